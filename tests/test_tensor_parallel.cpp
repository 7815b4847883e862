// Tensor parallelism inside the model (engine/runtime/model/tensor_parallel.hpp, Megatron's scheme): each family's
// blocks split over thread ranks of a tensor group, the embedding and the loss over its vocabulary rows. Every rank
// holds its share of the whole model's weights, cut by the plan's tensor_slice_of and checked here against a cut
// made another way (which heads, which rows); its loss must be the whole model's and its gradients the whole
// model's gradients' shares, to 1e-5 in fp32 (to bf16's rounding in bf16).
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "engine/plan/mesh.hpp"
#include "engine/runtime/comm/comm_local.hpp"
#include "engine/runtime/device/device.hpp"
#include "engine/runtime/model/fused_head_loss.hpp"
#include "engine/runtime/model/language_model.hpp"
#include "engine/runtime/model/tensor_parallel.hpp"
#include "engine/runtime/run/flat_params.hpp"
#include "test_helpers.hpp"

namespace ds {
namespace {

constexpr const char* kConfig = R"({"train_micro_batch_size_per_gpu": 2, "data": {"seq_len": 16}})";

// Tensor `i` of the plan's layout, whole, from the flat buffer `flat` (the plan's layout).
torch::Tensor tensor_of(const Plan& plan, const torch::Tensor& flat, size_t i) {
  const ParamSlot& p = plan.layout.params[i];
  return flat.narrow(0, p.offset, p.numel).view(p.shape);
}

struct Outcome {
  double loss = 0;
  torch::Tensor grads;  // the flat gradients
};

// One forward and backward of `model` on the batch, with dropout keyed `key` (training) or none.
Outcome run_once(LanguageModel& model, FlatParams& flat, const torch::Tensor& in, const torch::Tensor& tgt, bool dropout) {
  flat.grads.zero_();
  model.set_dropout(11, dropout);
  model.set_loss_gradient(1.0);
  const torch::Tensor loss = model.loss(in, tgt);
  loss.backward();
  return {loss.item<double>(), flat.grads.clone()};
}

struct Case {
  std::vector<std::string> overrides;
  int tensor = 2;
  bool masked = false;   // some targets not counted (a prompt's)
  bool dropout = false;  // the residual and embedding dropout, whose masks every rank draws alike
};

void expect_split_equals_whole(const Case& c) {
  std::vector<std::string> split_overrides = c.overrides;
  split_overrides.push_back("tensor_parallel.autotp_size=" + std::to_string(c.tensor));
  const Plan whole_plan = test::plan_of(kConfig, 1, 0, c.overrides);
  const bool bf16 = whole_plan.precision.compute_dtype == Dtype::bf16;
  auto device = Device::create(DeviceKind::cpu, 0);
  FlatParams whole = FlatParams::allocate(whole_plan, 0, *device);
  at::Generator gen = at::detail::createCPUGenerator(3);
  {
    torch::NoGradGuard ng;
    torch::Tensor fp32 = torch::empty({whole_plan.layout.numel}, torch::kFloat32);
    initialise_model(whole_plan, fp32, 5);
    fp32.add_(torch::randn(fp32.sizes(), gen), 0.05);  // no zero biases, no unit gains: every share shows
    whole.params.narrow(0, 0, whole_plan.layout.numel).copy_(fp32);
    for (const torch::Tensor& v : whole.frozen_views) v.copy_(torch::randn(v.sizes(), gen) * 0.1);  // model.freeze's, LoRA's base
  }
  std::vector<size_t> frozen;  // the model's tensor each frozen view is
  for (size_t i = 0; i < whole_plan.model.tensors.size(); ++i)
    if (whole_plan.is_frozen(i)) frozen.push_back(i);
  ASSERT_EQ(frozen.size(), whole.frozen_views.size());
  const ModelSpec& trained = whole_plan.trained();  // what the layout holds: the model's, those not frozen, or LoRA's adapters
  const int64_t V = whole_plan.model.hp.vocab_size;
  const torch::Tensor in = torch::randint(0, V, {2, 16}, gen, torch::kLong);
  torch::Tensor tgt = torch::randint(0, V, {2, 16}, gen, torch::kLong);
  tgt[1][3] = V - 1;  // the last rank's last real row
  if (c.masked) tgt[0].narrow(0, 0, 5).fill_(-1);
  auto whole_model = make_model(whole_plan, whole);
  const Outcome expected = run_once(*whole_model, whole, in, tgt, c.dropout);
  const double tolerance = bf16 ? 2e-2 : 1e-5;

  LocalGroup group(c.tensor);
  test::on_ranks(c.tensor, [&](int rank) {
    const Plan plan = test::plan_of(kConfig, c.tensor, rank, split_overrides);
    ASSERT_EQ(plan.layout.params.size(), whole_plan.layout.params.size());
    auto dev = Device::create(DeviceKind::cpu, 0);
    FlatParams flat = FlatParams::allocate(plan, 0, *dev);
    std::vector<TensorSlice> slices;
    {
      torch::NoGradGuard ng;
      for (size_t i = 0; i < plan.layout.params.size(); ++i) {
        slices.push_back(tensor_slice_of(whole_plan.model, trained.tensors[i], c.tensor, rank));
        const torch::Tensor share = take_share(tensor_of(whole_plan, whole.params, i), slices.back());
        ASSERT_EQ(share.sizes(), torch::IntArrayRef(plan.layout.params[i].shape)) << plan.layout.params[i].name;
        tensor_of(plan, flat.params, i).copy_(share);
      }
      ASSERT_EQ(flat.frozen_views.size(), frozen.size());
      for (size_t k = 0; k < frozen.size(); ++k)
        flat.frozen_views[k].copy_(take_share(whole.frozen_views[k], tensor_slice_of(whole_plan.model, whole_plan.model.tensors[frozen[k]], c.tensor, rank)));
    }
    const std::unique_ptr<Communicator> comm = group.join(rank);
    auto model = make_model(plan, flat, comm.get());
    const Outcome got = run_once(*model, flat, in, tgt, c.dropout);
    const std::string who = "rank " + std::to_string(rank) + " of " + std::to_string(c.tensor);
    EXPECT_NEAR(got.loss, expected.loss, tolerance * expected.loss) << who;
    const double scale = expected.grads.abs().max().item<double>();
    for (size_t i = 0; i < plan.layout.params.size(); ++i) {
      const torch::Tensor want = take_share(tensor_of(whole_plan, expected.grads, i), slices[i]).to(torch::kFloat32);
      const torch::Tensor have = tensor_of(plan, got.grads, i).to(torch::kFloat32);
      EXPECT_LT((want - have).abs().max().item<double>(), tolerance * scale) << who << ": " << plan.layout.params[i].name;
    }
  });
}

TEST(TensorParallelModel, EachFamilySplitOverATensorGroupGivesTheWholeModelsLossAndGradients) {
  const std::vector<Case> cases = {
      {{"model.preset=gpt2-tiny"}},
      {{"model.preset=gpt2-tiny", "model.vocab_size=250"}, 4},  // 63 rows a rank, the last 2 padding
      {{"model.preset=gpt2-tiny", "model.activation_checkpointing=true"}, 2, true},
      {{"model.preset=gpt2-tiny", "model.resid_pdrop=0.2", "model.embd_pdrop=0.2", "model.attn_pdrop=0"}, 2, false, true},
      {{"model.preset=llama-tiny", "model.vocab_size=251"}},
      {{"model.preset=llama-tiny", "model.tie_word_embeddings=true"}, 2, true},
      {{"model.preset=qwen3-tiny"}},
      {{"model.preset=gemma2-tiny", "model.sliding_window=4"}},
      {{"model.preset=phi3-tiny"}, 2, true},
      {{"model.preset=llama-tiny", "bf16.enabled=true"}},
      // Fine-tuning: frozen tensors held as their shares; LoRA's A and B split with their base (B by a column-parallel
      // projection's outputs, A whole and its gradient summed; A by a row-parallel one's inputs, x A^T summed, B whole),
      // a packed projection's B by each part; LoRA dropout as one rank draws it (a row-parallel input's columns cut
      // from the whole input's mask).
      {{"model.preset=gpt2-tiny", R"(model.freeze=["transformer.wte.weight", "transformer.h.0.attn.*", "*.ln_2.*"])"}},
      {{"model.preset=gpt2-tiny", R"(model.lora={"r": 4, "target_modules": ["c_attn", "c_proj", "c_fc"]})"}},
      {{"model.preset=phi3-tiny", R"(model.lora={"r": 4, "target_modules": ["all-linear"]})"}, 2, true},
      {{"model.preset=qwen3-tiny", R"(model.lora={"r": 2, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]})"}},
      {{"model.preset=llama-tiny", "model.vocab_size=251", R"(model.lora={"r": 4, "dropout": 0.2, "target_modules": ["q_proj", "o_proj", "up_proj", "down_proj"]})"},
       2, false, true},
      {{"model.preset=gpt2-tiny", R"(model.lora={"r": 4, "dropout": 0.3, "target_modules": ["c_attn", "c_proj", "c_fc"]})"}, 4, false, true},
  };
  for (const Case& c : cases) {
    std::string what;
    for (const std::string& o : c.overrides) what += o + " ";
    SCOPED_TRACE(what + "tensor " + std::to_string(c.tensor));
    expect_split_equals_whole(c);
  }
}

// The cut itself, by a second route: the whole tensor's elements numbered, each rank's share read back. A
// column-split projection gives each rank its own heads' q, k and v (whole heads, in order, from each part of a
// packed one), a row-split one its rows of the input, the vocabulary its rows then zeros; across the ranks every
// element of the whole appears exactly once.
TEST(TensorParallelModel, EachRanksShareIsItsHeadsItsChannelsOrItsVocabularyRowsAndTheSharesTileTheWhole) {
  for (const std::string preset : {"gpt2-tiny", "phi3-tiny", "llama-tiny"}) {
    const Plan plan = test::plan_of(kConfig, 1, 0, {"model.preset=" + preset, "model.vocab_size=250"});
    const ModelSpec& m = plan.model;
    const ModelHyper& h = m.hp;
    const int t = 2;
    for (const TensorSpec& spec : m.tensors) {
      SCOPED_TRACE(preset + " " + spec.name);
      const torch::Tensor whole = torch::arange(spec.numel, torch::kDouble).view(spec.shape) + 1;  // no element is 0
      std::multiset<double> seen;
      for (int r = 0; r < t; ++r) {
        const torch::Tensor share = take_share(whole, tensor_slice_of(m, spec, t, r));
        EXPECT_EQ(share.numel(), tensor_numel_per_rank(m, spec, t));
        const TensorSplit split = tensor_split_of(m, spec);
        const std::string leaf = spec.name.substr(spec.name.rfind('.', spec.name.rfind('.') - 1) + 1);
        if (split == TensorSplit::whole) {
          EXPECT_TRUE(torch::equal(share, whole));
        }
        if (split == TensorSplit::vocabulary) {  // rows [125 r, 125 (r + 1)) of 250
          EXPECT_TRUE(torch::equal(share, whole.narrow(0, 125 * r, 125)));
        }
        // A packed q|k|v: this rank's q heads, then its k heads, then its v heads, each head's D outputs whole.
        if (split == TensorSplit::column && (leaf == "c_attn.weight" || leaf == "qkv_proj.weight")) {
          const int64_t D = h.head_dim(), NH = h.num_heads, NKV = h.num_kv_heads > 0 ? h.num_kv_heads : NH;
          const bool in_out = h.traits().in_out;
          const torch::Tensor outputs = in_out ? whole : whole.t();  // (in, out)
          std::vector<torch::Tensor> mine;
          mine.push_back(outputs.narrow(1, r * NH / t * D, NH / t * D));
          mine.push_back(outputs.narrow(1, NH * D + r * NKV / t * D, NKV / t * D));
          mine.push_back(outputs.narrow(1, (NH + NKV) * D + r * NKV / t * D, NKV / t * D));
          const torch::Tensor expected = torch::cat(mine, 1);
          EXPECT_TRUE(torch::equal(in_out ? share : share.t(), expected));
        }
        if (split == TensorSplit::column && leaf == "gate_up_proj.weight") {  // [out, in]: gate's rows, then up's
          const int64_t I = h.intermediate_size;
          EXPECT_TRUE(torch::equal(share, torch::cat({whole.narrow(0, r * I / t, I / t), whole.narrow(0, I + r * I / t, I / t)}, 0)));
        }
        if (split == TensorSplit::row) {  // the inputs: [in, out] rows for GPT-2's Conv1D, else [out, in] columns
          const int64_t in = h.traits().in_out ? spec.shape[0] : spec.shape[1];
          const torch::Tensor expected = h.traits().in_out ? whole.narrow(0, r * in / t, in / t) : whole.narrow(1, r * in / t, in / t);
          EXPECT_TRUE(torch::equal(share, expected));
        }
        if (split != TensorSplit::whole) {
          const torch::Tensor flat = share.reshape(-1);
          for (int64_t k = 0; k < flat.numel(); ++k)
            if (flat[k].item<double>() != 0) seen.insert(flat[k].item<double>());
        }
      }
      if (tensor_split_of(m, spec) != TensorSplit::whole) {
        EXPECT_EQ(seen.size(), static_cast<size_t>(spec.numel));
        EXPECT_EQ(std::set<double>(seen.begin(), seen.end()).size(), static_cast<size_t>(spec.numel));
      }
    }
  }
}

// A rank of a split plan starts from its share of the weights one rank draws: initialise_model hands each
// tensor rank the share take_share cuts from the whole model's initial weights.
TEST(TensorParallelModel, ATensorRankDrawsItsShareOfTheWeightsOneRankDraws) {
  const Plan whole = test::plan_of(kConfig, 1, 0, {"model.preset=llama-tiny", "model.vocab_size=251"});
  torch::Tensor all = torch::empty({whole.layout.numel}, torch::kFloat32);
  initialise_model(whole, all, 9);
  for (int rank = 0; rank < 2; ++rank) {
    const Plan plan = test::plan_of(kConfig, 2, rank, {"model.preset=llama-tiny", "model.vocab_size=251", "tensor_parallel.autotp_size=2"});
    torch::Tensor mine = torch::empty({plan.layout.numel}, torch::kFloat32);
    initialise_model(plan, mine, 9, rank);
    for (size_t i = 0; i < plan.layout.params.size(); ++i) {
      const torch::Tensor want = take_share(tensor_of(whole, all, i), tensor_slice_of(whole.model, whole.model.tensors[i], 2, rank));
      EXPECT_TRUE(torch::equal(tensor_of(plan, mine, i), want)) << "rank " << rank << ": " << plan.layout.params[i].name;
    }
  }
}

// A checkpoint of a mesh is the whole model's: every rank's owned elements (its share of its data group's ZeRO
// partition), mapped by whole_segments, hold the whole model's values at the offsets they name, and over the
// world they tile the whole model exactly once (the tensors held whole by tensor rank 0 alone, no padding row).
TEST(TensorParallelModel, WholeSegmentsPutEachRanksElementsAtTheirPlaceInTheWholeModelAndTileIt) {
  for (const auto& [preset, t] : std::vector<std::pair<std::string, int>>{{"gpt2-tiny", 4}, {"llama-tiny", 2}, {"phi3-tiny", 2}}) {
    for (const int stage : {0, 1, 3}) {
      SCOPED_TRACE(preset + " tensor " + std::to_string(t) + " stage " + std::to_string(stage));
      const std::vector<std::string> o = {"model.preset=" + preset, "model.vocab_size=250", "zero_optimization.stage=" + std::to_string(stage)};
      const Plan whole = test::plan_of(kConfig, 1, 0, o);
      const int64_t P = whole.model.num_params;
      const torch::Tensor values = torch::arange(P, torch::kDouble);
      std::vector<int> covered(static_cast<size_t>(P), 0);
      const int data = stage == 0 ? 1 : 2, world = t * data;
      std::vector<std::string> split = o;
      split.push_back("tensor_parallel.autotp_size=" + std::to_string(t));
      for (int rank = 0; rank < world; ++rank) {
        const Plan plan = test::plan_of(kConfig, world, rank, split);
        const MeshCoord at = mesh_coord(plan.mesh.shape, rank);
        // The rank's share in its own layout, then its local buffer as its owned segments lay it out.
        torch::Tensor share = torch::zeros({plan.layout.numel}, torch::kDouble);
        for (size_t i = 0; i < plan.layout.params.size(); ++i)
          tensor_of(plan, share, i).copy_(take_share(tensor_of(whole, values, i), tensor_slice_of(whole.model, whole.model.tensors[i], t, at.tensor)));
        const std::vector<OwnedSegment> owned = owned_segments(plan.layout, at.data);
        int64_t local_numel = 0;
        for (const OwnedSegment& s : owned) local_numel = std::max(local_numel, s.local + s.numel);
        torch::Tensor local = torch::zeros({local_numel}, torch::kDouble);
        for (const OwnedSegment& s : owned) local.narrow(0, s.local, s.numel).copy_(share.narrow(0, s.global, s.numel));
        if (stage == 0 && at.data != 0) continue;  // stage 0: the first data rank's tensor ranks write
        for (const OwnedSegment& g : whole_segments(whole.model, whole.model, plan.own.trained, t, at.tensor, plan.layout, owned, /*writing=*/true)) {
          ASSERT_TRUE(torch::equal(local.narrow(0, g.local, g.numel), values.narrow(0, g.global, g.numel)))
              << "rank " << rank << ": segment at " << g.global << " of " << g.numel;
          for (int64_t k = g.global; k < g.global + g.numel; ++k) ++covered[static_cast<size_t>(k)];
        }
      }
      EXPECT_EQ(std::count(covered.begin(), covered.end(), 1), P) << "every element of the whole model written exactly once";
    }
  }
}

// The loss's traffic is the plan's: per chunk of logits one all-reduce of 2t + 1 fp32 values a row; a small
// chunk makes several calls.
TEST(TensorParallelModel, TheVocabularyParallelLossSendsOneAllReduceOfTwoTPlusOneValuesPerRowAndChunk) {
  constexpr int t = 2;
  constexpr int64_t N = 10, C = 8, V = 13;  // 7 rows a rank, the last one padding
  at::Generator gen = at::detail::createCPUGenerator(4);
  const torch::Tensor x = torch::randn({N, C}, gen), w = torch::randn({V, C}, gen);
  const torch::Tensor targets = torch::randint(0, V, {N}, gen, torch::kLong);
  // The whole loss and gradients by LibTorch's own cross-entropy.
  const torch::Tensor xw = x.clone().requires_grad_(true), ww = w.clone().requires_grad_(true);
  const torch::Tensor whole = torch::nn::functional::cross_entropy(torch::matmul(xw, ww.t()), targets);
  whole.backward();
  LocalGroup group(t);
  test::on_ranks(t, [&](int rank) {
    const std::unique_ptr<Communicator> comm = group.join(rank);
    TensorGroup g{comm.get(), vocab_share(V, t, rank), V};
    const torch::Tensor xs = x.clone().requires_grad_(true);
    const torch::Tensor ws = take_share(w, {0, {{g.vocab.begin, g.vocab.real}}, g.vocab.rows - g.vocab.real}).requires_grad_(true);
    const torch::Tensor loss = vocab_parallel_head_loss(enter_tensor_group(xs, *comm), ws, targets, g, 1.0, 3 * g.vocab.rows);
    loss.backward();
    EXPECT_NEAR(loss.item<double>(), whole.item<double>(), 1e-5);
    EXPECT_TRUE(torch::allclose(xs.grad(), xw.grad(), 1e-5, 1e-6));
    const torch::Tensor want = take_share(ww.grad(), {0, {{g.vocab.begin, g.vocab.real}}, g.vocab.rows - g.vocab.real});
    EXPECT_TRUE(torch::allclose(ws.grad(), want, 1e-5, 1e-6)) << "rank " << rank;
    const CommStats& sent = comm->ledger().at(CollectiveKind::tensor_activations);
    // 3 rows a chunk: 4 chunks of the loss, then x's gradient summed once in backward.
    EXPECT_EQ(sent.calls, 4 + 1);
    const double ring = 2.0 * (t - 1) / t;
    EXPECT_DOUBLE_EQ(sent.bytes, ring * ((2 * t + 1) * N * 4 + N * C * 4));
  });
}

}  // namespace
}  // namespace ds
