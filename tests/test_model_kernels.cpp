// The model's own CPU kernels (kernels/cpu) against their plain double-precision references, at
// awkward sizes, in fp32 and bf16.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <random>
#include <vector>

#include "kernels/cpu/adam.hpp"
#include "kernels/cpu/attention_softmax.hpp"
#include "kernels/cpu/attention_tiles.hpp"
#include "kernels/cpu/cross_entropy.hpp"
#include "kernels/cpu/embedding.hpp"
#include "kernels/cpu/activation.hpp"
#include "kernels/cpu/layer_norm.hpp"
#include "kernels/cpu/rope.hpp"

using namespace ds::kernels;

namespace {

std::vector<float> normal_values(int64_t n, float stddev, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0, stddev);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

double widen_value(float v) { return v; }
double widen_value(uint16_t v) { return bf16_to_float(v); }

std::vector<uint16_t> to_bf16(const std::vector<float>& f) {
  std::vector<uint16_t> b(f.size());
  for (size_t i = 0; i < f.size(); ++i) b[i] = float_to_bf16(f[i]);
  return b;
}

}  // namespace

TEST(CrossEntropyKernel, LossAndGradientMatchTheDoubleReference) {
  for (int64_t vocab : {1, 15, 16, 17, 1000, 1025, 50257}) {
    for (int64_t pad : {0, 3}) {
      const int64_t rows = 5, stride = vocab + pad;
      // Logits on a wide scale (some rows far from 0) so the shift by the maximum matters.
      std::vector<float> f = normal_values(rows * stride, 4.0f, static_cast<uint32_t>(vocab));
      for (int64_t j = 0; j < stride; ++j) f[static_cast<size_t>(2 * stride + j)] += 80.0f;
      std::vector<int64_t> targets(rows);
      for (int64_t r = 0; r < rows; ++r) targets[static_cast<size_t>(r)] = (r * 7919) % vocab;
      const float scale = 1.0f / 3;

      std::vector<float> fast = f, ref = f;
      const double lf = softmax_cross_entropy_f32(fast.data(), targets.data(), rows, vocab, stride, scale, true);
      const double lr = softmax_cross_entropy_f32_reference(ref.data(), targets.data(), rows, vocab, stride, scale, true);
      ASSERT_TRUE(std::isfinite(lr));
      EXPECT_NEAR(lf, lr, 1e-6 * std::fabs(lr) + 1e-6) << vocab;
      for (size_t i = 0; i < f.size(); ++i) {
        if (static_cast<int64_t>(i) % stride >= vocab) {
          EXPECT_EQ(fast[i], f[i]) << "padding written at " << i;  // between rows: untouched
          continue;
        }
        ASSERT_NEAR(fast[i], ref[i], 1e-6f * std::fabs(ref[i]) + 1e-9f) << vocab << " at " << i;
      }

      std::vector<uint16_t> b = to_bf16(f), bfast = b, bref = b;
      const double bl = softmax_cross_entropy_bf16(bfast.data(), targets.data(), rows, vocab, stride, scale, true);
      const double blr =
          softmax_cross_entropy_bf16_reference(bref.data(), targets.data(), rows, vocab, stride, scale, true);
      EXPECT_NEAR(bl, blr, 1e-6 * std::fabs(blr) + 1e-6) << vocab;
      for (size_t i = 0; i < b.size(); ++i) {
        const float x = bf16_to_float(bfast[i]), y = bf16_to_float(bref[i]);
        // One rounding of nearly the same fp32 value: equal, or one bf16 step apart.
        ASSERT_NEAR(x, y, std::fabs(y) * (1.0f / 128) + 1e-30f) << vocab << " at " << i;
      }
    }
  }
}

TEST(CrossEntropyKernel, TheLossAloneLeavesTheLogitsAsTheyWere) {
  const int64_t rows = 3, vocab = 333;
  std::vector<float> f = normal_values(rows * vocab, 1.0f, 9), before = f;
  const std::vector<int64_t> targets = {0, 332, 100};
  const double loss = softmax_cross_entropy_f32(f.data(), targets.data(), rows, vocab, vocab, 1.0f, false);
  EXPECT_EQ(f, before);
  std::vector<float> g = f;
  EXPECT_NEAR(loss, softmax_cross_entropy_f32_reference(g.data(), targets.data(), rows, vocab, vocab, 1.0f, false),
              1e-9 * loss);
}

