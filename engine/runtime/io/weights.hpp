// ds — model weights in and out of ds, tensor by tensor, without LibTorch:
//  * a ds checkpoint (any ZeRO stage, any world size): its plan.json names every tensor with its shape
//    and place in the flat order, and each tensor is read from whichever shards hold its pieces;
//  * a Hugging Face model directory (config.json + model.safetensors, or shards named by
//    model.safetensors.index.json) or a single .safetensors file, memory-mapped.
// Reading and writing hold one tensor at a time: memory is bounded by the largest tensor, not the model.
// Names are Hugging Face's, which ds's ModelSpec uses too (GPT-2's Conv1D weights stored [in, out]).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/plan/lora.hpp"
#include "engine/plan/model_spec.hpp"
#include "engine/runtime/io/checkpoint.hpp"

namespace ds {

enum class WeightsKind { ds_checkpoint, hf_directory, safetensors_file, peft_adapter, deepspeed_checkpoint };
const char* weights_kind_name(WeightsKind k);

struct NamedShape {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;  // "F32", "BF16", ...
  int64_t numel() const;
};

// A LoRA adapter as PEFT describes it (adapter_config.json): what a ds LoRA run's checkpoint holds.
struct PeftAdapter {
  int64_t r = 0;
  double alpha = 0, dropout = 0;
  std::vector<std::string> target_modules;
  bool fan_in_fan_out = false;  // GPT-2: the base's Conv1D weights are (in, out)
  std::vector<int64_t> layers_to_transform;  // the adapted blocks (empty: every block)
};

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  WeightsKind kind() const { return kind_; }
  const std::string& path() const { return path_; }
  const std::vector<NamedShape>& tensors() const { return tensors_; }
  const NamedShape* find(const std::string& name) const;
  // The tensor's values as fp32 into `out` (its numel elements). UserError naming the file on bad data.
  virtual void read_f32(const std::string& name, float* out) const = 0;

  // ds checkpoints: the model as trained, from its plan.json, and the training state's counters.
  bool has_model() const { return has_model_; }
  const ModelHyper& model() const { return model_; }
  int64_t step = -1, world_size = 0;
  int64_t tensor_parallel = 1;  // a ds checkpoint of a mesh: the ranks of each tensor group (world_size counts the data ranks)
  int64_t pipeline_stages = 1;  // and its pipeline's stages
  int zero_stage = -1;
  std::string precision;  // the run's precision mode ("bf16", ...)
  // A LoRA run's checkpoint: its tensors are the adapter's ("<module>.lora_A.weight", ...), not the model's.
  std::optional<PeftAdapter> lora;
  // A run that held weights frozen (LoRA's base, model.freeze) checkpoints only what trained: the rest is the
  // base it read from `base_path` ("" for the seed's random init), whose frozen tensors had `base_checksum`.
  bool frozen_part = false;
  std::string base_path, base_checksum;

 protected:
  WeightsKind kind_ = WeightsKind::ds_checkpoint;
  std::string path_;
  std::vector<NamedShape> tensors_;
  bool has_model_ = false;
  ModelHyper model_;
};

// What `path` holds: a ds run directory or checkpoint (its newest complete checkpoint), a Hugging Face
// directory, a .safetensors file, a DeepSpeed checkpoint folder (`latest` and global_stepN/, read from its
// fp32 master weights: deepspeed_checkpoint.hpp), or a PEFT LoRA adapter directory (adapter_config.json and
// adapter_model.safetensors: its tensors named as ds names an adapter's, without "base_model.model.", its
// `lora` and `base_path` from the config). UserError naming the path when it is none of them.
WeightsKind detect_weights(const std::string& path);
std::unique_ptr<WeightSource> open_weights(const std::string& path);

// For each tensor of `model` (in order), the source's name holding it, with its shape checked: GPT-2
// names with or without "transformer." (the original files have none), a tied head's lm_head.weight
// and old causal-mask buffers (attn.bias, attn.masked_bias) ignored. UserError naming the tensor and both
// shapes on a mismatch, or the tensor the source lacks.
std::vector<std::string> match_weights(const WeightSource& source, const ModelSpec& model);

