"""Experiment (H200): the Mosaic GPU extend kernel (jaxattn.extend_mgpu) beside the Triton two-stage kernel.

On E1-E3 (and T64 for 64-dim heads): every variant is checked against the jnp reference (worst |err| / bf16
tolerance) before timing, then timed in interleaved rounds. (Until 726e5bf the kernel read a gathered copy of the
prefix and this script also timed that copy's XLA side; `results/2026-12-03_h200_mgpu_overhead.log` measured it.)
Writes $OUT/mgpu_extend.json. Usage: python benchmarks/experiments/mgpu_extend.py [E1 E2 E3 T64]
"""
import json, os, statistics, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import numpy as np
from jaxattn import bench, testing
from jaxattn.extend_mgpu import MgpuExtendConfig

out_dir = os.environ.get("OUT", "/tmp")
rounds = int(os.environ.get("ROUNDS", "2"))
# (block_q, block_kv, stages); VARIANTS="64x128s2,64x64s4" picks others.
variants = [tuple(int(x) for x in v.replace("x", " ").replace("s", " ").split()) for v in os.environ.get("VARIANTS", "64x128s2").split(",")]
rows = []


for name in sys.argv[1:] or ["E1", "E2", "E3"]:
    case = bench.CASES[name]
    inp = bench.make_inputs(case)
    ref = np.asarray(bench.extend_reference(inp)(), np.float32)
    tol = testing.tolerance(inp.q.dtype)
    limit = tol["atol"] + tol["rtol"] * np.abs(ref)
    makers = {"triton two-stage": lambda: bench.extend_jaxattn(inp)}
    for bq, bkv, st in variants:
        makers[f"mgpu {bq}x{bkv} s{st}"] = lambda c=MgpuExtendConfig(bq, bkv, st): bench.extend_mgpu(inp, config=c)
    fns = {}
    for label, make in makers.items():
        try:
            t0 = time.time()
            fn = make()
            out = np.asarray(fn(), np.float32)
            worst = float(np.max(np.abs(out - ref) / limit))
            print(f"{name} {label}: compiled+ran in {time.time() - t0:.1f}s, worst |err|/tol {worst:.3f}", flush=True)
            if not worst <= 1.0:
                bad = np.argwhere(np.abs(out - ref) > limit)
                print(f"   {len(bad)} elements out of tolerance; first rows {np.unique(bad[:, 0])[:10]} heads {np.unique(bad[:, 1])[:8]}", flush=True)
                rows.append(dict(case=name, variant=label, error="tolerance", worst=worst, bad=len(bad)))
                continue
            fns[label] = (fn, worst)
        except Exception as e:
            print(f"{name} {label}: FAILED {type(e).__name__}: {str(e)[:1500]}", flush=True)
            rows.append(dict(case=name, variant=label, error=f"{type(e).__name__}: {str(e)[:300]}"))
    samples = {k: [] for k in fns}
    for _ in range(rounds):
        for label, (fn, _) in fns.items():
            samples[label].append(bench.time_calls(fn, bench.jax_sync, repeats=5))
    for label, s in samples.items():
        ms = statistics.median(s)
        rows.append(dict(case=name, variant=label, median_ms=round(ms, 4), floor_ms=round(case.floor_ms(), 4),
                         fraction=round(case.floor_ms() / ms, 3), rounds=[round(x, 4) for x in s], worst=fns[label][1]))
        print(f"{name} {label:34s} {ms:8.3f} ms  {100 * case.floor_ms() / ms:5.1f}% of floor", flush=True)
    del inp, ref, fns
    json.dump(rows, open(os.path.join(out_dir, "mgpu_extend.json"), "w"), indent=1)
