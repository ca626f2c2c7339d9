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


MASK_DTYPES = (jnp.bool_, jnp.uint8, jnp.int8)

# Head dims the kernels support: tl.dot needs 16 along every dimension on the GPU, and the largest tiles the sm_90
# tables cover are MLA's 576 (q/k: 512 latent + 64 rope) and 512 (v).
MIN_HEAD_DIM = 16
MAX_QK_HEAD_DIM = 576
MAX_V_HEAD_DIM = 512


def check_head_dims(qk_head_dim: int, v_head_dim: int, *, qk_name: str, v_name: str) -> None:
    """Raises unless MIN_HEAD_DIM <= qk_head_dim <= MAX_QK_HEAD_DIM and MIN_HEAD_DIM <= v_head_dim <= MAX_V_HEAD_DIM."""
    for name, value, top in ((qk_name, qk_head_dim, MAX_QK_HEAD_DIM), (v_name, v_head_dim, MAX_V_HEAD_DIM)):
        if not MIN_HEAD_DIM <= value <= top:
            raise ValueError(f"{name} (a head dim) must be in [{MIN_HEAD_DIM}, {top}] (the kernels' supported range); got {value}")


def check_index_dtype(name: str, dtype) -> None:
    """`dtype` (a requested output dtype) must be int32 or int64."""
    try:
        ok = any(jnp.dtype(dtype) == jnp.dtype(d) for d in INDEX_DTYPES)
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} must be {_dtype_names(INDEX_DTYPES)}; got {dtype!r}")


def check_window(name: str, value) -> None:
    """A sliding window: -1 (none) or a static int >= 0."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < -1:
        raise ValueError(f"{name} must be -1 (no window) or a static int >= 0; got {value!r}")


def check_score_options(logit_cap, xai_temperature_len) -> None:
    """logit_cap >= 0 (0: off); xai_temperature_len <= 0 (off) or >= 2 (log2(len) is the divisor)."""
    if not isinstance(logit_cap, (int, float, np.integer, np.floating)) or not logit_cap >= 0 or not np.isfinite(logit_cap):
        raise ValueError(f"logit_cap must be a finite float >= 0 (0: no soft cap); got {logit_cap!r}")
    if not isinstance(xai_temperature_len, (int, np.integer)) or xai_temperature_len == 1:
        raise ValueError(f"xai_temperature_len must be an int, <= 0 (off) or >= 2 (scores scale by log2(pos) / log2(len)); got {xai_temperature_len!r}")
