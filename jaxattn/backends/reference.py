"""ReferenceBackend: the pure-jnp backend, the CPU default and the oracle the kernel backends are tested against."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxattn.backends.layer import AttentionLayer, is_latent_pool, split_heads
from jaxattn.kv_indices import create_kv_indices_reference
from jaxattn.paging import PageTable, create_kv_indices_from_pages
from jaxattn.reference import ragged_paged_attention_reference
from jaxattn.serving.batch import ForwardBatch, ForwardMode
from jaxattn.serving.kv_pool import write_kv


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

    def init_forward_metadata(self, batch: ForwardBatch, req_to_token: "jax.Array | PageTable") -> ReferenceMetadata:
        """The step's lists from req_to_token (i32[max_reqs, max_context_len], the slot of every token) or from a
        `jaxattn.paging.PageTable` (pages, with static page_size and num_slots)."""
        encoder = batch.encoder_lens
        self_start = None if encoder is None else encoder
        if isinstance(req_to_token, PageTable):
            def lists(lens, starts):
                return create_kv_indices_from_pages(req_to_token.req_to_page, batch.req_pool_indices, lens, starts,
                                                    capacity=batch.kv_capacity, **req_to_token.builder_args())
        else:
            def lists(lens, starts):
                return create_kv_indices_reference(req_to_token, batch.req_pool_indices, lens, starts,
                                                   capacity=batch.kv_capacity)
        kv_indptr, kv_indices = lists(batch.seq_lens, self_start)
        cross_indptr = cross_indices = None
        if encoder is not None:
            cross_indptr, cross_indices = lists(encoder, None)
        verify = batch.mode == ForwardMode.TARGET_VERIFY
        max_q = 1 if batch.mode == ForwardMode.DECODE else batch.max_extend_len
        return ReferenceMetadata(
            qo_indptr=batch.qo_indptr,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            out_cache_loc=batch.out_cache_loc,
            mask_indptr=batch.mask_indptr if verify else None,
            custom_mask=batch.verify_custom_mask() if verify else None,
            cross_kv_indptr=cross_indptr,
            cross_kv_indices=cross_indices,
            mode=batch.mode,
            max_q_len=max_q,
            max_kv_len=batch.max_seq_len,
        )

    def forward(self, q, k, v, k_pool, v_pool, layer: AttentionLayer, meta: ReferenceMetadata, *, sinks=None, save_kv=True):
        """Writes k/v (unless save_kv=False or k is None) and attends.

        Args:
          q: [T, q_heads, head_dim] or [T, q_heads * head_dim]. k, v: [T, kv_heads, head_dim / v_head_dim] (or flat).
          k_pool, v_pool: this layer's pool; v_pool None (with v None): a latent (MLA) pool, V = the first
            layer.v_head_dim dims of each K row. sinks: optional f32[q_heads].

        Returns:
          (o [T, q_heads, v_head_dim], k_pool, v_pool).
        """
        layer.check_sinks(sinks)
        q = split_heads(q, layer.q_heads, layer.head_dim, "q")
        latent = is_latent_pool(v_pool, v)  # MLA's latent cache: V is the first layer.dv dims of each K row
        if meta.mode == ForwardMode.IDLE:
            return jnp.zeros((q.shape[0], layer.q_heads, layer.dv), q.dtype), k_pool, v_pool
        if save_kv and k is not None:
            k = split_heads(k, layer.kv_heads, layer.head_dim, "k")
            v = None if latent else split_heads(v, layer.kv_heads, layer.dv, "v")
            k_pool, v_pool = write_kv(k_pool, v_pool, meta.out_cache_loc, k, v, k_scale=layer.k_scale, v_scale=layer.v_scale)
        # fp8 pools are read with the layer's scales, row by row as they are gathered; 16-bit pools as they are.
        scales = layer.pool_scales(k_pool, v_pool)
        pools = (k_pool, v_pool)
        if latent:  # the reference reads V as an array of its own
            v_view, scales = layer.latent_v(k_pool, scales)
            pools = (k_pool, v_view)
        if layer.is_cross_attention:
            if meta.cross_kv_indptr is None:
                raise ValueError(f"layer {layer.layer_id} is cross attention but the batch has no encoder_lens")
            o = ragged_paged_attention_reference(
                q, *pools, meta.qo_indptr, meta.cross_kv_indptr, meta.cross_kv_indices, causal=False,
                logit_cap=layer.logit_cap, sinks=sinks, sm_scale=layer.scale,
                max_q_len=meta.max_q_len, max_kv_len=meta.max_kv_len, **scales,
            )
            return o, k_pool, v_pool
        o = ragged_paged_attention_reference(
            q, *pools, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
            custom_mask=meta.custom_mask, mask_indptr=meta.mask_indptr, sliding_window=layer.sliding_window,
            logit_cap=layer.logit_cap, sinks=sinks, xai_temperature_len=layer.xai_temperature_len, sm_scale=layer.scale,
            max_q_len=meta.max_q_len, max_kv_len=meta.max_kv_len, **scales,
        )
        return o, k_pool, v_pool
