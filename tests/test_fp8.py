"""fp8 KV pools read inside the kernels (issue 26): decode, both extend forms and the backends against the reference
on the same fp8 pool, the quantisation error per format, the scale arguments' checks, and no pool-sized conversion
in a compiled step.

Pools are e4m3fn / e5m2 with unused rows NaN (fp8 has NaN), so a wrong gather shows; q is bf16 (upcast to f32 by the
interpreter, which also sees fp8 pools as f32 values: the same values, exactly).
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import testing
from jaxattn.backends import AttentionLayer, ReferenceBackend, TritonBackend
from jaxattn.decode import DecodeConfig, decode_attention, decode_attention_reference, decode_metadata_from_indptr
from jaxattn.extend import (
    extend_attention,
    extend_attention_reference,
    extend_attention_unified,
    extend_attention_unified_reference,
)
from jaxattn.impl.mgpu_extend import dequantised_prefix
from jaxattn.serving import ForwardMode, write_kv
from tests import test_triton_backend as tb
from tests.helpers import HAS_GPU, MODES, random_normal
from tests.test_decode import make_pools
from tests.test_extend import make_batch

def _clean(pool):
    """The references gather padding slots too (and multiply them by 0): zeros instead of the pool's NaN rows."""
    return jnp.nan_to_num(pool, nan=0.0)


FORMATS = [pytest.param(jnp.float8_e4m3fn, id="e4m3fn"), pytest.param(jnp.float8_e5m2, id="e5m2")]


def quantised(pool, scale, fmt):
    """pool / scale stored as `fmt` (what `write_kv` stores); per-head scales broadcast over the head axis."""
    if pool is None:
        return None
    scale = jnp.asarray(scale, jnp.float32).reshape(1, -1, 1)
    return (pool.astype(jnp.float32) / scale).astype(fmt)


def per_head(kv_heads):
    return jnp.linspace(0.5, 2.0, kv_heads, dtype=jnp.float32)


# (q_heads, kv_heads, qk_dim, v_dim, v_from_k, config): GQA on the grouped kernel, MLA's latent cache (V inside K), MHA
# on the vector kernel.
DECODE_CASES = [
    pytest.param((8, 2, 128, 128, False, None), id="gqa4-128"),
    pytest.param((4, 1, 576, 512, True, None), id="mla-576"),
    pytest.param((2, 2, 64, 64, False, DecodeConfig(block_n=32, block_h=1)), id="mha-vector"),
    # K and V converted to f16 in registers before the dots (DecodeConfig.fp8_in_registers); MLA's V reuses K's.
    pytest.param((8, 2, 128, 128, False, DecodeConfig(block_n=32, fp8_in_registers=True)), id="gqa4-128-in-registers"),
    pytest.param((4, 1, 576, 512, True, DecodeConfig(block_n=32, fp8_in_registers=True)), id="mla-576-in-registers"),
    # Keys as the dots' M (DecodeConfig.keys_as_rows): the fp8 tiles convert in registers and feed wgmma.
    pytest.param((8, 2, 128, 128, False, DecodeConfig(block_n=32, keys_as_rows=True)), id="gqa4-128-keys-as-rows"),
    pytest.param((4, 1, 576, 512, True, DecodeConfig(block_n=32, keys_as_rows=True)), id="mla-576-keys-as-rows"),
    # Both: the converted K and V tiles feed wgmma with the keys as M (the fp8 sweep's "inreg keys-as-rows" rows).
    pytest.param((8, 2, 128, 128, False, DecodeConfig(block_n=64, num_warps=4, keys_as_rows=True, fp8_in_registers=True)),
                 id="gqa4-128-keys-as-rows-in-registers"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", DECODE_CASES)
@pytest.mark.parametrize("scales", ["float", "per-head"])
def test_decode_reads_fp8_pools(rng, mode, fmt, case, scales):
    q_heads, kv_heads, qk_dim, v_dim, v_from_k, config = case
    kv_lens = [1, 37, 0, 161]
    q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, kv_lens, q_heads, kv_heads, qk_dim, v_dim, jnp.bfloat16,
                                                          v_from_k=v_from_k)
    k_scale = 0.25 if scales == "float" else per_head(kv_heads)
    v_scale = None if v_from_k else (2.0 if scales == "float" else per_head(kv_heads)[::-1])
    k8, v8 = quantised(k_pool, k_scale, fmt), quantised(v_pool, 1.0 if v_scale is None else v_scale, fmt)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=q_heads, kv_heads=kv_heads, max_kv_splits=4,
                                       min_split_len=32, programs_per_sm=10**6)
    kwargs = dict(return_lse=True, v_head_dim=v_dim if v_from_k else None, k_scale=k_scale, v_scale=v_scale)
    o, lse = decode_attention(q, k8, v8, meta, mode=mode, config=config, **kwargs)
    ref_o, ref_lse = decode_attention_reference(q, k8, v8, meta, **kwargs)
    assert o.dtype == jnp.bfloat16
    assert not np.isnan(np.float32(o)).any()  # unused NaN rows never leak
    np.testing.assert_allclose(np.float32(o), np.float32(ref_o), **testing.tolerance(jnp.bfloat16))
    np.testing.assert_allclose(lse, ref_lse, atol=2e-3, rtol=2e-3)
    np.testing.assert_array_equal(np.float32(o[2]), 0.0)  # the empty row


def primitives(jaxpr) -> set[str]:
    """Every primitive of a jaxpr, nested jaxprs included."""
    found = set()
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                found |= primitives(inner)
    return found


