"""The benchmark shapes (the anchor shapes of benchmarks/ANCHORS.md plus the tuning cases) and their physical floors."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """What one GPU measured (benchmarks/experiments/ceilings.py): the rates the floors divide by."""

    copy_bytes_per_s: float  # device-to-device copy, bytes read + written per second
    bf16_matmul_flops: float  # dense bf16 matmul, FLOP/s


# Keyed by JAX's device_kind. A device not listed gets the reference part's (the H200's) and the report says so.
CEILINGS = {
    "NVIDIA H200": Ceilings(copy_bytes_per_s=4.3e12, bf16_matmul_flops=790e12),
    # 2026-12-05 (results/2026-12-05_h100_ceilings_b8a97ef.log): torch's memcpy 3.00 TB/s (90% of the part's 3.35, as
    # the H200's 4.3 is of 4.8; XLA's elementwise copy reached only 2.53-2.63), XLA's matmul 651-674 TFLOP/s.
    "NVIDIA H100 80GB HBM3": Ceilings(copy_bytes_per_s=3.0e12, bf16_matmul_flops=670e12),
}
REFERENCE_DEVICE = "NVIDIA H200"
COPY_BANDWIDTH_BYTES_PER_S = CEILINGS[REFERENCE_DEVICE].copy_bytes_per_s
BF16_MATMUL_FLOPS = CEILINGS[REFERENCE_DEVICE].bf16_matmul_flops


def ceilings_for(device_kind: str | None) -> tuple[str, Ceilings]:
    """(the device whose figures apply, its Ceilings): `device_kind`'s own, else the reference part's."""
    if device_kind in CEILINGS:
        return device_kind, CEILINGS[device_kind]
    return REFERENCE_DEVICE, CEILINGS[REFERENCE_DEVICE]


def device_name() -> str:
    """The device this process runs on, as JAX names its kind (the key of CEILINGS)."""
    import jax  # here, so that the case table imports without a backend

    return getattr(jax.devices()[0], "device_kind", str(jax.devices()[0]))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    op: str  # "decode" | "extend"
    batch: int
    prefix: int  # cached tokens per sequence (decode: the context before the new token)
    new: int  # new tokens per sequence (decode: 1, or the query tokens of a verify step)
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    v_head_dim: int | None = None
    default: bool = True  # part of the op's default run (the tuning cases below are run by name)
    # Score features (extend): every backend of the case runs with the same ones; the floor counts visible pairs.
    sliding_window: int = -1  # W >= 0: a query sees itself and the W previous keys
    logit_cap: float = 0.0
    sinks: bool = False  # per-head sinks near the rows' log-denominators (so they change the output)
    causal: bool = True  # False: every query sees its whole sequence (encoder tokens, cross attention)
    xai_temperature_len: int = -1  # L > 0: Grok's temperature on positions past L (no FlashInfer peer)
    # The new tokens are speculative drafts under a random tree (`draft_tree`): each sees the whole prefix, itself and
    # its ancestors, given as a custom mask (TARGET_VERIFY); the same tree in every sequence.
    tree: bool = False
    kv_dtype: str = "bfloat16"  # the pool's dtype: "float8_e4m3fn" pools are read by the kernels with K/V scales
    # KV pages (jaxattn.paging): each sequence's pages scattered over the pool, its tokens contiguous within a page.
    # Page size 1 scatters every token. Set by `paged_case`, which also names the case.
    page_size: int = 1

    @property
    def dv(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def v_in_k(self) -> bool:
        """MLA: one latent KV head whose first Dv dims are V, so the pool is read once."""
        return self.v_head_dim is not None and self.kv_heads == 1

    @property
    def fp8(self) -> bool:
        return self.kv_dtype.startswith("float8")

    def floor_ms(self, ceilings: Ceilings | None = None) -> float:
        """The floor on `ceilings`' GPU (default: the one this process runs on, see `ceilings_for`)."""
        if ceilings is None:
            ceilings = ceilings_for(device_name())[1]
        if self.op == "decode":
            # Reading the pool once: 2 bytes per element, 1 for an fp8 pool (its own floor, half the bf16 one).
            tokens = self.batch * (self.prefix + self.new)
            per_token = self.kv_heads * (self.head_dim if self.v_in_k else self.head_dim + self.dv)
            return tokens * per_token * (1 if self.fp8 else 2) / ceilings.copy_bytes_per_s * 1e3
        # QK^T and PV: 2 * (Dqk + Dv) FLOPs per visible (query, key) pair and head.
        flops = 2 * self.q_heads * (self.head_dim + self.dv) * self.visible_pairs() * self.batch
        return flops / ceilings.bf16_matmul_flops * 1e3

    def visible_pairs(self) -> float:
        """(query, key) pairs one sequence's queries see: causal, and at most W + 1 keys each under a window."""
        if not self.causal:
            return float(self.new * (self.prefix + self.new))
        if self.tree:
            tree = draft_tree(self.new)
            if self.sliding_window < 0:
                return float(self.new * self.prefix + tree.sum())
            # Draft i sits at list position prefix + i: it sees prefix keys p >= prefix + i - W and its ancestors j
            # with i - j <= W.
            i = np.arange(self.new)
            prefix_seen = np.minimum(self.prefix, np.maximum(self.sliding_window - i, 0))
            return float(prefix_seen.sum() + (tree & (i[:, None] - i[None, :] <= self.sliding_window)).sum())
        if self.sliding_window < 0:
            return self.new * (self.prefix + (self.new + 1) / 2)
        return float(sum(min(self.prefix + i + 1, self.sliding_window + 1) for i in range(self.new)))

    @property
    def features(self) -> dict:
        """The extend ops' keyword arguments for this case's score features (sinks are passed as an array)."""
        return dict(sliding_window=self.sliding_window, logit_cap=self.logit_cap, causal=self.causal,
                    xai_temperature_len=self.xai_temperature_len)


