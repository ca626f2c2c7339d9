"""Hostile inputs (issue 21): every kernel stays inside its buffers and lets NaN through, and the host side (write_kv,
scalars, layers, checked mode) rejects or drops what it cannot store.

Kernels (classes 1, 5, 6):

In the interpreter (JAXATTN_HOSTILE_MODE=gpu: on the compiled kernels). Hostile slots are 2**30, -1, 2**31 - 1 and the
pool size (just past the end); each must read the padding slot 0, so the expected output is the reference run on the
same input with those slots replaced by 0 and every CSR range cut to the buffer it indexes. Pools are slices of a
bigger array whose rows past the slice are NaN (the rows a missing clamp would hit on a real allocation); slot 0 is
finite. NaN tests: NaN in q or a visible K/V makes exactly the rows that see it NaN; a NaN key a row cannot see
(listed, masked by causality) leaves it clean.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.backends import AttentionLayer
from jaxattn.checked import checked, validate_extend_inputs
from jaxattn.decode import DecodeConfig, decode_attention, decode_attention_reference, decode_metadata, decode_metadata_from_indptr
from jaxattn.extend import (
    ExtendConfig,
    ExtendMetadata,
    ExtendUnifiedMetadata,
    extend_attention,
    extend_attention_reference,
    extend_attention_unified,
    extend_attention_unified_reference,
    extend_metadata,
    extend_unified_metadata,
)
from jaxattn.kv_indices import build_unified_kv_indices, build_unified_kv_indices_reference, create_kv_indices, create_kv_indices_reference
from jaxattn.merge_state import merge_state, merge_state_reference
from jaxattn.serving import write_kv

# The interpreter by default (CI); JAXATTN_HOSTILE_MODE=gpu runs the same cases on the compiled kernels, e.g. under
# compute-sanitizer (scripts/gpu_check.sh with SANITIZE=1).
MODE = os.environ.get("JAXATTN_HOSTILE_MODE", "interpret")
TOL = dict(rtol=2e-5, atol=2e-5)
SMALL = ExtendConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def hostile_slots(num_slots):
    return [2**30, -1, num_slots, 2**31 - 1]


def sanitize(indices, num_slots):
    """What the kernels read for each listed slot: out-of-pool slots become the padding slot 0."""
    indices = np.asarray(indices)
    return jnp.asarray(np.where((indices >= 0) & (indices < num_slots), indices, 0).astype(indices.dtype))


def clamp_indptr(indptr, capacity):
    """The CSR offsets the kernels use: each range cut to [0, capacity] (monotone inputs stay monotone)."""
    return jnp.asarray(np.clip(np.asarray(indptr), 0, capacity).astype(np.int32))


def pool(rng, num_slots, heads, dim, nan_tail=8):
    """[num_slots, heads, dim] f32 (slot 0 finite), cut from an array whose `nan_tail` rows past the end are NaN."""
    full = rng.standard_normal((num_slots + nan_tail, heads, dim)).astype(np.float32)
    full[num_slots:] = np.nan
    return jnp.asarray(full)[:num_slots]


def nan_rows(o):
    return np.isnan(np.float32(o)).any(axis=-1)


def assert_same(o, ref, tol=TOL):
    """Same NaN pattern, and equal where finite."""
    o, ref = np.float32(o), np.float32(ref)
    np.testing.assert_array_equal(nan_rows(o), nan_rows(ref))
    clean = ~nan_rows(ref)
    np.testing.assert_allclose(o[clean], ref[clean], **tol)


# ---------------------------------------------------------------------------------------------
# Decode

DEC_HEADS, DEC_KV_HEADS, DEC_DIM = 2, 1, 64
DEC_LENS = [5, 40, 0, 7]  # 40 keys in 2 splits (32 + 8); the empty row gives 0 and LSE -inf
DEC_CONFIGS = [pytest.param(None, id="grouped"), pytest.param(DecodeConfig(block_n=16, block_h=1), id="vector")]


def decode_inputs(rng):
    total = sum(DEC_LENS)
    num_slots = total + 4
    slots = rng.permutation(np.arange(1, num_slots))[:total].astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(DEC_LENS)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((len(DEC_LENS), DEC_HEADS, DEC_DIM)).astype(np.float32))
    return q, pool(rng, num_slots, DEC_KV_HEADS, DEC_DIM), pool(rng, num_slots, DEC_KV_HEADS, DEC_DIM), indptr, slots, num_slots


def meta_for(indptr, indices, splits=(1, 2, 1, 2)):
    meta = decode_metadata_from_indptr(jnp.asarray(indptr), jnp.asarray(indices), q_heads=DEC_HEADS, kv_heads=DEC_KV_HEADS,
                                       max_kv_splits=2)
    return dataclasses.replace(meta, num_kv_splits=jnp.asarray(splits, jnp.int32))


@pytest.mark.parametrize("config", DEC_CONFIGS)
def test_decode_hostile_indptr_and_slots(rng, config):
    q, k_pool, v_pool, indptr, slots, num_slots = decode_inputs(rng)
    bad = slots.copy()
    bad[[1, 8, 43, 46]] = hostile_slots(num_slots)  # in seq 0, seq 1 (both splits) and seq 3
    capacity = 49  # kv_indices is cut short: seq 3's range [45, 52) points past it
    hostile_indptr = indptr.copy()
    hostile_indptr[0] = -4  # a negative start: seq 0 is [0, 5)
    meta = meta_for(hostile_indptr, bad[:capacity])
    o, lse = decode_attention(q, k_pool, v_pool, meta, config=config, return_lse=True, mode=MODE)
    ref_meta = meta_for(clamp_indptr(indptr, capacity), sanitize(bad[:capacity], num_slots))
    ref_o, ref_lse = decode_attention_reference(q, k_pool, v_pool, ref_meta, return_lse=True)
    assert not nan_rows(o).any()
    np.testing.assert_allclose(np.float32(o), np.float32(ref_o), **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)
    np.testing.assert_array_equal(np.float32(o[2]), 0.0)
    assert np.all(np.asarray(lse[2]) == -np.inf)


def test_references_read_slots_outside_the_pool_as_slot_0(rng):
    # The references take the kernels' slot rule on the raw lists: a slot outside the pool reads the padding slot 0,
    # not the pool's last row (clamped), which can hold another request's keys (NaN here, so a clamp shows).
    def with_nan_row(x):  # a last row no list names
        return jnp.concatenate([x, jnp.full_like(x[:1], jnp.nan)])

    q, k_pool, v_pool, indptr, slots, num_slots = decode_inputs(rng)
    k_pool, v_pool, num_slots = with_nan_row(k_pool), with_nan_row(v_pool), num_slots + 1
    bad = slots.copy()
    bad[[1, 8, 43, 46]] = hostile_slots(num_slots)
    raw, sanitized = meta_for(indptr, bad), meta_for(indptr, sanitize(bad, num_slots))
    ref = decode_attention_reference(q, k_pool, v_pool, raw)
    assert_same(ref, decode_attention_reference(q, k_pool, v_pool, sanitized))
    assert not nan_rows(ref).any()
    assert_same(decode_attention(q, k_pool, v_pool, raw, mode=MODE), ref)
    case = extend_inputs(rng)
    k_pool, v_pool, num_slots = with_nan_row(case.k_pool), with_nan_row(case.v_pool), case.num_slots + 1
    bad = case.prefix_slots.copy()
    bad[[2, 7, 21, 25]] = hostile_slots(num_slots)
    qo, kvp = csr(EXT_NEW), csr(EXT_PREFIX)
    ref = extend_attention_reference(case.q, case.k_new, case.v_new, k_pool, v_pool, two_stage_meta(qo, kvp, bad))
    sanitized = two_stage_meta(qo, kvp, sanitize(bad, num_slots))
    assert_same(ref, extend_attention_reference(case.q, case.k_new, case.v_new, k_pool, v_pool, sanitized))
    assert not nan_rows(ref).any()
    kv_indptr, kv_indices = unified_lists(case)
    bad = kv_indices.copy()
    bad[[2, 30, 45, 55]] = hostile_slots(num_slots)
    ref = extend_attention_unified_reference(case.q, k_pool, v_pool, unified_meta(qo, kv_indptr, bad))
    sanitized = unified_meta(qo, kv_indptr, sanitize(bad, num_slots))
    assert_same(ref, extend_attention_unified_reference(case.q, k_pool, v_pool, sanitized))
    assert not nan_rows(ref).any()


def test_decode_reference_sizes_a_hostile_indptr_by_the_list(rng):
    # Outside jit the reference sizes its gather from the lengths it reads; a range of 2**31 - 1 keys over a 30-entry
    # list is cut at kv_capacity (it asked XLA for ~290 GB before), as every list is.
    q, k_pool, v_pool, _, slots, _ = decode_inputs(rng)
    indptr = np.array([0, 2**31 - 1, 2**31 - 1, 2**31 - 1, 2**31 - 1], np.int32)
    o = decode_attention_reference(q, k_pool, v_pool, meta_for(indptr, slots[:30]))
    assert o.shape == q.shape and not nan_rows(o).any()


def test_int64_tables_past_int32_are_not_wrapped_into_range():
    # With jax_enable_x64, int64 table entries, rows and page ids past 2**31 stay out of range when the builders narrow
    # them to int32 (saturated, not wrapped): a slot of 2**32 + 3 is not slot 3, row 2**32 + 1 not row 1, page
    # 2**32 + 1 not page 1; the kernels then read slot 0 as the references do.
    from jaxattn.paging import token_slots

    with jax.enable_x64(True):
        table = jnp.array([[2**32 + 3, 5, 6, 0], [7, 8, 9, 0]], jnp.int64)
        lens = jnp.array([3], jnp.int64)
        for row, want in ((0, [None, 5, 6, 0]), (2**32 + 1, [0, 0, 0, 0])):
            rows = jnp.array([row], jnp.int64)
            _, got = create_kv_indices(table, rows, lens, capacity=4, index_dtype=jnp.int64, mode=MODE)
            _, ref = create_kv_indices_reference(table, rows, lens, capacity=4, index_dtype=jnp.int64)
            got, ref = np.asarray(got), np.asarray(ref)
            np.testing.assert_array_equal(got[1:], want[1:])
            np.testing.assert_array_equal(ref[1:], want[1:])
            if want[0] is None:  # both outside [0, 2**31): read as slot 0 by every kernel and reference
                assert got[0] >= 2**31 - 1 and ref[0] >= 2**31 - 1, (got, ref)
            else:
                assert got[0] == ref[0] == want[0]
        slots = token_slots(jnp.array([[2**32 + 1, 2]], jnp.int64), jnp.array([0], jnp.int64),
                            jnp.arange(4, dtype=jnp.int64), 8, num_slots=64)
        np.testing.assert_array_equal(np.asarray(slots), 0)


def test_decode_metadata_hostile_tables(rng):
    q, k_pool, v_pool, indptr, slots, num_slots = decode_inputs(rng)
    lens = np.diff(indptr)
    table = np.zeros((6, 48), np.int32)
    rows = np.array([5, 1, 2, 3], np.int32)
    for b in range(4):
        table[rows[b], : lens[b]] = slots[indptr[b] : indptr[b + 1]]
    table[1, [3, 20, 39]] = hostile_slots(num_slots)[:3]
    table[3, 2] = hostile_slots(num_slots)[3]
    rows[0] = 10**6  # a request row outside the table: its keys become slot 0
    # kv_capacity below the 52 listed keys: kv_indptr ends past kv_indices (seq 3 keeps 3 of its 7 keys).
    meta = decode_metadata(jnp.asarray(table), jnp.asarray(rows), jnp.asarray(lens.astype(np.int32)), kv_capacity=48,
                           q_heads=DEC_HEADS, kv_heads=DEC_KV_HEADS, max_kv_splits=2, min_split_len=16)
    assert int(meta.kv_indptr[-1]) == 52
    o, lse = decode_attention(q, k_pool, v_pool, meta, return_lse=True, mode=MODE)
    ref_meta = dataclasses.replace(meta, kv_indptr=clamp_indptr(meta.kv_indptr, 48), kv_indices=sanitize(meta.kv_indices, num_slots))
    ref_o, ref_lse = decode_attention_reference(q, k_pool, v_pool, ref_meta, return_lse=True)
    assert not nan_rows(o).any()
    np.testing.assert_allclose(np.float32(o), np.float32(ref_o), **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)


@pytest.mark.parametrize("config", DEC_CONFIGS)
def test_decode_nan_reaches_only_its_rows(rng, config):
    q, k_pool, v_pool, indptr, slots, _ = decode_inputs(rng)
    q = q.at[0, 1].set(jnp.nan)  # seq 0, head 1 only
    k_pool = k_pool.at[slots[indptr[1] + 35]].set(jnp.nan)  # a visible key of seq 1, in its second split
    v_pool = v_pool.at[slots[indptr[3] + 2]].set(jnp.nan)  # a visible value of seq 3
    meta = meta_for(indptr, slots)
    o, lse = decode_attention(q, k_pool, v_pool, meta, config=config, return_lse=True, mode=MODE)
    ref_o = decode_attention_reference(q, k_pool, v_pool, meta)
    expected = np.array([[False, True], [True, True], [False, False], [True, True]])
    np.testing.assert_array_equal(nan_rows(o), expected)
    # NaN q or K: the LSE is NaN too (not -inf, so a merge cannot drop the row); a NaN V leaves the denominator clean.
    np.testing.assert_array_equal(np.isnan(np.asarray(lse)), expected & np.array([[True], [True], [True], [False]]))
    assert_same(o, ref_o)
    np.testing.assert_array_equal(np.float32(o[2]), 0.0)
    assert np.all(np.asarray(lse[2]) == -np.inf)


# A NaN sm_scale no longer reaches a kernel: it is rejected at trace time (test_sm_scale_is_validated_at_trace_time).


# ---------------------------------------------------------------------------------------------
# Extend

EXT_HEADS, EXT_KV_HEADS, EXT_DIM = 2, 1, 32
EXT_PREFIX = [20, 0, 9]
EXT_NEW = [18, 5, 12]  # 35 new tokens


@dataclasses.dataclass
class ExtendCase:
    q: jnp.ndarray  # [35, H, D]
    k_new: jnp.ndarray
    v_new: jnp.ndarray
    k_pool: jnp.ndarray  # the cache, new tokens' K/V written at their slots too (for the unified kernel)
    v_pool: jnp.ndarray
    prefix_slots: np.ndarray  # i32[29]
    new_slots: np.ndarray  # i32[35]
    num_slots: int


def extend_inputs(rng):
    total = sum(EXT_PREFIX) + sum(EXT_NEW)
    num_slots = total + 4
    slots = rng.permutation(np.arange(1, num_slots))[:total].astype(np.int32)
    prefix_slots, new_slots = slots[: sum(EXT_PREFIX)], slots[sum(EXT_PREFIX) :]
    tokens = sum(EXT_NEW)
    q = rng.standard_normal((tokens, EXT_HEADS, EXT_DIM)).astype(np.float32)
    k_new = rng.standard_normal((tokens, EXT_KV_HEADS, EXT_DIM)).astype(np.float32)
    v_new = rng.standard_normal((tokens, EXT_KV_HEADS, EXT_DIM)).astype(np.float32)
    k_pool = pool(rng, num_slots, EXT_KV_HEADS, EXT_DIM).at[new_slots].set(k_new)
    v_pool = pool(rng, num_slots, EXT_KV_HEADS, EXT_DIM).at[new_slots].set(v_new)
    return ExtendCase(jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new), k_pool, v_pool, prefix_slots, new_slots, num_slots)


def csr(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def two_stage_meta(qo_indptr, kv_indptr, kv_indices, mask_indptr=None):
    batch = len(qo_indptr) - 1
    return ExtendMetadata(
        qo_indptr=jnp.asarray(qo_indptr, jnp.int32), kv_indptr=jnp.asarray(kv_indptr, jnp.int32),
        kv_indices=jnp.asarray(kv_indices), kv_start_pos=jnp.zeros((batch,), jnp.int32),
        mask_indptr=None if mask_indptr is None else jnp.asarray(mask_indptr, jnp.int32),
        max_extend_len=max(EXT_NEW), kv_capacity=int(np.shape(kv_indices)[0]),
    )


def unified_lists(case):
    """CSR of the unified lists (prefix then new slots) and the prefix lengths."""
    pi, qi = csr(EXT_PREFIX), csr(EXT_NEW)
    parts = []
    for b in range(3):
        parts += [case.prefix_slots[pi[b] : pi[b + 1]], case.new_slots[qi[b] : qi[b + 1]]]
    return csr(np.add(EXT_PREFIX, EXT_NEW)), np.concatenate(parts).astype(np.int32)


def unified_meta(qo_indptr, kv_indptr, kv_indices, mask_indptr=None):
    batch = len(qo_indptr) - 1
    return ExtendUnifiedMetadata(
        qo_indptr=jnp.asarray(qo_indptr, jnp.int32), kv_indptr=jnp.asarray(kv_indptr, jnp.int32),
        kv_indices=jnp.asarray(kv_indices), prefix_lens=jnp.asarray(EXT_PREFIX, jnp.int32),
        kv_start_pos=jnp.zeros((batch,), jnp.int32),
        mask_indptr=None if mask_indptr is None else jnp.asarray(mask_indptr, jnp.int32),
        max_extend_len=max(EXT_NEW), kv_capacity=int(np.shape(kv_indices)[0]),
    )


def test_extend_two_stage_hostile_indices(rng):
    case = extend_inputs(rng)
    bad = case.prefix_slots.copy()
    bad[[2, 7, 21, 25]] = hostile_slots(case.num_slots)
    rows = 31  # q/k_new/v_new have 31 rows: seq 2's new tokens [23, 35) point past them
    capacity = 26  # kv_indices is cut short: seq 2's prefix [20, 29) points past it
    qo = csr(EXT_NEW)
    hostile_qo = qo.copy()
    hostile_qo[0] = -2  # a negative start: seq 0 is [0, 18)
    q, k_new, v_new = case.q[:rows], case.k_new[:rows], case.v_new[:rows]
    meta = two_stage_meta(hostile_qo, csr(EXT_PREFIX), bad[:capacity])
    o = extend_attention(q, k_new, v_new, case.k_pool, case.v_pool, meta, config=SMALL, impl="triton", mode=MODE)
    assert o.shape == (rows, EXT_HEADS, EXT_DIM)
    ref_meta = two_stage_meta(qo, clamp_indptr(csr(EXT_PREFIX), capacity), sanitize(bad[:capacity], case.num_slots))
    ref = extend_attention_reference(q, k_new, v_new, case.k_pool, case.v_pool, ref_meta)
    assert not nan_rows(o).any()
    np.testing.assert_allclose(np.float32(o), np.float32(ref), **TOL)


def short_mask(rng, widths, cut):
    """A random per-sequence row-major mask ([q_len, width] each), its indptr, the kept prefix `mask[:cut]`, and the
    zero-padded version the reference reads (entries past the cut are "not visible")."""
    lens = np.multiply(EXT_NEW, widths)
    indptr = csr(lens)
    mask = rng.random(int(lens.sum())) < 0.6
    indptr[1] += 1000  # seq 1's rows start past the mask's end: nothing visible (output 0)
    full = np.zeros(int(np.max(indptr[:-1] + lens)) + 1, bool)
    full[:cut] = mask[:cut]
    return indptr, jnp.asarray(mask[:cut]), jnp.asarray(full)


def test_extend_two_stage_short_custom_mask(rng):
    case = extend_inputs(rng)
    widths = np.add(EXT_PREFIX, EXT_NEW)
    mask_indptr, mask, padded = short_mask(rng, widths, cut=18 * 38 + 5 * 5 + 40)  # seq 2's rows end past the cut
    meta = two_stage_meta(csr(EXT_NEW), csr(EXT_PREFIX), case.prefix_slots, mask_indptr)
    o = extend_attention(case.q, case.k_new, case.v_new, case.k_pool, case.v_pool, meta, custom_mask=mask,
                         skip_prefix_custom_mask=False, config=SMALL, impl="triton", mode=MODE)
    ref = extend_attention_reference(case.q, case.k_new, case.v_new, case.k_pool, case.v_pool, meta, custom_mask=padded,
                                     skip_prefix_custom_mask=False)
    assert not nan_rows(o).any()
    np.testing.assert_allclose(np.float32(o), np.float32(ref), **TOL)
    np.testing.assert_array_equal(np.float32(o[18:23]), 0.0)


def test_extend_unified_hostile_indices(rng):
    case = extend_inputs(rng)
    kv_indptr, kv_indices = unified_lists(case)
    bad = kv_indices.copy()
    bad[[2, 30, 45, 55]] = hostile_slots(case.num_slots)  # prefix and new-token entries of seqs 0 and 2
    rows, capacity = 31, 60  # q ends inside seq 2's rows [23, 35); kv_indices inside seq 2's list [43, 64)
    qo = csr(EXT_NEW)
    meta = unified_meta(qo, kv_indptr, bad[:capacity])
    o = extend_attention_unified(case.q[:rows], case.k_pool, case.v_pool, meta, config=SMALL, mode=MODE)
    assert o.shape == (rows, EXT_HEADS, EXT_DIM)
    assert not nan_rows(o).any()
    # Seq 2's 8 remaining rows (positions 9..16) see only its first 17 keys, all before the cut: the reference on
    # the sanitized list, its 4 cut entries read as slot 0 (causally masked for every remaining row).
    ref_meta = unified_meta(qo, kv_indptr, np.concatenate([sanitize(bad[:capacity], case.num_slots), np.zeros(4, np.int32)]))
    ref = extend_attention_unified_reference(case.q[:rows], case.k_pool, case.v_pool, ref_meta)
    np.testing.assert_allclose(np.float32(o), np.float32(ref), **TOL)


def test_extend_unified_short_custom_mask(rng):
    case = extend_inputs(rng)
    kv_indptr, kv_indices = unified_lists(case)
    widths = np.add(EXT_PREFIX, EXT_NEW)
    mask_indptr, mask, padded = short_mask(rng, widths, cut=18 * 38 + 5 * 5 + 40)
    meta = unified_meta(csr(EXT_NEW), kv_indptr, kv_indices, mask_indptr)
    o = extend_attention_unified(case.q, case.k_pool, case.v_pool, meta, custom_mask=mask, config=SMALL, mode=MODE)
    ref = extend_attention_unified_reference(case.q, case.k_pool, case.v_pool, meta, custom_mask=padded)
    assert not nan_rows(o).any()
    np.testing.assert_allclose(np.float32(o), np.float32(ref), **TOL)
    np.testing.assert_array_equal(np.float32(o[18:23]), 0.0)


@pytest.mark.parametrize("kernel", ["two_stage", "unified"])
def test_extend_nan_reaches_only_its_rows(rng, kernel):
    case = extend_inputs(rng)
    q = case.q.at[3, 0].set(jnp.nan)  # seq 0, token 3, head 0 only
    # Seq 0's new token 10: a NaN key. Its rows 0..9 cannot see it (listed, causally masked: must stay clean),
    # rows 10..17 can. Seq 2: a NaN value in its prefix, visible to all its rows.
    k_new, k_pool, v_pool = case.k_new.at[10].set(jnp.nan), case.k_pool.at[case.new_slots[10]].set(jnp.nan), case.v_pool
    v_pool = v_pool.at[case.prefix_slots[20 + 4]].set(jnp.nan)
    expected = np.zeros((35, 2), bool)
    expected[3, 0] = True
    expected[10:18] = True
    expected[23:35] = True
    qo = csr(EXT_NEW)
    if kernel == "two_stage":
        meta = two_stage_meta(qo, csr(EXT_PREFIX), case.prefix_slots)
        two_stage_pool = case.k_pool  # the two-stage kernel reads new tokens from k_new; the pool's copy stays finite
        o = extend_attention(q, k_new, case.v_new, two_stage_pool, v_pool, meta, config=SMALL, impl="triton", mode=MODE)
        ref = extend_attention_reference(q, k_new, case.v_new, two_stage_pool, v_pool, meta)
    else:
        kv_indptr, kv_indices = unified_lists(case)
        meta = unified_meta(qo, kv_indptr, kv_indices)
        o = extend_attention_unified(q, k_pool, v_pool, meta, config=SMALL, mode=MODE)
        ref = extend_attention_unified_reference(q, k_pool, v_pool, meta)
    np.testing.assert_array_equal(nan_rows(o), expected)
    assert_same(o, ref)


# ---------------------------------------------------------------------------------------------
# Index builders and merge_state


def test_create_kv_indices_hostile_lengths_and_starts():
    table = jnp.asarray(np.arange(1, 4 * 8 + 1, dtype=np.int32).reshape(4, 8))
    rows = jnp.asarray([0, 1, 99, -1], jnp.int32)
    lens = jnp.asarray([3, 2**30, 2, 4], jnp.int32)  # seq 1 alone is far longer than the list
    starts = jnp.asarray([0, -5, 2**31 - 1, 1], jnp.int32)
    got = create_kv_indices(table, rows, lens, starts, capacity=16, mode=MODE)
    want = create_kv_indices_reference(table, rows, lens, starts, capacity=16)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # Lengths whose running total overflows int32 (a negative kv_indptr): nothing is written out of place.
    _, indices = create_kv_indices(table, rows[:3], jnp.full((3,), 2**30, jnp.int32), capacity=16, mode=MODE)
    np.testing.assert_array_equal(np.asarray(indices), np.r_[np.arange(1, 9), np.zeros(8)].astype(np.int32))


def test_build_unified_kv_indices_hostile_offsets():
    prefix_indptr = jnp.asarray([0, 4, 30], jnp.int32)  # seq 1's prefix runs past the 10 prefix entries
    prefix_indices = jnp.arange(100, 110, dtype=jnp.int32)
    starts = jnp.asarray([0, 50], jnp.int32)  # seq 1's new slots start past out_cache_loc
    lens = jnp.asarray([3, 3], jnp.int32)
    new = jnp.arange(200, 206, dtype=jnp.int32)
    got = build_unified_kv_indices(prefix_indptr, prefix_indices, starts, lens, new, capacity=20, mode=MODE)
    want = build_unified_kv_indices_reference(prefix_indptr, prefix_indices, starts, lens, new, capacity=20)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_merge_state_nan_states_stay_nan(rng):
    o1 = jnp.asarray(rng.standard_normal((4, 2, 16)).astype(np.float32))
    o2 = jnp.asarray(rng.standard_normal((4, 2, 16)).astype(np.float32))
    lse1 = jnp.asarray(rng.standard_normal((4, 2)).astype(np.float32))
    lse2 = jnp.asarray(rng.standard_normal((4, 2)).astype(np.float32))
    lse2 = lse2.at[1, 0].set(jnp.nan)  # a NaN state next to a clean one
    lse1, lse2 = lse1.at[0, 1].set(-jnp.inf), lse2.at[0, 1].set(jnp.nan)  # a NaN state next to an empty one
    o1 = o1.at[2, 1].set(jnp.nan)  # NaN output with a finite LSE
    lse1, lse2 = lse1.at[3, 0].set(-jnp.inf), lse2.at[3, 0].set(-jnp.inf)  # both empty
    o1 = o1.at[3, 0].set(jnp.nan)
    o, lse = merge_state(o1, lse1, o2, lse2, mode=MODE)
    expected = np.zeros((4, 2), bool)
    expected[1, 0] = expected[0, 1] = expected[2, 1] = True
    np.testing.assert_array_equal(nan_rows(o), expected)
    assert np.isnan(np.asarray(lse)[1, 0]) and np.isnan(np.asarray(lse)[0, 1])
    np.testing.assert_array_equal(np.asarray(o[3, 0]), 0.0)
    assert np.asarray(lse)[3, 0] == -np.inf
    ref_o, ref_lse = merge_state_reference(o1, lse1, o2, lse2)
    clean = ~expected
    np.testing.assert_allclose(np.asarray(o)[clean], np.asarray(ref_o)[clean], **TOL)
    np.testing.assert_allclose(np.asarray(lse)[clean], np.asarray(ref_lse)[clean], **TOL)


# ---------------------------------------------------------------------------------------------
# Host-side classes of issue 21: narrowing, fp8 saturation, scalars, NaN through the reference, layer facts.


def test_write_kv_drops_host_slots_past_int32_instead_of_wrapping():
    # Narrowed to int32 on the way to the device, 2**32 + 3 would become slot 3; it is out of range: dropped.
    k_pool, v_pool = jnp.ones((8, 1, 4)), jnp.ones((8, 1, 4))
    new = jnp.full((3, 1, 4), 7.0)
    k2, v2 = write_kv(k_pool, v_pool, np.array([2**32 + 3, -1, 5], np.int64), new, new)
    np.testing.assert_array_equal(np.asarray(k2)[:, 0, 0], [1, 1, 1, 1, 1, 7, 1, 1])
    np.testing.assert_array_equal(np.asarray(v2)[:, 0, 0], [1, 1, 1, 1, 1, 7, 1, 1])


@pytest.mark.parametrize("fp8", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3fn", "e5m2"])
def test_fp8_writes_saturate_and_keep_nan(fp8):
    k_pool, v_pool = jnp.zeros((4, 1, 4), fp8), jnp.zeros((4, 1, 4), fp8)
    new = jnp.asarray([[[1e9, -1e9, jnp.inf, jnp.nan]]], jnp.float32)
    k2, _ = write_kv(k_pool, v_pool, jnp.asarray([2], jnp.int32), new, new, k_scale=0.5)
    stored = np.asarray(k2.astype(jnp.float32))[2, 0]
    largest = float(jnp.finfo(fp8).max)
    np.testing.assert_array_equal(stored[:3], [largest, -largest, largest])
    assert np.isnan(stored[3])


@pytest.mark.parametrize("sm_scale", [0.0, -0.125, float("nan"), float("inf")])
def test_sm_scale_is_validated_at_trace_time(sm_scale):
    q, k_pool, v_pool, meta = _tiny_decode()
    for op in (decode_attention, decode_attention_reference):
        with pytest.raises(ValueError, match="sm_scale must be None"):
            op(q, k_pool, v_pool, meta, sm_scale=sm_scale)


@pytest.mark.parametrize("bad", [dict(logit_cap=-1.0), dict(sliding_window=-3), dict(sm_scale=-1.0),
                                 dict(xai_temperature_len=1), dict(k_scale=0.0), dict(head_dim=8)],
                         ids=lambda d: next(iter(d)))
def test_attention_layer_rejects_what_any_backend_would(bad):
    # ReferenceBackend used to accept a negative cap or window that TritonBackend rejected: the layer checks once.
    fields = dict(layer_id=0, q_heads=4, kv_heads=2, head_dim=16) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        AttentionLayer(**fields)


def test_nan_sink_gives_nan_in_the_reference_not_an_unnormalised_row():
    q, k_pool, v_pool, meta = _tiny_decode()
    sinks = jnp.asarray([0.5, jnp.nan, 0.0, -1.0], jnp.float32)
    o = np.asarray(decode_attention_reference(q, k_pool, v_pool, meta, sinks=sinks))
    assert np.isnan(o[:, 1]).all() and np.isfinite(o[:, [0, 2, 3]]).all()


def _tiny_decode():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
    k_pool = jnp.asarray(rng.standard_normal((10, 2, 16)), jnp.float32)
    v_pool = jnp.asarray(rng.standard_normal((10, 2, 16)), jnp.float32)
    meta = decode_metadata_from_indptr(jnp.asarray([0, 3, 5], jnp.int32), jnp.asarray([1, 2, 3, 4, 5], jnp.int32),
                                       q_heads=4, kv_heads=2)
    return q, k_pool, v_pool, meta


def test_checked_mode_reports_custom_mask_offsets_past_int32():
    # 64 sequences x 256 drafts over 140k keys: 2.3e9 mask entries, past what int32 offsets can address.
    rows = jnp.arange(64, dtype=jnp.int32)
    req_to_token = jnp.zeros((64, 140_544), jnp.int32)
    prefix, extend = jnp.full(64, 140_288, jnp.int32), jnp.full(64, 256, jnp.int32)

    def step(prefix, extend):
        validate_extend_inputs(req_to_token, rows, prefix, extend, num_slots=1, max_extend_len=256, custom_mask=True)
        return jnp.int32(0)

    with pytest.raises(ValueError, match="past int32 offsets"):
        checked(step)(prefix, extend)
    checked(step)(prefix, jnp.full(64, 8, jnp.int32))  # 72M entries: fine


@pytest.mark.parametrize("kernel", ["two_stage", "unified"])
def test_a_row_that_sees_no_key_gives_zeros_even_beside_a_masked_nan_value(kernel):
    # A custom mask hides both keys from query row 0; key 1's V is NaN, and row 1 sees it. p = 0 times NaN must not
    # reach row 0 (no visible key: zeros), while row 1 is NaN (NaN in is NaN out), in the kernel and the reference.
    table = jnp.arange(1, 17, dtype=jnp.int32).reshape(2, 8)
    q = jnp.asarray(np.random.default_rng(0).standard_normal((2, 2, 16)), jnp.float32)
    k_new = jnp.ones((2, 1, 16), jnp.float32)
    v_new = jnp.ones((2, 1, 16), jnp.float32).at[1].set(jnp.nan)
    k_pool, v_pool = jnp.ones((17, 1, 16), jnp.float32), jnp.ones((17, 1, 16), jnp.float32)
    mask = jnp.asarray([False, False, True, True])  # [q_len 2, kv_len 2], row-major
    if kernel == "two_stage":
        meta = extend_metadata(table, jnp.asarray([0], jnp.int32), jnp.asarray([0], jnp.int32),
                               jnp.asarray([2], jnp.int32), max_extend_len=2, kv_capacity=1)
        o = extend_attention(q, k_new, v_new, k_pool, v_pool, meta, custom_mask=mask, impl="triton", mode=MODE)
        ref = extend_attention_reference(q, k_new, v_new, k_pool, v_pool, meta, custom_mask=mask)
    else:
        k_pool, v_pool = k_pool.at[1:3].set(k_new), v_pool.at[1:3].set(v_new)
        meta = extend_unified_metadata(table, jnp.asarray([0], jnp.int32), jnp.asarray([0], jnp.int32),
                                       jnp.asarray([2], jnp.int32), jnp.asarray([1, 2], jnp.int32), max_extend_len=2,
                                       kv_capacity=2)
        o = extend_attention_unified(q, k_pool, v_pool, meta, custom_mask=mask, mode=MODE)
        ref = extend_attention_unified_reference(q, k_pool, v_pool, meta, custom_mask=mask)
    for out in (o, ref):
        np.testing.assert_array_equal(np.float32(out[0]), 0.0)
        assert np.isnan(np.float32(out[1])).all()


def test_an_infinite_sink_gives_nan_in_the_kernel_and_the_reference():
    q, k_pool, v_pool, meta = _tiny_decode()
    sinks = jnp.asarray([0.5, jnp.inf, 0.0, -jnp.inf], jnp.float32)  # -inf: no sink, a normal row
    for o in (decode_attention(q, k_pool, v_pool, meta, sinks=sinks, mode=MODE),
              decode_attention_reference(q, k_pool, v_pool, meta, sinks=sinks)):
        o = np.asarray(o)
        assert np.isnan(o[:, 1]).all() and np.isfinite(o[:, [0, 2, 3]]).all()
    plain = np.asarray(decode_attention_reference(q, k_pool, v_pool, meta))
    np.testing.assert_allclose(np.asarray(decode_attention_reference(q, k_pool, v_pool, meta, sinks=sinks))[:, 3],
                               plain[:, 3], rtol=1e-6)


def test_references_take_zero_tokens_as_the_kernels_do():
    table = jnp.arange(1, 17, dtype=jnp.int32).reshape(2, 8)
    meta = extend_metadata(table, jnp.asarray([0, 1], jnp.int32), jnp.asarray([2, 2], jnp.int32),
                           jnp.asarray([0, 0], jnp.int32), max_extend_len=1, kv_capacity=8)
    q, k = jnp.zeros((0, 2, 16)), jnp.zeros((0, 1, 16))
    pool_ = jnp.ones((17, 1, 16))
    for o in (extend_attention_reference(q, k, k, pool_, pool_, meta),
              extend_attention(q, k, k, pool_, pool_, meta, impl="triton", mode=MODE)):
        assert o.shape == (0, 2, 16)
