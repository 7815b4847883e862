#include "kernels/cpu/norm.hpp"

#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels/cpu/adam.hpp"

namespace ds::kernels {

double sum_of_squares_f32_reference(const float* x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return s;
}

double sum_of_squares_bf16_reference(const uint16_t* x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = bf16_to_float(x[i]);
    s += v * v;
  }
  return s;
}

namespace {

#if defined(__x86_64__)
template <bool kBf16>
__attribute__((target("avx512f"))) inline __m512 load16(const void* data, int64_t k) {
  if constexpr (kBf16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(data) + k))), 16));
  else
    return _mm512_loadu_ps(static_cast<const float*>(data) + k);
}

template <bool kBf16>
__attribute__((target("avx512f"))) double avx512_range(const void* data, int64_t begin, int64_t end) {
  __m512d acc_lo = _mm512_setzero_pd(), acc_hi = _mm512_setzero_pd();
  int64_t i = begin;
  // 16 vectors (256 elements) summed in fp32, then widened into the double accumulators.
  for (; i + 256 <= end; i += 256) {
    __m512 part = _mm512_setzero_ps();
    for (int k = 0; k < 256; k += 16) {
      const __m512 v = load16<kBf16>(data, i + k);
      part = _mm512_fmadd_ps(v, v, part);
    }
    acc_lo = _mm512_add_pd(acc_lo, _mm512_cvtps_pd(_mm512_castps512_ps256(part)));
    acc_hi = _mm512_add_pd(acc_hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(part), 1))));
  }
  double s = _mm512_reduce_add_pd(_mm512_add_pd(acc_lo, acc_hi));
  if constexpr (kBf16)
    s += sum_of_squares_bf16_reference(static_cast<const uint16_t*>(data) + i, end - i);
  else
    s += sum_of_squares_f32_reference(static_cast<const float*>(data) + i, end - i);
  return s;
}
#endif

template <bool kBf16>
double dispatch(const void* data, int64_t n) {
  constexpr int64_t kBlock = 1 << 16;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  double total = 0;
#if defined(__x86_64__)
  const bool fast = __builtin_cpu_supports("avx512f");
#else
  const bool fast = false;
#endif
#pragma omp parallel for schedule(static) reduction(+ : total) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, end = begin + kBlock < n ? begin + kBlock : n;
#if defined(__x86_64__)
    if (fast) {
      total += avx512_range<kBf16>(data, begin, end);
      continue;
    }
#endif
    if constexpr (kBf16)
      total += sum_of_squares_bf16_reference(static_cast<const uint16_t*>(data) + begin, end - begin);
    else
      total += sum_of_squares_f32_reference(static_cast<const float*>(data) + begin, end - begin);
  }
  return total;
}

}  // namespace

double sum_of_squares_f32(const float* x, int64_t n) { return dispatch<false>(x, n); }
double sum_of_squares_bf16(const uint16_t* x, int64_t n) { return dispatch<true>(x, n); }

}  // namespace ds::kernels
