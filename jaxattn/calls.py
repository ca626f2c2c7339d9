"""What an op hands its implementations: one call, its arguments checked and normalised (trace time).

An implementation reads a call and either declines it with a reason or runs it (see `jaxattn.registry`). Array
fields are traced values; the rest is static.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class DecodeCall:
    """`decode_attention`'s arguments. v_pool None: V is the first v_head_dim dims of K (MLA)."""

    q: jax.Array  # [batch, q_heads, qk_head_dim], or [batch, tokens_per_seq, q_heads, qk_head_dim]
    k_pool: jax.Array  # [slots, kv_heads, qk_head_dim]
    v_pool: jax.Array | None  # [slots, kv_heads, v_head_dim]
    meta: Any  # DecodeMetadata
    sinks: jax.Array | None  # f32[q_heads]
    sm_scale: float
    logit_cap: float
    xai_temperature_len: int
    sliding_window: int  # the effective window (the call's, else the metadata's)
    v_head_dim: int
    return_lse: bool
    config: Any  # an implementation's config or None
    launch_mode: str  # "gpu" | "interpret"
    kv_scales: jax.Array | None = None  # f32[2, kv_heads]: K and V scales of the pool (`jaxattn.fp8`), None: 1
    draft_mask: jax.Array | None = None  # i32[batch, tokens_per_seq]: each token's drafts as bits; None: causal

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def tokens_per_seq(self) -> int:
        return 1 if self.q.ndim == 3 else self.q.shape[1]

    @property
    def q_heads(self) -> int:
        return self.q.shape[-2]

    @property
    def kv_heads(self) -> int:
        return self.k_pool.shape[1]

    @property
    def qk_head_dim(self) -> int:
        return self.q.shape[-1]


class _TokenRows:
    """Shape accessors of a call whose q is [tokens, q_heads, qk_head_dim] (the extend-like ops)."""

    @property
    def tokens(self) -> int:
        return self.q.shape[0]

    @property
    def q_heads(self) -> int:
        return self.q.shape[1]

    @property
    def qk_head_dim(self) -> int:
        return self.q.shape[2]


@dataclasses.dataclass(frozen=True)
class ExtendCall(_TokenRows):
    """An extend call in one of two forms.

    form "two_stage" (`extend_attention`): the prefix through `meta.kv_indices` (an ExtendMetadata), the new tokens'
    K/V in k_new/v_new (q's rows). form "unified" (`extend_attention_unified`): every key through the pool
    (`meta` an ExtendUnifiedMetadata, k_new/v_new None), tiles at fixed key offsets (deterministic).
    """

    form: str  # "two_stage" | "unified"
    q: jax.Array  # [tokens, q_heads, qk_head_dim]
    k_new: jax.Array | None  # [tokens, kv_heads, qk_head_dim] (two_stage)
    v_new: jax.Array | None  # [tokens, kv_heads, v_head_dim] (two_stage)
    k_pool: jax.Array  # [slots, kv_heads, qk_head_dim]
    v_pool: jax.Array  # [slots, kv_heads, v_head_dim]
    meta: Any  # ExtendMetadata | ExtendUnifiedMetadata
    kv_start_pos: jax.Array  # i32[batch]: absolute position of each sequence's first listed key
    causal: bool
    custom_mask: jax.Array | None
    skip_prefix_custom_mask: bool
    sliding_window: int
    logit_cap: float
    sinks: jax.Array | None
    xai_temperature_len: int
    sm_scale: float
    config: Any
    launch_mode: str
    kv_scales: jax.Array | None = None  # f32[2, kv_heads]: K and V scales of the pool (`jaxattn.fp8`), None: 1
    # i32/u32[tokens, words] (two-stage): a compact tree mask, row r's bit j % 32 of word j // 32 = it sees its
    # sequence's new token j; the listed prefix is visible. Replaces causal; never with custom_mask.
    draft_mask: jax.Array | None = None

    @property
    def kv_heads(self) -> int:
        return self.v_pool.shape[1]

    @property
    def v_head_dim(self) -> int:
        return self.v_pool.shape[2]

    @property
    def batch(self) -> int:
        return self.meta.qo_indptr.shape[0] - 1

    @property
    def features(self) -> tuple[str, ...]:
        """The score features this call uses beyond plain causal attention (`score_features`)."""
        return score_features(causal=self.causal, custom_mask=self.custom_mask, sliding_window=self.sliding_window,
                              logit_cap=self.logit_cap, sinks=self.sinks, xai_temperature_len=self.xai_temperature_len,
                              draft_mask=self.draft_mask)


def score_features(*, causal, custom_mask, sliding_window, logit_cap, sinks, xai_temperature_len,
                   draft_mask=None) -> tuple[str, ...]:
    """Names of the score features an extend call uses beyond plain causal attention (the decline reasons' names)."""
    used = (("non-causal", not causal), ("custom mask", custom_mask is not None), ("sliding window", sliding_window >= 0),
            ("soft cap", logit_cap > 0), ("sinks", sinks is not None), ("xai temperature", xai_temperature_len > 0),
            ("draft mask", draft_mask is not None))
    return tuple(name for name, on in used if on)


@dataclasses.dataclass(frozen=True)
class MlaExtendCall(_TokenRows):
    """`jaxattn.mla.mla_extend_attention`'s arguments: absorbed MLA extend, V = the first v_head_dim dims of K."""

    q: jax.Array  # [tokens, q_heads, qk_head_dim]
    k_new: jax.Array  # [tokens, 1, qk_head_dim]: the new tokens' latent rows
    k_pool: jax.Array  # [slots, 1, qk_head_dim]
    meta: Any  # ExtendMetadata
    v_head_dim: int
    sinks: jax.Array | None  # f32[q_heads]
    sm_scale: float
    launch_mode: str  # "gpu" | "interpret"
