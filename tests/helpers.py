"""Shared test helpers: launch modes, dtype tolerances, random paged batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Output tolerances against the float32 reference, by input dtype (one table for tests, stress run and users).
# Under the interpreter bf16/fp16 inputs are compared after the same rounding, so these hold on both paths.
from jaxattn.testing import TOLERANCES, tolerance  # noqa: F401

jax.config.update("jax_enable_x64", False)

HAS_GPU = jax.default_backend() in ("gpu", "cuda")

# Kernel launch modes to test: the interpreter everywhere, the compiled kernel where a GPU exists.
MODES = [
    pytest.param("interpret", id="interpret"),
    pytest.param("gpu", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")]),
]

def random_pool_batch(rng, kv_lens, *, num_slots=None, reserve_slot0=True):
    """Scatters the tokens of every sequence over random distinct pool slots, as a real allocator does.

    Returns (kv_indptr i32[B+1], kv_indices i32[sum], num_slots). Slot 0 is never used when reserve_slot0.
    """
    kv_lens = np.asarray(kv_lens, np.int64)
    total = int(kv_lens.sum())
    first = 1 if reserve_slot0 else 0
    if num_slots is None:
        num_slots = first + total + int(rng.integers(0, 17))
    slots = rng.permutation(np.arange(first, num_slots))[:total]
    indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    return jnp.asarray(indptr), jnp.asarray(slots.astype(np.int32)), num_slots


def random_normal(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * scale).astype(dtype)


def assert_nan_confined(o, index):
    """o (tokens/rows x heads x dim) is NaN throughout row `index` (a (row, head) pair) and finite everywhere else:
    a NaN input spreads to its own output row only."""
    o = np.float32(o)
    assert np.isnan(o[index]).all()
    others = np.ones(o.shape[:2], bool)
    others[index] = False
    assert np.isfinite(o[others]).all()

