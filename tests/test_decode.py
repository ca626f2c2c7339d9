"""decode_attention: split-KV kernels against the reference (interpreter on CPU, compiled on GPU).

Pools are bigger than needed, slots are scattered at random and every unused pool row (slot 0 included) is
NaN, so a wrong gather shows up. Shapes stay small: the interpreter runs every program in Python.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.decode import (
    DecodeConfig,
    DecodeMetadata,
    clamp_config,
    decode_attention,
    decode_attention_reference,
    decode_metadata,
    decode_metadata_from_indptr,
    get_config,
    num_kv_splits_heuristic,
    vector_config,
)
from jaxattn.metadata import LAST_WAVE_KEY_SHARE, SPLIT_FIXED_KEYS, SplitWaves
from jaxattn.reference import ragged_paged_attention_reference
from tests.helpers import MODES, random_normal, random_pool_batch, tolerance

LSE_TOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.float16): 2e-3, jnp.dtype(jnp.bfloat16): 2e-3}


def make_pools(rng, kv_lens, q_heads, kv_heads, qk_dim, v_dim, dtype, *, v_from_k=False):
    """q, k_pool, v_pool (None when v_from_k), kv_indptr, kv_indices; unused pool rows are NaN."""
    kv_indptr, kv_indices, slots = random_pool_batch(rng, kv_lens, num_slots=int(np.sum(kv_lens)) + 1 + int(rng.integers(3, 20)))
    used = np.zeros(slots, bool)
    used[np.asarray(kv_indices)] = True
    nan_rows = jnp.asarray(~used)[:, None, None]
    k_pool = jnp.where(nan_rows, jnp.nan, random_normal(rng, (slots, kv_heads, qk_dim), jnp.float32)).astype(dtype)
    v_pool = None
    if not v_from_k:
        v_pool = jnp.where(nan_rows, jnp.nan, random_normal(rng, (slots, kv_heads, v_dim), jnp.float32)).astype(dtype)
    q = random_normal(rng, (len(kv_lens), q_heads, qk_dim), dtype)
    return q, k_pool, v_pool, kv_indptr, kv_indices


def req_tables(kv_indptr, kv_indices, extra_rows=2, extra_ctx=5):
    """req_to_token rows holding each sequence's slots (in shuffled row order), and req_pool_indices."""
    indptr = np.asarray(kv_indptr)
    lens = np.diff(indptr)
    batch = len(lens)
    ctx = int(lens.max(initial=1)) + extra_ctx
    table = np.zeros((batch + extra_rows, ctx), np.int32)
    rows = np.random.default_rng(batch).permutation(batch + extra_rows)[:batch]
    for b in range(batch):
        table[rows[b], : lens[b]] = np.asarray(kv_indices)[indptr[b] : indptr[b + 1]]
    return jnp.asarray(table), jnp.asarray(rows.astype(np.int32)), jnp.asarray(lens.astype(np.int32))


def assert_close(o, lse, ref_o, ref_lse, dtype):
    assert not np.isnan(np.float32(o)).any()
    np.testing.assert_allclose(np.float32(o), np.float32(ref_o), **tolerance(dtype))
    np.testing.assert_allclose(lse, ref_lse, atol=LSE_TOL[jnp.dtype(dtype)], rtol=LSE_TOL[jnp.dtype(dtype)])


