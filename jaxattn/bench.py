"""Benchmarks: jaxattn beside its peers and the physical floor, on the shapes of ../shared/anchors.md.

    python -m jaxattn.bench decode [--cases D1,D2] [--json out.json] [--plot out.png] [--sweep]
    python -m jaxattn.bench extend [--cases E1] [--json out.json] [--plot out.png] [--sweep]
    python -m jaxattn.bench plot results/decode.json results/extend.json -o plot.png


Every backend is timed the same way in one process on one GPU: N back-to-back calls on device-resident
inputs, then one synchronisation; the figure is the median over repeats of (elapsed / N). Inputs are
random normal (never zeros) and every sequence's KV slots are scattered at random over the pool, as a
real allocator leaves them. Floors: decode reads every K and V byte once at 4.3 TB/s; extend does
2 * q_heads * (qk_head_dim + v_head_dim) * new * (prefix + (new + 1) / 2) FLOPs per sequence at 790 TFLOP/s.
Peers that are not installed (FlashInfer, torch) or not supported for a shape are skipped with a note.
Each run prints a markdown table; `--json` keeps the rows (with device, date and commit: git's, or
$JAXATTN_COMMIT where the checkout has no .git) and `--plot` draws fraction-of-floor bars (matplotlib, the
`jaxattn[bench]` extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import numpy as np

COPY_BANDWIDTH_BYTES_PER_S = 4.3e12  # measured device-to-device copy on the H200 (bytes read + written)
BF16_MATMUL_FLOPS = 790e12  # measured bf16 matmul on the H200


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    op: str  # "decode" | "extend"
    batch: int
    prefix: int  # cached tokens per sequence (decode: the context before the new token)
    new: int  # new tokens per sequence (decode: 1)
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    v_head_dim: int | None = None
    default: bool = True  # part of the op's default run (the tuning cases below are run by name)

    @property
    def dv(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def v_in_k(self) -> bool:
        """MLA: one latent KV head whose first Dv dims are V, so the pool is read once."""
        return self.v_head_dim is not None and self.kv_heads == 1

    def floor_ms(self) -> float:
        if self.op == "decode":
            tokens = self.batch * (self.prefix + self.new)
            per_token = self.kv_heads * (self.head_dim if self.v_in_k else self.head_dim + self.dv)
            return tokens * per_token * 2 / COPY_BANDWIDTH_BYTES_PER_S * 1e3
        # QK^T and PV: 2 * (Dqk + Dv) FLOPs per visible (query, key) pair and head.
        flops = 2 * self.q_heads * (self.head_dim + self.dv) * self.new * (self.prefix + (self.new + 1) / 2) * self.batch
        return flops / BF16_MATMUL_FLOPS * 1e3


CASES = {
    "D1": Case("D1", "decode", 64, 4095, 1),
    "D2": Case("D2", "decode", 8, 32767, 1),
    "D3": Case("D3", "decode", 256, 1023, 1),
    "MLA": Case("MLA", "decode", 64, 4095, 1, q_heads=16, kv_heads=1, head_dim=576, v_head_dim=512),
    # MHA (32 q heads, 32 kv heads): the vector kernel's shape, same bytes as D1 (floor 0.250 ms).
    "MHA": Case("MHA", "decode", 16, 4095, 1, q_heads=32, kv_heads=32),
    "E1": Case("E1", "extend", 8, 2048, 2048),
    "E2": Case("E2", "extend", 4, 0, 4096),
    "E3": Case("E3", "extend", 32, 4096, 128),
    # Tuning cases: one per head-dim family of jaxattn.extend.SM90_CONFIGS other than "128" (E1-E3), E1's lengths
    # unless noted. Run by name (`--cases T64,...`); not in the default extend run.
    "T64": Case("T64", "extend", 8, 2048, 2048, q_heads=32, kv_heads=8, head_dim=64, default=False),
    "T256": Case("T256", "extend", 8, 2048, 2048, q_heads=16, kv_heads=8, head_dim=256, default=False),  # Gemma-2-like
    # DeepSeek-V3 MHA prefill (not absorbed), 16 heads of a tensor-parallel shard.
    "T192": Case("T192", "extend", 8, 2048, 2048, q_heads=16, kv_heads=16, head_dim=192, v_head_dim=128, default=False),
    # Absorbed MLA over the latent cache (one KV head, V = first 512 dims of K): short extends (chunked prefill tail,
    # speculative verify) over long prefixes.
    "T576": Case("T576", "extend", 16, 4096, 256, q_heads=16, kv_heads=1, head_dim=576, v_head_dim=512, default=False),
    "T288": Case("T288", "extend", 16, 4096, 256, q_heads=16, kv_heads=1, head_dim=288, v_head_dim=256, default=False),
}


def time_calls(fn: Callable[[], object], sync: Callable[[object], None], *, target_ms: float = 30.0, repeats: int = 9,
               warmup: int = 3) -> float:
    """Median milliseconds per call of `fn`, called back to back about `target_ms` per repeat, then synchronised."""
    for _ in range(warmup):
        sync(fn())
    start = time.perf_counter()
    sync(fn())
    estimate_ms = (time.perf_counter() - start) * 1e3
    calls = int(min(200, max(5, target_ms / max(estimate_ms, 1e-3))))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            result = fn()
        sync(result)
        samples.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(samples) / getattr(fn, "calls", 1)


# ---------------------------------------------------------------------------------------------
# Inputs


@dataclasses.dataclass
class Inputs:
    case: Case
    q: object  # jax [T, Hq, D]
    k_pool: object  # jax [S, Hkv, D]
    v_pool: object  # jax [S, Hkv, Dv]
    req_to_token: object  # jax i32[B, max_ctx]
    req_pool_indices: object  # jax i32[B]
    prefix_lens: object  # jax i32[B]
    seq_lens: object  # jax i32[B] (prefix + new)
    qo_indptr: object  # jax i32[B+1]
    kv_indptr: object  # jax i32[B+1] over whole sequences
    kv_indices: object  # jax i32[total]
    prefix_indptr: object
    prefix_indices: object
    new_slots: object  # jax i32[T]: the slots of the new tokens (out_cache_loc)
    k_new: object
    v_new: object


def make_inputs(case: Case, seed: int = 0) -> Inputs:
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    b, p, n = case.batch, case.prefix, case.new
    total = b * (p + n)
    num_slots = total + 1  # slot 0 is the padding slot
    slots = (rng.permutation(total) + 1).astype(np.int32).reshape(b, p + n)
    key = jax.random.key(seed)
    kq, kk, kv = jax.random.split(key, 3)
    dtype = jnp.bfloat16
    k_pool = jax.random.normal(kk, (num_slots, case.kv_heads, case.head_dim), dtype)
    if case.v_in_k:
        v_pool = k_pool[:, :, : case.dv]  # MLA: V is the first Dv dims of the latent K
    else:
        v_pool = jax.random.normal(kv, (num_slots, case.kv_heads, case.dv), dtype)
    q = jax.random.normal(kq, (b * n, case.q_heads, case.head_dim), dtype)
    seq_lens = np.full(b, p + n, np.int32)
    indptr = np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32)
    prefix_indptr = np.arange(b + 1, dtype=np.int32) * p
    new_slots = slots[:, p:].reshape(-1)
    to = jnp.asarray
    return Inputs(
        case=case,
        q=q,
        k_pool=k_pool,
        v_pool=v_pool,
        req_to_token=to(slots),
        req_pool_indices=to(np.arange(b, dtype=np.int32)),
        prefix_lens=to(np.full(b, p, np.int32)),
        seq_lens=to(seq_lens),
        qo_indptr=to(np.arange(b + 1, dtype=np.int32) * n),
        kv_indptr=to(indptr),
        kv_indices=to(slots.reshape(-1)),
        prefix_indptr=to(prefix_indptr),
        prefix_indices=to(slots[:, :p].reshape(-1)),
        new_slots=to(new_slots),
        k_new=k_pool[to(new_slots)],
        v_new=v_pool[to(new_slots)],
    )


def _jax_sync(x):
    import jax

    jax.block_until_ready(x)


def _torch_sync(_):
    import torch

    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# Backends: each returns a zero-argument callable running one step, or raises Skip.


class Skip(Exception):
    pass


def _decode_jaxattn(inp: Inputs, config=None, programs_per_sm=None):
    import jax

    from jaxattn import decode

    case = inp.case
    split_kw = {} if programs_per_sm is None else dict(programs_per_sm=programs_per_sm)
    meta = decode.decode_metadata_from_indptr(
        inp.kv_indptr, inp.kv_indices, inp.seq_lens, q_heads=case.q_heads, kv_heads=case.kv_heads, **split_kw
    )
    if case.v_in_k:  # MLA: V is the first Dv dims of the latent K; the kernel reads the pool once
        fn = jax.jit(lambda q, k, m: decode.decode_attention(q, k, None, m, v_head_dim=case.dv, config=config))
        return lambda: fn(inp.q, inp.k_pool, meta)
    fn = jax.jit(lambda q, k, v, m: decode.decode_attention(q, k, v, m, config=config))
    return lambda: fn(inp.q, inp.k_pool, inp.v_pool, meta)


def _decode_reference(inp: Inputs):
    import jax

    from jaxattn.reference import ragged_paged_attention_reference

    case = inp.case
    if case.batch * case.q_heads * (case.prefix + 1) * 4 > 8e9:
        raise Skip("reference too large")
    max_len = case.prefix + case.new
    fn = jax.jit(
        lambda q, k, v, qo, kvp, kvi: ragged_paged_attention_reference(q, k, v, qo, kvp, kvi, max_q_len=1, max_kv_len=max_len)
    )
    return lambda: fn(inp.q, inp.k_pool, inp.v_pool, inp.qo_indptr, inp.kv_indptr, inp.kv_indices)


def _torch_views(inp: Inputs):
    try:
        import torch
    except ImportError:
        raise Skip("torch not installed")
    t = torch.from_dlpack
    return torch, {name: t(getattr(inp, name)) for name in ("q", "k_pool", "v_pool", "kv_indptr", "kv_indices", "qo_indptr")}


def _decode_flashinfer(inp: Inputs, tensor_cores: bool, through_jax: bool = False, layers: int = 1):
    case = inp.case
    if case.v_head_dim is not None:
        raise Skip("MLA shapes need FlashInfer's MLA wrapper")
    try:
        import flashinfer
    except ImportError:
        raise Skip("flashinfer not installed")
    torch, tv = _torch_views(inp)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
    last_page_len = torch.ones(case.batch, dtype=torch.int32, device="cuda")
    wrapper.plan(
        tv["kv_indptr"], tv["kv_indices"], last_page_len, case.q_heads, case.kv_heads, case.head_dim, 1,
        q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
    )
    k = tv["k_pool"].unsqueeze(1)  # [slots, page_size 1, Hkv, D]
    v = tv["v_pool"].unsqueeze(1)
    q = tv["q"]
    if through_jax:
        return _bridged(wrapper, inp, layers)
    return lambda: wrapper.run(q, (k, v))


def _bridged(wrapper, inp: Inputs, layers: int = 1):
    """The same planned wrapper, called from a jitted JAX function through jaxattn's DLPack bridge.

    layers > 1: one jitted step makes that many calls, like a model's attention layers (time_calls divides by it),
    so the per-call dispatch of the jitted function is shared as in a real forward step.
    """
    import jax

    from jaxattn.flashinfer_backend import bridged_run

    def step(q, k, v):
        return [bridged_run(wrapper, q, k, v, inp.case.dv, has_side_effect=layers > 1)[0] for _ in range(layers)]

    fn = jax.jit(step)
    return PerCall(lambda: fn(inp.q, inp.k_pool, inp.v_pool), layers)


@dataclasses.dataclass
class PerCall:
    """A callable that runs `calls` kernel calls at once; time_calls reports the time per kernel call."""

    fn: Callable[[], object]
    calls: int

    def __call__(self):
        return self.fn()


def extend_meta(inp: Inputs, unified: bool = False):
    """The case's `ExtendMetadata` (or `ExtendUnifiedMetadata`): every sequence extends by case.new over case.prefix."""
    import jax.numpy as jnp

    from jaxattn import extend

    case = inp.case
    extend_lens = jnp.full((case.batch,), case.new, jnp.int32)
    sizes = dict(max_extend_len=case.new, kv_capacity=case.batch * (case.prefix + case.new))
    if unified:
        return extend.extend_unified_metadata(inp.req_to_token, inp.req_pool_indices, inp.prefix_lens, extend_lens,
                                              inp.new_slots, **sizes)
    return extend.extend_metadata(inp.req_to_token, inp.req_pool_indices, inp.prefix_lens, extend_lens, **sizes)


