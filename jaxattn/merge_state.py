"""`merge_state`: combine two attention states computed over disjoint key sets."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton

from jaxattn.checks import launch_mode_argument, FLOAT_DTYPES, check_array
from jaxattn.aot import build
from jaxattn.launch import launch


def _check_merge_args(o1, lse1, o2, lse2):
    check_array("o1", o1, ndim=3, dtypes=FLOAT_DTYPES, what="[tokens, heads, head_dim]")
    tokens, heads, head_dim = o1.shape
    if head_dim < 1:
        raise ValueError(f"o1 must have head_dim >= 1 [tokens, heads, head_dim]; got shape {tuple(o1.shape)}")
    check_array("lse1", lse1, shape=(tokens, heads), dtypes=FLOAT_DTYPES, what="[tokens, heads]")
    check_array("o2", o2, shape=o1.shape, dtypes=(o1.dtype,), what="[tokens, heads, head_dim] like o1")
    check_array("lse2", lse2, shape=(tokens, heads), dtypes=FLOAT_DTYPES, what="[tokens, heads]")


@functools.partial(jax.jit, static_argnames=("launch_mode", "mode"))
def merge_state(o1: jax.Array, lse1: jax.Array, o2: jax.Array, lse2: jax.Array, *, launch_mode: str | None = None, mode: str | None = None):
    """Merges attention outputs over two disjoint key sets into the output over their union.

    LSE is the natural log of the softmax denominator (jaxattn's convention; FlashInfer's is base 2).
    An LSE of -inf means "no keys" and contributes nothing; +inf is treated as -inf (as SGLang does).
    When both sides are empty the result is zeros with LSE -inf.

    Args:
      o1, o2: [tokens, heads, head_dim], f32/f16/bf16, same dtype.
      lse1, lse2: [tokens, heads].

    Returns:
      o: [tokens, heads, head_dim] in o1's dtype; lse: f32[tokens, heads].
    """
    _check_merge_args(o1, lse1, o2, lse2)
    tokens, heads, head_dim = o1.shape
    return launch(
        ("merge_state", "merge_state_kernel"),
        o1,
        lse1.astype(jnp.float32),
        o2,
        lse2.astype(jnp.float32),
        out_shape=(jax.ShapeDtypeStruct(o1.shape, o1.dtype), jax.ShapeDtypeStruct((tokens, heads), jnp.float32)),
        grid=(tokens, heads),
        mode=launch_mode_argument(launch_mode, mode),
        HEADS=heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def merge_state_reference(o1, lse1, o2, lse2):
    """Pure-jnp twin of `merge_state`."""
    _check_merge_args(o1, lse1, o2, lse2)
    lse1 = jnp.where(lse1 == jnp.inf, -jnp.inf, lse1.astype(jnp.float32))
    lse2 = jnp.where(lse2 == jnp.inf, -jnp.inf, lse2.astype(jnp.float32))
    lse = jnp.logaddexp(lse1, lse2)
    empty = lse == -jnp.inf
    w1 = jnp.where(empty, 0.0, jnp.exp(lse1 - jnp.where(empty, 0.0, lse)))[..., None]
    w2 = jnp.where(empty, 0.0, jnp.exp(lse2 - jnp.where(empty, 0.0, lse)))[..., None]
    o = jnp.where(w1 > 0, o1.astype(jnp.float32) * w1, 0.0) + jnp.where(w2 > 0, o2.astype(jnp.float32) * w2, 0.0)
    return o.astype(o1.dtype), lse


def kernel_builds():
    """The GPU builds `merge_state` can launch (see jaxattn.aot)."""
    builds = []
    for dtype in ("fp32", "fp16", "bf16"):
        for head_dim in (64, 128, 256, 512):
            builds.append(
                build(
                    "merge_state",
                    "merge_state_kernel",
                    {"O1": f"*{dtype}", "LSE1": "*fp32", "O2": f"*{dtype}", "LSE2": "*fp32", "O_OUT": f"*{dtype}", "LSE_OUT": "*fp32"},
                    {"HEADS": 32, "HEAD_DIM": head_dim, "BLOCK_D": head_dim},
                    label=f"{dtype} head_dim={head_dim}",
                )
            )
    return builds
