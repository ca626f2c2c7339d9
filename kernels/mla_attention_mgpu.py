"""Absorbed MLA attention for Hopper as a Pallas Mosaic GPU kernel: the latent row read once, heads packed into
wgmma tiles. Two entry points on one CTA body: split-KV decode (merge=True: the whole op, a sequence's last split
merging the others' partials; merge=False: stage 1, writing the partial buffers of `kernels/decode_attention.py`'s
Triton merge) and two-stage extend (prefix from the pool, new tokens contiguous, causal, one pass).

DeepSeek's absorbed attention reads one 576-wide latent head per key (K = all 576 dims, V = its first 512; the
half-size variant 288 / 256) for every q head. One CTA = one sequence x (decode) one split of its keys x one block of
up to 64 rows, a row being a (query token, q head) pair, token-major (16 heads x 1 token pad to 64 wgmma rows; 16
heads x 4 tokens fill them), three warpgroups:

* warpgroup 2 (producer, 40 registers) copies the block's Q rows (rows past them zero-filled), then gathers the
  CTA's latent rows into a ring of [64, width] tiles (`LatentShape`: 2 deep at 576, 4 at 288), from the pool through
  kv_indices or (extend) from the new tokens' rows: 16-byte `cp.async` copies straight into the 128-byte-swizzled
  layout wgmma reads (`issue_rows` of the extend kernel), rows past the range zero-filled.
* warpgroup 0 computes S = Q K^T over all the latent dims, the online softmax (base 2, the scale folded into the
  exponent's FMA), and O's first half of V's columns += P V with P from registers; it hands P (bf16 or f16) to
  warpgroup 1 through the tile's rope columns (read by nothing after S) and each row's rescale factor alpha through
  shared memory.
* warpgroup 1 rescales its half of O by alpha and adds P V from the same K tile's other V columns.

So each key's latent row crosses HBM once for every row of the block, S is computed once, and the two 64 x 256 (or
128) f32 accumulators live in the two consumers' registers. Both consumers release a ring slot (two warpgroups' arrivals)
when their P V on it has completed; warpgroup 0 waits for warpgroup 1 to have read P and alpha before it writes the
next ones. At the end warpgroup 0 passes each row's output factor (1 / denominator, the sink folded in) the same way,
and each consumer stores its half of the output straight from registers to global memory (only the block's real
rows: the padding rows of a 16-row block are computed but never stored); decode's warpgroup 0 also stores the LSE.

`mla_decode_transposed_kernel` (one query token): the same decode with the keys as wgmma's M and the heads as N, one
consumer warpgroup (see its comment). Both can merge a sequence's splits themselves (merge=True: the last split waits
for the others' partials, which pass in their registers' order: at the barrier of a thread-block cluster made of the
splits, `cluster_sync`, up to `CLUSTER_MAX_SPLITS`; past it on a GMEM semaphore).

Decode over an fp8 latent cache (576 wide, f16 Q), on either tile: the producer copies each tile's fp8 rows into the
upper half of its ring slot and converts them there to f16 (`convert_fp8_tiles` of the extend kernel), one tile
ahead; the consumers are unchanged.

Decode's split geometry, index checks and empty rows follow `kernels/decode_attention.py` (the effective range under
a window, `per_split` keys per split in multiples of MIN_BLOCK_KV, ranges cut into kv_indices, slots outside the
pool read as slot 0, an empty split stores nothing, a row that sees no key of a split stores 0 and LSE -inf, NaN stays
NaN).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, scf, vector
import numpy as np

from jaxattn.kernels.extend_attention_mgpu import (
    LOG2E,
    READ_ONLY_REF,
    REGISTERS,
    SWIZZLE_BYTES,
    SWIZZLED,
    SWIZZLES,
    WARPGROUP,
    draft_bits_tile,
    global_address,
    arrive_barrier,
    check_fp8_tile,
    check_register_split,
    commit_copies,
    convert_fp8_tiles,
    init_barriers,
    issue_fp8_rows,
    issue_rows,
    online_softmax_tile,
    row_sources,
    scalar_value,
    thread_in_warpgroup,
    wait_barrier,
)

BLOCK_ROWS = 64  # wgmma's M: (token, head) rows per CTA
# 64-key tiles (P V's reduction axis; Mosaic's wgmma takes multiples of 64 at a 128-byte swizzle).
BLOCK_KV = 64


@dataclasses.dataclass(frozen=True)
class LatentShape:
    """One latent head shape the kernel takes: qk_dim = v_dim + a rope part of at most 64 dims.

    Rows sit in shared memory `width` wide (qk_dim rounded up to the 64-column swizzled tiles, the rest zeros). P has
    no buffer of its own: it goes through the K tile's columns v_dim..v_dim + 63 (the rope part and its zero
    padding), which only warpgroup 0's S = Q K^T reads (at 576 a separate 8 KB P buffer made the kernel exactly 227 KB,
    which failed to launch on the H200). `stages`: the ring's depth that fits beside Q in sm_90's 227 KB (576: Q 72 KB
    + 2 x 72 KB + 1 KB of rows and mbarriers = 217 KB; 288, 320 wide: 40 KB + 4 x 40 KB + 1 KB = 201 KB).

    block_kv: 64, or 32 (decode at 576, `DECODE_KV32`: a 4-deep ring of half tiles holds as many bytes, issued in
    smaller steps, so a tile's copies start sooner after the slot before it frees; Mosaic's wgmma reduces over
    multiples of 64 at a 128-byte swizzle, so these tiles take the 64-byte one, `SWIZZLED_64`). A 32-key tile's rope
    columns are 32 rows, not P's 64: P goes through a 4 KB buffer of its own (Q 72 KB + 4 x 36 KB + 4 KB + 1 KB =
    221 KB). Slower than 64-key tiles on the H100 (179e77b).
    """

    qk_dim: int
    v_dim: int
    stages: int
    block_kv: int = 64

    @property
    def swizzle(self) -> int:  # the ring's swizzle bytes: wgmma's reduction over keys needs 64-key tiles at 128
        return 128 if self.block_kv == 64 else 64

    @property
    def p_buffer(self) -> bool:  # P handed over in a buffer of its own (not the tile's rope columns)
        return self.block_kv != BLOCK_ROWS

    @property
    def width(self) -> int:
        return -(-self.qk_dim // 64) * 64

    @property
    def v_split(self) -> int:  # each consumer warpgroup's share of the V columns
        return self.v_dim // 2

    @property
    def rope_columns(self):
        return pl.ds(self.v_dim, 64)


SHAPES = {576: LatentShape(576, 512, stages=2), 288: LatentShape(288, 256, stages=4)}  # by qk_dim
DECODE_KV32 = LatentShape(576, 512, stages=4, block_kv=32)  # decode's 32-key tiles at 576 (`MgpuDecodeConfig.block_kv`)
LN2 = 0.6931471805599453


def _cdiv(x, d):
    return lax.div(x + (d - 1), d)


def store_rows(values, out, first, valid_rows, *, row_stride: int, first_scale: int, column0: int = 0,
               transposed: bool = False):
    """Stores rows r < valid_rows of `values` ([rows, cols] in the WGMMA layout, or [rows] in its row layout) to the
    flat GMEM buffer `out` (values' dtype), row r column c at element first * first_scale + r * row_stride + column0
    + c (int64 arithmetic), from registers. first, valid_rows: i32 scalars. No other element of `out` is written.
    transposed: `values` holds the rows as its columns ([cols, rows] in the WGMMA layout, or [rows] in its column
    layout: the transposed tile's output and LSE), stored the same way.

    [rows, cols] values go one register at a time (`register_stores`): a WGMMA register holds a row's consecutive
    columns, stored by one vector instruction (2 elements: half the instructions and L2 writes of element stores)."""
    two_d = len(values.shape) == 2
    layout = plgpu.Layout.WGMMA if two_d else plgpu.Layout.WGMMA.reduce(0 if transposed else 1)

    @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType(), plgpu.Layout.WG_SPLAT(()), plgpu.Layout.WG_SPLAT(())))
    def run(ctx, values, out, first, valid_rows):
        del ctx
        i64 = ir.IntegerType.get_signless(64)
        first, valid_rows = scalar_value(first), scalar_value(valid_rows)
        start = arith.addi(arith.muli(arith.extsi(i64, first), arith.constant(i64, first_scale)),
                           arith.constant(i64, column0))
        valid_rows = arith.extsi(i64, valid_rows)
        base = llvm.inttoptr(llvm.PointerType.get(1), global_address(out))

        def store(value, index):  # value: one element, or a register's elements of one row from column index[1]
            if transposed:  # (column, row) in two dimensions; one dimension: the row
                r = arith.index_cast(i64, index[1] if two_d else index[0])
                c = arith.index_cast(i64, index[0]) if two_d else arith.constant(i64, 0)
            else:
                r = arith.index_cast(i64, index[0])
                c = arith.index_cast(i64, index[1]) if two_d else arith.constant(i64, 0)
            valid = arith.cmpi(arith.CmpIPredicate.slt, r, valid_rows)
            at = arith.addi(start, arith.addi(arith.muli(r, arith.constant(i64, row_stride)), c))
            element = ir.VectorType(value.type).element_type if isinstance(value.type, ir.VectorType) else value.type
            branch = scf.IfOp(valid)
            with ir.InsertionPoint(branch.then_block):
                llvm.store(value, mgpu_utils.getelementptr(base, [at], element))
                scf.yield_([])

        if two_d and not transposed and register_stores(values, row_stride, first_scale, column0):
            for index, register in zip(values.layout.thread_idxs(values.shape), np.ndindex(values.registers.shape),
                                       strict=True):
                store(values.registers[register], index)
        else:
            values.foreach(store)

    run(values, out, first, valid_rows)


def register_stores(values, row_stride: int, first_scale: int, column0: int) -> bool:
    """Whether `store_rows` stores [rows, cols] `values` (the WGMMA layout) a register at a time: each register is a
    vector of n consecutive columns of a row from a multiple of n, so where every other term of the element offset
    is a multiple of n too, each vector store is aligned to its own size (the buffer's start is)."""
    register_type = values.registers.flat[0].type
    if not isinstance(register_type, ir.VectorType):
        return False
    n = ir.VectorType(register_type).shape[0]
    return all(term % n == 0 for term in (row_stride, first_scale, column0))


def online_softmax_start(rows: int, acc_shape, *, stats_axis: int):
    """(m, l, acc) before the first tile: m = -1e30 (finite: a row that sees no key of the CTA, e.g. later drafts
    only, keeps p = 0, alpha = 1), l = 0 per row, in the WGMMA layout reduced along `stats_axis` (1: rows are the
    accumulator's rows; 0: its columns, the transposed tile), and acc = 0 (WGMMA layout)."""
    stats = plgpu.Layout.WGMMA.reduce(stats_axis)
    return (plgpu.layout_cast(jnp.full((rows,), -1e30, jnp.float32), stats),
            plgpu.layout_cast(jnp.full((rows,), 0.0, jnp.float32), stats),
            plgpu.layout_cast(jnp.full(acc_shape, 0.0, jnp.float32), plgpu.Layout.WGMMA))


def inverse_sum(l_i):
    """1 / l per row; "no keys" is l == 0 exactly (acc is 0 then, so the row stays 0); NaN stays NaN."""
    return 1.0 / jnp.where(l_i == 0.0, 1.0, l_i)


def rows_lse(m_i, l_i):
    """The rows' natural-log LSE from the base-2 running max and sum; -inf for rows that saw no key."""
    return jnp.where(l_i == 0.0, -jnp.inf, (m_i + jnp.log2(jnp.where(l_i == 0.0, 1.0, l_i))) * LN2)


def head_values(values, r0, *, q_heads: int, transposed: bool = False):
    """f32[64] in the WGMMA row layout: row r's entry values[(r0 + r) % q_heads] ((token, head) rows, token-major,
    from row r0). values: f32[q_heads] in GMEM; r0: i32 scalar >= 0. transposed: f32[q_heads] in the column layout
    (the transposed tile's heads as its columns), column c's entry values[(r0 + c) % q_heads]."""
    rows, axis = (q_heads, 0) if transposed else (BLOCK_ROWS, 1)

    @plgpu.inline_mgpu(arg_types=(READ_ONLY_REF, plgpu.Layout.WG_SPLAT(())),
                       return_type=plgpu.ShapeDtypeStruct((rows,), jnp.float32, layout=plgpu.Layout.WGMMA.reduce(axis)))
    def run(ctx, values, r0):
        del ctx
        f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
        r0 = scalar_value(r0)
        base = llvm.inttoptr(llvm.PointerType.get(1), global_address(values))
        zeros = mgpu.FragmentedArray.splat(arith.constant(f32, 0.0), (rows,), layout=mgpu.WGMMA_LAYOUT.reduce((axis,)))

        def entry(_, index):
            row = arith.addi(r0, arith.index_cast(i32, index[0]))
            head = arith.remui(row, arith.constant(i32, q_heads))
            return llvm.load(f32, mgpu_utils.getelementptr(base, [head], f32))

        return zeros.foreach(entry, create_array=True)

    return run(values, r0)


def _register_width(register_type) -> int:
    """Elements in a register of this type (a vector's length, else 1)."""
    return ir.VectorType(register_type).shape[0] if isinstance(register_type, ir.VectorType) else 1


def _spilled_at(slot, i: int, width: int, slot_stride: int):
    """The element offset (i64) of this thread's register i (`width` elements) in spill slot `slot` (i32)."""
    i64 = ir.IntegerType.get_signless(64)
    in_slot = arith.muli(arith.addi(arith.constant(i64, i * WARPGROUP), arith.extui(i64, thread_in_warpgroup())),
                         arith.constant(i64, width))
    return arith.addi(arith.muli(arith.extsi(i64, slot), arith.constant(i64, slot_stride)), in_slot)


def _check_slot(registers, slot_stride: int):
    needed = registers.size * _register_width(registers.flat[0].type) * WARPGROUP
    if needed > slot_stride:
        raise ValueError(f"a spill slot of {slot_stride} elements; the warpgroup's registers need {needed}")


def spill_registers(values, out, slot, *, layout, slot_stride: int):
    """Stores each thread's registers of the f32 array `values` (in `layout`) to the flat f32 GMEM buffer `out`,
    register-major so that a warp's stores are contiguous: element j of register i of thread t at slot * slot_stride
    + (i * 128 + t) * w + j (w: the register's width; int64 arithmetic). `fill_registers` reads them back into the
    same layout. slot: i32 scalar."""

    @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType(), plgpu.Layout.WG_SPLAT(())))
    def run(ctx, values, out, slot):
        del ctx
        f32 = ir.F32Type.get()
        slot = scalar_value(slot)
        base = llvm.inttoptr(llvm.PointerType.get(1), global_address(out))
        _check_slot(values.registers, slot_stride)
        for i, register in enumerate(values.registers.flat):
            llvm.store(register, mgpu_utils.getelementptr(base, [_spilled_at(slot, i, _register_width(register.type),
                                                                              slot_stride)], f32))

    run(values, out, slot)


def _load_spilled(base, slot, i: int, register_type, slot_stride: int):
    """Register i of this thread from spill slot `slot` (base: the buffer's i64 address), through L2 (ld.relaxed.gpu:
    another CTA of the launch stored it, and an SM's L1 is not coherent with its stores)."""
    f32, i64 = ir.F32Type.get(), ir.IntegerType.get_signless(64)
    is_vector, width = isinstance(register_type, ir.VectorType), _register_width(register_type)
    address = arith.addi(base, arith.muli(_spilled_at(slot, i, width, slot_stride), arith.constant(i64, 4)))
    if width == 1:
        value = mgpu_utils.inline_ptx("ld.relaxed.gpu.global.f32 $0, [$1];", address, result_types=f32,
                                      has_side_effects=True)
        return vector.from_elements(register_type, [value]) if is_vector else value
    outs = ", ".join(f"${j}" for j in range(width))
    parts = mgpu_utils.inline_ptx(f"ld.relaxed.gpu.global.v{width}.f32 {{{outs}}}, [${width}];", address,
                                  result_types=[f32] * width, has_side_effects=True)
    return vector.from_elements(register_type, list(parts))


def fill_registers(src, slot, *, shape, layout, slot_stride: int):
    """What `spill_registers` stored at `slot` of `src`, as an f32 array of `shape` in `layout`."""

    @plgpu.inline_mgpu(arg_types=(READ_ONLY_REF, plgpu.Layout.WG_SPLAT(())),
                       return_type=plgpu.ShapeDtypeStruct(shape, jnp.float32, layout=layout))
    def run(ctx, src, slot):
        del ctx
        slot = scalar_value(slot)
        base = global_address(src)
        template = mgpu.FragmentedArray.splat(arith.constant(ir.F32Type.get(), 0.0), shape, layout=layout.to_mgpu())
        _check_slot(template.registers, slot_stride)
        registers = np.empty(template.registers.shape, dtype=object)
        for i, (index, register) in enumerate(np.ndenumerate(template.registers)):
            registers[index] = _load_spilled(base, slot, i, register.type, slot_stride)
        return mgpu.FragmentedArray(_registers=registers, _layout=template.layout, _is_signed=None)

    return run(src, slot)


def fold_spilled(acc, alpha, w, src, slot, *, slot_stride: int):
    """acc * alpha + o * w, o being the WGMMA-layout array `spill_registers` stored at `slot` of `src` (acc, alpha,
    w: f32 arrays of one shape in the WGMMA layout; alpha and w broadcast from per-row or per-column values). Each
    register of o is folded as it is loaded, so no second accumulator's worth of registers is live."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA, plgpu.Layout.WGMMA, READ_ONLY_REF,
                                  plgpu.Layout.WG_SPLAT(())),
                       return_type=plgpu.ShapeDtypeStruct(acc.shape, jnp.float32, layout=plgpu.Layout.WGMMA))
    def run(ctx, acc, alpha, w, src, slot):
        del ctx
        slot = scalar_value(slot)
        base = global_address(src)
        _check_slot(acc.registers, slot_stride)
        registers = np.empty(acc.registers.shape, dtype=object)
        for i, (index, register) in enumerate(np.ndenumerate(acc.registers)):
            o = _load_spilled(base, slot, i, register.type, slot_stride)
            registers[index] = arith.addf(arith.mulf(register, alpha.registers[index]),
                                          arith.mulf(o, w.registers[index]))
        return mgpu.FragmentedArray(_registers=registers, _layout=acc.layout, _is_signed=None)

    return run(acc, alpha, w, src, slot)


def publish_stores():
    """Orders the warpgroup's global stores before a semaphore signal that follows: each thread's stores fenced at
    GPU scope, then the warpgroup's barrier (the signal is one thread's)."""

    @plgpu.inline_mgpu()
    def run(ctx):
        del ctx
        mgpu_utils.inline_ptx("fence.acq_rel.gpu;", has_side_effects=True)
        mgpu_utils.warpgroup_barrier()

    run()


def cluster_sync(acquire_gpu: bool = False):
    """Every thread of the CTA arrives at the cluster's hardware barrier (release) and waits (acquire) until every
    thread of the cluster's other CTAs has arrived or exited: what a split's CTA stored and fenced before is then
    visible to its cluster peers. Every thread of every CTA must call it exactly once (the call is aligned: whole
    warps). acquire_gpu: a GPU-scope fence after the wait too, before loads of what the peers stored in GMEM."""

    @plgpu.inline_mgpu()
    def run(ctx):
        del ctx
        mgpu_utils.inline_ptx("barrier.cluster.arrive.release.aligned;", has_side_effects=True, convergent=True)
        mgpu_utils.inline_ptx("barrier.cluster.wait.acquire.aligned;", has_side_effects=True, convergent=True)
        if acquire_gpu:
            mgpu_utils.inline_ptx("fence.acq_rel.gpu;", has_side_effects=True)

    run()


# merge=True with 2 to this many splits a (sequence, head block): its splits are one thread-block cluster and meet at
# the cluster's hardware barrier (`cluster_sync`), so no GMEM semaphore, which XLA zeroes in a kernel of its own
# before every call (0.9 us and a launch gap at MLA on the H100: `experiments/bench_timeline.py`, RESULTS' thirty-second
# session). 8: the portable cluster size.
CLUSTER_MAX_SPLITS = 8


def check_merger_skew(merger_skew, merge: bool) -> None:
    """Refuses a merger_skew (`decode_cta`) that is not a whole number of keys >= 0, or one without merge=True (the
    split ranges of a Triton-merged call stay the Triton kernel's)."""
    if not isinstance(merger_skew, int) or merger_skew < 0 or (merger_skew and not merge):
        raise ValueError(f"merger_skew must be an int >= 0, and 0 unless merge=True; got {merger_skew!r} with "
                         f"merge={merge}")


def merge_waits(merge: bool, max_kv_splits: int) -> tuple[bool, bool]:
    """(waits, clustered) of a decode launch: whether a merging call's last split waits for the others' partials (one
    split: its CTA stores the result, nothing to wait for), and whether at its cluster's barrier (up to
    `CLUSTER_MAX_SPLITS` splits) rather than on a GMEM semaphore."""
    waits = merge and max_kv_splits > 1
    return waits, waits and max_kv_splits <= CLUSTER_MAX_SPLITS


def split_launch(max_kv_splits: int, clustered: bool, grid: tuple, grid_names: tuple) -> dict:
    """`plgpu.kernel`'s grid arguments for a split-KV decode: the splits axis ("splits") before `grid`, as a grid axis,
    or (clustered) as a thread-block cluster of max_kv_splits CTAs over a grid of `grid` (CUDA's grid then has the
    splits innermost, the cluster's one axis longer than 1)."""
    if clustered:
        return dict(grid=grid, grid_names=grid_names, cluster=(max_kv_splits,) + (1,) * len(grid),
                    cluster_names=("splits",) + tuple(f"cluster_{name}" for name in grid_names))
    return dict(grid=(max_kv_splits,) + grid, grid_names=("splits",) + grid_names)


CONSUMERS_BARRIER = 15  # the padded tile's two consumer warpgroups' named barrier (Mosaic takes 0 and 1-3)


def consumers_barrier():
    """The padded tile's two consumer warpgroups (warpgroups 0 and 1; every thread of both calls it) meet, their
    global stores fenced at GPU scope before and their later loads after, so what either stored or acquired before
    is visible to the other (and, through a semaphore signalled after, to other CTAs)."""

    @plgpu.inline_mgpu()
    def run(ctx):
        del ctx
        mgpu_utils.inline_ptx("fence.acq_rel.gpu;", has_side_effects=True)
        mgpu_utils.inline_ptx(f"bar.sync {CONSUMERS_BARRIER}, {2 * WARPGROUP};", has_side_effects=True)
        mgpu_utils.inline_ptx("fence.acq_rel.gpu;", has_side_effects=True)

    run()


def merge_weights(m, lse_s):
    """The Triton merge's (`decode_stage2_kernel`) step for one more split of natural-log LSE lse_s, from running max
    m: (new max, alpha for what is merged so far, w for the split). A -inf max adds nothing and gives no NaN; NaN
    passes on."""
    m_new = jnp.maximum(m, lse_s)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    return m_new, jnp.exp(m - m_safe), jnp.exp(lse_s - m_safe)


def nothing_merged(acc_shape, *, stats_dim: int):
    """(acc, running max, denominator) before any split is folded: 0, -inf, 0; acc in the WGMMA layout, the others
    along acc's `stats_dim` (0: the padded tile's rows, 1: the transposed tile's heads)."""
    stats = plgpu.Layout.WGMMA.reduce(1 - stats_dim)
    length = acc_shape[stats_dim]
    return (plgpu.layout_cast(jnp.full(acc_shape, 0.0, jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((length,), -jnp.inf, jnp.float32), stats),
            plgpu.layout_cast(jnp.full((length,), 0.0, jnp.float32), stats))


def merge_split_partial(merged, o_s, lse_s, *, stats_dim: int):
    """One split's normalised output o_s and LSE lse_s folded into merged = (acc, m, denom) (stats_dim: the axis of
    acc that m, denom and lse_s run along: 0 the padded tile's rows, 1 the transposed tile's heads)."""
    acc, m, denom = merged
    m_new, alpha, w = merge_weights(m, lse_s)
    acc = (acc * lax.broadcast_in_dim(alpha, acc.shape, [stats_dim])
           + o_s * lax.broadcast_in_dim(w, acc.shape, [stats_dim]))
    return acc, m_new, denom * alpha + w


def merge_spilled_partial(merged, src, slot, lse_s, *, stats_dim: int, slot_stride: int):
    """`merge_split_partial` with the split's output read from spill slot `slot` of `src` (`fold_spilled`)."""
    acc, m, denom = merged
    m_new, alpha, w = merge_weights(m, lse_s)
    acc = fold_spilled(acc, lax.broadcast_in_dim(alpha, acc.shape, [stats_dim]),
                       lax.broadcast_in_dim(w, acc.shape, [stats_dim]), src, slot, slot_stride=slot_stride)
    return acc, m_new, denom * alpha + w


def merged_result(merged, sink, *, stats_dim: int):
    """(o, lse) of the merged splits, as the Triton merge ends: the sink (natural-log logits along stats_dim, or None)
    joins the denominator only; no key (denominator exactly 0) gives 0 and LSE -inf (the sink's LSE with a sink);
    NaN stays NaN."""
    acc, m, denom = merged
    if sink is not None:
        m_safe = jnp.maximum(m, sink)
        m_safe = jnp.where(m_safe == -jnp.inf, 0.0, m_safe)  # no keys and a -inf sink: stays empty
        alpha = jnp.exp(m - m_safe)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [stats_dim])
        denom, m = denom * alpha + jnp.exp(sink - m_safe), m_safe
    has_keys = denom != 0.0
    safe = jnp.where(has_keys, denom, 1.0)
    o = acc * lax.broadcast_in_dim(1.0 / safe, acc.shape, [stats_dim])
    o = jnp.where(lax.broadcast_in_dim(has_keys, acc.shape, [stats_dim]), o, 0.0)
    return o, jnp.where(has_keys, m + jnp.log(safe), -jnp.inf)


# mbarriers (one 8-byte word each, after the 64 alpha floats): the ring's "tile landed" (128 producer cp.async
# arrivals) and "slot free" (256: every consumer thread, after its wgmma on the slot completed), Q landed (128), P
# ready (128: every thread of warpgroup 0, after its stores) and P free (128: warpgroup 1, after its loads). Plain
# mbarriers with per-thread arrivals and explicit phases, in the 1 KB block the alpha rows take anyway (Pallas
# allocates its barriers apart).
# --- A CTA's geometry: scalar arithmetic (jnp / lax on traced or concrete ints), shared with the CPU model of the
# kernel (tests/test_mla_kernel_model.py), which runs these functions on numpy values.

class DecodeCta(NamedTuple):
    kv_begin: Any  # the split's sequence: its first effective entry of kv_indices, and its effective length
    kv_len: Any
    split_start: Any  # the split's first key (in the effective range) and its key count
    split_len: Any
    steps: Any  # K tiles of the split
    full_steps: Any  # tiles [0, full_steps) run unmasked; [full_steps, steps) masked (`decode_visible`)
    nonempty_splits: Any  # the sequence's splits with keys: [0, nonempty_splits) (0: no key at all)


def decode_cta(kv_indptr, num_kv_splits, seq, split, *, capacity: int, sliding_window: int, max_kv_splits: int,
               min_block_kv: int, tokens: int, block_kv: int = BLOCK_KV, merger_skew: int = 0) -> DecodeCta:
    """Split `split` of sequence `seq` (kv_indptr, num_kv_splits: refs in the kernel, arrays in the model; both
    unchecked), as `kernels/decode_attention.py` cuts it: the range clamped into [0, capacity], a window's last W + 1
    keys, splits of per_split keys (a multiple of min_block_kv). merger_skew (keys, >= 0; merge=True): the last split
    with keys, which merges, starts that many keys early, taken from the split before it where that one keeps keys,
    so that split publishes its partial while the merger still streams (every split but the last is whole)."""
    kv_begin = jnp.clip(kv_indptr[seq], 0, capacity)
    kv_end = jnp.clip(kv_indptr[seq + 1], kv_begin, capacity)
    kv_len = kv_end - kv_begin
    if sliding_window >= 0:
        skipped = jnp.maximum(kv_len - (sliding_window + 1), 0)
        kv_begin, kv_len = kv_begin + skipped, kv_len - skipped
    n_splits = jnp.clip(num_kv_splits[seq], 1, max_kv_splits)
    per_split = _cdiv(_cdiv(kv_len, n_splits), min_block_kv) * min_block_kv
    split_start = split * per_split
    split_len = jnp.maximum(jnp.minimum(split_start + per_split, kv_len) - split_start, 0)
    nonempty_splits = jnp.where(kv_len > 0, _cdiv(kv_len, jnp.maximum(per_split, 1)), 0)
    if merger_skew:
        merger = nonempty_splits - 1
        skew = jnp.where((merger >= 1) & (per_split > merger_skew), merger_skew, 0)
        split_start = split_start - jnp.where(split == merger, skew, 0)
        split_len = split_len + jnp.where(split == merger, skew, 0) - jnp.where(split == merger - 1, skew, 0)
    steps = _cdiv(split_len, block_kv)
    # Tiles whose every key is in the split and (several tokens) before the drafts run unmasked.
    full_steps = lax.div(split_len, block_kv)
    if tokens > 1:
        before_drafts = jnp.maximum(kv_len - tokens - split_start, 0)
        full_steps = jnp.minimum(full_steps, lax.div(before_drafts, block_kv))
    return DecodeCta(kv_begin, kv_len, split_start, split_len, steps, full_steps, nonempty_splits)


def causal_draft_bits(first_draft, cols, rows, *, q_heads: int):
    """A verify step's causal draft mask (no tree: token t sees drafts 0..t) over a score tile whose first column is
    draft first_draft: 1 where column c's draft is at most row r's token. rows: each score's row among its sequence's
    (token, head) rows, token-major, so its token is rows // q_heads; draft d <= rows // q_heads iff d * q_heads <=
    rows (d an integer, rows >= 0). Computed, not loaded: no per-row words pass through memory."""
    return ((first_draft + cols) * q_heads <= rows).astype(jnp.int32)


def decode_visible(cta: DecodeCta, step, cols, tokens: int, draft_bits_of=None, block_kv: int = BLOCK_KV):
    """Tile `step`'s visible scores (cols: each score's column): keys inside the split and, with several tokens,
    keys before the drafts or drafts whose bit is set (draft_bits_of(first_draft): the tile's bits, whose first
    column is draft first_draft: `draft_bits_tile`, or `causal_draft_bits`)."""
    visible = step * block_kv + cols < cta.split_len
    if tokens > 1:
        first_draft = cta.split_start + step * block_kv - (cta.kv_len - tokens)  # < 0: a key before the drafts
        bits = draft_bits_of(first_draft)
        visible = visible & ((first_draft + cols < 0) | (bits != 0))
    return visible


class ExtendCta(NamedTuple):
    q_start: Any  # the sequence's first new token; the block's first row and its rows (<= 64) among the sequence's
    r0: Any  # (token, head) rows
    count: Any
    kv_begin: Any  # its listed prefix: first entry of kv_indices, length
    prefix: Any
    t_lo: Any  # the block's first and last tokens (of the sequence's new tokens)
    t_hi: Any
    pre_steps: Any  # tiles: [0, prefix // 64) whole prefix, [.., pre_steps) the partial one, then new-token tiles:
    full_new: Any  # [pre_steps, full_new) seen whole by every row, [full_new, steps) causal-masked
    steps: Any


def extend_cta(qo_indptr, kv_indptr, seq, block, *, tokens: int, capacity: int, max_extend_len: int,
               q_heads: int) -> ExtendCta:
    """Row block `block` of sequence `seq` (qo_indptr, kv_indptr: refs in the kernel, arrays in the model; unchecked):
    ranges clamped into the token rows and kv_indices, new tokens past max_extend_len not computed."""
    q_start = jnp.clip(qo_indptr[seq], 0, tokens)
    new = jnp.clip(jnp.minimum(qo_indptr[seq + 1], tokens) - q_start, 0, max_extend_len)
    kv_begin = jnp.clip(kv_indptr[seq], 0, capacity)
    prefix = jnp.clip(kv_indptr[seq + 1], kv_begin, capacity) - kv_begin
    r0 = block * BLOCK_ROWS  # the block's first row among the sequence's (token, head) rows
    count = jnp.clip(new * q_heads - r0, 0, BLOCK_ROWS)
    t_lo = lax.div(r0, q_heads)
    t_hi = lax.div(r0 + count - 1, q_heads)
    pre_steps = _cdiv(prefix, BLOCK_KV)
    steps = pre_steps + _cdiv(t_hi + 1, BLOCK_KV)  # prefix tiles, then new tiles up to the last token
    full_new = pre_steps + lax.div(t_lo + 1, BLOCK_KV)  # new tiles every row sees whole
    return ExtendCta(q_start, r0, count, kv_begin, prefix, t_lo, t_hi, pre_steps, full_new, steps)


def extend_tile_source(cta: ExtendCta, step):
    """(from_pool, first, count) of tile `step`: prefix keys kv_indices[first + r], or new tokens' rows first + r."""
    from_pool = step < cta.pre_steps
    first = jnp.where(from_pool, cta.kv_begin + step * BLOCK_KV, cta.q_start + (step - cta.pre_steps) * BLOCK_KV)
    count = jnp.where(from_pool, cta.prefix - step * BLOCK_KV, cta.t_hi + 1 - (step - cta.pre_steps) * BLOCK_KV)
    return from_pool, first, count


def extend_loops(cta: ExtendCta, prefix_mask, causal_mask):
    """The extend CTA's tile ranges in order, with the mask each takes (None: unmasked)."""
    return ((0, lax.div(cta.prefix, BLOCK_KV), None), (lax.div(cta.prefix, BLOCK_KV), cta.pre_steps, prefix_mask),
            (cta.pre_steps, cta.full_new, None), (cta.full_new, cta.steps, causal_mask))


def extend_prefix_visible(cta: ExtendCta, step, cols):
    """The prefix's last, partial tile: keys before the prefix's end."""
    return step * BLOCK_KV + cols < cta.prefix


def extend_causal_visible(cta: ExtendCta, step, cols, rows, q_heads: int):
    """A new-token tile: new key i is visible to the row (of token t) iff i <= t; rows: the tile's row indices."""
    return (step - cta.pre_steps) * BLOCK_KV + cols <= lax.div(cta.r0 + rows, q_heads)


def decode_rows_supported(rows_per_seq: int) -> bool:
    """Whether a sequence's tokens x q_heads rows pack into 64-row blocks: a multiple of 8 (Q's 8-row tiles), at most
    64 or a multiple of 64 (whole blocks)."""
    return rows_per_seq % 8 == 0 and (rows_per_seq <= BLOCK_ROWS or rows_per_seq % BLOCK_ROWS == 0)


def extend_heads_supported(q_heads: int) -> bool:
    """Whether the extend form takes q_heads heads: a multiple of 8, or a divisor of 64 (blocks of whole tokens)."""
    return q_heads % 8 == 0 or BLOCK_ROWS % q_heads == 0


def _barriers(stages: int):
    """(ready, free, q, p_ready, p_free, counts): the first index of each kind and every barrier's arrival count."""
    counts = (WARPGROUP,) * stages + (2 * WARPGROUP,) * stages + (WARPGROUP,) * 3
    return 0, stages, 2 * stages, 2 * stages + 1, 2 * stages + 2, counts


def _scratch(dtype, shape: LatentShape):
    counts = _barriers(shape.stages)[-1]
    transforms = SWIZZLES[shape.swizzle]
    return (
        # Q (a ring of one, for issue_rows), swizzled as the ring (wgmma takes one swizzle for both operands).
        plgpu.SMEM((1, BLOCK_ROWS, shape.width), dtype, transforms=transforms),
        plgpu.SMEM((shape.stages, shape.block_kv, shape.width), dtype, transforms=transforms),  # the latent rows' ring
        # P from warpgroup 0 to 1 where it has no rope columns to go through (32-key tiles).
        *((plgpu.SMEM((BLOCK_ROWS, shape.block_kv), dtype, transforms=transforms),) if shape.p_buffer else ()),
        # alpha per row (then the output factors), warpgroup 0 -> 1, and the mbarriers: one allocation (each is
        # aligned to 1 KB).
        plgpu.SMEM((BLOCK_ROWS + 2 * len(counts),), jnp.float32),
    )


def wait_ring_tile(bars, ready: int, stages: int, step):
    """Waits until ring tile `step` has landed (mbarrier ready + slot, phase by its use count); returns its slot."""
    slot = lax.rem(step, stages)
    wait_barrier(bars, ready + slot, lax.rem(lax.div(step, stages), 2))
    return slot


def _cta(q_ref, new_ref, pool_ref, kv_indices_ref, scoped, *, shape: LatentShape, scale_log2, steps, loops, tile_source,
         q_row0, q_count, store_out, sink=None, producer_done=None, early_masks=True):
    """One CTA's work (call inside `pl.when` of a non-empty CTA; every warpgroup runs it).

    q_ref: [rows, 1, qk_dim]; new_ref / pool_ref: [*, 1, qk_dim] (the producer's two row sources); steps: the K tiles;
    loops: ((start, end, mask), ...) covering [0, steps) in order, mask None (every key of the tile visible to every
    row) or mask(step) -> bool[64, 64] (WGMMA layout, visible scores); tile_source(step) -> (from_pool, first, count):
    the tile's rows first + r (r < count) of pool (through kv_indices) or new, zeros past count; q_row0, q_count: the
    block's Q rows of q_ref; store_out(wg, out, lse): warpgroup wg's [64, v_dim / 2] f32 output (normalised; wg 0:
    the first half of the columns) and, from warpgroup 0, f32[64] natural-log LSE rows (None from warpgroup 1; both
    consumer warpgroups call it, last, so it may hold a barrier of theirs); sink: f32[64] (WGMMA row
    layout), each row's natural-log sink logit joining its denominator, or None; producer_done: called last by the
    producer warpgroup (after its last copy), or None. early_masks: each masked tile's mask is computed before its S
    wgmma (a mask that gathers, e.g. draft words, overlapping it), else after it (a mask computed from indices alone:
    nothing of it lives across the wgmma, where the scores' registers do). An fp8 pool (every tile from it,
    f16 Q): the producer copies each tile's fp8 rows into the upper half of its ring slot and converts them there to
    f16 (`convert_fp8_tiles`, unscaled: the caller folds the scales into q and the output), its copies one tile ahead
    of its conversions.
    """
    if shape.p_buffer:
        q_smem, k_smem, p_smem, rows_and_bars = scoped
    else:
        (q_smem, k_smem, rows_and_bars), p_smem = scoped, None
    alpha_smem = rows_and_bars.at[pl.ds(0, BLOCK_ROWS)]
    ready, free, q_bar, p_ready, p_free, counts = _barriers(shape.stages)
    stages, v_split, rope, block_kv, swizzle = (shape.stages, shape.v_split, shape.rope_columns, shape.block_kv,
                                                shape.swizzle)

    def p_tile(slot):  # where P goes from warpgroup 0 to 1: the tile's rope columns (read by nothing after S), or
        return p_smem if p_smem is not None else k_smem.at[slot, :, rope]  # its own buffer
    bars = rows_and_bars.at[pl.ds(BLOCK_ROWS, 2 * len(counts))]
    wg = lax.axis_index("wg")
    dtype = q_smem.dtype
    init_barriers(bars, counts)
    wait_tile = functools.partial(wait_ring_tile, bars, ready, stages)

    @pl.when(wg == 0)
    def _scores():
        plgpu.set_max_registers(REGISTERS[2][0], action="increase")
        m_i, l_i, acc = online_softmax_start(BLOCK_ROWS, (BLOCK_ROWS, v_split), stats_axis=1)
        wait_barrier(bars, q_bar, 0)

        def step_fn(step, carry, mask=None):
            acc, m_i, l_i = carry
            visible = mask(step) if mask is not None and early_masks else None  # gathers overlap the wgmma below
            slot = wait_tile(step)

            def qk(s_ref):
                plgpu.wgmma(s_ref, q_smem.at[0], k_smem.at[slot].transpose((1, 0)))
                return s_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((BLOCK_ROWS, block_kv), jnp.float32))
            if mask is not None:
                s = jnp.where(mask(step) if visible is None else visible, s, -jnp.inf)
            p, acc, m_new, l_i, alpha = online_softmax_tile(s, acc, m_i, l_i, scale_log2)
            p16 = p.astype(dtype)
            # Warpgroup 1 has read the previous P and alpha (its arrival #step - 1 on P free).
            pl.when(step > 0)(lambda: wait_barrier(bars, p_free, lax.rem(step - 1, 2)))
            p_tile(slot)[...] = p16  # S = Q K^T has completed: the rope columns are free
            alpha_smem[...] = alpha
            arrive_barrier(bars, p_ready)

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, k_smem.at[slot, :, pl.ds(0, v_split)])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            arrive_barrier(bars, free + slot)
            return acc, m_new, l_i

        carry = (acc, m_i, l_i)
        for start, end, mask in loops:
            carry = lax.fori_loop(start, end, lambda i, c, mask=mask: step_fn(i, c, mask), carry)
        acc, m_i, l_i = carry
        if sink is not None:  # the sink joins the denominator only, in base 2 at the common max
            sink2 = sink * LOG2E
            m_f = jnp.maximum(m_i, sink2)
            alpha = jnp.exp2(m_i - m_f)
            l_i = l_i * alpha + jnp.exp2(sink2 - m_f)
            m_i = m_f
            factor = alpha / jnp.where(l_i == 0.0, 1.0, l_i)
        else:
            factor = inverse_sum(l_i)
        wait_barrier(bars, p_free, lax.rem(steps - 1, 2))
        alpha_smem[...] = factor  # for warpgroup 1's half
        arrive_barrier(bars, p_ready)
        store_out(0, acc * lax.broadcast_in_dim(factor, acc.shape, [0]), rows_lse(m_i, l_i))

    @pl.when(wg == 1)
    def _second_half():
        plgpu.set_max_registers(REGISTERS[2][0], action="increase")
        acc = plgpu.layout_cast(jnp.full((BLOCK_ROWS, v_split), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        def step_fn(step, acc):
            wait_barrier(bars, p_ready, lax.rem(step, 2))
            slot = wait_tile(step)
            alpha = plgpu.load(alpha_smem, layout=plgpu.Layout.WGMMA.reduce(1))
            p16 = plgpu.load(p_tile(slot), layout=plgpu.Layout.WGMMA)
            arrive_barrier(bars, p_free)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, k_smem.at[slot, :, pl.ds(v_split, v_split)])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            arrive_barrier(bars, free + slot)
            return acc

        acc = lax.fori_loop(0, steps, step_fn, acc)
        wait_barrier(bars, p_ready, lax.rem(steps, 2))
        factor = plgpu.load(alpha_smem, layout=plgpu.Layout.WGMMA.reduce(1))
        store_out(1, acc * lax.broadcast_in_dim(factor, acc.shape, [0]), None)

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(REGISTERS[2][1], action="decrease")
        stream_latent_tiles(q_ref, new_ref, pool_ref, kv_indices_ref, q_smem, k_smem, bars, q_row0=q_row0,
                            q_count=q_count, q_block_rows=BLOCK_ROWS, q_bar=q_bar, ready=ready, free=free,
                            stages=stages, steps=steps, tile_source=tile_source, block_kv=block_kv,
                            head_dim=shape.qk_dim, swizzle=swizzle)
        if producer_done is not None:
            producer_done()


def stream_latent_tiles(q_ref, new_ref, pool_ref, kv_indices_ref, q_smem, k_smem, bars, *, q_row0, q_count,
                        q_block_rows: int, q_bar: int, ready: int, free: int, stages: int, steps, tile_source,
                        block_kv: int, head_dim: int, swizzle: int, copies_first: bool = False,
                        addresses_per_tile: bool | None = None):
    """The producer warpgroup's work (both decode tiles, and extend): Q's q_block_rows rows by cp.async (rows past
    q_count zero-filled) into q_smem ([1, q_block_rows, width]) on mbarrier q_bar, then the CTA's `steps` latent tiles
    into the ring k_smem ([stages, block_kv, width]) on mbarriers ready + slot, each slot's previous tile first
    released on free + slot (explicit phases). tile_source(step) -> (from_pool, first, count) as `_cta` takes it. An fp8
    pool: each tile's rows copied into the upper half of its slot and converted there to f16 (q_smem's dtype),
    the copies stages - 1 tiles ahead of the conversions. copies_first: each step issues the copies of tile
    step + stages - 1 before converting tile `step` (their latency overlapping the conversion; the slot's release by
    the consumers is waited for first, so this suits consumers that finish a tile quickly: the transposed tile),
    else after it (the conversion never waits for the consumers: the padded tile's two busy warpgroups).
    addresses_per_tile: the fp8 copies' and conversion's (`fp8_step_thread`; None: `FP8_ADDRESSES_PER_TILE`)."""
    from_q = q_count < 0  # a traced False: rows first + r of q
    q_rows = row_sources(kv_indices_ref, from_q, q_row0, q_count, block_kv=q_block_rows, pool_rows=q_ref.shape[0])
    issue_rows(q_ref, q_ref, q_smem, bars, q_rows, from_q, jnp.int32(0), jnp.int32(q_bar), jnp.int32(0),
               block_kv=q_block_rows, head_dim=head_dim, swizzle=swizzle)

    def sources_of(step):
        from_pool, first, count = tile_source(step)
        return row_sources(kv_indices_ref, from_pool, first, count, block_kv=block_kv, pool_rows=pool_ref.shape[0])

    def wait_free(step, slot):  # the slot's previous tile (step - stages) released by every consumer thread
        pl.when(step >= stages)(lambda: wait_barrier(bars, free + slot, lax.rem(lax.div(step, stages) - 1, 2)))

    if jnp.dtype(pool_ref.dtype).itemsize == 1:  # fp8: copies stages - 1 tiles ahead of the conversions
        def start(step, sources):
            @pl.when(step < steps)
            def _():
                slot = lax.rem(step, stages)
                wait_free(step, slot)
                issue_fp8_rows(pool_ref, k_smem, sources, slot, jnp.int32(0), block_kv=block_kv, head_dim=head_dim,
                               swizzle=swizzle, addresses_per_tile=addresses_per_tile)
            commit_copies()

        def fp8_step(step, sources):
            # sources: tile step + stages - 1's, loaded an iteration ahead (as the 16-bit loop's), so the load of
            # kv_indices, queued behind the copies' traffic, overlaps the conversion instead of delaying the copies.
            if copies_first:
                start(step + (stages - 1), sources)
            next_sources = sources_of(step + stages)
            slot = lax.rem(step, stages)
            # Tile step's copies are its cp.async group; the groups of the tiles after it issued so far may fly on.
            convert_fp8_tiles(((k_smem, ready + slot, None),), bars, slot, block_kv=block_kv, head_dim=head_dim,
                              fp8_dtype=pool_ref.dtype, dtype=q_smem.dtype,
                              wait_pending=stages - 1 if copies_first else stages - 2, swizzle=swizzle,
                              addresses_per_tile=addresses_per_tile)
            if not copies_first:
                start(step + (stages - 1), sources)
            return next_sources

        for ahead in range(stages - 1):
            start(jnp.int32(ahead), sources_of(jnp.int32(ahead)))
        lax.fori_loop(0, steps, fp8_step, sources_of(jnp.int32(stages - 1)))
        return

    # Each tile's rows are loaded from kv_indices two tiles ahead: tiles 0 and 1's loads fly together before the
    # first copy (one index round trip before the ring's first two tiles, not one before each), and later ones
    # overlap two tiles' waits and copies.
    def step_body(step, carried):
        sources, next_sources = carried
        after_next = sources_of(step + 2)
        slot = lax.rem(step, stages)
        wait_free(step, slot)
        from_pool = tile_source(step)[0]
        issue_rows(new_ref, pool_ref, k_smem, bars, sources, from_pool, slot, ready + slot, jnp.int32(0),
                   block_kv=block_kv, head_dim=head_dim, swizzle=swizzle)
        return next_sources, after_next

    lax.fori_loop(0, steps, step_body, (sources_of(jnp.int32(0)), sources_of(jnp.int32(1))))


def _check_v_scale(k_pool, v_scale) -> bool:
    """Whether k_pool is fp8, checking that v_scale (f32[1]) is given exactly then (both decode tiles)."""
    fp8 = jnp.dtype(k_pool.dtype).itemsize == 1
    if fp8 != (v_scale is not None) or (fp8 and (v_scale.shape != (1,) or v_scale.dtype != jnp.float32)):
        raise ValueError("v_scale (f32[1]) is given exactly when k_pool is fp8")
    return fp8


def _latent_shape(q, k_pool, k_new=None, fp8_pool=False, block_kv: int = BLOCK_KV) -> LatentShape:
    """The shape of the call's latent head (q [rows, 1, qk_dim] with qk_dim a key of SHAPES; block_kv 32: decode at
    576, `DECODE_KV32`), checked. fp8_pool: the pool may be e4m3fn / e5m2 with f16 q (rows whole 64-column tiles:
    576)."""
    qk_dim = q.shape[-1]
    if qk_dim not in SHAPES:
        raise ValueError(f"the latent head must be {sorted(SHAPES)} wide; got q {q.shape}")
    if block_kv not in (BLOCK_KV, DECODE_KV32.block_kv) or (block_kv != BLOCK_KV and qk_dim != DECODE_KV32.qk_dim):
        raise ValueError(f"block_kv must be {BLOCK_KV}, or {DECODE_KV32.block_kv} at {DECODE_KV32.qk_dim}; got "
                         f"{block_kv} at {qk_dim}")
    shape = SHAPES[qk_dim] if block_kv == BLOCK_KV else DECODE_KV32
    for name, array in (("q", q), ("k_pool", k_pool)) + ((("k_new", k_new),) if k_new is not None else ()):
        if array.ndim != 3 or array.shape[1:] != (1, qk_dim):
            raise ValueError(f"{name} must be [rows, 1, {qk_dim}]; got {array.shape}")
    if fp8_pool and jnp.dtype(k_pool.dtype).itemsize == 1:
        if q.dtype != jnp.float16 or jnp.dtype(k_pool.dtype) not in map(jnp.dtype, (jnp.float8_e4m3fn, jnp.float8_e5m2)):
            raise ValueError(f"an fp8 latent pool takes e4m3fn / e5m2 rows and f16 q; got {k_pool.dtype}, {q.dtype}")
        if shape.width != qk_dim:  # the in-place conversion needs rows of whole 64-column tiles
            raise ValueError(f"an fp8 latent pool takes 576-wide rows; got {qk_dim} (padded to {shape.width})")
        check_fp8_tile(shape.block_kv, qk_dim)
    elif k_pool.dtype != q.dtype or (k_new is not None and k_new.dtype != q.dtype):
        raise ValueError("q, k_pool (and k_new) must have one dtype")
    return shape


def mla_decode_mgpu_kernel(q, k_pool, kv_indptr, kv_indices, num_kv_splits, draft_words, sinks=None, *, tokens,
                           q_heads, sm_scale, max_kv_splits, sliding_window=-1, min_block_kv=32, v_scale=None,
                           block_kv=BLOCK_KV, merge=False, out_dtype=None, merger_skew=0):
    """Split-KV MLA decode. merge=False, stage 1: (mid_o f32[rows * max_kv_splits, 512], mid_lse f32[rows *
    max_kv_splits]) with rows = batch * tokens * q_heads in (sequence, token, head) order: row g's split s at g *
    max_kv_splits + s, the layout of `decode_stage1_kernel`'s MID_O / MID_LSE (f32[batch * tokens, q_heads,
    max_kv_splits, ...]) flattened. Entries of empty splits and of splits past a sequence's count are not written.
    merge=True, the whole op: (o [rows, 512] of out_dtype (default q's), lse f32[rows]), a block's splits merged by
    its last non-empty split as `mla_decode_transposed_kernel` merges them (each consumer warpgroup its half of the
    columns; the CTAs pass their partials through spill slots, a block's splits one cluster up to
    `CLUSTER_MAX_SPLITS`, else with a semaphore per (sequence, head block)); sinks
    (f32[q_heads], merge=True only) join each row's denominator there; merger_skew (merge=True only): the merging
    split's extra keys (`decode_cta`).

    q: [batch * tokens * q_heads, 1, qk_dim] bf16/f16 (rows in that order; qk_dim 576 or 288); k_pool: [slots, 1,
    qk_dim], q's dtype (V = each row's first 512 / 256 dims: mid_o's width); kv_indptr: i32[batch + 1]; kv_indices: i32/i64[capacity]; num_kv_splits: i32[batch]
    (clamped to [1, max_kv_splits]); draft_words: with several tokens (the sequence's last `tokens` keys are its
    drafts; keys before them are always visible), None for the causal mask (token t sees drafts 0..t, computed:
    `causal_draft_bits`) or i32[batch * tokens, 1], one word per (sequence, token) that its q_heads rows share: row g
    sees draft j iff bit j of word g // q_heads is set; None with one token. tokens * q_heads must be a multiple of 8
    and at most 64 or a multiple of 64.
    sliding_window W >= 0 (tokens == 1): only the last W + 1 listed keys. min_block_kv: split lengths are multiples
    of it (`jaxattn.metadata.MIN_BLOCK_KV`, as in the Triton stages).
    v_scale: f32[1] exactly when k_pool is fp8 (e4m3fn / e5m2, 576 wide; q f16, pre-multiplied by the K scale, which
    the kernel never sees): the rows are converted to f16 in shared memory (exact) and the stored outputs multiplied
    by v_scale. block_kv: the key tile, 64 or (576 only) 32 (`LatentShape.block_kv`).
    """
    shape = _latent_shape(q, k_pool, fp8_pool=True, block_kv=block_kv)
    fp8 = _check_v_scale(k_pool, v_scale)
    rows_total = q.shape[0]
    rows_per_seq = tokens * q_heads
    if not decode_rows_supported(rows_per_seq):
        raise ValueError(f"tokens * q_heads ({rows_per_seq}) must be a multiple of 8, at most {BLOCK_ROWS} or a "
                         f"multiple of {BLOCK_ROWS}")
    if draft_words is not None and tokens == 1:
        raise ValueError("draft_words takes several tokens a sequence (one token has no drafts)")
    if sliding_window >= 0 and tokens > 1:
        raise ValueError("a sliding window takes one query token per sequence")
    batch = kv_indptr.shape[0] - 1
    if batch * rows_per_seq != rows_total:
        raise ValueError(f"q has {rows_total} rows; batch {batch} x tokens {tokens} x q_heads {q_heads} = "
                         f"{batch * rows_per_seq}")
    if sinks is not None and not merge:
        raise ValueError("sinks are added by the merge: merge=True (or the Triton merge's sink argument)")
    check_merger_skew(merger_skew, merge)
    block_rows = min(rows_per_seq, BLOCK_ROWS)  # the CTA's real rows (static)
    head_blocks = rows_per_seq // block_rows
    capacity = kv_indices.shape[0]
    v_dim, v_split = shape.v_dim, shape.v_split
    waits, clustered = merge_waits(merge, max_kv_splits)
    rows_layout = plgpu.Layout.WGMMA.reduce(1)  # per-row values: m, l, LSE
    # merge=True: the partials pass between CTAs in their registers' order (`spill_registers`), two o slots (one per
    # consumer warpgroup's half) and one LSE slot (its per-thread copies, at most 64 a thread) per (sequence, head
    # block, split).
    o_slot, lse_slot = BLOCK_ROWS * v_split, WARPGROUP * BLOCK_ROWS
    slots = batch * head_blocks * max_kv_splits

    def body(kv_indptr_ref, kv_indices_ref, splits_ref, q_ref, k_pool_ref, words_ref, v_scale_ref, sinks_ref,
             mid_o_ref, mid_lse_ref, o_ref, lse_ref, scoped):
        split = lax.axis_index("splits")
        block = lax.axis_index("head_blocks")
        seq = lax.axis_index("seq")
        wg = lax.axis_index("wg")
        cta = decode_cta(kv_indptr_ref, splits_ref, seq, split, capacity=capacity, sliding_window=sliding_window,
                         max_kv_splits=max_kv_splits, min_block_kv=min_block_kv, tokens=tokens, block_kv=block_kv,
                         merger_skew=merger_skew)
        row0 = seq * rows_per_seq + block * block_rows  # the block's first row among all rows
        group = seq * head_blocks + block  # the (sequence, head block) whose splits merge together
        sems = pl.get_global(plgpu.SemaphoreType.REGULAR((batch * head_blocks,))) if waits and not clustered else None

        def mask(step):
            cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS, block_kv), 1, layout=plgpu.Layout.WGMMA)
            if tokens == 1:
                bits_of = None
            elif words_ref is None:  # causal drafts
                rows = block * block_rows + plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS, block_kv), 0,
                                                                   layout=plgpu.Layout.WGMMA)
                bits_of = functools.partial(causal_draft_bits, cols=cols, rows=rows, q_heads=q_heads)
            else:
                bits_of = lambda first_draft: draft_bits_tile(  # noqa: E731
                    words_ref, row0, first_draft, block_q=BLOCK_ROWS, block_kv=block_kv, rows_per_word=q_heads)
            return decode_visible(cta, step, cols, tokens, bits_of, block_kv=block_kv)

        first_out = row0 * max_kv_splits + split  # row g's split s sits at g * max_kv_splits + s

        def store_partial(half, out, lse):
            store_rows(out, mid_o_ref, first_out, jnp.int32(block_rows), row_stride=max_kv_splits * v_dim,
                       first_scale=v_dim, column0=half * v_split)
            if lse is not None:
                store_rows(lse, mid_lse_ref, first_out, jnp.int32(block_rows), row_stride=max_kv_splits, first_scale=1)

        def store_merged(half, merged):  # this half of the result (and from half 0 the LSE), the sinks joining
            sink = None if sinks_ref is None else head_values(sinks_ref, row0, q_heads=q_heads)
            o, lse = merged_result(merged, sink, stats_dim=0)
            store_rows(o.astype(o_ref.dtype), o_ref, row0, jnp.int32(block_rows), row_stride=v_dim, first_scale=v_dim,
                       column0=half * v_split)
            if half == 0:
                store_rows(lse, lse_ref, row0, jnp.int32(block_rows), row_stride=1, first_scale=1)

        def store_out(half, out, lse):  # `_cta`'s epilogue, in each consumer warpgroup (lse: warpgroup 0's)
            if v_scale_ref is not None:
                out = out * v_scale_ref[0]
            if not merge:
                store_partial(half, out, lse)
                return
            writers = cta.nonempty_splits - 1  # the splits before the block's last non-empty one
            slot = group * max_kv_splits + split
            if waits:
                # Clustered: each consumer warpgroup meets the cluster barrier once on either branch (a split with
                # keys is a writer or the merger).
                @pl.when(split != writers)
                def _publish():
                    @pl.when(split < writers)
                    def _():
                        spill_registers(out, mid_o_ref, 2 * slot + half, layout=plgpu.Layout.WGMMA,
                                        slot_stride=o_slot)
                        if lse is not None:
                            spill_registers(lse, mid_lse_ref, slot, layout=rows_layout, slot_stride=lse_slot)
                        consumers_barrier()  # both halves stored and fenced, then one signal
                        if lse is not None and not clustered:
                            plgpu.semaphore_signal(sems.at[group], 1, memory_scope="gpu")

                    if clustered:
                        cluster_sync()

            @pl.when(split == writers)
            def _merge():
                if lse is not None:  # warpgroup 1 reads this CTA's own LSE from its slot
                    spill_registers(lse, mid_lse_ref, slot, layout=rows_layout, slot_stride=lse_slot)
                    if waits and not clustered:
                        plgpu.semaphore_wait(sems.at[group], writers, memory_scope="gpu")
                if clustered:
                    cluster_sync(acquire_gpu=True)
                consumers_barrier()  # warpgroup 0's acquisition (and its LSE) passes to warpgroup 1
                own_lse = lse if lse is not None else fill_registers(mid_lse_ref, slot, shape=(BLOCK_ROWS,),
                                                                     layout=rows_layout, slot_stride=lse_slot)
                merged = merge_split_partial(nothing_merged(out.shape, stats_dim=0), out, own_lse, stats_dim=0)
                if waits:
                    def fold(s, merged):
                        other = group * max_kv_splits + s
                        lse_s = fill_registers(mid_lse_ref, other, shape=(BLOCK_ROWS,), layout=rows_layout,
                                               slot_stride=lse_slot)
                        return merge_spilled_partial(merged, mid_o_ref, 2 * other + half, lse_s, stats_dim=0,
                                                     slot_stride=o_slot)

                    merged = lax.fori_loop(0, writers, fold, merged)
                store_merged(half, merged)

        @pl.when(cta.split_len > 0)
        def _():
            _cta(q_ref, k_pool_ref, k_pool_ref, kv_indices_ref, scoped, shape=shape, scale_log2=float(sm_scale) * LOG2E,
                 steps=cta.steps, loops=((0, cta.full_steps, None), (cta.full_steps, cta.steps, mask)),
                 tile_source=lambda step: (cta.split_len > 0, cta.kv_begin + cta.split_start + step * block_kv,
                                           cta.split_len - step * block_kv),
                 q_row0=row0, q_count=jnp.int32(block_rows), store_out=store_out,
                 producer_done=cluster_sync if clustered else None, early_masks=words_ref is not None)

        if clustered:
            @pl.when(cta.split_len <= 0)
            def _():  # a split without keys: every warpgroup meets the cluster barrier once too
                cluster_sync()

        if merge:
            @pl.when((split == 0) & (cta.nonempty_splits == 0) & (wg == 0))
            def _no_keys():  # the block sees no key: 0 and LSE -inf (the sink's LSE with sinks), as merged
                store_merged(0, nothing_merged((BLOCK_ROWS, v_split), stats_dim=0))
                store_merged(1, nothing_merged((BLOCK_ROWS, v_split), stats_dim=0))

    def entry(kv_indptr_ref, kv_indices_ref, splits_ref, q_ref, k_pool_ref, *rest):
        words_ref, rest = (rest[0], rest[1:]) if draft_words is not None else (None, rest)
        v_scale_ref, rest = (rest[0], rest[1:]) if fp8 else (None, rest)
        sinks_ref, rest = (rest[0], rest[1:]) if sinks is not None else (None, rest)
        mid_o_ref, mid_lse_ref, o_ref, lse_ref = rest if merge else (*rest, None, None)
        pl.run_scoped(lambda *scoped: body(kv_indptr_ref, kv_indices_ref, splits_ref, q_ref, k_pool_ref, words_ref,
                                           v_scale_ref, sinks_ref, mid_o_ref, mid_lse_ref, o_ref, lse_ref, scoped),
                      *_scratch(q.dtype, shape), collective_axes="wg")

    if merge:
        partial_types = (jax.ShapeDtypeStruct((slots * 2 * o_slot,), jnp.float32),
                         jax.ShapeDtypeStruct((slots * lse_slot,), jnp.float32))
        result_types = (jax.ShapeDtypeStruct((rows_total, v_dim), out_dtype or q.dtype),
                        jax.ShapeDtypeStruct((rows_total,), jnp.float32))
    else:
        partial_types = (jax.ShapeDtypeStruct((rows_total * max_kv_splits, v_dim), jnp.float32),
                         jax.ShapeDtypeStruct((rows_total * max_kv_splits,), jnp.float32))
        result_types = ()
    outs = plgpu.kernel(
        entry,
        out_type=partial_types + result_types,
        **split_launch(max_kv_splits, clustered, (head_blocks, batch), ("head_blocks", "seq")),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(kv_indptr, kv_indices, num_kv_splits, q, k_pool, *(() if draft_words is None else (draft_words,)),
      *(() if v_scale is None else (v_scale,)), *(() if sinks is None else (sinks.astype(jnp.float32),)))
    return outs[2:] if merge else outs


# The transposed decode tile (`MgpuDecodeConfig(transposed=True)`, issue 22; one query token): the keys are wgmma's M
# and the block's (head) rows its N, so a tile's matrix work is the rows' own (16 heads: a quarter of the padded
# form's) and Q's buffer is N rows, not 64. One consumer warpgroup computes S^T = K Q^T [64 keys, N], the online
# softmax along the keys (axis 0; m, l per column), hands P to wgmma through a transposed view of a swizzled [N, 64]
# buffer, and accumulates O^T += V^T P^T [512, N] (32 N-wide wgmmas over V's 512 columns); the producer warpgroup
# fills a 2-deep ring of 64-key latent tiles as the padded form's does (`benchmarks/experiments/
# mla_transposed_lowering.py` lowered its pieces first). On the H100 (179e77b): 0.121 ms at MLA (16 heads x 4096 keys
# x 64 sequences) against the padded tile's 0.124 and FlashInfer's 0.118.
TRANSPOSED_STAGES = 2  # Q N x 576 (18 KB at 16 heads) + 2 x 72 KB + P and barriers: a third 72 KB tile does not fit
TRANSPOSED_QK_DIM = 576  # the latent head it takes (V: the first 512 columns, 8 wgmma M-blocks)
# The transposed tile's registers a thread (setmaxnreg), (consumer, producer), by whether the cache is fp8. Its two
# warpgroups launch with 232 a thread (`register_split_fits`), so the producer need not give its registers away as
# the padded tile's does beside two consumers. Over a 16-bit cache it only issues copies (40). Over fp8 it also
# converts every 64 x 576 tile, the tile's critical path: the padded tile's producer at 40 registers spilled 1228
# bytes doing so, its loop 812 instructions a tile with 112 local-memory loads; the same PTX given 224 registers
# compiles (ptxas 13, on the CPU) to a 598-instruction loop without one (RESULTS, thirty-sixth session): there it
# keeps 224.
TRANSPOSED_REGISTERS = {False: (232, 40), True: (232, 224)}

# The transposed tile's fp8 producer issues tile t + 1's copies before converting tile t (`stream_latent_tiles
# (copies_first=True)`): the copy waits for the slot's release, and then tile t's conversion waits behind it. False:
# the conversion first. Chosen by reading, not timed against each other (MLA-FP8 ~0.11 ms on H100 and H200 alike,
# not HBM-bound): `benchmarks/experiments/mla_fp8_order.py` times both.
TRANSPOSED_FP8_COPIES_FIRST = True


# At 64 heads Q's 72 KB beside the 144 KB ring, P and Mosaic's scratch passed the 227 KB of shared memory (the H100
# refused the launch: "invalid argument", 2026-12-05); 48 never ran; there the padded tile's M is mostly full anyway.
TRANSPOSED_MAX_ROWS = 32


def transposed_rows_supported(rows_per_seq: int) -> bool:
    """Rows (heads) per CTA the transposed tile takes: wgmma's N, whole 16-row groups of Q's copies, at most
    `TRANSPOSED_MAX_ROWS`."""
    return rows_per_seq % 16 == 0 and 0 < rows_per_seq <= TRANSPOSED_MAX_ROWS


def mla_decode_transposed_kernel(q, k_pool, kv_indptr, kv_indices, num_kv_splits, sinks=None, *, q_heads, sm_scale,
                                 max_kv_splits, sliding_window=-1, min_block_kv=32, merge=False, v_scale=None,
                                 out_dtype=None, merger_skew=0):
    """Split-KV MLA decode on the transposed tile, one query token per sequence. q: [batch * q_heads, 1, 576]
    bf16/f16; k_pool: [slots, 1, 576] of q's dtype, or fp8 (e4m3fn / e5m2) with f16 q and v_scale as
    `mla_decode_mgpu_kernel` takes them (the producer converts each tile to f16 in shared memory, `stream_latent_tiles`;
    each split's output times v_scale); q_heads (the tile's N) 16 or 32 (`transposed_rows_supported`); out_dtype: the
    merged output's dtype (default q's). The split geometry, index checks and empty rows are
    `mla_decode_mgpu_kernel`'s (`decode_cta`).

    merge=False: stage 1 only, (mid_o f32[rows * max_kv_splits, 512], mid_lse f32[rows * max_kv_splits]), the
    partial buffers the Triton merge takes. merge=True: the whole op, (o [rows, 512] of out_dtype, lse f32[rows]): a
    sequence's last non-empty split waits for the splits before it to publish their partials (each thread's
    registers, `spill_registers`), then folds them and its own in split order as the Triton merge does, and stores
    the result; a sequence without keys stores 0 and LSE -inf (from its split 0); sinks (f32[q_heads], merge=True
    only) add exp(sink) to each head's denominator as the Triton merge adds them. Up to `CLUSTER_MAX_SPLITS` splits
    the sequence's splits are one cluster and wait at its barrier (co-scheduled); past it, on a GMEM semaphore per
    sequence, where waiting only on lower block indices relies on CTAs being dispatched in block order (as split-K
    serial reductions do), so any grid size finishes. merger_skew (merge=True only): the merging split's extra keys
    (`decode_cta`)."""
    shape = _latent_shape(q, k_pool, fp8_pool=True)
    fp8 = _check_v_scale(k_pool, v_scale)
    if shape.qk_dim != TRANSPOSED_QK_DIM or not transposed_rows_supported(q_heads):
        raise ValueError(f"the transposed tile takes 576-wide latent rows and 16 or 32 q heads; got "
                         f"{shape.qk_dim}, {q_heads}")
    rows_total, width, v_dim = q.shape[0], shape.width, shape.v_dim
    batch = kv_indptr.shape[0] - 1
    if batch * q_heads != rows_total:
        raise ValueError(f"q has {rows_total} rows; batch {batch} x q_heads {q_heads} = {batch * q_heads}")
    rows, stages, capacity = q_heads, TRANSPOSED_STAGES, kv_indices.shape[0]
    consumer_registers, producer_registers = TRANSPOSED_REGISTERS[fp8]
    check_register_split(f"TRANSPOSED_REGISTERS[{fp8}] = {TRANSPOSED_REGISTERS[fp8]}",
                         (consumer_registers, producer_registers))
    scale_log2 = float(sm_scale) * LOG2E
    ready, free, q_bar = 0, stages, 2 * stages
    counts = (WARPGROUP,) * (2 * stages + 1)  # every barrier: one warpgroup's 128 arrivals
    if sinks is not None and not merge:
        raise ValueError("sinks are added by the merge: merge=True (or the Triton merge's sink argument)")
    check_merger_skew(merger_skew, merge)
    waits, clustered = merge_waits(merge, max_kv_splits)
    columns = plgpu.Layout.WGMMA.reduce(0)  # the tile's per-head (column) values: m, l, LSE

    def body(kv_indptr_ref, kv_indices_ref, splits_ref, q_ref, k_pool_ref, v_scale_ref, sinks_ref, mid_o_ref,
             mid_lse_ref, o_ref, lse_ref, scoped):
        q_smem, k_smem, p_smem, bars = scoped
        split, seq = lax.axis_index("splits"), lax.axis_index("seq")
        wg = lax.axis_index("wg")
        cta = decode_cta(kv_indptr_ref, splits_ref, seq, split, capacity=capacity, sliding_window=sliding_window,
                         max_kv_splits=max_kv_splits, min_block_kv=min_block_kv, tokens=1, merger_skew=merger_skew)
        row0 = seq * rows  # the sequence's first row (its heads) among all rows
        first_out = row0 * max_kv_splits  # row g's split s sits at g * max_kv_splits + s
        sems = pl.get_global(plgpu.SemaphoreType.REGULAR((batch,))) if waits and not clustered else None

        def store_partial(o, lse, at):  # the stage-1 partial of split `at`
            store_rows(o, mid_o_ref, first_out + at, jnp.int32(rows), row_stride=max_kv_splits * v_dim,
                       first_scale=v_dim, transposed=True)
            store_rows(lse, mid_lse_ref, first_out + at, jnp.int32(rows), row_stride=max_kv_splits, first_scale=1,
                       transposed=True)

        def store_merged(merged):  # the result and its LSE (the sinks joining), as the Triton merge ends
            sink = None if sinks_ref is None else head_values(sinks_ref, jnp.int32(0), q_heads=rows, transposed=True)
            o, lse = merged_result(merged, sink, stats_dim=1)
            store_rows(o.astype(o_ref.dtype), o_ref, row0, jnp.int32(rows), row_stride=v_dim, first_scale=v_dim,
                       transposed=True)
            store_rows(lse, lse_ref, row0, jnp.int32(rows), row_stride=1, first_scale=1, transposed=True)

        @pl.when(cta.split_len > 0)
        def _():
            init_barriers(bars, counts)
            wait_tile = functools.partial(wait_ring_tile, bars, ready, stages)

            @pl.when(wg == 0)
            def _consumer():
                plgpu.set_max_registers(consumer_registers, action="increase")
                m_i, l_i, acc = online_softmax_start(rows, (v_dim, rows), stats_axis=0)  # per column
                wait_barrier(bars, q_bar, 0)

                def step_fn(step, carry, masked):
                    acc, m_i, l_i = carry
                    slot = wait_tile(step)

                    def qk(s_ref):
                        plgpu.wgmma(s_ref, k_smem.at[slot], q_smem.at[0].transpose((1, 0)))
                        return s_ref[...]

                    s = pl.run_scoped(qk, plgpu.ACC((BLOCK_KV, rows), jnp.float32))  # S^T: keys x rows
                    if masked:  # the split's last, partial tile: keys past its end hidden
                        keys = plgpu.broadcasted_iota(jnp.int32, (BLOCK_KV, rows), 0, layout=plgpu.Layout.WGMMA)
                        s = jnp.where(step * BLOCK_KV + keys < cta.split_len, s, -jnp.inf)
                    p, acc, m_new, l_i, _ = online_softmax_tile(s, acc, m_i, l_i, scale_log2, keys_axis=0)
                    p_smem.transpose((1, 0))[...] = p.astype(p_smem.dtype)  # the previous P V has completed
                    plgpu.commit_smem()  # the generic stores, then wgmma's reads through the async proxy

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, k_smem.at[slot, :, pl.ds(0, v_dim)].transpose((1, 0)),
                                    p_smem.transpose((1, 0)))

                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                    arrive_barrier(bars, free + slot)
                    return acc, m_new, l_i

                carry = (acc, m_i, l_i)
                carry = lax.fori_loop(0, cta.full_steps, lambda i, c: step_fn(i, c, False), carry)
                acc, m_i, l_i = lax.fori_loop(cta.full_steps, cta.steps, lambda i, c: step_fn(i, c, True), carry)
                o = acc * lax.broadcast_in_dim(inverse_sum(l_i), acc.shape, [1])
                if v_scale_ref is not None:  # every split's output alike: the merge's weighted sum carries it
                    o = o * v_scale_ref[0]
                lse = rows_lse(m_i, l_i)
                if not merge:
                    store_partial(o, lse, split)
                    return
                writers = cta.nonempty_splits - 1  # the splits before the sequence's last non-empty one

                if waits:
                    # Clustered: this warpgroup meets the cluster barrier once on either branch (a split with keys
                    # is a writer or the merger).
                    @pl.when(split != writers)
                    def _publish():
                        @pl.when(split < writers)
                        def _():
                            slot = seq * max_kv_splits + split
                            spill_registers(o, mid_o_ref, slot, layout=plgpu.Layout.WGMMA, slot_stride=o_slot)
                            spill_registers(lse, mid_lse_ref, slot, layout=columns, slot_stride=lse_slot)
                            publish_stores()
                            if not clustered:
                                plgpu.semaphore_signal(sems.at[seq], 1, memory_scope="gpu")

                        if clustered:
                            cluster_sync()

                @pl.when(split == writers)
                def _merge():
                    merged = nothing_merged((v_dim, rows), stats_dim=1)
                    if waits:
                        if clustered:
                            cluster_sync(acquire_gpu=True)
                        else:
                            plgpu.semaphore_wait(sems.at[seq], writers, memory_scope="gpu")

                        def fold(s, merged):
                            slot = seq * max_kv_splits + s
                            lse_s = fill_registers(mid_lse_ref, slot, shape=(rows,), layout=columns,
                                                   slot_stride=lse_slot)
                            return merge_spilled_partial(merged, mid_o_ref, slot, lse_s, stats_dim=1,
                                                         slot_stride=o_slot)

                        merged = lax.fori_loop(0, writers, fold, merged)
                    store_merged(merge_split_partial(merged, o, lse, stats_dim=1))

            @pl.when(wg == 1)
            def _producer():
                plgpu.set_max_registers(producer_registers, action="decrease")
                stream_latent_tiles(
                    q_ref, k_pool_ref, k_pool_ref, kv_indices_ref, q_smem, k_smem, bars, q_row0=row0,
                    q_count=jnp.int32(rows), q_block_rows=rows, q_bar=q_bar, ready=ready, free=free, stages=stages,
                    steps=cta.steps, tile_source=lambda step: (cta.split_len > 0, cta.kv_begin + cta.split_start
                                                               + step * BLOCK_KV, cta.split_len - step * BLOCK_KV),
                    block_kv=BLOCK_KV, head_dim=width, swizzle=SWIZZLE_BYTES,
                    copies_first=TRANSPOSED_FP8_COPIES_FIRST,
                    addresses_per_tile=False)  # 224 registers hold them (`TRANSPOSED_REGISTERS`)
                if clustered:
                    cluster_sync()

        if clustered:
            @pl.when(cta.split_len <= 0)
            def _():  # a split without keys: both warpgroups meet the cluster barrier once too
                cluster_sync()

        if merge:
            @pl.when((split == 0) & (cta.nonempty_splits == 0) & (wg == 0))
            def _no_keys():  # the sequence sees no key: 0 and LSE -inf (the sink's LSE with sinks), as merged
                store_merged(nothing_merged((v_dim, rows), stats_dim=1))

    # merge=True: the partials pass between CTAs in their registers' order (`spill_registers`), one slot per
    # (sequence, split): o's v_dim x rows values, the LSE's per-thread copies (at most `rows` a thread).
    o_slot, lse_slot = v_dim * rows, WARPGROUP * rows
    partial_types = (jax.ShapeDtypeStruct((rows_total * max_kv_splits, v_dim), jnp.float32),
                     jax.ShapeDtypeStruct((batch * max_kv_splits * (lse_slot if merge else rows),), jnp.float32))
    result_types = (jax.ShapeDtypeStruct((rows_total, v_dim), out_dtype or q.dtype),
                    jax.ShapeDtypeStruct((rows_total,), jnp.float32))

    def entry(kv_indptr_ref, kv_indices_ref, splits_ref, q_ref, k_pool_ref, *refs):
        v_scale_ref, refs = (refs[0], refs[1:]) if fp8 else (None, refs)
        sinks_ref, refs = (refs[0], refs[1:]) if sinks is not None else (None, refs)
        mid_o_ref, mid_lse_ref, o_ref, lse_ref = refs if merge else (*refs, None, None)
        pl.run_scoped(lambda *scoped: body(kv_indptr_ref, kv_indices_ref, splits_ref, q_ref, k_pool_ref, v_scale_ref,
                                           sinks_ref, mid_o_ref, mid_lse_ref, o_ref, lse_ref, scoped),
                      plgpu.SMEM((1, rows, width), q.dtype, transforms=SWIZZLED),  # Q (a ring of one, for issue_rows)
                      plgpu.SMEM((stages, BLOCK_KV, width), q.dtype, transforms=SWIZZLED),  # the latent rows' ring
                      plgpu.SMEM((rows, BLOCK_KV), q.dtype, transforms=SWIZZLED),  # P, stored through its transpose
                      plgpu.SMEM((2 * len(counts),), jnp.int32),  # the mbarriers (8 bytes each)
                      collective_axes="wg")

    outs = plgpu.kernel(
        entry,
        out_type=partial_types + (result_types if merge else ()),
        **split_launch(max_kv_splits, clustered, (batch,), ("seq",)),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(kv_indptr, kv_indices, num_kv_splits, q, k_pool, *(() if v_scale is None else (v_scale,)),
      *(() if sinks is None else (sinks.astype(jnp.float32),)))
    return outs[2:] if merge else outs


def mla_extend_mgpu_kernel(q, k_new, k_pool, qo_indptr, kv_indptr, kv_indices, out_ref, *, q_heads, sm_scale,
                           max_extend_len, sinks=None):
    """Causal two-stage MLA extend in one pass; writes `out_ref` in place (rows it does not compute stay as they were).

    q: [tokens * q_heads, 1, qk_dim] bf16/f16 ((token, head) rows, token-major; qk_dim 576 or 288); k_new: [tokens,
    1, qk_dim] (the new tokens' latent rows, q's dtype); k_pool: [slots, 1, qk_dim]; qo_indptr, kv_indptr: i32[batch + 1] (sequence b's new tokens
    and listed prefix slots; its token t sees the whole prefix and its new tokens 0..t); kv_indices: i32/i64[capacity];
    out_ref: a Ref [tokens * q_heads, v_dim] of q's dtype (512 / 256). Tokens past max_extend_len of a sequence are not computed
    (as in the Triton kernels). sinks: f32[q_heads] natural-log logits joining the denominators, or None.
    Ranges are cut into kv_indices and the token rows, slots outside the pool read as slot 0.
    """
    shape = _latent_shape(q, k_pool, k_new)
    v_dim, v_split = shape.v_dim, shape.v_split
    tokens = k_new.shape[0]
    if q.shape[0] != tokens * q_heads:
        raise ValueError(f"q has {q.shape[0]} rows; tokens {tokens} x q_heads {q_heads} = {tokens * q_heads}")
    if not extend_heads_supported(q_heads):
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of 8 or divide {BLOCK_ROWS}")
    batch = kv_indptr.shape[0] - 1
    capacity = kv_indices.shape[0]
    blocks = -(-max_extend_len * q_heads // BLOCK_ROWS)

    def body(qo_indptr_ref, kv_indptr_ref, kv_indices_ref, q_ref, k_new_ref, k_pool_ref, sinks_ref, out_gmem, scoped):
        block = lax.axis_index("blocks")
        seq = lax.axis_index("seq")
        cta = extend_cta(qo_indptr_ref, kv_indptr_ref, seq, block, tokens=tokens, capacity=capacity,
                         max_extend_len=max_extend_len, q_heads=q_heads)

        def prefix_mask(step):
            cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS, BLOCK_KV), 1, layout=plgpu.Layout.WGMMA)
            return extend_prefix_visible(cta, step, cols)

        def causal_mask(step):
            cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS, BLOCK_KV), 1, layout=plgpu.Layout.WGMMA)
            rows = plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS, BLOCK_KV), 0, layout=plgpu.Layout.WGMMA)
            return extend_causal_visible(cta, step, cols, rows, q_heads)

        q_row0 = cta.q_start * q_heads + cta.r0

        def store_out(wg, out, lse):  # extend keeps no LSE
            del lse
            store_rows(out.astype(out_gmem.dtype), out_gmem, q_row0, cta.count, row_stride=v_dim, first_scale=v_dim,
                       column0=wg * v_split)

        # Each row's sink: its head's, sinks[(r0 + r) % q_heads].
        sink = None if sinks_ref is None else head_values(sinks_ref, cta.r0, q_heads=q_heads)

        @pl.when(cta.count > 0)
        def _():
            _cta(q_ref, k_new_ref, k_pool_ref, kv_indices_ref, scoped, shape=shape, scale_log2=float(sm_scale) * LOG2E,
                 steps=cta.steps, loops=extend_loops(cta, prefix_mask, causal_mask),
                 tile_source=lambda step: extend_tile_source(cta, step), q_row0=q_row0, q_count=cta.count,
                 store_out=store_out, sink=sink)

    def entry(qo_indptr_ref, kv_indptr_ref, kv_indices_ref, q_ref, k_new_ref, k_pool_ref, *rest):
        (sinks_ref, out_gmem) = rest if sinks is not None else (None, rest[0])
        pl.run_scoped(lambda *scoped: body(qo_indptr_ref, kv_indptr_ref, kv_indices_ref, q_ref, k_new_ref, k_pool_ref,
                                           sinks_ref, out_gmem, scoped),
                      *_scratch(q.dtype, shape), collective_axes="wg")

    plgpu.kernel(
        entry,
        out_type=(),
        grid=(blocks, batch),
        grid_names=("blocks", "seq"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(qo_indptr, kv_indptr, kv_indices, q, k_new, k_pool, *(() if sinks is None else (sinks,)), out_ref)
