"""Lowers (does not run) `extend_attention_mgpu`, the MLA decode kernel and the GQA decode kernel for CUDA on a CPU machine; run by
tests/test_extend_mgpu.py.

Needs jax's CUDA plugin module on sys.path (scripts/setup.sh puts it in .venv/mosaic_gpu_lowering). Lowering runs
Pallas' Mosaic GPU lowering and Mosaic's layout inference, which reject what the kernel cannot express (e.g. a TMA
into 8-row tiles at a row offset not provably a multiple of 8); ptxas and the run itself happen only on a GPU.
Prints one line per shape: "ok <label>" or "FAIL <label>: <error>". Arguments: a substring of the labels to lower,
"i/n" to lower every n-th shape from the i-th, and "--core" for the `CORE` shapes only. Each shape costs about a second
of lowering: README's test command lowers the `CORE` shapes (tests/test_extend_mgpu.py), CI (`.ci/run`) every shape.
"""
import contextlib
import dataclasses
import re
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.calls import DecodeCall, ExtendCall, MlaExtendCall
from jaxattn.decode import DecodeMetadata
from jaxattn.extend import extend_metadata, extend_unified_metadata
from jaxattn.extend_mgpu import MgpuExtendConfig, extend_attention_mgpu, extend_attention_unified_mgpu
from jaxattn.impl.mgpu_decode import gqa_decode_partials, kernel_split_bound, run as gqa_decode_run
from jaxattn.impl.mgpu_extend import FP8, LATENT, UNIFIED_FP8
from jaxattn.impl.mgpu_mla import mla_decode_partials, run_decode as mla_run_decode, run_extend
from jaxattn.tuning import MgpuDecodeConfig


