"""Attention backends: SGLang's backend layer as pure functions over pytrees, one module per backend.

    backend = ReferenceBackend()                       # or TritonBackend(), FlashInferBackend()
    meta = backend.init_forward_metadata(batch, req_to_token)      # inside jit, no host sync
    meta = backend.init_forward_metadata(batch, page_table)        # or a jaxattn.paging.PageTable (Reference, Triton)
    o, k_pool, v_pool = backend.forward(q, k, v, k_pool, v_pool, layer, meta, sinks=...)

`init_forward_metadata` runs once per step and its result is shared by every layer; `forward` writes the step's new
K/V at `batch.out_cache_loc` (in place when the caller donates the pools) and attends. The backends build their
metadata with `jaxattn.metadata`'s builders.

  * `jaxattn.backends.layer`: `AttentionLayer` (a layer's static facts), `split_heads`.
  * `jaxattn.backends.reference`: `ReferenceBackend` (pure jnp; the CPU default and the oracle).
  * `jaxattn.backends.triton`: `TritonBackend` (jaxattn's kernels), `draft_decode_metadata`.
  * `jaxattn.backends.flashinfer`: `FlashInferBackend` (FlashInfer through DLPack; torch imported on use).
"""

from jaxattn.backends.layer import AttentionLayer
from jaxattn.backends.reference import ReferenceBackend, ReferenceMetadata
from jaxattn.backends.triton import DraftDecodeMetadata, TritonBackend, TritonMetadata, draft_decode_metadata

__all__ = ["AttentionLayer", "ReferenceBackend", "ReferenceMetadata", "TritonBackend", "TritonMetadata",
           "DraftDecodeMetadata", "draft_decode_metadata"]
