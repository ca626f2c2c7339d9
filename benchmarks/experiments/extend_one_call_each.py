"""Experiment, under Nsight Compute: one call of each named extend backend at a bench case and nothing else, so
`ncu -k regex:entry_mosaic_gpu_kernel --launch-count N` profiles exactly those kernels, in the order named. Several
(case, backends) pairs run one after the other: `E3 jaxattn E3-FP8 jaxattn-mgpu-fp8`.

Asked by the thirty-fourth session's timelines (benchmarks/RESULTS.md): where a prefix is cached, the two-stage
kernel (`jaxattn`) runs 3.5-4% longer than the unified one (`jaxattn-unified`) on the GPU's clock (E3, E3-P16, T64),
and 3.4% shorter without one (E2). Run from the repository root on the GPU machine (after installing the wheels):
    ncu --clock-control none --target-processes application-only -k regex:entry_mosaic_gpu_kernel --launch-count 2 \
        --section LaunchStats --section WarpStateStats --section InstructionStats \
        python benchmarks/experiments/extend_one_call_each.py E3 jaxattn,jaxattn-unified
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main():
    args = sys.argv[1:]
    if not args or len(args) % 2:
        raise SystemExit(__doc__)
    from jaxattn import bench

    for name, backends in zip(args[::2], args[1::2]):
        case = bench.case_named(name)
        if case is None:
            raise SystemExit(f"unknown case {name!r}: the names are {list(bench.CASES)}")
        inp = bench.make_inputs(case)
        for backend in backends.split(","):
            maker, sync = bench.BACKENDS["extend"][backend]
            sync(maker(inp)())  # compiles, then launches its kernels once
            print(f"{case.name} {backend}: one call", flush=True)


if __name__ == "__main__":
    main()
