// ds train on a CUDA GPU against the same run on the CPU: the plan, the data, the initial weights and the
// dropout masks are the same, so fp32 on the GPU must give the CPU's losses step by step (to 1e-4; the
// GPU's GEMMs and reductions add in another order), bf16 on the GPU must track fp32 (2%), ZeRO's stages at
// one rank must train what stage 0 trains, LoRA must train the same adapter, a checkpoint of a GPU run
// must resume on the CPU and the reverse (one format), offload from the GPU must train the CPU's offloaded
// run, fp16 must skip its overflows and track the CPU's fp16 run, and ZeRO, tensor and pipeline parallelism on thread
// ranks sharing the GPU (in NCCL's terms) must train the one-rank run.
// Without a GPU that LibTorch can use, every test skips and says why (label gpu; scripts/device-check.sh
// runs them on a GPU machine).
#include <gtest/gtest.h>

#include <c10/core/AutogradState.h>
#include <torch/cuda.h>
#include <torch/version.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "common/crash_trace.hpp"
#include "common/error.hpp"
#include "engine/runtime/comm/comm_local.hpp"
#include "engine/runtime/device/build_support.hpp"
#include "engine/runtime/run/trainer.hpp"
#include "schema/loader.hpp"
#include "test_helpers.hpp"

using namespace ds;
namespace fs = std::filesystem;

namespace {

const char* kBase = R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
  "gradient_clipping": 1.0,
  "model": {"preset": "gpt2-tiny"}, "data": {"type": "synthetic", "seq_len": 32},
  "train": {"steps": 12, "eval_every": 0, "threads": 2, "seed": 5}})";

class CudaTrain : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available())
      GTEST_SKIP() << "LibTorch sees no CUDA GPU (a CPU LibTorch, or no GPU): run scripts/device-check.sh on a GPU machine";
    print_stack_on_crash();  // a crash on the GPU machine says where in its log
    root_ = fs::temp_directory_path() / ("ds_cuda_train_" + std::to_string(::getpid()));
    fs::remove_all(root_);
  }
  void TearDown() override {
    if (!root_.empty()) fs::remove_all(root_);
  }

  // Rank `rank` of `world` thread ranks on `device`.
  static Topology topology(DeviceKind device, int world = 1, int rank = 0) {
    Topology t = test::thread_ranks(world, rank);
    t.device = device;
    if (device == DeviceKind::cuda) t.device_memory_bytes = 16.0 * (1 << 30);
    return t;
  }

  // The plan of kBase with `overrides` on `device`, writing its own directory under the scratch root.
  Plan plan_for(DeviceKind device, std::vector<std::string> overrides, const std::string& dir) const {
    overrides.push_back("train.output_dir=" + (root_ / dir).string());
    Config c = load_config_text(kBase, "test.json", overrides);
    return compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), topology(device));
  }

  // That plan trained (continued from `resume` when given).
  TrainResult run(DeviceKind device, std::vector<std::string> overrides, const std::string& dir, const std::string& resume = "") {
    TrainOptions opt;
    opt.print_every = 1000;
    opt.resume_from = resume;
    return train(plan_for(device, std::move(overrides), dir), opt, nullptr);
  }

  // `overrides` on `world` thread ranks sharing the GPU (NCCL refuses two ranks a GPU), their collectives and
  // messages LibTorch ops on its tensors in NCCL's terms (the library's own reduce-scatter, 16-bit sums in their
  // own dtype, gathers in equal pieces): each rank's plan and run, rank 0 first. A hang fails in 30 s, naming the
  // collective, well inside ctest's bound.
  std::vector<std::pair<Plan, TrainResult>> on_thread_ranks(int world, std::vector<std::string> overrides, const std::string& dir) const {
    overrides.push_back("train.output_dir=" + (root_ / dir).string());
    std::vector<std::pair<Plan, TrainResult>> runs(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) {
      Config c = load_config_text(kBase, "test.json", overrides);
      Topology t = topology(DeviceKind::cuda, world, r);
      t.communicator = CommBackend::nccl;
      t.build = build_support();
      if (t.build->nccl.empty()) t.build->nccl = "thread ranks";  // (the thread ranks' group stands in for NCCL's communicator)
      runs[static_cast<size_t>(r)].first = compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), t);
    }
    EXPECT_EQ(runs[0].first.execution.backend, CommBackend::nccl);
    LocalGroup group(world, std::chrono::seconds(30), CommBackend::nccl);
    test::on_ranks(world, [&](int r) {
#if TORCH_VERSION_MAJOR >= 2
      // LibTorch runs a GPU's backward on one worker thread shared by every thread that calls backward: rank 0's hooks
      // (ZeRO's reduces and gathers inside backward, a tensor group's all-reduce) would hold it waiting for rank 1,
      // whose backward queues behind it. Each rank's backward runs on its own thread instead.
      c10::AutogradState::get_tls_state().set_multithreading_enabled(false);
#endif
      TrainOptions opt;
      opt.print_every = 1000;
      auto comm = group.join(r);
      runs[static_cast<size_t>(r)].second = train(runs[static_cast<size_t>(r)].first, opt, comm.get());
    });
    return runs;
  }

  fs::path root_;
};

