"""FlashInfer's FFI launch (jaxattn.backends.flashinfer_ffi): launch choice and the recorded call on CPU (a stand-in
wrapper whose "kernel" is a Python function, through a real XLA FFI call when jax-tvm-ffi is installed); against
bridged_run and the reference on the GPU."""

import dataclasses
import shutil
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.backends.flashinfer_ffi import (
    Operand,
    call_template,
    choose_launch,
    ffi_available,
    fill_template,
    record_run_call,
)
from tests.helpers import HAS_GPU

HAS_FFI = ffi_available()


def test_the_ffi_launch_is_opt_in(monkeypatch):
    monkeypatch.delenv("JAXATTN_FLASHINFER_LAUNCH", raising=False)
    assert choose_launch(available=True) == "bridge"  # installed is not enough (see choose_launch)
    assert choose_launch("auto", available=True) == "bridge"
    assert choose_launch(available=False) == "bridge"
    assert choose_launch("bridge", available=True) == "bridge"
    monkeypatch.setenv("JAXATTN_FLASHINFER_LAUNCH", "bridge")
    assert choose_launch(available=True) == "bridge"
    assert choose_launch("ffi", available=True) == "ffi"  # the argument wins over the environment


def test_forcing_ffi_without_the_wheel_names_it():
    with pytest.raises(ImportError, match=r"jax-tvm-ffi"):
        choose_launch("ffi", available=False)
    with pytest.raises(ValueError, match="expected one of"):
        choose_launch("tvm", available=True)


class StandInWrapper:
    """Shaped like a planned FlashInfer wrapper: plan() sets `_plan_info` and a workspace, run() makes one positional
    call into `_cached_module` with q, the K/V pair (also nested, as the tensor-core decode path does), out and lse.
    Its "kernel" writes out = q * scale * plan_info[0] + k[0, 0, 0, 0] and lse = plan_info[0]."""

    def __init__(self):
        self._cached_module = SimpleNamespace(run=self.kernel)
        self.kernel_calls = 0

    def plan(self, factor):
        self._plan_info = [factor, 7]
        self._workspace = np.zeros(4, np.float32)

    def run(self, q, paged_kv_cache, *, out, lse, return_lse, k_scale=None):
        assert return_lse
        k, v = paged_kv_cache
        scale = 1.0 if k_scale is None else k_scale
        self._cached_module.run(self._workspace, self._plan_info, q, k, v, out, lse, 1, paged_kv_cache, scale)

    def kernel(self, workspace, plan_info, q, k, v, out, lse, layout, kv_pair, scale):
        self.kernel_calls += 1
        assert same_buffer(kv_pair[0], k) and same_buffer(kv_pair[1], v) and layout == 1
        out, lse = np.from_dlpack(out), np.from_dlpack(lse)
        out[...] = np.from_dlpack(q) * scale * plan_info[0] + np.from_dlpack(k)[0, 0, 0, 0]
        lse[...] = plan_info[0]


def same_buffer(a, b) -> bool:
    """Whether two tensors are views of the same memory (the native replay hands the K/V pair over as a tvm-ffi array
    of the tensors it also passes alone: other Python objects, one buffer)."""
    a, b = np.from_dlpack(a), np.from_dlpack(b)
    return a.ctypes.data == b.ctypes.data and a.shape == b.shape


def numpy_placeholders(q_shape, q_dtype, k_shape, v_shape, kv_dtype, page_size=1, variant_shapes=()):
    return (np.zeros((1, *q_shape[1:]), np.float32), np.zeros((1, page_size, *k_shape[1:]), np.float32),
            np.zeros((1, page_size, *v_shape[1:]), np.float32), np.zeros((1, q_shape[1], v_shape[2]), np.float32),
            np.zeros((1, q_shape[1]), np.float32), *(np.zeros(shape, np.float32) for shape, _ in variant_shapes))


