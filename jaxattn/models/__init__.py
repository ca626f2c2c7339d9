"""Real decoder models on jaxattn's backends, loaded from Hugging Face checkpoints (local directories only).

  * `jaxattn.models.llama`: Llama-3 / Mistral / Qwen2 / Qwen3 decoders: `LlamaConfig.from_hf`, `load_hf_checkpoint`,
    `forward` (one paged step through a backend and the KV pool), `dense_logits` (the no-cache oracle).
  * `jaxattn.models.safetensors_io`: safetensors files read and written with numpy (the `safetensors` package when
    installed, a small built-in reader/writer otherwise).
  * `jaxattn.models.testing`: `write_random_checkpoint`, tiny random checkpoints in the HF layout (what the tests
    and the transformers comparison load).

Needs the extra `jaxattn[models]` (safetensors, tokenizers) only for speed and tokenizers; the loader works without.
"""

from jaxattn.models.llama import LlamaConfig, dense_logits, forward, init_kv_cache, load_hf_checkpoint, load_params

__all__ = ["LlamaConfig", "load_hf_checkpoint", "load_params", "forward", "dense_logits", "init_kv_cache"]
