"""fp8 KV pools: the formats and their scales.

An fp8 pool stores ``K / k_scale`` and ``V / v_scale`` (SGLang's per-layer k_scale / v_scale; per kv head when a
checkpoint carries them). The kernels read the fp8 rows directly, convert them to q's dtype (exact: every e4m3fn and
e5m2 value is a bf16 and an f16 value) and apply the scales in float32: k_scale multiplies the scores (folded into the
softmax scale), v_scale the output. No step converts the pool itself.

A scale is None (1), a Python float > 0, or a float array of shape [] or [kv_heads] (traced: one compiled step serves
every layer's scales). The ops take them for any pool dtype; the backends pass them for fp8 pools only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)


def is_fp8(dtype) -> bool:
    return any(jnp.dtype(dtype) == jnp.dtype(d) for d in FP8_DTYPES)


def kv_scale_table(k_scale, v_scale, kv_heads: int) -> jax.Array | np.ndarray | None:
    """f32[2, kv_heads]: row 0 the K scale of every kv head, row 1 the V scale; None when both scales are None. A
    numpy array when both scales are Python numbers (a constant whose values the kernels' operands can still read
    at trace time, where inside jit a jnp constant is a tracer: `scale_table_operand`), else a jax array.

    The arguments are checked first (`jaxattn.checks.check_kv_scale`).
    """
    if k_scale is None and v_scale is None:
        return None

    def row(scale):
        # Python numbers (SGLang's per-layer scales) stay numpy: the table is then a constant of the compiled step,
        # where jnp would make XLA launch a broadcast kernel on every call (0.9 us and a launch gap on the H100).
        if scale is None or isinstance(scale, (int, float, np.number)):
            return np.full((kv_heads,), 1.0 if scale is None else scale, np.float32)
        return jnp.broadcast_to(jnp.asarray(scale, jnp.float32).reshape(-1), (kv_heads,))

    rows = [row(k_scale), row(v_scale)]
    if all(isinstance(r, np.ndarray) for r in rows):
        return np.stack(rows)
    return jnp.stack(rows)


def scale_table_operand(table, kv_heads: int | None = None) -> jax.Array:
    """`kv_scale_table`'s table as a kernel operand, flat f32[2 * kv_heads] (K's scales, then V's), read by index;
    table None (an fp8 pool without scales): scales of 1 for kv_heads heads.
    A constant table (Python-number scales) whose values are all equal gets one element more, unlike them and never
    read: XLA turns a constant of more than one element, all equal, into a broadcast kernel launched on every call
    (0.9 us and a launch gap on the H100, benchmarks/RESULTS.md, forty-third session). A traced table stays as it is."""
    if table is None:
        table = np.ones((2, kv_heads), np.float32)
    if not isinstance(table, np.ndarray):  # traced
        return table.astype(jnp.float32).reshape(-1)
    values = table.astype(np.float32).reshape(-1)
    if values.size > 1 and (values == values[0]).all():
        values = np.append(values, np.float32(1.0 if values[0] == 0 else 0.0))
    return jnp.asarray(values)


def per_head_factor(scale):
    """A scale (a float, or an array [] / [kv_heads]) as a float32 factor broadcastable over [rows, kv_heads, dim]."""
    return jnp.asarray(scale, jnp.float32).reshape(1, -1, 1)


def in_pool(ids, num_rows: int):
    """bool[...]: the ids (slots, or page ids over num_rows pages) that address a real row of the pool,
    1 <= id < num_rows (numpy or jax arrays, any integer dtype: no narrowing first, so an int64 id past 2**32 cannot
    wrap into the pool). Any other id reads as the padding row 0 (0 itself is that row): the one rule of the
    references' gathers, `jaxattn.paging.page_in_pool` and FlashInfer's lists, as every kernel reads (Triton's
    `_checked_slots`, the Mosaic GPU kernels' `row_sources`)."""
    return (ids > 0) & (ids < num_rows)


def dequantised_rows(pool, slots, scale, dtype):
    """pool[slots] as `dtype` values, multiplied by `scale` (None: as stored) in float32: the rows a step needs,
    never the pool. pool: [slots, kv_heads, dim]; slots: [rows], any value (outside the pool: slot 0)."""
    rows = pool[jnp.where(in_pool(slots, pool.shape[0]), slots, 0)]
    if scale is None:
        return rows.astype(dtype)
    return (rows.astype(jnp.float32) * per_head_factor(scale)).astype(dtype)


def largest_finite(dtype) -> float:
    """The largest finite value of an fp8 format (e4m3fn: 448, e5m2: 57344): writes saturate there."""
    return float(jnp.finfo(dtype).max)
