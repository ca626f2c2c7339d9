"""Extend attention on Hopper through a Pallas Mosaic GPU kernel (`kernels/extend_attention_mgpu.py`).

Two implementations of `jaxattn.extend`'s contract on one kernel:

* "mgpu" (`IMPLEMENTATION`, and `extend_attention_mgpu`): the two-stage form (prefix from the pool, new tokens
  contiguous), causal or not, with a sliding window (causal, or with a custom mask), a soft cap, sinks, xai
  temperature, custom masks (speculative tree verify) and draft masks (per-row draft words), alone or together.
* "mgpu-unified" (`UNIFIED`, and `extend_attention_unified_mgpu`): the deterministic unified form (every key through
  the pool, one list per sequence): tiles at fixed listed-key offsets (multiples of block_kv); a masked tile only
  replaces invisible scores, so a token's row is bit-identical however its sequence is split into prefix and new
  tokens. Causal or not, soft cap, sinks, xai temperature, a sliding window (causal, on uncut lists).

* "mgpu-fp8" / "mgpu-unified-fp8" (`FP8`, `UNIFIED_FP8`; by name, and "mgpu" for short extends: `converts_in_kernel`):
  either form over fp8 pools read by the kernel (its producer converts each tile in shared memory), where the two
  above gather and dequantise the listed keys first (`dequantised_prefix`). Two conversions
  (`MgpuExtendConfig.fp8_tiles`): "q_dtype" (value x scale rounded to q's dtype: on the H100 at 179e77b equal to the
  dequantising route bit for bit, and 1.32-1.50x slower than it at E1-FP8 / E3-FP8) and "f16" (the two-stage default
  at head dims 64/128: exact unscaled f16 tiles, a sixth of the conversion's instructions, the scales applied by the
  consumers; on the H100 at 35d899e within bf16's tolerance of the reference, 8% faster than the dequantising route at
  E3-FP8 and 18% slower at E1-FP8; 9% and 18% at 0281adf).

They exist for speed: the FlashAttention-3 schedule (a producer warpgroup, two consumer warpgroups with wgmma from
registers) that the Triton kernels cannot express on this stack. The producer reads pool rows straight through the
index list (`cp.async`: Hopper's TMA cannot gather single rows), so a call needs no scratch beyond its output and,
when tokens is not a multiple of 8, a padded copy of q. Under a window it loads only the K/V tiles the window reaches.

It needs an sm_90 GPU and jax's CUDA plugin (Mosaic GPU); there is no CPU path (Pallas' GPU interpreter does not run
a wgmma whose left operand is in registers). The references are `jaxattn.extend.extend_attention_reference` and
`extend_attention_unified_reference`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxattn import hardware, tuning
from jaxattn.calls import ExtendCall, score_features
from jaxattn.checks import check_array, check_extend_args, check_extend_draft_mask, check_new_tokens, index_i32
from jaxattn.fp8 import dequantised_rows, is_fp8, scale_table_operand
from jaxattn.tuning.sm90 import EXTEND_MGPU_FP8_IN_KERNEL_MAX_READERS, EXTEND_MGPU_PAGE_COPY_MIN_ROWS
from jaxattn.launch import launch_mode as resolve_launch_mode, operand_or_unread
from jaxattn.metadata import ExtendMetadata, ExtendUnifiedMetadata
from jaxattn.registry import Implementation
from jaxattn.tuning import ExtendConfig, MgpuExtendConfig

MGPU_DTYPES = (jnp.bfloat16, jnp.float16)
# (qk_head_dim, v_head_dim) pairs: multiples of 64 (the 128-byte swizzled tiles) whose accumulators and tiles fit both
# consumer warpgroups' registers and shared memory; 192/128 is DeepSeek's non-absorbed (MHA) prefill, 256/256 Gemma's
# (64-key tiles, partial O tiles stored in 64-column chunks).
MGPU_HEAD_DIMS = ((64, 64), (128, 128), (192, 128), (256, 256))


def _head_dims_supported(qk_head_dim: int, v_head_dim: int) -> bool:
    return (qk_head_dim, v_head_dim) in MGPU_HEAD_DIMS


HEAD_DIMS_TEXT = ", ".join(f"{qk}/{v}" for qk, v in MGPU_HEAD_DIMS)  # for messages


# The score features of `ExtendCall.features` the kernel takes, per form (static flags; off, the plain kernel is
# unchanged). The unified form's tiles sit at fixed listed-key offsets, so it takes a window on uncut lists only (a
# window-cut list moves them with the list's start: `_declines_form`). Draft masks and unified windows joined after
# their GPU tests (2026-12-04, e1003ed / 4d7ea2d: 21 passed).
MGPU_FEATURES = {"two_stage": ("sliding window", "soft cap", "sinks", "xai temperature", "non-causal", "custom mask",
                               "draft mask"),
                 "unified": ("sliding window", "soft cap", "sinks", "xai temperature", "non-causal", "custom mask")}
_FEATURE_NAMES = {"custom mask": "a custom mask", "sliding window": "a sliding window",
                  "draft mask": "a draft mask (per-row bits)"}


def _unsupported(dtype, qk_head_dim, v_head_dim, features, launch_mode, form="two_stage") -> str | None:
    """Why the kernel cannot take a call of `form` with these facts, or None (the one list of its limits)."""
    if jnp.dtype(dtype) not in map(jnp.dtype, MGPU_DTYPES):
        return f"dtype {jnp.dtype(dtype).name} (bf16/f16 only)"
    if not _head_dims_supported(qk_head_dim, v_head_dim):
        return f"head dims {qk_head_dim}/{v_head_dim} ({HEAD_DIMS_TEXT} only)"
    declined = [_FEATURE_NAMES.get(f, f) for f in features if f not in MGPU_FEATURES[form]]
    if declined:
        return ", ".join(declined) + (" in the unified form" if form == "unified" else "")
    if "sliding window" in features and "non-causal" in features:
        return "a sliding window with non-causal attention"
    return hardware.mosaic_gpu_unavailable(launch_mode)


def mgpu_unsupported(q, k_pool, v_pool, *, causal=True, custom_mask=None, sliding_window=-1, logit_cap=0.0, sinks=None,
                     xai_temperature_len=-1, mode=None, form="two_stage", draft_mask=None) -> str | None:
    """Why the Mosaic GPU kernel cannot take this `extend_attention` call (form "two_stage") or
    `extend_attention_unified` call (form "unified"), or None when it can (trace time)."""
    features = score_features(causal=causal, custom_mask=custom_mask, sliding_window=sliding_window, logit_cap=logit_cap,
                              sinks=sinks, xai_temperature_len=xai_temperature_len, draft_mask=draft_mask)
    mode_name = mode if mode not in (None, "gpu") else resolve_launch_mode(mode)
    return _unsupported(q.dtype, q.shape[2], v_pool.shape[2], features, mode_name, form)


def unified_window_on_full_lists(q, k_pool, v_pool, *, sliding_window, custom_mask=None, logit_cap=0.0, sinks=None,
                                 xai_temperature_len=-1, launch_mode=None) -> bool:
    """Whether a deterministic (unified) call under a sliding window should get its sequences' full key lists, the
    window given as the op's `sliding_window`, instead of window-cut lists: where this kernel takes that call. It
    starts at the tile the window reaches, so its cost follows the window; a cut list moves the tiles' fixed offsets
    with its start, which only the unified Triton kernel takes (2.2-2.8x slower at E1-W1024 on the H200, fe6f0e3).
    Pools of q's 16-bit dtype only: over fp8 (or scaled) pools the unified form dequantises every listed key first,
    the whole context on a full list. A verify step's custom mask joins the window there as on the H200's GPU tests
    (test_unified_custom_masks_match_reference[tree-window-cap-sinks], 0815fbc). q: [tokens, q_heads, qk_head_dim];
    k_pool, v_pool: [slots, kv_heads, D]."""
    if sliding_window < 0 or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        return False
    return mgpu_unsupported(q, k_pool, v_pool, causal=True, custom_mask=custom_mask, sliding_window=sliding_window,
                            logit_cap=logit_cap, sinks=sinks, xai_temperature_len=xai_temperature_len, mode=launch_mode,
                            form="unified") is None


def _declines_form(form: str):
    def declines(call: ExtendCall) -> str | None:
        if call.form != form:
            return f"takes the {form.replace('_', '-')} form only"
        if isinstance(call.config, ExtendConfig):
            return "config is a Triton ExtendConfig (pass an MgpuExtendConfig, or none, for this kernel)"
        if form == "unified" and call.meta.sliding_window >= 0:
            return "a window-cut key list in the unified form"
        if call.batch > hardware.GRID_YZ_LIMIT:  # the batch is the grid's third dimension
            return f"batch {call.batch} (at most {hardware.GRID_YZ_LIMIT}: the launch grid's third dimension)"
        return _unsupported(call.q.dtype, call.qk_head_dim, call.v_head_dim, call.features, call.launch_mode, form)

    return declines


def fp8_staging_fits(config: MgpuExtendConfig, head_dim: int) -> bool:
    """Whether a call over fp8 pools takes the config's staging tiles: asked for, and within sm_90's shared memory."""
    return config.fp8_staging and config.staged_shared_memory_bytes(head_dim) <= hardware.SM90.shared_memory_bytes


def _config(config: MgpuExtendConfig | None, qk_head_dim: int, v_head_dim: int, *, sliding_window: int = -1,
            max_extend_len: int | None = None) -> MgpuExtendConfig:
    """`config`, or the tuned one for these head dims (and window, extend length); checked against sm_90's shared
    memory."""
    config = config or tuning.mgpu_extend_config(qk_head_dim, v_head_dim, sliding_window=sliding_window,
                                                 max_extend_len=max_extend_len)
    if not isinstance(config, MgpuExtendConfig):
        raise ValueError(f"config must be an MgpuExtendConfig or None; got {type(config).__name__}")
    limit = hardware.SM90.shared_memory_bytes
    needed = config.shared_memory_bytes(qk_head_dim, v_head_dim)
    if needed > limit:
        raise ValueError(
            f"config {config} needs {needed} B of shared memory at head dims {qk_head_dim}/{v_head_dim}; "
            f"sm_90 has {limit} (fewer stages or a smaller block_kv)")
    return config


def _check_head_dims(op: str, q, v_pool, fallback: str) -> None:
    if not _head_dims_supported(q.shape[2], v_pool.shape[2]):
        raise ValueError(f"{op} takes q/k and v head dims {HEAD_DIMS_TEXT}; got qk_head_dim {q.shape[2]}, "
                         f"v_head_dim {v_pool.shape[2]} (use {fallback})")


def _call_config(call: ExtendCall) -> MgpuExtendConfig:
    """The call's tiles. The unified form's ignore its window: the short-window tile is chosen by the extend length
    (the bucket), and a deterministic call's block_kv, so its bits, must not depend on the bucket its batch landed in."""
    window = call.sliding_window if call.form == "two_stage" else -1
    return _config(call.config, call.qk_head_dim, call.v_head_dim, sliding_window=window,
                   max_extend_len=call.meta.max_extend_len)


