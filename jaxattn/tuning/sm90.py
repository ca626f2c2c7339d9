"""Tuned tables for sm_90 (H100/H200), every entry timed on the H200 (records in benchmarks/results/).

Keys (normalised by `jaxattn.tuning`'s lookups):
  * DECODE: (qk_head_dim, v_head_dim, group bucket); the bucket is "g1" for MHA (falls back to "g16" when missing),
    "g16" for q_heads / kv_heads <= 16, else "g>16". DECODE_FP8: the same keys, for fp8 pools (falls back to DECODE).
  * EXTEND: the head-dim family: "64", "128", "256" (plain heads, the larger head dim rounded up to a power of 2, at
    least 64) and "576/512", "288/256", "192/128" (qk/v head dims with a rope part in a second dot). Configs are for
    16-bit inputs; fp32 and custom masks adapt them (`jaxattn.tuning.extend_config`).
  * EXTEND_MGPU: the head-dim family, as EXTEND ("64", "128", "192/128", "256"); EXTEND_MGPU_SHORT_WINDOW: the same
    keys, the tile for short windows over short extends (where measured).
"""

from __future__ import annotations

from jaxattn.tuning.configs import DecodeConfig, ExtendConfig, MgpuExtendConfig

# The Triton release these tables were timed with (the H200 image's): register counts, and so occupancy, are a property
# of its code generation; another release compiles the same kernels differently (3.9 puts the 64 family at 144).
TIMED_TRITON = "3.6"

# Bandwidth-bound decode: pipelined gathered loads matter most. 128/128 and 576/512 (g16) were picked from the sweep
# of 2026-12-02 on the H200: the best all-rounder over D1-D3, and the best MLA config.
DECODE: dict[tuple[int, int, str], DecodeConfig] = {
    (64, 64, "g16"): DecodeConfig(block_n=64, block_h=16, num_warps=4, num_stages=3),
    (128, 128, "g16"): DecodeConfig(block_n=128, block_h=16, num_warps=4, num_stages=3),
    # MHA: from the H200 sweep of the "MHA" case (2026-12-02, 7dd44a3): 96% of the floor, where the vector kernel's
    # best tile (n64 w2) reached 93.5% and 128-key tiles 94%.
    (128, 128, "g1"): DecodeConfig(block_n=32, block_h=16, num_warps=4, num_stages=3),
    (256, 256, "g16"): DecodeConfig(block_n=32, block_h=16, num_warps=4, num_stages=3),
    (192, 128, "g16"): DecodeConfig(block_n=32, block_h=16, num_warps=4, num_stages=2),  # block_n 64 spills
    (288, 256, "g16"): DecodeConfig(block_n=32, block_h=16, num_warps=4, num_stages=3),
    (576, 512, "g16"): DecodeConfig(block_n=32, block_h=16, num_warps=4, num_stages=2),
    # Many q heads per kv head (MLA without TP, big MQA): fewer head blocks, fewer K re-reads.
    (64, 64, "g>16"): DecodeConfig(block_n=64, block_h=32, num_warps=4, num_stages=3),
    (128, 128, "g>16"): DecodeConfig(block_n=64, block_h=32, num_warps=4, num_stages=3),
    (256, 256, "g>16"): DecodeConfig(block_n=32, block_h=32, num_warps=8, num_stages=3),
    (192, 128, "g>16"): DecodeConfig(block_n=64, block_h=32, num_warps=8, num_stages=2),
    (288, 256, "g>16"): DecodeConfig(block_n=32, block_h=32, num_warps=8, num_stages=3),
    # MLA rows past 16 (more heads, or 16 heads x several query tokens): one 64-row wgmma tile per kv head (2
    # warpgroups) instead of 32-row mma.sync tiles. At MLA-V4 (16 heads x 4 tokens, 94212e2): 0.378 ms against 0.606.
    (576, 512, "g>16"): DecodeConfig(block_n=32, block_h=64, num_warps=8, num_stages=3),
}

