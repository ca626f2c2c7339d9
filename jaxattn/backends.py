"""Attention backends: SGLang's backend layer as pure functions over pytrees.

    backend = ReferenceBackend()                       # or TritonBackend()
    meta = backend.init_forward_metadata(batch, req_to_token)      # inside jit, no host sync
    o, k_buffer, v_buffer = backend.forward(q, k, v, k_buffer, v_buffer, layer, meta, sinks=...)

`init_forward_metadata` runs once per step and its result is shared by every layer; `forward` writes the
step's new K/V at `batch.out_cache_loc` (in place when the caller donates the buffers) and attends.
Per-layer facts that SGLang keeps on RadixAttention (heads, scale, soft cap, window, cross attention)
are an `AttentionLayer`: static and hashable.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxattn.batch import ForwardBatch, ForwardMode
from jaxattn.kv_indices import create_kv_indices_reference, exclusive_cumsum
from jaxattn.kv_pool import read_scaled, write_kv
from jaxattn.reference import ragged_paged_attention_reference


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

    def __post_init__(self):
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads})")

    @property
    def dv(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.sm_scale is None else self.sm_scale


def _split_heads(x, heads, dim, name):
    if x.ndim == 2:
        if x.shape[1] != heads * dim:
            raise ValueError(f"{name} must be [tokens, {heads}*{dim}] or [tokens, {heads}, {dim}]; got {x.shape}")
        return x.reshape(x.shape[0], heads, dim)
    if x.ndim != 3 or x.shape[1:] != (heads, dim):
        raise ValueError(f"{name} must be [tokens, {heads}, {dim}]; got {x.shape}")
    return x


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReferenceMetadata:
    qo_indptr: jax.Array  # i32[B + 1]
    kv_indptr: jax.Array  # i32[B + 1]: every key of each sequence (prefix + new)
    kv_indices: jax.Array  # i32[kv_capacity]
    out_cache_loc: jax.Array  # i32[T]
    mask_indptr: jax.Array | None  # i32[B + 1] (TARGET_VERIFY)
    custom_mask: jax.Array | None  # bool[mask_capacity] (TARGET_VERIFY)
    cross_kv_indptr: jax.Array | None  # i32[B + 1]: the encoder's keys (cross attention)
    cross_kv_indices: jax.Array | None
    mode: ForwardMode = dataclasses.field(metadata=dict(static=True))
    max_q_len: int = dataclasses.field(metadata=dict(static=True))
    max_kv_len: int = dataclasses.field(metadata=dict(static=True))


class ReferenceBackend:
    """Pure-jnp backend: the CPU default and the oracle the kernel backends are tested against."""

    name = "reference"

    def init_forward_metadata(self, batch: ForwardBatch, req_to_token: jax.Array) -> ReferenceMetadata:
        encoder = batch.encoder_lens
        self_start = None if encoder is None else encoder
        kv_indptr, kv_indices = create_kv_indices_reference(
            req_to_token, batch.req_pool_indices, batch.seq_lens, self_start, capacity=batch.kv_capacity
        )
        cross_indptr = cross_indices = None
        if encoder is not None:
            cross_indptr, cross_indices = create_kv_indices_reference(
                req_to_token, batch.req_pool_indices, encoder, capacity=batch.kv_capacity
            )
        verify = batch.mode == ForwardMode.TARGET_VERIFY
        max_q = 1 if batch.mode == ForwardMode.DECODE else batch.max_extend_len
        return ReferenceMetadata(
            qo_indptr=batch.qo_indptr,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            out_cache_loc=batch.out_cache_loc,
            mask_indptr=batch.mask_indptr if verify else None,
            custom_mask=batch.custom_mask if verify else None,
            cross_kv_indptr=cross_indptr,
            cross_kv_indices=cross_indices,
            mode=batch.mode,
            max_q_len=max_q,
            max_kv_len=batch.max_seq_len,
        )

    def forward(self, q, k, v, k_buffer, v_buffer, layer: AttentionLayer, meta: ReferenceMetadata, *, sinks=None, save_kv=True):
        """Writes k/v (unless save_kv=False or k is None) and attends.

        Args:
          q: [T, q_heads, head_dim] or [T, q_heads * head_dim]. k, v: [T, kv_heads, head_dim / v_head_dim] (or flat).
          k_buffer, v_buffer: this layer's pool. sinks: optional f32[q_heads].

        Returns:
          (o [T, q_heads, v_head_dim], k_buffer, v_buffer).
        """
        q = _split_heads(q, layer.q_heads, layer.head_dim, "q")
        if meta.mode == ForwardMode.IDLE:
            return jnp.zeros((q.shape[0], layer.q_heads, layer.dv), q.dtype), k_buffer, v_buffer
        if save_kv and k is not None:
            k = _split_heads(k, layer.kv_heads, layer.head_dim, "k")
            v = _split_heads(v, layer.kv_heads, layer.dv, "v")
            k_buffer, v_buffer = write_kv(k_buffer, v_buffer, meta.out_cache_loc, k, v, k_scale=layer.k_scale, v_scale=layer.v_scale)
        k_pool = read_scaled(k_buffer, layer.k_scale, q.dtype)
        v_pool = read_scaled(v_buffer, layer.v_scale, q.dtype)
        if layer.is_cross_attention:
            if meta.cross_kv_indptr is None:
                raise ValueError(f"layer {layer.layer_id} is cross attention but the batch has no encoder_lens")
            o = ragged_paged_attention_reference(
                q, k_pool, v_pool, meta.qo_indptr, meta.cross_kv_indptr, meta.cross_kv_indices, causal=False,
                logit_cap=layer.logit_cap, sinks=sinks, sm_scale=layer.scale,
                max_q_len=meta.max_q_len, max_kv_len=meta.max_kv_len,
            )
            return o, k_buffer, v_buffer
        o = ragged_paged_attention_reference(
            q, k_pool, v_pool, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
            custom_mask=meta.custom_mask, mask_indptr=meta.mask_indptr, sliding_window=layer.sliding_window,
            logit_cap=layer.logit_cap, sinks=sinks, xai_temperature_len=layer.xai_temperature_len, sm_scale=layer.scale,
            max_q_len=meta.max_q_len, max_kv_len=meta.max_kv_len,
        )
        return o, k_buffer, v_buffer
