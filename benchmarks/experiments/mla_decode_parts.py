"""Experiment (H200; issue 22): where MLA decode's time goes at 64 x 4096 (70-76% of the floor against 85%).

Times, on the Mosaic GPU MLA kernel (`impl="mgpu"`) and each case's inputs (`jaxattn.bench` MLA, MLA-L):
  * "op": decode_attention as the bench times it (stage 1 + the Triton merge);
  * "stage 1": the kernel alone (its partial buffers as the result);
  * "merge": the Triton merge alone, on the kernel's partials computed once;
each at the kernel's own split bound and at the bounds given by --splits. If op - stage 1 is the merge's own time, a
fused merge saves that much; what stage 1 takes beyond tiles x per-tile time is its fixed cost (pipeline fill,
epilogue), which a persistent schedule would spread.

    python benchmarks/experiments/mla_decode_parts.py --cases MLA,MLA-L --splits 1,2,3 --json $OUT/mla_parts.json
"""

import argparse
import contextlib
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


@contextlib.contextmanager
def run_merged_as(replacement):
    """While tracing: the MLA route's `triton_decode.run_merged(call, partials)` replaced (undecorated functions)."""
    from jaxattn.impl import triton_decode

    import jax

    original = triton_decode.run_merged
    jax.clear_caches()  # JAX caches traces by function (also jitted ones inside): trace anew under the replacement
    triton_decode.run_merged = replacement
    try:
        yield
    finally:
        triton_decode.run_merged = original
        jax.clear_caches()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="MLA,MLA-L")
    parser.add_argument("--splits", default="", help="comma-separated split bounds besides the kernel's own")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import jax

    from jaxattn import bench, decode, metadata
    from jaxattn.impl import triton_decode
    from jaxattn.tuning import MgpuDecodeConfig
    from variant_timing import write_record

    rows = []
    for name in args.cases.split(","):
        case = bench.CASES[name]
        inp = bench.make_inputs(case)
        meta = metadata.decode_metadata_from_indptr(inp.kv_indptr, inp.kv_indices, inp.seq_lens, q_heads=case.q_heads,
                                                    kv_heads=case.kv_heads)
        floor_ms = case.floor_ms()
        timed = {}
        for splits in [None] + [int(s) for s in args.splits.split(",") if s]:
            config = None if splits is None else MgpuDecodeConfig(splits=splits)
            label = "own bound" if splits is None else f"{splits} splits"

            def op(q, k, m, config=config):  # traced anew under each run_merged_as (it clears JAX's caches)
                return decode.decode_attention(q, k, None, m, v_head_dim=case.dv, config=config, impl="mgpu")

            full = jax.jit(op).lower(inp.q, inp.k_pool, meta).compile()
            with run_merged_as(lambda call, partials: partials(call)[:2]):
                stage1 = jax.jit(op).lower(inp.q, inp.k_pool, meta).compile()
                mid_o, mid_lse = stage1(inp.q, inp.k_pool, meta)
            captured = {}

            def merge_only(call, partials):
                _, _, num_kv_splits, max_splits = partials(call)  # traced, then unused: only the merge is launched
                captured["splits"] = max_splits
                return triton_decode.merge_splits(call, captured["mid_o"], captured["mid_lse"], num_kv_splits,
                                                  max_splits)

            def merge_op(q, k, m, mid_o, mid_lse):  # the partials as arguments (closed over, they became constants)
                captured.update(mid_o=mid_o, mid_lse=mid_lse)
                return op(q, k, m)

            with run_merged_as(merge_only):
                merge = jax.jit(merge_op).lower(inp.q, inp.k_pool, meta, mid_o, mid_lse).compile()
            timed[f"{label}: op"] = lambda full=full: full(inp.q, inp.k_pool, meta)
            timed[f"{label}: stage 1"] = lambda stage1=stage1: stage1(inp.q, inp.k_pool, meta)
            timed[f"{label}: merge"] = lambda merge=merge, o=mid_o, lse=mid_lse: merge(inp.q, inp.k_pool, meta, o, lse)
            print(f"{name} {label}: {captured['splits']} splits at most", flush=True)
        samples = {label: [] for label in timed}
        for _ in range(args.rounds):
            for label, fn in timed.items():
                samples[label].append(bench.time_calls(fn, bench.jax_sync, repeats=5))
        for label, s in samples.items():
            ms = statistics.median(s)
            rows.append(dict(case=name, variant=label, ms=round(ms, 5), floor_ms=floor_ms, rounds=[round(x, 5) for x in s]))
            print(f"{name:6s} {label:24s} {ms * 1e3:8.1f} us  ({100 * floor_ms / ms:5.1f}% of the floor's time)",
                  flush=True)
    write_record(args.json, rows)


if __name__ == "__main__":
    main()
