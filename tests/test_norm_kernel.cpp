#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/adam.hpp"
#include "kernels/cpu/norm.hpp"

using namespace ds::kernels;

TEST(SumOfSquaresKernel, MatchesTheDoubleReferenceAtAwkwardSizes) {
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0, 1e-2f);
  for (int64_t n : {1, 15, 16, 255, 256, 257, 4097, (1 << 16) + 7, 3 * (1 << 16) + 300}) {
    std::vector<float> f(n);
    std::vector<uint16_t> b(n);
    for (int64_t i = 0; i < n; ++i) {
      f[i] = d(rng);
      b[i] = float_to_bf16(f[i]);
    }
    const double rf = sum_of_squares_f32_reference(f.data(), n), rb = sum_of_squares_bf16_reference(b.data(), n);
    EXPECT_NEAR(sum_of_squares_f32(f.data(), n), rf, 1e-6 * rf) << n;
    EXPECT_NEAR(sum_of_squares_bf16(b.data(), n), rb, 1e-6 * rb) << n;
  }
}

TEST(SumOfSquaresKernel, StaysAccurateOverHundredsOfMillionsOfElements) {
  // 2^27 ones: the exact answer is 2^27; an fp32 running sum would stall at 2^24.
  const int64_t n = int64_t{1} << 27;
  std::vector<uint16_t> ones(n, float_to_bf16(1.0f));
  EXPECT_EQ(sum_of_squares_bf16(ones.data(), n), static_cast<double>(n));
}

TEST(SumOfSquaresKernel, PropagatesInfAndNaN) {
  std::vector<float> x(1000, 1.0f);
  x[777] = INFINITY;
  EXPECT_TRUE(std::isinf(sum_of_squares_f32(x.data(), 1000)));
  x[777] = NAN;
  EXPECT_TRUE(std::isnan(sum_of_squares_f32(x.data(), 1000)));
}
