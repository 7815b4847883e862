// The rotary frequencies of each rope_type against values computed by hand from Hugging Face's formulas
// (modeling_rope_utils: default, linear, dynamic NTK, llama3, yarn, longrope), in double.
#include <gtest/gtest.h>

#include <cmath>

#include "engine/plan/rope.hpp"
#include "schema/rope_scaling.hpp"

using namespace ds;

namespace {
ModelHyper rotary_model(int64_t head_dim, double theta, int64_t context) {
  ModelHyper h;
  h.arch = ModelArch::llama;
  h.num_heads = 2;
  h.hidden_size = 2 * head_dim;
  h.rope_theta = theta;
  h.max_position_embeddings = context;
  return h;
}
void expect_close(double got, double want, const char* what, int j) {
  EXPECT_NEAR(got, want, 1e-7 * std::abs(want)) << what << " inv_freq[" << j << "]";
}
}  // namespace

TEST(Rope, DefaultAndLinearAndDynamicFrequencies) {
  ModelHyper h = rotary_model(64, 10000.0, 2048);
  RotaryTables t = rotary_tables(h, 16);
  ASSERT_EQ(t.inv_freq.size(), 32u);
  for (int j = 0; j < 32; ++j) expect_close(t.inv_freq[static_cast<size_t>(j)], std::pow(10000.0, -2.0 * j / 64), "default", j);
  EXPECT_EQ(t.attention_factor, 1.0);
  h.rope_scaling.type = RopeType::linear;
  h.rope_scaling.factor = 4;
  t = rotary_tables(h, 16);
  for (int j = 0; j < 32; ++j) expect_close(t.inv_freq[static_cast<size_t>(j)], std::pow(10000.0, -2.0 * j / 64) / 4, "linear", j);
  // dynamic: the base unchanged within the context, stretched past it.
  h.rope_scaling.type = RopeType::dynamic;
  h.rope_scaling.factor = 2;
  t = rotary_tables(h, 2048);
  expect_close(t.inv_freq[16], std::pow(10000.0, -0.5), "dynamic within the context", 16);
  t = rotary_tables(h, 8192);
  expect_close(t.inv_freq[0], 1.0, "dynamic", 0);
  expect_close(t.inv_freq[16], 0.003662860395123453, "dynamic", 16);
  expect_close(t.inv_freq[31], 1.905030617376177e-05, "dynamic", 31);
}

TEST(Rope, Llama3FrequenciesAsLlama31Uses) {
  ModelHyper h = rotary_model(128, 500000.0, 131072);  // Llama 3.1 8B's attention
  h.rope_scaling.type = RopeType::llama3;
  h.rope_scaling.factor = 8;
  h.rope_scaling.low_freq_factor = 1;
  h.rope_scaling.high_freq_factor = 4;
  h.rope_scaling.original_max_position_embeddings = 8192;
  const RotaryTables t = rotary_tables(h, 4096);
  const std::pair<int, double> want[] = {{0, 1.0},                       // short wavelength: kept
                                         {20, 0.016560440080994446},
                                         {40, 3.428102195952591e-05},    // the smoothed band
                                         {44, 1.509621717643313e-05},
                                         {48, 6.647869871181236e-06},
                                         {63, 3.068925988914511e-07}};   // long wavelength: divided by 8
  for (const auto& [j, v] : want) expect_close(t.inv_freq[static_cast<size_t>(j)], v, "llama3", j);
  EXPECT_EQ(t.attention_factor, 1.0);
}

TEST(Rope, YarnFrequenciesAndAttentionFactor) {
  ModelHyper h = rotary_model(64, 10000.0, 4096);
  h.rope_scaling.type = RopeType::yarn;
  h.rope_scaling.factor = 4;
  const RotaryTables t = rotary_tables(h, 16);
  EXPECT_NEAR(t.attention_factor, 1.138629436111989, 1e-12);  // 0.1 ln 4 + 1
  const std::pair<int, double> want[] = {{0, 1.0},  {5, 0.23713737056616555}, {10, 0.056234132519034905},
                                         {15, 0.009488517882700576}, {20, 0.0013378867023789293}, {31, 3.33380358040831e-05}};
  for (const auto& [j, v] : want) expect_close(t.inv_freq[static_cast<size_t>(j)], v, "yarn", j);
}

