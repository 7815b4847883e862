#include <gtest/gtest.h>

#include <map>

#include "engine/plan/model_spec.hpp"

using namespace ds;

// Published parameter counts (Hugging Face model cards / state_dicts; tied heads counted once).
TEST(ModelPresets, ParameterCountsEqualThePublishedModels) {
  const std::map<std::string, int64_t> published = {
      {"gpt2", 124439808},           {"gpt2-medium", 354823168},    {"gpt2-large", 774030080},
      {"gpt2-xl", 1557611200},       {"llama-2-7b", 6738415616},    {"llama-2-13b", 13015864320},
      {"llama-2-70b", 68976648192},  {"llama-3-8b", 8030261248},    {"llama-3-70b", 70553706496},
      {"mistral-7b", 7241732096},    {"tinyllama-1.1b", 1100048384}, {"llama-3.2-1b", 1235814400},
      {"llama-3.2-3b", 3212749824},  {"llama-3.1-8b", 8030261248},   {"llama-3.1-70b", 70553706496},
      // Mistral 7B v0.3 (vocabulary 32768) and Nemo (128-wide heads on a 5120 width); Qwen2.5 (q, k, v
      // biases; the small ones tied) and Qwen3 (q/k norms, 128-wide heads): their configs' counts, equal to
      // Keras-Hub's presets of the same models and to the model cards' rounded figures.
      {"mistral-7b-v0.3", 7248023552}, {"mistral-nemo-12b", 12247782400},
      {"qwen2.5-0.5b", 494032768},   {"qwen2.5-1.5b", 1543714304},  {"qwen2.5-3b", 3085938688},
      {"qwen2.5-7b", 7615616512},    {"qwen2.5-14b", 14770033664},  {"qwen2.5-32b", 32763876352},
      {"qwen2.5-72b", 72706203648},  {"qwen3-0.6b", 596049920},     {"qwen3-1.7b", 1720574976},
      {"qwen3-4b", 4022468096},      {"qwen3-8b", 8190735360},      {"qwen3-14b", 14768307200},
      {"qwen3-32b", 32762123264},
      // Phi-3 (q|k|v and gate|up fused, untied): mini 3,821,079,552 and medium 13,960,238,080, the model cards' 3.8B and 14B.
      {"phi-3-mini-4k", 3821079552}, {"phi-3-medium-4k", 13960238080},
      // Gemma 2 (tied, four norms a block, 256-wide heads; 27B's 128): 2.61B, 9.24B, 27.2B as the model cards round them.
      {"gemma-2-2b", 2614341888}, {"gemma-2-9b", 9241705984}, {"gemma-2-27b", 27227128320},
      // Gemma (tied, 256-wide heads, the 2B with one kv head): 2,506,172,416 and 8,537,680,896, as counted from
      // google/gemma-2b's and gemma-7b's config.json by hand (embedding V C, per layer q k v o, GeGLU 3 C I, two norms).
      {"gemma-2b", 2506172416}, {"gemma-7b", 8537680896}};
  for (const auto& [name, count] : published)
    EXPECT_EQ(build_model_spec(model_preset(name)).num_params, count) << name;
}

TEST(ModelPresets, TinyPresetsMatchTheirFormula) {
  // gpt2: V*C + P*C + L*(12C^2 + 13C) + 2C (tied head), with C = 64, L = 2, V = 256, P = 128.
  const int64_t C = 64, L = 2, V = 256, P = 128;
  EXPECT_EQ(build_model_spec(model_preset("gpt2-tiny")).num_params, V * C + P * C + L * (12 * C * C + 13 * C) + 2 * C);
  // llama: 2VC (untied) + L*(C*(NH*D) + 2*C*(NKV*D) + (NH*D)*C + 3*C*I + 2C) + C; NH 4, NKV 2, D 16, I 176.
  const int64_t D = 16, NH = 4, NKV = 2, I = 176;
  EXPECT_EQ(build_model_spec(model_preset("llama-tiny")).num_params,
            2 * V * C + L * (C * NH * D + 2 * C * NKV * D + NH * D * C + 3 * C * I + 2 * C) + C);
}

