"""Generate text with a Hugging Face checkpoint (Llama-3, Mistral, Qwen2, Qwen3) served through jaxattn.

    python examples/generate.py --model DIR --prompts "The capital of France is" "def fib(n):"
    python examples/generate.py --model DIR --prompt-ids 1,2,3 --prompt-ids 4,5 --max-new-tokens 16
    python examples/generate.py --model DIR --backend triton --max-new-tokens 64    # GPU (default there)

DIR is a local directory (config.json, *.safetensors, optionally tokenizer.json); nothing is downloaded. With the
`tokenizers` package and DIR/tokenizer.json, prompts are text and outputs are decoded; otherwise they are token ids
(`--prompt-ids`). Every prompt starts with a shared system prompt (`--system` / `--system-ids`) that is prefilled
once and then reused from the KV pool by every request (a prefix-cache hit); prompts are admitted in continuous
batches, decoded greedily with one jitted step per bucket (examples/batching.py's loop), and the run ends with
tokens/s for prefill and decode (first step of each, the compile, excluded). `--check` recomputes every generated
token's logits densely (no cache) and reports the largest difference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from batching import Buckets, Job, Progress, make_backend, print_rows, run_jobs  # noqa: E402
from jaxattn.models import dense_logits, forward, init_kv_cache, load_hf_checkpoint  # noqa: E402
from jaxattn.serving import RequestTable, SlotAllocator  # noqa: E402

DEFAULT_SYSTEM = "You are a helpful assistant. Answer briefly and precisely.\n"
DEFAULT_PROMPTS = ["The capital of France is", "Here is a Python function that reverses a string:",
                   "Three facts about the Moon:", "1, 1, 2, 3, 5, 8,"]


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def load_tokenizer(model_dir):
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(path)


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise SystemExit(f"--prompt-ids / --system-ids take comma-separated token ids; got {text!r}") from None


def plan_buckets(system_len: int, suffix_lens: list[int], max_new: int, max_batch: int):
    """Buckets, pool slots and table rows for these prompts (one extend bucket, one decode bucket)."""
    max_extend = _pow2(max(16, system_len, *suffix_lens))
    extend_batch = min(4, len(suffix_lens))
    decode_batch = min(_pow2(len(suffix_lens)), max_batch)
    max_ctx = -(-(system_len + max(suffix_lens) + max_new + 1) // 64) * 64
    buckets = Buckets(extend_batch=extend_batch, extend_tokens=extend_batch * max_extend, max_extend_len=max_extend,
                      decode_batch=decode_batch, kv_capacity=max(decode_batch, extend_batch) * max_ctx, max_seq_len=max_ctx)
    num_slots = 1 + max_ctx * (decode_batch + 1)  # the system prompt plus every running request at full length
    return buckets, num_slots, decode_batch + 1, max_ctx


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="local HF model directory (config.json, *.safetensors)")
    parser.add_argument("--backend", default=None, choices=["reference", "triton", "flashinfer"],
                        help="default: triton on a GPU, reference on CPU")
    parser.add_argument("--prompts", nargs="+", default=None, help="text prompts (needs tokenizers and DIR/tokenizer.json)")
    parser.add_argument("--prompt-ids", action="append", default=None, help="a prompt as comma-separated token ids (repeatable)")
    parser.add_argument("--system", default=None, help="the shared system prompt (text)")
    parser.add_argument("--system-ids", default=None, help="the shared system prompt as token ids")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=16, help="decode batch bucket (most requests running at once)")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default: bfloat16 on a GPU, float32 on CPU")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    parser.add_argument("--check", action="store_true", help="compare every generated token's logits with dense recomputation")
    parser.add_argument("--seed", type=int, default=0, help="for the random prompts used when none are given without a tokenizer")
    parser.add_argument("--json", default=None, help="write the run's record (tokens, rates) here")
    parser.add_argument("--deterministic", action="store_true",
                        help="batch-invariant attention (the triton and flashinfer backends' deterministic modes)")
    args = parser.parse_args(argv)

    on_gpu = jax.default_backend() in ("gpu", "cuda")
    dtype = jnp.dtype(args.dtype or ("bfloat16" if on_gpu else "float32"))
    t0 = time.perf_counter()
    config, params = load_hf_checkpoint(args.model, dtype)
    load_s = time.perf_counter() - t0
    backend_name = args.backend or ("triton" if on_gpu else "reference")
    backend = make_backend(backend_name, config.sliding_windows, deterministic=args.deterministic)

    tokenizer = None if (args.prompt_ids and not args.prompts) else load_tokenizer(args.model)
    if args.prompts and tokenizer is None:
        raise SystemExit("--prompts needs the tokenizers package and DIR/tokenizer.json; give --prompt-ids instead")
    rng = np.random.default_rng(args.seed)
    if args.system_ids is not None:
        system = _ids(args.system_ids)
    elif tokenizer is not None:
        system = tokenizer.encode(args.system or DEFAULT_SYSTEM, add_special_tokens=True).ids
    else:
        system = [int(t) for t in rng.integers(0, config.vocab_size, 24)]
    if args.prompt_ids:
        users = [_ids(p) for p in args.prompt_ids]
    elif tokenizer is not None:
        users = [tokenizer.encode(p, add_special_tokens=False).ids for p in (args.prompts or DEFAULT_PROMPTS)]
    else:
        users = [[int(t) for t in rng.integers(0, config.vocab_size, int(n))] for n in (5, 11, 8, 16)]
    if any(not u for u in users):
        raise SystemExit("every prompt needs at least one token")
    stop = () if args.ignore_eos else config.eos_token_ids
    jobs = [Job(system + u, max_new=args.max_new_tokens, shares_system_prompt=bool(system), stop_ids=stop) for u in users]

    buckets, num_slots, max_reqs, max_ctx = plan_buckets(len(system), [len(u) for u in users], args.max_new_tokens, args.max_batch)
    if max_ctx > config.max_position_embeddings:
        print(f"warning: contexts up to {max_ctx} tokens exceed max_position_embeddings {config.max_position_embeddings}", file=sys.stderr)
    cache = init_kv_cache(config, num_slots, dtype)
    table = RequestTable(max_reqs, max_ctx, SlotAllocator(num_slots))

    def step_fn(params, cache, batch, req_to_token, token_ids, rows, meta=None):
        logits, cache = forward(params, config, backend, batch, req_to_token, cache, token_ids, meta, logit_rows=rows)
        ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # greedy, ties to the lowest id (as torch.argmax)
        return ids, (logits.astype(jnp.float32) if args.check else None), cache

    step = jax.jit(step_fn, donate_argnums=1)

    def run_step(batch, token_ids, rows):
        nonlocal cache
        padded = np.zeros(batch.batch_size, np.int32)  # a static row count per bucket: one compile each
        padded[: len(rows)] = rows
        if backend_name == "flashinfer":  # FlashInfer plans on the host before the jitted step
            meta = backend.plan(batch, table.req_to_token, list(config.attention_layers()), q_dtype=dtype, kv_dtype=dtype,
                                num_slots=num_slots)
            ids, logits, cache = step(params, cache, batch, None, token_ids, jnp.asarray(padded), meta)
        else:
            ids, logits, cache = step(params, cache, batch, jnp.asarray(table.req_to_token), token_ids, jnp.asarray(padded))
        ids = np.asarray(ids)[: len(rows)]
        return ids, (None if logits is None else np.asarray(logits)[: len(rows)])

    progress = Progress(total=len(jobs) * args.max_new_tokens)
    stats = run_jobs(jobs, table, run_step, buckets, system_prompt=system, progress=progress)
    progress.close()

    worst = None
    if args.check:
        worst = 0.0
        dense = jax.jit(lambda params, ids: dense_logits(params, config, ids))
        for job in stats.finished:
            tokens = job.prompt + job.generated[:-1]
            padded = np.zeros(max_ctx, np.int32)
            padded[: len(tokens)] = tokens
            want = np.asarray(dense(params, jnp.asarray(padded)).astype(jnp.float32))[len(job.prompt) - 1 : len(tokens)]
            worst = max(worst, float(np.max(np.abs(np.stack(job.logits) - want))))

    counts, times, first = stats.counts, stats.times, stats.first
    decode_rate = stats.steady_rate("decode", "decode_tokens")
    prefill_rate = stats.steady_rate("extend", "prefill_tokens")
    rows = [
        ("backend", f"{backend_name} on {jax.default_backend()}"),
        ("model", f"{config.model_type}: {config.num_layers} layers, {config.num_heads}/{config.num_kv_heads} heads x "
                  f"{config.head_dim}, hidden {config.hidden_size}, vocab {config.vocab_size}, {dtype.name}"
                  + (f", windows W={list(config.sliding_windows)} on layers {[i for i, w in enumerate(config.windows) if w >= 0]}" if config.windows else "")),
        ("load", f"{load_s:.2f} s"),
        ("prefill", f"{counts['extend']} steps: {counts['prefill_tokens']} tokens computed, {counts['reused_tokens']} reused "
                    f"from the prefix cache; {times['extend']:.3f} s ({first.get('extend', 0):.3f} s first step, with compile)"
                    + (f"; {prefill_rate:.1f} tok/s after it" if prefill_rate else "")),
        ("decode", f"{counts['decode']} steps: {counts['decode_tokens']} tokens; {times['decode']:.3f} s "
                   f"({first.get('decode', 0):.3f} s first step, with compile)" + (f"; {decode_rate:.1f} tok/s after it" if decode_rate else "")),
    ]
    if worst is not None:
        rows.append(("max |paged - dense| logits", f"{worst:.3e}"))
    print_rows(rows)
    print()
    order = {id(j): i for i, j in enumerate(jobs)}
    for job in sorted(stats.finished, key=lambda j: order[id(j)]):
        user = job.prompt[len(system):]
        if tokenizer is not None:
            print(f"[{order[id(job)]}] {tokenizer.decode(user)!r} -> {tokenizer.decode(job.generated)!r}")
        else:
            print(f"[{order[id(job)]}] {user} -> {job.generated}")
    if args.json:
        record = dict(model=os.path.abspath(args.model), backend=backend_name, platform=jax.default_backend(), dtype=dtype.name,
                      system=system, prompts=[j.prompt[len(system):] for j in jobs], generated=[j.generated for j in jobs],
                      counts=counts, times=times, first_step_s=first, prefill_tok_s=prefill_rate, decode_tok_s=decode_rate,
                      max_abs_logit_diff_vs_dense=worst)
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
