#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "engine/plan/plan.hpp"
#include "engine/plan/plan_record.hpp"
#include "engine/plan/fit.hpp"
#include "engine/plan/runnable.hpp"
#include "test_helpers.hpp"

using namespace ds;
using namespace ds::test;
namespace fs = std::filesystem;

namespace {

Topology topo(int world, double device_memory = 0) {
  Topology t;
  t.world_size = world;
  t.ranks_per_node = world;
  t.num_nodes = 1;
  t.cores_per_node = 8;
  t.host_memory_bytes = 256.0 * (1 << 30);
  t.world_size_source = "--world-size";
  if (device_memory > 0) {
    t.device = DeviceKind::cuda;
    t.device_memory_bytes = device_memory;
  }
  return t;
}

Plan plan_of(const std::string& text, int world, const std::vector<std::string>& overrides = {}, double device_memory = 0) {
  Config c = load_config_text(text, "test.json", overrides);
  return compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), topo(world, device_memory));
}

const char* kGpt2 = R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "bf16": {"enabled": true},
                        "model": {"preset": "gpt2"}, "data": {"seq_len": 256}})";

std::vector<ResolvedValue>::const_iterator find_resolved(const Plan& p, const std::string& path) {
  return std::find_if(p.resolved.begin(), p.resolved.end(), [&](const ResolvedValue& r) { return r.path == path; });
}

double bytes_of_role(const Plan& p, BufferRole role) {
  const ZeroBuffer* b = p.execution.find(role);
  return b ? b->bytes() : 0.0;
}

}  // namespace

TEST(PlanCompiler, MemoryCategoriesSumToTheTotals) {
  for (int stage : {0, 1, 2, 3}) {
    Plan p = plan_of(kGpt2, 4, {"zero_optimization.stage=" + std::to_string(stage)});
    const auto& d = p.memory.device;
    EXPECT_DOUBLE_EQ(d.total(), d.params + d.grads + d.optimizer_states + d.activations + d.buffers);
    EXPECT_DOUBLE_EQ(p.device_bytes_per_rank(), d.total());
    EXPECT_DOUBLE_EQ(p.host_bytes_per_node(), (d.total() + p.memory.host.total()) * 4);  // a CPU run: device is host
  }
}

// On a GPU the plan counts what LibTorch's fused attention keeps (MemoryModel.LibTorchsFusedAttention...): TinyLlama's
// shape, every block: k and v at 32 heads instead of 4.
TEST(PlanCompiler, AGpuPlanCountsWhatItsAttentionKeeps) {
  const char* cfg = R"({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true}, "model": {"preset": "tinyllama-1.1b"},
                        "data": {"seq_len": 256}})";
  const Plan cpu = plan_of(cfg, 1), gpu = plan_of(cfg, 1, {}, 80.0 * (1 << 30));
  const double tokens = 2 * 256, blocks = 22, NH = 32, NKV = 4, D = 64, b = 2;
  EXPECT_DOUBLE_EQ(gpu.memory.device.activations - cpu.memory.device.activations,
                   tokens * blocks * 2 * (NH - NKV) * D * b);
  // Checkpointed, only the block recomputed at a time keeps them.
  const Plan cpu_ckpt = plan_of(cfg, 1, {"model.activation_checkpointing=true"}),
             gpu_ckpt = plan_of(cfg, 1, {"model.activation_checkpointing=true"}, 80.0 * (1 << 30));
  EXPECT_DOUBLE_EQ(gpu_ckpt.memory.device.activations - cpu_ckpt.memory.device.activations, tokens * 2 * (NH - NKV) * D * b);
}

TEST(PlanCompiler, ModelStatesFollowTheZeroPaperFormulas) {
  // Mixed precision with Adam: 2 bytes params + 2 grads + 12 optimizer (fp32 master + two moments).
  // Stage 1: 2P + 2P + 12P/N; stage 2: 2P + (2 + 12)P/N; stage 3: (2 + 2 + 12)P/N (plus the small
  // persistent parameters kept whole, set to none here).
  const int N = 4;
  for (int stage : {1, 2, 3}) {
    Plan p = plan_of(kGpt2, N, {"zero_optimization.stage=" + std::to_string(stage),
                                "zero_optimization.stage3_param_persistence_threshold=0"});
    const double S = static_cast<double>(p.layout.shard_numel), P = static_cast<double>(p.layout.numel);
    const auto& d = p.memory.device;
    EXPECT_DOUBLE_EQ(d.optimizer_states, 12 * S) << stage;
    EXPECT_DOUBLE_EQ(d.grads, stage >= 2 ? 2 * S : 2 * P) << stage;
    EXPECT_DOUBLE_EQ(d.params, stage == 3 ? 2 * S : 2 * P) << stage;
    EXPECT_NEAR(S, P / N, N) << stage;  // padding only
  }
}

TEST(PlanCompiler, Stage3At4RanksHoldsAtMost30PercentOfStage0ModelStates) {
  Plan p0 = plan_of(kGpt2, 4, {"zero_optimization.stage=0"});
  Plan p3 = plan_of(kGpt2, 4, {"zero_optimization.stage=3"});
  auto states = [](const Plan& p) { return p.memory.device.params + p.memory.device.grads + p.memory.device.optimizer_states; };
  EXPECT_LE(states(p3), 0.30 * states(p0));
}

TEST(PlanCompiler, OffloadMovesStatesToTheHost) {
  Plan p = plan_of(kGpt2, 2, {"zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=cpu",
                              "zero_optimization.offload_param.device=cpu"});
  EXPECT_EQ(p.memory.device.optimizer_states, 0);
  EXPECT_GT(p.memory.host.optimizer_states, 0);
  EXPECT_GT(p.memory.host.params, 0);
  EXPECT_EQ(p.placement.optimizer_states, "cpu, partitioned");
}

