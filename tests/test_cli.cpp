// The ds binary as a user runs it: exit codes, which stream carries what, --json, colour rules.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/wait.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
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
  // A small model's table in a unit that shows its figures: the quickstart's 124,672 bf16 weights are
  // 243.50 KiB = 0.24 MiB (not 0.00 GiB).
  r = ds("plan examples/quickstart.json");
  EXPECT_TRUE(contains(r.out, "Memory per rank (MiB)")) << r.out;
  EXPECT_TRUE(contains(r.out, "  parameters              0.24")) << r.out;
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

TEST(CliUsage, BareDsListsEverySubcommandAndIsAUsageError) {
  Result r = ds("");
  EXPECT_EQ(r.code, 2) << "a script that forgot its command must not pass";
  for (const char* sub : {"plan", "estimate-memory", "train", "convert-ckpt", "profile", "env"})
    EXPECT_TRUE(contains(r.err, std::string("  ") + sub + " ")) << sub << "\n" << r.err;
  r = ds("trian examples/quickstart.json");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "did you mean `ds train`?")) << r.err;
  EXPECT_TRUE(contains(ds("--help").out, "man -l man/ds-config.5"));
}

TEST(CliUsage, DeepSpeedsConfigAndLocalRankFlagsAreAccepted) {
  // DeepSpeed's launcher and scripts pass the config as --deepspeed_config and each process's --local_rank.
  Result r = ds("plan --deepspeed_config examples/quickstart.json zero_optimization.stage=3 --local_rank=0 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["layout"]["stage"], 3);
  r = ds("plan examples/quickstart.json --deepspeed_config examples/quickstart.json");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "the config is given twice")) << r.err;
  r = ds("plan --local_rank=1 examples/quickstart.json", "LOCAL_RANK=0");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "--local_rank 1 disagrees with LOCAL_RANK=0")) << r.err;
}

TEST(CliUsage, RoughEdgesANewUserMet) {
  // An output directory that cannot exist: exit 2 naming the key, not a raw filesystem error.
  Result r = ds("train examples/quickstart.json train.steps=2 train.output_dir=/proc/ds_cannot_be_here");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "train.output_dir '/proc/ds_cannot_be_here' cannot be created")) << r.err;
  // A build without CUDA: --device cuda is refused naming --device cpu; auto trains on the CPU and says so
  // when nvidia-smi lists a GPU (a stand-in nvidia-smi here). A CUDA build trains there instead.
  if (contains(ds("--version").out, "(CPU); CUDA")) {  // the LibTorch this ds runs on has no CUDA
    r = ds("train examples/quickstart.json train.steps=2 --device cuda");
    EXPECT_EQ(r.code, 2);
    EXPECT_TRUE(contains(r.err, "--device cpu")) << r.err;
    const std::string bin = scratch_dir() + "/fake_bin";
    std::filesystem::create_directories(bin);
    std::ofstream(bin + "/nvidia-smi") << "#!/bin/sh\necho 'NVIDIA H200, 143771'\n";
    std::filesystem::permissions(bin + "/nvidia-smi", std::filesystem::perms::owner_all);
    const std::string path_env = "PATH=" + bin + ":" + std::getenv("PATH");
    r = ds("train examples/quickstart.json train.steps=2 train.eval_every=0 train.output_dir=" + scratch_dir() + "/gpu_machine", path_env);
    EXPECT_EQ(r.code, 0) << r.err;
    EXPECT_TRUE(contains(r.err, "training on the CPU: this build has no CUDA support, so the 1 GPU nvidia-smi lists is not used")) << r.err;
    EXPECT_TRUE(contains(ds("plan examples/quickstart.json", path_env).out, "cuda")) << "ds plan still plans for the GPU";
  }
  // A missing NVMe swap folder: a warning while planning (as a missing data file is), an error before a run.
  r = ds("plan examples/offload-nvme.json zero_optimization.offload_optimizer.nvme_path=/nonexistent/swap");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "zero_optimization.offload_optimizer.nvme_path: '/nonexistent/swap' does not exist")) << r.err;
  r = ds("train examples/offload-nvme.json zero_optimization.offload_optimizer.nvme_path=/nonexistent/swap train.steps=1 "
         "train.output_dir=" + scratch_dir() + "/no_swap");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "'/nonexistent/swap' does not exist")) << r.err;
  // A tag that does not exist: the tags that do.
  r = ds("convert-ckpt " + scratch_dir() + "/gpu_machine out.safetensors -t step_00000099");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "its checkpoints: step_00000002")) << r.err;
}

TEST(CliUsage, EverySubcommandsFlagsAreInItsManPage) {
  // Help and man page must not drift apart: each option --help lists (by its first spelling) is described
  // in the subcommand's man page.
  for (const std::string sub : {"plan", "estimate-memory", "train", "convert-ckpt", "profile", "env"}) {
    const std::string help = ds(sub + " --help").out;
    std::string man = slurp(std::string(DS_SOURCE_DIR) + "/man/ds-" + (sub == "env" ? std::string("") : sub) + (sub == "env" ? "" : ".1"));
    if (sub == "env") man = slurp(std::string(DS_SOURCE_DIR) + "/man/ds.1");
    ASSERT_FALSE(man.empty()) << sub;
    std::string plain;
    for (size_t i = 0; i < man.size(); ++i)
      if (!(man[i] == '\\' && i + 1 < man.size() && man[i + 1] == '-')) plain += man[i];
    std::istringstream lines(help);
    int flags = 0;
    for (std::string line; std::getline(lines, line);) {
      const size_t at = line.find_first_not_of(' ');
      if (at == std::string::npos || at == 0 || (line.compare(at, 2, "--") != 0 && line.compare(at, 1, "-") != 0)) continue;
      const size_t dd = line.find("--", at);
      if (dd == std::string::npos) continue;
      const size_t end = line.find_first_of(" ,=", dd);
      const std::string flag = line.substr(dd, end == std::string::npos ? std::string::npos : end - dd);
      if (flag == "--help") continue;
      ++flags;
      EXPECT_TRUE(contains(plain, flag)) << "ds " << sub << " " << flag << " is not in its man page";
    }
    EXPECT_GT(flags, 0) << sub << "\n" << help;
  }
}