def _launch(call: ExtendCall, k_pool, v_pool, meta, kv_scales=None):
    """The call's kernel launch over these pools and lists (the call's own, or the dequantised prefix's)."""
    return _run_kernel(call.q, call.k_new, call.v_new, k_pool, v_pool, meta, call.sm_scale, _call_config(call),
                       causal=call.causal, sliding_window=call.sliding_window, logit_cap=call.logit_cap, sinks=call.sinks,
                       xai_temperature_len=call.xai_temperature_len, kv_start_pos=call.kv_start_pos,
                       prefix_lens=meta.prefix_lens if call.form == "unified" else None, custom_mask=call.custom_mask,
                       skip_prefix_custom_mask=call.skip_prefix_custom_mask, draft_mask=call.draft_mask,
                       kv_scales=kv_scales)


def prefix_tile_readers(call: ExtendCall) -> int:
    """How many CTAs read (and, over fp8 pools in the kernel, convert) each prefix tile of a sequence's kv head: its
    q heads' CTAs times the CTAs a bucket of new tokens spans (`heads_per_cta`, the kernel's `head_rows_per_cta`)."""
    from jaxattn.kernels.extend_attention_mgpu import head_rows_per_cta

    config = _call_config(call)
    group = call.q.shape[1] // call.kv_heads
    heads = heads_per_cta(call.meta.max_extend_len, group, config)
    rows = head_rows_per_cta(config.consumers, config.block_q, heads)
    return group // heads * -(-call.meta.max_extend_len // rows)


