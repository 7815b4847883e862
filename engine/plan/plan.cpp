#include "engine/plan/plan.hpp"

#include "engine/plan/fit.hpp"
#include "engine/plan/packing.hpp"
#include "engine/plan/plan_steps.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "common/error.hpp"
#include "common/format.hpp"
#include "common/strings.hpp"

namespace ds {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

// A key the user set, in the file or on the command line (not the schema's default, nor a value init_from filled).
bool user_gave(const Config& c, const std::string& path) {
  const auto it = c.value_source.find(path);
  return it != c.value_source.end() && (it->second == "file" || it->second == "override");
}

PrecisionPolicy resolve_precision(const Config& c, const Topology& topo) {
  PrecisionPolicy p;
  const bool fp16 = c.fp16.enabled.value_or(false), bf16 = c.bf16.enabled.value_or(false);
  DS_CHECK(!(fp16 && bf16), "the loader rejects fp16 and bf16 together");
  if (bf16) {
    p.mode = "bf16";
    p.param_dtype = p.compute_dtype = Dtype::bf16;
    p.fp32_master = true;
    p.check_overflow = c.bf16.check_grad_overflow;
    p.overflow_is_fatal = false;
  } else if (fp16) {
    p.mode = "fp16";
    p.overflow_is_fatal = false;
    p.param_dtype = Dtype::fp16;
    p.fp32_master = true;
    p.check_overflow = true;
    if (!topo.device_traits().computes_fp16) {
      p.compute_dtype = Dtype::fp32;
      p.note = "fp16 on CPU: parameters and gradients are stored in fp16 (so overflow and loss scaling are real) "
               "but matmuls run in fp32, because LibTorch has no fp16 CPU kernels; bf16 is the fast CPU choice";
    } else {
      p.compute_dtype = Dtype::fp16;
    }
    auto& ls = p.loss_scaling;
    ls.enabled = true;
    ls.dynamic = c.fp16.loss_scale == 0;
    ls.initial_scale = ls.dynamic ? std::ldexp(1.0, c.fp16.initial_scale_power) : c.fp16.loss_scale;
    ls.window = c.fp16.loss_scale_window;
    ls.hysteresis = c.fp16.hysteresis;
    ls.consecutive_hysteresis = c.fp16.consecutive_hysteresis;
    ls.min_scale = c.fp16.min_loss_scale;
  } else {
    p.mode = "fp32";
  }
  p.grad_dtype = c.grad_accum_dtype.value_or(p.param_dtype);
  p.comm_dtype = c.communication_data_type;
  return p;
}

ResolvedOptimizer resolve_optimizer(const Config& c, std::vector<ResolvedValue>& resolved) {
  const OptimizerConfig& o = c.optimizer;
  ResolvedOptimizer r;
  r.type = o.type;
  DS_CHECK(o.lr && o.eps && o.weight_decay && o.betas, "the loader fills optimizer defaults");
  r.lr = *o.lr;
  r.eps = *o.eps;
  r.weight_decay = *o.weight_decay;
  r.decay_all_params = c.train.decay_all_params;
  r.betas = *o.betas;
  r.bias_correction = o.bias_correction;
  r.momentum = o.momentum;
  r.dampening = o.dampening;
  r.nesterov = o.nesterov;
  r.eps_inside_sqrt = o.eps_inside_sqrt;
  r.max_coeff = o.max_coeff;
  r.min_coeff = o.min_coeff;
  switch (o.type) {
    case OptimizerType::Adam:  // DeepSpeed: "Adam" is AdamW unless adam_w_mode is false
      r.decoupled_weight_decay = o.adam_w_mode;
      r.moments = 2;
      break;
    case OptimizerType::AdamW: r.decoupled_weight_decay = true; r.moments = 2; break;
    case OptimizerType::Lamb: r.decoupled_weight_decay = true; r.moments = 2; break;
    case OptimizerType::SGD: r.decoupled_weight_decay = false; r.moments = o.momentum > 0 ? 1 : 0; break;
  }
  if (!o.given)
    resolved.push_back({"optimizer", std::string(optimizer_type_name(r.type)) + " lr " + format_double(r.lr),
                        "default: the config has no optimizer block"});
  return r;
}

ResolvedScheduler resolve_scheduler(const Config& c, double lr, int64_t steps, std::vector<ResolvedValue>& resolved,
                                    std::vector<ConfigIssue>& warnings) {
  ResolvedScheduler r;
  r.type = c.scheduler.type;
  r.params = c.scheduler;
  if (r.type == SchedulerType::None) return r;
  auto& p = r.params;
  if (!p.warmup_min_lr) p.warmup_min_lr = 0.0;
  const bool uses_max_lr = r.type == SchedulerType::WarmupLR || r.type == SchedulerType::WarmupDecayLR;
  if (!p.warmup_max_lr && uses_max_lr) {
    p.warmup_max_lr = lr;
    resolved.push_back({"scheduler.params.warmup_max_lr", format_double(lr), "the optimizer's lr"});
  }
  if (!p.total_num_steps && (r.type == SchedulerType::WarmupDecayLR || r.type == SchedulerType::WarmupCosineLR)) {
    p.total_num_steps = steps;
    resolved.push_back({"scheduler.params.total_num_steps", str(steps), "train.steps"});
  }
  const bool warms_up = r.type == SchedulerType::WarmupLR || r.type == SchedulerType::WarmupDecayLR || r.type == SchedulerType::WarmupCosineLR;
  if (!p.warmup_num_steps && warms_up) {  // OneCycle and LRRangeTest have no warmup of this kind
    p.warmup_num_steps = std::max<int64_t>(1, steps / 10);
    resolved.push_back({"scheduler.params.warmup_num_steps", str(*p.warmup_num_steps), "auto: train.steps / 10"});
  }
  if (r.type == SchedulerType::OneCycle) {
    if (!p.cycle_second_step_size) p.cycle_second_step_size = p.cycle_first_step_size;
    if (!p.cycle_first_stair_count) p.cycle_first_stair_count = 0;
    if (!p.cycle_second_stair_count) p.cycle_second_stair_count = p.cycle_first_stair_count;
  }
  if (p.total_num_steps && p.warmup_num_steps && *p.total_num_steps < *p.warmup_num_steps)
    warnings.push_back({"scheduler.params.total_num_steps",
                        "total_num_steps " + str(*p.total_num_steps) + " is shorter than warmup_num_steps " +
                            str(*p.warmup_num_steps) + ": the schedule never leaves warmup",
                        ""});
  return r;
}

void check_zero(const Config& c, const ResolvedOptimizer& optimizer, int stage, std::vector<ConfigIssue>& errors,
                std::vector<ConfigIssue>& warnings,
                ResolvedZero& z) {
  if (z.offload_param.device != OffloadDevice::none && stage != 3)
    errors.push_back({"zero_optimization.offload_param.device",
                      "parameter offload needs ZeRO stage 3, but the stage is " + std::to_string(stage),
                      "set zero_optimization.stage=3, or remove offload_param"});
  if (z.offload_optimizer.device != OffloadDevice::none && stage == 0)
    errors.push_back({"zero_optimization.offload_optimizer.device",
                      "optimizer offload needs ZeRO stage 1 or higher, but the stage is 0",
                      "set zero_optimization.stage=2 (the usual ZeRO-Offload setting)"});
  // NVMe optimizer offload swaps the rank's local optimizer part, which every stage from 1 on has: ds
  // accepts it at stages 1-2 as well (DeepSpeed turns it into CPU offload there).
  if (z.offload_optimizer.device == OffloadDevice::nvme) {
    if (optimizer.per_tensor_update())
      errors.push_back({"zero_optimization.offload_optimizer.device",
                        "Lamb cannot swap its states to NVMe: its trust ratio needs every tensor's norms before any "
                        "update, a second pass over the swapped states",
                        "offload to \"cpu\", or use Adam/AdamW"});
    // A sub-group needs a buffer for the fp32 master, one for its gradients and one per moment.
    const int64_t moments = optimizer.moments;
    const int64_t per_set = 2 + moments;
    const int64_t wanted = 1 + (z.offload_optimizer.pipeline_read ? 1 : 0) + (z.offload_optimizer.pipeline_write ? 1 : 0);
    const int64_t count = z.offload_optimizer.buffer_count;
    if (count < per_set) {
      errors.push_back({"zero_optimization.offload_optimizer.buffer_count",
                        "buffer_count " + std::to_string(count) + " is below the " + std::to_string(per_set) +
                            " buffers one sub-group needs (fp32 master, gradients and " + std::to_string(moments) +
                            (moments == 1 ? " moment)" : " moments)"),
                        "set buffer_count to at least " + std::to_string(per_set)});
    } else {
      z.swap_sets = static_cast<int>(std::min(wanted, count / per_set));
      if (z.swap_sets < wanted)
        warnings.push_back({"zero_optimization.offload_optimizer.buffer_count",
                            "pipelining NVMe swaps needs " + std::to_string(wanted * per_set) + " buffers (" +
                                std::to_string(per_set) + " per sub-group, " + std::to_string(wanted) +
                                " sub-groups in flight); buffer_count " + std::to_string(count) + " allows " +
                                std::to_string(z.swap_sets),
                            "set buffer_count to " + std::to_string(wanted * per_set)});
    }
  }
  if (z.offload_optimizer.ratio < 1.0 && z.offload_optimizer.device != OffloadDevice::none && stage != 3)
    errors.push_back({"zero_optimization.offload_optimizer.ratio", "partial offloading (ratio < 1) needs ZeRO stage 3",
                      "set ratio to 1.0 or the stage to 3"});
  if (z.offload_optimizer.ratio < 1.0 && z.offload_optimizer.device != OffloadDevice::none && optimizer.per_tensor_update())
    errors.push_back({"zero_optimization.offload_optimizer.ratio",
                      "Lamb cannot split its states between two places: its trust ratio is taken over whole tensors",
                      "set ratio to 1.0, or use Adam/AdamW"});
}

void resolve_threads(const Config& c, const Topology& topo, Plan& plan) {
  if (c.train.threads) {
    plan.threads = static_cast<int>(*c.train.threads);
  } else {
    plan.threads = std::max(1, topo.cores_per_node / std::max(1, topo.ranks_per_node));
    plan.resolved.push_back({"train.threads", std::to_string(plan.threads),
                             "auto: " + std::to_string(topo.cores_per_node) + " usable cores / " +
                                 std::to_string(topo.ranks_per_node) + (topo.ranks_per_node == 1 ? " rank" : " ranks") + " per node"});
  }
}

// Where the model states live, read off the ZeRO execution's buffers (the ones the runtime allocates):
// the farthest place any of a state's buffers is at (partial offload keeps a share on the device too).
Placement render_placement(const ZeroExecution& z, int stage, DeviceKind device) {
  const std::string dev = std::string("device (") + device_kind_name(device) + ")";
  const auto where = [&](std::initializer_list<BufferRole> roles) -> std::string {
    for (Place p : {Place::nvme, Place::host})
      for (BufferRole r : roles)
        if (z.find(r, p)) return p == Place::nvme ? "nvme" : "cpu";
    return dev;
  };
  Placement p;
  p.params = where({BufferRole::params}) + (stage >= 3 ? ", partitioned" : "");
  p.grads = where({BufferRole::grads, BufferRole::offload_grads}) + (stage >= 2 ? ", partitioned" : "");
  p.optimizer_states = where({BufferRole::master, BufferRole::exp_avg, BufferRole::exp_avg_sq}) + (stage >= 1 ? ", partitioned" : "");
  return p;
}

// "auto" values the loader replaced by their defaults (optimizer lr, betas, gradient_clipping, ...):
// listed with the rest of what ds decided.
void list_default_autos(const Config& c, std::vector<ResolvedValue>& resolved) {
  for (const auto& [path, value] : c.auto_defaults) resolved.push_back({path, value, "auto: DeepSpeed's default"});
}

// Activation checkpointing: model.activation_checkpointing (each block recomputed), or DeepSpeed's pipeline key
// pipeline.activation_checkpoint_interval (blocks recomputed in groups of that many), which decides alone where
// it is above 0, as it does in DeepSpeed's pipeline module.
void resolve_checkpointing(const Config& c, Plan& plan) {
  plan.activation_checkpointing = c.model.activation_checkpointing;
  const int64_t n = c.parallel.checkpoint_interval;
  if (n <= 0) return;
  plan.activation_checkpointing = true;
  plan.recompute_group = n;
  plan.resolved.push_back({"model.activation_checkpointing", "true",
                           "pipeline.activation_checkpoint_interval " + std::to_string(n) +
                               (n == 1 ? ": each block recomputed in its backward" : ": the blocks recomputed " + std::to_string(n) + " at a time")});
}

// pipeline.activation_checkpoint_interval at or past the blocks a rank runs backward through: one group holds them
// all, recomputed at once, which keeps more than recomputing each block (said, as the key still acts).
void note_recompute_groups(Plan& plan) {
  if (!plan.activation_checkpointing || plan.recompute_group <= 1) return;
  int64_t most = 0;  // the most blocks one rank runs backward through
  for (const PipelineStage& st : plan.mesh.stages)
    most = std::max<int64_t>(most, st.blocks - std::clamp<int64_t>(plan.backward_from - st.first_block, 0, st.blocks));
  if (plan.mesh.stages.empty()) most = plan.model.hp.num_layers - plan.backward_from;
  if (plan.recompute_group < most) return;
  plan.warnings.push_back({"pipeline.activation_checkpoint_interval",
                           std::to_string(plan.recompute_group) + " blocks a group, where a rank runs backward through " + std::to_string(most) +
                               ": they are all recomputed at once, keeping more than recomputing each block does",
                           most > 1 ? "an interval below " + std::to_string(most) + " (1: each block)" : std::string("1, or 0 with model.activation_checkpointing")});
}

// Where the step's gradients are summed in a dtype other than the one asked for changes nothing, and where ds's
// default differs from DeepSpeed's: DeepSpeed sums bf16 gradients in fp32 at ZeRO stage 0 even unasked.
void note_gradient_sums(const Config& c, Plan& plan) {
  const PrecisionPolicy& pp = plan.precision;
  const bool sums = plan.batch.grad_accum > 1 || plan.topology.world_size > 1;  // micro-batches, or ranks' parts
  if (c.grad_accum_dtype && plan.execution.micro_grads && !sums)
    plan.warnings.push_back({"data_types.grad_accum_dtype",
                             std::string(dtype_name(pp.grad_dtype)) + " changes nothing here: one micro-batch a step on one rank sums no "
                                 "gradients (the run is plain " + dtype_name(pp.param_dtype) + "'s, holding 4 bytes more a parameter)",
                             "remove it, or accumulate (gradient_accumulation_steps > 1)"});
  if (!c.grad_accum_dtype && pp.param_dtype == Dtype::bf16 && plan.zero_stage() == 0 && sums)
    plan.resolved.push_back({"data_types.grad_accum_dtype", "bf16",
                             "default: the weights' dtype; DeepSpeed sums bf16 gradients in fp32 at ZeRO stage 0: fp32 gives its numbers "
                             "(4 bytes more a parameter)"});
}

// communication_data_type acts wherever data-parallel gradients cross ranks (ZeroExecution::wire_dtype); said where
// it cannot act, where it rounds without sending fewer bytes, where it sends more for sums Gloo already does in fp32,
// and where fp16's range meets gradients no loss scale keeps in it.
void note_communication_dtype(Plan& plan) {
  const std::optional<Dtype> asked = plan.precision.comm_dtype;
  const ZeroExecution& z = plan.execution;
  if (!asked) return;
  const std::string name = dtype_name(*asked), held = dtype_name(z.reduced_dtype);
  const auto warn = [&](const std::string& what, const std::string& hint) { plan.warnings.push_back({"communication_data_type", what, hint}); };
  if (z.world_size <= 1) {
    if (*asked != z.reduced_dtype) warn("has no effect: one data-parallel rank sends no gradients to sum", "remove it, or train on several ranks");
    return;
  }
  if (z.wire_dtype == z.reduced_dtype) return;
  const int wire_bytes = dtype_bytes(z.wire_dtype), held_bytes = dtype_bytes(z.reduced_dtype);
  const bool gloo_widens = !comm_capabilities(z.backend).sums_16bit;  // Gloo: 16-bit floats summed in fp32, rounded once
  // One warning at most, the gravest first.
  if (z.wire_dtype == Dtype::fp16 && !plan.precision.loss_scaling.enabled)
    warn("fp16 holds nothing above 65504: a sum beyond it becomes inf even where each rank's part fits, and no loss scale keeps this "
         "run's gradients in range (inf gradients " + std::string(plan.precision.overflow_is_fatal ? "end this run" : "skip or spoil the step") + ")",
         "bf16 (fp32's range in half the bytes), or fp16.enabled");
  else if (wire_bytes < held_bytes && gloo_widens && !z.scatter)
    warn("rounds the gradients to " + name + " but sends no fewer bytes: Gloo's all-reduce sums 16-bit floats through fp32 copies",
         "remove it, or ZeRO stage 2-3 with reduce_scatter (their pieces go point to point, in " + name + ")");
  else if (wire_bytes > held_bytes && gloo_widens)
    warn("changes no sum: Gloo adds " + held + " gradients in fp32 and rounds once already" +
             (z.scatter ? std::string(", and this sends twice their bytes") : std::string()),
         "remove it (on GPU ranks NCCL sums 16-bit floats in their own dtype, where fp32 does change the sums)");
  else if (wire_bytes == held_bytes)  // (bf16 over fp16: an fp16 wire over bf16 is the range warning above)
    warn("sends as many bytes as " + held + " and rounds the gradients to " + name + "'s shorter mantissa",
         "remove it, or fp32 to sum them without rounding at every hop");
}

// What the config decides without a model: the run's cadence and data, precision, optimizer, schedule,
// clipping, and the "auto"s that mean a default.
Plan plan_from_settings(const Config& c, const Topology& topo) {
  Plan plan;
  plan.config_source = c.source;
  plan.topology = topo;
  plan.warnings = c.warnings;
  plan.steps = c.train.steps;
  plan.data = c.data;
  plan.run.output_dir = c.train.output_dir;
  plan.run.seed = static_cast<uint64_t>(c.train.seed);
  plan.run.save_every = c.train.save_every;
  plan.run.keep_last = c.train.keep_last;
  plan.run.divergence_factor = c.train.divergence_factor;
  plan.run.eval_every = c.train.eval_every;
  plan.run.eval_batches = c.train.eval_batches;
  plan.run.comm_timeout_s = c.train.comm_timeout_s;
  plan.run.comms_logger = c.comms_logger_enabled;
  plan.run.wall_clock_breakdown = c.wall_clock_breakdown;
  plan.run.flops_profiler = c.flops_profiler;
  plan.run.steps_measured_alone = c.steps_measured_alone || c.flops_profiler.enabled;
  plan.run.csv_monitor = c.csv_monitor;
  plan.run.tensorboard = c.tensorboard;
  plan.run.init_from = c.model.init_from;
  plan.gradient_sum_over_ranks = c.gradient_allreduce_sum;
  resolve_checkpointing(c, plan);
  list_default_autos(c, plan.resolved);
  plan.precision = resolve_precision(c, topo);
  if (topo.world_size > 1 && topo.comm_backend() == CommBackend::nccl && topo.build && !topo.build->nccl.empty())
    plan.warnings.push_back({"world size", "several GPU ranks over NCCL " + topo.build->nccl +
                                               ": ds's own checks have run its NCCL communicator on one GPU only (the one kind of machine "
                                               "lent to them) and ZeRO's collectives in NCCL's terms on CPU ranks" +
                                               (c.parallel.tensor > 1 || c.parallel.pipeline > 1
                                                    ? std::string("; a split model's groups and a pipeline's messages have run between "
                                                                  "thread ranks on the CPU, never over NCCL")
                                                    : std::string()) +
                                               "; a run across GPUs is new",
                             "compare its first steps with a one-GPU run of the same global batch; --device cpu runs the ranks over Gloo"});
  // fp16 and offload from one GPU have run on one (session 66's H200: the fp16 kernels and an fp16 run with its
  // overflow skips, the offloaded runs' losses and bytes against the CPU's, the offloaded step's speed as planned):
  // not warned of. What has not: offload from several GPU ranks, and the parameters on NVMe from a GPU.
  if (!topo.device_traits().memory_is_host && topo.world_size > 1 &&
      (c.zero.offload_optimizer.device != OffloadDevice::none || c.zero.offload_param.device != OffloadDevice::none))
    plan.warnings.push_back({c.zero.offload_optimizer.device != OffloadDevice::none ? "zero_optimization.offload_optimizer"
                                                                                     : "zero_optimization.offload_param",
                             "offload from several GPU ranks is new: ds's own checks have run offload from one GPU and from "
                             "several ranks on the CPU, not from several GPUs",
                             "compare its first steps with the same run without offload (a smaller model), or on one GPU"});
  else if (!topo.device_traits().memory_is_host && c.zero.offload_param.device == OffloadDevice::nvme)
    plan.warnings.push_back({"zero_optimization.offload_param.device",
                             "the parameters on NVMe from a GPU are new: ds's own checks have run them from the CPU, and the "
                             "optimizer's states on NVMe from a GPU, not the parameters",
                             "compare its first steps with offload_param.device=cpu where the host's memory holds them"});
  // pin_memory page-locks what a GPU copies to and from; on the CPU nothing crosses.
  for (const auto& [path, block] : {std::pair<const char*, const OffloadConfig*>{"zero_optimization.offload_optimizer.pin_memory", &c.zero.offload_optimizer},
                                    {"zero_optimization.offload_param.pin_memory", &c.zero.offload_param}})
    if (topo.device_traits().memory_is_host && block->device != OffloadDevice::none && !block->pin_memory)
      plan.warnings.push_back({path, "has no effect on a CPU run: page-locked memory speeds copies between a GPU and its host, and "
                                     "here host and device are one memory",
                               "remove it; on a GPU, false keeps the offload's copied buffers pageable (slower copies)"});
  plan.optimizer = resolve_optimizer(c, plan.resolved);
  // DeepSpeed takes the optimizer from the training script when its config names none (no block, or one without a
  // type); ds has no script, and a fine-tuning run at the default's lr would silently train at another rate.
  if (!user_gave(c, "optimizer.type")) {
    const std::string lr = user_gave(c, "optimizer.params.lr") ? std::string() : " lr " + format_double(plan.optimizer.lr) + " (where no scheduler sets the rate)";
    plan.warnings.push_back({"optimizer", std::string(c.optimizer.given ? "the optimizer block names no type" : "the config has no optimizer block") +
                                              ": ds trains with its default, " + optimizer_type_name(plan.optimizer.type) + lr +
                                              "; a DeepSpeed config that names none takes the optimizer from the training script",
                             "write the script's optimizer here: \"optimizer\": {\"type\": ..., \"params\": {\"lr\": ...}}"});
  }
  plan.scheduler = resolve_scheduler(c, plan.optimizer.lr, c.train.steps, plan.resolved, plan.warnings);
  DS_CHECK(c.gradient_clipping.has_value(), "the loader fills gradient_clipping");
  plan.gradient_clipping = *c.gradient_clipping;
  return plan;
}

}  // namespace