void expect_losses_near(const std::vector<double>& got, const std::vector<double>& want, double rel) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], rel * std::fabs(want[i])) << "step " << i + 1;
}

}  // namespace

TEST_F(CudaTrain, Fp32OnTheGpuGivesTheCpuRunsLossesStepByStep) {
  // llama-tiny: grouped kv heads, RoPE, SwiGLU. An odd vocabulary: the GPU's head splits its products at
  // the last aligned id (fused_head_loss), the CPU's does not.
  for (const std::string model : {"model.preset=gpt2-tiny", "model.preset=llama-tiny", "model.vocab_size=1001"}) {
    SCOPED_TRACE(model);
    const std::vector<std::string> o = {model, "bf16.enabled=false", "model.dropout=0.1"};
    const TrainResult cpu = run(DeviceKind::cpu, o, "cpu_" + model);
    const TrainResult gpu = run(DeviceKind::cuda, o, "gpu_" + model);
    expect_losses_near(gpu.losses, cpu.losses, 1e-4);
    EXPECT_LT(gpu.losses.back(), gpu.losses.front());
    EXPECT_GT(gpu.device_peak_bytes, gpu.device_baseline_bytes);  // the GPU held the run
  }
}

TEST_F(CudaTrain, Bf16OnTheGpuTracksFp32) {
  const TrainResult fp32 = run(DeviceKind::cuda, {"bf16.enabled=false"}, "fp32");
  const TrainResult bf16 = run(DeviceKind::cuda, {"bf16.enabled=true"}, "bf16");
  expect_losses_near(bf16.losses, fp32.losses, 0.02);
}

TEST_F(CudaTrain, ZeroStagesAtOneRankTrainWhatStageZeroTrains) {
  const TrainResult s0 = run(DeviceKind::cuda, {"bf16.enabled=false", "zero_optimization.stage=0"}, "s0");
  for (const char* stage : {"zero_optimization.stage=1", "zero_optimization.stage=2", "zero_optimization.stage=3"}) {
    SCOPED_TRACE(stage);
    const TrainResult s = run(DeviceKind::cuda, {"bf16.enabled=false", stage}, stage);
    expect_losses_near(s.losses, s0.losses, 1e-5);
  }
}

