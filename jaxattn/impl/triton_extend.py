"""Extend on SGLang's Triton kernels (`kernels/extend_attention.py`): the two-stage kernel (prefix from the pool, new
tokens contiguous) and the deterministic unified one (every key through the pool). Every feature: custom masks, windows,
soft caps, sinks, xai temperature, non-causal, every head shape in [16, 576] / [16, 512], f32/f16/bf16.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import triton

from jaxattn import tuning
from jaxattn.aot import build
from jaxattn.calls import ExtendCall
from jaxattn.checks import index_i32
from jaxattn.fp8 import scale_table_operand
from jaxattn.launch import launch, unread_operand
from jaxattn.metadata import rope_split
from jaxattn.registry import Implementation
from jaxattn.tuning import ExtendConfig

_LOG2E = 1.4426950408889634


def _block_dims(qk_head_dim: int, v_head_dim: int):
    block_d, block_dpe = rope_split(qk_head_dim)
    return block_d, block_dpe, max(16, triton.next_power_of_2(v_head_dim))


def kernel_constexprs(*, q_heads, kv_heads, qk_head_dim, v_head_dim, dtype, config, sm_scale, logit_cap, xai_temperature_len,
                      sliding_window, causal, use_mask, has_sink, tokens, num_slots, kv_capacity, mask_len,
                      skip_prefix_mask=None, has_kv_scales=False, mask_bits=0):
    """The constexprs of one launch (shared by the launches and kernel_builds, so the AOT check compiles what runs).

    tokens, num_slots, kv_capacity, mask_len: the q/o rows, pool slots, kv_indices and custom mask lengths (static
    shapes) that the kernels clamp every index into. has_kv_scales: the pool carries K/V scales (fp8).
    skip_prefix_mask, mask_bits: the two-stage kernel's (None for the unified one): the prefix columns are not read;
    mask_bits > 0: the mask is per-row draft words, that many per row (`extend_attention(draft_mask=)`).
    """
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
        TOKENS=tokens,
        NUM_SLOTS=num_slots,
        KV_CAPACITY=kv_capacity,
        MASK_LEN=mask_len,
        HAS_KV_SCALES=bool(has_kv_scales),
    )
    if skip_prefix_mask is not None:
        constexprs.update(SKIP_PREFIX_MASK=bool(skip_prefix_mask), MASK_BITS=int(mask_bits))
    return constexprs


def _grid(config: ExtendConfig, q_heads: int, batch: int, max_extend_len: int) -> tuple[int, int, int]:
    """(head groups, sequences, q-blocks of block_m / head_pack tokens)."""
    return (q_heads // config.head_pack, batch, triton.cdiv(max_extend_len, config.block_m // config.head_pack))


def declines(call: ExtendCall) -> str | None:
    if call.config is not None and not isinstance(call.config, ExtendConfig):
        return f"config is a {type(call.config).__name__}, not an ExtendConfig"
    return None


def _launch(call: ExtendCall, kernel: str, arrays: tuple, two_stage: bool):
    q, meta = call.q, call.meta
    tokens, q_heads, qk_dim = q.shape
    kv_heads, v_dim = call.kv_heads, call.v_head_dim
    bits = call.draft_mask  # [tokens, words] (two-stage only): the kernel reads them through its mask operand
    masked = call.custom_mask is not None or bits is not None
    config = call.config or tuning.extend_config(qk_dim, v_dim, q.dtype, meta.max_extend_len, custom_mask=masked)
    config = tuning.pack_heads(config, q_heads, kv_heads)
    if bits is not None:
        mask, mask_indptr = jax.lax.bitcast_convert_type(bits, jnp.int32).reshape(-1), unread_operand(jnp.int32)
    elif call.custom_mask is not None:
        mask, mask_indptr = call.custom_mask.astype(jnp.uint8), meta.mask_indptr
    else:
        mask, mask_indptr = unread_operand(jnp.uint8), unread_operand(jnp.int32)
    constexprs = kernel_constexprs(
        q_heads=q_heads, kv_heads=kv_heads, qk_head_dim=qk_dim, v_head_dim=v_dim, dtype=q.dtype, config=config,
        sm_scale=call.sm_scale, logit_cap=call.logit_cap, xai_temperature_len=call.xai_temperature_len,
        sliding_window=call.sliding_window, causal=call.causal, use_mask=masked,
        has_sink=call.sinks is not None, tokens=tokens, num_slots=call.k_pool.shape[0],
        kv_capacity=meta.kv_indices.shape[0], mask_len=mask.shape[0] if masked else 1,
        skip_prefix_mask=(call.skip_prefix_custom_mask or bits is not None) if two_stage else None,
        has_kv_scales=call.kv_scales is not None, mask_bits=0 if bits is None else bits.shape[1],
    )
    if call.batch == 0 or tokens == 0:
        return jnp.zeros((tokens, q_heads, v_dim), q.dtype)
    return launch(
        ("extend_attention", kernel),
        *arrays,
        mask,
        mask_indptr,
        unread_operand(jnp.float32) if call.sinks is None else call.sinks.astype(jnp.float32),
        unread_operand(jnp.float32) if call.kv_scales is None else scale_table_operand(call.kv_scales),
        out_shape=jax.ShapeDtypeStruct((tokens, q_heads, v_dim), q.dtype),
        grid=_grid(config, q_heads, call.batch, meta.max_extend_len),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        zeroed_outputs=(0,),  # padding rows past qo_indptr[-1] read as 0
        mode=call.launch_mode,
        name=f"{kernel.removesuffix('_kernel')}_{config.block_m}x{config.block_n}_p{config.head_pack}",
        **constexprs,
    )


def run_two_stage(call: ExtendCall):
    meta = call.meta
    return _launch(call, "extend_attention_kernel", (
        call.q, call.k_new, call.v_new, call.k_pool, call.v_pool, index_i32(meta.qo_indptr),
        index_i32(meta.kv_indptr), meta.kv_indices, index_i32(call.kv_start_pos),
    ), two_stage=True)


def run_unified(call: ExtendCall):
    meta = call.meta
    return _launch(call, "extend_attention_unified_kernel", (
        call.q, call.k_pool, call.v_pool, index_i32(meta.qo_indptr), index_i32(meta.kv_indptr),
        meta.kv_indices, index_i32(meta.prefix_lens), index_i32(call.kv_start_pos),
    ), two_stage=False)


def _form(form: str, run):
    def declines_form(call: ExtendCall) -> str | None:
        if call.form != form:
            return f"takes the {form.replace('_', '-')} form only"
        return declines(call)

    return declines_form, run


TWO_STAGE = Implementation("triton", *_form("two_stage", run_two_stage))
UNIFIED = Implementation("triton-unified", *_form("unified", run_unified))


# ---------------------------------------------------------------------------------------------
# AOT builds (see jaxattn.aot).

_BUILD_HEADS = {"64": (64, 64), "128": (128, 128), "256": (256, 256), "576/512": (576, 512), "288/256": (288, 256), "192/128": (192, 128)}
# Families whose H200 timing relied on an occupancy: 64's 128x64 tiles x 8 warps ran at 128 registers per thread, two
# CTAs per SM; at 159 registers (one CTA) T64 took 2.14 ms instead of 1.26.
_TIMED_MAX_REGISTERS = {"64": 128}


def _build(kernel, family, dtype, *, label_extra="", causal=True, use_mask=False, skip_prefix_mask=True, window=-1, logit_cap=0.0, has_sink=False, xai=-1, max_registers=None, pool_dtype=None, mask_bits=0):
    qk_dim, v_dim = _BUILD_HEADS[family]
    q_heads, kv_heads = (16, 1) if qk_dim in (576, 288) else (32, 8)  # MLA absorbed: one latent KV head
    config = tuning.sm90.EXTEND[family]
    config = tuning.with_custom_mask(config) if use_mask else config
    config = tuning.pack_heads(config, q_heads, kv_heads)
    jdtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16}[dtype]
    two_stage = kernel == "extend_attention_kernel"
    constexprs = kernel_constexprs(
        q_heads=q_heads, kv_heads=kv_heads, qk_head_dim=qk_dim, v_head_dim=v_dim, dtype=jdtype, config=config,
        sm_scale=1.0 / math.sqrt(qk_dim), logit_cap=logit_cap, xai_temperature_len=xai, sliding_window=window,
        causal=causal, use_mask=use_mask, has_sink=has_sink, skip_prefix_mask=skip_prefix_mask if two_stage else None,
        tokens=1 << 16, num_slots=1 << 20, kv_capacity=1 << 22, mask_len=1 << 28 if use_mask else 1,  # sizes: no code change
        has_kv_scales=pool_dtype is not None, mask_bits=mask_bits,
    )
    t = f"*{dtype}"
    p = f"*{pool_dtype or dtype}"
    if two_stage:
        signature = {"Q": t, "K_NEW": t, "V_NEW": t, "K_POOL": p, "V_POOL": p, "QO_INDPTR": "*i32", "KV_INDPTR": "*i32", "KV_INDICES": "*i32", "KV_START_POS": "*i32"}
    else:
        signature = {"Q": t, "K_POOL": p, "V_POOL": p, "QO_INDPTR": "*i32", "KV_INDPTR": "*i32", "KV_INDICES": "*i32", "PREFIX_LENS": "*i32", "KV_START_POS": "*i32"}
    signature.update({"MASK": "*i32" if mask_bits else "*u8", "MASK_INDPTR": "*i32", "SINKS": "*fp32", "KV_SCALES": "*fp32",
                      "O": t})
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
        builds.append(_build(kernel, "128", "bf16", label_extra=" fp8e4nv pool", pool_dtype="fp8e4nv"))
    builds.append(_build("extend_attention_kernel", "128", "bf16", label_extra=" mask+prefix", use_mask=True, skip_prefix_mask=False))
    builds.append(_build("extend_attention_kernel", "576/512", "bf16", label_extra=" mask", use_mask=True))
    builds.append(_build("extend_attention_kernel", "128", "bf16", label_extra=" draft words", use_mask=True, mask_bits=2))
    return builds
