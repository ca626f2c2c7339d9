"""Decode attention (one new query token per sequence) over the paged KV pool: split-KV Triton kernels.

Semantics are `jaxattn.reference`'s (score order scale -> soft cap -> xai temperature -> mask; a sliding
window W keeps W + 1 keys; sinks add exp(sink) to the denominator only; empty rows give 0 and LSE -inf).
The query of sequence b is the last token of its KV list, its K/V already written to the pool.

Three layers:
  * `decode_metadata` / `decode_metadata_from_indptr` (jit-friendly, no host sync) build a `DecodeMetadata`
    pytree once per batch: the CSR KV lists and the number of KV splits of every sequence.
  * `decode_attention(q, k_pool, v_pool, meta, ...)` runs stage 1 (one program per sequence x kv-head
    block x split, `tl.dot` over BLOCK_H q heads of one kv head; for MHA the vector kernel, one q head per
    program with multiply-and-sum instead of a 16-row dot) and stage 2 (merge the splits with their LSEs, add
    the sink).
  * `decode_attention_reference(q, k_pool, v_pool, meta, ...)`: the same call on the pure-jnp reference.

MLA: pass ``v_pool=None`` (and ``v_head_dim``, default 512 for qk_head_dim 576 and 256 for 288) when V is
the first ``v_head_dim`` dims of K, as in DeepSeek's latent cache: the kernel then reuses the K tile it already
loaded instead of reading V a second time. A JAX array cannot be a strided view, so this is the way to avoid
materialising ``k_pool[..., :512]``.

Example::

    meta = decode_metadata(req_to_token, req_pool_indices, seq_lens, kv_capacity=4096,
                           q_heads=32, kv_heads=8)
    o = decode_attention(q, k_pool, v_pool, meta)            # [batch, 32, head_dim]
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import triton

from jaxattn._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_array,
    check_head_dims,
    check_positive_int,
    check_score_options,
    check_window,
)
from jaxattn.kv_indices import create_kv_indices, exclusive_cumsum
from jaxattn.launch import launch, launch_mode
from jaxattn.reference import ragged_paged_attention_reference

MIN_BLOCK_KV = 32  # split lengths are multiples of this (SGLang's _MIN_BLOCK_KV)
DEFAULT_MAX_KV_SPLITS_CAP = 64
H200_NUM_SMS = 132


# ---------------------------------------------------------------------------------------------
# Metadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeMetadata:
    """Per-batch decode metadata (a pytree: arrays are leaves, sizes are static).

    Batch rows past the real batch are padding: seq_len 0, an empty KV list, output 0.
    """

    kv_indptr: jax.Array  # i32[max_batch + 1]: CSR offsets into kv_indices
    kv_indices: jax.Array  # i32/i64[kv_capacity]: pool slots of the listed keys, sequence after sequence
    num_kv_splits: jax.Array  # i32[max_batch]: KV splits per sequence (clamped to [1, max_kv_splits] by the kernels)
    seq_lens: jax.Array  # i32[max_batch]: full sequence lengths (current token included); query position = seq_len - 1
    max_kv_splits: int = dataclasses.field(metadata=dict(static=True))  # grid size of the split axis; partial buffers
    kv_capacity: int = dataclasses.field(metadata=dict(static=True))  # static length of kv_indices
    sliding_window: int = dataclasses.field(default=-1, metadata=dict(static=True))  # W the lists were trimmed to, -1: none
    deterministic: bool = dataclasses.field(default=False, metadata=dict(static=True))  # splits depend on the length only
    max_kv_len: int | None = dataclasses.field(default=None, metadata=dict(static=True))  # bound on listed keys per sequence

    def __post_init__(self):
        if isinstance(self.kv_indptr, (jax.Array, np.ndarray)) and hasattr(self.kv_indptr, "shape"):
            check_array("kv_indptr", self.kv_indptr, ndim=1, dtypes=INDEX_DTYPES, what="[max_batch + 1]")
            batch = self.kv_indptr.shape[0] - 1
            check_array("kv_indices", self.kv_indices, shape=(self.kv_capacity,), dtypes=INDEX_DTYPES, what="[kv_capacity]")
            check_array("num_kv_splits", self.num_kv_splits, shape=(batch,), dtypes=INDEX_DTYPES, what="[max_batch]")
            check_array("seq_lens", self.seq_lens, shape=(batch,), dtypes=INDEX_DTYPES, what="[max_batch]")
        check_positive_int("max_kv_splits", self.max_kv_splits)

    @property
    def batch(self) -> int:
        return self.kv_indptr.shape[0] - 1


def _head_blocks(q_heads, kv_heads, block_h=16):
    group = q_heads // kv_heads
    return kv_heads * -(-group // block_h)


def _window_lengths(seq_lens, sliding_window):
    seq_lens = jnp.maximum(seq_lens.astype(jnp.int32), 0)
    if sliding_window >= 0:
        return jnp.minimum(seq_lens, sliding_window + 1)
    return seq_lens


def default_max_kv_splits(max_batch, q_heads, kv_heads, max_context_len, *, deterministic=False, split_tile_size=256,
                          num_sms=H200_NUM_SMS, programs_per_sm=8, min_split_len=256):
    """A static split bound: the most splits the dynamic heuristic would want, at most 64.

    Stage 1 launches max_batch x head_blocks x max_kv_splits programs and the unused ones exit at once, but
    they are not free (D3, 256 x 1024 on the H200: 89.5% of the floor with a bound of 2, 90.4% with 1): keep this
    small for big batches. x2 slack for padding rows (a half-full bucket wants twice the splits) only when the full
    bucket needs more than one split; a bucket that fills the GPU with one split still gives a half-full batch
    about programs_per_sm / 2 programs per SM. Deterministic: ceil(max_context_len / split_tile_size).
    """
    if deterministic:
        return max(1, -(-max_context_len // split_tile_size))
    per_split = max(1, max_batch * _head_blocks(q_heads, kv_heads))
    by_fill = -(-num_sms * programs_per_sm // per_split)
    if by_fill > 1:
        by_fill *= 2
    by_len = max(1, -(-max_context_len // min_split_len))
    return int(max(1, min(DEFAULT_MAX_KV_SPLITS_CAP, by_fill, by_len)))


def num_kv_splits_heuristic(eff_lens, *, max_kv_splits, q_heads, kv_heads, deterministic=False, split_tile_size=256,
                            num_sms=H200_NUM_SMS, programs_per_sm=8, min_split_len=256):
    """i32[batch] splits per sequence, computed on device (no host sync).

    Dynamic (default): pick one split count S for the longest sequence so that the stage-1 grid
    (active sequences x head blocks x S) gives about `programs_per_sm` programs per multiprocessor and every
    split keeps at least `min_split_len` keys; then give every sequence ceil(len / chunk) splits with
    chunk = ceil(max_len / S), so splits have about the same size across the batch. Not capped at 8 (SGLang's
    default): batch 8 x 32k with 8 kv heads gets 17 splits. Deterministic: ceil(len / split_tile_size),
    which depends on the sequence's own length only (batch invariance).
    """
    eff_lens = eff_lens.astype(jnp.int32)
    if deterministic:
        splits = (eff_lens + split_tile_size - 1) // split_tile_size
        return jnp.clip(splits, 1, max_kv_splits).astype(jnp.int32)
    max_len = jnp.max(eff_lens, initial=0)
    active = jnp.maximum(jnp.sum(eff_lens > 0), 1)
    per_split_programs = active * _head_blocks(q_heads, kv_heads)
    by_fill = (num_sms * programs_per_sm + per_split_programs - 1) // per_split_programs
    by_len = jnp.maximum((max_len + min_split_len - 1) // min_split_len, 1)
    target = jnp.clip(jnp.minimum(by_fill, by_len), 1, max_kv_splits)
    chunk = jnp.maximum((max_len + target - 1) // target, 1)
    splits = (eff_lens + chunk - 1) // chunk
    return jnp.clip(splits, 1, max_kv_splits).astype(jnp.int32)


def _check_split_args(max_kv_splits, deterministic, split_tile_size, max_context_len):
    check_positive_int("max_kv_splits", max_kv_splits)
    check_positive_int("split_tile_size", split_tile_size)
    if deterministic and max_kv_splits * split_tile_size < max_context_len:
        raise ValueError(
            f"max_kv_splits ({max_kv_splits}) x split_tile_size ({split_tile_size}) must cover the longest context "
            f"({max_context_len}) in deterministic mode: use max_kv_splits >= {-(-max_context_len // split_tile_size)}"
        )


def _check_heads(q_heads, kv_heads):
    check_positive_int("q_heads", q_heads)
    check_positive_int("kv_heads", kv_heads)
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")


@functools.partial(
    jax.jit,
    static_argnames=("kv_capacity", "max_kv_splits", "q_heads", "kv_heads", "deterministic", "split_tile_size",
                     "sliding_window", "num_sms", "programs_per_sm", "min_split_len", "mode"),
)
def decode_metadata(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    seq_lens: jax.Array,
    *,
    kv_capacity: int,
    q_heads: int,
    kv_heads: int,
    max_kv_splits: int | None = None,
    deterministic: bool = False,
    split_tile_size: int = 256,
    sliding_window: int = -1,
    num_sms: int = H200_NUM_SMS,
    programs_per_sm: int = 8,
    min_split_len: int = 256,
    mode: str | None = None,
) -> DecodeMetadata:
    """Builds the decode metadata of a batch from SGLang's request tables, on device.

    Args:
      req_to_token: i32[max_reqs, max_context_len]. Pool slot of every token of every request row.
      req_pool_indices: i32[max_batch]. The req_to_token row of each sequence.
      seq_lens: i32[max_batch]. Sequence lengths including the current token; 0 for padding rows.
      kv_capacity: static length of the KV index list (>= the batch's total listed keys).
      q_heads, kv_heads: the layer's head counts (the split heuristic sizes the stage-1 grid with them).
      max_kv_splits: static split bound (the partial buffers' size); default `default_max_kv_splits`.
      deterministic: splits = ceil(len / split_tile_size): a sequence's result does not depend on the batch.
      sliding_window: W >= 0 lists only the last min(seq_len, W + 1) keys of each sequence.
      num_sms, programs_per_sm, min_split_len: the dynamic split heuristic's knobs (see `num_kv_splits_heuristic`).
      mode: launch mode of the index kernel.

    Returns:
      A `DecodeMetadata`.
    """
    check_array("req_to_token", req_to_token, ndim=2, dtypes=INDEX_DTYPES, what="[max_reqs, max_context_len]")
    check_array("req_pool_indices", req_pool_indices, ndim=1, dtypes=INDEX_DTYPES, what="[max_batch]")
    check_array("seq_lens", seq_lens, shape=(req_pool_indices.shape[0],), dtypes=INDEX_DTYPES,
                what="[max_batch] (one per req_pool_indices entry)")
    _check_heads(q_heads, kv_heads)
    check_positive_int("kv_capacity", kv_capacity)
    check_window("sliding_window", sliding_window)
    seq_lens = jnp.maximum(seq_lens.astype(jnp.int32), 0)
    listed = _window_lengths(seq_lens, sliding_window)
    kv_indptr, kv_indices = create_kv_indices(
        req_to_token, req_pool_indices, listed, seq_lens - listed, capacity=kv_capacity, mode=mode
    )
    # The lists hold at most min(max_context_len, W + 1) keys each; the split bound and heuristic are shared.
    max_listed = req_to_token.shape[1] if sliding_window < 0 else min(req_to_token.shape[1], sliding_window + 1)
    return decode_metadata_from_indptr(
        kv_indptr, kv_indices, seq_lens, q_heads=q_heads, kv_heads=kv_heads, max_kv_splits=max_kv_splits,
        deterministic=deterministic, split_tile_size=split_tile_size, sliding_window=sliding_window,
        max_context_len=max_listed, num_sms=num_sms, programs_per_sm=programs_per_sm, min_split_len=min_split_len,
    )


@functools.partial(
    jax.jit,
    static_argnames=("max_kv_splits", "q_heads", "kv_heads", "deterministic", "split_tile_size", "sliding_window",
                     "max_context_len", "num_sms", "programs_per_sm", "min_split_len"),
)
def decode_metadata_from_indptr(
    kv_indptr: jax.Array,
    kv_indices: jax.Array,
    seq_lens: jax.Array | None = None,
    *,
    q_heads: int,
    kv_heads: int,
    max_kv_splits: int | None = None,
    deterministic: bool = False,
    split_tile_size: int = 256,
    sliding_window: int = -1,
    max_context_len: int | None = None,
    num_sms: int = H200_NUM_SMS,
    programs_per_sm: int = 8,
    min_split_len: int = 256,
) -> DecodeMetadata:
    """Decode metadata for callers that already hold CSR KV lists.

    Args:
      kv_indptr: i32[max_batch + 1]. kv_indices: i32/i64[kv_capacity]. The keys each sequence attends to, in
        position order, ending with the current token.
      seq_lens: optional i32[max_batch], the full sequence lengths (default: the list lengths). Only matters
        when the lists start after position 0 (e.g. already trimmed to a window) and xai temperature is used.
      sliding_window: W >= 0 when the lists are (or may be) longer than W + 1: the kernels then attend to the
        last W + 1 listed keys only, and the splits are sized for that.
      max_context_len: static bound on the listed keys per sequence (default kv_capacity); in deterministic mode
        max_kv_splits * split_tile_size must cover it.
      Others: see `decode_metadata`.
    """
    check_array("kv_indptr", kv_indptr, ndim=1, dtypes=INDEX_DTYPES, what="[max_batch + 1]")
    check_array("kv_indices", kv_indices, ndim=1, dtypes=INDEX_DTYPES, what="[kv_capacity]")
    batch = kv_indptr.shape[0] - 1
    if seq_lens is not None:
        check_array("seq_lens", seq_lens, shape=(batch,), dtypes=INDEX_DTYPES, what="[max_batch]")
    _check_heads(q_heads, kv_heads)
    check_window("sliding_window", sliding_window)
    if max_context_len is not None:
        check_positive_int("max_context_len", max_context_len)
    kv_capacity = kv_indices.shape[0]
    max_ctx = kv_capacity if max_context_len is None else int(max_context_len)
    if sliding_window >= 0:
        max_ctx = min(max_ctx, sliding_window + 1)
    if max_kv_splits is None:
        max_kv_splits = default_max_kv_splits(
            batch, q_heads, kv_heads, max_ctx, deterministic=deterministic, split_tile_size=split_tile_size,
            num_sms=num_sms, programs_per_sm=programs_per_sm, min_split_len=min_split_len,
        )
    _check_split_args(max_kv_splits, deterministic, split_tile_size, max_ctx)
    kv_indptr = kv_indptr.astype(jnp.int32)
    kv_lens = jnp.maximum(kv_indptr[1:] - kv_indptr[:-1], 0)
    seq_lens = kv_lens if seq_lens is None else seq_lens.astype(jnp.int32)
    splits = num_kv_splits_heuristic(
        _window_lengths(kv_lens, sliding_window), max_kv_splits=max_kv_splits, q_heads=q_heads, kv_heads=kv_heads,
        deterministic=deterministic, split_tile_size=split_tile_size, num_sms=num_sms, programs_per_sm=programs_per_sm, min_split_len=min_split_len,
    )
    return DecodeMetadata(kv_indptr, kv_indices, splits, seq_lens, max_kv_splits, kv_capacity, sliding_window,
                          deterministic, max_context_len)


# ---------------------------------------------------------------------------------------------
# Tuning


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Stage-1 launch configuration."""

    block_n: int = 32  # keys per loop iteration (power of 2, >= 16)
    # q heads of one kv head per program: a power of 2 >= 16 (tl.dot's minimum M) for the grouped kernel, or 1 for
    # the vector kernel (one q head per program, no tl.dot; the MHA default).
    block_h: int = 16
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_n", "block_h", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value & (value - 1):
                raise ValueError(f"DecodeConfig.{name} must be a positive power of 2; got {value!r}")
        if self.block_n < 16 or (self.block_h != 1 and self.block_h < 16):
            raise ValueError(
                f"DecodeConfig.block_n must be >= 16 and block_h 1 (vector kernel) or >= 16 (tl.dot); got {self.block_n}, "
                f"{self.block_h}"
            )
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"DecodeConfig.num_stages must be a positive int; got {self.num_stages!r}")


# Key schema: (qk_head_dim, v_head_dim, group bucket), group bucket = "g1" for MHA (falls back to "g16" when missing),
# "g16" for q_heads / kv_heads <= 16, else "g>16".
# Values are starting points for the H200 (bandwidth-bound decode: pipelined gathered loads matter most);
# the benchmark sweeps them with decode_attention(..., config=...). 128/128 and 576/512 (g16) were picked from the
# sweep of 2026-12-02 on the H200 (benchmarks/results/): the best all-rounder over D1-D3, and the best MLA config.
SM90_CONFIGS: dict[tuple[int, int, str], DecodeConfig] = {
    (64, 64, "g16"): DecodeConfig(block_n=64, block_h=16, num_warps=4, num_stages=3),
    (128, 128, "g16"): DecodeConfig(block_n=128, block_h=16, num_warps=4, num_stages=3),
    # MHA: from the H200 sweep of the "MHA" case (2026-12-02, 7dd44a3): 96% of the floor, where the vector kernel's
    # best tile (n64 w2) reached 93.5% and 128-key tiles 94%.
    (128, 128, "g1"): DecodeConfig(block_n=32, block_h=16, num_warps=4, num_stages=3),
    (256, 256, "g16"): DecodeConfig(block_n=32, block_h=16, num_warps=4, num_stages=3),
    (192, 128, "g16"): DecodeConfig(block_n=32, block_h=16, num_warps=4, num_stages=2),  # block_n 64 spills
    (288, 256, "g16"): DecodeConfig(block_n=32, block_h=16, num_warps=4, num_stages=3),
    (576, 512, "g16"): DecodeConfig(block_n=32, block_h=16, num_warps=4, num_stages=2),
    # Many q heads per kv head (MLA without TP, big MQA): fewer head blocks, fewer K re-reads.
    (64, 64, "g>16"): DecodeConfig(block_n=64, block_h=32, num_warps=4, num_stages=3),
    (128, 128, "g>16"): DecodeConfig(block_n=64, block_h=32, num_warps=4, num_stages=3),
    (256, 256, "g>16"): DecodeConfig(block_n=32, block_h=32, num_warps=8, num_stages=3),
    (192, 128, "g>16"): DecodeConfig(block_n=64, block_h=32, num_warps=8, num_stages=2),
    (288, 256, "g>16"): DecodeConfig(block_n=32, block_h=32, num_warps=8, num_stages=3),
    (576, 512, "g>16"): DecodeConfig(block_n=32, block_h=32, num_warps=8, num_stages=2),
}
CONFIG_TABLES = {"sm90": SM90_CONFIGS}

_warned_misses: set = set()


def heuristic_config(qk_head_dim: int, v_head_dim: int, group: int) -> DecodeConfig:
    """Fallback for head dims without a table entry: smaller key tiles as the head grows."""
    width = triton.next_power_of_2(qk_head_dim) + triton.next_power_of_2(v_head_dim)
    block_n = 64 if width <= 256 else 32
    num_stages = 3 if width <= 512 else 2
    block_h = 16 if group <= 16 else 32
    num_warps = 4 if block_h == 16 or width <= 256 else 8
    return DecodeConfig(block_n=block_n, block_h=block_h, num_warps=num_warps, num_stages=num_stages)


def vector_config(qk_head_dim: int, v_head_dim: int) -> DecodeConfig:
    """The vector kernel's tile (opt-in with DecodeConfig(block_h=1)): one q head per program, no tl.dot.

    On the H200 it loses to the grouped kernel at MHA (93.5% of the floor at its best tile, 2 warps, against 96%;
    benchmarks/results/2026-12-02_h200_decode_mha_sweep.log): Triton's pipeliner stages only loads that feed a dot,
    so its loads are plain global loads that only occupancy hides, while the grouped kernel's are cp.async pipelined
    and its 16-row padding costs tensor-core time a bandwidth-bound kernel has to spare.
    """
    width = triton.next_power_of_2(qk_head_dim) + triton.next_power_of_2(v_head_dim)
    return DecodeConfig(block_n=64 if width <= 256 else 32, block_h=1, num_warps=2, num_stages=1)


def clamp_config(config: DecodeConfig, group: int) -> DecodeConfig:
    """Fits a config to the problem: no more head rows than the group needs (but >= 16; 1 = vector kernel stays)."""
    if config.block_h == 1:
        return config
    block_h = max(16, min(config.block_h, triton.next_power_of_2(group)))
    return dataclasses.replace(config, block_h=block_h)


def get_config(qk_head_dim: int, v_head_dim: int, group: int, arch: str = "sm90") -> DecodeConfig:
    """The tuned config for these head dims and group size, or the heuristic one (warning once) on a miss.

    MHA (group 1) uses its own entry where the table has one, else the "g16" entry: the grouped kernel pads the single
    head to 16 dot rows, which costs less than the vector kernel's unpipelined loads (see vector_config).
    """
    bucket = "g1" if group == 1 else "g16" if group <= 16 else "g>16"
    table = CONFIG_TABLES.get(arch, {})
    config = table.get((qk_head_dim, v_head_dim, bucket))
    if config is None and bucket == "g1":
        bucket = "g16"
        config = table.get((qk_head_dim, v_head_dim, bucket))
    if config is None:
        key = (qk_head_dim, v_head_dim, bucket)
        if (arch, key) not in _warned_misses:
            _warned_misses.add((arch, key))
            warnings.warn(f"jaxattn.decode: no tuned config for {arch} {key}; using a heuristic one", stacklevel=3)
        config = heuristic_config(qk_head_dim, v_head_dim, group)
    return clamp_config(config, group)


def head_dim_split(qk_head_dim: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_DPE): split a non-power-of-2 head dim into two power-of-2 dots when it can
    (576 = 512 + 64, 288 = 256 + 32, 192 = 128 + 64), else pad to the next power of 2."""
    block_d = triton.next_power_of_2(qk_head_dim)
    if block_d == qk_head_dim:
        return block_d, 0
    main = block_d // 2
    rest = qk_head_dim - main
    if rest >= 16 and rest == triton.next_power_of_2(rest):
        return main, rest
    return block_d, 0


# ---------------------------------------------------------------------------------------------
# The op


def _default_v_head_dim(qk_head_dim):
    return {576: 512, 288: 256}.get(qk_head_dim)


def _check_decode_args(q, k_pool, v_pool, meta, sinks, v_head_dim, sliding_window, logit_cap=0.0, xai_temperature_len=-1):
    check_array("q", q, ndim=3, dtypes=FLOAT_DTYPES, what="[batch, q_heads, qk_head_dim]")
    batch, q_heads, qk_dim = q.shape
    check_array("k_pool", k_pool, ndim=3, dtypes=(q.dtype,), what="[slots, kv_heads, qk_head_dim] (q's dtype)")
    slots, kv_heads, _ = k_pool.shape
    check_array("k_pool", k_pool, shape=(None, None, qk_dim), what="[slots, kv_heads, qk_head_dim] (qk_head_dim of q)")
    if v_pool is None:
        v_head_dim = _default_v_head_dim(qk_dim) if v_head_dim is None else v_head_dim
        if v_head_dim is None or not 0 < v_head_dim <= qk_dim:
            raise ValueError(
                f"v_head_dim must be given (0 < v_head_dim <= qk_head_dim = {qk_dim}) when v_pool is None "
                f"(V = the first v_head_dim dims of K); got {v_head_dim!r}"
            )
    else:
        check_array("v_pool", v_pool, shape=(slots, kv_heads, None), dtypes=(q.dtype,), what="[slots, kv_heads, v_head_dim]")
        if v_head_dim is not None and v_head_dim != v_pool.shape[2]:
            raise ValueError(f"v_head_dim ({v_head_dim}) must match v_pool.shape[2] ({v_pool.shape[2]}) or be None")
        v_head_dim = v_pool.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}, q.shape[1]) must be a multiple of kv_heads ({kv_heads}, k_pool.shape[1])")
    check_head_dims(qk_dim, v_head_dim, qk_name="qk_head_dim (q.shape[2])",
                    v_name="v_head_dim" + (" (v_pool.shape[2])" if v_pool is not None else ""))
    if not isinstance(meta, DecodeMetadata):
        raise ValueError(f"meta must be a DecodeMetadata (see decode_metadata); got {type(meta).__name__}")
    if meta.batch != batch:
        raise ValueError(f"meta batch ({meta.batch}, meta.kv_indptr.shape[0] - 1) must equal q.shape[0] ({batch})")
    if sinks is not None:
        check_array("sinks", sinks, shape=(q_heads,), dtypes=FLOAT_DTYPES, what="[q_heads]")
    check_window("sliding_window", sliding_window)
    check_score_options(logit_cap, xai_temperature_len)
    if meta.sliding_window >= 0 and sliding_window > meta.sliding_window:
        raise ValueError(
            f"sliding_window ({sliding_window}) must not exceed meta.sliding_window ({meta.sliding_window}): the KV "
            "lists were trimmed to that window"
        )
    return batch, q_heads, kv_heads, qk_dim, v_head_dim


def _effective_window(meta, sliding_window):
    return sliding_window if sliding_window >= 0 else meta.sliding_window


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "logit_cap", "xai_temperature_len", "sliding_window", "return_lse", "v_head_dim",
                     "config", "mode"),
)
def decode_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array | None,
    meta: DecodeMetadata,
    *,
    sm_scale: float | None = None,
    logit_cap: float = 0.0,
    sinks: jax.Array | None = None,
    xai_temperature_len: int = -1,
    sliding_window: int = -1,
    return_lse: bool = False,
    v_head_dim: int | None = None,
    config: DecodeConfig | None = None,
    mode: str | None = None,
):
    """Attention of one query per sequence over its paged KV list, with split-KV Triton kernels.

    Args:
      q: [batch, q_heads, qk_head_dim] f32/f16/bf16 (batch = meta's max_batch; padding rows give 0).
      k_pool: [slots, kv_heads, qk_head_dim], q's dtype. q head h reads kv head h // (q_heads // kv_heads).
      v_pool: [slots, kv_heads, v_head_dim], q's dtype; or None when V is the first `v_head_dim` dims of K (MLA).
      meta: `DecodeMetadata` of the batch.
      sm_scale: default 1 / sqrt(qk_head_dim).
      logit_cap: > 0 soft-caps the scores: cap * tanh(s / cap).
      sinks: optional f32[q_heads]; exp(sink) joins the softmax denominator.
      xai_temperature_len: > 0 scales scores by log2(pos) / log2(len) past that position (Grok).
      sliding_window: W >= 0 keeps the last W + 1 keys (default: meta's window).
      return_lse: also return the natural-log LSE (sink included).
      v_head_dim: with v_pool None: how many leading dims of K are V (default 512 for 576, 256 for 288).
      config: a `DecodeConfig` overriding the tuned table (for sweeps).
      mode: launch mode ("gpu", "interpret" or None for automatic).

    Returns:
      o: [batch, q_heads, v_head_dim] in q's dtype, and with return_lse f32[batch, q_heads].
    """
    batch, q_heads, kv_heads, qk_dim, v_dim = _check_decode_args(
        q, k_pool, v_pool, meta, sinks, v_head_dim, sliding_window, logit_cap, xai_temperature_len
    )
    group = q_heads // kv_heads
    window = _effective_window(meta, sliding_window)
    sm_scale = 1.0 / math.sqrt(qk_dim) if sm_scale is None else float(sm_scale)
    mode = launch_mode(mode)
    config = get_config(qk_dim, v_dim, group) if config is None else clamp_config(config, group)
    block_d, block_dpe = head_dim_split(qk_dim)
    block_dv = triton.next_power_of_2(v_dim)
    if v_pool is None:
        v_from_k = v_dim == block_d and block_dpe > 0
        v_arg, stride_v_slot, stride_v_head = k_pool, kv_heads * qk_dim, qk_dim
    else:
        v_from_k = False
        v_arg, stride_v_slot, stride_v_head = v_pool, kv_heads * v_dim, v_dim
    max_splits = meta.max_kv_splits
    precision = "ieee" if (mode == "interpret" or q.dtype == jnp.float32) else "tf32"
    shared = dict(
        SM_SCALE=sm_scale,
        LOGIT_CAP=float(logit_cap),
        XAI_TEMPERATURE_LEN=int(xai_temperature_len),
        XAI_INV_LOG2_LEN=(1.0 / math.log2(xai_temperature_len)) if xai_temperature_len > 1 else 1.0,
        SLIDING_WINDOW=int(window),
        Q_HEADS=q_heads,
        GROUP=group,
        STRIDE_K_SLOT=kv_heads * qk_dim,
        STRIDE_K_HEAD=qk_dim,
        STRIDE_V_SLOT=stride_v_slot,
        STRIDE_V_HEAD=stride_v_head,
        QK_HEAD_DIM=qk_dim,
        V_HEAD_DIM=v_dim,
        BLOCK_D=block_d,
        BLOCK_DPE=block_dpe,
        BLOCK_DV=block_dv,
        BLOCK_N=config.block_n,
        MAX_KV_SPLITS=max_splits,
        MIN_BLOCK_KV=MIN_BLOCK_KV,
    )
    if config.block_h == 1:  # the vector kernel: one q head per program
        kernel, head_programs = "decode_stage1_vector_kernel", q_heads
    else:
        kernel, head_programs = "decode_stage1_kernel", kv_heads * -(-group // config.block_h)
        shared.update(V_FROM_K=v_from_k, BLOCK_H=config.block_h, DOT_PRECISION=precision)
    mid_o, mid_lse = launch(
        ("decode_attention", kernel),
        q,
        k_pool,
        v_arg,
        meta.kv_indptr.astype(jnp.int32),
        meta.kv_indices,
        meta.num_kv_splits.astype(jnp.int32),
        meta.seq_lens.astype(jnp.int32),
        out_shape=(
            jax.ShapeDtypeStruct((batch, q_heads, max_splits, v_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, q_heads, max_splits), jnp.float32),
        ),
        grid=(batch, head_programs, max_splits),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        mode=mode,
        name=f"decode_stage1_BLOCK_H={config.block_h}_BLOCK_N={config.block_n}",
        **shared,
    )
    sink_arg = jnp.zeros((q_heads,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    o, lse = launch(
        ("decode_attention", "decode_stage2_kernel"),
        mid_o,
        mid_lse,
        meta.kv_indptr.astype(jnp.int32),
        meta.num_kv_splits.astype(jnp.int32),
        sink_arg,
        out_shape=(jax.ShapeDtypeStruct((batch, q_heads, v_dim), q.dtype), jax.ShapeDtypeStruct((batch, q_heads), jnp.float32)),
        grid=(batch, q_heads),
        num_warps=4,
        num_stages=2,
        mode=mode,
        name="decode_stage2",
        SLIDING_WINDOW=int(window),
        Q_HEADS=q_heads,
        V_HEAD_DIM=v_dim,
        BLOCK_DV=block_dv,
        HAS_SINK=sinks is not None,
        MAX_KV_SPLITS=max_splits,
        MIN_BLOCK_KV=MIN_BLOCK_KV,
    )
    return (o, lse) if return_lse else o


def decode_attention_reference(
    q, k_pool, v_pool, meta, *, sm_scale=None, logit_cap=0.0, sinks=None, xai_temperature_len=-1, sliding_window=-1,
    return_lse=False, v_head_dim=None, config=None, mode=None,
):
    """`decode_attention` on the pure-jnp reference (same arguments; config and mode are ignored)."""
    del config, mode
    batch, q_heads, kv_heads, qk_dim, v_dim = _check_decode_args(
        q, k_pool, v_pool, meta, sinks, v_head_dim, sliding_window, logit_cap, xai_temperature_len
    )
    if v_pool is None:
        v_pool = k_pool[..., :v_dim]
    window = _effective_window(meta, sliding_window)
    kv_indptr = meta.kv_indptr.astype(jnp.int32)
    kv_lens = kv_indptr[1:] - kv_indptr[:-1]
    max_kv_len = meta.max_kv_len
    try:
        max_kv_len = max(int(np.max(np.asarray(kv_lens), initial=0)), 1)
    except jax.errors.TracerArrayConversionError:
        max_kv_len = meta.kv_capacity if max_kv_len is None else min(max_kv_len, meta.kv_capacity)
    return ragged_paged_attention_reference(
        q, k_pool, v_pool, jnp.arange(batch + 1, dtype=jnp.int32), kv_indptr, meta.kv_indices,
        causal=True, sliding_window=window, logit_cap=logit_cap, sinks=sinks, xai_temperature_len=xai_temperature_len,
        sm_scale=sm_scale, kv_start_positions=meta.seq_lens.astype(jnp.int32) - kv_lens, max_q_len=1,
        max_kv_len=max_kv_len, return_lse=return_lse,
    )


# ---------------------------------------------------------------------------------------------
# AOT builds


SUPPORTED_HEAD_DIMS = ((64, 64), (128, 128), (256, 256), (192, 128), (288, 256), (576, 512))


def kernel_builds():
    """Every stage-1/stage-2 build the sm_90 table (and clamping) can choose, per dtype and head-dim family."""
    from jaxattn.aot import build

    builds = []
    index = {"KV_INDPTR": "*i32", "KV_INDICES": "*i32", "NUM_KV_SPLITS": "*i32", "SEQ_LENS": "*i32"}
    for dtype in ("bf16", "fp16"):
        for qk_dim, v_dim in SUPPORTED_HEAD_DIMS:
            block_d, block_dpe = head_dim_split(qk_dim)
            v_variants = [False] + ([True] if v_dim == block_d and block_dpe > 0 else [])
            for group_key in ("g1", "g16", "g>16"):
                if (qk_dim, v_dim, group_key) not in SM90_CONFIGS:
                    continue  # g1 falls back to g16's build
                config = SM90_CONFIGS[(qk_dim, v_dim, group_key)]
                group = {"g1": 1, "g16": 8, "g>16": 64}[group_key]
                config = clamp_config(config, group)
                for v_from_k in v_variants:
                    builds.append(
                        build(
                            "decode_attention",
                            "decode_stage1_kernel",
                            {"Q": f"*{dtype}", "K_POOL": f"*{dtype}", "V_POOL": f"*{dtype}", **index,
                             "MID_O": "*fp32", "MID_LSE": "*fp32"},
                            {
                                "SM_SCALE": 1.0 / math.sqrt(qk_dim), "LOGIT_CAP": 30.0, "XAI_TEMPERATURE_LEN": -1,
                                "XAI_INV_LOG2_LEN": 1.0, "SLIDING_WINDOW": -1, "Q_HEADS": 8 * group, "GROUP": group,
                                "STRIDE_K_SLOT": 8 * qk_dim, "STRIDE_K_HEAD": qk_dim,
                                "STRIDE_V_SLOT": 8 * (qk_dim if v_from_k else v_dim), "STRIDE_V_HEAD": qk_dim if v_from_k else v_dim,
                                "QK_HEAD_DIM": qk_dim, "V_HEAD_DIM": v_dim, "BLOCK_D": block_d, "BLOCK_DPE": block_dpe,
                                "BLOCK_DV": triton.next_power_of_2(v_dim), "V_FROM_K": v_from_k, "BLOCK_H": config.block_h,
                                "BLOCK_N": config.block_n, "MAX_KV_SPLITS": 64, "MIN_BLOCK_KV": MIN_BLOCK_KV,
                                "DOT_PRECISION": "tf32",
                            },
                            num_warps=config.num_warps,
                            num_stages=config.num_stages,
                            # M = BLOCK_H (16 or 32) < 64 rows per warpgroup: Triton emits mma.sync, not wgmma
                            # (checked with `python -m jaxattn.aot -k decode`); decode is bandwidth-bound.
                            expects_wgmma=False,
                            expects_pipelining=config.num_stages > 1,
                            label=f"{dtype} {qk_dim}/{v_dim} {group_key}{' v_from_k' if v_from_k else ''}",
                        )
                    )
            # The vector kernel (opt-in: DecodeConfig(block_h=1)).
            config = vector_config(qk_dim, v_dim)
            builds.append(
                build(
                    "decode_attention",
                    "decode_stage1_vector_kernel",
                    {"Q": f"*{dtype}", "K_POOL": f"*{dtype}", "V_POOL": f"*{dtype}", **index, "MID_O": "*fp32", "MID_LSE": "*fp32"},
                    {
                        "SM_SCALE": 1.0 / math.sqrt(qk_dim), "LOGIT_CAP": 30.0, "XAI_TEMPERATURE_LEN": -1, "XAI_INV_LOG2_LEN": 1.0,
                        "SLIDING_WINDOW": -1, "Q_HEADS": 16, "GROUP": 1, "STRIDE_K_SLOT": 16 * qk_dim, "STRIDE_K_HEAD": qk_dim,
                        "STRIDE_V_SLOT": 16 * v_dim, "STRIDE_V_HEAD": v_dim, "QK_HEAD_DIM": qk_dim, "V_HEAD_DIM": v_dim,
                        "BLOCK_D": block_d, "BLOCK_DPE": block_dpe, "BLOCK_DV": triton.next_power_of_2(v_dim),
                        "BLOCK_N": config.block_n, "MAX_KV_SPLITS": 64, "MIN_BLOCK_KV": MIN_BLOCK_KV,
                    },
                    num_warps=config.num_warps,
                    num_stages=config.num_stages,
                    expects_wgmma=False,  # no tl.dot
                    expects_pipelining=False,  # see vector_config
                    label=f"{dtype} {qk_dim}/{v_dim} mha vector",
                )
            )
        for v_dim in sorted({v for _, v in SUPPORTED_HEAD_DIMS}):
            builds.append(
                build(
                    "decode_attention",
                    "decode_stage2_kernel",
                    {"MID_O": "*fp32", "MID_LSE": "*fp32", "KV_INDPTR": "*i32", "NUM_KV_SPLITS": "*i32", "SINKS": "*fp32",
                     "O": f"*{dtype}", "LSE": "*fp32"},
                    {"SLIDING_WINDOW": -1, "Q_HEADS": 32, "V_HEAD_DIM": v_dim, "BLOCK_DV": triton.next_power_of_2(v_dim),
                     "HAS_SINK": True, "MAX_KV_SPLITS": 64, "MIN_BLOCK_KV": MIN_BLOCK_KV},
                    num_warps=4,
                    num_stages=2,
                    label=f"{dtype} v_dim={v_dim}",
                )
            )
    return builds
