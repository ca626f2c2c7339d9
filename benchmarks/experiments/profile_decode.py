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
    parser.add_argument("--in-registers", action="store_true",
                        help="fp8 pools: the table's tile with K and V converted in registers (DecodeConfig.fp8_in_registers)")
    parser.add_argument("--split-waves", action="store_true",
                        help="split counts by waves of the fp8 tile's resident programs (tuning.decode_split_waves)")
    args = parser.parse_args(argv)

    import dataclasses

    import jax

    from jaxattn import bench, decode, metadata, tuning

    case = bench.CASES[args.case]
    inp = bench.make_inputs(case)
    scales = bench.peers.scales(inp)
    waves = tuning.decode_split_waves(case.head_dim, case.dv, case.q_heads, case.kv_heads) if args.split_waves else None
    meta = metadata.decode_metadata_from_indptr(inp.kv_indptr, inp.kv_indices, inp.seq_lens,
                                                q_heads=case.q_heads, kv_heads=case.kv_heads, split_waves=waves)
    config = None
    if args.in_registers:
        config = tuning.decode_config(case.head_dim, case.dv, case.q_heads // case.kv_heads, fp8_pool=True)
        config = dataclasses.replace(config, fp8_in_registers=True)
    fn = jax.jit(lambda q, k, v, m: decode.decode_attention(q, k, v, m, config=config, **scales))
    for _ in range(args.calls):
        out = fn(inp.q, inp.k_pool, inp.v_pool, meta)
    jax.block_until_ready(out)
    print(args.case, "done", out.shape, out.dtype, "splits", sorted(set(map(int, meta.num_kv_splits))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
