#include <gtest/gtest.h>

#include <cmath>

#include "engine/plan/estimate.hpp"
#include "test_helpers.hpp"

using namespace ds;
using namespace ds::test;

namespace {
const int64_t kLlama7B = 6738415616, kLlama7BLargest = 32000LL * 4096;
double gib(double bytes) { return std::round(bytes / 1073741824.0 * 100) / 100; }  // DeepSpeed prints %.2f of /2^30

const DeepSpeedEstimateRow& row(const std::vector<DeepSpeedEstimateRow>& rows, const std::string& options) {
  for (const auto& r : rows)
    if (r.options == options) return r;
  throw std::runtime_error("no row " + options);
}
}  // namespace

// Worked example A of the reference (§3): Llama-2-7B on 1 node x 8 GPUs, to the byte.
TEST(DeepSpeedEstimator, Zero2ReproducesTheWorkedExampleToTheByte) {
  auto rows = deepspeed_zero2_estimate(kLlama7B, 8, 1);
  EXPECT_EQ(row(rows, "offload_optimizer=cpu").gpu_bytes, 13476831232.0);
  EXPECT_EQ(row(rows, "offload_optimizer=cpu").cpu_bytes, 323443949568.0);
  EXPECT_EQ(row(rows, "offload_optimizer=none").gpu_bytes, 28638266368.0);
  EXPECT_EQ(gib(row(rows, "offload_optimizer=none").cpu_bytes), 301.23);
}

TEST(DeepSpeedEstimator, Zero3ReproducesTheWorkedExampleToTheByte) {
  auto rows = deepspeed_zero3_estimate(kLlama7B, kLlama7BLargest, 8, 1);
  ASSERT_EQ(rows.size(), 6u);
  EXPECT_EQ(row(rows, "offload_param=cpu, offload_optimizer=cpu, zero_init=1").cpu_bytes, 181937221632.0);
  EXPECT_EQ(row(rows, "offload_param=cpu, offload_optimizer=cpu, zero_init=1").gpu_bytes, 524288000.0);
  EXPECT_EQ(gib(row(rows, "offload_param=cpu, offload_optimizer=cpu, zero_init=0").cpu_bytes), 301.23);
  EXPECT_EQ(row(rows, "offload_param=none, offload_optimizer=cpu, zero_init=1").gpu_bytes, 2208891904.0);
  EXPECT_EQ(gib(row(rows, "offload_param=none, offload_optimizer=cpu, zero_init=1").cpu_bytes), 150.62);
  EXPECT_EQ(row(rows, "offload_param=none, offload_optimizer=none, zero_init=1").gpu_bytes, 15685723136.0);
  EXPECT_EQ(row(rows, "offload_param=none, offload_optimizer=none, zero_init=1").cpu_bytes, 6291456000.0);
  EXPECT_EQ(gib(row(rows, "offload_param=none, offload_optimizer=none, zero_init=0").cpu_bytes), 301.23);
}

// Worked example B: 4 nodes x 8 GPUs (DeepSpeed's ZeRO-2 CPU term uses the total GPU count).
TEST(DeepSpeedEstimator, FourNodesReproduceWorkedExampleB) {
  auto z2 = deepspeed_zero2_estimate(kLlama7B, 8, 4);
  EXPECT_EQ(gib(row(z2, "offload_optimizer=cpu").cpu_bytes), 1204.92);
  EXPECT_EQ(gib(row(z2, "offload_optimizer=none").gpu_bytes), 16.08);
  auto z3 = deepspeed_zero3_estimate(kLlama7B, kLlama7BLargest, 8, 4);
  EXPECT_EQ(gib(row(z3, "offload_param=cpu, offload_optimizer=cpu, zero_init=1").cpu_bytes), 42.36);
  EXPECT_EQ(gib(row(z3, "offload_param=none, offload_optimizer=cpu, zero_init=1").cpu_bytes), 37.65);
  EXPECT_EQ(gib(row(z3, "offload_param=none, offload_optimizer=cpu, zero_init=1").gpu_bytes), 0.88);
  EXPECT_EQ(gib(row(z3, "offload_param=none, offload_optimizer=none, zero_init=1").gpu_bytes), 4.02);
}

