"""Experiment: runs `python -m jaxattn.bench ...` with every Triton kernel compiled under a register cap (Triton's
`maxnreg` option, which jax_triton's `triton_call` does not expose), so a tile's programs per multiprocessor can be
raised without a new kernel. Issue 26: the fp8 decode table tile (n64 w2 s6) takes 254 registers, so 4 programs (8
warps) fit an SM and the loop is issue-bound at low occupancy; capped at 200 it fits 5 with no spill (ptxas 13 for
sm_90 on a CPU, Triton 3.6: 0 spill bytes, 34.3 SASS instructions a key against 33.3).

One cap per process (jax_triton's kernel cache key has no maxnreg): time the baseline with cap 0 and the cap in two
runs of the same call, same arguments. The cap applies to every Triton kernel of the process (merge kernels too).

    python3 benchmarks/experiments/triton_maxnreg.py 0 decode --cases D1-FP8,D2-FP8,D3-FP8 --backends jaxattn --rounds 3
    python3 benchmarks/experiments/triton_maxnreg.py 200 decode --cases D1-FP8,D2-FP8,D3-FP8 --backends jaxattn --rounds 3
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def cap_registers(maxnreg: int) -> None:
    """Every Triton kernel compiled after this call takes `maxnreg` registers at most (0: no cap)."""
    if not maxnreg:
        return
    from triton.backends.nvidia import compiler

    parse_options = compiler.CUDABackend.parse_options

    def capped(self, options):
        return parse_options(self, {**options, "maxnreg": maxnreg})

    compiler.CUDABackend.parse_options = capped


def main():
    if len(sys.argv) < 3 or not sys.argv[1].isdigit():
        raise SystemExit(__doc__)
    maxnreg = int(sys.argv[1])
    cap_registers(maxnreg)
    print(f"triton_maxnreg: {maxnreg or 'no cap'}", flush=True)
    from jaxattn.bench.cli import main as bench

    sys.exit(bench(sys.argv[2:]))


if __name__ == "__main__":
    main()
