#include "engine/runtime/run/trainer.hpp"

#include <malloc.h>
#include <sys/statvfs.h>
#include <omp.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <ctime>
#include <functional>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <optional>

#include "common/error.hpp"
#include "common/format.hpp"
#include "common/hash.hpp"
#include "common/stop_signals.hpp"
#include "engine/runtime/device/block_pool.hpp"
#include "engine/runtime/io/checkpoint.hpp"
#include "engine/runtime/comm/comm.hpp"
#include "engine/runtime/data/sampler.hpp"
#include "engine/runtime/data/token_source.hpp"
#include "engine/runtime/device/device.hpp"
#include "engine/runtime/run/flat_params.hpp"
#include "engine/runtime/run/frozen_base.hpp"
#include "engine/runtime/model/language_model.hpp"
#include "engine/runtime/run/loss_scaler.hpp"
#include "engine/runtime/run/mesh_groups.hpp"
#include "engine/runtime/io/nvme_swap.hpp"
#include "engine/runtime/device/gemm_peak.hpp"
#include "engine/runtime/run/optimizer_step.hpp"
#include "engine/runtime/run/pipeline.hpp"
#include "engine/runtime/device/resident_memory.hpp"
#include "engine/runtime/run/run_report.hpp"
#include "engine/runtime/io/weights.hpp"
#include "engine/runtime/run/zero.hpp"
#include "engine/plan/plan_record.hpp"
#include "engine/plan/runnable.hpp"

#include <nlohmann/json.hpp>

namespace ds {
namespace {

// Ctrl-C (SIGINT) and SIGTERM (Slurm, Kubernetes, `timeout`) both stop the run after the current step
// with a checkpoint; the signal decides the exit code (130 or 143).
std::atomic<int> g_stop_signal{0};
// While the run starts, a second signal ends the process at once: the first waits for a stop point, which a
// read blocked on a slow filesystem may not reach soon, and before the first step there is nothing to save.
// "Second" means a second later: one Ctrl-C reaches a launched rank twice within milliseconds (from the
// terminal's process group and forwarded by its launcher), as Slurm's SIGTERM may.
std::atomic<bool> g_starting{false};
std::atomic<int64_t> g_first_signal_ms{0};
int64_t monotonic_ms() {  // clock_gettime: safe in a signal handler
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000 + t.tv_nsec / 1000000;
}
void on_stop_signal(int sig) {
  const int64_t now = monotonic_ms();
  if (!g_stop_signal) g_first_signal_ms = now;
  if (g_starting && g_stop_signal && now - g_first_signal_ms >= 1000) {
    static const char text[] = "ds train: a second stop while starting: ending now, nothing was trained or saved\n";
    if (::write(STDERR_FILENO, text, sizeof text - 1) < 0) {
    }
    ::_exit(128 + sig);
  }
  g_stop_signal = sig;
}

// A training step allocates and frees the same large tensors every step (logits, activations,
// gradients). glibc hands blocks above 32 MiB back to the OS on free, so every step page-faults them
// in again: measured here, a fresh 512x50257 bf16 matmul output costs 146 ms against 57 ms reused.
// Serve large blocks from the heap and never trim it: RSS stays at the peak, which the plan predicts.
// Tensors of 64 KiB and more come from a pool of their own (block_pool.hpp), where small long-lived
// objects cannot pin the holes they leave: the quickstart's peak 1.7x -> 1.2x the plan in fp32.
void keep_freed_memory() {
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
  mallopt(M_TOP_PAD, 256 << 20);
  route_large_tensors_to_pool();
}

// The first checkpoint must fit: fp32 master weights and moments of every rank, found out now rather
// than after the first save_every steps.
void check_free_space(const Plan& plan) {
  const int64_t numel = plan.checkpoint_layout().numel;
  const double need = static_cast<double>(numel) * 4.0 * (1 + plan.optimizer.moments) + (1 << 20);
  struct statvfs fs {};
  if (statvfs(plan.run.output_dir.c_str(), &fs) != 0) return;
  const double free_bytes = static_cast<double>(fs.f_bavail) * static_cast<double>(fs.f_frsize);
  if (free_bytes < need)
    throw UserError("train.output_dir '" + plan.run.output_dir + "' has " + format_bytes(free_bytes) + " free; a checkpoint needs " +
                        format_bytes(need),
                    "free some space, or choose another train.output_dir");
}

// A stop asked for while the run starts (Ctrl-C; SIGTERM, Slurm's notice before it kills): one process ends
// at the next of these points, having trained and saved nothing, so that a large model's minute of drawing
// weights does not outlast the grace period. Ranks finish starting and stop after their first step, as they
// must agree (a rank that left alone would leave its peers waiting in a collective).
struct StoppedWhileStarting {
  int signal;
  std::string phase;
};

// How a swap file is read and written, for the start-up note.
const char* io_mode(bool direct) { return direct ? "O_DIRECT" : "through the page cache: this filesystem refuses O_DIRECT"; }

// Ctrl-C and SIGTERM set the flag while the run lasts (on the signals' own thread: common/stop_signals.hpp);
// the previous handler comes back when the run ends, however it ends.
struct StopSignals {
  explicit StopSignals(StopHandler (*set)(StopHandler)) : set(set) {
    g_stop_signal = 0;
    previous = set(on_stop_signal);
  }
  ~StopSignals() { set(previous); }
  StopHandler (*set)(StopHandler);
  StopHandler previous = nullptr;
};

}  // namespace

// A run of at least this many steps that applied none of them (every one skipped for inf/NaN gradients)
// ends with exit 1: fewer may be fp16's dynamic scaler still finding its scale.
constexpr int64_t kMinStepsForAllSkipped = 16;

TrainResult train(const Plan& plan, const TrainOptions& opt) {
  // Several ranks: join the group the topology describes (Gloo; its rendezvous address came from the CLI).
  std::unique_ptr<Communicator> own;
  if (plan.topology.world_size > 1)
    own = Communicator::create(plan.execution.backend, plan.topology,
                               std::chrono::milliseconds(static_cast<int64_t>(plan.run.comm_timeout_s * 1000)));
  return train(plan, opt, own.get());
}

namespace {

// The training run of one process: what it holds and the parts of the loop, from start to finish.
class TrainingRun {
 public:
  TrainingRun(const Plan& plan, const TrainOptions& opt, Communicator* comm, Device& device, TrainResult& result);
  // The weights drawn (or read from init_from), or the checkpoint's state, then published to every rank.
  void initialise();
  // The steps from the first to train.steps, or until Ctrl-C/SIGTERM; checkpoints on cadence and at the end.
  void loop();
  // The run failed with `reason`: its communicators are told before its buffers are freed (Communicator::abort).
  void abort(const std::string& reason) noexcept {
    try {
      groups_.abort(reason);
    } catch (...) {  // (the run's own error is the one it ends with)
    }
  }

