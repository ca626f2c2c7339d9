"""A numpy model of the MLA Mosaic GPU kernel's schedule, run on CPU against the references.

The kernel cannot run on CPU (CI lowers it: tests/lower_mgpu_kernel.py); its numerics run on the H200. This model
replays, CTA by CTA, what the kernel's warpgroups do with the kernel module's own geometry functions (`decode_cta`,
`decode_visible`, `extend_cta`, `extend_tile_source`, `extend_loops`, ...): which tiles a CTA visits in which order,
which rows each tile gathers (zeros past its count, slots outside the pool read as slot 0), which scores it masks,
the online softmax in base 2, the sink fold, where `store_rows` puts each output row (the flat offsets the kernel
computes), and the kernel's own merge of the splits (which split merges, in which order, with the module's merge
functions). An index or geometry slip in those functions shows here as a mismatch with the reference, without a GPU.
"""

import dataclasses
import functools

import numpy as np
import pytest

import jax.numpy as jnp

from jaxattn.decode import decode_attention_reference, decode_metadata_from_indptr, draft_mask_bits
from jaxattn.kernels import mla_attention_mgpu as K
from jaxattn.mla import mla_extend_attention_reference
from jaxattn.serving.batch import tree_mask_for_verify
from tests.helpers import random_pool_batch
from tests.test_extend import _clean, make_batch

LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453


def _int(x):
    return int(np.asarray(x))


def gather_tile(source, first, count, *, indices=None, pool_rows, block_kv=K.BLOCK_KV):
    """`row_sources` + `issue_rows`: tile row r <- source row (indices[first + r], slot 0 where that is outside the
    pool; or first + r), zeros for r >= count."""
    tile = np.zeros((block_kv, source.shape[-1]), np.float32)
    for r in range(block_kv):
        if r >= count:
            continue
        if indices is None:
            row = first + r
        else:
            row = int(indices[int(np.clip(first + r, 0, len(indices) - 1))])
            row = row if 0 <= row < pool_rows else 0
        tile[r] = source[row, 0]
    return tile


def attend(q_block, tiles, v_dim, scale, sink=None):
    """`_cta`'s consumers: tiles = [(keys [64, qk], visible bool[64, 64] or None)] in the kernel's order; returns
    (out [64, v_dim] normalised, lse [64])."""
    rows = q_block.shape[0]
    m, l, acc = np.full(rows, -1e30, np.float32), np.zeros(rows, np.float32), np.zeros((rows, v_dim), np.float32)
    scale_log2 = np.float32(scale * LOG2E)
    for keys, visible in tiles:
        s = q_block @ keys.T
        if visible is not None:
            s = np.where(visible, s, -np.inf)
        m_new = np.maximum(m, s.max(axis=1) * scale_log2)
        alpha = np.exp2(m - m_new)
        p = np.exp2(s * scale_log2 - m_new[:, None])
        l = l * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + p @ keys[:, :v_dim]
        m = m_new
    if sink is not None:
        sink2 = sink * LOG2E
        m_f = np.maximum(m, sink2)
        alpha = np.exp2(m - m_f)
        l = l * alpha + np.exp2(sink2 - m_f)
        m = m_f
        factor = alpha / np.where(l == 0, 1, l)
    else:
        factor = 1 / np.where(l == 0, 1, l)
    lse = np.where(l == 0, -np.inf, (m + np.log2(np.where(l == 0, 1, l))) * LN2)
    return acc * factor[:, None], lse


def store(out_flat, values, first, valid_rows, *, row_stride, first_scale, column0=0):
    """`store_rows`: row r < valid_rows, column c at first * first_scale + r * row_stride + column0 + c."""
    values = values.reshape(values.shape[0], -1)
    for r in range(valid_rows):
        at = first * first_scale + r * row_stride + column0
        out_flat[at:at + values.shape[1]] = values[r]


