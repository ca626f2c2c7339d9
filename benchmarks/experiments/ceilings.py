"""Measure this GPU's ceilings the benchmark's floors use: device-to-device copy (bytes read + written per second)
and bf16 matmul (FLOP/s), and beside them a read-only pass (bytes read per second), as medians over timed repetitions
of jitted JAX calls, on random data; where torch is installed, also torch's memcpy (`copy_`) and row sum, timed with CUDA
events. XLA's elementwise pass and reduction fall short of the memory on the H100 (2.5-2.6 / 2.3-2.5 TB/s against
torch's 3.0 / 3.0, 2026-12-05), so `jaxattn.bench.cases.CEILINGS` takes the best copy measured.

Usage: python3 benchmarks/experiments/ceilings.py [--json PATH]
"""
import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def median_seconds(fn, arg, reps=50):
    out = fn(arg)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        out = fn(arg)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def torch_rates(elements: int = 1 << 30, reps: int = 30):
    """(memcpy bytes read + written per second, row-sum bytes read per second) of 2 GiB of bf16 through torch, or None
    without torch or a CUDA device. Needs XLA_PYTHON_CLIENT_PREALLOCATE=false (scripts/gpu_env.sh sets it) so that
    JAX leaves torch the 4 GiB."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    x = torch.randn(elements, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)

    def median(fn):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return float(np.median(times))

    nbytes = x.numel() * x.element_size()
    copy = 2 * nbytes / median(lambda: y.copy_(x))
    read = nbytes / median(lambda: x.view(-1, 4096).sum(dim=1, dtype=torch.float32))
    return copy, read


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    key = jax.random.key(0)
    # 2 GiB of bf16: large enough that launch overhead is < 0.1% of the copy.
    x = jax.random.normal(key, (1 << 30,), jnp.bfloat16)
    copy = jax.jit(lambda a: a * jnp.bfloat16(1.0001))  # an elementwise pass: one read, one write per element
    copy_s = median_seconds(copy, x)
    copy_bw = 2 * x.nbytes / copy_s
    # A read-only pass (decode reads far more than it writes): a sum over rows of 4096, f32 accumulation.
    read = jax.jit(lambda a: jnp.sum(a.reshape(-1, 4096), axis=1, dtype=jnp.float32))
    read_s = median_seconds(read, x)
    read_bw = x.nbytes / read_s
    del x
    n = 8192
    a = jax.random.normal(key, (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    matmul = jax.jit(lambda p: p[0] @ p[1])
    mm_s = median_seconds(matmul, (a, b))
    flops = 2 * n**3 / mm_s
    record = {
        "device": jax.devices()[0].device_kind,
        "copy_bytes_per_s": copy_bw,
        "read_bytes_per_s": read_bw,
        "bf16_matmul_flops": flops,
    }
    print(f"{record['device']}: copy {copy_bw / 1e12:.2f} TB/s (read + write), read {read_bw / 1e12:.2f} TB/s, "
          f"bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    del a, b
    rates = torch_rates()
    if rates is not None:
        record["torch_copy_bytes_per_s"], record["torch_read_bytes_per_s"] = rates
        print(f"torch: memcpy {rates[0] / 1e12:.2f} TB/s (read + write), row sum {rates[1] / 1e12:.2f} TB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
