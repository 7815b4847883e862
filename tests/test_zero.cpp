// Several ranks as real processes (`ds train --nproc-per-node N`): ZeRO stages 1-3 train the same run
// as one rank with the same global batch, send what the plan says, shard checkpoints that resume at
// another world size, and a dead rank ends every rank.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_helpers.hpp"
#include "engine/runtime/io/checkpoint.hpp"
#include "engine/runtime/io/safetensors.hpp"

using namespace cli_test;
using nlohmann::json;

namespace {

std::vector<double> losses_of(const std::string& run) {
  std::vector<double> out;
  for (const json& m : metrics_of(run)) out.push_back(m["loss"].get<double>());
  return out;
}

// The whole model's weights and moments from a run's newest checkpoint, whatever its world size.
struct WholeState {
  std::vector<float> master, exp_avg, exp_avg_sq;
};
WholeState whole_state(const std::string& run, const std::string& run_with_plan = "") {
  const std::string planned = run_with_plan.empty() ? run : run_with_plan;
  const int64_t P = json::parse(slurp(planned + "/plan.json"))["layout"]["numel"].get<int64_t>();
  WholeState w{std::vector<float>(P), std::vector<float>(P), std::vector<float>(P)};
  ds::CheckpointBuffers b{w.master.data(), w.exp_avg.data(), w.exp_avg_sq.data(), P, {ds::OwnedSegment{0, 0, 0, P}}, P};
  ds::load_checkpoint(ds::find_latest_checkpoint(run), b);
  return w;
}

void expect_close(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  size_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::fabs(a[i] - b[i]) > 1e-5f * (1 + std::fabs(a[i])) && bad++ < 3)
      ADD_FAILURE() << what << "[" << i << "] " << a[i] << " vs " << b[i];
}

// A run's newest checkpoint holds `base`'s weights and moments (to 1e-5), and `ds convert-ckpt` consolidates
// exactly those weights (tensor by tensor from the shards: what a resume loads). `planned_by`: the run whose
// plan.json gives the whole model's layout (a tensor-parallel run's own has its rank's share).
void expect_state_and_export(const std::string& dir, const WholeState& base, const std::string& planned_by = "") {
  const WholeState state = whole_state(dir, planned_by);
  expect_close(state.master, base.master, "weights");
  expect_close(state.exp_avg, base.exp_avg, "exp_avg");
  expect_close(state.exp_avg_sq, base.exp_avg_sq, "exp_avg_sq");
  Result c = cli_test::ds("convert-ckpt " + dir + " " + dir + "/consolidated.safetensors");
  ASSERT_EQ(c.code, 0) << c.err;
  ds::SafetensorsFile file(dir + "/consolidated.safetensors");
  std::vector<float> consolidated;
  for (const ds::StTensor& t : file.view().tensors()) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    file.view().read_f32(t, v.data());
    consolidated.insert(consolidated.end(), v.begin(), v.end());
  }
  EXPECT_TRUE(consolidated == state.master) << "the consolidated file differs from the checkpoint's weights";
}

// Global batch 24 per step (micro x accumulation x ranks), gradient clipping on (quickstart: 1.0),
// small buckets so every group is reduced and gathered in several pieces, and partitioned stage-3
// parameters ("auto" keeps only biases and norms whole; DeepSpeed's 1e5 would keep this tiny model whole).
const std::string kRun =
    "train examples/quickstart.json bf16.enabled=false train.eval_every=0 train_batch_size=24 "
    "scheduler.params.total_num_steps=10 scheduler.params.warmup_num_steps=3 zero_optimization.reduce_bucket_size=20000 "
    "zero_optimization.allgather_bucket_size=30000 zero_optimization.stage3_param_persistence_threshold=auto ";

std::string shape(int ranks) {  // micro batch and accumulation for 24 samples per step
  switch (ranks) {
    case 1: return "train_micro_batch_size_per_gpu=8 gradient_accumulation_steps=3 ";
    case 2: return "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 --nproc-per-node 2 ";
    case 3: return "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=2 --nproc-per-node 3 ";
    default: return "train_micro_batch_size_per_gpu=3 gradient_accumulation_steps=2 --nproc-per-node 4 ";
  }
}

const std::string& single_rank_run() {
  static const std::string dir = [] {
    const std::string d = scratch_dir() + "/one_rank";
    Result r = cli_test::ds(kRun + shape(1) + "train.steps=10 train.output_dir=" + d);
    EXPECT_EQ(r.code, 0) << r.err;
    return d;
  }();
  return dir;
}

void expect_same_run_as_one_rank(int ranks) {
  const std::string& one = single_rank_run();
  const auto base = losses_of(one);
  ASSERT_EQ(base.size(), 10u);
  const WholeState base_state = whole_state(one);
  for (int stage : {1, 2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage) + " on " + std::to_string(ranks) + " ranks");
    const std::string dir = scratch_dir() + "/z" + std::to_string(stage) + "_" + std::to_string(ranks);
    // overlap_comm (reduces in flight during backward) takes DeepSpeed's default (stage 3 only) except on
    // 3 ranks, where it is flipped; on 4 ranks, stages 2-3 recompute each block in its backward
    // (activation checkpointing, inside the ZeRO hooks).
    std::string overlap = ranks == 3 ? std::string(" zero_optimization.overlap_comm=") + (stage == 3 ? "false" : "true") : "";
    if (ranks == 4 && stage >= 2) overlap += " model.activation_checkpointing=true";
    Result r = cli_test::ds(kRun + shape(ranks) + "train.steps=10 comms_logger.enabled=true zero_optimization.stage=" +
                            std::to_string(stage) + overlap + " train.output_dir=" + dir);
    ASSERT_EQ(r.code, 0) << r.err;
    const auto losses = losses_of(dir);
    ASSERT_EQ(losses.size(), base.size());
    for (size_t i = 0; i < base.size(); ++i) EXPECT_NEAR(losses[i], base[i], 1e-5 * base[i]) << "step " << i + 1;
    expect_state_and_export(dir, base_state);
    // Bytes sent per step are the plan's, collective for collective.
    double planned = 0;
    const json plan = json::parse(slurp(dir + "/plan.json"));
    for (const json& c : plan["collectives"]) planned += c["wire_bytes_per_rank_per_step"].get<double>();
    for (const json& m : metrics_of(dir)) EXPECT_NEAR(m["comm_bytes"].get<double>(), planned, 1.0) << "step " << m["step"];
    const std::string log = slurp(dir + "/train.log");
    EXPECT_TRUE(contains(log, "ZeRO stage " + std::to_string(stage) + " on " + std::to_string(ranks) + " ranks")) << log;
    EXPECT_TRUE(contains(log, "comms step 1: loss, norm and stop flag 1x") && contains(log, " | gradients "))
        << log;  // comms_logger's per-step line, in the plan's order
  }
}

}  // namespace

TEST(Zero, EveryStageOnTwoRanksTrainsTheSingleRankRun) { expect_same_run_as_one_rank(2); }
TEST(Zero, EveryStageOnThreeRanksTrainsTheSingleRankRun) { expect_same_run_as_one_rank(3); }
TEST(Zero, EveryStageOnFourRanksTrainsTheSingleRankRun) { expect_same_run_as_one_rank(4); }

