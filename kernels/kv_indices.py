"""Kernels that build CSR KV-index lists (page size 1: one index per token slot)."""

import triton
import triton.language as tl


@triton.jit
def create_kv_indices_kernel(
    REQ_TO_TOKEN,  # i32[max_reqs, max_ctx]: KV-pool slot of every token of every request row
    REQ_POOL_INDICES,  # i32[batch]: the req_to_token row of each sequence
    KV_LENS,  # i32[batch]: how many tokens of each sequence to list
    KV_STARTS,  # i32[batch]: first token position to list (0 unless a window or an encoder offset)
    KV_INDPTR,  # i32[batch + 1]: exclusive cumsum of KV_LENS
    KV_INDICES,  # out: [capacity]: the slots, sequence after sequence
    MAX_REQS: tl.constexpr,
    MAX_CTX: tl.constexpr,
    CAPACITY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    seq = tl.program_id(0)
    req = tl.load(REQ_POOL_INDICES + seq).to(tl.int64)
    length = tl.load(KV_LENS + seq)
    start = tl.load(KV_STARTS + seq)
    out_start = tl.load(KV_INDPTR + seq).to(tl.int64)
    # A bad row index reads nothing (its entries become slot 0, the padding slot) instead of memory outside the table.
    req_ok = (req >= 0) & (req < MAX_REQS)
    row = REQ_TO_TOKEN + tl.where(req_ok, req, 0) * MAX_CTX
    for block_start in range(0, length, BLOCK):
        offs = block_start + tl.arange(0, BLOCK)
        in_seq = offs < length
        pos = start + offs
        read_ok = in_seq & req_ok & (pos >= 0) & (pos < MAX_CTX)
        slots = tl.load(row + pos, mask=read_ok, other=0)
        dst = out_start + offs
        tl.store(KV_INDICES + dst, slots.to(KV_INDICES.dtype.element_ty), mask=in_seq & (dst < CAPACITY))


@triton.jit
def concat_kv_indices_kernel(
    FIRST_INDPTR,  # i32[batch + 1]: CSR of the first list (e.g. the cached prefix)
    FIRST_INDICES,  # [first_capacity]
    SECOND_STARTS,  # i32[batch]: where each sequence's part of the second list starts
    SECOND_LENS,  # i32[batch]
    SECOND_INDICES,  # [second_capacity] (e.g. out_cache_loc: the slots of the new tokens)
    OUT_INDPTR,  # i32[batch + 1]: CSR of the result
    OUT_INDICES,  # out: [capacity]: per sequence, its first-list part then its second-list part
    FIRST_CAPACITY: tl.constexpr,
    SECOND_CAPACITY: tl.constexpr,
    CAPACITY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    seq = tl.program_id(0)
    first_start = tl.load(FIRST_INDPTR + seq).to(tl.int64)
    first_len = tl.load(FIRST_INDPTR + seq + 1).to(tl.int64) - first_start
    second_start = tl.load(SECOND_STARTS + seq).to(tl.int64)
    second_len = tl.load(SECOND_LENS + seq).to(tl.int64)
    out_start = tl.load(OUT_INDPTR + seq).to(tl.int64)
    for block_start in range(0, first_len, BLOCK):
        offs = block_start + tl.arange(0, BLOCK)
        src = first_start + offs
        ok = (offs < first_len) & (src >= 0) & (src < FIRST_CAPACITY)
        values = tl.load(FIRST_INDICES + src, mask=ok, other=0)
        dst = out_start + offs
        tl.store(OUT_INDICES + dst, values.to(OUT_INDICES.dtype.element_ty), mask=(offs < first_len) & (dst < CAPACITY))
    out_start += first_len
    for block_start in range(0, second_len, BLOCK):
        offs = block_start + tl.arange(0, BLOCK)
        src = second_start + offs
        ok = (offs < second_len) & (src >= 0) & (src < SECOND_CAPACITY)
        values = tl.load(SECOND_INDICES + src, mask=ok, other=0)
        dst = out_start + offs
        tl.store(OUT_INDICES + dst, values.to(OUT_INDICES.dtype.element_ty), mask=(offs < second_len) & (dst < CAPACITY))
