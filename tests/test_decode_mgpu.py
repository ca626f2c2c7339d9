"""The Mosaic GPU MLA decode kernel (`decode_attention(..., impl="mgpu")`) against the reference.

The kernel needs an sm_90 GPU: its numerics run under `-m gpu`; CI lowers it for CUDA (tests/lower_mgpu_kernel.py,
from tests/test_extend_mgpu.py) and checks here what runs without a GPU (which calls it takes, its split rule).
Pools are bigger than the batch, slots scattered, every unused row (slot 0 included) NaN, so a wrong gather shows.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.calls import DecodeCall
from jaxattn.decode import decode_attention, decode_attention_reference, decode_metadata_from_indptr, draft_mask_bits
from jaxattn.impl import mgpu_decode, mgpu_mla
from tests.helpers import HAS_GPU, assert_nan_confined, random_normal, random_pool_batch, tolerance
from tests.test_decode import LSE_TOL

needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU (sm_90)")


def make_case(rng, kv_lens, q_heads, tokens, dtype, *, window=-1, deterministic=False, dim=576):
    kv_indptr, kv_indices, slots = random_pool_batch(rng, kv_lens, num_slots=int(np.sum(kv_lens)) + 1 + int(rng.integers(3, 40)))
    used = np.zeros(slots, bool)
    used[np.asarray(kv_indices)] = True
    k_pool = jnp.where(jnp.asarray(~used)[:, None, None], jnp.nan,
                       random_normal(rng, (slots, 1, dim), jnp.float32)).astype(dtype)
    shape = (len(kv_lens), q_heads, dim) if tokens == 1 else (len(kv_lens), tokens, q_heads, dim)
    q = random_normal(rng, shape, dtype)
    # Deterministic: ceil(len / 256) splits per sequence, so the bound must cover the whole pool's worth.
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=q_heads, kv_heads=1,
                                       max_kv_splits=32 if deterministic else 8, sliding_window=window,
                                       deterministic=deterministic)
    return q, k_pool, meta


def run_both(q, k_pool, meta, **kwargs):
    o, lse = decode_attention(q, k_pool, None, meta, impl="mgpu", return_lse=True, **kwargs)
    ref_o, ref_lse = decode_attention_reference(q, k_pool, None, meta, return_lse=True, **kwargs)
    return o, lse, ref_o, ref_lse


def assert_close(o, lse, ref_o, ref_lse, dtype):
    assert not np.isnan(np.float32(o)).any()
    np.testing.assert_allclose(np.float32(o), np.float32(ref_o), **tolerance(dtype))
    finite = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], atol=LSE_TOL[jnp.dtype(dtype)],
                               rtol=LSE_TOL[jnp.dtype(dtype)])


# Lengths: 1, odd, 0 (padding), one tile, a split's tail mid-tile, long ones in many splits.
KV_LENS = [1, 37, 0, 64, 161, 1000, 4097, 300]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("q_heads", [16, 128], ids=["16-heads", "128-heads"])
def test_decode_matches_reference(rng, dtype, q_heads):
    q, k_pool, meta = make_case(rng, KV_LENS, q_heads, 1, dtype)
    o, lse, ref_o, ref_lse = run_both(q, k_pool, meta)
    assert o.shape == (len(KV_LENS), q_heads, 512) and o.dtype == dtype
    assert_close(o, lse, ref_o, ref_lse, dtype)
    np.testing.assert_array_equal(np.float32(o[2]), 0.0)  # padding row
    assert np.all(np.asarray(lse[2]) == -np.inf)



@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tokens,window", [(1, -1), (1, 300), (4, -1)], ids=["decode", "window", "verify-4"])
def test_32_key_tiles_match_reference_and_64(rng, tokens, window):
    # MgpuDecodeConfig(block_kv=32): 32-key tiles in a 4-deep ring (64-byte swizzle, P in its own buffer); against the
    # reference, and the default 64-key tiles on the same inputs (within tolerance: the tile order differs).
    from jaxattn.tuning import MgpuDecodeConfig

    q, k_pool, meta = make_case(rng, KV_LENS, 16, tokens, jnp.bfloat16, window=window)  # the window in meta
    o, lse, ref_o, ref_lse = run_both(q, k_pool, meta, config=MgpuDecodeConfig(block_kv=32))
    assert_close(o, lse, ref_o, ref_lse, jnp.bfloat16)
    o64 = decode_attention(q, k_pool, None, meta, impl="mgpu")
    np.testing.assert_allclose(np.float32(o), np.float32(o64), **tolerance(jnp.bfloat16))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("q_heads,window", [(16, -1), (16, 300), (32, -1)], ids=["16", "16-window", "32"])
def test_transposed_tile_matches_reference_and_the_padded_one(rng, q_heads, window):
    # MgpuDecodeConfig(transposed=True): keys as wgmma's M, the heads as N (S^T = K Q^T, the softmax along the keys,
    # O^T += V^T P^T); against the reference and the padded tile on the same inputs.
    from jaxattn.tuning import MgpuDecodeConfig

    q, k_pool, meta = make_case(rng, KV_LENS, q_heads, 1, jnp.bfloat16, window=window)
    o, lse, ref_o, ref_lse = run_both(q, k_pool, meta, config=MgpuDecodeConfig(transposed=True))
    assert_close(o, lse, ref_o, ref_lse, jnp.bfloat16)
    np.testing.assert_array_equal(np.float32(o[2]), 0.0)  # padding row
    padded = decode_attention(q, k_pool, None, meta, impl="mgpu", config=MgpuDecodeConfig(transposed=False))
    np.testing.assert_allclose(np.float32(o), np.float32(padded), **tolerance(jnp.bfloat16))
    default = decode_attention(q, k_pool, None, meta, impl="mgpu")  # the transposed tile where it takes the call
    np.testing.assert_array_equal(np.float32(default), np.float32(o))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("q_heads,window,splits,sinks", [(16, -1, None, False), (16, -1, 1, False), (16, 300, 2, True),
                                                         (32, -1, 8, False), (16, -1, 64, True)],
                         ids=["16-own", "16-one-split", "16-window-2-sinks", "32-8", "16-64-splits-sinks"])
def test_kernel_merge_matches_reference_and_the_triton_merge(rng, q_heads, window, splits, sinks):
    # MgpuDecodeConfig.kernel_merge: the transposed tile's last split of a sequence folds the others' partials
    # (waiting on a semaphore), sinks included; against the reference, and the Triton merge of the same partials.
    # 64 splits: more CTAs than multiprocessors, so a waiting CTA relies on the ones before it being dispatched first.
    from jaxattn.tuning import MgpuDecodeConfig

    lens = KV_LENS + [20000, 0, 5]
    q, k_pool, meta = make_case(rng, lens, q_heads, 1, jnp.bfloat16, window=window)
    meta = dataclasses.replace(meta, num_kv_splits=jnp.full_like(meta.num_kv_splits, 64), max_kv_splits=64)
    sink_arg = dict(sinks=jnp.asarray(rng.standard_normal(q_heads).astype(np.float32))) if sinks else {}
    o, lse, ref_o, ref_lse = run_both(q, k_pool, meta, config=MgpuDecodeConfig(splits=splits, kernel_merge=True),
                                      **sink_arg)
    assert o.shape == (len(lens), q_heads, 512) and o.dtype == jnp.bfloat16
    assert_close(o, lse, ref_o, ref_lse, jnp.bfloat16)
    for empty in (2, len(lens) - 2):  # no keys: 0 (and LSE -inf, or the sink's)
        np.testing.assert_array_equal(np.float32(o[empty]), 0.0)
        np.testing.assert_array_equal(np.asarray(lse[empty]), sink_arg["sinks"] if sinks else -np.inf)
    triton_o, triton_lse = decode_attention(q, k_pool, None, meta, impl="mgpu", return_lse=True, **sink_arg,
                                            config=MgpuDecodeConfig(splits=splits, kernel_merge=False))
    np.testing.assert_allclose(np.float32(o), np.float32(triton_o), atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(triton_lse), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("transposed,tokens,splits,sinks", [(True, 1, 2, False), (True, 1, 8, True),
                                                            (False, 4, 2, True), (False, 1, 3, False)],
                         ids=["transposed-2", "transposed-8-sinks", "padded-verify-4-2-sinks", "padded-3"])
def test_merger_skew_matches_reference_and_the_even_splits(rng, transposed, tokens, splits, sinks):
    # MgpuDecodeConfig.merger_skew: the merging split takes 64 keys from the split before it (none where that one
    # would be left without keys); against the reference, and the same call with even splits.
    from jaxattn.tuning import MgpuDecodeConfig

    lens = KV_LENS + [20000, 0, 5]
    q, k_pool, meta = make_case(rng, lens, 16, tokens, jnp.bfloat16)
    meta = dataclasses.replace(meta, num_kv_splits=jnp.full_like(meta.num_kv_splits, 64), max_kv_splits=64)
    sink_arg = dict(sinks=jnp.asarray(rng.standard_normal(16).astype(np.float32))) if sinks else {}
    config = MgpuDecodeConfig(splits=splits, kernel_merge=True, transposed=transposed, merger_skew=64)
    o, lse, ref_o, ref_lse = run_both(q, k_pool, meta, config=config, **sink_arg)
    assert_close(o, lse, ref_o, ref_lse, jnp.bfloat16)
    even = decode_attention(q, k_pool, None, meta, impl="mgpu", **sink_arg,
                            config=dataclasses.replace(config, merger_skew=0))
    np.testing.assert_allclose(np.float32(o), np.float32(even), atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tokens,q_heads,splits,sinks,dim", [(4, 16, None, False, 576), (4, 16, 64, True, 576),
                                                             (1, 128, 8, True, 576), (2, 32, 2, False, 576),
                                                             (1, 16, 3, False, 288)],
                         ids=["verify-4-own", "verify-4-64-splits-sinks", "128-heads-8-sinks", "verify-2x32-2", "288-3"])
def test_padded_tile_kernel_merge_matches_reference_and_the_triton_merge(rng, tokens, q_heads, splits, sinks, dim):
    # The padded 64-row tile merging its own splits (each consumer warpgroup its half of V's columns; two head blocks
    # at 128 heads, each with its own semaphore), sinks included; against the reference and the Triton merge.
    from jaxattn.tuning import MgpuDecodeConfig

    lens = [2, 37, 0, 130, 97, 4096, 700, 9000]
    q, k_pool, meta = make_case(rng, lens, q_heads, tokens, jnp.bfloat16, dim=dim)
    meta = dataclasses.replace(meta, num_kv_splits=jnp.full_like(meta.num_kv_splits, 64), max_kv_splits=64)
    sink_arg = dict(sinks=jnp.asarray(rng.standard_normal(q_heads).astype(np.float32))) if sinks else {}
    config = MgpuDecodeConfig(splits=splits, kernel_merge=True, transposed=False)
    o, lse, ref_o, ref_lse = run_both(q, k_pool, meta, config=config, **sink_arg)
    assert o.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.float32(o), np.float32(ref_o), **tolerance(jnp.bfloat16))
    finite = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], atol=2e-3, rtol=2e-3)
    assert not np.isnan(np.float32(o)).any()
    np.testing.assert_array_equal(np.float32(o[2]), 0.0)  # no keys
    triton_o = decode_attention(q, k_pool, None, meta, impl="mgpu", **sink_arg,
                                config=dataclasses.replace(config, kernel_merge=False))
    np.testing.assert_allclose(np.float32(o), np.float32(triton_o), atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tokens,tree", [(4, False), (4, True), (2, True), (3, False)],
                         ids=["t4-causal", "t4-tree", "t2-tree", "t3-causal"])
def test_verify_matches_reference(rng, tokens, tree):
    # Lengths below the token count (the first tokens see nothing), a split of drafts only (long lists).
    kv_lens = [2, 37, 0, 130, 97, 4096, 700]
    q, k_pool, meta = make_case(rng, kv_lens, 16, tokens, jnp.bfloat16)
    draft_mask = None
    if tree:
        parents = [[int(rng.integers(-1, t)) for t in range(tokens)] for _ in kv_lens]
        masks = np.zeros((len(kv_lens), tokens, tokens), bool)
        for b, tree_parents in enumerate(parents):
            for t in range(tokens):
                node = t
                while node >= 0:
                    masks[b, t, node] = True
                    node = tree_parents[node]
        draft_mask = draft_mask_bits(masks)
    o, lse, ref_o, ref_lse = run_both(q, k_pool, meta, draft_mask=draft_mask)
    np.testing.assert_allclose(np.float32(o), np.float32(ref_o), **tolerance(jnp.bfloat16))
    finite = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], atol=2e-3, rtol=2e-3)
    assert not np.isnan(np.float32(o)).any()



@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tokens", [1, 4], ids=["decode", "verify-4"])
def test_half_size_latent_head_288(rng, tokens):
    # 288 = 256 + 32: rows 320 wide in shared memory (the last tile half zeros), a 4-deep ring, V 256 wide.
    q, k_pool, meta = make_case(rng, KV_LENS if tokens == 1 else [2, 37, 0, 130, 4096], 16, tokens, jnp.bfloat16,
                                dim=288)
    o, lse, ref_o, ref_lse = run_both(q, k_pool, meta)
    assert o.shape[-1] == 256
    np.testing.assert_allclose(np.float32(o), np.float32(ref_o), **tolerance(jnp.bfloat16))
    finite = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@needs_gpu
def test_window_sinks_and_deterministic(rng):
    q, k_pool, meta = make_case(rng, KV_LENS, 16, 1, jnp.bfloat16, window=200)
    sinks = jnp.asarray(rng.standard_normal(16).astype(np.float32))
    assert_close(*run_both(q, k_pool, meta, sinks=sinks), jnp.bfloat16)
    # Deterministic metadata: the metadata's splits (length only), so a sequence's bits do not depend on its batch.
    q, k_pool, meta = make_case(rng, KV_LENS, 16, 1, jnp.bfloat16, deterministic=True)
    o, lse, ref_o, ref_lse = run_both(q, k_pool, meta)
    assert_close(o, lse, ref_o, ref_lse, jnp.bfloat16)
    alone = decode_metadata_from_indptr(jnp.asarray([0, KV_LENS[6]], jnp.int32),
                                        meta.kv_indices[int(meta.kv_indptr[6]):int(meta.kv_indptr[7])],
                                        q_heads=16, kv_heads=1, max_kv_splits=32, deterministic=True)
    o_alone = decode_attention(q[6:7], k_pool, None, alone, impl="mgpu")
    np.testing.assert_array_equal(np.float32(o_alone[0]), np.float32(o[6]))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("seq", [4, 6], ids=["one-split", "many-splits"])
def test_nan_stays_in_its_row(rng, seq):
    # Sequence 6 (4097 keys) spans several splits: its NaN passes through the kernel's merge.
    q, k_pool, meta = make_case(rng, KV_LENS, 16, 1, jnp.bfloat16)
    q = q.at[seq, 3, 100].set(jnp.nan)
    assert_nan_confined(decode_attention(q, k_pool, None, meta, impl="mgpu"), (seq, 3))


@pytest.mark.gpu
@needs_gpu
def test_hostile_indices_stay_inside(rng):
    # Slots past the pool and negative ones, and an indptr past kv_indices: clamped, no fault, finite where the
    # reference is (the clamped rows are NaN rows of the pool here, so only the shape and a clean run are checked).
    # Also a verify step (4 tokens: the causal drafts computed in the kernel, and a tree's words read per (sequence,
    # token) with every bit set, strays past the drafts included) over the same hostile lists.
    for tokens, words in ((1, None), (4, None), (4, jnp.full((len(KV_LENS), 4), -1, jnp.int32))):
        q, k_pool, meta = make_case(rng, KV_LENS, 16, tokens, jnp.bfloat16)
        bad = meta.kv_indices.at[5].set(10**9).at[40].set(-7)
        meta = dataclasses.replace(meta, kv_indices=bad, kv_indptr=meta.kv_indptr.at[-1].set(10**6))
        o = decode_attention(q, k_pool, None, meta, impl="mgpu", draft_mask=words)
        jax.block_until_ready(o)
        assert o.shape == q.shape[:-1] + (512,)


# What runs without a GPU.

def _call(q_heads=16, tokens=1, dtype=jnp.bfloat16, qk=576, v_pool=False, kv_heads=1, batch=4, **fields):
    q = jax.ShapeDtypeStruct((batch, q_heads, qk) if tokens == 1 else (batch, tokens, q_heads, qk), dtype)
    k_pool = jax.ShapeDtypeStruct((100, kv_heads, qk), fields.pop("pool_dtype", dtype))
    base = dict(q=q, k_pool=k_pool, v_pool=k_pool if v_pool else None, meta=None, sinks=None, sm_scale=0.1,
                logit_cap=0.0, xai_temperature_len=-1, sliding_window=-1, v_head_dim=512 if qk == 576 else qk,
                return_lse=False, config=None, launch_mode="gpu")
    base.update(fields)
    return DecodeCall(**base)


def test_declines_name_the_reason():
    assert "latent heads" in mgpu_mla.declines_decode(_call(qk=128))
    assert "separate V pool" in mgpu_mla.declines_decode(_call(v_pool=True))
    assert "kv heads" in mgpu_mla.declines_decode(_call(kv_heads=2, q_heads=16))
    assert "float32" in mgpu_mla.declines_decode(_call(dtype=jnp.float32))
    assert mgpu_mla.declines_decode(_call(pool_dtype=jnp.float8_e4m3fn, tokens=4)) == mgpu_mla.declines_decode(_call())
    assert "288 wide" in mgpu_mla.declines_decode(_call(pool_dtype=jnp.float8_e4m3fn, qk=288, v_head_dim=256))
    assert "soft cap" in mgpu_mla.declines_decode(_call(logit_cap=30.0))
    assert "grid's third dimension" in mgpu_mla.declines_decode(_call(batch=70000))
    assert "rows per sequence" in mgpu_mla.declines_decode(_call(q_heads=20))  # 20 rows: not a multiple of 8
    assert "rows per sequence" in mgpu_mla.declines_decode(_call(q_heads=16, tokens=5))  # 80 rows
    assert "interpreted" in mgpu_mla.declines_decode(_call(launch_mode="interpret"))
    from jaxattn.tuning import MgpuDecodeConfig

    assert "576 only" in mgpu_mla.declines_decode(_call(qk=288, v_head_dim=256, config=MgpuDecodeConfig(block_kv=32)))
    assert "without the kernel merge" in mgpu_mla.declines_decode(
        _call(config=MgpuDecodeConfig(kernel_merge=False, merger_skew=64)))
    assert "merger_skew=" in mgpu_decode.declines(_call(qk=128, v_pool=True, kv_heads=2,
                                                        config=MgpuDecodeConfig(merger_skew=64)))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="merger_skew must be None or an int >= 0"):
            MgpuDecodeConfig(merger_skew=bad)
    transposed = MgpuDecodeConfig(transposed=True)
    assert "one token, 16 or 32 heads" in mgpu_mla.declines_decode(_call(q_heads=128, config=transposed))
    assert "one token, 16 or 32 heads" in mgpu_mla.declines_decode(_call(q_heads=64, config=transposed))
    assert "one token" in mgpu_mla.declines_decode(_call(tokens=4, config=transposed))
    assert "other than 576" in mgpu_mla.declines_decode(_call(qk=288, v_head_dim=256, config=transposed))
    assert "the MLA kernel's tiles" in mgpu_decode.declines(_call(qk=128, v_pool=True, kv_heads=2,
                                                                       config=MgpuDecodeConfig(block_kv=32)))
    if not HAS_GPU:
        assert "sm_90" in mgpu_mla.declines_decode(_call())


def test_transposed_tile_register_split_fits_and_is_checked(monkeypatch):
    # The transposed tile's two warpgroups launch with the larger of their registers (232): both of its splits fit
    # (fp8 keeps 224 for its converting producer); a split past the register file's share is refused at trace time.
    import jaxattn.kernels.mla_attention_mgpu as mla_kernel
    from jaxattn.kernels.extend_attention_mgpu import register_split_fits

    assert register_split_fits(mla_kernel.TRANSPOSED_REGISTERS[False])
    assert register_split_fits(mla_kernel.TRANSPOSED_REGISTERS[True])
    assert register_split_fits((248, 240)) and not register_split_fits((256, 248))  # 248: two warpgroups' share
    batch, heads = 2, 16
    q = jnp.ones((batch * heads, 1, 576), jnp.float16)
    pool = jnp.ones((64, 1, 576), jnp.float8_e4m3fn)
    indptr, indices, splits = jnp.array([0, 5, 9], jnp.int32), jnp.arange(9, dtype=jnp.int32), jnp.ones(2, jnp.int32)
    monkeypatch.setitem(mla_kernel.TRANSPOSED_REGISTERS, True, (256, 248))
    with pytest.raises(ValueError, match=r"TRANSPOSED_REGISTERS\[True\] = \(256, 248\) does not fit"):
        jax.eval_shape(lambda: mla_kernel.mla_decode_transposed_kernel(
            q, pool, indptr, indices, splits, q_heads=heads, sm_scale=1.0, max_kv_splits=1,
            v_scale=jnp.ones((1,), jnp.float32)))


def test_transposed_tile_is_the_default_where_it_takes_the_call():
    # MgpuDecodeConfig.transposed None: the transposed tile wherever it takes the call, over a 16-bit latent pool
    # (tuning.sm90.MLA_DECODE_TRANSPOSED) and over fp8 (MLA_DECODE_TRANSPOSED_FP8); True / False force it; the padded
    # tile for verify steps, 64+ heads, 288-wide latents, 32-key tiles.
    from jaxattn.tuning import MgpuDecodeConfig

    assert mgpu_mla.MLA_DECODE_TRANSPOSED and mgpu_mla.MLA_DECODE_TRANSPOSED_FP8
    assert mgpu_mla._transposed(_call(q_heads=16)) and mgpu_mla._transposed(_call(q_heads=32))
    assert mgpu_mla._transposed(_call(q_heads=16, config=MgpuDecodeConfig(splits=2)))
    assert mgpu_mla._transposed(_call(pool_dtype=jnp.float8_e4m3fn))
    assert not mgpu_mla._transposed(_call(pool_dtype=jnp.float8_e4m3fn, tokens=4))
    assert mgpu_mla._transposed(_call(pool_dtype=jnp.float8_e4m3fn, config=MgpuDecodeConfig(transposed=True)))
    assert not mgpu_mla._transposed(_call(q_heads=16, config=MgpuDecodeConfig(transposed=False)))
    assert not mgpu_mla._transposed(_call(pool_dtype=jnp.float8_e5m2, config=MgpuDecodeConfig(transposed=False)))
    for call in (_call(q_heads=64), _call(tokens=4), _call(qk=288, v_head_dim=256),
                 _call(config=MgpuDecodeConfig(block_kv=32))):
        assert not mgpu_mla._transposed(call)


def test_default_takes_fp8_latent_decode_on_either_tile(monkeypatch):
    # On an sm_90 GPU (stood in for here), decode_attention's first implementation, "mgpu", takes fp8 MLA decode:
    # one token at 16 or 32 heads on the transposed tile (1.8x Triton's kernel on the H100), verify steps and 64 heads
    # on the padded tile (MLA_DECODE_PADDED_FP8: 3.3x Triton's kernel at MLA-V4-FP8 on the H200). With that flag off
    # they fall through to the Triton kernel, the padded tile forced by its config to "mgpu-fp8" (which Triton's
    # config type declines), and "mgpu-fp8" takes them all by name either way.
    from jaxattn import decode as decode_module, hardware
    from jaxattn.registry import select
    from jaxattn.tuning import MgpuDecodeConfig

    monkeypatch.setattr(hardware, "mosaic_gpu_unavailable", lambda launch_mode: None)
    assert mgpu_mla.MLA_DECODE_PADDED_FP8
    for fmt in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        off_transposed = (_call(pool_dtype=fmt, tokens=4), _call(pool_dtype=fmt, q_heads=64),
                          _call(pool_dtype=fmt, config=MgpuDecodeConfig(transposed=False)))
        for q_heads in (16, 32):
            assert select(decode_module.IMPLEMENTATIONS, _call(q_heads=q_heads, pool_dtype=fmt)).name == "mgpu"
        assert select(decode_module.IMPLEMENTATIONS, _call(pool_dtype=fmt, dtype=jnp.float16)).name == "mgpu"
        for call in off_transposed:
            assert not mgpu_mla._transposed(call) and mgpu_mla.declines_decode(call) is None
            assert select(decode_module.IMPLEMENTATIONS, call).name == "mgpu"
        assert "288 wide" in mgpu_mla.declines_decode(_call(pool_dtype=fmt, qk=288, v_head_dim=256))
        with monkeypatch.context() as flag_off:
            flag_off.setattr(mgpu_mla, "MLA_DECODE_PADDED_FP8", False)
            assert select(decode_module.IMPLEMENTATIONS, _call(pool_dtype=fmt)).name == "mgpu"
            for call in off_transposed:
                assert "MLA_DECODE_PADDED_FP8 off" in mgpu_mla.declines_decode(call)
                assert select(decode_module.IMPLEMENTATIONS, call).name == ("mgpu-fp8" if call.config else "triton")
                assert select(decode_module.IMPLEMENTATIONS, call, impl="mgpu-fp8").name == "mgpu-fp8"


def test_kernel_merge_is_the_default_on_both_tiles():
    # MgpuDecodeConfig.kernel_merge None (tuning.sm90.MLA_DECODE_KERNEL_MERGE) / True: the kernel merges its splits
    # itself on either tile (sinks included); False: the Triton merge.
    from jaxattn.tuning import MgpuDecodeConfig

    sinks = jax.ShapeDtypeStruct((16,), jnp.float32)
    assert mgpu_mla.MLA_DECODE_KERNEL_MERGE
    for call in (_call(), _call(config=MgpuDecodeConfig(splits=3)), _call(sinks=sinks), _call(tokens=4),
                 _call(q_heads=64), _call(config=MgpuDecodeConfig(transposed=False))):
        assert mgpu_mla._kernel_merges(call)
    assert not mgpu_mla._kernel_merges(_call(config=MgpuDecodeConfig(kernel_merge=False)))
    assert not mgpu_mla._kernel_merges(_call(tokens=4, config=MgpuDecodeConfig(kernel_merge=False)))
    with pytest.raises(ValueError, match="kernel_merge"):
        MgpuDecodeConfig(kernel_merge=1)


def test_rows_rule():
    for tokens, heads in ((1, 16), (4, 16), (3, 16), (1, 128), (8, 16), (2, 64)):
        assert mgpu_mla.rows_unsupported(tokens, heads) is None
    for tokens, heads in ((1, 4), (5, 16), (3, 32)):
        assert mgpu_mla.rows_unsupported(tokens, heads) is not None


def test_split_rule_fills_the_gpu_once():
    assert mgpu_mla.kernel_splits(64, 1, num_sms=132) == 2
    assert mgpu_mla.kernel_splits(128, 1, num_sms=132) == 1
    assert mgpu_mla.kernel_splits(8, 1, num_sms=132) == 16
    assert mgpu_mla.kernel_splits(4, 2, num_sms=132) == 16
    assert mgpu_mla.kernel_splits(1000, 2, num_sms=132) == 1


def test_causal_draft_bits_are_the_causal_tree():
    # The padded tile's causal verify mask, computed from (token, head) row numbers: row r (token r // q_heads) sees
    # every key before the drafts (columns < 0) and the drafts of the causal tree ("t sees 0..t"), both as the tree
    # itself and as the bits of its token's word (draft_mask_bits), over the sequence's columns.
    from jaxattn.kernels.mla_attention_mgpu import causal_draft_bits

    for tokens, q_heads in ((4, 16), (2, 32), (8, 16), (3, 8)):
        tree = np.tril(np.ones((tokens, tokens), bool))  # tree_mask_for_verify of a chain: t sees 0..t
        words = np.asarray(draft_mask_bits(tree[None]))[0].view(np.uint32)
        rows = np.arange(tokens * q_heads)[:, None]
        cols = np.arange(64)[None, :]
        for first_draft in (-70, -3, 0, 2):
            got = np.asarray(causal_draft_bits(jnp.int32(first_draft), jnp.asarray(cols), jnp.asarray(rows),
                                               q_heads=q_heads))
            draft = first_draft + cols
            keys = draft[0] < tokens  # the sequence's columns: before the drafts, or drafts
            visible = ((draft < 0) | (got != 0))[:, keys]
            from_tree = (draft < 0) | tree[rows // q_heads, np.clip(draft, 0, tokens - 1)]
            bit = (words[rows // q_heads] >> np.clip(draft, 0, 31).astype(np.uint32)) & 1
            np.testing.assert_array_equal(visible, from_tree[:, keys])
            np.testing.assert_array_equal(visible, ((draft < 0) | (bit == 1))[:, keys])
