"""The per-layer KV pool and writes into it.

A layer's cache is two arrays, ``k_pool [slots, kv_heads, head_dim]`` and ``v_pool [slots, kv_heads,
v_head_dim]``. Slot 0 is reserved: padding tokens write there and no sequence lists it, so whatever lands
in it is harmless. Writes are functional (`.at[slots].set`) and happen in place when the step function
donates the buffers (``jax.jit(step, donate_argnames=...)``).

fp8 storage: buffers of dtype float8_e4m3fn / float8_e5m2 hold ``value / scale``; the kernels read them directly and
multiply back by the same scale (SGLang's per-layer k_scale / v_scale, or one per kv head: `jaxattn.fp8`).
"""

from __future__ import annotations


import jax.numpy as jnp
import numpy as np

from jaxattn.checks import FLOAT_DTYPES, INDEX_DTYPES, check_array, check_kv_scale, index_i32
from jaxattn.fp8 import FP8_DTYPES, in_pool, is_fp8, largest_finite, per_head_factor  # noqa: F401  (FP8_DTYPES, is_fp8 re-exported)

BUFFER_DTYPES = FLOAT_DTYPES + FP8_DTYPES


def allocate_kv_pool(num_slots: int, kv_heads: int, head_dim: int, v_head_dim: int | None = None, dtype=jnp.bfloat16):
    """Zeroed (k_pool, v_pool) for one layer; `num_slots` includes the padding slot 0."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    return jnp.zeros((num_slots, kv_heads, head_dim), dtype), jnp.zeros((num_slots, kv_heads, v_head_dim), dtype)


def write_kv(k_pool, v_pool, out_cache_loc, k, v, *, k_scale: float | None = None, v_scale: float | None = None):
    """Stores new tokens' K and V at their slots; returns the updated (k_pool, v_pool).

    Args:
      k_pool: [slots, kv_heads, head_dim]. v_pool: [slots, kv_heads, v_head_dim], or None for a latent (MLA) pool
        whose V is the first dims of each K row (then v must be None too, and None is returned in its place).
      out_cache_loc: i32[tokens], the slot of each token. Slot 0 is the padding slot: padding tokens write there,
        as often as they like. Slots outside ``[0, slots)`` (negative ones included) are dropped, never written
        elsewhere. Duplicates: when several tokens name one slot, that slot ends up holding, element by element,
        one of the values written to it (which one is unspecified and may differ between elements and between runs
        on a GPU); every other slot is exact. Real tokens must therefore not share a slot: checked mode
        (`check_write_slots`, `jaxattn.checked.validate_write_slots`) rejects repeats of any slot but 0.
      k: [tokens, kv_heads, head_dim]. v: [tokens, kv_heads, v_head_dim].
      k_scale, v_scale: for fp8 buffers, the stored value is ``k / k_scale`` (default 1; a float, or a float array []
        / [kv_heads] for per-head scales), saturated to the format's largest finite value (e4m3fn: 448, e5m2: 57344;
        +-inf saturate too), so no finite input is stored as inf or NaN; NaN stays NaN. 16-bit buffers ignore them.
    """
    check_array("k_pool", k_pool, ndim=3, dtypes=BUFFER_DTYPES, what="[slots, kv_heads, head_dim]")
    slots, kv_heads, head_dim = k_pool.shape
    latent = v_pool is None
    if latent != (v is None):
        raise ValueError("v_pool and v are None together (a latent pool: V is part of K) or neither")
    if not latent:
        check_array("v_pool", v_pool, shape=(slots, kv_heads, None), dtypes=BUFFER_DTYPES, what="[slots, kv_heads, v_head_dim]")
    check_array("out_cache_loc", out_cache_loc, ndim=1, dtypes=INDEX_DTYPES, what="[tokens]")
    tokens = out_cache_loc.shape[0]
    check_array("k", k, shape=(tokens, kv_heads, head_dim), dtypes=FLOAT_DTYPES, what="[tokens, kv_heads, head_dim]")
    if not latent:
        check_array("v", v, shape=(tokens, kv_heads, v_pool.shape[2]), dtypes=FLOAT_DTYPES, what="[tokens, kv_heads, v_head_dim]")
    check_kv_scale("k_scale", k_scale, kv_heads)
    check_kv_scale("v_scale", v_scale, kv_heads)
    if isinstance(out_cache_loc, np.ndarray):
        # A host array is narrowed to int32 on its way to the device (64-bit ints need jax_enable_x64): an
        # out-of-range slot becomes -1 first (dropped), so 2**32 + 3 cannot wrap onto slot 3.
        in_pool = (out_cache_loc >= 0) & (out_cache_loc < slots)
        out_cache_loc = np.where(in_pool, out_cache_loc, -1).astype(np.int32)
    # wrap_negative_indices=False: a negative slot is out of range and dropped (NumPy-style wrapping would write
    # slot -1 into the last slot of the pool).
    k = _quantised(k, k_pool.dtype, k_scale)
    k_pool = k_pool.at[out_cache_loc].set(k.astype(k_pool.dtype), mode="drop", wrap_negative_indices=False)
    if latent:
        return k_pool, None
    v = _quantised(v, v_pool.dtype, v_scale)
    v_pool = v_pool.at[out_cache_loc].set(v.astype(v_pool.dtype), mode="drop", wrap_negative_indices=False)
    return k_pool, v_pool


def move_kv(k_pool, v_pool, src, dst):
    """Copies the K/V rows of slots `src` into slots `dst` (pairwise); returns the updated (k_pool, v_pool).

    For a draft tree's accepted branch with pages (`RequestTable.accept_drafts_by_copy`, SGLang's move_kv_cache): every
    source row is read before any row is written, so a slot may be both a destination and a later pair's source. The
    rows move as stored (an fp8 pool's bytes keep their layer scales). Jittable; pad both lists to a static bucket
    with 0 (slot 0 onto itself: the padding slot, harmless).

    Args:
      k_pool: [slots, kv_heads, head_dim]. v_pool: [slots, kv_heads, v_head_dim], or None for a latent (MLA) pool
        (then None is returned in its place).
      src, dst: int[moves]. A source outside ``[1, slots)`` reads the padding slot 0 (`jaxattn.fp8.in_pool`, the
        kernels' rule); a destination outside ``[0, slots)`` is dropped. Destinations other than 0 must be distinct
        (as `write_kv`'s slots).
    """
    check_array("k_pool", k_pool, ndim=3, dtypes=BUFFER_DTYPES, what="[slots, kv_heads, head_dim]")
    slots = k_pool.shape[0]
    if v_pool is not None:
        check_array("v_pool", v_pool, shape=(slots, k_pool.shape[1], None), dtypes=BUFFER_DTYPES,
                    what="[slots, kv_heads, v_head_dim]")
    check_array("src", src, ndim=1, dtypes=INDEX_DTYPES, what="[moves]")
    check_array("dst", dst, shape=src.shape, dtypes=INDEX_DTYPES, what="[moves] (as src)")
    src = jnp.where(in_pool(src, slots), src, 0)
    dst = jnp.where((dst >= 0) & (dst < slots), dst, -1)  # no int32 narrowing first: 2**32 + 3 stays out of range
    src, dst = index_i32(src), index_i32(dst)

    def moved(pool):
        return pool.at[dst].set(pool[src], mode="drop", wrap_negative_indices=False)

    return moved(k_pool), None if v_pool is None else moved(v_pool)


def _quantised(x, dtype, scale):
    """x as stored in a pool of `dtype`: fp8 pools hold x / scale, saturated to the format's finite range."""
    if not is_fp8(dtype):
        return x
    largest = largest_finite(dtype)
    return jnp.clip(x.astype(jnp.float32) / per_head_factor(1.0 if scale is None else scale), -largest, largest)


def read_scaled(buffer, scale: float | None, dtype):
    """The whole pool as `dtype` values: fp8 buffers are multiplied back by their scale (for inspection and tests; the
    kernels and backends read fp8 pools directly)."""
    if is_fp8(buffer.dtype):
        return (buffer.astype(jnp.float32) * (1.0 if scale is None else scale)).astype(dtype)
    return buffer


def check_write_slots(out_cache_loc, num_slots: int):
    """Run-time check (checkify) that real slots are in range and distinct; slot 0 may repeat."""
    from jax.experimental import checkify

    loc = index_i32(out_cache_loc)
    checkify.check(jnp.all((loc >= 0) & (loc < num_slots)), "out_cache_loc has a slot outside [0, {n})", n=jnp.int32(num_slots))
    ordered = jnp.sort(loc)
    repeated = (ordered[1:] == ordered[:-1]) & (ordered[1:] != 0)
    if repeated.size == 0:
        return
    slot = ordered[1:][jnp.argmax(repeated)]
    checkify.check(~jnp.any(repeated), "out_cache_loc names slot {s} twice (only the padding slot 0 may repeat)", s=slot)


allocate_kv_buffers = allocate_kv_pool  # its earlier name