TEST(CliEstimate, ArgumentErrorsSayWhatIsMissingAndSizeOnlyRowsAreNotDoubled) {
  Result r = ds("estimate-memory --params 7e9");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "--params needs --largest-layer")) << r.err;
  EXPECT_FALSE(contains(r.err, "inf")) << r.err;
  r = ds("estimate-memory --largest-layer 1e6");
  EXPECT_EQ(r.code, 2);
  EXPECT_FALSE(contains(r.err, "did you mean --largest-layer")) << r.err;
  r = ds("estimate-memory --params 7e9 --largest-layer 131e6 --gpus 8 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto rows = nlohmann::json::parse(r.out)["rows"];
  ASSERT_FALSE(rows.empty());
  for (const auto& row : rows) EXPECT_FALSE(row["activation_checkpointing"].get<bool>()) << row.dump();
  // A ds config's own micro batch (the quickstart's 16), not 1; --micro-batch still overrides it.
  r = ds("estimate-memory --model examples/quickstart.json --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["assumptions"]["micro_batch"], 16);
  r = ds("estimate-memory --model examples/quickstart.json --micro-batch 3 --json");
  EXPECT_EQ(nlohmann::json::parse(r.out)["assumptions"]["micro_batch"], 3);
}

TEST(CliPlan, SchedulesAndDecidedValuesAreDescribedAsTheyAre) {
  // OneCycle and LRRangeTest by their own parameters, with no warmup ds made up.
  Result r = ds("plan examples/quickstart.json ~scheduler scheduler.type=OneCycle scheduler.params.cycle_min_lr=0.0001 "
                "scheduler.params.cycle_max_lr=0.001 scheduler.params.cycle_first_step_size=100");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "OneCycle: lr 0.0001 -> 0.001 over 100 steps, back over 100, then constant at 0.0001")) << r.out;
  EXPECT_FALSE(contains(r.out, "warmup")) << r.out;
  r = ds("plan examples/quickstart.json ~scheduler scheduler.type=LRRangeTest scheduler.params.lr_range_test_min_lr=0.0001 "
         "scheduler.params.lr_range_test_step_size=10 scheduler.params.lr_range_test_step_rate=2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "LRRangeTest: lr 0.0001 x (1 + 2 x step / 10)")) << r.out;
  EXPECT_FALSE(contains(r.out, "warmup")) << r.out;
  // Every batch key ds computed is listed by name, the micro batch from memory included.
  r = ds("plan examples/quickstart.json train_batch_size=auto gradient_accumulation_steps=auto train_micro_batch_size_per_gpu=auto "
         "--device cuda --device-memory 1GiB");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "  train_micro_batch_size_per_gpu = 64")) << r.out;
  EXPECT_TRUE(contains(r.out, "  train_batch_size = 64   (micro 64 x accumulation 1 x world 1")) << r.out;
  EXPECT_TRUE(contains(r.out, "  gradient_accumulation_steps = 1   (default 1")) << r.out;
  // Stage 3's prefetch unit is listed once: the block ds gathers (not also the "auto" 0.9 x hidden^2).
  r = ds("plan templates/zero3.json --world-size 2");
  ASSERT_EQ(r.code, 0) << r.err;
  size_t listed = 0;
  for (size_t at = r.out.find("stage3_prefetch_bucket_size ="); at != std::string::npos; at = r.out.find("stage3_prefetch_bucket_size =", at + 1))
    ++listed;
  EXPECT_EQ(listed, 1u) << r.out;
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
  const auto plan = nlohmann::json::parse(slurp(dir + "/plan.json"));
  const double tokens = plan["tokens_per_step"].get<double>(), flops = plan["train_flops_per_step"].get<double>();
  std::string line;
  int lines = 0;
  while (std::getline(metrics, line)) {
    auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["step"], ++lines);
    EXPECT_TRUE(j.contains("loss") && j.contains("lr") && j.contains("grad_norm"));
    const double step_s = j["step_s"].get<double>();
    EXPECT_NEAR(j["forward_s"].get<double>() + j["backward_s"].get<double>() + j["optimizer_s"].get<double>(), step_s,
                0.05 + 0.2 * step_s);
    // Each line's rates are that step's own (not the console's smoothed figure), up to the printed digits.
    EXPECT_NEAR(j["tokens_per_s"].get<double>() * step_s / tokens, 1.0, 1e-3 + 1e-4 / step_s) << line;
    EXPECT_NEAR(j["tflops"].get<double>() * 1e12 * step_s / flops, 1.0, 1e-4 / step_s) << line;
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
  // A long run, interrupted with SIGINT a few steps in, as a person pressing Ctrl-C would.
  Result r = ds_signalled("train examples/quickstart.json train.steps=100000 train.output_dir=" + dir, SIGINT, dir + "/metrics.jsonl", 3, 0.1);
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

TEST(CliTrain, CtrlCAtAnyMomentOfASingleThreadedFp32RunSavesACheckpoint) {
  // Ctrl-C used to run its handler on the computing thread; inside oneDNN's single-threaded sgemm that
  // corrupted the heap and about one run in four aborted without a checkpoint. Now the signal is taken
  // on a thread of its own (common/stop_signals.hpp). Six interrupts at different moments of the steps,
  // counted from the first step's end (not from the start: a loaded machine may still be starting up).
  for (const char* after : {"0.0", "0.03", "0.07", "0.11", "0.17", "0.23"}) {
    const std::string dir = scratch_dir() + "/interrupt_" + after;
    std::system(("rm -rf " + dir).c_str());
    Result r = ds_signalled("train examples/quickstart.json bf16.enabled=false train.threads=1 train.eval_every=0 train.steps=100000 "
                            "train.output_dir=" + dir,
                            SIGINT, dir + "/metrics.jsonl", 1, std::stod(after));
    EXPECT_EQ(r.code, 130) << "interrupted after " << after << " s:\n" << r.err;
    EXPECT_TRUE(contains(r.err, "interrupted at step")) << "interrupted after " << after << " s:\n" << r.err;
    EXPECT_TRUE(std::filesystem::exists(dir + "/checkpoints/latest")) << "no checkpoint after Ctrl-C at " << after << " s";
  }
}

