"""Tuning: the kernels' launch configurations, one table per GPU family, and the lookups that pick from them.

    from jaxattn import tuning
    tuning.decode_config(128, 128, group=4)            # DecodeConfig for this device
    tuning.extend_config(128, 128, jnp.bfloat16, 4096)  # ExtendConfig, clamped to the problem

Each lookup detects the device's family (`jaxattn.hardware`), normalises the key as the family's table documents
(`jaxattn.tuning.sm90`), warns once when the device or the key has no entry (then falls back to the reference
family's table or a heuristic) and clamps the result to the problem. No GPU visible (the CPU interpreter): the
reference family's table, silently.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax.numpy as jnp
import triton

from jaxattn import hardware
from jaxattn.metadata import SplitWaves, rope_split
from jaxattn.tuning import sm90
from jaxattn.tuning.configs import DecodeConfig, ExtendConfig, MgpuDecodeConfig, MgpuExtendConfig

__all__ = [
    "DecodeConfig", "ExtendConfig", "MgpuDecodeConfig", "MgpuExtendConfig", "TABLES", "table", "decode_config", "float32_decode_config", "clamp_decode_config",
    "heuristic_decode_config", "vector_config", "head_dim_family", "extend_config", "with_custom_mask", "pack_heads",
    "mgpu_extend_config", "mgpu_extend_latent_config", "decode_split_waves", "default_decode_split_waves",
]

# GPU family -> op -> table (see each family module for its keys).
TABLES = {hardware.SM90.name: sm90.TABLES}

_warned: set = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def table(op: str, family: str | None = None) -> dict:
    """The `op` table ("decode", "decode_fp8", "decode_fp8_resident_per_sm", "extend", "extend_mgpu",
    "extend_mgpu_short_window", "extend_mgpu_latent") of `family` (default: the visible GPU's family)."""
    if family is None:
        family = hardware.gpu_family_name() or hardware.REFERENCE_FAMILY.name
    tables = TABLES.get(family)
    if tables is None:
        _warn_once(f"jaxattn.tuning: no tuned tables for GPU family {family}; using {hardware.REFERENCE_FAMILY.name}'s")
        tables = TABLES[hardware.REFERENCE_FAMILY.name]
    return tables[op]


# ---------------------------------------------------------------------------------------------
# Decode (Triton split-KV kernels)


def decode_group_bucket(group: int) -> str:
    """The decode tables' group key: "g1" (MHA), "g16" (up to 16 q heads a kv head) or "g>16"."""
    return "g1" if group == 1 else "g16" if group <= 16 else "g>16"


def heuristic_decode_config(qk_head_dim: int, v_head_dim: int, group: int) -> DecodeConfig:
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


def clamp_decode_config(config: DecodeConfig, rows: int) -> DecodeConfig:
    """Fits a config to the problem: rows = q heads per kv head (x query tokens per sequence). A tile holds at least
    16 rows (a dot's least) and no more than the rows need, except that padding up to 64 (one wgmma tile: a tiling
    choice, not extra memory traffic) is left to an explicit config; block_h 1 (the vector kernel) stays."""
    if config.block_h == 1:
        return config
    block_h = max(16, min(config.block_h, max(64, triton.next_power_of_2(rows))))
    return dataclasses.replace(config, block_h=block_h)


def float32_decode_config(config: DecodeConfig, qk_head_dim: int, v_head_dim: int) -> DecodeConfig:
    """The tables' (bf16) decode tile adapted to fp32 inputs, whose IEEE dots run on FMA units with fp32 operands in
    registers: at most 64 keys and 16 head rows per tile, at most 2 stages, 8 warps once the head dims add up to 256.

    Compiled for sm_90 (`jaxattn.aot`), the tables' own tiles in fp32 spill 10-20 KB per thread (128/128 g16: 12.6
    KB); these spill nothing at any table entry (tests/test_aot_compile.py builds them). fp32 is a test and
    comparison dtype (e.g. scripts/compare_transformers.py --dtype float32), so these were not timed.
    """
    if config.block_h == 1:  # the vector kernel (opt-in): no tl.dot
        return config
    width = triton.next_power_of_2(qk_head_dim) + triton.next_power_of_2(v_head_dim)
    return dataclasses.replace(config, block_n=min(config.block_n, 64), block_h=16, num_stages=min(config.num_stages, 2),
                               num_warps=8 if width >= 256 else config.num_warps)


def decode_config(qk_head_dim: int, v_head_dim: int, group: int, family: str | None = None, dtype=None,
                  fp8_pool: bool = False) -> DecodeConfig:
    """The tuned decode config for these head dims and group size, or the heuristic one (warning once) on a miss.

    MHA (group 1) uses its own entry where the table has one, else the "g16" entry: the grouped kernel pads the single
    head to 16 dot rows, which costs less than the vector kernel's unpipelined loads (see vector_config). dtype: q's
    (the tables are bf16/fp16's; float32 takes `float32_decode_config`). fp8_pool: the pool is e4m3fn / e5m2 (the
    "decode_fp8" table's entry where it has one).
    """
    bucket = decode_group_bucket(group)
    entries = table("decode", family)
    if fp8_pool:
        entries = {**entries, **table("decode_fp8", family)}
    config = entries.get((qk_head_dim, v_head_dim, bucket))
    if config is None and bucket == "g1":
        bucket = "g16"
        config = entries.get((qk_head_dim, v_head_dim, bucket))
    if config is None:
        _warn_once(f"jaxattn.tuning: no tuned config for decode {(qk_head_dim, v_head_dim, bucket)}; using a heuristic one")
        config = heuristic_decode_config(qk_head_dim, v_head_dim, group)
    if dtype is not None and jnp.dtype(dtype) == jnp.float32:
        config = float32_decode_config(config, qk_head_dim, v_head_dim)
    return clamp_decode_config(config, group)


def decode_split_waves(qk_head_dim: int, v_head_dim: int, q_heads: int, kv_heads: int,
                       family: str | None = None) -> SplitWaves | None:
    """`SplitWaves` of the table's fp8 decode tile for this shape (its resident programs and heads a program), for
    `decode_metadata(split_waves=...)`; None where the family's table lists no residency for the key."""
    group = q_heads // kv_heads
    resident = table("decode_fp8_resident_per_sm", family).get((qk_head_dim, v_head_dim, decode_group_bucket(group)))
    if resident is None:
        return None
    config = decode_config(qk_head_dim, v_head_dim, group, family=family, fp8_pool=True)
    return SplitWaves(resident_per_sm=resident, heads_per_program=config.block_h)


def default_decode_split_waves(qk_head_dim: int, v_head_dim: int, q_heads: int, kv_heads: int,
                               fp8_pool: bool) -> SplitWaves | None:
    """The `SplitWaves` decode lists get by default: `decode_split_waves` for fp8 pools while
    `sm90.DECODE_FP8_SPLIT_WAVES` is on, else None (the fill heuristic)."""
    if not (fp8_pool and sm90.DECODE_FP8_SPLIT_WAVES):
        return None
    return decode_split_waves(qk_head_dim, v_head_dim, q_heads, kv_heads)


# ---------------------------------------------------------------------------------------------
# Extend (Triton two-stage and unified kernels)


def head_dim_family(qk_head_dim: int, v_head_dim: int) -> str:
    """The extend table key of a head shape (see `jaxattn.tuning.sm90`)."""
    main, rope = rope_split(qk_head_dim)
    if rope and f"{qk_head_dim}/{main}" in sm90.EXTEND:
        return f"{qk_head_dim}/{main}"
    dim = max(triton.next_power_of_2(qk_head_dim), triton.next_power_of_2(v_head_dim))
    return str(max(dim, 64)) if dim <= 256 else "576/512"


def with_custom_mask(config: ExtendConfig) -> ExtendConfig:
    """The custom-mask variant keeps a [BLOCK_M, BLOCK_N] mask tile live too: 128-key tiles overflow shared memory."""
    return dataclasses.replace(config, block_n=min(config.block_n, 64))


def extend_config(qk_head_dim: int, v_head_dim: int, dtype, max_extend_len: int, *, custom_mask: bool = False,
                  family: str | None = None) -> ExtendConfig:
    """The table's config for this head shape, adapted to the dtype and clamped to the problem.

    A key the table lacks falls back to its largest family (warning once). fp32 inputs (tests, mostly) take half-size
    K/V tiles and no pipelining so shared memory still fits. block_m is clamped to max_extend_len (rounded up to a
    power of 2, >= 16).
    """
    entries = table("extend", family)
    key = head_dim_family(qk_head_dim, v_head_dim)
    config = entries.get(key)
    if config is None:
        _warn_once(f"jaxattn.tuning: no tuned config for extend family {key}; using 576/512's")
        config = entries["576/512"]
    if custom_mask:
        config = with_custom_mask(config)
    if jnp.dtype(dtype) == jnp.float32:
        config = dataclasses.replace(config, block_m=min(config.block_m, 64), block_n=min(config.block_n, 32), num_stages=1)
    block_m = max(16, min(config.block_m, triton.next_power_of_2(max(int(max_extend_len), 1))))
    return dataclasses.replace(config, block_m=block_m)


def pack_heads(config: ExtendConfig, q_heads: int, kv_heads: int) -> ExtendConfig:
    """The config a launch uses: head_pack cut to the largest power of 2 dividing the group size."""
    return dataclasses.replace(config, head_pack=math.gcd(config.head_pack, q_heads // kv_heads))


# ---------------------------------------------------------------------------------------------
# Extend (Mosaic GPU kernel)


def mgpu_extend_latent_config(qk_head_dim: int, v_head_dim: int, family: str | None = None) -> MgpuExtendConfig | None:
    """The Mosaic GPU extend kernel's tiles over a latent cache (V inside K) at these head dims, or None where the
    table has none (the kernel does not take them: at 576/512 O's accumulator does not fit a warpgroup's registers)."""
    return table("extend_mgpu_latent", family).get(f"{qk_head_dim}/{v_head_dim}")


def mgpu_extend_config(qk_head_dim: int, v_head_dim: int | None = None, family: str | None = None, *,
                       sliding_window: int = -1, max_extend_len: int | None = None) -> MgpuExtendConfig:
    """The Mosaic GPU extend kernel's tiles for these head dims (v_head_dim default: qk_head_dim), keyed as the
    Triton extend table (`head_dim_family`); the default config on a miss, warning once. A window of at most the
    "extend_mgpu_short_window" table's W over extends of at most block_q new tokens takes that table's tile, and such
    short extends take two consumer warpgroups where the table has three: two then hold two heads' rows of one
    sequence (`jaxattn.impl.mgpu_extend.heads_per_cta`), where three would hold one head's and compute padding in two."""
    v_head_dim = qk_head_dim if v_head_dim is None else v_head_dim
    key = head_dim_family(qk_head_dim, v_head_dim)
    config = table("extend_mgpu", family).get(key)
    if config is None:
        _warn_once(f"jaxattn.tuning: no tuned config for the Mosaic GPU extend kernel at head dims {key}; using the default")
        config = MgpuExtendConfig()
    short = table("extend_mgpu_short_window", family).get(key)
    if short is not None and 0 <= sliding_window <= short[0] and max_extend_len is not None \
            and max_extend_len <= short[1].block_q:
        config = short[1]
    if config.consumers == 3 and max_extend_len is not None and max_extend_len <= config.block_q:
        config = dataclasses.replace(config, consumers=2, overlap=False)
    return config
