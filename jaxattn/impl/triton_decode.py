"""Decode on SGLang's split-KV Triton kernels (`kernels/decode_attention.py`): stage 1 attends each split, stage 2
merges the splits with their LSEs and adds the sink.

Stage 1 has two kernels: the grouped one (`tl.dot` over BLOCK_H q heads of one kv head; every group size, MHA
included, where it pads the head to 16 dot rows) and the vector one (one q head per program, multiply-and-sum; opt-in
with `DecodeConfig(block_h=1)`). Takes every decode call.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import triton

from jaxattn import hardware, tuning
from jaxattn.aot import build
from jaxattn.calls import DecodeCall
from jaxattn.checks import index_i32
from jaxattn.fp8 import scale_table_operand
from jaxattn.launch import launch, unread_operand
from jaxattn.metadata import MIN_BLOCK_KV, rope_split
from jaxattn.registry import Implementation
from jaxattn.tuning import DecodeConfig

# Head shapes the sm_90 table covers (the AOT builds compile each).
SUPPORTED_HEAD_DIMS = ((64, 64), (128, 128), (256, 256), (192, 128), (288, 256), (576, 512))


def declines(call: DecodeCall) -> str | None:
    if call.config is not None and not isinstance(call.config, DecodeConfig):
        return f"config is a {type(call.config).__name__}, not a DecodeConfig"
    if call.tokens_per_seq > 1 and call.config is not None and call.config.block_h == 1:
        return "DecodeConfig(block_h=1) (the vector kernel) takes one query token per sequence"
    if call.config is not None and call.config.fp8_in_registers and call.launch_mode == "gpu":
        family = hardware.gpu_family_name()
        if family is not None and int(family.removeprefix("sm_")) < 89:
            return (f"DecodeConfig(fp8_in_registers=True) on {family} (its fp8 conversion is sm_89+'s "
                    "cvt.rn.f16x2.e4m3x2 / e5m2x2)")
    return None


def stage1_constexprs(*, q_heads, kv_heads, qk_head_dim, v_head_dim, config, sm_scale, logit_cap, xai_temperature_len,
                      sliding_window, max_kv_splits, v_in_k, v_from_k, dot_precision, num_slots, kv_capacity,
                      has_kv_scales=False, f16_dots=False, q_tokens=1, has_draft_mask=False, final_at_one_split=False):
    """Stage 1's constexprs (shared by `run` and `kernel_builds`, so the AOT check compiles what runs).

    v_in_k: V's buffer is the K pool (its first v_head_dim dims); v_from_k: the kernel also reuses the loaded K tile.
    num_slots, kv_capacity: the pool's and kv_indices' lengths, which every slot and CSR offset is clamped into.
    has_kv_scales: the call carries K/V scales (fp8 pools).
    f16_dots: fp8 pool with bf16 q: the grouped kernel's dots run in f16 (see `uses_f16_dots`).
    q_tokens, has_draft_mask: query tokens per sequence, and whether a draft mask (else causal) says which drafts each
    sees (the grouped kernel; see kernels/decode_attention.py).
    final_at_one_split: a sequence of one split has its rows' output stored by stage 1 (no sink to add), and
    stage 2, given the same flag, leaves them.
    """
    block_d, block_dpe = rope_split(qk_head_dim)
    group = q_heads // kv_heads
    v_width = qk_head_dim if v_in_k else v_head_dim  # the row width of V's buffer
    constexprs = dict(
        SM_SCALE=float(sm_scale),
        LOGIT_CAP=float(logit_cap),
        XAI_TEMPERATURE_LEN=int(xai_temperature_len),
        XAI_INV_LOG2_LEN=(1.0 / math.log2(xai_temperature_len)) if xai_temperature_len > 1 else 1.0,
        SLIDING_WINDOW=int(sliding_window),
        Q_HEADS=q_heads,
        GROUP=group,
        STRIDE_K_SLOT=kv_heads * qk_head_dim,
        STRIDE_K_HEAD=qk_head_dim,
        STRIDE_V_SLOT=kv_heads * v_width,
        STRIDE_V_HEAD=v_width,
        QK_HEAD_DIM=qk_head_dim,
        V_HEAD_DIM=v_head_dim,
        BLOCK_D=block_d,
        BLOCK_DPE=block_dpe,
        BLOCK_DV=triton.next_power_of_2(v_head_dim),
        BLOCK_N=config.block_n,
        MAX_KV_SPLITS=max_kv_splits,
        MIN_BLOCK_KV=MIN_BLOCK_KV,
        NUM_SLOTS=num_slots,  # slots outside the pool read slot 0
        KV_CAPACITY=kv_capacity,  # kv_indptr is clamped into kv_indices
        HAS_KV_SCALES=bool(has_kv_scales),
        FINAL_AT_ONE_SPLIT=bool(final_at_one_split),
    )
    if config.block_h != 1:  # the grouped kernel's extra constexprs (the vector kernel has none)
        constexprs.update(V_FROM_K=v_from_k, BLOCK_H=config.block_h, DOT_PRECISION=dot_precision,
                          F16_DOTS=bool(f16_dots), FP8_IN_REGISTERS=bool(has_kv_scales) and config.fp8_in_registers,
                          Q_TOKENS=int(q_tokens), HAS_DRAFT_MASK=bool(has_draft_mask), KEYS_AS_ROWS=config.keys_as_rows)
    return constexprs


def stage2_constexprs(*, q_heads, v_head_dim, sliding_window, has_sink, max_kv_splits, kv_capacity, q_tokens=1,
                      final_at_one_split=False):
    # kv_capacity: stage 1's clamp of kv_indptr, so both stages see the same splits.
    return dict(SLIDING_WINDOW=int(sliding_window), Q_HEADS=q_heads, V_HEAD_DIM=v_head_dim,
                BLOCK_DV=triton.next_power_of_2(v_head_dim), HAS_SINK=bool(has_sink), MAX_KV_SPLITS=max_kv_splits,
                MIN_BLOCK_KV=MIN_BLOCK_KV, KV_CAPACITY=kv_capacity, Q_TOKENS=int(q_tokens),
                FINAL_AT_ONE_SPLIT=bool(final_at_one_split))


def stage1_kernel(config: DecodeConfig) -> str:
    return "decode_stage1_vector_kernel" if config.block_h == 1 else "decode_stage1_kernel"


def uses_f16_dots(q_dtype, has_kv_scales: bool) -> bool:
    """fp8 pool with bf16 q: the grouped kernel converts K/V rows to f16 (one packed conversion per two elements)
    instead of bf16 (a second conversion per element: about a tenth of the fp8 step at D1 on the H200);
    kernels/decode_attention.py says why this keeps the numerics."""
    return bool(has_kv_scales) and jnp.dtype(q_dtype) == jnp.bfloat16


def reads_v_from_k(qk_head_dim: int, v_head_dim: int) -> bool:
    """MLA with V inside K: the kernel reuses the K tile it loaded (V = the first BLOCK_D dims, the non-rope part)."""
    block_d, block_dpe = rope_split(qk_head_dim)
    return v_head_dim == block_d and block_dpe > 0


def run(call: DecodeCall):
    k_pool, v_pool, meta = call.k_pool, call.v_pool, call.meta
    batch, q_heads, kv_heads, qk_dim, v_dim = call.batch, call.q_heads, call.kv_heads, call.qk_head_dim, call.v_head_dim
    tokens = call.tokens_per_seq
    q = call.q.reshape(batch * tokens, q_heads, qk_dim)  # (sequence, token) rows
    # The kernel's rows are (token, q head) pairs of one kv head: the tables are looked up by how many there are.
    rows = tokens * (q_heads // kv_heads)
    mode = call.launch_mode
    if call.config is None:
        config = tuning.decode_config(qk_dim, v_dim, rows, dtype=q.dtype, fp8_pool=call.kv_scales is not None)
    else:
        config = tuning.clamp_decode_config(call.config, rows)
    has_kv_scales = call.kv_scales is not None
    v_in_k = v_pool is None
    max_splits = meta.max_kv_splits
    # Without a sink, a one-split sequence's rows are final in stage 1 (D1 / D3 decode one split a sequence on an
    # fp8 pool): no partials written and read back for them, and the merge's programs for them store nothing.
    final_at_one_split = call.sinks is None
    constexprs = stage1_constexprs(
        q_heads=q_heads, kv_heads=kv_heads, qk_head_dim=qk_dim, v_head_dim=v_dim, config=config, sm_scale=call.sm_scale,
        logit_cap=call.logit_cap, xai_temperature_len=call.xai_temperature_len, sliding_window=call.sliding_window,
        max_kv_splits=max_splits, v_in_k=v_in_k, v_from_k=v_in_k and reads_v_from_k(qk_dim, v_dim),
        dot_precision="ieee" if (mode == "interpret" or q.dtype == jnp.float32) else "tf32",
        num_slots=k_pool.shape[0], kv_capacity=meta.kv_indices.shape[0], has_kv_scales=has_kv_scales,
        f16_dots=uses_f16_dots(q.dtype, has_kv_scales), q_tokens=tokens,
        has_draft_mask=call.draft_mask is not None, final_at_one_split=final_at_one_split,
    )
    # Unused operands: `unread_operand` (why a 1-element numpy constant: there); equal scales: `scale_table_operand`.
    kv_scales = unread_operand() if call.kv_scales is None else scale_table_operand(call.kv_scales)
    # The kernel reads 32 bits per row: u32 masks are reinterpreted, not converted (bit 31 would not survive a cast).
    if call.draft_mask is None:
        draft_mask = unread_operand(jnp.int32)
    else:
        draft_mask = jax.lax.bitcast_convert_type(call.draft_mask.reshape(-1), jnp.int32)
    head_programs = q_heads if config.block_h == 1 else kv_heads * -(-rows // config.block_h)
    # A static bound of one split (D3: a batch that fills the GPU): every row is final in stage 1, no partial is
    # written and the merge is not launched.
    only_final = final_at_one_split and max_splits == 1

    def output(shape, dtype, written: bool):  # an output stage 1 writes, or a 1-element placeholder it never touches
        return jax.ShapeDtypeStruct(shape if written else (1,), dtype)

    rows_out = batch * tokens
    mid_o, mid_lse, o, lse = launch(
        ("decode_attention", stage1_kernel(config)),
        q,
        k_pool,
        k_pool if v_pool is None else v_pool,
        index_i32(meta.kv_indptr),
        meta.kv_indices,
        index_i32(meta.num_kv_splits),
        index_i32(meta.seq_lens),
        kv_scales,
        draft_mask,
        out_shape=(
            output((rows_out, q_heads, max_splits, v_dim), jnp.float32, not only_final),
            output((rows_out, q_heads, max_splits), jnp.float32, not only_final),
            output((rows_out, q_heads, v_dim), q.dtype, final_at_one_split),
            output((rows_out, q_heads), jnp.float32, final_at_one_split),
        ),
        grid=(batch, head_programs, max_splits),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        mode=mode,
        name=f"decode_stage1_BLOCK_H={config.block_h}_BLOCK_N={config.block_n}",
        **constexprs,
    )
    if only_final:
        return finished(call, o, lse)
    return merge_splits(call, mid_o, mid_lse, index_i32(meta.num_kv_splits), max_splits,
                        final_rows=(o, lse) if final_at_one_split else None)


def finished(call: DecodeCall, o, lse):
    """The op's result from o [batch * tokens, q_heads, v_dim] and lse f32[batch * tokens, q_heads]."""
    o, lse = o.reshape(call.q.shape[:-1] + (call.v_head_dim,)), lse.reshape(call.q.shape[:-1])
    return (o, lse) if call.return_lse else o


