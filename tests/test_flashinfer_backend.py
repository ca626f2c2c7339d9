"""FlashInfer backend: plan arguments on CPU (against the reference metadata); the backend itself on the GPU."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.backends import AttentionLayer, ReferenceBackend
from jaxattn.batch import ForwardBatch, ForwardMode
from jaxattn.flashinfer_backend import plan_arguments, should_use_tensor_cores
from tests.helpers import HAS_GPU


def make_batch(rng, mode, seq_lens, extend_lens, tokens, max_ctx=64, custom_mask=None, encoder_lens=None):
    b = len(seq_lens)
    req_to_token = rng.permutation(8 * max_ctx).reshape(8, max_ctx).astype(np.int32) + 1
    rows = rng.choice(8, b, replace=False).astype(np.int32)
    batch = ForwardBatch(
        req_pool_indices=jnp.asarray(rows), seq_lens=jnp.asarray(seq_lens, jnp.int32), extend_lens=jnp.asarray(extend_lens, jnp.int32),
        out_cache_loc=jnp.zeros(tokens, jnp.int32), positions=jnp.zeros(tokens, jnp.int32), mode=mode, max_extend_len=16,
        kv_capacity=256, max_seq_len=max_ctx, custom_mask=custom_mask,
        encoder_lens=None if encoder_lens is None else jnp.asarray(encoder_lens, jnp.int32),
    )
    return batch, req_to_token


def test_decode_plan_lists_the_same_keys_as_the_reference_metadata(rng):
    batch, r2t = make_batch(rng, ForwardMode.DECODE, [5, 0, 17], [1, 0, 1], 3)
    args = plan_arguments(batch, r2t)
    meta = ReferenceBackend().init_forward_metadata(batch, jnp.asarray(r2t))
    ref_indptr = np.asarray(meta.kv_indptr)
    rows = np.asarray(batch.req_pool_indices)
    # Real rows list exactly the reference's keys; the padding row lists the padding slot 0 once.
    np.testing.assert_array_equal(args["kv_indptr"], [0, 5, 6, 23])
    np.testing.assert_array_equal(args["kv_indices"][:5], np.asarray(meta.kv_indices)[ref_indptr[0] : ref_indptr[1]])
    assert args["kv_indices"][5] == 0
    np.testing.assert_array_equal(args["kv_indices"][6:], r2t[rows[2], :17])
    np.testing.assert_array_equal(args["kv_last_page_len"], [1, 1, 1])
    assert "qo_indptr" not in args


def test_window_and_cross_attention_plans(rng):
    batch, r2t = make_batch(rng, ForwardMode.EXTEND, [10, 3], [4, 3], 8, encoder_lens=[6, 2])
    rows = np.asarray(batch.req_pool_indices)
    window = plan_arguments(batch, r2t, sliding_window=2)
    # Sequence 0: 10 decoder tokens after 6 encoder tokens; keep min(10, W + q_len) = 6 keys, the last ones.
    np.testing.assert_array_equal(window["kv_indices"][:6], r2t[rows[0], 6 + 4 : 6 + 10])
    np.testing.assert_array_equal(window["kv_indices"][6:], r2t[rows[1], 2 : 2 + 3])
    np.testing.assert_array_equal(window["qo_indptr"], [0, 4, 7])
    cross = plan_arguments(batch, r2t, cross_attention=True)
    np.testing.assert_array_equal(cross["kv_indptr"], [0, 6, 8])
    np.testing.assert_array_equal(cross["kv_indices"], np.concatenate([r2t[rows[0], :6], r2t[rows[1], :2]]))


def test_verify_plan_carries_each_requests_mask_rows(rng):
    seq_lens, draft = [6, 4], [3, 2]
    sizes = [s * d for s, d in zip(seq_lens, draft)]
    mask = rng.random(sum(sizes) + 5) < 0.5  # 5 entries of bucket padding
    batch, r2t = make_batch(rng, ForwardMode.TARGET_VERIFY, seq_lens, draft, 6, custom_mask=jnp.asarray(mask))
    args = plan_arguments(batch, r2t)
    np.testing.assert_array_equal(args["mask_indptr"], [0, 18, 26])
    np.testing.assert_array_equal(args["custom_mask"], mask[:26])


def test_tensor_core_rule_follows_sglang():
    assert should_use_tensor_cores(jnp.bfloat16, 32, 8)
    assert not should_use_tensor_cores(jnp.bfloat16, 16, 8)
    assert not should_use_tensor_cores(jnp.float8_e4m3fn, 32, 8)  # its tensor-core fp8 module does not build (0.6.0)
    assert not should_use_tensor_cores(jnp.float32, 32, 8)


def test_asking_without_flashinfer_says_what_to_install():
    try:
        import flashinfer  # noqa: F401
        pytest.skip("flashinfer is installed here")
    except ImportError:
        pass
    from jaxattn.flashinfer_backend import FlashInferBackend

    with pytest.raises(ImportError, match=r"pip install 'jaxattn\[flashinfer\]'"):
        FlashInferBackend()


def _scheduled_batch(rng, mode, seq_lens, extend_lens, tokens, num_slots, max_ctx=64, **kw):
    """A batch whose new tokens' slots are the req_to_token entries they will be written to."""
    batch, r2t = make_batch(rng, mode, seq_lens, extend_lens, tokens, max_ctx=max_ctx, **kw)
    r2t = (rng.permutation(num_slots - 1)[: r2t.size].reshape(r2t.shape) + 1).astype(np.int32)
    rows = np.asarray(batch.req_pool_indices)
    out_cache_loc = np.zeros(tokens, np.int32)
    cursor = 0
    for b, (s, n) in enumerate(zip(seq_lens, extend_lens)):
        at = b if mode == ForwardMode.DECODE else cursor
        out_cache_loc[at : at + n] = r2t[rows[b], s - n : s]
        cursor += n
    return dataclasses.replace(batch, out_cache_loc=jnp.asarray(out_cache_loc)), r2t


