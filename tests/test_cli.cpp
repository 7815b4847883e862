// The ds binary as a user runs it: exit codes, which stream carries what, --json, colour rules.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli_helpers.hpp"

using namespace cli_test;

TEST(CliPlan, PrintsThePlanOnStdoutAndExitsZero) {
  Result r = ds("plan templates/zero2.json");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "Memory per rank (GiB)")) << r.out;
  EXPECT_TRUE(contains(r.out, "124,439,808 parameters")) << r.out;
  EXPECT_EQ(r.err, "");
}

TEST(CliPlan, JsonIsParseableWithASchemaVersion) {
  Result r = ds("plan templates/zero3.json --world-size 4 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["schema_version"], 1);
  EXPECT_EQ(j["topology"]["world_size"], 4);
  EXPECT_EQ(j["zero"]["stage"], 3);
}

TEST(CliPlan, OverridesOnTheCommandLine) {
  Result r = ds("plan templates/zero2.json zero_optimization.stage=3 bf16.enabled=false --json");
  ASSERT_EQ(r.code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["zero"]["stage"], 3);
  EXPECT_EQ(j["precision"]["mode"], "fp32");
}

TEST(CliPlan, ConfigErrorsExitTwoAndListEveryProblemOnStderr) {
  Result r = ds("plan templates/zero2.json zero_optimization.stag=3 bf16.enabled=maybe");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_TRUE(contains(r.err, "ds plan: error: templates/zero2.json: 2 problems")) << r.err;
  EXPECT_TRUE(contains(r.err, "did you mean 'stage'")) << r.err;
}

TEST(CliPlan, MissingFileExitsTwoNamingIt) {
  Result r = ds("plan no/such/config.json");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "no/such/config.json")) << r.err;
}

TEST(CliPlan, WarningsGoToStderr) {
  Result r = ds("plan templates/zero2.json compile.deepcompile=true");
  EXPECT_EQ(r.code, 0);
  EXPECT_TRUE(contains(r.err, "warning: compile: ignored")) << r.err;
  EXPECT_FALSE(contains(r.out, "warning:"));
}

TEST(CliPlan, ResolvedConfigShowsDefaultsFilled) {
  Result r = ds("plan templates/bf16.json --resolved-config");
  ASSERT_EQ(r.code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["zero_optimization"]["sub_group_size"], 1000000000);
}

TEST(CliUsage, UnknownFlagsAndMissingArgumentsExitTwo) {
  EXPECT_EQ(ds("plan --no-such-flag templates/zero2.json").code, 2);
  EXPECT_EQ(ds("plan").code, 2);
  EXPECT_EQ(ds("frobnicate").code, 2);
  Result r = ds("plan templates/zero2.json --world-size 0");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "ds plan --help")) << r.err;
}

TEST(CliUsage, HelpEndsWithExamplesAndExitsZero) {
  for (const char* sub : {"plan", "estimate-memory", "train", "convert-ckpt", "profile", "env"}) {
    Result r = ds(std::string(sub) + " --help");
    EXPECT_EQ(r.code, 0) << sub;
    EXPECT_TRUE(contains(r.out, "Examples")) << sub << "\n" << r.out;
  }
}

TEST(CliUsage, BareDsListsEverySubcommand) {
  Result r = ds("");
  EXPECT_EQ(r.code, 0);
  for (const char* sub : {"plan", "estimate-memory", "train", "convert-ckpt", "profile", "env"})
    EXPECT_TRUE(contains(r.out, std::string("  ") + sub + " ")) << sub << "\n" << r.out;
}

TEST(CliUsage, PendingSubcommandsSaySoAndExitOne) {
  Result r = ds("convert-ckpt runs/x");
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(contains(r.err, "not available in this build")) << r.err;
}

