"""A decode step to run under Nsight Compute (issue 26: what holds fp8 decode at ~72% of its floor).

Runs each named case's default `decode_attention` a few times (compile, warm-up, then the profiled calls), so
`ncu --kernel-name regex:decode_stage1 --launch-skip N --launch-count 1` catches one steady-state stage-1 launch:

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --kernel-name regex:decode_stage1 --launch-skip 2 --launch-count 1 \
        python benchmarks/experiments/profile_decode.py --case D1-FP8
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="D1-FP8")
    parser.add_argument("--calls", type=int, default=4)
    args = parser.parse_args(argv)

    import jax

    from jaxattn import bench, decode, metadata

    case = bench.CASES[args.case]
    inp = bench.make_inputs(case)
    scales = bench.peers.scales(inp)
    meta = metadata.decode_metadata_from_indptr(inp.kv_indptr, inp.kv_indices, inp.seq_lens,
                                                q_heads=case.q_heads, kv_heads=case.kv_heads)
    fn = jax.jit(lambda q, k, v, m: decode.decode_attention(q, k, v, m, **scales))
    for _ in range(args.calls):
        out = fn(inp.q, inp.k_pool, inp.v_pool, meta)
    jax.block_until_ready(out)
    print(args.case, "done", out.shape, out.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
