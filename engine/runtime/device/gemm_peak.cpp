#include "engine/runtime/device/gemm_peak.hpp"

#include <chrono>
#include <map>
#include <tuple>

#include "engine/runtime/run/flat_params.hpp"
#include "engine/runtime/model/matmul.hpp"

namespace ds {

GemmPeak measure_gemm_peak(const ModelSpec& model, int64_t tokens, Dtype dtype, double budget_s) {
  // Each distinct (k, n) with the FLOPs one step spends in it.
  std::map<std::pair<int64_t, int64_t>, double> shapes;
  for (const TensorSpec& t : model.tensors) {
    if (t.shape.size() == 2 && !is_embedding_table(t)) shapes[{t.shape[0], t.shape[1]}] += 2.0 * static_cast<double>(tokens * t.numel);
  }
  if (model.hp.tie_word_embeddings)
    shapes[{model.hp.hidden_size, model.hp.vocab_size}] += 2.0 * static_cast<double>(tokens) * model.hp.hidden_size * model.hp.vocab_size;
  GemmPeak peak;
  if (shapes.empty()) return peak;
  torch::NoGradGuard ng;
  const auto opts = torch::TensorOptions().dtype(to_torch(dtype));
  const double per_shape = budget_s / static_cast<double>(shapes.size());
  double weighted_flops = 0, weighted_seconds = 0;
  const auto start = std::chrono::steady_clock::now();
  for (const auto& [kn, step_flops] : shapes) {
    const auto [k, n] = kn;
    const torch::Tensor a = torch::randn({tokens, k}, opts), b = torch::randn({k, n}, opts);
    const torch::Tensor c = matmul_new(a, b);  // warm: first-call allocation and kernel selection; ds's own path
    const double flops = 2.0 * static_cast<double>(tokens) * static_cast<double>(k) * static_cast<double>(n);
    int reps = 0;
    const auto t0 = std::chrono::steady_clock::now();
    double elapsed = 0;
    while (reps < 2 || elapsed < per_shape) {
      matmul_into(c, a, b, false);
      ++reps;
      elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    const double rate = flops * reps / elapsed;
    weighted_flops += step_flops;
    weighted_seconds += step_flops / rate;
    ++peak.shapes;
  }
  peak.flops_per_s = weighted_flops / weighted_seconds;
  peak.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return peak;
}

}  // namespace ds