# (q_heads, kv_heads, qk_dim, v_dim, dtype, v_from_k): GQA ratios 1/4/8 and >16, every head-dim family, every dtype.
CASES = [
    (2, 2, 64, 64, jnp.float32, False),  # MHA (group 1): the grouped kernel (the default) on these two,
    (4, 4, 128, 128, jnp.bfloat16, False),
    (2, 2, 256, 256, jnp.float16, False),  # the opt-in vector kernel on these two (VECTOR_CASES)
    (2, 2, 192, 128, jnp.bfloat16, False),  # rope part in a second multiply-and-sum
    (4, 1, 128, 128, jnp.bfloat16, False),
    (8, 1, 64, 64, jnp.float16, False),
    (2, 1, 256, 256, jnp.float32, False),
    (2, 1, 576, 512, jnp.bfloat16, False),
    (2, 1, 576, 512, jnp.float16, True),
    (4, 1, 288, 256, jnp.float32, True),
    (8, 2, 192, 128, jnp.bfloat16, False),
    (2, 1, 192, 128, jnp.float16, True),
    (20, 1, 64, 64, jnp.float32, False),  # group 20 > 16: two head blocks, the second partly masked
]
VECTOR_CASES = {CASES[2], CASES[3]}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0]}-{c[1]}_d{c[2]}-{c[3]}_{jnp.dtype(c[4]).name}{'_vfromk' if c[5] else ''}")
def test_matches_reference(rng, mode, case):
    q_heads, kv_heads, qk_dim, v_dim, dtype, v_from_k = case
    # Lengths 1, odd, 0 (padding), 161 in 4 splits of 64 (the 4th starts past the end) and 128 in 3 splits of 64
    # (the 3rd starts exactly at the end): both stages must skip those splits, whose buffers are NaN-poisoned.
    kv_lens = [1, 37, 0, 161, 128]
    q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, kv_lens, q_heads, kv_heads, qk_dim, v_dim, dtype, v_from_k=v_from_k)
    meta = decode_metadata_from_indptr(
        kv_indptr, kv_indices, q_heads=q_heads, kv_heads=kv_heads, max_kv_splits=4, min_split_len=32, programs_per_sm=10**6
    )
    assert np.asarray(meta.num_kv_splits).tolist() == [1, 1, 1, 4, 4]
    meta = dataclasses.replace(meta, num_kv_splits=jnp.asarray([1, 2, 1, 4, 3], jnp.int32))
    kwargs = dict(return_lse=True, v_head_dim=v_dim if v_from_k else None)
    config = DecodeConfig(block_n=32, block_h=1) if case in VECTOR_CASES else None
    o, lse = decode_attention(q, k_pool, v_pool, meta, mode=mode, config=config, **kwargs)
    assert o.shape == (5, q_heads, v_dim) and o.dtype == dtype and lse.dtype == jnp.float32
    ref_o, ref_lse = decode_attention_reference(q, k_pool, v_pool, meta, **kwargs)
    assert_close(o, lse, ref_o, ref_lse, dtype)
    # Padding row: zeros and LSE -inf.
    np.testing.assert_array_equal(np.float32(o[2]), 0.0)
    assert np.all(np.asarray(lse[2]) == -np.inf)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pool", ["bf16", "fp8"])
@pytest.mark.parametrize("config", [None, DecodeConfig(block_n=32, block_h=1)], ids=["grouped", "vector"])
def test_one_split_rows_stored_by_stage_1_equal_the_merge(rng, mode, pool, config):
    """Without a sink, stage 1 stores the rows of one-split sequences itself and the merge leaves them; a sink of
    -inf (exp(-inf) = 0 added to the denominator) takes every row through the merge instead, with the same
    arithmetic: the two must agree bit for bit, empty row and v_scale included."""
    if pool == "fp8" and config is not None:
        pytest.skip("fp8 pools take the grouped kernel's table tiles")
    q_heads, kv_heads, dim = 8, 2, 64
    kv_lens = [1, 37, 0, 161, 128, 70]
    q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, kv_lens, q_heads, kv_heads, dim, dim, jnp.bfloat16)
    scales = {}
    if pool == "fp8":
        k_pool, v_pool = (jnp.nan_to_num(p).astype(jnp.float8_e4m3fn) for p in (k_pool, v_pool))
        scales = dict(k_scale=0.7, v_scale=1.3)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=q_heads, kv_heads=kv_heads, max_kv_splits=4,
                                       min_split_len=32)
    meta = dataclasses.replace(meta, num_kv_splits=jnp.asarray([1, 2, 1, 4, 1, 3], jnp.int32))
    kw = dict(return_lse=True, mode=mode, config=config, **scales)
    o, lse = decode_attention(q, k_pool, v_pool, meta, **kw)
    merged_o, merged_lse = decode_attention(q, k_pool, v_pool, meta, sinks=jnp.full((q_heads,), -jnp.inf), **kw)
    assert not np.isnan(np.float32(o)).any()
    np.testing.assert_array_equal(np.float32(o), np.float32(merged_o))
    np.testing.assert_array_equal(lse, merged_lse)
    ref_o, ref_lse = decode_attention_reference(q, k_pool, v_pool, meta, return_lse=True, **scales)
    assert_close(o, lse, ref_o, ref_lse, jnp.bfloat16)
    np.testing.assert_array_equal(np.float32(o[2]), 0.0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pool", ["bf16", "fp8", "fp8-in-registers"])
def test_tile_tails_read_no_key_listed_after_their_split(rng, mode, pool):
    """A key tile that runs past its split reads the split's last key again (kernels/decode_attention.py, "Tail keys"),
    never the keys listed after it: a NaN V at the first key of sequences 1 and 3 (each listed right after a sequence
    whose length ends mid-tile) makes exactly those sequences' rows NaN; sequences 0 and 2 match the reference."""
    q_heads, kv_heads, dim = 8, 2, 64
    kv_lens = [37, 45, 29, 70]
    q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, kv_lens, q_heads, kv_heads, dim, dim, jnp.bfloat16)
    scales, config = {}, None  # (the pool's unlisted rows stay NaN, in fp8 too)
    if pool != "bf16":
        k_pool, v_pool = k_pool.astype(jnp.float8_e4m3fn), v_pool.astype(jnp.float8_e4m3fn)
        scales = dict(k_scale=0.7, v_scale=1.3)
        config = DecodeConfig(block_n=32, fp8_in_registers=True) if pool == "fp8-in-registers" else None
    for b in (1, 3):
        v_pool = v_pool.at[int(kv_indices[int(kv_indptr[b])]), 1].set(jnp.nan)  # kv head 1: q heads 4-7
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=q_heads, kv_heads=kv_heads, max_kv_splits=2,
                                       min_split_len=16, programs_per_sm=10**6)
    o = np.float32(decode_attention(q, k_pool, v_pool, meta, mode=mode, config=config, **scales))
    nan_rows = np.isnan(o).any(axis=-1)
    want = np.zeros(nan_rows.shape, bool)
    want[[1, 3], 4:] = True
    np.testing.assert_array_equal(nan_rows, want)
    ref_o = np.float32(decode_attention_reference(q, k_pool, v_pool, meta, **scales))
    np.testing.assert_allclose(o[[0, 2]], ref_o[[0, 2]], **tolerance(jnp.bfloat16))