TEST(Zero, AtStageThreeAFrozenBaseIsPartitionedGatheredWithItsBlockAndTrainsTheOneRankRun) {
  // LoRA on every projection, and model.freeze of the first block: the frozen matrices inside the blocks are
  // each rank's partitions at stage 3, gathered as their block runs ("auto" keeps norms and biases whole).
  const std::string lora = R"('model.lora={"r": 4, "alpha": 8, "target_modules": ["c_attn", "c_proj", "c_fc"]}' )";
  const std::string freeze = R"('model.freeze=["transformer.wte.weight", "transformer.h.0.*"]' )";
  for (const std::string& frozen : {lora, freeze}) {
    SCOPED_TRACE(frozen);
    const std::string one = scratch_dir() + "/frozen1", two = scratch_dir() + "/frozen2";
    std::filesystem::remove_all(one);
    std::filesystem::remove_all(two);
    Result r1 = cli_test::ds(kRun + shape(1) + frozen + "train.steps=6 train.output_dir=" + one);
    ASSERT_EQ(r1.code, 0) << r1.err;
    Result r2 = cli_test::ds(kRun + shape(2) + frozen + "train.steps=6 zero_optimization.stage=3 train.output_dir=" + two);
    ASSERT_EQ(r2.code, 0) << r2.err;
    const auto a = losses_of(one), b = losses_of(two);
    ASSERT_EQ(a.size(), 6u);
    ASSERT_EQ(b.size(), 6u);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 1e-5 * a[i]) << "step " << i + 1;
    expect_close(whole_state(two).master, whole_state(one).master, "trained weights");
    // Each rank held part of the base, and sent per step what the plan said, the base's gathers included.
    const json plan = json::parse(slurp(two + "/plan.json"));
    const json& z = plan["zero_execution"];
    EXPECT_GT(z["frozen_partitioned_numel"].get<int64_t>(), 0);
    const int64_t whole = z["frozen_whole_numel"].get<int64_t>(), partitioned = z["frozen_partitioned_numel"].get<int64_t>();
    for (const json& buf : z["buffers"]) {
      if (buf["role"] == "frozen_params") {
        EXPECT_EQ(buf["elements"].get<int64_t>(), whole);
      }
      if (buf["role"] == "frozen_partitions") {  // half of each partitioned one (padded: a little more)
        EXPECT_GE(buf["elements"].get<int64_t>(), partitioned / 2);
        EXPECT_LT(buf["elements"].get<int64_t>(), partitioned);
      }
    }
    double planned = 0, frozen_gathers = 0;
    for (const json& c : plan["collectives"]) {
      planned += c["wire_bytes_per_rank_per_step"].get<double>();
      if (c["what"] == "frozen parameters (both passes)") frozen_gathers = c["wire_bytes_per_rank_per_step"].get<double>();
    }
    EXPECT_GT(frozen_gathers, 0);
    for (const json& m : metrics_of(two)) EXPECT_NEAR(m["comm_bytes"].get<double>(), planned, 1.0) << "step " << m["step"];
  }
}

TEST(Zero, EachFamilyAtStageThreeWithOffloadAndRecomputationTrainsItsOneRankRunWholeAndWithLora) {
  // Every family's own pieces (biases, per-head norms, sandwich norms, windows shorter than the sequence, capped
  // scores and logits, longrope, tied tables) through the partitioned path: parameters gathered block by block
  // from host memory, the optimizer on the host, each block recomputed in its backward; and LoRA with the
  // family's default modules (PEFT has none for Phi-3: named) over a partitioned frozen base.
  struct Family {
    std::string name, model, lora_targets;
  };
  const std::string longrope = R"( 'model.rope_scaling={"type": "longrope", "short_factor": [1, 1.2, 1.5, 2, 3, 4, 6, 8], )"
                               R"("long_factor": [1, 2, 3, 5, 8, 13, 21, 34], "original_max_position_embeddings": 32}')";
  const std::vector<Family> families = {
      {"llama", "model.preset=llama-tiny model.attention_bias=true model.mlp_bias=true model.head_dim=24", ""},
      {"mistral", "model.preset=mistral-tiny model.sliding_window=8", ""},
      {"qwen2", "model.preset=qwen2-tiny", ""},
      {"qwen3", "model.preset=qwen3-tiny model.attention_bias=true", ""},
      {"phi3", "model.preset=phi3-tiny model.sliding_window=10" + longrope, R"(, "target_modules": ["qkv_proj", "gate_up_proj"])"},
      {"gemma", "model.preset=gemma-tiny", ""},
      {"gemma2", "model.preset=gemma2-tiny", ""}};
  for (const Family& f : families) {
    for (const bool lora : {false, true}) {
      SCOPED_TRACE(f.name + (lora ? " with LoRA" : ""));
      const std::string base = kRun + f.model + " train_batch_size=16 train.steps=6 " +
                               (lora ? R"('model.lora={"r": 4, "alpha": 8)" + f.lora_targets + "}' " : std::string());
      const std::string one = scratch_dir() + "/fam1_" + f.name + (lora ? "_lora" : ""),
                        two = scratch_dir() + "/fam2_" + f.name + (lora ? "_lora" : "");
      Result r1 = cli_test::ds(base + "train_micro_batch_size_per_gpu=8 gradient_accumulation_steps=2 train.output_dir=" + one);
      ASSERT_EQ(r1.code, 0) << r1.err;
      Result r2 = cli_test::ds(base + "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=2 --nproc-per-node 2 "
                                      "zero_optimization.stage=3 zero_optimization.offload_optimizer.device=cpu "
                                      "zero_optimization.offload_param.device=cpu model.activation_checkpointing=true "
                                      "train.output_dir=" + two);
      ASSERT_EQ(r2.code, 0) << r2.err;
      const auto a = losses_of(one), b = losses_of(two);
      ASSERT_EQ(a.size(), 6u);
      ASSERT_EQ(b.size(), 6u);
      EXPECT_GT(std::fabs(a.back() - a.front()), 1e-4);  // the weights moved, so the comparison below means something
      for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 1e-5 * a[i]) << "step " << i + 1;
      const WholeState s1 = whole_state(one), s2 = whole_state(two);
      expect_close(s2.master, s1.master, "weights");
      expect_close(s2.exp_avg_sq, s1.exp_avg_sq, "exp_avg_sq");
      const json plan = json::parse(slurp(two + "/plan.json"));
      const json& z = plan["zero_execution"];  // each rank held a part of what it trained, or of the frozen base
      if (lora) {
        EXPECT_GT(z["frozen_partitioned_numel"].get<int64_t>(), 0) << z.dump();
      } else {
        EXPECT_LT(z["local_numel"].get<int64_t>(), z["full_numel"].get<int64_t>()) << z.dump();
      }
    }
  }
}

