"""The backends: each adapter takes an `Inputs` and returns a zero-argument callable running one step, or raises Skip.

jaxattn's decode, extend (two-stage Triton, unified, Mosaic GPU), FlashInfer's decode and paged prefill called from torch
and from jit through jaxattn's DLPack bridge, cuDNN (dense only) and the jnp reference. BACKENDS names them per op with
their synchronisation; its keys are the `backend` of the result rows.

Pages (`Case.page_size` P): jaxattn's metadata comes from the page table (`jaxattn.paging`'s builders, as
TritonBackend builds it from a PageTable): one slot per key, and for extend the promise of whole pages, which the Hopper
kernel copies as blocks; FlashInfer is planned with page_size P over the page ids and reads the same pools as
[slots // P, P, Hkv, D] views.
"""

from __future__ import annotations

import functools

import numpy as np

from .cases import draft_tree
from .inputs import Inputs
from .timing import PerCall, jax_sync, torch_sync


class Skip(Exception):
    pass


def layer_queries(q, layers: int) -> list:
    """`layers` distinct queries for one jitted step of that many attention calls, as a model's layers make them:
    q, then q times 1 + i / 128 (identical calls could be merged by XLA)."""
    import jax.numpy as jnp

    return [q] + [q * jnp.asarray(1 + i / 128, q.dtype) for i in range(1, layers)]


def chained_layers(one_call):
    """step(qs, *args) -> [one_call(q, *args) for q in qs], each call ordered after the one before as a model's layers
    are (layer i's query is available only once layer i - 1's output is: an optimization barrier ties them, with no
    extra kernel), so XLA neither runs two calls at once nor reorders them."""
    import jax

    def step(qs, *args):
        outs = []
        for q in qs:
            if outs:
                q, _ = jax.lax.optimization_barrier((q, outs[-1]))
            outs.append(one_call(q, *args))
        return outs

    return step


def in_one_step(one_call, q, args: tuple, layers: int):
    """The bench's callable for `one_call(q, *args)` (jitted): one call a step, or (layers > 1) one jitted step of
    `layers` calls on distinct queries (`layer_queries`), each after the one before (`chained_layers`), timed per call
    (`PerCall`): the op as a model's forward step runs it, the step's dispatch shared by its layers."""
    import jax

    if layers == 1:
        fn = jax.jit(one_call)
        return lambda: fn(q, *args)
    qs = layer_queries(q, layers)
    fn = jax.jit(chained_layers(one_call))
    return PerCall(lambda: fn(qs, *args), layers)


def decode_jaxattn(inp: Inputs, config=None, programs_per_sm=None, impl=None, layers: int = 1, split_waves=None,
                   max_kv_splits=None):
    from jaxattn import decode, metadata, tuning

    case = inp.case
    if split_waves is None and programs_per_sm is None and max_kv_splits is None:  # the default, as TritonBackend's
        split_waves = tuning.default_decode_split_waves(case.head_dim, case.dv, case.q_heads, case.kv_heads, case.fp8)
    split_kw = dict(programs_per_sm=programs_per_sm, split_waves=split_waves, max_kv_splits=max_kv_splits)
    split_kw = {name: value for name, value in split_kw.items() if value is not None}
    meta = metadata.decode_metadata_from_indptr(
        inp.kv_indptr, inp.kv_indices, inp.seq_lens, q_heads=case.q_heads, kv_heads=case.kv_heads, **split_kw
    )
    # Several new tokens (a verify step): q [batch, tokens, q_heads, dim], causal over the sequence's last keys.
    q = inp.q if case.new == 1 else inp.q.reshape(case.batch, case.new, case.q_heads, case.head_dim)
    if case.v_in_k:  # MLA: V is the first Dv dims of the latent K; the kernel reads the pool once
        return in_one_step(lambda q, k, m: decode.decode_attention(q, k, None, m, v_head_dim=case.dv, config=config,
                                                                   k_scale=inp.k_scale, impl=impl),
                           q, (inp.k_pool, meta), layers)
    return in_one_step(lambda q, k, v, m: decode.decode_attention(q, k, v, m, config=config, impl=impl, **scales(inp)),
                       q, (inp.k_pool, inp.v_pool, meta), layers)


