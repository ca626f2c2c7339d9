"""Batch metadata: the pytrees the attention ops take, their builders (pure, inside jit, no host sync) and the layout
rules they follow, each rule written once here.

Layout (page size 1, SGLang's; `jaxattn.paging` maps larger pages onto it): slot 0 of the pool is the padding slot;
`req_to_token[row, pos]` is the pool slot of token `pos` of request row `row`; index lists are CSR
(`indptr[b]:indptr[b+1]` of `indices`) with static capacities.

Rules:
  * `window_first_key`: the first key a sliding-window layer lists for a sequence. Its first query sits at position
    `prefix_len` and sees keys `q_pos - W .. q_pos`, so the list starts at `max(prefix_len - W, 0)`. Decode (prefix =
    seq_len - 1) lists the last min(seq_len, W + 1) keys, extend the last min(prefix_len, W) prefix keys plus the new
    tokens, FlashInfer's plan the last min(seq_len, W + q_len); all derive from this one rule.
  * `listed_columns_mask`: full-width custom-mask rows `[q_len, start + listed + q_len]` cut to the listed columns.
  * `rope_split`: how a qk head dim is cut into two power-of-2 dots (MLA's rope part: 576 = 512 + 64).
  * Token offsets: `token_offsets[b]` is the req_to_token column of sequence b's first decoder token (the encoder's
    tokens, for cross attention, sit before it); positions count from there.

Pytrees: `DecodeMetadata` (split-KV decode), `ExtendMetadata` (two-stage extend: the prefix through the pool, the new
tokens contiguous), `ExtendUnifiedMetadata` (every key through the pool, deterministic).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import triton

from jaxattn import hardware
from jaxattn.checks import (
    index_i32,
    INDEX_DTYPES,
    MAX_DECODE_QUERY_TOKENS,
    check_array,
    check_extend_builder_args,
    check_heads,
    check_positive_int,
    check_split_args,
    check_split_knobs,
    check_window,
    launch_mode_argument,
)
from jaxattn.kv_indices import build_unified_kv_indices, create_kv_indices, exclusive_cumsum

MIN_BLOCK_KV = 32  # decode split lengths are multiples of this (SGLang's _MIN_BLOCK_KV)
DEFAULT_MAX_KV_SPLITS_CAP = 64


# ---------------------------------------------------------------------------------------------
# Layout rules


def window_first_key(prefix_lens, sliding_window: int):
    """First position a window-W layer lists for each sequence: max(prefix_len - W, 0) (0 without a window).

    prefix_lens: i32[batch] (numpy or jax), the keys before each sequence's first query.
    """
    prefix_lens = jnp.maximum(index_i32(prefix_lens), 0)
    if sliding_window < 0:
        return jnp.zeros_like(prefix_lens)
    return jnp.maximum(prefix_lens - sliding_window, 0)


def listed_prefix(prefix_lens, sliding_window: int):
    """(listed, dropped) prefix keys per sequence under `window_first_key` (all of them without a window)."""
    prefix_lens = jnp.maximum(index_i32(prefix_lens), 0)
    dropped = window_first_key(prefix_lens, sliding_window)
    return prefix_lens - dropped, dropped


def draft_mask_bits(mask) -> jax.Array:
    """A draft tree's boolean mask as the bit masks decode's several-token form takes (`decode_attention(draft_mask=)`).

    mask: bool[..., tokens, tokens], row t = which of the sequence's drafts (its last `tokens` keys) token t sees;
    tokens <= 32. Returns i32[..., tokens] with bit j of row t set iff mask[..., t, j]. Works inside jit.
    """
    mask = jnp.asarray(mask).astype(bool)
    tokens = mask.shape[-1]
    if mask.ndim < 2 or mask.shape[-2] != tokens or tokens > MAX_DECODE_QUERY_TOKENS:
        raise ValueError(f"mask must be bool[..., tokens, tokens] with tokens <= {MAX_DECODE_QUERY_TOKENS}; got shape "
                         f"{tuple(mask.shape)}")
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(tokens, dtype=jnp.uint32))
    bits = jnp.sum(jnp.where(mask, weights, jnp.uint32(0)), axis=-1, dtype=jnp.uint32)  # distinct bits: sum = or
    return jax.lax.bitcast_convert_type(bits, jnp.int32)


def draft_mask_words(mask) -> jax.Array:
    """Boolean draft rows as the words `extend_attention(draft_mask=)` takes: mask bool[..., rows, drafts] (row r:
    which of its sequence's new tokens it sees) -> u32[..., rows, ceil(drafts / 32)], bit j % 32 of word j // 32 set
    iff mask[..., r, j]. Any number of drafts; works inside jit."""
    mask = jnp.asarray(mask).astype(bool)
    if mask.ndim < 2 or mask.shape[-1] < 1:
        raise ValueError(f"mask must be bool[..., rows, drafts] with drafts >= 1; got shape {tuple(mask.shape)}")
    drafts = mask.shape[-1]
    words = -(-drafts // 32)
    padded = jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, 32 * words - drafts)])
    grouped = padded.reshape(*mask.shape[:-1], words, 32)
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(32, dtype=jnp.uint32))
    return jnp.sum(jnp.where(grouped, weights, jnp.uint32(0)), axis=-1, dtype=jnp.uint32)  # distinct bits: sum = or


def custom_mask_from_draft_bits(draft_mask, extend_lens, seq_lens, capacity: int) -> jax.Array:
    """The full TARGET_VERIFY custom mask of a verify step given as per-row bit masks (for the paths that take the
    boolean form: window layers, the reference and FlashInfer).

    draft_mask: i32/u32[B, D], bit j of [b, t]: draft t of sequence b sees draft j (its last D keys); every draft sees
    the sequence's earlier keys. extend_lens, seq_lens: i32[B] (D, or 0 for padding). capacity: static length of the
    result (>= sum(extend_len * seq_len), e.g. B * D * max_seq_len). Returns bool[capacity]: rows [extend_len, seq_len]
    per sequence at `custom_mask_indptr(extend_lens, seq_lens)`, False past the end.
    """
    batch, drafts = draft_mask.shape
    extend_lens = jnp.maximum(index_i32(extend_lens), 0)
    seq_lens = jnp.maximum(index_i32(seq_lens), 0)
    indptr = custom_mask_indptr(extend_lens, seq_lens)
    flat = jnp.arange(capacity, dtype=indptr.dtype)
    b = jnp.clip(jnp.searchsorted(indptr, flat, side="right") - 1, 0, batch - 1)
    width = jnp.maximum(seq_lens[b], 1).astype(indptr.dtype)
    local = flat - indptr[b]
    row = jnp.clip(local // width, 0, drafts - 1).astype(jnp.int32)
    draft = (local % width).astype(jnp.int32) - (seq_lens[b] - extend_lens[b])  # negative: a key before the drafts
    bits = draft_mask.astype(jnp.uint32)[b, row]
    bit = jnp.right_shift(bits, jnp.clip(draft, 0, 31).astype(jnp.uint32)) & 1
    return (flat < indptr[-1]) & ((draft < 0) | ((draft < drafts) & (bit != 0)))


def decode_listed_keys(seq_lens, sliding_window: int):
    """Keys a decode query lists per sequence (its own included): min(seq_len, W + 1) with a window."""
    seq_lens = jnp.maximum(index_i32(seq_lens), 0)
    return seq_lens - window_first_key(seq_lens - 1, sliding_window)


def listed_columns_mask(custom_mask, mask_indptr, listed, start_pos, q_lens, skip_prefix):
    """Full-width rows [q_len, start + listed + q_len] -> rows over the listed keys [q_len, listed + q_len].

    Returns (mask bool[len(custom_mask)], mask_indptr i32[batch + 1] of the cut rows). skip_prefix: the listed prefix
    columns read as visible (SGLang's skip_prefix_custom_mask).
    """
    listed = index_i32(listed)
    start_pos = index_i32(start_pos)
    batch = listed.shape[0]
    width = listed + q_lens
    out_indptr = custom_mask_indptr(q_lens, width)
    e = jnp.arange(custom_mask.shape[0], dtype=out_indptr.dtype)
    b = jnp.clip(jnp.searchsorted(out_indptr, e, side="right") - 1, 0, batch - 1)
    r = e - out_indptr[b]
    w = jnp.maximum(width[b], 1).astype(out_indptr.dtype)
    i, j = r // w, r % w
    src = mask_indptr[b].astype(out_indptr.dtype) + i * (start_pos[b] + width[b]) + start_pos[b] + j
    values = custom_mask[jnp.clip(src, 0, custom_mask.shape[0] - 1)].astype(bool)
    if skip_prefix:
        values = values | (j < listed[b])
    return jnp.where(e < out_indptr[-1], values, False), out_indptr


def custom_mask_indptr(q_lens, kv_lens):
    """[batch + 1] offsets of each sequence's custom-mask rows [q_len, kv_len] (row-major, sequence after sequence).

    q_len x kv_len products pass 2**31 in big verify batches: int64 when jax_enable_x64 is on; else int32, whose
    range `jaxattn.checked.validate_extend_inputs` checks (JAX makes no int64 arrays without x64).
    """
    dtype = jnp.int64 if jax.config.jax_enable_x64 else jnp.int32
    return exclusive_cumsum(q_lens.astype(dtype) * kv_lens.astype(dtype), dtype)


def rope_split(qk_head_dim: int) -> tuple[int, int]:
    """(main, rope): a head dim that is not a power of 2 is cut into two power-of-2 dots when it can (576 = 512 + 64,
    288 = 256 + 32, 192 = 128 + 64), else padded to the next power of 2 (rope 0). main >= 16 (tl.dot's minimum)."""
    padded = max(16, triton.next_power_of_2(qk_head_dim))
    if padded == qk_head_dim:
        return padded, 0
    main = padded // 2
    rest = qk_head_dim - main
    if main >= 16 and rest >= 16 and rest == triton.next_power_of_2(rest):
        return main, rest
    return padded, 0


def row_token_offsets(token_offsets, batch):
    """i32[batch]: each sequence's first column in its request row (`token_offsets`, default 0; negatives read 0)."""
    if token_offsets is None:
        return jnp.zeros((batch,), jnp.int32)
    check_array("token_offsets", token_offsets, shape=(batch,), dtypes=INDEX_DTYPES, what="[batch]")
    return jnp.maximum(index_i32(token_offsets), 0)


# ---------------------------------------------------------------------------------------------
# Decode


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeMetadata:
    """Per-batch decode metadata (a pytree: arrays are leaves, sizes are static).

    Batch rows past the real batch are padding: seq_len 0, an empty KV list, output 0.
    """

    kv_indptr: jax.Array  # i32[max_batch + 1]: CSR offsets into kv_indices
    kv_indices: jax.Array  # i32/i64[kv_capacity]: pool slots of the listed keys, sequence after sequence
    num_kv_splits: jax.Array  # i32[max_batch]: KV splits per sequence (clamped to [1, max_kv_splits] by the kernels)
    seq_lens: jax.Array  # i32[max_batch]: full sequence lengths (current token included); query position = seq_len - 1
    max_kv_splits: int = dataclasses.field(metadata=dict(static=True))  # grid size of the split axis; partial buffers
    kv_capacity: int = dataclasses.field(metadata=dict(static=True))  # static length of kv_indices
    sliding_window: int = dataclasses.field(default=-1, metadata=dict(static=True))  # W the lists were trimmed to, -1: none
    deterministic: bool = dataclasses.field(default=False, metadata=dict(static=True))  # splits depend on the length only
    max_kv_len: int | None = dataclasses.field(default=None, metadata=dict(static=True))  # bound on listed keys per sequence

    def __post_init__(self):
        if isinstance(self.kv_indptr, (list, tuple)):  # pytree rebuilds pass arrays, tracers or placeholders
            raise ValueError("DecodeMetadata's index fields must be arrays (see decode_metadata / "
                             f"decode_metadata_from_indptr); got kv_indptr as a {type(self.kv_indptr).__name__}")
        if isinstance(self.kv_indptr, (jax.Array, np.ndarray)) and hasattr(self.kv_indptr, "shape"):
            check_array("kv_indptr", self.kv_indptr, ndim=1, dtypes=INDEX_DTYPES, what="[max_batch + 1]")
            batch = self.kv_indptr.shape[0] - 1
            check_array("kv_indices", self.kv_indices, shape=(self.kv_capacity,), dtypes=INDEX_DTYPES, what="[kv_capacity]")
            check_array("num_kv_splits", self.num_kv_splits, shape=(batch,), dtypes=INDEX_DTYPES, what="[max_batch]")
            check_array("seq_lens", self.seq_lens, shape=(batch,), dtypes=INDEX_DTYPES, what="[max_batch]")
        check_positive_int("max_kv_splits", self.max_kv_splits)

    @property
    def batch(self) -> int:
        return self.kv_indptr.shape[0] - 1


# Stage-1 programs a multiprocessor the fill heuristic aims at (`num_kv_splits_heuristic`), from the H200's bf16 GQA
# decode (benchmarks/results/2026-12-02_h200_decode_sweep.json tried 4 and 16 beside it).
FILL_PROGRAMS_PER_SM = 8


def _split_work(q_heads, kv_heads):
    """Stage-1 work per sequence and split, in programs of 4 q heads (the GQA shape programs_per_sm = 8 was tuned on):
    one kv head's group of G heads counts ceil(G / 4). A program over MLA's 16 heads does 4x the dot work and writes
    4x the partials per key of a 4-head one, so it gets 4x fewer splits: on the H200 (d3464cf, 94212e2) 2 programs per
    SM beat 8 at both MLA shapes (64 x 4096: 0.123 vs 0.131 ms; 128 x 8192: 0.354 vs 0.369 ms)."""
    group = q_heads // kv_heads
    return kv_heads * max(1, -(-group // 4))


# The cost of a split count S under `SplitWaves`, in the time a full wave of resident programs takes per key (fitted
# on the H100, fp8 decode D1-D3 at 1-50 splits: benchmarks/RESULTS.md, thirty-eighth session): each split a program
# streams costs SPLIT_FIXED_KEYS keys' worth more (prologue, pipeline fill, its partial's write), and a last wave of
# fewer programs than multiprocessors runs at a lone program's rate, adding LAST_WAVE_KEY_SHARE of a split's keys.
SPLIT_FIXED_KEYS = 113
LAST_WAVE_KEY_SHARE = 0.4


@dataclasses.dataclass(frozen=True)
class SplitWaves:
    """Decode split counts chosen by whole waves of resident stage-1 programs (`num_kv_splits_by_waves`), for the
    kernel configuration that will run them.

    resident_per_sm: stage-1 programs one multiprocessor holds at once (`jaxattn.hardware.resident_blocks` of the
      compiled kernel); heads_per_program: q heads of one kv head a program takes (the config's block_h, 1 for the
      vector kernel). `jaxattn.tuning.decode_split_waves` gives both for a table's configuration.
    """

    resident_per_sm: int
    heads_per_program: int

    def __post_init__(self):
        check_positive_int("SplitWaves.resident_per_sm", self.resident_per_sm)
        check_positive_int("SplitWaves.heads_per_program", self.heads_per_program)


def default_max_kv_splits(max_batch, q_heads, kv_heads, max_context_len, *, deterministic=False, split_tile_size=256,
                          num_sms=None, programs_per_sm=FILL_PROGRAMS_PER_SM, min_split_len=256):
    """A static split bound: the most splits the dynamic heuristic would want, at most 64.

    Stage 1 launches max_batch x head_blocks x max_kv_splits programs and the unused ones exit at once, but
    they are not free (D3, 256 x 1024 on the H200: 89.5% of the floor with a bound of 2, 90.4% with 1): keep this
    small for big batches. x2 slack for padding rows (a half-full bucket wants twice the splits) only when the full
    bucket needs more than one split; a bucket that fills the GPU with one split still gives a half-full batch
    about programs_per_sm / 2 programs per SM. Deterministic: ceil(max_context_len / split_tile_size).
    num_sms: default the visible GPU's (`jaxattn.hardware.sm_count`).
    """
    if deterministic:
        return max(1, -(-max_context_len // split_tile_size))
    num_sms = hardware.sm_count() if num_sms is None else num_sms
    per_split = max(1, max_batch * _split_work(q_heads, kv_heads))
    by_fill = -(-num_sms * programs_per_sm // per_split)
    if by_fill > 1:
        by_fill *= 2
    by_len = max(1, -(-max_context_len // min_split_len))
    return int(max(1, min(DEFAULT_MAX_KV_SPLITS_CAP, by_fill, by_len)))


def num_kv_splits_heuristic(eff_lens, *, max_kv_splits, q_heads, kv_heads, deterministic=False, split_tile_size=256,
                            num_sms=None, programs_per_sm=FILL_PROGRAMS_PER_SM, min_split_len=256, split_waves=None):
    """i32[batch] splits per sequence, computed on device (no host sync).

    split_waves: a `SplitWaves` picks the count by whole waves of resident programs instead
    (`num_kv_splits_by_waves`); programs_per_sm is then unused.

    Dynamic (default): pick one split count S for the longest sequence so that the stage-1 grid
    (active sequences x `_split_work` x S, in programs of 4 q heads) gives about `programs_per_sm` per multiprocessor and every
    split keeps at least `min_split_len` keys; then give every sequence ceil(len / chunk) splits with
    chunk = ceil(max_len / S), so splits have about the same size across the batch. Not capped at 8 (SGLang's
    default): batch 8 x 32k with 8 kv heads gets 17 splits. Deterministic: ceil(len / split_tile_size),
    which depends on the sequence's own length only (batch invariance).
    """
    eff_lens = eff_lens.astype(jnp.int32)
    if deterministic:
        splits = (eff_lens + split_tile_size - 1) // split_tile_size
        return jnp.clip(splits, 1, max_kv_splits).astype(jnp.int32)
    num_sms = hardware.sm_count() if num_sms is None else num_sms
    if split_waves is not None:
        return num_kv_splits_by_waves(eff_lens, max_kv_splits=max_kv_splits, q_heads=q_heads, kv_heads=kv_heads,
                                      split_waves=split_waves, num_sms=num_sms, min_split_len=min_split_len)
    max_len = jnp.max(eff_lens, initial=0)
    active = jnp.maximum(jnp.sum(eff_lens > 0), 1)
    per_split_programs = active * _split_work(q_heads, kv_heads)
    by_fill = (num_sms * programs_per_sm + per_split_programs - 1) // per_split_programs
    target = jnp.clip(jnp.minimum(by_fill, _most_splits_by_length(max_len, min_split_len)), 1, max_kv_splits)
    return jnp.clip(_even_splits(eff_lens, max_len, target), 1, max_kv_splits).astype(jnp.int32)


def _most_splits_by_length(max_len, min_split_len):
    """The most splits the longest sequence takes with at least min_split_len keys each (at least 1)."""
    return jnp.maximum((max_len + min_split_len - 1) // min_split_len, 1)


def _even_splits(eff_lens, max_len, count):
    """Splits of each sequence when the longest is cut in `count`: ceil(len / chunk), chunk = ceil(max_len / count),
    so splits have about the same size across the batch (0 for an empty row). count broadcasts against eff_lens."""
    chunk = jnp.maximum((max_len + count - 1) // count, 1)
    return (eff_lens + chunk - 1) // chunk


def num_kv_splits_by_waves(eff_lens, *, max_kv_splits, q_heads, kv_heads, split_waves: SplitWaves, num_sms,
                           min_split_len=256):
    """i32[batch] splits per sequence with the count S chosen by waves of resident stage-1 programs, on device.

    A program streams its split's keys at a rate set by how many programs share HBM: a GPU of resident programs
    (num_sms x resident_per_sm, one wave) runs at the memory's pace from about half a wave on, a last wave of a few
    dozen runs at one program's latency. The counts considered are S <= max_kv_splits with at least min_split_len
    keys a split (as the fill heuristic). Where one split a sequence fits in one wave, the most splits that still fit
    in one wave win: a second wave adds a tail and each split a fixed cost (H100, fp8 D1 / D2, RESULTS.md, fortieth
    session: 1 and 8 splits, 512 programs each, 0.217 / 0.216 ms; 4 splits, half a wave, 0.217; 2 and 11-17 splits
    0.220 and 0.248-0.264). Otherwise the cost of S is waves(S) x (SPLIT_FIXED_KEYS + keys a split), plus
    LAST_WAVE_KEY_SHARE x keys a split when the last wave holds fewer programs than multiprocessors, and the cheapest
    S wins (the fewest splits on a tie). Sequences then get ceil(len / chunk) splits, chunk = ceil(max_len / S), as the
    fill heuristic gives them.

    eff_lens: i32[batch], keys each sequence attends to (0: a padding row).
    """
    eff_lens = jnp.maximum(eff_lens.astype(jnp.int32), 0)
    group = q_heads // kv_heads
    programs_per_split = kv_heads * -(-group // split_waves.heads_per_program)
    capacity = num_sms * split_waves.resident_per_sm
    max_len = jnp.max(eff_lens, initial=0)
    counts = jnp.arange(1, max_kv_splits + 1, dtype=jnp.int32)  # [C] candidate S
    chunks = jnp.maximum((max_len + counts - 1) // counts, 1)  # [C] keys a split (of the longest sequence)
    programs = jnp.sum(_even_splits(eff_lens[None, :], max_len, counts[:, None]), axis=1) * programs_per_split  # [C]
    by_len = _most_splits_by_length(max_len, min_split_len)
    allowed = counts <= by_len
    widest_one_wave = jnp.max(jnp.where(allowed & (programs <= capacity), counts, 0))  # 0: one split overflows a wave
    waves = programs.astype(jnp.float32) / capacity
    last_wave = programs % capacity
    lone_tail = (programs > capacity) & (last_wave > 0) & (last_wave < num_sms)
    keys = chunks.astype(jnp.float32)
    cost = waves * (SPLIT_FIXED_KEYS + keys) + jnp.where(lone_tail, LAST_WAVE_KEY_SHARE * keys, 0.0)
    cheapest = counts[jnp.argmin(jnp.where(allowed, cost, jnp.inf))]
    target = jnp.where(widest_one_wave > 0, widest_one_wave, cheapest)
    return jnp.clip(_even_splits(eff_lens, max_len, target), 1, max_kv_splits).astype(jnp.int32)


@functools.partial(
    jax.jit,
    static_argnames=("kv_capacity", "max_kv_splits", "q_heads", "kv_heads", "deterministic", "split_tile_size",
                     "sliding_window", "max_context_len", "num_sms", "programs_per_sm", "min_split_len", "split_waves",
                     "launch_mode", "mode"),
)
def decode_metadata(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    seq_lens: jax.Array,
    *,
    kv_capacity: int,
    q_heads: int,
    kv_heads: int,
    max_kv_splits: int | None = None,
    deterministic: bool = False,
    split_tile_size: int = 256,
    sliding_window: int = -1,
    token_offsets: jax.Array | None = None,
    max_context_len: int | None = None,
    num_sms: int | None = None,
    programs_per_sm: int = FILL_PROGRAMS_PER_SM,
    min_split_len: int = 256,
    split_waves: SplitWaves | None = None,
    launch_mode: str | None = None,
    mode: str | None = None,
) -> DecodeMetadata:
    """Builds the decode metadata of a batch from SGLang's request tables, on device.

    Args:
      req_to_token: i32[max_reqs, max_context_len]. Pool slot of every token of every request row.
      req_pool_indices: i32[max_batch]. The req_to_token row of each sequence.
      seq_lens: i32[max_batch]. Sequence lengths including the current token; 0 for padding rows.
      kv_capacity: static length of the KV index list (>= the batch's total listed keys).
      q_heads, kv_heads: the layer's head counts (the split heuristic sizes the stage-1 grid with them).
      max_kv_splits: static split bound (the partial buffers' size); default `default_max_kv_splits`.
      deterministic: splits = ceil(len / split_tile_size): a sequence's result does not depend on the batch.
      sliding_window: W >= 0 lists only the last min(seq_len, W + 1) keys of each sequence.
      token_offsets: optional i32[max_batch], the req_to_token column of each sequence's token 0 (default 0; the
        encoder tokens of cross attention sit before it).
      max_context_len: static bound on a sequence's keys (default req_to_token.shape[1]).
      num_sms, programs_per_sm, min_split_len: the dynamic split heuristic's knobs (see `num_kv_splits_heuristic`).
      split_waves: optional `SplitWaves` of the decode kernel's configuration: split counts by whole waves of its
        resident programs (`num_kv_splits_by_waves`) instead of programs_per_sm.
      launch_mode: launch mode of the index kernel (`mode`: its old name).

    Returns:
      A `DecodeMetadata`.
    """
    check_array("req_to_token", req_to_token, ndim=2, dtypes=INDEX_DTYPES, what="[max_reqs, max_context_len]")
    check_array("req_pool_indices", req_pool_indices, ndim=1, dtypes=INDEX_DTYPES, what="[max_batch]")
    check_array("seq_lens", seq_lens, shape=(req_pool_indices.shape[0],), dtypes=INDEX_DTYPES,
                what="[max_batch] (one per req_pool_indices entry)")
    check_heads(q_heads, kv_heads)
    check_positive_int("kv_capacity", kv_capacity)
    check_window("sliding_window", sliding_window)
    if max_context_len is not None:
        check_positive_int("max_context_len", max_context_len)
    elif req_to_token.shape[1] < 1:
        raise ValueError(f"req_to_token must have at least one column (its width is the default max_context_len); got "
                         f"shape {tuple(req_to_token.shape)}")
    offsets = row_token_offsets(token_offsets, req_pool_indices.shape[0])
    seq_lens = jnp.maximum(index_i32(seq_lens), 0)
    listed = decode_listed_keys(seq_lens, sliding_window)
    kv_indptr, kv_indices = create_kv_indices(
        req_to_token, req_pool_indices, listed, offsets + seq_lens - listed, capacity=kv_capacity, launch_mode=launch_mode_argument(launch_mode, mode)
    )
    # The lists hold at most min(max_context_len, W + 1) keys each; the split bound and heuristic are shared.
    max_listed = req_to_token.shape[1] if max_context_len is None else max_context_len
    if sliding_window >= 0:
        max_listed = min(max_listed, sliding_window + 1)
    return decode_metadata_from_indptr(
        kv_indptr, kv_indices, seq_lens, q_heads=q_heads, kv_heads=kv_heads, max_kv_splits=max_kv_splits,
        deterministic=deterministic, split_tile_size=split_tile_size, sliding_window=sliding_window,
        max_context_len=max_listed, num_sms=num_sms, programs_per_sm=programs_per_sm, min_split_len=min_split_len,
        split_waves=split_waves,
    )


@functools.partial(
    jax.jit,
    static_argnames=("max_kv_splits", "q_heads", "kv_heads", "deterministic", "split_tile_size", "sliding_window",
                     "max_context_len", "num_sms", "programs_per_sm", "min_split_len", "split_waves"),
)
def decode_metadata_from_indptr(
    kv_indptr: jax.Array,
    kv_indices: jax.Array,
    seq_lens: jax.Array | None = None,
    *,
    q_heads: int,
    kv_heads: int,
    max_kv_splits: int | None = None,
    deterministic: bool = False,
    split_tile_size: int = 256,
    sliding_window: int = -1,
    max_context_len: int | None = None,
    num_sms: int | None = None,
    programs_per_sm: int = FILL_PROGRAMS_PER_SM,
    min_split_len: int = 256,
    split_waves: SplitWaves | None = None,
) -> DecodeMetadata:
    """Decode metadata for callers that already hold CSR KV lists.

    Args:
      kv_indptr: i32[max_batch + 1]. kv_indices: i32/i64[kv_capacity]. The keys each sequence attends to, in
        position order, ending with the current token.
      seq_lens: optional i32[max_batch], the full sequence lengths (default: the list lengths). Only matters
        when the lists start after position 0 (e.g. already trimmed to a window) and xai temperature is used.
      sliding_window: W >= 0 when the lists are (or may be) longer than W + 1: the kernels then attend to the
        last W + 1 listed keys only, and the splits are sized for that.
      max_context_len: static bound on the listed keys per sequence (default kv_capacity); in deterministic mode
        max_kv_splits * split_tile_size must cover it.
      Others: see `decode_metadata`.
    """
    check_array("kv_indptr", kv_indptr, ndim=1, dtypes=INDEX_DTYPES, what="[max_batch + 1]")
    if kv_indptr.shape[0] < 1:
        raise ValueError("kv_indptr must have max_batch + 1 >= 1 entries [max_batch + 1]; got shape (0,)")
    check_array("kv_indices", kv_indices, ndim=1, dtypes=INDEX_DTYPES, what="[kv_capacity]")
    batch = kv_indptr.shape[0] - 1
    if seq_lens is not None:
        check_array("seq_lens", seq_lens, shape=(batch,), dtypes=INDEX_DTYPES, what="[max_batch]")
    check_heads(q_heads, kv_heads)
    check_split_knobs(split_tile_size, min_split_len, programs_per_sm, num_sms)
    if split_waves is not None and not isinstance(split_waves, SplitWaves):
        raise ValueError(f"split_waves must be None or a jaxattn.metadata.SplitWaves; got {split_waves!r}")
    check_window("sliding_window", sliding_window)
    if max_context_len is not None:
        check_positive_int("max_context_len", max_context_len)
    kv_capacity = kv_indices.shape[0]
    max_ctx = kv_capacity if max_context_len is None else int(max_context_len)
    if sliding_window >= 0:
        max_ctx = min(max_ctx, sliding_window + 1)
    if max_kv_splits is None:
        max_kv_splits = default_max_kv_splits(
            batch, q_heads, kv_heads, max_ctx, deterministic=deterministic, split_tile_size=split_tile_size,
            num_sms=num_sms, programs_per_sm=programs_per_sm, min_split_len=min_split_len,
        )
    check_split_args(max_kv_splits, deterministic, split_tile_size, max_ctx)
    kv_indptr = index_i32(kv_indptr)
    kv_lens = jnp.maximum(kv_indptr[1:] - kv_indptr[:-1], 0)
    seq_lens = kv_lens if seq_lens is None else index_i32(seq_lens)
    splits = num_kv_splits_heuristic(
        decode_listed_keys(kv_lens, sliding_window), max_kv_splits=max_kv_splits, q_heads=q_heads, kv_heads=kv_heads,
        deterministic=deterministic, split_tile_size=split_tile_size, num_sms=num_sms, programs_per_sm=programs_per_sm,
        min_split_len=min_split_len, split_waves=split_waves,
    )
    return DecodeMetadata(kv_indptr, kv_indices, splits, seq_lens, max_kv_splits, kv_capacity, sliding_window,
                          deterministic, max_context_len)


# ---------------------------------------------------------------------------------------------
# Extend


def _listed_prefix_lists(req_to_token, req_pool_indices, prefix_lens, sliding_window, token_offsets, capacity, index_dtype,
                         launch_mode):
    """(listed, dropped, kv_indptr, kv_indices): each sequence's listed prefix (`listed_prefix`) from its token_offsets
    column on, as CSR lists of pool slots (both extend builders start from these)."""
    offsets = row_token_offsets(token_offsets, req_pool_indices.shape[0])
    listed, start = listed_prefix(prefix_lens, sliding_window)
    kv_indptr, kv_indices = create_kv_indices(req_to_token, req_pool_indices, listed, start + offsets, capacity=capacity,
                                              index_dtype=index_dtype, launch_mode=launch_mode)
    return listed, start, kv_indptr, kv_indices


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExtendMetadata:
    """Batch layout for `extend_attention` (two-stage): the new tokens' rows and the listed cached prefix.

    A sliding-window layer lists only the last `sliding_window` prefix keys of each sequence; `kv_start_pos` says how
    many were dropped, so positions and the custom mask's full-width columns stay right.
    """

    qo_indptr: jax.Array  # i32[batch + 1]: sequence b's new tokens are rows qo_indptr[b]:qo_indptr[b+1] of q/k_new/v_new
    kv_indptr: jax.Array  # i32[batch + 1]: CSR of the listed prefix
    kv_indices: jax.Array  # i32/i64[kv_capacity]: pool slots of the listed prefix keys, in position order
    kv_start_pos: jax.Array  # i32[batch]: absolute position of the first listed prefix key (SGLang's window_kv_offsets)
    mask_indptr: jax.Array | None  # i32/i64[batch + 1] (`custom_mask_indptr`): each sequence's mask rows [q_len, prefix_len + q_len]
    max_extend_len: int = dataclasses.field(metadata=dict(static=True))  # static bound on q_len; fixes the grid
    kv_capacity: int = dataclasses.field(metadata=dict(static=True))  # static length of kv_indices
    sliding_window: int = dataclasses.field(default=-1, metadata=dict(static=True))  # window the list was cut for; -1 full
    # P > 1: the listed prefixes are whole pages of P slots (`jaxattn.paging`'s builders promise it: each list starts
    # a page, P consecutive slots per page from a multiple of P), so a kernel may copy a page's rows as a block
    # (the Hopper kernel does). A list that breaks the promise reads wrong rows of the pool, never outside it.
    page_size: int = dataclasses.field(default=1, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExtendUnifiedMetadata:
    """Batch layout for `extend_attention_unified`: one list per sequence, listed prefix keys then new tokens."""

    qo_indptr: jax.Array  # i32[batch + 1]
    kv_indptr: jax.Array  # i32[batch + 1]: CSR of the unified list (listed prefix + new tokens)
    kv_indices: jax.Array  # i32/i64[kv_capacity]: pool slots; the new tokens' K/V must already be in the pool
    prefix_lens: jax.Array  # i32[batch]: listed prefix keys per sequence
    kv_start_pos: jax.Array  # i32[batch]: absolute position of each sequence's first listed key
    mask_indptr: jax.Array | None  # i32/i64[batch + 1] (`custom_mask_indptr`): each sequence's mask rows [q_len, listed kv_len]
    max_extend_len: int = dataclasses.field(metadata=dict(static=True))
    kv_capacity: int = dataclasses.field(metadata=dict(static=True))
    sliding_window: int = dataclasses.field(default=-1, metadata=dict(static=True))
    page_size: int = dataclasses.field(default=1, metadata=dict(static=True))  # as ExtendMetadata's, over the listed prefix


@functools.partial(jax.jit, static_argnames=("max_extend_len", "kv_capacity", "sliding_window", "index_dtype", "launch_mode", "mode"))
def extend_metadata(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    prefix_lens: jax.Array,
    extend_lens: jax.Array,
    *,
    max_extend_len: int,
    kv_capacity: int,
    sliding_window: int = -1,
    token_offsets: jax.Array | None = None,
    index_dtype=jnp.int32,
    launch_mode: str | None = None,
    mode: str | None = None,
) -> ExtendMetadata:
    """Builds `ExtendMetadata` for a batch (SGLang's EXTEND mode), inside or outside jit.

    Args:
      req_to_token: i32[max_reqs, max_context_len]: pool slot of every token of every request row.
      req_pool_indices: i32[batch]: each sequence's row.
      prefix_lens: i32[batch]: cached tokens per sequence (0 allowed).
      extend_lens: i32[batch]: new tokens per sequence (0 allowed); the rows of q are these, sequence after sequence.
      max_extend_len: static bound on extend_lens (a bucket; it fixes the kernel grid). Longer rows are not computed.
      kv_capacity: static length of kv_indices: at least the total listed prefix.
      sliding_window: W >= 0 lists only the last W prefix keys of each sequence (all a window-W query can see).
      token_offsets: optional i32[batch]: req_to_token column of each sequence's token 0 (default 0).
      index_dtype: int32 or int64 slots.

    Returns:
      ExtendMetadata, with `mask_indptr` laid out for full-width custom masks [q_len, prefix_len + q_len].
    """
    check_extend_builder_args(req_to_token, req_pool_indices, prefix_lens, extend_lens, max_extend_len, kv_capacity,
                              sliding_window, index_dtype)
    extend_lens = jnp.maximum(index_i32(extend_lens), 0)
    listed, start, kv_indptr, kv_indices = _listed_prefix_lists(
        req_to_token, req_pool_indices, prefix_lens, sliding_window, token_offsets, kv_capacity, index_dtype,
        launch_mode_argument(launch_mode, mode))
    return extend_metadata_from_lists(extend_lens, listed, start, kv_indptr, kv_indices, max_extend_len=max_extend_len,
                                      kv_capacity=kv_capacity, sliding_window=sliding_window)


def extend_metadata_from_lists(extend_lens, listed, start, kv_indptr, kv_indices, *, max_extend_len, kv_capacity,
                               sliding_window, page_size=1) -> ExtendMetadata:
    """`ExtendMetadata` from a batch's listed-prefix lists (`extend_metadata` and the page-table builder share it).

    extend_lens: i32[batch], clamped >= 0. listed, start: `listed_prefix`'s (listed keys, keys dropped before them).
    kv_indptr / kv_indices: the listed prefix's CSR slot lists. Masks are full width [q_len, start + listed + q_len].
    page_size: the lists' whole pages (`ExtendMetadata.page_size`), 1 when they promise none.
    """
    return ExtendMetadata(
        qo_indptr=exclusive_cumsum(extend_lens),
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        kv_start_pos=start,
        mask_indptr=custom_mask_indptr(extend_lens, listed + start + extend_lens),
        max_extend_len=max_extend_len,
        kv_capacity=kv_capacity,
        sliding_window=int(sliding_window) if sliding_window >= 0 else -1,
        page_size=page_size,
    )


@functools.partial(jax.jit, static_argnames=("max_extend_len", "kv_capacity", "sliding_window", "index_dtype", "launch_mode", "mode"))
def extend_unified_metadata(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    prefix_lens: jax.Array,
    extend_lens: jax.Array,
    out_cache_loc: jax.Array,
    *,
    max_extend_len: int,
    kv_capacity: int,
    sliding_window: int = -1,
    extend_start_loc: jax.Array | None = None,
    token_offsets: jax.Array | None = None,
    index_dtype=jnp.int32,
    launch_mode: str | None = None,
    mode: str | None = None,
) -> ExtendUnifiedMetadata:
    """Builds `ExtendUnifiedMetadata` (SGLang's `_forward_extend_unified`): listed prefix slots then out_cache_loc.

    Args:
      req_to_token, req_pool_indices, prefix_lens, extend_lens, max_extend_len, sliding_window, token_offsets: as
        `extend_metadata`.
      out_cache_loc: i32[extend_tokens]: the pool slots the new tokens' K/V were written to, sequence after sequence.
      kv_capacity: static length of the unified list: at least total listed prefix + total new tokens.
      extend_start_loc: optional i32[batch]: where each sequence's slots start in out_cache_loc (default: cumsum).

    Returns:
      ExtendUnifiedMetadata, `mask_indptr` laid out for custom masks [q_len, listed_prefix + q_len].
    """
    check_extend_builder_args(req_to_token, req_pool_indices, prefix_lens, extend_lens, max_extend_len, kv_capacity,
                              sliding_window, index_dtype)
    check_array("out_cache_loc", out_cache_loc, ndim=1, dtypes=INDEX_DTYPES, what="[extend_tokens]")
    extend_lens = jnp.maximum(index_i32(extend_lens), 0)
    launch_mode = launch_mode_argument(launch_mode, mode)
    _, start, prefix_indptr, prefix_indices = _listed_prefix_lists(
        req_to_token, req_pool_indices, prefix_lens, sliding_window, token_offsets, kv_capacity, index_dtype, launch_mode)
    return extend_unified_metadata_from_lists(
        extend_lens, start, prefix_indptr, prefix_indices, out_cache_loc, extend_start_loc, max_extend_len=max_extend_len,
        kv_capacity=kv_capacity, sliding_window=sliding_window, index_dtype=index_dtype, launch_mode=launch_mode)


def extend_unified_metadata_from_lists(extend_lens, start, prefix_indptr, prefix_indices, out_cache_loc, extend_start_loc,
                                       *, max_extend_len, kv_capacity, sliding_window, index_dtype,
                                       launch_mode, page_size=1) -> ExtendUnifiedMetadata:
    """`ExtendUnifiedMetadata` from the listed-prefix lists and the new tokens' slots, joined by the unified index
    kernel (`extend_unified_metadata` and the page-table builder share it). Masks are [q_len, listed + q_len].
    page_size: the listed prefixes' whole pages (`ExtendMetadata.page_size`), 1 when they promise none."""
    kv_indptr, kv_indices, listed = build_unified_kv_indices(
        prefix_indptr, prefix_indices, extend_start_loc, extend_lens, out_cache_loc, capacity=kv_capacity,
        index_dtype=index_dtype, launch_mode=launch_mode,
    )
    return ExtendUnifiedMetadata(
        qo_indptr=exclusive_cumsum(extend_lens),
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        prefix_lens=listed,
        kv_start_pos=start,
        mask_indptr=custom_mask_indptr(extend_lens, listed + extend_lens),
        max_extend_len=max_extend_len,
        kv_capacity=kv_capacity,
        sliding_window=int(sliding_window) if sliding_window >= 0 else -1,
        page_size=page_size,
    )


@functools.partial(jax.jit, static_argnames=("max_extend_len", "kv_capacity", "launch_mode", "mode"))
def cross_attention_metadata(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    encoder_lens: jax.Array,
    extend_lens: jax.Array,
    *,
    max_extend_len: int,
    kv_capacity: int,
    launch_mode: str | None = None,
    mode: str | None = None,
) -> ExtendUnifiedMetadata:
    """`ExtendUnifiedMetadata` of cross attention: each sequence's new tokens over its encoder's tokens (the first
    encoder_lens[b] columns of its req_to_token row), all listed as "prefix" keys; run non-causal."""
    check_extend_builder_args(req_to_token, req_pool_indices, encoder_lens, extend_lens, max_extend_len, kv_capacity)
    encoder_lens = jnp.maximum(index_i32(encoder_lens), 0)
    indptr, indices = create_kv_indices(req_to_token, req_pool_indices, encoder_lens, None, capacity=kv_capacity, launch_mode=launch_mode_argument(launch_mode, mode))
    return cross_attention_metadata_from_lists(indptr, indices, encoder_lens, extend_lens, max_extend_len=max_extend_len,
                                               kv_capacity=kv_capacity)


def cross_attention_metadata_from_lists(kv_indptr, kv_indices, encoder_lens, extend_lens, *, max_extend_len: int,
                                        kv_capacity: int) -> ExtendUnifiedMetadata:
    """The cross-attention metadata around the encoder tokens' lists (kv_indptr i32[B + 1], kv_indices [kv_capacity]),
    shared by the req_to_token and page-table builders. encoder_lens: i32[B], >= 0."""
    return ExtendUnifiedMetadata(
        qo_indptr=exclusive_cumsum(jnp.maximum(index_i32(extend_lens), 0)), kv_indptr=kv_indptr,
        kv_indices=kv_indices, prefix_lens=encoder_lens, kv_start_pos=jnp.zeros_like(encoder_lens), mask_indptr=None,
        max_extend_len=max_extend_len, kv_capacity=kv_capacity,
    )