TEST(CliTrain, UnsupportedPlansAndBadDataExitTwoBeforeWork) {
  Result r = ds("train examples/quickstart.json bf16.enabled=true data_types.grad_accum_dtype=fp32");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "grad_accum_dtype")) << r.err;
  r = ds("train examples/quickstart.json data.type=text data.path=/nonexistent/corpus.txt");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "/nonexistent/corpus.txt")) << r.err;
  r = ds("train examples/quickstart.json train.resume=/nonexistent/run");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "no complete checkpoint at '/nonexistent/run'")) << r.err;
}

TEST(CliStartup, CommandsThatRunNoModelNeverLoadLibTorch) {
  // ds plan / estimate-memory / env / --version start in milliseconds: LibTorch is in libds_train.so,
  // loaded by ds train alone. (Timings are in bench/bench_startup.sh, not here.)
  ASSERT_EQ(std::system("ldd " DS_BINARY " | grep -q libtorch"), 256) << "ds links LibTorch directly";
  Result r = ds("plan templates/zero3.json", "LD_DEBUG=files");
  EXPECT_EQ(r.code, 0);
  EXPECT_FALSE(contains(r.err, "libtorch")) << "ds plan loaded LibTorch";
  r = ds("train examples/quickstart.json train.steps=1 train.output_dir=" + scratch_dir() + "/startup_run", "LD_DEBUG=files");
  EXPECT_EQ(r.code, 0);
  EXPECT_TRUE(contains(r.err, "libds_train.so")) << "ds train did not load its runtime";
}

TEST(CliVersion, IdentifiesItselfApartFromDeepSpeedsLauncher) {
  Result r = ds("--version");
  EXPECT_EQ(r.code, 0);
  EXPECT_TRUE(contains(r.out, "ds 0.")) << r.out;
  EXPECT_TRUE(contains(r.out, "git ")) << r.out;
  EXPECT_TRUE(contains(r.out, "not DeepSpeed's Python `ds` launcher")) << r.out;
  EXPECT_TRUE(contains(r.out, "LibTorch")) << r.out;
  // What the layers' fp32 products run on: the library this build found, or LibTorch's BLAS.
  EXPECT_TRUE(contains(r.out, "fp32 products of the layers: oneDNN sgemm (libdnnl") ||
              contains(r.out, "fp32 products of the layers: LibTorch (its BLAS)")) << r.out;
}

TEST(CliEnv, ReportsTheMachineAsJson) {
  Result r = ds("env --json");
  ASSERT_EQ(r.code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_GE(j["cores"].get<int>(), 1);
  EXPECT_GT(j["memory_bytes"].get<int64_t>(), 0);
  EXPECT_TRUE(j.contains("shm_bytes"));
  // The attention kernels a run gets: tiles only where /proc/cpuinfo lists what they need.
  const auto& features = j["cpu_features"];
  const bool fp32_tiles = j["attention_tiles"]["fp32"].get<bool>(), bf16_tiles = j["attention_tiles"]["bf16"].get<bool>();
  EXPECT_EQ(fp32_tiles, features["avx512f"].get<bool>()) << r.out;  // (every AVX-512 CPU since Skylake has BW, VL, DQ)
  // bf16 tiles exactly where the CPU has AVX512-BF16 (+ AVX-512); their products AMX where it has that too.
  EXPECT_EQ(bf16_tiles, features["avx512_bf16"].get<bool>() && features["avx512f"].get<bool>()) << r.out;
  const std::string products = j["attention_bf16_products"].get<std::string>();
  if (bf16_tiles)
    EXPECT_EQ(products, features["amx_bf16"].get<bool>() ? "AMX" : "AVX512-BF16") << r.out;
  else
    EXPECT_EQ(products, "none") << r.out;
}

TEST(CliEnv, SaysWhetherCudaIsBuiltInAndWhatItsRuntimeSees) {
  // ds env and ds --version agree on whether this ds has the CUDA kernels; where it has them, env says how
  // many devices the CUDA runtime sees, and when none, the runtime's own reason.
  const Result version = ds("--version");
  const bool built = version.out.find("CUDA kernels: compiled") != std::string::npos;
  Result r = ds("env --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto cuda = nlohmann::json::parse(r.out)["cuda"];
  EXPECT_EQ(cuda["kernels_built"].get<bool>(), built) << version.out;
  if (!built) {
    EXPECT_EQ(cuda["devices_visible"].get<int>(), 0);
  } else if (cuda["devices_visible"].get<int>() == 0) {
    EXPECT_FALSE(cuda["reason"].get<std::string>().empty());
  }
  const Result text = ds("env");
  EXPECT_NE(text.out.find("  cuda         "), std::string::npos) << text.out;
}

TEST(CliEnv, ThreadsFollowTheCpusTheProcessMayUseNotTheMachines) {
  // Pinned to one CPU (as taskset, Slurm or a container cpuset do): one usable core, one thread; more
  // would only wait on each other.
  Result r = ds("env --json", "taskset -c 0");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["cores"], 1) << r.out;
  EXPECT_EQ(j["cores_detail"]["affinity"], 1) << r.out;
  r = ds("plan examples/quickstart.json --json", "taskset -c 0");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["threads"], 1);
}

