#include "cli/train.hpp"

#include <unistd.h>

#include <cstdlib>
#include <iostream>

#include "common/format.hpp"
#include "engine/runtime/checkpoint.hpp"
#include "engine/runtime/data/token_source.hpp"
#include "engine/runtime/launcher.hpp"
#include "engine/runtime/trainer.hpp"
#include "schema/json_diff.hpp"
#include "schema/loader.hpp"
#include "schema/plan_json.hpp"

namespace ds::cli {

Subcommand setup_train(CLI::App& app) {
  auto args = std::make_shared<TrainArgs>();
  CLI::App* sub = app.add_subcommand("train", "train a model as the config and its plan say");
  add_config_args(sub, args->config);
  sub->add_flag("--resume", args->resume,
                "continue from the newest complete checkpoint in train.output_dir (train.resume=auto); "
                "starts fresh when there is none");
  sub->add_option("--hostfile", args->hostfile,
                  "start ranks on these hosts over ssh: DeepSpeed's 'hostname slots=N' lines (DS_SSH replaces ssh)");
  sub->add_option("--master-addr", args->master_addr, "where the ranks rendezvous (default: the hostfile's first host)");
  sub->add_option("--master-port", args->master_port, "the rendezvous port (default: a free one on this machine, else 29500)")
      ->check(CLI::Range(1, 65535));
  sub->footer(R"(Examples:
  ds train examples/quickstart.json
      a tiny GPT-2 on an embedded synthetic language: the loss falls towards its known floor in a minute
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
at any ZeRO stage; a checkpoint resumes at any world size. Offload is refused before work starts, with
the reason (exit 2). See ds-train(1).)");
  return {sub, [args] { return run_train(*args); }};
}

int run_train(const TrainArgs& a) {
  return run_guarded("train", [&]() -> int {
    ConfigArgs args = a.config;
    if (a.resume) args.overrides.push_back("train.resume=auto");
    // --nproc-per-node N or --hostfile: this process only starts the ranks (the config is checked for
    // that world size first).
    std::vector<LaunchHost> hosts;
    if (!a.hostfile.empty() && !std::getenv("RANK")) {
      if (args.nproc_per_node > 0) throw UserError("--hostfile and --nproc-per-node both given", "the hostfile's slots say how many ranks each host runs");
      hosts = read_hostfile(a.hostfile);
      args.world_size = 0;
      for (const auto& h : hosts) args.world_size += h.slots;
    }
    const bool launcher = (args.nproc_per_node > 1 || !hosts.empty()) && !std::getenv("RANK");
    const CompiledConfig compiled = compile_config("train", args, /*quiet=*/launcher);  // rank 0 prints them
    const Plan& plan = compiled.plan;
    const Config& config = compiled.config;
    if (launcher) {
      LaunchSpec spec;
      spec.nproc = args.nproc_per_node;
      spec.hosts = hosts;
      spec.master_addr = a.master_addr;
      spec.master_port = a.master_port;
      const auto& all = command_line();
      for (size_t i = 0; i < all.size(); ++i) {
        bool launcher_only = false;
        for (const char* flag : {"--nproc-per-node", "--hostfile", "--master-addr", "--master-port"}) {
          if (all[i] == flag) {
            ++i;
            launcher_only = true;
            break;
          }
          if (all[i].rfind(std::string(flag) + "=", 0) == 0) launcher_only = true;
        }
        if (!launcher_only) spec.args.push_back(all[i]);
      }
      spec.log_dir = config.train.output_dir + "/logs";
      spec.grace = std::chrono::seconds(static_cast<int64_t>(config.train.comm_timeout_s) + 5);
      const int world = plan.topology.world_size;
      std::cerr << "ds train: starting " << world << " ranks "
                << (hosts.empty() ? std::string("on this machine") : "on " + std::to_string(hosts.size()) + " hosts from " + a.hostfile)
                << (world == 2 ? "; rank 1 logs to " + spec.log_dir + "/rank_1.log\n"
                               : "; ranks 1-" + std::to_string(world - 1) + " log to " + spec.log_dir + "/rank_N.log\n");
      return launch_ranks(spec);
    }
    TrainOptions opt;
    // Where to resume from is settled before any work, so a bad path fails at once.
    if (config.train.resume == "auto") {
      opt.resume_from = find_latest_checkpoint(config.train.output_dir);
      if (opt.resume_from.empty())
        std::cerr << "ds train: no checkpoint in " << config.train.output_dir << "/checkpoints: starting fresh\n";
    } else if (config.train.resume != "false") {
      opt.resume_from = resolve_checkpoint_path(config.train.resume);
    }
    opt.resolved_config_json = resolved_config_json(args.config, args.overrides);
    if (!opt.resume_from.empty()) {
      std::vector<std::string> changed;
      for (const auto& p : json_differences(read_checkpoint_text(opt.resume_from, "config_json"), opt.resolved_config_json))
        if (p != "train.resume") changed.push_back(p);
      if (!changed.empty()) {
        std::string list;
        for (const auto& p : changed) list += (list.empty() ? "" : ", ") + p;
        print_warnings("train", {{"", "the config differs from the checkpoint's at: " + list,
                                  "intended for keys such as train.steps; other changes alter the run being continued"}});
      }
    }
    opt.plan_json = plan_to_json(plan);
    const char* term = std::getenv("TERM");
    opt.live_progress = isatty(STDERR_FILENO) && !(term && std::string(term) == "dumb");
    opt.print_every = config.steps_per_print.value_or(10);
    const TrainResult r = train(plan, config, opt);
    if (r.losses.empty()) return r.interrupted ? kExitInterrupted : kExitOk;
    const int64_t done = r.steps - r.first_step;
    std::cerr << "ds train: " << (r.interrupted ? "interrupted at step " : "done: ") << r.steps << " of " << plan.steps
              << " steps (" << done << " this run) in " << format_double(std::round(r.seconds * 10) / 10) << " s; loss " << format_double(std::round(r.losses.front() * 1e4) / 1e4)
              << " -> " << format_double(std::round(r.losses.back() * 1e4) / 1e4);
    if (!r.val_losses.empty()) std::cerr << " (validation " << format_double(std::round(r.val_losses.back() * 1e4) / 1e4) << ")";
    if (config.data.type == DataType::synthetic)
      std::cerr << "; the synthetic language's floor is " << format_double(std::round(markov_entropy_nats() * 1e4) / 1e4);
    if (r.skipped_steps) std::cerr << "; " << r.skipped_steps << " steps skipped";
    const double predicted = plan.memory.device.total() + plan.memory.host.total();
    const double grown = r.peak_rss_bytes - r.baseline_rss_bytes;
    std::cerr << "\nds train: peak resident memory " << format_bytes(r.peak_rss_bytes) << ": "
              << format_bytes(r.baseline_rss_bytes) << " of code and libraries + " << format_bytes(grown) << " for training, "
              << format_double(std::round(grown / predicted * 100) / 100) << "x the plan's " << format_bytes(predicted)
              << " (the plan leaves out allocator slack and library workspaces)"
              << "\n";
    const char* rank = std::getenv("RANK");
    if (!rank || std::string(rank) == "0") std::cerr << "ds train: metrics in " << r.metrics_path << "\n";  // rank 0 writes them
    if (r.interrupted && !r.last_checkpoint.empty())
      std::cerr << "ds train: continue with: ds train " << args.config << " --resume\n";
    return r.interrupted ? kExitInterrupted : kExitOk;
  });
}

}  // namespace ds::cli
