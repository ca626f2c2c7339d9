"""Greedy speculative decoding with a draft tree, through jaxattn's verify step and the request table.

    python examples/speculative.py                     # CPU: the reference backend
    python examples/speculative.py --backend triton    # GPU: Triton / Hopper kernels (CPU: Triton's interpreter, slow)
    python examples/speculative.py --page-size 16      # KV pages: the accepted branch's K/V is copied (move_kv)

What happens, each round: a draft model (here the target's weights plus noise, run densely: a stand-in for a small
model) proposes a tree of two branches of depth `--depth` after the current token; one TARGET_VERIFY step writes
every tree token's K/V and scores them all under the tree mask, each token at its depth's position; the longest
branch the target agrees with is accepted, plus the target's own next token. At page size 1
`RequestTable.accept_drafts` keeps the accepted tokens' slots as their new positions; with pages a slot cannot change
position, so `accept_drafts_by_copy` names the K/V copies and `move_kv` makes them in every layer. The rejected
tokens' slots go back to the pool. At the end the tokens must equal plain greedy decoding of the target, and every
slot must be back in the pool.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from batching import make_backend, print_rows
from jaxattn.kv_pool import allocate_kv_buffers
from jaxattn.paging import PAGE_SIZES
from jaxattn.serving import ForwardMode, RequestTable, SlotAllocator, move_kv, tree_mask_for_verify
from toy_model import ToyConfig, dense_logits, forward, init_params

CONFIG = ToyConfig(vocab=128, hidden=64, layers=3, q_heads=4, kv_heads=2, head_dim=32)
NUM_SLOTS, MAX_CTX, PROMPT_LEN = 1024, 128, 12
BRANCHES = 2  # the tree: two branches from the current token (the draft's top two), each a chain of --depth tokens


def draft_tree(depth: int):
    """(parents, depths) of the verify rows: row 0 the current token, then branch b's tokens at rows 1 + b + 2 * j
    (breadth first, so each row's parent comes before it)."""
    parents, depths = [-1], [0]
    for j in range(depth):
        for b in range(BRANCHES):
            parents.append(0 if j == 0 else 1 + b + BRANCHES * (j - 1))
            depths.append(j + 1)
    return parents, depths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None, choices=["reference", "triton"],
                        help="default: triton on a GPU, reference on CPU")
    parser.add_argument("--page-size", type=int, default=1, choices=PAGE_SIZES)
    parser.add_argument("--depth", type=int, default=3, help="draft tokens on each branch")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--draft-noise", type=float, default=0.4, help="the draft model's weight noise (more: fewer accepted)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() in ("gpu", "cuda")
    backend_name = args.backend or ("triton" if on_gpu else "reference")
    backend = make_backend(backend_name)
    config = CONFIG
    rng = np.random.default_rng(args.seed)
    params = init_params(config, seed=args.seed)
    noise = jax.random.split(jax.random.key(args.seed + 1), len(jax.tree.leaves(params)))
    draft_params = jax.tree.unflatten(jax.tree.structure(params), [
        w + args.draft_noise * jnp.std(w) * jax.random.normal(key, w.shape, w.dtype)
        for w, key in zip(jax.tree.leaves(params), noise)])
    # float32 everywhere (the toy's default), so the verify logits and plain greedy decoding agree on every argmax.
    cache = [allocate_kv_buffers(NUM_SLOTS, config.kv_heads, config.head_dim, dtype=jnp.dtype(config.dtype))
             for _ in range(config.layers)]
    table = RequestTable(4, MAX_CTX, SlotAllocator(NUM_SLOTS, seed=args.seed, page_size=args.page_size))
    free_at_start = table.allocator.available_pages
    if args.depth < 1:
        raise SystemExit(f"speculative: --depth must be >= 1; got {args.depth}")
    parents, depths = draft_tree(args.depth)
    rows = len(parents)
    if PROMPT_LEN + args.new_tokens + rows > MAX_CTX:
        raise SystemExit(f"speculative: the prompt ({PROMPT_LEN}), --new-tokens and a tree of {rows} rows must fit "
                         f"{MAX_CTX} positions")
    mask_bucket = rows * MAX_CTX  # static length of the flattened tree mask (rows x keys of one request)
    buckets = dict(batch_bucket=2, token_bucket=max(32, rows), max_extend_len=max(32, rows), kv_capacity=2 * MAX_CTX,
                   max_seq_len=MAX_CTX)

    step = jax.jit(lambda cache, batch, table, token_ids: forward(params, config, backend, batch, table, cache, token_ids),
                   donate_argnums=0)
    move_bucket = BRANCHES * args.depth + 1
    pad = lambda slots: jnp.asarray(np.pad(slots, (0, move_bucket - slots.size)))  # noqa: E731  (slot 0 onto slot 0)
    move = jax.jit(lambda cache, src, dst: [move_kv(k, v, src, dst) for k, v in cache], donate_argnums=0)
    dense = jax.jit(dense_logits, static_argnums=1)

    def kv_table():
        return jnp.asarray(table.req_to_token) if args.page_size == 1 else table.page_table()

    def next_tokens(weights, tokens, k=1):
        """The k most likely next tokens after `tokens` under `weights` (dense, no cache: the draft's stand-in)."""
        padded = np.zeros(MAX_CTX, np.int32)
        padded[: len(tokens)] = tokens
        logits = np.asarray(dense(weights, config, jnp.asarray(padded)))[len(tokens) - 1]
        return np.argsort(-logits)[:k].tolist()

    prompt = rng.integers(0, config.vocab, PROMPT_LEN).tolist()
    greedy = list(prompt)
    for _ in range(args.new_tokens):
        greedy += next_tokens(params, greedy)

    began = time.perf_counter()
    request = table.add(prompt)
    batch, token_ids = table.schedule([request], [len(prompt)], mode=ForwardMode.EXTEND, **buckets)
    logits, cache = step(cache, batch, kv_table(), token_ids)
    request.tokens.append(int(np.argmax(np.asarray(logits)[len(prompt) - 1])))  # the current token: not cached yet
    verify_steps = accepted_drafts = copies = 0
    while len(request.tokens) < len(greedy):
        first = request.cached
        tree = [request.tokens[-1]] + [0] * (rows - 1)
        for b, token in enumerate(next_tokens(draft_params, request.tokens, BRANCHES)):  # each branch: a greedy chain
            branch = [token]
            for _ in range(args.depth - 1):
                branch += next_tokens(draft_params, request.tokens + branch)
            for j, t in enumerate(branch):
                tree[1 + b + BRANCHES * j] = t
        request.tokens[first:] = tree
        batch, token_ids = table.schedule([request], [rows], mode=ForwardMode.EXTEND, **buckets)
        mask = tree_mask_for_verify(parents, first).reshape(-1)
        positions = np.array(batch.positions)
        positions[:rows] = first + np.asarray(depths)  # each tree token at its depth's position
        batch = dataclasses.replace(batch, mode=ForwardMode.TARGET_VERIFY, positions=jnp.asarray(positions),
                                    custom_mask=jnp.asarray(np.pad(mask, (0, mask_bucket - mask.size))))
        logits, cache = step(cache, batch, kv_table(), token_ids)
        predicted = np.argmax(np.asarray(logits)[:rows], axis=-1).tolist()  # row i: the target's token after row i
        path = [0]
        while True:  # follow the child whose token the target predicts
            children = [i for i, p in enumerate(parents) if p == path[-1] and tree[i] == predicted[path[-1]]]
            if not children:
                break
            path.append(children[0])
        if args.page_size == 1:
            table.accept_drafts(request, first, path)
        else:
            src, dst = table.accept_drafts_by_copy(request, first, path)
            cache = move(cache, pad(src), pad(dst))
            copies += src.size
        request.tokens[first:] = [tree[i] for i in path] + [predicted[path[-1]]]  # then the target's bonus token
        verify_steps += 1
        accepted_drafts += len(path) - 1
    seconds = time.perf_counter() - began
    generated = len(request.tokens) - len(prompt)
    ok = request.tokens[: len(greedy)] == greedy
    table.finish(request)
    back = table.allocator.available_pages == free_at_start
    print_rows([
        ("backend", f"{backend_name} on {jax.default_backend()}, page size {args.page_size}"),
        ("draft tree", f"{BRANCHES} branches x {args.depth} tokens, {rows} verify rows a step"),
        ("verify steps", f"{verify_steps}: {generated} tokens ({generated / max(verify_steps, 1):.2f} a step), "
                         f"{accepted_drafts} drafts accepted"),
        ("K/V copies", f"{copies} (accepted tokens off the first branch, page size > 1)"),
        ("time", f"{seconds:.2f} s (compile included)"),
        ("tokens equal greedy decoding", str(ok)),
        ("every slot back in the pool", str(back)),
    ])
    if not (ok and back):
        raise SystemExit("speculative: the tokens differ from greedy decoding or slots leaked")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
