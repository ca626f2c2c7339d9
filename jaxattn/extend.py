"""Extend attention (prefill over a cached prefix): SGLang's two-stage kernel and the deterministic unified kernel.

Two contracts, as in SGLang (see `kernels/extend_attention.py` for the kernels):

* `extend_attention` (two-stage): the prefix keys come from the pool through `ExtendMetadata.kv_indices`
  (prefix only), the new tokens' K/V from the contiguous `k_new`/`v_new` (same rows as `q`).
* `extend_attention_unified` (one stage, deterministic): every key, prefix and new, comes from the pool through one
  index list (`ExtendUnifiedMetadata`), so the new tokens' K/V must already be written to the pool. Keys are
  visited in one loop in absolute key order with tiles at multiples of BLOCK_N, so a token's output does not depend
  on where the prefix/new split falls (radix-cache hits, chunked prefill).

On sm_90, `extend_attention`'s plain causal calls go to the Pallas Mosaic GPU kernel of `jaxattn.extend_mgpu` (same
contract and output, FlashAttention-3's schedule); `impl=` picks explicitly.

Semantics are `jaxattn.reference`'s (queries are the last q_len tokens; scale -> softcap -> xai temperature -> mask;
a custom mask replaces causal; a window W keeps W + 1 keys; sinks join the denominator only; rows with no visible key
give 0). xai temperature uses SGLang's log2 formula (2-stage and decode kernels) in *both* kernels; SGLang's unified
kernel uses ``L / (pos + 1)`` instead, which jaxattn does not copy. Output rows past ``qo_indptr[-1]`` (padding
tokens) are 0.

Metadata is built inside jit by `extend_metadata` / `extend_unified_metadata` from SGLang's req_to_token table.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import triton

from jaxattn._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    MASK_DTYPES,
    check_array,
    check_head_dims,
    check_index_dtype,
    check_positive_int,
    check_score_options,
    check_window,
)
from jaxattn.kv_indices import build_unified_kv_indices, build_unified_kv_indices_reference, create_kv_indices, exclusive_cumsum
from jaxattn.launch import launch
from jaxattn.reference import check_attention_args, ragged_paged_attention_reference

_LOG2E = 1.4426950408889634

# ---------------------------------------------------------------------------------------------
# Tuning: one frozen config per launch, one table per GPU architecture.


@dataclasses.dataclass(frozen=True)
class ExtendConfig:
    """Tile sizes and launch options of one extend launch (both kernels use the same fields).

    block_m: query rows per program (the q-block). block_n: keys per inner-loop tile. Both powers of 2, >= 16.
    In the unified kernel block_n also fixes the reduction order: outputs are bit-identical across prefix/new splits
    only for the same block_n. num_warps, num_stages: Triton launch options (num_stages > 1 software-pipelines the
    K/V loads of the inner loop). head_pack: q heads of one KV head that share a program (a power of 2): its block_m
    rows are head_pack heads x block_m / head_pack tokens, so each K/V tile loaded serves head_pack heads. Launches
    use gcd(head_pack, q_heads / kv_heads) (1 for MHA).
    """

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    head_pack: int = 1

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"ExtendConfig.{name} must be a power of 2 >= 16; got {value!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"ExtendConfig.num_warps must be 1, 2, 4, 8 or 16; got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"ExtendConfig.num_stages must be a positive int; got {self.num_stages!r}")
        if not isinstance(self.head_pack, int) or self.head_pack < 1 or self.head_pack & (self.head_pack - 1):
            raise ValueError(f"ExtendConfig.head_pack must be a power of 2 >= 1; got {self.head_pack!r}")
        if self.head_pack > self.block_m:
            raise ValueError(f"ExtendConfig.head_pack ({self.head_pack}) must not exceed block_m ({self.block_m})")


def _packed(config: ExtendConfig, q_heads: int, kv_heads: int) -> ExtendConfig:
    """The config a launch uses: head_pack cut to the largest power of 2 dividing the group size."""
    return dataclasses.replace(config, head_pack=math.gcd(config.head_pack, q_heads // kv_heads))


def _grid(config: ExtendConfig, q_heads: int, batch: int, max_extend_len: int) -> tuple[int, int, int]:
    """(head groups, sequences, q-blocks of block_m / head_pack tokens)."""
    return (q_heads // config.head_pack, batch, triton.cdiv(max_extend_len, config.block_m // config.head_pack))


# Key schema: head-dim family -> config for 16-bit inputs. Families: "64", "128", "256" (plain heads, qk_head_dim rounded
# up to a power of 2) and "576/512", "288/256", "192/128" (qk_head_dim/v_head_dim with a rope part in a second dot).
# Every entry was timed on the H200, two-stage kernel, bf16, each candidate checked against the reference first:
# "128" on E1/E3 (sweep of 2026-12-02): 128x128 tiles with 3 stages, 2.56 ms on E1 against 5.24 ms for 128x32/2.
# The others on the tuning cases T64/T256/T192/T576/T288 of jaxattn.bench (benchmarks/experiments/extend_tuning.py,
# results/2026-12-03_h200_extend_tuning_round{1,2}.json), against the earlier CPU-chosen guesses (ms, guess -> now):
# 64: 1.91 -> 1.27; 192/128: 2.67 -> 1.87; 256: 7.02 -> 2.82; 288/256: 2.35 -> 1.10; 576/512: 8.67 -> 4.06.
# What the sweep showed: 64-row q-blocks want 4 warps (one warpgroup; with 8 the row softmax is split across two
# warpgroups and runs 1.5-2.5x slower), except 576/512, whose 64x32 tiles need 8 warps to hold the 512-wide
# accumulator (it spills a little and still beats 32-row tiles without wgmma by 2.1x); 128-row blocks want 8.
# A third/fourth stage only helps where shared memory is left over (64-dim heads, 192/128).
SM90_CONFIGS = {
    "64": ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    "128": ExtendConfig(block_m=128, block_n=128, num_warps=8, num_stages=3),
    "256": ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),
    "192/128": ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    "288/256": ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),
    "576/512": ExtendConfig(block_m=64, block_n=32, num_warps=8, num_stages=2),
}
CONFIG_TABLES = {"sm_90": SM90_CONFIGS}

# qk_head_dim -> (BLOCK_D, BLOCK_DPE): the rope part of these heads goes through a second dot (SGLang's split).
_DPE_SPLITS = {576: (512, 64), 288: (256, 32), 192: (128, 64)}


def head_dim_family(qk_head_dim: int, v_head_dim: int) -> str:
    """The config-table key of a head shape (see SM90_CONFIGS)."""
    if qk_head_dim in _DPE_SPLITS:
        return f"{qk_head_dim}/{_DPE_SPLITS[qk_head_dim][0]}"
    dim = max(triton.next_power_of_2(qk_head_dim), triton.next_power_of_2(v_head_dim))
    return str(max(dim, 64)) if dim <= 256 else "576/512"


def with_custom_mask(config: ExtendConfig) -> ExtendConfig:
    """The custom-mask variant keeps a [BLOCK_M, BLOCK_N] mask tile live too: 128-key tiles overflow shared memory."""
    return dataclasses.replace(config, block_n=min(config.block_n, 64))


def default_config(qk_head_dim: int, v_head_dim: int, dtype, max_extend_len: int, arch: str = "sm_90",
                   custom_mask: bool = False) -> ExtendConfig:
    """The table's config for this head shape, adapted to the dtype and clamped to the problem.

    Unknown families fall back to the largest family's config. fp32 inputs (tests, mostly) take half-size K/V tiles and
    no pipelining so shared memory still fits. block_m is clamped to max_extend_len (rounded up to a power of 2, >= 16).
    """
    table = CONFIG_TABLES.get(arch, SM90_CONFIGS)
    config = table.get(head_dim_family(qk_head_dim, v_head_dim), table["576/512"])
    if custom_mask:
        config = with_custom_mask(config)
    if jnp.dtype(dtype) == jnp.float32:
        config = dataclasses.replace(config, block_m=min(config.block_m, 64), block_n=min(config.block_n, 32), num_stages=1)
    block_m = max(16, min(config.block_m, triton.next_power_of_2(max(int(max_extend_len), 1))))
    return dataclasses.replace(config, block_m=block_m)


def _block_dims(qk_head_dim: int, v_head_dim: int):
    block_d, block_dpe = _DPE_SPLITS.get(qk_head_dim, (max(16, triton.next_power_of_2(qk_head_dim)), 0))
    return block_d, block_dpe, max(16, triton.next_power_of_2(v_head_dim))


def _kernel_constexprs(*, q_heads, kv_heads, qk_head_dim, v_head_dim, dtype, config, sm_scale, logit_cap, xai_temperature_len, sliding_window, causal, use_mask, has_sink, skip_prefix_mask=None):
    """The constexprs of one launch (shared by the wrappers and kernel_builds, so the AOT check compiles what runs)."""
    block_d, block_dpe, block_dv = _block_dims(qk_head_dim, v_head_dim)
    logit_cap = float(logit_cap)
    qk_scale = sm_scale / logit_cap if logit_cap > 0 else sm_scale * _LOG2E
    constexprs = dict(
        Q_HEADS=q_heads,
        KV_HEADS=kv_heads,
        D_QK=qk_head_dim,
        D_V=v_head_dim,
        BLOCK_D=block_d,
        BLOCK_DPE=block_dpe,
        BLOCK_DV=block_dv,
        BLOCK_M=config.block_m,
        HEAD_PACK=config.head_pack,
        BLOCK_N=config.block_n,
        QK_SCALE=float(qk_scale),
        LOGIT_CAP=logit_cap if logit_cap > 0 else 0.0,
        XAI_LEN=int(xai_temperature_len) if xai_temperature_len > 0 else 0,
        XAI_INV_LOG2_LEN=1.0 / math.log2(xai_temperature_len) if xai_temperature_len > 1 else 1.0,
        WINDOW=int(sliding_window) if sliding_window >= 0 else -1,
        IS_CAUSAL=bool(causal),
        USE_MASK=bool(use_mask),
        HAS_SINK=bool(has_sink),
        DOT_PRECISION="ieee" if jnp.dtype(dtype) == jnp.float32 else "tf32",
    )
    if skip_prefix_mask is not None:
        constexprs["SKIP_PREFIX_MASK"] = bool(skip_prefix_mask)
    return constexprs


# ---------------------------------------------------------------------------------------------
# Metadata: pytrees built inside jit.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExtendMetadata:
    """Batch layout for `extend_attention` (two-stage): the new tokens' rows and the listed cached prefix.

    A sliding-window layer lists only the last `sliding_window` prefix keys of each sequence; `kv_start_pos` says how
    many were dropped, so positions and the custom mask's full-width columns stay right.
    """

    qo_indptr: jax.Array  # i32[batch + 1]: sequence b's new tokens are rows qo_indptr[b]:qo_indptr[b+1] of q/k_new/v_new
    kv_indptr: jax.Array  # i32[batch + 1]: CSR of the listed prefix
    kv_indices: jax.Array  # i32/i64[kv_capacity]: pool slots of the listed prefix keys, in position order
    kv_start_pos: jax.Array  # i32[batch]: absolute position of the first listed prefix key (SGLang's window_kv_offsets)
    mask_indptr: jax.Array | None  # i32[batch + 1]: start of each sequence's custom mask rows [q_len, prefix_len + q_len]
    max_extend_len: int = dataclasses.field(metadata=dict(static=True))  # static bound on q_len; fixes the grid
    kv_capacity: int = dataclasses.field(metadata=dict(static=True))  # static length of kv_indices
    sliding_window: int = dataclasses.field(default=-1, metadata=dict(static=True))  # window the list was cut for; -1 full


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExtendUnifiedMetadata:
    """Batch layout for `extend_attention_unified`: one list per sequence, listed prefix keys then new tokens."""

    qo_indptr: jax.Array  # i32[batch + 1]
    kv_indptr: jax.Array  # i32[batch + 1]: CSR of the unified list (listed prefix + new tokens)
    kv_indices: jax.Array  # i32/i64[kv_capacity]: pool slots; the new tokens' K/V must already be in the pool
    prefix_lens: jax.Array  # i32[batch]: listed prefix keys per sequence
    kv_start_pos: jax.Array  # i32[batch]: absolute position of each sequence's first listed key (window_start_pos)
    mask_indptr: jax.Array | None  # i32[batch + 1]: start of each sequence's custom mask rows [q_len, listed kv_len]
    max_extend_len: int = dataclasses.field(metadata=dict(static=True))
    kv_capacity: int = dataclasses.field(metadata=dict(static=True))
    sliding_window: int = dataclasses.field(default=-1, metadata=dict(static=True))


def check_request_tables(req_to_token, req_pool_indices, prefix_lens, extend_lens) -> int:
    """Trace-time shape/dtype checks of an extend batch's request tables (the builders and `jaxattn.checked`); the batch."""
    check_array("req_to_token", req_to_token, ndim=2, dtypes=INDEX_DTYPES, what="[max_reqs, max_context_len]")
    check_array("req_pool_indices", req_pool_indices, ndim=1, dtypes=INDEX_DTYPES, what="[batch]")
    batch = req_pool_indices.shape[0]
    check_array("prefix_lens", prefix_lens, shape=(batch,), dtypes=INDEX_DTYPES, what="[batch]")
    check_array("extend_lens", extend_lens, shape=(batch,), dtypes=INDEX_DTYPES, what="[batch]")
    return batch


