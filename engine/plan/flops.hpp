// ds — FLOPs per module of one micro batch, counted from the model's own tensors: every matmul ds runs
// (2 m n k each), forward and backward separately (backward computes both the input's and the weight's
// gradient: 2x the forward, exactly, not an estimate), the attention scores and their weighted sum over
// the full T x T (the model-FLOPs convention: the fused causal attention computes only the part on and
// below the diagonal, and the scores again in backward), and the forward again when a block is recomputed in
// its backward (activation checkpointing). Norms, activations and softmax are not matmuls and count 0,
// as in the model FLOPs of PaLM and llm.c: summed over modules, forward + backward equals
// ModelSpec::train_flops_per_token x B x T. With frozen tensors (model.freeze, LoRA's base) a frozen matmul's backward computes the input's
// gradient only (1x their forward) and the adapters' matmuls count in their module, trained (the sum is
// then Plan::train_flops_per_token x B x T). Pure arithmetic.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/plan/lora.hpp"
#include "engine/plan/model_spec.hpp"

namespace ds {

struct ModuleFlops {
  std::string name;   // Hugging Face's module path: "transformer.h.0.attn", "model.layers.3.mlp", "lm_head"
  int depth = 1;      // 1: embeddings, blocks, final norm, head; 2: a block's children
  int layer = -1;     // the block, -1 outside
  int64_t params = 0;
  double forward = 0, backward = 0, recompute = 0;  // FLOPs per micro batch
  double total() const { return forward + backward + recompute; }
};

// Depth 1 and depth 2 rows, in execution order (a block's row before its children). `recompute`: the
// blocks' forward runs twice (model.activation_checkpointing). `frozen`: per tensor, held frozen (Plan::frozen;
// empty: none); `lora`: the adapter beside the frozen model.
std::vector<ModuleFlops> module_flops(const ModelSpec& model, int64_t micro_batch, int64_t seq_len, bool recompute,
                                      const std::vector<uint8_t>& frozen = {}, const LoraPlan& lora = {});

}  // namespace ds