SHAPES = [  # label, tokens, q heads, kv heads, head dim, dtype, config, features
    ("gqa-128-bf16", 300, 8, 2, 128, jnp.bfloat16, MgpuExtendConfig(), {}),  # every K/V tile by cp.async
    ("mha-128-f16-kv64s3", 512, 4, 4, 128, jnp.float16, MgpuExtendConfig(block_kv=64, stages=3), {}),
    ("gqa-128-bf16-short", 5, 4, 2, 128, jnp.bfloat16, MgpuExtendConfig(), {}),
    ("gqa-64-bf16", 256, 4, 1, 64, jnp.bfloat16, MgpuExtendConfig(), {}),  # tokens % 8 == 0: new tiles by TMA
    # Features: window (on a full and a window-cut prefix list), soft cap, sinks, all three; TMA and cp.async tiles.
    ("window-128-bf16", 300, 8, 2, 128, jnp.bfloat16, MgpuExtendConfig(), dict(sliding_window=100)),
    ("window-cut-64-bf16-tma", 256, 4, 1, 64, jnp.bfloat16, MgpuExtendConfig(), dict(sliding_window=0, cut=True)),
    ("softcap-128-f16-kv64s3", 512, 4, 4, 128, jnp.float16, MgpuExtendConfig(block_kv=64, stages=3), dict(logit_cap=30.0)),
    ("sinks-128-bf16", 300, 8, 2, 128, jnp.bfloat16, MgpuExtendConfig(), dict(sinks=True)),
    ("all-128-bf16-tma", 512, 8, 2, 128, jnp.bfloat16, MgpuExtendConfig(), dict(sliding_window=1024, cut=True, logit_cap=50.0, sinks=True)),
    ("all-64-f16-kv64s4", 300, 4, 2, 64, jnp.float16, MgpuExtendConfig(block_kv=64, stages=4), dict(sliding_window=37, logit_cap=5.0, sinks=True)),
    # Non-causal (encoder tokens) with TMA and cp.async new tiles; xai temperature with a window and a soft cap.
    ("noncausal-128-bf16", 300, 8, 2, 128, jnp.bfloat16, MgpuExtendConfig(), dict(causal=False)),
    ("noncausal-64-bf16-tma-sinks", 256, 4, 1, 64, jnp.bfloat16, MgpuExtendConfig(), dict(causal=False, sinks=True)),
    ("xai-window-cap-128-bf16-tma", 512, 8, 2, 128, jnp.bfloat16, MgpuExtendConfig(), dict(xai_temperature_len=64, sliding_window=100, logit_cap=30.0)),
    # The unified form (every key from the pool): plain, and non-causal with every score feature.
    ("unified-128-bf16", 300, 8, 2, 128, jnp.bfloat16, MgpuExtendConfig(), dict(unified=True)),
    ("unified-64-f16-kv64s3-all", 256, 4, 2, 64, jnp.float16, MgpuExtendConfig(block_kv=64, stages=3), dict(unified=True, causal=False, logit_cap=5.0, sinks=True, xai_temperature_len=16)),
    # DeepSeek's non-absorbed prefill (q/k 192, v 128): O through its own buffer; TMA new tiles; the unified form.
    ("mha-192-128-bf16-tma-window", 256, 4, 4, 192, jnp.bfloat16, None, dict(dv=128, sliding_window=64, logit_cap=10.0)),
    ("unified-192-128-bf16", 300, 4, 4, 192, jnp.bfloat16, None, dict(dv=128, unified=True)),
    # Gemma's 256 (partial O tiles in 64-column chunks): plain by cp.async, window + soft cap by TMA, unified.
    ("gqa-256-bf16", 300, 8, 4, 256, jnp.bfloat16, None, {}),
    ("gqa-256-f16-tma-window-cap", 512, 8, 4, 256, jnp.float16, None, dict(sliding_window=100, logit_cap=50.0)),
    ("unified-256-bf16-sinks", 300, 8, 4, 256, jnp.bfloat16, None, dict(unified=True, causal=False, sinks=True)),
    # Custom masks (tree verify): gathered per masked tile; new tiles only (skip prefix) or every tile; with features.
    ("mask-128-bf16-tma", 512, 8, 2, 128, jnp.bfloat16, None, dict(mask=True)),
    ("mask-prefix-64-f16-cap-sinks-xai", 300, 4, 2, 64, jnp.float16, None,
     dict(mask=True, skip_prefix_custom_mask=False, logit_cap=5.0, sinks=True, xai_temperature_len=16)),
    # Short extends (max_extend_len <= 64, an even group): two q heads per CTA; a verify step's mask, a window.
    ("packed-mask-128-bf16-tma", 256, 8, 2, 128, jnp.bfloat16, None, dict(mask=True, max_extend_len=64)),
    ("packed-window-64-f16", 300, 8, 4, 64, jnp.float16, None, dict(sliding_window=20, max_extend_len=40)),
    # A custom mask under a window (verify on a sliding-window layer): on a cut list with the prefix columns read, and
    # two heads per CTA on a full list.
    ("mask-window-cut-128-bf16-tma", 512, 8, 2, 128, jnp.bfloat16, None,
     dict(mask=True, sliding_window=100, cut=True, skip_prefix_custom_mask=False)),
    ("packed-mask-window-64-f16", 300, 8, 4, 64, jnp.float16, None, dict(mask=True, sliding_window=30, max_extend_len=64)),
    # A tree as per-row draft words: alone (TMA new tiles), and two heads per CTA under a window with sinks.
    ("draft-128-bf16-tma", 512, 8, 2, 128, jnp.bfloat16, None, dict(draft=True)),
    ("packed-draft-window-64-f16", 300, 8, 4, 64, jnp.float16, None,
     dict(draft=True, sliding_window=30, sinks=True, max_extend_len=64)),
    # Three consumer warpgroups at 64-dim heads (192-row CTAs, no schedule barrier): plain with TMA new tiles, every
    # score feature on a cut list, the unified form, a tree mask.
    ("three-64-bf16-tma", 512, 8, 2, 64, jnp.bfloat16, MgpuExtendConfig(consumers=3), {}),
    ("three-64-f16-all", 300, 4, 2, 64, jnp.float16, MgpuExtendConfig(consumers=3),
     dict(sliding_window=100, cut=True, logit_cap=5.0, sinks=True, xai_temperature_len=16)),
    ("three-unified-64-bf16-noncausal", 300, 4, 1, 64, jnp.bfloat16, MgpuExtendConfig(consumers=3, block_kv=64, stages=3),
     dict(unified=True, causal=False)),
    ("three-mask-64-bf16", 300, 8, 2, 64, jnp.bfloat16, MgpuExtendConfig(consumers=3), dict(mask=True, max_extend_len=64)),
    # ... with the intra-warpgroup overlap on their unmasked runs: plain by TMA, every score feature on a cut list, the
    # unified form under a window (its unmasked middle run).
    ("overlap-64-bf16-tma", 512, 8, 2, 64, jnp.bfloat16, MgpuExtendConfig(consumers=3, overlap=True), {}),
    ("overlap-64-f16-all", 300, 4, 2, 64, jnp.float16, MgpuExtendConfig(consumers=3, overlap=True),
     dict(sliding_window=100, cut=True, logit_cap=5.0, sinks=True, xai_temperature_len=16)),
    ("overlap-unified-window-64-bf16", 300, 4, 1, 64, jnp.bfloat16, MgpuExtendConfig(consumers=3, overlap=True),
     dict(unified=True, sliding_window=100, sinks=True)),
    # The unified form under a window (uncut lists): with a soft cap and sinks, and at 64-key tiles.
    ("unified-window-128-bf16-cap-sinks", 512, 8, 2, 128, jnp.bfloat16, None,
     dict(unified=True, sliding_window=100, logit_cap=30.0, sinks=True)),
    ("unified-window-64-f16-kv64", 300, 4, 1, 64, jnp.float16, MgpuExtendConfig(block_kv=64, stages=3),
     dict(unified=True, sliding_window=0)),
    # The unified form with a custom mask over the listed keys (deterministic verify): alone, and two heads per CTA
    # under a window with sinks.
    ("unified-mask-128-bf16", 300, 8, 2, 128, jnp.bfloat16, None, dict(unified=True, mask=True)),
    ("unified-packed-mask-window-64-f16-sinks", 256, 8, 4, 64, jnp.float16, None,
     dict(unified=True, mask=True, sliding_window=30, sinks=True, max_extend_len=64)),
    # Lists of whole pages (meta.page_size; a pool of whole pages): prefix tiles by TMA page by page, beside TMA new
    # tiles; the unified form with a custom mask at 64-key tiles; pages larger than the tile under a window.
    ("pages64-128-bf16", 512, 8, 2, 128, jnp.bfloat16, None, dict(page_size=64)),
    ("pages64-unified-64-f16-kv64s3-mask", 300, 4, 2, 64, jnp.float16, MgpuExtendConfig(block_kv=64, stages=3),
     dict(unified=True, page_size=64, mask=True)),
    ("pages128-256-bf16-window", 512, 8, 4, 256, jnp.bfloat16, None, dict(page_size=128, sliding_window=100)),
    # The experimental page issue (one thread issues a tile's page copies on the row-copy mbarrier), 16-row pages.
    ("pages16-inline-128-bf16-unified", 300, 8, 2, 128, jnp.bfloat16, None,
     dict(unified=True, page_size=16, page_issue="inline")),
    ("pages32-inline-128-bf16", 512, 8, 2, 128, jnp.bfloat16, None, dict(page_size=32, page_issue="inline")),
    # fp8 pools read by the kernel (`impl="mgpu-fp8"` / "mgpu-unified-fp8": the producer converts each pool tile in
    # its ring slot): e4m3 beside TMA new tiles (constant scales); e5m2 with f16 q, a window and a soft cap (64-key tiles, 4 stages);
    # three consumers at 64; 256 with sinks; the unified form with a custom mask. (Page lists take the same code: an
    # fp8 pool's tiles are copied row by row.)
    ("fp8-e4m3-128-bf16-tma", 512, 8, 2, 128, jnp.bfloat16, None, dict(pool=jnp.float8_e4m3fn, constant_scales=True)),
    # f16 pool tiles (the default at 64 and 128) and q_dtype ones: a window with a custom mask (pool and new-key
    # tiles apart), two q heads per CTA (a short extend) with a soft cap and sinks; q_dtype explicitly.
    ("fp8-e4m3-128-bf16-qdtype", 512, 8, 2, 128, jnp.bfloat16, MgpuExtendConfig(fp8_tiles="q_dtype"),
     dict(pool=jnp.float8_e4m3fn)),
    ("fp8-e4m3-128-bf16-f16-window-mask", 300, 8, 2, 128, jnp.bfloat16, None,
     dict(pool=jnp.float8_e4m3fn, sliding_window=100, mask=True)),
    ("fp8-e5m2-64-bf16-f16-short-cap-sinks", 40, 8, 2, 64, jnp.bfloat16, MgpuExtendConfig(),
     dict(pool=jnp.float8_e5m2, max_extend_len=32, logit_cap=20.0, sinks=True)),
    ("fp8-e5m2-128-f16-kv64s4-window-cap", 300, 8, 2, 128, jnp.float16, MgpuExtendConfig(block_kv=64, stages=4),
     dict(pool=jnp.float8_e5m2, sliding_window=100, logit_cap=30.0)),
    ("fp8-e4m3-64-bf16-three", 300, 8, 2, 64, jnp.bfloat16, None, dict(pool=jnp.float8_e4m3fn)),
    ("fp8-e4m3-256-bf16-sinks", 300, 8, 4, 256, jnp.bfloat16, None, dict(pool=jnp.float8_e4m3fn, sinks=True)),
    ("fp8-e5m2-unified-128-bf16-mask", 300, 8, 2, 128, jnp.bfloat16, None,
     dict(pool=jnp.float8_e5m2, unified=True, mask=True)),
    # The shapes above take the staging tiles where they fit (every one but 256's; at 128 dims and 128-key tiles
    # only without Pallas' reduction scratch); the fp8 rows copied into the slots instead (fp8_staging off): beside
    # TMA new tiles; q_dtype tiles with f16 q and a window; 64 dims with three consumers; the unified form.
    ("fp8-in-slot-e4m3-128-bf16-tma", 512, 8, 2, 128, jnp.bfloat16, MgpuExtendConfig(fp8_staging=False),
     dict(pool=jnp.float8_e4m3fn)),
    # Staged with each thread refilling the staging bytes it converted (fp8_refill, opt-in): a window with a custom
    # mask (pool and new-key tiles apart, the first step past 0), the unified form, 64 dims two q heads a CTA.
    ("fp8-refill-e4m3-128-bf16-f16-window-mask", 300, 8, 2, 128, jnp.bfloat16, MgpuExtendConfig(fp8_refill=True),
     dict(pool=jnp.float8_e4m3fn, sliding_window=100, mask=True)),
    ("fp8-refill-e5m2-unified-128-bf16", 300, 8, 2, 128, jnp.bfloat16, MgpuExtendConfig(fp8_refill=True),
     dict(pool=jnp.float8_e5m2, unified=True)),
    ("fp8-refill-e4m3-64-bf16-short-sinks", 40, 8, 2, 64, jnp.bfloat16, MgpuExtendConfig(fp8_refill=True),
     dict(pool=jnp.float8_e4m3fn, max_extend_len=32, sinks=True)),
    ("fp8-in-slot-e5m2-128-f16-qdtype-window", 300, 8, 2, 128, jnp.float16,
     MgpuExtendConfig(fp8_tiles="q_dtype", fp8_staging=False), dict(pool=jnp.float8_e5m2, sliding_window=100)),
    ("fp8-in-slot-e4m3-64-bf16-three", 300, 8, 2, 64, jnp.bfloat16,
     MgpuExtendConfig(consumers=3, fp8_staging=False), dict(pool=jnp.float8_e4m3fn)),
    ("fp8-in-slot-e4m3-unified-128-bf16", 300, 8, 2, 128, jnp.bfloat16, MgpuExtendConfig(fp8_staging=False),
     dict(pool=jnp.float8_e4m3fn, unified=True)),
]