@pytest.mark.parametrize("max_kv_splits", [1, 3])
def test_a_one_split_bound_launches_stage_1_alone(rng, max_kv_splits):
    """A static bound of one split (a batch filling the GPU, D3) has every row stored by stage 1: no merge launch.
    With a sink, or a higher bound, the merge runs."""
    q_heads, kv_heads, dim = 8, 2, 64
    kv_lens = [1, 37, 0, 70]
    q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, kv_lens, q_heads, kv_heads, dim, dim, jnp.float32)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=q_heads, kv_heads=kv_heads,
                                       max_kv_splits=max_kv_splits, min_split_len=32)

    def launches(**kw):
        jaxpr = jax.make_jaxpr(lambda q: decode_attention(q, k_pool, v_pool, meta, mode="interpret", **kw))(q)
        return str(jaxpr).count("pure_callback")

    assert launches() == (1 if max_kv_splits == 1 else 2)
    assert launches(sinks=jnp.zeros((q_heads,))) == 2
    o, lse = decode_attention(q, k_pool, v_pool, meta, return_lse=True, mode="interpret")
    ref_o, ref_lse = decode_attention_reference(q, k_pool, v_pool, meta, return_lse=True)
    assert_close(o, lse, ref_o, ref_lse, jnp.float32)
    np.testing.assert_array_equal(np.float32(o[2]), 0.0)
    assert np.all(np.asarray(lse[2]) == -np.inf)


