"""Host-side bookkeeping a serving loop needs around the jitted step: KV slots, req_to_token rows, batches.

This is the scheduler's side (numpy, outside jit). It hands the step a `ForwardBatch` padded to static
buckets, so the jitted step compiles once per bucket.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxattn.serving.batch import ForwardBatch, ForwardMode


class SlotAllocator:
    """Hands out KV-pool slots 1..num_slots-1 (slot 0 is the padding slot), in shuffled order like a used pool."""

    def __init__(self, num_slots: int, seed: int = 0):
        self.num_slots = num_slots
        self._free = list(np.random.default_rng(seed).permutation(np.arange(1, num_slots)))

    def alloc(self, n: int) -> np.ndarray:
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: asked for {n} slots, {len(self._free)} free")
        out, self._free = self._free[:n], self._free[n:]
        return np.asarray(out, np.int32)

    def free(self, slots) -> None:
        self._free.extend(int(s) for s in slots)

    @property
    def available(self) -> int:
        return len(self._free)


@dataclasses.dataclass
class Request:
    row: int  # req_to_token row
    tokens: list[int]  # every token so far (prompt + generated)
    cached: int = 0  # tokens whose KV is in the pool


class RequestTable:
    """req_to_token [max_reqs, max_context] on the host, plus the requests living in it."""

    def __init__(self, max_reqs: int, max_context: int, allocator: SlotAllocator):
        self.req_to_token = np.zeros((max_reqs, max_context), np.int32)
        self.allocator = allocator
        self.free_rows = list(range(max_reqs))
        self.requests: dict[int, Request] = {}

    def add(self, tokens, shared_prefix_from: Request | None = None, shared_len: int = 0) -> Request:
        """A new request; optionally reusing the first `shared_len` cached slots of another (prefix cache hit)."""
        row = self.free_rows.pop(0)
        request = Request(row, list(tokens))
        if shared_prefix_from is not None and shared_len:
            if shared_len > shared_prefix_from.cached:
                raise ValueError("can only share tokens that are already cached")
            self.req_to_token[row, :shared_len] = self.req_to_token[shared_prefix_from.row, :shared_len]
            request.cached = shared_len
        self.requests[row] = request
        return request

    def finish(self, request: Request, keep_prefix: int = 0) -> None:
        """Releases the request's row and its slots (all but the first `keep_prefix`, still shared)."""
        self.allocator.free(self.req_to_token[request.row, keep_prefix : request.cached])
        del self.requests[request.row]
        self.free_rows.append(request.row)

    def schedule(self, requests: list[Request], new_counts: list[int], *, mode: ForwardMode, batch_bucket: int,
                 token_bucket: int, max_extend_len: int, kv_capacity: int, max_seq_len: int):
        """Allocates slots for each request's next `new_counts` tokens and builds the padded step inputs.

        Returns (ForwardBatch, token_ids i32[token_bucket]); the requests' `cached` counts advance.
        """
        if len(requests) > batch_bucket:
            raise ValueError(f"{len(requests)} requests exceed the batch bucket {batch_bucket}")
        req_pool_indices = np.zeros(batch_bucket, np.int32)
        seq_lens = np.zeros(batch_bucket, np.int32)
        extend_lens = np.zeros(batch_bucket, np.int32)
        out_cache_loc = np.zeros(token_bucket, np.int32)
        positions = np.zeros(token_bucket, np.int32)
        token_ids = np.zeros(token_bucket, np.int32)
        cursor = 0
        for b, (request, n) in enumerate(zip(requests, new_counts)):
            if n > max_extend_len:
                raise ValueError(f"request {request.row}: {n} new tokens exceed max_extend_len {max_extend_len}")
            slots = self.allocator.alloc(n)
            start = request.cached
            self.req_to_token[request.row, start : start + n] = slots
            token_pos = b if mode == ForwardMode.DECODE else cursor
            if mode == ForwardMode.DECODE and n != 1:
                raise ValueError("DECODE steps take exactly one new token per request")
            out_cache_loc[token_pos : token_pos + n] = slots
            positions[token_pos : token_pos + n] = np.arange(start, start + n)
            token_ids[token_pos : token_pos + n] = request.tokens[start : start + n]
            cursor += n
            req_pool_indices[b] = request.row
            seq_lens[b] = start + n
            extend_lens[b] = n
            request.cached = start + n
        if cursor > token_bucket:
            raise ValueError(f"{cursor} new tokens exceed the token bucket {token_bucket}")
        batch = ForwardBatch(
            req_pool_indices=jnp.asarray(req_pool_indices),
            seq_lens=jnp.asarray(seq_lens),
            extend_lens=jnp.asarray(extend_lens),
            out_cache_loc=jnp.asarray(out_cache_loc),
            positions=jnp.asarray(positions),
            mode=mode,
            max_extend_len=max_extend_len,
            kv_capacity=kv_capacity,
            max_seq_len=max_seq_len,
        )
        return batch, jnp.asarray(token_ids)
