"""The one timing method for every backend: N back-to-back calls, one synchronisation, the median over repeats."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable


def time_calls(fn: Callable[[], object], sync: Callable[[object], None], *, target_ms: float = 30.0, repeats: int = 9,
               warmup: int = 3) -> float:
    """Median milliseconds per call of `fn`, called back to back about `target_ms` per repeat, then synchronised."""
    for _ in range(warmup):
        sync(fn())
    start = time.perf_counter()
    sync(fn())
    estimate_ms = (time.perf_counter() - start) * 1e3
    calls = int(min(200, max(5, target_ms / max(estimate_ms, 1e-3))))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            result = fn()
        sync(result)
        samples.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(samples) / getattr(fn, "calls", 1)


@dataclasses.dataclass
class PerCall:
    """A callable that runs `calls` kernel calls at once; time_calls reports the time per kernel call."""

    fn: Callable[[], object]
    calls: int

    def __call__(self):
        return self.fn()


def jax_sync(x):
    import jax

    jax.block_until_ready(x)


def torch_sync(_):
    import torch

    torch.cuda.synchronize()