TEST(Zero, LambTakesEachTensorsTrustRatioOverItsPartsOnEveryRank) {
  // Lamb's ratio ||w|| / ||u|| is per tensor; split across ranks, each rank's share of the norms is summed
  // before any rank applies its part.
  const std::string lamb = "optimizer.type=Lamb optimizer.params.lr=0.02 ";
  const std::string one = scratch_dir() + "/lamb1";
  Result r1 = cli_test::ds(kRun + lamb + shape(1) + "train.steps=6 train.output_dir=" + one);
  ASSERT_EQ(r1.code, 0) << r1.err;
  // Stage 2 on 2 ranks, stage 3 on 3, a pipeline of 2 stages x data 2 at stage 1 (a stage holds its tensors whole:
  // their norms are summed over its data group only), tensor 2 (a split tensor's norms summed over the tensor
  // group) and tensor 2 x data 2 at stage 2 (over both).
  const std::string four = "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 --nproc-per-node 4 ";
  for (const auto& [name, run] : {std::pair<std::string, std::string>{"z2", shape(2) + "zero_optimization.stage=2 "},
                                  {"z3", shape(3) + "zero_optimization.stage=3 "},
                                  {"p2d2z1", four + "pipeline.stages=2 zero_optimization.stage=1 "},
                                  {"t2", "train_micro_batch_size_per_gpu=8 gradient_accumulation_steps=3 --nproc-per-node 2 "
                                         "tensor_parallel.autotp_size=2 zero_optimization.stage=0 "},
                                  {"t2d2z2", four + "tensor_parallel.autotp_size=2 zero_optimization.stage=2 "}}) {
    SCOPED_TRACE(name);
    const std::string dir = scratch_dir() + "/lamb_" + name;
    Result r = cli_test::ds(kRun + lamb + run + "train.steps=6 train.output_dir=" + dir);
    ASSERT_EQ(r.code, 0) << r.err;
    const auto a = losses_of(one), b = losses_of(dir);
    ASSERT_EQ(b.size(), a.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 1e-5 * a[i]) << "step " << i + 1;
    expect_close(whole_state(dir, one).master, whole_state(one).master, "weights");
    const std::string log = slurp(dir + "/train.log");
    if (name != "t2") {  // over the data group
      EXPECT_TRUE(contains(log, "Lamb tensor norms: 1.0 calls")) << log;
    }
    if (name[0] != 't') continue;
    EXPECT_TRUE(contains(log, "Lamb tensor norms (tensor group): 1.0 calls")) << log;
    // Bytes sent per step: ZeRO's collectives, the tensor group's all-reduces and its Lamb norms, as planned.
    const json plan = json::parse(slurp(dir + "/plan.json"));
    const json& traffic = plan["mesh"]["stages"][0]["traffic_per_rank_per_step"];
    EXPECT_GT(traffic["lamb_bytes"].get<double>(), 0);
    double planned = traffic["tensor_wire_bytes"].get<double>() + traffic["lamb_bytes"].get<double>();
    for (const json& c : plan["collectives"]) planned += c["wire_bytes_per_rank_per_step"].get<double>();
    for (const json& m : metrics_of(dir)) EXPECT_NEAR(m["comm_bytes"].get<double>(), planned, 1.0) << "step " << m["step"];
  }
}

TEST(Zero, Fp16AcrossRanksOverflowsSkipsAndScalesAsOneRankDoes) {
  // fp16 on the CPU: weights and gradients stored in fp16, computed in fp32. A 2^20 initial loss scale
  // overflows the first steps; every rank must see the overflow (the norm is agreed across ranks), skip
  // the same steps, move the scale the same way and then train the same run as one rank.
  const std::string fp16 = "bf16.enabled=false fp16.enabled=true fp16.initial_scale_power=20 train.steps=8 ";
  const std::string one = scratch_dir() + "/fp16_1";
  Result r1 = cli_test::ds(kRun + fp16 + shape(1) + "train.output_dir=" + one);
  ASSERT_EQ(r1.code, 0) << r1.err;
  const auto base = metrics_of(one);
  ASSERT_EQ(base.size(), 8u);
  ASSERT_TRUE(base[0]["skipped"].get<bool>()) << "the scale was meant to overflow step 1";
  ASSERT_TRUE(base[0]["grad_norm"].is_null());  // JSON has no inf
  for (const auto& [ranks, stage] : {std::pair{2, 1}, {2, 2}, {2, 3}, {3, 3}}) {
    SCOPED_TRACE("stage " + std::to_string(stage) + " on " + std::to_string(ranks) + " ranks");
    const std::string dir = scratch_dir() + "/fp16_" + std::to_string(stage) + "_" + std::to_string(ranks);
    Result r = cli_test::ds(kRun + fp16 + shape(ranks) + "zero_optimization.stage=" + std::to_string(stage) + " train.output_dir=" + dir);
    ASSERT_EQ(r.code, 0) << r.err;
    const auto m = metrics_of(dir);
    ASSERT_EQ(m.size(), base.size());
    for (size_t i = 0; i < base.size(); ++i) {
      EXPECT_NEAR(m[i]["loss"].get<double>(), base[i]["loss"].get<double>(), 1e-5 * base[i]["loss"].get<double>()) << "step " << i + 1;
      EXPECT_EQ(m[i]["skipped"], base[i]["skipped"]) << "step " << i + 1;
      EXPECT_EQ(m[i]["loss_scale"], base[i]["loss_scale"]) << "step " << i + 1;
    }
    expect_close(whole_state(dir).master, whole_state(one).master, "weights");
  }
}

TEST(Zero, ACheckpointSavedOnTwoRanksResumesOnThreeAndBack) {
  // 5 steps on one world size and stage, then 5 more on another: the same losses as 10 on one rank.
  const auto base = losses_of(single_rank_run());
  ASSERT_EQ(base.size(), 10u);
  for (const auto& [first, second] : {std::pair{std::string("2 zero_optimization.stage=2"), std::string("3 zero_optimization.stage=3")},
                                      {std::string("3 zero_optimization.stage=3"), std::string("2 zero_optimization.stage=1")}}) {
    SCOPED_TRACE(first + " -> " + second);
    const std::string dir = scratch_dir() + "/elastic_" + first.substr(0, 1);
    auto ranks = [](const std::string& s) { return std::stoi(s.substr(0, 1)); };
    Result a = cli_test::ds(kRun + shape(ranks(first)) + first.substr(2) + " train.steps=5 train.output_dir=" + dir);
    ASSERT_EQ(a.code, 0) << a.err;
    Result b = cli_test::ds(kRun + shape(ranks(second)) + second.substr(2) + " train.steps=10 --resume train.output_dir=" + dir);
    ASSERT_EQ(b.code, 0) << b.err;
    EXPECT_TRUE(contains(b.err, "resuming from")) << b.err;
    const auto losses = losses_of(dir);
    ASSERT_EQ(losses.size(), 10u);
    for (size_t i = 0; i < base.size(); ++i) EXPECT_NEAR(losses[i], base[i], 1e-5 * base[i]) << "step " << i + 1;
  }
}

TEST(Zero, ConvertCkptReshardsACheckpointForAnotherWorldSizeAndStageBitForBit) {
  // 5 steps on 2 ranks at stage 1; sharded by convert-ckpt for 3 ranks at stage 3 and back. The state
  // is the same bits in every layout, each rank's file is its own, and the resharded run resumes to the
  // losses of 10 steps on one rank.
  const auto base = losses_of(single_rank_run());
  const std::string a = scratch_dir() + "/reshard_a", b = scratch_dir() + "/reshard_b", c = scratch_dir() + "/reshard_c";
  Result r = cli_test::ds(kRun + shape(2) + "zero_optimization.stage=1 train.steps=5 train.output_dir=" + a);
  ASSERT_EQ(r.code, 0) << r.err;
  r = cli_test::ds("convert-ckpt " + a + " " + b + " --world-size 3 --stage 3");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string ckpt = "/checkpoints/step_00000005/";
  for (const char* f : {"state.h5", "shard_00001.h5", "shard_00002.h5", "DONE"}) EXPECT_TRUE(std::filesystem::exists(b + ckpt + f)) << f;
  EXPECT_FALSE(std::filesystem::exists(b + ckpt + "shard_00003.h5"));
  r = cli_test::ds("convert-ckpt --info " + b + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json info = json::parse(r.out);
  EXPECT_EQ(info["world_size"], 3);
  EXPECT_EQ(info["zero_stage"], 3);
  const WholeState sa = whole_state(a), sb = whole_state(b, a);
  EXPECT_TRUE(sa.master == sb.master && sa.exp_avg == sb.exp_avg && sa.exp_avg_sq == sb.exp_avg_sq);
  r = cli_test::ds("convert-ckpt " + b + " " + c + " --world-size 2 --stage 1");
  ASSERT_EQ(r.code, 0) << r.err;
  const WholeState sc = whole_state(c, a);
  EXPECT_TRUE(sa.master == sc.master && sa.exp_avg == sc.exp_avg && sa.exp_avg_sq == sc.exp_avg_sq);
  EXPECT_EQ(std::filesystem::file_size(a + ckpt + "shard_00001.h5"), std::filesystem::file_size(c + ckpt + "shard_00001.h5"));
  // Nothing is replaced unasked, and a ds checkpoint has no dtype to convert to.
  r = cli_test::ds("convert-ckpt " + a + " " + b + " --world-size 3");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "already exists")) << r.err;
  r = cli_test::ds("convert-ckpt " + a + " " + scratch_dir() + "/reshard_bf16 --stage 2 --dtype bf16");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "fp32 master weights")) << r.err;
  r = cli_test::ds(kRun + shape(3) + "zero_optimization.stage=3 train.steps=10 --resume train.output_dir=" + b);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(contains(r.err, "differs from the checkpoint's")) << r.err;  // the reshard's config is the run's, sharded
  const auto losses = losses_of(b);
  ASSERT_EQ(losses.size(), 5u);  // the resharded directory's own metrics: steps 6-10
  for (size_t i = 0; i < losses.size(); ++i) EXPECT_NEAR(losses[i], base[i + 5], 1e-5 * base[i + 5]) << "step " << i + 6;
}

