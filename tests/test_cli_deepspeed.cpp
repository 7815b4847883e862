// Leaving DeepSpeed: `ds convert-ckpt` and `model.init_from` on the real DeepSpeed checkpoints of
// ../shared/data/deepspeed-checkpoints (DeepSpeed 0.14.4 wrote them; its own zero_to_fp32.py wrote their
// pytorch_model.bin). Checked independently: tests/tools/torch_state_compare.py reads the .bin with Python's
// own pickle and zipfile modules and the export with json and struct, byte for byte; and a ds run started
// from the checkpoint, or resuming it, logs the losses DeepSpeed recorded.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_helpers.hpp"

using namespace cli_test;
namespace fs = std::filesystem;

namespace {
const std::string kCases = DS_SHARED_DIR "/data/deepspeed-checkpoints/";

#define REQUIRE_CASES()                                                                         \
  do {                                                                                         \
    if (!fs::exists(kCases + "README.md")) GTEST_SKIP() << "no ../shared/data/deepspeed-checkpoints"; \
  } while (0)

// torch_state_compare.py's verdict on `state` (a .bin, or FILE.pt:KEY) against `export_file`.
Result compare(const std::string& state, const std::string& export_file, const std::string& tied = "") {
  const std::string out = scratch_dir() + "/compare.txt";
  const int status = std::system(("python3 " DS_SOURCE_DIR "/tests/tools/torch_state_compare.py " + state + " " + export_file + " " + tied +
                                  " > " + out + " 2>&1").c_str());
  Result r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(out);
  return r;
}

bool have_python() { return std::system("python3 -c 'import json, pickle, struct, zipfile' >/dev/null 2>&1") == 0; }
}  // namespace

TEST(CliDeepSpeed, InfoDescribesACheckpointFromItsPicklesAlone) {
  REQUIRE_CASES();
  Result r = ds("convert-ckpt --info " + kCases + "llama-z2-w2-fp32/ckpt --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["kind"], "DeepSpeed checkpoint");
  EXPECT_EQ(j["tag"], "global_step5");
  EXPECT_EQ(j["zero_stage"], 2);
  EXPECT_EQ(j["world_size"], 2);
  EXPECT_EQ(j["step"], 5);
  EXPECT_EQ(j["num_params"], 106816);  // the case's README
  EXPECT_EQ(j["tensors"].size(), 21u);
  EXPECT_EQ(j["ds_version"], "0.14.4");
  EXPECT_EQ(j["config"]["optimizer"]["type"], "AdamW");
  EXPECT_EQ(j["files"].size(), 3u);
  EXPECT_TRUE(std::is_sorted(j["files"].begin(), j["files"].end())) << j["files"].dump();  // by name, not in read order
  EXPECT_TRUE(j["fp32_master"].get<bool>());
  r = ds("convert-ckpt --info " + kCases + "gpt2-z2-w2-fp32/ckpt");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "saved by    2 ranks at ZeRO stage 2")) << r.out;
  EXPECT_TRUE(contains(r.out, "tied        lm_head.weight = transformer.wte.weight")) << r.out;
  EXPECT_TRUE(contains(r.out, "parameters  120,576 in 28 tensors")) << r.out;
}