TEST(PlanCompiler, ThePlacementLineIsReadOffTheBuffersTheRuntimeAllocates) {
  // ds plan's "placement" row names, for each model state, the farthest place any of its buffers is at in
  // the ZeRO execution: the same buffers FlatParams allocates, so the line cannot drift from what runs.
  struct Case {
    std::vector<std::string> o;
    const char* params;
    const char* grads;
    const char* states;
  };
  const std::vector<Case> cases{
      {{"zero_optimization.stage=0"}, "device (cpu)", "device (cpu)", "device (cpu)"},
      {{"zero_optimization.stage=2", "zero_optimization.offload_optimizer.device=cpu"}, "device (cpu)", "cpu, partitioned",
       "cpu, partitioned"},
      {{"zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=nvme", "zero_optimization.offload_optimizer.nvme_path=/tmp",
        "zero_optimization.offload_param.nvme_path=/tmp", "zero_optimization.offload_param.device=nvme"},
       "nvme, partitioned", "cpu, partitioned", "nvme, partitioned"},
      {{"zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=cpu", "zero_optimization.offload_optimizer.ratio=0.3"},
       "device (cpu), partitioned", "cpu, partitioned", "cpu, partitioned"},
  };
  for (const Case& c : cases) {
    const Plan p = plan_of(kGpt2, 2, c.o);
    SCOPED_TRACE(c.o.back());
    EXPECT_EQ(p.placement.params, c.params);
    EXPECT_EQ(p.placement.grads, c.grads);
    EXPECT_EQ(p.placement.optimizer_states, c.states);
    // And from the buffers themselves: an offloaded optimizer's states have a host (or NVMe) buffer.
    const bool off_device = p.execution.find(BufferRole::master, Place::host) || p.execution.find(BufferRole::master, Place::nvme) ||
                            p.execution.find(BufferRole::exp_avg, Place::host) || p.execution.find(BufferRole::exp_avg, Place::nvme);
    EXPECT_EQ(off_device, std::string(c.states).rfind("device", 0) != 0);
  }
}

TEST(PlanCompiler, InvalidStageAndOffloadCombinationsAreRejected) {
  try {
    plan_of(kGpt2, 2, {"zero_optimization.stage=2", "zero_optimization.offload_param.device=cpu"});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.issues().at(0).path, "zero_optimization.offload_param.device");
    EXPECT_NE(e.issues().at(0).hint.find("stage=3"), std::string::npos);
  }
  EXPECT_THROW(plan_of(kGpt2, 2, {"zero_optimization.offload_optimizer.device=cpu"}), ConfigError);  // stage 0
}

TEST(PlanCompiler, NvmeOptimizerOffloadSwapsAtEveryStageAndRefusesWhatCannotSwap) {
  // DeepSpeed treats nvme as cpu below stage 3; ds swaps the rank's part at stages 1-2 too.
  Plan p = plan_of(kGpt2, 2, {"zero_optimization.stage=2", "zero_optimization.offload_optimizer.device=nvme",
                              "zero_optimization.offload_optimizer.nvme_path=/tmp"});
  EXPECT_EQ(p.zero.offload_optimizer.device, OffloadDevice::nvme);
  EXPECT_NE(p.execution.find(BufferRole::master, Place::nvme), nullptr);
  EXPECT_FALSE(p.execution.sub_groups.empty());
  // Lamb's trust ratio needs every tensor's norms before any update: refused, not swapped twice.
  EXPECT_THROW(plan_of(kGpt2, 2, {"zero_optimization.stage=3", "optimizer.type=Lamb", "zero_optimization.offload_optimizer.device=nvme",
                                  "zero_optimization.offload_optimizer.nvme_path=/tmp"}),
               ConfigError);
  // Fewer buffers than one sub-group needs (Adam: master, gradients, two moments) is an error; enough for
  // one but not for the pipeline asked for is a warning, and the pipeline shrinks to fit.
  EXPECT_THROW(plan_of(kGpt2, 2, {"zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=nvme",
                                  "zero_optimization.offload_optimizer.nvme_path=/tmp", "zero_optimization.offload_optimizer.buffer_count=3"}),
               ConfigError);
  Plan piped = plan_of(kGpt2, 2, {"zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=nvme",
                                  "zero_optimization.offload_optimizer.nvme_path=/tmp", "zero_optimization.offload_optimizer.buffer_count=8",
                                  "zero_optimization.offload_optimizer.pipeline_read=true", "zero_optimization.offload_optimizer.pipeline_write=true"});
  EXPECT_EQ(piped.execution.swap_sets, 2);
  ASSERT_FALSE(piped.warnings.empty());
  EXPECT_EQ(piped.warnings.back().path, "zero_optimization.offload_optimizer.buffer_count");
  EXPECT_NE(piped.warnings.back().message.find("needs 12 buffers"), std::string::npos) << piped.warnings.back().message;
}

TEST(PlanCompiler, ASubGroupSizeThatWouldMakeMillionsOfSubGroupsIsRefusedNotListed) {
  // Found by fuzz_config: sub_group_size 0 on a 13B model asked for 800 million sub-groups (3 GiB of plan).
  for (const char* size : {"0", "16"}) {
    try {
      plan_of(kGpt2, 2, {"zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=nvme",
                         "zero_optimization.offload_optimizer.nvme_path=/tmp", std::string("zero_optimization.sub_group_size=") + size});
      FAIL() << size;
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.issues().at(0).path, "zero_optimization.sub_group_size");
      EXPECT_NE(e.issues().at(0).hint.find("at least "), std::string::npos) << e.issues().at(0).hint;
    }
  }
  // The bound is on the count, not the size: a small model may use small sub-groups.
  Plan small = plan_of(kGpt2, 2, {"zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=nvme",
                                  "zero_optimization.offload_optimizer.nvme_path=/tmp", "zero_optimization.sub_group_size=1000000"});
  EXPECT_GT(small.execution.sub_groups.size(), 10u);
}

TEST(PlanCompiler, AutoValuesAreResolvedWithTheirSource) {
  Plan p = plan_of(kGpt2, 2, {"zero_optimization.reduce_bucket_size=auto", "zero_optimization.stage=3",
                              "zero_optimization.stage3_prefetch_bucket_size=auto", "data.seq_len=auto"});
  EXPECT_EQ(p.zero.reduce_bucket_size, 768 * 768);
  EXPECT_EQ(p.zero.prefetch_bucket_size, static_cast<int64_t>(0.9 * 768 * 768));
  EXPECT_EQ(p.seq_len, 1024);
  EXPECT_TRUE(p.zero.overlap_comm);  // null -> true at stage 3
  auto r = find_resolved(p, "zero_optimization.reduce_bucket_size");
  ASSERT_NE(r, p.resolved.end());
  EXPECT_NE(r->source.find("hidden_size^2"), std::string::npos);
  EXPECT_NE(find_resolved(p, "data.seq_len"), p.resolved.end());
}

