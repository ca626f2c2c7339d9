"""FlashInfer backend: plan arguments on CPU (against the reference metadata); the backend itself on the GPU."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.backends import AttentionLayer, ReferenceBackend
from jaxattn.batch import ForwardBatch, ForwardMode
from jaxattn.flashinfer_backend import plan_arguments, should_use_tensor_cores, token_valid
from tests.helpers import HAS_GPU


def make_batch(rng, mode, seq_lens, extend_lens, tokens, max_ctx=64, custom_mask=None, encoder_lens=None, max_extend_len=None):
    b = len(seq_lens)
    req_to_token = rng.permutation(8 * max_ctx).reshape(8, max_ctx).astype(np.int32) + 1
    rows = rng.choice(8, b, replace=False).astype(np.int32)
    batch = ForwardBatch(
        req_pool_indices=jnp.asarray(rows), seq_lens=jnp.asarray(seq_lens, jnp.int32), extend_lens=jnp.asarray(extend_lens, jnp.int32),
        out_cache_loc=jnp.zeros(tokens, jnp.int32), positions=jnp.zeros(tokens, jnp.int32), mode=mode,
        # The bucket holds every sequence's new tokens (checked mode's rule: longer rows are not computed).
        max_extend_len=max([16, *extend_lens]) if max_extend_len is None else max_extend_len,
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
    "verify-window": dict(mode=ForwardMode.TARGET_VERIFY, seq_lens=[20, 12], extend_lens=[4, 4], tokens=8, window=6),
    "softcap": dict(mode=ForwardMode.EXTEND, seq_lens=[40, 9], extend_lens=[11, 9], tokens=20, cap=10.0),
    # FlashInfer's sink-aware wrapper (GPT-OSS layers: sinks, with and without a window), decode and extend.
    "sinks": dict(mode=ForwardMode.EXTEND, seq_lens=[40, 9, 1], extend_lens=[11, 9, 1], tokens=24, sinks=True),
    "sinks-window": dict(mode=ForwardMode.EXTEND, seq_lens=[40, 9, 30], extend_lens=[11, 9, 5], tokens=28, window=6,
                         sinks=True),
    "sinks-decode": dict(mode=ForwardMode.DECODE, seq_lens=[33, 0, 64, 7], extend_lens=[1, 0, 1, 1], tokens=4, sinks=True),
    "sinks-window-decode": dict(mode=ForwardMode.DECODE, seq_lens=[40, 9, 30], extend_lens=[1, 1, 1], tokens=3, window=6,
                                sinks=True),
    # fp8 scales on a layer whose pool is bf16: the pool holds the values, no scale applies.
    "scales-on-bf16": dict(mode=ForwardMode.EXTEND, seq_lens=[40, 9], extend_lens=[11, 9], tokens=20, scales=(0.5, 4.0)),
}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and flashinfer")
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_flashinfer_backend_agrees_with_reference_backend(rng, name):
    from jaxattn.flashinfer_backend import FlashInferBackend

    case = dict(GPU_CASES[name])
    window, cap, has_sinks = case.pop("window", -1), case.pop("cap", 0.0), case.pop("sinks", False)
    k_scale, v_scale = case.pop("scales", (None, None))
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
    layer = AttentionLayer(0, hq, hkv, d, sliding_window=window, logit_cap=cap, has_sinks=has_sinks, k_scale=k_scale,
                           v_scale=v_scale)
    # Sinks near the rows' log-denominators (scores ~ N(0, 1) over tens of keys), so they change the output.
    sinks = jnp.asarray(rng.normal(3.0, 1.0, hq), jnp.float32) if has_sinks else None
    k_buffer = jnp.asarray(rng.standard_normal((num_slots, hkv, d)), jnp.bfloat16)
    v_buffer = jnp.asarray(rng.standard_normal((num_slots, hkv, d)), jnp.bfloat16)
    t = case["tokens"]
    q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((t, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((t, hkv, d)), jnp.bfloat16)

    ref = ReferenceBackend()
    want, _, _ = jax.jit(lambda *a: ref.forward(*a[:5], layer, ref.init_forward_metadata(batch, jnp.asarray(r2t)),
                                                sinks=a[5]))(q, k, v, k_buffer, v_buffer, sinks)
    fib = FlashInferBackend()
    meta = fib.plan(batch, r2t, [layer])
    got, _, _ = jax.jit(lambda q, k, v, kb, vb, m, s: fib.forward(q, k, v, kb, vb, layer, m, sinks=s))(
        q, k, v, k_buffer, v_buffer, meta, sinks)
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


# ---------------------------------------------------------------------------------------------
# Pages: a PageTable is planned with FlashInfer's own page_size (page ids, last-page lengths).

PAGED_CASES = {  # lengths end mid-page, on a page boundary (16, 64), at 1, and a padding row (0)
    "decode": dict(mode=ForwardMode.DECODE, seq_lens=[70, 0, 64, 7, 16], extend_lens=[1, 0, 1, 1, 1]),
    "extend": dict(mode=ForwardMode.EXTEND, seq_lens=[70, 9, 1, 32], extend_lens=[11, 9, 1, 16]),
    "window": dict(mode=ForwardMode.EXTEND, seq_lens=[70, 9, 30, 64], extend_lens=[11, 9, 5, 3], window=6),
    "window-decode": dict(mode=ForwardMode.DECODE, seq_lens=[70, 9, 30, 0, 17], extend_lens=[1, 1, 1, 0, 1], window=6),
}
PAGED_CONTEXT = 128  # every page size's rows hold 128 positions


def paged_batch(rng, mode, seq_lens, extend_lens, page_size, encoder_lens=None, custom_mask=None):
    """A batch over a page table whose rows take pages of the pool at random (page 0 never), with the new tokens' slots
    in out_cache_loc. Returns (batch, PageTable)."""
    from jaxattn.paging import PageTable, out_cache_loc_from_pages, token_slots

    max_reqs, max_pages = 6, PAGED_CONTEXT // page_size
    num_slots = (max_reqs * max_pages + 1) * page_size
    req_to_page = jnp.asarray((rng.permutation(max_reqs * max_pages) + 1).reshape(max_reqs, max_pages), jnp.int32)
    table = PageTable(req_to_page, page_size=page_size, num_slots=num_slots)
    rows = jnp.asarray(rng.choice(max_reqs, len(seq_lens), replace=False), jnp.int32)
    seq_lens, extend_lens = jnp.asarray(seq_lens, jnp.int32), jnp.asarray(extend_lens, jnp.int32)
    if mode == ForwardMode.DECODE:  # token b is sequence b; padding rows (seq_len 0) get slot 0
        out_cache_loc = token_slots(req_to_page, rows, seq_lens - 1, page_size, num_slots=num_slots)
    else:
        out_cache_loc = out_cache_loc_from_pages(req_to_page, rows, seq_lens - extend_lens, extend_lens, page_size=page_size,
                                                 num_slots=num_slots, num_tokens=int(extend_lens.sum()))
    batch = ForwardBatch(
        req_pool_indices=rows, seq_lens=seq_lens, extend_lens=extend_lens, out_cache_loc=out_cache_loc,
        positions=jnp.zeros(out_cache_loc.shape, jnp.int32), mode=mode, max_extend_len=16, kv_capacity=512,
        max_seq_len=PAGED_CONTEXT, custom_mask=custom_mask,
        encoder_lens=None if encoder_lens is None else jnp.asarray(encoder_lens, jnp.int32),
    )
    return batch, table


def listed_slots(args, page_size, b):
    """Sequence b's keys as pool slots: its pages expanded (page p is slots p * P .. p * P + P - 1), the last page cut
    at kv_last_page_len."""
    pages = args["kv_indices"][args["kv_indptr"][b] : args["kv_indptr"][b + 1]]
    slots = (pages[:, None] * page_size + np.arange(page_size)).reshape(-1)
    return slots[: len(slots) - page_size + args["kv_last_page_len"][b]]


@pytest.mark.parametrize("page_size", [1, 8, 16, 64])
@pytest.mark.parametrize("name", list(PAGED_CASES))
def test_a_page_table_plans_pages_that_expand_to_its_page_one_lists(rng, name, page_size):
    case = dict(PAGED_CASES[name])
    window = case.pop("window", -1)
    batch, table = paged_batch(rng, page_size=page_size, **case)
    paged = plan_arguments(batch, table, sliding_window=window)
    flat = plan_arguments(batch, table.req_to_token(), sliding_window=window)  # page size 1 over the same slots
    assert paged.keys() == flat.keys()
    if "qo_indptr" in flat:
        np.testing.assert_array_equal(paged["qo_indptr"], flat["qo_indptr"])
    assert np.all((paged["kv_last_page_len"] >= 1) & (paged["kv_last_page_len"] <= page_size))
    for b, seq_len in enumerate(case["seq_lens"]):
        keys, want = listed_slots(paged, page_size, b), listed_slots(flat, 1, b)
        if seq_len == 0:  # a padding row lists the padding page once, one key
            np.testing.assert_array_equal(paged["kv_indices"][paged["kv_indptr"][b] : paged["kv_indptr"][b + 1]], [0])
            np.testing.assert_array_equal(keys, [0])
            continue
        # The same keys, but a list starts on a page's first slot: under a window up to P - 1 keys before the
        # window's first key come too (window_left masks them); without one, none.
        extra = len(keys) - len(want)
        assert 0 <= extra < page_size and (window >= 0 or extra == 0)
        np.testing.assert_array_equal(keys[extra:], want)
        assert paged["kv_indptr"][b + 1] - paged["kv_indptr"][b] == -(-len(keys) // page_size)
    if page_size == 1:  # page size 1 is exactly the req_to_token plan
        for key in flat:
            np.testing.assert_array_equal(paged[key], flat[key])


def test_paged_plans_of_ends_on_and_off_a_page_boundary(rng):
    batch, table = paged_batch(rng, ForwardMode.DECODE, [16, 17, 15, 0], [1, 1, 1, 0], page_size=16)
    args = plan_arguments(batch, table)
    np.testing.assert_array_equal(args["kv_indptr"], [0, 1, 3, 4, 5])
    np.testing.assert_array_equal(args["kv_last_page_len"], [16, 1, 15, 1])
    pages = np.asarray(table.req_to_page)[np.asarray(batch.req_pool_indices)]
    np.testing.assert_array_equal(args["kv_indices"], [pages[0, 0], pages[1, 0], pages[1, 1], pages[2, 0], 0])
    # A window of 20 over 40 keys in decode: keys 19..39 are seen, so page 0 (keys 0..15) is dropped and page 1
    # (16..31) listed from its start: 3 keys before the window, masked by window_left.
    batch, table = paged_batch(rng, ForwardMode.DECODE, [40], [1], page_size=16)
    args = plan_arguments(batch, table, sliding_window=20)
    pages = np.asarray(table.req_to_page)[np.asarray(batch.req_pool_indices)[0]]
    np.testing.assert_array_equal(args["kv_indices"], pages[1:3])
    np.testing.assert_array_equal(args["kv_last_page_len"], [8])


def test_paged_plans_cross_attention_and_refuse_a_decoder_starting_mid_page(rng):
    batch, table = paged_batch(rng, ForwardMode.EXTEND, [20, 9], [4, 3], page_size=16, encoder_lens=[16, 32])
    rows = np.asarray(batch.req_pool_indices)
    pages = np.asarray(table.req_to_page)[rows]
    cross = plan_arguments(batch, table, cross_attention=True)  # the encoder's tokens: 1 and 2 whole pages
    np.testing.assert_array_equal(cross["kv_indptr"], [0, 1, 3])
    np.testing.assert_array_equal(cross["kv_indices"], [pages[0, 0], pages[1, 0], pages[1, 1]])
    np.testing.assert_array_equal(cross["kv_last_page_len"], [16, 16])
    own = plan_arguments(batch, table)  # the decoder's tokens start on a page boundary after the encoder's
    np.testing.assert_array_equal(own["kv_indices"], [pages[0, 1], pages[0, 2], pages[1, 2]])
    np.testing.assert_array_equal(own["kv_last_page_len"], [4, 9])
    batch, table = paged_batch(rng, ForwardMode.EXTEND, [20, 9], [4, 3], page_size=16, encoder_lens=[16, 5])
    with pytest.raises(NotImplementedError, match=r"encoder_lens \[5\] are not multiples of page_size"):
        plan_arguments(batch, table)
    plan_arguments(batch, table, sliding_window=2)  # the window hides the encoder keys on row 1's first page


def test_paged_plans_read_page_ids_outside_the_pool_as_the_padding_page():
    from jaxattn.paging import PageTable

    table = PageTable(jnp.asarray([[3, 99, -4, 5]], jnp.int32), page_size=8, num_slots=8 * 12)
    batch = ForwardBatch(
        req_pool_indices=jnp.asarray([0], jnp.int32), seq_lens=jnp.asarray([30], jnp.int32),
        extend_lens=jnp.asarray([1], jnp.int32), out_cache_loc=jnp.zeros(1, jnp.int32), positions=jnp.zeros(1, jnp.int32),
        mode=ForwardMode.DECODE, max_extend_len=1, kv_capacity=64, max_seq_len=32,
    )
    args = plan_arguments(batch, table)
    np.testing.assert_array_equal(args["kv_indices"], [3, 0, 0, 5])
    np.testing.assert_array_equal(args["kv_last_page_len"], [6])


def flashinfer_semantics(q, k_pool, v_pool, args, page_size, *, window, causal, scale):
    """FlashInfer's paged attention as documented, in numpy float64: sequence b's keys are its listed slots
    (`listed_slots`); query i of its qo_len sits at position kv_len - qo_len + i and sees the keys at positions <= its
    own (causal; with a custom mask, args["custom_mask"], instead the mask's bit [i, j] at mask_indptr[b]) with
    position distance <= window_left (when >= 0): fa2's DefaultAttention applies mask and window both. A row that
    sees no key gets 0. Returns f64[T, q_heads, Dv]."""
    q, k_pool, v_pool = (np.asarray(x, np.float64) for x in (q, k_pool, v_pool))
    batch = len(args["kv_last_page_len"])
    qo_indptr = args.get("qo_indptr", np.arange(batch + 1))
    group = q.shape[1] // k_pool.shape[1]
    out = np.zeros(q.shape[:2] + v_pool.shape[2:])
    for b in range(batch):
        slots = listed_slots(args, page_size, b)
        k, v = np.repeat(k_pool[slots], group, axis=1), np.repeat(v_pool[slots], group, axis=1)  # [kv_len, Hq, D]
        qo_len, kv_len = qo_indptr[b + 1] - qo_indptr[b], len(slots)
        for i in range(qo_len):
            q_pos, k_pos = kv_len - qo_len + i, np.arange(kv_len)
            seen = (k_pos <= q_pos) if causal else np.ones(kv_len, bool)
            if "custom_mask" in args:
                row = args["mask_indptr"][b] + i * kv_len
                seen = args["custom_mask"][row : row + kv_len].copy()
            if window >= 0:
                seen &= q_pos - k_pos <= window
            if not seen.any():
                continue
            scores = np.einsum("hd,khd->hk", q[qo_indptr[b] + i], k[seen]) * scale
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[qo_indptr[b] + i] = np.einsum("hk,khd->hd", weights / weights.sum(axis=1, keepdims=True), v[seen])
    return out


def paged_layer_case(rng, name, page_size, hq, hkv, d):
    """(the PAGED_CASES entry without its window, its batch, its PageTable, a layer of these heads and its window)."""
    case = dict(PAGED_CASES[name])
    window = case.pop("window", -1)
    batch, table = paged_batch(rng, page_size=page_size, **case)
    return case, batch, table, AttentionLayer(0, hq, hkv, d, sliding_window=window)


@pytest.mark.parametrize("page_size", [1, 8, 16])
@pytest.mark.parametrize("name", list(PAGED_CASES))
def test_paged_plans_give_the_reference_attention_under_flashinfers_semantics(rng, name, page_size):
    # The plan, read the way FlashInfer reads it (pages, last-page lengths, window_left by position), attends like
    # ReferenceBackend on the same page table. Pool rows that no real token owns are NaN, so a key listed past a
    # sequence's end shows.
    from jaxattn.paging import token_slots

    hq, hkv, d = 4, 2, 16
    case, batch, table, layer = paged_layer_case(rng, name, page_size, hq, hkv, d)
    window = layer.sliding_window
    owned = np.zeros(table.num_slots, bool)
    for row, seq_len in zip(np.asarray(batch.req_pool_indices), case["seq_lens"]):
        positions = jnp.arange(seq_len, dtype=jnp.int32)
        owned[np.asarray(token_slots(table.req_to_page, jnp.full_like(positions, row), positions, page_size,
                                     num_slots=table.num_slots))] = True
    pools = [np.where(owned[:, None, None], rng.standard_normal((table.num_slots, hkv, d)), np.nan) for _ in range(2)]
    k_pool, v_pool = (jnp.asarray(x, jnp.float32) for x in pools)
    q = jnp.asarray(rng.standard_normal((batch.num_tokens, hq, d)), jnp.float32)
    ref = ReferenceBackend()
    want, _, _ = ref.forward(q, None, None, k_pool, v_pool, layer, ref.init_forward_metadata(batch, table))
    args = plan_arguments(batch, table, sliding_window=window)
    got = flashinfer_semantics(q, k_pool, v_pool, args, page_size, window=window, causal=True, scale=layer.scale)
    valid = token_valid(batch)
    np.testing.assert_allclose(got[valid], np.asarray(want, np.float64)[valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("draft_form", [False, True], ids=["custom-mask", "draft-bits"])
@pytest.mark.parametrize("window", [-1, 5])
@pytest.mark.parametrize("page_size", [1, 16])
def test_verify_plans_give_the_reference_attention_under_flashinfers_semantics(rng, page_size, window, draft_form):
    # TARGET_VERIFY: the tree mask's columns cut to the keys FlashInfer lists (under a window its lists start at the
    # window's first page), read with FlashInfer's semantics, attends like ReferenceBackend; a draft-bits batch's
    # padding sequences plan D rows each, whose mask rows are there and empty.
    from jaxattn.metadata import draft_mask_bits
    from jaxattn.serving.batch import tree_mask_for_verify

    hq, hkv, d, drafts = 4, 2, 16, 4
    seq_lens, extend_lens = [37, 9, 20, 0], [drafts, drafts, drafts, 0]
    parents = [[-1, 0, 0, 1], [-1, -1, 1, 2], [-1, 0, 1, 2]]
    trees = [tree_mask_for_verify(p, s - drafts) for p, s in zip(parents, seq_lens)]
    mask = jnp.asarray(np.concatenate([t.reshape(-1) for t in trees] + [np.zeros(9, bool)]))
    batch, table = paged_batch(rng, ForwardMode.TARGET_VERIFY, seq_lens, extend_lens, page_size, custom_mask=mask)
    if draft_form:  # the same trees as bits; D token rows per sequence, padding included
        bits = np.zeros((4, drafts), np.int32)
        bits[:3] = np.asarray(draft_mask_bits(np.stack([tree_mask_for_verify(p, 0) for p in parents])))
        batch = dataclasses.replace(batch, custom_mask=None, draft_mask=jnp.asarray(bits),
                                    out_cache_loc=jnp.pad(batch.out_cache_loc, (0, 4 * drafts - batch.num_tokens)),
                                    positions=jnp.zeros(4 * drafts, jnp.int32))
    layer = AttentionLayer(0, hq, hkv, d, sliding_window=window)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal((table.num_slots, hkv, d)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((batch.num_tokens, hq, d)), jnp.float32)
    ref = ReferenceBackend()
    want, _, _ = ref.forward(q, None, None, k_pool, v_pool, layer, ref.init_forward_metadata(batch, table))
    args = plan_arguments(batch, table, sliding_window=window)
    assert args["mask_indptr"][-1] == args["custom_mask"].size  # every planned row's bits, none past the end
    got = flashinfer_semantics(q, k_pool, v_pool, args, page_size, window=window, causal=False, scale=layer.scale)
    valid = token_valid(batch)
    np.testing.assert_allclose(got[valid], np.asarray(want, np.float64)[valid], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and flashinfer")
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("name", list(PAGED_CASES))
def test_flashinfer_backend_with_pages_agrees_with_reference_backend(rng, name, page_size):
    from jaxattn.flashinfer_backend import FlashInferBackend

    hq, hkv, d = 8, 2, 128
    _, batch, table, layer = paged_layer_case(rng, name, page_size, hq, hkv, d)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal((table.num_slots, hkv, d)), jnp.bfloat16) for _ in range(2))
    t = batch.num_tokens
    q, k, v = (jnp.asarray(rng.standard_normal((t, h, d)), jnp.bfloat16) for h in (hq, hkv, hkv))
    ref = ReferenceBackend()
    want, _, _ = jax.jit(lambda *a: ref.forward(*a, layer, ref.init_forward_metadata(batch, table)))(q, k, v, k_pool, v_pool)
    fib = FlashInferBackend()
    meta = fib.plan(batch, table, [layer])
    assert meta.page_size == page_size
    got, _, _ = jax.jit(lambda q, k, v, kb, vb, m: fib.forward(q, k, v, kb, vb, layer, m))(q, k, v, k_pool, v_pool, meta)
    np.testing.assert_allclose(np.float32(got), np.float32(want), atol=2e-2, rtol=2e-2)


MLA_LAYER = AttentionLayer(0, 16, 1, 576, v_head_dim=512, sm_scale=0.1)  # DeepSeek's absorbed shape


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and flashinfer")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", ["decode", "extend"])
def test_flashinfer_mla_wrapper_agrees_with_reference_backend(rng, name, page_size):
    """An MLA layer (one 576/512 latent head, v_pool None) through FlashInfer's MLA wrapper against ReferenceBackend,
    the new tokens' latent rows written first; pages end mid-page, padding rows are zero."""
    from jaxattn.flashinfer_backend import FlashInferBackend

    case = dict(PAGED_CASES[name])
    batch, table = paged_batch(rng, page_size=page_size, **case)
    layer = dataclasses.replace(MLA_LAYER, sm_scale=1 / np.sqrt(192.0))  # DeepSeek's: the pre-absorption head dim
    pool = jnp.asarray(rng.standard_normal((table.num_slots, 1, 576)), jnp.bfloat16)
    t = batch.num_tokens
    q = jnp.asarray(rng.standard_normal((t, layer.q_heads, 576)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((t, 1, 576)), jnp.bfloat16)
    ref = ReferenceBackend()
    want, want_pool, _ = jax.jit(lambda q, k, kb: ref.forward(q, k, None, kb, None, layer,
                                                              ref.init_forward_metadata(batch, table)))(q, k, pool)
    fib = FlashInferBackend()
    meta = fib.plan(batch, table, [layer])
    got, got_pool, v_pool = jax.jit(lambda q, k, kb, m: fib.forward(q, k, None, kb, None, layer, m))(q, k, pool, meta)
    assert v_pool is None and got.shape == (t, layer.q_heads, 512)
    np.testing.assert_array_equal(np.float32(got_pool), np.float32(want_pool))
    np.testing.assert_allclose(np.float32(got), np.float32(want), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and flashinfer")
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_deterministic_flashinfer_is_batch_invariant(rng, mode):
    """deterministic=True: one sequence long enough to be split (several fixed splits) gives the same bits whatever
    it is batched with (other sequences, its place in the batch, the batch size)."""
    from jaxattn.flashinfer_backend import FlashInferBackend

    hq, hkv, d, context, new = 8, 2, 128, 10240, 48
    rows_total = 4
    num_slots = rows_total * context + 1
    req_to_token = (np.arange(rows_total * context).reshape(rows_total, context) + 1).astype(np.int32)
    req_to_token = req_to_token[:, rng.permutation(context)]  # scattered slots within each row
    layer = AttentionLayer(0, hq, hkv, d)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal((num_slots, hkv, d)), jnp.bfloat16) for _ in range(2))
    length = 9000  # row 0's sequence: 5 decode splits of 2048 keys, 3 prefill splits of 4096
    q_rows = 1 if mode == ForwardMode.DECODE else new
    q_seq = jnp.asarray(rng.standard_normal((q_rows, hq, d)), jnp.bfloat16)
    backend = FlashInferBackend(deterministic=True)
    step = jax.jit(lambda q, kb, vb, m: backend.forward(q, None, None, kb, vb, layer, m, save_kv=False))

    def run(rows, seq_lens, place):
        """Row 0's sequence at index `place` among sequences of request rows `rows` and lengths `seq_lens`."""
        extend_lens = [1 if mode == ForwardMode.DECODE else min(new, s) for s in seq_lens]
        tokens = sum(extend_lens)
        q = jnp.asarray(rng.standard_normal((tokens, hq, d)), jnp.bfloat16)
        first = sum(extend_lens[:place])
        q = q.at[first : first + q_rows].set(q_seq)
        batch = ForwardBatch(
            req_pool_indices=jnp.asarray(rows, jnp.int32), seq_lens=jnp.asarray(seq_lens, jnp.int32),
            extend_lens=jnp.asarray(extend_lens, jnp.int32), out_cache_loc=jnp.zeros(tokens, jnp.int32),
            positions=jnp.zeros(tokens, jnp.int32), mode=mode, max_extend_len=new, kv_capacity=sum(seq_lens),
            max_seq_len=context)
        meta = backend.plan(batch, req_to_token, [layer])
        return np.float32(step(q, k_pool, v_pool, meta)[0][first : first + q_rows])

    alone = run([0], [length], 0)
    batched = run([2, 0, 1], [3000, length, 9999], 1)
    bigger = run([3, 1, 2, 0], [100, 7000, 5000, length], 3)
    np.testing.assert_array_equal(batched, alone)
    np.testing.assert_array_equal(bigger, alone)
    assert np.all(np.isfinite(alone)) and np.any(alone != 0)


# ---------------------------------------------------------------------------------------------
# FlashInferBackend's planning and argument handling on CPU, with stand-ins for torch and flashinfer.


class _HostTensor:
    """torch.from_numpy(x).cuda() of the stand-in torch: the numpy array, kept for the assertions."""

    def __init__(self, array):
        self.array = array

    def cuda(self):
        return self


class _TorchDtype:
    """A stand-in torch dtype: equal to its name, but not a dtype JAX reads (jnp.dtype raises on it, as on torch's)."""

    def __init__(self, name):
        self.name = name

    def __eq__(self, other):
        return other == self.name if isinstance(other, str) else other is self

    def __hash__(self):
        return hash(self.name)

    def __repr__(self):
        return f"torch.{self.name}"


class _RecordingWrapper:
    """A stand-in FlashInfer wrapper: records how it was built and every plan() call."""

    def __init__(self, kind, *args, **kwargs):
        self.kind, self.args, self.kwargs, self.plans = kind, args, kwargs, []

    def plan(self, *args, **kwargs):
        self.plans.append((tuple(a.array if isinstance(a, _HostTensor) else a for a in args), kwargs))


@pytest.fixture
def stand_in_flashinfer(monkeypatch):
    """FlashInferBackend over stand-in torch / flashinfer modules (no GPU): what it builds and plans is recorded."""
    from types import SimpleNamespace
    import sys

    dtypes = {name: _TorchDtype(name) for name in ("uint8", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")}
    torch = SimpleNamespace(**dtypes, empty=lambda *a, **k: "workspace", from_numpy=_HostTensor,
                            cuda=SimpleNamespace(synchronize=lambda: None, get_device_capability=lambda: (9, 0)))
    kinds = ("BatchAttentionWithAttentionSinkWrapper", "BatchDecodeWithPagedKVCacheWrapper",
             "BatchPrefillWithPagedKVCacheWrapper", "BatchMLAPagedAttentionWrapper")
    flashinfer = SimpleNamespace(**{kind: (lambda *a, kind=kind, **k: _RecordingWrapper(kind, *a, **k)) for kind in kinds})
    monkeypatch.setitem(sys.modules, "torch", torch)  # for the backend's helpers that import torch themselves
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer)
    import jaxattn.backends.flashinfer as fi_module

    fi_module.forget_sink_modules()  # a fresh process's FlashInfer module cache
    yield fi_module.FlashInferBackend(launch="bridge", modules=(torch, flashinfer))
    fi_module.forget_sink_modules()


def test_sink_layers_plan_flashinfers_sink_wrapper_also_for_decode(rng, stand_in_flashinfer):
    backend = stand_in_flashinfer
    batch, r2t = make_batch(rng, ForwardMode.DECODE, [5, 0, 17], [1, 0, 1], 3)
    sink_layer = AttentionLayer(0, 8, 2, 64, sliding_window=7, has_sinks=True)
    plain_layer = AttentionLayer(1, 8, 2, 64)
    backend.plan(batch, r2t, [sink_layer, plain_layer, dataclasses.replace(sink_layer, layer_id=2)])
    wrappers = {w.kind: w for w in backend.wrappers}
    assert len(backend.wrappers) == 2  # layers 0 and 2 are one kind
    sink = wrappers["BatchAttentionWithAttentionSinkWrapper"]
    assert sink.kwargs == dict(backend="fa3", q_data_type="bfloat16", kv_data_type="bfloat16", head_dim_qk=64,
                               head_dim_vo=64, window_left=7)
    (args, kwargs), = sink.plans
    np.testing.assert_array_equal(args[0], [0, 1, 2, 3])  # qo_indptr: one query row per sequence
    window = plan_arguments(batch, r2t, sliding_window=7)
    for got, key in zip(args[1:4], ("kv_indptr", "kv_indices", "kv_last_page_len")):
        np.testing.assert_array_equal(got, window[key])
    assert args[4:8] == (8, 2, 64, 1) and kwargs["causal"] and kwargs["window_left"] == 7
    assert kwargs["logits_soft_cap"] is None and kwargs["custom_mask"] is None
    (args, kwargs), = wrappers["BatchDecodeWithPagedKVCacheWrapper"].plans
    np.testing.assert_array_equal(args[0], plan_arguments(batch, r2t)["kv_indptr"])
    # Other dtypes get wrappers of their own (a jitted step keeps the wrapper it was traced with; the sink wrapper is
    # compiled for its dtypes); planning the first dtypes again re-plans their wrappers in place.
    key = backend._key(ForwardMode.DECODE, backend.layer_kind(sink_layer), jnp.bfloat16, jnp.bfloat16)
    backend.plan(batch, r2t, [sink_layer, plain_layer], q_dtype=jnp.float16, kv_dtype=jnp.float16)
    f16 = backend._wrappers[backend._key(ForwardMode.DECODE, backend.layer_kind(sink_layer), jnp.float16, jnp.float16)]
    assert f16 is not sink and f16.kwargs["q_data_type"] == "float16" and len(backend.wrappers) == 4
    backend.plan(batch, r2t, [sink_layer, plain_layer])
    assert backend._wrappers[key] is sink and len(sink.plans) == 2 and len(backend.wrappers) == 4


def test_sink_layers_refuse_what_the_sink_wrapper_cannot_take(rng, stand_in_flashinfer):
    backend = stand_in_flashinfer
    batch, r2t = make_batch(rng, ForwardMode.EXTEND, [10, 3], [4, 3], 8)
    with pytest.raises(NotImplementedError, match="layer 3: .*no soft cap"):
        backend.plan(batch, r2t, [AttentionLayer(3, 4, 2, 64, logit_cap=30.0, has_sinks=True)])
    verify, r2t = make_batch(rng, ForwardMode.TARGET_VERIFY, [6, 4], [2, 2], 4, custom_mask=jnp.ones(20, bool))
    with pytest.raises(NotImplementedError, match="no custom"):
        backend.plan(verify, r2t, [AttentionLayer(0, 4, 2, 64, has_sinks=True)])


def test_forward_passes_sinks_and_only_an_fp8_pools_scales(rng, stand_in_flashinfer, monkeypatch):
    import jaxattn.backends.flashinfer as fi_module

    backend = stand_in_flashinfer
    batch, r2t = make_batch(rng, ForwardMode.EXTEND, [10, 3], [4, 3], 8)
    layers = [AttentionLayer(0, 4, 2, 64, k_scale=0.5, v_scale=2.0, has_sinks=True), AttentionLayer(1, 4, 2, 64, k_scale=0.5)]
    calls = []

    def run(wrapper, q, k_pool, v_pool, v_head_dim, **kwargs):
        calls.append(kwargs)
        return jnp.ones((q.shape[0], q.shape[1], v_head_dim), q.dtype), jnp.zeros(q.shape[:2], jnp.float32)

    monkeypatch.setattr(fi_module, "bridged_run", run)
    q = jnp.ones((8, 4 * 64), jnp.bfloat16)
    sinks = jnp.array([0.5, 1.0, 2.0, 3.0])
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        meta = backend.plan(batch, r2t, layers, kv_dtype=dtype)
        pools = [jnp.zeros((1024, 2, 64), dtype)] * 2
        backend.forward(q, None, None, *pools, layers[0], meta, sinks=sinks, save_kv=False)
        backend.forward(q, None, None, *pools, layers[1], meta, save_kv=False)
    bf16_sinks, bf16_plain, fp8_sinks, fp8_plain = calls
    assert all(kwargs.pop("planned_rows")() == 7 for kwargs in calls)  # 4 + 3 new tokens of 8 rows
    # A 16-bit pool holds the values themselves: FlashInfer gets no scales for it (write_kv ignores them too).
    assert "k_scale" not in bf16_plain and "v_scale" not in bf16_plain and bf16_plain["variant_args"] == ()
    assert fp8_plain["k_scale"] == 0.5 and fp8_plain["v_scale"] is None
    # The sink variant reads its softmax scale from its arguments: an fp8 pool's k_scale is folded in there.
    for kwargs, sm_scale in ((bf16_sinks, 1 / 8), (fp8_sinks, 0.5 / 8)):
        got_sinks, got_scale = kwargs["variant_args"]
        np.testing.assert_array_equal(got_sinks, sinks)
        assert got_sinks.dtype == jnp.float32 and got_scale == pytest.approx(sm_scale)
    assert fp8_sinks["v_scale"] == 2.0 and "k_scale" not in fp8_sinks  # folded into the variant's scale only
    with pytest.raises(ValueError, match="layer 1: FlashInferBackend takes sinks for layers planned with them"):
        backend.forward(q, None, None, *pools, layers[1], meta, sinks=sinks, save_kv=False)
    with pytest.raises(ValueError, match=r"layer 0 has sinks .*pass forward\(sinks=\)"):
        backend.forward(q, None, None, *pools, layers[0], meta, save_kv=False)
    with pytest.raises(ValueError, match=r"sinks.*\[q_heads\]"):
        backend.forward(q, None, None, *pools, layers[0], meta, sinks=sinks[:2], save_kv=False)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_mla_layers_plan_flashinfers_mla_wrapper_with_each_sequences_key_count(rng, stand_in_flashinfer, mode, page_size):
    backend = stand_in_flashinfer
    seq_lens, extend_lens = ([70, 0, 64, 7, 16], [1, 0, 1, 1, 1]) if mode == ForwardMode.DECODE else ([70, 9, 1, 32], [11, 9, 1, 16])
    batch, table = paged_batch(rng, mode, seq_lens, extend_lens, page_size)
    backend.plan(batch, table, [MLA_LAYER])
    (wrapper,) = backend.wrappers
    assert wrapper.kind == "BatchMLAPagedAttentionWrapper" and wrapper.kwargs == dict(backend="auto")
    (args, kwargs), = wrapper.plans
    qo_indptr, kv_indptr, kv_indices, kv_len = args[:4]
    want = plan_arguments(batch, table)
    want_qo = np.arange(len(seq_lens) + 1) if mode == ForwardMode.DECODE else want["qo_indptr"]
    np.testing.assert_array_equal(qo_indptr, want_qo)
    np.testing.assert_array_equal(kv_indptr, want["kv_indptr"])
    np.testing.assert_array_equal(kv_indices, want["kv_indices"])
    np.testing.assert_array_equal(kv_len, np.maximum(seq_lens, 1))  # a padding row lists the padding slot once
    assert args[4:] == (16, 512, 64, page_size, True, 0.1, "bfloat16", "bfloat16") and kwargs == {}


def test_mla_layers_refuse_what_flashinfers_mla_wrapper_cannot_take(rng, stand_in_flashinfer):
    backend = stand_in_flashinfer
    batch, r2t = make_batch(rng, ForwardMode.EXTEND, [10, 3], [4, 3], 8)
    for change, what in ((dict(sliding_window=8), "sliding window"), (dict(logit_cap=30.0), "soft cap"),
                         (dict(has_sinks=True), "sinks"), (dict(is_cross_attention=True), "cross attention")):
        with pytest.raises(NotImplementedError, match=f"MLA wrapper takes no {what}"):
            backend.plan(batch, r2t, [dataclasses.replace(MLA_LAYER, **change)])
    with pytest.raises(NotImplementedError, match="takes no fp8 pool"):
        backend.plan(batch, r2t, [MLA_LAYER], kv_dtype=jnp.float8_e4m3fn)
    verify, r2t = make_batch(rng, ForwardMode.TARGET_VERIFY, [6, 4], [2, 2], 4, custom_mask=jnp.ones(20, bool))
    with pytest.raises(NotImplementedError, match=r"takes no custom \(tree\) mask"):
        backend.plan(verify, r2t, [MLA_LAYER])


def test_mla_forward_writes_the_latent_pool_and_runs_the_mla_wrapper(rng, stand_in_flashinfer, monkeypatch):
    import jaxattn.backends.flashinfer as fi_module

    backend = stand_in_flashinfer
    batch, r2t = make_batch(rng, ForwardMode.EXTEND, [10, 3], [4, 3], 8)
    batch = dataclasses.replace(batch, out_cache_loc=jnp.arange(8, dtype=jnp.int32) + 100)
    meta = backend.plan(batch, r2t, [MLA_LAYER])
    calls = []

    def run(wrapper, q, latent_pool, v_head_dim, **kwargs):
        calls.append((wrapper, q, latent_pool, v_head_dim, kwargs))
        return jnp.ones((q.shape[0], q.shape[1], v_head_dim), q.dtype), jnp.zeros(q.shape[:2], jnp.float32)

    monkeypatch.setattr(fi_module, "bridged_mla_run", run)
    q = jnp.ones((8, 16 * 576), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((8, 576)), jnp.bfloat16)
    pool = jnp.zeros((256, 1, 576), jnp.bfloat16)
    o, lse, new_pool, v_pool = backend.forward(q, k, None, pool, None, MLA_LAYER, meta, return_lse=True)
    assert v_pool is None and o.shape == (8, 16, 512)
    np.testing.assert_array_equal(np.asarray(new_pool[100:108, 0], np.float32), np.asarray(k, np.float32))
    (wrapper, got_q, got_pool, v_head_dim, kwargs), = calls
    assert wrapper is backend._wrappers[backend._key(ForwardMode.EXTEND, backend.layer_kind(MLA_LAYER), q.dtype, pool.dtype)]
    assert got_q.shape == (8, 16, 576) and got_pool is new_pool and v_head_dim == 512
    assert kwargs.pop("planned_rows")() == 7 and kwargs == dict(page_size=1)  # FlashInfer gets the 7 planned rows
    np.testing.assert_array_equal(np.asarray(o[7]), 0)  # 7 real tokens: the padding row is zeroed
    with pytest.raises(NotImplementedError, match="no separate V pool"):
        backend.forward(q, k, k[:, None, :512], pool, pool[..., :512], MLA_LAYER, meta)
    plain = AttentionLayer(1, 4, 2, 64)
    with pytest.raises(NotImplementedError, match="layer 1: .*2 kv heads of 64/64 and v_pool None"):
        backend.forward(q, None, None, pool, None, plain, meta)


def test_deterministic_mode_plans_fixed_splits_and_tensor_core_decode(rng, stand_in_flashinfer):
    backend_type = type(stand_in_flashinfer)
    with pytest.raises(ValueError, match="deterministic=True needs tensor-core decode"):
        backend_type(launch="bridge", deterministic=True, use_tensor_cores=False)
    layers = [AttentionLayer(0, 4, 4, 64), AttentionLayer(1, 4, 4, 64, has_sinks=True)]  # MHA: no tensor cores by rule
    for page_size in (1, 16):
        backend = backend_type(launch="bridge", deterministic=True)
        for mode, seq_lens, extend_lens, split in ((ForwardMode.DECODE, [70, 9, 1, 32], [1, 1, 1, 1], 2048),
                                                   (ForwardMode.EXTEND, [70, 9, 1, 32], [11, 9, 1, 16], 4096)):
            batch, table = paged_batch(rng, mode, seq_lens, extend_lens, page_size)
            backend.plan(batch, table, layers)
            plain, sinks = (backend._wrappers[backend._key(mode, backend.layer_kind(layer), jnp.bfloat16, jnp.bfloat16)]
                            for layer in layers)
            if mode == ForwardMode.DECODE:
                assert plain.kind == "BatchDecodeWithPagedKVCacheWrapper" and plain.kwargs["use_tensor_cores"] is True
            # fa2 wrappers: 0.6.0's plans pass the fixed split size to fa2's planner only.
            assert plain.kwargs["backend"] == sinks.kwargs["backend"] == "fa2"
            assert plain.plans[-1][1]["fixed_split_size"] == split // page_size
            assert sinks.plans[-1][1]["fixed_split_size"] == 4096 // page_size  # a prefill plan, also for decode
    plain = backend_type(launch="bridge")
    batch, r2t = make_batch(rng, ForwardMode.DECODE, [5, 17], [1, 1], 2)
    plain.plan(batch, r2t, layers[:1])
    (wrapper,) = plain.wrappers
    assert "fixed_split_size" not in wrapper.plans[-1][1] and wrapper.kwargs["use_tensor_cores"] is False
    with pytest.raises(NotImplementedError, match="MLA wrapper has no fixed split size"):
        backend_type(launch="bridge", deterministic=True).plan(batch, r2t, [MLA_LAYER])


def test_a_step_needs_a_plan_for_its_dtypes(rng, stand_in_flashinfer):
    backend = stand_in_flashinfer
    batch, r2t = make_batch(rng, ForwardMode.EXTEND, [10, 3], [4, 3], 8)
    layer = AttentionLayer(0, 4, 2, 64)
    meta = backend.plan(batch, r2t, [layer])  # bf16 q and pool
    pools = [jnp.zeros((1024, 2, 64), jnp.float16)] * 2
    with pytest.raises(ValueError, match=r"layer 0 was not planned for this step's mode and dtypes \(q float16, pool float16\)"):
        backend.forward(jnp.ones((8, 4 * 64), jnp.float16), None, None, *pools, layer, meta, save_kv=False)


@pytest.mark.parametrize("field, value, message", [
    ("seq_lens", [5, -1, 17], r"batch.seq_lens must be >= 0; sequences \[1\] have \[-1\]"),
    ("extend_lens", [1, 1, 18], r"batch.extend_lens must be <= seq_lens"),
    ("req_pool_indices", [0, 8, 1], r"batch.req_pool_indices must be rows of the table, in \[0, 8\); sequences \[1\] have \[8\]"),
])
def test_plans_refuse_batches_the_kernels_cannot_take(rng, field, value, message):
    batch, r2t = make_batch(rng, ForwardMode.DECODE, [5, 1, 17], [1, 1, 1], 3)
    batch = dataclasses.replace(batch, **{field: jnp.asarray(value, jnp.int32)})
    with pytest.raises(ValueError, match=message):
        plan_arguments(batch, r2t)


def test_plans_refuse_extends_longer_than_the_bucket(rng):
    # The other backends leave a sequence's rows past max_extend_len uncomputed (0); FlashInfer plans from the host's
    # lengths and would compute them, so the backends would disagree: the plan says so instead.
    batch, r2t = make_batch(rng, ForwardMode.EXTEND, [10, 3], [4, 3], 8)
    plan_arguments(dataclasses.replace(batch, max_extend_len=4), r2t)
    with pytest.raises(ValueError, match=r"batch.extend_lens must be <= batch.max_extend_len \(3, the bucket.*"
                                         r"sequences \[0\] have \[4\]"):
        plan_arguments(dataclasses.replace(batch, max_extend_len=3), r2t)


def test_plans_list_slots_outside_the_pool_as_the_padding_slot(rng, stand_in_flashinfer):
    # FlashInfer's kernels read every slot a list names: a table entry outside [1, num_slots) is listed as the padding
    # slot 0 (the kernels' own clamp), negative ones also without num_slots; a pool smaller than planned is refused.
    batch, r2t = make_batch(rng, ForwardMode.DECODE, [5, 0, 17], [1, 0, 1], 3)
    rows = np.asarray(batch.req_pool_indices)
    r2t = r2t.copy()
    r2t[rows[0], 1], r2t[rows[0], 3], r2t[rows[2], 16] = 10**6, -7, 512
    listed = plan_arguments(batch, r2t, num_slots=512)["kv_indices"]
    want = np.concatenate([r2t[rows[0], :5], [0], r2t[rows[2], :17]])
    want[[1, 3, 5 + 1 + 16]] = 0
    np.testing.assert_array_equal(listed, want)
    unbounded = plan_arguments(batch, r2t)["kv_indices"]
    assert unbounded[1] == 10**6 and unbounded[3] == 0 and unbounded[-1] == 512

    backend = stand_in_flashinfer
    layer = AttentionLayer(0, 4, 2, 64)
    meta = backend.plan(batch, r2t, [layer], num_slots=512)
    assert meta.num_slots == 512
    pools = [jnp.zeros((256, 2, 64), jnp.bfloat16)] * 2
    with pytest.raises(ValueError, match=r"k_pool has 256 rows; the step was planned for a pool of 512 slots"):
        backend.forward(jnp.ones((3, 4 * 64), jnp.bfloat16), None, None, *pools, layer, meta, save_kv=False)
    with pytest.raises(ValueError, match=r"num_slots must be a positive Python int"):
        backend.plan(batch, r2t, [layer], num_slots=0)


def test_wrappers_take_fa3_only_where_it_takes_the_layer(rng, stand_in_flashinfer, monkeypatch):
    # FlashInfer 0.6.0's backend="auto" picks fa3 on sm_90 whatever the dtypes and head dims: the backend names fa2
    # where fa3 would fail (16-bit q over an fp8 pool, head dims other than 64/128/256) and off Hopper.
    import jaxattn.backends.flashinfer as fi_module

    backend = stand_in_flashinfer
    extend, r2t = make_batch(rng, ForwardMode.EXTEND, [10, 3], [4, 3], 8)
    decode, _ = make_batch(rng, ForwardMode.DECODE, [10, 3], [1, 1], 2)

    def built(layer, batch, kv_dtype=jnp.bfloat16):
        backend.plan(batch, r2t, [layer], kv_dtype=kv_dtype)
        return backend._wrappers[backend._key(batch.mode, backend.layer_kind(layer), jnp.bfloat16, kv_dtype)].kwargs

    assert built(AttentionLayer(0, 8, 2, 128), extend)["backend"] == "fa3"
    assert built(AttentionLayer(0, 8, 2, 128, k_scale=0.5), extend, jnp.float8_e4m3fn)["backend"] == "fa2"
    assert built(AttentionLayer(0, 8, 2, 96), extend)["backend"] == "fa2"
    assert built(AttentionLayer(0, 8, 2, 96, has_sinks=True), extend)["backend"] == "fa2"
    decode_kwargs = built(AttentionLayer(0, 8, 2, 128), decode)
    assert decode_kwargs["backend"] == "fa3" and decode_kwargs["use_tensor_cores"] is True  # a group of 4
    # A verify step's tree mask: 0.6.0's fa3 paged prefill refuses custom masks (fa2, as its own auto rule picks);
    # a cross layer of the same step sees every encoder key (no mask: fa3).
    verify, _ = make_batch(rng, ForwardMode.TARGET_VERIFY, [6, 4], [2, 2], 4, custom_mask=jnp.ones(20, bool),
                           encoder_lens=[2, 2])
    assert built(AttentionLayer(0, 8, 2, 128), verify)["backend"] == "fa2"
    assert built(AttentionLayer(1, 8, 2, 128, is_cross_attention=True), verify)["backend"] == "fa3"
    assert fi_module.attention_backend(jnp.bfloat16, jnp.bfloat16, 128, 128, deterministic=False, hopper=True,
                                       custom_mask=True) == "fa2"
    assert fi_module.fa3_declines(jnp.bfloat16, jnp.float8_e5m2, 128, 128).startswith("fa3 takes no bfloat16 q")
    assert "64, 128, 256" in fi_module.fa3_declines(jnp.bfloat16, jnp.bfloat16, 192, 128)
    assert fi_module.fa3_declines(jnp.float16, jnp.float16, 256, 256) is None
    assert fi_module.attention_backend(jnp.bfloat16, jnp.bfloat16, 128, 128, deterministic=False, hopper=False) == "fa2"
    monkeypatch.setattr(backend.torch.cuda, "get_device_capability", lambda: (8, 0))
    assert type(backend)(launch="bridge").hopper is False


def test_layers_with_two_head_dims_are_refused_unless_mla(rng, stand_in_flashinfer):
    # 0.6.0's paged kernels read K and V pages of one stride and decode takes one head dim: a 192/128 layer over
    # separate pools would fail inside FlashInfer; MLA's 576/512 latent layer takes its own wrapper.
    extend, r2t = make_batch(rng, ForwardMode.EXTEND, [10, 3], [4, 3], 8)
    with pytest.raises(NotImplementedError, match="layer 5: .*one head dim .* 192/128"):
        stand_in_flashinfer.plan(extend, r2t, [AttentionLayer(5, 8, 8, 192, v_head_dim=128)])
    stand_in_flashinfer.plan(extend, r2t, [MLA_LAYER])


def test_sink_layers_of_one_flashinfer_module_name_are_one_configuration(rng, stand_in_flashinfer):
    # FlashInfer 0.6.0 names a sink module by q's dtype, window or not and backend only: a second pool dtype or head
    # dim under the same name would load the first's library; refused, naming the name. Another window kind, another
    # q dtype or the same configuration again are fine.
    backend = stand_in_flashinfer
    batch, r2t = make_batch(rng, ForwardMode.EXTEND, [10, 3], [4, 3], 8)
    layer = AttentionLayer(0, 8, 2, 64, has_sinks=True)
    backend.plan(batch, r2t, [layer, dataclasses.replace(layer, layer_id=1, sliding_window=100)])
    backend.plan(batch, r2t, [layer], q_dtype=jnp.float16, kv_dtype=jnp.float16)
    type(backend)(launch="bridge").plan(batch, r2t, [layer])
    with pytest.raises(NotImplementedError, match="'batch_prefill_attention_sink_bf16_swa_False_fa3'.* head dims 64/64"):
        backend.plan(batch, r2t, [AttentionLayer(2, 8, 2, 128, has_sinks=True)])
    # An fp8 pool's sink layers take fa2 (fa3 declines them): another name on Hopper; in deterministic mode (fa2
    # throughout) the same name as the 16-bit pool's.
    backend.plan(batch, r2t, [dataclasses.replace(layer, k_scale=0.5)], kv_dtype=jnp.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="a bfloat16 pool .*_fa2'.* a float8_e4m3fn pool"):
        type(backend)(launch="bridge", deterministic=True).plan(batch, r2t, [layer])

