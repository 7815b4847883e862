// ds — the Plan: everything decided before the first step. compile_plan is pure: the same Config,
// ModelSpec and Topology always give the same Plan. The runtime executes it and re-decides nothing.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/plan/batch.hpp"
#include "engine/plan/comm.hpp"
#include "engine/plan/layout.hpp"
#include "engine/plan/lora.hpp"
#include "engine/plan/memory.hpp"
#include "engine/plan/mesh.hpp"
#include "engine/plan/model_spec.hpp"
#include "engine/plan/step_time.hpp"
#include "engine/plan/topology.hpp"
#include "engine/plan/zero_plan.hpp"
#include "schema/config.hpp"

namespace ds {

// Bumped when a field of `ds plan --json` (and the plan stored in checkpoints) changes meaning or
// disappears; adding fields does not bump it.
constexpr int kPlanSchemaVersion = 1;

struct LossScaling {
  bool enabled = false;   // fp16 only
  bool dynamic = false;
  double initial_scale = 1, min_scale = 1;
  int64_t window = 0;
  int hysteresis = 0;
  bool consecutive_hysteresis = false;
};

struct PrecisionPolicy {
  std::string mode;  // "fp32" | "bf16" | "fp16"
  Dtype param_dtype = Dtype::fp32;    // working parameters
  Dtype compute_dtype = Dtype::fp32;  // matmuls and activations
  Dtype grad_dtype = Dtype::fp32;     // accumulated gradients
  // communication_data_type: the dtype gradients cross ranks in, where the config names one (ZeroExecution::wire_dtype).
  std::optional<Dtype> comm_dtype;
  bool fp32_master = false;           // optimizer keeps an fp32 copy of the weights
  bool check_overflow = false;        // skip the step on inf/NaN gradients
  // inf/NaN gradients end the run: fp32 has no overflow to skip (bf16 skips or ignores them as
  // check_overflow says; fp16's loss scaler skips them and lowers the scale).
  bool overflow_is_fatal = true;
  LossScaling loss_scaling;
  std::string note;                   // e.g. why fp16 computes in fp32 on CPU
};

struct ResolvedOptimizer {
  OptimizerType type = OptimizerType::AdamW;
  double lr = 0, eps = 0, weight_decay = 0;
  std::array<double, 2> betas{0, 0};
  bool bias_correction = true, decoupled_weight_decay = true;
  double momentum = 0, dampening = 0;
  bool nesterov = false, eps_inside_sqrt = false;
  double max_coeff = 0, min_coeff = 0;
  bool decay_all_params = false;  // train.weight_decay_params: all parameters decay, not only the matrices
  int moments = 2;  // fp32 state tensors per parameter element
  // The update of an element depends on its whole tensor (Lamb's trust ratio over ||w|| and ||u||):
  // steps run over whole tensors, their norms are summed across ranks, and the states cannot be split
  // between places or swapped piecewise. Decided here, read everywhere else.
  bool per_tensor_update() const { return type == OptimizerType::Lamb; }
};

struct ResolvedScheduler {
  SchedulerType type = SchedulerType::None;
  SchedulerConfig params;  // every optional filled
};

// The ZeRO knobs as resolved (every "auto" decided). The stage itself is the layout's (Plan::zero_stage).
struct ResolvedZero {
  bool overlap_comm = false, reduce_scatter = true, contiguous_gradients = true;
  int64_t reduce_bucket_size = 0, allgather_bucket_size = 0, prefetch_bucket_size = 0,
          param_persistence_threshold = 0, max_live_parameters = 0, max_reuse_distance = 0, sub_group_size = 0;
  OffloadConfig offload_optimizer, offload_param;
  AioConfig aio;
  // NVMe optimizer offload: sub-group buffer sets swapped through at once (1 + pipeline_read +
  // pipeline_write, as far as offload_optimizer.buffer_count allows).
  int swap_sets = 0;
};

struct Placement {
  std::string params, grads, optimizer_states;  // "device" | "cpu" | "nvme" (with a detail)
};

// How the run is carried out and reported: what the runtime reads besides the execution itself, so
// that the Plan is its only input.
struct RunSettings {
  std::string output_dir;
  uint64_t seed = 0;
  int64_t save_every = 0, keep_last = 0, eval_every = 0, eval_batches = 0;
  double divergence_factor = 4;  // the loss above this many times its best, 3 steps running, ends the run (0: never)
  double comm_timeout_s = 0;  // collectives and rendezvous
  bool comms_logger = false, wall_clock_breakdown = false;
  MonitorConfig csv_monitor, tensorboard;
  std::string init_from;  // initial weights (model.init_from), "" for the architecture's random init
  FlopsProfilerConfig flops_profiler;  // enabled: blocks are timed and step profile_step is reported
  // ds profile and the flops_profiler block: each step's work within that step, nothing of it left to the next
  // forward (ZeRO's gathers ahead and the host's step during the forward are done at once), so a step's figures are its own.
  bool steps_measured_alone = false;
};

// A value ds decided rather than read: an "auto", a derived batch size, a default that depends on
// the model. Shown by `ds plan` so nothing is decided silently.
struct ResolvedValue {
  std::string path, value, source;
};

// A resumed run's checkpoint, as far as its plan is kept where this config leaves things open (cli/ reads it
// from the checkpoint's plan.json): its global batch at another world size, and its schedule's lengths when
// train.steps changed (a longer run continues the schedule rather than stretch it mid-way).
struct ResumedFrom {
  int64_t train_batch_size = 0;  // 0: not recorded
  int64_t world_size = 0;
  int64_t steps = 0;
  std::string scheduler;  // its type's name
  std::optional<int64_t> total_num_steps, warmup_num_steps;
};

// What the compiler kept of a checkpoint's plan: the values, by the config path they take the place of (the
// run's stored config is written with them, as if the user had given them), and a sentence for each.
struct KeptFromCheckpoint {
  std::vector<std::pair<std::string, int64_t>> values;
  std::vector<std::string> notes;
  // Why the checkpoint's global batch cannot be kept (no whole accumulation gives it), with the choices: the
  // caller refuses the run, after checking the checkpoint is of this model. "" when nothing is refused.
  std::string refusal, refusal_hint;
};

// What one rank holds and trains, as a model of its own. For a model split over ranks: its stage's share
// (stage_share, each tensor the whole model's `tensors[i]`), which of those are frozen (a tied head's copy with the
// token table), those that train, and LoRA's adapters on its blocks (`lora.adapted` numbering `model`'s tensors).
// Unsplit: the whole plan's own. `trained` maps each parameter of the rank's layout to the whole run's trained
// tensor it is (a part of): Plan::trained()'s index, a tied copy marked; `trained_model` to the whole model's
// tensor (-1: an adapter).
struct StageShare {
  ModelSpec model;
  std::vector<StageTensor> tensors;
  std::vector<uint8_t> frozen;  // per tensor of `model`; empty: every one trains
  ModelSpec unfrozen;
  LoraPlan lora;
  std::vector<StageTensor> trained;
  std::vector<int> trained_model;
  const ModelSpec& trained_spec() const { return lora.enabled ? lora.adapters : frozen.empty() ? model : unfrozen; }
  bool is_frozen(size_t tensor) const { return !frozen.empty() && frozen[tensor] != 0; }
  int64_t frozen_numel() const;  // the elements of `model` held frozen
};

struct Plan {
  int schema_version = kPlanSchemaVersion;
  std::string config_source;
  // False for a config without a model block: what needs the model (memory, layout, collectives'
  // bytes, an "auto" ZeRO stage or micro batch) is left empty, and the stage is -1 when "auto".
  bool has_model = true;
  ModelSpec model;
  LoraPlan lora;             // model.lora: the adapter that trains in place of the model's weights
  // Per tensor of the model: held frozen (model.freeze, or every one under LoRA). Empty: every tensor trains.
  std::vector<uint8_t> frozen;
  ModelSpec unfrozen;        // model.freeze without LoRA: the model's tensors that train
  // The first block whose backward runs (first_backward_block): those below it run forward only. In the model's
  // numbering; a stage's rank plan (stage_rank_plan) in its share's.
  int64_t backward_from = 0;
  Topology topology;
  ResolvedBatch batch;
  int64_t seq_len = 0;
  int threads = 1;
  PrecisionPolicy precision;
  ResolvedOptimizer optimizer;
  ResolvedScheduler scheduler;
  ResolvedZero zero;
  // The world split into data x tensor x pipeline (data x 1 x 1 when the model is not split): the batch counts
  // the data-parallel ranks. Without a model, its shape only.
  MeshPlan mesh;
  double gradient_clipping = 0;
  bool activation_checkpointing = false;
  int64_t recompute_group = 1;  // with activation checkpointing: blocks recomputed together (pipeline.activation_checkpoint_interval)
  FlatLayout layout;         // the stage lives here: layout.stage (-1: "auto" without a model)
  ZeroExecution execution;   // every buffer and collective of a rank; without a model, collectives per parameter
  MemoryEstimate memory;     // the execution's buffers summed, plus activations
  Placement placement;
  int64_t tokens_per_step = 0;
  double train_flops_per_step = 0;  // model FLOPs of one optimizer step across all ranks
  StepTime step_time;               // predicted from the topology's rates (what it lacks: step_time.missing)
  int64_t steps = 0;
  DataConfig data;                       // the token source, as resolved by the loader
  RunSettings run;
  bool gradient_sum_over_ranks = false;  // gradient_allreduce_op "sum": ranks' gradients add up, not averaged
  std::vector<ResolvedValue> resolved;
  std::vector<ConfigIssue> warnings;  // the loader's plus the compiler's
  KeptFromCheckpoint kept;            // a resumed run's (compile_plan's `resumed`)
  // What this plan's rank (topology.rank) holds and trains: the runtime binds, draws, loads and checkpoints
  // through it. compile_plan fills it for the rank's own stage.
  StageShare own;