def _extend_jaxattn(inp: Inputs, config=None, unified=False, impl="triton"):
    import jax

    from jaxattn import extend

    meta = extend_meta(inp, unified)
    if unified:
        fn = jax.jit(lambda q, k, v, m: extend.extend_attention_unified(q, k, v, m, config=config))
        return lambda: fn(inp.q, inp.k_pool, inp.v_pool, meta)
    fn = jax.jit(lambda q, kn, vn, k, v, m: extend.extend_attention(q, kn, vn, k, v, m, config=config, impl=impl))
    return lambda: fn(inp.q, inp.k_new, inp.v_new, inp.k_pool, inp.v_pool, meta)


def _extend_mgpu(inp: Inputs, config=None):
    import jax

    from jaxattn.extend_mgpu import extend_attention_mgpu

    case = inp.case
    if case.head_dim not in (64, 128) or case.dv != case.head_dim:
        raise Skip("the Mosaic GPU kernel takes equal q/k and v head dims of 64 or 128")
    meta = extend_meta(inp)
    fn = jax.jit(lambda q, kn, vn, k, v, m: extend_attention_mgpu(q, kn, vn, k, v, m, config=config))
    return lambda: fn(inp.q, inp.k_new, inp.v_new, inp.k_pool, inp.v_pool, meta)