def converts_in_kernel(call: ExtendCall) -> bool:
    """Whether "mgpu" runs a call over fp8 pools as "mgpu-fp8" does (the kernel converting the prefix tiles) rather than
    dequantising the listed prefix first: two-stage calls the fp8 form takes whose prefix tiles have at most
    `EXTEND_MGPU_FP8_IN_KERNEL_MAX_READERS` readers (`prefix_tile_readers`). (The unified form always dequantises:
    its bits must not depend on the bucket.)"""
    return (call.form == "two_stage" and _declines_fp8_form("two_stage")(call) is None
            and prefix_tile_readers(call) <= EXTEND_MGPU_FP8_IN_KERNEL_MAX_READERS)


def _run(call: ExtendCall):
    k_pool, v_pool, meta = call.k_pool, call.v_pool, call.meta
    if call.kv_scales is not None or is_fp8(k_pool.dtype) or is_fp8(v_pool.dtype):
        if converts_in_kernel(call):
            return _run_fp8(call)
        k_pool, v_pool, meta = dequantised_prefix(k_pool, v_pool, meta, call.kv_scales, call.q.dtype)
    return _launch(call, k_pool, v_pool, meta)


def dequantised_prefix(k_pool, v_pool, meta: ExtendMetadata | ExtendUnifiedMetadata, kv_scales, dtype):
    """(k, v, meta) for a scaled (fp8) pool: the listed rows (the prefix; in the unified form every key) gathered,
    scaled and cast to q's `dtype`, with meta listing them in order (entry e at row e).

    The kernel's producer copies 16-bit rows into the tensor-core layout; fp8 rows would need a conversion pass in
    shared memory it does not have. The copy is kv_capacity rows (the batch's listed prefix bound), never the pool:
    at E1 (16k prefix rows x 8 heads x 128) 34 MB read and 67 MB written, about 1.5% of the kernel's time.
    Slots outside the pool read slot 0, as the kernel does.
    """
    slots = meta.kv_indices
    k = dequantised_rows(k_pool, slots, None if kv_scales is None else kv_scales[0], dtype)
    v = dequantised_rows(v_pool, slots, None if kv_scales is None else kv_scales[1], dtype)
    # The gathered rows are in list order, not in pages.
    listed = dataclasses.replace(meta, kv_indices=jnp.arange(meta.kv_indices.shape[0], dtype=meta.kv_indices.dtype),
                                 page_size=1)
    return k, v, listed


