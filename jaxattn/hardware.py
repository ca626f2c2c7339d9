"""The GPUs jaxattn knows: each family's limits, defined once, and which family this process runs on.

A family is named by its CUDA compute capability, "sm_90" for the H100/H200 (Hopper). Tuning tables
(`jaxattn.tuning`), the Mosaic GPU kernel's resource check, the decode split heuristic and the ahead-of-time
compile check (`jaxattn.aot`) all read their limits from `FAMILIES`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
# Imported here, not first inside a caller's jitted step: the Mosaic GPU routes' checks import Pallas while tracing,
# and on jax 0.12 importing Pallas registers config states that are part of jit's cache key, so a step whose first
# trace did the import traced again at its next call (tests/test_backends_e2e.py's trace count on the newest stack).
import jax.experimental.pallas  # noqa: F401


@dataclasses.dataclass(frozen=True)
class GpuFamily:
    """Limits of one GPU family (per thread block / per device)."""

    name: str  # "sm_90"
    compute_capability: str  # as JAX reports it: "9.0"
    shared_memory_bytes: int  # opt-in shared memory per thread block
    sm_count: int  # multiprocessors of the reference part (H200 SXM), used when no device can be asked
    aot_target: tuple  # Triton's GPUTarget(backend, arch, warp size) for ahead-of-time builds
    # Per multiprocessor: what bounds how many thread blocks it holds at once (`resident_blocks`).
    registers_per_sm: int
    shared_memory_per_sm: int  # bytes, of which each resident block also takes shared_memory_reserved_per_block
    shared_memory_reserved_per_block: int
    max_warps_per_sm: int
    max_blocks_per_sm: int


SM90 = GpuFamily(name="sm_90", compute_capability="9.0", shared_memory_bytes=227 * 1024, sm_count=132,
                 aot_target=("cuda", 90, 32), registers_per_sm=65536, shared_memory_per_sm=228 * 1024,
                 shared_memory_reserved_per_block=1024, max_warps_per_sm=64, max_blocks_per_sm=32)
FAMILIES = {SM90.name: SM90}
# CUDA's bound on a launch grid's second and third dimensions (the first takes up to 2**31 - 1).
GRID_YZ_LIMIT = 65535
# The family whose tables serve where no GPU is visible (the CPU interpreter) and as the fallback elsewhere.
REFERENCE_FAMILY = SM90


@functools.cache
def _first_gpu():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:  # no GPU backend in this process
        return None
    return gpus[0] if gpus else None


def gpu_family_name() -> str | None:
    """"sm_XY" of the first visible CUDA GPU (e.g. "sm_90"), or None when JAX sees no GPU."""
    device = _first_gpu()
    capability = getattr(device, "compute_capability", None) if device is not None else None
    if capability is None:
        return None
    major, _, minor = str(capability).partition(".")
    return f"sm_{major}{minor or '0'}"


def is_sm90() -> bool:
    """Whether the visible GPU is a Hopper part (wgmma, TMA): the Mosaic GPU kernels' requirement."""
    return gpu_family_name() == SM90.name


def resident_blocks(registers: int, shared_bytes: int, num_warps: int, family: GpuFamily = SM90) -> int:
    """Thread blocks of a kernel one multiprocessor holds at once (CUDA's occupancy rules): the fewest of what its
    registers, shared memory and warps allow. registers: per thread (ptxas's count; allocated in steps of 8 a
    thread and 256 a warp); shared_bytes: the block's dynamic + static shared memory."""
    warp_registers = -(-(-(-registers // 8) * 8 * 32) // 256) * 256
    by_registers = family.registers_per_sm // (warp_registers * num_warps)
    by_shared = family.shared_memory_per_sm // (shared_bytes + family.shared_memory_reserved_per_block)
    by_warps = family.max_warps_per_sm // num_warps
    return min(by_registers, by_shared, by_warps, family.max_blocks_per_sm)


def sm_count() -> int:
    """Multiprocessors of the visible GPU, or of the reference part when none is visible."""
    device = _first_gpu()
    count = getattr(device, "core_count", None) if device is not None else None
    return int(count) if count else REFERENCE_FAMILY.sm_count


def _cuda_runtime_version() -> int | None:
    try:
        from jax._src.lib import cuda_versions  # private: the version JAX's CUDA plugin was loaded with
    except ImportError:
        return None
    return None if cuda_versions is None else cuda_versions.cuda_runtime_get_version()


def mosaic_gpu_unavailable(launch_mode: str) -> str | None:
    """Why this process cannot run jaxattn's Mosaic GPU kernels in `launch_mode` ("gpu" / "interpret"), or None."""
    if launch_mode != "gpu":
        return "no GPU (or an interpreted launch mode)"
    if not is_sm90():
        return f"device {gpu_family_name()} is not sm_90 (the kernel uses Hopper's wgmma and TMA)"
    version = _cuda_runtime_version()
    if version is not None and 12080 <= version < 12091:
        # JAX's own FlashAttention-3 Mosaic GPU kernel refuses causal masks for these versions (a ptxas miscompile).
        return f"CUDA runtime {version} (12.8.0-12.9.0 miscompile causal masks in Mosaic GPU kernels)"
    return None
