#include "engine/runtime/run/loss_scaler.hpp"

#include <algorithm>
#include <stdexcept>

#include "common/format.hpp"

namespace ds {

LossScaler::LossScaler(const LossScaling& config) : config_(config) {
  state_.scale = config.enabled ? config.initial_scale : 1.0;
  state_.hysteresis_left = config.hysteresis;
}

bool LossScaler::update(bool overflow, std::string* event) {
  if (!config_.enabled) return overflow;  // bf16/fp32: skip on inf/NaN if asked, never rescale
  if (!config_.dynamic) {
    ++state_.iteration;
    return overflow;
  }
  LossScalerState& s = state_;
  const double factor = 2.0;
  if (overflow) {
    if (config_.hysteresis == 1 || s.hysteresis_left == 1) {
      if (s.scale == config_.min_scale)
        throw std::runtime_error("fp16 overflow at the minimum loss scale " + format_double(s.scale) +
                                 ": the run cannot continue (try bf16, a lower lr, or gradient clipping)");
      const double next = std::max(s.scale / factor, config_.min_scale);
      if (event) *event = "overflow: skipping step; loss scale " + format_double(s.scale) + " -> " + format_double(next);
      s.scale = next;
    } else {
      if (event)
        *event = "overflow: skipping step; loss scale stays " + format_double(s.scale) + ", hysteresis " +
                 std::to_string(s.hysteresis_left) + " -> " + std::to_string(s.hysteresis_left - 1);
      --s.hysteresis_left;
    }
    s.last_overflow_iteration = s.iteration;
  } else {
    if (config_.consecutive_hysteresis) s.hysteresis_left = config_.hysteresis;
    const int64_t stable = s.iteration - s.last_overflow_iteration - 1;
    if (stable > 0 && stable % config_.window == 0) {
      if (!config_.consecutive_hysteresis) s.hysteresis_left = config_.hysteresis;
      if (event) *event = "loss scale " + format_double(s.scale) + " -> " + format_double(s.scale * factor) +
                          " after " + std::to_string(config_.window) + " clean steps";
      s.scale *= factor;
    }
  }
  ++s.iteration;
  return overflow;
}

}  // namespace ds
