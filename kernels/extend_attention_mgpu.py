"""Extend attention for Hopper as a Pallas Mosaic GPU kernel: warp-specialised, paged K/V by cp.async, wgmma.

The FlashAttention-3 schedule (the structure of JAX's `pallas/ops/gpu/attention_mgpu.py`), made ragged and paged
for serving: one CTA = 2 * block_q new tokens of one sequence x one q head (for short extends block_q tokens x two
q heads of one kv head, `heads_per_cta`; at 64-dim heads optionally 3 * block_q tokens, `consumers`), three
warpgroups (four with three consumers):

* the last warpgroup (producer, 40 registers; 24 beside three consumers) streams the sequence's K/V tiles into a
  `stages`-deep ring of shared memory: first the cached prefix, row by row from the pool through kv_indices, then the
  new tokens (k_new/v_new rows qo_indptr[b]:...), up to the CTA's last query row (causal). Hopper's TMA cannot gather
  single rows, so for prefix tiles each of the 128 producer threads issues 16-byte `cp.async` copies straight into the
  128-byte-swizzled layout wgmma reads (8 threads per 128-byte row segment: coalesced), and a
  `cp.async.mbarrier.arrive.noinc` per thread completes the tile's mbarrier when its copies land; the slots of the
  next tile are loaded while the current one is issued. New-token tiles are contiguous: TMA loads them when the arrays
  allow (`tma_new_tiles`), cp.async otherwise and for a tile that reaches past the batch's last token (its rows past
  it are zero-filled). Lists of whole pages (`page_rows`): a prefix tile wholly inside the prefix is a few runs of
  consecutive slots, one TMA copy per page (or per tile's rows of a larger page), completing a barrier that expects
  one arrival per copy.
* warpgroups 0 and 1 (consumers, 232 registers; 0-2 with 160 each at 64-dim heads) each own block_q query rows: S = Q
  K^T and O += P V with wgmma (P stays in registers), online softmax in base 2 with the scale folded into the
  exponent's FMA. A shared "schedule" barrier alternates two consumers' matrix work, so one warpgroup's softmax runs
  while the other's wgmma does. Three consumers run without it, optionally (`overlap`) each issuing its next tile's
  S = Q K^T before this tile's softmax on runs of unmasked tiles (FlashAttention-3's intra-warpgroup overlap).

Tiles that cross the end of the prefix or the causal diagonal are masked; the others run unmasked. New-key tiles
start on the 8-row grid the Q tiles use (Mosaic's TMA for Q/O needs provably 8-aligned rows): a tile may hold rows of
the previous or next sequence; their scores are masked and rows past the batch's tokens are copied as zeros, so V
rows that meet p = 0 are finite. The last, partial q tile of a sequence is stored through a ladder of power-of-2 TMA
stores, so no row of another sequence is overwritten. Shapes: see `extend_attention_mgpu_kernel`.

Features, each a static flag that adds code only when on: a sliding window (the CTA's K/V steps start at the tile
its first query row's window reaches, `window_first_step`; producer and consumers count ring uses and cp.async
phases from that step; tiles reaching below a warpgroup's window are masked per row), a soft cap (tanh.approx.f32
before the mask, cap * log2(e) folded into the exponent's FMA), attention sinks (folded into the denominator at
the end), xai temperature (a per-row factor of the exponent's scale, computed once per warpgroup), non-causal
calls (every CTA takes the sequence's whole prefix and all its new keys; tiles holding another sequence's keys are
masked) and custom masks (SGLang's flat byte mask, e.g. a speculative draft tree: the non-causal schedule, each
masked tile's entries gathered into the accumulator's layout by `custom_mask_tile`; with a window too). q/k and v
head dims may differ (192/128): O then goes through its own buffer. At 256/256 a partial q tile is stored through a
64-column buffer in four chunks (a whole-width one would not fit beside Q and the ring).

fp8 pools (`kv_scales`): the producer copies a pool tile's fp8 rows into staging tiles of their own (`fp8_staging`,
where shared memory has room) or into the upper half of its 16-bit ring slot, and converts them into the slot as the
16-bit tile (`convert_fp8_tiles`), a tile (staged) or stages - 1 tiles (in the slot) ahead of the consumers. With
fp8_tiles="q_dtype" each value times its scale is rounded to q's dtype, and the consumers' work does not change. With
fp8_tiles="f16" (two-stage form) each value is converted exactly to f16 and nothing more (one instruction per two
values, a sixth of the scaled conversion's), the consumers multiply pool tiles against an f16 copy of their Q tile
and fold k_scale into those tiles' scores and v_scale into the accumulator once the pool tiles are done.

The unified form (`prefix_lens` given; no k_new/v_new): every key comes from the pool through one list per sequence,
all tiles by cp.async at fixed listed-key offsets from step 0, the CTA taking the tiles up to its last row's listed
position. Tiles every valid row of a warpgroup sees whole run unmasked, the others masked; the mask only replaces
invisible scores, and tiles past a row's last key are exact no-ops (p = 0, alpha = 1, from a finite m_init), so a
row's bits do not depend on where its sequence's prefix/new split falls, nor on its neighbours. Under a sliding
window (on uncut lists) the steps start at the tile the CTA's first row's window reaches: the tiles skipped hold no key
its rows see, so skipping them equals the exact no-ops they would be.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, nvvm, vector

LOG2E = 1.4426950408889634
COMPUTE_WARPGROUPS = 2  # consumer warpgroups of a CTA by default (`consumers`: 2 or 3)
# Registers per thread of each warpgroup kind, by consumers (the register file's 64K over 128 * (consumers + 1)
# threads): three consumers hold 64-dim heads' accumulators in 160 (FlashAttention-3's split for its 192-row tiles).
REGISTERS = {2: (232, 40), 3: (160, 24)}  # consumers -> (consumer, producer)
WARPGROUP = 128
REGISTER_FILE = 65536  # 32-bit registers of an sm_90 multiprocessor
SWIZZLE_BYTES = 128  # one swizzle atom row: 8 x 16-byte chunks; a tile of 8 rows is 1024 bytes
_SCALAR = plgpu.Layout.WG_SPLAT(())
# An inline function's view of a kernel input (pool, index list, mask) that it only reads. jax 0.12.1's Pallas refuses
# a kernel whose body may write an input passed as an array, and takes every RefType argument as written unless told
# (`write=False`); older releases have no such field and no such check.
READ_ONLY_REF = (plgpu.RefType(write=False) if "write" in {f.name for f in dataclasses.fields(plgpu.RefType)}
                 else plgpu.RefType())
_ROW_SOURCES = plgpu.Layout.WG_STRIDED((WARPGROUP,), vec_size=1)  # one i32 per producer thread
SWIZZLED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(SWIZZLE_BYTES))  # the K/V/Q tiles wgmma reads
SWIZZLED_8BIT = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(SWIZZLE_BYTES))  # fp8 rows, the same bytes
# 16-bit tiles with a 64-byte swizzle ((8, 32) tiles of 512 bytes): wgmma then reduces over multiples of 32, not 64
# (the MLA decode kernel's 32-key tiles).
SWIZZLED_64 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(64))
SWIZZLES = {SWIZZLE_BYTES: SWIZZLED, 64: SWIZZLED_64}  # 16-bit tiles by swizzle bytes


def register_split_fits(registers) -> bool:
    """Whether a CTA whose warpgroups set these registers per thread (setmaxnreg, one entry per warpgroup) can run.
    The launch gives each thread the most any warpgroup sets, capped by the register file's share rounded down to 8
    (ptxas' counts: 168 for three warpgroups setting 232 / 40, 232 for two setting 232 / 40), and setmaxnreg moves
    registers only within that: an increase waits until decreases have freed enough, so a split past the launch's
    total hangs the kernel (216 / 80 beside two consumers did on an H100: benchmarks/RESULTS.md, thirty-fifth session).
    setmaxnreg takes multiples of 8 in [24, 256]."""
    threads = WARPGROUP * len(registers)
    per_thread = min(REGISTER_FILE // threads, 255) // 8 * 8  # 255: a thread's most
    launched = min(per_thread, max(registers)) * threads
    return all(24 <= r <= 256 and r % 8 == 0 for r in registers) and WARPGROUP * sum(registers) <= launched


def check_register_split(table_entry: str, registers) -> None:
    """Raises at trace time unless `registers` (one entry per warpgroup) fits (`register_split_fits`), naming the table
    entry they come from ("REGISTERS[2] = (232, 40)")."""
    if not register_split_fits(registers):
        raise ValueError(f"{table_entry} does not fit one CTA's registers (`register_split_fits`): the kernel would "
                         f"hang")


def _cdiv(x, d: int):
    return lax.div(x + (d - 1), jnp.int32(d))


def _align8(x):
    """x rounded down to a multiple of 8, in a form Mosaic's divisibility analysis can see (a product by 8)."""
    return lax.div(x, jnp.int32(8)) * 8


# --- Low-level pieces (Mosaic GPU MLIR through plgpu.inline_mgpu): Pallas has no gather copy on Hopper. ---

def _i32(v):
    return arith.constant(ir.IntegerType.get_signless(32), v)


def _i64(v):
    return arith.constant(ir.IntegerType.get_signless(64), v)


def scalar_value(x):
    """A scalar argument of an inline_mgpu function as an ir.Value (Warpgroup semantics pass it as one already)."""
    return x.registers.item() if isinstance(x, mgpu.FragmentedArray) else x


def thread_in_warpgroup():
    """This thread's index in its warpgroup, i32."""
    return arith.remui(mgpu_utils.thread_idx(), _i32(WARPGROUP))


def _lane_ids(thread=None):
    """(warp in the warpgroup, lane) of this thread (or of `thread`, its index in the warpgroup), i32."""
    t = thread_in_warpgroup() if thread is None else thread
    return arith.divui(t, _i32(32)), arith.remui(t, _i32(32))


def global_address(memref_value):
    """The global-space address of a GMEM memref's first element, as an i64."""
    pointer = llvm.addrspacecast(llvm.PointerType.get(1), mgpu_utils.memref_ptr(memref_value))
    return llvm.ptrtoint(ir.IntegerType.get_signless(64), pointer)


def _barrier_ptr(bars, index):
    """Pointer to mbarrier `index` of `bars` (an i32 shared-memory buffer, 8 bytes per barrier)."""
    i64 = ir.IntegerType.get_signless(64)
    return mgpu_utils.getelementptr(mgpu_utils.memref_ptr(bars), [index], i64)


def init_barriers(bars, count):
    """One thread initialises every mbarrier of `bars` to expect `count` arrivals (an int, or one per barrier);
    then the whole CTA syncs."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def run(ctx, bars):
        del ctx
        n = ir.MemRefType(bars.type).shape[0] // 2
        counts = [count] * n if isinstance(count, int) else list(count)
        if len(counts) != n:
            raise ValueError(f"{len(counts)} arrival counts for {n} mbarriers")
        first = mgpu_utils.single_thread_predicate(mgpu_utils.ThreadSubset.BLOCK)
        for i, expected in enumerate(counts):
            nvvm.mbarrier_init(_barrier_ptr(bars, _i32(i)), _i32(expected), predicate=first)
        nvvm.fence_mbarrier_init()
        mgpu_utils.inline_ptx("bar.sync 0;", has_side_effects=True, convergent=True)  # every warpgroup passes here

    run(bars)


def wait_barrier(bars, index, parity):
    """Blocks until phase `parity` (0/1) of mbarrier `index` of `bars` has completed."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), _SCALAR, _SCALAR))
    def run(ctx, bars, index, parity):
        del ctx
        nvvm.mbarrier_try_wait_parity(_barrier_ptr(bars, scalar_value(index)), scalar_value(parity), _i32(10_000_000))

    run(bars, index, parity)


def arrive_barrier(bars, index):
    """This thread arrives (release) on mbarrier `index` of `bars` (one arrival of the count it was set up with)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), _SCALAR))
    def run(ctx, bars, index):
        del ctx
        mgpu_utils.inline_ptx("mbarrier.arrive.release.cta.shared::cta.b64 _, [$0];",
                              _barrier_ptr(bars, scalar_value(index)), has_side_effects=True)

    run(bars, index)


def row_sources(kv_indices, from_pool, first, count, *, block_kv: int, pool_rows: int):
    """The source row of each K/V tile row a producer thread will hand out (see `issue_rows`), as an i32[128]
    (thread t holds tile row (t // 32) * rows_per_warp + t % rows_per_warp): kv_indices[first + r] when from_pool (a
    slot outside the pool: the padding slot 0, as every kernel and the reference read it), else first + r; -1 for rows
    r >= count (copied as zeros).
    """
    rows_per_warp = block_kv // 4
    capacity = kv_indices.shape[0]

    @plgpu.inline_mgpu(arg_types=(READ_ONLY_REF, _SCALAR, _SCALAR, _SCALAR),
                       return_type=plgpu.ShapeDtypeStruct((WARPGROUP,), jnp.int32, layout=_ROW_SOURCES))
    def run(ctx, indices, from_pool, first, count):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        from_pool, first, count = scalar_value(from_pool), scalar_value(first), scalar_value(count)
        warp, lane = _lane_ids()
        row = arith.addi(arith.muli(warp, _i32(rows_per_warp)), arith.remui(lane, _i32(rows_per_warp)))
        position = arith.addi(first, row)
        listed = arith.cmpi(arith.CmpIPredicate.slt, row, count)
        # Always a valid address: the load happens for new-token tiles too (its value is then unused).
        safe = arith.maxsi(arith.minsi(position, _i32(capacity - 1)), _i32(0))
        index_type = ir.MemRefType(indices.type).element_type
        pointer = llvm.inttoptr(llvm.PointerType.get(1), global_address(indices))
        slot = llvm.load(index_type, mgpu_utils.getelementptr(pointer, [safe], index_type))
        # Checked before narrowing an int64 slot, so one past 2**32 cannot wrap into the pool.
        bound = _i64 if ir.IntegerType(index_type).width == 64 else _i32
        in_pool = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, slot, bound(0)),
                             arith.cmpi(arith.CmpIPredicate.slt, slot, bound(pool_rows)))
        slot = arith.select(in_pool, slot, bound(0))
        if ir.IntegerType(index_type).width == 64:
            slot = arith.trunci(i32, slot)
        source = arith.select(from_pool, slot, position)
        source = arith.select(listed, source, _i32(-1))
        return mgpu.FragmentedArray(
            _registers=np.array([vector.broadcast(ir.VectorType.get((1,), i32), source)], dtype=object),
            _layout=_ROW_SOURCES.to_mgpu(), _is_signed=True)

    return run(kv_indices, from_pool, first, count)


def custom_mask_tile(mask, mask_indptr, seq, row0, width, column0, *, block_q: int, block_kv: int):
    """The custom-mask entries of one score tile, gathered from GMEM into the wgmma accumulator's layout: an
    i32[block_q, block_kv] (WGMMA layout) of 0/1, entry (r, c) = mask[mask_indptr[seq] + (row0 + r) * width +
    column0 + c] != 0 (SGLang's flat row-major [q_len, kv_len] per sequence), 0 where that index is outside the mask.

    mask: bool/u8/i8[mask_len] (one byte an entry; mask_len >= 1; entries past the real mask are never read as
    visible: `mask_len` is the memref's length), mask_indptr: i32/i64[batch + 1]; seq, row0 (the tile's row 0 as a
    row of the sequence's mask, < 0 for rows of the previous sequence), width (the sequence's mask row length),
    column0 (the mask column of tile column 0): i32 scalars. Indices are computed in int64 (row * width passes 2^31
    on long sequences) and clamped into the mask before the load, so no metadata can make it read outside the
    buffer.
    """

    @plgpu.inline_mgpu(arg_types=(READ_ONLY_REF, READ_ONLY_REF) + (_SCALAR,) * 4,
                       return_type=plgpu.ShapeDtypeStruct((block_q, block_kv), jnp.int32, layout=plgpu.Layout.WGMMA))
    def run(ctx, mask, indptr, seq, row0, width, column0):
        del ctx
        i8, i32, i64 = (ir.IntegerType.get_signless(w) for w in (8, 32, 64))
        mask_len = ir.MemRefType(mask.type).shape[0]
        seq, row0, width, column0 = (arith.extsi(i64, scalar_value(x)) for x in (seq, row0, width, column0))
        index_type = ir.MemRefType(indptr.type).element_type
        start = llvm.load(index_type, mgpu_utils.getelementptr(
            llvm.inttoptr(llvm.PointerType.get(1), global_address(indptr)), [seq], index_type))
        if ir.IntegerType(index_type).width == 32:
            start = arith.extsi(i64, start)
        bytes_ = llvm.inttoptr(llvm.PointerType.get(1), global_address(mask))
        zeros = mgpu.FragmentedArray.splat(_i32(0), (block_q, block_kv), layout=mgpu.WGMMA_LAYOUT, is_signed=True)

        def entry(_, index):
            r, c = (arith.index_cast(i64, x) for x in index)
            at = arith.addi(arith.addi(start, arith.muli(arith.addi(row0, r), width)), arith.addi(column0, c))
            inside = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, at, _i64(0)),
                                arith.cmpi(arith.CmpIPredicate.slt, at, _i64(mask_len)))
            value = llvm.load(i8, mgpu_utils.getelementptr(bytes_, [arith.select(inside, at, _i64(0))], i8))
            visible = arith.andi(inside, arith.cmpi(arith.CmpIPredicate.ne, value, arith.constant(i8, 0)))
            return arith.extui(i32, visible)

        return zeros.foreach(entry, create_array=True, is_signed=True)

    return run(mask, mask_indptr, seq, row0, width, column0)


def draft_bits_tile(bits, row0, draft0, *, block_q: int, block_kv: int, rows_per_word: int = 1):
    """A compact tree mask's entries of one score tile, in the wgmma accumulator's layout: an i32[block_q, block_kv]
    (WGMMA layout) of 0/1, entry (r, c) = bit d % 32 of bits[(row0 + r) // rows_per_word, d // 32] with d = draft0 + c
    (the new key's index among its sequence's new tokens); 0 where that bits row is outside bits' rows or d outside
    [0, 32 * words).

    bits: i32[rows, words] (row i: the draft words of query rows i * rows_per_word ...: 1, one per query row; MLA's
    verify: q_heads, one per token); row0 (the tile's row 0 as a query row, >= 0), draft0: i32 scalars. The word
    index is clamped into the buffer before the load, so no argument makes it read outside.
    """

    @plgpu.inline_mgpu(arg_types=(READ_ONLY_REF,) + (_SCALAR,) * 2,
                       return_type=plgpu.ShapeDtypeStruct((block_q, block_kv), jnp.int32, layout=plgpu.Layout.WGMMA))
    def run(ctx, bits, row0, draft0):
        del ctx
        i32, i64 = (ir.IntegerType.get_signless(w) for w in (32, 64))
        rows, words = ir.MemRefType(bits.type).shape
        row0, draft0 = (arith.extsi(i64, scalar_value(x)) for x in (row0, draft0))
        base = llvm.inttoptr(llvm.PointerType.get(1), global_address(bits))
        zeros = mgpu.FragmentedArray.splat(_i32(0), (block_q, block_kv), layout=mgpu.WGMMA_LAYOUT, is_signed=True)

        def entry(_, index):
            r, c = (arith.index_cast(i64, x) for x in index)
            row, draft = arith.addi(row0, r), arith.addi(draft0, c)
            if rows_per_word > 1:  # (row0 >= 0: the quotient is the floor)
                row = arith.divsi(row, _i64(rows_per_word))
            inside = arith.andi(
                arith.andi(arith.cmpi(arith.CmpIPredicate.sge, row, _i64(0)), arith.cmpi(arith.CmpIPredicate.slt, row, _i64(rows))),
                arith.andi(arith.cmpi(arith.CmpIPredicate.sge, draft, _i64(0)),
                           arith.cmpi(arith.CmpIPredicate.slt, draft, _i64(32 * words))))
            at = arith.addi(arith.muli(row, _i64(words)), arith.divsi(draft, _i64(32)))
            word = llvm.load(i32, mgpu_utils.getelementptr(base, [arith.select(inside, at, _i64(0))], i32))
            shift = arith.trunci(i32, arith.remsi(arith.maxsi(draft, _i64(0)), _i64(32)))
            bit = arith.andi(arith.shrui(word, shift), _i32(1))
            return arith.select(inside, bit, _i32(0))

        return zeros.foreach(entry, create_array=True, is_signed=True)

    return run(bits, row0, draft0)


def issue_rows(new_ref, pool_ref, smem, bars, sources, from_pool, slot, barrier, kv_head, *, block_kv: int, head_dim: int,
               itemsize: int = 2, swizzle: int = SWIZZLE_BYTES):
    """Starts the cp.async copies of one K or V tile into ring slot `slot` of `smem` ([stages, block_kv, head_dim],
    tiled into 128-byte rows ((8, 64) for 16-bit elements, `SWIZZLED`; (8, 128) for 8-bit ones, `SWIZZLED_8BIT`),
    128-byte swizzled): tile row r <- row sources[r] (as `row_sources` lays them out) of pool_ref
    when from_pool, else of new_ref, head kv_head; zeros where the source is -1. Then each thread's
    `cp.async.mbarrier.arrive.noinc` on mbarrier `barrier` (which expects 128 arrivals) fires when its copies land.
    itemsize: bytes per element of the rows and of `smem` (2, or 1 for fp8 pools). swizzle: 128, or 64 (16-bit
    `SWIZZLED_64` tiles: each 128-byte span of a row is two 64-byte tiles' rows; rows of whole 128-byte spans only).

    Thread (warp w, lane l) copies the 16-byte chunk l % 8 of each 128-byte segment of rows w * rows_per_warp +
    4p + l // 8: 8 threads per contiguous segment, so each warp instruction reads 4 whole 128-byte lines.
    A head_dim that is not a multiple of 64 (MLA's 288) fills its last column tile partly: `smem`'s rows are
    head_dim rounded up to 64 wide, and the chunks past head_dim are written as zeros (nothing read for them).
    """
    rows_per_warp = block_kv // 4
    head_bytes = head_dim * itemsize
    segments = -(-head_bytes // SWIZZLE_BYTES)  # 128-byte column tiles per row
    last_chunks = head_bytes % SWIZZLE_BYTES // 16  # chunks of the last, partial tile (0: it is whole)
    kv_heads = new_ref.shape[1]
    row_bytes = kv_heads * head_bytes
    slot_bytes = block_kv * segments * SWIZZLE_BYTES
    transforms = {2: SWIZZLED, 1: SWIZZLED_8BIT}[itemsize]
    if swizzle != SWIZZLE_BYTES:
        if itemsize != 2 or last_chunks or swizzle not in SWIZZLES:
            raise ValueError(f"a {swizzle}-byte swizzle takes 16-bit rows of whole 128-byte spans; got {head_bytes} bytes")
        transforms = SWIZZLES[swizzle]

    @plgpu.inline_mgpu(arg_types=(READ_ONLY_REF, READ_ONLY_REF, plgpu.RefType(transforms), plgpu.RefType(),
                                  _ROW_SOURCES) + (_SCALAR,) * 4)
    def run(ctx, new, pool, smem, bars, sources, from_pool, slot, barrier, kv_head):
        del ctx
        i64 = ir.IntegerType.get_signless(64)
        from_pool, slot, barrier, kv_head = (scalar_value(x) for x in (from_pool, slot, barrier, kv_head))
        my_source = vector.extract(sources.registers.flat[0], [], [0])
        warp, lane = _lane_ids()
        chunk = arith.remui(lane, _i32(8))
        lane_row = arith.divui(lane, _i32(8))
        base = arith.select(from_pool, global_address(pool), global_address(new))
        head_offset = arith.extui(i64, arith.addi(arith.muli(kv_head, _i32(head_bytes)), arith.muli(chunk, _i32(16))))
        base = arith.addi(base, head_offset)
        smem_base = mgpu_utils.getelementptr(
            mgpu_utils.memref_ptr(smem), [arith.muli(slot, _i32(slot_bytes))], ir.IntegerType.get_signless(8))
        full = _i32(0xFFFFFFFF)
        for p in range(rows_per_warp // 4):
            holder = arith.addi(_i32(4 * p), lane_row)  # the lane that loaded this row's source
            source = nvvm.shfl_sync(full, my_source, holder, _i32(0x1F), nvvm.ShflKind.idx)
            valid = arith.cmpi(arith.CmpIPredicate.sge, source, _i32(0))
            source = arith.extui(i64, arith.maxsi(source, _i32(0)))
            gmem = arith.addi(base, arith.muli(source, _i64(row_bytes)))
            row = arith.addi(arith.muli(warp, _i32(rows_per_warp)), holder)
            size = arith.select(valid, _i32(16), _i32(0))  # 0: the copy writes 16 zero bytes
            for s in range(segments):
                # Chunk c of the span is the row's 16-byte chunk 8 s + c; the row's bytes in smem: whole 128-byte spans.
                at_smem = swizzled_16bit_byte(row, arith.addi(chunk, _i32(8 * s)), head_dim=segments * 64,
                                              swizzle=swizzle, ops=IrOps)
                dst = mgpu_utils.getelementptr(smem_base, [at_smem], ir.IntegerType.get_signless(8))
                at = arith.addi(gmem, _i64(s * SWIZZLE_BYTES))
                chunk_size = size
                if last_chunks and s == segments - 1:  # past the row's end: zeros, from the row's own start
                    inside = arith.cmpi(arith.CmpIPredicate.ult, chunk, _i32(last_chunks))
                    chunk_size = arith.select(inside, size, _i32(0))
                    at = arith.select(inside, at, gmem)
                src = llvm.inttoptr(llvm.PointerType.get(1), at)
                nvvm.cp_async_shared_global(dst, src, 16, nvvm.LoadCacheModifierKind.CG, cp_size=chunk_size)
        nvvm.cp_async_mbarrier_arrive(_barrier_ptr(bars, barrier), noinc=True)

    run(new_ref, pool_ref, smem, bars, sources, from_pool, slot, barrier, kv_head)


def issue_pages(pool_ref, smem, bars, starts, slot, barrier, kv_head, *, page_rows: int, head_dim: int):
    """Starts one K or V tile of whole pages into ring slot `slot` of `smem` ([stages, block_kv, head_dim], 16-bit,
    `SWIZZLED`) by TMA, all copies issued by one thread: copy c takes rows [starts[c] * page_rows, + page_rows) of
    head kv_head of pool_ref ([slots, kv_heads, head_dim]) into tile rows [c * page_rows, + page_rows). It completes
    mbarrier `barrier` of `bars` as `issue_rows` does (128 arrivals, one per producer thread, each now expecting its
    share of the tile's bytes, which the copies complete), so a tile of pages takes a row-copy tile's barrier and
    phase (the kernel's page_issue="inline"; "pallas" issues one Pallas copy per page, each with a warpgroup barrier
    and its own arrival).
    """
    if pool_ref.dtype.itemsize != 2:  # the SWIZZLED (8, 64) tiles and the byte count below are 16-bit ones
        raise ValueError(f"issue_pages copies 16-bit pools; got {pool_ref.dtype}")
    tile_bytes = len(starts) * page_rows * head_dim * 2
    if tile_bytes % (WARPGROUP * 16):  # each producer thread expects an equal, 16-byte-granular share
        raise ValueError(f"a tile of {tile_bytes} bytes does not split into {WARPGROUP} equal shares")

    @plgpu.inline_mgpu(arg_types=(READ_ONLY_REF, plgpu.RefType(SWIZZLED), plgpu.RefType()) + (_SCALAR,) * (3 + len(starts)))
    def run(ctx, pool, smem, bars, slot, barrier, kv_head, *starts):
        index = ir.IndexType.get()
        barrier = scalar_value(barrier)
        nvvm.mbarrier_arrive_expect_tx(_barrier_ptr(bars, barrier), _i32(tile_bytes // WARPGROUP))
        ref = mgpu_utils.BarrierRef(mgpu_utils.memref_ptr(bars), barrier, None, 1)
        slot = arith.index_cast(index, scalar_value(slot))
        kv_head = arith.index_cast(index, scalar_value(kv_head))
        for chunk, start in enumerate(starts):
            row = arith.index_cast(index, arith.muli(scalar_value(start), _i32(page_rows)))
            # smem is tiled (8, 64): rows [chunk * page_rows, + page_rows) are row tiles from chunk * page_rows / 8.
            dst = mgpu_utils.memref_slice(smem, (slot, mgpu.ds(chunk * page_rows // 8, page_rows // 8)))
            ctx.async_copy(src_ref=pool, dst_ref=dst, gmem_slice=(mgpu.ds(row, page_rows), kv_head),
                           gmem_transform=mgpu.TileTransform((8, 64)), swizzle=SWIZZLE_BYTES, barrier=ref, arrive=False)

    run(pool_ref, smem, bars, slot, barrier, kv_head, *starts)


# --- fp8 pools (issue 26): the producer converts each prefix tile in place in its ring slot. ---
# A 16-bit ring slot holds block_kv * head_dim * 2 bytes; an fp8 tile of the same rows is half that. The producer
# copies the fp8 rows (cp.async) row-major into the slot's upper half, then rewrites the slot as the 16-bit tile wgmma
# reads, in steps over its rows (`fp8_conversion_steps`). 16-bit rows [0, e) lie in bytes [0, 2 * hd * e) and fp8 row j
# starts at hd * (block_kv + j), so rows [d, d + n) with n <= (block_kv - d) / 2 are stored below every fp8 row from d
# on: such a step (a phase) needs no sync inside, each thread converting its chunks one by one (load, convert, store);
# its stores reach only fp8 rows of earlier steps, whose loads a warpgroup sync before it orders. Halving phases take
# the tile down to its last rows, which go in rounds of R rows (`fp8_round_rows`: about 16 fp8 bytes per producer
# thread): every thread loads its chunks of the round, the warpgroup syncs, every thread stores (a round's stores reach
# fp8 rows of this round or earlier only). A tile of 128 rows: phases of 64, 32 and 16 rows and one round, 3 syncs
# (8 in rounds alone). No step loads a byte an earlier one stored. `tests/test_fp8_extend_layout.py` replays these
# formulas on bytes. The extend kernel's staging form (`fp8_staging`) reads the fp8 rows from tiles of their own
# instead, in one pass (`fp8_conversion_steps(staged=True)`); the in-place steps serve where there is no room for
# them (the extend kernel's 256 tile, MLA decode). Rows are whole 64-column 16-bit tiles (head_dim a multiple of 64),
# so the slot is exactly 2x the tile.
FP8_HEAD_DIMS = (64, 128, 256)  # the extend kernel's fp8 head dims (q/k = v)
# How the producer converts a pool tile: each value times its scale rounded to q's dtype, or exactly to f16 unscaled
# (the consumers apply the scales: `extend_attention_mgpu_kernel`'s fp8_tiles).
FP8_TILES = ("q_dtype", "f16")
# fp8_tiles="f16": each row of the consumers' f16 Q copy is scaled to this largest magnitude (2^15: f16's full
# precision for every row, and rounding cannot reach f16's largest finite value, 65504).
F16_Q_ROW_MAX = 32768.0
F16_MIN_GAIN = 2.0 ** -100  # a zero gain's stand-in: a masked score (-inf) times it stays -inf, never NaN
# The fp8 copies' and conversion's shared-memory addresses are the same for every tile of a thread, so LLVM hoists
# them out of the producer's loop: 13 of them (64-bit) outlived its 40 registers at E3-FP8 and ptxas spilled them to
# local memory, one LDL before each store of every tile (SASS of the H100's build, thirty-fifth session). True: each
# tile's step computes them again from an opaque copy of the thread index (`fp8_step_thread`), a few integer ops a
# store instead of a local-memory load. The default for producers at 40 registers (the extend kernel's, the MLA padded
# tile's) since 3fba716's GPU run (H100, one call, 3 rounds each, with / without, ms): MLA-FP8 on the padded tile
# 0.144 / 0.247 (ptxas: 464 / 1160 bytes spilled), E3-FP8 0.776 / 0.776, E1-FP8 1.854 / 1.844 (`mgpu-fp8`); the fp8
# GPU tests of both kernels (48) passed with it and gave the same bits. The MLA transposed tile's producer keeps 224
# registers, and its addresses in them (`stream_latent_tiles(addresses_per_tile=False)`).
FP8_ADDRESSES_PER_TILE = True
# fp8_staging: the shared memory Pallas reserves for cross-warp reductions (CompilerParams.reduction_scratch_bytes,
# 2048 by default, reserved for any reduction). The kernel's reductions (a row's max and sum over its keys in the
# WGMMA layout) stay inside a warp and take none; without the reserve the staging tiles fit at 128 dims and 128-key
# tiles (lowered: 230,488 of sm_90's 232,448 bytes; 232,536 with it).
STAGED_REDUCTION_SCRATCH = 0


def kernel_flags() -> tuple[str, ...]:
    """This module's switchable kernel forms (its upper-case booleans, read when a kernel is traced: opt-in ones False,
    a form kept switchable after becoming the default True): what `benchmarks/experiments/with_kernel_flags.py` and
    the tests' JAXATTN_TEST_KERNEL_FLAGS set (`set_kernel_flag`)."""
    return tuple(sorted(name for name, value in globals().items() if name.isupper() and isinstance(value, bool)))


def set_kernel_flag(setting: str, *, value_required: bool = False) -> tuple[str, bool]:
    """Sets one of `kernel_flags()` from "FLAG=1" / "FLAG=0" (or a bare "FLAG", on, unless value_required) for the
    kernels traced after it; returns (FLAG, value). Raises ValueError naming the expected form."""
    name, equals, value = setting.partition("=")
    values = ("0", "1") if value_required or equals else ("",)
    if name not in kernel_flags() or value not in values:
        raise ValueError(f"expected FLAG=0|1{'' if value_required else ' (or FLAG)'} with FLAG one of "
                         f"{kernel_flags()}; got {setting!r}")
    globals()[name] = value != "0"
    return name, value != "0"


def fp8_step_thread(per_tile: bool | None = None):
    """This thread's index in its warpgroup for the fp8 copies' and conversion's addresses: per_tile (None:
    `FP8_ADDRESSES_PER_TILE`) an opaque copy (inline asm with side effects), which keeps every address derived from
    it inside the producer's loop (`benchmarks/experiments/hoisted_addresses_replica.cu`, compiled by nvcc 13 for
    sm_90a: 89 registers without the copy, 46 with it)."""
    thread = thread_in_warpgroup()
    if not (FP8_ADDRESSES_PER_TILE if per_tile is None else per_tile):
        return thread
    return mgpu_utils.inline_ptx("mov.b32 $0, $1;", thread, result_types=ir.IntegerType.get_signless(32),
                                 has_side_effects=True)


def pool_score_gain(k_scale, factor):
    """fp8_tiles="f16": the factor giving a pool tile's scores back, per row: |k_scale| / factor (>= 0, so a row's
    largest score times it is still its largest); a zero gain (k_scale 0, or a tiny scale over a large factor) is
    F16_MIN_GAIN instead (-inf * 0 would be NaN; the scores are then ~0, as k_scale 0 makes them), NaN stays NaN."""
    gain = jnp.abs(k_scale) / factor
    return jnp.where(gain == 0.0, F16_MIN_GAIN, gain)


def f16_tiles_fit(*, unified: bool, o_rows_columns: int, qk_dim: int) -> bool:
    """Whether fp8_tiles="f16" is taken: the two-stage form (its pool tiles all come before its new-key tiles) with
    O-rows buffers as wide as Q (they hold the f16 Q copies)."""
    return not unified and o_rows_columns == qk_dim


class IntOps:
    """The layout formulas' arithmetic on Python ints (the CPU model in tests/)."""
    add = staticmethod(lambda a, b: a + b)
    mul = staticmethod(lambda a, b: a * b)
    div = staticmethod(lambda a, b: a // b)
    rem = staticmethod(lambda a, b: a % b)
    xor = staticmethod(lambda a, b: a ^ b)
    min = staticmethod(min)


class IrOps:
    """The same arithmetic on non-negative i32 MLIR values (ints become constants)."""

    @staticmethod
    def _v(x):
        return _i32(x) if isinstance(x, int) else x

    add = staticmethod(lambda a, b: arith.addi(IrOps._v(a), IrOps._v(b)))
    mul = staticmethod(lambda a, b: arith.muli(IrOps._v(a), IrOps._v(b)))
    div = staticmethod(lambda a, b: arith.divui(IrOps._v(a), IrOps._v(b)))
    rem = staticmethod(lambda a, b: arith.remui(IrOps._v(a), IrOps._v(b)))
    xor = staticmethod(lambda a, b: arith.xori(IrOps._v(a), IrOps._v(b)))
    min = staticmethod(lambda a, b: arith.minui(IrOps._v(a), IrOps._v(b)))


def fp8_staging_byte(row, chunk, *, head_dim: int, ops=IntOps):
    """Byte offset of 16-byte chunk `chunk` of fp8 row `row` in a row-major fp8 tile (a staging tile)."""
    return ops.add(ops.mul(row, head_dim), ops.mul(chunk, 16))


def fp8_staged_byte(row, chunk, *, block_kv: int, head_dim: int, ops=IntOps):
    """Byte offset in a ring slot of 16-byte chunk `chunk` of fp8 row `row`: row-major from the slot's middle."""
    return fp8_staging_byte(ops.add(row, block_kv), chunk, head_dim=head_dim, ops=ops)


def swizzled_16bit_byte(row, chunk, *, head_dim: int, swizzle: int = SWIZZLE_BYTES, ops=IntOps):
    """Byte offset in a ring slot of 16-byte chunk `chunk` (elements 8 * chunk...) of 16-bit row `row` in `SWIZZLED`
    ((8, 64) tiles of 1024 bytes, row-major over [rows / 8, head_dim / 64]; 16-byte chunks XOR-swizzled by row % 8)
    or, swizzle 64, `SWIZZLED_64` ((8, 32) tiles of 512 bytes; chunk c of a tile's row r at c ^ (r % 8 // 2): the
    hardware's 64-byte swizzle). head_dim: the row's width in smem, in 16-bit elements (`SWIZZLED_8BIT`'s rows of
    2 * head_dim bytes lie the same way, byte for byte)."""
    per_row = swizzle // 16  # chunks of a tile's row
    row_in_tile = ops.rem(row, 8)
    tile = ops.add(ops.mul(ops.div(row, 8), head_dim * 2 // swizzle), ops.div(chunk, per_row))
    swizzled = ops.xor(ops.rem(chunk, per_row), ops.div(row_in_tile, 8 // per_row))
    return ops.add(ops.add(ops.mul(tile, 8 * swizzle), ops.mul(row_in_tile, swizzle)), ops.mul(swizzled, 16))


def fp8_copy_position(warp, lane, p: int, *, block_kv: int, head_dim: int, ops=IntOps):
    """(holder, row, chunk) of copy p of thread (warp, lane) in `issue_fp8_rows`: the warp's rows are those whose
    sources it holds (`row_sources`: lane h < block_kv / 4 holds row warp * block_kv / 4 + h), their 16-byte chunks
    taken in order, 32 per warp instruction (consecutive lanes, consecutive bytes)."""
    chunks = head_dim // 16
    k = ops.add(p * 32, lane)  # the chunk's index among the warp's rows' chunks
    holder = ops.div(k, chunks)
    return holder, ops.add(ops.mul(warp, block_kv // 4), holder), ops.rem(k, chunks)


def fp8_copies_per_thread(block_kv: int, head_dim: int) -> int:
    return (block_kv // 4) * (head_dim // 16) // 32


def fp8_round_rows(head_dim: int) -> int:
    """Rows per conversion round: a multiple of 8 (whole 16-bit row tiles) near 16 fp8 bytes per producer thread."""
    return max(8, WARPGROUP * 16 // head_dim // 8 * 8)


def fp8_conversion_steps(block_kv: int, head_dim: int, staged: bool = False) -> tuple[tuple[int, int, bool], ...]:
    """The conversion of a tile, in order: (first row, rows, round). Phases (round False) while the rows left allow
    one of at least R = `fp8_round_rows` rows: the largest multiple of R at most half the rows left; then rounds of R
    rows (round True). Every step but the first starts with a warpgroup sync (a round's sits between its loads and
    its stores). staged (the fp8 rows in a staging tile, no byte both read and written): the whole tile, one phase."""
    if staged:
        return ((0, block_kv, False),)
    rows = fp8_round_rows(head_dim)
    steps, start = [], 0
    while (phase := (block_kv - start) // 2 // rows * rows) >= rows:
        steps.append((start, phase, False))
        start += phase
    steps += [(row, rows, True) for row in range(start, block_kv, rows)]
    return tuple(steps)


def fp8_step_position(first_row: int, rows: int, thread, i: int, *, head_dim: int, ops=IntOps):
    """(row, chunk) of the i-th chunk thread `thread` converts in the step of `rows` rows from `first_row`: chunk
    thread + 128 i of the step's rows * head_dim / 16, or where that is past them the step's last chunk (converted
    twice, to the same bytes: no branch around the copy; in a phase its fp8 bytes are never overwritten)."""
    chunks, total = head_dim // 16, rows * (head_dim // 16)
    k = ops.add(thread, i * WARPGROUP)
    if (i + 1) * WARPGROUP > total:
        k = ops.min(k, total - 1)
    return ops.add(first_row, ops.div(k, chunks)), ops.rem(k, chunks)


def fp8_step_chunks_per_thread(rows: int, head_dim: int) -> int:
    return -(-rows * (head_dim // 16) // WARPGROUP)


def check_fp8_tile(block_kv: int, head_dim: int) -> None:
    """Raises unless the fp8 copies and conversion rounds tile [block_kv, head_dim] exactly."""
    if (head_dim % 64 or block_kv % 4 or block_kv % fp8_round_rows(head_dim)
            or (block_kv // 4) * (head_dim // 16) % 32):
        raise ValueError(f"fp8 tiles are converted with head_dim a multiple of 64 and block_kv a multiple of "
                         f"{fp8_round_rows(head_dim) if head_dim > 0 else 8} (and of 4); got head_dim {head_dim}, "
                         f"block_kv {block_kv}")


def head_rows_per_cta(consumers: int, block_q: int, heads_per_cta: int) -> int:
    """Query rows of each of its heads a CTA takes: its consumers' block_q rows each, shared by its heads."""
    return consumers * block_q // heads_per_cta


def online_softmax_tile(s, acc, m_i, l_i, scale_log2, *, keys_axis: int = 1):
    """One key tile of the online softmax in base 2 (m in log2 units, so p = exp2(s * c - m) is one FMA and an exp2):
    s f32[rows, keys] raw scores (WGMMA layout; invisible ones -inf), acc f32[rows, n] the rows' output so far,
    m_i / l_i f32[rows] their running max (of scaled scores) and sum; scale_log2 > 0: a scalar, or f32[rows] (WGMMA
    row layout) for a scale per row. Returns (p f32, acc rescaled by alpha, m_new, l_new, alpha). keys_axis 0 (a
    transposed tile): s is [keys, rows] and acc [n, rows], the rows are columns (m_i, l_i in the column layout)."""
    rows_axis = 1 - keys_axis
    m_new = jnp.maximum(m_i, s.max(axis=keys_axis) * scale_log2)
    if getattr(scale_log2, "ndim", 0) == 1:
        scale_log2 = lax.broadcast_in_dim(scale_log2, s.shape, [rows_axis])
    scaled = s * scale_log2
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(scaled - lax.broadcast_in_dim(m_new, s.shape, [rows_axis]))
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [rows_axis])
    l_i = l_i * alpha + p.sum(axis=keys_axis)
    return p, acc, m_new, l_i, alpha


def issue_fp8_rows(pool_ref, smem, sources, slot, kv_head, *, block_kv: int, head_dim: int,
                   swizzle: int = SWIZZLE_BYTES, addresses_per_tile: bool | None = None, staging: bool = False):
    """Starts the cp.async copies of one fp8 K or V tile into the upper half of ring slot `slot` of `smem` (a 16-bit
    [stages, block_kv, head_dim] ring, `SWIZZLED`; the fp8 rows stored as `fp8_staged_byte` lays them out): tile row
    r <- row sources[r] of pool_ref ([slots, kv_heads, head_dim] fp8), head kv_head; zeros where the source is -1.
    staging: `smem` is instead a staging tile (int8 [block_kv, head_dim], row-major: `fp8_staging_byte`; slot
    unused). Not committed: the caller commits the step's copies as one cp.async group (`commit_copies`).
    addresses_per_tile: `fp8_step_thread`'s per_tile."""
    check_fp8_tile(block_kv, head_dim)
    kv_heads = pool_ref.shape[1]
    row_bytes = kv_heads * head_dim
    slot_bytes = 2 * block_kv * head_dim
    if staging:
        byte_of = functools.partial(fp8_staging_byte, head_dim=head_dim, ops=IrOps)
    else:
        byte_of = functools.partial(fp8_staged_byte, block_kv=block_kv, head_dim=head_dim, ops=IrOps)
    smem_type = plgpu.RefType() if staging else plgpu.RefType(SWIZZLES[swizzle])

    @plgpu.inline_mgpu(arg_types=(READ_ONLY_REF, smem_type, _ROW_SOURCES, _SCALAR, _SCALAR))
    def run(ctx, pool, smem, sources, slot, kv_head):
        del ctx
        i8 = ir.IntegerType.get_signless(8)
        slot = scalar_value(slot)
        my_source = vector.extract(sources.registers.flat[0], [], [0])
        warp, lane = _lane_ids(fp8_step_thread(addresses_per_tile))
        smem_base = mgpu_utils.memref_ptr(smem)
        if not staging:
            smem_base = mgpu_utils.getelementptr(smem_base, [arith.muli(slot, _i32(slot_bytes))], i8)
        base = fp8_head_address(pool, kv_head, head_dim=head_dim)
        for p in range(fp8_copies_per_thread(block_kv, head_dim)):
            issue_fp8_copy(base, smem_base, my_source, warp, lane, p, byte_of=byte_of, block_kv=block_kv,
                           head_dim=head_dim, row_bytes=row_bytes)

    run(pool_ref, smem, sources, slot, kv_head)


def fp8_head_address(pool, kv_head, *, head_dim: int):
    """i64 global address of head `kv_head` of pool row 0 (pool: an inline_mgpu ref of [slots, kv_heads, head_dim])."""
    i64 = ir.IntegerType.get_signless(64)
    return arith.addi(global_address(pool), arith.extui(i64, arith.muli(scalar_value(kv_head), _i32(head_dim))))


def issue_fp8_copy(base, smem_base, my_source, warp, lane, p: int, *, byte_of, block_kv: int, head_dim: int,
                   row_bytes: int, enabled=None):
    """Inside an inline_mgpu function: this thread's copy p (`fp8_copy_position`) of an fp8 tile, 16 bytes of its
    row's source (pool row my_source of the holder lane, at `base`: `fp8_head_address`) into smem_base + byte_of(row,
    chunk) by cp.async; zeros where the source is -1 or `enabled` (i1, None: on) is false. Every lane calls it (a
    shuffle). Returns (row, chunk)."""
    i8, i64 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(64)
    holder, row, chunk = fp8_copy_position(warp, lane, p, block_kv=block_kv, head_dim=head_dim, ops=IrOps)
    source = nvvm.shfl_sync(_i32(0xFFFFFFFF), my_source, holder, _i32(0x1F), nvvm.ShflKind.idx)
    valid = arith.cmpi(arith.CmpIPredicate.sge, source, _i32(0))
    if enabled is not None:
        valid = arith.andi(valid, enabled)
    source = arith.extui(i64, arith.maxsi(source, _i32(0)))
    at = arith.addi(arith.addi(base, arith.muli(source, _i64(row_bytes))),
                    arith.extui(i64, arith.muli(chunk, _i32(16))))
    dst = mgpu_utils.getelementptr(smem_base, [byte_of(row, chunk)], i8)
    nvvm.cp_async_shared_global(dst, llvm.inttoptr(llvm.PointerType.get(1), at), 16, nvvm.LoadCacheModifierKind.CG,
                                cp_size=arith.select(valid, _i32(16), _i32(0)))
    return row, chunk


def refill_pending_groups(block_kv: int, head_dim: int) -> int:
    """fp8_refill: the cp.async groups a thread may leave pending when it converts copy position p of a
    tile: those committed after p's, this tile's of positions p + 1... and the next tile's of 0..p - 1."""
    return fp8_copies_per_thread(block_kv, head_dim) - 1


def issue_fp8_staging_groups(pool_refs, stagings, sources, kv_head, *, block_kv: int, head_dim: int,
                             addresses_per_tile: bool | None = None):
    """fp8_refill's first pool tile: the copies of `issue_fp8_rows(staging=True)` for each tile (K's, V's)
    into its staging tile, committed as one cp.async group per copy position (K's and V's copy p together), the
    groups `convert_fp8_tiles(refill=...)` waits for one at a time."""
    check_fp8_tile(block_kv, head_dim)
    count = len(pool_refs)
    byte_of = functools.partial(fp8_staging_byte, head_dim=head_dim, ops=IrOps)
    row_bytes = [pool_ref.shape[1] * head_dim for pool_ref in pool_refs]

    @plgpu.inline_mgpu(arg_types=(READ_ONLY_REF,) * count + (plgpu.RefType(),) * count + (_ROW_SOURCES, _SCALAR))
    def run(ctx, *args):
        del ctx
        pools, smems, (sources, kv_head) = args[:count], args[count:2 * count], args[2 * count:]
        my_source = vector.extract(sources.registers.flat[0], [], [0])
        warp, lane = _lane_ids(fp8_step_thread(addresses_per_tile))
        bases = [fp8_head_address(pool, kv_head, head_dim=head_dim) for pool in pools]
        for p in range(fp8_copies_per_thread(block_kv, head_dim)):
            for base, smem, pool_row_bytes in zip(bases, smems, row_bytes):
                issue_fp8_copy(base, mgpu_utils.memref_ptr(smem), my_source, warp, lane, p, byte_of=byte_of,
                               block_kv=block_kv, head_dim=head_dim, row_bytes=pool_row_bytes)
            nvvm.cp_async_commit_group()

    run(*pool_refs, *stagings, sources, kv_head)


def wait_copies():
    """Waits until every cp.async copy this thread issued has landed."""

    @plgpu.inline_mgpu()
    def run(ctx):
        del ctx
        nvvm.cp_async_wait_group(0)

    run()


def commit_copies():
    """Closes this thread's cp.async copies issued so far into one group (an empty group when there were none)."""

    @plgpu.inline_mgpu()
    def run(ctx):
        del ctx
        nvvm.cp_async_commit_group()

    run()


# e4m3fn / e5m2 -> f32 (through f16x2: exact), times the scale, rounded to q's dtype: the 4 elements of one 32-bit word
# into two words of 16-bit pairs (element 0 in the low half), as `jaxattn.fp8.dequantised_rows` computes them. Without
# a scale (the kernel folds it elsewhere): straight to f16x2, one instruction per two elements, exact.
FP8_TO_F16_PTX = """{{
.reg .b16 b01, b23;
mov.b32 {{b01, b23}}, $2;
cvt.rn.f16x2.{fp8}x2 $0, b01;
cvt.rn.f16x2.{fp8}x2 $1, b23;
}}"""
FP8_CONVERT_PTX = """{{
.reg .b16 b01, b23, a0, a1, a2, a3;
.reg .b32 h0, h1;
.reg .f32 f0, f1, f2, f3;
mov.b32 {{b01, b23}}, $2;
cvt.rn.f16x2.{fp8}x2 h0, b01;
cvt.rn.f16x2.{fp8}x2 h1, b23;
mov.b32 {{a0, a1}}, h0;
mov.b32 {{a2, a3}}, h1;
cvt.f32.f16 f0, a0;
cvt.f32.f16 f1, a1;
cvt.f32.f16 f2, a2;
cvt.f32.f16 f3, a3;
mul.rn.f32 f0, f0, $3;
mul.rn.f32 f1, f1, $3;
mul.rn.f32 f2, f2, $3;
mul.rn.f32 f3, f3, $3;
cvt.rn.{out}x2.f32 $0, f1, f0;
cvt.rn.{out}x2.f32 $1, f3, f2;
}}"""
FP8_PTX_NAMES = {jnp.dtype(jnp.float8_e4m3fn): "e4m3", jnp.dtype(jnp.float8_e5m2): "e5m2"}
OUT_PTX_NAMES = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float16): "f16"}


def fp8_convert_ptx(fp8_dtype, dtype, scaled: bool = True) -> str:
    if not scaled:
        if jnp.dtype(dtype) != jnp.dtype(jnp.float16):
            raise ValueError(f"an unscaled fp8 conversion writes f16 tiles; got {jnp.dtype(dtype).name}")
        return FP8_TO_F16_PTX.format(fp8=FP8_PTX_NAMES[jnp.dtype(fp8_dtype)])
    return FP8_CONVERT_PTX.format(fp8=FP8_PTX_NAMES[jnp.dtype(fp8_dtype)], out=OUT_PTX_NAMES[jnp.dtype(dtype)])


def convert_fp8_tiles(tiles, bars, slot, *, block_kv: int, head_dim: int, fp8_dtype, dtype, wait_pending: int | None,
                      swizzle: int = SWIZZLE_BYTES, addresses_per_tile: bool | None = None, staging=None, refill=None):
    """Rewrites the fp8 tiles `issue_fp8_rows` copied into ring slot `slot` of each ring as the `SWIZZLED` tiles of
    `dtype`, then completes each tile's mbarrier (each producer thread arrives once: its 128 arrivals, as a cp.async
    tile's). tiles: ((smem, barrier, scale), ...), smem a 16-bit [stages, block_kv, head_dim] ring, barrier an index
    into `bars`, scale an f32 scalar (each value times it in f32) or None (f16, exact, the scale folded elsewhere;
    one for all tiles). The tiles go through the same steps (`fp8_conversion_steps`: phases, then rounds), sharing
    their syncs. wait_pending: None (the copies were
    waited for by an earlier call), or wait until at most this many of the thread's cp.async groups are in flight,
    then sync the warpgroup so every thread's copies are visible. addresses_per_tile: `fp8_step_thread`'s per_tile.
    staging: None, or per tile its staging tile (`issue_fp8_rows(staging=True)`), where its fp8 rows are read from
    instead of the slot's upper half: one pass, each thread's chunks loaded, converted and stored one by one (no
    byte is both read and written), then a warpgroup sync after the arrivals, so the next copies into the staging
    tiles start once every thread has read them.
    refill (the kernel's fp8_refill; staging only, wait_pending None): (pool refs, one per tile; the next tile's row
    sources, `row_sources`; kv_head; whether the next tile is a pool tile, i32 0/1). Each thread converts its chunks
    at its copies' positions (`fp8_copy_position`, the staging tiles' bytes it copied itself), position by position:
    it waits for that position's cp.async group (`issue_fp8_staging_groups`, or the refill before), converts, then
    copies the next tile's chunk there (zeros if it is no pool tile) and commits it as a group. No warpgroup sync."""
    check_fp8_tile(block_kv, head_dim)
    slot_bytes = 2 * block_kv * head_dim
    staged = staging is not None
    if staged and len(staging) != len(tiles):
        raise ValueError(f"one staging tile per tile: {len(tiles)} tiles, {len(staging)} staging tiles")
    refilled = refill is not None
    if refilled and (not staged or wait_pending is not None or len(refill[0]) != len(tiles)):
        raise ValueError("refill takes staging tiles, one pool per tile, and no wait_pending (its waits are per "
                         "copy position)")
    pool_row_bytes = [pool_ref.shape[1] * head_dim for pool_ref in refill[0]] if refilled else []
    scaled = tiles[0][2] is not None
    if any((scale is not None) != scaled for _, _, scale in tiles):
        raise ValueError("the tiles converted together are all scaled or all unscaled")
    ptx = fp8_convert_ptx(fp8_dtype, dtype, scaled)
    count = len(tiles)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(SWIZZLES[swizzle]),) * count + (plgpu.RefType(),) * (count * staged)
                       + ((READ_ONLY_REF,) * count + (_ROW_SOURCES, _SCALAR, _SCALAR) if refilled else ())
                       + (plgpu.RefType(), _SCALAR) + (_SCALAR,) * (count * (1 + scaled)))
    def run(ctx, *args):
        del ctx
        smems, args = args[:count], args[count:]
        staging_refs, args = (args[:count], args[count:]) if staged else (None, args)
        refill_args, args = (args[:count + 3], args[count + 3:]) if refilled else (None, args)
        (bars, slot), rest = args[:2], args[2:]
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        words = ir.VectorType.get((4,), i32)
        slot = scalar_value(slot)
        barriers = [scalar_value(x) for x in rest[:count]]
        scales = [(scalar_value(x),) for x in rest[count:]] if scaled else [()] * count
        sync = mgpu_utils.warpgroup_barrier  # bar.sync on the producer warpgroup's own barrier (as Mosaic's)
        if wait_pending is not None:
            nvvm.cp_async_wait_group(wait_pending)
            sync()
        thread = fp8_step_thread(addresses_per_tile)
        bases = [mgpu_utils.getelementptr(mgpu_utils.memref_ptr(smem), [arith.muli(slot, _i32(slot_bytes))], i8)
                 for smem in smems]
        # Where each tile's fp8 rows are read: its staging tile, or its slot's upper half.
        fp8_bases = [mgpu_utils.memref_ptr(ref) for ref in staging_refs] if staged else bases
        tiles_at = list(zip(bases, fp8_bases, scales))  # per tile: its slot, its fp8 rows, its scale

        def load(fp8_base, row, chunk):
            if staged:
                at = fp8_staging_byte(row, chunk, head_dim=head_dim, ops=IrOps)
            else:
                at = fp8_staged_byte(row, chunk, block_kv=block_kv, head_dim=head_dim, ops=IrOps)
            return llvm.load(words, mgpu_utils.getelementptr(fp8_base, [at], i8), alignment=16)

        def store(base, scale, row, chunk, data):
            out = []
            for i in range(4):
                out += mgpu_utils.inline_ptx(ptx, vector.extract(data, [], [i]), *scale, result_types=[i32, i32])
            for half in range(2):
                at = swizzled_16bit_byte(row, IrOps.add(IrOps.mul(chunk, 2), half), head_dim=head_dim,
                                         swizzle=swizzle, ops=IrOps)
                llvm.store(vector.from_elements(words, out[4 * half:4 * half + 4]),
                           mgpu_utils.getelementptr(base, [at], i8), alignment=16)

        if refilled:
            pools, (sources, kv_head, next_is_pool) = refill_args[:count], refill_args[count:]
            my_source = vector.extract(sources.registers.flat[0], [], [0])
            warp, lane = _lane_ids(thread)
            pool_bases = [fp8_head_address(pool, kv_head, head_dim=head_dim) for pool in pools]
            enabled = arith.cmpi(arith.CmpIPredicate.ne, scalar_value(next_is_pool), _i32(0))
            staging_byte = functools.partial(fp8_staging_byte, head_dim=head_dim, ops=IrOps)
            for p in range(fp8_copies_per_thread(block_kv, head_dim)):
                nvvm.cp_async_wait_group(refill_pending_groups(block_kv, head_dim))
                _, row, chunk = fp8_copy_position(warp, lane, p, block_kv=block_kv, head_dim=head_dim, ops=IrOps)
                loaded = [(base, scale, load(fp8_base, row, chunk)) for base, fp8_base, scale in tiles_at]
                for base, scale, data in loaded:
                    store(base, scale, row, chunk, data)
                # The next tile's chunk into the bytes just read: issued after the stores that use those loads'
                # values, so the loads have returned (in-order issue); the copy's write lands a global read later
                # (or, zeros, through the same in-order shared-memory pipe). The GPU tests check it bit for bit.
                for pool_base, fp8_base, row_bytes in zip(pool_bases, fp8_bases, pool_row_bytes):
                    issue_fp8_copy(pool_base, fp8_base, my_source, warp, lane, p, byte_of=staging_byte,
                                   block_kv=block_kv, head_dim=head_dim, row_bytes=row_bytes, enabled=enabled)
                nvvm.cp_async_commit_group()
        else:
            for index, (first_row, rows, is_round) in enumerate(fp8_conversion_steps(block_kv, head_dim, staged)):
                positions = [fp8_step_position(first_row, rows, thread, i, head_dim=head_dim, ops=IrOps)
                             for i in range(fp8_step_chunks_per_thread(rows, head_dim))]
                if is_round:  # every thread's loads, then the sync, then the stores
                    loaded = [(base, scale, row, chunk, load(fp8_base, row, chunk))
                              for base, fp8_base, scale in tiles_at for row, chunk in positions]
                    # every thread's bytes of this round (and of the steps before) read before any is overwritten
                    sync()
                    for base, scale, row, chunk, data in loaded:
                        store(base, scale, row, chunk, data)
                else:  # a phase: its stores reach no fp8 byte of its own, so no sync between its loads and stores
                    if index:
                        sync()  # the steps before: every thread's loads done before this phase overwrites their bytes
                    # Each position's chunk of every tile (K's and V's) loaded, then stored: two loads in flight within
                    # the producer's few registers (`REGISTERS`; more positions at a time, or more registers, were no
                    # faster on the H100, 0281adf).
                    for row, chunk in positions:
                        loaded = [(base, scale, load(fp8_base, row, chunk)) for base, fp8_base, scale in tiles_at]
                        for base, scale, data in loaded:
                            store(base, scale, row, chunk, data)
        # wgmma reads the tiles through the async proxy: order this thread's stores before it, then release.
        nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)
        for barrier in barriers:
            mgpu_utils.inline_ptx("mbarrier.arrive.release.cta.shared::cta.b64 _, [$0];", _barrier_ptr(bars, barrier),
                                  has_side_effects=True)
        if staged and not refilled:
            sync()  # every thread's loads of the staging tiles done before any thread copies the next tile into them

    if refilled:
        pools, sources, kv_head, next_is_pool = refill
        refill = (*pools, sources, kv_head, jnp.asarray(next_is_pool, jnp.int32))
    run(*(smem for smem, _, _ in tiles), *(staging or ()), *(refill or ()), bars, slot,
        *(barrier for _, barrier, _ in tiles), *(scale for _, _, scale in tiles if scale is not None))


def steps_in_slot(end, *, slot, stages: int):
    """How many steps m in [0, end) use ring slot `slot` (m % stages == slot)."""
    return lax.div(jnp.maximum(end - slot, 0) + (stages - 1), jnp.int32(stages))


def cp_async_uses(step, slot, *, pre_steps, tail_step, stages: int, first_step=None, page_steps=0):
    """How many cp.async tiles before `step` used ring slot `slot` (= step % stages). Each completes the slot's
    mbarrier once, so this count's parity is the phase tile `step` waits for. The cp.async steps are
    [page_steps, pre_steps) (the prefix tiles not copied page by page) and [tail_step, ...) (new-key tiles past the
    TMA ones); the steps between come by TMA. Any number of tail tiles is counted right: bad metadata must not leave
    a wait on a phase that never comes (a hang). page_steps: 0, or the prefix tiles copied by TMA page by page
    (0 <= page_steps; with pre_steps <= 0 nothing of the prefix is counted).
    first_step (a sliding window): the CTA's first loaded step; tiles before it were never loaded, so they are not
    counted (the mbarriers start at phase 0 on the CTA's first tile).
    """
    count = functools.partial(steps_in_slot, slot=slot, stages=stages)

    def before(end):  # cp.async steps m in [0, end) with m % stages == slot
        prefix_end = jnp.minimum(end, pre_steps)
        prefix = count(prefix_end)
        if not (isinstance(page_steps, int) and page_steps == 0):  # less the prefix tiles copied page by page
            prefix = prefix - count(jnp.minimum(prefix_end, page_steps))
        return prefix + count(jnp.maximum(end, tail_step)) - count(tail_step)

    uses = before(step)
    if first_step is not None:
        uses = uses - before(first_step)
    return uses


# The two-stage form's waits on prefix tiles (steps < pre_steps, no pages by TMA): every tile before them in their
# slot came by cp.async, so their phase is `prefix_cp_async_uses`, a few uniform ops, where the general wait computes
# `cp_async_uses` over the TMA ranges and branches between TMA and cp.async barriers on every tile. In the SASS of the
# H100's E3 build (thirty-fifth session) the two-stage kernel's prefix loop runs 533 instructions a tile against the
# unified kernel's 513 (per-thread min / max / compares, 6 waits against 4, 11 branches against 5), and its kernel
# took 3.5-4% longer wherever a prefix is cached. The default since 3fba716's GPU run (H100, one call, 3 rounds each,
# default / fast, ms: E3 0.616 / 0.602, T64 1.090 / 1.041, E3-P16 0.617 / 0.595, E1 1.609 / 1.558; E3's kernel 520.5
# us, the unified kernel's 520.0; the same bits on 8 GPU cases); False gives the general wait back.
PREFIX_FAST_WAITS = True


def prefix_cp_async_uses(step, slot, *, stages: int, first_step=None):
    """`cp_async_uses` for a prefix step (step < pre_steps; no prefix tile copied page by page by TMA): the cp.async
    tiles before `step` in its slot are all the steps before it there, step // stages, less those before a window's
    first step (first_step <= step: never loaded)."""
    uses = lax.div(step, jnp.int32(stages))  # `steps_in_slot(step)`: step's own slot
    if first_step is not None:
        uses = uses - steps_in_slot(first_step, slot=slot, stages=stages)
    return uses


def window_first_step(first_row, prefix_len, lead, pre_steps, *, window: int, block_kv: int):
    """The first K/V step a query sees under a sliding window W: the step holding the key at position first_row - W.

    Positions here count from the sequence's first new token (listed coordinates minus prefix_len): query / new key
    i at i, listed prefix key j at j - prefix_len; a query at t sees keys at positions in [t - W, t]. first_row
    (>= 0) is the smallest query of the range; the steps are the kernel's: prefix tiles [0, pre_steps) of block_kv
    listed keys, then new-key tiles from base = q_start - lead. Keys before the step returned are outside the
    window of every query >= first_row: no row of the range needs those tiles (they are neither loaded nor consumed).
    """
    lowest = first_row - window
    in_prefix = lax.div(jnp.maximum(lowest + prefix_len, 0), jnp.int32(block_kv))
    in_new = pre_steps + lax.div(jnp.maximum(lowest + lead, 0), jnp.int32(block_kv))
    return jnp.where(lowest < 0, in_prefix, in_new)


def window_full_step(last_row, prefix_len, lead, pre_steps, *, window: int, block_kv: int):
    """The first step from which no tile holds a key below the window of the query at last_row (position
    last_row - W, coordinates as `window_first_step`): tiles from here on need no window mask for any query of a
    range ending at last_row. Conservative for the first new-key tile when lead > 0 (its lead keys belong to the
    previous sequence and are masked anyway).
    """
    lowest = last_row - window
    in_prefix = _cdiv(jnp.maximum(lowest + prefix_len, 0), block_kv)
    in_new = pre_steps + _cdiv(jnp.maximum(lowest + lead, 0), block_kv)
    return jnp.where(in_prefix < pre_steps, in_prefix, in_new)


def cta_window_first_step(cta_row, q_start, prefix_len, lead, pre_steps, cta_steps, *, window: int, block_kv: int):
    """The CTA's first step under a window: the one its first valid query row needs first. The producer loads the
    steps [this, cta_steps); both consumer warpgroups consume (or release) every one of them, in order."""
    first_row = jnp.maximum(cta_row, q_start) - q_start
    first = window_first_step(first_row, prefix_len, lead, pre_steps, window=window, block_kv=block_kv)
    return jnp.minimum(first, cta_steps)


def warpgroup_window_steps(wg_row, q_start, q_end, prefix_len, lead, pre_steps, first_step, wg_steps, *,
                           window: int, block_q: int, block_kv: int):
    """(wg_first, win_full) of a consumer warpgroup whose query rows start at wg_row, under a window:
    first_step <= wg_first <= win_full <= wg_steps. It releases the CTA's steps [first_step, wg_first) unused (its
    rows see none of their keys), computes [wg_first, wg_steps), with the window mask on [wg_first, win_full)."""
    t0 = wg_row - q_start  # the warpgroup's row 0, from the sequence's first new token (< 0: previous sequence)
    t_last = jnp.minimum(wg_row + block_q, q_end) - 1 - q_start  # its last valid row
    wg_first = jnp.clip(window_first_step(jnp.maximum(t0, 0), prefix_len, lead, pre_steps, window=window,
                                          block_kv=block_kv), first_step, wg_steps)
    win_full = jnp.clip(window_full_step(t_last, prefix_len, lead, pre_steps, window=window, block_kv=block_kv),
                        wg_first, wg_steps)
    return wg_first, win_full


def unified_window_first_step(first_t, q_prefix, *, window: int, block_kv: int):
    """The unified form's first step under a sliding window W for queries t >= first_t (query t sits at listed
    position q_prefix + t and sees keys at listed positions >= q_prefix + t - W): the tile holding q_prefix +
    first_t - W (tiles sit at fixed listed offsets, step s holding keys s * block_kv ...). Keys before it are outside
    the window of every query >= first_t."""
    return lax.div(jnp.maximum(q_prefix + first_t - window, 0), jnp.int32(block_kv))


def unified_window_full_step(last_t, q_prefix, *, window: int, block_kv: int):
    """The unified form's first step from which no tile holds a key below the window of the query at last_t: tiles
    from here on need no window mask for any query <= last_t."""
    return _cdiv(jnp.maximum(q_prefix + last_t - window, 0), block_kv)


def extend_attention_mgpu_kernel(q, k_new, v_new, k_pool, v_pool, kv_indices, qo_indptr, kv_indptr, out_ref, *,
                                 max_extend_len, sm_scale, block_q, block_kv, stages, tma_new_tiles, o_rows_columns,
                                 causal=True, sliding_window=-1, logit_cap=0.0, sinks=None, xai_temperature_len=-1,
                                 kv_start_pos=None, prefix_lens=None, custom_mask=None, mask_indptr=None,
                                 skip_prefix_custom_mask=True, heads_per_cta=1, draft_mask=None, page_rows=0,
                                 page_issue="pallas", latent_v_dim=None, consumers=COMPUTE_WARPGROUPS,
                                 overlap=False, kv_scales=None, fp8_tiles="q_dtype", fp8_staging=False,
                                 fp8_refill=False):
    """Runs the kernel; writes `out_ref` in place (rows it does not own are left as they were).

    q: [q_rows, q_heads, qk_dim] (q_rows a multiple of 8, >= block_q: Q/O move by TMA in 8-row tiles);
    k_new: [tokens, kv_heads, qk_dim], v_new: [tokens, kv_heads, v_dim] (token i's K/V; tokens <= q_rows);
    k_pool: [slots, kv_heads, qk_dim], v_pool: [slots, kv_heads, v_dim]; kv_indices: i32/i64[capacity]: sequence
      b's prefix slots at kv_indptr[b]:kv_indptr[b+1]; qo_indptr, kv_indptr: i32[batch + 1]; out_ref: a Ref
      [q_rows, q_heads, v_dim] of q's dtype.
    qk_dim / v_dim: 64/64, 128/128, 192/128 or 256/256 (multiples of 64; the accumulators of the consumer warpgroups
      live in registers); block_kv 64 or 128. With v_dim != qk_dim, O is stored through its own buffer (not Q's).
    o_rows_columns: the width of the row-sliceable O buffer a partial q tile is stored through, in column chunks
      (v_dim, or a divisor of it when v_dim == qk_dim: at 256/256 a [block_q, 256] buffer per warpgroup would not fit
      beside Q and the ring; `MgpuExtendConfig.o_rows_columns` is the rule).
    heads_per_cta: 1, or 2 (two q heads of one kv head per CTA, each consumer warpgroup taking the same block_q
      rows of its own head: for short extends, e.g. a verify step's drafts, where a 2 * block_q-row tile of one
      head would be mostly empty; needs (q_heads // kv_heads) % 2 == 0 and 2 consumers).
    consumers: consumer warpgroups per CTA, 2 (ping-pong: a shared schedule barrier alternates their matrix work) or
      3 (64/64 head dims only: 3 * block_q rows per CTA, 160 registers each, FlashAttention-3's tile for 64-dim heads,
      whose softmax is as long as its matrix work; no schedule barrier, the warp schedulers interleave the three).
    kv_scales: f32[2 * kv_heads] (K scales, then V scales) exactly when k_pool / v_pool are fp8 (e4m3fn or e5m2, one
      format; qk_dim == v_dim in `FP8_HEAD_DIMS`, not latent, page_rows 0): the producer copies each pool tile's fp8
      rows into the upper half of its 16-bit ring slot and converts them there (`convert_fp8_tiles`: value * scale in
      f32, rounded to q's dtype, as `jaxattn.fp8.dequantised_rows`), so the consumers' work is unchanged. Its copies
      run stages - 1 tiles ahead of its conversions (cp.async groups, one per step). New tokens' K/V (two-stage) stay
      in q's dtype, unscaled. Opt-in (`impl="mgpu-fp8"`).
    fp8_tiles (fp8 pools): "q_dtype" (as above), or "f16" (two-stage form, o_rows_columns == qk_dim): the producer
      converts each fp8 value exactly to f16, unscaled (`FP8_TO_F16_PTX`). Each consumer warpgroup keeps an f16
      copy of its Q tile (aliasing its O-rows buffer, used only after the last tile) with each row times
      factor = min(F16_Q_ROW_MAX / max|row|, 2^64) (no f16 overflow, f16's full precision) and times sign(k_scale);
      pool tiles run S = Q16 K16^T and O += P16 V16 in f16 (P in [0, 1]), their scores times |k_scale| / factor per
      row (`pool_score_gain`; in the exponent's scale, or with a soft cap inside the tanh), and the accumulator is
      multiplied by v_scale after the last pool tile (every pool tile comes before every new-key tile). New-key
      tiles are unchanged (q's dtype). The rings hold f16 pool tiles and new-key tiles of q's dtype in the same
      slots (two views of one allocation, `plgpu.RefUnion`).
    fp8_staging (fp8 pools): the producer copies a pool tile's fp8 rows into staging tiles of their own (K's and V's,
      block_kv x qk_dim bytes each) instead of its slot's upper half, so the copies of tile s + 1 start as soon as
      tile s is converted, without waiting for s + 1's slot: they land while the consumers work on two tiles (s - 1
      and s), and only the conversion sits between a slot's release and its use. Takes 2 * block_kv * qk_dim bytes
      of shared memory, and none of Pallas' reduction scratch (the kernel's row reductions stay inside a warp:
      `STAGED_REDUCTION_SCRATCH`), which is what makes 128-key tiles at 128 dims fit.
    fp8_refill (with fp8_staging; opt-in, GPU-tested in part): each producer thread converts the staging chunks it
      copied itself (at its copies' positions, `fp8_copy_position`), position by position, and refills each with
      its copy of the next pool tile's chunk, a cp.async group per position (`convert_fp8_tiles(refill=...)`): every
      staging byte is copied, waited for and read by one thread, so no warpgroup sync, and tile s + 1's copies start
      one position into tile s's conversion rather than after it (the staged chain per tile, copy latency +
      conversion, becomes about copy latency + one position's conversion).
    overlap (3 consumers): FlashAttention-3's intra-warpgroup overlap on the runs of unmasked tiles: tile t + 1's
      S = Q K^T is issued before tile t's softmax, which runs while the tensor cores compute it. The same tiles, order
      and arithmetic as without it (the same bits); masked tiles run as before.
    tma_new_tiles: load new-key tiles that lie wholly before the batch's last token by TMA (needs tokens a multiple
      of 8 and >= block_kv: Mosaic's TMA moves whole 8-row tiles, no taller than the array); the others by cp.async.
    page_rows: 0, or P' = min(page size, block_kv) when the lists are whole pages (`ExtendMetadata.page_size`: each
      sequence's listed prefix starts a page, and the slots of each run of P' listed keys are consecutive from a
      multiple of P'): prefix tiles wholly inside the listed prefix (the unified form: inside its cached prefix,
      prefix_lens) come by TMA, block_kv / P' copies of P' rows, each from the slot its first key lists rounded down
      to a multiple of P' (slot 0 for one outside the pool, which holds whole pages: a bad list reads wrong rows of the
      pool, never outside it). The other tiles by cp.async, row by row.
    page_issue: how the page copies are issued: "pallas" (one Pallas copy per page, each with a warpgroup barrier and
      an arrival on the slot's page barrier) or "inline" (experimental, `issue_pages`: one thread issues a tile's
      copies, completing the slot's row-copy mbarrier; not yet run on a GPU).

    Optional features (static; each adds code only when on, the plain causal kernel is unchanged without them):
    sliding_window W >= 0: a query at t sees keys at t - W..t (listed coordinates: a prefix list cut for the window
      shifts query and key positions alike). The CTA loads and consumes only steps from `window_first_step` of its
      first query; a warpgroup whose own range starts later releases the tiles before it (a head flush that waits
      each tile's barriers, so every mbarrier phase is still waited in order); tiles that reach below a
      warpgroup's window (`window_full_step` of its last valid row) are masked per row. The unified form takes a
      window on uncut lists (tiles at fixed listed offsets: `unified_window_first_step`, `unified_window_full_step`).
    logit_cap > 0: s = cap * tanh(s * sm_scale / cap) (tanh.approx.f32 under approx_math) before the mask; the
      multiply by cap * log2(e) is folded into the exponent's FMA as sm_scale * log2(e) is without a cap.
    sinks: f32[q_heads], natural-log logits joining each row's denominator only (folded in at the end, in base 2
      at the common max).
    custom_mask: bool/u8/i8[mask_len] (mask_len >= 1; an entry is visible where its byte != 0), SGLang's flat mask:
      sequence b's rows at mask_indptr[b] (i32/i64[batch + 1]), row-major [q_len, kv_start_pos + prefix_len +
      q_len] (the columns of keys dropped from the list first).
      It replaces causal: the CTA takes the sequence's whole prefix and all its new keys, as non-causal, and every
      new-key tile (with skip_prefix_custom_mask=False every prefix tile too) is masked by entries gathered per tile
      (`custom_mask_tile`). With a sliding window (verify on a sliding-window layer) the window bounds each row's
      keys from below and the tiles reaching below it are masked by both. Two-stage form only; needs kv_start_pos.
    draft_mask: i32[rows, words], the compact form of a tree mask (instead of custom_mask): query row r sees its
      sequence's new token j iff bit j % 32 of word j // 32 of row r is set, and every listed prefix key (as
      skip_prefix_custom_mask). The custom mask's schedule, the new-key tiles' entries from `draft_bits_tile`.
    latent_v_dim: absorbed MLA's latent cache (v_pool = v_new = None): V is the first latent_v_dim dims of each K
      row, read from the K tile in shared memory (no V ring: a ring slot is released after P V, not after Q K^T).
      k_pool / k_new rows may be narrower than q's (MLA's 288): the producer copies them by cp.async, zero-filling
      the columns up to q's width (a multiple of 64, q's extra columns zeros too), so tma_new_tiles and page_rows
      must be off. O goes through the o_rows buffer in o_rows_columns chunks, whole tiles too (Q's buffer is wider
      than O). Two-stage form. Not yet run on a GPU (issue 22's T288: each K tile then serves 128 query rows of
      one head where the MLA kernel's serves 64 (token, head) rows, and the two consumers alternate as here).
    """
    q_rows, q_heads, qk_dim = q.shape  # qk_dim: the width of Q and the K tiles in shared memory
    latent = latent_v_dim is not None
    if latent:
        if v_pool is not None or v_new is not None or prefix_lens is not None:
            raise ValueError("a latent cache (latent_v_dim) takes v_pool = v_new = None, in the two-stage form")
        if tma_new_tiles or page_rows:
            raise ValueError("a latent cache's rows come by cp.async: tma_new_tiles and page_rows must be off")
        v_dim = int(latent_v_dim)
        k_row_dim = k_pool.shape[2]  # the latent rows' width in memory (288 or 576): <= qk_dim, q's padded width
        if qk_dim % 64 or not v_dim <= k_row_dim <= qk_dim < k_row_dim + 64:
            raise ValueError(f"q's width {qk_dim} must be the latent rows' {k_row_dim} rounded up to 64, and "
                             f"latent_v_dim {v_dim} at most {k_row_dim}")
    else:
        v_dim = v_pool.shape[2]
        k_row_dim = qk_dim
    o_in_q = v_dim == qk_dim  # whole O tiles reuse Q's (swizzled) buffer; else every O tile goes through o_rows
    o_whole_buffer = not o_in_q and not latent  # whole O tiles go through o_rows in one piece (else in chunks)
    if v_dim % o_rows_columns or (o_whole_buffer and o_rows_columns != v_dim):
        raise ValueError(f"o_rows_columns {o_rows_columns} must divide v_dim {v_dim} (equal it when v_dim != qk_dim)")
    unified = prefix_lens is not None
    if unified and (k_new is not None or v_new is not None):
        raise ValueError("the unified form reads every key from the pool: give k_new = v_new = None")
    tokens = q_rows if unified else k_new.shape[0]
    kv_heads = k_pool.shape[1]
    pool_rows = k_pool.shape[0]
    batch = qo_indptr.shape[0] - 1
    group = q_heads // kv_heads
    dtype = q.dtype
    if consumers not in REGISTERS:
        raise ValueError(f"consumers must be one of {sorted(REGISTERS)}; got {consumers!r}")
    if consumers == 3 and (qk_dim > 64 or v_dim > 64 or latent):
        raise ValueError(f"3 consumer warpgroups take head dims 64/64 (their accumulators in {REGISTERS[3][0]} "
                         f"registers); got {qk_dim}/{v_dim}{' (latent)' if latent else ''}")
    if heads_per_cta not in (1, 2) or group % heads_per_cta or (heads_per_cta == 2 and consumers != 2):
        raise ValueError(f"heads_per_cta must be 1, or 2 with an even q/kv head group and 2 consumers; got "
                         f"{heads_per_cta} at group {group} with {consumers} consumers")
    packed = heads_per_cta > 1
    scheduled = consumers == 2  # the ping-pong schedule barrier (see `consumers`)
    if overlap and (scheduled or latent):
        raise ValueError("overlap takes 3 consumer warpgroups (no schedule barrier) and K/V tiles of their own")
    consumer_registers, producer_registers = REGISTERS[consumers]
    check_register_split(f"REGISTERS[{consumers}] = {REGISTERS[consumers]}",
                         (consumer_registers,) * consumers + (producer_registers,))
    cta_rows = head_rows_per_cta(consumers, block_q, heads_per_cta)
    q_tiles = -(-(max_extend_len + 7) // cta_rows)  # + 7: tiles start up to 7 rows before a sequence
    window = int(sliding_window) if sliding_window is not None and sliding_window >= 0 else None
    byte_mask = custom_mask is not None
    bits = draft_mask is not None
    custom = byte_mask or bits  # a mask replacing causal: the non-causal schedule, every new-key tile masked
    if byte_mask and bits:
        raise ValueError("give custom_mask or draft_mask, not both")
    if byte_mask and jnp.dtype(custom_mask.dtype).itemsize != 1:  # `custom_mask_tile` reads one byte an entry
        raise ValueError(f"custom_mask must be bool, u8 or i8 (one byte an entry); got {custom_mask.dtype}")
    if window is not None and not (causal or custom):
        raise ValueError("a sliding window is taken with causal calls (or a custom mask) only")
    if byte_mask and (mask_indptr is None or (kv_start_pos is None and not unified)):
        raise ValueError("a custom mask needs mask_indptr (and, two-stage, kv_start_pos)")
    if bits and unified:
        raise ValueError("a draft mask is taken by two-stage calls")
    if custom:
        causal = False  # the mask decides alone (as in SGLang's kernels); the schedule is the non-causal one
    mask_prefix = byte_mask and not skip_prefix_custom_mask
    logit_cap = float(logit_cap) if logit_cap and logit_cap > 0 else None
    # The exponent's scale: scores (or with a soft cap their tanh, in [-1, 1]) times this are log2 units.
    scale_log2 = float(sm_scale) * LOG2E if logit_cap is None else logit_cap * LOG2E
    has_sinks = sinks is not None
    xai = int(xai_temperature_len) if xai_temperature_len is not None and xai_temperature_len > 0 else None
    if xai is not None and kv_start_pos is None:
        raise ValueError("xai temperature needs kv_start_pos (each sequence's first listed key's position)")
    if unified:
        tma_new_tiles = False  # every tile comes from the pool (by cp.async, or whole pages by TMA)
    if page_rows and (page_rows % 8 or block_kv % page_rows or pool_rows % page_rows):
        raise ValueError(f"page_rows {page_rows} must be a multiple of 8 dividing block_kv ({block_kv}) and the pool's "
                         f"rows ({pool_rows})")
    if page_issue not in ("pallas", "inline"):
        raise ValueError(f"page_issue must be 'pallas' or 'inline'; got {page_issue!r}")
    pallas_pages = bool(page_rows) and page_issue == "pallas"  # page tiles on their own (Pallas) barriers
    capacity = kv_indices.shape[0]
    fp8 = jnp.dtype(k_pool.dtype).itemsize == 1
    if fp8:
        if (kv_scales is None or latent or page_rows or v_pool.dtype != k_pool.dtype or qk_dim != v_dim
                or jnp.dtype(k_pool.dtype) not in FP8_PTX_NAMES or jnp.dtype(dtype) not in OUT_PTX_NAMES):
            raise ValueError(f"fp8 pools ({k_pool.dtype}/{v_pool.dtype}) take kv_scales, one fp8 format (e4m3fn or "
                             f"e5m2), bf16/f16 q, equal head dims, no latent cache and no page copies")
        if kv_scales.shape not in ((2 * kv_heads,), (2 * kv_heads + 1,)) or kv_scales.dtype != jnp.float32:
            raise ValueError(f"kv_scales must be f32[{2 * kv_heads}] (or one unread element more, "
                             f"`jaxattn.fp8.scale_table_operand`); got {kv_scales.dtype}{list(kv_scales.shape)}")
        check_fp8_tile(block_kv, qk_dim)
    elif kv_scales is not None:
        raise ValueError("kv_scales is given exactly when the pools are fp8")
    if fp8_tiles not in FP8_TILES:
        raise ValueError(f"fp8_tiles must be one of {FP8_TILES}; got {fp8_tiles!r}")
    if fp8_staging and not fp8:
        raise ValueError(f"fp8_staging takes fp8 pools; got {k_pool.dtype}")
    if fp8_refill and not fp8_staging:
        raise ValueError("fp8_refill takes fp8_staging (it refills the staging tiles)")
    f16_tiles = fp8 and fp8_tiles == "f16"  # pool tiles in f16, scales folded into the consumers' arithmetic
    if f16_tiles and not f16_tiles_fit(unified=unified, o_rows_columns=o_rows_columns, qk_dim=qk_dim):
        got = "the unified form" if unified else f"o_rows_columns {o_rows_columns}"
        raise ValueError(f"fp8_tiles='f16' takes the two-stage form with o_rows_columns == qk_dim (the Q copy shares "
                         f"the O-rows buffer); got {got}")
    # Pool tiles (f16) and new-key tiles (q's dtype) share the rings' slots: two typed views of one allocation.
    mixed_rings = f16_tiles and jnp.dtype(dtype) != jnp.dtype(jnp.float16)

    def body(qo_indptr_ref, kv_indptr_ref, kv_indices_ref, q_ref, k_new_ref, v_new_ref, k_pool_ref, v_pool_ref,
             sinks_ref, start_pos_ref, prefix_lens_ref, mask_ref, mask_indptr_ref, bits_ref, scales_ref, out_gmem,
             scoped):
        buffers, (k_ready, v_ready, q_ready), (k_free, v_free), schedule = scoped[:4]
        if latent:  # no V ring: V is read from the K tiles
            (qo_smem2, o_rows_smem2, k_smem, kv_bars), v_smem = buffers, None
        else:
            qo_smem2, o_rows_smem2, k_smem, v_smem, kv_bars = buffers[:5]
        k_staging, v_staging = buffers[5:] if fp8_staging else (None, None)
        q16_smem2 = None
        k16_smem, v16_smem = k_smem, v_smem  # the pool tiles' view of the rings
        if f16_tiles:  # (o_rows, Q16) share one buffer; mixed rings: (q's dtype view, f16 view)
            o_rows_smem2, q16_smem2 = o_rows_smem2
            if mixed_rings:
                (k_smem, k16_smem), (v_smem, v16_smem) = k_smem, v_smem
        page_ready = scoped[4] if pallas_pages else None  # (K, V): per slot, one TMA arrival per page copy of a tile
        cta_head = lax.axis_index("heads") * heads_per_cta  # the CTA's (first) q head
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
        kv_start = kv_indptr_ref[seq]
        # Listed keys from the pool: the cached prefix (two-stage), or every key, prefix then new (unified).
        prefix_len = kv_indptr_ref[seq + 1] - kv_start
        token_end = jnp.minimum(qo_indptr_ref[batch], tokens)  # rows of k_new/v_new past it are copied as zeros
        # Non-causal: every new key of the sequence (all its rows, also those past max_extend_len).
        key_end = jnp.minimum(qo_indptr_ref[seq + 1], token_end)
        cta_row = base + tile * cta_rows  # first (absolute) query row of this CTA
        if unified:
            prefix_len = jnp.maximum(prefix_len, 0)
        pre_steps = _cdiv(prefix_len, block_kv)
        if unified:
            # Query t of the sequence sits at listed position q_prefix + t; causal, it sees the listed keys up to it.
            q_prefix = prefix_lens_ref[seq]
        # Whole pages: prefix tiles [0, page_steps) lie wholly inside the paged part of the list (two-stage: the
        # prefix; unified: the cached prefix, the new tokens' slots being the caller's) and come by TMA.
        if page_rows:
            paged_len = jnp.minimum(q_prefix, prefix_len) if unified else prefix_len
            page_steps = jnp.maximum(lax.div(paged_len, jnp.int32(block_kv)), 0)
        else:
            page_steps = 0
        if unified:
            def unified_steps(last_row):  # the K/V steps rows up to `last_row` (absolute) see, from step 0
                if not causal:
                    return pre_steps
                return _cdiv(jnp.clip(q_prefix + (last_row - q_start) + 1, 0, prefix_len), block_kv)

            cta_steps = unified_steps(jnp.minimum(cta_row + cta_rows, q_end) - 1)
        elif causal:
            # K/V tiles the CTA needs: the whole prefix, then new keys up to its last valid row.
            cta_steps = pre_steps + _cdiv(jnp.minimum(cta_row + cta_rows, q_end) - base, block_kv)
        else:
            # At least one new-key tile, as causal CTAs have: the consumers' loops assume steps past the prefix exist
            # (with bad metadata, key_end <= q_start, that tile's keys are all masked).
            cta_steps = pre_steps + jnp.maximum(_cdiv(key_end - base, block_kv), 1)
        # The CTA's first step: 0, or under a window the one its first query row needs first. Producer and both
        # consumers start their bookkeeping (ring slots' first uses, cp.async phases) from this one value.
        if window is None:
            first_step = 0
        elif unified:
            first_step = jnp.minimum(unified_window_first_step(jnp.maximum(cta_row, q_start) - q_start, q_prefix,
                                                               window=window, block_kv=block_kv), cta_steps)
        else:
            first_step = cta_window_first_step(cta_row, q_start, prefix_len, lead, pre_steps, cta_steps,
                                               window=window, block_kv=block_kv)

        def schedule_sync():
            if scheduled:
                plgpu.barrier_arrive(schedule)
                plgpu.barrier_wait(schedule)

        # New-key tiles wholly before token_end come by TMA (their rows are provably 8-aligned: base is): new tiles
        # [0, tma_tiles). The prefix tiles and the new tiles from tma_tiles on (they reach past token_end: rows
        # zero-filled) come by cp.async. Steps [pre_steps, tail_step) are the TMA ones.
        tma_tiles = jnp.maximum(lax.div(token_end - base, jnp.int32(block_kv)), 0) if tma_new_tiles else 0
        tail_step = pre_steps + tma_tiles

        def by_tma(step):
            return (step >= pre_steps) & (step < tail_step)

        fast_prefix_waits = PREFIX_FAST_WAITS and not pallas_pages and not unified

        def wait_ready(which, step, ready, prefix=False, new_key=False):
            # Tile `step` sits in slot step % stages. A TMA tile completes Pallas' barrier `ready` of the slot (a
            # tile of whole pages: `page_ready`; Pallas tracks their phases); a cp.async tile (or with page_issue
            # "inline" a tile of pages) completes the slot's own mbarrier in kv_bars (phase: its use count).
            # prefix (only with fast_prefix_waits, for a step < pre_steps): `prefix_cp_async_uses`, no TMA branch.
            # new_key (a step >= pre_steps, so never one of whole pages): no `page_ready` branch.
            slot = lax.rem(step, jnp.int32(stages))
            if prefix:
                uses = prefix_cp_async_uses(step, slot, stages=stages, first_step=None if window is None else first_step)
                return wait_barrier(kv_bars, which * stages + slot, lax.rem(uses, 2))
            uses = cp_async_uses(step, slot, pre_steps=pre_steps, tail_step=tail_step, stages=stages,
                                 first_step=None if window is None else first_step,
                                 page_steps=page_steps if pallas_pages else 0)
            cp_async = lambda: wait_barrier(kv_bars, which * stages + slot, lax.rem(uses, 2))
            if not tma_new_tiles and not pallas_pages:
                return cp_async()
            copied = []  # the conditions of the TMA kinds on
            if tma_new_tiles:
                copied.append(by_tma(step))
                pl.when(copied[-1])(lambda: plgpu.barrier_wait(ready.at[slot]))
            if pallas_pages and not new_key:
                copied.append(step < page_steps)
                pl.when(copied[-1])(lambda: plgpu.barrier_wait(page_ready[which].at[slot]))
            if not copied:
                return cp_async()
            pl.when(jnp.logical_not(functools.reduce(jnp.logical_or, copied)))(cp_async)

        @pl.when((cta_row < q_end) & (q_start < q_end))
        def _cta():
            init_barriers(kv_bars, WARPGROUP)  # K then V barrier of each slot: one arrival per producer thread

            @pl.when(wg < consumers)
            def _consumer():
                plgpu.set_max_registers(consumer_registers, action="increase")
                qo_smem = qo_smem2.at[wg]
                # This warpgroup's q head and first query row (it may hold no valid row): packed, the CTA's rows of
                # head cta_head + wg; else the CTA's head, rows from cta_row + wg * block_q.
                head = cta_head + wg if packed else cta_head
                wg_row = cta_row if packed else cta_row + wg * block_q
                wg_rel = wg_row - base  # ... counted from base, as key tile offsets are
                t0 = wg_row - q_start  # its row 0, from the sequence's first new token (< 0: previous sequence)
                wg_last_row = jnp.minimum(wg_row + block_q, q_end) - 1
                if unified:
                    wg_steps = unified_steps(wg_last_row)
                elif causal:
                    wg_steps = pre_steps + _cdiv(wg_last_row + 1 - base, block_kv)
                else:
                    wg_steps = cta_steps
                new_steps = wg_steps - pre_steps
                # Prefix tiles with no key past the prefix (none run unmasked when the mask covers the prefix).
                full_pre = 0 if mask_prefix else lax.div(prefix_len, jnp.int32(block_kv))
                # New-key tiles every row sees whole: none of the previous sequence's keys (tile 0 when lead > 0),
                # last key <= the warpgroup's first row (causal) or before the sequence's end (non-causal).
                first_full = jnp.where(lead > 0, 1, 0)
                last_seen = wg_rel + 1 if causal else key_end - base
                end_full = jnp.maximum(jnp.minimum(lax.div(last_seen, jnp.int32(block_kv)), new_steps), first_full)
                if custom:
                    end_full = first_full  # every new-key tile is masked
                if byte_mask and unified:
                    # The sequence's mask rows: [q_len, listed keys], column j = listed key j; row 0 is mask row t0.
                    mask_width = prefix_len
                elif byte_mask:
                    # The sequence's mask rows: [q_len, start + prefix + q_len] (unclamped lengths, as SGLang lays
                    # them out); this warpgroup's row 0 is mask row t0.
                    mask_start_pos = start_pos_ref[seq]
                    mask_width = mask_start_pos + prefix_len + (qo_indptr_ref[seq + 1] - q_start)

                plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(wg_row, block_q), head], qo_smem, q_ready.at[wg])
                plgpu.barrier_wait(q_ready.at[wg])
                if f16_tiles:
                    # The pool tiles' Q: each row times factor = F16_Q_ROW_MAX / max|row| (at most 2^64: a zero or
                    # tiny row stays finite) and times sign(k_scale), in f16. Their scores are then q.k16 *
                    # factor * sign, given back per row by `pool_score_gain`. NaN in a row makes its copy NaN (as
                    # its scores would be).
                    kv_head_q = lax.div(head, jnp.int32(group))
                    k_scale = scales_ref[kv_head_q]
                    q16_smem = q16_smem2.at[wg]
                    q_rows = plgpu.load(qo_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                    factor = jnp.minimum(F16_Q_ROW_MAX / jnp.max(jnp.abs(q_rows), axis=1), 2.0 ** 64)
                    signed = factor * jnp.where(k_scale < 0, -1.0, 1.0)
                    q16_smem[...] = (q_rows * lax.broadcast_in_dim(signed, q_rows.shape, [0])).astype(jnp.float16)
                    plgpu.commit_smem()  # the stores before wgmma reads the copy (async proxy)
                    pool_gain = pool_score_gain(k_scale, factor)
                    v_scale = scales_ref[kv_heads + kv_head_q]

                # Under a window a valid row's first tiles may hold none of its keys (they straddle another row's
                # window edge): a finite start keeps exp2(m_i - m_new) at 1 there, never exp2(-inf + inf) = NaN. The
                # unified form starts finite too, so a row that sees no key (bad metadata) ends with l = 0, not NaN.
                m_init = -jnp.inf if window is None and not unified and not custom else -1e30
                m_i = plgpu.layout_cast(jnp.full((block_q,), m_init, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
                l_i = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
                acc = plgpu.layout_cast(jnp.full((block_q, v_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)
                # Listed position of the warpgroup's row 0 (query t at listed position q_pos0 + t), where used.
                q_pos0 = (q_prefix if unified else prefix_len) + t0 if unified or xai is not None else None

                if xai is None:
                    row_scale = scale_log2
                else:
                    # Grok's temperature per row: log2(pos) / log2(L) for absolute positions pos > L, else 1,
                    # folded into the exponent's scale once per warpgroup (the reduction only changes the layout).
                    rows = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 0, layout=plgpu.Layout.WGMMA)
                    position = (start_pos_ref[seq] + q_pos0 + rows).astype(jnp.float32)
                    factor = jnp.where(position > float(xai), jnp.log2(jnp.maximum(position, 1.0)) * (1.0 / np.log2(xai)),
                                       1.0)
                    row_scale = factor.max(axis=1) * scale_log2

                if window is None:
                    if unified:
                        pl.when(wg_steps > 0)(lambda: wait_ready(0, jnp.int32(0), k_ready))
                    else:
                        wait_ready(0, jnp.int32(0), k_ready)
                    pl.when(wg == 1)(schedule_sync)
                else:
                    # This warpgroup's query rows are t0..; its steps: [wg_first, wg_steps), masked for the window up
                    # to win_full; the CTA's steps from first_step before wg_first are released unused (head flush).
                    if unified:
                        wg_first = jnp.clip(unified_window_first_step(jnp.maximum(t0, 0), q_prefix, window=window,
                                                                      block_kv=block_kv), first_step, wg_steps)
                        win_full = jnp.clip(unified_window_full_step(wg_last_row - q_start, q_prefix, window=window,
                                                                     block_kv=block_kv), wg_first, wg_steps)
                    else:
                        wg_first, win_full = warpgroup_window_steps(
                            wg_row, q_start, q_end, prefix_len, lead, pre_steps, first_step, wg_steps, window=window,
                            block_q=block_q, block_kv=block_kv)
                    pl.when(wg == 1)(schedule_sync)

                def soft_cap(s, gain=None):  # tanh(s * sm_scale / cap); the cap's multiply joins the exponent's FMA
                    if logit_cap is None:
                        return s
                    if gain is None:
                        return jnp.tanh(s * (float(sm_scale) / logit_cap))
                    # (an f16 pool tile: its per-row score factor inside the tanh)
                    return jnp.tanh(s * lax.broadcast_in_dim(gain * (float(sm_scale) / logit_cap), s.shape, [0]))

                def online_softmax(s, acc, m_i, l_i, gain=None):
                    # `online_softmax_tile` with c = sm_scale * log2(e) (with a soft cap cap * log2(e): s is then
                    # the tanh), times each row's xai factor. Returns (acc rescaled, l, m, p in q's dtype). gain: an
                    # f16 pool tile's per-row score factor (>= 0; `pool_gain`), joining c (with a soft cap it went
                    # inside the tanh); p is then in f16, as the tile's V.
                    row_c = None if xai is None else row_scale
                    if gain is not None and logit_cap is None:
                        row_c = gain * (scale_log2 if row_c is None else row_c)
                    p, acc, m_new, l_i, _ = online_softmax_tile(s, acc, m_i, l_i,
                                                                scale_log2 if row_c is None else row_c)
                    p16 = p.astype(dtype if gain is None else jnp.float16)
                    return lax.optimization_barrier((acc, l_i, m_new, p16))

                def operands(pool):
                    # (Q, K ring, V ring, score gain) of a tile: an f16 pool tile's, or q's dtype's (gain None).
                    if f16_tiles and pool:
                        return q16_smem, k16_smem, v16_smem, pool_gain
                    return qo_smem, k_smem, v_smem, None

                def kv_step(step, carry, mask_kind=None, pool=False, prefix=False, new_key=False):
                    # pool: the tile comes from the pool (matters with fp8_tiles="f16": `operands`). prefix: a prefix
                    # step (step < pre_steps) whose waits take the fast form (`fast_prefix_waits`). new_key: a step of
                    # the new keys (>= pre_steps), as the next one: `wait_ready`'s new_key.
                    acc, m_i, l_i = carry
                    slot = lax.rem(step, jnp.int32(stages))
                    q_tile, k_ring, v_ring, gain = operands(pool)
                    gathers = mask_kind in ("custom", "window_new") or (mask_prefix and mask_kind in (
                        "custom_prefix", "window_prefix")) or (byte_mask and mask_kind == "unified")
                    if gathers and unified:  # the listed keys' columns
                        tile_mask = custom_mask_tile(mask_ref, mask_indptr_ref, seq, t0, mask_width, step * block_kv,
                                                     block_q=block_q, block_kv=block_kv)
                    elif gathers and bits:
                        # The new keys' draft bits of the warpgroup's rows (before the QK^T wgmma, as below).
                        tile_mask = draft_bits_tile(bits_ref, wg_row, (step - pre_steps) * block_kv - lead,
                                                    block_q=block_q, block_kv=block_kv)
                    elif gathers:
                        # Gathered before the QK^T wgmma is issued: the loads' latency overlaps it.
                        if mask_kind in ("custom_prefix", "window_prefix"):
                            column0 = mask_start_pos + step * block_kv
                        else:
                            column0 = mask_start_pos + prefix_len + (step - pre_steps) * block_kv - lead
                        tile_mask = custom_mask_tile(mask_ref, mask_indptr_ref, seq, t0, mask_width, column0,
                                                     block_q=block_q, block_kv=block_kv)

                    def qk(s_ref):
                        plgpu.wgmma(s_ref, q_tile, k_ring.at[slot].transpose((1, 0)))
                        schedule_sync()
                        return s_ref[...]

                    s = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
                    if not latent:  # (a latent tile holds V too: released after P V)
                        plgpu.barrier_arrive(k_free.at[slot])
                    s = soft_cap(s, gain)
                    if mask_kind is not None:
                        cols = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1, layout=plgpu.Layout.WGMMA)
                        rows = functools.partial(plgpu.broadcasted_iota, jnp.int32, (block_q, block_kv), 0,
                                                 layout=plgpu.Layout.WGMMA)  # each tile row's index, where a mask needs it
                        if mask_kind == "prefix":  # the prefix's last tile: keys past the prefix are padding
                            visible = step * block_kv + cols < prefix_len
                        elif mask_kind == "unified":
                            # Listed key j: inside the list, (causal) at or before the row's listed position and
                            # (a window) at or after that position - W.
                            key = step * block_kv + cols
                            visible = key < prefix_len
                            if causal:
                                visible = visible & (key <= q_pos0 + rows())
                            if byte_mask:  # replaces causal: where the row's mask entries say so
                                visible = visible & (tile_mask != 0)
                            if window is not None:
                                visible = visible & (key >= q_pos0 + rows() - window)
                        elif mask_kind == "window":
                            # Any tile (prefix or new) reaching below the window: key at position k (see
                            # window_first_step) is visible to row t iff max(t - W, lo) <= k <= min(t, hi), lo/hi
                            # the tile's in-sequence keys: prefix keys up to -1 (not its padding), new keys from 0
                            # (not the lead rows of the previous sequence); causal for new keys.
                            from_pool = step < pre_steps
                            key = jnp.where(from_pool, step * block_kv - prefix_len,
                                            (step - pre_steps) * block_kv - lead) + cols
                            t = t0 + rows()
                            lo = jnp.where(from_pool, -prefix_len, 0)
                            hi = jnp.where(from_pool, -1, jnp.int32(2**30))
                            visible = (key >= jnp.maximum(t - window, lo)) & (key <= jnp.minimum(t, hi))
                        elif mask_kind == "window_prefix":
                            # With a custom mask (which replaces causal; the window still bounds each row from below,
                            # as in the reference), a prefix tile reaching below the window: listed prefix keys at
                            # -prefix_len..-1, where the mask rows say so (visible with skip_prefix_custom_mask).
                            key = step * block_kv - prefix_len + cols
                            visible = (key >= jnp.maximum(t0 + rows() - window, -prefix_len)) & (key <= -1)
                            if mask_prefix:
                                visible = visible & (tile_mask != 0)
                        elif mask_kind == "window_new":
                            # ... and a new-key tile: the sequence's new keys from 0 (not the previous sequence's lead
                            # rows) to its last, where the mask rows say so.
                            key = (step - pre_steps) * block_kv - lead + cols
                            visible = ((key >= jnp.maximum(t0 + rows() - window, 0)) & (key < key_end - q_start)
                                       & (tile_mask != 0))
                        elif mask_kind == "new":  # non-causal: key k (from base) is the sequence's iff lead <= k < end
                            key = (step - pre_steps) * block_kv + cols
                            visible = (key >= lead) & (key < key_end - base)
                        elif mask_kind == "custom":  # the sequence's new keys, where its mask rows say so
                            key = (step - pre_steps) * block_kv + cols
                            visible = (key >= lead) & (key < key_end - base) & (tile_mask != 0)
                        elif mask_kind == "custom_prefix":  # listed prefix keys, where the mask rows say so
                            visible = (step * block_kv + cols < prefix_len) & (tile_mask != 0)
                        else:  # "causal": key k (from base) is visible to row r iff lead <= k <= wg_rel + r
                            key = (step - pre_steps) * block_kv + cols
                            visible = (key >= lead) & (key <= wg_rel + rows())
                        s = jnp.where(visible, s, -jnp.inf)
                    acc, l_i, m_new, p16 = online_softmax(s, acc, m_i, l_i, gain)
                    if scheduled:
                        plgpu.barrier_arrive(schedule)  # softmax done
                    if not latent:
                        wait_ready(1, step, v_ready, prefix=prefix, new_key=new_key)
                    if scheduled:
                        plgpu.barrier_wait(schedule)  # the other warpgroup's matrix work is issued

                    def pv(acc_ref):
                        v_tile = k_smem.at[slot, :, pl.ds(0, v_dim)] if latent else v_ring.at[slot]
                        plgpu.wgmma(acc_ref, p16, v_tile)
                        next_step = step + 1
                        if prefix:  # the next tile is a prefix tile too, but after the prefix's last one
                            next_prefix = next_step < pre_steps
                            pl.when(next_prefix & (next_step < wg_steps))(
                                lambda: wait_ready(0, next_step, k_ready, prefix=True))
                            pl.when(~next_prefix & (next_step < wg_steps))(lambda: wait_ready(0, next_step, k_ready))
                        else:
                            pl.when(next_step < wg_steps)(lambda: wait_ready(0, next_step, k_ready, new_key=new_key))

                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                    plgpu.barrier_arrive((k_free if latent else v_free).at[slot])
                    return acc, m_new, l_i

                def overlapped_run(lo, hi, carry, pool=False, new_key=False):
                    # The unmasked tiles [lo, hi) with FlashAttention-3's intra-warpgroup overlap: tile t + 1's
                    # S = Q K^T is issued before tile t's softmax and read after it, so the tensor cores compute it
                    # while this warpgroup's softmax runs. The same tiles, order and arithmetic as kv_step's; entered,
                    # like kv_step, with tile lo's K landed, and leaves tile hi's K waited (if the range has it).
                    q_tile, k_ring, v_ring, gain = operands(pool)

                    def run(carry):
                        def first(s_ref):
                            plgpu.wgmma(s_ref, q_tile, k_ring.at[lax.rem(lo, jnp.int32(stages))].transpose((1, 0)))
                            return s_ref[...]

                        s = pl.run_scoped(first, plgpu.ACC((block_q, block_kv), jnp.float32))
                        plgpu.barrier_arrive(k_free.at[lax.rem(lo, jnp.int32(stages))])

                        def tile(step, acc, m_i, l_i, s, has_next):
                            slot = lax.rem(step, jnp.int32(stages))
                            s = soft_cap(s, gain)
                            if has_next:
                                next_slot = lax.rem(step + 1, jnp.int32(stages))

                                def next_scores_and_softmax(s_ref):
                                    wait_ready(0, step + 1, k_ready, new_key=new_key)
                                    plgpu.wgmma(s_ref, q_tile, k_ring.at[next_slot].transpose((1, 0)))
                                    return (*online_softmax(s, acc, m_i, l_i, gain), s_ref[...])

                                acc, l_i, m_new, p16, s_next = pl.run_scoped(
                                    next_scores_and_softmax, plgpu.ACC((block_q, block_kv), jnp.float32))
                                plgpu.barrier_arrive(k_free.at[next_slot])  # read by the completed S wgmma
                            else:
                                acc, l_i, m_new, p16 = online_softmax(s, acc, m_i, l_i, gain)
                                s_next = None
                            wait_ready(1, step, v_ready, new_key=new_key)

                            def pv(acc_ref):
                                plgpu.wgmma(acc_ref, p16, v_ring.at[slot])
                                if not has_next:  # kv_step's entry condition for the step after the range
                                    pl.when(hi < wg_steps)(lambda: wait_ready(0, hi, k_ready, new_key=new_key))

                            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                            plgpu.barrier_arrive(v_free.at[slot])
                            return acc, m_new, l_i, s_next

                        def body(step, state):
                            return tile(step, *state, has_next=True)

                        acc, m_i, l_i, s = lax.fori_loop(lo, hi - 1, body, (*carry, s))
                        return tile(hi - 1, acc, m_i, l_i, s, has_next=False)[:3]

                    return lax.cond(lo < hi, run, lambda carry: carry, carry)

                def step_fn(mask_kind=None, pool=False, new_key=False):
                    # kv_step for a loop (the same function object where nothing is bound: one traced body).
                    bound_args = {}
                    if mask_kind:
                        bound_args["mask_kind"] = mask_kind
                    if new_key:
                        bound_args["new_key"] = True
                    if pool and f16_tiles:
                        bound_args["pool"] = True
                    if pool and fast_prefix_waits:  # the loops given pool=True run prefix steps only
                        bound_args["prefix"] = True
                    return functools.partial(kv_step, **bound_args) if bound_args else kv_step

                def unmasked(lo, hi, carry, pool=False, new_key=False):  # a run of tiles every row sees whole
                    if overlap:
                        return overlapped_run(lo, hi, carry, pool, new_key)
                    return lax.fori_loop(lo, hi, step_fn(pool=pool, new_key=new_key), carry)

                def flush_step(step, _):
                    # Tiles the producer loaded for another warpgroup's longer causal range: release them in step.
                    # Without the schedule barrier's lockstep a flushing warpgroup could run ahead and arrive on a
                    # slot's free barrier for a later tile before the others' arrivals for the earlier one completed
                    # its phase: it waits for each tile to land first (the tile's load needed that phase).
                    slot = lax.rem(step, jnp.int32(stages))
                    if not scheduled:
                        wait_ready(0, step, k_ready)
                    plgpu.barrier_arrive(k_free.at[slot])
                    if not latent:
                        if not scheduled:
                            wait_ready(1, step, v_ready)
                        plgpu.barrier_arrive(v_free.at[slot])
                    schedule_sync()
                    schedule_sync()

                def head_flush_step(step, _):
                    # Under a window: tiles the producer loaded for the CTA's first rows that this warpgroup's rows
                    # do not see. Waiting their barriers keeps every phase waited in order (Pallas counts the TMA
                    # barriers' phases per thread; a cp.async phase two uses ahead would be ambiguous).
                    slot = lax.rem(step, jnp.int32(stages))
                    wait_ready(0, step, k_ready)
                    plgpu.barrier_arrive(k_free.at[slot])
                    schedule_sync()
                    if not latent:
                        wait_ready(1, step, v_ready)
                        plgpu.barrier_arrive(v_free.at[slot])
                    schedule_sync()

                new_kind = "custom" if custom else "causal" if causal else "new"
                # The two-stage form's new-key loops (steps >= pre_steps) wait without the whole-page branch: with it
                # on every new-key tile E2 at page 64 (no prefix) ran ~1% behind page 1 on the H100 (86f93dc).
                new_keys_apart = pallas_pages and not unified
                masked = step_fn(new_kind, new_key=new_keys_apart)
                carry = (acc, m_i, l_i)
                if window is not None:  # the CTA's steps before this warpgroup's first, released unused (head flush)
                    lax.fori_loop(first_step, wg_first, head_flush_step, None)
                    pl.when(wg_first < wg_steps)(lambda: wait_ready(0, wg_first, k_ready))
                if unified:
                    # Tiles in key order at fixed listed offsets: [0, full_end) hold only keys every valid row sees
                    # (unmasked), the rest are masked. Which path a tile takes for a row depends on where its q tile
                    # starts, i.e. on the prefix/new split; the mask only replaces invisible scores by -inf, so a
                    # visible score's arithmetic is the same on both paths, and tiles past a row's last key are exact
                    # no-ops (p = 0, alpha = 1): a row's bits do not depend on the split (tested on the GPU).
                    # Under a window the steps start at wg_first (those before it hold no key a row sees, so skipping
                    # them equals the exact no-ops they would be), and [wg_first, win_full) is masked too.
                    seen_by_all = q_prefix + jnp.maximum(t0, 0) + 1 if causal else prefix_len
                    full_end = jnp.clip(lax.div(jnp.minimum(prefix_len, seen_by_all), jnp.int32(block_kv)), 0, wg_steps)
                    if byte_mask:
                        full_end = jnp.int32(0)  # the mask covers every listed key: every tile is masked
                    unified_masked = functools.partial(kv_step, mask_kind="unified")
                    if window is None:
                        carry = unmasked(0, full_end, carry)
                        carry = lax.fori_loop(full_end, wg_steps, unified_masked, carry)
                    else:
                        masked_from = jnp.maximum(full_end, win_full)
                        carry = lax.fori_loop(wg_first, win_full, unified_masked, carry)
                        carry = unmasked(win_full, masked_from, carry)
                        carry = lax.fori_loop(masked_from, wg_steps, unified_masked, carry)
                else:
                    window_new_tiles = None  # f16 pool tiles under a window: its new-key tiles, after the pool's
                    if window is None:
                        bound = lambda x: x  # noqa: E731
                    else:
                        if custom or f16_tiles:
                            # Pool and new-key tiles apart: only the mask's columns are gathered; f16 pool tiles
                            # take other operands.
                            pool_kind, new_kind_w = ("window_prefix", "window_new") if custom else ("window", "window")
                            split = jnp.clip(pre_steps, wg_first, win_full)
                            carry = lax.fori_loop(wg_first, split, step_fn(pool_kind, pool=True), carry)

                            def window_new_tiles(carry):
                                return lax.fori_loop(split, win_full, step_fn(new_kind_w), carry)

                            if not f16_tiles:
                                carry, window_new_tiles = window_new_tiles(carry), None
                        else:
                            carry = lax.fori_loop(wg_first, win_full, step_fn("window"), carry)
                        bound = lambda x: jnp.maximum(x, win_full)  # noqa: E731  the steps below are done
                    carry = unmasked(bound(0), bound(full_pre), carry, pool=True)
                    prefix_kind = "custom_prefix" if mask_prefix else "prefix"
                    carry = lax.fori_loop(bound(full_pre), bound(pre_steps), step_fn(prefix_kind, pool=True), carry)
                    if f16_tiles:
                        # Every pool tile is done (steps run in order, the pool's first): V's scale on what they added
                        # (where none was consumed the accumulator is 0 and stays so, whatever the scale).
                        pool_acc, pool_m, pool_l = carry
                        pool_seen = (wg_first if window is not None else jnp.int32(0)) < pre_steps
                        carry = (pool_acc * jnp.where(pool_seen, v_scale, 1.0), pool_m, pool_l)
                        if window_new_tiles is not None:
                            carry = window_new_tiles(carry)
                    carry = lax.fori_loop(bound(pre_steps), bound(pre_steps + first_full), masked, carry)
                    carry = unmasked(bound(pre_steps + first_full), bound(pre_steps + end_full), carry,
                                     new_key=new_keys_apart)
                    carry = lax.fori_loop(bound(pre_steps + end_full), wg_steps, masked, carry)
                lax.fori_loop(wg_steps, cta_steps, flush_step, None)
                pl.when(wg == 0)(schedule_sync)
                acc, m_i, l_i = carry

                if has_sinks:
                    # The sink joins the denominator only (natural-log logit, not scaled): in base 2 at the common max.
                    sink = sinks_ref[head] * LOG2E
                    m_f = jnp.maximum(m_i, sink)
                    alpha = jnp.exp2(m_i - m_f)
                    l_i = l_i * alpha + jnp.exp2(sink - m_f)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_rows = lax.broadcast_in_dim(l_i, acc.shape, [0])
                if unified or custom:  # a row that saw no key (bad metadata, or its mask's choice) gives 0, also where
                    # a masked key's V is NaN (p = 0 times NaN in acc); a NaN l stays NaN
                    empty = l_rows == 0.0
                    out = jnp.where(empty, 0.0, acc / jnp.where(empty, 1.0, l_rows)).astype(dtype)
                else:
                    out = (acc / l_rows).astype(dtype)
                # This warpgroup's rows of the sequence: [lo, hi) of its block_q.
                lo = jnp.clip(q_start - wg_row, 0, block_q)
                hi = jnp.clip(q_end - wg_row, 0, block_q)

                if not latent:  # (latent: O narrower than Q's buffer, every tile in o_rows_columns chunks)
                    @pl.when((lo == 0) & (hi == block_q))
                    def _whole_tile():
                        o_smem = qo_smem if o_in_q else o_rows_smem2.at[wg]
                        o_smem[...] = out
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[pl.ds(wg_row, block_q), head])

                @pl.when((hi > lo) if latent else (hi > lo) & ((lo > 0) | (hi < block_q)))
                def _partial_tile():
                    # TMA boxes have static sizes: store hi - lo rows as a sum of powers of 2 (e.g. 37 = 32 + 4 + 1),
                    # from a plain (row-sliceable) buffer, o_rows_columns columns at a time.
                    o_rows = o_rows_smem2.at[wg]
                    count = hi - lo
                    for column in range(0, v_dim, o_rows_columns):
                        if column:  # the previous chunk's stores have read the buffer
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        o_rows[...] = out[:, column:column + o_rows_columns]
                        plgpu.commit_smem()
                        start = lo
                        size = block_q if latent else block_q // 2  # (a whole tile's block_q rows: latent only)
                        while size >= 1:
                            @pl.when((count & size) != 0)
                            def _(start=start, size=size, column=column):
                                plgpu.copy_smem_to_gmem(
                                    o_rows.at[pl.ds(start, size)],
                                    out_gmem.at[pl.ds(wg_row + start, size), head, pl.ds(column, o_rows_columns)])

                            start = start + (count & size)
                            size //= 2

                plgpu.wait_smem_to_gmem(0)

            @pl.when(wg == consumers)
            def _producer():
                plgpu.set_max_registers(producer_registers, action="decrease")
                kv_head = lax.div(cta_head, jnp.int32(group))  # packed heads share it (an even group)

                def sources_of(step):
                    # Prefix tiles: slots kv_indices[kv_start + step * block_kv + r]; new-key tiles: rows from base.
                    from_pool = step < pre_steps
                    new_first = base + (step - pre_steps) * block_kv
                    first = jnp.where(from_pool, kv_start + step * block_kv, new_first)
                    count = jnp.where(from_pool, prefix_len - step * block_kv, token_end - new_first)
                    return row_sources(kv_indices_ref, from_pool, first, count, block_kv=block_kv, pool_rows=pool_rows)

                def page_starts(step):
                    # Whole pages: each page copy of tile `step` starts at pool row start * page_rows, start the slot
                    # its first key lists (outside the pool: slot 0) over page_rows. Multiplied where the copy is
                    # issued, so Mosaic sees an 8-aligned row (a loop carry would hide the factor).
                    starts = []
                    for chunk in range(block_kv // page_rows):
                        index = jnp.clip(kv_start + step * block_kv + chunk * page_rows, 0, capacity - 1)
                        slot = kv_indices_ref[index]
                        slot = jnp.where((slot >= 0) & (slot < pool_rows), slot, 0).astype(jnp.int32)
                        starts.append(lax.div(slot, jnp.int32(page_rows)))
                    return tuple(starts)

                def issue(step, sources, starts):
                    # starts: `page_starts(step)`, or None where no tile of the loop is one of whole pages
                    paged = bool(page_rows) and starts is not None
                    slot = lax.rem(step, jnp.int32(stages))
                    from_pool = step < pre_steps
                    tma = by_tma(step)
                    rows = pl.ds(base + (step - pre_steps) * block_kv, block_kv)

                    def load(which, new_ref, pool_ref, smem, free, ready, head_dim):
                        @pl.when(step >= first_step + stages)  # the CTA's first `stages` tiles fill empty slots
                        def _():
                            plgpu.barrier_wait(free.at[slot])

                        def rows_by_cp_async():
                            issue_rows(new_ref, pool_ref, smem, kv_bars, sources, from_pool, slot, which * stages + slot,
                                       kv_head, block_kv=block_kv, head_dim=head_dim)

                        def cp_async():  # the tiles on the kv_bars mbarriers
                            if not paged or pallas_pages:
                                return rows_by_cp_async()
                            pages = step < page_steps
                            pl.when(pages)(lambda: issue_pages(pool_ref, smem, kv_bars, starts, slot, which * stages + slot,
                                                               kv_head, page_rows=page_rows, head_dim=head_dim))
                            pl.when(jnp.logical_not(pages))(rows_by_cp_async)

                        def page_copies():
                            for chunk, start in enumerate(starts):
                                plgpu.copy_gmem_to_smem(pool_ref.at[pl.ds(start * page_rows, page_rows), kv_head],
                                                        smem.at[slot, pl.ds(chunk * page_rows, page_rows)],
                                                        page_ready[which].at[slot])

                        if not tma_new_tiles and not (paged and pallas_pages):
                            return cp_async()
                        copied = []
                        if tma_new_tiles:
                            copied.append(tma)
                            pl.when(tma)(lambda: plgpu.copy_gmem_to_smem(new_ref.at[rows, kv_head], smem.at[slot],
                                                                         ready.at[slot]))
                        if paged and pallas_pages:
                            copied.append(step < page_steps)
                            pl.when(copied[-1])(page_copies)
                        pl.when(jnp.logical_not(functools.reduce(jnp.logical_or, copied)))(cp_async)

                    load(0, k_new_ref, k_pool_ref, k_smem, k_free, k_ready, k_row_dim)
                    if not latent:
                        load(1, v_new_ref, v_pool_ref, v_smem, v_free, v_ready, v_dim)

                def fp8_tile_start(step, sources, pool_tile):
                    """fp8 pools: issues tile `step`'s copies (`pool_tile()` for a pool tile, a new-key tile as 16-bit
                    pools do; nothing past cta_steps), then closes them into one group. sources: `sources_of(step)`.
                    pool_tile None: a pool tile's copies are issued elsewhere (fp8_refill)."""
                    @pl.when(step < cta_steps)
                    def _():
                        if unified:  # every tile from the pool
                            if pool_tile is not None:
                                pool_tile()
                        else:
                            if pool_tile is not None:
                                pl.when(step < pre_steps)(pool_tile)
                            pl.when(step >= pre_steps)(lambda: issue(step, sources, None))
                    commit_copies()

                def fp8_start(step, sources):
                    """`fp8_tile_start`, a pool tile's fp8 rows into its slots' upper halves once they are free."""
                    def pool_tile():
                        slot = lax.rem(step, jnp.int32(stages))
                        for pool_ref, smem, free in ((k_pool_ref, k_smem, k_free), (v_pool_ref, v_smem, v_free)):
                            pl.when(step >= first_step + stages)(lambda free=free: plgpu.barrier_wait(free.at[slot]))
                            issue_fp8_rows(pool_ref, smem, sources, slot, kv_head, block_kv=block_kv, head_dim=qk_dim)

                    fp8_tile_start(step, sources, pool_tile)

                def fp8_staged_start(step, sources):
                    """`fp8_tile_start`, a pool tile's fp8 rows into the staging tiles (fp8_staging; the conversion
                    before freed them)."""
                    def pool_tile():
                        for pool_ref, staging in ((k_pool_ref, k_staging), (v_pool_ref, v_staging)):
                            issue_fp8_rows(pool_ref, staging, sources, 0, kv_head, block_kv=block_kv, head_dim=qk_dim,
                                           staging=True)

                    fp8_tile_start(step, sources, pool_tile)

                def fp8_producer_loop(first):
                    # In the slots (fp8_start), copies run stages - 1 tiles ahead: tile s + stages - 1's start after
                    # tile s's conversion (its slot frees when the consumers are done with tile s - 1), so a
                    # conversion finds its copies landed while the consumers work on the tile before. Staged
                    # (fp8_staged_start), tile s + 1's copies start once tile s is converted (the staging tiles free
                    # again), so they land while the consumers finish tiles s - 1 and s; tile s + 1's conversion then
                    # waits only for its slot (the consumers done with tile s + 1 - stages).
                    if f16_tiles:  # exact f16, unscaled: the consumers apply the scales
                        k_scale = v_scale = None
                    else:
                        k_scale, v_scale = scales_ref[kv_head], scales_ref[kv_heads + kv_head]
                    lead = 1 if fp8_staging else stages - 1  # tiles whose copies run ahead of the conversion
                    start = fp8_staged_start if fp8_staging else fp8_start
                    if fp8_refill:
                        # The first tile's copies a group per copy position (a pool tile's; else as any other start).
                        def first_pool_tile():
                            issue_fp8_staging_groups((k_pool_ref, v_pool_ref), (k_staging, v_staging),
                                                     sources_of(first), kv_head, block_kv=block_kv, head_dim=qk_dim)

                        is_pool = (first < pre_steps) & (first < cta_steps)
                        pl.when(is_pool)(first_pool_tile)
                        pl.when(jnp.logical_not(is_pool))(lambda: fp8_tile_start(first, sources_of(first), None))
                    else:
                        for ahead in range(lead):
                            start(first + ahead, sources_of(first + ahead))

                    def fp8_step(step, sources):
                        # sources: tile step + lead's, loaded an iteration ahead (as `step_body`'s), so the load of
                        # kv_indices overlaps the conversion instead of delaying the copies.
                        next_sources = sources_of(step + (lead + 1))

                        @pl.when(step < pre_steps)
                        def _():
                            slot = lax.rem(step, jnp.int32(stages))
                            if fp8_staging:  # (in the slots, waited for before the copies)
                                for free in (k_free, v_free):
                                    pl.when(step >= first_step + stages)(
                                        lambda free=free: plgpu.barrier_wait(free.at[slot]))
                            # Groups in flight: this tile's and those of the lead - 1 tiles after it.
                            # refill: the next tile's copies go with this conversion where it is a pool tile.
                            next_is_pool = (step + 1 < pre_steps) & (step + 1 < cta_steps)
                            convert_fp8_tiles(((k_smem, slot, k_scale), (v_smem, stages + slot, v_scale)), kv_bars,
                                              slot, block_kv=block_kv, head_dim=qk_dim, fp8_dtype=k_pool.dtype,
                                              dtype=jnp.float16 if f16_tiles else dtype,
                                              wait_pending=None if fp8_refill else lead - 1,
                                              staging=(k_staging, v_staging) if fp8_staging else None,
                                              refill=((k_pool_ref, v_pool_ref), sources, kv_head, next_is_pool)
                                              if fp8_refill else None)
                        if fp8_refill:  # a new-key tile next (a pool tile's copies went with the conversion)
                            pl.when(step + 1 >= pre_steps)(lambda: fp8_tile_start(step + 1, sources, None))
                        else:
                            start(step + lead, sources)
                        return next_sources

                    lax.fori_loop(first_step, cta_steps, fp8_step, sources_of(first + lead))
                    if fp8_refill:
                        wait_copies()  # the last refills (zeros) land before the producer exits

                def step_body(step, sources):
                    next_sources = sources_of(step + 1)  # its loads overlap this tile's waits and copies
                    issue(step, sources, None)
                    return next_sources

                def paged_step_body(step, carry):
                    sources, starts = carry
                    next_carry = sources_of(step + 1), page_starts(step + 1)  # as above, the page starts too
                    issue(step, sources, starts)
                    return next_carry

                first = jnp.int32(first_step)
                if fp8:
                    fp8_producer_loop(first)
                elif page_rows:
                    # Tiles of whole pages first, then the rest without the page starts' lookups (new keys, a
                    # partial last prefix tile): with them in every step E2 at page 64 (no prefix) ran 2.4% behind
                    # row copies on the H100.
                    last_paged = jnp.clip(page_steps, first, cta_steps)
                    # Only a CTA with page tiles looks up their first starts: an empty loop's carry would still be
                    # computed, global index loads ahead of the first copy in every CTA of E2 (no prefix), which
                    # ran 1.008-1.012x its page-1 time at page 64 with them (H200, 6a7f2a9).
                    @pl.when(last_paged > first)
                    def _():
                        lax.fori_loop(first, last_paged, paged_step_body, (sources_of(first), page_starts(first)))

                    lax.fori_loop(last_paged, cta_steps, step_body, sources_of(last_paged))
                else:
                    lax.fori_loop(first_step, cta_steps, step_body, sources_of(first))

    # Operands: the optional ones only when their feature is on (a plain call's kernel is unchanged).
    optional = {"sinks": sinks if has_sinks else None,
                "start_pos": kv_start_pos if xai is not None or byte_mask else None, "prefix_lens": prefix_lens,
                "mask": custom_mask, "mask_indptr": mask_indptr if byte_mask else None, "bits": draft_mask,
                "scales": kv_scales}
    present = tuple(name for name, value in optional.items() if value is not None)
    new_operands = () if unified else (k_new,) if latent else (k_new, v_new)
    pool_operands = (k_pool,) if latent else (k_pool, v_pool)

    def entry(qo_indptr_ref, kv_indptr_ref, kv_indices_ref, q_ref, *rest):
        if unified:  # the producer's "new" operand is never read (every step is from the pool): the pool stands in
            (k_pool_ref, v_pool_ref), rest = rest[:2], rest[2:]
            k_new_ref, v_new_ref = k_pool_ref, v_pool_ref
        elif latent:  # V inside K: no V operands
            (k_new_ref, k_pool_ref), rest = rest[:2], rest[2:]
            v_new_ref = v_pool_ref = None
        else:
            (k_new_ref, v_new_ref, k_pool_ref, v_pool_ref), rest = rest[:4], rest[4:]
        refs = dict(zip(present, rest[:len(present)]))
        (out_gmem,) = rest[len(present):]
        o_rows = plgpu.SMEM((consumers, block_q, o_rows_columns), dtype)  # O of a partial tile (row-sliceable)
        if f16_tiles:  # ... and, until the last tile is done, the f16 Q copy (the same bytes: o_rows_columns == qk_dim)
            o_rows = plgpu.RefUnion(o_rows, plgpu.SMEM((consumers, block_q, qk_dim), jnp.float16, transforms=SWIZZLED))

        def ring(dim):  # with mixed rings, a view in q's dtype (new-key tiles) and one in f16 (pool tiles)
            views = [plgpu.SMEM((stages, block_kv, dim), ring_dtype, transforms=SWIZZLED)
                     for ring_dtype in ((dtype, jnp.float16) if mixed_rings else (dtype,))]
            return plgpu.RefUnion(*views) if mixed_rings else views[0]

        smem = (
            plgpu.SMEM((consumers, block_q, qk_dim), dtype, transforms=SWIZZLED),  # Q, then O (o_in_q)
            o_rows,
            ring(qk_dim),
            *(() if latent else (ring(v_dim),)),
            plgpu.SMEM((2 * stages * 2,), jnp.int32),  # mbarriers (8 bytes each): K ready, V ready per slot
            *((plgpu.SMEM((block_kv, qk_dim), jnp.int8),) * 2 if fp8_staging else ()),  # fp8 staging: K's, V's
        )
        # Whole pages: one barrier per slot for K and one for V, completed by the tile's block_kv / page_rows copies.
        pages = (((plgpu.Barrier(num_arrivals=block_kv // page_rows, num_barriers=stages),) * 2,) if pallas_pages else ())
        pl.run_scoped(
            lambda *scoped: body(qo_indptr_ref, kv_indptr_ref, kv_indices_ref, q_ref, k_new_ref, v_new_ref, k_pool_ref,
                                 v_pool_ref, refs.get("sinks"), refs.get("start_pos"), refs.get("prefix_lens"),
                                 refs.get("mask"), refs.get("mask_indptr"), refs.get("bits"), refs.get("scales"),
                                 out_gmem, scoped),
            smem,
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_barriers=consumers)),
            (plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=consumers),  # the schedule (used with 2 consumers)
            *pages,
            collective_axes="wg",
        )

    plgpu.kernel(
        entry,
        out_type=(),
        grid=(q_heads // heads_per_cta, q_tiles, batch),
        grid_names=("heads", "q_tiles", "seq"),
        num_threads=consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, **(dict(reduction_scratch_bytes=STAGED_REDUCTION_SCRATCH) if fp8_staging else {})),
    )(qo_indptr, kv_indptr, kv_indices, q, *new_operands, *pool_operands, *(optional[name] for name in present), out_ref)