TEST(CrossEntropyKernel, UniformLogitsCostLogVocabAndTheGradientSumsToZero) {
  const int64_t rows = 4, vocab = 50257;
  std::vector<float> f(rows * vocab, 0.25f);
  const std::vector<int64_t> targets = {0, 1, 50256, 777};
  const double loss = softmax_cross_entropy_f32(f.data(), targets.data(), rows, vocab, vocab, 1.0f, true);
  EXPECT_NEAR(loss / rows, std::log(static_cast<double>(vocab)), 1e-6);
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0;
    for (int64_t j = 0; j < vocab; ++j) sum += f[static_cast<size_t>(r * vocab + j)];
    EXPECT_NEAR(sum, 0.0, 1e-5) << r;
    EXPECT_NEAR(f[static_cast<size_t>(r * vocab + targets[static_cast<size_t>(r)])], 1.0 / vocab - 1.0, 1e-6);
  }
}

TEST(CrossEntropyKernel, ANaNLogitMakesTheLossNaN) {
  std::vector<float> f(100, 0.0f);
  f[42] = NAN;
  const int64_t target = 3;
  EXPECT_TRUE(std::isnan(softmax_cross_entropy_f32(f.data(), &target, 1, 100, 100, 1.0f, true)));
}

namespace {

// |got - want| within rel of the largest |want| (plus one bf16 step of each value for bf16 outputs).
template <class T>
void expect_close(const std::vector<T>& got, const std::vector<T>& want, double rel, const std::string& what) {
  double scale = 0;
  for (const T& w : want) scale = std::max(scale, std::fabs(widen_value(w)));
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = widen_value(got[i]), w = widen_value(want[i]);
    const double step = sizeof(T) == 2 ? std::fabs(w) / 128 : 0.0;
    ASSERT_NEAR(g, w, rel * scale + step + 1e-30) << what << " at " << i;
  }
}

}  // namespace

TEST(NormKernels, LayerNormAndRmsNormMatchTheDoubleReferenceForwardAndBackward) {
  for (bool rms : {false, true}) {
    for (int64_t cols : {1, 15, 17, 64, 768, 1000}) {
      for (int64_t rows : {1, 7}) {
        const NormShape shape{rows, cols, 1e-5f, rms};
        const std::string what = std::string(rms ? "rms" : "layer") + " cols " + std::to_string(cols) + " rows " + std::to_string(rows);
        std::vector<float> x = normal_values(rows * cols, 3.0f, static_cast<uint32_t>(cols + rows));
        for (float& v : x) v += 1.5f;  // a mean away from 0
        const std::vector<float> w = normal_values(cols, 1.0f, 11), b = normal_values(cols, 1.0f, 12);
        const std::vector<float> dy = normal_values(rows * cols, 1.0f, 13);
        const float* bias = rms ? nullptr : b.data();
        {  // fp32
          std::vector<float> y(x.size()), y_ref(x.size()), mean(rows), rstd(rows), mean_ref(rows), rstd_ref(rows);
          norm_forward_f32(x.data(), w.data(), bias, y.data(), mean.data(), rstd.data(), shape);
          norm_forward_f32_reference(x.data(), w.data(), bias, y_ref.data(), mean_ref.data(), rstd_ref.data(), shape);
          expect_close(y, y_ref, 1e-5, what + " y");
          expect_close(rstd, rstd_ref, 1e-5, what + " rstd");
          std::vector<float> dx(x.size()), dx_ref(x.size()), dw(cols, 0.5f), dw_ref(cols, 0.5f), db(cols, 0.25f), db_ref(cols, 0.25f);
          norm_backward_f32(dy.data(), x.data(), w.data(), mean.data(), rstd.data(), dx.data(), dw.data(), rms ? nullptr : db.data(), shape);
          norm_backward_f32_reference(dy.data(), x.data(), w.data(), mean_ref.data(), rstd_ref.data(), dx_ref.data(),
                                      dw_ref.data(), rms ? nullptr : db_ref.data(), shape);
          if (cols > 1) expect_close(dx, dx_ref, 1e-4, what + " dx");  // one column: dx is rounding noise around 0
          expect_close(dw, dw_ref, 1e-5, what + " dw");
          expect_close(db, db_ref, 1e-5, what + " db");
        }
        {  // bf16
          const std::vector<uint16_t> xb = to_bf16(x), wb = to_bf16(w), bb = to_bf16(b), dyb = to_bf16(dy);
          const uint16_t* biasb = rms ? nullptr : bb.data();
          std::vector<uint16_t> y(x.size()), y_ref(x.size()), dx(x.size()), dx_ref(x.size());
          std::vector<float> mean(rows), rstd(rows), mean_ref(rows), rstd_ref(rows), dw(cols, 0), dw_ref(cols, 0), db(cols, 0), db_ref(cols, 0);
          norm_forward_bf16(xb.data(), wb.data(), biasb, y.data(), mean.data(), rstd.data(), shape);
          norm_forward_bf16_reference(xb.data(), wb.data(), biasb, y_ref.data(), mean_ref.data(), rstd_ref.data(), shape);
          expect_close(y, y_ref, 1e-5, what + " bf16 y");
          norm_backward_bf16(dyb.data(), xb.data(), wb.data(), mean.data(), rstd.data(), dx.data(), dw.data(), db.data(), shape);
          norm_backward_bf16_reference(dyb.data(), xb.data(), wb.data(), mean_ref.data(), rstd_ref.data(), dx_ref.data(),
                                       dw_ref.data(), db_ref.data(), shape);
          if (cols > 1) expect_close(dx, dx_ref, 1e-4, what + " bf16 dx");
          expect_close(dw, dw_ref, 1e-5, what + " bf16 dw");
        }
      }
    }
  }
}

