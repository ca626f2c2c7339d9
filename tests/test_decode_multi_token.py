"""decode_attention with several query tokens per sequence (speculative verify, multi-token prediction).

q [batch, tokens, q_heads, dim]: the last `tokens` listed keys of a sequence are the tokens' own (the drafts). Checked
against the reference (whose draft-mask rule is itself checked against the full boolean custom mask), on pools whose
unused rows are NaN, with lengths shorter than the token count, padding rows, and a split holding drafts only (the
first tokens see no key there: stage 2 must merge it as empty).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.decode import (
    DecodeConfig,
    decode_attention,
    decode_attention_reference,
    decode_metadata_from_indptr,
    draft_mask_bits,
)
from jaxattn.reference import ragged_paged_attention_reference
from jaxattn.serving.batch import tree_mask_for_verify
from tests.helpers import MODES, random_normal, random_pool_batch, tolerance
from tests.test_decode import LSE_TOL

# Lengths: 2 (< 4 tokens: the first tokens see nothing), odd, 0 (padding), 130 in 3 splits of 64 whose last holds
# drafts 2 and 3 only, 97 in 2 splits.
KV_LENS = [2, 37, 0, 130, 97]
SPLITS = [1, 1, 1, 3, 2]


def make_case(rng, q_heads, kv_heads, qk_dim, v_dim, tokens, dtype, *, v_from_k=False, kv_dtype=None):
    kv_indptr, kv_indices, slots = random_pool_batch(rng, KV_LENS, num_slots=sum(KV_LENS) + 9)
    used = np.zeros(slots, bool)
    used[np.asarray(kv_indices)] = True
    nan_rows = jnp.asarray(~used)[:, None, None]
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    k_pool = jnp.where(nan_rows, jnp.nan, random_normal(rng, (slots, kv_heads, qk_dim), jnp.float32)).astype(kv_dtype)
    v_pool = None if v_from_k else jnp.where(
        nan_rows, jnp.nan, random_normal(rng, (slots, kv_heads, v_dim), jnp.float32)).astype(kv_dtype)
    q = random_normal(rng, (len(KV_LENS), tokens, q_heads, qk_dim), dtype)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=q_heads, kv_heads=kv_heads, max_kv_splits=4,
                                       min_split_len=32, programs_per_sm=10**6)
    meta = dataclasses.replace(meta, num_kv_splits=jnp.asarray(SPLITS, jnp.int32))
    return q, k_pool, v_pool, meta


def random_trees(rng, batch, tokens):
    """i32[batch, tokens] draft masks of random trees (each token sees itself and its ancestors), and the trees."""
    parents = [[int(rng.integers(-1, t)) for t in range(tokens)] for _ in range(batch)]
    masks = np.stack([tree_mask_for_verify(p, 0) for p in parents])  # bool[batch, tokens, tokens]
    return draft_mask_bits(masks), parents


def assert_close(o, lse, ref_o, ref_lse, dtype, rows_with_keys):
    """o / lse match the reference; rows that see no key are exactly 0 / -inf."""
    np.testing.assert_allclose(np.float32(o), np.float32(ref_o), **tolerance(dtype))
    finite = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], atol=LSE_TOL[jnp.dtype(dtype)],
                               rtol=LSE_TOL[jnp.dtype(dtype)])
    assert not np.isnan(np.float32(o)).any()
    assert finite[rows_with_keys].all()


# (q_heads, kv_heads, qk_dim, v_dim, tokens, dtype, v_from_k): MLA's latent head (4 heads x 4 tokens = one 16-row
# tile), GQA with 3 tokens (6 rows of 16), 5 tokens x 4 heads (20 rows: two head blocks, the second partly masked).
CASES = [
    (4, 1, 576, 512, 4, jnp.bfloat16, True),
    (4, 2, 64, 64, 3, jnp.float32, False),
    (8, 2, 128, 128, 5, jnp.float16, False),
]
IDS = ["mla-t4", "gqa-t3", "gqa-t5-two-blocks"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("keys_as_rows", [False, True], ids=["table", "keys-as-rows"])
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_reference(rng, mode, keys_as_rows, tree, case):
    q_heads, kv_heads, qk_dim, v_dim, tokens, dtype, v_from_k = case
    q, k_pool, v_pool, meta = make_case(rng, q_heads, kv_heads, qk_dim, v_dim, tokens, dtype, v_from_k=v_from_k)
    draft_mask = random_trees(rng, len(KV_LENS), tokens)[0] if tree else None
    kwargs = dict(return_lse=True, v_head_dim=v_dim if v_from_k else None, draft_mask=draft_mask)
    # keys_as_rows: the dots transposed (DecodeConfig.keys_as_rows), the (token, head) rows as their N.
    config = DecodeConfig(block_n=32, keys_as_rows=True) if keys_as_rows else None
    o, lse = decode_attention(q, k_pool, v_pool, meta, mode=mode, config=config, **kwargs)
    assert o.shape == (len(KV_LENS), tokens, q_heads, v_dim) and o.dtype == dtype
    assert lse.shape == (len(KV_LENS), tokens, q_heads)
    ref_o, ref_lse = decode_attention_reference(q, k_pool, v_pool, meta, **kwargs)
    # Sequence 0 lists 2 keys for 4 tokens: token t sees key i iff i <= t - 2 (causal); rows 1, 3, 4 see keys.
    assert_close(o, lse, ref_o, ref_lse, dtype, rows_with_keys=[1, 3, 4])
    np.testing.assert_array_equal(np.float32(o[2]), 0.0)  # padding
    if not tree:
        np.testing.assert_array_equal(np.float32(o[0, : tokens - 2]), 0.0)  # tokens placed before the list's start


@pytest.mark.parametrize("mode", MODES)
def test_features_sinks_soft_cap_fp8(rng, mode):
    q_heads, kv_heads, dim, tokens = 4, 2, 64, 4
    q, k_pool, v_pool, meta = make_case(rng, q_heads, kv_heads, dim, dim, tokens, jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn)
    sinks = random_normal(rng, (q_heads,), jnp.float32)
    draft_mask = random_trees(rng, len(KV_LENS), tokens)[0]
    kwargs = dict(return_lse=True, sinks=sinks, logit_cap=2.0, k_scale=0.7, v_scale=1.3, draft_mask=draft_mask)
    o, lse = decode_attention(q, k_pool, v_pool, meta, mode=mode, **kwargs)
    ref_o, ref_lse = decode_attention_reference(q, k_pool, v_pool, meta, **kwargs)
    np.testing.assert_allclose(np.float32(o), np.float32(ref_o), atol=3e-2, rtol=3e-2)  # bf16 q, f16 dots over fp8
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-2, rtol=2e-2)  # sinks: every LSE finite


def test_reference_draft_mask_is_the_tree_custom_mask(rng):
    """The reference's compact rule equals the full boolean mask of the same trees (tree_mask_for_verify)."""
    q_heads, kv_heads, dim, tokens = 4, 2, 32, 5
    lens = [9, 5, 12]
    kv_indptr, kv_indices, slots = random_pool_batch(rng, lens, num_slots=sum(lens) + 3)
    k_pool = random_normal(rng, (slots, kv_heads, dim), jnp.float32)
    v_pool = random_normal(rng, (slots, kv_heads, dim), jnp.float32)
    q = random_normal(rng, (len(lens) * tokens, q_heads, dim), jnp.float32)
    bits, parents = random_trees(rng, len(lens), tokens)
    full = np.concatenate([tree_mask_for_verify(p, n - tokens).reshape(-1) for p, n in zip(parents, lens)])
    mask_indptr = jnp.asarray(np.concatenate([[0], np.cumsum([tokens * n for n in lens])]), jnp.int32)
    qo_indptr = jnp.arange(len(lens) + 1, dtype=jnp.int32) * tokens
    common = dict(max_q_len=tokens, max_kv_len=max(lens))
    by_bits = ragged_paged_attention_reference(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices,
                                               draft_mask=bits.reshape(-1), **common)
    by_mask = ragged_paged_attention_reference(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices,
                                               custom_mask=jnp.asarray(full), mask_indptr=mask_indptr, **common)
    np.testing.assert_allclose(np.asarray(by_bits), np.asarray(by_mask), atol=1e-6, rtol=1e-6)
    assert not np.allclose(np.asarray(by_bits), np.asarray(ragged_paged_attention_reference(
        q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, causal=True, **common)))  # a tree is not the causal mask


