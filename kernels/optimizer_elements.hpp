// ds — the optimizers' arithmetic on one element, written once for the CPU's reference loops
// (kernels/cpu) and the GPU's kernels (kernels/cuda): the same operations in the same order, so the two
// devices differ only where their compilers contract multiply-adds. Plain C++ and CUDA device code alike.
#pragma once

#include <cmath>

#include "common/host_device.hpp"
#include "kernels/cpu/adam.hpp"
#include "kernels/cpu/lamb.hpp"
#include "kernels/cpu/sgd.hpp"


namespace ds::kernels {

// The gradient scale a step runs with: its own, or its control's (AdamStep::control); false: the control
// says skip, and the kernel writes nothing.
template <class Step>
DS_HOST_DEVICE bool scale_of(const Step& s, float& scale) {
  scale = s.grad_scale;
  if (!s.control) return true;
  scale = s.control[0];
  return s.control[1] != 0;
}

// Adam/AdamW: the moments m, v and the weight w updated from the (scaled) gradient g. step_size =
// lr / bias_correction1, decay = lr x weight_decay (per step, not per element).
DS_HOST_DEVICE void adam_element(float g, float& w, float& m, float& v, const AdamStep& s, float step_size, float decay) {
  if (!s.decoupled && s.weight_decay != 0) g = g + s.weight_decay * w;
  m = s.beta1 * m + (1 - s.beta1) * g;
  v = s.beta2 * v + (1 - s.beta2) * (g * g);
  const float denom = sqrtf(v) * s.rsqrt_bias_correction2 + s.eps;
  if (s.decoupled && s.weight_decay != 0) w = w - decay * w;
  w = w - step_size * (m / denom);
}

// SGD with optional (Nesterov) momentum: `buf` null without momentum. g is the scaled gradient.
DS_HOST_DEVICE void sgd_element(float g, float& w, float* buf, const SgdStep& s) {
  g = g + s.weight_decay * w;
  if (s.momentum != 0) {
    const float b = s.first_step ? g : s.momentum * *buf + (1 - s.dampening) * g;
    *buf = b;
    g = s.nesterov ? g + s.momentum * b : b;
  }
  w -= s.lr * g;
}

// Lamb: the moments from the scaled gradient g, then the update direction of one element.
DS_HOST_DEVICE void lamb_moments_element(float g, float& m, float& v, const LambStep& s) {
  m = s.beta1 * m + (1 - s.beta1) * g;
  v = s.beta2 * v + (1 - s.beta2) * (g * g);
}
DS_HOST_DEVICE float lamb_update_element(float m, float v, float w, const LambStep& s) {
  const float denom = s.eps_inside_sqrt ? sqrtf(v + s.eps) : sqrtf(v) + s.eps;
  return m / denom + s.weight_decay * w;
}

}  // namespace ds::kernels
