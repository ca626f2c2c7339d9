"""The reference attention checked against independent dense and brute-force computations."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.reference import dense_causal_attention, ragged_paged_attention_reference, xai_temperature_scale
from tests.helpers import random_normal, random_pool_batch


def brute_force(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, *, causal=True, window=-1, cap=0.0, sinks=None,
                mask=None, mask_indptr=None, xai_len=-1, sm_scale=None):
    """A per-query numpy loop, written from the docstring's rules without reusing the reference's code."""
    q, k_pool, v_pool = (np.asarray(x, np.float64) for x in (q, k_pool, v_pool))
    tokens, hq, d = q.shape
    hkv = k_pool.shape[1]
    sm_scale = 1 / math.sqrt(d) if sm_scale is None else sm_scale
    out = np.zeros((tokens, hq, v_pool.shape[2]))
    lse = np.full((tokens, hq), -np.inf)
    for b in range(len(qo_indptr) - 1):
        qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
        ks, ke = int(kv_indptr[b]), int(kv_indptr[b + 1])
        q_len, kv_len = qe - qs, ke - ks
        slots = np.asarray(kv_indices[ks:ke])
        for i in range(q_len):
            q_pos = kv_len - q_len + i
            for h in range(hq):
                kh = h // (hq // hkv)
                logits, values = [], []
                for j in range(kv_len):
                    if mask is not None:
                        if not mask[int(mask_indptr[b]) + i * kv_len + j]:
                            continue
                    elif causal and j > q_pos:
                        continue
                    if window >= 0 and q_pos - j > window:
                        continue
                    s = float(q[qs + i, h] @ k_pool[slots[j], kh]) * sm_scale
                    if cap > 0:
                        s = cap * math.tanh(s / cap)
                    if xai_len > 0 and q_pos > xai_len:
                        s *= math.log2(q_pos) / math.log2(xai_len)
                    logits.append(s)
                    values.append(v_pool[slots[j], kh])
                extra = [] if sinks is None else [float(sinks[h])]
                if not logits and not extra:
                    continue
                m = max(logits + extra)
                w = np.exp(np.array(logits) - m) if logits else np.zeros(0)
                den = w.sum() + sum(math.exp(e - m) for e in extra)
                if logits:
                    out[qs + i, h] = (w[:, None] * np.array(values)).sum(0) / den
                lse[qs + i, h] = m + math.log(den)
    return out, lse


def test_matches_dense_causal_attention_on_contiguous_sequences(rng):
    lens = [5, 17, 1]
    hq, hkv, d = 4, 2, 16
    indptr, indices, slots = random_pool_batch(rng, lens)
    k_pool = random_normal(rng, (slots, hkv, d), jnp.float32)
    v_pool = random_normal(rng, (slots, hkv, d), jnp.float32)
    q = random_normal(rng, (sum(lens), hq, d), jnp.float32)
    out = ragged_paged_attention_reference(q, k_pool, v_pool, indptr, indptr, indices)
    for b, n in enumerate(lens):
        s, e = int(indptr[b]), int(indptr[b + 1])
        sl = indices[s:e]
        dense = dense_causal_attention(q[s:e], k_pool[sl], v_pool[sl])
        np.testing.assert_allclose(out[s:e], dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "features",
    [
        dict(),
        dict(window=3),
        dict(cap=5.0),
        dict(sinks=True),
        dict(xai_len=4),
        dict(causal=False),
        dict(mask=True),
        dict(mask=True, window=2, cap=2.0, sinks=True),
    ],
    ids=lambda f: "-".join(f"{k}" for k in f) or "plain",
)
def test_matches_brute_force(rng, features):
    q_lens = [3, 1, 6, 0]
    prefix = [4, 9, 0, 5]
    kv_lens = [a + b for a, b in zip(q_lens, prefix)]
    hq, hkv, d, dv = 4, 1, 8, 12
    kv_indptr, kv_indices, slots = random_pool_batch(rng, kv_lens)
    qo_indptr = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
    k_pool = random_normal(rng, (slots, hkv, d), jnp.float32, 2.0)
    v_pool = random_normal(rng, (slots, hkv, dv), jnp.float32)
    q = random_normal(rng, (sum(q_lens) + 2, hq, d), jnp.float32, 2.0)  # 2 padding rows
    sinks = random_normal(rng, (hq,), jnp.float32) if features.get("sinks") else None
    mask = mask_indptr = None
    if features.get("mask"):
        sizes = [a * b for a, b in zip(q_lens, kv_lens)]
        mask = rng.random(sum(sizes)) < 0.6
        mask_indptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    causal = features.get("causal", True)
    window, cap, xai_len = features.get("window", -1), features.get("cap", 0.0), features.get("xai_len", -1)
    out, lse = ragged_paged_attention_reference(
        q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, causal=causal, sliding_window=window, logit_cap=cap,
        sinks=sinks, custom_mask=None if mask is None else jnp.asarray(mask),
        mask_indptr=None if mask is None else jnp.asarray(mask_indptr), xai_temperature_len=xai_len, return_lse=True,
    )
    want, want_lse = brute_force(
        q, k_pool, v_pool, np.asarray(qo_indptr), np.asarray(kv_indptr), np.asarray(kv_indices), causal=causal,
        window=window, cap=cap, sinks=None if sinks is None else np.asarray(sinks), mask=mask, mask_indptr=mask_indptr,
        xai_len=xai_len,
    )
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=2e-5)
    assert np.isfinite(np.asarray(out)).all()


def test_fully_masked_rows_and_padding_give_zeros_not_nan(rng):
    hq, d = 2, 8
    kv_indptr, kv_indices, slots = random_pool_batch(rng, [4, 0])
    qo_indptr = jnp.asarray([0, 2, 2], jnp.int32)
    k_pool = random_normal(rng, (slots, 1, d), jnp.float32)
    v_pool = random_normal(rng, (slots, 1, d), jnp.float32)
    q = random_normal(rng, (3, hq, d), jnp.float32)
    mask = jnp.zeros((2 * 4,), bool)  # no key visible
    out, lse = ragged_paged_attention_reference(
        q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, custom_mask=mask, mask_indptr=jnp.asarray([0, 8, 8]),
        return_lse=True,
    )
    assert np.array_equal(np.asarray(out), np.zeros_like(out))
    assert np.all(np.asarray(lse) == -np.inf)


def test_jit_needs_static_lengths_and_then_matches_eager(rng):
    kv_indptr, kv_indices, slots = random_pool_batch(rng, [3, 7])
    k_pool = random_normal(rng, (slots, 2, 8), jnp.bfloat16)
    v_pool = random_normal(rng, (slots, 2, 8), jnp.bfloat16)
    q = random_normal(rng, (10, 4, 8), jnp.bfloat16)
    eager = ragged_paged_attention_reference(q, k_pool, v_pool, kv_indptr, kv_indptr, kv_indices)
    with pytest.raises(ValueError, match="max_q_len"):
        jax.jit(ragged_paged_attention_reference)(q, k_pool, v_pool, kv_indptr, kv_indptr, kv_indices)
    jitted = jax.jit(lambda *a: ragged_paged_attention_reference(*a, max_q_len=8, max_kv_len=8))(
        q, k_pool, v_pool, kv_indptr, kv_indptr, kv_indices
    )
    assert eager.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.float32(eager), np.float32(jitted))


def test_rejects_bad_shapes_with_named_arguments(rng):
    q = jnp.zeros((4, 6, 8))
    k = jnp.zeros((10, 4, 8))
    indptr = jnp.asarray([0, 4], jnp.int32)
    with pytest.raises(ValueError, match=r"q_heads \(6, q.shape\[1\]\) must be a multiple of kv_heads"):
        ragged_paged_attention_reference(q, k, k, indptr, indptr, jnp.arange(4, dtype=jnp.int32))
    with pytest.raises(ValueError, match="v_pool must have shape"):
        ragged_paged_attention_reference(q[:, :4], k, k[:5], indptr, indptr, jnp.arange(4, dtype=jnp.int32))
    with pytest.raises(ValueError, match="kv_indices must have dtype int32/int64"):
        ragged_paged_attention_reference(q[:, :4], k, k, indptr, indptr, jnp.arange(4, dtype=jnp.float32))


def test_xai_scale_is_one_up_to_the_length_then_log_ratio():
    scale = xai_temperature_scale(jnp.asarray([0, 5, 8, 64]), 8)
    np.testing.assert_allclose(scale, [1.0, 1.0, 1.0, 2.0], rtol=1e-6)