# (q_heads, kv_heads, qk_dim, v_dim, dtype, v_from_k, block_h): MLA's latent head (V inside K, and V a pool of its own),
# 288/256 in fp32, GQA 4, group 20 in two 16-row head blocks (the second partly masked), MLA at 64 rows.
KEYS_AS_ROWS_CASES = [
    (2, 1, 576, 512, jnp.bfloat16, True, 16),
    (2, 1, 576, 512, jnp.float16, False, 16),
    (4, 1, 288, 256, jnp.float32, True, 16),
    (8, 2, 128, 128, jnp.bfloat16, False, 16),
    (20, 1, 64, 64, jnp.float32, False, 16),
    (16, 1, 576, 512, jnp.bfloat16, True, 64),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("features", [{}, dict(logit_cap=5.0, sinks=True, sliding_window=40, xai_temperature_len=16)],
                         ids=["plain", "cap+sinks+window+xai"])
@pytest.mark.parametrize("case", KEYS_AS_ROWS_CASES,
                         ids=lambda c: f"h{c[0]}-{c[1]}_d{c[2]}-{c[3]}_{jnp.dtype(c[4]).name}{'_vfromk' if c[5] else ''}_bh{c[6]}")
def test_keys_as_rows_matches_reference(rng, mode, features, case):
    """DecodeConfig(keys_as_rows=True): both dots transposed (keys as M), the output transposed back; the same
    lengths and splits as test_matches_reference (empty and past-the-end splits NaN-poisoned), with every feature."""
    q_heads, kv_heads, qk_dim, v_dim, dtype, v_from_k, block_h = case
    kv_lens = [1, 37, 0, 161, 128]
    q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, kv_lens, q_heads, kv_heads, qk_dim, v_dim, dtype, v_from_k=v_from_k)
    meta = decode_metadata_from_indptr(
        kv_indptr, kv_indices, q_heads=q_heads, kv_heads=kv_heads, max_kv_splits=4, min_split_len=32, programs_per_sm=10**6
    )
    meta = dataclasses.replace(meta, num_kv_splits=jnp.asarray([1, 2, 1, 4, 3], jnp.int32))
    sinks = random_normal(rng, (q_heads,), jnp.float32) if features.get("sinks") else None
    kwargs = dict(return_lse=True, v_head_dim=v_dim if v_from_k else None, sinks=sinks,
                  **{k: v for k, v in features.items() if k != "sinks"})
    config = DecodeConfig(block_n=32, block_h=block_h, num_warps=8 if block_h == 64 else 4, keys_as_rows=True)
    o, lse = decode_attention(q, k_pool, v_pool, meta, mode=mode, config=config, **kwargs)
    ref_o, ref_lse = decode_attention_reference(q, k_pool, v_pool, meta, **kwargs)
    assert_close(o, lse, ref_o, ref_lse, dtype)
    np.testing.assert_array_equal(np.float32(o[2]), 0.0)  # the padding row


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "config",
    [
        DecodeConfig(block_n=16, block_h=16, num_warps=4, num_stages=1),
        DecodeConfig(block_n=128, block_h=32, num_warps=8, num_stages=3),
        DecodeConfig(block_n=32, block_h=1, num_warps=4, num_stages=2),  # the vector kernel on GQA (one q head each)
    ],
)
def test_configs_and_many_splits(rng, mode, config):
    # 13 non-empty splits (> SGLang's 8) of 32 keys; lengths that are not multiples of any block size.
    q_heads, kv_heads, dim, dtype = 4, 2, 64, jnp.float16
    kv_lens = [389, 45, 3]
    q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, kv_lens, q_heads, kv_heads, dim, dim, dtype)
    meta = decode_metadata_from_indptr(
        kv_indptr, kv_indices, q_heads=q_heads, kv_heads=kv_heads, max_kv_splits=16, min_split_len=32, programs_per_sm=10**6
    )
    assert int(meta.num_kv_splits[0]) == 13
    o, lse = decode_attention(q, k_pool, v_pool, meta, return_lse=True, config=config, mode=mode)
    ref_o, ref_lse = decode_attention_reference(q, k_pool, v_pool, meta, return_lse=True)
    assert_close(o, lse, ref_o, ref_lse, dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "features",
    [
        dict(logit_cap=5.0, sinks=True),
        dict(sliding_window=40, xai_temperature_len=16),
        dict(sliding_window=0, sinks=True, logit_cap=2.0, xai_temperature_len=50),
    ],
    ids=["cap+sinks", "window+xai", "window0+all"],
)
@pytest.mark.parametrize("config", [None, DecodeConfig(block_n=32, block_h=1)], ids=["grouped", "vector"])
def test_features_against_ragged_reference(rng, mode, features, config):
    """Built from request tables (windowed lists, absolute positions), checked against the ragged reference over
    the full untrimmed lists, which knows nothing about decode metadata."""
    q_heads, kv_heads, dim, dtype = 4, 2, 64, jnp.float32
    kv_lens = [70, 0, 1, 133]
    q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, kv_lens, q_heads, kv_heads, dim, dim, dtype)
    sinks = random_normal(rng, (q_heads,), jnp.float32) if features.get("sinks") else None
    window = features.get("sliding_window", -1)
    kw = dict(logit_cap=features.get("logit_cap", 0.0), xai_temperature_len=features.get("xai_temperature_len", -1), sm_scale=0.3)
    table, rows, seq_lens = req_tables(kv_indptr, kv_indices)
    meta = decode_metadata(
        table, rows, seq_lens, kv_capacity=300, q_heads=q_heads, kv_heads=kv_heads, sliding_window=window,
        max_kv_splits=3, programs_per_sm=10**6, min_split_len=32, mode=mode,
    )
    o, lse = decode_attention(q, k_pool, v_pool, meta, sinks=sinks, return_lse=True, mode=mode, config=config, **kw)
    ref_o, ref_lse = ragged_paged_attention_reference(
        q, k_pool, v_pool, jnp.arange(5, dtype=jnp.int32), kv_indptr, kv_indices, causal=True, sliding_window=window,
        sinks=sinks, return_lse=True, **kw,
    )
    assert_close(o, lse, ref_o, ref_lse, dtype)
    ref2 = decode_attention_reference(q, k_pool, v_pool, meta, sinks=sinks, return_lse=True, **kw)
    assert_close(o, lse, *ref2, dtype)
    # The padding row: zeros, and LSE the sink's (the reference's rule: the sink is the whole denominator) or -inf.
    np.testing.assert_array_equal(np.float32(o[1]), 0.0)
    np.testing.assert_allclose(lse[1], np.asarray(sinks) if sinks is not None else -np.inf)

    # The same window applied by the kernel to untrimmed CSR lists gives the same result.
    meta_full = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=q_heads, kv_heads=kv_heads, max_kv_splits=3, min_split_len=32)
    o_full = decode_attention(q, k_pool, v_pool, meta_full, sinks=sinks, sliding_window=window, mode=mode, **kw)
    np.testing.assert_allclose(o_full, ref_o, **tolerance(dtype))