  // Per rank on the device, and per node in host RAM (a CPU-only run's device memory is host RAM).
  int zero_stage() const { return layout.stage; }
  // The parameters that train, which the layout lays out: the adapter's with LoRA, else the model's.
  const ModelSpec& trained() const { return lora.enabled ? lora.adapters : frozen.empty() ? model : unfrozen; }
  bool is_frozen(size_t tensor) const { return !frozen.empty() && frozen[tensor] != 0; }
  // Elements of the model held frozen (the frozen_params buffer).
  int64_t frozen_numel() const;
  // Per parameter of the layout, the tensor of the model it is (-1: a LoRA adapter's; a split model's rank: the
  // whole tensor its share is of, the tied head's copy the token table's): own.trained_model.
  const std::vector<int>& trained_model_tensors() const { return own.trained_model; }
  // The layout a checkpoint of this plan holds and records: the rank's own, or for a model split over ranks the
  // whole model's laid out for its data ranks (each rank writes the whole tensors' elements it holds, so one rank
  // or any mesh resumes it).
  FlatLayout checkpoint_layout() const;
  double device_bytes_per_rank() const { return memory.device.total(); }
  // Model FLOPs of one token at seq_len: the model's, or with LoRA the frozen base's and the adapter's.
  double train_flops_per_token() const;
  // Model FLOPs of one step whose data counted `counted_targets` targets over all ranks: the rows whose targets
  // are masked (a prompt's, padding) never reach the head (LanguageModel::head_loss), so each costs the head's
  // share less. Packed rows run their attention per sample: `attention_squares` is the step's sum of those
  // calls' lengths squared (where every row would be seq_len^2). -1: as the plan counts them.
  double train_flops_of_step(int64_t counted_targets, int64_t attention_squares = -1) const;
  double host_bytes_per_node() const;
};

// Resolves every "auto", the batch triangle and the precision policy, lays out the parameters and
// sizes memory and communication. Throws ConfigError for combinations that cannot run. `resumed`: the
// checkpoint a run continues, whose batch and schedule it keeps where the config leaves them open
// (Plan::kept says what, or why its batch cannot be kept).
Plan compile_plan(const Config& config, const ModelSpec& model, const Topology& topology, const ResumedFrom* resumed = nullptr);

// What can be planned from the config alone (a DeepSpeed ds_config without a model block): batch
// triangle, precision, optimizer, schedule, ZeRO stage and placement. Throws ConfigError as compile_plan.
Plan compile_plan_without_model(const Config& config, const Topology& topology);

// A split model's device bytes per rank of each stage (ds plan's mesh table) were its blocks cut `blocks[s]` per
// stage (each at least one, summing to the model's blocks), the plan otherwise as compiled.
std::vector<double> stage_device_bytes(const Plan& plan, const std::vector<int>& blocks);

// The pipeline stage the plan's rank (topology.rank) runs: 0 without stages.
int own_stage(const Plan& plan);
// What a rank of stage `stage` holds and trains (Plan::own's record); the whole plan's own without stages.
StageShare share_of(const Plan& plan, int stage);
// What the plan's rank trains: a plan whose mesh cuts the model into pipeline stages describes a rank of its
// heaviest stage (the fit is judged there); this copy's layout, ZeRO execution and memory are those of the
// rank's own stage. The plan as it is without stages.
Plan with_own_stage(const Plan& plan);

}  // namespace ds