IMPLEMENTATION = Implementation("mgpu", _declines_form("two_stage"), _run)
UNIFIED = Implementation("mgpu-unified", _declines_form("unified"), _run)


def _declines_fp8_form(form: str):
    """The form's limits, over fp8 pools read by the kernel itself (`FP8_HEAD_DIMS`, equal head dims)."""
    declines_form = _declines_form(form)

    def declines(call: ExtendCall) -> str | None:
        from jaxattn.kernels.extend_attention_mgpu import FP8_HEAD_DIMS

        pools = jnp.dtype(call.k_pool.dtype), jnp.dtype(call.v_pool.dtype)
        if not is_fp8(pools[0]) or pools[0] != pools[1]:
            return (f"{pools[0].name}/{pools[1].name} pools (one fp8 format only; other pools: impl=\"mgpu\" or "
                    "\"mgpu-unified\")")
        if call.qk_head_dim != call.v_head_dim or call.qk_head_dim not in FP8_HEAD_DIMS:
            return f"head dims {call.qk_head_dim}/{call.v_head_dim} over fp8 pools (equal, one of {FP8_HEAD_DIMS})"
        return declines_form(call)

    return declines


def _run_fp8(call: ExtendCall):
    scales = scale_table_operand(call.kv_scales, call.kv_heads)
    return _launch(call, call.k_pool, call.v_pool, call.meta, kv_scales=scales)


# fp8 pools read by the kernel (issue 26): the producer converts each pool tile in shared memory, so no step gathers
# and converts the listed prefix first (`dequantised_prefix`: about +28% at E3-FP8 on the H200). Every CTA reading a
# prefix tile converts it (64 times at E1), so it loses to dequantising once at long extends: "mgpu" takes it for
# short ones only (`converts_in_kernel`), the names force it.
FP8 = Implementation("mgpu-fp8", _declines_fp8_form("two_stage"), _run_fp8)
UNIFIED_FP8 = Implementation("mgpu-unified-fp8", _declines_fp8_form("unified"), _run_fp8)


def _latent_config(qk_head_dim: int, v_head_dim: int) -> MgpuExtendConfig | None:
    """The tiles over a latent cache at these head dims (`tuning.mgpu_extend_latent_config`), None where there are
    none; checked against sm_90's shared memory."""
    config = tuning.mgpu_extend_latent_config(qk_head_dim, v_head_dim)
    if config is not None and config.latent_shared_memory_bytes(qk_head_dim) > hardware.SM90.shared_memory_bytes:
        raise ValueError(f"the latent config {config} needs {config.latent_shared_memory_bytes(qk_head_dim)} B of "
                         f"shared memory at {qk_head_dim}/{v_head_dim}; sm_90 has {hardware.SM90.shared_memory_bytes}")
    return config


def _declines_latent(call) -> str | None:
    """Why this kernel cannot take an `jaxattn.mla.mla_extend_attention` call (`MlaExtendCall`), or None."""
    if _latent_config(call.qk_head_dim, call.v_head_dim) is None:
        return (f"latent head dims {call.qk_head_dim}/{call.v_head_dim} (288/256 only: at 576/512 O's accumulator does "
                "not fit a consumer warpgroup's registers)")
    if jnp.dtype(call.q.dtype) not in map(jnp.dtype, MGPU_DTYPES):
        return f"dtype {jnp.dtype(call.q.dtype).name} (bf16/f16 only)"
    if call.k_pool.dtype != call.q.dtype:
        return f"a {jnp.dtype(call.k_pool.dtype).name} pool with {jnp.dtype(call.q.dtype).name} q"
    if call.meta.qo_indptr.shape[0] - 1 > hardware.GRID_YZ_LIMIT:  # the batch is the grid's third dimension
        return f"batch {call.meta.qo_indptr.shape[0] - 1} (at most {hardware.GRID_YZ_LIMIT}: the launch grid's third dimension)"
    return hardware.mosaic_gpu_unavailable(call.launch_mode)


