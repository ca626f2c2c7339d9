"""The Mosaic GPU GQA decode kernel (`decode_attention(..., impl="mgpu-gqa")`, fp8 pools "mgpu-gqa-fp8") against the
reference.

The kernel needs an sm_90 GPU: its numerics run under `-m gpu`; CI lowers it for CUDA (tests/lower_mgpu_kernel.py,
from tests/test_extend_mgpu.py) and checks here what runs without a GPU (which calls it takes, its split rule).
Pools are bigger than the batch, slots scattered, every unused row (slot 0 included) NaN, so a wrong gather shows.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import hardware, testing
from jaxattn.calls import DecodeCall
from jaxattn.decode import decode_attention, decode_attention_reference, decode_metadata_from_indptr
from jaxattn.impl import mgpu_decode
from jaxattn.tuning import MgpuDecodeConfig
from tests.helpers import HAS_GPU, assert_nan_confined
from tests.test_decode import LSE_TOL, make_pools
from tests.test_fp8 import per_head, quantised

needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU (sm_90)")

# Lengths: 1, odd, 0 (padding), one tile, a split's tail mid-tile, long ones in many splits.
KV_LENS = [1, 37, 0, 64, 161, 1000, 4097, 300]


def make_case(rng, q_heads, kv_heads, dim, dtype, pool, *, kv_lens=KV_LENS, window=-1, deterministic=False):
    """q, the pools (fp8: quantised with per-head K scales and a float V scale), the metadata, and the scale kwargs."""
    q, k_pool, v_pool, kv_indptr, kv_indices = make_pools(rng, kv_lens, q_heads, kv_heads, dim, dim, dtype)
    kwargs = {}
    if pool != dtype:
        kwargs = dict(k_scale=per_head(kv_heads), v_scale=1.5)
        k_pool, v_pool = quantised(k_pool, kwargs["k_scale"], pool), quantised(v_pool, 1.5, pool)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=q_heads, kv_heads=kv_heads,
                                       max_kv_splits=32 if deterministic else 8, sliding_window=window,
                                       deterministic=deterministic, min_split_len=32, programs_per_sm=10**6)
    return q, k_pool, v_pool, meta, kwargs


def impl_for(q, k_pool):
    return "mgpu-gqa" if k_pool.dtype == q.dtype else "mgpu-gqa-fp8"


def run_both(q, k_pool, v_pool, meta, **kwargs):
    o, lse = decode_attention(q, k_pool, v_pool, meta, impl=impl_for(q, k_pool), return_lse=True, **kwargs)
    reference_kwargs = {name: value for name, value in kwargs.items() if name != "config"}
    ref_o, ref_lse = decode_attention_reference(q, k_pool, v_pool, meta, return_lse=True, **reference_kwargs)
    return o, lse, ref_o, ref_lse


def assert_close(o, lse, ref_o, ref_lse, dtype, score_scale: float = 1.0):
    """score_scale: how much larger than unit-variance scores this case's are. The LSE's absolute error follows the
    scores' (an LSE near 0 can come from scores of tens), so its tolerance scales with them."""
    assert not np.isnan(np.float32(o)).any()  # unused NaN rows never leak
    np.testing.assert_allclose(np.float32(o), np.float32(ref_o), **testing.tolerance(dtype))
    finite = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    tol = LSE_TOL[jnp.dtype(dtype)] * score_scale
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], atol=tol, rtol=tol)


