"""The Mosaic GPU extend kernel's fp8 tiles (issue 26), replayed on bytes: `issue_fp8_rows`' copies into the upper
half of a 16-bit ring slot, then `convert_fp8_tiles`' in-place steps (phases: each thread's chunks loaded, converted
and stored one by one, in any order across threads; rounds: every thread's loads, one warpgroup sync, every thread's
stores), through the kernel module's own layout formulas (`IntOps`). The slot must end up holding the tile
wgmma reads (Mosaic's (8, 64)-tiled, 128-byte-swizzled layout, written out independently here) with the values
`jaxattn.fp8.dequantised_rows` gives, bit for bit. The kernel itself runs only on a GPU.
"""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxattn.fp8 import dequantised_rows
from jaxattn.kernels import extend_attention_mgpu as kernel

THREADS = 128


def swizzled_tile(slot: np.ndarray, block_kv: int, head_dim: int, dtype, swizzle: int = 128) -> np.ndarray:
    """[block_kv, head_dim] of `dtype` read from a slot in Mosaic's SWIZZLED layout: (8, 64) tiles of 1024 bytes in
    row-major order, each tile's 128-byte rows holding 8 chunks of 16 bytes, chunk c of row r at position c ^ (r % 8);
    swizzle 64 (SWIZZLED_64): (8, 32) tiles of 512 bytes, 64-byte rows of 4 chunks, chunk c of row r at c ^ (r % 8 // 2)
    (Mosaic's transfer swizzle: the 16-byte unit index XOR (byte offset // 128) % (swizzle // 16))."""
    out = np.zeros((block_kv, head_dim), np.uint16)
    per_row = swizzle // 16
    for r in range(block_kv):
        for c in range(head_dim // 8):
            tile = (r // 8) * (head_dim * 2 // swizzle) + c // per_row
            in_tile = (r % 8) * swizzle + (c % per_row) * 16
            at = tile * 8 * swizzle + (in_tile ^ ((in_tile // 128) % per_row * 16))
            out[r, 8 * c:8 * c + 8] = slot[at:at + 16].view(np.uint16)
    return out.view(np.dtype(dtype))


def copy_tile(slot, pool, sources, kv_head, *, block_kv, head_dim, staging=False):
    """issue_fp8_rows: each (warp, lane, copy) moves 16 bytes of its row's source (zeros for source -1); into the
    slot's upper half, or with staging into a staging tile (`slot` is then the staging tile)."""
    rows_per_warp = block_kv // 4
    written = np.zeros((block_kv, head_dim // 16), int)
    raw = pool.view(np.uint8)
    for warp in range(4):
        for lane in range(32):
            for p in range(kernel.fp8_copies_per_thread(block_kv, head_dim)):
                holder, row, chunk = kernel.fp8_copy_position(warp, lane, p, block_kv=block_kv, head_dim=head_dim)
                assert holder < rows_per_warp  # the lane whose `row_sources` entry the shuffle reads
                source = sources[warp * rows_per_warp + holder]
                data = raw[source, kv_head, 16 * chunk:16 * chunk + 16] if source >= 0 else np.zeros(16, np.uint8)
                if staging:
                    at = kernel.fp8_staging_byte(row, chunk, head_dim=head_dim)
                else:
                    at = kernel.fp8_staged_byte(row, chunk, block_kv=block_kv, head_dim=head_dim)
                slot[at:at + 16] = data
                written[row, chunk] += 1
    assert (written == 1).all()  # every 16 bytes of the tile copied once


def convert_tile(slot, fp8_dtype, scale, dtype, *, block_kv, head_dim, synced=True, swizzle=128, staging=None):
    """convert_fp8_tiles' steps on one tile (scale None: straight to f16; K's and V's share the steps, each on its
    own ring). A phase's chunks go through in reverse order (one thread may run ahead of another), after a check that
    none of its stores reaches a byte it loads. synced=False replays the whole tile as one phase (no sync at all):
    the in-place rewrite then must fail, which shows this test can. staging: the staging tile the fp8 rows are read
    from (`convert_fp8_tiles(staging=...)`), else the slot's upper half."""
    steps = kernel.fp8_conversion_steps(block_kv, head_dim, staged=staging is not None)
    assert steps[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(steps, steps[1:]))
    assert steps[-1][0] + steps[-1][1] == block_kv  # the steps cover the rows in order
    converted = np.zeros((block_kv, head_dim // 16), int)

    def fp8_byte(row, chunk):
        if staging is not None:
            return kernel.fp8_staging_byte(row, chunk, head_dim=head_dim)
        return kernel.fp8_staged_byte(row, chunk, block_kv=block_kv, head_dim=head_dim)

    def load(row, chunk):
        at = fp8_byte(row, chunk)
        return (slot if staging is None else staging)[at:at + 16].copy()

    def stored_bytes(row, chunk):
        return [kernel.swizzled_16bit_byte(row, 2 * chunk + half, head_dim=head_dim, swizzle=swizzle)
                for half in range(2)]

    def store(row, chunk, data):
        values = data.view(fp8_dtype).astype(np.float32)
        values = (values if scale is None else values * np.float32(scale)).astype(dtype).view(np.uint8)
        for half, at in enumerate(stored_bytes(row, chunk)):
            slot[at:at + 16] = values[16 * half:16 * half + 16]

    all_positions = []
    for first_row, rows, is_round in steps:
        positions = [kernel.fp8_step_position(first_row, rows, t, i, head_dim=head_dim) for t in range(THREADS)
                     for i in range(kernel.fp8_step_chunks_per_thread(rows, head_dim))]
        for row, chunk in set(positions):
            converted[row, chunk] += 1
        all_positions += positions
        if not synced:
            continue
        if is_round:
            loaded = [load(*position) for position in positions]
            for position, data in zip(positions, loaded):
                store(*position, data)
        else:
            stores = {at + b for r, c in positions for at in stored_bytes(r, c) for b in range(16)}
            if staging is None:  # (staged, the loads read another buffer)
                loads = {fp8_byte(r, c) + b for r, c in positions for b in range(16)}
                assert not loads & stores, (first_row, rows)  # no sync inside a phase: it must not need one
            for position in reversed(positions):
                store(*position, load(*position))
    if not synced:
        for position in reversed(all_positions):
            store(*position, load(*position))
    assert (converted == 1).all()  # every chunk of the tile in exactly one step


def random_fp8_pool(rng, fp8_dtype, slots, kv_heads, head_dim):
    """Every byte pattern a pool can hold, NaN and subnormals included (e5m2's infinities too)."""
    return rng.integers(0, 256, (slots, kv_heads, head_dim), dtype=np.uint8).view(fp8_dtype)


# (block_kv, head_dim, swizzle): the extend kernel's tiles, and MLA's 576-wide latent rows (rounds of 8 rows: 288 chunks
# over 128 threads, the last ones converted twice), also as the decode kernel's 32-key tiles at a 64-byte swizzle.
CASES = [(64, 128, 128), (128, 128, 128), (64, 64, 128), (128, 64, 128), (64, 256, 128), (64, 576, 128),
         (32, 576, 64), (64, 128, 64)]


@pytest.mark.parametrize("block_kv,head_dim,swizzle", CASES)
@pytest.mark.parametrize("fp8_dtype", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2], ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("staged", [False, True], ids=["in-slot", "staged"])
def test_copies_and_in_place_rounds_give_the_dequantised_tile(block_kv, head_dim, swizzle, fp8_dtype, dtype, staged):
    # staged: the extend kernel's fp8 staging tiles (`fp8_staging`): copies into a tile of their own, one pass from it.
    if staged and (head_dim not in kernel.FP8_HEAD_DIMS or swizzle != kernel.SWIZZLE_BYTES):
        pytest.skip("staging tiles are the extend kernel's (its head dims, 128-byte swizzle)")
    rng = np.random.default_rng(block_kv * head_dim)
    kv_heads, kv_head, slots, scale = 3, 1, 500, 0.0371
    if head_dim == 576:  # MLA decode: one latent head, converted to f16 unscaled (the scales folded into q, the output)
        kv_heads, kv_head, scale = 1, 0, None
        if dtype != np.float16:
            pytest.skip("the unscaled conversion writes f16")
    pool = random_fp8_pool(rng, fp8_dtype, slots, kv_heads, head_dim)
    sources = rng.integers(0, slots, block_kv).astype(np.int32)
    sources[block_kv - 5:] = -1  # rows past the listed keys: zeros
    slot = rng.integers(0, 256, 2 * block_kv * head_dim, dtype=np.uint8)  # the slot's previous tile
    staging = rng.integers(0, 256, block_kv * head_dim, dtype=np.uint8) if staged else None  # the previous tile's
    copy_tile(slot if staging is None else staging, pool, sources, kv_head, block_kv=block_kv, head_dim=head_dim,
              staging=staged)
    convert_tile(slot, fp8_dtype, scale, dtype, block_kv=block_kv, head_dim=head_dim, swizzle=swizzle,
                 staging=staging)
    got = swizzled_tile(slot, block_kv, head_dim, dtype, swizzle)

    listed = sources >= 0
    rows = dequantised_rows(jnp.asarray(pool), jnp.asarray(np.maximum(sources, 0)),
                            None if scale is None else jnp.float32(scale), jnp.dtype(dtype))
    want = np.where(listed[:, None], np.asarray(rows)[:, kv_head].astype(dtype), np.zeros((), dtype))
    got_bits, want_bits = got.view(np.uint16), want.view(np.uint16)
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)  # NaN in is NaN out
    np.testing.assert_array_equal(got_bits[~nan], want_bits[~nan])
    assert nan.any() and (want[~nan] != 0).any()  # the random pool reaches the interesting values


@pytest.mark.parametrize("block_kv,head_dim", [(128, 128), (64, 256), (64, 576)])
def test_the_steps_need_their_syncs(block_kv, head_dim):
    rng = np.random.default_rng(7)
    pool = random_fp8_pool(rng, ml_dtypes.float8_e4m3fn, 300, 2, head_dim)
    sources = rng.integers(0, 300, block_kv).astype(np.int32)
    results = []
    for synced in (True, False):
        slot = np.zeros(2 * block_kv * head_dim, np.uint8)
        copy_tile(slot, pool, sources, 0, block_kv=block_kv, head_dim=head_dim)
        convert_tile(slot, ml_dtypes.float8_e4m3fn, 1.0, ml_dtypes.bfloat16, block_kv=block_kv, head_dim=head_dim,
                     synced=synced)
        results.append(swizzled_tile(slot, block_kv, head_dim, ml_dtypes.bfloat16).view(np.uint16))
    assert (results[0] != results[1]).any()


def test_conversion_steps_halve_then_round():
    # 128-row tiles of 128-dim heads: phases of 64, 32 and 16 rows, then one round of 16 (3 syncs where rounds alone
    # took 8); 64-dim heads end in a round of 32 rows; MLA's 576 in one of 8 rows after three phases.
    assert kernel.fp8_conversion_steps(128, 128) == ((0, 64, False), (64, 32, False), (96, 16, False), (112, 16, True))
    assert kernel.fp8_conversion_steps(128, 64) == ((0, 64, False), (64, 32, False), (96, 32, True))
    assert kernel.fp8_conversion_steps(64, 576) == ((0, 32, False), (32, 16, False), (48, 8, False), (56, 8, True))


def test_fp8_tile_limits():
    for block_kv, head_dim, _ in CASES:
        kernel.check_fp8_tile(block_kv, head_dim)
    for block_kv, head_dim in [(128, 96), (8, 128), (64, 288), (60, 128)]:
        with pytest.raises(ValueError, match="fp8 tiles"):
            kernel.check_fp8_tile(block_kv, head_dim)


def test_convert_ptx_names_both_formats_and_outputs():
    ptx = kernel.fp8_convert_ptx(jnp.float8_e5m2, jnp.float16)
    assert "cvt.rn.f16x2.e5m2x2" in ptx and "cvt.rn.f16x2.f32 $0, f1, f0" in ptx  # element 1 in the upper half
    ptx = kernel.fp8_convert_ptx(jnp.float8_e4m3fn, jnp.bfloat16)
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.rn.bf16x2.f32 $1, f3, f2" in ptx
    ptx = kernel.fp8_convert_ptx(jnp.float8_e4m3fn, jnp.float16, scaled=False)
    assert "cvt.rn.f16x2.e4m3x2 $0, b01" in ptx and "f32" not in ptx
    with pytest.raises(ValueError, match="writes f16"):
        kernel.fp8_convert_ptx(jnp.float8_e4m3fn, jnp.bfloat16, scaled=False)


@pytest.mark.parametrize("head_dim,swizzle", [(128, 128), (320, 128), (576, 128), (576, 64)])
def test_16bit_row_copies_land_where_wgmma_reads(head_dim, swizzle):
    # `issue_rows`' 16-bit copies (thread (warp, lane) copies chunk lane % 8 of each 128-byte span of its rows) through
    # `swizzled_16bit_byte`, the formula its 64-byte-swizzle form uses: every row's bytes land where the independent
    # reader above finds them (the 128-byte form checks the formula against the layout the kernel has always used).
    rows, spans = 64, head_dim * 2 // 128
    rng = np.random.default_rng(head_dim + swizzle)
    data = rng.integers(0, 2**16, (rows, head_dim), dtype=np.uint16)
    slot = np.zeros(rows * head_dim * 2, np.uint8)
    for row in range(rows):
        for span in range(spans):
            for chunk in range(8):
                at = kernel.swizzled_16bit_byte(row, chunk + 8 * span, head_dim=head_dim, swizzle=swizzle)
                slot[at:at + 16] = data[row, 64 * span + 8 * chunk:64 * span + 8 * chunk + 8].view(np.uint8)
    np.testing.assert_array_equal(swizzled_tile(slot, rows, head_dim, np.uint16, swizzle), data)


def wavefronts(byte_offsets) -> int:
    """Shared-memory wavefronts of one warp's 16-byte accesses (32 offsets, by lane): the hardware serves them 8 lanes
    at a time over 32 banks of 4-byte words; a group takes as many wavefronts as its most-used bank has distinct words."""
    total = 0
    for group in range(4):
        words_by_bank = {}
        for at in byte_offsets[8 * group:8 * group + 8]:
            for word in range(at // 4, at // 4 + 4):
                words_by_bank.setdefault(word % 32, set()).add(word)
        total += max(len(words) for words in words_by_bank.values())
    return total


@pytest.mark.parametrize("block_kv,head_dim,swizzle", CASES)
def test_fp8_copies_and_conversion_loads_avoid_bank_conflicts(block_kv, head_dim, swizzle):
    # The cp.async rows and the conversion's loads of them: one wavefront per 8 lanes. (The conversion's stores are
    # 2-way conflicted at 128/256-dim heads; a conflict-free order timed no faster for extend on the H100 and slower
    # for MLA, its producer spilling more: benchmarks/RESULTS.md, thirty-fifth session.)
    for warp in range(4):
        for p in range(kernel.fp8_copies_per_thread(block_kv, head_dim)):
            positions = [kernel.fp8_copy_position(warp, lane, p, block_kv=block_kv, head_dim=head_dim)[1:]
                         for lane in range(32)]
            assert wavefronts([kernel.fp8_staged_byte(r, c, block_kv=block_kv, head_dim=head_dim)
                               for r, c in positions]) == 4
    for first_row, rows, _ in kernel.fp8_conversion_steps(block_kv, head_dim):
        for i in range(kernel.fp8_step_chunks_per_thread(rows, head_dim)):
            for warp in range(4):
                positions = [kernel.fp8_step_position(first_row, rows, 32 * warp + lane, i, head_dim=head_dim)
                             for lane in range(32)]
                assert wavefronts([kernel.fp8_staged_byte(r, c, block_kv=block_kv, head_dim=head_dim)
                                   for r, c in positions]) == 4


def copy_owners(block_kv, head_dim):
    """{(row, chunk): thread} of `issue_fp8_rows`' copies (thread = 32 * warp + lane), each chunk copied once."""
    owners = {}
    for warp in range(4):
        for lane in range(32):
            for p in range(kernel.fp8_copies_per_thread(block_kv, head_dim)):
                _, row, chunk = kernel.fp8_copy_position(warp, lane, p, block_kv=block_kv, head_dim=head_dim)
                assert (row, chunk) not in owners
                owners[row, chunk] = 32 * warp + lane
    assert len(owners) == block_kv * head_dim // 16
    return owners


@pytest.mark.parametrize("block_kv,head_dim", [(128, 128), (64, 128), (128, 64), (64, 256)])
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=["bf16", "f16"])
def test_refill_converts_each_threads_own_copies_then_refills_them(block_kv, head_dim, dtype):
    # fp8_refill: each thread converts, position by position, the staging chunks it copied itself and then
    # copies the next tile's chunk there, with no warpgroup sync: correct in any interleaving of the threads only if
    # every chunk a thread reads (this tile's) and overwrites (the next tile's copy) is one it copied. Threads run here
    # in a random order per position; two tiles, the second's copies made by the first's refill, the third's
    # disabled (a new-key tile next: zeros).
    rng = np.random.default_rng(block_kv + head_dim)
    fp8_dtype, kv_heads, kv_head, slots, scale = ml_dtypes.float8_e4m3fn, 3, 2, 400, 0.0371
    pool = random_fp8_pool(rng, fp8_dtype, slots, kv_heads, head_dim)
    tiles = [rng.integers(0, slots, block_kv).astype(np.int32) for _ in range(2)]
    tiles[1][block_kv - 3:] = -1  # the last tile's rows past the prefix
    owners = copy_owners(block_kv, head_dim)
    staging = rng.integers(0, 256, block_kv * head_dim, dtype=np.uint8)
    copy_tile(staging, pool, tiles[0], kv_head, block_kv=block_kv, head_dim=head_dim, staging=True)  # the prologue
    raw = pool.view(np.uint8)

    def chunk_of(sources, row, chunk):
        source = sources[row]
        return raw[source, kv_head, 16 * chunk:16 * chunk + 16] if source >= 0 else np.zeros(16, np.uint8)

    for t, sources in enumerate(tiles):
        next_sources = tiles[t + 1] if t + 1 < len(tiles) else None
        slot = rng.integers(0, 256, 2 * block_kv * head_dim, dtype=np.uint8)
        for p in range(kernel.fp8_copies_per_thread(block_kv, head_dim)):
            for thread in rng.permutation(THREADS):
                _, row, chunk = kernel.fp8_copy_position(thread // 32, thread % 32, p, block_kv=block_kv,
                                                         head_dim=head_dim)
                assert owners[row, chunk] == thread  # read and overwritten by the thread that copied it
                at = kernel.fp8_staging_byte(row, chunk, head_dim=head_dim)
                values = staging[at:at + 16].view(fp8_dtype).astype(np.float32) * np.float32(scale)
                stored = values.astype(dtype).view(np.uint8)
                for half in range(2):
                    to = kernel.swizzled_16bit_byte(row, 2 * chunk + half, head_dim=head_dim)
                    slot[to:to + 16] = stored[16 * half:16 * half + 16]
                staging[at:at + 16] = (chunk_of(next_sources, row, chunk) if next_sources is not None
                                       else np.zeros(16, np.uint8))
        got = swizzled_tile(slot, block_kv, head_dim, dtype).view(np.uint16)
        rows = dequantised_rows(jnp.asarray(pool), jnp.asarray(np.maximum(sources, 0)), jnp.float32(scale),
                                jnp.dtype(dtype))
        want = np.where((sources >= 0)[:, None], np.asarray(rows)[:, kv_head].astype(dtype), np.zeros((), dtype))
        nan = np.isnan(want.astype(np.float32))
        np.testing.assert_array_equal(got[~nan], want.view(np.uint16)[~nan])
        np.testing.assert_array_equal(np.isnan(got.view(dtype).astype(np.float32)), nan)
    assert not staging.any()  # the disabled refill left zeros


def refill_groups_landed(pool_tiles, steps, first, pending, *, block_kv=128, head_dim=128) -> bool:
    """fp8_refill's cp.async groups, one producer thread, the steps as the kernel's loop takes them: the first
    tile's copies a group per copy position if it is a pool tile (one group otherwise), each pool tile's conversion
    waiting (wait_group(pending)) before each position and committing the next tile's copy of it, a new-key tile's
    start one group. wait_group(n) leaves pending at most the n newest groups: whether every wait finds the group of
    the position it converts older than those."""
    copies = kernel.fp8_copies_per_thread(block_kv, head_dim)
    committed = []  # group names, oldest first

    def is_pool(step):
        return step < pool_tiles and step < steps

    if is_pool(first):
        committed += [("pool", first, p) for p in range(copies)]
    else:
        committed.append(("start", first))
    for step in range(first, steps):
        if is_pool(step):
            for p in range(copies):
                may_pend = committed[len(committed) - pending:] if pending else []
                if ("pool", step, p) not in committed or ("pool", step, p) in may_pend:
                    return False
                committed.append(("pool", step + 1, p) if is_pool(step + 1) else ("zeros", step + 1, p))
        if step + 1 >= pool_tiles:
            committed.append(("start", step + 1))
    return True


@pytest.mark.parametrize("block_kv,head_dim", [(128, 128), (128, 64)])
@pytest.mark.parametrize("pool_tiles,steps,first", [(1, 3, 0), (4, 6, 0), (5, 5, 0), (3, 7, 2), (2, 6, 4), (6, 6, 3)])
def test_refill_waits_find_their_groups_landed(block_kv, head_dim, pool_tiles, steps, first):
    pending = kernel.refill_pending_groups(block_kv, head_dim)
    assert refill_groups_landed(pool_tiles, steps, first, pending, block_kv=block_kv, head_dim=head_dim)
    if pool_tiles > first + 1:  # a second pool tile: one group more left pending would be one too many
        assert not refill_groups_landed(pool_tiles, steps, first, pending + 1, block_kv=block_kv, head_dim=head_dim)
