"""Can two CTAs of a cluster share the conversion of an fp8 K/V tile? Lowers for sm_90 on a CPU; runs and checks on a GPU.

Issue 26: E3-FP8 runs 1.28-1.30x its bf16 time on the Hopper extend kernel (benchmarks/RESULTS.md), whose producer
warpgroup converts every fp8 prefix tile to 16 bits in shared memory; at E3 (128 new tokens, two q heads a CTA) two
CTAs read each prefix tile and both convert all of it. Made a cluster, each could convert half a tile and store the
16-bit half into its own tile and into its peer's (`plgpu.async_store_smem`: registers to a cluster peer's swizzled
shared memory, completing the peer's mbarrier with the bytes), halving the conversion work a CTA. This checks the
pieces with jax 0.11.2: the fp8 tile loaded from its swizzled buffer, converted, its half stored into both CTAs'
swizzled 16-bit tiles under one mbarrier each; on a GPU, each CTA's tile against the whole converted tile.

    PYTHONPATH=.venv/mosaic_gpu_lowering:. JAX_PLATFORMS=cpu python benchmarks/experiments/cluster_shared_conversion.py
    python3 benchmarks/experiments/cluster_shared_conversion.py     # on a GPU: run and compare

Lowered for e4m3fn and e5m2 on 2026-12-07 (fortieth session); not yet run on a GPU, not in the kernel. Open there:
how the peer's barrier counts the stores' arrivals at run time, and whether the stores' latency hides behind the
consumers' matrix work.

In the kernel (a sketch, not built): the cluster pairs the CTAs of one (sequence, q tile, kv head) that differ only
in their q heads, so both take the same key steps. Slot s of each CTA's ring gets its rows [h * R/2, (h + 1) * R/2)
from CTA h: that producer stages its half's fp8 rows in its own slot (inside its half's 16-bit rows, converted in
place in phases as today), stores the 16-bit rows locally and into the peer's slot (the kernel's conversion is
inline PTX, so `st.async ... mbarrier::complete_tx` to the peer's ready barrier rather than this primitive). Ready[s]
then waits for both halves; free[s] counts both CTAs' consumers (each consumer arrives on its own CTA's and, by a
remote `mbarrier.arrive ... shared::cluster`, its peer's), since the peer's producer writes into this slot; both CTAs
meet a cluster barrier before exiting. tests/barrier_model.py can check that protocol (six warpgroups) before a GPU
runs it.
"""

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np

from jaxattn.kernels.extend_attention_mgpu import SWIZZLED, SWIZZLED_8BIT
from jaxattn.kernels.mla_attention_mgpu import cluster_sync

ROWS, DIM, CTAS = 128, 128, 2  # one K (or V) tile of the extend kernel, a cluster of two CTAs


def shared_conversion(x):
    """f8[ROWS, DIM] -> bf16[CTAS, ROWS, DIM]: each CTA's 16-bit tile after the cluster converted the tile once."""

    def kernel(x_ref, o_ref):
        def body(fp8_tile, tile, loaded, converted):
            me = jax.lax.axis_index("cta")
            plgpu.copy_gmem_to_smem(x_ref, fp8_tile, loaded)
            plgpu.barrier_wait(loaded)
            half = fp8_tile[pl.ds(me * (ROWS // CTAS), ROWS // CTAS), :].astype(jnp.float16).astype(jnp.bfloat16)
            for peer in range(CTAS):  # this CTA's half into every tile of the cluster (its own included)
                plgpu.async_store_smem(half, tile.at[pl.ds(me * (ROWS // CTAS), ROWS // CTAS)], converted,
                                       cluster_idx=peer, cluster_dim="cta")
            plgpu.barrier_wait(converted)  # both halves in this CTA's tile
            cluster_sync()  # no CTA exits while a peer may still store into it
            plgpu.copy_smem_to_gmem(tile, o_ref.at[me])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(body, plgpu.SMEM((ROWS, DIM), x.dtype, transforms=SWIZZLED_8BIT),
                      plgpu.SMEM((ROWS, DIM), jnp.bfloat16, transforms=SWIZZLED), plgpu.Barrier(),
                      plgpu.Barrier(num_arrivals=CTAS))

    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((CTAS, ROWS, DIM), jnp.bfloat16), grid=(1,),
                        grid_names=("tile",), cluster=(CTAS,), cluster_names=("cta",))(x)


def main():
    on_gpu = jax.default_backend() == "gpu"
    for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        x = jax.random.normal(jax.random.key(0), (ROWS, DIM), jnp.float32).astype(dtype)
        name = jnp.dtype(dtype).name
        try:
            if not on_gpu:
                jax.export.export(jax.jit(shared_conversion), platforms=["cuda"])(x)
                print(f"lowered {name}")
                continue
            tiles = np.asarray(jax.jit(shared_conversion)(x).astype(jnp.float32))
            want = np.asarray(x.astype(jnp.float32))
            for cta in range(CTAS):
                np.testing.assert_array_equal(tiles[cta], want, err_msg=f"{name}: CTA {cta}'s tile")
            print(f"ran {name}: every CTA's tile is the whole converted tile")
        except Exception as error:  # report each dtype
            print(f"FAIL {name}: {type(error).__name__}: {str(error)[:800]}")


if __name__ == "__main__":
    main()
