#include <gtest/gtest.h>

#include <vector>

#include "engine/plan/layout.hpp"

using namespace ds;

namespace {
ModelSpec spec_with(std::vector<int64_t> sizes) {
  ModelSpec s;
  int i = 0;
  for (int64_t n : sizes) {
    TensorSpec t;
    t.name = "p" + std::to_string(i++);
    t.shape = {n};
    t.numel = n;
    s.tensors.push_back(t);
    s.num_params += n;
  }
  return s;
}
}  // namespace

// DeepSpeed's own example (reference §4.2): 1,000,003 elements on 4 ranks align to 1,000,008;
// partitions of 250,002, the last holding 249,997 real elements.
TEST(FlatLayout, Stage12MatchesDeepSpeedsAlignmentExample) {
  for (int stage : {1, 2}) {
    FlatLayout L = build_layout(spec_with({1000000, 3}), stage, 4);
    EXPECT_EQ(L.alignment, 8);
    EXPECT_EQ(L.padded_numel, 1000008);
    EXPECT_EQ(L.shard_numel, 250002);
    ASSERT_EQ(L.shards.size(), 4u);
    EXPECT_EQ(L.shards[0].real, 250002);
    EXPECT_EQ(L.shards[3].real, 249997);
  }
}

TEST(FlatLayout, Stage12ShardsCoverTheBufferExactlyOnceWithEqualSizes) {
  ModelSpec s = build_model_spec(model_preset("gpt2-tiny"));
  for (int world : {1, 2, 3, 4, 7, 8}) {
    FlatLayout L = build_layout(s, 2, world);
    int64_t next = 0, real = 0;
    for (const auto& sh : L.shards) {
      EXPECT_EQ(sh.begin, next);
      EXPECT_EQ(sh.numel(), L.shard_numel);
      next = sh.end;
      real += sh.real;
    }
    EXPECT_EQ(next, L.padded_numel) << world;
    EXPECT_EQ(real, s.num_params) << world;
    EXPECT_EQ(L.padded_numel % (2 * world), 0);
    EXPECT_LT(L.padded_numel - L.numel, 2 * world);
  }
}

TEST(FlatLayout, ParameterOffsetsFollowStateDictOrderWithoutGaps) {
  ModelSpec s = build_model_spec(model_preset("llama-tiny"));
  FlatLayout L = build_layout(s, 1, 4);
  int64_t off = 0;
  for (size_t i = 0; i < L.params.size(); ++i) {
    EXPECT_EQ(L.params[i].name, s.tensors[i].name);
    EXPECT_EQ(L.params[i].offset, off);
    off += L.params[i].numel;
  }
  EXPECT_EQ(off, L.numel);
}

// DeepSpeed's ZeRO-3 example: 10 elements on 4 ranks -> 3 per rank, the last holds 1 real + 2 padding.
TEST(FlatLayout, Stage3PartitionsEachParameterSeparately) {
  FlatLayout L = build_layout(spec_with({10}), 3, 4);
  ASSERT_EQ(L.params.size(), 1u);
  EXPECT_EQ(L.params[0].partition_numel, 3);
  EXPECT_EQ(stage3_owned(L.params[0], 0).real, 3);
  EXPECT_EQ(stage3_owned(L.params[0], 3).real, 1);
  EXPECT_EQ(L.shard_numel, 3);
}

TEST(FlatLayout, Stage3OwnershipCoversEveryParameterOnce) {
  ModelSpec s = build_model_spec(model_preset("llama-tiny"));
  for (int world : {1, 2, 3, 5}) {
    FlatLayout L = build_layout(s, 3, world);
    int64_t part_off = 0;
    for (const auto& p : L.params) {
      EXPECT_EQ(p.partition_offset, part_off);
      part_off += p.partition_numel;
      int64_t next = 0;
      for (int r = 0; r < world; ++r) {
        ShardRange o = stage3_owned(p, r);
        EXPECT_EQ(o.begin, std::min(next, p.numel));
        next = std::max(next, o.end);
      }
      EXPECT_EQ(next, p.numel) << p.name;
    }
    EXPECT_EQ(L.shard_numel, part_off);
  }
}

TEST(FlatLayout, Stage0ReplicatesEverything) {
  FlatLayout L = build_layout(spec_with({5, 7}), 0, 3);
  ASSERT_EQ(L.shards.size(), 3u);
  for (const auto& sh : L.shards) {
    EXPECT_EQ(sh.begin, 0);
    EXPECT_EQ(sh.end, 12);
  }
}