double Plan::train_flops_per_token() const { return ds::train_flops_per_token(model, frozen, lora, seq_len); }

double Plan::train_flops_of_step(int64_t counted_targets, int64_t attention_squares) const {
  double flops = train_flops_per_step;
  if (counted_targets >= 0) {
    const double skipped_rows = static_cast<double>(tokens_per_step) - static_cast<double>(counted_targets);
    flops -= skipped_rows * head_train_flops_per_token(model, frozen);
  }
  if (attention_squares >= 0 && seq_len > 0) {  // attention_train_flops_per_token(T) is linear in T: per T^2, its / T
    const double whole_rows = static_cast<double>(tokens_per_step) * static_cast<double>(seq_len);
    flops -= (whole_rows - static_cast<double>(attention_squares)) * ds::attention_train_flops_per_token(model, backward_from, seq_len) /
             static_cast<double>(seq_len);
  }
  return flops;
}

int64_t StageShare::frozen_numel() const {
  int64_t n = 0;
  for (size_t i = 0; i < model.tensors.size(); ++i)
    if (is_frozen(i)) n += model.tensors[i].numel;
  return n;
}

int64_t Plan::frozen_numel() const {
  int64_t n = 0;
  for (size_t i = 0; i < frozen.size(); ++i)
    if (frozen[i]) n += model.tensors[i].numel;
  return n;
}

