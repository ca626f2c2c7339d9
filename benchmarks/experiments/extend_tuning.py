"""Experiment (H200): extend tile configs per head-dim family, on the tuning cases T64/T256/T192/T576 of jaxattn.bench.

Every candidate is checked against the jnp reference (max |err| within the bf16 tolerance) before it is timed, in two
interleaved rounds. Candidates come from `python -m jaxattn.aot`-style sm_90 compiles on CPU: configs that fit in
shared memory without large spills. The two-stage kernel is swept; the unified kernel is timed with the current and
the best config. Usage: python benchmarks/experiments/extend_tuning.py [--round2] [T64 T256 ...]; writes
$OUT/extend_tuning.json.
"""
import json, os, statistics, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import numpy as np
from jaxattn import bench, extend, testing
from jaxattn.extend import ExtendConfig as C

# Round 1 (2026-12-03, results/2026-12-03_h200_extend_tuning_round1.json): around the table's guesses.
ROUND1 = {  # family -> (block_m, block_n, num_warps, num_stages)
    "64": [(64, 32, 4, 2), (64, 64, 4, 3), (64, 64, 8, 3), (64, 128, 8, 2), (64, 128, 8, 3), (128, 32, 8, 2),
           (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3)],
    "256": [(64, 32, 8, 2), (64, 32, 8, 3), (64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 32, 8, 3)],
    "192/128": [(128, 32, 8, 2), (128, 32, 8, 3), (64, 64, 8, 2), (64, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3),
                (64, 128, 8, 2), (64, 32, 4, 3)],
    "576/512": [(32, 32, 8, 2), (16, 32, 4, 2), (32, 64, 8, 2), (32, 16, 4, 2), (64, 32, 8, 2)],
}
# Round 2: around round 1's winners (64, 192/128: 128x64 w8 s3; 256: 64x32 w4 s2; 576/512: 64x32 w8 s2), and 288/256.
ROUND2 = {
    "64": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 8, 3), (64, 64, 4, 4), (128, 64, 4, 3)],
    "256": [(64, 32, 4, 2), (64, 32, 4, 3), (64, 64, 4, 2), (64, 16, 4, 2), (32, 64, 4, 2), (64, 32, 4, 4)],
    "192/128": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 8, 4), (64, 64, 4, 3), (64, 32, 4, 2)],
    "576/512": [(64, 32, 8, 2), (64, 16, 8, 2), (64, 16, 8, 3), (128, 16, 8, 2), (64, 32, 8, 1)],
    "288/256": [(64, 32, 8, 2), (64, 32, 4, 2), (64, 32, 4, 3), (32, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 16, 4, 2)],
}
FAMILY = {"T64": "64", "T256": "256", "T192": "192/128", "T576": "576/512", "T288": "288/256"}
args = sys.argv[1:]
CANDIDATES = ROUND1
if args[:1] == ["--round2"]:
    CANDIDATES, args = ROUND2, args[1:]
out_dir = os.environ.get("OUT", "/tmp")
rows = []
for name in args or [n for n in FAMILY if FAMILY[n] in CANDIDATES]:
    case, family = bench.CASES[name], FAMILY[name]
    inp = bench.make_inputs(case)
    ref = np.asarray(bench.extend_reference(inp)(), np.float32)
    tol = testing.tolerance(inp.q.dtype)
    limit = tol["atol"] + tol["rtol"] * np.abs(ref)
    current = extend.SM90_CONFIGS[family]
    fns = {}
    for cfg in CANDIDATES[family]:
        config = C(*cfg)
        label = f"m{cfg[0]} n{cfg[1]} w{cfg[2]} s{cfg[3]}" + (" (current)" if config == current else "")
        try:
            t0 = time.time()
            fn = bench.extend_jaxattn(inp, config=config)
            out = np.asarray(fn(), np.float32)
            worst = float(np.max(np.abs(out - ref) / limit))
            print(f"{name} {label}: compiled+ran in {time.time() - t0:.1f}s, worst |err|/tol {worst:.3f}", flush=True)
            if not worst <= 1.0:
                print(f"{name} {label}: OUT OF TOLERANCE, not timed", flush=True)
                rows.append(dict(case=name, family=family, config=cfg, kernel="two-stage", error="tolerance", worst=worst))
                continue
            fns[(label, "two-stage", cfg)] = fn
        except Exception as e:
            print(f"{name} {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    samples = {k: [] for k in fns}
    for _ in range(2):  # interleaved rounds: clock drift hits every config alike
        for key, fn in fns.items():
            samples[key].append(bench.time_calls(fn, bench.jax_sync, repeats=5))
    timed = {key: statistics.median(s) for key, s in samples.items()}
    best = min(timed, key=timed.get) if timed else None
    for key, ms in sorted(timed.items(), key=lambda kv: kv[1]):
        label, kernel, cfg = key
        rows.append(dict(case=name, family=family, config=cfg, kernel=kernel, median_ms=round(ms, 4), floor_ms=round(case.floor_ms(), 4),
                         fraction=round(case.floor_ms() / ms, 3), rounds=[round(x, 4) for x in samples[key]]))
        print(f"{name} {label:28s} {ms:8.3f} ms  {100 * case.floor_ms() / ms:5.1f}% of floor", flush=True)
    # The unified kernel with the current and the best two-stage config.
    current_cfg = (current.block_m, current.block_n, current.num_warps, current.num_stages)  # the candidates' 4-tuple form
    for cfg in {current_cfg, best[2] if best else None} - {None}:
        try:
            fn = bench.extend_jaxattn(inp, config=C(*cfg), unified=True)
            worst = float(np.max(np.abs(np.asarray(fn(), np.float32) - ref) / limit))
            ms = bench.time_calls(fn, bench.jax_sync, repeats=5)
            rows.append(dict(case=name, family=family, config=cfg, kernel="unified", median_ms=round(ms, 4), floor_ms=round(case.floor_ms(), 4),
                             fraction=round(case.floor_ms() / ms, 3), worst=worst))
            print(f"{name} unified m{cfg[0]} n{cfg[1]} w{cfg[2]} s{cfg[3]} {ms:8.3f} ms  {100 * case.floor_ms() / ms:5.1f}% of floor, worst |err|/tol {worst:.3f}", flush=True)
        except Exception as e:
            print(f"{name} unified {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    del inp, ref, fns
    json.dump(rows, open(os.path.join(out_dir, "extend_tuning.json"), "w"), indent=1)  # after every case: a partial run keeps its rows
