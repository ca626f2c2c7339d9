"""Experiment (issue 22): how much of MLA decode's time at 64 x 4096 is per call and how much per byte.

On the H200 at fe6f0e3 MLA decode ran 0.086 ms at 64 x 4096 (82% of the floor, 85% wanted) and 0.286 ms at
128 x 8192 (98%), beside FlashInfer's MLA wrapper at 80% / 91%. This times both at 64 sequences x L keys for several
L (16 heads, the 576/512 latent head, bf16, slots scattered: the bench's MLA case but for L) and fits
ms = fixed + bytes / rate for each: `fixed` is what a call costs whatever its keys (launches, the XLA memset of the
merge's semaphores, pipeline fill, the merge, the epilogue), `rate` the streaming rate, beside the card's copy rate
(the floor's). 85% at 64 x 4096 needs fixed <= floor / 0.85 - bytes / rate; the printout says how far off that is.
A second fit leaves out the lengths below --fit-from: at 64 x 512 keys a call's kernel (about 16 us) is shorter than
the host's dispatch of one jitted call (about 29 us on the H200 host), which then sets the row's time (at a56875d 64 x
512 timed 0.037 ms, slower than 64 x 1024's 0.033) and inflates the fixed cost of the fit through every length.

    python benchmarks/experiments/mla_fixed_cost.py --lengths 512,1024,2048,4096,8192 --json $OUT/mla_fixed_cost.json
"""

import argparse
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def mla_case(batch: int, length: int):
    """The bench's MLA case at `batch` sequences x `length` keys (16 heads over the 576/512 latent head), named
    MLA-<batch>x<length>."""
    from jaxattn import bench

    return bench.Case(f"MLA-{batch}x{length}", "decode", batch, length - 1, 1, q_heads=16, kv_heads=1, head_dim=576,
                      v_head_dim=512)


def mla_case_named(name: str):
    """`mla_case` from its name ("MLA-64x512"), or None when the name is not of that form."""
    match = re.fullmatch(r"MLA-(\d+)x(\d+)", name)
    return mla_case(int(match[1]), int(match[2])) if match else None


def fit_fixed_and_rate(nbytes, ms):
    """Least squares of ms = fixed + nbytes / rate: (fixed ms, rate in bytes per second)."""
    slope, fixed = np.polyfit(np.asarray(nbytes, float), np.asarray(ms, float), 1)  # slope: ms per byte
    return float(fixed), float(1e3 / slope)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192", help="keys per sequence")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--backends", default="jaxattn,flashinfer-mla")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fit-from", type=int, default=1024, help="the second fit's shortest length")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from jaxattn import bench
    from jaxattn.bench.cases import ceilings_for
    from variant_timing import write_record

    lengths = [int(x) for x in args.lengths.split(",")]
    cases = [mla_case(args.batch, length) for length in lengths]
    rows = bench.run("decode", cases, backends=args.backends.split(","), log=print, progress=False,
                     rounds=args.rounds)
    copy_rate = ceilings_for(bench.device_name())[1].copy_bytes_per_s
    nbytes = {case.name: args.batch * length * 576 * 2 for case, length in zip(cases, lengths)}
    target = bench.Case("MLA", "decode", 64, 4095, 1, q_heads=16, kv_heads=1, head_dim=576, v_head_dim=512)
    target_bytes = 64 * 4096 * 576 * 2
    length_of = {case.name: length for case, length in zip(cases, lengths)}
    fits = []
    for backend in args.backends.split(","):
        timed = [r for r in rows if r["backend"] == backend and r.get("median_ms")]
        for shortest in sorted({lengths[0], args.fit_from}):
            mine = [r for r in timed if length_of[r["case"]] >= shortest]
            if len(mine) < 2:
                print(f"{backend}: fewer than two lengths from {shortest} timed, no fit")
                continue
            fixed, rate = fit_fixed_and_rate([nbytes[r["case"]] for r in mine], [r["median_ms"] for r in mine])
            allowed = target.floor_ms() / 0.85 - target_bytes / rate * 1e3  # the fixed cost 85% at 64 x 4096 allows
            fits.append(dict(backend=backend, from_length=shortest, fixed_us=round(fixed * 1e3, 2),
                             rate_tb_s=round(rate / 1e12, 3), copy_tb_s=round(copy_rate / 1e12, 3),
                             fixed_us_allowed_at_85=round(allowed * 1e3, 2)))
            print(f"{backend:16s} from {shortest:5d} keys: fixed {fixed * 1e3:6.1f} us a call, streaming "
                  f"{rate / 1e12:5.2f} TB/s ({100 * rate / copy_rate:5.1f}% of the copy rate); 85% at 64 x 4096 "
                  f"allows {allowed * 1e3:5.1f} us fixed")
    write_record(args.json, rows + [dict(case="fit", **fit) for fit in fits])


if __name__ == "__main__":
    main()
