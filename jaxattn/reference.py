"""Pure-jnp reference attention over the ragged paged layout: the oracle for every kernel, and the CPU fallback.

Layout (page size 1, SGLang's):
  * ``q [tokens, q_heads, qk_head_dim]``: the queries of all sequences, sequence b at rows
    ``qo_indptr[b]:qo_indptr[b+1]``.
  * ``k_pool [slots, kv_heads, qk_head_dim]``, ``v_pool [slots, kv_heads, v_head_dim]``: the KV pool.
  * ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``: the pool slots of *all* keys sequence b attends to, in
    position order, including the new tokens (their K/V already written to the pool).

Positions: the queries of a sequence are its last ``q_len`` tokens, so with ``prefix_len = kv_len - q_len``
query i sits at position ``prefix_len + i`` and key j at position j (both shifted by ``kv_start_pos[b]``
when the listed keys start later, e.g. a sliding-window list that dropped old keys).

Score pipeline (SGLang's order): ``s = (q . k) * sm_scale``; ``s = logit_cap * tanh(s / logit_cap)`` if
``logit_cap > 0``; ``s *= xai_reg(q_pos)`` if ``xai_temperature_len > 0``; then the mask. A key is visible when

  * causal: ``k_pos <= q_pos`` (ignored when a custom mask is given: the custom mask decides alone);
  * custom mask: ``custom_mask[mask_indptr[b] + i * kv_len + j]`` is true (row-major ``[q_len, kv_len]``
    per sequence, the columns being the listed keys);
  * draft mask (a tree over the queries, compact): with ``d = j - prefix_len``, key j is visible when ``d < 0``
    (before the queries' own keys) or bit d % 32 of word d // 32 of ``draft_mask[q_row]`` is set (replaces causal,
    as a custom mask does);
  * sliding window W >= 0: ``q_pos - k_pos <= W``, i.e. W + 1 keys including itself. jaxattn uses this one
    rule for decode too (SGLang's Triton decode keeps only W keys; FlashInfer and Triton extend keep W + 1).

Softmax in float32 with natural-log LSE. ``sinks [q_heads]`` add ``exp(sink_h)`` to the denominator only
(no value; not scaled). A query with no visible key (and no sink) gets output 0 and LSE -inf, never NaN.
The returned LSE is the log of the full denominator the output was normalised with (sink included).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.checks import check_attention_args, index_i32
from jaxattn.fp8 import dequantised_rows, kv_scale_table


def xai_temperature_scale(positions: jax.Array, xai_temperature_len: int) -> jax.Array:
    """Grok's attention temperature: log2(pos) / log2(L) for pos > L, else 1 (SGLang's decode and 2-stage extend)."""
    positions = positions.astype(jnp.float32)
    length = float(xai_temperature_len)
    scale = jnp.log2(jnp.maximum(positions, 1.0)) / math.log2(length)
    return jnp.where(positions > length, scale, 1.0)


def _static_max_len(indptr, given, name):
    if given is not None:
        return int(given)
    try:
        lengths = np.diff(np.asarray(indptr))
    except jax.errors.TracerArrayConversionError:
        raise ValueError(
            f"{name} must be given as a static int when the index arrays are traced (inside jit)"
        ) from None
    return max(int(lengths.max(initial=0)), 1)


def ragged_paged_attention_reference(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    qo_indptr: jax.Array,
    kv_indptr: jax.Array,
    kv_indices: jax.Array,
    *,
    causal: bool = True,
    custom_mask: jax.Array | None = None,
    mask_indptr: jax.Array | None = None,
    sliding_window: int = -1,
    logit_cap: float = 0.0,
    sinks: jax.Array | None = None,
    xai_temperature_len: int = -1,
    sm_scale: float | None = None,
    kv_start_pos: jax.Array | None = None,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
    return_lse: bool = False,
    kv_start_positions: jax.Array | None = None,
    k_scale=None,
    v_scale=None,
    draft_mask: jax.Array | None = None,
):
    """Attention of every query over its sequence's listed keys (see the module docstring for semantics).

    Args:
      q: [tokens, q_heads, qk_head_dim] f32/f16/bf16.
      k_pool: [slots, kv_heads, qk_head_dim]. v_pool: [slots, kv_heads, v_head_dim]. q_heads % kv_heads == 0;
        q head h reads kv head h // (q_heads // kv_heads).
      qo_indptr: i32[batch + 1]. kv_indptr: i32[batch + 1]. kv_indices: i32/i64[kv_capacity].
      causal, custom_mask (bool/uint8 flat), mask_indptr (i32/i64[batch + 1]), sliding_window, logit_cap,
        sinks (f32[q_heads]), xai_temperature_len: see the module docstring.
      sm_scale: default 1 / sqrt(qk_head_dim).
      kv_start_pos: optional i32[batch], the position of each sequence's first listed key (default 0);
        `kv_start_positions` is its old name.
      max_q_len, max_kv_len: static bounds on per-sequence lengths; required under jit, inferred otherwise.
      return_lse: also return the natural-log LSE.
      k_scale, v_scale: the pools hold K / k_scale and V / v_scale (fp8 pools, `jaxattn.fp8`): None (1), a float or
        a float array [] / [kv_heads]. Only the listed rows are scaled (in float32), never the whole pool.
      draft_mask: optional i32/u32[tokens] or [tokens, words]: per query row, bit d % 32 of word d // 32 = sees the
        d-th of its sequence's last q_len listed keys (its drafts; 32 * words of them at most; see the module
        docstring). Not with custom_mask.

    Returns:
      o: [tokens, q_heads, v_head_dim] in q's dtype (rows past qo_indptr[-1] are 0), and with return_lse
      f32[tokens, q_heads].
    """
    batch, group = check_attention_args(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, sinks, custom_mask, mask_indptr,
                                        sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale)
    tokens, q_heads, qk_dim = q.shape
    kv_heads, v_dim = v_pool.shape[1], v_pool.shape[2]
    if draft_mask is not None:
        if custom_mask is not None:
            raise ValueError("give custom_mask or draft_mask, not both")
        if draft_mask.ndim not in (1, 2) or draft_mask.shape[0] != tokens or draft_mask.dtype not in (jnp.int32, jnp.uint32):
            raise ValueError(f"draft_mask must be i32/u32[{tokens}] or [{tokens}, words] (bit masks per query row); got "
                             f"{draft_mask.dtype}{list(draft_mask.shape)}")
        draft_mask = draft_mask.reshape(tokens, -1)
    max_q_len = _static_max_len(qo_indptr, max_q_len, "max_q_len")
    max_kv_len = _static_max_len(kv_indptr, max_kv_len, "max_kv_len")
    sm_scale = 1.0 / math.sqrt(qk_dim) if sm_scale is None else float(sm_scale)
    qo_indptr = index_i32(qo_indptr)
    kv_indptr = index_i32(kv_indptr)
    if kv_start_positions is not None:
        if kv_start_pos is not None:
            raise ValueError("give kv_start_pos only (kv_start_positions is its old name)")
        kv_start_pos = kv_start_positions
    starts = jnp.zeros((batch,), jnp.int32) if kv_start_pos is None else index_i32(kv_start_pos)
    scales = kv_scale_table(k_scale, v_scale, kv_heads)  # f32[2, kv_heads] or None

    def one_sequence(b):
        q_start, q_len = qo_indptr[b], qo_indptr[b + 1] - qo_indptr[b]
        kv_start, kv_len = kv_indptr[b], kv_indptr[b + 1] - kv_indptr[b]
        i = jnp.arange(max_q_len)
        j = jnp.arange(max_kv_len)
        q_valid = i < q_len
        k_valid = j < kv_len
        q_rows = jnp.clip(q_start + i, 0, tokens - 1)
        slots = kv_indices[jnp.clip(kv_start + j, 0, kv_indices.shape[0] - 1)]  # outside the pool: slot 0
        qb = q[q_rows].astype(jnp.float32)  # [Q, Hq, D]
        # Rows past the list's end are zeroed: the slots there are arbitrary and may hold NaN (0 * NaN = NaN).
        kb = dequantised_rows(k_pool, slots, None if scales is None else scales[0], jnp.float32)  # [K, Hkv, D]
        vb = dequantised_rows(v_pool, slots, None if scales is None else scales[1], jnp.float32)  # [K, Hkv, Dv]
        kb = jnp.where(k_valid[:, None, None], kb, 0.0)
        vb = jnp.where(k_valid[:, None, None], vb, 0.0)
        qb = qb.reshape(max_q_len, kv_heads, group, qk_dim)
        s = jnp.einsum("qhgd,khd->hgqk", qb, kb, precision=jax.lax.Precision.HIGHEST) * sm_scale
        if logit_cap > 0:
            s = logit_cap * jnp.tanh(s / logit_cap)
        q_pos = starts[b] + kv_len - q_len + i  # [Q]
        k_pos = starts[b] + j  # [K]
        if xai_temperature_len > 0:
            s = s * xai_temperature_scale(q_pos, xai_temperature_len)[:, None]
        visible = q_valid[:, None] & k_valid[None, :]
        if custom_mask is not None:
            offsets = mask_indptr.astype(jnp.int64 if jax.config.jax_enable_x64 else jnp.int32)
            flat = offsets[b] + (i[:, None] * kv_len + j[None, :]).astype(offsets.dtype)
            flat = jnp.clip(flat, 0, custom_mask.shape[0] - 1)
            visible &= custom_mask[flat].astype(bool)
        elif draft_mask is not None:
            bits = draft_mask[q_rows].astype(jnp.uint32)  # [Q, words]
            words = bits.shape[1]
            draft = j - (kv_len - q_len)  # [K]: negative before the queries' own keys
            word = bits[:, jnp.clip(draft // 32, 0, words - 1)]  # [Q, K]
            bit = jnp.right_shift(word, (jnp.maximum(draft, 0) % 32).astype(jnp.uint32)[None, :]) & 1
            visible &= (draft < 0)[None, :] | ((draft < 32 * words)[None, :] & (bit != 0))
        elif causal:
            visible &= k_pos[None, :] <= q_pos[:, None]
        if sliding_window >= 0:
            visible &= q_pos[:, None] - k_pos[None, :] <= sliding_window
        s = jnp.where(visible, s, -jnp.inf)
        row_max = jnp.max(s, axis=-1, keepdims=True)  # [Hkv, G, Q, 1]
        if sinks is not None:
            sink = sinks.astype(jnp.float32).reshape(kv_heads, group)[:, :, None, None]
            row_max = jnp.maximum(row_max, sink)
        # An empty row's -inf max becomes 0 (its p are 0); +inf (an infinite sink or score) and NaN stay, so their
        # rows come out NaN as in the kernels.
        row_max = jnp.where(row_max == -jnp.inf, 0.0, row_max)
        p = jnp.exp(s - row_max)
        denominator = jnp.sum(p, axis=-1, keepdims=True)
        if sinks is not None:
            denominator = denominator + jnp.exp(sink - row_max)
        o = jnp.einsum("hgqk,khd->qhgd", p, vb, precision=jax.lax.Precision.HIGHEST)
        # Only an empty row (denominator exactly 0) gives 0 / -inf; a NaN denominator (NaN in q, a visible key, the
        # scale or a sink) stays NaN in the output, never a silent finite value.
        empty = denominator == 0
        safe = jnp.where(empty, 1.0, denominator)
        # An empty row's o is 0, or NaN where a masked key's V is NaN (p = 0 times NaN): 0 either way.
        o = jnp.where(jnp.transpose(empty, (2, 0, 1, 3)), 0.0, o / jnp.transpose(safe, (2, 0, 1, 3)))
        lse = jnp.where(empty, -jnp.inf, jnp.log(safe) + row_max)[..., 0]  # [Hkv, G, Q]
        return o.reshape(max_q_len, q_heads, v_dim), jnp.transpose(lse, (2, 0, 1)).reshape(max_q_len, q_heads)

    if batch == 0 or tokens == 0:  # nothing to attend with (or for): zeros, as the kernels give
        o = jnp.zeros((tokens, q_heads, v_dim), q.dtype)
        lse = jnp.full((tokens, q_heads), -jnp.inf, jnp.float32)
        return (o, lse) if return_lse else o
    o_seq, lse_seq = jax.lax.map(one_sequence, jnp.arange(batch))  # [B, Q, Hq, Dv], [B, Q, Hq]
    # Scatter the per-sequence rows back to token order.
    t = jnp.arange(tokens)
    seq = jnp.clip(jnp.searchsorted(qo_indptr, t, side="right") - 1, 0, batch - 1)
    row = t - qo_indptr[seq]
    used = (t < qo_indptr[-1]) & (t >= qo_indptr[0]) & (row < max_q_len)
    o = jnp.where(used[:, None, None], o_seq[seq, jnp.clip(row, 0, max_q_len - 1)], 0.0).astype(q.dtype)
    lse = jnp.where(used[:, None], lse_seq[seq, jnp.clip(row, 0, max_q_len - 1)], -jnp.inf)
    return (o, lse) if return_lse else o


def dense_causal_attention(q, k, v, *, sm_scale=None):
    """Plain causal attention of one contiguous sequence: q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, Dv].

    Independent of the paged layout; tests use it to check the paged reference itself.
    """
    n, q_heads, dim = q.shape
    kv_heads = k.shape[1]
    sm_scale = 1.0 / math.sqrt(dim) if sm_scale is None else sm_scale
    k = jnp.repeat(k.astype(jnp.float32), q_heads // kv_heads, axis=1)
    v = jnp.repeat(v.astype(jnp.float32), q_heads // kv_heads, axis=1)
    s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k, precision=jax.lax.Precision.HIGHEST) * sm_scale
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool))[None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("hqk,khd->qhd", p, v, precision=jax.lax.Precision.HIGHEST).astype(q.dtype)
