"""Big pools: slot x row stride past 2^31 elements, so a kernel that forms `slot * stride` in int32 reads the wrong
row (or faults). On the H200: 2.2M slots x 8 kv heads x 128 dims (2.25e9 elements, 4.5 GB per bf16 pool; K and V:
9 GB), with the touched slots scattered over the top of the pool, above 2^31 / 1024 = 2,097,152.

Only a few hundred slots are written (random values; every other slot is NaN, so a stray read shows). The
reference runs on a compact copy of the touched rows with remapped indices, so it never indexes the big pool itself.
The same checks run on CPU (interpreter) with a small pool, to keep the test code honest; the big-pool runs are
marked `gpu`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.decode import decode_attention, decode_attention_reference, decode_metadata_from_indptr
from jaxattn.extend import (
    extend_attention,
    extend_attention_reference,
    extend_attention_unified,
    extend_attention_unified_reference,
    extend_metadata,
    extend_unified_metadata,
)
from jaxattn.kv_pool import write_kv
from tests.helpers import HAS_GPU, tolerance

BIG = dict(num_slots=2_200_000, kv_heads=8, head_dim=128, q_heads=32, dtype=jnp.bfloat16, mode="gpu")
SMALL = dict(num_slots=3_000, kv_heads=2, head_dim=32, q_heads=4, dtype=jnp.bfloat16, mode="interpret")
gpu_only = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU (9 GB of pools)")]
SIZES = [pytest.param(SMALL, id="small-interpret"), pytest.param(BIG, id="2.2M-slots-gpu", marks=gpu_only)]


def top_slots(rng, num_slots, n, kv_heads, head_dim, low=4):
    """n distinct slots: `low` of them near the bottom, the rest in the top 100k slots (above 2^31 elements on BIG)."""
    top = rng.choice(np.arange(max(1, num_slots - 100_000), num_slots), n - low, replace=False)
    bottom = rng.choice(np.arange(1, 64), low, replace=False)
    slots = rng.permutation(np.concatenate([top, bottom])).astype(np.int32)
    if num_slots >= 2_000_000:
        assert int(top.max()) * kv_heads * head_dim >= 2**31 and int(top.min()) * kv_heads * head_dim >= 2**31
    return slots


def big_pools(num_slots, kv_heads, head_dim, dtype, slots, k_rows, v_rows):
    """NaN pools with the given rows written at `slots` (donated: no second 4.5 GB copy)."""
    write = jax.jit(write_kv, donate_argnums=(0, 1))
    k = jnp.full((num_slots, kv_heads, head_dim), jnp.nan, dtype)
    v = jnp.full((num_slots, kv_heads, head_dim), jnp.nan, dtype)
    return write(k, v, jnp.asarray(slots), k_rows, v_rows)


def compact(slots, k_rows, v_rows):
    """The touched rows as a small pool (row 0 a zero padding row) and the slot -> row map."""
    remap = {int(s): i + 1 for i, s in enumerate(slots)}
    pad = lambda x: jnp.concatenate([jnp.zeros_like(x[:1]), x])  # noqa: E731
    return pad(k_rows), pad(v_rows), lambda idx: np.asarray([remap.get(int(s), 0) for s in np.asarray(idx)], np.int32)


@pytest.mark.parametrize("size", SIZES)
def test_decode_big_pool(rng, size):
    n_slots, hkv, d, hq, dtype, mode = (size[k] for k in ("num_slots", "kv_heads", "head_dim", "q_heads", "dtype", "mode"))
    kv_lens = [40, 1, 0, 150]
    total = sum(kv_lens)
    slots = top_slots(rng, n_slots, total, hkv, d)
    k_rows = jnp.asarray(rng.standard_normal((total, hkv, d)), dtype)
    v_rows = jnp.asarray(rng.standard_normal((total, hkv, d)), dtype)
    k_pool, v_pool = big_pools(n_slots, hkv, d, dtype, slots, k_rows, v_rows)
    q = jnp.asarray(rng.standard_normal((len(kv_lens), hq, d)), dtype)
    kv_indptr = jnp.asarray(np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32))
    kw = dict(q_heads=hq, kv_heads=hkv, max_kv_splits=4, min_split_len=32, programs_per_sm=10**6)
    meta = decode_metadata_from_indptr(kv_indptr, jnp.asarray(slots), **kw)
    o, lse = decode_attention(q, k_pool, v_pool, meta, sinks=jnp.ones((hq,)), logit_cap=30.0, return_lse=True, mode=mode)
    k_small, v_small, remap = compact(slots, k_rows, v_rows)
    meta_small = decode_metadata_from_indptr(kv_indptr, jnp.asarray(remap(slots)), **kw)
    ref_o, ref_lse = decode_attention_reference(q, k_small, v_small, meta_small, sinks=jnp.ones((hq,)), logit_cap=30.0, return_lse=True)
    assert np.isfinite(np.asarray(o, np.float32)).all()
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(ref_o, np.float32), **tolerance(dtype))
    np.testing.assert_allclose(lse, ref_lse, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("size", SIZES)
def test_extend_big_pool(rng, size):
    n_slots, hkv, d, hq, dtype, mode = (size[k] for k in ("num_slots", "kv_heads", "head_dim", "q_heads", "dtype", "mode"))
    prefix, extend = np.asarray([70, 0, 33], np.int32), np.asarray([20, 9, 16], np.int32)
    seq = prefix + extend
    slots = top_slots(rng, n_slots, int(seq.sum()), hkv, d)
    max_ctx = int(seq.max()) + 2
    table = np.zeros((4, max_ctx), np.int32)
    rows = np.asarray([2, 0, 3], np.int32)
    loc, offset = [], 0
    for b in range(3):
        table[rows[b], : seq[b]] = slots[offset : offset + seq[b]]
        loc.append(slots[offset + prefix[b] : offset + seq[b]])
        offset += seq[b]
    loc = np.concatenate(loc)
    tokens = int(extend.sum())
    k_rows = jnp.asarray(rng.standard_normal((len(slots), hkv, d)), dtype)
    v_rows = jnp.asarray(rng.standard_normal((len(slots), hkv, d)), dtype)
    k_pool, v_pool = big_pools(n_slots, hkv, d, dtype, slots, k_rows, v_rows)  # prefix and new tokens all in the pool
    new_rows = np.asarray([int(np.where(slots == s)[0][0]) for s in loc])
    k_new, v_new = k_rows[new_rows], v_rows[new_rows]
    q = jnp.asarray(rng.standard_normal((tokens, hq, d)), dtype)
    args = (jnp.asarray(table), jnp.asarray(rows), jnp.asarray(prefix), jnp.asarray(extend))
    cap = int(seq.sum())
    meta = extend_metadata(*args, max_extend_len=16 * 2, kv_capacity=cap, mode=mode)
    meta_u = extend_unified_metadata(*args, jnp.asarray(loc), max_extend_len=32, kv_capacity=cap, mode=mode)
    assert int(np.asarray(meta.kv_indices).max()) >= n_slots - 100_000  # the kernels are handed top slots
    o_two = extend_attention(q, k_new, v_new, k_pool, v_pool, meta, mode=mode)  # on an H200: the Mosaic GPU kernel
    o_triton = extend_attention(q, k_new, v_new, k_pool, v_pool, meta, mode=mode, impl="triton")
    o_uni = extend_attention_unified(q, k_pool, v_pool, meta_u, mode=mode)

    k_small, v_small, remap = compact(slots, k_rows, v_rows)
    small_table = jnp.asarray(remap(table.reshape(-1)).reshape(table.shape))
    small_args = (small_table,) + args[1:]
    ref_meta = extend_metadata(*small_args, max_extend_len=32, kv_capacity=cap)
    ref_meta_u = extend_unified_metadata(*small_args, jnp.asarray(remap(loc)), max_extend_len=32, kv_capacity=cap)
    ref_two = extend_attention_reference(q, k_new, v_new, k_small, v_small, ref_meta)
    ref_uni = extend_attention_unified_reference(q, k_small, v_small, ref_meta_u)
    for o, ref in ((o_two, ref_two), (o_triton, ref_two), (o_uni, ref_uni)):
        assert np.isfinite(np.asarray(o, np.float32)).all()
        np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(ref, np.float32), **tolerance(dtype))
