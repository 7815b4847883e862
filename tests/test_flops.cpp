// Per-module FLOPs against counts written out here from the architectures' definitions (not from the
// tensor list the code walks): every matmul is 2 m n k, backward twice forward, attention over T x T.
#include <gtest/gtest.h>

#include <map>

#include "engine/plan/flops.hpp"

using namespace ds;

namespace {

std::map<std::string, ModuleFlops> by_name(const std::vector<ModuleFlops>& rows) {
  std::map<std::string, ModuleFlops> m;
  for (const auto& r : rows) m[r.name] = r;
  return m;
}

}  // namespace

TEST(ModuleFlops, Gpt2BlocksAttentionMlpAndTheTiedHeadCountEveryMatmul) {
  const ModelSpec spec = build_model_spec(model_preset("gpt2"));
  const double B = 4, T = 128, C = 768, I = 3072, V = 50257, NH = 12, D = 64, N = B * T;
  const auto rows = module_flops(spec, 4, 128, false);
  const auto m = by_name(rows);
  // c_attn [C, 3C] and c_proj [C, C]; scores Q K^T and P V over the full T x T per head.
  const double attn = 2 * N * C * 3 * C + 2 * N * C * C + 2 * (2 * B * NH * T * T * D);
  const double mlp = 2 * N * C * I + 2 * N * I * C;
  EXPECT_DOUBLE_EQ(m.at("transformer.h.5.attn").forward, attn);
  EXPECT_DOUBLE_EQ(m.at("transformer.h.5.attn").backward, 2 * attn);
  EXPECT_DOUBLE_EQ(m.at("transformer.h.5.mlp").forward, mlp);
  EXPECT_DOUBLE_EQ(m.at("transformer.h.5").forward, attn + mlp);  // norms are not matmuls
  EXPECT_DOUBLE_EQ(m.at("transformer.h.5.ln_1").forward, 0);
  EXPECT_EQ(m.at("transformer.h.5.ln_1").params, 2 * 768);
  EXPECT_EQ(m.at("transformer.h.5").params, 12 * 768 * 768 + 13 * 768);
  EXPECT_DOUBLE_EQ(m.at("lm_head").forward, 2 * N * C * V);  // tied: the head's matmul, no parameters
  EXPECT_EQ(m.at("lm_head").params, 0);
  EXPECT_DOUBLE_EQ(m.at("transformer.wte").forward, 0);  // a lookup
  EXPECT_EQ(m.at("transformer.wte").params, 50257 * 768);
  // The whole model, forward and backward, is the plan's model FLOPs; every parameter in one row.
  double total = 0;
  int64_t params = 0;
  for (const auto& r : rows)
    if (r.depth == 1) {
      total += r.total();
      params += r.params;
    }
  EXPECT_DOUBLE_EQ(total, 12 * 3 * (attn + mlp) + 3 * 2 * N * C * V);
  EXPECT_NEAR(total, spec.train_flops_per_token(128) * N, 1e-9 * total);
  EXPECT_EQ(params, spec.num_params);
  // Execution order: embeddings, then each block before its children, final norm, head.
  EXPECT_EQ(rows.front().name, "transformer.wte");
  EXPECT_EQ(rows[2].name, "transformer.h.0");
  EXPECT_EQ(rows[3].name, "transformer.h.0.ln_1");
  EXPECT_EQ(rows.back().name, "lm_head");
}

TEST(ModuleFlops, LlamaWithGroupedQueryAttentionAndRecomputation) {
  const ModelSpec spec = build_model_spec(model_preset("tinyllama-1.1b"));
  const double B = 2, T = 256, C = 2048, I = 5632, V = 32000, NH = 32, KV = 4, D = 64, N = B * T;
  const auto m = by_name(module_flops(spec, 2, 256, true));
  // q and o [C, C], k and v [KV D, C]; gate, up and down [I, C].
  const double attn = 2 * N * (C * C + 2 * C * KV * D + C * C) + 2 * (2 * B * NH * T * T * D);
  const double mlp = 2 * N * 3 * C * I;
  EXPECT_DOUBLE_EQ(m.at("model.layers.21.self_attn").forward, attn);
  EXPECT_DOUBLE_EQ(m.at("model.layers.21.mlp").forward, mlp);
  EXPECT_DOUBLE_EQ(m.at("model.layers.21").recompute, attn + mlp);  // the block's forward again in its backward
  EXPECT_DOUBLE_EQ(m.at("model.layers.21").total(), 4 * (attn + mlp));
  EXPECT_DOUBLE_EQ(m.at("lm_head").forward, 2 * N * C * V);  // untied: its own weight
  EXPECT_EQ(m.at("lm_head").params, 32000 * 2048);
  EXPECT_DOUBLE_EQ(m.at("lm_head").recompute, 0);  // outside the blocks nothing is recomputed
  EXPECT_DOUBLE_EQ(m.at("model.norm").forward, 0);
}

