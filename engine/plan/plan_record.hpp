// ds — plan.json, the plan as a record: printed by `ds plan --json`, written into every run directory
// and stored in every checkpoint, then read back by a resume, by convert-ckpt and by model.init_from.
// The writer and the one reader live here side by side, so a field is added in one place.
//
// Versioned by kPlanSchemaVersion (engine/plan/plan.hpp). Fields are only ever added: a reader meets
// records written before a field existed, and reads each missing field as those runs had it (said at
// the field). A record of a newer version is read for the fields this build knows. A field present
// with the wrong type is damage, and refused naming it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "engine/plan/plan.hpp"

namespace ds {

// A tokenizer file a run's exports ship: its role ("vocab_file", "merges_file": what the run's data was
// read with; "init_from": what model.init_from's source had), the name it takes in an export, where the
// run read it, and its checksum (common/hash.hpp) and size then.
struct TokenizerFileRecord {
  std::string role, name, path, checksum64;
  int64_t bytes = 0;
};

// A tensor of the flat parameter order: its place among the model's elements.
struct RecordedTensor {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;
};

// What readers take from a stored plan. Optional fields are absent in older records, or in the plan of
// a config without a model (model, layout).
struct PlanRecord {
  int schema_version = 0;
  std::optional<ModelHyper> model;
  std::optional<LoraConfig> lora;  // a LoRA run: its adapter's r, alpha, dropout, targets and init
  bool frozen = false;             // a run with frozen tensors (LoRA's base, model.freeze)
  int64_t world_size = 0;          // the data-parallel ranks that trained it (batch.world_size; topology's in older records)
  int64_t train_batch_size = 0, micro_batch = 0;
  int64_t steps = 0;
  std::string scheduler;  // its type's name (scheduler_type_name)
  std::optional<int64_t> warmup_num_steps, total_num_steps;
  int zero_stage = 0;
  std::string precision;  // precision.mode: "fp32", "bf16", "fp16"
  // The flat layout: every element counted, the world size it was cut for, the tensors in order.
  int64_t layout_numel = 0, layout_world_size = 0;
  int64_t mesh_tensor = 1;  // the ranks of each tensor group (mesh.tensor; 1 in records without a mesh)
  int64_t mesh_pipeline = 1;  // the pipeline's stages (mesh.pipeline; 1 in records without a mesh)
  std::vector<RecordedTensor> params;
  // Absent (nullopt) in runs from before the record: their tokenizer files are known by the config's paths.
  std::optional<std::vector<TokenizerFileRecord>> tokenizer_files;
};

// The record: `ds plan --json`'s output (indent 2), with the tokenizer files a run records.
std::string plan_to_json(const Plan& plan, const std::vector<TokenizerFileRecord>& tokenizer_files = {}, int indent = 2);
// A model split over tensor ranks is checkpointed as the whole model's elements (whole_segments): the plan.json a
// checkpoint carries, `plan_json` (plan_to_json's) with the whole model's layout in place of a rank's share, so
// that what reads it (convert-ckpt, a resume on any mesh) finds every tensor whole.
std::string with_whole_model_layout(const std::string& plan_json, const Plan& plan);

// Reads a record written by plan_to_json (of this version or an older one). UserError naming `where`
// (for example "checkpoint 'runs/x/checkpoints/step_00000010'") and the field when the text is not a
// plan.json or is damaged.
PlanRecord read_plan_record(const std::string& text, const std::string& where);

// Whether a parsed file looks like a plan.json at all (a run directory's file that ds wrote).
bool looks_like_plan_record(const nlohmann::json& j);

}  // namespace ds