POOLS = [
    pytest.param((jnp.bfloat16, jnp.float8_e4m3fn), id="bf16-q-e4m3"),
    pytest.param((jnp.float16, jnp.float8_e5m2), id="f16-q-e5m2"),
    pytest.param((jnp.bfloat16, jnp.bfloat16), id="bf16"),
    pytest.param((jnp.float16, jnp.float16), id="f16"),
]
# (q heads, kv heads, head dim): Llama's group of 4, MHA, a group of 8 on one kv head (the CTA's second consumer
# idles), an odd kv head count, the most rows a consumer takes.
SHAPES = [pytest.param((32, 8, 128), id="32x8"), pytest.param((4, 4, 128), id="mha"),
          pytest.param((8, 1, 128), id="8x1"), pytest.param((12, 3, 128), id="12x3"),
          pytest.param((64, 1, 128), id="64x1")]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtypes", POOLS)
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_matches_reference(rng, dtypes, shape):
    dtype, pool = dtypes
    q_heads, kv_heads, dim = shape
    q, k_pool, v_pool, meta, kwargs = make_case(rng, q_heads, kv_heads, dim, dtype, pool)
    o, lse, ref_o, ref_lse = run_both(q, k_pool, v_pool, meta, **kwargs)
    assert o.shape == (len(KV_LENS), q_heads, dim) and o.dtype == dtype
    assert_close(o, lse, ref_o, ref_lse, dtype)
    np.testing.assert_array_equal(np.float32(o[2]), 0.0)  # padding row
    assert np.all(np.asarray(lse[2]) == -np.inf)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtypes", POOLS[:2])
def test_fp8_large_scores_and_outlier_channels(rng, dtypes):
    # Scores of tens (q x 20: a sharp softmax magnifies score errors) and q rows with two channels x 100: within q's
    # tolerance of the reference (the f16 dots round bf16 q * sm_scale to f16 once).
    dtype, pool = dtypes
    q, k_pool, v_pool, meta, kwargs = make_case(rng, 32, 8, 128, dtype, pool)
    q = (q.astype(jnp.float32) * 20).astype(dtype)
    # H200 (6eddc25): 2 of 224 LSEs near 0 from scores of tens, 0.006-0.009 off at the unscaled 2e-3 (f16 q rounding)
    assert_close(*run_both(q, k_pool, v_pool, meta, **kwargs), dtype, score_scale=20)
    q, k_pool, v_pool, meta, kwargs = make_case(rng, 32, 8, 128, dtype, pool)
    q = q.at[:, :, 3].multiply(100).at[:, :, 77].multiply(100)
    assert_close(*run_both(q, k_pool, v_pool, meta, **kwargs), dtype)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("config", [MgpuDecodeConfig(splits=1), MgpuDecodeConfig(splits=5, stages=2),
                                    MgpuDecodeConfig(splits=2, stages=3)], ids=["1-split", "5-splits-2-stages",
                                                                                "2-splits-3-stages"])
def test_configs_and_head_dim_64(rng, config):
    q, k_pool, v_pool, meta, kwargs = make_case(rng, 32, 8, 128, jnp.bfloat16, jnp.float8_e4m3fn)
    assert_close(*run_both(q, k_pool, v_pool, meta, config=config, **kwargs), jnp.bfloat16)
    # 16-bit pools at head dim 64 (fp8 takes 128 only)
    q, k_pool, v_pool, meta, kwargs = make_case(rng, 16, 2, 64, jnp.float16, jnp.float16)
    assert_close(*run_both(q, k_pool, v_pool, meta, config=config, **kwargs), jnp.float16)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtypes", [POOLS[0], POOLS[2]])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[3]])
@pytest.mark.parametrize("splits", [1, 3])
def test_persistent_ctas_match_reference(rng, dtypes, shape, splits):
    # Persistent CTAs take several work items each (48 sequences x kv head pairs x splits outnumber the GPU's
    # multiprocessors): ring phases and Q reloads carry across items of 0, 1, an odd count and many tiles, and across
    # items where an odd kv head count leaves the second consumer idle.
    dtype, pool = dtypes
    q_heads, kv_heads, dim = shape
    kv_lens = KV_LENS * 6
    q, k_pool, v_pool, meta, kwargs = make_case(rng, q_heads, kv_heads, dim, dtype, pool, kv_lens=kv_lens, window=700)
    config = MgpuDecodeConfig(splits=splits, persistent=True)
    o, lse, ref_o, ref_lse = run_both(q, k_pool, v_pool, meta, config=config, **kwargs)
    assert_close(o, lse, ref_o, ref_lse, dtype)
    np.testing.assert_array_equal(np.float32(o[2::len(KV_LENS)]), 0.0)  # the empty sequences
    # Bitwise the same as one CTA per item: the same tiles in the same order, only their CTAs differ.
    one_per_item = decode_attention(q, k_pool, v_pool, meta, impl=impl_for(q, k_pool),
                                    config=MgpuDecodeConfig(splits=splits, persistent=False), **kwargs)
    np.testing.assert_array_equal(np.float32(o), np.float32(one_per_item))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtypes", [POOLS[0], POOLS[2]])
