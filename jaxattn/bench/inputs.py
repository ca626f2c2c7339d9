"""Device-resident inputs for one case: random normal q/K/V, every sequence's KV slots scattered over the pool.

Page size 1 (the default) scatters every token's slot. A paged case (`Case.page_size` P > 1) lays the same tokens out
in pages (`jaxattn.paging`: page p holds slots [p * P, (p + 1) * P), page 0 is padding): each sequence's pages are
scattered at random over the pool, its tokens contiguous within a page, the last page partly filled when the length
is not a multiple of P. Every token keeps the K/V, and q, sinks and scales are the same, as at page size 1, so a
paged case computes exactly the page-1 case's attention.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .cases import Case, draft_tree


@dataclasses.dataclass
class Inputs:
    case: Case
    q: object  # jax [T, Hq, D]
    k_pool: object  # jax [S, Hkv, D]
    v_pool: object  # jax [S, Hkv, Dv]
    req_to_token: object  # jax i32[B, max_ctx]: every token's slot (paged: the page table's page-1 equivalent)
    req_to_page: object  # jax i32[B, pages per sequence]: page ids (page size 1: req_to_token)
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
    custom_mask: object = None  # jax bool[B * new * (prefix + new)] when case.tree: per sequence [new, prefix + new]
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
    v_pool = None if case.v_in_k else jax.random.normal(kv, (num_slots, case.kv_heads, case.dv), dtype)
    req_to_page = slots  # page size 1: a page is a slot
    if case.page_size > 1:
        req_to_page, paged_slots, num_slots = page_aligned_slots(case, seed)
        k_pool = move_rows(k_pool, slots, paged_slots, num_slots)  # each token keeps its page-1 K/V
        v_pool = None if v_pool is None else move_rows(v_pool, slots, paged_slots, num_slots)
        slots = paged_slots
    if case.v_in_k:
        v_pool = k_pool[:, :, : case.dv]  # MLA: V is the first Dv dims of the latent K
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
        req_to_page=to(req_to_page),
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
        custom_mask=to(verify_mask(case)) if case.tree else None,
    )


def verify_mask(case: Case) -> np.ndarray:
    """bool[B * new * (prefix + new)]: each sequence's [new, prefix + new] rows, the prefix visible, then
    `draft_tree` over the new tokens."""
    rows = np.concatenate([np.ones((case.new, case.prefix), bool), draft_tree(case.new)], axis=1)
    return np.tile(rows.reshape(-1), case.batch)


def page_aligned_slots(case: Case, seed: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """A paged case's layout: (req_to_page i32[B, pages per sequence], slots i32[B, prefix + new], num_slots).

    The pages 1 .. B * pages per sequence, in random order (page 0 is padding); each token's slot is
    `jaxattn.paging.req_to_token_from_pages` of them; the pool has num_slots = (B * pages per sequence + 1) *
    page_size rows. Its own random stream, so the page-1 draws (slots, sinks) stay as they are.
    """
    import jax.numpy as jnp

    from jaxattn.paging import req_to_token_from_pages

    length, page_size = case.prefix + case.new, case.page_size
    pages_per_sequence = -(-length // page_size)
    num_pages = case.batch * pages_per_sequence
    req_to_page = (np.random.default_rng((seed, page_size)).permutation(num_pages) + 1).astype(np.int32)
    req_to_page = req_to_page.reshape(case.batch, pages_per_sequence)
    num_slots = (num_pages + 1) * page_size
    slots = req_to_token_from_pages(jnp.asarray(req_to_page), page_size, length, num_slots=num_slots)
    return req_to_page, np.asarray(slots), num_slots


def move_rows(pool, slots: np.ndarray, new_slots: np.ndarray, num_slots: int):
    """A pool of `num_slots` rows holding row slots[i] of `pool` at new_slots[i] (zeros elsewhere: rows no token owns)."""
    import jax.numpy as jnp

    moved = jnp.zeros((num_slots,) + pool.shape[1:], pool.dtype)
    return moved.at[jnp.asarray(new_slots.reshape(-1))].set(pool[jnp.asarray(slots.reshape(-1))])
