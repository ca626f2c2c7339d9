#!/usr/bin/env python3
"""Stress run for the serving backends: random batches through TritonBackend or FlashInferBackend against
ReferenceBackend, layer by layer (`forward`: write_kv of the new tokens, then attention).

Each batch takes request rows of a page table whose pages lie at random in the pool, random lengths (padding
sequences of length 0, lengths ending mid-page, long and short extends; encoder tokens before the decoder's for
the encoder-decoder profiles, attended by a self or a cross layer), a mode (extend, decode, or target verify:
a random draft tree per sequence, as SGLang's custom mask or as per-row bit masks, `ForwardBatch.draft_mask`), random q/k/v and the profile's pools. A batch is a mismatch when an output is non-finite, a padding token's row is not exactly 0,
an element differs from ReferenceBackend's by more than the dtype tolerance (`jaxattn.testing.tolerance`), or the
pools differ after the write (bit for bit, but for slots several tokens wrote: the padding slot, whose value
`write_kv` leaves unspecified on a GPU); in deterministic mode also when a sequence alone, in another place of the batch,
does not give the same bits. Profiles fix what compiles (layer shape and features, page size, buckets); lengths,
pages and data change every batch.

    python scripts/stress_backends.py --backend flashinfer --batches 100 --json s.json        # on the H200
    python scripts/stress_backends.py --backend triton --batches 2 --shapes tiny              # CPU smoke (interpreter)

Modes a backend declines for a profile (NotImplementedError, e.g. FlashInfer's sink wrapper and tree masks) are
named in the record and skipped. Prints one line per profile and a summary; writes the figures as JSON; exits 1 on
any mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))  # batching.make_backend, as scripts/compare_transformers.py

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxattn.backends import AttentionLayer, ReferenceBackend  # noqa: E402
from jaxattn.backends.flashinfer import token_valid  # noqa: E402  (numpy; torch is imported only by the backend)
from jaxattn.metadata import draft_mask_bits  # noqa: E402
from jaxattn.paging import PageTable, out_cache_loc_from_pages, token_slots  # noqa: E402
from jaxattn.serving.batch import ForwardBatch, ForwardMode, tree_mask_for_verify  # noqa: E402
from jaxattn.testing import tolerance  # noqa: E402
from batching import make_backend  # noqa: E402  (examples/: the examples' backend choice)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Buckets and sizes of one size class."""

    q_heads: int
    kv_heads: int
    head_dim: int
    mla_q_heads: int
    context: int  # positions per request row
    max_reqs: int
    extend_batch: int  # sequences per extend batch (padding ones included)
    extend_tokens: int  # token rows per extend batch
    decode_batch: int
    drafts: int  # draft tokens per sequence of a target-verify batch
    dtype: str


SHAPES = {
    "gpu": Shapes(q_heads=32, kv_heads=8, head_dim=128, mla_q_heads=16, context=4096, max_reqs=48, extend_batch=6,
                  extend_tokens=2048, decode_batch=32, drafts=8, dtype="bfloat16"),
    "tiny": Shapes(q_heads=4, kv_heads=2, head_dim=32, mla_q_heads=4, context=64, max_reqs=6, extend_batch=3,
                   extend_tokens=24, decode_batch=4, drafts=3, dtype="float32"),
}


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    page_size: int = 1
    window: int = -1  # in keys; scaled to the size class's context (a quarter of it when > 0)
    logit_cap: float = 0.0
    sinks: bool = False
    mla: bool = False  # one 576/512 latent head (gpu), a latent pool
    kv_dtype: str = ""  # an fp8 pool ("float8_e4m3fn" / "float8_e5m2"), written and read with the layer's scales
    encoder: bool = False  # encoder-decoder batches: each row's encoder tokens first, its decoder tokens after them
    cross: bool = False  # the layer attends the encoder's tokens (non-causal); else the decoder's own

    @property
    def modes(self) -> list:
        return MODES[:2] if self.encoder else MODES  # no tree verify over encoder tokens

    def layer(self, shapes: Shapes) -> AttentionLayer:
        if self.mla:
            qk, dv = (576, 512) if shapes.head_dim >= 128 else (64 + 16, 64)  # tiny: a small latent for the interpreter
            return AttentionLayer(0, shapes.mla_q_heads, 1, qk, v_head_dim=dv, sm_scale=0.07, has_sinks=self.sinks)
        window = shapes.context // 4 if self.window > 0 else -1
        scales = dict(k_scale=0.5, v_scale=0.25) if self.kv_dtype else {}
        return AttentionLayer(0, shapes.q_heads, shapes.kv_heads, shapes.head_dim, sliding_window=window,
                              logit_cap=self.logit_cap, has_sinks=self.sinks, is_cross_attention=self.cross, **scales)


