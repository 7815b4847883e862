// The CUDA kernels (kernels/cuda, through the CUDA KernelTable) against the CPU kernels on the same
// inputs: the optimizers' updates within float rounding (the two may contract multiply-adds differently),
// the 16-bit weights they write within one bf16 step, sums of squares to 1e-12 of the double reference
// and bit-identical run to run. Without a visible GPU every test skips and says why (label gpu; scripts/device-check.sh runs them).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "engine/runtime/device/kernel_table_cuda.hpp"
#include "kernels/cpu/adam.hpp"
#include "kernels/cpu/lamb.hpp"
#include "kernels/cpu/norm.hpp"
#include "kernels/cpu/sgd.hpp"
#include "kernels/cpu/activation.hpp"
#include "kernels/cpu/cross_entropy.hpp"
#include "kernels/cpu/rope.hpp"
#include "kernels/cpu/dropout.hpp"
#include "kernels/cuda/activation.hpp"
#include "kernels/cuda/cross_entropy.hpp"
#include "kernels/cuda/dropout.hpp"
#include "kernels/cuda/norm.hpp"
#include "kernels/cuda/rope.hpp"
#include "kernels/dropout_mask.hpp"
#include "kernels/cuda/optimizers.hpp"

using namespace ds;

namespace {

class CudaKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* why = nullptr;
    if (kernels::cuda::device_count(&why) == 0)
      GTEST_SKIP() << "no CUDA device visible (" << (why ? why : "none") << "): the kernels were compiled and linked; "
                   << "run scripts/device-check.sh on a GPU machine";
    table_ = make_cuda_kernel_table(nullptr);
  }
  std::unique_ptr<KernelTable> table_;
};

// A device copy of a host vector, freed with the object.
template <class T>
struct OnDevice {
  explicit OnDevice(const std::vector<T>& host) : n(host.size()) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p), n * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, host.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~OnDevice() { cudaFree(p); }
  std::vector<T> host() const {
    std::vector<T> out(n);
    EXPECT_EQ(cudaMemcpy(out.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  size_t n;
  T* p = nullptr;
};

std::vector<float> normal(size_t n, float scale, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = kernels::float_to_bf16(v[i]);
  return out;
}

// Within `rel` of a's magnitude plus `abs`: an element near zero keeps the absolute error of the terms it
// was computed from (w - lr u rounds at |w|'s scale however small the result), so it gets `abs` as well.
void expect_close(const std::vector<float>& a, const std::vector<float>& b, double rel, const char* what, double abs = 1e-12) {
  ASSERT_EQ(a.size(), b.size());
  size_t bad = 0;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
    worst = std::max(worst, d);
    if (d > rel * std::fabs(a[i]) + abs) ++bad;
  }
  EXPECT_EQ(bad, 0u) << what << ": elements further apart than " << rel << " relative + " << abs << " (largest difference " << worst
                     << ")";
}

// An update w - lr u in fp32, computed with multiply-adds contracted differently on the two sides: one
// rounding of u's terms (|u| up to ~4, so ~5e-7) times lr, plus w's own half ulp at |w| ~ 0.5 (3e-8).
constexpr double kWeightAbs = 5e-8;

void expect_within_one_bf16_step(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  ASSERT_EQ(a.size(), b.size());
  size_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::abs(static_cast<int>(a[i]) - static_cast<int>(b[i])) > 1) ++bad;
  EXPECT_EQ(bad, 0u);
}

constexpr size_t kN = 100003;  // not a multiple of any block size

}  // namespace

