#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/adam.hpp"
#include "kernels/cpu/norm.hpp"
#include "kernels/cpu/sum.hpp"

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

// The end of a reduce-scatter: k sources added into one buffer.
TEST(SumIntoKernel, Bf16AccumulatesInFp32AndRoundsOnceAtAwkwardSizes) {
  std::mt19937 rng(9);
  std::normal_distribution<float> d(0, 1);
  for (int k : {1, 3}) {
    for (int64_t n : {1, 15, 16, 17, 1000, (1 << 16) + 9, 2 * (1 << 16) + 31}) {
      std::vector<std::vector<uint16_t>> src(static_cast<size_t>(k), std::vector<uint16_t>(n));
      std::vector<uint16_t> dst(n), ref(n);
      std::vector<float> fdst(n);
      std::vector<std::vector<float>> fsrc(static_cast<size_t>(k), std::vector<float>(n));
      for (int64_t i = 0; i < n; ++i) {
        dst[i] = ref[i] = float_to_bf16(d(rng));
        fdst[i] = d(rng);
        for (int j = 0; j < k; ++j) {
          src[static_cast<size_t>(j)][i] = float_to_bf16(d(rng));
          fsrc[static_cast<size_t>(j)][i] = d(rng);
        }
      }
      std::vector<const uint16_t*> ps;
      std::vector<const float*> fps;
      for (int j = 0; j < k; ++j) {
        ps.push_back(src[static_cast<size_t>(j)].data());
        fps.push_back(fsrc[static_cast<size_t>(j)].data());
      }
      // fp32: the sources added in order, element by element.
      std::vector<float> fexpect(fdst);
      for (int64_t i = 0; i < n; ++i)
        for (int j = 0; j < k; ++j) fexpect[i] += fsrc[static_cast<size_t>(j)][i];
      sum_into_f32(fdst.data(), fps.data(), k, n);
      EXPECT_EQ(fdst, fexpect) << k << " sources, " << n;
      sum_into_bf16(dst.data(), ps.data(), k, n);
      sum_into_bf16_reference(ref.data(), ps.data(), k, n);
      EXPECT_EQ(dst, ref) << k << " sources, " << n;
    }
  }
  // 256 + 1 + 1: rounded after each addition bf16 stays at 256 (257 ties to even); rounded once it is 258.
  std::vector<uint16_t> dst{float_to_bf16(256.0f)}, one{float_to_bf16(1.0f)};
  const uint16_t* two[] = {one.data(), one.data()};
  sum_into_bf16(dst.data(), two, 2, 1);
  EXPECT_EQ(bf16_to_float(dst[0]), 258.0f);
}
