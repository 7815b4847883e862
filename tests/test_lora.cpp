// LoRA (model.lora) as it trains: step 0 is the base model exactly, the adapter's gradients are the
// loss's derivatives, the base takes none, ZeRO on two ranks trains what one rank trains, and a resumed
// adapter must sit on the base it was trained on.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>

#include "common/error.hpp"
#include "engine/runtime/comm/comm_local.hpp"
#include "engine/runtime/device/device.hpp"
#include "engine/runtime/run/flat_params.hpp"
#include "engine/runtime/model/language_model.hpp"
#include "engine/runtime/run/trainer.hpp"
#include "schema/loader.hpp"
#include "test_helpers.hpp"

using namespace ds;
namespace fs = std::filesystem;

namespace {

const char* kTiny = R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
  "model": {"preset": "llama-tiny"}, "data": {"type": "synthetic", "seq_len": 16},
  "train": {"steps": 6, "eval_every": 0, "threads": 1, "seed": 11}})";

const std::string kLora = R"(model.lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]})";

fs::path scratch(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("ds_lora_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

// Trains on `world` thread ranks; rank 0's result.
TrainResult train_ranks(int world, std::vector<std::string> overrides, const fs::path& dir, const std::string& resume_from = "") {
  overrides.push_back("train.output_dir=" + dir.string());
  std::vector<TrainResult> results(static_cast<size_t>(world));
  LocalGroup group(world);
  test::on_ranks(world, [&](int r) {
    const Plan plan = test::plan_of(kTiny, world, r, overrides);
    TrainOptions opt;
    opt.print_every = 1000;
    opt.resume_from = resume_from;
    auto comm = world > 1 ? group.join(r) : nullptr;
    results[static_cast<size_t>(r)] = train(plan, opt, comm.get());
  });
  for (const TrainResult& r : results) EXPECT_EQ(r.losses, results[0].losses);  // every rank agrees on the mean loss
  return results[0];
}

}  // namespace

TEST(Lora, StepZeroIsTheBaseModelExactlyAndTheAdapterLearns) {
  for (const char* precision : {"bf16.enabled=false", "bf16.enabled=true"}) {
    SCOPED_TRACE(precision);
    const fs::path root = scratch("step0");
    // The base the LoRA run freezes is what a run training every weight draws from the same seed.
    const TrainResult full = train_ranks(1, {precision}, root / "full");
    const TrainResult lora = train_ranks(1, {precision, kLora}, root / "lora");
    ASSERT_EQ(lora.losses.size(), 6u);
    EXPECT_EQ(lora.losses[0], full.losses[0]);  // B = 0: the adapter adds exactly nothing
    EXPECT_NE(lora.losses[1], full.losses[1]);  // but it trains other numbers than the full run
    EXPECT_LT(lora.losses.back(), lora.losses.front());
    fs::remove_all(root);
  }
}

TEST(Lora, AdapterGradientsAreTheLossesDerivativesAndTheBaseTakesNone) {
  torch::manual_seed(3);
  const Plan plan = test::plan_of(kTiny, 1, 0, {"bf16.enabled=false", kLora, "model.activation_checkpointing=true"});
  auto device = Device::create(DeviceKind::cpu, 0);
  FlatParams flat = FlatParams::allocate(plan, 0, *device);
  {
    torch::NoGradGuard ng;
    InitialWeights base(plan, 5, true);
    int64_t at = 0;
    for (size_t i = 0; i < plan.model.tensors.size(); ++i) {
      const int64_t n = plan.model.tensors[i].numel;
      flat.frozen.narrow(0, at, n).copy_(torch::from_blob(const_cast<float*>(base.param(static_cast<int>(i))), {n}, torch::kFloat32));
      at += n;
    }
    flat.params.normal_(0.0, 0.2);  // B nonzero too, so both factors' gradients are exercised
  }
  auto model = make_model(plan, flat);
  const torch::Tensor in = torch::randint(0, 256, {2, 16}, torch::kLong), tgt = torch::randint(0, 256, {2, 16}, torch::kLong);
  flat.grads.zero_();
  model->set_loss_gradient(1.0);
  model->loss(in, tgt).backward();
  for (const torch::Tensor& v : flat.frozen_views) {
    EXPECT_FALSE(v.requires_grad());
    EXPECT_FALSE(v.grad().defined());
  }
  // Central differences in fp64 arithmetic of fp32 losses, on elements of every adapter tensor.
  torch::NoGradGuard ng;
  const float* g = flat.grads.data_ptr<float>();
  float* w = flat.params.data_ptr<float>();
  int checked = 0;
  for (const ParamSlot& p : plan.layout.params) {
    for (int64_t k : {int64_t{0}, p.numel / 2, p.numel - 1}) {
      const int64_t i = p.offset + k;
      const float keep = w[i];
      const float h = 1e-2f;
      w[i] = keep + h;
      const double up = model->loss(in, tgt).item<double>();
      w[i] = keep - h;
      const double down = model->loss(in, tgt).item<double>();
      w[i] = keep;
      const double numeric = (up - down) / (2.0 * h);
      EXPECT_NEAR(g[i], numeric, 2e-3 + 2e-2 * std::fabs(numeric)) << p.name << " element " << k;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 3 * 2 * 3 * 2);  // 3 elements x A and B x 3 modules x 2 blocks
}

TEST(Lora, ZeroStagesOnTwoRanksTrainTheOneRankAdapter) {
  const fs::path root = scratch("zero");
  const std::vector<std::string> o{"bf16.enabled=false", kLora, "train_micro_batch_size_per_gpu=4"};
  const TrainResult one = train_ranks(1, o, root / "one");
  for (int stage : {1, 2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    // Threshold 100: at stage 3 the base's block matrices are partitioned and gathered with their block.
    const std::vector<std::string> two_ranks{"bf16.enabled=false", kLora, "train_micro_batch_size_per_gpu=2",
                                             "zero_optimization.stage=" + std::to_string(stage),
                                             "zero_optimization.stage3_param_persistence_threshold=100"};
    const TrainResult two = train_ranks(2, two_ranks, root / ("two_s" + std::to_string(stage)));
    ASSERT_EQ(two.losses.size(), one.losses.size());
    for (size_t i = 0; i < one.losses.size(); ++i) EXPECT_NEAR(two.losses[i], one.losses[i], 1e-5 * one.losses[i]) << "step " << i + 1;
    // What the base's gathers sent is what the plan said they would, every step.
    double planned = 0, sent = 0;
    for (const Collective& c : test::plan_of(kTiny, 2, 0, two_ranks).execution.collectives)
      if (c.kind == CollectiveKind::frozen_parameters) planned = c.wire_bytes_per_rank_per_step * static_cast<double>(two.losses.size());
    for (const TrainResult::CollectiveTotal& c : two.collectives)
      if (c.name == collective_name(CollectiveKind::frozen_parameters)) sent = c.bytes;
    EXPECT_EQ(planned > 0, stage == 3);
    EXPECT_DOUBLE_EQ(sent, planned);
  }
  fs::remove_all(root);
}

TEST(Lora, AResumedAdapterContinuesOnItsBaseAndRefusesAnother) {
  const fs::path root = scratch("resume");
  const std::vector<std::string> o{"bf16.enabled=true", kLora, "train.save_every=2"};
  const TrainResult straight = train_ranks(1, o, root / "straight");
  const std::string step2 = (root / "straight" / "checkpoints" / "step_00000002").string();
  ASSERT_TRUE(fs::exists(step2));
  const TrainResult resumed = train_ranks(1, o, root / "resumed", step2);
  ASSERT_EQ(resumed.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(resumed.losses[i], straight.losses[i + 2]) << "step " << i + 3;
  // Another seed draws another random base: the adapter does not belong to it.
  std::vector<std::string> other = o;
  other.push_back("train.seed=12");
  try {
    train_ranks(1, other, root / "other", step2);
    ADD_FAILURE() << "resumed an adapter onto another base";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("trained on other frozen weights"), std::string::npos) << e.what();
  }
  // A checkpoint of every weight is no adapter.
  train_ranks(1, {"bf16.enabled=true", "train.save_every=2", "train.steps=2"}, root / "full");
  EXPECT_THROW(train_ranks(1, o, root / "full_into_lora", (root / "full" / "checkpoints" / "step_00000002").string()), UserError);
  fs::remove_all(root);
}

TEST(Freeze, FrozenTensorsStartAsTheFullRunsTrainNothingAndTwoRanksTrainWhatOneDoes) {
  const fs::path root = scratch("freeze");
  const std::string freeze = R"(model.freeze=["model.embed_tokens.weight", "model.layers.0.*"])";
  const TrainResult full = train_ranks(1, {"bf16.enabled=false"}, root / "full");
  const TrainResult one = train_ranks(1, {"bf16.enabled=false", freeze}, root / "one");
  ASSERT_EQ(one.losses.size(), 6u);
  EXPECT_EQ(one.losses[0], full.losses[0]);  // every tensor starts as the full run's, frozen or not
  EXPECT_NE(one.losses[1], full.losses[1]);
  EXPECT_LT(one.losses.back(), one.losses.front());
  for (int stage : {1, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const TrainResult two = train_ranks(2, {"bf16.enabled=false", freeze, "train_micro_batch_size_per_gpu=2", "zero_optimization.stage=" + std::to_string(stage),
                                            "zero_optimization.stage3_param_persistence_threshold=100"},
                                        root / ("two_s" + std::to_string(stage)));
    ASSERT_EQ(two.losses.size(), one.losses.size());
    for (size_t i = 0; i < one.losses.size(); ++i) EXPECT_NEAR(two.losses[i], one.losses[i], 1e-5 * one.losses[i]) << "step " << i + 1;
  }
  fs::remove_all(root);
}

// A whole block frozen, first or last: the blocks that reduce their gradients as backward finishes them
// (stage 1 with overlap_comm, stages 2-3 by group) skip it, and two ranks train what one does.
TEST(Freeze, AWholeFrozenBlockFirstOrLastIsSkippedByTheReducesAsBackwardGoes) {
  const fs::path root = scratch("freeze_blocks");
  for (const std::string freeze : {R"(model.freeze=["model.layers.0.*"])", R"(model.freeze=["model.layers.1.*"])"}) {
    const TrainResult one = train_ranks(1, {"bf16.enabled=false", freeze}, root / "one");
    ASSERT_EQ(one.losses.size(), 6u);
    for (const std::string zero : {"zero_optimization.stage=1", "zero_optimization.stage=2", "zero_optimization.stage=3"}) {
      SCOPED_TRACE(freeze + ", " + zero);
      const TrainResult two = train_ranks(2, {"bf16.enabled=false", freeze, zero, "zero_optimization.overlap_comm=true",
                                              "train_micro_batch_size_per_gpu=2"},
                                          root / "two");
      ASSERT_EQ(two.losses.size(), one.losses.size());
      for (size_t i = 0; i < one.losses.size(); ++i) EXPECT_NEAR(two.losses[i], one.losses[i], 1e-5 * one.losses[i]) << "step " << i + 1;
      fs::remove_all(root / "two");
    }
    fs::remove_all(root / "one");
  }
  fs::remove_all(root);
}

TEST(Freeze, FrozenTensorsTakeNoGradientAndStayAsLoaded) {
  const Plan plan = test::plan_of(kTiny, 1, 0, {"bf16.enabled=false", R"(model.freeze=["model.layers.1.mlp.*", "model.norm.weight"])"});
  auto device = Device::create(DeviceKind::cpu, 0);
  FlatParams flat = FlatParams::allocate(plan, 0, *device);
  ASSERT_EQ(flat.frozen_views.size(), 4u);  // gate, up, down and the final norm
  {
    torch::NoGradGuard ng;
    flat.frozen.normal_(0.0, 0.05);
    flat.params.normal_(0.0, 0.05);
  }
  const torch::Tensor before = flat.frozen.clone();
  auto model = make_model(plan, flat);
  flat.grads.zero_();
  model->set_loss_gradient(1.0);
  model->loss(torch::randint(0, 256, {2, 16}, torch::kLong), torch::randint(0, 256, {2, 16}, torch::kLong)).backward();
  for (const torch::Tensor& v : flat.frozen_views) EXPECT_FALSE(v.grad().defined());
  EXPECT_TRUE(torch::equal(flat.frozen, before));
  EXPECT_GT(flat.grads.abs().sum().item<double>(), 0.0);  // what trains got its gradients
}

// Below every trained tensor (here the embeddings and block 0 frozen) no gradient is wanted: those blocks run
// forward only, keep no graph, and what trains gets the gradients a backward through every block gives it.
TEST(Freeze, BlocksBelowEveryTrainedTensorRunForwardOnlyWithTheSameGradients) {
  const Plan plan = test::plan_of(kTiny, 1, 0, {"bf16.enabled=false", R"(model.freeze=["model.embed_tokens.weight", "model.layers.0.*"])"});
  ASSERT_EQ(plan.backward_from, 1);
  auto device = Device::create(DeviceKind::cpu, 0);
  FlatParams flat = FlatParams::allocate(plan, 0, *device);
  {
    torch::NoGradGuard ng;
    flat.frozen.normal_(0.0, 0.05);
    flat.params.normal_(0.0, 0.05);
  }
  auto model = make_model(plan, flat);
  EXPECT_EQ(model->backward_from(), 1);
  struct Recorder : BlockHooks {
    std::vector<int64_t> forward, backward;
    void before_forward(int64_t layer) override { forward.push_back(layer); }
    void before_backward(int64_t layer) override { backward.push_back(layer); }
    void after_backward(int64_t) override {}
  };
  const torch::Tensor ids = torch::randint(0, 256, {2, 16}, torch::kLong), targets = torch::randint(0, 256, {2, 16}, torch::kLong);
  model->set_loss_gradient(1.0);
  const auto run = [&](int64_t backward_from, bool hooked) {
    Recorder seen;
    model->set_backward_from(backward_from);
    model->set_block_hooks(hooked ? &seen : nullptr);
    flat.grads.zero_();
    const torch::Tensor loss = model->loss(ids, targets);
    loss.backward();
    model->set_block_hooks(nullptr);
    return std::make_tuple(loss.item<double>(), flat.grads.clone(), seen);
  };
  for (bool hooked : {false, true}) {
    SCOPED_TRACE(hooked ? "hooked blocks (ZeRO's)" : "plain blocks");
    const auto [whole_loss, whole_grads, whole_seen] = run(0, hooked);
    const auto [loss, grads, seen] = run(plan.backward_from, hooked);
    EXPECT_EQ(loss, whole_loss);
    EXPECT_TRUE(torch::equal(grads, whole_grads));
    EXPECT_GT(grads.abs().sum().item<double>(), 0.0);
    if (!hooked) continue;
    EXPECT_EQ(seen.forward, (std::vector<int64_t>{0, 1}));
    EXPECT_EQ(whole_seen.backward, (std::vector<int64_t>{1, 0}));
    EXPECT_EQ(seen.backward, std::vector<int64_t>{1});  // block 0's backward never ran
  }
}

// Blocks recomputed in groups (pipeline.activation_checkpoint_interval 2) above a frozen first block that runs
// forward only, plainly data parallel and with ZeRO stage 1's hooks around the groups (each block's gradients
// reduced as backward finishes it): two ranks train what one rank trains keeping every activation.
TEST(Freeze, GroupsOfRecomputedBlocksAboveForwardOnlyOnesTrainTheOneRankRun) {
  const fs::path root = scratch("groups");
  const std::string freeze = R"(model.freeze=["model.embed_tokens.weight", "model.layers.0.*"])";
  const TrainResult one = train_ranks(1, {"bf16.enabled=false", freeze, "model.num_layers=4"}, root / "one");
  ASSERT_EQ(one.losses.size(), 6u);
  for (const std::string zero : {"zero_optimization.stage=0", "zero_optimization.stage=1"}) {
    SCOPED_TRACE(zero);
    const TrainResult two = train_ranks(2, {"bf16.enabled=false", freeze, "model.num_layers=4", "pipeline.activation_checkpoint_interval=2",
                                            zero, "zero_optimization.overlap_comm=true", "train_micro_batch_size_per_gpu=2"},
                                        root / "two");
    ASSERT_EQ(two.losses.size(), one.losses.size());
    for (size_t i = 0; i < one.losses.size(); ++i) EXPECT_NEAR(two.losses[i], one.losses[i], 1e-5 * one.losses[i]) << "step " << i + 1;
    fs::remove_all(root / "two");
  }
  fs::remove_all(root);
}