class SinkStandInWrapper(StandInWrapper):
    """Shaped like FlashInfer's sink-aware wrapper: run(q, cache, sinks, sm_scale, ...) passes its variant arguments
    after the module call's own (flashinfer 0.6.0 prefill.py: `run_args.extend(args)` for a JIT variant). Its
    "kernel" writes out = q * sm_scale * plan_info[0] + sinks[head] and lse = plan_info[0]."""

    def run(self, q, paged_kv_cache, *variant, out, lse, return_lse, k_scale=None):
        assert return_lse
        k, v = paged_kv_cache
        self._cached_module.run(self._workspace, self._plan_info, q, k, v, out, lse, 1, paged_kv_cache, 1.0, *variant)

    def kernel(self, workspace, plan_info, q, k, v, out, lse, layout, kv_pair, scale, sinks=None, sm_scale=None):
        self.kernel_calls += 1
        out, lse = np.from_dlpack(out), np.from_dlpack(lse)
        out[...] = np.from_dlpack(q) * sm_scale * plan_info[0] + np.from_dlpack(sinks)[None, :, None]
        lse[...] = plan_info[0]


def test_the_template_holds_operands_where_run_passed_them():
    wrapper = StandInWrapper()
    wrapper.plan(2.0)
    operands = numpy_placeholders((3, 2, 4), None, (5, 1, 4), (5, 1, 4), None)
    name, args = record_run_call(wrapper, *operands, k_scale=0.5)
    assert name == "run" and wrapper.kernel_calls == 0  # recorded, not launched
    assert wrapper._cached_module.run == wrapper.kernel  # the module is put back
    template = call_template(args, operands, convert=lambda a: ("converted", a) if isinstance(a, np.ndarray) else a)
    assert template[0][0] == "converted" and template[1] == [2.0, 7]
    assert template[2:8] == (Operand(0), Operand(1), Operand(2), Operand(3), Operand(4), 1)
    assert template[8] == (Operand(1), Operand(2)) and template[9] == 0.5
    filled = fill_template(template, ("q", "k", "v", "out", "lse"))
    assert filled[2:8] == ["q", "k", "v", "out", "lse", 1] and filled[8] == ("k", "v")


def test_a_variants_tensors_are_operands_after_lse_and_its_values_stay():
    wrapper = SinkStandInWrapper()
    wrapper.plan(2.0)
    operands = numpy_placeholders((3, 2, 4), None, (5, 1, 4), (5, 1, 4), None, variant_shapes=[((2,), None)])
    assert len(operands) == 6 and operands[5].shape == (2,)
    name, args = record_run_call(wrapper, *operands[:5], variant_args=(operands[5], 0.125))
    template = call_template(args, operands)
    assert template[-2:] == (Operand(5), 0.125)
    assert fill_template(template, ("q", "k", "v", "out", "lse", "sinks"))[-2:] == ["sinks", 0.125]


def test_a_run_that_drops_an_operand_is_refused():
    operands = tuple(np.zeros(1) for _ in range(5))
    with pytest.raises(RuntimeError, match=r"operands \[4\]"):
        call_template((operands[0], operands[1], operands[2], operands[3], None), operands)


@pytest.mark.skipif(not HAS_FFI, reason="needs jax-tvm-ffi")
@pytest.mark.parametrize("native", [True, False], ids=["native", "python-callback"])
def test_ffi_launch_on_cpu_follows_every_new_plan(native):
    from jaxattn.backends.flashinfer_ffi import FfiLauncher

    wrapper = StandInWrapper()
    wrapper.plan(2.0)
    launcher = FfiLauncher(platform="cpu", placeholders=numpy_placeholders, native=native)
    q = jnp.arange(24, dtype=jnp.float32).reshape(3, 2, 4)
    k_pool = jnp.full((5, 1, 4), 10.0)
    v_pool = jnp.zeros((5, 1, 4))
    step = jax.jit(lambda q, k, v: launcher.run(wrapper, q, k, v, 4, k_scale=0.5, v_scale=2.0))
    o, lse = step(q, k_pool, v_pool)
    np.testing.assert_allclose(o, (q * 0.5 * 2.0 + 10.0) * 2.0)
    np.testing.assert_allclose(lse, np.full((3, 2), 2.0))
    wrapper.plan(3.0)  # a new plan: the same executable, the new plan's arguments
    o, lse = step(q, k_pool, v_pool)
    np.testing.assert_allclose(o, (q * 0.5 * 3.0 + 10.0) * 2.0)
    np.testing.assert_allclose(lse, np.full((3, 2), 3.0))
    assert wrapper.kernel_calls == 2 and step._cache_size() == 1
    from jaxattn.backends.flashinfer_ffi import native_replay_error

    assert [run.native for run in launcher.runs.values()] == [native and native_replay_error() is None]


