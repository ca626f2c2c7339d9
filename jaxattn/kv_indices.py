"""Building CSR KV-index lists inside jit: `create_kv_indices` and `build_unified_kv_indices`.

Page size is 1: a KV index is a token slot of the pool `[slots, kv_heads, head_dim]`. Index lists
have a static `capacity`; entries past the real total are slot 0 (SGLang's padding slot), and a
total larger than `capacity` is truncated, never written past the end.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxattn.checks import (
    index_i32,
    INDEX_DTYPES,
    check_array,
    check_index_dtype,
    check_kv_list_args,
    check_positive_int,
    launch_mode_argument,
)
from jaxattn.aot import build
from jaxattn.launch import launch

_COPY_BLOCK = 512


def exclusive_cumsum(lengths: jax.Array, dtype=jnp.int32) -> jax.Array:
    """[n] -> dtype[n + 1]: 0 followed by the running totals (a CSR indptr)."""
    return jnp.concatenate([jnp.zeros((1,), dtype), jnp.cumsum(lengths.astype(dtype), dtype=dtype)])


def _check_create_args(req_to_token, req_pool_indices, kv_lens, kv_starts):
    check_array("req_to_token", req_to_token, ndim=2, dtypes=INDEX_DTYPES, what="[max_reqs, max_context_len]")
    check_kv_list_args(req_pool_indices, kv_lens, kv_starts)


@functools.partial(jax.jit, static_argnames=("capacity", "index_dtype", "launch_mode", "mode"))
def create_kv_indices(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    kv_lens: jax.Array,
    kv_starts: jax.Array | None = None,
    *,
    capacity: int,
    index_dtype=jnp.int32,
    launch_mode: str | None = None,
    mode: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Lists the KV slots of each sequence, one sequence after the other (SGLang's
    create_flashinfer_kv_indices_triton).

    Args:
      req_to_token: i32[max_reqs, max_context_len]. Row r holds the pool slot of every token of request row r.
      req_pool_indices: i32[batch]. The req_to_token row of each sequence.
      kv_lens: i32[batch]. How many tokens to list per sequence (0 for padding entries).
      kv_starts: optional i32[batch]. First token position per sequence (default 0): the start of a
        sliding window, or the number of encoder tokens stored before the decoder tokens.
      capacity: static length of `kv_indices`; at least the largest total the batch can have.
      index_dtype: int32 (default) or int64.
      launch_mode: "gpu", "interpret" or None (automatic, see `jaxattn.launch.launch_mode`); `mode` is its old name.

    Returns:
      kv_indptr: i32[batch + 1], exclusive cumsum of `kv_lens`.
      kv_indices: index_dtype[capacity]. Slots of sequence b at `kv_indptr[b]:kv_indptr[b+1]`; the rest is 0.
        Rows outside req_to_token and positions outside `[0, max_context_len)` give slot 0.
    """
    _check_create_args(req_to_token, req_pool_indices, kv_lens, kv_starts)
    check_positive_int("capacity", capacity)
    check_index_dtype("index_dtype", index_dtype)
    batch = req_pool_indices.shape[0]
    max_reqs, max_ctx = req_to_token.shape
    kv_lens = jnp.maximum(index_i32(kv_lens), 0)
    kv_starts = jnp.zeros((batch,), jnp.int32) if kv_starts is None else index_i32(kv_starts)
    kv_indptr = exclusive_cumsum(kv_lens)
    if batch == 0:
        return kv_indptr, jnp.zeros((capacity,), index_dtype)
    kv_indices = launch(
        ("kv_indices", "create_kv_indices_kernel"),
        index_i32(req_to_token),
        index_i32(req_pool_indices),
        kv_lens,
        kv_starts,
        kv_indptr,
        out_shape=jax.ShapeDtypeStruct((capacity,), index_dtype),
        grid=(batch,),
        zeroed_outputs=(0,),
        mode=launch_mode_argument(launch_mode, mode),
        MAX_REQS=max_reqs,
        MAX_CTX=max_ctx,
        CAPACITY=capacity,
        BLOCK=_COPY_BLOCK,
    )
    return kv_indptr, kv_indices


