// ds profile as a user runs it: the report's figures against the plan and an independent count, the
// phases against the step, the Chrome trace's structure, and nothing left behind.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <map>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "cli_helpers.hpp"

using namespace cli_test;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// Every span of a step lies inside it, and every span of a rank sits in that rank's process.
void expect_well_formed_trace(const json& trace, int ranks, int steps) {
  std::map<int, int> step_spans;
  std::map<std::pair<int, int>, std::pair<double, double>> step_window;  // (pid, step) -> [begin, end]
  for (const json& e : trace["traceEvents"]) {
    ASSERT_TRUE(e.contains("ph") && e.contains("pid") && e.contains("name")) << e.dump();
    const int pid = e["pid"].get<int>();
    EXPECT_TRUE(pid >= 0 && pid < ranks) << e.dump();
    if (e["ph"] == "M") continue;
    ASSERT_EQ(e["ph"], "X") << e.dump();  // complete events: no B without its E
    EXPECT_GE(e["dur"].get<double>(), 0) << e.dump();
    if (e["name"].get<std::string>().rfind("step ", 0) == 0) {
      ++step_spans[pid];
      step_window[{pid, std::stoi(e["name"].get<std::string>().substr(5))}] = {e["ts"].get<double>(),
                                                                                e["ts"].get<double>() + e["dur"].get<double>()};
    }
  }
  for (const json& e : trace["traceEvents"]) {
    if (e["ph"] != "X" || !e["args"].contains("step")) continue;
    const auto [begin, end] = step_window.at({e["pid"].get<int>(), e["args"]["step"].get<int>()});
    EXPECT_GE(e["ts"].get<double>(), begin - 1e-3) << e.dump();
    EXPECT_LE(e["ts"].get<double>() + e["dur"].get<double>(), end + 1e-3) << e.dump();  // phases fit in their step
  }
  EXPECT_EQ(static_cast<int>(step_spans.size()), ranks);
  for (const auto& [pid, n] : step_spans) EXPECT_EQ(n, steps) << "rank " << pid;
}

}  // namespace

