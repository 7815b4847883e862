#include "kernels/cpu/attention_softmax.hpp"

#include <cmath>
#include <limits>

#include "kernels/cpu/simd.hpp"

namespace ds::kernels {
namespace {

template <class T>
void forward_row_reference(T* s, float* lse, int64_t n, int64_t cols, double scale) {
  double max = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < n; ++j) max = std::fmax(max, scale * widen(s[j]));
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += std::exp(scale * widen(s[j]) - max);
  const double l = max + std::log(sum);
  for (int64_t j = 0; j < n; ++j) narrow(s + j, std::exp(scale * widen(s[j]) - l));
  for (int64_t j = n; j < cols; ++j) narrow(s + j, 0.0);
  *lse = static_cast<float>(l);
}

template <class T>
void recompute_row_reference(T* s, float lse, int64_t n, int64_t cols, double scale) {
  for (int64_t j = 0; j < n; ++j) narrow(s + j, std::exp(scale * widen(s[j]) - static_cast<double>(lse)));
  for (int64_t j = n; j < cols; ++j) narrow(s + j, 0.0);
}

template <class T>
void backward_row_reference(const T* p, T* dp, int64_t n, int64_t cols, double scale) {
  double delta = 0;
  for (int64_t j = 0; j < n; ++j) delta += widen(p[j]) * widen(dp[j]);
  for (int64_t j = 0; j < n; ++j) narrow(dp + j, scale * widen(p[j]) * (widen(dp[j]) - delta));
  for (int64_t j = n; j < cols; ++j) narrow(dp + j, 0.0);
}

#if defined(__x86_64__)
// Zero the masked tail [n, cols) of a row.
template <class T>
DS_AVX512 void zero_tail(T* s, int64_t n, int64_t cols) {
  for (int64_t j = n; j < cols; j += 16) simd::store(s + j, simd::first_lanes(cols - j), _mm512_setzero_ps());
}

// Three passes over a row that sits in L1 (<= 4 KiB per 1024 fp32 scores): maximum, sum of
// exponentials, probabilities.
template <class T>
DS_AVX512 void forward_row_avx512(T* s, float* lse, int64_t n, int64_t cols, float scale) {
  using namespace simd;
  const __m512 vs = _mm512_set1_ps(scale);
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = first_lanes(n - j);
    vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_mul_ps(vs, load(s + j, m)));
  }
  const float max = _mm512_reduce_max_ps(vmax);
  const double l = static_cast<double>(max) + std::log(simd::sum_exp(s, n, scale, max));
  const __m512 vl = _mm512_set1_ps(static_cast<float>(l));
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = first_lanes(n - j);
    store(s + j, m, simd::exp(_mm512_fmsub_ps(vs, load(s + j, m), vl)));
  }
  zero_tail(s, n, cols);
  *lse = static_cast<float>(l);
}

template <class T>
DS_AVX512 void recompute_row_avx512(T* s, float lse, int64_t n, int64_t cols, float scale) {
  const __m512 vs = _mm512_set1_ps(scale), vl = _mm512_set1_ps(lse);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = simd::first_lanes(n - j);
    simd::store(s + j, m, simd::exp(_mm512_fmsub_ps(vs, simd::load(s + j, m), vl)));
  }
  zero_tail(s, n, cols);
}

template <class T>
DS_AVX512 void backward_row_avx512(const T* p, T* dp, int64_t n, int64_t cols, float scale) {
  __m512 vdot = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = simd::first_lanes(n - j);
    vdot = _mm512_fmadd_ps(simd::load(p + j, m), simd::load(dp + j, m), vdot);
  }
  const __m512 vs = _mm512_set1_ps(scale), vd = _mm512_set1_ps(_mm512_reduce_add_ps(vdot));
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = simd::first_lanes(n - j);
    const __m512 pj = _mm512_mul_ps(vs, simd::load(p + j, m));
    simd::store(dp + j, m, _mm512_mul_ps(pj, _mm512_sub_ps(simd::load(dp + j, m), vd)));
  }
  zero_tail(dp, n, cols);
}
#endif

// Each row in turn, rows split over OpenMP threads (causal rows differ in length, so dynamic); the
// references one thread, row by row, in double.
template <class F>
void over_rows(const CausalBlock& b, bool reference, F f) {
#pragma omp parallel for schedule(dynamic, 16) if (!reference && b.rows > 16)
  for (int64_t r = 0; r < b.rows; ++r) f(r, b.visible(r));
}

template <class T>
void forward(T* s, float* lse, const CausalBlock& b, bool reference) {
  over_rows(b, reference, [&](int64_t r, int64_t n) {
#if defined(__x86_64__)
    if (!reference && simd::has_avx512()) return forward_row_avx512(s + r * b.cols, lse + r, n, b.cols, b.scale);
#endif
    forward_row_reference(s + r * b.cols, lse + r, n, b.cols, b.scale);
  });
}

template <class T>
void recompute(T* s, const float* lse, const CausalBlock& b, bool reference) {
  over_rows(b, reference, [&](int64_t r, int64_t n) {
#if defined(__x86_64__)
    if (!reference && simd::has_avx512()) return recompute_row_avx512(s + r * b.cols, lse[r], n, b.cols, b.scale);
#endif
    recompute_row_reference(s + r * b.cols, lse[r], n, b.cols, b.scale);
  });
}

template <class T>
void backward(const T* p, T* dp, const CausalBlock& b, bool reference) {
  over_rows(b, reference, [&](int64_t r, int64_t n) {
#if defined(__x86_64__)
    if (!reference && simd::has_avx512()) return backward_row_avx512(p + r * b.cols, dp + r * b.cols, n, b.cols, b.scale);
#endif
    backward_row_reference(p + r * b.cols, dp + r * b.cols, n, b.cols, b.scale);
  });
}

}  // namespace

void causal_softmax_forward_f32(float* s, float* lse, const CausalBlock& b) { forward(s, lse, b, false); }
void causal_softmax_forward_bf16(uint16_t* s, float* lse, const CausalBlock& b) { forward(s, lse, b, false); }
void causal_softmax_recompute_f32(float* s, const float* lse, const CausalBlock& b) { recompute(s, lse, b, false); }
void causal_softmax_recompute_bf16(uint16_t* s, const float* lse, const CausalBlock& b) { recompute(s, lse, b, false); }
void causal_softmax_backward_f32(const float* p, float* dp, const CausalBlock& b) { backward(p, dp, b, false); }
void causal_softmax_backward_bf16(const uint16_t* p, uint16_t* dp, const CausalBlock& b) { backward(p, dp, b, false); }
void causal_softmax_forward_f32_reference(float* s, float* lse, const CausalBlock& b) { forward(s, lse, b, true); }
void causal_softmax_forward_bf16_reference(uint16_t* s, float* lse, const CausalBlock& b) { forward(s, lse, b, true); }
void causal_softmax_recompute_f32_reference(float* s, const float* lse, const CausalBlock& b) { recompute(s, lse, b, true); }
void causal_softmax_recompute_bf16_reference(uint16_t* s, const float* lse, const CausalBlock& b) {
  recompute(s, lse, b, true);
}
void causal_softmax_backward_f32_reference(const float* p, float* dp, const CausalBlock& b) { backward(p, dp, b, true); }
void causal_softmax_backward_bf16_reference(const uint16_t* p, uint16_t* dp, const CausalBlock& b) {
  backward(p, dp, b, true);
}

}  // namespace ds::kernels
