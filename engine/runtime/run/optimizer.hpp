// ds — the optimizer step over the flat buffers, for every optimizer the plan can name (Adam, AdamW,
// SGD, Lamb). It owns no memory: the caller hands it this rank's fp32 master weights, the moment buffers
// the plan counts (plan.optimizer.moments: 2 for Adam/Lamb, 1 for SGD with momentum, 0 without),
// the gradients (fp32, bf16 or fp16) and, under bf16, the working copy to refresh in the same pass.
// No LibTorch here: raw pointers and the plan's layout.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "engine/plan/optimizer_groups.hpp"
#include "engine/plan/plan.hpp"
#include "engine/runtime/device/kernel_table.hpp"

namespace ds {

struct OptimizerBuffers {
  float* master = nullptr;         // fp32 weights the optimizer updates
  float* moment1 = nullptr;        // Adam/Lamb exp_avg, SGD momentum buffer (null when the plan has none)
  float* moment2 = nullptr;        // Adam/Lamb exp_avg_sq (null when the plan has none)
  uint16_t* params_bf16 = nullptr; // bf16 working copy to refresh, or null (fp32 runs alias master)
  const void* grads = nullptr;     // stored as grad_elements
  GradElements grad_elements = GradElements::f32;
  // The kernels that reach these buffers: the device's table for its memory, the host's for offloaded states.
  const KernelTable* kernels = &cpu_kernel_table();
};

// Per-step inputs that come from the schedule and the gradient checks.
struct OptimizerStepInputs {
  double lr = 0, beta1 = 0.9, beta2 = 0.999;
  double grad_scale = 1;  // 1 / (loss scale) x clipping coefficient
  int64_t step = 1;       // 1-based count of applied steps, this one included (bias correction)
  // Set: {grad scale, apply} in the states' memory, decided there (kernels::AdamStep::control), in place of
  // grad_scale; apply 0 and the step writes nothing. Adam and SGD only.
  const float* control = nullptr;
};

// Sums `n` doubles element-wise over the ranks, in place (Lamb's per-tensor norms under ZeRO).
using SumOverRanks = std::function<void(double* values, size_t n)>;

class FlatOptimizer {
 public:
  // Steps the parts of the parameters rank `rank` owns (all of them at stage 0 or on one rank); the
  // buffers handed to step() are that rank's local buffers (owned_segments' `local` offsets).
  FlatOptimizer(const ResolvedOptimizer& o, const FlatLayout& layout, int rank);
  // `sum_over_ranks`: needed only when tensors are split across ranks and the optimizer is Lamb, whose
  // trust ratio needs each whole tensor's ||w|| and ||u||: one sum of 2 x (tensors) doubles per step.
  void step(const OptimizerBuffers& b, const OptimizerStepInputs& in, const SumOverRanks& sum_over_ranks = nullptr) const;
  // Steps local elements [begin, end) only, with `b` pointing at element `begin` of each buffer (an NVMe
  // sub-group in its swap buffers). Element-wise optimizers only (not Lamb). Stepping a buffer window by
  // window, on the runs' grain (optimizer_sub_groups), gives the bits step() gives.
  void step_window(const OptimizerBuffers& b, const OptimizerStepInputs& in, int64_t begin, int64_t end) const;
  const std::vector<StepRun>& runs() const { return runs_; }

 private:
  void lamb_step(const OptimizerBuffers& b, const OptimizerStepInputs& in, const SumOverRanks& sum_over_ranks) const;
  ResolvedOptimizer o_;
  std::vector<StepRun> runs_;  // one kernel call each
  size_t num_params_ = 0;
};

}  // namespace ds