def _run_latent(call):
    meta = call.meta
    return _run_kernel(call.q, call.k_new, None, call.k_pool, None, meta, call.sm_scale,
                       _latent_config(call.qk_head_dim, call.v_head_dim), causal=True, sliding_window=-1, logit_cap=0.0,
                       sinks=call.sinks, xai_temperature_len=-1, kv_start_pos=meta.kv_start_pos,
                       latent_v_dim=call.v_head_dim)


# Absorbed MLA extend (`jaxattn.mla.mla_extend_attention`) on this kernel: one q head's query rows per CTA (each K
# tile serving 128 of them), V read from the latent K tiles (`latent_v_dim`): the default for 288/256 (T288 at 60% of
# the floor on the H200, the MLA kernel 47%).
LATENT = Implementation("mgpu-gqa", _declines_latent, _run_latent)


@functools.partial(jax.jit, static_argnames=("causal", "skip_prefix_custom_mask", "sliding_window", "logit_cap",
                                             "xai_temperature_len", "sm_scale", "config"))
def extend_attention_mgpu(
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
    config: MgpuExtendConfig | None = None,
    draft_mask: jax.Array | None = None,
) -> jax.Array:
    """Two-stage extend attention (prefix from the pool, new tokens contiguous) with the Hopper Mosaic GPU kernel.

    Args:
      q: [tokens, q_heads, qk_head_dim] bf16/f16; sequence b's new tokens at meta.qo_indptr[b]:[b+1].
      k_new: [tokens, kv_heads, qk_head_dim], v_new: [tokens, kv_heads, v_head_dim]: the new tokens' K/V (q's dtype).
        q_heads % kv_heads == 0 (GQA). Head dims (qk/v): `MGPU_HEAD_DIMS` (64/64, 128/128, 192/128, 256/256).
      k_pool: [slots, kv_heads, qk_head_dim], v_pool: [slots, kv_heads, v_head_dim]: the cache; meta.kv_indices
        lists each sequence's prefix slots.
      meta: `ExtendMetadata` from `jaxattn.metadata.extend_metadata`, its prefix lists cut for a window or full.
        With meta.page_size P > 1 (`jaxattn.paging`'s builders: the lists keep whole pages) and a pool of whole pages,
        prefix tiles are copied page by page by TMA where a copy is at least `EXTEND_MGPU_PAGE_COPY_MIN_ROWS` rows.
      causal: False: every query sees its whole prefix and all its sequence's new tokens (encoder tokens).
      custom_mask: bool/u8 flat, sequence b's rows at meta.mask_indptr[b], row-major [q_len, prefix_len + q_len]
        (speculative tree verify); replaces causal. The kernel gathers the entries of the tiles it masks: the new-key
        tiles, and with skip_prefix_custom_mask=False the prefix tiles too (True: prefix columns read as visible,
        as SGLang's backend does). With a sliding window the window bounds each row's keys from below too.
      sliding_window: W >= 0 (causal, or with a custom mask): a query sees keys with q_pos - k_pos <= W; <=
        meta.sliding_window when the lists were cut for a window. The kernel loads and computes only the K/V tiles
        the window reaches.
      logit_cap: > 0 caps scores with cap * tanh(s / cap) (s already scaled). sinks: f32[q_heads] natural-log
        logits that join each row's softmax denominator only. xai_temperature_len: L > 0 multiplies scores by
        log2(pos) / log2(L) for absolute positions pos > L (meta.kv_start_pos + prefix + token).
      sm_scale: default 1 / sqrt(qk_head_dim). config: `MgpuExtendConfig` (default: `tuning.mgpu_extend_config`).
      draft_mask: i32/u32[tokens, words], a tree as per-row draft bits (`jaxattn.extend.extend_attention`'s); the
        kernel reads the words of the new-key tiles it masks.
      Slots past the pool (or negative) are clamped into it: a bad index reads a wrong row, never outside the pool
      (`jaxattn.checked` reports them).

    Returns:
      o: [tokens, q_heads, v_head_dim] in q's dtype, as `extend_attention` with the same features; rows past
      qo_indptr[-1], and rows of a sequence past meta.max_extend_len, are 0.
    """
    check_array("q", q, ndim=3, dtypes=MGPU_DTYPES, what="[tokens, q_heads, qk_head_dim] bf16/f16")
    check_extend_draft_mask(q, draft_mask, custom_mask)
    check_extend_args(q, k_pool, v_pool, meta, meta_type=ExtendMetadata, builder="extend_metadata",
                      custom_mask=custom_mask, sinks=sinks, sliding_window=sliding_window, logit_cap=logit_cap,
                      xai_temperature_len=xai_temperature_len, sm_scale=sm_scale)
    check_new_tokens(q, k_new, v_new, k_pool, v_pool)
    if is_fp8(k_pool.dtype) or is_fp8(v_pool.dtype):
        raise ValueError("extend_attention_mgpu takes pools of q's dtype; fp8 pools go through "
                         "jaxattn.extend.extend_attention(..., k_scale=, v_scale=), which dequantises the listed prefix "
                         "(impl=\"mgpu-fp8\": this kernel converting the fp8 tiles itself)")
    _check_head_dims("extend_attention_mgpu", q, v_pool, "jaxattn.extend.extend_attention")
    if sliding_window >= 0 and not causal:
        raise ValueError("extend_attention_mgpu takes a sliding_window with causal=True only (use "
                         "jaxattn.extend.extend_attention)")
    config = _config(config, q.shape[2], v_pool.shape[2], sliding_window=sliding_window,
                     max_extend_len=meta.max_extend_len)
    sm_scale = 1.0 / math.sqrt(q.shape[2]) if sm_scale is None else float(sm_scale)
    return _run_kernel(q, k_new, v_new, k_pool, v_pool, meta, sm_scale, config, causal=causal,
                       sliding_window=sliding_window, logit_cap=logit_cap, sinks=sinks,
                       xai_temperature_len=xai_temperature_len, kv_start_pos=meta.kv_start_pos, custom_mask=custom_mask,
                       skip_prefix_custom_mask=skip_prefix_custom_mask, draft_mask=draft_mask)


