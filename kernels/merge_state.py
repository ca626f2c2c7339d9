"""Merges two partial attention states (output, natural-log LSE) over disjoint key sets."""

import triton
import triton.language as tl


@triton.jit
def merge_state_kernel(
    O1,  # [tokens, heads, head_dim]
    LSE1,  # f32[tokens, heads]
    O2,  # [tokens, heads, head_dim]
    LSE2,  # f32[tokens, heads]
    O_OUT,  # out: [tokens, heads, head_dim]
    LSE_OUT,  # out: f32[tokens, heads]
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = token * HEADS + head
    lse1 = tl.load(LSE1 + row).to(tl.float32)
    lse2 = tl.load(LSE2 + row).to(tl.float32)
    # +inf is not a valid LSE; like SGLang, treat it as "no keys" (-inf).
    lse1 = tl.where(lse1 == float("inf"), float("-inf"), lse1)
    lse2 = tl.where(lse2 == float("inf"), float("-inf"), lse2)
    lse_max = tl.maximum(lse1, lse2)
    # Both empty: avoid (-inf) - (-inf) = NaN; the result is an empty state (zeros, -inf). Tested on each side, not on
    # the max: the GPU's max drops a NaN operand, which would make (-inf, NaN) look empty.
    both_empty = (lse1 == float("-inf")) & (lse2 == float("-inf"))
    safe_max = tl.where(both_empty, 0.0, lse_max)
    w1 = tl.exp(lse1 - safe_max)
    w2 = tl.exp(lse2 - safe_max)
    total = w1 + w2
    inv_total = tl.where(both_empty, 0.0, 1.0 / tl.where(both_empty, 1.0, total))
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    base = row * HEAD_DIM
    o1 = tl.load(O1 + base + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    o2 = tl.load(O2 + base + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    # An empty side (weight exactly 0) contributes nothing, even if its output rows hold garbage (NaN * 0 would be
    # NaN). A NaN state (NaN LSE, from NaN inputs) is not empty: its NaN weight passes and the merged row is NaN.
    o = tl.where(w1 == 0, 0.0, o1 * (w1 * inv_total)) + tl.where(w2 == 0, 0.0, o2 * (w2 * inv_total))
    tl.store(O_OUT + base + offs_d, o.to(O_OUT.dtype.element_ty), mask=mask_d)
    tl.store(LSE_OUT + row, tl.where(both_empty, float("-inf"), safe_max + tl.log(tl.where(both_empty, 1.0, total))))
