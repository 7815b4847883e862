#include "engine/runtime/trainer.hpp"

#include <malloc.h>
#include <sys/statvfs.h>
#include <omp.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <functional>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <optional>

#include "common/error.hpp"
#include "common/format.hpp"
#include "common/stop_signals.hpp"
#include "engine/runtime/block_pool.hpp"
#include "engine/runtime/checkpoint.hpp"
#include "engine/runtime/comm.hpp"
#include "engine/runtime/data/sampler.hpp"
#include "engine/runtime/data/token_source.hpp"
#include "engine/runtime/flat_params.hpp"
#include "engine/runtime/language_model.hpp"
#include "engine/runtime/loss_scaler.hpp"
#include "engine/runtime/nvme_swap.hpp"
#include "engine/runtime/gemm_peak.hpp"
#include "engine/runtime/optimizer_step.hpp"
#include "engine/runtime/resident_memory.hpp"
#include "engine/runtime/run_report.hpp"
#include "engine/runtime/weights.hpp"
#include "engine/runtime/zero.hpp"

namespace ds {
namespace {

// Ctrl-C (SIGINT) and SIGTERM (Slurm, Kubernetes, `timeout`) both stop the run after the current step
// with a checkpoint; the signal decides the exit code (130 or 143).
std::atomic<int> g_stop_signal{0};
void on_stop_signal(int sig) { g_stop_signal = sig; }

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
  const double need = static_cast<double>(plan.layout.numel) * 4.0 * (1 + plan.optimizer.moments) + (1 << 20);
  struct statvfs fs {};
  if (statvfs(plan.run.output_dir.c_str(), &fs) != 0) return;
  const double free_bytes = static_cast<double>(fs.f_bavail) * static_cast<double>(fs.f_frsize);
  if (free_bytes < need)
    throw UserError("train.output_dir '" + plan.run.output_dir + "' has " + format_bytes(free_bytes) + " free; a checkpoint needs " +
                        format_bytes(need),
                    "free some space, or choose another train.output_dir");
}

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

std::vector<std::string> unsupported_by_trainer(const Plan& plan) {
  std::vector<std::string> why;
  if (plan.topology.device != DeviceKind::cpu) why.push_back("training on CUDA devices (this build trains on the CPU)");
  if (plan.model.hp.arch == ModelArch::gpt2 && !plan.model.hp.tie_word_embeddings) why.push_back("an untied gpt2 output head");
  if (plan.precision.grad_dtype != plan.precision.param_dtype)
    why.push_back("data_types.grad_accum_dtype other than the parameters' dtype");
  // Optimizer offload runs to the CPU (the states in host buffers, the optimizer stepping them there) and
  // to NVMe (swapped sub-group by sub-group), whole or partial (ratio); parameters offload to the CPU or
  // NVMe (stage 3: the partition in host buffers or a file, gathered block by block).
  return why;
}

TrainResult train(const Plan& plan, const TrainOptions& opt) {
  // Several ranks: join the group the topology describes (Gloo; its rendezvous address came from the CLI).
  std::unique_ptr<Communicator> own;
  if (plan.topology.world_size > 1)
    own = Communicator::create(plan.execution.backend, plan.topology,
                               std::chrono::milliseconds(static_cast<int64_t>(plan.run.comm_timeout_s * 1000)));
  return train(plan, opt, own.get());
}

TrainResult train(const Plan& plan, const TrainOptions& opt, Communicator* comm) {
  const auto why = unsupported_by_trainer(plan);
  if (!why.empty()) {
    std::string list;
    for (const auto& w : why) list += "\n    - " + w;
    throw UserError("this build of ds cannot train this plan yet:" + list,
                    "`ds plan` shows the plan; the items above are on the roadmap (see README)");
  }
  const int64_t B = plan.batch.micro_batch, T = plan.seq_len;
  const uint64_t seed = plan.run.seed;
  const int W = plan.topology.world_size;

  // Inputs first: a bad data file fails before anything is allocated.
  auto stream = open_token_stream(plan.data, plan.model.hp.vocab_size, seed);
  // Several ranks: each draws its own micro batches of the same global batch and gradients are summed
  // across ranks before the step. Rank 0 alone writes the run directory.
  DS_CHECK((W > 1) == (comm != nullptr) && (!comm || (comm->world_size() == W && comm->rank() == plan.topology.rank)),
           "the communicator does not match the plan's topology");
  const int rank = comm ? comm->rank() : 0;
  const bool lead = rank == 0;
  BatchSampler sampler(*stream, {T, B, plan.batch.grad_accum, W, rank, plan.data.val_fraction, seed});

  keep_freed_memory();
  TrainResult result;
  result.baseline_rss_bytes = resident_bytes();
  torch::set_num_threads(plan.threads);
  omp_set_num_threads(plan.threads);
  RunReport report(plan, opt, lead, result);
  RunLog& log = report.log();
  if (lead && !opt.profile) check_free_space(plan);  // a profile writes no checkpoint

  // Optimizer states on NVMe: the folder is checked and the swap files reserved before anything else is
  // allocated; a swap directory a dead run left behind is named, with the command that removes it.
  std::unique_ptr<OptimizerSwapper> swapper;
  std::unique_ptr<ParamSwapper> param_swap;
  const bool states_on_nvme = plan.execution.find(BufferRole::master, Place::nvme) != nullptr;
  const bool params_on_nvme = plan.execution.find(BufferRole::params, Place::nvme) != nullptr;
  if (lead) {
    std::vector<std::string> roots;
    if (states_on_nvme) roots.push_back(plan.zero.offload_optimizer.nvme_path);
    if (params_on_nvme && (roots.empty() || roots[0] != plan.zero.offload_param.nvme_path))
      roots.push_back(plan.zero.offload_param.nvme_path);
    for (const std::string& root : roots)
      for (const StaleSwap& st : stale_swap_directories(root))
        log.note("ds train: warning: " + st.path + " (" + format_bytes(static_cast<double>(st.bytes)) + ") was left by process " +
                 std::to_string(st.pid) + ", which is gone: remove it with `rm -r " + st.path + "`");
  }
  if (params_on_nvme) {
    param_swap = std::make_unique<ParamSwapper>(plan, rank);
    if (lead)
      log.note("ds train: parameters on NVMe in " + param_swap->directory() + " (" + format_bytes(param_swap->file_bytes()) + ", " +
               io_mode(param_swap->direct()) + ")");
  }
  if (states_on_nvme) {
    const int states = 1 + plan.optimizer.moments;
    swapper = std::make_unique<OptimizerSwapper>(plan, rank, states);
    if (lead)
      log.note("ds train: optimizer states on NVMe in " + swapper->directory() + " (" + format_bytes(swapper->file_bytes()) + ", " +
               std::to_string(swapper->sub_groups().size()) + " sub-groups, " +
               io_mode(swapper->direct()) + ")");
  }
  FlatParams flat = FlatParams::allocate(plan, rank);
  ZeroExchange zero(plan, flat, comm, param_swap.get());
  const std::unique_ptr<LanguageModel> model = make_model(plan, flat);
  // ds profile and the flops_profiler block time each block around ZeRO's hooks (or none).
  std::unique_ptr<BlockTimer> block_timer;
  const bool profiling = keeps_step_measurements(plan, opt);
  if (profiling) block_timer = std::make_unique<BlockTimer>(zero.hooks_blocks() ? &zero : nullptr, plan.model.hp.num_layers);
  if (block_timer) {
    model->set_block_hooks(block_timer.get());
    model->set_block_parts(block_timer.get());
  } else if (zero.hooks_blocks()) {
    model->set_block_hooks(&zero);
  }
  LossScaler scaler(plan.precision.loss_scaling);
  OptimizerStep stepper(plan, flat, zero, *model, sampler, comm, scaler, swapper.get(), param_swap.get());
  stepper.set_sample_memory(opt.profile);
  CheckpointBuffers buffers{FlatParams::data_or_null(flat.master), FlatParams::data_or_null(flat.exp_avg),
                            FlatParams::data_or_null(flat.exp_avg_sq), plan.execution.local_numel, flat.owned, plan.layout.numel};
  if (swapper) buffers.pieces = swapped_pieces(*swapper, plan.optimizer.moments);
  // Partial offload: the rank's part lives in two places, the offloaded elements [0, split) (on the host or
  // swapped) and the kept rest on the device. Each is loaded on its own; saving draws both into one shard.
  const int64_t split = flat.partial() ? flat.offloaded : plan.execution.local_numel;
  CheckpointBuffers first_part = buffers;
  first_part.numel = split;
  first_part.segments = segments_within(flat.owned, 0, split);
  CheckpointBuffers kept{FlatParams::data_or_null(flat.kept_master), FlatParams::data_or_null(flat.kept_exp_avg),
                         FlatParams::data_or_null(flat.kept_exp_avg_sq), plan.execution.local_numel - split,
                         segments_within(flat.owned, split, plan.execution.local_numel), plan.layout.numel};
  kept.verify = false;  // the first part's load verified every data set
  if (flat.partial()) {
    const ShardPieces swapped = swapper ? swapped_pieces(*swapper, plan.optimizer.moments) : ShardPieces{};
    buffers.pieces.moments = plan.optimizer.moments;
    buffers.pieces.read = [&flat, &kept, split, swapped](int64_t at, int64_t n, float* m, float* e1, float* e2) {
      float* out[3] = {m, e1, e2};
      const int64_t lo = std::min(n, std::max<int64_t>(0, split - at));  // elements from the offloaded part
      if (lo > 0 && swapped.read) {
        swapped.read(at, lo, m, e1, e2);
      } else if (lo > 0) {
        const torch::Tensor* from[3] = {&flat.master, &flat.exp_avg, &flat.exp_avg_sq};
        for (int k = 0; k < 3; ++k)
          if (out[k] && from[k]->defined()) std::memcpy(out[k], from[k]->data_ptr<float>() + at, static_cast<size_t>(lo) * 4);
      }
      float* rest[3] = {kept.master, kept.exp_avg, kept.exp_avg_sq};
      for (int k = 0; k < 3; ++k)
        if (out[k] && rest[k] && n > lo) std::memcpy(out[k] + lo, rest[k] + (at + lo - split), static_cast<size_t>(n - lo) * 4);
    };
  }
  if (opt.resume_from.empty()) {
    // The model is initialised the same way at every stage and world size; each rank keeps its part,
    // drawn parameter by parameter (a sharded or swapped rank never holds the whole model in fp32).
    std::function<const float*(const OwnedSegment&)> values;
    InitialWeights drawn(plan, seed);
    torch::Tensor whole;
    if (plan.run.init_from.empty()) {
      values = [&](const OwnedSegment& s) {
        return drawn.param(s.param) + (s.global - plan.layout.params[static_cast<size_t>(s.param)].offset);
      };
    } else {
      whole = torch::zeros({plan.layout.numel}, torch::kFloat32);
      const auto source = open_weights(plan.run.init_from);
      load_weights(*source, plan.model, whole.data_ptr<float>());
      log.note(std::string("ds train: weights from ") + weights_kind_name(source->kind()) + " " + source->path() +
               " (step, schedule and optimizer start fresh)");
      values = [&](const OwnedSegment& s) { return whole.data_ptr<float>() + s.global; };
    }
    if (swapper)
      swap_in_weights(*swapper, first_part.segments, values);
    else
      for (const OwnedSegment& s : first_part.segments)
        std::memcpy(flat.master.data_ptr<float>() + s.local, values(s), static_cast<size_t>(s.numel) * 4);
    for (const OwnedSegment& s : kept.segments) std::memcpy(kept.master + s.local, values(s), static_cast<size_t>(s.numel) * 4);
  } else {
    const CheckpointScalars sc =
        swapper ? swap_in_checkpoint(*swapper, opt.resume_from, first_part) : load_checkpoint(opt.resume_from, first_part);
    if (flat.partial()) load_checkpoint(opt.resume_from, kept);
    result.first_step = sc.step;
    stepper.set_applied(sc.applied_steps);
    result.skipped_steps = sc.skipped_steps;
    if (scaler.enabled()) scaler.restore(sc.loss_scaler);
    if (sc.seed != seed)
      log.note("ds train: warning: the checkpoint was trained with seed " + std::to_string(sc.seed) + ", this run uses " +
               std::to_string(seed) + ": the data order changes from here on");
    log.note("ds train: resuming from " + opt.resume_from + " at step " + std::to_string(sc.step));
  }
  stepper.refresh_weights(false);

  double last_loss = std::numeric_limits<double>::quiet_NaN();  // of the last applied step, recorded with a checkpoint
  auto save = [&](int64_t step) {
    if (opt.profile) return;  // a profile measures; it leaves no state behind
    // Never write non-finite weights (they would be resumed from, and keep_last would prune a good
    // checkpoint for them). Every rank checks its part; the verdict is agreed so all stop together.
    double bad = stepper.master_finite() ? 0.0 : 1.0;
    if (comm) {
      torch::Tensor t = torch::tensor({bad}, torch::kFloat64);
      comm->all_reduce_sum(t, CollectiveKind::control);
      bad = t.item<double>();
    }
    if (bad > 0)
      throw std::runtime_error("the weights are not finite after step " + std::to_string(step) +
                               ": no checkpoint written (the previous ones are kept); lower the learning rate or keep gradient_clipping on");
    if (!lead && !plan.execution.sharded) return;  // stage 0: every rank holds the same state
    CheckpointScalars sc;
    sc.step = step;
    sc.applied_steps = stepper.applied();
    sc.skipped_steps = result.skipped_steps;
    sc.seed = seed;
    sc.loss_scaler = scaler.state();
    sc.loss = last_loss;
    CheckpointWriter writer;
    if (comm && plan.execution.sharded) writer = {rank, W, [&] { comm->barrier(); }};
    const SavedCheckpoint saved =
        save_checkpoint(plan.run.output_dir, sc, buffers, opt.plan_json, opt.resolved_config_json, plan.run.keep_last, writer);
    result.last_checkpoint = saved.path;
    if (lead)
      log.note("ds train: checkpoint at step " + std::to_string(step) + " -> " + saved.path + " (" +
               format_bytes(static_cast<double>(saved.bytes)) + (writer.world_size > 1 ? " in " + std::to_string(W) + " shards" : "") +
               ")");
  };
  // Validation loss over eval_batches global batches of held-out windows: the same windows whatever the
  // world size and micro batch (eval_batches x train_batch_size of them, in order). Every rank evaluates
  // its share, the same number of micro batches each (so stage 3's gathers pair up), and the sums are
  // added across ranks: every rank gets the same figure.
  std::vector<int32_t> in, tgt;
  auto validate = [&]() -> double {
    torch::NoGradGuard ng;
    const int64_t calls = plan.run.eval_batches * plan.batch.train_batch_size / (B * W);  // eval_batches x accumulation
    double sum = 0;
    for (int64_t i = 0; i < calls; ++i) {
      sampler.val_batch(i * W + rank, in, tgt);  // samples [(i W + rank) B, + B) of the validation sequence
      model->set_dropout(0, false);
      zero.begin_micro_step(true);
      sum += model->loss(to_long_tensor(in, B, T), to_long_tensor(tgt, B, T)).item<double>();
    }
    if (comm) {
      torch::Tensor total = torch::full({1}, sum, torch::kFloat64);
      comm->all_reduce_sum(total, CollectiveKind::validation_loss);
      sum = total.item<double>();
    }
    return sum / static_cast<double>(calls * W);
  };

  FlatParams::Bytes held = flat.bytes();
  if (swapper) held.buffers += swapper->buffer_bytes();  // the host buffers sub-groups are swapped through
  if (param_swap) held.buffers += param_swap->buffer_bytes();
  report.describe(held, stream->describe(), sampler.train_tokens(), sampler.val_tokens());
  if (opt.profile) {
    const GemmPeak peak = measure_gemm_peak(plan.model, B * T, plan.precision.compute_dtype);
    result.gemm_peak_flops = peak.flops_per_s;
    log.note("ds profile: matmul peak " + format_fixed(peak.flops_per_s / 1e12, 3) + " TFLOP/s in " +
             dtype_name(plan.precision.compute_dtype) + " at the model's " + std::to_string(peak.shapes) + " GEMM shapes (" +
             format_fixed(peak.seconds, 2) + " s)");
  }
  const StopSignals signals(opt.set_stop_handler);
  report.start();
  if (result.first_step >= plan.steps)
    log.note("ds train: the checkpoint is at step " + std::to_string(result.first_step) + " and train.steps is " +
             std::to_string(plan.steps) + ": nothing to do (raise train.steps to continue)");
  result.steps = result.first_step;
  bool stop_requested = false;  // Ctrl-C or SIGTERM, agreed across ranks
  if (comm && profiling) {
    comm->record_events(true);
    comm->take_events();  // the start's gathers are not a step's
  }
  const auto first_start = std::chrono::steady_clock::now();
  // Divergence: the loss above divergence_factor x its best of this run for 3 steps running ends the run
  // before the diverged weights are saved; pruning keeps the checkpoint saved at the lowest loss.
  double best_loss = std::numeric_limits<double>::infinity();
  int64_t best_step = 0, steps_above = 0, skipped_this_run = 0;
  for (int64_t step = result.first_step; step < plan.steps && !stop_requested; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    if (profiling) result.step_start_s.push_back(std::chrono::duration<double>(t0 - first_start).count());
    if (comm) comm->mark_step(step);
    report.begin_step(comm);
    const StepOutcome out = stepper.run(step, g_stop_signal);
    if (block_timer) {
      BlockTimer::Taken taken = block_timer->take(t0);
      result.block_forward_s.push_back(std::move(taken.forward));
      result.block_backward_s.push_back(std::move(taken.backward));
      result.block_spans.push_back(std::move(taken.spans));
      result.attention_forward_s.push_back(std::move(taken.attention_forward));
      result.mlp_backward_s.push_back(std::move(taken.mlp_backward));
      result.phase_rss_bytes.push_back(out.phase_rss_bytes);
      std::vector<CollectiveSpan> spans;
      if (comm)
        for (const Communicator::Event& e : comm->take_events())
          spans.push_back({collective_name(e.kind), std::chrono::duration<double>(e.issued - t0).count(),
                           std::chrono::duration<double>(e.done - e.issued).count(), e.bytes});
      result.collective_spans.push_back(std::move(spans));
    }
    report.end_collectives(comm);
    for (const std::string& note : out.notes) log.note(note);
    stop_requested = out.stop_requested;
    if (stop_requested && !g_stop_signal) g_stop_signal = SIGINT;  // another rank was interrupted
    const double step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::optional<double> val;
    if (!opt.profile && plan.run.eval_every > 0 && ((step + 1) % plan.run.eval_every == 0 || step + 1 == plan.steps) &&
        sampler.val_tokens() > 0)
      val = validate();
    report.step(step, out, val, step_s);
    skipped_this_run += out.skipped;
    if (!out.skipped && std::isfinite(out.loss)) {
      last_loss = out.loss;
      if (out.loss < best_loss) best_loss = out.loss, best_step = step + 1;
      const double factor = plan.run.divergence_factor;
      steps_above = factor > 0 && out.loss > factor * best_loss ? steps_above + 1 : 0;
      if (steps_above >= 3) {
        const std::string best = best_checkpoint(plan.run.output_dir);
        throw std::runtime_error("the run diverged: the loss has been above " + format_double(factor) + "x its best (" +
                                 format_fixed(best_loss, 4) + " at step " + std::to_string(best_step) + ") for 3 steps, " +
                                 format_fixed(out.loss, 4) + " at step " + std::to_string(step + 1) +
                                 "; no checkpoint of these weights was written. " +
                                 (best.empty() ? std::string("No checkpoint was saved before it")
                                               : "The checkpoint saved at the lowest loss is kept: " + best) +
                                 ". Lower the learning rate (and resume with train.resume=PATH), or set train.divergence_factor=0 "
                                 "to train on regardless");
      }
    }
    const bool cadence = plan.run.save_every > 0 && (step + 1) % plan.run.save_every == 0;
    if (!comm) stop_requested = g_stop_signal != 0;  // one process: react at once; ranks use the agreed flag
    if (cadence || step + 1 == plan.steps || stop_requested) save(step + 1);
  }
  // fp16 that never found a scale: a run that applied none of its steps trained nothing.
  const int64_t ran = result.steps - result.first_step;
  if (!stop_requested && ran >= kMinStepsForAllSkipped && skipped_this_run == ran)
    throw std::runtime_error("every one of this run's " + std::to_string(ran) +
                             " steps was skipped for inf/NaN gradients: the weights never changed; lower fp16.loss_scale or "
                             "fp16.initial_scale_power, or the learning rate (its checkpoints are of the starting weights)");
  result.interrupted = stop_requested;
  result.stop_signal = stop_requested ? static_cast<int>(g_stop_signal) : 0;
  report.finish();
  return result;
}

}  // namespace ds
