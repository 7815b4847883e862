// The model's fused operations against the plain LibTorch ops they replace, forward and backward, in
// fp32, bf16 and fp16, at awkward sizes and split into chunks.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "engine/runtime/fused_head_loss.hpp"
#include "engine/runtime/fused_ops.hpp"

using namespace ds;

namespace {

struct HeadResult {
  double loss;
  torch::Tensor dx, dw;
};

// The head as it was before it was fused: logits in the model's dtype, cross-entropy in fp32.
HeadResult reference_head(const torch::Tensor& x0, const torch::Tensor& w0, const torch::Tensor& t, double grad) {
  torch::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
  torch::Tensor loss = torch::cross_entropy_loss(torch::mm(x, w.t()).to(torch::kFloat32), t);
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

TEST(FusedOps, NormsAndGeluMatchLibTorchForwardAndBackward) {
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
    }
  }
}