def _check_builder_args(req_to_token, req_pool_indices, prefix_lens, extend_lens, max_extend_len, kv_capacity, sliding_window=-1, index_dtype=jnp.int32):
    check_request_tables(req_to_token, req_pool_indices, prefix_lens, extend_lens)
    check_positive_int("max_extend_len", max_extend_len)
    check_positive_int("kv_capacity", kv_capacity)
    check_window("sliding_window", sliding_window)
    check_index_dtype("index_dtype", index_dtype)


def listed_prefix(prefix_lens, sliding_window):
    """(listed, dropped) prefix keys per sequence: a window-W layer lists only the last W (all its queries can see)."""
    prefix_lens = jnp.maximum(prefix_lens.astype(jnp.int32), 0)
    if sliding_window >= 0:
        # Query 0 (position prefix_len) sees keys from prefix_len - W on: the last W prefix keys.
        listed = jnp.minimum(prefix_lens, sliding_window)
    else:
        listed = prefix_lens
    return listed, prefix_lens - listed


@functools.partial(jax.jit, static_argnames=("max_extend_len", "kv_capacity", "sliding_window", "index_dtype", "mode"))
def extend_metadata(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    prefix_lens: jax.Array,
    extend_lens: jax.Array,
    *,
    max_extend_len: int,
    kv_capacity: int,
    sliding_window: int = -1,
    index_dtype=jnp.int32,
    mode: str | None = None,
) -> ExtendMetadata:
    """Builds `ExtendMetadata` for a batch (SGLang's EXTEND mode), inside or outside jit.

    Args:
      req_to_token: i32[max_reqs, max_context_len]: pool slot of every token of every request row.
      req_pool_indices: i32[batch]: each sequence's row.
      prefix_lens: i32[batch]: cached tokens per sequence (0 allowed).
      extend_lens: i32[batch]: new tokens per sequence (0 allowed); the rows of q are these, sequence after sequence.
      max_extend_len: static bound on extend_lens (a bucket; it fixes the kernel grid). Longer rows are not computed.
      kv_capacity: static length of kv_indices: at least the total listed prefix.
      sliding_window: W >= 0 lists only the last W prefix keys of each sequence (all a window-W query can see).
      index_dtype: int32 or int64 slots.

    Returns:
      ExtendMetadata, with `mask_indptr` laid out for full-width custom masks [q_len, prefix_len + q_len].
    """
    _check_builder_args(req_to_token, req_pool_indices, prefix_lens, extend_lens, max_extend_len, kv_capacity, sliding_window, index_dtype)
    extend_lens = jnp.maximum(extend_lens.astype(jnp.int32), 0)
    listed, start = listed_prefix(prefix_lens, sliding_window)
    kv_indptr, kv_indices = create_kv_indices(
        req_to_token, req_pool_indices, listed, start, capacity=kv_capacity, index_dtype=index_dtype, mode=mode
    )
    full = listed + start
    return ExtendMetadata(
        qo_indptr=exclusive_cumsum(extend_lens),
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        kv_start_pos=start,
        mask_indptr=exclusive_cumsum(extend_lens * (full + extend_lens)),
        max_extend_len=max_extend_len,
        kv_capacity=kv_capacity,
        sliding_window=int(sliding_window) if sliding_window >= 0 else -1,
    )


