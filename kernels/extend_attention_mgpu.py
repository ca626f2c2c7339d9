"""Causal extend attention for Hopper as a Pallas Mosaic GPU kernel: warp-specialised, TMA-fed, wgmma in registers.

The FlashAttention-3 schedule (the structure of JAX's `pallas/ops/gpu/attention_mgpu.py`), made ragged for serving:
one CTA = 2 * block_q new tokens of one sequence x one q head, three warpgroups:

* warpgroup 2 (producer, 40 registers) streams the sequence's K/V tiles into a `stages`-deep ring of shared memory
  with TMA: first the cached prefix (from `k_prefix`/`v_prefix`: the prefix gathered into one contiguous buffer by
  `kernels/gather_prefix.py`, each sequence from an 8-aligned row), then the new tokens (from `k_new`/`v_new`, rows
  qo_indptr[b]:...), up to the CTA's last query row (causal);
* warpgroups 0 and 1 (consumers, 232 registers) each own block_q query rows: S = Q K^T and O += P V with wgmma (P
  stays in registers), online softmax in base 2 with the scale folded into the exponent's FMA. A shared "schedule"
  barrier alternates their matrix work, so one warpgroup's softmax runs while the other's wgmma does.

Tiles that cross the end of the prefix or the causal diagonal are masked; the others run unmasked. A tile may hold
rows of the next sequence (or rows past the array, which TMA fills with zeros): their scores are masked, and their V
rows meet p = 0. The last, partial q tile of a sequence is stored through a ladder of power-of-2 TMA stores, so no
row of another sequence is overwritten. Shapes: see `extend_attention_mgpu_kernel`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

LOG2E = 1.4426950408889634
COMPUTE_WARPGROUPS = 2


def _cdiv(x, d: int):
    return lax.div(x + (d - 1), jnp.int32(d))


def _align8(x):
    """x rounded down to a multiple of 8, in a form Mosaic's divisibility analysis can see (a product by 8)."""
    return lax.div(x, jnp.int32(8)) * 8


