"""Experiment (H200): extend kernel variants on E1-E3, interleaved rounds, each checked against the reference.

"old" is the kernel before the FMA change: `git show 85ae429:kernels/extend_attention.py > kernels/extend_attention_old.py`
(delete it afterwards). Result of 2026-12-02: benchmarks/results/2026-12-02_h200_extend_variants.{json,log}.
"""
import json, os, sys, time, statistics
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import jax, jax.numpy as jnp, numpy as np
from jaxattn import bench, extend
from jaxattn.extend import ExtendConfig

orig_launch = extend.launch
out_dir = os.environ.get("OUT", "/tmp")
rows = []

def build(inp, module, config, unified):
    case = inp.case
    extend_lens = jnp.full((case.batch,), case.new, jnp.int32)
    sizes = dict(max_extend_len=case.new, kv_capacity=case.batch * (case.prefix + case.new))
    def patched(key, *a, **kw):
        return orig_launch((module, key[1]), *a, **kw)
    extend.launch = patched
    try:
        if unified:
            meta = extend.extend_unified_metadata(inp.req_to_token, inp.req_pool_indices, inp.prefix_lens, extend_lens, inp.new_slots, **sizes)
            fn = jax.jit(lambda q, k, v, m: extend.extend_attention_unified.__wrapped__(q, k, v, m, config=config))
            args = (inp.q, inp.k_pool, inp.v_pool, meta)
        else:
            meta = extend.extend_metadata(inp.req_to_token, inp.req_pool_indices, inp.prefix_lens, extend_lens, **sizes)
            fn = jax.jit(lambda q, kn, vn, k, v, m: extend.extend_attention.__wrapped__(q, kn, vn, k, v, m, config=config))
            args = (inp.q, inp.k_new, inp.v_new, inp.k_pool, inp.v_pool, meta)
        out = jax.block_until_ready(fn(*args))  # trace + compile with the patched launch
    finally:
        extend.launch = orig_launch
    return (lambda: fn(*args)), out

C = ExtendConfig
variants = [
    ("old 128x128 w8 s3", "extend_attention_old", C(128, 128, 8, 3), False),
    ("new 128x128 w8 s3", "extend_attention", C(128, 128, 8, 3), False),
    ("new 128x128 w8 s2", "extend_attention", C(128, 128, 8, 2), False),
    ("new 128x64 w8 s3", "extend_attention", C(128, 64, 8, 3), False),
    ("new 128x64 w8 s4", "extend_attention", C(128, 64, 8, 4), False),
    ("new 64x128 w4 s3", "extend_attention", C(64, 128, 4, 3), False),
    ("old unified 128x128 w8 s3", "extend_attention_old", C(128, 128, 8, 3), True),
    ("new unified 128x128 w8 s3", "extend_attention", C(128, 128, 8, 3), True),
    ("new unified 128x64 w8 s4", "extend_attention", C(128, 64, 8, 4), True),
]
cases = sys.argv[1:] or ["E1", "E2", "E3"]
for cname in cases:
    case = bench.CASES[cname]
    inp = bench.make_inputs(case)
    ref = np.asarray(bench.extend_reference(inp)(), np.float32)
    fns = {}
    for label, module, config, unified in variants:
        try:
            t0 = time.time()
            fn, out = build(inp, module, config, unified)
            err = float(np.max(np.abs(np.asarray(out, np.float32) - ref)))
            fns[label] = fn
            print(f"{cname} {label}: compiled in {time.time()-t0:.1f}s, max|err| {err:.4f}", flush=True)
        except Exception as e:
            print(f"{cname} {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    samples = {k: [] for k in fns}
    for rnd in range(3):  # interleaved rounds so clock drift hits every variant alike
        for label, fn in fns.items():
            samples[label].append(bench.time_calls(fn, bench.jax_sync, repeats=5))
    for label, s in samples.items():
        ms = statistics.median(s)
        row = dict(case=cname, variant=label, median_ms=ms, floor_ms=case.floor_ms(), fraction=case.floor_ms() / ms)
        rows.append(row)
        print(f"{cname} {label:30s} {ms:.4f} ms  {100*row['fraction']:.1f}% of floor  (rounds {', '.join(f'{x:.4f}' for x in s)})", flush=True)
    del inp, ref
json.dump(rows, open(os.path.join(out_dir, "extend_variants.json"), "w"), indent=1)
