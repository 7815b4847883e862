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

float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t x;
  if (exponent == 0x1f) {
    x = sign | 0x7f800000u | (mantissa << 13);  // infinity, or NaN with its payload
  } else if (exponent != 0) {
    x = sign | ((exponent + 112) << 23) | (mantissa << 13);  // exponent bias 15 -> 127
  } else {
    const float f = static_cast<float>(mantissa) * 0x1p-24f;  // zero or subnormal: mantissa units of 2^-24, exact
    std::memcpy(&x, &f, 4);
    x |= sign;
  }
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

uint16_t float_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;  // NaN stays a (quiet) NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and above round to infinity
  if (a >= 0x38800000u) {                       // a normal fp16 (2^-14 and above): round the 13 dropped bits to even
    const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return sign | static_cast<uint16_t>((r - 0x38000000u) >> 13);
  }
  float magnitude;
  std::memcpy(&magnitude, &a, 4);
  // Subnormal (or zero): a whole number of 2^-24 units, rounded to even (1024 units is 2^-14, the smallest normal).
  return sign | static_cast<uint16_t>(std::nearbyint(magnitude * 0x1p24f));
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

template <Stored G>
void scalar_range(float* p, float* m, float* v, uint16_t* out, const void* grad, int64_t begin, int64_t end, const AdamStep& s) {
  const float step_size = s.lr / s.bias_correction1;
  const float decay = s.lr * s.weight_decay;
  for (int64_t i = begin; i < end; ++i) {
    adam_element(stored_at<G>(grad, i) * s.grad_scale, p[i], m[i], v[i], s, step_size, decay);
    if (out) out[i] = float_to_bf16(p[i]);
  }
}

}  // namespace

void adam_step_f32_reference(float* p, float* m, float* v, uint16_t* out, const float* g, int64_t n, const AdamStep& given) {
  AdamStep s = given;
  if (scale_of(given, s.grad_scale)) scalar_range<Stored::f32>(p, m, v, out, g, 0, n, s);
}

void adam_step_bf16_reference(float* p, float* m, float* v, uint16_t* out, const uint16_t* g, int64_t n,
                              const AdamStep& given) {
  AdamStep s = given;
  if (scale_of(given, s.grad_scale)) scalar_range<Stored::bf16>(p, m, v, out, g, 0, n, s);
}

// ---------------------------------------------------------------------------------------------
// AVX-512: 16 lanes per iteration, the same operations in the same order (FMA where the scalar code
// multiplies then adds, so results may differ from the reference in the last bit). Chosen at run
// time, so the binary still runs on CPUs without AVX-512. OpenMP splits the range across threads;
// each thread streams its own contiguous block.

#if defined(__x86_64__)
namespace {

using simd::to_bf16_x16;

template <Stored G>
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
    __m512 g = _mm512_mul_ps(simd::stored16_at<G>(grad, i), gs);
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
  scalar_range<G>(p, m, v, out, grad, i, end, s);  // the tail: fewer than 16 elements
}

using simd::has_avx512;

}  // namespace
#endif

namespace {

template <Stored G>
void dispatch(float* p, float* m, float* v, uint16_t* out, const void* grad, int64_t n, const AdamStep& given) {
  AdamStep s = given;
  if (!scale_of(given, s.grad_scale)) return;  // (the control says skip)
  constexpr int64_t kBlock = 1 << 16;  // elements per task: 1.25 MiB of state, large enough to stream
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, end = begin + kBlock < n ? begin + kBlock : n;
#if defined(__x86_64__)
    if (has_avx512()) {
      avx512_range<G>(p, m, v, out, grad, begin, end, s);
      continue;
    }
#endif
    scalar_range<G>(p, m, v, out, grad, begin, end, s);
  }
}

}  // namespace

void adam_step_f32(float* p, float* m, float* v, uint16_t* out, const float* g, int64_t n, const AdamStep& s) {
  dispatch<Stored::f32>(p, m, v, out, g, n, s);
}

void adam_step_bf16(float* p, float* m, float* v, uint16_t* out, const uint16_t* g, int64_t n, const AdamStep& s) {
  dispatch<Stored::bf16>(p, m, v, out, g, n, s);
}

void adam_step_fp16(float* p, float* m, float* v, uint16_t* out, const uint16_t* g, int64_t n, const AdamStep& s) {
  dispatch<Stored::fp16>(p, m, v, out, g, n, s);
}

const char* adam_implementation() {
#if defined(__x86_64__)
  if (has_avx512()) return "avx512";
#endif
  return "scalar";
}

}  // namespace ds::kernels
