// Pipeline parallelism inside a step (engine/runtime/run/pipeline.hpp): a model cut into stages on thread ranks,
// micro-batches flowing through them in 1F1B order, must give the whole model's losses and gradients (each stage
// its blocks' and ends'; the tied table's two copies summing to the whole's), to 1e-5 in fp32. Every send,
// receive, forward and backward is recorded: the order must be the schedule's, and no stage may hold more
// micro-batches' activations than min(p - s, m), nor keep every send of the step.
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/plan/mesh.hpp"
#include "engine/plan/plan.hpp"
#include "engine/runtime/comm/comm_local.hpp"
#include "engine/runtime/device/device.hpp"
#include "engine/runtime/model/language_model.hpp"
#include "engine/runtime/run/flat_params.hpp"
#include "engine/runtime/run/pipeline.hpp"
#include "test_helpers.hpp"

namespace ds {
namespace {

constexpr const char* kConfig = R"({"train_micro_batch_size_per_gpu": 2, "data": {"seq_len": 16}})";

torch::Tensor tensor_of(const Plan& plan, const torch::Tensor& flat, size_t i) {
  const ParamSlot& p = plan.layout.params[i];
  return flat.narrow(0, p.offset, p.numel).view(p.shape);
}

uint64_t key_of(int micro) { return 1000 + static_cast<uint64_t>(micro); }

struct Case {
  std::vector<std::string> overrides;
  int stages = 2, micro_batches = 4;
};

// What a stage did and computed.
struct StageResult {
  std::vector<PipelineEvent> trace;
  int most_in_flight = 0, most_sends_held = 0;
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> grads;  // by the whole model's tensor name (the tied copy: "copy of " + name)
};

void expect_stages_equal_whole(const Case& c) {
  const int M = c.micro_batches, P = c.stages;
  const std::string cfg = std::string(kConfig).insert(1, "\"gradient_accumulation_steps\": " + std::to_string(M) + ", ");
  const Plan whole_plan = test::plan_of(cfg, 1, 0, c.overrides);
  auto device = Device::create(DeviceKind::cpu, 0);
  FlatParams whole = FlatParams::allocate(whole_plan, 0, *device);
  at::Generator gen = at::detail::createCPUGenerator(3);
  {
    torch::NoGradGuard ng;
    torch::Tensor fp32 = torch::empty({whole_plan.layout.numel}, torch::kFloat32);
    initialise_model(whole_plan, fp32, 5);
    fp32.add_(torch::randn(fp32.sizes(), gen), 0.05);
    whole.params.narrow(0, 0, whole_plan.layout.numel).copy_(fp32);
  }
  const int64_t V = whole_plan.model.hp.vocab_size;
  std::vector<torch::Tensor> in, tgt;
  for (int m = 0; m < M; ++m) {
    in.push_back(torch::randint(0, V, {2, 16}, gen, torch::kLong));
    tgt.push_back(torch::randint(0, V, {2, 16}, gen, torch::kLong));
  }
  // The whole model: the micro-batches one after another, each loss's gradient 1 / M.
  auto whole_model = make_model(whole_plan, whole);
  whole.grads.zero_();
  std::vector<double> whole_losses;
  for (int m = 0; m < M; ++m) {
    whole_model->set_dropout(key_of(m), true);
    whole_model->set_loss_gradient(1.0 / M);
    const torch::Tensor loss = whole_model->loss(in[static_cast<size_t>(m)], tgt[static_cast<size_t>(m)]);
    (loss * (1.0 / M)).backward();
    whole_losses.push_back(loss.item<double>());
  }

  std::vector<StageResult> results(static_cast<size_t>(P));
  LocalGroup group(P);
  std::vector<std::string> split = c.overrides;
  split.push_back("pipeline.stages=" + std::to_string(P));
  test::on_ranks(P, [&](int rank) {
    const Plan plan = with_own_stage(test::plan_of(cfg, P, rank, split));
    ASSERT_EQ(own_stage(plan), rank);
    auto dev = Device::create(DeviceKind::cpu, 0);
    FlatParams flat = FlatParams::allocate(plan, 0, *dev);
    const std::vector<StageTensor> sources = stage_tensors(whole_plan.model, plan.mesh, rank);
    ASSERT_EQ(sources.size(), plan.layout.params.size());
    {
      torch::NoGradGuard ng;
      for (size_t i = 0; i < sources.size(); ++i) tensor_of(plan, flat.params, i).copy_(tensor_of(whole_plan, whole.params, static_cast<size_t>(sources[i].whole)));
    }
    const std::unique_ptr<Communicator> comm = group.join(rank);
    auto model = make_model(plan, flat);
    PipelineStageRunner runner(*model, comm.get(), M, {2, 16, whole_plan.model.hp.hidden_size}, torch::kFloat32);
    StageResult& r = results[static_cast<size_t>(rank)];
    runner.set_trace(&r.trace);
    flat.grads.zero_();
    const std::vector<torch::Tensor> losses = runner.run(
        [&](int m, bool) {
          model->set_dropout(key_of(m), true);
          model->set_loss_gradient(1.0 / M);
          return PipelineStageRunner::Batch{in[static_cast<size_t>(m)], tgt[static_cast<size_t>(m)]};
        },
        [&](const torch::Tensor& loss, int) { return loss * (1.0 / M); }, [](int) {});
    r.most_in_flight = runner.most_in_flight();
    r.most_sends_held = runner.most_sends_held();
    for (const torch::Tensor& l : losses) r.losses.push_back(l.item<double>());
    for (size_t i = 0; i < sources.size(); ++i)
      r.grads[(sources[i].tied_copy ? "copy of " : "") + whole_plan.model.tensors[static_cast<size_t>(sources[i].whole)].name] =
          tensor_of(plan, flat.grads, i).clone();
  });

  // The losses, on the last stage.
  ASSERT_EQ(results.back().losses.size(), static_cast<size_t>(M));
  for (int m = 0; m < M; ++m) EXPECT_NEAR(results.back().losses[static_cast<size_t>(m)], whole_losses[static_cast<size_t>(m)], 1e-5) << "micro " << m;
  // Every tensor's gradient on exactly one stage (a tied table: its two copies summed).
  const double scale = whole.grads.abs().max().item<double>();
  for (size_t i = 0; i < whole_plan.layout.params.size(); ++i) {
    const std::string& name = whole_plan.layout.params[i].name;
    torch::Tensor got;
    int holders = 0;
    for (const StageResult& r : results)
      for (const std::string& key : {name, "copy of " + name})
        if (r.grads.count(key)) {
          got = got.defined() ? got + r.grads.at(key) : r.grads.at(key);
          holders += key == name;
        }
    EXPECT_EQ(holders, 1) << name;
    ASSERT_TRUE(got.defined()) << name;
    EXPECT_LT((got - tensor_of(whole_plan, whole.grads, i)).abs().max().item<double>(), 1e-5 * scale) << name;
  }
  // The schedule: per stage, the 1F1B order, a forward's receive just before it and its send just after, a
  // backward's gradient received just before it and sent back just after; at most min(p - s, m) in flight.
  for (int s = 0; s < P; ++s) {
    std::vector<PipelineEvent> want;
    for (const PipelineOp& op : one_forward_one_backward(P, s, M)) {
      using K = PipelineEvent;
      if (op.forward) {
        if (s > 0) want.push_back({K::received_activation, op.micro});
        want.push_back({K::forward, op.micro});
        if (s < P - 1) want.push_back({K::sent_activation, op.micro});
      } else {
        if (s < P - 1) want.push_back({K::received_gradient, op.micro});
        want.push_back({K::backward, op.micro});
        if (s > 0) want.push_back({K::sent_gradient, op.micro});
      }
    }
    const StageResult& r = results[static_cast<size_t>(s)];
    ASSERT_EQ(r.trace.size(), want.size()) << "stage " << s;
    for (size_t k = 0; k < want.size(); ++k) {
      EXPECT_EQ(r.trace[k].kind, want[k].kind) << "stage " << s << ", event " << k;
      EXPECT_EQ(r.trace[k].micro, want[k].micro) << "stage " << s << ", event " << k;
    }
    EXPECT_EQ(r.most_in_flight, std::min(P - s, M)) << "stage " << s;
    // A send is let go once the schedule says it arrived: its activations in flight, and the gradients the previous
    // stage has not yet used (up to p - s + 1 of them), not every micro-batch's of the step.
    EXPECT_LE(r.most_sends_held, std::min(2 * (P - s) + 1, 2 * M)) << "stage " << s;
  }
}

TEST(PipelineModel, StagesRunningOneForwardOneBackwardGiveTheWholeModelsLossesAndGradients) {
  const std::vector<Case> cases = {
      {{"model.preset=gpt2-tiny"}, 2, 4},  // a tied head: the table's copy on the last stage
      {{"model.preset=llama-tiny", "model.num_layers=5"}, 3, 5},
      {{"model.preset=llama-tiny", "model.num_layers=4", "model.tie_word_embeddings=true"}, 4, 2},  // fewer micro-batches than stages
      // Recomputed blocks redraw their dropout masks in backward, after later micro-batches' forwards; Gemma 2's
      // windows alternate by the whole model's layer number.
      {{"model.preset=gemma2-tiny", "model.sliding_window=4", "model.activation_checkpointing=true", "model.resid_pdrop=0.2"}, 2, 3},
      {{"model.preset=qwen3-tiny", "pipeline.partition=uniform"}, 2, 2},
      // Groups of two blocks recomputed together, counted from each stage's first block (3 + 2 blocks).
      {{"model.preset=gemma2-tiny", "model.num_layers=5", "pipeline.partition=uniform", "model.sliding_window=4",
        "pipeline.activation_checkpoint_interval=2", "model.resid_pdrop=0.2"}, 2, 3},
  };
  for (const Case& c : cases) {
    std::string what;
    for (const std::string& o : c.overrides) what += o + " ";
    SCOPED_TRACE(what + "stages " + std::to_string(c.stages));
    expect_stages_equal_whole(c);
  }
}

TEST(PipelineModel, TheLastStagesTiedCopyStartsAsTheTableEvenWhenItIsTheFirstTensorAShardAsksFor) {
  // A ZeRO shard of the last stage may begin inside the tied head's copy: asked for first, it is the table's draw.
  const std::string cfg = kConfig;
  const Plan whole_plan = test::plan_of(cfg, 1, 0, {"model.preset=gpt2-tiny"});
  torch::Tensor whole = torch::empty({whole_plan.layout.numel}, torch::kFloat32);
  initialise_model(whole_plan, whole, 5);
  const Plan last = with_own_stage(test::plan_of(cfg, 2, 1, {"model.preset=gpt2-tiny", "pipeline.stages=2"}));
  const std::vector<StageTensor> sources = stage_tensors(whole_plan.model, last.mesh, 1);
  ASSERT_TRUE(sources.back().tied_copy);
  InitialWeights drawn(last, 5);
  const int copy = static_cast<int>(sources.size()) - 1;
  const ParamSlot& table = whole_plan.layout.params[static_cast<size_t>(sources.back().whole)];
  EXPECT_EQ(std::memcmp(drawn.param(copy), whole.data_ptr<float>() + table.offset, static_cast<size_t>(table.numel) * 4), 0);
}

TEST(PipelineSchedule, OneForwardOneBackwardFillsThePipelineThenAlternates) {
  // Stage 0 of 4 over 6 micro-batches: 3 forwards to fill, then F/B pairs, then the 3 backwards left.
  std::string order;
  for (const PipelineOp& op : one_forward_one_backward(4, 0, 6)) order += (op.forward ? "F" : "B") + std::to_string(op.micro) + " ";
  EXPECT_EQ(order, "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5 ");
  order.clear();
  for (const PipelineOp& op : one_forward_one_backward(4, 3, 3)) order += (op.forward ? "F" : "B") + std::to_string(op.micro) + " ";
  EXPECT_EQ(order, "F0 B0 F1 B1 F2 B2 ");
  order.clear();
  for (const PipelineOp& op : one_forward_one_backward(4, 1, 1)) order += (op.forward ? "F" : "B") + std::to_string(op.micro) + " ";
  EXPECT_EQ(order, "F0 B0 ");
}

}  // namespace
}  // namespace ds
