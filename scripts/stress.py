#!/usr/bin/env python3
"""Stress run: many random ragged batches through decode and extend (both kernels) against the reference.

Each batch goes the serving path: request tables (req_to_token rows at random, slots scattered over the pool) ->
the metadata builders -> `write_kv` of the new tokens -> the kernels, and the same batch through the jnp reference.
A batch is a mismatch when any output is non-finite, a row with no keys is not exactly 0, or an element differs from
the reference by more than atol + rtol * |ref| (the test suite's dtype tolerances).

Feature mixes come from a fixed list of profiles (head shapes, dtype, window, soft cap, sinks, xai temperature,
custom mask, non-causal) so compilation is paid once per profile; lengths, slots, batch fill and data change every
batch (zero-length sequences included).

    python scripts/stress.py --batches 1000 --json benchmarks/results/stress.json             # on a GPU
    python scripts/stress.py --batches 5 --mode interpret --shapes tiny --json /tmp/s.json    # CPU smoke run
    python scripts/stress.py --batches 1000 --workers 5 --json s.json     # profiles split over 5 processes

Batch i of an op draws its lengths, slots and masks from its own generator (seed, op, i); the data (q, K/V) come
from its profile's runner, whose state depends only on that profile's earlier batches. A profile always runs whole
in one process, so the results do not depend on how the run was split into worker processes. With --workers N the
profiles are dealt out over N processes (each compiles only its own profiles); the parent merges their records.

Prints one summary line (and the worst batch), writes the figures as JSON, exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import re
import subprocess
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxattn.batch import tree_mask_for_verify  # noqa: E402
from jaxattn.decode import decode_attention, decode_attention_reference, decode_metadata, draft_mask_bits  # noqa: E402
from jaxattn.metadata import draft_mask_words  # noqa: E402
from jaxattn.extend import (  # noqa: E402
    extend_attention,
    extend_attention_reference,
    extend_attention_unified,
    extend_attention_unified_reference,
    extend_metadata,
    extend_unified_metadata,
)
from jaxattn.fp8 import per_head_factor  # noqa: E402
from jaxattn.mla import mla_extend_attention, mla_extend_attention_reference  # noqa: E402
from jaxattn.kv_pool import write_kv  # noqa: E402
from jaxattn.paging import extend_metadata_from_pages, extend_unified_metadata_from_pages  # noqa: E402

from jaxattn.testing import tolerance  # noqa: E402  (the test suite's table)

TOLERANCES = {name: tuple(tolerance(name).values()) for name in ("float32", "float16", "bfloat16")}  # for the record


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    q_heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    dtype: str
    window: int = -1
    logit_cap: float = 0.0
    sinks: bool = False
    xai: int = -1
    mask: bool = False  # extend only: a random custom mask (fully masked rows included)
    draft: bool = False  # extend only: random trees as per-row draft words (draft_mask; the unified form: as a mask)
    causal: bool = True
    kv_dtype: str = ""  # the pools' dtype when it is not q's: "float8_e4m3fn" / "float8_e5m2" (read with k/v scales)
    per_head_scales: bool = False  # fp8: one scale per kv head instead of one per layer
    tokens: int = 1  # decode only: query tokens per sequence (a verify step: the last `tokens` keys are theirs)
    tree: bool = False  # decode with tokens > 1: a random draft tree (draft_mask) instead of causal
    # V is the first v_dim dims of K (MLA's latent cache): decode with v_pool=None; extend through
    # jaxattn.mla.mla_extend_attention (two-stage, causal) and the unified op on V sliced from the pool
    v_in_k: bool = False
    ext_bucket: int = 0  # extend only: max_extend_len when not the shapes' (<= 64: a verify step's short extends)
    page_size: int = 1  # extend only: pages of this many slots, metadata from the page table (whole-page copies)
    ops: tuple[str, ...] = ("decode", "extend")  # the ops that take it (its batches of the others are skipped)

    def pool_dtype(self):
        return jnp.dtype(self.kv_dtype or self.dtype)

    def scales(self) -> dict:
        """The ops' and write_kv's k_scale / v_scale for this profile's pools (none for 16/32-bit pools)."""
        if not self.kv_dtype:
            return {}
        if self.v_in_k:  # one latent pool: V is K's first dims, scaled by k_scale
            return dict(k_scale=0.5)
        if self.per_head_scales:
            heads = jnp.linspace(0.25, 1.0, self.kv_heads, dtype=jnp.float32)
            return dict(k_scale=heads, v_scale=heads[::-1])
        return dict(k_scale=0.5, v_scale=0.25)


def scaled_pool(values, profile: Profile, which: str):
    """A pool of the profile's dtype holding values / scale (fp8) or the values themselves; NaN stays NaN."""
    scale = profile.scales().get(f"{which}_scale")
    if scale is not None:
        values = values / per_head_factor(scale)
    return values.astype(profile.pool_dtype())


