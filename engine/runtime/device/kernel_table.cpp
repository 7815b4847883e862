#include "engine/runtime/device/kernel_table.hpp"

#include "kernels/cpu/norm.hpp"

namespace ds {
namespace {

class CpuKernelTable final : public KernelTable {
 public:
  const char* name() const override { return "cpu"; }
  void adam_step_f32(float* w, float* m, float* v, uint16_t* out, const float* g, int64_t n, const kernels::AdamStep& s) const override {
    kernels::adam_step_f32(w, m, v, out, g, n, s);
  }
  void adam_step_bf16(float* w, float* m, float* v, uint16_t* out, const uint16_t* g, int64_t n,
                      const kernels::AdamStep& s) const override {
    kernels::adam_step_bf16(w, m, v, out, g, n, s);
  }
  void sgd_step_f32(float* w, float* buf, uint16_t* out, const float* g, int64_t n, const kernels::SgdStep& s) const override {
    kernels::sgd_step_f32(w, buf, out, g, n, s);
  }
  void sgd_step_bf16(float* w, float* buf, uint16_t* out, const uint16_t* g, int64_t n, const kernels::SgdStep& s) const override {
    kernels::sgd_step_bf16(w, buf, out, g, n, s);
  }
  void lamb_moments_f32(const float* w, float* m, float* v, const float* g, int64_t n, const kernels::LambStep& s, double* w_sq,
                        double* u_sq) const override {
    kernels::lamb_moments_f32(w, m, v, g, n, s, w_sq, u_sq);
  }
  void lamb_moments_bf16(const float* w, float* m, float* v, const uint16_t* g, int64_t n, const kernels::LambStep& s, double* w_sq,
                         double* u_sq) const override {
    kernels::lamb_moments_bf16(w, m, v, g, n, s, w_sq, u_sq);
  }
  void lamb_apply(float* w, const float* m, const float* v, uint16_t* out, int64_t n, const kernels::LambStep& s,
                  float ratio) const override {
    kernels::lamb_apply(w, m, v, out, n, s, ratio);
  }
  void adam_step_fp16(float* w, float* m, float* v, uint16_t* out, const uint16_t* g, int64_t n,
                      const kernels::AdamStep& s) const override {
    kernels::adam_step_fp16(w, m, v, out, g, n, s);
  }
  void sgd_step_fp16(float* w, float* buf, uint16_t* out, const uint16_t* g, int64_t n, const kernels::SgdStep& s) const override {
    kernels::sgd_step_fp16(w, buf, out, g, n, s);
  }
  void lamb_moments_fp16(const float* w, float* m, float* v, const uint16_t* g, int64_t n, const kernels::LambStep& s, double* w_sq,
                         double* u_sq) const override {
    kernels::lamb_moments_fp16(w, m, v, g, n, s, w_sq, u_sq);
  }
  double sum_of_squares_f32(const float* x, int64_t n) const override { return kernels::sum_of_squares_f32(x, n); }
  double sum_of_squares_bf16(const uint16_t* x, int64_t n) const override { return kernels::sum_of_squares_bf16(x, n); }
  double sum_of_squares_fp16(const uint16_t* x, int64_t n) const override { return kernels::sum_of_squares_fp16(x, n); }
};

}  // namespace

const KernelTable& cpu_kernel_table() {
  static const CpuKernelTable table;
  return table;
}

}  // namespace ds
