#include "cli/common.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <optional>

#include <nlohmann/json.hpp>

#include "cli/run_policy.hpp"
#include "common/did_you_mean.hpp"
#include "common/format.hpp"
#include "common/strings.hpp"
#include "engine/plan/model_spec.hpp"
#include "engine/plan/fit.hpp"
#include "engine/plan/runnable.hpp"
#include "engine/runtime/data/token_source.hpp"
#include "engine/runtime/device/build_support.hpp"
#include "engine/runtime/io/checkpoint.hpp"
#include "engine/runtime/io/weights.hpp"
#include "schema/loader.hpp"
#include "schema/rope_scaling.hpp"

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

namespace {

// {"schema_version": 1, "error": "...", "errors": [{"path", "message", "hint"}]} on stdout, for --json callers.
void print_json_error(const std::string& what, const std::vector<ConfigIssue>& issues) {
  nlohmann::ordered_json j;
  j["schema_version"] = 1;
  j["error"] = what;
  j["errors"] = nlohmann::ordered_json::array();
  for (const auto& i : issues) j["errors"].push_back({{"path", i.path}, {"message", i.message}, {"hint", i.hint}});
  std::cout << j.dump(2) << "\n";
}

}  // namespace

int run_guarded(const std::string& sub, const std::function<int()>& body, bool json_errors) {
  const std::string prefix = "ds " + sub + ": " + red("error:", stderr) + " ";
  try {
    return body();
  } catch (const ConfigError& e) {
    std::cerr << prefix << e.what() << "\n";
    for (const auto& i : e.issues()) {
      std::cerr << "  " << (i.path.empty() ? "" : bold(i.path, stderr) + ": ") << i.message << "\n";
      if (!i.hint.empty()) std::cerr << "      hint: " << i.hint << "\n";
    }
    if (json_errors) print_json_error(e.what(), e.issues());
    return e.exit_code();
  } catch (const UserError& e) {
    std::cerr << prefix << e.what() << "\n";
    if (!e.hint().empty()) std::cerr << "    hint: " << e.hint() << "\n";
    if (json_errors) print_json_error(e.what(), {{"", e.what(), e.hint()}});
    return e.exit_code();
  } catch (const std::exception& e) {
    std::cerr << prefix << e.what() << "\n";
    if (json_errors) print_json_error(e.what(), {{"", e.what(), ""}});
    return kExitRuntime;
  }
}

double size_flag(const std::string& flag, const std::string& text) {
  double bytes = 0;
  if (parse_bytes(text, &bytes) && bytes > 0) {
    // Sizes ds works with are counted in 64-bit integers; more than an exbibyte is a typo, not a size.
    if (!(bytes <= 1152921504606846976.0))
      throw UserError(flag + " " + text + " is more than 1 EiB: no size ds can use", std::string("write e.g. 5GB or 2GiB (") + kSizeUnitsHelp + ")");
    return bytes;
  }
  char* end = nullptr;
  const double bare = std::strtod(text.c_str(), &end);
  if (end != text.c_str() && *end == '\0' && bare > 0)
    throw UserError(flag + " " + text + ": give a unit, e.g. " + text + "GiB", kSizeUnitsHelp);
  throw UserError(flag + " '" + text + "' is not a size", std::string("write e.g. 80GiB, 40GB or 24G (") + kSizeUnitsHelp + ")");
}

void add_ranks_per_node_flag(CLI::App* sub, int& value, const std::string& help) {
  sub->add_option("--nproc-per-node,--gpus,--num_gpus,--num-gpus", value,
                  help + " (torchrun's --nproc-per-node; --gpus and DeepSpeed's --num_gpus mean the same)")
      ->check(CLI::Range(1, 1 << 16));
}

void add_nodes_flag(CLI::App* sub, int& value) {
  sub->add_option("--nnodes,--nodes,--num_nodes,--num-nodes", value, "nodes (--nodes and DeepSpeed's --num_nodes mean the same)")
      ->check(CLI::Range(1, 1 << 16));
}

std::string flag_suggestion(const CLI::App* app, const std::string& word) {
  if (word.rfind("--", 0) != 0) return "";
  std::vector<std::string> names;
  for (const CLI::Option* o : app->get_options())
    for (const std::string& n : o->get_lnames()) names.push_back("--" + n);
  std::string spelled = word.substr(0, word.find('='));
  std::replace(spelled.begin(), spelled.end(), '_', '-');
  if (std::find(names.begin(), names.end(), spelled) != names.end()) return spelled;
  return closest_match(spelled, names);
}