double Plan::host_bytes_per_node() const {
  const bool device_is_host = topology.device_traits().memory_is_host;
  const auto of = [&](const MemoryEstimate& m) { return m.host.total() + (device_is_host ? m.device.total() : 0.0); };
  if (mesh.shape.pipeline <= 1 || mesh.heaviest_stage < 0) return of(memory) * topology.ranks_per_node;
  // Pipeline stages hold different parts: a node's host memory is its own ranks' stages', the most of any node's.
  const int per_node = std::max(1, topology.ranks_per_node), world = mesh.shape.world();
  double most = 0;
  for (int first = 0; first < world; first += per_node) {
    double node = 0;
    for (int r = first; r < std::min(world, first + per_node); ++r)
      node += of(mesh.stages[static_cast<size_t>(mesh_coord(mesh.shape, r).pipeline)].memory);
    most = std::max(most, node);
  }
  return most;
}

// Packed rows (data.packing): each sample's attention output, kept by the attention for its backward, is a
// tensor of its own beside the rows' joined one the output projection keeps: NH x D more per token in each
// block kept (`blocks`). Rotary models also keep, once, the fp32 cos and sin tables gathered at every
// position's place in its sample: D/2 of each per token.
double packed_row_bytes(const Plan& plan, int64_t micro_batch, double blocks) {
  if (!plan.data.packing || plan.data.type != DataType::jsonl) return 0;
  const ModelHyper& hp = plan.model.hp;
  const double tokens = static_cast<double>(micro_batch * plan.seq_len), D = static_cast<double>(hp.head_dim());
  const double tables = hp.traits().positions == Positions::rotary ? tokens * D * 4 : 0;
  return blocks * tokens * static_cast<double>(hp.num_heads) * D * dtype_bytes(plan.precision.compute_dtype) + tables;
}

