// ds — what `ds train` may do with a run directory (train.output_dir) before it starts: never write a
// fresh run over another one, clear it only when asked (--overwrite), and on a resume keep the
// schedule the checkpoint was trained with unless the user changed the schedule itself.
#pragma once

#include <string>
#include <vector>

#include "engine/plan/plan.hpp"

namespace ds::cli {

// Throws UserError (exit 2) when `dir` cannot hold a run (a file, or its checkpoints/ is a file) or,
// for a fresh run without `overwrite`, when it already holds one (naming its last step). With
// `overwrite`, removes what ds wrote there: checkpoints/, metrics.jsonl, train.log, config.json,
// plan.json (logs/ belongs to the launcher, other files to the user). Returns warnings to print.
std::vector<ConfigIssue> prepare_run_dir(const std::string& dir, bool resume, bool overwrite);

// Overrides that keep a resumed run's schedule where the checkpoint had it: scheduler lengths that
// followed train.steps ("auto" or absent) are pinned to the checkpoint's values when train.steps
// changed. `note` says what was kept. Empty when nothing needs pinning.
std::vector<std::string> schedule_pins(const std::string& checkpoint_plan_json, const Plan& plan, const Config& config,
                                       std::string* note);

}  // namespace ds::cli
