// The ds binary as a user runs it: exit codes, which stream carries what, --json, colour rules; ds plan,
// estimate-memory, env and --version. `ds train`'s own are in test_cli_train.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
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

TEST(CliPlan, PredictsTheStepsTimeForTheGpusAndLinksItIsToldOf) {
  Result r = ds("plan examples/time-llama2-7b.json --gpu h100 --gpus 8");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* s : {"Time per optimizer step (predicted)", "0.45 x H100 SXM 80GB's 989.4 TFLOP/s", "nvlink4 (within a node)", "tokens/s over 8 ranks",
                        "a prediction from rates, not a measurement"})
    EXPECT_TRUE(contains(r.out, s)) << s << "\n" << r.out;
  // Four nodes: the data group crosses the network, which must be named.
  r = ds("plan examples/time-llama2-7b.json --gpu h100 --gpus 8 --nnodes 4");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "not predicted without the network between nodes (--inter-node-link")) << r.out;
  r = ds("plan examples/time-llama2-7b.json --gpu h100 --gpus 8 --nnodes 4 --inter-node-link ib-ndr --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json t = nlohmann::json::parse(r.out)["step_time"];
  EXPECT_EQ(t["collectives"][0]["link"], "ib-ndr (across nodes, 8 NICs a node)");  // one ring per NIC
  EXPECT_GT(t["step_s"].get<double>(), t["compute_s"].get<double>());
  // estimate-memory predicts each row's throughput too, and picks the fastest mesh that fits.
  r = ds("estimate-memory --model llama-3-70b --gpus 8 --nodes 4 --gpu h100 --inter-node-link ib-ndr --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json e = nlohmann::json::parse(r.out);
  EXPECT_EQ(e["mesh_recommended"]["chosen_as"], "fastest");
  EXPECT_GT(e["mesh_recommended"]["predicted_tokens_per_s"].get<double>(), 0);
  EXPECT_GT(e["rows"][0]["predicted_tokens_per_s"].get<double>(), 0);
  // A model or a link ds does not know is refused with the ones it does.
  r = ds("plan examples/time-llama2-7b.json --gpu h1000");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "h100, h200")) << r.err;
  r = ds("plan examples/time-llama2-7b.json --gpu h100 --inter-node-link fast");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "ib-ndr")) << r.err;
  // Offloaded: the transfers at the H100's PCIe, the host's step once its memory's rate is given; which bounds the step.
  r = ds("plan examples/time-llama2-7b.json --gpu h100 --gpus 1 zero_optimization.offload_optimizer.device=cpu");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* s : {"gradients to the host", "pcie5 (50.0 GB/s a direction)", "not predicted without the host's memory bandwidth (--host-memory-bw"})
    EXPECT_TRUE(contains(r.out, s)) << s << "\n" << r.out;
  r = ds("plan examples/time-llama2-7b.json --gpu h100 --gpus 1 zero_optimization.offload_optimizer.device=nvme "
         "zero_optimization.offload_optimizer.nvme_path=/tmp --host-memory-bw 200GB/s --nvme-bw 1GB/s");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* s : {"optimizer step on the host", "host memory (200.0 GB/s)", "nvme (1.0 GB/s)", "nvme-bound"})
    EXPECT_TRUE(contains(r.out, s)) << s << "\n" << r.out;
  r = ds("plan examples/time-llama2-7b.json --gpu h100 --host-memory-bw 200Gb/s");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "--host-memory-bw '200Gb/s' is not a rate in bytes a second")) << r.err;
}

