"""Tiny kernels that exercise the launch layer itself."""

import triton
import triton.language as tl


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def scale_even_rows_kernel(X, SCALE, Y, ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr):
    # Writes only the even rows of Y: the odd rows show what an unwritten row looks like.
    row = tl.program_id(0)
    if row % 2 == 0:
        offs = tl.arange(0, BLOCK)
        x = tl.load(X + row * COLS + offs, mask=offs < COLS)
        tl.store(Y + row * COLS + offs, _twice(x) * tl.load(SCALE), mask=offs < COLS)


@triton.jit
def add_at_kernel(POOL, SLOTS, VALUES, POOL_OUT, COLS: tl.constexpr, BLOCK: tl.constexpr):
    # POOL_OUT aliases POOL: rows named by SLOTS get VALUES added, in place.
    i = tl.program_id(0)
    slot = tl.load(SLOTS + i).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    old = tl.load(POOL_OUT + slot * COLS + offs, mask=offs < COLS)
    new = tl.load(VALUES + i * COLS + offs, mask=offs < COLS)
    tl.store(POOL_OUT + slot * COLS + offs, old + new, mask=offs < COLS)


@triton.jit
def row_stats_kernel(X, OUT, COLS: tl.constexpr, BLOCK: tl.constexpr):
    # Uses Triton's library helpers (jit functions themselves): max, sum, zeros, cdiv.
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + row * COLS + offs, mask=offs < COLS, other=float("-inf"))
    acc = tl.zeros([BLOCK], dtype=tl.float32) + tl.where(offs < COLS, x, 0.0)
    tl.store(OUT + row * 3 + 0, tl.max(x, axis=0))
    tl.store(OUT + row * 3 + 1, tl.sum(acc, axis=0))
    tl.store(OUT + row * 3 + 2, tl.cdiv(row + COLS, 4).to(tl.float32))