TEST(CliTrain, TrainsTheQuickstartAndWritesTheRunDirectory) {
  const std::string dir = scratch_dir() + "/quickstart";
  Result r = ds("train examples/quickstart.json train.steps=40 train.eval_every=20 train.output_dir=" + dir +
                " csv_monitor.enabled=true csv_monitor.output_path=" + dir + " tensorboard.enabled=true tensorboard.output_path=" + dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "step 40/40")) << r.err;
  EXPECT_TRUE(contains(r.err, "ds train: done: 40 of 40 steps")) << r.err;
  EXPECT_EQ(r.out, "");  // progress and summaries are diagnostics
  std::ifstream metrics(dir + "/metrics.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(metrics, line)) {
    auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["step"], ++lines);
    EXPECT_TRUE(j.contains("loss") && j.contains("lr") && j.contains("grad_norm"));
    EXPECT_NEAR(j["forward_s"].get<double>() + j["backward_s"].get<double>() + j["optimizer_s"].get<double>(),
                j["step_s"].get<double>(), 0.05 + 0.2 * j["step_s"].get<double>());
  }
  EXPECT_EQ(lines, 40);
  EXPECT_EQ(nlohmann::json::parse(slurp(dir + "/plan.json"))["schema_version"], 1);
  EXPECT_EQ(nlohmann::json::parse(slurp(dir + "/config.json"))["train"]["steps"], 40);
  // The run's own log: every printed line, timestamped.
  const std::string log = slurp(dir + "/train.log");
  EXPECT_NE(log.find(" ds train: gpt2-tiny, "), std::string::npos) << log;
  EXPECT_NE(log.find(" step 40/40 | loss "), std::string::npos) << log;
  EXPECT_NE(log.find(" ds train: checkpoint at step 40 -> "), std::string::npos) << log;
  // The monitors: DeepSpeed's CSV files (x axis = samples: 16 per step) and a TensorBoard event file.
  const std::string lr = slurp(dir + "/DeepSpeedJobName/Train_Samples_lr.csv");
  EXPECT_EQ(lr.rfind("step,lr\n16,", 0), 0u) << lr;
  EXPECT_NE(slurp(dir + "/DeepSpeedJobName/Train_Samples_val_loss.csv").find("\n640,"), std::string::npos);
  int event_files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/DeepSpeedJobName"))
    event_files += e.path().filename().string().rfind("events.out.tfevents.", 0) == 0;
  EXPECT_EQ(event_files, 1);
}

TEST(CliTrain, CtrlCSavesACheckpointAndExits130ThenResumeContinues) {
  const std::string dir = scratch_dir() + "/interrupt";
  std::system(("rm -rf " + dir).c_str());
  // A long run, interrupted after a few seconds with SIGINT, as a person pressing Ctrl-C would.
  Result r = ds("train examples/quickstart.json train.steps=100000 train.output_dir=" + dir, "timeout --preserve-status -s INT 4");
  EXPECT_EQ(r.code, 130) << r.err;
  EXPECT_TRUE(contains(r.err, "interrupted at step")) << r.err;
  EXPECT_TRUE(contains(r.err, "--resume")) << r.err;
  std::ifstream latest(dir + "/checkpoints/latest");
  std::string name;
  latest >> name;
  ASSERT_EQ(name.rfind("step_", 0), 0u) << "no checkpoint after Ctrl-C";
  const int saved = std::stoi(name.substr(5));
  r = ds("train examples/quickstart.json train.steps=" + std::to_string(saved + 3) + " train.output_dir=" + dir + " --resume");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "resuming from")) << r.err;
  EXPECT_TRUE(contains(r.err, "(3 this run)")) << r.err;
}

TEST(CliTrain, UnsupportedPlansAndBadDataExitTwoBeforeWork) {
  Result r = ds("train examples/quickstart.json zero_optimization.stage=2 zero_optimization.offload_optimizer.device=cpu");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "optimizer or parameter offload")) << r.err;
  r = ds("train examples/quickstart.json data.type=text data.path=/nonexistent/corpus.txt");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "/nonexistent/corpus.txt")) << r.err;
  r = ds("train examples/quickstart.json train.resume=/nonexistent/run");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "no complete checkpoint at '/nonexistent/run'")) << r.err;
}

