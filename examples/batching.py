"""The continuous-batching loop the serving examples share (`serve.py`'s toy model, `generate.py`'s HF checkpoints).

    stats = run_jobs(jobs, table, run_step, buckets, system_prompt=system)

What happens: the system prompt is prefilled once by an owner request that never finishes (the radix cache's part:
its slots stay cached); jobs that share it are added with `RequestTable.add(shared_prefix_from=owner, shared_len=...)`
(a prefix-cache hit: only their suffix is computed). Waiting jobs are admitted while the decode batch and the
prefill buckets have room, in one EXTEND step; then every running job decodes one token per DECODE step (greedy);
finished jobs leave and their own slots go back to the pool, and waiting jobs join.

`run_step(batch, token_ids, rows)` runs one jitted step and returns (next token ids for `rows`, their logits or None):
`rows` are the token rows whose next token the loop needs (each admitted job's last prompt token in EXTEND steps,
row b of sequence b in DECODE steps).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from jaxattn.serving import ForwardMode


@dataclasses.dataclass
class Job:
    prompt: list[int]
    max_new: int
    shares_system_prompt: bool = False
    stop_ids: tuple = ()  # generation ends early after one of these tokens (EOS)
    generated: list[int] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    request: object = None

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new or bool(self.generated and self.generated[-1] in self.stop_ids)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Static step shapes: one compile per bucket. Extend: up to `extend_batch` sequences and `extend_tokens` new
    tokens, `max_extend_len` per sequence; decode: `decode_batch` sequences; keys: `kv_capacity` listed keys per
    step (sum of seq_lens), `max_seq_len` per sequence."""

    extend_batch: int
    extend_tokens: int
    max_extend_len: int
    decode_batch: int
    kv_capacity: int
    max_seq_len: int

    def extend(self) -> dict:
        return dict(batch_bucket=self.extend_batch, token_bucket=self.extend_tokens, max_extend_len=self.max_extend_len,
                    kv_capacity=self.kv_capacity, max_seq_len=self.max_seq_len)

    def decode(self) -> dict:
        return dict(batch_bucket=self.decode_batch, token_bucket=self.decode_batch, max_extend_len=1,
                    kv_capacity=self.kv_capacity, max_seq_len=self.max_seq_len)


def make_backend(name: str, sliding_windows=(), deterministic: bool = False):
    """reference | triton | flashinfer; TritonBackend gets trimmed lists for the model's windows. deterministic:
    batch-invariant outputs (TritonBackend's unified extend and length-only decode splits, FlashInfer's fixed split
    sizes); the reference backend computes every sequence's attention without splits and takes it as it is."""
    if name == "reference":
        from jaxattn.backends import ReferenceBackend

        return ReferenceBackend()
    if name == "triton":
        from jaxattn.backends import TritonBackend

        return TritonBackend(sliding_windows=tuple(sliding_windows), deterministic=deterministic)
    if name == "flashinfer":
        from jaxattn.backends.flashinfer import FlashInferBackend

        return FlashInferBackend(deterministic=deterministic)
    raise SystemExit(f"unknown backend {name!r}")


@dataclasses.dataclass
class Stats:
    times: dict  # mode -> seconds in its steps (compile included)
    first: dict  # mode -> seconds of its first step (the compile, mostly)
    first_tokens: dict  # mode -> tokens of its first step
    counts: dict  # extend, decode (steps), prefill_tokens, reused_tokens, decode_tokens
    finished: list

    def steady_rate(self, mode: str, tokens_key: str) -> float:
        """Tokens per second of `mode`'s steps after its first (compile excluded); 0 when there was only one step."""
        steps = self.counts[mode]
        if steps < 2:
            return 0.0
        tokens = self.counts[tokens_key] - self.first_tokens[mode]
        return tokens / max(self.times[mode] - self.first[mode], 1e-9)


