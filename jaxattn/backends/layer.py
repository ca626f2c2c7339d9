"""What a backend needs to know of one attention layer, and the helpers every backend shares.

    backend = ReferenceBackend()                       # or TritonBackend(), FlashInferBackend()
    meta = backend.init_forward_metadata(batch, req_to_token)      # inside jit, no host sync
    o, k_pool, v_pool = backend.forward(q, k, v, k_pool, v_pool, layer, meta, sinks=...)

Per-layer facts that SGLang keeps on RadixAttention (heads, scale, soft cap, window, cross attention, fp8 scales)
are an `AttentionLayer`: static and hashable.
"""

from __future__ import annotations

import dataclasses
import math

from jaxattn.checks import check_head_dims, check_heads, check_positive_int, check_score_options, check_sm_scale, check_window
from jaxattn.fp8 import is_fp8


@dataclasses.dataclass(frozen=True)
class AttentionLayer:
    """Static description of one attention layer (SGLang's RadixAttention attributes)."""

    layer_id: int
    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int | None = None  # default head_dim
    sm_scale: float | None = None  # default 1 / sqrt(head_dim)
    logit_cap: float = 0.0
    sliding_window: int = -1  # W >= 0: each query sees itself and the W previous tokens
    is_cross_attention: bool = False  # attends the encoder's tokens (non-causal)
    xai_temperature_len: int = -1
    k_scale: float | None = None  # fp8 KV storage scales
    v_scale: float | None = None
    # The layer takes per-head attention sinks (GPT-OSS; `forward(sinks=)`, which every backend then requires).
    # FlashInferBackend plans its sink-aware wrapper for such layers and takes sinks for them only; the other
    # backends also take sinks for layers not marked.
    has_sinks: bool = False

    def __post_init__(self):
        check_heads(self.q_heads, self.kv_heads)
        check_positive_int("head_dim", self.head_dim)
        if self.v_head_dim is not None:
            check_positive_int("v_head_dim", self.v_head_dim)
        check_head_dims(self.head_dim, self.dv, qk_name="head_dim", v_name="v_head_dim")
        check_sm_scale(self.sm_scale)
        check_window("sliding_window", self.sliding_window)
        check_score_options(self.logit_cap, self.xai_temperature_len)
        for name in ("k_scale", "v_scale"):
            scale = getattr(self, name)
            if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
                raise ValueError(f"{name} must be None or a finite float > 0 (fp8 pools store value / scale); got {scale!r}")

    @property
    def dv(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.sm_scale is None else self.sm_scale

    def pool_scales(self, k_pool, v_pool) -> dict:
        """The ops' k_scale / v_scale for this layer's pools: its scales for fp8 pools, none for 16/32-bit pools
        (they hold the values themselves, as `write_kv` stores them). A latent pool (v_pool None) has K's scale only."""
        scales = {}
        if is_fp8(k_pool.dtype):
            scales["k_scale"] = self.k_scale
        if v_pool is not None and is_fp8(v_pool.dtype):
            scales["v_scale"] = self.v_scale
        return scales

    def check_sinks(self, sinks) -> None:
        """ValueError when a layer marked `has_sinks` gets no sinks (a forgotten argument would silently drop them)."""
        if self.has_sinks and sinks is None:
            raise ValueError(f"layer {self.layer_id} has sinks (AttentionLayer(has_sinks=True)): pass forward(sinks=) "
                             "f32[q_heads]")

    def latent_v(self, k_pool, scales: dict):
        """(v_pool, scales) for ops that read V as an array of its own, from a latent pool: its rows' first v_head_dim
        dims (a copy of that slice of the pool) and K's scale as V's."""
        if "k_scale" in scales:
            scales = dict(scales, v_scale=scales["k_scale"])
        return k_pool[..., :self.dv], scales


def is_latent_pool(v_pool, v) -> bool:
    """Whether this layer's pool is latent (MLA's: v_pool None, V the first v_head_dim dims of each K row); a latent
    pool takes no separate new V (ValueError otherwise)."""
    if v_pool is None and v is not None:
        raise ValueError("v must be None with a latent pool (v_pool None): V is part of K")
    return v_pool is None


def split_heads(x, heads, dim, name):
    if x.ndim == 2:
        if x.shape[1] != heads * dim:
            raise ValueError(f"{name} must be [tokens, {heads}*{dim}] or [tokens, {heads}, {dim}]; got {x.shape}")
        return x.reshape(x.shape[0], heads, dim)
    if x.ndim != 3 or x.shape[1:] != (heads, dim):
        raise ValueError(f"{name} must be [tokens, {heads}, {dim}]; got {x.shape}")
    return x



