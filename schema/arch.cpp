#include "schema/arch.hpp"

#include "common/error.hpp"

namespace ds {
namespace {

// Llama's block (RMSNorm, rotary, SwiGLU, grouped-query attention, nn.Linear layouts) with a family's
// name and defaults; the rows below change what differs.
ArchTraits llama_like(ModelArch a, const char* name, const char* hf_class) {
  ArchTraits t{};
  t.arch = a;
  t.name = t.hf_model_type = name;
  t.hf_class = hf_class;
  t.positions = Positions::rotary;
  t.norm = NormKind::rms_norm;
  t.activation = Activation::swiglu;
  t.grouped_query = t.head_dim_key = true;
  t.vocab_size = 32000;
  t.max_position_embeddings = 4096;
  t.norm_eps = 1e-6;  // LlamaConfig's, MistralConfig's, Qwen's rms_norm_eps
  t.rope_theta = 10000.0;
  t.lora_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  t.lora_default_targets = {"q_proj", "v_proj"};  // PEFT's default for each of these families
  t.row_parallel = {"o_proj", "down_proj"};
  return t;
}

std::vector<ArchTraits> make_rows() {
  ArchTraits gpt2{};
  gpt2.arch = ModelArch::gpt2;
  gpt2.name = gpt2.hf_model_type = "gpt2";
  gpt2.hf_class = "GPT2LMHeadModel";
  gpt2.positions = Positions::learned;
  gpt2.norm = NormKind::layer_norm;
  gpt2.activation = Activation::gelu_tanh;
  gpt2.in_out = gpt2.fused_qkv = gpt2.biases_everywhere = gpt2.dropout_keys = true;
  gpt2.tied = true;
  gpt2.vocab_size = 50257;
  gpt2.max_position_embeddings = 1024;
  gpt2.norm_eps = 1e-5;
  gpt2.lora_modules = {"c_attn", "c_proj", "c_fc"};
  gpt2.lora_default_targets = {"c_attn"};
  gpt2.row_parallel = {"c_proj"};  // attn.c_proj and mlp.c_proj

  ArchTraits llama = llama_like(ModelArch::llama, "llama", "LlamaForCausalLM");
  llama.attention_bias_key = llama.mlp_bias_key = true;

  ArchTraits mistral = llama_like(ModelArch::mistral, "mistral", "MistralForCausalLM");
  mistral.attention_bias_key = false;  // MistralAttention has no biases
  mistral.sliding_window_key = true;
  mistral.default_window = 4096;  // MistralConfig's: a config.json turns it off with null
  mistral.max_position_embeddings = 32768;

  ArchTraits qwen2 = llama_like(ModelArch::qwen2, "qwen2", "Qwen2ForCausalLM");
  qwen2.qkv_bias = true;
  qwen2.sliding_window_key = qwen2.use_sliding_window_key = true;
  qwen2.vocab_size = 151936;
  qwen2.max_position_embeddings = 32768;
  qwen2.norm_eps = 1e-6;

  ArchTraits qwen3 = llama_like(ModelArch::qwen3, "qwen3", "Qwen3ForCausalLM");
  qwen3.attention_bias_key = qwen3.qk_norm = qwen3.sliding_window_key = qwen3.use_sliding_window_key = true;
  qwen3.default_head_dim = 128;
  qwen3.vocab_size = 151936;
  qwen3.max_position_embeddings = 32768;
  qwen3.norm_eps = 1e-6;
  // Phi-3: Llama's block with q|k|v and gate|up each made by one projection, dropout after each sub-layer
  // (resid_pdrop), and an attention window in the 4k models. PEFT has no default target_modules for it.
  ArchTraits phi3 = llama_like(ModelArch::phi3, "phi3", "Phi3ForCausalLM");
  phi3.fused_qkv = phi3.fused_gate_up = phi3.sliding_window_key = phi3.dropout_keys = true;
  phi3.vocab_size = 32064;
  phi3.norm_eps = 1e-5;
  phi3.rope_original_at_top = true;
  phi3.lora_modules = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"};
  phi3.lora_default_targets = {};
  // Gemma 2: (1 + w) RMSNorms, four per block, the embedding scaled by sqrt(width), GeGLU, attention scores
  // scaled by query_pre_attn_scalar^-1/2 and soft-capped, the final logits soft-capped, a window on the even
  // layers, 256-wide heads, a tied head.
  // Gemma (1): Llama's block with (1 + w) RMSNorms, the embedding scaled by sqrt(width), GeGLU with the tanh
  // GELU, 256-wide heads (one kv head in the 2B), a tied head.
  ArchTraits gemma = llama_like(ModelArch::gemma, "gemma", "GemmaForCausalLM");
  gemma.activation = Activation::geglu_tanh;
  gemma.attention_bias_key = gemma.norm_plus_one = gemma.embedding_scaled = true;
  gemma.tied = true;
  gemma.default_head_dim = 256;
  gemma.vocab_size = 256000;
  gemma.max_position_embeddings = 8192;
  gemma.norm_eps = 1e-6;
  ArchTraits gemma2 = llama_like(ModelArch::gemma2, "gemma2", "Gemma2ForCausalLM");
  gemma2.activation = Activation::geglu_tanh;
  gemma2.attention_bias_key = gemma2.norm_plus_one = gemma2.embedding_scaled = gemma2.sandwich_norms = true;
  gemma2.softcap_keys = gemma2.sliding_window_key = gemma2.window_on_even_layers = true;
  gemma2.tied = true;
  gemma2.default_window = 4096;
  gemma2.default_head_dim = 256;
  gemma2.default_attn_softcap = 50;
  gemma2.default_final_softcap = 30;
  gemma2.default_query_pre_attn_scalar = 256;
  gemma2.vocab_size = 256000;
  gemma2.max_position_embeddings = 8192;
  gemma2.norm_eps = 1e-6;
  return {gpt2, llama, mistral, qwen2, qwen3, phi3, gemma, gemma2};
}

const std::vector<ArchTraits>& rows() {
  static const std::vector<ArchTraits> all = make_rows();
  return all;
}

}  // namespace

const ArchTraits& arch_traits(ModelArch a) {
  for (const ArchTraits& t : rows())
    if (t.arch == a) return t;
  DS_CHECK(false, "architecture ", static_cast<int>(a), " has no row in schema/arch.cpp");
  return rows().front();
}

const char* model_arch_name(ModelArch a) { return arch_traits(a).name; }

std::optional<ModelArch> model_arch_from_name(const std::string& name) {
  for (const ArchTraits& t : rows())
    if (name == t.name) return t.arch;
  return std::nullopt;
}

const ArchTraits* arch_of_hf_model_type(const std::string& type) {
  for (const ArchTraits& t : rows())
    if (type == t.hf_model_type) return &t;
  return nullptr;
}

std::string hf_model_types() {
  std::string s;
  for (const ArchTraits& t : rows()) s += (s.empty() ? "" : ", ") + std::string(t.hf_model_type);
  return s;
}

}  // namespace ds
