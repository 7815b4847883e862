#include "kernels/cpu/dropout.hpp"

#include "kernels/cpu/adam.hpp"  // float_to_bf16, bf16_to_float
#include "kernels/dropout_mask.hpp"

namespace ds::kernels {

void dropout_f32(const float* x, float* y, int64_t n, uint64_t key, uint32_t keep_below, float scale) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) y[i] = dropout_keeps(key, static_cast<uint64_t>(i), keep_below) ? x[i] * scale : 0.0f;
}

void dropout_bf16(const uint16_t* x, uint16_t* y, int64_t n, uint64_t key, uint32_t keep_below, float scale) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i)
    y[i] = dropout_keeps(key, static_cast<uint64_t>(i), keep_below) ? float_to_bf16(bf16_to_float(x[i]) * scale) : uint16_t{0};
}

}  // namespace ds::kernels
