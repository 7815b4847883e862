// ds — DeepSpeed's checkpoints read as they lie on disk, without Python and without running their pickles:
// a folder holding `latest` and tag folders (global_stepN/), or a tag folder itself, written by
// engine.save_checkpoint at ZeRO stage 0-3 on any data-parallel world size:
//  * stage 0: mp_rank_00_model_states.pt holds the module's weights (and the optimizer's state);
//  * stages 1-2: mp_rank_00_model_states.pt holds the module's (16-bit) weights and `param_shapes`, the
//    parameters of each group in their flat order; [bf16_]zero_pp_rank_K_mp_rank_00_optim_states.pt holds
//    rank K's slice of each group's flat fp32 master vector (the ranks' slices, concatenated, are the
//    group's parameters back to back, padded at the end to a multiple of 2 x world size);
//  * stage 3: zero_pp_rank_K_mp_rank_00_model_states.pt per rank (the module's parameters empty), and
//    rank K's optimizer file holding its part of every parameter back to back: a parameter of n elements
//    gives each rank ceil(n / world) of them, the last rank's padded.
// Frozen parameters (stages 2-3) come from `frozen_param_fragments`, tied ones (`shared_params`) are named
// once. Everything is checked before a value is read: the files the world size needs (a missing rank
// named, a surplus one refused), one save's files (the ranks' optimizer steps agree), the partitions'
// sizes against the parameter shapes, as DeepSpeed's zero_to_fp32.py checks them. Values are read one
// parameter at a time from the files' storages: memory is the parameter being read, never the model.
#pragma once

#include <cstdint>
#include <array>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/runtime/io/safetensors.hpp"
#include "engine/runtime/io/torch_file.hpp"
#include "engine/runtime/io/weights.hpp"

namespace ds {

// True when `path` is a DeepSpeed checkpoint folder: it holds `latest`, or *_model_states.pt files.
bool is_deepspeed_checkpoint(const std::string& path);

struct DeepSpeedParam {
  enum class From { module, flat_group, stage3_flat, frozen };
  std::string name;  // the model's name for it ("module." dropped)
  std::string key;   // as the checkpoint records it
  std::vector<int64_t> shape;
  int64_t numel = 0;
  From from = From::module;
  int group = -1;      // flat_group: its parameter group
  int64_t offset = 0;  // flat_group: in the group's flat vector; stage3_flat: in every rank's flat partition
  bool buffer = false;  // a module buffer (kept in the module at every stage)
};

class DeepSpeedCheckpoint {
 public:
  // `path`: the folder holding `latest`, or a tag folder; `tag` names the tag folder instead of `latest`.
  explicit DeepSpeedCheckpoint(const std::string& path, const std::string& tag = "");

  const std::string& dir() const { return dir_; }  // the tag folder read
  const std::string& tag() const { return tag_; }
  int stage() const { return stage_; }
  int64_t world_size() const { return world_size_; }
  int64_t step() const { return step_; }
  int64_t global_samples() const { return global_samples_; }
  int64_t skipped_steps() const { return skipped_steps_; }
  const std::string& ds_version() const { return ds_version_; }
  StDtype module_dtype() const { return module_dtype_; }
  // Whether fp32 master weights are stored (stages 1-3, bf16's optimizer at stage 0).
  bool has_master() const { return has_master_; }
  bool has_moments() const { return has_moments_; }
  const std::vector<DeepSpeedParam>& params() const { return params_; }
  const std::vector<std::pair<std::string, std::string>>& tied() const { return tied_; }  // (alias, source)
  const nlohmann::json& config() const { return config_; }  // the run's ds_config as saved
  const std::vector<std::string>& files() const { return files_; }  // the files read, in order
  const DeepSpeedParam* find(const std::string& name) const;

  // A parameter's values as fp32: the fp32 master where the checkpoint stores one (unless
  // `module_weights`), else the module's weights in their training dtype. UserError naming the file.
  void read(const DeepSpeedParam& p, bool module_weights, float* out) const;

  // The optimizer's state (stage 0 without bf16: the module's weights and torch's per-parameter state, tied to
  // names by the Trainer's grouping; stages 1-3: the partitions): elements [lo, lo + n) of a trained parameter's fp32 master
  // (`which` 0), Adam's first moment (1) or second moment (2). `moments_missing()` says why moments cannot
  // be read ("" when they can).
  void read_state(const DeepSpeedParam& p, int which, int64_t lo, int64_t n, float* out) const;
  const std::string& moments_missing() const { return moments_missing_; }
  // The loss scaler's state as the optimizer saved it (fp16): scale, iteration, last overflow, hysteresis;
  // absent keys keep the defaults given.
  const PyValue* loss_scaler() const;

 struct TagFiles;  // the files of a tag folder, by role

 private:
  void locate(const std::string& path, const std::string& tag);
  const PyValue& open_model_states(const TagFiles& t);
  void open_optimizer_files(const TagFiles& t);
  void check_one_save() const;
  void read_params(const PyValue& model_states);
  void read_partitions(const PyValue& param_shapes);
  void add(DeepSpeedParam p);
  DeepSpeedParam shaped(const PyValue& key, const PyValue& shape, DeepSpeedParam::From from, int group, int64_t offset) const;
  void add_module_param(const std::string& key, const PyValue& v, bool buffer);

  struct Piece {
    const TorchFile* file;
    const PyValue* tensor;
  };
  void read_concat(const std::vector<Piece>& pieces, int64_t from, int64_t n, float* out) const;
  const PyValue& module_tensor(const DeepSpeedParam& p) const;

  std::string dir_, tag_, ds_version_;
  std::string lead_;              // the model-state file that records the run (rank 0's)
  std::set<std::string> seen_;    // parameter names read so far
  int64_t total_numel_ = 0;       // their elements
  int stage_ = 0;
  int64_t world_size_ = 1, step_ = 0, global_samples_ = 0, skipped_steps_ = 0;
  StDtype module_dtype_ = StDtype::F32;
  bool has_master_ = false, has_moments_ = false;
  std::vector<DeepSpeedParam> params_;
  std::vector<std::pair<std::string, std::string>> tied_;
  nlohmann::json config_;
  std::vector<std::string> files_;
  std::vector<std::unique_ptr<TorchFile>> model_files_, optim_files_;  // by rank (one model file below stage 3)
  std::vector<std::vector<Piece>> groups_;                             // stages 1-2: [group][rank] partitions
  std::vector<std::vector<Piece>> flat_;                               // stage 3: [rank][sub-group]
  // Adam's moments beside them, in the same shape: [moment][group][rank] (stages 1-2), [moment][rank][sub-group] (3).
  std::vector<std::vector<Piece>> moments_[2];
  std::string moments_missing_;
  void collect_moments();
  void collect_stage0_moments();
  std::map<std::string, std::array<const PyValue*, 2>> stage0_moments_;  // stage 0: by parameter name
};

// A DeepSpeed checkpoint as a source of weights, named as the model names them, tied aliases left out
// (transformers ties them again on load). No ds model is attached (has_model() is false): exports write the
// tensors under their own names.
class DeepSpeedSource : public WeightSource {
 public:
  DeepSpeedSource(std::shared_ptr<const DeepSpeedCheckpoint> ckpt, bool module_weights, bool exclude_frozen);
  void read_f32(const std::string& name, float* out) const override;
  const DeepSpeedCheckpoint& checkpoint() const { return *ckpt_; }

 private:
  std::shared_ptr<const DeepSpeedCheckpoint> ckpt_;
  bool module_weights_;
};

}  // namespace ds
