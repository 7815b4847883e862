#include "engine/plan/model_spec.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>

#include "common/did_you_mean.hpp"
#include "common/format.hpp"
#include "engine/plan/attention_workspace.hpp"  // what the attention kernels copy, which the plan counts

namespace ds {
namespace {

ModelHyper gpt2_hyper(const char* name, int64_t L, int64_t C, int64_t NH, int64_t V = 50257, int64_t P = 1024) {
  ModelHyper h;
  h.name = name;
  h.arch = ModelArch::gpt2;
  h.vocab_size = V;
  h.hidden_size = C;
  h.num_layers = L;
  h.num_heads = NH;
  h.num_kv_heads = NH;
  h.intermediate_size = 4 * C;
  h.max_position_embeddings = P;
  h.tie_word_embeddings = true;
  h.norm_eps = 1e-5;
  if (V >= 50257) h.bos_token_id = 50256, h.eos_token_id = {50256};  // GPT-2's <|endoftext|>
  return h;
}

ModelHyper llama_hyper(const char* name, int64_t L, int64_t C, int64_t NH, int64_t NKV, int64_t I, int64_t V,
                       int64_t P, bool tied, double eps, double theta, ModelArch arch = ModelArch::llama) {
  ModelHyper h;
  h.name = name;
  h.arch = arch;
  h.vocab_size = V;
  h.hidden_size = C;
  h.num_layers = L;
  h.num_heads = NH;
  h.num_kv_heads = NKV;
  h.intermediate_size = I;
  h.max_position_embeddings = P;
  h.tie_word_embeddings = tied;
  h.norm_eps = eps;
  h.rope_theta = theta;
  // The published models' special tokens: <s>/</s> at 1 and 2 (SentencePiece's in Llama 2, TinyLlama and
  // Mistral 7B v0.1/v0.3; Tekken's in Mistral Nemo) and Llama 3's <|begin_of_text|>/<|end_of_text|>.
  if (V == 32000 || V == 32768 || V == 131072) h.bos_token_id = 1, h.eos_token_id = {2};
  if (V == 128256) h.bos_token_id = 128000, h.eos_token_id = {128001};
  return h;
}

// Published architectures (Hugging Face config.json of each model).
// Llama 3.1 and 3.2 as released: rope_scaling of type llama3 over the 8192 positions Llama 3 was trained at.
ModelHyper llama31(ModelHyper h, double factor) {
  h.rope_scaling.type = RopeType::llama3;
  h.rope_scaling.factor = factor;
  h.rope_scaling.low_freq_factor = 1;
  h.rope_scaling.high_freq_factor = 4;
  h.rope_scaling.original_max_position_embeddings = 8192;
  return h;
}

// Qwen2.5 (q, k, v biases; theta 1e6; <|endoftext|> begins and ends) and Qwen3 (q/k norms, 128-wide heads
// whatever the width; <|im_end|> ends), as their base models' config.json give them.
ModelHyper qwen(ModelArch arch, const char* name, int64_t L, int64_t C, int64_t NH, int64_t NKV, int64_t I, int64_t V, int64_t P,
                bool tied, double eps) {
  ModelHyper h = llama_hyper(name, L, C, NH, NKV, I, V, P, tied, eps, 1000000.0, arch);
  h.bos_token_id = 151643;
  h.eos_token_id = {arch == ModelArch::qwen3 ? int64_t{151645} : int64_t{151643}};
  if (arch == ModelArch::qwen3) h.head_dim_given = C / NH == 128 ? 0 : 128;
  return h;
}

ModelHyper phi3_4k(const char* name, int64_t L, int64_t C, int64_t NH, int64_t NKV, int64_t I) {
  ModelHyper h = llama_hyper(name, L, C, NH, NKV, I, 32064, 4096, false, 1e-5, 10000.0, ModelArch::phi3);
  h.sliding_window = 2047;
  h.bos_token_id = 1;
  h.eos_token_id = {32000};
  return h;
}

// Gemma as released: 256000 tokens (<bos> 2, <eos> 1), 8192 positions, 256-wide heads, tied.
ModelHyper gemma(const char* name, int64_t L, int64_t C, int64_t NH, int64_t NKV, int64_t I) {
  ModelHyper h = llama_hyper(name, L, C, NH, NKV, I, 256000, 8192, true, 1e-6, 10000.0, ModelArch::gemma);
  h.head_dim_given = 256;
  h.bos_token_id = 2;
  h.eos_token_id = {1};
  return h;
}

// Every Gemma feature at test size: one kv head for four query heads (the 2B's multi-query attention) and
// 32-wide heads on a width of 64 (not 64 / 4).
ModelHyper gemma_tiny() {
  ModelHyper h = gemma("gemma-tiny", 2, 64, 4, 1, 176);
  h.head_dim_given = 32;
  h.vocab_size = 256;
  h.max_position_embeddings = 128;
  h.bos_token_id = -1;
  h.eos_token_id = {};
  return h;
}

// Gemma 2 as released: 256000 tokens (<bos> 2, <eos> 1), 8192 positions, a window of 4096 on the even layers,
// scores capped at 50 and logits at 30, tied.
ModelHyper gemma2(const char* name, int64_t L, int64_t C, int64_t NH, int64_t NKV, int64_t D, int64_t I, double query_scalar) {
  ModelHyper h = gemma(name, L, C, NH, NKV, I);  // Gemma's sizes, tokens and positions
  h.arch = ModelArch::gemma2;
  h.head_dim_given = D;
  h.sliding_window = 4096;
  h.attn_softcap = 50;
  h.final_softcap = 30;
  h.query_pre_attn_scalar = query_scalar;
  return h;
}

ModelHyper with_window(ModelHyper h, int64_t window) {
  h.sliding_window = window;
  return h;
}

ModelHyper with_head_dim(ModelHyper h, int64_t d) {
  h.head_dim_given = d;
  return h;
}

// Every Gemma 2 feature at test size: 32-wide heads (not 64 / 4), a window of 8 on the even layers, both caps,
// and a query scalar other than the head width.
ModelHyper gemma2_tiny() {
  ModelHyper h = gemma2("gemma2-tiny", 2, 64, 4, 2, 32, 176, 24);
  h.vocab_size = 256;
  h.max_position_embeddings = 128;
  h.sliding_window = 8;
  h.bos_token_id = -1;
  h.eos_token_id = {};
  return h;
}

const std::vector<ModelHyper>& presets() {
  static const std::vector<ModelHyper> all = {
      gpt2_hyper("gpt2-tiny", 2, 64, 4, 256, 128),  // for tests and the quickstart
      gpt2_hyper("gpt2", 12, 768, 12),
      gpt2_hyper("gpt2-medium", 24, 1024, 16),
      gpt2_hyper("gpt2-large", 36, 1280, 20),
      gpt2_hyper("gpt2-xl", 48, 1600, 25),
      llama_hyper("llama-tiny", 2, 64, 4, 2, 176, 256, 128, false, 1e-5, 10000.0),  // tests
      with_window(llama_hyper("mistral-tiny", 2, 64, 4, 2, 176, 256, 128, false, 1e-5, 10000.0, ModelArch::mistral), 64),  // tests
      llama_hyper("qwen2-tiny", 2, 64, 4, 2, 176, 256, 128, true, 1e-6, 1000000.0, ModelArch::qwen2),                 // tests
      gemma_tiny(),                                                                                                     // tests
      gemma2_tiny(),                                                                                                    // tests
      llama_hyper("phi3-tiny", 2, 64, 4, 2, 176, 256, 128, false, 1e-5, 10000.0, ModelArch::phi3),                      // tests
      with_head_dim(llama_hyper("qwen3-tiny", 2, 64, 4, 2, 176, 256, 128, true, 1e-6, 1000000.0, ModelArch::qwen3), 24),  // tests
      llama_hyper("tinyllama-1.1b", 22, 2048, 32, 4, 5632, 32000, 2048, false, 1e-5, 10000.0),
      llama31(llama_hyper("llama-3.2-1b", 16, 2048, 32, 8, 8192, 128256, 131072, true, 1e-5, 500000.0), 32),
      llama31(llama_hyper("llama-3.2-3b", 28, 3072, 24, 8, 8192, 128256, 131072, true, 1e-5, 500000.0), 32),
      llama31(llama_hyper("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, 131072, false, 1e-5, 500000.0), 8),
      llama31(llama_hyper("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256, 131072, false, 1e-5, 500000.0), 8),
      llama_hyper("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, false, 1e-5, 10000.0),
      llama_hyper("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, 4096, false, 1e-5, 10000.0),
      llama_hyper("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, false, 1e-5, 10000.0),
      llama_hyper("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, false, 1e-5, 500000.0),
      llama_hyper("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, false, 1e-5, 500000.0),
      // Mistral 7B v0.1 attends within 4096 positions; v0.3 (a larger vocabulary, theta 1e6) and Nemo to all.
      with_window(llama_hyper("mistral-7b", 32, 4096, 32, 8, 14336, 32000, 32768, false, 1e-5, 10000.0, ModelArch::mistral), 4096),
      llama_hyper("mistral-7b-v0.3", 32, 4096, 32, 8, 14336, 32768, 32768, false, 1e-5, 1000000.0, ModelArch::mistral),
      with_head_dim(llama_hyper("mistral-nemo-12b", 40, 5120, 32, 8, 14336, 131072, 128000, false, 1e-5, 1000000.0, ModelArch::mistral), 128),
      // Phi-3 mini and medium (4k context, a window of 2047): <s> begins, <|endoftext|> (32000) ends.
      gemma("gemma-2b", 18, 2048, 8, 1, 16384), gemma("gemma-7b", 28, 3072, 16, 16, 24576),
      gemma2("gemma-2-2b", 26, 2304, 8, 4, 256, 9216, 256), gemma2("gemma-2-9b", 42, 3584, 16, 8, 256, 14336, 256),
      gemma2("gemma-2-27b", 46, 4608, 32, 16, 128, 36864, 144),
      phi3_4k("phi-3-mini-4k", 32, 3072, 32, 32, 8192), phi3_4k("phi-3-medium-4k", 40, 5120, 40, 10, 17920),
      qwen(ModelArch::qwen2, "qwen2.5-0.5b", 24, 896, 14, 2, 4864, 151936, 32768, true, 1e-6),
      qwen(ModelArch::qwen2, "qwen2.5-1.5b", 28, 1536, 12, 2, 8960, 151936, 131072, true, 1e-6),
      qwen(ModelArch::qwen2, "qwen2.5-3b", 36, 2048, 16, 2, 11008, 151936, 32768, true, 1e-6),
      qwen(ModelArch::qwen2, "qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, 131072, false, 1e-6),
      qwen(ModelArch::qwen2, "qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064, 131072, false, 1e-5),
      qwen(ModelArch::qwen2, "qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, 131072, false, 1e-5),
      qwen(ModelArch::qwen2, "qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, 131072, false, 1e-5),
      qwen(ModelArch::qwen3, "qwen3-0.6b", 28, 1024, 16, 8, 3072, 151936, 40960, true, 1e-6),
      qwen(ModelArch::qwen3, "qwen3-1.7b", 28, 2048, 16, 8, 6144, 151936, 40960, true, 1e-6),
      qwen(ModelArch::qwen3, "qwen3-4b", 36, 2560, 32, 8, 9728, 151936, 40960, true, 1e-6),
      qwen(ModelArch::qwen3, "qwen3-8b", 36, 4096, 32, 8, 12288, 151936, 40960, false, 1e-6),
      qwen(ModelArch::qwen3, "qwen3-14b", 40, 5120, 40, 8, 17408, 151936, 40960, false, 1e-6),
      qwen(ModelArch::qwen3, "qwen3-32b", 64, 5120, 64, 8, 25600, 151936, 40960, false, 1e-6),
  };
  return all;
}

void add(ModelSpec& s, std::string name, std::vector<int64_t> shape, int layer, bool decay) {
  TensorSpec t;
  t.name = std::move(name);
  t.numel = 1;
  for (int64_t d : shape) t.numel *= d;
  t.shape = std::move(shape);
  t.layer = layer;
  t.weight_decay = decay;
  s.tensors.push_back(std::move(t));
}

void build_gpt2(ModelSpec& s) {
  const auto& h = s.hp;
  const int64_t V = h.vocab_size, C = h.hidden_size, I = h.intermediate_size, P = h.max_position_embeddings;
  add(s, "transformer.wte.weight", {V, C}, -1, true);
  add(s, "transformer.wpe.weight", {P, C}, -1, true);
  for (int l = 0; l < h.num_layers; ++l) {
    const std::string p = "transformer.h." + std::to_string(l) + ".";
    add(s, p + "ln_1.weight", {C}, l, false);
    add(s, p + "ln_1.bias", {C}, l, false);
    add(s, p + "attn.c_attn.weight", {C, 3 * C}, l, true);  // Conv1D: [in, out]
    add(s, p + "attn.c_attn.bias", {3 * C}, l, false);
    add(s, p + "attn.c_proj.weight", {C, C}, l, true);
    add(s, p + "attn.c_proj.bias", {C}, l, false);
    add(s, p + "ln_2.weight", {C}, l, false);
    add(s, p + "ln_2.bias", {C}, l, false);
    add(s, p + "mlp.c_fc.weight", {C, I}, l, true);
    add(s, p + "mlp.c_fc.bias", {I}, l, false);
    add(s, p + "mlp.c_proj.weight", {I, C}, l, true);
    add(s, p + "mlp.c_proj.bias", {C}, l, false);
  }
  add(s, "transformer.ln_f.weight", {C}, -1, false);
  add(s, "transformer.ln_f.bias", {C}, -1, false);
  if (!h.tie_word_embeddings) add(s, "lm_head.weight", {V, C}, -1, true);
}

// Llama and the families that share its block (schema/arch.hpp): in Hugging Face's state_dict order, each
// projection's bias after its weight, Qwen3's q_norm and k_norm after o_proj.
void build_rotary(ModelSpec& s) {
  const auto& h = s.hp;
  const int64_t V = h.vocab_size, C = h.hidden_size, I = h.intermediate_size, D = h.head_dim();
  const int64_t Q = h.num_heads * D, KV = h.num_kv_heads * D;
  add(s, "model.embed_tokens.weight", {V, C}, -1, true);
  for (int l = 0; l < h.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    auto projection = [&](const std::string& name, int64_t out, int64_t in, bool bias) {
      add(s, p + name + ".weight", {out, in}, l, true);  // nn.Linear: [out, in]
      if (bias) add(s, p + name + ".bias", {out}, l, false);
    };
    if (h.traits().fused_qkv) {  // Phi-3 registers o_proj before qkv_proj
      projection("self_attn.o_proj", C, Q, h.o_biased());
      projection("self_attn.qkv_proj", Q + 2 * KV, C, h.qkv_biased());
    } else {
      projection("self_attn.q_proj", Q, C, h.qkv_biased());
      projection("self_attn.k_proj", KV, C, h.qkv_biased());
      projection("self_attn.v_proj", KV, C, h.qkv_biased());
      projection("self_attn.o_proj", C, Q, h.o_biased());
    }
    if (h.traits().qk_norm) {
      add(s, p + "self_attn.q_norm.weight", {D}, l, false);
      add(s, p + "self_attn.k_norm.weight", {D}, l, false);
    }
    if (h.traits().fused_gate_up) {
      projection("mlp.gate_up_proj", 2 * I, C, h.mlp_biased());
    } else {
      projection("mlp.gate_proj", I, C, h.mlp_biased());
      projection("mlp.up_proj", I, C, h.mlp_biased());
    }
    projection("mlp.down_proj", C, I, h.mlp_biased());
    add(s, p + "input_layernorm.weight", {C}, l, false);
    add(s, p + "post_attention_layernorm.weight", {C}, l, false);
    if (h.traits().sandwich_norms) {  // Gemma 2: post_attention_layernorm normalises the attention's output
      add(s, p + "pre_feedforward_layernorm.weight", {C}, l, false);
      add(s, p + "post_feedforward_layernorm.weight", {C}, l, false);
    }
  }
  add(s, "model.norm.weight", {C}, -1, false);
  if (!h.tie_word_embeddings) add(s, "lm_head.weight", {V, C}, -1, true);
}

std::string module_of(const std::string& tensor_name) {
  auto dot = tensor_name.rfind('.');
  return dot == std::string::npos ? tensor_name : tensor_name.substr(0, dot);
}

}  // namespace

const std::vector<std::string>& model_preset_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const auto& p : presets()) n.push_back(p.name);
    return n;
  }();
  return names;
}

ModelHyper model_preset(const std::string& name) {
  for (const auto& p : presets())
    if (p.name == name) return p;
  std::string hint = "known presets: ";
  for (const auto& n : model_preset_names()) hint += n + " ";
  std::string guess = closest_match(name, model_preset_names());
  throw UserError("unknown model preset '" + name + "'" + (guess.empty() ? "" : "; did you mean '" + guess + "'?"),
                  hint);
}

namespace {

// One source's fields over what the model has so far (a preset, then a config.json, then the model block).
void layer_fields(const ModelFields& f, const std::string& preset, ModelHyper& h, std::vector<ConfigIssue>& issues) {
  if (f.arch) {
    if (!preset.empty() && *f.arch != h.arch)
      issues.push_back({"model.arch", std::string("arch '") + model_arch_name(*f.arch) + "' contradicts preset '" + preset + "' (" +
                                          model_arch_name(h.arch) + ")", "remove one of the two"});
    h.arch = *f.arch;
  }
  if (f.vocab_size) h.vocab_size = *f.vocab_size;
  if (f.hidden_size) h.hidden_size = *f.hidden_size;
  if (f.num_layers) h.num_layers = *f.num_layers;
  if (f.num_heads) h.num_heads = *f.num_heads;
  if (f.num_kv_heads) h.num_kv_heads = *f.num_kv_heads;
  if (f.intermediate_size) h.intermediate_size = *f.intermediate_size;
  if (f.max_position_embeddings) h.max_position_embeddings = *f.max_position_embeddings;
  if (f.tie_word_embeddings) h.tie_word_embeddings = *f.tie_word_embeddings;
  if (f.head_dim) h.head_dim_given = *f.head_dim;
  if (f.attention_bias) h.attention_bias = *f.attention_bias;
  if (f.mlp_bias) h.mlp_bias = *f.mlp_bias;
  if (f.sliding_window) h.sliding_window = *f.sliding_window;
  if (f.attn_logit_softcapping) h.attn_softcap = *f.attn_logit_softcapping;
  if (f.final_logit_softcapping) h.final_softcap = *f.final_logit_softcapping;
  if (f.query_pre_attn_scalar) h.query_pre_attn_scalar = *f.query_pre_attn_scalar;
  if (f.norm_eps) h.norm_eps = *f.norm_eps;
  if (f.rope_theta) h.rope_theta = *f.rope_theta;
  if (f.rope_scaling) h.rope_scaling = *f.rope_scaling;
  if (f.attn_pdrop) h.attn_pdrop = *f.attn_pdrop;
  if (f.resid_pdrop) h.resid_pdrop = *f.resid_pdrop;
  if (f.embd_pdrop) h.embd_pdrop = *f.embd_pdrop;
  if (f.bos_token_id) h.bos_token_id = *f.bos_token_id;
  if (f.eos_token_id) h.eos_token_id = *f.eos_token_id;
}

// The model before its own keys: a preset, a Hugging Face config.json over it, or (from scratch) the family's
// defaults for the keys a description may leave out; named "(modified)" when the model block changes sizes.
ModelHyper base_hyper(const ModelConfig& m, std::vector<ConfigIssue>& issues) {
  ModelHyper h;
  bool have_base = false;
  if (!m.preset.empty()) {
    h = model_preset(m.preset);
    have_base = true;
  }
  if (!m.hf_config.empty()) {
    layer_fields(m.from_hf, m.preset, h, issues);
    have_base = true;
    if (m.preset.empty()) h.name = m.hf_config;
  }
  const ModelFields& e = m.explicit_fields;
  if (!have_base) {
    if (!e.arch) {
      issues.push_back({"model", "no architecture given",
                        "set model.preset (e.g. \"gpt2\"), model.hf_config (a config.json), or model.arch with its sizes"});
      throw ConfigError("model", issues);
    }
    h.name = "custom";
    h.arch = *e.arch;
    // Family defaults for keys a from-scratch description may leave out.
    const ArchTraits& t = h.traits();
    h.tie_word_embeddings = t.tied;
    h.norm_eps = t.norm_eps;
    h.rope_theta = t.rope_theta;
    h.vocab_size = t.vocab_size;
    h.max_position_embeddings = t.max_position_embeddings;
  } else if (e.hidden_size || e.num_layers || e.num_heads || e.vocab_size || e.intermediate_size || e.num_kv_heads ||
             e.max_position_embeddings || e.tie_word_embeddings || e.head_dim || e.attention_bias || e.mlp_bias || e.sliding_window ||
             e.attn_logit_softcapping || e.final_logit_softcapping || e.query_pre_attn_scalar) {
    h.name = (m.preset.empty() ? std::string("custom") : m.preset) + " (modified)";
  }
  return h;
}

// Every size within ModelLimits, and the ones nothing can default given.
void check_sizes(const ModelHyper& h, std::vector<ConfigIssue>& issues) {
  for (const auto& [path, v, limit] : {std::tuple{"model.vocab_size", h.vocab_size, ModelLimits::vocab_size},
                                       {"model.hidden_size", h.hidden_size, ModelLimits::hidden_size},
                                       {"model.num_layers", h.num_layers, ModelLimits::num_layers},
                                       {"model.num_heads", h.num_heads, ModelLimits::num_heads},
                                       {"model.num_kv_heads", h.num_kv_heads, ModelLimits::num_heads},
                                       {"model.intermediate_size", h.intermediate_size, ModelLimits::intermediate_size},
                                       {"model.max_position_embeddings", h.max_position_embeddings,
                                        ModelLimits::max_position_embeddings}})
    if (v > limit || v < 0)
      issues.push_back({path, std::to_string(v) + " is outside what ds accepts (0 < " + std::string(path).substr(6) + " <= " +
                                  std::to_string(limit) + ")",
                        "check the value (a typo, or a Hugging Face config.json that is not a model's)"});
  if (!issues.empty()) throw ConfigError("model", issues);
  if (h.hidden_size <= 0) issues.push_back({"model.hidden_size", "missing", "give the model width, e.g. 768"});
  if (h.num_layers <= 0) issues.push_back({"model.num_layers", "missing", "give the number of blocks, e.g. 12"});
  if (h.num_heads <= 0) issues.push_back({"model.num_heads", "missing", "give the number of heads, e.g. 12"});
  if (!issues.empty()) throw ConfigError("model", issues);
}

// Keys of another family refused, and each family's own rules (heads, windows, rope scaling, dropout).
void check_family_keys(const ModelHyper& h, const ModelFields& e, std::vector<ConfigIssue>& issues) {
  const ArchTraits& traits = h.traits();
  const bool learned = traits.positions == Positions::learned;
  // What a key means only for other families: refused, never ignored (schema/arch.hpp says who has what).
  auto not_for = [&](const char* key, bool given, bool has, const std::string& why) {
    if (given && !has)
      issues.push_back({std::string("model.") + key, std::string(traits.name) + " " + why, "remove it, or choose the family that has it"});
  };
  not_for("head_dim", h.head_dim_given > 0, traits.head_dim_key, "heads are hidden_size / num_heads wide");
  not_for("attention_bias", h.attention_bias, traits.attention_bias_key, "attention projections have no such switch");
  not_for("mlp_bias", h.mlp_bias, traits.mlp_bias_key, "MLP projections have no such switch");
  not_for("sliding_window", h.sliding_window > 0, traits.sliding_window_key, "attends to every earlier position");
  not_for("attn_logit_softcapping", h.attn_softcap > 0, traits.softcap_keys, "does not cap its attention scores");
  not_for("final_logit_softcapping", h.final_softcap > 0, traits.softcap_keys, "does not cap its logits");
  not_for("query_pre_attn_scalar", h.query_pre_attn_scalar > 0, traits.softcap_keys, "scales its scores by 1/sqrt(head_dim)");
  if (h.head_dim_given > ModelLimits::hidden_size)
    issues.push_back({"model.head_dim", std::to_string(h.head_dim_given) + " is outside what ds accepts", ""});
  if (h.head_dim_given > 0 && h.head_dim_given % 2 != 0)
    issues.push_back({"model.head_dim", std::to_string(h.head_dim_given) + " is odd: the rotation pairs a head's dimensions", ""});
  if (h.head_dim_given <= 0 && h.hidden_size % h.num_heads != 0)
    issues.push_back({"model.num_heads", "hidden_size " + std::to_string(h.hidden_size) + " is not divisible by num_heads " +
                                             std::to_string(h.num_heads), "choose heads that divide the width"});
  if (h.num_kv_heads > 0 && h.num_heads % h.num_kv_heads != 0)
    issues.push_back({"model.num_kv_heads", "num_heads " + std::to_string(h.num_heads) + " is not a multiple of num_kv_heads " +
                                                std::to_string(h.num_kv_heads), "grouped-query attention needs whole groups"});
  for (const auto& [path, v] : {std::pair{"model.attn_pdrop", h.attn_pdrop}, {"model.resid_pdrop", h.resid_pdrop},
                                {"model.embd_pdrop", h.embd_pdrop}})
    if (!(v >= 0 && v < 1)) issues.push_back({path, "dropout " + std::to_string(v) + " is not in [0, 1)", ""});
  if (!traits.grouped_query && e.num_kv_heads && *e.num_kv_heads != h.num_heads)
    issues.push_back({"model.num_kv_heads", "gpt2 has no grouped-query attention", "remove num_kv_heads or use arch llama"});
  if (learned && h.rope_scaling.type != RopeType::none)
    issues.push_back({"model.rope_scaling", "gpt2 learns its positions: it has no rotary embedding to scale", "remove rope_scaling or use arch llama"});
  if (h.rope_scaling.type == RopeType::llama3 && h.rope_scaling.original_max_position_embeddings < 1)
    issues.push_back({"model.rope_scaling", "llama3 scaling needs original_max_position_embeddings", ""});
  if (traits.rope_original_at_top && h.rope_scaling.type != RopeType::none &&
      (h.rope_scaling.type != RopeType::longrope || h.rope_scaling.attention_factor))
    issues.push_back({"model.rope_scaling", std::string(traits.name) + " takes rope_scaling of type longrope with short_factor and long_factor only",
                      "transformers' Phi3Config refuses any other"});
  if (h.rope_scaling.type == RopeType::longrope && !traits.rope_original_at_top)
    issues.push_back({"model.rope_scaling", "longrope is Phi-3's: transformers computes it for Phi-3's config form", "use arch phi3, or another rope_type"});
  if (traits.window_on_even_layers && h.sliding_window <= 0)
    issues.push_back({"model.sliding_window", std::string(traits.name) + " slides a window on its even layers: it needs one",
                      "give the window (Gemma 2's is 4096)"});
  if (h.rope_scaling.type == RopeType::longrope) {
    if (h.rope_scaling.original_max_position_embeddings < 1)
      issues.push_back({"model.rope_scaling", "longrope scaling needs original_max_position_embeddings", "the context the short factors serve"});
    const size_t pairs = static_cast<size_t>(h.head_dim() / 2);
    if (h.rope_scaling.short_factor.size() != pairs || h.rope_scaling.long_factor.size() != pairs)
      issues.push_back({"model.rope_scaling", "longrope's short_factor and long_factor have " + std::to_string(h.rope_scaling.short_factor.size()) +
                                                  " and " + std::to_string(h.rope_scaling.long_factor.size()) + " factors, not one per pair of a head's " +
                                                  std::to_string(h.head_dim()) + " dimensions (" + std::to_string(pairs) + ")", ""});
  }
}

// The special tokens: GPT-2's BPE end-of-text where that vocabulary is, none outside the vocabulary.
void resolve_special_tokens(const ModelConfig& m, ModelHyper& h, std::vector<ConfigIssue>& issues) {
  const ModelFields& e = m.explicit_fields;
  // A GPT-2 with GPT-2's BPE vocabulary (50257 ids, or padded past it) ends its texts with <|endoftext|>,
  // whatever preset its sizes came from, unless its special tokens were given.
  if (h.arch == ModelArch::gpt2 && h.vocab_size >= 50257 && h.bos_token_id < 0 && h.eos_token_id.empty() && !e.bos_token_id &&
      !e.eos_token_id && !m.from_hf.bos_token_id && !m.from_hf.eos_token_id)
    h.bos_token_id = 50256, h.eos_token_id = {50256};
  // Special tokens outside the vocabulary: a preset's, when the vocabulary was changed, no longer mean
  // anything (dropped); ones given for this model are an error.
  if (h.bos_token_id >= h.vocab_size) {
    if (e.bos_token_id) issues.push_back({"model.bos_token_id", std::to_string(h.bos_token_id) + " is not in the vocabulary of " +
                                                                    std::to_string(h.vocab_size), ""});
    h.bos_token_id = -1;
  }
  for (int64_t id : h.eos_token_id)
    if (id >= h.vocab_size) {
      if (e.eos_token_id)
        issues.push_back({"model.eos_token_id", std::to_string(id) + " is not in the vocabulary of " + std::to_string(h.vocab_size), ""});
      h.eos_token_id.clear();
      break;
    }
}

}  // namespace

ModelHyper resolve_model_hyper(const ModelConfig& m) {
  std::vector<ConfigIssue> issues;
  ModelHyper h = base_hyper(m, issues);
  const ModelFields& e = m.explicit_fields;
  const bool explicit_ffn = e.intermediate_size.has_value() || m.from_hf.intermediate_size.has_value();
  layer_fields(e, m.preset, h, issues);
  check_sizes(h, issues);
  const ArchTraits& traits = h.traits();
  const bool learned = traits.positions == Positions::learned;
  if (!traits.grouped_query || h.num_kv_heads <= 0) h.num_kv_heads = h.num_heads;
  if (h.intermediate_size <= 0 || (learned && !explicit_ffn && e.hidden_size)) h.intermediate_size = learned ? 4 * h.hidden_size : 0;
  if (h.intermediate_size <= 0)
    issues.push_back({"model.intermediate_size", std::string("missing for a ") + traits.name + " model", "give the MLP width, e.g. 11008"});
  check_family_keys(h, e, issues);
  // A width equal to the quotient is no width of its own: the model is the same one either way.
  if (h.head_dim_given > 0 && h.hidden_size % h.num_heads == 0 && h.head_dim_given == h.hidden_size / h.num_heads) h.head_dim_given = 0;
  resolve_special_tokens(m, h, issues);
  if (!issues.empty()) throw ConfigError("model", issues);
  return h;
}

ModelSpec build_model_spec(const ModelHyper& hp) {
  ModelSpec s;
  s.hp = hp;
  switch (hp.traits().positions) {
    case Positions::learned: build_gpt2(s); break;
    case Positions::rotary: build_rotary(s); break;
  }
  std::map<std::string, int64_t> module_params;
  int64_t block0 = 0;
  for (const auto& t : s.tensors) {
    s.num_params += t.numel;
    module_params[module_of(t.name)] += t.numel;
    if (t.layer == 0) block0 += t.numel;
  }
  for (const auto& [name, n] : module_params) s.largest_module_params = std::max(s.largest_module_params, n);
  s.largest_block_params = block0;
  return s;
}

bool is_embedding_table(const TensorSpec& t) {
  return t.name.find("wte") != std::string::npos || t.name.find("wpe") != std::string::npos ||
         t.name.find("embed_tokens") != std::string::npos;
}

bool is_token_table(const TensorSpec& t) { return is_embedding_table(t) && t.name.find("wpe") == std::string::npos; }

double ModelSpec::matmul_params() const {
  double n = 0;
  for (const auto& t : tensors)
    if (t.shape.size() == 2 && !is_embedding_table(t)) n += static_cast<double>(t.numel);
  n += static_cast<double>(hp.vocab_size) * hp.hidden_size;  // output head
  if (!hp.tie_word_embeddings) n -= static_cast<double>(hp.vocab_size) * hp.hidden_size;  // lm_head was in the list
  return n;
}

double ModelSpec::attention_train_flops_per_token(int64_t T) const {
  return 12.0 * hp.num_layers * static_cast<double>(T) * (hp.num_heads * hp.head_dim());
}

double ModelSpec::train_flops_per_token(int64_t T) const { return 6.0 * matmul_params() + attention_train_flops_per_token(T); }

double ModelSpec::block_activation_bytes_per_token(int64_t T, int b, bool library_attention) const {
  // Tensors autograd keeps per token for one block. With the fused causal attention (no attention
  // dropout): the attention keeps q, k, v and one fp32 log-sum-exp per head, nothing of size T.
  //  gpt2:  ln_1 in C, c_attn in C, q k v 3C, c_proj in C, ln_2 in C, c_fc in C, GELU in I,
  //         mlp.c_proj in I                                -> 8C + 2I elements
  //  llama: norm in C, q/k/v proj in C, q after RoPE NH*D, k after RoPE and v NKV*D each, o_proj in
  //         NH*D, norm in C, gate/up in C, gate I, up I (the fused SwiGLU keeps no silu(gate)), down in I
  //                                                        -> 4C + 2 NH*D + 2 NKV*D + 3I elements
  //         (the rotary families alike; biases keep nothing more; measured per family by
  //         Families.TheActivationsEachFamilyKeepsAreWhatThePlanCounts, at 2 and 8 blocks)
  // With attention dropout the probabilities are materialised instead: NH*T elements, and for llama
  // k and v repeated to NH heads (2 NH*D for 2 NKV*D).
  // LibTorch's fused attention (a GPU's, library_attention) keeps the k and v it is given, for llama repeated to NH
  // heads as materialised (2 NH*D; the NKV-head k and v are then kept by nothing: the repeat's backward needs only
  // their shape). Its output is allocated in q's layout (tokens first), so the output projection reads it without a
  // copy: nothing more. On an H200, TinyLlama's 8 x 1024 ran 1.07x the plan without this (1.20 GiB of its 1.77).
  // Plus two fp32 statistics per norm (mean/rstd).
  if (hp.num_layers == 0) return 0;  // a model known only by its size has no blocks to count
  const double C = static_cast<double>(hp.hidden_size), I = static_cast<double>(hp.intermediate_size);
  const double NH = static_cast<double>(hp.num_heads), D = static_cast<double>(hp.head_dim());
  const double NKV = static_cast<double>(hp.num_kv_heads);  // = NH for gpt2
  const bool materialised = hp.attention_materialised(T);
  const bool fused_by_library = library_attention && !materialised;
  // Gemma's (1 + w) norms outside fp32 run as LibTorch ops in fp32: each keeps its input widened and its
  // normalised value (8 C bytes) where the kernel keeps the input alone.
  const bool widened = norms_widened(b);
  const double wide_norms = widened ? (hp.traits().sandwich_norms ? 4 : 2) * 8 * C : 0;
  double elements;
  if (hp.traits().positions == Positions::learned)
    elements = 8 * C + 2 * I;
  else  // widened, the two norms' inputs are their fp32 copies (above)
    elements = (widened ? 2 : 4) * C + 2 * NH * D + 2 * (materialised || fused_by_library ? NH : NKV) * D + 3 * I;
  // Qwen3's per-head norms keep their inputs, q and k before the norm, and two fp32 statistics per head.
  const double head_norms = hp.traits().qk_norm ? (NH + NKV) * D * b + (NH + NKV) * 2 * 4 : 0;
  // Gemma 2: its two more norms keep their inputs (the attention's and the MLP's outputs, C each; widened,
  // their fp32 copies, counted above); GeGLU, not fused, keeps gelu(gate) besides gate and up (I); capped
  // scores keep their tanh (NH T).
  if (hp.traits().sandwich_norms && !widened) elements += 2 * C;
  if (hp.traits().activation == Activation::geglu_tanh) elements += I;
  const double probabilities = NH * static_cast<double>(T) * (hp.attn_softcap > 0 ? 2 : 1);
  if (materialised) return (elements + probabilities) * b + 2 * 2 * 4 + head_norms + wide_norms;
  return elements * b + NH * 4 + 2 * 2 * 4 + head_norms + wide_norms;
}

double ModelSpec::attention_workspace_bytes(int64_t micro_batch, int64_t T, int b, int threads) const {
  // The block path: one block's backward at a time, a block of probabilities and their gradient (the
  // last block, the widest), and the keys' and values' gradients summed in fp32.
  if (hp.num_layers == 0) return 0;
  // The materialised attention: beside the probabilities it keeps, the scores and their masked copy exist
  // while it runs (and the capped scores' two steps), B x NH x T x T each.
  if (hp.attention_materialised(T))
    return (hp.attn_softcap > 0 ? 4.0 : 2.0) * static_cast<double>(micro_batch) * static_cast<double>(hp.num_heads) *
           static_cast<double>(T) * static_cast<double>(T) * b;
  const double NH = static_cast<double>(hp.num_heads), D = static_cast<double>(hp.head_dim());
  const double NKV = static_cast<double>(hp.num_kv_heads);
  const double B = static_cast<double>(micro_batch), rows = static_cast<double>(attention_chunk_rows(micro_batch * hp.num_heads, T));
  const double blocks = 2 * B * NH * rows * static_cast<double>(T) * b + 2 * B * NKV * static_cast<double>(T) * D * 4;
  // The tiled kernels, which the CPU decides (the plan does not know it): the larger of the two paths.
  if (b == 2) {
    // bf16 tiles (AMX or AVX512-BF16; fp16 counted alike): forward's copies of k and v, or backward's
    // per-task copies with one task per (sample, kv head) running at once -- at most `threads` of them.
    const int64_t Bi = micro_batch, NKVi = hp.num_kv_heads, Di = hp.head_dim();
    const double forward = static_cast<double>(workspace::attention_tiles_bf16_forward_bytes(Bi, NKVi, T, Di, threads));
    const double tasks = static_cast<double>(std::min<int64_t>(threads, Bi * NKVi));
    const double backward = tasks * static_cast<double>(workspace::attention_tiles_bf16_backward_task_bytes(T, Di));
    return std::max({blocks, forward, backward});
  }
  // fp32 where the CPU has AVX-512.
  const double tiles = static_cast<double>(workspace::attention_tiles_f32_backward_bytes(micro_batch, hp.num_kv_heads, T, hp.head_dim()));
  return std::max(blocks, tiles);
}

double ModelSpec::head_activation_bytes_per_token(int b) const {
  // The final norm's input (widened: its fp32 copy and normalised value) and the head input's gradient, which
  // the fused head makes in forward with the weight's: the head's input and its logits need no keeping
  // (head_workspace_bytes). The embedding output is the first block's input, kept by its first norm.
  if (!holds_head) return 0;
  const double C = static_cast<double>(hp.hidden_size);
  return (norms_widened(b) ? 8 * C : C * b) + C * b;
}

double ModelSpec::widened_product_bytes(int64_t tokens) const {
  // rows x k by k x n into rows x n (the backward's two products of a projection take the same three sizes).
  const auto copies = [](double rows, double k, double n) { return 4 * (rows * k + k * n + rows * n); };
  const double T = static_cast<double>(tokens);
  double most = 0;
  for (const TensorSpec& t : tensors)
    if (t.layer >= 0 && t.shape.size() == 2) most = std::max(most, copies(T, static_cast<double>(t.shape[0]), static_cast<double>(t.shape[1])));
  if (holds_head) {
    const double rows = static_cast<double>(std::min(tokens, head_chunk_rows(hp.vocab_size)));
    most = std::max(most, copies(rows, static_cast<double>(hp.hidden_size), static_cast<double>(hp.vocab_size)));
  }
  return most;
}

double ModelSpec::head_workspace_bytes(int64_t tokens, int b) const {
  if (!holds_head) return 0;
  // The weight's gradient goes into its flat buffer chunk by chunk (counted with the gradients).
  const double V = static_cast<double>(hp.vocab_size);
  const double rows = static_cast<double>(std::min(tokens, head_chunk_rows(hp.vocab_size)));
  return rows * V * (b + (hp.final_softcap > 0 ? 4 : 0));  // capped logits keep a chunk of their tanh, in fp32
}

std::string preset_for_size(const std::string& text, std::string* note) {
  if (text.size() < 2) return "";
  char unit = static_cast<char>(std::tolower(static_cast<unsigned char>(text.back())));
  if (unit != 'b' && unit != 'm') return "";
  char* end = nullptr;
  std::string num = text.substr(0, text.size() - 1);
  double v = std::strtod(num.c_str(), &end);
  if (end == num.c_str() || *end != '\0' || !(v > 0)) return "";
  const double want = v * (unit == 'b' ? 1e9 : 1e6);
  // Standard architectures a size shorthand means (the common reading of "7b", "350m", ...).
  static const char* standard[] = {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "tinyllama-1.1b", "llama-3.2-3b",
                                   "llama-2-7b", "llama-3-8b", "llama-2-13b", "llama-2-70b"};
  std::string best;
  double best_err = 1e300;
  int64_t best_params = 0;
  for (const char* name : standard) {
    ModelSpec s = build_model_spec(model_preset(name));
    double err = std::fabs(std::log(static_cast<double>(s.num_params) / want));
    if (err < best_err) best_err = err, best = name, best_params = s.num_params;
  }
  if (note) *note = "'" + text + "' read as " + best + " (" + format_si(static_cast<double>(best_params)) + " parameters)";
  return best;
}

}  // namespace ds
