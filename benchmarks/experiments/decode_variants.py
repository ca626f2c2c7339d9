"""Experiment (H200): decode configs and split bounds on D1-D3, interleaved rounds.

Result of 2026-12-02 (commit 85ae429): benchmarks/results/2026-12-02_h200_decode_variants.{json,log}.
"""
import json, os, sys, statistics
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import jax, numpy as np
from jaxattn import bench, decode
from jaxattn.decode import DecodeConfig as C

def make(inp, config=None, pps=None, max_splits=None):
    case = inp.case
    kw = {} if pps is None else dict(programs_per_sm=pps)
    if max_splits is not None:
        kw["max_kv_splits"] = max_splits
    meta = decode.decode_metadata_from_indptr(inp.kv_indptr, inp.kv_indices, inp.seq_lens, q_heads=case.q_heads, kv_heads=case.kv_heads, **kw)
    fn = jax.jit(lambda q, k, v, m: decode.decode_attention(q, k, v, m, config=config))
    return lambda: fn(inp.q, inp.k_pool, inp.v_pool, meta)

variants = {
    "default": dict(),
    "max_splits 1": dict(max_splits=1),
    "pps4": dict(pps=4),
    "pps16": dict(pps=16),
    "n64 w4 s3": dict(config=C(64, 16, 4, 3)),
    "n64 w4 s4": dict(config=C(64, 16, 4, 4)),
    "n32 w4 s4": dict(config=C(32, 16, 4, 4)),
    "n128 w4 s2": dict(config=C(128, 16, 4, 2)),
    "n128 w4 s4": dict(config=C(128, 16, 4, 4)),
}
rows = []
for cname in sys.argv[1:] or ["D1", "D2", "D3"]:
    case = bench.CASES[cname]
    inp = bench.make_inputs(case)
    fns = {k: make(inp, **kw) for k, kw in variants.items()}
    samples = {k: [] for k in fns}
    for rnd in range(5):
        for k, fn in fns.items():
            samples[k].append(bench.time_calls(fn, bench.jax_sync, repeats=5))
    for k, s in samples.items():
        ms = statistics.median(s)
        rows.append(dict(case=cname, variant=k, median_ms=ms, fraction=case.floor_ms() / ms))
        print(f"{cname} {k:14s} {ms:.4f} ms {100 * case.floor_ms() / ms:.1f}%  rounds {[round(x, 4) for x in s]}", flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "decode_variants.json"), "w"), indent=1)