PROFILES = [
    Profile("gqa-p1"),
    Profile("gqa-p16", page_size=16),
    Profile("window-p16", page_size=16, window=1),
    Profile("softcap-p64", page_size=64, logit_cap=30.0),
    Profile("sinks-p1", sinks=True),
    Profile("sinks-window-p16", page_size=16, window=1, sinks=True),
    Profile("mla-p1", mla=True),
    Profile("mla-p16", page_size=16, mla=True),
    Profile("fp8-e4m3-p16", page_size=16, kv_dtype="float8_e4m3fn"),
    Profile("fp8-e5m2-window-p1", window=1, kv_dtype="float8_e5m2"),
    Profile("encdec-self-p1", encoder=True),
    Profile("encdec-cross-p16", page_size=16, encoder=True, cross=True),
]
MODES = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY]


@dataclasses.dataclass(frozen=True)
class Draw:
    """One batch's sequences: request rows, which are real (the others padding), lengths, a verify step's trees."""

    rows: np.ndarray
    real: np.ndarray
    seq_lens: np.ndarray
    extend_lens: np.ndarray
    encoder_lens: np.ndarray
    trees: tuple = ()  # TARGET_VERIFY: each real sequence's draft parents
    draft_form: bool = False  # TARGET_VERIFY: the trees as per-row bit masks (draft_mask), real sequences first

    def alone(self, b: int) -> "Draw":
        """Sequence b alone, moved to the last place (the others padding): a batch-invariance check's batch."""
        last = len(self.rows) - 1
        order = np.arange(len(self.rows))
        order[[b, last]] = order[[last, b]]
        keep = np.arange(len(self.rows)) == last
        pick = lambda x: np.where(keep, x[order], 0)  # noqa: E731
        return Draw(self.rows[order], keep, pick(self.seq_lens), pick(self.extend_lens), pick(self.encoder_lens))

    def token_rows(self, mode: ForwardMode, b: int) -> np.ndarray:
        """Sequence b's rows of q and of the output."""
        if mode == ForwardMode.DECODE:
            return np.array([b])
        first = int(self.extend_lens[:b].sum())
        return np.arange(first, first + int(self.extend_lens[b]))


def random_table(rng, profile: Profile, shapes: Shapes) -> PageTable:
    """Every request row's pages at random in the pool (page 0 never)."""
    pages_per_row = shapes.context // profile.page_size
    num_slots = (shapes.max_reqs * pages_per_row + 1) * profile.page_size
    req_to_page = (rng.permutation(shapes.max_reqs * pages_per_row) + 1).reshape(shapes.max_reqs, pages_per_row)
    return PageTable(jnp.asarray(req_to_page, jnp.int32), page_size=profile.page_size, num_slots=num_slots)


