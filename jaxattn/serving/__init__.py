"""The serving side around the attention ops: the step's `ForwardBatch`, the per-layer KV pool and its writes, and the
host-side bookkeeping (`SlotAllocator`, `RequestTable`) that hands the jitted step padded batches.

  * `jaxattn.serving.batch`: `ForwardMode`, `ForwardBatch` (a pytree with static buckets), `tree_mask_for_verify`.
  * `jaxattn.serving.kv_pool`: `allocate_kv_pool`, `write_kv`, `move_kv`, `read_scaled`, fp8 storage.
  * `jaxattn.serving.tables`: `SlotAllocator`, `Request`, `RequestTable` (numpy, outside jit; every call transactional,
    rejected calls raise `ServingError`). `SlotAllocator(num_slots, page_size=P)` hands out whole pages and
    `RequestTable.page_table()` gives the backends a `jaxattn.paging.PageTable` (whole-page prefix sharing);
    for speculative decoding, `RequestTable.reserve` holds the draft steps' slots, `rewind` gives back a request's
    tail and `accept_drafts` keeps a verified draft tree's accepted branch (the rejected drafts go back to the pool;
    with pages, `accept_drafts_by_copy` gives the K/V copies to make with `move_kv`).
"""

from jaxattn.serving.batch import ForwardBatch, ForwardMode, tree_mask_for_verify
from jaxattn.serving.kv_pool import allocate_kv_buffers, allocate_kv_pool, move_kv, read_scaled, write_kv
from jaxattn.serving.tables import KVPoolExhausted, Request, RequestTable, RequestTableFull, ServingError, SlotAllocator

__all__ = [
    "ForwardBatch", "ForwardMode", "tree_mask_for_verify", "allocate_kv_pool", "allocate_kv_buffers", "read_scaled",
    "write_kv", "move_kv", "Request", "RequestTable", "SlotAllocator", "ServingError", "KVPoolExhausted", "RequestTableFull",
]
