#include "kernels/cpu/sgd.hpp"

#include "kernels/optimizer_elements.hpp"

#include "kernels/cpu/adam.hpp"  // bf16 and fp16 conversions

namespace ds::kernels {
namespace {

// A plain loop the compiler vectorises; SGD is one read-modify-write pass and rarely the bottleneck.
template <class LoadGrad>
void sgd_range(float* p, float* buf, uint16_t* out, int64_t n, const SgdStep& given, LoadGrad grad) {
  SgdStep s = given;
  if (!scale_of(given, s.grad_scale)) return;  // (the control says skip)
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    sgd_element(grad(i) * s.grad_scale, p[i], s.momentum != 0 ? buf + i : nullptr, s);
    if (out) out[i] = float_to_bf16(p[i]);
  }
}

}  // namespace

void sgd_step_f32(float* p, float* buf, uint16_t* out, const float* g, int64_t n, const SgdStep& s) {
  sgd_range(p, buf, out, n, s, [g](int64_t i) { return g[i]; });
}

void sgd_step_bf16(float* p, float* buf, uint16_t* out, const uint16_t* g, int64_t n, const SgdStep& s) {
  sgd_range(p, buf, out, n, s, [g](int64_t i) { return bf16_to_float(g[i]); });
}

void sgd_step_fp16(float* p, float* buf, uint16_t* out, const uint16_t* g, int64_t n, const SgdStep& s) {
  sgd_range(p, buf, out, n, s, [g](int64_t i) { return fp16_to_float(g[i]); });
}

}  // namespace ds::kernels
