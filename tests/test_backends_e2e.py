"""End to end: a tiny multi-layer model served through a backend and the paged KV pool equals dense recomputation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.backends import ReferenceBackend
from jaxattn.batch import ForwardMode, tree_mask_for_verify
from jaxattn.kv_pool import allocate_kv_buffers
from jaxattn.serving import RequestTable, SlotAllocator
from jaxattn.toy_model import ToyConfig, dense_logits, forward, init_params

BACKENDS = [pytest.param(ReferenceBackend, id="reference")]
CONFIG = ToyConfig(layers=3, window_layers=(1,), sliding_window=4)
NUM_SLOTS, MAX_REQS, MAX_CTX = 96, 6, 32
BUCKETS = dict(kv_capacity=80, max_seq_len=32)


def new_state(rng, config=CONFIG):
    params = init_params(config, seed=int(rng.integers(1 << 30)))
    cache = [allocate_kv_buffers(NUM_SLOTS, config.kv_heads, config.head_dim, dtype=jnp.float32) for _ in range(config.layers)]
    table = RequestTable(MAX_REQS, MAX_CTX, SlotAllocator(NUM_SLOTS, seed=int(rng.integers(1 << 30))))
    return params, cache, table


def make_step(backend, params, count_traces=None, config=CONFIG):
    def step(cache, batch, req_to_token, token_ids):
        if count_traces is not None:
            count_traces.append(1)
        return forward(params, config, backend, batch, req_to_token, cache, token_ids)

    return jax.jit(step, donate_argnums=0)


def check_against_dense(params, logits, requests, counts, token_rows, atol=2e-4):
    for request, n, rows in zip(requests, counts, token_rows):
        if n == 0:
            continue
        want = dense_logits(params, CONFIG, jnp.asarray(request.tokens[: request.cached]))[-n:]
        np.testing.assert_allclose(logits[rows], want, atol=atol, rtol=atol)


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_prefill_extend_then_decode_equals_dense(rng, backend_cls):
    backend = backend_cls()
    params, cache, table = new_state(rng)
    prompts = [list(rng.integers(0, CONFIG.vocab, n)) for n in (9, 12, 3)]
    requests = [table.add(p) for p in prompts]
    traces = []
    step = make_step(backend, params, traces)

    def run(mode, counts, max_extend_len, token_bucket, batch_bucket=4):
        nonlocal cache
        batch, token_ids = table.schedule(requests, counts, mode=mode, batch_bucket=batch_bucket, token_bucket=token_bucket,
                                          max_extend_len=max_extend_len, **BUCKETS)
        logits, cache = step(cache, batch, jnp.asarray(table.req_to_token), token_ids)
        return np.asarray(logits)

    # Prefill part of each prompt, then extend over the cached prefix (one request adds nothing this step).
    counts = [5, 12, 3]
    logits = run(ForwardMode.EXTEND, counts, 16, 24)
    starts = np.cumsum([0] + counts)
    check_against_dense(params, logits, requests, counts, [slice(s, s + n) for s, n in zip(starts, counts)])
    counts = [4, 0, 0]
    logits = run(ForwardMode.EXTEND, counts, 16, 24)
    check_against_dense(params, logits, requests, counts, [slice(0, 4), slice(4, 4), slice(4, 4)])
    # Decode: greedy tokens, a padding row in the batch bucket, the window layer now trimming old keys.
    for _ in range(4):
        for b, request in enumerate(requests):
            request.tokens.append(int(np.argmax(last_logits[b])) if _ else int(rng.integers(CONFIG.vocab)))
        logits = run(ForwardMode.DECODE, [1, 1, 1], 1, 4)
        last_logits = logits
        check_against_dense(params, logits, requests, [1, 1, 1], [slice(b, b + 1) for b in range(3)])
    assert len(traces) == 2  # one compile for the extend bucket, one for the decode bucket


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_tree_verification_equals_sequential_decoding_of_each_path(rng, backend_cls):
    # Windowed layers are left out: verify masks index the draft list, while a window over a tree needs each
    # draft's depth (SGLang has the same limit; see README "Known limits").
    config = dataclasses.replace(CONFIG, window_layers=())
    backend = backend_cls()
    params, cache, table = new_state(rng, config)
    prompt = list(rng.integers(0, config.vocab, 7))
    request = table.add(prompt)
    step = make_step(backend, params, config=config)
    batch, token_ids = table.schedule([request], [7], mode=ForwardMode.EXTEND, batch_bucket=2, token_bucket=8,
                                      max_extend_len=8, **BUCKETS)
    _, cache = step(cache, batch, jnp.asarray(table.req_to_token), token_ids)
    # A draft tree: 0 and 1 follow the prompt; 2, 3 follow 0; 4 follows 3.
    parents = [-1, -1, 0, 0, 3]
    depth = [0, 0, 1, 1, 2]
    drafts = list(rng.integers(0, config.vocab, len(parents)))
    request.tokens += drafts
    batch, token_ids = table.schedule([request], [len(parents)], mode=ForwardMode.EXTEND, batch_bucket=2, token_bucket=8,
                                      max_extend_len=8, **BUCKETS)
    mask = tree_mask_for_verify(parents, len(prompt)).reshape(-1)
    mask = np.concatenate([mask, np.zeros(200 - mask.size, bool)])
    positions = np.array(batch.positions)
    positions[: len(parents)] = len(prompt) + np.asarray(depth)
    batch = dataclasses.replace(batch, mode=ForwardMode.TARGET_VERIFY, custom_mask=jnp.asarray(mask), positions=jnp.asarray(positions))
    logits, cache = step(cache, batch, jnp.asarray(table.req_to_token), token_ids)
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.insert(0, drafts[j])
            j = parents[j]
        want = dense_logits(params, config, jnp.asarray(prompt + path))[-1]
        np.testing.assert_allclose(np.asarray(logits)[i], want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_donated_pool_is_updated_in_place_and_only_at_the_written_slots(rng, backend_cls):
    backend = backend_cls()
    params, cache, table = new_state(rng)
    cache = [(jnp.asarray(rng.standard_normal(k.shape), k.dtype), jnp.asarray(rng.standard_normal(v.shape), v.dtype)) for k, v in cache]
    before = [(np.array(k), np.array(v)) for k, v in cache]  # copies: a numpy view would pin the buffer and block donation
    request = table.add(list(rng.integers(0, CONFIG.vocab, 5)))
    batch, token_ids = table.schedule([request], [5], mode=ForwardMode.EXTEND, batch_bucket=2, token_bucket=8,
                                      max_extend_len=8, **BUCKETS)
    step = make_step(backend, params)
    old_k = cache[0][0]
    _, new_cache = step(cache, batch, jnp.asarray(table.req_to_token), token_ids)
    assert old_k.is_deleted()  # donated: the step reused its buffer
    written = np.asarray(batch.out_cache_loc)
    written = np.unique(written)  # includes the padding slot 0 (padding tokens land there)
    for (k0, v0), (k1, v1) in zip(before, new_cache):
        untouched = np.setdiff1d(np.arange(NUM_SLOTS), written)
        np.testing.assert_array_equal(np.asarray(k1)[untouched], k0[untouched])
        np.testing.assert_array_equal(np.asarray(v1)[untouched], v0[untouched])
        assert not np.allclose(np.asarray(k1)[written[written != 0]], k0[written[written != 0]])
