#include "engine/runtime/run_policy.hpp"

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "engine/runtime/checkpoint.hpp"
#include "schema/json_diff.hpp"

namespace ds {
namespace fs = std::filesystem;

namespace {

int64_t count_lines(const fs::path& file) {
  std::ifstream in(file);
  int64_t n = 0;
  for (std::string line; std::getline(in, line);) n += !line.empty();
  return n;
}

}  // namespace

std::vector<ConfigIssue> prepare_run_dir(const std::string& dir, bool resume, bool overwrite) {
  std::vector<ConfigIssue> warnings;
  std::error_code ec;
  const fs::path root(dir);
  if (fs::exists(root, ec) && !fs::is_directory(root, ec))
    throw UserError("train.output_dir '" + dir + "' is a file, not a directory", "choose another train.output_dir");
  if (fs::exists(root / "checkpoints", ec) && !fs::is_directory(root / "checkpoints", ec))
    throw UserError("'" + (root / "checkpoints").string() + "' is a file; ds keeps its checkpoints in a directory of that name",
                    "move the file away, or choose another train.output_dir");
  for (const auto& name : unreadable_checkpoint_names(dir))
    warnings.push_back({"", "skipping " + (root / "checkpoints" / name).string() + ": not a step number", ""});
  if (resume) return warnings;

  const std::string latest = find_latest_checkpoint(dir);
  const int64_t metric_lines = count_lines(root / "metrics.jsonl");
  if (latest.empty() && metric_lines == 0) return warnings;
  if (!overwrite) {
    std::string what;
    if (!latest.empty()) what = "checkpoint " + fs::path(latest).filename().string();
    if (metric_lines > 0) what += (what.empty() ? "" : ", ") + std::string("metrics.jsonl with ") + std::to_string(metric_lines) + " steps";
    throw UserError("train.output_dir '" + dir + "' holds a run (" + what + "); a fresh run would overwrite it",
                    "continue it with --resume; start over with --overwrite (deletes its checkpoints, metrics.jsonl "
                    "and train.log); or choose another directory, e.g. train.output_dir=" + dir + "-2");
  }
  for (const char* name : {"checkpoints", "metrics.jsonl", "train.log", "config.json", "plan.json"}) {
    fs::remove_all(root / name, ec);
    if (ec) throw UserError("--overwrite: cannot remove '" + (root / name).string() + "': " + ec.message(), "");
  }
  warnings.push_back({"", "--overwrite: removed the previous run's checkpoints, metrics and logs from " + dir, ""});
  return warnings;
}

std::vector<std::string> schedule_pins(const std::string& checkpoint_plan_json, const Plan& plan, const Config& config,
                                       std::string* note) {
  std::vector<std::string> pins;
  if (plan.scheduler.type == SchedulerType::None) return pins;
  nlohmann::json old;
  try {
    old = nlohmann::json::parse(checkpoint_plan_json);
  } catch (const nlohmann::json::exception&) {
    return pins;  // an older or damaged plan: nothing to compare against
  }
  const int64_t old_steps = old.value("steps", int64_t{0});
  if (old_steps == plan.steps || !old.contains("scheduler") ||
      old["scheduler"].value("type", std::string()) != scheduler_type_name(plan.scheduler.type))
    return pins;
  const SchedulerConfig& now = plan.scheduler.params;
  std::string kept;
  for (const auto& [key, value] : {std::pair{"total_num_steps", now.total_num_steps}, {"warmup_num_steps", now.warmup_num_steps}}) {
    const std::string path = std::string("scheduler.params.") + key;
    const auto src = config.value_source.find(path);
    const bool given = src != config.value_source.end() && (src->second == "file" || src->second == "override");
    if (given || !value || !old["scheduler"].contains(key)) continue;
    const int64_t was = old["scheduler"][key].get<int64_t>();
    if (was == *value) continue;
    pins.push_back(path + "=" + std::to_string(was));
    kept += (kept.empty() ? "" : ", ") + std::string(key) + "=" + std::to_string(was);
  }
  if (!pins.empty())
    *note = "train.steps " + std::to_string(old_steps) + " -> " + std::to_string(plan.steps) + ": the schedule keeps " + kept +
            " from the checkpoint; set scheduler.params.total_num_steps (and warmup_num_steps) to stretch it";
  return pins;
}

std::string resume_checkpoint(const std::string& resume, const std::string& output_dir) {
  if (resume == "false") return "";
  if (resume == "auto") return find_latest_checkpoint(output_dir);
  return resolve_checkpoint_path(resume);
}

std::vector<std::string> config_changes_since(const std::string& checkpoint, const std::string& resolved_config_json) {
  std::vector<std::string> changed;
  for (const auto& p : json_differences(read_checkpoint_text(checkpoint, "config_json"), resolved_config_json))
    if (p != "train.resume" && p != "train.steps" && p.rfind("scheduler.params.", 0) != 0) changed.push_back(p);
  return changed;
}

}  // namespace ds