TEST(PlanCompiler, AutoMicroBatchIsTheLargestThatFits) {
  const double gib = 1 << 30;
  Plan big = plan_of(R"({"train_micro_batch_size_per_gpu": "auto", "model": {"preset": "gpt2"}, "bf16": {"enabled": true}})", 1,
                     {}, 80 * gib);
  Plan small = plan_of(R"({"train_micro_batch_size_per_gpu": "auto", "model": {"preset": "gpt2"}, "bf16": {"enabled": true}})", 1,
                       {}, 8 * gib);
  EXPECT_GT(big.batch.micro_batch, small.batch.micro_batch);
  EXPECT_LE(small.device_bytes_per_rank(), 0.9 * 8 * gib);
  // The next power of two would not have fitted.
  Plan doubled = plan_of(R"({"model": {"preset": "gpt2"}, "bf16": {"enabled": true}})", 1,
                         {"train_micro_batch_size_per_gpu=" + std::to_string(small.batch.micro_batch * 2)}, 8 * gib);
  EXPECT_GT(doubled.device_bytes_per_rank(), 0.9 * 8 * gib);
  EXPECT_NE(find_resolved(small, "train_micro_batch_size_per_gpu"), small.resolved.end());
}

TEST(PlanCompiler, AutoMicroBatchFitsTheHostMemoryOffloadTakesToo) {
  // ZeRO-3 with the optimizer and parameters offloaded to the CPU: the device has room for a big micro
  // batch, the host (24 GiB here) does not have room for what offload keeps there plus the activations of
  // a CPU rank. "auto" must pick what the host fit check (ds train's) accepts.
  Topology t;
  t.world_size = t.ranks_per_node = t.num_nodes = 1;
  t.cores_per_node = 2;
  t.host_memory_bytes = 24.0 * (1 << 30);
  t.world_size_source = "--world-size";
  const Config c = load_config_text(R"({"train_micro_batch_size_per_gpu": "auto", "model": {"preset": "gpt2-large"}, "bf16": {"enabled": true},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, "data": {"seq_len": 1024}})",
                                    "t.json");
  const Plan p = compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), t);
  ASSERT_GE(p.batch.micro_batch, 1);
  EXPECT_LE(p.host_bytes_per_node(), 0.9 * t.host_memory_bytes) << "micro batch " << p.batch.micro_batch;
  // The next power of two would not have fitted the host.
  const Config d = load_config_text(R"({"model": {"preset": "gpt2-large"}, "bf16": {"enabled": true},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, "data": {"seq_len": 1024}})",
                                    "t.json", {"train_micro_batch_size_per_gpu=" + std::to_string(p.batch.micro_batch * 2)});
  const Plan doubled = compile_plan(d, build_model_spec(resolve_model_hyper(d.model)), t);
  EXPECT_GT(doubled.host_bytes_per_node(), 0.9 * t.host_memory_bytes);
  const auto r = find_resolved(p, "train_micro_batch_size_per_gpu");
  ASSERT_NE(r, p.resolved.end());
  EXPECT_NE(r->source.find("of host memory per node"), std::string::npos) << r->source;
}

TEST(PlanCompiler, AutoStageIsTheLowestThatFits) {
  const double gib = 1 << 30;
  const char* cfg = R"({"train_micro_batch_size_per_gpu": 1, "model": {"preset": "llama-2-7b", "activation_checkpointing": true},
                        "bf16": {"enabled": true}, "zero_optimization": {"stage": "auto"}, "data": {"seq_len": 1024}})";
  EXPECT_EQ(plan_of(cfg, 8, {}, 80 * gib).zero_stage(), 1);  // 16P = 100 GiB: stage 0 does not fit 80 GiB
  EXPECT_EQ(plan_of(cfg, 8, {}, 24 * gib).zero_stage(), 3);
}

TEST(PlanCompiler, SequenceLongerThanLearnedPositionsIsAnError) {
  EXPECT_THROW(plan_of(kGpt2, 1, {"data.seq_len=2048"}), ConfigError);
}

TEST(PlanCompiler, Fp16OnCpuStoresHalfButComputesInFloat) {
  Plan p = plan_of(kGpt2, 1, {"~bf16", "fp16.enabled=true"});
  EXPECT_EQ(p.precision.param_dtype, Dtype::fp16);
  EXPECT_EQ(p.precision.compute_dtype, Dtype::fp32);
  EXPECT_TRUE(p.precision.loss_scaling.dynamic);
  EXPECT_DOUBLE_EQ(p.precision.loss_scaling.initial_scale, 65536);
  EXPECT_FALSE(p.precision.note.empty());
}

TEST(PlanCompiler, AdamWithoutAdamWModeIsL2Decay) {
  Plan p = plan_of(kGpt2, 1, {"optimizer.type=Adam", "optimizer.params.adam_w_mode=false"});
  EXPECT_FALSE(p.optimizer.decoupled_weight_decay);
  EXPECT_TRUE(plan_of(kGpt2, 1, {"optimizer.type=Adam"}).optimizer.decoupled_weight_decay);
}