void add_config_args(CLI::App* sub, ConfigArgs& a) {
  sub->add_option("config", a.config, "the training config (a DeepSpeed ds_config plus model/data/train blocks)");
  // What DeepSpeed's launcher and scripts pass: the config as a flag, and each process's local rank.
  sub->add_option("--deepspeed_config,--deepspeed-config", a.deepspeed_config, "the config, as DeepSpeed's scripts pass it (same as CONFIG)");
  sub->add_option_function<int>(
         "--local_rank,--local-rank",
         [](const int& r) {
           const char* env = std::getenv("LOCAL_RANK");
           if (env && std::to_string(r) != env)
             throw UserError("--local_rank " + std::to_string(r) + " disagrees with LOCAL_RANK=" + env, "pass one of them");
           setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
         },
         "the process's rank on its node, as DeepSpeed's launcher passes it (same as LOCAL_RANK)")
      ->check(CLI::Range(0, 1 << 16));
  sub->add_option("overrides", a.overrides,
                  "key.sub=value sets any config key (value parsed as JSON, else a string); ~key.sub removes one");
  sub->add_option("--world-size", a.world_size, "ranks to plan for, every rank of the mesh (data x tensor x pipeline; default: WORLD_SIZE, else 1)")
      ->check(CLI::Range(1, kMaxWorldSize));
  add_ranks_per_node_flag(sub, a.nproc_per_node, "ranks (GPUs, or CPU processes) per node (default: one per visible GPU on a "
                                                  "GPU run, fewer where that would change the run; else 1)");
  add_nodes_flag(sub, a.nnodes);
  sub->add_option("--device", a.device, "plan for cpu or cuda devices (auto: cuda when a GPU is found or "
                                        "--device-memory is given)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  sub->add_option("--device-memory", a.device_memory,
                  std::string("memory of each rank's GPU, e.g. 80GiB (default: the detected GPU's); used for \"auto\" choices "
                  "and the fit check; ") + kSizeUnitsHelp);
  sub->add_option("--host-memory,--cpu-memory", a.host_memory,
                  "host memory per node, e.g. 1TiB, for \"auto\" choices and the fit check (default: this machine's, unless "
                  "--device-memory plans for GPUs it does not have)");
  sub->add_option("--headroom", a.headroom,
                  "share of device and host memory left free when judging what fits (allocator slack, the CUDA context and "
                  "library workspaces are not counted), default 0.10, as ds estimate-memory");
  add_hardware_flags(sub, a.hardware);
}

void add_hardware_flags(CLI::App* sub, HardwareArgs& a) {
  sub->add_option("--gpu", a.gpu,
                  "plan for this GPU model: its memory (unless --device-memory), its peak rate and its node's link, for the "
                  "predicted step time (" + known_gpu_names() + "; default: the detected GPU's)");
  sub->add_option("--intra-node-link", a.intra_node_link,
                  "the link between the ranks of a node, by name (" + known_link_names() +
                      ") or bus bandwidth per GPU, e.g. 300GB/s (default: the GPU model's)");
  sub->add_option("--inter-node-link", a.inter_node_link,
                  "the network between nodes, per GPU, by name (ib-ndr, ib-hdr, eth-100g) or rate, e.g. 50GB/s or 400Gb/s "
                  "(a NIC's line rate, taken at 90%)");
  sub->add_option("--mfu", a.mfu, "the share of the peak matmul rate a step's FLOPs (recomputation included) run at, for the predicted step time (default " +
                                      format_double(kAssumedMfu) + ", what ds measured on one H200)")
      ->check(CLI::Range(0.01, 1.0));
  sub->add_option("--host-link", a.host_link,
                  "offload: a GPU's copies to and from its host's pinned memory, per direction, by name (" + known_host_link_names() +
                      ") or rate, e.g. 50GB/s (default: the GPU model's PCIe)");
  sub->add_option("--host-memory-bw", a.host_memory_bw,
                  "offload: the bytes a second a node's memory streams with all its cores, e.g. 200GB/s: the optimizer's step "
                  "on the host reads and writes its states at this rate, shared by the node's ranks (unknown unless given)");
  sub->add_option("--nvme-bw", a.nvme_bw,
                  "offload to NVMe: the bytes a second a node's drives under nvme_path read or write, e.g. 6GB/s, shared by "
                  "the node's ranks (unknown unless given)");
}

void apply_hardware_flags(const HardwareArgs& a, TopologyOptions& topt) {
  topt.gpu = a.gpu;
  topt.intra_node_link = a.intra_node_link;
  topt.inter_node_link = a.inter_node_link;
  topt.host_link = a.host_link;
  topt.host_memory_bw = a.host_memory_bw;
  topt.nvme_bw = a.nvme_bw;
  topt.mfu = a.mfu;
}