def _extend_reference(inp: Inputs):
    import jax

    from jaxattn.reference import ragged_paged_attention_reference

    case = inp.case
    fn = jax.jit(
        lambda q, k, v, qo, kvp, kvi: ragged_paged_attention_reference(
            q, k, v, qo, kvp, kvi, max_q_len=case.new, max_kv_len=case.prefix + case.new
        )
    )
    return lambda: fn(inp.q, inp.k_pool, inp.v_pool, inp.qo_indptr, inp.kv_indptr, inp.kv_indices)


def _extend_flashinfer(inp: Inputs, backend: str, through_jax: bool = False):
    case = inp.case
    try:
        import flashinfer
    except ImportError:
        raise Skip("flashinfer not installed")
    if case.v_in_k:
        raise Skip("MLA latent cache: FlashInfer's paged prefill takes separate K and V heads (its MLA wrapper is not wired here)")
    torch, tv = _torch_views(inp)
    workspace = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
    last_page_len = torch.ones(case.batch, dtype=torch.int32, device="cuda")
    wrapper.plan(
        tv["qo_indptr"], tv["kv_indptr"], tv["kv_indices"], last_page_len, case.q_heads, case.kv_heads, case.head_dim, 1,
        head_dim_vo=case.dv, causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
    )
    k = tv["k_pool"].unsqueeze(1)
    v = tv["v_pool"].unsqueeze(1)
    q = tv["q"]
    if through_jax:
        return _bridged(wrapper, inp)
    return lambda: wrapper.run(q, (k, v))