TEST(CliDeepSpeed, EveryStageConsolidatesBitForBitAsZeroToFp32Does) {
  REQUIRE_CASES();
  if (!have_python()) GTEST_SKIP() << "no python3";
  const std::string dir = scratch_dir() + "/ds-export";
  fs::create_directories(dir);
  for (const std::string c : {"llama-z2-w2-fp32", "llama-z3-w2-fp32", "gpt2-z2-w2-fp32"}) {
    const Result r = ds("convert-ckpt " + kCases + c + "/ckpt " + dir + "/" + c + ".safetensors");
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_TRUE(contains(r.err, "reading the fp32 master weights (2 partitions)")) << r.err;
    const Result cmp = compare(kCases + c + "/ckpt/pytorch_model.bin", dir + "/" + c + ".safetensors",
                               c == "gpt2-z2-w2-fp32" ? "lm_head.weight=transformer.wte.weight" : "");
    EXPECT_EQ(cmp.code, 0) << c << "\n" << cmp.out;
    EXPECT_TRUE(contains(cmp.out, "0 differ")) << cmp.out;
  }
  // Stage 0 keeps no fp32 master apart from the module: its module weights, as the model file holds them.
  const Result r = ds("convert-ckpt " + kCases + "llama-z0-w1-fp32/ckpt " + dir + "/z0.safetensors");
  ASSERT_EQ(r.code, 0) << r.err;
  const Result cmp = compare(kCases + "llama-z0-w1-fp32/ckpt/global_step5/mp_rank_00_model_states.pt:module", dir + "/z0.safetensors");
  EXPECT_EQ(cmp.code, 0) << cmp.out;
  EXPECT_TRUE(contains(cmp.out, "21 tensors, 0 differ")) << cmp.out;
}

TEST(CliDeepSpeed, AHuggingFaceDirectoryNeedsTheModelsConfigAndShipsIt) {
  REQUIRE_CASES();
  const std::string dir = scratch_dir() + "/ds-hf";
  const std::string src = kCases + "llama-z3-w2-fp32/ckpt";
  Result r = ds("convert-ckpt " + src + " " + dir + "/no-config");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "needs the model's config.json")) << r.err;
  EXPECT_TRUE(contains(r.err, "--hf-config PATH")) << r.err;
  EXPECT_FALSE(fs::exists(dir + "/no-config"));
  r = ds("convert-ckpt " + src + " " + dir + "/hf --hf-config " + kCases + "llama-z3-w2-fp32/init --dtype bf16");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json cfg = nlohmann::json::parse(slurp(dir + "/hf/config.json"));
  EXPECT_EQ(cfg["model_type"], "llama");
  EXPECT_EQ(cfg["torch_dtype"], "bfloat16");  // the export's dtype, not the original's
  EXPECT_TRUE(fs::exists(dir + "/hf/generation_config.json"));  // found beside the config
  const std::string st = slurp(dir + "/hf/model.safetensors");
  uint64_t n = 0;
  std::memcpy(&n, st.data(), 8);
  const nlohmann::json header = nlohmann::json::parse(st.substr(8, n));
  EXPECT_EQ(header["model.layers.1.mlp.down_proj.weight"]["dtype"], "BF16");
  EXPECT_EQ(header["model.layers.1.mlp.down_proj.weight"]["shape"], nlohmann::json({64, 128}));
  EXPECT_EQ(header.size(), 22u);  // 21 tensors and the metadata
  // An existing destination is never replaced unasked; the checkpoint's own folder never receives an export.
  r = ds("convert-ckpt " + src + " " + dir + "/hf --hf-config " + kCases + "llama-z3-w2-fp32/init");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "already exists")) << r.err;
  r = ds("convert-ckpt " + src + " " + src + "/global_step5/out.safetensors");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "which this conversion reads")) << r.err;
  // Flags that do nothing where they are given: said, never silently dropped.
  r = ds("convert-ckpt " + src + " " + dir + "/one.safetensors --hf-config " + kCases + "llama-z3-w2-fp32/init --max-shard-size 1GB");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "--hf-config has no effect on one .safetensors file")) << r.err;
  EXPECT_TRUE(contains(r.err, "--max-shard-size has no effect on one .safetensors file")) << r.err;
  r = ds("convert-ckpt " + src + " " + dir + "/run --to ds --from-module-weights");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "--from-module-weights applies to an export")) << r.err;
}

