"""FlashInfer's run() inside `jax.jit` as an XLA FFI call (jax-tvm-ffi), without torch on the launch path.

    launcher = FfiLauncher()
    o, lse2 = launcher.run(wrapper, q, k_pool, v_pool, v_head_dim)   # inside jit; wrapper planned on the host

`plan()` stays on the host with torch, as for `bridged_run`. FlashInfer's kernels are tvm-ffi functions; jax-tvm-ffi
registers a function as an XLA FFI target and, per call, hands it XLA's buffers as tvm-ffi tensors with XLA's
stream set as tvm-ffi's current stream (which the kernels launch on). The registered function is a replay of the
recorded call, not the module function itself, for two reasons (jax-tvm-ffi 0.1.3, src/jax_tvm_ffi.cc):
  * its arg_spec places all operands as one block ("args"), all results as one block ("rets") and attributes; the
    module's run takes tensors at positions 0-1, 3-10 and 14 between non-tensor arguments (flashinfer 0.6.0
    decode.py BatchDecodeWithPagedKVCacheWrapper.run, run_args), which no arg_spec can express;
  * attributes are compile-time constants, and plan_info (and the plan's index buffers) change at every plan():
    as attributes every new plan would be a new executable.
So the replay calls the module's run with the argument list the planned wrapper's own run() would pass, with
XLA's q, K, V, out and lse in it. That list is recorded from `wrapper.run` itself (with the module replaced by a
recorder, on placeholder tensors) rather than rebuilt here, and recorded again by the wrapper's plan() (which the
launcher wraps), so a step jitted once keeps serving new plans, as with `bridged_run`. The replay is C++ by default
(`NATIVE_REPLAY_SOURCE`, compiled once per machine): a launch runs no Python and never waits for the GIL; with
`FfiLauncher(native=False)`, or a call nested deeper than one tuple, it is a Python callback.

Memory: XLA owns q, K, V (read only) and out, lse (results); the workspaces and the plan's index buffers stay the
wrapper's torch tensors, passed as tvm-ffi views made once per plan (not XLA operands, so XLA's assumption that
operands are immutable is not touched). plan() fills them with host->device copies on torch's stream: synchronise
after plan() and before the step (FlashInferBackend.plan does). Not CUDA-graph safe (a launch reads the current
plan), so the target is registered without the command-buffer trait and XLA launches it eagerly.

jax-tvm-ffi and apache-tvm-ffi are imported only when a launcher is made; `choose_launch` picks this path only when
asked (`FlashInferBackend(launch="ffi")` or $JAXATTN_FLASHINFER_LAUNCH=ffi) and says why it is not the default.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import types
import warnings

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

    The FFI launch is opt-in, also where jax-tvm-ffi is installed: no run has shown it within 1% of torch-launched
    FlashInfer at D1-D3 and E1 (records 2026-12-03_h200_flashinfer_ffi_11e9d5a.*, 2026-12-05_h100_flashinfer_clocks_*). (The non-zero rows its GPU test found at 55e003d were the test's: an extend longer than its batch's
    max_extend_len bucket, which the reference leaves uncomputed; fixed 2026-12-05.) Asking for "ffi" without the
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


def forwarded_call(function, args, is_compiled) -> tuple | None:
    """(compiled function, its positional arguments) that a Python `function` forwards `args` to, or None.

    FlashInfer 0.6's prefill modules wrap their compiled `paged_run` in a Python function (prefill.py,
    get_batch_prefill_module) that reorders the arguments, calls the compiled function held in its closure once and
    returns `o`; replaying that Python function would put the GIL back into every launch. The function is called once
    as a copy whose closure holds recorders in place of every compiled function (the original and its closure are not
    touched), and the forwarded call is taken if there was exactly one, with positional arguments only; a forwarder
    that fails without its compiled functions (it uses their results) is replayed as it is.
    is_compiled(value): whether a closure value is a compiled (tvm-ffi) function."""
    code, closure = getattr(function, "__code__", None), getattr(function, "__closure__", None)
    if code is None or not closure:
        return None
    calls = []

    def recorder(target):
        def record(*call_args, **call_kwargs):
            calls.append((target, call_args, call_kwargs))

        return record

    cells = tuple(types.CellType(recorder(cell.cell_contents)) if is_compiled(cell.cell_contents) else cell
                  for cell in closure)
    if all(new is old for new, old in zip(cells, closure)):
        return None
    copy = types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__, cells)
    copy.__kwdefaults__ = function.__kwdefaults__
    try:
        copy(*args)
    except Exception:  # noqa: BLE001  (whatever a forwarder does with a recorder's None: not a plain forwarder)
        return None
    if len(calls) != 1 or calls[0][2]:
        return None
    return calls[0][0], calls[0][1]


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

# The launch without Python (`native`): a tvm-ffi function, compiled once per machine (tvm_ffi.cpp.load_inline, a C++
# compiler; FlashInfer's own JIT needs one too), that calls the module function with the recorded arguments and
# XLA's tensors in place, so a launch never waits for the GIL. The Python callback does: XLA's thread runs it once per
# call, and while the host's Python thread holds the GIL (dispatching the next steps, scheduling) each launch waits
# for it (on CPU, beside a busy Python thread, a step of 8 launches took 50 ms against 13 ms for a C++ FFI call; the
# likely cause of the 0.5-1 ms per burst of steps that the callbacks lost on the H100, not yet measured without them).
# Recorded lists are pushed to it at every plan().
# Arguments: `fixed` holds the recorded values (None where an operand goes), `codes` says per argument where it comes
# from: -1 fixed, i >= 0 XLA's argument i, or (for a tuple, e.g. the K/V pair) an array of such codes per element.
NATIVE_REPLAY_SOURCE = r"""
#include <tvm/ffi/any.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/function.h>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace ffi = tvm::ffi;