// The layout, ZeRO execution and memory of a plan whose other decisions are made. `in_flight`: the micro-batches
// whose activations a rank holds at once (a pipeline stage's, under 1F1B; else 1).
void lay_out(Plan& plan, int stage, int in_flight) {
  plan.layout = build_layout(plan.trained(), stage, plan.topology.world_size);
  plan.execution = describe_zero(plan);
  const Dtype compute = plan.precision.compute_dtype;
  const int64_t recompute_group = plan.activation_checkpointing ? plan.recompute_group : 0;
  const ActivationParts parts =
      activation_parts(plan.model, plan.batch.micro_batch, plan.seq_len, compute, recompute_group, plan.threads, plan.backward_from,
                       plan.topology.device_traits().attention_by_library,
                       plan.topology.device_traits().memory_is_host && plan.topology.cpu_widens_bf16_products);
  double activations = in_flight * parts.kept + parts.workspace;
  // The adapters' own: every adapted block's, or with activation checkpointing one recomputed group's.
  activations += static_cast<double>(plan.batch.micro_batch * plan.seq_len) *
                 lora_activation_bytes_per_token(plan.lora, dtype_bytes(compute), recompute_group);
  const int64_t with_backward = plan.model.hp.num_layers - plan.backward_from;
  const double blocks = static_cast<double>(recompute_group > 0 ? std::min(recompute_group, with_backward) : with_backward);
  activations += packed_row_bytes(plan, plan.batch.micro_batch, blocks);
  plan.memory = estimate_memory(plan.execution, activations);
}

// The schedule resolved again, for the plan's steps now and `after`'s scheduler lengths: what its resolution
// for `before` and `steps_before` resolved and warned goes (only that: the loader's warnings stay).
void resolve_schedule_again(const Config& before, int64_t steps_before, const Config& after, Plan& plan) {
  std::vector<ResolvedValue> old_resolved;
  std::vector<ConfigIssue> old_warnings;
  resolve_scheduler(before, plan.optimizer.lr, steps_before, old_resolved, old_warnings);
  for (const ResolvedValue& o : old_resolved) {
    const auto it = std::find_if(plan.resolved.begin(), plan.resolved.end(),
                                 [&](const ResolvedValue& v) { return v.path == o.path && v.value == o.value && v.source == o.source; });
    if (it != plan.resolved.end()) plan.resolved.erase(it);
  }
  for (const ConfigIssue& o : old_warnings) {
    const auto it = std::find_if(plan.warnings.begin(), plan.warnings.end(),
                                 [&](const ConfigIssue& w) { return w.path == o.path && w.message == o.message; });
    if (it != plan.warnings.end()) plan.warnings.erase(it);
  }
  plan.scheduler = resolve_scheduler(after, plan.optimizer.lr, plan.steps, plan.resolved, plan.warnings);
}

// train.epochs: the steps that see the training split's tokens that many times, once the batch is known;
// the schedule's lengths that follow train.steps are resolved again for them.
void steps_from_epochs(const Config& c, Plan& plan) {
  const auto src = c.value_source.find("train.steps");
  if (src != c.value_source.end() && (src->second == "file" || src->second == "override"))
    throw ConfigError(c.source, {{"train.epochs", "both train.steps and train.epochs are given", "give one: epochs count steps from the data's size"}});
  const bool rows = c.data.type == DataType::jsonl;  // one sample a row: an epoch is the split's samples
  const std::optional<int64_t>& measured = rows ? c.data.measured_samples : c.data.measured_tokens;
  if (!measured)
    throw ConfigError(c.source, {{"train.epochs", "needs the data's size, which was not read (data.path '" + c.data.path + "')",
                                  "plan where the data is, or give train.steps"}});
  const int64_t n = *measured;
  int64_t split = n - static_cast<int64_t>(static_cast<double>(n) * c.data.val_fraction);  // the sampler's split
  const bool packed = rows && c.data.packing;  // an epoch is the rows its training samples are packed into
  if (packed) {
    DS_CHECK(static_cast<int64_t>(c.data.measured_sample_tokens.size()) == n, "packing needs each sample's length");
    const auto begin = c.data.measured_sample_tokens.begin();
    split = static_cast<int64_t>(pack_samples(std::vector<int64_t>(begin, begin + split), plan.seq_len).size());
  }
  const int64_t per_step = rows ? plan.batch.train_batch_size : plan.tokens_per_step;
  if (split <= 0)
    throw ConfigError(c.source, {{"train.epochs", std::string("the training split holds no ") + (rows ? "samples" : "tokens") +
                                                      " (data.path '" + c.data.path + "')",
                                  "give data with something to train on"}});
  const double exact = *c.train.epochs * static_cast<double>(split) / static_cast<double>(per_step);
  const int64_t steps_before = plan.steps;
  plan.steps = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(exact - 1e-9)));
  resolve_schedule_again(c, steps_before, c, plan);
  plan.resolved.push_back({"train.steps", str(plan.steps),
                           "train.epochs " + format_double(*c.train.epochs) + " x " + format_count(split) +
                               (packed ? " packed training rows / " : rows ? " training samples / " : " training tokens / ") +
                               format_count(per_step) + (packed ? " rows per step" : rows ? " samples per step" : " tokens per step")});
}

