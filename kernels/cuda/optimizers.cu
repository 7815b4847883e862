#include "kernels/cuda/optimizers.hpp"

#include <cuda_runtime.h>

#include "kernels/optimizer_elements.hpp"
#include "kernels/cuda/bf16.cuh"
#include "kernels/cuda/check.hpp"

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace ds::kernels::cuda {
namespace {

constexpr int kThreads = 256;

using ds::cuda::check;

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// Enough blocks to cover n with a grid-stride loop, at most a few waves.
int blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 4096 ? (b > 0 ? b : 1) : 4096);
}

__device__ __forceinline__ uint16_t to_bf16(float f) { return float_to_bf16(f); }
__device__ __forceinline__ float from_bf16(uint16_t b) { return bf16_to_float(b); }
__device__ __forceinline__ float load(const float* g, int64_t i) { return g[i]; }
__device__ __forceinline__ float load(const uint16_t* g, int64_t i) { return from_bf16(g[i]); }
__device__ __forceinline__ float load(const __half* g, int64_t i) { return __half2float(g[i]); }

// Four gradients in one load: 16 bytes of fp32, 8 of bf16 or fp16 (the pointer 4-element aligned).
__device__ __forceinline__ void load4(const float* g, float (&out)[4]) {
  const float4 q = *reinterpret_cast<const float4*>(g);
  out[0] = q.x, out[1] = q.y, out[2] = q.z, out[3] = q.w;
}
template <class H>
__device__ __forceinline__ void load4(const H* g, float (&out)[4]) {  // bf16 (uint16_t) or fp16 (__half)
  const uint2 q = *reinterpret_cast<const uint2*>(g);
  const H* e = reinterpret_cast<const H*>(&q);
#pragma unroll
  for (int k = 0; k < 4; ++k) out[k] = widen(e[k]);
}

// V elements a thread a step: 4 where every pointer is 4-element aligned (the fp32 states in 16-byte loads and
// stores, the 16-bit gradients and weights in 8), else 1. The same arithmetic element by element either way.
// (Scalar, the step ran at 0.64x the card's copy rate on an H200.)
template <class G, int V>
__global__ void adam_kernel(float* p, float* m, float* v, uint16_t* out, const G* grad, int64_t n, AdamStep s) {
  if (!scale_of(s, s.grad_scale)) return;  // (the control, in device memory, says skip)
  const float step_size = s.lr / s.bias_correction1;
  const float decay = s.lr * s.weight_decay;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x * V;
  for (int64_t i = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) * V; i < n; i += stride) {
    if constexpr (V == 1) {
      float w = p[i], mi = m[i], vi = v[i];
      adam_element(load(grad, i) * s.grad_scale, w, mi, vi, s, step_size, decay);
      m[i] = mi;
      v[i] = vi;
      p[i] = w;
      if (out) out[i] = to_bf16(w);
    } else {
      static_assert(V == 4, "four elements a thread");
      float4 w = *reinterpret_cast<const float4*>(p + i), mi = *reinterpret_cast<const float4*>(m + i),
             vi = *reinterpret_cast<const float4*>(v + i);
      float g[4];
      load4(grad + i, g);
      adam_element(g[0] * s.grad_scale, w.x, mi.x, vi.x, s, step_size, decay);
      adam_element(g[1] * s.grad_scale, w.y, mi.y, vi.y, s, step_size, decay);
      adam_element(g[2] * s.grad_scale, w.z, mi.z, vi.z, s, step_size, decay);
      adam_element(g[3] * s.grad_scale, w.w, mi.w, vi.w, s, step_size, decay);
      *reinterpret_cast<float4*>(m + i) = mi;
      *reinterpret_cast<float4*>(v + i) = vi;
      *reinterpret_cast<float4*>(p + i) = w;
      if (out) {
        uint2 b;
        b.x = static_cast<uint32_t>(to_bf16(w.x)) | static_cast<uint32_t>(to_bf16(w.y)) << 16;
        b.y = static_cast<uint32_t>(to_bf16(w.z)) | static_cast<uint32_t>(to_bf16(w.w)) << 16;
        *reinterpret_cast<uint2*>(out + i) = b;
      }
    }
  }
}

template <class G>
__global__ void sgd_kernel(float* p, float* buf, uint16_t* out, const G* grad, int64_t n, SgdStep s) {
  if (!scale_of(s, s.grad_scale)) return;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    sgd_element(load(grad, i) * s.grad_scale, p[i], s.momentum != 0 ? buf + i : nullptr, s);
    if (out) out[i] = to_bf16(p[i]);
  }
}

