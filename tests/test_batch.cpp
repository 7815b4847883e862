#include <gtest/gtest.h>

#include "common/error.hpp"
#include "engine/plan/batch.hpp"

using namespace ds;

namespace {
BatchInputs in(std::optional<int64_t> tb, std::optional<int64_t> mb, std::optional<int64_t> ga, int ws) {
  return BatchInputs{tb, mb, ga, ws, "--world-size"};
}
std::string error_of(const BatchInputs& b) {
  try {
    resolve_batch(b);
  } catch (const ConfigError& e) {
    return e.issues().at(0).message + " | " + e.issues().at(0).hint;
  }
  return "";
}
}  // namespace

// DeepSpeed's resolution table (deepspeed/runtime/config.py _set_batch_related_parameters).
TEST(BatchTriangle, AllThreeGivenAndConsistent) {
  auto r = resolve_batch(in(32, 4, 2, 4));
  EXPECT_EQ(r.train_batch_size, 32);
  EXPECT_EQ(r.micro_batch, 4);
  EXPECT_EQ(r.grad_accum, 2);
}

TEST(BatchTriangle, TrainBatchAndMicroGiveAccumulation) {
  auto r = resolve_batch(in(32, 4, std::nullopt, 2));
  EXPECT_EQ(r.grad_accum, 4);
  EXPECT_NE(r.derivation.find("32 / (4 x 2) = 4"), std::string::npos) << r.derivation;
}

TEST(BatchTriangle, TrainBatchAndAccumulationGiveMicro) {
  auto r = resolve_batch(in(48, std::nullopt, 3, 4));
  EXPECT_EQ(r.micro_batch, 4);
}

TEST(BatchTriangle, MicroAndAccumulationGiveTrainBatch) {
  auto r = resolve_batch(in(std::nullopt, 2, 8, 3));
  EXPECT_EQ(r.train_batch_size, 48);
}

TEST(BatchTriangle, TrainBatchAloneMeansNoAccumulation) {
  auto r = resolve_batch(in(16, std::nullopt, std::nullopt, 4));
  EXPECT_EQ(r.grad_accum, 1);
  EXPECT_EQ(r.micro_batch, 4);
}

TEST(BatchTriangle, MicroAloneMeansNoAccumulation) {
  auto r = resolve_batch(in(std::nullopt, 5, std::nullopt, 2));
  EXPECT_EQ(r.grad_accum, 1);
  EXPECT_EQ(r.train_batch_size, 10);
}

TEST(BatchTriangle, InconsistentTripleShowsTheArithmetic) {
  std::string e = error_of(in(10, 3, 1, 2));
  EXPECT_NE(e.find("train_batch_size 10 != micro 3 x accumulation 1 x world size 2 = 6"), std::string::npos) << e;
  EXPECT_NE(e.find("--world-size"), std::string::npos) << e;
}

TEST(BatchTriangle, NonDivisibleTrainBatchIsRejectedUpFront) {
  // DeepSpeed floors 10 // (3*2) = 1 and fails later; ds says why at once.
  std::string e = error_of(in(10, 3, std::nullopt, 2));
  EXPECT_NE(e.find("not divisible by micro 3 x world size 2 = 6"), std::string::npos) << e;
  EXPECT_NE(error_of(in(10, std::nullopt, 3, 1)), "");
  EXPECT_NE(error_of(in(10, std::nullopt, std::nullopt, 4)), "");
}

TEST(BatchTriangle, NeitherTrainBatchNorMicroIsAnError) {
  EXPECT_NE(error_of(in(std::nullopt, std::nullopt, 4, 1)).find("either train_batch_size or train_micro_batch_size_per_gpu"),
            std::string::npos);
  EXPECT_NE(error_of(in(std::nullopt, std::nullopt, std::nullopt, 1)), "");
}