ConfigArgs with_config_path(ConfigArgs a) {
  if (a.deepspeed_config.empty()) {
    if (a.config.empty()) throw UserError("no config given", "ds <command> CONFIG [key=value ...] (or --deepspeed_config CONFIG)");
    return a;
  }
  if (!a.config.empty()) {
    if (!looks_like_override(a.config))
      throw UserError("the config is given twice: '" + a.config + "' and --deepspeed_config " + a.deepspeed_config, "give one of them");
    a.overrides.insert(a.overrides.begin(), a.config);
  }
  a.config = a.deepspeed_config;
  a.deepspeed_config.clear();
  return a;
}

namespace {

// "auto" as Hugging Face's Trainer writes it into a ds_config: it fills these from its TrainingArguments,
// which ds does not have, so guessing (DeepSpeed's lr default, 1e-3, is 20x a fine-tune's) would train another
// run than the one meant. Each is refused naming the key and what to write.
const std::map<std::string, std::string>& trainer_only_autos() {
  static const std::map<std::string, std::string> keys = {
      {"optimizer.params.lr", "the learning rate you mean (the Trainer's default is 5e-5)"},
      {"optimizer.params.weight_decay", "the decay you mean (the Trainer's default is 0.0)"},
      {"optimizer.params.betas", "[0.9, 0.999] (the Trainer's adam_beta1 and adam_beta2)"},
      {"optimizer.params.eps", "1e-8 (the Trainer's adam_epsilon)"},
      {"scheduler.params.warmup_num_steps", "the warmup you mean (the Trainer's warmup_steps, 0 by default)"},
      {"fp16.enabled", "true or false (the Trainer's --fp16)"},
      {"bf16.enabled", "true or false (the Trainer's --bf16)"},
      {"gradient_clipping", "1.0 (the Trainer's max_grad_norm) or 0 to turn clipping off"},
  };
  return keys;
}

}  // namespace

std::vector<std::string> auto_choices(const Config& config, const Plan& plan, std::vector<ConfigIssue>* trainer_only) {
  const auto written = [&](const std::string& path) {
    const auto it = config.value_source.find(path);
    return it != config.value_source.end() && (it->second == "file" || it->second == "override" || it->second.rfind("auto", 0) == 0);
  };
  std::vector<std::string> chose;
  const auto consider = [&](const std::string& path, const std::string& value, const std::string& rule) {
    if (const auto it = trainer_only_autos().find(path); it != trainer_only_autos().end()) {
      if (trainer_only)
        trainer_only->push_back({path,
                                 "is \"auto\", which Hugging Face's Trainer fills from its TrainingArguments; ds has no Trainer and does "
                                 "not guess (it would be " + value + ", " + rule + ")",
                                 "write the value: " + it->second});
    } else {
      chose.push_back(path + "=" + value + " (" + rule + ")");
    }
  };
  for (const auto& [path, value] : config.auto_defaults) consider(path, value, "the default");
  for (const ResolvedValue& r : plan.resolved)
    if (r.source.rfind("auto", 0) == 0 && written(r.path) && !config.auto_defaults.count(r.path)) consider(r.path, r.value, r.source);
  return chose;
}