@functools.partial(jax.jit, static_argnames=("max_extend_len", "kv_capacity", "sliding_window", "index_dtype", "mode"))
def extend_unified_metadata(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    prefix_lens: jax.Array,
    extend_lens: jax.Array,
    out_cache_loc: jax.Array,
    *,
    max_extend_len: int,
    kv_capacity: int,
    sliding_window: int = -1,
    extend_start_loc: jax.Array | None = None,
    index_dtype=jnp.int32,
    mode: str | None = None,
) -> ExtendUnifiedMetadata:
    """Builds `ExtendUnifiedMetadata` (SGLang's `_forward_extend_unified`): listed prefix slots then out_cache_loc.

    Args:
      req_to_token, req_pool_indices, prefix_lens, extend_lens, max_extend_len, sliding_window: as `extend_metadata`.
      out_cache_loc: i32[extend_tokens]: the pool slots the new tokens' K/V were written to, sequence after sequence.
      kv_capacity: static length of the unified list: at least total listed prefix + total new tokens.
      extend_start_loc: optional i32[batch]: where each sequence's slots start in out_cache_loc (default: cumsum).

    Returns:
      ExtendUnifiedMetadata, `mask_indptr` laid out for custom masks [q_len, listed_prefix + q_len].
    """
    _check_builder_args(req_to_token, req_pool_indices, prefix_lens, extend_lens, max_extend_len, kv_capacity, sliding_window, index_dtype)
    check_array("out_cache_loc", out_cache_loc, ndim=1, dtypes=INDEX_DTYPES, what="[extend_tokens]")
    extend_lens = jnp.maximum(extend_lens.astype(jnp.int32), 0)
    listed, start = listed_prefix(prefix_lens, sliding_window)
    prefix_indptr, prefix_indices = create_kv_indices(
        req_to_token, req_pool_indices, listed, start, capacity=kv_capacity, index_dtype=index_dtype, mode=mode
    )
    kv_indptr, kv_indices, listed = build_unified_kv_indices(
        prefix_indptr, prefix_indices, extend_start_loc, extend_lens, out_cache_loc, capacity=kv_capacity, index_dtype=index_dtype, mode=mode
    )
    return ExtendUnifiedMetadata(
        qo_indptr=exclusive_cumsum(extend_lens),
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        prefix_lens=listed,
        kv_start_pos=start,
        mask_indptr=exclusive_cumsum(extend_lens * (listed + extend_lens)),
        max_extend_len=max_extend_len,
        kv_capacity=kv_capacity,
        sliding_window=int(sliding_window) if sliding_window >= 0 else -1,
    )