TEST(PlanCompiler, CollectivesMatchTheStage) {
  EXPECT_TRUE(plan_of(kGpt2, 1).execution.collectives.empty());
  auto find = [](const Plan& p, const std::string& what) {
    const auto& all = p.execution.collectives;
    const auto it = std::find_if(all.begin(), all.end(), [&](const Collective& c) { return c.what() == what; });
    EXPECT_NE(it, all.end()) << what;
    return it == all.end() ? Collective{} : *it;
  };
  // CUDA ranks (NCCL): stage 2 reduce-scatters every micro step's gradients in bf16.
  const double gpu = 80.0 * (1 << 30);
  Plan p2 = plan_of(kGpt2, 4, {"zero_optimization.stage=2"}, gpu);
  ASSERT_EQ(p2.execution.collectives.size(), 3u);  // the small control all-reduce, gradients, updated parameters
  const Collective g2 = find(p2, "gradients");
  EXPECT_EQ(g2.op, CollectiveOp::reduce_scatter);
  EXPECT_EQ(g2.dtype_bytes, 2);
  EXPECT_EQ(g2.elements_per_step, p2.layout.numel * 2);  // every micro step, GAS = 2
  EXPECT_DOUBLE_EQ(g2.wire_bytes_per_rank_per_step, g2.payload_bytes_per_step * 3 / 4);
  EXPECT_EQ(find(p2, "updated parameters").elements_per_step, p2.layout.padded_numel);
  // CPU ranks (Gloo): stage 2 reduce-scatters point to point, in the dtype backward wrote (bf16 here).
  const Collective c2 = find(plan_of(kGpt2, 4, {"zero_optimization.stage=2"}), "gradients");
  EXPECT_EQ(c2.op, CollectiveOp::reduce_scatter);
  EXPECT_EQ(c2.dtype_bytes, 2);
  EXPECT_DOUBLE_EQ(c2.wire_bytes_per_rank_per_step, c2.payload_bytes_per_step * 3 / 4);
  // Stage 1 on Gloo, and reduce_scatter=false anywhere, all-reduce (bf16 through an fp32 copy on Gloo),
  // and the note says why.
  for (const auto& knobs : {std::vector<std::string>{"zero_optimization.stage=1"},
                            std::vector<std::string>{"zero_optimization.stage=2", "zero_optimization.reduce_scatter=false"}}) {
    const Collective c = find(plan_of(kGpt2, 4, knobs), "gradients");
    EXPECT_EQ(c.op, CollectiveOp::all_reduce) << knobs[0];
    EXPECT_EQ(c.dtype_bytes, 4);
    EXPECT_FALSE(c.note.empty());
    EXPECT_DOUBLE_EQ(c.wire_bytes_per_rank_per_step, c.payload_bytes_per_step * 2 * 3 / 4);
  }
  // Stages 0-1 with overlap_comm: one reduce per block as the step's last backward finishes it, then the
  // parameters before the blocks (the embeddings) and after them (the final norm).
  for (const char* stage : {"zero_optimization.stage=0", "zero_optimization.stage=1"}) {
    const Plan o = plan_of(kGpt2, 2, {stage, "zero_optimization.overlap_comm=true"});
    EXPECT_EQ(find(o, "gradients").calls_per_step, o.model.hp.num_layers + 2) << stage;
    EXPECT_EQ(find(o, "gradients").elements_per_step, o.execution.full_numel) << stage;
    EXPECT_EQ(find(plan_of(kGpt2, 2, {stage, "zero_optimization.overlap_comm=false"}), "gradients").calls_per_step, 1) << stage;
  }
  const Collective g0 = find(plan_of(kGpt2, 4, {"zero_optimization.stage=0"}, gpu), "gradients");
  EXPECT_DOUBLE_EQ(g0.wire_bytes_per_rank_per_step, g0.payload_bytes_per_step * 2 * 3 / 4);
  // Stage 3: the blocks are gathered for forward and again for backward every micro step (GAS = 2), the
  // parameters outside them once a step; together, once each, every parameter.
  Plan p3 = plan_of(kGpt2, 4, {"zero_optimization.stage=3", "zero_optimization.stage3_param_persistence_threshold=0"}, gpu);
  const Collective fwd = find(p3, "parameters (forward)"), bwd = find(p3, "parameters (backward)");
  const Collective outer = find(p3, "parameters outside the blocks");
  EXPECT_EQ(fwd.calls_per_step, p3.model.hp.num_layers * 2);
  EXPECT_EQ(bwd.calls_per_step, p3.model.hp.num_layers * 2);
  EXPECT_EQ(bwd.elements_per_step, fwd.elements_per_step);
  EXPECT_EQ(outer.calls_per_step, 1);
  EXPECT_EQ(outer.when, Cadence::per_step);
  EXPECT_EQ(outer.elements_per_step + fwd.elements_per_step / 2, p3.layout.padded_numel);
  EXPECT_GT(bytes_of_role(p3, BufferRole::gather_staging), 0.0);  // NCCL's all-gather takes equal, padded pieces
  // Gloo (CPU ranks): gathers land in place, real elements only (5 ranks pad 768-wide tensors), through no
  // staging buffer; stored fp16 computed in fp32 still packs into staging, padding and all.
  const Plan c3 = plan_of(kGpt2, 5, {"zero_optimization.stage=3", "zero_optimization.stage3_param_persistence_threshold=0"});
  ASSERT_GT(c3.layout.padded_numel, c3.layout.numel);
  const int64_t gas = c3.batch.grad_accum;
  EXPECT_EQ(find(c3, "parameters outside the blocks").elements_per_step + find(c3, "parameters (forward)").elements_per_step / gas,
            c3.layout.numel);
  EXPECT_EQ(bytes_of_role(c3, BufferRole::gather_staging) + bytes_of_role(c3, BufferRole::prefetch_staging), 0.0);
  const Plan f3 = plan_of(kGpt2, 5, {"zero_optimization.stage=3", "zero_optimization.stage3_param_persistence_threshold=0",
                                     "bf16.enabled=false", "fp16.enabled=true"});
  EXPECT_EQ(find(f3, "parameters outside the blocks").elements_per_step + find(f3, "parameters (forward)").elements_per_step / gas,
            f3.layout.padded_numel);
  EXPECT_GT(bytes_of_role(f3, BufferRole::gather_staging), 0.0);
}

TEST(PlanJson, ParsesAndCarriesTheSchemaVersion) {
  Plan p = plan_of(kGpt2, 2, {"zero_optimization.stage=3"});
  auto j = nlohmann::json::parse(plan_to_json(p));
  EXPECT_EQ(j["schema_version"], kPlanSchemaVersion);
  EXPECT_EQ(j["model"]["num_params"], 124439808);
  EXPECT_EQ(j["batch"]["train_batch_size"], 16);
  EXPECT_EQ(j["zero"]["stage"], 3);
  EXPECT_EQ(j["layout"]["params"].size(), p.layout.params.size());
  EXPECT_EQ(j["memory"]["device_per_rank"]["total"], static_cast<int64_t>(std::llround(p.memory.device.total())));
  // The buffers listed add up to the memory table (less the activations), and say how stage 3 runs.
  double listed = 0;
  for (const auto& b : j["zero_execution"]["buffers"]) {
    EXPECT_EQ(b["bytes"].get<double>(), b["elements"].get<double>() * b["copies"].get<double>() * (b["dtype"] == "fp32" ? 4 : 2));
    if (b["place"] == "device") listed += b["bytes"].get<double>();
  }
  EXPECT_NEAR(listed, p.memory.device.total() - p.memory.device.activations, 16.0);  // JSON rounds each to bytes
  EXPECT_EQ(j["zero_execution"]["gathers"], true);
  EXPECT_EQ(j["zero_execution"]["sharded"], true);
  EXPECT_EQ(j["run"]["seed"], p.run.seed);
}

