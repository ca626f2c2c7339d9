"""Paged KV layout (issue 23, first step): page tables to the CSR lists of pool slots the kernels already read.

Layout decision. The pool stays `[slots, kv_heads, head_dim]` and every kernel keeps reading rows by slot; pages are
flat slots allocated page-aligned: page p holds slots `[p * page_size, (p + 1) * page_size)`, and token `pos` of a
request sits at slot `page * page_size + pos % page_size` with `page = req_to_page[row, pos // page_size]`. A
request's pages are listed in `req_to_page[max_reqs, max_pages]`. Page 0 is the padding page (slots
`[0, page_size)`), never listed for real tokens. Page size 1 is today's layout exactly: page id == slot and
`req_to_page` is SGLang's `req_to_token`. page_size is one of `PAGE_SIZES` (1, 8, 16, 32, 64, 128).

Page ids are checked the way the kernels check slots: a position whose page is 0, negative or past the pool
(`>= num_slots // page_size`), whose row is outside req_to_page, or whose position is outside
`[0, max_pages * page_size)`, gets slot 0 (the padding slot, `write_kv`'s and the kernels' clamp target), so no page
id makes anything read, or write, outside the pool. Valid pages never overflow int32 (num_slots < 2**31).

`PageTable(req_to_page, page_size=, num_slots=)`: a page table and its static sizes as one pytree, what
`TritonBackend.init_forward_metadata` and `ReferenceBackend.init_forward_metadata` take in place of req_to_token
(`RequestTable.page_table()` builds it). Its `req_to_token()` is the equivalent page-1 table.

Functions (pure, jit-friendly, no host sync; sizes are static Python ints):
  * `page_in_pool(page_ids, page_size, *, num_slots)`: which page ids are real pages (the check above).
  * `token_slots(req_to_page, req_pool_indices, positions, page_size, *, num_slots)`: the slot of each position.
  * `req_to_token_from_pages(req_to_page, page_size, max_context_len=None, *, num_slots)`: the equivalent page-1
    table (max_reqs x max_context_len entries: for tests, interop, or callers that want the page-1 builders).
  * `out_cache_loc_from_pages(...)`: the slots of a step's new tokens (for `write_kv`, which writes by slot, and for
    `extend_unified_metadata_from_pages`). A decode step's own slots are `token_slots(..., seq_lens - 1, ...)`
    (padding rows, seq_len 0, get slot 0).
  * `create_kv_indices_from_pages(...)`: `jaxattn.kv_indices.create_kv_indices` over pages (same results as that
    function on `req_to_token_from_pages`).
  * `decode_metadata_from_pages`, `extend_metadata_from_pages`, `extend_unified_metadata_from_pages`: the builders of
    `jaxattn.metadata` over pages, same signatures plus `page_size` and `num_slots`, same metadata (every field, static
    ones included) as the page-1 builders on the equivalent req_to_token, except the extend builders' static
    `page_size`: the lists keep whole pages (`ExtendMetadata.page_size`; 1 where a window or token_offsets cuts them).
    The window rules are `jaxattn.metadata`'s (`window_first_key` & co.), applied per token, so a window may start
    mid-page.

Cost: the lists are built by a jnp gather per listed key (a searchsorted over the batch's indptr, one page-table read
and one multiply-add per entry of kv_capacity), not by the Triton index kernel and not through a per-token table, so
the extra work is O(kv_capacity) per step and nothing of size max_reqs x max_context is built (only
`req_to_token_from_pages` builds that). The lists keep one slot per key; where they keep whole pages the Hopper extend
kernel copies a page's rows as one block (TMA, `ExtendMetadata.page_size`), the other kernels read row by row (the
serving allocator takes pages, and FlashInferBackend plans FlashInfer's own page_size from a PageTable).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxattn.checks import (
    index_i32,
    INDEX_DTYPES,
    PAGE_SIZES,  # noqa: F401  (re-exported: the page sizes the layout takes)
    check_array,
    check_extend_builder_args,
    check_heads,
    check_index_dtype,
    check_kv_list_args,
    check_page_args,
    check_positive_int,
    check_window,
    launch_mode_argument,
)
from jaxattn.fp8 import in_pool
from jaxattn.kv_indices import exclusive_cumsum
from jaxattn.metadata import (
    DecodeMetadata,
    ExtendMetadata,
    ExtendUnifiedMetadata,
    FILL_PROGRAMS_PER_SM,
    SplitWaves,
    cross_attention_metadata_from_lists,
    decode_listed_keys,
    decode_metadata_from_indptr,
    extend_metadata_from_lists,
    extend_unified_metadata_from_lists,
    listed_prefix,
    row_token_offsets,
)

__all__ = [
    "PAGE_SIZES",
    "PageTable",
    "create_kv_indices_from_pages",
    "cross_attention_metadata_from_pages",
    "decode_metadata_from_pages",
    "extend_metadata_from_pages",
    "extend_unified_metadata_from_pages",
    "out_cache_loc_from_pages",
    "page_in_pool",
    "req_to_token_from_pages",
    "token_slots",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageTable:
    """A page table and its pool's static sizes, as one pytree (`req_to_page` traced, the sizes static).

    req_to_page: i32/i64[max_reqs, max_pages]: page ids of every request row, page 0 = padding.
    page_size: one of PAGE_SIZES. num_slots: the pool's rows (k_pool.shape[0]), a multiple of page_size.
    """

    req_to_page: jax.Array
    page_size: int = dataclasses.field(default=1, metadata=dict(static=True))
    num_slots: int = dataclasses.field(default=1, metadata=dict(static=True))

    def __post_init__(self):
        if hasattr(self.req_to_page, "shape") and hasattr(self.req_to_page, "dtype"):  # not a pytree placeholder
            check_page_args(self.req_to_page, self.page_size, self.num_slots)

    @property
    def max_context_len(self) -> int:
        return self.req_to_page.shape[1] * self.page_size

    def req_to_token(self, max_context_len: int | None = None) -> jax.Array:
        """The equivalent page-1 table (`req_to_token_from_pages`): max_reqs x max_context_len entries."""
        return req_to_token_from_pages(self.req_to_page, self.page_size, max_context_len, num_slots=self.num_slots)

    def builder_args(self) -> dict:
        """`page_size` and `num_slots`, the keywords every `*_from_pages` builder takes beside req_to_page."""
        return dict(page_size=self.page_size, num_slots=self.num_slots)


def page_in_pool(page_ids, page_size: int, *, num_slots: int):
    """bool[...]: the page ids that address a real page of the pool, 1 <= id < num_slots // page_size (numpy or jax
    arrays). Any other id reads as the padding page 0: the one rule of which table entries are pages (the slot
    gathers here, FlashInfer's page lists; `jaxattn.fp8.in_pool` over pages)."""
    return in_pool(page_ids, num_slots // page_size)


def _slots(req_to_page, rows, positions, page_size, num_slots):
    """The page rule (arguments already checked): slot of (row, position), 0 where anything is out of range."""
    rows, positions = jnp.broadcast_arrays(index_i32(rows), index_i32(positions))
    max_reqs, max_pages = req_to_page.shape
    if max_reqs == 0 or max_pages == 0:
        return jnp.zeros(rows.shape, jnp.int32)
    column = positions // page_size  # floor: a negative position gives a negative column
    ok = (rows >= 0) & (rows < max_reqs) & (positions >= 0) & (column < max_pages)
    page = index_i32(req_to_page[jnp.clip(rows, 0, max_reqs - 1), jnp.clip(column, 0, max_pages - 1)])
    ok = ok & page_in_pool(page, page_size, num_slots=num_slots)
    return jnp.where(ok, page * page_size + positions % page_size, 0).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("page_size", "num_slots"))
def token_slots(req_to_page: jax.Array, req_pool_indices: jax.Array, positions: jax.Array, page_size: int, *,
                num_slots: int) -> jax.Array:
    """Pool slot of each (request row, token position): `page * page_size + position % page_size`.

    Args:
      req_to_page: i32/i64[max_reqs, max_pages]. Page ids of every request row's tokens, page 0 = padding.
      req_pool_indices: i32[...]: request rows; broadcast against `positions` (e.g. rows[:, None] with a [batch, n]
        position grid).
      positions: i32[...]: token positions within each row.
      page_size: static, one of PAGE_SIZES.
      num_slots: static, the pool's rows (k_pool.shape[0]), a multiple of page_size.

    Returns:
      i32[broadcast shape]: slots; 0 (the padding slot) for page 0, a page id outside [0, num_slots // page_size), a
      row outside req_to_page or a position outside [0, max_pages * page_size).
    """
    check_page_args(req_to_page, page_size, num_slots)
    check_array("req_pool_indices", req_pool_indices, dtypes=INDEX_DTYPES, what="[...] (request rows)")
    check_array("positions", positions, dtypes=INDEX_DTYPES, what="[...] (token positions)")
    try:
        jnp.broadcast_shapes(req_pool_indices.shape, positions.shape)
    except ValueError:
        raise ValueError(f"req_pool_indices (shape {tuple(req_pool_indices.shape)}) and positions (shape "
                         f"{tuple(positions.shape)}) must broadcast together") from None
    return _slots(req_to_page, req_pool_indices, positions, page_size, num_slots)


@functools.partial(jax.jit, static_argnames=("page_size", "max_context_len", "num_slots"))
def req_to_token_from_pages(req_to_page: jax.Array, page_size: int, max_context_len: int | None = None, *,
                            num_slots: int) -> jax.Array:
    """The page-1 table equivalent to a page table: i32[max_reqs, max_context_len] (default max_pages * page_size)
    of `token_slots` for every row and position. Feeding it to `jaxattn.metadata`'s builders gives the same metadata
    as the `*_from_pages` builders; it is max_reqs x max_context_len entries, which those builders never build."""
    check_page_args(req_to_page, page_size, num_slots)
    width = req_to_page.shape[1] * page_size if max_context_len is None else max_context_len
    check_positive_int("max_context_len", width)
    rows = jnp.arange(req_to_page.shape[0], dtype=jnp.int32)[:, None]
    return _slots(req_to_page, rows, jnp.arange(width, dtype=jnp.int32)[None, :], page_size, num_slots)


def _paged_lists(req_to_page, req_pool_indices, kv_lens, kv_starts, page_size, num_slots, capacity, index_dtype):
    """(kv_indptr, kv_indices): `create_kv_indices`'s lists, one page-table gather per entry (arguments checked)."""
    batch = req_pool_indices.shape[0]
    kv_lens = jnp.maximum(index_i32(kv_lens), 0)
    kv_starts = jnp.zeros((batch,), jnp.int32) if kv_starts is None else index_i32(kv_starts)
    kv_indptr = exclusive_cumsum(kv_lens)
    if batch == 0:
        return kv_indptr, jnp.zeros((capacity,), index_dtype)
    entry = jnp.arange(capacity, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(kv_indptr, entry, side="right") - 1, 0, batch - 1)
    slots = _slots(req_to_page, index_i32(req_pool_indices)[seq], kv_starts[seq] + entry - kv_indptr[seq],
                   page_size, num_slots)
    return kv_indptr, jnp.where(entry < kv_indptr[-1], slots, 0).astype(index_dtype)


@functools.partial(jax.jit, static_argnames=("page_size", "num_slots", "capacity", "index_dtype"))
def create_kv_indices_from_pages(
    req_to_page: jax.Array,
    req_pool_indices: jax.Array,
    kv_lens: jax.Array,
    kv_starts: jax.Array | None = None,
    *,
    page_size: int,
    num_slots: int,
    capacity: int,
    index_dtype=jnp.int32,
) -> tuple[jax.Array, jax.Array]:
    """`jaxattn.kv_indices.create_kv_indices` over a page table: each sequence's slots for positions
    kv_starts[b] .. kv_starts[b] + kv_lens[b] - 1, sequence after sequence, in a list of static `capacity` (0 past
    the total; a total past capacity is truncated). Slots follow `token_slots` (0 for anything out of range).

    Returns (kv_indptr i32[batch + 1], kv_indices index_dtype[capacity]).
    """
    check_page_args(req_to_page, page_size, num_slots)
    check_kv_list_args(req_pool_indices, kv_lens, kv_starts)
    check_positive_int("capacity", capacity)
    check_index_dtype("index_dtype", index_dtype)
    return _paged_lists(req_to_page, req_pool_indices, kv_lens, kv_starts, page_size, num_slots, capacity, index_dtype)


@functools.partial(jax.jit, static_argnames=("page_size", "num_slots", "num_tokens"))
def out_cache_loc_from_pages(
    req_to_page: jax.Array,
    req_pool_indices: jax.Array,
    prefix_lens: jax.Array,
    extend_lens: jax.Array,
    *,
    page_size: int,
    num_slots: int,
    num_tokens: int,
    token_offsets: jax.Array | None = None,
) -> jax.Array:
    """Slots of an extend step's new tokens (SGLang's out_cache_loc), sequence after sequence: token i of sequence b
    (row qo_indptr[b] + i of q) sits at position token_offsets[b] + prefix_lens[b] + i of its row.

    Args:
      req_to_page, req_pool_indices, prefix_lens, extend_lens, token_offsets: as `extend_metadata_from_pages`.
      page_size, num_slots: as `token_slots`.
      num_tokens: static length of the result (q's rows); tokens past sum(extend_lens) get slot 0 (padding).

    Returns:
      i32[num_tokens], the slots `write_kv` stores the new K/V at and `extend_unified_metadata_from_pages` lists.
    """
    check_page_args(req_to_page, page_size, num_slots)
    check_extend_builder_args(req_to_page, req_pool_indices, prefix_lens, extend_lens, 1, 1)
    check_positive_int("num_tokens", num_tokens)
    batch = req_pool_indices.shape[0]
    extend_lens = jnp.maximum(index_i32(extend_lens), 0)
    start = jnp.maximum(index_i32(prefix_lens), 0) + row_token_offsets(token_offsets, batch)
    _, slots = _paged_lists(req_to_page, req_pool_indices, extend_lens, start, page_size, num_slots, num_tokens,
                            jnp.int32)
    return slots


@functools.partial(
    jax.jit,
    static_argnames=("page_size", "num_slots", "kv_capacity", "max_kv_splits", "q_heads", "kv_heads", "deterministic",
                     "split_tile_size", "sliding_window", "max_context_len", "num_sms", "programs_per_sm",
                     "min_split_len", "split_waves", "launch_mode", "mode"),
)
def decode_metadata_from_pages(
    req_to_page: jax.Array,
    req_pool_indices: jax.Array,
    seq_lens: jax.Array,
    *,
    page_size: int,
    num_slots: int,
    kv_capacity: int,
    q_heads: int,
    kv_heads: int,
    max_kv_splits: int | None = None,
    deterministic: bool = False,
    split_tile_size: int = 256,
    sliding_window: int = -1,
    token_offsets: jax.Array | None = None,
    max_context_len: int | None = None,
    num_sms: int | None = None,
    programs_per_sm: int = FILL_PROGRAMS_PER_SM,
    min_split_len: int = 256,
    split_waves: SplitWaves | None = None,
    launch_mode: str | None = None,
    mode: str | None = None,
) -> DecodeMetadata:
    """`jaxattn.metadata.decode_metadata` over a page table: the same `DecodeMetadata` as that builder on
    `req_to_token_from_pages(req_to_page, page_size, num_slots=num_slots)`.

    Args:
      req_to_page: i32/i64[max_reqs, max_pages]: page ids of every request row (page 0 = padding).
      page_size: static, one of PAGE_SIZES. num_slots: static, the pool's rows (a multiple of page_size).
      max_context_len: static bound on a sequence's keys (default max_pages * page_size).
      launch_mode, mode: accepted for `decode_metadata`'s signature; the lists are built by jnp gathers, no kernel.
      Others: as `decode_metadata` (sliding_window W >= 0 lists the last min(seq_len, W + 1) keys, from any offset
        within a page).
    """
    check_page_args(req_to_page, page_size, num_slots)
    check_array("req_pool_indices", req_pool_indices, ndim=1, dtypes=INDEX_DTYPES, what="[max_batch]")
    check_array("seq_lens", seq_lens, shape=(req_pool_indices.shape[0],), dtypes=INDEX_DTYPES,
                what="[max_batch] (one per req_pool_indices entry)")
    check_heads(q_heads, kv_heads)
    check_positive_int("kv_capacity", kv_capacity)
    check_window("sliding_window", sliding_window)
    if max_context_len is not None:
        check_positive_int("max_context_len", max_context_len)
    launch_mode_argument(launch_mode, mode)
    offsets = row_token_offsets(token_offsets, req_pool_indices.shape[0])
    seq_lens = jnp.maximum(index_i32(seq_lens), 0)
    listed = decode_listed_keys(seq_lens, sliding_window)
    kv_indptr, kv_indices = _paged_lists(req_to_page, req_pool_indices, listed, offsets + seq_lens - listed, page_size,
                                         num_slots, kv_capacity, jnp.int32)
    # decode_metadata's split bound: at most min(max_context_len, W + 1) listed keys per sequence.
    max_listed = req_to_page.shape[1] * page_size if max_context_len is None else max_context_len
    if sliding_window >= 0:
        max_listed = min(max_listed, sliding_window + 1)
    return decode_metadata_from_indptr(
        kv_indptr, kv_indices, seq_lens, q_heads=q_heads, kv_heads=kv_heads, max_kv_splits=max_kv_splits,
        deterministic=deterministic, split_tile_size=split_tile_size, sliding_window=sliding_window,
        max_context_len=max_listed, num_sms=num_sms, programs_per_sm=programs_per_sm, min_split_len=min_split_len,
        split_waves=split_waves,
    )


def _listed_prefix_pages(req_to_page, req_pool_indices, prefix_lens, sliding_window, token_offsets, page_size, num_slots,
                         capacity, index_dtype):
    """`jaxattn.metadata._listed_prefix_lists` over pages: (listed, dropped, kv_indptr, kv_indices)."""
    offsets = row_token_offsets(token_offsets, req_pool_indices.shape[0])
    listed, start = listed_prefix(prefix_lens, sliding_window)
    kv_indptr, kv_indices = _paged_lists(req_to_page, req_pool_indices, listed, start + offsets, page_size, num_slots,
                                         capacity, index_dtype)
    return listed, start, kv_indptr, kv_indices


def _check_extend_pages(req_to_page, req_pool_indices, prefix_lens, extend_lens, page_size, num_slots, max_extend_len,
                        kv_capacity, sliding_window, index_dtype):
    check_page_args(req_to_page, page_size, num_slots)  # first, so a bad table is named req_to_page
    check_extend_builder_args(req_to_page, req_pool_indices, prefix_lens, extend_lens, max_extend_len, kv_capacity,
                              sliding_window, index_dtype)


@functools.partial(jax.jit, static_argnames=("page_size", "num_slots", "max_extend_len", "kv_capacity", "sliding_window",
                                             "index_dtype", "launch_mode", "mode"))
def extend_metadata_from_pages(
    req_to_page: jax.Array,
    req_pool_indices: jax.Array,
    prefix_lens: jax.Array,
    extend_lens: jax.Array,
    *,
    page_size: int,
    num_slots: int,
    max_extend_len: int,
    kv_capacity: int,
    sliding_window: int = -1,
    token_offsets: jax.Array | None = None,
    index_dtype=jnp.int32,
    launch_mode: str | None = None,
    mode: str | None = None,
) -> ExtendMetadata:
    """`jaxattn.metadata.extend_metadata` over a page table (the same `ExtendMetadata` as that builder on the
    equivalent req_to_token). req_to_page, page_size, num_slots: as `decode_metadata_from_pages`; launch_mode, mode:
    accepted for the signature (no kernel runs); others as `extend_metadata`."""
    _check_extend_pages(req_to_page, req_pool_indices, prefix_lens, extend_lens, page_size, num_slots, max_extend_len,
                        kv_capacity, sliding_window, index_dtype)
    launch_mode_argument(launch_mode, mode)
    extend_lens = jnp.maximum(index_i32(extend_lens), 0)
    listed, start, kv_indptr, kv_indices = _listed_prefix_pages(
        req_to_page, req_pool_indices, prefix_lens, sliding_window, token_offsets, page_size, num_slots, kv_capacity,
        index_dtype)
    return extend_metadata_from_lists(extend_lens, listed, start, kv_indptr, kv_indices, max_extend_len=max_extend_len,
                                      kv_capacity=kv_capacity, sliding_window=sliding_window,
                                      page_size=_whole_pages(page_size, sliding_window, token_offsets))


@functools.partial(jax.jit, static_argnames=("page_size", "num_slots", "max_extend_len", "kv_capacity", "sliding_window",
                                             "index_dtype", "launch_mode", "mode"))
def extend_unified_metadata_from_pages(
    req_to_page: jax.Array,
    req_pool_indices: jax.Array,
    prefix_lens: jax.Array,
    extend_lens: jax.Array,
    out_cache_loc: jax.Array,
    *,
    page_size: int,
    num_slots: int,
    max_extend_len: int,
    kv_capacity: int,
    sliding_window: int = -1,
    extend_start_loc: jax.Array | None = None,
    token_offsets: jax.Array | None = None,
    index_dtype=jnp.int32,
    launch_mode: str | None = None,
    mode: str | None = None,
) -> ExtendUnifiedMetadata:
    """`jaxattn.metadata.extend_unified_metadata` over a page table: the listed prefix's slots from the pages, then
    out_cache_loc (the new tokens' slots, e.g. `out_cache_loc_from_pages`), joined by the unified index kernel
    (`launch_mode`). req_to_page, page_size, num_slots: as `decode_metadata_from_pages`; others as
    `extend_unified_metadata`."""
    _check_extend_pages(req_to_page, req_pool_indices, prefix_lens, extend_lens, page_size, num_slots, max_extend_len,
                        kv_capacity, sliding_window, index_dtype)
    check_array("out_cache_loc", out_cache_loc, ndim=1, dtypes=INDEX_DTYPES, what="[extend_tokens]")
    launch_mode = launch_mode_argument(launch_mode, mode)
    extend_lens = jnp.maximum(index_i32(extend_lens), 0)
    _, start, prefix_indptr, prefix_indices = _listed_prefix_pages(
        req_to_page, req_pool_indices, prefix_lens, sliding_window, token_offsets, page_size, num_slots, kv_capacity,
        index_dtype)
    return extend_unified_metadata_from_lists(
        extend_lens, start, prefix_indptr, prefix_indices, out_cache_loc, extend_start_loc, max_extend_len=max_extend_len,
        kv_capacity=kv_capacity, sliding_window=sliding_window, index_dtype=index_dtype, launch_mode=launch_mode,
        page_size=_whole_pages(page_size, sliding_window, token_offsets))


def _whole_pages(page_size: int, sliding_window: int, token_offsets) -> int:
    """The page size an extend builder's prefix lists keep whole (`ExtendMetadata.page_size`): page_size, or 1 when
    a window cuts the lists (they start mid-page) or token_offsets shifts where they start in the table."""
    return page_size if sliding_window < 0 and token_offsets is None else 1


@functools.partial(jax.jit, static_argnames=("page_size", "num_slots", "max_extend_len", "kv_capacity"))
def cross_attention_metadata_from_pages(
    req_to_page: jax.Array,
    req_pool_indices: jax.Array,
    encoder_lens: jax.Array,
    extend_lens: jax.Array,
    *,
    page_size: int,
    num_slots: int,
    max_extend_len: int,
    kv_capacity: int,
) -> ExtendUnifiedMetadata:
    """`jaxattn.metadata.cross_attention_metadata` over a page table: each sequence's new tokens over its encoder's
    tokens (positions 0 .. encoder_lens[b] - 1 of its pages), run non-causal. req_to_page, page_size, num_slots: as
    `decode_metadata_from_pages`; others as `cross_attention_metadata`."""
    _check_extend_pages(req_to_page, req_pool_indices, encoder_lens, extend_lens, page_size, num_slots, max_extend_len,
                        kv_capacity, -1, jnp.int32)
    encoder_lens = jnp.maximum(index_i32(encoder_lens), 0)
    kv_indptr, kv_indices = _paged_lists(req_to_page, req_pool_indices, encoder_lens, None, page_size, num_slots,
                                         kv_capacity, jnp.int32)
    return cross_attention_metadata_from_lists(kv_indptr, kv_indices, encoder_lens, extend_lens,
                                               max_extend_len=max_extend_len, kv_capacity=kv_capacity)
