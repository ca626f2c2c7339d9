"""Compare jaxattn's serving path with transformers on one HF checkpoint, and time an 8B-shaped Llama-3 against it.

    # GPU (torch + transformers installed): logits at every position and greedy tokens, jaxattn's TritonBackend
    python scripts/compare_transformers.py --write-tiny /tmp/tiny-llama --preset llama     # a random checkpoint
    python scripts/compare_transformers.py --model /tmp/tiny-llama --steps 32 --json compare.json
    python scripts/compare_transformers.py --model /tmp/tiny-llama --dtype float32          # proves the greedy tokens
    python scripts/compare_transformers.py --write-tiny /tmp/llama3-1b --preset llama3-1b  # Llama-3.2-1B's shape, 2.5 GB
    python scripts/compare_transformers.py --bench --json bench.json                        # 8B shape, random weights
    # CPU, no torch: the jaxattn half only (reference backend), checked against jaxattn's dense oracle
    python scripts/compare_transformers.py --dry-run [--dtype float32] [--model DIR | --preset P --overrides JSON]
    python scripts/compare_transformers.py --bench --dry-run

Compare mode. The prompts (`--prompts` random ones of `--prompt-len` tokens, after a shared system prompt of
`--system-len` tokens) go through jaxattn as a server runs them: the system prompt is prefilled once, the prompts
reuse its slots (a prefix-cache hit) in one EXTEND step, then `--steps` greedy DECODE steps run for all of them
together (EOS ignored). transformers runs each prompt alone: greedy decoding with its own KV cache (the cached forward
that `generate` runs, without logits processors, so EOS neither stops nor is suppressed), and one forward over
jaxattn's whole sequence (teacher-forced) for the logits at every position. Reported per prompt: max |jaxattn -
transformers| over every position and vocab entry, the bound of the rule below, and whether the greedy tokens are
identical (else the first divergence and transformers' top-2 margin there: a near tie when the margin is within the
logits' difference). With `--fp32-reference` (default on) transformers also runs in float32 and the table shows how
far each bf16 implementation is from it (transformers' own bf16 error is the noise floor jaxattn is judged against).

Tolerance rules (bf16 logits), both stated in the output and the JSON:
  1. per position p, with (atol, rtol) = `jaxattn.testing.tolerance(bfloat16)` (1.6e-2 each, the kernels' tolerance
     for one attention call), every logit satisfies
         |jaxattn - transformers| <= atol * sqrt(num_layers) * max|transformers' logits at p| + rtol * |transformers|
     i.e. the per-call bf16 tolerance made relative to the position's logit scale and grown like a random walk over
     the layers' independent roundings;
  2. with the float32 reference: max |jaxattn - fp32| <= 2 * max |transformers bf16 - fp32| per prompt (jaxattn's
     bf16 error at most twice transformers' own; the tighter check, as rule 1 is loose for deep models).
The check fails when a position breaks rule 1, a prompt breaks rule 2, or the greedy tokens differ at a non-tie.
A divergence is a near tie when transformers' top-2 margin there is at most 2 * max |jaxattn - transformers| at that
position: the two picks can swap only if the two logits' differences add up to the margin.
(On CPU, jaxattn's paged bf16 logits differ from its own dense bf16 ones by about as much as either differs from
float32, 0.1-0.25 on the tiny presets: a flat elementwise atol/rtol on logits would fail bf16 models of any kind.)

Why float32 (`--dtype float32`). In bf16, greedy tokens of random-weight models are expected to diverge now and
then: logits round to 8 mantissa bits, so two candidates often share one bf16 value (margin exactly 0; at logits of
4-16 one bf16 step is 0.03-0.06) or differ by a step or two, and which one wins depends on rounding that two correct
implementations do in different orders (fused kernels, split-KV decode, batch shapes). Among the 128256 logits of
llama3-1b the top two are often a step apart: its CPU dry run in bf16 diverged at margin 0 or one step in 3 of 4
prompts. The near-tie rule above accepts such divergences but cannot prove the tokens. With `--dtype float32` both
frameworks serve the same checkpoint (bf16 weights upcast exactly) in float32 throughout: jaxattn's weights,
activations and KV pools (the Triton kernels take f32 q and pools and use IEEE f32 dots; the model's matmuls run at
`precision="highest"`), transformers in float32 with TF32 off and eager attention (cuBLAS f32 matmuls; `--hf-attn`
overrides). The logits then differ by ~1e-5 (llama3-1b's CPU dry run: 1.5e-5 at logits up to 5, 4% of rule 1's
float32 bound), ties become vanishingly rare, and the greedy tokens must be identical: a divergence fails unless it
is a near tie by the rule above, i.e. with float32 differences a margin of ~1e-5. Rule 1 uses
`jaxattn.testing.tolerance(float32)` (2e-5 each); rule 2 is skipped (it measures a bf16 run against the float32
reference, which is here the run itself) and the output says so. `--backend flashinfer` takes bf16 only.

Checkpoints (`--write-tiny DIR --preset P [--overrides JSON]`, `jaxattn.models.testing.write_random_checkpoint`):
the tiny presets llama, qwen3, qwen2, and real shapes with random weights: llama3-1b (Llama-3.2-1B's config: 16
layers, hidden 2048, 32/8 heads x 64, vocab 128256, llama3 RoPE scaling factor 32, tied embeddings; 2.5 GB),
qwen3-1.7b (Qwen3-1.7B's: 28 layers, hidden 2048, 16/8 heads x 128, q/k norms, vocab 151936, tied; 3.4 GB),
llama3-8b (16 GB). llama3-1b writes in about 30 s (float32 draws on one CPU core). Tied embeddings are drawn at
1/sqrt(hidden) (`jaxattn.models.testing.embedding_scale`: at unit scale greedy decoding just repeats the last token).

Bench mode (`--bench`): Llama-3-8B's shape (32 layers, hidden 4096, 32/8 heads x 128, intermediate 14336, vocab
128256; `--bench-layers` to shrink) with random bf16 weights made on the GPU by each framework (jaxattn:
`jaxattn.models.testing.random_params`; transformers: `from_config` under `torch.device("cuda")`), no checkpoint on
disk. Prefill: one EXTEND step of 4 x 4096 new tokens (logits of the last token of each only). Decode: batch 64 at a
4096-token context: the pool is filled with random K/V (the timing does not depend on the values), and the decode
step is repeated on that batch. Attention's share: the same decode step with attention replaced by a no-op (no KV
write, no metadata, no attention: q passed through as the output); share = 1 - t(no-op) / t(step). transformers:
prefill is one forward of 4 x 4096 (`logits_to_keep=1`), decode is `generate` with sdpa attention, timed as
(t(1 + D new tokens) - t(1 new token)) / D, which removes its prefill. Each side runs in its own process (a fresh
GPU memory pool); `--bench-side` runs one side.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to torch in the same process
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402


# --------------------------------------------------------------------------------------------------------------
# The jaxattn half

def make_prompts(vocab: int, count: int, prompt_len: int, system_len: int, seed: int):
    rng = np.random.default_rng(seed)
    high = min(vocab, 32000)  # ordinary ids (not the special tokens at the end of Llama-3's vocab)
    system = [int(t) for t in rng.integers(3, high, system_len)]
    users = [[int(t) for t in rng.integers(3, high, max(1, prompt_len + 3 * i - 3))] for i in range(count)]
    return system, users


def jaxattn_serve(config, params, backend_name: str, system, users, steps: int, dtype):
    """Serves system + users through jaxattn (prefix hit, one EXTEND step, `steps` DECODE steps). Returns per
    prompt (tokens, logits f32[len(tokens), vocab], generated): logits[p] predicts tokens[p + 1]."""
    import jax
    import jax.numpy as jnp

    from jaxattn.models import forward, init_kv_cache
    from jaxattn.serving import ForwardMode, RequestTable, SlotAllocator

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from batching import make_backend

    backend = make_backend(backend_name, config.sliding_windows)
    n = len(users)
    longest = len(system) + max(len(u) for u in users) + steps + 1
    max_ctx = -(-longest // 64) * 64
    pow2 = lambda x: 1 << max(0, x - 1).bit_length()  # noqa: E731
    max_extend = pow2(max(16, len(system), *[len(u) for u in users]))
    batch_bucket = pow2(n)
    extend = dict(batch_bucket=batch_bucket, token_bucket=batch_bucket * max_extend, max_extend_len=max_extend,
                  kv_capacity=batch_bucket * max_ctx, max_seq_len=max_ctx)
    decode = dict(extend, token_bucket=batch_bucket, max_extend_len=1)
    num_slots = 1 + max_ctx * (n + 1)
    cache = init_kv_cache(config, num_slots, dtype)
    table = RequestTable(n + 1, max_ctx, SlotAllocator(num_slots, seed=1))

    def step_fn(params, cache, batch, req_to_token, token_ids, meta=None):
        logits, cache = forward(params, config, backend, batch, req_to_token, cache, token_ids, meta)
        return logits.astype(jnp.float32), jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    step = jax.jit(step_fn, donate_argnums=1)

    def run(requests, counts, buckets, mode):
        nonlocal cache
        batch, ids = table.schedule(requests, counts, mode=mode, **buckets)
        if backend_name == "flashinfer":  # FlashInfer plans on the host before the jitted step
            meta = backend.plan(batch, table.req_to_token, list(config.attention_layers()), q_dtype=dtype, kv_dtype=dtype,
                                num_slots=num_slots)
            logits, greedy, cache = step(params, cache, batch, None, ids, meta)
        else:
            logits, greedy, cache = step(params, cache, batch, jnp.asarray(table.req_to_token), ids)
        return np.asarray(logits), np.asarray(greedy)

    owner = table.add(system)
    system_logits, _ = run([owner], [len(system)], extend, ForwardMode.EXTEND)
    system_logits = system_logits[: len(system)]
    requests = [table.add(system + u, shared_prefix_from=owner, shared_len=len(system)) for u in users]
    logits, greedy = run(requests, [len(u) for u in users], extend, ForwardMode.EXTEND)
    per = [[system_logits] for _ in users]
    row = 0
    for b, u in enumerate(users):
        per[b].append(logits[row : row + len(u)])
        row += len(u)
        requests[b].tokens.append(int(greedy[row - 1]))
    for _ in range(steps - 1):
        logits, greedy = run(requests, [1] * n, decode, ForwardMode.DECODE)
        for b in range(n):
            per[b].append(logits[b : b + 1])
            requests[b].tokens.append(int(greedy[b]))
    out = []
    for b, u in enumerate(users):
        tokens = requests[b].tokens
        out.append((tokens[:-1], np.concatenate(per[b]), tokens[len(system) + len(u):]))
    return out


def tolerance_bound(reference: np.ndarray, num_layers: int, dtype):
    """Per element bound of rule 1 in the module doc, for reference logits [positions, vocab] of a `dtype` run."""
    from jaxattn import testing

    tol = testing.tolerance(dtype)
    scale = np.max(np.abs(reference.astype(np.float64)), axis=-1, keepdims=True)
    return tol["atol"] * math.sqrt(num_layers) * scale + tol["rtol"] * np.abs(reference), tol


def judge(got: np.ndarray, want: np.ndarray, num_layers: int, dtype) -> dict:
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    bound, tol = tolerance_bound(want, num_layers, dtype)
    ratio = diff / bound
    worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    return dict(max_abs_diff=float(diff.max()), worst_ratio=float(ratio.max()), worst_position=int(worst[0]),
                positions=int(got.shape[0]), passed=bool(ratio.max() <= 1.0), atol=tol["atol"], rtol=tol["rtol"],
                atol_scaled=float((tol["atol"] * math.sqrt(num_layers) * np.max(np.abs(want.astype(np.float64)), axis=-1)).max()))


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# --------------------------------------------------------------------------------------------------------------
# Compare mode

def compare(args) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxattn.models import dense_logits, load_hf_checkpoint

    dry = args.dry_run
    fp32 = args.dtype == "float32"
    model_dir = args.model
    if model_dir is None:
        if not dry:
            raise SystemExit("--model DIR is required (or --dry-run, which writes a tiny checkpoint)")
        from jaxattn.models.testing import write_random_checkpoint

        model_dir = tempfile.mkdtemp(prefix="jaxattn-tiny-")
        overrides = json.loads(args.overrides) if args.overrides else None
        write_random_checkpoint(model_dir, args.preset, overrides)
    backend_name = args.backend or ("reference" if dry or jax.default_backend() == "cpu" else "triton")
    if fp32 and backend_name == "flashinfer":
        raise SystemExit("--dtype float32 needs --backend triton or reference: FlashInfer's kernels take fp16/bf16 only")
    dtype = jnp.float32 if fp32 else jnp.bfloat16
    hf_attn = args.hf_attn or ("eager" if fp32 else "sdpa")
    t0 = time.perf_counter()
    config, params = load_hf_checkpoint(model_dir, dtype)
    load_s = time.perf_counter() - t0
    system, users = make_prompts(config.vocab_size, args.prompts, args.prompt_len, args.system_len, args.seed)
    t0 = time.perf_counter()
    served = jaxattn_serve(config, params, backend_name, system, users, args.steps, dtype)
    serve_s = time.perf_counter() - t0
    record = dict(model=os.path.abspath(model_dir), backend=backend_name, platform=jax.default_backend(), jax=jax.__version__,
                  dtype=args.dtype, steps=args.steps, system_len=len(system), prompt_lens=[len(u) for u in users],
                  jaxattn_load_s=load_s, jaxattn_serve_s=serve_s, num_layers=config.num_layers, rows=[])
    if fp32:
        record["rule2"] = "skipped: the run is float32 (rule 2 measures bf16 error against the float32 reference)"

    def divergence(row, generated, theirs, margins, logits, want, first_generated):
        """Adds the first greedy divergence to `row`: reference top-2 margin there, the logits' difference there,
        and whether it is a near tie (margin <= 2 * the difference: only then can the difference flip the order)."""
        div = first_divergence(generated, theirs)
        row.update(tokens_identical=div is None, first_divergence=div)
        if div is not None:
            p = first_generated + div
            row["margin_at_divergence"] = float(margins[div])
            row["max_abs_diff_at_divergence"] = float(np.max(np.abs(logits[p] - want[p])))
            row["near_tie"] = bool(row["margin_at_divergence"] <= 2 * row["max_abs_diff_at_divergence"])

    if dry:  # no torch here: jaxattn's own dense oracle (f32 attention) stands in for transformers
        record["reference"] = "jaxattn dense_logits (dry run: no transformers)"
        dense = jax.jit(lambda params, ids: dense_logits(params, config, ids))
        params32 = None if fp32 else load_hf_checkpoint(model_dir, jnp.float32)[1]
        for b, (tokens, logits, generated) in enumerate(served):
            want = np.asarray(dense(params, jnp.asarray(tokens)).astype(jnp.float32))
            start = len(tokens) - len(generated)
            greedy_dense = [int(t) for t in np.argmax(want[start:], axis=-1)]
            top2 = np.sort(want[start:], axis=-1)[:, -2:]
            row = judge(logits, want, config.num_layers, dtype)
            row["prompt"] = b
            divergence(row, generated, greedy_dense, top2[:, 1] - top2[:, 0], logits, want, start)
            if not fp32:
                ref = np.asarray(dense(params32, jnp.asarray(tokens)))
                row["jaxattn_vs_fp32"] = float(np.max(np.abs(logits - ref)))
                row["transformers_bf16_vs_fp32"] = float(np.max(np.abs(want - ref)))  # here: jaxattn's dense bf16
            record["rows"].append(row)
        return record

    import torch
    import transformers

    record.update(reference=f"transformers {transformers.__version__} ({hf_attn}), torch {torch.__version__}")
    device = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 in true float32 (the reference, or the whole --dtype float32 run)
    torch.backends.cudnn.allow_tf32 = False

    def load(torch_dtype):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=hf_attn, **_dtype_kwarg(torch_dtype))
        return model.to(device).eval()

    hf = load(torch.float32 if fp32 else torch.bfloat16)
    rotary = getattr(getattr(hf, "model", hf), "rotary_emb", None)
    if rotary is not None and hasattr(rotary, "inv_freq"):
        theirs = rotary.inv_freq.detach().float().cpu().numpy()
        ours = config.inv_freq()
        record["inv_freq_max_rel_diff"] = float(np.max(np.abs(theirs - ours) / np.abs(ours)))
        record["inv_freq_dtype"] = str(rotary.inv_freq.dtype)

    @torch.no_grad()
    def teacher_forced(model, tokens):
        ids = torch.tensor([tokens], device=device)
        return model(ids, use_cache=False).logits[0].float().cpu().numpy()

    @torch.no_grad()
    def greedy(model, prompt, steps):
        out = model(torch.tensor([prompt], device=device), use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
        tokens, margins = [], []
        for _ in range(steps):
            top = torch.topk(logits.float(), 2)
            margins.append(float(top.values[0] - top.values[1]))
            token = int(torch.argmax(logits))  # ties to the lowest id, as jnp.argmax
            tokens.append(token)
            out = model(torch.tensor([[token]], device=device), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
        return tokens, margins

    hf_runs = []
    for b, (tokens, logits, generated) in enumerate(served):
        prompt = tokens[: len(tokens) - len(generated) + 1]
        want = teacher_forced(hf, tokens)
        hf_tokens, margins = greedy(hf, prompt, args.steps)
        row = judge(logits, want, config.num_layers, dtype)
        row["prompt"] = b
        divergence(row, generated, hf_tokens, margins, logits, want, len(prompt) - 1)
        record["rows"].append(row)
        hf_runs.append(want)
    if args.fp32_reference and not fp32:
        del hf
        torch.cuda.empty_cache()
        hf32 = load(torch.float32)
        for row, (tokens, logits, _), want in zip(record["rows"], served, hf_runs):
            ref = teacher_forced(hf32, tokens)
            row["jaxattn_vs_fp32"] = float(np.max(np.abs(logits - ref)))
            row["transformers_bf16_vs_fp32"] = float(np.max(np.abs(want - ref)))
    return record


def _dtype_kwarg(torch_dtype) -> dict:
    """transformers 5 takes dtype=, 4 torch_dtype= (4 would take an unknown dtype= silently and load float32)."""
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return {"dtype" if major >= 5 else "torch_dtype": torch_dtype}


def print_compare(record) -> bool:
    rows = record["rows"]
    fp32 = record.get("dtype", "bfloat16") == "float32"
    short = "fp32" if fp32 else "bf16"
    print(f"\njaxattn ({record['backend']} on {record['platform']}, {short}) vs {record['reference']}, {short}")
    print(f"model {record['model']}: {record['num_layers']} layers; system prompt {record['system_len']} tokens (a prefix-cache hit), "
          f"prompts {record['prompt_lens']}, {record['steps']} greedy steps")
    if "inv_freq_max_rel_diff" in record:
        print(f"RoPE inv_freq vs transformers' buffer ({record['inv_freq_dtype']}): max rel diff {record['inv_freq_max_rel_diff']:.2e}")
    if rows:
        r = rows[0]
        print(f"rule 1: |d| <= atol*sqrt(L)*max|ref logits at p| + rtol*|ref|, atol = rtol = {r['atol']:g} (testing.tolerance({short})), "
              f"L = {record['num_layers']}: atol term up to {max(x['atol_scaled'] for x in rows):.3g}; "
              + ("rule 2: skipped (this run is float32: rule 2 judges bf16 runs against the float32 reference); "
                 if fp32 else "rule 2: max|jaxattn - fp32| <= 2 * max|reference bf16 - fp32|; ")
              + "greedy tokens identical, or the first divergence a near tie (reference top-2 margin <= 2 * max|d| at that position)")
    head = "| prompt | positions | max abs diff | worst diff / rule-1 bound | rule 1 | greedy tokens | jaxattn vs fp32 | reference bf16 vs fp32 (rule 2) |"
    print(head)
    print("|---|---|---|---|---|---|---|---|")
    ok = True
    for r in rows:
        tokens = "identical" if r["tokens_identical"] else (
            f"differ at step {r['first_divergence']} (margin {r.get('margin_at_divergence', float('nan')):.3g}, "
            f"diff there {r.get('max_abs_diff_at_divergence', float('nan')):.3g}{', near tie' if r.get('near_tie') else ': FAILS'})")
        cell = lambda k: f"{r[k]:.3g}" if k in r else "-"  # noqa: E731
        rule2 = "" if "jaxattn_vs_fp32" not in r else (" ok" if r["jaxattn_vs_fp32"] <= 2 * r["transformers_bf16_vs_fp32"] else " FAILS")
        print(f"| {r['prompt']} | {r['positions']} | {r['max_abs_diff']:.3g} | {r['worst_ratio']:.3f} (pos {r['worst_position']}) | "
              f"{'yes' if r['passed'] else 'NO'} | {tokens} | {cell('jaxattn_vs_fp32')} | {cell('transformers_bf16_vs_fp32')}{rule2} |")
        if "jaxattn_vs_fp32" in r:
            r["rule2_passed"] = bool(r["jaxattn_vs_fp32"] <= 2 * r["transformers_bf16_vs_fp32"])
        ok &= r["passed"] and r.get("rule2_passed", True) and (r["tokens_identical"] or bool(r.get("near_tie")))
    if fp32 and rows:
        print(f"greedy tokens identical in {sum(r['tokens_identical'] for r in rows)} of {len(rows)} prompts (float32)")
    print("\nPASS" if ok else "\nFAIL")
    return ok


# --------------------------------------------------------------------------------------------------------------
# Bench mode

import jax.numpy as jnp  # noqa: E402


class NoAttention:
    """A backend whose attention is a no-op (q passed through, no KV write, no metadata): the rest of the step."""

    name = "no-attention"

    def init_forward_metadata(self, batch, req_to_token):
        return None

    def forward(self, q, k, v, k_pool, v_pool, layer, meta, **kwargs):
        # k and v stay live (a 0 * sum, which XLA does not fold for floats), so their projections are still computed.
        keep = (jnp.sum(k.astype(jnp.float32)) + jnp.sum(v.astype(jnp.float32))) * 0.0
        return q + keep.astype(q.dtype), k_pool, v_pool


def _median_time(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bench_config(args):
    from jaxattn.models import LlamaConfig
    from jaxattn.models.testing import hf_config

    if args.dry_run:  # a tiny stand-in, to run the code paths on CPU
        hf = hf_config("llama", {"num_hidden_layers": 2})
    else:
        hf = hf_config("llama3-8b", {"num_hidden_layers": args.bench_layers})
    return hf, LlamaConfig.from_hf(hf)


def _shape(text):
    batch, length = (int(x) for x in text.lower().split("x"))
    return batch, length


def bench_jaxattn(args) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxattn.models import forward, init_kv_cache
    from jaxattn.models.testing import random_params
    from jaxattn.serving import ForwardMode, RequestTable, SlotAllocator

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from batching import make_backend

    hf, config = bench_config(args)
    dtype = jnp.bfloat16
    backend_name = args.backend or ("reference" if jax.default_backend() == "cpu" else "triton")
    backend = make_backend(backend_name, config.sliding_windows)
    t0 = time.perf_counter()
    params = jax.block_until_ready(random_params(config, seed=0, dtype=dtype))
    record = dict(side="jaxattn", backend=backend_name, platform=jax.default_backend(), layers=config.num_layers,
                  params_s=time.perf_counter() - t0, num_params=config.num_params())
    reps = args.bench_reps
    rng = np.random.default_rng(0)

    def make_step(be):
        return jax.jit(lambda params, cache, batch, r2t, ids, rows: forward(params, config, be, batch, r2t, cache, ids, logit_rows=rows),
                       donate_argnums=1)

    # Prefill: B x L new tokens in one EXTEND step.
    pb, pl = _shape(args.bench_prefill)
    slots = 1 + pb * pl
    cache = init_kv_cache(config, slots, dtype)
    table = RequestTable(pb, pl, SlotAllocator(slots))
    reqs = [table.add([int(t) for t in rng.integers(3, 32000, pl)]) for _ in range(pb)]
    batch, ids = table.schedule(reqs, [pl] * pb, mode=ForwardMode.EXTEND, batch_bucket=pb, token_bucket=pb * pl,
                                max_extend_len=pl, kv_capacity=pb * pl, max_seq_len=pl)
    r2t, rows = jnp.asarray(table.req_to_token), jnp.arange(1, pb + 1, dtype=jnp.int32) * pl - 1
    step = make_step(backend)
    t0 = time.perf_counter()
    logits, cache = step(params, cache, batch, r2t, ids, rows)
    jax.block_until_ready(logits)
    record["prefill_first_call_s"] = time.perf_counter() - t0

    def prefill_once():
        nonlocal cache, logits
        logits, cache = step(params, cache, batch, r2t, ids, rows)
        jax.block_until_ready(logits)

    t = _median_time(prefill_once, reps)
    record.update(prefill_shape=f"{pb} x {pl}", prefill_step_s=t, prefill_tok_s=pb * pl / t)
    del cache, table, step
    jax.clear_caches()

    # Decode: B sequences at context L (the pool filled with random K/V, the step repeated on one batch).
    db, dl = _shape(args.bench_decode)
    slots = 1 + db * dl
    table = RequestTable(db, dl, SlotAllocator(slots))
    reqs = [table.add([int(t) for t in rng.integers(3, 32000, dl)]) for _ in range(db)]
    table.schedule(reqs, [dl - 1] * db, mode=ForwardMode.EXTEND, batch_bucket=db, token_bucket=db * (dl - 1),
                   max_extend_len=dl - 1, kv_capacity=db * dl, max_seq_len=dl)  # bookkeeping only: no step runs
    batch, ids = table.schedule(reqs, [1] * db, mode=ForwardMode.DECODE, batch_bucket=db, token_bucket=db,
                                max_extend_len=1, kv_capacity=db * dl, max_seq_len=dl)
    r2t, rows = jnp.asarray(table.req_to_token), jnp.arange(db, dtype=jnp.int32)
    fill = jax.jit(lambda key: tuple(jax.random.normal(k, (slots, config.num_kv_heads, config.head_dim), jnp.float32).astype(dtype)
                                     for k in jax.random.split(key, 2)))
    cache = [fill(jax.random.key(i)) for i in range(config.num_layers)]
    for name, be in (("decode", backend), ("decode_no_attention", NoAttention())):
        step = make_step(be)
        t0 = time.perf_counter()
        logits, cache = step(params, cache, batch, r2t, ids, rows)
        jax.block_until_ready(logits)
        record[f"{name}_first_call_s"] = time.perf_counter() - t0

        def decode_once():
            nonlocal cache, logits
            logits, cache = step(params, cache, batch, r2t, ids, rows)
            jax.block_until_ready(logits)

        record[f"{name}_step_s"] = _median_time(decode_once, max(reps, args.bench_decode_steps))
    record.update(decode_shape=f"{db} x {dl}", decode_tok_s=db / record["decode_step_s"],
                  attention_share=1.0 - record["decode_no_attention_step_s"] / record["decode_step_s"])
    return record


def bench_transformers(args) -> dict:
    import torch
    import transformers

    hf, config = bench_config(args)
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items() if k not in ("architectures", "transformers_version", "torch_dtype", "dtype")})
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", **_dtype_kwarg(torch.bfloat16))
    model.eval()
    torch.cuda.synchronize()
    record = dict(side="transformers", version=transformers.__version__, torch=torch.__version__, layers=config.num_layers,
                  params_s=time.perf_counter() - t0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    reps = args.bench_reps

    pb, pl = _shape(args.bench_prefill)
    ids = torch.randint(3, 32000, (pb, pl), device="cuda", generator=gen)

    @torch.no_grad()
    def prefill_once():
        for keep in ("logits_to_keep", "num_logits_to_keep", None):  # the keyword's name changed in transformers 4.49
            try:
                model(ids, use_cache=False, **({keep: 1} if keep else {}))
                break
            except TypeError:
                continue
        torch.cuda.synchronize()

    prefill_once()
    t = _median_time(prefill_once, reps)
    record.update(prefill_shape=f"{pb} x {pl}", prefill_step_s=t, prefill_tok_s=pb * pl / t)

    db, dl = _shape(args.bench_decode)
    ids = torch.randint(3, 32000, (db, dl - 1), device="cuda", generator=gen)
    mask = torch.ones_like(ids)

    @torch.no_grad()
    def generate(new):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    steps = args.bench_decode_steps
    try:
        generate(2)  # warm-up
        t1 = min(generate(1) for _ in range(2))
        tn = min(generate(1 + steps) for _ in range(2))
        record.update(decode_shape=f"{db} x {dl}", decode_step_s=(tn - t1) / steps, decode_tok_s=db * steps / (tn - t1),
                      generate_prefill_s=t1)
    except torch.cuda.OutOfMemoryError as e:
        record.update(decode_shape=f"{db} x {dl}", decode_error=f"out of memory: {e}"[:300])
    return record


def bench(args) -> dict:
    if args.dry_run:
        args.bench_prefill, args.bench_decode = "2x64", "4x128"
        return dict(jaxattn=bench_jaxattn(args))
    if args.bench_side != "both":
        return {args.bench_side: (bench_jaxattn if args.bench_side == "jaxattn" else bench_transformers)(args)}
    out = {}
    for side in ("jaxattn", "transformers"):  # separate processes: each side gets the whole GPU memory
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        argv = [sys.executable, os.path.abspath(__file__), "--bench", "--bench-side", side, "--json", path,
                "--bench-layers", str(args.bench_layers), "--bench-prefill", args.bench_prefill, "--bench-decode",
                args.bench_decode, "--bench-reps", str(args.bench_reps), "--bench-decode-steps", str(args.bench_decode_steps)]
        if args.backend:
            argv += ["--backend", args.backend]
        done = subprocess.run(argv)
        if done.returncode == 0:
            with open(path) as f:
                out.update(json.load(f)["bench"])
        else:
            out[side] = dict(error=f"exit status {done.returncode}")
    return out


def print_bench(result):
    print("\n| side | prefill | prefill tok/s | decode | decode tok/s | decode step | attention share of the decode step |")
    print("|---|---|---|---|---|---|---|")
    for side, r in result.items():
        if "error" in r:
            print(f"| {side} | {r['error']} | | | | | |")
            continue
        share = f"{100 * r['attention_share']:.1f}%" if "attention_share" in r else "-"
        decode = f"{r['decode_tok_s']:.0f}" if "decode_tok_s" in r else r.get("decode_error", "-")
        step = f"{1e3 * r['decode_step_s']:.2f} ms" if "decode_step_s" in r else "-"
        print(f"| {side} | {r.get('prefill_shape')} | {r.get('prefill_tok_s', 0):.0f} | {r.get('decode_shape')} | {decode} | {step} | {share} |")


# --------------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--model", default=None, help="local HF checkpoint directory")
    parser.add_argument("--steps", type=int, default=32, help="greedy decode steps (compare mode)")
    parser.add_argument("--json", default=None, help="write the record here")
    parser.add_argument("--backend", default=None, choices=["reference", "triton", "flashinfer"],
                        help="jaxattn backend (default: triton on a GPU, reference on CPU or with --dry-run)")
    parser.add_argument("--prompts", type=int, default=4, help="number of random prompts")
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--system-len", type=int, default=40, help="shared system prompt (the prefix-cache hit)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-fp32-reference", dest="fp32_reference", action="store_false",
                        help="skip transformers in float32 (the noise floor columns)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="compare mode: both frameworks' weights, activations and KV pools (float32: proves the greedy tokens)")
    parser.add_argument("--hf-attn", default=None, choices=["sdpa", "eager", "flash_attention_2"],
                        help="transformers' attention in compare mode (default sdpa in bfloat16, eager in float32; eager also "
                             "if your version warns that sdpa ignores sliding windows)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, no torch: the jaxattn half, against jaxattn's dense oracle")
    parser.add_argument("--preset", default="llama",
                        help="checkpoint preset for --write-tiny / --dry-run: llama, qwen3, qwen2 (tiny), llama3-1b, qwen3-1.7b, llama3-8b")
    parser.add_argument("--write-tiny", metavar="DIR", default=None, help="write a random checkpoint of --preset to DIR and exit")
    parser.add_argument("--overrides", default=None,
                        help='config.json fields for --write-tiny / --dry-run, as JSON: \'{"num_hidden_layers": 2, "vocab_size": 512}\'')
    parser.add_argument("--bench", action="store_true", help="time the 8B-shaped Llama-3 (random weights) against transformers")
    parser.add_argument("--bench-side", default="both", choices=["both", "jaxattn", "transformers"])
    parser.add_argument("--bench-layers", type=int, default=32)
    parser.add_argument("--bench-prefill", default="4x4096", help="BATCHxLENGTH of the prefill step")
    parser.add_argument("--bench-decode", default="64x4096", help="BATCHxCONTEXT of the decode step")
    parser.add_argument("--bench-reps", type=int, default=5)
    parser.add_argument("--bench-decode-steps", type=int, default=16)
    args = parser.parse_args(argv)

    if args.write_tiny:
        from jaxattn.models.testing import write_random_checkpoint

        import importlib.util

        overrides = json.loads(args.overrides) if args.overrides else None
        write_random_checkpoint(args.write_tiny, args.preset, overrides, tokenizer=importlib.util.find_spec("tokenizers") is not None)
        print(f"wrote a random {args.preset} checkpoint to {args.write_tiny}")
        return 0
    if args.bench:
        result = bench(args)
        print_bench(result)
        ok = all("error" not in r for r in result.values())
        record = dict(bench=result)
    else:
        record = compare(args)
        ok = print_compare(record)
        record["passed"] = ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
