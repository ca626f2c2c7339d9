"""Checked mode: run-time validation of a batch's index arrays, with `jax.experimental.checkify`.

The ops check shapes and dtypes while tracing; they cannot see values. A wrong *value* (a slot past the pool, a
request row past the table, a negative length, an extend longer than its bucket) makes a kernel read or write the
wrong memory, or silently drops work. The validators here check those values on device and report through
checkify; they cost a few small reductions per step (the largest reads the req_to_token entries the batch uses),
so use them in tests, debug runs and canaries rather than in every production step.

What is checked (each message names the argument and the first offending entry):

* `validate_decode_inputs` / `validate_extend_inputs` (SGLang's request tables, before the metadata builders):
  lengths non-negative; the req_pool_indices of every non-empty sequence inside req_to_token's rows; the req_to_token
  entries the batch lists inside [0, num_slots); prefix + extend (or seq_len) within max_context_len (req_to_token's
  width); extend_lens <= the max_extend_len bucket; totals within kv_capacity / the query rows; out_cache_loc in
  range and free of repeats other than the padding slot 0 (`jaxattn.kv_pool.check_write_slots`). A
  `jaxattn.paging.PageTable` may stand for req_to_token: the pages holding the listed keys must then be pages of
  the pool (1 <= id < num_slots / page_size; page 0 and ids outside read the padding slot).
* `validate_decode_metadata` / `validate_extend_metadata` (the metadata pytrees, also for callers that build CSR
  lists themselves): indptrs start at 0, never decrease and end within the index capacity; the listed kv_indices
  inside [0, num_slots); per-sequence query counts within max_extend_len; seq_lens / prefix_lens consistent; an
  extend metadata's promise of whole pages (`page_size` > 1) kept by its lists.
  They *return the metadata with out-of-range slots replaced by the padding slot 0*: checkify reports after the
  step, so the step that finds the error still runs, and with the returned metadata it reads only inside the pool
  (the kernels clamp every index as well). To stop a bad batch before its step, pass the request-table validators as
  `checked(step, validate=...)`: they run first, in their own call, and raise before the step is launched.
  (Pool writes are already safe: `write_kv` drops out-of-range slots.)
* `validate_write_slots`: out_cache_loc for `write_kv`.
* `validate_kv_scales`: an fp8 pool's array k_scale / v_scale finite and > 0.
* `validate_verify_drafts`: a verify step whose tree comes as bit masks (`ForwardBatch.draft_mask`, D drafts per
  sequence): every sequence with keys has exactly D new tokens and at least D keys, every padding sequence none, and
  the padding sequences come last.

Use, either way:

    # 1. Wrap the step: jit(checkify(step)) that raises a ValueError (checkify.JaxRuntimeError) on a bad batch.
    def step(cache, req_to_token, req_pool_indices, seq_lens, out_cache_loc, q, k, v):
        validate_decode_inputs(req_to_token, req_pool_indices, seq_lens, num_slots=cache[0].shape[0],
                               out_cache_loc=out_cache_loc, kv_capacity=4096)
        meta = decode_metadata(req_to_token, req_pool_indices, seq_lens, kv_capacity=4096, q_heads=32, kv_heads=8)
        meta = validate_decode_metadata(meta, num_slots=cache[0].shape[0])
        ...
    step = checked(step, donate_argnums=0)

    # 2. Or inside a function you checkify yourself.
    err, out = jax.jit(checkify.checkify(step))(...)
    err.throw()

Outside checkify (a plain jit), the `checkify.check` calls raise at trace time: "Cannot abstractly evaluate a
checkify.check which was not functionalized". Call the validators only in checked functions.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from jaxattn.checks import (
    INDEX_DTYPES,
    check_array,
    check_positive_int,
    check_request_tables,
    check_window,
    index_i32,
)
from jaxattn.metadata import DecodeMetadata, ExtendMetadata, ExtendUnifiedMetadata, listed_prefix
from jaxattn.paging import PageTable, page_in_pool
from jaxattn.serving.kv_pool import check_write_slots

__all__ = [
    "checked",
    "validate_decode_inputs",
    "validate_extend_inputs",
    "validate_decode_metadata",
    "validate_extend_metadata",
    "validate_write_slots",
    "validate_kv_scales",
]

_PREFIX = "jaxattn checked mode: "


def checked(fn, *, errors=checkify.user_checks, jit: bool = True, validate=None, **jit_kwargs):
    """`fn` checkified (and jitted with `jit_kwargs`, e.g. donate_argnums/static_argnames); a failed check raises.

    The returned function has `fn`'s signature and results. A failed `checkify.check` inside `fn` (the validators of
    this module, or your own) raises `checkify.JaxRuntimeError`, a ValueError, with the check's message, after the
    step ran. `errors` picks checkify's error sets (default: user checks only; add `checkify.index_checks` or
    `checkify.nan_checks` to also catch out-of-bounds jnp indexing or NaN outputs, at a further cost).

    validate: an optional function taking `fn`'s arguments that runs the validators *before* the step: it is
    checkified and jitted on its own (no donation), and a failed check raises before `fn` is called, so the step never
    runs on the bad batch and donated buffers are untouched. Costs one more dispatch of small reductions per call.
    """
    checked_fn = checkify.checkify(fn, errors=errors)
    checked_validate = None if validate is None else checkify.checkify(validate, errors=errors)
    if jit:
        checked_fn = jax.jit(checked_fn, **jit_kwargs)
        if checked_validate is not None:
            static = {k: v for k, v in jit_kwargs.items() if k in ("static_argnums", "static_argnames")}
            checked_validate = jax.jit(checked_validate, **static)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if checked_validate is not None:
            err, _ = checked_validate(*args, **kwargs)
            err.throw()
        err, out = checked_fn(*args, **kwargs)
        err.throw()
        return out

    run.checkified = checked_fn  # returns (error, out) without raising
    return run


# ---------------------------------------------------------------------------------------------
# Building blocks


def _first(bad):
    """Index of the first true entry of a flat bool array (0 when none)."""
    if bad.size == 0:
        return jnp.int32(0)
    return jnp.argmax(bad.reshape(-1)).astype(jnp.int32)


def _check_all(ok, message, **values):
    checkify.check(jnp.all(ok), _PREFIX + message, **values)


def _non_negative(name, lengths):
    if lengths.size == 0:
        return
    lengths = index_i32(lengths)
    bad = lengths < 0
    i = _first(bad)
    _check_all(~bad, f"{name}[{{i}}] = {{v}} is negative (lengths must be >= 0)", i=i, v=lengths[i])


def _at_most(name, values, bound, what):
    if values.size == 0:
        return
    values = index_i32(values)
    bad = values > bound
    i = _first(bad)
    _check_all(~bad, f"{name}[{{i}}] = {{v}} exceeds {what} ({{bound}})", i=i, v=values[i], bound=jnp.int32(bound))


def _slots_in_range(name, slots, num_slots, valid=None):
    """Entries of `slots` (where `valid`) inside [0, num_slots)."""
    bad = (slots < 0) | (slots >= num_slots)
    if valid is not None:
        bad &= valid
    if bad.size == 0:
        return bad
    flat = bad.reshape(-1)
    i = _first(flat)
    _check_all(~flat, f"{name} entry {{i}} (flat) = {{v}} is outside the pool [0, {num_slots})", i=i, v=slots.reshape(-1)[i])
    return bad


def _indptr(name, indptr, capacity, capacity_name="the index capacity"):
    """indptr[0] == 0, non-decreasing, indptr[-1] <= capacity (None: no bound); returns the lengths (clamped >= 0)."""
    indptr = index_i32(indptr)
    checkify.check(indptr[0] == 0, _PREFIX + f"{name}[0] = {{v}} must be 0", v=indptr[0])
    steps = indptr[1:] - indptr[:-1]
    if steps.size:
        bad = steps < 0
        i = _first(bad)
        _check_all(~bad, f"{name} decreases at {{i}}: {name}[{{i}}] = {{a}} > {name}[{{j}}] = {{b}} (a negative length)",
                   i=i, j=i + 1, a=indptr[i], b=indptr[i + 1])
    if capacity is not None:
        checkify.check(indptr[-1] <= capacity, _PREFIX + f"{name}[-1] = {{v}} exceeds {capacity_name} ({capacity})", v=indptr[-1])
    return jnp.maximum(steps, 0)


def _rows_in_range(req_pool_indices, max_reqs, active):
    if active.size == 0:
        return
    rows = index_i32(req_pool_indices)
    bad = active & ((rows < 0) | (rows >= max_reqs))
    i = _first(bad)
    _check_all(~bad, f"req_pool_indices[{{i}}] = {{v}} is outside req_to_token's rows [0, {max_reqs}) (a non-empty sequence)",
               i=i, v=rows[i])


def _table_shape(req_to_token, num_slots: int) -> tuple[int, int]:
    """(max_reqs, max_context_len) of a request table: req_to_token's shape, or a `PageTable`'s rows and the positions
    its pages hold (its num_slots must be the pool's)."""
    if isinstance(req_to_token, PageTable):
        if req_to_token.num_slots != num_slots:
            raise ValueError(f"num_slots ({num_slots}) must be the PageTable's num_slots ({req_to_token.num_slots}): the "
                             "pool the table pages")
        return req_to_token.req_to_page.shape[0], req_to_token.max_context_len
    check_array("req_to_token", req_to_token, ndim=2, dtypes=INDEX_DTYPES, what="[max_reqs, max_context_len]")
    return req_to_token.shape


def _listed_page_entries(table: PageTable, req_pool_indices, begin, end):
    """The pages holding positions begin_b .. end_b - 1 of every sequence are pages of the pool, 1 <= id < num_slots /
    page_size (rows already checked): page 0 and ids outside the pool read the padding slot 0."""
    max_reqs, max_pages = table.req_to_page.shape
    if req_pool_indices.size == 0:
        return
    rows = jnp.clip(index_i32(req_pool_indices), 0, max_reqs - 1)
    pages = index_i32(table.req_to_page[rows])  # [batch, max_pages]: only the rows the batch uses
    column = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
    size = table.page_size
    listed = (column >= begin[:, None] // size) & (column * size < end[:, None]) & (end > begin)[:, None]
    bad = listed & ~page_in_pool(pages, size, num_slots=table.num_slots)
    flat = bad.reshape(-1)
    k = _first(flat)
    b, p = k // max_pages, k % max_pages
    _check_all(~flat, f"req_to_page[req_pool_indices[{{b}}], {{p}}] = {{v}} is not a page of the pool [1, "
               f"{table.num_slots // size}) (it holds a listed key)", b=b, p=p, v=pages.reshape(-1)[k])


def _listed_table_entries(req_to_token, req_pool_indices, begin, end, num_slots):
    """req_to_token[row_b, begin_b:end_b] inside [0, num_slots) for every sequence (rows already checked); for a
    `PageTable`, the pages holding those positions are pages of the pool."""
    if isinstance(req_to_token, PageTable):
        _listed_page_entries(req_to_token, req_pool_indices, begin, end)
        return
    max_reqs, max_ctx = req_to_token.shape
    if req_pool_indices.size == 0:
        return
    rows = jnp.clip(index_i32(req_pool_indices), 0, max_reqs - 1)
    table = req_to_token[rows]  # [batch, max_ctx]: only the rows the batch uses
    pos = jnp.arange(max_ctx, dtype=jnp.int32)[None, :]
    listed = (pos >= begin[:, None]) & (pos < end[:, None])
    bad = listed & ((table < 0) | (table >= num_slots))
    flat = bad.reshape(-1)
    k = _first(flat)
    b, p = k // max_ctx, k % max_ctx
    _check_all(~flat, f"req_to_token[req_pool_indices[{{b}}], {{p}}] = {{v}} is outside the pool [0, {num_slots}) (a listed key)",
               b=b, p=p, v=table.reshape(-1)[k])


# ---------------------------------------------------------------------------------------------
# Request tables (before the metadata builders)


def validate_write_slots(out_cache_loc, num_slots: int):
    """out_cache_loc inside [0, num_slots) and no slot other than the padding slot 0 named twice."""
    check_array("out_cache_loc", out_cache_loc, ndim=1, dtypes=INDEX_DTYPES, what="[tokens]")
    check_positive_int("num_slots", num_slots)
    loc = index_i32(out_cache_loc)
    bad = (loc < 0) | (loc >= num_slots)
    i = _first(bad)
    _check_all(~bad, f"out_cache_loc[{{i}}] = {{v}} is outside the pool [0, {num_slots})", i=i, v=loc[i])
    check_write_slots(out_cache_loc, num_slots)


def validate_kv_scales(k_scale=None, v_scale=None):
    """Array k_scale / v_scale (an fp8 pool's per-layer or per-head scales, `jaxattn.fp8`) finite and > 0: the ops check
    their shapes while tracing, not their values, and the kernels fold a scale into the score scale and the output,
    where an inf or 0 scale gives a different non-finite pattern than the reference's (Python float scales are
    checked at trace time already). None and Python floats pass through."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None or not hasattr(scale, "shape"):
            continue
        values = jnp.asarray(scale, jnp.float32).reshape(-1)
        bad = ~(jnp.isfinite(values) & (values > 0))
        i = _first(bad)
        _check_all(~bad, f"{name}[{{i}}] = {{v}}: a scale must be finite and > 0 (the pool stores value / scale)",
                   i=i, v=values[i])


def validate_verify_drafts(extend_lens, seq_lens, drafts: int):
    """A draft-bits verify step's lengths: extend_lens[b] == drafts <= seq_lens[b] where seq_lens[b] > 0, else 0 (the
    several-token decode kernel takes a sequence's last `drafts` keys as its query tokens' own), padding sequences
    last."""
    check_array("extend_lens", extend_lens, ndim=1, dtypes=INDEX_DTYPES, what="[batch]")
    check_array("seq_lens", seq_lens, shape=extend_lens.shape, dtypes=INDEX_DTYPES, what="[batch]")
    check_positive_int("drafts", drafts)
    extend, seq = index_i32(extend_lens), index_i32(seq_lens)
    bad = jnp.where(seq > 0, extend != drafts, extend != 0)
    i = _first(bad)
    _check_all(~bad, f"extend_lens[{{i}}] = {{v}} (seq_lens {{s}}): a draft-mask verify step gives every sequence with "
                     f"keys {drafts} drafts and padding sequences none", i=i, v=extend[i], s=seq[i])
    short = (seq > 0) & (seq < drafts)
    i = _first(short)
    _check_all(~short, f"seq_lens[{{i}}] = {{v}} is shorter than the {drafts} drafts it verifies", i=i, v=seq[i])
    # Token rows are b * drafts + t, and the extend paths (window layers) count rows by extend_lens: the two agree only
    # with the padding sequences last.
    after_padding = (seq > 0) & (jnp.cumsum((seq == 0).astype(jnp.int32)) > 0)
    i = _first(after_padding)
    _check_all(~after_padding, f"seq_lens[{{i}}] = {{v}} follows a padding sequence: a draft-mask verify step puts its "
                               "padding sequences last", i=i, v=seq[i])


def validate_decode_inputs(req_to_token, req_pool_indices, seq_lens, *, num_slots: int, kv_capacity: int | None = None,
                           out_cache_loc=None, sliding_window: int = -1):
    """Run-time checks of a decode batch's request tables (the arguments of `decode_metadata`).

    seq_lens >= 0 and <= max_context_len; req_pool_indices of non-empty sequences inside req_to_token; the listed
    entries (the last min(seq_len, W + 1) with a window W) inside [0, num_slots); the listed total <= kv_capacity;
    out_cache_loc (the current tokens' slots) valid for `write_kv`. req_to_token may be a `jaxattn.paging.PageTable`
    (the pages holding the listed keys must be pages of the pool).
    """
    max_reqs, max_ctx = _table_shape(req_to_token, num_slots)
    check_array("req_pool_indices", req_pool_indices, ndim=1, dtypes=INDEX_DTYPES, what="[max_batch]")
    check_array("seq_lens", seq_lens, shape=req_pool_indices.shape, dtypes=INDEX_DTYPES, what="[max_batch]")
    check_positive_int("num_slots", num_slots)
    check_window("sliding_window", sliding_window)
    seq_lens = index_i32(seq_lens)
    _non_negative("seq_lens", seq_lens)
    _at_most("seq_lens", seq_lens, max_ctx, "max_context_len, req_to_token.shape[1]")
    active = seq_lens > 0
    _rows_in_range(req_pool_indices, max_reqs, active)
    lens = jnp.clip(seq_lens, 0, max_ctx)
    listed = jnp.minimum(lens, sliding_window + 1) if sliding_window >= 0 else lens
    _listed_table_entries(req_to_token, req_pool_indices, lens - listed, lens, num_slots)
    if kv_capacity is not None:
        total = jnp.sum(listed)
        checkify.check(total <= kv_capacity, _PREFIX + f"the batch lists {{t}} keys, more than kv_capacity ({kv_capacity})", t=total)
    if out_cache_loc is not None:
        validate_write_slots(out_cache_loc, num_slots)


def validate_extend_inputs(req_to_token, req_pool_indices, prefix_lens, extend_lens, *, num_slots: int, max_extend_len: int,
                           kv_capacity: int | None = None, unified: bool = False, out_cache_loc=None,
                           num_tokens: int | None = None, sliding_window: int = -1, custom_mask: bool = False):
    """Run-time checks of an extend batch's request tables (the arguments of `extend_metadata` /
    `extend_unified_metadata`).

    prefix_lens, extend_lens >= 0; extend_lens <= max_extend_len (longer rows would not be computed); prefix + extend
    <= max_context_len; req_pool_indices of non-empty sequences inside req_to_token; the listed prefix entries and the
    new tokens' entries of req_to_token inside [0, num_slots); the listed total (prefix, plus the new tokens when
    `unified`) <= kv_capacity; the total of extend_lens <= num_tokens (q's rows) and <= len(out_cache_loc); out_cache_loc
    valid for `write_kv`; with `custom_mask` (a verify step) and without x64, the mask's total size fits int32 offsets.
    req_to_token may be a `jaxattn.paging.PageTable` (the pages holding the listed keys must be pages of the pool).
    """
    check_positive_int("num_slots", num_slots)
    max_reqs, max_ctx = _table_shape(req_to_token, num_slots)
    paged = isinstance(req_to_token, PageTable)
    check_request_tables(req_to_token.req_to_page if paged else req_to_token, req_pool_indices, prefix_lens, extend_lens)
    check_positive_int("max_extend_len", max_extend_len)
    check_window("sliding_window", sliding_window)
    prefix_lens = index_i32(prefix_lens)
    extend_lens = index_i32(extend_lens)
    _non_negative("prefix_lens", prefix_lens)
    _non_negative("extend_lens", extend_lens)
    _at_most("extend_lens", extend_lens, max_extend_len, "the max_extend_len bucket")
    seq_lens = prefix_lens + extend_lens
    bad = seq_lens > max_ctx
    i = _first(bad)
    _check_all(~bad, f"prefix_lens[{{i}}] + extend_lens[{{i}}] = {{v}} exceeds max_context_len ({max_ctx}, req_to_token.shape[1])",
               i=i, v=seq_lens[i])
    _rows_in_range(req_pool_indices, max_reqs, seq_lens > 0)
    prefix = jnp.clip(prefix_lens, 0, max_ctx)
    listed, _ = listed_prefix(prefix, sliding_window)
    new = jnp.maximum(extend_lens, 0)
    _listed_table_entries(req_to_token, req_pool_indices, prefix - listed, jnp.clip(prefix + new, 0, max_ctx), num_slots)
    tokens = jnp.sum(new)
    if kv_capacity is not None:
        total = jnp.sum(listed) + (tokens if unified else 0)
        checkify.check(total <= kv_capacity, _PREFIX + f"the batch lists {{t}} keys, more than kv_capacity ({kv_capacity})", t=total)
    if custom_mask and not jax.config.jax_enable_x64:
        # The mask rows' offsets (`jaxattn.metadata.custom_mask_indptr`) are int32 without x64: their total must fit.
        cells = jnp.sum(new.astype(jnp.float32) * (prefix + new).astype(jnp.float32))
        checkify.check(cells < 2.0**31, _PREFIX + "the custom mask's rows add up to {c} entries, past int32 offsets (2**31): "
                       "enable jax_enable_x64 for int64 offsets, or split the batch", c=cells)
    if num_tokens is not None:
        checkify.check(tokens <= num_tokens, _PREFIX + f"extend_lens add up to {{t}} tokens, more than q's rows ({num_tokens})", t=tokens)
    if out_cache_loc is not None:
        validate_write_slots(out_cache_loc, num_slots)
        n = out_cache_loc.shape[0]
        checkify.check(tokens <= n, _PREFIX + f"extend_lens add up to {{t}} tokens, more than out_cache_loc holds ({n})", t=tokens)


# ---------------------------------------------------------------------------------------------
# Metadata (after the builders, or for CSR lists built by the caller)


def _sanitized_indices(kv_indices, used, num_slots):
    bad = _slots_in_range("kv_indices", kv_indices, num_slots, used)
    return jnp.where(bad, jnp.zeros((), kv_indices.dtype), kv_indices)


def validate_decode_metadata(meta, *, num_slots: int):
    """Checks a `DecodeMetadata` against a pool of `num_slots` slots; returns it with out-of-range slots set to 0.

    kv_indptr starts at 0, never decreases, ends within kv_capacity; the listed kv_indices inside [0, num_slots);
    seq_lens >= the list lengths (positions stay >= 0); no list longer than the metadata's static bound
    `max_kv_len` (the builders' max_context_len), which the jitted reference gathers up to (the kernels read every
    listed key, so a longer list would make the two differ without an error).
    """
    if not isinstance(meta, DecodeMetadata):
        raise ValueError(f"meta must be a DecodeMetadata; got {type(meta).__name__}")
    check_positive_int("num_slots", num_slots)
    lens = _indptr("kv_indptr", meta.kv_indptr, meta.kv_capacity, "kv_capacity")
    seq_lens = index_i32(meta.seq_lens)
    bad = seq_lens < lens
    if bad.size:
        i = _first(bad)
        _check_all(~bad, "seq_lens[{i}] = {v} is shorter than its KV list ({n} keys)", i=i, v=seq_lens[i], n=lens[i])
    if meta.max_kv_len is not None and lens.size:
        _at_most("kv_lens", lens, meta.max_kv_len, "the metadata's max_kv_len")  # lens: kv_indptr's steps
    used = jnp.arange(meta.kv_capacity) < meta.kv_indptr[-1]
    return dataclasses.replace(meta, kv_indices=_sanitized_indices(meta.kv_indices, used, num_slots))


def validate_extend_metadata(meta, *, num_slots: int, num_tokens: int | None = None):
    """Checks an `ExtendMetadata` / `ExtendUnifiedMetadata`; returns it with out-of-range slots set to 0.

    qo_indptr and kv_indptr (and mask_indptr) start at 0 and never decrease; qo_indptr ends within num_tokens (q's
    rows) when given, and each sequence's query count is <= max_extend_len; kv_indptr ends within kv_capacity; the
    listed kv_indices inside [0, num_slots); kv_start_pos >= 0; for the unified layout, prefix_lens in [0, list length]
    and list length - prefix_len == query count.
    """
    if not isinstance(meta, (ExtendMetadata, ExtendUnifiedMetadata)):
        raise ValueError(f"meta must be an ExtendMetadata or ExtendUnifiedMetadata; got {type(meta).__name__}")
    check_positive_int("num_slots", num_slots)
    q_lens = _indptr("qo_indptr", meta.qo_indptr, num_tokens, "q's rows (num_tokens)")
    _at_most("query counts (qo_indptr[b + 1] - qo_indptr[b])", q_lens, meta.max_extend_len, "max_extend_len")
    kv_lens = _indptr("kv_indptr", meta.kv_indptr, meta.kv_capacity, "kv_capacity")
    _non_negative("kv_start_pos", meta.kv_start_pos)
    if meta.mask_indptr is not None:
        _indptr("mask_indptr", meta.mask_indptr, None)
    if isinstance(meta, ExtendUnifiedMetadata):
        prefix = index_i32(meta.prefix_lens)
        bad = (prefix < 0) | (kv_lens - prefix != q_lens)
        if bad.size:
            i = _first(bad)
            _check_all(~bad, "prefix_lens[{i}] = {p} does not fit its list: {n} keys listed for {q} queries", i=i, p=prefix[i],
                   n=kv_lens[i], q=q_lens[i])
    used = jnp.arange(meta.kv_capacity) < meta.kv_indptr[-1]
    if meta.page_size > 1:
        paged = index_i32(meta.prefix_lens) if isinstance(meta, ExtendUnifiedMetadata) else kv_lens
        _check_whole_pages(meta.kv_indices, index_i32(meta.kv_indptr), paged, meta.page_size)
    return dataclasses.replace(meta, kv_indices=_sanitized_indices(meta.kv_indices, used, num_slots))


def _check_whole_pages(kv_indices, kv_indptr, paged_lens, page_size: int) -> None:
    """meta.page_size's promise: key j < paged_lens[b] of sequence b's list sits at a slot that is a multiple of
    page_size where j is, and one past key j - 1's elsewhere (the Hopper kernel copies such runs as blocks)."""
    entries = jnp.arange(kv_indices.shape[0], dtype=jnp.int32)
    if entries.size == 0 or paged_lens.size == 0:
        return
    seq = jnp.clip(jnp.searchsorted(kv_indptr, entries, side="right") - 1, 0, paged_lens.shape[0] - 1)
    key = entries - kv_indptr[seq]
    slots = index_i32(kv_indices)
    previous = jnp.concatenate([slots[:1], slots[:-1]])
    whole = jnp.where(key % page_size == 0, slots % page_size == 0, slots == previous + 1)
    bad = (entries < kv_indptr[-1]) & (key < paged_lens[seq]) & ~whole
    i = _first(bad)
    _check_all(~bad, f"kv_indices[{{i}}] = {{v}} breaks meta.page_size = {page_size}'s whole pages (key {{j}} of a list: "
               f"a multiple of {page_size} at a page's first key, else one past the key before); build the lists with "
               "jaxattn.paging's builders, or set page_size=1", i=i, v=slots[i], j=key[i])