TEST(Templates, EveryTemplateValidatesAndPlans) {
  int n = 0;
  for (const auto& entry : fs::directory_iterator(fs::path(DS_SOURCE_DIR) / "templates")) {
    SCOPED_TRACE(entry.path().string());
    Config c = load_config_file(entry.path().string());
    EXPECT_TRUE(c.warnings.empty()) << dump(c.warnings);
    Plan p = compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), topo(8, 80.0 * (1 << 30)));
    EXPECT_GT(p.batch.train_batch_size, 0);
    EXPECT_LE(p.device_bytes_per_rank(), 80.0 * (1 << 30));  // every template fits an 80 GiB GPU at 8 ranks
    ++n;
  }
  EXPECT_GE(n, 9);
}

TEST(DeepSpeedConfigs, EveryTrainingConfigPlans) {
  DS_REQUIRE_SHARED_DATA();
  for (const auto& entry : fs::directory_iterator(fs::path(DS_SHARED_DIR) / "data" / "deepspeed-configs")) {
    if (entry.path().filename() == "csrc_aio_py_test_single_process_config.json") continue;
    SCOPED_TRACE(entry.path().string());
    std::vector<std::string> overrides = {"model.preset=gpt2"};
    // DeepSpeed's autotuning templates leave the batch to the autotuner; give them a micro batch.
    if (entry.path().filename().string().find("autotuning") != std::string::npos)
      overrides.push_back("train_micro_batch_size_per_gpu=1");
    Config c = load_config_file(entry.path().string(), overrides);
    // Their batch sizes assume a world size; plan with one that divides train_batch_size.
    int world = 1;
    if (c.train_batch_size && c.train_micro_batch_size_per_gpu && c.gradient_accumulation_steps)
      world = static_cast<int>(*c.train_batch_size / (*c.train_micro_batch_size_per_gpu * *c.gradient_accumulation_steps));
    EXPECT_NO_THROW(compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), topo(world)));
  }
}

TEST(PlanCompiler, CommunicationKeysWithoutEffectWarnOnce) {
  const auto warned = [](const Plan& p, const std::string& key) {
    return std::count_if(p.warnings.begin(), p.warnings.end(), [&](const ConfigIssue& w) { return w.path == key; });
  };
  // reduce_scatter given where ds all-reduces regardless: stage 0, and stage 1 on CPU ranks.
  for (const char* stage : {"zero_optimization.stage=0", "zero_optimization.stage=1"})
    for (const char* value : {"zero_optimization.reduce_scatter=true", "zero_optimization.reduce_scatter=false"})
      EXPECT_EQ(warned(plan_of(kGpt2, 2, {stage, value}), "zero_optimization.reduce_scatter"), 1) << stage << " " << value;
  // Where it acts, or left to its default, or on one rank (nothing crosses a wire), no word.
  EXPECT_EQ(warned(plan_of(kGpt2, 2, {"zero_optimization.stage=2", "zero_optimization.reduce_scatter=false"}), "zero_optimization.reduce_scatter"), 0);
  EXPECT_EQ(warned(plan_of(kGpt2, 2, {"zero_optimization.stage=1"}), "zero_optimization.reduce_scatter"), 0);
  EXPECT_EQ(warned(plan_of(kGpt2, 1, {"zero_optimization.stage=0", "zero_optimization.reduce_scatter=true"}), "zero_optimization.reduce_scatter"), 0);
}

TEST(PlanCompiler, CommunicationDataTypeIsTheDtypeGradientsCrossRanksIn) {
  const auto warned = [](const Plan& p, const std::string& key) {
    return std::count_if(p.warnings.begin(), p.warnings.end(), [&](const ConfigIssue& w) { return w.path == key; });
  };
  // communication_data_type acts: the plan counts the gradients' bytes in it, on CPU and GPU ranks alike.
  const auto gradient_bytes = [](const Plan& p) {
    for (const Collective& c : p.execution.collectives)
      if (c.kind == CollectiveKind::gradients) return c.dtype_bytes;
    return 0;
  };
  const double gpu = 80.0 * (1 << 30);
  const Plan fp32_asked = plan_of(kGpt2, 2, {"zero_optimization.stage=2", "communication_data_type=fp32"}, gpu);
  EXPECT_EQ(warned(fp32_asked, "communication_data_type"), 0);
  EXPECT_EQ(fp32_asked.execution.reduced_dtype, Dtype::bf16);
  EXPECT_EQ(fp32_asked.execution.wire_dtype, Dtype::fp32);
  EXPECT_EQ(gradient_bytes(fp32_asked), 4);
  EXPECT_EQ(gradient_bytes(plan_of(kGpt2, 2, {"zero_optimization.stage=2"}, gpu)), 2);
  EXPECT_EQ(warned(plan_of(kGpt2, 2, {"communication_data_type=bf16"}), "communication_data_type"), 0);  // bf16 run: what it does
  // Said once where it cannot act (one rank: nothing crosses), where it rounds without sending fewer bytes (Gloo's
  // all-reduce widens 16-bit floats to fp32), and where fp16 meets gradients no loss scale keeps in its range.
  EXPECT_EQ(warned(plan_of(kGpt2, 1, {"communication_data_type=fp32"}), "communication_data_type"), 1);
  const char* fp32_run = "bf16.enabled=false";
  const Plan rounded = plan_of(kGpt2, 2, {fp32_run, "zero_optimization.stage=1", "communication_data_type=bf16"});
  EXPECT_EQ(warned(rounded, "communication_data_type"), 1);
  EXPECT_EQ(gradient_bytes(rounded), 4);
  const Plan scattered = plan_of(kGpt2, 2, {fp32_run, "zero_optimization.stage=2", "communication_data_type=bf16"});
  EXPECT_EQ(warned(scattered, "communication_data_type"), 0);
  EXPECT_EQ(gradient_bytes(scattered), 2);
  EXPECT_EQ(warned(plan_of(kGpt2, 2, {"zero_optimization.stage=2", "communication_data_type=fp16"}), "communication_data_type"), 1);
  EXPECT_EQ(warned(plan_of(kGpt2, 2, {"zero_optimization.stage=2", "communication_data_type=fp16"}, gpu), "communication_data_type"), 1);
  // fp32 over bf16 gradients on CPU ranks: Gloo sums them in fp32 already (said); on GPU ranks it changes NCCL's sums (no word).
  for (const char* stage : {"zero_optimization.stage=1", "zero_optimization.stage=2"})
    EXPECT_EQ(warned(plan_of(kGpt2, 2, {stage, "communication_data_type=fp32"}), "communication_data_type"), 1) << stage;
  EXPECT_EQ(warned(plan_of(kGpt2, 2, {"bf16.enabled=false", "fp16.enabled=true", "zero_optimization.stage=2", "communication_data_type=fp16"}),
                   "communication_data_type"),
            0);
  // Gradients summed in fp32 over bf16 weights cross in fp32 unasked.
  const Plan summed = plan_of(kGpt2, 2, {"zero_optimization.stage=1", "data_types.grad_accum_dtype=fp32"}, gpu);
  EXPECT_EQ(warned(summed, "communication_data_type"), 0);
  EXPECT_EQ(gradient_bytes(summed), 4);
  EXPECT_EQ(summed.execution.reduced_dtype, Dtype::fp32);
  EXPECT_EQ(plan_of(kGpt2, 2, {"zero_optimization.stage=2", "data_types.grad_accum_dtype=fp32"}, gpu).execution.reduced_dtype, Dtype::bf16);
}