// Tensor parallelism over real processes (Gloo): tensor 2 alone, and tensor 2 x data 2 with ZeRO 1 and 3 over the data
// groups, train the one-rank run (the same global batch): per-step losses to 1e-5. Their checkpoint is the whole
// model's (each tensor rank writes its share as the elements of the whole it holds): it holds the one-rank run's
// weights and moments, convert-ckpt consolidates it, and one rank resumes a mesh's checkpoint into the same losses.
TEST(Zero, TensorParallelMeshesTrainTheSingleRankRunIntoTheWholeModelsCheckpoint) {
  const std::string& one = single_rank_run();
  const auto base = losses_of(one);
  ASSERT_EQ(base.size(), 10u);
  const WholeState base_state = whole_state(one);
  struct Mesh {
    std::string name, shape;
  };
  const std::vector<Mesh> meshes = {
      {"t2", "train_micro_batch_size_per_gpu=8 gradient_accumulation_steps=3 --nproc-per-node 2 zero_optimization.stage=0"},
      {"t2d2z1", "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 --nproc-per-node 4 zero_optimization.stage=1"},
      {"t2d2z2", "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 --nproc-per-node 4 zero_optimization.stage=2"},
      {"t2d2z3", "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 --nproc-per-node 4 zero_optimization.stage=3 "
                 "model.activation_checkpointing=true"},
  };
  for (const Mesh& m : meshes) {
    SCOPED_TRACE(m.name);
    const std::string dir = scratch_dir() + "/tp_" + m.name;
    Result r = cli_test::ds(kRun + m.shape + " tensor_parallel.autotp_size=2 train.steps=10 train.save_every=5 train.output_dir=" + dir);
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_TRUE(contains(slurp(dir + "/train.log"), "(tensor 2 x data ")) << slurp(dir + "/train.log");
    const auto losses = losses_of(dir);
    ASSERT_EQ(losses.size(), base.size());
    for (size_t i = 0; i < base.size(); ++i) EXPECT_NEAR(losses[i], base[i], 1e-5 * base[i]) << "step " << i + 1;
    // Bytes sent per step: ZeRO's collectives over the data group and the tensor group's all-reduces, as planned.
    const json plan = json::parse(slurp(dir + "/plan.json"));
    double planned = plan["mesh"]["stages"][0]["traffic_per_rank_per_step"]["tensor_wire_bytes"].get<double>();
    EXPECT_GT(planned, 0);
    for (const json& c : plan["collectives"]) planned += c["wire_bytes_per_rank_per_step"].get<double>();
    for (const json& m : metrics_of(dir)) EXPECT_NEAR(m["comm_bytes"].get<double>(), planned, 1.0) << "step " << m["step"];
    expect_state_and_export(dir, base_state, one);
  }
  // The step-5 checkpoint of tensor 2 x data 2 at stage 3, resumed on one rank: steps 6-10 are the one-rank run's.
  const std::string resumed = scratch_dir() + "/tp_resumed";
  Result r = cli_test::ds(kRun + shape(1) + "train.steps=10 train.output_dir=" + resumed + " train.resume=" + scratch_dir() +
                          "/tp_t2d2z3/checkpoints/step_00000005");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto losses = losses_of(resumed);
  ASSERT_EQ(losses.size(), 5u);
  for (size_t i = 0; i < losses.size(); ++i) EXPECT_NEAR(losses[i], base[i + 5], 1e-5 * base[i + 5]) << "step " << i + 6;
  // And on another mesh: tensor 2 x data 2 at stage 1's step 5, continued by tensor 2 alone at stage 0.
  const std::string remeshed = scratch_dir() + "/tp_remeshed";
  r = cli_test::ds(kRun + meshes[0].shape + " tensor_parallel.autotp_size=2 train.steps=10 train.output_dir=" + remeshed +
                   " train.resume=" + scratch_dir() + "/tp_t2d2z1/checkpoints/step_00000005");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto continued = losses_of(remeshed);
  ASSERT_EQ(continued.size(), 5u);
  for (size_t i = 0; i < continued.size(); ++i) EXPECT_NEAR(continued[i], base[i + 5], 1e-5 * base[i + 5]) << "step " << i + 6;
  // --info says who wrote it.
  r = cli_test::ds("convert-ckpt --info " + scratch_dir() + "/tp_t2d2z1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "saved by    4 ranks (tensor 2 x data 2) at ZeRO stage 1")) << r.out;
  // convert-ckpt reshards a mesh's checkpoint as data parallelism's (3 ranks at stage 3): the same state, bit for bit.
  const std::string resharded = scratch_dir() + "/tp_resharded";
  r = cli_test::ds("convert-ckpt " + scratch_dir() + "/tp_t2d2z1 " + resharded + " --world-size 3 --stage 3");
  ASSERT_EQ(r.code, 0) << r.err;
  const WholeState before = whole_state(scratch_dir() + "/tp_t2d2z1", one), after = whole_state(resharded, one);
  EXPECT_TRUE(before.master == after.master && before.exp_avg == after.exp_avg && before.exp_avg_sq == after.exp_avg_sq);
  // Validation: the data ranks split the held-out rows, each tensor group evaluates its rows together; the same loss.
  double val[2] = {0, 0};
  for (int tp = 0; tp < 2; ++tp) {
    const std::string dir = scratch_dir() + "/tp_val" + std::to_string(tp);
    r = cli_test::ds(kRun + (tp ? meshes[1].shape + " tensor_parallel.autotp_size=2" : shape(1)) +
                     " train.steps=2 train.eval_every=2 train.eval_batches=2 train.output_dir=" + dir);
    ASSERT_EQ(r.code, 0) << r.err;
    val[tp] = metrics_of(dir).back()["val_loss"].get<double>();
  }
  EXPECT_NEAR(val[1], val[0], 1e-5 * val[0]);
  // bf16: the same run within bf16's rounding (the tensor group sums its parts in another order).
  std::vector<double> bf16[2];
  for (int tp = 0; tp < 2; ++tp) {
    const std::string dir = scratch_dir() + "/tp_bf16_" + std::to_string(tp);
    r = cli_test::ds(kRun + (tp ? meshes[2].shape + " tensor_parallel.autotp_size=2" : shape(1)) +
                     " bf16.enabled=true train.steps=10 train.output_dir=" + dir);
    ASSERT_EQ(r.code, 0) << r.err;
    bf16[tp] = losses_of(dir);
  }
  ASSERT_EQ(bf16[1].size(), 10u);
  ASSERT_EQ(bf16[0].size(), 10u);
  for (size_t i = 0; i < 10; ++i) EXPECT_NEAR(bf16[1][i], bf16[0][i], 1e-3 * bf16[0][i]) << "bf16 step " << i + 1;
  // Started from a checkpoint's weights (model.init_from): each tensor rank reads the whole tensors and keeps its
  // share; the first steps' losses are one rank's from the same weights.
  std::vector<double> from[2];
  for (int tp = 0; tp < 2; ++tp) {
    const std::string dir = scratch_dir() + "/tp_init" + std::to_string(tp);
    r = cli_test::ds(kRun + (tp ? meshes[1].shape + " tensor_parallel.autotp_size=2" : shape(1)) + " train.steps=2 model.init_from=" +
                     ds::find_latest_checkpoint(one) + " train.output_dir=" + dir);
    ASSERT_EQ(r.code, 0) << r.err;
    from[tp] = losses_of(dir);
  }
  ASSERT_EQ(from[0].size(), 2u);
  ASSERT_EQ(from[1].size(), 2u);
  EXPECT_LT(from[0][0], base[0] - 0.1);  // the trained weights, not a fresh draw
  for (size_t i = 0; i < 2; ++i) EXPECT_NEAR(from[1][i], from[0][i], 1e-5 * from[0][i]) << "step " << i + 1;
}

TEST(Zero, PipelineMeshesTrainTheSingleRankRunIntoTheWholeModelsCheckpoint) {
  // Real processes over Gloo: pipeline stages alone, with data parallelism under ZeRO 1, and tensor 2 x pipeline 2
  // x data 2 (8 ranks). GPT-2's head is tied: the last stage holds a copy of the token table, whose gradient is
  // summed with the first stage's every step.
  const std::string& one = single_rank_run();
  const auto base = losses_of(one);
  ASSERT_EQ(base.size(), 10u);
  const WholeState base_state = whole_state(one);
  struct Mesh {
    std::string name, shape, says;
  };
  const std::vector<Mesh> meshes = {
      {"p2", "train_micro_batch_size_per_gpu=8 gradient_accumulation_steps=3 --nproc-per-node 2 zero_optimization.stage=0 pipeline.stages=2",
       "(tensor 1 x pipeline 2"},
      {"p2d2z1", "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 --nproc-per-node 4 zero_optimization.stage=1 pipeline.stages=2 "
                 "model.activation_checkpointing=true",
       "(tensor 1 x pipeline 2 x data 2"},
      {"t2p2d2", "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 --nproc-per-node 8 zero_optimization.stage=1 pipeline.stages=2 "
                 "tensor_parallel.autotp_size=2",
       "(tensor 2 x pipeline 2 x data 2"},
  };
  for (const Mesh& m : meshes) {
    SCOPED_TRACE(m.name);
    const std::string dir = scratch_dir() + "/pp_" + m.name;
    Result r = cli_test::ds(kRun + m.shape + " train.steps=10 train.save_every=5 train.output_dir=" + dir);
    ASSERT_EQ(r.code, 0) << r.err;
    const std::string log = slurp(dir + "/train.log");
    EXPECT_TRUE(contains(log, m.says)) << log;
    const auto losses = losses_of(dir);
    ASSERT_EQ(losses.size(), base.size());
    for (size_t i = 0; i < base.size(); ++i) EXPECT_NEAR(losses[i], base[i], 1e-5 * base[i]) << "step " << i + 1;
    // Bytes rank 0 (the first stage) sends per step: its ZeRO collectives, its activations (and their gradients
    // none: the first stage sends no gradient back), the tied table's gradient and the tensor all-reduces, as planned.
    const json plan = json::parse(slurp(dir + "/plan.json"));
    const json& traffic = plan["mesh"]["stages"][0]["traffic_per_rank_per_step"];
    double planned = traffic["pipeline_bytes"].get<double>() + traffic["tied_bytes"].get<double>() + traffic["tensor_wire_bytes"].get<double>() +
                     traffic["zero_wire_bytes"].get<double>();  // (the plan's collectives are its heaviest stage's)
    EXPECT_GT(traffic["pipeline_bytes"].get<double>(), 0);
    EXPECT_GT(traffic["tied_bytes"].get<double>(), 0);
    for (const json& c : plan["collectives"])
      if (c["what"] == "loss, norm and stop flag") planned += c["wire_bytes_per_rank_per_step"].get<double>();
    for (const json& x : metrics_of(dir)) EXPECT_NEAR(x["comm_bytes"].get<double>(), planned, 1.0) << "step " << x["step"];
    EXPECT_TRUE(contains(log, "pipeline activations: 3.0 calls")) << log;  // the run report's row beside the plan's
    // The stage's measured idle share beside the plan's bubble (p 2, m 3: 25%): a share of the step, whatever the machine.
    const std::string said = "stage 0 waited for the other stages (their activations, gradients, the step's end) ";
    const size_t waited = log.find(said);
    ASSERT_NE(waited, std::string::npos) << log;
    char* end = nullptr;
    const double share = std::strtod(log.c_str() + waited + said.size(), &end);
    EXPECT_EQ(*end, '%') << log.substr(waited, 200);
    EXPECT_GE(share, 0.0);
    EXPECT_LE(share, 100.0);
    EXPECT_TRUE(contains(log, "the plan's bubble: 25.0%, (p - 1) / (m + p - 1) with p 2, m 3")) << log;
    expect_state_and_export(dir, base_state, one);
  }
  Result info = cli_test::ds("convert-ckpt --info " + scratch_dir() + "/pp_t2p2d2");
  ASSERT_EQ(info.code, 0) << info.err;
  EXPECT_TRUE(contains(info.out, "saved by    8 ranks (tensor 2 x pipeline 2 x data 2) at ZeRO stage 1")) << info.out;
  info = cli_test::ds("convert-ckpt --info --json " + scratch_dir() + "/pp_t2p2d2");
  ASSERT_EQ(info.code, 0) << info.err;
  const json saved = json::parse(info.out);
  EXPECT_EQ(saved["world_size"], 8);
  EXPECT_EQ(saved["data_parallel"], 2);
  // Resharded for 2 data ranks, the command it prints resumes it from the run's own config (which names its mesh
  // and batch shape): the overrides it gives are all the new shape needs.
  const std::string two = scratch_dir() + "/pp_resharded2";
  Result c = cli_test::ds("convert-ckpt " + scratch_dir() + "/pp_t2p2d2/checkpoints/step_00000005 " + two + " --world-size 2");
  ASSERT_EQ(c.code, 0) << c.err;
  const size_t at = c.err.find("resume it: ds train CONFIG ");
  ASSERT_NE(at, std::string::npos) << c.err;
  const std::string resume = c.err.substr(at + 27, c.err.find('\n', at) - at - 27);
  for (const char* o : {"pipeline.stages=1", "tensor_parallel.autotp_size=1", "train_batch_size=24", "--nproc-per-node 2", "--resume"})
    EXPECT_TRUE(contains(resume, o)) << resume;
  c = cli_test::ds(kRun + meshes[2].shape.substr(0, meshes[2].shape.find("--nproc")) + "pipeline.stages=2 tensor_parallel.autotp_size=2 "
                   "train.steps=10 " + resume);
  ASSERT_EQ(c.code, 0) << c.err;
  const auto continued = losses_of(two);
  ASSERT_EQ(continued.size(), 5u);
  for (size_t i = 0; i < continued.size(); ++i) EXPECT_NEAR(continued[i], base[i + 5], 1e-5 * base[i + 5]) << "step " << i + 6;
  // The 2 x 2 x 2 mesh's step-5 checkpoint resumed on one rank, and on pipeline 2 x data 2 at ZeRO stage 0: steps 6-10
  // are the one-rank run's.
  for (const std::string& shape_then : {shape(1), std::string("train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 "
                                                              "--nproc-per-node 4 pipeline.stages=2 zero_optimization.stage=0 ")}) {
    SCOPED_TRACE(shape_then);
    const std::string resumed = scratch_dir() + "/pp_resumed" + std::to_string(shape_then.size());
    Result r = cli_test::ds(kRun + shape_then + "train.steps=10 train.output_dir=" + resumed + " train.resume=" + scratch_dir() +
                            "/pp_t2p2d2/checkpoints/step_00000005");
    ASSERT_EQ(r.code, 0) << r.err;
    // The same global batch on another mesh: its micro batch and mesh keys changed, not the run (only
    // train.save_every, which this resume leaves out, is a change to report).
    const size_t said = r.err.find("the config differs from the checkpoint's at: ");
    ASSERT_NE(said, std::string::npos) << r.err;
    const std::string changes = r.err.substr(said, r.err.find('\n', said) - said);
    EXPECT_TRUE(contains(changes, "train.save_every")) << changes;
    for (const char* key : {"train_micro_batch_size_per_gpu", "pipeline.stages", "tensor_parallel", "zero_optimization.stage"})
      EXPECT_FALSE(contains(changes, key)) << changes;
    const auto losses = losses_of(resumed);
    ASSERT_EQ(losses.size(), 5u);
    for (size_t i = 0; i < losses.size(); ++i) EXPECT_NEAR(losses[i], base[i + 5], 1e-5 * base[i + 5]) << "step " << i + 6;
  }
  // Validation: the last stage's losses, the same as one rank's.
  double val[2] = {0, 0};
  for (int pp = 0; pp < 2; ++pp) {
    const std::string dir = scratch_dir() + "/pp_val" + std::to_string(pp);
    Result r = cli_test::ds(kRun + (pp ? meshes[1].shape : shape(1)) + " train.steps=2 train.eval_every=2 train.eval_batches=2 train.output_dir=" + dir);
    ASSERT_EQ(r.code, 0) << r.err;
    val[pp] = metrics_of(dir).back()["val_loss"].get<double>();
  }
  EXPECT_NEAR(val[1], val[0], 1e-5 * val[0]);
  // Started from a checkpoint's weights (model.init_from): each stage reads its tensors (the last the table too).
  std::vector<double> from[2];
  for (int pp = 0; pp < 2; ++pp) {
    const std::string dir = scratch_dir() + "/pp_init" + std::to_string(pp);
    Result r = cli_test::ds(kRun + (pp ? meshes[0].shape : shape(1)) + " train.steps=2 model.init_from=" + ds::find_latest_checkpoint(one) +
                            " train.output_dir=" + dir);
    ASSERT_EQ(r.code, 0) << r.err;
    from[pp] = losses_of(dir);
  }
  ASSERT_EQ(from[0].size(), 2u);
  ASSERT_EQ(from[1].size(), 2u);
  EXPECT_LT(from[0][0], base[0] - 0.1);
  for (size_t i = 0; i < 2; ++i) EXPECT_NEAR(from[1][i], from[0][i], 1e-5 * from[0][i]) << "step " << i + 1;
  // Three data ranks sum a gradient in an order that depends on where it lies in a rank's buffer, which differs
  // between the first stage's table and the last stage's copy: the copy takes the table's weights every step, so
  // a run resumed at step 5 is the uninterrupted one, bit for bit (pipeline 2 x data 3, 6 ranks).
  const std::string d3 = "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=2 --nproc-per-node 6 zero_optimization.stage=1 "
                         "pipeline.stages=2 train.steps=10 train.output_dir=";
  const std::string straight = scratch_dir() + "/pp_d3", again = scratch_dir() + "/pp_d3_resumed";
  Result r = cli_test::ds(kRun + d3 + straight + " train.save_every=5");
  ASSERT_EQ(r.code, 0) << r.err;
  r = cli_test::ds(kRun + d3 + again + " train.resume=" + straight + "/checkpoints/step_00000005");
  ASSERT_EQ(r.code, 0) << r.err;
  const WholeState a = whole_state(straight, one), b = whole_state(again, one);
  EXPECT_TRUE(a.master == b.master && a.exp_avg == b.exp_avg && a.exp_avg_sq == b.exp_avg_sq);
}

TEST(Zero, AMemoryCutPipelineTrainsTheSingleRankRun) {
  // pipeline.partition "memory": 8 blocks on 4 stages with 12 micro-batches, the first stage holding the most
  // activations takes the fewest blocks; the stages run the one-rank run all the same.
  const std::string eight = kRun + "model.num_layers=8 train.steps=4 train_micro_batch_size_per_gpu=2 gradient_accumulation_steps=12 ";
  const std::string one = scratch_dir() + "/memory_cut_one", four = scratch_dir() + "/memory_cut_p4";
  Result r = cli_test::ds(eight + "train.output_dir=" + one);
  ASSERT_EQ(r.code, 0) << r.err;
  r = cli_test::ds(eight + "pipeline.stages=4 pipeline.partition=memory --nproc-per-node 4 train.output_dir=" + four);
  ASSERT_EQ(r.code, 0) << r.err;
  const json stages = json::parse(slurp(four + "/plan.json"))["mesh"]["stages"];
  ASSERT_EQ(stages.size(), 4u);
  EXPECT_LT(stages[0]["blocks"].get<int>(), stages[3]["blocks"].get<int>()) << stages.dump();
  const auto a = losses_of(one), b = losses_of(four);
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 1e-5 * a[i]) << "step " << i + 1;
  expect_close(whole_state(four, one).master, whole_state(one).master, "weights");
}