TEST(CliTrain, IdleThreadsWaitBrieflyUnlessTheUserChoseHowTheyWait) {
  // libgomp's default long spin, and OpenBLAS's worker threads spinning after each product, take CPU from
  // the busy threads; ds train sets short waits before those libraries load (it runs itself again), and
  // the start-up line says which settings are in force. Each setting the user made is kept.
  const std::string dir = scratch_dir() + "/spin";
  const std::string args = "train examples/quickstart.json train.steps=1 train.eval_every=0 --overwrite train.output_dir=" + dir;
  Result r = ds(args, "-u OMP_WAIT_POLICY -u GOMP_SPINCOUNT -u OPENBLAS_THREAD_TIMEOUT");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, " (GOMP_SPINCOUNT=1000, OPENBLAS_THREAD_TIMEOUT=4); writing ")) << r.err;
  r = ds(args, "-u GOMP_SPINCOUNT -u OPENBLAS_THREAD_TIMEOUT OMP_WAIT_POLICY=active");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, " (OMP_WAIT_POLICY=active, OPENBLAS_THREAD_TIMEOUT=4); writing ")) << r.err;
  r = ds(args, "-u OMP_WAIT_POLICY -u GOMP_SPINCOUNT OPENBLAS_THREAD_TIMEOUT=20");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, " (GOMP_SPINCOUNT=1000, OPENBLAS_THREAD_TIMEOUT=20); writing ")) << r.err;
  r = ds(args, "GOMP_SPINCOUNT=5000 OPENBLAS_THREAD_TIMEOUT=30");  // nothing to set: no second start either
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, " (GOMP_SPINCOUNT=5000, OPENBLAS_THREAD_TIMEOUT=30); writing ")) << r.err;
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


// ---- Trust: what a user relies on most (issue "Trust") ----

namespace {
const char* kShort = "train examples/quickstart.json train.steps=20 train.save_every=10 steps_per_print=10 ";
}  // namespace

TEST(CliTrust, SizesNeedAUnitAndTheHelpSaysWhichUnitIsWhich) {
  Result r = ds("plan templates/zero2.json --device-memory 80");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "--device-memory 80: give a unit, e.g. 80GiB")) << r.err;
  r = ds("estimate-memory --model 7b --gpu-memory 80");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "give a unit")) << r.err;
  EXPECT_TRUE(contains(ds("estimate-memory --help").out, "GB = 10^9 bytes; GiB (or G) = 2^30 bytes"));
}

TEST(CliTrust, ASizeOnlyModelIsPlannedLikeThePresetOfTheSameSizes) {
  auto rows = [&](const std::string& model) {
    Result r = ds("estimate-memory " + model + " --gpus 8 --gpu-memory 80GiB --json");
    EXPECT_EQ(r.code, 0) << r.err;
    return nlohmann::json::parse(r.out);
  };
  const auto preset = rows("--model 7b"), sized = rows("--params 6738415616 --largest-layer 131072000");
  auto stage3 = [](const nlohmann::json& j) {
    for (const auto& row : j["rows"])
      if (row["zero_stage"] == 3 && row["offload_optimizer"] == "none" && row["offload_param"] == "none" &&
          row["activation_checkpointing"] == false)
        return row["per_gpu"];
    return nlohmann::json();
  };
  const auto a = stage3(preset), b = stage3(sized);
  for (const char* k : {"params", "grads", "optimizer_states"})
    EXPECT_NEAR(b[k].get<double>(), a[k].get<double>(), 0.01 * a[k].get<double>()) << k;
  // Gather and reduce buffers: a layer at a time (two in flight), the same order as the preset's blocks,
  // not the whole model (which once made ZeRO-3 look like it needed 75 GiB of buffers).
  EXPECT_LT(b["buffers"].get<double>(), 2.0 * a["buffers"].get<double>());
  EXPECT_GT(b["buffers"].get<double>(), 0.25 * a["buffers"].get<double>());
  EXPECT_EQ(preset["rows"][preset["recommended"].get<int>()]["zero_stage"], sized["rows"][sized["recommended"].get<int>()]["zero_stage"]);
}

