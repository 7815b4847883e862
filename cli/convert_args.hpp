// ds convert-ckpt's flags, shared by its two files: convert_ckpt.cpp (ds checkpoints, Hugging Face
// directories) and convert_deepspeed.cpp (DeepSpeed's checkpoints).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "engine/plan/plan.hpp"
#include "engine/runtime/io/checkpoint.hpp"
#include "engine/runtime/io/weights.hpp"

namespace ds::cli {

struct ConvertArgs {
  std::string src, dst, to, dtype = "fp32", max_shard_size = "5GB", tag;
  int world_size = 0, stage = -1;  // ds -> ds: the layout to write (0 / -1: the source's)
  bool info = false, json = false, overwrite = false, exclude_frozen = false, allow_fp16_overflow = false, adapter = false, merge = false;
  std::string base;       // --merge: the base's weights (default: the run's record)
  std::string hf_config;  // a DeepSpeed checkpoint exported as a Hugging Face directory: the model's config.json
  bool module_weights = false;  // a DeepSpeed checkpoint: its module's (16-bit) weights instead of the fp32 master
};

// Refuses a destination that exists (without --overwrite), is or holds what the conversion reads
// (`sources`), or holds a ds run an export would hide (`exports`: DST receives Hugging Face files).
void check_destination(const ConvertArgs& a, const std::vector<std::string>& sources, bool exports);

// What an export wrote and removed, and its fp16 warnings, on stderr.
void report_export(const ExportSummary& s);

// The plan of rank `rank` of `world` ranks on one node for a conversion (`source` names where the world size came from).
Plan plan_for_rank(const Config& config, const ModelSpec& spec, int world, int rank, const char* source);

// Writes a ds run's checkpoint into `dst` as `files` ranks save it (one file, or one per rank of a sharded
// plan): `shard_of(r)` gives rank r's buffers, drawn piece by piece. Prints each further rank as it is written.
SavedCheckpoint write_run_checkpoint(const std::string& dst, const CheckpointScalars& scalars, int files,
                                     const std::function<CheckpointBuffers(int rank)>& shard_of, const std::string& plan_json,
                                     const std::string& config_json);

// SRC is a DeepSpeed checkpoint folder: --info, or its weights as a Hugging Face directory or one file.
int convert_deepspeed(const ConvertArgs& a);

}  // namespace ds::cli