TEST_F(CudaTrain, ZeroOnThreadRanksOfOneGpuSpeakingNcclsTermsTrainsTheOneRankRun) {
  // Several ranks on one GPU (NCCL refuses two ranks a GPU): two thread ranks whose collectives are LibTorch ops on
  // the device's tensors, in NCCL's terms (the library's own reduce-scatter, 16-bit sums in their own dtype, gathers
  // in equal pieces), exercise ZeRO's device-side buffers, staging and ordering at every stage; the global batch is
  // the one-rank run's (micro 4 x accumulation 2 there, 4 x 1 on each rank here), so fp32 gives its losses to 1e-5.
  // communication_data_type bf16 at stage 2 casts each piece in flight on the device: bf16's rounding of the run
  // (2e-3), half the gradient bytes, the plan's bytes sent each step. Offload from the two ranks trains it too.
#if TORCH_VERSION_MAJOR < 2
  GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " runs every GPU backward on one thread, where the ranks' hooks would wait for each other";
#endif
  const int world = 2;
  const std::vector<std::string> fp32 = {"bf16.enabled=false"};
  const TrainResult one = run(DeviceKind::cuda, fp32, "one_rank");
  const auto on_two = [&](std::vector<std::string> o, const std::string& dir) {  // rank 0's plan and run
    o.insert(o.end(), {"bf16.enabled=false", "gradient_accumulation_steps=1"});
    return on_thread_ranks(world, o, dir)[0];
  };
  for (const char* stage : {"zero_optimization.stage=0", "zero_optimization.stage=1", "zero_optimization.stage=2", "zero_optimization.stage=3"}) {
    SCOPED_TRACE(stage);
    const auto [plan, ranks] = on_two({stage}, std::string("threads_") + stage);
    expect_losses_near(ranks.losses, one.losses, 1e-5);
  }
  // Offload from several ranks (the optimizer's states on the host, at stage 3 the parameters too): the one-rank run
  // within 1e-5 in fp32 (the host's AdamW kernel and the GPU's may round apart).
  const std::string opt = "zero_optimization.offload_optimizer.device=cpu", par = "zero_optimization.offload_param.device=cpu";
  for (const std::vector<std::string>& offload : {std::vector<std::string>{"zero_optimization.stage=2", opt},
                                                  std::vector<std::string>{"zero_optimization.stage=3", opt, par}}) {
    SCOPED_TRACE(offload.back());
    const auto [offload_plan, offloaded] = on_two(offload, "threads_offload_" + offload[0]);
    expect_losses_near(offloaded.losses, one.losses, 1e-5);
  }
  const auto [plain_plan, plain] = on_two({"zero_optimization.stage=2"}, "threads_plain");
  const auto [plan, cast] = on_two({"zero_optimization.stage=2", "communication_data_type=bf16"}, "threads_bf16_wire");
  expect_losses_near(cast.losses, plain.losses, 2e-3);
  ASSERT_EQ(plan.execution.wire_dtype, Dtype::bf16);
  double planned = 0, gradients = 0, plain_gradients = 0;
  for (const Collective& c : plan.execution.collectives) {
    planned += c.wire_bytes_per_rank_per_step;
    if (c.kind == CollectiveKind::gradients) gradients += c.wire_bytes_per_rank_per_step;
  }
  for (const Collective& c : plain_plan.execution.collectives)
    if (c.kind == CollectiveKind::gradients) plain_gradients += c.wire_bytes_per_rank_per_step;
  EXPECT_DOUBLE_EQ(2 * gradients, plain_gradients);
  std::ifstream metrics(cast.metrics_path);
  int steps = 0;
  for (std::string line; std::getline(metrics, line);) {
    const nlohmann::json m = nlohmann::json::parse(line);
    if (!m.contains("comm_bytes")) continue;
    ++steps;
    EXPECT_NEAR(m["comm_bytes"].get<double>(), planned, 1.0) << "step " << m["step"];
  }
  EXPECT_EQ(steps, static_cast<int>(cast.losses.size()));
}