namespace {
// The DeepSpeed case's own config (as losses.json records it) with ds's blocks: its model, its data in the
// order DeepSpeed fed it (windows of 33 tokens at a stride of 32, no shuffling), `steps` steps.
std::string case_config(const std::string& dir, const std::string& c, int steps, const std::string& out) {
  nlohmann::json cfg = nlohmann::json::parse(slurp(kCases + c + "/losses.json"))["ds_config"];
  cfg["model"] = {{"hf_config", kCases + c + "/init/config.json"}};
  cfg["data"] = {{"type", "tokens"}, {"token_format", "uint16"}, {"path", kCases + "gpl3.u16"}, {"seq_len", 32}, {"val_fraction", 0},
                 {"shuffle", false}};
  cfg["train"] = {{"steps", steps}, {"eval_every", 0}, {"output_dir", out}};
  const std::string path = dir + "/" + c + ".json";
  std::ofstream(path) << cfg.dump(1);
  return path;
}

std::vector<double> losses_of(const std::string& run) {
  std::vector<double> out;
  for (const nlohmann::json& m : metrics_of(run))
    if (m.contains("loss") && m.contains("step")) out.push_back(m["loss"].get<double>());
  return out;
}
}  // namespace

// The same run in ds from DeepSpeed's initial weights: its data in DeepSpeed's order (data.shuffle false),
// DeepSpeed's ds_config, ZeRO-2 on two ranks: every step's loss is the one DeepSpeed logged, and the seventh
// (the weights after step 6 on batch 6) too. AdamW, the weight-decay groups, clipping and the batch's
// layout over ranks all agree.
TEST(CliDeepSpeed, TrainedFromTheSameStartDsLogsDeepSpeedsLossesStepForStep) {
  REQUIRE_CASES();
  const std::string dir = scratch_dir() + "/ds-same";
  fs::create_directories(dir);
  const std::string c = "llama-z2-w2-fp32";
  const Result r = ds("train " + case_config(dir, c, 7, dir + "/run") + " model.init_from=" + kCases + c + "/init --nproc-per-node 2");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json rec = nlohmann::json::parse(slurp(kCases + c + "/losses.json"));
  const std::vector<double> ours = losses_of(dir + "/run");
  ASSERT_EQ(ours.size(), 7u);
  for (size_t i = 0; i < 6; ++i) EXPECT_NEAR(ours[i], rec["losses"][i].get<double>(), 1e-5) << "step " << i + 1;
  EXPECT_NEAR(ours[6], rec["loss_after_step6_on_batch_b6"].get<double>(), 1e-5);
}

// A DeepSpeed run continued in ds: `convert-ckpt --to ds` lays the fp32 master and both Adam moments out for
// ds's plan, and `ds train --resume` takes step 6 and 7 as DeepSpeed did. Step 7's loss depends on the
// moments and the step count the checkpoint carried.
TEST(CliDeepSpeed, ADeepSpeedRunResumedInDsContinuesWithDeepSpeedsNextLosses) {
  REQUIRE_CASES();
  const std::string dir = scratch_dir() + "/ds-resume";
  fs::create_directories(dir);
  // ZeRO-3 and ZeRO-2 on two ranks; stage 0 on one, whose moments torch keeps by parameter index.
  for (const std::string c : {"llama-z3-w2-fp32", "gpt2-z2-w2-fp32", "llama-z0-w1-fp32"}) {
    Result r = ds("convert-ckpt " + kCases + c + "/ckpt " + dir + "/" + c + " --to ds --hf-config " + kCases + c + "/init");
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_TRUE(contains(r.err, "fp32 master weights, Adam's moments, step 5")) << r.err;
    const bool two = c != "llama-z0-w1-fp32";
    r = ds("train " + case_config(dir, c, 7, dir + "/" + c) + " --resume" + (two ? " --nproc-per-node 2" : ""));
    ASSERT_EQ(r.code, 0) << r.err;
    // DeepSpeed recorded no data block and the config's steps_per_print only prints: no change to warn of.
    EXPECT_FALSE(contains(r.err, "differs from the checkpoint's")) << r.err;
    const nlohmann::json rec = nlohmann::json::parse(slurp(kCases + c + "/losses.json"));
    const std::vector<double> ours = losses_of(dir + "/" + c);
    ASSERT_EQ(ours.size(), 2u) << c;  // steps 6 and 7
    EXPECT_NEAR(ours[0], rec["losses"][5].get<double>(), 1e-5) << c;
    EXPECT_NEAR(ours[1], rec["loss_after_step6_on_batch_b6"].get<double>(), 1e-5) << c;
  }
}

