// The CUDA optimizer kernels' bandwidth on a GPU, against the card's own device-to-device copy rate
// measured in the same run (the fused AdamW step is memory-bound: 28 bytes per element), and the head's
// cross-entropy on one of GPT-2's chunks (640 rows of 50,257 bf16 logits) each way it can read a row
// (kernels/cuda/cross_entropy.hpp: twice from device memory, or once into shared memory), and at GPT-2's block
// shape (16,384 rows of 768 bf16) a bias gradient's column sums, the LayerNorm's backward, and its forward alone
// and with the residual add in the same kernel (kernels/cuda/norm.hpp). Interleaved rounds; prints the command
// and medians. Built with the CUDA kernels (target bench_cuda_optimizers,
// not part of `all`); scripts/device-check.sh runs it.
//   bench_cuda_optimizers [ELEMENTS=124439808] [ROUNDS=5]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/cuda/cross_entropy.hpp"
#include "kernels/cuda/norm.hpp"
#include "kernels/cuda/optimizers.hpp"

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_cuda_optimizers: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// Seconds `work` takes on the default stream, timed by events.
template <class F>
double timed(F work) {
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "cudaEventCreate");
  check(cudaEventCreate(&b), "cudaEventCreate");
  check(cudaEventRecord(a), "cudaEventRecord");
  work();
  check(cudaEventRecord(b), "cudaEventRecord");
  check(cudaEventSynchronize(b), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / 1e3;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 124439808;  // GPT-2 124M's parameters
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 5;
  const char* why = nullptr;
  if (ds::kernels::cuda::device_count(&why) == 0) {
    std::fprintf(stderr, "bench_cuda_optimizers: no CUDA device (%s)\n", why ? why : "none");
    return 2;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("command: %s %lld %d\ndevice: %s\n", argv[0], static_cast<long long>(n), rounds, prop.name);
  float *w, *m, *v, *copy_src, *copy_dst;
  uint16_t *g, *out;
  double* scratch;
  const size_t f = static_cast<size_t>(n) * 4, h = static_cast<size_t>(n) * 2;
  for (auto [p, bytes] : {std::pair<void**, size_t>{reinterpret_cast<void**>(&w), f}, {reinterpret_cast<void**>(&m), f},
                          {reinterpret_cast<void**>(&v), f}, {reinterpret_cast<void**>(&g), h}, {reinterpret_cast<void**>(&out), h},
                          {reinterpret_cast<void**>(&copy_src), 14 * static_cast<size_t>(n)},
                          {reinterpret_cast<void**>(&copy_dst), 14 * static_cast<size_t>(n)},
                          {reinterpret_cast<void**>(&scratch), sizeof(double) * (2 + ds::kernels::cuda::kReduceBlocks)}}) {
    check(cudaMalloc(p, bytes), "cudaMalloc");
    check(cudaMemset(*p, 0, bytes), "cudaMemset");
  }
  // One chunk of GPT-2's head as training runs it on a GPU: rows 8 elements apart (16 bytes of bf16).
  constexpr int64_t kRows = 640, kVocab = 50257, kStride = 50264;
  uint16_t* logits;
  int64_t* targets;
  float* row_loss;
  check(cudaMalloc(reinterpret_cast<void**>(&logits), kRows * kStride * 2), "cudaMalloc");
  check(cudaMalloc(reinterpret_cast<void**>(&targets), kRows * 8), "cudaMalloc");
  check(cudaMalloc(reinterpret_cast<void**>(&row_loss), kRows * 4), "cudaMalloc");
  check(cudaMemset(logits, 0, kRows * kStride * 2), "cudaMemset");
  check(cudaMemset(targets, 0, kRows * 8), "cudaMemset");
  using ds::kernels::cuda::CrossEntropyPath;
  const auto cross_entropy = [&](CrossEntropyPath path) {
    return timed([&] {
      ds::kernels::cuda::softmax_cross_entropy_bf16_by(path, logits, targets, kRows, kVocab, kStride, 1.0f / 16384, true, row_loss, nullptr);
    });
  };
  // GPT-2 124M's block activations at 16 x 1024 tokens: a norm's rows, bf16.
  const ds::kernels::NormShape ns{16384, 768, 1e-5f, false};
  const size_t act = static_cast<size_t>(ns.rows * ns.cols) * 2;
  uint16_t *nx, *nr, *nsum, *ny, *ndy, *ndx, *nw, *nb;
  float *nmean, *nrstd, *ndw, *ndb, *nscratch, *bias_scratch;
  for (uint16_t** p : {&nx, &nr, &nsum, &ny, &ndy, &ndx}) check(cudaMalloc(reinterpret_cast<void**>(p), act), "cudaMalloc");
  for (uint16_t** p : {&nw, &nb}) check(cudaMalloc(reinterpret_cast<void**>(p), static_cast<size_t>(ns.cols) * 2), "cudaMalloc");
  for (float** p : {&nmean, &nrstd}) check(cudaMalloc(reinterpret_cast<void**>(p), static_cast<size_t>(ns.rows) * 4), "cudaMalloc");
  for (float** p : {&ndw, &ndb}) check(cudaMalloc(reinterpret_cast<void**>(p), static_cast<size_t>(ns.cols) * 4), "cudaMalloc");
  check(cudaMalloc(reinterpret_cast<void**>(&nscratch), static_cast<size_t>(ds::kernels::cuda::norm_backward_scratch_floats(ns)) * 4),
        "cudaMalloc");
  check(cudaMalloc(reinterpret_cast<void**>(&bias_scratch),
                   static_cast<size_t>(ds::kernels::cuda::column_sums_scratch_floats(ns.rows, ns.cols)) * 4),
        "cudaMalloc");
  for (uint16_t* p : {nx, nr, ndy}) check(cudaMemset(p, 0x3c, act), "cudaMemset");  // about 0.01: finite
  for (uint16_t* p : {nw, nb}) check(cudaMemset(p, 0x3c, static_cast<size_t>(ns.cols) * 2), "cudaMemset");
  ds::kernels::AdamStep s;
  s.lr = 1e-4f;
  s.weight_decay = 0.1f;
  const ds::kernels::AdamStep k = s.at_step(10);
  std::vector<double> copy_s, adam_s, norm_s, two_pass_s, shared_s, colsum_s, ln_back_s, ln_fwd_s, ln_add_fwd_s;
  for (int r = 0; r <= rounds; ++r) {  // round 0 warms up
    const double c = timed([&] { check(cudaMemcpy(copy_dst, copy_src, 14 * static_cast<size_t>(n), cudaMemcpyDeviceToDevice), "copy"); });
    const double a = timed([&] { ds::kernels::cuda::adam_step_bf16(w, m, v, out, g, n, k, nullptr); });
    const double q = timed([&] { ds::kernels::cuda::sum_of_squares_bf16(g, n, scratch, scratch + 2, nullptr); });
    // (taken in turn first, so neither always follows a kernel that just wrote the chunk while it sits in L2)
    double ce1 = 0, ce2 = 0;
    if (r % 2 == 0)
      ce2 = cross_entropy(CrossEntropyPath::two_pass), ce1 = cross_entropy(CrossEntropyPath::row_in_shared);
    else
      ce1 = cross_entropy(CrossEntropyPath::row_in_shared), ce2 = cross_entropy(CrossEntropyPath::two_pass);
    const double cs = timed([&] { ds::kernels::cuda::column_sums_add_bf16(ndy, ns.rows, ns.cols, nb, bias_scratch, nullptr); });
    const double lb = timed([&] {
      ds::kernels::cuda::norm_backward_bf16(ndy, nullptr, nx, nw, nmean, nrstd, ndx, ndw, ndb, nscratch, ns, nullptr);
    });
    const double lf = timed([&] { ds::kernels::cuda::norm_forward_bf16(nx, nullptr, nw, nb, nullptr, ny, nmean, nrstd, ns, nullptr); });
    const double la = timed([&] { ds::kernels::cuda::norm_forward_bf16(nx, nr, nw, nb, nsum, ny, nmean, nrstd, ns, nullptr); });
    if (r == 0) continue;
    colsum_s.push_back(cs);
    ln_back_s.push_back(lb);
    ln_fwd_s.push_back(lf);
    ln_add_fwd_s.push_back(la);
    copy_s.push_back(c);
    adam_s.push_back(a);
    norm_s.push_back(q);
    two_pass_s.push_back(ce2);
    shared_s.push_back(ce1);
    std::printf("round %d: copy %.3f ms, AdamW %.3f ms, sum of squares %.3f ms, cross-entropy chunk %.1f us (two passes) / %.1f us "
                "(row in shared memory)\n",
                r, c * 1e3, a * 1e3, q * 1e3, ce2 * 1e6, ce1 * 1e6);
  }
  // The chunk's logits read once and the gradient written once: what either way must move at the least.
  const double ce_bytes = 2.0 * 2 * kRows * kVocab;
  std::printf("cross-entropy, %lld x %lld bf16: two passes %.1f us, row in shared memory %.1f us (%.2fx); %.0f and %.0f GB/s of the "
              "chunk read once and written once\n",
              static_cast<long long>(kRows), static_cast<long long>(kVocab), median(two_pass_s) * 1e6, median(shared_s) * 1e6,
              median(two_pass_s) / median(shared_s), ce_bytes / median(two_pass_s) / 1e9, ce_bytes / median(shared_s) / 1e9);
  // A copy of 14 bytes reads 14 and writes 14: 28 bytes moved per element, as the fused AdamW step moves.
  const double copy_rate = 28.0 * n / median(copy_s), adam_rate = 28.0 * n / median(adam_s), norm_rate = 2.0 * n / median(norm_s);
  std::printf("medians: device copy %.0f GB/s; AdamW (bf16 grads in, bf16 weights out, 28 B/elem) %.3f ms = %.0f GB/s = %.2fx the copy; "
              "bf16 sum of squares %.0f GB/s\n",
              copy_rate / 1e9, median(adam_s) * 1e3, adam_rate / 1e9, adam_rate / copy_rate, norm_rate / 1e9);
  // Bytes each must move at the least: the column sums read dy; the backward reads dy and x and writes dx, then
  // reads dy and x again for the weight's sums; the forward reads x and writes y; with the residual it reads x and
  // r and writes the sum and y.
  const double a_bytes = static_cast<double>(act);
  std::printf("norms at 16384 x 768 bf16: bias column sums %.1f us (%.0f GB/s); LayerNorm backward %.1f us (%.0f GB/s of 5 passes); "
              "forward %.1f us (%.0f GB/s), with the residual add %.1f us (%.0f GB/s of 4 passes; %.1f us for the add and the norm "
              "apart would be its 5 passes at the forward's rate)\n",
              median(colsum_s) * 1e6, a_bytes / median(colsum_s) / 1e9, median(ln_back_s) * 1e6, 5 * a_bytes / median(ln_back_s) / 1e9,
              median(ln_fwd_s) * 1e6, 2 * a_bytes / median(ln_fwd_s) / 1e9, median(ln_add_fwd_s) * 1e6,
              4 * a_bytes / median(ln_add_fwd_s) / 1e9, median(ln_fwd_s) * 5 / 2 * 1e6);
  return 0;
}