TEST_F(CudaTrain, SplitModelsOnThreadRanksOfOneGpuTrainTheOneRankRunAndSendThePlansBytes) {
  // Tensor and pipeline parallelism's device side, which several GPUs run over NCCL: the tensor groups' all-reduces of
  // activations, a pipeline's activations and gradients received into the GPU's memory, the tied table's exchange
  // and the stages' losses read once their messages have settled, between thread ranks sharing the GPU. In fp32 the
  // one-rank GPU run's losses to 1e-4 (a split changes the GEMMs' shapes, and cuBLAS's order of adds with them; the
  // vocabulary-parallel loss takes LibTorch's ops) and the plan's bytes each step; in bf16 (activations crossing
  // stages in bf16) the one-rank bf16 run's within bf16's rounding.
#if TORCH_VERSION_MAJOR < 2
  GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " runs every GPU backward on one thread, where the ranks' hooks would wait for each other";
#endif
  const TrainResult one = run(DeviceKind::cuda, {"bf16.enabled=false"}, "one_rank");  // 4 x 2 micro-batches a step
  struct Mesh {
    std::string name;
    int world;
    std::vector<std::string> shape;
  };
  const std::vector<Mesh> meshes = {
      {"t2", 2, {"tensor_parallel.autotp_size=2"}},
      {"p2", 2, {"pipeline.stages=2"}},
      {"t2p2", 4, {"tensor_parallel.autotp_size=2", "pipeline.stages=2"}},
      {"t2d2z2", 4, {"tensor_parallel.autotp_size=2", "zero_optimization.stage=2", "train_micro_batch_size_per_gpu=2"}},
  };
  for (const Mesh& m : meshes) {
    SCOPED_TRACE(m.name);
    std::vector<std::string> o = m.shape;
    o.push_back("bf16.enabled=false");
    const auto runs = on_thread_ranks(m.world, o, "mesh_" + m.name);
    for (int r = 0; r < m.world; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      const auto& [plan, result] = runs[static_cast<size_t>(r)];
      ASSERT_TRUE(plan.mesh.shape.splits_the_model());
      expect_losses_near(result.losses, one.losses, 1e-4);
      const double planned = test::mesh_bytes_per_step(plan, r);
      ASSERT_EQ(result.comm_bytes.size(), one.losses.size());
      for (size_t i = 0; i < result.comm_bytes.size(); ++i) EXPECT_NEAR(result.comm_bytes[i], planned, 1.0) << "step " << i + 1;
    }
  }
  const TrainResult one_bf16 = run(DeviceKind::cuda, {"bf16.enabled=true"}, "one_rank_bf16");
  const auto bf16 = on_thread_ranks(4, {"tensor_parallel.autotp_size=2", "pipeline.stages=2", "bf16.enabled=true"}, "mesh_bf16");
  expect_losses_near(bf16[0].second.losses, one_bf16.losses, 1e-2);
}

TEST_F(CudaTrain, LoraOnTheGpuTrainsTheCpusAdapter) {
  const std::vector<std::string> o = {"model.preset=llama-tiny", "bf16.enabled=false",
                                      R"(model.lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]})"};
  const TrainResult cpu = run(DeviceKind::cpu, o, "lora_cpu");
  const TrainResult gpu = run(DeviceKind::cuda, o, "lora_gpu");
  expect_losses_near(gpu.losses, cpu.losses, 1e-4);
  EXPECT_LT(gpu.losses.back(), gpu.losses.front());
}

