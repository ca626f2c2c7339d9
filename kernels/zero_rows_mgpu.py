"""The output buffer of a ragged extend kernel, with zeros in exactly the rows the kernel does not write.

The Mosaic GPU extend kernels write rows [qo_indptr[b], min(qo_indptr[b + 1], qo_indptr[b] + max_extend_len)) of
each sequence b and nothing else; the op's contract says every other row is 0 (padding tokens past qo_indptr[-1],
rows past the static bucket). Zeroing the whole buffer first is an XLA memset of the whole output (134 MB at E1);
this kernel writes zeros only where no CTA of the extend kernel will, into a fresh buffer that the extend kernel then
fills in place: 3.4% / 4.3% faster than the memset at E3 / E1 on the H100 (benchmarks/RESULTS.md, twenty-fourth
session).

Rows are contiguous in the row-major output, so each span of unwritten rows is one contiguous byte range, cleared
with 16-byte stores. The spans (`zero_span`): span 0 = [0, qo_indptr[0]), span s = 1..batch = sequence s - 1's rows
past max_extend_len, span batch + 1 = [qo_indptr[batch], rows), each clamped into [0, rows). Where qo_indptr rises
monotonically these are exactly the rows the kernel leaves; where it does not (hostile metadata) the sequences'
ranges still cover [qo_indptr[0], max(qo_indptr)) (the first step of the walk past a row contains it), so no row is
left uninitialised. Spans 0..batch are one CTA each (they are empty unless the metadata is inconsistent); the
padding span, which a serving bucket can make large, is shared by `padding_ctas` CTAs.
"""

from __future__ import annotations

import math

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, scf

from jaxattn.kernels.extend_attention_mgpu import WARPGROUP, global_address, scalar_value, thread_in_warpgroup

STORE_BYTES = 16  # one st.global.v4 per thread and step
# The padding span gets one CTA per this many bytes of the whole output, at most MAX_PADDING_CTAS: a bucket that is
# mostly padding is cleared at about the rate of the memset this replaces, a batch without padding costs a few
# CTAs that exit at once.
PADDING_BYTES_PER_CTA = 256 * 1024
MAX_PADDING_CTAS = 264
_SCALAR = plgpu.Layout.WG_SPLAT(())


def zero_span(span, qo_at, *, batch: int, rows: int, max_extend_len: int):
    """(lo, hi) i32: the rows of span `span` (0..batch + 1, see the module docstring), lo <= hi, both in [0, rows].
    qo_at(i) -> qo_indptr[i] (i traced, in [0, batch]). jnp on scalars: the kernel and the tests share it."""
    clamp = lambda x: jnp.clip(x, 0, rows)  # noqa: E731
    # A sequence's rows end at qo_indptr[b] + max_extend_len, from the raw start (the GQA kernel) or the clamped one
    # (the MLA kernel); the span starts at the lower of the two (no overflow: rows, max_extend_len < 2**30).
    prev = jnp.minimum(qo_at(jnp.maximum(span - 1, 0)), rows) + min(max_extend_len, rows)
    here = clamp(qo_at(jnp.minimum(span, batch)))
    lo = jnp.where(span == 0, 0, jnp.where(span == batch + 1, here, prev))
    hi = jnp.where(span == 0, here, jnp.where(span == batch + 1, rows, here))
    lo = clamp(lo)
    return lo, jnp.maximum(lo, hi)


def padding_ctas(rows: int, row_bytes: int) -> int:
    return max(1, min(MAX_PADDING_CTAS, -(-rows * row_bytes // PADDING_BYTES_PER_CTA)))


def _clear_bytes(out, first, last, cta, ctas, row_bytes: int):
    """This warpgroup stores zeros to bytes [first * row_bytes, last * row_bytes) of `out`, as CTA `cta` of `ctas`
    (i32 scalars) sharing the range: every ctas-th block of 128 x 16 bytes (consecutive threads, consecutive 16
    bytes: coalesced)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), _SCALAR, _SCALAR, _SCALAR, _SCALAR))
    def run(ctx, out, first, last, cta, ctas):
        del ctx
        index = ir.IndexType.get()
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        vector = ir.VectorType.get([STORE_BYTES // 4], i32)
        zeros = arith.constant(vector, ir.DenseElementsAttr.get_splat(vector, ir.IntegerAttr.get(i32, 0)))
        per_row = row_bytes // STORE_BYTES

        def to_index(x, scale):  # i32 rows -> index of 16-byte words (64-bit arithmetic)
            x = scalar_value(x)
            return arith.index_cast(index, arith.muli(arith.extsi(i64, x), arith.constant(i64, scale)))

        thread = arith.index_cast(index, thread_in_warpgroup())
        start = arith.addi(arith.addi(to_index(first, per_row), to_index(cta, WARPGROUP)), thread)
        stop = to_index(last, per_row)
        base = llvm.inttoptr(llvm.PointerType.get(1), global_address(out))
        loop = scf.ForOp(start, stop, to_index(ctas, WARPGROUP))
        with ir.InsertionPoint(loop.body):
            word = arith.index_cast(i64, loop.induction_variable)
            llvm.store(zeros, mgpu_utils.getelementptr(base, [word], vector), alignment=STORE_BYTES)
            scf.yield_([])

    run(out, first, last, cta, ctas)


def unwritten_rows_zeroed(qo_indptr, *, rows: int, row_shape: tuple, dtype, max_extend_len: int,
                          owner=None) -> jax.Array:
    """A fresh [rows, *row_shape] buffer of `dtype` in which every row that an extend kernel with this qo_indptr
    (i32[batch + 1]) and max_extend_len does not write is 0; the rows it writes are left uninitialised (for it to
    fill in place). Rows whose bytes are not a multiple of 16, or 2**30 rows or more: all zeros (XLA's memset).

    owner: an array of the call the buffer is for (its q). The buffer is then made from values tied to it by an
    optimization barrier, so that XLA cannot merge the buffers of two calls with the same metadata (a model's layers
    in one jitted step) into one buffer, which every call filling it in place would then copy whole first: at E1,
    134 MB a layer, one 630-us gap in a step of 8 layers on the H100 (benchmarks/RESULTS.md, thirty-fifth session)."""
    batch = qo_indptr.shape[0] - 1
    row_bytes = math.prod(row_shape) * np.dtype(dtype).itemsize
    if row_bytes % STORE_BYTES or rows >= 2**30 or rows == 0:
        zero = jnp.zeros((), dtype)
        if owner is not None:
            zero = lax.optimization_barrier((zero, owner))[0]
        return jnp.broadcast_to(zero, (rows, *row_shape))
    if owner is not None:
        qo_indptr = lax.optimization_barrier((qo_indptr, owner))[0]
    padding = padding_ctas(rows, row_bytes)

    def body(qo_ref, out_ref):
        cta = lax.axis_index("cta")
        span = jnp.minimum(cta, batch + 1)  # CTAs past batch + 1 share the padding span
        lo, hi = zero_span(span, lambda i: qo_ref[i], batch=batch, rows=rows, max_extend_len=max_extend_len)
        padding_part = cta > batch
        _clear_bytes(out_ref, lo, hi, jnp.where(padding_part, cta - (batch + 1), 0),
                     jnp.where(padding_part, padding, 1), row_bytes)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((rows, *row_shape), dtype),
        grid=(batch + 1 + padding,),
        grid_names=("cta",),
    )(qo_indptr.astype(jnp.int32))
