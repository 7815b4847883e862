#include "kernels/cuda/activation.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/bf16.cuh"
#include "kernels/cuda/check.hpp"

namespace ds::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // a grid-stride loop beyond this
constexpr float kTwoSqrt2OverPi = 1.5957691216057308f;  // 2 sqrt(2/pi)
constexpr float kCubic = 0.044715f;

__device__ __forceinline__ float sigmoid(float z) { return 1.f / (1.f + expf(-z)); }
// kFast: the hardware's approximate exponential and division (a few fp32 ulps, many where |z| is large and the
// result is all but 0 or 1), for bf16 results, whose 8 bits round them alike but at the odd boundary. GELU's
// kernels were bound by this arithmetic: 70 us forward on an H200 for a block of GPT-2's (16 x 1024 x 3072) whose
// bytes need 48; LibTorch's ran in 58. fp32 and fp16 keep the exact forms (their results are held closer).
template <bool kFast>
__device__ __forceinline__ float sigmoid_of(float z) {
  if constexpr (kFast)
    return __fdividef(1.f, 1.f + __expf(-z));  // (0 once exp(-z) passes 2^126: sigmoid's own value there, to fp32)
  else
    return sigmoid(z);
}

// With s = sigmoid(2u) = (1 + tanh u) / 2 (as kernels/cpu writes it: nothing cancels in the negative tail).
template <bool kFast = false>
struct GeluForward {
  __device__ float operator()(float x) const { return x * sigmoid_of<kFast>(kTwoSqrt2OverPi * (x + kCubic * x * x * x)); }
};
template <bool kFast = false>
struct GeluBackward {
  __device__ float operator()(float dy, float x) const {
    const float s = sigmoid_of<kFast>(kTwoSqrt2OverPi * (x + kCubic * x * x * x));
    return dy * (s + x * s * (1.f - s) * kTwoSqrt2OverPi * (1.f + 3.f * kCubic * x * x));
  }
};

template <class T, int V>
__global__ void swiglu_forward_kernel(const T* g, const T* u, T* y, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x * V;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < n; i += step) {
    float gv[V], uv[V];
    load_widened<T, V>(g + i, gv);
    load_widened<T, V>(u + i, uv);
#pragma unroll
    for (int k = 0; k < V; ++k) gv[k] = gv[k] * sigmoid(gv[k]) * uv[k];
    store_narrowed<T, V>(y + i, gv);
  }
}

// dg = dy u s (1 + g (1 - s)),  du = dy g s,  s = sigmoid(g).
template <class T, int V>
__global__ void swiglu_backward_kernel(const T* dy, const T* g, const T* u, T* dg, T* du, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x * V;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < n; i += step) {
    float dv[V], gv[V], uv[V], dgv[V], duv[V];
    load_widened<T, V>(dy + i, dv);
    load_widened<T, V>(g + i, gv);
    load_widened<T, V>(u + i, uv);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float s = sigmoid(gv[k]);
      dgv[k] = dv[k] * uv[k] * s * (1.f + gv[k] * (1.f - s));
      duv[k] = dv[k] * gv[k] * s;
    }
    store_narrowed<T, V>(dg + i, dgv);
    store_narrowed<T, V>(du + i, duv);
  }
}

bool vectorised(int64_t n, int width, std::initializer_list<const void*> ptrs) {
  if (n % width != 0) return false;
  return std::all_of(ptrs.begin(), ptrs.end(), [](const void* p) { return aligned_to(p, 16); });
}

unsigned blocks_for(int64_t n, int width) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(kMaxBlocks, (n / width + kThreads - 1) / kThreads)));
}

// The elementwise map's inputs, passed by value in the kernel's arguments.
template <class T, int N>
struct Inputs {
  const T* p[N];
};

// out[i] = f(in_0[i], ..., in_{N-1}[i]), V elements a thread a step.
template <class T, int V, int N, class F>
__global__ void map_kernel(Inputs<T, N> in, T* out, int64_t n, F f) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x * V;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < n; i += step) {
    float v[N][V], r[V];
#pragma unroll
    for (int a = 0; a < N; ++a) load_widened<T, V>(in.p[a] + i, v[a]);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      if constexpr (N == 1)
        r[k] = f(v[0][k]);
      else
        r[k] = f(v[0][k], v[1][k]);
    }
    store_narrowed<T, V>(out + i, r);
  }
}