namespace {
// A config.json's problems as the key the user gave names them: the loader reads a Hugging Face directory's
// config.json as model.hf_config, a key the user never set.
[[noreturn]] void rethrow_naming(const ConfigError& e, const std::string& key) {
  std::vector<ConfigIssue> issues = e.issues();
  for (ConfigIssue& i : issues)
    if (i.path == "model.hf_config" || i.path.empty()) i.path = key;
  throw ConfigError(e.source(), issues);
}

// The architecture of model.init_from's source: a ds checkpoint's (from its plan), a Hugging Face
// directory's (its config.json, read as model.hf_config would be); none for a lone safetensors file or a
// source that cannot be opened (the input check below reports that).
// `required`: the config names no architecture, so the source must give one: its problems (a path that
// does not exist, a config.json ds cannot train) are the config's errors, on model.init_from.
std::optional<ModelHyper> source_architecture(const std::string& init_from, bool required, const std::string& config_path) {
  std::unique_ptr<WeightSource> src;
  try {
    src = open_weights(init_from);
    if (src->kind() == WeightsKind::peft_adapter && required) open_adapter_base(*src);  // a base that is not there, named
  } catch (const UserError& e) {
    if (required) throw ConfigError(config_path, {{"model.init_from", e.what(), e.hint()}});
    return std::nullopt;
  }
  if (src->kind() == WeightsKind::peft_adapter)  // an adapter's model is its base's
    return src->base_path.empty() || src->base_path == init_from ? std::nullopt : source_architecture(src->base_path, required, config_path);
  if (src->kind() == WeightsKind::ds_checkpoint && src->has_model()) return src->model();
  // A DeepSpeed checkpoint records no model; Hugging Face's Trainer saves its config.json beside it.
  std::string hf = (std::filesystem::path(src->kind() == WeightsKind::deepspeed_checkpoint ? init_from : src->path()) / "config.json").string();
  if (src->kind() == WeightsKind::deepspeed_checkpoint && !std::filesystem::is_regular_file(hf)) {
    if (required)
      throw ConfigError(config_path, {{"model.init_from", "'" + init_from + "' is a DeepSpeed checkpoint, which does not record which model it holds",
                                       "set model.hf_config to the model's config.json (or model.preset)"}});
    return std::nullopt;
  }
  if (src->kind() != WeightsKind::hf_directory && src->kind() != WeightsKind::deepspeed_checkpoint) return std::nullopt;
  const nlohmann::json cfg{{"train_micro_batch_size_per_gpu", 1}, {"model", {{"hf_config", std::filesystem::absolute(hf).string()}}}};
  try {
    const Config c = load_config_text(cfg.dump(), hf);  // its errors name the file (unsupported keys included)
    return resolve_model_hyper(c.model);
  } catch (const ConfigError& e) {
    rethrow_naming(e, "model.init_from");
  }
}

// The architecture keys a source fixes, as overrides and as the resolved values to compare.
struct ArchitectureKey {
  const char* key;
  std::function<std::string(const ModelHyper&)> value;
  bool rotary_only = false;  // a key only the rotary families have (schema/arch.hpp)
};
const std::vector<ArchitectureKey>& architecture_keys() {
  static const std::vector<ArchitectureKey> keys = {
      {"arch", [](const ModelHyper& h) { return std::string(model_arch_name(h.arch)); }},
      {"vocab_size", [](const ModelHyper& h) { return std::to_string(h.vocab_size); }},
      {"hidden_size", [](const ModelHyper& h) { return std::to_string(h.hidden_size); }},
      {"num_layers", [](const ModelHyper& h) { return std::to_string(h.num_layers); }},
      {"num_heads", [](const ModelHyper& h) { return std::to_string(h.num_heads); }},
      {"num_kv_heads", [](const ModelHyper& h) { return std::to_string(h.num_kv_heads > 0 ? h.num_kv_heads : h.num_heads); }, true},
      {"intermediate_size", [](const ModelHyper& h) { return std::to_string(h.intermediate_size); }},
      {"max_position_embeddings", [](const ModelHyper& h) { return std::to_string(h.max_position_embeddings); }},
      {"tie_word_embeddings", [](const ModelHyper& h) { return std::string(h.tie_word_embeddings ? "true" : "false"); }},
      {"norm_eps", [](const ModelHyper& h) { return format_double(h.norm_eps); }},
      {"rope_theta", [](const ModelHyper& h) { return format_double(h.rope_theta); }, true},
      {"rope_scaling", [](const ModelHyper& h) { return rope_scaling_json(h.rope_scaling).dump(); }, true},
      {"head_dim", [](const ModelHyper& h) { return std::to_string(h.head_dim()); }, true},
      {"attention_bias", [](const ModelHyper& h) { return std::string(h.attention_bias ? "true" : "false"); }, true},
      {"mlp_bias", [](const ModelHyper& h) { return std::string(h.mlp_bias ? "true" : "false"); }, true},
      {"sliding_window", [](const ModelHyper& h) { return h.sliding_window > 0 ? std::to_string(h.sliding_window) : std::string("null"); }, true},
      {"attn_logit_softcapping", [](const ModelHyper& h) { return h.attn_softcap > 0 ? format_double(h.attn_softcap) : std::string("null"); }, true},
      {"final_logit_softcapping", [](const ModelHyper& h) { return h.final_softcap > 0 ? format_double(h.final_softcap) : std::string("null"); }, true},
      {"query_pre_attn_scalar", [](const ModelHyper& h) { return h.query_pre_attn_scalar > 0 ? format_double(h.query_pre_attn_scalar) : std::string("null"); }, true},
  };
  return keys;
}

bool rotary(const ModelHyper& h) { return h.traits().positions == Positions::rotary; }

// The machine planned for: flags over the launcher's environment; a run here uses what this build can.
Topology topology_of(const std::string& sub, const ConfigArgs& a, bool quiet) {
  TopologyOptions topt;
  topt.world_size = a.world_size;
  topt.nproc_per_node = a.nproc_per_node;
  topt.nproc_source = a.nproc_source;
  topt.nnodes = a.nnodes;
  if (!a.device_memory.empty()) topt.device_memory_bytes = size_flag("--device-memory", a.device_memory);
  if (!a.host_memory.empty()) topt.host_memory_bytes = size_flag("--host-memory", a.host_memory);
  topt.headroom = a.headroom;
  topt.device = a.device;
  apply_hardware_flags(a.hardware, topt);
  if (a.device != "cpu") topt.gpus = detect_gpus();
  topt.build = build_support();
  topt.runs_here = a.runs_here;
  Topology t = make_topology(topt, [](const char* n) { return std::getenv(n); });
  if (!t.device_note.empty() && !quiet) std::cerr << "ds " << sub << ": " << t.device_note << "\n";
  return t;
}

// model.init_from: the model is the source's. Asked by the loader (ModelSourceKeys) while the config loads:
// a config that names no architecture takes the source's (as keys, so the run's stored config says what it
// trained), and the source's special tokens unless the config sets them. `source` receives the source's
// architecture (none without init_from); `takes` whether the config took it.
ModelSourceKeys source_keys(const std::string& config_path, std::optional<ModelHyper>& source, bool& takes) {
  return [&source, &takes, config_path](const std::string& init_from, const nlohmann::json& model) {
    const auto given = [&](const char* key) {
      return model.contains(key) && !model[key].is_null() && !(model[key].is_string() && model[key].get<std::string>().empty());
    };
    takes = !given("preset") && !given("hf_config") && !given("arch");
    source = source_architecture(init_from, takes, config_path);
    nlohmann::json keys = nlohmann::json::object();
    if (!source) return keys;
    // A key's text as an override would have it: JSON where it reads as JSON, else a string (the arch's name).
    const auto value = [](const std::string& text) {
      nlohmann::json v = nlohmann::json::parse(text, nullptr, false);
      return v.is_discarded() ? nlohmann::json(text) : v;
    };
    if (takes)
      for (const ArchitectureKey& k : architecture_keys())
        if (!k.rotary_only || rotary(*source)) keys[k.key] = value(k.value(*source));
    // The special tokens go with the weights (an export writes them to config.json and generation_config.json).
    keys["bos_token_id"] = source->bos_token_id >= 0 ? nlohmann::json(source->bos_token_id) : nlohmann::json(nullptr);
    keys["eos_token_id"] = source->eos_token_id.empty() ? nlohmann::json(nullptr) : nlohmann::json(source->eos_token_id);
    return keys;
  };
}

// A config that names an architecture must agree with model.init_from's, key by key.
void check_agrees_with_source(const ModelHyper& hyper, const ModelHyper& source, const Config& config, const std::string& path) {
  std::vector<ConfigIssue> differ;
  for (const ArchitectureKey& k : architecture_keys()) {
    if (k.rotary_only && (!rotary(hyper) || !rotary(source))) continue;
    const std::string mine = k.value(hyper), theirs = k.value(source);
    if (mine != theirs)
      differ.push_back({"model." + std::string(k.key),
                        "the config gives " + mine + ", but model.init_from (" + config.model.init_from + ") was trained with " + theirs,
                        "a model that computes another function would start from weights made for this one: remove the "
                        "model keys (the source's architecture is then taken) or make them agree"});
    if (k.key == std::string("arch") && mine != theirs) break;  // the rest follows from the architecture
  }
  if (!differ.empty()) throw ConfigError(path, differ);
}

// The data files the config names: each must be there, and a file (or a directory of shards where allowed).
void check_data_files(const DataConfig& d, std::vector<ConfigIssue>& missing) {
  auto need = [&](const std::string& path, const char* key, bool shards = false) {
    std::error_code ec;
    if (path.empty()) return;
    if (!std::filesystem::exists(path, ec))
      missing.push_back({key, "'" + path + "' does not exist", "check the path (relative paths are from the working directory)"});
    else if (std::filesystem::is_directory(path, ec) && shards)
      try {
        data_files(path, key);  // a directory of shards: it must hold some
      } catch (const UserError& e) {
        missing.push_back({key, e.what(), e.hint()});
      }
    else if (std::filesystem::is_directory(path, ec))
      missing.push_back({key, "'" + path + "' is a directory, not a file", "name the file itself"});
    else if (!std::filesystem::is_regular_file(path, ec))  // a FIFO or a device would block or never end
      missing.push_back({key, "'" + path + "' is not a regular file (a FIFO, socket or device)", "name a file on disk"});
  };
  if (d.type != DataType::synthetic)
    need(d.path, "data.path", d.type == DataType::text || d.type == DataType::tokens || d.type == DataType::jsonl);
  need(d.val_path, "data.val_path", true);
  if (!d.val_path.empty() && !d.path.empty()) {  // a validation file read as training data too would score what was trained
    std::vector<std::string> train, held;
    try {
      train = data_files(d.path);
      held = data_files(d.val_path, "data.val_path");
    } catch (const UserError&) {  // said above
    }
    for (const std::string& h : held)
      for (const std::string& t : train) {
        std::error_code ec;
        if (std::filesystem::equivalent(h, t, ec))
          missing.push_back({"data.val_path", "'" + h + "' is also read as training data (data.path '" + d.path + "')",
                             "validate on samples the run does not train on: a file outside data.path"});
      }
  }
  if (d.tokenizer == "hf" && !d.tokenizer_path.empty()) {
    std::error_code ec;
    if (!std::filesystem::exists(d.tokenizer_path, ec))
      missing.push_back({"data.tokenizer_path", "'" + d.tokenizer_path + "' does not exist",
                         "point it at the model's directory or its tokenizer.json"});
  }
  if (d.type == DataType::text && d.tokenizer == "gpt2") {
    need(d.vocab_file, "data.vocab_file");
    need(d.merges_file, "data.merges_file");
  }
}

// Swap folders for NVMe offload (ds train checks more: writable, room for the files).
void check_swap_folders(const ResolvedZero& z, std::vector<ConfigIssue>& missing) {
  for (const auto& [offload, key] : {std::pair{&z.offload_optimizer, "zero_optimization.offload_optimizer.nvme_path"},
                                     {&z.offload_param, "zero_optimization.offload_param.nvme_path"}}) {
    if (offload->device != OffloadDevice::nvme) continue;
    std::error_code ec;
    if (offload->nvme_path.empty())
      missing.push_back({key, "NVMe offload needs a folder to swap to", "set it to a folder on a fast local drive"});
    else if (!std::filesystem::exists(offload->nvme_path, ec))
      missing.push_back({key, "'" + offload->nvme_path + "' does not exist",
                         "create it (mkdir -p " + offload->nvme_path + ") or point nvme_path at a folder on a fast local drive"});
    else if (!std::filesystem::is_directory(offload->nvme_path, ec))
      missing.push_back({key, "'" + offload->nvme_path + "' is not a directory", "point nvme_path at a folder"});
  }
}

// model.init_from's weights: there, a model to start from, matching the plan's tensors (headers only are read).
void check_initial_weights(const std::string& init_from, const Plan& plan, std::vector<ConfigIssue>& missing) {
  try {
    const std::unique_ptr<WeightSource> source = open_weights(init_from);
    if (source->kind() == WeightsKind::ds_checkpoint && source->frozen_part)
      throw UserError("model.init_from '" + init_from + "' is a run that trained " +
                          (source->lora ? "a LoRA adapter" : "some tensors over a frozen base") +
                          ": its checkpoints hold only what trained, not a model to start from",
                      "continue it with train.resume=" + init_from + "; or start from its result: ds convert-ckpt " + init_from +
                          " OUT --merge (the whole model)" +
                          (source->lora ? std::string(" or --adapter (the adapter, which model.init_from takes with model.lora)") : ""));
    if (source->kind() != WeightsKind::peft_adapter) {
      match_weights(*source, plan.model);
    } else if (!plan.lora.enabled) {
      throw UserError("model.init_from '" + init_from + "' is a LoRA adapter, and this config trains no adapter",
                      "set model.lora as its adapter_config.json says (r " + std::to_string(source->lora->r) + ", alpha " +
                          format_double(source->lora->alpha) + ", target_modules " + join(source->lora->target_modules, ", ") + ")");
    } else {
      check_peft_adapter(*source, plan.lora);
      match_weights(*open_adapter_base(*source), plan.model);
    }
  } catch (const UserError& e) {
    missing.push_back({"model.init_from", e.what(), e.hint()});
  }
}

}  // namespace

