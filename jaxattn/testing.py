"""Numerical tolerances for checking jaxattn's kernels against their jnp references.

The test suite, `scripts/stress.py` and users' own checks share one table, by input dtype, for outputs compared
with the float32 reference (`jaxattn.reference` and the ops' `*_reference` twins):

    import chex
    from jaxattn import testing
    chex.assert_trees_all_close(out, ref, **testing.tolerance(out.dtype))
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
    key = jnp.dtype(dtype)
    if key not in TOLERANCES:
        raise ValueError(f"no tolerance for dtype {key}; known: {', '.join(str(d) for d in TOLERANCES)}")
    atol, rtol = TOLERANCES[key]
    return dict(atol=atol, rtol=rtol)
