#include "cli/train.hpp"

#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <set>

#include <nlohmann/json.hpp>

#include "common/files.hpp"
#include "common/format.hpp"
#include "common/hash.hpp"
#include "common/stop_signals.hpp"
#include "common/strings.hpp"
#include "engine/plan/fit.hpp"
#include "engine/plan/runnable.hpp"
#include "engine/runtime/io/checkpoint.hpp"
#include "engine/runtime/data/token_source.hpp"
#include "cli/launcher.hpp"
#include "cli/run_policy.hpp"
#include "engine/runtime/run/runtime_library.hpp"
#include "engine/runtime/io/weights.hpp"
#include "schema/loader.hpp"
#include "engine/plan/plan_record.hpp"
#include "cli/tokenizer_record.hpp"
#include "cli/profile_report.hpp"

namespace ds::cli {
namespace {

// True when the overrides name a checkpoint for train.resume (not true/false/auto).
bool explicit_resume_path(const std::vector<std::string>& overrides) {
  for (const auto& o : overrides)
    if (o.rfind("train.resume=", 0) == 0) {
      const std::string v = o.substr(13);
      if (v != "auto" && v != "true" && v != "false" && v != "\"auto\"") return true;
    }
  return false;
}

// The command that continues this run: the same words (config, overrides, flags), with --resume. A rank
// started by ds's launcher takes the launcher's words (--nproc-per-node, --hostfile included).
std::string resume_command() {
  std::string cmd = "ds train";
  bool has_resume = false;
  std::vector<std::string> words = command_line();
  if (const char* launched = std::getenv("DS_LAUNCH_COMMAND"); launched && started_as_rank()) {
    words.clear();
    std::string w;
    for (const char* c = launched;; ++c) {
      if (*c == '\x1f' || *c == '\0') {
        words.push_back(w);
        w.clear();
        if (!*c) break;
      } else {
        w += *c;
      }
    }
  }
  for (const auto& w : words) {
    if (w == "train" && cmd == "ds train") continue;  // the subcommand itself
    if (w == "--overwrite") continue;                  // continuing must not delete what it continues
    has_resume |= w == "--resume";
    cmd += " " + shell_quote(w);
  }
  return has_resume ? cmd : cmd + " --resume";
}

// DeepSpeed's flops_profiler block: ds profile's report of step profile_step (rank 0's figures), printed
// when the run ends, to standard output or output_file.
void print_flops_profile(const Plan& plan, const FlopsProfilerConfig& f, const TrainResult& r) {
  const int64_t ran = static_cast<int64_t>(r.step_seconds.size());
  if (ran == 0) return;
  // The vectors start at this run's first step (a resumed run's is not step 1).
  const int64_t index = std::clamp<int64_t>(f.profile_step - 1 - r.first_step, 0, ran - 1);
  const nlohmann::json report = build_profile_report(
      plan, {profile_rank_part(plan, r)},
      {static_cast<int>(index), static_cast<int>(index + 1), f.module_depth == 1 ? 1 : 2, static_cast<int>(f.top_modules)});
  const std::string text = "flops_profiler: step " + std::to_string(r.first_step + index + 1) + "\n" +
                           render_profile_text(plan, report, f.detailed);
  if (f.output_file.empty()) {
    std::cout << text;
    return;
  }
  std::ofstream out(f.output_file);
  out << text;
  if (!out.flush()) throw UserError("cannot write flops_profiler.output_file '" + f.output_file + "'", "");
  std::cerr << "ds train: flops profile of step " << r.first_step + index + 1 << " in " << f.output_file << "\n";
}

// Until the trainer takes Ctrl-C and SIGTERM (loading LibTorch takes a second or two), a stop ends the
// process at once, saying so: nothing has been written to the run directory yet.
void stopped_before_the_trainer(int sig) {
  const char* text = sig == SIGTERM ? "ds train: stopped by SIGTERM while starting, before the first step: nothing was trained or saved\n"
                                    : "ds train: interrupted while starting, before the first step: nothing was trained or saved\n";
  if (::write(STDERR_FILENO, text, std::strlen(text)) < 0) {
  }
  ::_exit(sig == SIGTERM ? kExitTerminated : kExitInterrupted);
}

// The trainer takes the signals over from stopped_before_the_trainer and, ending, hands them back: to the
// default instead, so a signal after the run (which has saved) is never reported as a stop while starting.
StopHandler set_for_the_trainer(StopHandler handler) {
  return set_stop_handler(handler == stopped_before_the_trainer ? nullptr : handler);
}

// What the start-up does first, said at once: a large model's minute of drawing weights is not silence.
std::string start_line(const Plan& plan, const std::string& resume_from) {
  std::string what;
  if (!resume_from.empty()) what = "loading the checkpoint " + resume_from;
  else if (!plan.run.init_from.empty())
    what = std::string(plan.lora.enabled ? "reading the frozen base" : "reading the initial weights") + " from " + plan.run.init_from;
  else what = "drawing the initial weights of " + format_count(plan.model.num_params) + " parameters (seed " + std::to_string(plan.run.seed) + ")";
  const DeviceTraits device = plan.topology.device_traits();
  const std::string where = device.memory_is_host ? std::string("on the ") + device.label
                                                  : std::string("on ") + device.label + " " + std::to_string(plan.topology.local_rank);
  return "ds train: starting " + where + ": " + what + "; Ctrl-C or SIGTERM now stops it with nothing saved";
}

}  // namespace

Subcommand setup_train(CLI::App& app) {
  auto args = std::make_shared<TrainArgs>();
  CLI::App* sub = app.add_subcommand("train", "train a model as the config and its plan say");
  add_config_args(sub, args->config);
  sub->add_flag("--resume", args->resume,
                "continue from the checkpoint train.output_dir/checkpoints/latest names (train.resume=auto); "
                "starts fresh when there is none; an explicit train.resume=PATH is used instead");
  sub->add_flag("--no-fit-check", args->no_fit_check,
                "start even when the plan needs more memory per node than this machine has (it will likely be killed)");
  sub->add_flag("--overwrite", args->overwrite,
                "start fresh even though train.output_dir holds a run: what ds wrote there (checkpoints, metrics.jsonl, "
                "train.log, config.json, plan.json) is deleted first, each named; other files are kept");
  sub->add_option("--hostfile", args->hostfile,
                  "start ranks on these hosts over ssh: DeepSpeed's 'hostname slots=N' lines (DS_SSH replaces ssh)");
  sub->add_option("--master-addr,--master_addr", args->master_addr, "where the ranks rendezvous (default: the hostfile's first host)");
  sub->add_option("--master-port,--master_port", args->master_port, "the rendezvous port (default: a free one on this machine, else 29500)")
      ->check(CLI::Range(1, 65535));
  // DeepSpeed's launcher filters hosts and GPUs; ds takes the hosts and slots from the hostfile alone.
  for (const char* flag : {"--include", "--exclude"})
    sub->add_option_function<std::string>(
           flag,
           [flag](const std::string&) {
             throw UserError(std::string(flag) + " is DeepSpeed's host/GPU filter; ds has none",
                             "list only the hosts to use, with their slots, in the --hostfile (lines 'host slots=N'); "
                             "on one machine, --nproc-per-node N starts N ranks");
           },
           "DeepSpeed's host filter: answered with the ds equivalent (list the hosts in --hostfile)")
        ->group("");
  sub->footer(R"(Examples:
  ds train examples/quickstart.json
      a tiny GPT-2 on an embedded synthetic language: the loss falls towards its known floor in seconds
  ds train examples/quickstart.json train.steps=1000 optimizer.params.lr=1e-3
      overrides, exactly as for `ds plan`
  ds train my.json data.type=text data.path=corpus.txt data.tokenizer=bytes
  ds train examples/quickstart.json train.steps=600 --resume
      continue the quickstart run from its last checkpoint, exactly where it stopped
  ds train examples/quickstart.json --nproc-per-node 2 zero_optimization.stage=3
      two ranks on this machine (each takes its share of the global batch), ZeRO stage 3
  ds train my.json --hostfile hosts.txt --master-addr 10.0.0.1
      every host's slots, started over ssh in this directory (the binary and data at the same paths)

The run directory (train.output_dir) receives config.json (the resolved config), plan.json,
metrics.jsonl (one JSON object per step) and checkpoints/step_NNNNNNNN/ (HDF5, every train.save_every
steps, at the end and on Ctrl-C; the newest train.keep_last are kept). Progress goes to stderr: a live line on a terminal, plain
lines every steps_per_print steps (default 10) otherwise. Ctrl-C saves a checkpoint after the current step and exits 130.
--nproc-per-node N starts N local ranks (rank 0 prints, the others log to train.output_dir/logs/rank_N.log)
at any ZeRO stage; a checkpoint resumes at any world size. Optimizer offload (CPU or NVMe, stages 1-3) and
parameter offload (stage 3) run as zero_optimization's offload blocks say. A fresh run into a directory
that holds a run is refused: --resume continues it, --overwrite replaces it (removing only what ds wrote);
a directory another ds run is using, or one holding files ds did not write, is refused. This build trains
on the CPU (--device auto). SIGTERM and Ctrl-C save a checkpoint after the current step. See ds-train(1).)");
  return {sub, [args] { return run_train(*args); }};
}

namespace {

// The one fit rule (engine/plan/fit.hpp): a plan past what the machine has is refused; one inside the
// headroom starts with a warning (ds plan calls it tight).
void check_fits(const Plan& plan, bool no_fit_check, bool launcher) {
  const FitCheck fit = check_fit(plan, plan.topology.headroom);
  if (fit.does_not_fit() && !no_fit_check)
    throw UserError("the plan needs " +
                        (fit.host == Fit::does_not_fit ? format_bytes(fit.host_need) + " of host memory per node, but this machine has " + format_bytes(fit.host_have)
                                                       : format_bytes(fit.device_need) + " per GPU, but it has " + format_bytes(fit.device_have)),
                    "`ds plan` shows where it goes: lower the micro batch or the sequence, raise the ZeRO stage, enable "
                    "model.activation_checkpointing, or add --no-fit-check to start anyway");
  if (!fit.fits() && !fit.does_not_fit() && !launcher)
    print_warnings("train", {{"", "the plan leaves less than the headroom free (" +
                                       (fit.host == Fit::within_headroom ? fit_text(fit.host, fit.host_need, fit.host_have, plan.topology.headroom)
                                                                         : fit_text(fit.device, fit.device_need, fit.device_have, plan.topology.headroom)) +
                                       "): what the memory model does not count may not fit",
                              "a smaller micro batch, or model.activation_checkpointing, leaves more"}});
}

// This process starts the ranks (--nproc-per-node, --hostfile) and waits for them.
int launch_ranks_of(const RankLaunch& launch, const ConfigArgs& args, const CompiledConfig& compiled, const TrainArgs& a,
                    const RunDirLock& lock) {
  const Plan& plan = compiled.plan;
  const Config& config = compiled.config;
  LaunchSpec spec = rank_launch_spec(launch, args, config.train.output_dir + "/logs", config.train.comm_timeout_s);
  spec.inherit_fds = lock.inheritable_fds();
  spec.master_addr = a.master_addr;
  spec.master_port = a.master_port;
  const int world = plan.topology.world_size;
  // --num_gpus 2 where no GPU trains starts CPU processes: said, not left to be found out.
  std::cerr << "ds train: starting " << world << " " << plan.topology.device_traits().label << " ranks "
            << (launch.hosts.empty() ? std::string("on this machine") : "on " + std::to_string(launch.hosts.size()) + " hosts from " + a.hostfile)
            << (world == 2 ? "; rank 1 logs to " + spec.log_dir + "/rank_1.log\n"
                           : "; ranks 1-" + std::to_string(world - 1) + " log to " + spec.log_dir + "/rank_N.log\n");
  return launch_ranks(spec);
}

// How the run ended, said, and its exit status.
int finish(const TrainResult& r, const Plan& plan, const Config& config, bool writes_run_dir) {
  const int stopped = r.stop_signal == SIGTERM ? kExitTerminated : kExitInterrupted;
  if (r.interrupted && r.losses.empty())
    std::cerr << "ds train: " << (r.stop_signal == SIGTERM ? "stopped by SIGTERM" : "interrupted") << " while "
              << (r.stopped_while.empty() ? std::string("starting") : r.stopped_while)
              << ", before the first step: nothing was trained or saved; the same command starts it again\n";
  if (r.losses.empty()) return r.interrupted ? stopped : kExitOk;
  if (writes_run_dir) std::cerr << "ds train: metrics in " << r.metrics_path << "\n";  // rank 0 writes them
  if (writes_run_dir && config.flops_profiler.enabled) print_flops_profile(plan, config.flops_profiler, r);
  if (r.interrupted && !r.last_checkpoint.empty()) std::cerr << "ds train: continue with: " << resume_command() << "\n";
  return r.interrupted ? stopped : kExitOk;
}

}  // namespace

int run_train(const TrainArgs& a) {
  return run_guarded("train", [&]() -> int {
    ConfigArgs args = with_config_path(a.config);
    args.inputs_must_exist = true;
    args.runs_here = true;
    args.resumes = true;
    // First, so that a train.resume=PATH override after it (or before: same key) names the checkpoint.
    if (a.resume && !explicit_resume_path(args.overrides)) args.overrides.insert(args.overrides.begin(), "train.resume=auto");
    // --nproc-per-node N or --hostfile: this process only starts the ranks (the config is checked for
    // that world size first).
    default_ranks_to_visible_gpus("train", args, a.hostfile);
    const RankLaunch launch = rank_launch(a.hostfile, args);
    const bool launcher = launch.launcher;
    CompiledConfig compiled = compile_config("train", args, /*quiet=*/launcher);  // rank 0 prints them
    const std::vector<std::string> autos = auto_choices(compiled.config, compiled.plan, nullptr);
    if (!launcher && !autos.empty() && compiled.plan.topology.rank == 0) std::cerr << "ds train: \"auto\" chose " << join(autos, ", ") << "\n";
    check_fits(compiled.plan, a.no_fit_check, launcher);
    check_resumed(compiled);
    // What ds cannot train yet (pipeline stages, tensor parallelism with LoRA...) is refused before a launcher
    // touches the run directory or starts a rank: each rank would refuse the same plan once started.
    if (launcher) refuse_not_runnable(compiled.plan, not_yet_runnable(compiled.plan));
    const bool writes_run_dir = compiled.plan.topology.rank == 0;
    // The checkpoint to continue from was settled with the plan (a bad train.resume is the config's error,
    // reported before anything about the output directory); what the plan kept of it is said once.
    const std::string& resume_from = compiled.resume_from;
    const std::optional<PlanRecord>& checkpoint_plan = compiled.checkpoint_plan;
    if (!launcher)
      for (const std::string& note : compiled.plan.kept.notes) std::cerr << "ds train: " << note << "\n";
    RunDirLock lock;  // held until the run (or the launched ranks) ends
    if (writes_run_dir) {
      const Config& c = compiled.config;
      lock = RunDirLock(c.train.output_dir);
      if (!lock.note().empty()) print_warnings("train", {{"", lock.note(), ""}});
      RunDirRequest request{c.train.output_dir, c.train.resume != "false", resume_from, a.overwrite,
                            {c.model.init_from, c.data.path, c.data.val_path, c.data.vocab_file, c.data.merges_file, c.source, resume_from}};
      print_warnings("train", prepare_run_dir(request));
    }
    if (launcher) return launch_ranks_of(launch, args, compiled, a, lock);
    TrainOptions opt;
    opt.resume_from = resume_from;
    if (opt.resume_from.empty() && compiled.config.train.resume == "auto")
      std::cerr << "ds train: no checkpoint in " << compiled.config.train.output_dir << "/checkpoints: starting fresh\n";
    const Plan& plan = compiled.plan;
    const Config& config = compiled.config;
    opt.resolved_config_json = compiled.resolved_json;
    if (!opt.resume_from.empty()) {
      const std::vector<std::string> changed = config_changes_since(opt.resume_from, opt.resolved_config_json, plan.kept);
      if (!changed.empty())
        print_warnings("train", {{"", "the config differs from the checkpoint's at: " + join(changed, ", "),
                                  "intended for keys such as train.steps; other changes alter the run being continued"}});
    }
    const std::vector<TokenizerFileRecord> tokenizer = tokenizer_record(config.data, config.model.init_from);
    if (checkpoint_plan) check_tokenizer_unchanged(*checkpoint_plan, tokenizer);
    opt.plan_json = plan_to_json(plan, tokenizer);
    const char* term = std::getenv("TERM");
    opt.live_progress = isatty(STDERR_FILENO) && !(term && std::string(term) == "dumb");
    opt.print_every = config.steps_per_print.value_or(10);
    const StopHandler before = set_stop_handler(stopped_before_the_trainer);  // before the line that says so
    opt.set_stop_handler = set_for_the_trainer;
    std::cerr << start_line(plan, opt.resume_from) << "\n";
    const TrainResult r = train_with_runtime(plan, opt);  // loads LibTorch, here and only here
    set_stop_handler(before);
    return finish(r, plan, config, writes_run_dir);
  });
}

}  // namespace ds::cli
