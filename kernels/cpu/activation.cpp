#include "kernels/cpu/activation.hpp"

#include <cmath>

#include "kernels/cpu/simd.hpp"

namespace ds::kernels {
namespace {

constexpr double kSqrt2OverPi = 0.79788456080286535588, kCubic = 0.044715;

template <class T>
void gelu_forward_reference(const T* x, T* y, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const double v = widen(x[i]);
    narrow(y + i, 0.5 * v * (1.0 + std::tanh(kSqrt2OverPi * (v + kCubic * v * v * v))));
  }
}

template <class T>
void gelu_backward_reference(const T* dy, const T* x, T* dx, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const double v = widen(x[i]), t = std::tanh(kSqrt2OverPi * (v + kCubic * v * v * v));
    const double d = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * kSqrt2OverPi * (1.0 + 3.0 * kCubic * v * v);
    narrow(dx + i, widen(dy[i]) * d);
  }
}

template <class T>
void swiglu_forward_reference(const T* g, const T* u, T* y, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const double a = widen(g[i]);
    narrow(y + i, a / (1.0 + std::exp(-a)) * widen(u[i]));
  }
}

template <class T>
void swiglu_backward_reference(const T* dy, const T* g, const T* u, T* dg, T* du, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const double a = widen(g[i]), s = 1.0 / (1.0 + std::exp(-a)), d = widen(dy[i]);
    narrow(dg + i, d * widen(u[i]) * s * (1.0 + a * (1.0 - s)));
    narrow(du + i, d * a * s);
  }
}

#if defined(__x86_64__)
// With s = sigmoid(2u) = (1 + tanh u) / 2:  y = x s,  dy/dx = s + 2 x s (1 - s) du/dx. Written this
// way nothing cancels in the negative tail (1 + tanh u computed as such loses every digit there).
template <class T>
DS_AVX512 void gelu_forward_avx512(const T* x, T* y, int64_t begin, int64_t end) {
  const __m512 k0 = _mm512_set1_ps(static_cast<float>(2 * kSqrt2OverPi)), k1 = _mm512_set1_ps(static_cast<float>(kCubic));
  for (int64_t i = begin; i < end; i += 16) {
    const __mmask16 m = simd::first_lanes(end - i);
    const __m512 v = simd::load(x + i, m);
    const __m512 two_u = _mm512_mul_ps(k0, _mm512_fmadd_ps(_mm512_mul_ps(k1, v), _mm512_mul_ps(v, v), v));
    simd::store(y + i, m, _mm512_mul_ps(v, simd::sigmoid(two_u)));
  }
}

template <class T>
DS_AVX512 void gelu_backward_avx512(const T* dy, const T* x, T* dx, int64_t begin, int64_t end) {
  const __m512 k0 = _mm512_set1_ps(static_cast<float>(2 * kSqrt2OverPi)), k1 = _mm512_set1_ps(static_cast<float>(kCubic));
  const __m512 k3 = _mm512_set1_ps(static_cast<float>(3 * kCubic)), one = _mm512_set1_ps(1.0f);
  for (int64_t i = begin; i < end; i += 16) {
    const __mmask16 m = simd::first_lanes(end - i);
    const __m512 v = simd::load(x + i, m), v2 = _mm512_mul_ps(v, v);
    const __m512 s = simd::sigmoid(_mm512_mul_ps(k0, _mm512_fmadd_ps(_mm512_mul_ps(k1, v), v2, v)));
    const __m512 two_du = _mm512_mul_ps(k0, _mm512_fmadd_ps(k3, v2, one));  // 2 du/dx
    const __m512 d = _mm512_fmadd_ps(_mm512_mul_ps(v, _mm512_mul_ps(s, _mm512_sub_ps(one, s))), two_du, s);
    simd::store(dx + i, m, _mm512_mul_ps(simd::load(dy + i, m), d));
  }
}

template <class T>
DS_AVX512 void swiglu_forward_avx512(const T* g, const T* u, T* y, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += 16) {
    const __mmask16 m = simd::first_lanes(end - i);
    const __m512 a = simd::load(g + i, m);
    simd::store(y + i, m, _mm512_mul_ps(_mm512_mul_ps(a, simd::sigmoid(a)), simd::load(u + i, m)));
  }
}

template <class T>
DS_AVX512 void swiglu_backward_avx512(const T* dy, const T* g, const T* u, T* dg, T* du, int64_t begin, int64_t end) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = begin; i < end; i += 16) {
    const __mmask16 m = simd::first_lanes(end - i);
    const __m512 a = simd::load(g + i, m), s = simd::sigmoid(a), d = simd::load(dy + i, m);
    const __m512 dsilu = _mm512_mul_ps(s, _mm512_fmadd_ps(a, _mm512_sub_ps(one, s), one));
    simd::store(dg + i, m, _mm512_mul_ps(_mm512_mul_ps(d, simd::load(u + i, m)), dsilu));
    simd::store(du + i, m, _mm512_mul_ps(d, _mm512_mul_ps(a, s)));
  }
}
#endif