def draft_tree(new: int, seed: int = 0) -> np.ndarray:
    """bool[new, new]: a random draft tree over `new` tokens in topological order (token j's parent is one of the
    tokens before it, or the prefix), row j true at j and its ancestors."""
    rng = np.random.default_rng(seed)
    mask = np.eye(new, dtype=bool)
    for j in range(1, new):
        parent = int(rng.integers(-1, j))
        if parent >= 0:
            mask[j] |= mask[parent]
    return mask


CASES = {
    "D1": Case("D1", "decode", 64, 4095, 1),
    "D2": Case("D2", "decode", 8, 32767, 1),
    "D3": Case("D3", "decode", 256, 1023, 1),
    "MLA": Case("MLA", "decode", 64, 4095, 1, q_heads=16, kv_heads=1, head_dim=576, v_head_dim=512),
    # Issue 22's longer MLA shape, and a speculative verify step on MLA's shape: 4 query tokens per sequence (causal
    # over the drafts), the same 4096 keys per sequence, so the same floor as MLA.
    "MLA-L": Case("MLA-L", "decode", 128, 8191, 1, q_heads=16, kv_heads=1, head_dim=576, v_head_dim=512),
    "MLA-V4": Case("MLA-V4", "decode", 64, 4092, 4, q_heads=16, kv_heads=1, head_dim=576, v_head_dim=512),
    "D1-V4": Case("D1-V4", "decode", 64, 4092, 4),  # D1's sequences, the last 4 tokens verified (GQA 32/8)
    # MHA (32 q heads, 32 kv heads): the vector kernel's shape, same bytes as D1 (floor 0.250 ms).
    "MHA": Case("MHA", "decode", 16, 4095, 1, q_heads=32, kv_heads=32),
    # fp8 (e4m3fn) pools, the kernels reading them directly (issue 26): each beside its bf16 case and FlashInfer's fp8.
    "D1-FP8": Case("D1-FP8", "decode", 64, 4095, 1, kv_dtype="float8_e4m3fn"),
    "D2-FP8": Case("D2-FP8", "decode", 8, 32767, 1, kv_dtype="float8_e4m3fn"),
    "D3-FP8": Case("D3-FP8", "decode", 256, 1023, 1, kv_dtype="float8_e4m3fn"),
    "MLA-FP8": Case("MLA-FP8", "decode", 64, 4095, 1, q_heads=16, kv_heads=1, head_dim=576, v_head_dim=512,
                    kv_dtype="float8_e4m3fn"),
    # MLA-V4 over an fp8 latent cache, by name: the MLA kernel's padded tile (the default since 815627c; H200,
    # a56875d: 0.154 ms) against the Triton kernel (`jaxattn-triton`; 0.504 ms).
    "MLA-V4-FP8": Case("MLA-V4-FP8", "decode", 64, 4092, 4, q_heads=16, kv_heads=1, head_dim=576, v_head_dim=512,
                       kv_dtype="float8_e4m3fn", default=False),
    "E1": Case("E1", "extend", 8, 2048, 2048),
    "E2": Case("E2", "extend", 4, 0, 4096),
    "E3": Case("E3", "extend", 32, 4096, 128),
    # E1 with the score features of Gemma-2 (window 1024 and soft cap 50 layers) and GPT-OSS (sinks): each beside the
    # peers with the same feature (sinks: FlashInfer's sink-aware wrapper, its paged prefill with a sink variant).
    "E1-W1024": Case("E1-W1024", "extend", 8, 2048, 2048, sliding_window=1024),
    "E1-CAP50": Case("E1-CAP50", "extend", 8, 2048, 2048, logit_cap=50.0),
    "E1-W1024-CAP50": Case("E1-W1024-CAP50", "extend", 8, 2048, 2048, sliding_window=1024, logit_cap=50.0),
    "E1-SINKS": Case("E1-SINKS", "extend", 8, 2048, 2048, sinks=True),
    # Encoder tokens (non-causal): E2's lengths, every query sees its whole sequence. Grok-1's layers: xai temperature
    # (L = 1024: positions 1025.. of E1's 4096 are scaled) and soft cap 30.
    "E2-NC": Case("E2-NC", "extend", 4, 0, 4096, causal=False),
    "E1-XAI-CAP30": Case("E1-XAI-CAP30", "extend", 8, 2048, 2048, logit_cap=30.0, xai_temperature_len=1024),
    # Speculative tree verify: 64 draft tokens per sequence over a 4096-token prefix, a random tree as a custom mask
    # (FlashInfer fa2 takes it; fa3 takes no custom mask).
    "V-TREE64": Case("V-TREE64", "extend", 32, 4096, 64, tree=True),
    # The same verify step on a sliding-window layer (GPT-OSS's window of 128): the window bounds each draft's prefix.
    "V-TREE64-W128": Case("V-TREE64-W128", "extend", 32, 4096, 64, tree=True, sliding_window=128),
    "E1-FP8": Case("E1-FP8", "extend", 8, 2048, 2048, kv_dtype="float8_e4m3fn"),
    "E3-FP8": Case("E3-FP8", "extend", 32, 4096, 128, kv_dtype="float8_e4m3fn"),  # E2 has no cached prefix to read
    # Tuning cases: one per head-dim family of jaxattn.extend.SM90_CONFIGS other than "128" (E1-E3), E1's lengths
    # unless noted. T64, T256 and T192 are in the default extend run (head dims of real models); the MLA ones run by
    # name (`--cases T576,...`).
    "T64": Case("T64", "extend", 8, 2048, 2048, q_heads=32, kv_heads=8, head_dim=64),
    "T256": Case("T256", "extend", 8, 2048, 2048, q_heads=16, kv_heads=8, head_dim=256),  # Gemma-2-like
    # DeepSeek-V3 MHA prefill (not absorbed), 16 heads of a tensor-parallel shard.
    "T192": Case("T192", "extend", 8, 2048, 2048, q_heads=16, kv_heads=16, head_dim=192, v_head_dim=128),
    # Absorbed MLA over the latent cache (one KV head, V = first 512 dims of K): short extends (chunked prefill tail,
    # speculative verify) over long prefixes.
    "T576": Case("T576", "extend", 16, 4096, 256, q_heads=16, kv_heads=1, head_dim=576, v_head_dim=512, default=False),
    "T288": Case("T288", "extend", 16, 4096, 256, q_heads=16, kv_heads=1, head_dim=288, v_head_dim=256, default=False),
}


PAGE_SUFFIX = "-P"  # a paged case's name: its case's name, then -P<page size> (D1-P16)


def paged_case(case: Case, page_size: int) -> Case:
    """`case` over KV pages of `page_size` tokens, named `<name>-P<page_size>`; page size 1 is `case` itself."""
    from jaxattn.checks import check_page_size

    check_page_size(page_size)
    if page_size == 1:
        return case
    return dataclasses.replace(case, name=f"{case.name}{PAGE_SUFFIX}{page_size}", page_size=page_size)


def case_named(name: str) -> Case | None:
    """The case of a name: one of CASES, or a paged one (`paged_case`'s name, e.g. D1-P16); None if neither."""
    base, suffix, size = name.rpartition(PAGE_SUFFIX)
    if suffix and size.isdigit() and base in CASES:
        return paged_case(CASES[base], int(size))
    return CASES.get(name)