TEST(CliProfile, OneRankReportsThePlansFlopsPhasesInsideTheStepAndLeavesNothing) {
  const std::string tmp = scratch_dir() + "/profile_tmp", trace = scratch_dir() + "/profile_trace.json";
  const std::string unused = scratch_dir() + "/profile_output_dir";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  Result r = ds("profile examples/quickstart.json --steps 3 --warmup 1 --json --module-depth 2 --trace " + trace +
                    " model.activation_checkpointing=true train.output_dir=" + unused,
                "TMPDIR=" + tmp);
  ASSERT_EQ(r.code, 0) << r.err;
  // Its progress is a profile's, not a training run's.
  EXPECT_TRUE(contains(r.err, "ds profile: ")) << r.err;
  EXPECT_FALSE(contains(r.err, "ds train:")) << r.err;
  const json report = json::parse(r.out);
  EXPECT_EQ(report["schema_version"], 1);
  EXPECT_EQ(report["measured_steps"], 3);
  // FLOPs: the module rows (each counted in tests/test_flops.cpp) add up to the plan's model FLOPs per
  // step; recomputation comes on top as executed FLOPs.
  Result p = ds("plan examples/quickstart.json --json model.activation_checkpointing=true");
  ASSERT_EQ(p.code, 0) << p.err;
  const json plan = json::parse(p.out);
  double model = 0, recompute = 0;
  for (const json& m : report["modules"])
    if (m["depth"] == 1) {
      model += m["forward_flops"].get<double>() + m["backward_flops"].get<double>();
      recompute += m["recompute_flops"].get<double>();
    }
  const double micro_batches = plan["batch"]["gradient_accumulation_steps"].get<double>();
  EXPECT_NEAR(model * micro_batches, plan["train_flops_per_step"].get<double>(), 1e-9 * model);
  EXPECT_NEAR(report["summary"]["model_flops_per_step"].get<double>(), plan["train_flops_per_step"].get<double>(), 1e-9 * model);
  EXPECT_GT(recompute, 0);
  EXPECT_NEAR(report["summary"]["executed_flops_per_step"].get<double>(), (model + recompute) * micro_batches, 1e-9 * model);
  // Phases are measured inside the step: none negative, together never more than the step.
  double phases = 0;
  for (const json& ph : report["phases"]) {
    EXPECT_GE(ph["seconds"].get<double>(), 0) << ph.dump();
    phases += ph["seconds"].get<double>();
  }
  const double step = report["summary"]["step_latency_s"].get<double>();
  EXPECT_GT(step, 0);
  EXPECT_LE(phases, step * (1 + 1e-9));
  // Every block is timed, inside the forward and backward phases that contain it.
  double blocks_forward = 0, blocks_backward = 0;
  int timed = 0;
  for (const json& m : report["modules"])
    if (m.contains("forward_s")) {
      ++timed;
      if (m["depth"] == 2) continue;  // halves of a block counted below
      EXPECT_GT(m["forward_s"].get<double>(), 0) << m.dump();
      EXPECT_GT(m["backward_s"].get<double>(), 0) << m.dump();
      blocks_forward += m["forward_s"].get<double>();
      blocks_backward += m["backward_s"].get<double>();
    }
  EXPECT_EQ(timed, 2 * 3);  // gpt2-tiny's two blocks, each with its attention and MLP
  // A block's two halves add up to the block, forward and backward (recomputation included).
  std::map<std::string, json> rows;
  for (const json& m : report["modules"]) rows[m["name"].get<std::string>()] = m;
  for (const char* block : {"transformer.h.0", "transformer.h.1"}) {
    const json &whole = rows.at(block), &attn = rows.at(std::string(block) + ".attn"), &mlp = rows.at(std::string(block) + ".mlp");
    for (const char* key : {"forward_s", "backward_s"}) {
      EXPECT_GT(attn[key].get<double>(), 0) << block << " " << key;
      EXPECT_GT(mlp[key].get<double>(), 0) << block << " " << key;
      EXPECT_NEAR(attn[key].get<double>() + mlp[key].get<double>(), whole[key].get<double>(), 1e-9) << block << " " << key;
    }
  }
  EXPECT_LE(blocks_forward, report["summary"]["fwd_latency_s"].get<double>() * (1 + 1e-9));
  EXPECT_LE(blocks_backward, report["summary"]["bwd_latency_s"].get<double>() * (1 + 1e-9));
  EXPECT_GE(report["outside_blocks"]["forward_s"].get<double>(), 0);
  EXPECT_GT(report["summary"]["gemm_peak_flops_per_s"].get<double>(), 0);
  // MFU: each measured step's model FLOPs over its time, against the matmul rate measured right after it; the
  // report's figure is the median of those.
  std::vector<double> mfus;
  const double flops_per_rank = report["summary"]["model_flops_per_step"].get<double>() / report["summary"]["world_size"].get<double>();
  ASSERT_EQ(report["steps"].size(), report["measured_steps"].get<size_t>());
  for (const json& st : report["steps"]) {
    ASSERT_GT(st["gemm_flops_per_s"].get<double>(), 0);
    mfus.push_back(flops_per_rank / st["step_s"].get<double>() / st["gemm_flops_per_s"].get<double>());
    EXPECT_NEAR(st["mfu"].get<double>(), mfus.back(), 1e-12 * mfus.back());
  }
  std::sort(mfus.begin(), mfus.end());
  const double median = mfus.size() % 2 ? mfus[mfus.size() / 2] : (mfus[mfus.size() / 2 - 1] + mfus[mfus.size() / 2]) / 2;
  EXPECT_NEAR(report["summary"]["mfu"].get<double>(), median, 1e-12 * median);
  EXPECT_DOUBLE_EQ(report["summary"]["mfu_range"][0].get<double>(), mfus.front());
  EXPECT_DOUBLE_EQ(report["summary"]["mfu_range"][1].get<double>(), mfus.back());
  EXPECT_NEAR(report["summary"]["tokens_per_s"].get<double>() * step, plan["tokens_per_step"].get<double>(), 1e-6 * step);
  // The largest modules by FLOPs: the blocks' MLPs first (8C^2 of 12C^2 per block, at T = 64 < 4C).
  EXPECT_EQ(report["top_modules"][0].get<std::string>().find(".mlp") != std::string::npos, true) << report["top_modules"].dump();
  // Memory at the end of every phase that ran, never above the reported peak.
  const json& memory = report["memory"];
  ASSERT_EQ(memory["by_phase"].size(), 8u);
  for (const json& ph : memory["by_phase"]) {
    if (ph["phase"] == "forward" || ph["phase"] == "backward") {
      EXPECT_GT(ph["resident_bytes"].get<double>(), 0) << ph.dump();
    }
    EXPECT_LE(ph["resident_bytes"].get<double>(), memory["peak_rss_bytes"].get<double>()) << ph.dump();
  }
  // The peak in three parts: code and libraries before training, file pages since (LibTorch's code first run
  // in step 1), and training's own, which holds at least the state the plan counts.
  EXPECT_GT(memory["paged_file_bytes"].get<double>(), 0);
  EXPECT_NEAR(memory["baseline_rss_bytes"].get<double>() + memory["paged_file_bytes"].get<double>() + memory["training_bytes"].get<double>(),
              memory["peak_rss_bytes"].get<double>(), 1.0);
  EXPECT_GE(memory["training_bytes"].get<double>(),
            memory["plan"]["params"].get<double>() + memory["plan"]["grads"].get<double>() + memory["plan"]["optimizer_states"].get<double>());
  const json parsed_trace = json::parse(slurp(trace));
  expect_well_formed_trace(parsed_trace, 1, 4);
  int block_spans = 0;  // each block's forward and backward in every step, on a track of their own
  for (const json& e : parsed_trace["traceEvents"])
    if (e["ph"] == "X" && e["name"].get<std::string>().rfind("block ", 0) == 0) ++block_spans;
  EXPECT_EQ(block_spans, 4 * 2 * 2);  // 4 steps x 2 blocks x (forward, backward)
  // Nothing written: no run directory where the config points, no scratch left in TMPDIR.
  EXPECT_FALSE(fs::exists(unused));
  EXPECT_TRUE(fs::is_empty(tmp)) << fs::directory_iterator(tmp)->path();
  // The text report names the same figures.
  r = ds("profile examples/quickstart.json --steps 2 --warmup 0");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* s : {"Summary", "fwd MACs per micro batch", "Phases of one optimizer step", "unaccounted", "lm_head", "MFU"})
    EXPECT_TRUE(contains(r.out, s)) << s << "\n" << r.out;
}