// The whole model's weights, fp32 in the flat layout's order (`whole` holds model.num_params floats).
void load_weights(const WeightSource& source, const ModelSpec& model, float* whole);
// The same values produced piece by piece in that order, holding one tensor (the one the piece is in):
// for writing a model larger than memory. `source` must outlive the result; pieces are asked for in order.
FloatPieces weights_in_pieces(const WeightSource& source, const ModelSpec& model);

// Hugging Face's config.json for this model (GPT2LMHeadModel or LlamaForCausalLM), and its
// generation_config.json. `torch_dtype`: "float32", "bfloat16" or "float16".
std::string hf_config_json(const ModelHyper& hp, const std::string& torch_dtype);
std::string hf_generation_config_json(const ModelHyper& hp);

struct ExportOptions {
  std::string dtype = "fp32";             // fp32 | bf16 | fp16
  uint64_t max_shard_bytes = 5'000'000'000;  // transformers' default (5GB)
  // fp16 only: values beyond its range (|v| > 65504) become +-inf instead of refusing the export.
  bool allow_fp16_overflow = false;
};
struct ExportSummary {
  std::vector<std::string> files;  // written, in order
  std::vector<std::string> removed;  // weight files of a previous export in the directory that this one replaced
  uint64_t tensor_bytes = 0;
  int64_t tensors = 0;
  int64_t fp16_overflowed = 0, fp16_flushed = 0;  // fp16 only: values made +-inf, nonzero values made 0
};

// Writes a Hugging Face directory: config.json, generation_config.json, model.safetensors (or
// model-0000i-of-0000N.safetensors + model.safetensors.index.json above max_shard_bytes). The tied
// head is written once, as transformers does. `out_dir` is created; files are replaced atomically.
ExportSummary export_hf_directory(const WeightSource& source, const ModelHyper& hp, const std::string& out_dir,
                                  const ExportOptions& options);
// A PEFT adapter (model.init_from) against the plan's LoRA: r, lora_alpha and target_modules as model.lora
// says, and every adapter tensor by name and shape (UserError naming the key or tensor and both values).
void check_peft_adapter(const WeightSource& adapter, const LoraPlan& lora);
// The base a PEFT adapter names (base_model_name_or_path), opened; UserError when it names none.
std::unique_ptr<WeightSource> open_adapter_base(const WeightSource& adapter);

// PEFT's LoRA directory: adapter_config.json (peft_type LORA) and adapter_model.safetensors, the adapter's
// tensors under PEFT's names ("base_model.model.<module>.lora_A.weight" (r, in), "...lora_B.weight" (out, r)).
ExportSummary export_peft_adapter(const WeightSource& source, const std::string& out_dir, const ExportOptions& options);

// The model's tensors in `source` (those `frozen` marks, when it is not empty), checksummed as a run records
// its frozen weights (16 hex digits).
std::string weights_checksum(const WeightSource& source, const ModelSpec& model, const std::vector<uint8_t>& frozen = {});

// The base's weights with a run's trained part put in, tensor by tensor as they are read: the checkpoint's
// tensors in place of the base's (model.freeze), and a LoRA adapter folded in, W + (alpha / r) B A (transposed
// for GPT-2's Conv1D): what `convert-ckpt --merge` exports. `base` and `trained` (a checkpoint with
// `frozen_part`) must outlive it.
std::unique_ptr<WeightSource> merged_weights(const WeightSource& base, const WeightSource& trained);

// Every tensor of `source` under its own name and in its order, for a source that carries no ds model (a
// DeepSpeed checkpoint): one .safetensors file when `config_json` is empty, else a Hugging Face directory
// with that config.json (its torch_dtype set to the export's) and `extra_files` (name, bytes) beside it.
ExportSummary export_as_named(const WeightSource& source, const std::string& dst, const std::string& config_json,
                              const std::vector<std::pair<std::string, std::string>>& extra_files, const ExportOptions& options);

// One consolidated .safetensors file of every tensor (DeepSpeed's zero_to_fp32 job).
ExportSummary export_safetensors_file(const WeightSource& source, const ModelSpec& model, const std::string& file,
                                      const ExportOptions& options);

}  // namespace ds
