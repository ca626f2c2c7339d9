"""jaxattn.paging: page tables give the same metadata, and the same attention, as the page-1 tables they stand for.

Every batch is laid out in pages of one pool: pages are taken at random (page 0, the padding page, never), two requests
share whole prefix pages, lengths end mid-page, and every pool row no real token owns (the padding page, the tails of
partly filled pages, unused pages) is NaN, so a wrong gather shows. The page-1 table of the same batch is built here
in numpy, independently of `jaxattn.paging`. Shapes are tiny: the kernels run in Triton's interpreter.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.checks import PAGE_SIZES
from jaxattn.decode import decode_attention, decode_attention_reference
from jaxattn.extend import (
    ExtendConfig,
    extend_attention,
    extend_attention_reference,
    extend_attention_unified,
    extend_attention_unified_reference,
)
from jaxattn.kv_indices import create_kv_indices_reference
from jaxattn.kv_pool import write_kv
from jaxattn.metadata import decode_metadata, extend_metadata, extend_unified_metadata
from jaxattn.paging import (
    PageTable,
    create_kv_indices_from_pages,
    cross_attention_metadata_from_pages,
    decode_metadata_from_pages,
    extend_metadata_from_pages,
    extend_unified_metadata_from_pages,
    out_cache_loc_from_pages,
    req_to_token_from_pages,
    token_slots,
)
from tests.helpers import MODES, tolerance

SMALL = ExtendConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
HQ, HKV, DIM = 2, 1, 16
PAGES = [pytest.param(p, id=f"page{p}") for p in PAGE_SIZES]
# One pool size and one page-1 table width for every page size, so the ops, the references and the page-1 builders
# compile once for all of them (only the page builders, static in page_size, compile per page size).
NUM_SLOTS = 1024
CONTEXT = 512


def numpy_slots(req_to_page, page_size, num_slots, width=None):
    """The page-1 table of a page table, by the layout's definition (written out independently of jaxattn.paging);
    `width` columns (default max_pages * page_size), 0 past the pages."""
    max_reqs, max_pages = req_to_page.shape
    table = np.zeros((max_reqs, width or max_pages * page_size), np.int32)
    for row in range(max_reqs):
        for pos in range(max_pages * page_size):
            page = int(req_to_page[row, pos // page_size])
            if 0 < page < num_slots // page_size:
                table[row, pos] = page * page_size + pos % page_size
    return table


@dataclasses.dataclass
class Paged:
    req_to_page: np.ndarray  # i32[max_reqs, max_pages]
    req_to_token: np.ndarray  # the same batch at page size 1 (numpy_slots)
    rows: np.ndarray  # each sequence's row
    page_size: int
    num_slots: int
    k_pool: jax.Array  # NaN in every row no real token owns
    v_pool: jax.Array


def paged_batch(rng, page_size, seq_lens, *, shared_pages=1, hkv=HKV, dim=DIM, num_slots=None):
    """Requests 0 and 1 share their first `shared_pages` pages (both must be that long); every other page is the
    request's own, picked at random among the pool's pages (never page 0). K/V of tokens past seq_len stay NaN.
    The page-1 table is CONTEXT wide when num_slots is given (NUM_SLOTS), else just as wide as the pages."""
    seq_lens = [int(n) for n in seq_lens]
    batch = len(seq_lens)
    need = [-(-n // page_size) for n in seq_lens]
    assert min(seq_lens[0], seq_lens[1]) >= shared_pages * page_size
    num_pages = 1 + sum(need) - shared_pages + int(rng.integers(2, 5)) if num_slots is None else num_slots // page_size
    assert num_pages >= 1 + sum(need) - shared_pages
    free = list(rng.permutation(np.arange(1, num_pages)))
    max_pages = max(need) + 1
    req_to_page = np.zeros((batch + 2, max_pages), np.int32)
    rows = rng.permutation(batch + 2)[:batch].astype(np.int32)
    for b in range(batch):
        for p in range(need[b]):
            req_to_page[rows[b], p] = req_to_page[rows[0], p] if b == 1 and p < shared_pages else free.pop()
    width = None if num_slots is None else CONTEXT
    num_slots = num_pages * page_size
    req_to_token = numpy_slots(req_to_page, page_size, num_slots, width)
    owned = np.zeros(num_slots, bool)
    for b in range(batch):
        owned[req_to_token[rows[b], : seq_lens[b]]] = True
    assert not owned[:page_size].any()  # the padding page is never listed for real tokens
    k = np.where(owned[:, None, None], rng.standard_normal((num_slots, hkv, dim)), np.nan).astype(np.float32)
    v = np.where(owned[:, None, None], rng.standard_normal((num_slots, hkv, dim)), np.nan).astype(np.float32)
    return Paged(req_to_page, req_to_token, rows, page_size, num_slots, jnp.asarray(k), jnp.asarray(v))


def assert_same_metadata(a, b):
    assert type(a) is type(b)
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if hasattr(x, "shape"):
            assert x.dtype == y.dtype, field.name
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=field.name)
        else:
            assert x == y, field.name


def clean(x):
    return jnp.nan_to_num(x, nan=0.0)  # the references multiply padding rows by 0: give them zeros, not NaN


# ---------------------------------------------------------------------------------------------
# The page rule and the index lists (no attention kernel).


def test_page_sizes():
    assert PAGE_SIZES == (1, 8, 16, 32, 64, 128)


@pytest.mark.parametrize("page_size", PAGES)
def test_token_slots_and_tables(rng, page_size):
    num_pages, max_pages = 6, 3
    num_slots = num_pages * page_size
    # Real pages, page 0, and ids past the pool, negative or huge: the last three must read as the padding slot 0.
    req_to_page = rng.choice(np.array([0, 1, 2, 3, 4, 5, 6, 7, -1, -(2**31), 2**31 - 1], np.int32), size=(4, max_pages))
    want = numpy_slots(req_to_page, page_size, num_slots)
    got = req_to_token_from_pages(jnp.asarray(req_to_page), page_size, num_slots=num_slots)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert 0 <= int(got.min()) and int(got.max()) < num_slots
    # Rows and positions outside the table give slot 0; rows broadcast against a position grid.
    rows = np.array([0, 3, -1, 4, 2], np.int32)
    positions = np.arange(-2, max_pages * page_size + 3, dtype=np.int32)
    slots = np.asarray(token_slots(jnp.asarray(req_to_page), jnp.asarray(rows)[:, None], jnp.asarray(positions)[None, :],
                                   page_size, num_slots=num_slots))
    padded = np.pad(want, ((1, 1), (2, 3)))  # row -1 / 4 and positions -2, -1, width.. width + 2 all 0
    np.testing.assert_array_equal(slots, padded[np.array([1, 4, 0, 5, 3])])
    # A longer page-1 table: the positions past the pages are 0.
    wide = req_to_token_from_pages(jnp.asarray(req_to_page), page_size, max_pages * page_size + 5, num_slots=num_slots)
    np.testing.assert_array_equal(np.asarray(wide), np.pad(want, ((0, 0), (0, 5))))


def test_kv_indices_and_out_cache_loc(rng):
    page_size = 16  # page 1 goes through the same lists in test_decode / test_extend
    paged = paged_batch(rng, page_size, [2 * page_size + 3, page_size + 2, 5])
    table, rows = jnp.asarray(paged.req_to_page), jnp.asarray(np.append(paged.rows, [7, -1]).astype(np.int32))
    lens = jnp.asarray([2 * page_size + 3, page_size + 2, 5, 4, 3], jnp.int32)
    starts = jnp.asarray([page_size - 1, 0, 2, 0, 0], jnp.int32)  # a window start mid-page; out-of-table rows
    for capacity in (int(lens.sum()) + 4, int(lens.sum()) - 3):  # room to spare, and a truncated total
        want = create_kv_indices_reference(jnp.asarray(paged.req_to_token), rows, lens, starts, capacity=capacity)
        got = create_kv_indices_from_pages(table, rows, lens, starts, page_size=page_size, num_slots=paged.num_slots,
                                           capacity=capacity)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    prefix, extend = np.array([page_size + 1, page_size, 0]), np.array([page_size + 2, 2, 5])
    loc = out_cache_loc_from_pages(table, jnp.asarray(paged.rows), jnp.asarray(prefix, jnp.int32),
                                   jnp.asarray(extend, jnp.int32), page_size=page_size, num_slots=paged.num_slots,
                                   num_tokens=int(extend.sum()) + 2)
    want = np.concatenate([paged.req_to_token[paged.rows[b], prefix[b] : prefix[b] + extend[b]] for b in range(3)] + [[0, 0]])
    np.testing.assert_array_equal(np.asarray(loc), want)
    # The builders' defaults (max_context_len: the page table's max_pages * page_size tokens) match the page-1
    # builder's on the equivalent table (its width).
    seq_lens = jnp.asarray([2 * page_size + 3, page_size + 2, 0], jnp.int32)
    dec = dict(kv_capacity=int(seq_lens.sum()), q_heads=4, kv_heads=2, num_sms=1)
    assert_same_metadata(
        decode_metadata_from_pages(table, rows[:3], seq_lens, page_size=page_size, num_slots=paged.num_slots, **dec),
        decode_metadata(req_to_token_from_pages(table, page_size, num_slots=paged.num_slots), rows[:3], seq_lens,
                        launch_mode="interpret", **dec))


def test_rejects_bad_arguments():
    table, rows, lens = jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32), jnp.ones((2,), jnp.int32)
    dec = dict(page_size=8, num_slots=64, kv_capacity=8, q_heads=2, kv_heads=1)
    for page_size in (0, 2, 4, 256, 8.0, True, None):
        with pytest.raises(ValueError, match="page_size must be one of"):
            token_slots(table, rows, lens, page_size, num_slots=64)
    for num_slots in (0, -8, 60, 8.0, 2**31 + 8):
        with pytest.raises(ValueError, match="num_slots"):
            decode_metadata_from_pages(table, rows, lens, **(dec | dict(num_slots=num_slots)))
    with pytest.raises(ValueError, match="req_to_page must have rank 2"):
        decode_metadata_from_pages(table[0], rows, lens, **dec)
    with pytest.raises(ValueError, match="req_to_page must have dtype"):
        extend_metadata_from_pages(table.astype(jnp.float32), rows, lens, lens, page_size=8, num_slots=64,
                                   max_extend_len=4, kv_capacity=8)
    with pytest.raises(ValueError, match="positions must be an array"):
        token_slots(table, rows, [0, 1], 8, num_slots=64)
    with pytest.raises(ValueError, match="must broadcast together"):
        token_slots(table, rows, jnp.zeros((3,), jnp.int32), 8, num_slots=64)
    with pytest.raises(ValueError, match="seq_lens must have shape"):
        decode_metadata_from_pages(table, rows, jnp.ones((3,), jnp.int32), **dec)
    with pytest.raises(ValueError, match="prefix_lens must have shape"):
        extend_unified_metadata_from_pages(table, rows, lens[:1], lens, lens, page_size=8, num_slots=64,
                                           max_extend_len=4, kv_capacity=8)
    with pytest.raises(ValueError, match="out_cache_loc must have rank 1"):
        extend_unified_metadata_from_pages(table, rows, lens, lens, lens[None], page_size=8, num_slots=64,
                                           max_extend_len=4, kv_capacity=8)
    with pytest.raises(ValueError, match="num_tokens must be a positive"):
        out_cache_loc_from_pages(table, rows, lens, lens, page_size=8, num_slots=64, num_tokens=0)


# ---------------------------------------------------------------------------------------------
# Attention through the interpreter: page metadata == page-1 metadata, the same kernel output, and the reference.


# The references, jitted (eager they cost more than the interpreted kernels) on the NaN-free pools.
decode_reference = jax.jit(lambda q, k, v, meta: decode_attention_reference(q, clean(k), clean(v), meta))
extend_reference = jax.jit(
    lambda q, k_new, v_new, k, v, meta, window: extend_attention_reference(q, k_new, v_new, clean(k), clean(v), meta,
                                                                           sliding_window=window),
    static_argnames="window")
unified_reference = jax.jit(
    lambda q, k, v, meta, window: extend_attention_unified_reference(q, clean(k), clean(v), meta, sliding_window=window),
    static_argnames="window")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("page_size", PAGES)
def test_decode(rng, mode, page_size):
    # Sequence 0 ends mid-page (3 into its third page); 1 shares 0's first page and ends 2 into its own; 2 is a
    # padding row; 3 fills its page exactly.
    seq_lens = np.array([2 * page_size + 3, page_size + 2, 0, page_size], np.int32)
    paged = paged_batch(rng, page_size, seq_lens, num_slots=NUM_SLOTS)
    q = jnp.asarray(rng.standard_normal((len(seq_lens), HQ, DIM)).astype(np.float32))
    rows, lens = jnp.asarray(paged.rows), jnp.asarray(seq_lens)
    common = dict(kv_capacity=4 * 128 + 8, q_heads=HQ, kv_heads=HKV, max_kv_splits=2, num_sms=1, min_split_len=32,
                  max_context_len=CONTEXT, launch_mode=mode)
    # No window, then W = page_size + 1: sequence 0's first key, position page_size + 1, sits mid-page.
    for window in (-1, page_size + 1):
        meta = decode_metadata_from_pages(jnp.asarray(paged.req_to_page), rows, lens, page_size=page_size,
                                          num_slots=paged.num_slots, sliding_window=window, **common)
        meta_1 = decode_metadata(jnp.asarray(paged.req_to_token), rows, lens, sliding_window=window, **common)
        assert_same_metadata(meta, meta_1)
        o, lse = decode_attention(q, paged.k_pool, paged.v_pool, meta, return_lse=True, launch_mode=mode)
        o_1, lse_1 = decode_attention(q, paged.k_pool, paged.v_pool, meta_1, return_lse=True, launch_mode=mode)
        np.testing.assert_array_equal(np.asarray(o), np.asarray(o_1))
        assert not np.isnan(np.asarray(o)).any()
        np.testing.assert_allclose(np.asarray(o), np.asarray(decode_reference(q, paged.k_pool, paged.v_pool, meta_1)),
                                   **tolerance(jnp.float32))
        np.testing.assert_array_equal(np.asarray(o[2]), 0.0)  # the padding row
        assert np.all(np.asarray(lse[2]) == -np.inf)
    # The decode step's own slots (what write_kv stores this token's K/V at): position seq_len - 1, padding row 0.
    own = token_slots(jnp.asarray(paged.req_to_page), rows, lens - 1, page_size, num_slots=paged.num_slots)
    want = [paged.req_to_token[r, n - 1] if n else 0 for r, n in zip(paged.rows, seq_lens)]
    np.testing.assert_array_equal(np.asarray(own), want)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("page_size", PAGES)
def test_extend(rng, mode, page_size):
    # Prefixes: 3 into a second page, one whole page shared with sequence 0, none. Every length ends mid-page
    # (page size > 1). W = 5 starts sequence 0's listed prefix at page_size - 2, mid-page.
    prefix_lens = np.array([page_size + 3, page_size, 0], np.int32)
    extend_lens = np.array([4, 3, 5], np.int32)
    paged = paged_batch(rng, page_size, prefix_lens + extend_lens, num_slots=NUM_SLOTS)
    tokens = int(extend_lens.sum())
    table, rows = jnp.asarray(paged.req_to_page), jnp.asarray(paged.rows)
    args = (rows, jnp.asarray(prefix_lens), jnp.asarray(extend_lens))
    pages = dict(page_size=page_size, num_slots=paged.num_slots)
    loc = out_cache_loc_from_pages(table, *args, num_tokens=tokens, **pages)
    want_loc = np.concatenate([paged.req_to_token[paged.rows[b], prefix_lens[b] : prefix_lens[b] + extend_lens[b]]
                               for b in range(3)])
    np.testing.assert_array_equal(np.asarray(loc), want_loc)
    q = jnp.asarray(rng.standard_normal((tokens, HQ, DIM)).astype(np.float32))
    k_new = jnp.asarray(rng.standard_normal((tokens, HKV, DIM)).astype(np.float32))
    v_new = jnp.asarray(rng.standard_normal((tokens, HKV, DIM)).astype(np.float32))
    # Two-stage: the pool without the new tokens (NaN at their slots). Unified: write_kv stores them by slot.
    k_prefix = paged.k_pool.at[loc].set(jnp.nan)
    v_prefix = paged.v_pool.at[loc].set(jnp.nan)
    k_all, v_all = write_kv(k_prefix, v_prefix, loc, k_new, v_new)
    common = dict(max_extend_len=8, kv_capacity=2 * 128 + 24)
    for window in (-1, 5):
        kw = dict(sliding_window=window, launch_mode=mode, **common)
        meta = extend_metadata_from_pages(table, *args, **pages, **kw)
        meta_1 = extend_metadata(jnp.asarray(paged.req_to_token), *args, **kw)
        # The page builders promise whole pages (a window's cut lists start mid-page: none), the rest is the same.
        assert meta.page_size == (page_size if window < 0 else 1) and meta_1.page_size == 1
        assert_same_metadata(dataclasses.replace(meta, page_size=1), meta_1)
        run = dict(config=SMALL, sliding_window=window, launch_mode=mode)
        o = extend_attention(q, k_new, v_new, k_prefix, v_prefix, meta, impl="triton", **run)
        o_1 = extend_attention(q, k_new, v_new, k_prefix, v_prefix, meta_1, impl="triton", **run)
        np.testing.assert_array_equal(np.asarray(o), np.asarray(o_1))
        assert not np.isnan(np.asarray(o)).any()
        ref = extend_reference(q, k_new, v_new, k_prefix, v_prefix, meta_1, window)
        np.testing.assert_allclose(np.asarray(o), np.asarray(ref), **tolerance(jnp.float32))

        meta_u = extend_unified_metadata_from_pages(table, *args, loc, **pages, **kw)
        meta_u1 = extend_unified_metadata(jnp.asarray(paged.req_to_token), *args, jnp.asarray(want_loc), **kw)
        assert meta_u.page_size == meta.page_size
        assert_same_metadata(dataclasses.replace(meta_u, page_size=1), meta_u1)
        o_u = extend_attention_unified(q, k_all, v_all, meta_u, **run)
        o_u1 = extend_attention_unified(q, k_all, v_all, meta_u1, **run)
        np.testing.assert_array_equal(np.asarray(o_u), np.asarray(o_u1))
        assert not np.isnan(np.asarray(o_u)).any()
        np.testing.assert_allclose(np.asarray(o_u), np.asarray(unified_reference(q, k_all, v_all, meta_u1, window)),
                                   **tolerance(jnp.float32))
        np.testing.assert_allclose(np.asarray(o_u), np.asarray(ref), **tolerance(jnp.float32))  # both forms agree


@pytest.mark.parametrize("page_size", [1, 16])
def test_draft_decode_metadata_over_pages(rng, page_size):
    """Speculative draft steps over a PageTable: the same metadata as over its page-1 table, the drafts' reserved
    slots (positions seq_len + t * steps + j) included; a padding row (seq_len 0) gets empty lists either way."""
    from jaxattn.triton_backend import draft_decode_metadata

    num_steps, topk = 3, 2
    verified = np.array([34, 27, 14, 0], np.int32)
    paged = paged_batch(rng, page_size, [n + topk * num_steps if n else 0 for n in verified])
    kw = dict(speculative_num_steps=num_steps, topk=topk, kv_capacity=256, q_heads=8, kv_heads=2, max_kv_splits=4)
    rows, lens = jnp.asarray(paged.rows), jnp.asarray(verified)
    table = PageTable(jnp.asarray(paged.req_to_page), page_size=page_size, num_slots=paged.num_slots)
    got = draft_decode_metadata(table, rows, lens, **kw)
    want = draft_decode_metadata(jnp.asarray(paged.req_to_token), rows, lens, **kw)
    assert_same_metadata(got, want)
    assert int(got.kv_indptr[0, -1]) == topk * (verified.sum() + np.count_nonzero(verified))  # step 0: prefix + 1 draft
    assert np.asarray(got.out_cache_loc).min() >= 0 and (np.asarray(got.out_cache_loc) > 0).sum() == 2 * topk * 3


@pytest.mark.parametrize("page_size", [1, 16])
def test_cross_attention_metadata_over_pages(rng, page_size):
    """Cross attention's lists (each sequence's encoder tokens, then run non-causal) from the pages equal the
    page-1 builder's; an encoder of 0 tokens (a decoder-only row) lists nothing."""
    from jaxattn.metadata import cross_attention_metadata

    paged = paged_batch(rng, page_size, [40, 33, 20])
    rows, encoder, extend = jnp.asarray(paged.rows), jnp.asarray([40, 17, 0], jnp.int32), jnp.asarray([3, 5, 2], jnp.int32)
    sizes = dict(max_extend_len=8, kv_capacity=128)
    got = cross_attention_metadata_from_pages(jnp.asarray(paged.req_to_page), rows, encoder, extend, page_size=page_size,
                                              num_slots=paged.num_slots, **sizes)
    want = cross_attention_metadata(jnp.asarray(paged.req_to_token), rows, encoder, extend, **sizes)
    assert_same_metadata(got, want)
    np.testing.assert_array_equal(np.asarray(got.kv_indptr), [0, 40, 57, 57])
