"""Extend attention (prefill over a cached prefix): the ops, their reference twins and their implementations.

Two forms, as in SGLang:

* `extend_attention` (two-stage): the prefix keys come from the pool through `ExtendMetadata.kv_indices`
  (prefix only), the new tokens' K/V from the contiguous `k_new`/`v_new` (same rows as `q`).
* `extend_attention_unified` (one stage, deterministic): every key, prefix and new, comes from the pool through one
  index list (`ExtendUnifiedMetadata`), so the new tokens' K/V must already be written to the pool. Keys are
  visited in one loop in absolute key order with tiles at multiples of BLOCK_N, so a token's output does not depend
  on where the prefix/new split falls (radix-cache hits, chunked prefill).

Implementations (`IMPLEMENTATIONS`, in order of preference; each takes what it can and names why it declines the
rest, `impl=` forces one):

  ================  ==========  ==================================================================================
  "mgpu"            two-stage   Pallas Mosaic GPU kernel, FlashAttention-3's schedule (`jaxattn.impl.mgpu_extend`):
                                sm_90, bf16/f16, head dims 64, 128, 192/128, 256, causal or not, window (causal or with
                                a custom mask), soft cap, sinks, xai temperature, custom and draft masks; lists of
                                whole pages copied page by page (`tuning.sm90.EXTEND_MGPU_PAGE_COPY_MIN_ROWS`).
  "triton"          two-stage   SGLang's two-stage Triton kernel, every feature (`jaxattn.impl.triton_extend`), and
                                draft masks (a tree as per-row bits).
  "mgpu-unified"    unified     The Mosaic GPU kernel over one list per sequence, tiles at fixed listed-key
                                offsets (deterministic): as "mgpu" less draft masks, on lists not cut for a window.
  "triton-unified"  unified     SGLang's deterministic unified Triton kernel, every feature.
  "mgpu-fp8",       both        By name: the Mosaic GPU kernel reading fp8 pools itself (its producer converts
  "mgpu-unified-                each tile in shared memory) where "mgpu" and "mgpu-unified" gather and dequantise
  fp8"                          the listed keys first; head dims 64, 128, 256. "mgpu" runs two-stage calls this
                                way itself where at most 4 CTAs read each prefix tile (`tuning.sm90.
                                EXTEND_MGPU_FP8_IN_KERNEL_MAX_READERS`; E3-FP8, 128 new tokens at 32/8 heads: 9%
                                faster than dequantising; slower from 256 new tokens there; H100, 0281adf).
  ================  ==========  ==================================================================================

A `config=` picks among them by its type (`ExtendConfig`: the Triton kernels; `MgpuExtendConfig`: Mosaic GPU).

Semantics are `jaxattn.reference`'s (queries are the last q_len tokens; scale -> softcap -> xai temperature -> mask;
a custom mask replaces causal; a window W keeps W + 1 keys; sinks join the denominator only; rows with no visible key
give 0). xai temperature uses SGLang's log2 formula (2-stage and decode kernels) in *both* kernels; SGLang's unified
kernel uses ``L / (pos + 1)`` instead, which jaxattn does not copy. Output rows past ``qo_indptr[-1]`` (padding
tokens) are 0.

Metadata is built inside jit by `extend_metadata` / `extend_unified_metadata` (`jaxattn.metadata`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxattn.calls import ExtendCall
from jaxattn.checks import (
    index_i32,
    INDEX_DTYPES,
    check_array,
    check_extend_args,
    check_extend_draft_mask,
    check_new_tokens,
    jit_with_kv_scales,
    launch_mode_argument,
)
from jaxattn.fp8 import dequantised_rows, kv_scale_table
from jaxattn.impl import mgpu_extend, triton_extend
from jaxattn.kv_indices import build_unified_kv_indices_reference
from jaxattn.launch import launch_mode as resolve_launch_mode
from jaxattn.metadata import (  # noqa: F401  (re-exported: the builders' documented home before jaxattn.metadata)
    ExtendMetadata,
    ExtendUnifiedMetadata,
    draft_mask_words,
    extend_metadata,
    extend_unified_metadata,
    listed_columns_mask,
    listed_prefix,
)
from jaxattn.reference import ragged_paged_attention_reference
from jaxattn.registry import select
from jaxattn.tuning import (  # noqa: F401  (re-exported)
    ExtendConfig,
    MgpuExtendConfig,
    extend_config as default_config,
    head_dim_family,
    with_custom_mask,
)
from jaxattn.tuning.sm90 import EXTEND as SM90_CONFIGS  # noqa: F401  (re-exported)

IMPLEMENTATIONS = (mgpu_extend.IMPLEMENTATION, triton_extend.TWO_STAGE, mgpu_extend.UNIFIED, triton_extend.UNIFIED,
                   mgpu_extend.FP8, mgpu_extend.UNIFIED_FP8)
CONFIG_TYPES = (ExtendConfig, MgpuExtendConfig)

_STATIC = ("causal", "skip_prefix_custom_mask", "sliding_window", "logit_cap", "xai_temperature_len", "sm_scale", "config",
           "launch_mode", "mode", "impl")


def _call(form, q, k_new, v_new, k_pool, v_pool, meta, kv_start_pos, *, causal, custom_mask, skip_prefix_custom_mask,
          sliding_window, logit_cap, sinks, xai_temperature_len, sm_scale, config, launch_mode, k_scale, v_scale,
          draft_mask=None):
    return ExtendCall(
        form=form, q=q, k_new=k_new, v_new=v_new, k_pool=k_pool, v_pool=v_pool, meta=meta, kv_start_pos=kv_start_pos,
        causal=bool(causal), custom_mask=custom_mask, skip_prefix_custom_mask=bool(skip_prefix_custom_mask),
        sliding_window=int(sliding_window), logit_cap=float(logit_cap), sinks=sinks,
        xai_temperature_len=int(xai_temperature_len),
        sm_scale=1.0 / math.sqrt(q.shape[2]) if sm_scale is None else float(sm_scale), config=config,
        launch_mode=resolve_launch_mode(launch_mode), kv_scales=kv_scale_table(k_scale, v_scale, v_pool.shape[1]),
        draft_mask=draft_mask,
    )


@jit_with_kv_scales(static_argnames=_STATIC)
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
    config: ExtendConfig | MgpuExtendConfig | None = None,
    launch_mode: str | None = None,
    impl: str | None = None,
    mode: str | None = None,
    k_scale=None,
    v_scale=None,
    draft_mask: jax.Array | None = None,
) -> jax.Array:
    """Two-stage extend attention (SGLang's extend_attention_fwd): cached prefix from the pool, new tokens contiguous.

    Runs the first of `IMPLEMENTATIONS` that takes the call: on an H200/H100 (sm_90), bf16/f16 calls with head dims
    64, 128, 192/128 or 256 (causal or not; a sliding window, soft cap, sinks, xai temperature and a custom mask are
    taken, alone or together) run the Mosaic GPU kernel (FlashAttention-3's schedule, 1.5x faster at E1;
    3.5x FlashInfer fa2 on a tree-verify step); everything else runs SGLang's two-stage Triton kernel.

    Args:
      q: [tokens, q_heads, qk_head_dim] f32/f16/bf16: the new tokens' queries, sequence b at meta.qo_indptr[b]:[b+1].
      k_new: [tokens, kv_heads, qk_head_dim], v_new: [tokens, kv_heads, v_head_dim]: the new tokens' K/V (q's dtype).
      k_pool: [slots, kv_heads, qk_head_dim], v_pool: [slots, kv_heads, v_head_dim]: the cache (q's dtype, or fp8
        e4m3fn / e5m2 read directly, `jaxattn.fp8`).
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
      sm_scale: default 1 / sqrt(qk_head_dim).
      config: an `ExtendConfig` (Triton tiles; default: the tuned table) or an `MgpuExtendConfig` (Mosaic GPU tiles).
      launch_mode: "gpu", "interpret" or None (automatic); `mode` is its old name.
      impl: None (pick as above) or an implementation's name ("mgpu", "triton"); raises with the reason when that
        implementation cannot take the call.
      k_scale, v_scale: the pools hold K / k_scale and V / v_scale: None (1), a float > 0 or a float array [] /
        [kv_heads] (traced). They scale the cached prefix only: k_new / v_new are the step's own values.
      draft_mask: i32/u32[tokens, words], the compact form of a tree mask (speculative verify): row r, new token t of
        its sequence, sees the sequence's new token j iff bit j % 32 of word j // 32 is set (`draft_mask_words` packs
        boolean rows), and its whole listed prefix (a window still applies).
        Replaces causal; not with custom_mask. No [q_len, kv_len] mask is built or read. The Triton kernel takes it.

    Returns:
      o: [tokens, q_heads, v_head_dim] in q's dtype; rows past qo_indptr[-1] are 0.
    """
    check_extend_draft_mask(q, draft_mask, custom_mask)
    check_extend_args(q, k_pool, v_pool, meta, meta_type=ExtendMetadata, builder="extend_metadata", custom_mask=custom_mask,
                      sinks=sinks, sliding_window=sliding_window, config=config, config_types=CONFIG_TYPES,
                      logit_cap=logit_cap, xai_temperature_len=xai_temperature_len, sm_scale=sm_scale,
                      k_scale=k_scale, v_scale=v_scale, causal=causal, skip_prefix_custom_mask=skip_prefix_custom_mask)
    check_new_tokens(q, k_new, v_new, k_pool, v_pool)
    call = _call("two_stage", q, k_new, v_new, k_pool, v_pool, meta, meta.kv_start_pos, causal=causal,
                 custom_mask=custom_mask, skip_prefix_custom_mask=skip_prefix_custom_mask, sliding_window=sliding_window,
                 logit_cap=logit_cap, sinks=sinks, xai_temperature_len=xai_temperature_len, sm_scale=sm_scale,
                 config=config, launch_mode=launch_mode_argument(launch_mode, mode), k_scale=k_scale, v_scale=v_scale,
                 draft_mask=draft_mask)
    return select(IMPLEMENTATIONS, call, impl).run(call)


@jit_with_kv_scales(static_argnames=tuple(s for s in _STATIC if s != "skip_prefix_custom_mask"))
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
    kv_start_pos: jax.Array | None = None,
    config: ExtendConfig | MgpuExtendConfig | None = None,
    launch_mode: str | None = None,
    impl: str | None = None,
    mode: str | None = None,
    window_start_pos: jax.Array | None = None,
    k_scale=None,
    v_scale=None,
) -> jax.Array:
    """Deterministic one-stage extend attention (SGLang's extend_attention_fwd_unified), all keys through the pool.

    Args:
      q: [tokens, q_heads, qk_head_dim]; k_pool, v_pool: the cache, the new tokens' K/V already written at the slots
        meta lists for them.
      meta: `ExtendUnifiedMetadata` (see `extend_unified_metadata`).
      custom_mask: flat, per sequence row-major [q_len, kv_len] over the *listed* keys (prefix + new); replaces causal.
      kv_start_pos: optional i32[batch]: absolute position of each sequence's first listed key (default
        meta.kv_start_pos); `window_start_pos` is its old name.
      causal, sliding_window, logit_cap, sinks, xai_temperature_len, sm_scale, config, launch_mode, impl: as
        `extend_attention`. Implementations of the unified form: "mgpu-unified" (sm_90, bf16/f16, head dims 64, 128,
        192/128 or 256, no window or custom mask; tiles of config.block_kv keys) and "triton-unified" (every feature; tiles of
        config.block_n keys), picked in that order.
      k_scale, v_scale: as `extend_attention`; here they scale every key and value (all come from the pool).

    Returns:
      o: [tokens, q_heads, v_head_dim] in q's dtype; rows past qo_indptr[-1] are 0. For a fixed implementation and
      tile a token's row is bit-identical however its sequence is split into prefix and new tokens.
    """
    kv_start_pos = _unified_start_pos(q, k_pool, v_pool, meta, custom_mask, sinks, sliding_window, config, logit_cap,
                                      xai_temperature_len, kv_start_pos, window_start_pos, sm_scale, k_scale, v_scale,
                                      causal=causal)
    call = _call("unified", q, None, None, k_pool, v_pool, meta, kv_start_pos, causal=causal, custom_mask=custom_mask,
                 skip_prefix_custom_mask=False, sliding_window=sliding_window, logit_cap=logit_cap, sinks=sinks,
                 xai_temperature_len=xai_temperature_len, sm_scale=sm_scale, config=config,
                 launch_mode=launch_mode_argument(launch_mode, mode), k_scale=k_scale, v_scale=v_scale)
    return select(IMPLEMENTATIONS, call, impl).run(call)


def _unified_start_pos(q, k_pool, v_pool, meta, custom_mask, sinks, sliding_window, config, logit_cap,
                       xai_temperature_len, kv_start_pos, window_start_pos, sm_scale=None, k_scale=None, v_scale=None,
                       causal=True):
    """Checks the unified form's arguments; returns the start positions it uses."""
    batch = check_extend_args(q, k_pool, v_pool, meta, meta_type=ExtendUnifiedMetadata, builder="extend_unified_metadata",
                              custom_mask=custom_mask, sinks=sinks, sliding_window=sliding_window, config=config,
                              config_types=CONFIG_TYPES, logit_cap=logit_cap, xai_temperature_len=xai_temperature_len,
                              sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, causal=causal)
    check_array("meta.prefix_lens", meta.prefix_lens, shape=(batch,), dtypes=INDEX_DTYPES, what="[batch]")
    name = "kv_start_pos"
    if window_start_pos is not None:
        if kv_start_pos is not None:
            raise ValueError("give kv_start_pos only (window_start_pos is its old name)")
        name, kv_start_pos = "window_start_pos", window_start_pos
    if kv_start_pos is None:
        return meta.kv_start_pos
    check_array(name, kv_start_pos, shape=(batch,), dtypes=INDEX_DTYPES, what="[batch]")
    return kv_start_pos