def _export(call, args, page_issue, page_size):
    """jax.export of call(*args) for CUDA; page_issue: the kernel's (not a wrapper argument) with page copies forced
    on for page_size (below the tuned rule's 64 rows too), set while tracing."""
    if page_issue is None:
        return jax.export.export(jax.jit(call), platforms=["cuda"])(*args)
    from jaxattn.impl.mgpu_extend import kernel_options_forced

    with kernel_options_forced(lambda kw: dict(kw, page_issue=page_issue, page_rows=min(page_size, kw["block_kv"]))):
        return jax.export.export(jax.jit(call), platforms=["cuda"])(*args)


def lower(tokens, hq, hkv, d, dtype, config, features=None, batch=3, slots=1000, capacity=500):
    S = jax.ShapeDtypeStruct
    idx = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
    features = dict(features or {})
    unified = features.pop("unified", False)
    window = features.pop("sliding_window", -1)
    cut = window if features.pop("cut", False) else -1  # prefix lists cut for the window, or full ones
    sinks = S((hq,), jnp.float32) if features.pop("sinks", False) else None
    if features.pop("mask", False):
        features["custom_mask"] = S((5000,), jnp.bool_)
    dv = features.pop("dv", d)
    max_extend_len = features.pop("max_extend_len", 256)
    page_size = features.pop("page_size", 1)
    page_issue = features.pop("page_issue", None)
    slots = slots // page_size * page_size  # a pool of whole pages
    pool_dtype = features.pop("pool", dtype)
    pool = (S((slots, hkv, d), pool_dtype), S((slots, hkv, dv), pool_dtype))
    if pool_dtype != dtype:
        return _lower_fp8(tokens, hq, hkv, d, dtype, config, pool, unified=unified, window=window, sinks=sinks,
                          page_size=page_size, max_extend_len=max_extend_len, capacity=capacity, batch=batch, **features)
    if unified:
        meta = jax.eval_shape(lambda: extend_unified_metadata(idx(4, 600), idx(batch), idx(batch), idx(batch), idx(tokens),
                                                              max_extend_len=max_extend_len, kv_capacity=capacity))
        meta = dataclasses.replace(meta, page_size=page_size)
        args = (S((tokens, hq, d), dtype), *pool, meta, sinks, features.pop("custom_mask", None))
        call = lambda *a: extend_attention_unified_mgpu(*a[:-2], sinks=a[-2], custom_mask=a[-1],  # noqa: E731
                                                        config=config, sliding_window=window, **features)
    else:
        meta = jax.eval_shape(lambda: extend_metadata(idx(4, 600), idx(batch), idx(batch), idx(batch), max_extend_len=max_extend_len,
                                                      kv_capacity=capacity, sliding_window=cut))
        meta = dataclasses.replace(meta, page_size=page_size)
        args = (S((tokens, hq, d), dtype), S((tokens, hkv, d), dtype), S((tokens, hkv, dv), dtype), *pool, meta, sinks)
        mask = features.pop("custom_mask", None)
        draft = S((tokens, 3), jnp.int32) if features.pop("draft", False) else None
        args += (mask, draft)
        call = lambda *a: extend_attention_mgpu(*a[:-3], sinks=a[-3], custom_mask=a[-2], draft_mask=a[-1],  # noqa: E731
                                                sliding_window=window, config=config, **features)
    exported = _export(call, args, page_issue, page_size)
    if "mosaic_gpu" not in exported.mlir_module():
        raise AssertionError("no Mosaic GPU custom call in the lowered module")


