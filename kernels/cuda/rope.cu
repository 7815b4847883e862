#include "kernels/cuda/rope.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/cuda/bf16.cuh"
#include "kernels/cuda/check.hpp"

namespace ds::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;

// V pairs (j .. j+V-1, each with j + D/2) of one head of one row a thread; row r = b T + t sits at position t, its
// head h at x + b xs.batch + t xs.position + h xs.head (y packed: rows x heads x D). V is a 16-byte load's width
// where D/2, the strides and the pointers allow, else 1.
template <class T, int V>
__global__ void rope_kernel(const T* x, RopeStrides xs, T* y, const float* cos, const float* sin, int64_t rows, int64_t T_len,
                            int64_t heads, int64_t D, float sign) {
  const int64_t half = D / 2, groups = half / V, items = rows * heads * groups;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < items; i += step) {
    const int64_t j = i % groups * V, rh = i / groups, r = rh / heads, h = rh % heads;
    const int64_t t = r % T_len, in = r / T_len * xs.batch + t * xs.position + h * xs.head + j, out = rh * D + j;
    float a[V], b[V], c[V], sn[V], ya[V], yb[V];
    load_widened<T, V>(x + in, a);
    load_widened<T, V>(x + in + half, b);
#pragma unroll
    for (int k = 0; k < V; ++k) c[k] = cos[t * half + j + k], sn[k] = sign * sin[t * half + j + k];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      // As kernels/cpu/rope's AVX-512 path: a c - (b s) and b c + (a s), each one fused multiply-add.
      ya[k] = fmaf(a[k], c[k], -(b[k] * sn[k]));
      yb[k] = fmaf(b[k], c[k], a[k] * sn[k]);
    }
    store_narrowed<T, V>(y + out, ya);
    store_narrowed<T, V>(y + out + half, yb);
  }
}

template <class T>
void rope(const T* x, const RopeStrides* strides, T* y, const float* cos, const float* sin, const RopeShape& s, void* stream) {
  const bool empty = s.rows == 0 || s.heads == 0 || s.D == 0;  // nothing to rotate, as on the CPU
  if (s.rows < 0 || s.heads < 0 || s.D < 0 || s.D % 2 != 0 || (!empty && s.T <= 0))
    throw std::runtime_error("rope: bad shape (rows " + std::to_string(s.rows) + ", T " + std::to_string(s.T) + ", heads " +
                             std::to_string(s.heads) + ", D " + std::to_string(s.D) + ")");
  if (empty) return;
  const RopeStrides xs = strides ? *strides : RopeStrides{s.T * s.heads * s.D, s.heads * s.D, s.D};
  constexpr int kN = Pack<T>::kN;
  const int64_t half = s.D / 2;
  const bool vectors = half % kN == 0 && xs.batch % kN == 0 && xs.position % kN == 0 && xs.head % kN == 0 &&
                       aligned_to(x, 16) && aligned_to(y, 16);
  const int64_t items = s.rows * s.heads * (vectors ? half / kN : half);
  const auto blocks = static_cast<unsigned>(std::min(kMaxBlocks, (items + kThreads - 1) / kThreads));
  auto* st = static_cast<cudaStream_t>(stream);
  const float sign = s.inverse ? -1.f : 1.f;
  if (vectors)
    rope_kernel<T, kN><<<blocks, kThreads, 0, st>>>(x, xs, y, cos, sin, s.rows, s.T, s.heads, s.D, sign);
  else
    rope_kernel<T, 1><<<blocks, kThreads, 0, st>>>(x, xs, y, cos, sin, s.rows, s.T, s.heads, s.D, sign);
  ds::cuda::check(cudaGetLastError(), "rope launch");
}

}  // namespace

void rope_f32(const float* x, float* y, const float* cos, const float* sin, const RopeShape& s, void* stream, const RopeStrides* x_strides) {
  rope(x, x_strides, y, cos, sin, s, stream);
}
void rope_bf16(const uint16_t* x, uint16_t* y, const float* cos, const float* sin, const RopeShape& s, void* stream,
               const RopeStrides* x_strides) {
  rope(x, x_strides, y, cos, sin, s, stream);
}
void rope_fp16(const uint16_t* x, uint16_t* y, const float* cos, const float* sin, const RopeShape& s, void* stream,
               const RopeStrides* x_strides) {
  rope(as_half(x), x_strides, as_half(y), cos, sin, s, stream);
}

}  // namespace ds::kernels::cuda