# ---------------------------------------------------------------------------------------------
# References: same signatures, built on ragged_paged_attention_reference.


def extend_attention_reference(
    q, k_new, v_new, k_pool, v_pool, meta, *, causal=True, custom_mask=None, skip_prefix_custom_mask=True, sliding_window=-1,
    logit_cap=0.0, sinks=None, xai_temperature_len=-1, sm_scale=None, config=None, launch_mode=None, impl=None, mode=None,
    k_scale=None, v_scale=None, draft_mask=None,
):
    """Pure-jnp twin of `extend_attention` (`config`, `launch_mode`, `impl` ignored).

    The listed prefix rows are gathered (and scaled, for fp8 pools) into one float32 buffer, the new tokens appended
    (entry e of meta.kv_indices at row e, token t at row kv_capacity + t), each sequence's key list is its listed
    prefix then its new rows, and the custom mask is re-cut to those listed columns. No pool-sized copy.
    """
    del config, launch_mode, impl, mode
    check_extend_draft_mask(q, draft_mask, custom_mask)
    check_extend_args(q, k_pool, v_pool, meta, meta_type=ExtendMetadata, builder="extend_metadata", custom_mask=custom_mask,
                      sinks=sinks, sliding_window=sliding_window, logit_cap=logit_cap,
                      xai_temperature_len=xai_temperature_len, k_scale=k_scale, v_scale=v_scale, causal=causal,
                      skip_prefix_custom_mask=skip_prefix_custom_mask)
    check_new_tokens(q, k_new, v_new, k_pool, v_pool)
    scales = kv_scale_table(k_scale, v_scale, v_pool.shape[1])
    return _extend_reference(q, k_new, v_new, k_pool, v_pool, meta, custom_mask, sinks, scales, draft_mask,
                             causal=causal, skip_prefix_custom_mask=skip_prefix_custom_mask,
                             sliding_window=int(sliding_window), logit_cap=float(logit_cap),
                             xai_temperature_len=int(xai_temperature_len),
                             sm_scale=None if sm_scale is None else float(sm_scale))