@contextlib.contextmanager
def reductions_without_scratch():
    """Fails a lowering in which a reduction is handed Pallas' reduction scratch (a cross-warp one): the extend
    kernel with fp8 staging tiles lowers with none reserved (`STAGED_REDUCTION_SCRATCH`), so such a reduction would
    read an empty buffer."""
    from jax.experimental.mosaic.gpu import fragmented_array

    reduce = fragmented_array.FragmentedArray.reduce

    def checked(self, op, axis, scratch=None, **kwargs):
        if scratch is not None:
            raise AssertionError("a cross-warp reduction takes Pallas' reduction scratch, which fp8_staging drops")
        return reduce(self, op, axis, scratch, **kwargs)

    fragmented_array.FragmentedArray.reduce = checked
    try:
        yield
    finally:
        fragmented_array.FragmentedArray.reduce = reduce


def _lower_fp8(tokens, hq, hkv, d, dtype, config, pool, *, unified, window, sinks, page_size, max_extend_len, capacity,
               batch, custom_mask=None, constant_scales=False, **features):
    """The fp8 implementations' kernel launch (built as `ExtendCall`s: on CPU the registry declines the kernel).
    constant_scales: the table of equal Python-number scales, which `scale_table_operand` hands over with one element
    more, in place of a traced table."""
    S = jax.ShapeDtypeStruct
    idx = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
    if unified:
        meta = jax.eval_shape(lambda: extend_unified_metadata(idx(4, 600), idx(batch), idx(batch), idx(batch), idx(tokens),
                                                              max_extend_len=max_extend_len, kv_capacity=capacity))
        new = (None, None)
    else:
        meta = jax.eval_shape(lambda: extend_metadata(idx(4, 600), idx(batch), idx(batch), idx(batch),
                                                      max_extend_len=max_extend_len, kv_capacity=capacity))
        new = (S((tokens, hkv, d), dtype), S((tokens, hkv, d), dtype))
    meta = dataclasses.replace(meta, page_size=page_size)
    args = (S((tokens, hq, d), dtype), *new, *pool, meta, sinks, custom_mask, S((2, hkv), jnp.float32))

    def call(q, k_new, v_new, k_pool, v_pool, meta, sinks, custom_mask, kv_scales):
        extend_call = ExtendCall(
            form="unified" if unified else "two_stage", q=q, k_new=k_new, v_new=v_new, k_pool=k_pool, v_pool=v_pool,
            meta=meta, kv_start_pos=meta.kv_start_pos, causal=features.get("causal", True), custom_mask=custom_mask,
            skip_prefix_custom_mask=not unified, sliding_window=window, logit_cap=features.get("logit_cap", 0.0),
            sinks=sinks, xai_temperature_len=-1, sm_scale=0.09, config=config, launch_mode="gpu",
            kv_scales=np.full((2, hkv), 0.5, np.float32) if constant_scales else kv_scales)
        return (UNIFIED_FP8 if unified else FP8).run(extend_call)

    # Staged or not (the staging tiles are the default where they fit), the guard holds for every fp8 shape.
    with reductions_without_scratch():
        exported = jax.export.export(jax.jit(call), platforms=["cuda"])(*args)
    if "mosaic_gpu" not in exported.mlir_module():
        raise AssertionError("no Mosaic GPU custom call in the lowered module")


