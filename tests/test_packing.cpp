// Packing fine-tuning samples into rows (data.packing): which rows pack_samples makes (against a naive best
// fit written here), what the sampler puts in them (each sample's own tokens and targets, every sample once
// an epoch) and what the plan counts of them. What the model computes of them: test_packed_model.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <random>

#include "engine/plan/packing.hpp"
#include "engine/runtime/data/chat_data.hpp"
#include "engine/runtime/data/sampler.hpp"
#include "test_helpers.hpp"

using namespace ds;

namespace {

// Best fit decreasing the slow way: the samples by falling positions (index order among equals), each into
// the row left with the least room that holds it (the earliest made among equals), else a new row.
std::vector<std::vector<int64_t>> naive_best_fit(const std::vector<int64_t>& tokens, int64_t T) {
  std::vector<std::pair<int64_t, int64_t>> by_size;  // (-positions, index)
  for (size_t i = 0; i < tokens.size(); ++i) by_size.push_back({-std::min(std::max<int64_t>(tokens[i] - 1, 0), T), static_cast<int64_t>(i)});
  std::sort(by_size.begin(), by_size.end());
  std::vector<std::vector<int64_t>> rows;
  std::vector<int64_t> room;
  for (const auto& [neg, i] : by_size) {
    const int64_t need = -neg;
    if (need == 0) continue;
    int best = -1;
    for (size_t r = 0; r < rows.size(); ++r)
      if (room[r] >= need && (best < 0 || room[r] < room[static_cast<size_t>(best)])) best = static_cast<int>(r);
    if (best < 0) {
      rows.emplace_back();
      room.push_back(T);
      best = static_cast<int>(rows.size()) - 1;
    }
    rows[static_cast<size_t>(best)].push_back(i);
    room[static_cast<size_t>(best)] -= need;
  }
  for (auto& r : rows) std::sort(r.begin(), r.end());
  std::sort(rows.begin(), rows.end());
  return rows;
}

}  // namespace

TEST(Packing, RowsAreTheBestFitOfTheLongestFirstAndHoldEverySampleOnce) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t T = 4 + static_cast<int64_t>(rng() % 60);
    std::vector<int64_t> tokens(1 + rng() % 80);
    for (auto& t : tokens) t = 1 + static_cast<int64_t>(rng() % static_cast<uint32_t>(trial % 3 == 0 ? 2 * T : T / 2 + 2));
    const auto rows = pack_samples(tokens, T);
    EXPECT_EQ(rows, naive_best_fit(tokens, T)) << "trial " << trial;
    std::vector<int> seen(tokens.size());
    int64_t used = 0;
    for (const auto& row : rows) {
      int64_t fill = 0;
      for (const int64_t i : row) fill += sample_positions(tokens[static_cast<size_t>(i)], T), ++seen[static_cast<size_t>(i)];
      EXPECT_LE(fill, T);
      used += fill;
    }
    for (size_t i = 0; i < tokens.size(); ++i) EXPECT_EQ(seen[i], tokens[i] > 1 ? 1 : 0) << i;
    EXPECT_GE(static_cast<int64_t>(rows.size()), (used + T - 1) / T);  // never fewer rows than the positions need
  }
}