// (offset 0: four elements a thread, then the last three one at a time; offset 1: every pointer off its 16-byte
// boundary, one at a time throughout)
TEST_F(CudaKernels, AdamWMatchesTheCpuKernelInFp32AndBf16Gradients) {
  for (const size_t off : {size_t{0}, size_t{1}})
  for (bool bf16_grads : {false, true}) {
    SCOPED_TRACE(std::string(bf16_grads ? "bf16 gradients" : "fp32 gradients") + ", offset " + std::to_string(off));
    std::vector<float> w = normal(kN, 0.5f, 1), m = normal(kN, 0.01f, 2), g = normal(kN, 1.0f, 4);
    std::vector<float> v(kN);
    for (size_t i = 0; i < kN; ++i) v[i] = 0.1f * std::fabs(m[i]) + 1e-6f;
    kernels::AdamStep s;
    s.lr = 1e-3f;
    s.weight_decay = 0.1f;
    s.grad_scale = 0.5f;
    const kernels::AdamStep k = s.at_step(7);
    OnDevice<float> dw(w), dm(m), dv(v), dg(g);
    OnDevice<uint16_t> dgb{to_bf16(g)}, dout{std::vector<uint16_t>(kN)};
    std::vector<uint16_t> out(kN), gb = to_bf16(g);
    const size_t n = kN - off;
    if (bf16_grads) {
      kernels::adam_step_bf16(w.data() + off, m.data() + off, v.data() + off, out.data() + off, gb.data() + off, n, k);
      table_->adam_step_bf16(dw.p + off, dm.p + off, dv.p + off, dout.p + off, dgb.p + off, n, k);
    } else {
      kernels::adam_step_f32(w.data() + off, m.data() + off, v.data() + off, out.data() + off, g.data() + off, n, k);
      table_->adam_step_f32(dw.p + off, dm.p + off, dv.p + off, dout.p + off, dg.p + off, n, k);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_close(w, dw.host(), 1e-6, "weights");
    expect_close(m, dm.host(), 1e-6, "exp_avg");
    expect_close(v, dv.host(), 1e-6, "exp_avg_sq");
    expect_within_one_bf16_step(out, dout.host());
  }
}

// fp16 gradients (a GPU's fp16 run, its loss scale undone by grad_scale): every optimizer and the sum of squares
// against the CPU's kernels on the same bits, to the tolerances above; an fp16 infinity makes the sum infinite.
TEST_F(CudaKernels, Fp16GradientsStepAndSumAsOnTheCpu) {
  std::vector<float> w = normal(kN, 0.5f, 41), m = normal(kN, 0.01f, 42), g = normal(kN, 1.0f, 43);
  std::vector<float> v(kN);
  for (size_t i = 0; i < kN; ++i) v[i] = 0.1f * std::fabs(m[i]) + 1e-6f;
  std::vector<uint16_t> gh(kN);
  for (size_t i = 0; i < kN; ++i) gh[i] = kernels::float_to_fp16(g[i] * 1024.0f);  // as scaled by a loss scale of 1024
  OnDevice<uint16_t> dgh(gh);
  {
    kernels::AdamStep s;
    s.lr = 1e-3f;
    s.weight_decay = 0.1f;
    s.grad_scale = 1.0f / 1024;
    const kernels::AdamStep k = s.at_step(7);
    std::vector<float> cw = w, cm = m, cv = v;
    std::vector<uint16_t> out(kN);
    OnDevice<float> dw(w), dm(m), dv(v);
    OnDevice<uint16_t> dout{std::vector<uint16_t>(kN)};
    kernels::adam_step_fp16(cw.data(), cm.data(), cv.data(), out.data(), gh.data(), kN, k);
    table_->adam_step(dw.p, dm.p, dv.p, dout.p, dgh.p, GradElements::fp16, kN, k);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_close(cw, dw.host(), 1e-6, "adam weights");
    expect_close(cm, dm.host(), 1e-6, "exp_avg");
    expect_close(cv, dv.host(), 1e-6, "exp_avg_sq");
    expect_within_one_bf16_step(out, dout.host());
  }
  {
    kernels::SgdStep s;
    s.lr = 0.01f;
    s.momentum = 0.9f;
    s.grad_scale = 1.0f / 1024;
    std::vector<float> cw = w, cb = m;
    OnDevice<float> dw(w), db(m);
    kernels::sgd_step_fp16(cw.data(), cb.data(), nullptr, gh.data(), kN, s);
    table_->sgd_step(dw.p, db.p, nullptr, dgh.p, GradElements::fp16, kN, s);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_close(cw, dw.host(), 1e-6, "sgd weights", kWeightAbs);
    expect_close(cb, db.host(), 1e-6, "momentum");
  }
  {
    kernels::LambStep s;
    s.lr = 1e-3f;
    s.grad_scale = 1.0f / 1024;
    const kernels::LambStep k = s.at_step(3);
    std::vector<float> cw = w, cm = m, cv = v;
    OnDevice<float> dw(w), dm(m), dv(v);
    double w_cpu = 0, u_cpu = 0, w_gpu = 0, u_gpu = 0;
    kernels::lamb_moments_fp16(cw.data(), cm.data(), cv.data(), gh.data(), kN, k, &w_cpu, &u_cpu);
    table_->lamb_moments(dw.p, dm.p, dv.p, dgh.p, GradElements::fp16, kN, k, &w_gpu, &u_gpu);
    EXPECT_NEAR(w_gpu, w_cpu, 1e-9 * w_cpu);
    EXPECT_NEAR(u_gpu, u_cpu, 1e-6 * u_cpu);
  }
  const double want = kernels::sum_of_squares_fp16_reference(gh.data(), kN);
  EXPECT_NEAR(table_->sum_of_squares(dgh.p, GradElements::fp16, kN), want, 1e-12 * want);
  for (const size_t skip : {size_t{1}, size_t{5}}) {  // off the 16-byte loads' boundary
    const double part = kernels::sum_of_squares_fp16_reference(gh.data() + skip, kN - skip - 3);
    EXPECT_NEAR(table_->sum_of_squares_fp16(dgh.p + skip, kN - skip - 3), part, 1e-12 * part) << "from element " << skip;
  }
  std::vector<uint16_t> with_inf = gh;
  with_inf[kN / 3] = 0x7c00;
  OnDevice<uint16_t> dinf(with_inf);
  EXPECT_TRUE(std::isinf(table_->sum_of_squares(dinf.p, GradElements::fp16, kN)));
}

TEST_F(CudaKernels, SgdWithMomentumMatchesTheCpuKernel) {
  std::vector<float> w = normal(kN, 0.5f, 11), buf = normal(kN, 0.1f, 12), g = normal(kN, 1.0f, 13);
  kernels::SgdStep s;
  s.lr = 0.01f;
  s.momentum = 0.9f;
  s.nesterov = true;
  s.weight_decay = 1e-4f;
  OnDevice<float> dw(w), db(buf), dg(g);
  kernels::sgd_step_f32(w.data(), buf.data(), nullptr, g.data(), kN, s);
  table_->sgd_step_f32(dw.p, db.p, nullptr, dg.p, kN, s);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_close(w, dw.host(), 1e-6, "weights", kWeightAbs);
  expect_close(buf, db.host(), 1e-6, "momentum");
}

// A step decided on the GPU: the kernels read {grad scale, apply} from device memory (AdamStep::control), taking the
// scale as the CPU kernel takes grad_scale, and write nothing when apply is 0; the sum of squares the step's norm
// comes from lands in device memory (sum_of_squares_to), equal to the one the host waits for.
TEST_F(CudaKernels, TheOptimizersReadTheirControlFromDeviceMemoryAndASkipWritesNothing) {
  const std::vector<float> w = normal(kN, 0.5f, 51), m = normal(kN, 0.01f, 52), g = normal(kN, 1.0f, 53);
  std::vector<float> v(kN);
  for (size_t i = 0; i < kN; ++i) v[i] = 0.1f * std::fabs(m[i]) + 1e-6f;
  kernels::AdamStep s;
  s.lr = 1e-3f;
  s.weight_decay = 0.1f;
  s.grad_scale = 0.37f;
  const kernels::AdamStep scalar = s.at_step(3);
  OnDevice<float> apply({0.37f, 1.0f}), skip({0.37f, 0.0f});
  for (const bool skipped : {false, true}) {
    SCOPED_TRACE(skipped ? "skip" : "apply");
    kernels::AdamStep k = scalar;
    k.grad_scale = 5.0f;  // (the control's scale is the step's)
    k.control = skipped ? skip.p : apply.p;
    std::vector<float> cw = w, cm = m, cv = v;
    std::vector<uint16_t> out(kN, 0x1234);
    if (!skipped) kernels::adam_step_f32(cw.data(), cm.data(), cv.data(), out.data(), g.data(), kN, scalar);
    OnDevice<float> dw(w), dm(m), dv(v), dg(g);
    OnDevice<uint16_t> dout{std::vector<uint16_t>(kN, 0x1234)};
    table_->adam_step_f32(dw.p, dm.p, dv.p, dout.p, dg.p, kN, k);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (skipped) {
      EXPECT_EQ(dw.host(), w);
      EXPECT_EQ(dm.host(), m);
      EXPECT_EQ(dv.host(), v);
      EXPECT_EQ(dout.host(), out);
    } else {
      expect_close(cw, dw.host(), 1e-6, "weights", kWeightAbs);
      expect_close(cm, dm.host(), 1e-6, "exp_avg");
      expect_close(cv, dv.host(), 1e-6, "exp_avg_sq");
      expect_within_one_bf16_step(out, dout.host());
    }
    kernels::SgdStep sgd;
    sgd.lr = 0.01f;
    sgd.grad_scale = 5.0f;
    sgd.control = k.control;
    std::vector<float> sw = w;
    kernels::SgdStep on_cpu = sgd;
    on_cpu.control = nullptr;
    on_cpu.grad_scale = 0.37f;
    if (!skipped) kernels::sgd_step_f32(sw.data(), nullptr, nullptr, g.data(), kN, on_cpu);
    OnDevice<float> sdw(w), sdg(g);
    table_->sgd_step_f32(sdw.p, nullptr, nullptr, sdg.p, kN, sgd);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (skipped)
      EXPECT_EQ(sdw.host(), w);
    else
      expect_close(sw, sdw.host(), 1e-6, "SGD's weights", kWeightAbs);
  }
  OnDevice<float> dg(g);
  OnDevice<double> sum({-1.0});
  table_->sum_of_squares_to(dg.p, GradElements::f32, kN, sum.p);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(sum.host()[0], table_->sum_of_squares_f32(dg.p, kN));
}

TEST_F(CudaKernels, LambsNormsAndUpdateMatchTheCpuKernel) {
  std::vector<float> w = normal(kN, 0.5f, 21), m = normal(kN, 0.01f, 22), g = normal(kN, 1.0f, 23);
  std::vector<float> v(kN, 1e-4f);
  kernels::LambStep s;
  s.lr = 1e-3f;
  s.weight_decay = 0.01f;
  const kernels::LambStep k = s.at_step(3);
  OnDevice<float> dw(w), dm(m), dv(v), dg(g);
  double w_cpu = 0, u_cpu = 0, w_gpu = 0, u_gpu = 0;
  kernels::lamb_moments_f32(w.data(), m.data(), v.data(), g.data(), kN, k, &w_cpu, &u_cpu);
  table_->lamb_moments_f32(dw.p, dm.p, dv.p, dg.p, kN, k, &w_gpu, &u_gpu);
  EXPECT_NEAR(w_gpu, w_cpu, 1e-9 * w_cpu);
  EXPECT_NEAR(u_gpu, u_cpu, 1e-6 * u_cpu);
  const float ratio = kernels::lamb_trust_ratio(w_cpu, u_cpu, k);
  kernels::lamb_apply(w.data(), m.data(), v.data(), nullptr, kN, k, ratio);
  table_->lamb_apply(dw.p, dm.p, dv.p, nullptr, kN, k, ratio);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_close(w, dw.host(), 1e-6, "weights", kWeightAbs);
}

TEST_F(CudaKernels, SumsOfSquaresMatchTheCpuAndRepeatBitForBit) {
  const std::vector<float> x = normal(kN, 3.0f, 31);
  const std::vector<uint16_t> xb = to_bf16(x);
  OnDevice<float> dx(x);
  OnDevice<uint16_t> dxb(xb);
  // Both sides add in double: the GPU to the CPU's scalar reference within double rounding over the
  // order of the additions. The CPU's fast kernel adds 256 elements in fp32 before widening: 1e-6 of it.
  const double exact = kernels::sum_of_squares_f32_reference(x.data(), kN), exact_b = kernels::sum_of_squares_bf16_reference(xb.data(), kN);
  const double gpu = table_->sum_of_squares_f32(dx.p, kN), gpu_b = table_->sum_of_squares_bf16(dxb.p, kN);
  EXPECT_NEAR(gpu, exact, 1e-12 * exact);
  EXPECT_NEAR(gpu_b, exact_b, 1e-12 * exact_b);
  EXPECT_NEAR(gpu, kernels::sum_of_squares_f32(x.data(), kN), 1e-6 * exact);
  EXPECT_NEAR(gpu_b, kernels::sum_of_squares_bf16(xb.data(), kN), 1e-6 * exact_b);
  // A start off the 16-byte loads' boundary (a partition's slice of a flat buffer): its head and tail read alone.
  for (const size_t skip : {size_t{1}, size_t{3}, size_t{7}}) {
    const double want = kernels::sum_of_squares_bf16_reference(xb.data() + skip, kN - skip - 2);
    EXPECT_NEAR(table_->sum_of_squares_bf16(dxb.p + skip, kN - skip - 2), want, 1e-12 * want) << "from element " << skip;
    const double want_f = kernels::sum_of_squares_f32_reference(x.data() + skip, kN - skip - 2);
    EXPECT_NEAR(table_->sum_of_squares_f32(dx.p + skip, kN - skip - 2), want_f, 1e-12 * want_f) << "from element " << skip;
  }
  const double again = table_->sum_of_squares_f32(dx.p, kN);
  EXPECT_EQ(std::memcmp(&gpu, &again, sizeof gpu), 0) << "a reduction that differs run to run";
  // An inf anywhere is seen (the overflow check reads this sum).
  std::vector<float> with_inf = x;
  with_inf[kN / 2] = INFINITY;
  OnDevice<float> dinf(with_inf);
  EXPECT_TRUE(std::isinf(table_->sum_of_squares_f32(dinf.p, kN)));
}

// The GPU's softmax cross-entropy against the CPU's double-precision reference on the same rows: each row's
// loss and every gradient element, for fp32 and bf16 logits, a vocabulary that is no multiple of the
// 16-byte loads (GPT-2's 50257) in rows padded to one and in rows packed tight, and a row whose target is
// its largest logit. The gradient's poisoned padding must stay untouched.
template <class T>
void check_cross_entropy(int64_t rows, int64_t vocab, int64_t stride, bool write_grad, unsigned seed,
                         kernels::cuda::CrossEntropyPath path = kernels::cuda::CrossEntropyPath::automatic) {
  std::vector<float> z = normal(static_cast<size_t>(rows * stride), 3.0f, seed);
  std::vector<int64_t> targets(static_cast<size_t>(rows));
  std::mt19937 gen(seed + 1);
  for (int64_t r = 0; r < rows; ++r) targets[r] = static_cast<int64_t>(gen() % static_cast<uint32_t>(vocab));
  targets[0] = static_cast<int64_t>(std::max_element(z.begin(), z.begin() + vocab) - z.begin());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = vocab; j < stride; ++j) z[r * stride + j] = 12345.0f;  // padding, never read or written
  std::vector<T> host;
  if constexpr (sizeof(T) == 2)
    host = to_bf16(z);
  else
    host = z;
  std::vector<T> expected = host;
  const float scale = 0.25f;
  double ref_sum = 0;
  std::vector<double> ref_rows(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    T* row = expected.data() + r * stride;
    if constexpr (sizeof(T) == 2)
      ref_rows[r] = kernels::softmax_cross_entropy_bf16_reference(row, &targets[r], 1, vocab, stride, scale, write_grad);
    else
      ref_rows[r] = kernels::softmax_cross_entropy_f32_reference(row, &targets[r], 1, vocab, stride, scale, write_grad);
    ref_sum += ref_rows[r];
  }
  OnDevice<T> d(host);
  OnDevice<int64_t> dt(targets);
  OnDevice<float> dloss(std::vector<float>(static_cast<size_t>(rows), NAN));
  if constexpr (sizeof(T) == 2)
    kernels::cuda::softmax_cross_entropy_bf16_by(path, d.p, dt.p, rows, vocab, stride, scale, write_grad, dloss.p, nullptr);
  else
    kernels::cuda::softmax_cross_entropy_f32(d.p, dt.p, rows, vocab, stride, scale, write_grad, dloss.p, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> losses = dloss.host();
  double sum = 0;
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_NEAR(losses[r], ref_rows[r], 1e-5 * std::fabs(ref_rows[r]) + 1e-5) << "row " << r;
    sum += losses[r];
  }
  EXPECT_NEAR(sum, ref_sum, 1e-5 * std::fabs(ref_sum));
  const std::vector<T> got = d.host();
  size_t bad = 0, padding_touched = 0;
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < stride; ++j) {
      const size_t i = static_cast<size_t>(r * stride + j);
      if (j >= vocab) {
        padding_touched += std::memcmp(&got[i], &host[i], sizeof(T)) != 0;
        continue;
      }
      double a, b;
      if constexpr (sizeof(T) == 2) {
        a = kernels::bf16_to_float(got[i]);
        b = kernels::bf16_to_float(expected[i]);
      } else {
        a = got[i];
        b = expected[i];
      }
      const double diff = std::fabs(a - b);
      worst = std::max(worst, diff);
      // One bf16 step (up to 2^-7 relative) where the two sides, exp in fp32 and in double, land on either
      // side of a rounding boundary.
      if (diff > (sizeof(T) == 2 ? 7.9e-3 : 1e-5) * std::fabs(b) + 1e-9) ++bad;
    }
  EXPECT_EQ(bad, 0u) << (write_grad ? "gradient" : "logits left alone") << ": largest difference " << worst;
  EXPECT_EQ(padding_touched, 0u) << "the kernel wrote past the vocabulary into a row's padding";
}

