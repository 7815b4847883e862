#include "kernels/cpu/norm.hpp"

#include "kernels/cpu/simd.hpp"

namespace ds::kernels {

namespace {

template <Stored S>
double squares_reference(const void* x, int64_t begin, int64_t end) {
  double s = 0;
  for (int64_t i = begin; i < end; ++i) {
    const double v = stored_at<S>(x, i);
    s += v * v;
  }
  return s;
}

#if defined(__x86_64__)
template <Stored S>
DS_AVX512 double avx512_range(const void* data, int64_t begin, int64_t end) {
  __m512d acc_lo = _mm512_setzero_pd(), acc_hi = _mm512_setzero_pd();
  int64_t i = begin;
  // 16 vectors (256 elements) summed in fp32, then widened into the double accumulators.
  for (; i + 256 <= end; i += 256) {
    __m512 part = _mm512_setzero_ps();
    for (int k = 0; k < 256; k += 16) {
      const __m512 v = simd::stored16_at<S>(data, i + k);
      part = _mm512_fmadd_ps(v, v, part);
    }
    acc_lo = _mm512_add_pd(acc_lo, _mm512_cvtps_pd(_mm512_castps512_ps256(part)));
    acc_hi = _mm512_add_pd(acc_hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(part), 1))));
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(acc_lo, acc_hi)) + squares_reference<S>(data, i, end);
}
#endif

template <Stored S>
double dispatch(const void* data, int64_t n) {
  constexpr int64_t kBlock = 1 << 16;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  double total = 0;
#if defined(__x86_64__)
  const bool fast = simd::has_avx512();
#else
  const bool fast = false;
#endif
#pragma omp parallel for schedule(static) reduction(+ : total) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, end = begin + kBlock < n ? begin + kBlock : n;
#if defined(__x86_64__)
    if (fast) {
      total += avx512_range<S>(data, begin, end);
      continue;
    }
#endif
    total += squares_reference<S>(data, begin, end);
  }
  return total;
}

}  // namespace

double sum_of_squares_f32_reference(const float* x, int64_t n) { return squares_reference<Stored::f32>(x, 0, n); }
double sum_of_squares_bf16_reference(const uint16_t* x, int64_t n) { return squares_reference<Stored::bf16>(x, 0, n); }
double sum_of_squares_fp16_reference(const uint16_t* x, int64_t n) { return squares_reference<Stored::fp16>(x, 0, n); }
double sum_of_squares_f32(const float* x, int64_t n) { return dispatch<Stored::f32>(x, n); }
double sum_of_squares_bf16(const uint16_t* x, int64_t n) { return dispatch<Stored::bf16>(x, n); }
double sum_of_squares_fp16(const uint16_t* x, int64_t n) { return dispatch<Stored::fp16>(x, n); }

}  // namespace ds::kernels
