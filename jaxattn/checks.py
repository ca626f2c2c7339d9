"""Every trace-time argument check of jaxattn, in one place: each raises ValueError naming the argument and what
was expected (shape, dtype, range).

The ops call one entry per call (`check_decode_args`, `check_extend_args`, `check_unified_extend_args`,
`check_attention_args`) before picking an implementation; implementations do not check again. Run-time checks of
*values* (slots inside the pool, monotone indptrs) are `jaxattn.checked`'s.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.fp8 import FP8_DTYPES

FLOAT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
INDEX_DTYPES = (jnp.int32, jnp.int64)


def index_i32(x):
    """An index array (rows, slots, page ids, lengths, offsets; int32 or int64) as int32, int64 values past int32's
    range saturated to its ends rather than wrapped: a value out of range stays out of range (a row or slot the
    rules then read as 0, a length cut to its buffer), as with `jax_enable_x64` a table entry of 2**32 + 3 must not
    become slot 3."""
    x = jnp.asarray(x)
    if x.dtype == jnp.int64:
        info = jnp.iinfo(jnp.int32)
        x = jnp.clip(x, info.min, info.max)
    return x.astype(jnp.int32)


def dtype_names(dtypes) -> str:
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
        raise ValueError(f"{name} must have dtype {dtype_names(dtypes)}; got {jnp.dtype(x.dtype).name}")


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
        raise ValueError(f"{name} must be {dtype_names(INDEX_DTYPES)}; got {dtype!r}")


def check_window(name: str, value) -> None:
    """A sliding window: -1 (none) or a static int >= 0."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < -1:
        raise ValueError(f"{name} must be -1 (no window) or a static int >= 0; got {value!r}")


def _static_float(value) -> float | None:
    """value as the float32 the kernels compute with, or None if it is not a static real number (bools are not)."""
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, (bool, np.bool_)):
        return None
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def check_sm_scale(sm_scale) -> None:
    """None (1 / sqrt(qk_head_dim)) or a float > 0 that is finite in float32 (the kernels' arithmetic): a zero,
    negative, NaN or overflowing scale would turn the masked scores' -inf into NaN or +inf, which no mask removes."""
    if sm_scale is None:
        return
    value = _static_float(sm_scale)
    if value is None or not np.isfinite(value) or not value > 0:
        raise ValueError(f"sm_scale must be None (1 / sqrt(qk_head_dim)) or a float > 0, finite in float32; got "
                         f"{sm_scale!r}")


