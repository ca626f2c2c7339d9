"""Serve a small Llama-style model through jaxattn: paged KV pool, prefix reuse, continuous batching.

    python examples/serve.py                       # CPU: the reference backend
    python examples/serve.py --backend triton      # GPU: Triton kernels (CPU: Triton's interpreter, slow)
    python examples/serve.py --backend flashinfer  # GPU with flashinfer installed
    python examples/serve.py --page-size 16        # KV pages of 16 slots (jaxattn.paging; prefix hits share whole pages)

What happens: requests arrive with prompts, some sharing a system prompt. A prefill (EXTEND) step writes
their K/V into the pool and reuses the cached system-prompt slots of an earlier request (a prefix-cache hit:
only the suffix is computed; the loop is examples/batching.py's). DECODE steps then generate greedily for every running request under one jitted
step function (compiled once per bucket). When a request finishes, its slots return to the pool and a
waiting request joins. At the end every generated token's logits are checked against dense recomputation of
the whole sequence, and a table shows throughput and per-phase time.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from batching import Buckets, Job, Progress, make_backend, print_rows, run_jobs
from jaxattn.kv_pool import allocate_kv_buffers
from jaxattn.paging import PAGE_SIZES
from jaxattn.serving import RequestTable, SlotAllocator
from toy_model import ToyConfig, dense_logits, forward, init_params

CONFIG = ToyConfig(vocab=256, hidden=128, layers=4, q_heads=8, kv_heads=2, head_dim=32, window_layers=(1, 3), sliding_window=24)
NUM_SLOTS, MAX_REQS, MAX_CTX = 4096, 16, 256
BUCKETS = Buckets(extend_batch=4, extend_tokens=128, max_extend_len=64, decode_batch=8, kv_capacity=8 * MAX_CTX, max_seq_len=MAX_CTX)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None, choices=["reference", "triton", "flashinfer"],
                        help="default: triton on a GPU, reference on CPU")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--page-size", type=int, default=1, choices=PAGE_SIZES,
                        help="KV page size: requests own whole pages; a prefix hit shares the whole pages of the prefix")
    parser.add_argument("--deterministic", action="store_true",
                        help="batch-invariant attention (the triton and flashinfer backends' deterministic modes)")
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() in ("gpu", "cuda")
    backend_name = args.backend or ("triton" if on_gpu else "reference")
    backend = make_backend(backend_name, sliding_windows=(CONFIG.sliding_window,),  # trimmed lists for the window layers
                           deterministic=args.deterministic)
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    config = dataclasses.replace(CONFIG, dtype=jnp.dtype(dtype).name)
    rng = np.random.default_rng(args.seed)
    params = init_params(config, seed=args.seed)
    cache = [allocate_kv_buffers(NUM_SLOTS, config.kv_heads, config.head_dim, dtype=dtype) for _ in range(config.layers)]
    table = RequestTable(MAX_REQS, MAX_CTX, SlotAllocator(NUM_SLOTS, seed=args.seed, page_size=args.page_size))

    def kv_table():
        """What the backends read the pool through: req_to_token (page size 1) or the page table."""
        return jnp.asarray(table.req_to_token) if args.page_size == 1 else table.page_table()

    system_prompt = list(rng.integers(0, config.vocab, 40))
    jobs = []
    for i in range(args.requests):
        shares = i % 2 == 0
        user = list(rng.integers(0, config.vocab, int(rng.integers(6, 24))))
        jobs.append(Job(system_prompt + user if shares else user + list(rng.integers(0, config.vocab, 20)),
                        max_new=int(rng.integers(4, 14)), shares_system_prompt=shares))

    step = jax.jit(lambda cache, batch, req_to_token, token_ids: forward(params, config, backend, batch, req_to_token, cache, token_ids),
                   donate_argnums=0)
    planned_step = jax.jit(lambda cache, batch, meta, token_ids: forward(params, config, backend, batch, None, cache, token_ids, meta=meta),
                           donate_argnums=0)

    def run_step(batch, token_ids, rows):
        nonlocal cache
        if backend_name == "flashinfer":  # the plan is host work before the jitted step
            layers = [config.attention_layer(i) for i in range(config.layers)]
            meta = backend.plan(batch, table.req_to_token if args.page_size == 1 else table.page_table(), layers,
                                q_dtype=dtype, kv_dtype=dtype, num_slots=NUM_SLOTS)
            logits, cache = planned_step(cache, batch, meta, token_ids)
        else:
            logits, cache = step(cache, batch, kv_table(), token_ids)
        logits = np.asarray(logits.astype(jnp.float32))[rows]
        return np.argmax(logits, axis=-1), logits

    progress = Progress(total=sum(j.max_new for j in jobs))
    stats = run_jobs(jobs, table, run_step, BUCKETS, system_prompt=system_prompt, progress=progress)
    progress.close()

    # Check: the logits of every generated token equal dense recomputation of the whole sequence.
    worst = 0.0
    for job in stats.finished:
        tokens = job.prompt + job.generated[:-1]
        dense = np.asarray(dense_logits(params, config, jnp.asarray(tokens)).astype(jnp.float32))
        got = np.stack(job.logits)
        want = dense[len(job.prompt) - 1 :]
        worst = max(worst, float(np.max(np.abs(got - want))))
    tolerance = 5e-2 if dtype == jnp.bfloat16 else 1e-3
    generated = sum(len(j.generated) for j in stats.finished)
    _report(backend_name, jax.default_backend(), config, stats.counts, stats.times, generated, worst, tolerance)
    if not worst <= tolerance:
        raise SystemExit(f"serve: paged logits differ from dense recomputation by {worst:.3g} (> {tolerance})")
    return 0


def _report(backend_name, platform, config, counts, times, generated, worst, tolerance):
    print_rows([
        ("backend", f"{backend_name} on {platform}"),
        ("model", f"{config.layers} layers, {config.q_heads}/{config.kv_heads} heads x {config.head_dim}, window {config.sliding_window} on layers {list(config.window_layers)}, {config.dtype}"),
        ("prefill steps", f"{counts['extend']}: {counts['prefill_tokens']} tokens computed, {counts['reused_tokens']} reused from the prefix cache"),
        ("decode steps", f"{counts['decode']}: {counts['decode_tokens']} tokens"),
        ("time in prefill", f"{times['extend']:.3f} s (compile included)"),
        ("time in decode", f"{times['decode']:.3f} s ({counts['decode_tokens'] / max(times['decode'], 1e-9):.1f} tok/s, compile included)"),
        ("generated tokens", str(generated)),
        ("max |paged - dense| logits", f"{worst:.2e} (tolerance {tolerance:g})"),
    ])


if __name__ == "__main__":
    raise SystemExit(main())