template <class T, int N, class F>
void map(Inputs<T, N> in, T* out, int64_t n, F f, void* stream, const char* what) {
  if (n <= 0) return;
  constexpr int kN = Pack<T>::kN;
  bool vec = vectorised(n, kN, {out});
  for (int a = 0; a < N; ++a) vec = vec && vectorised(n, kN, {in.p[a]});
  auto* st = static_cast<cudaStream_t>(stream);
  if (vec)
    map_kernel<T, kN, N><<<blocks_for(n, kN), kThreads, 0, st>>>(in, out, n, f);
  else
    map_kernel<T, 1, N><<<blocks_for(n, 1), kThreads, 0, st>>>(in, out, n, f);
  ds::cuda::check(cudaGetLastError(), what);
}

template <class T>
void swiglu_forward(const T* g, const T* u, T* y, int64_t n, void* stream) {
  if (n <= 0) return;
  constexpr int kN = Pack<T>::kN;
  auto* st = static_cast<cudaStream_t>(stream);
  if (vectorised(n, kN, {g, u, y}))
    swiglu_forward_kernel<T, kN><<<blocks_for(n, kN), kThreads, 0, st>>>(g, u, y, n);
  else
    swiglu_forward_kernel<T, 1><<<blocks_for(n, 1), kThreads, 0, st>>>(g, u, y, n);
  ds::cuda::check(cudaGetLastError(), "swiglu forward launch");
}

template <class T>
void swiglu_backward(const T* dy, const T* g, const T* u, T* dg, T* du, int64_t n, void* stream) {
  if (n <= 0) return;
  constexpr int kN = Pack<T>::kN;
  auto* st = static_cast<cudaStream_t>(stream);
  if (vectorised(n, kN, {dy, g, u, dg, du}))
    swiglu_backward_kernel<T, kN><<<blocks_for(n, kN), kThreads, 0, st>>>(dy, g, u, dg, du, n);
  else
    swiglu_backward_kernel<T, 1><<<blocks_for(n, 1), kThreads, 0, st>>>(dy, g, u, dg, du, n);
  ds::cuda::check(cudaGetLastError(), "swiglu backward launch");
}

}  // namespace

void gelu_tanh_forward_f32(const float* x, float* y, int64_t n, void* stream) {
  map(Inputs<float, 1>{{x}}, y, n, GeluForward<>{}, stream, "gelu forward launch");
}
void gelu_tanh_forward_bf16(const uint16_t* x, uint16_t* y, int64_t n, void* stream) {
  map(Inputs<uint16_t, 1>{{x}}, y, n, GeluForward<true>{}, stream, "gelu forward launch");
}
void gelu_tanh_backward_f32(const float* dy, const float* x, float* dx, int64_t n, void* stream) {
  map(Inputs<float, 2>{{dy, x}}, dx, n, GeluBackward<>{}, stream, "gelu backward launch");
}
void gelu_tanh_backward_bf16(const uint16_t* dy, const uint16_t* x, uint16_t* dx, int64_t n, void* stream) {
  map(Inputs<uint16_t, 2>{{dy, x}}, dx, n, GeluBackward<true>{}, stream, "gelu backward launch");
}

void gelu_tanh_forward_fp16(const uint16_t* x, uint16_t* y, int64_t n, void* stream) {
  map(Inputs<__half, 1>{{as_half(x)}}, as_half(y), n, GeluForward<>{}, stream, "gelu forward launch");
}
void gelu_tanh_backward_fp16(const uint16_t* dy, const uint16_t* x, uint16_t* dx, int64_t n, void* stream) {
  map(Inputs<__half, 2>{{as_half(dy), as_half(x)}}, as_half(dx), n, GeluBackward<>{}, stream, "gelu backward launch");
}

void swiglu_forward_f32(const float* g, const float* u, float* y, int64_t n, void* stream) { swiglu_forward(g, u, y, n, stream); }
void swiglu_forward_bf16(const uint16_t* g, const uint16_t* u, uint16_t* y, int64_t n, void* stream) {
  swiglu_forward(g, u, y, n, stream);
}
void swiglu_backward_f32(const float* dy, const float* g, const float* u, float* dg, float* du, int64_t n, void* stream) {
  swiglu_backward(dy, g, u, dg, du, n, stream);
}
void swiglu_backward_bf16(const uint16_t* dy, const uint16_t* g, const uint16_t* u, uint16_t* dg, uint16_t* du, int64_t n,
                          void* stream) {
  swiglu_backward(dy, g, u, dg, du, n, stream);
}
void swiglu_forward_fp16(const uint16_t* g, const uint16_t* u, uint16_t* y, int64_t n, void* stream) {
  swiglu_forward(as_half(g), as_half(u), as_half(y), n, stream);
}
void swiglu_backward_fp16(const uint16_t* dy, const uint16_t* g, const uint16_t* u, uint16_t* dg, uint16_t* du, int64_t n,
                          void* stream) {
  swiglu_backward(as_half(dy), as_half(g), as_half(u), as_half(dg), as_half(du), n, stream);
}

}  // namespace ds::kernels::cuda
