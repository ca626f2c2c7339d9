"""How much of the fp8 kernels' time is the in-place conversion (issue 26): `python -m jaxattn.bench` with the
conversion steps replaced. FP8_STEPS=none (the default) removes them (`fp8_conversion_steps` -> none: the producer
still copies each tile, waits for its copies, syncs and releases it; the consumers read unconverted bytes, so the
outputs are wrong and only the times mean anything); FP8_STEPS=rounds converts in rounds of `fp8_round_rows` only,
a sync in each (the form before the halving phases; correct outputs); FP8_STEPS=phases keeps the kernel's steps (for
FP8_PHASE_GROUP alone). FP8_PHASE_GROUP=n loads n positions' chunks of each tile before storing them in a phase
(`extend_attention_mgpu.FP8_PHASE_GROUP`, 1 by default; correct outputs, more producer registers);
FP8_REGISTERS=c,p sets the two-consumer kernels' registers per thread (consumer, producer; 232,40 by default: the
producer's 40 hold few loads in flight). Run it beside the
real rows in one device call: the difference is what the conversion, or its phases, cost on the critical path.

Usage: [FP8_STEPS=none|rounds|phases] [FP8_PHASE_GROUP=n] [FP8_REGISTERS=c,p] \
    python benchmarks/experiments/fp8_conversion_cost.py <jaxattn.bench arguments>
"""
import os
import sys

from jaxattn.bench.cli import main
from jaxattn.kernels import extend_attention_mgpu


def rounds_only(block_kv, head_dim):
    rows = extend_attention_mgpu.fp8_round_rows(head_dim)
    return tuple((row, rows, True) for row in range(0, block_kv, rows))


STEPS = {"none": lambda block_kv, head_dim: (), "rounds": rounds_only,
         "phases": extend_attention_mgpu.fp8_conversion_steps}
# The MLA kernel converts with the same functions.
extend_attention_mgpu.fp8_conversion_steps = STEPS[os.environ.get("FP8_STEPS", "none")]
if "FP8_REGISTERS" in os.environ:
    extend_attention_mgpu.REGISTERS[2] = tuple(int(n) for n in os.environ["FP8_REGISTERS"].split(","))
extend_attention_mgpu.FP8_PHASE_GROUP = int(os.environ.get("FP8_PHASE_GROUP", extend_attention_mgpu.FP8_PHASE_GROUP))

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
