// SGD and Lamb kernels against their formulas written out in double precision, and the flat
// optimizer's per-tensor trust ratio for Lamb.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
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

// A step decided on the device (AdamStep::control, SgdStep::control): the kernel takes its scale from the control
// as it would from grad_scale, bit for bit, and writes nothing at all when the control says skip, on every path
// (Adam's fast and reference loops, fp32, bf16 and fp16 gradients; SGD).
TEST(OptimizerControl, TheScaleComesFromTheControlAndASkipWritesNothing) {
  const int64_t n = 1000;  // (the fast path's 16-lane loop and its tail)
  const std::vector<float> w0 = randn(n, 1, 0.5f), m0 = randn(n, 2, 0.01f), g = randn(n, 3, 1.0f);
  std::vector<float> v0(static_cast<size_t>(n));
  for (size_t i = 0; i < v0.size(); ++i) v0[i] = 0.1f * std::fabs(m0[i]) + 1e-6f;
  std::vector<uint16_t> g16(static_cast<size_t>(n)), gh(static_cast<size_t>(n));
  for (size_t i = 0; i < g.size(); ++i) g16[i] = float_to_bf16(g[i]), gh[i] = float_to_fp16(g[i]);
  AdamStep scalar;
  scalar.lr = 1e-3f;
  scalar.weight_decay = 0.1f;
  scalar.grad_scale = 0.37f;
  scalar = scalar.at_step(3);
  struct State {
    std::vector<float> w, m, v;
    std::vector<uint16_t> out;
  };
  const auto run = [&](const char* path, const AdamStep& s) {
    State st{w0, m0, v0, std::vector<uint16_t>(static_cast<size_t>(n), 0x1234)};
    const std::string p = path;
    if (p == "f32") adam_step_f32(st.w.data(), st.m.data(), st.v.data(), st.out.data(), g.data(), n, s);
    if (p == "bf16") adam_step_bf16(st.w.data(), st.m.data(), st.v.data(), st.out.data(), g16.data(), n, s);
    if (p == "fp16") adam_step_fp16(st.w.data(), st.m.data(), st.v.data(), st.out.data(), gh.data(), n, s);
    if (p == "f32 reference") adam_step_f32_reference(st.w.data(), st.m.data(), st.v.data(), st.out.data(), g.data(), n, s);
    if (p == "bf16 reference") adam_step_bf16_reference(st.w.data(), st.m.data(), st.v.data(), st.out.data(), g16.data(), n, s);
    return st;
  };
  const float apply[2] = {0.37f, 1.0f}, skip[2] = {0.37f, 0.0f};
  AdamStep by_control = scalar, skipped = scalar;
  by_control.grad_scale = 5.0f;  // (ignored: the control's scale is the step's)
  by_control.control = apply;
  skipped.control = skip;
  for (const char* path : {"f32", "bf16", "fp16", "f32 reference", "bf16 reference"}) {
    SCOPED_TRACE(path);
    const State want = run(path, scalar), got = run(path, by_control), none = run(path, skipped);
    EXPECT_NE(want.w, w0);
    EXPECT_EQ(got.w, want.w);
    EXPECT_EQ(got.m, want.m);
    EXPECT_EQ(got.v, want.v);
    EXPECT_EQ(got.out, want.out);
    EXPECT_EQ(none.w, w0);
    EXPECT_EQ(none.m, m0);
    EXPECT_EQ(none.v, v0);
    EXPECT_EQ(none.out, std::vector<uint16_t>(static_cast<size_t>(n), 0x1234));
  }
  SgdStep sgd;
  sgd.lr = 0.01f;
  sgd.momentum = 0.9f;
  sgd.grad_scale = 0.37f;
  SgdStep sgd_control = sgd, sgd_skipped = sgd;
  sgd_control.grad_scale = 5.0f;
  sgd_control.control = apply;
  sgd_skipped.control = skip;
  std::vector<float> w1 = w0, b1 = m0, w2 = w0, b2 = m0, w3 = w0, b3 = m0;
  sgd_step_f32(w1.data(), b1.data(), nullptr, g.data(), n, sgd);
  sgd_step_f32(w2.data(), b2.data(), nullptr, g.data(), n, sgd_control);
  sgd_step_bf16(w3.data(), b3.data(), nullptr, g16.data(), n, sgd_skipped);
  EXPECT_NE(w1, w0);
  EXPECT_EQ(w2, w1);
  EXPECT_EQ(b2, b1);
  EXPECT_EQ(w3, w0);
  EXPECT_EQ(b3, m0);
}