def run_jobs(jobs: list[Job], table, run_step, buckets: Buckets, system_prompt=(), progress=None) -> Stats:
    """Serves `jobs` to completion (see the module doc); returns the finished jobs (in finishing order) and timings."""
    times = {"extend": 0.0, "decode": 0.0}
    first, first_tokens = {}, {}
    counts = {"extend": 0, "decode": 0, "prefill_tokens": 0, "reused_tokens": 0, "decode_tokens": 0}

    def timed(mode, batch, token_ids, rows, tokens):
        t0 = time.perf_counter()
        out = run_step(batch, token_ids, np.asarray(rows, np.int32))
        elapsed = time.perf_counter() - t0
        times[mode] += elapsed
        first.setdefault(mode, elapsed)
        first_tokens.setdefault(mode, tokens)
        counts[mode] += 1
        return out

    system_prompt = list(system_prompt)
    owner = None
    if system_prompt:
        owner = table.add(system_prompt)
        batch, token_ids = table.schedule([owner], [len(system_prompt)], mode=ForwardMode.EXTEND, **buckets.extend())
        timed("extend", batch, token_ids, [len(system_prompt) - 1], len(system_prompt))
        counts["prefill_tokens"] += len(system_prompt)

    waiting, running, finished = list(jobs), [], []
    while waiting or running:
        # Admit waiting jobs while there is room: one prefill step for them.
        admitted, new_tokens = [], 0
        while waiting and len(running) + len(admitted) < buckets.decode_batch and len(admitted) < buckets.extend_batch:
            job = waiting[0]
            reuse = bool(owner is not None and job.shares_system_prompt)
            # A prefix hit shares whole pages only: the system prompt's partial last page is computed again.
            shared = len(system_prompt) // table.page_size * table.page_size if reuse else 0
            n = len(job.prompt) - shared
            if n > buckets.max_extend_len:
                raise SystemExit(f"a prompt needs {n} new tokens, more than the extend bucket's {buckets.max_extend_len}")
            if admitted and new_tokens + n > buckets.extend_tokens:
                break
            job.request = table.add(job.prompt, shared_prefix_from=owner if reuse else None,
                                    shared_len=len(system_prompt) if reuse else 0)
            counts["reused_tokens"] += job.request.cached
            admitted.append(waiting.pop(0))
            new_tokens += n
        if admitted:
            new_counts = [len(j.prompt) - j.request.cached for j in admitted]
            batch, token_ids = table.schedule([j.request for j in admitted], new_counts, mode=ForwardMode.EXTEND, **buckets.extend())
            ids, logits = timed("extend", batch, token_ids, np.cumsum(new_counts) - 1, sum(new_counts))
            counts["prefill_tokens"] += sum(new_counts)
            for b, job in enumerate(admitted):
                _emit(job, ids[b], None if logits is None else logits[b])
            running += admitted
            if progress is not None:
                progress.advance(len(admitted))
        # One decode step for everyone still generating.
        live = [j for j in running if not j.done]
        if live:
            batch, token_ids = table.schedule([j.request for j in live], [1] * len(live), mode=ForwardMode.DECODE, **buckets.decode())
            ids, logits = timed("decode", batch, token_ids, np.arange(len(live)), len(live))
            counts["decode_tokens"] += len(live)
            for b, job in enumerate(live):
                _emit(job, ids[b], None if logits is None else logits[b])
            if progress is not None:
                progress.advance(len(live))
        # Finished jobs leave; their own slots go back to the pool (the shared system prompt stays cached).
        for job in [j for j in running if j.done]:
            running.remove(job)
            finished.append(job)
            table.finish(job.request)
    return Stats(times=times, first=first, first_tokens=first_tokens, counts=counts, finished=finished)


def _emit(job: Job, token, logits):
    job.generated.append(int(token))
    job.request.tokens.append(int(token))
    if logits is not None:
        job.logits.append(logits)


class Progress:
    """A progress bar over generated tokens (tqdm when installed, plain lines otherwise)."""

    def __init__(self, total, desc="generating"):
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="tok")
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


def print_rows(rows):
    width = max(len(k) for k, _ in rows)
    print()
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
