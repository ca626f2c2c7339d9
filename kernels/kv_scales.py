"""What the kernels share about fp8 pools (`jaxattn.fp8`): their K/V scales."""

import triton
import triton.language as tl


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
