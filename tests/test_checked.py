"""Checked mode (jaxattn.checked): each bad value is caught at run time with a message naming it; good batches pass;
the metadata validators hand back indices that stay inside the pool."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from jaxattn.checked import (
    checked,
    validate_decode_inputs,
    validate_decode_metadata,
    validate_extend_inputs,
    validate_extend_metadata,
    validate_verify_drafts,
    validate_kv_scales,
    validate_write_slots,
)
from jaxattn.decode import decode_attention, decode_attention_reference, decode_metadata, decode_metadata_from_indptr
from jaxattn.extend import (
    extend_attention_unified,
    extend_attention_unified_reference,
    extend_metadata,
    extend_unified_metadata,
)
from jaxattn.kv_pool import write_kv
from jaxattn.paging import PageTable

SLOTS, MAX_REQS, MAX_CTX = 16, 3, 8


def i32(*values):
    return jnp.asarray(values, jnp.int32)


def table():
    """Three request rows of slots 1..15 (row 2 ends with slots past the real tokens, all in range)."""
    t = np.zeros((MAX_REQS, MAX_CTX), np.int32)
    t[0, :5] = [3, 4, 5, 6, 7]
    t[1, :3] = [9, 10, 11]
    t[2, :6] = [1, 2, 8, 12, 13, 14]
    return t


def run(fn, *args):
    """fn checkified and jitted; raises on a failed check."""
    return checked(fn)(*args)


def decode_inputs(t=None, rows=(0, 2), lens=(5, 4), **kw):
    t = table() if t is None else t
    kw.setdefault("num_slots", SLOTS)
    return lambda: validate_decode_inputs(jnp.asarray(t), i32(*rows), i32(*lens), **kw)


def extend_inputs(t=None, rows=(0, 1), prefix=(2, 1), extend=(3, 2), **kw):
    t = table() if t is None else t
    kw.setdefault("num_slots", SLOTS)
    kw.setdefault("max_extend_len", 4)
    return lambda: validate_extend_inputs(jnp.asarray(t), i32(*rows), i32(*prefix), i32(*extend), **kw)


def with_entry(row, pos, value):
    t = table()
    t[row, pos] = value
    return t


PAGE, PAGED_SLOTS = 8, 64  # pages 1..7 (page 0 is padding)


def page_table(row=None, column=None, value=None):
    """Three request rows of two 8-slot pages each: row 0 pages 3, 5; row 1 page 2 (then padding); row 2 pages 7, 1.
    With row/column/value, that entry replaced."""
    pages = np.array([[3, 5], [2, 0], [7, 1]], np.int32)
    if row is not None:
        pages[row, column] = value
    return PageTable(jnp.asarray(pages), page_size=PAGE, num_slots=PAGED_SLOTS)


def paged_decode_inputs(table=None, rows=(0, 2), lens=(12, 9), **kw):
    table = page_table() if table is None else table
    return lambda: validate_decode_inputs(table, i32(*rows), i32(*lens), num_slots=PAGED_SLOTS, **kw)


def paged_extend_inputs(table=None, rows=(0, 1), prefix=(9, 1), extend=(3, 2), **kw):
    table = page_table() if table is None else table
    return lambda: validate_extend_inputs(table, i32(*rows), i32(*prefix), i32(*extend), num_slots=PAGED_SLOTS,
                                          max_extend_len=4, **kw)


BAD = [
    # (id, validation, regex naming the argument)
    ("paged/decode/padding-page", paged_decode_inputs(page_table(0, 1, 0)),
     r"req_to_page\[req_pool_indices\[0\], 1\] = 0 is not a page of the pool \[1, 8\)"),
    ("paged/decode/page-past-pool", paged_decode_inputs(page_table(2, 0, 8)),
     r"req_to_page\[req_pool_indices\[1\], 0\] = 8 is not a page of the pool"),
    ("paged/decode/seq_lens-past-pages", paged_decode_inputs(lens=(17, 9)), r"seq_lens\[0\] = 17 exceeds max_context_len"),
    ("paged/extend/new-tokens-page", paged_extend_inputs(page_table(1, 0, -3)),
     r"req_to_page\[req_pool_indices\[1\], 0\] = -3 is not a page of the pool"),
    ("decode/seq_lens-negative", decode_inputs(lens=(5, -2)), r"seq_lens\[1\] = -2 is negative"),
    ("decode/seq_lens-past-context", decode_inputs(lens=(9, 4)), r"seq_lens\[0\] = 9 exceeds max_context_len"),
    ("decode/req_pool_indices", decode_inputs(rows=(0, 7)), r"req_pool_indices\[1\] = 7 is outside req_to_token's rows \[0, 3\)"),
    ("decode/req_pool_indices-negative", decode_inputs(rows=(-1, 2)), r"req_pool_indices\[0\] = -1 is outside"),
    ("decode/req_to_token-slot", decode_inputs(t=with_entry(2, 3, 99)), r"req_to_token\[req_pool_indices\[1\], 3\] = 99 is outside the pool \[0, 16\)"),
    ("decode/req_to_token-negative", decode_inputs(t=with_entry(0, 0, -5)), r"req_to_token\[req_pool_indices\[0\], 0\] = -5 is outside the pool"),
    ("decode/kv_capacity", decode_inputs(kv_capacity=8), r"the batch lists 9 keys, more than kv_capacity \(8\)"),
    ("decode/out_cache_loc-range", decode_inputs(out_cache_loc=i32(7, 16)), r"out_cache_loc\[1\] = 16 is outside the pool \[0, 16\)"),
    ("decode/out_cache_loc-repeat", decode_inputs(out_cache_loc=i32(7, 7)), r"out_cache_loc names slot 7 twice \(only the padding slot 0 may repeat\)"),
    ("extend/prefix_lens-negative", extend_inputs(prefix=(2, -1)), r"prefix_lens\[1\] = -1 is negative"),
    ("extend/extend_lens-negative", extend_inputs(extend=(-3, 2)), r"extend_lens\[0\] = -3 is negative"),
    ("extend/extend_lens-bucket", extend_inputs(extend=(3, 2), max_extend_len=2), r"extend_lens\[0\] = 3 exceeds the max_extend_len bucket \(2\)"),
    ("extend/max_context_len", extend_inputs(prefix=(2, 5), extend=(3, 4), max_extend_len=8), r"prefix_lens\[1\] \+ extend_lens\[1\] = 9 exceeds max_context_len \(8"),
    ("extend/req_pool_indices", extend_inputs(rows=(0, 3)), r"req_pool_indices\[1\] = 3 is outside req_to_token's rows"),
    ("extend/req_to_token-prefix", extend_inputs(t=with_entry(0, 1, 16)), r"req_to_token\[req_pool_indices\[0\], 1\] = 16 is outside the pool"),
    ("extend/req_to_token-new", extend_inputs(t=with_entry(1, 2, 40)), r"req_to_token\[req_pool_indices\[1\], 2\] = 40 is outside the pool"),
    ("extend/kv_capacity-unified", extend_inputs(kv_capacity=7, unified=True), r"the batch lists 8 keys, more than kv_capacity \(7\)"),
    ("extend/kv_capacity", extend_inputs(kv_capacity=2), r"the batch lists 3 keys, more than kv_capacity \(2\)"),
    ("extend/num_tokens", extend_inputs(num_tokens=4), r"extend_lens add up to 5 tokens, more than q's rows \(4\)"),
    ("extend/out_cache_loc-short", extend_inputs(out_cache_loc=i32(5, 6, 7, 10)), r"more than out_cache_loc holds \(4\)"),
    ("extend/out_cache_loc-repeat", extend_inputs(out_cache_loc=i32(5, 6, 7, 10, 6)), r"out_cache_loc names slot 6 twice"),
    ("write/out_cache_loc", lambda: validate_write_slots(i32(0, -1), SLOTS), r"out_cache_loc\[1\] = -1 is outside the pool"),
    ("scales/inf", lambda: validate_kv_scales(jnp.asarray([0.5, jnp.inf])), r"k_scale\[1\] = inf: a scale must be finite and > 0"),
    ("scales/nan", lambda: validate_kv_scales(0.5, jnp.asarray(jnp.nan)), r"v_scale\[0\] = nan: a scale must be finite"),
    ("scales/zero", lambda: validate_kv_scales(None, jnp.asarray([1.0, 0.0], jnp.bfloat16)), r"v_scale\[1\] = 0.0"),
    ("verify/drafts", lambda: validate_verify_drafts(i32(4, 3), i32(9, 7), 4), r"extend_lens\[1\] = 3 \(seq_lens 7\)"),
    ("verify/padding", lambda: validate_verify_drafts(i32(4, 4), i32(9, 0), 4), r"extend_lens\[1\] = 4 \(seq_lens 0\)"),
    ("verify/short", lambda: validate_verify_drafts(i32(4, 4), i32(9, 2), 4), r"seq_lens\[1\] = 2 is shorter than the 4"),
    ("verify/padding-first", lambda: validate_verify_drafts(i32(0, 4), i32(0, 9), 4), r"seq_lens\[1\] = 9 follows a padding"),
]

GOOD = [
    ("paged/decode", paged_decode_inputs(kv_capacity=21)),
    # A window lists keys 8..11 of row 0 (its second page only), and row 1's padding page is past its tokens.
    ("paged/decode/window", paged_decode_inputs(page_table(0, 0, 0), sliding_window=3)),
    ("paged/extend", paged_extend_inputs(kv_capacity=17, unified=True)),
    ("decode", decode_inputs(kv_capacity=9, out_cache_loc=i32(7, 14))),
    # A padding row (length 0) may name any request row, and the table past a sequence's end is never read.
    ("decode/padding-row", decode_inputs(t=with_entry(0, 6, -7), rows=(0, 2, 99), lens=(5, 4, 0), kv_capacity=9)),
    # A window lists only the last W + 1 keys: a bad entry before it is never read.
    ("decode/window", decode_inputs(t=with_entry(0, 0, 99), sliding_window=3)),
    ("decode/padding-slot-repeats", decode_inputs(out_cache_loc=i32(0, 7, 0, 0))),
    ("extend", extend_inputs(kv_capacity=8, unified=True, num_tokens=5, out_cache_loc=i32(5, 6, 7, 10, 11, 0, 0))),
    ("extend/window", extend_inputs(t=with_entry(0, 0, 99), sliding_window=1)),
    ("extend/empty-rows", extend_inputs(rows=(0, 50), prefix=(2, 0), extend=(3, 0))),
    ("write", lambda: validate_write_slots(i32(0, 0, 15, 1), SLOTS)),
    ("scales", lambda: validate_kv_scales(jnp.asarray([0.5, 2.0]), jnp.asarray(1.5))),
    ("verify", lambda: validate_verify_drafts(i32(4, 4, 0), i32(9, 4, 0), 4)),
]


@pytest.mark.parametrize("validation, message", [pytest.param(v, m, id=i) for i, v, m in BAD])
def test_bad_value_is_caught(validation, message):
    with pytest.raises(checkify.JaxRuntimeError, match=message) as info:
        run(validation)
    assert "jaxattn checked mode: " in str(info.value) or "out_cache_loc names slot" in str(info.value)
    assert issubclass(checkify.JaxRuntimeError, ValueError)


@pytest.mark.parametrize("validation", [pytest.param(v, id=i) for i, v in GOOD])
def test_good_values_pass(validation):
    run(validation)


def test_a_page_table_must_page_the_pool_it_is_checked_against():
    with pytest.raises(ValueError, match=r"num_slots \(32\) must be the PageTable's num_slots \(64\)"):
        validate_decode_inputs(page_table(), i32(0), i32(3), num_slots=32)


def decode_meta():
    return decode_metadata(jnp.asarray(table()), i32(0, 2), i32(5, 4), kv_capacity=12, q_heads=2, kv_heads=1, max_kv_splits=2)


def check_meta(validate, meta, **kw):
    """(error, validated meta) from a checkified validator."""
    return jax.jit(checkify.checkify(lambda m: validate(m, num_slots=SLOTS, **kw)))(meta)


def test_decode_metadata_checks_and_sanitizes():
    meta = decode_meta()
    err, same = check_meta(validate_decode_metadata, meta)
    assert err.get() is None
    np.testing.assert_array_equal(same.kv_indices, meta.kv_indices)
    bad = dataclasses.replace(meta, kv_indices=meta.kv_indices.at[6].set(16).at[2].set(-3).at[10].set(999))
    err, fixed = check_meta(validate_decode_metadata, bad)
    assert "kv_indices entry 2 (flat) = -3 is outside the pool [0, 16)" in err.get()
    # Listed entries out of range become the padding slot 0; entries past the total (10 of 9) are left alone.
    want = np.asarray(bad.kv_indices).copy()
    want[[2, 6]] = 0
    np.testing.assert_array_equal(fixed.kv_indices, want)
    assert int(fixed.kv_indices[10]) == 999
    cases = [
        (dataclasses.replace(meta, kv_indptr=i32(0, 5, 3)), r"kv_indptr decreases at 1: kv_indptr\[1\] = 5 > kv_indptr\[2\] = 3"),
        (dataclasses.replace(meta, kv_indptr=i32(0, 5, 13)), r"kv_indptr\[-1\] = 13 exceeds kv_capacity \(12\)"),
        (dataclasses.replace(meta, kv_indptr=i32(1, 5, 9)), r"kv_indptr\[0\] = 1 must be 0"),
        (dataclasses.replace(meta, seq_lens=i32(5, 3)), r"seq_lens\[1\] = 3 is shorter than its KV list \(4 keys\)"),
        # A list longer than the static bound the jitted reference gathers up to (decode_metadata's max_context_len).
        (dataclasses.replace(meta, max_kv_len=4), r"kv_lens\[0\] = 5 exceeds the metadata's max_kv_len \(4\)"),
    ]
    for bad, message in cases:
        err, _ = check_meta(validate_decode_metadata, bad)
        assert err.get() is not None and re.search(message, err.get()), (message, err.get())


def test_extend_metadata_checks():
    args = (jnp.asarray(table()), i32(0, 1), i32(2, 1), i32(3, 2))
    meta = extend_metadata(*args, max_extend_len=4, kv_capacity=8)
    unified = extend_unified_metadata(*args, i32(5, 6, 7, 10, 11), max_extend_len=4, kv_capacity=8)
    for m in (meta, unified):
        err, _ = check_meta(validate_extend_metadata, m, num_tokens=5)
        assert err.get() is None
    cases = [
        (meta, dict(num_tokens=4), r"qo_indptr\[-1\] = 5 exceeds q's rows \(num_tokens\) \(4\)"),
        (dataclasses.replace(meta, max_extend_len=2), {}, r"query counts .*\[0\] = 3 exceeds max_extend_len \(2\)"),
        (dataclasses.replace(meta, kv_start_pos=i32(0, -1)), {}, r"kv_start_pos\[1\] = -1 is negative"),
        (dataclasses.replace(meta, kv_indices=meta.kv_indices.at[1].set(77)), {}, r"kv_indices entry 1 .* = 77 is outside the pool"),
        (dataclasses.replace(meta, mask_indptr=i32(0, 15, 14)), {}, r"mask_indptr decreases at 1"),
        (dataclasses.replace(unified, prefix_lens=i32(2, 2)), {}, r"prefix_lens\[1\] = 2 does not fit its list: 3 keys listed for 2 queries"),
        (dataclasses.replace(unified, kv_indices=unified.kv_indices.at[7].set(16)), {}, r"kv_indices entry 7 .* = 16 is outside"),
    ]
    for bad, kw, message in cases:
        err, _ = check_meta(validate_extend_metadata, bad, **kw)
        assert err.get() is not None and re.search(message, err.get()), (message, err.get())


def test_extend_metadata_whole_pages_checked():
    # meta.page_size's promise (what the Hopper kernel copies as blocks): each list's paged keys run from a multiple
    # of the page size, one slot after another; the unified lists' new tokens (the caller's slots) are not paged.
    t = np.zeros((MAX_REQS, MAX_CTX), np.int32)
    t[0, :5] = [8, 9, 10, 11, 12]
    t[1, :3] = [8, 9, 10]  # sequence 1 shares sequence 0's page
    args = (jnp.asarray(t), i32(0, 1), i32(4, 2), i32(1, 1))
    meta = dataclasses.replace(extend_metadata(*args, max_extend_len=2, kv_capacity=8), page_size=8)
    unified = dataclasses.replace(extend_unified_metadata(*args, i32(13, 3), max_extend_len=2, kv_capacity=8),
                                  page_size=8)
    for m in (meta, unified):
        err, _ = check_meta(validate_extend_metadata, m)
        assert err.get() is None
    cases = [(dataclasses.replace(meta, kv_indices=meta.kv_indices.at[2].set(12)), r"kv_indices\[2\] = 12 breaks meta.page_size = 8"),
             (dataclasses.replace(meta, kv_indices=meta.kv_indices.at[4].set(9)), r"kv_indices\[4\] = 9 breaks .* \(key 0 of"),
             (dataclasses.replace(unified, kv_indices=unified.kv_indices.at[6].set(1)), r"kv_indices\[6\] = 1 breaks")]
    for bad, message in cases:
        err, _ = check_meta(validate_extend_metadata, bad)
        assert err.get() is not None and re.search(message, err.get()), (message, err.get())


def test_checked_step_runs_kernels_and_reports(rng):
    """A whole decode step, jit + checkify + donation, through the interpreted kernels: a good batch gives the
    reference's result, and a batch whose table names a slot past the pool raises after a step that stayed in range."""
    q_heads, kv_heads, dim = 2, 1, 16
    k_pool = jnp.asarray(rng.standard_normal((SLOTS, kv_heads, dim)), jnp.float32)
    v_pool = jnp.asarray(rng.standard_normal((SLOTS, kv_heads, dim)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, q_heads, dim)), jnp.float32)

    def step(cache, req_to_token, rows, seq_lens, out_cache_loc, q, k_new, v_new):
        validate_decode_inputs(req_to_token, rows, seq_lens, num_slots=SLOTS, kv_capacity=12, out_cache_loc=out_cache_loc)
        k_buf, v_buf = write_kv(*cache, out_cache_loc, k_new, v_new)
        meta = decode_metadata(req_to_token, rows, seq_lens, kv_capacity=12, q_heads=q_heads, kv_heads=kv_heads, max_kv_splits=2, mode="interpret")
        meta = validate_decode_metadata(meta, num_slots=SLOTS)
        return decode_attention(q, k_buf, v_buf, meta, mode="interpret"), decode_attention_reference(q, k_buf, v_buf, meta), (k_buf, v_buf)

    step = checked(step, donate_argnums=0)
    new = jnp.asarray(rng.standard_normal((2, kv_heads, dim)), jnp.float32)
    args = (jnp.asarray(table()), i32(0, 2), i32(5, 4), i32(7, 12), q, new, new)
    o, ref, cache = step((jnp.array(k_pool), jnp.array(v_pool)), *args)
    np.testing.assert_allclose(o, ref, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(cache[0][7], new[0])
    with pytest.raises(checkify.JaxRuntimeError, match=r"req_to_token\[req_pool_indices\[1\], 2\] = 20 is outside the pool"):
        step(cache, jnp.asarray(with_entry(2, 2, 20)), *args[1:])


def test_checked_extend_step_and_window_start_bucket():
    """extend_attention_unified under checked(): a bucket overflow (extend longer than max_extend_len) is reported."""
    q_heads, kv_heads, dim = 2, 1, 16
    rng = np.random.default_rng(3)
    k_pool = jnp.asarray(rng.standard_normal((SLOTS, kv_heads, dim)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((5, q_heads, dim)), jnp.float32)

    def step(req_to_token, rows, prefix, extend, out_cache_loc, q):
        validate_extend_inputs(req_to_token, rows, prefix, extend, num_slots=SLOTS, max_extend_len=3, kv_capacity=8,
                               unified=True, num_tokens=q.shape[0], out_cache_loc=out_cache_loc)
        meta = extend_unified_metadata(req_to_token, rows, prefix, extend, out_cache_loc, max_extend_len=3, kv_capacity=8, mode="interpret")
        meta = validate_extend_metadata(meta, num_slots=SLOTS, num_tokens=q.shape[0])
        return (extend_attention_unified(q, k_pool, k_pool, meta, mode="interpret"),
                extend_attention_unified_reference(q, k_pool, k_pool, meta))

    step = checked(step)
    o, ref = step(jnp.asarray(table()), i32(0, 1), i32(2, 1), i32(3, 2), i32(5, 6, 7, 10, 11), q)
    np.testing.assert_allclose(o, ref, atol=2e-5, rtol=2e-5)
    with pytest.raises(checkify.JaxRuntimeError, match=r"extend_lens\[0\] = 4 exceeds the max_extend_len bucket \(3\)"):
        step(jnp.asarray(table()), i32(0, 1), i32(1, 1), i32(4, 1), i32(5, 6, 7, 10, 11), q)


def test_validators_need_checkify():
    """Under a plain jit the checks cannot be functionalized: the failure is loud, at trace time."""
    with pytest.raises(Exception, match="checkify"):
        jax.jit(lambda loc: validate_write_slots(loc, SLOTS))(i32(1, 2))


def test_decode_metadata_from_indptr_with_bad_slot_is_sanitized():
    """CSR callers: a slot past the pool in kv_indices is reported and replaced by slot 0 before any kernel reads it."""
    meta = decode_metadata_from_indptr(i32(0, 2, 3), i32(4, 40, 5), q_heads=2, kv_heads=1)
    err, fixed = check_meta(validate_decode_metadata, meta)
    assert "kv_indices entry 1 (flat) = 40 is outside the pool [0, 16)" in err.get()
    np.testing.assert_array_equal(fixed.kv_indices, [4, 0, 5])


def test_validate_runs_before_the_step_and_stops_a_bad_batch(rng):
    """checked(step, validate=...): a bad batch raises before the step is launched; its donated pool stays usable."""
    launched = []
    values = rng.standard_normal((SLOTS, 1, 16)).astype(np.float32)
    k_pool = jnp.asarray(values)

    def validate(pool, req_to_token, rows, seq_lens):
        validate_decode_inputs(req_to_token, rows, seq_lens, num_slots=SLOTS, kv_capacity=12)

    def step(pool, req_to_token, rows, seq_lens):
        launched.append(True)  # runs when the step is traced, i.e. only if validation passed
        return pool * 2.0

    run = checked(step, validate=validate, donate_argnums=0)
    with pytest.raises(checkify.JaxRuntimeError, match=r"req_to_token\[req_pool_indices\[1\], 2\] = 20 is outside the pool"):
        run(k_pool, jnp.asarray(with_entry(2, 2, 20)), i32(0, 2), i32(5, 4))
    assert not launched
    np.testing.assert_array_equal(np.asarray(k_pool), values)  # not donated: still readable
    doubled = run(k_pool, jnp.asarray(table()), i32(0, 2), i32(5, 4))  # a good batch: the step runs (and donates)
    assert launched
    np.testing.assert_allclose(doubled, values * 2.0)
