#include "kernels/cuda/rope.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda/bf16.cuh"
#include "kernels/cuda/check.hpp"

namespace ds::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;

// One thread a pair (j, j + D/2) of one head of one row; row r sits at position r % T.
template <class T>
__global__ void rope_kernel(const T* x, T* y, const float* cos, const float* sin, int64_t rows, int64_t T_len, int64_t heads,
                            int64_t D, float sign) {
  const int64_t half = D / 2, pairs = rows * heads * half;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < pairs; i += step) {
    const int64_t j = i % half, rh = i / half, r = rh / heads;
    const int64_t t = r % T_len, at = rh * D + j;
    const float a = widen(x[at]), b = widen(x[at + half]), c = cos[t * half + j], s = sign * sin[t * half + j];
    // As kernels/cpu/rope's AVX-512 path: a c - (b s) and b c + (a s), each one fused multiply-add.
    narrow_into(y[at], fmaf(a, c, -(b * s)));
    narrow_into(y[at + half], fmaf(b, c, a * s));
  }
}

template <class T>
void rope(const T* x, T* y, const float* cos, const float* sin, const RopeShape& s, void* stream) {
  const bool empty = s.rows == 0 || s.heads == 0 || s.D == 0;  // nothing to rotate, as on the CPU
  if (s.rows < 0 || s.heads < 0 || s.D < 0 || s.D % 2 != 0 || (!empty && s.T <= 0))
    throw std::runtime_error("rope: bad shape (rows " + std::to_string(s.rows) + ", T " + std::to_string(s.T) + ", heads " +
                             std::to_string(s.heads) + ", D " + std::to_string(s.D) + ")");
  if (empty) return;
  const int64_t pairs = s.rows * s.heads * (s.D / 2);
  const auto blocks = static_cast<unsigned>(std::min(kMaxBlocks, (pairs + kThreads - 1) / kThreads));
  rope_kernel<T><<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, y, cos, sin, s.rows, s.T, s.heads, s.D,
                                                                             s.inverse ? -1.f : 1.f);
  ds::cuda::check(cudaGetLastError(), "rope launch");
}

}  // namespace

void rope_f32(const float* x, float* y, const float* cos, const float* sin, const RopeShape& s, void* stream) {
  rope(x, y, cos, sin, s, stream);
}
void rope_bf16(const uint16_t* x, uint16_t* y, const float* cos, const float* sin, const RopeShape& s, void* stream) {
  rope(x, y, cos, sin, s, stream);
}
void rope_fp16(const uint16_t* x, uint16_t* y, const float* cos, const float* sin, const RopeShape& s, void* stream) {
  rope(as_half(x), as_half(y), cos, sin, s, stream);
}

}  // namespace ds::kernels::cuda
