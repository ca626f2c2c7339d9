"""Trace-time validation: every public op rejects bad shapes, dtypes, head counts, head dims, index dtypes and options
with a ValueError that names the argument. No kernel runs here: every call fails while tracing."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.decode import decode_attention, decode_attention_reference, decode_metadata, decode_metadata_from_indptr
from jaxattn.extend import (
    extend_attention,
    extend_attention_reference,
    extend_attention_unified,
    extend_metadata,
    extend_unified_metadata,
)
from jaxattn.kv_indices import build_unified_kv_indices, create_kv_indices
from jaxattn.kv_pool import write_kv
from jaxattn.merge_state import merge_state
from jaxattn.serving.batch import ForwardBatch, ForwardMode
from jaxattn.reference import ragged_paged_attention_reference

I32 = jnp.int32


def i32(*values):
    return jnp.asarray(values, I32)


# A tiny valid setup: 2 sequences, 4 q heads over 2 kv heads, head dim 32, a 16-slot pool.
B, HQ, HKV, D, SLOTS, CAP = 2, 4, 2, 32, 16, 8
Q_DEC = jnp.zeros((B, HQ, D))
K_POOL = jnp.zeros((SLOTS, HKV, D))
V_POOL = jnp.zeros((SLOTS, HKV, D))
KV_INDPTR = i32(0, 3, 5)
KV_INDICES = jnp.arange(1, CAP + 1, dtype=I32)
REQ_TO_TOKEN = jnp.arange(1, 3 * 8 + 1, dtype=I32).reshape(3, 8) % SLOTS
ROWS = i32(2, 0)
SEQ_LENS = i32(3, 2)


def dec_meta(**kw):
    return decode_metadata_from_indptr(KV_INDPTR, KV_INDICES, q_heads=HQ, kv_heads=HKV, **kw)


def ext_args():
    return REQ_TO_TOKEN, ROWS, i32(2, 1), i32(3, 2)


def ext_meta(**kw):
    return extend_metadata(*ext_args(), max_extend_len=4, kv_capacity=CAP, **kw)


def unified_meta(**kw):
    return extend_unified_metadata(*ext_args(), jnp.arange(10, 15, dtype=I32), max_extend_len=4, kv_capacity=CAP + 5, **kw)


T = 5  # extend tokens
Q_EXT = jnp.zeros((T, HQ, D))
K_NEW = jnp.zeros((T, HKV, D))
V_NEW = jnp.zeros((T, HKV, D))


def extend(**kw):
    args = dict(q=Q_EXT, k_new=K_NEW, v_new=V_NEW, k_pool=K_POOL, v_pool=V_POOL, meta=ext_meta())
    options = {k: kw.pop(k) for k in list(kw) if k not in args}
    args.update(kw)
    return extend_attention(**args, **options)


def unified(**kw):
    args = dict(q=Q_EXT, k_pool=K_POOL, v_pool=V_POOL, meta=unified_meta())
    options = {k: kw.pop(k) for k in list(kw) if k not in args}
    args.update(kw)
    return extend_attention_unified(**args, **options)


def decode(**kw):
    args = dict(q=Q_DEC, k_pool=K_POOL, v_pool=V_POOL, meta=dec_meta())
    options = {k: kw.pop(k) for k in list(kw) if k not in args}
    args.update(kw)
    return decode_attention(**args, **options)


def _batch(**fields):
    base = dict(req_pool_indices=ROWS, seq_lens=SEQ_LENS, extend_lens=i32(1, 1), out_cache_loc=i32(1, 2),
                positions=i32(2, 1), max_extend_len=4, kv_capacity=CAP, max_seq_len=8)
    return ForwardBatch(**dict(base, **fields))


# (id, call, regex the message must match: it names the argument and what was expected)
CASES = [
    # create_kv_indices
    ("create/req_to_token-rank", lambda: create_kv_indices(REQ_TO_TOKEN[0], ROWS, SEQ_LENS, capacity=8), r"req_to_token must have rank 2"),
    ("create/req_to_token-dtype", lambda: create_kv_indices(REQ_TO_TOKEN.astype(jnp.float32), ROWS, SEQ_LENS, capacity=8), r"req_to_token must have dtype int32/int64"),
    ("create/req_pool_indices-dtype", lambda: create_kv_indices(REQ_TO_TOKEN, ROWS.astype(jnp.uint32), SEQ_LENS, capacity=8), r"req_pool_indices must have dtype"),
    ("create/kv_lens-shape", lambda: create_kv_indices(REQ_TO_TOKEN, ROWS, i32(1, 2, 3), capacity=8), r"kv_lens must have shape \(2,\)"),
    ("create/kv_starts-shape", lambda: create_kv_indices(REQ_TO_TOKEN, ROWS, SEQ_LENS, i32(0), capacity=8), r"kv_starts must have shape \(2,\)"),
    ("create/capacity", lambda: create_kv_indices(REQ_TO_TOKEN, ROWS, SEQ_LENS, capacity=0), r"capacity must be a positive"),
    ("create/index_dtype", lambda: create_kv_indices(REQ_TO_TOKEN, ROWS, SEQ_LENS, capacity=8, index_dtype=jnp.int16), r"index_dtype must be int32/int64"),
    # build_unified_kv_indices
    ("unified-indices/prefix_kv_indptr", lambda: build_unified_kv_indices(KV_INDPTR[None], KV_INDICES, None, SEQ_LENS, KV_INDICES), r"prefix_kv_indptr must have rank 1"),
    ("unified-indices/extend_seq_lens", lambda: build_unified_kv_indices(KV_INDPTR, KV_INDICES, None, i32(1), KV_INDICES), r"extend_seq_lens must have shape \(2,\)"),
    ("unified-indices/extend_start_loc", lambda: build_unified_kv_indices(KV_INDPTR, KV_INDICES, i32(0, 1, 2), SEQ_LENS, KV_INDICES), r"extend_start_loc must have shape"),
    ("unified-indices/extend_kv_indices", lambda: build_unified_kv_indices(KV_INDPTR, KV_INDICES, None, SEQ_LENS, KV_INDICES.astype(jnp.float32)), r"extend_kv_indices must have dtype"),
    ("unified-indices/index_dtype", lambda: build_unified_kv_indices(KV_INDPTR, KV_INDICES, None, SEQ_LENS, KV_INDICES, index_dtype=jnp.float32), r"index_dtype must be int32/int64"),
    # merge_state
    ("merge/o1-rank", lambda: merge_state(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros((2, 3))), r"o1 must have rank 3"),
    ("merge/o1-dtype", lambda: merge_state(jnp.zeros((2, 3, 8), I32), jnp.zeros((2, 3)), jnp.zeros((2, 3, 8), I32), jnp.zeros((2, 3))), r"o1 must have dtype"),
    ("merge/lse1-shape", lambda: merge_state(jnp.zeros((2, 3, 8)), jnp.zeros((2, 4)), jnp.zeros((2, 3, 8)), jnp.zeros((2, 3))), r"lse1 must have shape \(2, 3\)"),
    ("merge/o2-shape", lambda: merge_state(jnp.zeros((2, 3, 8)), jnp.zeros((2, 3)), jnp.zeros((2, 3, 4)), jnp.zeros((2, 3))), r"o2 must have shape"),
    # decode_metadata
    ("decode_metadata/req_to_token", lambda: decode_metadata(REQ_TO_TOKEN.astype(jnp.float32), ROWS, SEQ_LENS, kv_capacity=8, q_heads=HQ, kv_heads=HKV), r"req_to_token must have dtype"),
    ("decode_metadata/req_pool_indices", lambda: decode_metadata(REQ_TO_TOKEN, ROWS[None], SEQ_LENS, kv_capacity=8, q_heads=HQ, kv_heads=HKV), r"req_pool_indices must have rank 1"),
    ("decode_metadata/seq_lens-shape", lambda: decode_metadata(REQ_TO_TOKEN, ROWS, i32(1, 2, 3), kv_capacity=8, q_heads=HQ, kv_heads=HKV), r"seq_lens must have shape \(2,\)"),
    ("decode_metadata/seq_lens-dtype", lambda: decode_metadata(REQ_TO_TOKEN, ROWS, SEQ_LENS.astype(jnp.float32), kv_capacity=8, q_heads=HQ, kv_heads=HKV), r"seq_lens must have dtype"),
    ("decode_metadata/kv_capacity", lambda: decode_metadata(REQ_TO_TOKEN, ROWS, SEQ_LENS, kv_capacity=0, q_heads=HQ, kv_heads=HKV), r"kv_capacity must be a positive"),
    ("decode_metadata/heads", lambda: decode_metadata(REQ_TO_TOKEN, ROWS, SEQ_LENS, kv_capacity=8, q_heads=6, kv_heads=4), r"q_heads \(6\) must be a multiple of kv_heads \(4\)"),
    ("decode_metadata/sliding_window", lambda: decode_metadata(REQ_TO_TOKEN, ROWS, SEQ_LENS, kv_capacity=8, q_heads=HQ, kv_heads=HKV, sliding_window=-3), r"sliding_window must be -1"),
    ("decode_metadata/max_kv_splits", lambda: decode_metadata(REQ_TO_TOKEN, ROWS, SEQ_LENS, kv_capacity=8, q_heads=HQ, kv_heads=HKV, max_kv_splits=0), r"max_kv_splits must be a positive"),
    ("decode_metadata/deterministic-bucket", lambda: decode_metadata(REQ_TO_TOKEN, ROWS, SEQ_LENS, kv_capacity=8, q_heads=HQ, kv_heads=HKV, deterministic=True, split_tile_size=2, max_kv_splits=2), r"max_kv_splits \(2\) x split_tile_size \(2\) must cover"),
    # decode_metadata_from_indptr
    ("from_indptr/kv_indptr-dtype", lambda: decode_metadata_from_indptr(KV_INDPTR.astype(jnp.float32), KV_INDICES, q_heads=HQ, kv_heads=HKV), r"kv_indptr must have dtype"),
    ("from_indptr/kv_indices-rank", lambda: decode_metadata_from_indptr(KV_INDPTR, KV_INDICES[None], q_heads=HQ, kv_heads=HKV), r"kv_indices must have rank 1"),
    ("from_indptr/seq_lens", lambda: decode_metadata_from_indptr(KV_INDPTR, KV_INDICES, i32(3), q_heads=HQ, kv_heads=HKV), r"seq_lens must have shape \(2,\)"),
    ("from_indptr/sliding_window", lambda: dec_meta(sliding_window=-2), r"sliding_window must be -1"),
    ("from_indptr/max_context_len", lambda: dec_meta(max_context_len=0), r"max_context_len must be a positive"),
    # decode_attention
    ("decode/q-dtype", lambda: decode(q=Q_DEC.astype(I32)), r"q must have dtype float32/float16/bfloat16"),
    ("decode/q-rank", lambda: decode(q=Q_DEC[0]), r"q must have rank 3"),
    ("decode/k_pool-dtype", lambda: decode(k_pool=K_POOL.astype(jnp.bfloat16)), r"k_pool must have q's dtype float32 or an fp8 format"),
    ("decode/v_pool-heads", lambda: decode(v_pool=V_POOL[:, :1]), r"v_pool must have shape"),
    ("decode/heads", lambda: decode(q=jnp.zeros((B, 3, D))), r"q_heads \(3, q.shape\[1\]\) must be a multiple of kv_heads \(2"),
    ("decode/qk_head_dim-small", lambda: decode(q=jnp.zeros((B, HQ, 8)), k_pool=jnp.zeros((SLOTS, HKV, 8)), v_pool=jnp.zeros((SLOTS, HKV, 8))), r"qk_head_dim \(q.shape\[2\]\) \(a head dim\) must be in \[16, 576\]"),
    ("decode/qk_head_dim-big", lambda: decode(q=jnp.zeros((B, HQ, 640)), k_pool=jnp.zeros((SLOTS, HKV, 640)), v_pool=V_POOL), r"qk_head_dim .* must be in \[16, 576\].*got 640"),
    ("decode/v_head_dim", lambda: decode(v_pool=jnp.zeros((SLOTS, HKV, 8))), r"v_head_dim \(v_pool.shape\[2\]\) .* must be in \[16, 512\]"),
    ("decode/v_head_dim-mla", lambda: decode(v_pool=None, v_head_dim=8), r"v_head_dim .* must be in \[16, 512\]"),
    ("decode/sinks-shape", lambda: decode(sinks=jnp.zeros((HQ + 1,))), r"sinks must have shape \(4,\)"),
    ("decode/sinks-dtype", lambda: decode(sinks=jnp.zeros((HQ,), I32)), r"sinks must have dtype"),
    ("decode/sliding_window", lambda: decode(sliding_window=-2), r"sliding_window must be -1"),
    ("decode/window-vs-meta", lambda: decode(meta=dec_meta(sliding_window=3), sliding_window=5), r"sliding_window \(5\) must not exceed meta.sliding_window \(3\)"),
    ("decode/logit_cap", lambda: decode(logit_cap=-1.0), r"logit_cap must be a float >= 0, finite in float32"),
    ("decode/xai_temperature_len", lambda: decode(xai_temperature_len=1), r"xai_temperature_len must be an int, <= 0 \(off\) or >= 2"),
    ("decode/meta-type", lambda: decode(meta=ext_meta()), r"meta must be a DecodeMetadata"),
    ("decode/meta-batch", lambda: decode(q=Q_DEC[:1]), r"meta batch \(2, .*\) must equal q.shape\[0\] \(1\)"),
    ("decode-reference/heads", lambda: decode_attention_reference(jnp.zeros((B, 3, D)), K_POOL, V_POOL, dec_meta()), r"q_heads \(3, q.shape\[1\]\) must be a multiple"),
    # extend_metadata / extend_unified_metadata
    ("extend_metadata/req_to_token", lambda: extend_metadata(REQ_TO_TOKEN[0], ROWS, i32(2, 1), i32(3, 2), max_extend_len=4, kv_capacity=CAP), r"req_to_token must have rank 2"),
    ("extend_metadata/prefix_lens", lambda: extend_metadata(REQ_TO_TOKEN, ROWS, i32(2), i32(3, 2), max_extend_len=4, kv_capacity=CAP), r"prefix_lens must have shape \(2,\)"),
    ("extend_metadata/extend_lens", lambda: extend_metadata(REQ_TO_TOKEN, ROWS, i32(2, 1), i32(3, 2).astype(jnp.float32), max_extend_len=4, kv_capacity=CAP), r"extend_lens must have dtype"),
    ("extend_metadata/max_extend_len", lambda: ext_meta() if False else extend_metadata(*ext_args(), max_extend_len=-4, kv_capacity=CAP), r"max_extend_len must be a positive"),
    ("extend_metadata/kv_capacity", lambda: extend_metadata(*ext_args(), max_extend_len=4, kv_capacity=0), r"kv_capacity must be a positive"),
    ("extend_metadata/sliding_window", lambda: ext_meta(sliding_window=-7), r"sliding_window must be -1"),
    ("extend_metadata/index_dtype", lambda: ext_meta(index_dtype=jnp.uint8), r"index_dtype must be int32/int64"),
    ("unified_metadata/out_cache_loc", lambda: extend_unified_metadata(*ext_args(), jnp.zeros((5,), jnp.float32), max_extend_len=4, kv_capacity=CAP), r"out_cache_loc must have dtype"),
    ("unified_metadata/extend_start_loc", lambda: extend_unified_metadata(*ext_args(), jnp.arange(5, dtype=I32), max_extend_len=4, kv_capacity=CAP, extend_start_loc=i32(0)), r"extend_start_loc must have shape \(2,\)"),
    # extend_attention (two-stage)
    ("extend/q-dtype", lambda: extend(q=Q_EXT.astype(I32)), r"q must have dtype"),
    ("extend/k_pool-rank", lambda: extend(k_pool=K_POOL[0]), r"k_pool must have rank 3"),
    ("extend/k_pool-dtype", lambda: extend(k_pool=K_POOL.astype(jnp.float16)), r"k_pool must have q's dtype float32"),
    ("extend/v_pool-slots", lambda: extend(v_pool=V_POOL[:3]), r"v_pool must have shape"),
    ("extend/heads", lambda: extend(q=jnp.zeros((T, 3, D))), r"q_heads \(3, q.shape\[1\]\) must be a multiple of kv_heads \(2"),
    ("extend/qk_head_dim", lambda: extend(q=jnp.zeros((T, HQ, 8)), k_new=jnp.zeros((T, HKV, 8)), k_pool=jnp.zeros((SLOTS, HKV, 8))), r"qk_head_dim \(q.shape\[2\]\) .* must be in \[16, 576\]"),
    ("extend/v_head_dim", lambda: extend(v_new=jnp.zeros((T, HKV, 1024)), v_pool=jnp.zeros((SLOTS, HKV, 1024))), r"v_head_dim \(v_pool.shape\[2\]\) .* must be in \[16, 512\]"),
    ("extend/k_new", lambda: extend(k_new=K_NEW[:2]), r"k_new must have shape"),
    ("extend/v_new-dtype", lambda: extend(v_new=V_NEW.astype(jnp.bfloat16)), r"v_new must have dtype float32"),
    ("extend/custom_mask-dtype", lambda: extend(custom_mask=jnp.ones(40, jnp.float32)), r"custom_mask must have dtype bool/uint8/int8"),
    ("extend/custom_mask-rank", lambda: extend(custom_mask=jnp.ones((5, 8), bool)), r"custom_mask must have rank 1"),
    ("extend/mask_indptr", lambda: extend(meta=dataclasses.replace(ext_meta(), mask_indptr=None), custom_mask=jnp.ones(40, bool)), r"mask_indptr .* is required with custom_mask"),
    ("extend/sinks-shape", lambda: extend(sinks=jnp.zeros((2,))), r"sinks must have shape \(4,\)"),
    ("extend/sinks-dtype", lambda: extend(sinks=jnp.zeros((HQ,), I32)), r"sinks must have dtype"),
    ("extend/sliding_window", lambda: extend(sliding_window=-2), r"sliding_window must be -1"),
    ("extend/window-vs-meta", lambda: extend(meta=ext_meta(sliding_window=2), sliding_window=3), r"sliding_window \(3\) must be in \[0, 2\]"),
    ("extend/logit_cap", lambda: extend(logit_cap=float("nan")), r"logit_cap must be a float >= 0, finite in float32"),
    ("extend/xai_temperature_len", lambda: extend(xai_temperature_len=1), r"xai_temperature_len must be"),
    ("extend/meta-type", lambda: extend(meta=unified_meta()), r"meta must be an ExtendMetadata"),
    ("extend/meta.kv_start_pos", lambda: extend(meta=dataclasses.replace(ext_meta(), kv_start_pos=i32(0))), r"meta.kv_start_pos must have shape \(2,\)"),
    ("extend/meta.kv_indices", lambda: extend(meta=dataclasses.replace(ext_meta(), kv_capacity=CAP + 1)), r"meta.kv_indices must have shape \(9,\)"),
    ("extend/meta.max_extend_len", lambda: extend(meta=dataclasses.replace(ext_meta(), max_extend_len=0)), r"meta.max_extend_len must be a positive"),
    ("extend/kv_indptr", lambda: extend(meta=dataclasses.replace(ext_meta(), kv_indptr=i32(0, 1))), r"kv_indptr must have shape \(3,\)"),
    ("extend/config", lambda: extend(config="fast"), r"config must be an ExtendConfig"),
    ("extend-reference/sinks", lambda: extend_attention_reference(Q_EXT, K_NEW, V_NEW, K_POOL, V_POOL, ext_meta(), sinks=jnp.zeros(3)), r"sinks must have shape"),
    # extend_attention_unified
    ("unified/v_pool-dtype", lambda: unified(v_pool=V_POOL.astype(jnp.float16)), r"v_pool must have q's dtype"),
    ("unified/meta-type", lambda: unified(meta=ext_meta()), r"meta must be an ExtendUnifiedMetadata"),
    ("unified/meta.prefix_lens", lambda: unified(meta=dataclasses.replace(unified_meta(), prefix_lens=i32(1, 2, 3))), r"meta.prefix_lens must have shape \(2,\)"),
    ("unified/window_start_pos", lambda: unified(window_start_pos=jnp.zeros((2,), jnp.float32)), r"window_start_pos must have dtype"),
    ("unified/custom_mask", lambda: unified(custom_mask=jnp.ones(40, jnp.float16)), r"custom_mask must have dtype bool/uint8/int8"),
    ("unified/qk_head_dim", lambda: unified(q=jnp.zeros((T, HQ, 600)), k_pool=jnp.zeros((SLOTS, HKV, 600))), r"qk_head_dim .* must be in \[16, 576\].*got 600"),
    # the reference
    ("reference/qo_indptr", lambda: ragged_paged_attention_reference(Q_EXT, K_POOL, V_POOL, KV_INDPTR.astype(jnp.float32), KV_INDPTR, KV_INDICES), r"qo_indptr must have dtype"),
    ("reference/custom_mask", lambda: ragged_paged_attention_reference(Q_EXT, K_POOL, V_POOL, KV_INDPTR, KV_INDPTR, KV_INDICES, custom_mask=jnp.ones(4), mask_indptr=KV_INDPTR), r"custom_mask must have dtype"),
    # Found by an adversarial pass (2026-12-05): an empty pool (every kernel would read slot 0 outside it), statics that
    # overflow float32 or are not bools, zero split knobs, lengths of 0, Python lists, numpy scalars for MLA.
    ("decode/k_pool-no-slots", lambda: decode(k_pool=K_POOL[:0], v_pool=V_POOL[:0]), r"k_pool must have at least one slot"),
    ("decode/k_pool-no-heads", lambda: decode(k_pool=K_POOL[:, :0], v_pool=V_POOL[:, :0]), r"k_pool.shape\[1\] \(kv_heads\) must be >= 1"),
    ("extend/k_pool-no-slots", lambda: extend(k_pool=K_POOL[:0], v_pool=V_POOL[:0]), r"k_pool must have at least one slot"),
    ("unified/k_pool-no-slots", lambda: unified(k_pool=K_POOL[:0], v_pool=V_POOL[:0]), r"k_pool must have at least one slot"),
    ("reference/k_pool-no-slots", lambda: ragged_paged_attention_reference(Q_EXT, K_POOL[:0], V_POOL[:0], KV_INDPTR, KV_INDPTR, KV_INDICES), r"k_pool must have at least one slot"),
    ("decode/sm_scale-overflows-f32", lambda: decode(sm_scale=1e300), r"sm_scale must be None .* finite in float32; got 1e\+300"),
    ("decode/sm_scale-bool", lambda: decode(sm_scale=True), r"sm_scale must be None"),
    ("extend/logit_cap-overflows-f32", lambda: extend(logit_cap=1e300), r"logit_cap must be a float >= 0, finite in float32"),
    ("extend/logit_cap-bool", lambda: extend(logit_cap=True), r"logit_cap must be a float"),
    ("extend/causal-None", lambda: extend(causal=None), r"causal must be a bool \(a static flag\); got None"),
    ("extend/skip_prefix_custom_mask-str", lambda: extend(skip_prefix_custom_mask="no"), r"skip_prefix_custom_mask must be a bool"),
    ("unified/causal-str", lambda: unified(causal="no"), r"causal must be a bool"),
    ("extend-reference/causal-None", lambda: extend_attention_reference(Q_EXT, K_NEW, V_NEW, K_POOL, V_POOL, ext_meta(), causal=None), r"causal must be a bool"),
    ("from_indptr/split_tile_size-0", lambda: dec_meta(deterministic=True, split_tile_size=0), r"split_tile_size must be a positive"),
    ("from_indptr/min_split_len-0", lambda: dec_meta(min_split_len=0), r"min_split_len must be a positive"),
    ("from_indptr/kv_indptr-empty", lambda: decode_metadata_from_indptr(KV_INDPTR[:0], KV_INDICES, q_heads=HQ, kv_heads=HKV), r"kv_indptr must have max_batch \+ 1 >= 1 entries"),
    ("decode_metadata/req_to_token-no-columns", lambda: decode_metadata(REQ_TO_TOKEN[:, :0], ROWS, SEQ_LENS, kv_capacity=8, q_heads=HQ, kv_heads=HKV), r"req_to_token must have at least one column"),
    ("decode/v_head_dim-float", lambda: decode(v_pool=None, v_head_dim=16.0), r"v_head_dim must be given as an int"),
    ("merge/head_dim-0", lambda: merge_state(jnp.zeros((2, 3, 0)), jnp.zeros((2, 3)), jnp.zeros((2, 3, 0)), jnp.zeros((2, 3))), r"o1 must have head_dim >= 1"),
    ("DecodeMetadata/lists", lambda: dataclasses.replace(dec_meta(), kv_indptr=[0, 3, 5]), r"DecodeMetadata's index fields must be arrays"),
    ("extend/qo_indptr-vs-kv_indptr", lambda: extend(meta=dataclasses.replace(ext_meta(), qo_indptr=i32(0, 3))), r"batch = qo_indptr.shape\[0\] - 1 = 1 \(one of the two has the wrong length\)"),
    ("ForwardBatch/custom_mask-in-extend", lambda: _batch(custom_mask=jnp.ones(8, bool)), r"custom_mask is a TARGET_VERIFY field; the batch's mode is EXTEND"),
    ("ForwardBatch/custom_mask-dtype", lambda: _batch(mode=ForwardMode.TARGET_VERIFY, custom_mask=jnp.ones(8)), r"custom_mask must have dtype bool/uint8/int8"),
    ("ForwardBatch/seq_lens-list", lambda: _batch(seq_lens=[3, 5]), r"ForwardBatch.seq_lens must be an array .*; got a list"),
    ("ForwardBatch/out_cache_loc-tuple", lambda: _batch(out_cache_loc=(1, 2)), r"ForwardBatch.out_cache_loc must be an array"),
    ("ForwardBatch/max_extend_len-bool", lambda: _batch(max_extend_len=True), r"max_extend_len must be a positive int"),
    # write_kv
    ("write_kv/k_pool-dtype", lambda: write_kv(K_POOL.astype(I32), V_POOL, i32(1, 2), K_NEW[:2], V_NEW[:2]), r"k_pool must have dtype"),
    ("write_kv/v_pool-shape", lambda: write_kv(K_POOL, V_POOL[:4], i32(1, 2), K_NEW[:2], V_NEW[:2]), r"v_pool must have shape"),
    ("write_kv/out_cache_loc-dtype", lambda: write_kv(K_POOL, V_POOL, jnp.asarray([1.0, 2.0]), K_NEW[:2], V_NEW[:2]), r"out_cache_loc must have dtype int32/int64"),
    ("write_kv/out_cache_loc-rank", lambda: write_kv(K_POOL, V_POOL, i32(1, 2)[None], K_NEW[:2], V_NEW[:2]), r"out_cache_loc must have rank 1"),
    ("write_kv/k-shape", lambda: write_kv(K_POOL, V_POOL, i32(1, 2), K_NEW[:3], V_NEW[:2]), r"k must have shape \(2, 2, 32\)"),
    ("write_kv/v-dtype", lambda: write_kv(K_POOL, V_POOL, i32(1, 2), K_NEW[:2], V_NEW[:2].astype(I32)), r"v must have dtype"),
    ("write_kv/k_scale", lambda: write_kv(K_POOL.astype(jnp.float8_e4m3fn), V_POOL, i32(1, 2), K_NEW[:2], V_NEW[:2], k_scale=0.0), r"k_scale must be None, a finite float > 0"),
    ("write_kv/v_scale-shape", lambda: write_kv(K_POOL, V_POOL.astype(jnp.float8_e5m2), i32(1, 2), K_NEW[:2], V_NEW[:2], v_scale=jnp.ones(3)), r"v_scale must be a scalar"),
]


@pytest.mark.parametrize("call, message", [pytest.param(c, m, id=i) for i, c, m in CASES])
def test_rejects_with_a_message_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_valid_setup_traces():
    """The fixtures above are valid: every op accepts them (so each case fails for its one bad argument)."""
    import jax

    meta = dec_meta()
    jax.eval_shape(lambda: decode_attention(Q_DEC, K_POOL, V_POOL, meta, mode="interpret"))
    jax.eval_shape(lambda: extend(mode="interpret"))
    jax.eval_shape(lambda: unified(mode="interpret"))
    jax.eval_shape(lambda: write_kv(K_POOL, V_POOL, i32(1, 2), K_NEW[:2], V_NEW[:2]))
    fp8 = write_kv(K_POOL.astype(jnp.float8_e4m3fn), V_POOL, i32(1, 2), K_NEW[:2], V_NEW[:2], k_scale=np.float32(0.5))
    assert fp8[0].dtype == jnp.float8_e4m3fn
    jax.eval_shape(lambda: merge_state(jnp.zeros((2, 3, 8)), jnp.zeros((2, 3)), jnp.zeros((2, 3, 8)), jnp.zeros((2, 3))))


def test_testing_tolerance_serves_chex_and_rejects_unknown_dtypes():
    import chex

    from jaxattn import testing

    ref = jnp.linspace(-1.0, 1.0, 7, dtype=jnp.float32)
    chex.assert_trees_all_close(ref.astype(jnp.bfloat16).astype(jnp.float32), ref, **testing.tolerance(jnp.bfloat16))
    with pytest.raises(AssertionError):
        chex.assert_trees_all_close(ref + 1e-3, ref, **testing.tolerance(jnp.float32))
    with pytest.raises(ValueError, match="no tolerance for dtype int32"):
        testing.tolerance(jnp.int32)


def test_numpy_scalars_are_taken_where_python_ones_are():
    # MLA extend took Python ints and floats only (np.int64 v_head_dim, np.float32 sm_scale were refused, while decode
    # and extend take them); decode's latent v_head_dim took floats and numpy ints into the kernels unconverted.
    import numpy as np

    from jaxattn.mla import mla_extend_attention_reference

    pool = jnp.ones((SLOTS, 1, 288))
    meta = extend_metadata(*ext_args(), max_extend_len=4, kv_capacity=CAP)
    o = mla_extend_attention_reference(jnp.ones((T, HQ, 288)), jnp.ones((T, 1, 288)), pool, meta,
                                       v_head_dim=np.int64(256), sm_scale=np.float32(0.1))
    assert o.shape == (T, HQ, 256)
    o = decode_attention_reference(jnp.ones((B, HQ, 288)), pool, None, dec_meta(), v_head_dim=np.int64(256))
    assert o.shape == (B, HQ, 256)