TEST(CliTrust, TheRecommendationLeavesHeadroom) {
  for (const std::string headroom : {"", "0.3"}) {
    Result r = ds("estimate-memory --model 7b --gpus 8 --gpu-memory 80GiB --json" + (headroom.empty() ? "" : " --headroom " + headroom));
    ASSERT_EQ(r.code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    const double share = headroom.empty() ? 0.1 : 0.3;
    EXPECT_DOUBLE_EQ(j["assumptions"]["headroom"].get<double>(), share);
    ASSERT_GE(j["recommended"].get<int>(), 0);
    const double total = j["rows"][j["recommended"].get<int>()]["per_gpu"]["total"].get<double>();
    EXPECT_LE(total, (1 - share) * 80.0 * (1 << 30));
    for (const auto& row : j["rows"])  // "fits" means within the headroom, for every row
      EXPECT_EQ(row["fits"].get<bool>(), row["per_gpu"]["total"].get<double>() <= (1 - share) * 80.0 * (1 << 30));
  }
  EXPECT_TRUE(contains(ds("estimate-memory --model 7b --gpus 8 --gpu-memory 80GiB").out, "fits = at most 90% of each GPU"));
}

TEST(CliTrust, ALongerResumedRunKeepsTheCheckpointsSchedule) {
  const std::string dir = scratch_dir() + "/horizon";
  std::filesystem::remove_all(dir);
  // A warmup that ends inside the first run, so the rest of its schedule is the cosine down to its floor.
  ASSERT_EQ(ds(std::string(kShort) + "scheduler.params.warmup_num_steps=5 train.output_dir=" + dir).code, 0);
  Result r = ds("train examples/quickstart.json train.steps=30 scheduler.params.warmup_num_steps=5 train.output_dir=" + dir + " --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "train.steps 20 -> 30: the schedule keeps total_num_steps=20")) << r.err;
  const auto m = metrics_of(dir);
  ASSERT_EQ(m.size(), 30u);  // appended on resume, never truncated
  const double lr20 = m[19]["lr"].get<double>();
  for (size_t i = 21; i < 30; ++i) EXPECT_LE(m[i]["lr"].get<double>(), lr20 * 1.0001) << "step " << i + 1 << " jumped";
  // Changing the schedule itself is the way to stretch it: then nothing is pinned.
  r = ds("train examples/quickstart.json train.steps=35 scheduler.params.warmup_num_steps=5 scheduler.params.total_num_steps=35 "
         "train.output_dir=" + dir + " --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(contains(r.err, "the schedule keeps")) << r.err;
}

TEST(CliTrust, AFreshRunNeverOverwritesARun) {
  const std::string dir = scratch_dir() + "/no_clobber";
  std::filesystem::remove_all(dir);
  ASSERT_EQ(ds(std::string(kShort) + "train.output_dir=" + dir).code, 0);
  Result r = ds("train examples/quickstart.json train.steps=5 train.output_dir=" + dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "holds a run (checkpoint step_00000020, metrics.jsonl with 20 steps)")) << r.err;
  EXPECT_TRUE(contains(r.err, "--resume")) << r.err;
  EXPECT_EQ(metrics_of(dir).size(), 20u);  // untouched
  // --resume follows `latest`, even where a higher step exists beside it.
  std::ofstream(dir + "/checkpoints/latest") << "step_00000010";
  r = ds("train examples/quickstart.json train.steps=12 train.output_dir=" + dir + " --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "resuming from " + dir + "/checkpoints/step_00000010 at step 10")) << r.err;
  // --overwrite: asked for, so the previous run goes.
  r = ds("train examples/quickstart.json train.steps=5 train.output_dir=" + dir + " --overwrite");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(metrics_of(dir).size(), 5u);
  EXPECT_FALSE(std::filesystem::exists(dir + "/checkpoints/step_00000020"));
}

TEST(CliTrust, EveryRealDeepSpeedConfigPlansWithoutAModelBlock) {
  const std::string configs = std::string(DS_SHARED_DIR) + "/data/deepspeed-configs";
  if (!std::filesystem::is_directory(configs)) GTEST_SKIP() << "no " << configs;
  int planned = 0;
  for (const auto& e : std::filesystem::directory_iterator(configs)) {
    Result r = ds("plan " + e.path().string());
    EXPECT_FALSE(contains(r.err, "no model block")) << e.path() << r.err;  // the real problem, if any, is shown
    if (r.code == 0) {
      ++planned;
      EXPECT_TRUE(contains(r.out, "Needs a model")) << r.out;
    } else {
      EXPECT_EQ(r.code, 2) << e.path() << r.err;
    }
  }
  EXPECT_GE(planned, 20);
  Result r = ds("plan " + configs + "/tests_model_Megatron_GPT2_ds_config_func_bs4_zero2.json --world-size 4");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "bytes per parameter per rank per step")) << r.out;
  EXPECT_TRUE(contains(r.out, "stage 2: optimizer states and gradients partitioned")) << r.out;
  r = ds("plan " + configs + "/tests_model_Megatron_GPT2_ds_config_func_bs4_zero2.json --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(nlohmann::json::parse(r.out)["has_model"].get<bool>());
  // train needs the model and says how to give one
  r = ds("train " + configs + "/tests_model_Megatron_GPT2_ds_config_func_bs4_zero2.json");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "model.preset=")) << r.err;
}

TEST(CliTrust, JsonRunsGetAJsonErrorOnStdout) {
  Result r = ds("plan templates/zero2.json zero_optimization.stag=3 --json");
  EXPECT_EQ(r.code, 2);
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["schema_version"], 1);
  EXPECT_EQ(j["errors"][0]["path"], "zero_optimization.stag");
  r = ds("estimate-memory --model nosuch --json");
  EXPECT_EQ(r.code, 2);
  EXPECT_FALSE(nlohmann::json::parse(r.out)["errors"].empty());
}

TEST(CliTrust, TopologyFlagsHaveOneSpellingWithDeepSpeedsAsAliases) {
  for (const char* flag : {"--nproc-per-node 2", "--gpus 2", "--num_gpus 2"}) {
    Result r = ds(std::string("plan templates/zero2.json --json ") + flag);
    ASSERT_EQ(r.code, 0) << flag << r.err;
    EXPECT_EQ(nlohmann::json::parse(r.out)["topology"]["world_size"], 2) << flag;
  }
  EXPECT_EQ(ds("estimate-memory --model 7b --nproc-per-node 8 --num_nodes 2 --json").code, 0);
  Result r = ds("plan templates/zero2.json --nproc-per-nod 2");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "did you mean --nproc-per-node?")) << r.err;
  r = ds("train examples/quickstart.json --include localhost:0");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "--hostfile")) << r.err;
  EXPECT_TRUE(contains(ds("train --help").out, "--master_port")) << "DeepSpeed's spelling is accepted";
}

TEST(CliTrust, InstallPutsTheBinaryManPagesAndTemplatesInPlace) {
  const std::string prefix = scratch_dir() + "/prefix";
  ASSERT_EQ(std::system(("cmake --install " DS_BUILD_DIR " --prefix " + prefix + " >/dev/null").c_str()), 0);
  for (const char* f : {"bin/ds", "lib/ds/libds_train.so", "share/man/man1/ds-train.1", "share/man/man5/ds-config.5",
                        "share/ds/templates/zero3.json", "share/ds/examples/quickstart.json"})
    EXPECT_TRUE(std::filesystem::exists(prefix + "/" + f)) << f;
  // The installed binary finds its training runtime (lib/ds/libds_train.so) and trains.
  const std::string run = scratch_dir() + "/installed_run";
  std::filesystem::remove_all(run);
  EXPECT_EQ(std::system(("cd " + work_dir() + " && " + prefix + "/bin/ds train examples/quickstart.json train.steps=2 train.output_dir=" +
                         run + " >/dev/null 2>&1").c_str()),
            0);
  EXPECT_TRUE(std::filesystem::exists(run + "/checkpoints/latest"));
}

