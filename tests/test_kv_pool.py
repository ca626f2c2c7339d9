"""KV pool writes lose nothing: only the named slots change, donation keeps the buffers in place, the padding slot is
harmless, duplicates and out-of-range slots have a defined result, fp8 storage round-trips with its scales."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from jaxattn.checked import checked, validate_write_slots
from jaxattn.decode import decode_attention, decode_attention_reference, decode_metadata_from_indptr
from jaxattn.kv_pool import allocate_kv_buffers, check_write_slots, read_scaled, write_kv
from jaxattn.serving import move_kv

SLOTS, HEADS, DIM, V_DIM = 40, 2, 32, 16


def pools(rng, dtype=jnp.float32):
    """Host copies (np.array, not views: a numpy view of a CPU jax array pins it and blocks donation)."""
    k = rng.standard_normal((SLOTS, HEADS, DIM)).astype(np.float32)
    v = rng.standard_normal((SLOTS, HEADS, V_DIM)).astype(np.float32)
    return k, v


def new_tokens(rng, n):
    return (rng.standard_normal((n, HEADS, DIM)).astype(np.float32), rng.standard_normal((n, HEADS, V_DIM)).astype(np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_only_named_slots_change(rng, dtype):
    k, v = pools(rng)
    loc = rng.permutation(np.arange(1, SLOTS))[:11].astype(np.int32)
    k_new, v_new = new_tokens(rng, 11)
    k_out, v_out = jax.jit(write_kv)(jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(loc), jnp.asarray(k_new), jnp.asarray(v_new))
    want_k, want_v = np.asarray(jnp.asarray(k, dtype)).copy(), np.asarray(jnp.asarray(v, dtype)).copy()
    want_k[loc] = np.asarray(jnp.asarray(k_new, dtype))
    want_v[loc] = np.asarray(jnp.asarray(v_new, dtype))
    assert k_out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(k_out), want_k)  # bit-exact, every slot
    np.testing.assert_array_equal(np.asarray(v_out), want_v)


def test_donation_writes_in_place(rng):
    k, v = pools(rng)
    k_buf, v_buf = jnp.asarray(np.array(k)), jnp.asarray(np.array(v))
    pointers = (k_buf.unsafe_buffer_pointer(), v_buf.unsafe_buffer_pointer())
    step = jax.jit(write_kv, donate_argnums=(0, 1))
    loc = jnp.asarray([5, 0, 17], jnp.int32)
    k_new, v_new = new_tokens(rng, 3)
    k_out, v_out = step(k_buf, v_buf, loc, jnp.asarray(k_new), jnp.asarray(v_new))
    assert k_buf.is_deleted() and v_buf.is_deleted()  # donated
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == pointers  # the same memory
    k[[5, 0, 17]] = k_new
    np.testing.assert_array_equal(np.asarray(k_out), k)
    # And again on the returned buffers: a serving loop keeps one pool allocation.
    k2, v2 = step(k_out, v_out, loc, jnp.asarray(k_new) * 2, jnp.asarray(v_new))
    assert k2.unsafe_buffer_pointer() == pointers[0]


def test_padding_slot_is_harmless(rng):
    """Padding tokens write slot 0 (any number of times); no sequence lists slot 0, so attention is unchanged."""
    k, v = pools(rng)
    kv_lens = [7, 12]
    slots = rng.permutation(np.arange(1, SLOTS))[:19].astype(np.int32)
    meta = decode_metadata_from_indptr(jnp.asarray([0, 7, 19], jnp.int32), jnp.asarray(slots), q_heads=2, kv_heads=HEADS)
    q = jnp.asarray(rng.standard_normal((2, 2, DIM)), jnp.float32)
    before = decode_attention(q, jnp.asarray(k), jnp.asarray(v), meta, mode="interpret")
    loc = jnp.asarray([0, 0, 0, 0], jnp.int32)  # a batch of padding tokens, with huge values
    k_new, v_new = new_tokens(rng, 4)
    k_out, v_out = write_kv(jnp.asarray(k), jnp.asarray(v), loc, jnp.asarray(k_new) * 1e4, jnp.asarray(v_new) * 1e4)
    np.testing.assert_array_equal(np.asarray(k_out)[1:], k[1:])
    np.testing.assert_array_equal(np.asarray(v_out)[1:], v[1:])
    after = decode_attention(q, k_out, v_out, meta, mode="interpret")
    np.testing.assert_array_equal(np.asarray(after), np.asarray(before))
    np.testing.assert_allclose(after, decode_attention_reference(q, k_out, v_out, meta), atol=2e-5, rtol=2e-5)
    assert sum(kv_lens) == 19
    # Checked mode accepts repeated padding slots.
    checked(lambda l: validate_write_slots(l, SLOTS))(loc)


def test_duplicate_slots_have_a_defined_result_and_checked_mode_rejects_them(rng):
    """Defined behaviour (see write_kv): the repeated slot holds, element by element, one of the values written to it;
    every other slot is exact. Checked mode rejects repeats of real slots."""
    k, v = pools(rng)
    loc = np.asarray([3, 9, 3, 21, 3], np.int32)
    k_new, v_new = new_tokens(rng, 5)
    k_out, v_out = jax.jit(write_kv)(jnp.asarray(k), jnp.asarray(v), jnp.asarray(loc), jnp.asarray(k_new), jnp.asarray(v_new))
    k_out, v_out = np.asarray(k_out), np.asarray(v_out)
    others = np.setdiff1d(np.arange(SLOTS), [3, 9, 21])
    np.testing.assert_array_equal(k_out[others], k[others])
    np.testing.assert_array_equal(k_out[[9, 21]], k_new[[1, 3]])
    writes = [0, 2, 4]
    assert np.all(np.any(k_out[3][None] == k_new[writes], axis=0)), "an element of slot 3 is none of the values written"
    assert np.all(np.any(v_out[3][None] == v_new[writes], axis=0))
    with pytest.raises(checkify.JaxRuntimeError, match="out_cache_loc names slot 3 twice"):
        checked(lambda l: validate_write_slots(l, SLOTS))(jnp.asarray(loc))
    err, _ = checkify.checkify(lambda l: check_write_slots(l, SLOTS))(jnp.asarray(loc))
    assert "slot 3 twice" in err.get()


@pytest.mark.parametrize("bad", [[-1], [SLOTS], [SLOTS + 7, -SLOTS], [2**31 - 1, -(2**31)]], ids=["minus1", "num_slots", "past-and-minus-num", "int32-extremes"])
def test_out_of_range_slots_are_dropped(rng, bad):
    """Never written anywhere: not wrapped around (slot -1 is not the last slot), not clamped to an edge slot."""
    k, v = pools(rng)
    loc = np.asarray([4] + bad + [11], np.int32)
    k_new, v_new = new_tokens(rng, len(loc))
    k_out, v_out = jax.jit(write_kv)(jnp.asarray(k), jnp.asarray(v), jnp.asarray(loc), jnp.asarray(k_new), jnp.asarray(v_new))
    want_k, want_v = k.copy(), v.copy()
    want_k[[4, 11]] = k_new[[0, -1]]
    want_v[[4, 11]] = v_new[[0, -1]]
    np.testing.assert_array_equal(np.asarray(k_out), want_k)
    np.testing.assert_array_equal(np.asarray(v_out), want_v)
    with pytest.raises(checkify.JaxRuntimeError, match=r"out_cache_loc\[1\] = .* is outside the pool"):
        checked(lambda l: validate_write_slots(l, SLOTS))(jnp.asarray(loc))


@pytest.mark.parametrize("fp8", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_round_trip_with_scales(rng, fp8):
    k_buf, v_buf = allocate_kv_buffers(SLOTS, HEADS, DIM, V_DIM, dtype=fp8)
    k_scale, v_scale = 0.05, 2.0  # values of magnitude ~1 stored as ~20 and ~0.5
    loc = jnp.asarray([1, 7, 30], jnp.int32)
    k_new, v_new = new_tokens(rng, 3)
    k_buf, v_buf = jax.jit(write_kv, static_argnames=("k_scale", "v_scale"))(
        k_buf, v_buf, loc, jnp.asarray(k_new, jnp.bfloat16), jnp.asarray(v_new, jnp.bfloat16), k_scale=k_scale, v_scale=v_scale)
    assert k_buf.dtype == fp8 and v_buf.dtype == fp8
    np.testing.assert_array_equal(np.asarray(k_buf[1] * 1.0, np.float32), np.asarray((jnp.asarray(k_new[0], jnp.bfloat16).astype(jnp.float32) / k_scale).astype(fp8), np.float32))
    k_back = np.asarray(read_scaled(k_buf, k_scale, jnp.float32))
    v_back = np.asarray(read_scaled(v_buf, v_scale, jnp.float32))
    # fp8 keeps 3 (e4m3) or 2 (e5m2) mantissa bits: relative error <= 2^-4 / 2^-3, plus bf16's rounding of the input.
    rel = 2.0**-4 if fp8 == jnp.float8_e4m3fn else 2.0**-3
    for back, new, scale in ((k_back, k_new, k_scale), (v_back, v_new, v_scale)):
        np.testing.assert_allclose(back[np.asarray(loc)], new, rtol=rel + 2**-8, atol=scale * 2.0**-9)
        untouched = np.setdiff1d(np.arange(SLOTS), np.asarray(loc))
        np.testing.assert_array_equal(back[untouched], 0.0)
    # Non-fp8 buffers ignore the scales on both sides.
    assert read_scaled(jnp.ones(3), 5.0, jnp.float32) is not None and float(read_scaled(jnp.ones(3), 5.0, jnp.float32)[0]) == 1.0


def test_latent_pool_writes_k_only():
    # A latent (MLA) pool: V is part of K, so v_pool and v are None together and only K is written.
    pool = jnp.zeros((6, 1, 8), jnp.float32)
    k = jnp.arange(16, dtype=jnp.float32).reshape(2, 1, 8)
    k_pool, v_pool = write_kv(pool, None, jnp.asarray([4, 2], jnp.int32), k, None)
    assert v_pool is None
    np.testing.assert_array_equal(np.asarray(k_pool)[[4, 2]], np.asarray(k))
    np.testing.assert_array_equal(np.asarray(k_pool)[[0, 1, 3, 5]], 0)
    with pytest.raises(ValueError, match="v_pool and v are None together"):
        write_kv(pool, None, jnp.asarray([1], jnp.int32), k[:1], k[:1])
    with pytest.raises(ValueError, match="v_pool and v are None together"):
        write_kv(pool, pool, jnp.asarray([1], jnp.int32), k[:1], None)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn])
def test_move_kv_reads_every_source_before_writing(rng, dtype):
    # An accepted tree branch's copies (RequestTable.accept_drafts_by_copy): slot 9 is a destination and a later pair's
    # source, so it must give its old row; (0, 0) pads the list; sources outside the pool read slot 0, destinations
    # outside it are dropped. Rows move bit for bit (fp8 bytes too).
    k, v = (jnp.asarray(x, dtype) for x in pools(rng))
    src = np.array([9, 13, 0, -4, SLOTS + 2, 2**31 - 1], np.int32)
    dst = np.array([5, 9, 0, 20, 21, SLOTS], np.int32)
    k_out, v_out = jax.jit(move_kv)(k, v, jnp.asarray(src), jnp.asarray(dst))
    for pool, out in ((k, k_out), (v, v_out)):
        want = np.asarray(pool.astype(jnp.float32)).copy()
        want[[5, 9, 20, 21]] = want[[9, 13, 0, 0]]
        assert out.dtype == dtype
        np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), want)


def test_move_kv_on_a_latent_pool_and_bad_arguments():
    pool = jnp.arange(6 * 8, dtype=jnp.float32).reshape(6, 1, 8)
    k_out, v_out = move_kv(pool, None, np.array([4], np.int64), np.array([2**32 + 1], np.int64))  # not wrapped onto 1
    assert v_out is None
    np.testing.assert_array_equal(np.asarray(k_out), np.asarray(pool))
    k_out, _ = move_kv(pool, None, jnp.asarray([4, 1]), jnp.asarray([1, 4]))  # a swap
    np.testing.assert_array_equal(np.asarray(k_out)[[1, 4]], np.asarray(pool)[[4, 1]])
    with pytest.raises(ValueError, match=r"dst"):
        move_kv(pool, None, jnp.asarray([1, 2]), jnp.asarray([3]))
    with pytest.raises(ValueError, match=r"src"):
        move_kv(pool, None, jnp.asarray([1.0]), jnp.asarray([3]))
    with pytest.raises(ValueError, match=r"v_pool"):
        move_kv(pool, jnp.zeros((5, 1, 8)), jnp.asarray([1]), jnp.asarray([3]))