TEST_F(CudaKernels, SoftmaxCrossEntropyMatchesTheCpuReference) {
  check_cross_entropy<float>(37, 50257, 50264, true, 11);
  check_cross_entropy<float>(5, 50257, 50257, true, 12);  // rows packed: loads of one element
  check_cross_entropy<uint16_t>(37, 50257, 50264, true, 13);
  check_cross_entropy<uint16_t>(9, 1000, 1000, true, 14);
  check_cross_entropy<uint16_t>(6, 50257, 50264, false, 15);  // the loss alone: logits unchanged
  check_cross_entropy<float>(3, 7, 8, true, 16);  // a vocabulary smaller than one load
  // Each way a bf16 row is read, whatever automatic picks: twice from device memory, or once into shared memory.
  for (const auto path : {kernels::cuda::CrossEntropyPath::two_pass, kernels::cuda::CrossEntropyPath::row_in_shared}) {
    check_cross_entropy<uint16_t>(37, 50257, 50264, true, 17, path);
    check_cross_entropy<uint16_t>(9, 1000, 1000, true, 18, path);
  }
}

TEST_F(CudaKernels, SoftmaxCrossEntropyNamesABadShape) {
  EXPECT_THROW(kernels::cuda::softmax_cross_entropy_f32(nullptr, nullptr, 4, 100, 50, 1.0f, true, nullptr, nullptr),
               std::runtime_error);
}

