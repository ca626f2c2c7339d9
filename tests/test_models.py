"""jaxattn.models: Hugging Face checkpoints (tiny random ones in the HF layout) loaded and served through a backend.

(a) the paged path (prefill with a prefix-cache hit, then decode) equals dense recomputation at every position,
(b) the loader's errors, (c) RoPE's llama3 scaling against an independent transcription of transformers' formula,
(d) the sliding-window mapping (HF's S keys -> jaxattn W = S - 1).
"""

import json
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxattn.backends import ReferenceBackend
from jaxattn.models import LlamaConfig, dense_logits, forward, init_kv_cache, load_hf_checkpoint, load_params
from jaxattn.models.llama import hf_tensor_names, rope_inv_freq
from jaxattn.models.safetensors_io import read_builtin, write_builtin, read_safetensors
from jaxattn.models.testing import hf_config, random_tensors, write_random_checkpoint
from jaxattn.serving import ForwardMode, RequestTable, SlotAllocator

NUM_SLOTS, MAX_REQS, MAX_CTX = 128, 6, 40
EXTEND = dict(batch_bucket=4, token_bucket=48, max_extend_len=24, kv_capacity=4 * MAX_CTX, max_seq_len=MAX_CTX)
DECODE = dict(batch_bucket=4, token_bucket=4, max_extend_len=1, kv_capacity=4 * MAX_CTX, max_seq_len=MAX_CTX)

