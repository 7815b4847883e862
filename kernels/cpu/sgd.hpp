// ds — SGD step over flat fp32 buffers, torch.optim.SGD's semantics (DeepSpeed hands type "SGD" to
// torch): weight decay is L2 (added to the gradient), the momentum buffer starts as the first
// gradient, and
//   g = grad * grad_scale + wd * p
//   buf = momentum * buf + (1 - dampening) * g          (buf = g on the first step)
//   g = nesterov ? g + momentum * buf : buf              (when momentum > 0)
//   p -= lr * g
// All math in fp32; `param_bf16` (may be null) receives the updated weights rounded to bf16.
#pragma once

#include <cstdint>

namespace ds::kernels {

struct SgdStep {
  float lr = 0, momentum = 0, dampening = 0, weight_decay = 0, grad_scale = 1;
  bool nesterov = false;
  bool first_step = false;  // the momentum buffer is initialised from this step's gradient
  const float* control = nullptr;  // set: {grad scale, apply} in place of grad_scale, as AdamStep::control
};

// `momentum_buf` may be null when momentum is 0. Gradients are fp32, bf16 or fp16.
void sgd_step_f32(float* master, float* momentum_buf, uint16_t* param_bf16, const float* grad, int64_t n, const SgdStep& s);
void sgd_step_bf16(float* master, float* momentum_buf, uint16_t* param_bf16, const uint16_t* grad, int64_t n,
                   const SgdStep& s);
void sgd_step_fp16(float* master, float* momentum_buf, uint16_t* param_bf16, const uint16_t* grad, int64_t n,
                   const SgdStep& s);

}  // namespace ds::kernels
