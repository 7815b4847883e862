// LoRA as the plan sees it: which tensors train, what the frozen base costs, the FLOPs and the
// activations, each against a count made here from the model's sizes.
#include <gtest/gtest.h>

#include <algorithm>

#include "engine/plan/plan.hpp"
#include "schema/loader.hpp"
#include "test_helpers.hpp"

using namespace ds;

namespace {

const char* kTiny = R"({"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": true},
  "model": {"preset": "llama-tiny"}, "data": {"type": "synthetic", "seq_len": 16}, "train": {"steps": 1, "threads": 1}})";

const std::string kAll =
    R"(model.lora={"r": 4, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]})";

// Each projection of a llama block as (in, out), from the sizes alone.
std::vector<std::pair<int64_t, int64_t>> llama_projections(const ModelHyper& hp) {
  const int64_t C = hp.hidden_size, D = hp.hidden_size / hp.num_heads, KV = hp.num_kv_heads * D, I = hp.intermediate_size;
  return {{C, C}, {C, KV}, {C, KV}, {C, C}, {C, I}, {C, I}, {I, C}};
}

}  // namespace

TEST(LoraPlan, TheAdapterIsWhatTrainsAndTheBaseIsFrozenInTheComputeDtype) {
  const Plan full = test::plan_of(kTiny, 1, 0);
  const Plan lora = test::plan_of(kTiny, 1, 0, {kAll});
  const ModelHyper& hp = lora.model.hp;
  ASSERT_TRUE(lora.lora.enabled);
  EXPECT_DOUBLE_EQ(lora.lora.scale, 4.0);

  int64_t adapter = 0;
  for (const auto& [in, out] : llama_projections(hp)) adapter += 4 * (in + out);
  adapter *= hp.num_layers;
  EXPECT_EQ(lora.layout.numel, adapter);
  EXPECT_EQ(lora.lora.adapters.num_params, adapter);
  ASSERT_EQ(lora.layout.params.size(), static_cast<size_t>(2 * 7 * hp.num_layers));
  EXPECT_EQ(lora.layout.params[0].name, "model.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(lora.layout.params[0].shape, (std::vector<int64_t>{4, hp.hidden_size}));
  EXPECT_EQ(lora.layout.params[1].name, "model.layers.0.self_attn.q_proj.lora_B.weight");
  EXPECT_EQ(lora.layout.params[1].shape, (std::vector<int64_t>{hp.hidden_size, 4}));
  EXPECT_EQ(lora.layout.params.back().name, "model.layers.1.mlp.down_proj.lora_B.weight");

  // The base: every parameter of the model, once, bf16 on the device; nothing else of it anywhere.
  EXPECT_EQ(lora.frozen_numel(), full.model.num_params);
  const ZeroBuffer* frozen = lora.execution.find(BufferRole::frozen_params);
  ASSERT_NE(frozen, nullptr);
  EXPECT_EQ(frozen->dtype, Dtype::bf16);
  EXPECT_EQ(frozen->elements, full.model.num_params);
  EXPECT_EQ(full.execution.find(BufferRole::frozen_params), nullptr);

  // Memory: the adapter's weights, gradients (bf16) and states (fp32 master and two moments), plus the base.
  const double padded = static_cast<double>(lora.layout.padded_numel);
  EXPECT_DOUBLE_EQ(lora.memory.device.params, 2.0 * padded + 2.0 * static_cast<double>(full.model.num_params));
  EXPECT_DOUBLE_EQ(lora.memory.device.grads, 2.0 * padded);
  EXPECT_DOUBLE_EQ(lora.memory.device.optimizer_states, 12.0 * padded);
  EXPECT_DOUBLE_EQ(full.memory.device.optimizer_states - lora.memory.device.optimizer_states,
                   12.0 * static_cast<double>(full.layout.padded_numel) - 12.0 * padded);
}

TEST(LoraPlan, FlopsCountNoWeightGradientForTheFrozenBase) {
  const Plan lora = test::plan_of(kTiny, 1, 0, {kAll});
  const ModelHyper& hp = lora.model.hp;
  double matmul = 0;
  for (const auto& [in, out] : llama_projections(hp)) matmul += static_cast<double>(in * out);
  matmul = matmul * static_cast<double>(hp.num_layers) + static_cast<double>(hp.vocab_size * hp.hidden_size);  // the head
  const double attention = 12.0 * static_cast<double>(hp.num_layers * lora.seq_len * hp.hidden_size);
  const double expected = 4.0 * matmul + 6.0 * static_cast<double>(lora.layout.numel) + attention;
  EXPECT_DOUBLE_EQ(lora.train_flops_per_token(), expected);
  EXPECT_DOUBLE_EQ(lora.train_flops_per_step, expected * static_cast<double>(lora.tokens_per_step));
  const Plan full = test::plan_of(kTiny, 1, 0);
  EXPECT_DOUBLE_EQ(full.train_flops_per_token(), 6.0 * matmul + attention);
}

TEST(LoraPlan, TheAdaptersActivationsAreCountedPerBlock) {
  const Plan full = test::plan_of(kTiny, 1, 0);
  const ModelHyper& hp = full.model.hp;
  const double tokens = 4.0 * 16.0;
  // q_proj and down_proj: x A^T (r each) kept per block; with dropout also the dropped input (its mask is a
  // function of a key, recomputed in backward: nothing kept).
  const std::string two = R"(model.lora={"r": 8, "target_modules": ["q_proj", "down_proj"]})";
  const std::string dropped = R"(model.lora={"r": 8, "dropout": 0.1, "target_modules": ["q_proj", "down_proj"]})";
  const Plan plain = test::plan_of(kTiny, 1, 0, {two});
  const Plan with_dropout = test::plan_of(kTiny, 1, 0, {dropped});
  const double L = static_cast<double>(hp.num_layers), C = static_cast<double>(hp.hidden_size), I = static_cast<double>(hp.intermediate_size);
  EXPECT_DOUBLE_EQ(plain.memory.device.activations - full.memory.device.activations, L * tokens * (8 + 8) * 2);
  EXPECT_DOUBLE_EQ(with_dropout.memory.device.activations - full.memory.device.activations,
                   L * tokens * (8 + C + 8 + I) * 2);
  // PEFT's layers_to_transform: block 1's adapters alone, block 0 below them running forward only (its activations
  // not kept either: the same difference as freezing the embeddings and block 0 without an adapter).
  const Plan upper = test::plan_of(kTiny, 1, 0, {two, "model.lora.layers_to_transform=[1]"});
  EXPECT_EQ(upper.lora.layers, std::vector<int64_t>{1});
  EXPECT_EQ(upper.backward_from, 1);
  ASSERT_EQ(upper.lora.adapters.tensors.size(), 4u);
  for (const TensorSpec& t : upper.lora.adapters.tensors) EXPECT_EQ(t.layer, 1) << t.name;
  const Plan frozen_below = test::plan_of(kTiny, 1, 0, {R"(model.freeze=["model.embed_tokens.weight", "model.layers.0.*"])"});
  const Plan frozen_none = test::plan_of(kTiny, 1, 0, {R"(model.freeze=["model.embed_tokens.weight"])"});
  EXPECT_DOUBLE_EQ(upper.memory.device.activations - plain.memory.device.activations,
                   frozen_below.memory.device.activations - frozen_none.memory.device.activations - tokens * (8 + 8) * 2);
  EXPECT_LT(upper.train_flops_per_token(), plain.train_flops_per_token());
}

TEST(LoraPlan, AnUnknownModuleIsRefusedNamingTheModelsAndTheDefaultIsPefts) {
  try {
    test::plan_of(kTiny, 1, 0, {R"(model.lora={"target_modules": ["q_proj", "c_attn"]})"});
    ADD_FAILURE() << "an unknown target module was accepted";
  } catch (const ConfigError& e) {
    const ConfigIssue* i = test::find_issue(e.issues(), "model.lora.target_modules");
    ASSERT_NE(i, nullptr) << test::dump(e.issues());
    EXPECT_NE(i->message.find("'c_attn'"), std::string::npos);
    EXPECT_EQ(i->hint, "its modules are: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj");
  }
  const Plan gpt2 = test::plan_of(kTiny, 1, 0, {"model.preset=gpt2-tiny", "model.lora={}"});
  EXPECT_EQ(gpt2.lora.target_modules, std::vector<std::string>{"c_attn"});
  EXPECT_EQ(gpt2.lora.r, 8);
  bool said = false;
  for (const ResolvedValue& v : gpt2.resolved) said |= v.path == "model.lora.target_modules" && v.value == "c_attn";
  EXPECT_TRUE(said);
  // GPT-2's Conv1D stores (in, out): the adapter is still A (r, in), B (out, r), biases frozen.
  EXPECT_EQ(gpt2.layout.params[0].name, "transformer.h.0.attn.c_attn.lora_A.weight");
  EXPECT_EQ(gpt2.layout.params[0].shape, (std::vector<int64_t>{8, 64}));
  EXPECT_EQ(gpt2.layout.params[1].shape, (std::vector<int64_t>{192, 8}));
  EXPECT_EQ(gpt2.layout.params.size(), 4u);
}

TEST(FreezePlan, FrozenTensorsLeaveTheLayoutForTheFrozenBufferAndLoseTheirWeightGradientFlops) {
  const Plan full = test::plan_of(kTiny, 1, 0);
  const std::string freeze = R"(model.freeze=["model.embed_tokens.weight", "model.layers.0.*"])";
  const Plan p = test::plan_of(kTiny, 1, 0, {freeze});
  const ModelHyper& hp = p.model.hp;
  int64_t frozen = 0, frozen_tensors = 0;
  double frozen_matmul = 0;
  for (const TensorSpec& t : p.model.tensors) {
    const bool is_frozen = t.name == "model.embed_tokens.weight" || t.layer == 0;
    if (!is_frozen) continue;
    frozen += t.numel;
    ++frozen_tensors;
    if (t.layer == 0 && t.shape.size() == 2) frozen_matmul += static_cast<double>(t.numel);  // untied: the embedding is a lookup
  }
  EXPECT_EQ(p.frozen_numel(), frozen);
  EXPECT_EQ(p.layout.numel, full.model.num_params - frozen);
  EXPECT_EQ(p.layout.params.size(), full.layout.params.size() - static_cast<size_t>(frozen_tensors));
  EXPECT_EQ(p.layout.params[0].name, "model.layers.1.self_attn.q_proj.weight");
  const ZeroBuffer* buffer = p.execution.find(BufferRole::frozen_params);
  ASSERT_NE(buffer, nullptr);
  EXPECT_EQ(buffer->elements, frozen);
  EXPECT_DOUBLE_EQ(p.memory.device.optimizer_states, 12.0 * static_cast<double>(p.layout.padded_numel));
  // Block 0 is below every trained tensor: it runs forward only (2 per parameter, not 6; its attention core's
  // forward, a third of the 12 T C per token a block's forward and backward take).
  EXPECT_EQ(p.backward_from, 1);
  const double attention_block = 12.0 * static_cast<double>(p.seq_len) * static_cast<double>(hp.num_heads * hp.head_dim());
  EXPECT_DOUBLE_EQ(p.train_flops_per_token(), full.train_flops_per_token() - 4.0 * frozen_matmul - attention_block * 2.0 / 3.0);
  // Frozen tensors above a trained one still pass the gradient back: 4 per parameter.
  const Plan later = test::plan_of(kTiny, 1, 0, {R"(model.freeze=["model.layers.1.*"])"});
  double later_matmul = 0;
  for (const TensorSpec& t : later.model.tensors)
    if (t.layer == 1 && t.shape.size() == 2) later_matmul += static_cast<double>(t.numel);
  EXPECT_EQ(later.backward_from, 0);
  EXPECT_DOUBLE_EQ(later.train_flops_per_token(), full.train_flops_per_token() - 2.0 * later_matmul);
  // With a tied head, freezing the embedding freezes the head's matmul too.
  const Plan tied = test::plan_of(kTiny, 1, 0, {"model.tie_word_embeddings=true", R"(model.freeze=["model.embed_tokens.weight"])"});
  const Plan tied_full = test::plan_of(kTiny, 1, 0, {"model.tie_word_embeddings=true"});
  EXPECT_DOUBLE_EQ(tied.train_flops_per_token(),
                   tied_full.train_flops_per_token() - 2.0 * static_cast<double>(hp.vocab_size * hp.hidden_size));
  // "[0-15]" is one character (0, 1 or 5), not the numbers 0 to 15: said.
  const Plan slip = test::plan_of(kTiny, 1, 0, {R"(model.freeze=["model.layers.[0-15].*"])"});
  EXPECT_TRUE(std::any_of(slip.warnings.begin(), slip.warnings.end(),
                          [](const ConfigIssue& w) { return w.path == "model.freeze" && w.message.find("not the numbers 0 to 15") != std::string::npos; }));
  // A pattern naming nothing, and freezing everything, are refused.
  for (const std::string& bad : {std::string(R"(model.freeze=["model.layers.9.*"])"), std::string(R"(model.freeze=["*"])")}) {
    try {
      test::plan_of(kTiny, 1, 0, {bad});
      ADD_FAILURE() << bad << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(test::find_issue(e.issues(), "model.freeze"), nullptr) << test::dump(e.issues());
    }
  }
}

TEST(LoraPlan, AtStageThreeOnSeveralRanksTheBasesBlocksArePartitionedAndGatheredWithTheirBlock) {
  // Threshold 100: every matrix of a block is partitioned, the norms (64 elements) stay whole, as do the
  // embedding and the head outside the blocks.
  const std::vector<std::string> o{kAll, "zero_optimization.stage=3", "zero_optimization.stage3_param_persistence_threshold=100",
                                   "gradient_accumulation_steps=2"};
  for (int W : {2, 3}) {
    SCOPED_TRACE(std::to_string(W) + " ranks");
    const Plan p = test::plan_of(kTiny, W, 0, o);
    const int64_t layers = p.model.hp.num_layers;
    int64_t whole = 0, partitions = 0, gathered = 0, largest_block = 0;
    std::vector<int64_t> per_block(static_cast<size_t>(layers), 0);
    for (const TensorSpec& t : p.model.tensors) {
      if (t.layer >= 0 && t.numel >= 100) {
        partitions += (t.numel + W - 1) / W;
        gathered += t.numel;
        per_block[static_cast<size_t>(t.layer)] += t.numel;
      } else {
        whole += t.numel;
      }
    }
    for (int64_t n : per_block) largest_block = std::max(largest_block, n);
    ASSERT_GT(partitions, 0);
    const ZeroBuffer* frozen = p.execution.find(BufferRole::frozen_params);
    const ZeroBuffer* parts = p.execution.find(BufferRole::frozen_partitions);
    ASSERT_NE(frozen, nullptr);
    ASSERT_NE(parts, nullptr);
    EXPECT_EQ(frozen->elements, whole);
    EXPECT_EQ(parts->elements, partitions);
    EXPECT_EQ(parts->place, Place::device);
    const ZeroBuffer* blocks = p.execution.find(BufferRole::frozen_block_params);
    ASSERT_NE(blocks, nullptr);
    EXPECT_EQ(blocks->elements, largest_block);
    EXPECT_EQ(blocks->copies, 2);
    EXPECT_EQ(blocks->dtype, Dtype::bf16);
    EXPECT_EQ(p.execution.find(BufferRole::frozen_staging), nullptr);  // Gloo lands every rank's spans in place
    // The weights a rank holds: its adapter partitions and the base's whole and partitioned tensors, in bf16.
    EXPECT_DOUBLE_EQ(p.memory.device.params, 2.0 * static_cast<double>(p.layout.shard_numel + p.execution.whole_numel + whole + partitions));
    // Each block's frozen tensors gathered before its forward and again before its backward, every micro step.
    const Collective* c = nullptr;
    for (const Collective& x : p.execution.collectives)
      if (x.kind == CollectiveKind::frozen_parameters) c = &x;
    ASSERT_NE(c, nullptr);
    EXPECT_EQ(c->op, CollectiveOp::all_gather);
    EXPECT_EQ(c->calls_per_step, 2 * 2 * layers);
    EXPECT_EQ(c->elements_per_step, 2 * 2 * gathered);
    EXPECT_DOUBLE_EQ(c->wire_bytes_per_rank_per_step, 2.0 * 2 * static_cast<double>(gathered) * 2 * (W - 1) / W);

    // Over NCCL (equal pieces) a gather packs every rank's padded partitions first: a staging buffer for a
    // block's and one for the prefetched block's, and the padding travels.
    Topology gpus = test::thread_ranks(W, 0);
    gpus.device = DeviceKind::cuda;
    gpus.device_memory_bytes = 80.0 * (1 << 30);
    Config config = load_config_text(kTiny, "test.json", o);
    const Plan nccl = compile_plan(config, build_model_spec(resolve_model_hyper(config.model)), gpus);
    int64_t padded = 0, largest_packed = 0;
    std::vector<int64_t> packed(static_cast<size_t>(layers), 0);
    for (const TensorSpec& t : p.model.tensors)
      if (t.layer >= 0 && t.numel >= 100) {
        padded += (t.numel + W - 1) / W * W;
        packed[static_cast<size_t>(t.layer)] += (t.numel + W - 1) / W * W;
      }
    for (int64_t n : packed) largest_packed = std::max(largest_packed, n);
    const ZeroBuffer* staging = nccl.execution.find(BufferRole::frozen_staging);
    ASSERT_NE(staging, nullptr);
    EXPECT_EQ(staging->elements, largest_packed);
    EXPECT_EQ(staging->copies, 2);
    for (const Collective& x : nccl.execution.collectives)
      if (x.kind == CollectiveKind::frozen_parameters) {
        EXPECT_EQ(x.elements_per_step, 2 * 2 * padded);
      }
  }
  // model.freeze of the second block alone: one block's frozen tensors gathered, twice per micro step.
  const Plan second = test::plan_of(kTiny, 2, 0, {R"(model.freeze=["model.layers.1.*"])", "zero_optimization.stage=3",
                                                  "zero_optimization.stage3_param_persistence_threshold=100"});
  for (const Collective& x : second.execution.collectives)
    if (x.kind == CollectiveKind::frozen_parameters) {
      EXPECT_EQ(x.calls_per_step, 2);
    }
  // One rank, or stage 2: the base is whole on every rank and nothing of it is gathered.
  for (const Plan& p : {test::plan_of(kTiny, 1, 0, o), test::plan_of(kTiny, 2, 0, {kAll, "zero_optimization.stage=2"})}) {
    EXPECT_EQ(p.execution.find(BufferRole::frozen_params)->elements, p.model.num_params);
    EXPECT_EQ(p.execution.find(BufferRole::frozen_block_params), nullptr);
    for (const Collective& x : p.execution.collectives) EXPECT_NE(x.kind, CollectiveKind::frozen_parameters);
  }
}

// offload_param puts the frozen base's partitions where it puts the trained ones, on the host: a 70B LoRA whose
// base does not fit the GPUs even partitioned fits with it offloaded. The tensors kept whole stay on the device.
TEST(LoraPlan, OffloadParamPutsTheBasesPartitionsOnTheHost) {
  const std::vector<std::string> o = {kAll, "zero_optimization.stage=3", "zero_optimization.stage3_param_persistence_threshold=100"};
  const Plan kept = test::plan_of(kTiny, 2, 0, o);
  std::vector<std::string> off = o;
  off.push_back("zero_optimization.offload_param.device=cpu");
  const Plan moved = test::plan_of(kTiny, 2, 0, off);
  const ZeroBuffer* parts = moved.execution.find_anywhere(BufferRole::frozen_partitions);
  ASSERT_NE(parts, nullptr);
  EXPECT_EQ(parts->place, Place::host);
  ASSERT_NE(kept.execution.find(BufferRole::frozen_partitions), nullptr);
  EXPECT_EQ(moved.execution.find(BufferRole::frozen_params)->place, Place::device);
  // Exactly the partitions' bytes leave the device for the host, the base's and the adapter's.
  const ZeroBuffer* adapter = moved.execution.find(BufferRole::params, Place::host);
  ASSERT_NE(adapter, nullptr);
  EXPECT_DOUBLE_EQ(kept.memory.device.params - moved.memory.device.params, parts->bytes() + adapter->bytes());
  EXPECT_DOUBLE_EQ(moved.memory.host.params - kept.memory.host.params, parts->bytes() + adapter->bytes());
}
