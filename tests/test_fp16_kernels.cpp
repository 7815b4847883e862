// fp16 in the CPU kernels: the conversions against the processor's own (F16C's vcvtph2ps / vcvtps2ph, round to
// nearest even) over every fp16 value and a sweep of fp32 values (subnormals, the overflow edge, ties), and the optimizers and sums of squares reading
// fp16 gradients (a GPU's fp16 run stepped on the host) against the same kernels on their exact fp32 values
// (within float rounding; the sums of squares bit for bit), through the kernel table's dispatch as the
// optimizer calls it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "engine/runtime/device/kernel_table.hpp"
#include "kernels/cpu/adam.hpp"
#include "kernels/cpu/norm.hpp"

using namespace ds;
using namespace ds::kernels;

namespace {

uint32_t bits_of(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  return x;
}

#if defined(__x86_64__)
// CPUID leaf 1, ECX bit 29 (clang's __builtin_cpu_supports does not know "f16c").
bool has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
}
__attribute__((target("f16c"))) float hardware_widened(uint16_t h) { return _cvtsh_ss(h); }
__attribute__((target("f16c"))) uint16_t hardware_narrowed(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#else
bool has_f16c() { return false; }
float hardware_widened(uint16_t) { return 0; }
uint16_t hardware_narrowed(float) { return 0; }
#endif

// Gradients as fp16 bits, spread over fp16's range (some subnormal, some near its largest), and their fp32 values.
struct Fp16Grads {
  std::vector<uint16_t> half;
  std::vector<float> wide;
  Fp16Grads(int64_t n, unsigned seed) : half(static_cast<size_t>(n)), wide(static_cast<size_t>(n)) {
    std::mt19937 gen(seed);
    std::normal_distribution<float> d(0, 1);
    std::uniform_int_distribution<int> scale(-26, 13);  // below 2^13 x 0.5 x a few sigma: finite
    for (int64_t i = 0; i < n; ++i) {
      half[i] = float_to_fp16(d(gen) * std::ldexp(1.0f, scale(gen)) * 0.5f);
      wide[i] = fp16_to_float(half[i]);
    }
  }
};

std::vector<float> normal(int64_t n, float scale, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(gen);
  return v;
}

// Master, moments and the bf16 copy of one optimizer's run, two identical sets.
struct States {
  std::vector<float> w, m, v;
  std::vector<uint16_t> out;
  States(int64_t n, unsigned seed) : w(normal(n, 0.02f, seed)), m(normal(n, 1e-3f, seed + 1)), v(normal(n, 1e-3f, seed + 2)), out(n, 0) {
    for (float& x : v) x = x * x;
  }
};

// Within float rounding: the compiler may contract a multiply-add into an FMA in one instantiation and not the
// other (the last bit), while an fp16 value widened wrongly would be off by fp16's resolution (1e-3).
void expect_same(const States& a, const States& b) {
  const auto near = [](float x, float y, float scale) { return std::fabs(x - y) <= 1e-6f * (std::fabs(y) + scale); };
  for (size_t i = 0; i < a.w.size(); ++i) {
    ASSERT_TRUE(near(a.w[i], b.w[i], 1e-3f)) << "master at " << i << ": " << a.w[i] << " vs " << b.w[i];
    ASSERT_TRUE(near(a.m[i], b.m[i], 1e-6f)) << "exp_avg at " << i << ": " << a.m[i] << " vs " << b.m[i];
    ASSERT_TRUE(near(a.v[i], b.v[i], 1e-9f)) << "exp_avg_sq at " << i << ": " << a.v[i] << " vs " << b.v[i];
    ASSERT_LE(std::abs(int(a.out[i]) - int(b.out[i])), 1) << "bf16 copy at " << i;
  }
}

const std::vector<int64_t> kSizes = {1, 15, 17, 255, 257, (1 << 16) + 3, 3 * (1 << 16) + 31};

}  // namespace

TEST(Fp16Conversion, WidensEveryFp16ValueAsTheProcessorDoes) {
  if (!has_f16c()) GTEST_SKIP() << "no F16C on this processor: nothing independent to compare with";
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float ours = fp16_to_float(static_cast<uint16_t>(h)), theirs = hardware_widened(static_cast<uint16_t>(h));
    if (std::isnan(theirs)) {
      ASSERT_TRUE(std::isnan(ours)) << std::hex << h;
      continue;
    }
    ASSERT_EQ(bits_of(ours), bits_of(theirs)) << "fp16 0x" << std::hex << h;
    ASSERT_EQ(float_to_fp16(ours), h) << "fp16 0x" << std::hex << h << " does not come back from fp32";  // exact: unchanged
  }
  EXPECT_EQ(fp16_to_float(0x3c00), 1.0f);
  EXPECT_EQ(fp16_to_float(0x7bff), 65504.0f);                 // the largest finite
  EXPECT_EQ(fp16_to_float(0x0001), std::ldexp(1.0f, -24));    // the smallest subnormal
  EXPECT_EQ(fp16_to_float(0x8400), -std::ldexp(1.0f, -14));   // the smallest normal, negative
}

