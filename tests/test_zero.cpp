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

#include "engine/runtime/io/checkpoint.hpp"
#include "zero_runs.hpp"

using namespace zero_test;

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
      if (c["what"] == "frozen parameters (each pass)") frozen_gathers = c["wire_bytes_per_rank_per_step"].get<double>();
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

TEST(Zero, GradientsCrossingInBf16SendHalfTheBytesAndTrackTheFp32Run) {
  // communication_data_type bf16 over fp32 training on two processes at stage 2: the gradients' pieces travel in bf16
  // (2 bytes an element on the wire, the plan's and the ledger's figure, half the same run's without the key), and
  // the run stays within bf16's rounding of that run, but off it: the gradients were rounded on their way.
  const std::string plain = scratch_dir() + "/comm_fp32", dir = scratch_dir() + "/comm_bf16";
  const std::string run = kRun + shape(2) + "train.steps=10 zero_optimization.stage=2 ";
  Result r = cli_test::ds(run + "train.output_dir=" + plain);
  ASSERT_EQ(r.code, 0) << r.err;
  r = cli_test::ds(run + "communication_data_type=bf16 train.output_dir=" + dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(contains(r.err, "communication_data_type")) << r.err;  // it acts: no warning
  const auto gradient_bytes = [](const std::string& d, double* planned) {
    const json plan = json::parse(slurp(d + "/plan.json"));
    double bytes = 0;
    for (const json& c : plan["collectives"]) {
      *planned += c["wire_bytes_per_rank_per_step"].get<double>();
      if (c["what"].get<std::string>().find("gradients") != std::string::npos) bytes += c["wire_bytes_per_rank_per_step"].get<double>();
    }
    return bytes;
  };
  double planned = 0, planned_plain = 0;
  const double sent = gradient_bytes(dir, &planned), sent_plain = gradient_bytes(plain, &planned_plain);
  EXPECT_GT(sent, 0);
  EXPECT_DOUBLE_EQ(2 * sent, sent_plain);
  EXPECT_EQ(json::parse(slurp(dir + "/plan.json"))["precision"]["comm_dtype"], "bf16");
  for (const json& m : metrics_of(dir)) EXPECT_NEAR(m["comm_bytes"].get<double>(), planned, 1.0) << "step " << m["step"];
  const auto base = losses_of(plain), losses = losses_of(dir);
  ASSERT_EQ(base.size(), 10u);
  ASSERT_EQ(losses.size(), base.size());
  double furthest = 0;
  for (size_t i = 0; i < base.size(); ++i) {
    EXPECT_NEAR(losses[i], base[i], 2e-3 * base[i]) << "step " << i + 1;
    furthest = std::max(furthest, std::abs(losses[i] - base[i]));
  }
  EXPECT_GT(furthest, 0.0);  // the same run without the key, deterministic, is another run
}

// Tensor parallelism over real processes (Gloo): tensor 2 alone, and tensor 2 x data 2 with ZeRO 1 and 3 over the data
// groups, train the one-rank run (the same global batch): per-step losses to 1e-5. Their checkpoint is the whole
// model's (each tensor rank writes its share as the elements of the whole it holds): it holds the one-rank run's
// weights and moments, convert-ckpt consolidates it, and one rank resumes a mesh's checkpoint into the same losses.
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
