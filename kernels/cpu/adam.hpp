// ds — fused Adam/AdamW step over flat fp32 buffers, with the bf16 working copy written in the
// same pass (one read and one write of each state per step: the step is memory-bound).
//
//   bc1 = 1 - beta1^t,  rbc2 = 1 / sqrt(1 - beta2^t)   (both 1 without bias correction)
//   g  = grad * grad_scale                              (unscale fp16 and clip in one multiply)
//   g += wd * p                                         (L2 mode only: Adam with adam_w_mode false)
//   m  = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
//   p -= lr wd p                                        (decoupled mode: AdamW)
//   p -= (lr / bc1) m / (sqrt(v) rbc2 + eps)
// This is DeepSpeed's CPU Adam update (csrc/adam/cpu_adam_impl.cpp; reference §5.1) and torch's
// AdamW up to rounding. Precision: all math in fp32; the bf16 copy rounds to nearest even (NaN stays
// NaN). Inputs are raw pointers and element counts: no allocation, no I/O, no LibTorch.
#pragma once

#include <cstdint>

namespace ds::kernels {

// The hyperparameters of one step, set by name; at_step fills what follows from the step number.
struct AdamStep {
  float lr = 0, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0;
  bool decoupled = true;        // AdamW (true) or L2-regularised Adam (false)
  bool bias_correction = true;  // divide the moments by (1 - beta^t)
  float grad_scale = 1;         // applied to every gradient first
  // Set: the step's control, read where the kernel runs (a GPU's memory) in place of grad_scale, so a step
  // whose clipping and overflow check were decided there never waits for the host: {grad scale, apply};
  // apply 0 skips the step (nothing is written).
  const float* control = nullptr;
  float bias_correction1 = 1;   // 1 - beta1^t (at_step)
  float rsqrt_bias_correction2 = 1;  // 1 / sqrt(1 - beta2^t) (at_step)

  // This step at step t (1-based): the two bias corrections the way DeepSpeed computes them.
  AdamStep at_step(int64_t t) const;
};

// One step over n elements. `param_bf16` (may be null) receives the updated weights in bf16.
// Gradients are fp32 (adam_step_f32), bf16 (adam_step_bf16) or fp16 (adam_step_fp16, below). Every pointer covers n elements;
// the buffers must not overlap.
void adam_step_f32(float* master, float* exp_avg, float* exp_avg_sq, uint16_t* param_bf16, const float* grad, int64_t n,
                   const AdamStep& s);
void adam_step_bf16(float* master, float* exp_avg, float* exp_avg_sq, uint16_t* param_bf16, const uint16_t* grad,
                    int64_t n, const AdamStep& s);

// The plain scalar versions the fast ones are tested against.
void adam_step_f32_reference(float* master, float* exp_avg, float* exp_avg_sq, uint16_t* param_bf16, const float* grad,
                             int64_t n, const AdamStep& s);
void adam_step_bf16_reference(float* master, float* exp_avg, float* exp_avg_sq, uint16_t* param_bf16,
                              const uint16_t* grad, int64_t n, const AdamStep& s);

// bf16 <-> fp32, round to nearest even.
uint16_t float_to_bf16(float f);
float bf16_to_float(uint16_t b);

// fp16 (IEEE binary16: 5 exponent bits, 10 mantissa bits) <-> fp32: widened exactly (subnormals, infinities,
// NaN payloads), narrowed to nearest even with overflow to infinity (|f| >= 65520) and NaN kept a quiet NaN.
uint16_t float_to_fp16(float f);
float fp16_to_float(uint16_t h);

// Adam with fp16 gradients (a GPU's fp16 run whose gradients the host steps: ZeRO-Offload).
void adam_step_fp16(float* master, float* exp_avg, float* exp_avg_sq, uint16_t* param_bf16, const uint16_t* grad,
                    int64_t n, const AdamStep& s);

// Which implementation runs on this CPU: "avx512" or "scalar".
const char* adam_implementation();

}  // namespace ds::kernels
