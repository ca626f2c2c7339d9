"""Experiment (H200, FlashInfer): the decode bridge's host cost by component, and per call in a multi-layer jit.

Run from the repository root on the GPU machine: python benchmarks/experiments/bridge_overhead.py D1
Result of 2026-12-02 (the torch.from_dlpack rows): benchmarks/results/2026-12-02_h200_bridge_overhead.log.
The "capsule" rows are NOT RUN YET. Hypothesis: torch.from_dlpack hands XLA's stream to the producer, which may
synchronise; a capsule taken with stream=-1 (DLPack: no synchronisation) or without a stream may remove the
~20 us per call the bridge costs (the callback already runs on XLA's stream, so no ordering is lost).
"""
import os, sys, time, statistics
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import jax, jax.numpy as jnp, numpy as np
import torch, flashinfer
from jax.experimental.buffer_callback import buffer_callback
from torch.utils import dlpack as torch_dlpack
from jaxattn import bench

case = bench.CASES[sys.argv[1] if len(sys.argv) > 1 else "D1"]
inp = bench.make_inputs(case)
torch_, tv = bench.torch_views(inp)
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

CONVERTERS = {
    "dlpack": torch.from_dlpack,  # what jaxattn.flashinfer_backend.bridged_run does
    "capsule, no stream": lambda b: torch_dlpack.from_dlpack(b.__dlpack__()),
    "capsule, stream=-1": lambda b: torch_dlpack.from_dlpack(b.__dlpack__(stream=-1)),
}


def make_callback(label):
    convert = CONVERTERS[label]

    def callback(ctx, outputs, q_buf, k_buf, v_buf):
        t = time.perf_counter()
        s = stream_of(ctx)
        with torch.cuda.stream(s):
            t = tick(f"{label}: stream ctx", t)
            tq, tk, tv_, to, tl_ = (convert(b) for b in (q_buf, k_buf, v_buf, outputs[0], outputs[1]))
            t = tick(f"{label}: 5 x convert", t)
            w.run(tq, (tk.unsqueeze(1), tv_.unsqueeze(1)), out=to, lse=tl_, return_lse=True)
            t = tick(f"{label}: wrapper.run", t)
    return callback

def layered(cb, layers, side_effect):
    def f(q, k, v):
        outs = []
        for i in range(layers):
            outs.append(buffer_callback(cb, shapes, has_side_effect=side_effect)(q, k, v)[0])
        return outs
    return jax.jit(f)

variants = {
    "torch run(out=, lse=)": (lambda: w.run(q, (k, v), out=torch.empty_like(q), lse=torch.empty(q.shape[:2], device="cuda"), return_lse=True), bench.torch_sync, 1),
    "jit 1 call, dlpack": (lambda f=layered(make_callback("dlpack"), 1, False): f(inp.q, inp.k_pool, inp.v_pool), bench.jax_sync, 1),
}
ref = w.run(q, (k, v)).float().cpu().numpy()
for label in CONVERTERS:
    f = layered(make_callback(label), 8, True)
    try:
        got = np.asarray(f(inp.q, inp.k_pool, inp.v_pool)[7], np.float32)
    except Exception as error:  # a handshake the producer refuses
        print(f"{label}: FAILED {type(error).__name__}: {str(error)[-300:]}")
        continue
    print(f"8 calls per step, {label}: last call max|diff| vs torch {float(np.max(np.abs(got - ref)))}")
    variants[f"jit 8 calls (side effect), {label}"] = (lambda f=f: f(inp.q, inp.k_pool, inp.v_pool), bench.jax_sync, 8)
samples = {k_: [] for k_ in variants}
for rnd in range(2):
    for name, (fn, sync, per) in variants.items():
        samples[name].append(bench.time_calls(fn, sync, repeats=5) / per)
for name, s in samples.items():
    print(f"{case.name} {name:36s} {statistics.median(s)*1e3:8.1f} us   rounds {[round(x*1e3,1) for x in s]}", flush=True)
for name, (n, tot) in stats.items():
    print(f"host {name:28s} {tot / n * 1e6:7.1f} us/call over {n} calls")
