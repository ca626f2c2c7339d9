"""Extend (prefill with a cached prefix) attention kernels: SGLang's two-stage kernel and the deterministic unified one.

Layout: page size 1, pools ``[slots, kv_heads, head_dim]``, queries ``[tokens, q_heads, qk_head_dim]``, all contiguous.
Positions are counted from the first *listed* key of a sequence ("listed coordinates"): the P listed prefix keys
sit at 0..P-1, the new tokens at P..P+q_len-1. A windowed prefix list (only the last keys) shifts every position
by the same amount, so causal and window tests hold; KV_START_POS (the absolute position of the first listed key)
is added only where absolute positions matter (xai temperature, custom-mask columns).

Score pipeline (SGLang's order), computed in base 2: ``s = q.k * sm_scale``; ``s = cap * tanh(s / cap)``;
``s *= xai_reg(q_pos)``; mask. log2(e) is folded into the last multiply so the softmax uses exp2.

Grid: (q-head groups, sequences, q-blocks). A program computes BLOCK_M rows: one q head's BLOCK_M tokens, or with
HEAD_PACK > 1 the same BLOCK_M / HEAD_PACK tokens of HEAD_PACK q heads that share a KV head (`_block_rows`).

Both kernels share `_fwd_inner`, the tutorial-06-style carry helper called once on the tiles every row of the
q-block fully sees (no mask work) and once on the tiles that need masking (diagonal, window, custom mask, the
ragged end). Tiles always start at multiples of BLOCK_N in listed-key order, so in the unified kernel a token's
reduction order depends only on absolute key positions, not on where the prefix/new split falls.

Indices are not trusted (issue 21): QO_INDPTR / KV_INDPTR ranges are cut to [0, TOKENS] / [0, KV_CAPACITY] with a
non-negative length (so Q, O, K_NEW, V_NEW rows stay inside the token count), a slot outside [0, NUM_SLOTS) reads the
padding slot 0, and custom-mask entries past MASK_LEN (or in a row whose offset is negative) read as "not visible".
NaN in q or a visible K/V gives a NaN row; a NaN K the row cannot see is removed by the mask. A NaN V the row cannot
see still poisons it when its key sits in a masked tile the program visits (p = 0 times NaN in the P @ V dot), as in
SGLang's kernel.
"""

import triton
import triton.language as tl

from jaxattn.kernels.kv_scales import load_kv_scales

LOG2E = 1.4426950408889634


# Only builtins and this module's helpers below: the launch layer's interpreter converts this module's @triton.jit
# functions, not triton.language's own (tl.max, tl.sum, tl.zeros, tl.sigmoid, tl.cdiv are @jit there).


@triton.jit
def _tanh(x):
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sum_combine(a, b):
    return a + b


