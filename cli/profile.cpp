#include "cli/profile.hpp"

#include <csignal>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/files.hpp"
#include "common/format.hpp"
#include "common/strings.hpp"
#include "engine/plan/plan_record.hpp"
#include "engine/plan/runnable.hpp"
#include "cli/profile_report.hpp"
#include "cli/launcher.hpp"
#include "engine/runtime/run/runtime_library.hpp"

namespace ds::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct ProfileArgs {
  ConfigArgs config;
  int steps = 5;
  ReportOptions report;  // warm-up, module depth, top modules
  bool json = false;
  std::string trace, hostfile, part_dir;
};

// Removes the scratch run directory however the profile ends.
struct Scratch {
  std::string dir;
  explicit Scratch(const std::string& d) : dir(d) {}
  ~Scratch() {
    std::error_code ec;
    if (!dir.empty()) fs::remove_all(dir, ec);
  }
};

std::string make_scratch_dir() {
  std::string tmpl = (fs::temp_directory_path() / "ds-profile-XXXXXX").string();
  if (!mkdtemp(tmpl.data())) throw UserError("cannot create a scratch directory in " + fs::temp_directory_path().string(), "set TMPDIR");
  return tmpl;
}

int run_profile(const ProfileArgs& a) {
  return run_guarded("profile", [&]() -> int {
    if (a.steps < 1) throw UserError("--steps must be at least 1", "");
    ConfigArgs args = with_config_path(a.config);
    args.inputs_must_exist = true;
    args.runs_here = true;
    args.steps_measured_alone = true;
    const bool rank_process = started_as_rank();
    // The run goes to a scratch directory (removed at the end) and is as long as warm-up + measured steps.
    const Scratch scratch(rank_process ? std::string() : make_scratch_dir());
    const std::string part_dir = rank_process ? a.part_dir : scratch.dir;
    args.overrides.push_back("train.steps=" + std::to_string(a.report.warmup + a.steps));
    args.overrides.push_back("train.epochs=null");  // the steps profiled, not the config's epochs
    args.overrides.push_back("train.output_dir=" + part_dir + "/run");
    args.own_choices.push_back("scheduler.params.total_num_steps");  // follows the steps profiled, not the user's
    default_ranks_to_visible_gpus("profile", args, a.hostfile, /*profiling=*/true);
    const RankLaunch launch = rank_launch(a.hostfile, args);
    const bool launcher = launch.launcher;
    const CompiledConfig compiled = compile_config("profile", args, /*quiet=*/launcher);
    const Plan& plan = compiled.plan;
    std::vector<json> parts;
    if (launcher) {
      refuse_not_runnable(plan, not_yet_runnable(plan, /*profiling=*/true));  // what the ranks would refuse, before any starts
      LaunchSpec spec = rank_launch_spec(launch, args, part_dir + "/logs", compiled.config.train.comm_timeout_s);
      spec.args.push_back("--part-dir");
      spec.args.push_back(part_dir);
      std::cerr << "ds profile: starting " << plan.topology.world_size << " ranks\n";
      const int code = launch_ranks(spec);
      if (code != 0) return code;
      for (int r = 0; r < plan.topology.world_size; ++r) {
        std::ifstream in(part_dir + "/rank_" + std::to_string(r) + ".json");
        if (!in) throw std::runtime_error("rank " + std::to_string(r) + " left no measurements in " + part_dir);
        parts.push_back(json::parse(in));
      }
    } else {
      TrainOptions opt;
      opt.resolved_config_json = compiled.resolved_json;
      opt.plan_json = plan_to_json(plan);
      opt.print_every = 1000000;
      opt.profile = true;
      const TrainResult result = train_with_runtime(plan, opt);
      if (result.interrupted) return result.stop_signal == SIGTERM ? kExitTerminated : kExitInterrupted;
      parts.push_back(profile_rank_part(plan, result));
      if (rank_process) {  // a launched rank: the launcher assembles the report
        write_text_atomically(part_dir + "/rank_" + std::to_string(plan.topology.rank) + ".json", parts.back().dump());
        return kExitOk;
      }
    }
    const json report = build_profile_report(plan, parts, a.report);
    if (!a.trace.empty()) {
      write_text_atomically(a.trace, profile_chrome_trace(plan, parts).dump());
      std::cerr << "ds profile: trace in " << a.trace << " (open in https://ui.perfetto.dev or chrome://tracing)\n";
    }
    if (a.json)
      std::cout << report.dump(2) << "\n";
    else
      std::cout << render_profile_text(plan, report, true);
    return kExitOk;
  }, a.json);
}

}  // namespace

Subcommand setup_profile(CLI::App& app) {
  auto a = std::make_shared<ProfileArgs>();
  CLI::App* sub = app.add_subcommand("profile", "where time, FLOPs, bytes and memory go in a training step");
  add_config_args(sub, a->config);
  sub->add_option("--steps", a->steps, "steps measured (default 5)")->check(CLI::Range(1, 100000));
  sub->add_option("--warmup", a->report.warmup, "steps run first and left out of the figures (default 2)")->check(CLI::Range(0, 100000));
  sub->add_option("--module-depth", a->report.depth, "module rows down to this depth: 1 blocks, 2 their attention / MLP / norms (default 1)")
      ->check(CLI::Range(1, 2));
  sub->add_option("--top-modules", a->report.top, "how many modules to name as the largest by FLOPs (default 10)")->check(CLI::Range(0, 100000));
  sub->add_flag("--json", a->json, "the whole report as JSON on standard output (schema_version 1)");
  sub->add_option("--trace", a->trace, "also write a Chrome trace-event JSON file (Perfetto, chrome://tracing): a process per rank");
  sub->add_option("--hostfile", a->hostfile, "start ranks on these hosts over ssh, as ds train");
  sub->add_option("--part-dir", a->part_dir, "")->group("");  // a launched rank: where its measurements go
  sub->footer(R"(Examples:
  ds profile examples/quickstart.json
  ds profile my.json bf16.enabled=true --steps 10 --module-depth 2
  ds profile my.json --nproc-per-node 2 zero_optimization.stage=3 --trace profile.json
  ds profile my.json --json > report.json

Runs the configured training for --warmup + --steps steps with the same engine as ds train, and
writes nothing else: the run goes to a scratch directory that is removed, no checkpoint is saved, no
validation runs. Reports the step's phases (summing to the step time, the remainder shown as
unaccounted), FLOPs per module counted from the model's matmuls (backward counted, not estimated),
achieved FLOP/s and MFU against a matmul peak measured in the same run at the model's own GEMM shapes,
bytes and time per collective beside the plan's table, and peak memory beside the plan's. See ds-profile(1).)");
  return {sub, [a] { return run_profile(*a); }};
}

}  // namespace ds::cli