TEST(DeepSpeedEstimator, OneGpuAndTheDocsTable) {
  EXPECT_EQ(gib(row(deepspeed_zero2_estimate(kLlama7B, 1, 1), "offload_optimizer=none").gpu_bytes), 125.51);
  EXPECT_EQ(gib(row(deepspeed_zero3_estimate(kLlama7B, kLlama7BLargest, 1, 1), "offload_param=none, offload_optimizer=none, zero_init=1").gpu_bytes), 113.45);
  // DeepSpeed's memory.rst table: P = 2851e6, L = 32e6, 1 node x 8 GPUs.
  auto z3 = deepspeed_zero3_estimate(2851000000, 32000000, 8, 1);
  const std::vector<std::pair<double, double>> docs = {{71.69, 0.12}, {127.45, 0.12}, {63.72, 0.78},
                                                       {127.45, 0.78}, {1.43, 6.09},  {127.45, 6.09}};
  for (size_t i = 0; i < docs.size(); ++i) {
    EXPECT_EQ(gib(z3[i].cpu_bytes), docs[i].first) << z3[i].options;
    EXPECT_EQ(gib(z3[i].gpu_bytes), docs[i].second) << z3[i].options;
  }
  EXPECT_EQ(gib(row(deepspeed_zero2_estimate(2851000000, 8, 1), "offload_optimizer=cpu").cpu_bytes), 127.45);
  EXPECT_EQ(gib(row(deepspeed_zero2_estimate(2851000000, 8, 1), "offload_optimizer=cpu").gpu_bytes), 5.31);
}

namespace {
Topology gpus(int per_node, int nodes, double memory) {
  Topology t;
  t.device = DeviceKind::cuda;
  t.ranks_per_node = per_node;
  t.num_nodes = nodes;
  t.world_size = per_node * nodes;
  t.device_memory_bytes = memory;
  t.world_size_source = "--gpus x --nodes";
  return t;
}
const char* kCfg = R"({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true}, "model": {"preset": "llama-2-7b"},
                       "data": {"seq_len": 1024}, "zero_optimization": {"offload_optimizer": {"device": "none"},
                       "offload_param": {"device": "none"}}})";
}  // namespace

TEST(MemoryEstimateTable, EveryRowIsWhatThePlanSays) {
  Config base = load_config_text(kCfg, "t");
  ModelSpec m = build_model_spec(resolve_model_hyper(base.model));
  Topology topo = gpus(8, 1, 80.0 * (1 << 30));
  MemoryEstimateTable t = estimate_memory_table(base, m, topo, {});
  ASSERT_EQ(t.rows.size(), 20u);
  for (const auto& r : t.rows) {
    std::vector<std::string> o = {"zero_optimization.stage=" + std::to_string(r.choice.stage),
                                  std::string("zero_optimization.offload_optimizer.device=") + offload_device_name(r.choice.offload_optimizer),
                                  std::string("zero_optimization.offload_param.device=") + offload_device_name(r.choice.offload_param),
                                  std::string("model.activation_checkpointing=") + (r.choice.activation_checkpointing ? "true" : "false"),
                                  "zero_optimization.offload_optimizer.nvme_path=/x", "zero_optimization.offload_param.nvme_path=/x"};
    Config c = load_config_text(kCfg, "t", o);
    Plan p = compile_plan(c, m, topo);
    EXPECT_DOUBLE_EQ(p.memory.device.total(), r.device_per_rank) << r.overrides;
    EXPECT_DOUBLE_EQ(p.memory.host.total() * 8, r.host_per_node) << r.overrides;
  }
}

