// The model's fused operations against the plain LibTorch ops they replace, forward and backward, in
// fp32, bf16 and fp16, at awkward sizes and split into chunks.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "engine/runtime/device/block_pool.hpp"
#include "engine/runtime/device/gemm_peak.hpp"
#include "engine/runtime/device/kernel_route.hpp"
#include "engine/runtime/model/fused_attention.hpp"
#include "engine/runtime/model/fused_head_loss.hpp"
#include "engine/runtime/model/fused_ops.hpp"
#include "engine/runtime/model/matmul.hpp"
#include "kernels/cpu/simd.hpp"

using namespace ds;

namespace {

struct HeadResult {
  double loss;
  torch::Tensor dx, dw;
};

// The head as it was before it was fused: logits in the model's dtype, cross-entropy in fp32. The products in fp32,
// each rounded once as oneDNN's are (LibTorch 1.13's own bf16 product accumulates in bf16 on a CPU without AVX-512).
HeadResult reference_head(const torch::Tensor& x0, const torch::Tensor& w0, const torch::Tensor& t, double grad) {
  torch::Tensor x = x0.to(torch::kFloat32).clone().requires_grad_(true), w = w0.to(torch::kFloat32).clone().requires_grad_(true);
  torch::Tensor loss = torch::cross_entropy_loss(torch::mm(x, w.t()).to(x0.scalar_type()).to(torch::kFloat32), t);
  (loss * grad).backward();
  return {loss.item<double>(), x.grad(), w.grad()};
}

HeadResult fused_head(const torch::Tensor& x0, const torch::Tensor& w0, const torch::Tensor& t, double expected,
                      double grad, int64_t chunk) {
  torch::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
  torch::Tensor loss = fused_head_loss(x, w, t, expected, chunk);
  EXPECT_EQ(loss.scalar_type(), torch::kFloat32);
  (loss * grad).backward();
  return {loss.item<double>(), x.grad(), w.grad()};
}

bool mm_runs_in(torch::ScalarType dtype) {
  try {
    torch::mm(torch::ones({2, 2}, dtype), torch::ones({2, 2}, dtype));
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

// Largest difference relative to the reference's largest magnitude.
double relative_error(const torch::Tensor& got, const torch::Tensor& want) {
  const torch::Tensor g = got.to(torch::kFloat64), w = want.to(torch::kFloat64);
  return (g - w).abs().max().item<double>() / w.abs().max().item<double>();
}

}  // namespace

TEST(FusedHeadLoss, MatchesLogitsThenCrossEntropyForwardAndBackward) {
  torch::manual_seed(3);
  const int64_t N = 10, C = 24, V = 1001;
  const torch::Tensor t = torch::randint(0, V, {N}, torch::kLong);
  for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    if (!mm_runs_in(dtype)) continue;  // fp16 matmuls: not on LibTorch 1.13's CPU (ds widens fp16 there)
    // fp16 gets the size of gradient it sees under loss scaling; the others a plain mean's.
    const double grad = dtype == torch::kFloat16 ? 4096.0 : 1.0 / 3;
    const torch::Tensor x = torch::randn({N, C}).to(dtype), w = (torch::randn({V, C}) * 0.5).to(dtype);
    const HeadResult want = reference_head(x, w, t, grad);
    const double tol = dtype == torch::kFloat32 ? 1e-5 : 2e-2;
    // One chunk; chunks of 3 rows (the last one short); one row at a time.
    for (int64_t chunk : {kHeadChunkElements, 3 * V, V}) {
      const HeadResult got = fused_head(x, w, t, grad, grad, chunk);
      EXPECT_NEAR(got.loss, want.loss, 1e-5 * want.loss) << dtype << " chunk " << chunk;
      EXPECT_EQ(got.dx.scalar_type(), dtype);
      EXPECT_EQ(got.dw.scalar_type(), dtype);
      EXPECT_LT(relative_error(got.dx, want.dx), tol) << dtype << " chunk " << chunk;
      EXPECT_LT(relative_error(got.dw, want.dw), tol) << dtype << " chunk " << chunk;
    }
    // A loss that receives another gradient than the expected one still gets the right gradients.
    const HeadResult rescaled = fused_head(x, w, t, grad * 8, grad, 3 * V);
    EXPECT_LT(relative_error(rescaled.dx, want.dx), tol) << dtype;
    EXPECT_LT(relative_error(rescaled.dw, want.dw), tol) << dtype;
  }
}

TEST(FusedHeadLoss, TheWeightGradientGoesIntoItsBoundBufferDuringForward) {
  // As ds trains: the weight's .grad is a view of the flat gradients, holding earlier micro batches'.
  torch::manual_seed(6);
  const int64_t N = 10, C = 24, V = 1001;
  const torch::Tensor t = torch::randint(0, V, {N}, torch::kLong);
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    const torch::Tensor x0 = torch::randn({N, C}).to(dtype), w0 = (torch::randn({V, C}) * 0.5).to(dtype);
    const HeadResult want = reference_head(x0, w0, t, 0.5);
    // An earlier micro batch's gradient of the same size (in bf16 a larger one would swamp dW's bits).
    const torch::Tensor start = (torch::randn({V, C}) * want.dw.abs().max().item<double>()).to(dtype);
    torch::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true), buffer = start.clone();
    w.mutable_grad() = buffer;
    torch::Tensor loss = fused_head_loss(x, w, t, 0.5, 3 * V);  // chunks of 3 rows
    EXPECT_FALSE(torch::equal(buffer, start)) << dtype << ": added during forward, where the logits' gradient exists";
    (loss * 0.5).backward();
    const double tol = dtype == torch::kFloat32 ? 1e-5 : 2e-2;
    EXPECT_EQ(w.grad().data_ptr(), buffer.data_ptr()) << dtype;
    EXPECT_LT(relative_error(buffer.to(torch::kFloat32) - start.to(torch::kFloat32), want.dw), tol) << dtype;
    EXPECT_LT(relative_error(x.grad(), want.dx), tol) << dtype;
    // Another gradient than the expected one cannot rescale what is already in the buffer: refused.
    torch::Tensor w2 = w0.clone().requires_grad_(true);
    w2.mutable_grad() = start.clone();
    torch::Tensor loss2 = fused_head_loss(x0.clone().requires_grad_(true), w2, t, 0.5, 3 * V);
    EXPECT_THROW(loss2.backward(), std::exception) << dtype;
  }
}