@pytest.mark.parametrize("mode", MODES)
def test_one_token_in_four_dims_is_the_plain_call(rng, mode):
    q, k_pool, v_pool, meta = make_case(rng, 4, 2, 64, 64, 1, jnp.float32)
    four = decode_attention(q, k_pool, v_pool, meta, mode=mode)
    three = decode_attention(q[:, 0], k_pool, v_pool, meta, mode=mode)
    np.testing.assert_array_equal(np.asarray(four[:, 0]), np.asarray(three))


def test_draft_mask_bits():
    mask = np.zeros((2, 32, 32), bool)
    mask[0, 3, [0, 3, 31]] = True
    mask[1] = np.tril(np.ones((32, 32), bool))
    bits = np.asarray(draft_mask_bits(mask)).view(np.uint32)
    assert bits[0, 3] == (1 | 8 | (1 << 31)) and bits[0, 0] == 0
    assert bits[1, 31] == 0xFFFFFFFF and bits[1, 4] == 0b11111
    with pytest.raises(ValueError, match="tokens <= 32"):
        draft_mask_bits(np.ones((33, 33), bool))


def test_bad_arguments_are_named(rng):
    q, k_pool, v_pool, meta = make_case(rng, 4, 2, 64, 64, 3, jnp.float32)
    with pytest.raises(ValueError, match="draft_mask must have shape"):
        decode_attention(q, k_pool, v_pool, meta, draft_mask=jnp.zeros((5, 4), jnp.int32))
    with pytest.raises(ValueError, match="draft_mask must have dtype"):
        decode_attention(q, k_pool, v_pool, meta, draft_mask=jnp.zeros((5, 3), jnp.float32))
    with pytest.raises(ValueError, match="draft_mask needs several query tokens"):
        decode_attention(q[:, 0], k_pool, v_pool, meta, draft_mask=jnp.zeros((5, 3), jnp.int32))
    with pytest.raises(ValueError, match="no sliding window"):
        decode_attention(q, k_pool, v_pool, meta, sliding_window=8)
    with pytest.raises(ValueError, match="no xai temperature"):
        decode_attention(q, k_pool, v_pool, meta, xai_temperature_len=4)
    with pytest.raises(ValueError, match=r"q.shape\[1\] \(query tokens per sequence\) must be in \[1, 32\]"):
        decode_attention(jnp.zeros((5, 33, 4, 64), jnp.float32), k_pool, v_pool, meta)
    with pytest.raises(ValueError, match="vector kernel"):
        decode_attention(q, k_pool, v_pool, meta, config=DecodeConfig(block_n=32, block_h=1), mode="interpret")