# fp8 pools (e4m3fn / e5m2), keys as DECODE's; a key missing here takes DECODE's entry. Rows are half as wide, and the
# f16 dots (kernels/decode_attention.py) want fewer warps: at D1-FP8 (H200, 2026-12-03, 11e9d5a, records in
# benchmarks/results/) 64-key tiles with 2 warps and 6 stages ran 0.176 ms against DECODE's 128/4/3 at 0.222 ms, and
# 4 or 8 warps at any tile stayed at 0.207-0.39 ms (the bench's sweep at f6b987e: 0.174 ms again). MLA-FP8 (576/512,
# V inside K), the same sweep: 64 keys, 4 warps, 2 stages 0.159 ms against DECODE's 32/4/2 at 0.173 ms (still slower
# than the bf16 latent cache's 0.138 ms: the compiled kernel reads the fp8 V operand from shared memory byte by byte).
DECODE_FP8: dict[tuple[int, int, str], DecodeConfig] = {
    (128, 128, "g16"): DecodeConfig(block_n=64, block_h=16, num_warps=2, num_stages=6),
    (576, 512, "g16"): DecodeConfig(block_n=64, block_h=16, num_warps=4, num_stages=2),
}

# Stage-1 programs one multiprocessor holds of DECODE_FP8's GQA tile as TIMED_TRITON compiles it
# (`hardware.resident_blocks` of its registers, shared memory and warps; tests/test_aot_compile.py checks it): 244
# registers x 2 warps since its key loads are unmasked (205 before, 255 before stage 1 stored final rows; 200 or fewer
# would hold 5, which a 200-register cap showed no faster, RESULTS thirty-eighth session), 39 KB. Not listed: 576/512,
# whose fp8 latent calls the Mosaic GPU MLA kernel takes (its own split counts).
DECODE_FP8_RESIDENT_PER_SM: dict[tuple[int, int, str], int] = {
    (128, 128, "g16"): 4,
}

# TritonBackend(kv_dtype=<fp8>) and the bench's jaxattn row size fp8 decode splits by whole waves of those programs
# (`jaxattn.metadata.SplitWaves` through `tuning.default_decode_split_waves`) instead of the fill heuristic. H100,
# afec991 (benchmarks/RESULTS.md, fortieth session), fp8 D1 / D2 / D3: the fill heuristic's 3 / 17 / 1 splits 0.226 /
# 0.256 / 0.227 ms; the wave rule's 1 / 8 / 1 split counts, timed as fixed counts in the same run, 0.217 / 0.216 /
# 0.228; as the default at 089bb79 (forty-first session) 0.217 / 0.215 / 0.226. Not yet timed on an H200.
DECODE_FP8_SPLIT_WAVES = True

# Two-stage kernel, bf16, each candidate checked against the reference first. "128" on E1/E3 (sweep of 2026-12-02):
# 128x128 tiles with 3 stages, 2.56 ms on E1 against 5.24 ms for 128x32/2. The others on the tuning cases
# T64/T256/T192/T576/T288 of jaxattn.bench (benchmarks/experiments/extend_tuning.py,
# results/2026-12-03_h200_extend_tuning_round{1,2}.json), against the earlier CPU-chosen guesses (ms, guess -> now):
# 64: 1.91 -> 1.27; 192/128: 2.67 -> 1.87; 256: 7.02 -> 2.82; 288/256: 2.35 -> 1.10; 576/512: 8.67 -> 4.06.
# What the sweep showed: 64-row q-blocks want 4 warps (one warpgroup; with 8 the row softmax is split across two
# warpgroups and runs 1.5-2.5x slower), except 576/512, whose 64x32 tiles need 8 warps to hold the 512-wide
# accumulator (it spills a little and still beats 32-row tiles without wgmma by 2.1x); 128-row blocks want 8.
# A third/fourth stage only helps where shared memory is left over (64-dim heads, 192/128).
EXTEND: dict[str, ExtendConfig] = {
    "64": ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    "128": ExtendConfig(block_m=128, block_n=128, num_warps=8, num_stages=3),
    "256": ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),
    "192/128": ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    "288/256": ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),
    "576/512": ExtendConfig(block_m=64, block_n=32, num_warps=8, num_stages=2),
}

# Measured on the H200 (E1-E3): 64 x 128 with 2 stages beats 64 x 64 with 3-4 stages by 9-27%
# (results/2026-12-03_h200_mgpu_extend_first.log). Head dim 64: three consumer warpgroups (192 q rows per CTA, as
# FlashAttention-3 tiles 64-dim heads), H100, 5 rounds each: 0.971x two at T64 (f890269), 0.946x (6fd99af); with FA3's
# intra-warpgroup overlap 1.58x slower (ptxas: 128 registers a thread, 292-612 bytes spilled). Extends of at most
# block_q new tokens keep two (`jaxattn.tuning.mgpu_extend_config`: they pack two heads per CTA instead).
# 192/128: 128-key tiles would need 240 KB of shared memory at 2 stages; 64-key tiles with 2 stages (not yet tuned).
EXTEND_MGPU: dict[str, MgpuExtendConfig] = {
    "64": MgpuExtendConfig(block_q=64, block_kv=128, stages=2, consumers=3),
    "128": MgpuExtendConfig(block_q=64, block_kv=128, stages=2),
    "192/128": MgpuExtendConfig(block_q=64, block_kv=64, stages=2),
    # The only tile that fits at 256: Q 64 KB + the 2-stage 64-key ring 128 KB + 16 KB of O chunk buffers.
    "256": MgpuExtendConfig(block_q=64, block_kv=64, stages=2),
}

