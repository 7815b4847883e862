#include "kernels/cpu/lamb.hpp"

#include "kernels/optimizer_elements.hpp"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/adam.hpp"  // bf16 and fp16 conversions

namespace ds::kernels {

LambStep LambStep::at_step(int64_t t) const {
  LambStep s = *this;
  s.step_size_factor = 1;
  if (bias_correction) {
    const double b1t = std::pow(static_cast<double>(beta1), static_cast<double>(t));
    const double b2t = std::pow(static_cast<double>(beta2), static_cast<double>(t));
    s.step_size_factor = static_cast<float>(std::sqrt(1.0 - b2t) / (1.0 - b1t));
  }
  return s;
}

namespace {


template <class LoadGrad>
void lamb_moments(const float* p, float* m, float* v, int64_t n, const LambStep& s, LoadGrad grad, double* w_sq_out,
                  double* u_sq_out) {
  double w_sq = 0, u_sq = 0;
#pragma omp parallel for schedule(static) reduction(+ : w_sq, u_sq) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    lamb_moments_element(grad(i) * s.grad_scale, m[i], v[i], s);
    const float u = lamb_update_element(m[i], v[i], p[i], s);
    w_sq += static_cast<double>(p[i]) * p[i];
    u_sq += static_cast<double>(u) * u;
  }
  *w_sq_out += w_sq;
  *u_sq_out += u_sq;
}

}  // namespace

void lamb_moments_f32(const float* p, float* m, float* v, const float* g, int64_t n, const LambStep& s, double* w_sq,
                      double* u_sq) {
  lamb_moments(p, m, v, n, s, [g](int64_t i) { return g[i]; }, w_sq, u_sq);
}

void lamb_moments_bf16(const float* p, float* m, float* v, const uint16_t* g, int64_t n, const LambStep& s, double* w_sq,
                       double* u_sq) {
  lamb_moments(p, m, v, n, s, [g](int64_t i) { return bf16_to_float(g[i]); }, w_sq, u_sq);
}

void lamb_moments_fp16(const float* p, float* m, float* v, const uint16_t* g, int64_t n, const LambStep& s, double* w_sq,
                       double* u_sq) {
  lamb_moments(p, m, v, n, s, [g](int64_t i) { return fp16_to_float(g[i]); }, w_sq, u_sq);
}

float lamb_trust_ratio(double w_sq, double u_sq, const LambStep& s) {
  if (w_sq > 0 && u_sq > 0) return std::clamp(static_cast<float>(std::sqrt(w_sq / u_sq)), s.min_coeff, s.max_coeff);
  return 1;
}

void lamb_apply(float* p, const float* m, const float* v, uint16_t* out, int64_t n, const LambStep& s, float ratio) {
  const float step = s.lr * s.step_size_factor * ratio;
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    p[i] -= step * lamb_update_element(m[i], v[i], p[i], s);
    if (out) out[i] = float_to_bf16(p[i]);
  }
}

namespace {
// One whole tensor on one rank: both phases with nothing to sum in between.
template <class Moments>
float whole_tensor_step(float* p, float* m, float* v, uint16_t* out, int64_t n, const LambStep& s, Moments moments) {
  double w_sq = 0, u_sq = 0;
  moments(&w_sq, &u_sq);
  const float ratio = lamb_trust_ratio(w_sq, u_sq, s);
  lamb_apply(p, m, v, out, n, s, ratio);
  return ratio;
}
}  // namespace

float lamb_step_f32(float* p, float* m, float* v, uint16_t* out, const float* g, int64_t n, const LambStep& s) {
  return whole_tensor_step(p, m, v, out, n, s, [&](double* w, double* u) { lamb_moments_f32(p, m, v, g, n, s, w, u); });
}

float lamb_step_bf16(float* p, float* m, float* v, uint16_t* out, const uint16_t* g, int64_t n, const LambStep& s) {
  return whole_tensor_step(p, m, v, out, n, s, [&](double* w, double* u) { lamb_moments_bf16(p, m, v, g, n, s, w, u); });
}

}  // namespace ds::kernels