TEST(Zero, TwoLocalRanksAtStageZeroTrainTheSameRunAsOneRank) {
  // One rank: 2 micro batches of 16 per step; two ranks: one each. The sampler hands both the same 32
  // samples per step, so fp32 losses agree to summation order.
  const std::string one = scratch_dir() + "/dp1", two = scratch_dir() + "/dp2";
  const std::string common = "train examples/quickstart.json bf16.enabled=false train.steps=12 train.eval_every=0 ";
  Result r1 = cli_test::ds(common + "gradient_accumulation_steps=2 train.output_dir=" + one);
  ASSERT_EQ(r1.code, 0) << r1.err;
  Result r2 = cli_test::ds(common + "--nproc-per-node 2 train.output_dir=" + two);
  ASSERT_EQ(r2.code, 0) << r2.err;
  EXPECT_TRUE(contains(r2.err, "starting 2 CPU ranks")) << r2.err;
  const auto a = losses_of(one), b = losses_of(two);
  ASSERT_EQ(a.size(), 12u);
  ASSERT_EQ(b.size(), 12u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5 * a[i]) << "step " << i + 1;
  EXPECT_TRUE(contains(slurp(two + "/logs/rank_1.log"), "done: 12 of 12 steps"));
}

TEST(Zero, WhenOneRankDiesEveryRankExitsAndTheLauncherNamesIt) {
  // Stage 3: rank 1 is killed a few seconds into a long run, while the others wait on it in gathers
  // (some in flight as prefetches) and reductions.
  const std::string dir = scratch_dir() + "/dpkill";
  std::system("(sleep 4; for p in $(pgrep -f 'dpkill'); do tr '\\0' '\\n' </proc/$p/environ 2>/dev/null | "
              "grep -qx RANK=1 && kill -9 $p; done) >/dev/null 2>&1 &");
  const auto t0 = std::chrono::steady_clock::now();
  Result r = cli_test::ds("train examples/quickstart.json train.steps=100000 train.comm_timeout_s=20 zero_optimization.stage=3 "
                "zero_optimization.stage3_param_persistence_threshold=auto --nproc-per-node 3 train.output_dir=" + dir);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "rank 1 of 3 was killed by signal")) << r.err;
  EXPECT_LT(seconds, 60) << "the launcher waited on a dead rank";
}