@pytest.mark.parametrize("persistent", [False, True], ids=["one-cta-per-item", "persistent"])
def test_one_split_writes_the_result_itself(rng, dtypes, persistent):
    # One split per sequence and no sinks: the kernel stores o and the LSE itself (no merge launch), bit for bit what
    # the merge makes of its partials; a sink of -inf (which adds nothing) takes the merged path.
    dtype, pool = dtypes
    q, k_pool, v_pool, meta, kwargs = make_case(rng, 32, 8, 128, dtype, pool, kv_lens=KV_LENS * 4, window=2000)
    config = MgpuDecodeConfig(splits=1, persistent=persistent)
    o, lse, ref_o, ref_lse = run_both(q, k_pool, v_pool, meta, config=config, **kwargs)
    assert_close(o, lse, ref_o, ref_lse, dtype)
    no_sinks = jnp.full((32,), -jnp.inf, jnp.float32)
    merged_o, merged_lse = decode_attention(q, k_pool, v_pool, meta, impl=impl_for(q, k_pool), return_lse=True,
                                            config=config, sinks=no_sinks, **kwargs)
    np.testing.assert_array_equal(np.float32(o), np.float32(merged_o))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(merged_lse))
    np.testing.assert_array_equal(np.float32(o[2::len(KV_LENS)]), 0.0)  # empty sequences: 0, LSE -inf
    assert np.all(np.asarray(lse[2::len(KV_LENS)]) == -np.inf)


@pytest.mark.gpu
@needs_gpu
def test_window_sinks_and_deterministic(rng):
    q, k_pool, v_pool, meta, kwargs = make_case(rng, 32, 8, 128, jnp.bfloat16, jnp.float8_e4m3fn, window=200)
    sinks = jnp.asarray(rng.standard_normal(32).astype(np.float32))
    assert_close(*run_both(q, k_pool, v_pool, meta, sinks=sinks, **kwargs), jnp.bfloat16)
    # Deterministic metadata: the metadata's splits (length only), so a sequence's bits do not depend on its batch.
    q, k_pool, v_pool, meta, kwargs = make_case(rng, 32, 8, 128, jnp.bfloat16, jnp.float8_e4m3fn, deterministic=True)
    o, lse, ref_o, ref_lse = run_both(q, k_pool, v_pool, meta, **kwargs)
    assert_close(o, lse, ref_o, ref_lse, jnp.bfloat16)
    alone = decode_metadata_from_indptr(jnp.asarray([0, KV_LENS[6]], jnp.int32),
                                        meta.kv_indices[int(meta.kv_indptr[6]):int(meta.kv_indptr[7])],
                                        q_heads=32, kv_heads=8, max_kv_splits=32, deterministic=True)
    o_alone = decode_attention(q[6:7], k_pool, v_pool, alone, impl="mgpu-gqa-fp8", **kwargs)
    np.testing.assert_array_equal(np.float32(o_alone[0]), np.float32(o[6]))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("pool", [jnp.float8_e4m3fn, jnp.bfloat16], ids=["e4m3", "bf16"])
