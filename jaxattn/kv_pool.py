"""Earlier import path of `jaxattn.serving.kv_pool` (re-exported)."""

from jaxattn.serving.kv_pool import (  # noqa: F401
    BUFFER_DTYPES,
    FP8_DTYPES,
    allocate_kv_buffers,
    allocate_kv_pool,
    check_write_slots,
    is_fp8,
    read_scaled,
    write_kv,
)