# The MLA kernel's two forms. Decode (stage 1): label, batch, tokens, q heads, dtype, features; extend: label,
# "extend", tokens, q heads, dtype, features.
DECODE_SHAPES = [
    ("mla-extend-16-bf16", "extend", 300, 16, jnp.bfloat16, {}),
    ("mla-extend-16-f16-sinks-i64", "extend", 256, 16, jnp.float16, dict(sinks=True, index_dtype=jnp.int64)),
    ("mla-extend-128-bf16", "extend", 64, 128, jnp.bfloat16, {}),
    ("mla-extend-288-16-bf16-sinks", "extend", 200, 16, jnp.bfloat16, dict(dim=288, sinks=True)),
    # MLA's 288/256 on the GQA extend kernel (V read from the latent K tiles: `impl.mgpu_extend.LATENT`): tokens not a
    # multiple of 8 with sinks; a short extend (two q heads per CTA), int64 lists.
    ("mla-extend-gqa-288-16-bf16-sinks", "extend", 300, 16, jnp.bfloat16, dict(dim=288, sinks=True, latent_gqa=True)),
    ("mla-extend-gqa-288-16-f16-short-i64", "extend", 40, 16, jnp.float16,
     dict(dim=288, latent_gqa=True, max_extend_len=32, index_dtype=jnp.int64)),
    ("mla-decode-288-16-f16", 8, 1, 16, jnp.float16, dict(dim=288)),
    ("mla-verify-288-4x16-bf16-draft", 4, 4, 16, jnp.bfloat16, dict(dim=288, draft=True)),
    # 16 rows padded to 64 (by config: one token at 16 heads takes the transposed tile by default)
    ("mla-decode-16-bf16", 8, 1, 16, jnp.bfloat16, dict(transposed=False)),
    ("mla-verify-4x16-bf16-draft", 4, 4, 16, jnp.bfloat16, dict(draft=True)),  # 64 rows, a draft tree
    ("mla-verify-2x16-f16-causal-i64", 3, 2, 16, jnp.float16, dict(index_dtype=jnp.int64)),
    ("mla-decode-128-bf16-window-deterministic", 2, 1, 128, jnp.bfloat16, dict(sliding_window=100, deterministic=True)),
    # The GQA decode kernel (batch "gqa"; then: batch, q heads, q dtype, features): fp8 and 16-bit pools.
    ("gqa-decode-e4m3-32x8-bf16", "gqa", 4, 32, jnp.bfloat16, dict(kv_heads=8, pool=jnp.float8_e4m3fn)),
    ("gqa-decode-e5m2-8x1-f16-window-i64", "gqa", 3, 8, jnp.float16,
     dict(kv_heads=1, pool=jnp.float8_e5m2, sliding_window=50, index_dtype=jnp.int64)),
    ("gqa-decode-bf16-32x8", "gqa", 4, 32, jnp.bfloat16, dict(kv_heads=8)),
    ("gqa-decode-f16-64-64x1-stages2", "gqa", 2, 64, jnp.float16, dict(kv_heads=1, dim=64, stages=2)),
    ("gqa-decode-e4m3-12x3-bf16", "gqa", 2, 12, jnp.bfloat16, dict(kv_heads=3, pool=jnp.float8_e4m3fn)),
    # Persistent CTAs (each takes work items in turn): 16-bit with a window and an odd kv head count; fp8.
    ("gqa-decode-bf16-12x3-window-persistent", "gqa", 5, 12, jnp.bfloat16, dict(kv_heads=3, sliding_window=70, persistent=True)),
    ("gqa-decode-e4m3-32x8-bf16-persistent", "gqa", 4, 32, jnp.bfloat16, dict(kv_heads=8, pool=jnp.float8_e4m3fn, persistent=True)),
    # One split: the kernel writes o and the LSE (no merge), persistent and not.
    ("gqa-decode-bf16-32x8-final", "gqa", 4, 32, jnp.bfloat16, dict(kv_heads=8, splits=1, persistent=False)),
    ("gqa-decode-e4m3-12x3-bf16-final-persistent", "gqa", 5, 12, jnp.bfloat16, dict(kv_heads=3, pool=jnp.float8_e4m3fn, splits=1, persistent=True)),
    # The MLA kernel's padded tile over an fp8 latent pool (`impl="mgpu-fp8"`: tiles converted to f16 by its
    # producer): one token with a window (named, so the shape stays the padded tile's whatever the fp8 default,
    # `MLA_DECODE_TRANSPOSED_FP8`), and a 4-token verify under a draft tree (e5m2, f16 q).
    ("mla-decode-e4m3-16-bf16-window", 8, 1, 16, jnp.bfloat16,
     dict(pool=jnp.float8_e4m3fn, sliding_window=300, transposed=False)),
    ("mla-verify-e5m2-4x16-f16-draft", 4, 4, 16, jnp.float16, dict(pool=jnp.float8_e5m2, draft=True)),
    # 32-key tiles in a 4-deep ring (`MgpuDecodeConfig(block_kv=32)`: 64-byte swizzle, P in its own buffer): 16-bit
    # with a window, and an fp8 verify under a draft tree.
    ("mla-decode-kv32-16-bf16-window", 8, 1, 16, jnp.bfloat16, dict(block_kv=32, sliding_window=300)),
    ("mla-verify-kv32-e4m3-4x16-bf16-draft", 4, 4, 16, jnp.bfloat16, dict(block_kv=32, pool=jnp.float8_e4m3fn, draft=True)),
    # The transposed tile (`MgpuDecodeConfig(transposed=True)`: keys as wgmma's M, the heads as N): 16 heads with a
    # window, 64 heads in f16.
    ("mla-decode-transposed-16-bf16-window", 8, 1, 16, jnp.bfloat16, dict(transposed=True, sliding_window=300)),
    ("mla-decode-transposed-32-f16", 5, 1, 32, jnp.float16, dict(transposed=True)),
    # ... over fp8 latent pools (the producer converting each tile, as the padded tile's): a window, e4m3 under f16 q;
    # e5m2 under bf16 q (q rounded to f16 by the call) merging 2 splits through a cluster.
    ("mla-decode-transposed-e4m3-16-f16-window", 8, 1, 16, jnp.float16,
     dict(transposed=True, pool=jnp.float8_e4m3fn, sliding_window=300)),
    ("mla-decode-transposed-merge-e5m2-32-bf16-2-splits", 8, 1, 32, jnp.bfloat16,
     dict(transposed=True, merge=True, pool=jnp.float8_e5m2, splits=2, waits_on="cluster")),
    # The transposed tile merging the splits itself (the op's result, no Triton merge): a window at its own bound (16
    # splits: a GMEM semaphore); deterministic metadata's bound (4: a cluster); 2 splits (MLA's: a cluster); one split
    # (nothing to wait for).
    ("mla-decode-transposed-merge-16-bf16-window-sinks", 8, 1, 16, jnp.bfloat16,
     dict(merge=True, sliding_window=300, sinks=True, waits_on="semaphore")),
    ("mla-decode-transposed-merge-32-f16-deterministic", 5, 1, 32, jnp.float16,
     dict(merge=True, deterministic=True, waits_on="cluster")),
    ("mla-decode-transposed-merge-16-bf16-2-splits", 8, 1, 16, jnp.bfloat16,
     dict(merge=True, splits=2, waits_on="cluster")),
    ("mla-decode-transposed-merge-16-bf16-one-split", 8, 1, 16, jnp.bfloat16, dict(merge=True, splits=1)),
    # The padded tile merging the splits itself (each consumer warpgroup its half): a verify step under a draft tree;
    # two head blocks with a window on deterministic metadata; fp8 with sinks; 288 wide on one split.
    ("mla-verify-merge-4x16-bf16-draft", 4, 4, 16, jnp.bfloat16, dict(merge=True, draft=True)),
    ("mla-decode-merge-128-bf16-window-deterministic", 2, 1, 128, jnp.bfloat16,
     dict(merge=True, sliding_window=100, deterministic=True, waits_on="cluster")),
    ("mla-decode-merge-e4m3-16-bf16-sinks", 8, 1, 16, jnp.bfloat16,
     dict(merge=True, pool=jnp.float8_e4m3fn, sinks=True, waits_on="semaphore")),
    ("mla-decode-merge-288-16-f16-one-split", 8, 1, 16, jnp.float16, dict(merge=True, dim=288, splits=1)),
    # Causal verify (no tree): the padded tile computes the draft mask from its rows (`causal_draft_bits`), one head
    # block and two (8 tokens x 16 heads), merging its splits with sinks.
    ("mla-verify-merge-4x16-bf16-causal", 4, 4, 16, jnp.bfloat16, dict(merge=True)),
    ("mla-verify-merge-8x16-f16-causal-sinks", 3, 8, 16, jnp.float16, dict(merge=True, sinks=True)),
    # The padded tile's splits as one cluster (2-8 splits: `CLUSTER_MAX_SPLITS`): a verify step under a draft tree at
    # 3 splits, fp8 at 2 with sinks.
    ("mla-verify-merge-4x16-bf16-draft-3-splits", 4, 4, 16, jnp.bfloat16,
     dict(merge=True, draft=True, splits=3, waits_on="cluster")),
    ("mla-decode-merge-e4m3-16-bf16-sinks-2-splits", 8, 1, 16, jnp.bfloat16,
     dict(merge=True, pool=jnp.float8_e4m3fn, sinks=True, splits=2, transposed=False, waits_on="cluster")),
    # The merging split taking 64 keys from the split before it (`MgpuDecodeConfig.merger_skew`): both tiles.
    ("mla-decode-transposed-merge-16-bf16-2-splits-skew", 8, 1, 16, jnp.bfloat16,
     dict(merge=True, splits=2, merger_skew=64, waits_on="cluster")),
    ("mla-verify-merge-4x16-bf16-causal-skew", 4, 4, 16, jnp.bfloat16, dict(merge=True, merger_skew=64)),
]


