"""FlashInfer behind jaxattn's backend interface, bridged zero-copy through DLPack and usable inside `jax.jit`.

    backend = FlashInferBackend()
    meta = backend.plan(batch, req_to_token, layers)      # host work, before the jitted step (syncs)
    o, k_pool, v_pool = backend.forward(q, k, v, k_pool, v_pool, layer, meta)   # inside jit

`plan` builds FlashInfer's plan arguments (indptr, indices, last-page lengths, the bit-packed tree mask) on
the host and calls the wrappers' `plan()`; it returns a small pytree whose static part names the planned
wrappers, so a step jitted once keeps serving new plans. `forward` writes K/V with `write_kv` (JAX) and runs
the wrapper's kernel on XLA's stream on JAX's own buffers (no copies), one of two ways (`launch=`, or
$JAXATTN_FLASHINFER_LAUNCH): "bridge" (the default), the wrapper's `run()` through `jax.experimental.buffer_callback`
on DLPack views (`bridged_run`), or "ffi" (opt-in, `jaxattn.backends.flashinfer_ffi.choose_launch` says why), an XLA
FFI call through jax-tvm-ffi. LSEs from FlashInfer are base 2; jaxattn's are natural log: converted at the boundary.

Pages: the pool `[slots, kv_heads, head_dim]` is passed as `[slots // P, P, kv_heads, head_dim]` (a view,
`paged_pool_view`): page size 1 for a req_to_token table (every `last_page_len` 1), a `jaxattn.paging.PageTable`'s
page_size P otherwise (page ids, FlashInfer's own paging). torch and flashinfer are imported only when this backend
is used.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.backends.flashinfer_ffi import FfiLauncher, choose_launch, result_shapes
from jaxattn.backends.layer import AttentionLayer, split_heads
from jaxattn.checks import check_positive_int, check_sinks
from jaxattn.metadata import window_first_key
from jaxattn.paging import PageTable, page_in_pool
from jaxattn.serving.batch import ForwardBatch, ForwardMode
from jaxattn.serving.kv_pool import is_fp8, write_kv

LN2 = math.log(2.0)


def _require_flashinfer():
    try:
        import flashinfer  # noqa: F401
        import torch  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "FlashInferBackend needs torch and flashinfer-python (a CUDA GPU too): pip install 'jaxattn[flashinfer]'. "
            f"Import failed with: {error}"
        ) from error
    import flashinfer
    import torch

    return torch, flashinfer


def should_use_tensor_cores(kv_dtype, q_heads: int, kv_heads: int) -> bool:
    """FlashInfer decode's kernel choice: SGLang's rule for 16-bit KV (tensor cores with >= 4 query heads per KV head);
    fp8 KV without them, unlike SGLang: the plain decode kernel runs it on the H200 image (D1 0.486 ms,
    benchmarks/RESULTS.md), while the tensor-core (prefill) module for bf16 q and e4m3 KV that failed to build there
    was fa3's (`backend="auto"`); fa2's (what `attention_backend` now names for it) has not been timed."""
    if is_fp8(kv_dtype):
        return False
    if jnp.dtype(kv_dtype) in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return q_heads // kv_heads >= 4
    return False


def plan_dtype_names(q_dtype, kv_dtype) -> tuple[str, str]:
    """torch dtype names of FlashInfer's `q_data_type` / `kv_data_type`; ValueError for dtypes its kernels lack
    (float32 among them: use TritonBackend or ReferenceBackend for fp32)."""
    sixteen = {jnp.dtype(jnp.bfloat16): "bfloat16", jnp.dtype(jnp.float16): "float16"}
    if jnp.dtype(q_dtype) not in sixteen:
        raise ValueError(f"FlashInferBackend: q dtype {jnp.dtype(q_dtype).name} is not supported (bf16/fp16 only; "
                         "TritonBackend and ReferenceBackend take float32)")
    if jnp.dtype(kv_dtype) not in sixteen and not is_fp8(kv_dtype):
        raise ValueError(f"FlashInferBackend: KV pool dtype {jnp.dtype(kv_dtype).name} is not supported (bf16/fp16/fp8 only; "
                         "TritonBackend and ReferenceBackend take float32)")
    fp8 = {jnp.dtype(jnp.float8_e4m3fn): "float8_e4m3fn", jnp.dtype(jnp.float8_e5m2): "float8_e5m2"}
    return sixteen[jnp.dtype(q_dtype)], {**sixteen, **fp8}[jnp.dtype(kv_dtype)]


# ---------------------------------------------------------------------------------------------
# Plan arguments (host, numpy): testable without a GPU.


def plan_page_size(req_to_token) -> int:
    """FlashInfer's page_size for a table: a `jaxattn.paging.PageTable`'s page_size, 1 for a req_to_token table."""
    return req_to_token.page_size if isinstance(req_to_token, PageTable) else 1


def first_listed_key(kv_starts, page_size: int) -> np.ndarray:
    """Row position of each paged list's first key: the start of the page holding kv_starts (FlashInfer lists whole pages)."""
    return np.asarray(kv_starts) // page_size * page_size


