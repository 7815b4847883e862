// ds — the policy of a run directory (train.output_dir), decided before `ds train` starts: never write
// a fresh run over another one, clear it only when asked (--overwrite), find the checkpoint to continue
// from, keep the schedule the checkpoint was trained with unless the user changed the schedule itself,
// and name what else changed since. The CLI wires these and prints their results.
#pragma once

#include <string>
#include <vector>

#include "engine/plan/plan.hpp"
#include "engine/plan/plan_record.hpp"

namespace ds {

// What a command asks of a run directory before it writes there.
struct RunDirRequest {
  std::string dir;
  bool resume = false;             // continue a run (train.resume set)
  std::string resume_from;         // the checkpoint it continues from ("" when none was found)
  bool overwrite = false;          // --overwrite: remove the run the directory holds
  std::vector<std::string> sources;  // what the command reads (init_from, data, its config): never cleared
};

// Throws UserError (exit 2) when `dir` cannot hold this run:
// - it is a file, or one of the names ds writes there is a file of another kind or a symbolic link
//   (ds never writes through a link);
// - it holds files ds did not write and no run (a Hugging Face export, a user's folder), or files ds
//   did not write under the names it writes (config.json, plan.json, metrics.jsonl, train.log);
// - it holds a run and this is a fresh start without `overwrite`, or the resume of a checkpoint from
//   another directory (which would replace its checkpoints and mix its metrics);
// - with `overwrite`, a source lies inside what would be removed.
// With `overwrite`, removes only what ds wrote there (the files of the checkpoints it can identify, latest,
// partial saves, metrics.jsonl, train.log, config.json, plan.json, logs/rank_N.log), each named in the
// warnings returned; a user's files (inside a checkpoint directory too) are kept and named.
std::vector<ConfigIssue> prepare_run_dir(const RunDirRequest& request);

// Whether `dir` holds a run ds wrote: a complete checkpoint, or a metrics.jsonl of ds's making.
bool holds_run(const std::string& dir);

// Whether `inner` is `outer` or lies inside it (after resolving links and "..": both may not exist yet).
bool path_within(const std::string& inner, const std::string& outer);
bool same_path(const std::string& a, const std::string& b);

// The run directory a checkpoint (RUN/checkpoints/step_N) belongs to, or "" when it lies elsewhere.
std::string checkpoint_run_dir(const std::string& checkpoint);

// One writer per run directory: advisory locks (flock) on DIR itself and on DIR/.ds.lock, held while the
// process or any process it started lives (the launcher's ranks inherit them), recording host, pid, start
// time and a token, so that a second run is refused naming the holder. A lock no process holds any more is
// taken over (`note` says whose). Ranks started by ds's own launcher run under the launcher's lock: its
// DS_RUN_LOCK ("TOKEN:PATH") must carry the token the holder wrote, so that setting it by hand, or removing
// .ds.lock, lets no second run in.
class RunDirLock {
 public:
  RunDirLock() = default;
  explicit RunDirLock(const std::string& dir);  // throws UserError when another live process holds it
  ~RunDirLock();
  RunDirLock(RunDirLock&& other) noexcept;
  RunDirLock& operator=(RunDirLock&& other) noexcept;
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;
  const std::string& note() const { return note_; }
  const std::string& path() const { return path_; }
  // The lock's descriptors, for the launcher to hand to the ranks it starts on this machine (they close on
  // exec otherwise). Ranks started over ssh cannot inherit them: the launcher's lock covers them only while
  // the launcher lives.
  std::vector<int> inheritable_fds() const;

 private:
  void release();
  int fd_ = -1, dir_fd_ = -1;
  std::string path_, note_;
};

// The checkpoint a run continues from, settled before any work so that a bad path fails at once:
// `resume` "false" gives "", "auto" the newest complete checkpoint in `output_dir` ("" when there is
// none), anything else that path (a run directory or a checkpoint; UserError when it is neither).
std::string resume_checkpoint(const std::string& resume, const std::string& output_dir);

// The keys whose resolved values differ between the checkpoint's config and this run's, besides those
// a continued run is meant to change (train.resume, train.steps, the scheduler's lengths), those the plan
// kept of the checkpoint to continue it as it was (`kept`: Plan::kept's paths), and, where the global batch is the
// checkpoint's, the keys that only lay the run out (micro batch and accumulation, the ZeRO stage, the mesh); never
// a key ds does not act on (the schema's x-ds-ignored).
std::vector<std::string> config_changes_since(const std::string& checkpoint, const std::string& resolved_config_json,
                                              const KeptFromCheckpoint& kept);

// Throws UserError when the checkpoint's tensors (its plan's layout: names and shapes, in order) differ
// from this plan's: the same parameter count in other shapes would load every weight into the wrong place.
void check_resume_shapes(const std::string& checkpoint, const PlanRecord& checkpoint_plan, const Plan& plan);

}  // namespace ds