def _extend_cudnn(inp: Inputs):
    import jax

    case = inp.case
    if case.prefix != 0:
        raise Skip("dense only (no cached prefix)")
    q = inp.q.reshape(case.batch, case.new, case.q_heads, case.head_dim)
    k = inp.k_new.reshape(case.batch, case.new, case.kv_heads, case.head_dim)
    v = inp.v_new.reshape(case.batch, case.new, case.kv_heads, case.dv)
    fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    return lambda: fn(q, k, v)


BACKENDS = {
    "decode": {
        "jaxattn": (_decode_jaxattn, _jax_sync),
        "flashinfer": (lambda inp: _decode_flashinfer(inp, False), _torch_sync),
        "flashinfer-tc": (lambda inp: _decode_flashinfer(inp, True), _torch_sync),
        "flashinfer-in-jit": (lambda inp: _decode_flashinfer(inp, False, through_jax=True), _jax_sync),
        "flashinfer-in-jit-8-layers": (lambda inp: _decode_flashinfer(inp, False, through_jax=True, layers=8), _jax_sync),
        "reference": (_decode_reference, _jax_sync),
    },
    "extend": {
        "jaxattn": (lambda inp: _extend_jaxattn(inp, impl=None), _jax_sync),  # what extend_attention picks
        "jaxattn-triton": (_extend_jaxattn, _jax_sync),
        "jaxattn-unified": (lambda inp: _extend_jaxattn(inp, unified=True), _jax_sync),
        "flashinfer-fa2": (lambda inp: _extend_flashinfer(inp, "fa2"), _torch_sync),
        "flashinfer-fa3": (lambda inp: _extend_flashinfer(inp, "fa3"), _torch_sync),
        "flashinfer-fa3-in-jit": (lambda inp: _extend_flashinfer(inp, "fa3", through_jax=True), _jax_sync),
        "cudnn": (_extend_cudnn, _jax_sync),
        "reference": (_extend_reference, _jax_sync),
    },
}