GPU_CASES = {
    "decode": dict(mode=ForwardMode.DECODE, seq_lens=[33, 0, 64, 7], extend_lens=[1, 0, 1, 1], tokens=4),
    "extend": dict(mode=ForwardMode.EXTEND, seq_lens=[40, 9, 1], extend_lens=[11, 9, 1], tokens=24),
    "window": dict(mode=ForwardMode.EXTEND, seq_lens=[40, 9, 30], extend_lens=[11, 9, 5], tokens=28, window=6),
    "window-decode": dict(mode=ForwardMode.DECODE, seq_lens=[40, 9, 30], extend_lens=[1, 1, 1], tokens=3, window=6),
    "verify": dict(mode=ForwardMode.TARGET_VERIFY, seq_lens=[20, 12], extend_lens=[4, 4], tokens=8),
    "softcap": dict(mode=ForwardMode.EXTEND, seq_lens=[40, 9], extend_lens=[11, 9], tokens=20, cap=10.0),
}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and flashinfer")
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_flashinfer_backend_agrees_with_reference_backend(rng, name):
    from jaxattn.flashinfer_backend import FlashInferBackend

    case = dict(GPU_CASES[name])
    window, cap = case.pop("window", -1), case.pop("cap", 0.0)
    num_slots, hq, hkv, d = 4096, 8, 2, 128
    mask = None
    if case["mode"] == ForwardMode.TARGET_VERIFY:
        sizes = [s * n for s, n in zip(case["seq_lens"], case["extend_lens"])]
        mask = jnp.asarray(rng.random(sum(sizes)) < 0.5)
    batch, r2t = _scheduled_batch(rng, num_slots=num_slots, custom_mask=mask, **case)
    if mask is not None:
        # every query must see at least its own key: set the diagonal of each request's block
        m = np.array(mask)
        start = 0
        for s, n in zip(case["seq_lens"], case["extend_lens"]):
            for i in range(n):
                m[start + i * s + (s - n + i)] = True
            start += s * n
        batch = dataclasses.replace(batch, custom_mask=jnp.asarray(m))
    layer = AttentionLayer(0, hq, hkv, d, sliding_window=window, logit_cap=cap)
    k_buffer = jnp.asarray(rng.standard_normal((num_slots, hkv, d)), jnp.bfloat16)
    v_buffer = jnp.asarray(rng.standard_normal((num_slots, hkv, d)), jnp.bfloat16)
    t = case["tokens"]
    q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((t, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((t, hkv, d)), jnp.bfloat16)

    ref = ReferenceBackend()
    want, _, _ = jax.jit(lambda *a: ref.forward(*a[:5], layer, ref.init_forward_metadata(batch, jnp.asarray(r2t))))(q, k, v, k_buffer, v_buffer)
    fib = FlashInferBackend()
    meta = fib.plan(batch, r2t, [layer])
    got, _, _ = jax.jit(lambda q, k, v, kb, vb, m: fib.forward(q, k, v, kb, vb, layer, m))(q, k, v, k_buffer, v_buffer, meta)
    np.testing.assert_allclose(np.float32(got), np.float32(want), atol=2e-2, rtol=2e-2)


def test_plan_dtypes_name_what_flashinfer_takes_and_refuse_float32():
    from jaxattn.backends.flashinfer import plan_dtype_names

    assert plan_dtype_names(jnp.bfloat16, jnp.bfloat16) == ("bfloat16", "bfloat16")
    assert plan_dtype_names(jnp.float16, jnp.float8_e4m3fn) == ("float16", "float8_e4m3fn")
    assert plan_dtype_names(jnp.bfloat16, jnp.float8_e5m2) == ("bfloat16", "float8_e5m2")  # once declared as e4m3
    with pytest.raises(ValueError, match="q dtype float32 is not supported"):
        plan_dtype_names(jnp.float32, jnp.bfloat16)
    with pytest.raises(ValueError, match="KV pool dtype float32 is not supported"):
        plan_dtype_names(jnp.bfloat16, jnp.float32)  # once read as fp8


def test_a_page_table_plans_as_its_page_one_table():
    from jaxattn.paging import PageTable

    page_size, num_slots = 8, 8 * 12
    req_to_page = jnp.asarray([[3, 5, 0], [0, 0, 0], [7, 2, 9]], jnp.int32)
    table = PageTable(req_to_page, page_size=page_size, num_slots=num_slots)
    batch = ForwardBatch(
        req_pool_indices=jnp.asarray([2, 0], jnp.int32), seq_lens=jnp.asarray([19, 11], jnp.int32),
        extend_lens=jnp.asarray([1, 1], jnp.int32), out_cache_loc=jnp.zeros(2, jnp.int32), positions=jnp.zeros(2, jnp.int32),
        mode=ForwardMode.DECODE, max_extend_len=1, kv_capacity=64, max_seq_len=24,
    )
    paged = plan_arguments(batch, table)
    flat = plan_arguments(batch, table.req_to_token())
    assert paged.keys() == flat.keys()
    for key in paged:
        np.testing.assert_array_equal(paged[key], flat[key])
    # Row 2's first 19 keys: page 7's 8 slots, page 2's 8, then 3 of page 9's.
    want = np.concatenate([np.arange(56, 64), np.arange(16, 24), np.arange(72, 75)])
    np.testing.assert_array_equal(paged["kv_indices"][:19], want)
