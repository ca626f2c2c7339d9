"""A small end-to-end run of jaxattn's kernel path (CPU: Triton interpreter; GPU: compiled kernels).

A batch of 3 requests whose tokens sit at scattered KV-pool slots: build their KV index lists with
`create_kv_indices` inside jit, attend over the cached prefix and over the new tokens separately, merge
the two states with the `merge_state` kernel, and check the result against attention over everything.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.kv_indices import create_kv_indices
from jaxattn.launch import launch_mode
from jaxattn.merge_state import merge_state
from jaxattn.reference import ragged_paged_attention_reference


def main():
    rng = np.random.default_rng(0)
    q_heads, kv_heads, head_dim = 8, 2, 64
    prefix_lens = np.array([37, 5, 120], np.int32)
    new_lens = np.array([4, 9, 1], np.int32)
    batch, max_ctx = len(prefix_lens), 256
    total = prefix_lens + new_lens
    num_slots = 1 + int(total.sum())  # slot 0 is the padding slot
    slots = rng.permutation(np.arange(1, num_slots))
    req_to_token = np.zeros((4, max_ctx), np.int32)
    pool_rows = np.array([2, 0, 3], np.int32)
    start = 0
    for b in range(batch):
        req_to_token[pool_rows[b], : total[b]] = slots[start : start + total[b]]
        start += total[b]
    k_pool = jnp.asarray(rng.standard_normal((num_slots, kv_heads, head_dim)), jnp.bfloat16)
    v_pool = jnp.asarray(rng.standard_normal((num_slots, kv_heads, head_dim)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((int(new_lens.sum()), q_heads, head_dim)), jnp.bfloat16)
    qo_indptr = jnp.asarray(np.concatenate([[0], np.cumsum(new_lens)]), jnp.int32)

    @jax.jit
    def attend_in_two_parts(q, k_pool, v_pool, req_to_token, pool_rows, prefix_lens, new_lens):
        prefix_indptr, prefix_indices = create_kv_indices(req_to_token, pool_rows, prefix_lens, capacity=256)
        new_indptr, new_indices = create_kv_indices(req_to_token, pool_rows, new_lens, prefix_lens, capacity=32)
        common = dict(return_lse=True, max_q_len=16, max_kv_len=128)
        o_prefix, lse_prefix = ragged_paged_attention_reference(
            q, k_pool, v_pool, qo_indptr, prefix_indptr, prefix_indices, causal=False, **common)
        o_new, lse_new = ragged_paged_attention_reference(
            q, k_pool, v_pool, qo_indptr, new_indptr, new_indices, causal=True, **common)
        return merge_state(o_prefix, lse_prefix, o_new, lse_new)

    args = [jnp.asarray(x) for x in (req_to_token, pool_rows, prefix_lens, new_lens)]
    t0 = time.perf_counter()
    o, lse = jax.block_until_ready(attend_in_two_parts(q, k_pool, v_pool, *args))
    seconds = time.perf_counter() - t0

    _, all_indices = create_kv_indices(args[0], args[1], jnp.asarray(total), capacity=num_slots)
    all_indptr = jnp.asarray(np.concatenate([[0], np.cumsum(total)]), jnp.int32)
    want = ragged_paged_attention_reference(q, k_pool, v_pool, qo_indptr, all_indptr, all_indices)
    error = float(jnp.max(jnp.abs(o.astype(jnp.float32) - want.astype(jnp.float32))))
    print(f"launch mode: {launch_mode()}  (JAX backend: {jax.default_backend()})")
    print(f"batch {batch}, new tokens {new_lens.tolist()}, cached prefixes {prefix_lens.tolist()}, "
          f"heads {q_heads}/{kv_heads}, head_dim {head_dim}, bf16")
    print(f"prefix + new attention merged by the merge_state kernel: max |error| vs one pass = {error:.2e}")
    print(f"first call (compile + run): {seconds:.2f} s")
    if not error < 2e-2:
        raise SystemExit(f"demo: mismatch {error} exceeds bf16 tolerance")


if __name__ == "__main__":
    main()
