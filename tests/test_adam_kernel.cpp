#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/adam.hpp"

using namespace ds::kernels;

namespace {

constexpr int kGuard = 64;           // elements past each output, which must stay untouched
constexpr float kSentinel = -12345.0f;

struct Buffers {
  std::vector<float> p, m, v, g;
  std::vector<uint16_t> out, gb;
  explicit Buffers(int64_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0, 1);
    p.resize(n + kGuard, kSentinel);
    m.resize(n + kGuard, kSentinel);
    v.resize(n + kGuard, kSentinel);
    g.resize(n);
    gb.resize(n);
    out.assign(n + kGuard, 0xBEEF);
    for (int64_t i = 0; i < n; ++i) {
      p[i] = d(rng) * 0.02f;
      m[i] = d(rng) * 1e-3f;
      v[i] = std::fabs(d(rng)) * 1e-6f;
      g[i] = d(rng) * 1e-2f;
      gb[i] = float_to_bf16(g[i]);
    }
  }
};

void expect_guards_intact(const Buffers& b, int64_t n) {
  for (int i = 0; i < kGuard; ++i) {
    ASSERT_EQ(b.p[n + i], kSentinel) << "write past the end of master at " << n + i;
    ASSERT_EQ(b.m[n + i], kSentinel);
    ASSERT_EQ(b.v[n + i], kSentinel);
    ASSERT_EQ(b.out[n + i], 0xBEEF);
  }
}

}  // namespace

TEST(Bf16Conversion, RoundsToNearestEvenAndKeepsNaN) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_float(0x3f80), 1.0f);
  EXPECT_EQ(float_to_bf16(1.00390625f), 0x3f80);  // exactly half way (0x3f808000): ties to even
  EXPECT_EQ(float_to_bf16(1.01171875f), 0x3f82);  // half way above an odd mantissa: rounds up
  EXPECT_EQ(float_to_bf16(std::nanf("")) & 0x7fc0, 0x7fc0);
  EXPECT_EQ(float_to_bf16(INFINITY), 0x7f80);
}

// The fast kernel against the scalar reference at awkward sizes (vector tails, block edges).
TEST(AdamKernel, FastPathMatchesTheReference) {
  for (int64_t n : {1, 7, 15, 16, 17, 4097, (1 << 16) + 3, 3 * (1 << 16) + 31}) {
    for (bool decoupled : {true, false}) {
      SCOPED_TRACE("n=" + std::to_string(n) + (decoupled ? " adamw" : " adam-l2"));
      AdamStep h;
      h.lr = 1e-3f, h.beta1 = 0.9f, h.beta2 = 0.95f, h.eps = 1e-8f, h.weight_decay = 0.1f, h.decoupled = decoupled, h.grad_scale = 0.5f;
      const AdamStep s = h.at_step(7);
      Buffers fast(n, 1), ref(n, 1);
      adam_step_f32(fast.p.data(), fast.m.data(), fast.v.data(), fast.out.data(), fast.g.data(), n, s);
      adam_step_f32_reference(ref.p.data(), ref.m.data(), ref.v.data(), ref.out.data(), ref.g.data(), n, s);
      expect_guards_intact(fast, n);
      // FMA vs multiply-then-add differ in the last bit, and updates can cancel, so each bound follows
      // the scale of the inputs (weights and first moments ~1e-3, second moments ~1e-5 here), not the result.
      double worst = 0;
      int64_t worst_i = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double e = std::fabs(fast.p[i] - ref.p[i]) / (std::fabs(ref.p[i]) + 1e-3);
        if (e > worst) worst = e, worst_i = i;
        ASSERT_NEAR(fast.m[i], ref.m[i], 1e-6 * (std::fabs(ref.m[i]) + 1e-3)) << i;
        ASSERT_NEAR(fast.v[i], ref.v[i], 1e-6 * (std::fabs(ref.v[i]) + 1e-5)) << i;
        ASSERT_LE(std::abs(int(fast.out[i]) - int(ref.out[i])), 1) << "bf16 copy differs by more than 1 ulp at " << i;
      }
      // Cancellation in m, amplified through m / sqrt(v), reaches a few 1e-6 of the scale: still 100x
      // below bf16's resolution, which the 1-ulp check on the copy above confirms.
      EXPECT_LT(worst, 1e-5) << "largest scaled difference at " << worst_i << ": " << fast.p[worst_i] << " vs "
                             << ref.p[worst_i];
    }
  }
}

TEST(AdamKernel, Bf16GradientsGiveTheSameStepAsTheirFp32Values) {
  const int64_t n = 1000;
  AdamStep h;
  h.lr = 1e-3f, h.beta1 = 0.9f, h.beta2 = 0.999f, h.eps = 1e-8f, h.weight_decay = 0.0f;
  AdamStep s = h.at_step(1);
  Buffers a(n, 3), b(n, 3);
  for (int64_t i = 0; i < n; ++i) b.g[i] = bf16_to_float(b.gb[i]);
  adam_step_bf16(a.p.data(), a.m.data(), a.v.data(), a.out.data(), a.gb.data(), n, s);
  adam_step_f32(b.p.data(), b.m.data(), b.v.data(), b.out.data(), b.g.data(), n, s);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(a.p[i], b.p[i]) << i;
  expect_guards_intact(a, n);
}

TEST(AdamKernel, ReferenceFollowsTheFormula) {
  // One element, step 1, by hand: with bias correction the first update is lr * sign(g) (|m/sqrt(v)| = 1).
  float p = 0.5f, m = 0, v = 0, g = 0.2f;
  uint16_t out = 0;
  AdamStep h;
  h.lr = 0.01f, h.beta1 = 0.9f, h.beta2 = 0.999f, h.eps = 0.0f, h.weight_decay = 0.0f;
  AdamStep s = h.at_step(1);
  adam_step_f32_reference(&p, &m, &v, &out, &g, 1, s);
  EXPECT_NEAR(p, 0.5f - 0.01f, 1e-6);
  EXPECT_FLOAT_EQ(m, (1 - 0.9f) * 0.2f);
  EXPECT_FLOAT_EQ(v, (1 - 0.999f) * (0.2f * 0.2f));
  EXPECT_EQ(out, float_to_bf16(p));
  // Decoupled weight decay shrinks the weight by lr * wd before the Adam update.
  float p2 = 1.0f, m2 = 0, v2 = 0, g2 = 0.0f;
  AdamStep wh;
  wh.lr = 0.1f, wh.beta1 = 0.9f, wh.beta2 = 0.999f, wh.eps = 1e-8f, wh.weight_decay = 0.5f;
  AdamStep wd = wh.at_step(1);
  adam_step_f32_reference(&p2, &m2, &v2, nullptr, &g2, 1, wd);
  EXPECT_FLOAT_EQ(p2, 1.0f - 0.1f * 0.5f);
}