// Adds `a` and `b` over the block; thread 0 gets the totals.
__device__ void block_sum2(double& a, double& b) {
  __shared__ double sa[kThreads], sb[kThreads];
  sa[threadIdx.x] = a;
  sb[threadIdx.x] = b;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      sa[threadIdx.x] += sa[threadIdx.x + half];
      sb[threadIdx.x] += sb[threadIdx.x + half];
    }
    __syncthreads();
  }
  a = sa[0];
  b = sb[0];
}

template <class G>
__global__ void lamb_moments_kernel(const float* p, float* m, float* v, const G* grad, int64_t n, LambStep s, double* partials) {
  double w_sq = 0, u_sq = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    float mi = m[i], vi = v[i];
    lamb_moments_element(load(grad, i) * s.grad_scale, mi, vi, s);
    m[i] = mi;
    v[i] = vi;
    const float u = lamb_update_element(mi, vi, p[i], s);
    w_sq += static_cast<double>(p[i]) * p[i];
    u_sq += static_cast<double>(u) * u;
  }
  block_sum2(w_sq, u_sq);
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = w_sq;
    partials[kReduceBlocks + blockIdx.x] = u_sq;
  }
}

__global__ void lamb_apply_kernel(float* p, const float* m, const float* v, uint16_t* out, int64_t n, LambStep s, float ratio) {
  const float step = s.lr * s.step_size_factor * ratio;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    p[i] -= step * lamb_update_element(m[i], v[i], p[i], s);
    if (out) out[i] = to_bf16(p[i]);
  }
}

template <class T>
__global__ void squares_kernel(const T* x, int64_t n, double* partials) {
  // The elements before x's first 16-byte boundary, then 16-byte loads (one element a load read 1.0 TB/s of
  // an H200's 4.2), then the tail; two accumulators so the double adds overlap.
  constexpr int kN = Pack<T>::kN;
  const int64_t tid = blockIdx.x * int64_t{blockDim.x} + threadIdx.x, threads = int64_t{gridDim.x} * blockDim.x;
  const auto misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(x) % 16);
  const int64_t to_boundary = misaligned == 0 ? 0 : (16 - misaligned) / static_cast<int64_t>(sizeof(T));
  const int64_t head = to_boundary < n ? to_boundary : n;
  const int64_t packs = (n - head) / kN, tail = head + packs * kN;
  double a0 = 0, a1 = 0;
  for (int64_t i = tid; i < head; i += threads) {
    const double f = load(x, i);
    a0 += f * f;
  }
  const auto* p = reinterpret_cast<const Pack<T>*>(x + head);
  for (int64_t i = tid; i < packs; i += threads) {
    const Pack<T> q = p[i];
#pragma unroll
    for (int k = 0; k < kN; k += 2) {
      const double f0 = widen(q.v[k]), f1 = widen(q.v[k + 1]);
      a0 += f0 * f0;
      a1 += f1 * f1;
    }
  }
  for (int64_t i = tail + tid; i < n; i += threads) {
    const double f = load(x, i);
    a1 += f * f;
  }
  double acc = a0 + a1, unused = 0;
  block_sum2(acc, unused);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// One block adds `values` rows of kReduceBlocks partials, in order, into out[k] (+= when `accumulate`).
__global__ void finish_kernel(const double* partials, int values, double* out, bool accumulate) {
  for (int k = 0; k < values; ++k) {
    double a = 0, unused = 0;
    for (int i = threadIdx.x; i < kReduceBlocks; i += blockDim.x) a += partials[k * kReduceBlocks + i];
    block_sum2(a, unused);
    if (threadIdx.x == 0) out[k] = accumulate ? out[k] + a : a;
    __syncthreads();
  }
}

template <class G>
void adam(float* p, float* m, float* v, uint16_t* out, const G* g, int64_t n, const AdamStep& s, void* stream) {
  if (n <= 0) return;
  // Four at a time over the elements a multiple of four covers, where every pointer is so aligned; the rest (under
  // four elements, or all of them for unaligned pointers) one at a time.
  const bool by_four = aligned_to(p, 16) && aligned_to(m, 16) && aligned_to(v, 16) && aligned_to(g, 4 * sizeof(G)) &&
                       (!out || aligned_to(out, 8));
  const int64_t four = by_four ? n / 4 * 4 : 0;
  if (four > 0) adam_kernel<G, 4><<<blocks_for(four / 4), kThreads, 0, as_stream(stream)>>>(p, m, v, out, g, four, s);
  if (four < n)
    adam_kernel<G, 1><<<blocks_for(n - four), kThreads, 0, as_stream(stream)>>>(p + four, m + four, v + four, out ? out + four : nullptr,
                                                                                 g + four, n - four, s);
  check(cudaGetLastError(), "adam_step");
}

