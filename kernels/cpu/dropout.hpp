// ds — dropout on the host: y = x * scale where kernels/dropout_mask.hpp keeps element i, else 0 (x and y
// may be the same buffer). The same function applied to the output's gradient is the backward. bf16 is
// widened, multiplied in fp32 and rounded to nearest even, as the GPU's kernel does (kernels/cuda/dropout).
// Elements are split over OpenMP threads.
#pragma once

#include <cstdint>

namespace ds::kernels {

void dropout_f32(const float* x, float* y, int64_t n, uint64_t key, uint32_t keep_below, float scale);
void dropout_bf16(const uint16_t* x, uint16_t* y, int64_t n, uint64_t key, uint32_t keep_below, float scale);

}  // namespace ds::kernels
