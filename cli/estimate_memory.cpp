#include "cli/estimate_memory.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <optional>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/format.hpp"
#include "common/strings.hpp"
#include "engine/plan/estimate.hpp"
#include "engine/plan/lora.hpp"
#include "schema/loader.hpp"

namespace ds::cli {
namespace {

using ojson = nlohmann::ordered_json;

std::string json_string(const std::string& s) { return ojson(s).dump(); }

// The base config every row starts from, and a note on how --model was read.
Config base_config(const EstimateMemoryArgs& a, std::string* model_note) {
  std::vector<std::string> overrides;
  std::string text;
  if (a.params > 0) {
    // A hypothetical model: only its size is known. gpt2-shaped placeholder, replaced below.
    text = R"({"model": {"preset": "gpt2-tiny"}})";
    *model_note = "a hypothetical model of " + format_count(static_cast<int64_t>(a.params)) + " parameters (largest layer " +
                  format_count(static_cast<int64_t>(a.largest_layer)) + "); activations are not counted without an architecture";
  } else if (ends_with(a.model, ".json")) {
    const std::string file = read_config_file(a.model);
    const auto keys = config_top_level_keys(file);
    if (std::find(keys.begin(), keys.end(), "model_type") != keys.end()) {
      text = R"({"model": {"hf_config": )" + json_string(a.model) + "}}";
      *model_note = "the Hugging Face config " + a.model;
    } else {
      text = file;
      *model_note = "the model block of " + a.model;
    }
  } else {
    std::string preset = a.model;
    const auto& names = model_preset_names();
    if (std::find(names.begin(), names.end(), preset) == names.end()) {
      std::string note;
      std::string sized = preset_for_size(a.model, &note);
      if (sized.empty()) model_preset(a.model);  // throws with a did-you-mean
      preset = sized;
      *model_note = note;
    }
    text = R"({"model": {"preset": )" + json_string(preset) + "}}";
  }
  const auto keys = config_top_level_keys(text);
  auto has = [&](const char* key) { return std::find(keys.begin(), keys.end(), key) != keys.end(); };
  // --micro-batch, else the config's own micro batch (when it gives one), else 1.
  if (a.micro_batch > 0 || !has("train_micro_batch_size_per_gpu"))
    overrides.push_back("train_micro_batch_size_per_gpu=" + std::to_string(a.micro_batch > 0 ? a.micro_batch : 1));
  const bool from_config = has("model") && model_note->rfind("the model block", 0) == 0;
  std::string dtype = a.dtype.empty() && !from_config ? "bf16" : a.dtype;
  if (!dtype.empty()) {
    overrides.push_back(std::string("bf16.enabled=") + (dtype == "bf16" ? "true" : "false"));
    overrides.push_back(std::string("fp16.enabled=") + (dtype == "fp16" ? "true" : "false"));
  }
  // A global batch given in the file would be checked against --gpus x --nodes; the micro batch and the
  // accumulation (a pipeline's micro-batches in flight) are kept.
  if (has("train_batch_size")) overrides.push_back("~train_batch_size");
  // Present offload blocks (device none) get the schema's defaults (buffer counts, pinning), which the
  // rows that switch offload on then use.
  for (const char* block : {"offload_optimizer", "offload_param"})
    overrides.push_back(std::string("zero_optimization.") + block + ".device=none");
  // What is estimated is memory: a profiler the config turns on is not what is being chosen (nor refused with it).
  overrides.push_back("flops_profiler.enabled=false");
  // --tp / --pp: the mesh (else the config's).
  if (a.tp > 0) overrides.push_back("tensor_parallel.autotp_size=" + std::to_string(a.tp));
  if (a.pp > 0) overrides.push_back("pipeline.stages=" + std::to_string(a.pp));
  Config c = load_config_text(text, a.model.empty() ? "--params" : a.model, overrides);
  if (!c.train_micro_batch_size_per_gpu) c.train_micro_batch_size_per_gpu = 1;
  // A pipeline without the config's accumulation runs as many micro-batches per step as it has stages: the fewest
  // that keep every stage busy.
  if (c.parallel.pipeline > 1 && !c.gradient_accumulation_steps) c.gradient_accumulation_steps = c.parallel.pipeline;
  return c;
}

ModelSpec hypothetical_spec(int64_t params, int64_t largest) {
  // Only sizes are known: the model as consecutive layers of the largest layer's size (the last one
  // holding the rest), each a unit that stage 3 gathers and reduces as ds does a transformer block.
  // No architecture, so no activations.
  ModelSpec s;
  s.hp.name = "hypothetical";
  s.hp.arch = ModelArch::llama;  // no learned positions to check the sequence against
  s.hp.num_heads = 1;
  int layer = 0;
  for (int64_t left = params; left > 0; left -= largest, ++layer) {
    TensorSpec t;
    t.name = "layers." + std::to_string(layer) + ".weight";
    t.numel = std::min(left, largest);
    t.shape = {t.numel};
    t.layer = layer;
    t.weight_decay = true;
    s.tensors.push_back(t);
  }
  s.num_params = params;  // hp.num_layers stays 0: no blocks whose activations could be counted
  s.largest_module_params = largest;
  s.largest_block_params = largest;
  return s;
}

std::string offload_text(const EstimateChoice& c) {
  auto d = [](OffloadDevice x) { return x == OffloadDevice::none ? std::string("-") : std::string(offload_device_name(x)); };
  return d(c.offload_param) + " / " + d(c.offload_optimizer);
}

std::string gib(double b) { return format_gib(b); }

}  // namespace

Subcommand setup_estimate_memory(CLI::App& app) {
  auto a = std::make_shared<EstimateMemoryArgs>();
  CLI::App* sub = app.add_subcommand("estimate-memory",
                                     "memory per GPU and per node for every ZeRO stage and offload choice, before any run");
  sub->add_option("--model", a->model,
                  "a preset (llama-2-7b, gpt2-xl, ...), a size (7b, 13b, 70b, 1.5b, 350m), a Hugging Face "
                  "config.json, or a ds config (its model block and settings)");
  const CLI::Validator positive_count(
      [](std::string& v) -> std::string {
        char* end = nullptr;
        const double d = std::strtod(v.c_str(), &end);
        if (end == v.c_str() || *end != '\0' || !std::isfinite(d)) return "'" + v + "' is not a number (e.g. 7e9)";
        if (d < 1) return "'" + v + "' is not a positive parameter count (e.g. 7e9)";
        return "";
      },
      "COUNT");
  auto* params = sub->add_option("--params", a->params, "a hypothetical model's total parameters (with --largest-layer)")
                     ->check(positive_count);
  sub->add_option("--largest-layer", a->largest_layer, "the hypothetical model's largest layer, in parameters")
      ->check(positive_count)
      ->needs(params);
  add_ranks_per_node_flag(sub, a->gpus, "GPUs per node (default 1)");
  add_nodes_flag(sub, a->nodes);
  sub->add_option("--gpu-memory", a->gpu_memory,
                  std::string("memory per GPU, e.g. 80GiB (default: the detected GPU's, else no fit check); ") + kSizeUnitsHelp);
  sub->add_option("--cpu-memory", a->cpu_memory, "host memory per node, e.g. 1TiB (default: no host fit check)");
  sub->add_option("--headroom", a->headroom,
                  "share of each GPU left free when judging what fits (allocator fragmentation, the CUDA context and "
                  "library workspaces are not counted), default 0.10")
      ->check(CLI::Range(0.0, 0.9));
  sub->add_option("--micro-batch", a->micro_batch, "samples per GPU per step (default: the config's, else 1)")
      ->check(CLI::PositiveNumber);
  sub->add_option("--seq-len", a->seq_len, "tokens per sample (default: the config's, else the context up to 2048)")
      ->check(CLI::PositiveNumber);
  sub->add_option("--dtype", a->dtype, "bf16 (default), fp16 or fp32")->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  sub->add_option("--activation-checkpointing", a->activation_checkpointing, "rows with it on, off, or both (default)")
      ->check(CLI::IsMember({"on", "off", "both"}));
  sub->add_option("--zero-stage", a->zero_stage, "only this ZeRO stage")->check(CLI::Range(0, 3));
  sub->add_option("--offload", a->offload, "only this optimizer offload: none, cpu or nvme")
      ->check(CLI::IsMember({"none", "cpu", "nvme"}));
  sub->add_option("--lora-r", a->lora_r,
                  "plan a LoRA fine-tune of this rank: the base frozen in the compute dtype, only the adapter trains (model.lora)")
      ->check(CLI::Range(1, 65536));
  sub->add_option("--lora-targets", a->lora_targets,
                  "with --lora-r: the projections that get an adapter, PEFT's names (q_proj,v_proj; default: every projection)")
      ->delimiter(',');
  sub->add_option("--tp", a->tp, "tensor-parallel size: each block's matrices split over this many GPUs of a node "
                                   "(tensor_parallel.autotp_size; rows are then the heaviest pipeline stage's GPU)")
      ->check(CLI::Range(1, 1 << 20));
  sub->add_option("--pp", a->pp, "pipeline stages: the blocks cut into this many stages, as many micro-batches per step unless "
                                   "a config gives gradient_accumulation_steps (pipeline.stages; ZeRO stages 0-1 only)")
      ->check(CLI::Range(1, 1 << 20));
  add_hardware_flags(sub, a->hardware);
  sub->add_flag("--json", a->json, "print the table as JSON (with schema_version)");
  sub->footer(R"(Examples:
  ds estimate-memory --model 7b --gpus 8
      every ZeRO stage and offload choice for Llama-2-7B on one node of 8 GPUs (the GPUs here, if any)
  ds estimate-memory --model llama-2-13b --gpus 8 --nodes 2 --gpu-memory 80GiB --cpu-memory 1TiB
      ... with fit checks and a recommendation: the fastest choice that fits
  ds estimate-memory --model path/to/config.json --gpus 4 --gpu-memory 24GiB --micro-batch 2 --seq-len 4096
      a Hugging Face config.json, or a ds config (its model block, precision and buckets)
  ds estimate-memory --params 2851e6 --largest-layer 32e6 --gpus 8
      a hypothetical model by size only (model states; activations need an architecture)
  ds estimate-memory --model gpt2-xl --zero-stage 3 --json | jq '.rows[0]'
  ds estimate-memory --model llama-2-7b --lora-r 16 --gpu-memory 24GiB
      can a 7B model be fine-tuned with LoRA (rank 16 on every projection) on one 24 GiB GPU
  ds estimate-memory --model llama-3-70b --gpus 8 --nodes 4 --gpu-memory 80GiB
      beside the ZeRO rows, the smallest tensor x pipeline mesh of these GPUs that fits
  ds estimate-memory --model llama-3-70b --gpus 8 --nodes 4 --tp 8 --pp 2 --gpu-memory 80GiB
      the rows for that mesh (each the heaviest stage's GPU)

Rows are what `ds plan` computes for each choice; DeepSpeed's estimate_zero2/zero3 numbers are shown
beside them for comparison (without a mesh). Exit status: 0 ok, 2 bad input.)");
  return {sub, [a] { return run_estimate_memory(*a); }};
}

namespace {

// The flags' own contradictions, before anything is read.
void check_flags(const EstimateMemoryArgs& a) {
  if (!(a.headroom >= 0 && a.headroom <= 0.9))  // NaN passes a range check: compared, it is neither in nor out
    throw UserError("--headroom " + format_double(a.headroom) + " is not a share from 0 to 0.9", "e.g. --headroom 0.1 leaves 10% of each GPU free");
  if (a.params > ModelLimits::params)
    throw UserError("--params " + format_double(a.params) + " is more than ds plans for (" + format_double(ModelLimits::params) + ")",
                    "give the parameter count, e.g. --params 7e9");
  if (a.params > 0 && (a.largest_layer <= 0 || a.largest_layer > a.params))
    throw UserError(a.largest_layer <= 0 ? "--params needs --largest-layer (the parameters of the biggest single layer)"
                                         : "--largest-layer " + format_double(a.largest_layer) + " is more than --params " + format_double(a.params),
                    "e.g. --params 7e9 --largest-layer 131e6 (a 7B Llama's largest layer is its 32000 x 4096 embedding)");
  if (a.params > 0 && a.params / a.largest_layer > ModelLimits::num_layers)
    throw UserError("--params / --largest-layer is " + format_double(std::ceil(a.params / a.largest_layer)) +
                        " layers, more than ds plans for (" + std::to_string(ModelLimits::num_layers) + ")",
                    "--largest-layer is the parameters of the biggest single layer, e.g. 131e6 for a 7B model");
  if (a.model.empty() && a.params == 0)
    throw UserError("no model given", "pass --model (llama-2-7b, 7b, a config.json) or --params N --largest-layer N");
  if (!a.model.empty() && a.params > 0) throw UserError("--model and --params are exclusive", "give one of them");
  if (a.params > 0 && (a.tp > 1 || a.pp > 1))
    throw UserError("--tp and --pp split an architecture's blocks, which --params does not give", "pass --model (a preset or a config.json)");
  if (a.params > 0 && (a.params != std::floor(a.params) || a.largest_layer != std::floor(a.largest_layer)))
    throw UserError("--params and --largest-layer count parameters: whole numbers", "e.g. --params 7e9 --largest-layer 131e6");
}

// The GPUs planned for: --gpus x --nodes, their memory given or detected; the host's only when given.
Topology target_topology(const EstimateMemoryArgs& a) {
  TopologyOptions topt;
  topt.nproc_per_node = a.gpus;
  topt.nnodes = a.nodes;
  topt.device = "cuda";
  if (!a.gpu_memory.empty()) topt.device_memory_bytes = size_flag("--gpu-memory", a.gpu_memory);
  apply_hardware_flags(a.hardware, topt);
  topt.gpus = detect_gpus();
  Topology topo = make_topology(topt, [](const char*) -> const char* { return nullptr; });
  topo.host_memory_bytes = 0;  // the target's host memory is unknown unless given
  if (!a.cpu_memory.empty()) topo.host_memory_bytes = size_flag("--cpu-memory", a.cpu_memory);
  return topo;
}

// --lora-r: the adapter planned over a frozen base (every projection unless --lora-targets names them).
LoraPlan plan_lora(const EstimateMemoryArgs& a, Config& base, const ModelSpec& model) {
  if (!a.lora_targets.empty() && a.lora_r == 0) throw UserError("--lora-targets needs --lora-r", "e.g. --lora-r 16 --lora-targets q_proj,v_proj");
  if (a.lora_r == 0) return {};
  if (a.params > 0) throw UserError("--lora-r needs an architecture, which --params does not give", "pass --model (a preset or a config.json)");
  LoraConfig& l = base.model.lora;
  l.enabled = true;
  l.r = a.lora_r;
  l.alpha = static_cast<double>(a.lora_r);
  l.target_modules = a.lora_targets.empty() ? lora_module_names(model.hp.arch) : a.lora_targets;
  std::vector<ConfigIssue> errors;
  LoraPlan lora = resolve_lora(l, model, errors);
  if (!errors.empty()) throw UserError("--lora-targets: " + errors[0].message, errors[0].hint);
  return lora;
}

EstimateFilter filter_of(const EstimateMemoryArgs& a) {
  EstimateFilter filter;
  if (a.zero_stage >= 0) filter.stage = a.zero_stage;
  if (!a.offload.empty())
    filter.offload = a.offload == "cpu" ? OffloadDevice::cpu : a.offload == "nvme" ? OffloadDevice::nvme : OffloadDevice::none;
  if (a.activation_checkpointing != "both") filter.activation_checkpointing = a.activation_checkpointing == "on";
  // A model known by size alone has no activations to count: checkpointing on and off would be the same
  // rows twice, so only the "off" rows are shown (the header says activations need an architecture).
  if (a.params > 0 && a.activation_checkpointing == "both") filter.activation_checkpointing = false;
  return filter;
}

// What every row was computed for.
struct EstimateInputs {
  const ModelSpec& model;
  const Config& base;
  const Topology& topo;
  const LoraPlan& lora;
  const std::string& model_note;
  std::string dtype;
  std::optional<MeshChoice> mesh;  // the smallest mesh of these GPUs that fits (recommend_mesh)
};

std::string mesh_choice_text(const MeshChoice& m, const Topology& topo) {
  return "tensor " + std::to_string(m.tensor) + " x pipeline " + std::to_string(m.pipeline) + " x data " +
         std::to_string(topo.world_size / (m.tensor * m.pipeline)) + ", ZeRO-1" + (m.activation_checkpointing ? ", activation checkpointing" : "");
}

void print_json(const EstimateMemoryArgs& a, const EstimateInputs& in, const MemoryEstimateTable& t) {
  const auto& [model, base, topo, lora, model_note, dtype, mesh] = in;
  ojson j;
  j["schema_version"] = 1;
  j["model"] = {{"name", model.hp.name}, {"num_params", model.num_params}, {"largest_layer_params", model.largest_module_params},
                {"note", model_note}};
  j["topology"] = {{"gpus_per_node", topo.ranks_per_node}, {"nodes", topo.num_nodes},
                   {"gpu_memory_bytes", static_cast<int64_t>(topo.device_memory_bytes)},
                   {"cpu_memory_per_node_bytes", static_cast<int64_t>(topo.host_memory_bytes)}};
  j["lora"] = lora.enabled ? ojson{{"r", lora.r}, {"target_modules", lora.target_modules}, {"trainable_params", lora.adapters.num_params},
                                   {"frozen_params", model.num_params}}
                           : ojson(nullptr);
  j["assumptions"] = {{"dtype", dtype}, {"micro_batch", *base.train_micro_batch_size_per_gpu}, {"seq_len", *base.data.seq_len},
                      {"headroom", a.headroom}, {"tensor_parallel", base.parallel.tensor}, {"pipeline_stages", base.parallel.pipeline},
                      {"micro_batches_per_step", base.gradient_accumulation_steps.value_or(1)}};
  ojson rows = ojson::array();
  for (const auto& r : t.rows) {
    const auto& d = r.memory.device;
    ojson row{{"zero_stage", r.choice.stage},
              {"offload_optimizer", offload_device_name(r.choice.offload_optimizer)},
              {"offload_param", offload_device_name(r.choice.offload_param)},
              {"activation_checkpointing", r.choice.activation_checkpointing},
              {"per_gpu", {{"params", std::llround(d.params)}, {"grads", std::llround(d.grads)},
                           {"optimizer_states", std::llround(d.optimizer_states)}, {"activations", std::llround(d.activations)},
                           {"buffers", std::llround(d.buffers)}, {"total", std::llround(d.total())}}},
              {"cpu_per_node", std::llround(r.host_per_node)},
              {"nvme_per_node", std::llround(r.nvme_per_node)},
              {"fits", r.fits_device ? ojson(r.fits()) : ojson(nullptr)},
              {"runs_today", r.not_yet.empty()},
              {"not_yet", r.not_yet},
              {"overrides", r.overrides},
              {"predicted_step_s", r.step_s > 0 ? ojson(r.step_s) : ojson(nullptr)},
              {"predicted_tokens_per_s", r.step_s > 0 ? ojson(r.tokens_per_s) : ojson(nullptr)}};
    rows.push_back(row);
  }
  j["rows"] = rows;
  j["recommended"] = t.recommended;
  j["runnable"] = t.runnable;
  ojson dsrows = ojson::array();
  for (const auto& r : t.deepspeed)
    dsrows.push_back({{"zero_stage", r.stage}, {"options", r.options}, {"cpu_per_node", std::llround(r.cpu_bytes)},
                      {"per_gpu", std::llround(r.gpu_bytes)}});
  j["deepspeed"] = dsrows;
  j["mesh_recommended"] = mesh ? ojson{{"tensor", mesh->tensor}, {"pipeline", mesh->pipeline},
                                       {"data", topo.world_size / (mesh->tensor * mesh->pipeline)}, {"zero_stage", 1},
                                       {"activation_checkpointing", mesh->activation_checkpointing},
                                       {"per_gpu", std::llround(mesh->device_per_rank)}, {"heaviest_stage", mesh->heaviest_stage},
                                       {"runs_today", mesh->not_yet.empty()}, {"not_yet", mesh->not_yet}, {"overrides", mesh->overrides},
                                       {"predicted_step_s", mesh->step_s > 0 ? ojson(mesh->step_s) : ojson(nullptr)},
                                       {"predicted_tokens_per_s", mesh->step_s > 0 ? ojson(mesh->tokens_per_s) : ojson(nullptr)}, {"chosen_as", mesh->fastest ? "fastest" : "fewest_gpus"}}
                               : ojson(nullptr);
  std::cout << j.dump(2) << "\n";
}

// The table's rows, and what this ds cannot train yet among them, once per reason.
void render_rows(const MemoryEstimateTable& t, std::ostringstream& o) {
  char line[512];
  std::snprintf(line, sizeof line, "  %-5s %-11s %-5s | %7s %7s %7s %7s %7s | %8s | %9s %9s | %s\n", "stage", "offload p/o",
                "ckpt", "params", "grads", "optim", "activ", "buffers", "per GPU", "CPU/node", "NVMe/node", "fits");
  o << line;
  for (size_t i = 0; i < t.rows.size(); ++i) {
    const auto& r = t.rows[i];
    const auto& d = r.memory.device;
    std::string fits = !r.fits_device ? "?" : r.fits() ? "yes" : "no";
    if (r.step_s > 0) fits += ", " + format_count(std::llround(r.tokens_per_s)) + " tokens/s";
    if (!r.not_yet.empty()) fits += ", not yet *";
    if (static_cast<int>(i) == t.recommended) fits += "  <- recommended";
    std::snprintf(line, sizeof line, "  %-5d %-11s %-5s | %7s %7s %7s %7s %7s | %8s | %9s %9s | %s\n", r.choice.stage,
                  offload_text(r.choice).c_str(), r.choice.activation_checkpointing ? "on" : "off", gib(d.params).c_str(),
                  gib(d.grads).c_str(), gib(d.optimizer_states).c_str(), gib(d.activations).c_str(), gib(d.buffers).c_str(),
                  gib(d.total()).c_str(), gib(r.host_per_node).c_str(), r.nvme_per_node > 0 ? gib(r.nvme_per_node).c_str() : "-",
                  fits.c_str());
    o << line;
  }
  const bool some_unpredicted = std::any_of(t.rows.begin(), t.rows.end(), [](const EstimateRow& r) { return !(r.step_s > 0); });
  if (std::any_of(t.rows.begin(), t.rows.end(), [](const EstimateRow& r) { return r.step_s > 0; }))
    o << "  (GiB; per GPU columns are one rank's device memory; rows fastest first by the tokens/s predicted over all GPUs from the\n"
         "  GPU's and the links' rates, as ds plan predicts a step"
      << (some_unpredicted ? "; the offload rows, not predicted without --host-memory-bw (and --nvme-bw), after them in expected order)\n"
                           : ")\n");
  else
    o << "  (GiB; per GPU columns are one rank's device memory; rows in expected speed order, fastest first)\n";
  // What this ds cannot train yet on these GPUs, once per reason.
  std::vector<std::string> reasons;
  for (const auto& r : t.rows)
    for (const std::string& why : r.not_yet)
      if (std::find(reasons.begin(), reasons.end(), why) == reasons.end()) reasons.push_back(why);
  for (size_t k = 0; k < reasons.size(); ++k) o << (k ? "    " : "  * not yet runnable by this ds: ") << reasons[k] << "\n";
  o << "\n";
}

void render_recommendation(const MemoryEstimateTable& t, const EstimateInputs& in, FILE* out, std::ostringstream& o) {
  const Topology& topo = in.topo;
  const auto choice_text = [](const EstimateRow& r) {
    return "ZeRO-" + std::to_string(r.choice.stage) +
           (r.choice.offload_optimizer != OffloadDevice::none ? std::string(", optimizer offload to ") + offload_device_name(r.choice.offload_optimizer) : "") +
           (r.choice.offload_param != OffloadDevice::none ? std::string(", parameter offload to ") + offload_device_name(r.choice.offload_param) : "") +
           (r.choice.activation_checkpointing ? ", activation checkpointing" : "");
  };
  if (t.recommended >= 0) {
    const auto& r = t.rows[t.recommended];
    o << bold("Recommended", out) << ": " << choice_text(r) << ": " << format_bytes(r.device_per_rank)
      << " per GPU (" << std::lround(100.0 * r.device_per_rank / topo.device_memory_bytes) << "% of "
      << format_bytes(topo.device_memory_bytes) << ")\n  select it with: ds plan CONFIG " << r.overrides << "\n";
    // Said with the recommendation, not only in the table: what this ds cannot train yet, and what it can.
    if (!r.not_yet.empty()) {
      o << "  not yet runnable by this ds: " << join(r.not_yet, "; ") << "\n";
      if (t.runnable >= 0)
        o << "  the fastest that fits and ds trains today: " << choice_text(t.rows[t.runnable]) << " (ds plan CONFIG "
          << t.rows[t.runnable].overrides << ")\n";
      else
        o << "  none of the rows that fit can ds train on " << (topo.world_size > 1 ? "these GPUs" : "a GPU") << " today\n";
    }
    o << "\n";
  } else if (topo.device_memory_bytes > 0) {
    o << bold("Nothing fits", out) << " " << format_bytes(topo.device_memory_bytes)
      << " per GPU: use more GPUs, a smaller micro batch or sequence, or more memory"
      << (in.mesh ? ", or split the model over the GPUs (below)." : ".") << "\n\n";
  } else {
    o << "Pass --gpu-memory (e.g. 80GiB) for a fit check and a recommendation.\n\n";
  }
}

// The smallest mesh that fits at ZeRO-1, beside the rows: what splitting the model costs in memory where data
// parallelism would gather every parameter across all GPUs (ZeRO-3) or offload.
void render_mesh(const MemoryEstimateTable& t, const EstimateInputs& in, FILE* out, std::ostringstream& o) {
  const Topology& topo = in.topo;
  if (!in.mesh) {
    if (t.recommended < 0 && topo.device_memory_bytes > 0 && topo.world_size > 1 && in.base.parallel.tensor == 1 &&
        in.base.parallel.pipeline == 1 && in.model.hp.num_layers > 0)
      o << "No tensor x pipeline mesh of these GPUs fits either.\n\n";
    return;
  }
  const MeshChoice& m = *in.mesh;
  o << bold("Split the model", out) << ": " << mesh_choice_text(m, topo) << ": " << format_bytes(m.device_per_rank)
    << " per GPU on stage " << m.heaviest_stage << ", the heaviest (" << std::lround(100.0 * m.device_per_rank / topo.device_memory_bytes)
    << "% of " << format_bytes(topo.device_memory_bytes) << ")\n"
    << (m.fastest ? "  the fastest predicted of the meshes that fit at ZeRO-1 (" + format_count(std::llround(m.tokens_per_s)) +
                        " tokens/s, a step of " + format_fixed(m.step_s, 2) + " s, as ds plan predicts it);"
                  : std::string("  the fewest GPUs per copy of the model that fit at ZeRO-1 (tensor groups within a node, then pipeline stages);"))
    << (t.recommended >= 0 ? " no parameter gathers across all GPUs, at the cost of the mesh's own traffic (ds plan shows it)" : "")
    << "\n  select it with: ds plan CONFIG " << m.overrides << "\n";
  if (!m.not_yet.empty()) o << "  not yet runnable by this ds: " << join(m.not_yet, "; ") << "\n";
  o << "\n";
}

void render_deepspeed(const MemoryEstimateTable& t, const LoraPlan& lora, FILE* out, std::ostringstream& o) {
  char line[512];
  o << bold("DeepSpeed's estimator", out)
    << " (estimate_zero2/zero3_model_states_mem_needs: model states only, CPU x1.5 buffer factor; GiB, which DeepSpeed prints as GB"
    << (lora.enabled ? "; it knows no LoRA: these rows train every weight" : "") << ")\n";
  o << "   per CPU  |  per GPU | options\n";
  for (const auto& r : t.deepspeed) {
    std::snprintf(line, sizeof line, "  %8s  | %8s | ZeRO-%d %s\n", gib(r.cpu_bytes).c_str(), gib(r.gpu_bytes).c_str(), r.stage,
                  r.options.c_str());
    o << line;
  }
  o << "\nCounted per GPU: parameters, gradients, fp32 master weights and optimizer moments, activations kept for "
       "backward, reduction and gather buffers (DeepSpeed's default bucket sizes unless the config sets them).\n"
       "Not counted: allocator fragmentation, the CUDA context (~0.5-1 GiB), library workspaces. CPU/node is the "
       "offloaded states and staging buffers of all ranks on a node; DeepSpeed's 1.5x factor is not applied.\n";
}

void print_text(const EstimateMemoryArgs& a, const EstimateInputs& in, const MemoryEstimateTable& t) {
  const auto& [model, base, topo, lora, model_note, dtype, mesh] = in;
  FILE* out = stdout;
  std::ostringstream o;
  o << bold("Memory to train " + model.hp.name, out) << " (" << format_count(model.num_params) << " parameters, largest layer "
    << format_count(model.largest_module_params) << ") on " << topo.num_nodes << (topo.num_nodes == 1 ? " node" : " nodes")
    << " x " << topo.ranks_per_node << (topo.ranks_per_node == 1 ? " GPU" : " GPUs") << "\n";
  if (!model_note.empty()) o << "  model: " << model_note << "\n";
  if (lora.enabled) {
    o << "  LoRA r " << lora.r << " on " << join(lora.target_modules, ", ") << ": " << format_count(lora.adapters.num_params) << " parameters train ("
      << format_fixed(100.0 * static_cast<double>(lora.adapters.num_params) / static_cast<double>(model.num_params), 3)
      << "% of the model); the base is frozen in " << dtype << " (params column: "
      << (base.parallel.tensor > 1 || base.parallel.pipeline > 1 ? "each GPU's share of the split model" : "whole on every GPU")
      << "; at stage 3 partitioned, a block gathered as it runs)\n";
  }
  o << "  " << dtype << ", micro batch " << *base.train_micro_batch_size_per_gpu
    << (a.params > 0 ? std::string(" (activations need an architecture)") : " x " + std::to_string(*base.data.seq_len) + " tokens")
    << ", " << optimizer_type_name(base.optimizer.type) << "; GPU memory "
    << (topo.device_memory_bytes > 0 ? format_bytes(topo.device_memory_bytes) : std::string("not given (no fit check)"))
    << "; CPU memory per node " << (topo.host_memory_bytes > 0 ? format_bytes(topo.host_memory_bytes) : std::string("not given"))
    << "\n";
  if (base.parallel.tensor > 1 || base.parallel.pipeline > 1)
    o << "  mesh: tensor " << base.parallel.tensor << " x pipeline " << base.parallel.pipeline << " x data "
      << topo.world_size / (base.parallel.tensor * base.parallel.pipeline) << "; each row is a GPU of the heaviest pipeline stage"
      << (base.parallel.pipeline > 1 ? ", " + std::to_string(base.gradient_accumulation_steps.value_or(base.parallel.pipeline)) +
                                         " micro-batches per step; a pipeline takes ZeRO stages 0-1"
                                     : std::string())
      << "\n";
  if (topo.device_memory_bytes > 0)
    o << "  fits = at most " << std::lround((1 - a.headroom) * 100) << "% of each GPU (" << format_bytes((1 - a.headroom) * topo.device_memory_bytes)
      << "): --headroom " << format_double(a.headroom) << " is left for what is not counted\n";
  o << "\n";
  render_rows(t, o);
  render_recommendation(t, in, out, o);
  render_mesh(t, in, out, o);
  if (!t.deepspeed.empty()) render_deepspeed(t, lora, out, o);
  std::cout << o.str();
}

}  // namespace

int run_estimate_memory(const EstimateMemoryArgs& a) {
  return run_guarded("estimate-memory", [&] {
    check_flags(a);
    const Topology topo = target_topology(a);
    std::string model_note;
    Config base = base_config(a, &model_note);
    const ModelSpec model = a.params > 0 ? hypothetical_spec(static_cast<int64_t>(a.params), static_cast<int64_t>(a.largest_layer))
                                         : build_model_spec(resolve_model_hyper(base.model));
    const LoraPlan lora = plan_lora(a, base, model);
    if (a.seq_len > 0) {
      base.data.seq_len = a.seq_len;
    } else if (!base.data.seq_len || a.params > 0) {
      base.data.seq_len = std::max<int64_t>(1, std::min<int64_t>(model.hp.max_position_embeddings, 2048));
    }
    const MemoryEstimateTable t = estimate_memory_table(base, model, topo, filter_of(a), a.headroom);
    if (t.rows.empty())
      throw UserError("no configuration matches the filters", base.parallel.pipeline > 1 ? "a pipeline takes ZeRO stages 0-1; optimizer offload needs stage >= 1"
                                                                                      : "stage 0 has no offload; optimizer offload needs stage >= 1");
    // Beside the rows, the smallest mesh of these GPUs that fits (an architecture's, more than one GPU).
    std::optional<MeshChoice> mesh;
    if (base.parallel.tensor == 1 && base.parallel.pipeline == 1 && model.hp.num_layers > 0 && topo.world_size > 1)
      mesh = recommend_mesh(base, model, topo, a.headroom);
    const EstimateInputs in{model, base, topo, lora, model_note,
                            base.bf16.enabled.value_or(false) ? "bf16" : base.fp16.enabled.value_or(false) ? "fp16" : "fp32", mesh};
    if (a.json)
      print_json(a, in, t);
    else
      print_text(a, in, t);
    return 0;
  }, a.json);
}

}  // namespace ds::cli
