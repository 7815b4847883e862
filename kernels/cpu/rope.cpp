#include "kernels/cpu/rope.hpp"

#include "kernels/cpu/simd.hpp"

namespace ds::kernels {
namespace {

// One row's heads at position t; c and s point at that position's D/2 table entries.
template <class T>
void row_reference(const T* x, T* y, const float* c, const float* s, const RopeShape& sh) {
  const int64_t half = sh.D / 2;
  const double sign = sh.inverse ? -1.0 : 1.0;
  for (int64_t h = 0; h < sh.heads; ++h) {
    const T* xh = x + h * sh.D;
    T* yh = y + h * sh.D;
    for (int64_t j = 0; j < half; ++j) {
      const double a = widen(xh[j]), b = widen(xh[j + half]), cj = c[j], sj = sign * s[j];
      narrow(yh + j, a * cj - b * sj);
      narrow(yh + j + half, b * cj + a * sj);
    }
  }
}

#if defined(__x86_64__)
template <class T>
DS_AVX512 void row_avx512(const T* x, T* y, const float* c, const float* s, const RopeShape& sh) {
  const int64_t half = sh.D / 2;
  const __m512 sign = _mm512_set1_ps(sh.inverse ? -1.0f : 1.0f);
  for (int64_t j = 0; j < half; j += 16) {
    const __mmask16 m = simd::first_lanes(half - j);
    const __m512 cj = _mm512_maskz_loadu_ps(m, c + j), sj = _mm512_mul_ps(sign, _mm512_maskz_loadu_ps(m, s + j));
    for (int64_t h = 0; h < sh.heads; ++h) {
      const T* xh = x + h * sh.D;
      T* yh = y + h * sh.D;
      const __m512 a = simd::load(xh + j, m), b = simd::load(xh + j + half, m);
      simd::store(yh + j, m, _mm512_fmsub_ps(a, cj, _mm512_mul_ps(b, sj)));
      simd::store(yh + j + half, m, _mm512_fmadd_ps(b, cj, _mm512_mul_ps(a, sj)));
    }
  }
}
#endif

template <class T>
void run(const T* x, T* y, const float* cos, const float* sin, const RopeShape& sh, bool reference) {
  const int64_t width = sh.heads * sh.D, half = sh.D / 2;
#pragma omp parallel for schedule(static) if (!reference && sh.rows * width > (1 << 15))
  for (int64_t r = 0; r < sh.rows; ++r) {
    const int64_t t = r % sh.T;
#if defined(__x86_64__)
    if (!reference && simd::has_avx512()) {
      row_avx512(x + r * width, y + r * width, cos + t * half, sin + t * half, sh);
      continue;
    }
#endif
    row_reference(x + r * width, y + r * width, cos + t * half, sin + t * half, sh);
  }
}

}  // namespace

void rope_f32(const float* x, float* y, const float* cos, const float* sin, const RopeShape& s) {
  run(x, y, cos, sin, s, false);
}
void rope_bf16(const uint16_t* x, uint16_t* y, const float* cos, const float* sin, const RopeShape& s) {
  run(x, y, cos, sin, s, false);
}
void rope_f32_reference(const float* x, float* y, const float* cos, const float* sin, const RopeShape& s) {
  run(x, y, cos, sin, s, true);
}
void rope_bf16_reference(const uint16_t* x, uint16_t* y, const float* cos, const float* sin, const RopeShape& s) {
  run(x, y, cos, sin, s, true);
}

}  // namespace ds::kernels
