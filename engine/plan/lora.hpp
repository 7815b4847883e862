// ds — LoRA as the plan sees it (Hu et al. 2021, as Hugging Face PEFT trains it): which projections
// get an adapter, the adapter's tensors (the only parameters that train), and what the frozen base
// costs. Pure arithmetic, no tensor allocated.
//
// A projection y = x W^T (W (out, in); GPT-2's Conv1D stores W^T, (in, out)) gains A (r, in) and
// B (out, r): y = x W^T + (alpha / r) dropout(x) A^T B^T. B starts at zero, so step 0 is the base.
// The adapter's tensors are named as PEFT names them without its "base_model.model." prefix:
// "<module>.lora_A.weight" and "<module>.lora_B.weight", block by block, A before B, the modules in
// the base's state_dict order. ZeRO lays out, partitions and checkpoints these tensors alone.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/plan/model_spec.hpp"
#include "schema/config.hpp"

namespace ds {

struct LoraPlan {
  bool enabled = false;
  int64_t r = 0;
  double alpha = 0, scale = 0, dropout = 0;  // scale = alpha / r
  LoraInit init = LoraInit::kaiming_uniform;
  std::vector<std::string> target_modules;  // as resolved (the default filled in)
  // The trainable tensors as a model of their own: hp is the base's, tensors the adapters', counts theirs.
  ModelSpec adapters;
  std::vector<int> adapted;  // per adapter tensor: the index of the base tensor it adapts
  std::vector<int64_t> layers;  // model.lora.layers_to_transform resolved (sorted, each once); empty: every block
};

// The module names a LoRA target may take for this architecture (PEFT's spelling), in block order.
std::vector<std::string> lora_module_names(ModelArch arch);
// PEFT's default targets for the architecture (llama q_proj, v_proj; gpt2 c_attn).
std::vector<std::string> lora_default_targets(ModelArch arch);
// The module a tensor belongs to: "q_proj" of "model.layers.0.self_attn.q_proj.weight".
std::string lora_module_of(const std::string& tensor_name);

// model.lora resolved against the base model; a target the architecture lacks is a ConfigIssue at
// model.lora.target_modules naming the architecture's modules.
LoraPlan resolve_lora(const LoraConfig& config, const ModelSpec& base, std::vector<ConfigIssue>& errors);

// model.freeze: per tensor of the model, whether a pattern (shell wildcards, fnmatch) names it. A pattern
// that names nothing is a ConfigIssue at model.freeze. Empty when there are no patterns.
std::vector<uint8_t> resolve_freeze(const std::vector<std::string>& patterns, const ModelSpec& model, std::vector<ConfigIssue>& errors);
// Warnings for model.freeze patterns that likely mean something else: "[0-15]" is a class of one character (0, 1
// or 5), not the numbers 0 to 15.
std::vector<ConfigIssue> freeze_pattern_slips(const std::vector<std::string>& patterns);
// The model's tensors that `keep` marks, as a model of their own (what a layout then lays out).
ModelSpec model_part(const ModelSpec& model, const std::vector<uint8_t>& keep);
// The model's tensors that are not frozen (what the layout lays out under model.freeze).
ModelSpec unfrozen_part(const ModelSpec& model, const std::vector<uint8_t>& frozen);

// The first block whose backward runs. Below it nothing trains (model.freeze of the embeddings and the first
// blocks, or LoRA's adapters from a later block on): no gradient is wanted there, so those blocks run forward
// only, keep no activations, and a pipeline stage made of them alone receives no gradient. 0 when an embedding
// table trains (a tied head's too) or nothing is frozen; the number of blocks when none trains.
int64_t first_backward_block(const ModelSpec& model, const std::vector<uint8_t>& frozen, const LoraPlan& lora);
// The attention core's training FLOPs per token at T: forward and backward in the blocks whose backward runs,
// forward alone (a third) in the `forward_only` below them (first_backward_block).
double attention_train_flops_per_token(const ModelSpec& model, int64_t forward_only, int64_t T);

// Training FLOPs per token at sequence length T with some matmuls frozen (`frozen`, per tensor of the model;
// a tied head is frozen with its embedding) and LoRA's adapters beside them: a frozen matmul runs forward and
// passes the gradient to its input (4 per parameter, no weight gradient), a trained one 6, the adapter's 6,
// the attention core is the full model's; a block below first_backward_block runs forward only (2 per parameter,
// a third of its attention core).
double train_flops_per_token(const ModelSpec& model, const std::vector<uint8_t>& frozen, const LoraPlan& lora, int64_t T);
// The output head's share of train_flops_per_token: 6 V C per token, 4 V C when its matrix (a tied head's
// token table) is frozen.
double head_train_flops_per_token(const ModelSpec& model, const std::vector<uint8_t>& frozen);

// Activations the adapters keep for backward per token, `bytes` per element: x A^T (r) per adapted module, and with
// dropout the dropped input (in) as well (its mask is recomputed, not kept). Every adapted block's, or with
// activation checkpointing (`recompute_group` G > 0) the most any G consecutive blocks keep: one group is
// recomputed at a time.
double lora_activation_bytes_per_token(const LoraPlan& lora, int bytes, int64_t recompute_group);

}  // namespace ds
