"""merge_state: kernel against the reference, and against attention over the union of two key sets."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.merge_state import merge_state, merge_state_reference
from jaxattn.reference import ragged_paged_attention_reference
from tests.helpers import MODES, random_normal, random_pool_batch, tolerance


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("head_dim", [48, 128])
def test_merge_equals_attention_over_the_union(rng, mode, dtype, head_dim):
    # Attention of 9 queries over keys split in two non-causal halves, merged, equals attention over all keys.
    heads, n_q, n_a, n_b = 4, 9, 13, 6
    kv_indptr_all, kv_indices_all, slots = random_pool_batch(rng, [n_a + n_b])
    k_pool = random_normal(rng, (slots, heads, head_dim), dtype)
    v_pool = random_normal(rng, (slots, heads, head_dim), dtype)
    q = random_normal(rng, (n_q, heads, head_dim), dtype)
    qo = jnp.asarray([0, n_q], jnp.int32)

    def attend(indices):
        indptr = jnp.asarray([0, len(indices)], jnp.int32)
        return ragged_paged_attention_reference(q, k_pool, v_pool, qo, indptr, indices, causal=False, return_lse=True)

    o1, lse1 = attend(kv_indices_all[:n_a])
    o2, lse2 = attend(kv_indices_all[n_a:])
    o_all, lse_all = attend(kv_indices_all)
    o, lse = merge_state(o1, lse1, o2, lse2, mode=mode)
    assert o.dtype == dtype
    np.testing.assert_allclose(np.float32(o), np.float32(o_all), **tolerance(dtype))
    np.testing.assert_allclose(lse, lse_all, atol=1e-5, rtol=1e-5)
    ref_o, ref_lse = merge_state_reference(o1, lse1, o2, lse2)
    np.testing.assert_allclose(np.float32(o), np.float32(ref_o), **tolerance(dtype))
    np.testing.assert_allclose(lse, ref_lse, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_infinite_lse_rows(rng, mode):
    tokens, heads, dim = 4, 1, 8
    o1 = random_normal(rng, (tokens, heads, dim), jnp.float32)
    o2 = random_normal(rng, (tokens, heads, dim), jnp.float32)
    o1 = o1.at[1].set(jnp.nan)  # an empty state may hold garbage rows
    lse1 = jnp.asarray([[0.5], [-jnp.inf], [jnp.inf], [-jnp.inf]])
    lse2 = jnp.asarray([[-jnp.inf], [1.0], [0.25], [-jnp.inf]])
    o, lse = merge_state(o1, lse1, o2, lse2, mode=mode)
    np.testing.assert_allclose(o[0], o1[0], rtol=1e-6)  # only side 1 has keys
    np.testing.assert_allclose(o[1], o2[1], rtol=1e-6)  # only side 2 has keys; side 1's NaN rows are ignored
    np.testing.assert_allclose(o[2], o2[2], rtol=1e-6)  # +inf counts as empty
    np.testing.assert_array_equal(o[3], np.zeros((heads, dim)))  # both empty
    np.testing.assert_allclose(lse[:, 0], [0.5, 1.0, 0.25, -np.inf])
    ref_o, ref_lse = merge_state_reference(o1, lse1, o2, lse2)
    np.testing.assert_allclose(o, ref_o, rtol=1e-6)
    np.testing.assert_array_equal(lse, ref_lse)


def test_rejects_mismatched_shapes():
    o = jnp.zeros((2, 3, 8))
    with pytest.raises(ValueError, match=r"lse2 must have shape \(2, 3\)"):
        merge_state(o, jnp.zeros((2, 3)), o, jnp.zeros((3, 2)))
    with pytest.raises(ValueError, match="o2 must have dtype float32"):
        merge_state(o, jnp.zeros((2, 3)), o.astype(jnp.float16), jnp.zeros((2, 3)))
