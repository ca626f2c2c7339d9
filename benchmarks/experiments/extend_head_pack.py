"""Experiment (H200): GQA head packing in the extend kernels (ExtendConfig.head_pack), on E1-E3 and T64.

head_pack q heads of one KV head share a program (block_m rows = head_pack heads x block_m / head_pack tokens), so
each K/V tile loaded serves head_pack heads instead of one. Same tiles otherwise; every variant is checked against
the jnp reference (worst |err| / bf16 tolerance) before timing; two interleaved rounds. Writes
$OUT/extend_head_pack.json. Usage: python benchmarks/experiments/extend_head_pack.py [E1 E2 E3 T64]
"""
import json, os, statistics, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import numpy as np
from jaxattn import bench, extend, testing
from jaxattn.extend import ExtendConfig

out_dir = os.environ.get("OUT", "/tmp")
rows = []
for name in sys.argv[1:] or ["E1", "E2", "E3", "T64"]:
    case = bench.CASES[name]
    base = extend.SM90_CONFIGS[extend.head_dim_family(case.head_dim, case.dv)]
    inp = bench.make_inputs(case)
    ref = np.asarray(bench.extend_reference(inp)(), np.float32)
    tol = testing.tolerance(inp.q.dtype)
    limit = tol["atol"] + tol["rtol"] * np.abs(ref)
    fns = {}
    for unified in (False, True):
        for pack in (1, 2, 4):
            config = ExtendConfig(base.block_m, base.block_n, base.num_warps, base.num_stages, head_pack=pack)
            label = f"{'unified' if unified else 'two-stage'} pack{pack}"
            try:
                t0 = time.time()
                fn = bench.extend_jaxattn(inp, config=config, unified=unified)
                worst = float(np.max(np.abs(np.asarray(fn(), np.float32) - ref) / limit))
                print(f"{name} {label}: compiled+ran in {time.time() - t0:.1f}s, worst |err|/tol {worst:.3f}", flush=True)
                if not worst <= 1.0:
                    rows.append(dict(case=name, variant=label, error="tolerance", worst=worst))
                    continue
                fns[label] = (fn, worst)
            except Exception as e:
                print(f"{name} {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    samples = {k: [] for k in fns}
    for _ in range(2):
        for label, (fn, _) in fns.items():
            samples[label].append(bench.time_calls(fn, bench.jax_sync, repeats=5))
    for label, s in samples.items():
        ms = statistics.median(s)
        rows.append(dict(case=name, variant=label, config=[base.block_m, base.block_n, base.num_warps, base.num_stages], median_ms=round(ms, 4),
                         floor_ms=round(case.floor_ms(), 4), fraction=round(case.floor_ms() / ms, 3), rounds=[round(x, 4) for x in s], worst=fns[label][1]))
        print(f"{name} {label:20s} {ms:8.3f} ms  {100 * case.floor_ms() / ms:5.1f}% of floor", flush=True)
    del inp, ref, fns
    json.dump(rows, open(os.path.join(out_dir, "extend_head_pack.json"), "w"), indent=1)