def merge_splits(call: DecodeCall, mid_o, mid_lse, num_kv_splits, max_splits: int, final_rows=None):
    """Stage 2 (the Triton merge) of any stage 1 that writes `decode_stage1_kernel`'s partial buffers: mid_o
    f32[batch * tokens, q_heads, max_splits, v_dim], mid_lse f32[batch * tokens, q_heads, max_splits] (natural log),
    split s of a sequence covering the keys `kernels/decode_attention.py`'s split geometry gives for num_kv_splits
    (i32[batch]) and max_splits; entries of empty splits are never read. Adds the sink; returns the op's result.

    final_rows: (o [batch * tokens, q_heads, v_dim] in q's dtype, lse f32[batch * tokens, q_heads]) where stage 1
    stored the rows of one-split sequences (`stage1_constexprs`' final_at_one_split; no sink): the merge writes the
    other rows into them in place."""
    batch, q_heads, v_dim, tokens = call.batch, call.q_heads, call.v_head_dim, call.tokens_per_seq
    meta = call.meta
    if final_rows is not None and call.sinks is not None:
        raise ValueError("final_rows: stage 1 stores no final row where a sink is added")
    # Operands the kernel does not read: `unread_operand`.
    sink_arg = unread_operand() if call.sinks is None else call.sinks.astype(jnp.float32)
    if final_rows is None:
        final_args, aliases = (unread_operand(),) * 2, {}
    else:
        final_args, aliases = final_rows, {5: 0, 6: 1}
    o, lse = launch(
        ("decode_attention", "decode_stage2_kernel"),
        mid_o,
        mid_lse,
        index_i32(meta.kv_indptr),
        num_kv_splits,
        sink_arg,
        *final_args,
        out_shape=(jax.ShapeDtypeStruct((batch * tokens, q_heads, v_dim), call.q.dtype),
                   jax.ShapeDtypeStruct((batch * tokens, q_heads), jnp.float32)),
        input_output_aliases=aliases,
        grid=(batch * tokens, q_heads),
        num_warps=4,
        num_stages=2,
        mode=call.launch_mode,
        name="decode_stage2",
        **stage2_constexprs(q_heads=q_heads, v_head_dim=v_dim, sliding_window=call.sliding_window,
                            has_sink=call.sinks is not None, max_kv_splits=max_splits,
                            kv_capacity=meta.kv_indices.shape[0], q_tokens=tokens,
                            final_at_one_split=final_rows is not None),
    )
    return finished(call, o, lse)


