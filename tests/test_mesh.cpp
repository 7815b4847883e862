// The mesh (engine/plan/mesh.hpp): ranks laid out data x tensor x pipeline, each tensor's share on a tensor
// rank, the blocks cut into stages, the bubble; and the plan that carries it. Every count is checked against
// one computed here another way: from the hyperparameters by formula, or by trying every cut.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <limits>
#include <functional>
#include <set>
#include <tuple>

#include "engine/plan/mesh.hpp"
#include "engine/plan/plan_record.hpp"
#include "engine/plan/runnable.hpp"
#include "test_helpers.hpp"

namespace ds {
namespace {

ModelSpec model_of(const std::string& preset, const std::vector<std::string>& overrides = {}) {
  std::vector<std::string> with = overrides;
  with.push_back("model.preset=" + preset);
  const Config c = load_config_text(R"({"train_micro_batch_size_per_gpu": 1})", "test.json", with);
  return build_model_spec(resolve_model_hyper(c.model));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

TEST(Mesh, RanksAreLaidOutTensorFastestThenDataThenPipeline) {
  const MeshShape m{2, 2, 2};
  for (int r = 0; r < m.world(); ++r) EXPECT_EQ(mesh_rank(m, mesh_coord(m, r)), r);
  using G = std::vector<std::vector<int>>;
  EXPECT_EQ(mesh_groups(m, MeshAxis::tensor), (G{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(mesh_groups(m, MeshAxis::data), (G{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(mesh_groups(m, MeshAxis::pipeline), (G{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  // Any shape: each rank is in exactly one group of each kind, and a group differs along its axis only.
  const MeshShape odd{3, 2, 4};
  for (MeshAxis axis : {MeshAxis::data, MeshAxis::tensor, MeshAxis::pipeline}) {
    std::multiset<int> seen;
    for (const auto& g : mesh_groups(odd, axis)) {
      for (int r : g) seen.insert(r);
      for (int r : g) {
        const MeshCoord a = mesh_coord(odd, g.front()), b = mesh_coord(odd, r);
        EXPECT_EQ(a.data == b.data, axis != MeshAxis::data || r == g.front());
        EXPECT_EQ(a.tensor == b.tensor, axis != MeshAxis::tensor || r == g.front());
        EXPECT_EQ(a.pipeline == b.pipeline, axis != MeshAxis::pipeline || r == g.front());
      }
    }
    EXPECT_EQ(seen.size(), static_cast<size_t>(odd.world()));
    for (int r = 0; r < odd.world(); ++r) EXPECT_EQ(seen.count(r), 1u) << mesh_axis_name(axis) << " rank " << r;
  }
}

TEST(Mesh, EachTensorRankHoldsItsShareAsMegatronSplitsALlamaBlock) {
  const ModelSpec model = model_of("llama-tiny", {"model.vocab_size=250"});  // a vocabulary 2 does not divide
  const ModelHyper& h = model.hp;
  const int64_t C = h.hidden_size, D = h.head_dim(), I = h.intermediate_size, V = h.vocab_size;
  for (int t : {1, 2}) {
    std::vector<ConfigIssue> errors;
    const MeshPlan m = plan_mesh(model, {t, 1}, 2 * t, 8, 1, errors);
    ASSERT_TRUE(errors.empty()) << test::dump(errors);
    // q, k, v, o, gate, up, down split t ways; the two norms whole; the table and head by rows, padded.
    const int64_t block = (C * h.num_heads * D + 2 * C * h.num_kv_heads * D + h.num_heads * D * C + 3 * C * I) / t + 2 * C;
    const int64_t expected = h.num_layers * block + 2 * ceil_div(V, t) * C + C;
    ASSERT_EQ(m.stages.size(), 1u);
    EXPECT_EQ(m.stages[0].params_per_rank, expected) << "tensor " << t;
    if (t == 1) {
      EXPECT_EQ(expected, model.num_params);
    }
  }
  int64_t per_rank_by_kind[4] = {};
  for (const TensorSpec& t : model.tensors) per_rank_by_kind[static_cast<int>(tensor_split_of(model, t))] += t.numel;
  EXPECT_EQ(per_rank_by_kind[static_cast<int>(TensorSplit::row)], h.num_layers * (h.num_heads * D * C + I * C));  // o and down
  EXPECT_EQ(per_rank_by_kind[static_cast<int>(TensorSplit::vocabulary)], 2 * V * C);
}

TEST(Mesh, AGpt2BlocksRowParallelBiasesStayWholeAndATiedHeadIsCopiedToTheLastStage) {
  const ModelSpec model = model_of("gpt2-tiny", {"model.num_layers=4"});
  const ModelHyper& h = model.hp;
  const int64_t C = h.hidden_size, V = h.vocab_size, P = h.max_position_embeddings, t = 2;
  std::vector<ConfigIssue> errors;
  const MeshPlan m = plan_mesh(model, {2, 2, StagePartition::uniform, "uniform"}, 8, 8, 4, errors);
  ASSERT_TRUE(errors.empty()) << test::dump(errors);
  EXPECT_EQ(m.shape.data, 2);
  // c_attn and c_fc split with their biases; both c_proj weights split, their biases whole; ln_1, ln_2 whole.
  const int64_t block = (3 * C * C + 3 * C) / t + C * C / t + C + 4 * C + (4 * C * C + 4 * C) / t + 4 * C * C / t + C;
  const int64_t table = ceil_div(V, t) * C;
  ASSERT_EQ(m.stages.size(), 2u);
  EXPECT_EQ(m.stages[0].blocks, 2);
  EXPECT_EQ(m.stages[0].params_per_rank, 2 * block + table + P * C);  // the position table whole
  EXPECT_EQ(m.stages[1].params_per_rank, 2 * block + 2 * C + table);  // ln_f, and the tied head's copy of the table
  EXPECT_TRUE(m.stages[0].embeddings && !m.stages[0].head && m.stages[1].head && !m.stages[1].embeddings);
  // One stage: the tied table is held once.
  const MeshPlan one = plan_mesh(model, {2, 1}, 2, 8, 1, errors);
  EXPECT_EQ(one.stages[0].params_per_rank, 4 * block + table + P * C + 2 * C);
}

// The least possible largest stage, by trying every cut of the blocks into `p` non-empty runs.
int64_t best_largest_stage(const std::vector<int64_t>& block, int64_t first, int64_t last, int p) {
  const int L = static_cast<int>(block.size());
  int64_t best = std::numeric_limits<int64_t>::max();
  std::vector<int> cut(static_cast<size_t>(p), 1);
  std::function<void(int, int)> go = [&](int s, int left) {
    if (s == p - 1) {
      cut[static_cast<size_t>(s)] = left;
      int64_t largest = 0;
      int b = 0;
      for (int k = 0; k < p; ++k) {
        int64_t load = (k == 0 ? first : 0) + (k == p - 1 ? last : 0);
        for (int i = 0; i < cut[static_cast<size_t>(k)]; ++i) load += block[static_cast<size_t>(b++)];
        largest = std::max(largest, load);
      }
      best = std::min(best, largest);
      return;
    }
    for (int n = 1; n <= left - (p - 1 - s); ++n) {
      cut[static_cast<size_t>(s)] = n;
      go(s + 1, left - n);
    }
  };
  go(0, L);
  return best;
}

TEST(Mesh, StagesCutByParametersMakeTheLargestStageAsSmallAsAnyCut) {
  // A large vocabulary makes the first and last stages heavy: they take fewer blocks.
  for (const auto& [layers, vocab, stages] : std::vector<std::tuple<int, int, int>>{{12, 50000, 4}, {9, 256, 3}, {7, 4096, 7}, {10, 30000, 2}}) {
    const ModelSpec model = model_of("llama-tiny", {"model.num_layers=" + std::to_string(layers), "model.vocab_size=" + std::to_string(vocab)});
    std::vector<ConfigIssue> errors;
    const MeshPlan m = plan_mesh(model, {1, stages}, stages, 8, 8, errors);
    ASSERT_TRUE(errors.empty()) << test::dump(errors);
    const MeshPlan one = plan_mesh(model, {1, 1}, 1, 8, 8, errors);
    const int64_t per_block = (one.stages[0].params_per_rank - 2 * int64_t{vocab} * 64 - 64) / layers;
    const int64_t largest = std::max_element(m.stages.begin(), m.stages.end(), [](auto& a, auto& b) {
                              return a.params_per_rank < b.params_per_rank;
                            })->params_per_rank;
    EXPECT_EQ(largest, best_largest_stage(std::vector<int64_t>(static_cast<size_t>(layers), per_block), int64_t{vocab} * 64,
                                          int64_t{vocab} * 64 + 64, stages))
        << layers << " layers, vocab " << vocab << ", " << stages << " stages";
    int blocks = 0;
    int64_t params = 0;
    for (const PipelineStage& s : m.stages) {
      EXPECT_EQ(s.first_block, blocks);
      EXPECT_GE(s.blocks, 1);
      blocks += s.blocks;
      params += s.params_per_rank;
    }
    EXPECT_EQ(blocks, layers);
    EXPECT_EQ(params, one.stages[0].params_per_rank);  // untied: every tensor on exactly one stage
  }
  // Uniform: the same number of blocks on each, the first ones one more.
  std::vector<ConfigIssue> errors;
  const MeshPlan u = plan_mesh(model_of("llama-tiny", {"model.num_layers=10"}), {1, 4, StagePartition::uniform, "uniform"}, 4, 4, 8, errors);
  std::vector<int> blocks;
  for (const PipelineStage& s : u.stages) blocks.push_back(s.blocks);
  EXPECT_EQ(blocks, (std::vector<int>{3, 3, 2, 2}));
}

TEST(Mesh, TheBubbleAndTheMicroBatchesEachStageHoldsFollowOneForwardOneBackward) {
  EXPECT_DOUBLE_EQ(pipeline_bubble(4, 8), 3.0 / 11.0);
  EXPECT_DOUBLE_EQ(pipeline_bubble(1, 8), 0.0);
  std::vector<ConfigIssue> errors;
  const MeshPlan m = plan_mesh(model_of("llama-tiny", {"model.num_layers=8"}), {1, 4}, 4, 4, 2, errors);
  std::vector<int> in_flight;
  for (const PipelineStage& s : m.stages) in_flight.push_back(s.in_flight);
  EXPECT_EQ(in_flight, (std::vector<int>{2, 2, 2, 1}));  // min(p - s, m) with m = 2
  EXPECT_DOUBLE_EQ(m.bubble, 3.0 / 5.0);
}

TEST(Mesh, AMeshTheModelOrTheWorldCannotTakeIsRefusedNamingTheKey) {
  const ModelSpec model = model_of("llama-tiny");  // 4 heads, 2 kv heads, 176 MLP channels, 2 blocks
  const auto refusal = [&](const MeshRequest& r, int world) {
    std::vector<ConfigIssue> errors;
    const MeshPlan m = plan_mesh(model, r, world, 8, 1, errors);
    EXPECT_EQ(m.stages.empty(), !errors.empty());  // no stages for a mesh that cannot be
    return test::dump(errors);
  };
  EXPECT_NE(refusal({2, 2}, 6).find("pipeline.stages: the 6 ranks do not split into tensor 2 x pipeline 2 groups"), std::string::npos);
  const std::string kv = refusal({4, 1}, 4);
  EXPECT_NE(kv.find("the model's 2 key/value heads do not split over 4 tensor ranks"), std::string::npos) << kv;
  EXPECT_NE(kv.find("choose a tensor size of at most 2"), std::string::npos) << kv;
  EXPECT_EQ(kv.find("attention heads do not split"), std::string::npos) << kv;  // 4 heads split 4 ways
  EXPECT_NE(refusal({1, 3}, 3).find("pipeline.stages: 3 stages for the model's 2 blocks"), std::string::npos);
  const std::string mlp = refusal({2, 1}, 2);
  EXPECT_TRUE(mlp.empty()) << mlp;  // 176 = 2 x 88
  std::vector<ConfigIssue> errors;
  plan_mesh(model_of("llama-tiny", {"model.intermediate_size=174"}), {4, 1}, 4, 8, 1, errors);
  EXPECT_NE(test::dump(errors).find("174 MLP channels (intermediate_size) do not split over 4"), std::string::npos) << test::dump(errors);
  // 9 vocabulary rows over 4 tensor ranks: 3 a rank, and the last would hold only padding.
  errors.clear();
  plan_mesh(model_of("gpt2-tiny", {"model.vocab_size=9"}), {4, 1}, 4, 8, 1, errors);
  EXPECT_NE(test::dump(errors).find("9 vocabulary rows leave tensor rank 3 none of its own"), std::string::npos) << test::dump(errors);
  errors.clear();
  plan_mesh(model_of("gpt2-tiny", {"model.vocab_size=10"}), {4, 1}, 4, 8, 1, errors);  // 3, 3, 3 and 1
  EXPECT_TRUE(errors.empty()) << test::dump(errors);
}

TEST(PlanMesh, TheBatchCountsDataParallelRanksAndTheTrainerRefusesASplitModel) {
  const std::string cfg = R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                              "model": {"preset": "llama-tiny", "num_layers": 4}, "data": {"seq_len": 32},
                              "tensor_parallel": {"autotp_size": 2}, "pipeline": {"stages": 2}})";
  const Plan p = test::plan_of(cfg, 8, 0);
  EXPECT_EQ(p.mesh.shape.data, 2);
  EXPECT_EQ(p.batch.world_size, 2);
  EXPECT_EQ(p.batch.train_batch_size, 2 * 4 * 2);
  ASSERT_EQ(p.mesh.stages.size(), 2u);
  EXPECT_DOUBLE_EQ(p.mesh.bubble, 1.0 / 5.0);
  // Fewer micro-batches than stages is said: half of each step idle with one micro-batch through two stages.
  const auto bubble_warning = [](const Plan& plan) {
    for (const ConfigIssue& w : plan.warnings)
      if (w.path == "gradient_accumulation_steps") return w.message;
    return std::string();
  };
  EXPECT_EQ(bubble_warning(p), "");
  EXPECT_NE(bubble_warning(test::plan_of(cfg, 8, 0, {"gradient_accumulation_steps=1"})).find("50.0% of each step"), std::string::npos);
  // Tensor x pipeline parallel trains (ZeRO 0-1: a pipeline at stage 2-3 is the plan's error); with what it does
  // not run with yet, each is named.
  EXPECT_TRUE(not_yet_runnable(test::plan_of(cfg, 8, 0, {"zero_optimization.stage=1"})).empty());
  EXPECT_THROW(test::plan_of(cfg, 8, 0, {"zero_optimization.stage=2"}), ConfigError);
  // LoRA and model.freeze split with the model, a pipeline stage whose every tensor is frozen too: below every trained
  // tensor it runs forward only, and the stage after it sends it no gradient.
  EXPECT_TRUE(not_yet_runnable(
                  test::plan_of(cfg, 8, 0, {"zero_optimization.stage=1", "model.lora={\"r\": 4, \"dropout\": 0.1, \"target_modules\": [\"q_proj\", \"o_proj\"]}"}))
                  .empty());
  const Plan first_frozen =
      test::plan_of(cfg, 8, 0, {"zero_optimization.stage=1", "model.freeze=[\"model.embed_tokens.weight\", \"model.layers.[01].*\"]"});
  EXPECT_TRUE(not_yet_runnable(first_frozen).empty());
  ASSERT_EQ(first_frozen.mesh.stages.size(), 2u);
  const PipelineStage& s0 = first_frozen.mesh.stages[0];
  const PipelineStage& s1 = first_frozen.mesh.stages[1];
  EXPECT_EQ(first_frozen.backward_from, 2);
  EXPECT_EQ(s0.blocks, 2);
  EXPECT_FALSE(stage_runs_backward(s0, first_frozen.backward_from));
  EXPECT_FALSE(stage_sends_gradient(s1, first_frozen.backward_from));
  const int64_t m = first_frozen.mesh.micro_batches;
  EXPECT_EQ(s0.traffic.pipeline_sends, m);  // its activations on; nothing comes back
  EXPECT_EQ(s1.traffic.pipeline_sends, 0);
  // It keeps no micro-batch's activations between its forward and a backward: none in flight (the record's too).
  const nlohmann::json stages = nlohmann::json::parse(plan_to_json(first_frozen))["mesh"]["stages"];
  EXPECT_EQ(stages[0]["micro_batches_in_flight"], 0);
  EXPECT_EQ(stages[1]["micro_batches_in_flight"], 1);
  // Its blocks keep no activations: against the same blocks frozen with the token table training (a backward through
  // them), its two blocks' for each micro-batch it holds fewer, one block's held while it runs more.
  const Plan trained = test::plan_of(cfg, 8, 0, {"zero_optimization.stage=1", "model.freeze=[\"model.layers.[01].*\"]"});
  EXPECT_EQ(trained.backward_from, 0);
  EXPECT_EQ(trained.mesh.stages[1].traffic.pipeline_sends, m);
  EXPECT_EQ(trained.mesh.stages[1].traffic.pipeline_gradient_sends, m);  // all of them gradients back
  EXPECT_EQ(trained.mesh.stages[0].traffic.pipeline_gradient_sends, 0);
  const ModelSpec share = stage_share(trained.model, trained.mesh, 0);
  const double per_micro_batch = 2.0 * 32 * 2 * share.block_activation_bytes_per_token(32, dtype_bytes(trained.precision.compute_dtype));
  EXPECT_NEAR(trained.mesh.stages[0].memory.device.activations - s0.memory.device.activations, (s0.in_flight - 0.5) * per_micro_batch,
              1e-9 * per_micro_batch);
  // Lamb's per-tensor norms are summed over the data and tensor groups: it trains on any mesh.
  EXPECT_TRUE(not_yet_runnable(test::plan_of(cfg, 8, 0, {"zero_optimization.stage=1", "optimizer.type=Lamb"})).empty());
  // Tensor parallel alone trains, and with its optimizer offloaded (the states a span on the host, as without a mesh).
  EXPECT_TRUE(not_yet_runnable(test::plan_of(cfg, 8, 0, {"~pipeline"})).empty());
  const Plan offloaded = test::plan_of(cfg, 8, 0, {"~pipeline", "zero_optimization.stage=2", "zero_optimization.offload_optimizer.device=cpu"});
  EXPECT_TRUE(not_yet_runnable(offloaded).empty());
  ASSERT_EQ(offloaded.execution.state_spans.size(), 1u);
  EXPECT_EQ(offloaded.execution.state_spans[0].place, Place::host);
  EXPECT_GT(offloaded.memory.host.optimizer_states, 0);
  // DeepSpeed's train_batch_size for this mesh (micro x accumulation x data ranks) is consistent.
  EXPECT_EQ(test::plan_of(cfg, 8, 0, {"train_batch_size=16"}).batch.grad_accum, 4);
  // plan.json carries the mesh; a plain run's is data x 1 x 1 and nothing is refused for it.
  const nlohmann::json j = nlohmann::json::parse(plan_to_json(p));
  EXPECT_EQ(j["mesh"]["tensor"], 2);
  // A resume reads back the ranks its batch counted: the data-parallel ones.
  EXPECT_EQ(read_plan_record(plan_to_json(p), "test").world_size, 2);
  EXPECT_EQ(j["mesh"]["stages"][1]["head"], true);
  EXPECT_EQ(j["mesh"]["stages"][0]["params_per_rank"], p.mesh.stages[0].params_per_rank);
  const Plan plain = test::plan_of(cfg, 8, 0, {"~tensor_parallel", "~pipeline"});
  EXPECT_EQ(plain.mesh.shape.data, 8);
  EXPECT_FALSE(plain.mesh.shape.splits_the_model());
  EXPECT_TRUE(not_yet_runnable(plain).empty());
  // A world the mesh does not divide is the config's error.
  try {
    test::plan_of(cfg, 6, 0);
    ADD_FAILURE() << "6 ranks planned for tensor 2 x pipeline 2";
  } catch (const ConfigError& e) {
    EXPECT_NE(test::dump(e.issues()).find("pipeline.stages: the 6 ranks do not split"), std::string::npos) << test::dump(e.issues());
  }
  // A partition ds does not know is refused by the loader; DeepSpeed's "best" and "type:" are taken.
  EXPECT_NE(test::dump(test::problems(cfg, {"pipeline.partition=random"})).find("pipeline.partition"), std::string::npos);
  EXPECT_TRUE(test::problems(cfg, {"pipeline.partition=type:DecoderLayer"}).empty());
  EXPECT_TRUE(test::problems(cfg, {"pipeline.partition=best"}).empty());
}

TEST(PlanMesh, SizesBeyondTheWorldAndZeroStagesAPipelineCannotTakeAreRefusedNamingTheirKey) {
  const std::string cfg = R"({"train_micro_batch_size_per_gpu": 1, "model": {"preset": "llama-tiny", "num_layers": 4},
                              "data": {"seq_len": 32}})";
  const auto error_of = [&](int world, const std::vector<std::string>& overrides) {
    try {
      test::plan_of(cfg, world, 0, overrides);
    } catch (const ConfigError& e) {
      return test::dump(e.issues());
    }
    return std::string("(planned)");
  };
  // Sizes whose product is beyond 32 bits: an error, not a division by a wrapped product.
  std::string e = error_of(8, {"tensor_parallel.autotp_size=65536", "pipeline.stages=65536"});
  EXPECT_NE(e.find("tensor_parallel.autotp_size: the 8 ranks do not split into tensor 65536 x pipeline 65536"), std::string::npos) << e;
  EXPECT_NE(e.find("launch a multiple of 4294967296 ranks"), std::string::npos) << e;
  // The sizes offered are ones the model takes: of 12's divisors only 1 and 2 split llama-tiny's 4 heads, 2 key/value
  // heads and 176 MLP channels (4 would leave a rank without a key/value head).
  e = error_of(12, {"tensor_parallel.autotp_size=5"});
  EXPECT_NE(e.find("set tensor_parallel.autotp_size to one of: 1, 2]"), std::string::npos) << e;
  for (int t : {1, 2}) EXPECT_TRUE(tensor_split_issues(model_of("llama-tiny").hp, t).empty()) << t;
  for (int t : {3, 4, 6, 12}) EXPECT_FALSE(tensor_split_issues(model_of("llama-tiny").hp, t).empty()) << t;
  // The key named is the one to change: the tensor size divides 16, three stages do not.
  e = error_of(16, {"tensor_parallel.autotp_size=2", "pipeline.stages=3"});
  EXPECT_NE(e.find("pipeline.stages: the 16 ranks do not split"), std::string::npos) << e;
  // A pipeline keeps each stage's gradients and parameters whole: ZeRO 2 and 3 are refused, "auto" takes 1.
  e = error_of(4, {"pipeline.stages=2", "zero_optimization.stage=2"});
  EXPECT_NE(e.find("zero_optimization.stage: stage 2 with pipeline stages"), std::string::npos) << e;
  EXPECT_EQ(error_of(4, {"tensor_parallel.autotp_size=2", "zero_optimization.stage=3"}), "(planned)");  // tensor alone: any stage
  const Plan automatic = test::plan_of(cfg, 4, 0, {"pipeline.stages=2", "zero_optimization.stage=auto"});
  EXPECT_EQ(automatic.zero_stage(), 1);
  // The batch's ranks are called what they are.
  e = error_of(8, {"tensor_parallel.autotp_size=2", "pipeline.stages=2", "train_batch_size=3"});
  EXPECT_NE(e.find("not divisible by micro 1 x data-parallel size 2"), std::string::npos) << e;
  EXPECT_NE(e.find("data-parallel size 2 comes from the 8 ranks of test / (tensor 2 x pipeline 2)"), std::string::npos) << e;
}

TEST(Mesh, ATensorGroupAcrossNodesIsCountedWithTheNodesItSpans) {
  const ModelSpec model = model_of("llama-tiny", {"model.num_heads=8", "model.num_kv_heads=8"});
  std::vector<ConfigIssue> errors;
  const MeshPlan inside = plan_mesh(model, {8, 1}, 16, 8, 1, errors);
  EXPECT_EQ(inside.tensor_groups_across_nodes, 0);
  EXPECT_EQ(inside.tensor_group_nodes, 1);
  const MeshPlan across = plan_mesh(model, {8, 1}, 16, 2, 1, errors);  // 8 nodes of 2 ranks: each group on 4
  ASSERT_TRUE(errors.empty()) << test::dump(errors);
  EXPECT_EQ(across.tensor_groups_across_nodes, 2);
  EXPECT_EQ(across.tensor_group_nodes, 4);
}

TEST(PlanMesh, EachStagesRankIsLaidOutByThePlansMemoryModel) {
  const std::string cfg = R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "bf16": {"enabled": true},
                              "zero_optimization": {"stage": 0}, "model": {"preset": "llama-tiny", "num_layers": 4},
                              "data": {"seq_len": 32}, "tensor_parallel": {"autotp_size": 2}, "pipeline": {"stages": 2}})";
  const Plan p = test::plan_of(cfg, 8, 0);
  ASSERT_EQ(p.mesh.stages.size(), 2u);
  for (const PipelineStage& st : p.mesh.stages) {
    ASSERT_TRUE(st.memory_planned);
    // bf16 weights and gradients, fp32 master weights and two Adam moments, all whole at stage 0.
    const double n = static_cast<double>(st.params_per_rank);
    EXPECT_EQ(st.memory.device.params, 2 * n);
    EXPECT_EQ(st.memory.device.grads, 2 * n);
    EXPECT_EQ(st.memory.device.optimizer_states, 12 * n);
  }
  // The plan's own memory and layout are the heaviest stage's rank: the fit is judged on it.
  ASSERT_GE(p.mesh.heaviest_stage, 0);
  const PipelineStage& heaviest = p.mesh.stages[static_cast<size_t>(p.mesh.heaviest_stage)];
  for (const PipelineStage& st : p.mesh.stages) EXPECT_LE(st.memory.device.total(), heaviest.memory.device.total());
  EXPECT_EQ(p.memory.device.total(), heaviest.memory.device.total());
  EXPECT_EQ(p.layout.numel, heaviest.params_per_rank);
  // Activations: pipeline alone, two blocks a stage. The last stage holds one micro-batch: what a two-block
  // model on its own keeps (the embedding output is the first block's input, counted with it). The first
  // holds min(p, m) of them, and nothing outside the blocks: not the final norm's input, the head input's
  // gradient or the logits.
  const auto act = [&](int accum, int s) {
    return test::plan_of(cfg, 4, 0, {"tensor_parallel.autotp_size=1", "pipeline.partition=uniform",
                                     "gradient_accumulation_steps=" + std::to_string(accum)})
        .mesh.stages[static_cast<size_t>(s)].memory.device.activations;
  };
  const Plan two_blocks = test::plan_of(cfg, 1, 0, {"~tensor_parallel", "~pipeline", "model.num_layers=2", "gradient_accumulation_steps=1"});
  const double width = 2 * 32 * 64 * 2;           // one hidden-wide tensor: 64 tokens x 64 in bf16
  const double logits_chunk = 2 * 32 * 256 * 2;  // the head's chunk of logits: 64 tokens x 256 in bf16
  EXPECT_EQ(act(4, 1), two_blocks.memory.device.activations);
  EXPECT_EQ(act(1, 0), act(1, 1) - logits_chunk - 2 * width);
  const ActivationParts per_micro_batch = activation_parts(two_blocks.model, 2, 32, Dtype::bf16, false, two_blocks.threads);
  EXPECT_EQ(act(4, 0) - act(1, 0), per_micro_batch.kept - 2 * width);
  // Fine-tuning: each stage's rank trains the adapters of its own blocks or its tensors not frozen: bf16 gradients
  // and fp32 master and moments for those (counted here from the whole run's trained tensors by block, a tensor
  // rank's share by hand: LoRA's A whole beside a column-parallel projection and split beside a row-parallel one, B
  // the other way round; a frozen-free tensor's by its split), its frozen share beside.
  const std::vector<std::string> row_parallel = {"o_proj", "down_proj"};
  for (const int t : {1, 2})
    for (const char* trains : {"model.lora={\"r\": 4, \"target_modules\": [\"q_proj\", \"down_proj\"]}",
                               "model.freeze=[\"model.layers.0.*\", \"lm_head.weight\", \"*.q_proj.*\"]"}) {
      SCOPED_TRACE(std::string(trains) + " on tensor " + std::to_string(t));
      const Plan pp = test::plan_of(cfg, 2 * t, 0, {"tensor_parallel.autotp_size=" + std::to_string(t), "pipeline.partition=uniform", trains});
      ASSERT_EQ(pp.mesh.stages.size(), 2u);
      const ModelSpec& whole = pp.trained();
      for (const PipelineStage& st : pp.mesh.stages) {
        ASSERT_TRUE(st.memory_planned);
        double trained = 0;
        for (const TensorSpec& w : whole.tensors) {
          // (llama-tiny's head is untied: the table on the first stage, the final norm and the head on the last)
          if (!(w.layer >= 0 ? w.layer >= st.first_block && w.layer < st.first_block + st.blocks
                             : w.name == "model.embed_tokens.weight" ? st.embeddings : st.head))
            continue;
          const bool adapter_a = w.name.find("lora_A") != std::string::npos, adapter_b = w.name.find("lora_B") != std::string::npos;
          bool row = false;
          for (const std::string& m : row_parallel) row |= w.name.find(m) != std::string::npos;
          const bool norm = w.shape.size() == 1;
          const bool split = adapter_a ? row : adapter_b ? !row : !norm;  // (every trained matrix here is split: q_proj, the others' o, gate, up, down, v, k)
          trained += static_cast<double>(w.numel) / (split ? t : 1);
        }
        EXPECT_EQ(st.memory.device.grads, 2 * trained) << "stage starting at block " << st.first_block;
        EXPECT_EQ(st.memory.device.optimizer_states, 12 * trained) << "stage starting at block " << st.first_block;
      }
    }
}

TEST(PlanMesh, AMemoryCutMakesTheHeaviestStageTheLeastOfEveryCut) {
  // 8 blocks on 4 stages with 8 micro-batches: the first stage holds 4 micro-batches' activations, the last 1 (and
  // the head's copy of the table), so balancing parameters leaves the first stages heaviest.
  const std::string cfg = R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8, "bf16": {"enabled": true},
                              "model": {"preset": "gpt2-tiny", "num_layers": 8}, "data": {"seq_len": 64},
                              "pipeline": {"stages": 4}})";
  const Plan by_memory = test::plan_of(cfg, 4, 0, {"pipeline.partition=memory"});
  const Plan by_parameters = test::plan_of(cfg, 4, 0);
  const auto heaviest = [](const Plan& p) { return p.mesh.stages[static_cast<size_t>(p.mesh.heaviest_stage)].memory.device.total(); };
  std::vector<int> cut;
  for (const PipelineStage& st : by_memory.mesh.stages) cut.push_back(st.blocks);
  // The mesh table's figures are the cut's.
  const std::vector<double> mine = stage_device_bytes(by_memory, cut);
  for (size_t s = 0; s < cut.size(); ++s) EXPECT_DOUBLE_EQ(mine[s], by_memory.mesh.stages[s].memory.device.total()) << "stage " << s;
  // Every cut of 8 blocks into 4 stages: none has a lighter heaviest stage.
  const auto least_of_every_cut = [](const Plan& p) {
    double least = -1;
    for (int a = 1; a <= 5; ++a)
      for (int b = 1; a + b <= 6; ++b)
        for (int c = 1; a + b + c <= 7; ++c) {
          const std::vector<double> bytes = stage_device_bytes(p, {a, b, c, 8 - a - b - c});
          const double most = *std::max_element(bytes.begin(), bytes.end());
          if (least < 0 || most < least) least = most;
        }
    return least;
  };
  EXPECT_DOUBLE_EQ(heaviest(by_memory), least_of_every_cut(by_memory));
  EXPECT_LT(heaviest(by_memory), heaviest(by_parameters));
  EXPECT_GT(cut.back(), cut.front());  // the first stage holds the most activations: it takes fewer blocks
  // With LoRA the stages' memory is the adapters' and the frozen base's: cut by it all the same.
  const Plan lora = test::plan_of(cfg, 4, 0, {"pipeline.partition=memory", "model.lora={\"r\": 4}"});
  EXPECT_FALSE(std::any_of(lora.warnings.begin(), lora.warnings.end(), [](const ConfigIssue& w) { return w.path == "pipeline.partition"; }));
  EXPECT_DOUBLE_EQ(heaviest(lora), least_of_every_cut(lora));
  // model.freeze makes blocks unlike (a frozen one holds no gradient or state; below every trained tensor no
  // activations either): the cut weighs each stage's own blocks, and is still the least of every cut.
  for (const std::string freeze : {R"(model.freeze=["transformer.h.0.*"])", R"(model.freeze=["transformer.h.[4-7].*"])",
                                   R"(model.freeze=["transformer.wte.weight", "transformer.wpe.weight", "transformer.h.[0-2].*"])"}) {
    SCOPED_TRACE(freeze);
    const Plan frozen = test::plan_of(cfg, 4, 0, {"pipeline.partition=memory", freeze});
    EXPECT_DOUBLE_EQ(heaviest(frozen), least_of_every_cut(frozen));
    EXPECT_LE(heaviest(frozen), heaviest(test::plan_of(cfg, 4, 0, {freeze})));
  }
  // Freezing the last four blocks, their stages hold no states: the memory cut gives them more blocks than the
  // cut by parameters does.
  const Plan back = test::plan_of(cfg, 4, 0, {"pipeline.partition=memory", R"(model.freeze=["transformer.h.[4-7].*"])"});
  EXPECT_GT(back.mesh.stages.back().blocks + back.mesh.stages[2].blocks, 4);
}

TEST(PlanMesh, TheMeshsTrafficPerRankIsMegatronsAllReducesAndThePipelinesSends) {
  const std::string cfg = R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "bf16": {"enabled": true},
                              "model": {"preset": "gpt2-tiny", "num_layers": 4}, "data": {"seq_len": 32},
                              "tensor_parallel": {"autotp_size": 2}, "pipeline": {"stages": 2, "partition": "uniform"}})";
  for (const bool recompute : {false, true}) {
    const Plan p = test::plan_of(cfg, 8, 0, {std::string("model.activation_checkpointing=") + (recompute ? "true" : "false")});
    ASSERT_EQ(p.mesh.stages.size(), 2u);
    const double boundary = 2 * 32 * 64 * 4;  // micro 2 x 32 tokens x 64 wide, bf16 summed in fp32 (Gloo)
    const double sent = 2 * 32 * 64 * 2;      // the same sent to the next stage as it is, bf16
    const int64_t per_block = recompute ? 6 : 4;
    // Stage 0: two blocks and the embedding's output; stage 1: two blocks, the head's input gradient and the
    // loss's one chunk (64 rows of 128 vocabulary rows per rank) of 2t + 1 = 5 fp32 values per token. Four
    // micro-batches; a ring of two sends the payload once.
    const MeshTraffic& first = p.mesh.stages[0].traffic;
    EXPECT_EQ(first.tensor_all_reduces, 4 * (2 * per_block + 1));
    EXPECT_EQ(first.tensor_payload_bytes, 4 * (2 * per_block + 1) * boundary);
    EXPECT_EQ(first.tensor_wire_bytes, first.tensor_payload_bytes);
    const MeshTraffic& last = p.mesh.stages[1].traffic;
    EXPECT_EQ(last.tensor_all_reduces, 4 * (2 * per_block + 1 + 1));
    EXPECT_EQ(last.tensor_payload_bytes, 4 * ((2 * per_block + 1) * boundary + 5 * 2 * 32 * 4));
    for (const PipelineStage& st : p.mesh.stages) {
      EXPECT_EQ(st.traffic.pipeline_sends, 4);  // activations on from stage 0, their gradients back from stage 1
      EXPECT_EQ(st.traffic.pipeline_bytes, 4 * sent);
      // the ledger's two kinds: the first stage's are activations, the last stage's their gradients
      const std::vector<MeshCollective> rows = mesh_collectives(st.traffic);
      const CollectiveKind kind = &st == &p.mesh.stages.front() ? CollectiveKind::pipeline_activations : CollectiveKind::pipeline_gradients;
      const auto row = std::find_if(rows.begin(), rows.end(), [](const MeshCollective& c) {
        return c.kind == CollectiveKind::pipeline_activations || c.kind == CollectiveKind::pipeline_gradients;
      });
      ASSERT_NE(row, rows.end());
      EXPECT_EQ(row->kind, kind);
      EXPECT_EQ(row->calls, 4);
      EXPECT_EQ(row->bytes, 4 * sent);
      // GPT-2's head is the token table: once a step the last stage sends its copy's gradient and the first the
      // table's weights back, 128 of the 256 rows on each tensor rank, in bf16 as they are.
      EXPECT_EQ(st.traffic.tied_sends, 1);
      EXPECT_EQ(st.traffic.tied_bytes, 128 * 64 * 2);
    }
  }
  // Lamb: once a step, two fp64 norms per tensor of the stage summed over the tensor group (a ring of two sends the
  // payload once); stage 0 holds the embeddings (wte, wpe) and blocks 0-1, stage 1 blocks 2-3, ln_f and wte's copy.
  const Plan lamb = test::plan_of(cfg, 8, 0, {"optimizer.type=Lamb"});
  const int64_t per_block = 12;  // ln_1, c_attn, attn.c_proj, ln_2, c_fc, mlp.c_proj: weight and bias each
  EXPECT_EQ(lamb.mesh.stages[0].traffic.lamb_all_reduces, 1);
  EXPECT_EQ(lamb.mesh.stages[0].traffic.lamb_bytes, 2 * 8 * (2 + 2 * per_block));
  EXPECT_EQ(lamb.mesh.stages[1].traffic.lamb_bytes, 2 * 8 * (2 * per_block + 2 + 1));
  EXPECT_EQ(test::plan_of(cfg, 8, 0).mesh.stages[0].traffic.lamb_all_reduces, 0);
  // Gradients summed in fp32 (data_types.grad_accum_dtype): the copy's gradient leaves in fp32, the weights in bf16.
  const Plan wide = test::plan_of(cfg, 8, 0, {"data_types.grad_accum_dtype=fp32"});
  EXPECT_EQ(wide.mesh.stages.back().traffic.tied_bytes, 128 * 64 * 4);
  EXPECT_EQ(wide.mesh.stages.front().traffic.tied_bytes, 128 * 64 * 2);
  // Frozen tensors have no norms to sum (stage 0 without wpe and block 0's six pairs), and a frozen tied table
  // nothing to exchange.
  const Plan frozen = test::plan_of(cfg, 8, 0, {"optimizer.type=Lamb", R"(model.freeze=["transformer.wpe.weight", "transformer.wte.weight", "transformer.h.0.*"])"});
  EXPECT_EQ(frozen.mesh.stages[0].traffic.lamb_bytes, 2 * 8 * per_block);
  EXPECT_EQ(frozen.mesh.stages[1].traffic.lamb_bytes, 2 * 8 * (2 * per_block + 2));
  EXPECT_EQ(frozen.mesh.stages[0].traffic.tied_sends, 0);
  EXPECT_EQ(frozen.mesh.stages[1].traffic.tied_bytes, 0);
  // Qwen3's per-head q and k gains: their gradients summed over the tensor group once a block and micro-batch
  // each, none for a frozen gain (4 micro-batches x 2 blocks of q_norm fewer).
  const auto all_reduces = [&](const std::vector<std::string>& more) {
    std::vector<std::string> o = {"model.preset=qwen3-tiny", "model.num_layers=2", "~pipeline"};
    o.insert(o.end(), more.begin(), more.end());
    return test::plan_of(cfg, 2, 0, o).mesh.stages[0].traffic.tensor_all_reduces;
  };
  EXPECT_EQ(all_reduces({}) - all_reduces({R"(model.freeze=["*.q_norm.weight"])"}), 4 * 2);
  // Tensor parallel alone: no sends; four tensor ranks send 2 x 3/4 of the payload.
  const Plan four = test::plan_of(cfg, 4, 0, {"tensor_parallel.autotp_size=4", "~pipeline"});
  ASSERT_EQ(four.mesh.stages.size(), 1u);
  const MeshTraffic& x = four.mesh.stages[0].traffic;
  EXPECT_EQ(x.pipeline_sends, 0);
  EXPECT_DOUBLE_EQ(x.tensor_wire_bytes, 1.5 * x.tensor_payload_bytes);
  // NCCL sums bf16 itself: the activations cross in bf16, half Gloo's fp32 (the loss's values are fp32 on both:
  // 4 micro-batches x 2t + 1 = 9 values x 64 tokens x 4 bytes).
  const Config c = load_config_text(cfg, "test.json", {"tensor_parallel.autotp_size=4", "~pipeline"});
  Topology gpus = test::thread_ranks(4, 0);
  gpus.device = DeviceKind::cuda;
  const Plan on_gpus = compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), gpus);
  const double loss = 4 * 9 * 64 * 4;
  EXPECT_DOUBLE_EQ(x.tensor_payload_bytes - loss, 2 * (on_gpus.mesh.stages[0].traffic.tensor_payload_bytes - loss));
}

}  // namespace
}  // namespace ds
