// Experiment (CPU only: nvcc and ptxas, no GPU): why the fp8 extend kernel's producer spilled (issue 26; RESULTS,
// thirty-fifth session). A replica of its conversion loop: each step reads 16-byte chunks of a tile and stores two
// 16-byte halves at swizzled shared-memory addresses that depend on the thread only, the same every step. The compiler
// hoists those addresses out of the loop and, past the register budget, keeps them in local memory; an opaque copy of
// the thread index inside the loop (inline asm, volatile) keeps them in the loop (what
// `jaxattn.kernels.extend_attention_mgpu.FP8_ADDRESSES_PER_TILE` does). With nvcc 13.0 for sm_90a: conv<false> takes
// 89 registers (24 bytes spilled with -maxrregcount=40), conv<true> 46 (none spilled either way).
// Usage: nvcc -arch=sm_90a -cubin -Xptxas -v [-maxrregcount=40] benchmarks/experiments/hoisted_addresses_replica.cu \
//            -o /tmp/replica.cubin
#include <cuda_fp16.h>
__device__ __forceinline__ unsigned swz(unsigned row, unsigned chunk) {
  unsigned in_tile = row % 8; unsigned tile = (row / 8) * 2 + chunk / 8;
  return tile * 1024 + in_tile * 128 + (((chunk % 8) ^ in_tile) * 16);
}
template <bool OPAQUE>
__global__ void __launch_bounds__(128) conv(const int* __restrict__ steps, float* out) {
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned acc = 0;
  int n = steps[0];
  unsigned tid0 = threadIdx.x % 128;
  for (int s = 0; s < n; ++s) {
    unsigned t = tid0;
    if (OPAQUE) asm volatile("mov.b32 %0, %1;" : "=r"(t) : "r"(tid0));
    unsigned slot = (s & 1) * 32768;
    #pragma unroll
    for (int i = 0; i < 16; ++i) {
      unsigned k = t + 128 * i; unsigned row = k / 8, chunk = k % 8;
      uint4 d = *(const uint4*)(smem + slot + 16384 + row * 128 + chunk * 16);
      uint4 o0 = make_uint4(d.x * 3, d.y * 3, d.z * 3, d.w * 3);
      uint4 o1 = make_uint4(d.x ^ 5, d.y ^ 5, d.z ^ 5, d.w ^ 5);
      *(uint4*)(smem + slot + swz(row, 2 * chunk)) = o0;
      *(uint4*)(smem + slot + swz(row, 2 * chunk + 1)) = o1;
      acc += d.x;
    }
    __syncthreads();
  }
  out[threadIdx.x] = acc;
}
template __global__ void conv<false>(const int*, float*);
template __global__ void conv<true>(const int*, float*);
