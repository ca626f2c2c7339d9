"""The launch configurations of jaxattn's kernels: one frozen dataclass per kernel family.

`DecodeConfig` (Triton split-KV decode), `ExtendConfig` (both Triton extend kernels) and `MgpuExtendConfig` (the
Hopper Mosaic GPU extend kernel). Passing one as `config=` to an op also picks the implementation it configures.
"""

from __future__ import annotations

import dataclasses

# Shared memory the Mosaic GPU extend kernel takes beside its tiles: the cp.async mbarrier array (1 KiB: Pallas aligns
# each buffer to 1 KiB), Pallas' reduction scratch (`PALLAS_REDUCTION_SCRATCH_BYTES`) and the barriers (88 B at 2
# stages); lowered at 256/256, 3160 B.
PALLAS_REDUCTION_SCRATCH_BYTES = 2048  # CompilerParams.reduction_scratch_bytes' default
PALLAS_OVERHEAD_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Stage-1 launch configuration of the Triton decode kernels."""

    block_n: int = 32  # keys per loop iteration (power of 2, >= 16)
    # q heads of one kv head per program: a power of 2 >= 16 (tl.dot's minimum M) for the grouped kernel, or 1 for
    # the vector kernel (one q head per program, no tl.dot).
    block_h: int = 16
    num_warps: int = 4
    num_stages: int = 2
    # fp8 pools, grouped kernel: convert the K and V tiles to f16 in their loads' layout before the dots
    # (kernels/decode_attention.py, FP8_IN_REGISTERS: fewer instructions a key on sm_90's SASS; V alone was no faster on
    # the H100 at 236f758; sm_89+ only); off in the tables.
    fp8_in_registers: bool = False
    # Grouped kernel: both dots with the keys as their M dimension (K q^T and V^T p^T; kernels/decode_attention.py,
    # KEYS_AS_ROWS): block_h q rows become the dots' N (16 is a whole wgmma N), so a few heads take wgmma without
    # padding them to 64 rows. Timed on the H200 (benchmarks/RESULTS.md, eleventh session): slower except for the
    # 4-token MLA verify with fewer splits; off in the tables.
    keys_as_rows: bool = False

    def __post_init__(self):
        for name in ("fp8_in_registers", "keys_as_rows"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"DecodeConfig.{name} must be a bool; got {getattr(self, name)!r}")
        if self.keys_as_rows and self.block_h == 1:
            raise ValueError("DecodeConfig.keys_as_rows takes the grouped kernel (block_h >= 16), not block_h=1")
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


@dataclasses.dataclass(frozen=True)
class ExtendConfig:
    """Tile sizes and launch options of one Triton extend launch (the two-stage and unified kernels share them).

    block_m: query rows per program (the q-block). block_n: keys per inner-loop tile. Both powers of 2, >= 16.
    In the unified kernel block_n also fixes the reduction order: outputs are bit-identical across prefix/new splits
    only for the same block_n. num_warps, num_stages: Triton launch options (num_stages > 1 software-pipelines the
    K/V loads of the inner loop). head_pack: q heads of one KV head that share a program (a power of 2): its block_m
    rows are head_pack heads x block_m / head_pack tokens, so each K/V tile loaded serves head_pack heads. Launches
    use gcd(head_pack, q_heads / kv_heads) (1 for MHA).
    """

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    head_pack: int = 1

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"ExtendConfig.{name} must be a power of 2 >= 16; got {value!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"ExtendConfig.num_warps must be 1, 2, 4, 8 or 16; got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"ExtendConfig.num_stages must be a positive int; got {self.num_stages!r}")
        if not isinstance(self.head_pack, int) or self.head_pack < 1 or self.head_pack & (self.head_pack - 1):
            raise ValueError(f"ExtendConfig.head_pack must be a power of 2 >= 1; got {self.head_pack!r}")
        if self.head_pack > self.block_m:
            raise ValueError(f"ExtendConfig.head_pack ({self.head_pack}) must not exceed block_m ({self.block_m})")


@dataclasses.dataclass(frozen=True)
class MgpuExtendConfig:
    """Tiles of the Mosaic GPU extend kernel: block_q rows per consumer warpgroup (a CTA takes consumers x block_q),
    block_kv keys per tile, stages K/V tiles in flight, consumers warpgroups per CTA: 2 (ping-pong) or 3 (64-dim
    heads only, FlashAttention-3's tile there: `kernels/extend_attention_mgpu.py`; 0.946-0.971x two at T64 on the H100).
    overlap (3 consumers): each warpgroup issues its next tile's S = Q K^T before this tile's softmax on the runs of
    unmasked tiles (FlashAttention-3's intra-warpgroup overlap, which its 64-dim tile runs with); 1.58x slower than
    two consumers at T64 on the H100 (benchmarks/RESULTS.md, twenty-fourth session). fp8_tiles (fp8 pools,
    `impl="mgpu-fp8"`): how the producer converts a pool tile: "f16" (exact and unscaled, one instruction per two
    values; the consumers run pool tiles in f16 with the scales folded into their arithmetic; where the kernel
    takes it: the two-stage form at head dims 64 and 128) or "q_dtype" (each value times its scale, rounded to
    q's dtype: six instructions per two values). fp8_staging (fp8 pools): the producer copies a pool tile's fp8
    rows into staging tiles of their own rather than its ring slot, so they start a tile earlier (the kernel's
    `fp8_staging`), where they fit beside the tile (`staged_shared_memory_bytes`; 128 keys at head dims 64 and 128,
    not the 256 tile); else the rows go to the slot. On the H100 (fbf99d6, one run, 5 rounds) the f16 tiles took
    0.731 ms staged against 0.778 at E3-FP8 (row spreads 5.5% / 1.6%) and 1.822 against 1.891 at E1-FP8, the same
    bits (benchmarks/RESULTS.md, forty-third session). fp8_refill (with fp8_staging): each producer thread refills the
    staging bytes it has just converted with its copy of the next pool tile's, so no warpgroup sync sits between
    them and the next tile's copies start during this tile's conversion (the kernel's `fp8_refill`); E3-FP8 0.692 ms
    against 0.729 on the H200 (6a7f2a9, one run), opt-in until its GPU tests all run (33 passed, none failed)."""

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2
    consumers: int = 2
    overlap: bool = False
    fp8_tiles: str = "f16"
    fp8_staging: bool = True
    fp8_refill: bool = False

    @staticmethod
    def o_rows_columns(qk_head_dim: int, v_head_dim: int | None = None) -> int:
        """Columns of the row-sliceable O buffer each consumer warpgroup stores a partial q tile through (in chunks of
        this many columns). Whole tiles reuse Q's buffer when the head dims are equal, so only partial tiles use it
        then: up to 128 columns wide, and 64 beyond (256/256: Q, the ring and a 128-column buffer need 88 bytes more
        than sm_90 has); with unequal head dims every O tile goes through it whole."""
        v_head_dim = qk_head_dim if v_head_dim is None else v_head_dim
        return v_head_dim if v_head_dim != qk_head_dim or v_head_dim <= 128 else 64

    def shared_memory_bytes(self, qk_head_dim: int, v_head_dim: int | None = None) -> int:
        """Q tiles of the consumer warpgroups (O reuses them), their O store buffers (`o_rows_columns`), the K/V
        ring (16-bit), and `PALLAS_OVERHEAD_BYTES`."""
        v_head_dim = qk_head_dim if v_head_dim is None else v_head_dim
        q_and_o = self.consumers * self.block_q * (qk_head_dim + self.o_rows_columns(qk_head_dim, v_head_dim))
        ring = self.stages * self.block_kv * (qk_head_dim + v_head_dim)
        return (q_and_o + ring) * 2 + PALLAS_OVERHEAD_BYTES

    def staged_shared_memory_bytes(self, head_dim: int) -> int:
        """The same over fp8 pools with the staging tiles (fp8_staging; equal head dims): K's and V's, block_kv x
        head_dim bytes each, and no Pallas reduction scratch (the kernel then reserves none)."""
        return self.shared_memory_bytes(head_dim) + 2 * self.block_kv * head_dim - PALLAS_REDUCTION_SCRATCH_BYTES

    def latent_shared_memory_bytes(self, qk_head_dim: int) -> int:
        """The same kernel over a latent cache (`latent_v_dim`: V inside the K tiles): Q tiles qk_head_dim rounded up to
        64 wide, O stored in 64-column chunks, a ring of K tiles only, and the same 4 KiB."""
        width = -(-qk_head_dim // 64) * 64
        return (2 * self.block_q * (width + 64) + self.stages * self.block_kv * width) * 2 + PALLAS_OVERHEAD_BYTES

    def __post_init__(self):
        if self.block_q != 64:
            raise ValueError(f"MgpuExtendConfig.block_q must be 64 (one wgmma M tile per warpgroup); got {self.block_q!r}")
        if self.block_kv not in (64, 128):
            # The producer hands each of its 128 threads one row's slot: block_kv <= 128 rows, in whole 16-row groups.
            raise ValueError(f"MgpuExtendConfig.block_kv must be 64 or 128; got {self.block_kv!r}")
        if not isinstance(self.stages, int) or self.stages < 2:
            raise ValueError(f"MgpuExtendConfig.stages must be an int >= 2; got {self.stages!r}")
        if self.consumers not in (2, 3):
            raise ValueError(f"MgpuExtendConfig.consumers must be 2 or 3; got {self.consumers!r}")
        if self.fp8_tiles not in ("f16", "q_dtype"):  # the kernel's FP8_TILES
            raise ValueError(f"MgpuExtendConfig.fp8_tiles must be 'f16' or 'q_dtype'; got {self.fp8_tiles!r}")
        if not isinstance(self.fp8_staging, bool):
            raise ValueError(f"MgpuExtendConfig.fp8_staging must be a bool; got {self.fp8_staging!r}")
        if not isinstance(self.fp8_refill, bool) or (self.fp8_refill and not self.fp8_staging):
            raise ValueError(f"MgpuExtendConfig.fp8_refill must be a bool, True with fp8_staging only (it refills "
                             f"the staging tiles); got fp8_refill={self.fp8_refill!r} with "
                             f"fp8_staging={self.fp8_staging!r}")
        if not isinstance(self.overlap, bool) or (self.overlap and self.consumers != 3):
            raise ValueError(f"MgpuExtendConfig.overlap must be a bool, True with consumers=3 only (the two-consumer "
                             f"schedule barrier orders the matrix work itself); got overlap={self.overlap!r} with "
                             f"consumers={self.consumers}")


@dataclasses.dataclass(frozen=True)
class MgpuDecodeConfig:
    """The Mosaic GPU decode kernels' choices (their tiles are fixed by sm_90's shared memory). splits: the static
    split bound, None for the kernel's own rule (`jaxattn.impl.mgpu_mla.kernel_splits`, `jaxattn.impl.mgpu_decode.
    kernel_splits`: fill every multiprocessor once). stages: the GQA kernel's ring depth (None: its default); the
    MLA kernel's is fixed by its shared memory and must be None. persistent: the GQA kernel's launch, one CTA per
    multiprocessor taking work items in turn (True) or one CTA per item (False); None: its default. block_kv: the
    MLA kernel's key tile, None (64) or 32 (at 576: a 4-deep ring of 32-key tiles, `kernels/mla_attention_mgpu.py`'s
    `DECODE_KV32`; on the H100 at MLA 0.129 ms against 0.124 for 64-key tiles, 179e77b). transposed: the MLA
    kernel's transposed tile (keys as wgmma's M, the heads as N: a quarter of the padded tile's matrix work at 16
    heads; one query token, 576, 16 or 32 heads; `mla_decode_transposed_kernel`), True / False to force it
    on or off; None: wherever it takes the call over a 16-bit cache (`tuning.sm90.MLA_DECODE_TRANSPOSED`; over fp8,
    `MLA_DECODE_TRANSPOSED_FP8`). kernel_merge: the MLA kernel
    (either tile) merging a sequence's splits itself (its last split folds the others' partials: no Triton merge
    launched) where True, the Triton merge where False; None: `tuning.sm90.MLA_DECODE_KERNEL_MERGE`. merger_skew:
    with the kernel merge, the keys the merging split (a sequence's last with keys) takes over from the split before
    it, so that one publishes its partial while the merger still streams (`decode_cta` of
    `kernels/mla_attention_mgpu.py`); None: `tuning.sm90.MLA_DECODE_MERGER_SKEW`."""

    splits: int | None = None
    stages: int | None = None
    persistent: bool | None = None
    block_kv: int | None = None
    transposed: bool | None = None
    kernel_merge: bool | None = None
    merger_skew: int | None = None

    def __post_init__(self):
        if self.splits is not None and (not isinstance(self.splits, int) or self.splits < 1):
            raise ValueError(f"MgpuDecodeConfig.splits must be None or an int >= 1; got {self.splits!r}")
        if self.stages is not None and (not isinstance(self.stages, int) or self.stages < 2):
            raise ValueError(f"MgpuDecodeConfig.stages must be None or an int >= 2; got {self.stages!r}")
        if self.persistent is not None and not isinstance(self.persistent, bool):
            raise ValueError(f"MgpuDecodeConfig.persistent must be None, True or False; got {self.persistent!r}")
        if self.block_kv not in (None, 32, 64):
            raise ValueError(f"MgpuDecodeConfig.block_kv must be None, 32 or 64; got {self.block_kv!r}")
        if self.transposed is not None and not isinstance(self.transposed, bool):
            raise ValueError(f"MgpuDecodeConfig.transposed must be None, True or False; got {self.transposed!r}")
        if self.kernel_merge is not None and not isinstance(self.kernel_merge, bool):
            raise ValueError(f"MgpuDecodeConfig.kernel_merge must be None, True or False; got {self.kernel_merge!r}")
        if self.merger_skew is not None and (not isinstance(self.merger_skew, int) or isinstance(self.merger_skew, bool)
                                             or self.merger_skew < 0):
            raise ValueError(f"MgpuDecodeConfig.merger_skew must be None or an int >= 0; got {self.merger_skew!r}")