def test_float_scales_are_constants_of_the_compiled_op(rng):
    # Python number scales are static: the scale table (and the kernels' unused operands) are constants, so XLA
    # launches no broadcast kernel on every call (two such kernels and their gaps were ~6% of an fp8 decode call on
    # the H100's clock, RESULTS, forty-first session); array scales stay traced (one compile for every value).
    q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, [5, 9], 8, 2, 64, 64, jnp.bfloat16)
    k8, v8 = quantised(k_pool, 0.5, jnp.float8_e4m3fn), quantised(v_pool, 2.0, jnp.float8_e4m3fn)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=8, kv_heads=2, max_kv_splits=2)

    def step(q, k8, v8, meta, k_scale, v_scale):
        return decode_attention(q, k8, v8, meta, impl="triton", mode="interpret", k_scale=k_scale, v_scale=v_scale)

    floats = primitives(jax.make_jaxpr(lambda *a: step(*a, 0.5, 2.0))(q, k8, v8, meta).jaxpr)
    assert not floats & {"broadcast_in_dim", "stack", "concatenate"}, floats
    arrays = primitives(jax.make_jaxpr(step)(q, k8, v8, meta, jnp.float32(0.5), jnp.float32(2.0)).jaxpr)
    assert "broadcast_in_dim" in arrays  # the traced scales' table, built on every call
    np.testing.assert_array_equal(np.float32(step(q, k8, v8, meta, 0.5, 2.0)),
                                  np.float32(step(q, k8, v8, meta, jnp.float32(0.5), jnp.float32(2.0))))


@pytest.mark.parametrize("scales", [(0.5, 0.5), (0.5, 2.0), None], ids=["equal", "unequal", "bf16"])
def test_the_compiled_decode_step_broadcasts_nothing(rng, scales):
    # XLA makes a constant of more than one element, all equal, a broadcast kernel launched on every call (two of
    # them beside an fp8 decode call on the H100's clock at fbf99d6: the scale table of equal scales and the merge's
    # unread sink operand; a bf16 call had the unread table too). The compiled step (stage 1 and the merge) holds
    # none: equal scales' table carries one unread element unlike the others (`scale_table_operand`), unread
    # operands are 1-element constants. Its outputs are those of the traced scales.
    q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, [5, 90], 8, 2, 64, 64, jnp.bfloat16)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=8, kv_heads=2, max_kv_splits=2, min_split_len=32)
    kw = {}
    if scales is not None:
        k_pool = quantised(k_pool, scales[0], jnp.float8_e4m3fn)
        v_pool = quantised(v_pool, scales[1], jnp.float8_e4m3fn)
        kw = dict(k_scale=scales[0], v_scale=scales[1])
    step = jax.jit(lambda q, k, v, m: decode_attention(q, k, v, m, impl="triton", mode="interpret", **kw))
    hlo = step.lower(q, k_pool, v_pool, meta).compile().as_text()
    assert "broadcast(" not in hlo, [line for line in hlo.splitlines() if "broadcast(" in line]
    assert hlo.count("xla_ffi_python_cpu_callback") == 2  # stage 1 and the merge
    if scales is not None:
        traced = decode_attention(q, k_pool, v_pool, meta, impl="triton", mode="interpret",
                                  k_scale=jnp.float32(scales[0]), v_scale=jnp.float32(scales[1]))
        np.testing.assert_array_equal(np.float32(step(q, k_pool, v_pool, meta)), np.float32(traced))


def test_the_compiled_extend_step_broadcasts_nothing(rng):
    # As the decode step above, for the Triton extend over an fp8 pool with equal float scales (every fp8 kernel's
    # table goes through `scale_table_operand`): no broadcast kernel, and the outputs of the traced scales.
    batch = make_batch(rng, [5, 21], [13, 7], hq=4, hkv=2, dqk=64, dtype=jnp.bfloat16, max_extend_len=16)
    kp, vp = quantised(batch.k_pool, 0.5, jnp.float8_e4m3fn), quantised(batch.v_pool, 0.5, jnp.float8_e4m3fn)

    def step(k_scale, v_scale):
        return jax.jit(lambda q, k_new, v_new, kp, vp, meta: extend_attention(
            q, k_new, v_new, kp, vp, meta, impl="triton", mode="interpret", k_scale=k_scale, v_scale=v_scale))

    args = (batch.q, batch.k_new, batch.v_new, kp, vp, batch.meta)
    hlo = step(0.5, 0.5).lower(*args).compile().as_text()
    assert "broadcast(" not in hlo, [line for line in hlo.splitlines() if "broadcast(" in line]
    np.testing.assert_array_equal(np.float32(step(0.5, 0.5)(*args)),
                                  np.float32(step(jnp.float32(0.5), jnp.float32(0.5))(*args)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("logit_cap", [0.0, 20.0])
def test_decode_f16_dots_keep_large_scores(rng, mode, logit_cap):
    """bf16 q over an fp8 pool runs the grouped kernel's dots in f16 with q pre-scaled (kernels/decode_attention.py):
    scores of tens (q x 20), with and without a soft cap, still match the reference on the same pool."""
    q_heads, kv_heads, dim = 8, 2, 128
    q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, [5, 300, 77], q_heads, kv_heads, dim, dim, jnp.bfloat16)
    q = (q.astype(jnp.float32) * 20).astype(jnp.bfloat16)
    k8, v8 = quantised(k_pool, 0.5, jnp.float8_e4m3fn), quantised(v_pool, 2.0, jnp.float8_e4m3fn)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=q_heads, kv_heads=kv_heads, max_kv_splits=4,
                                       min_split_len=32, programs_per_sm=10**6)
    kwargs = dict(k_scale=0.5, v_scale=2.0, logit_cap=logit_cap, return_lse=True)
    o, lse = decode_attention(q, k8, v8, meta, mode=mode, **kwargs)
    ref_o, ref_lse = decode_attention_reference(q, _clean(k8), _clean(v8), meta, **kwargs)
    assert np.abs(np.float32(ref_lse)).max() > 10  # the scores are large: the test is not about near-uniform softmax
    np.testing.assert_allclose(np.float32(o), np.float32(ref_o), **testing.tolerance(jnp.bfloat16))
    np.testing.assert_allclose(lse, ref_lse, atol=2e-2, rtol=2e-3)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", [None, DecodeConfig(block_n=32, fp8_in_registers=True),
                                    DecodeConfig(block_n=32, keys_as_rows=True)],
                         ids=["table", "in-registers", "keys-as-rows"])