def check_flag(name: str, value) -> None:
    """A static on/off argument: a bool (None or a string would silently pick one meaning)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool (a static flag); got {value!r}")


def check_score_options(logit_cap, xai_temperature_len) -> None:
    """logit_cap >= 0 (0: off), finite in float32; xai_temperature_len <= 0 (off) or >= 2 (log2(len) is the
    divisor)."""
    value = _static_float(logit_cap)
    if value is None or not value >= 0 or not np.isfinite(value):
        raise ValueError(f"logit_cap must be a float >= 0, finite in float32 (0: no soft cap); got {logit_cap!r}")
    if not isinstance(xai_temperature_len, (int, np.integer)) or xai_temperature_len == 1:
        raise ValueError(f"xai_temperature_len must be an int, <= 0 (off) or >= 2 (scores scale by log2(pos) / log2(len)); got {xai_temperature_len!r}")


def check_pool_extent(name: str, pool) -> None:
    """A KV pool [slots, kv_heads, ...] has at least one slot (slot 0: the padding slot the kernels read for any index
    out of range) and one kv head."""
    slots, kv_heads = pool.shape[:2]
    if slots < 1:
        raise ValueError(f"{name} must have at least one slot (slot 0 is the padding slot out-of-range indices read); "
                         f"got shape {tuple(pool.shape)}")
    if kv_heads < 1:
        raise ValueError(f"{name}.shape[1] (kv_heads) must be >= 1; got shape {tuple(pool.shape)}")


def check_heads(q_heads, kv_heads) -> None:
    """Static head counts: positive ints, q_heads a multiple of kv_heads."""
    check_positive_int("q_heads", q_heads)
    check_positive_int("kv_heads", kv_heads)
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")


def _a(name: str) -> str:
    return ("an " if name[0] in "AEIOM" else "a ") + name


def check_meta(meta, meta_type, builder: str) -> None:
    """`meta` must be an instance of `meta_type` (built by `builder`)."""
    if not isinstance(meta, meta_type):
        raise ValueError(f"meta must be {_a(meta_type.__name__)} (see {builder}); got {type(meta).__name__}")


def check_config(config, config_types) -> None:
    """`config` is None or an instance of one of `config_types` (the implementations' config classes)."""
    if config is not None and not isinstance(config, tuple(config_types)):
        names = " or ".join(_a(t.__name__) for t in config_types)
        raise ValueError(f"config must be {names} or None; got {type(config).__name__}")


def check_pool_dtype(name: str, pool, q_dtype) -> None:
    """A KV pool holds q's dtype, or an fp8 format (e4m3fn / e5m2) that the kernels read directly."""
    allowed = (q_dtype,) + FP8_DTYPES
    if not any(jnp.dtype(pool.dtype) == jnp.dtype(d) for d in allowed):
        raise ValueError(f"{name} must have q's dtype {jnp.dtype(q_dtype).name} or an fp8 format "
                         f"({dtype_names(FP8_DTYPES)}); got {jnp.dtype(pool.dtype).name}")


def check_kv_scale(name: str, scale, kv_heads: int) -> None:
    """None, a finite Python float > 0, or a float array of shape [] / [1] / [kv_heads] (`jaxattn.fp8`)."""
    if scale is None:
        return
    if hasattr(scale, "shape") and hasattr(scale, "dtype"):
        if tuple(scale.shape) not in ((), (1,), (kv_heads,)):
            raise ValueError(f"{name} must be a scalar or have shape ({kv_heads},) (one per kv head); got shape {tuple(scale.shape)}")
        if not jnp.issubdtype(scale.dtype, jnp.floating):
            raise ValueError(f"{name} must be a float array; got dtype {jnp.dtype(scale.dtype).name}")
        return
    if isinstance(scale, bool) or not (isinstance(scale, numbers.Real) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name} must be None, a finite float > 0 or a float array [] / [kv_heads] (the pool stores value / scale); got {scale!r}")


def jit_with_kv_scales(static_argnames: tuple[str, ...]):
    """`jax.jit(op, static_argnames=...)` for an op taking k_scale / v_scale (None, Python numbers or float arrays).

    Python number scales (SGLang's per-layer scales) are checked here, before jit would turn them into tracers (a
    traced value cannot be tested at trace time), and are static arguments, as sm_scale is: constants of the compiled
    op, where traced ones make XLA broadcast the scale table in a kernel of its own on every call (a launch and a gap:
    an fp8 decode call's cost on the GPU's clock, RESULTS, forty-first session). Array scales stay traced and are
    checked inside, with the pool's heads."""

    def decorate(op):
        traced = jax.jit(op, static_argnames=static_argnames)
        constant = jax.jit(op, static_argnames=(*static_argnames, "k_scale", "v_scale"))

        @functools.wraps(traced)
        def checked_op(*args, k_scale=None, v_scale=None, **kwargs):
            for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
                if not hasattr(scale, "shape"):
                    check_kv_scale(name, scale, kv_heads=1)
            jitted = traced if hasattr(k_scale, "shape") or hasattr(v_scale, "shape") else constant
            return jitted(*args, k_scale=k_scale, v_scale=v_scale, **kwargs)

        return checked_op

    return decorate


# ---------------------------------------------------------------------------------------------
# The ops' argument checks (one call per op call, before an implementation is chosen).


def check_sinks(sinks, q_heads: int) -> None:
    """Attention sinks: None, or one natural-log logit per q head, float[q_heads]."""
    if sinks is not None:
        check_array("sinks", sinks, shape=(q_heads,), dtypes=FLOAT_DTYPES, what="[q_heads]")


def check_attention_args(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, sinks=None, custom_mask=None, mask_indptr=None,
                         sm_scale=None, k_scale=None, v_scale=None):
    """The ragged paged layout shared by the reference and every op. Returns (batch, group_size)."""
    check_sm_scale(sm_scale)
    check_array("q", q, ndim=3, dtypes=FLOAT_DTYPES, what="[tokens, q_heads, qk_head_dim]")
    tokens, q_heads, qk_dim = q.shape
    check_array("k_pool", k_pool, ndim=3, what="[slots, kv_heads, qk_head_dim]")
    check_pool_extent("k_pool", k_pool)
    slots, kv_heads, _ = k_pool.shape
    check_array("k_pool", k_pool, shape=(None, None, qk_dim), what="[slots, kv_heads, qk_head_dim] (qk_head_dim of q)")
    check_array("v_pool", v_pool, shape=(slots, kv_heads, None), what="[slots, kv_heads, v_head_dim]")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}, q.shape[1]) must be a multiple of kv_heads ({kv_heads}, k_pool.shape[1])")
    check_array("qo_indptr", qo_indptr, ndim=1, dtypes=INDEX_DTYPES, what="[batch + 1]")
    batch = qo_indptr.shape[0] - 1
    check_array("kv_indptr", kv_indptr, shape=(batch + 1,), dtypes=INDEX_DTYPES,
                what=f"[batch + 1], batch = qo_indptr.shape[0] - 1 = {batch} (one of the two has the wrong length)")
    check_array("kv_indices", kv_indices, ndim=1, dtypes=INDEX_DTYPES, what="[kv_capacity]")
    check_sinks(sinks, q_heads)
    if custom_mask is not None:
        check_array("custom_mask", custom_mask, ndim=1, dtypes=MASK_DTYPES, what="[mask_len] (flat, per sequence row-major [q_len, kv_len])")
        if mask_indptr is None:
            raise ValueError("mask_indptr (i64/i32[batch + 1]) is required with custom_mask")
        check_array("mask_indptr", mask_indptr, shape=(batch + 1,), dtypes=INDEX_DTYPES, what="[batch + 1]")
    check_kv_scale("k_scale", k_scale, kv_heads)
    check_kv_scale("v_scale", v_scale, kv_heads)
    return batch, q_heads // kv_heads