TEST(CliTrust, ProgressKeepsLinesValidationAndRatesThatAreNotZero) {
  const std::string dir = scratch_dir() + "/progress";
  std::filesystem::remove_all(dir);
  Result r = ds("train examples/quickstart.json train.steps=30 train.eval_every=15 steps_per_print=10 train.output_dir=" + dir);
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* line : {"step  1/30", "step 10/30", "step 15/30 | loss", "(val ", "step 20/30", "step 30/30"})
    EXPECT_TRUE(contains(r.err, line)) << line << "\n" << r.err;
  EXPECT_FALSE(contains(r.err, "| 0.00 TFLOP/s")) << r.err;
  for (const auto& m : metrics_of(dir)) EXPECT_GT(m["tflops"].get<double>(), 0);
  // train.log ends as the terminal did: the summary and the peak memory
  const std::string log = slurp(dir + "/train.log");
  EXPECT_TRUE(contains(log, "ds train: done: 30 of 30 steps")) << log;
  EXPECT_TRUE(contains(log, "ds train: peak resident memory")) << log;
}

// "12.34 MiB" as format_bytes writes it, in bytes.
double bytes_of(const std::string& text) {
  const double v = std::stod(text);
  const char unit = text[text.find(' ') + 1];
  return v * (unit == 'G' ? 1 << 30 : unit == 'M' ? 1 << 20 : unit == 'K' ? 1 << 10 : 1);
}

// The closing memory line: its parts add up to the peak; the peak is the kernel's own account of the process
// (getrusage of the finished child: this test's only one); training's part holds at least the state the
// plan counts and stays near the plan, once the code LibTorch first runs in step 1 is set apart.
TEST(CliTrust, ThePeakMemoryLineAddsUpToTheKernelsAccountOfTheProcess) {
  const std::string dir = scratch_dir() + "/peak";
  std::filesystem::remove_all(dir);
  Result r = ds("train examples/quickstart.json train.steps=20 bf16.enabled=false train.output_dir=" + dir);
  ASSERT_EQ(r.code, 0) << r.err;
  rusage children{};
  ASSERT_EQ(getrusage(RUSAGE_CHILDREN, &children), 0);
  const double kernel_peak = static_cast<double>(children.ru_maxrss) * 1024.0;
  const std::string b = R"(([0-9.]+ [KMG]?i?B))";
  const std::regex line("peak resident memory " + b + ": " + b + " of code and libraries \\+ " + b +
                        " of code and files paged in since \\+ " + b + " for training, ([0-9.]+)x the plan's " + b);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.err, m, line)) << r.err;
  const double peak = bytes_of(m[1]), code = bytes_of(m[2]), paged = bytes_of(m[3]), training = bytes_of(m[4]);
  const double ratio = std::stod(m[5]), planned = bytes_of(m[6]);
  const double rounding = 0.02 * (1 << 20);
  EXPECT_NEAR(code + paged + training, peak, rounding);
  EXPECT_LE(peak, kernel_peak + rounding);
  EXPECT_GE(peak, 0.97 * kernel_peak);
  EXPECT_GT(paged, 1 << 20);
  EXPECT_NEAR(ratio, training / planned, 0.01);
  const auto plan = nlohmann::json::parse(slurp(dir + "/plan.json"))["memory"]["device_per_rank"];
  EXPECT_NEAR(planned, plan["total"].get<double>(), rounding);
  const double state = plan["params"].get<double>() + plan["grads"].get<double>() + plan["optimizer_states"].get<double>();
  EXPECT_GE(training, state);
  EXPECT_LE(training, 2 * planned);
}

TEST(CliTrust, ThePlanShowsTheDataAndMissingInputsAreCaughtBeforeARun) {
  Result r = ds("plan examples/quickstart.json data.type=text data.path=nosuch.txt");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "data        text nosuch.txt, tokenizer bytes")) << r.out;
  EXPECT_TRUE(contains(r.err, "data.path: 'nosuch.txt' does not exist")) << r.err;
  r = ds("train examples/quickstart.json data.type=text data.path=nosuch.txt");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "'nosuch.txt' does not exist")) << r.err;
  EXPECT_TRUE(contains(ds("plan examples/quickstart.json model.dropout=0.1").out, "dropout attention 0.1, residual 0.1, embedding 0.1"));
}

// ---- Hardening: attacks from outside (issue "Hardening") ----

TEST(CliHardening, SigtermSavesAndExits143WithACommandThatResumesThisRun) {
  const std::string dir = scratch_dir() + "/sigterm";
  std::filesystem::remove_all(dir);
  Result r = ds_signalled("train examples/quickstart.json train.steps=100000 optimizer.params.lr=0.002 train.output_dir=" + dir, SIGTERM,
                          dir + "/metrics.jsonl", 3, 0.1);
  EXPECT_EQ(r.code, 143) << r.err;
  EXPECT_TRUE(std::filesystem::exists(dir + "/checkpoints/latest")) << r.err;
  // The printed command keeps the overrides (the output directory above all).
  EXPECT_TRUE(contains(r.err, "continue with: ds train examples/quickstart.json train.steps=100000 optimizer.params.lr=0.002 "
                              "train.output_dir=" + dir + " --resume")) << r.err;
}

TEST(CliHardening, AnExplicitResumePathIsUsedOrRefused) {
  const std::string dir = scratch_dir() + "/explicit";
  std::filesystem::remove_all(dir);
  ASSERT_EQ(ds(std::string(kShort) + "train.output_dir=" + dir).code, 0);
  Result r = ds("train examples/quickstart.json train.steps=22 train.output_dir=" + dir + " train.resume=" + dir +
                "/checkpoints/step_00000010 --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "resuming from " + dir + "/checkpoints/step_00000010 at step 10")) << r.err;
  r = ds("train examples/quickstart.json train.output_dir=" + dir + " train.resume=" + dir + "/checkpoints/step_00000099 --resume");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "no complete checkpoint at")) << r.err;
}