TEST(FusedHeadLoss, WithoutGradientsItIsTheSameLossAndTouchesNothing) {
  torch::manual_seed(4);
  const int64_t N = 7, C = 16, V = 333;
  const torch::Tensor x = torch::randn({N, C}).to(torch::kBFloat16), w = torch::randn({V, C}).to(torch::kBFloat16);
  const torch::Tensor t = torch::randint(0, V, {N}, torch::kLong);
  const double want = torch::cross_entropy_loss(torch::mm(x, w.t()).to(torch::kFloat32), t).item<double>();
  torch::NoGradGuard no_grad;
  const torch::Tensor x_before = x.clone(), w_before = w.clone();
  for (int64_t chunk : {kHeadChunkElements, 2 * V})
    EXPECT_NEAR(fused_head_loss(x, w, t, 1.0, chunk).item<double>(), want, 1e-5 * want);
  EXPECT_TRUE(torch::equal(x, x_before));
  EXPECT_TRUE(torch::equal(w, w_before));
}

TEST(FusedHeadLoss, AFrozenWeightGetsNoGradientMadeOrHeld) {
  // LoRA freezes the head: its forward makes x's gradient only, so nothing V x C is held until backward, and
  // x's gradient is the one the trained head gives.
  const BlockPool& pool = route_large_tensors_to_pool();
  torch::manual_seed(5);
  const int64_t N = 64, C = 256, V = 4096;  // W: 4 MiB in fp32, x and its gradient 64 KiB each
  const torch::Tensor x = torch::randn({N, C}).requires_grad_(true), w = torch::randn({V, C}) * 0.05;
  const torch::Tensor t = torch::randint(0, V, {N}, torch::kLong);
  const double before = static_cast<double>(pool.stats().live_bytes);
  torch::Tensor loss = fused_head_loss(x, w, t, 1.0, kHeadChunkElements);
  EXPECT_LT(static_cast<double>(pool.stats().live_bytes) - before, 0.5 * V * C * 4) << "W's gradient held until backward";
  loss.backward();
  const torch::Tensor frozen_dx = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  const torch::Tensor trained_w = w.clone().requires_grad_(true);
  fused_head_loss(x, trained_w, t, 1.0, kHeadChunkElements).backward();
  EXPECT_TRUE(torch::equal(frozen_dx, x.grad()));
  EXPECT_TRUE(trained_w.grad().defined());
}

TEST(FusedHeadLoss, AKeptChunkOfLogitsIsReusedAndGivesTheSameResults) {
  // A model keeps its chunk of logits from step to step (made anew each step it fragmented the heap).
  torch::manual_seed(7);
  const int64_t N = 10, C = 24, V = 1001;
  const torch::Tensor x0 = torch::randn({N, C}), w0 = torch::randn({V, C}) * 0.5;
  const torch::Tensor t = torch::randint(0, V, {N}, torch::kLong);
  const HeadResult want = fused_head(x0, w0, t, 1.0, 1.0, 4 * V);
  torch::Tensor kept;
  const void* first = nullptr;
  for (int step = 0; step < 3; ++step) {
    torch::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    torch::Tensor loss = fused_head_loss(x, w, t, 1.0, 4 * V, &kept);
    loss.backward();
    ASSERT_TRUE(kept.defined());
    EXPECT_EQ(kept.numel(), 4 * V) << "one chunk of 4 rows";
    if (step == 0) first = kept.data_ptr();
    EXPECT_EQ(kept.data_ptr(), first) << "step " << step << " made its chunk again";
    EXPECT_EQ(loss.item<double>(), want.loss);
    EXPECT_TRUE(torch::equal(x.grad(), want.dx) && torch::equal(w.grad(), want.dw)) << "step " << step;
  }
  // A smaller chunk (evaluation of a shorter batch) uses the same buffer; a larger one or bf16 replaces it.
  torch::NoGradGuard no_grad;
  fused_head_loss(x0.narrow(0, 0, 2), w0, t.narrow(0, 0, 2), 1.0, 4 * V, &kept);
  EXPECT_EQ(kept.data_ptr(), first);
  fused_head_loss(x0, w0, t, 1.0, 8 * V, &kept);
  EXPECT_EQ(kept.numel(), 8 * V);
  fused_head_loss(x0.to(torch::kBFloat16), w0.to(torch::kBFloat16), t, 1.0, 8 * V, &kept);
  EXPECT_EQ(kept.scalar_type(), torch::kBFloat16);
}

TEST(FusedHeadLoss, TiedWeightsCollectTheEmbeddingsGradientToo) {
  // GPT-2's head is its token embedding: the two gradients must add up in the one .grad.
  torch::manual_seed(5);
  const int64_t B = 2, T = 5, C = 8, V = 50;
  const torch::Tensor ids = torch::randint(0, V, {B, T}, torch::kLong), t = torch::randint(0, V, {B * T}, torch::kLong);
  const torch::Tensor w0 = torch::randn({V, C});
  torch::Tensor w = w0.clone().requires_grad_(true), w_ref = w0.clone().requires_grad_(true);
  fused_head_loss(torch::tanh(torch::embedding(w, ids)).view({B * T, C}), w, t, 1.0).backward();
  torch::cross_entropy_loss(torch::mm(torch::tanh(torch::embedding(w_ref, ids)).view({B * T, C}), w_ref.t()), t).backward();
  EXPECT_LT(relative_error(w.grad(), w_ref.grad()), 1e-5);
}

namespace {

// Gradients of sum(f(inputs) * probe) with respect to every input: the probe makes each output count.
std::vector<torch::Tensor> grads_of(const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& f,
                                    const std::vector<torch::Tensor>& inputs0, const torch::Tensor& probe,
                                    torch::Tensor* out) {
  std::vector<torch::Tensor> inputs;
  for (const auto& t : inputs0) inputs.push_back(t.clone().requires_grad_(true));
  *out = f(inputs);
  (*out * probe).sum().backward();
  std::vector<torch::Tensor> g;
  for (const auto& t : inputs) g.push_back(t.grad());
  return g;
}

// LibTorch's op, the reference, computed in fp32 from the same (rounded) inputs.
void expect_matches_reference(const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& ours,
                              const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& reference,
                              const std::vector<torch::Tensor>& inputs, const std::string& what) {
  const auto dtype = inputs[0].scalar_type();
  const double tol = dtype == torch::kFloat32 ? 1e-5 : 1e-2;
  const torch::Tensor probe = torch::randn(inputs[0].sizes()).to(dtype);
  std::vector<torch::Tensor> wide;
  for (const auto& t : inputs) wide.push_back(t.to(torch::kFloat32));
  torch::Tensor y, y_ref;
  const auto g = grads_of(ours, inputs, probe, &y);
  const auto g_ref = grads_of(reference, wide, probe.to(torch::kFloat32), &y_ref);
  EXPECT_EQ(y.scalar_type(), dtype) << what;
  EXPECT_LT(relative_error(y, y_ref), tol) << what << " output";
  for (size_t i = 0; i < g.size(); ++i) {
    ASSERT_TRUE(g[i].defined()) << what << " input " << i;
    EXPECT_EQ(g[i].scalar_type(), dtype) << what;
    EXPECT_LT(relative_error(g[i], g_ref[i]), tol) << what << " gradient of input " << i;
  }
}

}  // namespace

