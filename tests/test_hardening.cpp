// Inputs that once crashed ds, overflowed its arithmetic or ran without bound: each now an error that
// names the problem (exit 2 at the command line), found before anything large is built.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include "engine/plan/model_spec.hpp"
#include "engine/plan/plan.hpp"
#include "schema/schema_walk.hpp"
#include "test_helpers.hpp"

using namespace ds;
using namespace ds::test;
namespace fs = std::filesystem;

namespace {

std::string user_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return std::string(e.what()) + "\n" + dump(e.issues());
  } catch (const UserError& e) {
    return std::string(e.what()) + " [" + e.hint() + "]";
  }
  return "";
}

std::string scratch(const std::string& name) {
  const std::string dir = fs::temp_directory_path() / ("ds_hardening_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir + "/" + name;
}

}  // namespace

TEST(Hardening, DeepNestingIsRefusedWithAPositionNotACrash) {
  // 50,000 levels once overflowed the stack in the loader's recursive walks.
  const std::string deep = "{\"a\":" + std::string(50000, '[') + "1" + std::string(50000, ']') + "}";
  const std::string e = user_error([&] { load_config_text(deep, "d.json"); });
  EXPECT_NE(e.find("d.json:1:"), std::string::npos) << e;
  EXPECT_NE(e.find("nesting deeper than 32 levels"), std::string::npos) << e;
  // Brackets inside strings and comments are not nesting.
  EXPECT_EQ(user_error([] { load_config_text("{\"data\": {\"path\": \"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\"}} // {{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{", "ok.json"); }), "");
  // An override's value is checked the same way.
  const std::string e2 = user_error([] { load_config_text("{}", "t.json", {"train.seed=" + std::string(60000, '[')}); });
  EXPECT_NE(e2.find("nesting deeper than"), std::string::npos) << e2;
}

TEST(Hardening, SizesThatWouldOverflowArePlannedNever) {
  for (const char* override_text : {"train_micro_batch_size_per_gpu=9223372036854775807", "gradient_accumulation_steps=4611686018427387904",
                               "train_batch_size=1e30", "model.hidden_size=4000000000000", "model.num_layers=100000000",
                               "data.seq_len=99999999999", "zero_optimization.reduce_bucket_size=1e300", "train.threads=1e9"}) {
    const std::string o = override_text;
    const auto issues = problems(R"({"model": {"preset": "gpt2-tiny"}})", {o});
    const std::string key = o.substr(0, o.find('='));
    EXPECT_NE(find_issue(issues, key), nullptr) << o << "\n" << dump(issues);
  }
}

TEST(Hardening, ModelLimitsHoldForEverySourceIncludingHuggingFaceConfigs) {
  const std::string hf = scratch("huge_config.json");
  std::ofstream(hf) << R"({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 1e12, "num_attention_heads": 32,
                         "intermediate_size": 11008, "vocab_size": 32000})";
  const auto start = std::chrono::steady_clock::now();
  const std::string e = user_error([&] {
    const Config c = load_config_text("{\"model\": {\"hf_config\": \"" + hf + "\"}}", "t.json");
    build_model_spec(resolve_model_hyper(c.model));
  });
  EXPECT_NE(e.find("model.num_layers"), std::string::npos) << e;
  EXPECT_NE(e.find("16384"), std::string::npos) << e;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 2.0);  // refused before building
  std::ofstream(hf) << R"({"model_type": "gpt2", "n_embd": 1e30, "n_layer": 2, "n_head": 2})";
  EXPECT_NE(user_error([&] { load_config_text("{\"model\": {\"hf_config\": \"" + hf + "\"}}", "t.json"); }).find("not a positive whole number"),
            std::string::npos);
}

TEST(Hardening, NumbersPastADoubleAreAConfigErrorWithTheirPosition) {
  const std::string e = user_error([] { load_config_text("{\n  \"optimizer\": {\"params\": {\"lr\": 1e999}}\n}", "big.json"); });
  EXPECT_NE(e.find("big.json:2:"), std::string::npos) << e;
  EXPECT_NE(e.find("number out of range: 1e999"), std::string::npos) << e;
}