def _device_name() -> str:
    import jax

    return getattr(jax.devices()[0], "device_kind", str(jax.devices()[0]))


def _commit() -> str:
    """$JAXATTN_COMMIT when set (the GPU machine's copy of the tree), else the checkout's short hash (+dirty)."""
    if os.environ.get("JAXATTN_COMMIT"):
        # Checked first: on the GPU machine a git lookup can find some other repository's HEAD.
        return os.environ["JAXATTN_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True)
        if head.returncode == 0 and head.stdout.strip():
            dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "."], cwd=here, capture_output=True).returncode != 0
            return head.stdout.strip() + ("+dirty" if dirty else "")
    except OSError:
        pass
    return "unknown"


def _progress(total: int, desc: str):
    """A tqdm bar over the sweep's work items, or None when tqdm is missing."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="item", leave=False, dynamic_ncols=True)


def run(op: str, cases: list, backends: list[str] | None = None, sweep: bool = False, log=print,
        progress: bool = True) -> list[dict]:
    """Times every (case, backend or config) work item; returns one row per timed item.

    `cases` are names from CASES or `Case` objects. A failing or skipped item is logged, never fatal.
    """
    rows = []
    device, commit, date = _device_name(), _commit(), datetime.date.today().isoformat()
    cases = [CASES[c] if isinstance(c, str) else c for c in cases]
    work = []  # (case, backend label, maker, sync)
    for case in cases:
        if case.op != op:
            raise SystemExit(f"case {case.name} is a {case.op} case, not {op}")
        chosen = BACKENDS[op] if backends is None else {b: BACKENDS[op][b] for b in backends}
        work += [(case, backend, maker, sync) for backend, (maker, sync) in chosen.items()]
        if sweep:
            work += [(case, f"sweep[{label}]", maker, _jax_sync) for label, maker in _sweep_variants(op, case)]
    bar = _progress(len(work), f"bench {op}") if progress else None
    say = log if bar is None else (lambda line: bar.write(line))
    inp = None
    for case, backend, maker, sync in work:
        if bar is not None:
            bar.set_postfix_str(f"{case.name} {backend}", refresh=False)
        if inp is None or inp.case != case:
            inp = None  # free the previous case's arrays first
            inp = make_inputs(case)
        floor = case.floor_ms()
        try:
            fn = maker(inp)
            ms = time_calls(fn, sync)
        except Skip as why:
            say(f"  {case.name:4s} {backend:24s} skipped: {why}")
            continue
        except Exception as error:  # a peer that fails must not hide the others
            say(f"  {case.name:4s} {backend:24s} FAILED: {type(error).__name__}: {str(error)[:300]}")
            continue
        finally:
            if bar is not None:
                bar.update(1)
        row = dict(op=op, case=case.name, backend=backend, median_ms=round(ms, 4), floor_ms=round(floor, 4),
                   fraction_of_floor=round(floor / ms, 3), device=device, commit=commit, date=date)
        rows.append(row)
        say(f"  {case.name:4s} {backend:24s} {ms:8.3f} ms  floor {floor:6.3f} ms  {100 * floor / ms:5.1f}% of floor")
    if bar is not None:
        bar.close()
    return rows


def _sweep_variants(op: str, case: Case):
    """(label, maker) for candidate kernel configurations of this shape: what a tuning table should pick from."""
    variants = []
    if op == "decode":
        from jaxattn.decode import DecodeConfig

        for block_n in (32, 64, 128):
            for num_warps in (4, 8):
                for num_stages in (2, 3, 4):
                    if case.head_dim > 256 and (block_n > 64 or num_stages > 3):
                        continue  # MLA tiles: shared memory
                    config = DecodeConfig(block_n=block_n, num_warps=num_warps, num_stages=num_stages)
                    label = f"n{block_n} w{num_warps} s{num_stages}"
                    variants.append((label, lambda inp, c=config: _decode_jaxattn(inp, config=c)))
        if case.q_heads == case.kv_heads:  # MHA: the vector kernel's tiles beside the grouped kernel's above
            for block_n in (32, 64, 128):
                for num_warps in (2, 4, 8):
                    config = DecodeConfig(block_n=block_n, block_h=1, num_warps=num_warps, num_stages=1)
                    variants.append((f"vector n{block_n} w{num_warps}", lambda inp, c=config: _decode_jaxattn(inp, config=c)))
        for programs_per_sm in (4, 16):
            variants.append((f"default pps{programs_per_sm}", lambda inp, p=programs_per_sm: _decode_jaxattn(inp, programs_per_sm=p)))
    else:
        from jaxattn.extend import ExtendConfig

        for block_m, block_n, num_warps in ((64, 64, 4), (128, 64, 8), (128, 128, 8), (64, 128, 4), (128, 32, 8)):
            for num_stages in (2, 3):
                if case.head_dim > 256 and block_m > 64:
                    continue
                config = ExtendConfig(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
                label = f"m{block_m} n{block_n} w{num_warps} s{num_stages}"
                variants.append((label, lambda inp, c=config: _extend_jaxattn(inp, config=c)))
    return variants


def markdown_table(rows: list[dict]) -> str:
    cases = list(dict.fromkeys(r["case"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    lines = ["| backend | " + " | ".join(f"{c} (floor {next(r['floor_ms'] for r in rows if r['case'] == c):.3f} ms)" for c in cases) + " |"]
    lines.append("|---|" + "---|" * len(cases))
    for b in backends:
        cells = []
        for c in cases:
            r = next((r for r in rows if r["case"] == c and r["backend"] == b), None)
            cells.append("-" if r is None else f"{r['median_ms']:.3f} ms ({100 * r['fraction_of_floor']:.0f}%)")
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Plot: fraction of the floor per case and backend (matplotlib, imported only here).

LABELS = {
    "jaxattn": "jaxattn",
    "jaxattn-unified": "jaxattn unified (deterministic)",
    "jaxattn-triton": "jaxattn two-stage (Triton)",
    "flashinfer": "FlashInfer",
    "flashinfer-tc": "FlashInfer, tensor cores",
    "flashinfer-in-jit": "FlashInfer from jit (bridge)",
    "flashinfer-in-jit-8-layers": "FlashInfer from jit (bridge), 8 layers per step",
    "flashinfer-fa2": "FlashInfer fa2",
    "flashinfer-fa3": "FlashInfer fa3",
    "flashinfer-fa3-in-jit": "FlashInfer fa3 from jit (bridge)",
    "cudnn": "cuDNN (dense only)",
    "reference": "reference (jnp)",
}
FLOOR_NOTES = {
    "decode": f"decode: % of the memory floor (K and V read once at {COPY_BANDWIDTH_BYTES_PER_S / 1e12:.1f} TB/s)",
    "extend": f"extend: % of the matmul floor (bf16 at {BF16_MATMUL_FLOPS / 1e12:.0f} TFLOP/s)",
}


def _require_matplotlib():
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit(
            "jaxattn.bench: plotting needs matplotlib: pip install 'jaxattn[bench]' (or pip install matplotlib). "
            f"Import failed with: {error}"
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _case_label(name: str) -> str:
    case = CASES.get(name)
    if case is None:
        return name
    if case.op == "decode":
        shape = f"{case.batch} x {case.prefix + case.new}"
    else:
        shape = f"{case.batch} x ({case.prefix}+{case.new})"
    if case.v_head_dim is not None:
        shape += f"\n{case.q_heads}/{case.kv_heads} heads, {case.head_dim}/{case.dv}"
    return f"{name}\n{shape}"


def _summary(rows: list[dict], key: str) -> str:
    values = list(dict.fromkeys(str(r.get(key, "?")) for r in rows))
    return ", ".join(values) if values else "?"


def plot_rows(rows: list[dict], path: str, title: str | None = None, include_sweeps: bool = False) -> str:
    """Writes a PNG of grouped bars (one group per case, one bar per backend) of % of the floor; returns `path`.

    One panel per op in `rows`; the dashed line is the floor (100%). Sweep rows ("sweep[...]") are left out
    unless `include_sweeps`.
    """
    plt = _require_matplotlib()
    if not include_sweeps:
        rows = [r for r in rows if not r["backend"].startswith("sweep[")]
    if not rows:
        raise ValueError("no rows to plot")
    ops = [op for op in ("decode", "extend") if any(r["op"] == op for r in rows)]
    ops += sorted({r["op"] for r in rows} - set(ops))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    palette = plt.get_cmap("tab10").colors
    colour = {b: palette[i % len(palette)] for i, b in enumerate(backends)}
    widths = [max(2, len({r["case"] for r in rows if r["op"] == op})) for op in ops]
    top = max(110.0, 100 * max(r["fraction_of_floor"] for r in rows) + 15)
    fig, axes = plt.subplots(1, len(ops), figsize=(2.2 * sum(widths) + 1.5, 6.0), squeeze=False,
                             gridspec_kw=dict(width_ratios=widths))
    for ax, op in zip(axes[0], ops):
        op_rows = [r for r in rows if r["op"] == op]
        cases = list(dict.fromkeys(r["case"] for r in op_rows))
        op_backends = [b for b in backends if any(r["backend"] == b for r in op_rows)]
        op_backends.sort(key=lambda b: b == "reference")  # the slow oracle last
        bar_width = 0.84 / len(op_backends)
        labelled = set()
        for i, case in enumerate(cases):
            present = [(b, r) for b in op_backends for r in op_rows if r["case"] == case and r["backend"] == b]
            for j, (backend, row) in enumerate(present):  # centred on the case: no gaps for skipped backends
                x = i + bar_width * (j - (len(present) - 1) / 2)
                y = 100 * row["fraction_of_floor"]
                label = LABELS.get(backend, backend) if backend not in labelled else "_nolegend_"
                labelled.add(backend)
                ax.bar([x], [y], bar_width, color=colour[backend], label=label,
                       edgecolor="black" if backend == "jaxattn" else "none", linewidth=1.0)
                ax.annotate(f"{y:.0f}", (x, y), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                            fontsize=7)
        handles, labels = ax.get_legend_handles_labels()
        order = sorted(range(len(labels)), key=lambda k: [LABELS.get(b, b) for b in op_backends].index(labels[k]))
        ax.axhline(100, color="black", linestyle="--", linewidth=1)
        ax.text(len(cases) - 0.5, 101, "floor", ha="right", va="bottom", fontsize=8)
        ax.set_xticks(range(len(cases)), [_case_label(c) for c in cases], fontsize=8)
        ax.set_xlim(-0.5, len(cases) - 0.5)
        ax.set_ylim(0, top)
        ax.set_title(FLOOR_NOTES.get(op, op), fontsize=9)
        ax.set_ylabel("% of floor (higher is better)")
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        ax.legend([handles[k] for k in order], [labels[k] for k in order], fontsize=7, loc="upper center",
                  bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    if title is None:
        title = (f"jaxattn benchmarks on {_summary(rows, 'device')}, {_summary(rows, 'date')}, "
                 f"commit {_summary(rows, 'commit')}")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def load_rows(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        with open(path) as f:
            rows += json.load(f)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for op in ("decode", "extend"):
        p = sub.add_parser(op, help=f"time the {op} cases")
        p.add_argument("--cases", default=None, help="comma-separated case names (default: all of the op)")
        p.add_argument("--backends", default=None, help="comma-separated backends (default: all)")
        p.add_argument("--json", default=None, help="write the rows to this JSON file")
        p.add_argument("--plot", default=None, help="write a PNG of %% of floor per case and backend (needs matplotlib)")
        p.add_argument("--sweep", action="store_true", help="also time every candidate kernel configuration")
        p.add_argument("--no-progress", action="store_true", help="no progress bar; one line per item instead")
    p = sub.add_parser("plot", help="plot saved JSON records")
    p.add_argument("records", nargs="+", help="JSON files written by --json")
    p.add_argument("-o", "--output", required=True, help="the PNG to write")
    p.add_argument("--title", default=None)
    p.add_argument("--sweeps", action="store_true", help="include sweep[...] rows")
    args = parser.parse_args(argv)
    if args.command == "plot":
        rows = load_rows(args.records)
        print(markdown_table(rows))
        print(f"wrote {plot_rows(rows, args.output, title=args.title, include_sweeps=args.sweeps)}")
        return 0
    if args.plot:
        _require_matplotlib()  # fail before the sweep, not after it
    case_names = args.cases.split(",") if args.cases else [n for n, c in CASES.items() if c.op == args.command and c.default]
    backends = args.backends.split(",") if args.backends else None
    print(f"jaxattn.bench {args.command}: device {_device_name()}, commit {_commit()}")
    rows = run(args.command, case_names, backends, sweep=args.sweep, log=lambda s: print(s, flush=True),
               progress=not args.no_progress)
    print()
    print(markdown_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot and rows:
        print(f"wrote {plot_rows(rows, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
