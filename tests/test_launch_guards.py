"""Guard regions around interpreted buffers: out-of-bounds stores fail the launch, out-of-bounds float loads read NaN.

The kernels are written for this test into a package in a temporary folder and named by dotted path, as `launch`
allows, so the launch layer imports them (and their interpreted variant) like any kernel module.
"""

import sys
import textwrap
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.launch import launch

KERNELS = '''
import triton
import triton.language as tl


@triton.jit
def copy_kernel(X, Y, N: tl.constexpr, BLOCK: tl.constexpr, EXTRA_STORE: tl.constexpr, EXTRA_LOAD: tl.constexpr,
                STORE_BEFORE: tl.constexpr):
    # Copies N elements; EXTRA_STORE / EXTRA_LOAD elements more are stored / loaded past the end (a bug on purpose),
    # STORE_BEFORE stores one element before the start.
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N + EXTRA_LOAD)
    tl.store(Y + offs, x, mask=offs < N + EXTRA_STORE)
    if STORE_BEFORE:
        tl.store(Y - 1, tl.load(X))


@triton.jit
def store_past_input_kernel(X, Y, N: tl.constexpr):
    # Writes through an input pointer, one element past its end.
    tl.store(X + N, tl.load(X))
    tl.store(Y, tl.load(X))


@triton.jit
def gather_rows_kernel(X, IDX, Y, COLS: tl.constexpr, BLOCK: tl.constexpr):
    # Y[i] = X[IDX[i]]: an index one past the last row reads the guard.
    i = tl.program_id(0)
    row = tl.load(IDX + i).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    tl.store(Y + i * COLS + offs, tl.load(X + row * COLS + offs, mask=offs < COLS), mask=offs < COLS)


@triton.jit
def add_one_in_place_kernel(X, X_OUT, LEN: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr):
    # X_OUT aliases X (LEN elements); adds 1 to the first N (N > LEN stores past the end).
    offs = tl.arange(0, BLOCK)
    tl.store(X_OUT + offs, tl.load(X_OUT + offs, mask=offs < LEN, other=0.0) + 1, mask=offs < N)
'''


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    package = f"guard_kernels_{uuid.uuid4().hex[:8]}"
    root = tmp_path_factory.mktemp("guard_kernels")
    (root / package).mkdir()
    (root / package / "__init__.py").write_text("")
    (root / package / "kernels.py").write_text(textwrap.dedent(KERNELS))
    sys.path.insert(0, str(root))
    try:
        yield f"{package}.kernels"
    finally:
        sys.path.remove(str(root))


def copy(kernels, x, n_out=None, extra_store=0, extra_load=0, store_before=False, zeroed=True):
    n = x.shape[0] if n_out is None else n_out
    return launch((kernels, "copy_kernel"), x, out_shape=jax.ShapeDtypeStruct((n,), x.dtype), grid=(1,),
                  zeroed_outputs=(0,) if zeroed else (), mode="interpret", N=n, BLOCK=64,
                  EXTRA_STORE=extra_store, EXTRA_LOAD=extra_load, STORE_BEFORE=store_before)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.int8])
def test_a_correct_kernel_passes(kernels, rng, dtype):
    x = jnp.asarray(rng.integers(-50, 50, 37), dtype)
    np.testing.assert_array_equal(np.asarray(copy(kernels, x)), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: copy(kernels, x, zeroed=False))(x)), np.asarray(x))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_a_store_one_past_the_output_fails_the_launch(kernels, rng, dtype):
    x = jnp.asarray(rng.integers(-50, 50, 40), dtype)
    with pytest.raises(RuntimeError, match=r"copy_kernel.*out-of-bounds write.*output 0: 1 element\(s\) past the end "
                                           r"\(nearest 1, farthest 1"):
        jax.block_until_ready(copy(kernels, x, n_out=39, extra_store=1))  # on a GPU the callback's error surfaces here


def test_a_store_before_the_output_fails_the_launch(kernels, rng):
    x = jnp.asarray(rng.standard_normal(16), jnp.float32)
    with pytest.raises(RuntimeError, match=r"out-of-bounds write.*output 0: 1 element\(s\) before the start"):
        jax.block_until_ready(copy(kernels, x, store_before=True))


def test_a_store_past_an_input_fails_the_launch_and_names_its_position(kernels):
    x = jnp.arange(8, dtype=jnp.float32)
    with pytest.raises(RuntimeError, match=r"store_past_input_kernel.*out-of-bounds write.*input at argument "
                                           r"position 0: 1 element\(s\) past the end"):
        jax.block_until_ready(launch((kernels, "store_past_input_kernel"), x, out_shape=jax.ShapeDtypeStruct((1,), jnp.float32),
                                     grid=(1,), mode="interpret", N=8))


def test_the_failure_surfaces_inside_jit(kernels):
    x = jnp.arange(8, dtype=jnp.float32)
    with pytest.raises(Exception, match="out-of-bounds write"):
        jax.jit(lambda x: copy(kernels, x, n_out=7, extra_store=1))(x).block_until_ready()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_a_load_past_the_input_reads_nan(kernels, rng, dtype):
    x = jnp.asarray(rng.standard_normal(20), dtype)
    # The output is 21 long and the kernel reads x[20], one past x's end.
    y = np.asarray(copy(kernels, x, n_out=21)).astype(np.float32)
    np.testing.assert_array_equal(y[:20], np.asarray(x).astype(np.float32))
    assert np.isnan(y[20])


@pytest.mark.parametrize("extra_rows", [0, 1])
def test_a_row_index_one_past_the_last_row_reads_nan(kernels, rng, extra_rows):
    # Rows of 1024 floats (4 KB): the guard still covers a whole row past the end.
    x = jnp.asarray(rng.standard_normal((5, 1024)), jnp.float32)
    idx = jnp.asarray([4, 0, 4 + extra_rows], jnp.int32)
    y = np.asarray(launch((kernels, "gather_rows_kernel"), x, idx, out_shape=jax.ShapeDtypeStruct((3, 1024), x.dtype),
                          grid=(3,), mode="interpret", COLS=1024, BLOCK=1024))
    np.testing.assert_array_equal(y[:2], np.asarray(x)[[4, 0]])
    assert np.isnan(y[2]).all() == bool(extra_rows)


def test_aliased_output_is_updated_in_place_and_guarded(kernels):
    x = jnp.arange(10, dtype=jnp.float32)
    y = launch((kernels, "add_one_in_place_kernel"), x, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,),
               input_output_aliases={0: 0}, mode="interpret", LEN=10, N=10, BLOCK=16)
    np.testing.assert_array_equal(np.asarray(y), np.arange(10) + 1)
    with pytest.raises(RuntimeError, match=r"output 0: 1 element\(s\) past the end"):
        jax.block_until_ready(launch((kernels, "add_one_in_place_kernel"), x[:9], out_shape=jax.ShapeDtypeStruct((9,), x.dtype),
                                     grid=(1,), input_output_aliases={0: 0}, mode="interpret", LEN=9, N=10, BLOCK=16))


def test_unwritten_outputs_are_still_poisoned(kernels):
    # EXTRA_STORE=-1: the kernel stores the first 30 of the output's 31 elements; the last keeps its NaN poison.
    x = jnp.arange(31, dtype=jnp.float32)
    y = np.asarray(copy(kernels, x, extra_store=-1, zeroed=False))
    np.testing.assert_array_equal(y[:30], np.arange(30))
    assert np.isnan(y[30])
