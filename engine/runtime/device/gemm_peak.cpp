#include "engine/runtime/device/gemm_peak.hpp"

#include <algorithm>
#include <chrono>
#include <map>
#include <tuple>

#include "engine/runtime/run/flat_params.hpp"
#include "engine/runtime/model/fused_head_loss.hpp"
#include "engine/runtime/model/matmul.hpp"

namespace ds {

std::map<std::pair<int64_t, int64_t>, double> gemm_shapes(const ModelSpec& model, int64_t tokens, bool host) {
  const int64_t vocab = model.hp.vocab_size, product_vocab = head_product_vocab(vocab, host);
  const auto run_as = [&](int64_t d) { return d == vocab ? product_vocab : d; };
  std::map<std::pair<int64_t, int64_t>, double> shapes;
  const auto add = [&](int64_t k, int64_t n) {
    k = run_as(k), n = run_as(n);
    shapes[{k, n}] += 2.0 * static_cast<double>(tokens) * static_cast<double>(k) * static_cast<double>(n);
  };
  for (const TensorSpec& t : model.tensors)
    if (t.shape.size() == 2 && !is_embedding_table(t)) add(t.shape[0], t.shape[1]);
  if (model.hp.tie_word_embeddings) add(model.hp.hidden_size, vocab);
  return shapes;
}

GemmPeak measure_gemm_peak(const ModelSpec& model, int64_t tokens, Dtype dtype, Device& device, double budget_s) {
  const auto shapes = gemm_shapes(model, tokens, device.host_addresses_device());
  GemmPeak peak;
  if (shapes.empty()) return peak;
  torch::NoGradGuard ng;
  Stream& stream = device.compute_stream();
  const auto operand = [&](int64_t rows, int64_t cols) { return device.allocate(Place::device, dtype, rows * cols, false).view({rows, cols}); };
  const double per_shape = budget_s / static_cast<double>(shapes.size());
  double weighted_flops = 0, weighted_seconds = 0;
  const auto start = std::chrono::steady_clock::now();
  for (const auto& [kn, step_flops] : shapes) {
    const auto [k, n] = kn;
    const torch::Tensor a = operand(tokens, k), b = operand(k, n), c = operand(tokens, n);
    a.normal_(), b.normal_();      // (a GPU's products of zeros run faster than of real values)
    matmul_into(c, a, b, false);  // warm: first-call kernel selection; ds's own path
    const double flops = 2.0 * static_cast<double>(tokens) * static_cast<double>(k) * static_cast<double>(n);
    // Rounds of products, each timed to its end: one, then as many as the time left allows at the rate so far
    // (a GPU runs what is queued after the call returns, so the clock is read after the stream is waited for).
    stream.synchronize();
    int64_t reps = 0, round = 1;
    const auto t0 = std::chrono::steady_clock::now();
    double elapsed = 0;
    while (reps < 2 || elapsed < per_shape) {
      for (int64_t i = 0; i < round; ++i) matmul_into(c, a, b, false);
      reps += round;
      stream.synchronize();
      elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double each = elapsed / static_cast<double>(reps);
      round = std::clamp<int64_t>(static_cast<int64_t>((per_shape - elapsed) / std::max(each, 1e-9)), 1, std::max<int64_t>(reps, 1));
    }
    const double rate = flops * static_cast<double>(reps) / elapsed;
    weighted_flops += step_flops;
    weighted_seconds += step_flops / rate;
    ++peak.shapes;
  }
  peak.flops_per_s = weighted_flops / weighted_seconds;
  peak.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return peak;
}

}  // namespace ds