TEST(CliHardening, OddRunDirectoriesAreNamedNotCrashedOn) {
  const std::string dir = scratch_dir() + "/odd";
  std::filesystem::remove_all(dir);
  ASSERT_EQ(ds(std::string(kShort) + "train.output_dir=" + dir).code, 0);
  std::filesystem::create_directories(dir + "/checkpoints/step_garbage");
  std::filesystem::create_directories(dir + "/checkpoints/step_99999999999999999999");
  Result r = ds("train examples/quickstart.json train.steps=21 train.output_dir=" + dir + " --resume");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "skipping " + dir + "/checkpoints/step_garbage: not a step number")) << r.err;
  const std::string file_dir = scratch_dir() + "/ckpt_file";
  std::filesystem::create_directories(file_dir);
  std::ofstream(file_dir + "/checkpoints") << "not a directory";
  r = ds("train examples/quickstart.json train.steps=2 train.output_dir=" + file_dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "is a file")) << r.err;
}

TEST(CliHardening, HostileInputsExitTwoWithAMessage) {
  const std::string deep = scratch_dir() + "/deep.json";
  std::ofstream(deep) << std::string(50000, '[') << std::string(50000, ']');
  for (const std::string& cmd : {"plan " + deep, "train " + deep, "estimate-memory --model " + deep}) {
    Result r = ds(cmd);
    EXPECT_EQ(r.code, 2) << cmd << r.err;
    EXPECT_TRUE(contains(r.err, "nesting deeper than")) << cmd << r.err;
  }
  Result r = ds("plan templates");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "is a directory")) << r.err;
  r = ds("plan examples/quickstart.json train_micro_batch_size_per_gpu=9223372036854775807");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "train_micro_batch_size_per_gpu")) << r.err;
  r = ds("estimate-memory --params 1e30 --largest-layer 1e6 --gpus 8");
  EXPECT_EQ(r.code, 2) << r.out;
  r = ds("estimate-memory --params 0 --largest-layer 1");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "not a positive parameter count")) << r.err;
  r = ds("estimate-memory --params nan --largest-layer 1");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "not a number")) << r.err;
  // A run the plan says cannot fit this machine is refused before it allocates (unless forced).
  r = ds("train examples/quickstart.json train_micro_batch_size_per_gpu=1048576 train.steps=1");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "per node, but this machine has")) << r.err;
  EXPECT_TRUE(contains(r.err, "--no-fit-check")) << r.err;
  // The documented --micro-batch flag works.
  r = ds("estimate-memory --model 7b --gpus 8 --micro-batch 2 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["assumptions"]["micro_batch"], 2);
}

TEST(CliHardening, RanksDieWithTheirLauncher) {
  const std::string dir = scratch_dir() + "/orphans";
  std::filesystem::remove_all(dir);
  // kill -9 the launcher once the ranks train; nothing of this run may be left a few seconds later.
  const std::string script = "cd " + work_dir() + " && (" DS_BINARY " train examples/quickstart.json --nproc-per-node 2 "
                             "zero_optimization.stage=2 train.steps=100000 train.output_dir=" + dir +
                             " >/dev/null 2>&1 & echo $! > " + dir + ".pid; wait) & sleep 6; kill -9 $(cat " + dir +
                             ".pid); for i in $(seq 1 40); do pgrep -f 'train.output_dir=" + dir + "$' >/dev/null || exit 0; sleep 0.5; done; exit 1";
  std::filesystem::create_directories(scratch_dir());
  EXPECT_EQ(std::system(("bash -c '" + [&] {
                          std::string q;
                          for (char c : script) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
                          return q;
                        }() + "'").c_str()),
            0)
      << "ranks of the killed launcher still run";
  std::system(("pkill -9 -f 'train.output_dir=" + dir + "$'").c_str());
}

TEST(CliHardening, AFullDiskIsFoundBeforeTheFirstStepAndNamedWhenItFillsLater) {
  // A small tmpfs in a private mount namespace stands in for a full disk (needs root; skipped otherwise).
  const std::string mnt = scratch_dir() + "/tiny_disk";
  std::filesystem::create_directories(mnt);
  if (std::system(("unshare -m sh -c 'mount -t tmpfs -o size=64k tmpfs " + mnt + "' 2>/dev/null").c_str()) != 0)
    GTEST_SKIP() << "cannot mount a tmpfs here";
  auto in_tiny_disk = [&](const std::string& size, const std::string& args) {
    const std::string out = scratch_dir() + "/tiny_out", err = scratch_dir() + "/tiny_err";
    const int status = std::system(("unshare -m sh -c 'mount -t tmpfs -o size=" + size + " tmpfs " + mnt + " && cd " + work_dir() +
                                    " && " DS_BINARY " " + args + "' >" + out + " 2>" + err + " </dev/null").c_str());
    return Result{WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
  };
  // 64 KiB cannot hold a 1.4 MiB checkpoint: refused before any step.
  Result r = in_tiny_disk("64k", "train examples/quickstart.json train.steps=5 train.output_dir=" + mnt + "/run");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "free; a checkpoint needs")) << r.err;
  EXPECT_FALSE(contains(r.err, "step 1/")) << r.err;
  // Room for one checkpoint but not a second: the failed write names the file, the run exits 1, and the
  // first checkpoint stays complete.
  r = in_tiny_disk("2600k", "train examples/quickstart.json train.steps=4 train.save_every=2 train.keep_last=0 train.output_dir=" + mnt +
                                "/run && ls " + mnt + "/run/checkpoints/step_00000002/DONE");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_TRUE(contains(r.err, mnt + "/run/checkpoints/")) << r.err;
}

