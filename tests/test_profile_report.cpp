// The profile report's memory section, built from a rank's measurements as ds profile builds it: on a GPU the
// device's memory (the most in use after a step, less what was in use before training) is set beside the plan's
// device bytes and the resident memory beside the plan's host part; on the CPU the resident memory beside all of
// it. The figures are computed here again from the same inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "cli/profile_report.hpp"
#include "common/format.hpp"
#include "test_helpers.hpp"

using namespace ds;
using nlohmann::json;

namespace {

const char* kTiny = R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
  "model": {"preset": "gpt2-tiny"}, "data": {"type": "synthetic", "seq_len": 16},
  "train": {"steps": 4, "eval_every": 0, "threads": 1}})";

cli::ReportOptions after_one_warmup_step() {
  cli::ReportOptions o;
  o.warmup = 1;
  return o;
}

Plan plan_on(DeviceKind device) {
  Config c = load_config_text(kTiny, "test.json");
  Topology t = test::thread_ranks(1, 0);
  t.device = device;
  if (device == DeviceKind::cuda) t.device_memory_bytes = 16.0 * (1 << 30);
  return compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), t);
}

// Four steps of made-up measurements; the first (the warm-up) holds the largest memory figures, which the report
// must leave out.
TrainResult measured(bool gpu) {
  TrainResult r;
  r.steps = 4;
  r.baseline_rss_bytes = 100e6;
  r.peak_rss_bytes = 300e6;
  for (int i = 0; i < 4; ++i) {
    r.step_seconds.push_back(1.0);
    r.step_start_s.push_back(i);
    StepPhases p;
    p.forward = 0.4, p.backward = 0.5, p.optimizer = 0.1;
    r.phases.push_back(p);
    r.comm_seconds.push_back(0);
    r.comm_bytes.push_back(0);
    r.offload_bytes.push_back(0);
    r.rss_bytes.push_back(300e6);
    std::array<double, 8> rss{}, device{};
    for (size_t k = 0; k < 8; ++k) {
      rss[k] = (i == 0 ? 290e6 : 200e6 + 1e6 * static_cast<double>(k * i));
      device[k] = (i == 0 ? 9e9 : 2e9 + 1e8 * static_cast<double>(k) + 1e7 * i);
    }
    r.phase_rss_bytes.push_back(rss);
    if (gpu) r.phase_device_bytes.push_back(device);
  }
  if (gpu) r.device_baseline_bytes = 0.5e9, r.device_peak_bytes = 3.25e9;
  return r;
}

}  // namespace

