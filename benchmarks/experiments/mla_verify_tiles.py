"""MLA verify (16 heads x 4 query tokens over the 576/512 latent head) at tiles the bench's sweep did not try, one GPU run.

The eighth session's sweep (94212e2): 16-row tiles read the latent cache once per token (0.40 ms), the 32-row 8-warp
tile 0.60 ms, 64-row wgmma tiles 0.31-0.38 ms (one CTA per SM), MLA decode itself 0.122 ms. This asks whether 32-row
tiles on 4 warps (two reads of the cache, mma.sync, smaller shared memory) or more programs per SM do better.

    python benchmarks/experiments/mla_verify_tiles.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="MLA-V4")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from jaxattn import bench
    from jaxattn.bench.peers import decode_jaxattn
    from jaxattn.bench.timing import jax_sync, time_calls
    from jaxattn.tuning import DecodeConfig

    case = bench.CASES[args.case]
    inp = bench.make_inputs(case)
    variants = [("table", None, None)]
    for block_h, warps, block_n, stages in ((32, 4, 32, 2), (32, 4, 16, 3), (32, 4, 64, 2), (16, 4, 32, 2),
                                            (64, 8, 32, 3), (64, 8, 16, 4)):
        config = DecodeConfig(block_n=block_n, block_h=block_h, num_warps=warps, num_stages=stages)
        for pps in (None, 2):
            variants.append((f"h{block_h} w{warps} n{block_n} s{stages}" + (f" pps{pps}" if pps else ""), config, pps))
    rows = []
    for label, config, pps in variants:
        try:
            ms = time_calls(decode_jaxattn(inp, config=config, programs_per_sm=pps), jax_sync)
        except Exception as error:  # a tile that does not build: say so, keep going
            print(f"{label}: FAILED {type(error).__name__}: {str(error)[:200]}", flush=True)
            continue
        rows.append(dict(case=case.name, variant=label, median_ms=ms, floor_ms=case.floor_ms(),
                         fraction_of_floor=case.floor_ms() / ms, commit=bench.commit()))
        print(f"{label:32s} {ms:.4f} ms  {case.floor_ms() / ms:6.1%} of floor", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
