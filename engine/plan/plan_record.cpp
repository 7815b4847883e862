#include "engine/plan/plan_record.hpp"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "common/error.hpp"
#include "common/json_depth.hpp"
#include "engine/plan/fit.hpp"
#include "engine/plan/runnable.hpp"
#include "schema/rope_scaling.hpp"

#include <nlohmann/json.hpp>

namespace ds {
namespace {

using json = nlohmann::ordered_json;

json bytes(double b) { return static_cast<int64_t>(std::llround(b)); }

json categories(const MemoryCategories& m) {
  return json{{"params", bytes(m.params)},         {"grads", bytes(m.grads)},
              {"optimizer_states", bytes(m.optimizer_states)}, {"activations", bytes(m.activations)},
              {"buffers", bytes(m.buffers)},       {"total", bytes(m.total())}};
}

json offload(const OffloadConfig& o) {
  json j{{"device", offload_device_name(o.device)}};
  if (o.device == OffloadDevice::nvme) j["nvme_path"] = o.nvme_path;
  if (o.device != OffloadDevice::none) {
    j["pin_memory"] = o.pin_memory;
    j["buffer_count"] = o.buffer_count;
  }
  return j;
}

json issues(const std::vector<ConfigIssue>& list) {
  json a = json::array();
  for (const auto& i : list) a.push_back({{"path", i.path}, {"message", i.message}, {"hint", i.hint}});
  return a;
}

json model_json(const Plan& p) {
  const ModelHyper& h = p.model.hp;
  return {{"name", h.name},
          {"arch", model_arch_name(h.arch)},
          {"vocab_size", h.vocab_size},
          {"hidden_size", h.hidden_size},
          {"num_layers", h.num_layers},
          {"num_heads", h.num_heads},
          {"num_kv_heads", h.num_kv_heads},
          {"intermediate_size", h.intermediate_size},
          {"head_dim", h.head_dim()},
          {"max_position_embeddings", h.max_position_embeddings},
          {"tie_word_embeddings", h.tie_word_embeddings},
          {"attention_bias", h.attention_bias},
          {"mlp_bias", h.mlp_bias},
          {"sliding_window", h.sliding_window > 0 ? json(h.sliding_window) : json(nullptr)},
          {"attn_logit_softcapping", h.attn_softcap > 0 ? json(h.attn_softcap) : json(nullptr)},
          {"final_logit_softcapping", h.final_softcap > 0 ? json(h.final_softcap) : json(nullptr)},
          {"query_pre_attn_scalar", h.query_pre_attn_scalar > 0 ? json(h.query_pre_attn_scalar) : json(nullptr)},
          {"norm_eps", h.norm_eps},
          {"rope_theta", h.rope_theta},
          {"rope_scaling", rope_scaling_json(h.rope_scaling)},
          {"attn_pdrop", h.attn_pdrop},
          {"resid_pdrop", h.resid_pdrop},
          {"embd_pdrop", h.embd_pdrop},
          {"bos_token_id", h.bos_token_id >= 0 ? json(h.bos_token_id) : json(nullptr)},
          {"eos_token_id", h.eos_token_id.empty() ? json(nullptr) : json(h.eos_token_id)},
          {"num_params", p.model.num_params},
          {"largest_module_params", p.model.largest_module_params},
          {"largest_block_params", p.model.largest_block_params},
          {"train_flops_per_token", p.train_flops_per_token()}};
}

// What trains and what is held: LoRA's adapter, or model.freeze's tensors (null when neither).
void add_trainable(const Plan& p, json& j) {
  if (p.lora.enabled)
    j["lora"] = {{"r", p.lora.r},
                 {"alpha", p.lora.alpha},
                 {"scale", p.lora.scale},
                 {"dropout", p.lora.dropout},
                 {"target_modules", p.lora.target_modules},
                 {"init", p.lora.init == LoraInit::gaussian ? "gaussian" : "kaiming_uniform"},
                 {"trainable_params", p.lora.adapters.num_params},
                 {"frozen_params", p.frozen_numel()},
                 {"forward_only_blocks", p.backward_from},
                 {"layers_to_transform", p.lora.layers.empty() ? json(nullptr) : json(p.lora.layers)}};
  else
    j["lora"] = nullptr;
  if (!p.lora.enabled && !p.frozen.empty()) {
    json names = json::array();
    for (size_t i = 0; i < p.frozen.size(); ++i)
      if (p.frozen[i]) names.push_back(p.model.tensors[i].name);
    j["freeze"] = {{"frozen_tensors", names},
                   {"frozen_params", p.frozen_numel()},
                   {"trainable_params", p.unfrozen.num_params},
                   {"forward_only_blocks", p.backward_from}};
  } else {
    j["freeze"] = nullptr;
  }
}

json topology_json(const Topology& t) {
  return {{"world_size", t.world_size},
          {"ranks_per_node", t.ranks_per_node},
          {"num_nodes", t.num_nodes},
          {"device", device_kind_name(t.device)},
          {"device_memory_bytes", bytes(t.device_memory_bytes)},
          {"host_memory_bytes", bytes(t.host_memory_bytes)},
          {"cores_per_node", t.cores_per_node},
          {"world_size_source", t.world_size_source}};
}

// The device's traits (engine/plan/device_traits.hpp): what ds plan and the trainer ask of it, and what it refuses.
json device_json(const Plan& p) {
  const DeviceTraits d = p.topology.device_traits();
  json build = nullptr;
  if (p.topology.build)
    build = {{"torch_cuda", p.topology.build->torch_cuda}, {"cuda_kernels", p.topology.build->cuda_kernels}, {"nccl", p.topology.build->nccl}};
  return {{"name", d.name},
          {"communicator", comm_backend_name(d.communicator)},
          {"memory_is_host", d.memory_is_host},
          {"memory_measured_by", d.memory_measured_by},
          {"computes_fp16", d.computes_fp16},
          {"build", build},
          {"refuses", device_refusals(p)}};
}

// `wire`: the dtype gradients cross ranks in (ZeroExecution::wire_dtype), recorded as comm_dtype.
json precision_json(const PrecisionPolicy& pr, Dtype wire) {
  return {{"mode", pr.mode},
          {"param_dtype", dtype_name(pr.param_dtype)},
          {"compute_dtype", dtype_name(pr.compute_dtype)},
          {"grad_dtype", dtype_name(pr.grad_dtype)},
          {"comm_dtype", dtype_name(wire)},
          {"fp32_master", pr.fp32_master},
          {"check_overflow", pr.check_overflow},
          {"loss_scaling",
           {{"enabled", pr.loss_scaling.enabled},
            {"dynamic", pr.loss_scaling.dynamic},
            {"initial_scale", pr.loss_scaling.initial_scale},
            {"window", pr.loss_scaling.window},
            {"hysteresis", pr.loss_scaling.hysteresis},
            {"consecutive_hysteresis", pr.loss_scaling.consecutive_hysteresis},
            {"min_scale", pr.loss_scaling.min_scale}}},
          {"note", pr.note}};
}

json optimizer_json(const ResolvedOptimizer& o) {
  return {{"type", optimizer_type_name(o.type)},
          {"lr", o.lr},
          {"betas", {o.betas[0], o.betas[1]}},
          {"eps", o.eps},
          {"weight_decay", o.weight_decay},
          {"decoupled_weight_decay", o.decoupled_weight_decay},
          {"weight_decay_params", o.decay_all_params ? "all" : "matrices"},
          {"bias_correction", o.bias_correction},
          {"momentum", o.momentum},
          {"moments", o.moments}};
}

json scheduler_json(const Plan& p) {
  const SchedulerConfig& s = p.scheduler.params;
  json sj{{"type", scheduler_type_name(p.scheduler.type)}};
  if (p.scheduler.type != SchedulerType::None) {
    if (s.warmup_min_lr) sj["warmup_min_lr"] = *s.warmup_min_lr;
    if (s.warmup_max_lr) sj["warmup_max_lr"] = *s.warmup_max_lr;
    if (s.warmup_num_steps) sj["warmup_num_steps"] = *s.warmup_num_steps;
    if (s.total_num_steps) sj["total_num_steps"] = *s.total_num_steps;
    sj["warmup_type"] = s.warmup_type;
  }
  return sj;
}

json zero_json(const Plan& p) {
  const ResolvedZero& z = p.zero;
  return {{"stage", p.zero_stage()},
          {"overlap_comm", z.overlap_comm},
          {"reduce_scatter", z.reduce_scatter},
          {"contiguous_gradients", z.contiguous_gradients},
          {"reduce_bucket_size", z.reduce_bucket_size},
          {"allgather_bucket_size", z.allgather_bucket_size},
          {"stage3_prefetch_bucket_size", z.prefetch_bucket_size},
          {"stage3_param_persistence_threshold", z.param_persistence_threshold},
          {"stage3_max_live_parameters", z.max_live_parameters},
          {"stage3_max_reuse_distance", z.max_reuse_distance},
          {"sub_group_size", z.sub_group_size},
          {"offload_optimizer", offload(z.offload_optimizer)},
          {"offload_param", offload(z.offload_param)}};
}

// The flat layout: every tensor's place, and each rank's shard (what checkpoints are cut by).
json layout_json(const FlatLayout& L) {
  json params = json::array();
  for (const auto& ps : L.params) {
    json e{{"name", ps.name}, {"shape", ps.shape}, {"numel", ps.numel}, {"offset", ps.offset}, {"weight_decay", ps.weight_decay}};
    if (L.stage == 3) {
      e["partition_numel"] = ps.partition_numel;
      e["partition_offset"] = ps.partition_offset;
    }
    params.push_back(std::move(e));
  }
  json shards = json::array();
  for (size_t r = 0; r < L.shards.size(); ++r)
    shards.push_back({{"rank", r}, {"begin", L.shards[r].begin}, {"end", L.shards[r].end}, {"real", L.shards[r].real}});
  return {{"stage", L.stage},       {"world_size", L.world_size},   {"numel", L.numel},
          {"padded_numel", L.padded_numel}, {"alignment", L.alignment}, {"shard_numel", L.shard_numel},
          {"shards", shards},       {"params", params}};
}

json collectives_json(const std::vector<Collective>& collectives) {
  json coll = json::array();
  for (const auto& c : collectives)
    coll.push_back({{"what", c.what()},
                    {"op", collective_op_name(c.op)},
                    {"when", cadence_name(c.when)},
                    {"calls_per_step", c.calls_per_step},
                    {"elements_per_step", c.elements_per_step},
                    {"dtype_bytes", c.dtype_bytes},
                    {"payload_bytes_per_step", bytes(c.payload_bytes_per_step)},
                    {"wire_bytes_per_rank_per_step", bytes(c.wire_bytes_per_rank_per_step)},
                    {"note", c.note}});
  return coll;
}

// The ZeRO execution: the buffers the runtime allocates, the transfers between places, NVMe's sub-groups.
json execution_json(const ZeroExecution& x) {
  json buffers = json::array();
  for (const ZeroBuffer& b : x.buffers)
    buffers.push_back({{"role", buffer_role_name(b.role)},
                       {"dtype", dtype_name(b.dtype)},
                       {"elements", b.elements},
                       {"copies", b.copies},
                       {"place", place_name(b.place)},
                       {"bytes", bytes(b.bytes())},
                       {"transient", b.transient},
                       {"pinned", b.pinned}});
  json e = {{"sharded", x.sharded},         {"grouped", x.grouped},         {"gathers", x.gathers},
            {"overlap", x.overlap},         {"gather_ahead", x.gather_ahead}, {"step_in_forward", x.step_in_forward}, {"step_in_backward", x.step_in_backward}, {"speculated_numel", x.speculated_numel}, {"gradient_lag", x.gradient_lag}, {"kept_within_step", x.kept_within_step}, {"widened", x.widened},         {"micro_grads", x.micro_grads}, {"full_numel", x.full_numel},
            {"local_numel", x.local_numel}, {"block_numel", x.block_numel}, {"outer_numel", x.outer_numel},
            {"whole_numel", x.whole_numel}, {"gather_numel", x.gather_numel}, {"buffers", buffers},
            {"backend", comm_backend_name(x.backend)},
            // Frozen tensors: kept whole, and (stage 3 on several ranks) partitioned, gathered by block.
            {"frozen_whole_numel", x.frozen_whole_numel},
            {"frozen_partitioned_numel", x.frozen_layout.numel},
            {"frozen_block_numel", x.frozen_block_numel}};
  json transfers = json::array();
  for (const Transfer& t : x.transfers)
    transfers.push_back({{"what", t.what}, {"from", place_name(t.from)}, {"to", place_name(t.to)}, {"bytes_per_step", bytes(t.bytes_per_step)},
                         {"written_in_step", t.written_in_step}});
  e["transfers"] = transfers;
  json spans = json::array();  // where the optimizer's states live: the rank's local elements [begin, end) at a place
  for (const StateSpan& sp : x.state_spans) spans.push_back({{"begin", sp.begin}, {"end", sp.end}, {"place", place_name(sp.place)}, {"weights", weights_back_name(sp.weights)}});
  e["optimizer_state_spans"] = spans;
  if (!x.weight_tiles.empty()) e["weight_tiles"] = {{"tiles", x.weight_tiles.size()}, {"largest", std::max_element(x.weight_tiles.begin(), x.weight_tiles.end(), [](const SubGroup& a, const SubGroup& b) { return a.numel() < b.numel(); })->numel()}};
  if (!x.sub_groups.empty())
    e["nvme_swap"] = {{"sub_groups", x.sub_groups.size()}, {"sub_group_numel", x.sub_group_numel},
                      {"sets_in_flight", x.swap_sets}, {"file_bytes_per_state", swap_file_bytes(x.sub_groups)}};
  return e;
}

json run_json(const RunSettings& r) {
  return {{"output_dir", r.output_dir},     {"seed", r.seed},
          {"save_every", r.save_every},     {"keep_last", r.keep_last}, {"divergence_factor", r.divergence_factor},
          {"eval_every", r.eval_every},     {"eval_batches", r.eval_batches},
          {"comm_timeout_s", r.comm_timeout_s}, {"comms_logger", r.comms_logger},
          {"wall_clock_breakdown", r.wall_clock_breakdown},
          {"csv_monitor", r.csv_monitor.enabled}, {"tensorboard", r.tensorboard.enabled},
          {"init_from", r.init_from}};
}

json fit_json(const Plan& p) {
  if (!p.has_model) return nullptr;
  const FitCheck f = check_fit(p, p.topology.headroom);
  const auto name = [](Fit v) {
    switch (v) {
      case Fit::fits: return "fits";
      case Fit::within_headroom: return "within_headroom";
      case Fit::does_not_fit: return "does_not_fit";
      case Fit::not_applicable: return "not_applicable";
      case Fit::unknown: break;
    }
    return "unknown";
  };
  return {{"device", name(f.device)}, {"host", name(f.host)}, {"headroom", p.topology.headroom}};
}

// The mesh: its shape always; with a model, each stage's blocks and parameters per rank, and the bubble.
json mesh_json(const Plan& p) {
  const MeshPlan& m = p.mesh;
  json j{{"data", m.shape.data}, {"tensor", m.shape.tensor}, {"pipeline", m.shape.pipeline},
         {"rank_order", "tensor fastest, then data, then pipeline"}};
  if (!p.has_model) return j;
  j["partition"] = m.partition_text;
  j["micro_batches"] = m.micro_batches;
  j["bubble"] = m.bubble;
  j["tensor_groups_across_nodes"] = m.tensor_groups_across_nodes;
  j["tensor_group_nodes"] = m.tensor_group_nodes;
  j["heaviest_stage"] = m.heaviest_stage >= 0 ? json(m.heaviest_stage) : json(nullptr);
  json stages = json::array();
  for (const PipelineStage& s : m.stages) {
    json st{{"first_block", s.first_block}, {"blocks", s.blocks}, {"embeddings", s.embeddings}, {"head", s.head},
            {"params_per_rank", s.params_per_rank}, {"micro_batches_in_flight", activations_in_flight(s, p.backward_from)}, {"memory_per_rank", nullptr}};
    if (s.memory_planned)
      st["memory_per_rank"] = {{"device", categories(s.memory.device)}, {"host", categories(s.memory.host)}, {"nvme", bytes(s.memory.nvme)}};
    const MeshTraffic& x = s.traffic;
    st["traffic_per_rank_per_step"] = {{"tensor_all_reduces", x.tensor_all_reduces}, {"tensor_payload_bytes", x.tensor_payload_bytes},
                                       {"tensor_wire_bytes", x.tensor_wire_bytes}, {"pipeline_sends", x.pipeline_sends},
                                       {"pipeline_bytes", x.pipeline_bytes},
                                       {"pipeline_gradient_sends", x.pipeline_gradient_sends},
                                       {"pipeline_gradient_bytes", x.pipeline_gradient_bytes}, {"tied_sends", x.tied_sends},
                                       {"tied_bytes", x.tied_bytes}, {"lamb_all_reduces", x.lamb_all_reduces},
                                       {"lamb_bytes", x.lamb_bytes}, {"zero_wire_bytes", s.zero_wire_bytes}};
    stages.push_back(st);
  }
  j["stages"] = stages;
  return j;
}

// The predicted step (a prediction from the topology's rates; null figures where they are unknown).
json step_time_json(const Plan& p) {
  const StepTime& t = p.step_time;
  const HardwareRates& hw = p.topology.rates;
  const auto link = [](const Link& l) { return l.known() ? json{{"name", l.name}, {"busbw_bytes_per_s", l.busbw}, {"latency_s", l.latency_s}} : json(nullptr); };
  json j = {{"gpu", hw.gpu},
            {"peak_flops", t.compute_known ? json(t.peak_flops) : json(nullptr)},
            {"mfu", hw.mfu},
            {"mfu_source", hw.mfu_given ? "--mfu" : "assumed"},
            {"intra_node_link", link(hw.intra_node)},
            {"inter_node_link", link(hw.inter_node)},
            {"missing", t.missing}};
  const auto known = [](bool k, double v) { return k ? json(v) : json(nullptr); };
  j["compute_s"] = known(t.compute_known, t.compute_s);
  j["bubble_s"] = known(t.compute_known, t.bubble_s);
  j["communication_s"] = known(t.comm_known, t.comm_s);
  j["hidden_s"] = known(t.comm_known && t.compute_known, t.hidden_s);
  j["step_s"] = known(t.step_known(), t.step_s());
  j["bound"] = t.step_known() ? json(t.bound()) : json(nullptr);
  json rows = json::array();
  for (const CollectiveTime& c : t.collectives)
    rows.push_back({{"what", c.what}, {"link", c.link}, {"overlaps", step_phase_name(c.phase)}, {"seconds", c.seconds}, {"hidden_s", c.hidden_s}});
  j["collectives"] = rows;
  j["host_link"] = link(hw.host_link);
  j["host_memory_bytes_per_s"] = hw.host_memory_bw > 0 ? json(hw.host_memory_bw) : json(nullptr);
  j["nvme_bytes_per_s"] = hw.nvme_bw > 0 ? json(hw.nvme_bw) : json(nullptr);
  json offload = json::array();
  for (const OffloadTime& x : t.offload)
    offload.push_back({{"what", x.what}, {"resource", offload_resource_name(x.resource)}, {"at", x.rate}, {"bytes", x.bytes},
                       {"seconds", known(x.known, x.seconds)}, {"hidden_s", known(x.known, x.hidden_s)}});
  j["offload"] = offload;
  j["offload_s"] = known(t.offload_known(), t.offload_s - t.offload_hidden_s);
  j["host_memory_busy_s"] = known(t.host_memory_busy_s > 0, t.host_memory_busy_s);
  j["host_memory_copied_bytes"] = known(t.host_memory_busy_s > 0, t.host_memory_copied_bytes);
  return j;
}

}  // namespace

std::string with_whole_model_layout(const std::string& plan_json, const Plan& plan) {
  json j = json::parse(plan_json);
  j["layout"] = layout_json(plan.checkpoint_layout());
  return j.dump(2);
}

std::string plan_to_json(const Plan& p, const std::vector<TokenizerFileRecord>& tokenizer_files, int indent) {
  json j;
  j["schema_version"] = p.schema_version;
  j["config"] = p.config_source;
  j["model"] = p.has_model ? model_json(p) : json(nullptr);  // a config without a model block: what needs one is null below
  add_trainable(p, j);
  j["topology"] = topology_json(p.topology);
  j["device"] = device_json(p);
  j["mesh"] = mesh_json(p);
  j["batch"] = {{"train_batch_size", p.batch.train_batch_size},
                {"train_micro_batch_size_per_gpu", p.batch.micro_batch},
                {"gradient_accumulation_steps", p.batch.grad_accum},
                {"world_size", p.batch.world_size},
                {"derivation", p.batch.derivation}};
  j["has_model"] = p.has_model;
  const DataConfig& d = p.data;
  j["data"] = {{"type", data_type_name(d.type)}, {"path", d.path},       {"tokenizer", d.tokenizer},
               {"vocab_file", d.vocab_file},     {"merges_file", d.merges_file}, {"token_format", d.token_format},
               {"dataset", d.dataset},           {"val_fraction", d.val_fraction}, {"shuffle", d.shuffle},
               {"tokenizer_path", d.tokenizer_path}, {"chat_template", d.chat_template}, {"train_on_prompt", d.train_on_prompt}, {"packing", d.packing}, {"val_path", d.val_path}};
  j["seq_len"] = p.seq_len;
  j["steps"] = p.steps;
  j["threads"] = p.threads;
  j["tokens_per_step"] = p.tokens_per_step;
  j["train_flops_per_step"] = p.train_flops_per_step;
  j["precision"] = precision_json(p.precision, p.execution.wire_dtype);
  j["optimizer"] = optimizer_json(p.optimizer);
  j["scheduler"] = scheduler_json(p);
  j["gradient_clipping"] = p.gradient_clipping;
  j["gradient_sum_over_ranks"] = p.gradient_sum_over_ranks;
  j["activation_checkpointing"] = p.activation_checkpointing;
  j["recompute_group"] = p.recompute_group;
  j["zero"] = zero_json(p);
  j["layout"] = layout_json(p.layout);
  j[p.has_model ? "collectives" : "collectives_per_parameter"] = collectives_json(p.execution.collectives);
  j["step_time"] = step_time_json(p);
  if (p.has_model) j["zero_execution"] = execution_json(p.execution);
  j["run"] = run_json(p.run);
  j["memory"] = {{"device_per_rank", categories(p.memory.device)},
                 {"host_per_rank", categories(p.memory.host)},
                 {"nvme_per_rank", bytes(p.memory.nvme)},
                 {"host_per_node", bytes(p.host_bytes_per_node())},
                 {"shard_numel", p.memory.shard_numel},
                 {"persistent_numel", p.memory.persistent_numel}};
  j["placement"] = {{"params", p.placement.params}, {"grads", p.placement.grads}, {"optimizer_states", p.placement.optimizer_states}};
  json res = json::array();
  for (const auto& r : p.resolved) res.push_back({{"path", r.path}, {"value", r.value}, {"source", r.source}});
  j["resolved"] = res;
  j["warnings"] = issues(p.warnings);
  j["not_yet_runnable"] = p.has_model ? not_yet_runnable(p) : std::vector<std::string>{};
  j["fit"] = fit_json(p);
  if (!p.has_model)
    for (const char* needs_model : {"layout", "memory", "tokens_per_step", "train_flops_per_step"}) j[needs_model] = nullptr;
  if (!tokenizer_files.empty()) {
    json files = json::array();
    for (const TokenizerFileRecord& f : tokenizer_files)
      files.push_back({{"role", f.role}, {"name", f.name}, {"path", f.path}, {"checksum64", f.checksum64}, {"bytes", f.bytes}});
    j["tokenizer_files"] = files;
  }
  return j.dump(indent);
}

}  // namespace ds