TEST(PlanCompiler, TheCommunicationBackendIsThePlansDecision) {
  // CPU ranks talk over Gloo, GPU ranks over NCCL; the runtime's communicator factory is keyed by this.
  EXPECT_EQ(plan_of(kGpt2, 2, {"zero_optimization.stage=2"}).execution.backend, CommBackend::gloo);
  const Plan gpu = plan_of(kGpt2, 2, {"zero_optimization.stage=2"}, 80.0 * (1 << 30));
  EXPECT_EQ(gpu.execution.backend, CommBackend::nccl);
  EXPECT_EQ(nlohmann::json::parse(plan_to_json(gpu))["zero_execution"]["backend"], "nccl");
  // NCCL reduce-scatters at stage 1 too and gathers stage-3 partitions through equal staged pieces.
  EXPECT_TRUE(plan_of(kGpt2, 2, {"zero_optimization.stage=1"}, 80.0 * (1 << 30)).execution.scatter);
  EXPECT_FALSE(plan_of(kGpt2, 2, {"zero_optimization.stage=1"}).execution.scatter);
  EXPECT_TRUE(plan_of(kGpt2, 2, {"zero_optimization.stage=3"}, 80.0 * (1 << 30)).execution.gather_staged);
}

// train.weight_decay_params: "matrices" (Hugging Face's Trainer grouping) decays the projections, the token
// and position embeddings and the head, never biases or norm weights; "all" decays every parameter, as
// DeepSpeed does with one group. ds plan says which.
TEST(Plan, WeightDecayAppliesToMatricesOrToEveryParameter) {
  const char* gpt2 = R"({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"weight_decay": 0.1}},
    "model": {"preset": "gpt2-tiny"}, "data": {"seq_len": 16}})";
  const Plan matrices = test::plan_of(gpt2, 1, 0);
  const Plan all = test::plan_of(gpt2, 1, 0, {"train.weight_decay_params=all"});
  ASSERT_EQ(matrices.layout.params.size(), all.layout.params.size());
  int decayed = 0;
  for (size_t i = 0; i < matrices.layout.params.size(); ++i) {
    const ParamSlot& p = matrices.layout.params[i];
    const bool is_matrix = p.shape.size() == 2;  // wte, wpe, c_attn, c_proj, c_fc: the bias and norm vectors are 1-D
    EXPECT_EQ(p.weight_decay, is_matrix) << p.name;
    EXPECT_TRUE(all.layout.params[i].weight_decay) << p.name;
    decayed += p.weight_decay;
  }
  EXPECT_EQ(decayed, 2 + 4 * matrices.model.hp.num_layers);
  EXPECT_EQ(matrices.optimizer.decay_all_params, false);
  EXPECT_EQ(all.optimizer.decay_all_params, true);
}

// What this ds cannot train yet is the plan's to say, by device: ds plan shows it, ds train refuses it.
TEST(Plan, WhatCannotRunYetIsDecidedFromThePlan) {
  const char* cfg = R"({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true}, "model": {"preset": "gpt2-tiny"}, "data": {"seq_len": 16}})";
  Config c = load_config_text(cfg, "t.json", {"zero_optimization.stage=2", "zero_optimization.offload_optimizer.device=cpu"});
  const ModelSpec m = build_model_spec(resolve_model_hyper(c.model));
  Topology gpu;
  gpu.device = DeviceKind::cuda;
  gpu.device_memory_bytes = 80.0 * (1 << 30);
  gpu.world_size_source = "test";
  Topology cpu;
  cpu.world_size_source = "test";
  EXPECT_TRUE(not_yet_runnable(compile_plan(c, m, cpu)).empty());
  // One GPU offloads, not warned of (its checks have run on a GPU); several GPU ranks too, warned that ds's checks
  // have not run that; the parameters on NVMe from one GPU are warned of too.
  const Plan one = compile_plan(c, m, gpu);
  EXPECT_TRUE(not_yet_runnable(one).empty());
  bool warned = false;
  for (const ConfigIssue& w : one.warnings) warned = warned || w.message.find("is new") != std::string::npos;
  EXPECT_FALSE(warned);
  warned = false;
  const Config on_nvme = load_config_text(cfg, "t.json", {"zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=cpu",
                                                           "zero_optimization.offload_param.device=nvme", "zero_optimization.offload_param.nvme_path=/tmp"});
  for (const ConfigIssue& w : compile_plan(on_nvme, m, gpu).warnings)
    warned = warned || (w.path == "zero_optimization.offload_param.device" && w.message.find("parameters on NVMe from a GPU are new") != std::string::npos);
  EXPECT_TRUE(warned);
  gpu.world_size = gpu.ranks_per_node = 2;
  const std::vector<std::string> why = not_yet_runnable(compile_plan(c, m, gpu));
  ASSERT_EQ(why.size(), 1u);  // this test's topology names no build: no NCCL communicator
  EXPECT_NE(why[0].find("no NCCL communicator"), std::string::npos) << why[0];
  gpu.build = BuildSupport{};
  gpu.build->torch_cuda = true;
  gpu.build->cuda_kernels = "CUDA 13.0, sm_90";
  gpu.build->nccl = "2.27.7";
  const Plan two = compile_plan(c, m, gpu);
  EXPECT_TRUE(not_yet_runnable(two).empty());
  warned = false;
  for (const ConfigIssue& w : two.warnings)
    warned = warned || w.message.find("offload from several GPU ranks is new") != std::string::npos;
  EXPECT_TRUE(warned);
  // A model split over GPU ranks (tensor 2 x pipeline 2) runs over NCCL's groups, warned that ds's checks have run
  // them between thread ranks on the CPU only.
  Config split = load_config_text(cfg, "t.json", {"tensor_parallel.autotp_size=2", "pipeline.stages=2", "train_batch_size=8"});
  gpu.world_size = gpu.ranks_per_node = 4;
  const Plan mesh = compile_plan(split, build_model_spec(resolve_model_hyper(split.model)), gpu);
  ASSERT_TRUE(mesh.mesh.shape.splits_the_model());
  EXPECT_TRUE(not_yet_runnable(mesh).empty()) << not_yet_runnable(mesh).front();
  warned = false;
  for (const ConfigIssue& w : mesh.warnings)
    warned = warned || w.message.find("a split model's groups and a pipeline's messages have run between thread ranks on the CPU") != std::string::npos;
  EXPECT_TRUE(warned);
}

