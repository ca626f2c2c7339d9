"""Llama-family decoders (Llama-3, Mistral, Qwen2, Qwen3) in plain JAX, attending through a jaxattn backend.

    config, params = load_hf_checkpoint("path/to/model_dir")            # config.json + *.safetensors, no network
    kv_cache = init_kv_cache(config, num_slots=4096)                     # one (k_pool, v_pool) per layer
    logits, kv_cache = forward(params, config, backend, batch, req_to_token, kv_cache, token_ids)
    want = dense_logits(params, config, token_ids_of_one_sequence)       # the no-cache oracle

The computation follows transformers' modeling code for these families, operation by operation and in the same
dtypes (so bf16 results round where transformers' do): RMSNorm in float32 then `weight * x.to(dtype)`; RoPE with the
rotate-half convention (first half / second half of head_dim, not interleaved), cos/sin computed in float32 and cast
to the activations' dtype; Qwen3's per-head q_norm / k_norm (RMSNorm over head_dim) before RoPE; SwiGLU MLP
`down(silu(gate(x)) * up(x))`; Linear layers as one matmul accumulated in float32 plus bias, rounded once; logits in
the model's dtype.

Sliding windows. Hugging Face's Mistral / Qwen2 / Qwen3 `sliding_window = S` keeps S keys per query (the query's own
included: `q_pos - k_pos < S`, transformers' `sliding_window_overlay`), while jaxattn's `AttentionLayer(sliding_window=W)`
keeps W + 1 keys (`q_pos - k_pos <= W`, SGLang's convention). A window layer of size S therefore maps to W = S - 1
(what SGLang's model code does too). Which layers have a window: Mistral, every layer when `sliding_window` is set;
Qwen2/Qwen3, `layer_types` when the config has it, else the layers `i >= max_window_layers` when
`use_sliding_window` is true; Llama, none.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.backends.layer import AttentionLayer
from jaxattn.serving.batch import ForwardBatch
from jaxattn.serving.kv_pool import allocate_kv_pool

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
# transformers' defaults for the fields these configs may leave out (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config).
_DEFAULTS = dict(rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                 hidden_act="silu", max_position_embeddings=2048)
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A decoder's static shape and options (hashable: it is part of the jitted step's closure)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()  # sorted (key, value) items of the HF rope_scaling dict; () for the default RoPE
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # biases on q_proj, k_proj, v_proj
    o_bias: bool = False  # bias on o_proj
    mlp_bias: bool = False  # biases on gate_proj, up_proj, down_proj
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    windows: tuple = ()  # jaxattn window W per layer (-1: full attention); () means none anywhere
    eos_token_ids: tuple = ()

    # ------------------------------------------------------------------ from a config.json

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaConfig":
        """The config of a Hugging Face `config.json` dict (Llama-3, Mistral, Qwen2, Qwen3); ValueError otherwise."""
        if not isinstance(hf, dict):
            raise ValueError(f"LlamaConfig.from_hf takes the parsed config.json dict; got {type(hf).__name__}")
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            hint = " (mixture-of-experts models are not supported)" if "moe" in str(model_type).lower() else ""
            raise ValueError(f"unsupported model_type {model_type!r}{hint}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        for key in _MOE_KEYS:
            if hf.get(key):
                raise ValueError(f"config has {key}={hf[key]!r}: mixture-of-experts layers are not supported")
        missing = [k for k in _REQUIRED if hf.get(k) is None]
        if missing:
            raise ValueError(f"config.json is missing required field(s) {', '.join(missing)} (model_type {model_type!r})")
        get = lambda key: hf[key] if hf.get(key) is not None else _DEFAULTS[key]  # noqa: E731
        if get("hidden_act") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu: the SwiGLU MLP)")
        if float(hf.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor {hf['partial_rotary_factor']} is not supported (RoPE over the whole head)")
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        if hf.get("head_dim") is not None:
            head_dim = int(hf["head_dim"])
        else:
            if hidden % heads:
                raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} and head_dim is not given")
            head_dim = hidden // heads
        if head_dim % 2:
            raise ValueError(f"head_dim {head_dim} must be even (RoPE rotates halves)")
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        rope_theta, rope_scaling = _rope_fields(hf)
        layers = int(hf["num_hidden_layers"])
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False  # Qwen2Attention: q/k/v always biased, o never
        else:
            qkv_bias = o_bias = bool(get("attention_bias"))
        eos = hf.get("eos_token_id")
        eos = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
        return cls(
            model_type=model_type, vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]), num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
            head_dim=head_dim, rms_norm_eps=float(get("rms_norm_eps")), rope_theta=rope_theta, rope_scaling=rope_scaling,
            max_position_embeddings=int(get("max_position_embeddings")), tie_word_embeddings=bool(get("tie_word_embeddings")),
            qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=bool(get("mlp_bias")) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3", windows=_layer_windows(hf, model_type, layers), eos_token_ids=eos,
        )

    # ------------------------------------------------------------------ derived facts

    def window(self, i: int) -> int:
        """jaxattn's window W of layer i (-1: full attention)."""
        return self.windows[i] if self.windows else -1

    def attention_layer(self, i: int) -> AttentionLayer:
        return AttentionLayer(i, self.num_heads, self.num_kv_heads, self.head_dim, sliding_window=self.window(i))

    def attention_layers(self) -> tuple:
        return tuple(self.attention_layer(i) for i in range(self.num_layers))

    @property
    def sliding_windows(self) -> tuple:
        """The distinct jaxattn windows W of the model (for `TritonBackend(sliding_windows=...)`)."""
        return tuple(sorted({w for w in self.windows if w >= 0}))

    def inv_freq(self) -> np.ndarray:
        """f32[head_dim / 2]: RoPE's inverse frequencies, scaled as the config says (transformers' rope init functions)."""
        return rope_inv_freq(self.head_dim, self.rope_theta, dict(self.rope_scaling))

    def num_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * h * self.intermediate_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * (attn + mlp + 2 * h) + self.vocab_size * h + head + h