TEST(MemoryEstimateTable, StatesMatchAnIndependentCount) {
  // ZeRO-2 on 8 GPUs, bf16 + AdamW: params 2P, grads 2S, optimizer 12S, S = P rounded up to 16, / 8.
  Config base = load_config_text(kCfg, "t");
  ModelSpec m = build_model_spec(resolve_model_hyper(base.model));
  EstimateFilter f;
  f.stage = 2;
  f.offload = OffloadDevice::none;
  f.activation_checkpointing = false;
  MemoryEstimateTable t = estimate_memory_table(base, m, gpus(8, 1, 0), f);
  ASSERT_EQ(t.rows.size(), 1u);
  const double P = 6738415616.0, S = std::ceil(P / 16) * 16 / 8;
  EXPECT_DOUBLE_EQ(t.rows[0].memory.device.params, 2 * P);
  EXPECT_DOUBLE_EQ(t.rows[0].memory.device.grads, 2 * S);
  EXPECT_DOUBLE_EQ(t.rows[0].memory.device.optimizer_states, 12 * S);
  EXPECT_FALSE(t.rows[0].fits_device.has_value());  // no memory given: no verdict
  EXPECT_EQ(t.recommended, -1);
}

TEST(MemoryEstimateTable, RecommendsTheFastestRowThatFits) {
  Config base = load_config_text(kCfg, "t");
  ModelSpec m = build_model_spec(resolve_model_hyper(base.model));
  MemoryEstimateTable big = estimate_memory_table(base, m, gpus(8, 1, 80.0 * (1 << 30)), {});
  ASSERT_GE(big.recommended, 0);
  const auto& rec = big.rows[big.recommended];
  EXPECT_TRUE(rec.fits());
  for (int i = 0; i < big.recommended; ++i) EXPECT_FALSE(big.rows[i].fits()) << big.rows[i].overrides;
  EXPECT_EQ(rec.choice.offload_optimizer, OffloadDevice::none);  // 80 GiB needs no offload for 7B on 8 GPUs
  // 8 GiB: only rows with the optimizer offloaded fit (on a GPU each rank's gradient partition then lives on
  // the host with the states, as DeepSpeed's ZeRO-Offload keeps it).
  MemoryEstimateTable small = estimate_memory_table(base, m, gpus(8, 1, 8.0 * (1 << 30)), {});
  ASSERT_GE(small.recommended, 0);
  EXPECT_NE(small.rows[small.recommended].choice.offload_optimizer, OffloadDevice::none);
  EXPECT_EQ(estimate_memory_table(base, m, gpus(1, 1, 1.0 * (1 << 30)), {}).recommended, -1);
  // Every row says whether this ds trains it on those GPUs today: 8 ranks are refused (no NCCL named), offloaded
  // or not, for that reason alone.
  for (const EstimateRow& r : small.rows) {
    ASSERT_EQ(r.not_yet.size(), 1u) << r.overrides;
    EXPECT_NE(r.not_yet[0].find("no NCCL communicator"), std::string::npos) << r.not_yet[0];
  }
  EXPECT_EQ(small.runnable, -1);
  // One GPU trains every row, offloaded or not; 1 GiB fits none.
  MemoryEstimateTable one = estimate_memory_table(base, m, gpus(1, 1, 160.0 * (1 << 30)), {});
  for (const EstimateRow& r : one.rows) EXPECT_TRUE(r.not_yet.empty()) << r.overrides;
  ASSERT_GE(one.runnable, 0);
  EXPECT_EQ(one.runnable, one.recommended);
}

