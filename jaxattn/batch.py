"""Earlier import path of `jaxattn.serving.batch` (re-exported)."""

from jaxattn.serving.batch import ForwardBatch, ForwardMode, tree_mask_for_verify  # noqa: F401