TEST(FusedOps, NormsGeluSwiGluAndRotaryMatchLibTorchForwardAndBackward) {
  torch::manual_seed(6);
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (int64_t C : {7, 48, 100}) {
      const std::string what = std::string(dtype == torch::kFloat32 ? "fp32" : "bf16") + " C=" + std::to_string(C);
      const torch::Tensor x = (torch::randn({2, 5, C}) * 2 + 0.5).to(dtype);
      const torch::Tensor w = (torch::randn({C}) * 0.5 + 1).to(dtype), b = torch::randn({C}).to(dtype);
      expect_matches_reference([](const auto& in) { return layer_norm(in[0], in[1], in[2], 1e-5); },
                               [C](const auto& in) { return torch::layer_norm(in[0], {C}, in[1], in[2], 1e-5); }, {x, w, b},
                               "layer_norm " + what);
      expect_matches_reference([](const auto& in) { return rms_norm(in[0], in[1], 1e-6); },
                               [](const auto& in) { return in[1] * in[0] * torch::rsqrt(in[0].pow(2).mean(-1, true) + 1e-6); },
                               {x, w}, "rms_norm " + what);
      expect_matches_reference([](const auto& in) { return gelu_tanh(in[0]); },
                               [](const auto& in) { return torch::gelu(in[0], "tanh"); }, {x * 3}, "gelu " + what);
      const int64_t T = 5, D = 2 * (C / 2);  // x as (2, T, heads 1, D)
      const torch::Tensor angles = torch::outer(torch::arange(T, torch::kFloat32), torch::rand({D / 2}));
      const torch::Tensor cos = angles.cos(), sin = angles.sin();
      expect_matches_reference([&](const auto& in) { return rotary(in[0], cos, sin); },
                               [&](const auto& in) {  // Hugging Face's rotate_half form, in fp32
                                 const torch::Tensor& v = in[0];
                                 const torch::Tensor c = torch::cat({cos, cos}, -1).view({T, 1, D}), s = torch::cat({sin, sin}, -1).view({T, 1, D});
                                 return v * c + torch::cat({-v.narrow(-1, D / 2, D / 2), v.narrow(-1, 0, D / 2)}, -1) * s;
                               },
                               {x.narrow(-1, 0, D).reshape({2, T, 1, D}) * 3}, "rotary " + what);
      expect_matches_reference([](const auto& in) { return swiglu(in[0], in[1]); },
                               [](const auto& in) { return torch::silu(in[0]) * in[1]; }, {x * 3, x.flip(-1)}, "swiglu " + what);
    }
  }
}

namespace {

struct AttentionResult {
  torch::Tensor y, dq, dk, dv;
};

// y = attention(q, k, v) and the gradients of sum(y * probe).
AttentionResult run_attention(const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>& f,
                              const torch::Tensor& q0, const torch::Tensor& k0, const torch::Tensor& v0, const torch::Tensor& probe) {
  torch::Tensor q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true), v = v0.clone().requires_grad_(true);
  torch::Tensor y = f(q, k, v);
  (y * probe).sum().backward();
  return {y, q.grad(), k.grad(), v.grad()};
}

}  // namespace

// A residual add and the norm after it as one op give what the add and the norm apart give, bit for bit: the sum,
// the normalised output, and the gradients of both addends, the weight and the bias; with the sum read again (a
// pre-norm block's residual stream) or only through the norm. And a norm with the stream passed on beside it (a
// block's first) gives the norm apart's output and gradients, the stream's two gradients added as autograd adds them.
TEST(FusedOps, AResidualAddWithItsNormEqualsTheAddAndTheNormApartBitForBit) {
  torch::manual_seed(14);
  const int64_t B = 3, T = 5, C = 40;
  enum Mode { add_read_again, add_read_by_norm, beside };
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (bool rms : {false, true}) {
      for (Mode mode : {add_read_again, add_read_by_norm, beside}) {
        const std::string what = std::string(dtype == torch::kFloat32 ? "fp32" : "bf16") + (rms ? " RMSNorm" : " LayerNorm") +
                                 (mode == add_read_again     ? ", the sum read again"
                                  : mode == add_read_by_norm ? ", the sum read by the norm only"
                                                             : ", the stream beside the norm");
        const torch::Tensor x0 = torch::randn({B, T, C}).to(dtype), r0 = torch::randn({B, T, C}).to(dtype);
        const torch::Tensor w0 = (torch::randn({C}) + 1).to(dtype), b0 = torch::randn({C}).to(dtype);
        const torch::Tensor p_sum = torch::randn({B, T, C}).to(dtype), p_y = torch::randn({B, T, C}).to(dtype);
        struct Result {
          torch::Tensor sum, y, dx, dr, dw, db;
        };
        const auto run = [&](bool fused) {
          torch::Tensor x = x0.clone().requires_grad_(true), r = r0.clone().requires_grad_(true);
          torch::Tensor w = w0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
          torch::Tensor sum, y;
          if (fused && mode == beside) {
            std::tie(sum, y) = rms ? rms_norm_beside(x, w, 1e-5) : layer_norm_beside(x, w, b, 1e-5);
          } else if (fused) {
            std::tie(sum, y) = rms ? add_rms_norm(x, r, w, 1e-5) : add_layer_norm(x, r, w, b, 1e-5);
          } else {
            sum = mode == beside ? x : x + r;
            y = rms ? rms_norm(sum, w, 1e-5) : layer_norm(sum, w, b, 1e-5);
          }
          torch::Tensor loss = (y * p_y).sum();
          if (mode != add_read_by_norm) loss = loss + (sum * p_sum).sum();
          loss.backward();
          const torch::Tensor none = torch::zeros({1});
          return Result{sum.detach(), y.detach(), x.grad(), mode == beside ? none : r.grad(), w.grad(), rms ? none : b.grad()};
        };
        const Result apart = run(false), fused = run(true);
        EXPECT_TRUE(torch::equal(fused.sum, apart.sum)) << what << ": the sum";
        EXPECT_TRUE(torch::equal(fused.y, apart.y)) << what << ": the norm";
        EXPECT_TRUE(torch::equal(fused.dx, apart.dx)) << what << ": x's gradient";
        EXPECT_TRUE(torch::equal(fused.dr, apart.dr)) << what << ": r's gradient";
        EXPECT_TRUE(torch::equal(fused.dw, apart.dw)) << what << ": the weight's gradient";
        EXPECT_TRUE(torch::equal(fused.db, apart.db)) << what << ": the bias's gradient";
      }
    }
  }
}