// With the optimizer offloaded from stage 2 on, a GPU rank's gradient partition is on the host, beside the
// states (DeepSpeed's ZeRO-Offload): the device holds the block buffers only. On the CPU nothing moves.
TEST(MemoryEstimateTable, OffloadedGradientsLiveOnTheHostOfAGpuRank) {
  Config base = load_config_text(kCfg, "t");
  ModelSpec m = build_model_spec(resolve_model_hyper(base.model));
  EstimateFilter f;
  f.stage = 3;
  f.offload = OffloadDevice::cpu;
  f.activation_checkpointing = true;
  const MemoryEstimateTable t = estimate_memory_table(base, m, gpus(8, 1, 24.0 * (1 << 30)), f);
  ASSERT_FALSE(t.rows.empty());
  for (const EstimateRow& r : t.rows) {
    EXPECT_EQ(r.memory.device.grads, 0.0) << r.overrides;
    EXPECT_GT(r.memory.host.grads, 0.0) << r.overrides;
  }
}

TEST(MemoryEstimateTable, SpeedOrderPrefersLessOffloadThenLowerStageThenNoRecompute) {
  EXPECT_LT(speed_rank_of({2, OffloadDevice::none, OffloadDevice::none, false}),
            speed_rank_of({0, OffloadDevice::none, OffloadDevice::none, true}));
  EXPECT_LT(speed_rank_of({2, OffloadDevice::none, OffloadDevice::none, true}),
            speed_rank_of({3, OffloadDevice::none, OffloadDevice::none, false}));
  EXPECT_LT(speed_rank_of({3, OffloadDevice::none, OffloadDevice::none, true}),
            speed_rank_of({2, OffloadDevice::cpu, OffloadDevice::none, false}));
  EXPECT_LT(speed_rank_of({3, OffloadDevice::cpu, OffloadDevice::cpu, true}),
            speed_rank_of({3, OffloadDevice::nvme, OffloadDevice::none, false}));
}

// The mesh recommended beside the rows: it fits, and no mesh of fewer GPUs per copy of the model does (every
// tensor size within a node x every pipeline length, with recomputation and without, tried here).
TEST(MeshRecommendation, TheSmallestMeshThatFitsAndNothingSmallerDoes) {
  const std::string cfg = R"({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true}, "model": {"preset": "llama-3-70b"},
                              "data": {"seq_len": 4096}})";
  const Config base = load_config_text(cfg, "t");
  const ModelSpec m = build_model_spec(resolve_model_hyper(base.model));
  const Topology cluster = gpus(8, 4, 80.0 * (1 << 30));
  const std::optional<MeshChoice> mesh = recommend_mesh(base, m, cluster);
  ASSERT_TRUE(mesh.has_value());
  const Plan chosen = compile_plan(with_mesh(base, mesh->tensor, mesh->pipeline, mesh->activation_checkpointing), m, cluster);
  EXPECT_LE(chosen.memory.device.total(), 0.9 * cluster.device_memory_bytes);
  EXPECT_DOUBLE_EQ(chosen.memory.device.total(), mesh->device_per_rank);
  EXPECT_EQ(chosen.zero_stage(), 1);
  // The same overrides, read as a user's ds plan reads them, give the same plan.
  std::vector<std::string> overrides;
  for (size_t at = 0, next; at < mesh->overrides.size(); at = next + 1) {
    next = mesh->overrides.find(' ', at);
    if (next == std::string::npos) next = mesh->overrides.size();
    overrides.push_back(mesh->overrides.substr(at, next - at));
  }
  EXPECT_DOUBLE_EQ(compile_plan(load_config_text(cfg, "t", overrides), m, cluster).memory.device.total(), mesh->device_per_rank);
  int smaller = 0;
  for (int t : {1, 2, 4, 8})
    for (int p = 1; p <= 32 / t; ++p) {
      if ((32 / t) % p != 0 || t * p >= mesh->tensor * mesh->pipeline || t * p == 1) continue;
      for (bool ckpt : {false, true}) {
        try {
          const Plan smaller_plan = compile_plan(with_mesh(base, t, p, ckpt), m, cluster);
          EXPECT_GT(smaller_plan.memory.device.total(), 0.9 * cluster.device_memory_bytes) << "tensor " << t << " x pipeline " << p;
          ++smaller;
        } catch (const ConfigError&) {
        }
      }
    }
  EXPECT_GT(smaller, 0);
  // Without the GPUs' memory there is nothing to judge a fit by: no recommendation.
  EXPECT_FALSE(recommend_mesh(base, m, gpus(8, 4, 0)).has_value());
}