TEST(Fp16Conversion, NarrowsToNearestEvenAsTheProcessorDoes) {
  if (!has_f16c()) GTEST_SKIP() << "no F16C on this processor: nothing independent to compare with";
  // Values at every scale fp16 has and past it, and the halfway points between neighbouring fp16 values.
  std::vector<float> values = {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, 1e30f, -1e30f, std::numeric_limits<float>::infinity(),
                               std::ldexp(1.0f, -25), std::ldexp(1.0f, -26), std::ldexp(1.5f, -25), std::ldexp(1.0f, -14),
                               std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25), 1e-10f, -3e-8f};
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-30, 17);
  for (int i = 0; i < 200000; ++i) values.push_back((i % 2 ? -1.0f : 1.0f) * std::ldexp(mantissa(gen), exponent(gen)));
  for (uint32_t h = 0; h < 0x7c00; h += 7) {  // exactly between h and h + 1
    const double mid = (static_cast<double>(fp16_to_float(static_cast<uint16_t>(h))) + fp16_to_float(static_cast<uint16_t>(h + 1))) / 2;
    values.push_back(static_cast<float>(mid));
  }
  for (const float f : values) ASSERT_EQ(float_to_fp16(f), hardware_narrowed(f)) << f << " (0x" << std::hex << bits_of(f) << ")";
  const uint16_t nan = float_to_fp16(std::nanf(""));
  EXPECT_EQ(nan & 0x7c00, 0x7c00);
  EXPECT_NE(nan & 0x3ff, 0) << "a NaN stays a NaN";
}

TEST(Fp16Gradients, AdamSgdAndLambStepAsOnTheirFp32Values) {
  const KernelTable& table = cpu_kernel_table();
  for (const int64_t n : kSizes) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const Fp16Grads g(n, 3);
    AdamStep a;
    a.lr = 1e-3f, a.weight_decay = 0.1f, a.grad_scale = 1.0f / 1024;  // the loss scale undone in the step
    const AdamStep ak = a.at_step(3);
    States x(n, 1), y(n, 1);
    table.adam_step(x.w.data(), x.m.data(), x.v.data(), x.out.data(), g.half.data(), GradElements::fp16, n, ak);
    table.adam_step_f32(y.w.data(), y.m.data(), y.v.data(), y.out.data(), g.wide.data(), n, ak);
    expect_same(x, y);

    SgdStep s;
    s.lr = 0.1f, s.momentum = 0.9f, s.weight_decay = 0.01f, s.grad_scale = 0.5f;
    States p(n, 5), q(n, 5);
    table.sgd_step(p.w.data(), p.m.data(), p.out.data(), g.half.data(), GradElements::fp16, n, s);
    table.sgd_step_f32(q.w.data(), q.m.data(), q.out.data(), g.wide.data(), n, s);
    expect_same(p, q);

    LambStep l;
    l.lr = 1e-3f, l.weight_decay = 0.01f, l.grad_scale = 0.25f;
    const LambStep lk = l.at_step(2);
    States u(n, 7), v(n, 7);
    double sums_u[2] = {0, 0}, sums_v[2] = {0, 0};
    table.lamb_moments(u.w.data(), u.m.data(), u.v.data(), g.half.data(), GradElements::fp16, n, lk, sums_u, sums_u + 1);
    table.lamb_moments_f32(v.w.data(), v.m.data(), v.v.data(), g.wide.data(), n, lk, sums_v, sums_v + 1);
    expect_same(u, v);
    EXPECT_NEAR(sums_u[0], sums_v[0], 1e-9 * sums_v[0]);
    EXPECT_NEAR(sums_u[1], sums_v[1], 1e-6 * sums_v[1]);
  }
}

TEST(Fp16Gradients, SumOfSquaresMatchesItsReferenceAndTheFp32SumAndSeesOverflow) {
  const KernelTable& table = cpu_kernel_table();
  for (const int64_t n : kSizes) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const Fp16Grads g(n, 9);
    const double fast = table.sum_of_squares(g.half.data(), GradElements::fp16, n);
    EXPECT_EQ(fast, table.sum_of_squares_f32(g.wide.data(), n)) << "the same values, the same order of sums";
    const double reference = sum_of_squares_fp16_reference(g.half.data(), n);
    EXPECT_NEAR(fast, reference, 1e-6 * reference);
    // An overflowed gradient (fp16's infinity) anywhere makes the norm infinite: the loss scaler's skip.
    std::vector<uint16_t> overflowed = g.half;
    overflowed[static_cast<size_t>(n) / 2] = 0xfc00;
    EXPECT_TRUE(std::isinf(table.sum_of_squares(overflowed.data(), GradElements::fp16, n)));
  }
  // The offset of an element by its stored size.
  const std::vector<uint16_t> h = {float_to_fp16(3.0f), float_to_fp16(4.0f)};
  EXPECT_EQ(table.sum_of_squares(element_at(h.data(), GradElements::fp16, 1), GradElements::fp16, 1), 16.0);
}