CHECKPOINTS = {  # name: (preset, overrides, shards)
    "llama3": ("llama", None, 1),
    "qwen3-sharded": ("qwen3", None, 2),
    "qwen2-window": ("qwen2", None, 1),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for name, (preset, overrides, shards) in CHECKPOINTS.items():
        out[name] = str(root / name)
        write_random_checkpoint(out[name], preset, overrides, seed=len(name), shards=shards)
    return out


def serve(config, params, backend, rng, decode_steps=3):
    """System prompt prefilled, then 3 requests (2 sharing its cached slots) prefilled and decoded greedily.

    Returns [(tokens, {position: logits})] per request."""
    cache = init_kv_cache(config, NUM_SLOTS, jnp.float32)
    table = RequestTable(MAX_REQS, MAX_CTX, SlotAllocator(NUM_SLOTS, seed=int(rng.integers(1 << 30))))
    step = jax.jit(lambda params, cache, batch, r2t, ids: forward(params, config, backend, batch, r2t, cache, ids), donate_argnums=1)
    vocab = config.vocab_size

    def run(requests, counts, buckets, mode):
        nonlocal cache
        batch, ids = table.schedule(requests, counts, mode=mode, **buckets)
        logits, cache = step(params, cache, batch, jnp.asarray(table.req_to_token), ids)
        return np.asarray(logits.astype(jnp.float32))

    system = [int(t) for t in rng.integers(0, vocab, 10)]
    owner = table.add(system)
    run([owner], [len(system)], EXTEND, ForwardMode.EXTEND)
    prompts = [system + [int(t) for t in rng.integers(0, vocab, 7)], system + [int(t) for t in rng.integers(0, vocab, 12)],
               [int(t) for t in rng.integers(0, vocab, 9)]]
    requests = [table.add(prompts[0], shared_prefix_from=owner, shared_len=len(system)),
                table.add(prompts[1], shared_prefix_from=owner, shared_len=len(system)), table.add(prompts[2])]
    assert [r.cached for r in requests] == [10, 10, 0]  # the prefix-cache hit: the system prompt is not recomputed
    seen = [dict() for _ in requests]
    starts = [r.cached for r in requests]
    counts = [len(p) - r.cached for p, r in zip(prompts, requests)]
    logits = run(requests, counts, EXTEND, ForwardMode.EXTEND)
    row = 0
    for b, (start, n) in enumerate(zip(starts, counts)):
        for j in range(n):
            seen[b][start + j] = logits[row + j]
        row += n
        requests[b].tokens.append(int(np.argmax(logits[row - 1])))
    for _ in range(decode_steps):
        positions = [len(r.tokens) - 1 for r in requests]
        logits = run(requests, [1] * len(requests), DECODE, ForwardMode.DECODE)
        for b, r in enumerate(requests):
            seen[b][positions[b]] = logits[b]
            r.tokens.append(int(np.argmax(logits[b])))
    return [(r.tokens[:-1], s) for r, s in zip(requests, seen)]


def check_against_dense(config, params, served, atol):
    dense = jax.jit(lambda ids: dense_logits(params, config, ids))
    for tokens, seen in served:
        padded = np.zeros(MAX_CTX, np.int32)  # one compile for every length (causal: the padding changes nothing before it)
        padded[: len(tokens)] = tokens
        want = np.asarray(dense(jnp.asarray(padded)).astype(jnp.float32))
        assert max(seen) == len(tokens) - 1
        for position, got in seen.items():
            np.testing.assert_allclose(got, want[position], atol=atol, rtol=atol, err_msg=f"position {position}")


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_paged_reference_path_equals_dense_at_every_position(checkpoints, name, rng):
    config, params = load_hf_checkpoint(checkpoints[name], jnp.float32)
    served = serve(config, params, ReferenceBackend(), rng)
    check_against_dense(config, params, served, atol=2e-4)


def test_loaded_configs_have_each_familys_features(checkpoints):
    llama, _ = load_hf_checkpoint(checkpoints["llama3"], jnp.float32)
    qwen3, qwen3_params = load_hf_checkpoint(checkpoints["qwen3-sharded"], jnp.float32)
    qwen2, qwen2_params = load_hf_checkpoint(checkpoints["qwen2-window"], jnp.float32)
    assert dict(llama.rope_scaling)["rope_type"] == "llama3" and llama.num_heads != llama.num_kv_heads
    assert qwen3.qk_norm and qwen3.tie_word_embeddings and "lm_head" not in qwen3_params
    assert qwen3.head_dim * qwen3.num_heads != qwen3.hidden_size  # head_dim given explicitly
    assert os.path.exists(os.path.join(checkpoints["qwen3-sharded"], "model.safetensors.index.json"))
    assert qwen2.qkv_bias and not qwen2.o_bias and "bq" in qwen2_params["layers"][0]
    assert qwen2.windows == (-1, 5)  # HF sliding_window=6 keys on layers >= max_window_layers=1 -> W = 5


def test_bf16_load_keeps_the_checkpoints_values(checkpoints):
    config, params = load_hf_checkpoint(checkpoints["llama3"])  # bf16 by default
    assert params["embed"].dtype == jnp.bfloat16
    tensors = read_safetensors(os.path.join(checkpoints["llama3"], "model.safetensors"))
    np.testing.assert_array_equal(np.asarray(params["layers"][1]["wq"]), tensors["model.layers.1.self_attn.q_proj.weight"].T)
    logits = dense_logits(params, config, jnp.arange(12) % config.vocab_size)
    assert logits.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(logits)))


def test_triton_backend_interpreted_prefill_equals_dense(tmp_path, rng):
    from jaxattn.backends import TritonBackend

    # One window layer (Qwen2 S = 6 -> W = 5): the two-stage extend kernel over the shared prefix, trimmed lists.
    write_random_checkpoint(tmp_path, "qwen2", {"num_hidden_layers": 1, "max_window_layers": 0}, seed=3)
    config, params = load_hf_checkpoint(tmp_path, jnp.float32)
    assert config.windows == (5,)
    served = serve(config, params, TritonBackend(sliding_windows=config.sliding_windows), rng, decode_steps=1)
    check_against_dense(config, params, served, atol=2e-4)


# Real-shape presets shrunk for CPU: their attention shapes (hidden 2048, the heads, head dims 64 / 128), 2 layers, a
# small vocab and MLP.
SHRUNK = {"num_hidden_layers": 2, "vocab_size": 512, "intermediate_size": 2048}


