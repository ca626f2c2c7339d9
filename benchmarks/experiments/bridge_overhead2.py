"""Experiment (H200, FlashInfer): the decode bridge's host cost by component, and per call in a multi-layer jit.

Run from the repository root on the GPU machine: python benchmarks/experiments/bridge_overhead2.py D1
Result of 2026-12-02: benchmarks/results/2026-12-02_h200_bridge_overhead.log.
"""
import os, sys, time, statistics
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import jax, jax.numpy as jnp, numpy as np
import torch, flashinfer
from jax.experimental.buffer_callback import buffer_callback
from jaxattn import bench

case = bench.CASES[sys.argv[1] if len(sys.argv) > 1 else "D1"]
inp = bench.make_inputs(case)
torch_, tv = bench._torch_views(inp)
ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=False)
w.plan(tv["kv_indptr"], tv["kv_indices"], torch.ones(case.batch, dtype=torch.int32, device="cuda"), case.q_heads, case.kv_heads,
       case.head_dim, 1, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
k, v, q = tv["k_pool"].unsqueeze(1), tv["v_pool"].unsqueeze(1), tv["q"]
shapes = (jax.ShapeDtypeStruct((q.shape[0], q.shape[1], case.dv), jnp.bfloat16), jax.ShapeDtypeStruct((q.shape[0], q.shape[1]), jnp.float32))
stats = {}
def tick(name, t0):
    t = time.perf_counter(); s = stats.setdefault(name, [0, 0.0]); s[0] += 1; s[1] += t - t0; return t
streams = {}
def stream_of(ctx):
    s = streams.get(ctx.stream)
    if s is None:
        s = streams[ctx.stream] = torch.cuda.ExternalStream(ctx.stream)
    return s

def cb_dlpack(ctx, outputs, q_buf, k_buf, v_buf):
    t = time.perf_counter()
    s = stream_of(ctx)
    with torch.cuda.stream(s):
        t = tick("dlpack: stream ctx", t)
        tq, tk, tv_, to, tl_ = (torch.from_dlpack(b) for b in (q_buf, k_buf, v_buf, outputs[0], outputs[1]))
        t = tick("dlpack: 5 x from_dlpack", t)
        w.run(tq, (tk.unsqueeze(1), tv_.unsqueeze(1)), out=to, lse=tl_, return_lse=True)
        t = tick("dlpack: wrapper.run", t)

def layered(cb, layers, side_effect):
    def f(q, k, v):
        outs = []
        for i in range(layers):
            outs.append(buffer_callback(cb, shapes, has_side_effect=side_effect)(q, k, v)[0])
        return outs
    return jax.jit(f)

variants = {
    "torch run(out=, lse=)": (lambda: w.run(q, (k, v), out=torch.empty_like(q), lse=torch.empty(q.shape[:2], device="cuda"), return_lse=True), bench._torch_sync, 1),
    "jit 1 call, dlpack": (lambda f=layered(cb_dlpack, 1, False): f(inp.q, inp.k_pool, inp.v_pool), bench._jax_sync, 1),
    "jit 8 calls (side effect), dlpack": (lambda f=layered(cb_dlpack, 8, True): f(inp.q, inp.k_pool, inp.v_pool), bench._jax_sync, 8),
}
ref = w.run(q, (k, v)).float().cpu().numpy()
got = np.asarray(variants["jit 8 calls (side effect), dlpack"][0]()[7], np.float32)
print("8-call jit, last call max|diff| vs torch:", float(np.max(np.abs(got - ref))))
samples = {k_: [] for k_ in variants}
for rnd in range(2):
    for name, (fn, sync, per) in variants.items():
        samples[name].append(bench.time_calls(fn, sync, repeats=5) / per)
for name, s in samples.items():
    print(f"{case.name} {name:36s} {statistics.median(s)*1e3:8.1f} us   rounds {[round(x*1e3,1) for x in s]}", flush=True)
for name, (n, tot) in stats.items():
    print(f"host {name:28s} {tot / n * 1e6:7.1f} us/call over {n} calls")
