"""Tiny random checkpoints in the Hugging Face layout, for tests and for comparing with transformers.

    from jaxattn.models.testing import write_random_checkpoint
    write_random_checkpoint("/tmp/tiny-llama", "llama")                       # config.json + model.safetensors
    write_random_checkpoint("/tmp/tiny-qwen3", "qwen3", shards=2)             # + model.safetensors.index.json
    # transformers.AutoModelForCausalLM.from_pretrained("/tmp/tiny-llama") loads the same directory.

Presets: "llama", "qwen3", "qwen2" are tiny (each family's distinguishing features switched on); "llama3-1b"
(Llama-3.2-1B's config.json: 16 layers, hidden 2048, 32/8 heads x 64, llama3 RoPE scaling with factor 32, tied
embeddings), "qwen3-1.7b" (Qwen3-1.7B's: 28 layers, hidden 2048, 16/8 heads x 128, q/k norms, tied embeddings) and
"llama3-8b" have real models' shapes (`REAL_SHAPES`). Their weights are random, so their text is noise: they are for
comparing implementations and for timing at real sizes. Shrink one through `config_overrides` (e.g.
`{"num_hidden_layers": 2, "vocab_size": 512}`) for a CPU test.

`random_params(config, seed, dtype)` makes the same kind of weights directly on the device (no files), e.g. for an
8B-shaped timing run.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

from jaxattn.models.llama import ARCHITECTURES, LlamaConfig, hf_tensor_names

# Small configs per family, each with the family's distinguishing features switched on.
PRESETS = {
    # Llama-3: GQA, llama3 RoPE scaling (the factors of Llama-3.1, with a short original context so that the
    # tiny head dim has low, medium and high frequencies), untied embeddings.
    "llama": dict(
        model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
        max_position_embeddings=1024, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        hidden_act="silu", bos_token_id=1, eos_token_id=2, pretraining_tp=1, initializer_range=0.02, use_cache=True,
        attention_dropout=0.0,
    ),
    # Qwen3: q_norm / k_norm, head_dim given explicitly (not hidden / heads), tied embeddings (see
    # `embedding_scale`), no biases.
    "qwen3": dict(
        model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling=None, max_position_embeddings=1024, tie_word_embeddings=True, attention_bias=False,
        hidden_act="silu", use_sliding_window=False, sliding_window=None, max_window_layers=2, bos_token_id=1,
        eos_token_id=2, initializer_range=0.02, use_cache=True, attention_dropout=0.0,
    ),
    # Qwen2: q/k/v biases, a sliding window of S = 6 keys on the layers i >= max_window_layers = 1 (jaxattn W = 5).
    "qwen2": dict(
        model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=1024, tie_word_embeddings=False, hidden_act="silu", use_sliding_window=True,
        sliding_window=6, max_window_layers=1, bos_token_id=1, eos_token_id=2, initializer_range=0.02, use_cache=True,
        attention_dropout=0.0,
    ),
}

# Llama-3-8B's shape (random weights: for timing, not for text).
LLAMA3_8B = dict(
    PRESETS["llama"], vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, max_position_embeddings=131072,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    bos_token_id=128000, eos_token_id=128001,
)

# Llama-3.2-1B's config.json (meta-llama/Llama-3.2-1B): 1.24B parameters, embeddings tied, llama3 RoPE scaling
# with factor 32 (3.1's is 8).
LLAMA3_1B = dict(
    LLAMA3_8B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)

# Qwen3-1.7B's config.json (Qwen/Qwen3-1.7B): 1.72B parameters, q/k norms, head_dim 128 given explicitly (equal to
# hidden / heads here), embeddings tied, no sliding window.
QWEN3_1_7B = dict(
    PRESETS["qwen3"], vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
    max_position_embeddings=40960, max_window_layers=28, tie_word_embeddings=True, bos_token_id=151643,
    eos_token_id=151645,
)

# Presets with real models' shapes: their random weights are drawn in float32 (five times faster than the tiny
# presets' float64 draws, which stay as they were: the untied tiny presets are written again bit for bit; the tied
# qwen3 changed on 2026-12-03 with `embedding_scale`).
REAL_SHAPES = {"llama3-1b": LLAMA3_1B, "qwen3-1.7b": QWEN3_1_7B, "llama3-8b": LLAMA3_8B}


def preset_names() -> list[str]:
    return [*PRESETS, *REAL_SHAPES]


def hf_config(preset: str = "llama", overrides: dict | None = None, dtype: str = "bfloat16") -> dict:
    """A complete config.json dict (architectures, model_type, every field transformers reads) of a preset."""
    base = PRESETS.get(preset, REAL_SHAPES.get(preset))
    if base is None:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(preset_names())}")
    config = dict(base)
    config.update(overrides or {})
    config["architectures"] = [ARCHITECTURES[config["model_type"]]]
    config["torch_dtype"] = dtype  # transformers 4 reads torch_dtype, 5 reads dtype (and still accepts torch_dtype)
    config["dtype"] = dtype
    config.setdefault("transformers_version", "4.56.0")
    if config.get("head_dim") is None:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    return config


def embedding_scale(config: LlamaConfig) -> float:
    """Standard deviation of the random embedding: 1, or 1 / sqrt(hidden) when the embedding is tied (the lm_head).

    Tied at unit scale, the logit of the current token is ~|e|^2 / rms(x) = hidden / rms(x) against the others'
    ~sqrt(hidden) (the residual stream still holds the token's own embedding): the current token is the argmax at
    every position of the 1B-shaped presets and at 97% of the tiny qwen3's, and greedy decoding repeats it forever,
    which proves nothing about the tokens. At 1 / sqrt(hidden) the other logits are ~N(0, 1) and the own-token term
    ~1 / rms(x): the argmax at none of the 1B-shaped positions and 3-11% of the tiny qwen3's (a 2-layer model still
    falls into repetition loops now and then, through attention)."""
    return 1.0 / float(np.sqrt(config.hidden_size)) if config.tie_word_embeddings else 1.0


def random_tensors(config: LlamaConfig, seed: int = 0, dtype=ml_dtypes.bfloat16, draw_dtype=np.float64) -> dict[str, np.ndarray]:
    """{HF name: array} of random weights for `config`, scaled so activations and logits stay O(1) (see
    `embedding_scale` for tied embeddings).

    draw_dtype: the dtype of the normal draws (float32 is about five times faster than float64, for real shapes;
    the two give different values for one seed)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (path, shape, _) in hf_tensor_names(config).items():
        key = path[-1]
        value = rng.standard_normal(shape, dtype=draw_dtype)
        if key in ("input_norm", "post_norm", "norm", "q_norm", "k_norm"):
            value = 1.0 + 0.2 * value
        elif key.startswith("b"):
            value = 0.2 * value
        elif key == "embed":
            if config.tie_word_embeddings:
                value *= embedding_scale(config)
        else:  # a Linear [out, in]: unit-variance outputs (lm_head a little wider, so greedy picks are not near ties)
            value *= (3.0 if key == "lm_head" else 1.0) / np.sqrt(shape[1])
        out[name] = value.astype(np.float32, copy=False).astype(dtype)
    return out


