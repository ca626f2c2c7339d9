"""Where fp8 decode's time goes (issue 26): D1 with an fp8 pool against the bf16 pool, one GPU run.

The first H200 run (b45b5d5) read fp8 pools at 49.5% of their floor (0.252 ms at D1, bf16 0.273 ms). Two suspects:
the fp8 -> bf16 conversion (Triton converts e4m3 pairs to f16, then each f16 to bf16: 1.5 conversions per element),
and half as many bytes in flight per tile. This times, in one run: bf16 q over the bf16 pool; bf16 q over the fp8 pool;
f16 q over the fp8 pool (one conversion per two elements, no bf16 step); each at the table's tile and at longer key
tiles / more stages / more splits.

    python benchmarks/experiments/fp8_decode.py --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="D1-FP8")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jaxattn import bench, decode, metadata
    from jaxattn.bench.timing import jax_sync, time_calls

    fp8_case = bench.CASES[args.case]
    bf16_case = dataclasses.replace(fp8_case, kv_dtype="bfloat16")
    rows = []
    for case in (bf16_case, fp8_case):
        inp = bench.make_inputs(case)
        scales = bench.peers.scales(inp)
        for q_dtype in ((jnp.bfloat16,) if not case.fp8 else (jnp.bfloat16, jnp.float16)):
            q = inp.q.astype(q_dtype)
            for label, config, pps in (
                ("table", None, None),
                ("n128 w4 s4", decode.DecodeConfig(block_n=128, num_warps=4, num_stages=4), None),
                ("n256 w4 s3", decode.DecodeConfig(block_n=256, num_warps=4, num_stages=3), None),
                ("n256 w8 s3", decode.DecodeConfig(block_n=256, num_warps=8, num_stages=3), None),
                ("n64 w4 s4", decode.DecodeConfig(block_n=64, num_warps=4, num_stages=4), None),
                ("table pps16", None, 16),
            ):
                kw = {} if pps is None else dict(programs_per_sm=pps)
                meta = metadata.decode_metadata_from_indptr(inp.kv_indptr, inp.kv_indices, inp.seq_lens,
                                                            q_heads=case.q_heads, kv_heads=case.kv_heads, **kw)
                fn = jax.jit(lambda q, k, v, m, c=config: decode.decode_attention(q, k, v, m, config=c, **scales))
                try:
                    ms = time_calls(lambda: fn(q, inp.k_pool, inp.v_pool, meta), jax_sync)
                except Exception as error:  # noqa: BLE001  (a tile that does not fit must not hide the others)
                    print(f"{case.name:7s} q {jnp.dtype(q_dtype).name:8s} {label:12s} FAILED {type(error).__name__}: {error}"[:200])
                    continue
                floor = case.floor_ms()
                rows.append(dict(case=case.name, q_dtype=jnp.dtype(q_dtype).name, variant=label, ms=ms, floor_ms=floor))
                print(f"{case.name:7s} q {jnp.dtype(q_dtype).name:8s} {label:12s} {ms:.3f} ms  {100 * floor / ms:5.1f}% of its floor", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=bench.device_name(), commit=bench.commit(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