// ---- Reading a record back ------------------------------------------------------------------------

namespace ds {
namespace {

using rjson = nlohmann::json;

// Each field read at its path and typed; absent and null read alike (null is how the writer says "none").
class FieldReader {
 public:
  explicit FieldReader(const std::string& where) : where_(where) {}

  [[noreturn]] void damaged(const std::string& what) const {
    throw UserError(where_ + " has no readable plan.json (" + what + ")",
                    "it was not written by ds, or is damaged: read another checkpoint of the run (each stores its plan)");
  }
  const rjson* find(const rjson& obj, const char* key) const {
    const auto it = obj.find(key);
    return it == obj.end() || it->is_null() ? nullptr : &*it;
  }
  const rjson* object(const rjson& obj, const char* key, const std::string& path) const {
    const rjson* v = find(obj, key);
    if (v && !v->is_object()) damaged(path + key + " is not an object");
    return v;
  }
  template <class T>
  std::optional<T> get(const rjson& obj, const char* key, const std::string& path) const {
    const rjson* v = find(obj, key);
    if (!v) return std::nullopt;
    if (!has_type<T>(*v)) damaged(path + key + " is not " + type_name<T>());
    return v->get<T>();
  }
  template <class T>
  T need(const rjson& obj, const char* key, const std::string& path) const {
    const std::optional<T> v = get<T>(obj, key, path);
    if (!v) damaged(path + key + " is missing");
    return *v;
  }

