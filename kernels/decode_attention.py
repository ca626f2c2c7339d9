"""Split-KV decode attention kernels (page size 1): stage 1 attends each split, stage 2 merges the splits.

Layout (jaxattn's, see jaxattn/reference.py): one query per sequence, the last token of its KV list.
Sequence b attends to the keys in slots ``KV_INDICES[KV_INDPTR[b]:KV_INDPTR[b+1]]`` (the current token
included). With a sliding window W >= 0 only the last W + 1 listed keys are visible, so both stages
work on the "effective" range: the last ``min(kv_len, W + 1)`` listed keys.

Split geometry (shared by both stages through `_split_geometry`): with ``L`` the effective length and
``n = clamp(NUM_KV_SPLITS[b], 1, MAX_KV_SPLITS)``, every split covers
``per_split = cdiv(cdiv(L, n), MIN_BLOCK_KV) * MIN_BLOCK_KV`` keys; split s is ``[s * per_split,
min((s + 1) * per_split, L))`` and is skipped by both stages when empty (its partial buffers are never
written nor read).

Final rows (FINAL_AT_ONE_SPLIT, every call without a sink): a sequence whose split count is 1 has its rows' output (in
O's dtype) and LSE stored by stage 1's split 0, and stage 2's programs for those rows load and store nothing (stage
2's O / LSE are stage 1's, aliased): the merge of one split is that split unchanged, so the bits are the merge's.
With a static bound of one split the merge is not launched. fp8 decode runs one split a sequence at D1 / D3 (whole
waves of resident programs), where the merge took 3.5 / 7.0 us beside stage 1's 203.5 / 207.9 on the H100 (089bb79).

Tail keys (the grouped kernel): the loads of a key tile are not masked by the split's length. A position past the
split's last key reads that last key's index, K and V again (inside the split's clamped range: no read past the list
or the pool), and its score is masked to -inf as before, so p = 0 there. In SASS for sm_90 (`python -m jaxattn.aot
--loop`, Triton 3.6) the masks cost a select per copied chunk: the fp8 table tile's loop took 35.0 warp-instructions
a key with them and 28.9 without (with V alone converted in registers 21.2 / 19.6). A repeated key adds 0 * V to the
output: 0 for finite V; NaN for a NaN or infinite V, where that key is one the row sees (one token: every key of the
split), so its row is non-finite anyway (an infinite V then gives NaN, where the reference may give inf). Several
query tokens: a draft the row does not see adds 0 * V at its own position too, as before.

Folded scale (the grouped kernel): a tile's scores stay unscaled through the mask and the row max, and the logit scale
s (softmax scale, k_scale, log2(e), xai temperature) enters the exponent, p = exp2(s * qk - m), one FFMA an element
where a multiply and a subtract were; the running max is s times the unscaled row max, which is exact for s > 0
(rounding is monotone). So s must be > 0: the launch checks sm_scale, and a traced k_scale of another sign gives its
sign to q instead (exact; 0 zeroes q, every score 0 as before; NaN stays in s). With fp8 pools and with several query
tokens (no rope part: MLA's registers are full) the row sums also stay a [BLOCK_H, BLOCK_N] accumulator, l = l *
alpha + p element by element, reduced once after the loop instead of across threads and warps every tile. SASS for
sm_90 (`python -m jaxattn.aot --loop`), warp-instructions per iteration, before / after: the fp8 table tile 925 / 886
(244 / 255 registers, 4 programs an SM either way), in registers 575 / 547, GQA's 4-token verify 507 / 466 (124 / 128
registers; shared memory keeps it at 3 an SM), the other 16-bit builds 0.3-3.0% fewer (at most a register more).

Indices are not trusted (issue 21): KV_INDPTR ranges are cut to [0, KV_CAPACITY] with a non-negative length, and a
slot outside [0, NUM_SLOTS) reads the padding slot 0. NaN is not trusted away either: "no keys" is tested as l == 0
(stage 1) and denom == 0 (stage 2), so NaN in q, a visited K/V or the scale gives a NaN row (NaN LSE for NaN scores),
while an empty split or row still gives 0 and LSE -inf.

fp8 pools (HAS_KV_SCALES): K/V rows load as fp8 and convert exactly to the dot dtype; KV_SCALES[0, kv_head] multiplies
the scores (folded into the scale the scores are multiplied by anyway) and KV_SCALES[1, kv_head] the split's output. For
16-bit pools HAS_KV_SCALES is False and the code is the same as without scales.
F16_DOTS (the grouped kernel, fp8 pool with bf16 q): the dots run in f16, not bf16. e4m3 / e5m2 rows convert to f16 in
one packed instruction per two elements, to bf16 in a second one per element (f16 -> bf16): about a tenth of the fp8
step at D1 (H200: 0.252 -> 0.224 ms; benchmarks/RESULTS.md). q is multiplied by SM_SCALE in f32 before its f16 rounding
(10 mantissa bits, finer than bf16's 8), so f16's range holds |q * SM_SCALE| up to 65504; beyond it the score is inf.
p (in [0, 1]) is rounded to f16 instead of bf16 for the p.v dot.
FP8_IN_REGISTERS (the grouped kernel, fp8 pools; `DecodeConfig.fp8_in_registers`): the p.v dot's V operand wants keys
along its reduction axis, across the rows memory holds, and sm_90 has no transposing 8-bit ldmatrix, so Triton reads an
fp8 V tile from shared memory a byte at a time (128 ld.shared.b8 per 64-key tile, 255 registers at 128/128). With
FP8_IN_REGISTERS the K and V tiles are converted to f16 in their loads' layout first (`_f16_of_fp8`: exact, unscaled;
k_scale and v_scale applied as without it), and the dots read the f16 copies with ldmatrix (.trans for V). Converting
K too spares q's dot operand the register moves an fp8 K operand's k-order forces on it (78 a 64-key tile) and lets
MLA's V (the K tile) reuse K's conversion. SASS for sm_90 (`python -m jaxattn.aot --loop`, Triton 3.6, unmasked key
loads), the table's 64-key tile at 2 warps: 18.0 warp-instructions a key (V alone 19.6, neither 28.9), 168 registers;
at 6 stages its f16 copies' shared memory keeps it at 4 programs an SM, at 4 stages 5 (17.7); MLA 576/512 60.2
against the table tile's 106.4. V alone, timed on the H100 (236f758): no faster than the table tile at the same split
counts (D1-FP8 0.244-0.247 ms against 0.227 at the default splits); K and V not yet timed. (A first form converted V
through f32 times v_scale, which Triton's layout passes did not move, and ran slower at every tile on the H200,
d3464cf: D1-FP8 0.198 ms against 0.177.)

fp8 scores (q K^T on fp8 tensor cores from the stored K rows, q split into three e4m3 parts, with the keys as rows
for fp8 wgmma) were tried and removed: on the H200 (2026-12-05) 1.4-1.6x slower than the f16 dots' table tile, whose
SASS issues more instructions per key, and outside bf16's tolerance on large scores with outlier q channels.

KEYS_AS_ROWS (the grouped kernel; `DecodeConfig.keys_as_rows`): both dots transposed, keys as their M dimension
(S^T = K q^T, O^T += V^T p^T; the output transposed back at the end), so BLOCK_H rows are the dots' N: 16 head rows
take wgmma without padding to 64, and an fp8 V tile is converted in registers before it becomes the dot's operand
(no byte-wise shared-memory reads). Timed on the H200 (ba2dcea) it was slower on every MLA and fp8 case but the
4-token MLA verify (with fewer splits than the heuristic gives): off in the tables.

Several query tokens per sequence (Q_TOKENS > 1, the grouped kernel; speculative verify, multi-token prediction): the
last Q_TOKENS listed keys of a sequence are its query tokens' own keys (the "drafts"). A program's BLOCK_H rows are
(token, q head) pairs of one kv head, token-major (row r: token r // GROUP, head r % GROUP), so each K/V tile is read
once for all tokens: MLA's 16 heads x 4 tokens fill one 64-row tile. Token t sees every key before the drafts and,
causally, drafts 0..t; with HAS_DRAFT_MASK, the drafts whose bits are set in DRAFT_MASK[b, t] (bit j: draft j; a tree
given as per-row bit masks, so no [q_len, kv_len] mask moves through memory). Q is [batch * Q_TOKENS, q_heads,
qk_head_dim]; the partial buffers and outputs have a row per (sequence, token). Windows and xai temperature take one
token (their positions are the last key's). A split can hold no key a row sees (a split of later drafts only): that
row stores out 0 and LSE -inf, which stage 2 merges as an empty split.
"""