def paged_kv_lists(table, rows, kv_starts, kv_lens, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's paged-KV lists of each sequence's token range (numpy, host).

    Sequence b lists positions kv_starts[b] .. kv_starts[b] + kv_lens[b] - 1 of request row rows[b], from the first
    slot of the page holding kv_starts[b]: FlashInfer's first key of a sequence is a page's first slot, so up to
    page_size - 1 earlier keys are listed too (the caller makes sure they are masked).

    Args:
      table: i32[max_reqs, max_pages]: page ids of every request row (page size 1: req_to_token's slots).
      rows, kv_starts, kv_lens: i32[B] (kv_lens >= 1).
      page_size: tokens per page.

    Returns:
      (kv_indptr i32[B + 1] over pages, kv_indices i32[kv_indptr[-1]]: page ids, kv_last_page_len i32[B]: tokens on
      each sequence's last page, 1..page_size, FlashInfer's convention).
    """
    table, rows = np.asarray(table), np.asarray(rows)
    first_key = first_listed_key(kv_starts, page_size)
    first_page = first_key // page_size
    listed = np.asarray(kv_starts) + np.asarray(kv_lens) - first_key  # keys from the first page's start
    num_pages = -(-listed // page_size)
    if np.any(first_page + num_pages > table.shape[1]):
        raise ValueError(f"a sequence's keys run past the table's {table.shape[1]} columns (page_size {page_size})")
    kv_indices = np.concatenate(
        [table[r, f : f + n] for r, f, n in zip(rows, first_page, num_pages)] + [np.zeros(0, np.int32)]
    ).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(num_pages)]).astype(np.int32)
    return kv_indptr, kv_indices, (listed - (num_pages - 1) * page_size).astype(np.int32)


def plan_arguments(batch: ForwardBatch, req_to_token, *, sliding_window: int = -1, cross_attention: bool = False,
                   num_slots: int | None = None) -> dict:
    """FlashInfer's plan inputs for one wrapper, as numpy arrays (host sync on the batch's arrays).

    Keys: qo_indptr (extend-like modes), kv_indptr, kv_indices, kv_last_page_len, and for TARGET_VERIFY (self
    attention) custom_mask (bool, flat per request [qo_len, listed keys], `listed_verify_mask`) and mask_indptr, also
    under a window (the mask's columns cut to the listed keys). With a sliding window the kv list keeps the last
    min(seq_len, W + q_len) keys (decode: W + 1), like SGLang's window wrapper; with cross attention it is the
    encoder's tokens; a decoder with encoder tokens lists its own tokens after them.

    Slots: FlashInfer's kernels read whatever the lists name, so slots outside the pool are listed as the padding
    slot 0, as the Triton and Mosaic GPU kernels read them (`jaxattn.paging.page_in_pool`, the one rule): a
    req_to_token table's slots outside [1, num_slots) (num_slots None: its negative slots only), a PageTable's pages
    outside its num_slots.

    Pages: a req_to_token table is planned with page size 1 (one slot per key, every last_page_len 1). A
    `jaxattn.paging.PageTable` is planned with its page_size P (`plan_page_size`): kv_indices are page ids (ids
    outside the pool read as the padding page 0, `jaxattn.paging.page_in_pool`), kv_indptr counts pages and
    kv_last_page_len the keys on each last page (1..P). A list starts on a page boundary: under a window the whole
    pages before the window's first key are dropped and FlashInfer's window_left (it masks by position, counted
    from the list's end, so distances are kept) hides the rest; a decoder whose first token is mid-page (encoder_lens
    not a multiple of P) with no window to hide the encoder keys on that page is refused.
    """
    page_size = plan_page_size(req_to_token)
    if isinstance(req_to_token, PageTable):
        pages = np.asarray(req_to_token.req_to_page)
        table = np.where(page_in_pool(pages, page_size, num_slots=req_to_token.num_slots), pages, 0)
    else:
        table = np.asarray(req_to_token)
        bound = np.iinfo(np.int64).max if num_slots is None else num_slots
        table = np.where(page_in_pool(table, 1, num_slots=bound), table, 0)
    rows = np.asarray(batch.req_pool_indices)
    seq_lens = np.asarray(batch.seq_lens)
    extend_lens = np.asarray(batch.extend_lens)
    encoder = None if batch.encoder_lens is None else np.asarray(batch.encoder_lens)
    check_plan_batch(rows, seq_lens, extend_lens, encoder, table.shape[0],
                     max_extend_len=batch.max_extend_len if batch.mode.is_extend_like else None)
    decode = batch.mode == ForwardMode.DECODE
    q_lens = np.ones_like(seq_lens) if decode else extend_lens
    dropped = np.zeros_like(seq_lens)  # keys before the window's first key (none without a window)
    if cross_attention:
        if encoder is None:
            raise ValueError("cross attention needs batch.encoder_lens")
        kv_lens, kv_starts = encoder, np.zeros_like(encoder)
    else:
        kv_lens = seq_lens.copy()
        kv_starts = np.zeros_like(seq_lens) if encoder is None else encoder.copy()
        if sliding_window >= 0:  # the keys the first query can see on (window_first_key): min(seq_len, W + q_len)
            dropped = np.asarray(window_first_key(seq_lens - q_lens, sliding_window))
            kv_starts = kv_starts + dropped
            kv_lens = seq_lens - dropped
    # Padding rows (seq_len 0) get one key, the padding slot 0, so no kernel sees an empty list; their outputs
    # are zeroed afterwards (FlashInferMetadata.token_valid).
    padding = seq_lens <= 0
    kv_lens = np.where(padding, 1, kv_lens)
    kv_starts = np.where(padding, 0, kv_starts)
    seen_mid_page = (kv_starts % page_size != 0) & (dropped == 0) & ~padding
    if np.any(seen_mid_page):
        raise NotImplementedError(
            f"FlashInferBackend with page_size {page_size}: batch.encoder_lens {encoder[seen_mid_page].tolist()} are "
            "not multiples of page_size, so the decoder's first page would show it the encoder's last keys (FlashInfer "
            "lists whole pages); use page_size 1 or page-aligned encoder lengths")
    kv_indptr, kv_indices, kv_last_page_len = paged_kv_lists(table, rows, kv_starts, kv_lens, page_size)
    kv_indices[kv_indptr[:-1][padding]] = 0
    args = dict(kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=kv_last_page_len)
    if not decode:
        args["qo_indptr"] = np.asarray(batch.qo_indptr).astype(np.int32)  # draft_mask: D rows per sequence
    if batch.mode == ForwardMode.TARGET_VERIFY and not cross_attention:  # cross layers see every encoder key
        listed = (np.diff(kv_indptr) - 1) * page_size + kv_last_page_len
        # The decoder position of each list's first key (a page start; under a window the window hides the keys
        # between it and the window's first key, FlashInfer applying window_left and the mask both).
        first = first_listed_key(kv_starts, page_size) - (0 if encoder is None else encoder)
        qo_lens = np.diff(args["qo_indptr"])  # draft_mask batches: D rows for padding sequences too
        args["custom_mask"], args["mask_indptr"] = listed_verify_mask(
            np.asarray(batch.verify_custom_mask(), bool), extend_lens, seq_lens, qo_lens, first, listed)
    return args


def check_plan_batch(rows, seq_lens, extend_lens, encoder_lens, table_rows: int, max_extend_len: int | None = None) -> None:
    """ValueError naming the field when a batch's host values cannot be planned: every request row inside the table
    (padding sequences' too: their padding key is listed from their row), lengths >= 0, extend_lens <= seq_lens, and
    (extend-like modes: max_extend_len given) extend_lens <= the batch's max_extend_len bucket, whose longer rows the
    other backends do not compute (FlashInfer would: the backends would disagree). FlashInfer's kernels trust the
    plan's lists, so they are checked on the host before any is built."""
    def bad(name, values, mask, expected):
        where = np.flatnonzero(mask)
        raise ValueError(f"FlashInferBackend.plan: batch.{name} must be {expected}; sequences {where[:8].tolist()} have "
                         f"{np.asarray(values)[where[:8]].tolist()}")

    if np.any((rows < 0) | (rows >= table_rows)):
        bad("req_pool_indices", rows, (rows < 0) | (rows >= table_rows), f"rows of the table, in [0, {table_rows})")
    for name, values in (("seq_lens", seq_lens), ("extend_lens", extend_lens), ("encoder_lens", encoder_lens)):
        if values is not None and np.any(values < 0):
            bad(name, values, values < 0, ">= 0")
    if np.any(extend_lens > seq_lens):
        bad("extend_lens", extend_lens, extend_lens > seq_lens, "<= seq_lens (new tokens are part of the sequence)")
    if max_extend_len is not None and np.any(extend_lens > max_extend_len):
        bad("extend_lens", extend_lens, extend_lens > max_extend_len,
            f"<= batch.max_extend_len ({max_extend_len}, the bucket; TritonBackend and ReferenceBackend leave longer "
            "rows uncomputed)")


def listed_verify_mask(full_mask, extend_lens, seq_lens, qo_lens, first, listed) -> tuple[np.ndarray, np.ndarray]:
    """A verify step's tree mask over the keys FlashInfer lists (numpy, host).

    full_mask: bool, sequence b's rows [extend_len, seq_len] at its custom-mask offset (`ForwardBatch.
    verify_custom_mask`). qo_lens: query rows FlashInfer plans per sequence (a padding sequence's rows see nothing);
    first: decoder position of each list's first key; listed: keys listed. Returns (bool[sum(qo_len * listed)],
    mask_indptr i64[B + 1]): row i of sequence b sees listed key j iff the full mask has position first[b] + j in
    row i (keys before the decoder's first, and rows or keys past the full mask, are hidden).
    """
    starts = np.concatenate([[0], np.cumsum(extend_lens * seq_lens)]).astype(np.int64)
    blocks = []
    for b, (q_len, kv_len) in enumerate(zip(qo_lens, listed)):
        block = np.zeros((q_len, kv_len), bool)
        rows, width = min(int(extend_lens[b]), int(q_len)), int(seq_lens[b])
        if rows > 0 and width > 0:
            full = full_mask[starts[b] : starts[b] + extend_lens[b] * width].reshape(-1, width)[:rows]
            positions = first[b] + np.arange(kv_len)
            inside = (positions >= 0) & (positions < width)
            block[:rows, inside] = full[:, positions[inside]]
        blocks.append(block.reshape(-1))
    mask_indptr = np.concatenate([[0], np.cumsum([blk.size for blk in blocks])]).astype(np.int64)
    return np.concatenate(blocks + [np.zeros(0, bool)]), mask_indptr


# ---------------------------------------------------------------------------------------------


_external_streams: dict = {}


def _torch_stream(torch, stream_pointer: int):
    """The torch handle of XLA's stream, made once per stream (constructing it costs host time every call)."""
    stream = _external_streams.get(stream_pointer)
    if stream is None:
        stream = _external_streams[stream_pointer] = torch.cuda.ExternalStream(stream_pointer)
    return stream


def _torch_view(buffer):
    """A torch tensor over an XLA buffer, no copy. The DLPack capsule is taken with stream=-1 (DLPack: the producer
    does no synchronisation): the callback already runs on XLA's stream, so nothing needs ordering, and skipping
    torch.from_dlpack's stream handshake saves ~10 us of host time per buffer (H200, benchmarks/results/)."""
    from torch.utils import dlpack as torch_dlpack

    return torch_dlpack.from_dlpack(buffer.__dlpack__(stream=-1))


def paged_pool_view(pool, page_size: int):
    """FlashInfer's NHD page view of a flat pool, no copy: torch [slots, kv_heads, D] -> [slots // page_size,
    page_size, kv_heads, D]. The pool's rows are page-aligned (`jaxattn.paging`: page p is slots [p * P, (p + 1) * P)),
    so page p of the view is exactly those slots; page size 1 is [slots, 1, kv_heads, D]."""
    if pool.shape[0] % page_size:
        raise ValueError(f"the KV pool's {pool.shape[0]} rows are not a multiple of page_size {page_size}")
    return pool.unflatten(0, (pool.shape[0] // page_size, page_size))


def bridged_run(wrapper, q, k_pool, v_pool, v_head_dim: int, *, k_scale=None, v_scale=None, has_side_effect=False,
                page_size: int = 1, variant_args: tuple = (), planned_rows=None):
    """Runs a planned FlashInfer wrapper on JAX arrays, inside or outside jit, with no copies.

    `jax.experimental.buffer_callback` hands the callback XLA's device buffers and stream; torch sees them
    through DLPack and FlashInfer runs on `torch.cuda.ExternalStream(stream)`, so the kernel is ordered with
    the rest of the XLA program. Returns (o [T, q_heads, v_head_dim], base-2 lse f32[T, q_heads]).
    has_side_effect: keep XLA from merging calls on identical inputs (the benchmark's repeated layers).
    page_size: the page size the wrapper was planned with; the pools go in as `paged_pool_view`s.
    variant_args: the extra arguments of a wrapper built for a FlashInfer attention variant, in its order, passed to
      run() after the KV cache (the sink wrapper's (sinks f32[q_heads], sm_scale): `sink_variant_args`); JAX arrays
      among them go in as views like q, the others as they are.
    planned_rows: None, or a function called at each launch giving the query rows the wrapper's current plan covers
      (its qo_indptr[-1]); q, out and lse then go in as their first that many rows (flashinfer 0.7 refuses a q with
      more rows than planned; a bucket's padding rows past them are left unwritten, as the kernels leave them; a plan
      of no rows runs nothing).
    """
    import torch
    from jax.experimental.buffer_callback import buffer_callback

    is_array = [isinstance(a, jax.Array) for a in variant_args]
    arrays = [a for a, array in zip(variant_args, is_array) if array]

    def run(ctx, outputs, q_buf, k_buf, v_buf, *array_bufs):
        out_buf, lse_buf = outputs
        with torch.cuda.stream(_torch_stream(torch, ctx.stream)):
            cache = (paged_pool_view(_torch_view(k_buf), page_size), paged_pool_view(_torch_view(v_buf), page_size))
            views = iter([_torch_view(b) for b in array_bufs])
            extra = [next(views) if array else a for a, array in zip(variant_args, is_array)]
            rows = _launch_rows(planned_rows)
            if rows is None:
                return
            wrapper.run(_torch_view(q_buf)[rows], cache, *extra, out=_torch_view(out_buf)[rows],
                        lse=_torch_view(lse_buf)[rows], return_lse=True, k_scale=k_scale, v_scale=v_scale)

    out_shape = result_shapes(q, v_head_dim)
    return buffer_callback(run, out_shape, has_side_effect=has_side_effect)(q, k_pool, v_pool, *arrays)


def _launch_rows(planned_rows) -> slice | None:
    """The rows of q / out / lse a launch hands FlashInfer (`bridged_run`'s planned_rows), or None when its plan has
    none (padding only: nothing runs, the backend zeroes every row)."""
    if planned_rows is None:
        return slice(None)
    rows = planned_rows()
    return slice(rows) if rows > 0 else None


def sink_variant_args(sinks, sm_scale: float, k_scale=None) -> tuple:
    """The run() arguments of FlashInfer's sink-aware wrapper (`BatchAttentionWithAttentionSinkWrapper`, flashinfer
    0.6.0 attention.py; its "AttentionSink" variant, jit/attention/variants.py): (sinks f32[q_heads], sm_scale).
    The variant reads its softmax scale from these arguments, so an fp8 pool's k_scale (a float) is folded in here
    and must not also go to run() (0.6.0's run() folds it into a scale the variant ignores; 0.7's sink wrapper folds
    it into this one). Its sinks are natural-log logits joining the denominator (and the LSE), as jaxattn's."""
    return jnp.asarray(sinks, jnp.float32), float(sm_scale) * (1.0 if k_scale is None else float(k_scale))


# Deterministic mode (`FlashInferBackend(deterministic=True)`), as SGLang's FlashInfer backend runs it: FA2's split-KV
# at a fixed split size (in tokens here; FlashInfer counts pages), so a sequence's partials and their merge do not
# depend on the rest of the batch (SGLANG_FLASHINFER_{PREFILL,DECODE}_SPLIT_TILE_SIZE's defaults), and tensor-core
# decode (FlashInfer's fixed split size is implemented there only, flashinfer 0.6.0 decode.py plan()). Its plans pass
# the split size to fa2's planner only (0.6.0 prefill.py / decode.py plan(): `if self._backend == "fa2"`), so the
# deterministic wrappers are fa2 ones (`attention_backend`).
DETERMINISTIC_PREFILL_SPLIT_TOKENS = 4096
DETERMINISTIC_DECODE_SPLIT_TOKENS = 2048


# FlashInfer 0.6.0's Hopper (fa3) prefill: what it takes. Its backend="auto" picks fa3 on sm_90 without asking
# (utils.py is_fa3_backend_supported checks positional encoding, fp16 reductions and custom masks only), so the
# backend names fa2 wherever fa3 would fail: head dims (hopper/prefill_sm90.cuh asserts HEAD_DIM_VO in 64/128/256),
# and 16-bit q over an fp8 pool (fa3's fp8 kernels want fp8 q: the bf16-q / e4m3-KV module failed to build on the
# H200, benchmarks/results/2026-12-03_h200_extend_fp8_b45b5d5.log).
FA3_HEAD_DIMS = (64, 128, 256)


def fa3_declines(q_dtype, kv_dtype, head_dim: int, dv: int) -> str | None:
    """Why FlashInfer's fa3 prefill cannot take a call of these dtypes and head dims, or None."""
    if jnp.dtype(q_dtype) != jnp.dtype(kv_dtype):
        return (f"fa3 takes no {jnp.dtype(q_dtype).name} q over a {jnp.dtype(kv_dtype).name} pool (its fp8 kernels "
                "want fp8 q)")
    if head_dim != dv or head_dim not in FA3_HEAD_DIMS:
        return f"fa3 takes head dims {FA3_HEAD_DIMS} (qk = vo) only; got {head_dim}/{dv}"
    return None


def attention_backend(q_dtype, kv_dtype, head_dim: int, dv: int, *, deterministic: bool, hopper: bool,
                      custom_mask: bool = False) -> str:
    """The `backend` FlashInferBackend builds its paged-prefill, sink and decode wrappers with: "fa3" on Hopper
    (sm_90) where it takes the call, else "fa2"; "fa2" in deterministic mode (the fixed split size is fa2's) and for a
    custom mask (TARGET_VERIFY's tree: 0.6.0's fa3 paged prefill returns cudaErrorNotSupported for one, and its own
    `determine_attention_backend` picks fa2 there). Decode wrappers use it for their tensor-core path only."""
    if not hopper or deterministic or custom_mask or fa3_declines(q_dtype, kv_dtype, head_dim, dv):
        return "fa2"
    return "fa3"


# FlashInfer 0.6.0 names a sink wrapper's JIT module by q's dtype, window or not, and backend only (attention.py,
# BatchAttentionWithAttentionSinkWrapper: "batch_prefill_attention_sink_{q}_swa_{window}_{backend}"), not by the pool's
# dtype or the head dims: a second configuration under one name would build over the first's library, which the
# process has already loaded. Process-wide, as FlashInfer's module cache is: name -> (pool dtype, head dims).
_SINK_MODULES: dict[str, tuple] = {}


def forget_sink_modules() -> None:
    """Empties the process's record of sink module names (`claim_sink_module`): for a tool that plans configurations
    as separate processes would run them (scripts/prebuild_flashinfer.py) and for tests; never while FlashInfer's own
    module cache holds them."""
    _SINK_MODULES.clear()


def claim_sink_module(q_name: str, kv_name: str, head_dim: int, dv: int, window: int, backend: str) -> None:
    """Records the sink module FlashInfer will build for this configuration; NotImplementedError if the process
    already holds another configuration under the same module name."""
    short = {"bfloat16": "bf16", "float16": "f16"}[q_name]  # 0.6.0 jit/utils.py filename_safe_dtype_map
    name = f"batch_prefill_attention_sink_{short}_swa_{window >= 0}_{backend}"
    config = (kv_name, head_dim, dv)
    held = _SINK_MODULES.setdefault(name, config)
    if held != config:
        raise NotImplementedError(
            f"FlashInfer 0.6.0 builds sink layers of a {kv_name} pool with head dims {head_dim}/{dv} under the module "
            f"name {name!r}, which this process already loaded for a {held[0]} pool with head dims {held[1]}/{held[2]} "
            "(its name omits both): run the other configuration in its own process, or use TritonBackend")


# FlashInfer's MLA wrapper (`BatchMLAPagedAttentionWrapper`) takes DeepSeek's absorbed shape: one latent kv head of
# 576 dims, the first 512 the compressed KV (V; `ckv`), the last 64 its rope part (`kpe`).
FLASHINFER_MLA_HEAD_DIMS = (576, 512)


def _mla_shape(kv_heads: int, head_dim: int, dv: int) -> bool:
    return kv_heads == 1 and (head_dim, dv) == FLASHINFER_MLA_HEAD_DIMS


def is_flashinfer_mla(layer: AttentionLayer) -> bool:
    """Whether FlashInferBackend runs `layer` on FlashInfer's MLA wrapper (its pool is then latent: v_pool None)."""
    return _mla_shape(layer.kv_heads, layer.head_dim, layer.dv)


def _mla_kind(kind) -> bool:  # a FlashInferBackend.layer_kind of an MLA layer (`is_flashinfer_mla`)
    _, _, _, _, _, kv_heads, head_dim, dv, _ = kind
    return _mla_shape(kv_heads, head_dim, dv)


def _check_mla_layer(layer: AttentionLayer, mode: ForwardMode, kv_dtype) -> None:
    """NotImplementedError naming what FlashInfer's MLA wrapper cannot take (it is causal attention, nothing more)."""
    refused = {"sliding window": layer.sliding_window >= 0, "soft cap": layer.logit_cap > 0, "sinks": layer.has_sinks,
               "cross attention": layer.is_cross_attention, "custom (tree) mask": mode == ForwardMode.TARGET_VERIFY,
               "fp8 pool": is_fp8(kv_dtype)}
    for what, present in refused.items():
        if present:
            raise NotImplementedError(f"layer {layer.layer_id}: FlashInfer's MLA wrapper takes no {what}; use "
                                      "TritonBackend for this MLA layer")


def bridged_mla_run(wrapper, q, latent_pool, v_head_dim: int, *, has_side_effect=False, page_size: int = 1,
                    planned_rows=None):
    """Runs a planned `BatchMLAPagedAttentionWrapper` on JAX arrays, as `bridged_run` runs the other wrappers.

    q [T, q_heads, qk_dim] goes in as its latent part q[..., :v_head_dim] and its rope part (two copies, the
    wrapper's q_nope / q_pe); latent_pool [slots, 1, qk_dim] as pages [slots // P, P, qk_dim] whose first v_head_dim
    dims are the wrapper's ckv cache and the rest its kpe cache (strided views of the pool, no copy).
    Returns (o [T, q_heads, v_head_dim], base-2 lse f32[T, q_heads]). planned_rows: as `bridged_run`'s.
    """
    import torch
    from jax.experimental.buffer_callback import buffer_callback

    def run(ctx, outputs, nope_buf, pe_buf, pool_buf):
        out_buf, lse_buf = outputs
        with torch.cuda.stream(_torch_stream(torch, ctx.stream)):
            pages = paged_pool_view(_torch_view(pool_buf), page_size)[:, :, 0]  # [pages, P, qk_dim]: one kv head
            rows = _launch_rows(planned_rows)
            if rows is None:
                return
            wrapper.run(_torch_view(nope_buf)[rows], _torch_view(pe_buf)[rows], pages[..., :v_head_dim],
                        pages[..., v_head_dim:], out=_torch_view(out_buf)[rows], lse=_torch_view(lse_buf)[rows],
                        return_lse=True)

    out_shape = result_shapes(q, v_head_dim)
    return buffer_callback(run, out_shape, has_side_effect=has_side_effect)(
        q[..., :v_head_dim], q[..., v_head_dim:], latent_pool)


def token_valid(batch: ForwardBatch) -> np.ndarray:
    """bool[T]: tokens that belong to a real sequence (others are padding and get zero output)."""
    if batch.mode == ForwardMode.DECODE:
        return np.asarray(batch.seq_lens) > 0
    if batch.draft_mask is not None:  # D rows per sequence, padding sequences included
        return np.repeat(np.asarray(batch.seq_lens) > 0, batch.draft_mask.shape[1])
    return np.arange(batch.num_tokens) < int(np.asarray(batch.extend_lens).sum())


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FlashInferMetadata:
    out_cache_loc: jax.Array  # i32[T]
    token_valid: jax.Array  # bool[T]
    mode: ForwardMode = dataclasses.field(metadata=dict(static=True))
    num_tokens: int = dataclasses.field(metadata=dict(static=True))
    page_size: int = dataclasses.field(default=1, metadata=dict(static=True))  # the wrappers' planned page size
    # The pool rows the plan was made for (its lists name no slot past them); None: not given to plan().
    num_slots: int | None = dataclasses.field(default=None, metadata=dict(static=True))


class FlashInferBackend:
    """FlashInfer decode / paged prefill (with tree masks and windows) behind the jaxattn backend interface.

    One planned wrapper per mode, layer kind (window or full, cross or self, soft cap, scale, head shapes, sinks) and
    q / pool dtypes: `plan` re-plans them in place each step; their identity is static, so the jitted step is traced
    once. Layers with attention sinks
    (`AttentionLayer(has_sinks=True)`) run FlashInfer's sink-aware wrapper (`BatchAttentionWithAttentionSinkWrapper`,
    its paged prefill with an "AttentionSink" variant, also for decode steps: one query row per sequence); it takes
    no soft cap and no custom mask. MLA layers of DeepSeek's shape (`is_flashinfer_mla`: one 576/512 latent kv head,
    a latent pool) run FlashInfer's MLA wrapper (`BatchMLAPagedAttentionWrapper`, causal; no window, soft cap, sinks,
    custom mask or fp8 pool), through the bridge in either launch mode.

    deterministic: batch-invariant outputs as SGLang's deterministic inference gets them from FlashInfer: every plan
    takes a fixed split size (`DETERMINISTIC_PREFILL_SPLIT_TOKENS` / `DETERMINISTIC_DECODE_SPLIT_TOKENS`, in pages of
    the plan's page size) on fa2 wrappers (the split size is fa2's) and decode runs on tensor cores
    (use_tensor_cores=False is refused); MLA layers are refused (FlashInfer's MLA wrapper has no fixed split size).
    As in SGLang, extend is invariant only among batches whose average query length per sequence gives FlashInfer's
    fa2 planner the same q tile (16, 64 or 128 rows, chosen per plan), which fixes a row's reduction order.

    Wrappers take fa3 (FlashInfer's Hopper kernels) where it takes the layer and dtypes, fa2 otherwise
    (`attention_backend`); layers whose V head dim differs from K's are refused unless they are MLA layers.
    """

    name = "flashinfer"

    def __init__(self, workspace_bytes: int = 384 << 20, use_tensor_cores: bool | None = None, launch: str | None = None,
                 deterministic: bool = False, modules: tuple | None = None):
        """modules: (torch, flashinfer) to use instead of importing them, e.g. stand-ins that record which wrappers
        the backend builds and how it plans them, without a GPU (scripts/prebuild_flashinfer.py, the tests)."""
        if deterministic and use_tensor_cores is False:
            raise ValueError("deterministic=True needs tensor-core decode (FlashInfer's fixed split size is implemented "
                             "there only): leave use_tensor_cores None or True")
        self.torch, self.flashinfer = _require_flashinfer() if modules is None else modules
        self.deterministic = deterministic
        self.hopper = self.torch.cuda.get_device_capability()[0] == 9  # where FlashInfer's fa3 kernels run
        self.launch = choose_launch(launch)  # "ffi" | "bridge"
        self._ffi = FfiLauncher(flashinfer_version=self.flashinfer.__version__) if self.launch == "ffi" else None
        self.workspace = self.torch.empty(workspace_bytes, dtype=self.torch.uint8, device="cuda")
        self.use_tensor_cores = use_tensor_cores
        # Keyed by (mode, layer kind, q and pool dtype names): a jitted step holds the wrapper it was traced with, so
        # a key's wrapper is built once and re-planned in place (a sink wrapper is compiled for its dtypes).
        self._wrappers: dict = {}
        self._planned_rows: dict = {}  # the same keys -> query rows the current plan covers (read at each launch)
        self._mode = None

    @property
    def wrappers(self) -> list:
        """The FlashInfer wrappers built so far, one per (mode, layer kind, dtypes), in the order they were built."""
        return list(self._wrappers.values())

    @staticmethod
    def layer_kind(layer: AttentionLayer):
        return (layer.sliding_window, layer.is_cross_attention, layer.logit_cap, layer.scale, layer.q_heads, layer.kv_heads,
                layer.head_dim, layer.dv, layer.has_sinks)

    @staticmethod
    def _key(mode: ForwardMode, kind, q_dtype, kv_dtype) -> tuple:
        return (mode, kind, *plan_dtype_names(q_dtype, kv_dtype))

    def _wrapper(self, mode: ForwardMode, kind, q_dtype, kv_dtype, q_t, kv_t, key):
        """The wrapper under `key`, built when missing: q_dtype / kv_dtype the (JAX) dtypes of q and the pool, q_t /
        kv_t their torch dtypes."""
        if key in self._wrappers:
            return self._wrappers[key]
        window, cross, _, _, q_heads, kv_heads, head_dim, dv, sinks = kind
        fi = self.flashinfer
        # A verify step's self-attention layers plan the tree mask (`plan_arguments`); cross layers see every key.
        backend = attention_backend(q_dtype, kv_dtype, head_dim, dv, deterministic=self.deterministic,
                                    hopper=self.hopper, custom_mask=mode == ForwardMode.TARGET_VERIFY and not cross)
        if _mla_kind(kind):
            self._wrappers[key] = fi.BatchMLAPagedAttentionWrapper(self.workspace, backend="auto")
        elif sinks:  # built for its dtypes, head dims and window (FlashInfer JIT-compiles the variant for them)
            claim_sink_module(*plan_dtype_names(q_dtype, kv_dtype), head_dim, dv, window, backend)
            self._wrappers[key] = fi.BatchAttentionWithAttentionSinkWrapper(
                self.workspace, "NHD", backend=backend, q_data_type=q_t, kv_data_type=kv_t, head_dim_qk=head_dim,
                head_dim_vo=dv, window_left=window)
        else:
            if mode == ForwardMode.DECODE:
                tc = self.use_tensor_cores
                if tc is None:
                    tc = self.deterministic or should_use_tensor_cores(kv_dtype, q_heads, kv_heads)
                self._wrappers[key] = fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=tc,
                                                                            backend=backend)
            else:
                self._wrappers[key] = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=backend)
        return self._wrappers[key]

    def plan(self, batch: ForwardBatch, req_to_token, layers, *, q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
             num_slots: int | None = None) -> FlashInferMetadata:
        """Host work before the step: plans one wrapper per distinct layer kind. Waits for the previous step.

        req_to_token: i32[max_reqs, max_context_len] (page size 1), or a `jaxattn.paging.PageTable`: planned with
        its page_size (`plan_arguments`), and `forward` hands FlashInfer the pools as pages (`paged_pool_view`).
        num_slots: the pools' rows, for a req_to_token table (a PageTable has its own): slots outside them are
        listed as the padding slot 0 (FlashInfer's kernels would read past the pool), and `forward` refuses a
        smaller pool. Without it only negative slots are caught.
        """
        if isinstance(req_to_token, PageTable):
            if num_slots is not None and num_slots != req_to_token.num_slots:
                raise ValueError(f"num_slots {num_slots} differs from the PageTable's num_slots {req_to_token.num_slots}")
            num_slots = req_to_token.num_slots
        elif num_slots is not None:
            check_positive_int("num_slots", num_slots)
            num_slots = int(num_slots)
        torch = self.torch
        q_name, kv_name = plan_dtype_names(q_dtype, kv_dtype)
        valid = jnp.asarray(token_valid(batch))
        page_size = plan_page_size(req_to_token)
        if batch.mode == ForwardMode.IDLE:
            return FlashInferMetadata(batch.out_cache_loc, valid, batch.mode, batch.num_tokens, page_size, num_slots)
        for layer in layers:
            if is_flashinfer_mla(layer):
                _check_mla_layer(layer, batch.mode, kv_dtype)
                if self.deterministic:
                    raise NotImplementedError(f"layer {layer.layer_id}: FlashInfer's MLA wrapper has no fixed split size "
                                              "(deterministic=True); use TritonBackend's deterministic mode for MLA")
            elif layer.dv != layer.head_dim:
                # 0.6.0's paged kernels read K and V pages of one stride (batch_prefill.cu, batch_prefill_sm90.cu)
                # and decode takes one head dim (batch_decode.cu).
                raise NotImplementedError(f"layer {layer.layer_id}: FlashInfer's paged kernels take K and V of one head "
                                          f"dim over separate pools; got {layer.head_dim}/{layer.dv} (use TritonBackend)")
            if layer.has_sinks and layer.logit_cap > 0:
                raise NotImplementedError(f"layer {layer.layer_id}: FlashInfer's sink-aware wrapper takes no soft cap; "
                                          "use TritonBackend for layers with sinks and a soft cap")
            if layer.has_sinks and batch.mode == ForwardMode.TARGET_VERIFY:
                raise NotImplementedError(f"layer {layer.layer_id}: FlashInfer's sink-aware wrapper takes no custom "
                                          "(tree) mask; use TritonBackend to verify drafts on layers with sinks")
        jax.block_until_ready(batch.seq_lens)  # the wrappers' buffers are reused: the last step must be done
        q_t, kv_t = getattr(torch, q_name), getattr(torch, kv_name)
        for kind in dict.fromkeys(self.layer_kind(layer) for layer in layers):
            window, cross, cap, scale, q_heads, kv_heads, head_dim, dv, sinks = kind
            args = plan_arguments(batch, req_to_token, sliding_window=window, cross_attention=cross, num_slots=num_slots)
            mla = _mla_kind(kind)
            if (sinks or mla) and batch.mode == ForwardMode.DECODE:  # a prefill-style plan: one query row per sequence
                args["qo_indptr"] = np.arange(len(args["kv_last_page_len"]) + 1, dtype=np.int32)
            if mla:  # the MLA wrapper takes each sequence's key count instead of its last page's
                pages = np.diff(args["kv_indptr"])
                args["kv_len"] = ((pages - 1) * page_size + args.pop("kv_last_page_len")).astype(np.int32)
            dev = {k: torch.from_numpy(v).cuda() for k, v in args.items()}
            key = self._key(batch.mode, kind, q_dtype, kv_dtype)
            wrapper = self._wrapper(batch.mode, kind, q_dtype, kv_dtype, q_t, kv_t, key)
            rows = args["qo_indptr"][-1] if "qo_indptr" in args else len(args["kv_last_page_len"])  # decode: one each
            self._planned_rows[key] = int(rows)
            common = dict(logits_soft_cap=cap if cap > 0 else None, sm_scale=scale, q_data_type=q_t, kv_data_type=kv_t)
            if self.deterministic:
                split_tokens = DETERMINISTIC_DECODE_SPLIT_TOKENS if batch.mode == ForwardMode.DECODE and not sinks \
                    else DETERMINISTIC_PREFILL_SPLIT_TOKENS
                common["fixed_split_size"] = max(split_tokens // page_size, 1)
            if mla:  # causal: a query sees its sequence's keys up to its own position (one query: all of them)
                wrapper.plan(dev["qo_indptr"], dev["kv_indptr"], dev["kv_indices"], dev["kv_len"], q_heads, dv,
                             head_dim - dv, page_size, True, scale, q_t, kv_t)
            elif batch.mode == ForwardMode.DECODE and not sinks:
                wrapper.plan(dev["kv_indptr"], dev["kv_indices"], dev["kv_last_page_len"], q_heads, kv_heads, head_dim,
                             page_size, window_left=window, **common)
            else:
                wrapper.plan(dev["qo_indptr"], dev["kv_indptr"], dev["kv_indices"], dev["kv_last_page_len"], q_heads, kv_heads,
                             head_dim, page_size, head_dim_vo=dv, custom_mask=dev.get("custom_mask"), causal=not cross and "custom_mask" not in dev,
                             window_left=window, **common)
        torch.cuda.synchronize()
        return FlashInferMetadata(batch.out_cache_loc, valid, batch.mode, batch.num_tokens, page_size, num_slots)

    def forward(self, q, k, v, k_pool, v_pool, layer: AttentionLayer, meta: FlashInferMetadata, *, sinks=None, save_kv=True,
                return_lse=False):
        layer.check_sinks(sinks)
        if sinks is not None and not layer.has_sinks:  # its plan chose a wrapper without sinks
            raise ValueError(f"layer {layer.layer_id}: FlashInferBackend takes sinks for layers planned with them "
                             "(AttentionLayer(has_sinks=True): FlashInfer's sink-aware wrapper); this one has none")
        if layer.xai_temperature_len > 0:
            raise NotImplementedError("FlashInfer has no xai temperature: use TritonBackend")
        mla = is_flashinfer_mla(layer)
        if mla != (v_pool is None):
            raise NotImplementedError(
                f"layer {layer.layer_id}: FlashInferBackend runs latent pools (v_pool None) on FlashInfer's MLA wrapper, "
                f"which takes one {FLASHINFER_MLA_HEAD_DIMS[0]}/{FLASHINFER_MLA_HEAD_DIMS[1]} kv head and no separate "
                f"V pool; this layer has {layer.kv_heads} kv heads of {layer.head_dim}/{layer.dv} and v_pool "
                f"{'None' if v_pool is None else 'given'} (TritonBackend and ReferenceBackend take both)")
        q = split_heads(q, layer.q_heads, layer.head_dim, "q")
        if meta.mode == ForwardMode.IDLE:
            out = jnp.zeros((q.shape[0], layer.q_heads, layer.dv), q.dtype)
            return (out, jnp.full(out.shape[:2], -jnp.inf), k_pool, v_pool) if return_lse else (out, k_pool, v_pool)
        if save_kv and k is not None:
            k = split_heads(k, layer.kv_heads, layer.head_dim, "k")
            v = None if mla else split_heads(v, layer.kv_heads, layer.dv, "v")  # a latent pool: V is part of K
            k_pool, v_pool = write_kv(k_pool, v_pool, meta.out_cache_loc, k, v, k_scale=layer.k_scale, v_scale=layer.v_scale)
        key = self._key(meta.mode, self.layer_kind(layer), q.dtype, k_pool.dtype)
        if key not in self._wrappers:
            raise ValueError(f"layer {layer.layer_id} was not planned for this step's mode and dtypes (q {q.dtype.name}, pool "
                             f"{k_pool.dtype.name}): pass it to FlashInferBackend.plan(batch, req_to_token, layers, "
                             "q_dtype=, kv_dtype=)")
        if k_pool.shape[0] % meta.page_size:
            raise ValueError(f"k_pool's {k_pool.shape[0]} rows are not a multiple of the planned page_size {meta.page_size}")
        if meta.num_slots is not None and k_pool.shape[0] < meta.num_slots:
            raise ValueError(f"k_pool has {k_pool.shape[0]} rows; the step was planned for a pool of {meta.num_slots} "
                             "slots, whose lists may name slots past it")
        if mla:
            o, lse2 = bridged_mla_run(self._wrappers[key], q, k_pool, layer.dv, page_size=meta.page_size,
                                      planned_rows=lambda: self._planned_rows[key])
            return self._finish(o, lse2, q.dtype, meta, return_lse, k_pool, v_pool)
        scales = layer.pool_scales(k_pool, v_pool)  # a 16-bit pool holds the values themselves: no scales
        variant = ()
        if sinks is not None:
            check_sinks(sinks, layer.q_heads)
            variant = sink_variant_args(sinks, layer.scale, scales.pop("k_scale", None))  # folded there, not in run()
        if self._ffi is None:
            o, lse2 = bridged_run(self._wrappers[key], q, k_pool, v_pool, layer.dv, page_size=meta.page_size,
                                  variant_args=variant, planned_rows=lambda: self._planned_rows[key], **scales)
        else:
            o, lse2 = self._ffi.run(self._wrappers[key], q, k_pool, v_pool, layer.dv, page_size=meta.page_size,
                                    variant_args=variant, **scales)
        return self._finish(o, lse2, q.dtype, meta, return_lse, k_pool, v_pool)

    @staticmethod
    def _finish(o, lse2, dtype, meta: FlashInferMetadata, return_lse: bool, k_pool, v_pool):
        """forward's results: padding tokens' rows zeroed (LSE -inf), the LSE in natural log."""
        o = jnp.where(meta.token_valid[:, None, None], o, 0).astype(dtype)
        lse2 = jnp.where(meta.token_valid[:, None], lse2, -jnp.inf)
        if return_lse:
            return o, lse2 * LN2, k_pool, v_pool
        return o, k_pool, v_pool