# ---------------------------------------------------------------------------------------------
# Argument checks (trace time).


def _check_common(q, k_pool, v_pool, meta, meta_type, custom_mask, sinks, sliding_window, config, logit_cap=0.0, xai_temperature_len=-1):
    if not isinstance(meta, meta_type):
        raise ValueError(f"meta must be an {meta_type.__name__} (see {meta_type.__name__.replace('Metadata', '').lower()}_metadata); got {type(meta).__name__}")
    batch, _ = check_attention_args(q, k_pool, v_pool, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, sinks, custom_mask, meta.mask_indptr if custom_mask is not None else None)
    check_head_dims(q.shape[2], v_pool.shape[2], qk_name="qk_head_dim (q.shape[2])", v_name="v_head_dim (v_pool.shape[2])")
    check_array("meta.kv_start_pos", meta.kv_start_pos, shape=(batch,), dtypes=INDEX_DTYPES, what="[batch]")
    check_array("meta.kv_indices", meta.kv_indices, shape=(meta.kv_capacity,), what="[meta.kv_capacity]")
    check_positive_int("meta.max_extend_len", meta.max_extend_len)
    check_window("sliding_window", sliding_window)
    check_score_options(logit_cap, xai_temperature_len)
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if jnp.dtype(pool.dtype) != jnp.dtype(q.dtype):
            raise ValueError(f"{name} must have q's dtype {jnp.dtype(q.dtype).name}; got {jnp.dtype(pool.dtype).name}")
    if custom_mask is not None:
        check_array("custom_mask", custom_mask, ndim=1, dtypes=MASK_DTYPES, what="[mask_len]")
    if meta.sliding_window >= 0 and not (0 <= sliding_window <= meta.sliding_window):
        raise ValueError(
            f"sliding_window ({sliding_window}) must be in [0, {meta.sliding_window}]: meta's prefix lists were cut for a "
            f"window of {meta.sliding_window}, so they lack keys a wider (or no) window would see"
        )
    if config is not None and not isinstance(config, ExtendConfig):
        raise ValueError(f"config must be an ExtendConfig or None; got {type(config).__name__}")
    return batch