def test_fp8_decode_nan_reaches_exactly_the_rows_that_see_it(rng, mode, config):
    """NaN in one sequence's q (through the f16 dots) and in one listed fp8 V entry of another sequence (through the
    V dequantisation): exactly those rows come out NaN, the others stay finite and correct."""
    q_heads, kv_heads, dim = 8, 2, 128
    q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, [5, 40, 77], q_heads, kv_heads, dim, dim, jnp.bfloat16)
    k8, v8 = quantised(k_pool, 0.5, jnp.float8_e4m3fn), quantised(v_pool, 2.0, jnp.float8_e4m3fn)
    q = q.at[0, 3, 7].set(jnp.nan)  # sequence 0, q head 3 (kv head 0)
    listed = int(np.asarray(kv_indices)[int(kv_indptr[1]) + 11])  # sequence 1's 12th key
    v8 = v8.at[listed, 1, 5].set(jnp.nan)  # its V, kv head 1: q heads 4-7 of sequence 1 see it
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=q_heads, kv_heads=kv_heads, max_kv_splits=4,
                                       min_split_len=32, programs_per_sm=10**6)
    o = np.float32(decode_attention(q, k8, v8, meta, mode=mode, config=config, k_scale=0.5, v_scale=2.0))
    want = np.zeros(o.shape, bool)
    want[0, 3, :] = True
    want[1, 4:, 5] = True
    np.testing.assert_array_equal(np.isnan(o), want)
    ref = np.float32(decode_attention_reference(q, _clean(k8), _clean(v8), meta, k_scale=0.5, v_scale=2.0))
    np.testing.assert_allclose(o[~want], ref[~want], **testing.tolerance(jnp.bfloat16))  # every other entry


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", [None, DecodeConfig(block_n=32, fp8_in_registers=True),
                                    DecodeConfig(block_n=32, keys_as_rows=True)],
                         ids=["table", "in-registers", "keys-as-rows"])