import os

import triton
import triton.language as tl

from jaxattn.kernels.kv_scales import load_kv_scales

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# Whether this copy of the module runs under Triton's interpreter (jaxattn.launch imports a second copy with
# TRITON_INTERPRET=1): the interpreter runs no inline PTX.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _f16_of_fp8(x):
    """An fp8 tile (e4m3fn or e5m2) as f16, exactly, by one packed cvt per two values, four values (one 32-bit register
    as loaded, so no byte shuffles) per asm block. Inline PTX, so Triton's layout passes cannot move the consumer's (a
    dot operand's) layout back onto the fp8 load, as they do through `.to`: the conversion runs in the load's layout
    (16-byte reads) and the f16 tile reaches the dot through a 16-bit layout change (ldmatrix.trans), not by byte
    reads from shared memory."""
    if INTERPRETED:
        return x.to(tl.float16)
    elif x.dtype == tl.float8e5:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e5m2x2 $0, lo; cvt.rn.f16x2.e5m2x2 $1, hi; }",
            "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _dot_operand(stored, like, FP8_IN_REGISTERS: tl.constexpr):
    """A loaded K or V tile in `like`'s dtype (q's) for a dot: with FP8_IN_REGISTERS through `_f16_of_fp8` in the
    load's layout (module docstring), else by `.to`."""
    if FP8_IN_REGISTERS:
        return _f16_of_fp8(stored).to(like.dtype)
    else:
        return stored.to(like.dtype)