template <class G>
void sgd(float* p, float* buf, uint16_t* out, const G* g, int64_t n, const SgdStep& s, void* stream) {
  if (n <= 0) return;
  sgd_kernel<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(p, buf, out, g, n, s);
  check(cudaGetLastError(), "sgd_step");
}

template <class G>
void lamb_moments(const float* p, float* m, float* v, const G* g, int64_t n, const LambStep& s, double* sums, double* scratch,
                  void* stream) {
  if (n <= 0) return;
  lamb_moments_kernel<<<kReduceBlocks, kThreads, 0, as_stream(stream)>>>(p, m, v, g, n, s, scratch);
  finish_kernel<<<1, kThreads, 0, as_stream(stream)>>>(scratch, 2, sums, true);
  check(cudaGetLastError(), "lamb_moments");
}

template <class T>
void squares(const T* x, int64_t n, double* out, double* scratch, void* stream) {
  squares_kernel<<<kReduceBlocks, kThreads, 0, as_stream(stream)>>>(x, n, scratch);
  finish_kernel<<<1, kThreads, 0, as_stream(stream)>>>(scratch, 1, out, false);
  check(cudaGetLastError(), "sum_of_squares");
}

}  // namespace

void adam_step_f32(float* p, float* m, float* v, uint16_t* out, const float* g, int64_t n, const AdamStep& s, void* stream) {
  adam(p, m, v, out, g, n, s, stream);
}
void adam_step_bf16(float* p, float* m, float* v, uint16_t* out, const uint16_t* g, int64_t n, const AdamStep& s, void* stream) {
  adam(p, m, v, out, g, n, s, stream);
}
void sgd_step_f32(float* p, float* buf, uint16_t* out, const float* g, int64_t n, const SgdStep& s, void* stream) {
  sgd(p, buf, out, g, n, s, stream);
}
void sgd_step_bf16(float* p, float* buf, uint16_t* out, const uint16_t* g, int64_t n, const SgdStep& s, void* stream) {
  sgd(p, buf, out, g, n, s, stream);
}
void adam_step_fp16(float* p, float* m, float* v, uint16_t* out, const uint16_t* g, int64_t n, const AdamStep& s, void* stream) {
  adam(p, m, v, out, as_half(g), n, s, stream);
}
void sgd_step_fp16(float* p, float* buf, uint16_t* out, const uint16_t* g, int64_t n, const SgdStep& s, void* stream) {
  sgd(p, buf, out, as_half(g), n, s, stream);
}
void lamb_moments_f32(const float* p, float* m, float* v, const float* g, int64_t n, const LambStep& s, double* sums,
                      double* scratch, void* stream) {
  lamb_moments(p, m, v, g, n, s, sums, scratch, stream);
}
void lamb_moments_bf16(const float* p, float* m, float* v, const uint16_t* g, int64_t n, const LambStep& s, double* sums,
                       double* scratch, void* stream) {
  lamb_moments(p, m, v, g, n, s, sums, scratch, stream);
}
void lamb_moments_fp16(const float* p, float* m, float* v, const uint16_t* g, int64_t n, const LambStep& s, double* sums,
                       double* scratch, void* stream) {
  lamb_moments(p, m, v, as_half(g), n, s, sums, scratch, stream);
}
void lamb_apply(float* p, const float* m, const float* v, uint16_t* out, int64_t n, const LambStep& s, float ratio, void* stream) {
  if (n <= 0) return;
  lamb_apply_kernel<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(p, m, v, out, n, s, ratio);
  check(cudaGetLastError(), "lamb_apply");
}
void sum_of_squares_f32(const float* x, int64_t n, double* out, double* scratch, void* stream) { squares(x, n, out, scratch, stream); }
void sum_of_squares_bf16(const uint16_t* x, int64_t n, double* out, double* scratch, void* stream) {
  squares(x, n, out, scratch, stream);
}
void sum_of_squares_fp16(const uint16_t* x, int64_t n, double* out, double* scratch, void* stream) {
  squares(as_half(x), n, out, scratch, stream);
}

int device_count(const char** why) {
  int n = 0, driver = 0;
  if (cudaDriverGetVersion(&driver) == cudaSuccess && driver == 0) {
    if (why) *why = "no NVIDIA driver is installed";
    return 0;
  }
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    if (why) *why = cudaGetErrorString(e);
    cudaGetLastError();  // clear it: a later call must not see this one
    return 0;
  }
  if (n == 0 && why) *why = "no CUDA device is visible";
  return n;
}

}  // namespace ds::kernels::cuda
