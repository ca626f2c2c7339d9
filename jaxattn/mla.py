"""Absorbed MLA extend (DeepSeek's prefill over a latent cache): one latent KV head whose first v_head_dim dims are V.

`mla_extend_attention(q, k_new, k_pool, meta)` is `jaxattn.extend.extend_attention`'s two-stage causal extend (the
same `ExtendMetadata`) without a separate V: k_new [tokens, 1, 576] holds the new tokens' latent rows, k_pool
[slots, 1, 576] the cache, and V is their first 512 dims (`v_head_dim`), as SGLang's MLA backends store it.

Implementations (`IMPLEMENTATIONS`, in order of preference):
  * "mgpu-gqa" (`jaxattn.impl.mgpu_extend.LATENT`): at 288/256 on sm_90 the GQA extend kernel, one q head's 128
    query rows per CTA sharing each latent K tile, V read from the K tiles, its two consumer warpgroups alternating
    their softmax with each other's matrix work (T288 on the H200: 0.631 ms, 60% of the floor, beside the MLA
    kernel's 0.804, 2026-12-05).
  * "mgpu" (`jaxattn.impl.mgpu_mla.EXTEND`): on sm_90, bf16/f16 at 576/512 (and 288/256 by name), a Mosaic GPU
    kernel reads each latent row once for 64 (token, head) rows (16 heads x 4 tokens) and computes S = Q K^T once for
    all V columns.
  * "triton": `extend_attention` on V sliced from K. The Triton kernels read V as an array of its own, so this route
    copies the first v_head_dim dims of k_pool and k_new on every call (a pool-sized copy): it is the fallback (other
    head dims such as 288/256, fp32, off Hopper), not a fast path. The cache is q's dtype: an fp8 latent cache goes
    through `extend_attention` with its scales (on a V slice).

Decode over the same cache is `jaxattn.decode.decode_attention(q, k_pool, None, meta, v_head_dim=512)`.
"""

from __future__ import annotations

import functools
import math

import jax

from jaxattn.calls import MlaExtendCall
from jaxattn.checks import (FLOAT_DTYPES, check_array, check_head_dims, check_meta, check_pool_extent, check_sinks,
                            check_sm_scale, latent_v_head_dim)
from jaxattn.extend import extend_attention, extend_attention_reference
from jaxattn.impl import mgpu_extend, mgpu_mla
from jaxattn.launch import launch_mode as resolve_launch_mode
from jaxattn.metadata import ExtendMetadata
from jaxattn.registry import Implementation, select


def _run_triton(call: MlaExtendCall):
    v = call.v_head_dim
    return extend_attention(call.q, call.k_new, call.k_new[..., :v], call.k_pool, call.k_pool[..., :v], call.meta,
                            sinks=call.sinks, sm_scale=call.sm_scale, launch_mode=call.launch_mode)


TRITON = Implementation("triton", lambda call: None, _run_triton)
IMPLEMENTATIONS = (mgpu_extend.LATENT, mgpu_mla.EXTEND, TRITON)


def _check(q, k_new, k_pool, meta, sinks, v_head_dim, sm_scale) -> int:
    """The arguments' shapes and dtypes (trace time); returns v_head_dim."""
    check_array("q", q, ndim=3, dtypes=FLOAT_DTYPES, what="[tokens, q_heads, qk_head_dim]")
    tokens, q_heads, qk_dim = q.shape
    check_array("k_new", k_new, shape=(tokens, 1, qk_dim), dtypes=(q.dtype,), what="[tokens, 1, qk_head_dim] (one latent head)")
    check_array("k_pool", k_pool, ndim=3, dtypes=(q.dtype,), what="[slots, 1, qk_head_dim] (one latent head), q's dtype")
    if k_pool.shape[1:] != (1, qk_dim):
        raise ValueError(f"k_pool must be [slots, 1, {qk_dim}] (one latent head of q's width); got {tuple(k_pool.shape)}")
    check_meta(meta, ExtendMetadata, "extend_metadata")
    if meta.sliding_window >= 0:
        raise ValueError(f"meta was cut for a sliding window ({meta.sliding_window}); MLA extend takes full prefix lists")
    check_pool_extent("k_pool", k_pool)
    check_sinks(sinks, q_heads)
    check_sm_scale(sm_scale)
    v_head_dim = latent_v_head_dim(v_head_dim, qk_dim)
    check_head_dims(qk_dim, v_head_dim, qk_name="qk_head_dim (q.shape[2])", v_name="v_head_dim")
    return v_head_dim


@functools.partial(jax.jit, static_argnames=("v_head_dim", "sm_scale", "launch_mode", "impl"))
def mla_extend_attention(q, k_new, k_pool, meta: ExtendMetadata, *, v_head_dim: int | None = None, sinks=None,
                         sm_scale: float | None = None, launch_mode: str | None = None, impl: str | None = None):
    """Causal two-stage extend over a latent cache, V = the first v_head_dim dims of K.

    Args:
      q: [tokens, q_heads, qk_head_dim] f32/f16/bf16 (absorbed queries, e.g. 576 = 512 latent + 64 rope).
      k_new: [tokens, 1, qk_head_dim]: the new tokens' latent rows (q's dtype).
      k_pool: [slots, 1, qk_head_dim]: the latent cache (q's dtype).
      meta: `ExtendMetadata` (`jaxattn.extend.extend_metadata`) with full prefix lists (no window cut).
      v_head_dim: V's width, the first dims of each latent row (default 512 for 576, 256 for 288).
      sinks: optional f32[q_heads] denominator-only logits. sm_scale: default 1 / sqrt(qk_head_dim).
      launch_mode: "gpu", "interpret" or None (automatic). impl: None (the first of `IMPLEMENTATIONS` that takes the
        call) or "mgpu" / "mgpu-gqa" / "triton".

    Returns:
      o: [tokens, q_heads, v_head_dim] in q's dtype; rows past qo_indptr[-1] are 0.
    """
    v_head_dim = _check(q, k_new, k_pool, meta, sinks, v_head_dim, sm_scale)
    call = MlaExtendCall(q=q, k_new=k_new, k_pool=k_pool, meta=meta, v_head_dim=v_head_dim, sinks=sinks,
                         sm_scale=1.0 / math.sqrt(q.shape[2]) if sm_scale is None else float(sm_scale),
                         launch_mode=resolve_launch_mode(launch_mode))
    return select(IMPLEMENTATIONS, call, impl).run(call)


def mla_extend_attention_reference(q, k_new, k_pool, meta, *, v_head_dim=None, sinks=None, sm_scale=None,
                                   launch_mode=None, impl=None):
    """`mla_extend_attention` on the pure-jnp reference (launch_mode and impl are ignored)."""
    del launch_mode, impl
    v = _check(q, k_new, k_pool, meta, sinks, v_head_dim, sm_scale)
    return extend_attention_reference(q, k_new, k_new[..., :v], k_pool, k_pool[..., :v], meta, sinks=sinks,
                                      sm_scale=sm_scale)
