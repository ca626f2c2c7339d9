"""A tiny Llama-style decoder (seeded random weights, GQA, RoPE) that runs its attention through a jaxattn backend.

Used by the end-to-end tests and the serving example: `forward` runs one paged step (extend, decode or
verify) through a backend and the KV pool; `dense_logits` recomputes a whole sequence without any cache,
the oracle the paged steps must match.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxattn.backends.layer import AttentionLayer
from jaxattn.serving.batch import ForwardBatch


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    vocab: int = 97
    hidden: int = 64
    layers: int = 3
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    window_layers: tuple[int, ...] = ()  # layers with a sliding window
    sliding_window: int = -1  # W for those layers: each token sees itself and W previous tokens
    logit_cap: float = 0.0
    dtype: str = "float32"

    def attention_layer(self, i: int) -> AttentionLayer:
        window = self.sliding_window if i in self.window_layers else -1
        return AttentionLayer(i, self.q_heads, self.kv_heads, self.head_dim, sliding_window=window, logit_cap=self.logit_cap)


def init_params(config: ToyConfig, seed: int = 0):
    keys = iter(jax.random.split(jax.random.key(seed), 2 + 4 * config.layers))
    dtype = jnp.dtype(config.dtype)
    h, d = config.hidden, config.head_dim

    def dense(shape, fan_in):
        return (jax.random.normal(next(keys), shape, jnp.float32) / jnp.sqrt(fan_in)).astype(dtype)

    params = {"embed": dense((config.vocab, h), 1.0), "unembed": dense((h, config.vocab), h), "layers": []}
    for _ in range(config.layers):
        params["layers"].append(
            {
                "wq": dense((h, config.q_heads * d), h),
                "wk": dense((h, config.kv_heads * d), h),
                "wv": dense((h, config.kv_heads * d), h),
                "wo": dense((config.q_heads * d, h), config.q_heads * d),
            }
        )
    return params


def rope(x, positions):
    """Rotary embedding on [tokens, heads, head_dim] at integer positions [tokens]."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def _matmul(a, b):
    # Full fp32 precision: on a GPU the default lets XLA use TF32, whose rounding depends on the matmul's shape, so the
    # same token would get logits differing by ~1e-3 between batch compositions and the tests could not compare them.
    return jnp.matmul(a, b, precision="highest")


def _rms_norm(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def forward(params, config: ToyConfig, backend, batch: ForwardBatch, req_to_token, kv_cache, token_ids, meta=None):
    """One paged step. kv_cache: list of (k_buffer, v_buffer) per layer. Returns (logits [T, vocab], kv_cache).

    `meta` is the backend's metadata when it was made outside the step (FlashInfer's host-side plan);
    by default the step builds it with `backend.init_forward_metadata`.
    """
    if meta is None:
        meta = backend.init_forward_metadata(batch, req_to_token)
    x = params["embed"][token_ids]
    new_cache = []
    for i, (layer_params, (k_buffer, v_buffer)) in enumerate(zip(params["layers"], kv_cache)):
        layer = config.attention_layer(i)
        h = _rms_norm(x)
        q = rope(_matmul(h, layer_params["wq"]).reshape(-1, config.q_heads, config.head_dim), batch.positions)
        k = rope(_matmul(h, layer_params["wk"]).reshape(-1, config.kv_heads, config.head_dim), batch.positions)
        v = _matmul(h, layer_params["wv"]).reshape(-1, config.kv_heads, config.head_dim)
        o, k_buffer, v_buffer = backend.forward(q, k, v, k_buffer, v_buffer, layer, meta)
        x = x + _matmul(o.reshape(o.shape[0], -1), layer_params["wo"])
        new_cache.append((k_buffer, v_buffer))
    return _matmul(_rms_norm(x), params["unembed"]), new_cache


def dense_logits(params, config: ToyConfig, token_ids):
    """Logits at every position of one whole sequence, by plain dense causal attention (no cache, no pages)."""
    n = token_ids.shape[0]
    positions = jnp.arange(n)
    x = params["embed"][token_ids]
    group = config.q_heads // config.kv_heads
    for i, layer_params in enumerate(params["layers"]):
        layer = config.attention_layer(i)
        h = _rms_norm(x)
        q = rope(_matmul(h, layer_params["wq"]).reshape(n, config.q_heads, config.head_dim), positions)
        k = rope(_matmul(h, layer_params["wk"]).reshape(n, config.kv_heads, config.head_dim), positions)
        v = _matmul(h, layer_params["wv"]).reshape(n, config.kv_heads, config.head_dim)
        k = jnp.repeat(k, group, axis=1).astype(jnp.float32)
        v = jnp.repeat(v, group, axis=1).astype(jnp.float32)
        s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k, precision="highest") * layer.scale
        if layer.logit_cap > 0:
            s = layer.logit_cap * jnp.tanh(s / layer.logit_cap)
        visible = positions[None, :] <= positions[:, None]
        if layer.sliding_window >= 0:
            visible &= positions[:, None] - positions[None, :] <= layer.sliding_window
        s = jnp.where(visible[None], s, -jnp.inf)
        o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v, precision="highest").astype(x.dtype)
        x = x + _matmul(o.reshape(n, -1), layer_params["wo"])
    return _matmul(_rms_norm(x), params["unembed"])