def decode_mgpu(inp: Inputs):
    """The Mosaic GPU MLA kernel (`impl="mgpu"`; fp8 latent caches "mgpu-fp8", its producer converting the tiles),
    MLA cases only."""
    if not inp.case.v_in_k:
        raise Skip("the Mosaic GPU MLA decode kernel takes MLA's latent cache only")
    return decode_jaxattn(inp, impl="mgpu-fp8" if inp.case.fp8 else "mgpu")


def decode_mgpu_gqa(inp: Inputs, config=None):
    """The Mosaic GPU GQA kernel (`impl="mgpu-gqa"`, fp8 pools "mgpu-gqa-fp8"): separate K/V pools, one token per
    sequence."""
    if inp.case.v_in_k or inp.case.new != 1:
        raise Skip("the Mosaic GPU GQA decode kernel takes separate K/V pools and one token per sequence")
    return decode_jaxattn(inp, config=config, impl="mgpu-gqa-fp8" if inp.case.fp8 else "mgpu-gqa")


def decode_as_extend(inp: Inputs):
    """A verify step (several new tokens per sequence) through extend_attention, what it would run without the
    several-token decode form."""
    if inp.case.new == 1:
        raise Skip("one token per sequence: the decode op itself")
    return extend_jaxattn(inp, impl=None)


def verify_flashinfer_fa3(inp: Inputs):
    """A verify step (several new tokens per sequence, causal) on FlashInfer's fa3 paged prefill."""
    reason = verify_flashinfer_fa3_declines(inp.case)
    if reason:
        raise Skip(reason)
    return extend_flashinfer(inp, "fa3")


def verify_flashinfer_fa3_declines(case) -> str | None:
    """Why the flashinfer-fa3 row skips a decode case, or None."""
    if case.new == 1:
        return "one token per sequence: FlashInfer's decode rows"
    return extend_flashinfer_declines(case, "fa3")


def scales(inp: Inputs) -> dict:
    """The ops' k_scale / v_scale for the case's pool (none for bf16)."""
    return {} if inp.k_scale is None else dict(k_scale=inp.k_scale, v_scale=inp.v_scale)


def decode_reference(inp: Inputs):
    import jax

    from jaxattn.reference import ragged_paged_attention_reference

    case = inp.case
    if case.batch * case.q_heads * (case.prefix + 1) * 4 > 8e9:
        raise Skip("reference too large")
    max_len = case.prefix + case.new
    fn = jax.jit(
        lambda q, k, v, qo, kvp, kvi: ragged_paged_attention_reference(q, k, v, qo, kvp, kvi, max_q_len=case.new,
                                                                       max_kv_len=max_len, **scales(inp))
    )
    return lambda: fn(inp.q, inp.k_pool, inp.v_pool, inp.qo_indptr, inp.kv_indptr, inp.kv_indices)


def torch_views(inp: Inputs):
    try:
        import torch
    except ImportError:
        raise Skip("torch not installed")
    import jax
    import jax.numpy as jnp

    from jaxattn.fp8 import is_fp8

    def view(x):
        if is_fp8(x.dtype):  # fp8 through DLPack as bytes, viewed as torch's fp8 (a copy made once, before timing)
            fp8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}[jnp.dtype(x.dtype).name]
            return torch.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint8)).view(fp8)
        return torch.from_dlpack(x)

    return torch, {name: view(getattr(inp, name)) for name in ("q", "k_pool", "v_pool", "kv_indptr", "kv_indices", "qo_indptr")}


def flashinfer_pages(inp: Inputs, torch):
    """FlashInfer's paged-KV plan lists of the whole sequences at the case's page size, as CUDA tensors:
    (kv_indptr over pages, kv_indices: page ids, kv_last_page_len), from `jaxattn.backends.flashinfer.paged_kv_lists`
    (what FlashInferBackend plans). Page size 1: the token lists, every last_page_len 1."""
    from jaxattn.backends.flashinfer import paged_kv_lists

    batch = inp.case.batch
    lists = paged_kv_lists(np.asarray(inp.req_to_page), np.arange(batch), np.zeros(batch, np.int64), np.asarray(inp.seq_lens),
                           inp.case.page_size)
    return tuple(torch.from_numpy(x).cuda() for x in lists)


