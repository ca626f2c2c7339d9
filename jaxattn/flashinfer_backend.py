"""Earlier import path of `jaxattn.backends.flashinfer` (re-exported)."""

from jaxattn.backends.flashinfer import (  # noqa: F401
    FlashInferBackend,
    FlashInferMetadata,
    bridged_run,
    plan_arguments,
    should_use_tensor_cores,
    token_valid,
)
