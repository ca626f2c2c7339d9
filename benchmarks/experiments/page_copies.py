"""Experiment (H200): the Mosaic GPU extend kernel over lists of whole pages, prefix tiles copied page by page by TMA
(meta.page_size = P) against row by row by cp.async (the same lists, page_size 1), both forms, in interleaved rounds;
outputs compared first (they must be bitwise equal). Writes $OUT/page_copies.json.
Usage: python benchmarks/experiments/page_copies.py [--cases E1,E3] [--page-sizes 8,16,64]
"""
import argparse
import dataclasses
import functools
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import jax  # noqa: E402
import numpy as np  # noqa: E402

from variant_timing import write_record  # noqa: E402  (this folder: the script's own directory)
from jaxattn import bench  # noqa: E402
from jaxattn.extend_mgpu import extend_attention_mgpu, extend_attention_unified_mgpu  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--cases", default="E1,E3")
parser.add_argument("--page-sizes", default="8,16,64")
parser.add_argument("--rounds", type=int, default=3)
args = parser.parse_args()
rows = []
for name in args.cases.split(","):
    for page_size in map(int, args.page_sizes.split(",")):
        case = bench.paged_case(bench.CASES[name], page_size)
        inp = bench.make_inputs(case)
        fns = {}
        for form in ("two-stage", "unified"):
            meta = bench.extend_meta(inp, unified=form == "unified")
            assert meta.page_size == page_size, meta.page_size
            for copies, m in (("pages", meta), ("rows", dataclasses.replace(meta, page_size=1))):
                if form == "unified":
                    f = jax.jit(extend_attention_unified_mgpu)
                    fns[(form, copies)] = functools.partial(f, inp.q, inp.k_pool, inp.v_pool, m)
                else:
                    f = jax.jit(extend_attention_mgpu)
                    fns[(form, copies)] = functools.partial(f, inp.q, inp.k_new, inp.v_new, inp.k_pool, inp.v_pool, m)
        for form in ("two-stage", "unified"):
            same = np.array_equal(np.asarray(fns[(form, "pages")](), np.float32), np.asarray(fns[(form, "rows")](), np.float32))
            print(f"{case.name} {form}: pages bitwise equal to rows: {same}", flush=True)
        samples = {k: [] for k in fns}
        for _ in range(args.rounds):
            for key, fn in fns.items():
                samples[key].append(bench.time_calls(fn, bench.jax_sync, repeats=5))
        for (form, copies), s in samples.items():
            ms = statistics.median(s)
            rows.append(dict(case=case.name, form=form, copies=copies, ms=round(ms, 4), floor_ms=case.floor_ms(),
                             rounds=[round(x, 4) for x in s]))
            print(f"{case.name:7s} {form:9s} {copies:5s} {ms:8.4f} ms  {100 * case.floor_ms() / ms:5.1f}% of floor", flush=True)
        del inp, fns
write_record(os.path.join(os.environ.get("OUT", "/tmp"), "page_copies.json"), rows)