def test_real_shape_presets_have_the_real_configs():
    llama = LlamaConfig.from_hf(hf_config("llama3-1b"))  # Llama-3.2-1B
    assert (llama.hidden_size, llama.num_layers, llama.num_heads, llama.num_kv_heads, llama.head_dim) == (2048, 16, 32, 8, 64)
    assert (llama.intermediate_size, llama.vocab_size, llama.rope_theta) == (8192, 128256, 500000.0)
    assert dict(llama.rope_scaling) == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192.0}
    assert llama.tie_word_embeddings and "lm_head.weight" not in hf_tensor_names(llama)
    assert round(llama.num_params() / 1e6) == 1236
    qwen = LlamaConfig.from_hf(hf_config("qwen3-1.7b"))  # Qwen3-1.7B
    assert (qwen.hidden_size, qwen.num_layers, qwen.num_heads, qwen.num_kv_heads, qwen.head_dim) == (2048, 28, 16, 8, 128)
    assert (qwen.intermediate_size, qwen.vocab_size, qwen.rope_theta, qwen.rope_scaling) == (6144, 151936, 1e6, ())
    assert qwen.qk_norm and qwen.tie_word_embeddings and qwen.windows == ()
    assert round(qwen.num_params() / 1e6) == 1721


def test_tied_random_embeddings_do_not_make_the_current_token_the_argmax():
    # At unit scale a tied embedding makes the current token the argmax at 97% of the tiny qwen3's positions (greedy
    # decoding then repeats it); testing.embedding_scale shrinks it to lm_head-like logits.
    config = LlamaConfig.from_hf(hf_config("qwen3"))
    params = load_params(config, random_tensors(config, seed=1, dtype=np.float32), jnp.float32)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, 64)
    logits = np.asarray(dense_logits(params, config, jnp.asarray(ids)))
    assert np.mean(np.argmax(logits, axis=-1) == ids) < 0.25
    assert 0.5 < np.std(logits) < 2.0  # logits ~N(0, 1)


@pytest.mark.parametrize("preset", ["llama3-1b", "qwen3-1.7b"])
def test_real_shape_presets_shrunk_serve_like_dense(tmp_path, preset, rng):
    hf = write_random_checkpoint(tmp_path, preset, SHRUNK)
    assert hf["tie_word_embeddings"] and hf["hidden_size"] == 2048
    tensors = read_safetensors(os.path.join(tmp_path, "model.safetensors"))
    assert "lm_head.weight" not in tensors  # tied: transformers ties lm_head to the embedding, as the loader does
    config, params = load_hf_checkpoint(tmp_path, jnp.float32)
    assert config.tie_word_embeddings and "lm_head" not in params and config.num_layers == 2
    served = serve(config, params, ReferenceBackend(), rng, decode_steps=2)
    check_against_dense(config, params, served, atol=2e-4)


# ------------------------------------------------------------------------------------------- (b) loader errors

def _tensors(preset="llama", overrides=None):
    config = LlamaConfig.from_hf(hf_config(preset, overrides))
    return config, random_tensors(config, seed=0, dtype=np.float32)


def test_missing_tensor_is_named():
    config, tensors = _tensors()
    del tensors["model.layers.2.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensor\(s\): model\.layers\.2\.mlp\.up_proj\.weight"):
        load_params(config, tensors)


def test_unexpected_tensor_is_named():
    config, tensors = _tensors()
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)  # Llama without attention_bias
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\): model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_params(config, tensors)


def test_wrong_shape_is_named():
    config, tensors = _tensors()
    tensors["model.norm.weight"] = np.zeros(65, np.float32)
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(65,\)"):
        load_params(config, tensors)


def test_tied_checkpoint_may_store_lm_head_and_old_rope_buffers_are_ignored():
    config, tensors = _tensors("qwen3")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(16, np.float32)
    assert "lm_head" not in load_params(config, tensors, jnp.float32)


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_scaling type 'yarn'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "unsupported rope_scaling type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 is missing low_freq_factor"),
    ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
    ({"model_type": "qwen3_moe"}, "mixture-of-experts"),
    ({"num_local_experts": 8}, "mixture-of-experts"),
    ({"hidden_size": None}, "missing required field.*hidden_size"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_unsupported_configs_raise(change, message):
    hf = hf_config("llama")
    hf.update(change)
    if hf["hidden_size"] is None:
        del hf["hidden_size"]
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf(hf)


def test_checkpoint_directory_errors(tmp_path):
    with pytest.raises(ValueError, match="not a local directory"):
        load_hf_checkpoint(tmp_path / "absent")
    with pytest.raises(ValueError, match="no config.json"):
        load_hf_checkpoint(tmp_path)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(hf_config("llama"), f)
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load_hf_checkpoint(tmp_path)


def test_builtin_safetensors_reader_and_writer_agree_with_the_package(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.numpy import load_file, save_file

    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16), "b": np.arange(5, dtype=np.int32)}
    save_file(tensors, str(tmp_path / "pkg.safetensors"))
    for name, value in read_builtin(tmp_path / "pkg.safetensors").items():
        np.testing.assert_array_equal(value, tensors[name])
    write_builtin(tmp_path / "own.safetensors", tensors, metadata={"format": "pt"})
    loaded = load_file(str(tmp_path / "own.safetensors"))
    for name, value in tensors.items():
        np.testing.assert_array_equal(loaded[name], value)


