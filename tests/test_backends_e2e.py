"""End to end: a tiny multi-layer model served through a backend and the paged KV pool equals dense recomputation."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.backends import ReferenceBackend
from jaxattn.batch import ForwardMode, tree_mask_for_verify
from jaxattn.kv_pool import allocate_kv_buffers
from jaxattn.serving import RequestTable, SlotAllocator, move_kv
from examples.toy_model import ToyConfig, dense_logits, forward, init_params
from jaxattn.triton_backend import TritonBackend

CONFIG = ToyConfig(layers=3, window_layers=(1,), sliding_window=4)
BACKENDS = [
    pytest.param(ReferenceBackend, id="reference"),
    # Interpreted Triton kernels on CPU: the window layer gets its own trimmed lists.
    pytest.param(functools.partial(TritonBackend, sliding_windows=(CONFIG.sliding_window,)), id="triton"),
    pytest.param(functools.partial(TritonBackend, deterministic=True, sliding_windows=(CONFIG.sliding_window,)), id="triton-deterministic"),
]
NUM_SLOTS, MAX_REQS, MAX_CTX = 96, 6, 32
BUCKETS = dict(kv_capacity=80, max_seq_len=32)


def new_state(rng, config=CONFIG, page_size=1):
    params = init_params(config, seed=int(rng.integers(1 << 30)))
    cache = [allocate_kv_buffers(NUM_SLOTS, config.kv_heads, config.head_dim, dtype=jnp.float32) for _ in range(config.layers)]
    table = RequestTable(MAX_REQS, MAX_CTX, SlotAllocator(NUM_SLOTS, seed=int(rng.integers(1 << 30)), page_size=page_size))
    return params, cache, table


def make_step(backend, params, count_traces=None, config=CONFIG):
    def step(cache, batch, req_to_token, token_ids):
        if count_traces is not None:
            count_traces.append(1)
        return forward(params, config, backend, batch, req_to_token, cache, token_ids)

    return jax.jit(step, donate_argnums=0)


@functools.partial(jax.jit, static_argnums=1)
def _dense_logits_padded(params, config, token_ids):
    return dense_logits(params, config, token_ids)


def dense_prefix_logits(params, config, tokens):
    """dense_logits of `tokens`, computed on the sequence padded to MAX_CTX: one compile for every length
    (dense attention is causal, so the padding after the sequence changes nothing before it)."""
    padded = np.zeros(MAX_CTX, np.int32)
    padded[: len(tokens)] = tokens
    return _dense_logits_padded(params, config, jnp.asarray(padded))[: len(tokens)]


def check_against_dense(params, logits, requests, counts, token_rows, atol=2e-4):
    for request, n, rows in zip(requests, counts, token_rows):
        if n == 0:
            continue
        want = dense_prefix_logits(params, CONFIG, request.tokens[: request.cached])[-n:]
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
        want = dense_prefix_logits(params, config, prompt + path)[-1]
        np.testing.assert_allclose(np.asarray(logits)[i], want, atol=2e-4, rtol=2e-4)


def greedy_decoding_setup(rng, backend_cls, new_tokens, page_size=1):
    """(config, params, cache, table, step, prompt, greedy) for the speculative tests: the toy model without window
    layers (verify masks index the drafts), a 6-token prompt and its greedy continuation by dense recomputation."""
    config = dataclasses.replace(CONFIG, window_layers=())
    params, cache, table = new_state(rng, config, page_size)
    step = make_step(backend_cls(), params, config=config)
    prompt = list(rng.integers(0, config.vocab, 6))
    greedy = list(prompt)
    for _ in range(new_tokens):
        greedy.append(int(np.argmax(dense_prefix_logits(params, config, greedy)[-1])))
    return config, params, cache, table, step, prompt, greedy


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_speculative_decoding_with_rewound_drafts_equals_greedy_decoding(rng, backend_cls):
    # Greedy speculative decoding: each round verifies the current token and 3 drafts (a chain, as a TARGET_VERIFY
    # step), keeps the drafts the target agrees with plus its next token, and gives the rejected drafts' slots back
    # with RequestTable.rewind. The tokens must be plain greedy decoding's, and the slots reused after a rewind
    # (overwritten by later tokens) must not leak into any later step.
    config, params, cache, table, step, prompt, greedy = greedy_decoding_setup(rng, backend_cls, new_tokens=10)
    k = 3
    free_at_start = table.allocator.available
    request = table.add(prompt)
    batch, token_ids = table.schedule([request], [len(prompt)], mode=ForwardMode.EXTEND, batch_bucket=2, token_bucket=8,
                                      max_extend_len=8, **BUCKETS)
    logits, cache = step(cache, batch, jnp.asarray(table.req_to_token), token_ids)
    request.tokens.append(int(np.argmax(np.asarray(logits)[len(prompt) - 1])))  # the current token: not cached yet
    rejected_total = 0
    while len(request.tokens) < len(greedy):
        cached = request.cached
        # Drafts: the greedy continuation, each wrong with probability 0.4 (a draft model's guesses).
        truth = greedy[len(request.tokens) : len(request.tokens) + k] + [0] * k
        drafts = [t if rng.random() < 0.6 else (t + 1) % config.vocab for t in truth[:k]]
        request.tokens += drafts
        batch, token_ids = table.schedule([request], [1 + k], mode=ForwardMode.EXTEND, batch_bucket=2, token_bucket=8,
                                          max_extend_len=8, **BUCKETS)
        mask = tree_mask_for_verify(list(range(-1, k)), cached).reshape(-1)
        mask = np.concatenate([mask, np.zeros(200 - mask.size, bool)])
        batch = dataclasses.replace(batch, mode=ForwardMode.TARGET_VERIFY, custom_mask=jnp.asarray(mask))
        logits, cache = step(cache, batch, jnp.asarray(table.req_to_token), token_ids)
        predicted = np.argmax(np.asarray(logits)[: 1 + k], axis=-1).tolist()  # row i: the token after row i
        accepted = 0
        while accepted < k and drafts[accepted] == predicted[accepted]:
            accepted += 1
        rejected_total += k - accepted
        assert table.rewind(request, cached + 1 + accepted) == cached + 1 + accepted
        del request.tokens[cached + 1 + accepted :]
        request.tokens.append(predicted[accepted])  # the target's own next token: the new current token
    assert request.tokens[: len(greedy)] == greedy
    assert rejected_total > 0  # rewinds happened (the draws above make some drafts wrong)
    table.finish(request)
    assert table.allocator.available == free_at_start


@pytest.mark.parametrize("page_size", [1, 8])
@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_a_tree_verify_step_keeps_the_accepted_branch_and_decoding_goes_on_from_it(rng, backend_cls, page_size):
    # Verify rows: the current token and a draft tree of two branches, cur -> (wrong, g1) -> (x, g2), where g1, g2
    # are greedy's next tokens: the accepted path is rows 0, 2, 4, not a prefix of the verify order. At page size 1
    # accept_drafts keeps their slots (their K/V were written at their depths' positions) and frees the others; with
    # pages accept_drafts_by_copy names the K/V copies into positions first + 1, first + 2 (move_kv in every layer).
    # Decoding from the bonus token must give greedy decoding's tokens.
    config, params, cache, table, step, prompt, greedy = greedy_decoding_setup(rng, backend_cls, new_tokens=6,
                                                                               page_size=page_size)
    free_at_start = table.allocator.available
    request = table.add(prompt)
    schedule = functools.partial(table.schedule, batch_bucket=2, token_bucket=8, max_extend_len=8, **BUCKETS)
    batch, token_ids = schedule([request], [len(prompt)], mode=ForwardMode.EXTEND)
    logits, cache = step(cache, batch, jnp.asarray(table.req_to_token), token_ids)
    cur, g1, g2 = int(np.argmax(np.asarray(logits)[len(prompt) - 1])), greedy[7], greedy[8]
    assert cur == greedy[6]
    parents, depth = [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2]
    request.tokens += [cur, (g1 + 1) % config.vocab, g1, int(rng.integers(config.vocab)), g2]
    first = request.cached
    batch, token_ids = schedule([request], [len(parents)], mode=ForwardMode.EXTEND)
    mask = tree_mask_for_verify(parents, first).reshape(-1)
    positions = np.array(batch.positions)
    positions[: len(parents)] = first + np.asarray(depth)
    batch = dataclasses.replace(batch, mode=ForwardMode.TARGET_VERIFY, positions=jnp.asarray(positions),
                                custom_mask=jnp.asarray(np.concatenate([mask, np.zeros(200 - mask.size, bool)])))
    logits, cache = step(cache, batch, jnp.asarray(table.req_to_token), token_ids)
    predicted = np.argmax(np.asarray(logits)[: len(parents)], axis=-1).tolist()
    path = [0]
    while True:  # follow the child whose token the target predicts
        children = [i for i, p in enumerate(parents) if p == path[-1] and request.tokens[first + i] == predicted[path[-1]]]
        if not children:
            break
        path.append(children[0])
    assert path == [0, 2, 4]
    slots = table.req_to_token[request.row, first : first + len(parents)].tolist()
    if page_size == 1:
        assert table.accept_drafts(request, first, path) == first + 3 == request.cached
        assert table.req_to_token[request.row, first : first + 3].tolist() == [slots[i] for i in path]
        assert {slots[1], slots[3]} <= set(table.allocator._free)
    else:
        src, dst = table.accept_drafts_by_copy(request, first, path)
        assert request.cached == first + 3 and (src.tolist(), dst.tolist()) == ([slots[2], slots[4]], slots[1:3])
        cache = jax.jit(lambda c, s, d: [move_kv(k, v, s, d) for k, v in c], donate_argnums=0)(
            cache, jnp.asarray(np.pad(src, (0, 2))), jnp.asarray(np.pad(dst, (0, 2))))  # a padded bucket of 4 moves
        assert table.req_to_token[request.row, first : first + 3].tolist() == slots[:3]
    assert not table.req_to_token[request.row, first + 3 :].any()
    request.tokens[first:] = [cur, g1, g2, predicted[4]]  # the accepted path, then the target's bonus token
    for _ in range(2):
        batch, token_ids = schedule([request], [1], mode=ForwardMode.DECODE, token_bucket=2)
        logits, cache = step(cache, batch, jnp.asarray(table.req_to_token), token_ids)
        want = dense_prefix_logits(params, config, request.tokens[: request.cached])[-1]
        np.testing.assert_allclose(np.asarray(logits)[0], want, atol=2e-4, rtol=2e-4)  # the kept K/V, not only argmax
        request.tokens.append(int(np.argmax(np.asarray(logits)[0])))
    assert request.tokens == greedy[: len(request.tokens)] and len(request.tokens) == len(greedy)
    table.finish(request)
    assert table.allocator.available == free_at_start


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


def test_deterministic_triton_is_bitwise_invariant_to_the_prefix_split(rng):
    # Three requests with the same 14 tokens, prefilled in different chunks (14; 5 + 9; 11 + 3, i.e. a cached
    # prefix of 5 or 11): the unified kernel makes every token's logits bit-identical, window layer included.
    # The two-stage kernel gives the same logits within float tolerance.
    params, _, _ = new_state(rng)
    tokens = list(rng.integers(0, CONFIG.vocab, 14))
    chunks = [(14,), (5, 9), (11, 3)]
    logits = {}
    for deterministic in (True, False):
        backend = TritonBackend(deterministic=deterministic, sliding_windows=(CONFIG.sliding_window,))
        _, cache, table = new_state(np.random.default_rng(0))
        requests = [table.add(tokens) for _ in chunks]
        step = make_step(backend, params)
        rows = [[] for _ in chunks]
        for s in range(2):
            counts = [c[s] if s < len(c) else 0 for c in chunks]
            batch, token_ids = table.schedule(requests, counts, mode=ForwardMode.EXTEND, batch_bucket=4, token_bucket=32,
                                              max_extend_len=16, **BUCKETS)
            out, cache = step(cache, batch, jnp.asarray(table.req_to_token), token_ids)
            starts = np.cumsum([0] + counts)
            for r, (start, n) in enumerate(zip(starts, counts)):
                rows[r].append(np.asarray(out)[start : start + n])
        logits[deterministic] = [np.concatenate(r) for r in rows]
    for r in (1, 2):
        np.testing.assert_array_equal(logits[True][r], logits[True][0])
    np.testing.assert_allclose(logits[False][1], logits[True][0], atol=2e-4, rtol=2e-4)
    want = dense_prefix_logits(params, CONFIG, tokens)
    np.testing.assert_allclose(logits[True][0], want, atol=2e-4, rtol=2e-4)
