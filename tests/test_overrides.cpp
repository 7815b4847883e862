#include <gtest/gtest.h>

#include "test_helpers.hpp"

using namespace ds;
using namespace ds::test;

namespace {
const char* kBase = R"({"train_batch_size": 8, "zero_optimization": {"stage": 1},
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999]}}})";
Config load(const std::vector<std::string>& o) { return load_config_text(kBase, "base.json", o); }
}  // namespace

TEST(Overrides, SetAnExistingKey) {
  Config c = load({"zero_optimization.stage=3"});
  EXPECT_EQ(*c.zero.stage, 3);
  EXPECT_EQ(c.value_source.at("zero_optimization.stage"), "override");
}

TEST(Overrides, SetAKeyTheFileDoesNotHaveCreatingItsParents) {
  Config c = load({"bf16.enabled=true", "zero_optimization.offload_optimizer.device=cpu", "model.preset=gpt2"});
  EXPECT_TRUE(*c.bf16.enabled);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::cpu);
  EXPECT_EQ(c.model.preset, "gpt2");
}

TEST(Overrides, ValueIsJsonElseAString) {
  Config c = load({"optimizer.params.betas=[0.8, 0.95]", "optimizer.type=SGD", "~optimizer.params.betas"});
  EXPECT_EQ(c.optimizer.type, OptimizerType::SGD);
  c = load({"train.output_dir=runs/a=b"});  // split at the first '=' only
  EXPECT_EQ(c.train.output_dir, "runs/a=b");
  c = load({"optimizer.params.lr=\"auto\""});
  EXPECT_DOUBLE_EQ(*c.optimizer.lr, 1e-3);
}

TEST(Overrides, ArrayElementsByIndex) {
  Config c = load({"optimizer.params.betas.0=0.95"});
  EXPECT_DOUBLE_EQ((*c.optimizer.betas)[0], 0.95);
  EXPECT_DOUBLE_EQ((*c.optimizer.betas)[1], 0.999);
  EXPECT_FALSE(problems(kBase, {"optimizer.params.betas.5=0.1"}).empty());
}

TEST(Overrides, TildeRemovesAKey) {
  Config c = load({"~train_batch_size", "train_micro_batch_size_per_gpu=2"});
  EXPECT_FALSE(c.train_batch_size.has_value());
  EXPECT_EQ(*c.train_micro_batch_size_per_gpu, 2);
  auto p = problems(kBase, {"~scheduler"});
  ASSERT_EQ(p.size(), 1u);
  EXPECT_NE(p[0].message.find("does not have"), std::string::npos);
}

TEST(Overrides, UnknownKeysAreErrorsWithADidYouMeanAsInAFile) {
  auto p = problems(kBase, {"zero_optimization.stag=3"});
  ASSERT_EQ(p.size(), 1u) << dump(p);
  EXPECT_NE(p[0].message.find("did you mean 'stage'"), std::string::npos) << dump(p);
  p = problems(kBase, {"zero_optimisation.stage=3"});
  EXPECT_NE(p.at(0).message.find("did you mean 'zero_optimization'"), std::string::npos) << dump(p);
}

TEST(Overrides, ValuesAreValidatedLikeTheFile) {
  auto p = problems(kBase, {"zero_optimization.stage=7"});
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].path, "zero_optimization.stage");
}

TEST(Overrides, MalformedOverridesSayHowToWriteThem) {
  EXPECT_NE(problems(kBase, {"zero_optimization..stage=3"}).at(0).message.find("empty key segment"), std::string::npos);
  EXPECT_NE(problems(kBase, {"train_batch_size=8=9"}).size(), 0u);  // "8=9" is a string, not an integer
}

TEST(Overrides, LegacyNamesWorkInOverridesToo) {
  Config c = load({"bfloat16.enabled=true"});
  EXPECT_TRUE(*c.bf16.enabled);
  c = load({"zero_optimization.cpu_offload=true"});
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::cpu);
}

TEST(Overrides, RecognisedOnTheCommandLine) {
  EXPECT_TRUE(looks_like_override("zero_optimization.stage=3"));
  EXPECT_TRUE(looks_like_override("~scheduler"));
  EXPECT_FALSE(looks_like_override("config.json"));
  EXPECT_FALSE(looks_like_override("--json"));
  EXPECT_FALSE(looks_like_override("dir/a=b.json"));
  EXPECT_FALSE(looks_like_override("=3"));
}