@dataclasses.dataclass(frozen=True)
class Shapes:
    dec_batch: int
    dec_max_len: int
    ext_batch: int
    ext_max_prefix: int
    ext_bucket: int  # max_extend_len


SHAPES = {
    # On a GPU: decode up to 16 x 4096 keys, extend up to 8 x (1024 prefix + 256 new): still many 128-key tiles and
    # partial tiles per sequence, and small enough that the jnp reference (a dense [batch, heads, 256, 1280] f32
    # score tensor) lets 1000 extend batches run in a few minutes.
    "gpu": Shapes(dec_batch=16, dec_max_len=4096, ext_batch=8, ext_max_prefix=1024, ext_bucket=256),
    # CPU interpreter smoke run.
    "tiny": Shapes(dec_batch=3, dec_max_len=40, ext_batch=3, ext_max_prefix=24, ext_bucket=8),
}


def profiles(shapes: str) -> list[Profile]:
    if shapes == "tiny":
        return [
            Profile("tiny-gqa2", 4, 2, 32, 32, "float32", sinks=True),
            Profile("tiny-window", 2, 1, 16, 16, "bfloat16", window=5, logit_cap=5.0),
            Profile("tiny-mask", 3, 3, 32, 16, "float16", mask=True, xai=8),
            Profile("tiny-fp8", 4, 2, 32, 32, "bfloat16", kv_dtype="float8_e4m3fn", per_head_scales=True),
            Profile("tiny-verify-tree", 4, 2, 32, 32, "float32", sinks=True, tokens=3, tree=True),
            Profile("tiny-pages", 4, 2, 32, 32, "float32", mask=True, page_size=8),
            Profile("tiny-latent", 4, 1, 48, 32, "float32", sinks=True, v_in_k=True),  # MLA's latent cache, V in K
        ]
    return [
        Profile("llama-gqa4-bf16", 32, 8, 128, 128, "bfloat16"),
        Profile("llama-gqa4-fp16", 32, 8, 128, 128, "float16"),
        Profile("gemma-cap-window", 16, 8, 256, 256, "bfloat16", window=1023, logit_cap=50.0),
        Profile("gpt-oss-sinks-window", 64, 8, 64, 64, "bfloat16", window=127, sinks=True),
        Profile("grok-xai-cap", 48, 8, 128, 128, "bfloat16", logit_cap=30.0, xai=1024),
        Profile("mla-absorbed", 16, 1, 576, 512, "bfloat16"),
        Profile("deepseek-mha-192", 16, 16, 192, 128, "bfloat16", window=0),
        Profile("mqa-group32-fp16", 32, 1, 128, 128, "float16", sinks=True),
        Profile("tree-mask", 32, 8, 128, 128, "bfloat16", mask=True),
        # A verify step's short extends (max_extend_len 64): two q heads per CTA on the Mosaic GPU kernel.
        Profile("verify-tree-64", 32, 8, 128, 128, "bfloat16", mask=True, ext_bucket=64, sinks=True),
        # Verify on sliding-window layers (Gemma, GPT-OSS): a custom mask under a window, both tilings.
        Profile("verify-tree-window", 16, 8, 128, 128, "bfloat16", mask=True, window=127, logit_cap=30.0),
        Profile("verify-tree-window-64", 64, 8, 64, 64, "bfloat16", mask=True, window=100, ext_bucket=64, sinks=True),
        # The compact tree form (extend_attention(draft_mask=)): up to 256 drafts in 8 words, and a verify step's 64.
        Profile("verify-draft-words", 32, 8, 128, 128, "bfloat16", draft=True, logit_cap=30.0),
        Profile("verify-draft-words-64", 32, 8, 128, 128, "float16", draft=True, ext_bucket=64, sinks=True, window=300),
        Profile("noncausal", 8, 8, 64, 64, "float16", causal=False, logit_cap=20.0),
        # KV pages (issue 23): lists of whole pages, which the Hopper extend kernel copies page by page (a tile's rows
        # of a larger page), with a custom mask too.
        Profile("llama-pages-64", 32, 8, 128, 128, "bfloat16", sinks=True, page_size=64),
        Profile("gemma-256-pages-128", 16, 8, 256, 256, "bfloat16", logit_cap=50.0, page_size=128),
        Profile("tree-mask-pages-64", 32, 8, 128, 128, "bfloat16", mask=True, page_size=64),
        # fp8 pools read by the kernels (issue 26): per-layer and per-head scales, both formats, GQA / MLA / sinks.
        Profile("llama-gqa4-fp8", 32, 8, 128, 128, "bfloat16", kv_dtype="float8_e4m3fn"),
        Profile("mla-absorbed-fp8", 16, 1, 576, 512, "bfloat16", kv_dtype="float8_e4m3fn"),
        Profile("gpt-oss-fp8-e5m2", 64, 8, 64, 64, "bfloat16", window=127, sinks=True, kv_dtype="float8_e5m2",
                per_head_scales=True),
        # Short extends over fp8 pools: the Mosaic GPU kernel converts the prefix tiles itself where at most
        # tuning.sm90.EXTEND_MGPU_FP8_IN_KERNEL_MAX_READERS CTAs read each (4 in both: the second packs two heads a CTA).
        Profile("llama-gqa4-fp8-128", 32, 8, 128, 128, "bfloat16", kv_dtype="float8_e4m3fn", ext_bucket=128),
        Profile("gpt-oss-fp8-e5m2-64", 64, 8, 64, 64, "bfloat16", window=127, sinks=True, kv_dtype="float8_e5m2",
                per_head_scales=True, ext_bucket=64),
        # Several query tokens per sequence on the decode kernel (speculative verify, MTP): causal, and random trees.
        Profile("mla-verify-4", 16, 1, 576, 512, "bfloat16", tokens=4),
        # MLA's latent cache as served (V = K's first 512 dims): the Mosaic GPU decode kernel on sm_90.
        Profile("mla-latent", 16, 1, 576, 512, "bfloat16", v_in_k=True, sinks=True),
        Profile("mla-latent-verify-tree-4", 16, 1, 576, 512, "float16", v_in_k=True, tokens=4, tree=True),
        Profile("mla-latent-288", 16, 1, 288, 256, "bfloat16", v_in_k=True, sinks=True),  # the half-size head
        Profile("mla-latent-288-verify-4", 16, 1, 288, 256, "float16", v_in_k=True, tokens=4),
        # fp8 latent caches (decode only: MLA extend takes 16-bit pools): one token at 16 or 32 heads on the MLA
        # kernel's transposed tile (its default since f5e08aa), verify steps on its padded tile (MLA_DECODE_PADDED_FP8).
        Profile("mla-latent-fp8", 16, 1, 576, 512, "bfloat16", v_in_k=True, sinks=True, kv_dtype="float8_e4m3fn",
                ops=("decode",)),
        Profile("mla-latent-fp8-e5m2-32", 32, 1, 576, 512, "float16", v_in_k=True, window=300,
                kv_dtype="float8_e5m2", ops=("decode",)),
        Profile("mla-latent-fp8-verify-4", 16, 1, 576, 512, "bfloat16", v_in_k=True, tokens=4,
                kv_dtype="float8_e4m3fn", ops=("decode",)),
        Profile("llama-verify-tree-6", 32, 8, 128, 128, "bfloat16", logit_cap=30.0, tokens=6, tree=True),
        Profile("llama-verify-tree-fp8", 32, 8, 128, 128, "bfloat16", sinks=True, tokens=5, tree=True,
                kv_dtype="float8_e4m3fn"),
    ]