def flashinfer_cache(inp: Inputs, tv: dict):
    """(K, V) as FlashInfer's NHD pages: [slots // P, P, Hkv, D] views of the pools (`paged_pool_view`, no copy)."""
    from jaxattn.backends.flashinfer import paged_pool_view

    return paged_pool_view(tv["k_pool"], inp.case.page_size), paged_pool_view(tv["v_pool"], inp.case.page_size)


def flashinfer_session(inp: Inputs, workspace_mb: int = 256):
    """(the flashinfer module, torch, the inputs as torch views, a workspace buffer); Skip without FlashInfer."""
    try:
        import flashinfer
    except ImportError:
        raise Skip("flashinfer not installed")
    torch, tv = torch_views(inp)
    return flashinfer, torch, tv, torch.empty(workspace_mb << 20, dtype=torch.uint8, device="cuda")


def decode_flashinfer_declines(case, through_jax: bool = False) -> str | None:
    """Why the flashinfer decode rows skip a case, or None."""
    if case.v_head_dim is not None:
        return "MLA shapes need FlashInfer's MLA wrapper"
    if case.new > 1:  # its decode kernels take one query per sequence (given more rows, the H200 run faulted)
        return "several tokens per sequence: FlashInfer's verify is its prefill (row flashinfer-fa3)"
    if through_jax and case.fp8:
        return "the bridge rows time bf16 pools"
    return None


def decode_flashinfer_backend(case, tensor_cores: bool) -> str:
    """The decode wrapper's `backend`. Tensor-core decode runs FlashInfer's prefill kernels; 0.6.0's "auto" picks fa3
    on sm_90, whose module for bf16 q over an fp8 pool does not build: fa2 where fa3 declines the pool (as
    FlashInferBackend does)."""
    import jax.numpy as jnp

    from jaxattn.backends.flashinfer import fa3_declines

    if tensor_cores and fa3_declines(jnp.bfloat16, jnp.dtype(case.kv_dtype), case.head_dim, case.head_dim):
        return "fa2"
    return "auto"


def decode_flashinfer(inp: Inputs, tensor_cores: bool, through_jax: bool = False, layers: int = 1,
                      launch: str = "bridge"):
    case = inp.case
    reason = decode_flashinfer_declines(case, through_jax)
    if reason:
        raise Skip(reason)
    flashinfer, torch, tv, workspace = flashinfer_session(inp)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores,
                                                            backend=decode_flashinfer_backend(case, tensor_cores))
    kv_indptr, kv_indices, last_page_len = flashinfer_pages(inp, torch)
    kv_type = tv["k_pool"].dtype  # bf16, or fp8 (FlashInfer decodes fp8 KV with bf16 queries)
    wrapper.plan(
        kv_indptr, kv_indices, last_page_len, case.q_heads, case.kv_heads, case.head_dim, case.page_size,
        q_data_type=torch.bfloat16, kv_data_type=kv_type,
    )
    k, v = flashinfer_cache(inp, tv)  # [slots // P, P, Hkv, D]
    q = tv["q"]
    if through_jax:
        return bridged(wrapper, inp, layers, launch=launch)
    if layers > 1:
        return torch_layers(torch, wrapper, q, (k, v), case.dv, layers, **scales(inp))
    return lambda: wrapper.run(q, (k, v), **scales(inp))


def torch_layers(torch, wrapper, q, kv, dv: int, layers: int, *variant, **run_kwargs):
    """The planned wrapper launched from torch `layers` times per call (time_calls divides by it), each launch into its
    own preallocated output and LSE: the work and the sample shape of the `*-ffi-8-layers` rows (whose launches
    write the LSE too), so the two compare like for like."""
    outs = [torch.empty(*q.shape[:2], dv, dtype=q.dtype, device=q.device) for _ in range(layers)]
    lses = [torch.empty(*q.shape[:2], dtype=torch.float32, device=q.device) for _ in range(layers)]

    def step():
        for out, lse in zip(outs, lses):
            wrapper.run(q, kv, *variant, out=out, lse=lse, return_lse=True, **run_kwargs)

    return PerCall(step, layers)


