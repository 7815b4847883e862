// ds — 16-bit floats in the CUDA kernels. bf16 as kernels/cpu rounds it: widened exactly, narrowed to nearest
// even with a NaN kept a quiet NaN; fp16 (__half) through CUDA's own conversions (exact widening, nearest even
// narrowing, overflow to inf). widen/narrow_into for code templated on fp32, bf16 (uint16_t) or fp16 (__half)
// elements, and the 16-byte Pack they are loaded in. One definition for every .cu file.
#pragma once

#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>

namespace ds::kernels::cuda {

__device__ __forceinline__ float bf16_to_float(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }

__device__ __forceinline__ uint16_t float_to_bf16(float f) {
  uint32_t x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(uint16_t b) { return bf16_to_float(b); }
__device__ __forceinline__ float widen(__half h) { return __half2float(h); }  // exact
__device__ __forceinline__ void narrow_into(float& dst, float f) { dst = f; }
__device__ __forceinline__ void narrow_into(uint16_t& dst, float f) { dst = float_to_bf16(f); }
__device__ __forceinline__ void narrow_into(__half& dst, float f) { dst = __float2half_rn(f); }

// f rounded to T and widened back: what a T tensor holding f reads as (an op's output another op then reads).
template <class T>
__device__ __forceinline__ float rounded_to(float f) {
  T t;
  narrow_into(t, f);
  return widen(t);
}

// fp16 crosses the kernels' headers as its bits (uint16_t: no CUDA types there), bf16 too; the two are told
// apart by the entry points' names, and fp16's bits are read as __half here.
inline const __half* as_half(const uint16_t* p) { return reinterpret_cast<const __half*>(p); }
inline __half* as_half(uint16_t* p) { return reinterpret_cast<__half*>(p); }

// Whether p may be read `bytes` at a time (a Pack's 16, or 8 for four 16-bit elements): the kernels' vector paths.
__host__ __device__ inline bool aligned_to(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// 16 bytes of elements (8 bf16 or fp16, or 4 fp32): one load or store instruction.
template <class T>
struct alignas(16) Pack {
  static constexpr int kN = 16 / sizeof(T);
  T v[kN];
};

// V consecutive elements widened to fp32: one 16-byte load when V is a Pack's width, else one element; with
// kVector false, a Pack's width of elements one at a time (p off the 16-byte boundary: the same elements to the
// same thread as the vector path, so a reduction over them sums in the same order).
template <class T, int V, bool kVector = true>
__device__ __forceinline__ void load_widened(const T* p, float (&out)[V]) {
  if constexpr (V == 1 || !kVector) {
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = widen(p[k]);
  } else {
    static_assert(V == Pack<T>::kN, "a vector access is one 16-byte Pack");
    const Pack<T> q = *reinterpret_cast<const Pack<T>*>(p);
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = widen(q.v[k]);
  }
}

template <class T, int V, bool kVector = true>
__device__ __forceinline__ void store_narrowed(T* p, const float (&in)[V]) {
  if constexpr (V == 1 || !kVector) {
#pragma unroll
    for (int k = 0; k < V; ++k) narrow_into(p[k], in[k]);
  } else {
    Pack<T> q;
#pragma unroll
    for (int k = 0; k < V; ++k) narrow_into(q.v[k], in[k]);
    *reinterpret_cast<Pack<T>*>(p) = q;
  }
}

}  // namespace ds::kernels::cuda