def _check_new_tokens(q, k_new, v_new, k_pool, v_pool):
    tokens, _, qk_dim = q.shape
    kv_heads, v_dim = v_pool.shape[1], v_pool.shape[2]
    check_array("k_new", k_new, shape=(tokens, kv_heads, qk_dim), dtypes=(q.dtype,), what="[tokens, kv_heads, qk_head_dim]")
    check_array("v_new", v_new, shape=(tokens, kv_heads, v_dim), dtypes=(q.dtype,), what="[tokens, kv_heads, v_head_dim]")


def _dummy(dtype):
    return jnp.zeros((1,), dtype)


# ---------------------------------------------------------------------------------------------
# Public ops.

_STATIC = ("causal", "skip_prefix_custom_mask", "sliding_window", "logit_cap", "xai_temperature_len", "sm_scale", "config", "mode")
IMPLS = ("triton", "mgpu")


@functools.partial(jax.jit, static_argnames=_STATIC + ("impl",))
def extend_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    meta: ExtendMetadata,
    *,
    causal: bool = True,
    custom_mask: jax.Array | None = None,
    skip_prefix_custom_mask: bool = True,
    sliding_window: int = -1,
    logit_cap: float = 0.0,
    sinks: jax.Array | None = None,
    xai_temperature_len: int = -1,
    sm_scale: float | None = None,
    config: ExtendConfig | None = None,
    mode: str | None = None,
    impl: str | None = None,
) -> jax.Array:
    """Two-stage extend attention (SGLang's extend_attention_fwd): cached prefix from the pool, new tokens contiguous.

    On an H200/H100 (sm_90), plain causal calls (bf16/f16, head dim 64 or 128, no mask, window, cap, sinks or xai
    temperature, no `config`) run the Mosaic GPU kernel of `jaxattn.extend_mgpu` (FlashAttention-3's schedule,
    1.5x faster at E1); everything else runs SGLang's two-stage Triton kernel. `impl="triton"` or `"mgpu"` forces one.

    Args:
      q: [tokens, q_heads, qk_head_dim] f32/f16/bf16: the new tokens' queries, sequence b at meta.qo_indptr[b]:[b+1].
      k_new: [tokens, kv_heads, qk_head_dim], v_new: [tokens, kv_heads, v_head_dim]: the new tokens' K/V (q's dtype).
      k_pool: [slots, kv_heads, qk_head_dim], v_pool: [slots, kv_heads, v_head_dim]: the cache (q's dtype).
        q head h reads kv head h // (q_heads // kv_heads). qk_head_dim 576/288/192 split off a rope part (MLA).
      meta: `ExtendMetadata` (see `extend_metadata`).
      causal: causal among the new tokens (every prefix key precedes every query). Ignored with a custom mask.
      custom_mask: bool/u8/i8 flat; sequence b's rows at meta.mask_indptr[b], row-major [q_len, prefix_len + q_len]
        over the full prefix (window-dropped columns included), then the new tokens. Replaces causal.
      skip_prefix_custom_mask: do not read the prefix columns (all visible), as SGLang's backend does.
      sliding_window: W >= 0: a query sees keys with q_pos - k_pos <= W (W + 1 keys). Must be <= meta.sliding_window
        when the metadata was cut for a window.
      logit_cap: > 0 caps scores with cap * tanh(s / cap). sinks: f32[q_heads] denominator-only logits.
      xai_temperature_len: L > 0 multiplies scores by log2(pos) / log2(L) for positions pos > L.
      sm_scale: default 1 / sqrt(qk_head_dim). config: Triton tile sizes (default: `default_config`). mode: launch mode.
      impl: None (pick as above), "triton" or "mgpu" (raises if the Mosaic GPU kernel cannot take the call).

    Returns:
      o: [tokens, q_heads, v_head_dim] in q's dtype; rows past qo_indptr[-1] are 0.
    """
    check_array("q", q, ndim=3, dtypes=FLOAT_DTYPES, what="[tokens, q_heads, qk_head_dim]")
    batch = _check_common(q, k_pool, v_pool, meta, ExtendMetadata, custom_mask, sinks, sliding_window, config, logit_cap, xai_temperature_len)
    _check_new_tokens(q, k_new, v_new, k_pool, v_pool)
    if impl not in (None,) + IMPLS:
        raise ValueError(f"impl must be None, 'triton' or 'mgpu'; got {impl!r}")
    if impl == "mgpu" or (impl is None and config is None):
        from jaxattn.extend_mgpu import extend_attention_mgpu, mgpu_unsupported

        why_not = mgpu_unsupported(q, k_pool, v_pool, causal=causal, custom_mask=custom_mask, sliding_window=sliding_window,
                                   logit_cap=logit_cap, sinks=sinks, xai_temperature_len=xai_temperature_len, mode=mode)
        if why_not is None:
            return extend_attention_mgpu(q, k_new, v_new, k_pool, v_pool, meta, sm_scale=sm_scale)
        if impl == "mgpu":
            raise ValueError(f"impl='mgpu': the Mosaic GPU extend kernel cannot take this call: {why_not}")
    tokens, q_heads, qk_dim = q.shape
    kv_heads, v_dim = v_pool.shape[1], v_pool.shape[2]
    sm_scale = 1.0 / math.sqrt(qk_dim) if sm_scale is None else float(sm_scale)
    config = _packed(config or default_config(qk_dim, v_dim, q.dtype, meta.max_extend_len, custom_mask=custom_mask is not None), q_heads, kv_heads)
    constexprs = _kernel_constexprs(
        q_heads=q_heads, kv_heads=kv_heads, qk_head_dim=qk_dim, v_head_dim=v_dim, dtype=q.dtype, config=config,
        sm_scale=sm_scale, logit_cap=logit_cap, xai_temperature_len=xai_temperature_len, sliding_window=sliding_window,
        causal=causal, use_mask=custom_mask is not None, has_sink=sinks is not None, skip_prefix_mask=skip_prefix_custom_mask,
    )
    if batch == 0 or tokens == 0:
        return jnp.zeros((tokens, q_heads, v_dim), q.dtype)
    return launch(
        ("extend_attention", "extend_attention_kernel"),
        q, k_new, v_new, k_pool, v_pool,
        meta.qo_indptr.astype(jnp.int32),
        meta.kv_indptr.astype(jnp.int32),
        meta.kv_indices,
        meta.kv_start_pos.astype(jnp.int32),
        _dummy(jnp.uint8) if custom_mask is None else custom_mask.astype(jnp.uint8),
        _dummy(jnp.int32) if custom_mask is None else meta.mask_indptr,
        _dummy(jnp.float32) if sinks is None else sinks.astype(jnp.float32),
        out_shape=jax.ShapeDtypeStruct((tokens, q_heads, v_dim), q.dtype),
        grid=_grid(config, q_heads, batch, meta.max_extend_len),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        zeroed_outputs=(0,),  # padding rows past qo_indptr[-1] read as 0
        mode=mode,
        name=f"extend_attention_{config.block_m}x{config.block_n}_p{config.head_pack}",
        **constexprs,
    )