TEST(Hardening, OverridesWithHugeIndicesOrBadTextAreProblemsNotCrashes) {
  auto issues = problems("{}", {"optimizer.params.betas=[0.9,0.99]", "optimizer.params.betas.99999999999999999999999=0.5"});
  ASSERT_FALSE(issues.empty());
  EXPECT_NE(dump(issues).find("past the end of the array"), std::string::npos) << dump(issues);
  issues = problems("{}", {std::string("train.output_dir=runs/\xff\xfe")});
  ASSERT_FALSE(issues.empty());
  EXPECT_NE(dump(issues).find("not valid UTF-8"), std::string::npos) << dump(issues);
}

TEST(Hardening, ConfigFilesAreCheckedBeforeBeingRead) {
  EXPECT_NE(user_error([] { load_config_file(fs::temp_directory_path().string()); }).find("is a directory, not a config file"),
            std::string::npos);
  const auto start = std::chrono::steady_clock::now();
  const std::string e = user_error([] { load_config_file("/dev/zero"); });
  EXPECT_NE(e.find("larger than 16 MiB"), std::string::npos) << e;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
}

TEST(Hardening, ProblemsOfOneKeyAreReportedOnce) {
  const auto issues = problems("{}", {"optimizer.type=Lion"});
  ASSERT_EQ(issues.size(), 1u) << dump(issues);
  EXPECT_NE(issues[0].message.find("does not implement the Lion optimizer"), std::string::npos);
}

TEST(Hardening, ABatchMismatchIsReportedAgainstTheFile) {
  Topology t;
  t.world_size = 1;
  t.ranks_per_node = 1;
  const Config c = load_config_text(R"({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 4, "model": {"preset": "gpt2-tiny"}})",
                                    "mine.json");
  try {
    compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), t);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.source(), "mine.json");
    EXPECT_NE(find_issue(e.issues(), "train_batch_size"), nullptr) << dump(e.issues());
  }
}

TEST(Hardening, AutoThatMeansTheDefaultIsListedAsDecided) {
  Topology t;
  t.world_size = 1;
  t.ranks_per_node = 1;
  const Config c = load_config_text(R"({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": "auto",
      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}}, "model": {"preset": "gpt2-tiny"}})", "hf.json");
  const Plan p = compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), t);
  std::map<std::string, std::string> decided;
  for (const auto& r : p.resolved) decided[r.path] = r.value;
  EXPECT_EQ(decided["optimizer.params.lr"], "0.001");
  EXPECT_EQ(decided["optimizer.params.betas"], "[0.9,0.999]");
  EXPECT_EQ(decided["gradient_clipping"], "1.0");
  EXPECT_DOUBLE_EQ(p.optimizer.lr, 1e-3);
}

TEST(Hardening, DropoutComesFromEveryModelSourceAndIsBounded) {
  Config c = load_config_text(R"({"model": {"preset": "gpt2-tiny", "dropout": 0.1, "attn_pdrop": 0.2}})", "t.json");
  ModelHyper h = resolve_model_hyper(c.model);
  EXPECT_DOUBLE_EQ(h.attn_pdrop, 0.2);
  EXPECT_DOUBLE_EQ(h.resid_pdrop, 0.1);
  EXPECT_DOUBLE_EQ(h.embd_pdrop, 0.1);
  const std::string hf = scratch("gpt2_config.json");
  std::ofstream(hf) << R"({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 256, "n_positions": 64,
                         "attn_pdrop": 0.1, "resid_pdrop": 0.05, "embd_pdrop": 0.0})";
  c = load_config_text("{\"model\": {\"hf_config\": \"" + hf + "\"}}", "t.json");
  h = resolve_model_hyper(c.model);
  EXPECT_DOUBLE_EQ(h.attn_pdrop, 0.1);
  EXPECT_DOUBLE_EQ(h.resid_pdrop, 0.05);
  EXPECT_NE(find_issue(problems(R"({"model": {"preset": "gpt2-tiny", "dropout": 1}})"), "model.dropout"), nullptr);
}
