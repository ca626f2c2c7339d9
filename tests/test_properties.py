"""Property-based tests (hypothesis): random ragged batches through the kernels (Triton's interpreter on CPU, compiled
on a GPU) against the reference.

Every example draws lengths 0..N per sequence (zero-length rows included), a GQA ratio, head dims, a dtype, and the
features: sliding windows (0 included), soft caps, sinks, xai temperature, custom masks with fully masked rows,
non-causal attention. Properties: outputs are finite; sequences with no keys and rows with no visible key give exactly
0 (never NaN/Inf); everything else matches the reference within the dtype's tolerance; the two extend kernels agree.

Shapes are fixed per bucket (batch, pool, token and mask buffers are padded) so that jit caches hit across examples and
only the static features recompile. Every unused pool slot, slot 0 included, holds NaN, so a stray read turns into a
NaN output. Examples are derandomized (CI is deterministic). The default suite runs 15 examples per test (~45 s for both on 2
CPU cores); `pytest -m slow tests/test_properties.py` runs 300 per test (~10 min).
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxattn.decode import decode_attention, decode_attention_reference, decode_metadata_from_indptr
from jaxattn.extend import (
    ExtendConfig,
    extend_attention,
    extend_attention_reference,
    extend_attention_unified,
    extend_attention_unified_reference,
    extend_metadata,
    extend_unified_metadata,
)
from tests.helpers import HAS_GPU, tolerance

MODE = "gpu" if HAS_GPU else "interpret"
FAST = settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), print_blob=True)
SLOW = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), print_blob=True)

# ---------------------------------------------------------------------------------------------
# Decode

DEC_BATCH, DEC_MAX_LEN, DEC_SLOTS, DEC_CAPACITY = 4, 80, 4 * 80 + 9, 4 * 80
HEADS = [(2, 2), (4, 1), (6, 2), (8, 1), (3, 3)]  # group 1, 4, 3 (not a power of 2), 8
DEC_DIMS = [(16, 16), (32, 16), (48, 32), (64, 64)]  # 48: padded to a 64 tile
CAPS = [0.0, 1.5, 20.0]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@st.composite
def decode_cases(draw):
    return dict(
        heads=draw(st.sampled_from(HEADS)),
        dims=draw(st.sampled_from(DEC_DIMS)),
        dtype=draw(st.sampled_from(DTYPES)),
        lens=draw(st.lists(st.one_of(st.just(0), st.integers(1, DEC_MAX_LEN)), min_size=DEC_BATCH, max_size=DEC_BATCH)),
        window=draw(st.one_of(st.just(-1), st.just(0), st.integers(1, DEC_MAX_LEN))),
        logit_cap=draw(st.sampled_from(CAPS)),
        sinks=draw(st.booleans()),
        xai=draw(st.sampled_from([-1, 16])),
        deterministic=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@functools.partial(jax.jit, static_argnames=("window", "logit_cap", "xai"))
def _decode_reference(q, k_pool, v_pool, meta, sinks, *, window, logit_cap, xai):
    return decode_attention_reference(q, k_pool, v_pool, meta, sinks=sinks, sliding_window=window, logit_cap=logit_cap,
                                      xai_temperature_len=xai, return_lse=True)


def _poisoned_pool(rng, used, shape, dtype):
    pool = np.full(shape, np.nan, np.float32)
    pool[used] = rng.standard_normal((len(used),) + shape[1:])
    return jnp.asarray(pool).astype(dtype)


def check_decode(case):
    rng = np.random.default_rng(case["seed"])
    (q_heads, kv_heads), (qk_dim, v_dim), dtype = case["heads"], case["dims"], case["dtype"]
    lens = np.asarray(case["lens"], np.int32)
    total = int(lens.sum())
    slots = rng.permutation(np.arange(1, DEC_SLOTS))[:total].astype(np.int32)
    kv_indptr = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    kv_indices = jnp.asarray(np.pad(slots, (0, DEC_CAPACITY - total)))
    k_pool = _poisoned_pool(rng, slots, (DEC_SLOTS, kv_heads, qk_dim), dtype)
    v_pool = _poisoned_pool(rng, slots, (DEC_SLOTS, kv_heads, v_dim), dtype)
    q = jnp.asarray(rng.standard_normal((DEC_BATCH, q_heads, qk_dim)), dtype)
    sinks = jnp.asarray(rng.standard_normal(q_heads) * 2, jnp.float32) if case["sinks"] else None
    # Up to 4 splits of >= 16 keys (dynamic), or of 32 keys (deterministic): most sequences are split.
    meta = decode_metadata_from_indptr(
        kv_indptr, kv_indices, q_heads=q_heads, kv_heads=kv_heads, max_kv_splits=4, min_split_len=16, programs_per_sm=10**6,
        deterministic=case["deterministic"], split_tile_size=32, max_context_len=DEC_MAX_LEN,
    )
    kw = dict(window=case["window"], logit_cap=case["logit_cap"], xai=case["xai"])
    o, lse = decode_attention(q, k_pool, v_pool, meta, sinks=sinks, sliding_window=kw["window"], logit_cap=kw["logit_cap"],
                              xai_temperature_len=kw["xai"], return_lse=True, mode=MODE)
    ref_o, ref_lse = _decode_reference(q, k_pool, v_pool, meta, sinks, **kw)
    o, ref_o, lse, ref_lse = (np.asarray(x, np.float32) for x in (o, ref_o, lse, ref_lse))
    assert np.isfinite(o).all(), "non-finite decode output"
    assert np.isfinite(ref_o).all(), "non-finite reference output"
    empty = lens == 0
    np.testing.assert_array_equal(o[empty], 0.0)
    if sinks is None:
        assert np.all(lse[empty] == -np.inf)
    np.testing.assert_allclose(o, ref_o, **tolerance(dtype))
    live = ~empty
    np.testing.assert_allclose(lse[live], ref_lse[live], atol=2e-3, rtol=2e-3)


@given(decode_cases())
@FAST
def test_decode_matches_reference(case):
    check_decode(case)


@pytest.mark.slow
@given(decode_cases())
@SLOW
def test_decode_matches_reference_many(case):
    check_decode(case)


# ---------------------------------------------------------------------------------------------
# Extend: both kernels on one batch

EXT_BATCH, EXT_MAX_PREFIX, EXT_BUCKET = 3, 40, 16
EXT_TOKENS = EXT_BATCH * EXT_BUCKET + 2  # q rows (2+ padding rows past the real tokens)
EXT_CTX = EXT_MAX_PREFIX + EXT_BUCKET
EXT_SLOTS = EXT_BATCH * EXT_CTX + 5
EXT_CAPACITY = EXT_BATCH * EXT_CTX
EXT_MASK = EXT_BATCH * EXT_BUCKET * EXT_CTX
EXT_DIMS = [(16, 16), (32, 32), (40, 24), (64, 32)]
SMALL = ExtendConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


@st.composite
def extend_cases(draw):
    mask = draw(st.booleans())
    return dict(
        heads=draw(st.sampled_from(HEADS)),
        dims=draw(st.sampled_from(EXT_DIMS)),
        dtype=draw(st.sampled_from(DTYPES)),
        prefix=draw(st.lists(st.one_of(st.just(0), st.integers(1, EXT_MAX_PREFIX)), min_size=EXT_BATCH, max_size=EXT_BATCH)),
        extend=draw(st.lists(st.one_of(st.just(0), st.integers(1, EXT_BUCKET)), min_size=EXT_BATCH, max_size=EXT_BATCH)),
        window=draw(st.one_of(st.just(-1), st.just(0), st.integers(1, EXT_CTX))),
        causal=draw(st.booleans()),
        mask=mask,
        skip_prefix=draw(st.booleans()) if mask else True,
        logit_cap=draw(st.sampled_from(CAPS)),
        sinks=draw(st.booleans()),
        xai=draw(st.sampled_from([-1, 24])),
        config=draw(st.sampled_from([SMALL, None])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


_EXT_STATIC = ("causal", "window", "logit_cap", "xai", "skip_prefix")


@functools.partial(jax.jit, static_argnames=_EXT_STATIC)
def _extend_references(q, k_new, v_new, k_pool, v_pool, k_unified, v_unified, meta, meta_u, mask, mask_u, sinks, *,
                       causal, window, logit_cap, xai, skip_prefix):
    kw = dict(causal=causal, sliding_window=window, logit_cap=logit_cap, sinks=sinks, xai_temperature_len=xai)
    two = extend_attention_reference(q, k_new, v_new, k_pool, v_pool, meta, custom_mask=mask, skip_prefix_custom_mask=skip_prefix, **kw)
    uni = extend_attention_unified_reference(q, k_unified, v_unified, meta_u, custom_mask=mask_u, **kw)
    return two, uni


def check_extend(case):
    rng = np.random.default_rng(case["seed"])
    (q_heads, kv_heads), (qk_dim, v_dim), dtype = case["heads"], case["dims"], case["dtype"]
    prefix, extend = np.asarray(case["prefix"], np.int32), np.asarray(case["extend"], np.int32)
    window = case["window"]
    seq = prefix + extend
    tokens = int(extend.sum())
    slots = rng.permutation(np.arange(1, EXT_SLOTS))[: int(seq.sum())].astype(np.int32)
    req_to_token = np.zeros((EXT_BATCH + 1, EXT_CTX), np.int32)
    rows = rng.permutation(EXT_BATCH + 1)[:EXT_BATCH].astype(np.int32)
    out_cache_loc, offset = [], 0
    for b in range(EXT_BATCH):
        req_to_token[rows[b], : seq[b]] = slots[offset : offset + seq[b]]
        out_cache_loc.append(slots[offset + prefix[b] : offset + seq[b]])
        offset += seq[b]
    out_cache_loc = np.concatenate(out_cache_loc)
    prefix_slots = np.setdiff1d(slots, out_cache_loc)
    shape_k, shape_v = (EXT_SLOTS, kv_heads, qk_dim), (EXT_SLOTS, kv_heads, v_dim)
    k_pool = np.full(shape_k, np.nan, np.float32)
    v_pool = np.full(shape_v, np.nan, np.float32)
    k_pool[prefix_slots] = rng.standard_normal((len(prefix_slots), kv_heads, qk_dim))
    v_pool[prefix_slots] = rng.standard_normal((len(prefix_slots), kv_heads, v_dim))
    k_new = rng.standard_normal((EXT_TOKENS, kv_heads, qk_dim)).astype(np.float32)
    v_new = rng.standard_normal((EXT_TOKENS, kv_heads, v_dim)).astype(np.float32)
    k_unified, v_unified = k_pool.copy(), v_pool.copy()
    k_unified[out_cache_loc] = k_new[:tokens]
    v_unified[out_cache_loc] = v_new[:tokens]
    q = rng.standard_normal((EXT_TOKENS, q_heads, qk_dim)).astype(np.float32)
    cast = lambda x: jnp.asarray(x).astype(dtype)  # noqa: E731
    q, k_new, v_new, k_pool, v_pool, k_unified, v_unified = map(cast, (q, k_new, v_new, k_pool, v_pool, k_unified, v_unified))
    args = (jnp.asarray(req_to_token), jnp.asarray(rows), jnp.asarray(prefix), jnp.asarray(extend))
    meta = extend_metadata(*args, max_extend_len=EXT_BUCKET, kv_capacity=EXT_CAPACITY, sliding_window=window, mode=MODE)
    loc = jnp.asarray(np.pad(out_cache_loc, (0, EXT_TOKENS - tokens)))  # padding tokens write the padding slot 0
    meta_u = extend_unified_metadata(*args, loc, max_extend_len=EXT_BUCKET, kv_capacity=EXT_CAPACITY, sliding_window=window, mode=MODE)

    # Visibility in numpy, per sequence over its full-width columns [q_len, prefix + q_len].
    listed = np.minimum(prefix, window) if window >= 0 else prefix
    start = prefix - listed
    full_rows, listed_rows, visible_any = [], [], []
    for b in range(EXT_BATCH):
        p, n = int(prefix[b]), int(extend[b])
        i, j = np.arange(n)[:, None], np.arange(p + n)[None, :]
        if case["mask"]:
            m = rng.random((n, p + n)) < 0.4
            m[rng.random(n) < 0.25] = False  # fully masked rows
            full_rows.append(m.reshape(-1))
            listed_rows.append(m[:, start[b]:].reshape(-1))
            vis = m | ((j < p) & case["skip_prefix"])
        else:
            vis = (j <= p + i) if case["causal"] else np.ones((n, p + n), bool)
        vis = vis & (j >= start[b])
        if window >= 0:
            vis &= (p + i) - j <= window
        visible_any.append(vis.any(axis=1))
    visible_any = np.concatenate(visible_any + [np.zeros(0, bool)])
    mask = mask_u = None
    if case["mask"]:
        mask = jnp.asarray(np.pad(np.concatenate(full_rows), (0, EXT_MASK - sum(len(r) for r in full_rows))))
        mask_u = jnp.asarray(np.pad(np.concatenate(listed_rows), (0, EXT_MASK - sum(len(r) for r in listed_rows))).astype(np.uint8))

    sinks = jnp.asarray(rng.standard_normal(q_heads) * 2, jnp.float32) if case["sinks"] else None
    kw = dict(causal=case["causal"], sliding_window=window, logit_cap=case["logit_cap"], sinks=sinks,
              xai_temperature_len=case["xai"], config=case["config"], mode=MODE)
    o_two = extend_attention(q, k_new, v_new, k_pool, v_pool, meta, custom_mask=mask, skip_prefix_custom_mask=case["skip_prefix"], **kw)
    o_uni = extend_attention_unified(q, k_unified, v_unified, meta_u, custom_mask=mask_u, **kw)
    ref_two, ref_uni = _extend_references(
        q, k_new, v_new, k_pool, v_pool, k_unified, v_unified, meta, meta_u, mask, mask_u, sinks, causal=case["causal"],
        window=window, logit_cap=case["logit_cap"], xai=case["xai"], skip_prefix=case["skip_prefix"],
    )
    o_two, o_uni, ref_two, ref_uni = (np.asarray(x, np.float32) for x in (o_two, o_uni, ref_two, ref_uni))
    for name, o, ref in (("two-stage", o_two, ref_two), ("unified", o_uni, ref_uni)):
        assert np.isfinite(o).all(), f"non-finite {name} output"
        assert np.isfinite(ref).all(), f"non-finite {name} reference"
        np.testing.assert_array_equal(o[tokens:], 0.0, err_msg=f"{name}: padding rows")
        np.testing.assert_array_equal(o[:tokens][~visible_any], 0.0, err_msg=f"{name}: rows with no visible key")
        np.testing.assert_allclose(o, ref, **tolerance(dtype), err_msg=name)
    if not case["mask"] or not case["skip_prefix"]:  # same keys, same mask: the two kernels agree
        np.testing.assert_allclose(o_two, o_uni, **tolerance(dtype))


@given(extend_cases())
@FAST
def test_extend_kernels_match_reference(case):
    check_extend(case)


@pytest.mark.slow
@given(extend_cases())
@SLOW
def test_extend_kernels_match_reference_many(case):
    check_extend(case)


@pytest.fixture(autouse=True)
def _quiet_config_misses():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*no tuned config.*")
        yield