@pytest.mark.skipif(not HAS_FFI, reason="needs jax-tvm-ffi")
def test_without_a_compiler_the_launch_falls_back_to_the_callback(monkeypatch):
    import jaxattn.backends.flashinfer_ffi as ffi

    monkeypatch.setattr(ffi, "native_replay_error", lambda: "RuntimeError: no C++ compiler")
    wrapper = StandInWrapper()
    wrapper.plan(2.0)
    launcher = ffi.FfiLauncher(platform="cpu", placeholders=numpy_placeholders)
    q = jnp.arange(24, dtype=jnp.float32).reshape(3, 2, 4)
    with pytest.warns(RuntimeWarning, match="no C.. compiler"):
        o, _ = jax.jit(lambda q, k, v: launcher.run(wrapper, q, k, v, 4))(q, jnp.full((5, 1, 4), 10.0), jnp.zeros((5, 1, 4)))
    np.testing.assert_allclose(o, q * 2.0 + 10.0)
    assert [run.native for run in launcher.runs.values()] == [False]


@pytest.mark.skipif(not HAS_FFI, reason="needs jax-tvm-ffi")
@pytest.mark.parametrize("native", [True, False], ids=["native", "python-callback"])
def test_ffi_launch_on_cpu_passes_a_variants_tensors_from_jit(native):
    from jaxattn.backends.flashinfer import sink_variant_args
    from jaxattn.backends.flashinfer_ffi import FfiLauncher

    wrapper = SinkStandInWrapper()
    wrapper.plan(2.0)
    launcher = FfiLauncher(platform="cpu", placeholders=numpy_placeholders, native=native)
    q = jnp.arange(24, dtype=jnp.float32).reshape(3, 2, 4)
    k_pool = v_pool = jnp.zeros((5, 1, 4))
    step = jax.jit(lambda q, k, v, sinks: launcher.run(wrapper, q, k, v, 4,
                                                        variant_args=sink_variant_args(sinks, 0.25, k_scale=0.5)))
    for sinks in (jnp.array([1.0, -3.0]), jnp.array([0.5, 7.0])):  # traced: one executable, each call's values
        o, _ = step(q, k_pool, v_pool, sinks)
        np.testing.assert_allclose(o, q * 0.125 * 2.0 + sinks[None, :, None])
    assert wrapper.kernel_calls == 2 and step._cache_size() == 1


# A C++ stand-in kernel (StandInWrapper.kernel's arithmetic, f32, contiguous) for the launch with no Python in it.
CPP_KERNEL = r"""
#include <tvm/ffi/any.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
namespace ffi = tvm::ffi;
void kernel(ffi::Any workspace, ffi::Array<ffi::Any> plan_info, ffi::TensorView q, ffi::TensorView k, ffi::TensorView v,
            ffi::TensorView out, ffi::TensorView lse, int64_t layout, ffi::Array<ffi::Any> kv_pair, double scale) {
  double factor = plan_info[0].cast<double>();
  float k0 = static_cast<const float*>(k.data_ptr())[0];
  const float* q_data = static_cast<const float*>(q.data_ptr());
  float* out_data = static_cast<float*>(out.data_ptr());
  float* lse_data = static_cast<float*>(lse.data_ptr());
  for (int64_t i = 0; i < out.numel(); ++i) out_data[i] = static_cast<float>(q_data[i] * scale * factor + k0);
  for (int64_t i = 0; i < lse.numel(); ++i) lse_data[i] = static_cast<float>(factor);
  if (layout != 1 || kv_pair.size() != 2) lse_data[0] = -1.0f;  // the recorded layout and the K/V pair reached it
}
"""


