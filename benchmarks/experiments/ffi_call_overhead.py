"""Experiment (CPU or H200): what one FlashInfer FFI launch costs the host, without FlashInfer's kernels.

Times jitted steps of 8 calls each (has_side_effect, so none is merged), on tiny arrays, per call:
  * "xla op": one XLA add (the step's own cost per op);
  * "ffi direct": an XLA FFI call (jax-tvm-ffi) of a C++ no-op built with tvm-ffi, taking (q, k, v, out, lse);
  * "ffi launcher": the FFI launch as FlashInferBackend(launch="ffi") does it (`FfiLauncher`: the C++ replay of a
    wrapper's recorded run() call), whose module function is the same C++ no-op;
  * "ffi launcher, python callback": the same through the Python callback (`FfiLauncher(native=False)`).
The difference between the last two is the Python callback's share; the second's is jax-tvm-ffi's and XLA's.
Needs jax-tvm-ffi and a C++ compiler (tvm_ffi.cpp.load_inline). Writes $OUT/ffi_call_overhead.json.

Measured on CPU (2 cores, 2026-12-04, best of 5): xla op 1.8 us, ffi direct 13.6 us, ffi launcher (then the Python
callback) 16.3-17.9 us: the callback adds ~3 us; jax-tvm-ffi's call path is most of a launch's host cost. A C++
replay measured 16.9-17.3 us that day and was not kept then; the one kept since (2026-12-05) measured 13.3 us against
ffi direct's 13.4, and, what matters more, needs no GIL: beside a busy Python thread a step of 8 callback launches
took 50 ms against 13 ms for C++ FFI calls (the callbacks wait for the GIL, CPU).
"""
import os
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax_tvm_ffi  # noqa: E402
import numpy as np  # noqa: E402
import tvm_ffi.cpp  # noqa: E402

from variant_timing import write_record  # noqa: E402  (this folder: the script's own directory)
from jaxattn.backends.flashinfer_ffi import FfiLauncher  # noqa: E402

NOOP = tvm_ffi.cpp.load_inline("jaxattn_ffi_overhead_noop", cpp_sources=r"""
#include <tvm/ffi/any.h>
#include <tvm/ffi/container/tensor.h>
namespace ffi = tvm::ffi;
void direct(ffi::TensorView q, ffi::TensorView k, ffi::TensorView v, ffi::TensorView out, ffi::TensorView lse) {}
void replayed(ffi::Any workspace, ffi::Any plan_info, ffi::TensorView q, ffi::TensorView k, ffi::TensorView v,
              ffi::TensorView out, ffi::TensorView lse) {}
""", functions=["direct", "replayed"])
PLATFORM = "gpu" if jax.default_backend() in ("gpu", "cuda") else "cpu"


class NoopWrapper:
    """Shaped like a planned FlashInfer wrapper whose module function is the C++ no-op."""

    def __init__(self):
        self._cached_module = types.SimpleNamespace(run=NOOP.replayed)
        self._plan_info = [1, 2]
        self.workspace = np.zeros(4, np.float32)

    def run(self, q, paged_kv_cache, *, out, lse, return_lse, k_scale=None):
        k, v = paged_kv_cache
        self._cached_module.run(self.workspace, self._plan_info, q, k, v, out, lse)


def host_placeholders(q_shape, q_dtype, k_shape, v_shape, kv_dtype, page_size=1, variant_shapes=()):
    return (np.zeros((1, *q_shape[1:]), np.float32), np.zeros((1, page_size, *k_shape[1:]), np.float32),
            np.zeros((1, page_size, *v_shape[1:]), np.float32), np.zeros((1, q_shape[1], v_shape[2]), np.float32),
            np.zeros((1, q_shape[1]), np.float32))


def per_call_us(step, *operands, calls=8, steps=200, rounds=5) -> float:
    jax.block_until_ready(step(*operands))
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            result = step(*operands)
        jax.block_until_ready(result)
        best = min(best, (time.perf_counter() - start) / steps / calls * 1e6)
    return best


q, k_pool, v_pool = jnp.ones((8, 2, 4)), jnp.ones((16, 1, 4)), jnp.ones((16, 1, 4))
out_shape = (jax.ShapeDtypeStruct((8, 2, 4), jnp.float32), jax.ShapeDtypeStruct((8, 2), jnp.float32))
jax_tvm_ffi.register_ffi_target("jaxattn_ffi_overhead_direct", NOOP.direct, arg_spec=["args", "rets"],
                                platform=PLATFORM)
launcher = FfiLauncher(platform=PLATFORM, placeholders=host_placeholders)
callback_launcher = FfiLauncher(platform=PLATFORM, placeholders=host_placeholders, native=False)
wrapper = NoopWrapper()
steps = {
    "xla op": jax.jit(lambda q, k, v: [q + i for i in range(8)]),
    "ffi direct": jax.jit(lambda q, k, v: [jax.ffi.ffi_call("jaxattn_ffi_overhead_direct", out_shape,
                                                            has_side_effect=True)(q, k, v)[0] for _ in range(8)]),
    "ffi launcher": jax.jit(lambda q, k, v: [launcher.run(wrapper, q, k, v, 4, has_side_effect=True)[0]
                                             for _ in range(8)]),
    "ffi launcher, python callback": jax.jit(lambda q, k, v: [
        callback_launcher.run(wrapper, q, k, v, 4, has_side_effect=True)[0] for _ in range(8)]),
}
rows = []
for label, step in steps.items():
    us = per_call_us(step, q, k_pool, v_pool)
    rows.append(dict(variant=label, us_per_call=round(us, 2), platform=PLATFORM))
    print(f"{label:30s} {us:6.1f} us per call", flush=True)
write_record(os.path.join(os.environ.get("OUT", "/tmp"), "ffi_call_overhead.json"), rows)