TEST_F(CudaTrain, OffloadFromTheGpuTrainsTheCpusOffloadedRunAndMovesThePlansBytes) {
  // ZeRO-Offload and -Infinity from one GPU: the optimizer's states (all, or a ratio's part) on the host or on
  // NVMe, and at stage 3 the parameters on the host. Each gives the CPU's offloaded run's losses step by step
  // (fp32 to 1e-4; bf16, whose weights cross through the staging buffers tile by tile, to 2%) and the GPU's run
  // without offload's (fp32 to 1e-5: the host's AdamW kernel and the GPU's may round apart); each step moves the
  // bytes the plan's transfers say.
  const std::string opt = "zero_optimization.offload_optimizer.", par = "zero_optimization.offload_param.";
  const std::string nvme = (root_ / "nvme").string();
  fs::create_directories(nvme);
  struct Case {
    std::vector<std::string> overrides;  // the stage first, the dtype second
    double rel;
  };
  const std::vector<Case> cases{
      {{"zero_optimization.stage=2", "bf16.enabled=false", opt + "device=cpu"}, 1e-5},
      {{"zero_optimization.stage=3", "bf16.enabled=false", opt + "device=cpu", opt + "ratio=0.5"}, 1e-5},
      {{"zero_optimization.stage=3", "bf16.enabled=false", opt + "device=cpu", par + "device=cpu"}, 1e-5},
      {{"zero_optimization.stage=1", "bf16.enabled=false", opt + "device=nvme", opt + "nvme_path=" + nvme, "zero_optimization.sub_group_size=20000"}, 1e-5},
      // bf16 staged: in tiles of an in-memory span, and through NVMe's sub-groups with the gradients left on the host
      {{"zero_optimization.stage=2", "bf16.enabled=true", opt + "device=cpu", "zero_optimization.sub_group_size=20000"}, 0.02},
      {{"zero_optimization.stage=3", "bf16.enabled=true", opt + "device=nvme", opt + "nvme_path=" + nvme, "zero_optimization.sub_group_size=20000"}, 0.02},
  };
  std::map<std::string, std::vector<double>> kept;  // the GPU's run without offload, by stage and dtype
  for (size_t k = 0; k < cases.size(); ++k) {
    const std::vector<std::string>& o = cases[k].overrides;
    std::string what;
    for (size_t i = 2; i < o.size(); ++i) what += o[i] + " ";
    SCOPED_TRACE(o[0] + " " + o[1] + " " + what);
    const TrainResult cpu = run(DeviceKind::cpu, o, "offload_cpu_" + std::to_string(k));
    const TrainResult gpu = run(DeviceKind::cuda, o, "offload_gpu_" + std::to_string(k));
    expect_losses_near(gpu.losses, cpu.losses, cases[k].rel == 1e-5 ? 1e-4 : cases[k].rel);
    EXPECT_LT(gpu.losses.back(), gpu.losses.front());
    const std::string key = o[0] + " " + o[1];
    if (!kept.count(key)) kept[key] = run(DeviceKind::cuda, {o[0], o[1]}, "kept_gpu_" + std::to_string(k)).losses;
    expect_losses_near(gpu.losses, kept[key], cases[k].rel);
    const Plan plan = plan_for(DeviceKind::cuda, o, "offload_plan_" + std::to_string(k));
    if (o[1] == "bf16.enabled=true") {
      EXPECT_EQ(plan.execution.state_spans.front().weights, WeightsBack::staged);
    }
    double planned = 0;
    for (const Transfer& t : plan.execution.transfers) planned += t.bytes_per_step;
    std::ifstream metrics(gpu.metrics_path);
    int steps = 0;
    for (std::string line; std::getline(metrics, line);) {
      const nlohmann::json m = nlohmann::json::parse(line);
      if (!m.contains("offload_bytes") || m["skipped"].get<bool>()) continue;
      ++steps;
      EXPECT_DOUBLE_EQ(m["offload_bytes"].get<double>(), planned) << "step " << m["step"];
    }
    EXPECT_EQ(steps, static_cast<int>(gpu.losses.size()));
  }
}

TEST_F(CudaTrain, AGpuCheckpointResumesOnTheCpuAsTheRunWouldHaveGoneOn) {
  const std::vector<std::string> o = {"bf16.enabled=false", "train.save_every=6"};
  const TrainResult straight = run(DeviceKind::cuda, o, "straight");
  const TrainResult first = run(DeviceKind::cuda, {"bf16.enabled=false", "train.steps=6"}, "first");
  const TrainResult rest = run(DeviceKind::cpu, o, "rest", first.last_checkpoint);
  ASSERT_EQ(rest.first_step, 6);
  expect_losses_near(rest.losses, std::vector<double>(straight.losses.begin() + 6, straight.losses.end()), 1e-4);
  // And back: the CPU's checkpoint continues on the GPU.
  const TrainResult cpu_first = run(DeviceKind::cpu, {"bf16.enabled=false", "train.steps=6"}, "cpu_first");
  const TrainResult gpu_rest = run(DeviceKind::cuda, o, "gpu_rest", cpu_first.last_checkpoint);
  expect_losses_near(gpu_rest.losses, std::vector<double>(straight.losses.begin() + 6, straight.losses.end()), 1e-4);
}