class CppStandInWrapper(StandInWrapper):
    """StandInWrapper whose module function is compiled C++ (a tvm-ffi function, as FlashInfer's are)."""

    def __init__(self):
        import tvm_ffi.cpp

        super().__init__()
        module = tvm_ffi.cpp.load_inline("jaxattn_test_ffi_stand_in", cpp_sources=CPP_KERNEL, functions=["kernel"])
        self._cached_module = SimpleNamespace(run=module.kernel)


@pytest.mark.skipif(not HAS_FFI or shutil.which("c++") is None, reason="needs jax-tvm-ffi and a C++ compiler")
def test_the_native_launch_runs_no_python(monkeypatch):
    # With a C++ module function the native launch calls it from C++: the Python callback never runs (so a launch
    # never waits for the GIL), and a new plan still reaches the next launch of the same executable.
    from jaxattn.backends.flashinfer_ffi import FfiLauncher, FfiRun

    wrapper = CppStandInWrapper()
    wrapper.plan(2.0)
    launcher = FfiLauncher(platform="cpu", placeholders=numpy_placeholders)
    q = jnp.arange(24, dtype=jnp.float32).reshape(3, 2, 4)
    k_pool, v_pool = jnp.full((5, 1, 4), 10.0), jnp.zeros((5, 1, 4))
    step = jax.jit(lambda q, k, v: launcher.run(wrapper, q, k, v, 4, k_scale=0.5, has_side_effect=True))

    def no_python(*_):
        raise AssertionError("the Python callback ran")

    monkeypatch.setattr(FfiRun, "callback", no_python)
    for factor in (2.0, 3.0):
        wrapper.plan(factor)
        o, lse = step(q, k_pool, v_pool)
        np.testing.assert_allclose(o, q * 0.5 * factor + 10.0)
        np.testing.assert_allclose(lse, np.full((3, 2), factor))
    assert step._cache_size() == 1 and all(run.native for run in launcher.runs.values())


class ForwardingStandInWrapper(CppStandInWrapper):
    """Shaped like FlashInfer 0.6's prefill modules: the module function is Python, holds the compiled kernel in its
    closure, forwards to it and returns `out` (prefill.py's paged_run). hidden: the kernel is reached through an
    object instead, a forwarder the native replay cannot take apart (it then replays the Python function itself)."""

    def __init__(self, hidden=False):
        super().__init__()
        kernel, self.forwards = self._cached_module.run, []
        holder = SimpleNamespace(kernel=kernel)

        def forward(workspace, plan_info, q, k, v, out, lse, layout, kv_pair, scale):
            self.forwards.append(1)
            if hidden:
                holder.kernel(workspace, plan_info, q, k, v, out, lse, layout, kv_pair, scale)
            else:
                kernel(workspace, plan_info, q, k, v, out, lse, layout, kv_pair, scale)
            return out

        self._cached_module = SimpleNamespace(run=forward)


@pytest.mark.skipif(not HAS_FFI or shutil.which("c++") is None, reason="needs jax-tvm-ffi and a C++ compiler")
@pytest.mark.parametrize("hidden", [False, True], ids=["forwarded", "hidden-kernel"])
def test_the_native_launch_replays_past_a_python_forwarder(monkeypatch, hidden):
    # FlashInfer's prefill forwarder returns `o`: the launch must not hand XLA's tensor back as its result (jax-tvm-ffi
    # refuses a call that keeps it: "Leaked temp owned tensors", the H100 at 7c92694). Where the forwarder's one call
    # is positional, the launch calls the compiled kernel itself, so the forwarder runs only when a plan is recorded.
    from jaxattn.backends.flashinfer_ffi import FfiLauncher, FfiRun

    wrapper = ForwardingStandInWrapper(hidden)
    wrapper.plan(2.0)
    launcher = FfiLauncher(platform="cpu", placeholders=numpy_placeholders)
    q = jnp.arange(24, dtype=jnp.float32).reshape(3, 2, 4)
    k_pool, v_pool = jnp.full((5, 1, 4), 10.0), jnp.zeros((5, 1, 4))
    step = jax.jit(lambda q, k, v: launcher.run(wrapper, q, k, v, 4, k_scale=0.5, has_side_effect=True))
    monkeypatch.setattr(FfiRun, "callback", lambda *_: pytest.fail("the Python callback ran"))
    for factor in (2.0, 3.0):
        wrapper.plan(factor)
        for launch in range(2):
            forwards = len(wrapper.forwards)  # (the first launch of the first plan also traces and records)
            o, lse = step(q, k_pool, v_pool)
            np.testing.assert_allclose(o, q * 0.5 * factor + 10.0)
            np.testing.assert_allclose(lse, np.full((3, 2), factor))
        assert len(wrapper.forwards) - forwards == (1 if hidden else 0)
    assert all(run.native for run in launcher.runs.values())


