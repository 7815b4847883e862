#include <gtest/gtest.h>

#include <cmath>

#include "engine/runtime/run/lr_schedule.hpp"

using namespace ds;

namespace {
ResolvedScheduler sched(SchedulerType type) {
  ResolvedScheduler s;
  s.type = type;
  s.params.warmup_type = "log";
  return s;
}
}  // namespace

// Each expectation restates DeepSpeed's formula (reference §1.3) at a chosen step.
TEST(LrSchedule, WarmupLRLogRisesThenHolds) {
  auto s = sched(SchedulerType::WarmupLR);
  s.params.warmup_min_lr = 0.0;
  s.params.warmup_max_lr = 1e-3;
  s.params.warmup_num_steps = 100;
  LrSchedule lr(s, 1e-3, 0.9);
  EXPECT_DOUBLE_EQ(lr.lr_at(-1), 0.0);  // construction: warmup_min_lr
  EXPECT_DOUBLE_EQ(lr.lr_at(0), 0.0);   // ln(1)/ln(100) = 0: the first two steps run at the minimum
  EXPECT_DOUBLE_EQ(lr.lr_at(9), 1e-3 * std::log(10.0) / std::log(100.0));
  EXPECT_DOUBLE_EQ(lr.lr_at(100), 1e-3);
  EXPECT_DOUBLE_EQ(lr.lr_at(5000), 1e-3);
}

TEST(LrSchedule, WarmupStepsAreClampedToAtLeastTwo) {
  auto s = sched(SchedulerType::WarmupLR);
  s.params.warmup_num_steps = 1;
  s.params.warmup_max_lr = 1.0;
  s.params.warmup_type = "linear";
  LrSchedule lr(s, 1.0, 0.9);
  EXPECT_DOUBLE_EQ(lr.lr_at(1), 0.5);  // W = max(2, 1) = 2: gamma = 1/2
  EXPECT_DOUBLE_EQ(lr.lr_at(2), 1.0);
}

TEST(LrSchedule, WarmupDecayLRDecaysLinearlyToTheMinimumAtTotal) {
  auto s = sched(SchedulerType::WarmupDecayLR);
  s.params.warmup_min_lr = 1e-5;
  s.params.warmup_max_lr = 1e-3;
  s.params.warmup_num_steps = 10;
  s.params.total_num_steps = 110;
  s.params.warmup_type = "linear";
  LrSchedule lr(s, 1e-3, 0.9);
  EXPECT_DOUBLE_EQ(lr.lr_at(5), 1e-5 + (1e-3 - 1e-5) * 0.5);
  EXPECT_DOUBLE_EQ(lr.lr_at(10), 1e-5 + (1e-3 - 1e-5) * (110.0 - 10) / 100);  // gamma = (T - t) / (T - W)
  EXPECT_DOUBLE_EQ(lr.lr_at(60), 1e-5 + (1e-3 - 1e-5) * 0.5);
  EXPECT_DOUBLE_EQ(lr.lr_at(110), 1e-5);
  EXPECT_DOUBLE_EQ(lr.lr_at(500), 1e-5);  // gamma clamps at 0
}

TEST(LrSchedule, WarmupCosineLRScalesTheOptimizersLr) {
  auto s = sched(SchedulerType::WarmupCosineLR);
  s.params.warmup_min_ratio = 0.0;
  s.params.cos_min_ratio = 0.1;
  s.params.warmup_num_steps = 10;
  s.params.total_num_steps = 110;
  s.params.warmup_type = "linear";
  LrSchedule lr(s, 6e-4, 0.9);
  EXPECT_DOUBLE_EQ(lr.lr_at(-1), 0.0);
  EXPECT_DOUBLE_EQ(lr.lr_at(5), 6e-4 * 0.5);
  // t >= W: p = (t - W + 1) / (T - W); ratio = cmin + (1 - cmin)(1 + cos(pi p)) / 2.
  const double p = (59.0 - 10 + 1) / 100;
  EXPECT_DOUBLE_EQ(lr.lr_at(59), 6e-4 * (0.1 + 0.9 * (1 + std::cos(M_PI * p)) / 2));
  EXPECT_NEAR(lr.lr_at(109), 6e-4 * 0.1, 1e-15);
  EXPECT_NEAR(lr.lr_at(1000), 6e-4 * 0.1, 1e-15);
}

TEST(LrSchedule, OneCycleRisesFallsThenDecays) {
  auto s = sched(SchedulerType::OneCycle);
  s.params.cycle_min_lr = 1e-4;
  s.params.cycle_max_lr = 1e-3;
  s.params.cycle_first_step_size = 10;
  s.params.cycle_second_step_size = 10;
  s.params.decay_lr_rate = 0.5;
  s.params.decay_step_size = 10;
  s.params.cycle_momentum = true;
  s.params.cycle_min_mom = 0.8;
  s.params.cycle_max_mom = 0.9;
  LrSchedule lr(s, 1e-3, 0.9);
  // t = 4: b = 5, x = 0.25, ratio 0.5 -> scale 0.5.
  EXPECT_DOUBLE_EQ(lr.lr_at(4), 1e-4 + 9e-4 * 0.5);
  EXPECT_DOUBLE_EQ(lr.beta1_at(4), 0.9 - 0.1 * 0.5);
  // t = 9: b = 10, x = 0.5 -> scale 1 (the peak).
  EXPECT_DOUBLE_EQ(lr.lr_at(9), 1e-3);
  // t = 14: b = 15, x = 0.75 -> (0.75 - 1) / (0.5 - 1) = 0.5.
  EXPECT_DOUBLE_EQ(lr.lr_at(14), 1e-4 + 9e-4 * 0.5);
  // After the cycle: lr = min / (1 + rate d / size), d = t - total + 1.
  EXPECT_DOUBLE_EQ(lr.lr_at(29), 1e-4 / (1 + 0.5 * 10 / 10));
  EXPECT_EQ(lr.beta2_override(), 0.99);  // DeepSpeed forces beta2 to 0.99 while cycling momentum
}

TEST(LrSchedule, LRRangeTestGrowsLinearlyOrInStairs) {
  auto s = sched(SchedulerType::LRRangeTest);
  s.params.lr_range_test_min_lr = 1e-4;
  s.params.lr_range_test_step_size = 10;
  s.params.lr_range_test_step_rate = 2.0;
  LrSchedule smooth(s, 1.0, 0.9);
  EXPECT_DOUBLE_EQ(smooth.lr_at(14), 1e-4 * (1 + 2.0 * 1.5));
  s.params.lr_range_test_staircase = true;
  LrSchedule stairs(s, 1.0, 0.9);
  EXPECT_DOUBLE_EQ(stairs.lr_at(14), 1e-4 * (1 + 2.0 * 1));
}

TEST(LrSchedule, NoSchedulerKeepsTheOptimizersLr) {
  LrSchedule lr(sched(SchedulerType::None), 3e-4, 0.9);
  EXPECT_DOUBLE_EQ(lr.lr_at(0), 3e-4);
  EXPECT_DOUBLE_EQ(lr.lr_at(12345), 3e-4);
  EXPECT_FALSE(lr.beta2_override().has_value());
}
