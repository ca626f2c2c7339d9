"""Experiment (H200): the Mosaic GPU extend kernel with options forced that its tuned rules would not pick, beside
the default, on any bench case. Each --force is one variant: kernel keyword arguments (`extend_attention_mgpu_kernel`:
heads_per_cta, tma_new_tiles, page_rows, page_issue, ...) set while tracing (`impl.mgpu_extend.kernel_options_forced`).
Every variant is checked against the jnp reference (worst |err| / dtype tolerance) before timing, then all are timed in
interleaved rounds. Writes $OUT/mgpu_options.json.

Usage: python benchmarks/experiments/mgpu_options.py --cases T64,E1 --force heads_per_cta=2 [--force ...] [--unified]
(first candidate, issue 20's T64 gap: two q heads of one kv head per CTA for long extends, halving K/V loads per FLOP)
"""
import argparse
import ast
import contextlib
import functools
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from variant_timing import write_record  # noqa: E402  (this folder: the script's own directory)
from jaxattn import bench, testing  # noqa: E402
from jaxattn.extend_mgpu import extend_attention_mgpu, extend_attention_unified_mgpu  # noqa: E402
from jaxattn.impl.mgpu_extend import kernel_options_forced  # noqa: E402


def parse_force(spec: str) -> dict:
    """"heads_per_cta=2,tma_new_tiles=False" -> {"heads_per_cta": 2, "tma_new_tiles": False}."""
    return {name.strip(): ast.literal_eval(value.strip()) for name, value in (item.split("=", 1) for item in spec.split(","))}


parser = argparse.ArgumentParser()
parser.add_argument("--cases", default="T64,E1", help="bench case names, paged ones too (E2-P64)")
parser.add_argument("--force", action="append", default=[], help="name=value[,name=value]: one variant (repeatable)")
parser.add_argument("--unified", action="store_true", help="the unified form (every key from the pool) instead")
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--memset", action="store_true",
                    help="also the default with the whole output zeroed first (XLA's memset, as before the output "
                         "buffer cleared only its unwritten rows, kernels/zero_rows_mgpu.py)")
args = parser.parse_args()
variants = {"default": {}, **{spec: parse_force(spec) for spec in args.force}}
MEMSET = "default, whole output zeroed (memset)"
if args.memset:
    variants[MEMSET] = {}


@contextlib.contextmanager
def whole_output_zeroed(enabled: bool):
    """While tracing: the extend wrappers' output buffer all zeros (jnp.zeros), the form before zero_rows_mgpu."""
    import jaxattn.kernels.zero_rows_mgpu as zero_rows

    original = zero_rows.unwritten_rows_zeroed
    if enabled:
        zero_rows.unwritten_rows_zeroed = lambda qo_indptr, *, rows, row_shape, dtype, max_extend_len: jnp.zeros(
            (rows, *row_shape), dtype)
    try:
        yield
    finally:
        zero_rows.unwritten_rows_zeroed = original

rows = []
for name in args.cases.split(","):
    case = bench.case_named(name)  # paged ones too (E2-P64)
    if case is None:
        raise SystemExit(f"mgpu_options: no bench case {name!r}")
    inp = bench.make_inputs(case)
    meta = bench.extend_meta(inp, unified=args.unified)
    if args.unified:
        fn, operands = extend_attention_unified_mgpu, (inp.q, inp.k_pool, inp.v_pool, meta)
    else:
        fn, operands = extend_attention_mgpu, (inp.q, inp.k_new, inp.v_new, inp.k_pool, inp.v_pool, meta)
    ref = np.asarray(bench.extend_reference(inp)(), np.float32)
    tol = testing.tolerance(inp.q.dtype)
    limit = tol["atol"] + tol["rtol"] * np.abs(ref)
    fns = {}
    for label, forced in variants.items():
        try:
            with kernel_options_forced(lambda kw, forced=forced: dict(kw, **forced)), whole_output_zeroed(label == MEMSET):
                compiled = jax.jit(fn.__wrapped__).lower(*operands).compile()  # traced anew: the context clears the caches
            call = functools.partial(compiled, *operands)
            out = np.asarray(call(), np.float32)
            worst = float(np.max(np.abs(out - ref) / limit))
            print(f"{name} {label}: worst |err| / tolerance {worst:.3f}", flush=True)
            if not worst <= 1.0:
                rows.append(dict(case=name, variant=label, error="tolerance", worst=worst))
                continue
            fns[label] = call
        except Exception as error:  # noqa: BLE001  (a variant that fails must not hide the others)
            print(f"{name} {label} FAILED {type(error).__name__}: {error}"[:600], flush=True)
            rows.append(dict(case=name, variant=label, error=f"{type(error).__name__}: {str(error)[:300]}"))
    samples = {label: [] for label in fns}
    for _ in range(args.rounds):
        for label, call in fns.items():
            samples[label].append(bench.time_calls(call, bench.jax_sync, repeats=5))
    default_ms = statistics.median(samples["default"]) if "default" in samples else None
    for label, s in samples.items():
        ms = statistics.median(s)
        rows.append(dict(case=name, variant=label, unified=args.unified, ms=round(ms, 4), floor_ms=case.floor_ms(),
                         rounds=[round(x, 4) for x in s]))
        ratio = f"  {ms / default_ms:5.3f}x default" if default_ms else ""
        print(f"{name:6s} {label:32s} {ms:8.4f} ms  {100 * case.floor_ms() / ms:5.1f}% of floor{ratio}", flush=True)
    del inp, fns
write_record(os.path.join(os.environ.get("OUT", "/tmp"), "mgpu_options.json"), rows)