 private:
  template <class T>
  static bool has_type(const rjson& v) {
    if constexpr (std::is_same_v<T, bool>) return v.is_boolean();
    else if constexpr (std::is_same_v<T, int64_t>) return v.is_number_integer();
    else if constexpr (std::is_same_v<T, double>) return v.is_number();
    else if constexpr (std::is_same_v<T, std::string>) return v.is_string();
    else if constexpr (std::is_same_v<T, std::vector<int64_t>>)
      return v.is_array() && std::all_of(v.begin(), v.end(), [](const rjson& e) { return e.is_number_integer(); });
    else return v.is_array() && std::all_of(v.begin(), v.end(), [](const rjson& e) { return e.is_string(); });
  }
  template <class T>
  static const char* type_name() {
    if constexpr (std::is_same_v<T, bool>) return "true or false";
    else if constexpr (std::is_same_v<T, int64_t>) return "an integer";
    else if constexpr (std::is_same_v<T, double>) return "a number";
    else if constexpr (std::is_same_v<T, std::string>) return "a string";
    else if constexpr (std::is_same_v<T, std::vector<int64_t>>) return "a list of integers";
    else return "a list of strings";
  }
  const std::string& where_;
};

ModelHyper read_model(const FieldReader& r, const rjson& m, const std::string& where) {
  const std::string at = "model.";
  ModelHyper h;
  h.name = r.need<std::string>(m, "name", at);
  const std::string arch = r.need<std::string>(m, "arch", at);
  const std::optional<ModelArch> known = model_arch_from_name(arch);
  if (!known)
    throw UserError(where + " is of architecture '" + arch + "', which this build of ds does not know",
                    "a newer ds wrote it: export it to Hugging Face with that version (ds convert-ckpt RUN OUT --to hf)");
  h.arch = *known;
  h.vocab_size = r.need<int64_t>(m, "vocab_size", at);
  h.hidden_size = r.need<int64_t>(m, "hidden_size", at);
  h.num_layers = r.need<int64_t>(m, "num_layers", at);
  h.num_heads = r.need<int64_t>(m, "num_heads", at);
  h.num_kv_heads = r.need<int64_t>(m, "num_kv_heads", at);
  h.intermediate_size = r.need<int64_t>(m, "intermediate_size", at);
  h.max_position_embeddings = r.need<int64_t>(m, "max_position_embeddings", at);
  h.tie_word_embeddings = r.need<bool>(m, "tie_word_embeddings", at);
  h.norm_eps = r.need<double>(m, "norm_eps", at);
  h.rope_theta = r.need<double>(m, "rope_theta", at);
  // Records before the rotary families' own keys have none of these: their models had none.
  const int64_t head_dim = r.get<int64_t>(m, "head_dim", at).value_or(0);
  if (head_dim > 0 && h.num_heads > 0 && head_dim * h.num_heads != h.hidden_size) h.head_dim_given = head_dim;
  h.attention_bias = r.get<bool>(m, "attention_bias", at).value_or(false);
  h.mlp_bias = r.get<bool>(m, "mlp_bias", at).value_or(false);
  h.sliding_window = r.get<int64_t>(m, "sliding_window", at).value_or(0);
  h.attn_softcap = r.get<double>(m, "attn_logit_softcapping", at).value_or(0);
  h.final_softcap = r.get<double>(m, "final_logit_softcapping", at).value_or(0);
  h.query_pre_attn_scalar = r.get<double>(m, "query_pre_attn_scalar", at).value_or(0);
  h.attn_pdrop = r.get<double>(m, "attn_pdrop", at).value_or(0);
  h.resid_pdrop = r.get<double>(m, "resid_pdrop", at).value_or(0);
  h.embd_pdrop = r.get<double>(m, "embd_pdrop", at).value_or(0);
  if (m.contains("rope_scaling")) {  // records before rope scaling: plain rotary
    std::vector<ConfigIssue> bad;
    h.rope_scaling = read_rope_scaling(m["rope_scaling"], "plan_json", where + ": ", bad);
    if (!bad.empty()) throw UserError(bad.front().message, "a newer ds wrote it: export it with that version");
  }
  if (m.contains("bos_token_id")) {  // written (null when none) since the special tokens were recorded
    h.bos_token_id = r.get<int64_t>(m, "bos_token_id", at).value_or(-1);
    h.eos_token_id = r.get<std::vector<int64_t>>(m, "eos_token_id", at).value_or(std::vector<int64_t>{});
  } else if (h.arch == ModelArch::gpt2 && h.vocab_size >= 50257) {  // before: GPT-2's BPE vocabulary had its one
    h.bos_token_id = 50256, h.eos_token_id = {50256};
  }
  return h;
}

LoraConfig read_lora(const FieldReader& r, const rjson& l) {
  const std::string at = "lora.";
  LoraConfig c;
  c.enabled = true;
  c.r = r.need<int64_t>(l, "r", at);
  c.alpha = r.need<double>(l, "alpha", at);
  c.dropout = r.need<double>(l, "dropout", at);
  c.target_modules = r.need<std::vector<std::string>>(l, "target_modules", at);
  c.init = r.get<std::string>(l, "init", at).value_or("") == "gaussian" ? LoraInit::gaussian : LoraInit::kaiming_uniform;
  c.layers_to_transform = r.get<std::vector<int64_t>>(l, "layers_to_transform", at).value_or(std::vector<int64_t>{});  // (null: every block)
  return c;
}

std::vector<TokenizerFileRecord> read_tokenizer_files(const FieldReader& r, const rjson& files) {
  if (!files.is_array()) r.damaged("tokenizer_files is not a list");
  std::vector<TokenizerFileRecord> out;
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string at = "tokenizer_files[" + std::to_string(i) + "].";
    if (!files[i].is_object()) r.damaged("tokenizer_files[" + std::to_string(i) + "] is not an object");
    TokenizerFileRecord f;
    f.role = r.get<std::string>(files[i], "role", at).value_or("");
    // Records before the files were named carried only GPT-2's pair, named by their role.
    f.name = r.get<std::string>(files[i], "name", at).value_or(f.role == "merges_file" ? "merges.txt" : "vocab.json");
    f.path = r.get<std::string>(files[i], "path", at).value_or("");
    f.checksum64 = r.get<std::string>(files[i], "checksum64", at).value_or("");
    f.bytes = r.get<int64_t>(files[i], "bytes", at).value_or(0);
    out.push_back(std::move(f));
  }
  return out;
}

void read_layout(const FieldReader& r, const rjson& layout, PlanRecord& rec) {
  const std::string at = "layout.";
  rec.layout_numel = r.need<int64_t>(layout, "numel", at);
  rec.layout_world_size = r.need<int64_t>(layout, "world_size", at);
  const rjson* params = r.find(layout, "params");
  if (!params || !params->is_array()) r.damaged("layout.params is not a list");
  for (size_t i = 0; i < params->size(); ++i) {
    const std::string pat = "layout.params[" + std::to_string(i) + "].";
    if (!(*params)[i].is_object()) r.damaged("layout.params[" + std::to_string(i) + "] is not an object");
    rec.params.push_back({r.need<std::string>((*params)[i], "name", pat), r.need<std::vector<int64_t>>((*params)[i], "shape", pat),
                          r.need<int64_t>((*params)[i], "offset", pat)});
  }
}

}  // namespace

