// bench_adam — one optimizer step over GPT-2 124M's parameters: ds's fused AdamW kernel (fp32 master
// and moments, bf16 gradients in, bf16 weights out, one pass) against LibTorch's torch::optim::AdamW
// on fp32 parameters followed by the bf16 copy a mixed-precision trainer needs. Interleaved rounds,
// medians; achieved GB/s against the bytes each element must move.
//
// Napkin math for the fused pass: per element read master 4 + m 4 + v 4 + grad 2 bytes, write master 4 +
// m 4 + v 4 + bf16 weight 2 bytes = 28 bytes; 124.4M elements -> 3.48 GB per step.
//
// Usage: bench_adam [elements] [rounds] [threads]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/cpu/adam.hpp"

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 124439808;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 5;
  const int threads = argc > 3 ? std::atoi(argv[3]) : 2;
  torch::set_num_threads(threads);
  setenv("OMP_NUM_THREADS", std::to_string(threads).c_str(), 0);

  // ds: flat buffers, allocated once.
  std::vector<float> master(n), m(n, 0.f), v(n, 0.f);
  std::vector<uint16_t> grad(n), out(n);
  for (int64_t i = 0; i < n; ++i) {
    master[i] = 0.02f * static_cast<float>((i * 2654435761u) % 1000) / 1000.f;
    grad[i] = ds::kernels::float_to_bf16(1e-3f * static_cast<float>((i * 40503u) % 997) / 997.f - 5e-4f);
  }
  // torch: one fp32 parameter of the same size with an fp32 gradient (torch's AdamW needs fp32 grads
  // for fp32 params), then the bf16 copy for the forward pass.
  auto param = torch::from_blob(master.data(), {n}, torch::kFloat32).clone().set_requires_grad(true);
  param.mutable_grad() = torch::randn({n}) * 1e-3;
  torch::optim::AdamW torch_adam({param}, torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
  torch::Tensor bf16_copy = torch::empty({n}, torch::kBFloat16);

  std::vector<double> ds_s, torch_s;
  int64_t step = 0;
  for (int r = 0; r < rounds + 1; ++r) {  // round 0 warms up both
    ++step;
    auto t0 = std::chrono::steady_clock::now();
    ds::kernels::AdamStep h;
    h.lr = 1e-3f, h.weight_decay = 0.1f;
    auto s = h.at_step(step);
    ds::kernels::adam_step_bf16(master.data(), m.data(), v.data(), out.data(), grad.data(), n, s);
    const double t_ds = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    {
      torch::NoGradGuard ng;
      torch_adam.step();
      bf16_copy.copy_(param);
    }
    const double t_torch = seconds_since(t0);
    if (r > 0) ds_s.push_back(t_ds), torch_s.push_back(t_torch);
  }
  // The machine's streaming bandwidth in the same run: a STREAM-style triad a = b + s c over buffers
  // as large as the optimizer state (reads 8 B, writes 4 B per element; OpenMP like the kernel).
  std::vector<double> triad_s;
  {
    float* a = master.data();
    const float* b = m.data();
    const float* c = v.data();
    for (int r = 0; r < rounds + 1; ++r) {
      auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) a[i] = b[i] + 0.5f * c[i];
      if (r > 0) triad_s.push_back(seconds_since(t0));
    }
  }
  const double triad_gbs = 12.0 * static_cast<double>(n) / median(triad_s) / 1e9;
  const double bytes = 28.0 * static_cast<double>(n);
  const double d = median(ds_s), t = median(torch_s);
  std::printf("bench_adam %lld elements, %d threads, %d rounds (median), kernel %s, torch %s\n", static_cast<long long>(n),
              threads, rounds, ds::kernels::adam_implementation(), TORCH_VERSION);
  std::printf("  stream triad (peak here)   : %8.1f GB/s counted as 12 B/element (the store also reads its line: 16 B moved)\n", triad_gbs);
  std::printf("  ds fused AdamW + bf16 copy : %8.3f s  %6.1f GB/s of the 28 B/element it must move (%.0f%% of triad)\n", d,
              bytes / d / 1e9, 100.0 * bytes / d / 1e9 / triad_gbs);
  std::printf("  torch AdamW + bf16 copy    : %8.3f s\n", t);
  std::printf("  speedup                    : %8.2fx\n", t / d);
  return 0;
}
