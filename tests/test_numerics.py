"""Numerics: logits of magnitude 1e4 (before scaling, and after with sm_scale=1), with and without a soft cap, fp16 and
bf16, through decode and both extend kernels: finite, and equal to the reference within the dtype's tolerance.

The softmax is then nearly one-hot, so these catch a missing running-max subtraction (exp overflow), fp16 dot
outputs (|q.k| = 1e4 is near fp16's max 65504 once summed), and a soft cap applied after exponentiation. The
interpreter computes in fp32; the reference upcasts too, and is checked for finiteness on its own.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.decode import decode_attention, decode_attention_reference, decode_metadata_from_indptr
from tests.helpers import MODES, tolerance
from tests.test_decode import make_pools
from tests.test_extend import SMALL, make_batch, ref_two_stage, ref_unified, run_two_stage, run_unified

MAGNITUDE = 1e4
# Each dtype with and without a soft cap; sm_scale=1 makes the scaled logits 1e4 too (and exp(2 * 1e4 / cap) overflow
# inside the kernels' tanh = 2 * sigmoid(2x) - 1, which saturates to +-1 as it should: numpy warns, harmlessly).
CASES = [
    pytest.param(dtype, cap, sm_scale, id=f"{jnp.dtype(dtype).name}-cap{cap:g}-{'scale1' if sm_scale else 'default'}")
    for dtype, cap, sm_scale in (
        (jnp.float16, 0.0, None), (jnp.bfloat16, 30.0, None), (jnp.float16, 50.0, 1.0), (jnp.bfloat16, 0.0, 1.0),
    )
]
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _rescale(q, keys):
    """q scaled so that the largest |q . k| over every (query head, key head) pair is MAGNITUDE."""
    qf = np.asarray(q, np.float32)
    kf = np.nan_to_num(np.asarray(keys, np.float32))
    logits = np.einsum("thd,skd->thsk", qf, kf)
    return qf * (MAGNITUDE / np.abs(logits).max())


def _tol(dtype, o):
    # Nearly one-hot softmax: an fp32 logit error of ~1e4 * 2^-23 moves weights by ~1e-3 relative near ties.
    tol = tolerance(dtype)
    return dict(atol=max(tol["atol"], 4e-3), rtol=max(tol["rtol"], 4e-3))


def _max_logit(q, keys):
    return np.abs(np.einsum("thd,skd->thsk", np.asarray(q, np.float32), np.nan_to_num(np.asarray(keys, np.float32)))).max()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype, logit_cap, sm_scale", CASES)
def test_decode_huge_logits(rng, mode, dtype, logit_cap, sm_scale):
    kv_lens = [1, 45, 0, 70]
    q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, kv_lens, 8, 2, 64, 64, jnp.float32)
    used = np.asarray(kv_indices)
    k_pool = (k_pool * 4.0).astype(dtype)  # the keys' own magnitude is large too, not just q's
    q = jnp.asarray(_rescale(q, k_pool[used]), dtype)
    assert _max_logit(q, k_pool[used]) > 0.9 * MAGNITUDE  # still ~1e4 after rounding to the dtype
    v_pool = v_pool.astype(dtype)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=8, kv_heads=2, max_kv_splits=3, min_split_len=16, programs_per_sm=10**6)
    kw = dict(logit_cap=logit_cap, sm_scale=sm_scale, return_lse=True)
    o, lse = decode_attention(q, k_pool, v_pool, meta, mode=mode, **kw)
    ref_o, ref_lse = decode_attention_reference(q, k_pool, v_pool, meta, **kw)
    o, ref_o = np.asarray(o, np.float32), np.asarray(ref_o, np.float32)
    assert np.isfinite(ref_o).all(), "reference output not finite"
    assert np.isfinite(o).all(), "kernel output not finite"
    live = np.asarray(kv_lens) > 0
    assert np.isfinite(np.asarray(ref_lse)[live]).all() and np.isfinite(np.asarray(lse)[live]).all()
    np.testing.assert_array_equal(o[2], 0.0)
    np.testing.assert_allclose(o, ref_o, **_tol(dtype, o))
    # LSE ~ the largest scaled logit (up to 1e4): compare relatively.
    np.testing.assert_allclose(np.asarray(lse)[live], np.asarray(ref_lse)[live], rtol=1e-5, atol=2e-3)
    if logit_cap:
        assert np.abs(np.asarray(lse)[live]).max() <= logit_cap + np.log(max(kv_lens)) + 1e-3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype, logit_cap, sm_scale", CASES)
def test_extend_huge_logits(rng, mode, dtype, logit_cap, sm_scale):
    batch = make_batch(rng, [20, 0, 9], [13, 17, 0], hq=4, hkv=2, dqk=64, dtype=jnp.float32, scale=4.0)
    keys = np.concatenate([np.nan_to_num(np.asarray(batch.k_pool_unified))])
    q = jnp.asarray(_rescale(batch.q, keys), dtype)
    assert _max_logit(q, keys) > 0.9 * MAGNITUDE
    cast = {name: getattr(batch, name).astype(dtype) for name in ("k_new", "v_new", "k_pool", "v_pool", "k_pool_unified", "v_pool_unified")}
    batch.__dict__.update(cast, q=q)
    kw = dict(logit_cap=logit_cap, sm_scale=sm_scale, config=SMALL)
    for run, ref, name in ((run_two_stage, ref_two_stage, "two-stage"), (run_unified, ref_unified, "unified")):
        o = np.asarray(run(batch, mode, **kw), np.float32)
        r = np.asarray(ref(batch, **kw), np.float32)
        assert np.isfinite(r).all(), f"{name}: reference output not finite"
        assert np.isfinite(o).all(), f"{name}: kernel output not finite"
        np.testing.assert_array_equal(o[batch.tokens :], 0.0)
        np.testing.assert_allclose(o, r, err_msg=name, **_tol(dtype, o))


def test_reference_is_finite_in_low_precision_without_upcasting_help():
    """The reference itself on 1e4 logits in fp16/bf16 inputs: finite and one-hot where one key dominates."""
    from jaxattn.reference import ragged_paged_attention_reference

    for dtype in (jnp.float16, jnp.bfloat16):
        k = jnp.asarray(np.eye(4, 64, dtype=np.float32)[:, None, :] * 100.0, dtype)  # 4 orthogonal keys
        v = jnp.asarray(np.arange(4, dtype=np.float32)[:, None, None] * np.ones((4, 1, 16), np.float32), dtype)
        q = jnp.asarray(np.eye(4, 64, dtype=np.float32)[2][None, None, :] * 100.0, dtype)  # q . k_2 = 1e4, others 0
        indptr = jnp.asarray([0, 4], jnp.int32)
        for cap in (0.0, 30.0):
            o, lse = ragged_paged_attention_reference(q, k, v, jnp.asarray([0, 1], jnp.int32), indptr, jnp.arange(4, dtype=jnp.int32),
                                                      causal=False, logit_cap=cap, sm_scale=1.0, return_lse=True)
            assert np.isfinite(np.asarray(o, np.float32)).all() and np.isfinite(np.asarray(lse)).all()
            if cap == 0.0:
                np.testing.assert_allclose(np.asarray(o, np.float32), 2.0)  # exactly key 2's value
                np.testing.assert_allclose(lse, 1e4, rtol=1e-6)
            else:
                want = (2 * np.exp(30.0 - 30.0)) / (np.exp(30.0 - 30.0) + 3 * np.exp(-30.0))
                np.testing.assert_allclose(np.asarray(o, np.float32), want, rtol=1e-2)
