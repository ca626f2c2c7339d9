"""Earlier import path of `jaxattn.backends.triton` (re-exported)."""

from jaxattn.backends.triton import DraftDecodeMetadata, TritonBackend, TritonMetadata, draft_decode_metadata  # noqa: F401