TEST(SwiGluKernel, MatchesTheDoubleReferenceForwardAndBackwardOverItsWholeRange) {
  for (int64_t n : {1, 17, (1 << 14) + 5}) {
    std::vector<float> g = normal_values(n, 4.0f, static_cast<uint32_t>(n)), u = normal_values(n, 1.0f, 78);
    const std::vector<float> dy = normal_values(n, 1.0f, 79);
    g[0] = n > 1 ? 40.0f : -40.0f;  // far into both tails: silu -> g and -> 0
    g[static_cast<size_t>(n / 2)] = -20.0f;
    std::vector<float> y(n), y_ref(n), dg(n), dg_ref(n), du(n), du_ref(n);
    swiglu_forward_f32(g.data(), u.data(), y.data(), n);
    swiglu_forward_f32_reference(g.data(), u.data(), y_ref.data(), n);
    expect_close(y, y_ref, 5e-6, "swiglu y n=" + std::to_string(n));
    swiglu_backward_f32(dy.data(), g.data(), u.data(), dg.data(), du.data(), n);
    swiglu_backward_f32_reference(dy.data(), g.data(), u.data(), dg_ref.data(), du_ref.data(), n);
    expect_close(dg, dg_ref, 5e-6, "swiglu dg n=" + std::to_string(n));
    expect_close(du, du_ref, 5e-6, "swiglu du n=" + std::to_string(n));
    const std::vector<uint16_t> gb = to_bf16(g), ub = to_bf16(u), dyb = to_bf16(dy);
    std::vector<uint16_t> yb(n), yb_ref(n), dgb(n), dgb_ref(n), dub(n), dub_ref(n);
    swiglu_forward_bf16(gb.data(), ub.data(), yb.data(), n);
    swiglu_forward_bf16_reference(gb.data(), ub.data(), yb_ref.data(), n);
    expect_close(yb, yb_ref, 1e-6, "swiglu bf16 y");
    swiglu_backward_bf16(dyb.data(), gb.data(), ub.data(), dgb.data(), dub.data(), n);
    swiglu_backward_bf16_reference(dyb.data(), gb.data(), ub.data(), dgb_ref.data(), dub_ref.data(), n);
    expect_close(dgb, dgb_ref, 1e-6, "swiglu bf16 dg");
    expect_close(dub, dub_ref, 1e-6, "swiglu bf16 du");
  }
}