# MLA latent caches: V is the first v_head_dim dims of K (DeepSeek's 576 = 512 latent + 64 rope; 288 = 256 + 32).
MLA_V_HEAD_DIMS = {576: 512, 288: 256}


def latent_v_head_dim(v_head_dim, qk_dim: int) -> int:
    """V's width in a latent (MLA) cache, V = the first v_head_dim dims of K: the given int (numpy ints too) in (0,
    qk_dim], or MLA_V_HEAD_DIMS' default for qk_dim when None."""
    v_head_dim = MLA_V_HEAD_DIMS.get(qk_dim) if v_head_dim is None else v_head_dim
    if (not isinstance(v_head_dim, (int, np.integer)) or isinstance(v_head_dim, (bool, np.bool_))
            or not 0 < v_head_dim <= qk_dim):
        raise ValueError(
            f"v_head_dim must be given as an int (0 < v_head_dim <= qk_head_dim = {qk_dim}) for a latent cache (V = the "
            f"first v_head_dim dims of K; defaults exist for {sorted(MLA_V_HEAD_DIMS)}); got {v_head_dim!r}"
        )
    return int(v_head_dim)


# Query tokens per sequence a decode call takes (speculative verify, multi-token prediction): a draft mask holds
# one bit per draft in an int32.
MAX_DECODE_QUERY_TOKENS = 32