// ds started from DeepSpeed's checkpoint (model.init_from names the folder) scores, before its first
// update, the loss DeepSpeed logged for step 6 on the same rows: the weights reached ds's model intact
// (names, GPT-2's Conv1D layout and tied head, Llama's grouped-query projections). Its data are the
// tokens from step 6's first window on, in DeepSpeed's order (data.shuffle false), on DeepSpeed's two ranks.
TEST(CliDeepSpeed, InitFromADeepSpeedCheckpointScoresTheLossDeepSpeedRecordedNext) {
  REQUIRE_CASES();
  const std::string dir = scratch_dir() + "/ds-init";
  fs::create_directories(dir);
  const std::string all = slurp(kCases + "gpl3.u16");
  std::ofstream(dir + "/from-step6.u16", std::ios::binary) << all.substr(5 * 8 * 32 * 2);  // batch b = 5 of 8 rows of 32
  for (const std::string c : {"gpt2-z2-w2-fp32", "llama-z3-w2-fp32"}) {
    const Result r = ds("train " + case_config(dir, c, 1, dir + "/" + c) + " model.init_from=" + kCases + c + "/ckpt data.path=" + dir +
                        "/from-step6.u16 --nproc-per-node 2");
    ASSERT_EQ(r.code, 0) << r.err;
    const nlohmann::json rec = nlohmann::json::parse(slurp(kCases + c + "/losses.json"));
    const std::vector<double> ours = losses_of(dir + "/" + c);
    ASSERT_EQ(ours.size(), 1u);
    EXPECT_NEAR(ours[0], rec["losses"][5].get<double>(), 1e-5) << c;
  }
  // Without a model block naming the architecture: said, with the key that gives it.
  const nlohmann::json bare = {{"train_micro_batch_size_per_gpu", 1},
                               {"model", {{"init_from", kCases + "llama-z2-w2-fp32/ckpt"}}},
                               {"data", {{"type", "synthetic"}, {"seq_len", 32}}}};
  std::ofstream(dir + "/bare.json") << bare.dump();
  const Result r = ds("plan " + dir + "/bare.json");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "is a DeepSpeed checkpoint, which does not record which model it holds")) << r.err;
  EXPECT_TRUE(contains(r.err, "model.hf_config")) << r.err;
}


