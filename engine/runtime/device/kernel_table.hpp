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

// How the gradients an optimizer reads (or a buffer whose squares are summed) store their elements.
enum class GradElements { f32, bf16, fp16 };

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
  // fp16 gradients (a GPU's fp16 run): the same steps, each element widened exactly first.
  virtual void adam_step_fp16(float* master, float* exp_avg, float* exp_avg_sq, uint16_t* param_bf16, const uint16_t* grad,
                              int64_t n, const kernels::AdamStep& s) const = 0;
  virtual void sgd_step_fp16(float* master, float* momentum_buf, uint16_t* param_bf16, const uint16_t* grad, int64_t n,
                             const kernels::SgdStep& s) const = 0;
  virtual void lamb_moments_fp16(const float* master, float* exp_avg, float* exp_avg_sq, const uint16_t* grad, int64_t n,
                                 const kernels::LambStep& s, double* w_sq, double* u_sq) const = 0;

  // Sum of squares in double (the gradient norm; a finite check of the weights).
  virtual double sum_of_squares_f32(const float* x, int64_t n) const = 0;
  virtual double sum_of_squares_bf16(const uint16_t* x, int64_t n) const = 0;
  virtual double sum_of_squares_fp16(const uint16_t* x, int64_t n) const = 0;

  // The kernel for gradients stored as `e`, `grad` pointing at their first element.
  void adam_step(float* master, float* exp_avg, float* exp_avg_sq, uint16_t* param_bf16, const void* grad, GradElements e,
                 int64_t n, const kernels::AdamStep& s) const;
  void sgd_step(float* master, float* momentum_buf, uint16_t* param_bf16, const void* grad, GradElements e, int64_t n,
                const kernels::SgdStep& s) const;
  void lamb_moments(const float* master, float* exp_avg, float* exp_avg_sq, const void* grad, GradElements e, int64_t n,
                    const kernels::LambStep& s, double* w_sq, double* u_sq) const;
  double sum_of_squares(const void* x, GradElements e, int64_t n) const;
  // The same sum written to *out, in this table's memory, without the host waiting for it: a GPU's is queued on
  // its stream (the step's gradient norm stays on the device until the step's end). The host's: computed now.
  virtual void sum_of_squares_to(const void* x, GradElements e, int64_t n, double* out) const { *out = sum_of_squares(x, e, n); }
};

// Element `at` of a buffer stored as `e`.
inline const void* element_at(const void* data, GradElements e, int64_t at) {
  return static_cast<const char*>(data) + at * (e == GradElements::f32 ? 4 : 2);
}

// The dispatch by element kind, inline so that every table's users have it (ds_cuda_tests links no runtime).
inline void KernelTable::adam_step(float* w, float* m, float* v, uint16_t* out, const void* g, GradElements e, int64_t n,
                                   const kernels::AdamStep& s) const {
  const auto* h = static_cast<const uint16_t*>(g);
  switch (e) {
    case GradElements::f32: return adam_step_f32(w, m, v, out, static_cast<const float*>(g), n, s);
    case GradElements::bf16: return adam_step_bf16(w, m, v, out, h, n, s);
    case GradElements::fp16: return adam_step_fp16(w, m, v, out, h, n, s);
  }
}

inline void KernelTable::sgd_step(float* w, float* buf, uint16_t* out, const void* g, GradElements e, int64_t n,
                                  const kernels::SgdStep& s) const {
  const auto* h = static_cast<const uint16_t*>(g);
  switch (e) {
    case GradElements::f32: return sgd_step_f32(w, buf, out, static_cast<const float*>(g), n, s);
    case GradElements::bf16: return sgd_step_bf16(w, buf, out, h, n, s);
    case GradElements::fp16: return sgd_step_fp16(w, buf, out, h, n, s);
  }
}

inline void KernelTable::lamb_moments(const float* w, float* m, float* v, const void* g, GradElements e, int64_t n,
                                      const kernels::LambStep& s, double* w_sq, double* u_sq) const {
  const auto* h = static_cast<const uint16_t*>(g);
  switch (e) {
    case GradElements::f32: return lamb_moments_f32(w, m, v, static_cast<const float*>(g), n, s, w_sq, u_sq);
    case GradElements::bf16: return lamb_moments_bf16(w, m, v, h, n, s, w_sq, u_sq);
    case GradElements::fp16: return lamb_moments_fp16(w, m, v, h, n, s, w_sq, u_sq);
  }
}

inline double KernelTable::sum_of_squares(const void* x, GradElements e, int64_t n) const {
  const auto* h = static_cast<const uint16_t*>(x);
  switch (e) {
    case GradElements::f32: return sum_of_squares_f32(static_cast<const float*>(x), n);
    case GradElements::bf16: return sum_of_squares_bf16(h, n);
    case GradElements::fp16: return sum_of_squares_fp16(h, n);
  }
  return 0;
}

// The CPU's table: kernels/cpu, AVX-512 where the machine has it.
const KernelTable& cpu_kernel_table();

}  // namespace ds