// The stream beside its norm as the blocks meet it: a non-contiguous input, one that is not a leaf, and a forward
// run without grad mode first and again with it (a recomputed block): the norm apart's values and gradients.
TEST(FusedOps, TheStreamBesideItsNormTakesAnyInputTheBlocksGiveIt) {
  torch::manual_seed(15);
  const torch::Tensor x0 = torch::randn({4, 6, 24}).to(torch::kBFloat16), w0 = (torch::randn({24}) + 1).to(torch::kBFloat16);
  const torch::Tensor b0 = torch::randn({24}).to(torch::kBFloat16);
  const torch::Tensor p_sum = torch::randn({4, 6, 24}).to(torch::kBFloat16), p_y = torch::randn({4, 6, 24}).to(torch::kBFloat16);
  for (int form = 0; form < 3; ++form) {
    const char* what = form == 0 ? "non-contiguous" : form == 1 ? "not a leaf" : "run without grad mode first";
    const auto run = [&](bool fused) {
      torch::Tensor leaf = (form == 0 ? x0.transpose(0, 1).contiguous() : x0.clone()).requires_grad_(true);
      torch::Tensor x = form == 0 ? leaf.transpose(0, 1) : form == 1 ? leaf * 1 : leaf;
      torch::Tensor w = w0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
      if (form == 2 && fused) {
        torch::NoGradGuard no_grad;
        (void)layer_norm_beside(x, w, b, 1e-5);
      }
      torch::Tensor sum = x, y;
      if (fused)
        std::tie(sum, y) = layer_norm_beside(x, w, b, 1e-5);
      else
        y = layer_norm(x, w, b, 1e-5);
      ((y * p_y).sum() + (sum * p_sum).sum()).backward();
      return std::vector<torch::Tensor>{y.detach(), leaf.grad(), w.grad(), b.grad()};
    };
    const auto apart = run(false), fused = run(true);
    for (size_t k = 0; k < apart.size(); ++k) EXPECT_TRUE(torch::equal(fused[k], apart[k])) << what << ", result " << k;
  }
}

TEST(FusedAttention, MatchesTheMaterialisedAttentionForwardAndBackward) {
  torch::manual_seed(8);
  struct Case {
    int64_t heads, kv_heads, T, D, block_rows;
  };
  // Multi-head and grouped-query; one position, lengths that do not divide into the blocks, one row a block.
  for (const Case c : {Case{4, 4, 1, 8, 0}, Case{4, 4, 33, 8, 0}, Case{4, 4, 33, 8, 5}, Case{6, 2, 17, 12, 4},
                       Case{6, 3, 40, 16, 1}, Case{2, 1, 70, 7, 16}}) {
    for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
      const std::string what = std::string(dtype == torch::kFloat32 ? "fp32" : "bf16") + " NH " + std::to_string(c.heads) +
                               " NKV " + std::to_string(c.kv_heads) + " T " + std::to_string(c.T) + " rows " +
                               std::to_string(c.block_rows);
      const int64_t B = 2;
      const torch::Tensor q = (torch::randn({B, c.T, c.heads, c.D}) * 1.5).to(dtype);
      const torch::Tensor k = (torch::randn({B, c.T, c.kv_heads, c.D}) * 1.5).to(dtype);
      const torch::Tensor v = torch::randn({B, c.T, c.kv_heads, c.D}).to(dtype);
      const torch::Tensor probe = torch::randn({B, c.T, c.heads, c.D}).to(dtype);
      const int64_t rows = c.block_rows;
      const AttentionResult got = run_attention(
          [rows](const auto& q, const auto& k, const auto& v) { return causal_attention(q, k, v, rows); }, q, k, v, probe);
      // The reference in fp32 from the same rounded inputs.
      const AttentionResult want = run_attention([](const auto& q, const auto& k, const auto& v) { return causal_attention_materialised(q, k, v); },
                                                 q.to(torch::kFloat32), k.to(torch::kFloat32), v.to(torch::kFloat32),
                                                 probe.to(torch::kFloat32));
      // The path it replaces, in the same dtype: in bf16 it is held to that path's error (twice it: both
      // round the scores to bf16, so which one lands nearer the fp32 answer is chance).
      const AttentionResult plain = run_attention(
          [](const auto& q, const auto& k, const auto& v) { return causal_attention_materialised(q, k, v); }, q, k, v, probe);
      auto tol = [&](const torch::Tensor& plain_got, const torch::Tensor& reference) {
        return dtype == torch::kFloat32 ? 2e-5 : std::max(2e-2, 2 * relative_error(plain_got, reference));
      };
      ASSERT_EQ(got.y.sizes(), want.y.sizes()) << what;
      EXPECT_TRUE(got.y.is_contiguous()) << what;
      EXPECT_EQ(got.y.scalar_type(), dtype) << what;
      EXPECT_LT(relative_error(got.y, want.y), tol(plain.y, want.y)) << what << " output";
      EXPECT_LT(relative_error(got.dv, want.dv), tol(plain.dv, want.dv)) << what << " dv";
      EXPECT_EQ(got.dk.scalar_type(), dtype) << what;
      if (c.T == 1) {  // one key: the scores get no gradient
        EXPECT_LT(got.dq.abs().max().item<double>(), 1e-2 * want.dv.abs().max().item<double>()) << what;
        EXPECT_LT(got.dk.abs().max().item<double>(), 1e-2 * want.dv.abs().max().item<double>()) << what;
        continue;
      }
      EXPECT_LT(relative_error(got.dq, want.dq), tol(plain.dq, want.dq)) << what << " dq";
      EXPECT_LT(relative_error(got.dk, want.dk), tol(plain.dk, want.dk)) << what << " dk";
    }
  }
}