def _rope_fields(hf: dict):
    """(rope_theta, sorted rope_scaling items) from `rope_theta` + `rope_scaling` or transformers 5's `rope_parameters`."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    theta = hf.get("rope_theta")
    if isinstance(params, dict):
        if "rope_type" not in params and "type" not in params and all(isinstance(v, dict) for v in params.values()):
            raise ValueError("per-layer-type rope_parameters are not supported")
        theta = params.get("rope_theta", theta)
        scaling = scaling or params
    theta = float(theta if theta is not None else _DEFAULTS["rope_theta"])
    if not scaling:
        return theta, ()
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, ()
    if rope_type == "linear":
        items = {"rope_type": "linear", "factor": float(scaling["factor"])}
    elif rope_type == "llama3":
        need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in need if scaling.get(k) is None]
        if missing:
            raise ValueError(f"rope_scaling of type llama3 is missing {', '.join(missing)}")
        items = {"rope_type": "llama3", **{k: float(scaling[k]) for k in need}}
        if items["high_freq_factor"] <= items["low_freq_factor"]:
            raise ValueError("rope_scaling llama3: high_freq_factor must exceed low_freq_factor")
    else:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: default, linear, llama3")
    if items["factor"] <= 0:
        raise ValueError(f"rope_scaling factor must be > 0; got {items['factor']}")
    return theta, tuple(sorted(items.items()))


def _layer_windows(hf: dict, model_type: str, layers: int) -> tuple:
    """jaxattn window per layer: HF window S (S keys) -> W = S - 1 (W + 1 keys); () when no layer has one."""
    size = hf.get("sliding_window")
    if model_type == "llama":
        return ()
    if model_type == "mistral":
        sliding = [size is not None] * layers
    else:  # qwen2 / qwen3 (Qwen2Config: sliding_window only when use_sliding_window)
        if not hf.get("use_sliding_window", False):
            size = None
        types = hf.get("layer_types")
        if types is not None:
            if len(types) != layers:
                raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
            bad = sorted(set(types) - {"full_attention", "sliding_attention"})
            if bad:
                raise ValueError(f"unsupported layer_types {bad}; supported: full_attention, sliding_attention")
            sliding = [t == "sliding_attention" for t in types]
        else:
            first = hf.get("max_window_layers")
            first = 28 if first is None else int(first)  # Qwen2Config's default
            sliding = [i >= first for i in range(layers)]
    if size is None or not any(sliding):
        return ()
    size = int(size)
    if size < 1:
        raise ValueError(f"sliding_window must be >= 1 (keys per query); got {size}")
    return tuple(size - 1 if s else -1 for s in sliding)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """transformers' `_compute_default_rope_parameters`, `_compute_linear_scaling_rope_parameters` and
    `_compute_llama3_parameters`, in float32 as there (attention_factor is 1 for all three)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    rope_type = scaling.get("rope_type", "default") if scaling else "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return (inv_freq / float(scaling["factor"])).astype(np.float32)
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope type {rope_type!r}")
    # Python floats for the scalars and float32 arrays, as in transformers (numpy >= 2 keeps float32 like torch).
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama).astype(np.float32)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint loading

