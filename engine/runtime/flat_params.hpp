// ds — the model's parameters as one flat buffer per role, laid out as the Plan says (state_dict
// order, the FlatLayout's offsets). The runtime allocates each buffer once; every parameter tensor
// and its .grad are views into them, so autograd accumulates gradients straight into the flat
// gradient buffer and the fused optimizer steps the whole model in one pass.
//   params  (P) parameter dtype: the weights as stored (fp32, bf16 or fp16)
//   grads   (P) gradient dtype: the gradients as stored and checked for overflow
//   compute, compute_grads (P) compute dtype: what forward reads and backward accumulates into (the
//           views and their .grad). They alias params/grads except for fp16 on the CPU, where LibTorch
//           has no fp16 kernels: there the model computes in an fp32 copy of the fp16 weights, and its
//           gradients are rounded into the fp16 `grads` each step, so overflow is real.
//   master  (P) fp32: the optimizer's copy under mixed precision (aliases params in fp32 runs)
//   exp_avg, exp_avg_sq (P) fp32: the optimizer's moments, as many as the plan counts (Adam and Lamb 2,
//                       SGD with momentum 1: its buffer in exp_avg); undefined tensors otherwise
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "engine/plan/plan.hpp"

namespace ds {

struct FlatParams {
  torch::Tensor params, grads, compute, compute_grads, master, exp_avg, exp_avg_sq;
  std::vector<torch::Tensor> views;  // one per ParamSlot, requires_grad, .grad set to a view of grads
  std::vector<std::string> names;

  // Allocates every buffer once, for the plan's layout and precision.
  static FlatParams allocate(const Plan& plan);
  const torch::Tensor& operator[](size_t i) const { return views[i]; }
  int64_t numel() const { return params.numel(); }
  // True when the model computes in a wider copy of the stored weights (CPU fp16).
  bool widened() const { return compute.data_ptr() != params.data_ptr(); }
  static float* data_or_null(const torch::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }
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
