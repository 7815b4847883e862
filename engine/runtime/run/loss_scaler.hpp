// ds — fp16 loss scaling with DeepSpeed's DynamicLossScaler semantics (deepspeed/runtime/fp16/
// loss_scaler.py; reference §2), used by every ZeRO stage. Backward uses loss * scale(); before the
// step, gradients are divided by scale(). update() runs once per optimizer step with whether any
// gradient was inf/NaN; on overflow the caller skips the step (and the lr schedule does not advance).
#pragma once

#include <cstdint>
#include <string>

#include "engine/plan/plan.hpp"

namespace ds {

struct LossScalerState {  // everything a checkpoint needs to continue exactly
  double scale = 1;
  int64_t iteration = 0;          // cur_iter
  int64_t last_overflow_iteration = -1;
  int hysteresis_left = 0;        // cur_hysteresis
};

class LossScaler {
 public:
  explicit LossScaler(const LossScaling& config);

  double scale() const { return state_.scale; }
  bool enabled() const { return config_.enabled; }

  // Records one optimizer step. Returns true when the step must be skipped (overflow). Throws
  // std::runtime_error when an overflow happens at the minimum scale (DeepSpeed ends the run there).
  // `event` (may be null) receives a line for the log when the scale or hysteresis changes.
  bool update(bool overflow, std::string* event = nullptr);

  const LossScalerState& state() const { return state_; }
  void restore(const LossScalerState& s) { state_ = s; }

 private:
  LossScaling config_;
  LossScalerState state_;
};

}  // namespace ds
