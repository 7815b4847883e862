#include "engine/runtime/flat_params.hpp"

#include "common/error.hpp"
#include "common/strings.hpp"

namespace ds {

namespace {
torch::ScalarType to_torch(Dtype d) {
  switch (d) {
    case Dtype::fp32: return torch::kFloat32;
    case Dtype::bf16: return torch::kBFloat16;
    case Dtype::fp16: return torch::kFloat16;
  }
  return torch::kFloat32;
}
}  // namespace

FlatParams FlatParams::allocate(const Plan& plan) {
  const FlatLayout& L = plan.layout;
  const int64_t n = L.numel;
  FlatParams f;
  const PrecisionPolicy& pp = plan.precision;
  f.params = torch::zeros({n}, to_torch(pp.param_dtype));
  f.grads = torch::zeros({n}, to_torch(pp.grad_dtype));
  const bool widened = pp.compute_dtype != pp.param_dtype;  // fp16 on the CPU
  f.compute = widened ? torch::zeros({n}, to_torch(pp.compute_dtype)) : f.params;
  f.compute_grads = widened ? torch::zeros({n}, to_torch(pp.compute_dtype)) : f.grads;
  f.master = pp.fp32_master ? torch::zeros({n}, torch::kFloat32) : f.params;
  if (plan.optimizer.moments >= 1) f.exp_avg = torch::zeros({n}, torch::kFloat32);
  if (plan.optimizer.moments >= 2) f.exp_avg_sq = torch::zeros({n}, torch::kFloat32);
  for (const ParamSlot& p : L.params) {
    torch::Tensor v = f.compute.narrow(0, p.offset, p.numel).view(p.shape).detach().requires_grad_(true);
    v.mutable_grad() = f.compute_grads.narrow(0, p.offset, p.numel).view(p.shape);
    f.views.push_back(v);
    f.names.push_back(p.name);
  }
  return f;
}

const torch::Tensor& ParamCursor::next(const std::string& suffix) {
  DS_CHECK(i_ < p_.views.size() && ends_with(p_.names[i_], suffix), "parameter ", i_, " is ",
           (i_ < p_.names.size() ? p_.names[i_] : "missing"), ", expected *", suffix);
  return p_.views[i_++];
}

size_t FlatParams::bytes() const {
  size_t b = params.nbytes() + grads.nbytes();
  for (const torch::Tensor& t : {exp_avg, exp_avg_sq})
    if (t.defined()) b += t.nbytes();
  if (widened()) b += compute.nbytes() + compute_grads.nbytes();
  if (master.data_ptr() != params.data_ptr()) b += master.nbytes();
  return b;
}

}  // namespace ds
