// ds — bf16 in the CUDA kernels, as kernels/cpu rounds it: widened exactly, narrowed to nearest even with a
// NaN kept a quiet NaN. One definition for every .cu file.
#pragma once

#include <cstdint>

namespace ds::kernels::cuda {

__device__ __forceinline__ float bf16_to_float(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }

__device__ __forceinline__ uint16_t float_to_bf16(float f) {
  uint32_t x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

}  // namespace ds::kernels::cuda