def random_draw(rng, mode: ForwardMode, profile: Profile, shapes: Shapes) -> Draw:
    """Request rows at random, lengths at random (some sequences padding, length 0)."""
    page_size = profile.page_size
    decode = mode == ForwardMode.DECODE
    verify = mode == ForwardMode.TARGET_VERIFY
    batch_size = shapes.decode_batch if decode else shapes.extend_batch
    rows = rng.choice(shapes.max_reqs, batch_size, replace=False).astype(np.int32)
    real = rng.random(batch_size) < 0.8
    real[rng.integers(batch_size)] = True  # at least one real sequence
    draft_form = verify and rng.random() < 0.5  # the tree as per-row bit masks (draft_mask) instead of custom_mask
    if draft_form:  # that form has the padding sequences after the real ones
        real = np.arange(batch_size) < real.sum()
    encoder_lens = np.zeros(batch_size, np.int64)
    if profile.encoder:  # whole pages of encoder tokens (FlashInfer lists a decoder's keys from a page start)
        encoder_lens = np.where(real, rng.integers(1, shapes.context // 4 // page_size + 1, batch_size) * page_size, 0)
    seq_lens = np.where(real, rng.integers(shapes.drafts if verify else 1, shapes.context + 1 - encoder_lens), 0)
    trees = ()
    if decode:
        extend_lens = real.astype(np.int64)
    elif verify:  # D drafts after each real sequence's prefix, under a random tree (a parent before each child)
        extend_lens = real * shapes.drafts
        trees = tuple(tuple(int(rng.integers(-1, j)) for j in range(shapes.drafts)) for _ in range(int(real.sum())))
    else:  # a share of the token bucket each, at most the sequence's length
        extend_lens = np.zeros(batch_size, np.int64)
        for b in np.flatnonzero(real):
            extend_lens[b] = min(seq_lens[b], int(rng.integers(1, max(2, shapes.extend_tokens // int(real.sum())) + 1)))
    return Draw(rows, real, seq_lens, extend_lens, encoder_lens, trees, draft_form)


def build_batch(mode: ForwardMode, profile: Profile, shapes: Shapes, table: PageTable, draw: Draw) -> ForwardBatch:
    """The ForwardBatch of a draw over a page table, in the profile's buckets (one compile per mode and form)."""
    page_size, num_slots = table.page_size, table.num_slots
    decode = mode == ForwardMode.DECODE
    batch_size = len(draw.rows)
    tokens = {ForwardMode.DECODE: batch_size, ForwardMode.TARGET_VERIFY: batch_size * shapes.drafts}.get(
        mode, shapes.extend_tokens)
    custom_mask = draft_mask = None
    if mode == ForwardMode.TARGET_VERIFY:
        if draw.draft_form:
            bits = np.zeros((batch_size, shapes.drafts), np.int32)
            bits[: len(draw.trees)] = np.asarray(draft_mask_bits(np.stack([tree_mask_for_verify(t, 0)
                                                                            for t in draw.trees])))
            draft_mask = jnp.asarray(bits)
        else:
            flat = np.concatenate([tree_mask_for_verify(t, int(s - shapes.drafts)).reshape(-1)
                                   for t, s in zip(draw.trees, draw.seq_lens[draw.real])])
            custom_mask = np.zeros(batch_size * shapes.drafts * shapes.context, bool)  # a fixed bucket: one compile
            custom_mask[: flat.size] = flat
    prefix_lens = draw.seq_lens - draw.extend_lens
    j = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    if decode:  # a padding sequence's position -1 is outside the row: slot 0
        at = np.where(draw.real, draw.encoder_lens + draw.seq_lens - 1, -1)
        out_cache_loc = token_slots(table.req_to_page, j(draw.rows), j(at), page_size, num_slots=num_slots)
        positions = np.maximum(draw.seq_lens - 1, 0)
    else:
        out_cache_loc = out_cache_loc_from_pages(table.req_to_page, j(draw.rows), j(prefix_lens), j(draw.extend_lens),
                                                 page_size=page_size, num_slots=num_slots, num_tokens=tokens,
                                                 token_offsets=j(draw.encoder_lens) if profile.encoder else None)
        positions = np.zeros(tokens, np.int64)
        cursor = 0
        for p, n in zip(prefix_lens, draw.extend_lens):
            positions[cursor : cursor + n] = np.arange(p, p + n)
            cursor += n
    return ForwardBatch(req_pool_indices=j(draw.rows), seq_lens=j(draw.seq_lens), extend_lens=j(draw.extend_lens),
                        out_cache_loc=out_cache_loc, positions=j(positions), mode=mode,
                        max_extend_len=shapes.context if not decode else 1,
                        kv_capacity=batch_size * shapes.context, max_seq_len=shapes.context,
                        custom_mask=None if custom_mask is None else jnp.asarray(custom_mask), draft_mask=draft_mask,
                        encoder_lens=j(draw.encoder_lens) if profile.encoder else None)


class Runner:
    """One profile: the backend's and the reference's jitted steps (compiled once per mode), and its pools."""

    def __init__(self, profile: Profile, shapes: Shapes, backend: str, deterministic: bool):
        self.profile, self.shapes = profile, shapes
        self.layer = profile.layer(shapes)
        self.dtype = jnp.dtype(shapes.dtype)
        self.kv_dtype = jnp.dtype(profile.kv_dtype or shapes.dtype)
        self.backend_name = backend
        self.deterministic = deterministic
        windows = (self.layer.sliding_window,) if self.layer.sliding_window >= 0 else ()
        self.backend = make_backend(backend, sliding_windows=windows, deterministic=deterministic)
        self.planned = hasattr(self.backend, "plan")  # FlashInferBackend plans on the host before the step
        self.reference = ReferenceBackend()
        layer = self.layer

        def ref_step(q, k, v, kp, vp, sinks, batch, table):
            return self.reference.forward(q, k, v, kp, vp, layer, self.reference.init_forward_metadata(batch, table),
                                          sinks=sinks)

        self.ref_step = jax.jit(ref_step)
        if self.planned:
            self.step = jax.jit(lambda q, k, v, kp, vp, sinks, meta: self.backend.forward(q, k, v, kp, vp, layer, meta,
                                                                                           sinks=sinks))
        else:
            self.step = jax.jit(lambda q, k, v, kp, vp, sinks, batch, table: self.backend.forward(
                q, k, v, kp, vp, layer, self.backend.init_forward_metadata(batch, table), sinks=sinks))

    def backend_step(self, batch, table, q, k, v, k_pool, v_pool, sinks):
        """(o, k_pool, v_pool) of the backend's step (FlashInferBackend: planned on the host first)."""
        if self.planned:
            meta = self.backend.plan(batch, table, [self.layer], q_dtype=self.dtype, kv_dtype=self.kv_dtype)
            return self.step(q, k, v, k_pool, v_pool, sinks, meta)
        return self.step(q, k, v, k_pool, v_pool, sinks, batch, table)

    def run(self, rng, mode: ForwardMode) -> dict:
        layer, dtype = self.layer, self.dtype
        fp8 = self.kv_dtype != dtype
        table = random_table(rng, self.profile, self.shapes)
        draw = random_draw(rng, mode, self.profile, self.shapes)
        batch = build_batch(mode, self.profile, self.shapes, table, draw)
        normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
        tokens = batch.out_cache_loc.shape[0]
        latent = self.profile.mla
        q = normal(tokens, layer.q_heads * layer.head_dim)
        k = normal(tokens, layer.kv_heads * layer.head_dim)
        v = None if latent else normal(tokens, layer.kv_heads * layer.dv)
        k_pool = normal(table.num_slots, layer.kv_heads, layer.head_dim)
        v_pool = None if latent else normal(table.num_slots, layer.kv_heads, layer.dv)
        if fp8:  # stored as value / scale; the new tokens' K/V on the fp8 grid too (see the tolerance below)
            on_grid = lambda x, scale: ((x.astype(jnp.float32) / scale).astype(self.kv_dtype)  # noqa: E731
                                        .astype(jnp.float32) * scale).astype(dtype)
            k_pool = (k_pool.astype(jnp.float32) / layer.k_scale).astype(self.kv_dtype)
            v_pool = (v_pool.astype(jnp.float32) / layer.v_scale).astype(self.kv_dtype)
            k, v = on_grid(k, layer.k_scale), on_grid(v, layer.v_scale)
        # Sinks near the rows' log-denominators (scores ~ N(0, 1) over up to context keys), so they matter.
        sinks = jnp.asarray(rng.normal(np.log(self.shapes.context) / 2, 2.0, layer.q_heads), jnp.float32) \
            if self.profile.sinks else None
        want, want_k, want_v = self.ref_step(q, k, v, k_pool, v_pool, sinks, batch, table)
        got, got_k, got_v = self.backend_step(batch, table, q, k, v, k_pool, v_pool, sinks)
        reasons = []
        if self.deterministic and mode != ForwardMode.TARGET_VERIFY:
            # Batch invariance: a real sequence alone, in another place of the batch, gives the same bits.
            b = int(np.flatnonzero(draw.real)[0])
            solo = draw.alone(b)
            last = len(draw.rows) - 1
            rows, solo_rows = draw.token_rows(mode, b), solo.token_rows(mode, last)
            place = lambda x: None if x is None else normal(*x.shape).at[solo_rows].set(x[rows])  # noqa: E731
            alone = self.backend_step(build_batch(mode, self.profile, self.shapes, table, solo), table, place(q),
                                      place(k), place(v), k_pool, v_pool, sinks)[0]
            if not np.array_equal(np.asarray(alone)[solo_rows], np.asarray(got)[rows]):
                reasons.append("not batch-invariant (deterministic mode)")
        got, want = np.asarray(got, np.float32).reshape(tokens, -1), np.asarray(want, np.float32).reshape(tokens, -1)
        valid = token_valid(batch)
        # The dtype's tolerance also over fp8 pools: TritonBackend's two-stage extend reads the new tokens' K/V from k/v
        # (as SGLang), the reference from the pool they were written to; on the fp8 grid both are the same values.
        tol = tolerance(dtype)
        excess = np.abs(got[valid] - want[valid]) / (tol["atol"] + tol["rtol"] * np.abs(want[valid]))
        worst = float(excess.max()) if excess.size else 0.0
        if not np.all(np.isfinite(got)):
            reasons.append("non-finite output")
        if np.any(got[~valid] != 0):
            reasons.append("a padding row is not 0")
        if worst > 1.0:
            reasons.append(f"beyond tolerance ({worst:.2f}x)")
        # Slots several tokens wrote (the padding slot 0) hold one of their values, unspecified on a GPU (`write_kv`):
        # every other slot must be bit-equal.
        exact = single_writer_slots(np.asarray(batch.out_cache_loc), k_pool.shape[0])
        if not np.array_equal(np.asarray(got_k)[exact], np.asarray(want_k)[exact]) or (
                not latent and not np.array_equal(np.asarray(got_v)[exact], np.asarray(want_v)[exact])):
            reasons.append("pools differ after the write")
        return dict(ok=not reasons, worst=worst, reasons=reasons, mode=mode.name,
                    seq_lens=np.asarray(batch.seq_lens).tolist(), extend_lens=np.asarray(batch.extend_lens).tolist())


def single_writer_slots(out_cache_loc: np.ndarray, num_slots: int) -> np.ndarray:
    """bool[num_slots]: the slots at most one token of a step writes, whose contents after `write_kv` are exact."""
    in_pool = out_cache_loc[(out_cache_loc >= 0) & (out_cache_loc < num_slots)]
    return np.bincount(in_pool, minlength=num_slots) <= 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["triton", "flashinfer"], default="flashinfer")
    parser.add_argument("--batches", type=int, default=100, help="random batches per profile")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default=None, help="size class (default: gpu on a GPU)")
    parser.add_argument("--profiles", default=None, metavar="REGEX", help="only the profiles whose name matches")
    parser.add_argument("--deterministic", action="store_true", help="the backend's deterministic mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=None,
                        help="time budget: each profile gets an equal share of what is left, and stops starting "
                             "batches past it once each mode ran (so a time-boxed run covers every profile and mode)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() in ("gpu", "cuda")
    shapes = SHAPES[args.shapes or ("gpu" if on_gpu else "tiny")]
    profiles = [p for p in PROFILES if args.profiles is None or re.search(args.profiles, p.name)]
    results, total_bad, t0 = {}, 0, time.time()
    for index, profile in enumerate(profiles):
        try:
            runner = Runner(profile, shapes, args.backend, args.deterministic)
        except (NotImplementedError, ValueError) as error:  # a profile the backend declines, named
            results[profile.name] = dict(declined=f"{type(error).__name__}: {error}")
            print(f"{profile.name:18s} declined: {error}", flush=True)
            continue
        rng = np.random.default_rng([args.seed, index])
        worst, bad, ran, first_bad, declined = 0.0, 0, {}, None, {}
        deadline = None if args.seconds is None else (
            time.time() + (args.seconds - (time.time() - t0)) / (len(profiles) - index))
        for i in range(args.batches):
            if deadline is not None and i >= len(profile.modes) and time.time() > deadline:  # each mode once
                break
            modes = [m for m in profile.modes if m.name not in declined] or profile.modes
            mode = modes[i % len(modes)]
            if mode.name in declined:
                break  # every mode declined
            try:
                outcome = runner.run(rng, mode)
            except NotImplementedError as error:  # a mode the backend declines for this profile, named once
                declined[mode.name] = str(error)
                continue
            except Exception as error:  # noqa: BLE001  (a crash is a failure of this batch, reported with the rest)
                outcome = dict(ok=False, worst=0.0, reasons=[f"raised {type(error).__name__}: {str(error)[:300]}"],
                               mode=mode.name)
            ran[mode.name] = ran.get(mode.name, 0) + 1
            worst = max(worst, outcome["worst"])
            if not outcome["ok"]:
                bad += 1
                first_bad = first_bad or dict(batch=i, **outcome)
        results[profile.name] = dict(batches=sum(ran.values()), by_mode=ran, mismatches=bad,
                                     worst_error_over_tolerance=worst, first_mismatch=first_bad, declined=declined)
        total_bad += bad
        print(f"{profile.name:18s} {sum(ran.values())} batches {ran}, {bad} mismatches, worst |err| / tolerance "
              f"{worst:.3f}" + (f"; declined {sorted(declined)}" if declined else "")
              + (f"; first: {first_bad}" if first_bad else ""), flush=True)
        write_record(args, shapes, t0, total_bad, results, profiles_left=len(profiles) - index - 1)
    print(f"stress_backends: {args.backend}{' deterministic' if args.deterministic else ''}, "
          f"{sum(r.get('batches', 0) for r in results.values())} batches, {total_bad} mismatches", flush=True)
    write_record(args, shapes, t0, total_bad, results, profiles_left=0)
    return 1 if total_bad else 0


def write_record(args, shapes, t0, total_bad, results, *, profiles_left: int):
    """The run's JSON (if --json), rewritten after every profile: a run its time box cuts keeps what it finished
    (profiles_left > 0 says it was cut)."""
    if not args.json:
        return
    record = dict(backend=args.backend, deterministic=args.deterministic, shapes=dataclasses.asdict(shapes),
                  device=str(jax.devices()[0]), seconds=round(time.time() - t0, 1), commit=os.environ.get("JAXATTN_COMMIT"),
                  total_mismatches=total_bad, profiles_left=profiles_left, results=results)
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