@pytest.mark.parametrize("logit_cap", [0.0, 30.0])
def test_fp8_decode_takes_traced_k_scales_of_any_sign(rng, mode, config, logit_cap):
    """Array k_scales are traced, so unchecked: the grouped kernel's folded softmax (its scale in exp2's argument,
    kernels/decode_attention.py) moves a negative scale's sign onto q and turns a zero scale into zero scores. Per kv
    head: negative, zero, positive, NaN; the first three match the reference, the NaN head's rows are NaN."""
    q_heads, kv_heads, dim = 16, 4, 128
    q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, [5, 40, 77], q_heads, kv_heads, dim, dim, jnp.bfloat16)
    k_scale = jnp.asarray([-0.6, 0.0, 1.3, np.nan], jnp.float32)
    v_scale = per_head(kv_heads)
    k8 = quantised(k_pool, jnp.asarray([-0.6, 1.0, 1.3, 1.0]), jnp.float8_e4m3fn)  # (the values kept for 0 and NaN)
    v8 = quantised(v_pool, v_scale, jnp.float8_e4m3fn)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=q_heads, kv_heads=kv_heads, max_kv_splits=4,
                                       min_split_len=32, programs_per_sm=10**6)
    kwargs = dict(k_scale=k_scale, v_scale=v_scale, logit_cap=logit_cap, return_lse=True)
    o, lse = decode_attention(q, k8, v8, meta, mode=mode, config=config, **kwargs)
    ref_o, ref_lse = decode_attention_reference(q, _clean(k8), _clean(v8), meta, **kwargs)
    o, ref_o = np.float32(o), np.float32(ref_o)
    assert np.isnan(o[:, 12:]).all() and np.isnan(np.asarray(lse)[:, 12:]).all()
    np.testing.assert_allclose(o[:, :12], ref_o[:, :12], **testing.tolerance(jnp.bfloat16))
    np.testing.assert_allclose(np.asarray(lse)[:, :12], np.asarray(ref_lse)[:, :12], atol=2e-3, rtol=2e-3)
    # The zero scale's heads: every score 0, so the LSE is log(keys) (q finite: no NaN from 0 * q).
    np.testing.assert_allclose(np.asarray(lse)[:, 4:8], np.log([[5.0] * 4, [40.0] * 4, [77.0] * 4]), rtol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantisation_error_is_within_the_format_tolerance(rng, fmt):
    q_heads, kv_heads, dim = 8, 2, 128
    q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, [1, 37, 200, 500], q_heads, kv_heads, dim, dim, jnp.bfloat16)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=q_heads, kv_heads=kv_heads, max_kv_splits=4,
                                       min_split_len=32, programs_per_sm=10**6)
    k_scale, v_scale = 0.5, 2.0
    o8 = decode_attention(q, quantised(k_pool, k_scale, fmt), quantised(v_pool, v_scale, fmt), meta, mode="interpret",
                          k_scale=k_scale, v_scale=v_scale)
    o16 = decode_attention_reference(q, jnp.nan_to_num(k_pool), jnp.nan_to_num(v_pool), meta)
    np.testing.assert_allclose(np.float32(o8), np.float32(o16), **testing.fp8_tolerance(fmt))
    # ... and the tolerance is not vacuous: without the scales the outputs are far off.
    o_unscaled = decode_attention(q, quantised(k_pool, k_scale, fmt), quantised(v_pool, v_scale, fmt), meta, mode="interpret")
    assert np.abs(np.float32(o_unscaled) - np.float32(o16)).max() > 4 * testing.fp8_tolerance(fmt)["atol"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("features", [{}, dict(sliding_window=6, logit_cap=20.0)], ids=["plain", "window+cap"])
def test_extend_reads_fp8_pools(rng, mode, fmt, features):
    batch = make_batch(rng, [0, 21, 9], [13, 0, 17], hq=4, hkv=2, dqk=64, dtype=jnp.bfloat16, max_extend_len=20,
                       window=features.get("sliding_window", -1))
    k_scale, v_scale = per_head(2), 1.5
    kp, vp = quantised(batch.k_pool, k_scale, fmt), quantised(batch.v_pool, v_scale, fmt)
    ku, vu = quantised(batch.k_pool_unified, k_scale, fmt), quantised(batch.v_pool_unified, v_scale, fmt)
    kw = dict(k_scale=k_scale, v_scale=v_scale, **features)
    o = extend_attention(batch.q, batch.k_new, batch.v_new, kp, vp, batch.meta, mode=mode, impl="triton", **kw)
    ref = extend_attention_reference(batch.q, batch.k_new, batch.v_new, _clean(kp), _clean(vp), batch.meta, **kw)
    o_u = extend_attention_unified(batch.q, ku, vu, batch.meta_unified, mode=mode, **kw)
    ref_u = extend_attention_unified_reference(batch.q, _clean(ku), _clean(vu), batch.meta_unified, **kw)
    tol = testing.tolerance(jnp.bfloat16)
    for out, want in ((o, ref), (o_u, ref_u)):
        out = np.float32(out)
        assert not np.isnan(out).any()
        np.testing.assert_array_equal(out[batch.tokens:], 0.0)
        np.testing.assert_allclose(out[: batch.tokens], np.float32(want)[: batch.tokens], **tol)


@pytest.mark.parametrize("fmt", FORMATS)
def test_mgpu_route_dequantises_only_the_listed_prefix(rng, fmt):
    # The Mosaic GPU kernel (GPU only) takes fp8 pools through `dequantised_prefix`: the listed rows, scaled, in order.
    # The rewritten call must mean the same attention: checked here through the Triton kernel on both forms.
    batch = make_batch(rng, [5, 21, 9], [13, 3, 17], hq=4, hkv=2, dqk=64, dtype=jnp.bfloat16, max_extend_len=20)
    k_scale, v_scale = per_head(2), 0.75
    kp, vp = quantised(batch.k_pool, k_scale, fmt), quantised(batch.v_pool, v_scale, fmt)
    kv_scales = jnp.stack([k_scale, jnp.full((2,), v_scale)])
    k, v, meta = dequantised_prefix(kp, vp, batch.meta, kv_scales, jnp.bfloat16)
    assert k.shape == (batch.meta.kv_capacity, 2, 64) and k.dtype == jnp.bfloat16  # the listed bound, not the pool
    direct = extend_attention(batch.q, batch.k_new, batch.v_new, kp, vp, batch.meta, mode="interpret", impl="triton",
                              k_scale=k_scale, v_scale=v_scale)
    rewritten = extend_attention(batch.q, batch.k_new, batch.v_new, k, v, meta, mode="interpret", impl="triton")
    np.testing.assert_allclose(np.float32(rewritten), np.float32(direct), **testing.tolerance(jnp.bfloat16))


def test_scale_arguments_are_checked(rng):
    q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, [3, 5], 4, 2, 64, 64, jnp.bfloat16)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=4, kv_heads=2)
    k8, v8 = k_pool.astype(jnp.float8_e4m3fn), v_pool.astype(jnp.float8_e4m3fn)
    bad = [
        (dict(k_scale=-1.0), "k_scale must be None, a finite float > 0"),
        (dict(v_scale=float("nan")), "v_scale must be None, a finite float > 0"),
        (dict(k_scale=True), "k_scale must be None, a finite float > 0"),
        (dict(k_scale=jnp.ones((3,))), re.escape("k_scale must be a scalar or have shape (2,)")),
        (dict(v_scale=jnp.ones((2,), jnp.int32)), "v_scale must be a float array"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            decode_attention(q, k8, v8, meta, mode="interpret", **kwargs)
    with pytest.raises(ValueError, match="k_pool must have q's dtype bfloat16 or an fp8 format"):
        decode_attention(q, k_pool.astype(jnp.int8), v8, meta, mode="interpret")
    with pytest.raises(ValueError, match="v_scale must be None when v_pool is None"):
        decode_attention(q, k8, None, meta, v_head_dim=32, k_scale=2.0, v_scale=2.0, mode="interpret")


def test_write_kv_takes_per_head_scales(rng):
    k_pool = jnp.zeros((4, 2, 8), jnp.float8_e4m3fn)
    v_pool = jnp.zeros((4, 2, 8), jnp.float8_e5m2)
    k = jnp.asarray(rng.standard_normal((2, 2, 8)), jnp.float32)
    scales = jnp.asarray([0.5, 4.0])
    k_pool, v_pool = write_kv(k_pool, v_pool, jnp.asarray([1, 3], jnp.int32), k, k, k_scale=scales, v_scale=2.0)
    np.testing.assert_array_equal(np.float32(k_pool[jnp.asarray([1, 3])]),
                                  np.float32((k / scales[None, :, None]).astype(jnp.float8_e4m3fn)))
    np.testing.assert_array_equal(np.float32(v_pool[jnp.asarray([1, 3])]), np.float32((k / 2.0).astype(jnp.float8_e5m2)))


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=["extend", "decode"])
def test_triton_backend_passes_fp8_pools_through(rng, mode):
    # The backends hand fp8 pools and the layer's scales to the ops (the extend step writes fp8 rows, then reads
    # the prefix from them); TritonBackend and ReferenceBackend agree.
    decode = mode == ForwardMode.DECODE
    batch, req_to_token = tb.make_batch(rng, [6, 3, 0], [1, 1, 1] if decode else [5, 2, 7], mode=mode,
                                        token_bucket=3 if decode else 16, batch_bucket=3)
    q, k, v, kb, vb = tb.random_inputs(rng, 3 if decode else 16)
    layer = AttentionLayer(0, tb.H, tb.KVH, tb.D, k_scale=0.5, v_scale=2.0)
    kb, vb = kb.astype(jnp.float8_e4m3fn), vb.astype(jnp.float8_e5m2)
    outs = [backend.forward(q, k, v, kb, vb, layer, backend.init_forward_metadata(batch, req_to_token))
            for backend in (TritonBackend(), ReferenceBackend())]
    tokens = int(np.sum(np.asarray(batch.extend_lens)))
    got, want = np.asarray(outs[0][0])[:tokens], np.asarray(outs[1][0])[:tokens]
    if decode:
        np.testing.assert_allclose(got, want, atol=3e-5, rtol=3e-5)
    else:  # the two-stage kernel reads the new tokens' own K/V, the reference their fp8 copies (module doc)
        np.testing.assert_allclose(got, want, **testing.fp8_tolerance(jnp.float8_e5m2))
    np.testing.assert_array_equal(np.asarray(outs[0][1]).view(np.uint8), np.asarray(outs[1][1]).view(np.uint8))


def _backend_step(backend, num_slots, fmt):
    """A jitted one-layer DECODE step of `backend` over fp8 pools of `num_slots` slots, and its arguments."""
    batch, req_to_token = tb.make_batch(np.random.default_rng(0), [6, 3], [1, 1], mode=ForwardMode.DECODE,
                                        token_bucket=2, batch_bucket=2)
    layer = AttentionLayer(0, tb.H, tb.KVH, tb.D, k_scale=0.5, v_scale=2.0)

    def step(q, k, v, k_pool, v_pool):
        meta = backend.init_forward_metadata(batch, req_to_token)
        return backend.forward(q, k, v, k_pool, v_pool, layer, meta)

    q, k, v, _, _ = tb.random_inputs(np.random.default_rng(1), 2)
    pools = tuple(jnp.zeros((num_slots, tb.KVH, tb.D), fmt) for _ in range(2))
    return jax.jit(step), (q, k, v, *pools)


@pytest.mark.parametrize("backend", [TritonBackend(launch_mode="interpret"), ReferenceBackend()], ids=["triton", "reference"])
def test_no_pool_sized_conversion_in_a_step(backend):
    # Doubling the pool leaves the step's work unchanged: no op of the compiled step converts a pool-shaped array (the
    # old path dequantised the whole pool every call); only the row writes touch the pool.
    programs = []
    for num_slots in (4096, 8192):
        step, args = _backend_step(backend, num_slots, jnp.float8_e4m3fn)
        text = step.lower(*args).as_text()
        pool_type = f"tensor<{num_slots}x{tb.KVH}x{tb.D}x"
        converts = [line.strip() for line in text.splitlines() if "convert" in line and pool_type in line]
        assert not converts, f"pool-sized conversions: {converts[:3]}"
        assert pool_type in text  # the pattern does name the pool's arrays
        programs.append(text.replace(str(num_slots), "SLOTS").replace(str(num_slots - 1), "LAST_SLOT"))
    assert programs[0] == programs[1]  # the same program; only the pool's size (and last slot) differ


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_default_extend_route_reads_fp8_pools(rng, mode, fmt):
    # What extend_attention picks (on an H200: the Mosaic GPU kernel through `dequantised_prefix`) on an fp8 pool.
    batch = make_batch(rng, [40, 0, 133], [24, 17, 64], hq=8, hkv=2, dqk=128, dtype=jnp.bfloat16, max_extend_len=64)
    k_scale, v_scale = per_head(2), 0.5
    kp, vp = quantised(batch.k_pool, k_scale, fmt), quantised(batch.v_pool, v_scale, fmt)
    kw = dict(k_scale=k_scale, v_scale=v_scale)
    o = np.float32(extend_attention(batch.q, batch.k_new, batch.v_new, kp, vp, batch.meta, mode=mode, **kw))
    ref = extend_attention_reference(batch.q, batch.k_new, batch.v_new, _clean(kp), _clean(vp), batch.meta, **kw)
    assert not np.isnan(o).any()
    np.testing.assert_array_equal(o[batch.tokens:], 0.0)
    np.testing.assert_allclose(o[: batch.tokens], np.float32(ref)[: batch.tokens], **testing.tolerance(jnp.bfloat16))


def test_mgpu_entry_point_sends_fp8_pools_to_the_op(rng):
    from jaxattn.impl.mgpu_extend import extend_attention_mgpu

    batch = make_batch(rng, [5, 3], [8, 8], hq=4, hkv=2, dqk=64, dtype=jnp.bfloat16, max_extend_len=8)
    with pytest.raises(ValueError, match="fp8 pools go through jaxattn.extend.extend_attention"):
        extend_attention_mgpu(batch.q, batch.k_new, batch.v_new, batch.k_pool.astype(jnp.float8_e4m3fn),
                              batch.v_pool.astype(jnp.float8_e4m3fn), batch.meta)


def _extend_call(batch, k_pool, v_pool, form="two_stage", kv_scales=None):
    """The two-stage ExtendCall of `batch` over these pools (an interpreted launch)."""
    from jaxattn.calls import ExtendCall

    return ExtendCall(form=form, q=batch.q, k_new=batch.k_new, v_new=batch.v_new, k_pool=k_pool, v_pool=v_pool,
                      meta=batch.meta, kv_start_pos=batch.meta.kv_start_pos, causal=True, custom_mask=None,
                      skip_prefix_custom_mask=True, sliding_window=-1, logit_cap=0.0, sinks=None,
                      xai_temperature_len=-1, sm_scale=0.125, config=None, launch_mode="interpret",
                      kv_scales=kv_scales)


def test_mgpu_routes_fp8_pools_by_prefix_tile_readers(rng, monkeypatch):
    # impl="mgpu" over fp8 pools: the kernel's own conversion where at most EXTEND_MGPU_FP8_IN_KERNEL_MAX_READERS CTAs
    # read each prefix tile, the dequantised prefix above it, in the unified form, and wherever the fp8 form declines.
    from jaxattn import hardware
    from jaxattn.impl import mgpu_extend

    monkeypatch.setattr(hardware, "mosaic_gpu_unavailable", lambda mode: None)  # as on an sm_90 GPU

    def fp8_call(hq, hkv, dqk, max_extend_len, form="two_stage"):
        batch = make_batch(rng, [5, 3], [4, 2], hq=hq, hkv=hkv, dqk=dqk, dtype=jnp.bfloat16,
                           max_extend_len=max_extend_len)
        kp, vp = batch.k_pool.astype(jnp.float8_e4m3fn), batch.v_pool.astype(jnp.float8_e4m3fn)
        return batch, _extend_call(batch, kp, vp, form=form)

    # Readers: q heads a kv head over heads a CTA, times the CTAs a bucket spans (a head's rows a CTA: 128 at head
    # dim 128, 64 with two heads a CTA for buckets of at most 64, 192 at 64 on three consumer warpgroups).
    for hq, hkv, dqk, bucket, readers in ((8, 2, 128, 128, 4), (8, 2, 128, 256, 8), (8, 1, 128, 128, 8),
                                          (8, 2, 128, 64, 2), (4, 2, 64, 8, 1), (8, 2, 64, 200, 8)):
        _, call = fp8_call(hq, hkv, dqk, bucket)
        assert mgpu_extend.prefix_tile_readers(call) == readers, (hq, hkv, dqk, bucket)
        assert mgpu_extend.converts_in_kernel(call) is (readers <= mgpu_extend.EXTEND_MGPU_FP8_IN_KERNEL_MAX_READERS)
    batch, call = fp8_call(8, 2, 128, 128)  # 4 readers: E3's
    assert mgpu_extend.EXTEND_MGPU_FP8_IN_KERNEL_MAX_READERS == 4 and mgpu_extend.converts_in_kernel(call)
    monkeypatch.setattr(mgpu_extend, "EXTEND_MGPU_FP8_IN_KERNEL_MAX_READERS", 3)
    assert not mgpu_extend.converts_in_kernel(call)
    monkeypatch.setattr(mgpu_extend, "EXTEND_MGPU_FP8_IN_KERNEL_MAX_READERS", 4)
    assert not mgpu_extend.converts_in_kernel(fp8_call(8, 2, 128, 128, form="unified")[1])
    kp, vp = call.k_pool, call.v_pool
    assert not mgpu_extend.converts_in_kernel(_extend_call(batch, kp, vp.astype(jnp.float8_e5m2)))  # mixed formats
    scaled_bf16 = _extend_call(batch, batch.k_pool, batch.v_pool, kv_scales=jnp.ones((2, 2), jnp.float32))
    assert not mgpu_extend.converts_in_kernel(scaled_bf16)


def test_mgpu_fp8_implementations_are_by_name_and_decline_with_reasons(rng):
    # "mgpu-fp8" / "mgpu-unified-fp8" (the kernel converting fp8 tiles itself) come after every other implementation,
    # so a call picks them only by name until their GPU record exists; they take fp8 pools at head dims 64/128/256.
    from jaxattn import extend
    from jaxattn.impl import mgpu_extend
    from jaxattn.registry import declined

    assert extend.IMPLEMENTATIONS[-2:] == (mgpu_extend.FP8, mgpu_extend.UNIFIED_FP8)
    batch = make_batch(rng, [5, 3], [8, 8], hq=4, hkv=2, dqk=64, dtype=jnp.bfloat16, max_extend_len=8)
    kp, vp = batch.k_pool.astype(jnp.float8_e4m3fn), batch.v_pool.astype(jnp.float8_e4m3fn)

    call = functools.partial(_extend_call, batch)
    reasons = declined(extend.IMPLEMENTATIONS, call(batch.k_pool, batch.v_pool))
    assert "one fp8 format only" in reasons["mgpu-fp8"] and "one fp8 format only" in reasons["mgpu-unified-fp8"]
    assert "one fp8 format only" in declined(extend.IMPLEMENTATIONS, call(kp, batch.v_pool))["mgpu-fp8"]
    fp8 = declined(extend.IMPLEMENTATIONS, call(kp, vp))
    assert fp8["mgpu-fp8"] == "no GPU (or an interpreted launch mode)"  # on CPU: only the launch mode is missing
    assert fp8["mgpu-unified-fp8"] == "takes the unified form only"
    narrow_v = call(kp, jnp.zeros((9, 2, 32), jnp.float8_e4m3fn))  # q/k 64, v 32
    assert "head dims 64/32 over fp8 pools" in mgpu_extend.FP8.declines(narrow_v)


# (prefix lens, extend lens, q heads, kv heads, head dim, features): long prefixes (many tiles, so the copies run
# ahead of the conversions), odd lengths, an empty prefix, and the features that change the producer's steps.
MGPU_FP8_CASES = [
    pytest.param(([300, 0, 1000], [100, 64, 37], 8, 2, 128, {}), id="128"),
    pytest.param(([700, 130, 1], [200, 5, 300], 8, 2, 128, dict(sliding_window=200, logit_cap=30.0)), id="128-window-cap"),
    pytest.param(([513, 64], [129, 7], 4, 1, 64, dict(sinks=True)), id="64-sinks"),
    pytest.param(([77, 300], [40, 33], 8, 4, 256, {}), id="256"),
    pytest.param(([400, 90], [20, 50], 8, 2, 128, dict(causal=False)), id="128-noncausal"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU (the Mosaic GPU kernel)")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", MGPU_FP8_CASES)
@pytest.mark.parametrize("form,tiles", [("two_stage", "f16"), ("two_stage", "q_dtype"), ("unified", "q_dtype")])
@pytest.mark.parametrize("staging", [False, True, "refill"], ids=["in-slot", "staged", "refill"])
def test_mgpu_kernel_converts_fp8_tiles_itself(rng, fmt, case, form, tiles, staging):
    # impl="mgpu-fp8" / "mgpu-unified-fp8" against the reference on the dequantised pool. Tiles converted to q's
    # dtype (times the scale) also bit for bit against the dequantising route ("mgpu" / "mgpu-unified": the same
    # 16-bit operands, the same tiles and order); f16 tiles (the two-stage default at head dims 64 and 128; 256 takes
    # q_dtype tiles) run the pool tiles in f16 with the scales applied by the consumers: the reference's tolerance.
    # staging (`MgpuExtendConfig.fp8_staging`: the fp8 rows copied into staging tiles a tile earlier): the same bits
    # as the in-slot copies (only when the copies land changes); "refill" (`fp8_refill`: each thread refilling the
    # staging bytes it converted) too.
    from jaxattn import tuning
    from jaxattn.impl.mgpu_extend import fp8_staging_fits

    prefix_lens, extend_lens, hq, hkv, dim, features = case
    features = dict(features)
    if features.pop("sinks", False):
        features["sinks"] = jnp.asarray(rng.standard_normal(hq), jnp.float32)
    batch = make_batch(rng, prefix_lens, extend_lens, hq=hq, hkv=hkv, dqk=dim, dtype=jnp.bfloat16,
                       max_extend_len=max(extend_lens), window=features.get("sliding_window", -1) if form == "two_stage" else -1)
    k_scale, v_scale = per_head(hkv), 0.75
    kw = dict(k_scale=k_scale, v_scale=v_scale, **features)
    if form == "two_stage":
        kp, vp = quantised(batch.k_pool, k_scale, fmt), quantised(batch.v_pool, v_scale, fmt)
        args = (batch.q, batch.k_new, batch.v_new, kp, vp, batch.meta)
        run, reference, names = extend_attention, extend_attention_reference, ("mgpu-fp8", "mgpu")
        want = reference(batch.q, batch.k_new, batch.v_new, _clean(kp), _clean(vp), batch.meta, **kw)
    else:
        kp, vp = quantised(batch.k_pool_unified, k_scale, fmt), quantised(batch.v_pool_unified, v_scale, fmt)
        args = (batch.q, kp, vp, batch.meta_unified)
        run, reference, names = extend_attention_unified, extend_attention_unified_reference, ("mgpu-unified-fp8", "mgpu-unified")
        want = reference(batch.q, _clean(kp), _clean(vp), batch.meta_unified, **kw)
    # The tuned tile (three consumer warpgroups at 64, 64-key tiles at 256) with this conversion.
    config = dataclasses.replace(tuning.mgpu_extend_config(dim, dim, max_extend_len=max(extend_lens)), fp8_tiles=tiles,
                                 fp8_staging=False)
    if staging:
        in_slot = np.float32(run(*args, impl=names[0], config=config, **kw))
        config = dataclasses.replace(config, fp8_staging=True, fp8_refill=staging == "refill")
        if not fp8_staging_fits(config, dim):
            pytest.skip(f"no room for the staging tiles beside {config}")
    got = np.float32(run(*args, impl=names[0], config=config, **kw))
    assert not np.isnan(got).any()  # the pools' unlisted rows are NaN
    if staging:
        np.testing.assert_array_equal(got, in_slot)
    if tiles == "q_dtype" or dim == 256:
        np.testing.assert_array_equal(got, np.float32(run(*args, impl=names[1], config=config, **kw)))
    np.testing.assert_array_equal(got[batch.tokens:], 0.0)
    np.testing.assert_allclose(got[: batch.tokens], np.float32(want)[: batch.tokens], **testing.tolerance(jnp.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU (the Mosaic GPU kernel)")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens,window", [(1, -1), (1, 300), (4, -1)], ids=["decode", "window", "verify-4"])
@pytest.mark.parametrize("tile", ["default", "auto", "transposed", "padded", "triton-merge"])
def test_mla_kernel_converts_fp8_latent_tiles_itself(rng, fmt, tokens, window, tile):
    # impl="mgpu-fp8": the MLA kernel over an fp8 latent pool (its producer converts each tile to f16; q pre-scaled,
    # the scale on the outputs: V is K's first 512 columns, so k_scale is V's too) against the reference on the same
    # pool; empty and long sequences, unused rows NaN. A scale that is not a power of two, so a scale applied twice
    # or not at all shows. The transposed tile by default for one token (the padded one for verify steps; each
    # forced too), and decode_attention's default route ("auto": "mgpu", the same tiles); both tiles merge their
    # splits themselves by default (the Triton merge after them too).
    from jaxattn.tuning import MgpuDecodeConfig

    if tokens > 1 and tile == "transposed":
        pytest.skip("the transposed tile takes one token a sequence (the default route's verify steps: the padded one)")
    config = {"default": None, "auto": None, "transposed": MgpuDecodeConfig(transposed=True),
              "padded": MgpuDecodeConfig(transposed=False), "triton-merge": MgpuDecodeConfig(kernel_merge=False)}[tile]
    q_heads, dim = 16, 576
    kv_lens = [1, 700, 0, 2049, 64]
    q, k_pool, _, kv_indptr, kv_indices = make_pools(rng, kv_lens, q_heads, 1, dim, 512, jnp.bfloat16, v_from_k=True)
    if tokens > 1:
        q = random_normal(rng, (len(kv_lens), tokens, q_heads, dim), jnp.bfloat16)
    k8 = quantised(k_pool, 0.37, fmt)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=q_heads, kv_heads=1, max_kv_splits=4,
                                       min_split_len=32, programs_per_sm=10**6, sliding_window=window)
    kwargs = dict(return_lse=True, v_head_dim=512, k_scale=0.37, sliding_window=window)
    o, lse = decode_attention(q, k8, None, meta, impl=None if tile == "auto" else "mgpu-fp8", config=config, **kwargs)
    ref_o, ref_lse = decode_attention_reference(q, _clean(k8), None, meta, **kwargs)
    assert not np.isnan(np.float32(o)).any()
    np.testing.assert_allclose(np.float32(o), np.float32(ref_o), **testing.tolerance(jnp.bfloat16))
    np.testing.assert_allclose(lse, ref_lse, atol=2e-3, rtol=2e-3)
    np.testing.assert_array_equal(np.float32(o[2]), 0.0)  # the empty sequence


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU (the Mosaic GPU kernels)")
@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_addresses_per_tile_change_no_bit(rng, fmt, monkeypatch):
    # FP8_ADDRESSES_PER_TILE moves where the fp8 copies' and conversion's addresses are computed, nothing else: the
    # extend kernel's fp8 tiles (f16, the default) and the MLA kernel's padded tile (the transposed one keeps its
    # addresses in registers either way) give the same bits with and without it.
    from jaxattn.kernels import extend_attention_mgpu as kernel_module
    from jaxattn.tuning import MgpuDecodeConfig

    batch = make_batch(rng, [700, 130, 1], [200, 5, 300], hq=8, hkv=2, dqk=128, dtype=jnp.bfloat16, max_extend_len=300)
    kp, vp = quantised(batch.k_pool, per_head(2), fmt), quantised(batch.v_pool, 0.75, fmt)
    q, k_pool, _, kv_indptr, kv_indices = make_pools(rng, [1, 700, 0, 2049], 16, 1, 576, 512, jnp.bfloat16,
                                                     v_from_k=True)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=16, kv_heads=1, max_kv_splits=4,
                                       min_split_len=32, programs_per_sm=10**6)
    k8 = quantised(k_pool, 0.37, fmt)
    outputs = []
    for per_tile in (False, True):
        monkeypatch.setattr(kernel_module, "FP8_ADDRESSES_PER_TILE", per_tile)
        jax.clear_caches()  # the flag is read when the kernels are traced
        extend = extend_attention(batch.q, batch.k_new, batch.v_new, kp, vp, batch.meta, impl="mgpu-fp8",
                                  k_scale=per_head(2), v_scale=0.75)
        mla = decode_attention(q, k8, None, meta, impl="mgpu-fp8", v_head_dim=512, k_scale=0.37,
                               config=MgpuDecodeConfig(transposed=False))
        outputs.append((np.float32(extend), np.float32(mla)))
    assert not np.isnan(outputs[0][0][: batch.tokens]).any() and not np.isnan(outputs[0][1]).any()
    for before, after in zip(*outputs):
        np.testing.assert_array_equal(after, before)


def test_in_registers_is_declined_before_sm_89(rng, monkeypatch):
    # DecodeConfig(fp8_in_registers=True) converts K and V with sm_89+'s cvt.rn.f16x2.e4m3x2 (inline PTX): on an older GPU
    # the Triton implementation declines it by name rather than failing in ptxas; the interpreter converts with .to.
    from jaxattn import hardware
    from jaxattn.calls import DecodeCall
    from jaxattn.impl import triton_decode

    q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, [3, 9], 8, 2, 128, 128, jnp.bfloat16)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=8, kv_heads=2)

    def call(launch_mode, in_registers=True):
        return DecodeCall(q=q, k_pool=k_pool.astype(jnp.float8_e4m3fn), v_pool=v_pool.astype(jnp.float8_e4m3fn),
                          meta=meta, sinks=None, sm_scale=0.07, logit_cap=0.0, xai_temperature_len=-1,
                          sliding_window=-1, v_head_dim=128, return_lse=False, launch_mode=launch_mode,
                          config=DecodeConfig(block_n=32, fp8_in_registers=in_registers))

    monkeypatch.setattr(hardware, "gpu_family_name", lambda: "sm_80")
    assert "on sm_80 (its fp8 conversion is sm_89+'s" in triton_decode.declines(call("gpu"))
    assert triton_decode.declines(call("gpu", in_registers=False)) is None
    assert triton_decode.declines(call("interpret")) is None
    for family in ("sm_89", "sm_90", "sm_100"):
        monkeypatch.setattr(hardware, "gpu_family_name", lambda family=family: family)
        assert triton_decode.declines(call("gpu")) is None