@triton.jit
def _fwd_inner(
    acc,  # f32[BLOCK_M, BLOCK_DV]
    l_i,  # f32[BLOCK_M]: softmax denominator (base-2 exponentials)
    m_i,  # f32[BLOCK_M]: running max of the base-2 scores
    q,  # [BLOCK_M, BLOCK_D]
    qpe,  # [BLOCK_M, BLOCK_DPE] (rope part) or a dummy when BLOCK_DPE == 0
    row_scale,  # f32[BLOCK_M]: xai temperature per row (1 when off)
    q_pos,  # i32[BLOCK_M]: query positions, listed coordinates
    mask_rows,  # i64[BLOCK_M]: flat custom-mask offset of each row's column 0 (listed coordinates); with MASK_BITS,
    #             the offset of the row's draft words
    mask_cols,  # i32[BLOCK_M] (APPLY_MASK only): custom-mask columns of each row inside the mask (0: row past q_len);
    #             with MASK_BITS, the drafts the row's words cover (0: row past q_len)
    K,
    V,  # [rows, KV_HEADS, D]: the pool (GATHER) or the contiguous new tokens
    KV_INDICES,  # slots when GATHER
    MASK,  # u8 custom mask, or i32 draft words (MASK_BITS)
    idx_base,  # i64: first source row (contiguous) or first kv_indices entry (GATHER)
    k_pos_base,  # position (listed coordinates) of source key 0
    k_limit,  # number of source keys
    shift,  # tile start offset: tile t covers source keys t - shift .. t - shift + BLOCK_N - 1 (0 <= shift < BLOCK_N)
    lo,
    hi,  # tile range [lo, hi) (source index + shift); lo a multiple of BLOCK_N
    kv_head,
    MASKED: tl.constexpr,
    GATHER: tl.constexpr,
    APPLY_CAUSAL: tl.constexpr,
    APPLY_MASK: tl.constexpr,
    WINDOW: tl.constexpr,
    qk_scale,  # sm_scale * log2(e) (no cap) or sm_scale / cap (cap), times the source's k_scale (fp8 pools)
    LOGIT_CAP: tl.constexpr,
    USE_XAI: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_SLOTS: tl.constexpr,  # pool rows (GATHER): a slot outside [0, NUM_SLOTS) reads the padding slot 0
    MASK_BITS: tl.constexpr = 0,  # > 0: MASK holds MASK_BITS i32 draft words per row; source key n is draft n
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # Head-dim masks only where the block is wider than the head (e.g. 96 in a 128 block): a provably all-true mask
    # still costs predicate registers and selects per loaded element.
    PAD_D: tl.constexpr = BLOCK_D > D_QK
    PAD_DV: tl.constexpr = BLOCK_DV > D_V
    mask_d = offs_d < D_QK
    mask_dv = offs_dv < D_V
    # Fold the head into scalar base pointers so only [BLOCK_N] row offsets are per-tile (keeps loop-invariant 2-D
    # offset tensors out of registers).
    K = K + kv_head * D_QK
    V = V + kv_head * D_V
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        n = start_n + offs_n - shift
        if MASKED:
            k_valid = (n >= 0) & (n < k_limit)
            if GATHER:
                rows = tl.load(KV_INDICES + idx_base + n, mask=k_valid, other=0).to(tl.int64)
            else:
                rows = idx_base + n
        else:
            if GATHER:
                rows = tl.load(KV_INDICES + idx_base + n).to(tl.int64)
            else:
                rows = idx_base + n
        if GATHER:
            # Hostile slots (negative, 2**30, just past the pool) read the padding slot 0: one select per key, not per
            # element. Contiguous rows need none: the wrapper's ranges are clamped to the token count.
            rows = tl.where((rows >= 0) & (rows < NUM_SLOTS), rows, 0)
        # K transposed [BLOCK_D, BLOCK_N]; int64 offsets: slot * stride can pass 2**31.
        k_ptrs = K + (rows * (KV_HEADS * D_QK))[None, :] + offs_d[:, None]
        if MASKED:
            if PAD_D:
                k = tl.load(k_ptrs, mask=k_valid[None, :] & mask_d[:, None], other=0.0)
            else:
                k = tl.load(k_ptrs, mask=k_valid[None, :], other=0.0)
        elif PAD_D:
            k = tl.load(k_ptrs, mask=mask_d[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION)  # fp8 rows convert exactly
        if BLOCK_DPE > 0:
            offs_dpe = BLOCK_D + tl.arange(0, BLOCK_DPE)
            kpe_ptrs = K + (rows * (KV_HEADS * D_QK))[None, :] + offs_dpe[:, None]
            if MASKED:
                kpe = tl.load(kpe_ptrs, mask=k_valid[None, :], other=0.0)
            else:
                kpe = tl.load(kpe_ptrs)
            qk = tl.dot(qpe, kpe.to(qpe.dtype), qk, input_precision=DOT_PRECISION)
        if LOGIT_CAP > 0:
            qk = (LOGIT_CAP * 1.4426950408889634) * _tanh(qk * qk_scale)
            if USE_XAI:
                qk = qk * row_scale[:, None]
        # Without a cap the scale (and xai factor) is applied late: the row max is scaled once per row and the
        # exponent becomes one FMA per score, qk * scale - m, instead of a multiply and a subtract.
        if MASKED:
            k_pos = k_pos_base + n
            visible = k_valid[None, :]
            if APPLY_MASK:
                if MASK_BITS > 0:
                    # Draft words (the new tokens' stage: source key n is draft n): bit n % 32 of word n // 32, read
                    # for drafts the row's words cover only.
                    word = tl.load(
                        MASK + mask_rows[:, None] + (n // 32)[None, :],
                        mask=(n[None, :] < mask_cols[:, None]) & k_valid[None, :],
                        other=0,
                    )
                    custom = (word >> (n % 32)[None, :]) & 1
                else:
                    # Bounded by the mask's length through the per-row column count (one compare per element, as the
                    # row-valid test it replaces): entries past the mask's end read "not visible", never beyond it.
                    custom = tl.load(
                        MASK + mask_rows[:, None] + k_pos[None, :],
                        mask=(k_pos[None, :] < mask_cols[:, None]) & k_valid[None, :],
                        other=0,
                    )
                visible = visible & (custom != 0)
            elif APPLY_CAUSAL:
                visible = visible & (k_pos[None, :] <= q_pos[:, None])
            if WINDOW >= 0:
                visible = visible & (q_pos[:, None] - k_pos[None, :] <= WINDOW)
            qk = tl.where(visible, qk, float("-inf"))
        row_max = tl.reduce(qk, 1, _max_combine)
        if LOGIT_CAP == 0:
            # Scales are positive, so max(qk) * scale == max(qk * scale) (rounding is monotonic).
            if USE_XAI:
                row_max = row_max * (row_scale * qk_scale)
            else:
                row_max = row_max * qk_scale
        if MASKED:
            # A row with nothing visible yet keeps max -1e20 (not -inf) so exp2(-inf - max) stays 0, never NaN.
            row_max = tl.where(row_max == float("-inf"), -1e20, row_max)
        m_new = tl.maximum(m_i, row_max)
        alpha = tl.math.exp2(m_i - m_new)
        if LOGIT_CAP > 0:
            p = tl.math.exp2(qk - m_new[:, None])
        elif USE_XAI:
            p = tl.math.exp2(qk * (row_scale * qk_scale)[:, None] - m_new[:, None])
        else:
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
        v_ptrs = V + (rows * (KV_HEADS * D_V))[:, None] + offs_dv[None, :]
        if MASKED:
            if PAD_DV:
                v = tl.load(v_ptrs, mask=k_valid[:, None] & mask_dv[None, :], other=0.0)
            else:
                v = tl.load(v_ptrs, mask=k_valid[:, None], other=0.0)
        elif PAD_DV:
            v = tl.load(v_ptrs, mask=mask_dv[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _finish_and_store(acc, l_i, m_i, SINKS, O, head, o_rows, row_valid, Q_HEADS: tl.constexpr, D_V: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINK: tl.constexpr, HEAD_PACK: tl.constexpr):
    # head: this block's q head, or one per row [BLOCK_M] when heads are packed (HEAD_PACK > 1).
    if HAS_SINK:
        # The sink joins the denominator only (natural-log logit, not scaled): fold it in at a common max.
        sink = tl.load(SINKS + head).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_f)
        l_i = l_i * alpha + tl.math.exp2(sink - m_f)
        acc = acc * alpha[:, None]
    # A row with no visible key has l == 0: output 0 (its acc is 0, or NaN where a masked key's V is NaN: p = 0 times
    # NaN). A NaN l (NaN in q, a visible K/V or the scale) stays NaN: the empty test is l == 0, which NaN fails.
    empty = (l_i == 0)[:, None]
    o = tl.where(empty, 0.0, acc / tl.where(empty, 1.0, l_i[:, None]))
    offs_dv = tl.arange(0, BLOCK_DV)
    if HEAD_PACK == 1:
        # The unpacked form keeps the scalar head out of the per-row vector (fewer live 64-bit registers).
        o_ptrs = O + o_rows[:, None] * (Q_HEADS * D_V) + head * D_V + offs_dv[None, :]
    else:
        o_ptrs = O + (o_rows * (Q_HEADS * D_V) + head * D_V)[:, None] + offs_dv[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_valid[:, None] & (offs_dv[None, :] < D_V))


@triton.jit
def _load_q(Q, q_rows, row_valid, head, Q_HEADS: tl.constexpr, D_QK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, HEAD_PACK: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    if HEAD_PACK == 1:
        base = Q + q_rows[:, None] * (Q_HEADS * D_QK) + head * D_QK
    else:
        base = Q + (q_rows * (Q_HEADS * D_QK) + head * D_QK)[:, None]  # one head per row
    q = tl.load(base + offs_d[None, :], mask=row_valid[:, None] & (offs_d[None, :] < D_QK), other=0.0)
    if BLOCK_DPE > 0:
        offs_dpe = BLOCK_D + tl.arange(0, BLOCK_DPE)
        qpe = tl.load(base + offs_dpe[None, :], mask=row_valid[:, None], other=0.0)
    else:
        qpe = q
    return q, qpe


@triton.jit
def _xai_scale(abs_pos, XAI_LEN: tl.constexpr, XAI_INV_LOG2_LEN: tl.constexpr):
    # Grok's temperature, SGLang's 2-stage/decode formula: log2(pos) / log2(L) for pos > L, else 1.
    # (SGLang's unified kernel uses L / (pos + 1) instead; jaxattn uses this one formula in both kernels.)
    pos = abs_pos.to(tl.float32)
    return tl.where(pos > XAI_LEN, tl.log2(tl.maximum(pos, 1.0)) * XAI_INV_LOG2_LEN, 1.0)


@triton.jit
def _csr_range(INDPTR, seq, CAPACITY: tl.constexpr):
    """(start, length) of sequence `seq` in a CSR list, cut into the buffer it indexes: the start clamped to
    [0, CAPACITY], the length to [0, CAPACITY - start]. A few scalar min/max per program; a hostile indptr cannot move
    reads or writes outside the buffer. (Written in this order on purpose: clamping start and end first and then
    subtracting took the 64-family builds from 128 to 135-143 registers on sm_90.)"""
    start = tl.load(INDPTR + seq)
    end = tl.load(INDPTR + seq + 1)
    start = tl.minimum(tl.maximum(start, 0), CAPACITY)
    return start, tl.minimum(tl.maximum(end - start, 0), CAPACITY - start)


@triton.jit
def _csr_range_unbounded_start(INDPTR, seq, CAPACITY: tl.constexpr):
    """`_csr_range` with the start clamped from below only: entries [max(start, 0), min(end, CAPACITY)), length >= 0;
    a start past CAPACITY comes back unclamped with length 0 (nothing is read through it). The same guarantee in a
    form the two-stage kernel's prefix range compiles better with: with `_csr_range` its custom-mask builds spilled
    1512 B instead of 872 B (and `_csr_range` in turn keeps the unified 64-family build at 128 registers, this 135+)."""
    start = tl.maximum(tl.load(INDPTR + seq), 0)
    return start, tl.maximum(tl.minimum(tl.load(INDPTR + seq + 1), CAPACITY) - start, 0)


@triton.jit
def _mask_cols(mask_rows, row_valid, MASK_LEN: tl.constexpr):
    """Per row, how many columns from the row's offset `mask_rows` (int64) lie inside the MASK_LEN-entry mask; 0 for
    rows past q_len and for rows starting before the mask (a hostile negative offset: the row reads "not visible")."""
    cols = tl.minimum(tl.maximum(MASK_LEN - mask_rows, 0), 2**31 - 1)
    return tl.where(row_valid & (mask_rows >= 0), cols, 0).to(tl.int32)


@triton.jit
def _raw_len(INDPTR, seq):
    """INDPTR[seq + 1] - INDPTR[seq] in int64, unclamped (custom-mask row strides)."""
    return tl.load(INDPTR + seq + 1).to(tl.int64) - tl.load(INDPTR + seq).to(tl.int64)


@triton.jit
def _q_block(qo_start, q_len, ROWS: tl.constexpr):
    """Maps program axis 2 to this sequence's q-blocks of ROWS tokens, last (heaviest under causal) first. -1: none."""
    num_blocks = (q_len + ROWS - 1) // ROWS
    pid = tl.program_id(2)
    return tl.where(pid < num_blocks, num_blocks - 1 - pid, -1)


@triton.jit
def _block_rows(block_m, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_PACK: tl.constexpr):
    """(q head, token index within the sequence's new tokens, kv head) of each of the block's BLOCK_M rows.

    HEAD_PACK q heads of one KV head share a block: rows h * ROWS .. h * ROWS + ROWS - 1 hold head
    program_id(0) * HEAD_PACK + h for the block's ROWS = BLOCK_M // HEAD_PACK tokens, so every K/V tile loaded
    serves HEAD_PACK heads. HEAD_PACK == 1 keeps a scalar head (the unpacked kernel's code).
    """
    ROWS: tl.constexpr = BLOCK_M // HEAD_PACK
    first_head = tl.program_id(0) * HEAD_PACK
    kv_head = first_head // (Q_HEADS // KV_HEADS)
    offs_m = tl.arange(0, BLOCK_M)
    if HEAD_PACK == 1:
        head = first_head
        i = block_m * ROWS + offs_m
    else:
        head = first_head + offs_m // ROWS
        i = block_m * ROWS + offs_m % ROWS
    return head, i, kv_head


@triton.jit
def extend_attention_kernel(
    Q,  # [tokens, Q_HEADS, D_QK]: the new tokens' queries, sequence b at QO_INDPTR[b]:QO_INDPTR[b+1]
    K_NEW,  # [tokens, KV_HEADS, D_QK]: the new tokens' keys (contiguous, same rows as Q)
    V_NEW,  # [tokens, KV_HEADS, D_V]
    K_POOL,  # [slots, KV_HEADS, D_QK]: the cache
    V_POOL,  # [slots, KV_HEADS, D_V]
    QO_INDPTR,  # i32[batch + 1]
    KV_INDPTR,  # i32[batch + 1]: CSR of the listed (cached, possibly windowed) prefix
    KV_INDICES,  # i32/i64[kv_capacity]: prefix slots
    KV_START_POS,  # i32[batch]: absolute position of the first listed prefix key (prefix keys dropped by a window)
    MASK,  # u8[mask_len]: custom mask, per sequence row-major [q_len, KV_START_POS + P + q_len] (dummy if unused);
    #        with MASK_BITS, i32[tokens, MASK_BITS]: row r's bit j % 32 of word j // 32 = it sees its sequence's new token j
    MASK_INDPTR,  # i32/i64[batch + 1] (dummy if unused or MASK_BITS)
    SINKS,  # f32[Q_HEADS] (dummy if unused)
    KV_SCALES,  # f32[2, KV_HEADS]: the pool's K and V scales (read only if HAS_KV_SCALES)
    O,  # out: [tokens, Q_HEADS, D_V]
    Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QK_SCALE: tl.constexpr,  # sm_scale * log2(e), or sm_scale / logit_cap with a cap (the wrapper folds it)
    LOGIT_CAP: tl.constexpr,
    XAI_LEN: tl.constexpr,
    XAI_INV_LOG2_LEN: tl.constexpr,
    WINDOW: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    USE_MASK: tl.constexpr,
    SKIP_PREFIX_MASK: tl.constexpr,
    HAS_SINK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEAD_PACK: tl.constexpr,  # q heads per block (rows = HEAD_PACK heads x BLOCK_M // HEAD_PACK tokens)
    TOKENS: tl.constexpr,  # rows of Q/O (and K_NEW/V_NEW): QO_INDPTR is clamped into [0, TOKENS]
    NUM_SLOTS: tl.constexpr,  # pool rows: slots outside [0, NUM_SLOTS) read slot 0
    KV_CAPACITY: tl.constexpr,  # length of KV_INDICES: KV_INDPTR is clamped into it
    MASK_LEN: tl.constexpr,  # length of MASK (1 when unused)
    HAS_KV_SCALES: tl.constexpr,  # fp8 pool: the pool's keys and values are scaled (the new tokens' are not)
    MASK_BITS: tl.constexpr,  # > 0: MASK holds per-row draft words (a compact tree mask; needs USE_MASK, SKIP_PREFIX_MASK)
):
    tl.static_assert(Q_HEADS % KV_HEADS == 0)
    tl.static_assert((Q_HEADS // KV_HEADS) % HEAD_PACK == 0)
    tl.static_assert(MASK_BITS == 0 or (USE_MASK and SKIP_PREFIX_MASK))
    ROWS: tl.constexpr = BLOCK_M // HEAD_PACK  # tokens per block
    seq = tl.program_id(1)
    qo_start, q_len = _csr_range(QO_INDPTR, seq, TOKENS)
    block_m = _q_block(qo_start, q_len, ROWS)
    if block_m < 0:
        return
    head, i, kv_head = _block_rows(block_m, Q_HEADS, KV_HEADS, BLOCK_M, HEAD_PACK)
    kv_start, prefix_len = _csr_range_unbounded_start(KV_INDPTR, seq, KV_CAPACITY)
    start_pos = tl.load(KV_START_POS + seq)

    row_valid = i < q_len  # i: query index within the sequence's new tokens
    q_rows = qo_start.to(tl.int64) + i
    q_pos = prefix_len + i  # listed coordinates
    q, qpe = _load_q(Q, q_rows, row_valid, head, Q_HEADS, D_QK, BLOCK_D, BLOCK_DPE, HEAD_PACK)
    if XAI_LEN > 0:
        row_scale = _xai_scale(start_pos + q_pos, XAI_LEN, XAI_INV_LOG2_LEN)
    else:
        row_scale = tl.full([BLOCK_M], 1.0, tl.float32)
    if MASK_BITS > 0:
        # Each row's draft words (q rows are inside TOKENS: the range is clamped), covering its sequence's new tokens.
        mask_rows = q_rows * MASK_BITS
        mask_cols = tl.where(row_valid, tl.minimum(q_len, 32 * MASK_BITS), 0)
    elif USE_MASK:
        # Full-width rows: the window-dropped prefix columns come first, then the listed prefix, then the new tokens.
        # The row stride is the sequence's own (unclamped) width, so a range cut by the clamps keeps its rows' columns.
        mask_start = tl.load(MASK_INDPTR + seq).to(tl.int64)
        width = start_pos.to(tl.int64) + _raw_len(KV_INDPTR, seq) + _raw_len(QO_INDPTR, seq)
        mask_rows = mask_start + i.to(tl.int64) * width + start_pos
        mask_cols = _mask_cols(mask_rows, row_valid, MASK_LEN)
    else:
        mask_rows = i.to(tl.int64)
        mask_cols = i

    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    k_scale, v_scale = load_kv_scales(KV_SCALES, kv_head, KV_HEADS, HAS_KV_SCALES)
    q_first = block_m * ROWS  # smallest new-token index in this block
    q_last = tl.minimum(q_len, q_first + ROWS) - 1

    # Stage 1: the listed prefix through KV_INDICES. Every prefix key precedes every query (no causal test).
    PREFIX_MASK: tl.constexpr = USE_MASK and not SKIP_PREFIX_MASK
    if WINDOW >= 0:
        lo = tl.maximum(prefix_len + q_first - WINDOW, 0) // BLOCK_N * BLOCK_N
        mid = lo
    elif PREFIX_MASK:
        lo = 0
        mid = 0
    else:
        lo = 0
        mid = prefix_len // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, qpe, row_scale, q_pos, mask_rows, mask_cols, K_POOL, V_POOL, KV_INDICES, MASK,
        kv_start.to(tl.int64), 0, prefix_len, 0, lo, mid, kv_head,
        False, True, False, False, WINDOW, QK_SCALE * k_scale, LOGIT_CAP, XAI_LEN > 0,
        KV_HEADS, D_QK, D_V, BLOCK_D, BLOCK_DPE, BLOCK_DV, BLOCK_N, DOT_PRECISION, NUM_SLOTS,
    )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, qpe, row_scale, q_pos, mask_rows, mask_cols, K_POOL, V_POOL, KV_INDICES, MASK,
        kv_start.to(tl.int64), 0, prefix_len, 0, mid, prefix_len, kv_head,
        True, True, False, PREFIX_MASK, WINDOW, QK_SCALE * k_scale, LOGIT_CAP, XAI_LEN > 0,
        KV_HEADS, D_QK, D_V, BLOCK_D, BLOCK_DPE, BLOCK_DV, BLOCK_N, DOT_PRECISION, NUM_SLOTS,
    )
    if HAS_KV_SCALES:
        acc = acc * v_scale  # the prefix's values so far; the new tokens' are not scaled (acc is linear in V)

    # Stage 2: the new tokens from K_NEW/V_NEW. Causal programs stop at the diagonal; only diagonal tiles are masked.
    if USE_MASK:
        lo = 0
        mid = 0
        hi = q_len
    elif IS_CAUSAL:
        lo = 0
        mid = q_first // BLOCK_N * BLOCK_N
        hi = q_last + 1
    else:
        lo = 0
        mid = q_len // BLOCK_N * BLOCK_N
        hi = q_len
    if WINDOW >= 0:
        lo = tl.maximum(q_first - WINDOW, 0) // BLOCK_N * BLOCK_N
        mid = lo
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, qpe, row_scale, q_pos, mask_rows, mask_cols, K_NEW, V_NEW, KV_INDICES, MASK,
        qo_start.to(tl.int64), prefix_len, q_len, 0, lo, mid, kv_head,
        False, False, IS_CAUSAL, False, WINDOW, QK_SCALE, LOGIT_CAP, XAI_LEN > 0,
        KV_HEADS, D_QK, D_V, BLOCK_D, BLOCK_DPE, BLOCK_DV, BLOCK_N, DOT_PRECISION, NUM_SLOTS,
    )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, qpe, row_scale, q_pos, mask_rows, mask_cols, K_NEW, V_NEW, KV_INDICES, MASK,
        qo_start.to(tl.int64), prefix_len, q_len, 0, mid, hi, kv_head,
        True, False, IS_CAUSAL, USE_MASK, WINDOW, QK_SCALE, LOGIT_CAP, XAI_LEN > 0,
        KV_HEADS, D_QK, D_V, BLOCK_D, BLOCK_DPE, BLOCK_DV, BLOCK_N, DOT_PRECISION, NUM_SLOTS, MASK_BITS,
    )
    _finish_and_store(acc, l_i, m_i, SINKS, O, head, q_rows, row_valid, Q_HEADS, D_V, BLOCK_DV, HAS_SINK, HEAD_PACK)


@triton.jit
def extend_attention_unified_kernel(
    Q,  # [tokens, Q_HEADS, D_QK]
    K_POOL,  # [slots, KV_HEADS, D_QK]: the cache, the new tokens' K already written
    V_POOL,  # [slots, KV_HEADS, D_V]
    QO_INDPTR,  # i32[batch + 1]
    KV_INDPTR,  # i32[batch + 1]: CSR of the unified list (listed prefix, then new tokens)
    KV_INDICES,  # i32/i64[kv_capacity]
    PREFIX_LENS,  # i32[batch]: listed prefix keys per sequence
    KV_START_POS,  # i32[batch]: absolute position of the first listed key (window start)
    MASK,  # u8[mask_len]: custom mask, per sequence row-major [q_len, kv_len] over the listed keys (dummy if unused)
    MASK_INDPTR,  # i32/i64[batch + 1] (dummy if unused)
    SINKS,  # f32[Q_HEADS] (dummy if unused)
    KV_SCALES,  # f32[2, KV_HEADS]: the pool's K and V scales (read only if HAS_KV_SCALES)
    O,  # out: [tokens, Q_HEADS, D_V]
    Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QK_SCALE: tl.constexpr,  # sm_scale * log2(e), or sm_scale / logit_cap with a cap (the wrapper folds it)
    LOGIT_CAP: tl.constexpr,
    XAI_LEN: tl.constexpr,
    XAI_INV_LOG2_LEN: tl.constexpr,
    WINDOW: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    USE_MASK: tl.constexpr,
    HAS_SINK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEAD_PACK: tl.constexpr,  # q heads per block (rows = HEAD_PACK heads x BLOCK_M // HEAD_PACK tokens)
    TOKENS: tl.constexpr,  # rows of Q/O: QO_INDPTR is clamped into [0, TOKENS]
    NUM_SLOTS: tl.constexpr,  # pool rows: slots outside [0, NUM_SLOTS) read slot 0
    KV_CAPACITY: tl.constexpr,  # length of KV_INDICES: KV_INDPTR is clamped into it
    MASK_LEN: tl.constexpr,  # length of MASK (1 when unused)
    HAS_KV_SCALES: tl.constexpr,  # fp8 pool: the pool's keys and values are scaled (the new tokens' are not)
):
    tl.static_assert(Q_HEADS % KV_HEADS == 0)
    tl.static_assert((Q_HEADS // KV_HEADS) % HEAD_PACK == 0)
    ROWS: tl.constexpr = BLOCK_M // HEAD_PACK  # tokens per block
    seq = tl.program_id(1)
    qo_start, q_len = _csr_range(QO_INDPTR, seq, TOKENS)
    block_m = _q_block(qo_start, q_len, ROWS)
    if block_m < 0:
        return
    head, i, kv_head = _block_rows(block_m, Q_HEADS, KV_HEADS, BLOCK_M, HEAD_PACK)
    kv_start, kv_len = _csr_range(KV_INDPTR, seq, KV_CAPACITY)
    prefix_len = tl.load(PREFIX_LENS + seq)
    start_pos = tl.load(KV_START_POS + seq)

    row_valid = i < q_len
    q_rows = qo_start.to(tl.int64) + i
    q_pos = prefix_len + i
    q, qpe = _load_q(Q, q_rows, row_valid, head, Q_HEADS, D_QK, BLOCK_D, BLOCK_DPE, HEAD_PACK)
    if XAI_LEN > 0:
        row_scale = _xai_scale(start_pos + q_pos, XAI_LEN, XAI_INV_LOG2_LEN)
    else:
        row_scale = tl.full([BLOCK_M], 1.0, tl.float32)
    if USE_MASK:
        mask_start = tl.load(MASK_INDPTR + seq).to(tl.int64)
        mask_rows = mask_start + i.to(tl.int64) * _raw_len(KV_INDPTR, seq)  # the unclamped row stride (see above)
        mask_cols = _mask_cols(mask_rows, row_valid, MASK_LEN)
    else:
        mask_rows = i.to(tl.int64)
        mask_cols = i

    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    k_scale, v_scale = load_kv_scales(KV_SCALES, kv_head, KV_HEADS, HAS_KV_SCALES)
    q_pos_first = prefix_len + block_m * ROWS
    q_pos_last = prefix_len + tl.minimum(q_len, block_m * ROWS + ROWS) - 1

    # One loop in key order, tiles at absolute key positions that are multiples of BLOCK_N, so the split between
    # prefix and new keys plays no part in the reduction order. Without a window the list starts at position 0
    # (shift 0); a windowed list starts at start_pos, so tiles are shifted by start_pos % BLOCK_N.
    # Every tile takes the masked path: which tiles a q-block sees unmasked depends on where its rows start, i.e. on
    # the split, and the two code paths need not round alike (the compiler contracts multiply-adds differently),
    # which broke bitwise invariance on the H200. One path keeps each element's arithmetic identical in any split.
    if WINDOW >= 0:
        shift = (start_pos % BLOCK_N + BLOCK_N) % BLOCK_N  # in [0, BLOCK_N) even for a (hostile) negative start
        lo = tl.maximum(q_pos_first + shift - WINDOW, 0) // BLOCK_N * BLOCK_N
        if USE_MASK:
            hi = kv_len + shift
        elif IS_CAUSAL:
            hi = tl.minimum(q_pos_last + 1, kv_len) + shift
        else:
            hi = kv_len + shift
    else:
        shift = 0
        lo = 0
        if IS_CAUSAL and not USE_MASK:
            hi = tl.minimum(q_pos_last + 1, kv_len)  # keys past the block's last query are never visited
        else:
            hi = kv_len
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, qpe, row_scale, q_pos, mask_rows, mask_cols, K_POOL, V_POOL, KV_INDICES, MASK,
        kv_start.to(tl.int64), 0, kv_len, shift, lo, hi, kv_head,
        True, True, IS_CAUSAL, USE_MASK, WINDOW, QK_SCALE * k_scale, LOGIT_CAP, XAI_LEN > 0,
        KV_HEADS, D_QK, D_V, BLOCK_D, BLOCK_DPE, BLOCK_DV, BLOCK_N, DOT_PRECISION, NUM_SLOTS,
    )
    if HAS_KV_SCALES:
        acc = acc * v_scale
    _finish_and_store(acc, l_i, m_i, SINKS, O, head, q_rows, row_valid, Q_HEADS, D_V, BLOCK_DV, HAS_SINK, HEAD_PACK)