TEST(GeluKernel, MatchesTheDoubleReferenceForwardAndBackwardOverItsWholeRange) {
  for (int64_t n : {1, 17, (1 << 14) + 5, 50000}) {
    std::vector<float> x = normal_values(n, 3.0f, static_cast<uint32_t>(n)), dy = normal_values(n, 1.0f, 77);
    x[0] = n > 1 ? 30.0f : -30.0f;  // far into both tails
    x[static_cast<size_t>(n / 2)] = -12.0f;
    std::vector<float> y(n), y_ref(n), dx(n), dx_ref(n);
    gelu_tanh_forward_f32(x.data(), y.data(), n);
    gelu_tanh_forward_f32_reference(x.data(), y_ref.data(), n);
    expect_close(y, y_ref, 5e-6, "gelu y n=" + std::to_string(n));
    gelu_tanh_backward_f32(dy.data(), x.data(), dx.data(), n);
    gelu_tanh_backward_f32_reference(dy.data(), x.data(), dx_ref.data(), n);
    expect_close(dx, dx_ref, 5e-6, "gelu dx n=" + std::to_string(n));
    const std::vector<uint16_t> xb = to_bf16(x), dyb = to_bf16(dy);
    std::vector<uint16_t> yb(n), yb_ref(n), dxb(n), dxb_ref(n);
    gelu_tanh_forward_bf16(xb.data(), yb.data(), n);
    gelu_tanh_forward_bf16_reference(xb.data(), yb_ref.data(), n);
    expect_close(yb, yb_ref, 1e-6, "gelu bf16 y");
    gelu_tanh_backward_bf16(dyb.data(), xb.data(), dxb.data(), n);
    gelu_tanh_backward_bf16_reference(dyb.data(), xb.data(), dxb_ref.data(), n);
    expect_close(dxb, dxb_ref, 1e-6, "gelu bf16 dx");
  }
}

namespace {

// One block of causal softmax rows through the fast kernels and the double references, in T (float
// or bf16): forward, recompute from the lse, backward.
template <class T>
void check_causal_block(const CausalBlock& b, const std::vector<float>& scores, const std::vector<float>& grads,
                        double rel, const std::string& what) {
  std::vector<T> s(scores.size()), dp(grads.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if constexpr (sizeof(T) == 2)
      s[i] = float_to_bf16(scores[i]), dp[i] = float_to_bf16(grads[i]);
    else
      s[i] = scores[i], dp[i] = grads[i];
  }
  std::vector<T> s_ref = s, dp_ref = dp, again = s;
  std::vector<float> lse(static_cast<size_t>(b.rows)), lse_ref(lse.size());
  if constexpr (sizeof(T) == 2) {
    causal_softmax_forward_bf16(s.data(), lse.data(), b);
    causal_softmax_forward_bf16_reference(s_ref.data(), lse_ref.data(), b);
    causal_softmax_recompute_bf16(again.data(), lse_ref.data(), b);
  } else {
    causal_softmax_forward_f32(s.data(), lse.data(), b);
    causal_softmax_forward_f32_reference(s_ref.data(), lse_ref.data(), b);
    causal_softmax_recompute_f32(again.data(), lse_ref.data(), b);
  }
  expect_close(s, s_ref, rel, what + " probabilities");
  expect_close(lse, lse_ref, 1e-6, what + " lse");
  expect_close(again, s_ref, rel, what + " recomputed");
  for (int64_t r = 0; r < b.rows; ++r) {  // each row a distribution over exactly the keys it may see
    double sum = 0;
    for (int64_t j = 0; j < b.cols; ++j) {
      const double p = widen_value(s_ref[static_cast<size_t>(r * b.cols + j)]);
      if (j >= b.first_pos + r % b.block_rows + 1) {
        ASSERT_EQ(p, 0.0) << what << " row " << r << " key " << j;
      }
      sum += p;
    }
    ASSERT_NEAR(sum, 1.0, sizeof(T) == 2 ? 2e-2 : 1e-5) << what << " row " << r;
  }
  if constexpr (sizeof(T) == 2) {
    causal_softmax_backward_bf16(s_ref.data(), dp.data(), b);
    causal_softmax_backward_bf16_reference(s_ref.data(), dp_ref.data(), b);
  } else {
    causal_softmax_backward_f32(s_ref.data(), dp.data(), b);
    causal_softmax_backward_f32_reference(s_ref.data(), dp_ref.data(), b);
  }
  expect_close(dp, dp_ref, rel, what + " score gradients");
}

}  // namespace