def create_kv_indices_reference(req_to_token, req_pool_indices, kv_lens, kv_starts=None, *, capacity, index_dtype=jnp.int32):
    """Pure-jnp twin of `create_kv_indices` (same arguments and results)."""
    _check_create_args(req_to_token, req_pool_indices, kv_lens, kv_starts)
    batch = req_pool_indices.shape[0]
    max_reqs, max_ctx = req_to_token.shape
    kv_lens = jnp.maximum(index_i32(kv_lens), 0)
    kv_starts = jnp.zeros((batch,), jnp.int32) if kv_starts is None else index_i32(kv_starts)
    kv_indptr = exclusive_cumsum(kv_lens)
    out_pos = jnp.arange(capacity, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(kv_indptr, out_pos, side="right") - 1, 0, max(batch - 1, 0))
    used = out_pos < kv_indptr[-1]
    if batch == 0:
        return kv_indptr, jnp.zeros((capacity,), index_dtype)
    pos = kv_starts[seq] + out_pos - kv_indptr[seq]
    req = req_pool_indices[seq]
    ok = used & (req >= 0) & (req < max_reqs) & (pos >= 0) & (pos < max_ctx)
    slots = req_to_token[jnp.clip(req, 0, max_reqs - 1), jnp.clip(pos, 0, max_ctx - 1)]
    return kv_indptr, jnp.where(ok, slots, 0).astype(index_dtype)


def _check_unified_args(prefix_kv_indptr, prefix_kv_indices, extend_start_loc, extend_seq_lens, extend_kv_indices):
    check_array("prefix_kv_indptr", prefix_kv_indptr, ndim=1, dtypes=INDEX_DTYPES, what="[batch + 1]")
    batch = prefix_kv_indptr.shape[0] - 1
    check_array("prefix_kv_indices", prefix_kv_indices, ndim=1, dtypes=INDEX_DTYPES, what="[prefix_capacity]")
    check_array("extend_seq_lens", extend_seq_lens, shape=(batch,), dtypes=INDEX_DTYPES, what="[batch]")
    if extend_start_loc is not None:
        check_array("extend_start_loc", extend_start_loc, shape=(batch,), dtypes=INDEX_DTYPES, what="[batch]")
    check_array("extend_kv_indices", extend_kv_indices, ndim=1, dtypes=INDEX_DTYPES, what="[extend_tokens]")
    return batch