// Two network namespaces stand in for two machines, joined by a veth pair: 10.77.0.1 on `a` (interface
// `va`), 10.77.0.2 on `b` (`vb`). Torn down on destruction; `ok` is false where namespaces cannot be made.
struct TwoHosts {
  std::string id = std::to_string(::getpid() % 100000);
  std::string a = "dsA" + id, b = "dsB" + id, va = "va" + id, vb = "vb" + id;
  bool ok = false;
  TwoHosts() {
    const std::string setup = "ip netns add " + a + " && ip netns add " + b + " && ip link add " + va + " type veth peer name " +
                              vb + " && ip link set " + va + " netns " + a + " && ip link set " + vb + " netns " + b +
                              " && ip -n " + a + " addr add 10.77.0.1/24 dev " + va + " && ip -n " + b +
                              " addr add 10.77.0.2/24 dev " + vb + " && ip -n " + a + " link set " + va + " up && ip -n " + b +
                              " link set " + vb + " up && ip -n " + a + " link set lo up && ip -n " + b + " link set lo up";
    ok = std::system((setup + " >/dev/null 2>&1").c_str()) == 0;
  }
  ~TwoHosts() { std::system(("ip netns del " + a + " 2>/dev/null; ip netns del " + b + " 2>/dev/null").c_str()); }