# ------------------------------------------------------------------------------------------- (c) RoPE scaling

def _llama3_by_hand(head_dim, theta, factor, low, high, old):
    """transformers' _compute_llama3_parameters, one frequency at a time, in float64 (an independent transcription)."""
    out = []
    for i in range(head_dim // 2):
        freq = 1.0 / theta ** (2 * i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(freq)  # high frequency: unchanged
        elif wavelen > old / low:
            out.append(freq / factor)  # low frequency: divided by the factor
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


@pytest.mark.parametrize("head_dim, theta, factor, low, high, old", [
    (128, 500000.0, 8.0, 1.0, 4.0, 8192),  # Llama-3.1-8B
    (64, 500000.0, 32.0, 1.0, 4.0, 8192),  # Llama-3.2-1B
    (16, 500000.0, 8.0, 1.0, 4.0, 64),  # the tiny preset
])
def test_llama3_rope_scaling_matches_an_independent_transcription(head_dim, theta, factor, low, high, old):
    scaling = dict(rope_type="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                   original_max_position_embeddings=old)
    got = rope_inv_freq(head_dim, theta, scaling)
    want = _llama3_by_hand(head_dim, theta, factor, low, high, old)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-6)
    wavelen = 2 * math.pi / (1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim))
    assert (wavelen < old / high).any() and (wavelen > old / low).any()  # both ends; the tiny preset has all three
    if head_dim == 16:
        assert ((wavelen >= old / high) & (wavelen <= old / low)).any()


def test_linear_and_default_rope():
    default = rope_inv_freq(32, 10000.0, {})
    np.testing.assert_allclose(default, 1.0 / 10000.0 ** (np.arange(0, 32, 2) / 32), rtol=2e-6)
    np.testing.assert_allclose(rope_inv_freq(32, 10000.0, {"rope_type": "linear", "factor": 4.0}), default / 4, rtol=1e-7)
    hf = hf_config("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}})
    assert dict(LlamaConfig.from_hf(hf).rope_scaling) == {"rope_type": "linear", "factor": 2.0}
    hf = hf_config("llama", {"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}})
    assert LlamaConfig.from_hf(hf).rope_theta == 7.0 and LlamaConfig.from_hf(hf).rope_scaling == ()


# ------------------------------------------------------------------------------------------- (d) windows

@pytest.mark.parametrize("preset, change, windows", [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}, (-1, 5)),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 6, "max_window_layers": 0}, ()),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}, (3, -1)),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 1, "max_window_layers": 0}, (0, 0)),
    ("llama", {"model_type": "mistral", "sliding_window": 8}, (7, 7, 7)),
    ("llama", {"model_type": "mistral", "sliding_window": None}, ()),
    ("llama", {"sliding_window": 8}, ()),  # Llama has no window (transformers ignores the field)
])
def test_hf_window_of_s_keys_maps_to_jaxattn_w_equal_s_minus_1(preset, change, windows):
    config = LlamaConfig.from_hf(hf_config(preset, change))
    assert config.windows == windows
    for i, w in enumerate(windows):
        layer = config.attention_layer(i)
        assert layer.sliding_window == w
        if w >= 0:  # jaxattn keeps keys with q_pos - k_pos <= W: W + 1 = S keys, HF's count
            assert w + 1 == change["sliding_window"]