// fp16 on the GPU computes in fp16 (the CPU in an fp32 copy), so the two runs meet where they start: the first
// step's loss (the same weights and dropout masks, to fp16's rounding of the activations), overflow skips while
// the loss scale comes down from 2^20 (the CPU skips 3 steps here; the GPU's backward may also overflow in an
// activation's gradient or in its fp16 sum of two micro-batches: a few more), then a loss that falls to near the
// CPU's. GPT-2 (tied head, dropout drawn on the GPU for fp16) and Llama (RoPE, SwiGLU, grouped kv heads).
TEST_F(CudaTrain, Fp16OnTheGpuSkipsItsOverflowsAndTrainsAsTheCpusFp16Run) {
  for (const std::string model : {"model.preset=gpt2-tiny", "model.preset=llama-tiny"}) {
    SCOPED_TRACE(model);
    const std::vector<std::string> o = {model, "model.dropout=0.1", "bf16.enabled=false",
                                        R"(fp16={"enabled": true, "initial_scale_power": 20})", "train.steps=16"};
    const TrainResult cpu = run(DeviceKind::cpu, o, "fp16_cpu_" + model);
    const TrainResult gpu = run(DeviceKind::cuda, o, "fp16_gpu_" + model);
    ASSERT_EQ(gpu.losses.size(), cpu.losses.size());
    EXPECT_NEAR(gpu.losses.front(), cpu.losses.front(), 0.01 * cpu.losses.front());
    EXPECT_GE(cpu.skipped_steps, 1);
    EXPECT_GE(gpu.skipped_steps, 1) << "a loss scale of 2^20 overflowed no fp16 gradient";
    EXPECT_LE(gpu.skipped_steps, cpu.skipped_steps + 3);
    EXPECT_LT(gpu.losses.back(), gpu.losses.front());
    EXPECT_NEAR(gpu.losses.back(), cpu.losses.back(), 0.08 * cpu.losses.back());
  }
  // ZeRO's stages on one GPU: the same fp16 step; and ZeRO-Offload, whose gradients leave the GPU in fp16 block by
  // block for the host's fp16 kernels (stage 2) or widened to fp32 (stage 1), the fp16 weights copied back from the
  // host's master. The host's and the GPU's optimizer kernels may round apart in the last bit.
  const std::vector<std::string> o = {"bf16.enabled=false", R"(fp16={"enabled": true, "initial_scale_power": 20})", "train.steps=16"};
  const TrainResult s0 = run(DeviceKind::cuda, o, "fp16_s0");
  for (const std::vector<std::string>& extra : std::vector<std::vector<std::string>>{
           {"zero_optimization.stage=1"}, {"zero_optimization.stage=2"}, {"zero_optimization.stage=3"},
           {"zero_optimization.stage=1", "zero_optimization.offload_optimizer.device=cpu"},
           {"zero_optimization.stage=2", "zero_optimization.offload_optimizer.device=cpu"}}) {
    std::vector<std::string> staged = o;
    staged.insert(staged.end(), extra.begin(), extra.end());
    const std::string name = extra.size() == 1 ? extra[0] : extra[0] + "_offload";
    SCOPED_TRACE(name);
    const TrainResult z = run(DeviceKind::cuda, staged, "fp16_" + name);
    EXPECT_EQ(z.skipped_steps, s0.skipped_steps);
    expect_losses_near(z.losses, s0.losses, 1e-3);
  }
}

