"""What the kernels share about fp8 pools (`jaxattn.fp8`): their K/V scales, and the rule that splits q into e4m3
parts for fp8 scores (S = Q K^T on fp8 tensor cores straight from the pool's K rows)."""

import triton
import triton.language as tl

# fp8 scores: q (bf16 or f16) as Q_PARTS e4m3 parts, 4 significant bits each. The error is relative to the row's
# largest entry (at most 2**-14.8 of it over every row value: tests/test_decode_gqa_mgpu.py checks 2**-12), not to each
# entry as an f16 rounding's is, so small entries beside outlier channels keep fewer bits; two parts (8 bits) passed
# random scores but not scores of tens (tests/test_fp8.py). Each row is scaled so its largest |q * sm_scale| becomes
# e4m3's largest finite value; a row whose largest is under TINY_ROW_MAX (zeros: scores
# that small are 0 to the softmax, and its scale would flush to 0) is split at scale 1.
Q_PARTS = 3  # split_q_rows below returns exactly three
Q_DTYPES = ("bfloat16", "float16")
E4M3_MAX = 448.0
TINY_ROW_MAX = 2.0**-64
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_TINY_ROW_MAX = tl.constexpr(TINY_ROW_MAX)


@triton.jit
def load_kv_scales(KV_SCALES, kv_head, KV_HEADS: tl.constexpr, HAS_KV_SCALES: tl.constexpr):
    """(k_scale, v_scale) of kv head `kv_head`: f32 values from KV_SCALES [2, KV_HEADS], or 1.0 constants (16-bit
    pools: the kernel's arithmetic stays as without scales)."""
    if HAS_KV_SCALES:
        k_scale = tl.load(KV_SCALES + kv_head)
        v_scale = tl.load(KV_SCALES + KV_HEADS + kv_head)
    else:
        k_scale = 1.0
        v_scale = 1.0
    return k_scale, v_scale


@triton.jit
def _round_to_e4m3(x):
    """x (f32, |x| <= E4M3_MAX) rounded to the nearest e4m3fn value (ties to even) in f32 arithmetic, so that the cast
    to e4m3 that follows is exact: the hardware's cvt gives the same value, and Triton's interpreter (whose f32 -> fp8
    rounding is not faithful) does too. Spacing 2**(e - 3) in binade e, 2**-9 below 2**-6 (subnormals); (x + c) - c
    with c = 1.5 * 2**23 * spacing rounds to a multiple of the spacing."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    c = (((exponent - 3 + 23 + 127) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    return (x + c) - c


@triton.jit
def split_q_rows(q, SM_SCALE: tl.constexpr):
    """q [rows, d] -> (part 0, part 1, part 2, row_scale f32[rows]): Q_PARTS e4m3 parts with q * SM_SCALE ~=
    row_scale * (part 0 + part 1 + part 2), each part the rounding the parts before it left. A row holding NaN gets
    a NaN scale, so each of its scores is NaN."""
    scaled = q.to(tl.float32) * SM_SCALE
    row_max = tl.max(tl.abs(scaled), axis=1)
    has_nan = tl.max((scaled != scaled).to(tl.int32), axis=1) > 0
    row_scale = tl.where(row_max < _TINY_ROW_MAX, 1.0, row_max * (1.0 / _E4M3_MAX))
    row_scale = tl.where(has_nan, float("nan"), row_scale)
    left = tl.where(has_nan[:, None], 0.0, scaled / row_scale[:, None])
    part0 = _round_to_e4m3(left)
    left = left - part0
    part1 = _round_to_e4m3(left)
    part2 = _round_to_e4m3(left - part1)
    return part0.to(tl.float8e4nv), part1.to(tl.float8e4nv), part2.to(tl.float8e4nv), row_scale
