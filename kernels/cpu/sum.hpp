// ds — other buffers added into one: the end of a reduce-scatter, where this rank's part of a gradient
// meets the other ranks' contributions to it. bf16 accumulates in fp32 and rounds once, as an all-reduce
// through an fp32 copy would; fp32 adds the sources in order. Raw pointers, no allocation, no LibTorch.
#pragma once

#include <cstdint>

namespace ds::kernels {

// dst[i] = dst[i] + srcs[0][i] + ... + srcs[k-1][i], for i < n.
void sum_into_f32(float* dst, const float* const* srcs, int k, int64_t n);
void sum_into_bf16(uint16_t* dst, const uint16_t* const* srcs, int k, int64_t n);

// The scalar reference the bf16 version is tested against.
void sum_into_bf16_reference(uint16_t* dst, const uint16_t* const* srcs, int k, int64_t n);

}  // namespace ds::kernels
