"""FlashInfer's run() inside `jax.jit` as an XLA FFI call (jax-tvm-ffi), without torch on the launch path.

    launcher = FfiLauncher()
    o, lse2 = launcher.run(wrapper, q, k_pool, v_pool, v_head_dim)   # inside jit; wrapper planned on the host

`plan()` stays on the host with torch, as for `bridged_run`. FlashInfer's kernels are tvm-ffi functions; jax-tvm-ffi
registers a function as an XLA FFI target and, per call, hands it XLA's buffers as tvm-ffi tensors with XLA's
stream set as tvm-ffi's current stream (which the kernels launch on). The registered function is a small Python
callback, not the module function itself, for two reasons (jax-tvm-ffi 0.1.3, src/jax_tvm_ffi.cc):
  * its arg_spec places all operands as one block ("args"), all results as one block ("rets") and attributes; the
    module's run takes tensors at positions 0-1, 3-10 and 14 between non-tensor arguments (flashinfer 0.6.0
    decode.py BatchDecodeWithPagedKVCacheWrapper.run, run_args), which no arg_spec can express;
  * attributes are compile-time constants, and plan_info (and the plan's index buffers) change at every plan():
    as attributes every new plan would be a new executable.
So the callback calls the module's run with the argument list the planned wrapper's own run() would pass, with
XLA's q, K, V, out and lse in it. That list is recorded from `wrapper.run` itself (with the module replaced by a
recorder, on placeholder tensors) rather than rebuilt here, and recorded again whenever the wrapper has been
re-planned (a new `plan_info` object), so a step jitted once keeps serving new plans, as with `bridged_run`.

Memory: XLA owns q, K, V (read only) and out, lse (results); the workspaces and the plan's index buffers stay the
wrapper's torch tensors, passed as tvm-ffi views made once per plan (not XLA operands, so XLA's assumption that
operands are immutable is not touched). plan() fills them with host->device copies on torch's stream: synchronise
after plan() and before the step (FlashInferBackend.plan does). Not CUDA-graph safe (the callback reads the current
plan), so the target is registered without the command-buffer trait and XLA launches it eagerly.

jax-tvm-ffi and apache-tvm-ffi are imported only when a launcher is made; `choose_launch` picks this path only when
asked (`FlashInferBackend(launch="ffi")` or $JAXATTN_FLASHINFER_LAUNCH=ffi) and says why it is not the default.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import jax
import jax.numpy as jnp

FFI_FLASHINFER_VERSION = "0.6."  # the releases whose run() calls the FFI launch records and replays
LAUNCH_ENV = "JAXATTN_FLASHINFER_LAUNCH"  # "ffi" | "bridge" (default; "auto" is "bridge")
LAUNCHES = ("ffi", "bridge")


def ffi_available() -> bool:
    """Whether jax-tvm-ffi (and the apache-tvm-ffi it needs) can be imported."""
    try:
        import jax_tvm_ffi  # noqa: F401
        import tvm_ffi  # noqa: F401
    except ImportError:
        return False
    return True


def choose_launch(requested: str | None = None, *, available: bool | None = None) -> str:
    """The launch path, "ffi" or "bridge": `requested`, else $JAXATTN_FLASHINFER_LAUNCH, else "bridge".

    The FFI launch is opt-in, also where jax-tvm-ffi is installed: on the H200 (55e003d) its paged-prefill output had
    non-zero padding rows in one of four GPU cases, and it was no closer to torch-launched FlashInfer than the bridge
    at D1-D3 (records 2026-12-03_h200_flashinfer_ffi_11e9d5a.*). Not diagnosed: flashinfer 0.6.0's fa2 and fa3
    epilogues write no row past qo_indptr[-1] (prefill.cuh, hopper/epilogue.cuh), and the backend zeroes those rows
    after the call, so the values came from outside the kernels (an ordering race between the launch's stream and
    XLA's is the first suspect: `benchmarks/experiments/ffi_padding_rows.py` tests it). Asking for "ffi" without the
    wheel raises ImportError naming it."""
    requested = requested or os.environ.get(LAUNCH_ENV) or "bridge"
    if requested == "auto":
        return "bridge"
    if requested not in LAUNCHES:
        raise ValueError(f"FlashInfer launch {requested!r}: expected one of {LAUNCHES} or 'auto' "
                         f"(from the argument or ${LAUNCH_ENV})")
    if requested == "ffi" and not (ffi_available() if available is None else available):  # imported only if asked
        raise ImportError("the FlashInfer FFI launch needs jax-tvm-ffi (pip install 'jaxattn[flashinfer-ffi]': "
                          "jax-tvm-ffi 0.1.3 with apache-tvm-ffi); launch='bridge' runs FlashInfer through "
                          "jax.experimental.buffer_callback instead")
    return requested


# ---------------------------------------------------------------------------------------------
# The recorded argument list (pure Python: testable without a GPU).


class _Recorder:
    """Stands in for a wrapper's `_cached_module`: records the one call its run() makes instead of launching it."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.calls.append((name, args, kwargs))

        return record


def record_run_call(wrapper, q, k, v, out, lse, *, k_scale=None, variant_args=()):
    """(name of the module function, its positional arguments) that `wrapper.run` calls for these tensors.

    The wrapper's `_cached_module` (FlashInfer's JIT module, set by plan()) is swapped for a recorder for the call,
    so nothing is launched. k, v: [pages, page_size, kv_heads, head_dim] (NHD). variant_args: a variant wrapper's
    extra run() arguments (`jaxattn.backends.flashinfer.bridged_run`), tensors among them as placeholders.
    """
    module = wrapper._cached_module
    recorder = _Recorder()
    wrapper._cached_module = recorder
    try:
        wrapper.run(q, (k, v), *variant_args, out=out, lse=lse, return_lse=True, k_scale=k_scale)
    finally:
        wrapper._cached_module = module
    if len(recorder.calls) != 1 or recorder.calls[0][2]:
        raise RuntimeError(f"FlashInfer FFI launch: expected run() to make one positional call into its module, got "
                           f"{[(name, len(args), sorted(kwargs)) for name, args, kwargs in recorder.calls]}")
    name, args, _ = recorder.calls[0]
    return name, args


@dataclasses.dataclass(frozen=True)
class Operand:
    """Marks where XLA's operand number `index` (q, k, v, out, lse, then a variant's tensors) goes in a call
    template."""

    index: int


def call_template(args, operands, convert=lambda x: x) -> tuple:
    """The recorded arguments with each of `operands` (found by identity, also inside tuples) replaced by its
    `Operand(i)` and every other argument passed through `convert` (tvm-ffi views of torch tensors, made once)."""

    def item(arg):
        for i, operand in enumerate(operands):
            if arg is operand:
                return Operand(i)
        if isinstance(arg, tuple):
            return tuple(item(a) for a in arg)
        return convert(arg)

    template = tuple(item(arg) for arg in args)
    missing = [i for i in range(len(operands)) if not _uses(template, i)]
    if missing:
        raise RuntimeError(f"FlashInfer FFI launch: operands {missing} (of q, k, v, out, lse and a variant's tensors) "
                           "are not in the run call")
    return template


def _uses(template, index) -> bool:
    return any(_uses(a, index) if type(a) is tuple else type(a) is Operand and a.index == index for a in template)


def fill_template(template, operands) -> list:
    """The call's arguments: `template` with XLA's tensors in place of its Operand markers (tuples stay tuples)."""
    return [operands[a.index] if type(a) is Operand else tuple(fill_template(a, operands)) if type(a) is tuple else a
            for a in template]


def tvm_ffi_view(arg):
    """An argument as the kernels' call should receive it: tensors as tvm-ffi tensors (views, no copy) so that the
    call does not switch tvm-ffi's stream to torch's current one (it does for torch tensors, tvm_ffi
    cython/function.pxi TVMFFIPyArgSetterTorchFallback_), tvm-ffi arrays rebuilt (plan_info came from a call on torch
    tensors and carries torch's exchange hook), everything else as is."""
    import tvm_ffi

    if isinstance(arg, tvm_ffi.Tensor):
        return arg
    if hasattr(arg, "__dlpack__"):
        return tvm_ffi.from_dlpack(arg)
    if isinstance(arg, tvm_ffi.Array):
        return tvm_ffi.convert(list(arg))
    return arg


# ---------------------------------------------------------------------------------------------
# The FFI target of one planned wrapper.


def torch_placeholders(q_shape, q_dtype, k_shape, v_shape, kv_dtype, page_size: int = 1, variant_shapes=()):
    """(q, k, v, out, lse, *variant tensors) torch tensors of one token and one page for recording run(): the right
    dtypes, heads, head dims and page size (run() may read the page size from the cache's shape), one element of
    storage each (expanded), never read or written. variant_shapes: ((shape, dtype), ...) of a variant's tensors."""
    import torch

    def torch_dtype(dtype):
        return getattr(torch, jnp.dtype(dtype).name)

    def empty(shape, dtype):
        return torch.empty(1, dtype=dtype, device="cuda").expand(*shape)

    q_heads, head_dim = q_shape[1:]
    kv_heads, v_head_dim = v_shape[1:]
    q_t, kv_t = torch_dtype(q_dtype), torch_dtype(kv_dtype)
    return (empty((1, q_heads, head_dim), q_t), empty((1, page_size, kv_heads, k_shape[2]), kv_t),
            empty((1, page_size, kv_heads, v_head_dim), kv_t), empty((1, q_heads, v_head_dim), q_t),
            empty((1, q_heads), torch.float32), *(empty(shape, torch_dtype(dtype)) for shape, dtype in variant_shapes))


def result_shapes(q, v_head_dim: int) -> tuple:
    """What a FlashInfer launch returns for q [T, q_heads, D]: (o [T, q_heads, v_head_dim] in q's dtype, base-2 lse
    f32[T, q_heads]) as ShapeDtypeStructs."""
    return (jax.ShapeDtypeStruct((q.shape[0], q.shape[1], v_head_dim), q.dtype),
            jax.ShapeDtypeStruct((q.shape[0], q.shape[1]), jnp.float32))


_target_numbers = itertools.count()


class FfiRun:
    """One XLA FFI target running one planned wrapper for fixed head shapes, dtypes and k_scale.

    The target's callback gets (q, k, v, *variant tensors, out, lse) from XLA and calls the wrapper's module
    function with the argument list recorded from the wrapper's run(); it records the list again when the wrapper
    was re-planned. placeholders: the tensors run() is recorded on (q, k, v, out, lse, *variant tensors; torch on the
    GPU); variant_args: a variant's extra run() arguments with its tensors' placeholders in place; platform: "gpu",
    or "cpu" in tests.
    """

    def __init__(self, wrapper, placeholders, *, k_scale=None, variant_args=(), platform: str = "gpu"):
        import jax_tvm_ffi

        self.wrapper = wrapper
        self.placeholders = placeholders
        self.k_scale = k_scale
        self.variant_args = variant_args
        self.record()
        self.target = f"jaxattn_flashinfer_run_{next(_target_numbers)}"
        # pass_owned_tensor: XLA's buffers reach Python as tvm-ffi tensors (a Python callback needs it); no
        # allow_cuda_graph: the callback reads the current plan, so it must run at every launch.
        jax_tvm_ffi.register_ffi_target(self.target, self.callback, arg_spec=["args", "rets"], platform=platform,
                                        pass_owned_tensor=True)

    def record(self):
        name, args = record_run_call(self.wrapper, *self.placeholders[:5], k_scale=self.k_scale,
                                     variant_args=self.variant_args)
        self.function = getattr(self.wrapper._cached_module, name)
        self.template = call_template(args, self.placeholders, tvm_ffi_view)
        self.plan_info = self.wrapper._plan_info  # plan() makes a new one each time

    def callback(self, *tensors):  # XLA's operands (q, k, v, *variant tensors), then its results (out, lse)
        if self.wrapper._plan_info is not self.plan_info:
            self.record()
        q, k, v, *variant, out, lse = tensors
        self.function(*fill_template(self.template, (q, k, v, out, lse, *variant)))


class FfiLauncher:
    """Runs planned FlashInfer wrappers inside jit through XLA FFI targets, one per wrapper, head shapes and k_scale.

    `run` has `bridged_run`'s arguments and results. Call it at trace time after the wrapper's first plan().
    platform / placeholders: "gpu" and torch_placeholders; tests on CPU pass "cpu" and numpy placeholders.
    """

    def __init__(self, platform: str = "gpu", placeholders=torch_placeholders, flashinfer_version: str | None = None):
        if not ffi_available():
            choose_launch("ffi", available=False)  # raises the ImportError naming the wheel
        if flashinfer_version is not None and not flashinfer_version.startswith(FFI_FLASHINFER_VERSION):
            # 0.7 checks q's rows against the plan (the recorded placeholders have one) and its fa2 run() reads the
            # cache's torch strides (tvm-ffi tensors have none): the recorded call does not replay there.
            raise NotImplementedError(f"the FlashInfer FFI launch replays flashinfer {FFI_FLASHINFER_VERSION}x's run() "
                                      f"calls; flashinfer {flashinfer_version} is installed: use launch='bridge'")
        self.platform = platform
        self.placeholders = placeholders
        self.runs: dict = {}

    def target(self, wrapper, q, k_pool, v_pool, k_scale=None, page_size: int = 1, variant_args=()) -> FfiRun:
        # A variant's tensors by shape and dtype (XLA operands), its other arguments by value (in the template).
        variant = tuple(("tensor", a.shape, jnp.dtype(a.dtype).name) if isinstance(a, jax.Array) else ("value", a)
                        for a in variant_args)
        key = (id(wrapper), k_scale, page_size, q.shape[1:], jnp.dtype(q.dtype).name, k_pool.shape[1:],
               v_pool.shape[1:], jnp.dtype(k_pool.dtype).name, variant)
        if key not in self.runs:
            shapes = tuple((a.shape, a.dtype) for a in variant_args if isinstance(a, jax.Array))
            placeholders = self.placeholders(q.shape, q.dtype, k_pool.shape, v_pool.shape, k_pool.dtype, page_size,
                                             variant_shapes=shapes)
            stand_ins = iter(placeholders[5:])
            recorded = tuple(next(stand_ins) if isinstance(a, jax.Array) else a for a in variant_args)
            self.runs[key] = FfiRun(wrapper, placeholders, k_scale=k_scale, variant_args=recorded, platform=self.platform)
        return self.runs[key]

    def run(self, wrapper, q, k_pool, v_pool, v_head_dim: int, *, k_scale=None, v_scale=None, has_side_effect=False,
            page_size: int = 1, variant_args=()):
        """q [T, q_heads, D], k_pool [slots, kv_heads, D], v_pool [slots, kv_heads, Dv] (page-aligned rows, pages of
        page_size: the view `paged_pool_view` takes, here as a reshape) ->
        (o [T, q_heads, v_head_dim] in q's dtype, base-2 lse f32[T, q_heads]).
        has_side_effect: keep XLA from merging calls on identical inputs (the benchmark's repeated layers).
        variant_args: as `bridged_run`'s (its tensors become operands of the FFI call)."""
        target = self.target(wrapper, q, k_pool, v_pool, k_scale, page_size, variant_args)
        out_shape = result_shapes(q, v_head_dim)
        page = lambda pool: pool.reshape(pool.shape[0] // page_size, page_size, *pool.shape[1:])  # no copy  # noqa: E731
        tensors = [a for a in variant_args if isinstance(a, jax.Array)]
        o, lse = jax.ffi.ffi_call(target.target, out_shape, has_side_effect=has_side_effect)(
            q, page(k_pool), page(v_pool), *tensors)
        if v_scale is not None and v_scale != 1.0:  # FlashInfer's run() scales out after the kernel (0.6.0)
            o = (o.astype(jnp.float32) * v_scale).astype(o.dtype)
        return o, lse
