#include "kernels/cpu/sum.hpp"

#include "kernels/cpu/simd.hpp"

namespace ds::kernels {

namespace {
constexpr int64_t kBlock = 1 << 16;  // elements per thread's share
}

void sum_into_f32(float* dst, const float* const* srcs, int k, int64_t n) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, end = begin + kBlock < n ? begin + kBlock : n;
    for (int j = 0; j < k; ++j) {  // in source order: the fp32 sum a rank-ordered all-reduce makes
      const float* s = srcs[j];
      for (int64_t i = begin; i < end; ++i) dst[i] += s[i];
    }
  }
}

namespace {
void sum_into_bf16_scalar(uint16_t* dst, const uint16_t* const* srcs, int k, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float acc = bf16_to_float(dst[i]);
    for (int j = 0; j < k; ++j) acc += bf16_to_float(srcs[j][i]);
    dst[i] = float_to_bf16(acc);
  }
}
}  // namespace

void sum_into_bf16_reference(uint16_t* dst, const uint16_t* const* srcs, int k, int64_t n) {
  sum_into_bf16_scalar(dst, srcs, k, 0, n);
}

namespace {
#if defined(__x86_64__)
DS_AVX512 void sum_into_bf16_avx512(uint16_t* dst, const uint16_t* const* srcs, int k, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += 16) {
    const __mmask16 m = simd::first_lanes(end - i);
    __m512 acc = simd::load(dst + i, m);
    for (int j = 0; j < k; ++j) acc = _mm512_add_ps(acc, simd::load(srcs[j] + i, m));
    simd::store(dst + i, m, acc);
  }
}
#endif
}  // namespace

void sum_into_bf16(uint16_t* dst, const uint16_t* const* srcs, int k, int64_t n) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, end = begin + kBlock < n ? begin + kBlock : n;
#if defined(__x86_64__)
    if (simd::has_avx512()) {
      sum_into_bf16_avx512(dst, srcs, k, begin, end);
      continue;
    }
#endif
    sum_into_bf16_scalar(dst, srcs, k, begin, end);
  }
}

}  // namespace ds::kernels