TEST(CausalSoftmaxKernel, ForwardRecomputeAndBackwardMatchTheDoubleReference) {
  struct Case {
    int64_t heads, block_rows, first_pos;
  };
  // One row, a block at the start, blocks further down, a row longer than one 1024-key run of the sum.
  for (const Case c : {Case{1, 1, 0}, Case{3, 5, 0}, Case{2, 17, 40}, Case{4, 3, 13}, Case{1, 2, 1500}}) {
    CausalBlock b;
    b.block_rows = c.block_rows;
    b.first_pos = c.first_pos;
    b.cols = c.first_pos + c.block_rows;
    b.rows = c.heads * c.block_rows;
    b.scale = 0.125f;
    const std::string what = "heads " + std::to_string(c.heads) + " rows " + std::to_string(c.block_rows) + " from " +
                             std::to_string(c.first_pos);
    std::vector<float> scores = normal_values(b.rows * b.cols, 16.0f, static_cast<uint32_t>(b.cols));
    const std::vector<float> grads = normal_values(b.rows * b.cols, 1.0f, 5);
    scores[0] = 400.0f;  // one dominant score: the shift by the row's maximum matters
    check_causal_block<float>(b, scores, grads, 1e-5, what + " fp32");
    check_causal_block<uint16_t>(b, scores, grads, 1e-6, what + " bf16");
  }
}

namespace {

// (B, T, heads, D) storage seen as the kernels' (B, NKV, G, T, D) heads, starting at head `first`.
template <class T>
HeadViewOf<T> heads_in(std::vector<T>& x, const AttentionShape& s, int64_t heads, int64_t first, int64_t group) {
  HeadViewOf<T> h;
  h.data = x.data() + first * s.D;
  h.batch = s.T * heads * s.D;
  h.kv_head = group * s.D;
  h.group_head = s.D;
  h.row = heads * s.D;
  return h;
}

// One shape of the attention kernels' tests, and its inputs: q, k, v packed in one (B, T, NH + 2 NKV,
// D) tensor as GPT-2's c_attn writes them, q larger than k so some rows' softmax is dominated by one key.
struct AttentionCase {
  int64_t B, NKV, G, T, D;
  int64_t heads() const { return NKV * G; }
  int64_t packed_heads() const { return heads() + 2 * NKV; }
  int64_t positions() const { return B * T; }
  AttentionShape shape() const {
    AttentionShape s;
    s.B = B, s.NKV = NKV, s.G = G, s.T = T, s.D = D;
    s.scale = static_cast<float>(1.0 / std::sqrt(double(D)));
    return s;
  }
  std::string name() const {
    return "B " + std::to_string(B) + " NKV " + std::to_string(NKV) + " G " + std::to_string(G) + " T " + std::to_string(T) +
           " D " + std::to_string(D);
  }
  std::vector<float> packed_qkv() const {
    std::vector<float> qkv = normal_values(positions() * packed_heads() * D, 1.0f, static_cast<uint32_t>(T * 7 + D));
    for (size_t i = 0; i < qkv.size(); i += static_cast<size_t>(packed_heads() * D))
      for (int64_t d = 0; d < heads() * D; ++d) qkv[i + d] *= 3.0f;
    return qkv;
  }
};

}  // namespace

TEST(CausalAttentionTiles, ForwardAndBackwardMatchTheDoubleReferenceThroughStrides) {
  if (!causal_attention_tiles_available()) GTEST_SKIP() << "the tiled attention needs AVX-512";
  // One position; part tiles of queries and keys; whole tiles; grouped heads; head sizes off the
  // 16-lane vectors and past one 64-column panel.
  for (const AttentionCase c : {AttentionCase{1, 1, 1, 1, 1}, AttentionCase{2, 2, 3, 65, 24}, AttentionCase{1, 1, 1, 128, 64},
                                AttentionCase{2, 1, 2, 200, 80}, AttentionCase{1, 2, 1, 64, 16}, AttentionCase{1, 1, 1, 131, 100}}) {
    const AttentionShape s = c.shape();
    const int64_t NH = c.heads(), all = c.packed_heads(), n = c.positions() * c.D;
    const std::string what = c.name();
    std::vector<float> qkv = c.packed_qkv();
    std::vector<float> dy = normal_values(n * NH, 1.0f, 11);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> y(n * NH, nan), y_ref(y.size(), nan), lse(static_cast<size_t>(c.B * NH * c.T), nan), lse_ref(lse.size(), nan);
    std::vector<float> dqkv(qkv.size(), nan), dqkv_ref(qkv.size(), nan);
    const HeadView q = heads_in(qkv, s, all, 0, c.G), k = heads_in(qkv, s, all, NH, 1), v = heads_in(qkv, s, all, NH + c.NKV, 1);
    const HeadView yv = heads_in(y, s, NH, 0, c.G), yv_ref = heads_in(y_ref, s, NH, 0, c.G), dyv = heads_in(dy, s, NH, 0, c.G);
    causal_attention_forward_f32(s, q, k, v, yv, lse.data());
    causal_attention_forward_f32_reference(s, q, k, v, yv_ref, lse_ref.data());
    expect_close(y, y_ref, 2e-6, what + " y");
    expect_close(lse, lse_ref, 1e-6, what + " lse");
    causal_attention_backward_f32(s, q, k, v, yv, lse.data(), dyv, heads_in(dqkv, s, all, 0, c.G), heads_in(dqkv, s, all, NH, 1),
                                  heads_in(dqkv, s, all, NH + c.NKV, 1));
    causal_attention_backward_f32_reference(s, q, k, v, yv_ref, lse_ref.data(), dyv, heads_in(dqkv_ref, s, all, 0, c.G),
                                            heads_in(dqkv_ref, s, all, NH, 1), heads_in(dqkv_ref, s, all, NH + c.NKV, 1));
    expect_close(dqkv, dqkv_ref, 1e-5, what + " dq dk dv");
  }
}

