"""The Mosaic GPU GQA decode kernel's launch, ring depth and split bound (issues 26, 23), beside the Triton kernel,
one GPU run.

For each case (D1-D3, with fp8 and bf16 pools): jaxattn's default route, the Triton kernel, and the Mosaic GPU kernel
(its fp8 entry for fp8 pools; runs before 0052c73 named both "mgpu-gqa") with one CTA per work item ("items") or
persistent CTAs ("persistent"), at its rule's split bound and at twice and four times that bound
(`mgpu_decode.kernel_splits`; fp8 pools at the rule's bound only, swept before), at ring depths 2 and 3 with
`--stages` (default: the kernel's own depth); ms and % of the case's floor (its own: one byte per element for fp8).

    python benchmarks/experiments/gqa_decode_mgpu.py --cases D1-FP8,D2-FP8,D3-FP8,D1,D2,D3 --json out.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from variant_timing import time_variant, write_record  # noqa: E402  (this folder: the script's own directory)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="D1-FP8,D2-FP8,D3-FP8,D1,D2,D3")
    parser.add_argument("--json", default=None)
    parser.add_argument("--stages", action="store_true", help="also time ring depths 2 and 3")
    args = parser.parse_args(argv)

    from jaxattn import bench
    from jaxattn.impl import mgpu_decode
    from jaxattn.tuning import MgpuDecodeConfig

    rows = []
    for name in args.cases.split(","):
        case = bench.CASES[name]
        inp = bench.make_inputs(case)
        rule = mgpu_decode.kernel_splits(case.batch, case.kv_heads)
        variants = [("default route", dict(impl=None)), ("triton", dict(impl="triton"))]  # fp8: Triton is the default
        for persistent in (False, True):
            for splits in (rule,) if case.fp8 else (rule, 2 * rule, 4 * rule):
                for stages in (2, 3) if args.stages else (None,):  # 16-bit at 128 fits 2 only
                    launch = "persistent" if persistent else "items"
                    config = MgpuDecodeConfig(splits=splits, stages=stages, persistent=persistent)
                    variants.append((f"mgpu {launch} s{stages or 'default'} splits{splits}",
                                     dict(impl="mgpu-gqa-fp8" if case.fp8 else "mgpu-gqa", config=config)))
        for label, kw in variants:
            time_variant(rows, f"{name:7s} {label:45s}", bench.decode_jaxattn(inp, **kw), case, variant=label)
        write_record(args.json, rows)  # after each case: a run cut by its time box keeps the cases it finished
    return 0


if __name__ == "__main__":
    sys.exit(main())
