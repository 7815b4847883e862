// ds — the policy of a run directory (train.output_dir), decided before `ds train` starts: never write
// a fresh run over another one, clear it only when asked (--overwrite), find the checkpoint to continue
// from, keep the schedule the checkpoint was trained with unless the user changed the schedule itself,
// and name what else changed since. The CLI wires these and prints their results.
#pragma once

#include <string>
#include <vector>

#include "engine/plan/plan.hpp"

namespace ds {

// Throws UserError (exit 2) when `dir` cannot hold a run (a file, or its checkpoints/ is a file) or,
// for a fresh run without `overwrite`, when it already holds one (naming its last step). With
// `overwrite`, removes what ds wrote there: checkpoints/, metrics.jsonl, train.log, config.json,
// plan.json (logs/ belongs to the launcher, other files to the user). Returns warnings to print.
std::vector<ConfigIssue> prepare_run_dir(const std::string& dir, bool resume, bool overwrite);

// The checkpoint a run continues from, settled before any work so that a bad path fails at once:
// `resume` "false" gives "", "auto" the newest complete checkpoint in `output_dir` ("" when there is
// none), anything else that path (a run directory or a checkpoint; UserError when it is neither).
std::string resume_checkpoint(const std::string& resume, const std::string& output_dir);

// The keys whose resolved values differ between the checkpoint's config and this run's, besides those
// a continued run is meant to change (train.resume, train.steps, the scheduler's lengths).
std::vector<std::string> config_changes_since(const std::string& checkpoint, const std::string& resolved_config_json);

// Overrides that keep a resumed run's schedule where the checkpoint had it: scheduler lengths that
// followed train.steps ("auto" or absent) are pinned to the checkpoint's values when train.steps
// changed. `note` says what was kept. Empty when nothing needs pinning.
std::vector<std::string> schedule_pins(const std::string& checkpoint_plan_json, const Plan& plan, const Config& config,
                                       std::string* note);

}  // namespace ds