TEST(CausalAttentionTiles, TheFirstQueryCopiesTheFirstValueAndAFutureKeyChangesNothing) {
  AttentionShape s;
  s.B = 1, s.NKV = 1, s.G = 1, s.T = 70, s.D = 8;
  s.scale = 0.5f;
  std::vector<float> q = normal_values(s.T * s.D, 1.0f, 3), k = normal_values(s.T * s.D, 1.0f, 4), v = normal_values(s.T * s.D, 1.0f, 5);
  std::vector<float> y(q.size()), y2(q.size()), lse(static_cast<size_t>(s.T)), lse2(lse.size());
  auto view = [&](std::vector<float>& x) { return heads_in(x, s, 1, 0, 1); };
  causal_attention_forward_f32(s, view(q), view(k), view(v), view(y), lse.data());
  for (int64_t d = 0; d < s.D; ++d) EXPECT_FLOAT_EQ(y[d], v[d]) << "query 0 sees key 0 alone";
  for (int64_t d = 0; d < s.D; ++d) k[(s.T - 1) * s.D + d] += 100.0f, v[(s.T - 1) * s.D + d] = 1e6f;  // the last key
  causal_attention_forward_f32(s, view(q), view(k), view(v), view(y2), lse2.data());
  for (int64_t i = 0; i < (s.T - 1) * s.D; ++i) ASSERT_EQ(y[i], y2[i]) << "position " << i / s.D << " saw a later key";
}

namespace {

std::vector<float> widened(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = bf16_to_float(b[i]);
  return f;
}

// max |got - want| / max |want|
double max_relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  double scale = 0, error = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    scale = std::max(scale, std::fabs(double(want[i])));
    error = std::max(error, std::fabs(double(got[i]) - want[i]));
  }
  return error / scale;
}

}  // namespace

