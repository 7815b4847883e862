// ds — checkpoints on disk. A run directory holds checkpoints/step_NNNNNNNN/, each with state.h5 (HDF5)
// and a DONE marker, plus checkpoints/latest naming the newest. Writing is crash-safe: everything goes
// to a hidden .step_NNNNNNNN.partial directory first, is flushed, marked DONE and renamed into place;
// `latest` is replaced by an atomic rename. Readers never trust `latest` alone: the newest directory
// with a DONE marker wins, so a crash mid-write can never be resumed from.
//
// state.h5 (format version 2; see ds-checkpoint(5)):
//   attributes on /: format_version, step, applied_steps, skipped_steps, seed, world_size, model_numel,
//                    loss_scale, loss_scale_iteration, loss_scale_last_overflow, loss_scale_hysteresis
//   datasets: /plan_json and /config_json (strings), /base_json (LoRA: the frozen base's source), and rank 0's shard
// shard_NNNNN.h5, one per further rank (ZeRO stages 1-3 across ranks), and state.h5 itself hold a shard:
//   /segments (int64 [k, 3]: global offset in the unpadded flat order, local offset, length) and
//   /master, /optimizer/exp_avg, /optimizer/exp_avg_sq (fp32, the rank's local elements).
// Loading maps every segment the loading rank owns onto the files' segments, so a checkpoint saved at
// one world size or stage resumes at any other. Version 1 files (one whole /master) still load.
// No LibTorch here: the trainer hands over raw buffers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <functional>
#include <limits>

#include "engine/plan/layout.hpp"
#include "engine/runtime/run/loss_scaler.hpp"

namespace ds {

struct PlanRecord;  // engine/plan/plan_record.hpp

constexpr int kCheckpointFormatVersion = 3;

struct CheckpointScalars {
  int64_t step = 0;           // optimizer steps attempted: the data position
  int64_t applied_steps = 0;  // successful steps: the schedule's position and Adam's step count
  int64_t skipped_steps = 0;
  uint64_t seed = 0;
  LossScalerState loss_scaler;
  double loss = std::numeric_limits<double>::quiet_NaN();  // the training loss of the step saved after (NaN: unknown)
  // LoRA: the frozen base the adapter was trained on (its source and checksum, JSON), which the checkpoint
  // does not hold; "" for a run that trains every weight. Written as the /base_json data set.
  std::string base_json;
};

// Produces elements [at, at + n) of a buffer into `out`.
using FloatPieces = std::function<void(int64_t at, int64_t n, float* out)>;

// Saving only: a shard produced piece by piece rather than held in memory. `read` fills elements
// [at, at + n) of the local master weights and of the `moments` optimizer buffers (null beyond them).
struct ShardPieces {
  int moments = 0;  // 0, 1 (exp_avg) or 2 (exp_avg and exp_avg_sq)
  std::function<void(int64_t at, int64_t n, float* master, float* exp_avg, float* exp_avg_sq)> read;
};

struct CheckpointBuffers {  // this rank's local buffers, not owned; each `numel` fp32 elements
  float* master = nullptr;      // null when saving from `pieces`
  float* exp_avg = nullptr;     // Adam/Lamb first moment or SGD's momentum buffer; null: the optimizer has none
  float* exp_avg_sq = nullptr;  // Adam/Lamb second moment; null: none
  int64_t numel = 0;
  std::vector<OwnedSegment> segments;  // where the local elements belong in the whole model
  int64_t model_numel = 0;             // elements of the whole model
  // Read every data set in full against its checksum first. A reader taking a checkpoint apart in many
  // small loads (ds convert-ckpt, tensor by tensor) verifies on the first and skips it after.
  bool verify = true;
  // Saving only: when set, the shard is drawn from here instead of the pointers, so ds convert-ckpt writes
  // a checkpoint of a model larger than memory holding one piece of each buffer.
  ShardPieces pieces = {};
};

// Who writes: every rank writes its shard; rank 0 also the scalars, and marks the directory DONE once
// `barrier` says every rank has flushed its file. One rank: {0, 1, no barrier}.
struct CheckpointWriter {
  int rank = 0, world_size = 1;
  std::function<void()> barrier;
};

struct SavedCheckpoint {
  std::string path;  // the checkpoint directory
  uint64_t bytes = 0;
  std::vector<std::string> notes;  // what pruning removed and what it kept (a user's files inside a checkpoint)
};

// Whether a file inside a checkpoint directory is one ds writes there (state.h5, shard_NNNNN.h5, DONE, .save_id).
bool is_checkpoint_file_name(const std::string& name);

// Removes the files ds wrote in a checkpoint directory, and the directory when nothing else is left in it.
// Returns what it kept (a user's notes.txt, eval_results.json: never deleted), as paths. A checkpoint another
// process is reading (a CheckpointReader of it is alive) is left whole: `busy` says so (nullptr: wait for it).
std::vector<std::string> remove_checkpoint(const std::string& checkpoint_dir, bool* busy = nullptr);

// While alive, a shared lock (flock) on a checkpoint directory: pruning leaves a checkpoint alone while an
// export or a run reads it. `path` as resolve_checkpoint_path takes it; when it names a run directory and its
// newest checkpoint is pruned before the lock is taken, the then newest one is read instead.
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& path);
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  int fd_ = -1;
};

// Writes <run_dir>/checkpoints/step_<step>/ and updates `latest`; keeps the newest `keep_last`
// complete checkpoints (0 keeps all) and, besides them, the one saved at the lowest loss. Throws std::runtime_error naming the path on I/O failure.
// Every rank calls it together.
SavedCheckpoint save_checkpoint(const std::string& run_dir, const CheckpointScalars& scalars, const CheckpointBuffers& buffers,
                                const std::string& plan_json, const std::string& config_json, int64_t keep_last,
                                const CheckpointWriter& writer = {});

// The complete checkpoint saved at the lowest training loss (the newest when none records its loss), or "".
std::string best_checkpoint(const std::string& run_dir);

// The checkpoint <run_dir>/checkpoints/latest names when it is complete, else the complete one with the
// highest step, or "" when there is none.
std::string find_latest_checkpoint(const std::string& run_dir);
// Folders named step_* that are not a step number (step_garbage, step_99999999999999999999): skipped.
std::vector<std::string> unreadable_checkpoint_names(const std::string& run_dir);

// Accepts a checkpoint directory, its state.h5, or a run directory (its newest checkpoint). Throws
// UserError naming the path when there is no complete checkpoint there.
std::string resolve_checkpoint_path(const std::string& path);

// Reads the caller's segments of a checkpoint (any world size, any stage) into its buffers. Throws
// UserError for a wrong format version or a model of another size, naming both sizes.
CheckpointScalars load_checkpoint(const std::string& checkpoint_dir, const CheckpointBuffers& buffers);

// The segments of `owned` within local elements [begin, end), placed from `begin`: a piece of a rank's part
// loaded or saved on its own (a swapped sub-group, the two places of a partial offload).
std::vector<OwnedSegment> segments_within(const std::vector<OwnedSegment>& owned, int64_t begin, int64_t end);
std::string read_checkpoint_text(const std::string& checkpoint_dir, const char* which);  // "plan_json" | "config_json"
// The plan the checkpoint stores, read as a record (UserError naming the checkpoint when it is damaged).
PlanRecord read_checkpoint_plan(const std::string& checkpoint_dir);

// The HDF5 library's version, e.g. "1.10.8" (for `ds --version`).
std::string hdf5_version();

}  // namespace ds
