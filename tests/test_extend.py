"""Extend attention: the two-stage and unified kernels against the references, dense attention, and each other."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.extend import (
    ExtendConfig,
    ExtendMetadata,
    default_config,
    extend_attention,
    extend_attention_reference,
    extend_attention_unified,
    extend_attention_unified_reference,
    extend_metadata,
    extend_unified_metadata,
    head_dim_family,
)
from jaxattn.impl.triton_extend import kernel_builds
from jaxattn.reference import dense_causal_attention
from tests.helpers import MODES, random_normal, tolerance

SMALL = ExtendConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
PAD_TOKENS = 3  # rows of q past qo_indptr[-1]: padding tokens, whose output must be 0


@dataclasses.dataclass
class Batch:
    q: jax.Array  # [tokens + PAD_TOKENS, hq, dqk]
    k_new: jax.Array
    v_new: jax.Array
    k_pool: jax.Array  # NaN in every slot no sequence owns; the 2-stage pool also lacks the new tokens (NaN there)
    v_pool: jax.Array
    k_pool_unified: jax.Array  # the pool with the new tokens' K/V written at their slots
    v_pool_unified: jax.Array
    meta: ExtendMetadata
    meta_unified: object
    tokens: int
    builder_args: tuple  # (req_to_token, req_pool_indices, prefix_lens, extend_lens)


def make_batch(rng, prefix_lens, extend_lens, *, hq=2, hkv=1, dqk=32, dv=None, dtype=jnp.float32, window=-1, max_extend_len=None, scale=1.0):
    """A ragged batch whose every token sits at a random slot of one pool, as a real allocator leaves them."""
    dv = dqk if dv is None else dv
    prefix_lens = np.asarray(prefix_lens, np.int32)
    extend_lens = np.asarray(extend_lens, np.int32)
    batch = len(prefix_lens)
    seq_lens = prefix_lens + extend_lens
    total = int(seq_lens.sum())
    num_slots = total + 1 + int(rng.integers(3, 9))
    slots = rng.permutation(np.arange(1, num_slots))[:total].astype(np.int32)  # slot 0 is the padding slot
    max_ctx = max(int(seq_lens.max(initial=0)), 1) + 2
    req_to_token = np.zeros((batch + 2, max_ctx), np.int32)
    rows = rng.permutation(batch + 2)[:batch].astype(np.int32)  # requests live in scattered rows
    out_cache_loc, offset = [], 0
    for b in range(batch):
        req_to_token[rows[b], : seq_lens[b]] = slots[offset : offset + seq_lens[b]]
        out_cache_loc.append(slots[offset + prefix_lens[b] : offset + seq_lens[b]])
        offset += seq_lens[b]
    out_cache_loc = np.concatenate(out_cache_loc + [np.zeros(0, np.int32)])
    tokens = int(extend_lens.sum())
    k_pool = np.full((num_slots, hkv, dqk), np.nan, np.float32)
    v_pool = np.full((num_slots, hkv, dv), np.nan, np.float32)
    used = np.setdiff1d(slots, out_cache_loc)
    k_pool[used] = rng.standard_normal((len(used), hkv, dqk)) * scale
    v_pool[used] = rng.standard_normal((len(used), hkv, dv))
    k_new = rng.standard_normal((tokens + PAD_TOKENS, hkv, dqk)).astype(np.float32) * scale
    v_new = rng.standard_normal((tokens + PAD_TOKENS, hkv, dv)).astype(np.float32)
    k_unified, v_unified = k_pool.copy(), v_pool.copy()
    k_unified[out_cache_loc] = k_new[:tokens]
    v_unified[out_cache_loc] = v_new[:tokens]
    q = rng.standard_normal((tokens + PAD_TOKENS, hq, dqk)).astype(np.float32)
    cast = lambda x: jnp.asarray(x).astype(dtype)  # noqa: E731
    max_extend_len = max_extend_len or max(int(extend_lens.max(initial=0)), 1)
    args = (jnp.asarray(req_to_token), jnp.asarray(rows), jnp.asarray(prefix_lens), jnp.asarray(extend_lens))
    capacity = max(total, 1)
    meta = extend_metadata(*args, max_extend_len=max_extend_len, kv_capacity=capacity, sliding_window=window)
    meta_unified = extend_unified_metadata(
        *args, jnp.asarray(out_cache_loc), max_extend_len=max_extend_len, kv_capacity=capacity, sliding_window=window
    )
    return Batch(cast(q), cast(k_new), cast(v_new), cast(k_pool), cast(v_pool), cast(k_unified), cast(v_unified), meta, meta_unified, tokens, args)


def _clean(x):
    # The references gather padding slots too (and multiply them by 0): give them zeros instead of the pool's NaN.
    return jnp.nan_to_num(x, nan=0.0)


def run_two_stage(batch, mode, **kw):
    # The Triton kernel under test, also where extend_attention would pick the Mosaic GPU one (tests/test_extend_mgpu.py).
    return extend_attention(batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta, mode=mode, impl="triton", **kw)


def ref_two_stage(batch, **kw):
    kw.pop("config", None)
    return extend_attention_reference(batch.q, batch.k_new, batch.v_new, _clean(batch.k_pool), _clean(batch.v_pool), batch.meta, **kw)


def run_unified(batch, mode, **kw):
    return extend_attention_unified(batch.q, batch.k_pool_unified, batch.v_pool_unified, batch.meta_unified, mode=mode, **kw)


def ref_unified(batch, **kw):
    kw.pop("config", None)
    return extend_attention_unified_reference(batch.q, _clean(batch.k_pool_unified), _clean(batch.v_pool_unified), batch.meta_unified, **kw)


def assert_output(o, ref, batch, dtype, **tol):
    o, ref = np.float32(o), np.float32(ref)
    assert not np.isnan(o).any(), "NaN in the output"
    np.testing.assert_array_equal(o[batch.tokens :], 0.0)  # padding tokens
    np.testing.assert_allclose(o[: batch.tokens], ref[: batch.tokens], **(tol or tolerance(dtype)))


# Pairwise-ish coverage of dtype x heads x head dims x ragged shapes (zero-length prefixes and extends).
SHAPES = [
    # dtype, hq, hkv, dqk, dv, prefix_lens, extend_lens, config
    (jnp.float32, 2, 2, 64, 64, [0, 21, 5], [19, 0, 33], SMALL),
    (jnp.float16, 4, 1, 128, 128, [17, 0], [6, 24], SMALL),
    (jnp.bfloat16, 4, 2, 64, 64, [40, 3, 0], [9, 17, 1], None),  # the table's config, clamped
    (jnp.bfloat16, 2, 2, 192, 128, [11, 0], [20, 5], SMALL),  # DeepSeek MHA prefill: rope part in a second dot
    (jnp.float16, 2, 1, 576, 512, [9, 4], [7, 12], SMALL),  # MLA absorbed
    (jnp.float32, 2, 1, 288, 256, [0, 6], [0, 10], ExtendConfig(32, 16, 4, 1)),
    (jnp.float32, 4, 4, 40, 24, [13, 2], [11, 18], ExtendConfig(16, 32, 4, 1)),  # odd dims, Lq != Lv
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{jnp.dtype(s[0]).name}-{s[1]}x{s[2]}-{s[3]}-{s[4]}")
def test_matches_reference(rng, mode, shape):
    dtype, hq, hkv, dqk, dv, prefix_lens, extend_lens, config = shape
    batch = make_batch(rng, prefix_lens, extend_lens, hq=hq, hkv=hkv, dqk=dqk, dv=dv, dtype=dtype, max_extend_len=max(extend_lens) + 5)
    o = run_two_stage(batch, mode, config=config)
    assert o.shape == (batch.q.shape[0], hq, dv) and o.dtype == dtype
    assert_output(o, ref_two_stage(batch), batch, dtype)
    o_unified = run_unified(batch, mode, config=config)
    assert_output(o_unified, ref_unified(batch), batch, dtype)


FEATURES = {
    "noncausal": dict(causal=False),
    "softcap": dict(logit_cap=1.5),
    "xai": dict(xai_temperature_len=6),
    "sinks": dict(sinks="random"),
    "window": dict(window=7),
    "window-sinks-softcap": dict(window=20, sinks="random", logit_cap=3.0),
    "mask": dict(mask=True),
    "mask-prefix": dict(mask=True, skip_prefix_custom_mask=False),
    "mask-window": dict(mask=True, skip_prefix_custom_mask=False, window=9),
    "noncausal-window-xai": dict(causal=False, window=5, xai_temperature_len=20),
}


def _tree_mask(rng, q_len, width, prefix_full, dense_prefix=False):
    """Random speculative-tree mask rows [q_len, width]: each token sees itself, some earlier tokens, random prefix keys."""
    m = rng.random((q_len, width)) < 0.5
    new = np.tril(rng.random((q_len, q_len)) < 0.6)
    np.fill_diagonal(new, True)
    m[:, prefix_full:] = new
    if dense_prefix:
        m[:, :prefix_full] = True
    return m.reshape(-1)


def feature_batch(rng, spec, *, hq, hkv, prefix_lens, extend_lens):
    """A ragged f32 batch and the (two-stage, unified) keyword arguments for a FEATURES-style spec."""
    spec = dict(spec)
    window = spec.pop("window", -1)
    use_mask = spec.pop("mask", False)
    batch = make_batch(rng, prefix_lens, extend_lens, hq=hq, hkv=hkv, dqk=32, dtype=jnp.float32, window=window, scale=0.7)
    kw = dict(spec)
    if window >= 0:
        kw["sliding_window"] = window
    if kw.get("sinks") == "random":
        kw["sinks"] = random_normal(rng, (hq,), jnp.float32)
    kw_unified = {k: v for k, v in kw.items() if k != "skip_prefix_custom_mask"}
    if use_mask:
        # Two-stage: full-width rows [q_len, prefix_len + q_len]; unified: rows over the listed keys.
        full = [_tree_mask(rng, e, p + e, p) for p, e in zip(prefix_lens, extend_lens)]
        kw["custom_mask"] = jnp.asarray(np.concatenate(full))
        listed = np.asarray(batch.meta_unified.prefix_lens)
        rows = [_tree_mask(rng, e, l + e, l) for l, e in zip(listed, extend_lens)]
        kw_unified["custom_mask"] = jnp.asarray(np.concatenate(rows).astype(np.uint8))
    return batch, kw, kw_unified


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_features(rng, mode, feature):
    batch, kw, kw_unified = feature_batch(rng, FEATURES[feature], hq=4, hkv=2, prefix_lens=[26, 0, 9], extend_lens=[21, 6, 0])
    kw, kw_unified = dict(kw, config=SMALL), dict(kw_unified, config=SMALL)
    o = run_two_stage(batch, mode, **kw)
    assert_output(o, ref_two_stage(batch, **kw), batch, jnp.float32)
    o = run_unified(batch, mode, **kw_unified)
    assert_output(o, ref_unified(batch, **kw_unified), batch, jnp.float32)
    if feature == "window":
        # The windowed prefix list gives the same result as the full list under the same window.
        wide = extend_metadata(*batch.builder_args, max_extend_len=batch.meta.max_extend_len, kv_capacity=batch.meta.kv_capacity)
        o_full = extend_attention(batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, wide, mode=mode, **kw)
        np.testing.assert_allclose(np.float32(o_full), np.float32(o), atol=2e-5, rtol=2e-5)


def draft_words(rng, extend_lens, words, *, blind_row=None, stray_bits=False):
    """(draft_mask u32[tokens, words], the same trees as SGLang's full-width custom mask rows for `prefix_lens`):
    each token sees itself and random earlier new tokens; blind_row (sequence, row) sees no new token (only its
    prefix); stray_bits sets bits past each sequence's new tokens, which must be ignored."""
    rows = []
    for seq, e in enumerate(extend_lens):
        m = np.tril(rng.random((e, e)) < 0.4)
        np.fill_diagonal(m, True)
        if blind_row is not None and blind_row[0] == seq:
            m[blind_row[1]] = False
        rows.append(m)
    bits = np.zeros((sum(extend_lens), words), np.uint32)
    r = 0
    for m in rows:
        e = len(m)
        for t in range(e):
            columns = np.flatnonzero(m[t])
            if stray_bits:
                columns = np.concatenate([columns, np.arange(e, 32 * words, 7)])
            for j in columns[columns < 32 * words]:
                bits[r + t, j // 32] |= np.uint32(1 << (j % 32))
        r += e
    return bits, rows


def full_width_mask(trees, prefix_lens, words):
    """SGLang's flat custom mask of draft trees (the prefix columns all visible; drafts past 32 * words hidden)."""
    flat = []
    for m, p in zip(trees, prefix_lens):
        e = len(m)
        m = m & (np.arange(e) < 32 * words)[None, :]
        flat.append(np.concatenate([np.ones((e, p), bool), m], axis=1).reshape(-1))
    return jnp.asarray(np.concatenate(flat))


def test_draft_mask_words_packs_rows_of_any_width(rng):
    # jaxattn.metadata.draft_mask_words: bool[..., rows, drafts] -> u32[..., rows, ceil(drafts / 32)], bit j % 32 of
    # word j // 32 (checked by unpacking), inside jit too.
    from jaxattn.metadata import draft_mask_words
    for shape in ((5, 70), (2, 3, 32), (4, 1)):
        mask = rng.random(shape) < 0.5
        words = np.asarray(jax.jit(draft_mask_words)(jnp.asarray(mask)))
        assert words.dtype == np.uint32 and words.shape == shape[:-1] + (-(-shape[-1] // 32),)
        unpacked = (words[..., np.arange(shape[-1]) // 32] >> (np.arange(shape[-1]) % 32).astype(np.uint32)) & 1
        np.testing.assert_array_equal(unpacked.astype(bool), mask)
    with pytest.raises(ValueError, match="rows, drafts"):
        draft_mask_words(jnp.ones(4, bool))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", ["plain", "window-sinks-cap", "stray-bits-i32", "one-word-of-70-drafts"])
def test_draft_mask_is_the_compact_custom_mask(rng, mode, variant):
    # extend_attention(draft_mask=) (per-row draft words, no [q_len, kv_len] mask) gives what the same trees as a
    # full-width custom mask give, on the Triton kernel (interpreted here; compiled on the GPU) and in the reference:
    # sequences of 70 new tokens (three words), a row that sees only its prefix, an empty sequence, bits set past a
    # sequence's drafts (ignored), and a mask of one word for 70 drafts (drafts 32.. hidden).
    prefix_lens, extend_lens = [26, 0, 9, 40], [70, 6, 0, 33]
    words = 1 if variant == "one-word-of-70-drafts" else 3
    window = 12 if variant == "window-sinks-cap" else -1
    batch = make_batch(rng, prefix_lens, extend_lens, hq=4, hkv=2, dqk=32, dtype=jnp.float32, window=window, scale=0.7)
    bits, trees = draft_words(rng, extend_lens, words, blind_row=(0, 5), stray_bits=variant == "stray-bits-i32")
    bits = np.pad(bits, ((0, batch.q.shape[0] - len(bits)), (0, 0)), constant_values=0xFFFFFFFF)  # padding rows
    draft_mask = jnp.asarray(bits.view(np.int32) if variant == "stray-bits-i32" else bits)
    kw = dict(config=ExtendConfig(block_m=32, block_n=16, num_warps=4, num_stages=1))
    if variant == "window-sinks-cap":
        kw.update(sliding_window=window, sinks=random_normal(rng, (4,), jnp.float32), logit_cap=3.0)
    want = ref_two_stage(batch, custom_mask=full_width_mask(trees, prefix_lens, words), **kw)
    assert_output(ref_two_stage(batch, draft_mask=draft_mask, **kw), want, batch, jnp.float32)
    o = run_two_stage(batch, mode, draft_mask=draft_mask, **kw)
    assert_output(o, want, batch, jnp.float32)
    # The blind row (sequence 0, row 5) sees its 26 prefix keys only: not the causal result.
    causal = np.float32(ref_two_stage(batch, **kw))
    assert not np.allclose(np.float32(o)[5], causal[5], atol=1e-3)


PACKED_FEATURES = {  # feature -> (spec, head_pack): 4 heads x 8 tokens or 2 heads x 16 tokens per 32-row block
    "causal": ({}, 4),
    "window-sinks-softcap-xai": (dict(window=9, sinks="random", logit_cap=3.0, xai_temperature_len=12), 2),
    "mask-prefix": (dict(mask=True, skip_prefix_custom_mask=False), 4),
    "noncausal": (dict(causal=False), 2),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("feature", list(PACKED_FEATURES))
def test_head_pack(rng, mode, feature):
    # GQA 4:1 with 2 and 4 q heads per program: a packed block's rows span heads, so per-row heads (Q, O, sinks),
    # per-row positions (causal, window, xai, mask) and the block's token range all change with head_pack.
    spec, head_pack = PACKED_FEATURES[feature]
    batch, kw, kw_unified = feature_batch(rng, spec, hq=8, hkv=2, prefix_lens=[19, 0, 7], extend_lens=[13, 22, 0])
    want, want_unified = ref_two_stage(batch, **kw), ref_unified(batch, **kw_unified)
    config = ExtendConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, head_pack=head_pack)
    assert_output(run_two_stage(batch, mode, config=config, **kw), want, batch, jnp.float32)
    assert_output(run_unified(batch, mode, config=config, **kw_unified), want_unified, batch, jnp.float32)


@pytest.mark.parametrize("mode", MODES)
def test_against_dense_causal_attention(rng, mode):
    # One sequence: prefix 23 cached + 29 new; the new rows equal plain causal attention over all 52 tokens.
    hq, hkv, d, p, n = 4, 2, 64, 23, 29
    batch = make_batch(rng, [p], [n], hq=hq, hkv=hkv, dqk=d)
    meta = batch.meta
    prefix_slots = np.asarray(meta.kv_indices)[:p]
    k = jnp.concatenate([batch.k_pool[prefix_slots], batch.k_new[:n]])
    v = jnp.concatenate([batch.v_pool[prefix_slots], batch.v_new[:n]])
    q_full = jnp.concatenate([random_normal(rng, (p, hq, d), jnp.float32), batch.q[:n]])
    dense = dense_causal_attention(q_full, k, v)[p:]
    for o in (run_two_stage(batch, mode, config=SMALL), run_unified(batch, mode, config=SMALL)):
        np.testing.assert_allclose(np.float32(o[:n]), np.float32(dense), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", ["causal", "window-sinks-gqa"])
def test_unified_is_bitwise_split_invariant(rng, mode, variant):
    # The same 45-token sequence split as (prefix p, new 45 - p): every token computed in two splits gets the same bits.
    length, hq, hkv, d = 45, 2, 1, 32
    kw = dict(config=ExtendConfig(block_m=16, block_n=16, num_warps=4, num_stages=1))
    window = -1
    if variant != "causal":
        hq, window = 4, 11
        kw.update(sliding_window=window, sinks=random_normal(rng, (hq,), jnp.float32))
    slots = rng.permutation(np.arange(1, 80))[:length].astype(np.int32)
    k_pool = random_normal(rng, (80, hkv, d), jnp.float32)
    v_pool = random_normal(rng, (80, hkv, d), jnp.float32)
    q_all = random_normal(rng, (length, hq, d), jnp.float32)
    table = jnp.asarray(np.concatenate([slots, np.zeros(3, np.int32)])[None])
    outputs = {}
    for p in (0, 5, 16, 17, 31, 44):
        n = length - p
        # A second sequence in the batch (which also moves this one's q-rows) must not matter either.
        other = 7
        rows = jnp.asarray([0, 1], jnp.int32)
        table2 = jnp.concatenate([table, jnp.asarray(np.arange(1, 49, dtype=np.int32)[None])], axis=0)
        meta = extend_unified_metadata(
            table2, rows, jnp.asarray([p, 3], jnp.int32), jnp.asarray([n, other], jnp.int32),
            jnp.concatenate([jnp.asarray(slots[p:]), jnp.arange(4, 4 + other, dtype=jnp.int32)]),
            max_extend_len=length, kv_capacity=length + 16, sliding_window=window,
        )
        q = jnp.concatenate([q_all[p:], random_normal(rng, (other, hq, d), jnp.float32)])
        o = extend_attention_unified(q, k_pool, v_pool, meta, mode=mode, **kw)
        outputs[p] = np.asarray(o[:n])
        ref = extend_attention_unified_reference(q, k_pool, v_pool, meta, **kw)
        np.testing.assert_allclose(outputs[p], np.asarray(ref[:n]), atol=2e-5, rtol=2e-5)
    for p1 in outputs:
        for p2 in outputs:
            if p1 < p2:  # tokens p2.. are computed in both splits
                np.testing.assert_array_equal(outputs[p1][p2 - p1 :], outputs[p2], err_msg=f"splits at {p1} and {p2}")


@pytest.mark.parametrize("mode", MODES)
def test_unified_batch_with_per_sequence_new_slots(rng, mode):
    # SGLang's unified test should have been: batch > 1 whose new tokens' K/V sit at slots that really belong to each
    # sequence (scattered), checked tightly against the reference and the two-stage kernel.
    batch = make_batch(rng, [30, 12, 0, 19], [14, 25, 9, 1], hq=4, hkv=1, dqk=64, dtype=jnp.float32)
    out_loc = np.asarray(batch.meta_unified.kv_indices)
    assert len(np.unique(out_loc[: int(np.asarray(batch.meta_unified.kv_indptr)[-1])])) == 30 + 12 + 19 + 14 + 25 + 9 + 1
    o_unified = run_unified(batch, mode, config=SMALL)
    o_two_stage = run_two_stage(batch, mode, config=SMALL)
    tight = dict(atol=2e-5, rtol=2e-5)
    assert_output(o_unified, ref_unified(batch), batch, jnp.float32, **tight)
    assert_output(o_unified, o_two_stage, batch, jnp.float32, **tight)


@pytest.mark.parametrize("mode", MODES)
def test_all_empty_and_no_visible_key(rng, mode):
    batch = make_batch(rng, [5, 0], [0, 0], dqk=16)
    assert batch.tokens == 0
    o = run_two_stage(batch, mode, config=SMALL)
    np.testing.assert_array_equal(np.asarray(o), 0.0)
    np.testing.assert_array_equal(np.asarray(run_unified(batch, mode, config=SMALL)), 0.0)
    # A custom mask row with nothing visible gives 0, not NaN.
    batch = make_batch(rng, [4], [3], dqk=16)
    mask = np.ones((3, 7), bool)
    mask[1] = False
    o = run_two_stage(batch, mode, config=SMALL, custom_mask=jnp.asarray(mask.reshape(-1)), skip_prefix_custom_mask=False)
    assert not np.isnan(np.asarray(o)).any()
    np.testing.assert_array_equal(np.asarray(o[1]), 0.0)


def test_metadata_builders(rng):
    batch = make_batch(rng, [10, 0, 3], [4, 2, 0], window=4)
    meta, meta_u = batch.meta, batch.meta_unified
    np.testing.assert_array_equal(meta.qo_indptr, [0, 4, 6, 6])
    np.testing.assert_array_equal(meta.kv_indptr, [0, 4, 4, 7])  # the last min(prefix, 4) keys
    np.testing.assert_array_equal(meta.kv_start_pos, [6, 0, 0])
    np.testing.assert_array_equal(meta.mask_indptr, [0, 4 * 14, 4 * 14 + 2 * 2, 4 * 14 + 2 * 2])  # full-width rows
    np.testing.assert_array_equal(meta_u.kv_indptr, [0, 8, 10, 13])
    np.testing.assert_array_equal(meta_u.prefix_lens, [4, 0, 3])
    np.testing.assert_array_equal(meta_u.mask_indptr, [0, 4 * 8, 4 * 8 + 2 * 2, 4 * 8 + 2 * 2])
    assert (meta.max_extend_len, meta.sliding_window) == (4, 4)
    # The metadata is a pytree with static sizes: it passes through jit.
    leaves = jax.tree_util.tree_leaves(meta)
    assert all(isinstance(x, jax.Array) for x in leaves) and len(leaves) == 5
    same = jax.jit(lambda m: m)(meta)
    assert same.max_extend_len == 4 and same.kv_capacity == meta.kv_capacity


def test_configs():
    assert head_dim_family(128, 128) == "128" and head_dim_family(576, 512) == "576/512" and head_dim_family(80, 80) == "128"
    assert default_config(128, 128, jnp.bfloat16, 4096).block_m == 128
    assert default_config(128, 128, jnp.bfloat16, 20).block_m == 32  # clamped to the bucket
    assert default_config(128, 128, jnp.float32, 4096).num_stages == 1
    with pytest.raises(ValueError, match="block_n must be a power of 2"):
        ExtendConfig(block_m=64, block_n=48)
    with pytest.raises(ValueError, match="head_pack must be a power of 2"):
        ExtendConfig(head_pack=3)
    with pytest.raises(ValueError, match="must not exceed block_m"):
        ExtendConfig(block_m=16, head_pack=32)
    builds = kernel_builds()
    families = {b.label.split()[1] for b in builds}
    assert families == {"64", "128", "256", "576/512", "288/256", "192/128"}
    assert {b.function for b in builds} == {"extend_attention_kernel", "extend_attention_unified_kernel"}
    assert all(b.expects_wgmma == (dict(b.constexprs)["BLOCK_M"] >= 64) for b in builds)


def test_rejects_bad_arguments(rng):
    batch = make_batch(rng, [3], [2], dqk=16)
    q, kn, vn, kp, vp, meta = batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta
    with pytest.raises(ValueError, match=r"k_new must have shape"):
        extend_attention(q, kn[:1], vn, kp, vp, meta)
    with pytest.raises(ValueError, match="v_pool must have q's dtype"):
        extend_attention(q, kn, vn, kp, vp.astype(jnp.float16), meta)
    with pytest.raises(ValueError, match="meta must be an ExtendMetadata"):
        extend_attention(q, kn, vn, kp, vp, batch.meta_unified)
    with pytest.raises(ValueError, match="mask_indptr"):
        extend_attention(q, kn, vn, kp, vp, dataclasses.replace(meta, mask_indptr=None), custom_mask=jnp.ones(10, bool))
    with pytest.raises(ValueError, match="custom_mask must have dtype"):
        extend_attention(q, kn, vn, kp, vp, meta, custom_mask=jnp.ones(10, jnp.float32))
    with pytest.raises(ValueError, match="custom_mask or draft_mask, not both"):
        extend_attention(q, kn, vn, kp, vp, meta, custom_mask=jnp.ones(10, bool), draft_mask=jnp.ones((2, 1), jnp.int32))
    with pytest.raises(ValueError, match=rf"draft_mask must have q's {q.shape[0]} rows .* got shape \({q.shape[0] + 1}, 1\)"):
        extend_attention(q, kn, vn, kp, vp, meta, draft_mask=jnp.ones((q.shape[0] + 1, 1), jnp.int32))
    with pytest.raises(ValueError, match="draft_mask must have dtype"):
        extend_attention(q, kn, vn, kp, vp, meta, draft_mask=jnp.ones((2, 1), jnp.float32))
    with pytest.raises(ValueError, match=r"sinks must have shape \(2,\)"):
        extend_attention(q, kn, vn, kp, vp, meta, sinks=jnp.zeros(3))
    with pytest.raises(ValueError, match="config must be an ExtendConfig"):
        extend_attention(q, kn, vn, kp, vp, meta, config=(16, 16))
    windowed = make_batch(rng, [9], [2], dqk=16, window=4)
    with pytest.raises(ValueError, match=r"sliding_window \(-1\) must be in \[0, 4\]"):
        extend_attention(windowed.q, windowed.k_new, windowed.v_new, windowed.k_pool, windowed.v_pool, windowed.meta)
    with pytest.raises(ValueError, match="window_start_pos must have shape"):
        extend_attention_unified(q, kp, vp, batch.meta_unified, window_start_pos=jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="max_extend_len must be a positive"):
        extend_metadata(jnp.zeros((1, 4), jnp.int32), jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32), max_extend_len=0, kv_capacity=4)
