"""Every shipped kernel configuration compiles for the H200 (sm_90) on a CPU-only machine and fits its limits."""

import pytest
import triton

from jaxattn.aot import H200_SHARED_LIMIT_BYTES, compile_build, shipped_builds
from jaxattn.tuning.sm90 import DECODE_FP8_RESIDENT_PER_SM, TIMED_TRITON

BUILDS = shipped_builds()


def test_every_op_module_ships_builds():
    modules = {b.module for b in BUILDS}
    assert {"kv_indices", "merge_state"} <= modules


@pytest.mark.parametrize("kb", BUILDS, ids=[b.key for b in BUILDS])
def test_compiles_for_sm90_within_limits(kb):
    report = compile_build(kb)
    assert report.shared_bytes <= H200_SHARED_LIMIT_BYTES, f"{kb.key} needs {report.shared_bytes} B of shared memory"
    if kb.expects_wgmma:
        assert report.has_wgmma, f"{kb.key} is built around tl.dot on 16-bit inputs but its PTX has no wgmma"
    if kb.expects_pipelining:
        assert report.has_async_copy, f"{kb.key} runs {kb.num_stages} stages but its loads are not pipelined (no cp.async)"
    if kb.max_registers is not None and report.registers is not None and triton.__version__.startswith(TIMED_TRITON):
        # The config was timed at this occupancy (on the Triton the tables were timed with): more registers per thread
        # means fewer CTAs per SM.
        assert report.registers <= kb.max_registers, f"{kb.key} uses {report.registers} registers (timed at <= {kb.max_registers})"
    if report.spills is not None:
        # Spills are allowed but reported; a big spill is a tuning bug worth failing on.
        assert report.spills <= 1024, f"{kb.key} spills {report.spills} bytes"


def test_fp32_decode_lookup_takes_the_fp32_tile():
    import jax.numpy as jnp

    from jaxattn import tuning

    bf16 = tuning.decode_config(128, 128, 2, family="sm_90", dtype=jnp.bfloat16)
    fp32 = tuning.decode_config(128, 128, 2, family="sm_90", dtype=jnp.float32)
    assert bf16 == tuning.decode_config(128, 128, 2, family="sm_90")  # 16-bit: the table's tile
    assert fp32 == tuning.clamp_decode_config(tuning.float32_decode_config(bf16, 128, 128), 2)
    assert (fp32.block_n, fp32.num_stages, fp32.num_warps) == (64, 2, 8)  # the table's 128 keys x 3 stages spill in fp32
    assert any(b.label.startswith("fp32 128/128 g16") for b in BUILDS)  # and the fp32 tiles are compiled above


def test_main_loop_reads_the_key_loop_of_a_build():
    # jaxattn.aot.main_loop (the SASS of a build's key loop, to compare tiles before GPU time): the fp8 table tile's
    # f16 dots are mma.sync (HMMA) in its loop, the keys-as-rows tile's are wgmma (HGMMA), each loop a few hundred
    # instructions or more per warp and iteration.
    from jaxattn.aot import main_loop

    builds = {b.key: b for b in BUILDS}
    name = "decode_attention.decode_stage1_kernel[bf16 q, fp8e4nv pool 128/128{}]"
    table, rows = main_loop(builds[name.format("")]), main_loop(builds[name.format(" keys as rows")])
    assert table.count("HMMA") > 0 and table.count("HGMMA") == 0, table.opcodes[:12]
    assert rows.count("HGMMA") > 0, rows.opcodes[:12]
    assert min(table.instructions, rows.instructions) > 200


def test_resident_blocks_follow_cudas_occupancy_rules():
    from jaxattn.hardware import resident_blocks

    assert resident_blocks(255, 39424, 2) == 4  # registers: 256 a thread x 64 threads = 16K of the SM's 64K
    assert resident_blocks(168, 0, 2) == 6  # 168 x 32 = 21 x 256 a warp: 10752 a block
    assert resident_blocks(116, 74240, 4) == 3  # shared memory: 3 x (72.5 + 1 reserved) KB of 228
    assert resident_blocks(32, 0, 16) == 4  # warps: 64 an SM
    assert resident_blocks(16, 0, 1) == 32  # blocks: 32 an SM


@pytest.mark.parametrize("key", sorted(DECODE_FP8_RESIDENT_PER_SM), ids=str)
def test_decode_fp8_residency_table_matches_the_compiled_tiles(key):
    # tuning.sm90.DECODE_FP8_RESIDENT_PER_SM (split counts by waves of resident programs) against the table tile
    # as the Triton the tables were timed with compiles it.
    from jaxattn.hardware import resident_blocks

    qk_dim, v_dim, _ = key
    kb = {b.key: b for b in BUILDS}[f"decode_attention.decode_stage1_kernel[bf16 q, fp8e4nv pool {qk_dim}/{v_dim}]"]
    report = compile_build(kb)
    if report.registers is None or not triton.__version__.startswith(TIMED_TRITON):
        pytest.skip(f"residency is stated for Triton {TIMED_TRITON}'s code (ptxas report: {report.registers})")
    assert resident_blocks(report.registers, report.shared_bytes, kb.num_warps) == DECODE_FP8_RESIDENT_PER_SM[key]