@functools.partial(jax.jit, static_argnames=tuple(s for s in _STATIC if s != "skip_prefix_custom_mask"))
def extend_attention_unified(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    meta: ExtendUnifiedMetadata,
    *,
    causal: bool = True,
    custom_mask: jax.Array | None = None,
    sliding_window: int = -1,
    logit_cap: float = 0.0,
    sinks: jax.Array | None = None,
    xai_temperature_len: int = -1,
    sm_scale: float | None = None,
    window_start_pos: jax.Array | None = None,
    config: ExtendConfig | None = None,
    mode: str | None = None,
) -> jax.Array:
    """Deterministic one-stage extend attention (SGLang's extend_attention_fwd_unified), all keys through the pool.

    Args:
      q: [tokens, q_heads, qk_head_dim]; k_pool, v_pool: the cache, the new tokens' K/V already written at the slots
        meta lists for them.
      meta: `ExtendUnifiedMetadata` (see `extend_unified_metadata`).
      custom_mask: flat, per sequence row-major [q_len, kv_len] over the *listed* keys (prefix + new); replaces causal.
      window_start_pos: optional i32[batch]: absolute position of each sequence's first listed key (default
        meta.kv_start_pos).
      causal, sliding_window, logit_cap, sinks, xai_temperature_len, sm_scale, config, mode: as `extend_attention`.

    Returns:
      o: [tokens, q_heads, v_head_dim] in q's dtype; rows past qo_indptr[-1] are 0. For a fixed config.block_n a
      token's row is bit-identical however its sequence is split into prefix and new tokens.
    """
    check_array("q", q, ndim=3, dtypes=FLOAT_DTYPES, what="[tokens, q_heads, qk_head_dim]")
    batch = _check_common(q, k_pool, v_pool, meta, ExtendUnifiedMetadata, custom_mask, sinks, sliding_window, config, logit_cap, xai_temperature_len)
    check_array("meta.prefix_lens", meta.prefix_lens, shape=(batch,), dtypes=INDEX_DTYPES, what="[batch]")
    if window_start_pos is not None:
        check_array("window_start_pos", window_start_pos, shape=(batch,), dtypes=INDEX_DTYPES, what="[batch]")
    start_pos = meta.kv_start_pos if window_start_pos is None else window_start_pos
    tokens, q_heads, qk_dim = q.shape
    kv_heads, v_dim = v_pool.shape[1], v_pool.shape[2]
    sm_scale = 1.0 / math.sqrt(qk_dim) if sm_scale is None else float(sm_scale)
    config = _packed(config or default_config(qk_dim, v_dim, q.dtype, meta.max_extend_len, custom_mask=custom_mask is not None), q_heads, kv_heads)
    constexprs = _kernel_constexprs(
        q_heads=q_heads, kv_heads=kv_heads, qk_head_dim=qk_dim, v_head_dim=v_dim, dtype=q.dtype, config=config,
        sm_scale=sm_scale, logit_cap=logit_cap, xai_temperature_len=xai_temperature_len, sliding_window=sliding_window,
        causal=causal, use_mask=custom_mask is not None, has_sink=sinks is not None,
    )
    if batch == 0 or tokens == 0:
        return jnp.zeros((tokens, q_heads, v_dim), q.dtype)
    return launch(
        ("extend_attention", "extend_attention_unified_kernel"),
        q, k_pool, v_pool,
        meta.qo_indptr.astype(jnp.int32),
        meta.kv_indptr.astype(jnp.int32),
        meta.kv_indices,
        meta.prefix_lens.astype(jnp.int32),
        start_pos.astype(jnp.int32),
        _dummy(jnp.uint8) if custom_mask is None else custom_mask.astype(jnp.uint8),
        _dummy(jnp.int32) if custom_mask is None else meta.mask_indptr,
        _dummy(jnp.float32) if sinks is None else sinks.astype(jnp.float32),
        out_shape=jax.ShapeDtypeStruct((tokens, q_heads, v_dim), q.dtype),
        grid=_grid(config, q_heads, batch, meta.max_extend_len),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        zeroed_outputs=(0,),
        mode=mode,
        name=f"extend_attention_unified_{config.block_m}x{config.block_n}_p{config.head_pack}",
        **constexprs,
    )