def model_decode(q, k_pool, kv_indptr, kv_indices, num_kv_splits, draft_words, *, tokens, q_heads, sm_scale,
                 max_kv_splits, window=-1, block_kv=K.BLOCK_KV, merger_skew=0):
    """mla_decode_mgpu_kernel's partial buffers (mid_o, mid_lse), unwritten entries NaN; block_kv: its key tile;
    merger_skew: the merging split's extra keys (`decode_cta`; the kernel's with merge=True)."""
    shape = K.SHAPES[q.shape[-1]]
    rows_total, batch = q.shape[0], len(kv_indptr) - 1
    rows_per_seq = tokens * q_heads
    block_rows = min(rows_per_seq, K.BLOCK_ROWS)
    mid_o = np.full(rows_total * max_kv_splits * shape.v_dim, np.nan, np.float32)
    mid_lse = np.full(rows_total * max_kv_splits, np.nan, np.float32)
    cols = np.broadcast_to(np.arange(block_kv)[None, :], (K.BLOCK_ROWS, block_kv))
    for seq in range(batch):
        for block in range(rows_per_seq // block_rows):
            row0 = seq * rows_per_seq + block * block_rows
            q_block = gather_tile(q, row0, block_rows, pool_rows=rows_total)  # 64 rows, zeros past the block's
            for split in range(max_kv_splits):
                cta = K.decode_cta(kv_indptr, num_kv_splits, seq, split, capacity=len(kv_indices),
                                   sliding_window=window, max_kv_splits=max_kv_splits, min_block_kv=32, tokens=tokens,
                                   block_kv=block_kv, merger_skew=merger_skew)
                if _int(cta.split_len) <= 0:
                    continue

                def bits_of(first_draft):  # draft_bits_tile, or (no words: causal drafts) causal_draft_bits
                    if draft_words is None:
                        seq_rows = block * block_rows + np.arange(K.BLOCK_ROWS)[:, None]
                        return np.asarray(K.causal_draft_bits(first_draft, cols, seq_rows, q_heads=q_heads))
                    rows = (row0 + np.arange(K.BLOCK_ROWS)[:, None]) // q_heads  # a word per (sequence, token)
                    draft = _int(first_draft) + cols
                    inside = (rows < len(draft_words)) & (draft >= 0) & (draft < 32)
                    words = np.asarray(draft_words)[np.where(rows < len(draft_words), rows, 0), 0].view(np.uint32)
                    return np.where(inside, (words >> np.clip(draft, 0, 31).astype(np.uint32)) & 1, 0)

                tiles = []
                loops = ((0, cta.full_steps, False), (cta.full_steps, cta.steps, True))
                assert _int(loops[0][0]) == 0 and _int(loops[0][1]) == _int(loops[1][0]) <= _int(loops[1][1])
                for start, end, masked in loops:
                    for step in range(_int(start), _int(end)):
                        first = _int(cta.kv_begin + cta.split_start + step * block_kv)
                        keys = gather_tile(k_pool, first, _int(cta.split_len) - step * block_kv,
                                           indices=np.asarray(kv_indices), pool_rows=k_pool.shape[0], block_kv=block_kv)
                        visible = (np.asarray(K.decode_visible(cta, step, cols, tokens, bits_of, block_kv=block_kv))
                                   if masked else None)
                        tiles.append((keys[:, :shape.qk_dim], visible))
                out, lse = attend(q_block[:, :shape.qk_dim], tiles, shape.v_dim, sm_scale)
                first_out = row0 * max_kv_splits + split
                store(mid_o, out, first_out, block_rows, row_stride=max_kv_splits * shape.v_dim, first_scale=shape.v_dim)
                store(mid_lse, lse[:, None], first_out, block_rows, row_stride=max_kv_splits, first_scale=1)
    return mid_o.reshape(rows_total, max_kv_splits, shape.v_dim), mid_lse.reshape(rows_total, max_kv_splits)


def merge(mid_o, mid_lse):
    """Stage 2 over the written (non-NaN-LSE) splits: the LSE-weighted sum."""
    out = np.zeros((mid_o.shape[0], mid_o.shape[2]), np.float32)
    for g in range(mid_o.shape[0]):
        written = ~np.isnan(mid_lse[g])
        lse = mid_lse[g][written]
        if not written.any() or np.all(lse == -np.inf):
            continue
        w = np.exp(lse - lse.max())
        out[g] = (w[:, None] * mid_o[g][written]).sum(0) / w.sum()
    return out


@pytest.mark.parametrize("dim,block_kv", [(576, 64), (288, 64), (576, 32)], ids=["576", "288", "576-kv32"])
@pytest.mark.parametrize("tokens,tree", [(1, False), (4, False), (4, True), (8, False), (8, True)],
                         ids=["decode", "verify-causal", "verify-tree", "verify-causal-2-head-blocks",
                              "verify-tree-2-head-blocks"])
def test_decode_model_matches_reference(rng, dim, block_kv, tokens, tree):
    # Verify: lists shorter than the tokens, drafts in a whole 64-key tile (128 in splits of 64) and in a partial one.
    kv_lens = [2, 37, 0, 200, 128, 97] if tokens > 1 else [1, 37, 0, 64, 161, 300]
    batch, q_heads, v_dim = len(kv_lens), 16, dim - (64 if dim == 576 else 32)
    kv_indptr, kv_indices, slots = random_pool_batch(rng, kv_lens, num_slots=sum(kv_lens) + 9)
    k_pool = rng.standard_normal((slots, 1, dim)).astype(np.float32)
    q = rng.standard_normal((batch, tokens, q_heads, dim)).astype(np.float32)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=q_heads, kv_heads=1, max_kv_splits=3,
                                       min_split_len=32, programs_per_sm=10**6)
    draft_mask = None
    words = None  # one token, or causal drafts (the kernel computes their mask: `causal_draft_bits`)
    if tree:
        parents = [[int(rng.integers(-1, t)) for t in range(tokens)] for _ in kv_lens]
        draft_mask = draft_mask_bits(np.stack([tree_mask_for_verify(p, 0) for p in parents]))
        words = np.asarray(draft_mask).reshape(-1, 1)  # as _launch passes it: a word per (sequence, token)
    scale = dim ** -0.5
    mid_o, mid_lse = model_decode(q.reshape(-1, 1, dim), k_pool, np.asarray(kv_indptr), np.asarray(kv_indices),
                                  np.asarray(meta.num_kv_splits), words, tokens=tokens, q_heads=q_heads, sm_scale=scale,
                                  max_kv_splits=3, block_kv=block_kv)
    o = merge(mid_o, mid_lse).reshape(batch, tokens, q_heads, v_dim)
    qq = q[:, 0] if tokens == 1 else q
    ref = decode_attention_reference(jnp.asarray(qq), jnp.asarray(k_pool), None, meta, v_head_dim=v_dim,
                                     sm_scale=scale, draft_mask=draft_mask)
    np.testing.assert_allclose(o.reshape(np.asarray(ref).shape), np.asarray(ref), atol=2e-5, rtol=2e-5)