void check_resumed(const CompiledConfig& compiled) {
  if (compiled.resume_error) std::rethrow_exception(compiled.resume_error);
  if (!compiled.checkpoint_plan) return;
  // A checkpoint of another model is refused first; then a global batch no whole accumulation keeps.
  check_resume_shapes(compiled.resume_from, *compiled.checkpoint_plan, compiled.plan);
  const KeptFromCheckpoint& kept = compiled.plan.kept;
  if (!kept.refusal.empty()) throw UserError(kept.refusal, kept.refusal_hint);
}

// The resolved config with what a resumed run kept of its checkpoint written in, as if given: the run's
// stored config says what it trains with, and the next resume compares against it.
std::string with_kept_values(const std::string& resolved_json, const KeptFromCheckpoint& kept) {
  if (kept.values.empty()) return resolved_json;
  nlohmann::json j = nlohmann::json::parse(resolved_json);
  for (const auto& [path, value] : kept.values) {
    std::string pointer = "/" + path;
    std::replace(pointer.begin(), pointer.end(), '.', '/');
    j[nlohmann::json::json_pointer(pointer)] = value;
  }
  return j.dump(2);
}

std::string resolved_config(const ConfigArgs& a) {
  std::optional<ModelHyper> source;
  bool takes_architecture = false;
  return resolved_config_json(a.config, a.overrides, 2, source_keys(a.config, source, takes_architecture));
}