def test_a_forwarded_call_is_found_without_touching_the_forwarder():
    from jaxattn.backends.flashinfer_ffi import forwarded_call

    def compiled(*args):
        raise AssertionError("the compiled function ran")

    def make(kind):
        other = "a non-compiled closure value"

        def forward(a, b, c=5):
            if kind == "twice":
                compiled(a)
            if kind == "uses-result":
                return compiled(b, a).shape  # a recorder returns None: not a plain forwarder
            compiled(b, a, c + 1, other) if kind != "keyword" else compiled(b, key=a)
            return a

        return forward

    is_compiled = lambda value: value is compiled  # noqa: E731
    forward = make("once")
    assert forwarded_call(forward, (1, 2), is_compiled) == (compiled, (2, 1, 6, "a non-compiled closure value"))
    assert forward.__closure__[0].cell_contents is compiled  # the forwarder's own closure is untouched
    assert forwarded_call(make("twice"), (1, 2), is_compiled) is None
    assert forwarded_call(make("keyword"), (1, 2), is_compiled) is None
    assert forwarded_call(make("uses-result"), (1, 2), is_compiled) is None
    assert forwarded_call(compiled, (1,), is_compiled) is None  # no closure: not a forwarder
    assert forwarded_call(forward, (1, 2), lambda value: False) is None  # nothing compiled in its closure


def test_native_codes_place_operands_and_tuples():
    from jaxattn.backends.flashinfer_ffi import native_codes

    template = ("ws", [2.0, 7], Operand(0), (Operand(1), Operand(2)), Operand(3), Operand(4), 1, Operand(5))
    position = {0: 0, 1: 1, 2: 2, 3: 4, 4: 5, 5: 3}.get  # XLA's order: q, k, v, one variant tensor, out, lse
    fixed, codes = native_codes(template, position)
    assert codes == [-1, -1, 0, [1, 2], 4, 5, -1, 3]
    assert fixed == ["ws", [2.0, 7], None, [None, None], None, None, 1, None]
    assert native_codes(((Operand(0), (Operand(1),)),), position) is None  # deeper nesting: the Python callback


# ---------------------------------------------------------------------------------------------
# GPU: the FFI launch against bridged_run and the reference backend.

# Two batches per case with the same token count: one jitted step serves both plans.
GPU_CASES = {
    "decode": dict(mode="DECODE", seq_lens=([33, 0, 64, 7], [12, 3, 0, 50]), extend_lens=([1, 0, 1, 1], [1, 1, 0, 1]), tokens=4),
    "decode-tensor-cores": dict(mode="DECODE", seq_lens=([33, 5, 64], [2, 40, 9]), extend_lens=([1, 1, 1], [1, 1, 1]), tokens=3,
                                q_heads=8),
    "extend": dict(mode="EXTEND", seq_lens=([40, 9, 1], [20, 30, 2]), extend_lens=([11, 9, 1], [5, 18, 1]), tokens=24),
    "window": dict(mode="EXTEND", seq_lens=([40, 9, 30], [12, 50, 3]), extend_lens=([11, 9, 5], [12, 6, 3]), tokens=28, window=6),
}


