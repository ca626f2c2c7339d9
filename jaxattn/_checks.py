"""Trace-time argument checks that raise ValueError naming the argument and what was expected."""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
INDEX_DTYPES = (jnp.int32, jnp.int64)


def _dtype_names(dtypes) -> str:
    return "/".join(np.dtype(d).name for d in dtypes)


def check_array(
    name: str,
    x,
    *,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    dtypes: Sequence | None = None,
    what: str = "",
) -> None:
    """Checks rank, shape (None matches any size) and dtype of argument `name`.

    `what` describes the expected layout in the message, e.g. "[tokens, q_heads, head_dim]".
    """
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array{(' ' + what) if what else ''}; got {type(x).__name__}")
    layout = f" {what}" if what else ""
    if ndim is None and shape is not None:
        ndim = len(shape)
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim}{layout}; got shape {tuple(x.shape)}")
    if shape is not None:
        for axis, (got, want) in enumerate(zip(x.shape, shape)):
            if want is not None and got != want:
                expected = tuple("*" if s is None else s for s in shape)
                raise ValueError(f"{name} must have shape {expected}{layout}; got {tuple(x.shape)} (axis {axis})")
    if dtypes is not None and not any(jnp.dtype(x.dtype) == jnp.dtype(d) for d in dtypes):
        raise ValueError(f"{name} must have dtype {_dtype_names(dtypes)}; got {jnp.dtype(x.dtype).name}")


def check_positive_int(name: str, value) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive Python int (a static size); got {value!r}")
