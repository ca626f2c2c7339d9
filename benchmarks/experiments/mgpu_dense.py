"""Experiment (H200): what a warp-specialised Hopper kernel reachable from JAX does on E2's dense shape.

JAX ships a FlashAttention-3-style Pallas Mosaic GPU kernel (jax.experimental.pallas.ops.gpu.attention_mgpu: TMA
loads, a producer warpgroup, two consumer warpgroups, wgmma). Timed on E2 (batch 4 x 4096, 32 q / 8 kv heads, d 128,
causal) beside cuDNN and jaxattn's Triton kernel, to size the gap that warp specialisation closes. It takes fp16
(its shared-memory scratch is declared fp16), dense equal-length sequences and no paged prefix, so it is a data
point, not a backend. Writes $OUT/mgpu_dense.json.
"""
import json, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import jax, jax.numpy as jnp, numpy as np
from jaxattn import bench

out_dir = os.environ.get("OUT", "/tmp")
case = bench.CASES["E2"]
b, n, hq, hkv, d = case.batch, case.new, case.q_heads, case.kv_heads, case.head_dim
kq, kk, kv = jax.random.split(jax.random.key(0), 3)
rows = []


def record(label, fn, ref=None):
    try:
        out = jax.block_until_ready(fn())
        err = None if ref is None else float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
        ms = bench.time_calls(fn, bench.jax_sync)
        rows.append(dict(case="E2", backend=label, median_ms=round(ms, 4), floor_ms=round(case.floor_ms(), 4),
                         fraction_of_floor=round(case.floor_ms() / ms, 3), max_abs_err=err))
        print(f"E2 {label:40s} {ms:8.3f} ms  {100 * case.floor_ms() / ms:5.1f}% of floor  max|err| {err}", flush=True)
    except Exception as e:
        print(f"E2 {label}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)


for dtype in (jnp.float16,):  # bf16: its scratch is declared fp16 (dtype mismatch)
    q = jax.random.normal(kq, (b, n, hq, d), dtype)
    k = jax.random.normal(kk, (b, n, hkv, d), dtype)
    v = jax.random.normal(kv, (b, n, hkv, d), dtype)
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    ref = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), is_causal=True))(q, k, v)
    name = jnp.dtype(dtype).name
    record(f"cudnn {name}", lambda: cudnn(q, k, v), ref)
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu
    except Exception as e:
        print(f"attention_mgpu import FAILED {type(e).__name__}: {e}")
        break
    for block_q, block_kv, steps in ((64, 128, 2), (64, 64, 3), (64, 128, 3)):
        config = mgpu.TuningConfig(block_q=block_q, block_kv=block_kv, max_concurrent_steps=steps, causal=True)
        # The kernel applies no softmax scale (its own test omits it too): scale q by 1/sqrt(d) first, in the jit.
        fn = jax.jit(lambda q, k, v, c=config: mgpu.attention((q * d**-0.5).astype(q.dtype), k, v, c))
        record(f"pallas mosaic-gpu fa3 {name} q{block_q} kv{block_kv} s{steps}", lambda fn=fn: fn(q, k, v), ref)
json.dump(rows, open(os.path.join(out_dir, "mgpu_dense.json"), "w"), indent=1)