# ---------------------------------------------------------------------------------------------


def random_lengths(rng, n, top):
    """0 with p = 0.15, 1..32 with p = 0.3, else uniform up to `top`."""
    u = rng.random(n)
    small = rng.integers(1, min(32, top) + 1, n)
    big = rng.integers(1, top + 1, n)
    return np.where(u < 0.15, 0, np.where(u < 0.45, small, big)).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("atol", "rtol"))
def _compare_on_device(o, ref, empty_rows, *, atol, rtol):
    # Reduced where the arrays live: only four scalars cross to the host (outputs reach 2048 x 64 x 128 floats).
    o, ref = o.astype(jnp.float32), ref.astype(jnp.float32)
    rows = empty_rows.reshape((-1,) + (1,) * (o.ndim - 1))
    ratio = jnp.max(jnp.abs(o - ref) / (atol + rtol * jnp.abs(ref)), initial=0.0)
    return jnp.all(jnp.isfinite(o)), jnp.all(jnp.isfinite(ref)), jnp.all(jnp.where(rows, o == 0, True)), ratio


def compare(o, ref, dtype, empty_rows=None):
    """(ok, worst |o - ref| / (atol + rtol |ref|), reason)."""
    tol = tolerance(dtype)
    atol, rtol = tol["atol"], tol["rtol"]
    if empty_rows is None:
        empty_rows = np.zeros(o.shape[0], bool)
    o_finite, ref_finite, empty_zero, ratio = jax.device_get(
        _compare_on_device(o, ref, jnp.asarray(empty_rows), atol=atol, rtol=rtol))
    if not o_finite:
        return False, float("inf"), "non-finite output"
    if not ref_finite:
        return False, float("inf"), "non-finite reference"
    if not empty_zero:
        return False, float("inf"), "a row with no keys is not 0"
    ratio = float(ratio)
    return ratio <= 1.0, ratio, "" if ratio <= 1.0 else "beyond tolerance"


