"""Experiment (H200): where the FFI launch's non-zero padding rows come from (issue 24; the seventh session's GPU test
of `FlashInferBackend(launch="ffi")`, case "extend" of tests/test_flashinfer_ffi.py, failed at rows 21-23 of 24, the
bucket's padding tokens, which the backend zeroes after the launch with `jnp.where`).

The rows' values were plausible attention outputs, and the valid rows matched, which fits two facts together:
  (a) FlashInfer's paged prefill stores the padding q rows of the last sequence's tile (q has the bucket's 24 rows,
      the plan 21), and
  (b) the kernel runs after the step's `jnp.where` (done in place on the output buffer): the launch is not ordered
      with XLA's stream.
(b) saw 0 of 50 dirty steps on the H200 while the GPU test kept failing (H200 and H100): (c) replays the test's own
sequence (the reference backend first, two batches planned one after the other on one backend, return_lse=True) and
varies one thing at a time. Outcome (H100, d2f08e1): no padding row was non-zero in any variant, and the test's
failing rows were valid rows of its second batch: an extend of 18 tokens over the batch's max_extend_len bucket of 16,
whose last two tokens the reference does not compute (the bucket's contract; checked mode rejects such a batch). The
FFI launch computed them, as FlashInfer plans from the host's lengths. The test now sizes the bucket (4 passed).
This script tests each on the same batch and wrapper:
  (a) torch only: run() on the full 24-row q with `out` filled with NaN: which rows past qo_indptr[-1] it writes;
  (b) jitted FFI launch then the backend's zeroing, `repeats` times: how many steps leave a padding row non-zero,
      and the same for the bridge (ordered on XLA's stream by buffer_callback; it hands FlashInfer the planned rows
      only) as the control.
Prints the findings and writes $OUT/ffi_padding_rows.json. Needs a GPU, flashinfer 0.6.x and jax-tvm-ffi.

    python benchmarks/experiments/ffi_padding_rows.py [--repeats 50]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxattn.backends import AttentionLayer  # noqa: E402
from jaxattn.backends.flashinfer import FlashInferBackend, paged_pool_view  # noqa: E402
from jaxattn.batch import ForwardMode  # noqa: E402
from tests.test_flashinfer_ffi import scheduled_batch  # noqa: E402  (the failing GPU test's batches)


def dirty_rows(o, planned: int) -> list[int]:
    """The rows past the plan that hold anything but zeros."""
    o = np.float32(o)
    return [int(r) + planned for r in np.flatnonzero(np.any(o[planned:] != 0, axis=(1, 2)))]


def test_sequence() -> dict:
    """(c) tests/test_flashinfer_ffi.py's "extend" case step by step, with one change per variant; per variant and
    batch, the padding rows left non-zero after the backend's zeroing, on each of two calls of the step."""
    from jaxattn.backends import ReferenceBackend
    from tests.test_flashinfer_ffi import GPU_CASES

    case = GPU_CASES["extend"]
    tokens, num_slots, hq, hkv, d = case["tokens"], 4096, 4, 2, 128
    variants = {
        "as the test": dict(reference=True, return_lse=True, batches=(0, 1)),
        "no reference first": dict(reference=False, return_lse=True, batches=(0, 1)),
        "return_lse=False": dict(reference=True, return_lse=False, batches=(0, 1)),
        "first batch only": dict(reference=True, return_lse=True, batches=(0,)),
        "second batch first": dict(reference=True, return_lse=True, batches=(1, 0)),
    }
    found = {}
    for name, variant in variants.items():
        rng = np.random.default_rng(0)  # the same inputs in every variant
        bucket = max(16, *(max(lens) for lens in case["extend_lens"]))  # as the test, since d2f08e1
        batches = [scheduled_batch(rng, ForwardMode.EXTEND, s, e, tokens, num_slots, bucket)
                   for s, e in zip(case["seq_lens"], case["extend_lens"])]
        layer = AttentionLayer(0, hq, hkv, d)
        pools = [jnp.asarray(rng.standard_normal((num_slots, hkv, d)), jnp.bfloat16) for _ in range(2)]
        q, k, v = (jnp.asarray(rng.standard_normal((tokens, h, d)), jnp.bfloat16) for h in (hq, hkv, hkv))
        if variant["reference"]:
            ref = ReferenceBackend()
            for batch, r2t in batches:
                ref_step = jax.jit(lambda *a, b=batch, r=r2t: ref.forward(*a, layer, ref.init_forward_metadata(b, jnp.asarray(r))))
                jax.block_until_ready(ref_step(q, k, v, *pools))
        backend = FlashInferBackend(launch="ffi")
        lse = variant["return_lse"]
        step = jax.jit(lambda q, k, v, kb, vb, m: backend.forward(q, k, v, kb, vb, layer, m, return_lse=lse)[0])
        rows = {}
        for index in variant["batches"]:
            batch, r2t = batches[index]
            planned = int(np.asarray(batch.extend_lens).sum())
            meta = backend.plan(batch, r2t, [layer])
            valid = int(np.asarray(meta.token_valid).sum())
            rows[f"batch {index} (plan {planned}, valid {valid})"] = [dirty_rows(step(q, k, v, *pools, meta), planned)
                                                                      for _ in range(2)]
        found[name] = rows
        print(f"(c) {name}: {rows}", flush=True)
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    import torch

    rng = np.random.default_rng(0)
    tokens, num_slots, hq, hkv, d = 24, 4096, 4, 2, 128
    batch, r2t = scheduled_batch(rng, ForwardMode.EXTEND, [40, 9, 1], [11, 9, 1], tokens, num_slots)
    planned = int(np.asarray(batch.extend_lens).sum())  # 21
    layer = AttentionLayer(0, hq, hkv, d)
    pools = [jnp.asarray(rng.standard_normal((num_slots, hkv, d)), jnp.bfloat16) for _ in range(2)]
    q, k, v = (jnp.asarray(rng.standard_normal((tokens, h, d)), jnp.bfloat16) for h in (hq, hkv, hkv))
    record = dict(tokens=tokens, planned_rows=planned)

    # (a) The kernel alone, from torch, on the full bucket of q rows.
    backend = FlashInferBackend(launch="bridge")
    backend.plan(batch, r2t, [layer])
    (wrapper,) = backend.wrappers
    q_t = torch.from_dlpack(q)
    out = torch.full((tokens, hq, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((tokens, hq), float("nan"), dtype=torch.float32, device="cuda")
    cache = tuple(paged_pool_view(torch.from_dlpack(p), 1) for p in pools)
    wrapper.run(q_t, cache, out=out, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    written = (~torch.isnan(out.float()).all(dim=(1, 2))).cpu().numpy()
    record["backend"] = getattr(wrapper, "_backend", "?")
    record["rows_written_past_plan"] = [int(r) for r in np.flatnonzero(written[planned:]) + planned]
    print(f"(a) {record['backend']} run() on {tokens} q rows, plan {planned}: rows past the plan written: "
          f"{record['rows_written_past_plan'] or 'none'}", flush=True)

    # (b) The launch inside jit, then the backend's own zeroing; the bridge as the control.
    for launch in ("ffi", "bridge"):
        backend = FlashInferBackend(launch=launch)
        step = jax.jit(lambda q, k, v, kb, vb, m, b=backend: b.forward(q, k, v, kb, vb, layer, m)[0])
        meta = backend.plan(batch, r2t, [layer])
        dirty = 0
        for _ in range(args.repeats):
            o = np.float32(step(q, k, v, *pools, meta))
            dirty += bool(np.any(o[planned:] != 0))
        record[f"{launch}_steps_with_nonzero_padding"] = dirty
        print(f"(b) {launch}: {dirty} of {args.repeats} jitted steps left a padding row non-zero after the zeroing",
              flush=True)
    record["test_sequence"] = test_sequence()
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "ffi_padding_rows.json"), "w") as f:
        json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