def decode_flashinfer_mla_declines(case) -> str | None:
    """Why the flashinfer-mla row skips a case, or None."""
    if not case.v_in_k or (case.head_dim, case.dv) != (576, 512):
        return "FlashInfer's MLA wrapper takes the 576/512 latent head"
    if case.fp8:
        return "fp8 latent cache: not wired for FlashInfer's MLA wrapper"
    return None


def decode_flashinfer_mla(inp: Inputs):
    """FlashInfer's MLA decode (`BatchMLAPagedAttentionWrapper`, backend "auto") over the same latent pool: ckv = the
    first 512 dims, kpe = the last 64 (strided views of the pool, as SGLang passes them), causal over several new
    tokens."""
    case = inp.case
    reason = decode_flashinfer_mla_declines(case)
    if reason:
        raise Skip(reason)
    flashinfer, torch, tv, workspace = flashinfer_session(inp)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="auto")
    kv_indptr, kv_indices, _ = flashinfer_pages(inp, torch)
    qo_indptr = torch.arange(case.batch + 1, dtype=torch.int32, device="cuda") * case.new
    kv_lens = torch.from_numpy(np.asarray(inp.seq_lens)).cuda()
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, case.q_heads, 512, 64, case.page_size, case.new > 1,
                 1.0 / float(np.sqrt(case.head_dim)), torch.bfloat16, torch.bfloat16)
    pages = tv["k_pool"].reshape(-1, case.page_size, case.head_dim)  # [slots // P, P, 576]
    ckv, kpe = pages[..., :512], pages[..., 512:]
    q_nope, q_pe = tv["q"][..., :512].contiguous(), tv["q"][..., 512:].contiguous()
    return lambda: wrapper.run(q_nope, q_pe, ckv, kpe)


@functools.cache
def ffi_launcher():
    """The process's `FfiLauncher` (FlashInferBackend(launch="ffi")'s launch path; its FFI targets are registered once
    per wrapper and shapes), or Skip with the launcher's own refusal (no jax-tvm-ffi, a FlashInfer it cannot replay)."""
    from jaxattn.backends.flashinfer_ffi import FfiLauncher

    try:
        import flashinfer

        return FfiLauncher(flashinfer_version=flashinfer.__version__)
    except (ImportError, NotImplementedError) as error:
        raise Skip(str(error)) from error


def bridged(wrapper, inp: Inputs, layers: int = 1, variant_args: tuple = (), launch: str = "bridge"):
    """The same planned wrapper, called from a jitted JAX function through jaxattn's DLPack bridge, or (launch "ffi")
    through the XLA FFI launch FlashInferBackend(launch="ffi") uses.

    layers > 1: one jitted step makes that many calls, like a model's attention layers (time_calls divides by it),
    so the per-call dispatch of the jitted function is shared as in a real forward step: `in_one_step`, as jaxattn's
    rows (distinct queries, each call after the one before). No call needs has_side_effect, which, as a JAX effect,
    would take every call of the step off JAX's C++ dispatch path (pxla's `create_cpp_call`), where
    FlashInferBackend's calls are.
    """
    from jaxattn.backends.flashinfer import bridged_run

    run = ffi_launcher().run if launch == "ffi" else bridged_run

    def one_call(q, k, v):
        return run(wrapper, q, k, v, inp.case.dv, page_size=inp.case.page_size, variant_args=variant_args)[0]

    return in_one_step(one_call, inp.q, (inp.k_pool, inp.v_pool), layers)