class Tally:
    def __init__(self):
        self.batches = 0
        self.mismatches = 0
        self.worst = 0.0
        self.worst_case = None
        self.failures = []
        self.tokens = 0

    def add(self, ok, ratio, reason, case):
        self.batches += 1
        if ratio > self.worst:
            self.worst, self.worst_case = ratio, case
        if not ok:
            self.mismatches += 1
            if len(self.failures) < 20:
                self.failures.append(dict(case, reason=reason, ratio=ratio))

    def summary(self):
        return dict(batches=self.batches, mismatches=self.mismatches, worst_error_over_tolerance=self.worst,
                    worst_case=self.worst_case, failures=self.failures, tokens=self.tokens)

    def merge(self, summary):
        """Adds a worker's `summary()`."""
        self.batches += summary["batches"]
        self.mismatches += summary["mismatches"]
        self.tokens += summary["tokens"]
        if summary["worst_error_over_tolerance"] > self.worst:
            self.worst, self.worst_case = summary["worst_error_over_tolerance"], summary["worst_case"]
        self.failures = (self.failures + summary["failures"])[:20]


# ---------------------------------------------------------------------------------------------
# Decode

class DecodeRunner:
    def __init__(self, profile: Profile, shapes: Shapes, mode: str, seed: int):
        self.p, self.s, self.mode = profile, shapes, mode
        self.dtype = jnp.dtype(profile.dtype)
        self.slots = shapes.dec_batch * shapes.dec_max_len + 64
        self.capacity = shapes.dec_batch * shapes.dec_max_len
        key = jax.random.PRNGKey(seed)
        k1, k2, self.key = jax.random.split(key, 3)
        # Slot 0 (padding) and the reserved top slots hold NaN: a stray read shows up.
        poison = (jnp.arange(self.slots) == 0) | (jnp.arange(self.slots) >= self.slots - 8)
        self.k_pool = scaled_pool(jnp.where(poison[:, None, None], jnp.nan,
                                            jax.random.normal(k1, (self.slots, profile.kv_heads, profile.qk_dim))), profile, "k")
        self.v_pool = None if profile.v_in_k else scaled_pool(
            jnp.where(poison[:, None, None], jnp.nan, jax.random.normal(k2, (self.slots, profile.kv_heads, profile.v_dim))),
            profile, "v")  # a latent pool has no V of its own
        self.scales = profile.scales()
        p = profile
        v_kw = dict(v_head_dim=p.v_dim) if p.v_in_k else {}  # MLA's latent cache: v_pool=None, V = K[..., :v_dim]
        self.attn = functools.partial(decode_attention, sliding_window=p.window, logit_cap=p.logit_cap, xai_temperature_len=p.xai,
                                      mode=mode, **v_kw)
        self.ref = jax.jit(functools.partial(decode_attention_reference, sliding_window=p.window, logit_cap=p.logit_cap,
                                             xai_temperature_len=p.xai, **v_kw))
        self.meta = jax.jit(functools.partial(decode_metadata, kv_capacity=self.capacity, q_heads=p.q_heads, kv_heads=p.kv_heads,
                                              sliding_window=p.window, mode=mode))

    def run(self, rng, index):
        p, s = self.p, self.s
        lens = random_lengths(rng, s.dec_batch, s.dec_max_len)
        lens[rng.random(s.dec_batch) < 0.1] = 0
        total = int(lens.sum())
        slots = rng.permutation(np.arange(1, self.slots - 8))[:total].astype(np.int32)
        max_reqs = s.dec_batch + 3
        table = np.zeros((max_reqs, s.dec_max_len), np.int32)
        rows = rng.permutation(max_reqs)[: s.dec_batch].astype(np.int32)
        offset = 0
        for b in range(s.dec_batch):
            table[rows[b], : lens[b]] = slots[offset : offset + lens[b]]
            offset += lens[b]
        self.key, kq, kk, kv, ks = jax.random.split(self.key, 5)
        t = p.tokens
        q = jax.random.normal(kq, (s.dec_batch, t, p.q_heads, p.qk_dim) if t > 1 else (s.dec_batch, p.q_heads, p.qk_dim))
        q = q.astype(self.dtype)
        # The current tokens' K/V: written at their slots (the last t of each list) first, as a serving step does.
        # A list shorter than t has fewer; its missing tokens' rows write the padding slot.
        cols = np.arange(t) - t + lens[:, None]  # [batch, t]
        cur = np.where(cols >= 0, table[rows[:, None], np.maximum(cols, 0)], 0).reshape(-1).astype(np.int32)
        k_cur = jax.random.normal(kk, (s.dec_batch * t, p.kv_heads, p.qk_dim)).astype(self.dtype)
        v_cur = None if p.v_in_k else jax.random.normal(kv, (s.dec_batch * t, p.kv_heads, p.v_dim)).astype(self.dtype)
        draft_mask = None
        if p.tree:  # each token sees itself and its ancestors (a random tree in topological order)
            masks = np.zeros((s.dec_batch, t, t), bool)
            for b in range(s.dec_batch):
                parents = [int(rng.integers(-1, j)) for j in range(t)]
                masks[b] = tree_mask_for_verify(parents, 0)
            draft_mask = draft_mask_bits(masks)
        self.k_pool, self.v_pool = write_kv(self.k_pool, self.v_pool, jnp.asarray(cur), k_cur, v_cur, **self.scales)
        self.k_pool = self.k_pool.at[0].set(jnp.nan)  # padding rows wrote slot 0: poison it again
        if self.v_pool is not None:
            self.v_pool = self.v_pool.at[0].set(jnp.nan)
        sinks = jax.random.normal(ks, (p.q_heads,)) * 2 if p.sinks else None
        meta = self.meta(jnp.asarray(table), jnp.asarray(rows), jnp.asarray(lens))
        args = (q, self.k_pool, self.v_pool, meta)
        o = self.attn(*args, sinks=sinks, draft_mask=draft_mask, **self.scales)
        ref = self.ref(q, self.k_pool, self.v_pool, meta, sinks=sinks, draft_mask=draft_mask, **self.scales)
        # Rows with no key: padding sequences, and (causal, no sinks) the tokens placed before a short list's start.
        empty = np.broadcast_to((lens == 0)[:, None], (s.dec_batch, t)).copy()
        if not p.tree and not p.sinks:
            empty |= np.arange(t)[None, :] - t + lens[:, None] < 0
        rows = (s.dec_batch * t, p.q_heads, p.v_dim)  # one row per (sequence, token)
        ok, ratio, reason = compare(o.reshape(rows), ref.reshape(rows), p.dtype, empty_rows=empty.reshape(-1))
        return ok, ratio, reason, dict(op="decode", profile=p.name, batch=index, lens=lens.tolist()), int(total)