TEST(CliVersion, IdentifiesItselfApartFromDeepSpeedsLauncher) {
  Result r = ds("--version");
  EXPECT_EQ(r.code, 0);
  EXPECT_TRUE(contains(r.out, "ds 0.")) << r.out;
  EXPECT_TRUE(contains(r.out, "git ")) << r.out;
  EXPECT_TRUE(contains(r.out, "not DeepSpeed's Python `ds` launcher")) << r.out;
  EXPECT_TRUE(contains(r.out, "LibTorch")) << r.out;
}

TEST(CliEnv, ReportsTheMachineAsJson) {
  Result r = ds("env --json");
  ASSERT_EQ(r.code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_GE(j["cores"].get<int>(), 1);
  EXPECT_GT(j["memory_bytes"].get<int64_t>(), 0);
  EXPECT_TRUE(j.contains("shm_bytes"));
}

TEST(CliColor, NeverOnAPipeUnlessForced) {
  const std::string esc = "\033[";
  EXPECT_FALSE(contains(ds("plan templates/zero2.json zero_optimization.stag=3").err, esc));
  EXPECT_TRUE(contains(ds("--color=always plan templates/zero2.json zero_optimization.stag=3").err, esc));
  EXPECT_FALSE(contains(ds("--color=auto plan templates/zero2.json zero_optimization.stag=3", "NO_COLOR=1").err, esc));
}

TEST(CliEstimateMemory, TableWithDeepSpeedsNumbersBeside) {
  Result r = ds("estimate-memory --model 7b --gpus 8 --gpu-memory 80GiB");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "'7b' read as llama-2-7b")) << r.out;
  EXPECT_TRUE(contains(r.out, "<- recommended")) << r.out;
  EXPECT_TRUE(contains(r.out, "ds plan CONFIG zero_optimization.stage=")) << r.out;
  EXPECT_TRUE(contains(r.out, "169.44  |     0.49 | ZeRO-3 offload_param=cpu, offload_optimizer=cpu, zero_init=1")) << r.out;
  EXPECT_TRUE(contains(r.out, "Not counted")) << r.out;
}

TEST(CliEstimateMemory, JsonShape) {
  Result r = ds("estimate-memory --model gpt2-xl --gpus 4 --zero-stage 3 --gpu-memory 16GiB --json");
  ASSERT_EQ(r.code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["schema_version"], 1);
  EXPECT_EQ(j["model"]["num_params"], 1557611200);
  ASSERT_GT(j["rows"].size(), 0u);
  for (const auto& row : j["rows"]) {
    EXPECT_EQ(row["zero_stage"], 3);
    const auto& g = row["per_gpu"];
    EXPECT_EQ(g["total"].get<int64_t>(), g["params"].get<int64_t>() + g["grads"].get<int64_t>() +
                                             g["optimizer_states"].get<int64_t>() + g["activations"].get<int64_t>() +
                                             g["buffers"].get<int64_t>());
  }
  EXPECT_EQ(j["deepspeed"].size(), 8u);
}

TEST(CliEstimateMemory, AcceptsAHuggingFaceConfigAndAHypotheticalModel) {
  const std::string hf = scratch_dir() + "/hf";
  std::filesystem::create_directories(hf);
  std::ofstream(hf + "/config.json") << R"({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, )"
                                        R"("vocab_size": 50257, "n_positions": 1024})";
  Result r = ds("estimate-memory --model " + hf + "/config.json --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["model"]["num_params"], 124439808);
  r = ds("estimate-memory --params 2851e6 --largest-layer 32e6 --gpus 8 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["rows"][0]["per_gpu"]["activations"], 0);
}

TEST(CliEstimateMemory, BadInputExitsTwoWithAClearMessage) {
  Result r = ds("estimate-memory --model llama-7b");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "did you mean 'llama-2-7b'")) << r.err;
  EXPECT_EQ(ds("estimate-memory --model 7b --gpus 0").code, 2);
  EXPECT_EQ(ds("estimate-memory --model 7b --gpus -3").code, 2);
  r = ds("estimate-memory --model 7b --gpu-memory lots");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "'lots' is not a size")) << r.err;
  EXPECT_EQ(ds("estimate-memory").code, 2);
  EXPECT_EQ(ds("estimate-memory --params 1e9").code, 2);
}

