"""Experiment (H200, FlashInfer): the same planned wrapper launched from torch, from jit through the bridge
(`bridged_run`, buffer_callback + DLPack + torch) and from jit through the FFI launch (`FfiLauncher`, jax-tvm-ffi),
at D1, D2, D3 (decode, no tensor cores) and E1 (paged prefill, fa3), with 1 and 8 calls per jitted step.

Run from the repository root on the GPU machine (after installing the carried wheels into /tmp/site):
    export PYTHONPATH=$PWD:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false
    python benchmarks/experiments/flashinfer_ffi.py --json benchmarks/results/<date>_h200_flashinfer_ffi.json

Prints ms per kernel call (median over interleaved rounds) and the ratio to torch; the target is <= 1.01 for the
"ffi x8" rows. A variant that fails is reported FAILED with its error and the run goes on; the JSON is rewritten
after every case, so a run cut short keeps what it finished. Kernels are JIT-built by FlashInfer on first use
(decode bf16 ~12 s, fa3 prefill longer) unless carried prebuilt; D1-D3 share one decode module. First run: the
seventh session (results/2026-12-03_h200_flashinfer_ffi_11e9d5a.*, D1-D3 only).
"""

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error)[-400:]}"


def plan_wrapper(flashinfer, torch, case, tv, workspace, e1_backend: str):
    """A FlashInfer wrapper planned for the case (as jaxattn.bench.peers plans it): decode without tensor cores,
    extend with `e1_backend`. tv: jaxattn.bench.torch_views of the case's inputs."""
    last_page_len = torch.ones(case.batch, dtype=torch.int32, device="cuda")
    if case.op == "decode":
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=False)
        wrapper.plan(tv["kv_indptr"], tv["kv_indices"], last_page_len, case.q_heads, case.kv_heads, case.head_dim, 1,
                     q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=e1_backend)
        wrapper.plan(tv["qo_indptr"], tv["kv_indptr"], tv["kv_indices"], last_page_len, case.q_heads, case.kv_heads,
                     case.head_dim, 1, head_dim_vo=case.dv, causal=True, q_data_type=torch.bfloat16,
                     kv_data_type=torch.bfloat16)
    torch.cuda.synchronize()
    return wrapper


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="D1,D2,D3,E1")
    parser.add_argument("--layers", type=int, default=8, help="calls per jitted step (a model's attention layers)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per variant")
    parser.add_argument("--e1-backend", default="fa3", choices=["fa2", "fa3"])
    parser.add_argument("--json", default=None, help="where to write the results")
    args = parser.parse_args()

    import jax
    import numpy as np
    import torch
    import flashinfer

    from jaxattn import bench
    from jaxattn.bench.peers import torch_layers
    from jaxattn.backends.flashinfer import bridged_run
    from jaxattn.backends.flashinfer_ffi import FfiLauncher

    if not os.environ.get("TRITON_CACHE_DIR"):  # an import may have set it empty (jax_triton 0.3.1)
        os.environ["TRITON_CACHE_DIR"] = os.path.expanduser("~/.triton/cache")
    versions = dict(jax=jax.__version__, torch=torch.__version__, flashinfer=getattr(flashinfer, "__version__", "?"))
    for dist in ("jax-tvm-ffi", "apache-tvm-ffi"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    try:
        launcher, launcher_error = FfiLauncher(), None
    except Exception as error:  # no wheel: the ffi rows report it
        launcher, launcher_error = None, error_text(error)
    report = dict(experiment="flashinfer_ffi", device=bench.device_name(), commit=bench.commit(), date=bench.today(),
                  versions=versions, layers=args.layers, e1_backend=args.e1_backend, rows=[], setup_s={})

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    def row(case, variant, **fields):
        report["rows"].append(dict(case=case, variant=variant, **fields))
        if "error" in fields:
            print(f"{case:3s} {variant:10s} FAILED {fields['error']}", flush=True)

    workspace = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")  # shared: one wrapper lives at a time
    layers = args.layers
    for name in args.cases.split(","):
        case = bench.CASES[name]
        start = time.perf_counter()
        try:
            inp = bench.make_inputs(case)
            _, tv = bench.torch_views(inp)
            wrapper = plan_wrapper(flashinfer, torch, case, tv, workspace, args.e1_backend)
            q, kv = tv["q"], (tv["k_pool"].unsqueeze(1), tv["v_pool"].unsqueeze(1))  # NHD, page size 1
            # `layers` launches from torch a call, each into its own output and LSE (the bench's torch x8 rows)
            torch_step = torch_layers(torch, wrapper, q, kv, case.dv, layers)
            want = wrapper.run(q, kv).float().cpu().numpy()  # builds nothing new: plan() built it
        except Exception as error:
            row(name, "setup", error=error_text(error))
            traceback.print_exc()
            save()
            continue
        report["setup_s"][name] = round(time.perf_counter() - start, 1)
        print(f"{name}: inputs and plan (incl. any kernel build) {report['setup_s'][name]} s", flush=True)

        variants = {"torch": (torch_step, bench.torch_sync)}

        def jitted(run, calls):
            def step(q, k, v):
                return [run(wrapper, q, k, v, case.dv, has_side_effect=calls > 1)[0] for _ in range(calls)]

            fn = jax.jit(step)
            return bench.PerCall(lambda: fn(inp.q, inp.k_pool, inp.v_pool), calls)

        runs = {"bridge": bridged_run, "ffi": None if launcher is None else launcher.run}
        for label, run in runs.items():
            for calls in (1, layers):
                variant = f"{label} x{calls}"
                if run is None:
                    row(name, variant, error=launcher_error)
                    continue
                try:
                    fn = jitted(run, calls)
                    got = np.asarray(fn()[-1], np.float32)  # compiles, and checks the last call against torch's
                    diff = float(np.max(np.abs(got - want)))
                    if not diff <= 2e-2:
                        raise AssertionError(f"last call max|diff| vs torch {diff}")
                    variants[variant] = (fn, bench.jax_sync)
                    report.setdefault("max_abs_diff", {})[f"{name} {variant}"] = diff
                except Exception as error:
                    row(name, variant, error=error_text(error))
                    traceback.print_exc()

        samples = {variant: [] for variant in variants}
        for _ in range(args.rounds):
            for variant, (fn, sync) in list(variants.items()):
                try:
                    samples[variant].append(bench.time_calls(fn, sync, repeats=5))
                except Exception as error:
                    row(name, variant, error=error_text(error))
                    del variants[variant], samples[variant]
        torch_ms = statistics.median(samples["torch"]) if samples.get("torch") else None
        for variant, rounds in samples.items():
            ms = statistics.median(rounds)
            ratio = None if torch_ms is None else ms / torch_ms
            row(name, variant, ms_per_call=round(ms, 5), ratio_to_torch=None if ratio is None else round(ratio, 4),
                rounds_ms=[round(x, 5) for x in rounds], max_abs_diff=report.get("max_abs_diff", {}).get(f"{name} {variant}"))
            print(f"{name:3s} {variant:10s} {ms:8.4f} ms/call   x torch {ratio if ratio is None else f'{ratio:.4f}'}   "
                  f"rounds {[round(x, 4) for x in rounds]}", flush=True)
        save()
        del inp, tv, wrapper, kv, q, torch_step, variants, samples
        torch.cuda.empty_cache()
    save()


if __name__ == "__main__":
    main()