CompiledConfig compile_config(const std::string& sub, const ConfigArgs& given, bool quiet) {
  const ConfigArgs a = with_config_path(given);
  for (const auto& o : a.overrides)
    if (!looks_like_override(o))
      throw UserError("'" + o + "' is neither an override nor a flag",
                      "overrides look like zero_optimization.stage=3 or ~scheduler; flags start with --");
  const Topology topo = topology_of(sub, a, quiet);
  std::optional<ModelHyper> source;
  bool takes_architecture = false;
  LoadedConfig loaded = load_config_file_with_json(a.config, a.overrides, source_keys(a.config, source, takes_architecture));
  if (source && takes_architecture && !quiet)
    std::cerr << "ds " << sub << ": the model is model.init_from's: " << model_arch_name(source->arch) << ", " << source->num_layers
              << " layers x " << source->hidden_size << " wide, vocab " << source->vocab_size << "\n";
  // train.epochs counts steps from the data's size: read here (the plan itself reads no files).
  if (loaded.config.train.epochs && loaded.config.model.given) {
    try {
      DataConfig& data = loaded.config.data;
      if (data.type == DataType::jsonl && data.packing) {
        data.measured_sample_tokens = measure_sample_tokens(data);
        data.measured_samples = static_cast<int64_t>(data.measured_sample_tokens.size());
      } else if (data.type == DataType::jsonl) {
        data.measured_samples = measure_samples(data);
      }
      else data.measured_tokens = measure_tokens(data);
    } catch (const UserError& e) {
      throw ConfigError(a.config, {{"train.epochs", std::string("needs the data's size: ") + e.what(), e.hint()}});
    }
  }
  loaded.config.steps_measured_alone = a.steps_measured_alone;
  const Config& config = loaded.config;
  // The checkpoint a run continues is settled before the plan: the compiler keeps its batch and schedule.
  std::string resume_from;
  std::optional<PlanRecord> checkpoint_plan;
  std::optional<ResumedFrom> resumed;
  // A checkpoint that cannot be found or read is reported after the config's own errors (check_resumed).
  std::exception_ptr resume_error;
  if (a.resumes && config.model.given) {
    try {
      resume_from = resume_checkpoint(config.train.resume, config.train.output_dir);
      if (!resume_from.empty()) checkpoint_plan = read_checkpoint_plan(resume_from);
    } catch (const std::exception&) {
      resume_error = std::current_exception();
      resume_from.clear();
      checkpoint_plan.reset();
    }
    if (checkpoint_plan) {
      const PlanRecord& r = *checkpoint_plan;
      resumed = ResumedFrom{r.train_batch_size, r.world_size, r.steps, r.scheduler, r.total_num_steps, r.warmup_num_steps};
    }
  }
  Plan plan;
  if (config.model.given) {
    const ModelHyper hyper = resolve_model_hyper(config.model);
    if (source) check_agrees_with_source(hyper, *source, config, a.config);
    plan = compile_plan(config, build_model_spec(hyper), topo, resumed ? &*resumed : nullptr);
  } else {
    plan = compile_plan_without_model(config, topo);  // the config's own problems first, then the missing model
    if (!a.model_optional)
      throw ConfigError(a.config, {{"model", "the config has no model block: ds " + sub + " needs to know what to train",
                                    "add e.g. \"model\": {\"preset\": \"gpt2\"} to the file, or the override model.preset=gpt2 "
                                    "(presets: ds-config(5); a Hugging Face config.json: model.hf_config=path)"}});
  }
  // Input files: a warning while planning (the plan may be made on another machine), an error before a run.
  std::vector<ConfigIssue> missing;
  check_data_files(config.data, missing);
  check_swap_folders(plan.zero, missing);
  if (!config.model.init_from.empty() && plan.has_model) check_initial_weights(config.model.init_from, plan, missing);
  // "auto"s only a Python trainer can fill: refused before a run, a warning while planning.
  std::vector<ConfigIssue> trainer_only;
  auto_choices(config, plan, &trainer_only);
  if (!trainer_only.empty() && a.runs_here) throw ConfigError(a.config, trainer_only);
  plan.warnings.insert(plan.warnings.end(), trainer_only.begin(), trainer_only.end());
  if (!missing.empty() && a.inputs_must_exist) throw ConfigError(a.config, missing);
  plan.warnings.insert(plan.warnings.end(), missing.begin(), missing.end());
  std::vector<ConfigIssue> shown;
  for (const ConfigIssue& w : plan.warnings)
    if (std::find(a.own_choices.begin(), a.own_choices.end(), w.path) == a.own_choices.end()) shown.push_back(w);
  if (!quiet) print_warnings(sub, shown);
  std::string resolved = with_kept_values(loaded.resolved_json, plan.kept);
  return {std::move(loaded.config), std::move(plan), std::move(resolved), std::move(resume_from), std::move(checkpoint_plan), resume_error};
}

