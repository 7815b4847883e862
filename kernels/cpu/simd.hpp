// ds — building blocks the CPU kernels share (internal to kernels/cpu): scalar element access, and in
// AVX-512: bf16 <-> fp32 in 16 lanes, fp16 -> fp32, loads and stores of fp32 or bf16 with a mask for the tail, exp,
// sigmoid. Every AVX-512 function is compiled for AVX-512 by attribute and called only after has_avx512() said yes, so the binary still
// runs on CPUs without it (the kernels fall back to their scalar references).
#pragma once

#include <cstdint>

#include "common/cpu_features.hpp"
#include "kernels/cpu/adam.hpp"

namespace ds::kernels {

// Scalar element access for the reference versions: fp32 or bf16 (uint16_t) read as double, and a
// double written back rounded to the element's type.
inline double widen(float v) { return v; }
inline double widen(uint16_t v) { return bf16_to_float(v); }
inline void narrow(float* p, double v) { *p = static_cast<float>(v); }
inline void narrow(uint16_t* p, double v) { *p = float_to_bf16(static_cast<float>(v)); }

// How a buffer the optimizers read (gradients) or sum the squares of stores its elements: fp32, bf16 or fp16
// (both 16-bit kinds held as uint16_t, told apart by this tag). Element i of such a buffer, in fp32, exactly.
enum class Stored { f32, bf16, fp16 };
template <Stored S>
inline float stored_at(const void* data, int64_t i) {
  if constexpr (S == Stored::f32) return static_cast<const float*>(data)[i];
  if constexpr (S == Stored::bf16) return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
  return fp16_to_float(static_cast<const uint16_t*>(data)[i]);
}

}  // namespace ds::kernels

#if defined(__x86_64__)
#include <immintrin.h>

#define DS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

namespace ds::kernels::simd {

inline bool has_avx512() { return cpu_has_avx512(); }

// fp32 -> bf16, round to nearest even; NaN stays a quiet NaN.
DS_AVX512 inline __m256i to_bf16_x16(__m512 x) {
  const __m512i xi = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(xi, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(xi, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

DS_AVX512 inline __m512 from_bf16_x16(__m256i b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// Elements [i, i + 16) of a Stored buffer in fp32 (fp16 through the hardware's exact conversion).
template <Stored S>
DS_AVX512 inline __m512 stored16_at(const void* data, int64_t i) {
  if constexpr (S == Stored::f32) return _mm512_loadu_ps(static_cast<const float*>(data) + i);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(data) + i));
  if constexpr (S == Stored::bf16) return from_bf16_x16(h);
  return _mm512_cvtph_ps(h);
}

// The lanes [0, n) of 16, n <= 16.
DS_AVX512 inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}

// Up to 16 elements of T (float or uint16_t = bf16) as fp32; lanes outside `m` read as zero.
template <class T>
DS_AVX512 inline __m512 load(const T* p, __mmask16 m) {
  if constexpr (sizeof(T) == 2)
    return from_bf16_x16(_mm256_maskz_loadu_epi16(m, p));
  else
    return _mm512_maskz_loadu_ps(m, p);
}

template <class T>
DS_AVX512 inline void store(T* p, __mmask16 m, __m512 v) {
  if constexpr (sizeof(T) == 2)
    _mm256_mask_storeu_epi16(p, m, to_bf16_x16(v));
  else
    _mm512_mask_storeu_ps(p, m, v);
}

// e^x to ~1 ulp for x <= ~88 (larger x overflows to inf); NaN stays NaN, very negative x gives 0.
// Range reduction x = n ln2 + r with |r| <= ln2/2 (ln2 split in two for exactness), e^r by its Taylor
// polynomial to degree 7 (truncation below 1e-8 relative there), then scaled by 2^n.
DS_AVX512 inline __m512 exp(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);  // NaN in the second operand passes through
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 1 / (1 + e^-v): exact limits at both ends (e^-v -> inf gives 0), relative accuracy in both tails.
DS_AVX512 inline __m512 sigmoid(__m512 v) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, simd::exp(_mm512_sub_ps(_mm512_setzero_ps(), v))));
}

// sum_j e^(scale z_j - shift) over z[0, n) (fp32 or bf16), the fp32 lanes flushed into double every
// 1024 elements so the sum stays exact to ~1e-7 at any n. Softmax denominators: shift = the row's max.
// `kept` (n floats), when given, receives each e^(scale z_j - shift), so a later pass need not redo it.
template <class T>
DS_AVX512 inline double sum_exp(const T* z, int64_t n, float scale, float shift, float* kept = nullptr) {
  const __m512 vs = _mm512_set1_ps(scale), vshift = _mm512_set1_ps(shift);
  __m512d sum_lo = _mm512_setzero_pd(), sum_hi = _mm512_setzero_pd();
  for (int64_t block = 0; block < n; block += 1024) {
    const int64_t end = block + 1024 < n ? block + 1024 : n;
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = block; j < end; j += 16) {
      const __mmask16 m = first_lanes(end - j);
      const __m512 e = simd::exp(_mm512_fmsub_ps(vs, load(z + j, m), vshift));
      if (kept) _mm512_mask_storeu_ps(kept + j, m, e);
      vsum = _mm512_mask_add_ps(vsum, m, vsum, e);
    }
    sum_lo = _mm512_add_pd(sum_lo, _mm512_cvtps_pd(_mm512_castps512_ps256(vsum)));
    sum_hi = _mm512_add_pd(sum_hi, _mm512_cvtps_pd(_mm512_extractf32x8_ps(vsum, 1)));
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(sum_lo, sum_hi));
}

}  // namespace ds::kernels::simd

#endif