# One jitted computation: called eagerly (tests, the CPU fallback outside jit), its dozens of small ops would each be
# compiled on their own; inside jit it is inlined as before.
@functools.partial(jax.jit, static_argnames=("causal", "skip_prefix_custom_mask", "sliding_window", "logit_cap",
                                             "xai_temperature_len", "sm_scale"))
def _extend_reference(q, k_new, v_new, k_pool, v_pool, meta, custom_mask, sinks, scales, draft_mask, *, causal,
                      skip_prefix_custom_mask, sliding_window, logit_cap, xai_temperature_len, sm_scale):
    tokens, capacity = q.shape[0], meta.kv_capacity
    prefix_slots = meta.kv_indices  # outside the pool: slot 0 (dequantised_rows)
    k_prefix = dequantised_rows(k_pool, prefix_slots, None if scales is None else scales[0], jnp.float32)
    v_prefix = dequantised_rows(v_pool, prefix_slots, None if scales is None else scales[1], jnp.float32)
    k_all = jnp.concatenate([k_prefix, k_new.astype(jnp.float32)])
    v_all = jnp.concatenate([v_prefix, v_new.astype(jnp.float32)])
    qo_indptr = index_i32(meta.qo_indptr)
    extend_lens = qo_indptr[1:] - qo_indptr[:-1]
    kv_indptr, kv_indices, listed = build_unified_kv_indices_reference(
        index_i32(meta.kv_indptr), jnp.arange(capacity, dtype=jnp.int32), qo_indptr[:-1], extend_lens,
        capacity + jnp.arange(max(tokens, 1), dtype=jnp.int32), capacity=capacity + max(tokens, 1),
    )
    mask, mask_indptr = None, None
    if custom_mask is not None:
        mask, mask_indptr = listed_columns_mask(custom_mask, meta.mask_indptr, listed, meta.kv_start_pos, extend_lens,
                                                skip_prefix_custom_mask)
    return ragged_paged_attention_reference(
        q, k_all, v_all, qo_indptr, kv_indptr, kv_indices, causal=causal, custom_mask=mask, mask_indptr=mask_indptr,
        sliding_window=sliding_window, logit_cap=logit_cap, sinks=sinks, xai_temperature_len=xai_temperature_len,
        sm_scale=sm_scale, kv_start_pos=meta.kv_start_pos, max_q_len=meta.max_extend_len,
        max_kv_len=meta.kv_capacity + meta.max_extend_len, draft_mask=draft_mask,
    )