 private:
  void open_swappers();
  // The checkpoint's views of this rank's states: the whole part (saving) and each state span's (loading).
  void describe_states();
  // LoRA: the frozen base read from model.init_from (or drawn from the seed) into its buffer, and the
  // reference to it that checkpoints carry.
  void load_base();
  void draw_weights();
  void resume();
  void stop_point(const char* phase) const {
    if (!comm_ && g_stop_signal) throw StoppedWhileStarting{g_stop_signal, phase};
  }
  void save(int64_t step);
  double validate();
  void record_profile(const StepOutcome& out, std::chrono::steady_clock::time_point t0, const Event& step_start);
  // Throws when the loss has been above divergence_factor x its best for 3 steps.
  void check_divergence(int64_t step, double loss);

  const Plan& plan_;
  const TrainOptions& opt_;
  Communicator* comm_;  // the world: null on one rank
  Device& device_;
  TrainResult& result_;
  const int rank_;    // this rank's place among the data-parallel ranks (the world's rank unless the mesh splits the model)
  const bool lead_;   // the world's rank 0: it writes the run directory
  MeshGroups groups_;  // a split model's groups (and the world's communicator)
  std::unique_ptr<PipelineStageRunner> pipeline_;  // pipeline stages: this stage's micro-batches, 1F1B
  std::string checkpoint_plan_json_;  // the plan.json checkpoints carry: the whole model's layout when tensor ranks split it
  std::unique_ptr<TokenStream> stream_;   // pre-training data: one token stream, cut into windows
  std::unique_ptr<SampleSet> samples_;    // fine-tuning data (jsonl): one sample a row
  std::unique_ptr<BatchSampler> sampler_;
  std::unique_ptr<RunReport> report_;
  std::unique_ptr<OptimizerSwapper> swapper_;
  std::unique_ptr<ParamSwapper> param_swap_;
  FlatParams flat_;
  std::unique_ptr<ZeroExchange> zero_;
  std::unique_ptr<LanguageModel> model_;
  std::unique_ptr<BlockTimer> block_timer_;
  std::unique_ptr<KernelTrace> kernel_trace_;  // ds profile on a GPU: the kernels each step ran
  // The step's kernels and copies (CUPTI's records), once its stream was waited for.
  void take_kernels_of_step() {
    result_.kernel_times.push_back(kernel_totals(kernel_trace_->take()));
    result_.copy_times.push_back(kernel_totals(kernel_trace_->take_copies()));
  }
  std::unique_ptr<LossScaler> scaler_;
  std::unique_ptr<OptimizerStep> stepper_;
  CheckpointBuffers buffers_;             // the rank's whole part, as a checkpoint's shard holds it (saving)
  std::vector<CheckpointBuffers> spans_;  // per state span (FlatParams::spans): its part, loaded on its own
  bool profiling_ = false;
  double last_loss_ = std::numeric_limits<double>::quiet_NaN();  // of the last applied step, recorded with a checkpoint
  double best_loss_ = std::numeric_limits<double>::infinity();
  int64_t best_step_ = 0, steps_above_ = 0;
  std::vector<int32_t> in_, tgt_;
  RowSegments segments_;  // packed rows: the samples in each validation row
  std::string base_json_;  // LoRA: the frozen base's source and checksum
};

TrainingRun::TrainingRun(const Plan& plan, const TrainOptions& opt, Communicator* comm, Device& device, TrainResult& result)
    : plan_(plan),
      opt_(opt),
      comm_(comm),
      device_(device),
      result_(result),
      rank_(comm ? mesh_coord(plan.mesh.shape, comm->rank()).data : 0),
      lead_(!comm || comm->rank() == 0) {
  const int W = plan.topology.world_size, D = plan.batch.world_size;  // the world, and its data-parallel ranks
  // Inputs first: a bad data file fails before anything is allocated.
  if (plan.data.type == DataType::jsonl) samples_ = open_samples(plan.data, plan.model.hp.vocab_size, plan.seq_len, plan.topology.ranks_per_node);
  else stream_ = open_token_stream(plan.data, plan.model.hp.vocab_size, plan.run.seed);
  stop_point("reading the data");
  // Several ranks: each draws its own micro batches of the same global batch and gradients are summed
  // across ranks before the step. Rank 0 alone writes the run directory.
  DS_CHECK((W > 1) == (comm != nullptr) && (!comm || (comm->world_size() == W && comm->rank() == plan.topology.rank)),
           "the communicator does not match the plan's topology");
  DS_CHECK(plan.mesh.shape.world() == W && plan.mesh.shape.data == D, "the plan's mesh does not match its topology");
  groups_ = MeshGroups(plan, comm);
  // (from here a failure tells the groups first, while what is built so far still stands: Communicator::abort)
  try {
    checkpoint_plan_json_ = plan.mesh.shape.splits_the_model() && !opt.plan_json.empty() ? with_whole_model_layout(opt.plan_json, plan)
                                                                                          : opt.plan_json;
    const SamplerOptions sampling{plan.seq_len, plan.batch.micro_batch, plan.batch.grad_accum, D, rank_, plan.data.val_fraction,
                                  plan.run.seed, plan.data.shuffle, plan.data.packing};
    sampler_ = samples_ ? std::make_unique<BatchSampler>(*samples_, sampling) : std::make_unique<BatchSampler>(*stream_, sampling);

    keep_freed_memory();
    result.baseline_rss_bytes = resident_bytes();
    torch::set_num_threads(plan.threads);
    omp_set_num_threads(plan.threads);
    report_ = std::make_unique<RunReport>(plan, opt, lead_, result);
    if (lead_ && !opt.profile) check_free_space(plan);  // a profile writes no checkpoint
    open_swappers();
    result.device_baseline_bytes = device.memory_in_use();
    stop_point("opening the swap files");
    flat_ = FlatParams::allocate(plan, rank_, device);
    stop_point("allocating the buffers");
    zero_ = std::make_unique<ZeroExchange>(plan, flat_, groups_.data_comm, param_swap_.get());
    model_ = make_model(plan, flat_, groups_.tensor.get());
    // ds profile and the flops_profiler block time each block around ZeRO's hooks (or none).
    profiling_ = keeps_step_measurements(plan, opt);
    // (ZeRO's gathers and the host's step not left to the next forward: a step's figures are its own)
    DS_CHECK(!profiling_ || (!plan.execution.gather_ahead && !plan.execution.step_in_forward),
             "a profile of a plan that leaves a step's work to the next forward");
    zero_->host_work().on = profiling_;
    if (profiling_) {
      block_timer_ = std::make_unique<BlockTimer>(zero_->hooks_blocks() ? zero_.get() : nullptr, plan.model.hp.num_layers, device.compute_stream());
      model_->set_block_hooks(block_timer_.get());
      model_->set_block_parts(block_timer_.get());
    } else if (zero_->hooks_blocks()) {
      model_->set_block_hooks(zero_.get());
    }
    scaler_ = std::make_unique<LossScaler>(plan.precision.loss_scaling);
    stepper_ = std::make_unique<OptimizerStep>(plan, flat_, *zero_, *model_, *sampler_, groups_, *scaler_, swapper_.get(), param_swap_.get());
    if (plan.mesh.shape.pipeline > 1) {
      pipeline_ = std::make_unique<PipelineStageRunner>(
          *model_, groups_.pipeline.get(), static_cast<int>(plan.batch.grad_accum),
          std::vector<int64_t>{plan.batch.micro_batch, plan.seq_len, plan.model.hp.hidden_size},
          // received where the model's forward reads its weights (a pipeline's stages are ZeRO 0-1: compute is whole)
          torch::TensorOptions().dtype(to_torch(plan.precision.compute_dtype)).device(flat_.compute.device()));
      stepper_->set_pipeline(pipeline_.get(), groups_.tied.get());
    }
    stepper_->set_sample_memory(opt.profile);
    // ZeRO-Offload: the host steps most tiles during the next forward, each before the block that reads it.
    if (plan.execution.step_in_forward) model_->set_block_hooks(stepper_->forward_hooks(zero_->hooks_blocks() ? zero_.get() : nullptr));
    describe_states();
  } catch (const std::exception& e) {
    abort(e.what());
    throw;
  }
}

// Optimizer states on NVMe: the folder is checked and the swap files reserved before anything else is
// allocated; a swap directory a dead run left behind is named, with the command that removes it.
void TrainingRun::open_swappers() {
  RunLog& log = report_->log();
  const bool states_on_nvme = plan_.execution.find(BufferRole::master, Place::nvme) != nullptr;
  const bool params_on_nvme = plan_.execution.find(BufferRole::params, Place::nvme) != nullptr;
  if (lead_) {
    std::vector<std::string> roots;
    if (states_on_nvme) roots.push_back(plan_.zero.offload_optimizer.nvme_path);
    if (params_on_nvme && (roots.empty() || roots[0] != plan_.zero.offload_param.nvme_path))
      roots.push_back(plan_.zero.offload_param.nvme_path);
    for (const std::string& root : roots)
      for (const StaleSwap& st : stale_swap_directories(root))
        log.note("ds train: warning: " + st.path + " (" + format_bytes(static_cast<double>(st.bytes)) + ") was left by process " +
                 std::to_string(st.pid) + ", which is gone: remove it with `rm -r " + st.path + "`");
  }
  if (params_on_nvme) {
    param_swap_ = std::make_unique<ParamSwapper>(plan_, rank_);
    if (lead_)
      log.note("ds train: parameters on NVMe in " + param_swap_->directory() + " (" + format_bytes(param_swap_->file_bytes()) + ", " +
               io_mode(param_swap_->direct()) + ")");
  }
  if (states_on_nvme) {
    swapper_ = std::make_unique<OptimizerSwapper>(plan_, rank_, 1 + plan_.optimizer.moments);
    if (lead_)
      log.note("ds train: optimizer states on NVMe in " + swapper_->directory() + " (" + format_bytes(swapper_->file_bytes()) + ", " +
               std::to_string(swapper_->sub_groups().size()) + " sub-groups, " + io_mode(swapper_->direct()) + ")");
  }
}

void TrainingRun::describe_states() {
  const int moments = plan_.optimizer.moments;
  const std::vector<StateSpan>& spans = flat_.spans;
  spans_.clear();
  for (size_t i = 0; i < spans.size(); ++i) {
    const FlatParams::States& st = flat_.states[i];
    spans_.push_back({FlatParams::data_or_null(st.master), FlatParams::data_or_null(st.exp_avg), FlatParams::data_or_null(st.exp_avg_sq),
                      spans[i].numel(), segments_within(flat_.owned, spans[i].begin, spans[i].end), plan_.layout.numel});
    spans_.back().verify = i == 0;  // the first span's load verified every data set
  }
  buffers_ = spans_[0];
  buffers_.numel = plan_.execution.local_numel;
  buffers_.segments = flat_.owned;
  if (swapper_) buffers_.pieces = swapped_pieces(*swapper_, moments);
  if (plan_.mesh.shape.splits_the_model()) {
    // A rank's states are its share's: checkpointed as the whole model's elements they are, so the checkpoint
    // is the whole model's (any mesh or one rank resumes it, convert-ckpt reads it). Each rank loads every
    // element it holds (each span its own); what several ranks hold (tensors every tensor rank holds whole, the
    // tied table) is written by one alone.
    const int r = groups_.tensor ? groups_.tensor->rank() : 0;
    const ModelSpec& whole = plan_.trained();  // the whole run's trained tensors (the model's, those not frozen, the adapter's)
    const auto mapped = [&](bool writing) {
      return whole_segments(plan_.model, whole, plan_.own.trained, plan_.mesh.shape.tensor, r, plan_.layout, flat_.owned, writing);
    };
    buffers_.model_numel = whole.num_params;
    buffers_.segments = mapped(/*writing=*/true);
    const std::vector<OwnedSegment> held = mapped(/*writing=*/false);
    for (size_t i = 0; i < spans.size(); ++i) {
      spans_[i].model_numel = whole.num_params;
      spans_[i].segments = segments_within(held, spans[i].begin, spans[i].end);
    }
  }
  // One span the host reads (host memory, a CPU device's, or NVMe's swapped pieces) is saved as it is; states
  // on a device the host cannot address, or in several places, are drawn into the shard piece by piece
  // through counted copies.
  if (spans.size() == 1 && (spans[0].place != Place::device || device_.host_addresses_device())) return;
  const ShardPieces swapped = swapper_ ? swapped_pieces(*swapper_, moments) : ShardPieces{};
  buffers_.pieces.moments = moments;
  buffers_.pieces.read = [this, swapped](int64_t at, int64_t n, float* m, float* e1, float* e2) {
    for (size_t i = 0; i < flat_.spans.size(); ++i) {
      const StateSpan& span = flat_.spans[i];
      const int64_t from = std::max(at, span.begin), to = std::min(at + n, span.end);
      if (from >= to) continue;
      const int64_t within = from - at, k = to - from;
      float* out[3] = {m ? m + within : nullptr, e1 ? e1 + within : nullptr, e2 ? e2 + within : nullptr};
      if (span.place == Place::nvme) {
        swapped.read(from, k, out[0], out[1], out[2]);
        continue;
      }
      const FlatParams::States& st = flat_.states[i];
      const torch::Tensor* states[3] = {&st.master, &st.exp_avg, &st.exp_avg_sq};
      for (int s = 0; s < 3; ++s)
        if (out[s] && states[s]->defined())
          device_.copy(torch::from_blob(out[s], {k}, torch::kFloat32), Place::host, states[s]->narrow(0, from - span.begin, k), span.place);
    }
  };
}

// A checkpoint's part into states the host cannot address (`dest`: the part's master and moments, as the
// device's tensors): read into host memory, then copied over.
CheckpointScalars load_through_host(Device& device, const std::string& dir, const CheckpointBuffers& part,
                                    const std::array<const torch::Tensor*, 3>& dest, int moments) {
  torch::Tensor host = torch::empty({static_cast<int64_t>(1 + moments), std::max<int64_t>(part.numel, 1)}, torch::kFloat32);
  CheckpointBuffers staged = part;
  float** const from[3] = {&staged.master, &staged.exp_avg, &staged.exp_avg_sq};
  for (int s = 0; s < 3; ++s) *from[s] = dest[s]->defined() && s <= moments ? host[s].data_ptr<float>() : nullptr;
  const CheckpointScalars sc = load_checkpoint(dir, staged);
  for (int s = 0; s < 3; ++s)
    if (dest[s]->defined() && s <= moments)
      device.copy(dest[s]->narrow(0, 0, part.numel), Place::device, host[s].narrow(0, 0, part.numel), Place::host);
  return sc;
}

void TrainingRun::load_base() {
  if (plan_.frozen.empty()) return;
  const FrozenBase base = load_frozen_base(plan_, flat_, device_, rank_, groups_.tensor ? groups_.tensor->world_size() : 1,
                                           groups_.tensor ? groups_.tensor->rank() : 0, [this](const char* phase) { stop_point(phase); });
  base_json_ = base.record;
  if (!base.note.empty()) report_->log().note(base.note);
}

// The model is initialised the same way at every stage and world size; each rank keeps its part, drawn
// parameter by parameter (a sharded or swapped rank never holds the whole model in fp32).
void TrainingRun::draw_weights() {
  std::function<const float*(const OwnedSegment&)> values;
  InitialWeights drawn(plan_, plan_.run.seed, false, groups_.tensor ? groups_.tensor->rank() : 0);
  torch::Tensor whole;
  const std::unique_ptr<WeightSource> source = plan_.run.init_from.empty() ? nullptr : open_weights(plan_.run.init_from);
  const bool from_adapter = source && source->kind() == WeightsKind::peft_adapter;
  if (from_adapter) {  // a PEFT adapter's A and B, continued
    check_peft_adapter(*source, plan_.lora);
    whole = torch::zeros({plan_.layout.numel}, torch::kFloat32);
    for (size_t k = 0; k < plan_.layout.params.size(); ++k) {
      const ParamSlot& p = plan_.layout.params[k];
      float* at = whole.data_ptr<float>() + p.offset;
      if (groups_.tensor) {  // the whole adapter tensor read, this tensor rank's share kept
        const TensorSpec& t = plan_.lora.adapters.tensors[static_cast<size_t>(plan_.own.trained[k].whole)];
        torch::Tensor all = torch::empty({t.numel}, torch::kFloat32);
        source->read_f32(p.name, all.data_ptr<float>());
        whole.narrow(0, p.offset, p.numel)
            .copy_(take_share(all.view(t.shape), tensor_slice_of(plan_.model, t, groups_.tensor->world_size(), groups_.tensor->rank())).view(-1));
      } else {
        source->read_f32(p.name, at);
      }
      if (!std::all_of(at, at + p.numel, [](float v) { return std::isfinite(v); }))
        throw UserError("the adapter '" + source->path() + "' holds inf or NaN in " + p.name + ": it was saved from a run that diverged",
                        "continue from an earlier save of the adapter, or start the adapter fresh (model.init_from = its base)");
    }
    report_->log().note("ds train: adapter from " + source->path() + " (LoRA r " + std::to_string(source->lora->r) + ", " +
                        std::to_string(plan_.layout.params.size()) + " tensors; step, schedule and optimizer start fresh)");
    values = [&](const OwnedSegment& s) { return whole.data_ptr<float>() + s.global; };
  } else if (!source || plan_.lora.enabled) {  // a LoRA run's other init_from is its frozen base
    values = [&](const OwnedSegment& s) { return drawn.param(s.param) + (s.global - plan_.layout.params[static_cast<size_t>(s.param)].offset); };
  } else {
    whole = torch::zeros({plan_.layout.numel}, torch::kFloat32);
    // Each parameter of the layout is a tensor of the model (model.freeze leaves some out).
    const std::vector<std::string> names = match_weights(*source, plan_.model);
    const std::vector<int>& tensors = plan_.trained_model_tensors();
    for (size_t k = 0; k < tensors.size(); ++k) {
      stop_point("reading the initial weights");
      const ParamSlot& p = plan_.layout.params[k];
      const std::string& name = names[static_cast<size_t>(tensors[k])];
      if (!groups_.tensor) {
        source->read_f32(name, whole.data_ptr<float>() + p.offset);
        continue;
      }
      // Tensor parallel: the whole tensor read, this rank's share kept.
      const TensorSpec& t = plan_.model.tensors[static_cast<size_t>(tensors[k])];
      torch::Tensor all = torch::empty({t.numel}, torch::kFloat32);
      source->read_f32(name, all.data_ptr<float>());
      whole.narrow(0, p.offset, p.numel)
          .copy_(take_share(all.view(t.shape), tensor_slice_of(plan_.model, t, groups_.tensor->world_size(), groups_.tensor->rank())).view(-1));
    }
    report_->log().note(std::string("ds train: weights from ") + weights_kind_name(source->kind()) + " " + source->path() +
                        " (step, schedule and optimizer start fresh)");
    values = [&](const OwnedSegment& s) { return whole.data_ptr<float>() + s.global; };
  }
  // Into the master copy, wherever it lives: a copy from the host, counted like any other.
  const auto put = [&](const torch::Tensor& master, Place place, const OwnedSegment& s) {
    stop_point(source ? "reading the initial weights" : "drawing the initial weights");
    device_.copy(master.narrow(0, s.local, s.numel), place,
                 torch::from_blob(const_cast<float*>(values(s)), {s.numel}, torch::kFloat32), Place::host);
  };
  // (the segments of this rank's own layout: a tensor rank's checkpoint segments are the whole model's)
  for (size_t i = 0; i < flat_.spans.size(); ++i) {
    const StateSpan& span = flat_.spans[i];
    const std::vector<OwnedSegment> segments = segments_within(flat_.owned, span.begin, span.end);
    if (span.place == Place::nvme)
      swap_in_weights(*swapper_, segments, values);
    else
      for (const OwnedSegment& s : segments) put(flat_.states[i].master, span.place, s);
  }
}

void TrainingRun::resume() {
  RunLog& log = report_->log();
  // States on a device the host cannot address come in through host memory (counted copies).
  const bool through_host = !device_.host_addresses_device();
  const int moments = plan_.optimizer.moments;
  CheckpointScalars sc;
  for (size_t i = 0; i < flat_.spans.size(); ++i) {  // each span from the checkpoint, where its states live
    const StateSpan& span = flat_.spans[i];
    const FlatParams::States& st = flat_.states[i];
    const CheckpointScalars got =
        span.place == Place::nvme ? swap_in_checkpoint(*swapper_, opt_.resume_from, spans_[i])
        : through_host && span.place == Place::device
            ? load_through_host(device_, opt_.resume_from, spans_[i], {&st.master, &st.exp_avg, &st.exp_avg_sq}, moments)
            : load_checkpoint(opt_.resume_from, spans_[i]);
    if (i == 0) sc = got;
  }
  check_frozen_base(plan_, opt_.resume_from, sc.base_json, base_json_);
  result_.first_step = sc.step;
  stepper_->set_applied(sc.applied_steps);
  result_.skipped_steps = sc.skipped_steps;
  if (scaler_->enabled()) scaler_->restore(sc.loss_scaler);
  if (sc.seed != plan_.run.seed)
    log.note("ds train: warning: the checkpoint was trained with seed " + std::to_string(sc.seed) + ", this run uses " +
             std::to_string(plan_.run.seed) + ": the data order changes from here on");
  log.note("ds train: resuming from " + opt_.resume_from + " at step " + std::to_string(sc.step));
}

void TrainingRun::initialise() {
  load_base();
  stop_point("loading the frozen base");
  if (opt_.resume_from.empty())
    draw_weights();
  else
    resume();
  stop_point(opt_.resume_from.empty() ? "placing the initial weights" : "loading the checkpoint");
  stepper_->refresh_weights(false);
  stop_point("publishing the weights");
  // The run's metrics continue from here: the steps an earlier start recorded after this point go.
  report_->open_metrics(result_.first_step);
}

void TrainingRun::save(int64_t step) {
  stepper_->finish_update();  // (the tiles left to the next forward: the states and weights written are the step's)
  result_.tiles_stepped_in_forward = stepper_->tiles_stepped_in_forward();  // (so far: the run's last step saves)
  zero_->finish_published();  // (stages 1-2 gathering ahead: the weights written are the step's, whole)
  if (opt_.profile) return;  // a profile measures; it leaves no state behind
  // Never write non-finite weights (they would be resumed from, and keep_last would prune a good
  // checkpoint for them). Every rank checks its part; the verdict is agreed so all stop together.
  double bad = stepper_->master_finite() ? 0.0 : 1.0;
  if (comm_) {
    torch::Tensor t = torch::tensor({bad}, torch::kFloat64);
    comm_->all_reduce_sum(t, CollectiveKind::control);
    bad = t.item<double>();
  }
  if (bad > 0)
    throw std::runtime_error("the weights are not finite after step " + std::to_string(step) +
                             ": no checkpoint written (the previous ones are kept); lower the learning rate or keep gradient_clipping on");
  if (rank_ != 0 && !plan_.execution.sharded) return;  // stage 0: every data rank holds the same state
  CheckpointScalars sc;
  sc.step = step;
  sc.applied_steps = stepper_->applied();
  sc.skipped_steps = result_.skipped_steps;
  sc.seed = plan_.run.seed;
  sc.loss_scaler = scaler_->state();
  sc.loss = last_loss_;
  sc.base_json = base_json_;
  // Every rank that holds a part writes it: ZeRO's data ranks (each tensor rank's and stage's), or at stage 0
  // the first data rank's tensor ranks and stages.
  CheckpointWriter writer;
  if (comm_ && plan_.execution.sharded)
    writer = {comm_->rank(), comm_->world_size(), [this] { comm_->barrier(); }};
  else if (groups_.writers)
    writer = {groups_.writers->rank(), groups_.writers->world_size(), [this] { groups_.writers->barrier(); }};
  const SavedCheckpoint saved =
      save_checkpoint(plan_.run.output_dir, sc, buffers_, checkpoint_plan_json_, opt_.resolved_config_json, plan_.run.keep_last, writer);
  result_.last_checkpoint = saved.path;
  if (lead_)
    report_->log().note("ds train: checkpoint at step " + std::to_string(step) + " -> " + saved.path + " (" +
                        format_bytes(static_cast<double>(saved.bytes)) + (writer.world_size > 1 ? ", a file from each of " + std::to_string(writer.world_size) + " ranks" : "") +
                        ")");
  if (lead_)
    for (const std::string& note : saved.notes) report_->log().note("ds train: " + note);
}

// Validation loss over eval_batches global batches of held-out windows: the same windows whatever the
// world size and micro batch (eval_batches x train_batch_size of them, in order). Every rank evaluates
// its share, the same number of micro batches each (so stage 3's gathers pair up), and the sums are
// added across ranks: every rank gets the same figure.
double TrainingRun::validate() {
  torch::NoGradGuard ng;
  stepper_->finish_update();  // (the weights it reads are the last step's, every tile of them)
  const int64_t B = plan_.batch.micro_batch, T = plan_.seq_len;
  const int W = plan_.batch.world_size;  // the data-parallel ranks: a tensor group evaluates the same rows
  const int64_t calls = plan_.run.eval_batches * plan_.batch.train_batch_size / (B * W);  // eval_batches x accumulation
  // Masked rows (fine-tuning data): the mean over every counted target, as the training loss is.
  const bool masked = sampler_->masked();
  model_->set_loss_gradient(1.0);  // no gradient is made here; the last training micro batch's (0 if it counted nothing) must not reach the head
  // Validation micro batch i of this rank: drawn, its segments given to the model, dropout off; its weight in the
  // mean (its counted targets, masked) noted.
  std::vector<double> losses, weights;
  const auto draw = [&](int64_t i) {
    sampler_->val_batch(i * W + rank_, in_, tgt_, &segments_);  // samples [(i W + rank) B, + B) of the validation sequence
    model_->set_segments(&segments_);
    model_->set_dropout(0, false);
    weights.push_back(masked ? static_cast<double>(std::count_if(tgt_.begin(), tgt_.end(), [](int32_t t) { return t >= 0; })) : 1.0);
    return PipelineStageRunner::Batch{to_long_tensor(in_, B, T), to_long_tensor(tgt_, B, T)};
  };
  Communicator* summed_over = groups_.data_comm;
  if (pipeline_) {
    // The stages' forwards in turn; the last stage's losses, from its first tensor rank, summed over the world.
    const std::vector<torch::Tensor> staged = pipeline_->evaluate(static_cast<int>(calls), [&](int i, bool) { return draw(i); });
    groups_.settle();  // the stages' messages the losses follow, before the host reads them
    for (const torch::Tensor& l : staged) losses.push_back(l.item<double>());
    if (groups_.tensor && groups_.tensor->rank() != 0) losses.clear();  // (the tensor group's ranks hold the same)
    summed_over = comm_;
  } else {
    for (int64_t i = 0; i < calls; ++i) {
      const PipelineStageRunner::Batch batch = draw(i);
      zero_->begin_micro_step(true);
      const torch::Tensor loss_t = model_->loss(batch.inputs, batch.targets);
      groups_.settle();  // the gathers this forward waited on (stage 3), before the host reads its loss
      losses.push_back(loss_t.item<double>());
    }
  }
  double sum = 0, counted = 0;
  for (size_t i = 0; i < losses.size(); ++i) sum += losses[i] * weights[i], counted += weights[i];
  if (summed_over) {
    torch::Tensor total = masked ? torch::tensor({sum, counted}, torch::kFloat64) : torch::full({1}, sum, torch::kFloat64);
    summed_over->all_reduce_sum(total, CollectiveKind::validation_loss);
    sum = total[0].item<double>();
    if (masked) counted = total[1].item<double>();
  }
  if (masked) return counted > 0 ? sum / counted : 0;
  return sum / static_cast<double>(calls * W);
}

// `t0`: the step's start on the host's clock (the collectives' spans); `step_start`: on the compute stream's (the blocks').
void TrainingRun::record_profile(const StepOutcome& out, std::chrono::steady_clock::time_point t0, const Event& step_start) {
  BlockTimer::Taken taken = block_timer_->take(step_start);
  result_.block_forward_s.push_back(std::move(taken.forward));
  result_.block_backward_s.push_back(std::move(taken.backward));
  result_.block_spans.push_back(std::move(taken.spans));
  result_.attention_forward_s.push_back(std::move(taken.attention_forward));
  result_.mlp_backward_s.push_back(std::move(taken.mlp_backward));
  result_.phase_rss_bytes.push_back(out.phase_rss_bytes);
  if (!device_.host_addresses_device()) result_.phase_device_bytes.push_back(out.phase_device_bytes);
  std::vector<CollectiveSpan> spans;
  for (Communicator* c : groups_.all())  // the world's and a mesh's groups'
    for (const Communicator::Event& e : c->take_events())
      spans.push_back({std::string(collective_name(e.kind)) + (e.received ? " (received)" : ""), std::chrono::duration<double>(e.issued - t0).count(),
                       std::chrono::duration<double>(e.done - e.issued).count(), e.bytes});
  std::sort(spans.begin(), spans.end(), [](const CollectiveSpan& a, const CollectiveSpan& b) { return a.start_s < b.start_s; });
  result_.collective_spans.push_back(std::move(spans));
  result_.host_work_spans.push_back(zero_->host_work().take(t0));
}

// Divergence: the loss above divergence_factor x its best of this run for 3 steps running ends the run
// before the diverged weights are saved; pruning keeps the checkpoint saved at the lowest loss.
void TrainingRun::check_divergence(int64_t step, double loss) {
  last_loss_ = loss;
  if (loss < best_loss_) best_loss_ = loss, best_step_ = step + 1;
  const double factor = plan_.run.divergence_factor;
  steps_above_ = factor > 0 && loss > factor * best_loss_ ? steps_above_ + 1 : 0;
  if (steps_above_ < 3) return;
  const std::string best = best_checkpoint(plan_.run.output_dir);
  throw std::runtime_error("the run diverged: the loss has been above " + format_double(factor) + "x its best (" +
                           format_fixed(best_loss_, 4) + " at step " + std::to_string(best_step_) + ") for 3 steps, " +
                           format_fixed(loss, 4) + " at step " + std::to_string(step + 1) +
                           "; no checkpoint of these weights was written. " +
                           (best.empty() ? std::string("No checkpoint was saved before it")
                                         : "The checkpoint saved at the lowest loss is kept: " + best) +
                           ". Lower the learning rate (and resume with train.resume=PATH), or set train.divergence_factor=0 "
                           "to train on regardless");
}

void TrainingRun::loop() {
  g_starting = false;  // from here a stop saves after the current step
  RunLog& log = report_->log();
  FlatParams::Bytes held = flat_.bytes();
  if (swapper_) held.buffers += swapper_->buffer_bytes();  // the host buffers sub-groups are swapped through
  if (param_swap_) held.buffers += param_swap_->buffer_bytes();
  if (!plan_.topology.device_traits().memory_is_host) log.note("ds train: training on " + device_.name());
  const std::string notes = sampler_->notes();
  report_->describe(held, (samples_ ? samples_->description : stream_->describe()) + (notes.empty() ? "" : "; " + notes),
                    sampler_->train_tokens(), sampler_->val_tokens());
  if (opt_.profile) {
    const GemmPeak peak = measure_gemm_peak(plan_.model, plan_.batch.micro_batch * plan_.seq_len, plan_.precision.compute_dtype, device_);
    result_.gemm_peak_flops = peak.flops_per_s;
    log.note("ds profile: matmul peak " + format_fixed(peak.flops_per_s / 1e12, 3) + " TFLOP/s in " +
             dtype_name(plan_.precision.compute_dtype) + " at the model's " + std::to_string(peak.shapes) + " GEMM shapes (" +
             format_fixed(peak.seconds, 2) + " s)");
  }
  // ds profile on a GPU: every kernel of each step, from here on (the matmul peak above is no step's).
  if (opt_.profile && !plan_.topology.device_traits().memory_is_host) {
    device_.compute_stream().synchronize();
    kernel_trace_ = KernelTrace::start(&result_.kernels_not_listed);
    if (!kernel_trace_) log.note("ds profile: no kernel list: " + result_.kernels_not_listed);
  }
  report_->start();
  if (result_.first_step >= plan_.steps)
    log.note("ds train: the checkpoint is at step " + std::to_string(result_.first_step) + " and train.steps is " +
             std::to_string(plan_.steps) + ": nothing to do (raise train.steps to continue)");
  result_.steps = result_.first_step;
  bool stop_requested = false;  // Ctrl-C or SIGTERM, agreed across ranks
  if (profiling_)
    for (Communicator* c : groups_.all()) {
      c->record_events(true);
      c->drop_events();  // the start's gathers are not a step's
    }
  const auto first_start = std::chrono::steady_clock::now();
  int64_t skipped_this_run = 0;
  for (int64_t step = result_.first_step; step < plan_.steps && !stop_requested; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::shared_ptr<Event> step_start = profiling_ ? device_.compute_stream().record_timed() : nullptr;
    if (profiling_) result_.step_start_s.push_back(std::chrono::duration<double>(t0 - first_start).count());
    if (comm_) comm_->mark_step(step);  // (the groups report through the world's: they share its store and step)
    const CommLedger before = groups_.ledger();
    report_->begin_step(comm_ ? &before : nullptr);
    StepOutcome out;
    try {
      out = stepper_->run(step, g_stop_signal);
    } catch (const DataReadError&) {
      // The data went away under the run (a file truncated or replaced): its batches are read before the
      // step updates anything, so the weights are the last completed step's. One process saves them.
      if (!comm_ && step > result_.first_step) {
        save(step);
        report_->log().note("ds train: the data could not be read at step " + std::to_string(step + 1) + "; saved the " +
                            std::to_string(step) + " completed steps first");
      }
      throw;
    }
    groups_.settle();                         // the step's last gathers, bounded by the comm timeout
    device_.compute_stream().synchronize();  // a GPU's step has run when its time is taken
    result_.device_peak_bytes = std::max(result_.device_peak_bytes, device_.memory_in_use());
    if (block_timer_) record_profile(out, t0, *step_start);
    const CommLedger after = groups_.ledger();
    report_->end_collectives(comm_ ? &after : nullptr);
    for (const std::string& note : out.notes) log.note(note);
    stop_requested = out.stop_requested;
    if (stop_requested && !g_stop_signal) g_stop_signal = SIGINT;  // another rank was interrupted
    const double step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // (the stream was waited for; the records' flush and sums are the profile's, not the step's time)
    if (kernel_trace_) take_kernels_of_step();
    std::optional<double> val;
    if (!opt_.profile && plan_.run.eval_every > 0 && ((step + 1) % plan_.run.eval_every == 0 || step + 1 == plan_.steps) &&
        sampler_->val_tokens() > 0) {
      val = validate();
      if (block_timer_) block_timer_->discard();  // (the flops_profiler block) validation's forward is no step's
    }
    report_->step(step, out, val, step_s);
    // ds profile: the matmul rate now, outside the step's time, for this step's MFU.
    constexpr double kGemmBudgetPerStep = 0.25;  // seconds
    if (opt_.profile)
      result_.gemm_rates.push_back(
          measure_gemm_peak(plan_.model, plan_.batch.micro_batch * plan_.seq_len, plan_.precision.compute_dtype, device_, kGemmBudgetPerStep)
              .flops_per_s);
    if (kernel_trace_) kernel_trace_->take(), kernel_trace_->take_copies();  // the matmul rate's (its rounds end with a stream wait)
    skipped_this_run += out.skipped;
    if (!out.skipped && std::isfinite(out.loss)) check_divergence(step, out.loss);
    const bool cadence = plan_.run.save_every > 0 && (step + 1) % plan_.run.save_every == 0;
    if (!comm_) stop_requested = g_stop_signal != 0;  // one process: react at once; ranks use the agreed flag
    if (cadence || step + 1 == plan_.steps || stop_requested) save(step + 1);
  }
  zero_->finish_published();  // (the last step's weights, whole, for whatever reads them after the run)
  // fp16 that never found a scale: a run that applied none of its steps trained nothing.
  const int64_t ran = result_.steps - result_.first_step;
  if (!stop_requested && ran >= kMinStepsForAllSkipped && skipped_this_run == ran)
    throw std::runtime_error("every one of this run's " + std::to_string(ran) +
                             " steps was skipped for inf/NaN gradients: the weights never changed; lower fp16.loss_scale or "
                             "fp16.initial_scale_power, or the learning rate (its checkpoints are of the starting weights)");
  // A stop that came during the last step cut nothing short: the run is done.
  result_.interrupted = stop_requested && result_.steps < plan_.steps;
  result_.stop_signal = result_.interrupted ? static_cast<int>(g_stop_signal) : 0;
  report_->finish();
}

}  // namespace

TrainResult train(const Plan& plan, const TrainOptions& opt, Communicator* comm, Device* device) {
  // The plan's own answer: what the build lacks on its device (when the topology carries the build), what ds
  // cannot do there yet. The machine (a GPU the driver shows) is the device's to say when it is created.
  refuse_not_runnable(plan, not_yet_runnable(plan, opt.profile));
  // Ctrl-C and SIGTERM are taken from the start: while starting they end one process at the next stop
  // point; once training, after the current step with a checkpoint.
  struct Starting {  // until the loop begins, however train() ends
    Starting() { g_starting = true; }
    ~Starting() { g_starting = false; }
  } starting;
  const StopSignals signals(opt.set_stop_handler);
  std::unique_ptr<Device> own;
  if (!device) own = Device::create(plan.topology.device, plan.topology.local_rank);
  TrainResult result;
  try {
    // A pipeline stage's rank trains its own stage's layout (the plan describes the heaviest stage's).
    const Plan own_plan = with_own_stage(plan);
    TrainingRun run(own_plan, opt, comm, device ? *device : *own, result);
    try {
      run.initialise();
      run.loop();
    } catch (const std::exception& e) {  // (while the run and its memory still stand)
      run.abort(e.what());
      throw;
    }
  } catch (const StoppedWhileStarting& stopped) {
    result.interrupted = true;
    result.stop_signal = stopped.signal;
    result.stopped_while = stopped.phase;
  }
  return result;
}

}  // namespace ds