def test_mla_fp8_implementation_declines_with_reasons(rng):
    from jaxattn import decode
    from jaxattn.calls import DecodeCall
    from jaxattn.impl import mgpu_mla

    assert decode.IMPLEMENTATIONS[-1] is mgpu_mla.DECODE_FP8  # by name only, after every other implementation
    q, k_pool, _, kv_indptr, kv_indices = make_pools(rng, [3, 9], 16, 1, 576, 512, jnp.bfloat16, v_from_k=True)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=16, kv_heads=1)

    def call(pool):
        return DecodeCall(q=q, k_pool=pool, v_pool=None, meta=meta, sinks=None, sm_scale=0.07, logit_cap=0.0,
                          xai_temperature_len=-1, sliding_window=-1, v_head_dim=512, return_lse=False, config=None,
                          launch_mode="gpu")

    assert "fp8 only" in mgpu_mla.DECODE_FP8.declines(call(k_pool))
    fp8 = call(k_pool.astype(jnp.float8_e4m3fn))  # "mgpu" takes what "mgpu-fp8" takes (on CPU: neither, no sm_90)
    assert mgpu_mla.DECODE.declines(fp8) == mgpu_mla.DECODE_FP8.declines(fp8)
    narrow = DecodeCall(q=q[..., :288], k_pool=k_pool[..., :288].astype(jnp.float8_e4m3fn), v_pool=None, meta=meta,
                        sinks=None, sm_scale=0.07, logit_cap=0.0, xai_temperature_len=-1, sliding_window=-1,
                        v_head_dim=256, return_lse=False, config=None, launch_mode="gpu")
    assert "whole 64-column tiles" in mgpu_mla.DECODE_FP8.declines(narrow)
