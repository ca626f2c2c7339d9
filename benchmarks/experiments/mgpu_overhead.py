"""Experiment (H200; written 2026-12-03, not yet run): where the Mosaic GPU extend path's time goes beside its kernel.

Timing a small XLA op alone measures the host's dispatch, not the GPU, so every variant here is the attention kernel
plus some of the wrapper's work, each GPU-bound: (a) the kernel alone on a prefix gathered beforehand, (b) + the prefix
gather (Triton kernel, a few tile shapes), (c) the whole `extend_attention_mgpu` call. (b) - (a) is the gather's GPU
time, (c) - (b) the rest (layout, zeroed output, V padding rows). Outputs of (a)-(c) are compared with each other.
Writes $OUT/mgpu_overhead.json. Usage: python benchmarks/experiments/mgpu_overhead.py [E3 E1 E2]
"""
import json, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import jax, jax.numpy as jnp
import numpy as np
from jaxattn import bench
from jaxattn.extend_mgpu import MgpuExtendConfig, aligned_prefix_layout, extend_attention_mgpu, gather_prefix
from jaxattn.kernels.extend_attention_mgpu import extend_attention_mgpu_kernel

out_dir = os.environ.get("OUT", "/tmp")
config = MgpuExtendConfig()
rows = []
for name in sys.argv[1:] or ["E3", "E1", "E2"]:
    case = bench.CASES[name]
    inp = bench.make_inputs(case)
    meta = bench.extend_meta(inp)
    start, source = jax.jit(lambda m: aligned_prefix_layout(m, config.block_kv))(meta)
    needed = jnp.minimum(start[-1] + config.block_kv, source.shape[0])
    k_pre, v_pre = jax.jit(gather_prefix)(inp.k_pool, inp.v_pool, meta.kv_indices, source, needed)
    scale = case.head_dim ** -0.5

    def attend(q, kn, vn, kp, vp, qo, st, kvp):
        out = jax.new_ref(jnp.zeros(q.shape, q.dtype))
        extend_attention_mgpu_kernel(q, kn, vn, kp, vp, qo, st, kvp, out, max_extend_len=case.new, sm_scale=scale,
                                     block_q=config.block_q, block_kv=config.block_kv, stages=config.stages)
        return out[...]

    common = (meta.qo_indptr, start, meta.kv_indptr)
    variants = {"(a) kernel alone": (jax.jit(attend), (inp.q, inp.k_new, inp.v_new, k_pre, v_pre) + common)}
    for block_rows, warps in ((16, 4), (32, 4), (64, 8)):
        def gathered(q, kn, vn, kpool, vpool, idx, src, n, qo, st, kvp, br=block_rows, w=warps):
            kp, vp = gather_prefix(kpool, vpool, idx, src, n, block_rows=br, num_warps=w)
            return attend(q, kn, vn, kp, vp, qo, st, kvp)
        variants[f"(b) + gather rows{block_rows} w{warps}"] = (
            jax.jit(gathered), (inp.q, inp.k_new, inp.v_new, inp.k_pool, inp.v_pool, meta.kv_indices, source, needed) + common)
    variants["(c) whole call"] = (jax.jit(extend_attention_mgpu), (inp.q, inp.k_new, inp.v_new, inp.k_pool, inp.v_pool, meta))
    first = None
    for label, (fn, args) in variants.items():
        try:
            out = np.asarray(fn(*args), np.float32)
            first = out if first is None else first
            diff = float(np.max(np.abs(out - first)))
            ms = bench.time_calls(lambda fn=fn, args=args: fn(*args), bench._jax_sync, repeats=5)
        except Exception as e:
            print(f"{name} {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        rows.append(dict(case=name, variant=label, median_ms=round(ms, 4), max_abs_diff_from_a=diff))
        print(f"{name} {label:28s} {ms:8.4f} ms  max|diff| vs (a) {diff:.3g}", flush=True)
    json.dump(rows, open(os.path.join(out_dir, "mgpu_overhead.json"), "w"), indent=1)
