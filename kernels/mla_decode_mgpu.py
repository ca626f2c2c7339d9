"""MLA decode for Hopper as a Pallas Mosaic GPU kernel: the latent row read once, heads packed into wgmma tiles.

DeepSeek's absorbed attention reads one 576-wide latent head per key (K = all 576 dims, V = its first 512) for every
q head. Split-KV stage 1 (stage 2 is the Triton merge of `kernels/decode_attention.py`, which this kernel's partial
outputs match): one CTA = one sequence x one split of its keys x one block of up to 64 rows, a row being a (query
token, q head) pair (16 heads x 1 token pad to 64 wgmma rows; 16 heads x 4 tokens fill them), three warpgroups:

* warpgroup 2 (producer, 40 registers) gathers the split's latent rows into a `stages`-deep ring of
  [block_kv, 576] tiles through kv_indices: 16-byte `cp.async` copies straight into the 128-byte-swizzled layout
  wgmma reads (`issue_rows` of the extend kernel), rows past the split zero-filled.
* warpgroup 0 computes S = Q K^T over all 576 dims (Q: the block's rows, in shared memory), the online softmax
  (base 2, the scale folded into the exponent's FMA), and O[:, :256] += P V with P from registers; it hands P (bf16
  or f16) to warpgroup 1 through the tile's rope columns (read by nothing after S) and each row's rescale factor
  alpha through shared memory.
* warpgroup 1 rescales its O[:, 256:] by alpha and adds P V from the same K tile's columns 256..511.

So each key's 1152 bytes cross HBM once for every row of the block, S is computed once, and the two 64 x 256 f32
accumulators live in the two consumers' registers. Both consumers release a ring slot (`k_free`, two arrivals) when
their P V on it has completed; warpgroup 0 waits for warpgroup 1 to finish with P before it overwrites it (`p_free`).
At the end warpgroup 0 passes the row sums (the denominators) the same way, and each consumer stores its half of the
split's normalised output, and warpgroup 0 the split's LSE, straight from registers to global memory (only the block's
real rows: the padding rows of a 16-row block are computed but never stored).

Split geometry, index checks and empty rows follow `kernels/decode_attention.py` (the effective range under a window,
`per_split` keys per split in multiples of MIN_BLOCK_KV, ranges cut into kv_indices, slots clamped into the pool, an
empty split stores nothing, a row that sees no key of a split stores 0 and LSE -inf, NaN stays NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, scf

from jaxattn.kernels.extend_attention_mgpu import (
    LOG2E,
    SWIZZLED,
    WARPGROUP,
    draft_bits_tile,
    global_address,
    arrive_barrier,
    init_barriers,
    issue_rows,
    row_sources,
    wait_barrier,
)

BLOCK_ROWS = 64  # wgmma's M: (token, head) rows per CTA
V_SPLIT = 256  # each consumer warpgroup's share of the 512 V columns
# The ring: 64-key tiles (P V's reduction axis; Mosaic's wgmma takes multiples of 64 at a 128-byte swizzle), two of
# them: Q (72 KB) + 2 x 72 KB + 1 KB of rows and mbarriers = 217 KB of sm_90's 227. P has no buffer of its own: it
# goes through the K tile's rope columns (512..575), which only warpgroup 0's S = Q K^T reads (a separate 8 KB P
# buffer made the kernel exactly 227 KB, which failed to launch on the H200).
BLOCK_KV = 64
STAGES = 2
ROPE_COLUMNS = pl.ds(2 * V_SPLIT, 64)  # the latent row's last 64 dims (K only; V is the first 512)
LN2 = 0.6931471805599453


def _cdiv(x, d):
    return lax.div(x + (d - 1), d)


def store_rows(values, out, first, *, valid_rows: int, row_stride: int, first_scale: int, column0: int = 0):
    """Stores rows r < valid_rows of `values` (f32[rows, cols], WGMMA layout, or f32[rows] in its row layout) to the
    flat f32 GMEM buffer `out`, row r column c at element first * first_scale + r * row_stride + column0 + c (int64
    arithmetic), from registers. first: i32 scalar. No other element of `out` is written."""
    two_d = len(values.shape) == 2
    layout = plgpu.Layout.WGMMA if two_d else plgpu.Layout.WGMMA.reduce(1)

    @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType(), plgpu.Layout.WG_SPLAT(())))
    def run(ctx, values, out, first):
        del ctx
        f32, i64 = ir.F32Type.get(), ir.IntegerType.get_signless(64)
        first = first.registers.item() if isinstance(first, mgpu.FragmentedArray) else first
        start = arith.addi(arith.muli(arith.extsi(i64, first), arith.constant(i64, first_scale)),
                           arith.constant(i64, column0))
        base = llvm.inttoptr(llvm.PointerType.get(1), global_address(out))

        def store(value, index):
            r = arith.index_cast(i64, index[0])
            c = arith.index_cast(i64, index[1]) if two_d else arith.constant(i64, 0)
            valid = arith.cmpi(arith.CmpIPredicate.slt, r, arith.constant(i64, valid_rows))
            at = arith.addi(start, arith.addi(arith.muli(r, arith.constant(i64, row_stride)), c))
            branch = scf.IfOp(valid)
            with ir.InsertionPoint(branch.then_block):
                llvm.store(value, mgpu_utils.getelementptr(base, [at], f32))
                scf.yield_([])

        values.foreach(store)

    run(values, out, first)


def mla_decode_mgpu_kernel(q, k_pool, kv_indptr, kv_indices, num_kv_splits, draft_words, *, tokens, q_heads, sm_scale,
                           max_kv_splits, sliding_window=-1, min_block_kv=32):
    """Stage 1 of split-KV MLA decode. Returns (mid_o f32[rows * max_kv_splits, 512], mid_lse f32[rows * max_kv_splits])
    with rows = batch * tokens * q_heads in (sequence, token, head) order: row g's split s at g * max_kv_splits + s, the
    layout of `decode_stage1_kernel`'s MID_O / MID_LSE (f32[batch * tokens, q_heads, max_kv_splits, ...]) flattened.
    Entries of empty splits and of splits past a sequence's count are not written.

    q: [batch * tokens * q_heads, 1, 576] bf16/f16 (rows in that order); k_pool: [slots, 1, 576], q's dtype (V = each
    row's first 512 dims); kv_indptr: i32[batch + 1]; kv_indices: i32/i64[capacity]; num_kv_splits: i32[batch]
    (clamped to [1, max_kv_splits]); draft_words: None (tokens == 1) or i32[batch * tokens * q_heads, 1]: row g sees
    draft j (the sequence's last `tokens` keys are its drafts) iff bit j of its word is set; keys before the drafts
    are always visible. tokens * q_heads must be a multiple of 8 and at most 64 or a multiple of 64.
    sliding_window W >= 0 (tokens == 1): only the last W + 1 listed keys. min_block_kv: split lengths are multiples
    of it (`jaxattn.metadata.MIN_BLOCK_KV`, as in the Triton stages).
    """
    rows_total, q_heads_dim, qk_dim = q.shape
    slots, kv_heads, k_dim = k_pool.shape
    v_dim = 2 * V_SPLIT
    if (q_heads_dim, qk_dim, k_dim, kv_heads) != (1, 576, 576, 1):
        raise ValueError(f"q and k_pool must be [rows, 1, 576] and [slots, 1, 576]; got {q.shape}, {k_pool.shape}")
    rows_per_seq = tokens * q_heads
    if rows_per_seq % 8 or (rows_per_seq > BLOCK_ROWS and rows_per_seq % BLOCK_ROWS):
        raise ValueError(f"tokens * q_heads ({rows_per_seq}) must be a multiple of 8, at most {BLOCK_ROWS} or a "
                         f"multiple of {BLOCK_ROWS}")
    if (draft_words is None) != (tokens == 1):
        raise ValueError("draft_words is given exactly when tokens > 1")
    if sliding_window >= 0 and tokens > 1:
        raise ValueError("a sliding window takes one query token per sequence")
    batch = kv_indptr.shape[0] - 1
    block_rows = min(rows_per_seq, BLOCK_ROWS)  # the CTA's real rows (static)
    head_blocks = rows_per_seq // block_rows
    capacity = kv_indices.shape[0]
    dtype = q.dtype
    scale_log2 = float(sm_scale) * LOG2E
    block_kv, stages = BLOCK_KV, STAGES

    # mbarriers (one 8-byte word each, after the 64 alpha floats): the ring's "tile landed" (128 producer cp.async
    # arrivals) and "slot free" (256: every consumer thread, after its wgmma on the slot completed), Q landed (128),
    # P ready (128: every thread of warpgroup 0, after its stores) and P free (128: warpgroup 1, after its loads).
    # Plain mbarriers with per-thread arrivals and explicit phases, in the 1 KB block the alpha rows take anyway
    # (Pallas allocates its barriers apart).
    ready, free = 0, stages
    q_bar, p_ready, p_free = 2 * stages, 2 * stages + 1, 2 * stages + 2
    counts = (WARPGROUP,) * stages + (2 * WARPGROUP,) * stages + (WARPGROUP,) * 3

    def body(kv_indptr_ref, kv_indices_ref, splits_ref, q_ref, k_pool_ref, words_ref, mid_o_ref, mid_lse_ref, scoped):
        q_smem, k_smem, rows_and_bars = scoped
        alpha_smem = rows_and_bars.at[pl.ds(0, BLOCK_ROWS)]
        bars = rows_and_bars.at[pl.ds(BLOCK_ROWS, 2 * len(counts))]
        split = lax.axis_index("splits")
        block = lax.axis_index("head_blocks")
        seq = lax.axis_index("seq")
        wg = lax.axis_index("wg")
        # The sequence's effective range, cut into kv_indices (as both Triton stages cut it).
        kv_begin = jnp.clip(kv_indptr_ref[seq], 0, capacity)
        kv_end = jnp.clip(kv_indptr_ref[seq + 1], kv_begin, capacity)
        kv_len = kv_end - kv_begin
        if sliding_window >= 0:
            skipped = jnp.maximum(kv_len - (sliding_window + 1), 0)
            kv_begin, kv_len = kv_begin + skipped, kv_len - skipped
        n_splits = jnp.clip(splits_ref[seq], 1, max_kv_splits)
        per_split = _cdiv(_cdiv(kv_len, n_splits), min_block_kv) * min_block_kv
        split_start = split * per_split
        split_len = jnp.maximum(jnp.minimum(split_start + per_split, kv_len) - split_start, 0)
        steps = _cdiv(split_len, block_kv)
        # Tiles whose every key is in the split and (several tokens) before the drafts run unmasked.
        full_steps = lax.div(split_len, block_kv)
        if tokens > 1:
            before_drafts = jnp.maximum(kv_len - tokens - split_start, 0)
            full_steps = jnp.minimum(full_steps, lax.div(before_drafts, block_kv))
        row0 = seq * rows_per_seq + block * block_rows  # the block's first row among all rows

        @pl.when(split_len > 0)
        def _cta():
            init_barriers(bars, counts)

            def wait_tile(step):
                slot = lax.rem(step, stages)
                wait_barrier(bars, ready + slot, lax.rem(lax.div(step, stages), 2))
                return slot

            def normalised(acc, l_i):
                # "No keys" is l == 0 exactly (a split of later drafts only): 0, LSE -inf; NaN stays NaN.
                safe = jnp.where(l_i == 0.0, 1.0, l_i)
                return acc / lax.broadcast_in_dim(safe, acc.shape, [0])

            @pl.when(wg == 0)
            def _scores():
                plgpu.set_max_registers(232, action="increase")
                # Finite start: a row that sees no key of this split (later drafts only) keeps p = 0, alpha = 1.
                m_i = plgpu.layout_cast(jnp.full((BLOCK_ROWS,), -1e30, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
                l_i = plgpu.layout_cast(jnp.full((BLOCK_ROWS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
                acc = plgpu.layout_cast(jnp.full((BLOCK_ROWS, V_SPLIT), 0.0, jnp.float32), plgpu.Layout.WGMMA)
                wait_barrier(bars, q_bar, 0)

                def step_fn(step, carry, masked=False):
                    acc, m_i, l_i = carry
                    first_draft = split_start + step * block_kv - (kv_len - tokens)
                    if masked and tokens > 1:  # gathered before the wgmma is issued: the loads overlap it
                        tile_bits = draft_bits_tile(words_ref, row0, first_draft, block_q=BLOCK_ROWS, block_kv=block_kv)
                    slot = wait_tile(step)

                    def qk(s_ref):
                        plgpu.wgmma(s_ref, q_smem.at[0], k_smem.at[slot].transpose((1, 0)))
                        return s_ref[...]

                    s = pl.run_scoped(qk, plgpu.ACC((BLOCK_ROWS, block_kv), jnp.float32))
                    if masked:
                        cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS, block_kv), 1, layout=plgpu.Layout.WGMMA)
                        visible = step * block_kv + cols < split_len
                        if tokens > 1:
                            visible = visible & ((first_draft + cols < 0) | (tile_bits != 0))
                        s = jnp.where(visible, s, -jnp.inf)
                    m_new = jnp.maximum(m_i, s.max(axis=1) * scale_log2)
                    alpha = jnp.exp2(m_i - m_new)
                    p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(m_new, s.shape, [0]))
                    l_i = l_i * alpha + p.sum(axis=1)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    p16 = p.astype(dtype)
                    # Warpgroup 1 has loaded the previous P and alpha (its arrival #step - 1 on p_free).
                    pl.when(step > 0)(lambda: wait_barrier(bars, p_free, lax.rem(step - 1, 2)))
                    k_smem.at[slot, :, ROPE_COLUMNS][...] = p16  # S = Q K^T has completed: the rope columns are free
                    alpha_smem[...] = alpha
                    arrive_barrier(bars, p_ready)

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, k_smem.at[slot, :, pl.ds(0, V_SPLIT)])

                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                    arrive_barrier(bars, free + slot)
                    return acc, m_new, l_i

                carry = lax.fori_loop(0, full_steps, step_fn, (acc, m_i, l_i))
                acc, m_i, l_i = lax.fori_loop(full_steps, steps, lambda s, c: step_fn(s, c, masked=True), carry)
                wait_barrier(bars, p_free, lax.rem(steps - 1, 2))
                alpha_smem[...] = l_i  # the denominators, for warpgroup 1's half
                arrive_barrier(bars, p_ready)
                lse = jnp.where(l_i == 0.0, -jnp.inf, (m_i + jnp.log2(jnp.where(l_i == 0.0, 1.0, l_i))) * LN2)
                # Row g's split s sits at g * max_kv_splits + s; the block's first such entry:
                first_out = row0 * max_kv_splits + split
                store_rows(normalised(acc, l_i), mid_o_ref, first_out, valid_rows=block_rows,
                           row_stride=max_kv_splits * v_dim, first_scale=v_dim)
                store_rows(lse, mid_lse_ref, first_out, valid_rows=block_rows, row_stride=max_kv_splits, first_scale=1)

            @pl.when(wg == 1)
            def _second_half():
                plgpu.set_max_registers(232, action="increase")
                acc = plgpu.layout_cast(jnp.full((BLOCK_ROWS, V_SPLIT), 0.0, jnp.float32), plgpu.Layout.WGMMA)

                def step_fn(step, acc):
                    wait_barrier(bars, p_ready, lax.rem(step, 2))
                    slot = wait_tile(step)
                    alpha = plgpu.load(alpha_smem, (), layout=plgpu.Layout.WGMMA.reduce(1))
                    p16 = plgpu.load(k_smem.at[slot, :, ROPE_COLUMNS], (), layout=plgpu.Layout.WGMMA)
                    arrive_barrier(bars, p_free)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, k_smem.at[slot, :, pl.ds(V_SPLIT, V_SPLIT)])

                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                    arrive_barrier(bars, free + slot)
                    return acc

                acc = lax.fori_loop(0, steps, step_fn, acc)
                wait_barrier(bars, p_ready, lax.rem(steps, 2))
                l_i = plgpu.load(alpha_smem, (), layout=plgpu.Layout.WGMMA.reduce(1))
                store_rows(normalised(acc, l_i), mid_o_ref, row0 * max_kv_splits + split, valid_rows=block_rows,
                           row_stride=max_kv_splits * v_dim, first_scale=v_dim, column0=V_SPLIT)

            @pl.when(wg == 2)
            def _producer():
                plgpu.set_max_registers(40, action="decrease")
                # Q's rows by cp.async too (rows past the block's zero-filled), then the split's latent rows.
                from_q = split_len < 0  # a traced False: rows first + r of q
                q_rows = row_sources(kv_indices_ref, from_q, row0, jnp.int32(block_rows), block_kv=BLOCK_ROWS,
                                     pool_rows=rows_total)
                issue_rows(q_ref, q_ref, q_smem, bars, q_rows, from_q, jnp.int32(0), jnp.int32(q_bar), jnp.int32(0),
                           block_kv=BLOCK_ROWS, head_dim=qk_dim)
                first_key = kv_begin + split_start  # the split's first entry of kv_indices
                from_pool = split_len > 0  # a traced True: every tile is a pool tile

                def sources_of(step):
                    return row_sources(kv_indices_ref, from_pool, first_key + step * block_kv,
                                       split_len - step * block_kv, block_kv=block_kv, pool_rows=slots)

                def step_body(step, sources):
                    next_sources = sources_of(step + 1)  # its loads overlap this tile's wait and copies
                    slot = lax.rem(step, stages)
                    # The slot's previous tile (step - stages) released by all 256 consumer threads.
                    pl.when(step >= stages)(lambda: wait_barrier(bars, free + slot, lax.rem(lax.div(step, stages) - 1, 2)))
                    issue_rows(k_pool_ref, k_pool_ref, k_smem, bars, sources, from_pool, slot, ready + slot,
                               jnp.int32(0), block_kv=block_kv, head_dim=qk_dim)
                    return next_sources

                lax.fori_loop(0, steps, step_body, sources_of(jnp.int32(0)))

    def entry(kv_indptr_ref, kv_indices_ref, splits_ref, q_ref, k_pool_ref, *rest):
        if tokens > 1:
            words_ref, mid_o_ref, mid_lse_ref = rest
        else:
            (mid_o_ref, mid_lse_ref), words_ref = rest, None
        smem = (
            plgpu.SMEM((1, BLOCK_ROWS, qk_dim), dtype, transforms=SWIZZLED),  # Q (a ring of one, for issue_rows)
            plgpu.SMEM((stages, block_kv, qk_dim), dtype, transforms=SWIZZLED),  # the latent rows' ring
            # alpha per row (then the denominators), warpgroup 0 -> 1, and the mbarriers: one allocation (each is
            # aligned to 1 KB).
            plgpu.SMEM((BLOCK_ROWS + 2 * len(counts),), jnp.float32),
        )
        pl.run_scoped(
            lambda *scoped: body(kv_indptr_ref, kv_indices_ref, splits_ref, q_ref, k_pool_ref, words_ref, mid_o_ref,
                                 mid_lse_ref, scoped),
            *smem,
            collective_axes="wg",
        )

    rows = batch * rows_per_seq
    if rows != rows_total:
        raise ValueError(f"q has {rows_total} rows; batch {batch} x tokens {tokens} x q_heads {q_heads} = {rows}")
    return plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((rows * max_kv_splits, v_dim), jnp.float32),
                  jax.ShapeDtypeStruct((rows * max_kv_splits,), jnp.float32)),
        grid=(max_kv_splits, head_blocks, batch),
        grid_names=("splits", "head_blocks", "seq"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(kv_indptr, kv_indices, num_kv_splits, q, k_pool, *(() if draft_words is None else (draft_words,)))