// A value the user gave as a number, in the file or on the command line ("auto" leaves it open; a default too).
bool given_number(const Config& c, const std::string& path, bool has_value) { return has_value && user_gave(c, path); }

// A resumed run at another world size keeps its checkpoint's global batch, the accumulation scaled so that
// micro x accumulation x world is that batch, unless the batch is the user's choice for this run
// (train_batch_size given, or the micro batch or accumulation set on the command line: then it changes, said).
void keep_checkpoint_batch(const Config& c, const ResumedFrom& r, BatchInputs& bi, Plan& plan) {
  const ResolvedBatch& b = plan.batch;
  const int64_t was = r.train_batch_size;
  if (was <= 0 || was == b.train_batch_size) return;  // a record without its batch, or nothing changed
  // At the same world size the batch changed because the config did (the user's edit: it acts, and is said
  // as a config change) or because "auto" chose another micro batch (kept, as at another world size).
  const bool same_world = r.world_size == b.world_size;
  if (same_world && !c.micro_batch_auto) return;
  const auto on_command_line = [&](const char* key) {
    const auto it = c.value_source.find(key);
    return it != c.value_source.end() && it->second == "override";
  };
  const std::string change = "the global batch would change from " + str(was) + " (the checkpoint's, " + str(r.world_size) +
                             (r.world_size == 1 ? " rank" : " ranks") + ") to " + str(b.train_batch_size) + " (" +
                             std::to_string(b.world_size) + (b.world_size == 1 ? " rank" : " ranks") + ")";
  // Given means a number ("auto" leaves it open): train_batch_size anywhere, the others on the command line.
  if (given_number(c, "train_batch_size", c.train_batch_size.has_value()) ||
      (c.gradient_accumulation_steps && on_command_line("gradient_accumulation_steps")) ||
      (c.train_micro_batch_size_per_gpu && on_command_line("train_micro_batch_size_per_gpu"))) {
    plan.warnings.push_back({"", change + ": the batch is set for this run, so it does", ""});
    return;
  }
  const int64_t per_step = b.micro_batch * b.world_size;
  if (was % per_step != 0) {
    plan.kept.refusal = std::string(same_world ? "resuming with another micro batch: " : "resuming at another world size: ") + change;
    plan.kept.refusal_hint = "keep it with a micro batch that divides it: train_micro_batch_size_per_gpu x gradient_accumulation_steps x " +
                             std::to_string(b.world_size) + " = " + str(was) + "; or change it knowingly with train_batch_size=" +
                             str(b.train_batch_size);
    return;
  }
  const int64_t accumulation = was / per_step;
  bi.train_batch_size = was;
  bi.micro_batch = b.micro_batch;
  bi.grad_accum = accumulation;
  plan.batch = resolve_batch(bi);
  plan.kept.values.push_back({"train_batch_size", was});
  plan.kept.values.push_back({"gradient_accumulation_steps", accumulation});
  const std::string why = same_world ? "resuming with another micro batch (\"auto\" chose " + str(b.micro_batch) + ")"
                                      : "resuming on " + std::to_string(b.world_size) + (b.world_size == 1 ? " rank" : " ranks") +
                                            " (the checkpoint's run had " + str(r.world_size) + ")";
  plan.kept.notes.push_back(why + ": keeping its global batch of " + str(was) + " with gradient_accumulation_steps=" + str(accumulation) +
                            " (set train_batch_size to change it)");
}

// A run resumed with other train.steps keeps the schedule's lengths that followed train.steps at the
// checkpoint's values: it continues the schedule rather than stretch it mid-way.
void keep_checkpoint_schedule(const Config& c, const ResumedFrom& r, Plan& plan) {
  if (plan.scheduler.type == SchedulerType::None || r.steps == plan.steps || r.scheduler != scheduler_type_name(plan.scheduler.type))
    return;
  Config pinned = c;
  std::string kept;
  const SchedulerConfig& now = plan.scheduler.params;
  // A length the config gives as a number is the user's; one "auto" or left out followed train.steps.
  for (const auto& [key, given, value, was, into] :
       {std::tuple{"total_num_steps", c.scheduler.total_num_steps, now.total_num_steps, r.total_num_steps, &pinned.scheduler.total_num_steps},
        {"warmup_num_steps", c.scheduler.warmup_num_steps, now.warmup_num_steps, r.warmup_num_steps, &pinned.scheduler.warmup_num_steps}}) {
    const std::string path = std::string("scheduler.params.") + key;
    if (given_number(c, path, given.has_value()) || !value || !was || *was == *value) continue;
    *into = *was;
    plan.kept.values.push_back({path, *was});
    kept += (kept.empty() ? "" : ", ") + std::string(key) + "=" + str(*was);
  }
  if (kept.empty()) return;
  resolve_schedule_again(c, plan.steps, pinned, plan);
  plan.kept.notes.push_back("train.steps " + str(r.steps) + " -> " + str(plan.steps) + ": the schedule keeps " + kept +
                            " from the checkpoint; set scheduler.params.total_num_steps (and warmup_num_steps) to stretch it");
}

