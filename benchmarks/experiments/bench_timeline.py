"""Experiment: what a bench row's call runs on the GPU, beside what its host clock says (issues 20, 22, 23).

For each case and backend of `jaxattn.bench` (the same callables the bench times), torch's profiler (CUPTI, which
sees XLA's kernels as well as torch's) records a few back-to-back calls. Per row it prints the kernels per call with
each one's mean duration, the GPU's busy time and span per call, the idle gaps between kernels, and the host clock's
ms per call (`bench.time_calls`, as the bench times it). A row whose host time is well above its span is bound by
the host's dispatch, not the GPU; one whose span is above its busy time pays launch gaps; a kernel beside the main
one (a memset, an XLA fusion building masks or words) is a per-call cost the main kernel does not show.

Run from the repository root on the GPU machine (after installing the carried wheels):
    python benchmarks/experiments/bench_timeline.py decode --cases MLA,MLA-V4 --backends jaxattn,flashinfer-mla \
        --json $OUT/timeline_decode.json
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("op", choices=["decode", "extend"])
    parser.add_argument("--cases", required=True,
                        help="bench case names, paged ones too (E3-P16), and MLA at other shapes (MLA-64x512)")
    parser.add_argument("--backends", required=True, help="bench backend names")
    parser.add_argument("--calls", type=int, default=20, help="profiled steps per row (a step: one call, or 8)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from jaxattn import bench
    from flashinfer_timeline import profiled  # the FlashInfer timeline's profiling and trace reading
    from mla_fixed_cost import mla_case_named
    from variant_timing import warmed_backend, write_record

    if not os.environ.get("TRITON_CACHE_DIR"):  # jax_triton 0.3.1 empties it, which breaks torch-side Triton
        os.environ["TRITON_CACHE_DIR"] = os.path.expanduser("~/.triton/cache")
    import jax
    import jax.numpy as jnp

    # The host's floor for one jitted call: a one-kernel function on 8 floats (a row whose host time is near this is
    # bound by dispatching, whatever its kernel).
    tiny = jax.jit(lambda x: x + 1.0)
    x = jnp.zeros((8,), jnp.float32)
    tiny_ms = round(bench.time_calls(lambda: tiny(x), bench.jax_sync), 5)
    print(f"one tiny jitted call: host {tiny_ms * 1e3:.1f} us/call", flush=True)
    rows = [dict(case="tiny", backend="jax.jit(x + 1) on 8 floats", host_ms_per_call=tiny_ms)]
    for name in args.cases.split(","):
        case = bench.case_named(name) or mla_case_named(name)
        if case is None:
            raise SystemExit(f"unknown case {name!r}: the names are {list(bench.CASES)} (a paged one: E3-P16; MLA at a shape: MLA-64x512)")
        inp = bench.make_inputs(case)
        for backend in args.backends.split(","):
            made = warmed_backend(args.op, backend, name, inp)
            if made is None:
                continue
            fn, sync = made
            summary = profiled(fn, sync, args.calls)  # per step: a -8-layers row's step makes 8 calls
            summary["calls_per_step"] = getattr(fn, "calls", 1)
            summary["host_ms_per_call"] = round(bench.time_calls(fn, sync), 5)
            rows.append(dict(case=name, backend=backend, **summary))
            print(f"{name} {backend}: host {summary['host_ms_per_call'] * 1e3:.1f} us/call; GPU, per step of "
                  f"{summary['calls_per_step']} call(s): {summary.get('kernels_per_step')} kernels, busy "
                  f"{summary.get('busy_us_per_step', 0):.1f} "
                  f"us, span {summary.get('span_us_per_step', 0):.1f}, gaps {summary.get('gap_us_per_step', 0):.1f} "
                  f"(median {summary.get('gap_median_us', 0):.2f}, max {summary.get('gap_max_us', 0):.1f})",
                  flush=True)
            for kernel, mean in summary.get("mean_us_by_kernel", {}).items():
                print(f"    {mean:9.2f} us x{summary['count_by_kernel'][kernel] / args.calls:g}/step  {kernel}",
                      flush=True)
            write_record(args.json, rows)


if __name__ == "__main__":
    main()