TEST(ProfileReport, OnAGpuTheDevicesMemoryIsSetBesideThePlansDeviceBytesAndTheResidentBesideItsHostPart) {
  const Plan plan = plan_on(DeviceKind::cuda);
  const json report = cli::build_profile_report(plan, {cli::profile_rank_part(plan, measured(true))}, after_one_warmup_step());
  const json& m = report["memory"];
  ASSERT_TRUE(m.contains("device")) << m.dump();
  const json& d = m["device"];
  EXPECT_EQ(d["peak_bytes"].get<double>(), 3.25e9);
  EXPECT_EQ(d["baseline_bytes"].get<double>(), 0.5e9);
  EXPECT_EQ(d["training_bytes"].get<double>(), 2.75e9);
  EXPECT_EQ(d["plan_bytes"].get<double>(), plan.memory.device.total());
  ASSERT_EQ(d["by_phase"].size(), 8u);
  for (size_t k = 0; k < 8; ++k)  // the most over steps 2-4: step 4's
    EXPECT_EQ(d["by_phase"][k]["in_use_bytes"].get<double>(), 2e9 + 1e8 * static_cast<double>(k) + 3e7) << k;
  EXPECT_EQ(m["plan"]["total"].get<double>(), plan.memory.host.total());  // the process's memory is the host's part
  const std::string text = cli::render_profile_text(plan, report, false);
  const std::string ratio = format_fixed(2.75e9 / plan.memory.device.total(), 2) + "x";
  EXPECT_NE(text.find("GPU in use"), std::string::npos) << text;
  EXPECT_NE(text.find(format_bytes(2.75e9) + " for training, against the plan's " + format_bytes(plan.memory.device.total()) +
                      " on the device (" + ratio + ")"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("training (host)"), std::string::npos) << text;
  EXPECT_NE(text.find("GPU at each phase's end       data " + format_bytes(2.03e9) + ", forward " + format_bytes(2.13e9)), std::string::npos)
      << text;
}

TEST(ProfileReport, OnTheCpuTheResidentMemoryIsSetBesideThePlansWholeAndNoGpuIsNamed) {
  const Plan plan = plan_on(DeviceKind::cpu);
  const json report = cli::build_profile_report(plan, {cli::profile_rank_part(plan, measured(false))}, after_one_warmup_step());
  const json& m = report["memory"];
  EXPECT_FALSE(m.contains("device"));
  const MemoryCategories held = plan.memory.held();
  EXPECT_EQ(m["plan"]["total"].get<double>(), held.total());
  const std::string text = cli::render_profile_text(plan, report, false);
  EXPECT_EQ(text.find("GPU"), std::string::npos) << text;
}

// On a GPU the kernels each step ran (as CUPTI would hand them over, made up here): the report lists a measured
// step's mean per kernel, the longest first, its share of the mean step (1 s here), the first 20 by name and the
// rest summed; the warm-up step's kernels (a much longer one among them) are left out. Recomputed here.
TEST(ProfileReport, OnAGpuTheKernelsAreAMeasuredStepsMeanTheLongestFirst) {
  const Plan plan = plan_on(DeviceKind::cuda);
  TrainResult r = measured(true);
  for (int i = 0; i < 4; ++i) {
    std::vector<KernelTime> step = {{"gemm", 48, 0.30 + 0.01 * i}, {"ds::kernels::cuda::cross_entropy_kernel<...>", 2, 0.05}};
    if (i == 0) step.push_back({"warmup_only", 1, 5.0});
    for (int k = 0; k < 25; ++k) step.push_back({"small_" + std::to_string(100 + k), 3, 1e-4 * (k + 1)});
    r.kernel_times.push_back(step);
    // and its copies: the step's figures read back once, the batch in twice (the warm-up step's weights in too)
    std::vector<KernelTime> copies = {{"device to host, pageable", 1, 2e-6, 48}, {"host to device, page-locked", 2, 1e-5, 2048.0 + 1024.0 * i}};
    if (i == 0) copies.push_back({"host to device, pageable", 1, 0.5, 1e9});
    r.copy_times.push_back(copies);
  }
  const json report = cli::build_profile_report(plan, {cli::profile_rank_part(plan, r)}, after_one_warmup_step());
  ASSERT_TRUE(report.contains("kernels")) << report.dump();
  // The copies: a measured step's mean by way, the longest first; the warm-up's left out.
  const json& copies = report["copies"];
  ASSERT_EQ(copies.size(), 2u) << copies.dump();
  EXPECT_EQ(copies[0]["name"], "host to device, page-locked");
  EXPECT_EQ(copies[0]["count_per_step"].get<double>(), 2);
  EXPECT_NEAR(copies[0]["bytes_per_step"].get<double>(), 2048 + 1024 * 2, 1e-9);  // steps 2-4: 3072, 4096, 5120
  EXPECT_EQ(copies[1]["name"], "device to host, pageable");
  EXPECT_EQ(copies[1]["count_per_step"].get<double>(), 1);
  EXPECT_EQ(copies[1]["bytes_per_step"].get<double>(), 48);
  const json& k = report["kernels"];
  EXPECT_EQ(k["distinct"].get<size_t>(), 27u) << "warmup_only ran in the warm-up alone";
  ASSERT_EQ(k["top"].size(), 20u);
  EXPECT_EQ(k["top"][0]["name"], "gemm");
  EXPECT_NEAR(k["top"][0]["seconds_per_step"].get<double>(), 0.32, 1e-12);  // steps 2-4: 0.31, 0.32, 0.33
  EXPECT_NEAR(k["top"][0]["share_of_step_time"].get<double>(), 0.32, 1e-12);
  EXPECT_EQ(k["top"][0]["launches_per_step"].get<double>(), 48);
  EXPECT_EQ(k["top"][1]["name"], "ds::kernels::cuda::cross_entropy_kernel<...>");
  EXPECT_EQ(k["top"][2]["name"], "small_124");  // the small ones, longest first
  EXPECT_EQ(k["top"][19]["name"], "small_107");
  // The seven shortest (small_100 .. small_106: 1e-4 .. 7e-4 s) summed.
  EXPECT_EQ(k["others"]["kernels"].get<size_t>(), 7u);
  EXPECT_NEAR(k["others"]["seconds_per_step"].get<double>(), 1e-4 * (1 + 2 + 3 + 4 + 5 + 6 + 7), 1e-12);
  EXPECT_NEAR(k["others"]["launches_per_step"].get<double>(), 21, 1e-12);
  double small = 0;
  for (int j = 1; j <= 25; ++j) small += 1e-4 * j;
  EXPECT_NEAR(k["busy_seconds_per_step"].get<double>(), 0.32 + 0.05 + small, 1e-12);
  EXPECT_NEAR(k["launches_per_step"].get<double>(), 48 + 2 + 25 * 3, 1e-12);
  const std::string text = cli::render_profile_text(plan, report, false);
  EXPECT_NE(text.find("GPU kernels per step"), std::string::npos) << text;
  EXPECT_NE(text.find("7 other kernels"), std::string::npos) << text;
  EXPECT_EQ(text.find("warmup_only"), std::string::npos) << text;
  const size_t copies_at = text.find("Copies between host and GPU per step");
  ASSERT_NE(copies_at, std::string::npos) << text;
  const std::string back = text.substr(copies_at, text.find('\n', text.find("device to host, pageable", copies_at)) - copies_at);
  EXPECT_NE(back.find("1.0x"), std::string::npos) << back;
  EXPECT_NE(back.find("48 B  device to host, pageable"), std::string::npos) << back;

  // Where the trace could not start, the report says why instead.
  TrainResult none = measured(true);
  none.kernels_not_listed = "CUPTI could not be loaded (tried libcupti.so.13)";
  const json without = cli::build_profile_report(plan, {cli::profile_rank_part(plan, none)}, after_one_warmup_step());
  EXPECT_EQ(without["kernels"]["not_listed"], none.kernels_not_listed);
  EXPECT_NE(cli::render_profile_text(plan, without, false).find("GPU kernels: not listed (CUPTI could not be loaded"), std::string::npos);
}