def test_nan_stays_in_its_row(rng, pool):
    q, k_pool, v_pool, meta, kwargs = make_case(rng, 32, 8, 128, jnp.bfloat16, pool)
    q = q.at[4, 3, 100].set(jnp.nan)
    o = decode_attention(q, k_pool, v_pool, meta, impl=impl_for(q, k_pool), **kwargs)
    assert_nan_confined(o, (4, 3))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("config", [None, MgpuDecodeConfig(splits=1, persistent=True)],
                         ids=["default", "persistent-final-write"])
def test_hostile_indices_stay_inside(rng, config):
    # Slots past the pool and negative ones, and an indptr past kv_indices: clamped, no fault, the shape intact; also
    # on persistent CTAs writing the result themselves (each CTA reads its items' indptr entries in turn).
    q, k_pool, v_pool, meta, kwargs = make_case(rng, 32, 8, 128, jnp.bfloat16, jnp.float8_e4m3fn)
    bad = meta.kv_indices.at[5].set(10**9).at[40].set(-7)
    meta = dataclasses.replace(meta, kv_indices=bad, kv_indptr=meta.kv_indptr.at[-1].set(10**6))
    o = decode_attention(q, k_pool, v_pool, meta, impl="mgpu-gqa-fp8", config=config, **kwargs)
    jax.block_until_ready(o)
    assert o.shape == (len(KV_LENS), 32, 128)


# What runs without a GPU.

def _call(q_heads=32, kv_heads=8, tokens=1, dtype=jnp.bfloat16, dim=128, latent=False, batch=4, **fields):
    q = jax.ShapeDtypeStruct((batch, q_heads, dim) if tokens == 1 else (batch, tokens, q_heads, dim), dtype)
    k_pool = jax.ShapeDtypeStruct((100, kv_heads, dim), fields.pop("pool_dtype", dtype))
    base = dict(q=q, k_pool=k_pool, v_pool=None if latent else k_pool, meta=None, sinks=None, sm_scale=0.1,
                logit_cap=0.0, xai_temperature_len=-1, sliding_window=-1, v_head_dim=fields.pop("v_head_dim", dim),
                return_lse=False, config=None, launch_mode="gpu")
    base.update(fields)
    return DecodeCall(**base)


def test_declines_name_the_reason():
    declines, declines_fp8 = mgpu_decode.declines, mgpu_decode.declines_fp8
    assert "fp8 pools: impl=\"mgpu-gqa-fp8\"" in declines(_call(pool_dtype=jnp.float8_e4m3fn))
    assert "fp8 only" in declines_fp8(_call())
    assert "latent pool" in declines(_call(latent=True))
    assert "float32" in declines(_call(dtype=jnp.float32))
    assert "q's dtype or fp8" in declines(_call(pool_dtype=jnp.float16))
    assert "head dims 64/64" in declines_fp8(_call(dim=64, pool_dtype=jnp.float8_e4m3fn))  # fp8 rows of 64 bytes
    assert "head dims 256/256" in declines(_call(dim=256))
    assert "head dims 128/64" in declines(_call(v_head_dim=64))
    assert "q heads per kv head" in declines(_call(q_heads=128, kv_heads=1))
    assert "several query tokens" in declines(_call(tokens=2))
    assert "soft cap" in declines(_call(logit_cap=30.0))
    assert "grid's third dimension" in declines(_call(batch=70000, config=MgpuDecodeConfig(persistent=False)))
    assert declines(_call(batch=70000)) == hardware.mosaic_gpu_unavailable("gpu")  # persistent CTAs: a 1-D grid
    assert "MgpuDecodeConfig" in declines(_call(config=object()))
    assert "interpreted" in declines(_call(launch_mode="interpret"))
    if not HAS_GPU:
        assert "sm_90" in declines(_call())
        assert "sm_90" in declines(_call(dim=64))  # 16-bit pools take head dim 64


def test_split_rule_fills_the_gpu_once():
    assert mgpu_decode.kernel_splits(64, 8, num_sms=132) == 1  # D1: 256 CTAs (two kv heads each), in waves
    assert mgpu_decode.kernel_splits(8, 8, num_sms=132) == 4  # D2: 128 CTAs
    assert mgpu_decode.kernel_splits(2, 3, num_sms=132) == 33  # an odd kv head count: 2 pairs per sequence
    assert mgpu_decode.kernel_splits(1, 1, num_sms=132) == 132


