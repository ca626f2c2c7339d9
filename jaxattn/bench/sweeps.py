"""Candidate kernel configurations per shape (`--sweep`): what a tuning table should pick from."""

from __future__ import annotations

import dataclasses
import itertools

from .cases import Case
from .peers import decode_jaxattn, extend_jaxattn


def sweep_variants(op: str, case: Case):
    """(label, maker) for candidate kernel configurations of this shape: what a tuning table should pick from."""
    variants = []
    if op == "decode":
        from jaxattn.tuning import DecodeConfig

        # fp8 rows are half as wide and their f16 dots want fewer warps (tuning.sm90.DECODE_FP8): longer pipelines,
        # 2 or 4 warps.
        mla = case.head_dim > 256
        if case.fp8:
            grid = ((16, 32, 64) if mla else (32, 64, 128), (2, 4), (2, 3, 4) if mla else (4, 6, 8))
        else:
            grid = ((32, 64, 128), (2, 4, 8) if mla else (4, 8), (2, 3, 4))
        for block_n in grid[0]:
            for num_warps in grid[1]:
                for num_stages in grid[2]:
                    if mla and (block_n > 64 or num_stages > 3) and not case.fp8:
                        continue  # MLA tiles: shared memory
                    config = DecodeConfig(block_n=block_n, num_warps=num_warps, num_stages=num_stages)
                    label = f"n{block_n} w{num_warps} s{num_stages}"
                    variants.append((label, lambda inp, c=config: decode_jaxattn(inp, config=c)))
        if case.fp8:  # K and V converted in registers (DecodeConfig.fp8_in_registers): no byte-wise shared-memory reads
            tiles = ((32, 4, 2), (64, 4, 2), (64, 8, 2), (32, 8, 2)) if mla else (
                (64, 2, 6), (64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 4, 4), (128, 8, 3))
            for block_n, num_warps, num_stages in tiles:
                config = DecodeConfig(block_n=block_n, num_warps=num_warps, num_stages=num_stages, fp8_in_registers=True)
                label = f"n{block_n} w{num_warps} s{num_stages} in-registers"
                variants.append((label, lambda inp, c=config: decode_jaxattn(inp, config=c)))
        if case.fp8 and not mla:  # issue 26, not yet timed: one-warp tiles (no cross-warp row reductions; 7-12
            # programs a multiprocessor where the table tile holds 4 at 244 registers) and split counts per tile.
            # Stages 3/4, 5/6 and 7/8 compile to the same code (1, 2, 3 K/V buffers); 2 loads the indices unpipelined.
            for block_n, num_warps, num_stages in ((32, 1, 6), (32, 1, 4), (64, 1, 4)):
                config = DecodeConfig(block_n=block_n, num_warps=num_warps, num_stages=num_stages)
                variants.append((f"fp8 n{block_n} w{num_warps} s{num_stages}",
                                 lambda inp, c=config: decode_jaxattn(inp, config=c)))
            for (block_n, num_warps, num_stages), pps in itertools.product(((64, 2, 6), (32, 1, 6)), (4, 12, 16, 24, 32)):
                config = DecodeConfig(block_n=block_n, num_warps=num_warps, num_stages=num_stages)
                variants.append((f"fp8 n{block_n} w{num_warps} s{num_stages} pps{pps}",
                                 lambda inp, c=config, p=pps: decode_jaxattn(inp, config=c, programs_per_sm=p)))
            # K and V converted to f16 in their loads' layout (fp8_in_registers). SASS for sm_90 (`python -m
            # jaxattn.aot --loop`'s count with unmasked key loads, 2026-12-07), warp-instructions a key / programs an
            # SM: the table tile 28.9 / 4 (n64 w1 s4 26.8 / 10, n32 w1 s6 27.9 / 10); in registers n64 w2 s6 18.0 /
            # 4, n64 w2 s4 17.7 / 5, n32 w1 s4 18.9 / 10, n32 w1 s6 19.0 / 7, n64 w1 s4 16.7 / 6. Nsight Compute
            # found the table tile issue-bound on the H200 (IPC 2.14, at 35 instructions a key). With the folded
            # softmax scale and deferred row sums (2026-12-08): the table tile 27.7, in registers 17.1 / 16.8 / 17.8 /
            # 18.0 / 16.1 (n32 w1 s4 at 209 registers: 9 an SM).
            inreg_tiles = [(tile, pps) for tile in ((64, 2, 4), (64, 2, 6), (32, 1, 4)) for pps in (None, 4, 16)]
            for (block_n, num_warps, num_stages), pps in inreg_tiles + [((64, 1, 4), None), ((32, 1, 6), None)]:
                config = DecodeConfig(block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                                      fp8_in_registers=True)
                variants.append((f"fp8 inreg n{block_n} w{num_warps} s{num_stages}{f' pps{pps}' if pps else ''}",
                                 lambda inp, c=config, p=pps: decode_jaxattn(inp, config=c, programs_per_sm=p)))
            # With the keys as the dots' M as well (keys_as_rows: wgmma, 4 warps a program): 22.6 instructions a key
            # at n64 s2 (120 registers, 4 programs an SM: 16 warps), 18.3 at n128 s3 (3 an SM); 38.3 without.
            for block_n, num_stages in ((64, 2), (128, 3)):
                config = DecodeConfig(block_n=block_n, num_warps=4, num_stages=num_stages, keys_as_rows=True,
                                      fp8_in_registers=True)
                variants.append((f"fp8 inreg keys-as-rows n{block_n} w4 s{num_stages}",
                                 lambda inp, c=config: decode_jaxattn(inp, config=c)))
        if case.fp8 and not mla:  # Split counts by whole waves of the table tile's resident programs (SplitWaves, the
            # default since the fortieth session), the fill heuristic it replaced, and fixed counts to check the
            # model's choice against (a huge programs_per_sm: the fill heuristic takes the bound).
            from jaxattn import tuning
            from jaxattn.metadata import FILL_PROGRAMS_PER_SM

            waves = tuning.decode_split_waves(case.head_dim, case.dv, case.q_heads, case.kv_heads)
            variants.append(("fp8 waves", lambda inp, w=waves: decode_jaxattn(inp, split_waves=w)))
            variants.append(("fp8 fill", lambda inp: decode_jaxattn(inp, programs_per_sm=FILL_PROGRAMS_PER_SM)))
            table_tile = tuning.decode_config(case.head_dim, case.dv, case.q_heads // case.kv_heads, fp8_pool=True)
            config = dataclasses.replace(table_tile, fp8_in_registers=True)
            variants.append((f"fp8 inreg n{config.block_n} w{config.num_warps} s{config.num_stages} waves",
                             lambda inp, c=config, w=waves: decode_jaxattn(inp, config=c, split_waves=w)))
            for splits in (1, 2, 4, 8, 11, 12, 16, 33):
                variants.append((f"fp8 splits={splits}", lambda inp, s=splits: decode_jaxattn(
                    inp, programs_per_sm=1 << 16, max_kv_splits=s)))
        if mla and not case.fp8:  # 64-row tiles (MLA's 16 heads padded, or 16 heads x 4 tokens): wgmma, 8 warps
            for block_n, num_stages in ((16, 2), (16, 3), (32, 2), (32, 3)):
                config = DecodeConfig(block_n=block_n, block_h=64, num_warps=8, num_stages=num_stages)
                label = f"h64 n{block_n} w8 s{num_stages}"
                variants.append((label, lambda inp, c=config: decode_jaxattn(inp, config=c)))
                variants.append((f"{label} pps2", lambda inp, c=config: decode_jaxattn(inp, config=c, programs_per_sm=2)))
        if case.v_in_k:  # the Mosaic GPU MLA kernel (fp8 latent caches: "mgpu-fp8"): its split bound and key tile
            from jaxattn.tuning import MgpuDecodeConfig

            impl = "mgpu-fp8" if case.fp8 else "mgpu"
            for splits in (1, 2, 3, 4, 6, 8):
                config = MgpuDecodeConfig(splits=splits)
                variants.append((f"mgpu splits={splits}", lambda inp, c=config: decode_jaxattn(inp, config=c, impl=impl)))
            for merge in ("kernel", "triton"):  # the kernel merging its own splits, or the Triton merge after it
                config = MgpuDecodeConfig(kernel_merge=merge == "kernel")
                variants.append((f"mgpu merge={merge} splits=own",
                                 lambda inp, c=config: decode_jaxattn(inp, config=c, impl=impl)))
            for skew in (64, 128):  # the merging split taking over keys from the one before it (its default tile)
                config = MgpuDecodeConfig(kernel_merge=True, merger_skew=skew)
                variants.append((f"mgpu skew={skew} splits=own",
                                 lambda inp, c=config: decode_jaxattn(inp, config=c, impl=impl)))
            if case.head_dim == 576:  # 32-key tiles in a 4-deep ring; the transposed tile (one token)
                for splits in (None, 1, 2, 4):
                    config = MgpuDecodeConfig(splits=splits, block_kv=32)
                    variants.append((f"mgpu kv32 splits={splits or 'own'}",
                                     lambda inp, c=config: decode_jaxattn(inp, config=c, impl=impl)))
                    if case.new == 1:  # the transposed tile (merging its splits itself, or through the Triton
                        # merge), the 16-bit cache's default; the padded one, "mgpu-fp8"'s default over fp8
                        for transposed, merge, name in ((True, None, "transposed"),
                                                        (True, False, "transposed triton-merge"),
                                                        (False, None, "padded")):
                            config = MgpuDecodeConfig(splits=splits, transposed=transposed, kernel_merge=merge)
                            variants.append((f"mgpu {name} splits={splits or 'own'}",
                                             lambda inp, c=config: decode_jaxattn(inp, config=c, impl=impl)))
        # Keys as the dots' M dimension (DecodeConfig.keys_as_rows): wgmma without padding the heads to 64 rows.
        rows = case.new * case.q_heads // case.kv_heads  # (token, q head) rows per kv head
        if mla and rows > 16:
            tiles = ((32, 8, 2), (32, 8, 3), (64, 8, 2), (16, 8, 2))
        elif mla:
            tiles = ((32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 8, 2), (32, 8, 2))
        else:
            tiles = ((32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (64, 8, 3))
        for block_n, num_warps, num_stages in tiles:
            config = DecodeConfig(block_n=block_n, block_h=64 if rows > 16 else 16, num_warps=num_warps,
                                  num_stages=num_stages, keys_as_rows=True)
            label = f"keys-as-rows h{config.block_h} n{block_n} w{num_warps} s{num_stages}"
            variants.append((label, lambda inp, c=config: decode_jaxattn(inp, config=c)))
            if mla:
                variants.append((f"{label} pps2", lambda inp, c=config: decode_jaxattn(inp, config=c, programs_per_sm=2)))
                variants.append((f"{label} pps4", lambda inp, c=config: decode_jaxattn(inp, config=c, programs_per_sm=4)))
        if case.q_heads == case.kv_heads:  # MHA: the vector kernel's tiles beside the grouped kernel's above
            for block_n in (32, 64, 128):
                for num_warps in (2, 4, 8):
                    config = DecodeConfig(block_n=block_n, block_h=1, num_warps=num_warps, num_stages=1)
                    variants.append((f"vector n{block_n} w{num_warps}", lambda inp, c=config: decode_jaxattn(inp, config=c)))
        # MLA's one head block per sequence: fewer, longer splits (1-2 programs per SM) halve the partial buffers.
        for programs_per_sm in (1, 2, 4, 16) if mla else (4, 16):
            variants.append((f"default pps{programs_per_sm}", lambda inp, p=programs_per_sm: decode_jaxattn(inp, programs_per_sm=p)))
    else:
        from jaxattn.tuning import ExtendConfig

        for block_m, block_n, num_warps in ((64, 64, 4), (128, 64, 8), (128, 128, 8), (64, 128, 4), (128, 32, 8)):
            for num_stages in (2, 3):
                if case.head_dim > 256 and block_m > 64:
                    continue
                config = ExtendConfig(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
                label = f"m{block_m} n{block_n} w{num_warps} s{num_stages}"
                variants.append((label, lambda inp, c=config: extend_jaxattn(inp, config=c)))
        # The Mosaic GPU kernel's tiles (tuning.sm90.EXTEND_MGPU), where it takes the shape: those sm_90's shared
        # memory holds.
        from jaxattn.hardware import SM90
        from jaxattn.impl.mgpu_extend import MGPU_HEAD_DIMS, fp8_staging_fits
        from jaxattn.tuning import MgpuExtendConfig

        if (case.head_dim, case.dv) in MGPU_HEAD_DIMS:
            for block_kv in (64, 128):
                for stages in (2, 3, 4):
                    config = MgpuExtendConfig(block_kv=block_kv, stages=stages)
                    if config.shared_memory_bytes(case.head_dim, case.dv) > SM90.shared_memory_bytes:
                        continue
                    variants.append((f"mgpu kv{block_kv} s{stages}",
                                     lambda inp, c=config: extend_jaxattn(inp, config=c, impl="mgpu")))
                    if case.fp8:  # the kernel converting fp8 tiles itself, whose copies run stages - 1 tiles ahead:
                        # to f16 (the default where the kernel takes it) and to q's dtype, scaled; and with the
                        # copies in staging tiles of their own, a tile earlier, where they fit
                        # (each thread refilling the staging bytes it converted, `fp8_refill`, as well)
                        for tiles, (staging, refill) in itertools.product(
                                ("f16", "q_dtype"), ((False, False), (True, False), (True, True))):
                            fp8_config = dataclasses.replace(config, fp8_tiles=tiles, fp8_staging=staging,
                                                             fp8_refill=refill)
                            if staging and not fp8_staging_fits(fp8_config, case.head_dim):
                                continue
                            form = " staged refill" if refill else " staged" if staging else ""
                            variants.append((f"mgpu-fp8 {tiles} kv{block_kv} s{stages}{form}",
                                             lambda inp, c=fp8_config: extend_jaxattn(inp, config=c, impl="mgpu-fp8")))
            if (case.head_dim, case.dv) == (64, 64):  # three consumer warpgroups (192-row CTAs, FA3's 64-dim tile),
                # with and without the intra-warpgroup overlap FA3 runs it with
                for (block_kv, stages), overlap in itertools.product(((128, 2), (128, 3), (64, 3)), (False, True)):
                    config = MgpuExtendConfig(block_kv=block_kv, stages=stages, consumers=3, overlap=overlap)
                    variants.append((f"mgpu consumers3{' overlap' if overlap else ''} kv{block_kv} s{stages}",
                                     lambda inp, c=config: extend_jaxattn(inp, config=c, impl="mgpu")))
    return variants
