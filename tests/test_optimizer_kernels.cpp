// SGD and Lamb kernels against their formulas written out in double precision, and the flat
// optimizer's per-tensor trust ratio for Lamb.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "engine/runtime/run/optimizer.hpp"
#include "kernels/cpu/adam.hpp"
#include "kernels/cpu/lamb.hpp"
#include "kernels/cpu/sgd.hpp"

using namespace ds;
using namespace ds::kernels;

namespace {
std::vector<float> randn(int64_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0, 1);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(rng) * scale;
  return v;
}
}  // namespace

TEST(SgdKernel, MatchesTorchSgdOverThreeStepsWithNesterovMomentumAndDecay) {
  const int64_t n = 1000;  // spans the vectorised body and a tail
  std::vector<float> p = randn(n, 1, 0.1f), buf(n, 0.f);
  std::vector<double> pd(p.begin(), p.end()), bd(n, 0.0);
  SgdStep s;
  s.lr = 0.05f;
  s.momentum = 0.9f;
  s.dampening = 0.1f;
  s.weight_decay = 0.01f;
  s.nesterov = true;
  s.grad_scale = 0.5f;
  for (int t = 1; t <= 3; ++t) {
    const std::vector<float> g = randn(n, 10 + t, 1.f);
    s.first_step = t == 1;
    sgd_step_f32(p.data(), buf.data(), nullptr, g.data(), n, s);
    for (int64_t i = 0; i < n; ++i) {  // torch.optim.SGD, written out
      double gi = g[i] * 0.5 + 0.01 * pd[i];
      bd[i] = t == 1 ? gi : 0.9 * bd[i] + (1 - 0.1) * gi;
      gi = gi + 0.9 * bd[i];
      pd[i] -= 0.05 * gi;
    }
  }
  for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(p[i], pd[i], 1e-5 * (1 + std::fabs(pd[i]))) << i;
}

TEST(SgdKernel, PlainSgdNeedsNoStateAndBf16GradientsWork) {
  const int64_t n = 37;
  std::vector<float> p = randn(n, 2, 1.f), g = randn(n, 3, 1.f);
  std::vector<uint16_t> gb(n), out(n);
  for (int64_t i = 0; i < n; ++i) gb[i] = float_to_bf16(g[i]);
  const std::vector<float> before = p;
  SgdStep s;
  s.lr = 0.1f;
  sgd_step_bf16(p.data(), nullptr, out.data(), gb.data(), n, s);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_FLOAT_EQ(p[i], before[i] - 0.1f * bf16_to_float(gb[i]));
    EXPECT_EQ(out[i], float_to_bf16(p[i]));
  }
}

TEST(LambKernel, MatchesTheFusedLambFormulaIncludingTheTrustRatio) {
  const int64_t n = 5000;
  std::vector<float> p = randn(n, 4, 0.05f), m(n, 0.f), v(n, 0.f);
  std::vector<double> pd(p.begin(), p.end()), md(n, 0.0), vd(n, 0.0);
  const double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-6, wd = 0.01;
  for (int t = 1; t <= 3; ++t) {
    const std::vector<float> g = randn(n, 20 + t, 1e-2f);
    LambStep h;
    h.lr = lr, h.beta1 = b1, h.beta2 = b2, h.eps = eps, h.weight_decay = wd;
    const LambStep s = h.at_step(t);
    const float ratio = lamb_step_f32(p.data(), m.data(), v.data(), nullptr, g.data(), n, s);
    std::vector<double> u(n);
    double wn = 0, un = 0;
    for (int64_t i = 0; i < n; ++i) {
      md[i] = b1 * md[i] + (1 - b1) * g[i];
      vd[i] = b2 * vd[i] + (1 - b2) * g[i] * g[i];
      u[i] = md[i] / (std::sqrt(vd[i]) + eps) + wd * pd[i];
      wn += pd[i] * pd[i];
      un += u[i] * u[i];
    }
    const double r = std::clamp(std::sqrt(wn / un), 0.01, 10.0);
    EXPECT_NEAR(ratio, r, 1e-4 * r) << "step " << t;
    const double step = lr * std::sqrt(1 - std::pow(b2, t)) / (1 - std::pow(b1, t)) * r;
    for (int64_t i = 0; i < n; ++i) pd[i] -= step * u[i];
  }
  for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(p[i], pd[i], 1e-5 * (1e-2 + std::fabs(pd[i]))) << i;
}

TEST(LambKernel, TrustRatioIsClampedAndOneForZeroWeights) {
  const int64_t n = 64;
  std::vector<float> m(n, 0.f), v(n, 0.f), g(n, 1.f), zero(n, 0.f);
  LambStep h;
  h.lr = 1e-3f, h.beta1 = 0.9f, h.beta2 = 0.999f, h.eps = 1e-8f;
  LambStep s = h.at_step(1);
  EXPECT_FLOAT_EQ(lamb_step_f32(zero.data(), m.data(), v.data(), nullptr, g.data(), n, s), 1.f);
  std::vector<float> big(n, 1e3f), m2(n, 0.f), v2(n, 0.f);
  EXPECT_FLOAT_EQ(lamb_step_f32(big.data(), m2.data(), v2.data(), nullptr, g.data(), n, s), 10.f);  // max_coeff
}

TEST(FlatOptimizer, LambTakesOneTrustRatioPerParameterTensor) {
  // Two tensors with very different weight norms: a per-buffer ratio would move both alike.
  FlatLayout layout;
  layout.params = {{"a", {4}, 4, 0, 0, 0, false}, {"b", {4}, 4, 4, 0, 0, false}};
  layout.numel = 8;
  ResolvedOptimizer o;
  o.type = OptimizerType::Lamb;
  o.bias_correction = false;
  o.eps = 1e-8;
  o.betas = {0.9, 0.999};
  o.max_coeff = 10;
  o.min_coeff = 0.01;
  std::vector<float> w = {1, 1, 1, 1, 0.1f, 0.1f, 0.1f, 0.1f}, m(8, 0.f), v(8, 0.f), g(8, 1.f);
  OptimizerBuffers b;
  b.master = w.data();
  b.moment1 = m.data();
  b.moment2 = v.data();
  b.grads = g.data();
  OptimizerStepInputs in;
  in.lr = 0.01;
  FlatOptimizer(o, layout, 0).step(b, in);
  // u is the same everywhere, so ratio * u = ||w|| / ||u|| * u = w: each tensor moves by lr times its
  // own weights (1 and 0.1), which one ratio for the whole buffer could not do.
  EXPECT_NEAR(1.f - w[0], 0.01f * 1.0f, 1e-6);
  EXPECT_NEAR(0.1f - w[4], 0.01f * 0.1f, 1e-7);
}