def extend_attention_unified_reference(
    q, k_pool, v_pool, meta, *, causal=True, custom_mask=None, sliding_window=-1, logit_cap=0.0, sinks=None,
    xai_temperature_len=-1, sm_scale=None, kv_start_pos=None, config=None, launch_mode=None, impl=None, mode=None,
    window_start_pos=None, k_scale=None, v_scale=None,
):
    """Pure-jnp twin of `extend_attention_unified` (`config`, `launch_mode`, `impl` ignored)."""
    del launch_mode, impl, mode
    start_pos = _unified_start_pos(q, k_pool, v_pool, meta, custom_mask, sinks, sliding_window, config, logit_cap,
                                   xai_temperature_len, kv_start_pos, window_start_pos, k_scale=k_scale, v_scale=v_scale,
                                   causal=causal)
    return ragged_paged_attention_reference(
        q, k_pool, v_pool, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, causal=causal,
        custom_mask=None if custom_mask is None else custom_mask.astype(bool),
        mask_indptr=None if custom_mask is None else meta.mask_indptr, sliding_window=sliding_window,
        logit_cap=logit_cap, sinks=sinks, xai_temperature_len=xai_temperature_len, sm_scale=sm_scale,
        kv_start_pos=start_pos, max_q_len=meta.max_extend_len, max_kv_len=meta.kv_capacity, k_scale=k_scale,
        v_scale=v_scale,
    )
