#include "kernels/cuda/dropout.hpp"

#include <cuda_runtime.h>

#include "kernels/cuda/bf16.cuh"
#include "kernels/cuda/check.hpp"
#include "kernels/dropout_mask.hpp"

namespace ds::kernels::cuda {
namespace {

constexpr int kThreads = 256;

template <class T>
__global__ void dropout_kernel(const T* x, T* y, int64_t n, uint64_t key, uint32_t keep_below, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    narrow_into(y[i], dropout_keeps(key, static_cast<uint64_t>(i), keep_below) ? widen(x[i]) * scale : 0.0f);
}

template <class T>
void launch(const T* x, T* y, int64_t n, uint64_t key, uint32_t keep_below, float scale, void* stream) {
  if (n <= 0) return;
  const int64_t b = (n + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(b < 8192 ? b : 8192);
  dropout_kernel<T><<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, y, n, key, keep_below, scale);
  ds::cuda::check(cudaGetLastError(), "dropout launch");
}

}  // namespace

void dropout_f32(const float* x, float* y, int64_t n, uint64_t key, uint32_t keep_below, float scale, void* stream) {
  launch(x, y, n, key, keep_below, scale, stream);
}

void dropout_bf16(const uint16_t* x, uint16_t* y, int64_t n, uint64_t key, uint32_t keep_below, float scale, void* stream) {
  launch(x, y, n, key, keep_below, scale, stream);
}

void dropout_fp16(const uint16_t* x, uint16_t* y, int64_t n, uint64_t key, uint32_t keep_below, float scale, void* stream) {
  launch(as_half(x), as_half(y), n, key, keep_below, scale, stream);
}

}  // namespace ds::kernels::cuda