def test_reference_matches_dense_softmax(rng):
    """decode_attention_reference against a numpy softmax over the gathered keys (MLA shape, V = K[..., :512])."""
    q, k_pool, _, kv_indptr, kv_indices = make_pools(rng, [9, 30], 2, 1, 576, 512, jnp.float32, v_from_k=True)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=2, kv_heads=1)
    o = decode_attention_reference(q, k_pool, None, meta)
    for b in range(2):
        keys = np.asarray(k_pool)[np.asarray(kv_indices)[kv_indptr[b] : kv_indptr[b + 1]], 0]
        s = np.asarray(q[b]) @ keys.T / np.sqrt(576)
        p = np.exp(s - s.max(-1, keepdims=True))
        np.testing.assert_allclose(o[b], (p / p.sum(-1, keepdims=True)) @ keys[:, :512], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("mode", MODES)
def test_deterministic_mode_is_batch_invariant(rng, mode):
    q_heads, kv_heads, dim, dtype = 4, 1, 64, jnp.bfloat16
    kv_lens = [300, 7, 250]
    q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, kv_lens, q_heads, kv_heads, dim, dim, dtype)
    kw = dict(q_heads=q_heads, kv_heads=kv_heads, deterministic=True, split_tile_size=64, max_kv_splits=5)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, max_context_len=320, **kw)
    assert np.asarray(meta.num_kv_splits).tolist() == [5, 1, 4]
    o = decode_attention(q, k_pool, v_pool, meta, mode=mode)
    # Sequence 0 alone (other rows padding), then with a different neighbour: bit-identical output.
    for other in ([0, 0], [200, 0]):
        lens = [300] + other
        idx = np.concatenate([np.asarray(kv_indices)[:300], np.asarray(kv_indices)[307 : 307 + other[0]]])
        indptr = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        meta2 = decode_metadata_from_indptr(indptr, jnp.asarray(np.pad(idx, (0, 600 - len(idx))).astype(np.int32)), max_context_len=320, **kw)
        o2 = decode_attention(jnp.stack([q[0], q[2], q[1]]), k_pool, v_pool, meta2, mode=mode)
        np.testing.assert_array_equal(np.float32(o2[0]), np.float32(o[0]))
    ref = decode_attention_reference(q, k_pool, v_pool, meta)
    np.testing.assert_allclose(np.float32(o), np.float32(ref), **tolerance(dtype))


