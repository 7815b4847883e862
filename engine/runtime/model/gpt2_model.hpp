// ds — GPT-2 (Hugging Face's GPT2LMHeadModel): learned positions, pre-LayerNorm blocks, tanh GELU,
// tied input embedding and output head, biases everywhere. Weights use GPT-2's Conv1D layout
// [in, out] (as in the state_dict), so a layer computes x @ W + b and export is a rename.
// Legend: B batch, T sequence, C width, NH heads, D = C / NH, V vocabulary, L layers.
#pragma once

#include <torch/torch.h>

#include "engine/runtime/model/language_model.hpp"

namespace ds {

class Gpt2Model : public LanguageModel {
 public:
  Gpt2Model(const ModelHyper& hp, ModelWeights& weights, const StageEnds& stage = {});

  // GPT-2's initialisation: N(0, 0.02) weights, residual projections N(0, 0.02 / sqrt(2L)), zero
  // biases, unit LayerNorm gains. Deterministic in `seed`; written in fp32 into `master`.
  // Parameter `p`'s initial values into `t` (its numel, fp32), drawn from `gen` (layout order).
  static void initialise(const ModelHyper& hp, const ParamSlot& p, torch::Tensor t, at::Generator& gen);

  torch::Tensor block(int64_t layer, const torch::Tensor& x) const override;
  int64_t num_blocks() const override { return static_cast<int64_t>(blocks_.size()); }

 protected:
  torch::Tensor embed(const torch::Tensor& inputs) const override;
  torch::Tensor head(const torch::Tensor& x, const torch::Tensor& targets) const override;

 private:
  struct Block {
    torch::Tensor ln1_w, ln1_b, ln2_w, ln2_b;
    Linear attn, proj, fc, fc_proj;  // Conv1D weights, (in, out)
  };
  ModelHyper hp_;
  torch::Tensor wte_, wpe_, lnf_w_, lnf_b_;
  std::vector<Block> blocks_;
};

}  // namespace ds