@functools.partial(jax.jit, static_argnames=("capacity", "index_dtype", "launch_mode", "mode"))
def build_unified_kv_indices(
    prefix_kv_indptr: jax.Array,
    prefix_kv_indices: jax.Array,
    extend_start_loc: jax.Array | None,
    extend_seq_lens: jax.Array,
    extend_kv_indices: jax.Array,
    *,
    capacity: int | None = None,
    index_dtype=jnp.int32,
    launch_mode: str | None = None,
    mode: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Joins each sequence's cached-prefix slots and new-token slots into one CSR list, the input of
    the deterministic unified extend kernel (seed 000's build_unified_kv_indices).

    Args:
      prefix_kv_indptr: i32[batch + 1]. CSR of the cached prefixes.
      prefix_kv_indices: [prefix_capacity]. Prefix slots.
      extend_start_loc: optional i32[batch]. Where each sequence's new tokens start in
        `extend_kv_indices` (default: exclusive cumsum of `extend_seq_lens`).
      extend_seq_lens: i32[batch]. New tokens per sequence.
      extend_kv_indices: [extend_tokens]. Slots of the new tokens (out_cache_loc).
      capacity: static length of the result (default: prefix_capacity + extend_tokens).

    Returns:
      unified_kv_indptr: i32[batch + 1], exclusive cumsum of prefix_lens + extend_seq_lens.
      unified_kv_indices: index_dtype[capacity]: per sequence its prefix slots, then its new slots; 0 after the total.
      prefix_lens: i32[batch].
    """
    batch = _check_unified_args(prefix_kv_indptr, prefix_kv_indices, extend_start_loc, extend_seq_lens, extend_kv_indices)
    if capacity is None:
        capacity = prefix_kv_indices.shape[0] + extend_kv_indices.shape[0]
    check_positive_int("capacity", capacity)
    check_index_dtype("index_dtype", index_dtype)
    prefix_kv_indptr = index_i32(prefix_kv_indptr)
    extend_seq_lens = jnp.maximum(index_i32(extend_seq_lens), 0)
    if extend_start_loc is None:
        extend_start_loc = exclusive_cumsum(extend_seq_lens)[:-1]
    prefix_lens = prefix_kv_indptr[1:] - prefix_kv_indptr[:-1]
    unified_kv_indptr = exclusive_cumsum(prefix_lens + extend_seq_lens)
    if batch == 0:
        return unified_kv_indptr, jnp.zeros((capacity,), index_dtype), prefix_lens
    unified_kv_indices = launch(
        ("kv_indices", "concat_kv_indices_kernel"),
        prefix_kv_indptr,
        prefix_kv_indices,
        index_i32(extend_start_loc),
        extend_seq_lens,
        extend_kv_indices,
        unified_kv_indptr,
        out_shape=jax.ShapeDtypeStruct((capacity,), index_dtype),
        grid=(batch,),
        zeroed_outputs=(0,),
        mode=launch_mode_argument(launch_mode, mode),
        FIRST_CAPACITY=prefix_kv_indices.shape[0],
        SECOND_CAPACITY=extend_kv_indices.shape[0],
        CAPACITY=capacity,
        BLOCK=_COPY_BLOCK,
    )
    return unified_kv_indptr, unified_kv_indices, prefix_lens


def build_unified_kv_indices_reference(
    prefix_kv_indptr, prefix_kv_indices, extend_start_loc, extend_seq_lens, extend_kv_indices, *, capacity=None, index_dtype=jnp.int32
):
    """Pure-jnp twin of `build_unified_kv_indices` (same arguments and results)."""
    batch = _check_unified_args(prefix_kv_indptr, prefix_kv_indices, extend_start_loc, extend_seq_lens, extend_kv_indices)
    if capacity is None:
        capacity = prefix_kv_indices.shape[0] + extend_kv_indices.shape[0]
    prefix_kv_indptr = index_i32(prefix_kv_indptr)
    extend_seq_lens = jnp.maximum(index_i32(extend_seq_lens), 0)
    if extend_start_loc is None:
        extend_start_loc = exclusive_cumsum(extend_seq_lens)[:-1]
    prefix_lens = prefix_kv_indptr[1:] - prefix_kv_indptr[:-1]
    unified_kv_indptr = exclusive_cumsum(prefix_lens + extend_seq_lens)
    if batch == 0:
        return unified_kv_indptr, jnp.zeros((capacity,), index_dtype), prefix_lens
    out_pos = jnp.arange(capacity, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(unified_kv_indptr, out_pos, side="right") - 1, 0, batch - 1)
    offset = out_pos - unified_kv_indptr[seq]
    in_prefix = offset < prefix_lens[seq]
    prefix_src = prefix_kv_indptr[seq] + offset
    extend_src = extend_start_loc[seq] + offset - prefix_lens[seq]

    def take(values, src):
        ok = (src >= 0) & (src < values.shape[0])
        return jnp.where(ok, values[jnp.clip(src, 0, values.shape[0] - 1)], 0)

    values = jnp.where(in_prefix, take(prefix_kv_indices, prefix_src), take(extend_kv_indices, extend_src))
    used = out_pos < unified_kv_indptr[-1]
    return unified_kv_indptr, jnp.where(used, values, 0).astype(index_dtype), prefix_lens


def kernel_builds():
    """The GPU builds of the index kernels (see jaxattn.aot); the constexpr sizes do not change the code shape."""
    builds = []
    for index_type in ("i32",):
        builds.append(
            build(
                "kv_indices",
                "create_kv_indices_kernel",
                {"REQ_TO_TOKEN": "*i32", "REQ_POOL_INDICES": "*i32", "KV_LENS": "*i32", "KV_STARTS": "*i32", "KV_INDPTR": "*i32", "KV_INDICES": f"*{index_type}"},
                {"MAX_REQS": 4096, "MAX_CTX": 131072, "CAPACITY": 1 << 22, "BLOCK": _COPY_BLOCK},
                label=f"indices {index_type}",
            )
        )
        builds.append(
            build(
                "kv_indices",
                "concat_kv_indices_kernel",
                {"FIRST_INDPTR": "*i32", "FIRST_INDICES": "*i32", "SECOND_STARTS": "*i32", "SECOND_LENS": "*i32", "SECOND_INDICES": "*i32", "OUT_INDPTR": "*i32", "OUT_INDICES": f"*{index_type}"},
                {"FIRST_CAPACITY": 1 << 22, "SECOND_CAPACITY": 1 << 16, "CAPACITY": 1 << 22, "BLOCK": _COPY_BLOCK},
                label=f"indices {index_type}",
            )
        )
    return builds
