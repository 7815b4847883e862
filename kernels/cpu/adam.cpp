#include "kernels/cpu/adam.hpp"

#include "kernels/optimizer_elements.hpp"

#include <cmath>
#include <cstring>

#include "kernels/cpu/simd.hpp"

namespace ds::kernels {

uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays a (quiet) NaN
  x += 0x7fffu + ((x >> 16) & 1u);                    // round to nearest, ties to even
  return static_cast<uint16_t>(x >> 16);
}

float bf16_to_float(uint16_t b) {
  const uint32_t x = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

AdamStep AdamStep::at_step(int64_t t) const {
  AdamStep s = *this;
  s.bias_correction1 = 1;
  s.rsqrt_bias_correction2 = 1;
  if (bias_correction) {
    s.bias_correction1 = static_cast<float>(1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(t)));
    s.rsqrt_bias_correction2 =
        static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(t))));
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Scalar reference: one element at a time, in the order of the header's formula.

namespace {

template <class LoadGrad>
void scalar_range(float* p, float* m, float* v, uint16_t* out, int64_t begin, int64_t end, const AdamStep& s,
                  LoadGrad grad) {
  const float step_size = s.lr / s.bias_correction1;
  const float decay = s.lr * s.weight_decay;
  for (int64_t i = begin; i < end; ++i) {
    adam_element(grad(i) * s.grad_scale, p[i], m[i], v[i], s, step_size, decay);
    if (out) out[i] = float_to_bf16(p[i]);
  }
}

}  // namespace

void adam_step_f32_reference(float* p, float* m, float* v, uint16_t* out, const float* g, int64_t n, const AdamStep& s) {
  scalar_range(p, m, v, out, 0, n, s, [g](int64_t i) { return g[i]; });
}

void adam_step_bf16_reference(float* p, float* m, float* v, uint16_t* out, const uint16_t* g, int64_t n,
                              const AdamStep& s) {
  scalar_range(p, m, v, out, 0, n, s, [g](int64_t i) { return bf16_to_float(g[i]); });
}

// ---------------------------------------------------------------------------------------------
// AVX-512: 16 lanes per iteration, the same operations in the same order (FMA where the scalar code
// multiplies then adds, so results may differ from the reference in the last bit). Chosen at run
// time, so the binary still runs on CPUs without AVX-512. OpenMP splits the range across threads;
// each thread streams its own contiguous block.

#if defined(__x86_64__)
namespace {

using simd::from_bf16_x16;
using simd::to_bf16_x16;

template <bool kBf16Grad>
DS_AVX512 void avx512_range(float* p, float* m, float* v, uint16_t* out, const void* grad,
                                                     int64_t begin, int64_t end, const AdamStep& s) {
  const __m512 b1 = _mm512_set1_ps(s.beta1), b2 = _mm512_set1_ps(s.beta2);
  const __m512 omb1 = _mm512_set1_ps(1 - s.beta1), omb2 = _mm512_set1_ps(1 - s.beta2);
  const __m512 eps = _mm512_set1_ps(s.eps), rbc2 = _mm512_set1_ps(s.rsqrt_bias_correction2);
  const __m512 step = _mm512_set1_ps(s.lr / s.bias_correction1), gs = _mm512_set1_ps(s.grad_scale);
  const __m512 wd = _mm512_set1_ps(s.weight_decay), decay = _mm512_set1_ps(s.lr * s.weight_decay);
  const bool l2 = !s.decoupled && s.weight_decay != 0, decoupled = s.decoupled && s.weight_decay != 0;
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    __m512 g;
    if constexpr (kBf16Grad)
      g = from_bf16_x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i)));
    else
      g = _mm512_loadu_ps(static_cast<const float*>(grad) + i);
    g = _mm512_mul_ps(g, gs);
    __m512 w = _mm512_loadu_ps(p + i);
    if (l2) g = _mm512_fmadd_ps(wd, w, g);
    const __m512 mi = _mm512_fmadd_ps(b1, _mm512_loadu_ps(m + i), _mm512_mul_ps(omb1, g));
    const __m512 vi = _mm512_fmadd_ps(b2, _mm512_loadu_ps(v + i), _mm512_mul_ps(omb2, _mm512_mul_ps(g, g)));
    const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(vi), rbc2, eps);
    if (decoupled) w = _mm512_fnmadd_ps(decay, w, w);
    w = _mm512_fnmadd_ps(step, _mm512_div_ps(mi, denom), w);
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    _mm512_storeu_ps(p + i, w);
    if (out) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), to_bf16_x16(w));
  }
  // Tail: fewer than 16 elements, scalar.
  if constexpr (kBf16Grad) {
    const uint16_t* g = static_cast<const uint16_t*>(grad);
    scalar_range(p, m, v, out, i, end, s, [g](int64_t k) { return bf16_to_float(g[k]); });
  } else {
    const float* g = static_cast<const float*>(grad);
    scalar_range(p, m, v, out, i, end, s, [g](int64_t k) { return g[k]; });
  }
}

using simd::has_avx512;

}  // namespace
#endif

namespace {

template <bool kBf16Grad>
void dispatch(float* p, float* m, float* v, uint16_t* out, const void* grad, int64_t n, const AdamStep& s) {
  constexpr int64_t kBlock = 1 << 16;  // elements per task: 1.25 MiB of state, large enough to stream
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, end = begin + kBlock < n ? begin + kBlock : n;
#if defined(__x86_64__)
    if (has_avx512()) {
      avx512_range<kBf16Grad>(p, m, v, out, grad, begin, end, s);
      continue;
    }
#endif
    if constexpr (kBf16Grad) {
      const uint16_t* g = static_cast<const uint16_t*>(grad);
      scalar_range(p, m, v, out, begin, end, s, [g](int64_t k) { return bf16_to_float(g[k]); });
    } else {
      const float* g = static_cast<const float*>(grad);
      scalar_range(p, m, v, out, begin, end, s, [g](int64_t k) { return g[k]; });
    }
  }
}

}  // namespace

void adam_step_f32(float* p, float* m, float* v, uint16_t* out, const float* g, int64_t n, const AdamStep& s) {
  dispatch<false>(p, m, v, out, g, n, s);
}

void adam_step_bf16(float* p, float* m, float* v, uint16_t* out, const uint16_t* g, int64_t n, const AdamStep& s) {
  dispatch<true>(p, m, v, out, g, n, s);
}

const char* adam_implementation() {
#if defined(__x86_64__)
  if (has_avx512()) return "avx512";
#endif
  return "scalar";
}

}  // namespace ds::kernels
