// ds — what every subcommand shares: colour decisions, printing errors and warnings the same way,
// turning exceptions into exit codes, and the config-taking arguments (config file, overrides,
// topology flags) with the one function that turns them into a Plan.
#pragma once

#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "common/error.hpp"
#include "engine/plan/plan.hpp"
#include "engine/plan/plan_record.hpp"
#include "engine/plan/topology.hpp"
#include "cli/launcher.hpp"

namespace ds::cli {

// --color=auto|always|never, applied to stdout and stderr separately. auto: a terminal, NO_COLOR
// unset or empty, TERM not "dumb".
void set_color_mode(const std::string& mode);

// The arguments ds was started with (argv[1..]), for commands that start copies of themselves.
void set_command_line(int argc, char** argv);
const std::vector<std::string>& command_line();
bool color_enabled(FILE* stream);
std::string bold(const std::string& s, FILE* stream);
std::string red(const std::string& s, FILE* stream);
std::string yellow(const std::string& s, FILE* stream);

// `ds <sub>: warning: <path>: <message>` lines on stderr.
void print_warnings(const std::string& sub, const std::vector<ConfigIssue>& warnings);

// Runs `body`, mapping exceptions to exit codes: UserError -> its code (2), ConfigError -> 2 with
// every problem listed, anything else -> 1. Prints `ds <sub>: error: ...` to stderr, and with
// `json_errors` (a --json run) also a JSON error object on stdout for scripts.
int run_guarded(const std::string& sub, const std::function<int()>& body, bool json_errors = false);

// A size flag's value in bytes ("80GiB"); UserError naming the flag for a bare number or a non-size.
double size_flag(const std::string& flag, const std::string& text);

// Arguments of every subcommand that reads a config.
// The hardware the step's time is predicted for (engine/plan/hardware.hpp): a GPU model, the links, the MFU.
struct HardwareArgs {
  std::string gpu, intra_node_link, inter_node_link, host_link, host_memory_bw, nvme_bw;
  double mfu = 0;
};
// --gpu, --intra-node-link, --inter-node-link, --mfu and the offload rates (--host-link, --host-memory-bw,
// --nvme-bw) (ds plan, train, profile and estimate-memory alike).
void add_hardware_flags(CLI::App* sub, HardwareArgs& a);
void apply_hardware_flags(const HardwareArgs& a, TopologyOptions& topt);

struct ConfigArgs {
  std::string config;
  std::string deepspeed_config;  // --deepspeed_config: DeepSpeed's spelling of CONFIG
  std::vector<std::string> overrides;
  int world_size = 0;
  int nproc_per_node = 0;
  std::string nproc_source;  // what set nproc_per_node when not --nproc-per-node (the visible GPUs)
  int nnodes = 0;
  std::string device_memory;  // e.g. "80GiB"
  std::string host_memory;    // per node, e.g. "1TiB" (default: this machine's, when it is the one planned for)
  double headroom = kDefaultHeadroom;
  std::string device = "auto";
  HardwareArgs hardware;
  bool model_optional = false;     // ds plan: a config without a model block plans what it can
  bool inputs_must_exist = false;  // ds train: a missing data file is an error, not a warning
  // ds train / ds profile: the plan runs on this machine with this build, so --device auto means what the
  // build can use (the CPU in a build without CUDA), not what the machine has.
  bool runs_here = false;
  // ds train: the run continues a checkpoint (train.resume): found and read here, its batch and schedule
  // kept by the compiler where the config leaves them open.
  bool resumes = false;
  // ds profile: each step's work measured within it (Config::steps_measured_alone).
  bool steps_measured_alone = false;
  // Warnings about values the command itself chose, not the user (ds profile's train.steps makes the
  // scheduler's total_num_steps whatever it is): by JSON path, never printed.
  std::vector<std::string> own_choices;
};

// The config named once: as CONFIG, or as DeepSpeed's --deepspeed_config (then a word taken for CONFIG is
// the first override). UserError when there is none, or two.
ConfigArgs with_config_path(ConfigArgs a);

// One spelling of each topology flag across subcommands, with the others as aliases.
void add_ranks_per_node_flag(CLI::App* sub, int& value, const std::string& help);
void add_nodes_flag(CLI::App* sub, int& value);
// The flag of `app` nearest to a mistyped `word` ("--nproc-per-nod" -> "--nproc-per-node"), "" if none is near.
std::string flag_suggestion(const CLI::App* app, const std::string& word);

// Declares CONFIG [OVERRIDES...] and --world-size / --nproc-per-node / --nnodes / --device /
// --device-memory.
void add_config_args(CLI::App* sub, ConfigArgs& args);

// Load, validate and compile. Throws UserError / ConfigError. Warnings are printed.
struct CompiledConfig {
  Config config;
  Plan plan;
  std::string resolved_json;  // the config with defaults filled, and what a resume kept (the run directory's config.json)
  std::string resume_from;    // the checkpoint the run continues ("" none; ConfigArgs::resumes)
  std::optional<PlanRecord> checkpoint_plan;  // its plan.json
  std::exception_ptr resume_error;            // why it could not be found or read (check_resumed throws it)
};
// The resume settled with the plan, refused where it cannot go on: a checkpoint not found or unreadable, of
// another model (its tensors' shapes), or whose global batch no whole accumulation keeps. After the config's
// own errors and the fit check, before the run directory is touched.
void check_resumed(const CompiledConfig& compiled);
// Prints the plan's warnings unless `quiet` (a launcher whose rank 0 will print them itself).
// What each "auto" the user wrote chose, as "key=value (rule)". The "auto"s only Hugging Face's Trainer can
// fill (the learning rate, weight decay, betas, eps, warmup steps, fp16/bf16, clipping) go to `trainer_only`
// instead, each naming what to write: compile_config refuses them before a run (a warning while planning).
std::vector<std::string> auto_choices(const Config& config, const Plan& plan, std::vector<ConfigIssue>* trainer_only);

CompiledConfig compile_config(const std::string& sub, const ConfigArgs& args, bool quiet = false);
// The config resolved as a run stores it (defaults filled, model.init_from's architecture taken), for
// `ds plan --resolved-config`.
std::string resolved_config(const ConfigArgs& args);
inline Plan build_plan(const std::string& sub, const ConfigArgs& args) { return compile_config(sub, args).plan; }

// One subcommand: its CLI11 node and the function that runs it once parsed.
struct Subcommand {
  CLI::App* app = nullptr;
  std::function<int()> run;
};

// --nproc-per-node N or --hostfile F on a command that trains (ds train, ds profile): the hostfile's hosts,
// whose slots become args.world_size, and whether this process only starts the ranks (it is not itself
// a launched rank). UserError when both flags are given.
struct RankLaunch {
  std::vector<LaunchHost> hosts;
  bool launcher = false;
};
RankLaunch rank_launch(const std::string& hostfile, ConfigArgs& args);
// On a machine with several GPUs that the plan is for, when nothing says how many ranks (no --nproc-per-node,
// --world-size, --nnodes, --hostfile, launcher environment): one per visible GPU unless default_ranks_for_gpus
// (topology.hpp) keeps fewer; sets args.nproc_per_node and says why on stderr. The same rule for ds plan, ds train
// and ds profile (`profiling`), before rank_launch.
void default_ranks_to_visible_gpus(const std::string& sub, ConfigArgs& args, const std::string& hostfile, bool profiling = false);
// What the launcher starts: this command's words without the launcher's flags, on the hosts or
// --nproc-per-node local ranks, ranks other than 0 logging under `log_dir`, a failed rank's peers given
// the communication timeout (+5 s) to exit.
LaunchSpec rank_launch_spec(const RankLaunch& launch, const ConfigArgs& args, const std::string& log_dir, double comm_timeout_s);

}  // namespace ds::cli
