"""Experiment (H200, FlashInfer; issue 24): where the +2-5% of FlashInfer launched from jit goes, on the GPU's own
clock. The same planned wrapper runs as torch launches it, through the bridge and through the FFI launch (8 calls
per step, as `flashinfer_ffi.py` times them); torch's profiler (CUPTI, which sees every kernel of the process, XLA's
included) records each variant's kernels over a few steps. Per variant it prints the kernels per step, each kernel
name's mean duration, the GPU busy time per step and the idle gaps between kernels. If the kernels' own durations
match torch's, the cost is launch gaps (the host) and the fix is on the launch path; if they differ, it is what the
kernels read (buffers, streams, what else XLA runs) and the fix is there.

Run from the repository root on the GPU machine (after installing the carried wheels):
    python benchmarks/experiments/flashinfer_timeline.py --cases D2,E1 --json $OUT/flashinfer_timeline.json
"""

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))


def kernel_events(trace_path: str) -> list[dict]:
    """The GPU kernels of a chrome trace written by torch.profiler: [{name, ts, dur, stream}] sorted by start (us)."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [dict(name=e["name"], ts=float(e["ts"]), dur=float(e["dur"]), stream=e.get("args", {}).get("stream"))
               for e in events if e.get("cat") == "kernel" and "dur" in e]
    return sorted(kernels, key=lambda e: e["ts"])


def summarise(kernels: list[dict], steps: int) -> dict:
    """Per step: kernels, busy us (sum of durations), span us (first start to last end), idle gaps between
    consecutive kernels (sum, median, max), and the mean duration of each kernel name."""
    if not kernels:
        return dict(kernels_per_step=0)
    gaps = [max(0.0, b["ts"] - (a["ts"] + a["dur"])) for a, b in zip(kernels, kernels[1:])]
    by_name = collections.defaultdict(list)
    for k in kernels:
        by_name[k["name"][:90]].append(k["dur"])
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    return dict(kernels_per_step=len(kernels) / steps, busy_us_per_step=sum(k["dur"] for k in kernels) / steps,
                span_us_per_step=span / steps, gap_us_per_step=sum(gaps) / steps,
                gap_median_us=statistics.median(gaps) if gaps else 0.0, gap_max_us=max(gaps) if gaps else 0.0,
                streams=sorted({str(k["stream"]) for k in kernels}),
                mean_us_by_kernel={name: round(statistics.mean(d), 3) for name, d in by_name.items()},
                count_by_kernel={name: len(d) for name, d in by_name.items()})


def profiled(fn, sync, steps: int) -> dict:
    """`summarise` of `steps` back-to-back calls of fn (after the caller's warm-up), recorded by torch's profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            result = None
            for _ in range(steps):
                result = fn()
            sync(result)
            torch.cuda.synchronize()
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        return summarise(kernel_events(path), steps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="D2,E1")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="profiled steps per variant")
    parser.add_argument("--e1-backend", default="fa3", choices=["fa2", "fa3"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import torch
    import flashinfer

    from jaxattn import bench
    from jaxattn.backends.flashinfer import bridged_run
    from jaxattn.backends.flashinfer_ffi import FfiLauncher
    from flashinfer_ffi import plan_wrapper, torch_layers  # the experiment beside this one plans and launches so

    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = os.path.expanduser("~/.triton/cache")
    try:
        launcher, callback_launcher = FfiLauncher(), FfiLauncher(native=False)  # C++ replay; Python callback
    except Exception as error:
        print(f"FFI launch unavailable: {error}")
        launcher = callback_launcher = None
    report = dict(experiment="flashinfer_timeline", device=bench.device_name(), commit=bench.commit(),
                  date=bench.today(), layers=args.layers, steps=args.steps, rows=[])
    workspace = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    layers = args.layers
    for name in args.cases.split(","):
        case = bench.CASES[name]
        inp = bench.make_inputs(case)
        _, tv = bench.torch_views(inp)
        wrapper = plan_wrapper(flashinfer, torch, case, tv, workspace, args.e1_backend)
        torch_step = torch_layers(torch, case, tv, wrapper, layers)[-1]

        def jitted(run):
            fn = jax.jit(lambda q, k, v: [run(wrapper, q, k, v, case.dv, has_side_effect=True)[0]
                                          for _ in range(layers)])
            return lambda: fn(inp.q, inp.k_pool, inp.v_pool)

        # As a model's step calls it: a distinct q per layer and no side effect (which XLA's scheduling and JAX's
        # dispatch treat differently), so identical calls cannot be merged either way.
        layer_qs = [jnp.array(inp.q, copy=True) for _ in range(layers)]

        def jitted_distinct(run):
            fn = jax.jit(lambda qs, k, v: [run(wrapper, q, k, v, case.dv)[0] for q in qs])
            return lambda: fn(layer_qs, inp.k_pool, inp.v_pool)

        variants = {"torch": (torch_step, bench.torch_sync), "bridge x8": (jitted(bridged_run), bench.jax_sync)}
        if launcher is not None:
            variants["ffi x8"] = (jitted(launcher.run), bench.jax_sync)
            variants["ffi x8 distinct q"] = (jitted_distinct(launcher.run), bench.jax_sync)
            variants["ffi x8 python callback"] = (jitted(callback_launcher.run), bench.jax_sync)
        for variant, (fn, sync) in variants.items():
            for _ in range(3):  # compile, plan recordings, allocator warm
                sync(fn())
            summary = profiled(fn, sync, args.steps)
            summary["ms_per_call_span"] = round(summary.get("span_us_per_step", 0) / layers / 1e3, 5)
            # The same variant on the host's clock (bench.time_calls: steps back to back for ~target_ms, one sync),
            # short and long samples: a fixed cost per sample (first dispatch, final sync) shrinks in the long one.
            per_call = bench.PerCall(fn, layers)
            summary["wall_ms_per_call"] = {str(target): round(bench.time_calls(per_call, sync, target_ms=target,
                                                                               repeats=5), 5) for target in (30, 300)}
            report["rows"].append(dict(case=name, variant=variant, **summary))
            print(f"{name} {variant}: {summary.get('kernels_per_step')} kernels/step, busy "
                  f"{summary.get('busy_us_per_step', 0):.1f} us/step, span {summary.get('span_us_per_step', 0):.1f}, "
                  f"gaps {summary.get('gap_us_per_step', 0):.1f} (median {summary.get('gap_median_us', 0):.2f}, max "
                  f"{summary.get('gap_max_us', 0):.1f}), streams {summary.get('streams')}; host clock ms/call "
                  f"{summary['wall_ms_per_call']} against {summary['ms_per_call_span']} on the GPU's", flush=True)
            for kernel, mean in summary.get("mean_us_by_kernel", {}).items():
                print(f"    {mean:9.2f} us x{summary['count_by_kernel'][kernel] / args.steps:g}/step  {kernel}",
                      flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
