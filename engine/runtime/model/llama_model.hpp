// ds — Llama (Hugging Face's LlamaForCausalLM) and the families built on its block (schema/arch.hpp:
// Mistral, Qwen2, Qwen3): RMSNorm, rotary embeddings in HF's half-rotation layout (dimension j pairs with
// j + D/2: no q/k permutation on export), SwiGLU MLP down(silu(gate(x)) * up(x)), grouped-query attention
// (NKV key/value heads shared by NH/NKV query heads), tied or untied head. What the families add: biases
// on q, k, v (Qwen2; with o under attention_bias), on the MLP (mlp_bias), an RMSNorm over each head's q
// and k before the rotation (Qwen3), a head width of its own (head_dim). Weights are nn.Linear [out, in].
// Legend: B batch, T sequence, C width, NH heads, NKV kv heads, D head width, I MLP width, V vocabulary.
#pragma once

#include <utility>

#include "engine/runtime/model/language_model.hpp"

namespace ds {

class LlamaModel : public LanguageModel {
 public:
  LlamaModel(const ModelHyper& hp, ModelWeights& weights, const StageEnds& stage = {});
  // N(0, 0.02) for every matrix (HF's initializer_range), zero biases, unit RMSNorm gains.
  // Parameter `p`'s initial values into `t` (its numel, fp32), drawn from `gen` (layout order).
  static void initialise(const ModelHyper& hp, const ParamSlot& p, torch::Tensor t, at::Generator& gen);
  torch::Tensor block(int64_t layer, const torch::Tensor& x) const override;
  int64_t num_blocks() const override { return static_cast<int64_t>(blocks_.size()); }

 protected:
  torch::Tensor embed(const torch::Tensor& inputs) const override;
  torch::Tensor head(const torch::Tensor& x, const torch::Tensor& targets) const override;

 private:
  struct Block {
    Linear q, k, v, o, gate, up, down;  // Phi-3: q holds qkv_proj, gate gate_up_proj; k, v and up are unused
    torch::Tensor norm_in, norm_post, q_norm, k_norm;  // q_norm, k_norm: Qwen3's, else undefined
    torch::Tensor norm_pre_mlp, norm_post_mlp;         // Gemma 2's, else undefined (norm_post then follows attention)
  };
  torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w) const;
  // {x, rms_norm(x, w)} and {x + r, rms_norm(x + r, w)}: the residual stream beside its norm, whose gradients meet
  // in one backward where ds's RMSNorm runs (not Gemma's 1 + w).
  std::pair<torch::Tensor, torch::Tensor> norm_beside(const torch::Tensor& x, const torch::Tensor& w) const;
  std::pair<torch::Tensor, torch::Tensor> add_then_norm(const torch::Tensor& x, const torch::Tensor& r, const torch::Tensor& w) const;
  torch::Tensor gated(const torch::Tensor& gate, const torch::Tensor& up) const;
  // The rotary tables cos, sin (T, D/2, fp32) on `device`: made on the host and copied there once, then
  // kept, so a GPU's block never waits on a copy of them.
  std::pair<torch::Tensor, torch::Tensor> rotary_cos_sin(int64_t T, const torch::Device& device) const;
  // A packed sample's L rows of the tables (its `length` positions, and the padding after it): the first L of
  // the row's (`cos`, `sin` for T positions), or where the scaling depends on the length (dynamic, longrope)
  // those of the sample's own length, as the sample alone would have them.
  std::pair<torch::Tensor, torch::Tensor> sample_cos_sin(int64_t L, int64_t length, int64_t T, const torch::Tensor& cos,
                                                         const torch::Tensor& sin) const;
  ModelHyper hp_;
  const ArchTraits& traits_;  // the family's row (schema/arch.hpp), looked up once
  torch::Tensor embed_, norm_, head_;
  std::vector<Block> blocks_;
  mutable torch::Tensor rope_cos_, rope_sin_;  // rotary_cos_sin's, for the last T and device asked
  // Packed rows: the tables at each position's place in its sample, (B T, D/2), made once per batch
  // (set_segments), so every block's rotation keeps the same two tensors for backward, not copies of its own.
  std::pair<torch::Tensor, torch::Tensor> gathered_cos_sin(const torch::Tensor& cos, const torch::Tensor& sin) const;
  mutable torch::Tensor gathered_cos_, gathered_sin_;
  mutable uint64_t gathered_version_ = 0;
};

}  // namespace ds