def model_kernel_merge(mid_o, mid_lse, kv_indptr, num_kv_splits, *, capacity, max_kv_splits, q_heads, sinks, padded,
                       merger_skew=0):
    """The kernel's own merge (merge=True) over the partials of `model_decode`: per sequence (one token), the split
    roles by `decode_cta` (splits [0, nonempty_splits) have keys; the last of them merges), the partials folded in
    the kernel's order (the padded tile: its own first, then the writers'; the transposed: the writers', then its own)
    by the kernel module's own `merge_split_partial` / `merged_result`, the transposed tile on transposed arrays."""
    rows_total, v_dim = mid_o.shape[0], mid_o.shape[2]
    out, lse_out = np.zeros((rows_total, v_dim), np.float32), np.zeros(rows_total, np.float32)
    stats_dim = 0 if padded else 1
    arrange = (lambda a: a) if padded else (lambda a: a.T)  # the transposed tile holds [v_dim, heads]
    for seq in range(len(kv_indptr) - 1):
        ctas = [K.decode_cta(kv_indptr, num_kv_splits, seq, split, capacity=capacity, sliding_window=-1,
                             max_kv_splits=max_kv_splits, min_block_kv=32, tokens=1, merger_skew=merger_skew)
                for split in range(max_kv_splits)]
        nonempty = _int(ctas[0].nonempty_splits)
        assert all(_int(c.nonempty_splits) == nonempty for c in ctas)
        assert [s for s, c in enumerate(ctas) if _int(c.split_len) > 0] == list(range(nonempty))
        # The splits with keys cover the sequence's keys once, in order (a skewed merger starts where its writer ends).
        covered = [(_int(c.split_start), _int(c.split_start) + _int(c.split_len)) for c in ctas[:nonempty]]
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
        assert not covered or (covered[0][0], covered[-1][1]) == (0, _int(ctas[0].kv_len))
        rows = slice(seq * q_heads, (seq + 1) * q_heads)
        part = lambda s: (jnp.asarray(arrange(mid_o[rows, s])), jnp.asarray(mid_lse[rows, s]))  # noqa: E731
        merged = (jnp.zeros(arrange(mid_o[rows, 0]).shape, jnp.float32), jnp.full(q_heads, -jnp.inf, jnp.float32),
                  jnp.zeros(q_heads, jnp.float32))
        order = list(range(nonempty))
        if padded and nonempty:
            order = order[-1:] + order[:-1]
        for s in order:
            merged = K.merge_split_partial(merged, *part(s), stats_dim=stats_dim)
        o, lse = K.merged_result(merged, None if sinks is None else jnp.asarray(sinks), stats_dim=stats_dim)
        out[rows], lse_out[rows] = arrange(np.asarray(o)), np.asarray(lse)
    return out, lse_out