def hf_tensor_names(config: LlamaConfig) -> dict[str, tuple]:
    """{HF tensor name: (params path, HF shape, transpose)} that a checkpoint of `config` must hold."""
    h, d, i_size = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    names = {"model.embed_tokens.weight": (("embed",), (config.vocab_size, h), False),
             "model.norm.weight": (("norm",), (h,), False)}
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = (("lm_head",), (config.vocab_size, h), True)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": ("input_norm", (h,), False),
            "post_attention_layernorm.weight": ("post_norm", (h,), False),
            "self_attn.q_proj.weight": ("wq", (q, h), True),
            "self_attn.k_proj.weight": ("wk", (kv, h), True),
            "self_attn.v_proj.weight": ("wv", (kv, h), True),
            "self_attn.o_proj.weight": ("wo", (h, q), True),
            "mlp.gate_proj.weight": ("w_gate", (i_size, h), True),
            "mlp.up_proj.weight": ("w_up", (i_size, h), True),
            "mlp.down_proj.weight": ("w_down", (h, i_size), True),
        }
        if config.qkv_bias:
            layer.update({"self_attn.q_proj.bias": ("bq", (q,), False), "self_attn.k_proj.bias": ("bk", (kv,), False),
                          "self_attn.v_proj.bias": ("bv", (kv,), False)})
        if config.o_bias:
            layer["self_attn.o_proj.bias"] = ("bo", (h,), False)
        if config.mlp_bias:
            layer.update({"mlp.gate_proj.bias": ("b_gate", (i_size,), False), "mlp.up_proj.bias": ("b_up", (i_size,), False),
                          "mlp.down_proj.bias": ("b_down", (h,), False)})
        if config.qk_norm:
            layer.update({"self_attn.q_norm.weight": ("q_norm", (d,), False), "self_attn.k_norm.weight": ("k_norm", (d,), False)})
        for name, (key, shape, transpose) in layer.items():
            names[p + name] = (("layers", i, key), shape, transpose)
    return names


# Tensors a checkpoint may hold that the model does not use (old checkpoints' RoPE buffers).
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def _checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not os.path.exists(os.path.join(model_dir, f))]
        if absent:
            raise ValueError(f"{index} names shard(s) that are not in {model_dir}: {', '.join(absent)}")
        return [os.path.join(model_dir, f) for f in files]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in {model_dir} (and no model.safetensors.index.json)")
    return [os.path.join(model_dir, f) for f in files]


