"""Absorbed MLA on Hopper through a Pallas Mosaic GPU kernel (`kernels/mla_attention_mgpu.py`): decode (merging its
splits itself, or with the Triton merge) and extend.

`DECODE`, the "mgpu" implementation of `jaxattn.decode`'s contract for DeepSeek's absorbed attention: one 576-wide
latent head (`v_pool=None`: V is each row's first 512 dims), bf16/f16, one query token per sequence (sliding window
allowed) or several (speculative verify / multi-token prediction, causal or a draft mask), sinks (added by the merge).
Stage 1 packs (token, q head) rows of a sequence into 64-row wgmma tiles and reads each latent row once for all of
them; stage 2 is the Triton merge of the split partials (`jaxattn.impl.triton_decode.merge_splits`). One token over
a 576-wide 16-bit cache at 16 or 32 heads runs the transposed tile instead (keys as wgmma's M, the heads as N: a
quarter of the padded tile's matrix work; `MgpuDecodeConfig.transposed`, `tuning.sm90.MLA_DECODE_TRANSPOSED`). Either
tile merges a sequence's splits itself, sinks included, instead of stage 2 (`MgpuDecodeConfig.kernel_merge`,
`tuning.sm90.MLA_DECODE_KERNEL_MERGE`): one launch per call.

Its split bound is its own (static: enough CTAs to fill the GPU once, `kernel_splits`), each sequence taking the
metadata's split count under it; deterministic metadata keeps its own bound (splits by length only, so a sequence's
result does not depend on its batch).

`DECODE_FP8` ("mgpu-fp8", by name): the same decode over an fp8 (e4m3fn / e5m2) latent cache 576 wide, the
kernel's producer converting each tile to f16 in shared memory; q is multiplied by the softmax scale and k_scale and
rounded to f16 once, v_scale multiplies the outputs. It is `DECODE`'s too, so the default takes those calls: one
token at 16 or 32 heads on the transposed tile (H100, 3fba716: MLA-FP8 0.106 ms, the Triton kernel 0.195, the bf16
cache 0.111), verify steps and other head counts on the padded tile (H200, a56875d: MLA-V4-FP8 0.154 ms, Triton's
0.504; `tuning.sm90.MLA_DECODE_PADDED_FP8`).

Both take DeepSeek's 576/512 latent head and the half-size 288/256 (`MLA_HEAD_DIMS`). `EXTEND`, the "mgpu"
implementation of `jaxattn.mla.mla_extend_attention` (two-stage, causal, sinks allowed): one pass, 64 (token, head) rows per CTA over
the sequence's prefix and its new tokens up to the block's last.

Both need an sm_90 GPU and jax's CUDA plugin; the references are `jaxattn.decode.decode_attention_reference` and
`jaxattn.mla.mla_extend_attention_reference`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxattn import hardware
from jaxattn.calls import DecodeCall, MlaExtendCall
from jaxattn.checks import index_i32
from jaxattn.fp8 import is_fp8
from jaxattn.impl import triton_decode
from jaxattn.launch import operand_or_unread
from jaxattn.metadata import MIN_BLOCK_KV
from jaxattn.registry import Implementation
from jaxattn.tuning import MgpuDecodeConfig
from jaxattn.tuning.sm90 import (MLA_DECODE_KERNEL_MERGE, MLA_DECODE_MERGER_SKEW, MLA_DECODE_PADDED_FP8,
                                MLA_DECODE_TRANSPOSED, MLA_DECODE_TRANSPOSED_FP8)

# The latent head shapes the kernel builds (`SHAPES` of kernels/mla_attention_mgpu.py), each tested on the H200.
MLA_HEAD_DIMS = ((576, 512), (288, 256))
MGPU_DTYPES = (jnp.bfloat16, jnp.float16)


def rows_unsupported(tokens: int, q_heads: int) -> str | None:
    """Why the decode kernel cannot pack `tokens` x `q_heads` rows per sequence into its 64-row blocks, or None."""
    from jaxattn.kernels.mla_attention_mgpu import BLOCK_ROWS, decode_rows_supported

    rows = tokens * q_heads
    if not decode_rows_supported(rows):
        return (f"tokens x q heads = {rows} rows per sequence (the kernel takes multiples of 8 up to {BLOCK_ROWS}, "
                f"or multiples of {BLOCK_ROWS})")
    return None


def declines_decode(call: DecodeCall) -> str | None:
    """"mgpu": a latent pool of q's dtype, or an fp8 one 576 wide: on the transposed tile where it takes the call
    (one token at 16 or 32 heads: `MLA_DECODE_TRANSPOSED_FP8`), else on the padded tile (`MLA_DECODE_PADDED_FP8`);
    "mgpu-fp8" takes the same fp8 calls by name, whatever the two flags say."""
    if is_fp8(call.k_pool.dtype):
        reason = declines_decode_fp8(call)
        if reason is None and not (_transposed(call) or MLA_DECODE_PADDED_FP8):
            return ("an fp8 pool off the transposed tile (one token at 16 or 32 heads, 576 wide) with "
                    "MLA_DECODE_PADDED_FP8 off (impl=\"mgpu-fp8\" takes it by name)")
        return reason
    if call.k_pool.dtype != call.q.dtype or call.kv_scales is not None:
        return (f"a {jnp.dtype(call.k_pool.dtype).name} pool with {jnp.dtype(call.q.dtype).name} q, or K/V scales "
                "(fp8 latent pools: impl=\"mgpu-fp8\", by name)")
    return _declines_decode_call(call)


def declines_decode_fp8(call: DecodeCall) -> str | None:
    """"mgpu-fp8": an fp8 (e4m3fn / e5m2) latent pool 576 wide, converted by the kernel."""
    from jaxattn.kernels.mla_attention_mgpu import SHAPES

    if not is_fp8(call.k_pool.dtype):
        return f"a {jnp.dtype(call.k_pool.dtype).name} pool (fp8 only; 16-bit pools: impl=\"mgpu\")"
    shape = SHAPES.get(call.qk_head_dim)
    if shape is not None and shape.width != call.qk_head_dim:  # converted in place only as whole 64-column tiles
        return f"an fp8 latent head {call.qk_head_dim} wide (rows of whole 64-column tiles only: 576)"
    return _declines_decode_call(call)


def _declines_decode_call(call: DecodeCall) -> str | None:
    """The limits both decode implementations share (the pool's dtype aside)."""
    if call.config is not None and not isinstance(call.config, MgpuDecodeConfig):
        return f"config is a {type(call.config).__name__} (this kernel takes an MgpuDecodeConfig or none)"
    if call.config is not None and call.config.stages is not None:
        return "MgpuDecodeConfig(stages=) (the MLA kernel's ring depth is fixed by its shared memory)"
    if call.config is not None and call.config.persistent:
        return "MgpuDecodeConfig(persistent=True) (the MLA kernel launches one CTA per work item)"
    from jaxattn.kernels.mla_attention_mgpu import DECODE_KV32

    if call.config is not None and call.config.block_kv == 32 and call.qk_head_dim != DECODE_KV32.qk_dim:
        return f"MgpuDecodeConfig(block_kv=32) at head dim {call.qk_head_dim} ({DECODE_KV32.qk_dim} only)"
    if isinstance(call.config, MgpuDecodeConfig) and call.config.transposed:
        reason = _transposed_unsupported(call)
        if reason is not None:
            return f"MgpuDecodeConfig(transposed=True) with {reason}"
    if call.config is not None and call.config.merger_skew and not _kernel_merges(call):
        return "MgpuDecodeConfig(merger_skew=) without the kernel merge (it moves the merging split's keys)"
    if (call.qk_head_dim, call.v_head_dim) not in MLA_HEAD_DIMS:
        return f"head dims {call.qk_head_dim}/{call.v_head_dim} (MLA's latent heads {MLA_HEAD_DIMS} only)"
    if call.v_pool is not None:
        return "a separate V pool (the kernel reads V as the first 512 dims of each latent row: v_pool=None)"
    if call.kv_heads != 1:
        return f"{call.kv_heads} kv heads (MLA's one latent head only)"
    if jnp.dtype(call.q.dtype) not in map(jnp.dtype, MGPU_DTYPES):
        return f"dtype {jnp.dtype(call.q.dtype).name} (bf16/f16 only)"
    if call.logit_cap > 0 or call.xai_temperature_len > 0:
        return "a soft cap or xai temperature"
    reason = rows_unsupported(call.tokens_per_seq, call.q_heads)
    if reason is not None:
        return reason
    if call.batch > hardware.GRID_YZ_LIMIT:  # the batch is the grid's third dimension
        return f"batch {call.batch} (at most {hardware.GRID_YZ_LIMIT}: the launch grid's third dimension)"
    return hardware.mosaic_gpu_unavailable(call.launch_mode)


def kernel_splits(batch: int, head_blocks: int, num_sms: int | None = None) -> int:
    """The static split bound: as many splits as fill every multiprocessor once with batch x head_blocks x splits
    CTAs (one CTA per SM fits: the kernel takes 201-217 KB of sm_90's 227 KB of shared memory), at least 1."""
    num_sms = hardware.sm_count() if num_sms is None else num_sms
    return max(1, num_sms // max(1, batch * head_blocks))


def _transposed_unsupported(call: DecodeCall) -> str | None:
    """Why the transposed tile cannot take the call (`mla_decode_transposed_kernel`'s limits), or None."""
    from jaxattn.kernels.mla_attention_mgpu import TRANSPOSED_QK_DIM, transposed_rows_supported

    if (call.config is not None and call.config.block_kv is not None) or call.qk_head_dim != TRANSPOSED_QK_DIM:
        return f"block_kv or a latent head other than {TRANSPOSED_QK_DIM}"
    if call.tokens_per_seq != 1 or not transposed_rows_supported(call.q_heads):
        return f"{call.tokens_per_seq} tokens x {call.q_heads} heads (one token, 16 or 32 heads)"
    return None


def _transposed(call: DecodeCall) -> bool:
    """Whether the call runs on the transposed tile: `MgpuDecodeConfig.transposed` where set, else wherever the tile
    takes the call over a 16-bit cache (`MLA_DECODE_TRANSPOSED`; over fp8, `MLA_DECODE_TRANSPOSED_FP8`)."""
    if isinstance(call.config, MgpuDecodeConfig) and call.config.transposed is not None:
        return call.config.transposed
    default = MLA_DECODE_TRANSPOSED_FP8 if is_fp8(call.k_pool.dtype) else MLA_DECODE_TRANSPOSED
    return default and _transposed_unsupported(call) is None


def _split_bound(call: DecodeCall) -> int:
    """The kernel's static split bound. The metadata's splits per sequence (its heuristic keeps every split >= 256
    keys; deterministic: by length only) fall under it: both stages clamp them to it alike, so no per-call work
    computes them. Deterministic metadata keeps its own bound, else the config's, else `kernel_splits`."""
    from jaxattn.kernels.mla_attention_mgpu import BLOCK_ROWS

    if call.meta.deterministic:
        return call.meta.max_kv_splits
    if call.config is not None and call.config.splits is not None:
        return call.config.splits
    return kernel_splits(call.batch, max(1, call.tokens_per_seq * call.q_heads // BLOCK_ROWS))  # head blocks


def mla_decode_partials(call: DecodeCall):
    """Stage 1 on the kernel: (mid_o f32[batch * tokens, q_heads, splits, 512], mid_lse f32[batch * tokens, q_heads,
    splits], num_kv_splits i32[batch], splits), the partial buffers `triton_decode.merge_splits` takes."""
    splits = _split_bound(call)
    mid_o, mid_lse = _launch(call, splits, merge=False)
    rows = call.batch * call.tokens_per_seq
    return (mid_o.reshape(rows, call.q_heads, splits, call.v_head_dim), mid_lse.reshape(rows, call.q_heads, splits),
            index_i32(call.meta.num_kv_splits), splits)


def _launch(call: DecodeCall, splits: int, *, merge: bool):
    """The kernel over the call, on the transposed tile where it runs (`_transposed`), else the padded one: its
    partials (merge=False; the sinks are the Triton merge's) or its result and LSE (merge=True)."""
    from jaxattn.kernels.mla_attention_mgpu import mla_decode_mgpu_kernel, mla_decode_transposed_kernel

    meta = call.meta
    batch, tokens, q_heads = call.batch, call.tokens_per_seq, call.q_heads
    index_args = (index_i32(meta.kv_indptr), operand_or_unread(meta.kv_indices),
                  index_i32(meta.num_kv_splits))
    window = call.sliding_window if call.sliding_window >= 0 else -1
    sinks = call.sinks if merge else None
    skew = 0 if not merge else _merger_skew(call)
    q, sm_scale, v_scale = call.q, call.sm_scale, None
    if is_fp8(call.k_pool.dtype):
        # f16 dots (f16 holds every fp8 value): q times the softmax scale and k_scale in f32, rounded to f16 once (as
        # the Triton kernel's f16 dots; |q * scale| past 65504 gives inf scores); v_scale multiplies the outputs.
        scales = jnp.ones((2, 1), jnp.float32) if call.kv_scales is None else call.kv_scales.astype(jnp.float32)
        q = (q.astype(jnp.float32) * (sm_scale * scales[0, 0])).astype(jnp.float16)
        sm_scale, v_scale = 1.0, scales[1, :1]
    if _transposed(call):  # one token, 16 or 32 heads: one row block (the kernel's checks)
        return mla_decode_transposed_kernel(
            q.reshape(batch * q_heads, 1, call.qk_head_dim), call.k_pool, *index_args, sinks, q_heads=q_heads,
            sm_scale=sm_scale, max_kv_splits=splits, sliding_window=window, min_block_kv=MIN_BLOCK_KV,
            merge=merge, v_scale=v_scale, out_dtype=call.q.dtype, merger_skew=skew)
    draft_words = None  # one token, or several under the causal mask (the kernel computes it: no per-call words)
    if tokens > 1 and call.draft_mask is not None:  # one word per (sequence, token), its heads' rows share it
        words = call.draft_mask
        words = jax.lax.bitcast_convert_type(words, jnp.int32) if words.dtype == jnp.uint32 else words
        draft_words = words.reshape(-1, 1)
    return mla_decode_mgpu_kernel(
        q.reshape(batch * tokens * q_heads, 1, call.qk_head_dim), call.k_pool, *index_args, draft_words, sinks,
        tokens=tokens, q_heads=q_heads, sm_scale=sm_scale, max_kv_splits=splits, sliding_window=window,
        min_block_kv=MIN_BLOCK_KV, v_scale=v_scale, merge=merge, out_dtype=call.q.dtype, merger_skew=skew,
        **({} if call.config is None or call.config.block_kv is None else dict(block_kv=call.config.block_kv)))


def _merger_skew(call: DecodeCall) -> int:
    """The merging split's extra keys: `MgpuDecodeConfig.merger_skew` where set, else `MLA_DECODE_MERGER_SKEW`."""
    if isinstance(call.config, MgpuDecodeConfig) and call.config.merger_skew is not None:
        return call.config.merger_skew
    return MLA_DECODE_MERGER_SKEW


def _kernel_merges(call: DecodeCall) -> bool:
    """Whether the kernel merges the splits itself: `MgpuDecodeConfig.kernel_merge` where set, else
    `MLA_DECODE_KERNEL_MERGE`."""
    if isinstance(call.config, MgpuDecodeConfig) and call.config.kernel_merge is not None:
        return call.config.kernel_merge
    return MLA_DECODE_KERNEL_MERGE


def run_decode(call: DecodeCall):
    if call.batch and _kernel_merges(call):
        o, lse = _launch(call, _split_bound(call), merge=True)
        o, lse = o.reshape(call.q.shape[:-1] + (call.v_head_dim,)), lse.reshape(call.q.shape[:-1])
        return (o, lse) if call.return_lse else o
    return triton_decode.run_merged(call, mla_decode_partials)


DECODE = Implementation("mgpu", declines_decode, run_decode)
# fp8 latent pools (issue 26): the kernel's producer converts each tile to f16 in shared memory. Every fp8 call the
# kernel takes, by name; `DECODE` takes those on the transposed tile.
DECODE_FP8 = Implementation("mgpu-fp8", declines_decode_fp8, run_decode)


def declines_extend(call: MlaExtendCall) -> str | None:
    if (call.qk_head_dim, call.v_head_dim) not in MLA_HEAD_DIMS:
        return f"head dims {call.qk_head_dim}/{call.v_head_dim} (MLA's latent heads {MLA_HEAD_DIMS} only)"
    if jnp.dtype(call.q.dtype) not in map(jnp.dtype, MGPU_DTYPES):
        return f"dtype {jnp.dtype(call.q.dtype).name} (bf16/f16 only)"
    if call.k_pool.dtype != call.q.dtype:
        return f"a {jnp.dtype(call.k_pool.dtype).name} pool with {jnp.dtype(call.q.dtype).name} q"
    from jaxattn.kernels.mla_attention_mgpu import extend_heads_supported

    if not extend_heads_supported(call.q_heads):
        return f"{call.q_heads} q heads (a multiple of 8, or a divisor of 64)"
    if call.meta.qo_indptr.shape[0] - 1 > hardware.GRID_YZ_LIMIT:  # the batch is the grid's second dimension
        return (f"batch {call.meta.qo_indptr.shape[0] - 1} (at most {hardware.GRID_YZ_LIMIT}: the launch grid's "
                f"second dimension)")
    return hardware.mosaic_gpu_unavailable(call.launch_mode)


def run_extend(call: MlaExtendCall):
    from jaxattn.kernels.mla_attention_mgpu import mla_extend_mgpu_kernel
    from jaxattn.kernels.zero_rows_mgpu import unwritten_rows_zeroed

    tokens, q_heads, dim = call.q.shape
    meta = call.meta
    if tokens == 0 or call.meta.qo_indptr.shape[0] == 1:
        return jnp.zeros((tokens, q_heads, call.v_head_dim), call.q.dtype)
    kv_indices = operand_or_unread(meta.kv_indices)
    # The kernel fills the buffer in place; rows it does not compute (padding tokens, past max_extend_len) are 0
    # (only those are cleared). Its (token, head) rows are the [tokens, q_heads, v] buffer's bytes.
    out = unwritten_rows_zeroed(meta.qo_indptr, rows=tokens, row_shape=(q_heads, call.v_head_dim), dtype=call.q.dtype,
                                max_extend_len=meta.max_extend_len, owner=call.q)
    out_ref = jax.new_ref(out.reshape(tokens * q_heads, call.v_head_dim))
    mla_extend_mgpu_kernel(
        call.q.reshape(tokens * q_heads, 1, dim), call.k_new, call.k_pool, index_i32(meta.qo_indptr),
        index_i32(meta.kv_indptr), kv_indices, out_ref, q_heads=q_heads, sm_scale=call.sm_scale,
        max_extend_len=meta.max_extend_len, sinks=None if call.sinks is None else call.sinks.astype(jnp.float32))
    return out_ref[...].reshape(tokens, q_heads, call.v_head_dim)


EXTEND = Implementation("mgpu", declines_extend, run_extend)