TEST(ModuleFlops, LoraCountsNoWeightGradientForTheFrozenBaseAndTheAdaptersInTheirModule) {
  const ModelSpec spec = build_model_spec(model_preset("tinyllama-1.1b"));
  LoraConfig config;
  config.enabled = true;
  config.r = 16;
  config.target_modules = {"q_proj", "v_proj"};
  std::vector<ConfigIssue> errors;
  const LoraPlan lora = resolve_lora(config, spec, errors);
  ASSERT_TRUE(errors.empty());
  const double B = 2, T = 256, C = 2048, V = 32000, NH = 32, KV = 4, D = 64, N = B * T, r = 16;
  const std::vector<uint8_t> frozen(spec.tensors.size(), 1);
  const auto rows = module_flops(spec, 2, 256, false, frozen, lora);
  const auto m = by_name(rows);
  const double projections = 2 * N * (C * C + 2 * C * KV * D + C * C), core = 2 * (2 * B * NH * T * T * D);
  const double adapters = 2 * N * r * ((C + C) + (C + KV * D));  // q: C -> C, v: C -> KV D
  const auto& attn = m.at("model.layers.3.self_attn");
  EXPECT_DOUBLE_EQ(attn.forward, projections + core + adapters);
  EXPECT_DOUBLE_EQ(attn.backward, projections + 2 * core + 2 * adapters);  // frozen: the input's gradient only
  EXPECT_EQ(attn.params, static_cast<int64_t>(C * C + 2 * C * KV * D + C * C + r * ((C + C) + (C + KV * D))));
  EXPECT_DOUBLE_EQ(m.at("lm_head").backward, 2 * N * C * V);
  double total = 0;
  for (const auto& row : rows)
    if (row.depth == 1) total += row.total();
  EXPECT_NEAR(total, train_flops_per_token(spec, frozen, lora, 256) * N, 1e-9 * total);
}

TEST(ModuleFlops, BlocksBelowEveryTrainedTensorRunForwardOnly) {
  // GPT-2 with its tables and blocks 0-4 frozen: those blocks run forward alone (nothing recomputed either), block 5
  // passes no gradient on yet still computes its frozen matmuls' input gradient where frozen, the tied head is frozen.
  const ModelSpec spec = build_model_spec(model_preset("gpt2"));
  std::vector<uint8_t> frozen(spec.tensors.size(), 0);
  for (size_t i = 0; i < spec.tensors.size(); ++i) {
    const TensorSpec& t = spec.tensors[i];
    frozen[i] = t.name == "transformer.wte.weight" || t.name == "transformer.wpe.weight" || (t.layer >= 0 && t.layer < 5);
  }
  EXPECT_EQ(first_backward_block(spec, frozen, LoraPlan{}), 5);
  const double B = 4, T = 128, C = 768, I = 3072, V = 50257, NH = 12, D = 64, N = B * T;
  const double attn = 2 * N * C * 3 * C + 2 * N * C * C + 2 * (2 * B * NH * T * T * D), mlp = 2 * N * C * I + 2 * N * I * C;
  const auto rows = module_flops(spec, 4, 128, /*recompute=*/true, frozen, LoraPlan{});
  const auto m = by_name(rows);
  for (const char* name : {"transformer.h.0.attn", "transformer.h.4.mlp", "transformer.h.4"}) {
    SCOPED_TRACE(name);
    EXPECT_DOUBLE_EQ(m.at(name).backward, 0.0);
    EXPECT_DOUBLE_EQ(m.at(name).recompute, 0.0);
  }
  EXPECT_DOUBLE_EQ(m.at("transformer.h.4").forward, attn + mlp);
  EXPECT_DOUBLE_EQ(m.at("transformer.h.5.attn").backward, 2 * attn);
  EXPECT_DOUBLE_EQ(m.at("transformer.h.5.attn").recompute, attn);
  EXPECT_DOUBLE_EQ(m.at("lm_head").backward, 2 * N * C * V);  // the frozen table: the input's gradient only
  double total = 0;
  for (const auto& row : rows)
    if (row.depth == 1) total += row.forward + row.backward;  // train_flops_per_token leaves recomputation out
  EXPECT_NEAR(total, train_flops_per_token(spec, frozen, LoraPlan{}, 128) * N, 1e-9 * total);
  // By hand: 12 blocks' forward, 7 blocks' backward (2x), the head 3 x forward less its weight gradient.
  const double head = 2 * N * C * V;
  EXPECT_NEAR(total, 12 * (attn + mlp) + 7 * 2 * (attn + mlp) + head + head, 1e-6 * total);
}
