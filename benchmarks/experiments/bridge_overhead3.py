"""Experiment (H200, FlashInfer), NOT RUN YET: DLPack handshake variants of the bridge callback, 8 calls per step, D1.

Hypothesis: torch.from_dlpack passes XLA's stream to the producer, which may synchronise; a capsule taken with
stream=-1 (no synchronisation, DLPack spec) or without a stream could remove the ~20 us per call the bridge costs.
"""
import os, sys, time, statistics
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import jax, jax.numpy as jnp, numpy as np
import torch, flashinfer
from torch.utils import dlpack as tdl
from jax.experimental.buffer_callback import buffer_callback
from jaxattn import bench

case = bench.CASES["D1"]
inp = bench.make_inputs(case)
_, tv = bench._torch_views(inp)
ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=False)
w.plan(tv["kv_indptr"], tv["kv_indices"], torch.ones(case.batch, dtype=torch.int32, device="cuda"), case.q_heads, case.kv_heads,
       case.head_dim, 1, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
k, v, q = tv["k_pool"].unsqueeze(1), tv["v_pool"].unsqueeze(1), tv["q"]
shapes = (jax.ShapeDtypeStruct((q.shape[0], q.shape[1], case.dv), jnp.bfloat16), jax.ShapeDtypeStruct((q.shape[0], q.shape[1]), jnp.float32))
streams = {}
def make_cb(convert, use_ctx=True):
    def cb(ctx, outputs, q_buf, k_buf, v_buf):
        s = streams.get(ctx.stream)
        if s is None:
            s = streams[ctx.stream] = torch.cuda.ExternalStream(ctx.stream)
        prev = torch.cuda.current_stream()
        torch.cuda.set_stream(s)
        try:
            tq, tk, tv_, to, tl_ = (convert(b) for b in (q_buf, k_buf, v_buf, outputs[0], outputs[1]))
            w.run(tq, (tk.unsqueeze(1), tv_.unsqueeze(1)), out=to, lse=tl_, return_lse=True)
        finally:
            torch.cuda.set_stream(prev)
    return cb
converters = {
    "torch.from_dlpack": torch.from_dlpack,
    "capsule, no stream": lambda b: tdl.from_dlpack(b.__dlpack__()),
    "capsule, stream=-1": lambda b: tdl.from_dlpack(b.__dlpack__(stream=-1)),
}
def layered(cb, layers=8):
    return jax.jit(lambda q, k, v: [buffer_callback(cb, shapes, has_side_effect=True)(q, k, v)[0] for _ in range(layers)])
ref = w.run(q, (k, v)).float().cpu().numpy()
variants = {"torch run": (lambda: w.run(q, (k, v)), bench._torch_sync)}
for name, conv in converters.items():
    f = layered(make_cb(conv))
    try:
        got = np.asarray(f(inp.q, inp.k_pool, inp.v_pool)[7], np.float32)
        print(name, "max|diff|", float(np.max(np.abs(got - ref))), flush=True)
        variants["jit x8: " + name] = (bench.PerCall(lambda f=f: f(inp.q, inp.k_pool, inp.v_pool), 8), bench._jax_sync)
    except Exception as e:
        print(name, "FAILED", type(e).__name__, str(e)[-300:], flush=True)
samples = {n: [] for n in variants}
for rnd in range(2):
    for n, (fn, sync) in variants.items():
        samples[n].append(bench.time_calls(fn, sync, repeats=5))
for n, s in samples.items():
    print(f"{n:32s} {statistics.median(s)*1e3:7.1f} us  {[round(x*1e3,1) for x in s]}", flush=True)