def run_merged(call: DecodeCall, partials):
    """A stage 1 of another kernel, then the Triton merge: partials(call) -> (mid_o, mid_lse, num_kv_splits, splits)
    as `merge_splits` takes them. An empty batch launches nothing (the Triton path's empty result)."""
    if call.batch == 0:
        return run(dataclasses.replace(call, config=None))
    return merge_splits(call, *partials(call))


IMPLEMENTATION = Implementation("triton", declines, run)


# ---------------------------------------------------------------------------------------------
# AOT builds (see jaxattn.aot)

# The group size each table bucket is built at (8 KV heads), and the bounds the builds use (the sizes change no code).
_BUILD_GROUPS = {"g1": 1, "g16": 8, "g>16": 64}
_BUILD_MAX_SPLITS = 64
_BUILD_BOUNDS = dict(num_slots=1 << 20, kv_capacity=1 << 22)


def kernel_builds():
    """Every stage-1/stage-2 build the sm_90 table (and clamping) can choose, per dtype and head-dim family (fp32:
    the grouped stage 1 at `tuning.float32_decode_config`'s tiles, the one part whose code fp32 changes)."""
    builds = []
    index = {"KV_INDPTR": "*i32", "KV_INDICES": "*i32", "NUM_KV_SPLITS": "*i32", "SEQ_LENS": "*i32", "KV_SCALES": "*fp32",
             "DRAFT_MASK": "*i32"}

    def stage1_signature(dtype, pool_dtype):
        return {"Q": f"*{dtype}", "K_POOL": f"*{pool_dtype}", "V_POOL": f"*{pool_dtype}", **index, "MID_O": "*fp32",
                "MID_LSE": "*fp32", "O": f"*{dtype}", "LSE": "*fp32"}

    for dtype in ("bf16", "fp16", "fp32"):
        for qk_dim, v_dim in SUPPORTED_HEAD_DIMS:
            common = dict(qk_head_dim=qk_dim, v_head_dim=v_dim, sm_scale=1.0 / math.sqrt(qk_dim), logit_cap=30.0,
                          xai_temperature_len=-1, sliding_window=-1, max_kv_splits=_BUILD_MAX_SPLITS,
                          dot_precision="ieee" if dtype == "fp32" else "tf32", final_at_one_split=True,
                          **_BUILD_BOUNDS)
            v_variants = [False] + ([True] if reads_v_from_k(qk_dim, v_dim) else [])
            for group_key, group in _BUILD_GROUPS.items():
                if (qk_dim, v_dim, group_key) not in tuning.sm90.DECODE:
                    continue  # g1 falls back to g16's build
                config = tuning.sm90.DECODE[(qk_dim, v_dim, group_key)]
                if dtype == "fp32":
                    config = tuning.float32_decode_config(config, qk_dim, v_dim)
                config = tuning.clamp_decode_config(config, group)
                for v_from_k in v_variants:
                    constexprs = stage1_constexprs(q_heads=8 * group, kv_heads=8, config=config, v_in_k=v_from_k,
                                                   v_from_k=v_from_k, **common)
                    builds.append(build(
                        "decode_attention", stage1_kernel(config), stage1_signature(dtype, dtype), constexprs,
                        num_warps=config.num_warps, num_stages=config.num_stages,
                        # M = BLOCK_H (16 or 32) < 64 rows per warpgroup: Triton emits mma.sync, not wgmma
                        # (checked with `python -m jaxattn.aot -k decode`); 64-row tiles (MLA past 16 rows) use wgmma.
                        expects_wgmma=config.block_h >= 64 and dtype != "fp32", expects_pipelining=config.num_stages > 1,
                        label=f"{dtype} {qk_dim}/{v_dim} {group_key}{' v_from_k' if v_from_k else ''}",
                    ))
            if dtype == "fp32":
                continue
            # The vector kernel (opt-in: DecodeConfig(block_h=1)).
            config = tuning.vector_config(qk_dim, v_dim)
            constexprs = stage1_constexprs(q_heads=16, kv_heads=16, config=config, v_in_k=False, v_from_k=False, **common)
            builds.append(build(
                "decode_attention", stage1_kernel(config), stage1_signature(dtype, dtype), constexprs,
                num_warps=config.num_warps, num_stages=config.num_stages,
                expects_wgmma=False,  # no tl.dot
                expects_pipelining=False,  # see tuning.vector_config
                label=f"{dtype} {qk_dim}/{v_dim} mha vector",
            ))
        if dtype == "fp32":
            continue
        # Several query tokens (a verify step): MLA's 16 heads x 4 tokens and GQA's 4 heads x 4 tokens, causal and
        # under a draft mask, at the tiles the table gives their rows.
        for (qk_dim, v_dim, q_heads, kv_heads, v_from_k), has_draft_mask in itertools.product(
                ((576, 512, 16, 1, True), (128, 128, 32, 8, False)), (False, True)):
            rows = 4 * q_heads // kv_heads
            config = tuning.decode_config(qk_dim, v_dim, rows, family=hardware.SM90.name)
            constexprs = stage1_constexprs(
                q_heads=q_heads, kv_heads=kv_heads, qk_head_dim=qk_dim, v_head_dim=v_dim, config=config,
                sm_scale=1.0 / math.sqrt(qk_dim), logit_cap=0.0, xai_temperature_len=-1, sliding_window=-1,
                max_kv_splits=_BUILD_MAX_SPLITS, v_in_k=v_from_k, v_from_k=v_from_k, dot_precision="tf32",
                final_at_one_split=True,
                q_tokens=4, has_draft_mask=has_draft_mask, **_BUILD_BOUNDS)
            builds.append(build(
                "decode_attention", stage1_kernel(config), stage1_signature(dtype, dtype), constexprs,
                num_warps=config.num_warps, num_stages=config.num_stages, expects_wgmma=config.block_h >= 64,
                expects_pipelining=config.num_stages > 1,
                label=f"{dtype} {qk_dim}/{v_dim} 4 tokens x {q_heads // kv_heads} heads{' draft mask' if has_draft_mask else ''}",
            ))
        # fp8 pools (e4m3fn, e5m2) with this q dtype: the grouped builds of the common GQA and MLA shapes.
        for pool_dtype in ("fp8e4nv", "fp8e5"):
            for (qk_dim, v_dim, v_from_k), in_registers in itertools.product(((128, 128, False), (576, 512, True)),
                                                                              (False, True)):
                config = tuning.decode_config(qk_dim, v_dim, 8 if qk_dim == 128 else 16, family=hardware.SM90.name, fp8_pool=True)
                config = dataclasses.replace(config, fp8_in_registers=in_registers)
                constexprs = stage1_constexprs(
                    q_heads=64 if qk_dim == 128 else 16, kv_heads=8 if qk_dim == 128 else 1, qk_head_dim=qk_dim,
                    v_head_dim=v_dim, config=config, sm_scale=1.0 / math.sqrt(qk_dim), logit_cap=0.0,
                    xai_temperature_len=-1, sliding_window=-1, max_kv_splits=_BUILD_MAX_SPLITS, v_in_k=v_from_k,
                    v_from_k=v_from_k, dot_precision="tf32", has_kv_scales=True, final_at_one_split=True,
                    f16_dots=uses_f16_dots({"bf16": jnp.bfloat16, "fp16": jnp.float16}[dtype], True), **_BUILD_BOUNDS)
                builds.append(build(
                    "decode_attention", stage1_kernel(config), stage1_signature(dtype, pool_dtype), constexprs,
                    num_warps=config.num_warps, num_stages=config.num_stages, expects_wgmma=False,
                    expects_pipelining=config.num_stages > 1,
                    label=f"{dtype} q, {pool_dtype} pool {qk_dim}/{v_dim}{' in registers' if in_registers else ''}",
                ))
        # Keys as the dots' M (opt-in `DecodeConfig.keys_as_rows`): MLA's 16 heads on a bf16/f16 latent cache and
        # GQA on an fp8 pool; both dots are wgmma with the heads as N.
        for (qk_dim, v_dim, q_heads, kv_heads, v_from_k), pool_dtype in (
                ((576, 512, 16, 1, True), dtype), ((128, 128, 32, 8, False), "fp8e4nv")):
            config = DecodeConfig(block_n=32 if qk_dim == 576 else 64, block_h=16, num_warps=4, num_stages=2,
                                  keys_as_rows=True)
            fp8 = pool_dtype != dtype
            constexprs = stage1_constexprs(
                q_heads=q_heads, kv_heads=kv_heads, qk_head_dim=qk_dim, v_head_dim=v_dim, config=config,
                sm_scale=1.0 / math.sqrt(qk_dim), logit_cap=0.0, xai_temperature_len=-1, sliding_window=-1,
                max_kv_splits=_BUILD_MAX_SPLITS, v_in_k=v_from_k, v_from_k=v_from_k, dot_precision="tf32",
                final_at_one_split=True,
                has_kv_scales=fp8, f16_dots=uses_f16_dots({"bf16": jnp.bfloat16, "fp16": jnp.float16}[dtype], fp8),
                **_BUILD_BOUNDS)
            builds.append(build(
                "decode_attention", stage1_kernel(config), stage1_signature(dtype, pool_dtype), constexprs,
                num_warps=config.num_warps, num_stages=config.num_stages, expects_wgmma=True, expects_pipelining=True,
                label=f"{dtype} q, {pool_dtype} pool {qk_dim}/{v_dim} keys as rows",
            ))
        for v_dim, has_sink in itertools.product(sorted({v for _, v in SUPPORTED_HEAD_DIMS}), (True, False)):
            final_at_one_split = not has_sink  # `run`'s choice
            builds.append(build(
                "decode_attention", "decode_stage2_kernel",
                {"MID_O": "*fp32", "MID_LSE": "*fp32", "KV_INDPTR": "*i32", "NUM_KV_SPLITS": "*i32", "SINKS": "*fp32",
                 "O_STAGE1": f"*{dtype}" if final_at_one_split else "*fp32", "LSE_STAGE1": "*fp32",
                 "O": f"*{dtype}", "LSE": "*fp32"},
                stage2_constexprs(q_heads=32, v_head_dim=v_dim, sliding_window=-1, has_sink=has_sink,
                                  max_kv_splits=_BUILD_MAX_SPLITS, kv_capacity=_BUILD_BOUNDS["kv_capacity"],
                                  final_at_one_split=final_at_one_split),
                num_warps=4, num_stages=2,
                label=f"{dtype} v_dim={v_dim}{' sink' if has_sink else ' final rows at one split'}",
            ))
    return builds
