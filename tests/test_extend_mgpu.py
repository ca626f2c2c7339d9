"""The Mosaic GPU extend kernel (Hopper): against the reference and the Triton kernel; its input checks and layout."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.extend import (
    extend_attention,
    extend_attention_reference,
    extend_attention_unified,
    extend_attention_unified_reference,
    extend_unified_metadata,
)
from jaxattn.extend_mgpu import MgpuExtendConfig, extend_attention_mgpu, extend_attention_unified_mgpu, mgpu_unsupported
from jaxattn.impl.mgpu_extend import heads_per_cta
from jaxattn.reference import xai_temperature_scale
from tests.barrier_model import Barrier, run_protocol
from tests.helpers import HAS_GPU, random_normal, tolerance
from tests.test_extend import assert_output, draft_words, make_batch, ref_two_stage, ref_unified


def _is_hopper():
    return HAS_GPU and getattr(jax.devices()[0], "compute_capability", "") == "9.0"


needs_hopper = pytest.mark.skipif(not _is_hopper(), reason="needs an sm_90 GPU (Mosaic GPU, wgmma)")

# Ragged batches that reach every path: sequences starting off the 8-row grid (lead rows), partial and whole q tiles,
# one and several 128-row CTAs, prefixes shorter than, equal to and longer than a K tile, empty prefixes and extends,
# token counts that are not a multiple of 8 (the padded copy).
SHAPES = [
    # dtype, q heads, kv heads, head dim, prefix lens, extend lens, config
    (jnp.bfloat16, 8, 2, 128, [0, 37, 128, 300], [130, 5, 64, 257], None),
    (jnp.float16, 4, 4, 128, [513, 0, 9], [1, 200, 71], MgpuExtendConfig(block_kv=64, stages=3)),
    (jnp.bfloat16, 4, 1, 64, [64, 0, 1000, 3], [0, 63, 129, 8], None),
    (jnp.bfloat16, 2, 2, 64, [0], [3], None),  # fewer tokens than a tile
]


def _new_tokens(batch, whole_tiles):
    """(q, k_new, v_new) of a batch; whole_tiles: padded with NaN tokens to a multiple of 8 rows, so new-key tiles
    wholly inside the batch come by TMA (the tail tile by cp.async, its padding rows zero-filled)."""
    q, k_new, v_new = batch.q, batch.k_new, batch.v_new
    if whole_tiles:
        pad = ((0, -q.shape[0] % 8), (0, 0), (0, 0))
        q, k_new, v_new = (jnp.pad(x, pad, constant_values=jnp.nan) for x in (q, k_new, v_new))
    return q, k_new, v_new


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{jnp.dtype(s[0]).name}-{s[1]}x{s[2]}-{s[3]}-{len(s[4])}seq")
@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("whole_tiles", [False, True], ids=["tokens-odd", "tokens-x8"])
def test_matches_reference(rng, shape, whole_tiles):
    # tokens-odd: every K/V tile by cp.async. tokens-x8 (padded with NaN tokens to a multiple of 8): new-key tiles
    # wholly inside the batch by TMA, the tail tile by cp.async with its padding rows zero-filled.
    dtype, hq, hkv, d, prefix_lens, extend_lens, config = shape
    batch = make_batch(rng, prefix_lens, extend_lens, hq=hq, hkv=hkv, dqk=d, dtype=dtype, max_extend_len=max(extend_lens) + 9)
    q, k_new, v_new = _new_tokens(batch, whole_tiles)
    o = extend_attention_mgpu(q, k_new, v_new, batch.k_pool, batch.v_pool, batch.meta, config=config)
    assert o.shape == q.shape and o.dtype == dtype
    assert_output(o, ref_two_stage(batch), batch, dtype)  # rows past batch.tokens (padding) must be 0


# Features (static flags of the kernel), each against the reference on every SHAPES batch. cut: the prefix lists are
# cut for that window (extend_metadata(..., sliding_window=cut)): positions are then listed coordinates.
FEATURES = [
    # label, sliding_window, cut, logit_cap, sinks
    ("window0", 0, -1, 0.0, False),  # one key per query: every tile but the diagonal's skipped or masked
    ("window37-cut", 37, 37, 0.0, False),  # smaller than a tile, on a window-cut prefix list
    ("window100-cutwider", 100, 160, 0.0, False),  # a list cut for a wider window than the call's
    ("window100", 100, -1, 0.0, False),  # full prefix list: leading prefix tiles skipped
    ("window5000", 5000, -1, 0.0, False),  # larger than every prefix and extend: nothing skipped, nothing masked
    ("softcap", -1, -1, 2.0, False),  # a cap the scores reach (s ~ N(0, 1) after the scale)
    ("sinks", -1, -1, 0.0, True),
    ("all-cut", 64, 64, 3.0, True),
]


def _feature_kwargs(rng, hq, window, logit_cap, sinks):
    return _more_kwargs(rng, hq, dict(sliding_window=window, logit_cap=logit_cap, sinks=sinks))


@pytest.mark.parametrize("feature", FEATURES, ids=lambda f: f[0])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{jnp.dtype(s[0]).name}-{s[1]}x{s[2]}-{s[3]}-{len(s[4])}seq")
@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("whole_tiles", [False, True], ids=["tokens-odd", "tokens-x8"])
def test_features_match_reference(rng, shape, feature, whole_tiles):
    # As test_matches_reference, with a window (the CTA's first steps skipped by producer and consumers alike, the
    # second warpgroup's head flush, per-row window masks), a soft cap, sinks, or all three.
    dtype, hq, hkv, d, prefix_lens, extend_lens, config = shape
    _, window, cut, logit_cap, sinks = feature
    batch = make_batch(rng, prefix_lens, extend_lens, hq=hq, hkv=hkv, dqk=d, dtype=dtype, window=cut,
                       max_extend_len=max(extend_lens) + 9)
    kw = _feature_kwargs(rng, hq, window, logit_cap, sinks)
    q, k_new, v_new = _new_tokens(batch, whole_tiles)
    o = extend_attention_mgpu(q, k_new, v_new, batch.k_pool, batch.v_pool, batch.meta, config=config, **kw)
    assert o.shape == q.shape and o.dtype == dtype
    assert_output(o, ref_two_stage(batch, **kw), batch, dtype)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("feature", [f for f in FEATURES if f[0] in ("window100", "all-cut", "softcap")] +
                         [("window1024-cut", 1024, 1024, 0.0, False), ("all1024", 1024, -1, 50.0, True)],
                         ids=lambda f: f[0])
def test_features_match_triton_kernel_on_a_larger_batch(rng, feature):
    # Several CTAs per sequence whose windows start past the prefix (whole prefixes skipped), GQA 4:1.
    _, window, cut, logit_cap, sinks = feature
    batch = make_batch(rng, [1500, 0, 700, 2048], [1024, 2000, 777, 300], hq=8, hkv=2, dqk=128, dtype=jnp.bfloat16,
                       scale=0.5, window=cut)
    kw = _feature_kwargs(rng, 8, window, logit_cap, sinks)
    o = extend_attention_mgpu(batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta, **kw)
    o_triton = extend_attention(batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta, impl="triton", **kw)
    assert_output(o, o_triton, batch, jnp.bfloat16)
    assert_output(o, ref_two_stage(batch, **kw), batch, jnp.bfloat16)
    np.testing.assert_array_equal(np.float32(extend_attention(batch.q, batch.k_new, batch.v_new, batch.k_pool,
                                                              batch.v_pool, batch.meta, **kw)), np.float32(o))  # the default


# Non-causal calls (encoder tokens: every new key of the sequence, masked where a tile holds another sequence's) and
# xai temperature (a per-row factor folded into the exponent's scale), alone and with the other features.
MORE_FEATURES = [
    ("noncausal", dict(causal=False)),
    ("noncausal-cap-sinks", dict(causal=False, logit_cap=2.0, sinks=True)),
    ("xai", dict(xai_temperature_len=20)),
    ("xai-window-cap", dict(xai_temperature_len=50, sliding_window=37, logit_cap=3.0)),
    ("noncausal-xai", dict(causal=False, xai_temperature_len=8)),
]


def _more_kwargs(rng, hq, features):
    kw = dict(features)
    if kw.pop("sinks", False):
        kw["sinks"] = jnp.asarray(rng.standard_normal(hq) * 2.0, jnp.float32)
    return kw


@pytest.mark.parametrize("feature", MORE_FEATURES, ids=lambda f: f[0])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{jnp.dtype(s[0]).name}-{s[1]}x{s[2]}-{s[3]}-{len(s[4])}seq")
@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("whole_tiles", [False, True], ids=["tokens-odd", "tokens-x8"])
def test_noncausal_and_xai_match_reference(rng, shape, feature, whole_tiles):
    dtype, hq, hkv, d, prefix_lens, extend_lens, config = shape
    batch = make_batch(rng, prefix_lens, extend_lens, hq=hq, hkv=hkv, dqk=d, dtype=dtype, max_extend_len=max(extend_lens) + 9)
    kw = _more_kwargs(rng, hq, feature[1])
    q, k_new, v_new = _new_tokens(batch, whole_tiles)
    o = extend_attention_mgpu(q, k_new, v_new, batch.k_pool, batch.v_pool, batch.meta, config=config, **kw)
    assert_output(o, ref_two_stage(batch, **kw), batch, dtype)
    np.testing.assert_array_equal(  # the default route takes these calls
        np.float32(extend_attention(q, k_new, v_new, batch.k_pool, batch.v_pool, batch.meta, config=config, **kw)),
        np.float32(o))


UNIFIED_FEATURES = [
    ("causal", dict()),
    ("noncausal", dict(causal=False)),
    ("cap-sinks-xai", dict(logit_cap=2.0, sinks=True, xai_temperature_len=20)),
]


@pytest.mark.parametrize("feature", UNIFIED_FEATURES, ids=lambda f: f[0])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{jnp.dtype(s[0]).name}-{s[1]}x{s[2]}-{s[3]}-{len(s[4])}seq")
@pytest.mark.gpu
@needs_hopper
def test_unified_matches_reference(rng, shape, feature):
    # The unified form: every key (prefix and new) from the pool through one list, all tiles masked alike.
    dtype, hq, hkv, d, prefix_lens, extend_lens, config = shape
    batch = make_batch(rng, prefix_lens, extend_lens, hq=hq, hkv=hkv, dqk=d, dtype=dtype, max_extend_len=max(extend_lens) + 9)
    kw = _more_kwargs(rng, hq, feature[1])
    args = (batch.q, batch.k_pool_unified, batch.v_pool_unified, batch.meta_unified)
    o = extend_attention_unified_mgpu(*args, config=config, **kw)
    assert o.shape == batch.q.shape and o.dtype == dtype
    assert_output(o, ref_unified(batch, **kw), batch, dtype)
    np.testing.assert_array_equal(np.float32(extend_attention_unified(*args, config=config, **kw)), np.float32(o))


@pytest.mark.parametrize("window", [0, 40, 300])
@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: f"{jnp.dtype(s[0]).name}-{s[1]}x{s[2]}-{s[3]}-{len(s[4])}seq")
@pytest.mark.gpu
@needs_hopper
def test_unified_windows_match_reference(rng, shape, window):
    # The unified form under a window, on uncut lists (the default route's since this passed on the H200), with a
    # soft cap and sinks.
    dtype, hq, hkv, d, prefix_lens, extend_lens, config = shape
    batch = make_batch(rng, prefix_lens, extend_lens, hq=hq, hkv=hkv, dqk=d, dtype=dtype, max_extend_len=max(extend_lens) + 9)
    kw = _more_kwargs(rng, hq, dict(sliding_window=window, logit_cap=2.0, sinks=True))
    args = (batch.q, batch.k_pool_unified, batch.v_pool_unified, batch.meta_unified)
    assert_output(extend_attention_unified_mgpu(*args, config=config, **kw), ref_unified(batch, **kw), batch, dtype)


@pytest.mark.gpu
@needs_hopper
def test_deterministic_backend_window_layer_on_the_kernel_is_split_invariant(rng):
    # TritonBackend(deterministic=True) on a window layer: full unified lists with the window as the argument, so the
    # Mosaic GPU kernel (not the unified Triton kernel) runs it. One 36-token sequence prefilled as (p cached + the
    # rest new): every token computed in two splits gets the same bits, and the reference's values.
    from jaxattn.backends import AttentionLayer, ReferenceBackend
    from jaxattn.batch import ForwardBatch, ForwardMode
    from jaxattn.extend_mgpu import unified_window_on_full_lists
    from jaxattn.triton_backend import TritonBackend

    length, hq, hkv, d, window, num_slots = 36, 8, 2, 128, 7, 100
    layer = AttentionLayer(0, hq, hkv, d, sliding_window=window)
    slots = rng.permutation(np.arange(1, num_slots))[:length].astype(np.int32)
    req_to_token = jnp.asarray(np.concatenate([slots, np.zeros(4, np.int32)])[None])
    q_all, k_all, v_all = (random_normal(rng, (length, h, d), jnp.bfloat16) for h in (hq, hkv, hkv))
    k_pool = jnp.zeros((num_slots, hkv, d), jnp.bfloat16).at[slots].set(k_all)  # every token's K/V already cached
    v_pool = jnp.zeros((num_slots, hkv, d), jnp.bfloat16).at[slots].set(v_all)
    assert unified_window_on_full_lists(q_all, k_pool, v_pool, sliding_window=window)
    outputs = {}
    for prefix in (0, 11, 29):
        new = length - prefix
        batch = ForwardBatch(req_pool_indices=jnp.zeros(1, jnp.int32), seq_lens=jnp.asarray([length], jnp.int32),
                             extend_lens=jnp.asarray([new], jnp.int32), out_cache_loc=jnp.asarray(slots[prefix:]),
                             positions=jnp.arange(prefix, length, dtype=jnp.int32), mode=ForwardMode.EXTEND,
                             max_extend_len=length, kv_capacity=length + 4, max_seq_len=length + 4)
        got = []
        for backend in (TritonBackend(deterministic=True, sliding_windows=(window,)), ReferenceBackend()):
            meta = backend.init_forward_metadata(batch, req_to_token)
            got.append(backend.forward(q_all[prefix:], k_all[prefix:], v_all[prefix:], k_pool, v_pool, layer, meta)[0])
        np.testing.assert_allclose(np.float32(got[0]), np.float32(got[1]), **tolerance(jnp.bfloat16))
        outputs[prefix] = np.asarray(got[0].astype(jnp.float32))
    for p1 in outputs:
        for p2 in outputs:
            if p1 < p2:  # tokens p2.. are computed in both splits
                np.testing.assert_array_equal(outputs[p1][p2 - p1:], outputs[p2], err_msg=f"splits at {p1} and {p2}")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("config", [MgpuExtendConfig(), MgpuExtendConfig(block_kv=64, stages=3)], ids=["kv128", "kv64"])
@pytest.mark.parametrize("features", [dict(), dict(logit_cap=3.0, xai_temperature_len=100, sinks=True),
                                      dict(sliding_window=100, sinks=True)], ids=["plain", "cap-xai-sinks", "window"])
def test_unified_is_bitwise_split_invariant(rng, config, features):
    # One 700-token sequence split as (prefix p, new 700 - p), beside a second sequence that moves its q rows: every
    # token computed in two splits gets the same bits (its tiles sit at fixed listed-key offsets; a tile a row sees
    # whole runs unmasked in one split and masked in another with the same arithmetic; tiles past a row's last key
    # are exact no-ops).
    length, hq, hkv, d, slots_n = 700, 8, 2, 128, 2000
    slots = rng.permutation(np.arange(1, slots_n))[:length].astype(np.int32)
    k_pool = random_normal(rng, (slots_n, hkv, d), jnp.bfloat16)
    v_pool = random_normal(rng, (slots_n, hkv, d), jnp.bfloat16)
    q_all = random_normal(rng, (length, hq, d), jnp.bfloat16)
    other = 37
    kw = _more_kwargs(rng, hq, features)
    table = jnp.asarray(np.stack([np.concatenate([slots, np.zeros(8, np.int32)]),
                                  np.concatenate([np.arange(1500, 1500 + 60, dtype=np.int32), np.zeros(648, np.int32)])]))
    outputs = {}
    for p in (0, 1, 63, 64, 129, 300, 511, 699):
        n = length - p
        meta = extend_unified_metadata(
            table, jnp.asarray([0, 1], jnp.int32), jnp.asarray([p, 60 - other], jnp.int32), jnp.asarray([n, other], jnp.int32),
            jnp.concatenate([jnp.asarray(slots[p:]), jnp.arange(1500 + 60 - other, 1500 + 60, dtype=jnp.int32)]),
            max_extend_len=length, kv_capacity=length + 64)
        q = jnp.concatenate([q_all[p:], random_normal(rng, (other, hq, d), jnp.bfloat16)])
        o = extend_attention_unified_mgpu(q, k_pool, v_pool, meta, config=config, **kw)
        outputs[p] = np.asarray(o[:n].astype(jnp.float32))
        ref = extend_attention_unified_reference(q, k_pool, v_pool, meta, **kw)
        np.testing.assert_allclose(outputs[p], np.float32(ref[:n]), **tolerance(jnp.bfloat16))
    for p1 in outputs:
        for p2 in outputs:
            if p1 < p2:  # tokens p2.. are computed in both splits
                np.testing.assert_array_equal(outputs[p1][p2 - p1 :], outputs[p2], err_msg=f"splits at {p1} and {p2}")


UNIFIED_CUSTOM_MASKS = [
    ("tree", dict()),
    ("tree-window-cap-sinks", dict(sliding_window=40, logit_cap=3.0, sinks=True)),
    ("short-two-heads-per-cta", dict(short=True)),
]


@pytest.mark.parametrize("feature", UNIFIED_CUSTOM_MASKS, ids=lambda f: f[0])
@pytest.mark.gpu
@needs_hopper
def test_unified_custom_masks_match_reference(rng, feature):
    # A deterministic verify step: the mask's rows span the listed keys (prefix, then the new tokens), random prefix
    # columns and a random tree over the new ones; every tile is masked by its gathered entries. A blind row gives 0.
    kw = _more_kwargs(rng, 8, feature[1])
    short = kw.pop("short", False)
    prefix_lens, extend_lens = ([300, 0, 77, 1000], [64, 37, 5, 64]) if short else ([0, 37, 128, 300], [130, 5, 64, 257])
    batch = make_batch(rng, prefix_lens, extend_lens, hq=8, hkv=2, dqk=128, dtype=jnp.bfloat16,
                       max_extend_len=max(extend_lens) if short else 266)
    listed = [int(x) for x in np.asarray(batch.meta_unified.prefix_lens)]
    kw["custom_mask"] = _tree_masks(rng, listed, extend_lens, blind_row=(0, 3))
    args = (batch.q, batch.k_pool_unified, batch.v_pool_unified, batch.meta_unified)
    o = extend_attention_unified_mgpu(*args, **kw)
    assert_output(o, ref_unified(batch, **kw), batch, jnp.bfloat16)
    np.testing.assert_array_equal(np.float32(o[3]), 0.0)
    np.testing.assert_array_equal(np.float32(extend_attention_unified(*args, **kw)), np.float32(o))  # the default route


def _paged_extend(rng, page_size, dim=128):
    """A ragged batch over a page table (prefixes ending mid-page, on a page, sharing sequence 0's first page, none;
    NaN in every pool row no token owns), bf16, heads of `dim`: (q, k_new, v_new, k_pool, v_pool, two-stage meta,
    unified meta)."""
    from jaxattn.paging import extend_metadata_from_pages, extend_unified_metadata_from_pages, out_cache_loc_from_pages
    from tests.test_paging import paged_batch

    prefix_lens = np.array([3 * page_size + 5, page_size, 700, 2 * page_size, 0], np.int32)
    extend_lens = np.array([130, 37, 64, 257, 8], np.int32)  # 496 tokens: whole new-key tiles by TMA as well
    paged = paged_batch(rng, page_size, prefix_lens + extend_lens, hkv=2, dim=dim)
    k_pool, v_pool = paged.k_pool.astype(jnp.bfloat16), paged.v_pool.astype(jnp.bfloat16)
    args = (jnp.asarray(paged.req_to_page), jnp.asarray(paged.rows), jnp.asarray(prefix_lens), jnp.asarray(extend_lens))
    pages = dict(page_size=page_size, num_slots=paged.num_slots)
    tokens = int(extend_lens.sum())
    loc = out_cache_loc_from_pages(*args, num_tokens=tokens, **pages)
    sizes = dict(max_extend_len=int(extend_lens.max()), kv_capacity=int((prefix_lens + extend_lens).sum()) + 16)
    meta = extend_metadata_from_pages(*args, **pages, **sizes)
    meta_u = extend_unified_metadata_from_pages(*args, loc, **pages, **sizes)
    assert meta.page_size == meta_u.page_size == page_size
    q = random_normal(rng, (tokens, 8, dim), jnp.bfloat16)
    return q, k_pool[loc], v_pool[loc], k_pool, v_pool, meta, meta_u


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("config", [None, MgpuExtendConfig(block_kv=64, stages=3)], ids=["kv128", "kv64"])
@pytest.mark.parametrize("page_size", [16, 32, 64, 128])
def test_whole_pages_match_row_copies_and_reference(rng, page_size, config):
    # Lists of whole pages: the prefix tiles inside the prefix come by TMA page by page (pages larger than the tile a
    # tile's rows at a time). The tiles hold the same rows as the row-by-row copies', so every bit matches theirs;
    # both forms against the reference, both under a window too; the default route takes the page path.
    q, k_new, v_new, k_pool, v_pool, meta, meta_u = _paged_extend(rng, page_size)
    rows_only = lambda m: dataclasses.replace(m, page_size=1)  # noqa: E731
    o = extend_attention_mgpu(q, k_new, v_new, k_pool, v_pool, meta, config=config)
    np.testing.assert_array_equal(
        np.float32(o), np.float32(extend_attention_mgpu(q, k_new, v_new, k_pool, v_pool, rows_only(meta), config=config)))
    ref = extend_attention_reference(q, k_new, v_new, k_pool, v_pool, meta)
    np.testing.assert_allclose(np.float32(o), np.float32(ref), **tolerance(jnp.bfloat16))
    if config is None:  # the default route's config
        np.testing.assert_array_equal(np.float32(extend_attention(q, k_new, v_new, k_pool, v_pool, meta)), np.float32(o))
    # Two-stage under a window on these uncut lists (TritonBackend's window layers cut theirs, so take row copies):
    # the steps start at the tile the window reaches, page copies from there.
    o_w = extend_attention_mgpu(q, k_new, v_new, k_pool, v_pool, meta, config=config, sliding_window=100)
    np.testing.assert_array_equal(np.float32(o_w), np.float32(
        extend_attention_mgpu(q, k_new, v_new, k_pool, v_pool, rows_only(meta), config=config, sliding_window=100)))
    np.testing.assert_allclose(np.float32(o_w), np.float32(extend_attention_reference(
        q, k_new, v_new, k_pool, v_pool, meta, sliding_window=100)), **tolerance(jnp.bfloat16))
    for window in (-1, 100):
        o_u = extend_attention_unified_mgpu(q, k_pool, v_pool, meta_u, config=config, sliding_window=window)
        o_u_rows = extend_attention_unified_mgpu(q, k_pool, v_pool, rows_only(meta_u), config=config, sliding_window=window)
        np.testing.assert_array_equal(np.float32(o_u), np.float32(o_u_rows))
        ref_u = extend_attention_unified_reference(q, k_pool, v_pool, meta_u, sliding_window=window)
        np.testing.assert_allclose(np.float32(o_u), np.float32(ref_u), **tolerance(jnp.bfloat16))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("page_size", [16, 64])
def test_three_consumers_over_pages_match_two_and_reference(rng, page_size):
    # MgpuExtendConfig(consumers=3) (the candidate 64-dim default) over page tables, by row copies (16) and page
    # copies (64), in both forms: two consumers' bits and the reference.
    q, k_new, v_new, k_pool, v_pool, meta, meta_u = _paged_extend(rng, page_size, dim=64)
    three, two = MgpuExtendConfig(consumers=3), MgpuExtendConfig(consumers=2)
    o = extend_attention_mgpu(q, k_new, v_new, k_pool, v_pool, meta, config=three)
    np.testing.assert_allclose(np.float32(o), np.float32(extend_attention_reference(q, k_new, v_new, k_pool, v_pool, meta)),
                               **tolerance(jnp.bfloat16))
    np.testing.assert_array_equal(np.float32(o), np.float32(
        extend_attention_mgpu(q, k_new, v_new, k_pool, v_pool, meta, config=two)))
    o_u = extend_attention_unified_mgpu(q, k_pool, v_pool, meta_u, config=three)
    np.testing.assert_allclose(np.float32(o_u), np.float32(extend_attention_unified_reference(q, k_pool, v_pool, meta_u)),
                               **tolerance(jnp.bfloat16))
    np.testing.assert_array_equal(np.float32(o_u), np.float32(
        extend_attention_unified_mgpu(q, k_pool, v_pool, meta_u, config=two)))


@pytest.mark.gpu
@needs_hopper
def test_whole_pages_with_a_broken_list_stay_in_the_pool(rng):
    # A list that breaks the whole-pages promise (slots out of page order, negative, past the pool, huge): the page
    # copies clamp and round into the pool, so the other sequences' rows are exact and nothing faults.
    q, k_new, v_new, k_pool, v_pool, meta, _ = _paged_extend(rng, 64)
    start, end = (int(x) for x in np.asarray(meta.kv_indptr)[2:4])  # sequence 2's list (700 keys)
    bad = rng.integers(-5, 2**31 - 1, end - start).astype(np.int32)
    bad[:3] = [-1, 2**31 - 1, k_pool.shape[0] - 1]
    broken = dataclasses.replace(meta, kv_indices=meta.kv_indices.at[start:end].set(jnp.asarray(bad)))
    o = np.float32(extend_attention_mgpu(q, k_new, v_new, k_pool, v_pool, broken))
    clean = np.float32(extend_attention_mgpu(q, k_new, v_new, k_pool, v_pool, meta))
    rows = np.asarray(meta.qo_indptr)
    others = np.r_[rows[0]:rows[2], rows[3]:rows[-1]]
    np.testing.assert_array_equal(o[others], clean[others])


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("config", [MgpuExtendConfig(), MgpuExtendConfig(block_kv=64, stages=3)], ids=["kv128", "kv64"])
def test_unified_custom_mask_is_bitwise_split_invariant(rng, config):
    # One 300-token sequence under one [300, 300] tree mask (random earlier keys and itself), split as (prefix p, new
    # 300 - p) beside a second sequence: a token's row (the same mask row in every split) gets the same bits.
    length, hq, hkv, d, slots_n = 300, 8, 2, 128, 1000
    slots = rng.permutation(np.arange(1, slots_n))[:length].astype(np.int32)
    k_pool = random_normal(rng, (slots_n, hkv, d), jnp.bfloat16)
    v_pool = random_normal(rng, (slots_n, hkv, d), jnp.bfloat16)
    q_all = random_normal(rng, (length, hq, d), jnp.bfloat16)
    tree = np.tril(rng.random((length, length)) < 0.4)
    np.fill_diagonal(tree, True)
    other, other_listed = 21, 40
    other_mask = np.tril(np.ones((other, other_listed), bool), k=other_listed - other)
    table = jnp.asarray(np.stack([np.concatenate([slots, np.zeros(8, np.int32)]),
                                  np.concatenate([np.arange(900, 900 + other_listed, dtype=np.int32),
                                                  np.zeros(268, np.int32)])]))
    outputs = {}
    for p in (0, 1, 63, 64, 129, 299):
        n = length - p
        meta = extend_unified_metadata(
            table, jnp.asarray([0, 1], jnp.int32), jnp.asarray([p, other_listed - other], jnp.int32),
            jnp.asarray([n, other], jnp.int32),
            jnp.concatenate([jnp.asarray(slots[p:]), jnp.arange(900 + other_listed - other, 900 + other_listed,
                                                                 dtype=jnp.int32)]),
            max_extend_len=length, kv_capacity=length + 64)
        mask = jnp.asarray(np.concatenate([tree[p:].reshape(-1), other_mask.reshape(-1)]).astype(np.uint8))
        q = jnp.concatenate([q_all[p:], random_normal(rng, (other, hq, d), jnp.bfloat16)])
        o = extend_attention_unified_mgpu(q, k_pool, v_pool, meta, custom_mask=mask, config=config)
        outputs[p] = np.asarray(o[:n].astype(jnp.float32))
        ref = extend_attention_unified_reference(q, k_pool, v_pool, meta, custom_mask=mask)
        np.testing.assert_allclose(np.asarray(o.astype(jnp.float32)), np.float32(ref), **tolerance(jnp.bfloat16))
    for p1 in outputs:
        for p2 in outputs:
            if p1 < p2:  # tokens p2.. are computed in both splits
                np.testing.assert_array_equal(outputs[p1][p2 - p1 :], outputs[p2], err_msg=f"splits at {p1} and {p2}")


@pytest.mark.gpu
@needs_hopper
def test_unified_matches_triton_unified_on_a_larger_batch(rng):
    batch = make_batch(rng, [1500, 0, 700, 2048], [1024, 2000, 777, 300], hq=8, hkv=2, dqk=128, dtype=jnp.bfloat16, scale=0.5)
    args = (batch.q, batch.k_pool_unified, batch.v_pool_unified, batch.meta_unified)
    o = extend_attention_unified_mgpu(*args)
    assert_output(o, extend_attention_unified(*args, impl="triton-unified"), batch, jnp.bfloat16)
    assert_output(o, ref_unified(batch), batch, jnp.bfloat16)


@pytest.mark.gpu
@needs_hopper
def test_unified_rows_with_no_key_are_zero(rng):
    # Bad metadata: a sequence whose list is empty (its rows see nothing) gives 0, not NaN; the others are unharmed.
    batch = make_batch(rng, [30, 12], [20, 9], hq=4, hkv=2, dqk=128, dtype=jnp.bfloat16)
    meta = batch.meta_unified
    kv_indptr = meta.kv_indptr.at[0].set(meta.kv_indptr[1])  # sequence 0 lists no key
    bad = dataclasses.replace(meta, kv_indptr=kv_indptr, prefix_lens=meta.prefix_lens.at[0].set(0))
    o = np.float32(extend_attention_unified_mgpu(batch.q, batch.k_pool_unified, batch.v_pool_unified, bad))
    np.testing.assert_array_equal(o[:20], 0.0)
    want = np.float32(ref_unified(batch))
    np.testing.assert_allclose(o[20:29], want[20:29], **tolerance(jnp.bfloat16))


def _assert_both_forms_match_reference(batch, kw, whole_tiles):
    """A bf16 batch through the two-stage kernel (also what `extend_attention` picks) and, without a window, the
    unified one, each against the reference."""
    q, k_new, v_new = _new_tokens(batch, whole_tiles)
    o = extend_attention_mgpu(q, k_new, v_new, batch.k_pool, batch.v_pool, batch.meta, **kw)
    assert o.shape == q.shape[:2] + batch.v_pool.shape[2:] and o.dtype == jnp.bfloat16
    assert_output(o, ref_two_stage(batch, **kw), batch, jnp.bfloat16)
    np.testing.assert_array_equal(  # the default route takes these calls
        np.float32(extend_attention(q, k_new, v_new, batch.k_pool, batch.v_pool, batch.meta, **kw)), np.float32(o))
    if "sliding_window" not in kw:
        args = (batch.q, batch.k_pool_unified, batch.v_pool_unified, batch.meta_unified)
        o = extend_attention_unified_mgpu(*args, **kw)
        assert_output(o, ref_unified(batch, **kw), batch, jnp.bfloat16)
        np.testing.assert_array_equal(np.float32(extend_attention_unified(*args, **kw)), np.float32(o))


# DeepSeek's non-absorbed prefill: q/k head dim 192, v 128 (its own O buffer, 64-key tiles), both forms, features.
HEAD_DIMS_192 = [
    ("plain", dict()),
    ("window-cap-sinks", dict(sliding_window=37, logit_cap=3.0, sinks=True)),
    ("noncausal-xai", dict(causal=False, xai_temperature_len=20)),
]


@pytest.mark.parametrize("feature", HEAD_DIMS_192, ids=lambda f: f[0])
@pytest.mark.parametrize("whole_tiles", [False, True], ids=["tokens-odd", "tokens-x8"])
@pytest.mark.gpu
@needs_hopper
def test_head_dims_192_128_match_reference(rng, feature, whole_tiles):
    batch = make_batch(rng, [0, 37, 128, 300], [130, 5, 64, 257], hq=4, hkv=4, dqk=192, dv=128, dtype=jnp.bfloat16,
                       max_extend_len=266)
    kw = _more_kwargs(rng, 4, feature[1])
    _assert_both_forms_match_reference(batch, kw, whole_tiles)


# Gemma's head dim 256 (64-key tiles; a partial q tile stored in four 64-column chunks), both forms, its features.
HEAD_DIM_256 = [
    ("plain", dict()),
    ("window-cap", dict(sliding_window=100, logit_cap=50.0)),  # Gemma-2's local layers
    ("noncausal-sinks", dict(causal=False, sinks=True)),
]


@pytest.mark.parametrize("feature", HEAD_DIM_256, ids=lambda f: f[0])
@pytest.mark.parametrize("whole_tiles", [False, True], ids=["tokens-odd", "tokens-x8"])
@pytest.mark.gpu
@needs_hopper
def test_head_dim_256_matches_reference(rng, feature, whole_tiles):
    # Lengths give partial q tiles of 1-63 rows in both warpgroups (the chunked store) and whole ones (Q's buffer).
    batch = make_batch(rng, [0, 37, 128, 300], [130, 5, 64, 257], hq=8, hkv=4, dqk=256, dtype=jnp.bfloat16,
                       max_extend_len=266)
    kw = _more_kwargs(rng, 8, feature[1])
    _assert_both_forms_match_reference(batch, kw, whole_tiles)


CUSTOM_MASKS = [
    ("tree", dict()),
    ("tree-prefix-columns", dict(skip_prefix_custom_mask=False)),
    ("tree-prefix-columns-cap-sinks-xai", dict(skip_prefix_custom_mask=False, logit_cap=3.0, sinks=True,
                                               xai_temperature_len=20)),
    # Verify on a sliding-window layer: full lists with the kernel's window, and lists cut for it ("cut").
    ("tree-window", dict(sliding_window=40)),
    ("tree-prefix-columns-window-cut-cap", dict(skip_prefix_custom_mask=False, sliding_window=100, cut=True,
                                                logit_cap=3.0)),
]


@pytest.mark.parametrize("feature", CUSTOM_MASKS, ids=lambda f: f[0])
@pytest.mark.parametrize("whole_tiles", [False, True], ids=["tokens-odd", "tokens-x8"])
@pytest.mark.gpu
@needs_hopper
def test_custom_masks_match_reference(rng, feature, whole_tiles):
    # Speculative tree verify (SGLang's flat mask): the new-key tiles masked by gathered entries, prefix columns read
    # or skipped; a row whose mask hides every key gives 0.
    prefix_lens, extend_lens = [0, 37, 128, 300], [130, 5, 64, 257]
    kw = _more_kwargs(rng, 8, feature[1])
    cut = kw["sliding_window"] if kw.pop("cut", False) else -1
    batch = make_batch(rng, prefix_lens, extend_lens, hq=8, hkv=2, dqk=128, dtype=jnp.bfloat16, max_extend_len=266,
                       window=cut)
    blind = None if kw.get("skip_prefix_custom_mask", True) else (2, 10)
    kw["custom_mask"] = _tree_masks(rng, prefix_lens, extend_lens, blind_row=blind)
    q, k_new, v_new = _new_tokens(batch, whole_tiles)
    o = extend_attention_mgpu(q, k_new, v_new, batch.k_pool, batch.v_pool, batch.meta, **kw)
    assert_output(o, ref_two_stage(batch, **kw), batch, jnp.bfloat16)
    if blind is not None:
        np.testing.assert_array_equal(np.float32(o[130 + 5 + 10]), 0.0)
    np.testing.assert_array_equal(  # the default route takes these calls
        np.float32(extend_attention(q, k_new, v_new, batch.k_pool, batch.v_pool, batch.meta, **kw)), np.float32(o))


@pytest.mark.gpu
@needs_hopper
def test_custom_mask_dtypes_give_the_same_output(rng):
    # The kernel takes the mask's bytes as given (no conversion before the call): bool, u8 0/1 and i8 with arbitrary
    # nonzero values are one mask, bitwise one output, at the reference.
    prefix_lens, extend_lens = [0, 37, 300], [130, 5, 257]
    batch = make_batch(rng, prefix_lens, extend_lens, hq=8, hkv=2, dqk=128, dtype=jnp.bfloat16, max_extend_len=266)
    tree = np.asarray(_tree_masks(rng, prefix_lens, extend_lens))
    nonzero = rng.choice(np.array([-128, -3, 1, 7, 127], np.int8), tree.shape)
    q, k_new, v_new = _new_tokens(batch, False)
    outputs = [extend_attention_mgpu(q, k_new, v_new, batch.k_pool, batch.v_pool, batch.meta, custom_mask=mask)
               for mask in (jnp.asarray(tree), jnp.asarray(tree.astype(np.uint8)),
                            jnp.asarray(np.where(tree, nonzero, np.int8(0))))]
    assert_output(outputs[0], ref_two_stage(batch, custom_mask=jnp.asarray(tree)), batch, jnp.bfloat16)
    for o in outputs[1:]:
        np.testing.assert_array_equal(np.float32(o), np.float32(outputs[0]))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", ["plain", "window", "tree", "fp8"])
@pytest.mark.parametrize("whole_tiles", [False, True], ids=["tokens-odd", "tokens-x8"])
def test_prefix_fast_waits_change_no_bit(rng, case, whole_tiles, monkeypatch):
    # PREFIX_FAST_WAITS changes how a prefix tile's wait finds its phase, nothing else: the same bits without it, with
    # TMA new-key tiles (tokens a multiple of 8) and without, under a window, a tree mask and f16 fp8 tiles.
    from jaxattn.kernels import extend_attention_mgpu as kernel_module

    prefix_lens, extend_lens = [0, 37, 700, 300], [130, 5, 64, 257]
    batch = make_batch(rng, prefix_lens, extend_lens, hq=8, hkv=2, dqk=128, dtype=jnp.bfloat16, max_extend_len=266)
    q, k_new, v_new = _new_tokens(batch, whole_tiles)
    k_pool, v_pool, impl, kw = batch.k_pool, batch.v_pool, "mgpu", {}
    if case == "window":
        kw = dict(sliding_window=200)
    elif case == "tree":
        kw = dict(custom_mask=_tree_masks(rng, prefix_lens, extend_lens))
    elif case == "fp8":
        k_pool, v_pool = k_pool.astype(jnp.float8_e4m3fn), v_pool.astype(jnp.float8_e4m3fn)
        impl, kw = "mgpu-fp8", dict(k_scale=0.37, v_scale=0.75)
    outputs = []
    for fast in (False, True):
        monkeypatch.setattr(kernel_module, "PREFIX_FAST_WAITS", fast)
        jax.clear_caches()  # the flag is read when the kernel is traced
        outputs.append(np.float32(extend_attention(q, k_new, v_new, k_pool, v_pool, batch.meta, impl=impl, **kw)))
    assert not np.isnan(outputs[0][: batch.tokens]).any()
    np.testing.assert_array_equal(outputs[1], outputs[0])


DRAFT_MASKS = [
    ("plain", dict()),
    ("window-cap-sinks", dict(sliding_window=40, logit_cap=3.0, sinks=True)),
    ("short-two-heads-per-cta", dict(short=True)),
]


@pytest.mark.parametrize("feature", DRAFT_MASKS, ids=lambda f: f[0])
@pytest.mark.parametrize("whole_tiles", [False, True], ids=["tokens-odd", "tokens-x8"])
@pytest.mark.gpu
@needs_hopper
def test_draft_masks_match_reference(rng, feature, whole_tiles):
    # A tree as per-row draft words (extend_attention_mgpu(draft_mask=), the default route's since this passed on the
    # H200): five words for up to 160 drafts, a row that sees only its prefix, stray bits past a sequence's drafts;
    # short extends run two heads per CTA.
    kw = _more_kwargs(rng, 8, feature[1])
    short = kw.pop("short", False)
    prefix_lens, extend_lens = ([0, 37, 128, 300], [130, 5, 64, 157]) if not short else ([40, 0, 700, 9], [64, 5, 33, 64])
    batch = make_batch(rng, prefix_lens, extend_lens, hq=8, hkv=2, dqk=128, dtype=jnp.bfloat16,
                       max_extend_len=max(extend_lens) + (0 if short else 9))
    q, k_new, v_new = _new_tokens(batch, whole_tiles)
    bits, _ = draft_words(rng, extend_lens, 5, blind_row=(0, 3), stray_bits=True)
    kw["draft_mask"] = jnp.asarray(np.pad(bits, ((0, q.shape[0] - len(bits)), (0, 0)), constant_values=0xFFFFFFFF))
    o = extend_attention_mgpu(q, k_new, v_new, batch.k_pool, batch.v_pool, batch.meta, **kw)
    want = ref_two_stage(batch, **dict(kw, draft_mask=kw["draft_mask"][: batch.q.shape[0]]))
    assert_output(o, want, batch, jnp.bfloat16)
    triton = extend_attention(q, k_new, v_new, batch.k_pool, batch.v_pool, batch.meta, impl="triton", **kw)
    assert_output(o, triton, batch, jnp.bfloat16)


@pytest.mark.gpu
@needs_hopper
def test_custom_mask_verify_step_matches_triton_kernel(rng):
    # A verify step's shape: long prefixes, 64 drafts per sequence under a random tree (one 128-key tile or two
    # 64-key tiles of drafts per CTA), beside the Triton kernel with the same mask.
    prefix_lens, extend_lens = [1500, 700, 2048, 3], [64, 64, 64, 64]
    batch = make_batch(rng, prefix_lens, extend_lens, hq=8, hkv=2, dqk=128, dtype=jnp.bfloat16, scale=0.5)
    mask = _tree_masks(rng, prefix_lens, extend_lens)
    for config in (None, MgpuExtendConfig(block_kv=64, stages=3)):
        o = extend_attention_mgpu(batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta,
                                  custom_mask=mask, config=config)
        o_triton = extend_attention(batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta,
                                    custom_mask=mask, impl="triton")
        assert_output(o, o_triton, batch, jnp.bfloat16)
        assert_output(o, ref_two_stage(batch, custom_mask=mask), batch, jnp.bfloat16)


SHORT_EXTENDS = [
    ("plain", dict()),
    ("window-cap-sinks", dict(sliding_window=20, logit_cap=3.0, sinks=True)),
    ("noncausal-xai", dict(causal=False, xai_temperature_len=20)),
    ("tree-mask", dict(mask=True)),
    ("tree-mask-window-sinks", dict(mask=True, sliding_window=20, sinks=True)),
]


@pytest.mark.parametrize("feature", SHORT_EXTENDS, ids=lambda f: f[0])
@pytest.mark.parametrize("whole_tiles", [False, True], ids=["tokens-odd", "tokens-x8"])
@pytest.mark.gpu
@needs_hopper
def test_two_heads_per_cta_match_reference(rng, feature, whole_tiles):
    # Short extends (max_extend_len <= 64, group 4): each CTA runs two q heads of one kv head on the same rows, both
    # forms; lengths 1-64 starting off the 8-row grid, empty ones, rows past max_extend_len absent.
    prefix_lens, extend_lens = [0, 37, 128, 300, 5, 9], [1, 5, 64, 17, 0, 63]
    batch = make_batch(rng, prefix_lens, extend_lens, hq=8, hkv=2, dqk=128, dtype=jnp.bfloat16, max_extend_len=64)
    assert heads_per_cta(batch.meta.max_extend_len, 4, MgpuExtendConfig()) == 2
    kw = _more_kwargs(rng, 8, feature[1])
    if kw.pop("mask", False):
        kw["custom_mask"] = _tree_masks(rng, prefix_lens, extend_lens)
    q, k_new, v_new = _new_tokens(batch, whole_tiles)
    o = extend_attention_mgpu(q, k_new, v_new, batch.k_pool, batch.v_pool, batch.meta, **kw)
    assert_output(o, ref_two_stage(batch, **kw), batch, jnp.bfloat16)
    if "sliding_window" not in kw and "custom_mask" not in kw:
        args = (batch.q, batch.k_pool_unified, batch.v_pool_unified, batch.meta_unified)
        assert_output(extend_attention_unified_mgpu(*args, **kw), ref_unified(batch, **kw), batch, jnp.bfloat16)


THREE_CONSUMER_FEATURES = [
    ("plain", dict()),
    ("window-cap-sinks", dict(sliding_window=100, logit_cap=3.0, sinks=True)),
    ("noncausal-xai", dict(causal=False, xai_temperature_len=20)),
    ("tree-mask", dict(mask=True)),
]


@pytest.mark.parametrize("feature", THREE_CONSUMER_FEATURES, ids=lambda f: f[0])
@pytest.mark.parametrize("whole_tiles", [False, True], ids=["tokens-odd", "tokens-x8"])
@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap"])
@pytest.mark.gpu
@needs_hopper
def test_three_consumers_match_reference_and_two(rng, feature, whole_tiles, overlap):
    # MgpuExtendConfig(consumers=3) at 64-dim heads (192-row CTAs, no schedule barrier), with and without the
    # intra-warpgroup overlap: the reference's output, and the two-consumer kernel's bits (each warpgroup's 64 rows run
    # the same tiles in the same order, with the same arithmetic, either way), in both forms; lengths that end mid-CTA
    # and start off the 8-row grid, prefixes ending mid-tile, a long extend.
    prefix_lens, extend_lens = [0, 37, 1000, 300, 5], [130, 5, 700, 257, 191]
    batch = make_batch(rng, prefix_lens, extend_lens, hq=8, hkv=2, dqk=64, dtype=jnp.bfloat16)
    kw = _more_kwargs(rng, 8, feature[1])
    if kw.pop("mask", False):
        kw["custom_mask"] = _tree_masks(rng, prefix_lens, extend_lens)
    q, k_new, v_new = _new_tokens(batch, whole_tiles)
    three, two = MgpuExtendConfig(consumers=3, overlap=overlap), MgpuExtendConfig(consumers=2)
    o = extend_attention_mgpu(q, k_new, v_new, batch.k_pool, batch.v_pool, batch.meta, config=three, **kw)
    assert_output(o, ref_two_stage(batch, **kw), batch, jnp.bfloat16)
    o2 = extend_attention_mgpu(q, k_new, v_new, batch.k_pool, batch.v_pool, batch.meta, config=two, **kw)
    np.testing.assert_array_equal(np.asarray(o[: batch.tokens]), np.asarray(o2[: batch.tokens]))
    if "sliding_window" not in kw and "custom_mask" not in kw:
        args = (batch.q, batch.k_pool_unified, batch.v_pool_unified, batch.meta_unified)
        o = extend_attention_unified_mgpu(*args, config=three, **kw)
        assert_output(o, ref_unified(batch, **kw), batch, jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(o), np.asarray(extend_attention_unified_mgpu(*args, config=two, **kw)))


def test_three_consumers_take_64_dim_heads_only():
    # The config takes 2 or 3; 3 never packs two heads per CTA (each warpgroup would need its own head) and its
    # 192-row CTA's buffers fit sm_90 at 64/64.
    from jaxattn import hardware
    with pytest.raises(ValueError, match="consumers must be 2 or 3"):
        MgpuExtendConfig(consumers=4)
    with pytest.raises(ValueError, match="True with consumers=3 only"):  # two consumers keep their schedule barrier
        MgpuExtendConfig(overlap=True)
    with pytest.raises(ValueError, match="overlap must be a bool"):
        MgpuExtendConfig(consumers=3, overlap=1)
    assert MgpuExtendConfig(consumers=3, overlap=True).shared_memory_bytes(64) == \
        MgpuExtendConfig(consumers=3).shared_memory_bytes(64)  # S of the next tile lives in registers
    three = MgpuExtendConfig(consumers=3)
    assert heads_per_cta(64, 4, three) == 1 and heads_per_cta(64, 4, MgpuExtendConfig()) == 2
    assert three.shared_memory_bytes(64) == MgpuExtendConfig().shared_memory_bytes(64) + 64 * 128 * 2
    assert three.shared_memory_bytes(64) <= hardware.SM90.shared_memory_bytes


def test_short_windows_over_short_extends_take_64_key_tiles():
    # tuning.sm90.EXTEND_MGPU_SHORT_WINDOW: a verify step on a window of <= 128 keys (V-TREE64-W128) takes 64-key
    # tiles; a longer window, a longer extend, no window, or a family without a measured entry keep the table's.
    from jaxattn import hardware, tuning
    pick = lambda qk, **kw: tuning.mgpu_extend_config(qk, family=hardware.SM90.name, **kw)  # noqa: E731
    assert pick(128).block_kv == 128
    assert pick(128, sliding_window=128, max_extend_len=64) == MgpuExtendConfig(block_kv=64, stages=2)
    assert pick(128, sliding_window=0, max_extend_len=1).block_kv == 64
    for kw in (dict(sliding_window=129, max_extend_len=64), dict(sliding_window=128, max_extend_len=65),
               dict(sliding_window=-1, max_extend_len=64), dict(sliding_window=128)):
        assert pick(128, **kw) == pick(128), kw
    assert pick(64, sliding_window=128, max_extend_len=65) == pick(64)


def test_head_dim_64_takes_three_consumers_except_over_short_extends():
    # tuning.sm90.EXTEND_MGPU["64"]: three consumer warpgroups (FA3's 64-dim tile); an extend of at most block_q new
    # tokens keeps two, which pack two heads per CTA (a verify step), at every window.
    from jaxattn import hardware, tuning
    from jaxattn.impl.mgpu_extend import heads_per_cta
    pick = lambda **kw: tuning.mgpu_extend_config(64, family=hardware.SM90.name, **kw)  # noqa: E731
    assert pick().consumers == 3 and pick(max_extend_len=65).consumers == 3
    for kw in (dict(max_extend_len=64), dict(max_extend_len=1), dict(max_extend_len=64, sliding_window=128)):
        assert pick(**kw) == dataclasses.replace(pick(), consumers=2), kw
        assert heads_per_cta(kw["max_extend_len"], 4, pick(**kw)) == 2
    assert tuning.mgpu_extend_config(128, family=hardware.SM90.name, max_extend_len=64).consumers == 2


def test_head_dim_256_tiles_fit_shared_memory():
    # The rule the kernel's buffers follow (MgpuExtendConfig.o_rows_columns): at 256/256 only partial tiles use the O
    # buffer, 64 columns wide; the table's tile then fits sm_90's 227 KB, a 128-key tile does not.
    from jaxattn import hardware, tuning
    config = tuning.mgpu_extend_config(256)
    assert MgpuExtendConfig.o_rows_columns(256) == 64 and MgpuExtendConfig.o_rows_columns(192, 128) == 128
    assert MgpuExtendConfig.o_rows_columns(128) == 128 and MgpuExtendConfig.o_rows_columns(64) == 64
    assert config.shared_memory_bytes(256) <= hardware.SM90.shared_memory_bytes
    assert MgpuExtendConfig(block_kv=128).shared_memory_bytes(256) > hardware.SM90.shared_memory_bytes
    assert MgpuExtendConfig(stages=3, block_kv=64).shared_memory_bytes(256) > hardware.SM90.shared_memory_bytes


def test_fp8_staging_tiles_fit_beside_128_key_tiles_without_the_reduction_scratch():
    # MgpuExtendConfig.fp8_staging (the default): two fp8 staging tiles (block_kv x head_dim bytes each) and no Pallas
    # reduction scratch (the kernel lowers with reduction_scratch_bytes 0: `STAGED_REDUCTION_SCRATCH`). At 128 dims
    # and 128-key tiles that fits sm_90 (lowered: 230,488 B) where the reserve would not (232,536); the tuned tiles at
    # 64 dims (three consumers) too; at 256 the tuned tile has no room for them, so its calls copy into the slots. A
    # 16-bit pool's budget is the plain one whatever the flag.
    from jaxattn import hardware, tuning
    from jaxattn.impl.mgpu_extend import fp8_staging_fits
    from jaxattn.kernels.extend_attention_mgpu import STAGED_REDUCTION_SCRATCH
    from jaxattn.tuning.configs import PALLAS_REDUCTION_SCRATCH_BYTES
    config = MgpuExtendConfig()
    assert config.fp8_staging and STAGED_REDUCTION_SCRATCH == 0
    assert config.staged_shared_memory_bytes(128) == \
        config.shared_memory_bytes(128) + 2 * 128 * 128 - PALLAS_REDUCTION_SCRATCH_BYTES
    assert 230_488 <= config.staged_shared_memory_bytes(128) <= hardware.SM90.shared_memory_bytes
    assert config.staged_shared_memory_bytes(128) + PALLAS_REDUCTION_SCRATCH_BYTES > hardware.SM90.shared_memory_bytes
    assert fp8_staging_fits(config, 128) and fp8_staging_fits(tuning.mgpu_extend_config(64), 64)
    assert not fp8_staging_fits(dataclasses.replace(config, fp8_staging=False), 128)
    assert not fp8_staging_fits(tuning.mgpu_extend_config(256), 256)
    assert config.shared_memory_bytes(128) == dataclasses.replace(config, fp8_staging=False).shared_memory_bytes(128)
    with pytest.raises(ValueError, match="fp8_staging must be a bool"):
        MgpuExtendConfig(fp8_staging=1)
    with pytest.raises(ValueError, match="fp8_refill must be a bool, True with fp8_staging only"):
        MgpuExtendConfig(fp8_staging=False, fp8_refill=True)
    with pytest.raises(ValueError, match="fp8_refill must be a bool"):
        MgpuExtendConfig(fp8_refill=1)
    assert not config.fp8_refill  # opt-in until its GPU tests all run


@pytest.mark.gpu
@needs_hopper
def test_nan_outside_the_batch_does_not_leak(rng):
    # Unowned pool slots are NaN already (make_batch); padding tokens' K/V too here: a tile that runs past the last
    # sequence reads them, masked, and 0 * NaN must not reach a valid row.
    batch = make_batch(rng, [5, 70], [33, 19], hq=4, hkv=2, dqk=128, dtype=jnp.bfloat16)
    k_new = batch.k_new.at[batch.tokens :].set(jnp.nan)
    v_new = batch.v_new.at[batch.tokens :].set(jnp.nan)
    o = extend_attention_mgpu(batch.q, k_new, v_new, batch.k_pool, batch.v_pool, batch.meta)
    assert_output(o, ref_two_stage(batch), batch, jnp.bfloat16)


@pytest.mark.gpu
@needs_hopper
def test_out_of_range_slots_read_inside_the_pool(rng):
    # Slots past the pool (or negative) read the padding slot 0, as the Triton kernels and the reference do: the call
    # neither faults nor disturbs the other sequences, and the damaged sequence gets the reference's output.
    batch = make_batch(rng, [40, 150], [20, 30], hq=4, hkv=2, dqk=128, dtype=jnp.bfloat16)
    slots = batch.k_pool.shape[0]
    k_pool, v_pool = jnp.nan_to_num(batch.k_pool), jnp.nan_to_num(batch.v_pool)  # slot 0 finite
    kv_indices = batch.meta.kv_indices.at[3].set(slots + 1000).at[7].set(-5).at[39].set(2**31 - 1)  # sequence 0's
    bad = dataclasses.replace(batch.meta, kv_indices=kv_indices)
    o = np.float32(extend_attention_mgpu(batch.q, batch.k_new, batch.v_new, k_pool, v_pool, bad))
    ref = np.float32(ref_two_stage(batch))
    np.testing.assert_allclose(o[20:50], ref[20:50], **tolerance(jnp.bfloat16))
    damaged = np.float32(ref_two_stage(dataclasses.replace(batch, meta=bad, k_pool=k_pool, v_pool=v_pool)))
    np.testing.assert_allclose(o[:20], damaged[:20], **tolerance(jnp.bfloat16))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("skip_prefix", [True, False], ids=["draft-columns", "prefix-columns"])
def test_short_custom_mask_reads_inside_it(rng, skip_prefix):
    # A mask cut short (the last sequence's rows run past its end) and one sequence's rows placed past it
    # (mask_indptr[1] + 10**6): the kernel gathers only entries inside the buffer (compute-sanitizer checks the
    # reads), entries past the end count as hidden, so the result is the reference's on the zero-padded mask.
    prefix_lens, extend_lens = [40, 150, 7], [20, 30, 64]
    batch = make_batch(rng, prefix_lens, extend_lens, hq=4, hkv=2, dqk=128, dtype=jnp.bfloat16)
    mask = np.asarray(_tree_masks(rng, prefix_lens, extend_lens))
    cut = len(mask) - 64 * 30  # the last sequence keeps its first 34 rows
    mask_indptr = np.asarray(batch.meta.mask_indptr).astype(np.int64)
    mask_indptr[1] += 10**6
    meta = dataclasses.replace(batch.meta, mask_indptr=jnp.asarray(mask_indptr, jnp.int32))
    padded = np.zeros(int(mask_indptr[1]) + len(mask) + 1, bool)
    padded[:cut] = mask[:cut]
    kw = dict(skip_prefix_custom_mask=skip_prefix)
    o = extend_attention_mgpu(batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, meta,
                              custom_mask=jnp.asarray(mask[:cut]), **kw)
    ref = ref_two_stage(dataclasses.replace(batch, meta=meta), custom_mask=jnp.asarray(padded), **kw)
    assert_output(o, ref, batch, jnp.bfloat16)
    if not skip_prefix:  # sequence 1's rows see nothing: 0
        np.testing.assert_array_equal(np.float32(o[20:50]), 0.0)


@pytest.mark.gpu
@needs_hopper
def test_matches_triton_kernel_on_a_larger_batch(rng):
    # 1-2k tokens per sequence, GQA 4:1: several CTAs per sequence, long prefix loops, the schedule barrier's steady state.
    batch = make_batch(rng, [1500, 0, 700, 2048], [1024, 2000, 777, 300], hq=8, hkv=2, dqk=128, dtype=jnp.bfloat16, scale=0.5)
    o = extend_attention_mgpu(batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta)
    o_triton = extend_attention(batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta)
    assert_output(o, o_triton, batch, jnp.bfloat16)
    assert_output(o, ref_two_stage(batch), batch, jnp.bfloat16)


@pytest.mark.gpu
@needs_hopper
def test_rows_past_max_extend_len_are_zero(rng):
    # A sequence longer than the static bucket: its first max_extend_len rows are computed, the rest stay 0
    # (as in the Triton kernels), and no neighbouring sequence is disturbed.
    batch = make_batch(rng, [11, 3], [200, 40], hq=4, hkv=2, dqk=128, dtype=jnp.bfloat16, max_extend_len=200)
    short = dataclasses.replace(batch.meta, max_extend_len=130)
    o = np.float32(extend_attention_mgpu(batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, short))
    ref = np.float32(ref_two_stage(batch))
    np.testing.assert_allclose(o[:130], ref[:130], **tolerance(jnp.bfloat16))
    np.testing.assert_array_equal(o[130:200], 0.0)
    np.testing.assert_allclose(o[200:240], ref[200:240], **tolerance(jnp.bfloat16))
    np.testing.assert_array_equal(o[240:], 0.0)


def _written_rows(qo, rows, max_extend_len, kernel):
    """bool[rows]: the rows an extend kernel writes for qo_indptr `qo` (numpy): the GQA kernel from the raw starts,
    the MLA kernel from starts clamped into the rows (kernels/mla_attention_mgpu.py extend_cta)."""
    written = np.zeros(rows, bool)
    for b in range(len(qo) - 1):
        if kernel == "gqa":
            lo, hi = qo[b], min(qo[b + 1], qo[b] + max_extend_len)
        else:
            lo = min(max(qo[b], 0), rows)
            hi = lo + min(max(min(qo[b + 1], rows) - lo, 0), max_extend_len)
        written[max(lo, 0):max(min(hi, rows), 0)] = True
    return written


def test_zero_spans_complement_the_written_rows(rng):
    # The extend output buffer (kernels/zero_rows_mgpu.py) clears only the rows no CTA writes: every row is written or
    # cleared, for monotone qo_indptr (padding rows, sequences past the bucket, a batch not starting at row 0) and for
    # hostile ones (negative, decreasing, past the rows); monotone in-range ones clear no written row; spans stay
    # inside the buffer.
    from jaxattn.kernels.zero_rows_mgpu import zero_span

    for trial in range(60):
        batch, rows, max_extend_len = int(rng.integers(0, 6)), int(rng.integers(1, 90)), int(rng.integers(1, 40))
        monotone = trial % 2 == 0
        if monotone:
            start = 0 if trial % 4 == 0 else int(rng.integers(0, 10))
            qo = np.concatenate([[start], start + np.cumsum(rng.integers(0, 25, batch))]).astype(np.int32)
        else:
            qo = rng.integers(-40, 120, batch + 1).astype(np.int32)
        qo_array = jnp.asarray(qo)
        lo, hi = jax.vmap(lambda s: zero_span(s, lambda i: qo_array[i], batch=batch, rows=rows,
                                              max_extend_len=max_extend_len))(jnp.arange(batch + 2, dtype=jnp.int32))
        lo, hi = np.asarray(lo), np.asarray(hi)
        assert np.all((0 <= lo) & (lo <= hi) & (hi <= rows)), (qo, rows, lo, hi)
        cleared = np.zeros(rows, bool)
        for a, b in zip(lo, hi):
            cleared[a:b] = True
        for kernel in ("gqa", "mla"):
            written = _written_rows(qo, rows, max_extend_len, kernel)
            assert np.all(cleared | written), (kernel, qo.tolist(), rows, max_extend_len, np.flatnonzero(~(cleared | written)))
            if monotone and qo[-1] <= rows:
                assert not np.any(cleared & written), (kernel, qo.tolist(), rows, max_extend_len)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("qo, rows, row_shape, max_extend_len", [
    ([0, 5, 9, 30], 40, (4, 64), 16),  # padding rows and a sequence past the bucket
    ([3, 3, 70], 64, (2, 128), 50),  # a batch not starting at row 0; qo_indptr[-1] past the rows
    ([0, 100, 20, 400], 300, (8, 128), 128),  # hostile: decreasing, past the rows
    ([0, 100], 20000, (32, 128), 4096),  # mostly padding: the padding span's many CTAs
    ([0, 0], 7, (1, 8), 8),  # one 16-byte word per row, nothing written
])
def test_unwritten_rows_zeroed_on_dirty_memory(qo, rows, row_shape, max_extend_len):
    # The extend output buffer's cleared rows are exactly 0 although the memory it reuses held NaN.
    from jaxattn.kernels.zero_rows_mgpu import unwritten_rows_zeroed, zero_span

    dirty = jnp.full((rows, *row_shape), jnp.nan, jnp.bfloat16).block_until_ready()
    del dirty  # its block goes back to the allocator, which hands it to the next buffer of this size
    qo = jnp.asarray(qo, jnp.int32)
    run = jax.jit(lambda qo: unwritten_rows_zeroed(qo, rows=rows, row_shape=row_shape, dtype=jnp.bfloat16,
                                                   max_extend_len=max_extend_len))
    out = np.asarray(run(qo), np.float32)
    batch = qo.shape[0] - 1
    cleared = np.zeros(rows, bool)
    for span in range(batch + 2):
        lo, hi = zero_span(jnp.int32(span), lambda i: qo[i], batch=batch, rows=rows, max_extend_len=max_extend_len)
        cleared[int(lo):int(hi)] = True
    assert cleared.any()
    np.testing.assert_array_equal(out[cleared], 0.0)


@pytest.mark.gpu
@needs_hopper
def test_the_output_buffer_is_neither_zeroed_whole_nor_copied(rng, monkeypatch):
    # The compiled step has no whole-output broadcast (the memset) and no copy of the output: the kernel fills the
    # buffer the clearing kernel made, in place. Control: with the whole output zeroed the same check finds it.
    import re

    import jaxattn.kernels.zero_rows_mgpu as zero_rows

    batch = make_batch(rng, [50, 7], [100, 57], hq=4, hkv=2, dqk=128, dtype=jnp.bfloat16)  # 157 + 3 rows: x8
    operands = (batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta)
    out_shape = re.escape(f"bf16[{batch.q.shape[0]},4,128]")
    whole_output = re.compile(rf"{out_shape}\S* (broadcast|copy)\(")

    # A new function each time: JAX caches traces by function (the control's first GPU run reused the first trace).
    def compiled_text():
        return jax.jit(lambda *a: extend_attention_mgpu.__wrapped__(*a)).lower(*operands).compile().as_text()

    assert not whole_output.search(compiled_text())
    monkeypatch.setattr(zero_rows, "unwritten_rows_zeroed",
                        lambda qo, *, rows, row_shape, dtype, max_extend_len: jnp.zeros((rows, *row_shape), dtype))
    assert whole_output.search(compiled_text())


def test_forced_kernel_options_reach_traces_of_a_function_traced_before(rng, monkeypatch):
    # JAX caches traces by function: without clearing, a variant traced under kernel_options_forced after the default
    # got the default's trace back (every forced variant of the options experiments timed the default kernel), and a
    # trace after it would keep the forced option.
    import jaxattn.kernels.extend_attention_mgpu as kernel_module
    from jaxattn.impl.mgpu_extend import kernel_options_forced

    seen = []
    monkeypatch.setattr(kernel_module, "extend_attention_mgpu_kernel", lambda *args, **kwargs: seen.append(kwargs))
    batch = make_batch(rng, [50, 7], [100, 57], hq=4, hkv=2, dqk=128, dtype=jnp.bfloat16)
    operands = (batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta)

    def trace():
        jax.jit(extend_attention_mgpu.__wrapped__).trace(*operands)

    trace()
    with kernel_options_forced(lambda kwargs: dict(kwargs, heads_per_cta=7)):
        trace()
    trace()
    assert [kwargs["heads_per_cta"] for kwargs in seen] == [seen[0]["heads_per_cta"], 7, seen[0]["heads_per_cta"]]
    assert seen[0]["heads_per_cta"] != 7


def test_unified_tiles_do_not_depend_on_the_bucket(rng, monkeypatch):
    # The short-window tile (64 keys) is chosen by the extend length; the unified form is the deterministic one, so
    # its block_kv (and its bits) must not change with the bucket a batch lands in: it ignores its window for the
    # choice. The two-stage form keeps the short-window tile for short extends.
    import jaxattn.kernels.extend_attention_mgpu as kernel_module
    from jaxattn.calls import ExtendCall
    from jaxattn.impl import mgpu_extend

    seen = []
    monkeypatch.setattr(kernel_module, "extend_attention_mgpu_kernel", lambda *args, **kwargs: seen.append(kwargs))
    for form, implementation in (("unified", mgpu_extend.UNIFIED), ("two_stage", mgpu_extend.IMPLEMENTATION)):
        for bucket in (32, 256):
            batch = make_batch(rng, [300, 90], [20, 31], hq=8, hkv=2, dqk=128, dtype=jnp.bfloat16, max_extend_len=bucket)
            unified = form == "unified"
            call = ExtendCall(form=form, q=batch.q, k_new=None if unified else batch.k_new,
                              v_new=None if unified else batch.v_new,
                              k_pool=batch.k_pool_unified if unified else batch.k_pool,
                              v_pool=batch.v_pool_unified if unified else batch.v_pool,
                              meta=batch.meta_unified if unified else batch.meta, kv_start_pos=batch.meta.kv_start_pos,
                              causal=True, custom_mask=None, skip_prefix_custom_mask=not unified, sliding_window=100,
                              logit_cap=0.0, sinks=None, xai_temperature_len=-1, sm_scale=0.1, config=None,
                              launch_mode="gpu")
            jax.eval_shape(lambda: implementation.run(call))
    block_kv = [kwargs["block_kv"] for kwargs in seen]
    assert block_kv[0] == block_kv[1] == 128  # unified: the table's tile at either bucket
    assert block_kv[2:] == [64, 128]  # two-stage: the short-window tile for the short bucket


def test_register_splits_fit_one_cta(rng, monkeypatch):
    # setmaxnreg moves registers within what the launch gave the CTA: every split the kernels set fits; 216 / 80 beside
    # two consumers hung on an H100 (thirty-fifth session) and is refused at trace time, naming the table.
    import jaxattn.kernels.extend_attention_mgpu as kernel_module
    from jaxattn.calls import ExtendCall
    from jaxattn.impl import mgpu_extend

    fits = kernel_module.register_split_fits
    for consumers, (consumer, producer) in kernel_module.REGISTERS.items():
        assert fits((consumer,) * consumers + (producer,))
    assert fits((224, 224, 56)) and fits((216, 216, 72))  # the launch's 168 x 384 exactly
    assert not fits((216, 216, 80)) and not fits((224, 224, 64)) and not fits((232, 232, 44))
    batch = make_batch(rng, [300, 90], [20, 31], hq=8, hkv=2, dqk=128, dtype=jnp.bfloat16, max_extend_len=32)
    call = ExtendCall(form="two_stage", q=batch.q, k_new=batch.k_new, v_new=batch.v_new, k_pool=batch.k_pool,
                      v_pool=batch.v_pool, meta=batch.meta, kv_start_pos=batch.meta.kv_start_pos, causal=True,
                      custom_mask=None, skip_prefix_custom_mask=True, sliding_window=-1, logit_cap=0.0, sinks=None,
                      xai_temperature_len=-1, sm_scale=0.1, config=None, launch_mode="gpu")
    monkeypatch.setitem(kernel_module.REGISTERS, 2, (216, 80))
    with pytest.raises(ValueError, match=r"REGISTERS\[2\] = \(216, 80\) does not fit"):
        jax.eval_shape(lambda: mgpu_extend.IMPLEMENTATION.run(call))


def test_cp_async_phase_counts():
    # The kernel's own phase arithmetic (runs on CPU): against counting the cp.async steps one by one, for prefix
    # lengths, TMA ranges (empty included) and any number of tail tiles.
    from jaxattn.kernels.extend_attention_mgpu import cp_async_uses

    for stages in (2, 3, 4):
        for pre_steps in range(6):
            for tma_tiles in range(4):
                tail_step = pre_steps + tma_tiles
                steps = [m for m in range(14) if m < pre_steps or m >= tail_step]  # the cp.async ones
                got = cp_async_uses(jnp.asarray(steps, jnp.int32), jnp.asarray(steps, jnp.int32) % stages,
                                    pre_steps=jnp.int32(pre_steps), tail_step=jnp.int32(tail_step), stages=stages)
                want = [sum(1 for m in steps if m < step and m % stages == step % stages) for step in steps]
                np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{stages=} {pre_steps=} {tma_tiles=}")


def test_cp_async_phase_counts_with_pages():
    # Whole pages: prefix steps [0, page_steps) come by TMA; the cp.async ones are [page_steps, pre_steps) and the tail.
    from jaxattn.kernels.extend_attention_mgpu import cp_async_uses

    for stages in (2, 3):
        for pre_steps in range(6):
            for page_steps in range(pre_steps + 1):
                for tma_tiles in range(3):
                    tail_step = pre_steps + tma_tiles
                    steps = [m for m in range(12) if page_steps <= m < pre_steps or m >= tail_step]
                    got = cp_async_uses(jnp.asarray(steps, jnp.int32), jnp.asarray(steps, jnp.int32) % stages,
                                        pre_steps=jnp.int32(pre_steps), tail_step=jnp.int32(tail_step), stages=stages,
                                        page_steps=jnp.int32(page_steps))
                    want = [sum(1 for m in steps if m < step and m % stages == step % stages) for step in steps]
                    np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{stages=} {pre_steps=} {page_steps=}")


def test_page_copy_rule():
    # Whole pages are copied page by page where a copy is at least EXTEND_MGPU_PAGE_COPY_MIN_ROWS tall, a page larger
    # than the tile a tile's rows at a time; lists without the promise, pools of partial pages and small pages go row
    # by row.
    from jaxattn.impl.mgpu_extend import page_copy_rows
    from jaxattn.tuning.sm90 import EXTEND_MGPU_PAGE_COPY_MIN_ROWS as least

    assert least == 64
    assert [page_copy_rows(p, 128, 4096) for p in (1, 8, 16, 32, 64, 128)] == [0, 0, 0, 0, 64, 128]
    assert [page_copy_rows(p, 64, 4096) for p in (16, 32, 64, 128)] == [0, 0, 64, 64]
    assert page_copy_rows(64, 128, 4096 + 8) == 0  # the pool's last page is partial


def test_cp_async_phase_counts_from_a_first_step():
    # Under a window the CTA loads steps [first_step, ...) only: the mbarriers' first phase is first_step's tile.
    from jaxattn.kernels.extend_attention_mgpu import cp_async_uses

    for stages in (2, 3, 4):
        for pre_steps in range(5):
            for tma_tiles in range(3):
                tail_step = pre_steps + tma_tiles
                pairs = [(first, m) for first in range(9) for m in range(first, 14) if m < pre_steps or m >= tail_step]
                firsts, steps = (np.asarray(x, np.int32) for x in zip(*pairs))  # every first step at once
                got = cp_async_uses(jnp.asarray(steps), jnp.asarray(steps % stages), pre_steps=jnp.int32(pre_steps),
                                    tail_step=jnp.int32(tail_step), stages=stages, first_step=jnp.asarray(firsts))
                want = [sum(1 for f, m in pairs if f == first and m < step and m % stages == step % stages)
                        for first, step in pairs]
                np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{stages=} {pre_steps=} {tma_tiles=}")


def test_prefix_phase_counts_match_the_general_ones():
    # PREFIX_FAST_WAITS: a prefix step's phase from `prefix_cp_async_uses` (no TMA ranges) is `cp_async_uses`' for every
    # step < pre_steps, whatever the TMA range after the prefix, with and without a window's first step (<= the step).
    from jaxattn.kernels.extend_attention_mgpu import cp_async_uses, prefix_cp_async_uses

    for stages in (2, 3, 4):
        for pre_steps in range(1, 9):
            for tma_tiles in range(3):
                tail_step = pre_steps + tma_tiles
                pairs = [(first, m) for first in range(pre_steps) for m in range(first, pre_steps)]
                firsts, steps = (np.asarray(x, np.int32) for x in zip(*pairs))
                for windowed in (False, True):
                    first = jnp.asarray(firsts) if windowed else None
                    want = cp_async_uses(jnp.asarray(steps), jnp.asarray(steps % stages), pre_steps=jnp.int32(pre_steps),
                                         tail_step=jnp.int32(tail_step), stages=stages, first_step=first)
                    got = prefix_cp_async_uses(jnp.asarray(steps), jnp.asarray(steps % stages), stages=stages,
                                               first_step=first)
                    np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                                  err_msg=f"{stages=} {pre_steps=} {tma_tiles=} {windowed=}")


def _tile_keys(step, prefix_len, lead, block_kv):
    """Positions (from the first new token; prefix keys negative) of the in-sequence keys of a K/V step."""
    pre_steps = -(-prefix_len // block_kv)
    if step < pre_steps:
        return np.arange(step * block_kv, min((step + 1) * block_kv, prefix_len)) - prefix_len
    keys = (step - pre_steps) * block_kv + np.arange(block_kv) - lead
    return keys[keys >= 0]


def test_window_step_helpers_match_brute_force():
    from jaxattn.kernels.extend_attention_mgpu import window_first_step, window_full_step

    rows = np.arange(0, 400)
    for block_kv in (64, 128):
        for prefix_len in (0, 1, 63, 64, 65, 200, 300):
            pre_steps = -(-prefix_len // block_kv)
            steps = pre_steps + 400 // block_kv + 2
            for lead in (0, 3, 7):
                keys = [_tile_keys(s, prefix_len, lead, block_kv) for s in range(steps)]
                highest = np.array([k.max(initial=-10**6) for k in keys])
                lowest = np.array([k.min(initial=10**6) for k in keys])
                for window in (0, 1, 37, 64, 127, 128, 200, 1000):
                    args = (jnp.asarray(rows, jnp.int32), jnp.int32(prefix_len), jnp.int32(lead), jnp.int32(pre_steps))
                    first = np.asarray(window_first_step(*args, window=window, block_kv=block_kv))
                    full = np.asarray(window_full_step(*args, window=window, block_kv=block_kv))
                    ctx = f"{block_kv=} {prefix_len=} {lead=} {window=}"
                    edge = (rows - window)[:, None]
                    # first: the first step holding a key at or above t - W (every earlier key is invisible)
                    np.testing.assert_array_equal(first, np.argmax(highest >= edge, axis=1), err_msg=ctx)
                    # full: no key below t - W from here on; at most one step later than needed (lead keys)
                    need = np.argmax(lowest >= edge, axis=1)
                    assert ((need <= full) & (full <= need + (lead > 0))).all(), ctx
                    assert not ((np.arange(steps) >= full[:, None]) & (lowest < edge)).any(), ctx


@pytest.mark.parametrize("block_kv", [64, 128])
def test_window_schedule_of_every_cta(block_kv):
    # The kernel's own step ranges for every CTA and warpgroup of ragged sequences (CPU): producer and consumers agree
    # on one first step; each warpgroup's range is contiguous inside the CTA's, so it consumes or releases every
    # loaded tile once and in order (a tile waited out of order, or never released, hangs the GPU); every key a
    # valid row sees is computed, and tiles past win_full need no window mask.
    from jaxattn.kernels.extend_attention_mgpu import cta_window_first_step, warpgroup_window_steps

    block_q, cta_rows = 64, 128
    cdiv = lambda x, d: -(-x // d)  # noqa: E731
    for q_start in (0, 5, 13):
        base = q_start // 8 * 8
        lead = q_start - base
        for prefix_len in (0, 9, 300, 1000):
            pre_steps = cdiv(prefix_len, block_kv)
            for q_len in (1, 64, 65, 257, 700):
                q_end = q_start + q_len
                tiles = np.arange(cdiv(q_len + 7, cta_rows))
                cta_row = base + tiles * cta_rows
                tiles, cta_row = tiles[cta_row < q_end], cta_row[cta_row < q_end]
                cta_steps = pre_steps + cdiv(np.minimum(cta_row + cta_rows, q_end) - base, block_kv)
                for window in (0, 5, 64, 100, 255, 5000):
                    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
                    first = np.asarray(cta_window_first_step(
                        i32(cta_row), i32(q_start), i32(prefix_len), i32(lead), i32(pre_steps), i32(cta_steps),
                        window=window, block_kv=block_kv))
                    ranges = []
                    for wg in (0, 1):
                        wg_row = cta_row + wg * block_q
                        wg_steps = pre_steps + cdiv(np.minimum(wg_row + block_q, q_end) - base, block_kv)
                        wg_first, win_full = warpgroup_window_steps(
                            i32(wg_row), i32(q_start), i32(q_end), i32(prefix_len), i32(lead), i32(pre_steps),
                            i32(first), i32(wg_steps), window=window, block_q=block_q, block_kv=block_kv)
                        ranges.append((wg_row, wg_steps, np.asarray(wg_first), np.asarray(win_full)))
                    for c in range(len(tiles)):
                        ctx = f"{q_start=} {prefix_len=} {q_len=} {window=} cta={tiles[c]}"
                        assert 0 <= first[c] < cta_steps[c], ctx
                        assert ranges[0][2][c] == first[c], ctx  # warpgroup 0 holds the CTA's first row
                        for wg, (wg_row, wg_steps, wg_first, win_full) in enumerate(ranges):
                            assert first[c] <= wg_first[c] <= win_full[c] <= wg_steps[c] <= cta_steps[c], (ctx, wg)
                            t = np.arange(wg_row[c] - q_start, wg_row[c] - q_start + block_q)[:, None]
                            t = t[(t[:, 0] >= 0) & (t[:, 0] < q_len)]  # the warpgroup's valid rows
                            if t.size:
                                assert wg_first[c] < wg_steps[c], (ctx, wg)
                            for step in range(cta_steps[c] + 1):
                                keys = _tile_keys(step, prefix_len, lead, block_kv)[None, :]
                                if ((keys <= t) & (keys >= t - window)).any():  # a key some valid row sees
                                    assert wg_first[c] <= step < wg_steps[c], (ctx, wg, step)
                                if win_full[c] <= step < wg_steps[c]:  # no causal key below a row's window
                                    assert not ((keys <= t) & (keys < t - window)).any(), (ctx, wg, step)


def _cta_programs(first_step, cta_steps, wg_ranges, pre_steps, tail_step, uses, *, stages, tma_new_tiles,
                  page_steps=0, latent=False, overlap_runs=None, fp8=False):
    """The barrier operations of one CTA's producer and its consumer warpgroups, in the kernel's order. wg_ranges:
    (wg_first, wg_steps) per warpgroup (wg_first = first_step without a window; two consumers take the schedule
    barrier, three none); uses[step]: the kernel's
    cp_async_uses of that step; steps below page_steps come page by page by TMA (their own barriers). latent: the
    latent-cache mode (`latent_v_dim`): K tiles only, each slot released after P V. overlap_runs: per warpgroup, the
    (lo, hi) runs of its steps taken with the intra-warpgroup overlap (`overlapped_run`: tile t + 1's K waited and
    released before tile t's V). fp8: the fp8 pools' producer (`fp8_producer_loop`): a step's slots waited for and its
    copies issued stages - 1 steps before its conversion, whose arrivals complete a prefix tile's barriers (a "load"
    here: it completes at some later time); fp8="staged" (the same loop with fp8_staging): a prefix tile's copies go
    to the staging tiles (no barrier), its slots are waited for just before its conversion, and a step's new-key
    tile starts after the conversion of the step before."""
    kinds = (0,) if latent else (0, 1)
    by_tma = lambda step: tma_new_tiles and pre_steps <= step < tail_step  # noqa: E731

    def barrier(which, step):
        slot = step % stages
        return ("page" if step < page_steps else "ready" if by_tma(step) else "kv", which, slot)

    def ready(which, step):
        name = barrier(which, step)
        return ("wait", name, None if name[0] != "kv" else uses[step] % 2, step)

    def start(step):  # a step's slot waits and (but a prefix tile's, which its conversion completes) its loads
        ops = []
        for which in kinds if step < cta_steps else ():
            if step >= first_step + stages:
                ops.append(("wait", ("free", which, step % stages), None, step - stages))
            if not (fp8 and step < pre_steps):
                ops.append(("load", barrier(which, step), step))
        return ops

    def staged_start(step):  # fp8_staged_start: a prefix tile's copies touch no barrier
        return [] if step < pre_steps else start(step)

    producer = []
    if fp8 == "staged":
        producer += staged_start(first_step)
    elif fp8:
        for ahead in range(stages - 1):
            producer += start(first_step + ahead)
    for step in range(first_step, cta_steps):
        if not fp8:
            producer += start(step)
            continue
        if step < pre_steps:  # convert_fp8_tiles: K's and V's together
            if fp8 == "staged":  # the slots waited for just before the conversion
                producer += [("wait", ("free", which, step % stages), None, step - stages) for which in kinds
                             if step >= first_step + stages]
            producer += [("load", barrier(which, step), step) for which in kinds]
        producer += staged_start(step + 1) if fp8 == "staged" else start(step + stages - 1)
    scheduled = len(wg_ranges) == 2
    sync = [("arrive", "schedule", None), ("wait", "schedule", None, None)] if scheduled else []
    programs = {"producer": producer}
    for wg, (wg_first, wg_steps) in enumerate(wg_ranges):
        ops = sync[:] if wg == 1 else []
        for step in range(first_step, wg_first):  # head flush
            slot = step % stages
            ops += [ready(0, step), ("arrive", ("free", 0, slot), step)] + sync
            if not latent:
                ops += [ready(1, step), ("arrive", ("free", 1, slot), step)]
            ops += sync
        if wg_first < wg_steps:
            ops.append(ready(0, wg_first))
        runs = dict((overlap_runs or {}).get(wg, ()))  # lo -> hi
        step = wg_first
        while step < wg_steps:
            if step in runs:  # overlapped_run(lo, hi)
                lo, hi = step, runs[step]
                ops.append(("arrive", ("free", 0, lo % stages), lo))
                for t in range(lo, hi):
                    if t + 1 < hi:
                        ops += [ready(0, t + 1), ("arrive", ("free", 0, (t + 1) % stages), t + 1)]
                    ops.append(ready(1, t))
                    if t + 1 == hi and hi < wg_steps:
                        ops.append(ready(0, hi))
                    ops.append(("arrive", ("free", 1, t % stages), t))
                step = hi
                continue
            # kv_step
            slot = step % stages
            if latent:  # the K tile holds V: released after P V
                ops += sync + sync
            else:
                ops += sync + [("arrive", ("free", 0, slot), step), *sync[:1], ready(1, step), *sync[1:]]
            if step + 1 < wg_steps:
                ops.append(ready(0, step + 1))
            ops.append(("arrive", ("free", 0 if latent else 1, slot), step))
            step += 1
        for step in range(wg_steps, cta_steps):  # flush_step (without the schedule: each tile waited first)
            slot = step % stages
            for which in kinds:
                ops += ([] if scheduled else [ready(which, step)]) + [("arrive", ("free", which, slot), step)]
            ops += sync + sync
        if wg == 0:
            ops += sync
        programs[f"consumer{wg}"] = ops
    return programs


def _check_cta(first_step, cta_steps, wg_ranges, pre_steps, tail_step, *, stages, tma_new_tiles, windowed, rng,
               interleavings=3, page_steps=0, latent=False, overlap_runs=None, fp8=False):
    """One CTA's barrier programs (cp.async parities from the kernel's `cp_async_uses`, counted from first_step when
    windowed; prefix steps below page_steps by TMA page by page; overlap_runs as `_cta_programs`) run in
    `interleavings` random interleavings on fresh barriers; returns how many ran."""
    from jaxattn.kernels.extend_attention_mgpu import cp_async_uses

    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    steps = np.arange(cta_steps + 1)
    uses = np.asarray(cp_async_uses(i32(steps), i32(steps % stages), pre_steps=i32(pre_steps), tail_step=i32(tail_step),
                                    stages=stages, first_step=i32(first_step) if windowed else None,
                                    page_steps=i32(page_steps) if page_steps else 0))
    programs = _cta_programs(first_step, cta_steps, wg_ranges, pre_steps, tail_step, uses, stages=stages,
                             tma_new_tiles=tma_new_tiles, page_steps=page_steps, latent=latent,
                             overlap_runs=overlap_runs, fp8=fp8)
    for _ in range(interleavings):
        barriers = {("free", w, s): Barrier(len(wg_ranges)) for w in (0, 1) for s in range(stages)}
        barriers |= {(kind, w, s): Barrier(1) for kind in ("ready", "kv", "page") for w in (0, 1) for s in range(stages)}
        barriers["schedule"] = Barrier(2)
        run_protocol(programs, barriers, rng)
    return interleavings


def _random_runs(rng, wg_ranges):
    """Per warpgroup, random (lo, hi) runs of its steps for the intra-warpgroup overlap, between steps taken one by
    one (the kernel's unmasked runs sit between masked steps)."""
    runs = {}
    for wg, (wg_first, wg_steps) in enumerate(wg_ranges):
        runs[wg], step = [], wg_first
        while step < wg_steps:
            hi = rng.randint(step + 1, wg_steps)
            if rng.random() < 0.6:
                runs[wg].append((step, hi))
            step = hi
    return runs


@pytest.mark.parametrize("prefix_tiles", ["rows", "pages", "fp8", "fp8-staged"])
@pytest.mark.parametrize("tma_new_tiles", [False, True], ids=["cp-async", "tma"])
def test_barrier_protocol_never_hangs(tma_new_tiles, prefix_tiles):
    if prefix_tiles.startswith("fp8") and not tma_new_tiles:
        pytest.skip("the fp8 producer's new-key tiles are the rows form's; one new-tile kind suffices (suite time)")
    # CPU: every CTA's producer and consumers (their barrier operations in the kernel's order, step ranges and
    # cp.async parities from the kernel's own helpers) in random interleavings with loads landing late: no deadlock,
    # no wait passing early or on another tile's phase, with and without a window (head flushes included), causal
    # and with a custom mask's non-causal schedule; with whole pages, the prefix tiles inside the prefix by TMA; over
    # fp8 pools, the prefix tiles converted by the producer stages - 1 steps after their copies (or, staged, a step
    # after their copies into the staging tiles, once their slots are free).
    import itertools
    import random

    from jaxattn.kernels.extend_attention_mgpu import cta_window_first_step, warpgroup_window_steps

    rng = random.Random(0)
    block_q = 64
    cdiv = lambda x, d: -(-x // d)  # noqa: E731
    cases = 0
    # (tile, stages, heads per CTA, consumers): two heads per CTA (short extends) give both warpgroups the CTA's
    # block_q rows; three consumers (64-dim heads) take 192-row CTAs without the schedule barrier, each CTA also with
    # random runs of its steps under the intra-warpgroup overlap.
    for block_kv, stages, packed, consumers in ((128, 2, False, 2), (64, 3, False, 2), (64, 2, False, 2),
                                                (128, 2, True, 2), (64, 3, True, 2), (128, 2, False, 3),
                                                (64, 3, False, 3)):
        cta_rows = block_q if packed else consumers * block_q
        for q_start, prefix_len, q_len in ((5, 300, 257), (0, 0, 130), (13, 1000, 70), (8, 64, 700)):
            base, lead = q_start // 8 * 8, q_start % 8
            q_end = q_start + q_len
            pre_steps = cdiv(prefix_len, block_kv)
            token_end = q_end + 3  # a batch's last sequence, a few padding rows
            tail_step = pre_steps + (max((token_end - base) // block_kv, 0) if tma_new_tiles else 0)
            # A custom mask (with or without a window) takes the non-causal schedule: every warpgroup every new key.
            for window, custom in itertools.product((-1, 0, 37, 100, 5000), (False, True)):
                for cta_row in range(base, q_end, cta_rows):
                    cta_steps = pre_steps + cdiv(min(cta_row + cta_rows, q_end) - base, block_kv)
                    if custom:
                        cta_steps = pre_steps + max(cdiv(q_end - base, block_kv), 1)
                    first = 0
                    if window >= 0:
                        first = int(cta_window_first_step(cta_row, q_start, prefix_len, lead, pre_steps, cta_steps,
                                                          window=window, block_kv=block_kv))
                    ranges = []
                    for wg in range(consumers):
                        wg_row = cta_row if packed else cta_row + wg * block_q
                        wg_steps = cta_steps if custom else pre_steps + cdiv(min(wg_row + block_q, q_end) - base, block_kv)
                        wg_first = first
                        if window >= 0:
                            wg_first = int(warpgroup_window_steps(
                                wg_row, q_start, q_end, prefix_len, lead, pre_steps, first, wg_steps, window=window,
                                block_q=block_q, block_kv=block_kv)[0])
                        ranges.append((wg_first, wg_steps))
                    for overlap_runs in [None] + ([_random_runs(rng, ranges)] if consumers == 3 else []):
                        cases += _check_cta(first, cta_steps, ranges, pre_steps, tail_step, stages=stages,
                                            tma_new_tiles=tma_new_tiles, windowed=window >= 0, rng=rng,
                                            page_steps=prefix_len // block_kv if prefix_tiles == "pages" else 0,
                                            overlap_runs=overlap_runs,
                                            fp8={"fp8": True, "fp8-staged": "staged"}.get(prefix_tiles, False))
    assert cases > 100


def test_barrier_protocol_never_hangs_latent():
    # CPU: the latent-cache mode (MLA's 288/256, `latent_v_dim`): the producer loads K tiles only and a slot is freed
    # after both consumers' P V. Causal two-stage CTAs (the mode's only schedule), one and two heads per CTA, 2 and 3
    # stages, prefixes ending mid-tile, the second warpgroup's range shorter (flush steps).
    import random

    rng = random.Random(2)
    block_q, block_kv = 64, 64
    cdiv = lambda x, d: -(-x // d)  # noqa: E731
    cases = 0
    for stages, packed in ((3, False), (2, False), (3, True)):
        cta_rows = block_q if packed else 2 * block_q
        for q_start, prefix_len, q_len in ((5, 300, 257), (0, 0, 130), (13, 1000, 70), (8, 64, 700), (0, 4096, 60)):
            base = q_start // 8 * 8
            q_end = q_start + q_len
            pre_steps = cdiv(prefix_len, block_kv)
            for cta_row in range(base, q_end, cta_rows):
                cta_steps = pre_steps + cdiv(min(cta_row + cta_rows, q_end) - base, block_kv)
                ranges = []
                for wg in (0, 1):
                    wg_row = cta_row if packed else cta_row + wg * block_q
                    ranges.append((0, pre_steps + cdiv(min(wg_row + block_q, q_end) - base, block_kv)))
                cases += _check_cta(0, cta_steps, ranges, pre_steps, pre_steps, stages=stages, tma_new_tiles=False,
                                    windowed=False, rng=rng, latent=True)
    assert cases > 30


def test_barrier_protocol_never_hangs_unified_and_noncausal():
    # CPU: as above for the unified form (every step by cp.async, each warpgroup's causal step count from its last
    # row's listed position, the CTA's from its last row's; empty lists included; with and without a window) and for
    # non-causal two-stage CTAs (both warpgroups take every step of the sequence).
    import random

    from jaxattn.kernels.extend_attention_mgpu import unified_window_first_step

    rng = random.Random(1)
    block_q = 64
    cdiv = lambda x, d: -(-x // d)  # noqa: E731
    cases = 0
    for block_kv, stages, consumers in ((128, 2, 2), (64, 3, 2), (128, 2, 3)):  # 3: 64-dim heads' 192-row CTAs
        cta_rows = consumers * block_q
        for q_start, q_prefix, q_len, listed in ((5, 300, 257, 557), (0, 0, 130, 130), (13, 1000, 70, 1070),
                                                 (8, 64, 700, 764), (3, 0, 40, 0), (0, 20, 9, 25)):
            base = q_start // 8 * 8
            q_end = q_start + q_len
            pre_steps = cdiv(listed, block_kv)

            def unified_steps(last_row):
                return cdiv(min(max(q_prefix + (last_row - q_start) + 1, 0), listed), block_kv)

            for cta_row in range(base, q_end, cta_rows):
                # Unified: all steps from the pool (tail_step = pre_steps: no TMA new-key tiles); with whole pages
                # the tiles inside the cached prefix by TMA.
                cta_steps = unified_steps(min(cta_row + cta_rows, q_end) - 1)
                ranges = [(0, unified_steps(min(cta_row + wg * block_q + block_q, q_end) - 1)) for wg in range(consumers)]
                layouts = [(0, cta_steps, ranges, pre_steps, pre_steps, False)]
                paged = [(0, cta_steps, ranges, pre_steps, pre_steps, False, min(q_prefix, listed) // block_kv)]
                # Unified under a window: the CTA's steps from its first row's window tile, each warpgroup's from its
                # own (head flushes between).
                for window in (0, 37, 100, 5000):
                    step_of = lambda t, w=window: int(unified_window_first_step(t, q_prefix, window=w,  # noqa: E731
                                                                                block_kv=block_kv))
                    first = min(step_of(max(cta_row, q_start) - q_start), cta_steps)
                    windowed = [(int(np.clip(step_of(max(cta_row + wg * block_q - q_start, 0)), first, wg_steps)),
                                 wg_steps) for wg, (_, wg_steps) in enumerate(ranges)]
                    layouts.append((first, cta_steps, windowed, pre_steps, pre_steps, False))
                    paged.append((first, cta_steps, windowed, pre_steps, pre_steps, False, min(q_prefix, listed) // block_kv))
                # Non-causal two-stage (prefix of q_prefix keys, new keys to the sequence's end, some by TMA), and
                # with bad metadata whose keys end before the sequence's first row (still one new-key step).
                two_pre = cdiv(q_prefix, block_kv)
                for key_end in (q_end, q_start - 1):
                    nc_steps = two_pre + max(cdiv(key_end - base, block_kv), 1)
                    tail = two_pre + max((key_end - base) // block_kv, 0)
                    layouts.append((0, nc_steps, [(0, nc_steps)] * consumers, two_pre, tail, True))
                for first, steps_total, wg_ranges, pre, tail_step, tma, *page_steps in layouts + paged:
                    cases += _check_cta(first, steps_total, wg_ranges, pre, tail_step, stages=stages, tma_new_tiles=tma,
                                        windowed=first > 0, rng=rng, page_steps=page_steps[0] if page_steps else 0)
    assert cases > 150


def _softmax_steps(qt, plan, tile, mask, *, c_rows, m_init, sinks, hq, block_q, d_v, f16_pool=None):
    """The consumer's base-2 online softmax over `plan` ((step, kind) in order): qt [heads, rows, d]; tile(step) ->
    (k, v) [block_kv, heads, d]; mask(step, kind) -> visible [rows, block_kv] or None; c_rows [rows]: the exponent's
    scale per row (sm_scale * log2(e), or cap * log2(e) with a cap, times the xai factor); sinks at the end.
    f16_pool (fp8_tiles="f16"): `_F16Pool`: its tiles (tile(step) gives them unscaled) against its f16 Q copy, their
    scores times its gain per row, P rounded to f16; a ("v_scale", None) entry of the plan multiplies the
    accumulator by its v_scale where a pool tile was consumed.
    Returns acc / l [heads, rows, d_v] (l = 0 rows divide by 1 when m_init is finite, as the unified form does)."""
    from jaxattn.kernels.extend_attention_mgpu import LOG2E

    m = np.full((hq, block_q), m_init, np.float32)
    l, acc = np.zeros((hq, block_q), np.float32), np.zeros((hq, block_q, d_v), np.float32)
    pool_seen = False
    for step, kind in plan:
        if step == "v_scale":
            acc = acc * (f16_pool.v_scale[:, None, None] if pool_seen else 1.0)
            continue
        pool = f16_pool is not None and f16_pool.is_pool(step)
        pool_seen |= pool
        k, v = tile(step)
        c = c_rows.c
        with np.errstate(invalid="ignore"):
            s = np.einsum("hqd,khd->hqk", f16_pool.q16 if pool else qt, k)
            if pool and c_rows.logit_cap is not None:  # the gain inside the tanh
                s = s * f16_pool.gain[..., None]
            elif pool:  # ... or in the exponent's scale (after the mask, as the kernel has it)
                c = c * f16_pool.gain
        s = s if c_rows.logit_cap is None else np.tanh(s * c_rows.tanh_scale)
        visible = mask(step, kind)
        if visible is not None:
            s = np.where(visible, s, -np.inf)
        with np.errstate(invalid="ignore"):
            m_new = np.maximum(m, s.max(axis=-1) * c)
            alpha = np.exp2(m - m_new)
            p = np.exp2(s * c[..., None] - m_new[..., None])
        if pool:
            p = np.float32(np.float16(p))
        with np.errstate(invalid="ignore"):
            acc = acc * alpha[..., None] + np.einsum("hqk,khd->hqd", p, v)
        l, m = l * alpha + p.sum(axis=2), m_new
    if sinks is not None:
        sink = np.float32(sinks)[:, None] * LOG2E
        m_f = np.maximum(m, sink)
        alpha = np.exp2(m - m_f)
        l, acc = l * alpha + np.exp2(sink - m_f), acc * alpha[..., None]
    if np.isfinite(m_init):
        l = np.where(l == 0, 1.0, l)
    with np.errstate(invalid="ignore", divide="ignore"):
        return acc / l[..., None]


class _F16Pool:
    """A warpgroup's f16 pool tiles (fp8_tiles="f16"), as the kernel computes them: its Q rows times factor =
    min(F16_Q_ROW_MAX / max|row|, 2^64) times sign(k_scale) rounded to f16, the scores given back by gain =
    |k_scale| / factor, v_scale on the accumulator after the pool tiles. qt [heads, rows, d]; k_scale, v_scale
    [heads] (each q head's kv head's); is_pool(step): a pool tile."""

    def __init__(self, qt, k_scale, v_scale, is_pool):
        from jaxattn.kernels.extend_attention_mgpu import F16_MIN_GAIN, F16_Q_ROW_MAX

        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            factor = np.minimum(np.float32(F16_Q_ROW_MAX) / np.abs(qt).max(axis=2), np.float32(2.0**64))
            self.q16 = np.float32(np.float16(qt * (factor * np.where(k_scale < 0, -1.0, 1.0)[:, None])[..., None]))
            gain = np.abs(k_scale)[:, None] / factor
            self.gain = np.where(gain == 0, np.float32(F16_MIN_GAIN), gain)
        self.v_scale, self.is_pool = v_scale, is_pool


class _RowScale:
    """The exponent's scale of a warpgroup's rows (the kernel's scale_log2, times xai's factor per row)."""

    def __init__(self, *, sm_scale, logit_cap, xai, positions):
        from jaxattn.kernels.extend_attention_mgpu import LOG2E

        self.logit_cap = logit_cap if logit_cap > 0 else None
        self.tanh_scale = sm_scale / logit_cap if logit_cap > 0 else None
        base = logit_cap * LOG2E if logit_cap > 0 else sm_scale * LOG2E
        factor = np.ones(len(positions), np.float32)
        if xai > 0:  # the rule is the reference's (the kernel computes it per row once)
            factor = np.asarray(xai_temperature_scale(jnp.asarray(positions), xai))
        self.c = np.float32(base * factor)


def _kernel_model(q, k_new, v_new, k_pool, v_pool, meta, *, window, logit_cap, sinks, block_kv, block_q=64, causal=True,
                  xai=-1, custom_mask=None, skip_prefix_custom_mask=True, heads_per_cta=1, draft_mask=None, consumers=2,
                  f16_scales=None):
    """numpy model of the kernel's consumer warpgroups, f32: the CTA and warpgroup step ranges from the kernel's own
    helpers, its loop order and mask kinds (`kv_step`), base-2 online softmax from m_init, sinks at the end. A
    custom mask is gathered per tile as `custom_mask_tile` reads it (flat index, entries outside the mask hidden), a
    draft mask as `draft_bits_tile` reads it (the warpgroup's rows, the tile's draft indices).
    heads_per_cta=2: block_q-row CTAs, both warpgroups on the same rows (the model runs every head at once).
    consumers: consumer warpgroups per CTA (3: consumers * block_q-row CTAs).
    f16_scales (k_scale, v_scale) [kv_heads]: fp8_tiles="f16": the pools hold fp8 values (the scales not applied),
    run as `_F16Pool` tiles in the kernel's loop order for them (under a window the pool's tiles apart from the new
    keys', V's scale between)."""
    from jaxattn.kernels.extend_attention_mgpu import cta_window_first_step, warpgroup_window_steps

    cdiv = lambda x, d: -(-x // d)  # noqa: E731
    q, k_new, v_new = (np.float32(x) for x in (q, k_new, v_new))
    k_pool, v_pool = (np.nan_to_num(np.float32(x)) for x in (k_pool, v_pool))
    tokens, hq, d = q.shape
    d_v = v_new.shape[2]
    group = hq // k_new.shape[1]
    kv_of = np.arange(hq) // group
    sm_scale = 1 / np.sqrt(d)
    qo, kvp, kvi = (np.asarray(x) for x in (meta.qo_indptr, meta.kv_indptr, meta.kv_indices))
    start_pos = np.asarray(meta.kv_start_pos)
    cta_rows = consumers * block_q // heads_per_cta
    q_pad = np.zeros((cdiv(tokens, 8) * 8 + 2 * cta_rows, hq, d), np.float32)
    q_pad[:tokens] = q
    out = np.zeros((len(q_pad), hq, d_v), np.float32)
    token_end = min(qo[-1], tokens)
    cols, rows = np.arange(block_kv)[None, :], np.arange(block_q)[:, None]
    custom = custom_mask is not None or draft_mask is not None
    mask_prefix = custom_mask is not None and not skip_prefix_custom_mask
    if custom:
        causal = False  # the mask replaces causal; the non-causal schedule
    if custom_mask is not None:
        flat_mask = np.asarray(custom_mask).astype(bool)
        mask_indptr = np.asarray(meta.mask_indptr).astype(np.int64)
    if draft_mask is not None:
        words = np.asarray(draft_mask).view(np.uint32)

    def draft_bits(row0, draft0):  # draft_bits_tile
        row, draft = row0 + rows, draft0 + cols
        inside = (row >= 0) & (row < len(words)) & (draft >= 0) & (draft < 32 * words.shape[1])
        word = words[np.where(inside, row, 0), np.where(inside, draft // 32, 0)]
        return inside & ((word >> np.where(inside, draft % 32, 0).astype(np.uint32)) & 1).astype(bool)

    def gathered(seq, row0, width, column0):  # custom_mask_tile
        at = mask_indptr[seq] + (row0 + rows) * np.int64(width) + column0 + cols
        inside = (at >= 0) & (at < len(flat_mask))
        return inside & flat_mask[np.where(inside, at, 0)]

    for seq in range(len(qo) - 1):
        q_start, q_end = qo[seq], min(qo[seq + 1], qo[seq] + meta.max_extend_len)
        key_end = min(qo[seq + 1], token_end)  # non-causal: every new key of the sequence
        base, lead = q_start // 8 * 8, q_start % 8
        kv_start, prefix_len = kvp[seq], kvp[seq + 1] - kvp[seq]
        pre_steps = cdiv(prefix_len, block_kv)

        def tile(step):  # K/V tile `step` as the producer fills it: [block_kv, q heads, d], zeros past the rows
            r = np.arange(block_kv)
            if step < pre_steps:
                valid = step * block_kv + r < prefix_len
                rows = kvi[kv_start + np.minimum(step * block_kv + r, prefix_len - 1)]
                k, v = k_pool[rows], v_pool[rows]
            else:
                rows = base + (step - pre_steps) * block_kv + r
                valid = rows < token_end
                k, v = k_new[np.minimum(rows, tokens - 1)], v_new[np.minimum(rows, tokens - 1)]
            return tuple(np.where(valid[:, None, None], x[:, kv_of], 0.0) for x in (k, v))

        for cta_row in range(base, q_end, cta_rows):
            if causal:
                cta_steps = pre_steps + cdiv(min(cta_row + cta_rows, q_end) - base, block_kv)
            else:
                cta_steps = pre_steps + max(cdiv(key_end - base, block_kv), 1)
            if window >= 0:
                first_step = int(cta_window_first_step(cta_row, q_start, prefix_len, lead, pre_steps, cta_steps,
                                                       window=window, block_kv=block_kv))
            for wg in range(consumers // heads_per_cta):
                wg_row = cta_row + wg * block_q
                wg_rel = wg_row - base
                t0 = wg_row - q_start
                wg_steps = pre_steps + cdiv(min(wg_row + block_q, q_end) - base, block_kv) if causal else cta_steps
                new_steps = wg_steps - pre_steps
                full_pre = 0 if mask_prefix else prefix_len // block_kv
                first_full = int(lead > 0)
                last_seen = wg_rel + 1 if causal else key_end - base
                end_full = max(min(last_seen // block_kv, new_steps), first_full)
                if custom:
                    end_full = first_full
                    width = start_pos[seq] + prefix_len + (qo[seq + 1] - q_start)
                new_kind = "custom" if custom else "causal" if causal else "new"
                prefix_kind = "custom_prefix" if mask_prefix else "prefix"
                plan, bound, window_new = [], lambda x: x, []  # noqa: E731
                if window >= 0:
                    wg_first, win_full = (int(x) for x in warpgroup_window_steps(
                        wg_row, q_start, q_end, prefix_len, lead, pre_steps, first_step, wg_steps, window=window,
                        block_q=block_q, block_kv=block_kv))
                    if custom:  # the kernel's two loops: prefix tiles, then new-key tiles
                        plan += [(step, "window_prefix" if step < pre_steps else "window_new")
                                 for step in range(wg_first, win_full)]
                    else:
                        plan += [(step, "window") for step in range(wg_first, win_full)]
                    if f16_scales is not None:  # the new keys' window tiles after the pool's (and V's scale)
                        window_new = [entry for entry in plan if entry[0] >= pre_steps]
                        plan = [entry for entry in plan if entry[0] < pre_steps]
                    bound = lambda x, w=win_full: max(x, w)  # noqa: E731
                for i, (lo, hi, kind) in enumerate(((0, full_pre, None), (full_pre, pre_steps, prefix_kind),
                                                    (pre_steps, pre_steps + first_full, new_kind),
                                                    (pre_steps + first_full, pre_steps + end_full, None))):
                    if i == 2 and f16_scales is not None:  # the pool's tiles are done
                        plan += [("v_scale", None)] + window_new
                    plan += [(step, kind) for step in range(bound(lo), bound(hi))]
                plan += [(step, new_kind) for step in range(bound(pre_steps + end_full), wg_steps)]
                steps = [step for step, _ in plan if step != "v_scale"]
                assert steps == list(range(steps[0], steps[0] + len(steps))) if steps else True, plan  # in order
                assert all(step < cta_steps for step in steps), plan  # only tiles the producer loads

                def mask(step, kind, wg_rel=wg_rel, t0=t0, wg_row=wg_row):
                    if kind is None:
                        return None
                    if kind == "prefix":
                        return step * block_kv + cols < prefix_len
                    if kind == "custom_prefix":
                        return (step * block_kv + cols < prefix_len) & gathered(
                            seq, t0, width, start_pos[seq] + step * block_kv)
                    if kind == "custom":
                        key = (step - pre_steps) * block_kv + cols
                        column0 = start_pos[seq] + prefix_len + (step - pre_steps) * block_kv - lead
                        entry = (draft_bits(wg_row, (step - pre_steps) * block_kv - lead) if draft_mask is not None
                                 else gathered(seq, t0, width, column0))
                        return (key >= lead) & (key < key_end - base) & entry
                    if kind == "causal":
                        key = (step - pre_steps) * block_kv + cols
                        return (key >= lead) & (key <= wg_rel + rows)
                    if kind == "new":
                        key = (step - pre_steps) * block_kv + cols
                        return (key >= lead) & (key < key_end - base)
                    t = t0 + rows
                    if kind == "window_prefix":  # a custom mask replaces causal; prefix columns read if mask_prefix
                        key = step * block_kv - prefix_len + cols
                        entry = gathered(seq, t0, width, start_pos[seq] + step * block_kv) if mask_prefix else True
                        return (key >= np.maximum(t - window, -prefix_len)) & (key <= -1) & entry
                    if kind == "window_new":
                        key = (step - pre_steps) * block_kv - lead + cols
                        column0 = start_pos[seq] + prefix_len + (step - pre_steps) * block_kv - lead
                        entry = (draft_bits(wg_row, (step - pre_steps) * block_kv - lead) if draft_mask is not None
                                 else gathered(seq, t0, width, column0))
                        return (key >= np.maximum(t - window, 0)) & (key < key_end - q_start) & entry
                    from_pool = step < pre_steps  # "window"
                    key = (step * block_kv - prefix_len if from_pool else (step - pre_steps) * block_kv - lead) + cols
                    lo, hi = (-prefix_len, -1) if from_pool else (0, 2**30)
                    return (key >= np.maximum(t - window, lo)) & (key <= np.minimum(t, hi))

                scale = _RowScale(sm_scale=sm_scale, logit_cap=logit_cap, xai=xai,
                                  positions=start_pos[seq] + prefix_len + t0 + np.arange(block_q))
                qt = q_pad[wg_row : wg_row + block_q].transpose(1, 0, 2)
                f16_pool = None
                if f16_scales is not None:
                    f16_pool = _F16Pool(qt, *(np.float32(x)[kv_of] for x in f16_scales),
                                        is_pool=lambda step, pre_steps=pre_steps: step < pre_steps)
                o = _softmax_steps(qt, plan, tile, mask, c_rows=scale,
                                   m_init=-np.inf if window < 0 and not custom else -1e30, sinks=sinks, hq=hq,
                                   block_q=block_q, d_v=d_v, f16_pool=f16_pool)
                lo, hi = np.clip(q_start - wg_row, 0, block_q), np.clip(q_end - wg_row, 0, block_q)
                out[wg_row + lo : wg_row + hi] = o.transpose(1, 0, 2)[lo:hi]
    return out[:tokens]


def _unified_kernel_model(q, k_pool, v_pool, meta, *, logit_cap, sinks, block_kv, block_q=64, causal=True, xai=-1,
                          window=-1, consumers=2):
    """numpy model of the unified form's consumers: tiles at listed-key offsets from step 0, [0, full_end) unmasked and
    the rest masked (key in the list and, causal, at or before the row's listed position), m_init finite, rows that
    saw nothing divided by 1. Also checks the producer's step count covers every warpgroup's. A window: the steps
    from the kernel's `unified_window_first_step` of the CTA's / warpgroup's first row, [wg_first, win_full) masked
    too, keys below a row's position - W hidden."""
    from jaxattn.kernels.extend_attention_mgpu import unified_window_first_step, unified_window_full_step

    cdiv = lambda x, d: -(-x // d)  # noqa: E731
    q = np.float32(q)
    k_pool, v_pool = (np.nan_to_num(np.float32(x)) for x in (k_pool, v_pool))
    tokens, hq, d = q.shape
    d_v = v_pool.shape[2]
    kv_of = np.arange(hq) // (hq // k_pool.shape[1])
    qo, kvp, kvi = (np.asarray(x) for x in (meta.qo_indptr, meta.kv_indptr, meta.kv_indices))
    prefix_lens, start_pos = np.asarray(meta.prefix_lens), np.asarray(meta.kv_start_pos)
    cta_rows = consumers * block_q
    q_pad = np.zeros((cdiv(tokens, 8) * 8 + 2 * cta_rows, hq, d), np.float32)
    q_pad[:tokens] = q
    out = np.zeros((len(q_pad), hq, d_v), np.float32)
    cols, rows = np.arange(block_kv)[None, :], np.arange(block_q)[:, None]
    for seq in range(len(qo) - 1):
        q_start, q_end = qo[seq], min(qo[seq + 1], qo[seq] + meta.max_extend_len)
        base = q_start // 8 * 8
        kv_start, listed = kvp[seq], max(kvp[seq + 1] - kvp[seq], 0)
        q_prefix = prefix_lens[seq]

        def steps_to(last_row):
            if not causal:
                return cdiv(listed, block_kv)
            return cdiv(int(np.clip(q_prefix + (last_row - q_start) + 1, 0, listed)), block_kv)

        def tile(step):
            r = step * block_kv + np.arange(block_kv)
            slots = kvi[kv_start + np.minimum(r, listed - 1)]
            return tuple(np.where((r < listed)[:, None, None], x[slots][:, kv_of], 0.0) for x in (k_pool, v_pool))

        for cta_row in range(base, q_end, cta_rows):
            cta_steps = steps_to(min(cta_row + cta_rows, q_end) - 1)
            for wg in range(consumers):
                wg_row = cta_row + wg * block_q
                t0 = wg_row - q_start
                wg_steps = steps_to(min(wg_row + block_q, q_end) - 1)
                assert wg_steps <= cta_steps
                seen_by_all = q_prefix + max(t0, 0) + 1 if causal else listed
                full_end = int(np.clip(min(listed, seen_by_all) // block_kv, 0, wg_steps))
                if window < 0:
                    plan = [(step, None) for step in range(full_end)]
                    plan += [(step, "unified") for step in range(full_end, wg_steps)]
                else:
                    step_of = lambda f, t: int(f(t, q_prefix, window=window, block_kv=block_kv))  # noqa: E731
                    first_step = min(step_of(unified_window_first_step, max(cta_row, q_start) - q_start), cta_steps)
                    wg_first = int(np.clip(step_of(unified_window_first_step, max(t0, 0)), first_step, wg_steps))
                    t_last = min(wg_row + block_q, q_end) - 1 - q_start
                    win_full = int(np.clip(step_of(unified_window_full_step, t_last), wg_first, wg_steps))
                    masked_from = max(full_end, win_full)
                    plan = [(step, "unified") for step in range(wg_first, win_full)]
                    plan += [(step, None) for step in range(win_full, masked_from)]
                    plan += [(step, "unified") for step in range(masked_from, wg_steps)]

                def mask(step, kind, t0=t0):
                    if kind is None:
                        return None
                    key = step * block_kv + cols
                    visible = np.broadcast_to(key < listed, (block_q, block_kv))
                    if causal:
                        visible = visible & (key <= q_prefix + t0 + rows)
                    if window >= 0:
                        visible = visible & (key >= q_prefix + t0 + rows - window)
                    return visible

                scale = _RowScale(sm_scale=1 / np.sqrt(d), logit_cap=logit_cap, xai=xai,
                                  positions=start_pos[seq] + q_prefix + t0 + np.arange(block_q))
                o = _softmax_steps(q_pad[wg_row : wg_row + block_q].transpose(1, 0, 2), plan, tile, mask, c_rows=scale,
                                   m_init=-1e30, sinks=sinks, hq=hq, block_q=block_q, d_v=d_v)
                lo, hi = np.clip(q_start - wg_row, 0, block_q), np.clip(q_end - wg_row, 0, block_q)
                out[wg_row + lo : wg_row + hi] = o.transpose(1, 0, 2)[lo:hi]
    return out[:tokens]


@pytest.mark.parametrize("shape,consumers", [(SHAPES[1], 2), (SHAPES[2], 2), (SHAPES[2], 3)],
                         ids=lambda s: f"{jnp.dtype(s[0]).name}-{s[1]}x{s[2]}-{s[3]}-{len(s[4])}seq" if isinstance(s, tuple)
                         else f"{s}-consumers")
def test_kernel_model_matches_reference(rng, shape, consumers):
    # CPU: the kernel's step ranges, skipped tiles and masks, run by a numpy model, give the reference's output for
    # every feature (an error here is the schedule's or a mask's, not the GPU's), with 2 consumer warpgroups and with
    # 3 (64-dim heads). The GPU tests check the kernel itself.
    _, hq, hkv, d, prefix_lens, extend_lens, config = shape
    block_kv = (config or MgpuExtendConfig()).block_kv
    for label, window, cut, logit_cap, sinks in FEATURES:
        if label in ("softcap", "sinks", "window5000"):  # all-cut has both; little schedule to check (and compiles)
            continue
        batch = make_batch(rng, prefix_lens, extend_lens, hq=hq, hkv=hkv, dqk=d, dtype=jnp.float32, window=cut,
                           max_extend_len=max(extend_lens) + 9)
        kw = _feature_kwargs(rng, hq, window, logit_cap, sinks)
        o = _kernel_model(batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta, window=window,
                          logit_cap=logit_cap, sinks=kw.get("sinks"), block_kv=block_kv, consumers=consumers)
        ref = np.float32(ref_two_stage(batch, **kw))
        np.testing.assert_allclose(o[: batch.tokens], ref[: batch.tokens], atol=2e-5, rtol=2e-5, err_msg=label)


@pytest.mark.parametrize("shape,consumers", [(SHAPES[1], 2), (SHAPES[2], 2), (SHAPES[2], 3)],
                         ids=lambda s: f"{jnp.dtype(s[0]).name}-{s[1]}x{s[2]}-{s[3]}-{len(s[4])}seq" if isinstance(s, tuple)
                         else f"{s}-consumers")
def test_kernel_model_of_the_new_features_matches_reference(rng, shape, consumers):
    # CPU: as above for non-causal calls (new keys to the sequence's end, the neighbours' keys masked) and xai
    # temperature (a per-row factor of the exponent's scale, from absolute positions), and for the unified form
    # (tiles at listed-key offsets, [0, full_end) unmasked) with each of them.
    _, hq, hkv, d, prefix_lens, extend_lens, config = shape
    block_kv = (config or MgpuExtendConfig()).block_kv
    for label, features in MORE_FEATURES + UNIFIED_FEATURES:
        kw = _more_kwargs(rng, hq, features)
        batch = make_batch(rng, prefix_lens, extend_lens, hq=hq, hkv=hkv, dqk=d, dtype=jnp.float32,
                           window=kw.get("sliding_window", -1), max_extend_len=max(extend_lens) + 9)
        model = dict(logit_cap=kw.get("logit_cap", 0.0), sinks=kw.get("sinks"), block_kv=block_kv,
                     causal=kw.get("causal", True), xai=kw.get("xai_temperature_len", -1), consumers=consumers)
        o = _kernel_model(batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta,
                          window=kw.get("sliding_window", -1), **model)
        ref = np.float32(ref_two_stage(batch, **kw))
        np.testing.assert_allclose(o[: batch.tokens], ref[: batch.tokens], atol=2e-5, rtol=2e-5, err_msg=label)
        if "sliding_window" in kw:
            continue
        o = _unified_kernel_model(batch.q, batch.k_pool_unified, batch.v_pool_unified, batch.meta_unified, **model)
        ref = np.float32(ref_unified(batch, **kw))
        np.testing.assert_allclose(o[: batch.tokens], ref[: batch.tokens], atol=2e-5, rtol=2e-5, err_msg=f"unified {label}")


@pytest.mark.parametrize("fmt", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2]], ids=["128", "64"])
def test_kernel_model_of_f16_pool_tiles_matches_reference(rng, shape, fmt):
    # CPU: fp8_tiles="f16" as the kernel computes it (the numpy model): unscaled fp8 pool tiles against each
    # warpgroup's row-scaled f16 Q copy, the scores given back per row, P in f16, V's scale on the accumulator
    # between the pool's tiles and the new keys' (under a window too), against the reference on the dequantised
    # pools. Hostile rows: one far past f16's range (1e6), one of zeros; one kv head's scales negative.
    from tests.test_fp8 import quantised

    _, hq, hkv, d, prefix_lens, extend_lens, config = shape
    block_kv = (config or MgpuExtendConfig()).block_kv
    k_scale = np.linspace(0.3, 2.0, hkv).astype(np.float32)
    v_scale = np.linspace(1.5, 0.6, hkv).astype(np.float32)
    if hkv > 1:
        k_scale[-1], v_scale[-1] = -k_scale[-1], -v_scale[-1]
    for label, features in [("plain", {}), ("window100", dict(sliding_window=100)), ("window0", dict(sliding_window=0)),
                            ("cap-sinks", dict(logit_cap=3.0, sinks=True)), ("noncausal", dict(causal=False)),
                            ("xai-window-cap", dict(xai_temperature_len=50, sliding_window=37, logit_cap=3.0))]:
        kw = _more_kwargs(rng, hq, features)
        batch = make_batch(rng, prefix_lens, extend_lens, hq=hq, hkv=hkv, dqk=d, dtype=jnp.bfloat16,
                           window=-1, max_extend_len=max(extend_lens) + 9)
        q = np.float32(batch.q)
        q[1, 0] = 1e6 * np.sign(q[1, 0])  # f16 would overflow without the row's factor
        q[2, -1] = 0.0
        batch = dataclasses.replace(batch, q=jnp.asarray(q, jnp.bfloat16))
        k8, v8 = quantised(batch.k_pool, k_scale, fmt), quantised(batch.v_pool, v_scale, fmt)
        model = dict(logit_cap=kw.get("logit_cap", 0.0), sinks=kw.get("sinks"), block_kv=block_kv,
                     causal=kw.get("causal", True), xai=kw.get("xai_temperature_len", -1))
        o = _kernel_model(batch.q, batch.k_new, batch.v_new, k8, v8, batch.meta, window=kw.get("sliding_window", -1),
                          f16_scales=(k_scale, v_scale), **model)
        ref = np.float32(ref_two_stage(dataclasses.replace(batch, k_pool=k8, v_pool=v8), k_scale=jnp.asarray(k_scale),
                                       v_scale=jnp.asarray(v_scale), **kw))
        assert np.isfinite(o[: batch.tokens]).all(), label
        np.testing.assert_allclose(o[: batch.tokens], ref[: batch.tokens], **tolerance(jnp.bfloat16), err_msg=label)
    # A zero k_scale: every pool score 0 (masked keys stay masked: -inf times the gain, not NaN).
    zero = np.zeros_like(k_scale)
    o = _kernel_model(batch.q, batch.k_new, batch.v_new, k8, v8, batch.meta, window=-1, f16_scales=(zero, v_scale),
                      logit_cap=0.0, sinks=None, block_kv=block_kv)
    ref = np.float32(ref_two_stage(dataclasses.replace(batch, k_pool=k8, v_pool=v8), k_scale=jnp.asarray(zero),
                                   v_scale=jnp.asarray(v_scale)))
    np.testing.assert_allclose(o[: batch.tokens], ref[: batch.tokens], **tolerance(jnp.bfloat16))


def _tree_masks(rng, prefix_lens, extend_lens, *, blind_row=None):
    """SGLang's flat custom mask of a verify-like batch: per sequence rows [extend, prefix + extend], each token
    seeing random earlier drafts and itself, random prefix columns (read only with skip_prefix_custom_mask=False).
    blind_row (sequence, row): that row sees nothing, prefix included (its output is 0)."""
    rows = []
    for seq, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        m = rng.random((e, p + e)) < 0.5
        new = np.tril(rng.random((e, e)) < 0.3)
        np.fill_diagonal(new, True)
        m[:, p:] = new
        if blind_row is not None and blind_row[0] == seq:
            m[blind_row[1]] = False
        rows.append(m.reshape(-1))
    return jnp.asarray(np.concatenate(rows))


def test_kernel_model_with_custom_masks_matches_reference(rng):
    # CPU: custom masks (tree verify) through the kernel's schedule: the non-causal step ranges, every new-key tile
    # (and with the prefix columns every prefix tile) masked by entries gathered at the kernel's flat indices.
    # With a window (verify on a sliding-window layer): lists cut to the window, tiles below a row's window masked by
    # both the window and the gathered entries (window 0: a row sees only its own key, where its mask row has it).
    prefix_lens, extend_lens = [0, 37, 128, 300, 5], [130, 5, 64, 0, 77]
    for block_kv in (64, 128):
        for skip_prefix in (True, False):
            for window in (-1, 0, 40, 100):
                batch = make_batch(rng, prefix_lens, extend_lens, hq=4, hkv=2, dqk=64, dtype=jnp.float32,
                                   max_extend_len=140, window=window)
                blind = None if skip_prefix or window >= 0 else (2, 3)
                mask = _tree_masks(rng, prefix_lens, extend_lens, blind_row=blind)
                kw = dict(custom_mask=mask, skip_prefix_custom_mask=skip_prefix)
                ref = np.float32(ref_two_stage(batch, sliding_window=window, **kw))
                for packed in (1, 2):  # two heads per CTA as a verify step's short extends take them
                    o = _kernel_model(batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta,
                                      window=window, logit_cap=0.0, sinks=None, block_kv=block_kv, heads_per_cta=packed,
                                      **kw)
                    np.testing.assert_allclose(o[: batch.tokens], ref[: batch.tokens], atol=2e-5, rtol=2e-5,
                                               err_msg=f"kv{block_kv} skip_prefix={skip_prefix} window {window} "
                                                       f"heads_per_cta {packed}")
                if blind is not None:  # the blind row (sequence 2 starts at row 130 + 5) is 0, not NaN
                    np.testing.assert_array_equal(o[130 + 5 + 3], 0.0)


def test_kernel_model_with_draft_masks_matches_reference(rng):
    # CPU: a tree as per-row draft words (extend_attention's draft_mask) through the custom-mask schedule, the new-key
    # tiles masked by the bits `draft_bits_tile` reads (the warpgroup's rows, the tile's draft indices from the lead);
    # three words for 130 drafts, a row that sees only its prefix, stray bits past a sequence's drafts, windows.
    prefix_lens, extend_lens = [0, 37, 128, 300, 5], [130, 5, 64, 0, 77]
    for block_kv in (64, 128):
        for window in (-1, 0, 40):
            batch = make_batch(rng, prefix_lens, extend_lens, hq=4, hkv=2, dqk=64, dtype=jnp.float32,
                               max_extend_len=140, window=window)
            bits, _ = draft_words(rng, extend_lens, 5, blind_row=(0, 9), stray_bits=True)
            bits = np.pad(bits, ((0, batch.q.shape[0] - len(bits)), (0, 0)), constant_values=0xFFFFFFFF)
            kw = dict(draft_mask=jnp.asarray(bits))
            ref = np.float32(ref_two_stage(batch, sliding_window=window, **kw))
            for packed in (1, 2):
                o = _kernel_model(batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta,
                                  window=window, logit_cap=0.0, sinks=None, block_kv=block_kv, heads_per_cta=packed, **kw)
                np.testing.assert_allclose(o[: batch.tokens], ref[: batch.tokens], atol=2e-5, rtol=2e-5,
                                           err_msg=f"kv{block_kv} window {window} heads_per_cta {packed}")


def test_kernel_model_on_random_batches(rng):
    # CPU: random ragged batches (empty prefixes and extends, sequences off the 8-row grid, several CTAs) with a random
    # mix of features, both forms, both tile sizes: the kernel's schedule gives the reference's output.
    for trial in range(6):
        batch_size = int(rng.integers(1, 5))
        prefix_lens = [int(x) for x in rng.choice([0, 1, 63, 64, 65, 200, 333], batch_size)]
        extend_lens = [int(x) for x in rng.choice([0, 1, 7, 8, 64, 129, 200], batch_size)]
        block_kv = int(rng.choice([64, 128]))
        causal = bool(rng.random() < 0.6)
        window = int(rng.choice([-1, 0, 50])) if causal else -1
        features = dict(logit_cap=float(rng.choice([0.0, 2.0])), xai_temperature_len=int(rng.choice([-1, 30])),
                        sinks=bool(rng.random() < 0.5), causal=causal)
        if window >= 0:
            features["sliding_window"] = window
        kw = _more_kwargs(rng, 2, features)
        batch = make_batch(rng, prefix_lens, extend_lens, hq=2, hkv=1, dqk=64, dtype=jnp.float32, window=window,
                           max_extend_len=max(max(extend_lens), 1))
        model = dict(logit_cap=kw["logit_cap"], sinks=kw.get("sinks"), block_kv=block_kv, causal=causal,
                     xai=kw["xai_temperature_len"])
        # Two heads per CTA where the kernel's rule packs them (short extends; hq=2 over one kv head).
        packed = heads_per_cta(batch.meta.max_extend_len, 2, MgpuExtendConfig(block_kv=block_kv))
        context = f"trial {trial}: {prefix_lens} {extend_lens} {block_kv} {kw} heads_per_cta {packed}"
        o = _kernel_model(batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta, window=window,
                          heads_per_cta=packed, **model)
        np.testing.assert_allclose(o[: batch.tokens], np.float32(ref_two_stage(batch, **kw))[: batch.tokens], atol=2e-5,
                                   rtol=2e-5, err_msg=context)
        if window >= 0:  # the unified form takes a window on uncut lists
            batch = make_batch(rng, prefix_lens, extend_lens, hq=2, hkv=1, dqk=64, dtype=jnp.float32,
                               max_extend_len=max(max(extend_lens), 1))
        o = _unified_kernel_model(batch.q, batch.k_pool_unified, batch.v_pool_unified, batch.meta_unified, window=window,
                                  **model)
        np.testing.assert_allclose(o[: batch.tokens], np.float32(ref_unified(batch, **kw))[: batch.tokens], atol=2e-5,
                                   rtol=2e-5, err_msg="unified " + context)


def test_kernel_model_at_head_dims_192_128(rng):
    # CPU: v narrower than q/k (O [rows, 128]), 64-key tiles as the table has them, both forms.
    batch = make_batch(rng, [0, 37, 300], [130, 5, 70], hq=2, hkv=2, dqk=192, dv=128, dtype=jnp.float32,
                       max_extend_len=139)
    o = _kernel_model(batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta, window=-1,
                      logit_cap=0.0, sinks=None, block_kv=64)
    np.testing.assert_allclose(o[: batch.tokens], np.float32(ref_two_stage(batch))[: batch.tokens], atol=2e-5, rtol=2e-5)
    o = _unified_kernel_model(batch.q, batch.k_pool_unified, batch.v_pool_unified, batch.meta_unified, logit_cap=0.0,
                              sinks=None, block_kv=64)
    np.testing.assert_allclose(o[: batch.tokens], np.float32(ref_unified(batch))[: batch.tokens], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [-1, 0, 37, 100])
def test_unified_kernel_model_is_split_invariant(rng, window):
    # CPU: the unified schedule (which tiles run unmasked depends on the split; under a window also where the steps
    # start) gives the same values for a token whatever its split, as the GPU test checks bit for bit on the kernel.
    length, hq, d = 300, 2, 64
    slots = rng.permutation(np.arange(1, 400))[:length].astype(np.int32)
    k_pool, v_pool = (random_normal(rng, (400, 1, d), jnp.float32) for _ in range(2))
    q_all = random_normal(rng, (length, hq, d), jnp.float32)
    table = jnp.asarray(np.concatenate([slots, np.zeros(4, np.int32)])[None])
    outputs = {}
    for p in (0, 1, 64, 130, 299):
        meta = extend_unified_metadata(table, jnp.asarray([0], jnp.int32), jnp.asarray([p], jnp.int32),
                                       jnp.asarray([length - p], jnp.int32), jnp.asarray(slots[p:]),
                                       max_extend_len=length, kv_capacity=length)
        outputs[p] = _unified_kernel_model(q_all[p:], k_pool, v_pool, meta, logit_cap=0.0, sinks=None, block_kv=64,
                                           window=window)
    for p1 in outputs:
        for p2 in outputs:
            if p1 < p2:
                np.testing.assert_allclose(outputs[p1][p2 - p1 :], outputs[p2], atol=1e-6, rtol=1e-6)


def test_extend_attention_picks_the_kernel(rng):
    batch = make_batch(rng, [4, 9], [8, 5], hq=2, hkv=1, dqk=64, dtype=jnp.bfloat16)
    args = (batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta)
    with pytest.raises(ValueError, match="impl must be"):
        extend_attention(*args, impl="cuda")
    if _is_hopper():
        mgpu = extend_attention_mgpu(*args)
        np.testing.assert_array_equal(np.float32(extend_attention(*args)), np.float32(mgpu))  # the default
        with pytest.raises(ValueError, match="impl='mgpu'.*a sliding window with non-causal attention"):
            extend_attention(*args, causal=False, sliding_window=4, impl="mgpu")
    else:
        with pytest.raises(ValueError, match="impl='mgpu'.*no GPU"):
            extend_attention(*args, impl="mgpu")
    # Features the Mosaic GPU kernel lacks (and impl="triton") take the Triton kernel wherever this runs; those it
    # has (here a soft cap) take it on Hopper.
    assert_output(extend_attention(*args, impl="triton"), ref_two_stage(batch), batch, jnp.bfloat16)
    assert_output(extend_attention(*args, logit_cap=5.0), ref_two_stage(batch, logit_cap=5.0), batch, jnp.bfloat16)
    assert_output(extend_attention(*args, xai_temperature_len=4), ref_two_stage(batch, xai_temperature_len=4), batch,
                  jnp.bfloat16)


def test_says_why_it_cannot_take_a_call():
    S = jax.ShapeDtypeStruct
    q, pool = S((8, 4, 128), jnp.bfloat16), S((32, 2, 128), jnp.bfloat16)
    assert "dtype float32" in mgpu_unsupported(S((8, 4, 128), jnp.float32), pool, pool)
    assert "head dims 128/64 (64/64, 128/128, 192/128, 256/256 only)" in mgpu_unsupported(q, pool, S((32, 2, 64), jnp.bfloat16))
    q192, k192, v128 = S((8, 4, 192), jnp.bfloat16), S((32, 2, 192), jnp.bfloat16), S((32, 2, 128), jnp.bfloat16)
    assert "head dims" not in (mgpu_unsupported(q192, k192, v128) or "")  # DeepSeek's 192/128 is taken
    assert "head dims 96/96" in mgpu_unsupported(S((8, 4, 96), jnp.bfloat16), S((32, 2, 96), jnp.bfloat16), S((32, 2, 96), jnp.bfloat16))
    for feature, why in ((dict(causal=False, sliding_window=8), "a sliding window with non-causal attention"),
                         (dict(draft_mask=jnp.ones((8, 1), jnp.int32), form="unified"), "a draft mask")):
        assert why in mgpu_unsupported(q, pool, pool, **feature), feature
    assert "interpreted" in mgpu_unsupported(q, pool, pool, mode="interpret")
    # A window, a soft cap, sinks, xai temperature, non-causal calls, custom masks and draft masks are taken, alone or
    # together, and in the unified form a window: only the device can decline them.
    for feature in (dict(), dict(sliding_window=0), dict(logit_cap=1.0), dict(sinks=jnp.zeros(4)),
                    dict(sliding_window=100, logit_cap=30.0, sinks=jnp.zeros(4)), dict(xai_temperature_len=16),
                    dict(causal=False, logit_cap=3.0, sinks=jnp.zeros(4), xai_temperature_len=8),
                    dict(form="unified"), dict(form="unified", causal=False, logit_cap=1.0, xai_temperature_len=4),
                    dict(custom_mask=jnp.ones(4, bool)), dict(custom_mask=jnp.ones(4, bool), logit_cap=3.0, sinks=jnp.zeros(4)),
                    dict(custom_mask=jnp.ones(4, bool), sliding_window=8), dict(draft_mask=jnp.ones((8, 1), jnp.int32)),
                    dict(draft_mask=jnp.ones((8, 1), jnp.int32), sliding_window=8, sinks=jnp.zeros(4)),
                    dict(sliding_window=8, form="unified"), dict(sliding_window=0, form="unified", logit_cap=2.0),
                    dict(custom_mask=jnp.ones(4, bool), form="unified"),
                    dict(custom_mask=jnp.ones(4, bool), form="unified", sliding_window=8, sinks=jnp.zeros(4))):
        why = mgpu_unsupported(q, pool, pool, **feature)
        device_reasons = ("no GPU", "sm_90", "CUDA runtime")
        assert (why is None or "CUDA runtime" in why) if _is_hopper() else any(r in why for r in device_reasons), (feature, why)


def test_rejects_what_the_kernel_cannot_take(rng):
    batch = make_batch(rng, [4], [8], hq=2, hkv=1, dqk=64, dtype=jnp.bfloat16)
    args = (batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta)
    with pytest.raises(ValueError, match="q must have dtype"):
        extend_attention_mgpu(batch.q.astype(jnp.float32), *(a.astype(jnp.float32) for a in args[:4]), batch.meta)
    odd = make_batch(rng, [4], [8], hq=2, hkv=1, dqk=96, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="head dims 64/64, 128/128, 192/128, 256/256"):
        extend_attention_mgpu(odd.q, odd.k_new, odd.v_new, odd.k_pool, odd.v_pool, odd.meta)
    with pytest.raises(ValueError, match="k_new"):
        extend_attention_mgpu(batch.q, batch.k_new[:, :, :32], *args[1:])
    with pytest.raises(ValueError, match="block_kv"):
        MgpuExtendConfig(block_kv=96)
    with pytest.raises(ValueError, match="stages"):
        MgpuExtendConfig(stages=1)
    with pytest.raises(ValueError, match="shared memory"):
        extend_attention_mgpu(batch.q, *args, config=MgpuExtendConfig(block_kv=128, stages=8))
    mask = jnp.ones(8 * 12, bool)  # one sequence: [8 new, 4 + 8 keys]
    with pytest.raises(ValueError, match="custom_mask must have dtype"):
        extend_attention_mgpu(batch.q, *args, custom_mask=mask.astype(jnp.float32))
    with pytest.raises(ValueError, match="sliding_window with causal=True only"):
        extend_attention_mgpu(batch.q, *args, causal=False, sliding_window=4)
    # The kernel reads the mask's bytes as given (no conversion): a wider dtype would be read wrong, so it refuses one.
    from jaxattn.kernels.extend_attention_mgpu import extend_attention_mgpu_kernel
    with pytest.raises(ValueError, match="custom_mask must be bool, u8 or i8"):
        extend_attention_mgpu_kernel(
            batch.q, *args[:4], batch.meta.kv_indices, batch.meta.qo_indptr, batch.meta.kv_indptr, None,
            max_extend_len=8, sm_scale=0.1, block_q=64, block_kv=128, stages=2, tma_new_tiles=False,
            o_rows_columns=64, custom_mask=mask.astype(jnp.int32), mask_indptr=batch.meta.mask_indptr,
            kv_start_pos=batch.meta.kv_start_pos)
    # The unified form takes a window on lists not cut for one (its tiles sit at fixed listed-key offsets).
    uargs = (batch.q, batch.k_pool_unified, batch.v_pool_unified)
    with pytest.raises(ValueError, match=r"sliding_window with causal=True \(or a custom mask\) only"):
        extend_attention_unified_mgpu(*uargs, batch.meta_unified, causal=False, sliding_window=4)
    cut = make_batch(rng, [4], [8], hq=2, hkv=1, dqk=64, dtype=jnp.bfloat16, window=2)
    assert cut.meta_unified.sliding_window == 2
    with pytest.raises(ValueError, match="lists not cut for a window.*sliding_window=2"):
        extend_attention_unified_mgpu(*uargs, cut.meta_unified, sliding_window=2)


# This environment's own copy of jax's CUDA plugin (scripts/setup.sh puts one in each venv), else the pinned .venv's.
LOWERING_PLUGIN = next((p for p in (os.path.join(sys.prefix, "mosaic_gpu_lowering"),
                                    os.path.join(os.path.dirname(__file__), "..", ".venv", "mosaic_gpu_lowering"))
                        if os.path.isdir(os.path.join(p, "jax_cuda12_plugin"))),
                       os.path.join(os.path.dirname(__file__), "..", ".venv", "mosaic_gpu_lowering"))


needs_lowering_plugin = pytest.mark.skipif(
    not os.path.isdir(os.path.join(LOWERING_PLUGIN, "jax_cuda12_plugin")),
    reason="jax's CUDA plugin module is not in .venv/mosaic_gpu_lowering (scripts/setup.sh puts it there)")


def _in_lowering_env(*args):
    """`python *args` from the repository root, jax's CUDA plugin module importable (Mosaic GPU lowering on CPU)."""
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(LOWERING_PLUGIN), repo]), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, *args], cwd=repo, env=env, capture_output=True, text=True, timeout=900)


@needs_lowering_plugin
@pytest.mark.parametrize("part", [0, 1], ids=["even-shapes", "odd-shapes"])  # two halves: both test processes share it
def test_lowers_for_cuda_on_cpu(part):
    # CI has no GPU and Pallas' GPU interpreter cannot run this kernel: lowering it for CUDA is what CI can check.
    # The core shapes here (each kernel family once); .ci/run lowers all of them.
    run = _in_lowering_env("-m", "tests.lower_mgpu_kernel", "", f"{part}/2", "--core")
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    from tests.lower_mgpu_kernel import CORE

    assert run.stdout.count("ok ") == len(range(part, len(CORE), 2)), run.stdout


def test_core_lowering_shapes_are_shapes():
    from tests.lower_mgpu_kernel import CORE, DECODE_SHAPES, SHAPES

    labels = [shape[0] for shape in SHAPES + DECODE_SHAPES]
    assert len(labels) == len(set(labels)) == 102
    assert len(CORE) == len(set(CORE)) and set(CORE) <= set(labels), sorted(set(CORE) - set(labels))
    # The other shapes are lowered by CI only: .ci/run lowers every shape on both stacks.
    with open(os.path.join(os.path.dirname(__file__), "..", ".ci", "run")) as f:
        ci = f.read()
    assert '-m tests.lower_mgpu_kernel "" "$half/2"' in ci
    assert "\nlower_every_shape .venv\n" in ci and "\nlower_every_shape .venv/latest\n" in ci


def test_set_kernel_flag_reads_the_forms_and_refuses_others(monkeypatch):
    # The one parser of kernel flag settings (the tests' JAXATTN_TEST_KERNEL_FLAGS, experiments/with_kernel_flags.py).
    from jaxattn.kernels import extend_attention_mgpu as kernel_module

    for flag in kernel_module.kernel_flags():
        monkeypatch.setattr(kernel_module, flag, getattr(kernel_module, flag))  # restored after the test
    assert kernel_module.set_kernel_flag("PREFIX_FAST_WAITS=0") == ("PREFIX_FAST_WAITS", False)
    assert kernel_module.PREFIX_FAST_WAITS is False
    assert kernel_module.set_kernel_flag("PREFIX_FAST_WAITS") == ("PREFIX_FAST_WAITS", True)
    assert kernel_module.set_kernel_flag("FP8_ADDRESSES_PER_TILE=0", value_required=True)[1] is False
    for setting, required in (("BOGUS=1", False), ("PREFIX_FAST_WAITS=2", False), ("PREFIX_FAST_WAITS=", False),
                              ("PREFIX_FAST_WAITS", True)):
        with pytest.raises(ValueError, match="expected FLAG=0|1"):
            kernel_module.set_kernel_flag(setting, value_required=required)
    assert kernel_module.PREFIX_FAST_WAITS is True and kernel_module.FP8_ADDRESSES_PER_TILE is False


@needs_lowering_plugin
@pytest.mark.parametrize("flag,value,shape", [
    ("FP8_ADDRESSES_PER_TILE", False, "fp8-e4m3-128-bf16-tma"),
    ("FP8_ADDRESSES_PER_TILE", False, "mla-decode-e4m3-16-bf16-window"),
    ("PREFIX_FAST_WAITS", False, "gqa-128-bf16"), ("PREFIX_FAST_WAITS", False, "fp8-e4m3-128-bf16-f16-window-mask")])
def test_switchable_kernel_flags_lower_for_cuda(flag, value, shape):
    # The forms off the defaults lower for sm_90: FP8_ADDRESSES_PER_TILE off (the fp8 copies' and conversion's
    # addresses hoisted out of the producer's loop) in the extend and MLA (padded tile) kernels; PREFIX_FAST_WAITS off
    # (prefix tiles' waits through the general TMA / cp.async wait) plain, and with fp8 f16 tiles under a window and a
    # custom mask (the window's prefix loop).
    from jaxattn.kernels import extend_attention_mgpu as kernel_module

    assert flag in kernel_module.kernel_flags() and getattr(kernel_module, flag) != value  # the form off the default
    script = ("import runpy, sys\n"
              "from jaxattn.kernels import extend_attention_mgpu\n"
              f"extend_attention_mgpu.{flag} = {value}\n"
              f"sys.argv = ['lower', {shape!r}]\n"
              "runpy.run_module('tests.lower_mgpu_kernel', run_name='__main__')\n")
    run = _in_lowering_env("-c", script)
    assert run.returncode == 0 and f"ok {shape}" in run.stdout, run.stdout + run.stderr[-3000:]


ZERO_ROWS_TIED_TO_Q = """
import re, jax, jax.numpy as jnp, numpy as np
from tests.test_extend import make_batch
from jaxattn.extend_mgpu import extend_attention_mgpu
b = make_batch(np.random.default_rng(0), [300, 90], [20, 31], hq=8, hkv=2, dqk=128, dtype=jnp.bfloat16,
               max_extend_len=32)
call = lambda q: extend_attention_mgpu(q, b.k_new, b.v_new, b.k_pool, b.v_pool, b.meta)
text = jax.export.export(jax.jit(call), platforms=["cuda"])(b.q).mlir_module()
zero_rows = [m for m in re.finditer(r"stablehlo.custom_call @mosaic_gpu\\w*\\((%[\\w#]+)\\)", text)]
barriers = {m[0]: m[1:] for m in re.findall(r"(%\\w+):2 = stablehlo.optimization_barrier (%\\w+), (%\\w+)", text)}
operand = zero_rows[0].group(1) if len(zero_rows) == 1 else None
print("zero-rows calls", len(zero_rows), "operand", operand, "barrier", operand and operand.split("#")[0] in barriers)
"""


@needs_lowering_plugin
def test_the_zero_rows_buffer_is_tied_to_its_call():
    # A model's layers share the extend metadata: a zero-rows buffer made from it alone is the same computation in
    # every layer, XLA merges them into one, and each layer's kernel, filling it in place, then copies it whole first
    # (E1: 134 MB a layer; a 630-us gap in a step of 8 layers on the H100). The buffer's only operand (qo_indptr)
    # comes through an optimization barrier with the call's q, so no two calls' buffers are one computation.
    run = _in_lowering_env("-c", ZERO_ROWS_TIED_TO_Q)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "zero-rows calls 1 operand %" in run.stdout and run.stdout.strip().endswith("barrier True"), run.stdout


def test_batches_past_the_grid_limit_are_declined():
    # The batch is the launch grid's third dimension (at most 65535): larger batches take the Triton kernels.
    from types import SimpleNamespace

    from jaxattn.impl import mgpu_extend

    call = SimpleNamespace(form="two_stage", config=None, meta=SimpleNamespace(sliding_window=-1), batch=65536)
    assert "grid's third dimension" in mgpu_extend.IMPLEMENTATION.declines(call)
