"""Device-resident inputs for one case: random normal q/K/V, every sequence's KV slots scattered over the pool."""

from __future__ import annotations

import dataclasses

import numpy as np

from .cases import Case


@dataclasses.dataclass
class Inputs:
    case: Case
    q: object  # jax [T, Hq, D]
    k_pool: object  # jax [S, Hkv, D]
    v_pool: object  # jax [S, Hkv, Dv]
    req_to_token: object  # jax i32[B, max_ctx]
    req_pool_indices: object  # jax i32[B]
    prefix_lens: object  # jax i32[B]
    seq_lens: object  # jax i32[B] (prefix + new)
    qo_indptr: object  # jax i32[B+1]
    kv_indptr: object  # jax i32[B+1] over whole sequences
    kv_indices: object  # jax i32[total]
    prefix_indptr: object
    prefix_indices: object
    new_slots: object  # jax i32[T]: the slots of the new tokens (out_cache_loc)
    k_new: object
    v_new: object
    sinks: object = None  # jax f32[Hq] when case.sinks
    k_scale: float | None = None  # fp8 pools: they hold K / k_scale and V / v_scale
    v_scale: float | None = None


def make_inputs(case: Case, seed: int = 0) -> Inputs:
    import jax
    import jax.numpy as jnp

    from jaxattn.fp8 import dequantised_rows

    rng = np.random.default_rng(seed)
    b, p, n = case.batch, case.prefix, case.new
    total = b * (p + n)
    num_slots = total + 1  # slot 0 is the padding slot
    slots = (rng.permutation(total) + 1).astype(np.int32).reshape(b, p + n)
    key = jax.random.key(seed)
    kq, kk, kv = jax.random.split(key, 3)
    dtype = jnp.bfloat16
    k_pool = jax.random.normal(kk, (num_slots, case.kv_heads, case.head_dim), dtype)
    if case.v_in_k:
        v_pool = k_pool[:, :, : case.dv]  # MLA: V is the first Dv dims of the latent K
    else:
        v_pool = jax.random.normal(kv, (num_slots, case.kv_heads, case.dv), dtype)
    k_scale = v_scale = None
    if case.fp8:
        # Stored as value / scale (what write_kv stores); the new tokens' bf16 K/V are the same rows dequantised.
        k_scale = v_scale = 0.5
        fmt = jnp.dtype(case.kv_dtype)
        k_pool = (k_pool.astype(jnp.float32) / k_scale).astype(fmt)
        v_pool = k_pool[:, :, : case.dv] if case.v_in_k else (v_pool.astype(jnp.float32) / v_scale).astype(fmt)
    q = jax.random.normal(kq, (b * n, case.q_heads, case.head_dim), dtype)
    seq_lens = np.full(b, p + n, np.int32)
    indptr = np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32)
    prefix_indptr = np.arange(b + 1, dtype=np.int32) * p
    new_slots = slots[:, p:].reshape(-1)
    to = jnp.asarray
    return Inputs(
        case=case,
        q=q,
        k_pool=k_pool,
        v_pool=v_pool,
        req_to_token=to(slots),
        req_pool_indices=to(np.arange(b, dtype=np.int32)),
        prefix_lens=to(np.full(b, p, np.int32)),
        seq_lens=to(seq_lens),
        qo_indptr=to(np.arange(b + 1, dtype=np.int32) * n),
        kv_indptr=to(indptr),
        kv_indices=to(slots.reshape(-1)),
        prefix_indptr=to(prefix_indptr),
        prefix_indices=to(slots[:, :p].reshape(-1)),
        new_slots=to(new_slots),
        k_new=dequantised_rows(k_pool, to(new_slots), k_scale, dtype),
        v_new=dequantised_rows(v_pool, to(new_slots), v_scale, dtype),
        # Near the rows' log-denominators (about 8-9 for ~4096 keys of N(0, 1) scores), so they change the output.
        sinks=to(rng.normal(8.0, 1.0, case.q_heads).astype(np.float32)) if case.sinks else None,
        k_scale=k_scale,
        v_scale=v_scale,
    )

