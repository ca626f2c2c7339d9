"""Experiment (issue 26, fp8 MLA decode): runs `python -m jaxattn.bench ...` with the MLA transposed tile's fp8
producer in one order or the other (`kernels/mla_attention_mgpu.py`'s TRANSPOSED_FP8_COPIES_FIRST, read when the
kernel is traced): copies first (1, the default: tile t + 1's copies issued once its slot is released, then tile t
converted) or the conversion first (0). MLA-FP8 runs ~0.11 ms on the H100 and the H200 alike, so it is not bound by
HBM; which order wins says whether a step costs a load latency (one fp8 copy in flight an SM) or a conversion plus a
consumption (the conversion waiting for the slot), which decides how fp8 staging buffers should be laid out. One
order per process (traced kernels are cached): run both in one call.

    python3 benchmarks/experiments/mla_fp8_order.py 1 decode --cases MLA-FP8 --backends jaxattn --rounds 5
    python3 benchmarks/experiments/mla_fp8_order.py 0 decode --cases MLA-FP8 --backends jaxattn --rounds 5
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main():
    if len(sys.argv) < 3 or sys.argv[1] not in ("0", "1"):
        raise SystemExit(__doc__)
    from jaxattn.kernels import mla_attention_mgpu

    mla_attention_mgpu.TRANSPOSED_FP8_COPIES_FIRST = sys.argv[1] == "1"
    print(f"mla_fp8_order: copies first = {mla_attention_mgpu.TRANSPOSED_FP8_COPIES_FIRST}", flush=True)
    from jaxattn.bench.cli import main as bench

    sys.exit(bench(sys.argv[2:]))


if __name__ == "__main__":
    main()