def load_params(config: LlamaConfig, tensors: dict, dtype=jnp.bfloat16):
    """The params pytree of `config` from {HF name: array}; ValueError naming missing, unexpected or misshapen tensors.

    Linear weights are transposed to [in, out] (HF stores [out, in]). With tie_word_embeddings the logits use the
    embedding (a stored lm_head.weight is ignored, as transformers ties it).
    """
    expected = hf_tensor_names(config)
    allowed_extra = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(set(expected) - set(tensors), key=_natural)
    unexpected = sorted((k for k in tensors if k not in expected and k not in allowed_extra and not _IGNORED.fullmatch(k)), key=_natural)
    problems = []
    if missing:
        problems.append(f"missing tensor(s): {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} ({len(missing)})")
    if unexpected:
        problems.append(f"unexpected tensor(s): {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)})")
    for name, (_, shape, _) in expected.items():
        if name in tensors and tuple(tensors[name].shape) != shape:
            problems.append(f"tensor {name} has shape {tuple(tensors[name].shape)}, the config implies {shape}")
    if problems:
        raise ValueError(f"checkpoint does not match its config ({config.model_type}, {config.num_layers} layers): " + "; ".join(problems))
    params = {"layers": [{} for _ in range(config.num_layers)]}
    for name, (path, _, transpose) in expected.items():
        value = jnp.asarray(np.asarray(tensors[name])).astype(dtype)
        if transpose:
            value = value.T
        if path[0] == "layers":
            params["layers"][path[1]][path[2]] = value
        else:
            params[path[0]] = value
    return params


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def load_hf_checkpoint(model_dir, dtype=jnp.bfloat16):
    """(LlamaConfig, params) from a local Hugging Face model directory: config.json and model.safetensors, or shards
    listed by model.safetensors.index.json. Reads local files only (never the network)."""
    from jaxattn.models.safetensors_io import read_safetensors

    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise ValueError(f"{model_dir!r} is not a local directory (load_hf_checkpoint never downloads)")
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"{model_dir} has no config.json")
    with open(path) as f:
        config = LlamaConfig.from_hf(json.load(f))
    tensors = {}
    for file in _checkpoint_files(model_dir):
        for name, array in read_safetensors(file).items():
            if name in tensors:
                raise ValueError(f"tensor {name} is stored twice (again in {os.path.basename(file)})")
            tensors[name] = array
    return config, load_params(config, tensors, dtype)


def init_kv_cache(config: LlamaConfig, num_slots: int, dtype=jnp.bfloat16):
    """A zeroed KV pool for every layer: [(k_pool, v_pool)] of [num_slots, kv_heads, head_dim] (slot 0: padding)."""
    return [allocate_kv_pool(num_slots, config.num_kv_heads, config.head_dim, dtype=dtype) for _ in range(config.num_layers)]


# ---------------------------------------------------------------------------------------------------------------
# The model

def _linear(x, w, b=None):
    """x @ w (+ b), accumulated in float32 and rounded once to x's dtype (a torch Linear on cuBLAS, bias included)."""
    precision = "highest" if x.dtype == jnp.float32 else None  # f32: no TF32, so batch composition cannot change results
    if b is None:
        return jnp.matmul(x, w, precision=precision)  # 16-bit inputs: f32 accumulation, one rounding, 16-bit output
    y = jnp.matmul(x, w, precision=precision, preferred_element_type=jnp.float32)
    return (y + b.astype(jnp.float32)).astype(x.dtype)