def extend_meta(inp: Inputs, unified: bool = False, full_window_lists: bool = False):
    """The case's `ExtendMetadata` (or `ExtendUnifiedMetadata`): every sequence extends by case.new over case.prefix.
    Window cases get window-cut lists, as TritonBackend builds them; full_window_lists (unified): the full lists,
    the window given to the op alone, where TritonBackend's deterministic window layers take them
    (`jaxattn.extend_mgpu.unified_window_on_full_lists`)."""
    import jax.numpy as jnp

    from jaxattn import metadata, paging
    from jaxattn.extend_mgpu import unified_window_on_full_lists

    case = inp.case
    extend_lens = jnp.full((case.batch,), case.new, jnp.int32)
    window = case.sliding_window
    if unified and full_window_lists and unified_window_on_full_lists(
            inp.q, inp.k_pool, inp.v_pool, sliding_window=window, custom_mask=inp.custom_mask, logit_cap=case.logit_cap,
            sinks=inp.sinks, xai_temperature_len=case.xai_temperature_len):
        window = -1
    sizes = dict(max_extend_len=case.new, kv_capacity=case.batch * (case.prefix + case.new), sliding_window=window)
    if case.page_size > 1:
        pages = (inp.req_to_page, inp.req_pool_indices, inp.prefix_lens, extend_lens)
        sizes.update(page_size=case.page_size, num_slots=inp.k_pool.shape[0])
        if unified:
            return paging.extend_unified_metadata_from_pages(*pages, inp.new_slots, **sizes)
        return paging.extend_metadata_from_pages(*pages, **sizes)
    if unified:
        return metadata.extend_unified_metadata(inp.req_to_token, inp.req_pool_indices, inp.prefix_lens, extend_lens,
                                                inp.new_slots, **sizes)
    return metadata.extend_metadata(inp.req_to_token, inp.req_pool_indices, inp.prefix_lens, extend_lens, **sizes)


def extend_jaxattn(inp: Inputs, config=None, unified=False, impl="triton", layers: int = 1):
    from jaxattn import extend

    meta = extend_meta(inp, unified, full_window_lists=impl is None)
    features = inp.case.features
    features = dict(features, **scales(inp))
    if unified:
        return in_one_step(lambda q, k, v, m, s, c: extend.extend_attention_unified(
            q, k, v, m, sinks=s, custom_mask=c, config=config, impl=impl, **features),
            inp.q, (inp.k_pool, inp.v_pool, meta, inp.sinks, inp.custom_mask), layers)
    return in_one_step(lambda q, kn, vn, k, v, m, s, c: extend.extend_attention(
        q, kn, vn, k, v, m, sinks=s, custom_mask=c, config=config, impl=impl, **features),
        inp.q, (inp.k_new, inp.v_new, inp.k_pool, inp.v_pool, meta, inp.sinks, inp.custom_mask), layers)


def extend_mgpu_fp8(inp: Inputs, unified=False):
    """fp8 cases on the Mosaic GPU kernel that reads the fp8 pool itself (`impl="mgpu-fp8"` / "mgpu-unified-fp8":
    its producer converts each tile in shared memory), beside `jaxattn`'s route, which dequantises the listed keys."""
    if not inp.case.fp8:
        raise Skip("fp8 cases only")
    return extend_jaxattn(inp, unified=unified, impl="mgpu-unified-fp8" if unified else "mgpu-fp8")


def extend_mla(inp: Inputs, impl: str | None = None):
    """Absorbed-MLA cases through `jaxattn.mla.mla_extend_attention` (V read from the latent rows, no V arrays):
    what it picks, or `impl` ("mgpu-gqa": the GQA extend kernel over the latent cache, 288/256 only)."""
    import jax

    from jaxattn.mla import mla_extend_attention

    if not inp.case.v_in_k or inp.case.fp8:
        raise Skip("absorbed MLA cases (one latent head, V inside K) with a 16-bit cache")
    if impl == "mgpu-gqa" and (inp.case.head_dim, inp.case.dv) != (288, 256):
        raise Skip("the GQA extend kernel takes the 288/256 latent head only")
    meta = extend_meta(inp)
    fn = jax.jit(lambda q, kn, k, m: mla_extend_attention(q, kn, k, m, v_head_dim=inp.case.dv, impl=impl))
    return lambda: fn(inp.q, inp.k_new, inp.k_pool, meta)


