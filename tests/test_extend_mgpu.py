"""The Mosaic GPU extend kernel (Hopper): against the reference and the Triton kernel; its input checks and layout."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.extend import extend_attention
from jaxattn.extend_mgpu import MgpuExtendConfig, extend_attention_mgpu, mgpu_unsupported
from tests.helpers import HAS_GPU, tolerance
from tests.test_extend import assert_output, make_batch, ref_two_stage


def _is_hopper():
    return HAS_GPU and getattr(jax.devices()[0], "compute_capability", "") == "9.0"


needs_hopper = pytest.mark.skipif(not _is_hopper(), reason="needs an sm_90 GPU (Mosaic GPU, wgmma)")

# Ragged batches that reach every path: sequences starting off the 8-row grid (lead rows), partial and whole q tiles,
# one and several 128-row CTAs, prefixes shorter than, equal to and longer than a K tile, empty prefixes and extends,
# token counts that are not a multiple of 8 (the padded copy).
SHAPES = [
    # dtype, q heads, kv heads, head dim, prefix lens, extend lens, config
    (jnp.bfloat16, 8, 2, 128, [0, 37, 128, 300], [130, 5, 64, 257], None),
    (jnp.float16, 4, 4, 128, [513, 0, 9], [1, 200, 71], MgpuExtendConfig(block_kv=64, stages=3)),
    (jnp.bfloat16, 4, 1, 64, [64, 0, 1000, 3], [0, 63, 129, 8], None),
    (jnp.bfloat16, 2, 2, 64, [0], [3], None),  # fewer tokens than a tile
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{jnp.dtype(s[0]).name}-{s[1]}x{s[2]}-{s[3]}-{len(s[4])}seq")
@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("whole_tiles", [False, True], ids=["tokens-odd", "tokens-x8"])
def test_matches_reference(rng, shape, whole_tiles):
    # tokens-odd: every K/V tile by cp.async. tokens-x8 (padded with NaN tokens to a multiple of 8): new-key tiles
    # wholly inside the batch by TMA, the tail tile by cp.async with its padding rows zero-filled.
    dtype, hq, hkv, d, prefix_lens, extend_lens, config = shape
    batch = make_batch(rng, prefix_lens, extend_lens, hq=hq, hkv=hkv, dqk=d, dtype=dtype, max_extend_len=max(extend_lens) + 9)
    q, k_new, v_new = batch.q, batch.k_new, batch.v_new
    if whole_tiles:
        pad = ((0, -q.shape[0] % 8), (0, 0), (0, 0))
        q, k_new, v_new = (jnp.pad(x, pad, constant_values=jnp.nan) for x in (q, k_new, v_new))
    o = extend_attention_mgpu(q, k_new, v_new, batch.k_pool, batch.v_pool, batch.meta, config=config)
    assert o.shape == q.shape and o.dtype == dtype
    assert_output(o, ref_two_stage(batch), batch, dtype)  # rows past batch.tokens (padding) must be 0


@pytest.mark.gpu
@needs_hopper
def test_nan_outside_the_batch_does_not_leak(rng):
    # Unowned pool slots are NaN already (make_batch); padding tokens' K/V too here: a tile that runs past the last
    # sequence reads them, masked, and 0 * NaN must not reach a valid row.
    batch = make_batch(rng, [5, 70], [33, 19], hq=4, hkv=2, dqk=128, dtype=jnp.bfloat16)
    k_new = batch.k_new.at[batch.tokens :].set(jnp.nan)
    v_new = batch.v_new.at[batch.tokens :].set(jnp.nan)
    o = extend_attention_mgpu(batch.q, k_new, v_new, batch.k_pool, batch.v_pool, batch.meta)
    assert_output(o, ref_two_stage(batch), batch, jnp.bfloat16)


@pytest.mark.gpu
@needs_hopper
def test_out_of_range_slots_read_inside_the_pool(rng):
    # Slots past the pool (or negative) are clamped into it, as the Triton kernels do: the call neither faults nor
    # disturbs the other sequences, and the damaged sequence's output stays finite.
    batch = make_batch(rng, [40, 150], [20, 30], hq=4, hkv=2, dqk=128, dtype=jnp.bfloat16)
    slots = batch.k_pool.shape[0]
    k_pool, v_pool = jnp.nan_to_num(batch.k_pool), jnp.nan_to_num(batch.v_pool)  # clamped slots read finite rows
    kv_indices = batch.meta.kv_indices.at[3].set(slots + 1000).at[7].set(-5).at[39].set(2**31 - 1)  # sequence 0's
    bad = dataclasses.replace(batch.meta, kv_indices=kv_indices)
    o = np.float32(extend_attention_mgpu(batch.q, batch.k_new, batch.v_new, k_pool, v_pool, bad))
    ref = np.float32(ref_two_stage(batch))
    assert np.isfinite(o[:20]).all()
    np.testing.assert_allclose(o[20:50], ref[20:50], **tolerance(jnp.bfloat16))


@pytest.mark.gpu
@needs_hopper
def test_matches_triton_kernel_on_a_larger_batch(rng):
    # 1-2k tokens per sequence, GQA 4:1: several CTAs per sequence, long prefix loops, the schedule barrier's steady state.
    batch = make_batch(rng, [1500, 0, 700, 2048], [1024, 2000, 777, 300], hq=8, hkv=2, dqk=128, dtype=jnp.bfloat16, scale=0.5)
    o = extend_attention_mgpu(batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta)
    o_triton = extend_attention(batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta)
    assert_output(o, o_triton, batch, jnp.bfloat16)
    assert_output(o, ref_two_stage(batch), batch, jnp.bfloat16)


@pytest.mark.gpu
@needs_hopper
def test_rows_past_max_extend_len_are_zero(rng):
    # A sequence longer than the static bucket: its first max_extend_len rows are computed, the rest stay 0
    # (as in the Triton kernels), and no neighbouring sequence is disturbed.
    batch = make_batch(rng, [11, 3], [200, 40], hq=4, hkv=2, dqk=128, dtype=jnp.bfloat16, max_extend_len=200)
    short = dataclasses.replace(batch.meta, max_extend_len=130)
    o = np.float32(extend_attention_mgpu(batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, short))
    ref = np.float32(ref_two_stage(batch))
    np.testing.assert_allclose(o[:130], ref[:130], **tolerance(jnp.bfloat16))
    np.testing.assert_array_equal(o[130:200], 0.0)
    np.testing.assert_allclose(o[200:240], ref[200:240], **tolerance(jnp.bfloat16))
    np.testing.assert_array_equal(o[240:], 0.0)


def test_cp_async_phase_counts():
    # The kernel's own phase arithmetic (runs on CPU): against counting the cp.async steps one by one, for prefix
    # lengths, TMA ranges (empty included) and any number of tail tiles.
    from jaxattn.kernels.extend_attention_mgpu import cp_async_uses

    for stages in (2, 3, 4):
        for pre_steps in range(6):
            for tma_tiles in range(4):
                tail_step = pre_steps + tma_tiles
                steps = [m for m in range(14) if m < pre_steps or m >= tail_step]  # the cp.async ones
                got = cp_async_uses(jnp.asarray(steps, jnp.int32), jnp.asarray(steps, jnp.int32) % stages,
                                    pre_steps=jnp.int32(pre_steps), tail_step=jnp.int32(tail_step), stages=stages)
                want = [sum(1 for m in steps if m < step and m % stages == step % stages) for step in steps]
                np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{stages=} {pre_steps=} {tma_tiles=}")


def test_extend_attention_picks_the_kernel(rng):
    batch = make_batch(rng, [4, 9], [8, 5], hq=2, hkv=1, dqk=64, dtype=jnp.bfloat16)
    args = (batch.q, batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta)
    with pytest.raises(ValueError, match="impl must be"):
        extend_attention(*args, impl="cuda")
    if _is_hopper():
        mgpu = extend_attention_mgpu(*args)
        np.testing.assert_array_equal(np.float32(extend_attention(*args)), np.float32(mgpu))  # the default
        with pytest.raises(ValueError, match="impl='mgpu'.*soft cap"):
            extend_attention(*args, logit_cap=30.0, impl="mgpu")
    else:
        with pytest.raises(ValueError, match="impl='mgpu'.*no GPU"):
            extend_attention(*args, impl="mgpu")
    # Features the Mosaic GPU kernel lacks (and impl="triton") take the Triton kernel wherever this runs.
    assert_output(extend_attention(*args, impl="triton"), ref_two_stage(batch), batch, jnp.bfloat16)
    assert_output(extend_attention(*args, logit_cap=5.0), ref_two_stage(batch, logit_cap=5.0), batch, jnp.bfloat16)


def test_says_why_it_cannot_take_a_call():
    S = jax.ShapeDtypeStruct
    q, pool = S((8, 4, 128), jnp.bfloat16), S((32, 2, 128), jnp.bfloat16)
    assert "dtype float32" in mgpu_unsupported(S((8, 4, 128), jnp.float32), pool, pool)
    assert "head dims 128/64" in mgpu_unsupported(q, pool, S((32, 2, 64), jnp.bfloat16))
    assert "head dims 96/96" in mgpu_unsupported(S((8, 4, 96), jnp.bfloat16), S((32, 2, 96), jnp.bfloat16), S((32, 2, 96), jnp.bfloat16))
    for feature in (dict(causal=False), dict(custom_mask=jnp.ones(4, bool)), dict(sliding_window=0), dict(logit_cap=1.0),
                    dict(sinks=jnp.zeros(4)), dict(xai_temperature_len=16)):
        assert "plain causal" in mgpu_unsupported(q, pool, pool, **feature), feature
    assert "interpreted" in mgpu_unsupported(q, pool, pool, mode="interpret")
    if not _is_hopper():
        assert mgpu_unsupported(q, pool, pool) is not None


def test_rejects_what_the_kernel_cannot_take(rng):
    batch = make_batch(rng, [4], [8], hq=2, hkv=1, dqk=64, dtype=jnp.bfloat16)
    args = (batch.k_new, batch.v_new, batch.k_pool, batch.v_pool, batch.meta)
    with pytest.raises(ValueError, match="q must have dtype"):
        extend_attention_mgpu(batch.q.astype(jnp.float32), *(a.astype(jnp.float32) for a in args[:4]), batch.meta)
    odd = make_batch(rng, [4], [8], hq=2, hkv=1, dqk=96, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="head dims of 64 or 128"):
        extend_attention_mgpu(odd.q, odd.k_new, odd.v_new, odd.k_pool, odd.v_pool, odd.meta)
    with pytest.raises(ValueError, match="k_new"):
        extend_attention_mgpu(batch.q, batch.k_new[:, :, :32], *args[1:])
    with pytest.raises(ValueError, match="block_kv"):
        MgpuExtendConfig(block_kv=96)
    with pytest.raises(ValueError, match="stages"):
        MgpuExtendConfig(stages=1)
    with pytest.raises(ValueError, match="shared memory"):
        extend_attention_mgpu(batch.q, *args, config=MgpuExtendConfig(block_kv=128, stages=8))


LOWERING_PLUGIN = os.path.join(os.path.dirname(__file__), "..", ".venv", "mosaic_gpu_lowering")


@pytest.mark.skipif(not os.path.isdir(os.path.join(LOWERING_PLUGIN, "jax_cuda12_plugin")),
                    reason="jax's CUDA plugin module is not in .venv/mosaic_gpu_lowering (scripts/setup.sh puts it there)")
def test_lowers_for_cuda_on_cpu():
    # CI has no GPU and Pallas' GPU interpreter cannot run this kernel: lowering it for CUDA is what CI can check.
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(LOWERING_PLUGIN), repo]), JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-m", "tests.lower_mgpu_kernel"], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.count("ok ") == 4, run.stdout
