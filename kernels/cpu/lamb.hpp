// ds — Lamb step for one parameter tensor, DeepSpeed's FusedLamb semantics (ops/lamb; reference §1.2):
//   g = grad * grad_scale
//   m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
//   u = m / (sqrt(v) + eps) + wd * p            (eps_inside_sqrt: m / sqrt(v + eps))
//   ratio = clamp(||p|| / ||u||, min_coeff, max_coeff), 1 when either norm is 0
//   p -= lr * sqrt(1 - beta2^t) / (1 - beta1^t) * ratio * u     (bias correction folded into the step)
// The trust ratio is per parameter tensor, so the caller steps each tensor (a ParamSlot) separately.
// Two passes: moments and both norms (double accumulation), then the update. All math in fp32.
#pragma once

#include <cstdint>

namespace ds::kernels {

// The hyperparameters of one step, set by name; at_step fills what follows from the step number.
struct LambStep {
  float lr = 0, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0, grad_scale = 1;
  float max_coeff = 10, min_coeff = 0.01f;
  bool eps_inside_sqrt = false;
  bool bias_correction = true;
  float step_size_factor = 1;  // sqrt(1 - beta2^t) / (1 - beta1^t), or 1 without bias correction (at_step)

  LambStep at_step(int64_t t) const;
};

// Returns the trust ratio applied. `param_bf16` may be null.
// A tensor split across ranks (ZeRO) takes the step in two phases around a sum over the ranks:
//   lamb_moments_*   updates this part's moments and adds its ||p||^2 and ||u||^2 to w_sq / u_sq
//   lamb_trust_ratio the clamped ratio from the whole tensor's sums
//   lamb_apply       the update of this part with that ratio
void lamb_moments_f32(const float* master, float* exp_avg, float* exp_avg_sq, const float* grad, int64_t n, const LambStep& s,
                      double* w_sq, double* u_sq);
void lamb_moments_bf16(const float* master, float* exp_avg, float* exp_avg_sq, const uint16_t* grad, int64_t n,
                       const LambStep& s, double* w_sq, double* u_sq);
void lamb_moments_fp16(const float* master, float* exp_avg, float* exp_avg_sq, const uint16_t* grad, int64_t n,
                       const LambStep& s, double* w_sq, double* u_sq);
float lamb_trust_ratio(double w_sq, double u_sq, const LambStep& s);
void lamb_apply(float* master, const float* exp_avg, const float* exp_avg_sq, uint16_t* param_bf16, int64_t n, const LambStep& s,
                float ratio);

float lamb_step_f32(float* master, float* exp_avg, float* exp_avg_sq, uint16_t* param_bf16, const float* grad, int64_t n,
                    const LambStep& s);
float lamb_step_bf16(float* master, float* exp_avg, float* exp_avg_sq, uint16_t* param_bf16, const uint16_t* grad,
                     int64_t n, const LambStep& s);

}  // namespace ds::kernels
