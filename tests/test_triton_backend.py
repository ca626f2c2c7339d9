"""TritonBackend: every forward mode against ReferenceBackend on the same batches, the draft-step builder, one compile.

Kernels run in Triton's interpreter on CPU, so shapes stay tiny: 3 sequences, 4 q heads over 2 kv heads, head dim 16.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.backends import AttentionLayer, ReferenceBackend
from jaxattn.batch import ForwardBatch, ForwardMode, tree_mask_for_verify
from jaxattn.decode import decode_metadata_from_indptr
from jaxattn.triton_backend import DraftDecodeMetadata, TritonBackend, TritonMetadata, draft_decode_metadata

H, KVH, D = 4, 2, 16
NUM_SLOTS, MAX_REQS, MAX_CTX = 80, 6, 40
WINDOW = 3

FULL = AttentionLayer(0, H, KVH, D)
WINDOWED = AttentionLayer(1, H, KVH, D, sliding_window=WINDOW)
UNPREPARED = AttentionLayer(2, H, KVH, D, sliding_window=1)  # no trimmed lists: full lists + the kernels' mask
FEATURES = AttentionLayer(3, H, KVH, D, logit_cap=5.0, xai_temperature_len=4, sm_scale=0.3)
CROSS = AttentionLayer(4, H, KVH, D, is_cross_attention=True)
SELF_LAYERS = (WINDOWED, UNPREPARED, FEATURES)  # FEATURES runs on the full lists


def make_batch(rng, prefix_lens, extend_lens, *, mode, token_bucket, batch_bucket=4, max_extend_len=None,
               encoder_lens=None, parents=None):
    """A padded batch over a shuffled pool: row b's encoder tokens, then its prefix, then its new tokens.

    Returns (batch, req_to_token). Sequences past len(prefix_lens) are padding rows (seq_len 0).
    """
    n = len(prefix_lens)
    enc = np.zeros(n, int) if encoder_lens is None else np.asarray(encoder_lens)
    prefix, ext = np.asarray(prefix_lens), np.asarray(extend_lens)
    seq = prefix + ext
    req_to_token = np.zeros((MAX_REQS, MAX_CTX), np.int32)
    rows = rng.permutation(MAX_REQS)[:batch_bucket].astype(np.int32)
    free = iter(rng.permutation(np.arange(1, NUM_SLOTS)))
    for b in range(n):
        req_to_token[rows[b], : enc[b] + seq[b]] = [next(free) for _ in range(enc[b] + seq[b])]
    decode = mode == ForwardMode.DECODE
    loc = np.zeros(token_bucket, np.int32)
    pos = np.zeros(token_bucket, np.int32)
    cursor = 0
    for b in range(n):
        at = b if decode else cursor
        loc[at : at + ext[b]] = req_to_token[rows[b], enc[b] + prefix[b] : enc[b] + seq[b]]
        pos[at : at + ext[b]] = np.arange(prefix[b], seq[b])
        cursor += ext[b]
    pad = batch_bucket - n
    fields = dict(
        req_pool_indices=jnp.asarray(rows),
        seq_lens=jnp.asarray(np.concatenate([seq, np.zeros(pad, int)]).astype(np.int32)),
        extend_lens=jnp.asarray(np.concatenate([ext, np.zeros(pad, int)]).astype(np.int32)),
        out_cache_loc=jnp.asarray(loc),
        positions=jnp.asarray(pos),
        mode=mode,
        max_extend_len=max_extend_len or max(1, int(ext.max(initial=1))),
        kv_capacity=int(enc.sum() + seq.sum()) + 3,
        max_seq_len=MAX_CTX,
    )
    if encoder_lens is not None:
        fields["encoder_lens"] = jnp.asarray(np.concatenate([enc, np.zeros(pad, int)]).astype(np.int32))
    if parents is not None:
        masks = [tree_mask_for_verify(p, int(pf)).reshape(-1) for p, pf in zip(parents, prefix)]
        mask = np.concatenate(masks + [np.zeros(7, bool)])
        fields["custom_mask"] = jnp.asarray(mask)
    return ForwardBatch(**fields), jnp.asarray(req_to_token)


def random_inputs(rng, tokens, dtype=jnp.float32):
    def normal(shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    q, k, v = normal((tokens, H, D)), normal((tokens, KVH, D)), normal((tokens, KVH, D))
    return q, k, v, normal((NUM_SLOTS, KVH, D)), normal((NUM_SLOTS, KVH, D))


@jax.jit
def _reference_outputs(q, k, v, k_buffer, v_buffer, batch, req_to_token, sinks):
    backend = ReferenceBackend()
    meta = backend.init_forward_metadata(batch, req_to_token)
    return [backend.forward(q, k, v, k_buffer, v_buffer, layer, meta, sinks=sinks if layer is FEATURES else None)
            for layer in batch_layers(batch)]


def batch_layers(batch):
    return SELF_LAYERS + ((CROSS,) if batch.encoder_lens is not None else ())


def run_both(backend, batch, req_to_token, inputs, sinks):
    step = jax.jit(lambda q, k, v, kb, vb, batch, rt, sinks: [
        backend.forward(q, k, v, kb, vb, layer, meta, sinks=sinks if layer is FEATURES else None)
        for meta in [backend.init_forward_metadata(batch, rt)] for layer in batch_layers(batch)
    ])
    got = step(*inputs, batch, req_to_token, sinks)
    want = _reference_outputs(*inputs, batch, req_to_token, sinks)
    return got, want


def assert_matches_reference(got, want, batch, atol=3e-5):
    for layer, (o, kb, vb), (o_ref, kb_ref, vb_ref) in zip(batch_layers(batch), got, want):
        np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=atol, rtol=atol, err_msg=f"layer {layer}")
        # Slot 0 is the padding slot: several padding tokens write it in one scatter, so its contents are unspecified
        # (on a GPU the winning write differs between runs; see kv_pool.write_kv). Every other slot must match exactly.
        np.testing.assert_array_equal(np.asarray(kb)[1:], np.asarray(kb_ref)[1:])
        np.testing.assert_array_equal(np.asarray(vb)[1:], np.asarray(vb_ref)[1:])


BACKEND_KINDS = [
    pytest.param(dict(), id="two-stage"),
    pytest.param(dict(deterministic=True), id="deterministic"),
]


@pytest.mark.parametrize(
    "kind, mode",
    [
        pytest.param(dict(), ForwardMode.EXTEND, id="extend-two-stage"),
        pytest.param(dict(deterministic=True), ForwardMode.EXTEND, id="extend-deterministic"),
        # DRAFT_EXTEND: the same causal extend over the accepted tokens (no second visit of the new tokens).
        pytest.param(dict(), ForwardMode.DRAFT_EXTEND, id="draft-extend-two-stage"),
    ],
)
def test_extend_matches_reference(rng, kind, mode):
    # A plain prefill, a prefix longer than the window, a prefix shorter than it; one padding row; padding tokens.
    batch, req_to_token = make_batch(rng, [0, 9, 2], [5, 3, 2], mode=mode, token_bucket=12)
    inputs = random_inputs(rng, 12)
    sinks = jnp.asarray(rng.standard_normal(H), jnp.float32)
    got, want = run_both(TritonBackend(sliding_windows=(WINDOW,), **kind), batch, req_to_token, inputs, sinks)
    assert_matches_reference(got, want, batch)
    for o, _, _ in got:
        np.testing.assert_array_equal(np.asarray(o)[10:], 0)  # padding tokens


@pytest.mark.parametrize("kind", BACKEND_KINDS)
def test_decode_matches_reference(rng, kind):
    batch, req_to_token = make_batch(rng, [7, 0, 12], [1, 1, 1], mode=ForwardMode.DECODE, token_bucket=4)
    inputs = random_inputs(rng, 4)
    sinks = jnp.asarray(rng.standard_normal(H), jnp.float32)
    got, want = run_both(TritonBackend(sliding_windows=(WINDOW,), **kind), batch, req_to_token, inputs, sinks)
    assert_matches_reference(got, want, batch)
    for o, _, _ in got:
        np.testing.assert_array_equal(np.asarray(o)[3], 0)  # padding row


@pytest.mark.parametrize("kind", BACKEND_KINDS)
def test_target_verify_matches_reference(rng, kind):
    parents = [[-1, 0, 0, 1], [-1, -1, 1, 2]]
    batch, req_to_token = make_batch(rng, [6, 2], [4, 4], mode=ForwardMode.TARGET_VERIFY, token_bucket=10,
                                     batch_bucket=3, parents=parents)
    inputs = random_inputs(rng, 10)
    sinks = jnp.asarray(rng.standard_normal(H), jnp.float32)
    got, want = run_both(TritonBackend(sliding_windows=(WINDOW,), **kind), batch, req_to_token, inputs, sinks)
    assert_matches_reference(got, want, batch)


@pytest.mark.parametrize("kind", BACKEND_KINDS)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_cross_attention_matches_reference(rng, kind, mode):
    ext = [3, 2] if mode == ForwardMode.EXTEND else [1, 1]
    batch, req_to_token = make_batch(rng, [4, 0], ext, mode=mode, token_bucket=6 if mode == ForwardMode.EXTEND else 3,
                                     batch_bucket=3, encoder_lens=[5, 3])
    inputs = random_inputs(rng, batch.num_tokens)
    sinks = jnp.asarray(rng.standard_normal(H), jnp.float32)
    got, want = run_both(TritonBackend(sliding_windows=(WINDOW,), **kind), batch, req_to_token, inputs, sinks)
    assert_matches_reference(got, want, batch)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_cross_attention_over_a_page_table(rng, mode):
    """TritonBackend with a PageTable builds the cross-attention lists from the pages: at page size 1 (page id =
    slot) the same metadata as with req_to_token."""
    from jaxattn.paging import PageTable

    ext = [3, 2] if mode == ForwardMode.EXTEND else [1, 1]
    batch, req_to_token = make_batch(rng, [4, 0], ext, mode=mode, token_bucket=6 if mode == ForwardMode.EXTEND else 3,
                                     batch_bucket=3, encoder_lens=[5, 3])
    backend = TritonBackend()
    got = backend.init_forward_metadata(batch, PageTable(req_to_token, page_size=1, num_slots=NUM_SLOTS), batch_layers(batch))
    want = backend.init_forward_metadata(batch, req_to_token, batch_layers(batch))
    assert got.cross_attn is not None
    for a, b in zip(jax.tree_util.tree_leaves(got.cross_attn), jax.tree_util.tree_leaves(want.cross_attn)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree_util.tree_structure(got.cross_attn) == jax.tree_util.tree_structure(want.cross_attn)


def test_idle_gives_zeros_and_leaves_the_pool():
    rng = np.random.default_rng(0)
    batch, req_to_token = make_batch(rng, [], [], mode=ForwardMode.IDLE, token_bucket=2, batch_bucket=1)
    q, k, v, kb, vb = random_inputs(rng, 2)
    backend = TritonBackend()
    meta = backend.init_forward_metadata(batch, req_to_token)
    o, kb2, vb2 = backend.forward(q, k, v, kb, vb, FULL, meta)
    np.testing.assert_array_equal(np.asarray(o), 0)
    assert kb2 is kb and vb2 is vb


def test_fp8_pool_matches_reference(rng):
    batch, req_to_token = make_batch(rng, [6, 3], [1, 1], mode=ForwardMode.DECODE, token_bucket=2, batch_bucket=2)
    q, k, v, kb, vb = random_inputs(rng, 2)
    layer = AttentionLayer(0, H, KVH, D, k_scale=0.5, v_scale=2.0)
    kb, vb = kb.astype(jnp.float8_e4m3fn), vb.astype(jnp.float8_e4m3fn)
    outs = []
    for backend in (TritonBackend(), ReferenceBackend()):
        outs.append(backend.forward(q, k, v, kb, vb, layer, backend.init_forward_metadata(batch, req_to_token)))
    np.testing.assert_allclose(np.asarray(outs[0][0]), np.asarray(outs[1][0]), atol=3e-5, rtol=3e-5)
    np.testing.assert_array_equal(np.asarray(outs[0][1]).view(np.uint8), np.asarray(outs[1][1]).view(np.uint8))


def test_fp8_pools_size_decode_splits_by_waves_where_the_table_says(rng, monkeypatch):
    # TritonBackend(kv_dtype=<fp8>) passes the fp8 tile's SplitWaves to its decode lists (full and window) when
    # tuning.sm90.DECODE_FP8_SPLIT_WAVES is on; 16-bit pools, the flag off or deterministic mode pass none.
    import jaxattn.backends.triton as triton_backend
    from jaxattn.metadata import SplitWaves
    from jaxattn.tuning import decode_split_waves, sm90

    seen = []
    build = triton_backend.decode_metadata

    def recording(*args, **kwargs):
        seen.append(kwargs["split_waves"])
        return build(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "decode_metadata", recording)
    batch, req_to_token = make_batch(rng, [6, 3], [1, 1], mode=ForwardMode.DECODE, token_bucket=2, batch_bucket=2)
    layers = [AttentionLayer(0, 32, 8, 128), AttentionLayer(1, 32, 8, 128, sliding_window=WINDOW)]
    waves = decode_split_waves(128, 128, 32, 8)
    assert isinstance(waves, SplitWaves)
    cases = ((True, dict(kv_dtype=jnp.float8_e4m3fn), waves), (True, dict(kv_dtype="float8_e5m2"), waves),
             (True, dict(kv_dtype=jnp.bfloat16), None), (True, dict(), None),
             (True, dict(kv_dtype=jnp.float8_e4m3fn, deterministic=True), None),
             (False, dict(kv_dtype=jnp.float8_e4m3fn), None))
    for flag, kind, expected in cases:
        monkeypatch.setattr(sm90, "DECODE_FP8_SPLIT_WAVES", flag)
        seen.clear()
        TritonBackend(**kind).init_forward_metadata(batch, req_to_token, layers)
        assert seen == [expected, expected], (flag, kind)  # the full lists and the window's
    for wrong in (8, "fp9"):
        with pytest.raises(ValueError, match="kv_dtype must be None or a dtype"):
            TritonBackend(kv_dtype=wrong)


def test_windows_from_layers_get_trimmed_lists(rng):
    batch, req_to_token = make_batch(rng, [9, 2], [1, 1], mode=ForwardMode.DECODE, token_bucket=2, batch_bucket=2)
    meta = TritonBackend(sliding_windows=(5,)).init_forward_metadata(batch, req_to_token, layers=SELF_LAYERS + (CROSS,))
    assert meta.windows == (1, WINDOW, 5)
    lens = np.diff(np.asarray(meta.window_attn[1].kv_indptr))
    np.testing.assert_array_equal(lens, [WINDOW + 1, 3])
    assert meta.for_layer(WINDOWED)[0] is meta.window_attn[1]
    assert meta.for_layer(AttentionLayer(9, H, KVH, D, sliding_window=7))[0] is meta.attn  # unprepared: full lists


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY])
def test_deterministic_window_layers_on_full_lists_match_reference(rng, monkeypatch, mode):
    # Where the Mosaic GPU unified kernel takes the call (Hopper), a deterministic window layer runs on the full lists
    # (and the full-width verify mask) with the window as the op's argument; on CPU the unified Triton kernel runs
    # that same call here, which must give the reference's (and the cut lists') result.
    from jaxattn.backends import triton as triton_backend

    parents = [[-1, 0, 0, 1], [-1, -1, 1, 2]] if mode == ForwardMode.TARGET_VERIFY else None
    batch, req_to_token = make_batch(rng, [9, 2], [4, 4], mode=mode, token_bucket=10, batch_bucket=3, parents=parents)
    inputs = random_inputs(rng, 10)
    sinks = jnp.asarray(rng.standard_normal(H), jnp.float32)
    backend = TritonBackend(sliding_windows=(WINDOW,), deterministic=True)
    cut, want = run_both(backend, batch, req_to_token, inputs, sinks)
    seen = []
    real = triton_backend.extend_attention_unified

    def recording(q, k_pool, v_pool, lists, **kwargs):
        seen.append((lists.sliding_window, kwargs["sliding_window"], kwargs["custom_mask"] is None))
        return real(q, k_pool, v_pool, lists, **kwargs)

    monkeypatch.setattr(triton_backend, "unified_window_on_full_lists", lambda *args, **kwargs: True)
    monkeypatch.setattr(triton_backend, "extend_attention_unified", recording)
    full, _ = run_both(backend, batch, req_to_token, inputs, sinks)
    assert_matches_reference(full, want, batch)
    for layer, (o_full, _, _), (o_cut, _, _) in zip(batch_layers(batch), full, cut):
        np.testing.assert_allclose(np.asarray(o_full), np.asarray(o_cut), atol=3e-5, rtol=3e-5, err_msg=f"{layer}")
    verify = mode == ForwardMode.TARGET_VERIFY
    # WINDOWED (a prepared window) on the full lists (built without a window: -1) with its window as the argument;
    # UNPREPARED and FEATURES are on the full lists anyway.
    assert seen == [(-1, WINDOW, not verify), (-1, 1, not verify), (-1, -1, not verify)]


def test_unified_window_on_full_lists_where_the_mosaic_kernel_takes_the_call(monkeypatch):
    # The route's condition: a window, 16-bit pools of q's dtype, a call the Mosaic GPU unified kernel takes (head
    # dims, features), on a GPU it runs on.
    from jaxattn import hardware
    from jaxattn.extend_mgpu import unified_window_on_full_lists

    def arrays(dim=128, dtype=jnp.bfloat16, pool_dtype=None):
        pool = jnp.zeros((20, 2, dim), pool_dtype or dtype)
        return jnp.zeros((6, 8, dim), dtype), pool, pool

    assert not unified_window_on_full_lists(*arrays(), sliding_window=100, launch_mode="interpret")
    monkeypatch.setattr(hardware, "mosaic_gpu_unavailable", lambda mode: None)  # as on an sm_90 GPU
    assert unified_window_on_full_lists(*arrays(), sliding_window=100)
    assert unified_window_on_full_lists(*arrays(64, jnp.float16), sliding_window=0, logit_cap=30.0,
                                        sinks=jnp.zeros(8), custom_mask=jnp.ones(10, bool))
    assert not unified_window_on_full_lists(*arrays(), sliding_window=-1)  # no window: nothing to cut
    assert not unified_window_on_full_lists(*arrays(pool_dtype=jnp.float8_e4m3fn), sliding_window=100)  # dequantised
    assert not unified_window_on_full_lists(*arrays(dtype=jnp.float32), sliding_window=100)  # the Triton kernel's
    assert not unified_window_on_full_lists(*arrays(dim=16), sliding_window=100)  # head dims it does not take


def test_compiled_once_serves_varying_lengths_and_batches(rng):
    backend = TritonBackend(sliding_windows=(WINDOW,))
    traces = []

    def step(q, k, v, kb, vb, batch, req_to_token):
        traces.append(1)
        meta = backend.init_forward_metadata(batch, req_to_token)
        return [backend.forward(q, k, v, kb, vb, layer, meta)[0] for layer in (FULL, WINDOWED)]

    @jax.jit
    def reference_step(q, k, v, kb, vb, batch, req_to_token):
        reference = ReferenceBackend()
        meta = reference.init_forward_metadata(batch, req_to_token)
        return [reference.forward(q, k, v, kb, vb, layer, meta)[0] for layer in (FULL, WINDOWED)]

    step = jax.jit(step)
    for prefixes in ([3, 11, 0], [20, 1], [1, 1, 1, 30]):
        batch, req_to_token = make_batch(rng, prefixes, [1] * len(prefixes), mode=ForwardMode.DECODE, token_bucket=4)
        batch = dataclasses.replace(batch, kv_capacity=64)  # one bucket for every batch
        inputs = random_inputs(rng, 4)
        got = step(*inputs, batch, req_to_token)
        want = reference_step(*inputs, batch, req_to_token)
        for o, o_ref in zip(got, want):
            np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=3e-5, rtol=3e-5)
    assert len(traces) == 1


def test_metadata_is_a_pytree_with_static_mode(rng):
    batch, req_to_token = make_batch(rng, [4], [2], mode=ForwardMode.EXTEND, token_bucket=2, batch_bucket=1)
    meta = TritonBackend(sliding_windows=(WINDOW,)).init_forward_metadata(batch, req_to_token)
    leaves, treedef = jax.tree_util.tree_flatten(meta)
    assert all(isinstance(x, jax.Array) for x in leaves)
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(again, TritonMetadata) and again.mode == ForwardMode.EXTEND and again.windows == (WINDOW,)


# ---------------------------------------------------------------------------------------------
# Multi-step draft decoding


def draft_lists_one_step(req_to_token, rows, seq_lens, step, num_steps, topk):
    """SGLang's per-step rule, written out: row (b, t) lists its verified tokens then branch t's depth 0..step."""
    indptr, indices, lens = [0], [], []
    for row, seq in zip(rows, seq_lens):
        for t in range(topk):
            if seq == 0:
                lens.append(0)
                indptr.append(indptr[-1])
                continue
            keys = list(req_to_token[row, :seq]) + list(req_to_token[row, seq + t * num_steps : seq + t * num_steps + step + 1])
            indices += keys
            lens.append(len(keys))
            indptr.append(indptr[-1] + len(keys))
    return np.asarray(indptr, np.int32), np.asarray(indices, np.int32), np.asarray(lens, np.int32)


@pytest.mark.parametrize("topk", [1, 3])
def test_draft_decode_metadata_equals_building_each_step(rng, topk):
    num_steps, capacity = 4, 120
    rows = np.array([3, 0, 5], np.int32)
    seq_lens = np.array([7, 0, 12], np.int32)  # the middle row is padding
    req_to_token = rng.integers(1, NUM_SLOTS, (MAX_REQS, MAX_CTX)).astype(np.int32)
    kw = dict(q_heads=H, kv_heads=KVH, max_kv_splits=4, max_context_len=MAX_CTX)
    draft = draft_decode_metadata(jnp.asarray(req_to_token), jnp.asarray(rows), jnp.asarray(seq_lens),
                                  speculative_num_steps=num_steps, topk=topk, kv_capacity=capacity, **kw)
    assert isinstance(draft, DraftDecodeMetadata) and draft.num_steps == num_steps - 1  # the last step only samples
    for i, meta in enumerate(draft.steps()):
        indptr, indices, lens = draft_lists_one_step(req_to_token, rows, seq_lens, i, num_steps, topk)
        padded = np.zeros(capacity, np.int32)
        padded[: len(indices)] = indices
        want = decode_metadata_from_indptr(jnp.asarray(indptr), jnp.asarray(padded), jnp.asarray(lens), **kw)
        for name in ("kv_indptr", "kv_indices", "num_kv_splits", "seq_lens"):
            np.testing.assert_array_equal(np.asarray(getattr(meta, name)), np.asarray(getattr(want, name)), err_msg=f"step {i} {name}")
        assert (meta.max_kv_splits, meta.kv_capacity) == (want.max_kv_splits, want.kv_capacity)
        real = np.repeat(seq_lens > 0, topk)
        branch = np.tile(np.arange(topk), len(rows))
        want_loc = np.where(real, req_to_token[np.repeat(rows, topk), np.repeat(seq_lens, topk) + branch * num_steps + i], 0)
        np.testing.assert_array_equal(np.asarray(draft.out_cache_loc[i]), want_loc)
        np.testing.assert_array_equal(np.asarray(draft.positions[i]), np.where(real, np.repeat(seq_lens, topk) + i, 0))


def test_draft_steps_attend_like_the_reference_in_a_traced_loop(rng):
    """The draft loop indexes the stacked metadata with a traced step inside lax.fori_loop."""
    num_steps, topk = 3, 2
    rows = np.array([1, 4], np.int32)
    seq_lens = np.array([5, 9], np.int32)
    req_to_token = np.zeros((MAX_REQS, MAX_CTX), np.int32)
    slots = iter(rng.permutation(np.arange(1, NUM_SLOTS)))
    for row, seq in zip(rows, seq_lens):
        req_to_token[row, : seq + topk * num_steps] = [next(slots) for _ in range(seq + topk * num_steps)]
    draft = draft_decode_metadata(jnp.asarray(req_to_token), jnp.asarray(rows), jnp.asarray(seq_lens),
                                  speculative_num_steps=num_steps, topk=topk, kv_capacity=64, q_heads=H, kv_heads=KVH)
    backend = TritonBackend()
    n = len(rows) * topk
    q = jnp.asarray(rng.standard_normal((num_steps - 1, n, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((num_steps - 1, n, KVH, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((num_steps - 1, n, KVH, D)), jnp.float32)
    _, _, _, kb, vb = random_inputs(rng, 1)

    @jax.jit
    def loop(kb, vb):
        def body(i, carry):
            kb, vb, out = carry
            meta = backend.draft_step_metadata(draft, i)
            o, kb, vb = backend.forward(q[i], k[i], v[i], kb, vb, FEATURES, meta)
            return kb, vb, out.at[i].set(o)

        return jax.lax.fori_loop(0, num_steps - 1, body, (kb, vb, jnp.zeros((num_steps - 1, n, H, D), jnp.float32)))

    kb_out, vb_out, out = loop(kb, vb)
    # Replay with the reference: write each step's K/V, attend over the same lists.
    from jaxattn.reference import ragged_paged_attention_reference

    for i in range(num_steps - 1):
        meta = draft.step(i)
        kb = kb.at[draft.out_cache_loc[i]].set(k[i])
        vb = vb.at[draft.out_cache_loc[i]].set(v[i])
        want = ragged_paged_attention_reference(
            q[i], kb, vb, jnp.arange(n + 1, dtype=jnp.int32), meta.kv_indptr, meta.kv_indices, logit_cap=FEATURES.logit_cap,
            xai_temperature_len=FEATURES.xai_temperature_len, sm_scale=FEATURES.scale, max_q_len=1, max_kv_len=MAX_CTX,
        )
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(want), atol=3e-5, rtol=3e-5)
    np.testing.assert_array_equal(np.asarray(kb_out), np.asarray(kb))


# ---------------------------------------------------------------------------------------------
# Errors


def test_errors_name_the_argument(rng):
    with pytest.raises(ValueError, match="sliding_windows"):
        TritonBackend(sliding_windows=(-2,))
    with pytest.raises(ValueError, match="max_kv_splits"):
        TritonBackend(max_kv_splits=0)
    with pytest.raises(ValueError, match="q_heads and kv_heads"):
        TritonBackend(q_heads=4)
    batch, req_to_token = make_batch(rng, [4], [1], mode=ForwardMode.DECODE, token_bucket=1, batch_bucket=1)
    q, k, v, kb, vb = random_inputs(rng, 1)
    backend = TritonBackend()
    meta = backend.init_forward_metadata(batch, req_to_token)
    with pytest.raises(ValueError, match="encoder_lens"):
        backend.forward(q, k, v, kb, vb, CROSS, meta)
    with pytest.raises(ValueError, match="meta must be a TritonMetadata"):
        backend.forward(q, k, v, kb, vb, FULL, ReferenceBackend().init_forward_metadata(batch, req_to_token))
    with pytest.raises(ValueError, match="speculative_num_steps"):
        draft_decode_metadata(req_to_token, batch.req_pool_indices, batch.seq_lens, speculative_num_steps=1, topk=1,
                              kv_capacity=8, q_heads=H, kv_heads=KVH)


CAPPED = AttentionLayer(5, H, KVH, D, logit_cap=5.0)
VERIFY_LAYERS = (FULL, CAPPED, WINDOWED, UNPREPARED, FEATURES)


@pytest.mark.parametrize("kind", BACKEND_KINDS)
def test_target_verify_with_draft_bits(rng, kind):
    """The tree as per-row bit masks (batch.draft_mask): full layers run the several-token decode kernel, window and
    xai layers the extend path with the bits expanded; all match the boolean-mask batch and ReferenceBackend."""
    from jaxattn.metadata import draft_mask_bits

    parents = [[-1, 0, 0, 1], [-1, -1, 1, 2], [-1, 0, 1, 2]]
    drafts, batch_bucket = 4, 4
    with_mask, req_to_token = make_batch(rng, [6, 2, 9], [4, 4, 4], mode=ForwardMode.TARGET_VERIFY,
                                         token_bucket=drafts * batch_bucket, batch_bucket=batch_bucket, parents=parents)
    bits = np.zeros((batch_bucket, drafts), np.int32)
    bits[:3] = np.asarray(draft_mask_bits(np.stack([tree_mask_for_verify(p, 0) for p in parents])))
    with_bits = dataclasses.replace(with_mask, custom_mask=None, draft_mask=jnp.asarray(bits))
    used = int(np.sum(np.asarray(with_mask.extend_lens) * np.asarray(with_mask.seq_lens)))
    np.testing.assert_array_equal(np.asarray(with_bits.verify_custom_mask())[:used], np.asarray(with_mask.custom_mask)[:used])
    inputs = random_inputs(rng, drafts * batch_bucket)
    backend = TritonBackend(sliding_windows=(WINDOW,), **kind)

    def step(backend, batch):
        meta = backend.init_forward_metadata(batch, req_to_token)
        return [backend.forward(*inputs, layer, meta)[0] for layer in VERIFY_LAYERS]

    meta = backend.init_forward_metadata(with_bits, req_to_token)
    assert [meta.takes_verify_decode(layer) for layer in VERIFY_LAYERS] == [True, True, False, False, False]
    got = jax.jit(lambda b: step(backend, b))(with_bits)
    want_mask = jax.jit(lambda b: step(backend, b))(with_mask)
    want_ref = jax.jit(lambda b: step(ReferenceBackend(), b))(with_bits)
    for layer, o, o_mask, o_ref in zip(VERIFY_LAYERS, got, want_mask, want_ref):
        np.testing.assert_allclose(np.asarray(o), np.asarray(o_mask), atol=3e-5, rtol=3e-5, err_msg=f"layer {layer}")
        np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=3e-5, rtol=3e-5, err_msg=f"layer {layer}")
        np.testing.assert_array_equal(np.asarray(o)[12:], 0)  # the padding sequence's rows


def test_draft_mask_batch_checks(rng):
    batch, _ = make_batch(rng, [6, 2], [4, 4], mode=ForwardMode.TARGET_VERIFY, token_bucket=8, batch_bucket=2,
                          parents=[[-1, 0, 0, 1], [-1, -1, 1, 2]])
    bits = jnp.zeros((2, 4), jnp.int32)
    with pytest.raises(ValueError, match="one of them"):
        dataclasses.replace(batch, draft_mask=bits)  # custom_mask and draft_mask both
    with pytest.raises(ValueError, match=r"out_cache_loc must have shape \(6,\)"):
        dataclasses.replace(batch, custom_mask=None, draft_mask=jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="draft_mask must have dtype"):
        dataclasses.replace(batch, custom_mask=None, draft_mask=jnp.zeros((2, 4), jnp.float32))
    with pytest.raises(ValueError, match="TARGET_VERIFY field"):
        dataclasses.replace(batch, custom_mask=None, draft_mask=bits, mode=ForwardMode.EXTEND)


# Latent (MLA) pools: v_pool None, V = the first 512 dims of each 576-wide K row (DeepSeek's cache). A full layer
# (decode, decode-route verify and plain extend take the latent paths) and a window layer (the extend ops on V sliced
# from the pool).
LATENT = AttentionLayer(5, 2, 1, 576, v_head_dim=512)
LATENT_WINDOW = AttentionLayer(6, 2, 1, 576, v_head_dim=512, sliding_window=WINDOW)


@pytest.mark.parametrize(
    "kind, mode",
    [
        pytest.param(dict(), ForwardMode.EXTEND, id="extend"),
        pytest.param(dict(deterministic=True), ForwardMode.EXTEND, id="extend-deterministic"),
        pytest.param(dict(), ForwardMode.DECODE, id="decode"),
        pytest.param(dict(), ForwardMode.TARGET_VERIFY, id="verify-draft-bits"),
    ],
)
def test_latent_pools_match_reference_and_separate_pools(rng, kind, mode):
    from jaxattn.metadata import draft_mask_bits

    if mode == ForwardMode.DECODE:
        batch, req_to_token = make_batch(rng, [7, 0, 12], [1, 1, 1], mode=mode, token_bucket=4)
    elif mode == ForwardMode.TARGET_VERIFY:
        parents = [[-1, 0, 0, 1], [-1, -1, 1, 2]]
        batch, req_to_token = make_batch(rng, [6, 2], [4, 4], mode=mode, token_bucket=12, batch_bucket=3,
                                         parents=parents)
        bits = np.zeros((3, 4), np.int32)
        bits[:2] = np.asarray(draft_mask_bits(np.stack([tree_mask_for_verify(p, 0) for p in parents])))
        batch = dataclasses.replace(batch, custom_mask=None, draft_mask=jnp.asarray(bits))
    else:
        batch, req_to_token = make_batch(rng, [0, 9, 2], [5, 3, 2], mode=mode, token_bucket=12)
    tokens = batch.out_cache_loc.shape[0]
    normal = lambda shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    q, k, k_pool = normal((tokens, 2, 576)), normal((tokens, 1, 576)), normal((NUM_SLOTS, 1, 576))
    sinks = normal((2,))

    def step(backend, latent):
        meta = backend.init_forward_metadata(batch, req_to_token)
        out = []
        for layer in (LATENT, LATENT_WINDOW):
            if latent:
                out.append(backend.forward(q, k, None, k_pool, None, layer, meta, sinks=sinks))
            else:  # the same layer on a separate V pool holding the latent rows' first 512 dims
                out.append(backend.forward(q, k, k[..., :512], k_pool, k_pool[..., :512], layer, meta, sinks=sinks))
        return out

    got = jax.jit(lambda: step(TritonBackend(sliding_windows=(WINDOW,), **kind), True))()
    want = jax.jit(lambda: step(ReferenceBackend(), True))()
    separate = jax.jit(lambda: step(ReferenceBackend(), False))()
    for layer, (o, kb, vb), (o_ref, kb_ref, vb_ref), (o_sep, _, _) in zip((LATENT, LATENT_WINDOW), got, want, separate):
        assert vb is None and vb_ref is None
        assert o.shape == (tokens, 2, 512)
        np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=3e-5, rtol=3e-5, err_msg=f"layer {layer}")
        np.testing.assert_allclose(np.asarray(o_ref), np.asarray(o_sep), atol=1e-6, rtol=1e-6, err_msg=f"layer {layer}")
        np.testing.assert_array_equal(np.asarray(kb)[1:], np.asarray(kb_ref)[1:])
        np.testing.assert_array_equal(np.asarray(kb)[np.asarray(batch.out_cache_loc)[: int(batch.extend_lens.sum())]],
                                      np.asarray(k)[: int(batch.extend_lens.sum())])


def test_latent_pool_argument_errors(rng):
    batch, req_to_token = make_batch(rng, [3], [1], mode=ForwardMode.DECODE, token_bucket=2, batch_bucket=2)
    backend = TritonBackend()
    meta = backend.init_forward_metadata(batch, req_to_token)
    q, k, pool = jnp.zeros((2, 2, 576)), jnp.zeros((2, 1, 576)), jnp.zeros((NUM_SLOTS, 1, 576))
    with pytest.raises(ValueError, match="v must be None with a latent pool"):
        backend.forward(q, k, k[..., :512], pool, None, LATENT, meta)


@pytest.mark.parametrize("backend_cls", [ReferenceBackend, TritonBackend])
def test_a_layer_marked_with_sinks_needs_them(rng, backend_cls):
    # AttentionLayer(has_sinks=True) without forward(sinks=) is refused (the sinks would silently be dropped); sinks on
    # a layer not marked are taken, as before the mark existed.
    batch, req_to_token = make_batch(rng, [3, 5], [2, 1], mode=ForwardMode.EXTEND, token_bucket=4)
    q, k, v, k_pool, v_pool = random_inputs(rng, 4)
    backend = backend_cls()
    meta = backend.init_forward_metadata(batch, req_to_token)
    marked = AttentionLayer(7, H, KVH, D, has_sinks=True)
    with pytest.raises(ValueError, match=r"layer 7 has sinks .*pass forward\(sinks=\)"):
        backend.forward(q, k, v, k_pool, v_pool, marked, meta)
    sinks = jnp.zeros((H,), jnp.float32)
    with_mark = backend.forward(q, k, v, k_pool, v_pool, marked, meta, sinks=sinks)[0]
    without = backend.forward(q, k, v, k_pool, v_pool, AttentionLayer(7, H, KVH, D), meta, sinks=sinks)[0]
    np.testing.assert_array_equal(np.asarray(with_mark), np.asarray(without))