# Reductions through tl.reduce with these combine functions (tl.max / tl.sum would do the same on the GPU);
# jaxattn.launch recognises them by name and runs them as one numpy reduction under the interpreter.
@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sum_combine(a, b):
    return a + b


@triton.jit
def _effective_range(KV_INDPTR, seq, SLIDING_WINDOW: tl.constexpr, KV_CAPACITY: tl.constexpr):
    """(first listed index, effective length) of sequence `seq`'s visible keys.

    Hostile offsets are cut into the index list: the range is clamped to [0, KV_CAPACITY] and to a non-negative
    length, so no program reads past KV_INDICES (both stages clamp alike, so they agree on the splits).
    """
    kv_begin = tl.minimum(tl.maximum(tl.load(KV_INDPTR + seq).to(tl.int64), 0), KV_CAPACITY)
    kv_end = tl.minimum(tl.maximum(tl.load(KV_INDPTR + seq + 1).to(tl.int64), kv_begin), KV_CAPACITY)
    kv_len = kv_end - kv_begin
    if SLIDING_WINDOW >= 0:
        # The query is the last listed key: key j is visible iff (kv_len - 1 - j) <= W.
        skipped = tl.maximum(kv_len - (SLIDING_WINDOW + 1), 0)
        kv_begin = kv_begin + skipped
        kv_len = kv_len - skipped
    return kv_begin, kv_len