// Tensor 2 x data 2: a rank computes its share of the model's FLOPs (the step's sum over the ranks is the plan's),
// and the tensor group's all-reduces are a row of their own and spans of the trace, each the plan's.
TEST(CliProfile, ATensorParallelMeshCountsEachRanksShareOfTheFlopsAndItsGroupsCollectives) {
  const std::string trace = scratch_dir() + "/profile_tp.json";
  Result r = ds("profile examples/tensor-parallel.json --nproc-per-node 4 --steps 2 --warmup 1 --json --trace " + trace);
  ASSERT_EQ(r.code, 0) << r.err;
  const json report = json::parse(r.out);
  Result p = ds("plan examples/tensor-parallel.json --nproc-per-node 4 --json");
  ASSERT_EQ(p.code, 0) << p.err;
  const double planned = json::parse(p.out)["train_flops_per_step"].get<double>();
  EXPECT_NEAR(report["summary"]["model_flops_per_step"].get<double>(), planned, 1e-9 * planned);
  bool tensor_row = false;
  double plan_calls = 0;
  for (const json& c : report["communication"]) {
    ASSERT_TRUE(c.contains("bytes_per_step")) << c.dump();
    EXPECT_DOUBLE_EQ(c["bytes_per_step"].get<double>(), c["plan_bytes_per_step"].get<double>()) << c.dump();
    EXPECT_DOUBLE_EQ(c["calls_per_step"].get<double>(), c["plan_calls_per_step"].get<double>()) << c.dump();
    tensor_row |= c["collective"] == "tensor-parallel activations";
    plan_calls += c["plan_calls_per_step"].get<double>();
  }
  EXPECT_TRUE(tensor_row) << report["communication"].dump();
  std::map<int, double> calls;
  const json parsed = json::parse(slurp(trace));  // held: a range-for over a temporary's member reads freed memory
  for (const json& e : parsed["traceEvents"])
    if (e["ph"] == "X" && e.value("tid", 0) == 5) calls[e["pid"].get<int>()] += 1;
  for (int rank = 0; rank < 4; ++rank) EXPECT_DOUBLE_EQ(calls[rank], 3 * plan_calls) << "rank " << rank;
}