TEST(Packing, TheSamplerPutsEachSampleInItsRowWithItsOwnTargetsAndEveryOneOnceAnEpoch) {
  // 30 samples of 2-9 tokens, ids telling sample and place apart (100 i + t), the first two tokens untrained.
  SampleSet s;
  std::vector<int64_t> lengths;
  for (int i = 0; i < 30; ++i) {
    const int n = 2 + (i * 7) % 8;
    std::vector<int32_t> ids;
    std::vector<uint8_t> mask;
    for (int t = 0; t < n; ++t) ids.push_back(100 * i + t), mask.push_back(t >= 2);
    s.add(ids, mask);
    lengths.push_back(n);
  }
  const int64_t T = 12;
  SamplerOptions o{T, 2, 1, 1, 0, 0.2, 5, true};
  o.pack = true;
  BatchSampler sampler(s, o);
  ASSERT_TRUE(sampler.packed());
  const auto train_rows = pack_samples(std::vector<int64_t>(lengths.begin(), lengths.begin() + 24), T);
  const int64_t rows = static_cast<int64_t>(train_rows.size());
  EXPECT_EQ(sampler.train_tokens(), std::accumulate(lengths.begin(), lengths.begin() + 24, int64_t{0}));
  EXPECT_TRUE(sampler.notes().find("24 samples packed into " + std::to_string(rows) + " rows") != std::string::npos) << sampler.notes();
  // An epoch's rows are each row once, and hold every training sample once.
  std::vector<int> row_seen(static_cast<size_t>(rows)), sample_seen(24);
  for (int64_t g = 0; g < rows; ++g) {
    const int64_t row = sampler.sample_offset(g);
    ASSERT_LT(row, rows);
    ++row_seen[static_cast<size_t>(row)];
    for (const int64_t i : sampler.row_samples(row)) ++sample_seen[static_cast<size_t>(i)];
  }
  EXPECT_EQ(row_seen, std::vector<int>(static_cast<size_t>(rows), 1));
  EXPECT_EQ(sample_seen, std::vector<int>(24, 1));
  // Each row as the batch holds it: its samples' tokens in order, their own targets, then padding.
  std::vector<int32_t> in, tgt;
  RowSegments segments;
  for (int64_t step = 0; (step + 1) * 2 <= rows; ++step) {
    sampler.train_batch(step, 0, in, tgt, &segments);
    ASSERT_EQ(segments.size(), 2u);
    int64_t counted = 0;
    for (int64_t b = 0; b < 2; ++b) {
      const std::vector<int64_t> samples = sampler.row_samples(sampler.sample_offset(step * 2 + b));
      const auto& seg = segments[static_cast<size_t>(b)];
      int64_t covered = 0;
      for (size_t k = 0; k < seg.size(); ++k) {
        covered += std::abs(seg[k]);
        EXPECT_EQ(seg[k] < 0, k == samples.size()) << "only the padding after the samples is negative";
      }
      EXPECT_EQ(covered, T);
      ASSERT_GE(seg.size(), samples.size());
      int64_t at = b * T;
      for (size_t k = 0; k < samples.size(); ++k) {
        const int64_t i = samples[k];
        ASSERT_EQ(seg[k], lengths[static_cast<size_t>(i)] - 1);
        for (int64_t t = 0; t < seg[k]; ++t) {
          EXPECT_EQ(in[static_cast<size_t>(at + t)], 100 * i + t);
          EXPECT_EQ(tgt[static_cast<size_t>(at + t)], t + 1 >= 2 ? 100 * i + t + 1 : -1);
          counted += t + 1 >= 2;
        }
        at += seg[k];
      }
      for (; at < (b + 1) * T; ++at) EXPECT_EQ(tgt[static_cast<size_t>(at)], -1);
    }
    EXPECT_EQ(sampler.counted_targets(step, 0), counted);
  }
  // Validation rows hold the last six samples only.
  sampler.val_batch(0, in, tgt, &segments);
  for (int64_t p = 0; p < 2 * T; ++p)
    if (tgt[static_cast<size_t>(p)] >= 0) {
      EXPECT_GE(tgt[static_cast<size_t>(p)] / 100, 24);
    }
}

namespace {

const char* kConfig = R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
  "bf16": {"enabled": false}, "model": {"preset": "llama-tiny"}, "data": {"type": "synthetic", "seq_len": 16},
  "train": {"steps": 1, "eval_every": 0, "threads": 1, "seed": 3}})";

}  // namespace

// Packed rows keep each sample's attention output (the attention's, for its backward) beside the joined rows
// the output projection keeps: the plan counts NH x D more per token in every block kept (one recomputed),
// and once the rotary tables gathered per position (fp32 cos and sin, D/2 each).
TEST(Packing, ThePlanCountsEachSamplesAttentionOutputBesideTheJoinedRows) {
  const std::vector<std::string> jsonl = {"model.preset=qwen3-tiny", "data.type=jsonl", "data.tokenizer=hf", "data.tokenizer_path=tok",
                                          "data.path=chat.jsonl"};
  for (const bool checkpointing : {false, true}) {
    std::vector<std::string> one = jsonl;
    one.push_back(std::string("model.activation_checkpointing=") + (checkpointing ? "true" : "false"));
    std::vector<std::string> packed = one;
    packed.push_back("data.packing=true");
    const Plan a = test::plan_of(kConfig, 1, 0, one), b = test::plan_of(kConfig, 1, 0, packed);
    const ModelHyper& hp = a.model.hp;
    ASSERT_NE(hp.num_heads * hp.head_dim(), hp.hidden_size);  // qwen3-tiny's heads are wider than the model
    const double kept_blocks = checkpointing ? 1 : static_cast<double>(hp.num_layers);
    EXPECT_DOUBLE_EQ(b.memory.device.activations - a.memory.device.activations,
                     kept_blocks * 2 * 16 * static_cast<double>(hp.num_heads * hp.head_dim()) * 4 + 2 * 16 * hp.head_dim() * 4);
  }
}