// The one fit rule: fits up to (1 - headroom) of the memory, tight past it, does not fit past the whole.
TEST(Plan, OneFitRuleWithItsHeadroom) {
  EXPECT_EQ(judge_fit(50, 100, 0.1), Fit::fits);
  EXPECT_EQ(judge_fit(90, 100, 0.1), Fit::fits);
  EXPECT_EQ(judge_fit(91, 100, 0.1), Fit::within_headroom);
  EXPECT_EQ(judge_fit(100, 100, 0.1), Fit::within_headroom);
  EXPECT_EQ(judge_fit(101, 100, 0.1), Fit::does_not_fit);
  EXPECT_EQ(judge_fit(101, 0, 0.1), Fit::unknown);
  const char* cfg = R"({"train_micro_batch_size_per_gpu": 2, "model": {"preset": "gpt2-tiny"}, "data": {"seq_len": 16}})";
  Config c = load_config_text(cfg, "t.json");
  Topology host;
  host.world_size_source = "test";
  const Plan p = compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), host);
  host.host_memory_bytes = p.host_bytes_per_node() / 0.95;  // within the 10% left free
  const FitCheck tight = check_fit(compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), host), 0.1);
  EXPECT_EQ(tight.device, Fit::not_applicable);
  EXPECT_EQ(tight.host, Fit::within_headroom);
  EXPECT_FALSE(tight.fits());
  EXPECT_FALSE(tight.does_not_fit());
}

// A resumed run keeps its checkpoint's global batch at another world size (the accumulation scaled) and the
// schedule's lengths that followed train.steps, in one compile; a batch the user sets for this run changes,
// said; a batch no whole accumulation keeps is the caller's to refuse, with the choices.
TEST(PlanCompiler, AResumedRunKeepsItsCheckpointsBatchAndScheduleWhereTheConfigLeavesThemOpen) {
  const char* text = R"({"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": true}, "model": {"preset": "gpt2-tiny"},
    "scheduler": {"type": "WarmupCosineLR"}, "data": {"seq_len": 32}, "train": {"steps": 200}})";
  ResumedFrom was;  // 2 ranks x micro 4 x accumulation 2, 100 steps of WarmupCosineLR (warmup 10, total 100)
  was.train_batch_size = 16, was.world_size = 2, was.steps = 100, was.scheduler = "WarmupCosineLR";
  was.total_num_steps = 100, was.warmup_num_steps = 10;
  const auto compile = [&](const std::vector<std::string>& overrides, int world) {
    Config c = load_config_text(text, "resume.json", overrides);
    return compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), test::thread_ranks(world, 0), &was);
  };
  const Plan p = compile({}, 1);
  EXPECT_EQ(p.batch.train_batch_size, 16);
  EXPECT_EQ(p.batch.grad_accum, 4);
  EXPECT_EQ(p.tokens_per_step, 16 * 32);
  EXPECT_EQ(p.steps, 200);
  EXPECT_EQ(p.scheduler.params.total_num_steps, 100);
  EXPECT_EQ(p.scheduler.params.warmup_num_steps, 10);
  const std::vector<std::pair<std::string, int64_t>> kept{{"train_batch_size", 16}, {"gradient_accumulation_steps", 4},
                                                           {"scheduler.params.total_num_steps", 100}, {"scheduler.params.warmup_num_steps", 10}};
  EXPECT_EQ(p.kept.values, kept);
  ASSERT_EQ(p.kept.notes.size(), 2u);
  EXPECT_NE(p.kept.notes[0].find("keeping its global batch of 16 with gradient_accumulation_steps=4"), std::string::npos) << p.kept.notes[0];
  EXPECT_NE(p.kept.notes[1].find("train.steps 100 -> 200: the schedule keeps total_num_steps=100, warmup_num_steps=10"), std::string::npos)
      << p.kept.notes[1];
  EXPECT_TRUE(p.kept.refusal.empty());
  // The same plan as the values given by the user (what resuming did by overrides before).
  Config given = load_config_text(text, "resume.json", {"train_batch_size=16", "gradient_accumulation_steps=4",
                                                        "scheduler.params.total_num_steps=100", "scheduler.params.warmup_num_steps=10"});
  const Plan same = compile_plan(given, build_model_spec(resolve_model_hyper(given.model)), test::thread_ranks(1, 0));
  EXPECT_EQ(plan_to_json(p), plan_to_json(same));
  // The schedule set in the file, and the batch set for this run: they act, the batch's change said.
  const Plan mine = compile({"scheduler.params.total_num_steps=300", "gradient_accumulation_steps=1"}, 1);
  EXPECT_EQ(mine.batch.train_batch_size, 4);
  EXPECT_EQ(mine.scheduler.params.total_num_steps, 300);
  EXPECT_EQ(mine.scheduler.params.warmup_num_steps, 10);  // still open: kept
  bool said = false;
  for (const ConfigIssue& w : mine.warnings) said = said || w.message.find("the batch is set for this run, so it does") != std::string::npos;
  EXPECT_TRUE(said);
  // 16 cannot be made of micro 4 on 3 ranks: refused by the caller, naming the choices.
  const Plan three = compile({}, 3);
  EXPECT_NE(three.kept.refusal.find("the global batch would change from 16 (the checkpoint's, 2 ranks) to 12 (3 ranks)"), std::string::npos)
      << three.kept.refusal;
  EXPECT_NE(three.kept.refusal_hint.find("train_micro_batch_size_per_gpu x gradient_accumulation_steps x 3 = 16"), std::string::npos);
  // "auto" written in the file leaves a value open: kept like one left out.
  const Plan autos = compile({"train_batch_size=auto", "gradient_accumulation_steps=auto", "scheduler.params.total_num_steps=auto"}, 1);
  EXPECT_EQ(autos.batch.train_batch_size, 16);
  EXPECT_EQ(autos.scheduler.params.total_num_steps, 100);
  // A loader's warning on a scheduler key outlives the schedule resolved again.
  const Plan inert = compile({"scheduler.params.last_batch_iteration=5"}, 1);
  bool inert_said = false;
  for (const ConfigIssue& w : inert.warnings) inert_said = inert_said || w.path == "scheduler.params.last_batch_iteration";
  EXPECT_TRUE(inert_said);
  EXPECT_EQ(inert.scheduler.params.total_num_steps, 100);
  // At the same world size an edited accumulation is the user's (nothing kept); "auto" choosing another micro
  // batch is kept as at another world size.
  was.world_size = 1;
  EXPECT_EQ(compile({"gradient_accumulation_steps=2"}, 1).batch.train_batch_size, 8);
  EXPECT_TRUE(compile({"gradient_accumulation_steps=2"}, 1).kept.refusal.empty());
  // Nothing changed, nothing kept.
  was.world_size = 1, was.train_batch_size = 4, was.steps = 200, was.total_num_steps = 200, was.warmup_num_steps = 20;
  EXPECT_TRUE(compile({}, 1).kept.values.empty());
}