// Pipeline 2 x data 2 over four blocks: each block is timed on the stage that runs it, the collectives and memory of
// the stage the plan describes are measured on its first rank, and each stage's wait is set beside the bubble.
TEST(CliProfile, APipelineTimesEachBlockOnItsStageAndSetsEachStagesWaitBesideTheBubble) {
  const std::string trace = scratch_dir() + "/profile_pp.json";
  const std::string args = "examples/pipeline-parallel.json --nproc-per-node 4 model.num_layers=4 ";
  Result r = ds("profile " + args + "--steps 2 --warmup 1 --json --trace " + trace);
  ASSERT_EQ(r.code, 0) << r.err;
  const json report = json::parse(r.out);
  Result p = ds("plan " + args + "--json");
  ASSERT_EQ(p.code, 0) << p.err;
  const json plan = json::parse(p.out);
  const double planned = plan["train_flops_per_step"].get<double>();
  EXPECT_NEAR(report["summary"]["model_flops_per_step"].get<double>(), planned, 1e-9 * planned);  // the whole model's, every rank's
  int timed = 0;
  for (const json& m : report["modules"])
    if (m["depth"] == 1 && m["name"].get<std::string>().rfind("transformer.h.", 0) == 0) {
      EXPECT_GT(m.value("forward_s", 0.0), 0.0) << m.dump();
      EXPECT_GT(m.value("backward_s", 0.0), 0.0) << m.dump();
      ++timed;
    }
  EXPECT_EQ(timed, 4);
  // Ranks: tensor fastest, then data, then pipeline; the plan describes its heaviest stage, whose first rank is 2 x it.
  const int heaviest = plan["mesh"]["heaviest_stage"].get<int>();
  EXPECT_EQ(report["lead_rank"].get<int>(), 2 * heaviest);
  ASSERT_FALSE(report["communication"].empty());
  for (const json& c : report["communication"]) {
    ASSERT_TRUE(c.contains("bytes_per_step")) << c.dump();
    EXPECT_DOUBLE_EQ(c["bytes_per_step"].get<double>(), c["plan_bytes_per_step"].get<double>()) << c.dump();
    EXPECT_DOUBLE_EQ(c["calls_per_step"].get<double>(), c["plan_calls_per_step"].get<double>()) << c.dump();
  }
  const json& pipeline = report["pipeline"];
  EXPECT_DOUBLE_EQ(pipeline["bubble"].get<double>(), plan["mesh"]["bubble"].get<double>());
  ASSERT_EQ(pipeline["stages"].size(), 2u);
  for (size_t s = 0; s < 2; ++s) {
    const json& got = pipeline["stages"][s];
    const json& cut = plan["mesh"]["stages"][s];
    EXPECT_EQ(got["rank"].get<int>(), 2 * static_cast<int>(s));
    EXPECT_EQ(got["first_block"], cut["first_block"]);
    EXPECT_EQ(got["blocks"], cut["blocks"]);
    EXPECT_GE(got["waited_share"].get<double>(), 0.0);
    EXPECT_LT(got["waited_share"].get<double>(), 1.0);
    const json& memory = cut["memory_per_rank"];
    EXPECT_NEAR(got["plan_bytes"].get<double>(), memory["device"]["total"].get<double>() + memory["host"]["total"].get<double>(), 2.0);
  }
  // The trace: a process per rank, each stage's blocks under their own numbers (stage 1 runs blocks 2 and 3).
  const json parsed = json::parse(slurp(trace));
  expect_well_formed_trace(parsed, 4, 3);
  std::map<int, std::set<std::string>> blocks;
  for (const json& e : parsed["traceEvents"])
    if (e["ph"] == "X" && e.value("tid", 0) == 4) blocks[e["pid"].get<int>()].insert(e["name"].get<std::string>());
  const int first_of_last = plan["mesh"]["stages"][1]["first_block"].get<int>();
  EXPECT_TRUE(blocks[2].count("block " + std::to_string(first_of_last) + " backward")) << parsed.dump().substr(0, 300);
  EXPECT_FALSE(blocks[2].count("block 0 forward"));
  EXPECT_TRUE(blocks[0].count("block 0 forward"));
  // Every receive is a span of the receiving rank's: stage 1 takes each micro-batch's activations, stage 0 their
  // gradients (4 a step, 3 steps), and the time they wait is in each stage's wait for the others.
  std::map<std::pair<int, std::string>, std::pair<int, double>> received;  // (rank, what) -> (spans, seconds)
  for (const json& e : parsed["traceEvents"])
    if (e["ph"] == "X" && e.value("tid", 0) == 5 && contains(e["name"].get<std::string>(), "(received)")) {
      auto& [n, seconds] = received[{e["pid"].get<int>(), e["name"].get<std::string>()}];
      ++n;
      seconds += e["dur"].get<double>() * 1e-6;
    }
  const auto spans = [&](int rank, const std::string& what) { return received[{rank, what}].first; };
  EXPECT_EQ(spans(2, "pipeline activations (received)"), 12);
  EXPECT_EQ(spans(0, "pipeline activations' gradients (received)"), 12);
  EXPECT_EQ(spans(0, "pipeline activations (received)"), 0);
  for (int s : {0, 1}) {
    const json& stage = pipeline["stages"][static_cast<size_t>(s)];
    const double in_receives = received[{2 * s, s == 0 ? "pipeline activations' gradients (received)" : "pipeline activations (received)"}].second;
    // (the measured steps' mean wait holds their receives; the trace's sum is over all 3 steps, the warm-up's too)
    EXPECT_GT(stage["waited_s"].get<double>(), 0.0);
    EXPECT_GT(in_receives, 0.0);
  }
  // The text names the stages.
  r = ds("profile " + args + "--steps 1 --warmup 1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "Pipeline stages (each stage's first rank; waited: held up by the other stages, the median share of a step"))
      << r.out;
}

TEST(CliProfile, TwoRanksAtEveryStageSendThePlansBytesAndTraceOneProcessEach) {
  for (int stage : {1, 2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const std::string trace = scratch_dir() + "/profile_ranks_" + std::to_string(stage) + ".json";
    Result r = ds("profile examples/quickstart.json --nproc-per-node 2 --steps 2 --warmup 1 --json --intra-node-link 5GB/s --trace " + trace +
                  " train_micro_batch_size_per_gpu=8 zero_optimization.stage=" + std::to_string(stage) +
                  " zero_optimization.stage3_param_persistence_threshold=auto");
    ASSERT_EQ(r.code, 0) << r.err;
    const json report = json::parse(r.out);
    EXPECT_EQ(report["ranks"].size(), 2u);
    ASSERT_FALSE(report["communication"].empty());
    for (const json& c : report["communication"]) {
      ASSERT_TRUE(c.contains("bytes_per_step")) << c.dump();
      EXPECT_DOUBLE_EQ(c["bytes_per_step"].get<double>(), c["plan_bytes_per_step"].get<double>()) << c.dump();
      EXPECT_DOUBLE_EQ(c["calls_per_step"].get<double>(), c["plan_calls_per_step"].get<double>()) << c.dump();
      // Predicted from the link given: its bytes at 5 GB/s and 10 us a call (a rate within a node: NVLink's latency).
      ASSERT_TRUE(c.contains("predicted_seconds_per_step")) << c.dump();
      EXPECT_NEAR(c["predicted_seconds_per_step"].get<double>(),
                  c["plan_bytes_per_step"].get<double>() / 5e9 + c["plan_calls_per_step"].get<double>() * 10e-6, 1e-12) << c.dump();
    }
    EXPECT_FALSE(report["summary"].contains("predicted_step_latency_s"));  // the CPU's peak rate is not known to the plan
    const json parsed = json::parse(slurp(trace));
    expect_well_formed_trace(parsed, 2, 3);
    // Every collective of every step is a span on its rank's collectives track: the plan's calls and bytes.
    double plan_calls = 0, plan_bytes = 0;
    for (const json& c : report["communication"]) {
      plan_calls += c["plan_calls_per_step"].get<double>();
      plan_bytes += c["plan_bytes_per_step"].get<double>();
    }
    std::map<int, double> calls, bytes;
    for (const json& e : parsed["traceEvents"])
      if (e["ph"] == "X" && e.value("tid", 0) == 5) {
        calls[e["pid"].get<int>()] += 1;
        bytes[e["pid"].get<int>()] += e["args"]["bytes"].get<double>();
      }
    for (int rank : {0, 1}) {
      EXPECT_DOUBLE_EQ(calls[rank], 3 * plan_calls) << "rank " << rank;
      EXPECT_DOUBLE_EQ(bytes[rank], 3 * plan_bytes) << "rank " << rank;
    }
  }
  // The text report without the hardware flags: every collective measured, nothing predicted.
  const Result text = ds("profile examples/quickstart.json --nproc-per-node 2 --steps 2 --warmup 1 train_micro_batch_size_per_gpu=8 "
                         "zero_optimization.stage=2");
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_TRUE(contains(text.out, " waited ")) << text.out;
  EXPECT_FALSE(contains(text.out, "not measured")) << text.out;
  EXPECT_FALSE(contains(text.out, "(predicted")) << text.out;
}

TEST(CliProfile, BadArgumentsAreRefusedBeforeAnythingRuns) {
  Result r = ds("profile examples/quickstart.json --steps 0");
  EXPECT_EQ(r.code, 2) << r.err;
  r = ds("profile examples/quickstart.json --module-depth 3");
  EXPECT_EQ(r.code, 2) << r.err;
  r = ds("profile examples/missing.json");
  EXPECT_EQ(r.code, 2) << r.err;
}

TEST(CliProfile, TrainsFlopsProfilerBlockReportsTheStepItNamesWhereItSays) {
  const std::string dir = scratch_dir() + "/flops_profiler", file = scratch_dir() + "/flops_profile.txt";
  fs::remove_all(dir);
  fs::remove(file);
  Result r = ds("train examples/quickstart.json train.steps=4 train.eval_every=0 train.output_dir=" + dir +
                " flops_profiler.enabled=true flops_profiler.profile_step=2 flops_profiler.module_depth=1 flops_profiler.top_modules=3"
                " flops_profiler.output_file=" + file);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(contains(r.err, "flops_profiler.enabled: ignored")) << r.err;  // the key acts now
  EXPECT_TRUE(contains(r.err, "flops profile of step 2 in " + file)) << r.err;
  const std::string text = slurp(file);
  EXPECT_TRUE(contains(text, "flops_profiler: step 2\n")) << text;
  EXPECT_TRUE(contains(text, "1 step measured after 1 earlier")) << text;
  EXPECT_TRUE(contains(text, "transformer.h.1 ")) << text;          // depth 1: blocks
  EXPECT_FALSE(contains(text, "transformer.h.1.attn ")) << text;    // not their children
  const size_t top = text.find("top modules by FLOPs: ");
  ASSERT_NE(top, std::string::npos) << text;
  const std::string names = text.substr(top, text.find('\n', top) - top);
  EXPECT_EQ(std::count(names.begin(), names.end(), ','), 2) << names;  // top_modules=3
  // recompute_fwd_factor has no effect (ds counts recomputation exactly) and says so.
  r = ds("plan examples/quickstart.json flops_profiler.recompute_fwd_factor=1");
  EXPECT_TRUE(contains(r.err, "flops_profiler.recompute_fwd_factor: ignored")) << r.err;
}

TEST(CliProfile, OffloadBytesPerStepAreThePlansTransfers) {
  Result r = ds("profile examples/offload-cpu.json --steps 2 --warmup 1 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json f = json::parse(r.out)["offload"];
  double planned = 0;  // the plan's transfers, summed here from its own list
  for (const json& t : f["plan_transfers"]) planned += t["bytes_per_step"].get<double>();
  EXPECT_GT(planned, 0);
  EXPECT_DOUBLE_EQ(f["bytes_per_step"].get<double>(), planned);
  Result p = ds("plan examples/offload-cpu.json --json");
  ASSERT_EQ(p.code, 0) << p.err;
  // The plan's parameter count fixes the transfers: fp32 gradients in, bf16 weights out, this rank's share.
  const json plan = json::parse(p.out);
  const double local = plan["layout"]["padded_numel"].get<double>();
  EXPECT_DOUBLE_EQ(planned, local * (4 + 2)) << plan["layout"].dump();
}

// The host's offload work, span by span: each row of the report is its spans of that row summed over the measured
// steps (each step's spans are in the report too), split by where they ran, beside the plan's row where the plan
// predicts it (here from the memory's rate given).
TEST(CliProfile, TheHostsOffloadWorkIsItsSpansSummedByThePlansRows) {
  Result r = ds("profile examples/offload-cpu.json --steps 3 --warmup 1 --json --host-memory-bw 20GB/s");
  ASSERT_EQ(r.code, 0) << r.err;
  const json report = json::parse(r.out);
  const json& steps = report["steps"];
  ASSERT_EQ(steps.size(), 3u);
  std::map<std::string, std::array<double, 3>> summed;  // per row: during the forward, the backward, after
  for (const json& s : steps)
    for (const json& h : s.at("host_work_spans")) {
      const std::string during = h["during"].get<std::string>();
      ASSERT_TRUE(during == "forward" || during == "backward" || during == "after") << during;
      EXPECT_GE(h["seconds"].get<double>(), 0);
      // (one CPU rank: its gradients are summed on the device, its states stepped whole, not in tiles, after the
      // micro steps: no block's hook runs any of it)
      EXPECT_EQ(h["hook"].get<int64_t>(), -1);
      EXPECT_EQ(h["index"].get<int64_t>(), -1);
      EXPECT_EQ(h["micro_step"].get<int64_t>(), -1);
      EXPECT_EQ(during, "after");
      summed[h["what"].get<std::string>()][during == "forward" ? 0 : during == "backward" ? 1 : 2] += h["seconds"].get<double>();
    }
  Result p = ds("plan examples/offload-cpu.json --json --host-memory-bw 20GB/s");
  ASSERT_EQ(p.code, 0) << p.err;
  std::map<std::string, json> planned;
  const json plan = json::parse(p.out);
  for (const json& x : plan["step_time"]["offload"]) planned[x["what"].get<std::string>()] = x;
  const json& rows = report["offload"]["host_work"];
  ASSERT_EQ(rows.size(), summed.size());
  bool stepped = false;
  for (const json& row : rows) {
    const std::string what = row["what"].get<std::string>();
    SCOPED_TRACE(what);
    ASSERT_TRUE(summed.count(what));
    const auto& s = summed[what];
    EXPECT_NEAR(row["during_forward_s"].get<double>(), s[0] / 3, 1e-12);
    EXPECT_NEAR(row["during_backward_s"].get<double>(), s[1] / 3, 1e-12);
    EXPECT_NEAR(row["after_s"].get<double>(), s[2] / 3, 1e-12);
    EXPECT_NEAR(row["seconds_per_step"].get<double>(), (s[0] + s[1] + s[2]) / 3, 1e-12);
    if (planned.count(what)) {
      EXPECT_DOUBLE_EQ(row.at("predicted_seconds_per_step").get<double>(), planned[what]["seconds"].get<double>());
      EXPECT_DOUBLE_EQ(row.at("predicted_hidden_s").get<double>(), planned[what]["hidden_s"].get<double>());
    } else {
      EXPECT_FALSE(row.contains("predicted_seconds_per_step"));
    }
    if (what == "optimizer step on the host") {
      // On the CPU the host steps its states once the backward has ended, all of them: after, and more than nothing.
      stepped = true;
      EXPECT_GT(s[2], 0);
      EXPECT_EQ(s[0] + s[1], 0);
      EXPECT_TRUE(planned.count(what));
    }
  }
  EXPECT_TRUE(stepped) << rows.dump();
  Result text = ds("profile examples/offload-cpu.json --steps 2 --warmup 1 --host-memory-bw 20GB/s");
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_TRUE(contains(text.out, "the host's work")) << text.out;
  EXPECT_TRUE(contains(text.out, "optimizer step on the host")) << text.out;
  EXPECT_TRUE(contains(text.out, " during the forward, ")) << text.out;
}