namespace {
struct Argument {
  int64_t code = -1;                 // -1: the recorded value; >= 0: XLA's argument at this position
  std::vector<int64_t> element_codes;  // a tuple: one code per element
  bool is_tuple = false;
};

struct Replay {
  ffi::Function function;
  std::vector<ffi::Any> fixed;
  std::vector<std::vector<ffi::Any>> fixed_elements;
  std::vector<Argument> arguments;
};

// Never freed: at exit a static map's destructor would release Python-made values after the interpreter is gone
// (a segfault on the H100 at 7c92694).
std::mutex& replays_mutex = *new std::mutex;
auto& replays = *new std::unordered_map<int64_t, std::shared_ptr<const Replay>>;
}  // namespace

void set_replay(int64_t id, ffi::Function function, ffi::Array<ffi::Any> fixed, ffi::Array<ffi::Any> codes) {
  auto replay = std::make_shared<Replay>();
  replay->function = function;
  for (size_t i = 0; i < codes.size(); ++i) {
    Argument argument;
    std::vector<ffi::Any> elements;
    if (auto code = codes[i].try_cast<int64_t>()) {
      argument.code = *code;
    } else {
      argument.is_tuple = true;
      auto element_codes = codes[i].cast<ffi::Array<ffi::Any>>();
      auto element_values = fixed[i].cast<ffi::Array<ffi::Any>>();
      for (size_t j = 0; j < element_codes.size(); ++j) {
        argument.element_codes.push_back(element_codes[j].cast<int64_t>());
        elements.push_back(element_values[j]);
      }
    }
    replay->fixed.push_back(fixed[i]);
    replay->fixed_elements.push_back(std::move(elements));
    replay->arguments.push_back(std::move(argument));
  }
  std::lock_guard<std::mutex> lock(replays_mutex);
  replays[id] = std::move(replay);
}

