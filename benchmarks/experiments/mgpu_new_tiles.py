"""Experiment (H200): the Mosaic GPU extend kernel's new-key tiles by TMA (the default where tokens % 8 == 0) or all
K/V tiles by cp.async (what odd token counts get), on E1-E3, in interleaved rounds; outputs compared first.
Writes $OUT/mgpu_new_tiles.json. Usage: python benchmarks/experiments/mgpu_new_tiles.py [E1 E2 E3]
"""
import functools, json, os, statistics, sys
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import jax
import numpy as np
from jaxattn import bench
from jaxattn.extend_mgpu import extend_attention_mgpu
from jaxattn.impl.mgpu_extend import kernel_options_forced

out_dir = os.environ.get("OUT", "/tmp")
rounds = int(os.environ.get("ROUNDS", "3"))
rows = []


def make(inp, tma):
    meta = bench.extend_meta(inp)
    # The undecorated wrapper: jit's trace cache would hand the second variant the first one's trace.
    fn = jax.jit(lambda q, kn, vn, k, v, m: extend_attention_mgpu.__wrapped__(q, kn, vn, k, v, m))
    with kernel_options_forced(lambda kw: dict(kw, tma_new_tiles=tma and kw["tma_new_tiles"])):
        compiled = fn.lower(inp.q, inp.k_new, inp.v_new, inp.k_pool, inp.v_pool, meta).compile()
    return functools.partial(compiled, inp.q, inp.k_new, inp.v_new, inp.k_pool, inp.v_pool, meta)


for name in sys.argv[1:] or ["E1", "E2", "E3"]:
    case = bench.CASES[name]
    inp = bench.make_inputs(case)
    fns = {"new tiles by TMA": make(inp, True), "all tiles by cp.async": make(inp, False)}
    outs = {k: np.asarray(f(), np.float32) for k, f in fns.items()}
    diff = float(np.max(np.abs(outs["new tiles by TMA"] - outs["all tiles by cp.async"])))
    samples = {k: [] for k in fns}
    for _ in range(rounds):
        for label, fn in fns.items():
            samples[label].append(bench.time_calls(fn, bench.jax_sync, repeats=5))
    for label, s in samples.items():
        ms = statistics.median(s)
        rows.append(dict(case=name, variant=label, median_ms=round(ms, 4), fraction=round(case.floor_ms() / ms, 3),
                         rounds=[round(x, 4) for x in s], max_abs_diff_between_variants=diff))
        print(f"{name} {label:24s} {ms:8.3f} ms  {100 * case.floor_ms() / ms:5.1f}% of floor  (max |diff| {diff:.3g})", flush=True)
    del inp, fns, outs
    json.dump(rows, open(os.path.join(out_dir, "mgpu_new_tiles.json"), "w"), indent=1)