# MLA's half-size latent cache (288/256, V inside K) on the same kernel (`jaxattn.impl.mgpu_extend.LATENT`): Q 80 KB
# (rows padded to 320 columns) + a 3-stage ring of 64-key K tiles 120 KB + 16 KB of O chunk buffers = 220 KB. A latent
# slot holds V too, so it is released after both consumers' P V (a K slot otherwise after Q K^T): with 2 stages the
# producer could refill a slot only about half a step before the leading consumer needs it. Tiles by analogy with
# 256 (the same accumulator and S tile); not yet timed.
EXTEND_MGPU_LATENT: dict[str, MgpuExtendConfig] = {
    "288/256": MgpuExtendConfig(block_q=64, block_kv=64, stages=3),
}

# Short windows over short extends (a verify step on a sliding-window layer, GPT-OSS's window of 128): a CTA's rows
# see about W + 64 keys, where 64-key tiles compute fewer masked columns than 128-key ones. Family: (the largest
# window W, the tile for max_extend_len <= block_q). V-TREE64-W128 (32 x (4096 + 64 drafts), window 128) on the
# H200 (8061b2b, one run): 0.071 ms at kv64 s2 against 0.085 at the table's kv128 s2 (FlashInfer fa2 0.074 ms); without
# the window (V-TREE64) kv128 stays ahead (0.331 vs 0.363 ms). Two-stage calls only: the unified (deterministic) form
# keeps the table's tile, whose choice must not depend on the extend bucket (`jaxattn.impl.mgpu_extend._call_config`).
EXTEND_MGPU_SHORT_WINDOW: dict[str, tuple[int, MgpuExtendConfig]] = {
    "128": (128, MgpuExtendConfig(block_q=64, block_kv=64, stages=2)),
}

# Lists of whole pages (`ExtendMetadata.page_size`): prefix tiles copied page by page by TMA, one copy of
# min(page size, block_kv) rows each, where those copies are at least this tall; smaller pages go row by row
# (cp.async: each TMA copy costs the producer a warpgroup barrier and an arrival, so many short ones fall behind).
# `benchmarks/experiments/page_copies.py` on the H200, two-stage / unified, page copies against row copies of the
# same lists, ms: P = 128 (a5d6eb4) E1 1.645 vs 1.704 / 1.729 vs 1.706, E3 0.564 vs 0.646 / 0.588 vs 0.616; P = 64
# (e00a45c) E1 1.616 vs 1.725 / 1.675 vs 1.691, E3 0.585 vs 0.651 / 0.590 vs 0.608; P = 16 (e00a45c) E1 1.717 vs
# 1.686 / 1.831 vs 1.695, E3 0.631 vs 0.621 / 0.670 vs 0.604; P = 8 1.4-1.7x slower. One run each. P = 32 is not
# measured: the a5d6eb4 run's P = 32 rows compared row copies with row copies (this rule took rows there), 1-3% apart,
# which is that run's spread between identical variants.
EXTEND_MGPU_PAGE_COPY_MIN_ROWS = 64

# fp8 pools under impl="mgpu" (two-stage form): the kernel converts the prefix tiles itself (`impl="mgpu-fp8"`) where
# at most this many CTAs read each prefix tile, else the listed prefix is gathered and dequantised once first. Every
# CTA reading a prefix tile converts it: (q heads a kv head / heads a CTA) x ceil(extend bucket / a head's rows a CTA)
# times (`jaxattn.impl.mgpu_extend.prefix_tile_readers`), while dequantising converts each listed row once at the
# price of its round trip (fp8 read, 16-bit written and read again). 0: always dequantise. H100, 32/8 heads x 128 (4
# readers per 128 new tokens), 4096 cached tokens a sequence, 4096 new in all (`experiments/fp8_extend_route.py`,
# 0281adf, one run), kernel / dequantised, ms: 128 new tokens a sequence (4 readers) 0.783 / 0.865, 256 (8) 0.779 /
# 0.716, 512 (16) 0.777 / 0.646, 1024 (32) 0.789 / 0.641 (bf16 0.60-0.63); E3-FP8 (4) 0.789 / 0.870 in the same call,
# 0.78 / 0.85 at 35d899e. Other group sizes and head dims are not measured: the bound is on the conversions' count.
EXTEND_MGPU_FP8_IN_KERNEL_MAX_READERS = 4

