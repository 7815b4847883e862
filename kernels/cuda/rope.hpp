// ds — rotary position embedding on a CUDA GPU: the GPU's twin of kernels/cpu/rope (RopeShape, Hugging Face's
// rotate_half layout, fp32 tables of (T, D/2), fp32 math with the CPU's multiply-adds, bf16 rounded once), one
// kernel each way where LibTorch ran a concatenation, a negation, two products and a sum on copies of the
// tables. x and y may be the same buffer. Device pointers; only queues work on `stream` (a cudaStream_t;
// null: the legacy default stream). No LibTorch here.
#pragma once

#include <cstdint>

#include "kernels/cpu/rope.hpp"  // RopeShape

namespace ds::kernels::cuda {

// Where x's heads are, in elements: row r = b T + t's head h starts at x + b batch + t position + h head (its D
// elements contiguous). Passing them reads x where it lies (an attention's gradient, transposed from the kernel that
// made it) instead of after a copy into rows x heads x D; y is always packed so, and may be x only when x is too.
struct RopeStrides {
  int64_t batch = 0, position = 0, head = 0;
};

// x_strides null: x packed as rows x heads x D, as y is.
void rope_f32(const float* x, float* y, const float* cos, const float* sin, const RopeShape& s, void* stream,
              const RopeStrides* x_strides = nullptr);
void rope_bf16(const uint16_t* x, uint16_t* y, const float* cos, const float* sin, const RopeShape& s, void* stream,
               const RopeStrides* x_strides = nullptr);
void rope_fp16(const uint16_t* x, uint16_t* y, const float* cos, const float* sin, const RopeShape& s, void* stream,
               const RopeStrides* x_strides = nullptr);  // fp16's bits

}  // namespace ds::kernels::cuda
