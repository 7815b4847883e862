#include "kernels/cpu/layer_norm.hpp"

#include <cmath>

#include "kernels/cpu/simd.hpp"

namespace ds::kernels {
namespace {

// ---------------------------------------------------------------------------------------------
// Scalar reference: double statistics, one row at a time.

template <class T>
void forward_reference(const T* x, const T* w, const T* b, T* y, float* mean, float* rstd, const NormShape& s) {
  const int64_t C = s.cols;
  for (int64_t r = 0; r < s.rows; ++r) {
    const T* xr = x + r * C;
    double mu = 0;
    if (!s.rms) {
      for (int64_t c = 0; c < C; ++c) mu += widen(xr[c]);
      mu /= static_cast<double>(C);
    }
    double var = 0;
    for (int64_t c = 0; c < C; ++c) var += (widen(xr[c]) - mu) * (widen(xr[c]) - mu);
    const double rs = 1.0 / std::sqrt(var / static_cast<double>(C) + s.eps);
    mean[r] = static_cast<float>(mu);
    rstd[r] = static_cast<float>(rs);
    for (int64_t c = 0; c < C; ++c)
      narrow(y + r * C + c, (widen(xr[c]) - mu) * rs * widen(w[c]) + (b ? widen(b[c]) : 0.0));
  }
}

template <class T>
void backward_reference(const T* dy, const T* x, const T* w, const float* mean, const float* rstd, T* dx, float* dw,
                        float* db, const NormShape& s) {
  const int64_t C = s.cols;
  for (int64_t r = 0; r < s.rows; ++r) {
    double sum_g = 0, sum_gx = 0;
    for (int64_t c = 0; c < C; ++c) {
      const double xhat = (widen(x[r * C + c]) - mean[r]) * rstd[r], g = widen(dy[r * C + c]) * widen(w[c]);
      sum_g += g;
      sum_gx += g * xhat;
      dw[c] += static_cast<float>(widen(dy[r * C + c]) * xhat);
      if (db) db[c] += static_cast<float>(widen(dy[r * C + c]));
    }
    const double a = s.rms ? 0.0 : sum_g / static_cast<double>(C), bb = sum_gx / static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c) {
      const double xhat = (widen(x[r * C + c]) - mean[r]) * rstd[r], g = widen(dy[r * C + c]) * widen(w[c]);
      narrow(dx + r * C + c, rstd[r] * (g - a - xhat * bb));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512: a row at a time across 16 columns per vector (rows are a few KiB: every pass hits L1).

#if defined(__x86_64__)
template <class T>
DS_AVX512 void forward_row(const T* x, const T* w, const T* b, T* y, float* mean, float* rstd, const NormShape& s) {
  const int64_t C = s.cols;
  float mu = 0;
  if (!s.rms) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; c += 16) acc = _mm512_add_ps(acc, simd::load(x + c, simd::first_lanes(C - c)));
    mu = _mm512_reduce_add_ps(acc) / static_cast<float>(C);
  }
  const __m512 vmu = _mm512_set1_ps(mu);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 m = simd::first_lanes(C - c);
    const __m512 d = _mm512_maskz_sub_ps(m, simd::load(x + c, m), vmu);
    acc = _mm512_fmadd_ps(d, d, acc);
  }
  const float rs = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(C) + s.eps);
  *mean = mu;
  *rstd = rs;
  const __m512 vrs = _mm512_set1_ps(rs);
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 m = simd::first_lanes(C - c);
    const __m512 xhat = _mm512_mul_ps(_mm512_sub_ps(simd::load(x + c, m), vmu), vrs);
    const __m512 out = b ? _mm512_fmadd_ps(xhat, simd::load(w + c, m), simd::load(b + c, m)) : _mm512_mul_ps(xhat, simd::load(w + c, m));
    simd::store(y + c, m, out);
  }
}

template <class T>
DS_AVX512 void backward_row(const T* dy, const T* x, const T* w, float mean, float rstd, T* dx, const NormShape& s) {
  const int64_t C = s.cols;
  const __m512 vmu = _mm512_set1_ps(mean), vrs = _mm512_set1_ps(rstd);
  __m512 acc_g = _mm512_setzero_ps(), acc_gx = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 m = simd::first_lanes(C - c);
    const __m512 xhat = _mm512_maskz_mul_ps(m, _mm512_sub_ps(simd::load(x + c, m), vmu), vrs);
    const __m512 g = _mm512_mul_ps(simd::load(dy + c, m), simd::load(w + c, m));
    acc_g = _mm512_add_ps(acc_g, g);
    acc_gx = _mm512_fmadd_ps(g, xhat, acc_gx);
  }
  const float a = s.rms ? 0.0f : _mm512_reduce_add_ps(acc_g) / static_cast<float>(C);
  const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(_mm512_reduce_add_ps(acc_gx) / static_cast<float>(C));
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 m = simd::first_lanes(C - c);
    const __m512 xhat = _mm512_mul_ps(_mm512_sub_ps(simd::load(x + c, m), vmu), vrs);
    const __m512 g = _mm512_mul_ps(simd::load(dy + c, m), simd::load(w + c, m));
    simd::store(dx + c, m, _mm512_mul_ps(vrs, _mm512_fnmadd_ps(xhat, vb, _mm512_sub_ps(g, va))));
  }
}

