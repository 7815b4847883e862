#include <gtest/gtest.h>

#include <stdexcept>

#include "engine/runtime/run/loss_scaler.hpp"

using namespace ds;

namespace {
LossScaling dynamic(double init, int64_t window, int hysteresis, double min_scale = 1, bool consecutive = false) {
  LossScaling c;
  c.enabled = true;
  c.dynamic = true;
  c.initial_scale = init;
  c.window = window;
  c.hysteresis = hysteresis;
  c.min_scale = min_scale;
  c.consecutive_hysteresis = consecutive;
  return c;
}
}  // namespace

// DeepSpeed's DynamicLossScaler (reference §2): with window W the first doubling is at update index
// W, i.e. after W + 1 clean steps, then every W clean steps.
TEST(LossScaler, DoublesAfterEachCleanWindow) {
  LossScaler s(dynamic(65536, 3, 2));
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(s.update(false));
  EXPECT_DOUBLE_EQ(s.scale(), 65536);
  s.update(false);  // index 3
  EXPECT_DOUBLE_EQ(s.scale(), 131072);
  for (int i = 0; i < 3; ++i) s.update(false);  // indices 4-6: 6 - (-1) - 1 = 6, divisible by 3
  EXPECT_DOUBLE_EQ(s.scale(), 262144);
}

TEST(LossScaler, HysteresisAbsorbsOverflowsBeforeHalving) {
  LossScaler s(dynamic(1024, 1000, 2));
  EXPECT_TRUE(s.update(true));  // first overflow: counter 2 -> 1, scale unchanged, step skipped
  EXPECT_DOUBLE_EQ(s.scale(), 1024);
  EXPECT_EQ(s.state().hysteresis_left, 1);
  EXPECT_TRUE(s.update(true));  // counter at 1: halve
  EXPECT_DOUBLE_EQ(s.scale(), 512);
  EXPECT_TRUE(s.update(true));  // still 1 (no clean window refilled it): halve again
  EXPECT_DOUBLE_EQ(s.scale(), 256);
}

TEST(LossScaler, CleanWindowRefillsHysteresisAndDoublesFromTheLastOverflow) {
  LossScaler s(dynamic(1024, 2, 2));
  s.update(true);  // index 0: hysteresis 2 -> 1
  s.update(false);  // index 1: stable 0
  s.update(false);  // index 2: stable 1
  EXPECT_DOUBLE_EQ(s.scale(), 1024);
  s.update(false);  // index 3: stable 2 = W -> double and refill
  EXPECT_DOUBLE_EQ(s.scale(), 2048);
  EXPECT_EQ(s.state().hysteresis_left, 2);
}

TEST(LossScaler, ConsecutiveHysteresisRefillsOnEveryCleanStep) {
  LossScaler s(dynamic(1024, 1000, 2, 1, true));
  s.update(true);
  s.update(false);  // refilled
  s.update(true);   // 2 -> 1 again, no halving
  EXPECT_DOUBLE_EQ(s.scale(), 1024);
  s.update(true);  // two in a row: halve
  EXPECT_DOUBLE_EQ(s.scale(), 512);
}

TEST(LossScaler, NeverBelowTheMinimumAndFailsThere) {
  LossScaler s(dynamic(4, 1000, 1, 2));
  s.update(true);
  EXPECT_DOUBLE_EQ(s.scale(), 2);
  EXPECT_THROW(s.update(true), std::runtime_error);
}

TEST(LossScaler, StaticScaleAndDisabledScalerOnlyReportOverflow) {
  LossScaling fixed;
  fixed.enabled = true;
  fixed.dynamic = false;
  fixed.initial_scale = 128;
  LossScaler s(fixed);
  EXPECT_TRUE(s.update(true));
  EXPECT_DOUBLE_EQ(s.scale(), 128);
  LossScaler off{LossScaling{}};
  EXPECT_DOUBLE_EQ(off.scale(), 1);
  EXPECT_TRUE(off.update(true));  // bf16 with check_grad_overflow: skip, never rescale
  EXPECT_DOUBLE_EQ(off.scale(), 1);
}

TEST(LossScaler, StateRestoresExactly) {
  LossScaler a(dynamic(65536, 2, 2));
  for (bool o : {false, true, false, false, true, true, false}) a.update(o);
  LossScaler b(dynamic(65536, 2, 2));
  b.restore(a.state());
  for (bool o : {false, false, false, true, false}) {
    a.update(o);
    b.update(o);
    EXPECT_DOUBLE_EQ(a.scale(), b.scale());
  }
}
