"""`jaxattn.mla.mla_extend_attention`: absorbed MLA extend, V = the first v_head_dim dims of the latent rows.

The Triton route (V sliced from K) runs under the interpreter on CPU; the Mosaic GPU kernel's numerics run under
`-m gpu` on an sm_90 GPU (CI lowers it: tests/lower_mgpu_kernel.py). Pools are bigger than the batch, slots scattered,
unused rows NaN.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.mla import IMPLEMENTATIONS, mla_extend_attention, mla_extend_attention_reference
from jaxattn.registry import declined
from tests.helpers import HAS_GPU, assert_nan_confined, tolerance
from tests.test_extend import _clean, make_batch

needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU (sm_90)")


def check(batch, dtype, impl, mode=None, **kw):
    o = mla_extend_attention(batch.q, batch.k_new, batch.k_pool, batch.meta, impl=impl, launch_mode=mode, **kw)
    ref = mla_extend_attention_reference(batch.q, batch.k_new, _clean(batch.k_pool), batch.meta, **kw)
    assert o.shape == batch.q.shape[:2] + (kw.get("v_head_dim") or {576: 512, 288: 256}[batch.q.shape[2]],)
    o, ref = np.float32(o), np.float32(ref)
    assert not np.isnan(o).any()
    np.testing.assert_array_equal(o[batch.tokens:], 0.0)  # padding tokens
    np.testing.assert_allclose(o[: batch.tokens], ref[: batch.tokens], **tolerance(dtype))


def test_triton_route_matches_reference(rng):
    batch = make_batch(rng, [9, 0], [7, 12], hq=2, hkv=1, dqk=576, dtype=jnp.float16)
    check(batch, jnp.float16, "triton", "interpret")


def test_arguments_are_checked(rng):
    batch = make_batch(rng, [3], [4], hq=2, hkv=1, dqk=576, dtype=jnp.float16)
    with pytest.raises(ValueError, match="k_new must have shape"):
        mla_extend_attention(batch.q, batch.k_new[:, :, :512], batch.k_pool, batch.meta)
    with pytest.raises(ValueError, match="k_pool must be"):
        mla_extend_attention(batch.q, batch.k_new, jnp.concatenate([batch.k_pool] * 2, axis=1), batch.meta)
    with pytest.raises(ValueError, match="v_head_dim"):
        mla_extend_attention(batch.q[..., :100], batch.k_new[..., :100], batch.k_pool[..., :100], batch.meta)
    with pytest.raises(ValueError, match="sinks must have shape"):
        mla_extend_attention(batch.q, batch.k_new, batch.k_pool, batch.meta, sinks=jnp.zeros(3))
    windowed = make_batch(rng, [3], [4], hq=2, hkv=1, dqk=576, dtype=jnp.float16, window=2)
    with pytest.raises(ValueError, match="sliding window"):
        mla_extend_attention(windowed.q, windowed.k_new, windowed.k_pool, windowed.meta)


def test_declines_name_the_reason(rng):
    from jaxattn.calls import MlaExtendCall

    def reasons(dim, v_dim, dtype, heads=16):
        batch = make_batch(rng, [3], [4], hq=heads, hkv=1, dqk=dim, dtype=dtype)
        call = MlaExtendCall(q=batch.q, k_new=batch.k_new, k_pool=batch.k_pool, meta=batch.meta, v_head_dim=v_dim,
                             sinks=None, sm_scale=0.1, launch_mode="interpret")
        return declined(IMPLEMENTATIONS, call)

    assert "head dims 576/448" in reasons(576, 448, jnp.bfloat16)["mgpu"]
    assert "float32" in reasons(576, 512, jnp.float32)["mgpu"]
    assert "q heads" in reasons(576, 512, jnp.bfloat16, heads=12)["mgpu"]
    assert "interpreted" in reasons(288, 256, jnp.bfloat16)["mgpu"]  # the half-size head is taken too
    got = reasons(576, 512, jnp.bfloat16)  # taken: only the device declines it here
    assert "interpreted" in got["mgpu"] and got["triton"] is None
    # The GQA extend kernel over the latent cache (impl "mgpu-gqa"): 288/256 only (O's 64 x 512 accumulator at 576
    # does not fit a consumer warpgroup's registers), 16-bit, q's dtype in the pool.
    assert "288/256 only" in got["mgpu-gqa"]
    assert "interpreted" in reasons(288, 256, jnp.bfloat16)["mgpu-gqa"]
    assert "float32" in reasons(288, 256, jnp.float32)["mgpu-gqa"]


def test_gqa_kernel_latent_tiles_fit_shared_memory():
    # Q tiles 320 wide (288 padded), 16 KB of O chunk buffers and a 3-stage ring of 64-key K tiles (V read from them).
    from jaxattn import hardware, tuning

    config = tuning.mgpu_extend_latent_config(288, 256)
    assert (config.block_q, config.block_kv, config.stages) == (64, 64, 3)
    assert config.latent_shared_memory_bytes(288) == (2 * 64 * (320 + 64) + 3 * 64 * 320) * 2 + 4096
    assert config.latent_shared_memory_bytes(288) <= hardware.SM90.shared_memory_bytes
    assert tuning.mgpu_extend_latent_config(576, 512) is None


def test_gqa_kernel_latent_mode_refuses_what_it_cannot_take():
    # The kernel's own checks (trace time): a latent cache takes no V operands, no TMA / page copies of its rows, and
    # q's width must be the rows' rounded up to 64.
    from jaxattn.kernels.extend_attention_mgpu import extend_attention_mgpu_kernel

    S = jax.ShapeDtypeStruct
    q, k = S((64, 16, 320), jnp.bfloat16), S((64, 1, 288), jnp.bfloat16)
    idx = S((4,), jnp.int32)
    common = dict(max_extend_len=64, sm_scale=0.1, block_q=64, block_kv=64, stages=2, o_rows_columns=64,
                  latent_v_dim=256)
    with pytest.raises(ValueError, match="v_pool = v_new = None"):
        extend_attention_mgpu_kernel(q, k, k, k, k, idx, idx, idx, None, tma_new_tiles=False, **common)
    with pytest.raises(ValueError, match="tma_new_tiles and page_rows must be off"):
        extend_attention_mgpu_kernel(q, k, None, k, None, idx, idx, idx, None, tma_new_tiles=True, **common)
    with pytest.raises(ValueError, match="rounded up to 64"):
        extend_attention_mgpu_kernel(S((64, 16, 384), jnp.bfloat16), k, None, k, None, idx, idx, idx, None,
                                     tma_new_tiles=False, **common)


# (dtype, q heads, prefix lens, extend lens): 16 heads (4 tokens per 64-row block), 128 heads (two blocks per token),
# 4 heads (16 tokens per block); empty prefixes and extends, prefixes ending mid-tile, long extends.
GPU_CASES = [
    (jnp.bfloat16, 16, [0, 100, 1000, 37, 5], [1, 5, 70, 300, 0], 576),
    (jnp.float16, 128, [64, 3], [9, 40], 576),
    (jnp.bfloat16, 4, [200, 0], [33, 130], 576),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("case", GPU_CASES, ids=["16-heads-bf16", "128-heads-f16", "4-heads-bf16"])
def test_kernel_matches_reference(rng, case, sinks):
    dtype, hq, prefix_lens, extend_lens, dim = case
    batch = make_batch(rng, prefix_lens, extend_lens, hq=hq, hkv=1, dqk=dim, dtype=dtype,
                       max_extend_len=max(extend_lens) + 3)
    kw = dict(sinks=jnp.asarray(rng.standard_normal(hq).astype(np.float32))) if sinks else {}
    check(batch, dtype, "mgpu", **kw)


@pytest.mark.gpu
@needs_gpu
def test_kernel_half_size_latent_head_288(rng):
    # 288 = 256 + 32: rows 320 wide in shared memory (the last tile half zeros), a 4-deep ring, V 256 wide.
    batch = make_batch(rng, [0, 100, 1000, 37], [1, 70, 300, 9], hq=16, hkv=1, dqk=288, dtype=jnp.bfloat16)
    sinks = jnp.asarray(rng.standard_normal(16).astype(np.float32))
    o = np.float32(mla_extend_attention(batch.q, batch.k_new, batch.k_pool, batch.meta, sinks=sinks, impl="mgpu"))
    ref = np.float32(mla_extend_attention_reference(batch.q, batch.k_new, _clean(batch.k_pool), batch.meta, sinks=sinks))
    np.testing.assert_array_equal(o[batch.tokens:], 0.0)
    np.testing.assert_allclose(o[: batch.tokens], ref[: batch.tokens], **tolerance(jnp.bfloat16))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("case", [
    # 16 heads: long extends (two q tiles), an empty extend and prefix, prefixes ending mid-tile, token counts not a
    # multiple of 8; short extends (<= 64 new tokens: two q heads per CTA); 4 heads in f16.
    (jnp.bfloat16, 16, [0, 100, 1000, 37, 5], [1, 5, 70, 300, 0]),
    (jnp.bfloat16, 16, [3, 0, 4096], [60, 17, 33]),
    (jnp.float16, 4, [200, 0], [33, 130]),
], ids=["16-heads-bf16", "16-heads-short-bf16", "4-heads-f16"])
def test_gqa_kernel_latent_288_matches_reference(rng, case, sinks):
    # impl "mgpu-gqa": the GQA extend kernel with V read from the latent K tiles (rows 288 wide, copied by cp.async
    # into 320-wide tiles; q padded to 320; O stored in 64-column chunks).
    dtype, hq, prefix_lens, extend_lens = case
    batch = make_batch(rng, prefix_lens, extend_lens, hq=hq, hkv=1, dqk=288, dtype=dtype,
                       max_extend_len=max(extend_lens) + 3)
    kw = dict(sinks=jnp.asarray(rng.standard_normal(hq).astype(np.float32))) if sinks else {}
    check(batch, dtype, "mgpu-gqa", **kw)


# The Mosaic GPU routes: the MLA kernel at 576/512, the GQA extend kernel over the latent cache at 288/256.
KERNELS = [pytest.param(("mgpu", 576, 512), id="mgpu_576"), pytest.param(("mgpu-gqa", 288, 256), id="mgpu_gqa_288")]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_nan_stays_in_its_row(rng, kernel):
    impl, dim, _ = kernel
    batch = make_batch(rng, [50, 7], [20, 9], hq=16, hkv=1, dqk=dim, dtype=jnp.bfloat16)
    q = batch.q.at[3, 5, 10].set(jnp.nan)
    assert_nan_confined(mla_extend_attention(q, batch.k_new, batch.k_pool, batch.meta, impl=impl), (3, 5))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_under_hostile_metadata(rng, kernel):
    # An indptr past the index list and the tokens, slots outside the pool: no fault, the shape the op promises.
    impl, dim, v_dim = kernel
    batch = make_batch(rng, [50, 7], [20, 9], hq=16, hkv=1, dqk=dim, dtype=jnp.bfloat16)
    meta = dataclasses.replace(batch.meta, kv_indices=batch.meta.kv_indices.at[3].set(10**9).at[10].set(-5),
                               qo_indptr=batch.meta.qo_indptr.at[-1].set(10**6),
                               kv_indptr=batch.meta.kv_indptr.at[-1].set(10**7))
    o = mla_extend_attention(batch.q, batch.k_new, batch.k_pool, meta, impl=impl)
    jax.block_until_ready(o)
    assert o.shape == batch.q.shape[:2] + (v_dim,)


def test_batches_past_the_grid_limit_are_declined():
    # The batch is the MLA extend kernel's second grid dimension (at most 65535): larger batches take Triton.
    from types import SimpleNamespace

    from jaxattn.impl import mgpu_mla

    call = SimpleNamespace(qk_head_dim=576, v_head_dim=512, q=jax.ShapeDtypeStruct((8, 16, 576), jnp.bfloat16),
                           k_pool=jax.ShapeDtypeStruct((9, 1, 576), jnp.bfloat16), q_heads=16,
                           meta=SimpleNamespace(qo_indptr=jax.ShapeDtypeStruct((65537,), jnp.int32)), launch_mode="gpu")
    assert "grid's second dimension" in mgpu_mla.declines_extend(call)