# What README's test command lowers (every shape takes ~1.1 s; CI lowers all of them): each kernel family once, with
# the most features a shape of that family combines.
CORE = [
    # extend: window + soft cap + sinks by TMA; a custom mask over the prefix columns; a draft tree two heads a CTA;
    # three consumers overlapped; unified masked and packed; 192/128; 256; page lists; fp8 pools, both forms (with
    # staging tiles: sm_90's shared memory to its last 2 KB), and copied into the slots.
    "all-128-bf16-tma", "mask-prefix-64-f16-cap-sinks-xai", "packed-draft-window-64-f16", "overlap-64-f16-all",
    "unified-packed-mask-window-64-f16-sinks", "mha-192-128-bf16-tma-window", "gqa-256-f16-tma-window-cap",
    "pages64-unified-64-f16-kv64s3-mask", "fp8-e4m3-128-bf16-f16-window-mask", "fp8-e5m2-unified-128-bf16-mask",
    "fp8-in-slot-e4m3-128-bf16-tma",
    # MLA extend (its own kernel and the GQA kernel's latent form); the GQA decode kernel (fp8, one split persistent);
    # MLA decode: the padded tile at 32-key tiles, the transposed one merging through a cluster, the padded one through
    # a semaphore.
    "mla-extend-16-f16-sinks-i64", "mla-extend-gqa-288-16-f16-short-i64", "gqa-decode-e5m2-8x1-f16-window-i64",
    "gqa-decode-e4m3-12x3-bf16-final-persistent", "mla-verify-kv32-e4m3-4x16-bf16-draft",
    "mla-decode-transposed-merge-e5m2-32-bf16-2-splits", "mla-decode-merge-e4m3-16-bf16-sinks",
    "mla-verify-merge-8x16-f16-causal-sinks",
]


