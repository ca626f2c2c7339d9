"""TritonBackend: SGLang's TritonAttnBackend as pure functions over pytrees, on jaxattn's Triton kernels.

    backend = TritonBackend(sliding_windows=(4096,))                  # windows known statically
    meta = backend.init_forward_metadata(batch, req_to_token)         # inside jit, no host sync
    meta = backend.init_forward_metadata(batch, page_table)           # or pages: a jaxattn.paging.PageTable
    o, k_pool, v_pool = backend.forward(q, k, v, k_pool, v_pool, layer, meta, sinks=...)

`init_forward_metadata` builds, once per step and for every layer, the index lists each mode needs
(SGLang's `init_forward_metadata`, inventory §4.3):

  ===================  =======================================================================================
  DECODE               `DecodeMetadata` over each sequence's keys (its new token included, already written);
                       one more per prepared window W (the last W + 1 keys), and one over the encoder's tokens
                       when the batch has `encoder_lens`.
  EXTEND, DRAFT_EXTEND `ExtendMetadata` (two-stage kernel): the cached prefix from the pool, the new tokens from
                       the step's contiguous k/v, causal. Per window W: the last W prefix keys. DRAFT_EXTEND is the
                       same causal extend over the accepted tokens (prefix = seq_len - extend_len), so each new
                       token is visited once: SGLang's DRAFT_EXTEND lists seq_lens keys as the "prefix" and then
                       attends the new tokens again (inventory §4.3 "Open question"); jaxattn does not copy that.
  TARGET_VERIFY        The EXTEND lists (prefix = seq_len - draft) plus the tree mask, rows [draft, seq_len] per
                       sequence (`batch.custom_mask`, `batch.mask_indptr`). Like SGLang, the prefix columns are not
                       read (`skip_prefix_custom_mask`): every draft sees the whole verified prefix. With the tree
                       as bit masks (`batch.draft_mask`, D drafts per sequence) full attention layers run the
                       several-token decode kernel over `verify_decode` (each sequence's keys, drafts last): K/V
                       read once for all D drafts and no [D, seq_len] mask; window and xai-temperature layers
                       take the extend lists with the bits as per-row draft words (`extend_attention(draft_mask=)`;
                       deterministic: expanded to the boolean mask, which the unified kernel reads).
  deterministic        Extend-like modes use `ExtendUnifiedMetadata` (prefix slots then out_cache_loc, one key
                       loop in absolute order: bitwise identical whatever the prefix/new split); decode splits are
                       ceil(len / split_tile_size), a function of the sequence's own length only.
  IDLE                 Nothing; `forward` returns zeros.
  ===================  =======================================================================================

Cross attention (`batch.encoder_lens`): a sequence's encoder tokens sit first in its req_to_token row and its
decoder tokens after them. Self layers list decoder tokens only (positions count from the first decoder token);
cross layers (`layer.is_cross_attention`) attend the encoder's tokens, non-causally, through the unified kernel
(extend-like modes) or the decode kernel.

Pages: `init_forward_metadata` takes a `jaxattn.paging.PageTable` (req_to_page with static page_size and
num_slots; `RequestTable.page_table()`) wherever it takes req_to_token, and builds the same metadata with the
`*_from_pages` builders (self and cross attention, windows, every mode); `forward` is unchanged (the kernels read
by slot; on Hopper the extend kernel copies whole pages as blocks where the lists keep them, `ExtendMetadata.page_size`);
`draft_decode_metadata` takes a PageTable too (its lists gathered from the pages).

Which window sizes get their own (shorter) lists is static: `TritonBackend(sliding_windows=(W, ...))`, plus the
windows of `layers` when they are passed to `init_forward_metadata`. A window layer whose W was not prepared is
still exact: it runs on the full lists and the kernels mask keys outside the window (more keys visited). In
deterministic mode on Hopper a window layer's extend-like step runs on the full unified lists with the window as the
op's argument wherever the Mosaic GPU kernel takes that call (`jaxattn.extend_mgpu.unified_window_on_full_lists`: it
starts at the tile the window reaches); its window-cut lists would run the unified Triton kernel (the tiles' fixed
offsets move with a cut list's start), 2.2-2.8x slower at E1 with a 1024 window.

Speculative draft decoding: `draft_decode_metadata` builds the decode lists of every draft step at once (SGLang's
generate_draft_decode_kv_indices); `TritonBackend.draft_step_metadata` turns step i into a forward metadata.

fp8 KV pools (e4m3fn / e5m2) go to the kernels as they are, with the layer's k_scale / v_scale (`jaxattn.fp8`): the
kernels read fp8 rows and apply the scales, so a step's work does not grow with the pool. As in SGLang, the two-stage
extend reads the new tokens' K/V from the step's k/v (not their fp8 copy in the pool), so with fp8 pools it differs
from ReferenceBackend by the quantisation error of the new tokens; decode and the deterministic path read the pool only.

Latent (MLA) pools: pass v_pool=None (and v=None): V is the first `layer.v_head_dim` dims of each K row, as in
DeepSeek's latent cache, so only K is written. Decode and decode-route verify read the latent rows once (on sm_90 the
MLA Mosaic GPU kernel); plain causal two-stage extend runs `jaxattn.mla.mla_extend_attention` (the same kernel's
extend form on sm_90); other extend-like calls (masks, windows, soft caps, the deterministic unified path) run the
extend ops on V sliced from the pool, a copy of its first v_head_dim dims per call.

Limits: TARGET_VERIFY on a window layer windows over the *listed* order (prefix, then the drafts in list order),
exactly like ReferenceBackend, not over tree depth; SGLang has the same limit.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxattn.backends.layer import AttentionLayer, is_latent_pool, split_heads
from jaxattn.checks import INDEX_DTYPES, check_array, check_positive_int, index_i32, launch_mode_argument
from jaxattn.decode import decode_attention
from jaxattn.extend import extend_attention, extend_attention_unified
from jaxattn.extend_mgpu import unified_window_on_full_lists
from jaxattn.fp8 import dequantised_rows, is_fp8
from jaxattn.kv_indices import build_unified_kv_indices, create_kv_indices
from jaxattn.mla import mla_extend_attention
from jaxattn.metadata import (
    DecodeMetadata,
    ExtendMetadata,
    ExtendUnifiedMetadata,
    cross_attention_metadata,
    decode_metadata,
    decode_metadata_from_indptr,
    extend_metadata,
    extend_unified_metadata,
    listed_columns_mask,
)
from jaxattn.paging import (
    PageTable,
    create_kv_indices_from_pages,
    cross_attention_metadata_from_pages,
    decode_metadata_from_pages,
    extend_metadata_from_pages,
    extend_unified_metadata_from_pages,
    token_slots,
)
from jaxattn.serving.batch import ForwardBatch, ForwardMode
from jaxattn.serving.kv_pool import write_kv
from jaxattn.tuning import default_decode_split_waves


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TritonMetadata:
    """One step's metadata for every layer (a pytree; `mode`, `windows` and `deterministic` are static).

    `attn` serves full self-attention layers, `window_attn[i]` layers with sliding window `windows[i]`,
    `cross_attn` cross-attention layers. Their type follows the mode: `DecodeMetadata` (DECODE),
    `ExtendMetadata` (extend-like), `ExtendUnifiedMetadata` (extend-like, deterministic; cross layers always).
    """

    out_cache_loc: jax.Array  # i32[T]: where forward writes the step's new K/V
    attn: DecodeMetadata | ExtendMetadata | ExtendUnifiedMetadata | None
    window_attn: tuple  # one metadata per entry of `windows`
    cross_attn: DecodeMetadata | ExtendUnifiedMetadata | None
    custom_mask: jax.Array | None  # TARGET_VERIFY: flat bool, laid out for `attn`
    window_custom_masks: tuple  # TARGET_VERIFY: one per window (deterministic lists need the mask re-cut)
    mode: ForwardMode = dataclasses.field(metadata=dict(static=True))
    windows: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    deterministic: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # TARGET_VERIFY with `batch.draft_mask` (i32[B, D]): decode lists over each sequence's keys, for full layers.
    verify_decode: DecodeMetadata | None = None
    draft_mask: jax.Array | None = None
    # ... and for two-stage window / xai layers the same tree as per-row draft words (`ForwardBatch.verify_draft_words`,
    # i32[B * D, 1]): extend_attention(draft_mask=) reads no [D, seq_len] mask.
    draft_words: jax.Array | None = None

    def takes_verify_decode(self, layer: AttentionLayer) -> bool:
        """Whether `layer` runs this verify step on the several-token decode kernel (see the module doc)."""
        return (self.verify_decode is not None and not layer.is_cross_attention and layer.sliding_window < 0
                and layer.xai_temperature_len <= 0)

    def for_layer(self, layer: AttentionLayer):
        """(metadata, custom_mask) serving `layer`."""
        if layer.is_cross_attention:
            if self.cross_attn is None:
                raise ValueError(f"layer {layer.layer_id} is cross attention but the batch has no encoder_lens")
            return self.cross_attn, None
        if layer.sliding_window >= 0 and layer.sliding_window in self.windows:
            i = self.windows.index(layer.sliding_window)
            return self.window_attn[i], self.window_custom_masks[i]
        return self.attn, self.custom_mask


def _check_windows(windows) -> tuple:
    windows = tuple(windows)
    for w in windows:
        if not isinstance(w, int) or w < 0:
            raise ValueError(f"sliding_windows must hold ints >= 0 (W: each query sees itself and W previous keys); got {w!r}")
    return tuple(sorted(set(windows)))


class TritonBackend:
    """SGLang's Triton attention backend (decode split-KV, two-stage or unified extend, tree verify, windows, cross).

    Args:
      deterministic: batch-invariant results: unified extend kernel, decode splits by length only.
      max_kv_splits: static bound on decode KV splits (default: `decode.default_max_kv_splits` for the bucket).
      sliding_windows: window sizes W that get their own trimmed lists (see the module doc).
      q_heads, kv_heads: head counts the decode split heuristic sizes its grid with (only performance; default
        taken from `layers` in `init_forward_metadata`, else 1 and 1).
      split_tile_size: keys per decode split in deterministic mode (SGLang's 256).
      launch_mode: "gpu", "interpret" or None (automatic), passed to every kernel.
      kv_dtype: the KV pools' dtype (only performance; default 16-bit). With fp8 pools and
        `tuning.sm90.DECODE_FP8_SPLIT_WAVES` on, decode split counts follow whole waves of the fp8 tile's resident
        programs (`jaxattn.metadata.SplitWaves`, sized from the first of `layers`).
    """

    name = "triton"

    def __init__(self, deterministic: bool = False, max_kv_splits: int | None = None, sliding_windows=(), *,
                 q_heads: int | None = None, kv_heads: int | None = None, split_tile_size: int = 256,
                 launch_mode: str | None = None, kv_dtype=None):
        if max_kv_splits is not None:
            check_positive_int("max_kv_splits", max_kv_splits)
        check_positive_int("split_tile_size", split_tile_size)
        if (q_heads is None) != (kv_heads is None):
            raise ValueError(f"q_heads and kv_heads must be given together; got q_heads={q_heads!r}, kv_heads={kv_heads!r}")
        if q_heads is not None:
            check_positive_int("q_heads", q_heads)
            check_positive_int("kv_heads", kv_heads)
        self.deterministic = bool(deterministic)
        self.max_kv_splits = max_kv_splits
        self.sliding_windows = _check_windows(sliding_windows)
        self.q_heads, self.kv_heads = q_heads, kv_heads
        self.split_tile_size = split_tile_size
        self.launch_mode = launch_mode
        if kv_dtype is not None:
            try:
                kv_dtype = jnp.dtype(kv_dtype)
            except TypeError:
                raise ValueError(f"kv_dtype must be None or a dtype (the KV pools'); got {kv_dtype!r}") from None
        self.fp8_pools = kv_dtype is not None and is_fp8(kv_dtype)

    # -----------------------------------------------------------------------------------------
    # Metadata

    def _heads(self, layers):
        if self.q_heads is not None:
            return self.q_heads, self.kv_heads
        for layer in layers or ():
            return layer.q_heads, layer.kv_heads
        return 1, 1

    def _split_waves(self, layers, heads):
        """The decode lists' `SplitWaves` (`tuning.default_decode_split_waves`; `layers` give the head dims)."""
        if not layers or self.deterministic:
            return None
        return default_decode_split_waves(layers[0].head_dim, layers[0].dv, heads[0], heads[1], self.fp8_pools)

    def _decode_lists(self, batch, req_to_token, seq_lens, token_offsets, *, capacity, max_len, window, heads,
                      split_waves=None):
        """DecodeMetadata over each sequence's last keys (all of them, or a window's) from its token_offsets column."""
        kwargs = dict(
            kv_capacity=capacity, q_heads=heads[0], kv_heads=heads[1], max_kv_splits=self.max_kv_splits,
            deterministic=self.deterministic, split_tile_size=self.split_tile_size, sliding_window=window,
            token_offsets=token_offsets, max_context_len=max_len, launch_mode=self.launch_mode,
            split_waves=split_waves,
        )
        if isinstance(req_to_token, PageTable):
            return decode_metadata_from_pages(req_to_token.req_to_page, batch.req_pool_indices, seq_lens,
                                              **req_to_token.builder_args(), **kwargs)
        return decode_metadata(req_to_token, batch.req_pool_indices, seq_lens, **kwargs)

    def _extend_lists(self, batch, req_to_token, token_offsets, *, window, capacity):
        """ExtendMetadata (two-stage) or ExtendUnifiedMetadata (deterministic) of the batch's self attention."""
        sizes = dict(max_extend_len=batch.max_extend_len, kv_capacity=capacity, sliding_window=window,
                     token_offsets=token_offsets, launch_mode=self.launch_mode)
        if isinstance(req_to_token, PageTable):
            table, plain, unified = req_to_token.req_to_page, extend_metadata_from_pages, extend_unified_metadata_from_pages
            sizes.update(req_to_token.builder_args())
        else:
            table, plain, unified = req_to_token, extend_metadata, extend_unified_metadata
        if not self.deterministic:
            return plain(table, batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, **sizes)
        return unified(table, batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, batch.out_cache_loc, **sizes)

    def init_forward_metadata(self, batch: ForwardBatch, req_to_token: "jax.Array | PageTable", layers=None) -> TritonMetadata:
        """Builds the step's `TritonMetadata` on device (jit-friendly, no host sync).

        Args:
          batch: the step's `ForwardBatch` (B sequences, T token rows).
          req_to_token: i32[max_reqs, max_context_len]: pool slot of every token of every request row; or a
            `jaxattn.paging.PageTable` (pages of every request row, with static page_size and num_slots): the
            same metadata through the `*_from_pages` builders.
          layers: optional `AttentionLayer`s of the model: their sliding windows get trimmed lists too and the
            first one's head counts size the decode split heuristic.
        """
        if not isinstance(req_to_token, PageTable):
            check_array("req_to_token", req_to_token, ndim=2, dtypes=INDEX_DTYPES, what="[max_reqs, max_context_len]")
        windows = self.sliding_windows
        if layers:
            windows = _check_windows(windows + tuple(l.sliding_window for l in layers if l.sliding_window >= 0 and not l.is_cross_attention))
        heads = self._heads(layers)
        mode = batch.mode
        common = dict(out_cache_loc=batch.out_cache_loc, mode=mode, windows=windows, deterministic=self.deterministic)
        if mode == ForwardMode.IDLE:
            return TritonMetadata(attn=None, window_attn=(None,) * len(windows), cross_attn=None, custom_mask=None,
                                  window_custom_masks=(None,) * len(windows), **common)
        B = batch.batch_size
        seq_lens = jnp.maximum(index_i32(batch.seq_lens), 0)
        encoder = None if batch.encoder_lens is None else jnp.maximum(index_i32(batch.encoder_lens), 0)
        column0 = jnp.zeros((B,), jnp.int32) if encoder is None else encoder  # first decoder token's column

        if mode == ForwardMode.DECODE:
            waves = self._split_waves(layers, heads)
            attn = self._decode_lists(batch, req_to_token, seq_lens, column0, capacity=batch.kv_capacity,
                                      max_len=batch.max_seq_len, window=-1, heads=heads, split_waves=waves)
            window_attn = tuple(
                self._decode_lists(batch, req_to_token, seq_lens, column0, capacity=min(batch.kv_capacity, B * (w + 1)),
                                   max_len=batch.max_seq_len, window=w, heads=heads, split_waves=waves)
                for w in windows
            )
            cross = None
            if encoder is not None:
                cross = self._decode_lists(batch, req_to_token, encoder, None, capacity=batch.kv_capacity,
                                           max_len=batch.max_seq_len, window=-1, heads=heads, split_waves=waves)
            return TritonMetadata(attn=attn, window_attn=window_attn, cross_attn=cross, custom_mask=None,
                                  window_custom_masks=(None,) * len(windows), **common)

        # Extend-like: EXTEND, DRAFT_EXTEND, TARGET_VERIFY.
        attn = self._extend_lists(batch, req_to_token, column0, window=-1, capacity=batch.kv_capacity)
        window_attn = []
        for w in windows:
            # At most W prefix keys per sequence are listed (plus the new tokens in the unified list).
            bound = B * w + (batch.num_tokens if self.deterministic else 0)
            window_attn.append(self._extend_lists(batch, req_to_token, column0, window=w,
                                                  capacity=max(1, min(batch.kv_capacity, bound))))
        window_attn = tuple(window_attn)
        mask, window_masks, verify_decode, draft_words = None, (None,) * len(windows), None, None
        if mode == ForwardMode.TARGET_VERIFY:
            # rows [extend_len, seq_len]: full width = listed width without a window. From draft bits, the expansion
            # is computed only if a layer reads it (XLA drops it otherwise).
            mask = batch.verify_custom_mask().astype(bool)
            if batch.draft_mask is not None:
                verify_decode = self._decode_lists(batch, req_to_token, seq_lens, column0, capacity=batch.kv_capacity,
                                                   max_len=batch.max_seq_len, window=-1, heads=heads)
                if not self.deterministic:  # the unified kernel takes masks only
                    draft_words = batch.verify_draft_words()
            if self.deterministic:
                extend_lens = jnp.maximum(index_i32(batch.extend_lens), 0)
                window_masks = tuple(
                    listed_columns_mask(mask, batch.mask_indptr, m.prefix_lens, m.kv_start_pos, extend_lens, True)[0]
                    for m in window_attn
                )
            else:
                window_masks = (mask,) * len(windows)  # two-stage metadata keeps full-width mask rows
        cross = None
        if encoder is not None and isinstance(req_to_token, PageTable):
            cross = cross_attention_metadata_from_pages(req_to_token.req_to_page, batch.req_pool_indices, encoder,
                                                        batch.extend_lens, max_extend_len=batch.max_extend_len,
                                                        kv_capacity=batch.kv_capacity, **req_to_token.builder_args())
        elif encoder is not None:
            cross = cross_attention_metadata(req_to_token, batch.req_pool_indices, encoder, batch.extend_lens,
                                             max_extend_len=batch.max_extend_len, kv_capacity=batch.kv_capacity,
                                             launch_mode=self.launch_mode)
        return TritonMetadata(attn=attn, window_attn=window_attn, cross_attn=cross, custom_mask=mask,
                              window_custom_masks=window_masks, verify_decode=verify_decode,
                              draft_mask=batch.draft_mask, draft_words=draft_words, **common)

    def draft_step_metadata(self, draft: "DraftDecodeMetadata", step) -> TritonMetadata:
        """The forward metadata of draft step `step` (an int or a traced int) of `draft_decode_metadata`'s result.

        Window layers run on these full lists with the kernels' window mask; there are no cross layers.
        """
        return TritonMetadata(out_cache_loc=draft.out_cache_loc[step], attn=draft.step(step), window_attn=(),
                              cross_attn=None, custom_mask=None, window_custom_masks=(), mode=ForwardMode.DECODE,
                              windows=(), deterministic=draft.deterministic)

    # -----------------------------------------------------------------------------------------
    # Forward

    def forward(self, q, k, v, k_pool, v_pool, layer: AttentionLayer, meta: TritonMetadata, *, sinks=None, save_kv=True):
        """Writes k/v at `meta.out_cache_loc` (unless save_kv=False or k is None), then attends.

        Args:
          q: [T, q_heads, head_dim] or [T, q_heads * head_dim] (T = B in DECODE). k, v: [T, kv_heads, head_dim /
            v_head_dim] (or flat), or None when the new K/V are already in the pool.
          k_pool, v_pool: this layer's pool [slots, kv_heads, head_dim / v_head_dim]; fp8 pools are read directly
            with the layer's scales (see the module doc). v_pool None (with v None): a latent (MLA) pool, V = the
            first layer.v_head_dim dims of each K row.
          layer: the `AttentionLayer`. meta: this step's `TritonMetadata`. sinks: optional f32[q_heads].

        Returns:
          (o [T, q_heads, v_head_dim] in q's dtype, k_pool, v_pool). Padding tokens and padding rows give 0.
        """
        if not isinstance(meta, TritonMetadata):
            raise ValueError(f"meta must be a TritonMetadata (see TritonBackend.init_forward_metadata); got {type(meta).__name__}")
        layer.check_sinks(sinks)
        q = split_heads(q, layer.q_heads, layer.head_dim, "q")
        latent = is_latent_pool(v_pool, v)  # MLA's latent cache: V is the first layer.dv dims of each K row
        if meta.mode == ForwardMode.IDLE:
            return jnp.zeros((q.shape[0], layer.q_heads, layer.dv), q.dtype), k_pool, v_pool
        if k is not None:
            k = split_heads(k, layer.kv_heads, layer.head_dim, "k")
            v = None if latent else split_heads(v, layer.kv_heads, layer.dv, "v")
        if save_kv and k is not None:
            k_pool, v_pool = write_kv(k_pool, v_pool, meta.out_cache_loc, k, v, k_scale=layer.k_scale, v_scale=layer.v_scale)
        scales = layer.pool_scales(k_pool, v_pool)
        lists, mask = meta.for_layer(layer)
        common = dict(sm_scale=layer.scale, logit_cap=layer.logit_cap, sinks=sinks, launch_mode=self.launch_mode, **scales)
        if not layer.is_cross_attention:
            common["xai_temperature_len"] = layer.xai_temperature_len
        window = -1 if layer.is_cross_attention else layer.sliding_window
        latent_v = dict(v_head_dim=layer.dv) if latent else {}
        if meta.mode == ForwardMode.DECODE:
            return decode_attention(q, k_pool, v_pool, lists, sliding_window=window, **latent_v, **common), k_pool, v_pool
        if meta.mode == ForwardMode.TARGET_VERIFY and meta.takes_verify_decode(layer):
            batch, drafts = meta.draft_mask.shape
            o = decode_attention(q.reshape(batch, drafts, *q.shape[1:]), k_pool, v_pool, meta.verify_decode,
                                 draft_mask=meta.draft_mask, **latent_v, **common)
            return o.reshape(q.shape[0], *o.shape[2:]), k_pool, v_pool
        if k is None and not isinstance(lists, ExtendUnifiedMetadata):
            # The new tokens' K/V are in the pool already: their rows, dequantised.
            k = dequantised_rows(k_pool, meta.out_cache_loc, scales.get("k_scale"), q.dtype)
            if not latent:
                v = dequantised_rows(v_pool, meta.out_cache_loc, scales.get("v_scale"), q.dtype)
        plain_causal = (mask is None and window < 0 and layer.logit_cap <= 0 and not layer.is_cross_attention
                        and layer.xai_temperature_len <= 0)
        if latent and plain_causal and not isinstance(lists, ExtendUnifiedMetadata) and k_pool.dtype == q.dtype:
            o = mla_extend_attention(q, k.astype(q.dtype), k_pool, lists, v_head_dim=layer.dv, sinks=sinks,
                                     sm_scale=layer.scale, launch_mode=self.launch_mode)
            return o, k_pool, v_pool
        pool_v = v_pool
        if latent:  # the extend ops read V as an array of its own
            pool_v, common = layer.latent_v(k_pool, common)
        if isinstance(lists, ExtendUnifiedMetadata):
            if (lists is not meta.attn and not latent and not scales and unified_window_on_full_lists(
                    q, k_pool, v_pool, sliding_window=window, custom_mask=meta.custom_mask, logit_cap=layer.logit_cap,
                    sinks=sinks, xai_temperature_len=layer.xai_temperature_len, launch_mode=self.launch_mode)):
                lists, mask = meta.attn, meta.custom_mask  # the window as the op's argument (see the module doc)
            o = extend_attention_unified(q, k_pool, pool_v, lists, causal=not layer.is_cross_attention, custom_mask=mask,
                                         sliding_window=window, **common)
        else:
            v = k[..., :layer.dv] if latent else v
            # A verify step's tree as draft words where the batch has them (cross layers have no mask).
            tree = dict(custom_mask=mask)
            if mask is not None and meta.draft_words is not None:
                tree = dict(draft_mask=meta.draft_words)
            o = extend_attention(q, k.astype(q.dtype), v.astype(q.dtype), k_pool, pool_v, lists, causal=True,
                                 skip_prefix_custom_mask=True, sliding_window=window, **tree, **common)
        return o, k_pool, v_pool


# ---------------------------------------------------------------------------------------------
# Multi-step speculative draft decoding (SGLang's TritonMultiStepDraftBackend, inventory §4.7)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftDecodeMetadata:
    """The decode metadata of every draft step, stacked on a leading step axis (S = speculative_num_steps - 1).

    Row r = b * topk + t is branch t of sequence b. Index a step with `step(i)` (i may be traced, e.g. in a
    `lax.fori_loop`) or take them all with `steps()`.
    """

    kv_indptr: jax.Array  # i32[S, B * topk + 1]
    kv_indices: jax.Array  # i32[S, kv_capacity]
    num_kv_splits: jax.Array  # i32[S, B * topk]
    seq_lens: jax.Array  # i32[S, B * topk]: keys of each row at that step (verified prefix + drafts so far)
    out_cache_loc: jax.Array  # i32[S, B * topk]: slot the step's input token is written to (0 for padding rows)
    positions: jax.Array  # i32[S, B * topk]: position of the step's input token
    max_kv_splits: int = dataclasses.field(metadata=dict(static=True))
    kv_capacity: int = dataclasses.field(metadata=dict(static=True))
    deterministic: bool = dataclasses.field(default=False, metadata=dict(static=True))
    max_kv_len: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def num_steps(self) -> int:
        return self.kv_indptr.shape[0]

    def step(self, i) -> DecodeMetadata:
        return DecodeMetadata(self.kv_indptr[i], self.kv_indices[i], self.num_kv_splits[i], self.seq_lens[i],
                              self.max_kv_splits, self.kv_capacity, -1, self.deterministic, self.max_kv_len)

    def steps(self) -> tuple:
        return tuple(self.step(i) for i in range(self.num_steps))


@functools.partial(
    jax.jit,
    static_argnames=("speculative_num_steps", "topk", "kv_capacity", "q_heads", "kv_heads", "max_kv_splits",
                     "deterministic", "split_tile_size", "max_context_len", "launch_mode", "mode"),
)
def draft_decode_metadata(
    req_to_token: "jax.Array | PageTable",
    req_pool_indices: jax.Array,
    seq_lens: jax.Array,
    *,
    speculative_num_steps: int,
    topk: int,
    kv_capacity: int,
    q_heads: int,
    kv_heads: int,
    max_kv_splits: int | None = None,
    deterministic: bool = False,
    split_tile_size: int = 256,
    max_context_len: int | None = None,
    launch_mode: str | None = None,
    mode: str | None = None,
) -> DraftDecodeMetadata:
    """Decode metadata of all draft steps in one call (SGLang's generate_draft_decode_kv_indices, page size 1).

    Draft slots: the scheduler reserved ``topk * speculative_num_steps`` slots after each sequence's verified
    tokens (`jaxattn.serving.RequestTable.reserve`); branch t's token at depth j lives at
    ``req_to_token[row, seq_len + t * speculative_num_steps + j]``.
    Draft step i (0 <= i < speculative_num_steps - 1) feeds the depth-i tokens: row (b, t) lists
    ``req_to_token[row, :seq_len]`` then its i + 1 draft slots of depth 0..i, and writes the depth-i slot. The last
    step only samples (its tokens are never fed back), so, as SGLang's Triton backend and the trtllm fix in
    0.5.4 do, it gets no metadata: S = speculative_num_steps - 1.

    Args:
      req_to_token: i32[max_reqs, max_context_len], or a `jaxattn.paging.PageTable` (the same slots through its pages:
        the lists are gathered from the page table, no page-1 table is built). req_pool_indices: i32[B]. seq_lens:
        i32[B], verified tokens per sequence (0 = padding row: empty lists, slot 0).
      speculative_num_steps: >= 2. topk: draft branches per sequence, >= 1.
      kv_capacity: static length of each step's list: >= topk * sum(seq_lens) + B * topk * (speculative_num_steps - 1).
      q_heads, kv_heads, max_kv_splits, deterministic, split_tile_size: as `decode.decode_metadata`.
      max_context_len: static bound on a row's keys (default req_to_token.shape[1]).
      launch_mode: launch mode of the index kernels (`mode`: its old name).

    Returns:
      `DraftDecodeMetadata` with S = speculative_num_steps - 1 steps.
    """
    paged = isinstance(req_to_token, PageTable)
    if not paged:
        check_array("req_to_token", req_to_token, ndim=2, dtypes=INDEX_DTYPES, what="[max_reqs, max_context_len]")
    check_array("req_pool_indices", req_pool_indices, ndim=1, dtypes=INDEX_DTYPES, what="[batch]")
    batch = req_pool_indices.shape[0]
    check_array("seq_lens", seq_lens, shape=(batch,), dtypes=INDEX_DTYPES, what="[batch]")
    if not isinstance(speculative_num_steps, int) or speculative_num_steps < 2:
        raise ValueError(f"speculative_num_steps must be an int >= 2 (the last step runs no attention); got {speculative_num_steps!r}")
    check_positive_int("topk", topk)
    check_positive_int("kv_capacity", kv_capacity)
    launch_mode = launch_mode_argument(launch_mode, mode)
    rows = jnp.repeat(index_i32(req_pool_indices), topk)  # row r = b * topk + t
    seq = jnp.repeat(jnp.maximum(index_i32(seq_lens), 0), topk)
    branch = jnp.tile(jnp.arange(topk, dtype=jnp.int32), batch)
    real = seq > 0
    if paged:
        ctx = req_to_token.req_to_page.shape[1] * req_to_token.page_size  # positions a row's pages hold
        prefix_indptr, prefix_indices = create_kv_indices_from_pages(
            req_to_token.req_to_page, rows, seq, None, capacity=kv_capacity, **req_to_token.builder_args())

        def slots_at(cols):  # token_slots reads slot 0 for positions past the row's pages
            return token_slots(req_to_token.req_to_page, rows[:, None], cols, **req_to_token.builder_args())
    else:
        ctx = req_to_token.shape[1]
        prefix_indptr, prefix_indices = create_kv_indices(req_to_token, rows, seq, None, capacity=kv_capacity,
                                                          launch_mode=launch_mode)
        safe_rows = jnp.clip(rows, 0, req_to_token.shape[0] - 1)

        def slots_at(cols):
            return req_to_token[safe_rows[:, None], jnp.clip(cols, 0, ctx - 1)]
    max_ctx = ctx if max_context_len is None else int(max_context_len)
    metas, locs, positions = [], [], []
    for i in range(speculative_num_steps - 1):
        depth = jnp.arange(i + 1, dtype=jnp.int32)
        cols = seq[:, None] + branch[:, None] * speculative_num_steps + depth[None, :]  # [B * topk, i + 1]
        slots = jnp.where(real[:, None] & (cols < ctx), slots_at(cols), 0)
        drafts = jnp.where(real, i + 1, 0)
        # Row r's i + 1 draft slots sit at r * (i + 1) in the flattened [B * topk, i + 1] array.
        kv_indptr, kv_indices, _ = build_unified_kv_indices(
            prefix_indptr, prefix_indices, jnp.arange(batch * topk, dtype=jnp.int32) * (i + 1), drafts, slots.reshape(-1),
            capacity=kv_capacity, launch_mode=launch_mode,
        )
        step_lens = seq + drafts
        metas.append(decode_metadata_from_indptr(
            kv_indptr, kv_indices, step_lens, q_heads=q_heads, kv_heads=kv_heads, max_kv_splits=max_kv_splits,
            deterministic=deterministic, split_tile_size=split_tile_size, max_context_len=max_ctx,
        ))
        locs.append(slots[:, i])
        positions.append(jnp.where(real, seq + i, 0))
    first = metas[0]
    return DraftDecodeMetadata(
        kv_indptr=jnp.stack([m.kv_indptr for m in metas]),
        kv_indices=jnp.stack([m.kv_indices for m in metas]),
        num_kv_splits=jnp.stack([m.num_kv_splits for m in metas]),
        seq_lens=jnp.stack([m.seq_lens for m in metas]),
        out_cache_loc=jnp.stack(locs),
        positions=jnp.stack(positions),
        max_kv_splits=first.max_kv_splits,
        kv_capacity=kv_capacity,
        deterministic=deterministic,
        max_kv_len=max_ctx,
    )