  // Writes `hostfile` and an ssh stand-in into DIR_launch, beside the run directory `dir` (which holds the
  // run alone: ds refuses a run directory holding other files) (node-a and node-b are the namespaces; the
  // stand-in runs the command there, as sshd would on the host). Returns the launcher's flags; the
  // stand-in goes in DS_SSH.
  std::string hostfile_flags(const std::string& run_dir, int port,
                             const std::string& hostfile = "node-a slots=1\nnode-b slots=1\n") const {
    const std::string dir = run_dir + "_launch";
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/hosts.txt") << hostfile;
    std::ofstream(dir + "/ssh.sh") << "#!/bin/sh\nhost=$1; shift\ncase $host in\n  node-a) ns=" << a << "; nic=" << va
                                   << ";;\n  node-b) ns=" << b << "; nic=" << vb
                                   << ";;\n  *) echo \"ssh: $host: unknown host\" >&2; exit 255;;\nesac\n"
                                      "exec ip netns exec $ns env GLOO_SOCKET_IFNAME=$nic sh -c \"$1\"\n";
    std::filesystem::permissions(dir + "/ssh.sh", std::filesystem::perms::owner_all);
    return "--hostfile " + dir + "/hosts.txt --master-addr 10.77.0.1 --master-port " + std::to_string(port) + " ";
  }
  static std::string ssh_env(const std::string& run_dir) { return "DS_SSH=" + run_dir + "_launch/ssh.sh"; }
};

void expect_single_rank_losses(const std::string& dir) {
  const auto base = losses_of(single_rank_run()), losses = losses_of(dir);
  ASSERT_EQ(losses.size(), base.size());
  for (size_t i = 0; i < base.size(); ++i) EXPECT_NEAR(losses[i], base[i], 1e-5 * base[i]) << "step " << i + 1;
}

const std::string kTwoRankStage2 = kRun + "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 train.steps=10 "
                                          "zero_optimization.stage=2 train.comm_timeout_s=60 ";

TEST(Zero, TwoHostsStartedWithTorchrunsEnvironmentRendezvousAcrossTheLink) {
  // One rank per host, started as torchrun or Slurm would (RANK, WORLD_SIZE, MASTER_ADDR on the other
  // side of the link), Gloo bound to the veth interface by GLOO_SOCKET_IFNAME.
  TwoHosts hosts;
  if (!hosts.ok) GTEST_SKIP() << "cannot create network namespaces here (needs root and CAP_SYS_ADMIN)";
  const std::string dir = scratch_dir() + "/two_hosts_env";
  auto rank = [&](const std::string& ns, int r, const std::string& ifname) {
    return "ip netns exec " + ns + " env RANK=" + std::to_string(r) + " WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 " +
           "MASTER_ADDR=10.77.0.1 MASTER_PORT=29533 GLOO_SOCKET_IFNAME=" + ifname + " " DS_BINARY " " + kTwoRankStage2 +
           "train.output_dir=" + dir + " >" + dir + "_" + std::to_string(r) + ".log 2>&1";
  };
  const std::string both = "cd " + cli_test::work_dir() + " && { " + rank(hosts.a, 0, hosts.va) + " & p0=$!; " + rank(hosts.b, 1, hosts.vb) +
                           " & p1=$!; wait $p0; r0=$?; wait $p1; r1=$?; exit $((r0 + r1)); }";
  const int status = std::system(("bash -c '" + both + "'").c_str());
  ASSERT_EQ(status, 0) << slurp(dir + "_0.log") << slurp(dir + "_1.log");
  expect_single_rank_losses(dir);
}

TEST(Zero, AHostfileStartsRanksOnOtherHostsOverSsh) {
  // The launcher reads DeepSpeed's hostfile and starts each remote rank with `ssh HOST COMMAND`; DS_SSH
  // points it at a stand-in that runs COMMAND inside that host's namespace, as sshd would on the host.
  TwoHosts hosts;
  if (!hosts.ok) GTEST_SKIP() << "cannot create network namespaces here (needs root and CAP_SYS_ADMIN)";
  const std::string dir = scratch_dir() + "/two_hosts_ssh";
  const std::string flags = hosts.hostfile_flags(dir, 29534, "# two machines\nnode-a slots=1\nnode-b slots=1  # the second\n");
  Result r = cli_test::ds(kTwoRankStage2 + flags + "train.output_dir=" + dir, TwoHosts::ssh_env(dir));
  ASSERT_EQ(r.code, 0) << r.err << slurp(dir + "/logs/rank_1.log");
  EXPECT_TRUE(contains(r.err, "starting 2 CPU ranks on 2 hosts")) << r.err;
  expect_single_rank_losses(dir);
  // A malformed hostfile is refused before anything starts, naming the line.
  std::ofstream(dir + "/bad.txt") << "node-a slots=1\nnode-b 2\n";
  Result bad = cli_test::ds(kTwoRankStage2 + "--hostfile " + dir + "/bad.txt train.output_dir=" + dir + "/bad");
  EXPECT_EQ(bad.code, 2);
  EXPECT_TRUE(contains(bad.err, "bad.txt:2")) << bad.err;
}

TEST(Zero, WhenARemoteRankDiesTheLauncherNamesItsHostAndNothingIsLeftRunning) {
  // Rank 1 runs "on node-b" (a network namespace, through the ssh stand-in) and is killed mid-run. The
  // launcher names it and its host, ends rank 0's ssh and closes its input (the remote watcher then
  // interrupts rank 0 if it has not already failed on the lost peer); no ds process is left on either host.
  TwoHosts hosts;
  if (!hosts.ok) GTEST_SKIP() << "cannot create network namespaces here (needs root and CAP_SYS_ADMIN)";
  const std::string dir = scratch_dir() + "/remote_kill";
  const std::string flags = hosts.hostfile_flags(dir, 29535);
  std::system(("(sleep 5; for p in $(ip netns pids " + hosts.b + "); do tr '\\0' '\\n' </proc/$p/environ 2>/dev/null | "
               "grep -qx RANK=1 && kill -9 $p; done) >/dev/null 2>&1 &").c_str());
  const auto t0 = std::chrono::steady_clock::now();
  Result r = cli_test::ds(kTwoRankStage2 + "train.steps=100000 train.comm_timeout_s=20 " + flags + "train.output_dir=" + dir,
                          TwoHosts::ssh_env(dir));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "rank 1 of 2 (on node-b)")) << r.err;
  EXPECT_LT(seconds, 60) << "the launcher waited on a dead rank";
  std::this_thread::sleep_for(std::chrono::seconds(2));
  for (const std::string& ns : {hosts.a, hosts.b}) {
    const std::string count = "ip netns pids " + ns + " | xargs -r ps -o comm= -p 2>/dev/null | grep -c '^ds$' > " + dir + "/left";
    std::system(count.c_str());
    EXPECT_EQ(std::stoi(slurp(dir + "/left")), 0) << "ds still running in " << ns;
  }
}

