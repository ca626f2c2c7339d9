"""Gathers listed prefix K/V rows from the paged pool into one contiguous buffer (for the Mosaic GPU extend kernel).

One program copies BLOCK_ROWS rows of the output; a row is a whole pool slot (kv_heads x head_dim elements,
contiguous), so each load is a long unit-stride run. Rows with source -1 (the 8-row alignment gaps and the tail)
are written as zeros. Programs past the rows the attention kernel can read (NEEDED) exit at once, so the cost
follows the batch's real prefix, not the static capacity.
"""

import triton
import triton.language as tl


@triton.jit
def gather_prefix_kernel(
    SOURCE,  # i32[rows]: index into KV_INDICES of each output row, -1 for a zero row
    KV_INDICES,  # i32/i64[kv_capacity]: pool slots
    NEEDED,  # i32[1]: rows [0, NEEDED) are written; the rest are never read and stay as they are
    K_POOL,  # [slots, ROW_K] (kv_heads x qk_head_dim, flattened)
    V_POOL,  # [slots, ROW_V]
    K_OUT,  # [rows, ROW_K]
    V_OUT,  # [rows, ROW_V]
    ROWS: tl.constexpr,  # output rows (the grid's last program may run past them)
    NUM_SLOTS: tl.constexpr,
    ROW_K: tl.constexpr,
    ROW_V: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    row0 = tl.program_id(0) * BLOCK_ROWS
    if row0 < tl.load(NEEDED):
        rows = row0 + tl.arange(0, BLOCK_ROWS)
        in_out = rows < ROWS
        source = tl.load(SOURCE + rows, mask=in_out, other=-1)
        listed = source >= 0
        slot = tl.load(KV_INDICES + tl.maximum(source, 0), mask=listed, other=0).to(tl.int64)
        slot = tl.minimum(tl.maximum(slot, 0), NUM_SLOTS - 1)  # out-of-range slots read a valid row, never past the pool
        out_rows = rows.to(tl.int64)
        for start in tl.static_range(0, ROW_K, BLOCK_E):
            cols = start + tl.arange(0, BLOCK_E)
            in_row = cols < ROW_K
            x = tl.load(K_POOL + slot[:, None] * ROW_K + cols[None, :], mask=listed[:, None] & in_row[None, :], other=0.0)
            tl.store(K_OUT + out_rows[:, None] * ROW_K + cols[None, :], x, mask=in_out[:, None] & in_row[None, :])
        for start in tl.static_range(0, ROW_V, BLOCK_E):
            cols = start + tl.arange(0, BLOCK_E)
            in_row = cols < ROW_V
            x = tl.load(V_POOL + slot[:, None] * ROW_V + cols[None, :], mask=listed[:, None] & in_row[None, :], other=0.0)
            tl.store(V_OUT + out_rows[:, None] * ROW_V + cols[None, :], x, mask=in_out[:, None] & in_row[None, :])
