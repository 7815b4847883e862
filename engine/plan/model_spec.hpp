// ds — ModelSpec: a transformer as numbers. The ordered list of named parameter tensors (Hugging
// Face state_dict names and shapes), parameter counts, training FLOPs per token and activation bytes
// per token. Pure arithmetic: no tensor is ever allocated here.
//
// Legend: V vocab, C hidden width, L layers, NH heads, NKV key/value heads, D head dim (C/NH),
// I MLP width, P positions (context length), T sequence length, B micro batch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "schema/arch.hpp"

namespace ds {

struct ModelHyper {
  std::string name;  // preset name, or "custom"
  ModelArch arch = ModelArch::gpt2;
  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0,
          intermediate_size = 0, max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  double norm_eps = 0, rope_theta = 0;
  RopeScaling rope_scaling;  // rotary: how the frequencies are stretched (engine/plan/rope.hpp)
  // Rotary families: each head's width when given apart from hidden_size / num_heads (Qwen3, Mistral-Nemo;
  // 0: that quotient); Hugging Face's attention_bias (q, k, v and o biased) and mlp_bias (gate, up, down);
  // the attention window (each query sees the last W positions, itself included; 0: every earlier one).
  int64_t head_dim_given = 0;
  bool attention_bias = false, mlp_bias = false;
  int64_t sliding_window = 0;
  // Gemma 2: scores cap tanh(s / cap) and logits likewise (0: not capped); scores scaled by
  // query_pre_attn_scalar^-1/2 (0: by head_dim's).
  double attn_softcap = 0, final_softcap = 0, query_pre_attn_scalar = 0;
  // Dropout probabilities (training only): on attention probabilities, on each sub-layer's output
  // before the residual add, and on the input embeddings. Hugging Face's names.
  double attn_pdrop = 0, resid_pdrop = 0, embd_pdrop = 0;
  // The tokenizer's special tokens as the model's config records them (Hugging Face's bos_token_id and
  // eos_token_id; Llama 3 lists several ends): -1 / empty when the vocabulary has none (bytes, a tiny test model).
  int64_t bos_token_id = -1;
  std::vector<int64_t> eos_token_id;

  int64_t head_dim() const { return head_dim_given > 0 ? head_dim_given : hidden_size / num_heads; }
  // Block `layer`'s attention window (0: every earlier position).
  int64_t window_of(int64_t layer) const { return traits().window_on_even_layers && layer % 2 != 0 ? 0 : sliding_window; }
  // The scores' scale when it is not 1/sqrt(head_dim), else 0.
  double attention_scale() const {
    return query_pre_attn_scalar > 0 && query_pre_attn_scalar != static_cast<double>(head_dim()) ? 1.0 / std::sqrt(query_pre_attn_scalar) : 0;
  }
  // Whether some block's attention at T positions is the materialised one (engine/runtime/model/fused_attention):
  // its probabilities take dropout, its window is shorter than T, its scores are soft-capped or scaled
  // otherwise. It keeps the T probabilities per head (and their tanh when capped).
  bool attention_materialised(int64_t T) const { return attn_pdrop > 0 || form_materialises(T) != nullptr; }
  // Which of the family's attention forms materialises it at T positions, for messages; null: none does.
  const char* form_materialises(int64_t T) const {
    if (sliding_window > 0 && sliding_window < T) return "a window shorter than seq_len";
    if (attn_softcap > 0) return "capped scores";
    if (attention_scale() > 0) return "query_pre_attn_scalar";
    return nullptr;
  }
  const ArchTraits& traits() const { return arch_traits(arch); }
  // Which projections carry a bias: q, k and v; o; the MLP's.
  bool qkv_biased() const { return traits().biases_everywhere || traits().qkv_bias || attention_bias; }
  bool o_biased() const { return traits().biases_everywhere || attention_bias; }
  bool mlp_biased() const { return traits().biases_everywhere || mlp_bias; }
};

// The largest sizes ds accepts, from any source (preset, Hugging Face config, explicit keys, a size
// on the command line). With them every count and product the plan forms fits an int64 and nothing
// is allocated per layer for an absurd input. The schema's maxima for model.* say the same.
struct ModelLimits {
  static constexpr int64_t vocab_size = int64_t{1} << 24, hidden_size = int64_t{1} << 20, num_layers = 16384,
                           num_heads = 65536, intermediate_size = int64_t{1} << 22,
                           max_position_embeddings = int64_t{1} << 24;
  static constexpr double params = 1e15;  // estimate-memory --params
};

struct TensorSpec {
  std::string name;            // e.g. "transformer.h.0.attn.c_attn.weight"
  std::vector<int64_t> shape;  // as in the Hugging Face state_dict (GPT-2 Conv1D weights are [in, out])
  int64_t numel = 0;
  int layer = -1;              // transformer block index, -1 outside the blocks
  bool weight_decay = false;   // matrices decay (projections, the token and position embeddings, the head); biases and norms do not
};

struct ModelSpec {
  ModelHyper hp;
  std::vector<TensorSpec> tensors;  // state_dict order; the flat parameter layout follows it
  int64_t num_params = 0;           // tied weights counted once
  int64_t largest_module_params = 0;  // DeepSpeed's "largest layer": the biggest module's own params
  int64_t largest_block_params = 0;   // params of one transformer block (the unit ZeRO-3 gathers)
  // Whether this spec holds the final norm and head: a whole model does; of a pipeline's stages (engine/plan/mesh)
  // only the last. (A stage's embedding tables are in `tensors` or not: nothing else depends on them.)
  bool holds_head = true;