def lower_decode(batch, tokens, q_heads, dtype, features, slots=3000, capacity=5000):
    S = jax.ShapeDtypeStruct
    if batch == "extend":
        return lower_mla_extend(tokens, q_heads, dtype, features, slots=slots, capacity=capacity)
    if batch == "gqa":
        return lower_gqa_decode(tokens, q_heads, dtype, features, slots=slots, capacity=capacity)
    features = dict(features)
    index_dtype = features.pop("index_dtype", jnp.int32)
    dim = features.pop("dim", 576)
    q_shape = (batch, q_heads, dim) if tokens == 1 else (batch, tokens, q_heads, dim)
    pool = features.pop("pool", dtype)
    block_kv = features.pop("block_kv", None)
    transposed = features.pop("transposed", None)
    merge = features.pop("merge", None)
    waits_on = features.pop("waits_on", None)  # merge shapes: how the last split waits, "cluster" or "semaphore"
    splits_bound = features.pop("splits", None)
    merger_skew = features.pop("merger_skew", None)
    args = (S(q_shape, dtype), S((slots, 1, dim), pool), S((batch + 1,), jnp.int32), S((capacity,), index_dtype),
            S((batch,), jnp.int32), S((batch, tokens), jnp.int32) if features.pop("draft", False) else None,
            S((2, 1), jnp.float32) if pool != dtype else None)

    def call(q, k_pool, kv_indptr, kv_indices, splits, draft_mask, kv_scales):
        meta = DecodeMetadata(kv_indptr, kv_indices, splits, splits, max_kv_splits=4, kv_capacity=capacity,
                              sliding_window=features.get("sliding_window", -1),
                              deterministic=features.get("deterministic", False))
        sinks = jnp.linspace(-1.0, 1.0, q_heads, dtype=jnp.float32) if features.get("sinks") else None
        decode_call = DecodeCall(q=q, k_pool=k_pool, v_pool=None, meta=meta, sinks=sinks, sm_scale=0.07, logit_cap=0.0,
                                 xai_temperature_len=-1, sliding_window=features.get("sliding_window", -1),
                                 v_head_dim={576: 512, 288: 256}[dim], return_lse=False,
                                 config=None if block_kv is transposed is merge is splits_bound is merger_skew is None
                                 else MgpuDecodeConfig(block_kv=block_kv, transposed=transposed, kernel_merge=merge,
                                                       splits=splits_bound, merger_skew=merger_skew),
                                 launch_mode="gpu",
                                 draft_mask=draft_mask, kv_scales=kv_scales)
        if merge:  # the kernel's result (no Triton stage)
            return mla_run_decode(decode_call)
        return mla_decode_partials(decode_call)[:3]

    exported = jax.export.export(jax.jit(call), platforms=["cuda"])(*args)
    if "mosaic_gpu" not in exported.mlir_module():
        raise AssertionError("no Mosaic GPU custom call in the lowered module")
    main = exported.mlir_module().split("func.func public @main", 1)[1].split("\n  }", 1)[0]
    if tokens > 1 and f"tensor<{batch * tokens * q_heads}x1xi32>" in main:
        # A verify step's draft words per (token, head) row are an XLA kernel of their own before the Mosaic GPU one
        # on every call: the kernel computes causal drafts and reads a tree's words per (sequence, token).
        raise AssertionError("the call builds per-row draft words")
    # A GMEM semaphore is zeroed by XLA before the kernel (a broadcast of an i32 0 in the module's main); a cluster's
    # barrier needs nothing before the kernel.
    zeroed = re.search(r"broadcast_in_dim %\w+, dims = \[\] : \(tensor<i32>\) -> tensor<\d+xi32>", main) is not None
    if waits_on is not None and zeroed != (waits_on == "semaphore"):
        raise AssertionError(f"the merge should wait on a {waits_on}, but XLA {'does' if zeroed else 'does not'} zero "
                             "a semaphore buffer before the kernel")


