"""FlashInfer behind jaxattn's backend interface, bridged zero-copy through DLPack and usable inside `jax.jit`.

    backend = FlashInferBackend()
    meta = backend.plan(batch, req_to_token, layers)      # host work, before the jitted step (syncs)
    o, k_pool, v_pool = backend.forward(q, k, v, k_pool, v_pool, layer, meta)   # inside jit

`plan` builds FlashInfer's plan arguments (indptr, indices, last-page lengths, the bit-packed tree mask) on
the host and calls the wrappers' `plan()`; it returns a small pytree whose static part names the planned
wrappers, so a step jitted once keeps serving new plans. `forward` writes K/V with `write_kv` (JAX) and runs
the wrapper's kernel on XLA's stream on JAX's own buffers (no copies), one of two ways (`launch=`, or
$JAXATTN_FLASHINFER_LAUNCH): "ffi", an XLA FFI call through jax-tvm-ffi (`jaxattn.backends.flashinfer_ffi`, the
default when jax-tvm-ffi is installed), or "bridge", the wrapper's `run()` through `jax.experimental.buffer_callback`
on DLPack views (`bridged_run`). LSEs from FlashInfer are base 2; jaxattn's are natural log: converted at the boundary.

Page size 1: the pool `[slots, kv_heads, head_dim]` is passed as `[slots, 1, kv_heads, head_dim]` (a view)
with every `last_page_len` 1. torch and flashinfer are imported only when this backend is used.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.backends.flashinfer_ffi import FfiLauncher, choose_launch
from jaxattn.backends.layer import AttentionLayer, split_heads
from jaxattn.metadata import window_first_key
from jaxattn.paging import PageTable
from jaxattn.serving.batch import ForwardBatch, ForwardMode
from jaxattn.serving.kv_pool import is_fp8, write_kv

LN2 = math.log(2.0)


def _require_flashinfer():
    try:
        import flashinfer  # noqa: F401
        import torch  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "FlashInferBackend needs torch and flashinfer-python (a CUDA GPU too): pip install 'jaxattn[flashinfer]'. "
            f"Import failed with: {error}"
        ) from error
    import flashinfer
    import torch

    return torch, flashinfer


def should_use_tensor_cores(kv_dtype, q_heads: int, kv_heads: int) -> bool:
    """FlashInfer decode's kernel choice: SGLang's rule for 16-bit KV (tensor cores with >= 4 query heads per KV head);
    fp8 KV without them, unlike SGLang: with flashinfer 0.6.0 on the H200 image the tensor-core (prefill) module for
    bf16 q and e4m3 KV fails to build, while the plain decode kernel runs it (D1 0.486 ms, benchmarks/RESULTS.md)."""
    if is_fp8(kv_dtype):
        return False
    if jnp.dtype(kv_dtype) in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return q_heads // kv_heads >= 4
    return False


def plan_dtype_names(q_dtype, kv_dtype) -> tuple[str, str]:
    """torch dtype names of FlashInfer's `q_data_type` / `kv_data_type`; ValueError for dtypes its kernels lack
    (float32 among them: use TritonBackend or ReferenceBackend for fp32)."""
    sixteen = {jnp.dtype(jnp.bfloat16): "bfloat16", jnp.dtype(jnp.float16): "float16"}
    if jnp.dtype(q_dtype) not in sixteen:
        raise ValueError(f"FlashInferBackend: q dtype {jnp.dtype(q_dtype).name} is not supported (bf16/fp16 only; "
                         "TritonBackend and ReferenceBackend take float32)")
    if jnp.dtype(kv_dtype) not in sixteen and not is_fp8(kv_dtype):
        raise ValueError(f"FlashInferBackend: KV pool dtype {jnp.dtype(kv_dtype).name} is not supported (bf16/fp16/fp8 only; "
                         "TritonBackend and ReferenceBackend take float32)")
    fp8 = {jnp.dtype(jnp.float8_e4m3fn): "float8_e4m3fn", jnp.dtype(jnp.float8_e5m2): "float8_e5m2"}
    return sixteen[jnp.dtype(q_dtype)], {**sixteen, **fp8}[jnp.dtype(kv_dtype)]


# ---------------------------------------------------------------------------------------------
# Plan arguments (host, numpy): testable without a GPU.


def plan_arguments(batch: ForwardBatch, req_to_token, *, sliding_window: int = -1, cross_attention: bool = False) -> dict:
    """FlashInfer's plan inputs for one wrapper, as numpy arrays (host sync on the batch's arrays).

    Keys: qo_indptr (extend-like modes), kv_indptr, kv_indices, kv_last_page_len, and for TARGET_VERIFY
    custom_mask (bool, flat per request [q_len, kv_len]). With a sliding window the kv list keeps the last
    min(seq_len, W + q_len) keys (decode: W + 1), like SGLang's window wrapper; with cross attention it is the
    encoder's tokens; a decoder with encoder tokens lists its own tokens after them. A `jaxattn.paging.PageTable`
    is planned as its page-1 table (`PageTable.req_to_token()`: FlashInfer's page size 1 over the same slots).
    """
    if isinstance(req_to_token, PageTable):
        req_to_token = req_to_token.req_to_token()
    req_to_token = np.asarray(req_to_token)
    rows = np.asarray(batch.req_pool_indices)
    seq_lens = np.asarray(batch.seq_lens)
    extend_lens = np.asarray(batch.extend_lens)
    encoder = None if batch.encoder_lens is None else np.asarray(batch.encoder_lens)
    decode = batch.mode == ForwardMode.DECODE
    q_lens = np.ones_like(seq_lens) if decode else extend_lens
    if cross_attention:
        if encoder is None:
            raise ValueError("cross attention needs batch.encoder_lens")
        kv_lens, kv_starts = encoder, np.zeros_like(encoder)
    else:
        kv_lens = seq_lens.copy()
        kv_starts = np.zeros_like(seq_lens) if encoder is None else encoder.copy()
        if sliding_window >= 0:  # the keys the first query can see on (window_first_key): min(seq_len, W + q_len)
            dropped = np.asarray(window_first_key(seq_lens - q_lens, sliding_window))
            kv_starts = kv_starts + dropped
            kv_lens = seq_lens - dropped
    # Padding rows (seq_len 0) get one key, the padding slot 0, so no kernel sees an empty list; their outputs
    # are zeroed afterwards (FlashInferMetadata.token_valid).
    padding = seq_lens <= 0
    kv_lens = np.where(padding, 1, kv_lens)
    kv_starts = np.where(padding, 0, kv_starts)
    kv_indices = np.concatenate(
        [np.zeros(1, np.int32) if pad else req_to_token[r, s : s + n] for r, s, n, pad in zip(rows, kv_starts, kv_lens, padding)]
        + [np.zeros(0, np.int32)]
    ).astype(np.int32)
    args = dict(
        kv_indptr=np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32),
        kv_indices=kv_indices,
        kv_last_page_len=np.ones(len(rows), np.int32),
    )
    if not decode:
        args["qo_indptr"] = np.concatenate([[0], np.cumsum(extend_lens)]).astype(np.int32)
    if batch.mode == ForwardMode.TARGET_VERIFY:
        if sliding_window >= 0:
            raise NotImplementedError("TARGET_VERIFY on sliding-window layers is not supported by the FlashInfer path")
        mask_indptr = np.concatenate([[0], np.cumsum(extend_lens * seq_lens)]).astype(np.int64)
        args["custom_mask"] = np.asarray(batch.custom_mask, bool)[: mask_indptr[-1]]
        args["mask_indptr"] = mask_indptr
    return args


# ---------------------------------------------------------------------------------------------


_external_streams: dict = {}


def _torch_stream(torch, stream_pointer: int):
    """The torch handle of XLA's stream, made once per stream (constructing it costs host time every call)."""
    stream = _external_streams.get(stream_pointer)
    if stream is None:
        stream = _external_streams[stream_pointer] = torch.cuda.ExternalStream(stream_pointer)
    return stream


def _torch_view(buffer):
    """A torch tensor over an XLA buffer, no copy. The DLPack capsule is taken with stream=-1 (DLPack: the producer
    does no synchronisation): the callback already runs on XLA's stream, so nothing needs ordering, and skipping
    torch.from_dlpack's stream handshake saves ~10 us of host time per buffer (H200, benchmarks/results/)."""
    from torch.utils import dlpack as torch_dlpack

    return torch_dlpack.from_dlpack(buffer.__dlpack__(stream=-1))


def bridged_run(wrapper, q, k_pool, v_pool, v_head_dim: int, *, k_scale=None, v_scale=None, has_side_effect=False):
    """Runs a planned FlashInfer wrapper on JAX arrays, inside or outside jit, with no copies.

    `jax.experimental.buffer_callback` hands the callback XLA's device buffers and stream; torch sees them
    through DLPack and FlashInfer runs on `torch.cuda.ExternalStream(stream)`, so the kernel is ordered with
    the rest of the XLA program. Returns (o [T, q_heads, v_head_dim], base-2 lse f32[T, q_heads]).
    has_side_effect: keep XLA from merging calls on identical inputs (the benchmark's repeated layers).
    """
    import torch
    from jax.experimental.buffer_callback import buffer_callback

    def run(ctx, outputs, q_buf, k_buf, v_buf):
        out_buf, lse_buf = outputs
        with torch.cuda.stream(_torch_stream(torch, ctx.stream)):
            cache = (_torch_view(k_buf).unsqueeze(1), _torch_view(v_buf).unsqueeze(1))
            wrapper.run(_torch_view(q_buf), cache, out=_torch_view(out_buf), lse=_torch_view(lse_buf),
                        return_lse=True, k_scale=k_scale, v_scale=v_scale)

    out_shape = (jax.ShapeDtypeStruct((q.shape[0], q.shape[1], v_head_dim), q.dtype),
                 jax.ShapeDtypeStruct((q.shape[0], q.shape[1]), jnp.float32))
    return buffer_callback(run, out_shape, has_side_effect=has_side_effect)(q, k_pool, v_pool)


def token_valid(batch: ForwardBatch) -> np.ndarray:
    """bool[T]: tokens that belong to a real sequence (others are padding and get zero output)."""
    if batch.mode == ForwardMode.DECODE:
        return np.asarray(batch.seq_lens) > 0
    return np.arange(batch.num_tokens) < int(np.asarray(batch.extend_lens).sum())


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FlashInferMetadata:
    out_cache_loc: jax.Array  # i32[T]
    token_valid: jax.Array  # bool[T]
    mode: ForwardMode = dataclasses.field(metadata=dict(static=True))
    num_tokens: int = dataclasses.field(metadata=dict(static=True))


class FlashInferBackend:
    """FlashInfer decode / paged prefill (with tree masks and windows) behind the jaxattn backend interface.

    One planned wrapper per layer kind (window or full, cross or self, soft cap, scale): `plan` re-plans them
    in place each step; their identity is static, so the jitted step is traced once.
    """

    name = "flashinfer"

    def __init__(self, workspace_bytes: int = 384 << 20, use_tensor_cores: bool | None = None, launch: str | None = None):
        self.torch, self.flashinfer = _require_flashinfer()
        self.launch = choose_launch(launch)  # "ffi" | "bridge"
        self._ffi = FfiLauncher() if self.launch == "ffi" else None
        self.workspace = self.torch.empty(workspace_bytes, dtype=self.torch.uint8, device="cuda")
        self.use_tensor_cores = use_tensor_cores
        self._wrappers: dict = {}
        self._mode = None

    @staticmethod
    def layer_kind(layer: AttentionLayer):
        return (layer.sliding_window, layer.is_cross_attention, layer.logit_cap, layer.scale, layer.q_heads, layer.kv_heads,
                layer.head_dim, layer.dv)

    def _wrapper(self, mode: ForwardMode, kind, kv_dtype):
        key = (mode, kind)
        if key not in self._wrappers:
            fi = self.flashinfer
            _, _, _, _, q_heads, kv_heads, _, _ = kind
            if mode == ForwardMode.DECODE:
                tc = self.use_tensor_cores
                if tc is None:
                    tc = should_use_tensor_cores(kv_dtype, q_heads, kv_heads)
                self._wrappers[key] = fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=tc)
            else:
                self._wrappers[key] = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="auto")
        return self._wrappers[key]

    def plan(self, batch: ForwardBatch, req_to_token, layers, *, q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16) -> FlashInferMetadata:
        """Host work before the step: plans one wrapper per distinct layer kind. Waits for the previous step."""
        torch = self.torch
        q_name, kv_name = plan_dtype_names(q_dtype, kv_dtype)
        valid = jnp.asarray(token_valid(batch))
        if batch.mode == ForwardMode.IDLE:
            return FlashInferMetadata(batch.out_cache_loc, valid, batch.mode, batch.num_tokens)
        jax.block_until_ready(batch.seq_lens)  # the wrappers' buffers are reused: the last step must be done
        q_t, kv_t = getattr(torch, q_name), getattr(torch, kv_name)
        for kind in dict.fromkeys(self.layer_kind(layer) for layer in layers):
            window, cross, cap, scale, q_heads, kv_heads, head_dim, dv = kind
            args = plan_arguments(batch, req_to_token, sliding_window=window, cross_attention=cross)
            dev = {k: torch.from_numpy(v).cuda() for k, v in args.items()}
            wrapper = self._wrapper(batch.mode, kind, kv_dtype)
            common = dict(logits_soft_cap=cap if cap > 0 else None, sm_scale=scale, q_data_type=q_t, kv_data_type=kv_t)
            if batch.mode == ForwardMode.DECODE:
                wrapper.plan(dev["kv_indptr"], dev["kv_indices"], dev["kv_last_page_len"], q_heads, kv_heads, head_dim, 1,
                             window_left=window, **common)
            else:
                wrapper.plan(dev["qo_indptr"], dev["kv_indptr"], dev["kv_indices"], dev["kv_last_page_len"], q_heads, kv_heads,
                             head_dim, 1, head_dim_vo=dv, custom_mask=dev.get("custom_mask"), causal=not cross and "custom_mask" not in dev,
                             window_left=window, **common)
        torch.cuda.synchronize()
        return FlashInferMetadata(batch.out_cache_loc, valid, batch.mode, batch.num_tokens)

    def forward(self, q, k, v, k_pool, v_pool, layer: AttentionLayer, meta: FlashInferMetadata, *, sinks=None, save_kv=True,
                return_lse=False):
        if sinks is not None:
            raise NotImplementedError("FlashInfer's fa2/fa3 paths ignore attention sinks: use TritonBackend for sink models")
        if layer.xai_temperature_len > 0:
            raise NotImplementedError("FlashInfer has no xai temperature: use TritonBackend")
        q = split_heads(q, layer.q_heads, layer.head_dim, "q")
        if meta.mode == ForwardMode.IDLE:
            out = jnp.zeros((q.shape[0], layer.q_heads, layer.dv), q.dtype)
            return (out, jnp.full(out.shape[:2], -jnp.inf), k_pool, v_pool) if return_lse else (out, k_pool, v_pool)
        if save_kv and k is not None:
            k = split_heads(k, layer.kv_heads, layer.head_dim, "k")
            v = split_heads(v, layer.kv_heads, layer.dv, "v")
            k_pool, v_pool = write_kv(k_pool, v_pool, meta.out_cache_loc, k, v, k_scale=layer.k_scale, v_scale=layer.v_scale)
        key = (meta.mode, self.layer_kind(layer))
        if key not in self._wrappers:
            raise ValueError(f"layer {layer.layer_id} was not planned: pass it to FlashInferBackend.plan(batch, req_to_token, layers)")
        run = bridged_run if self._ffi is None else self._ffi.run
        o, lse2 = run(self._wrappers[key], q, k_pool, v_pool, layer.dv, k_scale=layer.k_scale, v_scale=layer.v_scale)
        o = jnp.where(meta.token_valid[:, None, None], o, 0).astype(q.dtype)
        lse2 = jnp.where(meta.token_valid[:, None], lse2, -jnp.inf)
        if return_lse:
            return o, lse2 * LN2, k_pool, v_pool
        return o, k_pool, v_pool