TEST(FusedAttention, PackedProjectionGivesTheSameOutputAndOneGradientOfItsShape) {
  // GPT-2 hands in its c_attn output viewed by head; evaluation runs without autograd.
  torch::manual_seed(9);
  const int64_t B = 3, T = 21, D = 8;
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (const auto& [NH, NKV] : {std::pair<int64_t, int64_t>{4, 4}, {6, 2}}) {
      for (int64_t rows : {6, 0}) {  // several blocks; one block
        const std::string what = std::string(dtype == torch::kFloat32 ? "fp32" : "bf16") + " NH " + std::to_string(NH) +
                                 " NKV " + std::to_string(NKV) + " rows " + std::to_string(rows);
        const torch::Tensor qkv = torch::randn({B, T, NH + 2 * NKV, D}).to(dtype), probe = torch::randn({B, T, NH, D}).to(dtype);
        // The reference: three separate (strided) inputs through the unpacked form, gradients joined.
        const auto [q, k, v] = unpack(qkv, NH);
        const AttentionResult want = run_attention(
            [rows](const auto& q, const auto& k, const auto& v) { return causal_attention(q, k, v, rows); }, q, k, v, probe);
        torch::Tensor packed = qkv.clone().requires_grad_(true);
        const torch::Tensor y = causal_attention_packed(packed, NH, rows);
        (y * probe).sum().backward();
        EXPECT_TRUE(y.is_contiguous()) << what;
        EXPECT_TRUE(torch::equal(y, want.y)) << what << " output";
        ASSERT_EQ(packed.grad().sizes(), qkv.sizes()) << what;
        EXPECT_TRUE(torch::equal(packed.grad(), torch::cat({want.dq, want.dk, want.dv}, 2))) << what << " gradient";
        torch::NoGradGuard no_grad;
        EXPECT_TRUE(torch::equal(causal_attention_packed(qkv, NH, rows), want.y)) << what << " without autograd";
      }
    }
  }
  EXPECT_THROW(causal_attention_packed(torch::zeros({1, 2, 5, 4}), 2), std::exception);  // 3 kv-part heads: not even
}

// The packed projection's parts taken apart for LibTorch's attention (a GPU's): one gradient of the
// packed shape, equal to what three narrows give, a part left unused contributing zeros.
TEST(FusedAttention, UnpackingWithOneGradientGivesTheNarrowsGradient) {
  torch::manual_seed(3);
  const int64_t NH = 4, NKV = 2;
  const torch::Tensor qkv0 = torch::randn({2, 5, NH + 2 * NKV, 8});
  const torch::Tensor a = torch::randn({2, 5, NH, 8}), b = torch::randn({2, 5, NKV, 8}), c = torch::randn({2, 5, NKV, 8});
  for (const bool use_v : {true, false}) {
    SCOPED_TRACE(use_v ? "q, k and v used" : "v unused");
    const torch::Tensor x1 = qkv0.clone().requires_grad_(true), x2 = qkv0.clone().requires_grad_(true);
    const auto [q1, k1, v1] = unpack(x1, NH);
    const auto [q2, k2, v2] = unpack_one_gradient(x2, NH);
    EXPECT_TRUE(torch::equal(q2, q1) && torch::equal(k2, k1) && torch::equal(v2, v1));
    torch::Tensor l1 = (q1 * a).sum() + (k1 * b).sum(), l2 = (q2 * a).sum() + (k2 * b).sum();
    if (use_v) l1 = l1 + (v1 * c).sum(), l2 = l2 + (v2 * c).sum();
    l1.backward();
    l2.backward();
    EXPECT_TRUE(torch::equal(x2.grad(), x1.grad()));
  }
}

TEST(FusedOps, ProjectionGradientsLandInTheParametersBuffersAsLibTorchComputesThem) {
  torch::manual_seed(12);
  const int64_t B = 3, T = 5, in = 24, out = 40;
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (bool in_out : {false, true}) {  // nn.Linear's (out, in); GPT-2's Conv1D (in, out)
      for (bool bias : {false, true}) {
        const std::string what = std::string(dtype == torch::kFloat32 ? "fp32" : "bf16") + (in_out ? " (in, out)" : " (out, in)") +
                                 (bias ? " with bias" : "");
        const torch::Tensor x0 = torch::randn({B, T, in}).to(dtype), probe = torch::randn({B, T, out}).to(dtype);
        const torch::Tensor w0 = (torch::randn(in_out ? std::vector<int64_t>{in, out} : std::vector<int64_t>{out, in}) * 0.2).to(dtype);
        const torch::Tensor b0 = torch::randn({out}).to(dtype);
        const torch::Tensor w_start = torch::randn(w0.sizes()).to(dtype), b_start = torch::randn({out}).to(dtype);
        // The reference in fp32: LibTorch's linear, its gradients added to what the buffers held.
        // (clones: in fp32 .to() would hand back x0 itself, and x0 must stay a plain tensor)
        torch::Tensor x_ref = x0.to(torch::kFloat32).clone().requires_grad_(true);
        torch::Tensor w_ref = w0.to(torch::kFloat32).clone().requires_grad_(true), b_ref = b0.to(torch::kFloat32).clone().requires_grad_(true);
        const torch::Tensor y_ref = torch::linear(x_ref, in_out ? w_ref.t() : w_ref, bias ? b_ref : torch::Tensor());
        (y_ref * probe.to(torch::kFloat32)).sum().backward();
        // ds: the gradients bound to buffers beforehand, as FlatParams does (holding an earlier micro batch's).
        torch::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
        torch::Tensor w_buffer = w_start.clone(), b_buffer = b_start.clone();
        w.mutable_grad() = w_buffer;
        b.mutable_grad() = b_buffer;
        const torch::Tensor y = projection(x, w, bias ? b : torch::Tensor(), in_out);
        ASSERT_EQ(y.sizes(), y_ref.sizes()) << what;
        (y * probe).sum().backward();
        const double tol = dtype == torch::kFloat32 ? 1e-6 : 1e-2;
        EXPECT_LT(relative_error(y, y_ref), tol) << what << " output";
        EXPECT_LT(relative_error(x.grad(), x_ref.grad()), tol) << what << " input gradient";
        EXPECT_EQ(w.grad().data_ptr(), w_buffer.data_ptr()) << what << ": the weight gradient stayed in its buffer";
        EXPECT_LT(relative_error(w_buffer, w_ref.grad() + w_start.to(torch::kFloat32)), tol) << what << " weight gradient";
        if (bias)
          EXPECT_LT(relative_error(b_buffer, b_ref.grad() + b_start.to(torch::kFloat32)), tol) << what << " bias gradient";
        else
          EXPECT_TRUE(torch::equal(b_buffer, b_start)) << what << ": no bias, its buffer untouched";
        // Without bound buffers: plain gradients, as LibTorch's.
        torch::Tensor w2 = w0.clone().requires_grad_(true);
        (projection(x0, w2, torch::Tensor(), in_out) * probe).sum().backward();
        torch::Tensor w2_ref = w0.to(torch::kFloat32).clone().requires_grad_(true);
        (torch::linear(x0.to(torch::kFloat32), in_out ? w2_ref.t() : w2_ref) * probe.to(torch::kFloat32)).sum().backward();
        EXPECT_LT(relative_error(w2.grad(), w2_ref.grad()), tol) << what << " unbound weight gradient";
      }
    }
  }
}