namespace {

// What trains: LoRA's adapter over a frozen base, or model.freeze's tensors frozen, or everything.
void resolve_trainable(const Config& c, const ModelSpec& model, Plan& plan, std::vector<ConfigIssue>& errors) {
  plan.lora = resolve_lora(c.model.lora, model, errors);
  if (plan.lora.enabled) {
    plan.frozen.assign(model.tensors.size(), 1);
    if (!c.model.freeze.empty())
      plan.warnings.push_back({"model.freeze", "has no effect with model.lora: every base weight is frozen already", "remove it"});
  } else {
    plan.frozen = resolve_freeze(c.model.freeze, model, errors);
    if (!plan.frozen.empty()) plan.unfrozen = unfrozen_part(model, plan.frozen);
  }
  plan.backward_from = first_backward_block(model, plan.frozen, plan.lora);
  for (ConfigIssue& w : freeze_pattern_slips(c.model.freeze)) plan.warnings.push_back(std::move(w));
  if (plan.lora.enabled && c.model.lora.target_modules.empty()) {
    plan.resolved.push_back({"model.lora.target_modules", join(plan.lora.target_modules, ", "), std::string("auto: PEFT's default for ") + model_arch_name(model.hp.arch)});
  }
  if (plan.lora.enabled && c.model.lora.target_modules == std::vector<std::string>{kAllLinear})
    plan.resolved.push_back({"model.lora.target_modules", join(plan.lora.target_modules, ", "),
                             std::string("all-linear: every projection of ") + model_arch_name(model.hp.arch) + ", the output head excepted"});
  if (!plan.lora.enabled && !c.model.freeze.empty() && c.model.init_from.empty())
    plan.warnings.push_back({"model.freeze", "freezes weights drawn from the seed (no model.init_from): no file holds them, so "
                             "convert-ckpt --merge cannot put the trained tensors back into a whole model",
                             "freeze weights you load: set model.init_from to the model being fine-tuned"});
}

void resolve_seq_len(const Config& c, const ModelHyper& h, Plan& plan, std::vector<ConfigIssue>& errors) {
  if (c.data.seq_len) {
    plan.seq_len = *c.data.seq_len;
  } else {
    plan.seq_len = h.max_position_embeddings;
    plan.resolved.push_back({"data.seq_len", str(plan.seq_len), "auto: the model's max_position_embeddings"});
  }
  if (h.traits().positions == Positions::learned && plan.seq_len > h.max_position_embeddings)
    errors.push_back({"data.seq_len",
                      "seq_len " + str(plan.seq_len) + " is longer than the model's " + str(h.max_position_embeddings) + " learned positions",
                      "lower data.seq_len, or raise model.max_position_embeddings"});
}

// The ZeRO knobs as given. Those whose "auto" follows the model's width (Hugging Face's rules) take it
// from `hidden_size`, each recorded as resolved; without a model (0) they stay 0, unknown.
void resolve_zero_knobs(const ZeroConfig& zc, int64_t hidden_size, Plan& plan) {
  ResolvedZero& z = plan.zero;
  const int64_t C = hidden_size;
  auto pick = [&](const std::optional<int64_t>& v, int64_t fallback, const char* path, const std::string& rule) {
    if (v || C == 0) return v.value_or(0);
    plan.resolved.push_back({path, str(fallback), "auto: " + rule});
    return fallback;
  };
  z.reduce_bucket_size = pick(zc.reduce_bucket_size, C * C, "zero_optimization.reduce_bucket_size", "hidden_size^2 = " + str(C) + "^2");
  z.allgather_bucket_size =
      pick(zc.allgather_bucket_size, C * C, "zero_optimization.allgather_bucket_size", "hidden_size^2 = " + str(C) + "^2");
  z.prefetch_bucket_size = pick(zc.prefetch_bucket_size, static_cast<int64_t>(0.9 * C * C), "zero_optimization.stage3_prefetch_bucket_size",
                                "0.9 x hidden_size^2");
  z.param_persistence_threshold =
      pick(zc.param_persistence_threshold, 10 * C, "zero_optimization.stage3_param_persistence_threshold", "10 x hidden_size");
  z.max_live_parameters = zc.max_live_parameters.value_or(0);  // the loader fills these three
  z.max_reuse_distance = zc.max_reuse_distance.value_or(0);
  z.sub_group_size = zc.sub_group_size.value_or(0);
  z.reduce_scatter = zc.reduce_scatter.value_or(true);
  z.contiguous_gradients = zc.contiguous_gradients;
  z.offload_optimizer = zc.offload_optimizer;
  z.offload_param = zc.offload_param;
  z.aio = zc.aio;
}

// The device memory each rank may use: the GPU's, or on the CPU its share of the host's (0: unknown).
double device_budget_of(const Topology& topo) {
  return topo.device_traits().memory_is_host ? (topo.host_memory_bytes > 0 ? topo.host_memory_bytes / topo.ranks_per_node : 0)
                                             : topo.device_memory_bytes;
}

// What "auto" chooses by memory: a plan fits by the one fit rule (fit.hpp), headroom left on the device and
// in the host's memory (offloaded states and staging buffers; on the CPU the device is the host), so
// "auto" never picks what ds plan calls tight.
struct MemoryChoice {
  const Plan& plan;
  const Topology& topo;
  double device_budget;
  bool fits(int stage, int64_t micro) const {
    Plan trial = plan;
    trial.batch.micro_batch = micro;
    lay_out(trial, stage);
    lay_out_mesh(trial, stage);  // a split model: a rank of its heaviest stage
    return check_fit(trial, topo.headroom).fits();
  }
  std::string budget_text() const {
    return format_bytes(device_budget) + " per rank" +
           (topo.host_memory_bytes > 0 ? " and " + format_bytes(topo.host_memory_bytes) + " of host memory per node" : std::string());
  }
};

// The stage: explicit, or the lowest that fits at the micro batch given (1 when "auto").
int choose_stage(const Config& c, const MemoryChoice& memory, Plan& plan, std::vector<ConfigIssue>& errors) {
  const bool pipelined = c.parallel.pipeline > 1;
  if (c.zero.stage) {
    if (pipelined && *c.zero.stage >= 2)
      errors.push_back({"zero_optimization.stage",
                        "stage " + std::to_string(*c.zero.stage) + " with pipeline stages: a stage's ranks keep its gradients and "
                            "parameters whole between micro-batches (DeepSpeed's pipeline engine takes ZeRO stage 0 or 1)",
                        "use stage 1 (each stage's optimizer states partitioned over its data group), or pipeline.stages=1"});
    return *c.zero.stage;
  }
  if (pipelined || c.parallel.tensor > 1) {
    plan.resolved.push_back({"zero_optimization.stage", "1",
                             "auto with the model split over ranks: the optimizer states partitioned over each data group, as "
                             "Megatron-DeepSpeed runs it (a pipeline takes at most stage 1)"});
    return 1;
  }
  int stage = 3;
  if (memory.device_budget <= 0)
    errors.push_back({"zero_optimization.stage", "\"auto\" needs the device memory, which is unknown", "pass --device-memory (e.g. 80GiB) or set the stage"});
  for (int s = 0; s <= 3 && memory.device_budget > 0; ++s)
    if (memory.fits(s, c.train_micro_batch_size_per_gpu.value_or(1))) {
      stage = s;
      break;
    }
  plan.resolved.push_back({"zero_optimization.stage", std::to_string(stage), "auto: the lowest stage whose plan fits " + memory.budget_text()});
  return stage;
}

// overlap_comm's default and where reduce_scatter cannot act, said.
void resolve_reduction(const ZeroConfig& zc, int stage, const Topology& topo, Plan& plan) {
  ResolvedZero& z = plan.zero;
  z.overlap_comm = zc.overlap_comm.value_or(stage == 3);
  if (!zc.overlap_comm)
    plan.resolved.push_back({"zero_optimization.overlap_comm", z.overlap_comm ? "true" : "false",
                             stage >= 2 ? "default: true at stage 3; true reduces each block's gradients while the next block's "
                                          "backward runs, for one more block gradient buffer"
                                        : "default: true at stage 3; true at stages 0-1 reduces each block's gradients as the "
                                          "step's last backward finishes it"});
  // Where the reduction is an all-reduce whatever the key says, it says so (one rank sends nothing at all).
  if (zc.reduce_scatter && topo.world_size > 1 && (stage == 0 || (stage == 1 && !comm_capabilities(topo.comm_backend()).native_reduce_scatter)))
    plan.warnings.push_back({"zero_optimization.reduce_scatter",
                             stage == 0 ? "has no effect at stage 0: every rank needs the whole gradient, so it is all-reduced"
                                        : "has no effect at stage 1 on CPU ranks: ds all-reduces there (over Gloo a reduce-scatter "
                                          "would need a receive buffer the size of each rank's shard)",
                             stage == 0 ? "remove it, or use stage 1 or above" : "remove it, or use stage 2"});
}

// The micro batch when "auto" leaves it to memory: the largest power of two up to 64 that fits.
void choose_micro_batch(const MemoryChoice& memory, int stage, BatchInputs& bi, Plan& plan, std::vector<ConfigIssue>& errors) {
  if (memory.device_budget <= 0) {
    errors.push_back({"train_micro_batch_size_per_gpu", "\"auto\" needs the device memory, which is unknown",
                      "pass --device-memory (e.g. 80GiB) or set the micro batch"});
    return;
  }
  int64_t micro = 0;
  for (int64_t m = 64; m >= 1 && micro == 0; m /= 2)
    if (memory.fits(stage, m)) micro = m;
  if (micro == 0) {
    micro = 1;
    plan.warnings.push_back({"train_micro_batch_size_per_gpu", "even a micro batch of 1 does not fit " + memory.budget_text(),
                             "see the memory table; try a higher ZeRO stage, offload or activation checkpointing"});
  }
  bi.micro_batch = micro;
  plan.resolved.push_back({"train_micro_batch_size_per_gpu", str(micro), "auto: the largest power of two up to 64 whose plan fits " + memory.budget_text()});
}

void resolve_batch_into(const BatchInputs& bi, Plan& plan, std::vector<ConfigIssue>& errors) {
  try {
    plan.batch = resolve_batch(bi);
  } catch (const ConfigError& e) {  // the same report as every other problem of the file
    errors.insert(errors.end(), e.issues().begin(), e.issues().end());
  }
}

// The batch triangle's keys ds computed, each by name (given as "auto" or left out).
void record_batch_derivation(const BatchInputs& bi, const Topology& topo, Plan& plan) {
  const ResolvedBatch& b = plan.batch;
  const std::string world = bi.world_name + " " + std::to_string(b.world_size) + " from " + bi.world_size_source;
  const std::string times = bi.world_name == "world size" ? " x world " : " x " + bi.world_name + " ";
  if (!bi.grad_accum)
    plan.resolved.push_back({"gradient_accumulation_steps", str(b.grad_accum),
                             bi.train_batch_size ? "train_batch_size / (micro " + str(b.micro_batch) + times +
                                                       std::to_string(b.world_size) + "); " + world
                                                 : "default 1 when train_batch_size is not given"});
  if (!bi.train_batch_size)
    plan.resolved.push_back({"train_batch_size", str(b.train_batch_size),
                             "micro " + str(b.micro_batch) + " x accumulation " + str(b.grad_accum) + times + std::to_string(b.world_size) +
                                 "; " + world});
}

// Stage 3 as ds runs it, which DeepSpeed's knobs do not describe: replaces the prefetch bucket's "auto".
void record_block_gathers(const ModelSpec& model, Plan& plan) {
  plan.resolved.erase(std::remove_if(plan.resolved.begin(), plan.resolved.end(),
                                     [](const ResolvedValue& v) { return v.path == "zero_optimization.stage3_prefetch_bucket_size"; }),
                      plan.resolved.end());
  plan.resolved.push_back({"zero_optimization.stage3_prefetch_bucket_size",
                           "one transformer block (" + format_count(model.largest_block_params) + " parameters)",
                           "ds gathers a whole block per collective and prefetches the next; max_live_parameters "
                           "and max_reuse_distance do not apply"});
}

// Without a model: the collectives of a model made of one large tensor, their bytes divided by its size,
// i.e. what each parameter costs on the wire per step at this stage and these dtypes (the real model adds
// the control all-reduce and per-tensor padding), and the placement that stage gives.
void add_collectives_per_parameter(const Topology& topo, int stage, Plan& plan) {
  Plan one = plan;
  const int64_t n = int64_t{1} << 20;
  one.model = ModelSpec{};
  one.model.tensors.push_back({"parameters", {n * topo.world_size}, n * topo.world_size, 0, true});
  one.model.num_params = n * topo.world_size;
  one.batch.grad_accum = std::max<int64_t>(1, plan.batch.grad_accum);
  one.zero.reduce_bucket_size = one.zero.allgather_bucket_size = n;
  one.layout = build_layout(one.model, stage, topo.world_size);
  const ZeroExecution one_execution = describe_zero(one);
  plan.placement = render_placement(one_execution, stage, topo.device);
  for (Collective col : one_execution.collectives) {
    if (col.kind == CollectiveKind::control) continue;
    col.payload_bytes_per_step /= static_cast<double>(one.model.num_params);
    col.wire_bytes_per_rank_per_step /= static_cast<double>(one.model.num_params);
    plan.execution.collectives.push_back(col);
  }
}

// The batch's "world": the data-parallel ranks, and where their number comes from.
BatchInputs batch_inputs(const Config& c, const Topology& topo, const MeshShape& mesh) {
  BatchInputs bi{c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps, mesh.data, topo.world_size_source};
  if (mesh.splits_the_model()) {
    bi.world_size_source = "the " + std::to_string(topo.world_size) + " ranks of " + topo.world_size_source + " / (tensor " +
                           std::to_string(mesh.tensor) + " x pipeline " + std::to_string(mesh.pipeline) + ")";
    bi.world_name = "data-parallel size";
  }
  return bi;
}

}  // namespace