# MLA decode (576/512, one query token, 16 or 32 heads) on the MLA kernel's transposed tile (keys as wgmma's M, heads
# as N: `MgpuDecodeConfig.transposed`, None takes this) rather than the padded 64-row tile. H100, ms (% of the floor):
# MLA 0.118-0.121 (83.1-85.0%) against 0.122-0.124 (81.5-82.7%) in four runs (179e77b, 35d899e, b65a744, 0281adf);
# MLA-L 0.416 (96.9%) against 0.421 (95.7%, 0281adf). 16-bit caches only: see MLA_DECODE_TRANSPOSED_FP8.
MLA_DECODE_TRANSPOSED = True

# The same choice over fp8 latent caches: the transposed tile, which also makes "mgpu" (the default) take one-token
# fp8 MLA decode at 16 or 32 heads. Its one producer warpgroup converts every tile for its one consumer: at 40
# registers it spilled and ran slower than the padded tile (H100, 37975d2: MLA-FP8 0.269 ms against 0.254); keeping
# 224 (`TRANSPOSED_REGISTERS`), H100 (3fba716, one run, 3 rounds, 2.1% apart): 0.106 ms (47.6% of the fp8 floor)
# against the padded tile's 0.249, the Triton kernel's 0.195 and the bf16 cache's 0.111.
MLA_DECODE_TRANSPOSED_FP8 = True

# The fp8 latent calls the transposed tile does not take (verify steps, 64+ heads) on the MLA kernel's padded tile
# under "mgpu" rather than on the Triton kernel (it also takes them by name, "mgpu-fp8"). Since its producer computes
# the fp8 copies' addresses per tile (`FP8_ADDRESSES_PER_TILE`, 11335e2) it is the faster: H200 (a56875d, one run, 3
# rounds), ms, padded tile / Triton: MLA-V4-FP8 (4 tokens verified) 0.154 / 0.504, MLA-FP8 0.142 / 0.196; H100
# (3fba716) MLA-FP8 0.144 / 0.195. 64+ heads over fp8 are not measured (the same tile per 64-row head block).
MLA_DECODE_PADDED_FP8 = True

# The MLA kernel merging a sequence's splits itself (`MgpuDecodeConfig.kernel_merge`, None takes this), on either tile:
# its last non-empty split folds the others' partials, passed in their registers' order, after a cluster barrier (2-8
# splits, e0c9269 / e0cee0d) or a semaphore; no Triton merge launched. H100, ms, kernel / Triton merge: the transposed
# tile (one run at b1bff0f) MLA 0.115 / 0.118 at its own 2 splits (FlashInfer MLA 0.114 in the same run), 0.118 / 0.125
# at one split, 0.123 / 0.127 at 4; MLA-L (one split) 0.408 / 0.417; the padded tile (c725d0f) MLA-V4 0.142 / 0.149. A
# first form passing the partials element by element lost at 2 and 4 splits (38c8f29). Over fp8 latent pools
# (`impl="mgpu-fp8"`, by name) the kernel merge measured 0.261 / 0.252 ms (c725d0f, spreads 10-22%) and 0.257 / 0.251
# (fe6f0e3). H200 (fe6f0e3, one run): the transposed tile MLA 0.0863 / 0.0882, MLA-L 0.2861 / 0.2937.
MLA_DECODE_KERNEL_MERGE = True

# Keys the MLA kernel's merging split takes over from the split before it (`MgpuDecodeConfig.merger_skew`, None takes
# this), so that split publishes its partial (stores, a GPU-scope fence, the cluster barrier: about 1.5 us by a reading
# of the transposed tile) while the merger streams its extra tile. H100 (236f758, 7 rounds): skew 64 / 128 tie the
# even splits at MLA and MLA-V4 (0.117 / 0.136 ms each): 0 (off).
MLA_DECODE_MERGER_SKEW = 0

TABLES = {"decode": DECODE, "decode_fp8": DECODE_FP8, "decode_fp8_resident_per_sm": DECODE_FP8_RESIDENT_PER_SM,
          "extend": EXTEND, "extend_mgpu": EXTEND_MGPU,
          "extend_mgpu_short_window": EXTEND_MGPU_SHORT_WINDOW, "extend_mgpu_latent": EXTEND_MGPU_LATENT}
