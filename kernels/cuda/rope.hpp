// ds — rotary position embedding on a CUDA GPU: the GPU's twin of kernels/cpu/rope (RopeShape, Hugging Face's
// rotate_half layout, fp32 tables of (T, D/2), fp32 math with the CPU's multiply-adds, bf16 rounded once), one
// kernel each way where LibTorch ran a concatenation, a negation, two products and a sum on copies of the
// tables. x and y may be the same buffer. Device pointers; only queues work on `stream` (a cudaStream_t;
// null: the legacy default stream). No LibTorch here.
#pragma once

#include <cstdint>

#include "kernels/cpu/rope.hpp"  // RopeShape

namespace ds::kernels::cuda {

void rope_f32(const float* x, float* y, const float* cos, const float* sin, const RopeShape& s, void* stream);
void rope_bf16(const uint16_t* x, uint16_t* y, const float* cos, const float* sin, const RopeShape& s, void* stream);
void rope_fp16(const uint16_t* x, uint16_t* y, const float* cos, const float* sin, const RopeShape& s, void* stream);  // fp16's bits

}  // namespace ds::kernels::cuda
