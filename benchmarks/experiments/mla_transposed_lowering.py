"""Does Mosaic GPU take the pieces of a transposed MLA decode tile? Lowers them for sm_90 (no GPU needed).

Issue 22: the MLA decode kernel (`kernels/mla_attention_mgpu.py`) computes S = Q K^T with Q's 16 heads padded to
wgmma's 64 rows, so 3/4 of its matrix work (and of Q's 72 KB buffer) is padding; at 64 x 4096 a tile's slot turns
over once per copy and both warpgroups' matrix work (benchmarks/RESULTS.md, twenty-sixth session). The transposed
form puts the keys on wgmma's M and the (token, head) rows on N:

    S^T = K Q^T          [64 keys, N rows]   A: the latent tile (K-major), B: Q [N, 576] transposed
    m, l per column      softmax over the keys: reductions along axis 0
    P stored as [N, 64]  through a transposed view of a 128-byte-swizzled buffer (wgmma takes one swizzle per call)
    O^T += V^T P^T       [512, N]            A: the tile's first 512 columns transposed, B: P's buffer transposed

Each step below adds one piece; all lower with jax 0.11.2 (2026-12-05). Not run on a GPU, not a kernel: the rest
(the output's transposed store, the LSE per column, masks along axis 0, the producer) is the work left.

    PYTHONPATH=.venv/mosaic_gpu_lowering:. JAX_PLATFORMS=cpu python benchmarks/experiments/mla_transposed_lowering.py
"""

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from jaxattn.kernels.extend_attention_mgpu import SWIZZLED

ROWS = 16  # MLA's 16 heads, one token: wgmma's N


def tile_kernel(steps: int):
    """A one-warpgroup kernel running the first `steps` pieces of the transposed tile (0: S^T only)."""

    def entry(o_ref, s_ref_out):
        def body(k_smem, q_smem, p_smem):
            def qk(s_ref):
                plgpu.wgmma(s_ref, k_smem, q_smem.transpose((1, 0)))
                return s_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((64, ROWS), jnp.float32))  # S^T: keys x rows
            if steps >= 1:  # the softmax over keys: axis 0
                s = jnp.exp2(s - jnp.max(s, axis=0)[None, :])
            s_ref_out[...] = s
            if steps >= 2:  # P through a transposed view; O^T += V^T P^T
                p_smem.transpose((1, 0))[...] = s.astype(jnp.bfloat16)
                acc = plgpu.layout_cast(jnp.zeros((512, ROWS), jnp.float32), plgpu.Layout.WGMMA)

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, k_smem.at[:, pl.ds(0, 512)].transpose((1, 0)), p_smem.transpose((1, 0)))

                o_ref[...] = pl.run_state(pv)(plgpu.ACC.init(acc))

        pl.run_scoped(body, plgpu.SMEM((64, 576), jnp.bfloat16, transforms=SWIZZLED),
                      plgpu.SMEM((ROWS, 576), jnp.bfloat16, transforms=SWIZZLED),
                      plgpu.SMEM((ROWS, 64), jnp.bfloat16, transforms=SWIZZLED), collective_axes="wg")

    return plgpu.kernel(entry, out_type=(jax.ShapeDtypeStruct((512, ROWS), jnp.float32),
                                         jax.ShapeDtypeStruct((64, ROWS), jnp.float32)),
                        num_threads=1, thread_name="wg")


if __name__ == "__main__":
    for steps, what in enumerate(("S^T = K Q^T", "+ softmax along keys", "+ P^T through smem, O^T += V^T P^T")):
        try:
            jax.export.export(jax.jit(tile_kernel(steps)), platforms=["cuda"])()
            print(f"ok   {what}")
        except Exception as error:  # report each piece
            print(f"FAIL {what}: {type(error).__name__}: {str(error)[:300]}")
