"""The Hopper Mosaic GPU extend kernel's direct entries; it lives in `jaxattn.impl.mgpu_extend` (re-exported here, its
earlier import path). `jaxattn.extend.extend_attention` picks it by itself where it applies."""

from jaxattn.impl.mgpu_extend import (  # noqa: F401
    MGPU_DTYPES,
    MGPU_HEAD_DIMS,
    extend_attention_mgpu,
    extend_attention_unified_mgpu,
    mgpu_unsupported,
    unified_window_on_full_lists,
)
from jaxattn.tuning import MgpuExtendConfig  # noqa: F401
