#include "kernels/cpu/cross_entropy.hpp"

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/simd.hpp"

namespace ds::kernels {
namespace {

template <class T>
double reference_rows(T* logits, const int64_t* targets, int64_t rows, int64_t vocab, int64_t stride, float grad_scale,
                      bool write_grad) {
  double total = 0;
  for (int64_t r = 0; r < rows; ++r) {
    T* z = logits + r * stride;
    double max = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < vocab; ++j) max = std::fmax(max, widen(z[j]));
    double sum = 0;
    for (int64_t j = 0; j < vocab; ++j) sum += std::exp(widen(z[j]) - max);
    const double lse = max + std::log(sum);
    const int64_t t = targets[r];
    total += lse - widen(z[t]);
    if (!write_grad) continue;
    for (int64_t j = 0; j < vocab; ++j)
      narrow(z + j, (std::exp(widen(z[j]) - lse) - (j == t ? 1.0 : 0.0)) * static_cast<double>(grad_scale));
  }
  return total;
}

#if defined(__x86_64__)
// One row in three passes over it: the maximum, the exponentials (fp32 lanes; summed, and kept in
// `exps` when the gradient is wanted), then the gradient from the kept exponentials. The target's
// entry is recomputed in double from the value read before the row was overwritten, so 1 is
// subtracted before rounding, not after. `exps` holds `vocab` floats: 200 KB at GPT-2's vocabulary,
// in L2, where recomputing each exponential cost a third of the kernel.
template <class T>
DS_AVX512 double avx512_row(T* z, int64_t t, int64_t vocab, float grad_scale, bool write_grad, float* exps) {
  using namespace simd;
  const double zt = widen(z[t]);
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < vocab; j += 16) {
    const __mmask16 m = first_lanes(vocab - j);
    vmax = _mm512_mask_max_ps(vmax, m, vmax, load(z + j, m));
  }
  const float max = _mm512_reduce_max_ps(vmax);
  // z - max exactly: fmsub by 1
  const double sum = simd::sum_exp(z, vocab, 1.0f, max, write_grad ? exps : nullptr);
  const double lse = static_cast<double>(max) + std::log(sum);
  if (write_grad) {
    const __m512 scale = _mm512_set1_ps(static_cast<float>(grad_scale / sum));
    for (int64_t j = 0; j < vocab; j += 16) {
      const __mmask16 m = first_lanes(vocab - j);
      store(z + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, exps + j), scale));
    }
    narrow(z + t, (std::exp(zt - lse) - 1.0) * static_cast<double>(grad_scale));
  }
  return lse - zt;
}
#endif

template <class T>
double dispatch(T* logits, const int64_t* targets, int64_t rows, int64_t vocab, int64_t stride, float grad_scale,
                bool write_grad) {
#if defined(__x86_64__)
  if (simd::has_avx512()) {
    double total = 0;
#pragma omp parallel reduction(+ : total) if (rows > 1)
    {
      std::vector<float> exps(write_grad ? static_cast<size_t>(vocab) : 0);
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; ++r)
        total += avx512_row(logits + r * stride, targets[r], vocab, grad_scale, write_grad, exps.data());
    }
    return total;
  }
#endif
  double total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r)
    total += reference_rows(logits + r * stride, targets + r, 1, vocab, stride, grad_scale, write_grad);
  return total;
}

}  // namespace

double softmax_cross_entropy_f32(float* logits, const int64_t* targets, int64_t rows, int64_t vocab, int64_t row_stride,
                                 float grad_scale, bool write_grad) {
  return dispatch(logits, targets, rows, vocab, row_stride, grad_scale, write_grad);
}
double softmax_cross_entropy_bf16(uint16_t* logits, const int64_t* targets, int64_t rows, int64_t vocab,
                                  int64_t row_stride, float grad_scale, bool write_grad) {
  return dispatch(logits, targets, rows, vocab, row_stride, grad_scale, write_grad);
}
double softmax_cross_entropy_f32_reference(float* logits, const int64_t* targets, int64_t rows, int64_t vocab,
                                           int64_t row_stride, float grad_scale, bool write_grad) {
  return reference_rows(logits, targets, rows, vocab, row_stride, grad_scale, write_grad);
}
double softmax_cross_entropy_bf16_reference(uint16_t* logits, const int64_t* targets, int64_t rows, int64_t vocab,
                                            int64_t row_stride, float grad_scale, bool write_grad) {
  return reference_rows(logits, targets, rows, vocab, row_stride, grad_scale, write_grad);
}

}  // namespace ds::kernels