TEST(Zero, CtrlCReachesRemoteRanksThroughTheirSshAndEveryRankSavesItsShard) {
  // The launcher is interrupted; the remote ranks hear it through their ssh input (closed), stop after the
  // same step, write one complete sharded checkpoint and exit 130, which ssh carries back.
  TwoHosts hosts;
  if (!hosts.ok) GTEST_SKIP() << "cannot create network namespaces here (needs root and CAP_SYS_ADMIN)";
  const std::string dir = scratch_dir() + "/remote_int";
  const std::string flags = hosts.hostfile_flags(dir, 29536);
  // Ctrl-C to the launcher alone (not the shell that started it): the process named ds with the hostfile.
  std::system(("(sleep 6; for p in $(pgrep -f -- '--hostfile " + dir + "_launch/hosts.txt'); do "
               "[ \"$(cat /proc/$p/comm)\" = ds ] && kill -INT $p; done) >/dev/null 2>&1 &").c_str());
  Result r = cli_test::ds(kTwoRankStage2 + "train.steps=100000 " + flags + "train.output_dir=" + dir, TwoHosts::ssh_env(dir));
  EXPECT_EQ(r.code, 130) << r.err << slurp(dir + "/logs/rank_1.log");
  const std::string latest = ds::find_latest_checkpoint(dir);
  ASSERT_FALSE(latest.empty()) << r.err;
  EXPECT_TRUE(std::filesystem::exists(latest + "/shard_00001.h5"));
  EXPECT_NO_THROW(whole_state(dir));  // every element of the model is in the shards
}

TEST(Zero, ResumingOnMoreRanksKeepsTheCheckpointsGlobalBatchOrSaysWhyItCannot) {
  // A config whose batch is micro 4 x accumulation 2 (global 8 on one rank). Resumed on 2 ranks it would
  // be 16: ds keeps 8 (accumulation 1) and the run continues the one-rank run; on 3 ranks no whole
  // accumulation keeps 8, so it is refused with the choices.
  const std::string dir = scratch_dir() + "/keep_batch", config = scratch_dir() + "/keep_batch.json";
  std::filesystem::remove_all(dir);
  nlohmann::json c = nlohmann::json::parse(slurp(std::string(DS_SOURCE_DIR) + "/examples/quickstart.json"), nullptr, true, true);
  c["train_micro_batch_size_per_gpu"] = 4;
  c["gradient_accumulation_steps"] = 2;
  c["bf16"]["enabled"] = false;
  c["scheduler"]["params"]["total_num_steps"] = 10;
  c["train"]["eval_every"] = 0;
  std::ofstream(config) << c.dump();
  Result whole = cli_test::ds("train " + config + " train.steps=10 train.output_dir=" + dir + "_whole");
  ASSERT_EQ(whole.code, 0) << whole.err;
  ASSERT_EQ(cli_test::ds("train " + config + " train.steps=5 train.output_dir=" + dir).code, 0);
  Result r = cli_test::ds("train " + config + " train.steps=10 --resume --nproc-per-node 3 train.output_dir=" + dir);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "the global batch would change from 8 (the checkpoint's, 1 rank) to 24 (3 ranks)")) << r.err;
  EXPECT_TRUE(contains(r.err, "or change it knowingly with train_batch_size=24")) << r.err;
  r = cli_test::ds("train " + config + " train.steps=10 --resume --nproc-per-node 2 train.output_dir=" + dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "keeping its global batch of 8 with gradient_accumulation_steps=1")) << r.err;
  const auto base = losses_of(dir + "_whole"), resumed = losses_of(dir);
  ASSERT_EQ(resumed.size(), 10u);
  for (size_t i = 0; i < base.size(); ++i) EXPECT_NEAR(resumed[i], base[i], 1e-5 * base[i]) << "step " << i + 1;
}

TEST(Zero, CtrlCOnTwoRanksExits130EarlyOrLateAndTheHintKeepsTheLauncherFlags) {
  // Interrupted before the ranks set up their handlers (the first second): 130, not "rank 0 was killed".
  const std::string early = scratch_dir() + "/early_int";
  std::filesystem::remove_all(early);
  Result r = cli_test::ds_signalled("train examples/quickstart.json --nproc-per-node 2 train.steps=100000 train.output_dir=" + early, SIGINT,
                                    early + "/metrics.jsonl", 0, 0.3);
  // (130 from the launcher, or the launcher itself ended by the signal before it set up its own handler:
  // the shell reports both as 130.)
  EXPECT_TRUE(r.code == 130 || r.code == -SIGINT) << r.code << "\n" << r.err;
  EXPECT_FALSE(contains(r.err, "was killed by signal")) << r.err;
  // Interrupted while training: the command that continues it keeps --nproc-per-node.
  const std::string late = scratch_dir() + "/late_int";
  std::filesystem::remove_all(late);
  r = cli_test::ds_signalled("train examples/quickstart.json --nproc-per-node 2 train.steps=100000 train.output_dir=" + late, SIGINT,
                             late + "/metrics.jsonl", 2, 0.1);
  EXPECT_EQ(r.code, 130) << r.err;
  EXPECT_TRUE(contains(r.err, "continue with: ds train examples/quickstart.json --nproc-per-node 2 train.steps=100000 train.output_dir=" + late +
                              " --resume"))
      << r.err;
}

TEST(Zero, ValidationSeesTheSameWindowsAtAnyWorldSize) {
  // The same global batch (16) on 1 rank (micro 8 x 2) and on 2 ranks (micro 8 x 1, and micro 4 x 2 at
  // stage 3): the validation loss is the same figure, each rank evaluating its share of the same windows.
  const std::string base = "train examples/quickstart.json bf16.enabled=false train.steps=6 train.eval_every=3 train.eval_batches=2 ";
  std::vector<std::vector<double>> vals;
  for (const std::string& shape : {std::string("train_micro_batch_size_per_gpu=8 gradient_accumulation_steps=2"),
                                   std::string("train_micro_batch_size_per_gpu=8 gradient_accumulation_steps=1 --nproc-per-node 2"),
                                   std::string("train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=2 --nproc-per-node 2 "
                                               "zero_optimization.stage=3")}) {
    const std::string dir = scratch_dir() + "/val_" + std::to_string(vals.size());
    std::filesystem::remove_all(dir);
    Result r = cli_test::ds(base + shape + " train.output_dir=" + dir);
    ASSERT_EQ(r.code, 0) << shape << "\n" << r.err;
    std::vector<double> v;
    for (const auto& m : cli_test::metrics_of(dir))
      if (m.contains("val_loss")) v.push_back(m["val_loss"].get<double>());
    ASSERT_EQ(v.size(), 2u) << shape;
    vals.push_back(v);
  }
  for (size_t k = 1; k < vals.size(); ++k)
    for (size_t i = 0; i < vals[0].size(); ++i) EXPECT_NEAR(vals[k][i], vals[0][i], 1e-5 * vals[0][i]) << "shape " << k << ", validation " << i;
}
