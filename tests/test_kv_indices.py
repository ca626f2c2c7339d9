"""create_kv_indices and build_unified_kv_indices: kernels (interpreter and GPU) against the references and by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.kv_indices import (
    build_unified_kv_indices,
    build_unified_kv_indices_reference,
    create_kv_indices,
    create_kv_indices_reference,
)
from tests.helpers import MODES


def by_hand(req_to_token, req_pool_indices, lens, starts, capacity):
    rows = [np.asarray(req_to_token)[r, s : s + n] for r, s, n in zip(req_pool_indices, starts, lens)]
    flat = np.concatenate(rows + [np.zeros(0, np.int32)])
    out = np.zeros(capacity, np.int32)
    out[: min(len(flat), capacity)] = flat[:capacity]
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32), out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch", [1, 5, 37])
def test_create_kv_indices_matches_gather(rng, mode, batch):
    max_reqs, max_ctx = 64, 700  # a context longer than one 512-slot copy block
    req_to_token = rng.permutation(max_reqs * max_ctx).reshape(max_reqs, max_ctx).astype(np.int32) + 1
    req_pool_indices = rng.choice(max_reqs, batch, replace=False).astype(np.int32)
    lens = rng.integers(0, max_ctx // 2, batch).astype(np.int32)
    starts = rng.integers(0, max_ctx // 2, batch).astype(np.int32)
    capacity = int(lens.sum()) + 13
    args = [jnp.asarray(x) for x in (req_to_token, req_pool_indices, lens, starts)]
    indptr, indices = create_kv_indices(*args, capacity=capacity, mode=mode)
    want_indptr, want = by_hand(req_to_token, req_pool_indices, lens, starts, capacity)
    np.testing.assert_array_equal(indptr, want_indptr)
    np.testing.assert_array_equal(indices, want)
    ref_indptr, ref = create_kv_indices_reference(*args, capacity=capacity)
    np.testing.assert_array_equal(ref, want)


@pytest.mark.parametrize("mode", MODES)
def test_create_kv_indices_never_reads_or_writes_out_of_range(rng, mode):
    req_to_token = jnp.asarray(rng.integers(1, 10_000, (4, 16)).astype(np.int32))
    # Row 9 does not exist, row -1 neither, and the second sequence runs past the context end.
    req_pool_indices = jnp.asarray([9, 2, -1, 1], jnp.int32)
    lens = jnp.asarray([3, 10, 2, 4], jnp.int32)
    starts = jnp.asarray([0, 12, 0, 0], jnp.int32)
    capacity = 16  # smaller than the total 19: the tail is cut, nothing is written past the end
    indptr, indices = create_kv_indices(req_to_token, req_pool_indices, lens, starts, capacity=capacity, mode=mode)
    r2t = np.asarray(req_to_token)
    want = np.concatenate([[0, 0, 0], r2t[2, 12:16], [0] * 6, [0, 0], r2t[1, :1]])
    np.testing.assert_array_equal(indices, want)
    np.testing.assert_array_equal(indptr, [0, 3, 13, 15, 19])
    _, ref = create_kv_indices_reference(req_to_token, req_pool_indices, lens, starts, capacity=capacity)
    np.testing.assert_array_equal(ref, want)


@pytest.mark.parametrize("mode", MODES)
def test_create_kv_indices_inside_jit_serves_new_lengths_without_retrace(rng, mode):
    req_to_token = jnp.asarray(rng.integers(1, 10_000, (8, 32)).astype(np.int32))
    traces = []

    @jax.jit
    def step(req_pool_indices, lens):
        traces.append(1)
        return create_kv_indices(req_to_token, req_pool_indices, lens, capacity=64, mode=mode)

    for lens in ([3, 5], [31, 0], [7, 7]):
        rows = rng.choice(8, 2, replace=False).astype(np.int32)
        _, got = step(jnp.asarray(rows), jnp.asarray(lens, jnp.int32))
        np.testing.assert_array_equal(got, by_hand(req_to_token, rows, lens, [0, 0], 64)[1])
    assert len(traces) == 1


@pytest.mark.parametrize("mode", MODES)
def test_build_unified_kv_indices_puts_each_sequences_new_slots_after_its_prefix(rng, mode):
    prefix_lens = np.array([10, 0, 15, 600], np.int32)
    extend_lens = np.array([5, 3, 0, 4], np.int32)
    prefix_indptr = np.concatenate([[0], np.cumsum(prefix_lens)]).astype(np.int32)
    prefix_indices = rng.integers(1, 1 << 20, prefix_indptr[-1] + 7).astype(np.int32)  # 7 entries of slack
    extend_indices = rng.integers(1, 1 << 20, extend_lens.sum()).astype(np.int32)
    args = [jnp.asarray(prefix_indptr), jnp.asarray(prefix_indices), None, jnp.asarray(extend_lens), jnp.asarray(extend_indices)]
    indptr, indices, got_prefix_lens = build_unified_kv_indices(*args, mode=mode)
    ext_start = np.concatenate([[0], np.cumsum(extend_lens)])
    want = np.concatenate(
        [
            np.concatenate([prefix_indices[prefix_indptr[b] : prefix_indptr[b + 1]], extend_indices[ext_start[b] : ext_start[b + 1]]])
            for b in range(4)
        ]
    )
    want = np.concatenate([want, np.zeros(len(prefix_indices) + len(extend_indices) - len(want), np.int32)])
    np.testing.assert_array_equal(indices, want)
    np.testing.assert_array_equal(indptr, np.concatenate([[0], np.cumsum(prefix_lens + extend_lens)]))
    np.testing.assert_array_equal(got_prefix_lens, prefix_lens)
    np.testing.assert_array_equal(build_unified_kv_indices_reference(*args)[1], want)


@pytest.mark.parametrize("mode", MODES)
def test_build_unified_kv_indices_honours_explicit_extend_start_loc(rng, mode):
    prefix_indptr = jnp.asarray([0, 2, 3], jnp.int32)
    prefix_indices = jnp.asarray([11, 12, 13], jnp.int32)
    extend_indices = jnp.asarray([21, 22, 23, 24, 25], jnp.int32)
    starts = jnp.asarray([3, 0], jnp.int32)  # the second sequence's new tokens come first in out_cache_loc
    lens = jnp.asarray([2, 3], jnp.int32)
    _, indices, _ = build_unified_kv_indices(prefix_indptr, prefix_indices, starts, lens, extend_indices, capacity=10, mode=mode)
    np.testing.assert_array_equal(indices, [11, 12, 24, 25, 13, 21, 22, 23, 0, 0])


def test_rejects_bad_arguments_by_name():
    r2t = jnp.zeros((4, 8), jnp.int32)
    with pytest.raises(ValueError, match=r"kv_lens must have shape \(2,\)"):
        create_kv_indices(r2t, jnp.zeros((2,), jnp.int32), jnp.zeros((3,), jnp.int32), capacity=8)
    with pytest.raises(ValueError, match="req_to_token must have dtype int32/int64"):
        create_kv_indices(r2t.astype(jnp.float32), jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32), capacity=8)
    with pytest.raises(ValueError, match="capacity must be a positive Python int"):
        create_kv_indices(r2t, jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32), capacity=0)