ffi::Function make_launch(int64_t id) {
  return ffi::Function::FromPacked([id](ffi::PackedArgs args, ffi::Any*) {
    std::shared_ptr<const Replay> replay;
    {
      std::lock_guard<std::mutex> lock(replays_mutex);
      replay = replays.at(id);
    }
    const size_t n = replay->arguments.size();
    std::vector<ffi::Any> tuples(n);
    std::vector<ffi::AnyView> call(n);
    for (size_t i = 0; i < n; ++i) {
      const Argument& argument = replay->arguments[i];
      if (!argument.is_tuple) {
        call[i] = argument.code < 0 ? ffi::AnyView(replay->fixed[i]) : args[argument.code];
        continue;
      }
      ffi::Array<ffi::Any> tuple;
      for (size_t j = 0; j < argument.element_codes.size(); ++j) {
        int64_t code = argument.element_codes[j];
        tuple.push_back(code < 0 ? replay->fixed_elements[i][j] : ffi::Any(args[code]));
      }
      tuples[i] = tuple;
      call[i] = tuples[i];
    }
    // The callee's return value is dropped here: FlashInfer's Python prefill forwarder returns `o`, and a result
    // holding XLA's tensor past the call is a leak jax-tvm-ffi refuses ("Leaked temp owned tensors").
    ffi::Any ignored;
    replay->function.CallPacked(call.data(), static_cast<int32_t>(n), &ignored);
  });
}
"""


@functools.cache
def native_replay():
    """The compiled replay module (set_replay, make_launch), built on first use and cached by tvm-ffi."""
    import tvm_ffi.cpp

    return tvm_ffi.cpp.load_inline("jaxattn_flashinfer_replay", cpp_sources=NATIVE_REPLAY_SOURCE,
                                   functions=["set_replay", "make_launch"])


@functools.cache
def native_replay_error() -> str | None:
    """Why the native replay cannot be built here (e.g. no C++ compiler), or None once it is."""
    try:
        native_replay()
    except Exception as error:  # noqa: BLE001  (any build failure: the launcher falls back to the Python callback)
        return f"{type(error).__name__}: {str(error)[-300:]}"
    return None


def native_codes(template, xla_position) -> tuple[list, list] | None:
    """(fixed, codes) for the native replay from a call template (see NATIVE_REPLAY_SOURCE), or None where it nests
    deeper than one tuple. xla_position(operand index) -> the operand's position among XLA's arguments."""
    fixed, codes = [], []
    for item in template:
        if type(item) is Operand:
            fixed.append(None)
            codes.append(xla_position(item.index))
        elif type(item) is tuple:
            if any(type(e) is tuple for e in item):
                return None
            fixed.append([None if type(e) is Operand else e for e in item])
            codes.append([xla_position(e.index) if type(e) is Operand else -1 for e in item])
        else:
            fixed.append(item)
            codes.append(-1)
    return fixed, codes


class FfiRun:
    """One XLA FFI target running one planned wrapper for fixed head shapes, dtypes and k_scale.

    The target's callback gets (q, k, v, *variant tensors, out, lse) from XLA and calls the wrapper's module
    function with the argument list recorded from the wrapper's run(); it records the list again when the wrapper
    was re-planned. placeholders: the tensors run() is recorded on (q, k, v, out, lse, *variant tensors; torch on the
    GPU); variant_args: a variant's extra run() arguments with its tensors' placeholders in place; platform: "gpu",
    or "cpu" in tests.
    """

    def __init__(self, wrapper, placeholders, *, k_scale=None, variant_args=(), platform: str = "gpu",
                 native: bool = True):
        import jax_tvm_ffi

        self.wrapper = wrapper
        self.placeholders = placeholders
        self.k_scale = k_scale
        self.variant_args = variant_args
        self.number = next(_target_numbers)
        self.target = f"jaxattn_flashinfer_run_{self.number}"
        if native and native_replay_error() is not None:
            warnings.warn("FlashInfer FFI launch: the native replay could not be built, so each launch runs a Python "
                          f"callback (which waits for the GIL): {native_replay_error()}", RuntimeWarning, stacklevel=3)
        self.native_requested = native and native_replay_error() is None
        self.native = False  # until the first recorded call is known to fit the replay
        self.record()
        self.native = self.native_requested and self.native_lists() is not None
        if self.native:
            self.push_native()
        # pass_owned_tensor: XLA's buffers reach the launch as tvm-ffi tensors (a Python callback needs them; the
        # module functions take them as tensors or views alike); no allow_cuda_graph: each launch reads the
        # current plan, so it must run at every step.
        launch = native_replay().make_launch(self.number) if self.native else self.callback
        jax_tvm_ffi.register_ffi_target(self.target, launch, arg_spec=["args", "rets"], platform=platform,
                                        pass_owned_tensor=True)

    def record(self):
        """Records the wrapper's current run() call (again after every plan(): FfiLauncher wraps the wrapper's plan)."""
        name, args = record_run_call(self.wrapper, *self.placeholders[:5], k_scale=self.k_scale,
                                     variant_args=self.variant_args)
        self.function = getattr(self.wrapper._cached_module, name)
        if self.native_requested:  # the compiled function behind a Python forwarder: no Python at launch
            import tvm_ffi

            forwarded = forwarded_call(self.function, args, lambda value: isinstance(value, tvm_ffi.Function))
            if forwarded is not None:
                self.function, args = forwarded
        self.template = call_template(args, self.placeholders, tvm_ffi_view)
        self.plan_info = self.wrapper._plan_info  # plan() makes a new one each time
        if self.native:
            self.push_native()

    def native_lists(self):
        """(fixed, codes) of the current template for the native replay; XLA's arguments are (q, k, v, *variant,
        out, lse), the template's operands (q, k, v, out, lse, *variant)."""
        variants = len(self.placeholders) - 5

        def xla_position(index):
            return index if index < 3 else index + variants if index < 5 else index - 2

        return native_codes(self.template, xla_position)

    def push_native(self):
        import tvm_ffi

        lists = self.native_lists()
        if lists is None:
            raise RuntimeError("FlashInfer FFI launch: a re-planned run() call nests its arguments deeper than the "
                               "native replay takes; use FfiLauncher(native=False)")
        fixed, codes = lists
        function = self.function if isinstance(self.function, tvm_ffi.Function) else tvm_ffi.convert(self.function)
        native_replay().set_replay(self.number, function, fixed, codes)

    def callback(self, *tensors):  # XLA's operands (q, k, v, *variant tensors), then its results (out, lse)
        if self.wrapper._plan_info is not self.plan_info:
            self.record()
        q, k, v, *variant, out, lse = tensors
        self.function(*fill_template(self.template, (q, k, v, out, lse, *variant)))