TEST(PlanCompiler, DeepSpeedsCheckpointIntervalRecomputesBlocksInGroups) {
  // 0 (DeepSpeed's default) leaves model.activation_checkpointing to decide; N turns it on, N blocks at a time.
  const Plan off = plan_of(kGpt2, 1);
  EXPECT_FALSE(off.activation_checkpointing);
  const Plan one = plan_of(kGpt2, 1, {"pipeline.activation_checkpoint_interval=1"});
  EXPECT_TRUE(one.activation_checkpointing);
  EXPECT_EQ(one.recompute_group, 1);
  const auto said = find_resolved(one, "model.activation_checkpointing");
  ASSERT_NE(said, one.resolved.end());
  EXPECT_NE(said->source.find("pipeline.activation_checkpoint_interval 1"), std::string::npos) << said->source;
  EXPECT_EQ(one.memory.device.activations, plan_of(kGpt2, 1, {"model.activation_checkpointing=true"}).memory.device.activations);
  // GPT-2's 12 blocks in groups of 4: 3 inputs kept instead of 12, 4 blocks recomputed at once instead of 1.
  const Plan four = plan_of(kGpt2, 1, {"pipeline.activation_checkpoint_interval=4"});
  EXPECT_EQ(four.recompute_group, 4);
  const double tokens = 4.0 * 256, bc = 2;
  const double block = four.model.block_activation_bytes_per_token(256, 2);
  EXPECT_NEAR(four.memory.device.activations - one.memory.device.activations,
              tokens * ((3.0 - 12.0) * static_cast<double>(four.model.hp.hidden_size) * bc + (4.0 - 1.0) * block), 1.0);
  EXPECT_TRUE(not_yet_runnable(four).empty());
  // Not yet at ZeRO stages 2-3 (two block buffers) or profiled (one backward per group). Above 0 it decides alone.
  for (const int stage : {2, 3}) {
    const std::vector<std::string> why =
        not_yet_runnable(plan_of(kGpt2, 2, {"pipeline.activation_checkpoint_interval=4", "zero_optimization.stage=" + std::to_string(stage)}));
    ASSERT_EQ(why.size(), 1u);
    EXPECT_NE(why[0].find("at ZeRO stage " + std::to_string(stage)), std::string::npos) << why[0];
    EXPECT_TRUE(not_yet_runnable(plan_of(kGpt2, 2, {"pipeline.activation_checkpoint_interval=1", "zero_optimization.stage=" + std::to_string(stage)})).empty());
  }
  EXPECT_TRUE(not_yet_runnable(plan_of(kGpt2, 2, {"pipeline.activation_checkpoint_interval=4", "zero_optimization.stage=1"})).empty());
  const std::vector<std::string> profiled = not_yet_runnable(four, /*profiling=*/true);
  ASSERT_EQ(profiled.size(), 1u);
  EXPECT_NE(profiled[0].find("activation_checkpoint_interval 4"), std::string::npos) << profiled[0];
  EXPECT_TRUE(plan_of(kGpt2, 1, {"pipeline.activation_checkpoint_interval=2", "model.activation_checkpointing=false"}).activation_checkpointing);
  // A group holding every block recomputes them all at once: said (the key still acts).
  const auto warned = [](const Plan& p) {
    return std::any_of(p.warnings.begin(), p.warnings.end(), [](const ConfigIssue& w) { return w.path == "pipeline.activation_checkpoint_interval"; });
  };
  EXPECT_FALSE(warned(four));
  EXPECT_TRUE(warned(plan_of(kGpt2, 1, {"pipeline.activation_checkpoint_interval=12"})));
}

TEST(PlanCompiler, AConfigWithoutAnOptimizerBlockIsWarnedOfTheDefaultItTrainsWith) {
  // DeepSpeed takes the optimizer from the training script when the config has none: a migrated fine-tuning
  // config would otherwise train at ds's default rate without a word.
  const auto said = [](const Plan& p) {
    for (const ConfigIssue& w : p.warnings)
      if (w.path == "optimizer") return w.message + " | " + w.hint;
    return std::string();
  };
  const std::string bare = said(plan_of(kGpt2, 1, {}));
  EXPECT_NE(bare.find("no optimizer block: ds trains with its default, AdamW lr 0.001 (where no scheduler sets the rate)"), std::string::npos)
      << bare;
  EXPECT_NE(bare.find("write the script's optimizer here"), std::string::npos) << bare;
  EXPECT_EQ(said(plan_of(kGpt2, 1, {"optimizer.type=AdamW"})), "");
  // A block without a type is DeepSpeed's "the script's optimizer" too; its lr, where given, is not the question.
  const std::string untyped = said(plan_of(kGpt2, 1, {"optimizer.params.lr=2e-5"}));
  EXPECT_NE(untyped.find("the optimizer block names no type: ds trains with its default, AdamW;"), std::string::npos) << untyped;
}
