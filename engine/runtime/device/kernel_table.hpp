// ds — the flat-buffer kernels of one device, reached through a table chosen once: the optimizers, the
// norms and the sums run on whatever memory the device holds, never on a host pointer assumed. A device
// hands out a table per place (engine/runtime/device/device.hpp): its own kernels for its memory, the host's for
// states an optimizer offloads there. kernels/cpu/ fills the CPU table; kernels/cuda/ will fill a second with
// the same raw-pointer signatures. No LibTorch here.
#pragma once

#include <cstdint>

#include "kernels/cpu/adam.hpp"
#include "kernels/cpu/lamb.hpp"
#include "kernels/cpu/sgd.hpp"

namespace ds {

class KernelTable {
 public:
  virtual ~KernelTable() = default;
  virtual const char* name() const = 0;

  // The optimizers over a run of n elements (kernels/cpu/adam.hpp, sgd.hpp, lamb.hpp for what each does);
  // `param_bf16` null: no 16-bit copy of the weights to refresh.
  virtual void adam_step_f32(float* master, float* exp_avg, float* exp_avg_sq, uint16_t* param_bf16, const float* grad, int64_t n,
                             const kernels::AdamStep& s) const = 0;
  virtual void adam_step_bf16(float* master, float* exp_avg, float* exp_avg_sq, uint16_t* param_bf16, const uint16_t* grad,
                              int64_t n, const kernels::AdamStep& s) const = 0;
  virtual void sgd_step_f32(float* master, float* momentum_buf, uint16_t* param_bf16, const float* grad, int64_t n,
                            const kernels::SgdStep& s) const = 0;
  virtual void sgd_step_bf16(float* master, float* momentum_buf, uint16_t* param_bf16, const uint16_t* grad, int64_t n,
                             const kernels::SgdStep& s) const = 0;
  virtual void lamb_moments_f32(const float* master, float* exp_avg, float* exp_avg_sq, const float* grad, int64_t n,
                                const kernels::LambStep& s, double* w_sq, double* u_sq) const = 0;
  virtual void lamb_moments_bf16(const float* master, float* exp_avg, float* exp_avg_sq, const uint16_t* grad, int64_t n,
                                 const kernels::LambStep& s, double* w_sq, double* u_sq) const = 0;
  virtual void lamb_apply(float* master, const float* exp_avg, const float* exp_avg_sq, uint16_t* param_bf16, int64_t n,
                          const kernels::LambStep& s, float ratio) const = 0;

  // Sum of squares in double (the gradient norm; a finite check of the weights).
  virtual double sum_of_squares_f32(const float* x, int64_t n) const = 0;
  virtual double sum_of_squares_bf16(const uint16_t* x, int64_t n) const = 0;
};

// The CPU's table: kernels/cpu, AVX-512 where the machine has it.
const KernelTable& cpu_kernel_table();

}  // namespace ds
