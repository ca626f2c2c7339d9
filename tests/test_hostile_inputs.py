"""Hostile inputs (issue 21): every class of bad metadata, scalar and host value a careless caller can pass."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.backends import AttentionLayer
from jaxattn.checked import checked, validate_extend_inputs
from jaxattn.decode import decode_attention, decode_attention_reference
from jaxattn.metadata import decode_metadata_from_indptr
from jaxattn.serving import write_kv

# ---------------------------------------------------------------------------------------------
# Host-side classes of issue 21: narrowing, fp8 saturation, scalars, NaN through the reference, layer facts.


def test_write_kv_drops_host_slots_past_int32_instead_of_wrapping():
    # Narrowed to int32 on the way to the device, 2**32 + 3 would become slot 3; it is out of range: dropped.
    k_pool, v_pool = jnp.ones((8, 1, 4)), jnp.ones((8, 1, 4))
    new = jnp.full((3, 1, 4), 7.0)
    k2, v2 = write_kv(k_pool, v_pool, np.array([2**32 + 3, -1, 5], np.int64), new, new)
    np.testing.assert_array_equal(np.asarray(k2)[:, 0, 0], [1, 1, 1, 1, 1, 7, 1, 1])
    np.testing.assert_array_equal(np.asarray(v2)[:, 0, 0], [1, 1, 1, 1, 1, 7, 1, 1])


@pytest.mark.parametrize("fp8", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3fn", "e5m2"])
def test_fp8_writes_saturate_and_keep_nan(fp8):
    k_pool, v_pool = jnp.zeros((4, 1, 4), fp8), jnp.zeros((4, 1, 4), fp8)
    new = jnp.asarray([[[1e9, -1e9, jnp.inf, jnp.nan]]], jnp.float32)
    k2, _ = write_kv(k_pool, v_pool, jnp.asarray([2], jnp.int32), new, new, k_scale=0.5)
    stored = np.asarray(k2.astype(jnp.float32))[2, 0]
    largest = float(jnp.finfo(fp8).max)
    np.testing.assert_array_equal(stored[:3], [largest, -largest, largest])
    assert np.isnan(stored[3])


@pytest.mark.parametrize("sm_scale", [0.0, -0.125, float("nan"), float("inf")])
def test_sm_scale_is_validated_at_trace_time(sm_scale):
    q, k_pool, v_pool, meta = _tiny_decode()
    for op in (decode_attention, decode_attention_reference):
        with pytest.raises(ValueError, match="sm_scale must be None"):
            op(q, k_pool, v_pool, meta, sm_scale=sm_scale)


@pytest.mark.parametrize("bad", [dict(logit_cap=-1.0), dict(sliding_window=-3), dict(sm_scale=-1.0),
                                 dict(xai_temperature_len=1), dict(k_scale=0.0), dict(head_dim=8)],
                         ids=lambda d: next(iter(d)))
def test_attention_layer_rejects_what_any_backend_would(bad):
    # ReferenceBackend used to accept a negative cap or window that TritonBackend rejected: the layer checks once.
    fields = dict(layer_id=0, q_heads=4, kv_heads=2, head_dim=16) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        AttentionLayer(**fields)


def test_nan_sink_gives_nan_in_the_reference_not_an_unnormalised_row():
    q, k_pool, v_pool, meta = _tiny_decode()
    sinks = jnp.asarray([0.5, jnp.nan, 0.0, -1.0], jnp.float32)
    o = np.asarray(decode_attention_reference(q, k_pool, v_pool, meta, sinks=sinks))
    assert np.isnan(o[:, 1]).all() and np.isfinite(o[:, [0, 2, 3]]).all()


def _tiny_decode():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
    k_pool = jnp.asarray(rng.standard_normal((10, 2, 16)), jnp.float32)
    v_pool = jnp.asarray(rng.standard_normal((10, 2, 16)), jnp.float32)
    meta = decode_metadata_from_indptr(jnp.asarray([0, 3, 5], jnp.int32), jnp.asarray([1, 2, 3, 4, 5], jnp.int32),
                                       q_heads=4, kv_heads=2)
    return q, k_pool, v_pool, meta


def test_checked_mode_reports_custom_mask_offsets_past_int32():
    # 64 sequences x 256 drafts over 140k keys: 2.3e9 mask entries, past what int32 offsets can address.
    rows = jnp.arange(64, dtype=jnp.int32)
    req_to_token = jnp.zeros((64, 140_544), jnp.int32)
    prefix, extend = jnp.full(64, 140_288, jnp.int32), jnp.full(64, 256, jnp.int32)

    def step(prefix, extend):
        validate_extend_inputs(req_to_token, rows, prefix, extend, num_slots=1, max_extend_len=256, custom_mask=True)
        return jnp.int32(0)

    with pytest.raises(ValueError, match="past int32 offsets"):
        checked(step)(prefix, extend)
    checked(step)(prefix, jnp.full(64, 8, jnp.int32))  # 72M entries: fine
