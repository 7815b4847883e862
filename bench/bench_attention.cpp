// bench_attention — causal self-attention at one shape: ds's fused attention as it trains ("fused": fp32
// tiles where the CPU has AVX-512, else blocks), its block path forced ("blocks": blocks of query rows
// through LibTorch's bmm, engine/runtime/model/fused_attention) and the materialised T x T path they replaced
// (LibTorch matmul, masked softmax, matmul), forward alone and forward + backward, interleaved rounds, medians. Also the
// rate of one bmm at the blocks' shape, the ceiling for either. FLOP/s use the model-FLOPs count of the
// full T x T (4 B NH T^2 D forward, twice that backward), as ds profile does.
//
// Usage: bench_attention [B] [NH] [NKV] [T] [D] [fp32|bf16] [rounds] [threads] [block rows, 0: ds's]
// Run it in the environment ds trains in: GOMP_SPINCOUNT=1000 (libgomp's default spin starves
// OpenBLAS's own threads: fp32 bmm ran 2-5x slower) and ds's glibc settings, e.g.
//   GOMP_SPINCOUNT=1000 MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=2147483647 (one line)
//   MALLOC_TOP_PAD_=268435456 build/bench_attention 4 6 6 1024 64 bf16 3
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "engine/runtime/model/fused_attention.hpp"

namespace {
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
double time_once(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

int main(int argc, char** argv) {
  auto arg = [&](int i, int64_t d) { return argc > i ? std::atoll(argv[i]) : d; };
  const int64_t B = arg(1, 4), NH = arg(2, 6), NKV = arg(3, NH), T = arg(4, 1024), D = arg(5, 64);
  const bool bf16 = !(argc > 6 && std::strcmp(argv[6], "fp32") == 0);
  const int rounds = static_cast<int>(arg(7, 5));
  const int threads = static_cast<int>(arg(8, 2));
  const int64_t rows = arg(9, 0);
  torch::set_num_threads(threads);
  const auto dtype = bf16 ? torch::kBFloat16 : torch::kFloat32;
  torch::manual_seed(1);
  const torch::Tensor q = torch::randn({B, T, NH, D}).to(dtype), k = torch::randn({B, T, NKV, D}).to(dtype),
                      v = torch::randn({B, T, NKV, D}).to(dtype), dy = torch::randn({B, T, NH, D}).to(dtype);
  using Attention = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>;
  const Attention fused = [&](const auto& a, const auto& b, const auto& c) { return ds::causal_attention(a, b, c, rows); };
  const int64_t block = rows > 0 ? rows : ds::attention_chunk_rows(B * NH, T);
  const Attention blocks = [&](const auto& a, const auto& b, const auto& c) { return ds::causal_attention(a, b, c, block); };
  const Attention plain = [](const auto& a, const auto& b, const auto& c) { return ds::causal_attention_materialised(a, b, c); };
  auto forward = [&](const Attention& f) {
    torch::NoGradGuard no_grad;
    f(q, k, v);
  };
  auto both = [&](const Attention& f) {
    torch::Tensor qq = q.clone().requires_grad_(true), kk = k.clone().requires_grad_(true), vv = v.clone().requires_grad_(true);
    f(qq, kk, vv).backward(dy);
  };
  const torch::Tensor a = torch::randn({B * NH, block, D}).to(dtype), bt = torch::randn({B * NH, D, T}).to(dtype);
  std::vector<double> ff, fb, bf, bb, pf, pb, mm;
  for (int r = 0; r < rounds + 1; ++r) {  // round 0 warms up
    const double t1 = time_once([&] { forward(fused); }), t2 = time_once([&] { both(fused); });
    const double t6 = time_once([&] { forward(blocks); }), t7 = time_once([&] { both(blocks); });
    const double t3 = time_once([&] { forward(plain); }), t4 = time_once([&] { both(plain); });
    const double t5 = time_once([&] { torch::bmm(a, bt); });
    if (r == 0) continue;
    ff.push_back(t1), fb.push_back(t2), bf.push_back(t6), bb.push_back(t7), pf.push_back(t3), pb.push_back(t4), mm.push_back(t5);
  }
  const double fwd_flops = 4.0 * B * NH * T * T * D;
  std::printf("bench_attention: B=%lld NH=%lld NKV=%lld T=%lld D=%lld %s, %d threads, blocks of %lld rows, %d rounds\n",
              (long long)B, (long long)NH, (long long)NKV, (long long)T, (long long)D, bf16 ? "bf16" : "fp32", threads,
              (long long)block, rounds);
  if (!std::getenv("GOMP_SPINCOUNT") || !std::getenv("MALLOC_MMAP_THRESHOLD_"))
    std::printf("note: not ds's environment (GOMP_SPINCOUNT=1000 and its glibc settings, see the usage): figures differ\n");
  std::printf("command:");
  for (int i = 0; i < argc; ++i) std::printf(" %s", argv[i]);
  std::printf("\n%-14s %12s %12s %14s\n", "", "forward ms", "fwd+bwd ms", "fwd+bwd TFLOP/s");
  std::printf("%-14s %12.2f %12.2f %14.3f\n", "fused", 1e3 * median(ff), 1e3 * median(fb), 3 * fwd_flops / median(fb) / 1e12);
  std::printf("%-14s %12.2f %12.2f %14.3f\n", "blocks", 1e3 * median(bf), 1e3 * median(bb), 3 * fwd_flops / median(bb) / 1e12);
  std::printf("%-14s %12.2f %12.2f %14.3f\n", "materialised", 1e3 * median(pf), 1e3 * median(pb), 3 * fwd_flops / median(pb) / 1e12);
  std::printf("one bmm (%lld x %lld x %lld, %lld batches): %.3f TFLOP/s\n", (long long)block, (long long)T, (long long)D,
              (long long)(B * NH), 2.0 * B * NH * block * T * D / median(mm) / 1e12);
  return 0;
}