// OpenMP over blocks of 16K elements (a multiple of 16, so only the last block has a tail).
template <class F>
void over_blocks(int64_t n, F f) {
  constexpr int64_t kBlock = 1 << 14;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) f(b * kBlock, b * kBlock + kBlock < n ? b * kBlock + kBlock : n);
}

template <class T>
void gelu_forward(const T* x, T* y, int64_t n) {
  over_blocks(n, [&](int64_t begin, int64_t end) {
#if defined(__x86_64__)
    if (simd::has_avx512()) return gelu_forward_avx512(x, y, begin, end);
#endif
    gelu_forward_reference(x, y, begin, end);
  });
}

template <class T>
void gelu_backward(const T* dy, const T* x, T* dx, int64_t n) {
  over_blocks(n, [&](int64_t begin, int64_t end) {
#if defined(__x86_64__)
    if (simd::has_avx512()) return gelu_backward_avx512(dy, x, dx, begin, end);
#endif
    gelu_backward_reference(dy, x, dx, begin, end);
  });
}

template <class T>
void swiglu_forward(const T* g, const T* u, T* y, int64_t n) {
  over_blocks(n, [&](int64_t begin, int64_t end) {
#if defined(__x86_64__)
    if (simd::has_avx512()) return swiglu_forward_avx512(g, u, y, begin, end);
#endif
    swiglu_forward_reference(g, u, y, begin, end);
  });
}

template <class T>
void swiglu_backward(const T* dy, const T* g, const T* u, T* dg, T* du, int64_t n) {
  over_blocks(n, [&](int64_t begin, int64_t end) {
#if defined(__x86_64__)
    if (simd::has_avx512()) return swiglu_backward_avx512(dy, g, u, dg, du, begin, end);
#endif
    swiglu_backward_reference(dy, g, u, dg, du, begin, end);
  });
}

}  // namespace

void swiglu_forward_f32(const float* g, const float* u, float* y, int64_t n) { swiglu_forward(g, u, y, n); }
void swiglu_forward_bf16(const uint16_t* g, const uint16_t* u, uint16_t* y, int64_t n) { swiglu_forward(g, u, y, n); }
void swiglu_backward_f32(const float* dy, const float* g, const float* u, float* dg, float* du, int64_t n) {
  swiglu_backward(dy, g, u, dg, du, n);
}
void swiglu_backward_bf16(const uint16_t* dy, const uint16_t* g, const uint16_t* u, uint16_t* dg, uint16_t* du, int64_t n) {
  swiglu_backward(dy, g, u, dg, du, n);
}
void swiglu_forward_f32_reference(const float* g, const float* u, float* y, int64_t n) {
  swiglu_forward_reference(g, u, y, 0, n);
}
void swiglu_forward_bf16_reference(const uint16_t* g, const uint16_t* u, uint16_t* y, int64_t n) {
  swiglu_forward_reference(g, u, y, 0, n);
}
void swiglu_backward_f32_reference(const float* dy, const float* g, const float* u, float* dg, float* du, int64_t n) {
  swiglu_backward_reference(dy, g, u, dg, du, 0, n);
}
void swiglu_backward_bf16_reference(const uint16_t* dy, const uint16_t* g, const uint16_t* u, uint16_t* dg, uint16_t* du,
                                    int64_t n) {
  swiglu_backward_reference(dy, g, u, dg, du, 0, n);
}

void gelu_tanh_forward_f32(const float* x, float* y, int64_t n) { gelu_forward(x, y, n); }
void gelu_tanh_forward_bf16(const uint16_t* x, uint16_t* y, int64_t n) { gelu_forward(x, y, n); }
void gelu_tanh_backward_f32(const float* dy, const float* x, float* dx, int64_t n) { gelu_backward(dy, x, dx, n); }
void gelu_tanh_backward_bf16(const uint16_t* dy, const uint16_t* x, uint16_t* dx, int64_t n) { gelu_backward(dy, x, dx, n); }
void gelu_tanh_forward_f32_reference(const float* x, float* y, int64_t n) { gelu_forward_reference(x, y, 0, n); }
void gelu_tanh_forward_bf16_reference(const uint16_t* x, uint16_t* y, int64_t n) { gelu_forward_reference(x, y, 0, n); }
void gelu_tanh_backward_f32_reference(const float* dy, const float* x, float* dx, int64_t n) {
  gelu_backward_reference(dy, x, dx, 0, n);
}
void gelu_tanh_backward_bf16_reference(const uint16_t* dy, const uint16_t* x, uint16_t* dx, int64_t n) {
  gelu_backward_reference(dy, x, dx, 0, n);
}

}  // namespace ds::kernels