bool looks_like_plan_record(const nlohmann::json& j) {
  return j.is_object() && j.contains("topology") && j.contains("batch") && j.contains("schema_version");
}

PlanRecord read_plan_record(const std::string& text, const std::string& where) {
  check_json_nesting(text, where + " (plan.json)");
  const rjson j = rjson::parse(text, nullptr, false);
  const FieldReader r(where);
  if (j.is_discarded() || !j.is_object()) r.damaged("not a JSON object");
  PlanRecord rec;
  rec.schema_version = static_cast<int>(r.need<int64_t>(j, "schema_version", ""));
  if (const rjson* m = r.object(j, "model", "")) rec.model = read_model(r, *m, where);
  if (const rjson* l = r.object(j, "lora", "")) rec.lora = read_lora(r, *l);
  rec.frozen = rec.lora.has_value() || r.object(j, "freeze", "") != nullptr;
  if (const rjson* t = r.object(j, "topology", "")) rec.world_size = r.get<int64_t>(*t, "world_size", "topology.").value_or(0);
  if (const rjson* m = r.object(j, "mesh", "")) {
    rec.mesh_tensor = std::max<int64_t>(1, r.get<int64_t>(*m, "tensor", "mesh.").value_or(1));
    rec.mesh_pipeline = std::max<int64_t>(1, r.get<int64_t>(*m, "pipeline", "mesh.").value_or(1));
  }
  if (const rjson* b = r.object(j, "batch", "")) {
    auto count = [&](const char* key) {  // 0: not recorded; a recorded one is at least 1
      const std::optional<int64_t> v = r.get<int64_t>(*b, key, "batch.");
      if (v && *v < 1) r.damaged(std::string("batch.") + key + " is not a positive count");
      return v.value_or(0);
    };
    rec.train_batch_size = count("train_batch_size");
    rec.micro_batch = count("train_micro_batch_size_per_gpu");
    // The ranks the batch counts: the data-parallel ones (a mesh's tensor ranks share each batch); older
    // records have the topology's alone, which was the same.
    if (const int64_t data = count("world_size")) rec.world_size = data;
  }
  rec.steps = r.get<int64_t>(j, "steps", "").value_or(0);
  if (const rjson* s = r.object(j, "scheduler", "")) {
    rec.scheduler = r.get<std::string>(*s, "type", "scheduler.").value_or("");
    rec.warmup_num_steps = r.get<int64_t>(*s, "warmup_num_steps", "scheduler.");
    rec.total_num_steps = r.get<int64_t>(*s, "total_num_steps", "scheduler.");
  }
  // Every record has had these two from the first: required.
  const rjson* zero = r.object(j, "zero", "");
  const rjson* precision = r.object(j, "precision", "");
  if (!zero || !precision) r.damaged(std::string(zero ? "precision" : "zero") + " is missing");
  rec.zero_stage = static_cast<int>(r.need<int64_t>(*zero, "stage", "zero."));
  rec.precision = r.need<std::string>(*precision, "mode", "precision.");
  if (const rjson* l = r.object(j, "layout", "")) read_layout(r, *l, rec);
  if (const rjson* f = r.find(j, "tokenizer_files")) rec.tokenizer_files = read_tokenizer_files(r, *f);
  return rec;
}

}  // namespace ds