def test_merger_skew_moves_keys_from_the_last_writer_to_the_merger():
    # MLA at 64 x 4096 keys, 2 splits: the writer keeps 4096 / 2 - 64 keys and the merger takes the rest; at 3 splits
    # only the boundary before the merger moves; no skew where the writer would be left without keys, or one split.
    def ranges(kv_len, splits, skew):
        ctas = [K.decode_cta(np.array([0, kv_len]), np.array([splits]), 0, s, capacity=kv_len, sliding_window=-1,
                             max_kv_splits=splits, min_block_kv=32, tokens=1, merger_skew=skew) for s in range(splits)]
        return [(_int(c.split_start), _int(c.split_len), _int(c.steps)) for c in ctas]

    assert ranges(4096, 2, 0) == [(0, 2048, 32), (2048, 2048, 32)]
    assert ranges(4096, 2, 64) == [(0, 1984, 31), (1984, 2112, 33)]
    assert ranges(3000, 3, 64) == [(0, 1024, 16), (1024, 960, 15), (1984, 1016, 16)]
    assert ranges(4096, 2, 2048) == ranges(4096, 2, 0)
    assert ranges(4096, 1, 64) == ranges(4096, 1, 0)
    with pytest.raises(ValueError, match="merger_skew must be an int >= 0, and 0 unless merge=True"):
        K.check_merger_skew(64, merge=False)