def test_persistent_ctas_take_many_short_items():
    # Items = splits x kv head pairs x sequences; persistent CTAs (one per multiprocessor) above two per multiprocessor.
    rule = mgpu_decode.persistent_ctas
    assert rule(_call(batch=64), splits=1, num_sms=132) == 0  # D1: 256 items
    assert rule(_call(batch=8), splits=4, num_sms=132) == 0  # D2: 128 items
    assert rule(_call(batch=256), splits=1, num_sms=132) == 132  # D3: 1024 items
    assert rule(_call(batch=256, config=MgpuDecodeConfig(persistent=False)), splits=1, num_sms=132) == 0
    assert rule(_call(batch=1, config=MgpuDecodeConfig(persistent=True)), splits=1, num_sms=132) == 132


def test_split_bound_decides_the_final_write():
    # A bound of 1 (and no sinks) is the kernel's final write, no merge: the rule's bound, a config's, or
    # deterministic metadata's own (which the config does not override).
    import types

    meta = types.SimpleNamespace(deterministic=False, max_kv_splits=64)
    bound = mgpu_decode.kernel_split_bound
    assert bound(_call(batch=64, meta=meta)) == mgpu_decode.kernel_splits(64, 8)
    assert bound(_call(batch=8, meta=meta, config=MgpuDecodeConfig(splits=1))) == 1
    deterministic = types.SimpleNamespace(deterministic=True, max_kv_splits=16)
    assert bound(_call(batch=8, meta=deterministic, config=MgpuDecodeConfig(splits=1))) == 16


def test_stages_that_do_not_fit_are_refused():
    from jaxattn.kernels.decode_attention_mgpu import shared_bytes

    assert mgpu_decode.ring_stages(128, 1) == 3 and mgpu_decode.ring_stages(128, 2) == 2
    assert mgpu_decode.ring_stages(64, 2) == 3 and mgpu_decode.ring_stages(128, 1, 2) == 2
    assert shared_bytes(128, 1, 3) <= 232448 < shared_bytes(128, 2, 3)
    with pytest.raises(ValueError, match=r"stages=3\) needs 233472 bytes of shared memory"):
        mgpu_decode.ring_stages(128, 2, 3)


def test_stages_is_the_gqa_kernels_own():
    from jaxattn.impl import mgpu_mla

    call = _call(q_heads=16, kv_heads=1, dim=576, v_head_dim=512, latent=True, config=MgpuDecodeConfig(stages=3))
    assert "ring depth" in mgpu_mla.declines_decode(call)
    with pytest.raises(ValueError, match="stages"):
        MgpuDecodeConfig(stages=1)
    call = _call(q_heads=16, kv_heads=1, dim=576, v_head_dim=512, latent=True, config=MgpuDecodeConfig(persistent=True))
    assert "one CTA per work item" in mgpu_mla.declines_decode(call)
    with pytest.raises(ValueError, match="persistent"):
        MgpuDecodeConfig(persistent=1)


def test_route_order():
    # 16-bit GQA pools before the Triton kernels (which take every call); the fp8 entry after them (by name only).
    from jaxattn.decode import IMPLEMENTATIONS

    names = [i.name for i in IMPLEMENTATIONS]
    assert names.index("mgpu-gqa") < names.index("triton") < names.index("mgpu-gqa-fp8")
    call = _call()  # on sm_90 only the device could decline it; the fp8 entry never takes a 16-bit pool
    assert mgpu_decode.declines(call) == hardware.mosaic_gpu_unavailable("gpu")
    assert "fp8 only" in mgpu_decode.declines_fp8(call)


