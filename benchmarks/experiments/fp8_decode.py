"""Where fp8 decode's time goes (issue 26): D1 with an fp8 pool against the bf16 pool, one GPU run.

The first H200 run (b45b5d5) read fp8 pools at 49.5% of their floor (0.252 ms at D1, bf16 0.273 ms). Two suspects:
the fp8 -> bf16 conversion (Triton converts e4m3 pairs to f16, then each f16 to bf16: 1.5 conversions per element),
and half as many bytes in flight per tile. This times, in one run: bf16 q over the bf16 pool; bf16 q over the fp8 pool;
f16 q over the fp8 pool (one conversion per two elements, no bf16 step); each at the table's tile and at longer key
tiles / more stages / more splits.
The first run (1b60983, records in benchmarks/results/) found f16 q no faster than bf16 q once the dots ran in f16
(0.219 vs 0.222 ms, 56% of the floor): the conversion was a tenth of the gap. This version asks about bytes in flight
(--wide: stages, warps, splits) and about the scattered 128-byte row pieces (each case also over sorted slots).
Its answer (11e9d5a): neither the rows nor the bytes in flight; 2 warps helped (0.176 ms). The compiled kernel reads
the fp8 V operand from shared memory byte by byte; --in-registers times the tiles that convert K and V in registers.

    python benchmarks/experiments/fp8_decode.py --wide --in-registers --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from variant_timing import time_variant, write_record  # noqa: E402  (this folder: the script's own directory)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="D1-FP8")
    parser.add_argument("--json", default=None)
    parser.add_argument("--wide", action="store_true", help="also longer pipelines, other warps and splits")
    parser.add_argument("--in-registers", action="store_true", help="also DecodeConfig(fp8_in_registers=True) tiles")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jaxattn import bench, decode, metadata

    fp8_case = bench.CASES[args.case]
    bf16_case = dataclasses.replace(fp8_case, kv_dtype="bfloat16", name=fp8_case.name.replace("-FP8", ""))
    DC = decode.DecodeConfig
    # Second run (after 1b60983's f16 dots): does fp8 lack bytes in flight (more stages / warps), or do its 128-byte
    # scattered row pieces (one kv head of a slot) read slower than bf16's 256-byte ones (sorted slots: contiguous)?
    variants = [("table", None, None)]
    if args.wide:
        variants += [
            ("n64 w4 s6", DC(block_n=64, num_warps=4, num_stages=6), None),
            ("n128 w4 s6", DC(block_n=128, num_warps=4, num_stages=6), None),
            ("n64 w2 s6", DC(block_n=64, num_warps=2, num_stages=6), None),
            ("n32 w2 s8", DC(block_n=32, num_warps=2, num_stages=8), None),
            ("n128 w8 s4", DC(block_n=128, num_warps=8, num_stages=4), None),
            ("n64 w4 s4 pps16", DC(block_n=64, num_warps=4, num_stages=4), 16),
        ]
    if args.in_registers:  # third question: K and V converted in registers (no byte-wise shared-memory reads of V)
        variants += [(f"{label} inreg", DC(block_n=n, num_warps=w, num_stages=st, fp8_in_registers=True), None)
                     for label, n, w, st in (("n64 w2 s6", 64, 2, 6), ("n64 w4 s4", 64, 4, 4), ("n128 w4 s3", 128, 4, 3),
                                             ("n128 w4 s4", 128, 4, 4), ("n128 w8 s3", 128, 8, 3))]
    rows = []
    for case in (bf16_case, fp8_case):
        inp = bench.make_inputs(case)
        scales = bench.peers.scales(inp)
        for slots in ("scattered", "sorted"):
            kv_indices = inp.kv_indices if slots == "scattered" else jnp.sort(inp.kv_indices)
            # bf16 pools: the table and the 16-bit tiles over sorted slots (the inreg tiles only change fp8 pools).
            mine = variants if case.fp8 else [v for v in variants if "inreg" not in v[0]] if slots == "sorted" else variants[:1]
            for label, config, pps in mine:
                kw = {} if pps is None else dict(programs_per_sm=pps)
                meta = metadata.decode_metadata_from_indptr(inp.kv_indptr, kv_indices, inp.seq_lens,
                                                            q_heads=case.q_heads, kv_heads=case.kv_heads, **kw)
                fn = jax.jit(lambda q, k, v, m, c=config: decode.decode_attention(q, k, v, m, config=c, **scales))
                time_variant(rows, f"{case.name:7s} {slots:9s} {label:16s}",
                             lambda: fn(inp.q, inp.k_pool, inp.v_pool, meta), case, slots=slots, variant=label)
    write_record(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
