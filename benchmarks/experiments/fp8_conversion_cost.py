"""How much of the fp8 kernels' time is the in-place conversion (issue 26): `python -m jaxattn.bench` with the
conversion rounds removed (`fp8_rounds` -> 0: the producer still copies each tile, waits for its copies, syncs and
releases it; the consumers read unconverted bytes, so the outputs are wrong and only the times mean anything). Run
it beside the real rows in one device call: the difference is what the conversion costs on the critical path.

Usage: python benchmarks/experiments/fp8_conversion_cost.py <jaxattn.bench arguments>
"""
import sys

from jaxattn.bench.cli import main
from jaxattn.kernels import extend_attention_mgpu

extend_attention_mgpu.fp8_rounds = lambda block_kv, head_dim: 0  # the MLA kernel converts with the same function

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