// Told the GPUs' and links' rates, the recommendation is the mesh that fits with the most predicted tokens/s
// (meshes run different micro-batches per step, so throughput, not the step, is compared), every candidate
// tried here; the rows carry their predicted throughput, offload rows none until the host's memory and the
// drives' rates are given, then every row, fastest first.
TEST(MeshRecommendation, WithTheHardwaresRatesTheFastestPredictedMeshThatFitsIsChosen) {
  const std::string cfg = R"({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true}, "model": {"preset": "llama-3-70b"},
                              "data": {"seq_len": 4096}})";
  const Config base = load_config_text(cfg, "t");
  const ModelSpec m = build_model_spec(resolve_model_hyper(base.model));
  Topology cluster = gpus(8, 4, 80.0 * (1 << 30));
  cluster.rates.gpu = "test GPU";
  cluster.rates.peak_flops_16bit = 1e15;
  cluster.rates.intra_node = {"nvlink", 300e9, 10e-6};
  cluster.rates.inter_node = {"ib", 40e9, 30e-6};
  const std::optional<MeshChoice> mesh = recommend_mesh(base, m, cluster);
  ASSERT_TRUE(mesh.has_value());
  EXPECT_TRUE(mesh->fastest);
  double best = 0;
  int fitting = 0;
  for (int t : {1, 2, 4, 8})
    for (int p = 1; p <= 32 / t; ++p) {
      if ((32 / t) % p != 0 || t * p == 1) continue;
      for (bool ckpt : {false, true}) {
        try {
          const Plan plan = compile_plan(with_mesh(base, t, p, ckpt), m, cluster);
          if (plan.memory.device.total() > 0.9 * cluster.device_memory_bytes) continue;
          ASSERT_TRUE(plan.step_time.step_known());
          ++fitting;
          best = std::max(best, static_cast<double>(plan.tokens_per_step) / plan.step_time.step_s());
        } catch (const ConfigError&) {
        }
      }
    }
  EXPECT_GT(fitting, 1);  // a real choice
  EXPECT_DOUBLE_EQ(mesh->tokens_per_s, best);
  const Plan chosen = compile_plan(with_mesh(base, mesh->tensor, mesh->pipeline, mesh->activation_checkpointing), m, cluster);
  EXPECT_DOUBLE_EQ(mesh->step_s, chosen.step_time.step_s());

  const MemoryEstimateTable table = estimate_memory_table(load_config_text(kCfg, "t"), build_model_spec(resolve_model_hyper(load_config_text(kCfg, "t").model)), cluster);
  double faster = 1e300;
  bool offload_seen = false;
  for (const EstimateRow& r : table.rows) {
    const bool offload = r.choice.offload_optimizer != OffloadDevice::none || r.choice.offload_param != OffloadDevice::none;
    EXPECT_EQ(r.step_s > 0, !offload) << r.overrides;
    if (r.step_s > 0) {
      EXPECT_DOUBLE_EQ(r.tokens_per_s, 32.0 * 1024 / r.step_s) << r.overrides;  // 32 GPUs x micro 1 x 1024 tokens
      EXPECT_LE(r.tokens_per_s, faster) << r.overrides;  // fastest first
      EXPECT_FALSE(offload_seen) << r.overrides;         // before the rows it cannot predict
      faster = r.tokens_per_s;
    }
    offload_seen = offload_seen || offload;
  }
  EXPECT_TRUE(offload_seen);
  cluster.rates.host_link = {"pcie5", 50e9, 10e-6};
  cluster.rates.host_memory_bw = 200e9;
  cluster.rates.nvme_bw = 6e9;
  const MemoryEstimateTable rated = estimate_memory_table(load_config_text(kCfg, "t"), build_model_spec(resolve_model_hyper(load_config_text(kCfg, "t").model)), cluster);
  ASSERT_EQ(rated.rows.size(), table.rows.size());
  faster = 1e300;
  for (const EstimateRow& r : rated.rows) {
    ASSERT_GT(r.step_s, 0) << r.overrides;
    EXPECT_LE(r.tokens_per_s, faster) << r.overrides;
    faster = r.tokens_per_s;
  }
}

