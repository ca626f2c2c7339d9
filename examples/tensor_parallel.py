"""Tensor parallelism: one attention layer with its heads sharded over devices by `jax.shard_map`.

    python examples/tensor_parallel.py --devices 2     # CPU: 2 host devices, kernels in Triton's interpreter
    python examples/tensor_parallel.py                 # GPU: every visible GPU, compiled Triton kernels

Megatron-style: wq/wk/wv are split by columns (whole heads per device), wo by rows, and one psum over the
"tp" axis joins the partial outputs. Each device keeps the K/V pool of its own KV heads ([slots, kv_heads / N,
head_dim]); the batch metadata (KV index lists, splits, qo_indptr) is the same for every head, so it is built
once and replicated. Inside shard_map the kernels see only the local heads: jaxattn's ops need no change.

Two steps run: a prefill over a cached prefix (`extend_attention`: SGLang's two-stage kernel here, on host devices;
on an H200 its plain causal calls take the Mosaic GPU kernel) and then a decode step (`decode_attention`). Each is checked against the same layer run unsharded on one device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=None,
                        help="devices on the 'tp' axis (default: all). On CPU this many host devices are created.")
    parser.add_argument("--json", default=None, help="write the check's figures to this JSON file")
    return parser.parse_args(argv)


def force_host_devices(n: int) -> None:
    """Asks XLA for n CPU devices. Only works before jax initialises its backends (i.e. before first use)."""
    if "jax" in sys.modules and sys.modules["jax"]._src.xla_bridge.backends_are_initialized():
        raise RuntimeError("set --xla_force_host_platform_device_count before JAX starts: run this as a script")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.devices:
        force_host_devices(args.devices)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxattn.decode import decode_attention, decode_metadata
    from jaxattn.extend import extend_attention, extend_metadata
    from jaxattn.kv_pool import write_kv
    from jaxattn.launch import launch_mode

    devices = jax.devices()
    n = args.devices or len(devices)
    if n > len(devices):
        raise SystemExit(f"asked for {n} devices, JAX sees {len(devices)}: {devices}")
    mesh = Mesh(np.array(devices[:n]), ("tp",))
    on_gpu = jax.default_backend() in ("gpu", "cuda")
    dtype = jnp.bfloat16 if on_gpu else jnp.float32

    # One layer: 8 q heads over 4 kv heads (GQA 2), head_dim 64. Heads must divide by the number of devices.
    hidden, q_heads, kv_heads, head_dim = 256, 8, 4, 64
    if kv_heads % n:
        raise SystemExit(f"{kv_heads} kv heads cannot be split over {n} devices")
    local_q, local_kv = q_heads // n, kv_heads // n
    rng = np.random.default_rng(0)
    w = lambda *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), dtype)  # noqa: E731
    wq, wk, wv = w(hidden, q_heads * head_dim), w(hidden, kv_heads * head_dim), w(hidden, kv_heads * head_dim)
    wo = w(q_heads * head_dim, hidden)

    # A batch of 3 requests with cached prefixes of 37, 5 and 70 tokens at scattered pool slots (slot 0: padding).
    prefix_lens = np.array([37, 5, 70], np.int32)
    new_lens = np.array([6, 11, 3], np.int32)
    batch, max_ctx, num_slots = len(prefix_lens), 128, 512
    slots = rng.permutation(np.arange(1, num_slots)).astype(np.int32)
    req_to_token = np.zeros((batch, max_ctx), np.int32)
    req_to_token[:, :] = slots[: batch * max_ctx].reshape(batch, max_ctx)
    k_pool = jnp.asarray(rng.standard_normal((num_slots, kv_heads, head_dim)), dtype)  # the cached prefixes' K/V
    v_pool = jnp.asarray(rng.standard_normal((num_slots, kv_heads, head_dim)), dtype)
    rows = jnp.arange(batch, dtype=jnp.int32)
    to = jnp.asarray

    # Step 1, prefill: the new tokens of each request, after its prefix.
    tokens = int(new_lens.sum())
    x_extend = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    extend_loc = to(np.concatenate([req_to_token[b, p : p + m] for b, (p, m) in enumerate(zip(prefix_lens, new_lens))]))
    extend_meta = extend_metadata(to(req_to_token), rows, to(prefix_lens), to(new_lens), max_extend_len=16, kv_capacity=256)
    # Step 2, decode: one more token per request.
    seq_lens = prefix_lens + new_lens + 1
    x_decode = jnp.asarray(rng.standard_normal((batch, hidden)), dtype)
    decode_loc = to(req_to_token[np.arange(batch), seq_lens - 1])
    # The split heuristic sizes the grid for the heads one device runs; the same metadata serves both runs.
    decode_meta = decode_metadata(to(req_to_token), rows, to(seq_lens), kv_capacity=256, q_heads=local_q, kv_heads=local_kv)

    def layer(x, wq, wk, wv, wo, k_buf, v_buf, loc, meta, *, step, tp_axis=None):
        """One attention layer over whatever heads this device holds; psum over `tp_axis` joins the heads."""
        t = x.shape[0]
        q = (x @ wq).reshape(t, -1, head_dim)
        k = (x @ wk).reshape(t, -1, head_dim)
        v = (x @ wv).reshape(t, -1, head_dim)
        k_buf, v_buf = write_kv(k_buf, v_buf, loc, k, v)
        if step == "extend":
            o = extend_attention(q, k, v, k_buf, v_buf, meta)  # prefix from the pool, new tokens from k/v
        else:
            o = decode_attention(q, k_buf, v_buf, meta)  # the whole sequence from the pool
        y = o.reshape(t, -1) @ wo  # this device's heads' share of the output projection
        if tp_axis is not None:
            y = jax.lax.psum(y, tp_axis)
        return y, k_buf, v_buf

    heads = P(None, "tp", None)  # [slots or tokens, heads, head_dim] split on the head axis
    in_specs = (P(), P(None, "tp"), P(None, "tp"), P(None, "tp"), P("tp", None), heads, heads, P(), P())

    def sharded(step):
        body = lambda *a: layer(*a, step=step, tp_axis="tp")  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(P(), heads, heads)))

    def unsharded(step):
        return jax.jit(lambda *a: layer(*a, step=step))

    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    weights = (put(wq, P(None, "tp")), put(wk, P(None, "tp")), put(wv, P(None, "tp")), put(wo, P("tp", None)))
    pool = (put(k_pool, heads), put(v_pool, heads))

    results = {}
    y_ext, k_tp, v_tp = sharded("extend")(x_extend, *weights, *pool, extend_loc, extend_meta)
    y_dec, k_tp, v_tp = sharded("decode")(x_decode, *weights, k_tp, v_tp, decode_loc, decode_meta)
    y_ext_ref, k_ref, v_ref = unsharded("extend")(x_extend, wq, wk, wv, wo, k_pool, v_pool, extend_loc, extend_meta)
    y_dec_ref, k_ref, v_ref = unsharded("decode")(x_decode, wq, wk, wv, wo, k_ref, v_ref, decode_loc, decode_meta)

    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    results = dict(
        devices=n,
        platform=jax.default_backend(),
        launch_mode=launch_mode(),
        local_pool_shape=list(k_tp.addressable_shards[0].data.shape),
        extend_max_abs_diff=float(np.max(np.abs(f32(y_ext) - f32(y_ext_ref)))),
        decode_max_abs_diff=float(np.max(np.abs(f32(y_dec) - f32(y_dec_ref)))),
        pool_max_abs_diff=float(max(np.max(np.abs(f32(k_tp) - f32(k_ref))), np.max(np.abs(f32(v_tp) - f32(v_ref))))),
    )
    tolerance = 5e-2 if dtype == jnp.bfloat16 else 1e-4
    results["tolerance"] = tolerance
    print(f"mesh: {n} x {devices[0].platform} devices on axis 'tp'; launch mode {results['launch_mode']}; {jnp.dtype(dtype).name}")
    print(f"heads per device: {local_q} q / {local_kv} kv of {q_heads} / {kv_heads}; "
          f"each device's K pool {results['local_pool_shape']} (full pool {list(k_pool.shape)})")
    print(f"prefill ({tokens} tokens over prefixes {prefix_lens.tolist()}): max |sharded - unsharded| = {results['extend_max_abs_diff']:.2e}")
    print(f"decode  ({batch} tokens, contexts {seq_lens.tolist()}): max |sharded - unsharded| = {results['decode_max_abs_diff']:.2e}")
    print(f"KV pools after both steps: max |sharded - unsharded| = {results['pool_max_abs_diff']:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    worst = max(results["extend_max_abs_diff"], results["decode_max_abs_diff"], results["pool_max_abs_diff"])
    if not worst <= tolerance:
        raise SystemExit(f"tensor_parallel: sharded and unsharded results differ by {worst:.3g} (> {tolerance})")
    print("sharded == unsharded within tolerance")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