def test_inside_jit(rng):
    q, k_pool, v_pool, meta = make_case(rng, 4, 2, 64, 64, 3, jnp.float32)
    draft_mask = random_trees(rng, len(KV_LENS), 3)[0]
    step = jax.jit(lambda q, m, d: decode_attention(q, k_pool, v_pool, m, draft_mask=d, mode="interpret"))
    np.testing.assert_allclose(np.asarray(step(q, meta, draft_mask)),
                               np.asarray(decode_attention_reference(q, k_pool, v_pool, meta, draft_mask=draft_mask)),
                               **tolerance(jnp.float32))


def test_unsigned_draft_mask_is_read_bit_for_bit(rng):
    # u32 masks (bit 31 set, unused beyond the drafts) give the same result as their i32 bit pattern.
    q, k_pool, v_pool, meta = make_case(rng, 4, 2, 64, 64, 3, jnp.float32)
    bits = np.asarray(random_trees(rng, len(KV_LENS), 3)[0]).view(np.uint32) | np.uint32(1 << 31)
    unsigned = decode_attention(q, k_pool, v_pool, meta, draft_mask=jnp.asarray(bits), mode="interpret")
    signed = decode_attention(q, k_pool, v_pool, meta, draft_mask=jnp.asarray(bits.view(np.int32)), mode="interpret")
    np.testing.assert_array_equal(np.asarray(unsigned), np.asarray(signed))
    want = decode_attention_reference(q, k_pool, v_pool, meta, draft_mask=jnp.asarray(bits))
    np.testing.assert_allclose(np.asarray(unsigned), np.asarray(want), **tolerance(jnp.float32))