// Rows for a mesh: each the heaviest stage's GPU, a pipeline's stopping at ZeRO stage 1.
TEST(MeshRecommendation, RowsForAMeshAreTheHeaviestStagesAndAPipelineStopsAtStageOne) {
  Config base = load_config_text(kCfg, "t", {"tensor_parallel.autotp_size=2", "pipeline.stages=2", "gradient_accumulation_steps=2"});
  const ModelSpec m = build_model_spec(resolve_model_hyper(base.model));
  const MemoryEstimateTable t = estimate_memory_table(base, m, gpus(8, 1, 80.0 * (1 << 30)), {});
  ASSERT_FALSE(t.rows.empty());
  for (const EstimateRow& r : t.rows) {
    EXPECT_LE(r.choice.stage, 1) << r.overrides;
    std::vector<std::string> o = {"tensor_parallel.autotp_size=2", "pipeline.stages=2", "gradient_accumulation_steps=2",
                                  "zero_optimization.stage=" + std::to_string(r.choice.stage),
                                  std::string("zero_optimization.offload_optimizer.device=") + offload_device_name(r.choice.offload_optimizer),
                                  std::string("model.activation_checkpointing=") + (r.choice.activation_checkpointing ? "true" : "false")};
    const Plan p = compile_plan(load_config_text(kCfg, "t", o), m, gpus(8, 1, 80.0 * (1 << 30)));
    const PipelineStage& heaviest = p.mesh.stages.at(static_cast<size_t>(p.mesh.heaviest_stage));
    EXPECT_DOUBLE_EQ(r.device_per_rank, heaviest.memory.device.total()) << r.overrides;
  }
  EXPECT_TRUE(t.deepspeed.empty());  // DeepSpeed's estimators know no mesh
}

// "auto" micro batch with a mesh is chosen by the memory of a rank of the heaviest stage, not of the whole model.
TEST(MeshRecommendation, AnAutoMicroBatchIsJudgedOnTheMeshsHeaviestStage) {
  const std::string cfg = R"({"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": true}, "model": {"preset": "llama-3-70b",
                              "activation_checkpointing": true}, "data": {"seq_len": 4096}, "zero_optimization": {"stage": 1},
                              "tensor_parallel": {"autotp_size": 8}, "pipeline": {"stages": 2}, "gradient_accumulation_steps": 16})";
  const Config c = load_config_text(cfg, "t");
  const ModelSpec m = build_model_spec(resolve_model_hyper(c.model));
  const Topology cluster = gpus(8, 4, 80.0 * (1 << 30));
  const Plan p = compile_plan(c, m, cluster);
  EXPECT_GT(p.batch.micro_batch, 1);  // the whole model fits no micro batch at all on 80 GiB
  EXPECT_LE(p.memory.device.total(), 0.9 * cluster.device_memory_bytes);
  const Plan twice = compile_plan(load_config_text(cfg, "t", {"train_micro_batch_size_per_gpu=" + std::to_string(2 * p.batch.micro_batch)}), m,
                                  cluster);
  EXPECT_GT(twice.memory.device.total(), 0.9 * cluster.device_memory_bytes);  // the next power of two does not fit
}
