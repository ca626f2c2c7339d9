"""Experiment (H200): the Mosaic GPU extend kernel over lists of whole pages, prefix tiles copied by TMA page by page
against row by row by cp.async (the same lists), both forms, in interleaved rounds; outputs compared first (they must
be bitwise equal). The page copies are forced on at every page size (below the tuned rule too), issued two ways:
"pallas" (one Pallas copy per page, each with a warpgroup barrier and an arrival on its own barrier: the product's)
and "inline" (one thread issues a tile's copies on the row-copy mbarrier: experimental).
Writes $OUT/page_copies.json. Usage: python benchmarks/experiments/page_copies.py [--cases E1,E3] [--page-sizes 8,16,64]
[--issues pallas,inline]
"""
import argparse
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
from jaxattn.impl.mgpu_extend import kernel_options_forced  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--cases", default="E1,E3")
parser.add_argument("--page-sizes", default="8,16,64")
parser.add_argument("--issues", default="pallas,inline", help="page-copy issues to time beside row copies")
parser.add_argument("--rounds", type=int, default=3)
args = parser.parse_args()


def compiled(fn, operands, page_size, copies):
    """fn(*operands) compiled with the kernel's page copies forced: "rows" (none) or a page issue."""
    def forced(kw):
        pages = 0 if copies == "rows" else min(page_size, kw["block_kv"])
        return dict(kw, page_rows=pages, page_issue="pallas" if copies == "rows" else copies)

    with kernel_options_forced(forced):  # (it clears JAX's caches: each variant is traced anew)
        return functools.partial(jax.jit(fn.__wrapped__).lower(*operands).compile(), *operands)


rows = []
for name in args.cases.split(","):
    for page_size in map(int, args.page_sizes.split(",")):
        case = bench.paged_case(bench.CASES[name], page_size)
        inp = bench.make_inputs(case)
        fns = {}
        for form in ("two-stage", "unified"):
            meta = bench.extend_meta(inp, unified=form == "unified")
            assert meta.page_size == page_size, meta.page_size
            if form == "unified":
                fn, operands = extend_attention_unified_mgpu, (inp.q, inp.k_pool, inp.v_pool, meta)
            else:
                fn, operands = extend_attention_mgpu, (inp.q, inp.k_new, inp.v_new, inp.k_pool, inp.v_pool, meta)
            for copies in ["rows", *args.issues.split(",")]:
                try:
                    fns[(form, copies)] = compiled(fn, operands, page_size, copies)
                except Exception as error:  # noqa: BLE001  (a variant that fails must not hide the others)
                    print(f"{case.name} {form} {copies} FAILED {type(error).__name__}: {error}"[:400], flush=True)
        outputs = {key: np.asarray(f(), np.float32) for key, f in fns.items()}
        for form, copies in outputs:
            if copies != "rows" and (form, "rows") in outputs:
                same = np.array_equal(outputs[(form, copies)], outputs[(form, "rows")])
                print(f"{case.name} {form} {copies}: bitwise equal to rows: {same}", flush=True)
        samples = {k: [] for k in fns}
        for _ in range(args.rounds):
            for key, fn in fns.items():
                samples[key].append(bench.time_calls(fn, bench.jax_sync, repeats=5))
        for (form, copies), s in samples.items():
            ms = statistics.median(s)
            rows.append(dict(case=case.name, form=form, copies=copies, ms=round(ms, 4), floor_ms=case.floor_ms(),
                             rounds=[round(x, 4) for x in s]))
            print(f"{case.name:7s} {form:9s} {copies:6s} {ms:8.4f} ms  {100 * case.floor_ms() / ms:5.1f}% of floor", flush=True)
        del inp, fns, outputs
write_record(os.path.join(os.environ.get("OUT", "/tmp"), "page_copies.json"), rows)