@triton.jit
def _split_geometry(NUM_KV_SPLITS, seq, kv_len, MAX_KV_SPLITS: tl.constexpr, MIN_BLOCK_KV: tl.constexpr):
    """Keys per split for a sequence of effective length kv_len (see the module docstring)."""
    num_splits = tl.load(NUM_KV_SPLITS + seq)
    num_splits = tl.minimum(tl.maximum(num_splits, 1), MAX_KV_SPLITS).to(tl.int64)
    # (no tl.cdiv: standard-library @jit helpers are not converted for the interpreter by jaxattn.launch)
    per_split = ((kv_len + num_splits - 1) // num_splits + MIN_BLOCK_KV - 1) // MIN_BLOCK_KV * MIN_BLOCK_KV
    return num_splits, per_split


@triton.jit
def _split_range(KV_INDPTR, NUM_KV_SPLITS, seq, split, SLIDING_WINDOW: tl.constexpr, MAX_KV_SPLITS: tl.constexpr,
                 MIN_BLOCK_KV: tl.constexpr, KV_CAPACITY: tl.constexpr):
    """(first kv_indices entry, number of keys, non-empty, the split's first key as an index into the effective
    range, the effective length, the sequence's split count) of split `split` of sequence `seq` (stage 1)."""
    kv_begin, kv_len = _effective_range(KV_INDPTR, seq, SLIDING_WINDOW, KV_CAPACITY)
    num_splits, per_split = _split_geometry(NUM_KV_SPLITS, seq, kv_len, MAX_KV_SPLITS, MIN_BLOCK_KV)
    split_start = split * per_split
    split_end = tl.minimum(split_start + per_split, kv_len)
    split_len = tl.maximum(split_end - split_start, 0).to(tl.int32)
    return kv_begin + split_start, split_len, split_end > split_start, split_start, kv_len, num_splits


@triton.jit
def _checked_slots(slots, NUM_SLOTS: tl.constexpr):
    """A slot outside the pool (negative, 2**30, just past the end) reads the padding slot 0 instead (one select per
    key, not per element)."""
    return tl.where((slots >= 0) & (slots < NUM_SLOTS), slots, 0)


@triton.jit
def _stores_partial(non_empty, num_splits, FINAL_AT_ONE_SPLIT: tl.constexpr):
    """Whether a stage-1 program stores its split's partial. With FINAL_AT_ONE_SPLIT a sequence of one split has its
    rows' output and LSE stored by split 0 itself instead (`_stores_final`), empty or not (0 and -inf, as the merge
    gives them): the merge of one split is the split unchanged (weight exp(lse - lse) = 1), so the result is the same,
    and the merge's programs skip those rows (`decode_stage2_kernel`)."""
    if FINAL_AT_ONE_SPLIT:
        return non_empty & (num_splits > 1)
    return non_empty


@triton.jit
def _stores_final(num_splits, split):
    """Whether a stage-1 program stores its rows' final output (FINAL_AT_ONE_SPLIT): split 0 of a one-split sequence."""
    return (num_splits == 1) & (split == 0)


@triton.jit
def _logit_scale(SEQ_LENS, seq, sm_scale, LOGIT_CAP: tl.constexpr, XAI_TEMPERATURE_LEN: tl.constexpr,
                 XAI_INV_LOG2_LEN: tl.constexpr):
    """The factor that turns a (soft-capped) q.k into a base-2 logit: xai temperature, log2(e) and, without a cap, the
    softmax scale (k_scale included) folded into one multiply."""
    if XAI_TEMPERATURE_LEN > 0:
        q_pos = (tl.load(SEQ_LENS + seq) - 1).to(tl.float32)
        xai = tl.where(q_pos > XAI_TEMPERATURE_LEN, tl.log2(tl.maximum(q_pos, 1.0)) * XAI_INV_LOG2_LEN, 1.0)
    else:
        xai = 1.0
    if LOGIT_CAP > 0:
        return xai * LOG2E
    return xai * (sm_scale * LOG2E)


@triton.jit
def _positive_logit_scale(logit_scale):
    """(q's factor, a logit scale > 0) for the grouped kernel's folded softmax (module docstring, "Folded scale"): a
    negative scale's sign moves onto q (exact), a zero one zeroes q (every score 0, as the zero scale gives them) and
    becomes 1; a NaN scale stays NaN (NaN rows)."""
    q_factor = tl.where(logit_scale < 0, -1.0, tl.where(logit_scale == 0, 0.0, 1.0))
    return q_factor, tl.where(logit_scale == 0, 1.0, tl.abs(logit_scale))


@triton.jit
def _soft_cap(qk, sm_scale, LOGIT_CAP: tl.constexpr):
    # cap * tanh(s / cap), with tanh(x) = 2 * sigmoid(2x) - 1 (saturates cleanly at +-1).
    qk = qk * sm_scale
    return LOGIT_CAP * (2.0 / (1.0 + tl.exp(-2.0 * (qk / LOGIT_CAP))) - 1.0)


@triton.jit
def decode_stage1_kernel(
    Q,  # [batch, q_heads, qk_head_dim]
    K_POOL,  # [slots, kv_heads, qk_head_dim]
    V_POOL,  # [slots, kv_heads, v_head_dim], or K_POOL itself when V is the first v_head_dim dims of K
    KV_INDPTR,  # i32[batch + 1]
    KV_INDICES,  # i32/i64[kv_capacity]
    NUM_KV_SPLITS,  # i32[batch]
    SEQ_LENS,  # i32[batch]: full sequence length; the query sits at position SEQ_LENS[b] - 1
    KV_SCALES,  # f32[2, kv_heads]: K and V scales of the pool (read only if HAS_KV_SCALES)
    DRAFT_MASK,  # i32[batch, Q_TOKENS]: bit j of [b, t]: token t sees draft j (read only if HAS_DRAFT_MASK)
    MID_O,  # out: f32[batch * Q_TOKENS, q_heads, MAX_KV_SPLITS, v_head_dim], per-split normalised output
    MID_LSE,  # out: f32[batch * Q_TOKENS, q_heads, MAX_KV_SPLITS], per-split natural-log LSE
    O,  # out: [batch * Q_TOKENS, q_heads, v_head_dim]: the rows of one-split sequences (if FINAL_AT_ONE_SPLIT)
    LSE,  # out: f32[batch * Q_TOKENS, q_heads]: the same rows' natural-log LSE (if FINAL_AT_ONE_SPLIT)
    SM_SCALE: tl.constexpr,
    LOGIT_CAP: tl.constexpr,  # > 0: soft cap cap * tanh(s / cap)
    XAI_TEMPERATURE_LEN: tl.constexpr,  # > 0: Grok's position-dependent temperature
    XAI_INV_LOG2_LEN: tl.constexpr,  # 1 / log2(XAI_TEMPERATURE_LEN)
    SLIDING_WINDOW: tl.constexpr,  # >= 0: only the last W + 1 keys are visible
    Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # q heads per kv head
    STRIDE_K_SLOT: tl.constexpr,
    STRIDE_K_HEAD: tl.constexpr,
    STRIDE_V_SLOT: tl.constexpr,
    STRIDE_V_HEAD: tl.constexpr,
    QK_HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # the first BLOCK_D dims of q/k (power of 2)
    BLOCK_DPE: tl.constexpr,  # the remaining dims (MLA rope part), 0 if none (power of 2)
    BLOCK_DV: tl.constexpr,
    V_FROM_K: tl.constexpr,  # V is the K tile's first BLOCK_D dims: reuse the loaded K tile
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_KV_SPLITS: tl.constexpr,
    MIN_BLOCK_KV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_SLOTS: tl.constexpr,  # pool rows: slots outside [0, NUM_SLOTS) read slot 0
    KV_CAPACITY: tl.constexpr,  # length of KV_INDICES: KV_INDPTR is clamped into it
    HAS_KV_SCALES: tl.constexpr,  # fp8 pool: apply KV_SCALES
    F16_DOTS: tl.constexpr,  # fp8 pool with bf16 q: q (pre-scaled), K, V and p as f16 in the dots (module docstring)
    FP8_IN_REGISTERS: tl.constexpr,  # fp8 pool: K and V tiles converted to f16 in registers before the dots (docstring)
    Q_TOKENS: tl.constexpr,  # query tokens per sequence (module docstring)
    HAS_DRAFT_MASK: tl.constexpr,  # Q_TOKENS > 1: DRAFT_MASK gives each token's drafts; else causal
    KEYS_AS_ROWS: tl.constexpr,  # the dots with keys as their M dimension (module docstring)
    FINAL_AT_ONE_SPLIT: tl.constexpr,  # a one-split sequence's rows go to O / LSE, not the partials (docstring)
):
    tl.static_assert(BLOCK_H >= 16, "tl.dot needs at least 16 rows")
    if Q_TOKENS > 1:
        tl.static_assert(SLIDING_WINDOW < 0, "several query tokens take no sliding window")
        tl.static_assert(XAI_TEMPERATURE_LEN <= 0, "several query tokens take no xai temperature")
    if HAS_DRAFT_MASK:
        tl.static_assert(Q_TOKENS <= 32, "a draft mask holds 32 drafts")
    tl.static_assert(BLOCK_N >= 16, "tl.dot needs at least 16 columns")
    tl.static_assert(BLOCK_D + BLOCK_DPE >= QK_HEAD_DIM)
    tl.static_assert(BLOCK_DV >= V_HEAD_DIM)
    tl.static_assert((not V_FROM_K) or (BLOCK_DV == BLOCK_D and V_HEAD_DIM == BLOCK_D))
    ROWS: tl.constexpr = Q_TOKENS * GROUP  # (token, q head) rows per kv head
    # fp8 pools and several query tokens, without a rope part (BLOCK_DPE: MLA's registers are full): the softmax's row
    # sums as a [BLOCK_H, BLOCK_N] accumulator, reduced once after the loop (module docstring, "Folded scale").
    DEFER_ROW_SUM: tl.constexpr = (HAS_KV_SCALES or Q_TOKENS > 1) and BLOCK_DPE == 0
    HEAD_BLOCKS_PER_KV: tl.constexpr = (ROWS + BLOCK_H - 1) // BLOCK_H
    KV_HEADS: tl.constexpr = Q_HEADS // GROUP

    seq = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2).to(tl.int64)

    # An empty split runs no loop iteration and stores nothing (stage 2 skips it). No early `if`: the body stays
    # a plain loop, which Triton's software pipeliner handles.
    kv_first, split_len, non_empty, split_start, kv_len, num_splits = _split_range(
        KV_INDPTR, NUM_KV_SPLITS, seq, split, SLIDING_WINDOW, MAX_KV_SPLITS, MIN_BLOCK_KV, KV_CAPACITY
    )
    kv_head = head_block // HEAD_BLOCKS_PER_KV
    row_offs = (head_block % HEAD_BLOCKS_PER_KV) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = row_offs < ROWS
    if Q_TOKENS == 1:
        group_offs = row_offs
        token_rows = seq  # the (sequence, token) row of q and of the outputs
    else:
        group_offs = row_offs % GROUP
        tokens = row_offs // GROUP  # [BLOCK_H]
        token_rows = seq * Q_TOKENS + tokens
        # Key i of the effective range is draft i - (kv_len - Q_TOKENS) (negative: a key before the drafts).
        first_draft = split_start - (kv_len - Q_TOKENS)
        if HAS_DRAFT_MASK:
            draft_bits = tl.load(DRAFT_MASK + token_rows, mask=mask_h, other=0).to(tl.int64) & 0xFFFFFFFF
    heads = kv_head * GROUP + group_offs  # [BLOCK_H]

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < QK_HEAD_DIM
    q_rows = Q + (token_rows * Q_HEADS + heads)[:, None] * QK_HEAD_DIM
    q = tl.load(q_rows + offs_d[None, :], mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    if BLOCK_DPE > 0:
        offs_dpe = BLOCK_D + tl.arange(0, BLOCK_DPE)
        mask_dpe = offs_dpe < QK_HEAD_DIM
        q_pe = tl.load(q_rows + offs_dpe[None, :], mask=mask_h[:, None] & mask_dpe[None, :], other=0.0)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < V_HEAD_DIM

    k_scale, v_scale = load_kv_scales(KV_SCALES, kv_head, KV_HEADS, HAS_KV_SCALES)
    if F16_DOTS:
        q = (q.to(tl.float32) * SM_SCALE).to(tl.float16)
        if BLOCK_DPE > 0:
            q_pe = (q_pe.to(tl.float32) * SM_SCALE).to(tl.float16)
        sm_scale = k_scale  # what the dots leave to scale
    else:
        sm_scale = SM_SCALE * k_scale
    post_scale = _logit_scale(SEQ_LENS, seq, sm_scale, LOGIT_CAP, XAI_TEMPERATURE_LEN, XAI_INV_LOG2_LEN)
    if HAS_KV_SCALES and LOGIT_CAP <= 0:  # k_scale is in post_scale: any sign (16-bit pools, a cap: > 0 already)
        q_factor, post_scale = _positive_logit_scale(post_scale)
        q = (q * q_factor).to(q.dtype)
        if BLOCK_DPE > 0:
            q_pe = (q_pe * q_factor).to(q_pe.dtype)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, log2 domain
    if DEFER_ROW_SUM:
        l_acc = tl.full([BLOCK_H, BLOCK_N], 0.0, tl.float32)  # the row sums' terms by column; summed after the loop
    else:
        l_i = tl.full([BLOCK_H], 0.0, tl.float32)
    if KEYS_AS_ROWS:
        acc = tl.full([BLOCK_DV, BLOCK_H], 0.0, tl.float32)  # the output transposed
    else:
        acc = tl.full([BLOCK_H, BLOCK_DV], 0.0, tl.float32)
    k_head = K_POOL + kv_head.to(tl.int64) * STRIDE_K_HEAD
    v_head = V_POOL + kv_head.to(tl.int64) * STRIDE_V_HEAD
    kv_base = KV_INDICES + kv_first
    for start in range(0, split_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < split_len
        # Unmasked loads (module docstring, "Tail keys"): a key past the split reads the split's last key again.
        # int64 slots: slot * stride can pass 2**31 on big pools.
        slots = _checked_slots(tl.load(kv_base + tl.minimum(offs_n, split_len - 1)).to(tl.int64), NUM_SLOTS)
        k_rows = k_head + slots[:, None] * STRIDE_K_SLOT
        k_stored = tl.load(k_rows + offs_d[None, :], mask=mask_d[None, :], other=0.0)
        k = _dot_operand(k_stored, q, FP8_IN_REGISTERS)
        if KEYS_AS_ROWS:
            qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_H] f32
            if BLOCK_DPE > 0:
                k_pe = tl.load(k_rows + offs_dpe[None, :], mask=mask_dpe[None, :], other=0.0)
                qk_t += tl.dot(k_pe.to(q_pe.dtype), tl.trans(q_pe), input_precision=DOT_PRECISION)
            qk = tl.trans(qk_t)
        else:
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N] f32
            if BLOCK_DPE > 0:
                k_pe = tl.load(k_rows + offs_dpe[None, :], mask=mask_dpe[None, :], other=0.0)
                qk += tl.dot(q_pe, tl.trans(k_pe.to(q_pe.dtype)), input_precision=DOT_PRECISION)
        if LOGIT_CAP > 0:
            qk = _soft_cap(qk, sm_scale, LOGIT_CAP)
        if Q_TOKENS == 1:
            visible = mask_n[None, :]
        else:
            draft = first_draft + offs_n  # [BLOCK_N]
            if HAS_DRAFT_MASK:
                bit = (draft_bits[:, None] >> tl.minimum(tl.maximum(draft, 0), 31)[None, :]) & 1
                sees = (draft < 0)[None, :] | (bit != 0)
            else:
                sees = draft[None, :] <= tokens[:, None]
            visible = mask_n[None, :] & sees
        qk = tl.where(visible, qk, float("-inf"))  # unscaled scores (post_scale > 0: "Folded scale")

        m_new = tl.maximum(m_i, tl.reduce(qk, 1, _max_combine) * post_scale)
        # Guard: a row whose keys are all masked keeps max -inf; use 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk * post_scale - m_safe[:, None])  # one FFMA an element
        if DEFER_ROW_SUM:
            l_acc = l_acc * alpha[:, None] + p
        else:
            l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
        if V_FROM_K:
            v = k  # the K tile's first BLOCK_D dims, converted once
        else:
            v_rows = v_head + slots[:, None] * STRIDE_V_SLOT
            v_stored = tl.load(v_rows + offs_dv[None, :], mask=mask_dv[None, :], other=0.0)
            v = _dot_operand(v_stored, q, FP8_IN_REGISTERS)
        if KEYS_AS_ROWS:
            acc = acc * alpha[None, :] + tl.dot(tl.trans(v), tl.trans(p.to(q.dtype)), input_precision=DOT_PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if DEFER_ROW_SUM:
        l_i = tl.reduce(l_acc, 1, _sum_combine)
    # "No keys" is l == 0 exactly; a NaN l (NaN in q, a visited K/V or the scale) is not hidden: it stays NaN.
    has_keys = l_i != 0
    safe_l = tl.where(has_keys, l_i, 1.0)
    if KEYS_AS_ROWS:
        out = tl.trans(acc) / safe_l[:, None]
    else:
        out = acc / safe_l[:, None]
    if HAS_KV_SCALES:
        out = out * v_scale
    lse = tl.where(has_keys, (m_i + tl.log2(safe_l)) * LN2, float("-inf"))
    partial = _stores_partial(non_empty, num_splits, FINAL_AT_ONE_SPLIT)
    out_row = token_rows * Q_HEADS + heads  # [BLOCK_H]
    row = out_row * MAX_KV_SPLITS + split
    tl.store(MID_O + row[:, None] * V_HEAD_DIM + offs_dv[None, :], out, mask=(mask_h & partial)[:, None] & mask_dv[None, :])
    tl.store(MID_LSE + row, lse, mask=mask_h & partial)
    if FINAL_AT_ONE_SPLIT:
        final = _stores_final(num_splits, split)
        out = tl.where(has_keys[:, None], out, 0.0)  # the merge's empty row, whatever v_scale is
        tl.store(O + out_row[:, None] * V_HEAD_DIM + offs_dv[None, :], out.to(O.dtype.element_ty),
                 mask=(mask_h & final)[:, None] & mask_dv[None, :])
        tl.store(LSE + out_row, lse, mask=mask_h & final)


@triton.jit
def decode_stage1_vector_kernel(
    Q,  # [batch, q_heads, qk_head_dim]
    K_POOL,  # [slots, kv_heads, qk_head_dim]
    V_POOL,  # [slots, kv_heads, v_head_dim], or K_POOL itself when V is the first v_head_dim dims of K
    KV_INDPTR,  # i32[batch + 1]
    KV_INDICES,  # i32/i64[kv_capacity]
    NUM_KV_SPLITS,  # i32[batch]
    SEQ_LENS,  # i32[batch]
    KV_SCALES,  # f32[2, kv_heads] (read only if HAS_KV_SCALES)
    DRAFT_MASK,  # unused: one query token per sequence (the grouped kernel's argument list)
    MID_O,  # out: f32[batch, q_heads, MAX_KV_SPLITS, v_head_dim]
    MID_LSE,  # out: f32[batch, q_heads, MAX_KV_SPLITS]
    O,  # out: [batch, q_heads, v_head_dim] (if FINAL_AT_ONE_SPLIT, as the grouped kernel's)
    LSE,  # out: f32[batch, q_heads] (if FINAL_AT_ONE_SPLIT)
    SM_SCALE: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
    XAI_TEMPERATURE_LEN: tl.constexpr,
    XAI_INV_LOG2_LEN: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    STRIDE_K_SLOT: tl.constexpr,
    STRIDE_K_HEAD: tl.constexpr,
    STRIDE_V_SLOT: tl.constexpr,
    STRIDE_V_HEAD: tl.constexpr,
    QK_HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_KV_SPLITS: tl.constexpr,
    MIN_BLOCK_KV: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    KV_CAPACITY: tl.constexpr,
    HAS_KV_SCALES: tl.constexpr,
    FINAL_AT_ONE_SPLIT: tl.constexpr,
):
    """Stage 1 for one q head per program (MHA, GROUP == 1): q.k and p.v as multiply-and-sum, no tl.dot.

    A dot needs 16 rows, so the grouped kernel would pad one head to 16; here each program streams its head's
    keys with vector math (SGLang's MHA decode kernel). Same split geometry and outputs as `decode_stage1_kernel`.
    """
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2).to(tl.int64)
    kv_first, split_len, non_empty, _, _, num_splits = _split_range(
        KV_INDPTR, NUM_KV_SPLITS, seq, split, SLIDING_WINDOW, MAX_KV_SPLITS, MIN_BLOCK_KV, KV_CAPACITY
    )
    kv_head = head // GROUP

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < QK_HEAD_DIM
    q_row = Q + (seq * Q_HEADS + head) * QK_HEAD_DIM
    q = tl.load(q_row + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if BLOCK_DPE > 0:
        offs_dpe = BLOCK_D + tl.arange(0, BLOCK_DPE)
        mask_dpe = offs_dpe < QK_HEAD_DIM
        q_pe = tl.load(q_row + offs_dpe, mask=mask_dpe, other=0.0).to(tl.float32)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < V_HEAD_DIM

    k_scale, v_scale = load_kv_scales(KV_SCALES, kv_head, Q_HEADS // GROUP, HAS_KV_SCALES)
    sm_scale = SM_SCALE * k_scale
    post_scale = _logit_scale(SEQ_LENS, seq, sm_scale, LOGIT_CAP, XAI_TEMPERATURE_LEN, XAI_INV_LOG2_LEN)

    m_i = float("-inf")  # running max, log2 domain
    l_i = 0.0
    acc = tl.full([BLOCK_DV], 0.0, tl.float32)
    k_head = K_POOL + kv_head.to(tl.int64) * STRIDE_K_HEAD
    v_head = V_POOL + kv_head.to(tl.int64) * STRIDE_V_HEAD
    kv_base = KV_INDICES + kv_first
    for start in range(0, split_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < split_len
        # int64: slot * stride can pass 2**31
        slots = _checked_slots(tl.load(kv_base + offs_n, mask=mask_n, other=0).to(tl.int64), NUM_SLOTS)
        k_rows = k_head + slots[:, None] * STRIDE_K_SLOT
        k = tl.load(k_rows + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        qk = tl.reduce(q[None, :] * k.to(tl.float32), 1, _sum_combine)  # [BLOCK_N]
        if BLOCK_DPE > 0:
            k_pe = tl.load(k_rows + offs_dpe[None, :], mask=mask_n[:, None] & mask_dpe[None, :], other=0.0)
            qk += tl.reduce(q_pe[None, :] * k_pe.to(tl.float32), 1, _sum_combine)
        if LOGIT_CAP > 0:
            qk = _soft_cap(qk, sm_scale, LOGIT_CAP)
        qk = qk * post_scale
        qk = tl.where(mask_n, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(qk, 0, _max_combine))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: exp2 gives 0, not NaN
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 0, _sum_combine)
        v = tl.load(v_head + slots[:, None] * STRIDE_V_SLOT + offs_dv[None, :], mask=mask_n[:, None] & mask_dv[None, :], other=0.0)
        acc = acc * alpha + tl.reduce(p[:, None] * v.to(tl.float32), 0, _sum_combine)
        m_i = m_new

    # "No keys" is l == 0 exactly; a NaN l (NaN in q, a visited K/V or the scale) is not hidden: it stays NaN.
    has_keys = l_i != 0
    safe_l = tl.where(has_keys, l_i, 1.0)
    out = acc / safe_l
    if HAS_KV_SCALES:
        out = out * v_scale
    lse = tl.where(has_keys, (m_i + tl.log2(safe_l)) * LN2, float("-inf"))
    partial = _stores_partial(non_empty, num_splits, FINAL_AT_ONE_SPLIT)
    out_row = seq * Q_HEADS + head
    row = out_row * MAX_KV_SPLITS + split
    tl.store(MID_O + row * V_HEAD_DIM + offs_dv, out, mask=mask_dv & partial)
    tl.store(MID_LSE + row, lse, mask=partial)
    if FINAL_AT_ONE_SPLIT:
        final = _stores_final(num_splits, split)
        out = tl.where(has_keys, out, 0.0)  # the merge's empty row, whatever v_scale is
        tl.store(O + out_row * V_HEAD_DIM + offs_dv, out.to(O.dtype.element_ty), mask=mask_dv & final)
        tl.store(LSE + out_row, lse, mask=final)


@triton.jit
def decode_stage2_kernel(
    MID_O,  # f32[batch * Q_TOKENS, q_heads, MAX_KV_SPLITS, v_head_dim]
    MID_LSE,  # f32[batch * Q_TOKENS, q_heads, MAX_KV_SPLITS]
    KV_INDPTR,  # i32[batch + 1]
    NUM_KV_SPLITS,  # i32[batch]
    SINKS,  # f32[q_heads] (ignored unless HAS_SINK)
    O_STAGE1,  # unread: the O stage 1 wrote (if FINAL_AT_ONE_SPLIT), aliased to O by the launch
    LSE_STAGE1,  # unread: the LSE stage 1 wrote, aliased to LSE
    O,  # out: [batch * Q_TOKENS, q_heads, v_head_dim]
    LSE,  # out: f32[batch * Q_TOKENS, q_heads]
    SLIDING_WINDOW: tl.constexpr,
    Q_HEADS: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_SINK: tl.constexpr,
    MAX_KV_SPLITS: tl.constexpr,
    MIN_BLOCK_KV: tl.constexpr,
    KV_CAPACITY: tl.constexpr,  # stage 1's: the same clamped ranges, so the same non-empty splits
    Q_TOKENS: tl.constexpr,  # query tokens per sequence: program 0's index is a (sequence, token) row
    FINAL_AT_ONE_SPLIT: tl.constexpr,  # stage 1 stored the rows of one-split sequences: leave them
):
    token_row = tl.program_id(0).to(tl.int64)
    seq = token_row // Q_TOKENS
    head = tl.program_id(1)
    _, kv_len = _effective_range(KV_INDPTR, seq, SLIDING_WINDOW, KV_CAPACITY)
    num_splits, per_split = _split_geometry(NUM_KV_SPLITS, seq, kv_len, MAX_KV_SPLITS, MIN_BLOCK_KV)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < V_HEAD_DIM
    row = token_row * Q_HEADS + head

    if FINAL_AT_ONE_SPLIT:
        tl.static_assert(not HAS_SINK, "stage 1 stores no row with a sink")
        # A one-split row was stored by stage 1 (O_STAGE1 is O): no loads, no stores (its program still starts).
        merges = num_splits > 1
        num_splits = tl.where(merges, num_splits, 0)
    else:
        merges = num_splits > 0  # every row
    m = float("-inf")
    denom = 0.0
    acc = tl.full([BLOCK_DV], 0.0, tl.float32)
    # Sequential over splits: a fixed reduction order, so the result depends only on the split geometry.
    for split in range(0, num_splits):
        split_start = split * per_split
        split_end = tl.minimum(split_start + per_split, kv_len)
        if split_end > split_start:
            lse_s = tl.load(MID_LSE + row * MAX_KV_SPLITS + split)
            o_s = tl.load(MID_O + (row * MAX_KV_SPLITS + split) * V_HEAD_DIM + offs_dv, mask=mask_dv, other=0.0)
            m_new = tl.maximum(m, lse_s)  # NaN passes on
            # -inf: no split so far has a key this row sees (several tokens: a split of later drafts only); 0 keeps
            # exp from giving NaN, and such a split adds nothing.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            w = tl.exp(lse_s - m_safe)
            acc = acc * alpha + w * o_s
            denom = denom * alpha + w
            m = m_new
    if HAS_SINK:
        # The sink adds exp(sink) to the denominator only.
        sink = tl.load(SINKS + head).to(tl.float32)
        m_new = tl.maximum(m, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no keys and a -inf sink: stay empty, no NaN
        alpha = tl.exp(m - m_safe)
        acc = acc * alpha
        denom = denom * alpha + tl.exp(sink - m_safe)
        m = m_safe
    # Empty is denom == 0 exactly: a NaN split (NaN inputs) keeps the row NaN instead of turning into 0.
    has_keys = denom != 0
    safe = tl.where(has_keys, denom, 1.0)
    out = tl.where(has_keys, acc / safe, 0.0)
    tl.store(O + row * V_HEAD_DIM + offs_dv, out.to(O.dtype.element_ty), mask=mask_dv & merges)
    tl.store(LSE + row, tl.where(has_keys, m + tl.log(safe), float("-inf")), mask=merges)
