"""Numerical tolerances for checking jaxattn's kernels against their jnp references.

The test suite, `scripts/stress.py` and users' own checks share one table, by input dtype, for outputs compared
with the float32 reference (`jaxattn.reference` and the ops' `*_reference` twins):

    import chex
    from jaxattn import testing
    chex.assert_trees_all_close(out, ref, **testing.tolerance(out.dtype))

fp8 pools: against the reference on the same fp8 pool (with the same scales) the tolerance is q's dtype's, as the
kernels convert fp8 rows to q's dtype exactly. Against a 16-bit pool of the unquantised values, `fp8_tolerance(format)`
bounds the quantisation error itself.
"""

from __future__ import annotations

import jax.numpy as jnp

# dtype -> (atol, rtol). 16-bit inputs are rounded before the kernel sees them and P is rounded to the input dtype
# for the second matmul, so bf16 (8-bit mantissa) needs about 8x fp16's tolerance.
TOLERANCES = {
    jnp.dtype(jnp.float32): (2e-5, 2e-5),
    jnp.dtype(jnp.float16): (2e-3, 2e-3),
    jnp.dtype(jnp.bfloat16): (1.6e-2, 1.6e-2),
}


def tolerance(dtype) -> dict:
    """{"atol": ..., "rtol": ...} for outputs of this input dtype (float32, float16 or bfloat16)."""
    return _lookup(TOLERANCES, dtype, "tolerance")


def _lookup(table: dict, dtype, what: str) -> dict:
    key = jnp.dtype(dtype)
    if key not in table:
        raise ValueError(f"no {what} for dtype {key}; known: {', '.join(str(d) for d in table)}")
    atol, rtol = table[key]
    return dict(atol=atol, rtol=rtol)


# fp8 format -> (atol, rtol) of outputs over an fp8 pool against the same attention over the unquantised values: the
# format's worst relative rounding of one element (e4m3fn: 3 mantissa bits, 2**-4; e5m2: 2 bits, 2**-3). An output row
# is a softmax-weighted mean of V rows, so a one-key row carries one V row's rounding and longer rows average it down
# (measured at head dim 128, unit-normal inputs, 1-500 keys: at most 0.039 for e4m3fn, 0.090 for e5m2).
FP8_TOLERANCES = {
    jnp.dtype(jnp.float8_e4m3fn): (2.0**-4, 2.0**-4),
    jnp.dtype(jnp.float8_e5m2): (2.0**-3, 2.0**-3),
}


def fp8_tolerance(fp8_dtype) -> dict:
    """{"atol": ..., "rtol": ...} between outputs over an fp8 pool and over the unquantised 16-bit values."""
    return _lookup(FP8_TOLERANCES, fp8_dtype, "fp8 tolerance")