TEST(ModelPresets, TheFamiliesAddTheirTensorsToLlamasCount) {
  // By hand from Hugging Face's modules: Qwen2.5-0.5B, V 151936, C 896, L 24, NH 14, NKV 2, D 64, I 4864, tied:
  // q (C x 896 + 896), k and v (C x 128 + 128 each), o (896 x C, no bias), MLP 3 C I, two norms; the final norm.
  {
    const int64_t V = 151936, C = 896, L = 24, Q = 14 * 64, KV = 2 * 64, I = 4864;
    EXPECT_EQ(build_model_spec(model_preset("qwen2.5-0.5b")).num_params,
              V * C + L * ((C * Q + Q) + 2 * (C * KV + KV) + Q * C + 3 * C * I + 2 * C) + C);
  }
  // Qwen3-0.6B, C 1024, 16 heads of 128 (2048 wide), 8 kv heads, I 3072, tied: no biases, q_norm and k_norm of 128 each.
  {
    const int64_t V = 151936, C = 1024, L = 28, D = 128, Q = 16 * D, KV = 8 * D, I = 3072;
    EXPECT_EQ(build_model_spec(model_preset("qwen3-0.6b")).num_params,
              V * C + L * (C * Q + 2 * C * KV + Q * C + 2 * D + 3 * C * I + 2 * C) + C);
  }
  // The tiny stand-ins: qwen2-tiny's biases, qwen3-tiny's 24-wide heads and norms, mistral-tiny's window.
  const ModelSpec q2 = build_model_spec(model_preset("qwen2-tiny")), q3 = build_model_spec(model_preset("qwen3-tiny"));
  EXPECT_EQ(q2.tensors[2].name, "model.layers.0.self_attn.q_proj.bias");
  EXPECT_EQ(q3.hp.head_dim(), 24);
  EXPECT_EQ(q3.tensors[1].shape, (std::vector<int64_t>{4 * 24, 64}));
  EXPECT_EQ(q3.tensors[5].name, "model.layers.0.self_attn.q_norm.weight");
  EXPECT_EQ(model_preset("mistral-tiny").sliding_window, 64);
}

TEST(ModelPresets, EveryPresetBuilds) {
  for (const auto& name : model_preset_names()) {
    ModelSpec s = build_model_spec(model_preset(name));
    EXPECT_GT(s.num_params, 0) << name;
    int64_t sum = 0;
    for (const auto& t : s.tensors) sum += t.numel;
    EXPECT_EQ(sum, s.num_params) << name;
  }
}

TEST(ModelPresets, UnknownNameSuggestsTheNearestPreset) {
  try {
    model_preset("lama-2-7b");
    FAIL() << "expected an error";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("did you mean 'llama-2-7b'"), std::string::npos) << e.what();
  }
}

TEST(ModelSpecTensors, Gpt2UsesHuggingFaceNamesAndConv1DShapes) {
  ModelSpec s = build_model_spec(model_preset("gpt2"));
  ASSERT_EQ(s.tensors.size(), 2u + 12u * 12u + 2u);
  EXPECT_EQ(s.tensors[0].name, "transformer.wte.weight");
  EXPECT_EQ(s.tensors[0].shape, (std::vector<int64_t>{50257, 768}));
  EXPECT_EQ(s.tensors[4].name, "transformer.h.0.attn.c_attn.weight");
  EXPECT_EQ(s.tensors[4].shape, (std::vector<int64_t>{768, 2304}));  // Conv1D: [in, out]
  EXPECT_EQ(s.tensors.back().name, "transformer.ln_f.bias");
  // DeepSpeed's "largest layer" is the embedding module; a block has 12C^2 + 13C parameters.
  EXPECT_EQ(s.largest_module_params, 50257 * 768);
  EXPECT_EQ(s.largest_block_params, 12 * 768 * 768 + 13 * 768);
}