def write_byte_tokenizer(model_dir) -> None:
    """DIR/tokenizer.json: a byte-level tokenizer (token id = byte value, 256 ids, no merges); needs `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _BYTE_OF[c])
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(os.path.join(model_dir, "tokenizer.json"))


def _bytes_to_unicode() -> dict:
    """GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's alphabet), inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_OF = _bytes_to_unicode()


def write_random_checkpoint(model_dir, preset: str = "llama", config_overrides: dict | None = None, seed: int = 0,
                            shards: int = 1, dtype: str = "bfloat16", tokenizer: bool = False) -> dict:
    """Writes config.json and random weights (model.safetensors, or `shards` files + model.safetensors.index.json)
    of a preset (`preset_names()`: "llama", "qwen3", "qwen2", "llama3-1b", "qwen3-1.7b", "llama3-8b") into
    `model_dir`; returns the config dict written.

    The files are what transformers' `from_pretrained(model_dir)` loads (metadata format "pt"). `tokenizer=True`
    also writes a byte-level tokenizer.json (vocab_size must be >= 256). A real-shape preset takes seconds per
    billion parameters (float32 draws) and 2 bytes per parameter of disk in bf16 (llama3-1b: 2.5 GB).
    """
    from jaxattn.models.safetensors_io import write_safetensors

    hf = hf_config(preset, config_overrides, dtype)
    config = LlamaConfig.from_hf(hf)
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}[dtype]
    tensors = random_tensors(config, seed, np_dtype, draw_dtype=np.float32 if preset in REAL_SHAPES else np.float64)
    if config.tie_word_embeddings:
        hf.setdefault("tie_word_embeddings", True)
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": hf.get("bos_token_id"), "eos_token_id": hf.get("eos_token_id"), "do_sample": False}, f, indent=2)
    if tokenizer:
        if config.vocab_size < 256:
            raise ValueError("a byte-level tokenizer needs vocab_size >= 256")
        write_byte_tokenizer(model_dir)
    names = list(tensors)
    if shards <= 1:
        write_safetensors(os.path.join(model_dir, "model.safetensors"), tensors, metadata={"format": "pt"})
        return hf
    groups = np.array_split(np.arange(len(names)), shards)
    weight_map, total = {}, 0
    for s, group in enumerate(groups):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {names[i]: tensors[names[i]] for i in group}
        write_safetensors(os.path.join(model_dir, file), part, metadata={"format": "pt"})
        for name in part:
            weight_map[name] = file
            total += part[name].nbytes
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return hf


def random_params(config: LlamaConfig, seed: int = 0, dtype=None):
    """A params pytree of random weights made on the default device (no files, no host copy): for timing runs at
    real shapes (e.g. the 8B preset), where writing and reading 16 GB of checkpoint would dominate."""
    import jax
    import jax.numpy as jnp

    from jaxattn.models.llama import hf_tensor_names as names_of

    dtype = jnp.bfloat16 if dtype is None else dtype
    entries = names_of(config)
    keys = jax.random.split(jax.random.key(seed), len(entries))
    params = {"layers": [{} for _ in range(config.num_layers)]}

    import functools

    @functools.partial(jax.jit, static_argnums=3)
    def make(key, scale, offset, shape):
        return (offset + scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    for key, (name, (path, shape, transpose)) in zip(keys, entries.items()):
        leaf = path[-1]
        shape = tuple(reversed(shape)) if transpose else shape
        if leaf in ("input_norm", "post_norm", "norm", "q_norm", "k_norm"):
            scale, offset = 0.2, 1.0
        elif leaf.startswith("b"):
            scale, offset = 0.2, 0.0
        elif leaf == "embed":
            scale, offset = embedding_scale(config), 0.0
        else:
            scale, offset = (3.0 if leaf == "lm_head" else 1.0) / float(np.sqrt(shape[0])), 0.0
        value = make(key, scale, offset, shape)
        if path[0] == "layers":
            params["layers"][path[1]][path[2]] = value
        else:
            params[path[0]] = value
    return params