def lower_gqa_decode(batch, q_heads, dtype, features, *, slots, capacity):
    S = jax.ShapeDtypeStruct
    features = dict(features)
    kv_heads, dim = features.pop("kv_heads"), features.pop("dim", 128)
    pool = features.pop("pool", dtype)
    window = features.pop("sliding_window", -1)
    args = (S((batch, q_heads, dim), dtype), S((slots, kv_heads, dim), pool), S((slots, kv_heads, dim), pool),
            S((batch + 1,), jnp.int32), S((capacity,), features.pop("index_dtype", jnp.int32)), S((batch,), jnp.int32),
            S((2, kv_heads), jnp.float32) if pool != dtype else None)

    def call(q, k_pool, v_pool, kv_indptr, kv_indices, splits, kv_scales):
        meta = DecodeMetadata(kv_indptr, kv_indices, splits, splits, max_kv_splits=4, kv_capacity=capacity,
                              sliding_window=window)
        decode_call = DecodeCall(q=q, k_pool=k_pool, v_pool=v_pool, meta=meta, sinks=None, sm_scale=0.07, logit_cap=0.0,
                                 xai_temperature_len=-1, sliding_window=window, v_head_dim=dim, return_lse=False,
                                 config=MgpuDecodeConfig(stages=features.pop("stages", None), splits=features.pop("splits", None),
                                                         persistent=features.pop("persistent", None)),
                                 launch_mode="gpu",
                                 kv_scales=kv_scales)
        if kernel_split_bound(decode_call) == 1:  # the kernel writes the result (stage 2 is Triton: not lowered here)
            return gqa_decode_run(decode_call)
        return gqa_decode_partials(decode_call)[:3]

    exported = jax.export.export(jax.jit(call), platforms=["cuda"])(*args)
    if "mosaic_gpu" not in exported.mlir_module():
        raise AssertionError("no Mosaic GPU custom call in the lowered module")


def lower_mla_extend(tokens, q_heads, dtype, features, *, slots, capacity, batch=3):
    S = jax.ShapeDtypeStruct
    index_dtype = features.get("index_dtype", jnp.int32)
    idx = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
    meta = jax.eval_shape(lambda: extend_metadata(idx(4, 600), idx(batch), idx(batch), idx(batch),
                                                  max_extend_len=features.get("max_extend_len", 128), kv_capacity=capacity))
    meta = jax.tree.map(lambda x: S(x.shape, index_dtype) if x.dtype == jnp.int32 and x.shape == (capacity,) else x, meta)
    dim = features.get("dim", 576)
    args = (S((tokens, q_heads, dim), dtype), S((tokens, 1, dim), dtype), S((slots, 1, dim), dtype), meta,
            S((q_heads,), jnp.float32) if features.get("sinks") else None)

    run = LATENT.run if features.get("latent_gqa") else run_extend

    def call(q, k_new, k_pool, meta, sinks):
        return run(MlaExtendCall(q=q, k_new=k_new, k_pool=k_pool, meta=meta, v_head_dim={576: 512, 288: 256}[dim],
                                 sinks=sinks, sm_scale=0.07, launch_mode="gpu"))

    exported = jax.export.export(jax.jit(call), platforms=["cuda"])(*args)
    if "mosaic_gpu" not in exported.mlir_module():
        raise AssertionError("no Mosaic GPU custom call in the lowered module")


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    failed = 0
    core = "--core" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--core"]
    only = args[0] if args else ""  # a substring of the labels to lower (default: every shape)
    part = args[1] if len(args) > 1 else "0/1"  # "i/n": every n-th shape from the i-th (tests split the work)
    index, parts = map(int, part.split("/"))
    shapes = SHAPES + [(label, "decode", *rest) for label, *rest in DECODE_SHAPES]
    if core:
        shapes = [shape for shape in shapes if shape[0] in CORE]
    for label, *shape in shapes[index::parts]:
        if only not in label:
            continue
        try:
            if shape[0] == "decode":
                lower_decode(*shape[1:])
            else:
                lower(*shape)
            print(f"ok {label}", flush=True)
        except Exception as error:  # report every shape, then fail
            failed += 1
            print(f"FAIL {label}: {type(error).__name__}: {str(error)[:2000]}", flush=True)
    sys.exit(1 if failed else 0)