def check_decode_args(q, k_pool, v_pool, meta, *, meta_type, sinks, v_head_dim, sliding_window, logit_cap=0.0,
                      xai_temperature_len=-1, sm_scale=None, k_scale=None, v_scale=None, draft_mask=None):
    """`decode_attention`'s arguments. Returns (batch, q_heads, kv_heads, qk_head_dim, v_head_dim)."""
    check_sm_scale(sm_scale)
    if getattr(q, "ndim", None) == 4:  # several query tokens per sequence
        check_array("q", q, ndim=4, dtypes=FLOAT_DTYPES, what="[batch, tokens_per_seq, q_heads, qk_head_dim]")
        batch, tokens, q_heads, qk_dim = q.shape
        if not 1 <= tokens <= MAX_DECODE_QUERY_TOKENS:
            raise ValueError(f"q.shape[1] (query tokens per sequence) must be in [1, {MAX_DECODE_QUERY_TOKENS}]; got {tokens}")
        if draft_mask is not None:
            check_array("draft_mask", draft_mask, shape=(batch, tokens), dtypes=(jnp.int32, jnp.uint32),
                        what="[batch, tokens_per_seq] (bit j: the token sees draft j)")
    else:
        check_array("q", q, ndim=3, dtypes=FLOAT_DTYPES,
                    what="[batch, q_heads, qk_head_dim] (or [batch, tokens_per_seq, q_heads, qk_head_dim])")
        batch, q_heads, qk_dim = q.shape
        if draft_mask is not None:
            raise ValueError("draft_mask needs several query tokens per sequence: q [batch, tokens_per_seq, q_heads, "
                             "qk_head_dim]")
        tokens = 1
    check_array("k_pool", k_pool, ndim=3, what="[slots, kv_heads, qk_head_dim]")
    check_pool_dtype("k_pool", k_pool, q.dtype)
    check_pool_extent("k_pool", k_pool)
    slots, kv_heads, _ = k_pool.shape
    check_array("k_pool", k_pool, shape=(None, None, qk_dim), what="[slots, kv_heads, qk_head_dim] (qk_head_dim of q)")
    if v_pool is None:
        if v_scale is not None:
            raise ValueError("v_scale must be None when v_pool is None: V is part of K's buffer, scaled by k_scale")
        v_head_dim = latent_v_head_dim(v_head_dim, qk_dim)
    else:
        check_array("v_pool", v_pool, shape=(slots, kv_heads, None), what="[slots, kv_heads, v_head_dim]")
        check_pool_dtype("v_pool", v_pool, q.dtype)
        if v_head_dim is not None and v_head_dim != v_pool.shape[2]:
            raise ValueError(f"v_head_dim ({v_head_dim}) must match v_pool.shape[2] ({v_pool.shape[2]}) or be None")
        v_head_dim = v_pool.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}, q.shape[1]) must be a multiple of kv_heads ({kv_heads}, k_pool.shape[1])")
    check_head_dims(qk_dim, v_head_dim, qk_name="qk_head_dim (q.shape[2])",
                    v_name="v_head_dim" + (" (v_pool.shape[2])" if v_pool is not None else ""))
    check_meta(meta, meta_type, "decode_metadata")
    if meta.batch != batch:
        raise ValueError(f"meta batch ({meta.batch}, meta.kv_indptr.shape[0] - 1) must equal q.shape[0] ({batch})")
    if tokens > 1 and (sliding_window >= 0 or meta.sliding_window >= 0):
        raise ValueError("several query tokens per sequence (q.shape[1] > 1) take no sliding window: use "
                         "extend_attention for windowed verify")
    if tokens > 1 and xai_temperature_len > 0:
        raise ValueError("several query tokens per sequence (q.shape[1] > 1) take no xai temperature: use extend_attention")
    check_sinks(sinks, q_heads)
    check_window("sliding_window", sliding_window)
    check_score_options(logit_cap, xai_temperature_len)
    check_kv_scale("k_scale", k_scale, kv_heads)
    check_kv_scale("v_scale", v_scale, kv_heads)
    if meta.sliding_window >= 0 and sliding_window > meta.sliding_window:
        raise ValueError(
            f"sliding_window ({sliding_window}) must not exceed meta.sliding_window ({meta.sliding_window}): the KV "
            "lists were trimmed to that window"
        )
    return batch, q_heads, kv_heads, qk_dim, v_head_dim