def record_at_every_plan(wrapper, run: FfiRun) -> None:
    """Makes the wrapper's plan() record `run`'s call again once it has planned (the native replay has no Python at
    launch to notice a new plan). The first call wraps the wrapper's own plan (an instance attribute)."""
    runs = wrapper.__dict__.get("_jaxattn_ffi_runs")
    if runs is None:
        runs = wrapper.__dict__["_jaxattn_ffi_runs"] = []
        plan = getattr(wrapper, "plan", None)
        if plan is not None:  # (a stand-in without plan() is never re-planned)
            @functools.wraps(plan)
            def plan_and_record(*args, **kwargs):
                result = plan(*args, **kwargs)
                for planned in runs:
                    planned.record()
                return result

            wrapper.plan = plan_and_record
    runs.append(run)


class FfiLauncher:
    """Runs planned FlashInfer wrappers inside jit through XLA FFI targets, one per wrapper, head shapes and k_scale.

    `run` has `bridged_run`'s arguments and results. Call it at trace time after the wrapper's first plan().
    platform / placeholders: "gpu" and torch_placeholders; tests on CPU pass "cpu" and numpy placeholders.
    native: launch through the compiled C++ replay (needs a C++ compiler once; see NATIVE_REPLAY_SOURCE), else
    through a Python callback.
    """

    def __init__(self, platform: str = "gpu", placeholders=torch_placeholders, flashinfer_version: str | None = None,
                 native: bool = True):
        if not ffi_available():
            choose_launch("ffi", available=False)  # raises the ImportError naming the wheel
        if flashinfer_version is not None and not flashinfer_version.startswith(FFI_FLASHINFER_VERSION):
            # 0.7 checks q's rows against the plan (the recorded placeholders have one) and its fa2 run() reads the
            # cache's torch strides (tvm-ffi tensors have none): the recorded call does not replay there.
            raise NotImplementedError(f"the FlashInfer FFI launch replays flashinfer {FFI_FLASHINFER_VERSION}x's run() "
                                      f"calls; flashinfer {flashinfer_version} is installed: use launch='bridge'")
        self.platform = platform
        self.placeholders = placeholders
        self.native = native
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
            run = FfiRun(wrapper, placeholders, k_scale=k_scale, variant_args=recorded, platform=self.platform,
                         native=self.native)
            record_at_every_plan(wrapper, run)
            self.runs[key] = run
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
