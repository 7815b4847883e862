// ds — learning-rate schedules with DeepSpeed's exact formulas (deepspeed/runtime/lr_schedules.py;
// reference §1.3). `t` is DeepSpeed's last_batch_iteration: -1 at construction, 0 after the first
// step() — and step() runs once per *successful* optimizer step (not on fp16-overflow skips).
// Pure arithmetic: the engine asks lr_at(t) and momentum_at(t); the only state is t itself, which is
// what a checkpoint stores (as DeepSpeed's {'last_batch_iteration': t}).
#pragma once

#include <cstdint>
#include <optional>

#include "engine/plan/plan.hpp"

namespace ds {

class LrSchedule {
 public:
  // `base_lr` is the optimizer's lr (the schedule scales it, or replaces it, per DeepSpeed).
  LrSchedule(const ResolvedScheduler& sched, double base_lr, double base_beta1);

  // The lr for the optimizer step that follows `t` steps of the scheduler.
  double lr_at(int64_t t) const;
  // beta1 under OneCycle's momentum cycling; otherwise the optimizer's own.
  double beta1_at(int64_t t) const;
  // OneCycle forces beta2 to 0.99 while cycling momentum (a DeepSpeed quirk kept for parity).
  std::optional<double> beta2_override() const;

 private:
  double warmup_gamma(int64_t t) const;  // 0..1 during warmup, 1 after
  double one_cycle_scale(int64_t t) const;  // OneCycle's position in the cycle, 0..1 (t within the cycle)
  ResolvedScheduler s_;
  double base_lr_, base_beta1_;
  int64_t warmup_steps_ = 0;  // max(2, warmup_num_steps), as DeepSpeed clamps it
};

}  // namespace ds