def scheduled_batch(rng, mode, seq_lens, extend_lens, tokens, num_slots, max_extend_len=None):
    """A batch whose new tokens' slots (out_cache_loc) are the req_to_token entries they are written to."""
    from tests.test_flashinfer_backend import make_batch

    batch, r2t = make_batch(rng, mode, seq_lens, extend_lens, tokens, max_extend_len=max_extend_len)
    r2t = (rng.permutation(num_slots - 1)[: r2t.size].reshape(r2t.shape) + 1).astype(np.int32)
    rows = np.asarray(batch.req_pool_indices)
    out_cache_loc = np.zeros(tokens, np.int32)
    cursor = 0
    for b, (s, n) in enumerate(zip(seq_lens, extend_lens)):
        at = b if mode.name == "DECODE" else cursor
        out_cache_loc[at : at + n] = r2t[rows[b], s - n : s]
        cursor += n
    return dataclasses.replace(batch, out_cache_loc=jnp.asarray(out_cache_loc)), r2t


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_GPU and HAS_FFI), reason="needs a CUDA GPU, flashinfer and jax-tvm-ffi")
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_ffi_launch_matches_the_bridge_and_the_reference(rng, name):
    from jaxattn.backends import AttentionLayer, ReferenceBackend
    from jaxattn.backends.flashinfer import FlashInferBackend
    from jaxattn.batch import ForwardMode

    case = dict(GPU_CASES[name])
    window, hq, mode, tokens = case.pop("window", -1), case.pop("q_heads", 4), ForwardMode[case["mode"]], case["tokens"]
    num_slots, hkv, d = 4096, 2, 128
    # One bucket for both batches (one jitted step); an extend longer than the bucket would not be computed (until
    # 2026-12-05 "extend" had one, and the reference's rows for its last two tokens were zeros: a failure of the test).
    bucket = max(16, *(max(lens) for lens in case["extend_lens"]))
    batches = [scheduled_batch(rng, mode, s, e, tokens, num_slots, bucket)
               for s, e in zip(case["seq_lens"], case["extend_lens"])]
    layer = AttentionLayer(0, hq, hkv, d, sliding_window=window)
    pools = [jnp.asarray(rng.standard_normal((num_slots, hkv, d)), jnp.bfloat16) for _ in range(2)]
    q, k, v = (jnp.asarray(rng.standard_normal((tokens, h, d)), jnp.bfloat16) for h in (hq, hkv, hkv))

    ref = ReferenceBackend()
    want = []
    for batch, r2t in batches:
        ref_step = jax.jit(lambda *a, b=batch, r=r2t: ref.forward(*a, layer, ref.init_forward_metadata(b, jnp.asarray(r))))
        want.append(ref_step(q, k, v, *pools)[0])
    got = {}
    for launch in ("ffi", "bridge"):
        backend = FlashInferBackend(launch=launch)
        step = jax.jit(lambda q, k, v, kb, vb, m: backend.forward(q, k, v, kb, vb, layer, m, return_lse=True))
        got[launch] = []
        for batch, r2t in batches:
            meta = backend.plan(batch, r2t, [layer])
            o, lse, _, _ = step(q, k, v, *pools, meta)
            got[launch].append((np.float32(o), np.float32(lse)))
        assert step._cache_size() == 1
    for i in range(len(batches)):
        np.testing.assert_allclose(got["ffi"][i][0], np.float32(want[i]), atol=2e-2, rtol=2e-2)
        # the same kernels and plans: the same bits
        np.testing.assert_array_equal(got["ffi"][i][0], got["bridge"][i][0])
        np.testing.assert_array_equal(got["ffi"][i][1], got["bridge"][i][1])


@pytest.mark.skipif(not HAS_FFI, reason="needs jax-tvm-ffi")
def test_the_ffi_launch_refuses_flashinfer_releases_whose_calls_it_cannot_replay():
    from jaxattn.backends.flashinfer_ffi import FfiLauncher

    FfiLauncher(platform="cpu", placeholders=numpy_placeholders, flashinfer_version="0.6.0")
    with pytest.raises(NotImplementedError, match=r"flashinfer 0.7.4 is installed: use launch='bridge'"):
        FfiLauncher(platform="cpu", placeholders=numpy_placeholders, flashinfer_version="0.7.4")