def extend_draft_words(inp: Inputs, mgpu: bool = False):
    """A tree-verify case's mask in its compact form (`extend_attention(draft_mask=)`: per-row draft words, no [new,
    prefix + new] mask): what extend_attention picks for it, or (mgpu) the Mosaic GPU kernel's own entry."""
    import jax
    import jax.numpy as jnp

    from jaxattn import extend
    from jaxattn.impl.mgpu_extend import extend_attention_mgpu
    from jaxattn.metadata import draft_mask_words

    case = inp.case
    if not case.tree:
        raise Skip("a tree-verify case's mask (the compact form of its custom mask)")
    draft_mask = jnp.tile(draft_mask_words(draft_tree(case.new)), (case.batch, 1))  # u32[batch * new, words]
    meta = extend_meta(inp)
    features = dict(case.features, **scales(inp))
    if mgpu:
        fn = jax.jit(lambda q, kn, vn, k, v, m, s, d: extend_attention_mgpu(q, kn, vn, k, v, m, sinks=s, draft_mask=d,
                                                                             **case.features))
    else:
        fn = jax.jit(lambda q, kn, vn, k, v, m, s, d: extend.extend_attention(q, kn, vn, k, v, m, sinks=s, draft_mask=d,
                                                                              **features))
    return lambda: fn(inp.q, inp.k_new, inp.v_new, inp.k_pool, inp.v_pool, meta, inp.sinks, draft_mask)


def extend_mgpu(inp: Inputs, config=None):
    import jax

    from jaxattn.impl.mgpu_extend import HEAD_DIMS_TEXT, MGPU_HEAD_DIMS, extend_attention_mgpu

    case = inp.case
    if (case.head_dim, case.dv) not in MGPU_HEAD_DIMS:
        raise Skip(f"the Mosaic GPU kernel takes head dims {HEAD_DIMS_TEXT}")
    if case.fp8:
        raise Skip("fp8 pools reach the kernel through extend_attention (row 'jaxattn')")
    meta = extend_meta(inp)
    features = case.features
    fn = jax.jit(lambda q, kn, vn, k, v, m, s, c: extend_attention_mgpu(q, kn, vn, k, v, m, sinks=s, custom_mask=c,
                                                                         config=config, **features))
    return lambda: fn(inp.q, inp.k_new, inp.v_new, inp.k_pool, inp.v_pool, meta, inp.sinks, inp.custom_mask)


def extend_reference(inp: Inputs):
    import jax

    from jaxattn.reference import ragged_paged_attention_reference

    case = inp.case
    if case.fp8:
        raise Skip("the new tokens' bf16 rows are not in the fp8 pool")
    rows = case.new * (case.prefix + case.new)  # one sequence's mask entries
    mask_indptr = None if inp.custom_mask is None else (np.arange(case.batch + 1) * rows).astype(np.int32)
    fn = jax.jit(
        lambda q, k, v, qo, kvp, kvi, s, c, mi: ragged_paged_attention_reference(
            q, k, v, qo, kvp, kvi, sinks=s, custom_mask=c, mask_indptr=mi, max_q_len=case.new,
            max_kv_len=case.prefix + case.new, **case.features
        )
    )
    return lambda: fn(inp.q, inp.k_pool, inp.v_pool, inp.qo_indptr, inp.kv_indptr, inp.kv_indices, inp.sinks,
                      inp.custom_mask, mask_indptr)


def extend_flashinfer_declines(case, backend: str, through_jax: bool = False) -> str | None:
    """Why the flashinfer-{backend} extend rows skip a case, or None."""
    if case.v_in_k:
        return "MLA latent cache: FlashInfer's paged prefill takes separate K and V heads (row flashinfer-mla: its MLA wrapper)"
    if case.sinks and (case.logit_cap > 0 or case.tree):
        return "FlashInfer's sink-aware wrapper takes no soft cap and no custom mask"
    if case.xai_temperature_len > 0:
        return "FlashInfer has no xai temperature"
    if case.dv != case.head_dim:
        # Seen on the H200 (0.6.0, T192): "K and V must have same page stride for sparse attention (3072 vs. 2048)".
        return "FlashInfer's paged prefill needs K and V pages of one stride (equal head dims)"
    if case.tree and backend == "fa3":
        return "FlashInfer's fa3 prefill takes no custom mask (row flashinfer-fa2)"
    if backend == "fa3":
        import jax.numpy as jnp

        from jaxattn.backends.flashinfer import fa3_declines

        reason = fa3_declines(jnp.bfloat16, jnp.dtype(case.kv_dtype), case.head_dim, case.dv)
        if reason:
            return f"{reason} (row flashinfer-fa2)"
    if case.fp8 and through_jax:
        return "the bridge rows time bf16 pools"
    return None