// The GPU's dropout drops what the CPU's drops, bit for bit (the mask is one function of key and index, the
// kept values one fp32 product rounded once), fp32 and bf16, at a size no multiple of the launch's width.
TEST_F(CudaKernels, DropoutDropsWhatTheCpuDropsBitForBit) {
  const int64_t n = 1000003;
  const uint32_t keep_below = kernels::dropout_keep_below(0.1);
  const float scale = static_cast<float>(1 / 0.9);
  const std::vector<float> x = normal(static_cast<size_t>(n), 1.0f, 21);
  std::vector<float> want(x.size());
  kernels::dropout_f32(x.data(), want.data(), n, 0x1234567887654321ull, keep_below, scale);
  OnDevice<float> dx(x), dy(std::vector<float>(x.size(), NAN));
  kernels::cuda::dropout_f32(dx.p, dy.p, n, 0x1234567887654321ull, keep_below, scale, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(std::memcmp(dy.host().data(), want.data(), want.size() * sizeof(float)), 0);
  const std::vector<uint16_t> xb = to_bf16(x);
  std::vector<uint16_t> want_b(xb.size());
  kernels::dropout_bf16(xb.data(), want_b.data(), n, 99, keep_below, scale);
  OnDevice<uint16_t> dxb(xb), dyb(std::vector<uint16_t>(xb.size(), 0xffff));
  kernels::cuda::dropout_bf16(dxb.p, dyb.p, n, 99, keep_below, scale, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(std::memcmp(dyb.host().data(), want_b.data(), want_b.size() * sizeof(uint16_t)), 0);
}

// The GPU's LayerNorm and RMSNorm against the CPU's scalar reference (double statistics) on the same rows:
// fp32 and bf16, a width of whole 16-byte loads (768, 2048) and one that is not (1001), more rows than one chunk
// of the weight gradients' sums; dw and db added to what they held; the gradients the same from run to run.
template <class T>
std::vector<float> widened(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    if constexpr (sizeof(T) == 2)
      out[i] = kernels::bf16_to_float(v[i]);
    else
      out[i] = v[i];
  }
  return out;
}

// A device copy of `host` placed `pad` elements past its allocation's start: pad 1 takes every 16-byte load off
// its boundary, so the kernels' one-element-a-load path runs.
template <class T>
std::vector<T> padded(const std::vector<T>& host, size_t pad) {
  std::vector<T> v(pad);
  v.insert(v.end(), host.begin(), host.end());
  return v;
}

template <class T>
struct Shifted {
  Shifted(const std::vector<T>& host, size_t pad_) : dev(padded(host, pad_)), pad(pad_), p(dev.p + pad_) {}
  std::vector<T> host() const {
    const std::vector<T> all = dev.host();
    return std::vector<T>(all.begin() + static_cast<std::ptrdiff_t>(pad), all.end());
  }
  OnDevice<T> dev;
  size_t pad;
  T* p;
};

// v as T's elements (bf16 rounded to nearest even).
template <class T>
std::vector<T> typed(const std::vector<float>& v) {
  if constexpr (sizeof(T) == 2)
    return to_bf16(v);
  else
    return v;
}

template <class T>
void check_norm(int64_t rows, int64_t C, bool rms, unsigned seed, size_t pad = 0) {
  SCOPED_TRACE(testing::Message() << (sizeof(T) == 2 ? "bf16 " : "fp32 ") << (rms ? "RMSNorm " : "LayerNorm ") << rows << " x " << C
                                  << (pad ? ", off the loads' boundary" : ""));
  const kernels::NormShape s{rows, C, 1e-5f, rms};
  const size_t n = static_cast<size_t>(rows * C);
  auto typed = [](std::vector<float> v) {
    if constexpr (sizeof(T) == 2)
      return to_bf16(v);
    else
      return v;
  };
  std::vector<float> xf = normal(n, 2.0f, seed);
  for (float& v : xf) v += 0.75f;  // a mean to take away
  const std::vector<T> x = typed(xf), w = typed(normal(static_cast<size_t>(C), 1.0f, seed + 1)),
                       b = rms ? std::vector<T>() : typed(normal(static_cast<size_t>(C), 0.5f, seed + 2)),
                       dy = typed(normal(n, 1.0f, seed + 3));
  const T* b_host = rms ? nullptr : b.data();
  std::vector<T> y_ref(n), dx_ref(n);
  std::vector<float> mean_ref(static_cast<size_t>(rows)), rstd_ref(mean_ref.size()), dw_ref(static_cast<size_t>(C), 0.25f),
      db_ref(dw_ref);
  if constexpr (sizeof(T) == 2) {
    kernels::norm_forward_bf16_reference(x.data(), w.data(), b_host, y_ref.data(), mean_ref.data(), rstd_ref.data(), s);
    kernels::norm_backward_bf16_reference(dy.data(), x.data(), w.data(), mean_ref.data(), rstd_ref.data(), dx_ref.data(), dw_ref.data(),
                                          rms ? nullptr : db_ref.data(), s);
  } else {
    kernels::norm_forward_f32_reference(x.data(), w.data(), b_host, y_ref.data(), mean_ref.data(), rstd_ref.data(), s);
    kernels::norm_backward_f32_reference(dy.data(), x.data(), w.data(), mean_ref.data(), rstd_ref.data(), dx_ref.data(), dw_ref.data(),
                                         rms ? nullptr : db_ref.data(), s);
  }
  Shifted<T> d_x(x, pad), d_w(w, pad), d_dy(dy, pad), d_y(std::vector<T>(n), pad), d_dx(std::vector<T>(n), pad);
  std::unique_ptr<Shifted<T>> d_b = rms ? nullptr : std::make_unique<Shifted<T>>(b, pad);
  OnDevice<float> dmean(std::vector<float>(static_cast<size_t>(rows), NAN)), drstd(dmean.host());
  OnDevice<float> scratch(std::vector<float>(static_cast<size_t>(kernels::cuda::norm_backward_scratch_floats(s)), NAN));
  std::vector<std::vector<float>> dws, dbs;
  for (int run = 0; run < 2; ++run) {
    OnDevice<float> ddw(std::vector<float>(static_cast<size_t>(C), 0.25f)), ddb(ddw.host());
    float* db_dev = rms ? nullptr : ddb.p;
    if constexpr (sizeof(T) == 2) {
      kernels::cuda::norm_forward_bf16(d_x.p, nullptr, d_w.p, rms ? nullptr : d_b->p, nullptr, d_y.p, dmean.p, drstd.p, s, nullptr);
      kernels::cuda::norm_backward_bf16(d_dy.p, nullptr, d_x.p, d_w.p, dmean.p, drstd.p, d_dx.p, ddw.p, db_dev, scratch.p, s, nullptr);
    } else {
      kernels::cuda::norm_forward_f32(d_x.p, nullptr, d_w.p, rms ? nullptr : d_b->p, nullptr, d_y.p, dmean.p, drstd.p, s, nullptr);
      kernels::cuda::norm_backward_f32(d_dy.p, nullptr, d_x.p, d_w.p, dmean.p, drstd.p, d_dx.p, ddw.p, db_dev, scratch.p, s, nullptr);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    dws.push_back(ddw.host());
    dbs.push_back(ddb.host());
  }
  const bool bf16 = sizeof(T) == 2;
  expect_close(mean_ref, dmean.host(), 1e-5, "mean", 1e-5);
  expect_close(rstd_ref, drstd.host(), 1e-5, "rstd");
  // One bf16 step (2^-7 relative) where fp32 and double land on either side of a rounding boundary.
  expect_close(widened(y_ref), widened(d_y.host()), bf16 ? 7.9e-3 : 2e-5, "y", bf16 ? 1e-3 : 1e-5);
  expect_close(widened(dx_ref), widened(d_dx.host()), bf16 ? 7.9e-3 : 1e-4, "dx", bf16 ? 1e-3 : 1e-5);
  expect_close(dw_ref, dws[0], 1e-4, "dw", 2e-3);
  if (rms) {
    EXPECT_EQ(dbs[0], std::vector<float>(static_cast<size_t>(C), 0.25f)) << "RMSNorm wrote a bias gradient";
  } else {
    expect_close(db_ref, dbs[0], 1e-4, "db", 2e-3);
  }
  EXPECT_EQ(std::memcmp(dws[0].data(), dws[1].data(), dws[0].size() * sizeof(float)), 0) << "dw differs from run to run";
  EXPECT_EQ(std::memcmp(dbs[0].data(), dbs[1].data(), dbs[0].size() * sizeof(float)), 0) << "db differs from run to run";
}

TEST_F(CudaKernels, LayerNormAndRmsNormMatchTheCpuReference) {
  check_norm<float>(300, 768, false, 31);
  check_norm<uint16_t>(300, 768, false, 32);
  check_norm<uint16_t>(97, 1001, false, 33);  // one element a load
  check_norm<float>(57, 1001, true, 34);
  check_norm<uint16_t>(300, 2048, true, 35);
  check_norm<float>(3000, 256, false, 36);  // 47 chunks of rows for dw and db
  check_norm<uint16_t>(1, 8, true, 37);
  check_norm<float>(40, 1000, false, 38);  // whole loads, but no whole number of a warp's loads a row
  check_norm<uint16_t>(40, 1000, true, 39);
  check_norm<uint16_t>(33, 768, false, 40, 1);  // pointers off the 16-byte boundary
  check_norm<float>(33, 768, true, 41, 3);
}

// A residual sum and the norm after it in one kernel equal the add and the norm apart, bit for bit: the sum rounded
// to the element type (and written), the statistics and y of that sum; in backward dx rounded, then the sum's other
// gradient added and rounded again, as autograd adds two gradients of one tensor. fp32 and bf16, whole 16-byte
// loads and not, every pointer off the boundary, or only the residual's and the sum's gradient (`pad_residual`:
// the add's fresh sum lies on it, so the norm apart loads 16 bytes at a time where the residual form cannot).
template <class T>
void check_residual_norm(int64_t rows, int64_t C, bool rms, unsigned seed, size_t pad = 0, size_t pad_residual = 0) {
  SCOPED_TRACE(testing::Message() << (sizeof(T) == 2 ? "bf16 " : "fp32 ") << (rms ? "RMSNorm " : "LayerNorm ") << rows << " x " << C
                                  << (pad ? ", off the loads' boundary" : "") << (pad_residual ? ", the residual off it" : ""));
  const kernels::NormShape s{rows, C, 1e-5f, rms};
  const size_t n = static_cast<size_t>(rows * C);
  const std::vector<T> x = typed<T>(normal(n, 2.0f, seed)), res = typed<T>(normal(n, 1.0f, seed + 1)),
                       w = typed<T>(normal(static_cast<size_t>(C), 1.0f, seed + 2)), b = typed<T>(normal(static_cast<size_t>(C), 0.5f, seed + 3)),
                       dy = typed<T>(normal(n, 1.0f, seed + 4)), dsum = typed<T>(normal(n, 1.0f, seed + 5));
  // The add as a T tensor holds it: fp32 sums of the widened values, rounded once.
  std::vector<float> sum_f(n);
  const std::vector<float> xf = widened(x), rf = widened(res);
  for (size_t i = 0; i < n; ++i) sum_f[i] = xf[i] + rf[i];
  const std::vector<T> sum = typed<T>(sum_f);
  const auto fn = [&](auto f32, auto bf16) {
    if constexpr (sizeof(T) == 2) return bf16;
    else return f32;
  };
  const auto forward = fn(kernels::cuda::norm_forward_f32, kernels::cuda::norm_forward_bf16);
  const auto backward = fn(kernels::cuda::norm_backward_f32, kernels::cuda::norm_backward_bf16);
  Shifted<T> d_x(x, pad), d_res(res, pad + pad_residual), d_sum_in(sum, pad), d_w(w, pad), d_b(b, pad), d_dy(dy, pad),
      d_dsum(dsum, pad + pad_residual);
  Shifted<T> d_sum(std::vector<T>(n), pad), y_fused(std::vector<T>(n), pad), y_apart(std::vector<T>(n), pad);
  Shifted<T> dx_fused(std::vector<T>(n), pad), dx_apart(std::vector<T>(n), pad);
  OnDevice<float> mean_f(std::vector<float>(static_cast<size_t>(rows))), rstd_f(mean_f.host()), mean_a(mean_f.host()), rstd_a(mean_f.host());
  OnDevice<float> dw_f(std::vector<float>(static_cast<size_t>(C))), dw_a(dw_f.host()), db_f(dw_f.host()), db_a(dw_f.host());
  OnDevice<float> scratch(std::vector<float>(static_cast<size_t>(kernels::cuda::norm_backward_scratch_floats(s))));
  T* bias = rms ? nullptr : d_b.p;
  forward(d_x.p, d_res.p, d_w.p, bias, d_sum.p, y_fused.p, mean_f.p, rstd_f.p, s, nullptr);
  forward(d_sum_in.p, nullptr, d_w.p, bias, nullptr, y_apart.p, mean_a.p, rstd_a.p, s, nullptr);
  backward(d_dy.p, d_dsum.p, d_sum.p, d_w.p, mean_f.p, rstd_f.p, dx_fused.p, dw_f.p, rms ? nullptr : db_f.p, scratch.p, s, nullptr);
  backward(d_dy.p, nullptr, d_sum_in.p, d_w.p, mean_a.p, rstd_a.p, dx_apart.p, dw_a.p, rms ? nullptr : db_a.p, scratch.p, s, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto same = [](const auto& a, const auto& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  EXPECT_TRUE(same(d_sum.host(), sum)) << "the sum written";
  EXPECT_TRUE(same(y_fused.host(), y_apart.host())) << "y";
  EXPECT_TRUE(same(mean_f.host(), mean_a.host()) && same(rstd_f.host(), rstd_a.host())) << "mean, rstd";
  EXPECT_TRUE(same(dw_f.host(), dw_a.host()) && same(db_f.host(), db_a.host())) << "dw, db";
  // dx apart, then the sum's other gradient added as a T tensor add does it.
  const std::vector<float> apart = widened(dx_apart.host()), other = widened(dsum);
  std::vector<float> want(n);
  for (size_t i = 0; i < n; ++i) want[i] = apart[i] + other[i];
  EXPECT_TRUE(same(dx_fused.host(), typed<T>(want))) << "dx";
}

TEST_F(CudaKernels, AResidualSumAndItsNormInOneKernelEqualTheAddAndTheNormApart) {
  check_residual_norm<uint16_t>(300, 768, false, 81);
  check_residual_norm<float>(300, 768, true, 82);
  check_residual_norm<uint16_t>(97, 1001, true, 83);  // one element a load
  check_residual_norm<float>(57, 1001, false, 84);
  check_residual_norm<uint16_t>(33, 2048, false, 85, 1);  // pointers off the 16-byte boundary
  check_residual_norm<uint16_t>(40, 768, false, 86, 0, 1);  // only the residual and the sum's gradient off it
  check_residual_norm<float>(40, 768, true, 87, 0, 2);
}

TEST_F(CudaKernels, NormNamesABadShape) {
  EXPECT_THROW(kernels::cuda::norm_forward_f32(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, kernels::NormShape{4, 0, 1e-5f, false},
                                               nullptr),
               std::runtime_error);
}

// GELU, SwiGLU and the rotary embedding on the GPU against the CPU's scalar references (double math) on the
// same inputs: fp32 within float rounding, bf16 within one bf16 step; sizes that are whole 16-byte loads and
// sizes that are not.

template <class T>
void expect_like_reference(const std::vector<T>& want, const std::vector<T>& got, const char* what) {
  const bool bf16 = sizeof(T) == 2;
  // An absolute part for results near a zero of the function (GELU's and SwiGLU's derivatives cross zero: terms cancel).
  // fp32: GELU's derivative loses a term of about 2e-6 of its value near x = 5, where 1 + exp(-2u) rounds to 1.
  expect_close(widened(want), widened(got), bf16 ? 7.9e-3 : 4e-6, what, bf16 ? 1e-5 : 1e-6);
}

template <class T>
void check_activations(int64_t n, unsigned seed, size_t pad = 0) {
  SCOPED_TRACE(testing::Message() << (sizeof(T) == 2 ? "bf16, " : "fp32, ") << n << " elements"
                                  << (pad ? ", off the loads' boundary" : ""));
  const size_t m = static_cast<size_t>(n);
  const std::vector<T> x = typed<T>(normal(m, 3.0f, seed)), u = typed<T>(normal(m, 1.0f, seed + 1)),
                       dy = typed<T>(normal(m, 1.0f, seed + 2));
  std::vector<T> y_ref(m), dx_ref(m), s_ref(m), dg_ref(m), du_ref(m);
  if constexpr (sizeof(T) == 2) {
    kernels::gelu_tanh_forward_bf16_reference(x.data(), y_ref.data(), n);
    kernels::gelu_tanh_backward_bf16_reference(dy.data(), x.data(), dx_ref.data(), n);
    kernels::swiglu_forward_bf16_reference(x.data(), u.data(), s_ref.data(), n);
    kernels::swiglu_backward_bf16_reference(dy.data(), x.data(), u.data(), dg_ref.data(), du_ref.data(), n);
  } else {
    kernels::gelu_tanh_forward_f32_reference(x.data(), y_ref.data(), n);
    kernels::gelu_tanh_backward_f32_reference(dy.data(), x.data(), dx_ref.data(), n);
    kernels::swiglu_forward_f32_reference(x.data(), u.data(), s_ref.data(), n);
    kernels::swiglu_backward_f32_reference(dy.data(), x.data(), u.data(), dg_ref.data(), du_ref.data(), n);
  }
  const std::vector<T> out(m);
  Shifted<T> d_x(x, pad), d_u(u, pad), d_dy(dy, pad), d_y(out, pad), d_dx(out, pad), d_s(out, pad), d_dg(out, pad), d_du(out, pad);
  if constexpr (sizeof(T) == 2) {
    kernels::cuda::gelu_tanh_forward_bf16(d_x.p, d_y.p, n, nullptr);
    kernels::cuda::gelu_tanh_backward_bf16(d_dy.p, d_x.p, d_dx.p, n, nullptr);
    kernels::cuda::swiglu_forward_bf16(d_x.p, d_u.p, d_s.p, n, nullptr);
    kernels::cuda::swiglu_backward_bf16(d_dy.p, d_x.p, d_u.p, d_dg.p, d_du.p, n, nullptr);
  } else {
    kernels::cuda::gelu_tanh_forward_f32(d_x.p, d_y.p, n, nullptr);
    kernels::cuda::gelu_tanh_backward_f32(d_dy.p, d_x.p, d_dx.p, n, nullptr);
    kernels::cuda::swiglu_forward_f32(d_x.p, d_u.p, d_s.p, n, nullptr);
    kernels::cuda::swiglu_backward_f32(d_dy.p, d_x.p, d_u.p, d_dg.p, d_du.p, n, nullptr);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_like_reference(y_ref, d_y.host(), "gelu");
  expect_like_reference(dx_ref, d_dx.host(), "gelu's dx");
  expect_like_reference(s_ref, d_s.host(), "swiglu");
  expect_like_reference(dg_ref, d_dg.host(), "swiglu's d gate");
  expect_like_reference(du_ref, d_du.host(), "swiglu's d up");
}

TEST_F(CudaKernels, GeluAndSwigluMatchTheCpuReference) {
  check_activations<float>(65536, 41);
  check_activations<float>(100003, 42);  // one element a load
  check_activations<uint16_t>(65536, 43);
  check_activations<uint16_t>(100003, 44);
  check_activations<uint16_t>(5, 45);
  check_activations<uint16_t>(65536, 46, 1);  // pointers off the 16-byte boundary
  check_activations<float>(65536, 47, 3);
}

// transposed: x given as it lies in (B, heads, T, D), as an attention's gradient comes, read by its strides.
template <class T>
void check_rope(int64_t B, int64_t T_len, int64_t heads, int64_t D, bool inverse, unsigned seed, bool transposed = false) {
  SCOPED_TRACE(testing::Message() << (sizeof(T) == 2 ? "bf16 " : "fp32 ") << B << " x " << T_len << " x " << heads << " x " << D
                                  << (inverse ? ", inverse" : "") << (transposed ? ", read by its strides" : ""));
  const kernels::RopeShape s{B * T_len, T_len, heads, D, inverse};
  const size_t n = static_cast<size_t>(B * T_len * heads * D), half = static_cast<size_t>(D / 2);
  const std::vector<T> x = typed<T>(normal(n, 1.0f, seed));
  std::vector<float> cos(static_cast<size_t>(T_len) * half), sin(cos.size());
  for (int64_t t = 0; t < T_len; ++t)
    for (size_t j = 0; j < half; ++j) {
      const double angle = static_cast<double>(t) * std::pow(10000.0, -2.0 * static_cast<double>(j) / static_cast<double>(D));
      cos[t * half + j] = static_cast<float>(std::cos(angle));
      sin[t * half + j] = static_cast<float>(std::sin(angle));
    }
  std::vector<T> want(n);
  if constexpr (sizeof(T) == 2)
    kernels::rope_bf16_reference(x.data(), want.data(), cos.data(), sin.data(), s);
  else
    kernels::rope_f32_reference(x.data(), want.data(), cos.data(), sin.data(), s);
  if (transposed) {
    std::vector<T> lying(n);  // element (b, t, h, j) at ((b heads + h) T + t) D + j
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T_len; ++t)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t j = 0; j < D; ++j) lying[((b * heads + h) * T_len + t) * D + j] = x[((b * T_len + t) * heads + h) * D + j];
    const kernels::cuda::RopeStrides strides{heads * T_len * D, D, T_len * D};
    OnDevice<T> d_lying(lying), d_y{std::vector<T>(n)};
    OnDevice<float> d_cos(cos), d_sin(sin);
    if constexpr (sizeof(T) == 2)
      kernels::cuda::rope_bf16(d_lying.p, d_y.p, d_cos.p, d_sin.p, s, nullptr, &strides);
    else
      kernels::cuda::rope_f32(d_lying.p, d_y.p, d_cos.p, d_sin.p, s, nullptr, &strides);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_like_reference(want, d_y.host(), "rotary of a strided x");
    return;
  }
  OnDevice<T> d_x(x), d_y{std::vector<T>(n)};
  OnDevice<float> d_cos(cos), d_sin(sin);
  if constexpr (sizeof(T) == 2)
    kernels::cuda::rope_bf16(d_x.p, d_y.p, d_cos.p, d_sin.p, s, nullptr);
  else
    kernels::cuda::rope_f32(d_x.p, d_y.p, d_cos.p, d_sin.p, s, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_like_reference(want, d_y.host(), "rotary");
  // In place, as the CPU's allows.
  if constexpr (sizeof(T) == 2)
    kernels::cuda::rope_bf16(d_x.p, d_x.p, d_cos.p, d_sin.p, s, nullptr);
  else
    kernels::cuda::rope_f32(d_x.p, d_x.p, d_cos.p, d_sin.p, s, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(std::memcmp(d_x.host().data(), d_y.host().data(), n * sizeof(T)), 0) << "in place differs";
}

TEST_F(CudaKernels, RotaryMatchesTheCpuReference) {
  check_rope<float>(2, 37, 3, 64, false, 51);
  check_rope<float>(2, 37, 3, 64, true, 52);
  check_rope<uint16_t>(3, 129, 4, 128, false, 53);
  check_rope<uint16_t>(1, 5, 2, 10, true, 54);  // D/2 = 5: one pair a thread
  // Read by strides (an attention's gradient): 16-byte loads (D 64, 128) and one element a load (D 10).
  check_rope<uint16_t>(2, 33, 4, 64, true, 55, true);
  check_rope<float>(2, 17, 3, 128, false, 56, true);
  check_rope<uint16_t>(2, 9, 3, 10, false, 57, true);
  EXPECT_THROW(kernels::cuda::rope_f32(nullptr, nullptr, nullptr, nullptr, kernels::RopeShape{4, 2, 1, 3, false}, nullptr),
               std::runtime_error);
}

// A bias's gradient as the GPU sums it: out += each column's sum over the rows, against the sums in double, out
// rounded once; fp32 and bf16, more rows than one chunk, a width no multiple of a warp's columns, whole 16-byte loads
// and x off their boundary.
template <class T>
void check_column_sums(int64_t rows, int64_t cols, unsigned seed, size_t pad = 0) {
  SCOPED_TRACE(testing::Message() << (sizeof(T) == 2 ? "bf16 " : "fp32 ") << rows << " x " << cols
                                  << (pad ? ", off the loads' boundary" : ""));
  const std::vector<T> x = typed<T>(normal(static_cast<size_t>(rows * cols), 1.0f, seed));
  const std::vector<float> x_f = widened(x);
  std::vector<float> want(static_cast<size_t>(cols));
  for (int64_t c = 0; c < cols; ++c) {
    double sum = 0.5;  // what out held
    for (int64_t r = 0; r < rows; ++r) sum += x_f[static_cast<size_t>(r * cols + c)];
    want[static_cast<size_t>(c)] = static_cast<float>(sum);
  }
  Shifted<T> d_x(x, pad);
  OnDevice<T> d_out(typed<T>(std::vector<float>(static_cast<size_t>(cols), 0.5f)));
  OnDevice<float> scratch(std::vector<float>(static_cast<size_t>(kernels::cuda::column_sums_scratch_floats(rows, cols)), NAN));
  if constexpr (sizeof(T) == 2)
    kernels::cuda::column_sums_add_bf16(d_x.p, rows, cols, d_out.p, scratch.p, nullptr);
  else
    kernels::cuda::column_sums_add_f32(d_x.p, rows, cols, d_out.p, scratch.p, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // fp32 sums of up to 3000 terms of about 1 in another order: 1e-4 of sqrt(rows) absolute.
  expect_close(want, widened(d_out.host()), sizeof(T) == 2 ? 7.9e-3 : 1e-5, "column sums", 1e-4 * std::sqrt(static_cast<double>(rows)));
}

TEST_F(CudaKernels, ColumnSumsAddABiasGradientOnce) {
  check_column_sums<float>(3000, 130, 61);
  check_column_sums<uint16_t>(1000, 768, 62);
  check_column_sums<uint16_t>(5, 3, 63);
  check_column_sums<uint16_t>(700, 2048, 64);  // 8 columns a thread, 256 a block
  check_column_sums<float>(700, 2048, 65);     // 4 a thread
  check_column_sums<uint16_t>(300, 768, 66, 1);  // off the boundary: one a thread
  check_column_sums<float>(300, 1000, 67, 2);
}

// The fp16 model kernels are the fp32 kernels' arithmetic with fp16 loads and stores: on fp16 inputs, each fp16
// output is the fp32 kernel's output on the same (widened) values rounded to fp16 once. The elementwise ops
// (GELU, SwiGLU, rotary, dropout) compute every element alike both ways: equal after that rounding, or one fp16
// step apart where nvcc contracts a multiply-add differently and the two land on either side of a boundary (a
// kernel that truncated, or rounded twice through bf16, would be off in about half of them). The row ops (norms,
// cross-entropy) sum in another order with 8 fp16 a load instead of 4 fp32: their fp32 statistics agree to float
// rounding, their fp16 outputs within one step. Sizes that are whole 16-byte loads and some that are not.
namespace {

std::vector<uint16_t> to_fp16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = kernels::float_to_fp16(v[i]);
  return out;
}

std::vector<float> from_fp16(const std::vector<uint16_t>& h) {
  std::vector<float> out(h.size());
  for (size_t i = 0; i < h.size(); ++i) out[i] = kernels::fp16_to_float(h[i]);
  return out;
}

// fp16 values as `got` against the fp32 results `want` rounded once: how many differ, and whether any is more
// than one step away (the bit patterns of finite fp16 values, sign and magnitude, are consecutive steps).
void expect_rounded_once(const std::vector<float>& want, const std::vector<uint16_t>& got, const char* what,
                         double most_unequal_fraction) {
  ASSERT_EQ(want.size(), got.size());
  const auto line = [](uint16_t h) { return (h & 0x8000) ? -static_cast<int32_t>(h & 0x7fff) : static_cast<int32_t>(h & 0x7fff); };
  size_t unequal = 0, far = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const uint16_t w = kernels::float_to_fp16(want[i]);
    if (w == got[i] || (line(w) == 0 && line(got[i]) == 0)) continue;  // (+0 and -0 alike)
    ++unequal;
    if (std::abs(line(w) - line(got[i])) > 1 || (got[i] & 0x7c00) == 0x7c00) ++far;
  }
  EXPECT_EQ(far, 0u) << what << ": fp16 outputs more than one step from the fp32 kernel's, rounded";
  EXPECT_LE(static_cast<double>(unequal), most_unequal_fraction * static_cast<double>(want.size()))
      << what << ": " << unequal << " of " << want.size() << " differ by a step";
}

}  // namespace

TEST_F(CudaKernels, Fp16ElementwiseKernelsRoundTheFp32KernelsOnce) {
  for (const int64_t n : {int64_t{65536}, int64_t{1000003}}) {
    SCOPED_TRACE(testing::Message() << n << " elements");
    const size_t un = static_cast<size_t>(n);
    const std::vector<uint16_t> xh = to_fp16(normal(un, 2.0f, 71)), uh = to_fp16(normal(un, 1.0f, 72)),
                                dyh = to_fp16(normal(un, 0.5f, 73));
    const std::vector<float> x = from_fp16(xh), u = from_fp16(uh), dy = from_fp16(dyh);
    OnDevice<float> fx(x), fu(u), fdy(dy), fy{std::vector<float>(un)}, fdx{std::vector<float>(un)}, fdu{std::vector<float>(un)};
    OnDevice<uint16_t> hx(xh), hu(uh), hdy(dyh), hy{std::vector<uint16_t>(un)}, hdx{std::vector<uint16_t>(un)},
        hdu{std::vector<uint16_t>(un)};
    const auto compare = [&](const char* what, OnDevice<float>& f, OnDevice<uint16_t>& h) {
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      expect_rounded_once(f.host(), h.host(), what, 1e-3);
    };
    kernels::cuda::gelu_tanh_forward_f32(fx.p, fy.p, n, nullptr);
    kernels::cuda::gelu_tanh_forward_fp16(hx.p, hy.p, n, nullptr);
    compare("gelu forward", fy, hy);
    kernels::cuda::gelu_tanh_backward_f32(fdy.p, fx.p, fdx.p, n, nullptr);
    kernels::cuda::gelu_tanh_backward_fp16(hdy.p, hx.p, hdx.p, n, nullptr);
    compare("gelu backward", fdx, hdx);
    kernels::cuda::swiglu_forward_f32(fx.p, fu.p, fy.p, n, nullptr);
    kernels::cuda::swiglu_forward_fp16(hx.p, hu.p, hy.p, n, nullptr);
    compare("swiglu forward", fy, hy);
    kernels::cuda::swiglu_backward_f32(fdy.p, fx.p, fu.p, fdx.p, fdu.p, n, nullptr);
    kernels::cuda::swiglu_backward_fp16(hdy.p, hx.p, hu.p, hdx.p, hdu.p, n, nullptr);
    compare("swiglu backward (gate)", fdx, hdx);
    compare("swiglu backward (up)", fdu, hdu);
    // Dropout: one product a kept element, so equal after rounding; the same elements dropped as the CPU's mask.
    const uint32_t keep_below = kernels::dropout_keep_below(0.1);
    const float scale = static_cast<float>(1 / 0.9);
    kernels::cuda::dropout_f32(fx.p, fy.p, n, 0xabcdef, keep_below, scale, nullptr);
    kernels::cuda::dropout_fp16(hx.p, hy.p, n, 0xabcdef, keep_below, scale, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_rounded_once(fy.host(), hy.host(), "dropout", 0);
    std::vector<float> cpu(un);
    kernels::dropout_f32(x.data(), cpu.data(), n, 0xabcdef, keep_below, scale);
    const std::vector<uint16_t> dropped = hy.host();
    size_t mask_differs = 0;
    for (size_t i = 0; i < un; ++i) mask_differs += (cpu[i] == 0 && x[i] != 0) != ((dropped[i] & 0x7fff) == 0 && x[i] != 0);
    EXPECT_EQ(mask_differs, 0u) << "dropout's fp16 mask is not the CPU's";
  }
  // Rotary, both ways and in place, over heads of an odd half-width (5 pairs: no 16-byte loads).
  for (const int64_t D : {int64_t{128}, int64_t{10}}) {
    const kernels::RopeShape s{3 * 33, 33, 4, D, D == 10};
    const size_t n = static_cast<size_t>(s.rows * s.heads * D), half = static_cast<size_t>(D / 2);
    std::vector<float> cos(static_cast<size_t>(s.T) * half), sin(cos.size());
    for (size_t i = 0; i < cos.size(); ++i) {
      cos[i] = static_cast<float>(std::cos(0.37 * static_cast<double>(i)));
      sin[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i)));
    }
    const std::vector<uint16_t> xh = to_fp16(normal(n, 1.0f, 74));
    OnDevice<float> fx(from_fp16(xh)), fy{std::vector<float>(n)}, d_cos(cos), d_sin(sin);
    OnDevice<uint16_t> hx(xh), hy{std::vector<uint16_t>(n)};
    kernels::cuda::rope_f32(fx.p, fy.p, d_cos.p, d_sin.p, s, nullptr);
    kernels::cuda::rope_fp16(hx.p, hy.p, d_cos.p, d_sin.p, s, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_rounded_once(fy.host(), hy.host(), "rotary", 1e-3);
    kernels::cuda::rope_fp16(hx.p, hx.p, d_cos.p, d_sin.p, s, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(hx.host(), hy.host()) << "rotary in place differs";
  }
}

TEST_F(CudaKernels, Fp16NormsAndBiasSumsRoundTheFp32KernelsOnce) {
  using Shape = std::tuple<int64_t, int64_t, bool>;  // rows, columns, RMSNorm
  for (const auto& [rows, C, rms] : {Shape{1000, 768, false}, Shape{300, 1001, true}, Shape{70, 2048, true}}) {
    SCOPED_TRACE(testing::Message() << (rms ? "RMSNorm " : "LayerNorm ") << rows << " x " << C);
    const kernels::NormShape s{rows, C, 1e-5f, rms};
    const size_t n = static_cast<size_t>(rows * C), c = static_cast<size_t>(C), r = static_cast<size_t>(rows);
    const std::vector<uint16_t> xh = to_fp16(normal(n, 1.5f, 81)), wh = to_fp16(normal(c, 1.0f, 82)), bh = to_fp16(normal(c, 0.2f, 83)),
                                dyh = to_fp16(normal(n, 1.0f, 84));
    OnDevice<float> fx(from_fp16(xh)), fw(from_fp16(wh)), fb(from_fp16(bh)), fdy(from_fp16(dyh)), fy{std::vector<float>(n)},
        fdx{std::vector<float>(n)}, fmean{std::vector<float>(r)}, frstd{std::vector<float>(r)}, fdw{std::vector<float>(c, 0.5f)},
        fdb{std::vector<float>(c, 0.5f)};
    OnDevice<uint16_t> hx(xh), hw(wh), hb(bh), hdy(dyh), hy{std::vector<uint16_t>(n)}, hdx{std::vector<uint16_t>(n)};
    OnDevice<float> hmean{std::vector<float>(r)}, hrstd{std::vector<float>(r)}, hdw{std::vector<float>(c, 0.5f)},
        hdb{std::vector<float>(c, 0.5f)};
    OnDevice<float> scratch(std::vector<float>(static_cast<size_t>(kernels::cuda::norm_backward_scratch_floats(s))));
    kernels::cuda::norm_forward_f32(fx.p, nullptr, fw.p, rms ? nullptr : fb.p, nullptr, fy.p, fmean.p, frstd.p, s, nullptr);
    kernels::cuda::norm_forward_fp16(hx.p, nullptr, hw.p, rms ? nullptr : hb.p, nullptr, hy.p, hmean.p, hrstd.p, s, nullptr);
    kernels::cuda::norm_backward_f32(fdy.p, nullptr, fx.p, fw.p, fmean.p, frstd.p, fdx.p, fdw.p, rms ? nullptr : fdb.p, scratch.p, s, nullptr);
    kernels::cuda::norm_backward_fp16(hdy.p, nullptr, hx.p, hw.p, hmean.p, hrstd.p, hdx.p, hdw.p, rms ? nullptr : hdb.p, scratch.p, s, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_close(fmean.host(), hmean.host(), 1e-5, "mean", 1e-6);
    expect_close(frstd.host(), hrstd.host(), 1e-5, "rstd");
    expect_rounded_once(fy.host(), hy.host(), "y", 0.05);
    // dx's three terms cancel: fp32's few ulps of difference in the row sums come out absolute, not relative.
    expect_close(fdx.host(), from_fp16(hdx.host()), 1e-3, "dx", 2e-4);
    expect_close(fdw.host(), hdw.host(), 1e-5, "dw", 1e-4);
    if (!rms) expect_close(fdb.host(), hdb.host(), 1e-5, "db", 1e-4);
    // A projection's bias gradient from the same dy: out (0.5 in fp16) plus each column's sum, rounded once.
    OnDevice<float> fout{std::vector<float>(c, 0.5f)};
    OnDevice<uint16_t> hout{std::vector<uint16_t>(c, kernels::float_to_fp16(0.5f))};
    OnDevice<float> sums(std::vector<float>(static_cast<size_t>(kernels::cuda::column_sums_scratch_floats(rows, C))));
    kernels::cuda::column_sums_add_f32(fdy.p, rows, C, fout.p, sums.p, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    kernels::cuda::column_sums_add_fp16(hdy.p, rows, C, hout.p, sums.p, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_rounded_once(fout.host(), hout.host(), "column sums", 0);
  }
}

TEST_F(CudaKernels, Fp16CrossEntropyRoundsTheFp32KernelsGradientOnce) {
  // rows, vocabulary, row stride, gradient written: GPT-2's rows (cached in shared memory), Llama 3's 128,256 (too
  // large a row: read twice), a small one, and the loss alone.
  using Shape = std::tuple<int64_t, int64_t, int64_t, bool>;
  for (const auto& [rows, vocab, stride, write_grad] : {Shape{33, 50257, 50264, true}, Shape{5, 50257, 50257, true},
                                                        Shape{3, 128256, 128256, true}, Shape{64, 1000, 1000, true},
                                                        Shape{7, 50257, 50264, false}}) {
    SCOPED_TRACE(testing::Message() << rows << " rows of " << vocab << (stride > vocab ? ", padded" : "")
                                    << (write_grad ? "" : ", loss only"));
    const size_t n = static_cast<size_t>(rows * stride);
    std::vector<uint16_t> zh = to_fp16(normal(n, 3.0f, 91));
    std::vector<int64_t> targets(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) targets[static_cast<size_t>(r)] = (r * 7919) % vocab;
    const float grad_scale = 4.0f;  // a loss scale over the rows, as an fp16 run's
    OnDevice<float> fz(from_fp16(zh)), floss{std::vector<float>(static_cast<size_t>(rows))}, hloss{std::vector<float>(static_cast<size_t>(rows))};
    OnDevice<uint16_t> hz(zh);
    OnDevice<int64_t> dt(targets);
    kernels::cuda::softmax_cross_entropy_f32(fz.p, dt.p, rows, vocab, stride, grad_scale, write_grad, floss.p, nullptr);
    kernels::cuda::softmax_cross_entropy_fp16(hz.p, dt.p, rows, vocab, stride, grad_scale, write_grad, hloss.p, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_close(floss.host(), hloss.host(), 1e-5, "row losses", 1e-5);
    // Compared over the vocabulary only: the padding must keep its values.
    std::vector<float> want;
    std::vector<uint16_t> got;
    const std::vector<float> fg = fz.host();
    const std::vector<uint16_t> hg = hz.host();
    size_t padding_touched = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < stride; ++j) {
        const size_t i = static_cast<size_t>(r * stride + j);
        if (j >= vocab) {
          padding_touched += hg[i] != zh[i];
          continue;
        }
        want.push_back(fg[i]);
        got.push_back(hg[i]);
      }
    EXPECT_EQ(padding_touched, 0u);
    expect_rounded_once(want, got, write_grad ? "gradient" : "logits left alone", 0.05);
  }
}
