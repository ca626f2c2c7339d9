"""Serve a small Llama-style model through jaxattn: paged KV pool, prefix reuse, continuous batching.

    python examples/serve.py                       # CPU: the reference backend
    python examples/serve.py --backend triton      # GPU: Triton kernels (CPU: Triton's interpreter, slow)
    python examples/serve.py --backend flashinfer  # GPU with flashinfer installed

What happens: requests arrive with prompts, some sharing a system prompt. A prefill (EXTEND) step writes
their K/V into the pool and reuses the cached system-prompt slots of an earlier request (a prefix-cache hit:
only the suffix is computed). DECODE steps then generate greedily for every running request under one jitted
step function (compiled once per bucket). When a request finishes, its slots return to the pool and a
waiting request joins. At the end every generated token's logits are checked against dense recomputation of
the whole sequence, and a table shows throughput and per-phase time.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.backends import ReferenceBackend
from jaxattn.batch import ForwardMode
from jaxattn.kv_pool import allocate_kv_buffers
from jaxattn.serving import RequestTable, SlotAllocator
from toy_model import ToyConfig, dense_logits, forward, init_params

CONFIG = ToyConfig(vocab=256, hidden=128, layers=4, q_heads=8, kv_heads=2, head_dim=32, window_layers=(1, 3), sliding_window=24)
NUM_SLOTS, MAX_REQS, MAX_CTX = 4096, 16, 256
EXTEND_BUCKET = dict(batch_bucket=4, token_bucket=128, max_extend_len=64)
DECODE_BUCKET = dict(batch_bucket=8, token_bucket=8, max_extend_len=1)
KV_BUCKET = dict(kv_capacity=8 * MAX_CTX, max_seq_len=MAX_CTX)


@dataclasses.dataclass
class Job:
    prompt: list[int]
    max_new: int
    shares_system_prompt: bool
    generated: list[int] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    request: object = None


def make_backend(name: str):
    if name == "reference":
        return ReferenceBackend()
    if name == "triton":
        from jaxattn.triton_backend import TritonBackend

        return TritonBackend(sliding_windows=(CONFIG.sliding_window,))  # trimmed lists for the window layers
    if name == "flashinfer":
        from jaxattn.flashinfer_backend import FlashInferBackend

        return FlashInferBackend()
    raise SystemExit(f"unknown backend {name!r}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None, choices=["reference", "triton", "flashinfer"],
                        help="default: triton on a GPU, reference on CPU")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() in ("gpu", "cuda")
    backend_name = args.backend or ("triton" if on_gpu else "reference")
    backend = make_backend(backend_name)
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    config = dataclasses.replace(CONFIG, dtype=jnp.dtype(dtype).name)
    rng = np.random.default_rng(args.seed)
    params = init_params(config, seed=args.seed)
    cache = [allocate_kv_buffers(NUM_SLOTS, config.kv_heads, config.head_dim, dtype=dtype) for _ in range(config.layers)]
    table = RequestTable(MAX_REQS, MAX_CTX, SlotAllocator(NUM_SLOTS, seed=args.seed))

    system_prompt = list(rng.integers(0, config.vocab, 40))
    waiting = []
    for i in range(args.requests):
        shares = i % 2 == 0
        user = list(rng.integers(0, config.vocab, int(rng.integers(6, 24))))
        waiting.append(Job(system_prompt + user if shares else user + list(rng.integers(0, config.vocab, 20)),
                           max_new=int(rng.integers(4, 14)), shares_system_prompt=shares))
    running: list[Job] = []
    finished: list[Job] = []

    step = jax.jit(lambda cache, batch, req_to_token, token_ids: forward(params, config, backend, batch, req_to_token, cache, token_ids),
                   donate_argnums=0)
    planned_step = jax.jit(lambda cache, batch, meta, token_ids: forward(params, config, backend, batch, None, cache, token_ids, meta=meta),
                           donate_argnums=0)
    times = {"extend": 0.0, "decode": 0.0}
    counts = {"extend": 0, "decode": 0, "prefill_tokens": 0, "reused_tokens": 0, "decode_tokens": 0}

    def run_step(batch, token_ids):
        nonlocal cache
        if backend_name == "flashinfer":  # the plan is host work before the jitted step
            layers = [config.attention_layer(i) for i in range(config.layers)]
            meta = backend.plan(batch, table.req_to_token, layers, q_dtype=dtype, kv_dtype=dtype)
            logits, cache = planned_step(cache, batch, meta, token_ids)
        else:
            logits, cache = step(cache, batch, jnp.asarray(table.req_to_token), token_ids)
        return np.asarray(logits.astype(jnp.float32))

    # The radix cache's part: the system prompt is prefilled once and its slots stay cached for reuse.
    system_owner = Job(system_prompt, max_new=0, shares_system_prompt=False)
    system_owner.request = table.add(system_prompt)
    batch, token_ids = table.schedule([system_owner.request], [len(system_prompt)], mode=ForwardMode.EXTEND, **EXTEND_BUCKET, **KV_BUCKET)
    t0 = time.perf_counter()
    run_step(batch, token_ids)
    times["extend"] += time.perf_counter() - t0
    counts["extend"] += 1
    counts["prefill_tokens"] += len(system_prompt)

    progress = _Progress(total=sum(j.max_new for j in waiting))
    while waiting or running:
        # Admit waiting jobs while there is room: a prefill step for them.
        admitted = []
        while waiting and len(running) + len(admitted) < DECODE_BUCKET["batch_bucket"] and len(admitted) < EXTEND_BUCKET["batch_bucket"]:
            admitted.append(waiting.pop(0))
        if admitted:
            new_counts = []
            for job in admitted:
                reuse = job.shares_system_prompt
                job.request = table.add(job.prompt, shared_prefix_from=system_owner.request if reuse else None,
                                        shared_len=len(system_prompt) if reuse else 0)
                new_counts.append(len(job.prompt) - job.request.cached)
                counts["reused_tokens"] += job.request.cached
            batch, token_ids = table.schedule([j.request for j in admitted], new_counts, mode=ForwardMode.EXTEND, **EXTEND_BUCKET, **KV_BUCKET)
            t0 = time.perf_counter()
            logits = run_step(batch, token_ids)
            times["extend"] += time.perf_counter() - t0
            counts["extend"] += 1
            counts["prefill_tokens"] += sum(new_counts)
            ends = np.cumsum(new_counts) - 1
            for job, end in zip(admitted, ends):
                job.logits.append(logits[end])
                job.generated.append(int(np.argmax(logits[end])))
                job.request.tokens.append(job.generated[-1])
            running += admitted
            progress.advance(len(admitted))
        # One decode step for everyone running.
        live = [j for j in running if len(j.generated) < j.max_new]
        if live:
            batch, token_ids = table.schedule([j.request for j in live], [1] * len(live), mode=ForwardMode.DECODE, **DECODE_BUCKET, **KV_BUCKET)
            t0 = time.perf_counter()
            logits = run_step(batch, token_ids)
            times["decode"] += time.perf_counter() - t0
            counts["decode"] += 1
            counts["decode_tokens"] += len(live)
            for b, job in enumerate(live):
                job.logits.append(logits[b])
                job.generated.append(int(np.argmax(logits[b])))
                job.request.tokens.append(job.generated[-1])
            progress.advance(len(live))
        # Finished jobs leave; their own slots go back to the pool (the shared system prompt stays cached).
        for job in [j for j in running if len(j.generated) >= j.max_new]:
            running.remove(job)
            finished.append(job)
            table.finish(job.request, keep_prefix=len(system_prompt) if job.shares_system_prompt else 0)
    progress.close()

    # Check: the logits of every generated token equal dense recomputation of the whole sequence.
    worst = 0.0
    for job in finished:
        tokens = job.prompt + job.generated[:-1]
        dense = np.asarray(dense_logits(params, config, jnp.asarray(tokens)).astype(jnp.float32))
        got = np.stack(job.logits)
        want = dense[len(job.prompt) - 1 :]
        worst = max(worst, float(np.max(np.abs(got - want))))
    tolerance = 5e-2 if dtype == jnp.bfloat16 else 1e-3
    generated = sum(len(j.generated) for j in finished)
    _report(backend_name, jax.default_backend(), config, counts, times, generated, worst, tolerance)
    if not worst <= tolerance:
        raise SystemExit(f"serve: paged logits differ from dense recomputation by {worst:.3g} (> {tolerance})")
    return 0


class _Progress:
    """A progress bar over generated tokens (tqdm when installed, plain lines otherwise)."""

    def __init__(self, total):
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="generating", unit="tok")
        except ImportError:
            self.bar = None
            self.total, self.done = total, 0

    def advance(self, n):
        if self.bar is not None:
            self.bar.update(n)
        else:
            self.done += n
            print(f"generated {self.done}/{self.total} tokens", flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _report(backend_name, platform, config, counts, times, generated, worst, tolerance):
    rows = [
        ("backend", f"{backend_name} on {platform}"),
        ("model", f"{config.layers} layers, {config.q_heads}/{config.kv_heads} heads x {config.head_dim}, window {config.sliding_window} on layers {list(config.window_layers)}, {config.dtype}"),
        ("prefill steps", f"{counts['extend']}: {counts['prefill_tokens']} tokens computed, {counts['reused_tokens']} reused from the prefix cache"),
        ("decode steps", f"{counts['decode']}: {counts['decode_tokens']} tokens"),
        ("time in prefill", f"{times['extend']:.3f} s (compile included)"),
        ("time in decode", f"{times['decode']:.3f} s ({counts['decode_tokens'] / max(times['decode'], 1e-9):.1f} tok/s, compile included)"),
        ("generated tokens", str(generated)),
        ("max |paged - dense| logits", f"{worst:.2e} (tolerance {tolerance:g})"),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


if __name__ == "__main__":
    raise SystemExit(main())