// LoRA's adapted projection as one node (a GPU's path) against LibTorch's ops in fp32: the output, x's gradient and
// the adapters' gradients, bound to buffers (added to what they held) or not, with LoRA's dropout before A or
// without; the frozen base gets none; an input that takes no gradient gets none made.
TEST(FusedOps, LoraProjectionEqualsTheComposedAdapterForwardAndBackward) {
  torch::manual_seed(13);
  const int64_t B = 2, T = 7, in = 24, out = 40, r = 4;
  const double scale = 2.5;
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (bool in_out : {false, true}) {
      for (bool bias : {false, true}) {
        for (int variant = 0; variant < 3; ++variant) {
          const bool bound = variant >= 1, drops = variant == 2;  // LoRA's dropout: A reads a masked x
          const std::string what = std::string(dtype == torch::kFloat32 ? "fp32" : "bf16") + (in_out ? " (in, out)" : " (out, in)") +
                                   (bias ? " with bias" : "") + (bound ? ", bound buffers" : ", unbound") + (drops ? ", dropout" : "");
          const torch::Tensor mask = drops ? ((torch::rand({B, T, in}) > 0.3).to(torch::kFloat32) / 0.7) : torch::ones({B, T, in});
          const torch::Tensor x0 = torch::randn({B, T, in}).to(dtype), probe = torch::randn({B, T, out}).to(dtype);
          const torch::Tensor w = (torch::randn(in_out ? std::vector<int64_t>{in, out} : std::vector<int64_t>{out, in}) * 0.2).to(dtype);
          const torch::Tensor b = torch::randn({out}).to(dtype);
          const torch::Tensor a0 = (torch::randn({r, in}) * 0.3).to(dtype), bm0 = (torch::randn({out, r}) * 0.3).to(dtype);
          // What the buffers held: small beside the gradients, so bf16's rounding of the sum stays a gradient's.
          const torch::Tensor a_start = (torch::randn({r, in}) * 0.1).to(dtype), bm_start = (torch::randn({out, r}) * 0.1).to(dtype);
          const auto f32 = [](const torch::Tensor& t) { return t.to(torch::kFloat32).clone(); };
          torch::Tensor x_ref = f32(x0).requires_grad_(true), a_ref = f32(a0).requires_grad_(true), bm_ref = f32(bm0).requires_grad_(true);
          const torch::Tensor y_ref = torch::linear(x_ref, in_out ? f32(w).t() : f32(w), bias ? f32(b) : torch::Tensor()) +
                                      scale * torch::linear(torch::linear(x_ref * mask, a_ref), bm_ref);
          (y_ref * f32(probe)).sum().backward();

          torch::Tensor x = x0.clone().requires_grad_(true), a = a0.clone().requires_grad_(true), bm = bm0.clone().requires_grad_(true);
          torch::Tensor a_buffer = a_start.clone(), bm_buffer = bm_start.clone();
          if (bound) a.mutable_grad() = a_buffer, bm.mutable_grad() = bm_buffer;
          const torch::Tensor dropped = drops ? x * mask.to(dtype) : torch::Tensor();
          const torch::Tensor y = lora_projection(x, dropped, w, bias ? b : torch::Tensor(), a, bm, scale, in_out);
          ASSERT_EQ(y.sizes(), y_ref.sizes()) << what;
          (y * probe).sum().backward();
          // fp32: float rounding; bf16: a few bf16 roundings (2^-8 each) of products over at most 40 terms.
          const double tol = dtype == torch::kFloat32 ? 1e-6 : 2e-2;
          const torch::Tensor held_a = bound ? a_start : torch::zeros({r, in}, dtype), held_bm = bound ? bm_start : torch::zeros({out, r}, dtype);
          EXPECT_LT(relative_error(y, y_ref), tol) << what << " output";
          EXPECT_LT(relative_error(x.grad(), x_ref.grad()), tol) << what << " input gradient";
          if (bound) {
            EXPECT_EQ(a.grad().data_ptr(), a_buffer.data_ptr()) << what << ": A's gradient stayed in its buffer";
            EXPECT_EQ(bm.grad().data_ptr(), bm_buffer.data_ptr()) << what << ": B's gradient stayed in its buffer";
          }
          EXPECT_LT(relative_error(a.grad().to(torch::kFloat32) - held_a.to(torch::kFloat32), a_ref.grad()), tol) << what << " A's gradient";
          EXPECT_LT(relative_error(bm.grad().to(torch::kFloat32) - held_bm.to(torch::kFloat32), bm_ref.grad()), tol) << what << " B's gradient";
          EXPECT_FALSE(w.grad().defined()) << what << ": the frozen base got a gradient";
          // x that takes no gradient (a LoRA run's first block below frozen embeddings): the adapters' still come.
          torch::Tensor a2 = a0.clone().requires_grad_(true);
          (lora_projection(x0, drops ? x0 * mask.to(dtype) : torch::Tensor(), w, bias ? b : torch::Tensor(), a2, bm0, scale, in_out) * probe)
              .sum()
              .backward();
          EXPECT_LT(relative_error(a2.grad(), a_ref.grad()), tol) << what << " A's gradient with x frozen";
        }
      }
    }
  }
  torch::Tensor trained = torch::randn({3, 2}).requires_grad_(true);
  EXPECT_THROW(lora_projection(torch::randn({1, 2}), {}, trained, {}, torch::randn({1, 2}), torch::randn({3, 1}), 1.0, false), std::exception)
      << "a base that trains is refused";
}