@functools.partial(jax.jit, static_argnames=("causal", "sliding_window", "logit_cap", "xai_temperature_len", "sm_scale",
                                             "config"))
def extend_attention_unified_mgpu(
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
    config: MgpuExtendConfig | None = None,
) -> jax.Array:
    """Deterministic unified extend attention (every key through the pool) with the Hopper Mosaic GPU kernel.

    Args:
      q: [tokens, q_heads, qk_head_dim] bf16/f16.
      k_pool: [slots, kv_heads, qk_head_dim], v_pool: [slots, kv_heads, v_head_dim] of q's dtype (head dims
        `MGPU_HEAD_DIMS`), the new tokens' K/V already written at the slots meta lists for them
        (`jaxattn.serving.write_kv`).
      meta: `ExtendUnifiedMetadata` from `jaxattn.metadata.extend_unified_metadata` (built without a window).
      sliding_window: W >= 0 (causal only): a query sees the listed keys at positions q_pos - W..q_pos; the kernel
        starts at the tile the window reaches, the tiles stay at fixed listed offsets.
      custom_mask: bool/u8 flat, sequence b's rows at meta.mask_indptr[b], row-major [q_len, listed kv_len] (column j
        = listed key j, prefix then new); replaces causal. Every tile is masked by its gathered entries, so a row's bits
        stay independent of the prefix/new split.
      causal, logit_cap, sinks, xai_temperature_len (absolute positions from meta.kv_start_pos), sm_scale, config:
        as `extend_attention_mgpu`.

    Returns:
      o: [tokens, q_heads, v_head_dim] in q's dtype, as `jaxattn.extend.extend_attention_unified`; rows past
      qo_indptr[-1], and rows of a sequence past meta.max_extend_len, are 0. For a fixed config.block_kv a token's
      row is bit-identical however its sequence is split into prefix and new tokens.
    """
    check_array("q", q, ndim=3, dtypes=MGPU_DTYPES, what="[tokens, q_heads, qk_head_dim] bf16/f16")
    check_extend_args(q, k_pool, v_pool, meta, meta_type=ExtendUnifiedMetadata, builder="extend_unified_metadata",
                      custom_mask=custom_mask, sinks=sinks, sliding_window=sliding_window, logit_cap=logit_cap,
                      xai_temperature_len=xai_temperature_len, sm_scale=sm_scale)
    if is_fp8(k_pool.dtype) or is_fp8(v_pool.dtype) or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise ValueError("extend_attention_unified_mgpu takes pools of q's dtype; fp8 pools go through "
                         "jaxattn.extend.extend_attention_unified(..., k_scale=, v_scale=) (impl=\"mgpu-unified-fp8\": "
                         "this kernel converting the fp8 tiles itself)")
    _check_head_dims("extend_attention_unified_mgpu", q, v_pool, "jaxattn.extend.extend_attention_unified")
    if meta.sliding_window >= 0:
        raise ValueError("extend_attention_unified_mgpu takes lists not cut for a window (its tiles sit at fixed "
                         f"listed-key offsets); meta was built with sliding_window={meta.sliding_window}: build it "
                         "without one and pass sliding_window here (or use jaxattn.extend.extend_attention_unified)")
    if sliding_window >= 0 and not causal and custom_mask is None:
        raise ValueError("extend_attention_unified_mgpu takes a sliding_window with causal=True (or a custom mask) only")
    # No window here: the short-window tile would make block_kv, and so the bits, depend on the extend length.
    config = _config(config, q.shape[2], v_pool.shape[2], max_extend_len=meta.max_extend_len)
    sm_scale = 1.0 / math.sqrt(q.shape[2]) if sm_scale is None else float(sm_scale)
    return _run_kernel(q, None, None, k_pool, v_pool, meta, sm_scale, config, causal=causal,
                       sliding_window=sliding_window,
                       logit_cap=logit_cap, sinks=sinks, xai_temperature_len=xai_temperature_len,
                       kv_start_pos=meta.kv_start_pos, prefix_lens=meta.prefix_lens, custom_mask=custom_mask,
                       skip_prefix_custom_mask=False)


