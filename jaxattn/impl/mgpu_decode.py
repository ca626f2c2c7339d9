"""Grouped-query decode on Hopper through a Pallas Mosaic GPU kernel (`kernels/decode_attention_mgpu.py`): stage 1
on the kernel (two kv heads per work item), stage 2 the Triton merge (`triton_decode.merge_splits`); with one split
per sequence and no sinks the kernel writes the result itself (no merge launch).

Two implementations of `jaxattn.decode`'s contract on it: `DECODE` ("mgpu-gqa", the default on sm_90) for 16-bit
pools, and `DECODE_FP8` ("mgpu-gqa-fp8", by name only) for fp8 pools (e4m3fn / e5m2 with per-layer or per-head
scales), where the Triton kernel is still faster. Both take separate K and V pools, bf16/f16 q, head dim 128 (and 64
for 16-bit pools), at most 64 q heads per kv head, one query token per sequence, a sliding window and sinks; they
decline soft caps, xai temperature, several query tokens and latent (MLA) pools, which the Triton kernels take.

Its split bound is its own (static: enough CTAs to fill every multiprocessor once, `kernel_splits`), each sequence
taking the metadata's split count under it; deterministic metadata keeps its own bound. Its launch (one CTA per
work item, or persistent CTAs) is `persistent_ctas`'s rule.
Needs an sm_90 GPU and jax's CUDA plugin; the reference is `jaxattn.decode.decode_attention_reference`.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxattn import hardware
from jaxattn.calls import DecodeCall
from jaxattn.checks import index_i32
from jaxattn.fp8 import is_fp8, scale_table_operand
from jaxattn.impl import triton_decode
from jaxattn.launch import operand_or_unread
from jaxattn.metadata import MIN_BLOCK_KV
from jaxattn.registry import Implementation
from jaxattn.tuning import MgpuDecodeConfig

MGPU_DTYPES = (jnp.bfloat16, jnp.float16)


def _declines(call: DecodeCall) -> str | None:
    """What both entries decline (the pool's dtype aside)."""
    from jaxattn.kernels.decode_attention_mgpu import BLOCK_ROWS, HEAD_DIMS

    if call.config is not None and not isinstance(call.config, MgpuDecodeConfig):
        return f"config is a {type(call.config).__name__} (this kernel takes an MgpuDecodeConfig or none)"
    if call.config is not None and (call.config.block_kv is not None or call.config.transposed
                                    or call.config.merger_skew):
        return "MgpuDecodeConfig(block_kv=, transposed=, merger_skew=) (the MLA kernel's tiles; this kernel's are fixed)"
    if call.v_pool is None:
        return "a latent pool (V inside K: the MLA kernel's)"
    if jnp.dtype(call.q.dtype) not in map(jnp.dtype, MGPU_DTYPES):
        return f"dtype {jnp.dtype(call.q.dtype).name} (bf16/f16 only)"
    pool = jnp.dtype(call.k_pool.dtype)
    if pool != jnp.dtype(call.q.dtype) and not is_fp8(pool):
        return f"a {pool.name} pool with {jnp.dtype(call.q.dtype).name} q (q's dtype or fp8 only)"
    if call.qk_head_dim != call.v_head_dim or call.qk_head_dim not in HEAD_DIMS[pool.itemsize]:
        return (f"head dims {call.qk_head_dim}/{call.v_head_dim} (equal, one of {HEAD_DIMS[pool.itemsize]} for a "
                f"{pool.name} pool)")
    if call.q_heads // call.kv_heads > BLOCK_ROWS:
        return f"{call.q_heads // call.kv_heads} q heads per kv head (at most {BLOCK_ROWS})"
    if call.tokens_per_seq > 1:
        return "several query tokens per sequence"
    if call.logit_cap > 0 or call.xai_temperature_len > 0:
        return "a soft cap or xai temperature"
    one_cta_per_item = isinstance(call.config, MgpuDecodeConfig) and call.config.persistent is False
    if call.batch > hardware.GRID_YZ_LIMIT and one_cta_per_item:
        return (f"batch {call.batch} with MgpuDecodeConfig(persistent=False) (at most {hardware.GRID_YZ_LIMIT}: the "
                f"launch grid's third dimension)")
    return hardware.mosaic_gpu_unavailable(call.launch_mode)


def declines(call: DecodeCall) -> str | None:
    """"mgpu-gqa": 16-bit pools (q's dtype)."""
    if call.v_pool is not None and is_fp8(call.k_pool.dtype):
        return (f"a {jnp.dtype(call.k_pool.dtype).name} pool (fp8 pools: impl=\"mgpu-gqa-fp8\", opt-in, slower "
                f"than the Triton kernel in its H200 runs)")
    return _declines(call)


def declines_fp8(call: DecodeCall) -> str | None:
    """"mgpu-gqa-fp8": fp8 pools."""
    if call.v_pool is not None and not is_fp8(call.k_pool.dtype):
        return f"a {jnp.dtype(call.k_pool.dtype).name} pool (fp8 only; 16-bit pools: impl=\"mgpu-gqa\")"
    return _declines(call)


def ring_stages(head_dim: int, pool_itemsize: int, stages: int | None = None) -> int:
    """The kernel's ring depth: `stages` if it fits in sm_90's shared memory (else ValueError with the byte count),
    by default the deepest that fits, at most 3 (fp8 at head dim 128: 3, 196 KB; 16-bit at 128: 2)."""
    from jaxattn.kernels.decode_attention_mgpu import shared_bytes

    limit = hardware.SM90.shared_memory_bytes
    if stages is None:
        return max((s for s in (2, 3) if shared_bytes(head_dim, pool_itemsize, s) <= limit),
                   default=2)
    needed = shared_bytes(head_dim, pool_itemsize, stages)
    if needed > limit:
        raise ValueError(f"MgpuDecodeConfig(stages={stages}) needs {needed} bytes of shared memory at head dim "
                         f"{head_dim} over {pool_itemsize}-byte rows (sm_90 has {limit})")
    return stages


def persistent_ctas(call: DecodeCall, splits: int, num_sms: int | None = None) -> int:
    """The kernel's launch: 0 for one CTA per work item (split x kv head pair x sequence), else the number of
    persistent CTAs (one per multiprocessor, each taking items in turn). A config's `persistent` decides; by default
    persistent CTAs take batches of more than two items per multiprocessor (many short items, where a CTA's start-up
    weighs most: D3, 256 x 1024 keys, 92.5 -> 94.4% of the floor on the H200 at ab99378, 87.9 -> 90.2% in an earlier
    run; at one or two items per multiprocessor, D1 and D2, both launches were level within 0.4%)."""
    from jaxattn.kernels.decode_attention_mgpu import CONSUMERS

    num_sms = hardware.sm_count() if num_sms is None else num_sms
    items = splits * -(-call.kv_heads // CONSUMERS) * call.batch
    chosen = call.config.persistent if isinstance(call.config, MgpuDecodeConfig) else None
    if chosen is None:
        chosen = items > 2 * num_sms
    return num_sms if chosen else 0


def kernel_splits(batch: int, kv_heads: int, num_sms: int | None = None) -> int:
    """The static split bound: as many splits as fill every multiprocessor once with batch x kv head pairs x splits
    CTAs (one CTA per SM: two kv heads, 196 KB of shared memory at fp8), at least 1 (more CTAs than that run in
    waves without splitting)."""
    from jaxattn.kernels.decode_attention_mgpu import CONSUMERS

    num_sms = hardware.sm_count() if num_sms is None else num_sms
    return max(1, num_sms // max(1, batch * -(-kv_heads // CONSUMERS)))


def kernel_split_bound(call: DecodeCall) -> int:
    """The kernel's static split bound: deterministic metadata's own, else the config's, else `kernel_splits`."""
    config = call.config or MgpuDecodeConfig()
    if call.meta.deterministic:
        return call.meta.max_kv_splits
    if config.splits is not None:
        return config.splits
    return kernel_splits(call.batch, call.kv_heads)


def _launch(call: DecodeCall, splits: int, final: bool):
    from jaxattn.kernels.decode_attention_mgpu import gqa_decode_mgpu_kernel

    meta = call.meta
    config = call.config or MgpuDecodeConfig()
    kv_indices = operand_or_unread(meta.kv_indices)
    # The metadata's splits per sequence under this kernel's static bound: both stages clamp them to it alike.
    num_kv_splits = index_i32(meta.num_kv_splits)
    fp8 = call.k_pool.dtype != call.q.dtype
    kv_scales = None
    if fp8:  # f32[2 * kv_heads]: K scales, then V scales
        kv_scales = scale_table_operand(call.kv_scales, call.kv_heads)
    out, lse = gqa_decode_mgpu_kernel(
        call.q, call.k_pool, call.v_pool, index_i32(meta.kv_indptr), kv_indices, num_kv_splits, kv_scales,
        sm_scale=call.sm_scale, max_kv_splits=splits,
        stages=ring_stages(call.qk_head_dim, jnp.dtype(call.k_pool.dtype).itemsize, config.stages),
        sliding_window=call.sliding_window if call.sliding_window >= 0 else -1, min_block_kv=MIN_BLOCK_KV,
        persistent_ctas=persistent_ctas(call, splits), final=final)
    return out, lse, num_kv_splits


def gqa_decode_partials(call: DecodeCall):
    """Stage 1 on the kernel: (mid_o f32[batch, q_heads, splits, head_dim], mid_lse f32[batch, q_heads, splits],
    num_kv_splits i32[batch], splits), the partial buffers `triton_decode.merge_splits` takes."""
    splits = kernel_split_bound(call)
    mid_o, mid_lse, num_kv_splits = _launch(call, splits, final=False)
    mid_o = mid_o.reshape(call.batch, call.q_heads, splits, call.v_head_dim)
    mid_lse = mid_lse.reshape(call.batch, call.q_heads, splits)
    return mid_o, mid_lse, num_kv_splits, splits


def run(call: DecodeCall):
    """One split per sequence and no sinks: the kernel writes the result itself (stage 2 would copy it, bit for bit,
    one launch more); else stage 1 here, then the Triton merge."""
    if call.batch and call.sinks is None and kernel_split_bound(call) == 1:
        o, lse, _ = _launch(call, 1, final=True)
        o, lse = o.reshape(call.q.shape[:-1] + (call.v_head_dim,)), lse.reshape(call.q.shape[:-1])
        return (o, lse) if call.return_lse else o
    return triton_decode.run_merged(call, gqa_decode_partials)


# Two entries on one kernel: 16-bit pools (the default route on sm_90: ahead of the Triton kernel, 95-96% of the
# floor at D1/D2) and fp8 pools (by name only, after the Triton kernel: 0.220 ms against its 0.172 at D1-FP8).
DECODE = Implementation("mgpu-gqa", declines, run)
DECODE_FP8 = Implementation("mgpu-gqa-fp8", declines_fp8, run)