def _rms_norm(x, weight, eps):
    """transformers' LlamaRMSNorm: normalise in float32, cast back, then multiply by the weight."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope_cos_sin(config: LlamaConfig, positions, dtype):
    """cos, sin [T, head_dim] for integer positions [T], computed in float32 and cast to `dtype` (as transformers)."""
    inv_freq = jnp.asarray(config.inv_freq())
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x, cos, sin):
    """x [T, heads, head_dim]: x * cos + rotate_half(x) * sin (rotate_half: [-x2, x1], halves of head_dim)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _qkv(lp, config: LlamaConfig, x, cos, sin):
    h = _rms_norm(x, lp["input_norm"], config.rms_norm_eps)
    n, d = x.shape[0], config.head_dim
    q = _linear(h, lp["wq"], lp.get("bq")).reshape(n, config.num_heads, d)
    k = _linear(h, lp["wk"], lp.get("bk")).reshape(n, config.num_kv_heads, d)
    v = _linear(h, lp["wv"], lp.get("bv")).reshape(n, config.num_kv_heads, d)
    if config.qk_norm:
        q = _rms_norm(q, lp["q_norm"], config.rms_norm_eps)
        k = _rms_norm(k, lp["k_norm"], config.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _after_attention(lp, config: LlamaConfig, x, o):
    x = x + _linear(o.reshape(o.shape[0], -1).astype(x.dtype), lp["wo"], lp.get("bo"))
    h = _rms_norm(x, lp["post_norm"], config.rms_norm_eps)
    gate = _linear(h, lp["w_gate"], lp.get("b_gate"))
    up = _linear(h, lp["w_up"], lp.get("b_up"))
    return x + _linear(jax.nn.silu(gate) * up, lp["w_down"], lp.get("b_down"))


def _logits(params, config: LlamaConfig, x):
    h = _rms_norm(x, params["norm"], config.rms_norm_eps)
    head = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    return _linear(h, head)


def forward(params, config: LlamaConfig, backend, batch: ForwardBatch, req_to_token, kv_cache, token_ids, meta=None, *,
            logit_rows=None):
    """One paged step (extend, decode or verify) through `backend` and the KV pool, as `examples/toy_model.py`'s.

    Args:
      kv_cache: list of (k_pool, v_pool) per layer (`init_kv_cache`). token_ids: i32[T], the step's new tokens.
      meta: the backend's metadata when it was made outside the step (FlashInfer's host-side plan); by default the
        step builds it once with `backend.init_forward_metadata` (TritonBackend also gets the model's layers, so
        every window W has its trimmed lists).
      logit_rows: optional i32[R]: only these token rows get logits (e.g. each sequence's last prefill token);
        default all T.

    Returns:
      (logits [T or R, vocab] in the params' dtype, the updated kv_cache).
    """
    if meta is None:
        if getattr(backend, "name", None) == "triton":
            meta = backend.init_forward_metadata(batch, req_to_token, layers=config.attention_layers())
        else:
            meta = backend.init_forward_metadata(batch, req_to_token)
    x = params["embed"][token_ids]
    cos, sin = rope_cos_sin(config, batch.positions, x.dtype)
    new_cache = []
    for i, (lp, (k_pool, v_pool)) in enumerate(zip(params["layers"], kv_cache)):
        q, k, v = _qkv(lp, config, x, cos, sin)
        o, k_pool, v_pool = backend.forward(q, k, v, k_pool, v_pool, config.attention_layer(i), meta)
        x = _after_attention(lp, config, x, o)
        new_cache.append((k_pool, v_pool))
    if logit_rows is not None:
        x = x[logit_rows]
    return _logits(params, config, x), new_cache


def dense_logits(params, config: LlamaConfig, token_ids):
    """Logits [n, vocab] at every position of one whole sequence by plain dense causal attention (no cache, no
    pages; the same windows), attention in float32: the oracle the paged steps are checked against."""
    n = token_ids.shape[0]
    positions = jnp.arange(n)
    x = params["embed"][token_ids]
    cos, sin = rope_cos_sin(config, positions, x.dtype)
    group = config.num_heads // config.num_kv_heads
    for i, lp in enumerate(params["layers"]):
        layer = config.attention_layer(i)
        q, k, v = _qkv(lp, config, x, cos, sin)
        k = jnp.repeat(k, group, axis=1).astype(jnp.float32)
        v = jnp.repeat(v, group, axis=1).astype(jnp.float32)
        s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k, precision="highest") * layer.scale
        visible = positions[None, :] <= positions[:, None]
        if layer.sliding_window >= 0:
            visible &= positions[:, None] - positions[None, :] <= layer.sliding_window
        s = jnp.where(visible[None], s, -jnp.inf)
        o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v, precision="highest").astype(x.dtype)
        x = _after_attention(lp, config, x, o)
    return _logits(params, config, x)
