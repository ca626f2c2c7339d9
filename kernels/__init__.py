"""Triton kernel sources of jaxattn (installed as `jaxattn.kernels`). No JAX imports here."""
