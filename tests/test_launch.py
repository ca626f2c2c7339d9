"""The launch layer: mode choice, interpreter behaviour (bf16, poisoning, aliasing), jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.launch import launch, launch_mode, operand_or_unread
from tests.helpers import HAS_GPU, MODES

SCALE_EVEN = ("tests.launch_kernels", "scale_even_rows_kernel")
ADD_AT = ("tests.launch_kernels", "add_at_kernel")


def test_mode_is_chosen_by_platform_and_overridable(monkeypatch):
    monkeypatch.delenv("JAXATTN_LAUNCH", raising=False)
    assert launch_mode() == ("gpu" if HAS_GPU else "interpret")
    assert launch_mode("interpret") == "interpret"
    monkeypatch.setenv("JAXATTN_LAUNCH", "interpret")
    assert launch_mode() == "interpret"
    with pytest.raises(ValueError, match="launch mode must be one of"):
        launch_mode("cuda")


def test_an_empty_operand_becomes_one_unread_entry_of_its_dtype():
    # Inside jit too; a listed operand passes through untouched.
    for dtype in (jnp.int32, jnp.uint8, jnp.bool_):
        stand_in = jax.jit(operand_or_unread)(jnp.zeros((0,), dtype))
        assert stand_in.shape == (1,) and stand_in.dtype == jnp.dtype(dtype) and not bool(stand_in[0])
    listed = jnp.arange(5, 12, dtype=jnp.int32)
    assert operand_or_unread(listed) is listed
    np.testing.assert_array_equal(jax.jit(operand_or_unread)(listed), np.arange(5, 12))


@pytest.mark.skipif(HAS_GPU, reason="checks the error on a machine without a GPU")
def test_gpu_mode_without_gpu_says_what_to_do():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU.*mode='interpret'"):
        launch_mode("gpu")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_kernel_runs_inside_jit_and_keeps_dtype(rng, mode, dtype):
    x = jnp.asarray(rng.standard_normal((6, 40)), dtype)

    @jax.jit
    def f(x, scale):
        return launch(SCALE_EVEN, x, scale, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(6,),
                      zeroed_outputs=(0,), mode=mode, ROWS=6, COLS=40, BLOCK=64)

    y = f(x, jnp.asarray([1.5], jnp.float32))
    assert y.dtype == dtype
    want = np.where((np.arange(6) % 2 == 0)[:, None], np.float32(x) * 3.0, 0.0)
    np.testing.assert_allclose(np.float32(y), want, rtol=1e-2 if dtype != jnp.float32 else 1e-6)


def test_interpreter_poisons_rows_the_kernel_does_not_write(rng):
    x = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    y = launch(SCALE_EVEN, x, jnp.ones((1,)), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
               mode="interpret", ROWS=4, COLS=8, BLOCK=8)
    assert np.isnan(np.asarray(y)[1::2]).all()
    np.testing.assert_allclose(np.asarray(y)[0::2], np.asarray(x)[0::2] * 2)


@pytest.mark.parametrize("mode", MODES)
def test_aliased_output_updates_only_named_rows(rng, mode):
    pool = jnp.asarray(rng.standard_normal((10, 4)), jnp.float32)
    values = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)
    slots = jnp.asarray([7, 2, 5], jnp.int32)

    @jax.jit
    def f(pool, slots, values):
        return launch(ADD_AT, pool, slots, values, out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype), grid=(3,),
                      input_output_aliases={0: 0}, mode=mode, COLS=4, BLOCK=4)

    want = np.asarray(pool).copy()
    want[[7, 2, 5]] += np.asarray(values)
    np.testing.assert_allclose(f(pool, slots, values), want, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_kernels_can_use_tritons_library_helpers(rng, mode):
    x = jnp.asarray(rng.standard_normal((5, 13)), jnp.float32)
    out = launch(("tests.launch_kernels", "row_stats_kernel"), x, out_shape=jax.ShapeDtypeStruct((5, 3), jnp.float32),
                 grid=(5,), mode=mode, COLS=13, BLOCK=16)
    want = np.stack([np.max(x, 1), np.sum(x, 1), (np.arange(5) + 13 + 3) // 4], 1)
    np.testing.assert_allclose(out, want, rtol=1e-5)
