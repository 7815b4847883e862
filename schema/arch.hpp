// ds — an architecture as one row of traits. Whatever differs between the families ds builds is read from
// here (the model's tensors and their order, how a block computes, Hugging Face's names and config keys,
// PEFT's module names, the defaults of a from-scratch description), so adding a family is adding a row,
// the few lines its new traits need where they act, and its tests (docs/ARCHITECTURE.md, "adding a model").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "schema/config.hpp"

namespace ds {

enum class Positions { learned, rotary };  // a position table added to the input (GPT-2), or rotary q and k
enum class NormKind { layer_norm, rms_norm };
// GPT-2's MLP act(fc(x)); Llama's down(silu(gate(x)) * up(x)); Gemma's down(gelu_tanh(gate(x)) * up(x)).
enum class Activation { gelu_tanh, swiglu, geglu_tanh };

struct ArchTraits {
  ModelArch arch;
  const char* name;           // ds's name: model.arch, plan.json, checkpoints
  const char* hf_model_type;  // config.json's model_type
  const char* hf_class;       // config.json's architectures
  Positions positions;
  NormKind norm;
  Activation activation;
  bool in_out;               // projection weights stored [in, out] (GPT-2's Conv1D); else nn.Linear's [out, in]
  bool fused_qkv;            // one projection makes q|k|v (GPT-2's c_attn, Phi-3's qkv_proj)
  bool fused_gate_up;        // one projection makes gate|up, split in halves (Phi-3's gate_up_proj)
  bool biases_everywhere;    // every projection and norm has a bias (GPT-2)
  bool qkv_bias;             // q, k and v have biases whatever the config says, o_proj none (Qwen2)
  bool attention_bias_key;   // config.json's attention_bias puts biases on q, k, v and o (Llama, Mistral, Qwen3)
  bool mlp_bias_key;         // config.json's mlp_bias puts biases on gate, up and down (Llama)
  bool qk_norm;              // an RMSNorm over each head's q and k before the rotation (Qwen3)
  bool norm_plus_one;        // RMSNorm scales by (1 + w), computed in fp32, its weights initialised to 0 (Gemma)
  bool embedding_scaled;     // the embedding is multiplied by sqrt(hidden_size), in the activations' dtype (Gemma)
  bool sandwich_norms;       // norms after attention and after the MLP too, before each residual add (Gemma 2)
  bool softcap_keys;         // attn_logit_softcapping, final_logit_softcapping and query_pre_attn_scalar act (Gemma 2)
  bool window_on_even_layers;  // the window acts on layers 0, 2, 4...; the others attend to all (Gemma 2)
  bool sliding_window_key;   // config.json may give an attention window (Mistral, Phi-3; Qwen2/3 with use_sliding_window)
  bool use_sliding_window_key;  // the window acts only with use_sliding_window, from max_window_layers on (Qwen)
  int64_t default_window;    // the window a config.json without the key means (Mistral's 4096), 0: none
  int64_t default_head_dim;  // the head width a config.json without head_dim means (Gemma's 256, Qwen3's 128), 0: hidden / heads
  // Gemma 2's config.json defaults: attn_logit_softcapping 50, final_logit_softcapping 30, query_pre_attn_scalar 256.
  double default_attn_softcap, default_final_softcap, default_query_pre_attn_scalar;
  bool rope_original_at_top;  // longrope's original context is config.json's top-level key, default 4096 (Phi-3);
                              // only Phi-3 takes longrope (transformers computes it for Phi-3's config form)
  bool dropout_keys;         // config.json's resid_pdrop acts, and is written (GPT-2, Phi-3)
  bool grouped_query;        // num_kv_heads may be fewer than num_heads
  bool head_dim_key;         // head_dim may be given apart from hidden_size / num_heads
  // What a from-scratch description (model.arch and sizes) means by the keys it leaves out.
  bool tied;
  int64_t vocab_size, max_position_embeddings;
  double norm_eps, rope_theta;
  std::vector<std::string> lora_modules;          // PEFT's names of a block's projections, in the block's order
  std::vector<std::string> lora_default_targets;  // PEFT's target_modules when none are given, for this family (none: must be named)
  // Of lora_modules, those tensor parallelism splits by their input (Megatron's row-parallel: attention's output
  // and the MLP's down projection); the others are split by their output (engine/plan/mesh.hpp).
  std::vector<std::string> row_parallel;
};

// The row of an architecture; every ModelArch has one (a test checks).
const ArchTraits& arch_traits(ModelArch a);
// The architecture whose config.json says model_type `type`, or none.
const ArchTraits* arch_of_hf_model_type(const std::string& type);
// The model types ds reads, for messages: "gpt2, llama, mistral, qwen2, qwen3".
std::string hf_model_types();

}  // namespace ds