@pytest.mark.parametrize("mode", MODES)
def test_one_compile_serves_different_lengths(rng, mode):
    q_heads, kv_heads, dim, dtype = 2, 1, 64, jnp.float32
    traces = []

    @jax.jit
    def step(q, k_pool, v_pool, table, rows, seq_lens):
        traces.append(1)
        meta = decode_metadata(table, rows, seq_lens, kv_capacity=128, q_heads=q_heads, kv_heads=kv_heads, max_kv_splits=4, mode=mode)
        return decode_attention(q, k_pool, v_pool, meta, mode=mode), decode_attention_reference(q, k_pool, v_pool, meta)

    for kv_lens in ([5, 40], [33, 0]):
        q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, kv_lens, q_heads, kv_heads, dim, dim, dtype)
        # Same pool size for both steps (NaN rows). Slot 0 holds zeros, as SGLang's padding slot does: the jnp
        # reference under jit gathers up to the static bound and would turn 0 * NaN into NaN.
        k_pool = jnp.pad(k_pool, ((0, 90 - k_pool.shape[0]), (0, 0), (0, 0)), constant_values=jnp.nan).at[0].set(0.0)
        v_pool = jnp.pad(v_pool, ((0, 90 - v_pool.shape[0]), (0, 0), (0, 0)), constant_values=jnp.nan).at[0].set(0.0)
        table, rows, seq_lens = req_tables(kv_indptr, kv_indices, extra_ctx=50 - max(kv_lens))
        o, ref = step(q, k_pool, v_pool, table, rows, seq_lens)
        np.testing.assert_allclose(o, ref, **tolerance(dtype))
    assert len(traces) == 1


def test_split_heuristic_fills_the_h200():
    kw = dict(q_heads=32, kv_heads=8, max_kv_splits=64)
    d2 = num_kv_splits_heuristic(jnp.full((8,), 32768), **kw)  # D2: batch 8 x 32k
    assert int(d2[0]) >= 16 and 32768 / int(d2[0]) >= 256
    assert np.asarray(num_kv_splits_heuristic(jnp.full((256,), 1024), **kw)).max() == 1  # D3: the batch fills the chip
    d1 = num_kv_splits_heuristic(jnp.full((64,), 4096), **kw)
    assert 2 <= int(d1[0]) <= 8
    mixed = np.asarray(num_kv_splits_heuristic(jnp.asarray([100, 8000, 0, 32768]), **kw))
    assert mixed[0] == 1 and mixed[1] < mixed[3] and mixed[2] == 1  # same chunk size across the batch
    det = num_kv_splits_heuristic(jnp.asarray([1, 256, 257, 0]), deterministic=True, split_tile_size=256, **kw)
    assert np.asarray(det).tolist() == [1, 1, 2, 1]
    # MLA (16 heads over one latent head): a program does 4 GQA programs' work, so about 4x fewer splits (the H200's
    # 132 SMs: 5 at 64 x 4096, 3 at 128 x 8192), not the 16 / 9 that counting programs alone gives.
    mla = dict(q_heads=16, kv_heads=1, max_kv_splits=64, num_sms=132)
    assert int(num_kv_splits_heuristic(jnp.full((64,), 4096), **mla)[0]) == 5
    assert int(num_kv_splits_heuristic(jnp.full((128,), 8192), **mla)[0]) == 3
    assert int(num_kv_splits_heuristic(jnp.full((64,), 4096), **dict(mla, q_heads=4))[0]) == 16  # 4 heads: as GQA