TEST(ModelSpecTensors, LlamaHasGroupedKvProjectionsAndAnUntiedHead) {
  ModelSpec s = build_model_spec(model_preset("llama-3-8b"));
  EXPECT_EQ(s.tensors[2].name, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(s.tensors[2].shape, (std::vector<int64_t>{1024, 4096}));
  EXPECT_EQ(s.tensors.back().name, "lm_head.weight");
  EXPECT_EQ(s.largest_module_params, 128256LL * 4096);
}

TEST(ModelSpecFlops, FollowsSixNPlusAttention) {
  ModelSpec s = build_model_spec(model_preset("gpt2"));
  // Matmul parameters: blocks' four weight matrices (12 C^2 per layer) plus the output head V*C.
  const double C = 768, L = 12, V = 50257, T = 1024;
  const double expected = 6 * (L * 12 * C * C + V * C) + 12 * L * T * C;
  EXPECT_DOUBLE_EQ(s.train_flops_per_token(1024), expected);
}

TEST(ModelSpecActivations, CheckpointingKeepsLessThanFullActivations) {
  ModelSpec s = build_model_spec(model_preset("gpt2"));
  const double full = s.block_activation_bytes_per_token(1024, 2) * 12;
  const double ckpt = 12 * 768 * 2 + s.block_activation_bytes_per_token(1024, 2);
  EXPECT_LT(ckpt, full);
  // gpt2 block: (8C + 2I) elements + an fp32 log-sum-exp per head + norm statistics; nothing of size T.
  EXPECT_DOUBLE_EQ(s.block_activation_bytes_per_token(1024, 2), (8 * 768 + 2 * 3072) * 2.0 + 12 * 4 + 16);
}

TEST(ResolveModel, ExplicitKeysOverrideThePreset) {
  ModelConfig m;
  m.preset = "gpt2";
  m.explicit_fields.num_layers = 6;
  m.explicit_fields.hidden_size = 384;
  m.explicit_fields.num_heads = 6;
  ModelHyper h = resolve_model_hyper(m);
  EXPECT_EQ(h.num_layers, 6);
  EXPECT_EQ(h.hidden_size, 384);
  EXPECT_EQ(h.intermediate_size, 4 * 384);  // follows the new width
  EXPECT_EQ(h.vocab_size, 50257);           // kept from the preset
}

TEST(ResolveModel, ReportsEveryInconsistencyAtOnce) {
  ModelConfig m;
  m.explicit_fields.arch = ModelArch::llama;
  m.explicit_fields.hidden_size = 100;
  m.explicit_fields.num_layers = 2;
  m.explicit_fields.num_heads = 3;
  m.explicit_fields.num_kv_heads = 2;
  try {
    resolve_model_hyper(m);
    FAIL() << "expected an error";
  } catch (const ConfigError& e) {
    ASSERT_EQ(e.issues().size(), 3u);  // no intermediate_size, heads do not divide, kv heads do not divide
    EXPECT_EQ(e.issues()[0].path, "model.intermediate_size");
  }
}

TEST(ResolveModel, MissingArchitectureNamesTheChoices) {
  try {
    resolve_model_hyper(ModelConfig{});
    FAIL() << "expected an error";
  } catch (const ConfigError& e) {
    EXPECT_NE(e.issues()[0].hint.find("model.preset"), std::string::npos);
  }
}

TEST(SizeShorthand, ResolvesToTheNearestStandardArchitecture) {
  std::string note;
  EXPECT_EQ(preset_for_size("7b", &note), "llama-2-7b");
  EXPECT_NE(note.find("llama-2-7b"), std::string::npos);
  EXPECT_EQ(preset_for_size("13B", &note), "llama-2-13b");
  EXPECT_EQ(preset_for_size("70b", &note), "llama-2-70b");
  EXPECT_EQ(preset_for_size("1.5b", &note), "gpt2-xl");
  EXPECT_EQ(preset_for_size("350m", &note), "gpt2-medium");
  EXPECT_EQ(preset_for_size("124m", &note), "gpt2");
  EXPECT_EQ(preset_for_size("gpt2", &note), "");
  EXPECT_EQ(preset_for_size("b", &note), "");
}