def heads_per_cta(max_extend_len: int, group: int, config: MgpuExtendConfig) -> int:
    """Q heads per CTA: 2 (each consumer warpgroup its own head's block_q rows, one K/V stream for both) when no
    sequence has more new tokens than one warpgroup's rows and the group is even, as in a verify step (64 drafts
    per sequence: a one-head CTA's second warpgroup would compute rows of the next sequence) with 2 consumer
    warpgroups; else 1."""
    return 2 if max_extend_len <= config.block_q and group % 2 == 0 and config.consumers == 2 else 1


def page_copy_rows(page_size: int, block_kv: int, pool_rows: int) -> int:
    """Rows per TMA copy of a tile's whole pages (the kernel's page_rows), or 0 for row-by-row copies: lists of whole
    pages (page_size > 1) over a pool of whole pages, where a copy of min(page_size, block_kv) rows (a page larger
    than the tile is copied a tile's rows at a time) is at least `EXTEND_MGPU_PAGE_COPY_MIN_ROWS` tall (shorter
    copies measured slower than row copies)."""
    rows = min(page_size, block_kv)
    whole_pages = page_size > 1 and pool_rows % page_size == 0
    return rows if whole_pages and rows >= EXTEND_MGPU_PAGE_COPY_MIN_ROWS else 0


@contextlib.contextmanager
def kernel_options_forced(adjust):
    """While active, every launch of the Mosaic GPU extend kernel traced takes its keyword arguments through
    `adjust(kwargs) -> kwargs`: experiments and the lowering test force an option the tuned rules would not pick (page
    copies below the rule, no TMA for new tiles). Only tracing sees it, so JAX's caches are cleared on entry and on
    exit: JAX caches a trace by function and arguments, also for `jax.jit(f.__wrapped__)` made anew, and would hand
    back a trace made without the option (before 2026-12-05 every forced variant timed this way ran the default
    kernel), or, after the context, one made with it. Not for serving."""
    import jaxattn.kernels.extend_attention_mgpu as kernel_module

    original = kernel_module.extend_attention_mgpu_kernel
    jax.clear_caches()
    kernel_module.extend_attention_mgpu_kernel = lambda *args, **kwargs: original(*args, **adjust(dict(kwargs)))
    try:
        yield
    finally:
        kernel_module.extend_attention_mgpu_kernel = original
        jax.clear_caches()


