"""Kernels that build CSR KV-index lists (page size 1: one index per token slot)."""

import triton
import triton.language as tl


@triton.jit
def _write_window(out_start, out_end, length, CAPACITY: tl.constexpr):
    """[lo, hi): the offsets (from out_start) of the entries a sequence may write: the first `length` of its range
    out_start..out_end, cut to [0, CAPACITY]. Empty when the range is empty or outside the list."""
    end = tl.minimum(tl.minimum(out_end, out_start + tl.maximum(length, 0)), CAPACITY)
    lo = tl.maximum(-out_start, 0)
    hi = tl.maximum(end - out_start, lo)
    return lo, hi


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
    length = tl.load(KV_LENS + seq).to(tl.int64)
    start = tl.load(KV_STARTS + seq).to(tl.int64)
    out_start = tl.load(KV_INDPTR + seq).to(tl.int64)
    out_end = tl.load(KV_INDPTR + seq + 1).to(tl.int64)
    # A bad row index reads nothing (its entries become slot 0, the padding slot) instead of memory outside the table.
    req_ok = (req >= 0) & (req < MAX_REQS)
    row = REQ_TO_TOKEN + tl.where(req_ok, req, 0) * MAX_CTX
    # Writes stay in this sequence's own output range cut to [0, CAPACITY] (an overflowed or hostile indptr can
    # neither write outside the list nor over a neighbour), and the loop only covers entries it may write.
    lo, hi = _write_window(out_start, out_end, length, CAPACITY)
    for block_start in range(lo, hi, BLOCK):
        offs = block_start + tl.arange(0, BLOCK)
        in_seq = offs < hi
        pos = start + offs
        read_ok = in_seq & req_ok & (pos >= 0) & (pos < MAX_CTX)
        slots = tl.load(row + pos, mask=read_ok, other=0)
        dst = out_start + offs
        tl.store(KV_INDICES + dst, slots.to(KV_INDICES.dtype.element_ty), mask=in_seq)


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
    first_len = tl.maximum(tl.load(FIRST_INDPTR + seq + 1).to(tl.int64) - first_start, 0)
    second_start = tl.load(SECOND_STARTS + seq).to(tl.int64)
    second_len = tl.load(SECOND_LENS + seq).to(tl.int64)
    out_start = tl.load(OUT_INDPTR + seq).to(tl.int64)
    out_end = tl.load(OUT_INDPTR + seq + 1).to(tl.int64)
    # Reads are bounded by each source's capacity; writes by this sequence's own output range cut to [0, CAPACITY]
    # (see _write_window), so the loops never run past the entries they may write.
    lo, hi = _write_window(out_start, out_end, first_len, CAPACITY)
    for block_start in range(lo, hi, BLOCK):
        offs = block_start + tl.arange(0, BLOCK)
        src = first_start + offs
        ok = (offs < hi) & (src >= 0) & (src < FIRST_CAPACITY)
        values = tl.load(FIRST_INDICES + src, mask=ok, other=0)
        dst = out_start + offs
        tl.store(OUT_INDICES + dst, values.to(OUT_INDICES.dtype.element_ty), mask=offs < hi)
    out_start += first_len
    lo, hi = _write_window(out_start, out_end, second_len, CAPACITY)
    for block_start in range(lo, hi, BLOCK):
        offs = block_start + tl.arange(0, BLOCK)
        src = second_start + offs
        ok = (offs < hi) & (src >= 0) & (src < SECOND_CAPACITY)
        values = tl.load(SECOND_INDICES + src, mask=ok, other=0)
        dst = out_start + offs
        tl.store(OUT_INDICES + dst, values.to(OUT_INDICES.dtype.element_ty), mask=offs < hi)