def extend_flashinfer(inp: Inputs, backend: str, through_jax: bool = False, layers: int = 1, launch: str = "bridge"):
    case = inp.case
    reason = extend_flashinfer_declines(case, backend, through_jax)
    if reason:
        raise Skip(reason)
    flashinfer, torch, tv, workspace = flashinfer_session(inp, workspace_mb=512)
    if case.sinks:  # its paged prefill with the "AttentionSink" variant (what FlashInferBackend plans for sink layers)
        wrapper = flashinfer.BatchAttentionWithAttentionSinkWrapper(
            workspace, "NHD", backend=backend, q_data_type=torch.bfloat16, kv_data_type=tv["k_pool"].dtype,
            head_dim_qk=case.head_dim, head_dim_vo=case.dv, window_left=case.sliding_window)
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
    kv_indptr, kv_indices, last_page_len = flashinfer_pages(inp, torch)
    wrapper.plan(
        tv["qo_indptr"], kv_indptr, kv_indices, last_page_len, case.q_heads, case.kv_heads, case.head_dim, case.page_size,
        head_dim_vo=case.dv, causal=case.causal and not case.tree, window_left=case.sliding_window,
        custom_mask=None if inp.custom_mask is None else torch.from_dlpack(inp.custom_mask),
        logits_soft_cap=case.logit_cap if case.logit_cap > 0 else None, q_data_type=torch.bfloat16,
        kv_data_type=tv["k_pool"].dtype,
    )
    k, v = flashinfer_cache(inp, tv)
    q = tv["q"]
    variant, run_scales = (), scales(inp)
    if case.sinks:  # the variant's own sm_scale takes k_scale (`sink_variant_args`)
        from jaxattn.backends.flashinfer import sink_variant_args

        variant = sink_variant_args(inp.sinks, 1.0 / float(np.sqrt(case.head_dim)), run_scales.pop("k_scale", None))
    if through_jax:
        return bridged(wrapper, inp, layers, variant_args=variant, launch=launch)
    torch_variant = tuple(torch.from_dlpack(a) if hasattr(a, "__dlpack__") else a for a in variant)
    if layers > 1:
        return torch_layers(torch, wrapper, q, (k, v), case.dv, layers, *torch_variant, **run_scales)
    return lambda: wrapper.run(q, (k, v), *torch_variant, **run_scales)


def extend_cudnn(inp: Inputs):
    import jax

    case = inp.case
    if case.prefix != 0:
        raise Skip("dense only (no cached prefix)")
    if case.sliding_window >= 0 or case.logit_cap > 0 or case.sinks or case.xai_temperature_len > 0 or case.tree:
        raise Skip("no score features (a window, cap, sinks, xai temperature or custom mask)")
    q = inp.q.reshape(case.batch, case.new, case.q_heads, case.head_dim)
    k = inp.k_new.reshape(case.batch, case.new, case.kv_heads, case.head_dim)
    v = inp.v_new.reshape(case.batch, case.new, case.kv_heads, case.dv)
    fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=case.causal, implementation="cudnn"))
    return lambda: fn(q, k, v)


