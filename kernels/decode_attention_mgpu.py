"""Split-KV decode for grouped-query attention on Hopper as a Pallas Mosaic GPU kernel, over 16-bit or fp8 pools.

Over 16-bit pools it is sm_90's default decode kernel (94-96% of the memory floor at D1-D3 on the H200 in one run,
where the Triton kernel reaches 89-92%: `benchmarks/RESULTS.md`). It was written for fp8 pools (issue 26), where Triton's
kernel (kernels/decode_attention.py) reads the fp8 V operand from shared memory a byte at a time (sm_90 has no 8-bit
transposing ldmatrix) and is bound by instruction issue (Nsight Compute at D1-FP8: IPC 2.1, DRAM 69%). Here a
consumer converts each fp8 tile to f16 in shared memory (32-bit loads, packed f16x2 conversions) and wgmma reads V
in its transposed (MN-major) form, which needs no byte shuffles; so far that runs 1.3x slower than Triton over fp8
pools (the conversions and the softmax sit on each consumer's critical path), so fp8 pools take it by name only.
Moving the conversions to the producer warpgroup was 20-33% slower still (H200, 2026-12-05: one warpgroup converting
both consumers' tiles has half the threads for the conversions that bind it) and was removed, as were fp8 scores
(S = Q K^T on fp8 tensor cores from the K ring, q split into three e4m3 parts: outside bf16's tolerance on large scores
with outlier q channels on the H200, 2026-12-05).

A work item = one sequence x two kv heads x one split of its keys; the launch is one CTA per item, or (many short
items) one persistent CTA per multiprocessor taking items in turn, whose producer fills the rings with the next
item's rows (and Q) while the consumers finish the current one. Each kv head's rows are its q heads (GQA's group, at
most 64), padded to wgmma's 64 rows with zero rows that are computed and never stored. Three warpgroups:

* warpgroups 0 and 1 (consumers, one kv head each; the second idles when the kv head count is odd) per 64-key tile:
  S = Q K^T (Q in registers; for fp8 pools bf16 q is pre-scaled by sm_scale in f32 and rounded to f16 once, as the
  Triton kernel's f16 dots, f16 q taken as it is; K from its f16 tile), V converted to f16 while the wgmma runs,
  the ring slot released, the online softmax (base 2, k_scale folded into the exponent's scale), O += P V with P
  from registers, and the next tile's K converted while that runs. 16-bit pools take no conversion: wgmma reads the
  ring's tiles and the slot is released after P V. Two consumers per SM keep one's conversions and softmax beside
  the other's wgmmas (a CTA of one consumer ran at 41-45% of the fp8 floor: `benchmarks/RESULTS.md`).
* warpgroup 2 (producer, 40 registers: `REGISTERS`) copies each kv head's Q rows once (rows past the group
  zero-filled), then gathers the split's K and V rows of both kv heads (the same slots) by 16-byte `cp.async`
  (`issue_rows`) into each consumer's two rings of [64, head_dim] tiles in the pool's dtype, one "landed" mbarrier per
  ring slot; ring phases count tiles over all of a CTA's items, and a Q reload waits for the consumer to have read the
  last Q.

At the end each consumer stores its group's rows of the split's normalised output (times v_scale) and natural-log
LSE into the partial buffers of `kernels/decode_attention.py`'s stage 1, which its stage 2 merges (sinks added there),
or, with one split per sequence (`final`), the output in q's dtype and the LSE themselves.
Split geometry, index checks and empty rows are the MLA kernel's (`decode_cta`, `decode_visible`): ranges clamped
into kv_indices, slots into the pool, an empty split stores nothing, NaN in q or a visited K/V row stays NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from jaxattn.kernels.extend_attention_mgpu import (
    LOG2E,
    REGISTERS,
    SWIZZLED,
    SWIZZLED_8BIT,
    WARPGROUP,
    arrive_barrier,
    init_barriers,
    issue_rows,
    online_softmax_tile,
    row_sources,
    wait_barrier,
)
from jaxattn.kernels.mla_attention_mgpu import (
    BLOCK_KV,
    BLOCK_ROWS,
    decode_cta,
    decode_visible,
    inverse_sum,
    rows_lse,
    store_rows,
)

FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)  # jaxattn.fp8's list: kernels/ imports nothing of jaxattn beyond it
# q/k = v head dims the kernel takes: rows of whole 128-byte swizzle columns (fp8 at 64 would need a 64-byte swizzle).
HEAD_DIMS = {1: (128,), 2: (64, 128)}  # by the pool's bytes per element
CONSUMERS = 2  # kv heads per CTA, one consumer warpgroup each


def shared_bytes(head_dim: int, pool_itemsize: int, stages: int) -> int:
    """A CTA's shared memory: per consumer Q, its K and V rings, (fp8) its f16 K and V tiles; 4 KB for the mbarriers
    and Pallas' alignment padding (a kernel within 2 KB of the limit failed to launch: `MgpuExtendConfig`'s rule)."""
    tile = BLOCK_KV * head_dim
    converted = 2 * tile * 2 if pool_itemsize == 1 else 0
    return CONSUMERS * (BLOCK_ROWS * head_dim * 2 + 2 * stages * tile * pool_itemsize + converted) + 4096


def _barriers(stages: int):
    """First indices of the (k_ready, v_ready, free) rings (consumer c's slot i: first + c * stages + i), of the Q
    barriers (q_ready + c: Q landed; q_free + c: consumer c has read it), and every barrier's arrival count (128
    threads each)."""
    ring = CONSUMERS * stages
    return 0, ring, 2 * ring, 3 * ring, 3 * ring + CONSUMERS, (WARPGROUP,) * (3 * ring + 2 * CONSUMERS)


def gqa_decode_mgpu_kernel(q, k_pool, v_pool, kv_indptr, kv_indices, num_kv_splits, kv_scales, *, sm_scale,
                           max_kv_splits, stages, sliding_window=-1, min_block_kv=32, persistent_ctas=0,
                           final=False):
    """Stage 1 of split-KV decode, one query token per sequence. Returns (mid_o f32[batch * q_heads * max_kv_splits,
    head_dim], mid_lse f32[batch * q_heads * max_kv_splits]): row g = b * q_heads + h, split s at g * max_kv_splits + s
    (`decode_stage1_kernel`'s MID_O / MID_LSE flattened). Entries of empty splits are not written.

    q: [batch, q_heads, head_dim] bf16/f16; k_pool, v_pool: [slots, kv_heads, head_dim], q's dtype or fp8 (e4m3fn /
    e5m2; then kv_scales f32[2 * kv_heads] or one more: K scales then V scales, else None); q_heads a multiple of
    kv_heads with at most 64 q heads per kv head; head_dim in HEAD_DIMS[pool itemsize]. kv_indptr: i32[batch + 1];
    kv_indices: i32/i64[capacity]; num_kv_splits: i32[batch] (clamped to [1, max_kv_splits]). stages: the rings'
    depth (>= 2; the caller checks `shared_bytes` against the device). sliding_window W >= 0: only the last W + 1
    listed keys.
    persistent_ctas: 0 launches one CTA per work item (split x kv head pair x sequence); n > 0 launches
    min(n, items) CTAs that take items i, i + n, ... in turn, the producer filling the rings with the next item's
    rows while the consumers finish the current one (a CTA's start-up, its first tiles' latency, is paid once).
    final (max_kv_splits 1 only): returns the attention itself instead, (o [batch * q_heads, head_dim] in q's dtype,
    lse f32[batch * q_heads]), what stage 2 makes of one split (bit for bit, without sinks): rows of empty sequences
    0 with LSE -inf; no merge launch.
    """
    batch, q_heads, head_dim = q.shape
    slots, kv_heads, _ = k_pool.shape
    if head_dim not in HEAD_DIMS.get(k_pool.dtype.itemsize, ()):
        raise ValueError(f"head_dim must be one of {HEAD_DIMS} (by the pool's bytes per element); got q {q.shape} "
                         f"over a {k_pool.dtype} pool")
    if q_heads % kv_heads or q_heads // kv_heads > BLOCK_ROWS:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads}), at most {BLOCK_ROWS} per kv head")
    if v_pool.shape != k_pool.shape or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"k_pool and v_pool must have one shape and dtype; got {k_pool.shape} {k_pool.dtype}, "
                         f"{v_pool.shape} {v_pool.dtype}")
    fp8 = k_pool.dtype in tuple(map(jnp.dtype, FP8_DTYPES))
    if not fp8 and k_pool.dtype != q.dtype:
        raise ValueError(f"the pools must be q's dtype or fp8; got {k_pool.dtype} with q {q.dtype}")
    if fp8 != (kv_scales is not None):
        raise ValueError("kv_scales is given exactly when the pools are fp8")
    if final and max_kv_splits != 1:
        raise ValueError(f"final outputs take max_kv_splits == 1; got {max_kv_splits}")
    itemsize = k_pool.dtype.itemsize
    group = q_heads // kv_heads
    capacity = kv_indices.shape[0]
    ring_transforms = SWIZZLED_8BIT if fp8 else SWIZZLED
    k_ready, v_ready, free, q_ready, q_free, counts = _barriers(stages)
    head_pairs = -(-kv_heads // CONSUMERS)
    items = max_kv_splits * head_pairs * batch
    ctas = min(persistent_ctas, items) if persistent_ctas > 0 else 0

    def body(kv_indptr_ref, kv_indices_ref, splits_ref, q_ref, k_ref, v_ref, scales_ref, mid_o_ref, mid_lse_ref,
             scoped):
        q_smem, k_rings, v_rings, converted, bars = scoped
        wg = lax.axis_index("wg")

        def item_at(k):
            """(seq, head_pair, split, its DecodeCta) of this CTA's k-th item. Persistent CTAs number the items kv head
            pair fastest (a sequence's pairs read the same slots' adjacent rows together), split slowest (a batch whose
            splits past the first are empty spreads its work over every CTA)."""
            if ctas:
                item = jnp.minimum(lax.axis_index("cta") + k * ctas, items - 1)  # past the last: a copy, never run
                head_pair = lax.rem(item, head_pairs)
                seq = lax.rem(lax.div(item, head_pairs), batch)
                split = lax.div(item, head_pairs * batch)
            else:
                split, head_pair, seq = (lax.axis_index(n) for n in ("splits", "kv_head_pairs", "seq"))
            cta = decode_cta(kv_indptr_ref, splits_ref, seq, split, capacity=capacity, sliding_window=sliding_window,
                             max_kv_splits=max_kv_splits, min_block_kv=min_block_kv, tokens=1)
            return seq, head_pair, split, cta

        def for_each_item(fn, counters):
            """Runs fn(seq, head_pair, split, cta, counters) -> counters over this CTA's items. A persistent CTA reads
            the next item's geometry before running the current one, so those loads' latency hides behind its tiles."""
            if not ctas:
                return fn(*item_at(jnp.int32(0)), counters)

            def run(k, carry):
                counters, current = carry
                following = item_at(k + 1)
                return fn(*current, counters), following

            cta_items = lax.div(items - 1 - lax.axis_index("cta"), ctas) + 1
            return lax.fori_loop(0, cta_items, run, (counters, item_at(jnp.int32(0))))[0]

        def store(q_row0, split, out, lse):
            """A group's rows of the output (or of split `split`'s partials) and LSE, from registers."""
            first_out = q_row0 * max_kv_splits + split  # row g's split s sits at g * max_kv_splits + s
            store_rows(out, mid_o_ref, first_out, jnp.int32(group), row_stride=max_kv_splits * head_dim,
                       first_scale=head_dim)
            store_rows(lse, mid_lse_ref, first_out, jnp.int32(group), row_stride=max_kv_splits, first_scale=1)

        def consumer(c):
            """Consumer warpgroup c (a traced index) on kv head CONSUMERS * head_pair + c of each item. Counters:
            (ring tiles it has consumed, Q loads it has read)."""
            ring0 = c * stages  # consumer c's slots of the rings, and of their barriers
            k16, v16 = (converted[0].at[c], converted[1].at[c]) if fp8 else (None, None)
            plgpu.set_max_registers(REGISTERS[CONSUMERS][0], action="increase")

            def ring_slot(tile):  # ring tile number -> (slot, phase parity)
                return ring0 + lax.rem(tile, stages), lax.rem(lax.div(tile, stages), 2)

            def convert(ring, tile, index, ready):
                """Waits for ring tile `index` and writes it to `tile` as f16. The 8-bit load takes 4 elements per
                32-bit access (the layout made for upcasting into wgmma's)."""
                slot, parity = ring_slot(index)
                wait_barrier(bars, ready + slot, parity)
                tile[...] = plgpu.load(ring.at[slot], layout=plgpu.Layout.WGMMA_UPCAST_2X).astype(jnp.float16)

            def item(seq, head_pair, split, cta, counters):
                ring_done, q_loads = counters
                kv_head = CONSUMERS * head_pair + c
                active = (cta.split_len > 0) & (kv_head < kv_heads)

                @pl.when(active)
                def _():
                    q_row0 = seq * q_heads + kv_head * group  # the group's first row of q (and of the outputs)
                    m_i = plgpu.layout_cast(jnp.full((BLOCK_ROWS,), -1e30, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
                    l_i = plgpu.layout_cast(jnp.full((BLOCK_ROWS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
                    acc = plgpu.layout_cast(jnp.full((BLOCK_ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)
                    wait_barrier(bars, q_ready + c, lax.rem(q_loads, 2))
                    q_regs = plgpu.load(q_smem.at[c], layout=plgpu.Layout.WGMMA)
                    if ctas:  # the producer may load the next item's Q
                        arrive_barrier(bars, q_free + c)
                    if fp8:  # f16 dots (f16 holds fp8 exactly)
                        if q.dtype == jnp.bfloat16:  # rounded to f16 once, sm_scale applied before (f16's range)
                            q_regs = (q_regs.astype(jnp.float32) * sm_scale).astype(jnp.float16)
                            scale_log2 = scales_ref[kv_head] * LOG2E
                        else:  # f16 q as it is: a rounding of q * sm_scale would cost it bits (Triton's f16 q too)
                            scale_log2 = scales_ref[kv_head] * (float(sm_scale) * LOG2E)
                        v_scale = scales_ref[kv_heads + kv_head]
                    else:
                        scale_log2 = float(sm_scale) * LOG2E
                        v_scale = None

                    if fp8:  # tile 0's K; each step converts the next tile's K while its P V runs
                        convert(k_rings, k16, ring_done, k_ready)
                        plgpu.commit_smem()

                    def step_fn(step, carry, masked):
                        acc, m_i, l_i = carry
                        tile = ring_done + step  # traced here: the closures below must not capture a constant
                        slot, parity = ring_slot(tile)
                        if not fp8:
                            wait_barrier(bars, k_ready + slot, parity)
                        k_tile = k16 if fp8 else k_rings.at[slot]

                        def qk(s_ref):
                            plgpu.wgmma(s_ref, q_regs, k_tile.transpose((1, 0)))
                            if fp8:  # V's conversion overlaps the wgmma; then both fp8 tiles are read: release the slot
                                convert(v_rings, v16, tile, v_ready)
                                arrive_barrier(bars, free + slot)
                                plgpu.commit_smem()
                            return s_ref[...]

                        s = pl.run_scoped(qk, plgpu.ACC((BLOCK_ROWS, BLOCK_KV), jnp.float32))
                        if masked:
                            cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS, BLOCK_KV), 1, layout=plgpu.Layout.WGMMA)
                            s = jnp.where(decode_visible(cta, step, cols, 1), s, -jnp.inf)
                        p, acc, m_new, l_i, _ = online_softmax_tile(s, acc, m_i, l_i, scale_log2)
                        p16 = p.astype(jnp.float16 if fp8 else q_regs.dtype)
                        if not fp8:
                            wait_barrier(bars, v_ready + slot, parity)
                        v_tile = v16 if fp8 else v_rings.at[slot]

                        def pv(acc_ref):
                            plgpu.wgmma(acc_ref, p16, v_tile)
                            if fp8:  # S = Q K^T has completed: K's f16 tile takes the next tile
                                @pl.when(step + 1 < cta.steps)
                                def _():
                                    convert(k_rings, k16, tile + 1, k_ready)
                                    plgpu.commit_smem()

                        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                        if not fp8:
                            arrive_barrier(bars, free + slot)
                        return acc, m_new, l_i

                    carry = (acc, m_i, l_i)
                    carry = lax.fori_loop(0, cta.full_steps, lambda i, c: step_fn(i, c, False), carry)
                    carry = lax.fori_loop(cta.full_steps, cta.steps, lambda i, c: step_fn(i, c, True), carry)
                    acc, m_i, l_i = carry
                    factor = inverse_sum(l_i)
                    if v_scale is not None:
                        factor = factor * v_scale
                    out = acc * lax.broadcast_in_dim(factor, acc.shape, [0])
                    store(q_row0, split, out.astype(q.dtype) if final else out, rows_lse(m_i, l_i))

                if final:  # an empty sequence's rows: what stage 2 writes for them
                    @pl.when(~active & (kv_head < kv_heads))
                    def _():
                        zeros = plgpu.layout_cast(jnp.full((BLOCK_ROWS, head_dim), 0.0, q.dtype), plgpu.Layout.WGMMA)
                        no_key = plgpu.layout_cast(jnp.full((BLOCK_ROWS,), -jnp.inf, jnp.float32),
                                                   plgpu.Layout.WGMMA.reduce(1))
                        store(seq * q_heads + kv_head * group, split, zeros, no_key)

                return ring_done + jnp.where(active, cta.steps, 0), q_loads + active.astype(jnp.int32)

            for_each_item(item, (jnp.int32(0), jnp.int32(0)))

        def producer():
            """Counters: per consumer, (ring tiles it has filled, Q loads it has issued)."""
            plgpu.set_max_registers(REGISTERS[CONSUMERS][1], action="decrease")

            def item(seq, head_pair, split, cta, counters):
                heads = [CONSUMERS * head_pair + c for c in range(CONSUMERS)]
                active = [(cta.split_len > 0) & (kv_head < kv_heads) for kv_head in heads]
                from_q = cta.split_len < 0  # a traced False: rows first + r of q
                for c, kv_head in enumerate(heads):
                    q_loads = counters[c][1]

                    @pl.when(active[c])
                    def _():
                        if ctas:  # consumer c has read the previous item's Q
                            pl.when(q_loads > 0)(lambda: wait_barrier(bars, q_free + c, lax.rem(q_loads - 1, 2)))
                        q_rows = row_sources(kv_indices_ref, from_q, seq * q_heads + kv_head * group, jnp.int32(group),
                                             block_kv=BLOCK_ROWS, pool_rows=q_ref.shape[0])
                        issue_rows(q_ref, q_ref, q_smem, bars, q_rows, from_q, jnp.int32(c), jnp.int32(q_ready + c),
                                   jnp.int32(0), block_kv=BLOCK_ROWS, head_dim=head_dim)

                from_pool = cta.split_len > 0  # a traced True where there are tiles

                def sources_of(step):
                    return row_sources(kv_indices_ref, from_pool, cta.kv_begin + cta.split_start + step * BLOCK_KV,
                                       cta.split_len - step * BLOCK_KV, block_kv=BLOCK_KV, pool_rows=slots)

                def step_body(step, sources):
                    next_sources = sources_of(step + 1)  # its loads overlap this tile's wait and copies
                    for c, kv_head in enumerate(heads):  # both kv heads read the same slots
                        @pl.when(active[c])
                        def _():
                            tile = counters[c][0] + step
                            slot = c * stages + lax.rem(tile, stages)
                            # The slot's previous tile (tile - stages) released by consumer c's 128 threads.
                            pl.when(tile >= stages)(lambda: wait_barrier(
                                bars, free + slot, lax.rem(lax.div(tile, stages) - 1, 2)))
                            for rings, pool, ready in ((k_rings, k_ref, k_ready), (v_rings, v_ref, v_ready)):
                                issue_rows(pool, pool, rings, bars, sources, from_pool, slot, ready + slot, kv_head,
                                           block_kv=BLOCK_KV, head_dim=head_dim, itemsize=itemsize)
                    return next_sources

                lax.fori_loop(0, cta.steps, step_body, sources_of(jnp.int32(0)))
                return tuple((filled + jnp.where(a, cta.steps, 0), loads + a.astype(jnp.int32))
                             for (filled, loads), a in zip(counters, active))

            for_each_item(item, tuple((jnp.int32(0), jnp.int32(0)) for _ in range(CONSUMERS)))

        init_barriers(bars, counts)
        pl.when(wg < CONSUMERS)(lambda: consumer(wg))
        pl.when(wg == CONSUMERS)(producer)

    def entry(kv_indptr_ref, kv_indices_ref, splits_ref, q_ref, k_ref, v_ref, *rest):
        scales_ref, (mid_o_ref, mid_lse_ref) = (rest[0], rest[1:]) if fp8 else (None, rest)
        tiles = (CONSUMERS, BLOCK_KV, head_dim)
        scratch = [
            plgpu.SMEM((CONSUMERS, BLOCK_ROWS, head_dim), q.dtype, transforms=SWIZZLED),  # Q per consumer
            # K and V rings, consumer c's slots at [c * stages, (c + 1) * stages)
            plgpu.SMEM((CONSUMERS * stages, BLOCK_KV, head_dim), k_pool.dtype, transforms=ring_transforms),
            plgpu.SMEM((CONSUMERS * stages, BLOCK_KV, head_dim), k_pool.dtype, transforms=ring_transforms),
            [plgpu.SMEM(tiles, jnp.float16, transforms=SWIZZLED)] * 2 if fp8 else [],  # f16 K and V per consumer
            plgpu.SMEM((2 * len(counts),), jnp.int32),  # the mbarriers, 8 bytes each
        ]
        pl.run_scoped(lambda *scoped: body(kv_indptr_ref, kv_indices_ref, splits_ref, q_ref, k_ref, v_ref, scales_ref,
                                           mid_o_ref, mid_lse_ref, scoped),
                      *scratch, collective_axes="wg")

    rows = batch * q_heads
    return plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((rows * max_kv_splits, head_dim), q.dtype if final else jnp.float32),
                  jax.ShapeDtypeStruct((rows * max_kv_splits,), jnp.float32)),
        grid=(ctas,) if ctas else (max_kv_splits, head_pairs, batch),
        grid_names=("cta",) if ctas else ("splits", "kv_head_pairs", "seq"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(kv_indptr, kv_indices, num_kv_splits, q.reshape(rows, 1, head_dim), k_pool, v_pool,
      *((kv_scales,) if fp8 else ()))
