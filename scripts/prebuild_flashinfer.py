#!/usr/bin/env python3
"""Builds FlashInfer 0.6.0's JIT modules that jaxattn uses, for the H200 (sm_90a), on a machine without a GPU, and packs
them as FlashInfer's AOT modules: .ficache/flashinfer_aot.tar.xz holds <name>/<name>.so for each, which
scripts/gpu_env.sh unpacks into the installed package's data/aot/ (FlashInfer loads a module from there without
building it: flashinfer/jit/core.py, JitSpec.is_aot and build_and_load). On the GPU machine nvcc takes 12-95 s per
module, most of a device call; here they take minutes each on 2 cores, but cost no device time.

    python scripts/prebuild_flashinfer.py --list                   # the modules, where each is used, built or not
    nohup python scripts/prebuild_flashinfer.py --jobs 2 > /tmp/prebuild.log 2>&1 &     # build all, then pack
    python scripts/prebuild_flashinfer.py --only sm90 --jobs 2     # those whose name or use contains "sm90"
    python scripts/prebuild_flashinfer.py --pack-only              # pack what is built (e.g. after an interruption)
(python: the build venv's, /tmp/fibuild/bin/python; see Setup below.)

A module already built in the workspace (--workspace, /tmp/fibuild-ws) is not built again, so a run resumes where an
interrupted one stopped (ninja keeps the finished object files of a half-built module too). Modules are built most
important first: the GPU tests' (tests/test_flashinfer_backend.py, tests/test_flashinfer_ffi.py), then
scripts/stress_backends.py's, then the bench's FlashInfer rows; each module's build time is printed.

Which modules: the wrappers FlashInferBackend builds are recorded by running its own plan() (over stand-ins for torch
and the wrapper classes, as tests/test_flashinfer_backend.py's `stand_in_flashinfer` does) on the layers and modes of
the tests, the stress profiles and benchmarks/experiments/ffi_padding_rows.py; the bench's wrappers follow
jaxattn/bench/peers.py. Each wrapper's modules are FlashInfer's own generators called with the arguments its plan()
passes them (`wrapper_modules`), so the names are the ones FlashInfer looks up on the GPU.

Setup (a throwaway venv; Python 3.11 because the torch wheel on this disk is cp311 and any other torch is a
multi-GB CUDA download; torch is only imported here, for dtypes, and the modules link no Python):
    /root/.pyenv/versions/3.11.7/bin/python -m venv /tmp/fibuild
    /tmp/fibuild/bin/pip install torch==2.13.0          # the CPU build on this disk
    /tmp/fibuild/bin/pip install --no-deps .whl/flashinfer_python-0.6.0-py3-none-any.whl
    /tmp/fibuild/bin/pip install apache-tvm-ffi==0.1.15.post2 nvidia-cudnn-frontend==1.32.0 numpy einops ninja click \
        nvidia-ml-py packaging requests tabulate tqdm filelock nvidia-curand==10.4.0.35
    /tmp/fibuild/bin/pip install jax jaxlib chex triton==3.6.0 jax-triton==0.3.1   # jaxattn's own rules and cases
    /tmp/fibuild/bin/python scripts/prebuild_flashinfer.py --jobs 2
nvcc 13.0 from CUDA_HOME (default /usr/local/cuda) must be the GPU image's release (it is: 13.0 on both).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tarfile
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))  # stress_backends' profiles
sys.path.insert(0, os.path.join(ROOT, "examples"))  # which stress_backends imports

TARBALL = os.path.join(ROOT, ".ficache", "flashinfer_aot.tar.xz")


# ---------------------------------------------------------------------------------------------
# The build environment. FlashInfer reads these when it is imported, so `configure` runs before the first import.


def configure(workspace: str, jobs: int) -> None:
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = "9.0a"  # compilation_context.py: the H200's arch, as it detects it there
    os.environ["FLASHINFER_WORKSPACE_BASE"] = workspace  # jit/env.py: <workspace>/.cache/flashinfer/0.6.0/90a/...
    os.environ["MAX_JOBS"] = str(jobs)  # jit/cpp_ext.py: ninja -j
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")  # else it takes `which nvcc`'s parent: /usr/local here
    # The modules built on the GPU image carry libstdc++ inside (no NEEDED libstdc++.so.6, checked on
    # .ficache/flashinfer.tgz) and link only what they use (--as-needed drops libcuda): the same here, so they need
    # no GLIBCXX_* version of the GPU image. CXX is FlashInfer's linker command, before its -lcudart -lcuda.
    os.environ["CXX"] = "c++ -Wl,--as-needed"
    stubs = os.path.join(workspace, "stubs")
    os.environ["FLASHINFER_EXTRA_LDFLAGS"] = f"-static-libstdc++ -L{stubs}"
    make_libcuda_stub(stubs)
    # CUTLASS's tensor_fill.h includes curand_kernel.h, which this CUDA (pip's nvidia-* parts) lacks: pip's
    # nvidia-curand has the headers (nothing of it is linked).
    import importlib.util

    nvidia = importlib.util.find_spec("nvidia")
    include = None if nvidia is None else next(
        (os.path.join(p, "cu13", "include") for p in nvidia.submodule_search_locations
         if os.path.exists(os.path.join(p, "cu13", "include", "curand_kernel.h"))), None)
    if include is None:
        raise SystemExit("curand_kernel.h not found: pip install nvidia-curand==10.4.0.35 (see the docstring)")
    os.environ["FLASHINFER_EXTRA_CUDAFLAGS"] = f"-isystem {include}"


def make_libcuda_stub(directory: str) -> None:
    """An empty libcuda.so for FlashInfer's -lcuda (there is no driver here): no module uses a driver symbol (none
    of the GPU image's builds needs libcuda), so --as-needed drops it; its soname is the driver's in case one did."""
    path = os.path.join(directory, "libcuda.so")
    if os.path.exists(path):
        return
    os.makedirs(directory, exist_ok=True)
    source = os.path.join(directory, "libcuda_stub.c")
    with open(source, "w") as f:
        f.write("int jaxattn_libcuda_stub;\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", path, source, "-Wl,-soname,libcuda.so.1"], check=True)


# ---------------------------------------------------------------------------------------------
# FlashInfer's wrappers and the JIT modules their plan() loads.


@dataclasses.dataclass(frozen=True)
class Wrapper:
    """One FlashInfer wrapper as constructed and planned: the arguments that choose its JIT modules."""

    kind: str  # "decode" (BatchDecodeWithPagedKVCacheWrapper), "prefill" (BatchPrefillWithPagedKVCacheWrapper),
    #            "sinks" (BatchAttentionWithAttentionSinkWrapper), "mla" (BatchMLAPagedAttentionWrapper)
    backend: str  # "fa2" | "fa3" as the wrapper resolves it on the H200; decode: its tensor-core path's
    q: str = "bfloat16"  # q_data_type (also the output's: no wrapper here is given o_data_type)
    kv: str = "bfloat16"  # kv_data_type
    head_dim: int = 128  # head_dim_qk (MLA: head_dim_ckv)
    head_dim_vo: int = 128  # (MLA: head_dim_kpe)
    window: bool = False  # window_left >= 0
    cap: bool = False  # logits_soft_cap > 0
    tensor_cores: bool = False  # decode: use_tensor_cores
    custom_mask: bool = False  # prefill: plan(custom_mask=...)


def wrapper_modules(w: Wrapper) -> list:
    """The JitSpecs `w`'s plan() builds and loads, from FlashInfer 0.6.0's own generators with the arguments plan()
    passes them (pos_encoding_mode "NONE" = 0, use_fp16_qk_reduction False and int32 indptrs throughout: jaxattn and
    its bench pass neither and int32 lists)."""
    import torch
    from flashinfer.jit.attention import (gen_batch_decode_module, gen_batch_mla_module, gen_batch_prefill_module,
                                          gen_customize_batch_prefill_module)
    from flashinfer.jit.attention.variants import attention_sink_decl
    from flashinfer.jit.quantization import gen_quantization_module
    from flashinfer.jit.utils import filename_safe_dtype_map

    q, kv = getattr(torch, w.q), getattr(torch, w.kv)
    if w.kind == "decode" and not w.tensor_cores:  # decode.py plan(): get_batch_decode_module(...)
        return [gen_batch_decode_module(q, kv, q, torch.int32, w.head_dim, w.head_dim, 0, w.window, w.cap)]
    if w.kind == "decode":  # decode.py plan(), use_tensor_cores: get_batch_prefill_module(backend, ...)
        return [gen_batch_prefill_module(w.backend, q, kv, q, torch.int32, w.head_dim, w.head_dim, 0, w.window, w.cap,
                                         False)]
    if w.kind == "prefill":  # prefill.py plan(): get_batch_prefill_module(backend, ...), and for a custom mask
        specs = [gen_batch_prefill_module(w.backend, q, kv, q, torch.int32, w.head_dim, w.head_dim_vo, 0, w.window,
                                          w.cap, False)]
        if w.custom_mask:  # segment_packbits (quantization.py) packs it
            specs.append(gen_quantization_module())
        return specs
    if w.kind == "sinks":  # attention.py BatchAttentionWithAttentionSinkWrapper.__init__'s jit_args / jit_kwargs,
        # which prefill.py's __init__ hands get_customize_batch_prefill_module(backend, *jit_args, **jit_kwargs).
        # Its name omits the pool dtype and head dims, and FlashInfer loads an AOT module by name without looking at
        # its sources (a JIT-cached one ninja rebuilds when they change): a sink layer of another pool dtype or head
        # dims than built here would run this build, wrongly. Every sink use today is a bf16 pool with 128/128 heads
        # (`modules` refuses a list that mixes them).
        uri = f"batch_prefill_attention_sink_{filename_safe_dtype_map[q]}_swa_{w.window}_{w.backend}"
        return [gen_customize_batch_prefill_module(
            w.backend, uri, q, kv, q, torch.int32, w.head_dim, w.head_dim_vo, ["sink"], ["float"], ["sm_scale"],
            ["double"], "AttentionSink", attention_sink_decl[w.backend], pos_encoding_mode=0,
            use_sliding_window=w.window, use_logits_soft_cap=False, use_fp16_qk_reduction=False, fp8_enabled=False)]
    if w.kind == "mla":  # mla.py plan(): get_batch_mla_module(backend, q, kv, q (the output's), qo_indptr's, ...)
        return [gen_batch_mla_module(w.backend, q, kv, q, torch.int32, w.head_dim, w.head_dim_vo, False)]
    raise ValueError(f"unknown wrapper kind {w.kind!r}")


# ---------------------------------------------------------------------------------------------
# FlashInferBackend's wrappers, recorded from its own plan().


class _RecordingWrapper:
    """Stands in for a FlashInfer wrapper class: keeps its constructor's and plan()'s arguments."""

    def __init__(self, kind, *args, **kwargs):
        self.kind, self.args, self.kwargs, self.plans = kind, args, kwargs, []

    def plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))


def _stand_ins():
    """(torch, flashinfer) for FlashInferBackend without a GPU: real torch dtypes, host arrays for device tensors."""
    import torch

    dtypes = {name: getattr(torch, name) for name in ("uint8", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")}
    stand_in_torch = SimpleNamespace(
        **dtypes, empty=lambda *a, **k: None, from_numpy=lambda x: SimpleNamespace(cuda=lambda: x),
        cuda=SimpleNamespace(synchronize=lambda: None, get_device_capability=lambda: (9, 0)))  # the H200
    kinds = ("BatchAttentionWithAttentionSinkWrapper", "BatchDecodeWithPagedKVCacheWrapper",
             "BatchPrefillWithPagedKVCacheWrapper", "BatchMLAPagedAttentionWrapper")
    stand_in_flashinfer = SimpleNamespace(**{k: (lambda *a, k=k, **kw: _RecordingWrapper(k, *a, **kw)) for k in kinds})
    return stand_in_torch, stand_in_flashinfer


def tiny_batch(mode, encoder: bool = False):
    """A one-sequence batch of `mode` and its req_to_token table (the lengths choose no module; the mode does, and a
    verify batch's custom mask)."""
    import jax.numpy as jnp
    import numpy as np

    from jaxattn.serving.batch import ForwardBatch, ForwardMode

    decode, verify = mode == ForwardMode.DECODE, mode == ForwardMode.TARGET_VERIFY
    seq_len, new = 8, 1 if decode else 4
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    batch = ForwardBatch(req_pool_indices=i32([0]), seq_lens=i32([seq_len]), extend_lens=i32([new]),
                         out_cache_loc=i32(np.arange(new) + 1), positions=i32(np.arange(new)), mode=mode,
                         custom_mask=jnp.ones(new * seq_len, bool) if verify else None,
                         encoder_lens=i32([4]) if encoder else None, max_extend_len=new, kv_capacity=64, max_seq_len=64)
    return batch, (np.arange(64, dtype=np.int32) + 1).reshape(1, 64)


def backend_wrappers(mode, layer, q_dtype="bfloat16", kv_dtype="bfloat16", deterministic=False) -> list[Wrapper]:
    """The wrappers FlashInferBackend(deterministic=) builds for `layer` in `mode`, on the H200, as its plan() builds
    and plans them ([] where it declines the layer: NotImplementedError)."""
    import jax.numpy as jnp

    import jaxattn.backends.flashinfer as fi_backend

    fi_backend.forget_sink_modules()  # a fresh process (main() checks names across all of them)
    backend = fi_backend.FlashInferBackend(launch="bridge", deterministic=deterministic, modules=_stand_ins())
    batch, table = tiny_batch(mode, encoder=layer.is_cross_attention)
    try:
        backend.plan(batch, table, [layer], q_dtype=jnp.dtype(q_dtype), kv_dtype=jnp.dtype(kv_dtype))
    except NotImplementedError:
        return []
    return [recorded_wrapper(w) for w in backend.wrappers]


def recorded_wrapper(r: _RecordingWrapper) -> Wrapper:
    """A `Wrapper` from a recorded wrapper's constructor and (last) plan() arguments, read as FlashInferBackend.plan
    passes them (positional: the plan lists, then heads and head dims)."""
    args, kwargs = r.plans[-1]
    names = lambda *dtypes: {n: str(d).removeprefix("torch.") for n, d in zip(("q", "kv"), dtypes)}  # noqa: E731
    if r.kind == "BatchMLAPagedAttentionWrapper":
        # plan(qo_indptr, kv_indptr, kv_indices, kv_len, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal,
        # sm_scale, q_data_type, kv_data_type); backend="auto": mla.py determine_mla_backend -> "fa3" on sm_90a
        assert r.kwargs["backend"] == "auto"
        return Wrapper("mla", "fa3", **names(args[10], args[11]), head_dim=args[5], head_dim_vo=args[6])
    common = dict(**names(kwargs["q_data_type"], kwargs["kv_data_type"]), window=kwargs["window_left"] >= 0,
                  cap=(kwargs["logits_soft_cap"] or 0) > 0)
    if r.kind == "BatchDecodeWithPagedKVCacheWrapper":  # plan(indptr, indices, last_page_len, qo heads, kv heads, D, P)
        return Wrapper("decode", r.kwargs["backend"], head_dim=args[5], head_dim_vo=args[5],
                       tensor_cores=r.kwargs["use_tensor_cores"], **common)
    if r.kind == "BatchAttentionWithAttentionSinkWrapper":  # built for its dtypes, head dims and window
        kw = r.kwargs
        return Wrapper("sinks", kw["backend"], **names(kw["q_data_type"], kw["kv_data_type"]),
                       head_dim=kw["head_dim_qk"], head_dim_vo=kw["head_dim_vo"], window=kw["window_left"] >= 0)
    # plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, qo heads, kv heads, head_dim_qk, P, head_dim_vo=...)
    return Wrapper("prefill", r.kwargs["backend"], head_dim=args[6], head_dim_vo=kwargs["head_dim_vo"],
                   custom_mask=kwargs.get("custom_mask") is not None, **common)


# ---------------------------------------------------------------------------------------------
# The bench's FlashInfer rows (jaxattn/bench/peers.py), which build wrappers themselves.


def bench_wrappers() -> list[tuple[str, Wrapper]]:
    """(where, wrapper) for every FlashInfer row of `python -m jaxattn.bench decode|extend` over every case of
    jaxattn/bench/cases.py (page sizes choose no module), skipped where peers.py's own rules skip them (its
    `*_declines` functions). backend="auto" is resolved as on the H200: utils.py determine_attention_backend gives fa3
    unless there is a custom mask (it checks no dtype), determine_mla_backend fa3."""
    from jaxattn.bench import peers
    from jaxattn.bench.cases import CASES

    def on_h200(backend):
        return "fa3" if backend == "auto" else backend

    rows = []
    for case in CASES.values():
        dtypes = dict(q="bfloat16", kv=case.kv_dtype)  # peers.py plans bf16 q over the case's pool
        if case.op == "decode":
            if not peers.decode_flashinfer_mla_declines(case):
                rows.append((f"bench decode {case.name} flashinfer-mla", Wrapper("mla", "fa3", head_dim=512,
                                                                                 head_dim_vo=64)))
            if not peers.decode_flashinfer_declines(case):  # rows flashinfer(-in-jit*), -tc
                for tensor_cores, row in ((False, "flashinfer"), (True, "flashinfer-tc")):
                    backend = on_h200(peers.decode_flashinfer_backend(case, tensor_cores))
                    rows.append((f"bench decode {case.name} {row}",
                                 Wrapper("decode", backend, **dtypes, tensor_cores=tensor_cores)))
            if not peers.verify_flashinfer_fa3_declines(case):  # extend_flashinfer(inp, "fa3")
                rows.append((f"bench decode {case.name} flashinfer-fa3",
                             Wrapper("prefill", "fa3", **dtypes, head_dim=case.head_dim, head_dim_vo=case.dv)))
            continue
        for backend in ("fa2", "fa3"):
            if peers.extend_flashinfer_declines(case, backend):
                continue
            kind = "sinks" if case.sinks else "prefill"
            rows.append((f"bench extend {case.name} flashinfer-{backend}",
                         Wrapper(kind, backend, **dtypes, head_dim=case.head_dim, head_dim_vo=case.dv,
                                 window=case.sliding_window >= 0, cap=case.logit_cap > 0 and not case.sinks,
                                 custom_mask=case.tree)))
    return rows


# ---------------------------------------------------------------------------------------------
# The list: every use of FlashInfer in jaxattn's GPU runs, most important first. One place; each entry says where.


def uses() -> list[tuple[str, Wrapper]]:
    """(where, wrapper) in build order: (a) the GPU tests, (b) scripts/stress_backends.py --backend flashinfer (then
    with --deterministic), (c) the bench's FlashInfer rows."""
    from dataclasses import replace

    from jaxattn.backends import AttentionLayer
    from jaxattn.serving.batch import ForwardMode

    import stress_backends

    extend, decode, verify = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY
    test_layer = AttentionLayer(0, 8, 2, 128)  # tests/test_flashinfer_backend.py: hq, hkv, d = 8, 2, 128, bf16 pools
    mla_layer = AttentionLayer(0, 16, 1, 576, v_head_dim=512, sm_scale=0.1)  # its MLA_LAYER
    backend_uses = [  # (where, modes, layer, kv dtype, deterministic)
        ("tests/test_flashinfer_backend.py GPU_CASES decode, extend, verify, scales-on-bf16; PAGED_CASES decode, "
         "extend",
         (decode, extend, verify), test_layer, "bfloat16", False),
        ("tests/test_flashinfer_backend.py GPU_CASES window, window-decode, verify-window; PAGED_CASES window*",
         (decode, extend, verify), replace(test_layer, sliding_window=6), "bfloat16", False),
        ("tests/test_flashinfer_backend.py GPU_CASES softcap", (extend,), replace(test_layer, logit_cap=10.0),
         "bfloat16", False),
        ("tests/test_flashinfer_backend.py GPU_CASES sinks, sinks-decode", (decode, extend),
         replace(test_layer, has_sinks=True), "bfloat16", False),
        ("tests/test_flashinfer_backend.py GPU_CASES sinks-window, sinks-window-decode", (decode, extend),
         replace(test_layer, sliding_window=6, has_sinks=True), "bfloat16", False),
        ("tests/test_flashinfer_backend.py test_flashinfer_mla_wrapper_agrees_with_reference_backend", (decode, extend),
         mla_layer, "bfloat16", False),
        ("tests/test_flashinfer_backend.py test_deterministic_flashinfer_is_batch_invariant", (decode, extend),
         test_layer, "bfloat16", True),
        ("tests/test_flashinfer_ffi.py GPU_CASES decode (4 q heads over 2: no tensor cores), extend",
         (decode, extend), AttentionLayer(0, 4, 2, 128), "bfloat16", False),
        ("tests/test_flashinfer_ffi.py GPU_CASES decode-tensor-cores", (decode,), AttentionLayer(0, 8, 2, 128),
         "bfloat16", False),
        ("tests/test_flashinfer_ffi.py GPU_CASES window", (extend,), AttentionLayer(0, 4, 2, 128, sliding_window=6),
         "bfloat16", False),
        ("benchmarks/experiments/ffi_padding_rows.py", (extend,), AttentionLayer(0, 4, 2, 128), "bfloat16", False),
    ]
    # scripts/stress_backends.py: every profile at the GPU size class, in each of its modes (fp8 profiles: decode
    # only, Runner.run declines the others before planning), without and with --deterministic.
    shapes = stress_backends.SHAPES["gpu"]
    for deterministic in (False, True):
        for profile in stress_backends.PROFILES:
            fp8 = bool(profile.kv_dtype)
            modes = [m for m in profile.modes if not fp8 or m == decode]
            flag = " --deterministic" if deterministic else ""
            backend_uses.append((f"scripts/stress_backends.py{flag} profile {profile.name}", modes,
                                 profile.layer(shapes), profile.kv_dtype or shapes.dtype, deterministic))
    listed = []
    for where, modes, layer, kv_dtype, deterministic in backend_uses:
        for mode in modes:
            listed += [(f"{where} ({mode.name.lower()})", w)
                       for w in backend_wrappers(mode, layer, "bfloat16", kv_dtype, deterministic)]
    return listed + bench_wrappers()


@dataclasses.dataclass
class Module:
    name: str
    spec: object  # flashinfer.jit.core.JitSpec
    where: list  # the uses that load it
    wrapper: Wrapper


def modules() -> list[Module]:
    """Every module of `uses()`, once, in the order of its first use; SystemExit if two uses would load different
    builds under one name (0.6.0's sink module names omit the pool dtype and head dims: one AOT build would serve
    both, silently wrong for one)."""
    found: dict[str, Module] = {}
    for where, wrapper in uses():
        for spec in wrapper_modules(wrapper):
            module = found.setdefault(spec.name, Module(spec.name, spec, [], wrapper))
            module.where.append(where)
            if wrapper.kind == "sinks" and (module.wrapper.kv, module.wrapper.head_dim, module.wrapper.head_dim_vo) != (
                    wrapper.kv, wrapper.head_dim, wrapper.head_dim_vo):
                raise SystemExit(f"{spec.name}: built for {module.wrapper} ({module.where[0]}) and {wrapper} ({where})")
    return list(found.values())


# ---------------------------------------------------------------------------------------------


def build(module: Module) -> float:
    """Builds one module into the workspace (ninja, -j MAX_JOBS); returns the seconds it took."""
    start = time.time()
    module.spec.build(verbose=False)
    return time.time() - start


def pack(mods: list[Module], path: str) -> list[str]:
    """Writes <name>/<name>.so of every built module to an xz -9 tarball (only the .so: FlashInfer's AOT directory
    holds nothing else); returns the names packed."""
    packed = []
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = path + ".partial"
    with tarfile.open(partial, "w:xz", preset=9) as tar:
        for m in mods:
            if m.spec.jit_library_path.exists():
                tar.add(m.spec.jit_library_path, arcname=f"{m.name}/{m.name}.so")
                packed.append(m.name)
    os.replace(partial, path)
    return packed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the modules (and whether built), build nothing")
    parser.add_argument("--only", default=None, metavar="SUBSTRING",
                        help="only the modules whose name or one of whose uses contains SUBSTRING")
    parser.add_argument("--jobs", type=int, default=2, help="parallel nvcc jobs (ninja -j)")
    parser.add_argument("--workspace", default="/tmp/fibuild-ws", help="FlashInfer's build cache goes under it")
    parser.add_argument("--output", default=TARBALL, help="the tarball to write")
    parser.add_argument("--pack-only", action="store_true", help="pack what is built, build nothing")
    args = parser.parse_args(argv)
    configure(args.workspace, args.jobs)

    mods = modules()
    chosen = [m for m in mods if args.only is None or args.only in m.name or any(args.only in w for w in m.where)]
    if args.list:
        for m in chosen:
            print(f"{m.name}  [{'built' if m.spec.jit_library_path.exists() else 'not built'}]")
            for where in m.where:
                print(f"    {where}")
        print(f"{len(chosen)} modules")
        return 0
    failed = []
    if not args.pack_only:
        for i, m in enumerate(chosen):
            if m.spec.jit_library_path.exists():
                print(f"[{i + 1}/{len(chosen)}] {m.name}: built already", flush=True)
                continue
            print(f"[{i + 1}/{len(chosen)}] {m.name}: building ({m.where[0]})", flush=True)
            try:
                seconds = build(m)
            except Exception as error:  # noqa: BLE001  (one module's failure must not stop the others)
                failed.append(m.name)
                print(f"[{i + 1}/{len(chosen)}] {m.name}: FAILED: {str(error)[-2000:]}", flush=True)
                continue
            print(f"[{i + 1}/{len(chosen)}] {m.name}: built in {seconds:.0f} s", flush=True)
    packed = pack(mods, args.output)
    print(f"packed {len(packed)} of {len(mods)} modules into {args.output} ({os.path.getsize(args.output) / 2**20:.1f} "
          f"MiB)" + (f"; failed: {failed}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