// bf16 against the double reference run on the same bf16 inputs: what differs is the rounding of the
// probabilities and the scores' gradient to bf16 before their products, and of the outputs. Every kind
// of product this CPU runs (an AMX CPU runs the AVX512-BF16 ones too).
TEST(CausalAttentionTilesBf16, ForwardAndBackwardMatchTheDoubleReferenceOnTheSameInputs) {
  const Bf16Products best = attention_tiles_bf16_products();
  if (best == Bf16Products::none) GTEST_SKIP() << "the bf16 attention tiles need AVX512-BF16 or AMX-BF16";
  std::vector<Bf16Products> kinds{Bf16Products::avx512_bf16};
  if (best == Bf16Products::amx) kinds.push_back(Bf16Products::amx);
  // One position; part tiles; whole tiles; grouped heads; head sizes off AMX's 32-element step.
  for (const Bf16Products how : kinds)
  for (const AttentionCase c : {AttentionCase{1, 1, 1, 1, 1}, AttentionCase{2, 2, 3, 65, 24}, AttentionCase{1, 1, 1, 128, 64},
                                AttentionCase{2, 1, 2, 200, 80}, AttentionCase{1, 2, 1, 64, 16}, AttentionCase{1, 1, 1, 131, 100},
                                AttentionCase{1, 2, 2, 300, 64}}) {
    const AttentionShape s = c.shape();
    const int64_t NH = c.heads(), all = c.packed_heads(), n = c.positions() * c.D;
    const std::string what = std::string(bf16_products_name(how)) + " " + c.name();
    const std::vector<float> qkv_f = c.packed_qkv();
    std::vector<uint16_t> qkv = to_bf16(qkv_f), dy = to_bf16(normal_values(n * NH, 1.0f, 11));
    std::vector<float> qkv_ref = widened(qkv), dy_ref = widened(dy);  // the reference sees the same values
    const uint16_t nan16 = 0x7fc0;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::vector<uint16_t> y(n * NH, nan16), dqkv(qkv.size(), nan16);
    std::vector<float> y_ref(y.size(), nan), lse(static_cast<size_t>(c.B * NH * c.T), nan), lse_ref(lse.size(), nan);
    std::vector<float> dqkv_ref(qkv.size(), nan);
    causal_attention_forward_bf16(s, heads_in(qkv, s, all, 0, c.G), heads_in(qkv, s, all, NH, 1),
                                  heads_in(qkv, s, all, NH + c.NKV, 1), heads_in(y, s, NH, 0, c.G), lse.data(), how);
    causal_attention_forward_f32_reference(s, heads_in(qkv_ref, s, all, 0, c.G), heads_in(qkv_ref, s, all, NH, 1),
                                           heads_in(qkv_ref, s, all, NH + c.NKV, 1), heads_in(y_ref, s, NH, 0, c.G),
                                           lse_ref.data());
    // p rounded to bf16 (2^-9 relative) before p v, then y rounded: 0.2-0.3% of the largest output seen.
    EXPECT_LT(max_relative_error(widened(y), y_ref), 6e-3) << what << " y";
    expect_close(lse, lse_ref, 2e-6, what + " lse");  // the scores are exact products summed in fp32
    causal_attention_backward_bf16(s, heads_in(qkv, s, all, 0, c.G), heads_in(qkv, s, all, NH, 1),
                                   heads_in(qkv, s, all, NH + c.NKV, 1), heads_in(y, s, NH, 0, c.G), lse.data(),
                                   heads_in(dy, s, NH, 0, c.G), heads_in(dqkv, s, all, 0, c.G), heads_in(dqkv, s, all, NH, 1),
                                   heads_in(dqkv, s, all, NH + c.NKV, 1), how);
    causal_attention_backward_f32_reference(s, heads_in(qkv_ref, s, all, 0, c.G), heads_in(qkv_ref, s, all, NH, 1),
                                            heads_in(qkv_ref, s, all, NH + c.NKV, 1), heads_in(y_ref, s, NH, 0, c.G),
                                            lse_ref.data(), heads_in(dy_ref, s, NH, 0, c.G),
                                            heads_in(dqkv_ref, s, all, 0, c.G), heads_in(dqkv_ref, s, all, NH, 1),
                                            heads_in(dqkv_ref, s, all, NH + c.NKV, 1));
    const std::vector<float> dqkv_got = widened(dqkv);
    // Per part (dq, dk, dv have different scales): each within 1% of its largest element (0.2-0.5% seen).
    for (const auto& [part, first, heads] : {std::tuple<const char*, int64_t, int64_t>{"dq", 0, NH}, {"dk", NH, c.NKV},
                                             {"dv", NH + c.NKV, c.NKV}}) {
      std::vector<float> got, want;
      for (int64_t row = 0; row < c.B * c.T; ++row)
        for (int64_t e = first * c.D; e < (first + heads) * c.D; ++e) {
          got.push_back(dqkv_got[static_cast<size_t>(row * all * c.D + e)]);
          want.push_back(dqkv_ref[static_cast<size_t>(row * all * c.D + e)]);
        }
      if (c.T == 1 && part[1] != 'v') continue;  // one key: the scores get no gradient (both ~0)
      EXPECT_LT(max_relative_error(got, want), 1e-2) << what << " " << part;
    }
  }
}

