#include "cli/render_plan.hpp"

#include "engine/plan/fit.hpp"
#include "engine/plan/runnable.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <functional>
#include <limits>
#include <set>
#include <sstream>

#include "common/format.hpp"
#include "common/strings.hpp"

namespace ds::cli {
namespace {


std::string flops(double f) {
  char buf[64];
  const char* units[] = {"FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP", "EFLOP"};
  int u = 0;
  while (f >= 1000 && u < 6) f /= 1000, ++u;
  std::snprintf(buf, sizeof buf, "%.2f %s", f, units[u]);
  return buf;
}

std::string stage_text(int stage) {
  switch (stage) {
    case 0: return "stage 0: nothing partitioned (plain data parallel)";
    case 1: return "stage 1: optimizer states partitioned";
    case 2: return "stage 2: optimizer states and gradients partitioned";
    default: return "stage 3: optimizer states, gradients and parameters partitioned";
  }
}

// `reduced`, `wire`: the dtype gradients are reduced from and cross ranks in (ZeroExecution::reduced_dtype, wire_dtype).
std::string precision_text(const PrecisionPolicy& pr, Dtype reduced, Dtype wire) {
  std::string prec = pr.mode + ": params " + dtype_name(pr.param_dtype) + ", compute " + dtype_name(pr.compute_dtype) +
                     ", grads " + dtype_name(pr.grad_dtype) +
                     (dtype_bytes(pr.grad_dtype) > dtype_bytes(pr.compute_dtype)
                          ? std::string(" (each micro-batch's ") + dtype_name(pr.compute_dtype) + " gradients added in " + dtype_name(pr.grad_dtype) + ")"
                          : std::string()) +
                     ", reduce in " + dtype_name(wire) +
                     (wire != reduced ? std::string(" (cast from ") + dtype_name(reduced) + ": communication_data_type)" : std::string()) +
                     (pr.fp32_master ? ", fp32 master weights" : "") + (pr.check_overflow ? ", skip step on inf/NaN" : "");
  if (pr.loss_scaling.enabled)
    prec += pr.loss_scaling.dynamic ? ", dynamic loss scale from " + format_double(pr.loss_scaling.initial_scale) +
                                          " (window " + std::to_string(pr.loss_scaling.window) + ", hysteresis " +
                                          std::to_string(pr.loss_scaling.hysteresis) +
                                          (pr.loss_scaling.consecutive_hysteresis ? " consecutive" : "") + ", at least " +
                                          format_double(pr.loss_scaling.min_scale) + ")"
                                    : ", static loss scale " + format_double(pr.loss_scaling.initial_scale);
  return prec;
}

std::string optimizer_text(const Plan& p) {
  const ResolvedOptimizer& op = p.optimizer;
  std::string opt = std::string(optimizer_type_name(op.type)) + " lr " + format_double(op.lr);
  if (op.type != OptimizerType::SGD)
    opt += ", betas (" + format_double(op.betas[0]) + ", " + format_double(op.betas[1]) + "), eps " + format_double(op.eps) +
           (op.bias_correction ? "" : ", no bias correction");
  else
    opt += ", momentum " + format_double(op.momentum);
  const std::string decayed = op.weight_decay == 0      ? ""
                              : op.decay_all_params     ? " on every parameter"
                                                        : " on matrices and embeddings, not biases or norms (train.weight_decay_params)";
  return opt + ", weight decay " + format_double(op.weight_decay) + (op.decoupled_weight_decay ? " (decoupled)" : " (L2)") + decayed +
         "; clip grad norm " + (p.gradient_clipping > 0 ? format_double(p.gradient_clipping) : std::string("off")) +
         (p.gradient_sum_over_ranks ? "; ranks' gradients summed (gradient_allreduce_op sum)" : "");
}

std::string scheduler_text(const Plan& p) {
  if (p.scheduler.type == SchedulerType::None) return "none (constant lr)";
  const SchedulerConfig& s = p.scheduler.params;
  std::string sch = scheduler_type_name(p.scheduler.type);
  // OneCycle and LRRangeTest are described by their own parameters (DeepSpeed's lr_schedules.py).
  if (p.scheduler.type == SchedulerType::OneCycle) {
    sch += ": lr " + format_double(s.cycle_min_lr) + " -> " + format_double(s.cycle_max_lr) + " over " +
           std::to_string(s.cycle_first_step_size) + " steps, back over " + std::to_string(s.cycle_second_step_size.value_or(s.cycle_first_step_size)) +
           (s.decay_step_size > 0 && s.decay_lr_rate != 0
                ? ", then " + format_double(s.cycle_min_lr) + " / (1 + " + format_double(s.decay_lr_rate) + " x steps since / " +
                      std::to_string(s.decay_step_size) + ")"
                : ", then constant at " + format_double(s.cycle_min_lr));
    if (s.cycle_momentum) sch += "; momentum " + format_double(s.cycle_max_mom) + " -> " + format_double(s.cycle_min_mom) + " and back";
    return sch;
  }
  if (p.scheduler.type == SchedulerType::LRRangeTest)
    return sch + ": lr " + format_double(s.lr_range_test_min_lr) + " x (1 + " + format_double(s.lr_range_test_step_rate) + " x step / " +
           std::to_string(s.lr_range_test_step_size) + ")" + (s.lr_range_test_staircase ? ", in stairs" : ", continuous");
  if (s.warmup_num_steps) sch += ": warmup " + std::to_string(*s.warmup_num_steps) + " steps (" + s.warmup_type + ")";
  if (s.total_num_steps) sch += ", total " + std::to_string(*s.total_num_steps);
  if (s.warmup_max_lr && p.scheduler.type != SchedulerType::WarmupCosineLR)
    sch += ", lr " + format_double(s.warmup_min_lr.value_or(0)) + " -> " + format_double(*s.warmup_max_lr);
  return sch;
}

std::string zero_text(int stage, const ResolvedZero& z) {
  std::string zs = stage < 0 ? std::string("stage auto: the lowest stage that fits, chosen once the model is known")
                             : stage_text(stage);
  if (z.offload_optimizer.device != OffloadDevice::none)
    zs += "; optimizer offload " + std::string(offload_device_name(z.offload_optimizer.device));
  if (z.offload_param.device != OffloadDevice::none)
    zs += "; parameter offload " + std::string(offload_device_name(z.offload_param.device));
  return zs;
}

std::string topology_text(const Topology& t) {
  return std::to_string(t.world_size) + (t.world_size == 1 ? " rank" : " ranks") + " (" + std::to_string(t.num_nodes) +
         (t.num_nodes == 1 ? " node" : " nodes") + " x " + std::to_string(t.ranks_per_node) + "), " +
         device_kind_name(t.device) + "; world size from " + t.world_size_source;
}

std::string batch_text(const Plan& p) {
  if (p.batch.micro_batch == 0) return "micro batch auto: the largest that fits, chosen once the model is known";
  return "global " + std::to_string(p.batch.train_batch_size) + " = micro " + std::to_string(p.batch.micro_batch) +
         " x accumulation " + std::to_string(p.batch.grad_accum) + (p.mesh.shape.splits_the_model() ? " x data ranks " : " x world ") +
         std::to_string(p.batch.world_size);
}

// In the order ds train's log and convert-ckpt name a mesh.
std::string mesh_text(const MeshShape& m) {
  return "tensor " + std::to_string(m.tensor) + " x pipeline " + std::to_string(m.pipeline) + " x data " + std::to_string(m.data);
}

std::string run_text(const Plan& p) {
  return std::to_string(p.steps) + " steps, " + std::to_string(p.threads) + (p.threads == 1 ? " thread" : " threads") +
         " per rank" +
         (!p.activation_checkpointing ? ""
          : p.recompute_group > 1     ? ", activation checkpointing (blocks recomputed " + std::to_string(p.recompute_group) + " at a time)"
                                      : ", activation checkpointing") +
         (p.run.init_from.empty() ? std::string() : ", weights from " + p.run.init_from);
}

std::string decided_and_warnings(const Plan& p, const std::function<std::string(const std::string&)>& h) {
  std::ostringstream o;
  if (!p.resolved.empty()) {
    o << "\n" << h("Decided by ds") << "\n";
    for (const auto& r : p.resolved) o << "  " << r.path << " = " << r.value << "   (" << r.source << ")\n";
  }
  if (!p.warnings.empty()) o << "\n" << p.warnings.size() << (p.warnings.size() == 1 ? " warning" : " warnings") << " (on stderr)\n";
  return o.str();
}

// A DeepSpeed config without a model block: what the config alone decides, and what needs a model.
std::string render_settings_only(const Plan& p, const std::function<std::string(const std::string&)>& h) {
  std::ostringstream o;
  auto row = [&](const char* key, const std::string& value) { o << "  " << pad(key, 12) << value << "\n"; };
  o << h("Plan for " + p.config_source) << " (no model block: the settings alone)\n";
  row("topology", topology_text(p.topology));
  if (p.mesh.shape.splits_the_model()) row("mesh", mesh_text(p.mesh.shape) + " (the stages need the model)");
  row("batch", batch_text(p));
  row("precision", precision_text(p.precision, p.execution.reduced_dtype, p.execution.wire_dtype));
  if (!p.precision.note.empty()) row("", p.precision.note);
  row("optimizer", optimizer_text(p));
  row("scheduler", scheduler_text(p));
  row("zero", zero_text(p.zero_stage(), p.zero));
  if (p.zero_stage() >= 0)
    row("placement", "params " + p.placement.params + "; grads " + p.placement.grads + "; optimizer states " +
                         p.placement.optimizer_states);
  row("data", data_text(p.data, p.seq_len));
  row("run", run_text(p));
  // What this ds cannot train yet on the plan's device, before anyone starts it.
  const std::vector<std::string> not_yet = not_yet_runnable(p);
  for (size_t i = 0; i < not_yet.size(); ++i) row(i == 0 ? "NOT YET" : "", "ds train refuses " + not_yet[i]);
  if (p.zero_stage() >= 0) {
    o << "\n" << h("Communication per parameter per optimizer step") << "\n";
    if (p.execution.collectives.empty()) {
      o << "  none (one rank)\n";
    } else {
      double wire = 0;
      for (const auto& c : p.execution.collectives) {
        o << "  " << pad(collective_op_name(c.op), 16) << pad(c.what(), 36) << pad(cadence_name(c.when), 16)
          << lpad(format_fixed(c.wire_bytes_per_rank_per_step, 2), 8) << " bytes on the wire per rank\n";
        if (!c.note.empty()) o << "  " << pad("", 16) << "(" << c.note << ")\n";
        wire += c.wire_bytes_per_rank_per_step;
      }
      o << "  total: " << format_fixed(wire, 2) << " bytes per parameter per rank per step (ring algorithms); times the "
        << "parameter count for a step's traffic\n";
    }
  }
  o << "\n" << h("Needs a model") << "\n"
    << "  memory per rank, the parameter layout and shards, the bytes of each collective"
    << (p.zero_stage() < 0 ? ", the \"auto\" ZeRO stage" : "") << (p.batch.micro_batch == 0 ? ", the \"auto\" micro batch" : "")
    << ".\n  Give one with an override (ds plan " << p.config_source << " model.preset=llama-2-7b), a \"model\" block in\n"
    << "  the file (a preset, a Hugging Face config.json, or sizes; see ds-config(5)), or size a model alone with\n"
    << "  ds estimate-memory --model 7b --gpus 8.\n";
  o << decided_and_warnings(p, h);
  return o.str();
}

}  // namespace

std::string data_text(const DataConfig& d, int64_t seq_len) {
  std::string s = data_type_name(d.type);
  switch (d.type) {
    case DataType::synthetic: s += " (an embedded Markov language, no file)"; break;
    case DataType::text:
      s += " " + d.path + ", tokenizer " + d.tokenizer;
      if (d.tokenizer == "gpt2") s += " (" + d.vocab_file + ", " + d.merges_file + ")";
      if (d.tokenizer == "hf") s += " (" + d.tokenizer_path + ")";
      break;
    case DataType::tokens: s += " " + d.path + " (" + d.token_format + ")"; break;
    case DataType::hdf5: s += " " + d.path + " dataset " + d.dataset; break;
    case DataType::jsonl:
      s += " " + d.path + ", tokenizer " + d.tokenizer_path + ", chat format " + d.chat_template +
           (d.packing ? ", samples packed into rows (each attends only to itself)" : ", one sample a row") + ", the loss on " +
           (d.train_on_prompt ? "every token" : "the completions and the assistant's turns");
      break;
  }
  s += "; " + (seq_len > 0 ? std::to_string(seq_len) + (d.packing ? " tokens per row" : " tokens per sample")
                           : std::string("sequence length auto (the model's context)"));
  if (!d.val_path.empty()) s += ", validation samples from " + d.val_path;
  else if (d.type != DataType::synthetic || d.val_fraction > 0) s += ", " + format_double(d.val_fraction * 100) + "% held out for validation";
  if (!d.shuffle) s += ", samples in stream order (data.shuffle false)";
  return s;
}

namespace {
// Where the frozen tensors live and what they cost a rank: whole on every rank, or at stage 3 on several
// ranks the blocks' partitioned (ZeroExecution::frozen_layout).
std::string frozen_where(const Plan& p) {
  const ZeroExecution& z = p.execution;
  const Dtype compute = p.precision.compute_dtype;
  const double bytes = dtype_bytes(compute);
  if (z.frozen_layout.params.empty()) {
    if (!p.mesh.shape.splits_the_model())
      return std::string(dtype_name(compute)) + ", " + format_bytes(static_cast<double>(p.frozen_numel()) * bytes) + " on every rank";
    // A split model's rank holds its stage's share (a tensor rank its slices), each stage its own.
    std::vector<double> held;
    for (size_t s = 0; s < std::max<size_t>(p.mesh.stages.size(), 1); ++s)
      held.push_back(static_cast<double>(share_of(p, static_cast<int>(s)).frozen_numel()) * bytes);
    std::string text = std::string(dtype_name(compute)) + ", per rank ";
    if (held.size() == 1) return text + format_bytes(held[0]) + " (its share of them)";
    if (std::all_of(held.begin(), held.end(), [&](double b) { return b == held[0]; }))
      return text + format_bytes(held[0]) + " on every stage (its share of them)";
    if (held.size() <= 4) {
      for (size_t s = 0; s < held.size(); ++s) text += (s ? ", " : "") + format_bytes(held[s]) + " on stage " + std::to_string(s);
      return text;
    }
    const auto [least, most] = std::minmax_element(held.begin(), held.end());
    return text + format_bytes(*least) + " (stage " + std::to_string(least - held.begin()) + ") to " + format_bytes(*most) + " (stage " +
           std::to_string(most - held.begin()) + ")";
  }
  return std::string(dtype_name(compute)) + ", " +
         format_bytes(static_cast<double>(z.frozen_whole_numel + z.frozen_layout.shard_numel) * bytes) + " per rank: the blocks' " +
         format_count(z.frozen_layout.numel) + " partitioned across the ranks and gathered as each block runs, " +
         format_count(z.frozen_whole_numel) + " kept whole";
}
// What trains and what is frozen: the adapter's size against the base's, and what the base costs.
// The model row: the sizes, then what the family adds to its block (schema/arch.hpp), the rotary scaling, dropout.
std::string model_text(const Plan& p) {
  const ModelHyper& m = p.model.hp;
  std::string s = m.name + " (" + model_arch_name(m.arch) + "): " + format_count(p.model.num_params) + " parameters (" +
                  format_si(static_cast<double>(p.model.num_params)) + "), " + std::to_string(m.num_layers) + " layers x " +
                  std::to_string(m.hidden_size) + " wide, " + std::to_string(m.num_heads) + " heads" +
                  (m.num_kv_heads != m.num_heads ? " (" + std::to_string(m.num_kv_heads) + " kv)" : "") +
                  (m.head_dim_given > 0 ? " of " + std::to_string(m.head_dim()) : "") + ", vocab " + std::to_string(m.vocab_size) +
                  ", context " + std::to_string(m.max_position_embeddings) + (m.tie_word_embeddings ? ", tied head" : "");
  if (m.traits().positions == Positions::rotary) {
    if (m.qkv_biased()) s += m.o_biased() ? ", q/k/v/o biases" : ", q/k/v biases";
    if (m.mlp_biased()) s += ", MLP biases";
    if (m.traits().qk_norm) s += ", q/k norms";
    if (m.sliding_window > 0) s += ", window " + std::to_string(m.sliding_window) + (m.traits().window_on_even_layers ? " on even layers" : "");
    if (m.attn_softcap > 0) s += ", scores capped at " + format_double(m.attn_softcap);
    if (m.final_softcap > 0) s += ", logits capped at " + format_double(m.final_softcap);
    // What the fused attention cannot compute takes the materialised one: T x T probabilities per head.
    if (const char* why = m.form_materialises(p.seq_len)) s += " (" + std::string(why) + ": the attention is materialised, T x T per head)";
  }
  if (m.rope_scaling.type != RopeType::none) {
    s += ", rope scaling " + std::string(rope_type_name(m.rope_scaling.type));
    if (m.rope_scaling.type != RopeType::longrope) s += " x" + format_double(m.rope_scaling.factor);
    else s += " (from " + std::to_string(m.rope_scaling.original_max_position_embeddings) + " positions)";
    if (m.rope_scaling.type == RopeType::llama3)
      s += " (from " + std::to_string(m.rope_scaling.original_max_position_embeddings) + " positions)";
  }
  if (m.attn_pdrop + m.resid_pdrop + m.embd_pdrop > 0)
    s += "; dropout attention " + format_double(m.attn_pdrop) + ", residual " + format_double(m.resid_pdrop) + ", embedding " +
         format_double(m.embd_pdrop) + " (training only)";
  return s;
}

// The blocks below every trained tensor: no backward there (Plan::backward_from).
std::string forward_only_text(const Plan& p) {
  if (p.backward_from <= 0) return "";
  const int64_t L = p.model.hp.num_layers;
  return "; " + (p.backward_from >= L ? std::string("every block runs") : p.backward_from == 1 ? "block 0 runs" : "blocks 0-" + std::to_string(p.backward_from - 1) + " run") +
         " forward only (nothing in or below " + (p.backward_from == 1 ? "it" : "them") + " trains: no backward, no activations kept)";
}

std::string lora_text(const Plan& p) {
  const LoraPlan& l = p.lora;
  const std::string modules = join(l.target_modules, ", ");
  const double trained = static_cast<double>(l.adapters.num_params), frozen = static_cast<double>(p.frozen_numel());
  return "r " + std::to_string(l.r) + ", alpha " + format_double(l.alpha) + " (scale " + format_double(l.scale) + "), dropout " +
         format_double(l.dropout) + " on " + modules + ": " + format_count(l.adapters.num_params) + " parameters train (" +
         format_fixed(100.0 * trained / (trained + frozen), trained < 0.01 * (trained + frozen) ? 3 : 2) + "% of all); the base's " + format_count(p.frozen_numel()) +
         " are frozen (" + frozen_where(p) + "; no gradient, no optimizer state)" + forward_only_text(p);
}
// model.freeze: what it froze and what still trains.
std::string freeze_text(const Plan& p) {
  const int64_t tensors = std::count(p.frozen.begin(), p.frozen.end(), uint8_t{1});
  return std::to_string(tensors) + " of " + std::to_string(p.model.tensors.size()) + " tensors frozen (" + format_count(p.frozen_numel()) +
         " parameters, " + frozen_where(p) + "; no gradient, no optimizer state); " + format_count(p.unfrozen.num_params) + " parameters train" +
         forward_only_text(p);
}
}  // namespace

namespace {

// The plan's one-line rows: the model, what trains, the machine, the batch, precision, optimizer, schedule,
// ZeRO, data and run; then what this ds cannot train yet on the plan's device, before anyone starts it.
void summary_rows(const Plan& p, const std::function<std::string(const std::string&)>& h, std::ostringstream& o) {
  const Topology& t = p.topology;
  auto row = [&](const char* key, const std::string& value) { o << "  " << pad(key, 12) << value << "\n"; };
  o << h("Plan for " + p.config_source) << "\n";
  row("model", model_text(p));
  if (p.lora.enabled) row("lora", lora_text(p));
  if (!p.lora.enabled && !p.frozen.empty()) row("freeze", freeze_text(p));
  row("topology", topology_text(t));
  row("batch", batch_text(p));
  row("tokens", std::to_string(p.seq_len) + (p.data.packing ? " per row, " : " per sample, ") + format_count(p.tokens_per_step) + " per step; " +
                    flops(p.train_flops_per_step) + " per step (" + flops(p.train_flops_per_token()) +
                    " per token)");
  row("precision", precision_text(p.precision, p.execution.reduced_dtype, p.execution.wire_dtype));
  if (!p.precision.note.empty()) row("", p.precision.note);
  row("optimizer", optimizer_text(p));
  row("scheduler", scheduler_text(p));
  row("zero", zero_text(p.zero_stage(), p.zero));
  row("placement", "params " + p.placement.params + "; grads " + p.placement.grads + "; optimizer states " +
                       p.placement.optimizer_states);
  row("data", data_text(p.data, p.seq_len));
  row("run", run_text(p));
  const std::vector<std::string> not_yet = not_yet_runnable(p);
  for (size_t i = 0; i < not_yet.size(); ++i) row(i == 0 ? "NOT YET" : "", "ds train refuses " + not_yet[i]);
}

// A few groups of ranks, "[0 1] [2 3] ... (16 groups)" beyond `shown`.
std::string groups_text(const std::vector<std::vector<int>>& groups, size_t shown = 8) {
  std::string out;
  for (size_t g = 0; g < groups.size() && g < shown; ++g) {
    out += g ? " [" : "[";
    for (size_t i = 0; i < groups[g].size(); ++i) out += (i ? " " : "") + std::to_string(groups[g][i]);
    out += "]";
  }
  if (groups.size() > shown) out += " ... (" + std::to_string(groups.size()) + " groups)";
  return out;
}

// A model split over ranks: the groups each kind of parallelism forms, each stage's blocks and parameters per
// rank, and the pipeline's bubble. Nothing when the ranks are data parallel alone.
void mesh_section(const Plan& p, const std::function<std::string(const std::string&)>& h, std::ostringstream& o) {
  const MeshPlan& m = p.mesh;
  if (!m.shape.splits_the_model()) return;
  o << "\n" << h("Mesh: " + mesh_text(m.shape) + " = " + std::to_string(m.shape.world()) + " ranks")
    << " (tensor fastest, then data, then pipeline)\n";
  for (MeshAxis axis : {MeshAxis::tensor, MeshAxis::data, MeshAxis::pipeline})
    o << "  " << pad(std::string(mesh_axis_name(axis)) + " groups", 17) << groups_text(mesh_groups(m.shape, axis)) << "\n";
  if (m.tensor_groups_across_nodes > 0)
    o << "  " << m.tensor_groups_across_nodes << (m.tensor_groups_across_nodes == 1 ? " tensor group spans " : " tensor groups span ")
      << (m.tensor_group_nodes == 2 ? std::string("two") : "up to " + std::to_string(m.tensor_group_nodes)) << " nodes: their all-reduces "
      << "(four per block per micro-batch, six with recomputation) cross the network; a tensor size that divides the ranks per node keeps each inside one\n";
  const bool memory = !m.stages.empty() && m.stages.front().memory_planned;
  o << "  " << pad("stage", 7) << pad("blocks", 12) << pad("also holds", 30) << lpad("params per rank", 16) << lpad("in flight", 11)
    << (memory ? lpad("memory per rank", 17) : "") << "\n";
  for (size_t s = 0; s < m.stages.size(); ++s) {
    const PipelineStage& st = m.stages[s];
    std::string also = st.embeddings && st.head ? "embeddings, final norm, head" : st.embeddings ? "embeddings" : st.head ? "final norm, head" : "";
    o << "  " << pad(std::to_string(s), 7)
      << pad(std::to_string(st.first_block) + "-" + std::to_string(st.first_block + st.blocks - 1) + " (" + std::to_string(st.blocks) + ")", 12)
      << pad(also, 30) << lpad(format_count(st.params_per_rank), 16) << lpad(std::to_string(activations_in_flight(st, p.backward_from)), 11)
      << (memory ? lpad(format_bytes(st.memory.device.total() + st.memory.host.total()), 17) : "")
      << (static_cast<int>(s) == m.heaviest_stage ? "  (the memory below)" : "") << "\n";
  }
  if (m.shape.pipeline > 1) o << "  stages cut by pipeline.partition \"" << m.partition_text << "\"; ";
  else o << "  ";
  o << "\"in flight\": micro-batches whose activations a stage holds at once (1F1B"
    << (std::any_of(m.stages.begin(), m.stages.end(), [&](const PipelineStage& st) { return !stage_runs_backward(st, p.backward_from); })
            ? "; 0: forward only, each let go once sent)"
            : ")")
    << (memory ? "; memory: device and host, by the memory model below" : "") << "\n";
  if (p.lora.enabled || !p.frozen.empty())
    o << "  params per rank: the model's tensors (" << (p.lora.enabled ? "the frozen base; the adapter's are not counted" : "frozen and trained")
      << ")\n";
  o << "  sent per rank per step, besides ZeRO's collectives over the data group (below):\n";
  o << "  " << pad("stage", 7) << lpad("tensor all-reduces", 19) << lpad("wire bytes", 13) << lpad("pipeline sends", 16) << lpad("bytes", 13)
    << "\n";
  for (size_t s = 0; s < m.stages.size(); ++s) {
    const MeshTraffic& x = m.stages[s].traffic;
    o << "  " << pad(std::to_string(s), 7) << lpad(format_count(x.tensor_all_reduces), 19) << lpad(format_bytes(x.tensor_wire_bytes), 13)
      << lpad(format_count(x.pipeline_sends), 16) << lpad(format_bytes(x.pipeline_bytes), 13) << "\n";
  }
  if (m.tied_copy_per_rank > 0 && !m.tied_trains)
    o << "  the tied head: stage " << m.stages.size() - 1 << " holds a copy of the frozen token table, loaded with it; nothing crosses\n";
  if (m.tied_exchange()) {
    const MeshTraffic& x = m.stages.front().traffic;
    o << "  the tied head: stage " << m.stages.size() - 1 << " sends its copy's gradient to stage 0, whose table steps on the sum and "
      << "sends its weights back, once per step (" << format_bytes(x.tied_bytes) << " each way)\n";
  }
  if (!m.stages.empty() && m.stages.front().traffic.lamb_all_reduces > 0) {
    const MeshTraffic& x = m.stages.front().traffic;
    o << "  Lamb: each tensor's two norms summed over the tensor group once per step (a split tensor's trust ratio is the whole "
      << "tensor's): " << format_bytes(x.lamb_bytes) << " per rank" << (m.stages.size() > 1 ? " of stage 0" : "") << "\n";
  }
  if (m.shape.pipeline > 1)
    o << "  pipeline bubble: " << format_fixed(100 * m.bubble, 1) << "% of each step idle ((p - 1) / (m + p - 1), p "
      << m.shape.pipeline << " stages, m " << m.micro_batches << (m.micro_batches == 1 ? " micro-batch" : " micro-batches")
      << ": gradient_accumulation_steps)\n";
}

// Memory per rank by category (in one unit, the largest in which its biggest figure is at least 1), and
// the fit by the one rule (engine/plan/fit.hpp) that estimate-memory and the "auto" choices judge by.
void memory_section(const Plan& p, const std::function<std::string(const std::string&)>& h, std::ostringstream& o) {
  const Topology& t = p.topology;
  const MemoryEstimate& me = p.memory;
  const double largest = std::max({me.device.total(), me.host.total(), me.nvme});
  const auto [unit, unit_bytes] = largest >= 1073741824.0 ? std::pair{"GiB", 1073741824.0}
                                  : largest >= 1048576.0  ? std::pair{"MiB", 1048576.0}
                                                          : std::pair{"KiB", 1024.0};
  auto in_unit = [unit_bytes = unit_bytes](double bytes) { return format_fixed(bytes / unit_bytes, 2); };
  o << "\n" << h(std::string("Memory per rank (") + unit + ")") << "\n";
  o << "  " << pad("", 18) << lpad("device", 10) << lpad("host", 10) << "\n";
  auto mrow = [&](const char* name, double dev, double host) {
    o << "  " << pad(name, 18) << lpad(in_unit(dev), 10) << lpad(in_unit(host), 10) << "\n";
  };
  mrow("parameters", me.device.params, me.host.params);
  mrow("gradients", me.device.grads, me.host.grads);
  mrow("optimizer states", me.device.optimizer_states, me.host.optimizer_states);
  mrow("activations", me.device.activations, me.host.activations);
  mrow("buffers", me.device.buffers, me.host.buffers);
  mrow("total", me.device.total(), me.host.total());
  if (me.nvme > 0) o << "  " << pad("nvme", 18) << lpad(in_unit(me.nvme), 10) << "\n";
  const FitCheck fit = check_fit(p, t.headroom);
  const auto verdict = [&](Fit f, double need, double have) {
    const std::string text = fit_text(f, need, have, t.headroom);
    return text.empty() ? text : "  -> " + text;
  };
  if (!t.device_traits().memory_is_host) {
    o << "  device per rank: " << format_bytes(me.device.total())
      << (t.device_memory_bytes > 0 ? verdict(fit.device, fit.device_need, fit.device_have)
                                    : "  (device memory unknown: pass --device-memory to check the fit)")
      << "\n  host RAM per node: " << format_bytes(p.host_bytes_per_node())
      << (t.host_memory_bytes > 0 ? verdict(fit.host, fit.host_need, fit.host_have)
                                  : "  (host memory unknown: pass --host-memory to check the fit)")
      << "\n";
    double pinned = 0;
    for (const ZeroBuffer& b : p.execution.buffers) pinned += b.pinned ? b.bytes() : 0.0;
    if (pinned > 0)
      o << "  page-locked per rank: " << format_bytes(pinned)
        << " of the host's (what the GPU copies to and from; the states the host steps stay pageable; pin_memory)\n";
  } else {
    o << "  host RAM per node: " << format_bytes(p.host_bytes_per_node()) << " (the device is this host)"
      << verdict(fit.host, fit.host_need, fit.host_have) << "\n";
  }
  o << "  counted: parameters, gradients, fp32 master + optimizer moments, activations at micro batch "
    << p.batch.micro_batch << " x " << p.seq_len << " tokens, comm/gather buffers; not counted: allocator slack, "
    << "CUDA context, library workspaces\n";
}

// The ZeRO execution's buffers (what the runtime allocates), transfers and NVMe sub-groups.
void buffers_section(const Plan& p, const std::function<std::string(const std::string&)>& h, std::ostringstream& o) {
  o << "\n" << h("Buffers per rank") << " (the ZeRO execution: what the runtime allocates)\n";
  size_t role_width = 18;
  for (const ZeroBuffer& b : p.execution.buffers) role_width = std::max(role_width, std::strlen(buffer_role_name(b.role)) + 2);
  for (const ZeroBuffer& b : p.execution.buffers) {
    std::string size = format_count(b.elements) + " " + dtype_name(b.dtype);
    if (b.copies > 1) size = std::to_string(b.copies) + " x " + size;
    o << "  " << pad(buffer_role_name(b.role), role_width) << pad(size, 26) << pad(place_name(b.place), 8)
      << lpad(format_bytes(b.bytes()), 11) << (b.transient ? b.role == BufferRole::reduce_cast ? "  (in flight)" : "  (in flight, held by the communicator)" : "")
      << (b.pinned ? "  page-locked" : "") << "\n";
  }
  for (const Transfer& t : p.execution.transfers)
    o << "  moved per step: " << pad(t.what, 30) << pad(std::string(place_name(t.from)) + " -> " + place_name(t.to), 16)
      << lpad(format_bytes(t.bytes_per_step), 11) << "\n";
  if (p.execution.gradient_lag > 0)
    o << "  each block's gradients are queued for the host (block_arrivals, on a copy stream of their own) in the block's hook and\n"
         "  summed there in the hook of the block "
      << p.execution.gradient_lag + 1 << " below (gradient_lag " << p.execution.gradient_lag
      << "): the hooks between do not wait for the copy\n";
  if (p.execution.step_in_forward) {
    const std::vector<int64_t>& hooks = p.execution.weight_tile_hooks;
    const std::vector<int64_t>& speculated = p.execution.weight_tile_final_after;  // (those stepped in the backward instead)
    int64_t later = 0;
    for (size_t i = 0; i < hooks.size(); ++i) later += hooks[i] >= 0 && (speculated.empty() || speculated[i] < 0);
    o << "  the host steps " << later << " of its " << hooks.size()
      << " weight tiles during the next forward, each before the block that reads it (the embeddings' at once"
      << (p.execution.state_spans.size() > 1 ? "; the GPU steps its part of the states at once" : "") << ")\n";
  }
  if (p.execution.step_in_backward) {
    const std::vector<int64_t>& after = p.execution.weight_tile_final_after;
    const auto speculated = std::count_if(after.begin(), after.end(), [](int64_t a) { return a >= 0; });
    // The blocks whose tiles are speculated (those final after them), as runs: "12-20, 24-47".
    std::set<int64_t> blocks(after.begin(), after.end());
    blocks.erase(-1);
    std::string runs;
    for (auto b = blocks.begin(); b != blocks.end();) {
      auto e = b;
      while (std::next(e) != blocks.end() && *std::next(e) == *e + 1) ++e;
      runs += (runs.empty() ? "" : ", ") + std::to_string(*b) + (e != b ? "-" + std::to_string(*e) : "");
      b = std::next(e);
    }
    o << "  speculative step: the host steps " << speculated << " of its " << after.size() << " weight tiles (those final after blocks "
      << runs << ") during the last backward, each once its blocks' gradients\n"
         "  have arrived, as if unclipped; ";
    if (const ZeroBuffer* backup = p.execution.find(BufferRole::step_backup, Place::host))
      o << "a clipped or skipped step restores them from their backup (step_backup, " << format_bytes(backup->bytes())
        << ") and steps them again (a cost the predicted step leaves out)\n";
    else
      o << "nothing can undo a step here (no gradient_clipping, no overflow skip): no backup\n";
  }
  if (!p.execution.step_in_forward && p.execution.kept_within_step) {
    o << "  each step's work is done within it, to be measured alone (ds profile, the flops_profiler block): no gathering\n"
         "  or host step left to the next forward\n";
  }
  if (!p.execution.sub_groups.empty())
    o << "  swapped in " << format_count(static_cast<int64_t>(p.execution.sub_groups.size())) << " sub-groups of up to "
      << format_count(p.execution.sub_group_numel) << " elements, " << p.execution.swap_sets
      << (p.execution.swap_sets == 1 ? " at a time (no pipelining)" : " in flight (read ahead / write behind)") << "\n";
}

void layout_section(const Plan& p, const std::function<std::string(const std::string&)>& h, bool full_layout, std::ostringstream& o) {
  const FlatLayout& L = p.layout;
  o << "\n" << h("Flat parameter layout") << "\n";
  o << "  " << format_count(L.numel) << " elements in " << L.params.size() << " tensors; ";
  if (L.stage == 3)
    o << "each tensor padded to a multiple of " << L.world_size << " and split across ranks; "
      << format_count(L.shard_numel) << " elements per rank\n";
  else if (L.stage == 0)
    o << "replicated on every rank\n";
  else
    o << "padded to " << format_count(L.padded_numel) << " (multiple of " << L.alignment << "); "
      << format_count(L.shard_numel) << " elements per rank\n";
  if (L.stage == 1 || L.stage == 2) {
    const size_t show = full_layout ? L.shards.size() : std::min<size_t>(L.shards.size(), 4);
    for (size_t r = 0; r < show; ++r)
      o << "  rank " << r << ": [" << L.shards[r].begin << ", " << L.shards[r].end << ")  " << format_count(L.shards[r].real)
        << " real, " << format_count(L.shards[r].numel() - L.shards[r].real) << " padding\n";
    if (show < L.shards.size()) o << "  ... " << L.shards.size() - show << " more ranks (--layout lists all)\n";
  }
  if (full_layout) {
    for (const auto& ps : L.params) {
      o << "  " << pad(ps.name, 46) << pad(format_shape(ps.shape), 16) << " offset " << lpad(std::to_string(ps.offset), 12);
      if (L.stage == 3) o << "  partition " << ps.partition_numel << " at " << ps.partition_offset;
      o << "\n";
    }
  }
}

// How ZeRO uses the library's collectives, as the plan decided from its capabilities (comm_capabilities).
std::string collectives_how(const Plan& p) {
  const ZeroExecution& z = p.execution;
  const CommCapabilities caps = comm_capabilities(z.backend);
  std::string how = z.scatter ? (caps.native_reduce_scatter ? "gradients reduce-scattered by the library"
                                                            : "gradients reduce-scattered as point-to-point sends (each rank the elements it owns)")
                              : "gradients all-reduced";
  const bool library_sums = !z.scatter || caps.native_reduce_scatter;  // point-to-point pieces are summed by ds
  if (library_sums && dtype_bytes(z.wire_dtype) < 4)
    how += caps.sums_16bit ? ", 16-bit sums by the library" : ", 16-bit sums through an fp32 copy (the library sums no 16-bit floats)";
  if (z.gathers)
    how += z.gather_staged ? "; gathers packed into equal pieces through staging buffers"
                           : "; gathers land every rank's spans in place (point-to-point)";
  // NCCL's reduce-scatter takes equal pieces in rank order; ZeRO's buckets and groups own uneven spans.
  if (z.scatter && caps.native_reduce_scatter && !caps.gathers_into_spans)
    how += "; a reduce-scatter of uneven spans (ZeRO's buckets and groups) runs as NCCL groups of reduces, each rooted at its span's owner";
  return how;
}

void communication_section(const Plan& p, const std::function<std::string(const std::string&)>& h, std::ostringstream& o) {
  o << "\n" << h("Communication per optimizer step") << "\n";
  // A mesh's tensor all-reduces and pipeline sends (its table's, the heaviest stage's) join the total.
  const MeshTraffic* mesh = p.mesh.shape.splits_the_model() && p.mesh.heaviest_stage >= 0
                                ? &p.mesh.stages[static_cast<size_t>(p.mesh.heaviest_stage)].traffic
                                : nullptr;
  const double mesh_wire = mesh ? mesh->sent_bytes() : 0;
  if (p.execution.collectives.empty()) {
    o << "  none (one rank)\n";
  } else {
    o << "  over " << comm_backend_name(p.execution.backend) << ": " << collectives_how(p) << "\n";
    o << "  " << pad("op", 16) << pad("what", 36) << pad("when", 16) << lpad("calls", 7) << lpad("payload", 13)
      << lpad("wire/rank", 13) << "\n";
    double wire = 0;
    for (const auto& c : p.execution.collectives) {
      o << "  " << pad(collective_op_name(c.op), 16) << pad(c.what(), 36) << pad(cadence_name(c.when), 16)
        << lpad(std::to_string(c.calls_per_step), 7) << lpad(format_bytes(c.payload_bytes_per_step), 13)
        << lpad(format_bytes(c.wire_bytes_per_rank_per_step), 13) << "\n";
      if (!c.note.empty()) o << "  " << pad("", 16) << "(" << c.note << ")\n";
      wire += c.wire_bytes_per_rank_per_step;
    }
    if (mesh_wire > 0)
      o << "  total on the wire per rank per step: " << format_bytes(wire + mesh_wire) << " (ring algorithms; " << format_bytes(wire)
        << " above and the mesh's " << format_bytes(mesh_wire) << ")\n";
    else
      o << "  total on the wire per rank per step: " << format_bytes(wire) << " (ring algorithms)\n";
  }
}

// In the unit its rounded figure reads best in (999.6 us is "1.0 ms", not "1000 us").
std::string seconds_text(double s) {
  return s >= 0.9995 ? format_fixed(s, 2) + " s" : s >= 0.9995e-3 ? format_fixed(s * 1e3, 1) + " ms" : format_fixed(s * 1e6, 0) + " us";
}

// The step's time predicted from the hardware's rates (engine/plan/step_time.hpp), or what the prediction lacks.
void time_section(const Plan& p, const std::function<std::string(const std::string&)>& h, std::ostringstream& o) {
  const StepTime& t = p.step_time;
  o << "\n" << h("Time per optimizer step (predicted)") << "\n";
  if (t.compute_known)
    o << "  compute " << seconds_text(t.compute_s) << (p.activation_checkpointing ? " (the recomputed forward included)" : "") << " at " << t.rate_source
      << (t.bubble_s > 0 ? "; of it the pipeline bubble " + seconds_text(t.bubble_s) : std::string()) << "\n";
  if (t.comm_known && !t.collectives.empty()) {
    size_t what_w = 34, link_w = 28;  // wider where a name is (a link across nodes names its NICs)
    for (const CollectiveTime& c : t.collectives) what_w = std::max(what_w, c.what.size() + 2), link_w = std::max(link_w, c.link.size() + 2);
    o << "  " << pad("collective", what_w) << pad("link", link_w) << pad("overlaps", 10) << lpad("time", 10) << lpad("hidden", 10) << "\n";
    for (const CollectiveTime& c : t.collectives)
      o << "  " << pad(c.what, what_w) << pad(c.link, link_w) << pad(c.phase == StepPhase::between ? "-" : step_phase_name(c.phase), 10)
        << lpad(seconds_text(c.seconds), 10) << lpad(t.compute_known ? seconds_text(c.hidden_s) : "?", 10) << "\n";
    o << "  communication " << seconds_text(t.comm_s);
    if (t.compute_known)
      o << ", " << format_fixed(t.comm_s > 0 ? 100 * t.hidden_s / t.comm_s : 0, 0) << "% hidden behind compute";
    o << "\n";
  } else if (t.comm_known) {
    o << "  communication none (one rank)\n";
  }
  if (!t.offload.empty()) {
    size_t what_w = 34, rate_w = 28;
    for (const OffloadTime& x : t.offload) what_w = std::max(what_w, x.what.size() + 2), rate_w = std::max(rate_w, x.rate.size() + 2);
    o << "  " << pad("offload", what_w) << pad("at", rate_w) << lpad("bytes", 12) << lpad("time", 10) << lpad("hidden", 10) << "\n";
    for (const OffloadTime& x : t.offload)
      o << "  " << pad(x.what, what_w) << pad(x.rate, rate_w) << lpad(format_bytes(x.bytes), 12)
        << lpad(x.known ? seconds_text(x.seconds) : "?", 10) << lpad(x.known ? seconds_text(x.hidden_s) : "?", 10) << "\n";
    // What compute hides of it: the gradients' trip behind the backward (one rank, overlap_comm), stage 3's parameters
    // crossing a block ahead (one rank), the tiles' step behind the next forward (step_in_forward).
    const auto hidden = [&](std::initializer_list<const char*> what) {
      return std::any_of(t.offload.begin(), t.offload.end(), [&](const OffloadTime& x) {
        return x.hidden_s > 0 && std::any_of(what.begin(), what.end(), [&](const char* w) { return x.what == w; });
      });
    };
    std::string hides;
    if (hidden({"gradients to the host", "gradients summed on the host"}))
      hides = "the backward hides the blocks' gradients on their way to the host and their sum there";
    if (hidden({"parameters to the device"}))
      hides += (hides.empty() ? "" : "; ") + std::string("each block's parameters cross while the block before it runs");
    if (p.execution.step_in_forward)
      hides += (hides.empty() ? "" : "; ") + std::string("the next forward's blocks hide only the tiles stepped during it: their host step and copies");
    if (p.execution.step_in_backward)
      hides += (hides.empty() ? "" : "; ") + std::string("the last backward's blocks hide the speculated tiles' backup and host step");
    // (where the host memory's busy time sets the step, the offload adds to the parts' sum, which the step outlasts)
    if (t.offload_known())
      o << "  offload " << seconds_text(t.offload_s - t.offload_hidden_s)
        << (t.step_known() && t.host_memory_floored() ? " added to the parts" : " added to the step")
        << (hides.empty() ? " (it follows the backward: no compute hides it)" : " (" + hides + ")") << "\n";
    if (!p.execution.overlap && gradients_can_leave_during_backward(p))
      o << "  zero_optimization.overlap_comm=true would hide the blocks' gradients on their way to the host behind the backward\n";
  }
  const bool floored = t.step_known() && t.host_memory_floored();  // (then the parts add up to less than the step: no split)
  if (floored)
    o << "  host memory busy " << seconds_text(t.host_memory_busy_s) << " a step (its rows above in full, and the "
      << format_bytes(t.host_memory_copied_bytes) << " the copies read or write there): longer than the "
      << seconds_text(t.parts_s()) << " the parts add up to, so the step takes that\n";
  if (t.step_known()) {
    const double step = t.step_s();
    // Where the step's time goes, beside its bound: the step is compute, the exposed collectives and each offload
    // resource's exposed time, one after the other (a compute-bound step may still be half offload).
    std::vector<std::pair<std::string, double>> parts{{"compute", t.compute_s}, {"communication", t.exposed_s()}};
    for (OffloadResource r : {OffloadResource::host_link, OffloadResource::host_memory, OffloadResource::nvme})
      parts.emplace_back(offload_resource_name(r), t.offload_seconds(r));
    std::string split;
    int shown = 0;
    for (const auto& [what, seconds] : parts)
      if (const long percent = std::lround(100 * seconds / step); percent >= 1 && !floored)
        split += (shown++ ? ", " : " (") + what + " " + std::to_string(percent) + "%";
    o << "  step " << seconds_text(step) << ": " << t.bound() << (shown > 1 ? split + " of it)" : "") << "; "
      << format_count(static_cast<int64_t>(p.tokens_per_step / step))
      << " tokens/s over " << p.topology.world_size << (p.topology.world_size == 1 ? " rank" : " ranks") << ", MFU "
      << format_fixed(t.mfu(p.train_flops_per_step / p.topology.world_size), 2)
      << (p.activation_checkpointing ? " (model FLOPs: the recomputed forward is not counted)" : "") << "\n";
  }
  for (const std::string& m : t.missing) o << "  not predicted without " << m << "\n";
  o << "  a prediction from rates, not a measurement: ds profile measures the step\n";
}

}  // namespace

std::string render_plan_text(const Plan& p, bool color, bool full_layout) {
  auto h = [&](const std::string& s) { return color ? "\033[1m" + s + "\033[0m" : s; };
  if (!p.has_model) return render_settings_only(p, h);
  std::ostringstream o;
  summary_rows(p, h, o);
  mesh_section(p, h, o);
  memory_section(p, h, o);
  buffers_section(p, h, o);
  layout_section(p, h, full_layout, o);
  communication_section(p, h, o);
  time_section(p, h, o);
  o << decided_and_warnings(p, h);
  return o.str();
}

}  // namespace ds::cli