// The speculative step where the step's time can be predicted: which tiles to speculate, and a warning where it
// still makes the step slower than without.
static void choose_speculated_tiles(Plan& plan) {
  // Which tiles to speculate: those of the blocks from the one whose choice predicts the shortest step up (the top
  // blocks' tiles are final first in the backward; the bottom ones', read first by the next forward, may do better
  // there; on a tie, the fewer tiles). Then each block's tiles in turn, from the top, taken out or put back where
  // that predicts a shorter step (a block whose tiles outlast the backward of the block below may do better in the
  // next forward while the blocks around it speculate), until no such change is left. Where the blocks' gradients land
  // a block late (gradient_lag), the lag too: a longer one leaves the host more slack behind the copies, and more of the
  // bottom blocks' tiles after the backward (the first lag tried that predicts the shortest step, with its top blocks).
  std::set<int64_t> groups(plan.execution.weight_tile_final_after.begin(), plan.execution.weight_tile_final_after.end());
  groups.erase(-1);
  // (first how the host's memory holds the choice, where it is known: each speculated tile's backup and each block of
  // lag's page-locked arrival buffer take more of it, so a choice that fits beats a faster one that does not, one with
  // room left beats a tight one; then the step, then its parts' sum: where the host memory's busy time sets the step,
  // the choice that leaves the shortest schedule under it)
  const auto predicted = [&](int64_t lag, const std::set<int64_t>& blocks) {
    Plan trial = plan;
    if (lag > 0) set_gradient_lag(trial.execution, lag);
    limit_speculation(trial.execution, blocks);
    trial.memory = estimate_memory(trial.execution, plan.memory.device.activations);
    const Fit host = check_fit(trial, trial.topology.headroom).host;
    const StepTime t = predict_step_time(trial);
    return std::tuple{host == Fit::does_not_fit ? 2 : host == Fit::within_headroom ? 1 : 0, t.step_s(), t.parts_s()};
  };
  constexpr int64_t kLongestLag = 3;  // (past it the last blocks' tiles, left after the backward, cost more than it hides)
  const int64_t shortest_lag = plan.execution.gradient_lag > 0 ? 1 : 0, longest_lag = shortest_lag > 0 ? kLongestLag : 0;
  std::tuple<int, double, double> best_s{3, 0.0, 0.0};  // (worse than any choice: its fit's rank is at most 2)
  std::set<int64_t> best;
  int64_t best_lag = shortest_lag;
  for (int64_t lag = shortest_lag; lag <= longest_lag; ++lag)
    for (int64_t k : groups) {
      const std::set<int64_t> top(groups.lower_bound(k), groups.end());
      if (const auto s = predicted(lag, top); s < best_s || (s == best_s && lag == best_lag)) best_s = s, best = top, best_lag = lag;
    }
  for (bool changed = true; changed;) {
    changed = false;
    for (auto g = groups.rbegin(); g != groups.rend(); ++g) {
      std::set<int64_t> trial = best;
      if (!trial.erase(*g)) trial.insert(*g);
      if (trial.empty()) continue;  // (none: the plan without speculation, which the warning below weighs)
      if (const auto s = predicted(best_lag, trial); s < best_s) best_s = s, best = std::move(trial), changed = true;
    }
  }
  if (best.empty()) return;  // (no prediction came out: all tiles, as asked)
  if (best_lag > 0) set_gradient_lag(plan.execution, best_lag);
  limit_speculation(plan.execution, best);
  plan.memory = estimate_memory(plan.execution, plan.memory.device.activations);
  plan.step_time = predict_step_time(plan);
  // What speculation buys here: the same plan's step predicted without it.
  Plan plain = plan;
  plain.zero.offload_optimizer.speculative_step = false;
  plain.execution = describe_zero(plain);
  const double with = plan.step_time.step_s(), without = predict_step_time(plain).step_s();
  double backup_s = 0;
  for (const OffloadTime& x : plan.step_time.offload) backup_s += x.what == "speculated states backed up" ? x.seconds : 0.0;
  const auto ms = [](double s) { return format_fixed(s * 1e3, 1) + " ms"; };
  if (with > without)
    plan.warnings.push_back({"zero_optimization.offload_optimizer.speculative_step",
                             "makes the predicted step slower, by " + ms(with - without) + " (" + ms(with) + " against " + ms(without) +
                                 (backup_s > 0 ? "): backing up the speculated tiles' states takes " + ms(backup_s) + " of the host's memory, " +
                                                     (plan.step_time.host_memory_floored()
                                                          ? "busy " + ms(plan.step_time.host_memory_busy_s) + " a step with it, which sets the step"
                                                          : "more than the last backward hides beyond what the next forward would")
                                               : "): the last backward hides less of the host's step than the next forward would"),
                             plan.execution.speculation_backed_up
                                 ? "remove it; without the backup (gradient_clipping 0 where the run does without clipping, and no "
                                   "overflow skip: bf16 without check_grad_overflow) speculation costs nothing beyond the step"
                                 : "remove it: the next forward hides the host's step already"});
}

