"""Decode attention: one new query token (or a few) per sequence over the paged KV pool. The op and its reference twin.

Semantics are `jaxattn.reference`'s (score order scale -> soft cap -> xai temperature -> mask; a sliding
window W keeps W + 1 keys; sinks add exp(sink) to the denominator only; empty rows give 0 and LSE -inf).
The query of sequence b is the last token of its KV list, its K/V already written to the pool.

  * `decode_metadata` / `decode_metadata_from_indptr` (`jaxattn.metadata`; jit-friendly, no host sync) build a
    `DecodeMetadata` pytree once per batch: the CSR KV lists and the number of KV splits of every sequence.
  * `decode_attention(q, k_pool, v_pool, meta, ...)` runs an implementation from `IMPLEMENTATIONS`: on sm_90 the
    Mosaic GPU MLA kernel (`jaxattn.impl.mgpu_mla`) for MLA's latent cache (576/512 or 288/256, V inside K,
    16-bit, or an fp8 latent cache 576 wide), the Mosaic GPU GQA kernel
    (`jaxattn.impl.mgpu_decode`) for separate 16-bit K/V pools (head dim 64/128, one token, no soft cap), else SGLang's
    split-KV Triton kernels (`jaxattn.impl.triton_decode`); `impl="mgpu-gqa-fp8"` runs the GQA kernel on fp8 pools
    (opt-in: slower than Triton there so far) and `impl="mgpu-fp8"` the MLA kernel on any fp8 latent call it takes
    (what "mgpu" takes over fp8, by name).
  * `decode_attention_reference(q, k_pool, v_pool, meta, ...)`: the same call on the pure-jnp reference.

Several query tokens per sequence (speculative verify, multi-token prediction): q ``[batch, tokens, q_heads, dim]``,
the last ``tokens`` listed keys of a sequence being those tokens' own (the drafts, written to the pool first). Token t
sees the keys before the drafts and drafts 0..t (causal), or with ``draft_mask`` (i32[batch, tokens], bit j of
[b, t]: token t sees draft j; `draft_mask_bits` packs a boolean tree mask) a draft tree. The kernel reads each K/V row
once for all the tokens. Up to 32 tokens; no sliding window or xai temperature (extend_attention takes those).

MLA: pass ``v_pool=None`` (and ``v_head_dim``, default 512 for qk_head_dim 576 and 256 for 288) when V is
the first ``v_head_dim`` dims of K, as in DeepSeek's latent cache: the kernel then reuses the K tile it already
loaded instead of reading V a second time. A JAX array cannot be a strided view, so this is the way to avoid
materialising ``k_pool[..., :512]``.

Example::

    meta = decode_metadata(req_to_token, req_pool_indices, seq_lens, kv_capacity=4096,
                           q_heads=32, kv_heads=8)
    o = decode_attention(q, k_pool, v_pool, meta)            # [batch, 32, head_dim]
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.calls import DecodeCall
from jaxattn.checks import check_decode_args, jit_with_kv_scales, launch_mode_argument
from jaxattn.fp8 import kv_scale_table
from jaxattn.impl import mgpu_decode, mgpu_mla, triton_decode
from jaxattn.launch import launch_mode as resolve_launch_mode
from jaxattn.metadata import (  # noqa: F401  (re-exported: the builders' documented home before jaxattn.metadata)
    MIN_BLOCK_KV,
    DecodeMetadata,
    decode_metadata,
    decode_metadata_from_indptr,
    default_max_kv_splits,
    draft_mask_bits,
    num_kv_splits_heuristic,
)
from jaxattn.reference import ragged_paged_attention_reference
from jaxattn.registry import select
from jaxattn.tuning import (  # noqa: F401  (re-exported)
    DecodeConfig,
    clamp_decode_config as clamp_config,
    decode_config as get_config,
    heuristic_decode_config as heuristic_config,
    vector_config,
)
from jaxattn.tuning.sm90 import DECODE as SM90_CONFIGS  # noqa: F401  (re-exported)

# In order of preference: the first that takes a call runs it (on sm_90, MLA's latent cache (fp8 ones 576 wide
# included) and GQA over 16-bit pools take the Mosaic GPU kernels; everything else, and every call off Hopper,
# the Triton kernels). The Mosaic GPU kernels' fp8 entries come after Triton, which takes every call, so they run only
# by name (`impl="mgpu-gqa-fp8"`, `"mgpu-fp8"`).
IMPLEMENTATIONS = (mgpu_mla.DECODE, mgpu_decode.DECODE, triton_decode.IMPLEMENTATION, mgpu_decode.DECODE_FP8,
                   mgpu_mla.DECODE_FP8)


def _effective_window(meta, sliding_window):
    return sliding_window if sliding_window >= 0 else meta.sliding_window


@jit_with_kv_scales(static_argnames=("sm_scale", "logit_cap", "xai_temperature_len", "sliding_window", "return_lse",
                                      "v_head_dim", "config", "launch_mode", "mode", "impl"))
def decode_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array | None,
    meta: DecodeMetadata,
    *,
    sm_scale: float | None = None,
    logit_cap: float = 0.0,
    sinks: jax.Array | None = None,
    xai_temperature_len: int = -1,
    sliding_window: int = -1,
    return_lse: bool = False,
    v_head_dim: int | None = None,
    config: DecodeConfig | None = None,
    launch_mode: str | None = None,
    impl: str | None = None,
    mode: str | None = None,
    k_scale=None,
    v_scale=None,
    draft_mask: jax.Array | None = None,
):
    """Attention of one query (or a few) per sequence over its paged KV list.

    Args:
      q: [batch, q_heads, qk_head_dim] f32/f16/bf16 (batch = meta's max_batch; padding rows give 0), or
        [batch, tokens, q_heads, qk_head_dim]: the sequence's last `tokens` listed keys are these queries' own.
      k_pool: [slots, kv_heads, qk_head_dim], q's dtype or fp8 (e4m3fn / e5m2, read directly: `jaxattn.fp8`).
        q head h reads kv head h // (q_heads // kv_heads).
      v_pool: [slots, kv_heads, v_head_dim], q's dtype or fp8; or None when V is the first `v_head_dim` dims of K
        (MLA).
      meta: `DecodeMetadata` of the batch.
      sm_scale: default 1 / sqrt(qk_head_dim).
      logit_cap: > 0 soft-caps the scores: cap * tanh(s / cap).
      sinks: optional f32[q_heads]; exp(sink) joins the softmax denominator.
      xai_temperature_len: > 0 scales scores by log2(pos) / log2(len) past that position (Grok).
      sliding_window: W >= 0 keeps the last W + 1 keys (default: meta's window).
      return_lse: also return the natural-log LSE (sink included).
      v_head_dim: with v_pool None: how many leading dims of K are V (default 512 for 576, 256 for 288).
      config: a `DecodeConfig` overriding the tuned table (for sweeps).
      launch_mode: "gpu", "interpret" or None (automatic); `mode` is its old name.
      impl: None (the first of `IMPLEMENTATIONS` that takes the call) or an implementation's name ("mgpu", "mgpu-gqa",
        "triton", "mgpu-gqa-fp8").
      k_scale, v_scale: the pools hold K / k_scale and V / v_scale: None (1), a float > 0 or a float array [] /
        [kv_heads] (traced). k_scale joins the score scale, v_scale the output.
      draft_mask: with several tokens, optional i32/u32[batch, tokens]: bit j of [b, t] = token t sees draft j
        (default causal: drafts 0..t). Keys before the drafts are always visible.

    Returns:
      o: q's shape with v_head_dim last, in q's dtype; with return_lse also the f32 LSE (q's shape without the last
      axis).
    """
    batch, q_heads, kv_heads, qk_dim, v_dim = check_decode_args(
        q, k_pool, v_pool, meta, meta_type=DecodeMetadata, sinks=sinks, v_head_dim=v_head_dim,
        sliding_window=sliding_window, logit_cap=logit_cap, xai_temperature_len=xai_temperature_len, sm_scale=sm_scale,
        k_scale=k_scale, v_scale=v_scale, draft_mask=draft_mask,
    )
    call = DecodeCall(
        q=q, k_pool=k_pool, v_pool=v_pool, meta=meta, sinks=sinks,
        sm_scale=1.0 / math.sqrt(qk_dim) if sm_scale is None else float(sm_scale), logit_cap=float(logit_cap),
        xai_temperature_len=int(xai_temperature_len), sliding_window=_effective_window(meta, sliding_window),
        v_head_dim=v_dim, return_lse=return_lse, config=config,
        launch_mode=resolve_launch_mode(launch_mode_argument(launch_mode, mode)),
        kv_scales=kv_scale_table(k_scale, k_scale if v_pool is None else v_scale, kv_heads), draft_mask=draft_mask,
    )
    return select(IMPLEMENTATIONS, call, impl).run(call)


def decode_attention_reference(
    q, k_pool, v_pool, meta, *, sm_scale=None, logit_cap=0.0, sinks=None, xai_temperature_len=-1, sliding_window=-1,
    return_lse=False, v_head_dim=None, config=None, launch_mode=None, impl=None, mode=None, k_scale=None, v_scale=None,
    draft_mask=None,
):
    """`decode_attention` on the pure-jnp reference (same arguments; config, launch_mode and impl are ignored)."""
    del config, launch_mode, impl, mode
    batch, q_heads, kv_heads, qk_dim, v_dim = check_decode_args(
        q, k_pool, v_pool, meta, meta_type=DecodeMetadata, sinks=sinks, v_head_dim=v_head_dim,
        sliding_window=sliding_window, logit_cap=logit_cap, xai_temperature_len=xai_temperature_len, sm_scale=sm_scale,
        k_scale=k_scale, v_scale=v_scale, draft_mask=draft_mask,
    )
    tokens = 1 if q.ndim == 3 else q.shape[1]
    if v_pool is None:  # V is K's first v_dim dims, scaled by k_scale
        v_pool, v_scale = k_pool[..., :v_dim], k_scale
    window = _effective_window(meta, sliding_window)
    kv_indptr = meta.kv_indptr.astype(jnp.int32)
    kv_lens = kv_indptr[1:] - kv_indptr[:-1]
    max_kv_len = meta.max_kv_len
    try:
        # A list is at most kv_capacity keys (the kernels cut a hostile indptr there), so a step sizes no more.
        max_kv_len = min(max(int(np.max(np.asarray(kv_lens), initial=0)), 1), max(meta.kv_capacity, 1))
    except jax.errors.TracerArrayConversionError:
        max_kv_len = meta.kv_capacity if max_kv_len is None else min(max_kv_len, meta.kv_capacity)
    out = ragged_paged_attention_reference(
        q.reshape(batch * tokens, q_heads, qk_dim), k_pool, v_pool, jnp.arange(batch + 1, dtype=jnp.int32) * tokens,
        kv_indptr, meta.kv_indices, causal=True, sliding_window=window, logit_cap=logit_cap, sinks=sinks,
        xai_temperature_len=xai_temperature_len, sm_scale=sm_scale, kv_start_pos=meta.seq_lens.astype(jnp.int32) - kv_lens,
        max_q_len=tokens, max_kv_len=max_kv_len, return_lse=return_lse, k_scale=k_scale, v_scale=v_scale,
        draft_mask=None if draft_mask is None else draft_mask.reshape(-1),
    )
    o, lse = out if return_lse else (out, None)
    o = o.reshape(q.shape[:-1] + (v_dim,))
    return (o, lse.reshape(q.shape[:-1])) if return_lse else o
