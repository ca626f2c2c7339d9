"""jaxattn: SGLang's LLM-serving attention layer for JAX, on Triton kernels."""
