#include "engine/runtime/run/lr_schedule.hpp"

#include <algorithm>
#include <cmath>

namespace ds {

LrSchedule::LrSchedule(const ResolvedScheduler& sched, double base_lr, double base_beta1)
    : s_(sched), base_lr_(base_lr), base_beta1_(base_beta1) {
  if (s_.params.warmup_num_steps) warmup_steps_ = std::max<int64_t>(2, *s_.params.warmup_num_steps);
}

double LrSchedule::warmup_gamma(int64_t t) const {
  // gamma(t) = ln(t+1)/ln(W) ('log') or t/W ('linear') for t < W; 1 for t >= W. At t = -1 (before the
  // first step) DeepSpeed sets the lr to the warmup minimum: gamma 0.
  const int64_t W = warmup_steps_;
  if (t < 0) return 0.0;
  if (t >= W) return 1.0;
  if (s_.params.warmup_type == "linear") return static_cast<double>(t) / W;
  return std::log(static_cast<double>(t + 1)) / std::log(static_cast<double>(W));
}

double LrSchedule::one_cycle_scale(int64_t t) const {
  // b = t + 1; x = 1 + b/total - floor(1 + b/total); rising while x <= S1/total, then falling.
  const SchedulerConfig& p = s_.params;
  const double S1 = static_cast<double>(p.cycle_first_step_size);
  const double S2 = static_cast<double>(p.cycle_second_step_size.value_or(p.cycle_first_step_size));
  const double total = S1 + S2, b = t + 1, ratio = S1 / total;
  const double x = 1 + b / total - std::floor(1 + b / total);
  return x <= ratio ? x / ratio : (x - 1) / (ratio - 1);
}

double LrSchedule::lr_at(int64_t t) const {
  const SchedulerConfig& p = s_.params;
  switch (s_.type) {
    case SchedulerType::None:
      return base_lr_;
    case SchedulerType::WarmupLR: {
      const double lo = p.warmup_min_lr.value_or(0.0), hi = p.warmup_max_lr.value_or(base_lr_);
      return lo + (hi - lo) * warmup_gamma(t);
    }
    case SchedulerType::WarmupDecayLR: {
      const double lo = p.warmup_min_lr.value_or(0.0), hi = p.warmup_max_lr.value_or(base_lr_);
      if (t < warmup_steps_) return lo + (hi - lo) * warmup_gamma(t);
      const double T = static_cast<double>(p.total_num_steps.value_or(0));
      const double gamma = std::max(0.0, (T - t) / std::max(1.0, T - warmup_steps_));
      return lo + (hi - lo) * gamma;
    }
    case SchedulerType::WarmupCosineLR: {
      // Ratios of the optimizer's lr: warmup from warmup_min_ratio to 1, then a cosine to cos_min_ratio.
      if (t < 0) return 0.0;  // DeepSpeed sets lr 0 at construction
      const double wmin = p.warmup_min_ratio, cmin = p.cos_min_ratio;
      double ratio;
      if (t < warmup_steps_) {
        ratio = wmin + (1.0 - wmin) * warmup_gamma(t);
      } else {
        const double T = static_cast<double>(p.total_num_steps.value_or(0));
        const double progress = std::min(1.0, (t - warmup_steps_ + 1) / std::max(1.0, T - warmup_steps_));
        ratio = std::max(0.0, cmin + (1.0 - cmin) * (1.0 + std::cos(M_PI * progress)) / 2.0);
      }
      return base_lr_ * ratio;
    }
    case SchedulerType::OneCycle: {
      const double lo = p.cycle_min_lr, hi = p.cycle_max_lr;
      const double S1 = static_cast<double>(p.cycle_first_step_size);
      const double S2 = static_cast<double>(p.cycle_second_step_size.value_or(p.cycle_first_step_size));
      const double total = S1 + S2;
      if (t < 0) return lo;
      if (t < total) {
        const double b = t + 1;
        double scale = one_cycle_scale(t);
        const int64_t k1 = p.cycle_first_stair_count.value_or(0);
        if (k1 > 0) {  // staircase: quantise the position within each half
          const int64_t k2 = p.cycle_second_stair_count.value_or(k1);
          const double ci = std::fmod(b, total);
          const double pos = ci <= S1 ? ci * k1 / S1 : (total - ci) * k2 / S2;
          scale = std::floor(pos) / (ci <= S1 ? k1 : k2);
        }
        return lo + (hi - lo) * scale;
      }
      const double d = t - total + 1;
      if (p.decay_step_size == 0 || p.decay_lr_rate == 0) return lo;
      return lo / (1 + p.decay_lr_rate * d / p.decay_step_size);
    }
    case SchedulerType::LRRangeTest: {
      const double size = static_cast<double>(p.lr_range_test_step_size);
      const double interval = p.lr_range_test_staircase ? std::floor((t + 1) / size) : (t + 1) / size;
      return p.lr_range_test_min_lr * (1 + p.lr_range_test_step_rate * interval);
    }
  }
  return base_lr_;
}

double LrSchedule::beta1_at(int64_t t) const {
  const SchedulerConfig& p = s_.params;
  if (s_.type != SchedulerType::OneCycle || !p.cycle_momentum) return base_beta1_;
  const double lo = p.cycle_min_mom, hi = p.cycle_max_mom;
  const double S1 = static_cast<double>(p.cycle_first_step_size);
  const double S2 = static_cast<double>(p.cycle_second_step_size.value_or(p.cycle_first_step_size));
  const double total = S1 + S2;
  if (t < 0) return lo;
  if (t < total) return hi - (hi - lo) * one_cycle_scale(t);  // momentum moves opposite to the lr
  const double d = t - total + 1;
  if (p.decay_step_size == 0 || p.decay_mom_rate == 0) return hi;
  return hi * (1 + p.decay_mom_rate * d / p.decay_step_size);
}

std::optional<double> LrSchedule::beta2_override() const {
  if (s_.type == SchedulerType::OneCycle && s_.params.cycle_momentum) return 0.99;
  return std::nullopt;
}

}  // namespace ds