TEST(CliHardening, ACorruptCheckpointIsNamedAndThePreviousOneOffered) {
  const std::string dir = scratch_dir() + "/corrupt";
  std::filesystem::remove_all(dir);
  ASSERT_EQ(ds(std::string(kShort) + "train.output_dir=" + dir).code, 0);
  // Four bytes flipped in the middle of the file: inside the weights or the optimizer moments.
  const std::string file = dir + "/checkpoints/step_00000020/state.h5";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(std::filesystem::file_size(file) / 2));
    f.write("\xde\xad\xbe\xef", 4);
  }
  Result r = ds("train examples/quickstart.json train.steps=25 train.save_every=10 train.output_dir=" + dir + " --resume");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, file + "': data set '")) << r.err;
  EXPECT_TRUE(contains(r.err, "does not match its checksum")) << r.err;
  EXPECT_TRUE(contains(r.err, "train.resume=" + dir + "/checkpoints/step_00000010")) << r.err;
  // Exporting it is refused the same way (convert-ckpt verifies every shard once, before the first tensor),
  // and nothing is left under the destination's name.
  r = ds("convert-ckpt " + dir + "/checkpoints/step_00000020 " + dir + "/export.safetensors");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "does not match its checksum")) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir + "/export.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/export.safetensors.partial"));
  // Cut to half its size (a full disk, an interrupted copy): called truncated, with the same way out.
  std::filesystem::resize_file(file, std::filesystem::file_size(file) / 2);
  r = ds("convert-ckpt --info " + dir);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, file + "' is not a readable HDF5 file")) << r.err;
  EXPECT_TRUE(contains(r.err, "truncated or damaged")) << r.err;
  EXPECT_TRUE(contains(r.err, "train.resume=" + dir + "/checkpoints/step_00000010")) << r.err;
  r = ds("train examples/quickstart.json train.steps=25 train.save_every=10 train.output_dir=" + dir + " train.resume=" + dir +
         "/checkpoints/step_00000010");
  EXPECT_EQ(r.code, 0) << r.err;
}

TEST(CliHardening, AFrozenRankIsTheOneNamed) {
  const std::string dir = scratch_dir() + "/frozen";
  std::filesystem::remove_all(dir);
  // Rank 1 is stopped (SIGSTOP) once the first step is done (every rank is past start-up, however
  // loaded the machine); rank 0 times out in its next collective.
  const std::string script =
      "cd " + work_dir() + "; (for i in $(seq 200); do [ -s " + dir + "/metrics.jsonl ] && break; sleep 0.25; done; for p in $(pgrep -f 'train.output_dir=" + dir + "$'); do "
      "tr '\\0' '\\n' < /proc/$p/environ | grep -qx RANK=1 && kill -STOP $p; done) & " DS_BINARY
      " train examples/quickstart.json --nproc-per-node 2 zero_optimization.stage=2 train.steps=100000 train.comm_timeout_s=5 "
      "train.output_dir=" + dir + " >/dev/null 2>" + dir + ".err; echo $? > " + dir + ".rc";
  std::filesystem::create_directories(scratch_dir());
  std::ofstream(scratch_dir() + "/frozen.sh") << script;
  std::system(("timeout 60 bash " + scratch_dir() + "/frozen.sh").c_str());
  const std::string err = slurp(dir + ".err");
  EXPECT_EQ(slurp(dir + ".rc"), "1\n") << err;
  EXPECT_TRUE(contains(err, "rank 1 of 2 was stopped (SIGSTOP or a debugger)")) << err;
  EXPECT_TRUE(contains(err, "a collective failed: ")) << err;  // rank 0's own account
  std::system(("pkill -9 -f 'train.output_dir=" + dir + "$'").c_str());
}

TEST(CliPlan, LoraShowsWhatTrainsWhatIsFrozenAndEstimateMemoryAnswersForIt) {
  Result r = ds("plan examples/lora.json");
  ASSERT_EQ(r.code, 0) << r.err;
  // gpt2-tiny, r 8 on c_attn (64 -> 192), c_proj (64 -> 64), c_fc (64 -> 256), mlp.c_proj (256 -> 64), 2 blocks.
  const int64_t adapter = 2 * 8 * ((64 + 192) + (64 + 64) + (64 + 256) + (256 + 64));
  EXPECT_TRUE(contains(r.out, "lora        r 8, alpha 16 (scale 2), dropout 0.05 on c_attn, c_proj, c_fc: 16,384 parameters train")) << r.out;
  EXPECT_EQ(adapter, 16384);
  r = ds("plan examples/lora.json --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["lora"]["trainable_params"], adapter);
  EXPECT_EQ(j["lora"]["frozen_params"], j["model"]["num_params"]);
  EXPECT_EQ(j["layout"]["numel"], adapter);
  r = ds("plan examples/lora.json 'model.lora.target_modules=[\"q_proj\"]'");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "its modules are: c_attn, c_proj, c_fc")) << r.err;

  // Llama-2-7B, r 16 on every projection: 32 blocks x 16 x (4 x (4096 + 4096) + 2 x (4096 + 11008) + (11008 + 4096)).
  r = ds("estimate-memory --model llama-2-7b --lora-r 16 --zero-stage 0 --activation-checkpointing on --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json e = nlohmann::json::parse(r.out);
  const int64_t adapter7b = int64_t{32} * 16 * (4 * 8192 + 3 * 15104);
  EXPECT_EQ(e["lora"]["trainable_params"], adapter7b);
  EXPECT_EQ(e["lora"]["frozen_params"], e["model"]["num_params"]);
  const nlohmann::json& row = e["rows"][0];
  // bf16: the base and the adapter at 2 bytes, the adapter's gradients at 2, its fp32 master and moments at 12.
  EXPECT_EQ(row["per_gpu"]["params"].get<int64_t>(), 2 * e["model"]["num_params"].get<int64_t>() + 2 * adapter7b);
  EXPECT_EQ(row["per_gpu"]["grads"].get<int64_t>(), 2 * adapter7b);
  EXPECT_EQ(row["per_gpu"]["optimizer_states"].get<int64_t>(), 12 * adapter7b);
  r = ds("estimate-memory --model llama-2-7b --lora-r 16 --lora-targets q_proj,wq");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "'wq' is not a projection")) << r.err;
}