# ---------------------------------------------------------------------------------------------
# References: same signatures, built on ragged_paged_attention_reference.


def extend_attention_reference(
    q, k_new, v_new, k_pool, v_pool, meta, *, causal=True, custom_mask=None, skip_prefix_custom_mask=True, sliding_window=-1,
    logit_cap=0.0, sinks=None, xai_temperature_len=-1, sm_scale=None, config=None, mode=None,
):
    """Pure-jnp twin of `extend_attention` (`config`, `mode` ignored).

    The new tokens are appended to a copy of the pool (token t at slot slots + t), each sequence's key list is its listed
    prefix then its new slots, and the custom mask is re-cut to those listed columns.
    """
    del config, mode
    check_array("q", q, ndim=3, dtypes=FLOAT_DTYPES, what="[tokens, q_heads, qk_head_dim]")
    batch = _check_common(q, k_pool, v_pool, meta, ExtendMetadata, custom_mask, sinks, sliding_window, None, logit_cap, xai_temperature_len)
    _check_new_tokens(q, k_new, v_new, k_pool, v_pool)
    tokens, slots = q.shape[0], k_pool.shape[0]
    k_all = jnp.concatenate([k_pool, k_new])
    v_all = jnp.concatenate([v_pool, v_new])
    qo_indptr = meta.qo_indptr.astype(jnp.int32)
    extend_lens = qo_indptr[1:] - qo_indptr[:-1]
    capacity = meta.kv_capacity + max(tokens, 1)
    kv_indptr, kv_indices, listed = build_unified_kv_indices_reference(
        meta.kv_indptr.astype(jnp.int32), meta.kv_indices, qo_indptr[:-1], extend_lens,
        slots + jnp.arange(max(tokens, 1), dtype=jnp.int32), capacity=capacity,
    )
    mask, mask_indptr = None, None
    if custom_mask is not None:
        mask, mask_indptr = _listed_columns_mask(custom_mask, meta.mask_indptr, listed, meta.kv_start_pos, extend_lens, skip_prefix_custom_mask)
    return ragged_paged_attention_reference(
        q, k_all, v_all, qo_indptr, kv_indptr, kv_indices, causal=causal, custom_mask=mask, mask_indptr=mask_indptr,
        sliding_window=sliding_window, logit_cap=logit_cap, sinks=sinks, xai_temperature_len=xai_temperature_len,
        sm_scale=sm_scale, kv_start_positions=meta.kv_start_pos, max_q_len=meta.max_extend_len,
        max_kv_len=meta.kv_capacity + meta.max_extend_len,
    )


def _listed_columns_mask(custom_mask, mask_indptr, listed, start_pos, q_lens, skip_prefix):
    """Full-width rows [q_len, start + listed + q_len] -> rows over the listed keys [q_len, listed + q_len]."""
    listed = listed.astype(jnp.int32)
    start_pos = start_pos.astype(jnp.int32)
    batch = listed.shape[0]
    width = listed + q_lens
    out_indptr = exclusive_cumsum(q_lens * width)
    e = jnp.arange(custom_mask.shape[0], dtype=jnp.int32)
    b = jnp.clip(jnp.searchsorted(out_indptr, e, side="right") - 1, 0, batch - 1)
    r = e - out_indptr[b]
    w = jnp.maximum(width[b], 1)
    i, j = r // w, r % w
    src = mask_indptr[b].astype(jnp.int32) + i * (start_pos[b] + width[b]) + start_pos[b] + j
    values = custom_mask[jnp.clip(src, 0, custom_mask.shape[0] - 1)].astype(bool)
    if skip_prefix:
        values = values | (j < listed[b])
    return jnp.where(e < out_indptr[-1], values, False), out_indptr


