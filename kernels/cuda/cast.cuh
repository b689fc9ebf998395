// Elementwise dtype conversion (F32 <-> F16/BF16), round to nearest even like the CPU's scalar
// conversions, so both backends agree bit for bit on finite values. Memory-bound grid-stride
// loop with coalesced scalar accesses: it feeds a GEMM that reads the result once per output
// tile, so this pass is a small share of the layer's time.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/elementwise.cuh"

namespace sf::kernels::cuda {

template <typename From, typename To>
struct CastParams {
  const From* x;
  To* out;
  int64_t n;
};

template <typename T>
__device__ __forceinline__ T convert_to(float v);
template <>
__device__ __forceinline__ float convert_to<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half convert_to<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 convert_to<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <typename From, typename To>
__global__ void cast_kernel(const CastParams<From, To> p) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n; i += stride)
    p.out[i] = convert_to<To>(load_float(p.x + i));
}

template <typename From, typename To>
cudaError_t cast_launch(const CastParams<From, To>& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  cast_kernel<From, To><<<flat_blocks(p.n), kFlatThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace sf::kernels::cuda