Plan compile_plan(const Config& c, const ModelSpec& given_model, const Topology& topo, const ResumedFrom* resumed) {
  Plan plan = plan_from_settings(c, topo);
  std::vector<ConfigIssue> errors;
  // Which tensors weight decay applies to is the model's per-tensor flag (matrices by default): "all" sets it on each.
  ModelSpec model = given_model;
  if (c.train.decay_all_params)
    for (TensorSpec& t : model.tensors) t.weight_decay = true;
  plan.model = model;
  resolve_trainable(c, model, plan, errors);
  resolve_seq_len(c, model.hp, plan, errors);
  DS_CHECK(c.zero.max_live_parameters && c.zero.max_reuse_distance && c.zero.sub_group_size, "the loader fills these defaults");
  resolve_zero_knobs(c.zero, model.hp.hidden_size, plan);

  // Micro batch: explicit, from the triangle, or (when "auto" and underdetermined, i.e. without
  // train_batch_size) from memory.
  plan.mesh.shape = mesh_shape_of(c, topo);
  BatchInputs bi = batch_inputs(c, topo, plan.mesh.shape);
  // The mesh's stages before any choice made by memory, which then judges a rank of the heaviest stage; the
  // micro-batches in flight follow the accumulation once it is resolved.
  const size_t before_mesh = errors.size();
  plan.mesh = plan_mesh(model, mesh_request(c), topo.world_size, topo.ranks_per_node,
                        static_cast<int>(c.gradient_accumulation_steps.value_or(1)), errors);
  // A mesh the world or the model cannot take: the batch and memory below would count its ranks wrongly.
  if (errors.size() > before_mesh) throw ConfigError(c.source, errors);
  for (size_t i = 0; i < model.tensors.size(); ++i)
    if (is_token_table(model.tensors[i])) plan.mesh.tied_trains = !plan.is_frozen(i);
  const MemoryChoice memory{plan, topo, device_budget_of(topo)};
  const int stage = choose_stage(c, memory, plan, errors);
  resolve_reduction(c.zero, stage, topo, plan);
  check_zero(c, plan.optimizer, stage, errors, plan.warnings, plan.zero);
  if (c.micro_batch_auto && !c.train_batch_size) choose_micro_batch(memory, stage, bi, plan, errors);
  resolve_batch_into(bi, plan, errors);
  if (!errors.empty()) throw ConfigError(c.source, errors);
  if (resumed) keep_checkpoint_batch(c, *resumed, bi, plan);
  schedule_micro_batches(plan.mesh, static_cast<int>(plan.batch.grad_accum));
  record_batch_derivation(bi, topo, plan);
  resolve_threads(c, topo, plan);

  lay_out(plan, stage);
  if (plan.mesh.partition == StagePartition::memory) cut_stages_by_memory(plan, stage);
  lay_out_mesh(plan, stage);
  plan.own = share_of(plan, own_stage(plan));
  // A library that cannot sum 16-bit floats itself (Gloo) sums the activations and gradients through fp32 copies.
  const auto on_wire = [&](Dtype d) { return comm_capabilities(topo.comm_backend()).sums_16bit ? dtype_bytes(d) : 4; };
  count_mesh_traffic(plan.mesh, model, stage_training(plan), plan.backward_from, plan.lora.r, plan.batch.micro_batch, plan.seq_len,
                     on_wire(plan.precision.compute_dtype),
                     dtype_bytes(plan.precision.compute_dtype), on_wire(plan.precision.grad_dtype), dtype_bytes(plan.precision.param_dtype),
                     dtype_bytes(plan.execution.reduced_dtype), plan.activation_checkpointing, plan.optimizer.per_tensor_update());
  note_communication_dtype(plan);
  note_gradient_sums(c, plan);
  if (c.zero.offload_optimizer.speculative_step && !plan.execution.step_in_backward)
    plan.warnings.push_back({"zero_optimization.offload_optimizer.speculative_step",
                             topo.device_traits().memory_is_host
                                 ? "has no effect on the CPU: the step's states and weights are in the memory the model computes in, "
                                   "and there is no device's backward to step them behind"
                                 : "has no effect here: it needs one GPU rank whose gradients leave for the host block by block (ZeRO "
                                   "stage 2 or 3, offload_optimizer.device cpu with ratio 1, no offload_param, weights in bf16 or fp32, "
                                   "overlap_comm true) and tiles of the blocks to step",
                             "remove it, or see man ds-train, OPTIMIZER OFFLOAD"});
  note_mesh(plan);
  note_recompute_groups(plan);
  if (plan.execution.gathers)
    record_block_gathers(plan.mesh.heaviest_stage >= 0 ? stage_share(plan.model, plan.mesh, plan.mesh.heaviest_stage) : model, plan);
  plan.tokens_per_step = plan.batch.train_batch_size * plan.seq_len;
  plan.train_flops_per_step = static_cast<double>(plan.tokens_per_step) * plan.train_flops_per_token();
  if (c.train.epochs) steps_from_epochs(c, plan);
  if (resumed) keep_checkpoint_schedule(c, *resumed, plan);
  plan.step_time = predict_step_time(plan);
  if (plan.execution.step_in_backward && plan.step_time.step_known()) choose_speculated_tiles(plan);
  plan.placement = render_placement(plan.execution, stage, topo.device);  // (the buffers as the speculation left them)
  if (topo.device_traits().memory_is_host && topo.rates.host_link.known())
    plan.warnings.push_back({"", "--host-link has no effect on the CPU: its copies between places are the host's memory's (--host-memory-bw)",
                             "drop --host-link, or plan for a GPU (--gpu)"});
  if (memory.device_budget > 0 && plan.device_bytes_per_rank() > memory.device_budget)
    plan.warnings.push_back({"", "the plan needs " + format_bytes(plan.device_bytes_per_rank()) + " per rank but the device has " +
                                     format_bytes(memory.device_budget),
                             "raise the ZeRO stage, offload, enable model.activation_checkpointing or lower the micro batch"});
  return plan;
}

FlatLayout Plan::checkpoint_layout() const {
  return mesh.shape.splits_the_model() ? build_layout(trained(), layout.stage, mesh.shape.data) : layout;
}

Plan compile_plan_without_model(const Config& c, const Topology& topo) {
  Plan plan = plan_from_settings(c, topo);
  plan.has_model = false;
  std::vector<ConfigIssue> errors;
  plan.seq_len = c.data.seq_len.value_or(0);
  resolve_zero_knobs(c.zero, 0, plan);
  const int stage = c.zero.stage.value_or(-1);  // "auto": chosen by memory, which needs the model
  plan.layout.stage = stage;
  plan.layout.world_size = topo.world_size;
  plan.zero.overlap_comm = c.zero.overlap_comm.value_or(stage == 3);
  if (stage >= 0) check_zero(c, plan.optimizer, stage, errors, plan.warnings, plan.zero);
  plan.mesh.shape = mesh_shape_of(c, topo);
  if (!check_mesh_world(mesh_request(c), topo.world_size, errors)) throw ConfigError(c.source, errors);
  const BatchInputs bi = batch_inputs(c, topo, plan.mesh.shape);
  if (!(c.micro_batch_auto && !c.train_batch_size)) resolve_batch_into(bi, plan, errors);
  if (!errors.empty()) throw ConfigError(c.source, errors);
  note_mesh(plan);
  resolve_threads(c, topo, plan);
  if (stage >= 0) add_collectives_per_parameter(topo, stage, plan);
  plan.step_time = predict_step_time(plan);  // says that it needs the model
  return plan;
}

}  // namespace ds
