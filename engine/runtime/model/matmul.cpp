#include "engine/runtime/model/matmul.hpp"

#include <algorithm>
#include <cstdint>

#include "common/cpu_features.hpp"
#include "common/error.hpp"
#include "engine/runtime/device/kernel_route.hpp"

#ifdef DS_WITH_ONEDNN_SGEMM
// oneDNN's C API (dnnl.h), declared here: Debian's runtime package has the library but not the header.
// Row-major: C = alpha op(A) op(B) + beta C. Returns dnnl_status_t, 0 on success.
extern "C" int dnnl_sgemm(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                          const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
#endif

namespace ds {
namespace {

// How sgemm reads a 2-D tensor: 'N' with its row stride, 'T' with its column stride, or not at all.
struct Operand {
  char trans = 0;
  int64_t ld = 0;
};

Operand operand(const torch::Tensor& t) {
  const int64_t rows = t.size(0), cols = t.size(1);
  if (t.stride(1) == 1 && t.stride(0) >= std::max<int64_t>(cols, 1)) return {'N', t.stride(0)};
  if (t.stride(0) == 1 && t.stride(1) >= std::max<int64_t>(rows, 1)) return {'T', t.stride(1)};
  return {};
}

#ifdef DS_WITH_ONEDNN_SGEMM
bool onednn_sgemm(const torch::Tensor& c, const torch::Tensor& a, const torch::Tensor& b, bool accumulate) {
  if (a.scalar_type() != torch::kFloat || b.scalar_type() != torch::kFloat || c.scalar_type() != torch::kFloat) return false;
  if (!on_host(a) || a.numel() == 0 || b.numel() == 0) return false;
  const Operand oa = operand(a), ob = operand(b), oc = operand(c);
  if (!oa.trans || !ob.trans || oc.trans != 'N') return false;
  const int status = dnnl_sgemm(oa.trans, ob.trans, a.size(0), b.size(1), a.size(1), 1.0f, a.data_ptr<float>(), oa.ld,
                                b.data_ptr<float>(), ob.ld, accumulate ? 1.0f : 0.0f, c.data_ptr<float>(), oc.ld);
  DS_CHECK(status == 0, "oneDNN's sgemm failed (status ", status, ") on ", a.sizes(), " x ", b.sizes());
  return true;
}
#endif

// LibTorch 1.13 multiplies bf16 on the host through oneDNN only where the CPU has AVX-512 (its bf16 check); elsewhere
// (an AVX2 machine) its fallback loops accumulate in bf16, an error growing with the inner dimension (measured on a
// Zen 3: 3x the tolerance a once-rounded product meets at k = 200). There the product is taken in fp32 and rounded
// once, as oneDNN's bf16 product does: c = round(c + a b) accumulating, round(a b) not.
// (The plan counts the fp32 copies such a product holds: Topology::cpu_widens_bf16_products.)
bool libtorch_multiplies_bf16_by_onednn() { return cpu_has_avx512(); }

bool widened_bf16(const torch::Tensor& c, const torch::Tensor& a, const torch::Tensor& b, bool accumulate) {
  if (c.scalar_type() != torch::kBFloat16 || a.scalar_type() != torch::kBFloat16 || b.scalar_type() != torch::kBFloat16) return false;
  if (!on_host(c) || libtorch_multiplies_bf16_by_onednn()) return false;
  const torch::Tensor wide = accumulate ? c.to(torch::kFloat32) : torch::empty({c.size(0), c.size(1)}, c.options().dtype(torch::kFloat32));
  matmul_into(wide, a.to(torch::kFloat32), b.to(torch::kFloat32), accumulate);
  c.copy_(wide);  // round to nearest even
  return true;
}

}  // namespace

void matmul_into(const torch::Tensor& c, const torch::Tensor& a, const torch::Tensor& b, bool accumulate) {
  DS_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2 && a.size(1) == b.size(0) && c.size(0) == a.size(0) && c.size(1) == b.size(1),
           "matmul: shapes ", a.sizes(), " x ", b.sizes(), " into ", c.sizes());
#ifdef DS_WITH_ONEDNN_SGEMM
  if (onednn_sgemm(c, a, b, accumulate)) return;
#endif
  if (widened_bf16(c, a, b, accumulate)) return;
  torch::Tensor out = c;
  if (accumulate)
    out.addmm_(a, b);
  else
    at::mm_out(out, a, b);
}

torch::Tensor matmul_new(const torch::Tensor& a, const torch::Tensor& b) {
  torch::Tensor c = torch::empty({a.size(0), b.size(1)}, a.options());
  matmul_into(c, a, b, false);
  return c;
}

}  // namespace ds