TEST(CliPlan, SaysHowZeroUsesTheLibrarysCollectives) {
  // Gloo (CPU ranks): no reduce-scatter and no 16-bit sums, so ds sends each rank its elements and widens to fp32.
  Result r = ds("plan examples/quickstart.json --nproc-per-node 2 zero_optimization.stage=3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "over gloo: gradients reduce-scattered as point-to-point sends")) << r.out;
  EXPECT_TRUE(contains(r.out, "gathers land every rank's spans in place")) << r.out;
  r = ds("plan examples/quickstart.json --nproc-per-node 2 zero_optimization.stage=0");
  EXPECT_TRUE(contains(r.out, "over gloo: gradients all-reduced, 16-bit sums through an fp32 copy")) << r.out;
  // NCCL (GPUs): its own reduce-scatter and 16-bit sums, gathers in equal packed pieces.
  r = ds("plan examples/quickstart.json --gpu h100 --gpus 8 zero_optimization.stage=3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "over nccl: gradients reduce-scattered by the library, 16-bit sums by the library; gathers packed into equal pieces"))
      << r.out;
  EXPECT_TRUE(contains(r.out, "; a reduce-scatter of uneven spans (ZeRO's buckets and groups) runs as NCCL groups of reduces"))
      << r.out;
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

// fp16 plans on a GPU (its optimizer reads fp16 gradients), no longer warned as new there (its checks have run on
// one); the CPU's fp16 is not warned of either.
TEST(CliPlan, Fp16OnAGpuIsPlannedAndNotWarnedOf) {
  Result r = ds("plan examples/gpu-fp16.json --gpu h100");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(contains(r.err, "fp16.enabled")) << r.err;
  EXPECT_FALSE(contains(r.out, "fp16 on a GPU (")) << "no longer refused: " << r.out;
  r = ds("plan examples/gpu-fp16.json --device cpu");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(contains(r.err, "fp16 on a GPU")) << r.err;
}

// ZeRO-Offload from one GPU: ds plan says how many of the host's weight tiles wait for the next forward: all but
// those beginning in the embeddings (counted here from the layout and the tiles' size), with the states all on the
// host, or the first half of them (ratio 0.5, stage 3), the GPU stepping the rest at once.
TEST(CliPlan, OneGpusOffloadSaysHowManyTilesTheNextForwardSteps) {
  for (const std::string ratio : {"", " zero_optimization.stage=3 zero_optimization.offload_optimizer.ratio=0.5"}) {
    SCOPED_TRACE(ratio);
    const std::string cmd = "plan examples/gpu-offload.json --device cuda" + ratio;
    Result r = ds(cmd + " --json");
    ASSERT_EQ(r.code, 0) << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    ASSERT_TRUE(j["zero_execution"]["step_in_forward"].get<bool>());
    const double tiles = j["zero_execution"]["weight_tiles"]["tiles"].get<double>();
    const double largest = j["zero_execution"]["weight_tiles"]["largest"].get<double>();
    double first_block = j["layout"]["numel"].get<double>();
    for (const auto& p : j["layout"]["params"])
      if (p["name"].get<std::string>().find(".h.") != std::string::npos) first_block = std::min(first_block, p["offset"].get<double>());
    const double host = j["zero_execution"]["optimizer_state_spans"][0]["end"].get<double>();
    EXPECT_NEAR(tiles, std::ceil(host / largest), 1);  // (tiles of about the largest's size cover the host's span)
    const long at_once = static_cast<long>(std::ceil(first_block / largest));
    r = ds(cmd);
    ASSERT_EQ(r.code, 0) << r.err;
    const std::string line = "the host steps " + std::to_string(static_cast<long>(tiles) - at_once) + " of its " +
                             std::to_string(static_cast<long>(tiles)) + " weight tiles during the next forward";
    EXPECT_TRUE(contains(r.out, line)) << line << "\n" << r.out;
    EXPECT_EQ(contains(r.out, "the GPU steps its part of the states at once"), !ratio.empty()) << r.out;
  }
}

// The predicted step line names its bound and where the step's time goes: compute, the collectives' exposed part
// and each offload resource's exposed part, as shares of the step, computed here from plan.json's rows; on one GPU
// (no collectives) the bound is the largest of them (offload with the host's step left to the next forward,
// measured alone, from pageable memory, without overlap_comm, and stage 3 with the parameters on the host). The offload
// line says what compute hides: the blocks' gradients on their way to the host behind the backward with overlap_comm
// (else it says what would), stage 3's parameters crossing a block ahead.
TEST(CliPlan, TheStepLineSaysWhereTheStepsTimeGoes) {
  for (const std::string extra : {"", " flops_profiler.enabled=true", " zero_optimization.offload_optimizer.pin_memory=false",
                                  " zero_optimization.overlap_comm=false", " zero_optimization.stage=3 zero_optimization.offload_param.device=cpu"}) {
    SCOPED_TRACE(extra);
    const std::string cmd = "plan examples/gpu-offload.json --gpu h100 --host-memory-bw 200GB/s" + extra;
    Result r = ds(cmd + " --json");
    ASSERT_EQ(r.code, 0) << r.err;
    const nlohmann::json t = nlohmann::json::parse(r.out)["step_time"];
    const double step = t["step_s"].get<double>();
    std::vector<std::pair<std::string, double>> parts{{"compute", t["compute_s"].get<double>()},
                                                      {"communication", t["communication_s"].get<double>() - t["hidden_s"].get<double>()},
                                                      {"host link", 0}, {"host memory", 0}, {"nvme", 0}};
    for (const auto& row : t["offload"])
      for (auto& [name, seconds] : parts)
        if (name == row["resource"].get<std::string>()) seconds += row["seconds"].get<double>() - row["hidden_s"].get<double>();
    double sum = 0;
    std::string split, most;
    double most_s = -1;
    for (const auto& [name, seconds] : parts) {
      sum += seconds;
      if (seconds > most_s) most_s = seconds, most = name;
      const long percent = std::lround(100 * seconds / step);  // (whole percents, a part under 1% left out)
      if (percent >= 1) split += (split.empty() ? "" : ", ") + name + " " + std::to_string(percent) + "%";
    }
    EXPECT_NEAR(sum, step, 1e-9 * step);  // (the parts are the whole step)
    const std::string bound = most == "compute" ? "compute-bound" : most == "host memory" ? "host-memory-bound" : most == "host link" ? "host-link-bound" : most + "-bound";
    EXPECT_EQ(t["bound"].get<std::string>(), bound);
    r = ds(cmd);
    ASSERT_EQ(r.code, 0) << r.err;
    const std::string line = ": " + bound + " (" + split + " of it); ";
    EXPECT_TRUE(contains(r.out, line)) << line << "\n" << r.out;
    EXPECT_TRUE(contains(r.out, " added to the step (")) << r.out;
    // Measured alone, the plan says what that turned off (here the host's step during the next forward).
    EXPECT_EQ(contains(r.out, "each step's work is done within it"), extra == " flops_profiler.enabled=true") << r.out;
    const bool overlap = extra != " zero_optimization.overlap_comm=false";
    EXPECT_EQ(contains(r.out, "the backward hides the blocks' gradients on their way to the host and their sum there"), overlap) << r.out;
    EXPECT_EQ(contains(r.out, "zero_optimization.overlap_comm=true would hide the blocks' gradients on their way to the host behind the backward"), !overlap)
        << r.out;
    // Stage 3's parameters in host memory cross a block ahead.
    EXPECT_EQ(contains(r.out, "each block's parameters cross while the block before it runs"), contains(extra, "offload_param")) << r.out;
  }
  // Where the host's memory is slow beside the GPU it is busy longer than the parts add up to (its rows in full, each
  // copy's bytes read or written there): that is the step, and the line says so instead of a split.
  const std::string slow = "plan examples/gpu-offload-speculative.json --gpu h200 --host-memory-bw 40GB/s";
  Result r = ds(slow + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json t = nlohmann::json::parse(r.out)["step_time"];
  double rows_s = 0, copied = 0, parts = t["compute_s"].get<double>() + t["communication_s"].get<double>() - t["hidden_s"].get<double>();
  for (const auto& row : t["offload"]) {
    parts += row["seconds"].get<double>() - row["hidden_s"].get<double>();
    if (row["resource"] == "host memory") rows_s += row["seconds"].get<double>();
    else copied += row["bytes"].get<double>();
  }
  const double busy = rows_s + copied / 40e9;
  ASSERT_GT(busy, parts);
  EXPECT_NEAR(t["host_memory_busy_s"].get<double>(), busy, 1e-9 * busy);
  EXPECT_NEAR(t["host_memory_copied_bytes"].get<double>(), copied, 1e-9 * copied);
  EXPECT_NEAR(t["step_s"].get<double>(), busy, 1e-9 * busy);
  EXPECT_EQ(t["bound"], "host-memory-bound");
  r = ds(slow);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto ms = [](double s) {  // (as ds prints a time)
    std::ostringstream o;
    o.setf(std::ios::fixed);
    if (s >= 0.9995) o << std::setprecision(2) << s << " s";
    else o << std::setprecision(1) << s * 1e3 << " ms";
    return o.str();
  };
  for (const std::string& s : {"  host memory busy " + ms(busy) + " a step", "longer than the " + ms(parts) + " the parts add up to",
                               "  step " + ms(busy) + ": host-memory-bound; "})
    EXPECT_TRUE(contains(r.out, s)) << s << "\n" << r.out;
  // The offload's exposed part then adds to the parts, not to the step (which the host memory's busy time sets).
  EXPECT_TRUE(contains(r.out, " added to the parts (")) << r.out;
  EXPECT_FALSE(contains(r.out, " added to the step")) << r.out;
  // A run with nothing to leave to the next forward (one CPU rank) says nothing of it.
  const Result alone = ds("plan examples/quickstart.json flops_profiler.enabled=true");
  ASSERT_EQ(alone.code, 0) << alone.err;
  EXPECT_FALSE(contains(alone.out, "each step's work is done within it")) << alone.out;
}

// The speculative step's choice of tiles weighs the host's memory first, where it is known: each speculated tile's
// backup (12 bytes an element here, with clipping) takes host memory, so where all of them would not fit, fewer are
// speculated, the plan fits, and the step is no shorter than the unconstrained choice's. With room for all, the same
// choice as without a host size.
TEST(CliPlan, TheSpeculativeStepTakesNoMoreTilesThanTheHostsMemoryHolds) {
  const std::string cmd = "plan examples/gpu-offload-speculative.json --gpu h200 --host-memory-bw 300GB/s gradient_clipping=1.0 --json";
  const auto plan_with = [&](const std::string& host) {
    const Result r = ds(cmd + (host.empty() ? "" : " --host-memory " + host));
    EXPECT_EQ(r.code, 0) << r.err;
    return nlohmann::json::parse(r.out);
  };
  const auto gb = [](double bytes) {  // (a size ds reads, to the kilobyte)
    std::ostringstream o;
    o.setf(std::ios::fixed);
    o << std::setprecision(6) << bytes / 1e9 << "GB";
    return o.str();
  };
  const nlohmann::json free = plan_with("");
  const double need = free["memory"]["host_per_node"].get<double>(), all = free["zero_execution"]["speculated_numel"].get<double>();
  const double step = free["step_time"]["step_s"].get<double>();
  ASSERT_GT(all, 0);
  const double headroom = free["fit"]["headroom"].get<double>();
  // Room for all but 6 GB of the backup (half of it): fewer tiles, within the room.
  const double have = (need - 6e9) / (1 - headroom);
  const nlohmann::json tight = plan_with(gb(have));
  EXPECT_EQ(tight["fit"]["host"], "fits") << tight["fit"].dump();
  const double some = tight["zero_execution"]["speculated_numel"].get<double>();
  EXPECT_GT(some, 0);
  EXPECT_LT(some, all);
  EXPECT_LE(tight["memory"]["host_per_node"].get<double>(), (1 - headroom) * have);
  EXPECT_GE(tight["step_time"]["step_s"].get<double>(), step);
  // Room for all of it: the same choice.
  const nlohmann::json roomy = plan_with(gb(need / (1 - headroom) + 1e9));
  EXPECT_EQ(roomy["fit"]["host"], "fits");
  EXPECT_EQ(roomy["zero_execution"]["speculated_numel"].get<double>(), all);
  EXPECT_EQ(roomy["zero_execution"]["gradient_lag"], free["zero_execution"]["gradient_lag"]);
  EXPECT_DOUBLE_EQ(roomy["step_time"]["step_s"].get<double>(), step);
}

// A machine with four GPUs (a stand-in nvidia-smi lists them): with nothing saying how many ranks, ds plan plans
// one per GPU that CUDA_VISIBLE_DEVICES shows, as ds train would start them, and says so; one where several are
// refused (offload) or a flag says how many.
TEST(CliPlan, SeveralVisibleGpusArePlannedOneRankEach) {
  const std::string bin = scratch_dir() + "/four_gpus";
  std::filesystem::create_directories(bin);
  std::ofstream(bin + "/nvidia-smi") << "#!/bin/sh\nfor g in 0 1 2 3; do echo \"NVIDIA H100 80GB HBM3, 81559, GPU-$g$g$g$g-uuid\"; done\n";
  std::filesystem::permissions(bin + "/nvidia-smi", std::filesystem::perms::owner_all);
  const std::string path = "PATH=" + bin + ":" + std::getenv("PATH");
  const auto planned = [&](const std::string& args, const std::string& env, std::string* err = nullptr) -> nlohmann::json {
    const Result r = ds("plan " + args + " --json", env + " " + path);  // (env's -u before its assignments)
    EXPECT_EQ(r.code, 0) << args << " " << env << ": " << r.err;
    if (err) *err = r.err;
    return r.code == 0 ? nlohmann::json::parse(r.out)["topology"] : nlohmann::json();
  };
  std::string err;
  nlohmann::json t = planned("examples/quickstart.json", "-u CUDA_VISIBLE_DEVICES", &err);
  EXPECT_EQ(t["device"], "cuda");
  if (!contains(ds("--version").out, "NCCL: not built in")) {  // several GPU ranks run with this build
    EXPECT_EQ(t["world_size"], 4);
    EXPECT_EQ(t["world_size_source"], "one rank per visible GPU");
    // (the global batch grows with the ranks where the config sets micro batch and accumulation: said)
    EXPECT_TRUE(contains(err, "ds plan: 4 GPUs visible: 4 ranks, one on each (--nproc-per-node 1 for one); global batch 64 = "
                              "micro 16 x accumulation 1 x 4 ranks")) << err;
  } else {  // without NCCL, several GPU ranks are refused where one is not: one, saying why
    EXPECT_EQ(t["world_size"], 1);
    EXPECT_TRUE(contains(err, "ds plan: 4 GPUs visible: one rank, since ds cannot run this plan on 4: several GPU ranks with this "
                              "build: it has no NCCL communicator")) << err;
  }
  planned("examples/quickstart.json", "CUDA_VISIBLE_DEVICES=3,GPU-1111", &err);
  EXPECT_TRUE(contains(err, "ds plan: 2 GPUs visible: ")) << err;
  t = planned("examples/quickstart.json", "CUDA_VISIBLE_DEVICES=2,7,1", &err);  // 7 ends the list: one GPU
  EXPECT_EQ(t["world_size"], 1);
  EXPECT_EQ(t["device"], "cuda");
  EXPECT_FALSE(contains(err, "GPUs visible")) << err;
  t = planned("examples/quickstart.json", "CUDA_VISIBLE_DEVICES=", &err);
  EXPECT_EQ(t["device"], "cpu") << "no GPU visible";
  EXPECT_EQ(t["world_size"], 1);
  EXPECT_FALSE(contains(err, "GPUs visible")) << err;
  t = planned("examples/quickstart.json --nproc-per-node 1", "-u CUDA_VISIBLE_DEVICES", &err);
  EXPECT_EQ(t["world_size"], 1);
  EXPECT_FALSE(contains(err, "GPUs visible")) << "a flag says how many: " << err;
  EXPECT_EQ(planned("examples/quickstart.json --device cpu", "-u CUDA_VISIBLE_DEVICES")["world_size"], 1);
  // A launcher's process (its rank, world or local rank set) is one rank of a run already counted.
  for (const std::string launched : {"WORLD_SIZE=1", "LOCAL_RANK=0", "RANK=0 WORLD_SIZE=1"}) {
    t = planned("examples/quickstart.json", "-u CUDA_VISIBLE_DEVICES " + launched, &err);
    EXPECT_EQ(t["world_size"], 1) << launched;
    EXPECT_FALSE(contains(err, "GPUs visible")) << launched << ": " << err;
  }
  // A config one rank cannot run either: its own error, nothing said of the GPUs.
  const Result broken = ds("plan examples/quickstart.json train_batch_size=7", "-u CUDA_VISIBLE_DEVICES " + path);
  EXPECT_EQ(broken.code, 2) << broken.err;
  EXPECT_FALSE(contains(broken.err, "GPUs visible")) << broken.err;
  EXPECT_EQ(planned("examples/quickstart.json --world-size 2", "-u CUDA_VISIBLE_DEVICES")["world_size"], 2);
  // fp16 on several GPU ranks is not run yet; one GPU trains fp16: one rank, saying why.
  t = planned("examples/gpu-fp16.json", "-u CUDA_VISIBLE_DEVICES", &err);
  EXPECT_EQ(t["world_size"], 1);
  EXPECT_TRUE(contains(err, "4 GPUs visible: one rank, since ds cannot run this plan on 4: ")) << err;
  EXPECT_TRUE(contains(err, "fp16 on several GPU ranks")) << err;
  // ds train on this machine with a build that trains on the CPU only: one CPU process, no ranks started.
  if (contains(ds("--version").out, "(CPU); CUDA")) {
    const Result r = ds("train examples/quickstart.json train.steps=1 train.eval_every=0 train.output_dir=" + scratch_dir() +
                            "/four_gpus_run", "-u CUDA_VISIBLE_DEVICES " + path);
    EXPECT_EQ(r.code, 0) << r.err;
    EXPECT_FALSE(contains(r.err, "ranks on this machine")) << r.err;
    EXPECT_TRUE(contains(r.err, "the 4 GPUs nvidia-smi lists are not used")) << r.err;
  }
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
  // An override where the config file goes (a resume typed without its config): said so, not "cannot read".
  Result missing = ds("train --resume train.output_dir=runs/x");
  EXPECT_EQ(missing.code, 2);
  EXPECT_TRUE(contains(missing.err, "'train.output_dir=runs/x' is an override (key=value), but the first argument is the config file"))
      << missing.err;
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
  // Settings that act are in the plan: Adam without bias correction, fp16's floor under the loss scale.
  r = ds("plan examples/quickstart.json optimizer.params.bias_correction=false bf16.enabled=false fp16.enabled=true "
         "fp16.min_loss_scale=1000 fp16.hysteresis=3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "eps 1e-08, no bias correction")) << r.out;
  EXPECT_TRUE(contains(r.out, "hysteresis 3, at least 1000)")) << r.out;
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

TEST(CliEstimateMemory, AMeshIsPlannedWithTpAndPpAndTheSmallestThatFitsIsShownBesideTheRows) {
  Result r = ds("estimate-memory --model llama-3-70b --gpus 8 --nodes 4 --gpu-memory 80GiB --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  const nlohmann::json& mesh = j["mesh_recommended"];
  ASSERT_TRUE(mesh.is_object()) << r.out;
  EXPECT_EQ(mesh["tensor"].get<int>() * mesh["pipeline"].get<int>() * mesh["data"].get<int>(), 32);
  EXPECT_LE(mesh["per_gpu"].get<double>(), 0.9 * 80 * 1073741824.0);
  EXPECT_FALSE(mesh["runs_today"].get<bool>());
  // The mesh's own rows: the heaviest stage's GPU, a pipeline's stopping at stage 1, no DeepSpeed estimator.
  r = ds("estimate-memory --model llama-3-70b --gpus 8 --nodes 4 --tp 8 --pp 2 --gpu-memory 80GiB --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json rows = nlohmann::json::parse(r.out);
  EXPECT_EQ(rows["assumptions"]["pipeline_stages"], 2);
  EXPECT_EQ(rows["assumptions"]["micro_batches_per_step"], 2);
  ASSERT_GT(rows["rows"].size(), 0u);
  for (const auto& row : rows["rows"]) EXPECT_LE(row["zero_stage"].get<int>(), 1);
  EXPECT_TRUE(rows["deepspeed"].empty());
  EXPECT_TRUE(rows["mesh_recommended"].is_null());
  r = ds("estimate-memory --model llama-3-70b --gpus 8 --nodes 4 --tp 8 --pp 2 --gpu-memory 80GiB");
  EXPECT_TRUE(contains(r.out, "mesh: tensor 8 x pipeline 2 x data 2; each row is a GPU of the heaviest pipeline stage")) << r.out;
  r = ds("estimate-memory --model llama-3-70b --gpus 8 --nodes 4 --gpu-memory 80GiB");
  EXPECT_TRUE(contains(r.out, "Split the model: tensor ")) << r.out;
  // What a mesh needs: an architecture (an adapter splits with it).
  r = ds("estimate-memory --params 7e9 --largest-layer 1e8 --gpus 8 --tp 2");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "--tp and --pp split an architecture's blocks")) << r.err;
  r = ds("estimate-memory --model 7b --gpus 8 --lora-r 8 --pp 2");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "mesh: tensor 1 x pipeline 2 x data 4")) << r.out;
  EXPECT_TRUE(contains(r.out, "LoRA r 8 on")) << r.out;
  r = ds("estimate-memory --model llama-tiny --gpus 4 --tp 4");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "key/value heads do not split over 4 tensor ranks")) << r.err;
}

// ---- Trust: what a user relies on most (issue "Trust") ----

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
