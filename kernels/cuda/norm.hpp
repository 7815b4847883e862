// ds — LayerNorm and RMSNorm on a CUDA GPU: the GPU's twin of kernels/cpu/layer_norm (the same functions,
// NormShape, fp32 statistics and bf16 rounding), so a GPU run normalises as the CPU run does.
//
// Forward: one warp a row; mean (0 for RMSNorm) and rstd written per row for the backward.
// Backward: one warp a row for dx (the row's two sums, then dx), and the weight's (and bias's) gradient as
// column sums over chunks of rows into `scratch`, then the chunks summed in order into dw (and db): no
// atomics, so a gradient is the same from run to run. dw and db are added to, as on the CPU.
// Replaces LibTorch's layer_norm backward (GammaBetaBackward + grad input: about 100 us for 16K x 768 bf16 on
// an H200) and RMSNorm's chain of six LibTorch ops. Device pointers; only queues work on `stream` (a
// cudaStream_t; null: the legacy default stream). No LibTorch here.
#pragma once

#include <cstdint>

#include "kernels/cpu/layer_norm.hpp"  // NormShape

namespace ds::kernels::cuda {

// residual and sum (both null, or both set): the row normalised is x + residual rounded to the element type, and
// that sum is written to `sum` (a pre-norm block's residual add and its next norm in one pass, equal bit for bit
// to the add then the norm).
void norm_forward_f32(const float* x, const float* residual, const float* w, const float* b, float* sum, float* y, float* mean, float* rstd,
                      const NormShape& s, void* stream);
void norm_forward_bf16(const uint16_t* x, const uint16_t* residual, const uint16_t* w, const uint16_t* b, uint16_t* sum, uint16_t* y,
                       float* mean, float* rstd, const NormShape& s, void* stream);
// fp16 as its bits (as the optimizers take it): fp32 statistics, rounded to fp16.
void norm_forward_fp16(const uint16_t* x, const uint16_t* residual, const uint16_t* w, const uint16_t* b, uint16_t* sum, uint16_t* y,
                       float* mean, float* rstd, const NormShape& s, void* stream);

// The fp32 elements of device memory the backward needs as scratch for a shape.
int64_t norm_backward_scratch_floats(const NormShape& s);
// db may be null (RMSNorm). dsum (may be null): the gradient x's other reader gave it (a residual sum's), added to
// dx after dx is rounded, as autograd adds two gradients of one tensor.
void norm_backward_f32(const float* dy, const float* dsum, const float* x, const float* w, const float* mean, const float* rstd, float* dx,
                       float* dw, float* db, float* scratch, const NormShape& s, void* stream);
void norm_backward_bf16(const uint16_t* dy, const uint16_t* dsum, const uint16_t* x, const uint16_t* w, const float* mean, const float* rstd,
                        uint16_t* dx, float* dw, float* db, float* scratch, const NormShape& s, void* stream);
void norm_backward_fp16(const uint16_t* dy, const uint16_t* dsum, const uint16_t* x, const uint16_t* w, const float* mean, const float* rstd,
                        uint16_t* dx, float* dw, float* db, float* scratch, const NormShape& s, void* stream);

// The same column sums without the norm: out[c] += sum over rows of x[r, c] (a projection's bias gradient from
// dy), fp32 sums in a fixed order, out of x's type rounded once. One pass over x instead of LibTorch's sum then add.
int64_t column_sums_scratch_floats(int64_t rows, int64_t cols);
void column_sums_add_f32(const float* x, int64_t rows, int64_t cols, float* out, float* scratch, void* stream);
void column_sums_add_bf16(const uint16_t* x, int64_t rows, int64_t cols, uint16_t* out, float* scratch, void* stream);
void column_sums_add_fp16(const uint16_t* x, int64_t rows, int64_t cols, uint16_t* out, float* scratch, void* stream);

}  // namespace ds::kernels::cuda
