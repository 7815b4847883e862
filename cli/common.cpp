#include "cli/common.hpp"

#include <unistd.h>

#include <cstdlib>
#include <iostream>

#include "common/format.hpp"
#include "engine/plan/model_spec.hpp"
#include "schema/loader.hpp"

namespace ds::cli {

namespace {
std::vector<std::string>& command_line_storage() {
  static std::vector<std::string> args;
  return args;
}
}  // namespace

void set_command_line(int argc, char** argv) { command_line_storage().assign(argv + 1, argv + argc); }
const std::vector<std::string>& command_line() { return command_line_storage(); }

namespace {

std::string g_color_mode = "auto";

}  // namespace

void set_color_mode(const std::string& mode) { g_color_mode = mode; }

bool color_enabled(FILE* stream) {
  if (g_color_mode == "always") return true;
  if (g_color_mode == "never") return false;
  const char* no_color = std::getenv("NO_COLOR");
  if (no_color && *no_color) return false;
  const char* term = std::getenv("TERM");
  if (term && std::string(term) == "dumb") return false;
  return isatty(fileno(stream)) != 0;
}

static std::string wrap(const std::string& s, const char* code, FILE* stream) {
  return color_enabled(stream) ? std::string("\033[") + code + "m" + s + "\033[0m" : s;
}
std::string bold(const std::string& s, FILE* stream) { return wrap(s, "1", stream); }
std::string red(const std::string& s, FILE* stream) { return wrap(s, "1;31", stream); }
std::string yellow(const std::string& s, FILE* stream) { return wrap(s, "1;33", stream); }

void print_warnings(const std::string& sub, const std::vector<ConfigIssue>& warnings) {
  for (const auto& w : warnings) {
    std::cerr << "ds " << sub << ": " << yellow("warning:", stderr) << " " << (w.path.empty() ? "" : w.path + ": ")
              << w.message << "\n";
    if (!w.hint.empty()) std::cerr << "    hint: " << w.hint << "\n";
  }
}

int run_guarded(const std::string& sub, const std::function<int()>& body) {
  const std::string prefix = "ds " + sub + ": " + red("error:", stderr) + " ";
  try {
    return body();
  } catch (const ConfigError& e) {
    std::cerr << prefix << e.what() << "\n";
    for (const auto& i : e.issues()) {
      std::cerr << "  " << (i.path.empty() ? "" : bold(i.path, stderr) + ": ") << i.message << "\n";
      if (!i.hint.empty()) std::cerr << "      hint: " << i.hint << "\n";
    }
    return e.exit_code();
  } catch (const UserError& e) {
    std::cerr << prefix << e.what() << "\n";
    if (!e.hint().empty()) std::cerr << "    hint: " << e.hint() << "\n";
    return e.exit_code();
  } catch (const std::exception& e) {
    std::cerr << prefix << e.what() << "\n";
    return kExitRuntime;
  }
}

void add_config_args(CLI::App* sub, ConfigArgs& a) {
  sub->add_option("config", a.config, "the training config (a DeepSpeed ds_config plus model/data/train blocks)")
      ->required();
  sub->add_option("overrides", a.overrides,
                  "key.sub=value sets any config key (value parsed as JSON, else a string); ~key.sub removes one");
  sub->add_option("--world-size", a.world_size, "data-parallel ranks to plan for (default: WORLD_SIZE, else 1)")
      ->check(CLI::Range(1, 1 << 20));
  sub->add_option("--nproc-per-node", a.nproc_per_node, "ranks per node")->check(CLI::Range(1, 1 << 16));
  sub->add_option("--nnodes", a.nnodes, "nodes")->check(CLI::Range(1, 1 << 16));
  sub->add_option("--device", a.device, "plan for cpu or cuda devices (auto: cuda when a GPU is found or "
                                        "--device-memory is given)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  sub->add_option("--device-memory", a.device_memory,
                  "memory of each rank's GPU, e.g. 80GiB (default: the detected GPU's); used for \"auto\" choices "
                  "and the fit check");
}

CompiledConfig compile_config(const std::string& sub, const ConfigArgs& a, bool quiet) {
  for (const auto& o : a.overrides)
    if (!looks_like_override(o))
      throw UserError("'" + o + "' is neither an override nor a flag",
                      "overrides look like zero_optimization.stage=3 or ~scheduler; flags start with --");
  TopologyOptions topt;
  topt.world_size = a.world_size;
  topt.nproc_per_node = a.nproc_per_node;
  topt.nnodes = a.nnodes;
  if (!a.device_memory.empty() &&
      (!parse_bytes(a.device_memory, &topt.device_memory_bytes) || topt.device_memory_bytes <= 0))
    throw UserError("--device-memory '" + a.device_memory + "' is not a size", "write e.g. 80GiB, 40GB or 24G");
  topt.device = a.device;
  if (a.device != "cpu") topt.gpus = detect_gpus();
  const Topology topo = make_topology(topt, [](const char* n) { return std::getenv(n); });
  const Config config = load_config_file(a.config, a.overrides);
  if (!config.model.given)
    throw ConfigError(a.config, {{"model", "the config has no model block",
                                  "add e.g. \"model\": {\"preset\": \"gpt2\"}, or the override model.preset=gpt2"}});
  const ModelSpec model = build_model_spec(resolve_model_hyper(config.model));
  Plan plan = compile_plan(config, model, topo);
  if (!quiet) print_warnings(sub, plan.warnings);
  return {config, std::move(plan)};
}

}  // namespace ds::cli
