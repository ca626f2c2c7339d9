"""Causal extend attention on Hopper through a Pallas Mosaic GPU kernel (`kernels/extend_attention_mgpu.py`).

`extend_attention_mgpu` takes the same inputs as `jaxattn.extend.extend_attention` for its causal calls (no custom
mask, no xai temperature; a sliding window, a soft cap and attention sinks are taken, alone or together) and returns
the same output. It exists for speed: the FlashAttention-3 schedule (a producer warpgroup, two consumer warpgroups
with wgmma from registers) that the Triton kernels cannot express on this stack. The producer reads the cached
prefix straight from the pool, row by row through kv_indices (`cp.async`: Hopper's TMA cannot gather single rows),
so the call needs no scratch beyond its output and, when tokens is not a multiple of 8, a padded copy of q. Under a
window it loads only the K/V tiles the window reaches.

It needs an sm_90 GPU and jax's CUDA plugin (Mosaic GPU); there is no CPU path (Pallas' GPU interpreter does not run
a wgmma whose left operand is in registers). The reference is `jaxattn.extend.extend_attention_reference`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxattn import hardware, tuning
from jaxattn.calls import ExtendCall, score_features
from jaxattn.checks import check_array, check_extend_args, check_new_tokens
from jaxattn.fp8 import dequantised_rows, is_fp8
from jaxattn.launch import launch_mode as resolve_launch_mode
from jaxattn.metadata import ExtendMetadata
from jaxattn.registry import Implementation
from jaxattn.tuning import ExtendConfig, MgpuExtendConfig

MGPU_DTYPES = (jnp.bfloat16, jnp.float16)
MGPU_HEAD_DIMS = (64, 128)  # equal q/k and v head dims: both consumer warpgroups' accumulators fit in registers


def _cuda_runtime_version() -> int | None:
    try:
        from jax._src.lib import cuda_versions  # private: the version JAX's CUDA plugin was loaded with
    except ImportError:
        return None
    return None if cuda_versions is None else cuda_versions.cuda_runtime_get_version()


def _head_dims_supported(qk_head_dim: int, v_head_dim: int) -> bool:
    return qk_head_dim == v_head_dim and qk_head_dim in MGPU_HEAD_DIMS


# The score features of `ExtendCall.features` the kernel takes (static flags; off, the plain kernel is unchanged).
MGPU_FEATURES = ("sliding window", "soft cap", "sinks")
_DECLINED_FEATURES = {"non-causal": "non-causal attention (the kernel is causal only)", "custom mask": "a custom mask",
                      "xai temperature": "xai temperature"}


def _unsupported(dtype, qk_head_dim, v_head_dim, features, launch_mode) -> str | None:
    """Why the kernel cannot take a call with these facts, or None (the one list of its limits)."""
    if jnp.dtype(dtype) not in map(jnp.dtype, MGPU_DTYPES):
        return f"dtype {jnp.dtype(dtype).name} (bf16/f16 only)"
    if not _head_dims_supported(qk_head_dim, v_head_dim):
        return f"head dims {qk_head_dim}/{v_head_dim} (equal, 64 or 128 only)"
    declined = [_DECLINED_FEATURES.get(f, f) for f in features if f not in MGPU_FEATURES]
    if declined:
        return ", ".join(declined)
    if launch_mode != "gpu":
        return "no GPU (or an interpreted launch mode)"
    if not hardware.is_sm90():
        return f"device {hardware.gpu_family_name()} is not sm_90 (the kernel uses Hopper's wgmma and TMA)"
    version = _cuda_runtime_version()
    if version is not None and 12080 <= version < 12091:
        # JAX's own FlashAttention-3 Mosaic GPU kernel refuses causal masks for these versions (a ptxas miscompile).
        return f"CUDA runtime {version} (12.8.0-12.9.0 miscompile causal masks in Mosaic GPU kernels)"
    return None


def mgpu_unsupported(q, k_pool, v_pool, *, causal=True, custom_mask=None, sliding_window=-1, logit_cap=0.0, sinks=None,
                     xai_temperature_len=-1, mode=None) -> str | None:
    """Why `extend_attention_mgpu` cannot take this `extend_attention` call, or None when it can (trace time)."""
    features = score_features(causal=causal, custom_mask=custom_mask, sliding_window=sliding_window, logit_cap=logit_cap,
                              sinks=sinks, xai_temperature_len=xai_temperature_len)
    mode_name = mode if mode not in (None, "gpu") else resolve_launch_mode(mode)
    return _unsupported(q.dtype, q.shape[2], v_pool.shape[2], features, mode_name)


def declines(call: ExtendCall) -> str | None:
    if call.form != "two_stage":
        return "takes the two-stage form only"
    if isinstance(call.config, ExtendConfig):
        return "config is a Triton ExtendConfig (pass an MgpuExtendConfig, or none, for this kernel)"
    return _unsupported(call.q.dtype, call.qk_head_dim, call.v_head_dim, call.features, call.launch_mode)


def _check_config(config: MgpuExtendConfig, head_dim: int) -> None:
    if not isinstance(config, MgpuExtendConfig):
        raise ValueError(f"config must be an MgpuExtendConfig or None; got {type(config).__name__}")
    limit = hardware.SM90.shared_memory_bytes
    if config.shared_memory_bytes(head_dim) > limit:
        raise ValueError(
            f"config {config} needs {config.shared_memory_bytes(head_dim)} B of shared memory at head dim {head_dim}; "
            f"sm_90 has {limit} (fewer stages or a smaller block_kv)")


def run(call: ExtendCall):
    config = call.config or tuning.mgpu_extend_config(call.qk_head_dim)
    _check_config(config, call.qk_head_dim)
    k_pool, v_pool, meta = call.k_pool, call.v_pool, call.meta
    if call.kv_scales is not None or is_fp8(k_pool.dtype) or is_fp8(v_pool.dtype):
        k_pool, v_pool, meta = dequantised_prefix(k_pool, v_pool, meta, call.kv_scales, call.q.dtype)
    return _run_kernel(call.q, call.k_new, call.v_new, k_pool, v_pool, meta, call.sm_scale, config,
                       call.sliding_window, call.logit_cap, call.sinks)


def dequantised_prefix(k_pool, v_pool, meta: ExtendMetadata, kv_scales, dtype):
    """(k, v, meta) for a scaled (fp8) pool: the listed prefix rows gathered, scaled and cast to q's `dtype`, with meta
    listing them in order (entry e at row e).

    The kernel's producer copies 16-bit rows into the tensor-core layout; fp8 rows would need a conversion pass in
    shared memory it does not have. The copy is kv_capacity rows (the batch's listed prefix bound), never the pool:
    at E1 (16k prefix rows x 8 heads x 128) 34 MB read and 67 MB written, about 1.5% of the kernel's time.
    Out-of-range slots are clamped into the pool, as the kernel does.
    """
    slots = jnp.clip(meta.kv_indices.astype(jnp.int32), 0, k_pool.shape[0] - 1)
    k = dequantised_rows(k_pool, slots, None if kv_scales is None else kv_scales[0], dtype)
    v = dequantised_rows(v_pool, slots, None if kv_scales is None else kv_scales[1], dtype)
    listed = dataclasses.replace(meta, kv_indices=jnp.arange(meta.kv_indices.shape[0], dtype=meta.kv_indices.dtype))
    return k, v, listed


IMPLEMENTATION = Implementation("mgpu", declines, run)


@functools.partial(jax.jit, static_argnames=("sliding_window", "logit_cap", "sm_scale", "config"))
def extend_attention_mgpu(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    meta: ExtendMetadata,
    *,
    sliding_window: int = -1,
    logit_cap: float = 0.0,
    sinks: jax.Array | None = None,
    sm_scale: float | None = None,
    config: MgpuExtendConfig | None = None,
) -> jax.Array:
    """Causal extend attention (prefix from the pool, new tokens contiguous) with the Hopper Mosaic GPU kernel.

    Args:
      q: [tokens, q_heads, head_dim] bf16/f16, head_dim 64 or 128; sequence b's new tokens at meta.qo_indptr[b]:[b+1].
      k_new, v_new: [tokens, kv_heads, head_dim]: the new tokens' K/V (q's dtype). q_heads % kv_heads == 0 (GQA).
      k_pool, v_pool: [slots, kv_heads, head_dim]: the cache; meta.kv_indices lists each sequence's prefix slots.
      meta: `ExtendMetadata` from `jaxattn.metadata.extend_metadata`, its prefix lists cut for a window or full.
      sliding_window: W >= 0: a query sees keys with q_pos - k_pos <= W (W + 1 keys); <= meta.sliding_window when the
        lists were cut for a window. The kernel loads and computes only the K/V tiles the window reaches.
      logit_cap: > 0 caps scores with cap * tanh(s / cap) (s already scaled). sinks: f32[q_heads] natural-log
        logits that join each row's softmax denominator only.
      sm_scale: default 1 / sqrt(head_dim). config: `MgpuExtendConfig` (default 64 x 128 tiles, 2 stages).
      Slots past the pool (or negative) are clamped into it: a bad index reads a wrong row, never outside the pool
      (`jaxattn.checked` reports them).

    Returns:
      o: [tokens, q_heads, head_dim] in q's dtype, as `extend_attention(..., causal=True)` with the same features;
      rows past qo_indptr[-1], and rows of a sequence past meta.max_extend_len, are 0.
    """
    check_array("q", q, ndim=3, dtypes=MGPU_DTYPES, what="[tokens, q_heads, head_dim] bf16/f16")
    check_extend_args(q, k_pool, v_pool, meta, meta_type=ExtendMetadata, builder="extend_metadata", custom_mask=None,
                      sinks=sinks, sliding_window=sliding_window, logit_cap=logit_cap, sm_scale=sm_scale)
    check_new_tokens(q, k_new, v_new, k_pool, v_pool)
    if is_fp8(k_pool.dtype) or is_fp8(v_pool.dtype):
        raise ValueError("extend_attention_mgpu takes pools of q's dtype; fp8 pools go through "
                         "jaxattn.extend.extend_attention(..., k_scale=, v_scale=), which dequantises the listed prefix")
    head_dim, v_dim = q.shape[2], v_pool.shape[2]
    if not _head_dims_supported(head_dim, v_dim):
        raise ValueError(
            f"extend_attention_mgpu takes equal q/k and v head dims of 64 or 128; got qk_head_dim {head_dim}, "
            f"v_head_dim {v_dim} (use jaxattn.extend.extend_attention)")
    config = config or tuning.mgpu_extend_config(head_dim)
    _check_config(config, head_dim)
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    return _run_kernel(q, k_new, v_new, k_pool, v_pool, meta, sm_scale, config, sliding_window, logit_cap, sinks)


def _run_kernel(q, k_new, v_new, k_pool, v_pool, meta, sm_scale: float, config: MgpuExtendConfig, sliding_window: int,
                logit_cap: float, sinks):
    """The kernel launch on checked arguments (the registry's route and `extend_attention_mgpu` share it)."""
    from jaxattn.kernels.extend_attention_mgpu import extend_attention_mgpu_kernel
    tokens, q_heads, head_dim = q.shape
    if tokens == 0 or meta.qo_indptr.shape[0] == 1:
        return jnp.zeros((tokens, q_heads, head_dim), q.dtype)
    # Q and O move by TMA in 8-row tiles, which wants an array of whole 8-row tiles no shorter than a block_q box:
    # pad q (a copy) when tokens is not a multiple of 8 or is below block_q. k_new/v_new need no copy: their whole
    # tiles come by TMA only when tokens allows it (below), the others row by row.
    rows = max(-(-tokens // 8) * 8, config.block_q)
    if rows > tokens:
        q = jnp.pad(q, ((0, rows - tokens), (0, 0), (0, 0)))
    # Zeros that the kernel overwrites in place (aliased): rows it does not compute stay 0.
    out_ref = jax.new_ref(jnp.zeros((rows, q_heads, head_dim), q.dtype))
    kv_indices = meta.kv_indices
    if kv_indices.shape[0] == 0:  # a kernel operand needs an address; no row of it is listed
        kv_indices = jnp.zeros((1,), kv_indices.dtype)
    extend_attention_mgpu_kernel(
        q, k_new, v_new, k_pool, v_pool, kv_indices,
        meta.qo_indptr.astype(jnp.int32), meta.kv_indptr.astype(jnp.int32), out_ref,
        max_extend_len=meta.max_extend_len, sm_scale=sm_scale,
        block_q=config.block_q, block_kv=config.block_kv, stages=config.stages,
        sliding_window=int(sliding_window) if sliding_window >= 0 else -1,
        logit_cap=float(logit_cap) if logit_cap > 0 else 0.0,
        sinks=None if sinks is None else sinks.astype(jnp.float32),
        # Whole new-key tiles by TMA where Mosaic allows it (an array of whole 8-row tiles, no shorter than a box).
        tma_new_tiles=tokens % 8 == 0 and tokens >= config.block_kv,
    )
    return out_ref[...][:tokens]