TEST(FusedOps, EmbeddingGradientsLandInTheParametersBufferAsLibTorchComputesThem) {
  torch::manual_seed(10);
  const int64_t V = 40, C = 24, B = 3, T = 9;
  const torch::Tensor ids = torch::randint(0, V / 2, {B, T}, torch::kLong) * 2;  // repeats; odd rows unused
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    const std::string what = dtype == torch::kFloat32 ? "fp32" : "bf16";
    const torch::Tensor w0 = torch::randn({V, C}).to(dtype), x = torch::randn({B * T, C}).to(dtype);
    const torch::Tensor probe = torch::randn({B, T, C}).to(dtype), start = torch::randn({V, C}).to(dtype);
    // The reference: LibTorch's embedding and a tied head reading the same table, from a gradient of `start`.
    torch::Tensor w_ref = w0.to(torch::kFloat32).clone().requires_grad_(true);
    ((torch::embedding(w_ref, ids) * probe.to(torch::kFloat32)).sum() + torch::mm(x.to(torch::kFloat32), w_ref.t()).sum()).backward();
    const torch::Tensor want = w_ref.grad() + start.to(torch::kFloat32);
    // ds: the gradient bound to a buffer beforehand, as FlatParams does; the rows are added into it.
    torch::Tensor buffer = start.clone();
    torch::Tensor w = w0.clone().requires_grad_(true);
    w.mutable_grad() = buffer;
    ((embedding_lookup(w, ids) * probe).sum() + torch::mm(x, w.t()).sum()).backward();
    EXPECT_EQ(w.grad().data_ptr(), buffer.data_ptr()) << what << ": the gradient stayed in its buffer";
    EXPECT_LT(relative_error(buffer, want), dtype == torch::kFloat32 ? 1e-6 : 1e-2) << what;
    // Without a bound buffer: the dense gradient, as LibTorch's.
    torch::Tensor w2 = w0.clone().requires_grad_(true);
    (embedding_lookup(w2, ids) * probe).sum().backward();
    torch::Tensor w2_ref = w0.clone().requires_grad_(true);
    (torch::embedding(w2_ref, ids) * probe).sum().backward();
    EXPECT_LT(relative_error(w2.grad(), w2_ref.grad()), 1e-6) << what;
  }
}

// The layers' products: every layout the layers pass (plain, transposed views, a narrowed chunk of rows,
// a row-major result inside a wider buffer falls back), written or added, against a double reference at
// awkward sizes; fp32 through oneDNN where built with it, bf16 through LibTorch.
// Dropout's mask is a function of its key and the element's index: the same key drops the same elements
// (fp32 and bf16 alike, and in backward), another key others, each element kept with probability 1 - p
// to within a percent, the kept ones scaled by 1 / (1 - p).
TEST(FusedOps, HashedDropoutKeepsOneMaskPerKeyAtTheRateAskedAndScalesWhatItKeeps) {
  const int64_t n = 1 << 20;
  const double p = 0.1;
  const torch::Tensor x = torch::rand({n}, torch::kFloat32) + 0.5;  // no zeros: a zero output means dropped
  const torch::Tensor kept = hashed_dropout(x, p, 42).ne(0);
  const double rate = kept.to(torch::kFloat64).mean().item<double>();
  EXPECT_NEAR(rate, 1 - p, 0.01 * (1 - p));
  EXPECT_TRUE(torch::equal(hashed_dropout(x, p, 42).ne(0), kept));  // the same key, the same mask
  const double overlap = hashed_dropout(x, p, 43).ne(0).logical_and(kept).to(torch::kFloat64).mean().item<double>();
  EXPECT_NEAR(overlap, (1 - p) * (1 - p), 0.01);  // another key: independent masks
  const torch::Tensor y = hashed_dropout(x, p, 42);
  EXPECT_TRUE(torch::allclose(y.masked_select(kept), x.masked_select(kept) / (1 - p), 1e-6, 0));
  // bf16: the same elements dropped, each kept one rounded once from the fp32 product.
  const torch::Tensor xb = x.to(torch::kBFloat16);
  const torch::Tensor yb = hashed_dropout(xb, p, 42);
  EXPECT_TRUE(torch::equal(yb.ne(0), kept));
  EXPECT_TRUE(torch::equal(yb, (xb.to(torch::kFloat32) * static_cast<float>(1 / (1 - p))).to(torch::kBFloat16) * kept));
  // backward: the gradient passes where the forward kept, scaled alike; checkpointed recomputation gets the mask again.
  const torch::Tensor leaf = x.clone().requires_grad_(true);
  hashed_dropout(leaf, p, 42).sum().backward();
  EXPECT_TRUE(torch::equal(leaf.grad().ne(0), kept));
  EXPECT_TRUE(torch::allclose(leaf.grad().masked_select(kept), torch::full({kept.sum().item<int64_t>()}, 1 / (1 - p)), 1e-6, 0));
  // fp16 (no kernel of its own) drops the same elements, its mask drawn a chunk at a time (this size is not a
  // multiple of one), each kept element x times 1 / (1 - p) in fp16 as LibTorch rounds it.
  EXPECT_TRUE(torch::equal(hashed_dropout(x.to(torch::kHalf), p, 42).ne(0), kept));
  const torch::Tensor odd = torch::rand({3, 100003}, torch::kFloat32) + 0.5, odd16 = odd.to(torch::kHalf);
  const torch::Tensor odd_kept = hashed_dropout(odd, p, 7).ne(0);
  const torch::Tensor y16 = hashed_dropout(odd16, p, 7);
  EXPECT_TRUE(torch::equal(y16.ne(0), odd_kept));
  EXPECT_TRUE(torch::equal(y16, odd16 * odd_kept.to(torch::kHalf) * (1.0 / (1.0 - p))));
  EXPECT_THROW(hashed_dropout(x, 0.0, 42), std::exception);
}

// The one answer to "which kernels take this tensor": ds's CPU kernels for fp32 and bf16 host tensors,
// LibTorch's for the rest on the host (fp16 included: the host computes no fp16); kernels/cuda's entry points
// refuse anything that is not theirs.
TEST(KernelRoute, HostTensorsOfOurDtypesTakeTheCpuKernelsAndTheCudaEntriesRefuseThem) {
  EXPECT_EQ(kernel_route(torch::zeros({4}, torch::kFloat32)), KernelRoute::host);
  EXPECT_EQ(kernel_route(torch::zeros({4}, torch::kBFloat16)), KernelRoute::host);
  EXPECT_EQ(kernel_route(torch::zeros({4}, torch::kHalf)), KernelRoute::libtorch);
  EXPECT_EQ(kernel_route(torch::zeros({4}, torch::kFloat64)), KernelRoute::libtorch);
  EXPECT_TRUE(on_host(torch::zeros({1})));
  const torch::Tensor x = torch::ones({8});
  EXPECT_THROW(cuda_dropout(x, torch::empty_like(x), 1, 1u << 31, 2.0f), std::exception);
  EXPECT_THROW(cuda_softmax_cross_entropy(x.view({2, 4}), torch::zeros({2}, torch::kLong), 1.0f, false, torch::empty({2})),
               std::exception);
}

