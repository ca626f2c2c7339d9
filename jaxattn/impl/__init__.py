"""Implementations of jaxattn's ops, one module per kernel family; the ops (`jaxattn.decode`, `jaxattn.extend`) pick
among them through `jaxattn.registry`."""
