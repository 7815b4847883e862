// ds — the model's parameters as one flat buffer per role, laid out as the Plan says (state_dict
// order, the FlatLayout's offsets). The runtime allocates each buffer once; every parameter tensor
// and its .grad are views into them, so autograd accumulates gradients straight into the flat
// gradient buffer and the fused optimizer steps the whole model in one pass.
//   params  (P) compute dtype: what forward reads
//   grads   (P) gradient dtype: what backward accumulates into (views pre-assigned as .grad)
//   master  (P) fp32: the optimizer's copy under bf16 (aliases params in fp32 runs)
//   exp_avg, exp_avg_sq (P) fp32: Adam's moments
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "engine/plan/plan.hpp"

namespace ds {

struct FlatParams {
  torch::Tensor params, grads, master, exp_avg, exp_avg_sq;
  std::vector<torch::Tensor> views;  // one per ParamSlot, requires_grad, .grad set to a view of grads
  std::vector<std::string> names;

  // Allocates every buffer once, for the plan's layout and precision.
  static FlatParams allocate(const Plan& plan);
  const torch::Tensor& operator[](size_t i) const { return views[i]; }
  int64_t numel() const { return params.numel(); }
  size_t bytes() const;  // everything allocated here
};

// Hands the parameter views to a model in layout order, checking each name ends as the model expects
// (a mismatch is a bug: the model and ModelSpec disagree on the state_dict order).
class ParamCursor {
 public:
  explicit ParamCursor(const FlatParams& params) : p_(params) {}
  const torch::Tensor& next(const std::string& suffix);
  bool done() const { return i_ == p_.views.size(); }

 private:
  const FlatParams& p_;
  size_t i_ = 0;
};

}  // namespace ds