  // Training FLOPs per token at sequence length T: 6 x (matmul params incl. the output head)
  // + 12 L T C_attn (attention scores and values), as in PaLM (Chowdhery et al. 2022, app. B) and
  // llm.c. Recomputation is not included (this is "model FLOPs", the basis of MFU).
  double train_flops_per_token(int64_t T) const;
  // Its two parts: parameters that take part in a matmul per token (every 2-D weight but the position
  // table, plus the output head, tied or not), and the attention core's training FLOPs per token.
  double matmul_params() const;
  double attention_train_flops_per_token(int64_t T) const;
  // Bytes one block keeps for backward per token, compute dtype of `bytes` per element. `library_attention`: the
  // attention is LibTorch's fused kernel (DeviceTraits::attention_by_library), not ds's.
  double block_activation_bytes_per_token(int64_t T, int bytes, bool library_attention = false) const;
  // Bytes kept outside the blocks per token, where the head is: the final norm's input and the gradient of the
  // head's input (the fused head computes it in forward and keeps it for backward).
  double head_activation_bytes_per_token(int bytes) const;
  // Gemma's (1 + w) norms in a 16-bit compute dtype: LibTorch ops in fp32 instead of the norm kernel.
  bool norms_widened(int bytes) const { return hp.traits().norm_plus_one && bytes != 4; }
  // What the fused causal attention holds beyond that while one block's backward runs (0 when the
  // attention is materialised for dropout); `threads` bounds how many of bf16 backward's per-task
  // copies exist at once.
  double attention_workspace_bytes(int64_t micro_batch, int64_t T, int bytes, int threads = 1) const;
  // What the fused head and loss holds at its peak, whatever the batch: one chunk of logits
  // (kHeadChunkElements); the head weight's gradient goes straight into the flat gradients. 0 without the head.
  double head_workspace_bytes(int64_t tokens, int bytes) const;
  // Where the device takes bf16 products in fp32 (a CPU without AVX-512: LibTorch 1.13's own accumulate in bf16
  // there; engine/runtime/model/matmul.cpp): the fp32 copies of both operands and the result that the largest of a
  // step's products holds while it runs, `tokens` the micro batch's. A block's projections over every token, the
  // head over one chunk of logits' rows (head_chunk_rows).
  double widened_product_bytes(int64_t tokens) const;
};

// Logit elements the fused head and loss makes at a time (engine/runtime/model/fused_head_loss): 32 Mi,
// 64 MiB in bf16. GPT-2 at 512 tokens is one chunk; longer batches are split so it stays bounded.
constexpr int64_t kHeadChunkElements = int64_t{1} << 25;
// Rows of logits per chunk for a vocabulary of `vocab`.
inline int64_t head_chunk_rows(int64_t vocab) {
  return vocab <= 0 || vocab >= kHeadChunkElements ? 1 : kHeadChunkElements / vocab;  // vocab 0: a size-only model
}

// Attention scores the fused causal attention makes at a time (engine/runtime/model/fused_attention), across
// the batch's heads: 8 Mi, 16 MiB in bf16, in blocks of at most 256 query rows. A block of query rows
// sees only the keys before it, so the T x T matrix is never made; GPT-2 at B=4, T=128 is one block.
// (bench_attention, bf16, B=4, T=1024: 6 heads in blocks of 64, 128, 170, 341, 682 rows took 63, 56, 60,
// 79, 88 ms forward + backward; 12 heads in blocks of 85, 128, 170, 256: 138, 122, 135, 125 ms.)
constexpr int64_t kAttentionChunkElements = int64_t{1} << 23, kAttentionBlockRowsMax = 256;
// Query rows per block for `batch_heads` (B x NH) heads of T positions.
inline int64_t attention_chunk_rows(int64_t batch_heads, int64_t T) {
  if (batch_heads <= 0 || T <= 0) return 1;
  const int64_t rows = std::min(kAttentionChunkElements / (batch_heads * T), kAttentionBlockRowsMax);
  return rows < 1 ? 1 : rows > T ? T : rows;
}

// A token or position table (wte, wpe, embed_tokens): looked up, not multiplied; the tied head's matmul
// reads wte but is counted as the head's.
bool is_embedding_table(const TensorSpec& t);
// The token table (wte, embed_tokens): an embedding table that is not the position table (wpe); a tied head
// multiplies by it.
bool is_token_table(const TensorSpec& t);

// Names of the built-in presets, in display order.
const std::vector<std::string>& model_preset_names();
// Throws UserError (with a did-you-mean) for an unknown name.
ModelHyper model_preset(const std::string& name);

// Layers preset < hf_config < explicit keys, fills arch defaults, and checks the result
// (heads divide the width, ...). Throws ConfigError naming model.* paths.
ModelHyper resolve_model_hyper(const ModelConfig& model);

ModelSpec build_model_spec(const ModelHyper& hp);

// A size shorthand ("7b", "1.5b", "350m") -> the nearest standard preset and a note saying so.
// Returns "" if the text is not a size.
std::string preset_for_size(const std::string& shorthand, std::string* note);

}  // namespace ds