TEST(Matmul, EveryLayoutTheLayersPassMatchesADoubleReference) {
  torch::manual_seed(7);
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (const auto& [m, k, n] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{1, 1, 1}, {7, 13, 5}, {33, 65, 17}, {128, 96, 200}}) {
      for (int layout = 0; layout < 4; ++layout) {
        const bool ta = layout & 1, tb = layout & 2;
        // a (m, k) stored as given or as (k, m) transposed; a also as rows of a taller matrix
        const torch::Tensor a_full = torch::randn(ta ? std::vector<int64_t>{k, m + 3} : std::vector<int64_t>{m + 3, k}).to(dtype);
        const torch::Tensor a = ta ? a_full.narrow(1, 2, m).t() : a_full.narrow(0, 2, m);
        const torch::Tensor b = tb ? torch::randn({n, k}).to(dtype).t() : torch::randn({k, n}).to(dtype);
        const torch::Tensor expect = torch::mm(a.to(torch::kDouble), b.to(torch::kDouble));
        const double tol = (dtype == torch::kFloat ? 1e-5 : 1e-2) * std::sqrt(static_cast<double>(k)) * 4;
        const std::string what = std::string(dtype == torch::kFloat ? "fp32" : "bf16") + " " + std::to_string(m) + "x" +
                                 std::to_string(k) + "x" + std::to_string(n) + " layout " + std::to_string(layout);
        const torch::Tensor c = matmul_new(a, b);
        EXPECT_LE((c.to(torch::kDouble) - expect).abs().max().item<double>(), tol) << what;
        const torch::Tensor start = torch::randn({m, n}).to(dtype);
        const torch::Tensor acc = start.clone();
        matmul_into(acc, a, b, true);
        EXPECT_LE((acc.to(torch::kDouble) - start.to(torch::kDouble) - expect).abs().max().item<double>(), tol * 2) << what;
        torch::Tensor wide = torch::zeros({m, n + 4}, dtype);
        matmul_into(wide.narrow(1, 1, n), a, b, false);  // ld > n: still row-major
        EXPECT_LE((wide.narrow(1, 1, n).to(torch::kDouble) - expect).abs().max().item<double>(), tol) << what;
        EXPECT_EQ(wide.narrow(1, 0, 1).abs().sum().item<double>(), 0) << what;  // nothing written outside it
      }
    }
  }
}

// Training routes LibTorch's large CPU tensors to ds's block pool (engine/runtime/device/block_pool.hpp): 64 KiB
// and more from the pool, smaller ones from malloc, both freed through the one deleter, and oneDNN's
// workspaces (raw_allocate, as in a bf16 product) too.
TEST(BlockPoolForTensors, TensorsOfSixtyFourKiBAndMoreComeFromThePool) {
  const BlockPool& pool = route_large_tensors_to_pool();
  const std::size_t before = pool.stats().live_bytes;
  {
    const torch::Tensor large = torch::empty({16384}, torch::kFloat32);  // 64 KiB exactly
    const torch::Tensor small = torch::empty({16383}, torch::kFloat32);
    EXPECT_TRUE(pool.owns(large.data_ptr()));
    EXPECT_FALSE(pool.owns(small.data_ptr()));
    EXPECT_EQ(pool.stats().live_bytes, before + 65536);
    const torch::Tensor a = torch::randn({300, 700}).to(torch::kBFloat16), b = torch::randn({700, 500}).to(torch::kBFloat16);
    const torch::Tensor c = torch::mm(a, b);
    EXPECT_TRUE(pool.owns(c.data_ptr()));
    // (LibTorch's own bf16 product: oneDNN's where the CPU has AVX-512, near the fp32 one; elsewhere its fallback, which
    // accumulates in bf16 and which ds's products avoid (Matmul.*): there the pooled result must equal a second run)
    const bool onednn = cpu_has_avx512();
    if (onednn)
      EXPECT_TRUE(torch::allclose(c.to(torch::kFloat32), torch::mm(a.to(torch::kFloat32), b.to(torch::kFloat32)), 0.02, 0.5));
    else
      EXPECT_TRUE(torch::equal(c, torch::mm(a, b)));
  }
  EXPECT_EQ(pool.stats().live_bytes, before) << "every pooled tensor went back when it died";
  EXPECT_EQ(&route_large_tensors_to_pool(), &pool) << "installed once";
}

// ds profile's matmul peak times the products training runs: off the host the head's are cut at the aligned part
// of an odd vocabulary (GPT-2's 50257 -> 50240), as fused_head_loss cuts them, not timed on cuBLAS's slow kernels for
// unaligned data that training never uses. On the host, and for a vocabulary already aligned, nothing changes.
TEST(GemmPeak, OffTheHostTheHeadIsTimedAtTheVocabularysAlignedPartAsTrainingRunsIt) {
  const ModelSpec gpt2 = build_model_spec(model_preset("gpt2"));
  constexpr int64_t tokens = 16;
  const auto host = gemm_shapes(gpt2, tokens, true), gpu = gemm_shapes(gpt2, tokens, false);
  ASSERT_TRUE(host.count({768, 50257}));
  EXPECT_FALSE(gpu.count({768, 50257}));
  ASSERT_TRUE(gpu.count({768, 50240}));
  EXPECT_DOUBLE_EQ(gpu.at({768, 50240}), 2.0 * tokens * 768 * 50240);
  // Every other product as the layers hold it: 12 blocks of q|k|v (768 x 2304), the attention's output (768 x 768)
  // and the MLP's two (768 x 3072, 3072 x 768), then the tied head.
  const auto total = [](const auto& shapes) {
    double sum = 0;
    for (const auto& kv : shapes) sum += kv.second;
    return sum;
  };
  const double blocks = 12.0 * (768 * 2304 + 768 * 768 + 2 * 768 * 3072);
  EXPECT_DOUBLE_EQ(total(host), 2.0 * tokens * (blocks + 768.0 * 50257));
  EXPECT_DOUBLE_EQ(total(gpu), 2.0 * tokens * (blocks + 768.0 * 50240));
  EXPECT_EQ(host.size(), gpu.size());
  const ModelSpec llama = build_model_spec(model_preset("tinyllama-1.1b"));  // vocabulary 32000: aligned already
  EXPECT_EQ(gemm_shapes(llama, tokens, true), gemm_shapes(llama, tokens, false));
}