# ---------------------------------------------------------------------------------------------
# Extend


class ExtendRunner:
    def __init__(self, profile: Profile, shapes: Shapes, mode: str, seed: int):
        self.p, self.s, self.mode = profile, shapes, mode
        self.dtype = jnp.dtype(profile.dtype)
        self.bucket = profile.ext_bucket or shapes.ext_bucket
        self.ctx = shapes.ext_max_prefix + self.bucket
        self.slots = shapes.ext_batch * self.ctx + 64
        if profile.page_size > 1:  # whole pages: a page for each sequence's every page_size positions, two spare
            self.slots = (shapes.ext_batch * -(-self.ctx // profile.page_size) + 2) * profile.page_size
        self.capacity = shapes.ext_batch * self.ctx
        self.tokens = shapes.ext_batch * self.bucket
        self.mask_len = shapes.ext_batch * self.bucket * self.ctx
        key = jax.random.PRNGKey(seed)
        k1, k2, self.key = jax.random.split(key, 3)
        self.k_pool = scaled_pool(jax.random.normal(k1, (self.slots, profile.kv_heads, profile.qk_dim)), profile, "k").at[0].set(jnp.nan)
        self.v_pool = None if profile.v_in_k else scaled_pool(  # a latent pool has no V of its own
            jax.random.normal(k2, (self.slots, profile.kv_heads, profile.v_dim)), profile, "v").at[0].set(jnp.nan)
        self.scales = profile.scales()
        p = profile
        kw = dict(causal=p.causal, sliding_window=p.window, logit_cap=p.logit_cap, xai_temperature_len=p.xai)
        self.two = functools.partial(extend_attention, mode=mode, skip_prefix_custom_mask=False, **kw)
        if p.v_in_k:  # MLA's own extend op (causal, sinks only): the route serving DeepSeek's prefill
            self.mla = functools.partial(mla_extend_attention, v_head_dim=p.v_dim, launch_mode=mode)
            self.mla_ref = jax.jit(functools.partial(mla_extend_attention_reference, v_head_dim=p.v_dim))
        self.uni = functools.partial(extend_attention_unified, mode=mode, **kw)
        self.two_ref = jax.jit(functools.partial(extend_attention_reference, skip_prefix_custom_mask=False, **kw))
        self.uni_ref = jax.jit(functools.partial(extend_attention_unified_reference, **kw))
        common = dict(max_extend_len=self.bucket, kv_capacity=self.capacity, sliding_window=p.window, mode=mode)
        if p.page_size > 1:
            common.update(page_size=p.page_size, num_slots=self.slots)
            self.meta = jax.jit(functools.partial(extend_metadata_from_pages, **common))
            self.meta_u = jax.jit(functools.partial(extend_unified_metadata_from_pages, **common))
        else:
            self.meta = jax.jit(functools.partial(extend_metadata, **common))
            self.meta_u = jax.jit(functools.partial(extend_unified_metadata, **common))
        self.write = jax.jit(write_kv, donate_argnums=(0, 1))

    def run(self, rng, index):
        p, s = self.p, self.s
        prefix = random_lengths(rng, s.ext_batch, s.ext_max_prefix)
        extend = random_lengths(rng, s.ext_batch, self.bucket)
        seq = prefix + extend
        tokens = int(extend.sum())
        max_reqs = s.ext_batch + 3
        table = np.zeros((max_reqs, self.ctx), np.int32)  # every token's slot (page size 1: what the builders read)
        rows = rng.permutation(max_reqs)[: s.ext_batch].astype(np.int32)
        size = p.page_size
        if size > 1:  # each sequence's pages at random (never page 0), its tokens contiguous within a page
            pages = rng.permutation(np.arange(1, self.slots // size))
            req_to_page = np.zeros((max_reqs, -(-self.ctx // size)), np.int32)
            for b in range(s.ext_batch):
                need = -(-int(seq[b]) // size)
                req_to_page[rows[b], :need], pages = pages[:need], pages[need:]
            positions = np.arange(self.ctx)
            table = (req_to_page[:, positions // size] * size + positions % size).astype(np.int32)
            table[req_to_page[:, positions // size] == 0] = 0
        else:
            slots = rng.permutation(np.arange(1, self.slots))[: int(seq.sum())].astype(np.int32)
            offset = 0
            for b in range(s.ext_batch):
                table[rows[b], : seq[b]] = slots[offset : offset + seq[b]]
                offset += seq[b]
        loc = [table[rows[b], prefix[b] : seq[b]] for b in range(s.ext_batch)]
        loc = np.pad(np.concatenate(loc), (0, self.tokens - tokens)).astype(np.int32)  # padding tokens: slot 0
        self.key, kq, kk, kv, ks = jax.random.split(self.key, 5)
        q = jax.random.normal(kq, (self.tokens, p.q_heads, p.qk_dim)).astype(self.dtype)
        k_new = jax.random.normal(kk, (self.tokens, p.kv_heads, p.qk_dim)).astype(self.dtype)
        v_new = jax.random.normal(kv, (self.tokens, p.kv_heads, p.v_dim)).astype(self.dtype)
        sinks = jax.random.normal(ks, (p.q_heads,)) * 2 if p.sinks else None
        args = (jnp.asarray(req_to_page if size > 1 else table), jnp.asarray(rows), jnp.asarray(prefix), jnp.asarray(extend))
        meta = self.meta(*args)
        meta_u = self.meta_u(*args, jnp.asarray(loc))
        # Two-stage: the prefix from the pool, the new tokens contiguous (their pool slots are not read).
        mask = mask_u = draft_mask = None
        listed = np.minimum(prefix, p.window) if p.window >= 0 else prefix
        if p.draft:
            # Each token sees itself and random earlier drafts (a tree-like lower triangle), some only their prefix;
            # the unified form gets the same rows as a mask over the listed keys (prefix columns visible).
            rows, cut = np.zeros((self.tokens, self.bucket), bool), []
            row = 0
            for b in range(s.ext_batch):
                n = int(extend[b])
                m = np.tril(rng.random((n, n)) < 0.3)
                np.fill_diagonal(m, rng.random(n) > 0.1)
                rows[row : row + n, :n] = m
                cut.append(np.concatenate([np.ones((n, int(listed[b])), bool), m], axis=1).reshape(-1))
                row += n
            draft_mask = draft_mask_words(rows)  # u32[tokens, ceil(bucket / 32)]
            mask_u = jnp.asarray(np.pad(np.concatenate(cut), (0, self.mask_len - sum(map(len, cut)))))
        if p.mask:
            full, cut = [], []
            for b in range(s.ext_batch):
                n, width = int(extend[b]), int(seq[b])
                m = rng.random((n, width)) < 0.5
                m[rng.random(n) < 0.1] = False  # fully masked rows
                full.append(m.reshape(-1))
                cut.append(m[:, int(prefix[b] - listed[b]) :].reshape(-1))
            mask = jnp.asarray(np.pad(np.concatenate(full), (0, self.mask_len - sum(map(len, full)))))
            mask_u = jnp.asarray(np.pad(np.concatenate(cut), (0, self.mask_len - sum(map(len, cut)))))
        sc = self.scales
        if p.v_in_k:
            o_two = self.mla(q, k_new, self.k_pool, meta, sinks=sinks)
            r_two = self.mla_ref(q, k_new, jnp.nan_to_num(self.k_pool), meta, sinks=sinks)
            v_new = None
        else:
            o_two = self.two(q, k_new, v_new, self.k_pool, self.v_pool, meta, custom_mask=mask, sinks=sinks,
                             draft_mask=draft_mask, **sc)
            r_two = self.two_ref(q, k_new, v_new, jnp.nan_to_num(self.k_pool), jnp.nan_to_num(self.v_pool), meta,
                                 custom_mask=mask, sinks=sinks, draft_mask=draft_mask, **sc)
        # Unified: write the new tokens into the pool first (slot 0 takes the padding tokens), then read all from it.
        self.k_pool, self.v_pool = self.write(self.k_pool, self.v_pool, jnp.asarray(loc), k_new, v_new, **sc)
        v_pool = self.k_pool[..., : p.v_dim] if p.v_in_k else self.v_pool
        o_uni = self.uni(q, self.k_pool, v_pool, meta_u, custom_mask=mask_u, sinks=sinks, **sc)
        r_uni = self.uni_ref(q, self.k_pool, v_pool, meta_u, custom_mask=mask_u, sinks=sinks, **sc)
        padding = np.arange(self.tokens) >= tokens
        results = []
        for name, o, r in (("extend", o_two, r_two), ("extend_unified", o_uni, r_uni)):
            ok, ratio, reason = compare(o, r, p.dtype, empty_rows=padding)
            results.append((ok, ratio, reason, dict(op=name, profile=p.name, batch=index, prefix=prefix.tolist(), extend=extend.tolist())))
        return results, tokens


# ---------------------------------------------------------------------------------------------


def environment(mode):
    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip()
        except Exception:  # noqa: BLE001
            return "unknown"

    import importlib.metadata

    import triton

    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return dict(
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        # The GPU machine gets the tree without .git: gpu_check.sh passes JAXATTN_COMMIT.
        commit=os.environ.get("JAXATTN_COMMIT")
        or git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else ""),
        device=str(jax.devices()[0].device_kind) if jax.devices() else "none",
        backend=jax.default_backend(),
        mode=mode,
        jax=jax.__version__,
        triton=triton.__version__,
        jax_triton=version("jax-triton"),
        python=platform.python_version(),
    )


OP_IDS = {"decode": 0, "extend": 1}


def batch_rng(seed: int, op: str, index: int) -> np.random.Generator:
    """The generator of batch `index` of `op`: independent of the other batches and of the worker split."""
    return np.random.default_rng([seed, OP_IDS[op], index])


# A shard checkpoints its record every 100 batches and at least this often (seconds), so a run that a device call's
# time box ends leaves the figures of every shard (slow profiles took one shard past 100 batches' time, 2026-12-06).
CHECKPOINT_SECONDS = 20


def shard_of(index: int, n_profiles: int, workers: int) -> int:
    """The worker that runs batch `index`: profiles are dealt out, so each worker compiles only its own."""
    return (index % n_profiles) % workers


def run_workers(argv, workers: int, json_path: str | None):
    """Runs this script in `workers` processes (one shard each) and returns their records.

    The shards' records sit next to `json_path` (`<json_path>.shard<w>`, checkpointed every 100 batches and every
    `CHECKPOINT_SECONDS`), so a run killed by a time limit still leaves what each worker did."""
    import tempfile

    base = json_path or os.path.join(tempfile.mkdtemp(prefix="stress_"), "stress.json")
    paths = [f"{base}.shard{w}" for w in range(workers)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--shard", f"{w}/{workers}", "--json", path])
             for w, path in enumerate(paths)]
    codes = [p.wait() for p in procs]
    records = []
    for w, path in enumerate(paths):
        if not os.path.exists(path):
            raise SystemExit(f"stress worker {w} wrote no record (exit status {codes[w]})")
        with open(path) as f:
            records.append(json.load(f))
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=1000, help="random batches per op (decode, extend)")
    parser.add_argument("--ops", nargs="+", default=["decode", "extend"], choices=["decode", "extend"])
    parser.add_argument("--mode", choices=["gpu", "interpret"], default=None, help="launch mode (default: by platform)")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default=None, help="size bucket (default: gpu on a GPU, tiny otherwise)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--workers", type=int, default=1, help="processes to split the profiles over")
    parser.add_argument("--profiles", default=None, metavar="REGEX",
                        help="only the profiles whose name this regular expression finds (default: all)")
    parser.add_argument("--shard", default=None, help=argparse.SUPPRESS)  # "w/N": set by --workers for its children
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    warnings.filterwarnings("ignore", message=".*no tuned config.*")
    mode = args.mode or ("gpu" if jax.default_backend() in ("gpu", "cuda") else "interpret")
    shapes_name = args.shapes or ("gpu" if mode == "gpu" else "tiny")
    shapes = SHAPES[shapes_name]
    profs = profiles(shapes_name)
    if args.profiles is not None:
        profs = [p for p in profs if re.search(args.profiles, p.name)]
        if not profs:
            parser.error(f"--profiles {args.profiles!r} names none of {[p.name for p in profiles(shapes_name)]}")
    shard, workers = (0, 1) if args.shard is None else tuple(int(x) for x in args.shard.split("/"))
    tallies = {}
    start = time.time()
    timings = {}

    def record(complete):
        mismatches = sum(t.mismatches for t in tallies.values())
        return dict(
            environment=environment(mode),
            settings=dict(batches_per_op=args.batches, ops=args.ops, seed=args.seed,
                          shapes=dataclasses.asdict(shapes),
                          shapes_name=shapes_name, profiles=[dataclasses.asdict(p) for p in profs], tolerances=TOLERANCES,
                          workers=args.workers, shard=args.shard),
            complete=complete,  # False: a checkpoint of a run still going (or killed); results cover the batches done
            results={op: t.summary() for op, t in tallies.items()},
            total_mismatches=mismatches,
            seconds=dict(total=time.time() - start, **timings),
        )

    def save(complete):
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(record(complete), f, indent=1)

    if args.workers > 1 and args.shard is None:
        # The children get the parent's resolved settings; --shard and --json are added per child.
        child_argv = ["--batches", str(args.batches), "--ops", *args.ops, "--mode", mode, "--shapes", shapes_name, "--seed", str(args.seed)]
        if args.profiles is not None:
            child_argv += ["--profiles", args.profiles]
        records = run_workers(child_argv, args.workers, args.json)
        complete = all(r["complete"] for r in records)
        for r in records:
            for op, summary in r["results"].items():
                tallies.setdefault(op, Tally()).merge(summary)
        timings["workers"] = [r["seconds"] for r in records]
        return finish(tallies, mode, shapes_name, args, start, save, complete)

    last_save = time.time()
    for op in args.ops:
        runners = {}
        op_start = time.time()
        mine = [i for i in range(args.batches) if shard_of(i, len(profs), workers) == shard]
        for done, i in enumerate(mine, 1):
            profile_index = i % len(profs)
            profile = profs[profile_index]
            if op not in profile.ops:
                continue
            if profile.name not in runners:
                seed = args.seed * 1000 + profile_index
                if op == "decode":
                    runners[profile.name] = DecodeRunner(profile, shapes, mode, seed=seed)
                else:
                    runners[profile.name] = ExtendRunner(profile, shapes, mode, seed=seed)
            runner = runners[profile.name]
            rng = batch_rng(args.seed, op, i)
            if op == "decode":
                ok, ratio, reason, case, tokens = runner.run(rng, i)
                results = [(ok, ratio, reason, case)]
            else:
                results, tokens = runner.run(rng, i)
            for ok, ratio, reason, case in results:
                tally = tallies.setdefault(case["op"], Tally())
                tally.add(ok, ratio, reason, case)
                tally.tokens += tokens
                if not ok:
                    print(f"MISMATCH {case['op']} {case['profile']} batch {i}: {reason} (error/tolerance {ratio:.3g})", flush=True)
            if done % 100 == 0 or done == len(mine) or time.time() - last_save >= CHECKPOINT_SECONDS:
                label = f"[shard {shard}/{workers}] " if args.shard else ""
                print(f"  {label}{op}: {done}/{len(mine)} batches, {time.time() - op_start:.0f} s", flush=True)
                save(complete=False)  # a run cut short by a time limit still leaves its figures
                last_save = time.time()
        timings[op] = time.time() - op_start
    return finish(tallies, mode, shapes_name, args, start, save, True)


def finish(tallies, mode, shapes_name, args, start, save, complete):
    wall = time.time() - start
    mismatches = sum(t.mismatches for t in tallies.values())
    parts = ", ".join(f"{op} {t.batches} batches {t.mismatches} mismatches (worst error/tol {t.worst:.3f})" for op, t in tallies.items())
    label = f" shard {args.shard}" if args.shard else (f" {args.workers} workers" if args.workers > 1 else "")
    print(f"stress [{mode}, {shapes_name} shapes, seed {args.seed}{label}]: {parts}; total mismatches {mismatches}; {wall:.0f} s"
          + ("" if complete else " (INCOMPLETE: a worker stopped early)"))
    for op, t in tallies.items():
        if t.worst_case is not None:
            print(f"  worst {op}: {json.dumps(t.worst_case)[:300]}")
    save(complete=complete)
    if args.json:
        print(f"wrote {args.json}")
    return 1 if mismatches or not complete else 0


if __name__ == "__main__":
    sys.exit(main())
