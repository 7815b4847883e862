// ds — the profile report, shared by `ds profile` and `ds train`'s flops_profiler block: one rank's
// measurements as JSON (what a launched rank hands to the launcher), the report built from every rank's,
// its text form, and a Chrome trace. No LibTorch: everything comes from the Plan and TrainResults.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/plan/plan.hpp"
#include "engine/runtime/run/trainer_api.hpp"

namespace ds::cli {

// One rank's per-step measurements (phases, block times, bytes, memory) and collective totals.
nlohmann::json profile_rank_part(const Plan& plan, const TrainResult& r);

struct ReportOptions {
  int warmup = 2;  // the first steps left out
  int end = -1;    // one past the last step reported; -1: every step after the warm-up
  int depth = 1;   // module rows down to this depth (1 or 2)
  int top = 10;    // the largest modules named
};
// The report (schema_version 1): rank 0's figures, every rank's step time beside them.
nlohmann::json build_profile_report(const Plan& plan, const std::vector<nlohmann::json>& parts, const ReportOptions& options);
// As a person reads it; `detailed` false leaves out the per-module table.
std::string render_profile_text(const Plan& plan, const nlohmann::json& report, bool detailed);
// Chrome trace-event JSON: a process per rank, tracks for compute, communication and offload I/O.
nlohmann::json profile_chrome_trace(const Plan& plan, const std::vector<nlohmann::json>& parts);

}  // namespace ds::cli