def check_extend_args(q, k_pool, v_pool, meta, *, meta_type, builder, custom_mask, sinks, sliding_window, config=None,
                      config_types=(), logit_cap=0.0, xai_temperature_len=-1, sm_scale=None, k_scale=None, v_scale=None,
                      causal=True, skip_prefix_custom_mask=True):
    """The arguments both extend forms share (`extend_attention`, `extend_attention_unified`). Returns the batch."""
    check_flag("causal", causal)
    check_flag("skip_prefix_custom_mask", skip_prefix_custom_mask)
    check_array("q", q, ndim=3, dtypes=FLOAT_DTYPES, what="[tokens, q_heads, qk_head_dim]")
    check_meta(meta, meta_type, builder)
    batch, _ = check_attention_args(q, k_pool, v_pool, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, sinks, custom_mask,
                                    meta.mask_indptr if custom_mask is not None else None, sm_scale=sm_scale,
                                    k_scale=k_scale, v_scale=v_scale)
    check_head_dims(q.shape[2], v_pool.shape[2], qk_name="qk_head_dim (q.shape[2])", v_name="v_head_dim (v_pool.shape[2])")
    check_array("meta.kv_start_pos", meta.kv_start_pos, shape=(batch,), dtypes=INDEX_DTYPES, what="[batch]")
    check_array("meta.kv_indices", meta.kv_indices, shape=(meta.kv_capacity,), what="[meta.kv_capacity]")
    check_positive_int("meta.max_extend_len", meta.max_extend_len)
    check_page_size(meta.page_size, "meta.page_size")
    check_window("sliding_window", sliding_window)
    check_score_options(logit_cap, xai_temperature_len)
    check_pool_dtype("k_pool", k_pool, q.dtype)
    check_pool_dtype("v_pool", v_pool, q.dtype)
    if custom_mask is not None:
        check_array("custom_mask", custom_mask, ndim=1, dtypes=MASK_DTYPES, what="[mask_len]")
    if meta.sliding_window >= 0 and not (0 <= sliding_window <= meta.sliding_window):
        raise ValueError(
            f"sliding_window ({sliding_window}) must be in [0, {meta.sliding_window}]: meta's prefix lists were cut for a "
            f"window of {meta.sliding_window}, so they lack keys a wider (or no) window would see"
        )
    check_config(config, config_types)
    return batch


def check_extend_draft_mask(q, draft_mask, custom_mask) -> None:
    """The two-stage form's compact tree mask: i32/u32[tokens, words], one row per query row, never beside a
    custom mask."""
    if draft_mask is None:
        return
    if custom_mask is not None:
        raise ValueError("give custom_mask or draft_mask, not both (draft_mask is the compact form of a tree mask)")
    check_array("draft_mask", draft_mask, ndim=2, dtypes=(jnp.int32, jnp.uint32),
                what="[tokens, words] (row r: bit j % 32 of word j // 32 = it sees its sequence's new token j)")
    if draft_mask.shape[0] != q.shape[0] or draft_mask.shape[1] < 1:
        raise ValueError(f"draft_mask must have q's {q.shape[0]} rows and at least one word per row; got shape "
                         f"{tuple(draft_mask.shape)}")


def check_new_tokens(q, k_new, v_new, k_pool, v_pool) -> None:
    """The two-stage form's contiguous new-token K/V: the rows of q, the pool's heads and dims, q's dtype."""
    tokens, _, qk_dim = q.shape
    kv_heads, v_dim = v_pool.shape[1], v_pool.shape[2]
    check_array("k_new", k_new, shape=(tokens, kv_heads, qk_dim), dtypes=(q.dtype,), what="[tokens, kv_heads, qk_head_dim]")
    check_array("v_new", v_new, shape=(tokens, kv_heads, v_dim), dtypes=(q.dtype,), what="[tokens, kv_heads, v_head_dim]")


# ---------------------------------------------------------------------------------------------
# Metadata builders' arguments.


def check_kv_list_args(req_pool_indices, kv_lens, kv_starts) -> int:
    """The per-sequence arguments of a key-list builder (`jaxattn.kv_indices.create_kv_indices`,
    `jaxattn.paging.create_kv_indices_from_pages`): rows, lengths and optional starts. Returns the batch."""
    check_array("req_pool_indices", req_pool_indices, ndim=1, dtypes=INDEX_DTYPES, what="[batch]")
    batch = req_pool_indices.shape[0]
    check_array("kv_lens", kv_lens, shape=(batch,), dtypes=INDEX_DTYPES, what="[batch]")
    if kv_starts is not None:
        check_array("kv_starts", kv_starts, shape=(batch,), dtypes=INDEX_DTYPES, what="[batch]")
    return batch