def _split_count_by_the_cost_model(lens, *, max_kv_splits, programs_per_split, capacity, num_sms, min_split_len=256):
    """num_kv_splits_by_waves's choice of S, by loops over the cost model its docstring states (the test's oracle)."""
    max_len = max(lens)
    by_len = max(-(-max_len // min_split_len), 1)
    costs, one_wave = {}, []
    for count in range(1, min(by_len, max_kv_splits) + 1):
        chunk = max(-(-max_len // count), 1)
        programs = sum(-(-n // chunk) for n in lens) * programs_per_split
        if programs <= capacity:
            one_wave.append(count)
        tail = programs % capacity
        lone = LAST_WAVE_KEY_SHARE * chunk if 0 < tail < num_sms and programs > capacity else 0.0
        costs[count] = programs / capacity * (SPLIT_FIXED_KEYS + chunk) + lone
    if one_wave:
        return max(one_wave)
    return min(costs, key=lambda count: (costs[count], count))


def test_split_counts_by_waves_follow_the_cost_model():
    # The fp8 table tile at 32/8 heads (4 programs an SM, one program per kv head and split) on 132 SMs: 528 at once.
    waves = SplitWaves(resident_per_sm=4, heads_per_program=16)
    kw = dict(q_heads=32, kv_heads=8, num_sms=132, split_waves=waves)
    # D2: 17 splits (the fill heuristic's) leave a last wave of 32 programs running alone (+19% on the H100); 8 splits
    # are 512 programs, the most that fit in one wave. D1: one split a sequence is already 512 programs.
    assert int(num_kv_splits_heuristic(jnp.full((8,), 32768), max_kv_splits=34, **dict(kw, split_waves=None))[0]) == 17
    assert int(num_kv_splits_heuristic(jnp.full((8,), 32768), max_kv_splits=34, **kw)[0]) == 8
    assert int(num_kv_splits_heuristic(jnp.full((64,), 4096), max_kv_splits=6, **kw)[0]) == 1
    # D3: one split is 2048 programs (3.9 waves); more splits only add waves.
    assert int(num_kv_splits_heuristic(jnp.full((256,), 1024), max_kv_splits=4, **kw)[0]) == 1
    # 67 x 4096: one split overflows a wave by 8 programs that would run alone; the cost model spreads them.
    assert int(num_kv_splits_heuristic(jnp.full((67,), 4096), max_kv_splits=6, **kw)[0]) > 1
    rng = np.random.default_rng(7)
    for _ in range(8):  # random batches (one padded shape: padding rows count no programs) against the loops
        batch = int(rng.integers(1, 64))
        lens = np.zeros(64, np.int64)
        lens[:batch] = rng.integers(0, 20000, size=batch)
        lens[0] = max(int(lens.max()), 1)
        max_kv_splits = int(rng.choice([6, 34]))
        resident, heads = int(rng.integers(1, 9)), int(rng.choice([1, 16, 32]))
        q_heads, kv_heads = int(rng.choice([8, 32, 64])), 8
        got = np.asarray(num_kv_splits_heuristic(jnp.asarray(lens), max_kv_splits=max_kv_splits, q_heads=q_heads,
                                                 kv_heads=kv_heads, num_sms=132,
                                                 split_waves=SplitWaves(resident, heads)))
        count = _split_count_by_the_cost_model(
            lens.tolist(), max_kv_splits=max_kv_splits, programs_per_split=kv_heads * -(-(q_heads // kv_heads) // heads),
            capacity=132 * resident, num_sms=132)
        chunk = max(-(-int(lens.max()) // count), 1)
        np.testing.assert_array_equal(got, np.clip(-(-lens // chunk), 1, max_kv_splits), err_msg=f"{lens}, S={count}")
    # Padding rows only: one split each, as the fill heuristic.
    assert np.asarray(num_kv_splits_heuristic(jnp.zeros((4,), jnp.int32), max_kv_splits=8, **kw)).tolist() == [1] * 4


def test_metadata_takes_split_waves(monkeypatch):
    from jaxattn import tuning

    waves = tuning.decode_split_waves(128, 128, 32, 8, family="sm_90")
    assert waves == SplitWaves(resident_per_sm=4, heads_per_program=16)
    monkeypatch.setattr(tuning.sm90, "DECODE_FP8_SPLIT_WAVES", True)
    assert tuning.default_decode_split_waves(128, 128, 32, 8, fp8_pool=True) == waves
    assert tuning.default_decode_split_waves(128, 128, 32, 8, fp8_pool=False) is None  # 16-bit pools: none
    assert tuning.decode_split_waves(64, 64, 32, 8, family="sm_90") is None  # no residency for the key
    lens = jnp.asarray([32768] * 8, jnp.int32)
    indptr = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lens)]).astype(jnp.int32)
    indices = jnp.zeros((8 * 32768,), jnp.int32)
    meta = decode_metadata_from_indptr(indptr, indices, q_heads=32, kv_heads=8, num_sms=132, split_waves=waves)
    expected = num_kv_splits_heuristic(lens, max_kv_splits=meta.max_kv_splits, q_heads=32, kv_heads=8, num_sms=132,
                                       split_waves=waves)
    np.testing.assert_array_equal(meta.num_kv_splits, expected)
    assert meta.max_kv_splits == 34  # the static bound is the fill heuristic's either way
    with pytest.raises(ValueError, match="split_waves must be None or a jaxattn.metadata.SplitWaves"):
        decode_metadata_from_indptr(indptr, indices, q_heads=32, kv_heads=8, split_waves=(4, 16))
    with pytest.raises(ValueError, match="SplitWaves.resident_per_sm"):
        SplitWaves(resident_per_sm=0, heads_per_program=16)


def test_config_table():
    assert get_config(128, 128, 4) == DecodeConfig(block_n=128, block_h=16, num_warps=4, num_stages=3)
    assert get_config(576, 512, 128).block_h == 64  # MLA past 16 rows: one 64-row tile per kv head
    assert clamp_config(DecodeConfig(block_h=64), 16).block_h == 64  # padding to one wgmma tile: an explicit choice
    assert clamp_config(DecodeConfig(block_h=128), 16).block_h == 64
    # MHA: the grouped kernel, with its own entry where tuned, else the g16 one clamped to 16 rows.
    assert get_config(128, 128, 1) == DecodeConfig(block_n=32, block_h=16, num_warps=4, num_stages=3)
    assert get_config(64, 64, 1) == get_config(64, 64, 4)
    assert vector_config(64, 64).block_h == 1
    assert clamp_config(vector_config(64, 64), 4).block_h == 1
    with pytest.raises(ValueError, match="block_h 1 .* or >= 16"):
        DecodeConfig(block_h=8)
    with pytest.warns(UserWarning, match="no tuned config"):
        assert get_config(80, 80, 2).block_n == 64
    with pytest.raises(ValueError, match="block_n"):
        DecodeConfig(block_n=48)
    with pytest.raises(ValueError, match="keys_as_rows takes the grouped kernel"):
        DecodeConfig(block_h=1, keys_as_rows=True)
    with pytest.raises(ValueError, match="keys_as_rows must be a bool"):
        DecodeConfig(keys_as_rows=1)


def test_clear_errors(rng):
    q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, [3, 4], 4, 2, 64, 64, jnp.float32)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="q_heads .* multiple of kv_heads"):
        decode_attention(q[:, :3], k_pool, v_pool, meta)
    with pytest.raises(ValueError, match="meta batch"):
        decode_attention(q[:1], k_pool, v_pool, meta)
    with pytest.raises(ValueError, match="k_pool must have q.s dtype float32 or an fp8 format"):
        decode_attention(q, k_pool.astype(jnp.float16), v_pool, meta)
    with pytest.raises(ValueError, match="k_pool must have shape"):
        decode_attention(q, k_pool[..., :32], v_pool, meta)
    with pytest.raises(ValueError, match="v_pool must have shape"):
        decode_attention(q, k_pool, v_pool[:, :1], meta)
    with pytest.raises(ValueError, match="v_head_dim must be given"):
        decode_attention(q, k_pool, None, meta)
    with pytest.raises(ValueError, match="sinks must have shape"):
        decode_attention(q, k_pool, v_pool, meta, sinks=jnp.zeros((3,)))
    with pytest.raises(ValueError, match="meta must be a DecodeMetadata"):
        decode_attention(q, k_pool, v_pool, (kv_indptr, kv_indices))
    with pytest.raises(ValueError, match="max_kv_splits .* deterministic"):
        decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=4, kv_heads=2, deterministic=True, max_kv_splits=2, max_context_len=1000)
    with pytest.raises(ValueError, match="q_heads .* multiple of kv_heads"):
        decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=3, kv_heads=2)
    windowed = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=4, kv_heads=2, sliding_window=8)
    with pytest.raises(ValueError, match="sliding_window .* meta.sliding_window"):
        decode_attention(q, k_pool, v_pool, windowed, sliding_window=9)
    with pytest.raises(ValueError, match="num_kv_splits must have shape"):
        DecodeMetadata(kv_indptr, kv_indices, jnp.zeros((3,), jnp.int32), jnp.zeros((2,), jnp.int32), max_kv_splits=4, kv_capacity=kv_indices.shape[0])
    assert isinstance(dataclasses.replace(meta, max_kv_splits=2), DecodeMetadata)