def _run_kernel(q, k_new, v_new, k_pool, v_pool, meta, sm_scale: float, config: MgpuExtendConfig, *, causal: bool,
                sliding_window: int, logit_cap: float, sinks, xai_temperature_len: int, kv_start_pos, prefix_lens=None,
                custom_mask=None, skip_prefix_custom_mask=True, draft_mask=None, latent_v_dim=None, kv_scales=None):
    """The kernel launch on checked arguments (the registry's routes and `extend_attention_mgpu` share it).
    prefix_lens (i32[batch]): the unified form (k_new, v_new unused: every key from the pool). custom_mask: flat
    bool/u8 at meta.mask_indptr. draft_mask: i32/u32[tokens, words] (two-stage form). latent_v_dim: a latent cache
    (v_new = v_pool = None, V = K's first latent_v_dim dims; q's columns padded to a multiple of 64 here).
    kv_scales: f32[2 * kv_heads] with fp8 pools (converted by the kernel's producer; rows copied row by row)."""
    from jaxattn.kernels.extend_attention_mgpu import extend_attention_mgpu_kernel, f16_tiles_fit
    from jaxattn.kernels.zero_rows_mgpu import unwritten_rows_zeroed
    tokens, q_heads = q.shape[:2]
    latent = latent_v_dim is not None
    v_dim = latent_v_dim if latent else v_pool.shape[2]
    if tokens == 0 or meta.qo_indptr.shape[0] == 1:
        return jnp.zeros((tokens, q_heads, v_dim), q.dtype)
    unified = prefix_lens is not None
    # Q and O move by TMA in 8-row tiles, which wants an array of whole 8-row tiles no shorter than a block_q box:
    # pad q (a copy) when tokens is not a multiple of 8 or is below block_q. k_new/v_new need no copy: their whole
    # tiles come by TMA only when tokens allows it (below), the others row by row.
    rows = max(-(-tokens // 8) * 8, config.block_q)
    # A latent row (MLA's 288) narrower than the 64-column tiles: q's extra columns are zeros, as the kernel makes
    # the K tiles' (a copy of q).
    width = -(-q.shape[2] // 64) * 64 if latent else q.shape[2]
    if rows > tokens or width > q.shape[2]:
        q = jnp.pad(q, ((0, rows - tokens), (0, 0), (0, width - q.shape[2])))
    # The kernel fills the buffer in place (aliased); the rows it does not compute are 0 (only those are cleared).
    out_ref = jax.new_ref(unwritten_rows_zeroed(meta.qo_indptr, rows=rows, row_shape=(q_heads, v_dim), dtype=q.dtype,
                                                max_extend_len=meta.max_extend_len, owner=q))
    kv_indices = operand_or_unread(meta.kv_indices)
    xai = int(xai_temperature_len) if xai_temperature_len > 0 else -1
    if custom_mask is not None:
        # As given (bool, u8 or i8: one byte an entry, read as bytes != 0 through a raw pointer), so no XLA kernel
        # converts a [q_len, kv_len] mask before every call (11 us at V-TREE64-W128). An empty mask hides every key:
        # one 0 entry stands in for it (the kernel never reads past an operand's length).
        custom_mask = operand_or_unread(custom_mask)
    if draft_mask is not None:
        draft_mask = jax.lax.bitcast_convert_type(draft_mask, jnp.int32)  # bit 31 survives (no value conversion)
    o_rows_columns = 64 if latent else config.o_rows_columns(q.shape[2], v_dim)
    fp8 = {}
    if kv_scales is not None:  # the config's conversion where the kernel takes it, else the scaled one
        fits = f16_tiles_fit(unified=unified, o_rows_columns=o_rows_columns, qk_dim=q.shape[2])
        staging = fp8_staging_fits(config, q.shape[2])
        fp8 = dict(kv_scales=kv_scales, fp8_tiles=config.fp8_tiles if fits else "q_dtype", fp8_staging=staging,
                   fp8_refill=staging and config.fp8_refill)
    extend_attention_mgpu_kernel(
        q, None if unified else k_new, None if unified else v_new, k_pool, v_pool, kv_indices,
        index_i32(meta.qo_indptr), index_i32(meta.kv_indptr), out_ref,
        max_extend_len=meta.max_extend_len, sm_scale=sm_scale,
        block_q=config.block_q, block_kv=config.block_kv, stages=config.stages, consumers=config.consumers,
        overlap=config.overlap,
        o_rows_columns=o_rows_columns,
        causal=bool(causal),
        sliding_window=int(sliding_window) if sliding_window >= 0 else -1,
        logit_cap=float(logit_cap) if logit_cap > 0 else 0.0,
        sinks=None if sinks is None else sinks.astype(jnp.float32),
        xai_temperature_len=xai,
        kv_start_pos=index_i32(kv_start_pos) if xai > 0 or custom_mask is not None else None,
        prefix_lens=index_i32(prefix_lens) if unified else None,
        custom_mask=custom_mask, mask_indptr=None if custom_mask is None else meta.mask_indptr,
        skip_prefix_custom_mask=bool(skip_prefix_custom_mask), draft_mask=draft_mask,
        heads_per_cta=heads_per_cta(meta.max_extend_len, q_heads // k_pool.shape[1], config),
        # Whole new-key tiles by TMA where Mosaic allows it (an array of whole 8-row tiles, no shorter than a box).
        tma_new_tiles=not unified and not latent and tokens % 8 == 0 and tokens >= config.block_kv,
        page_rows=0 if latent or kv_scales is not None else page_copy_rows(meta.page_size, config.block_kv,
                                                                            k_pool.shape[0]),
        **(dict(latent_v_dim=latent_v_dim) if latent else {}), **fp8,
    )
    return out_ref[...][:tokens]