// dw and db for the 16 columns from c: every row's contribution, in row order.
template <class T>
DS_AVX512 void weight_grads_columns(const T* dy, const T* x, const float* mean, const float* rstd, float* dw, float* db,
                                    int64_t c, const NormShape& s) {
  const int64_t C = s.cols;
  const __mmask16 m = simd::first_lanes(C - c);
  __m512 acc_w = _mm512_setzero_ps(), acc_b = _mm512_setzero_ps();
  for (int64_t r = 0; r < s.rows; ++r) {
    const __m512 d = simd::load(dy + r * C + c, m);
    const __m512 xhat = _mm512_mul_ps(_mm512_sub_ps(simd::load(x + r * C + c, m), _mm512_set1_ps(mean[r])), _mm512_set1_ps(rstd[r]));
    acc_w = _mm512_fmadd_ps(d, xhat, acc_w);
    acc_b = _mm512_add_ps(acc_b, d);
  }
  _mm512_mask_storeu_ps(dw + c, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, dw + c), acc_w));
  if (db) _mm512_mask_storeu_ps(db + c, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, db + c), acc_b));
}
#endif

template <class T>
void forward(const T* x, const T* w, const T* b, T* y, float* mean, float* rstd, const NormShape& s) {
#if defined(__x86_64__)
  if (simd::has_avx512()) {
#pragma omp parallel for schedule(static) if (s.rows > 1)
    for (int64_t r = 0; r < s.rows; ++r) forward_row(x + r * s.cols, w, b, y + r * s.cols, mean + r, rstd + r, s);
    return;
  }
#endif
  forward_reference(x, w, b, y, mean, rstd, s);
}

template <class T>
void backward(const T* dy, const T* x, const T* w, const float* mean, const float* rstd, T* dx, float* dw, float* db,
              const NormShape& s) {
#if defined(__x86_64__)
  if (simd::has_avx512()) {
    const int64_t C = s.cols, vectors = (C + 15) / 16;
#pragma omp parallel
    {
#pragma omp for schedule(static) nowait
      for (int64_t r = 0; r < s.rows; ++r) backward_row(dy + r * C, x + r * C, w, mean[r], rstd[r], dx + r * C, s);
#pragma omp for schedule(static)
      for (int64_t v = 0; v < vectors; ++v) weight_grads_columns(dy, x, mean, rstd, dw, db, v * 16, s);
    }
    return;
  }
#endif
  backward_reference(dy, x, w, mean, rstd, dx, dw, db, s);
}

}  // namespace

void norm_forward_f32(const float* x, const float* w, const float* b, float* y, float* mean, float* rstd, const NormShape& s) {
  forward(x, w, b, y, mean, rstd, s);
}
void norm_forward_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* b, uint16_t* y, float* mean, float* rstd,
                       const NormShape& s) {
  forward(x, w, b, y, mean, rstd, s);
}
void norm_backward_f32(const float* dy, const float* x, const float* w, const float* mean, const float* rstd, float* dx,
                       float* dw, float* db, const NormShape& s) {
  backward(dy, x, w, mean, rstd, dx, dw, db, s);
}
void norm_backward_bf16(const uint16_t* dy, const uint16_t* x, const uint16_t* w, const float* mean, const float* rstd,
                        uint16_t* dx, float* dw, float* db, const NormShape& s) {
  backward(dy, x, w, mean, rstd, dx, dw, db, s);
}
void norm_forward_f32_reference(const float* x, const float* w, const float* b, float* y, float* mean, float* rstd,
                                const NormShape& s) {
  forward_reference(x, w, b, y, mean, rstd, s);
}
void norm_forward_bf16_reference(const uint16_t* x, const uint16_t* w, const uint16_t* b, uint16_t* y, float* mean,
                                 float* rstd, const NormShape& s) {
  forward_reference(x, w, b, y, mean, rstd, s);
}
void norm_backward_f32_reference(const float* dy, const float* x, const float* w, const float* mean, const float* rstd,
                                 float* dx, float* dw, float* db, const NormShape& s) {
  backward_reference(dy, x, w, mean, rstd, dx, dw, db, s);
}
void norm_backward_bf16_reference(const uint16_t* dy, const uint16_t* x, const uint16_t* w, const float* mean,
                                  const float* rstd, uint16_t* dx, float* dw, float* db, const NormShape& s) {
  backward_reference(dy, x, w, mean, rstd, dx, dw, db, s);
}

}  // namespace ds::kernels