BACKENDS = {
    "decode": {
        "jaxattn": (decode_jaxattn, jax_sync),
        "jaxattn-triton": (lambda inp: decode_jaxattn(inp, impl="triton"), jax_sync),
        # 8 calls in one jitted step (a model's layers), per call: the step's dispatch shared as in a forward pass
        "jaxattn-8-layers": (lambda inp: decode_jaxattn(inp, layers=8), jax_sync),
        "jaxattn-mgpu": (decode_mgpu, jax_sync),  # MLA on the Mosaic GPU kernel
        "jaxattn-mgpu-gqa": (decode_mgpu_gqa, jax_sync),  # GQA (fp8 or 16-bit pools) on the Mosaic GPU kernel
        "jaxattn-extend": (decode_as_extend, jax_sync),
        "flashinfer": (lambda inp: decode_flashinfer(inp, False), torch_sync),
        # launched from torch 8 times per timed call into preallocated outputs and LSEs, as the FFI rows run
        "flashinfer-8-layers": (lambda inp: decode_flashinfer(inp, False, layers=8), torch_sync),
        "flashinfer-tc": (lambda inp: decode_flashinfer(inp, True), torch_sync),
        "flashinfer-mla": (decode_flashinfer_mla, torch_sync),
        "flashinfer-fa3": (verify_flashinfer_fa3, torch_sync),
        "flashinfer-in-jit": (lambda inp: decode_flashinfer(inp, False, through_jax=True), jax_sync),
        "flashinfer-in-jit-8-layers": (lambda inp: decode_flashinfer(inp, False, through_jax=True, layers=8), jax_sync),
        "flashinfer-ffi-8-layers": (lambda inp: decode_flashinfer(inp, False, through_jax=True, layers=8, launch="ffi"),
                                    jax_sync),
        # one FFI launch a jitted step: beside the 8-call step, whether a cost is paid per step or per launch
        "flashinfer-ffi": (lambda inp: decode_flashinfer(inp, False, through_jax=True, launch="ffi"), jax_sync),
        "reference": (decode_reference, jax_sync),
    },
    "extend": {
        "jaxattn": (lambda inp: extend_jaxattn(inp, impl=None), jax_sync),  # what extend_attention picks
        "jaxattn-triton": (extend_jaxattn, jax_sync),
        "jaxattn-8-layers": (lambda inp: extend_jaxattn(inp, impl=None, layers=8), jax_sync),
        "jaxattn-unified": (lambda inp: extend_jaxattn(inp, unified=True, impl=None), jax_sync),  # what it picks
        "jaxattn-unified-triton": (lambda inp: extend_jaxattn(inp, unified=True, impl="triton-unified"), jax_sync),
        "jaxattn-mgpu-fp8": (extend_mgpu_fp8, jax_sync),  # fp8 cases: the kernel converts tiles itself
        "jaxattn-mgpu-unified-fp8": (lambda inp: extend_mgpu_fp8(inp, unified=True), jax_sync),
        "jaxattn-mla": (extend_mla, jax_sync),  # absorbed MLA: mla_extend_attention (V inside the latent rows)
        # ... on the GQA extend kernel (V read from the latent K tiles; 288/256): impl "mgpu-gqa"
        "jaxattn-mla-gqa": (lambda inp: extend_mla(inp, impl="mgpu-gqa"), jax_sync),
        "jaxattn-draft-words": (extend_draft_words, jax_sync),  # tree cases: the mask as per-row draft words
        "jaxattn-mgpu-draft-words": (lambda inp: extend_draft_words(inp, mgpu=True), jax_sync),
        "flashinfer-fa2": (lambda inp: extend_flashinfer(inp, "fa2"), torch_sync),
        "flashinfer-fa3": (lambda inp: extend_flashinfer(inp, "fa3"), torch_sync),
        "flashinfer-fa3-8-layers": (lambda inp: extend_flashinfer(inp, "fa3", layers=8), torch_sync),
        "flashinfer-fa3-in-jit": (lambda inp: extend_flashinfer(inp, "fa3", through_jax=True), jax_sync),
        "flashinfer-fa3-in-jit-8-layers": (lambda inp: extend_flashinfer(inp, "fa3", through_jax=True, layers=8),
                                           jax_sync),
        "flashinfer-fa3-ffi-8-layers": (lambda inp: extend_flashinfer(inp, "fa3", through_jax=True, layers=8,
                                                                      launch="ffi"), jax_sync),
        "cudnn": (extend_cudnn, jax_sync),
        "reference": (extend_reference, jax_sync),
    },
}
