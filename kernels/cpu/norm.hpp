// ds — sum of squares of a flat buffer (the global gradient norm is its square root), for clipping
// and overflow checks. Accumulates in double: fp32 partial sums of 16 vectors are flushed into
// double accumulators, so the result is accurate to ~1e-7 relative at any size (LibTorch 1.13's
// linalg_vector_norm over bf16 was measured 1.4% off on 124M elements, and 15x slower). inf/NaN
// inputs propagate (the caller tests std::isfinite). Raw pointers, no allocation, no LibTorch.
#pragma once

#include <cstdint>

namespace ds::kernels {

double sum_of_squares_f32(const float* x, int64_t n);
double sum_of_squares_bf16(const uint16_t* x, int64_t n);
double sum_of_squares_fp16(const uint16_t* x, int64_t n);

// Scalar references the fast versions are tested against.
double sum_of_squares_f32_reference(const float* x, int64_t n);
double sum_of_squares_bf16_reference(const uint16_t* x, int64_t n);
double sum_of_squares_fp16_reference(const uint16_t* x, int64_t n);

}  // namespace ds::kernels