RankLaunch rank_launch(const std::string& hostfile, ConfigArgs& args) {
  RankLaunch l;
  const bool rank_process = started_as_rank();
  if (!hostfile.empty() && !rank_process) {
    if (args.nproc_per_node > 0) throw UserError("--hostfile and --nproc-per-node both given", "the hostfile's slots say how many ranks each host runs");
    l.hosts = read_hostfile(hostfile);
    args.world_size = 0;
    for (const auto& h : l.hosts) args.world_size += h.slots;
  }
  l.launcher = (args.nproc_per_node > 1 || !l.hosts.empty()) && !rank_process;
  return l;
}

void default_ranks_to_visible_gpus(const std::string& sub, ConfigArgs& args, const std::string& hostfile, bool profiling) {
  // (LOCAL_RANK: a process told which GPU is its, by --local_rank or a launcher of its own)
  if (!hostfile.empty() || args.nproc_per_node > 0 || args.world_size > 0 || args.nnodes > 0 || started_as_rank() ||
      std::getenv("WORLD_SIZE") || std::getenv("LOCAL_RANK") || std::getenv("LOCAL_WORLD_SIZE") || args.device == "cpu")
    return;
  // Planning for other GPUs (their memory or model named) is not planning for these.
  if (!args.device_memory.empty() || (!args.runs_here && !args.hardware.gpu.empty())) return;
  const int visible = static_cast<int>(detect_gpus().size());
  if (visible < 2 || topology_of(sub, args, /*quiet=*/true).device_traits().memory_is_host) return;  // (not a GPU run)
  std::optional<int> checkpoint_world;
  bool failed = false;  // the compiler refused the config (not the plan's device)
  std::map<int, std::string> batch_of;  // ranks -> "global batch 64 = micro 16 x accumulation 1 x 4 ranks"
  const auto refusals = [&](int n) -> std::vector<std::string> {
    ConfigArgs trial = args;
    trial.nproc_per_node = n > 1 ? n : 0;
    trial.resumes = true;  // the checkpoint ds train would continue keeps its ranks, in ds plan's answer too
    failed = true;
    try {
      const CompiledConfig c = compile_config(sub, trial, /*quiet=*/true);
      if (c.checkpoint_plan) checkpoint_world = c.checkpoint_plan->world_size;
      failed = false;
      const ResolvedBatch& b = c.plan.batch;
      batch_of[n] = "global batch " + std::to_string(b.train_batch_size) + " = micro " + std::to_string(b.micro_batch) +
                    " x accumulation " + std::to_string(b.grad_accum) + " x " + std::to_string(b.world_size) + " ranks";
      std::vector<std::string> why = not_yet_runnable(c.plan, profiling);
      // More ranks on a node may need more of its host memory than one: the fit check ds train makes. (Said without
      // figures, which differ with the ranks: a plan that fits on neither is the same refusal, said by the compile after.)
      const FitCheck fit = check_fit(c.plan, c.plan.topology.headroom);
      if (fit.host == Fit::does_not_fit) why.push_back("it does not fit in this machine's host memory");
      if (fit.device == Fit::does_not_fit) why.push_back("it does not fit in a GPU's memory");
      return why;
    } catch (const ConfigError& e) {
      std::vector<std::string> why;
      for (const ConfigIssue& i : e.issues()) why.push_back(i.path.empty() ? i.message : i.path + ": " + i.message);
      return why;
    } catch (const std::exception& e) {
      return {e.what()};
    }
  };
  const std::vector<std::string> one = refusals(1);  // and the checkpoint being continued, if any
  if (failed) return;  // a config that fails on one rank: the compile that follows says why, as without GPUs
  const DefaultRanks chosen =
      default_ranks_for_gpus(visible, checkpoint_world, [&](int n) { return n == 1 ? one : refusals(n); });
  std::cerr << "ds " << sub << ": " << chosen.note << (chosen.ranks > 1 ? "; " + batch_of[chosen.ranks] : std::string()) << "\n";
  if (chosen.ranks > 1) {
    args.nproc_per_node = chosen.ranks;
    args.nproc_source = "one rank per visible GPU";
  }
}

LaunchSpec rank_launch_spec(const RankLaunch& launch, const ConfigArgs& args, const std::string& log_dir, double comm_timeout_s) {
  LaunchSpec spec;
  spec.nproc = args.nproc_per_node;
  spec.hosts = launch.hosts;
  spec.args = rank_arguments(command_line());
  // The words the user typed, for the ranks' "continue with:" hint (theirs lack --nproc-per-node and the like).
  std::string words;
  for (const auto& w : command_line()) words += (words.empty() ? "" : "\x1f") + w;
  setenv("DS_LAUNCH_COMMAND", words.c_str(), 1);
  spec.log_dir = log_dir;
  spec.grace = std::chrono::seconds(static_cast<int64_t>(comm_timeout_s) + 5);
  return spec;
}

}  // namespace ds::cli