TEST(EmbeddingKernel, AddsEachIdsRowsOnceAndLeavesOtherRowsAlone) {
  const int64_t vocab = 50;
  for (int64_t width : {1, 17, 768}) {
    for (int64_t n : {1, 7, 600}) {
      const std::string what = "width " + std::to_string(width) + " n " + std::to_string(n);
      std::mt19937 rng(static_cast<uint32_t>(width * 1000 + n));
      std::vector<int64_t> ids(static_cast<size_t>(n));
      for (auto& id : ids) id = static_cast<int64_t>(rng() % 20) * 2;  // even ids only, many repeats
      const std::vector<float> table = normal_values(vocab * width, 1.0f, 3), dy = normal_values(n * width, 1.0f, 4);
      std::vector<float> g = table, g_ref = table;
      embedding_backward_f32(g.data(), ids.data(), dy.data(), n, width);
      embedding_backward_f32_reference(g_ref.data(), ids.data(), dy.data(), n, width);
      expect_close(g, g_ref, 1e-6, what + " fp32");
      // Independently: row r gains the sum of dy over the positions holding r; odd rows never change.
      for (int64_t r = 0; r < vocab; ++r) {
        for (int64_t c = 0; c < width; c += std::max<int64_t>(1, width / 5)) {
          double want = table[static_cast<size_t>(r * width + c)];
          for (int64_t i = 0; i < n; ++i)
            if (ids[static_cast<size_t>(i)] == r) want += dy[static_cast<size_t>(i * width + c)];
          if (r % 2) {
            ASSERT_EQ(g[static_cast<size_t>(r * width + c)], table[static_cast<size_t>(r * width + c)]) << what;
          }
          ASSERT_NEAR(g[static_cast<size_t>(r * width + c)], want, 1e-4) << what << " row " << r;
        }
      }
      const std::vector<uint16_t> tb = to_bf16(table), dyb = to_bf16(dy);
      std::vector<uint16_t> gb = tb, gb_ref = tb;
      embedding_backward_bf16(gb.data(), ids.data(), dyb.data(), n, width);
      embedding_backward_bf16_reference(gb_ref.data(), ids.data(), dyb.data(), n, width);
      expect_close(gb, gb_ref, 1e-6, what + " bf16");
    }
  }
}

TEST(RopeKernel, MatchesTheDoubleReferenceAndTheInverseUndoesIt) {
  const int64_t B = 2, T = 5, heads = 3;
  for (int64_t D : {2, 34, 64}) {
    const std::string what = "D " + std::to_string(D);
    const int64_t half = D / 2, n = B * T * heads * D;
    std::vector<float> cos(static_cast<size_t>(T * half)), sin(cos.size());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < half; ++j) {
        const double angle = static_cast<double>(t) * std::pow(10000.0, -2.0 * static_cast<double>(j) / static_cast<double>(D));
        cos[static_cast<size_t>(t * half + j)] = static_cast<float>(std::cos(angle));
        sin[static_cast<size_t>(t * half + j)] = static_cast<float>(std::sin(angle));
      }
    const std::vector<float> x = normal_values(n, 1.0f, static_cast<uint32_t>(D));
    const RopeShape fwd{B * T, T, heads, D, false}, inv{B * T, T, heads, D, true};
    std::vector<float> y(x.size()), y_ref(x.size()), back(x.size());
    rope_f32(x.data(), y.data(), cos.data(), sin.data(), fwd);
    rope_f32_reference(x.data(), y_ref.data(), cos.data(), sin.data(), fwd);
    expect_close(y, y_ref, 1e-6, what + " fp32");
    rope_f32(y.data(), back.data(), cos.data(), sin.data(), inv);
    expect_close(back, x, 1e-6, what + " inverse");  // a rotation and its transpose
    for (int64_t b = 0; b < B; ++b)  // position 0 is not rotated
      for (int64_t i = 0; i < heads * D; ++i) {
        const size_t at = static_cast<size_t>(b * T * heads * D + i);
        ASSERT_EQ(y[at], x[at]) << what;
      }
    // In place, as the op may use it.
    std::vector<float> inplace = x;
    rope_f32(inplace.data(), inplace.data(), cos.data(), sin.data(), fwd);
    expect_close(inplace, y_ref, 1e-6, what + " in place");
    const std::vector<uint16_t> xb = to_bf16(x);
    std::vector<uint16_t> yb(x.size()), yb_ref(x.size());
    rope_bf16(xb.data(), yb.data(), cos.data(), sin.data(), inv);
    rope_bf16_reference(xb.data(), yb_ref.data(), cos.data(), sin.data(), inv);
    expect_close(yb, yb_ref, 1e-6, what + " bf16 inverse");
  }
}
