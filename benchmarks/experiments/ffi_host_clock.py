"""Experiment (GPU): where the FlashInfer FFI launch's host-clock time per call goes, beside torch's (issue 24).

At 7deab52 (H100) `bench.time_calls` gave the FFI step of 8 calls 16-20 us a call more than the GPU's span of
back-to-back steps (torch's 8 launches: 4-6 us), so the difference lies outside the steps' kernels (an earlier run
put it at 0.5-1 ms at the start of each sample: RESULTS, twenty-third session). Per sample of
`--steps` back-to-back steps, after a sync, this splits the host clock into the dispatch of the steps (the host
returning from the last call) and the wait in the sync after it, and times one lone step (dispatch to result) and a
step's dispatch alone. A host that runs ahead of the GPU dispatches in far less than the sample; a dispatch close to
the sample's time means the host, not the GPU, paces the steps. A lone step's excess over a step inside a sample
is a cost each sample pays once.

At 6a7f2a9 (H200) the dispatch was equal (30 / 31 us a call at D2) but one lone FFI step took 3.55-3.75 ms against
torch's 3.07-3.18 (command buffers on or off): about 0.5 ms a sample, as at the twenty-third session. jaxattn's own
8-layer step (Triton kernels, no FFI) is timed beside them, so a lone step says whether the cost is the FFI target's
or any jitted step's, and the lone step's dispatch says whether it is spent before the host returns or after; one
launch a step (`flashinfer-ffi` beside torch's `flashinfer`) says whether it is paid per step or per launch.

    python3 benchmarks/experiments/ffi_host_clock.py --cases D2,D3 --json out.json
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from variant_timing import warmed_backend, write_record  # noqa: E402  (this folder: the script's own directory)

BACKENDS = "flashinfer-8-layers,flashinfer-ffi-8-layers,jaxattn-8-layers,flashinfer,flashinfer-ffi"


def split_sample(fn, sync, steps: int, repeats: int) -> dict:
    """Medians over `repeats` samples, ms per call: the whole sample (as time_calls), its dispatch, its sync."""
    calls = steps * getattr(fn, "calls", 1)
    whole, dispatch, wait = [], [], []
    for _ in range(repeats):
        sync(fn())
        start = time.perf_counter()
        for _ in range(steps):
            result = fn()
        dispatched = time.perf_counter()
        sync(result)
        done = time.perf_counter()
        whole.append((done - start) / calls * 1e3)
        dispatch.append((dispatched - start) / calls * 1e3)
        wait.append((done - dispatched) / calls * 1e3)
    lone, lone_dispatch = [], []
    for _ in range(repeats):
        sync(fn())
        start = time.perf_counter()
        result = fn()
        lone_dispatch.append((time.perf_counter() - start) * 1e3)
        sync(result)
        lone.append((time.perf_counter() - start) * 1e3)
    ms_per_call, lone_step_ms = statistics.median(whole), statistics.median(lone)
    return dict(ms_per_call=ms_per_call, dispatch_ms_per_call=statistics.median(dispatch),
                sync_ms_per_call=statistics.median(wait), lone_step_ms=lone_step_ms,
                lone_dispatch_ms=statistics.median(lone_dispatch),
                lone_excess_ms=lone_step_ms - ms_per_call * calls / steps, steps=steps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="D2,D3")
    parser.add_argument("--backends", default=BACKENDS, help="decode bench backends, comma-separated")
    parser.add_argument("--steps", type=int, default=9, help="steps a sample (time_calls takes about 9 at D1-D3)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from jaxattn import bench

    rows = []
    for name in args.cases.split(","):
        inp = bench.make_inputs(bench.case_named(name))
        for backend in args.backends.split(","):
            made = warmed_backend("decode", backend, name, inp)
            if made is None:
                continue
            fn, sync = made
            row = dict(case=name, backend=backend, **split_sample(fn, sync, args.steps, args.repeats))
            rows.append(row)
            print(f"{name} {backend}: {row['ms_per_call'] * 1e3:.1f} us/call = dispatch "
                  f"{row['dispatch_ms_per_call'] * 1e3:.1f} + sync {row['sync_ms_per_call'] * 1e3:.1f}; one step "
                  f"alone {row['lone_step_ms'] * 1e3:.0f} us (dispatch {row['lone_dispatch_ms'] * 1e3:.0f}, "
                  f"{row['lone_excess_ms'] * 1e3:.0f} more than a step in a sample)", flush=True)
            write_record(args.json, rows)


if __name__ == "__main__":
    main()
