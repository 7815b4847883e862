#include "engine/runtime/run/optimizer.hpp"

#include <algorithm>

#include "common/error.hpp"

namespace ds {

FlatOptimizer::FlatOptimizer(const ResolvedOptimizer& o, const FlatLayout& layout, int rank)
    : o_(o), runs_(optimizer_runs(layout, rank, o.per_tensor_update())), num_params_(layout.params.size()) {}

void FlatOptimizer::lamb_step(const OptimizerBuffers& b, const OptimizerStepInputs& in, const SumOverRanks& sum_over_ranks) const {
  DS_CHECK(!in.control, "Lamb's trust ratios are the host's: its step takes no control from the device");
  const auto f = [](double x) { return static_cast<float>(x); };
  auto step_for = [&](const StepRun& s) {
    kernels::LambStep k;
    k.lr = f(in.lr);
    k.beta1 = f(in.beta1);
    k.beta2 = f(in.beta2);
    k.eps = f(o_.eps);
    k.weight_decay = f(s.decay ? o_.weight_decay : 0.0);
    k.grad_scale = f(in.grad_scale);
    k.max_coeff = f(o_.max_coeff);
    k.min_coeff = f(o_.min_coeff);
    k.eps_inside_sqrt = o_.eps_inside_sqrt;
    k.bias_correction = o_.bias_correction;
    return k.at_step(in.step);
  };
  // Moments and this rank's share of every tensor's ||w||^2 and ||u||^2, then the whole tensors' sums.
  std::vector<double> sums(2 * num_params_, 0.0);
  for (const StepRun& s : runs_) {
    const int64_t n = s.end - s.begin;
    double* w_sq = &sums[2 * static_cast<size_t>(s.param)];
    b.kernels->lamb_moments(b.master + s.begin, b.moment1 + s.begin, b.moment2 + s.begin,
                            element_at(b.grads, b.grad_elements, s.begin), b.grad_elements, n, step_for(s), w_sq, w_sq + 1);
  }
  if (sum_over_ranks) sum_over_ranks(sums.data(), sums.size());
  for (const StepRun& s : runs_) {
    const auto k = step_for(s);
    const float ratio = kernels::lamb_trust_ratio(sums[2 * static_cast<size_t>(s.param)], sums[2 * static_cast<size_t>(s.param) + 1], k);
    b.kernels->lamb_apply(b.master + s.begin, b.moment1 + s.begin, b.moment2 + s.begin,
                        b.params_bf16 ? b.params_bf16 + s.begin : nullptr, s.end - s.begin, k, ratio);
  }
}

void FlatOptimizer::step(const OptimizerBuffers& b, const OptimizerStepInputs& in, const SumOverRanks& sum_over_ranks) const {
  if (o_.per_tensor_update()) {
    lamb_step(b, in, sum_over_ranks);
    return;
  }
  step_window(b, in, 0, runs_.empty() ? 0 : runs_.back().end);
}

void FlatOptimizer::step_window(const OptimizerBuffers& b, const OptimizerStepInputs& in, int64_t begin, int64_t end) const {
  DS_CHECK(!o_.per_tensor_update(), "Lamb steps whole tensors");
  const auto f = [](double x) { return static_cast<float>(x); };
  // Element `at` of the local buffers, in the window's buffers.
  const auto grad = [&](int64_t at) { return element_at(b.grads, b.grad_elements, at - begin); };
  const auto out = [&](int64_t at) { return b.params_bf16 ? b.params_bf16 + (at - begin) : nullptr; };
  for (const StepRun& run : runs_) {
    const int64_t lo = std::max(run.begin, begin), hi = std::min(run.end, end);
    if (lo >= hi) continue;
    const int64_t n = hi - lo, at = lo - begin;
    const double wd = run.decay ? o_.weight_decay : 0.0;
    float* w = b.master + at;
    switch (o_.type) {
      case OptimizerType::Adam:
      case OptimizerType::AdamW: {
        kernels::AdamStep a;
        a.lr = f(in.lr);
        a.beta1 = f(in.beta1);
        a.beta2 = f(in.beta2);
        a.eps = f(o_.eps);
        a.weight_decay = f(wd);
        a.decoupled = o_.decoupled_weight_decay;
        a.bias_correction = o_.bias_correction;
        a.grad_scale = f(in.grad_scale);
        a.control = in.control;
        const auto k = a.at_step(in.step);
        b.kernels->adam_step(w, b.moment1 + at, b.moment2 + at, out(lo), grad(lo), b.grad_elements, n, k);
        break;
      }
      case OptimizerType::Lamb: break;  // lamb_step
      case OptimizerType::SGD: {
        kernels::SgdStep k;
        k.lr = f(in.lr);
        k.momentum = f(o_.momentum);
        k.dampening = f(o_.dampening);
        k.weight_decay = f(wd);
        k.grad_scale = f(in.grad_scale);
        k.control = in.control;
        k.nesterov = o_.nesterov;
        k.first_step = in.step == 1;
        float* buf = o_.momentum > 0 ? b.moment1 + at : nullptr;
        b.kernels->sgd_step(w, buf, out(lo), grad(lo), b.grad_elements, n, k);
        break;
      }
    }
  }
}

}  // namespace ds
