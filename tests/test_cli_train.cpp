// `ds train` as a user runs it: the run directory it writes, Ctrl-C and SIGTERM, resume, a fresh run that
// never overwrites another, progress and memory lines, and hostile inputs, full disks, corrupt checkpoints
// and ranks that die or hang (the Trust and Hardening issues).
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>

#include <nlohmann/json.hpp>

#include "cli_helpers.hpp"

using namespace cli_test;

namespace {
const char* kShort = "train examples/quickstart.json train.steps=20 train.save_every=10 steps_per_print=10 ";
}  // namespace

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
  Result r = ds("train examples/quickstart.json bf16.enabled=false fp16.enabled=true data_types.grad_accum_dtype=fp32");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "data_types.grad_accum_dtype fp32 with fp16 weights")) << r.err;
  r = ds("train examples/quickstart.json data.type=text data.path=/nonexistent/corpus.txt");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "/nonexistent/corpus.txt")) << r.err;
  r = ds("train examples/quickstart.json train.resume=/nonexistent/run");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "no complete checkpoint at '/nonexistent/run'")) << r.err;
  // Launching ranks: a plan ds cannot train yet is refused before any rank starts or the run directory is made.
  const std::string dir = fresh("refused_pipeline");
  r = ds("train examples/pipeline-parallel.json --nproc-per-node 4 bf16.enabled=false data_types.grad_accum_dtype=bf16 train.output_dir=" + dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "data_types.grad_accum_dtype bf16 with fp32 weights")) << r.err;
  EXPECT_FALSE(contains(r.err, "starting 4 CPU ranks")) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir)) << dir;
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

// A checkpoint an earlier ds wrote, kept as it was (tests/data/checkpoint-46924e5: 2 ranks, ZeRO stage 3, a
// qwen3 variant): today's ds resumes it on one rank with its global batch and schedule kept, exports it to
// Hugging Face, and reshards it.
// A resumed run's checkpoint is settled with the plan, but its problems come after the config's own: a bad
// batch, or a missing data file, is reported before a checkpoint that is not there or cannot be continued.
TEST(CliTrust, TheConfigsErrorsComeBeforeTheCheckpointsOnResume) {
  const std::string dir = scratch_dir() + "/resume_order";
  std::filesystem::remove_all(dir);
  Result r = ds("train examples/quickstart.json train_batch_size=7 train.resume=" + dir + "/nowhere train.output_dir=" + dir + "/a");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "train_batch_size 7 != micro 16")) << r.err;
  ASSERT_EQ(ds("train examples/quickstart.json train.steps=2 train.eval_every=0 train.output_dir=" + dir + "/b").code, 0);
  // 16 cannot be kept on 2 ranks of micro 16; the missing data is said first.
  r = ds("train examples/quickstart.json train.steps=4 data.type=tokens data.path=" + dir + "/none.bin train.output_dir=" + dir +
         "/b --resume --nproc-per-node 2");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "none.bin' does not exist")) << r.err;
  r = ds("train examples/quickstart.json train.steps=4 train.output_dir=" + dir + "/b --resume --nproc-per-node 2");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "resuming at another world size: the global batch would change from 16")) << r.err;
}

TEST(CliTrust, ACheckpointKeptFromAnEarlierDsResumesExportsAndReshards) {
  namespace fs = std::filesystem;
  const std::string dir = scratch_dir() + "/kept", fixture = std::string(DS_SOURCE_DIR) + "/tests/data/checkpoint-46924e5";
  fs::remove_all(dir);
  fs::create_directories(dir + "/run/checkpoints");
  fs::copy(fixture + "/step_00000004", dir + "/run/checkpoints/step_00000004", fs::copy_options::recursive);
  const std::string config = "tests/data/checkpoint-46924e5/config.json ";
  Result r = ds("train " + config + "train.steps=6 train.output_dir=" + dir + "/run --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "resuming on 1 rank (the checkpoint's run had 2): keeping its global batch of 8 with gradient_accumulation_steps=4"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "at step 4")) << r.err;
  EXPECT_TRUE(contains(r.err, "train.steps 4 -> 6: the schedule keeps total_num_steps=4")) << r.err;
  // What ds kept to continue the run as it was is not reported as a change of the config.
  EXPECT_FALSE(contains(r.err, "the config differs from the checkpoint's at: gradient_accumulation_steps")) << r.err;
  const auto m = metrics_of(dir + "/run");
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0]["step"], 5);
  for (const auto& step : m) {  // the run ended at 4.54 (uniform over its 96 tokens: 4.56)
    EXPECT_GT(step["loss"].get<double>(), 3.5) << step.dump();
    EXPECT_LT(step["loss"].get<double>(), 5.0) << step.dump();
  }
  const std::string kept = dir + "/run/checkpoints/step_00000004";
  r = ds("convert-ckpt " + kept + " " + dir + "/hf");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json hf = nlohmann::json::parse(slurp(dir + "/hf/config.json"));
  EXPECT_EQ(hf["model_type"], "qwen3");
  EXPECT_EQ(hf["head_dim"], 12);
  EXPECT_EQ(hf["rope_scaling"]["rope_type"], "llama3");
  r = ds("convert-ckpt " + kept + " " + dir + "/one --world-size 1 --stage 1");
  ASSERT_EQ(r.code, 0) << r.err;
  r = ds("train " + config + "train.steps=5 zero_optimization.stage=1 train.output_dir=" + dir + "/one --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(metrics_of(dir + "/one").size(), 1u);
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
  // The bound only stops a run that never ends (normally it ends ~10 s in); start-up on a loaded machine (the stopper
  // waits up to 50 s for the first step) took it past 60 s once.
  std::system(("timeout 180 bash " + scratch_dir() + "/frozen.sh").c_str());
  const std::string err = slurp(dir + ".err");
  EXPECT_EQ(slurp(dir + ".rc"), "1\n") << err;
  EXPECT_TRUE(contains(err, "rank 1 of 2 was stopped (SIGSTOP or a debugger)")) << err;
  EXPECT_TRUE(contains(err, "a collective failed: ")) << err;  // rank 0's own account
  std::system(("pkill -9 -f 'train.output_dir=" + dir + "$'").c_str());
}