@pytest.mark.parametrize("padded", [False, True], ids=["transposed", "padded"])
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("merger_skew", [0, 64, 4096], ids=["even", "skew-64", "skew-past-a-split"])
def test_kernel_merge_model_matches_reference(rng, padded, sinks, merger_skew):
    # The split roles and the merge's arithmetic (the kernel module's functions): sequences without keys (0, and the
    # LSE -inf or the sink's), one split, several; against the reference's output and LSE. merger_skew: the merging
    # split takes keys from the one before it (none where that split would be left without keys).
    kv_lens = [1, 37, 0, 64, 161, 300, 1000]
    batch, q_heads, dim, v_dim, splits = len(kv_lens), 16, 576, 512, 4
    kv_indptr, kv_indices, slots = random_pool_batch(rng, kv_lens, num_slots=sum(kv_lens) + 9)
    k_pool = rng.standard_normal((slots, 1, dim)).astype(np.float32)
    q = rng.standard_normal((batch, q_heads, dim)).astype(np.float32)
    meta = decode_metadata_from_indptr(kv_indptr, kv_indices, q_heads=q_heads, kv_heads=1, max_kv_splits=splits,
                                       min_split_len=32, programs_per_sm=10**6)
    # Every sequence asks for 4 splits: short ones have fewer with keys (splits are whole 32-key multiples).
    meta = dataclasses.replace(meta, num_kv_splits=jnp.full_like(meta.num_kv_splits, splits))
    sink_values = rng.standard_normal(q_heads).astype(np.float32) if sinks else None
    scale = dim ** -0.5
    mid_o, mid_lse = model_decode(q.reshape(-1, 1, dim), k_pool, np.asarray(kv_indptr), np.asarray(kv_indices),
                                  np.asarray(meta.num_kv_splits), None, tokens=1, q_heads=q_heads, sm_scale=scale,
                                  max_kv_splits=splits, merger_skew=merger_skew)
    o, lse = model_kernel_merge(mid_o, mid_lse, np.asarray(kv_indptr), np.asarray(meta.num_kv_splits),
                                capacity=len(kv_indices), max_kv_splits=splits, q_heads=q_heads, sinks=sink_values,
                                padded=padded, merger_skew=merger_skew)
    ref, ref_lse = decode_attention_reference(jnp.asarray(q), jnp.asarray(k_pool), None, meta, v_head_dim=v_dim,
                                              sm_scale=scale, return_lse=True,
                                              sinks=None if sink_values is None else jnp.asarray(sink_values))
    np.testing.assert_allclose(o.reshape(batch, q_heads, v_dim), np.asarray(ref), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse.reshape(batch, q_heads), np.asarray(ref_lse), atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(o.reshape(batch, q_heads, v_dim)[2], 0.0)  # no keys


def model_extend(q, k_new, k_pool, qo_indptr, kv_indptr, kv_indices, *, q_heads, sm_scale, max_extend_len, sinks=None):
    """mla_extend_mgpu_kernel's output rows [tokens * q_heads, v_dim] (zeros where it writes nothing)."""
    shape = K.SHAPES[q.shape[-1]]
    tokens, batch = k_new.shape[0], len(qo_indptr) - 1
    out = np.zeros(tokens * q_heads * shape.v_dim, np.float32)
    cols = np.broadcast_to(np.arange(K.BLOCK_KV)[None, :], (K.BLOCK_ROWS, K.BLOCK_KV))
    rows = np.broadcast_to(np.arange(K.BLOCK_ROWS)[:, None], (K.BLOCK_ROWS, K.BLOCK_KV))
    for seq in range(batch):
        for block in range(-(-max_extend_len * q_heads // K.BLOCK_ROWS)):
            cta = K.extend_cta(qo_indptr, kv_indptr, seq, block, tokens=tokens, capacity=len(kv_indices),
                               max_extend_len=max_extend_len, q_heads=q_heads)
            count = _int(cta.count)
            if count <= 0:
                continue
            q_row0 = _int(cta.q_start) * q_heads + _int(cta.r0)
            q_block = gather_tile(q, q_row0, count, pool_rows=q.shape[0])
            prefix_mask = lambda step: np.asarray(K.extend_prefix_visible(cta, step, cols))  # noqa: E731
            causal_mask = lambda step: np.asarray(K.extend_causal_visible(cta, step, cols, rows, q_heads))  # noqa: E731
            loops = K.extend_loops(cta, prefix_mask, causal_mask)
            bounds = [(_int(a), _int(b)) for a, b, _ in loops]
            assert bounds[0][0] == 0 and all(bounds[i][1] == bounds[i + 1][0] for i in range(3))
            assert bounds[-1][1] == _int(cta.steps) and all(a <= b for a, b in bounds)
            tiles = []
            for (start, end), (_, _, mask) in zip(bounds, loops):
                for step in range(start, end):
                    from_pool, first, n = (_int(x) for x in K.extend_tile_source(cta, step))
                    keys = (gather_tile(k_pool, first, n, indices=np.asarray(kv_indices), pool_rows=k_pool.shape[0])
                            if from_pool else gather_tile(k_new, first, n, pool_rows=tokens))
                    tiles.append((keys, None if mask is None else mask(step)))
            sink = None if sinks is None else np.asarray(sinks)[(_int(cta.r0) + np.arange(K.BLOCK_ROWS)) % q_heads]
            o, _ = attend(q_block, tiles, shape.v_dim, sm_scale, sink)
            store(out, o, q_row0, count, row_stride=shape.v_dim, first_scale=shape.v_dim)
    return out.reshape(tokens, q_heads, shape.v_dim)


@pytest.mark.parametrize("dim,q_heads", [(576, 16), (576, 4), (288, 16)])
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_extend_model_matches_reference(rng, dim, q_heads, sinks):
    # Empty prefixes and extends, prefixes ending mid-tile, an extend longer than a tile and one past max_extend_len.
    batch = make_batch(rng, [0, 100, 37, 5], [1, 70, 9, 0], hq=q_heads, hkv=1, dqk=dim, dtype=jnp.float32,
                       max_extend_len=75)
    v_dim = dim - (64 if dim == 576 else 32)
    sink_values = rng.standard_normal(q_heads).astype(np.float32) if sinks else None
    k_pool = np.asarray(_clean(batch.k_pool))
    out = model_extend(np.asarray(batch.q).reshape(-1, 1, dim), np.asarray(batch.k_new), k_pool,
                       np.asarray(batch.meta.qo_indptr), np.asarray(batch.meta.kv_indptr), np.asarray(batch.meta.kv_indices),
                       q_heads=q_heads, sm_scale=dim ** -0.5, max_extend_len=batch.meta.max_extend_len, sinks=sink_values)
    ref = mla_extend_attention_reference(batch.q, batch.k_new, jnp.asarray(k_pool), batch.meta, v_head_dim=v_dim,
                                         sinks=None if sink_values is None else jnp.asarray(sink_values))
    np.testing.assert_allclose(out[: batch.tokens], np.asarray(ref)[: batch.tokens], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(out[batch.tokens:], 0.0)


def _ring(name: str, step: int, stages: int):
    """The barrier of ring slot step % stages: name "ready" (its tile landed) or "free" (its tile consumed)."""
    return (name, step % stages)


def _producer_program(steps: int, *, stages: int, fp8: bool, copies_first: bool = False):
    """The producer warpgroup's barrier operations (`stream_latent_tiles`): Q, then each tile, a slot's previous tile
    released first; over an fp8 pool its copies start stages - 1 tiles ahead and its conversion completes the tile's
    barrier (a "load" here), the next copies issued after the conversion or (copies_first) before it."""
    ready = functools.partial(_ring, "ready", stages=stages)
    free = functools.partial(_ring, "free", stages=stages)

    def start(step):
        if step >= steps:
            return []
        ops = [("wait", free(step), (step // stages - 1) % 2, step - stages)] if step >= stages else []
        return ops + ([] if fp8 else [("load", ready(step), step)])

    producer = [("load", "q", 0)]
    if fp8:
        for ahead in range(stages - 1):
            producer += start(ahead)
        for step in range(steps):
            converted = [("load", ready(step), step)]
            after = start(step + stages - 1)
            producer += after + converted if copies_first else converted + after
    else:
        for step in range(steps):
            producer += start(step)
    return producer


def _mla_cta_programs(steps: int, *, stages: int, fp8: bool):
    """The barrier operations of one MLA CTA (`_cta`) in the kernel's order: warpgroup 0 (S, softmax, half of P V,
    P and alpha handed over), warpgroup 1 (the other half), the producer (`_producer_program`)."""
    ready = functools.partial(_ring, "ready", stages=stages)
    free = functools.partial(_ring, "free", stages=stages)

    def wait_ready(step):
        return ("wait", ready(step), (step // stages) % 2, step)

    producer = _producer_program(steps, stages=stages, fp8=fp8)
    scores = [("wait", "q", 0, 0)]
    second = []
    for step in range(steps):
        scores.append(wait_ready(step))
        if step > 0:
            scores.append(("wait", "p_free", (step - 1) % 2, step - 1))
        scores += [("arrive", "p_ready", step), ("arrive", free(step), step)]
        second += [("wait", "p_ready", step % 2, step), wait_ready(step), ("arrive", "p_free", step),
                   ("arrive", free(step), step)]
    if steps:
        scores.append(("wait", "p_free", (steps - 1) % 2, steps - 1))
    scores.append(("arrive", "p_ready", steps))  # the output factors
    second.append(("wait", "p_ready", steps % 2, steps))
    return {"producer": producer, "scores": scores, "second": second}


@pytest.mark.parametrize("fp8", [False, True], ids=["16-bit", "fp8"])
def test_transposed_tile_barrier_protocol_never_hangs(fp8):
    # CPU: the transposed tile's CTA (one consumer warpgroup: each tile waited for, then released; the producer over an
    # fp8 pool issuing a tile's copies before converting the one before, `copies_first`) in random interleavings with
    # loads and conversions landing late: no deadlock, no wait passing early or on another tile's phase.
    import random

    from tests.barrier_model import Barrier, run_protocol

    rng = random.Random(7)
    stages = 2  # TRANSPOSED_STAGES
    for steps in (1, 2, 3, 7, 32):
        consumer = [("wait", "q", 0, 0)]
        for step in range(steps):
            consumer += [("wait", _ring("ready", step, stages), (step // stages) % 2, step),
                         ("arrive", _ring("free", step, stages), step)]
        programs = {"producer": _producer_program(steps, stages=stages, fp8=fp8, copies_first=True),
                    "consumer": consumer}
        for _ in range(5):
            barriers = {_ring("ready", s, stages): Barrier(1) for s in range(stages)}
            barriers |= {_ring("free", s, stages): Barrier(1) for s in range(stages)} | {"q": Barrier(1)}
            run_protocol(programs, barriers, rng)


@pytest.mark.parametrize("fp8", [False, True], ids=["16-bit", "fp8"])
def test_barrier_protocol_never_hangs(fp8):
    # CPU: one CTA's warpgroups in random interleavings with loads (and fp8 conversions) landing late: no deadlock, no
    # wait passing early or on another tile's phase, at the ring depths of both latent shapes.
    import random

    from tests.barrier_model import Barrier, run_protocol

    rng = random.Random(5)
    for stages in (2, 4):
        for steps in (1, 2, 3, 7, 32):
            programs = _mla_cta_programs(steps, stages=stages, fp8=fp8)
            for _ in range(5):
                barriers = {_ring("ready", s, stages): Barrier(1) for s in range(stages)}
                barriers |= {_ring("free", s, stages): Barrier(2) for s in range(stages)}  # both consumers release a slot
                barriers |= {"q": Barrier(1), "p_ready": Barrier(1), "p_free": Barrier(1)}
                run_protocol(programs, barriers, rng)