def extend_attention_mgpu_kernel(q, k_new, v_new, k_prefix, v_prefix, qo_indptr, prefix_start, kv_indptr, out_ref, *,
                                 max_extend_len, sm_scale, block_q, block_kv, stages):
    """Runs the kernel; writes `out_ref` in place (rows it does not own are left as they were).

    q: [tokens, q_heads, head_dim]; k_new/v_new: [tokens, kv_heads, head_dim] (same rows as q);
    k_prefix/v_prefix: [prefix_rows, kv_heads, head_dim]: sequence b's cached keys at rows prefix_start[b]: (a
      multiple of 8) + its prefix length kv_indptr[b+1] - kv_indptr[b], zeros after it up to the next sequence;
    qo_indptr, prefix_start, kv_indptr: i32[batch + 1]; out_ref: a Ref of [tokens, q_heads, head_dim] in q's dtype.
    head_dim a multiple of 64 (<= 128: the accumulators of both consumer warpgroups live in registers).
    """
    tokens, q_heads, head_dim = q.shape
    kv_heads = k_new.shape[1]
    batch = qo_indptr.shape[0] - 1
    group = q_heads // kv_heads
    dtype = q.dtype
    cta_rows = COMPUTE_WARPGROUPS * block_q
    q_tiles = -(-(max_extend_len + 7) // cta_rows)  # + 7: tiles start up to 7 rows before a sequence
    scale_log2 = float(sm_scale) * LOG2E

    def body(qo_indptr_ref, prefix_start_ref, kv_indptr_ref, q_ref, k_new_ref, v_new_ref, k_pre_ref, v_pre_ref, out_gmem, scoped):
        (qo_smem2, o_rows_smem2, k_smem, v_smem), (k_ready, v_ready, q_ready), (k_free, v_free), schedule = scoped
        head = lax.axis_index("heads")
        seq = lax.axis_index("seq")
        # Reversed: the q tiles with the most causal work start first, the short ones fill the tail.
        tile = (q_tiles - 1) - lax.axis_index("q_tiles")
        wg = lax.axis_index("wg")
        q_start = qo_indptr_ref[seq]
        # Rows past max_extend_len are not computed (left as the caller's out_ref has them), as in the Triton kernels.
        q_end = jnp.minimum(qo_indptr_ref[seq + 1], q_start + max_extend_len)
        # Tiles of new tokens (queries and keys) start at `base`, q_start rounded down to 8 rows: Mosaic's TMA into
        # 8-row-tiled shared memory needs row offsets it can prove are multiples of 8. The first `lead` rows of
        # the first tile belong to the previous sequence and are masked (as keys) and not stored (as queries).
        base = _align8(q_start)
        lead = q_start - base
        pre_start = _align8(prefix_start_ref[seq])  # a multiple of 8 already: this form lets Mosaic see it
        prefix_len = kv_indptr_ref[seq + 1] - kv_indptr_ref[seq]
        cta_row = base + tile * cta_rows  # first (absolute) query row of this CTA
        pre_steps = _cdiv(prefix_len, block_kv)
        # K/V tiles the CTA needs: the whole prefix, then new keys up to its last valid row.
        cta_steps = pre_steps + _cdiv(jnp.minimum(cta_row + cta_rows, q_end) - base, block_kv)

        def schedule_sync():
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(schedule)

        @pl.when((cta_row < q_end) & (q_start < q_end))
        def _cta():
            @pl.when(wg < COMPUTE_WARPGROUPS)
            def _consumer():
                plgpu.set_max_registers(232, action="increase")
                qo_smem = qo_smem2.at[wg]
                wg_row = cta_row + wg * block_q  # this warpgroup's first query row (it may hold no valid row)
                wg_rel = wg_row - base  # ... counted from base, as key tile offsets are
                new_steps = _cdiv(jnp.minimum(wg_row + block_q, q_end) - base, block_kv)
                wg_steps = pre_steps + new_steps
                full_pre = lax.div(prefix_len, jnp.int32(block_kv))  # prefix tiles with no key past the prefix
                # New-key tiles every row sees whole: none of the previous sequence's keys (tile 0 when lead > 0),
                # last key <= the warpgroup's first row.
                first_full = jnp.where(lead > 0, 1, 0)
                end_full = jnp.maximum(jnp.minimum(lax.div(wg_rel + 1, jnp.int32(block_kv)), new_steps), first_full)

                plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(wg_row, block_q), head], qo_smem, q_ready.at[wg])
                plgpu.barrier_wait(q_ready.at[wg])

                m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
                l_i = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
                acc = plgpu.layout_cast(jnp.full((block_q, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

                plgpu.barrier_wait(k_ready.at[0])
                pl.when(wg == 1)(schedule_sync)

                def kv_step(step, carry, mask_kind=None):
                    acc, m_i, l_i = carry
                    slot = lax.rem(step, jnp.int32(stages))

                    def qk(s_ref):
                        plgpu.wgmma(s_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                        schedule_sync()
                        return s_ref[...]

                    s = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
                    plgpu.barrier_arrive(k_free.at[slot])
                    if mask_kind is not None:
                        cols = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1, layout=plgpu.Layout.WGMMA)
                        if mask_kind == "prefix":  # the prefix's last tile: keys past the prefix are padding
                            visible = step * block_kv + cols < prefix_len
                        else:  # "causal": key k (from base) is visible to row r iff lead <= k <= wg_rel + r
                            rows = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 0, layout=plgpu.Layout.WGMMA)
                            key = (step - pre_steps) * block_kv + cols
                            visible = (key >= lead) & (key <= wg_rel + rows)
                        s = jnp.where(visible, s, -jnp.inf)
                    # Base-2 online softmax; m_i is kept in log2 units so p = exp2(s * c - m) is one FMA + exp2.
                    m_new = jnp.maximum(m_i, s.max(axis=1) * scale_log2)
                    alpha = jnp.exp2(m_i - m_new)
                    p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(m_new, s.shape, [0]))
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    l_i = l_i * alpha + p.sum(axis=1)
                    p16 = p.astype(dtype)
                    acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                    plgpu.barrier_arrive(schedule)  # softmax done
                    plgpu.barrier_wait(v_ready.at[slot])
                    plgpu.barrier_wait(schedule)  # the other warpgroup's matrix work is issued

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                        next_step = step + 1

                        @pl.when(next_step < wg_steps)
                        def _():
                            plgpu.barrier_wait(k_ready.at[lax.rem(next_step, jnp.int32(stages))])

                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                    plgpu.barrier_arrive(v_free.at[slot])
                    return acc, m_new, l_i

                def flush_step(step, _):
                    # Tiles the producer loaded for the other warpgroup's longer causal range: release them in step.
                    slot = lax.rem(step, jnp.int32(stages))
                    plgpu.barrier_arrive(k_free.at[slot])
                    plgpu.barrier_arrive(v_free.at[slot])
                    schedule_sync()
                    schedule_sync()

                masked = functools.partial(kv_step, mask_kind="causal")
                carry = (acc, m_i, l_i)
                carry = lax.fori_loop(0, full_pre, kv_step, carry)
                carry = lax.fori_loop(full_pre, pre_steps, functools.partial(kv_step, mask_kind="prefix"), carry)
                carry = lax.fori_loop(pre_steps, pre_steps + first_full, masked, carry)
                carry = lax.fori_loop(pre_steps + first_full, pre_steps + end_full, kv_step, carry)
                carry = lax.fori_loop(pre_steps + end_full, wg_steps, masked, carry)
                lax.fori_loop(wg_steps, cta_steps, flush_step, None)
                pl.when(wg == 0)(schedule_sync)
                acc, m_i, l_i = carry

                out = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(dtype)
                # This warpgroup's rows of the sequence: [lo, hi) of its block_q.
                lo = jnp.clip(q_start - wg_row, 0, block_q)
                hi = jnp.clip(q_end - wg_row, 0, block_q)

                @pl.when((lo == 0) & (hi == block_q))
                def _whole_tile():
                    qo_smem[...] = out
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(qo_smem, out_gmem.at[pl.ds(wg_row, block_q), head])

                @pl.when((hi > lo) & ((lo > 0) | (hi < block_q)))
                def _partial_tile():
                    # TMA boxes have static sizes: store hi - lo rows as a sum of powers of 2 (e.g. 37 = 32 + 4 + 1),
                    # from a plain (row-sliceable) buffer.
                    o_rows = o_rows_smem2.at[wg]
                    o_rows[...] = out
                    plgpu.commit_smem()
                    count = hi - lo
                    start = lo
                    size = block_q // 2
                    while size >= 1:
                        @pl.when((count & size) != 0)
                        def _(start=start, size=size):
                            plgpu.copy_smem_to_gmem(
                                o_rows.at[pl.ds(start, size)], out_gmem.at[pl.ds(wg_row + start, size), head])

                        start = start + (count & size)
                        size //= 2

                plgpu.wait_smem_to_gmem(0)

            @pl.when(wg == COMPUTE_WARPGROUPS)
            def _producer():
                plgpu.set_max_registers(40, action="decrease")
                kv_head = lax.div(head, jnp.int32(group))

                def load(step, slot, new_ref, pre_ref, smem, ready):
                    @pl.when(step < pre_steps)
                    def _():
                        rows = pl.ds(pre_start + step * block_kv, block_kv)
                        plgpu.copy_gmem_to_smem(pre_ref.at[rows, kv_head], smem.at[slot], ready.at[slot])

                    @pl.when(step >= pre_steps)
                    def _():
                        rows = pl.ds(base + (step - pre_steps) * block_kv, block_kv)
                        plgpu.copy_gmem_to_smem(new_ref.at[rows, kv_head], smem.at[slot], ready.at[slot])

                for i in range(stages):
                    @pl.when(i < cta_steps)
                    def _(i=i):
                        load(jnp.int32(i), i, k_new_ref, k_pre_ref, k_smem, k_ready)
                        load(jnp.int32(i), i, v_new_ref, v_pre_ref, v_smem, v_ready)

                @pl.loop(stages, jnp.maximum(cta_steps, stages))
                def _(step):
                    slot = lax.rem(step, jnp.int32(stages))
                    plgpu.barrier_wait(k_free.at[slot])
                    load(step, slot, k_new_ref, k_pre_ref, k_smem, k_ready)
                    plgpu.barrier_wait(v_free.at[slot])
                    load(step, slot, v_new_ref, v_pre_ref, v_smem, v_ready)

    def entry(qo_indptr_ref, prefix_start_ref, kv_indptr_ref, q_ref, k_new_ref, v_new_ref, k_pre_ref, v_pre_ref, out_gmem):
        swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = (
            plgpu.SMEM((COMPUTE_WARPGROUPS, block_q, head_dim), dtype, transforms=swizzled),  # Q, then O
            plgpu.SMEM((COMPUTE_WARPGROUPS, block_q, head_dim), dtype),  # O of a partial tile (row-sliceable)
            plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=swizzled),
            plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=swizzled),
        )
        pl.run_scoped(
            lambda *scoped: body(qo_indptr_ref, prefix_start_ref, kv_indptr_ref, q_ref, k_new_ref, v_new_ref, k_pre_ref, v_pre_ref,
                                 out_gmem, scoped),
            smem,
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS)),
            (plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS),
            collective_axes="wg",
        )

    plgpu.kernel(
        entry,
        out_type=(),
        grid=(q_heads, q_tiles, batch),
        grid_names=("heads", "q_tiles", "seq"),
        num_threads=COMPUTE_WARPGROUPS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(qo_indptr, prefix_start, kv_indptr, q, k_new, v_new, k_prefix, v_prefix, out_ref)