// rope_scaling as Hugging Face writes it: every key of its type read, anything else refused by name.
TEST(Rope, LongropeDividesByTheShortFactorsWithinTheOriginalContextAndTheLongOnesPast) {
  // Phi-3's long-context form: D = 8, an original context of 4096 stretched to 131072 (s = 32).
  ModelHyper h = rotary_model(8, 10000.0, 131072);
  h.rope_scaling.type = RopeType::longrope;
  h.rope_scaling.original_max_position_embeddings = 4096;
  h.rope_scaling.short_factor = {1.0, 1.25, 2.0, 3.5};
  h.rope_scaling.long_factor = {1.5, 4.0, 16.0, 60.0};
  const double factor = std::sqrt(1 + std::log(32.0) / std::log(4096.0));  // 1.1902380714238083
  for (const auto& [T, list] : {std::pair<int64_t, const std::vector<double>*>{4096, &h.rope_scaling.short_factor},
                                {4097, &h.rope_scaling.long_factor}}) {
    const RotaryTables t = rotary_tables(h, T);
    ASSERT_EQ(t.inv_freq.size(), 4u);
    for (int j = 0; j < 4; ++j)
      expect_close(t.inv_freq[static_cast<size_t>(j)], 1.0 / ((*list)[static_cast<size_t>(j)] * std::pow(10000.0, 2.0 * j / 8)), "longrope", j);
    EXPECT_NEAR(t.attention_factor, factor, 1e-12);
  }
  EXPECT_NEAR(factor, 1.1902380714238083, 1e-12);
  // Given, the attention factor is the file's; no stretch, none.
  h.rope_scaling.attention_factor = 1.5;
  EXPECT_EQ(rotary_tables(h, 16).attention_factor, 1.5);
  h.rope_scaling.attention_factor.reset();
  h.max_position_embeddings = 4096;
  EXPECT_EQ(rotary_tables(h, 16).attention_factor, 1.0);
  // Read as Phi-3's config writes it ("type", the original context at the top level, filled by the reader),
  // written back with rope_type; a list of the wrong kind is refused.
  std::vector<ConfigIssue> errors;
  const RopeScaling r = read_rope_scaling(nlohmann::json::parse(R"({"type": "longrope", "short_factor": [1, 2], "long_factor": [3, 4]})"), "k", "", errors);
  EXPECT_TRUE(errors.empty());
  EXPECT_EQ(r.type, RopeType::longrope);
  EXPECT_EQ(r.long_factor, (std::vector<double>{3, 4}));
  EXPECT_EQ(rope_scaling_json(r)["rope_type"], "longrope");
  read_rope_scaling(nlohmann::json::parse(R"({"type": "longrope", "short_factor": [1, -2], "long_factor": [3, 4]})"), "k", "", errors);
  EXPECT_EQ(errors.size(), 1u);
}

TEST(Rope, RopeScalingIsReadStrictlyAndWrittenBackAsHuggingFaceWritesIt) {
  std::vector<ConfigIssue> errors;
  const nlohmann::json llama31 = nlohmann::json::parse(
      R"({"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"})");
  const RopeScaling r = read_rope_scaling(llama31, "model.rope_scaling", "", errors);
  EXPECT_TRUE(errors.empty());
  EXPECT_EQ(r.type, RopeType::llama3);
  EXPECT_EQ(r.original_max_position_embeddings, 8192);
  EXPECT_EQ(rope_scaling_json(r), llama31);
  EXPECT_EQ(read_rope_scaling(nlohmann::json::parse(R"({"type": "linear", "factor": 2.0})"), "k", "", errors).type, RopeType::linear);
  EXPECT_TRUE(errors.empty());
  for (const char* bad : {R"({"rope_type": "longrope", "short_factor": [1], "long_factor": [1], "factor": 4.0})",
                          R"({"rope_type": "longrope", "short_factor": [1]})", R"({"rope_type": "ntk", "factor": 2.0})",
                          R"({"rope_type": "yarn", "factor": 4.0, "mscale": 1.0})",
                          R"({"rope_type": "llama3", "factor": 8.0})", R"({"rope_type": "linear", "factor": 0.5})", R"({"factor": 2.0})"}) {
    std::vector<ConfigIssue> e;
    read_rope_scaling(nlohmann::json::parse(bad), "model.rope_scaling", "", e);
    EXPECT_FALSE(e.empty()) << bad;
  }
  EXPECT_EQ(read_rope_scaling(nullptr, "k", "", errors).type, RopeType::none);
  EXPECT_TRUE(rope_scaling_json(RopeScaling{}).is_null());
}