def extend_attention_unified_reference(
    q, k_pool, v_pool, meta, *, causal=True, custom_mask=None, sliding_window=-1, logit_cap=0.0, sinks=None,
    xai_temperature_len=-1, sm_scale=None, window_start_pos=None, config=None, mode=None,
):
    """Pure-jnp twin of `extend_attention_unified` (`config`, `mode` ignored)."""
    del config, mode
    check_array("q", q, ndim=3, dtypes=FLOAT_DTYPES, what="[tokens, q_heads, qk_head_dim]")
    _check_common(q, k_pool, v_pool, meta, ExtendUnifiedMetadata, custom_mask, sinks, sliding_window, None, logit_cap, xai_temperature_len)
    if window_start_pos is not None:
        check_array("window_start_pos", window_start_pos, shape=(meta.qo_indptr.shape[0] - 1,), dtypes=INDEX_DTYPES, what="[batch]")
    start_pos = meta.kv_start_pos if window_start_pos is None else window_start_pos
    return ragged_paged_attention_reference(
        q, k_pool, v_pool, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, causal=causal,
        custom_mask=None if custom_mask is None else custom_mask.astype(bool),
        mask_indptr=None if custom_mask is None else meta.mask_indptr, sliding_window=sliding_window,
        logit_cap=logit_cap, sinks=sinks, xai_temperature_len=xai_temperature_len, sm_scale=sm_scale,
        kv_start_positions=start_pos, max_q_len=meta.max_extend_len, max_kv_len=meta.kv_capacity,
    )


# ---------------------------------------------------------------------------------------------
# AOT builds (see jaxattn.aot).

_BUILD_HEADS = {"64": (64, 64), "128": (128, 128), "256": (256, 256), "576/512": (576, 512), "288/256": (288, 256), "192/128": (192, 128)}
# Families whose H200 timing relied on an occupancy: 64's 128x64 tiles x 8 warps ran at 128 registers per thread, two
# CTAs per SM; at 159 registers (one CTA) T64 took 2.14 ms instead of 1.26.
_TIMED_MAX_REGISTERS = {"64": 128}


def _build(kernel, family, dtype, *, label_extra="", causal=True, use_mask=False, skip_prefix_mask=True, window=-1, logit_cap=0.0, has_sink=False, xai=-1, max_registers=None):
    from jaxattn.aot import build

    qk_dim, v_dim = _BUILD_HEADS[family]
    q_heads, kv_heads = (16, 1) if qk_dim in (576, 288) else (32, 8)  # MLA absorbed: one latent KV head
    config = with_custom_mask(SM90_CONFIGS[family]) if use_mask else SM90_CONFIGS[family]
    config = _packed(config, q_heads, kv_heads)
    jdtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16}[dtype]
    two_stage = kernel == "extend_attention_kernel"
    constexprs = _kernel_constexprs(
        q_heads=q_heads, kv_heads=kv_heads, qk_head_dim=qk_dim, v_head_dim=v_dim, dtype=jdtype, config=config,
        sm_scale=1.0 / math.sqrt(qk_dim), logit_cap=logit_cap, xai_temperature_len=xai, sliding_window=window,
        causal=causal, use_mask=use_mask, has_sink=has_sink, skip_prefix_mask=skip_prefix_mask if two_stage else None,
    )
    t = f"*{dtype}"
    if two_stage:
        signature = {"Q": t, "K_NEW": t, "V_NEW": t, "K_POOL": t, "V_POOL": t, "QO_INDPTR": "*i32", "KV_INDPTR": "*i32", "KV_INDICES": "*i32", "KV_START_POS": "*i32"}
    else:
        signature = {"Q": t, "K_POOL": t, "V_POOL": t, "QO_INDPTR": "*i32", "KV_INDPTR": "*i32", "KV_INDICES": "*i32", "PREFIX_LENS": "*i32", "KV_START_POS": "*i32"}
    signature.update({"MASK": "*u8", "MASK_INDPTR": "*i32", "SINKS": "*fp32", "O": t})
    return build(
        "extend_attention", kernel, signature, constexprs, num_warps=config.num_warps, num_stages=config.num_stages,
        expects_wgmma=config.block_m >= 64, expects_pipelining=config.num_stages > 1, max_registers=max_registers, label=f"{dtype} {family}{label_extra} {config.block_m}x{config.block_n}",
    )


def kernel_builds():
    """Every default-table config per kernel x dtype x head family, plus feature variants that change code shape."""
    builds = []
    for kernel in ("extend_attention_kernel", "extend_attention_unified_kernel"):
        for family in _BUILD_HEADS:
            for dtype in ("bf16", "fp16"):
                builds.append(_build(kernel, family, dtype, max_registers=_TIMED_MAX_REGISTERS.get(family)))
        builds.append(_build(kernel, "128", "bf16", label_extra=" mask", use_mask=True))
        builds.append(_build(kernel, "128", "bf16", label_extra=" window", window=4095))
        builds.append(_build(kernel, "64", "bf16", label_extra=" sinks+window", has_sink=True, window=127))
        builds.append(_build(kernel, "128", "bf16", label_extra=" softcap+xai", logit_cap=30.0, xai=4096))
        builds.append(_build(kernel, "128", "bf16", label_extra=" noncausal", causal=False))
    builds.append(_build("extend_attention_kernel", "128", "bf16", label_extra=" mask+prefix", use_mask=True, skip_prefix_mask=False))
    builds.append(_build("extend_attention_kernel", "576/512", "bf16", label_extra=" mask", use_mask=True))
    return builds