// The layouts the real checkpoints above do not have, written by tests/tools/write_deepspeed_checkpoint.py
// from DeepSpeed's documented partitioning: ZeRO-1, three ranks whose groups and parameters need padding
// (ZeRO-3's padding not zeroed), bf16 and fp16 module weights, bf16's optimizer at stage 0, frozen and tied
// parameters. Each consolidation equals what the writer computed from the values it wrote.
TEST(CliDeepSpeed, PaddedPartitionsAtThreeRanksBf16Fp16FrozenAndTiedConsolidateExactly) {
  if (std::system("python3 -c 'import pickle, zipfile, struct' >/dev/null 2>&1") != 0) GTEST_SKIP() << "no python3";
  const std::string dir = scratch_dir() + "/ds-written";
  fs::create_directories(dir);
  struct Case {
    std::string args;
    std::string reads;  // what ds says it reads
  };
  const std::vector<Case> cases = {{"--stage 1 --world 3 --dtype fp32 --frozen", "fp32 master weights (3 partitions)"},
                                   {"--stage 2 --world 3 --dtype bf16 --frozen --tied", "fp32 master weights (3 partitions)"},
                                   {"--stage 3 --world 3 --dtype bf16 --frozen --tied", "fp32 master weights (3 partitions)"},
                                   {"--stage 3 --world 2 --dtype fp16", "fp32 master weights (2 partitions)"},
                                   {"--stage 0 --world 1 --dtype bf16", "fp32 master weights (1 partition)"},
                                   {"--stage 0 --world 1 --dtype fp16 --tied", "the module's F16 weights"},
                                   {"--stage 2 --world 3 --dtype fp32", "fp32 master weights (3 partitions)"}};
  int i = 0;
  for (const Case& c : cases) {
    const std::string ck = dir + "/case" + std::to_string(i++);
    ASSERT_EQ(std::system(("python3 " DS_SOURCE_DIR "/tests/tools/write_deepspeed_checkpoint.py " + ck + " " + c.args).c_str()), 0) << c.args;
    Result r = ds("convert-ckpt " + ck + " " + ck + ".safetensors");
    ASSERT_EQ(r.code, 0) << c.args << "\n" << r.err;
    EXPECT_TRUE(contains(r.err, c.reads)) << c.args << "\n" << r.err;
    Result cmp = compare(ck + "/expected_master.safetensors", ck + ".safetensors");
    EXPECT_EQ(cmp.code, 0) << c.args << "\n" << cmp.out;
    if (c.args.find("--stage 3") == std::string::npos) {  // the module's own weights, in the dtype they trained in
      r = ds("convert-ckpt " + ck + " " + ck + "-module.safetensors --from-module-weights");
      ASSERT_EQ(r.code, 0) << c.args << "\n" << r.err;
      cmp = compare(ck + "/expected_module.safetensors", ck + "-module.safetensors");
      EXPECT_EQ(cmp.code, 0) << c.args << "\n" << cmp.out;
    }
  }
  // ZeRO-3 has no module weights to take; frozen parameters can be left out, as zero_to_fp32 leaves them.
  Result r = ds("convert-ckpt " + dir + "/case2 " + dir + "/m.safetensors --from-module-weights");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "a ZeRO-3 checkpoint keeps no module weights")) << r.err;
  r = ds("convert-ckpt " + dir + "/case2 " + dir + "/x.safetensors --exclude-frozen-parameters");
  ASSERT_EQ(r.code, 0) << r.err;
  const Result cmp = compare(dir + "/case2/expected_master.safetensors", dir + "/x.safetensors");
  EXPECT_EQ(cmp.code, 1);
  EXPECT_TRUE(contains(cmp.out, "MISSING model.layers.0.mlp.up_proj.weight")) << cmp.out;
  EXPECT_TRUE(contains(cmp.out, "11 tensors, 1 differ")) << cmp.out;
  // As ds runs: each case without frozen parameters written for ds's plan (three ranks' padding at stage 2,
  // ZeRO-3's slices, bf16's stage-0 optimizer), then exported: the same fp32 master.
  for (const int k : {3, 4, 6}) {
    const std::string ck = dir + "/case" + std::to_string(k);
    r = ds("convert-ckpt " + ck + " " + ck + "-run --to ds");
    ASSERT_EQ(r.code, 0) << r.err;
    r = ds("convert-ckpt " + ck + "-run " + ck + "-run.safetensors");
    ASSERT_EQ(r.code, 0) << r.err;
    const Result cmp = compare(ck + "/expected_master.safetensors", ck + "-run.safetensors");
    EXPECT_EQ(cmp.code, 0) << k << "\n" << cmp.out;
  }
  // A run whose frozen parameters ds would train: not written as a ds run, with the way that works.
  r = ds("convert-ckpt " + dir + "/case0 " + dir + "/run --to ds");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "the frozen parameter 'model.layers.0.mlp.up_proj.weight'")) << r.err;
  EXPECT_TRUE(contains(r.err, "model.init_from")) << r.err;
  r = ds("convert-ckpt --info " + dir + "/case2 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["module_dtype"], "BF16");
  EXPECT_EQ(j["world_size"], 3);
  EXPECT_EQ(j["tied"]["lm_head.weight"], "model.embed_tokens.weight");
}