def check_request_tables(req_to_token, req_pool_indices, prefix_lens, extend_lens) -> int:
    """An extend batch's request tables (the builders and `jaxattn.checked`). Returns the batch."""
    check_array("req_to_token", req_to_token, ndim=2, dtypes=INDEX_DTYPES, what="[max_reqs, max_context_len]")
    check_array("req_pool_indices", req_pool_indices, ndim=1, dtypes=INDEX_DTYPES, what="[batch]")
    batch = req_pool_indices.shape[0]
    check_array("prefix_lens", prefix_lens, shape=(batch,), dtypes=INDEX_DTYPES, what="[batch]")
    check_array("extend_lens", extend_lens, shape=(batch,), dtypes=INDEX_DTYPES, what="[batch]")
    return batch


def check_extend_builder_args(req_to_token, req_pool_indices, prefix_lens, extend_lens, max_extend_len, kv_capacity,
                              sliding_window=-1, index_dtype=jnp.int32) -> None:
    check_request_tables(req_to_token, req_pool_indices, prefix_lens, extend_lens)
    check_positive_int("max_extend_len", max_extend_len)
    check_positive_int("kv_capacity", kv_capacity)
    check_window("sliding_window", sliding_window)
    check_index_dtype("index_dtype", index_dtype)


# Page sizes the paged layout takes (`jaxattn.paging`); issue 23. Page 1 is today's token-slot layout.
PAGE_SIZES = (1, 8, 16, 32, 64, 128)

# Slots are int32 in the index lists and kernels: a page's slots must stay below 2**31.
MAX_SLOTS = 2**31 - 1


def check_page_size(page_size, name: str = "page_size") -> None:
    """A static page size, one of PAGE_SIZES."""
    if not isinstance(page_size, (int, np.integer)) or isinstance(page_size, bool) or page_size not in PAGE_SIZES:
        raise ValueError(f"{name} must be one of {PAGE_SIZES} (a static Python int); got {page_size!r}")


def check_page_args(req_to_page, page_size, num_slots) -> None:
    """A page table and its pool: req_to_page i32/i64[max_reqs, max_pages], page_size in PAGE_SIZES, num_slots (the
    pool's rows) a positive multiple of page_size below 2**31."""
    check_array("req_to_page", req_to_page, ndim=2, dtypes=INDEX_DTYPES, what="[max_reqs, max_pages]")
    check_page_size(page_size)
    check_positive_int("num_slots", num_slots)
    if num_slots % page_size:
        raise ValueError(f"num_slots ({num_slots}, the pool's rows) must be a multiple of page_size ({page_size}): "
                         "pages are page-aligned runs of slots")
    if num_slots > MAX_SLOTS:
        raise ValueError(f"num_slots must be at most {MAX_SLOTS} (slots are int32); got {num_slots}")


def check_split_knobs(split_tile_size, min_split_len, programs_per_sm, num_sms) -> None:
    """The split heuristic's static knobs (`decode_metadata`): positive ints (num_sms None: the device's)."""
    check_positive_int("split_tile_size", split_tile_size)
    check_positive_int("min_split_len", min_split_len)
    check_positive_int("programs_per_sm", programs_per_sm)
    if num_sms is not None:
        check_positive_int("num_sms", num_sms)


def check_split_args(max_kv_splits, deterministic, split_tile_size, max_context_len) -> None:
    """Decode's static split bound: in deterministic mode max_kv_splits * split_tile_size covers the longest list."""
    check_positive_int("max_kv_splits", max_kv_splits)
    check_positive_int("split_tile_size", split_tile_size)
    if deterministic and max_kv_splits * split_tile_size < max_context_len:
        raise ValueError(
            f"max_kv_splits ({max_kv_splits}) x split_tile_size ({split_tile_size}) must cover the longest context "
            f"({max_context_len}) in deterministic mode: use max_kv_splits >= {-(-max_context_len // split_tile_size)}"
        )


def launch_mode_argument(launch_mode, mode):
    """The ops' launch mode keyword: `launch_mode` ("gpu", "interpret" or None), or its old name `mode`."""
    if mode is not None:
        if launch_mode is not None and launch_mode != mode:
            raise ValueError(f"launch_mode ({launch_mode!r}) and its old name mode ({mode!r}) disagree: give launch_mode only")
        return mode
    return launch_mode