def _decode_cta_programs(items, *, stages, form, persistent):
    """The barrier operations of one CTA's producer and two consumers over its work items, in the kernel's order
    (`gqa_decode_mgpu_kernel`): items are (steps, (consumer 0 active, consumer 1 active)); form "16-bit", "consumers"
    (fp8, each consumer converts its tiles). Tags: a consumer's tile number over all its items, a Q load's number."""
    producer, consumers = [], [[], []]
    filled, q_loads = [0, 0], [0, 0]

    def ring(kind, c, tile):
        return (kind, c, tile % stages)

    for steps, active in items:
        for c in (0, 1):
            if active[c]:
                if persistent and q_loads[c] > 0:
                    producer.append(("wait", ("q_free", c), (q_loads[c] - 1) % 2, q_loads[c] - 1))
                producer.append(("load", ("q_ready", c), q_loads[c]))

        for step in range(steps):
            for c in (0, 1):
                if active[c]:
                    tile = filled[c] + step
                    if tile >= stages:
                        producer.append(("wait", ring("free", c, tile), (tile // stages - 1) % 2, tile - stages))
                    producer.append(("load", ring("k_ready", c, tile), tile))
                    producer.append(("load", ring("v_ready", c, tile), tile))

        for c in (0, 1):
            if not active[c]:
                continue
            ops, done = consumers[c], filled[c]  # consumer c has consumed as many tiles as the producer filled
            ops.append(("wait", ("q_ready", c), q_loads[c] % 2, q_loads[c]))
            if persistent:
                ops.append(("arrive", ("q_free", c), q_loads[c]))
            if form == "consumers":
                ops.append(("wait", ring("k_ready", c, done), (done // stages) % 2, done))
            for step in range(steps):
                tile = done + step
                parity = (tile // stages) % 2
                if form == "16-bit":
                    ops.append(("wait", ring("k_ready", c, tile), parity, tile))
                if form == "consumers":  # V converted during S = Q K^T, then the slot released
                    ops += [("wait", ring("v_ready", c, tile), parity, tile), ("arrive", ring("free", c, tile), tile)]
                if form == "16-bit":
                    ops.append(("wait", ring("v_ready", c, tile), parity, tile))
                if form == "consumers" and step + 1 < steps:  # the next K converted during P V
                    ops.append(("wait", ring("k_ready", c, tile + 1), ((tile + 1) // stages) % 2, tile + 1))
                if form == "16-bit":
                    ops.append(("arrive", ring("free", c, tile), tile))
        for c in (0, 1):
            if active[c]:
                filled[c] += steps
                q_loads[c] += 1
    return {"producer": producer, "consumer0": consumers[0], "consumer1": consumers[1]}


@pytest.mark.parametrize("form", ["16-bit", "consumers"])
def test_barrier_protocol_never_hangs(form):
    # CPU: one CTA's producer and consumers (their barrier operations in the kernel's order) in random interleavings
    # with loads landing late: no deadlock, no wait passing early or on another tile's phase; one CTA per item (one
    # item) and persistent CTAs (items of 1, 2, many tiles, either consumer idle, ring phases and Q reloads carried
    # over items), at ring depths 2 and 3.
    import random

    from tests.barrier_model import Barrier, run_protocol

    rng = random.Random(3)
    runs = 0
    for stages in (2, 3):
        for items, persistent in (([(1, (True, True))], False), ([(5, (True, False))], False),
                                  ([(7, (True, True)), (1, (True, False)), (0, (False, False)), (2, (False, True)),
                                    (4, (True, True)), (3, (True, True))], True),
                                  ([(2, (True, True))] * 5 + [(6, (True, True))], True)):
            programs = _decode_cta_programs(items, stages=stages, form=form, persistent=persistent)
            for _ in range(20):
                barriers = {(kind, c, slot): Barrier(1) for kind in ("k_ready", "v_ready", "free")
                            for c in (0, 1) for slot in range(stages)}
                barriers |= {(kind, c): Barrier(1) for kind in ("q_ready", "q_free") for c in (0, 1)}
                run_protocol(programs, barriers, rng)
                runs += 1
    assert runs == 160