TEST_F(CudaTrain, AProfileOnTheGpuTimesItsStepWithCudaEvents) {
  // The phases and the blocks are timed on the GPU's clock (events on the compute stream, read once the step
  // ran): they lie within the step's wall time, which the host takes after waiting for the GPU.
  const Plan plan = plan_for(DeviceKind::cuda, {"train.steps=4", "bf16.enabled=true", "flops_profiler.enabled=true"}, "profile");
  TrainOptions opt;
  opt.print_every = 1000;
  opt.profile = true;
  const TrainResult r = train(plan, opt, nullptr);
  ASSERT_EQ(r.phases.size(), 4u);
  ASSERT_EQ(r.block_forward_s.size(), 4u);
  EXPECT_GT(r.gemm_peak_flops, 0);
  for (size_t i = 1; i < r.phases.size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    const StepPhases& p = r.phases[i];
    const double sum = p.data + p.forward + p.backward + p.reduce + p.norm + p.offload + p.optimizer + p.gather;
    EXPECT_GT(p.forward, 0);
    EXPECT_GT(p.backward, 0);
    EXPECT_GT(p.optimizer, 0);
    EXPECT_LE(sum, r.step_seconds[i] * 1.001 + 1e-5);
    double blocks = 0;
    for (size_t b = 0; b < r.block_forward_s[i].size(); ++b) {
      EXPECT_GT(r.block_forward_s[i][b], 0) << "block " << b;
      EXPECT_GT(r.block_backward_s[i][b], 0) << "block " << b;
      EXPECT_LE(r.attention_forward_s[i][b], r.block_forward_s[i][b]) << "block " << b;
      blocks += r.block_forward_s[i][b];
    }
    EXPECT_LE(blocks, p.forward * 1.001 + 1e-5);  // the blocks run within the forward phase
    ASSERT_EQ(r.phase_device_bytes.size(), 4u);
    EXPECT_GT(r.phase_device_bytes[i][1], r.device_baseline_bytes);  // the GPU's memory at forward's end
  }
  // The kernels each step ran (CUPTI): ds's own among them (the head's cross-entropy, the norms), each listed once
  // by its short name, their time within the step's (one stream: they do not overlap), the matmul rate's GEMMs
  // measured between the steps not counted (the step's GEMMs are far fewer than the rate's rounds launch).
  ASSERT_TRUE(r.kernels_not_listed.empty()) << r.kernels_not_listed;
  ASSERT_EQ(r.kernel_times.size(), 4u);
  for (size_t i = 1; i < r.kernel_times.size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    double busy = 0;
    std::set<std::string> names;
    for (const KernelTime& k : r.kernel_times[i]) {
      busy += k.seconds;
      EXPECT_TRUE(names.insert(k.name).second) << k.name << " listed twice";
      EXPECT_EQ(k.name.find('('), std::string::npos) << k.name;
    }
    EXPECT_GT(busy, 0);
    EXPECT_LE(busy, r.step_seconds[i] * 1.001);
    EXPECT_TRUE(names.count("ds::kernels::cuda::cross_entropy_kernel<...>")) << "ds's cross-entropy is not among the step's kernels";
    EXPECT_TRUE(names.count("ds::kernels::cuda::forward_kernel<...>")) << "ds's norm is not among the step's kernels";
  }
  // The copies each step made (CUPTI): the host waits for the GPU once a step, to read the step's figures at its end
  // (the loss, the norm, the skip: 48 bytes); nothing else comes back to the host.
  ASSERT_EQ(r.copy_times.size(), 4u);
  for (size_t i = 1; i < r.copy_times.size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    double to_host = 0, bytes = 0;
    std::string seen;
    for (const KernelTime& c : r.copy_times[i]) {
      seen += c.name + " x" + std::to_string(c.launches) + " (" + std::to_string(c.bytes) + " B); ";
      if (c.name.rfind("device to host", 0) == 0) to_host += c.launches, bytes += c.bytes;
    }
    EXPECT_EQ(to_host, 1) << seen;
    EXPECT_EQ(bytes, 48) << seen;
  }
}
