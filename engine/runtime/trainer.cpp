#include "engine/runtime/trainer.hpp"

#include <malloc.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <omp.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "common/error.hpp"
#include "common/format.hpp"
#include "engine/runtime/checkpoint.hpp"
#include "engine/runtime/comm.hpp"
#include "engine/runtime/data/sampler.hpp"
#include "engine/runtime/data/token_source.hpp"
#include "engine/runtime/flat_params.hpp"
#include "engine/runtime/language_model.hpp"
#include "engine/runtime/loss_scaler.hpp"
#include "engine/runtime/monitor.hpp"
#include "engine/runtime/lr_schedule.hpp"
#include "engine/runtime/optimizer.hpp"
#include "engine/runtime/zero.hpp"
#include "common/hash.hpp"
#include "kernels/cpu/norm.hpp"

namespace ds {
namespace {

// Ctrl-C (SIGINT) and SIGTERM (Slurm, Kubernetes, `timeout`) both stop the run after the current step
// with a checkpoint; the signal decides the exit code (130 or 143).
std::atomic<int> g_stop_signal{0};
void on_stop_signal(int sig) { g_stop_signal = sig; }

// More skipped steps in a row than this (inf/NaN gradients) ends the run. fp16's dynamic scaler needs
// room to halve its way down from 2^16 or more (with hysteresis); bf16 has no scale to lower, so a streak
// means the weights are past saving.
constexpr int64_t kMaxConsecutiveSkipsFp16 = 64, kMaxConsecutiveSkipsBf16 = 8;

// "0.0412", "1.73", "12.4": three significant digits, so a small model's rate is never printed as 0.00.
std::string three_digits(double v) {
  char buf[32];
  const int decimals = v >= 100 ? 0 : v >= 10 ? 1 : v >= 1 ? 2 : v > 0 ? std::min(9, 2 - static_cast<int>(std::floor(std::log10(v)))) : 2;
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

std::string duration_text(double s) {
  char buf[32];
  if (s < 60) std::snprintf(buf, sizeof buf, "%.0fs", s);
  else if (s < 3600) std::snprintf(buf, sizeof buf, "%dm%02ds", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
  else std::snprintf(buf, sizeof buf, "%dh%02dm", static_cast<int>(s) / 3600, (static_cast<int>(s) / 60) % 60);
  return buf;
}

torch::Tensor to_long_tensor(const std::vector<int32_t>& v, int64_t B, int64_t T) {
  return torch::from_blob(const_cast<int32_t*>(v.data()), {B, T}, torch::kInt32).to(torch::kLong);
}

// Resident memory now (/proc/self/statm), for the peak-RSS report's baseline.
double resident_bytes() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE));
}

// A training step allocates and frees the same large tensors every step (logits, activations,
// gradients). glibc hands blocks above 32 MiB back to the OS on free, so every step page-faults them
// in again: measured here, a fresh 512x50257 bf16 matmul output costs 146 ms against 57 ms reused.
// Serve large blocks from the heap and never trim it: RSS stays at the peak, which the plan predicts.
void keep_freed_memory() {
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
  mallopt(M_TOP_PAD, 256 << 20);
}

// Every line the run prints also goes to <output_dir>/train.log with a timestamp, so a finished or
// crashed run keeps its own account. On a terminal, progress is one rewriting line: notes clear it first.
class RunLog {
 public:
  // An empty `file` logs to stderr only (ranks other than 0: the launcher captures their stderr).
  // Appended to, never truncated, as metrics.jsonl.
  RunLog(const std::filesystem::path& file, bool live) : live_(live) {
    if (!file.empty()) {
      file_.open(file, std::ios::app);
      if (!file_) throw std::runtime_error("cannot write " + file.string());
    }
  }
  void note(const std::string& line) {
    if (live_) std::cerr << "\r\033[K";
    std::cerr << line << "\n";
    write_file(line);
  }
  // `due` lines (every steps_per_print steps, validations, the last step) stay on the terminal and go to
  // train.log; on a terminal every other step rewrites one live line below them.
  void progress(const std::string& line, bool due) {
    if (live_) {
      std::cerr << "\r\033[K" << line << (due ? "\n" : "") << std::flush;
    } else if (due) {
      std::cerr << line << "\n";
    }
    if (due) write_file(line);
  }
  void end_live_line() {
    if (live_) std::cerr << "\n";
  }

 private:
  void write_file(const std::string& line) {
    if (!file_.is_open()) return;
    const std::time_t now = std::time(nullptr);
    char stamp[32];
    std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", std::localtime(&now));
    file_ << stamp << " " << line << "\n" << std::flush;
    if (!file_) throw std::runtime_error("writing train.log failed (is the disk full?)");
  }
  std::ofstream file_;
  bool live_;
};

// A value for metrics.jsonl: JSON has no inf or NaN (an overflowed fp16 step's norm), so those are null.
std::string json_number(double v) { return std::isfinite(v) ? format_fixed(v, 6) : "null"; }

// The bytes this rank holds beside the plan's prediction, by category.
std::string held_bytes_line(const FlatParams::Bytes& held, const MemoryCategories& plan) {
  std::string line = "held per rank (plan):";
  for (const auto& [name, have, want] : {std::tuple{"params", held.params, plan.params},
                                         {"gradients", held.grads, plan.grads},
                                         {"optimizer states", held.optimizer_states, plan.optimizer_states},
                                         {"buffers", held.buffers, plan.buffers}})
    line += std::string(" ") + name + " " + format_bytes(have) + " (" + format_bytes(want) + "),";
  line.pop_back();
  return line;
}

}  // namespace

std::vector<std::string> unsupported_by_trainer(const Plan& plan, const Config& config) {
  std::vector<std::string> why;
  if (plan.topology.device != DeviceKind::cpu) why.push_back("training on CUDA devices (this build trains on the CPU)");
  if (plan.model.hp.arch == ModelArch::gpt2 && !plan.model.hp.tie_word_embeddings) why.push_back("an untied gpt2 output head");
  if (plan.precision.grad_dtype != plan.precision.param_dtype)
    why.push_back("data_types.grad_accum_dtype other than the parameters' dtype");
  if (plan.zero.offload_optimizer.device != OffloadDevice::none || plan.zero.offload_param.device != OffloadDevice::none)
    why.push_back("optimizer or parameter offload");
  return why;
}

TrainResult train(const Plan& plan, const Config& config, const TrainOptions& opt) {
  const auto why = unsupported_by_trainer(plan, config);
  if (!why.empty()) {
    std::string list;
    for (const auto& w : why) list += "\n    - " + w;
    throw UserError("this build of ds cannot train this plan yet:" + list,
                    "`ds plan` shows the plan; the items above are on the roadmap (see README)");
  }
  const ModelHyper& hp = plan.model.hp;
  const int64_t B = plan.batch.micro_batch, T = plan.seq_len, GAS = plan.batch.grad_accum;
  const uint64_t seed = static_cast<uint64_t>(config.train.seed);

  // Inputs first: a bad data file fails before anything is allocated.
  auto stream = open_token_stream(config.data, hp.vocab_size, seed);
  const int W = plan.topology.world_size;
  // Several ranks: each draws its own micro batches of the same global batch and gradients are summed
  // across ranks before the step. Rank 0 alone writes the run directory.
  std::unique_ptr<Communicator> comm;
  if (W > 1)
    comm = Communicator::create(plan.topology, std::chrono::milliseconds(static_cast<int64_t>(config.train.comm_timeout_s * 1000)));
  const int rank = comm ? comm->rank() : 0;
  const bool lead = rank == 0;
  BatchSampler sampler(*stream, {T, B, GAS, W, rank, config.data.val_fraction, seed});

  keep_freed_memory();
  TrainResult result;
  result.baseline_rss_bytes = resident_bytes();
  torch::set_num_threads(plan.threads);
  omp_set_num_threads(plan.threads);
  const std::filesystem::path dir(config.train.output_dir);
  result.metrics_path = (dir / "metrics.jsonl").string();
  std::ofstream metrics;
  std::vector<std::unique_ptr<MetricSink>> monitors;
  if (lead) {
    std::filesystem::create_directories(dir);
    for (const auto& [name, text] : {std::pair{"config.json", &opt.resolved_config_json}, {"plan.json", &opt.plan_json}}) {
      std::ofstream f(dir / name);
      f << *text << "\n" << std::flush;
      if (!f) throw std::runtime_error("cannot write " + (dir / name).string() + " (is the disk full?)");
    }
    // Appended, never truncated: a resumed run's steps follow the earlier ones (a fresh run into a
    // directory holding a run is refused before this, or the run was removed by --overwrite).
    metrics.open(result.metrics_path, std::ios::app);
    if (!metrics) throw std::runtime_error("cannot write " + result.metrics_path);
    monitors = open_monitors(config);
  }
  RunLog log(lead ? dir / "train.log" : std::filesystem::path(), opt.live_progress && lead);
  if (lead) {
    // The first checkpoint must fit: fp32 master weights and moments of every rank, found out now rather
    // than after the first save_every steps.
    const double need = static_cast<double>(plan.layout.numel) * 4.0 * (1 + plan.optimizer.moments) + (1 << 20);
    struct statvfs fs {};
    if (statvfs(dir.c_str(), &fs) == 0) {
      const double free_bytes = static_cast<double>(fs.f_bavail) * static_cast<double>(fs.f_frsize);
      if (free_bytes < need)
        throw UserError("train.output_dir '" + dir.string() + "' has " + format_bytes(free_bytes) + " free; a checkpoint needs " +
                            format_bytes(need),
                        "free some space, or choose another train.output_dir");
    }
  }

  FlatParams flat = FlatParams::allocate(plan, rank);
  ZeroExchange zero(plan, flat, comm.get());
  CheckpointBuffers buffers{flat.master.data_ptr<float>(), FlatParams::data_or_null(flat.exp_avg),
                            FlatParams::data_or_null(flat.exp_avg_sq), flat.master.numel(), flat.owned, plan.layout.numel};
  LossScaler scaler(plan.precision.loss_scaling);
  int64_t applied = 0;  // successful optimizer steps: the schedule's position
  if (opt.resume_from.empty()) {
    // The whole model is initialised the same way at every stage and world size; each rank keeps its part.
    const bool whole = flat.master.numel() == plan.layout.numel;
    torch::Tensor init = whole ? flat.master : torch::zeros({plan.layout.numel}, torch::kFloat32);
    initialise_model(hp, plan, init, seed);
    if (!whole)
      for (const OwnedSegment& s : flat.owned) flat.master.narrow(0, s.local, s.numel).copy_(init.narrow(0, s.global, s.numel));
  } else {
    const CheckpointScalars sc = load_checkpoint(opt.resume_from, buffers);
    result.first_step = sc.step;
    applied = sc.applied_steps;
    result.skipped_steps = sc.skipped_steps;
    if (scaler.enabled()) scaler.restore(sc.loss_scaler);
    if (sc.seed != seed)
      log.note("ds train: warning: the checkpoint was trained with seed " + std::to_string(sc.seed) + ", this run uses " +
               std::to_string(seed) + ": the data order changes from here on");
    log.note("ds train: resuming from " + opt.resume_from + " at step " + std::to_string(sc.step));
  }
  // The weights the model reads, from the master copy: this rank's part rounded to the stored dtype
  // (nearest even, as the optimizer kernel does; `rounded` says the kernel did it already), gathered
  // from every rank, then widened to the compute dtype where the two differ (CPU fp16; at stage 3 the
  // gathers widen).
  auto refresh_weights = [&](bool rounded) {
    torch::NoGradGuard ng;
    if (!rounded && flat.master.data_ptr() != flat.local_params.data_ptr()) flat.local_params.copy_(flat.master);
    zero.publish_parameters();
    if (flat.widened && flat.compute.defined()) flat.compute.copy_(flat.params);
  };
  refresh_weights(false);
  auto save = [&](int64_t step) {
    // Never write non-finite weights (they would be resumed from, and keep_last would prune a good
    // checkpoint for them). Every rank checks its part; the verdict is agreed so all stop together.
    double bad = std::isfinite(kernels::sum_of_squares_f32(flat.master.data_ptr<float>(), flat.master.numel())) ? 0.0 : 1.0;
    if (comm) {
      torch::Tensor t = torch::tensor({bad}, torch::kFloat64);
      comm->all_reduce_sum(t, kControlCollective);
      bad = t.item<double>();
    }
    if (bad > 0)
      throw std::runtime_error("the weights are not finite after step " + std::to_string(step) +
                               ": no checkpoint written (the previous ones are kept); lower the learning rate or keep gradient_clipping on");
    if (!lead && plan.zero.stage == 0) return;  // stage 0: every rank holds the same state
    CheckpointScalars sc;
    sc.step = step;
    sc.applied_steps = applied;
    sc.skipped_steps = result.skipped_steps;
    sc.seed = seed;
    sc.loss_scaler = scaler.state();
    CheckpointWriter writer;
    if (comm && plan.zero.stage >= 1) writer = {rank, W, [&] { comm->barrier(); }};
    const SavedCheckpoint saved = save_checkpoint(dir.string(), sc, buffers, opt.plan_json, opt.resolved_config_json,
                                                  config.train.keep_last, writer);
    result.last_checkpoint = saved.path;
    if (lead)
      log.note("ds train: checkpoint at step " + std::to_string(step) + " -> " + saved.path + " (" +
               format_bytes(static_cast<double>(saved.bytes)) + (writer.world_size > 1 ? " in " + std::to_string(W) + " shards" : "") +
               ")");
  };
  const std::unique_ptr<LanguageModel> model_ptr = make_model(plan, flat);
  LanguageModel& model = *model_ptr;
  if (flat.grouped) model.set_block_hooks(&zero);
  const ResolvedOptimizer& o = plan.optimizer;
  LrSchedule schedule(plan.scheduler, o.lr, o.betas[0]);
  const FlatOptimizer optimizer(o, plan.layout, rank);
  // Lamb under ZeRO: each tensor's norms summed over the ranks that hold its parts.
  SumOverRanks sum_over_ranks;
  if (comm && plan.zero.stage >= 1 && o.type == OptimizerType::Lamb)
    sum_over_ranks = [&](double* v, size_t n) {
      comm->all_reduce_sum(torch::from_blob(v, {static_cast<int64_t>(n)}, torch::kFloat64), kLambNormsCollective);
    };
  OptimizerBuffers ob;
  ob.master = flat.master.data_ptr<float>();
  ob.moment1 = FlatParams::data_or_null(flat.exp_avg);
  ob.moment2 = FlatParams::data_or_null(flat.exp_avg_sq);
  ob.params_bf16 = plan.precision.param_dtype == Dtype::bf16 ? reinterpret_cast<uint16_t*>(flat.local_params.data_ptr()) : nullptr;
  // The rank's part of compute_grads: the gradients themselves, or under CPU fp16 their fp16 rounding widened back.
  ob.grads = flat.local_grads.data_ptr();
  ob.grads_bf16 = flat.local_grads.scalar_type() == torch::kBFloat16;

  log.note("ds train: " + hp.name + ", " + format_count(plan.model.num_params) + " parameters, " + plan.precision.mode + ", " +
           optimizer_type_name(o.type) +
           (W > 1 ? ", ZeRO stage " + std::to_string(plan.zero.stage) + " on " + std::to_string(W) + " ranks" : std::string()));
  log.note("ds train: " + held_bytes_line(flat.bytes(), plan.memory.device));
  log.note("ds train: data " + stream->describe() + "; " + format_count(sampler.train_tokens()) + " training / " +
           format_count(sampler.val_tokens()) + " validation tokens");
  log.note("ds train: " + std::to_string(plan.steps) + " steps of " + std::to_string(plan.batch.train_batch_size) + " x " +
           std::to_string(T) + " tokens (" + std::to_string(B) + " x " + std::to_string(GAS) + " micro batches), " +
           std::to_string(plan.threads) + " threads; writing " + dir.string() + "/");

  g_stop_signal = 0;
  auto previous_int = std::signal(SIGINT, on_stop_signal);
  auto previous_term = std::signal(SIGTERM, on_stop_signal);
  const auto start = std::chrono::steady_clock::now();
  std::vector<int32_t> in, tgt;
  if (result.first_step >= plan.steps)
    log.note("ds train: the checkpoint is at step " + std::to_string(result.first_step) + " and train.steps is " +
             std::to_string(plan.steps) + ": nothing to do (raise train.steps to continue)");
  result.steps = result.first_step;
  bool stop_requested = false;  // Ctrl-C or SIGTERM, agreed across ranks
  int64_t consecutive_skips = 0;
  double smoothed_step_s = 0;   // an exponential average over ~10 steps, for tok/s and TFLOP/s
  CommLedger comm_before, comm_total;  // collectives before this step, and summed over the run's steps
  if (comm) comm_before = comm->ledger();  // the start's gather of the initial weights is not a step's
  for (int64_t step = result.first_step; step < plan.steps && !stop_requested; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    if (comm) comm->mark_step(step);
    {
      torch::NoGradGuard ng;
      flat.compute_grads.zero_();  // grouped stages: this rank's part (the group buffers are zeroed as reduced)
    }
    const double loss_scale = scaler.enabled() ? scaler.scale() : 1.0;
    double loss_sum = 0, fwd_s = 0, bwd_s = 0;
    for (int64_t m = 0; m < GAS; ++m) {
      sampler.train_batch(step, m, in, tgt);
      model.set_dropout(splitmix64(seed ^ splitmix64((static_cast<uint64_t>(step) * static_cast<uint64_t>(GAS) + m) * 4099 +
                                                    static_cast<uint64_t>(rank))), true);
      const auto f0 = std::chrono::steady_clock::now();
      zero.begin_micro_step(false);
      torch::Tensor loss = model.loss(to_long_tensor(in, B, T), to_long_tensor(tgt, B, T));
      const auto b0 = std::chrono::steady_clock::now();
      zero.begin_backward();
      // The sum over ranks is the mean, unless gradient_allreduce_op is "sum".
      (loss * (loss_scale / static_cast<double>(GAS * (plan.gradient_sum_over_ranks ? 1 : W)))).backward();
      zero.end_micro_step();
      const auto b1 = std::chrono::steady_clock::now();
      fwd_s += std::chrono::duration<double>(b0 - f0).count();
      bwd_s += std::chrono::duration<double>(b1 - b0).count();
      loss_sum += loss.item<double>();
    }
    const auto opt0 = std::chrono::steady_clock::now();
    double loss = loss_sum / GAS;
    zero.reduce_gradients();
    if (flat.widened) {  // round the gradients to their stored dtype (fp16 overflows to inf here), then back
      torch::NoGradGuard ng;
      flat.grads.copy_(flat.compute_grads);
      flat.compute_grads.copy_(flat.grads);
    }
    bool partial = false;
    double sum_of_squares = zero.grad_sum_of_squares(&partial);
    if (comm) {
      // The mean loss, the gradient norm over the ranks' parts and whether any rank was interrupted,
      // agreed in one small collective, so every rank takes the same step and stops after the same one.
      torch::Tensor agreed = torch::tensor({loss_sum, g_stop_signal ? static_cast<double>(g_stop_signal) : 0.0,
                                            partial ? sum_of_squares : 0.0}, torch::kFloat64);
      comm->all_reduce_sum(agreed, kControlCollective);
      loss = agreed[0].item<double>() / static_cast<double>(GAS * W);
      stop_requested = agreed[1].item<double>() > 0;
      if (stop_requested && !g_stop_signal) g_stop_signal = SIGINT;  // another rank was interrupted
      if (partial) sum_of_squares = agreed[2].item<double>();
    } else {
      stop_requested = g_stop_signal != 0;
    }
    const double scaled_norm = std::sqrt(sum_of_squares);
    const double norm = scaled_norm / loss_scale;
    const bool overflow = !std::isfinite(scaled_norm);
    // fp32 and bf16: a non-finite loss means the weights are gone; fp32 has no overflow to skip either.
    if (!scaler.enabled() && (!std::isfinite(loss) || (overflow && plan.precision.mode != "bf16")))
      throw std::runtime_error("the loss or gradient became " + std::string(std::isnan(loss) ? "NaN" : "infinite") + " at step " +
                               std::to_string(step + 1) + ": lower the learning rate or keep gradient_clipping on");
    const double lr = schedule.lr_at(applied - 1);
    bool skip = overflow && plan.precision.check_overflow;
    if (scaler.enabled()) {
      std::string event;
      skip = scaler.update(overflow, &event);
      if (!event.empty()) {
        log.note("ds train: step " + std::to_string(step + 1) + ": " + event);
      }
    }
    consecutive_skips = skip ? consecutive_skips + 1 : 0;
    if (consecutive_skips > (scaler.enabled() ? kMaxConsecutiveSkipsFp16 : kMaxConsecutiveSkipsBf16))
      throw std::runtime_error(std::to_string(consecutive_skips) + " optimizer steps in a row were skipped for inf/NaN gradients "
                               "(up to step " + std::to_string(step + 1) + "): the run is not recovering; lower the learning rate");
    if (skip) {
      ++result.skipped_steps;
      if (!scaler.enabled()) log.note("ds train: step " + std::to_string(step + 1) + ": inf/NaN gradient, step skipped");
    } else {
      // DeepSpeed's clipping: coefficient ((norm + 1e-6) / clip), applied when above 1; the loss scale
      // comes off in the same multiply.
      double clip = 1.0;
      if (plan.gradient_clipping > 0) {
        const double c = (norm + 1e-6) / plan.gradient_clipping;
        if (c > 1) clip = 1.0 / c;
      }
      OptimizerStepInputs si;
      si.lr = lr;
      si.beta1 = schedule.beta1_at(applied - 1);
      si.beta2 = schedule.beta2_override().value_or(o.betas[1]);
      si.grad_scale = clip / loss_scale;
      si.step = applied + 1;
      optimizer.step(ob, si, sum_over_ranks);
      refresh_weights(ob.params_bf16 != nullptr);
      ++applied;
    }
    const double opt_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - opt0).count();
    // This step's collectives (validation's are counted apart, after this).
    CommLedger step_comm;
    double comm_bytes = 0, comm_s = 0;
    if (comm) {
      for (const auto& [what, st] : comm->ledger()) {
        CommStats d = st;
        if (auto it = comm_before.find(what); it != comm_before.end()) {
          d.calls -= it->second.calls;
          d.bytes -= it->second.bytes;
          d.seconds -= it->second.seconds;
        }
        if (d.calls == 0) continue;
        comm_bytes += d.bytes;
        comm_s += d.seconds;
        step_comm[what] = d;
      }
      for (const auto& [what, d] : step_comm) {
        comm_total[what].bytes += d.bytes;
        comm_total[what].calls += d.calls;
      }
    }
    result.comm_bytes.push_back(comm_bytes);
    result.losses.push_back(loss);
    result.steps = step + 1;

    const double step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    smoothed_step_s = step == result.first_step ? step_s : 0.9 * smoothed_step_s + 0.1 * step_s;
    const double tok_s = static_cast<double>(plan.tokens_per_step) / smoothed_step_s;
    const double tflops = plan.train_flops_per_step / smoothed_step_s / 1e12;
    std::optional<double> val;
    // Rank 0 evaluates; at stage 3 every rank takes part, since each holds only part of the weights.
    const bool evaluates = lead || (flat.grouped && plan.layout.stage == 3);
    if (evaluates && config.train.eval_every > 0 && ((step + 1) % config.train.eval_every == 0 || step + 1 == plan.steps) &&
        sampler.val_tokens() > 0) {
      torch::NoGradGuard ng;
      double sum = 0;
      for (int64_t i = 0; i < config.train.eval_batches; ++i) {
        sampler.val_batch(i, in, tgt);
        model.set_dropout(0, false);
        zero.begin_micro_step(true);
        sum += model.loss(to_long_tensor(in, B, T), to_long_tensor(tgt, B, T)).item<double>();
      }
      val = sum / static_cast<double>(config.train.eval_batches);
      result.val_losses.push_back(*val);
    }
    char val_text[32] = "";
    if (val) std::snprintf(val_text, sizeof val_text, " (val %.4f)", *val);
    char line[256];
    std::snprintf(line, sizeof line, "step %*lld/%lld | loss %.4f%s | lr %.2e | norm %.3f | %s tok/s | %s TFLOP/s | eta %s",
                  static_cast<int>(std::to_string(plan.steps).size()), static_cast<long long>(step + 1),
                  static_cast<long long>(plan.steps), loss, val_text, lr, norm,
                  format_count(static_cast<int64_t>(tok_s)).c_str(), three_digits(tflops).c_str(),
                  duration_text(elapsed / (step + 1 - result.first_step) * (plan.steps - step - 1)).c_str());
    const bool due = (step + 1) % std::max<int64_t>(1, opt.print_every) == 0 || step == 0 || step + 1 == plan.steps || val;
    log.progress(line, due);
    if (due && config.comms_logger_enabled && comm) {  // DeepSpeed's comms_logger: bytes and time per collective
      std::string c = "comms step " + std::to_string(step + 1) + ": ";
      for (const auto& [what, d] : step_comm)
        c += (c.back() == ' ' ? "" : " | ") + what + " " + std::to_string(d.calls) + "x " + format_bytes(d.bytes) + " " +
             format_fixed(d.seconds * 1e3, 2) + " ms";
      log.note(c);
    }
    if (due && config.wall_clock_breakdown && !opt.live_progress) {  // DeepSpeed's format; "step" = optimizer + clipping
      char times[128];
      std::snprintf(times, sizeof times, "time (ms) | fwd: %.2f | bwd: %.2f | step: %.2f", fwd_s * 1e3, bwd_s * 1e3, opt_s * 1e3);
      log.note(times);
    }
    char val_json[48] = "";
    if (val) std::snprintf(val_json, sizeof val_json, ", \"val_loss\": %.6f", *val);
    char scale_json[48] = "";
    if (scaler.enabled()) std::snprintf(scale_json, sizeof scale_json, ", \"loss_scale\": %g", loss_scale);
    char json[448];
    std::snprintf(json, sizeof json,
                  "{\"step\": %lld, \"loss\": %s, \"lr\": %.6e, \"grad_norm\": %s, \"tokens_per_s\": %.1f, "
                  "\"step_s\": %.4f, \"forward_s\": %.4f, \"backward_s\": %.4f, \"optimizer_s\": %.4f, \"comm_bytes\": %.0f, "
                  "\"comm_s\": %.4f, \"tflops\": %.6g, \"skipped\": %s%s%s}\n",
                  static_cast<long long>(step + 1), json_number(loss).c_str(), lr, json_number(norm).c_str(), tok_s, step_s,
                  fwd_s, bwd_s, opt_s, comm_bytes, comm_s, plan.train_flops_per_step / step_s / 1e12, skip ? "true" : "false",
                  scale_json, val_json);
    if (lead) {
      metrics << json << std::flush;
      if (!metrics) throw std::runtime_error("writing " + result.metrics_path + " failed (is the disk full?)");
    }
    if (!monitors.empty()) {
      const int64_t samples = (step + 1) * plan.batch.train_batch_size;  // DeepSpeed's x axis
      std::vector<MetricEvent> events{{"Train/Samples/train_loss", loss, samples}, {"Train/Samples/lr", lr, samples},
                                      {"Train/Samples/grad_norm", norm, samples}};
      if (scaler.enabled()) events.push_back({"Train/Samples/loss_scale", loss_scale, samples});
      if (val) events.push_back({"Train/Samples/val_loss", *val, samples});
      if (config.wall_clock_breakdown)
        for (const auto& [name, s] : {std::pair{"forward", fwd_s}, {"backward", bwd_s}, {"step", opt_s}})
          events.push_back({std::string("Train/Samples/elapsed_time_ms_") + name, s * 1e3, samples});
      for (const auto& m : monitors) m->write(events);
    }
    const bool cadence = config.train.save_every > 0 && (step + 1) % config.train.save_every == 0;
    if (!comm) stop_requested = g_stop_signal != 0;  // one process: react at once; ranks use the agreed flag
    if (cadence || step + 1 == plan.steps || stop_requested) save(step + 1);
    if (comm) comm_before = comm->ledger();
  }
  std::signal(SIGINT, previous_int);
  std::signal(SIGTERM, previous_term);
  if (comm && result.steps > result.first_step) {
    // What went on the wire per step beside the plan's prediction, per collective.
    const double n = static_cast<double>(result.steps - result.first_step);
    log.note("ds train: sent per rank per step (plan):");
    for (const Collective& c : plan.collectives) {
      const auto it = comm_total.find(c.what);
      const double bytes = it == comm_total.end() ? 0.0 : it->second.bytes / n;
      const double calls = it == comm_total.end() ? 0.0 : static_cast<double>(it->second.calls) / n;
      log.note("  " + c.what + ": " + format_fixed(calls, 1) + " calls, " + format_bytes(bytes) + " (" +
               std::to_string(c.calls_per_step) + " calls, " + format_bytes(c.wire_bytes_per_rank_per_step) + ")");
    }
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.interrupted = stop_requested;
  result.stop_signal = stop_requested ? static_cast<int>(g_stop_signal) : 0;
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) == 0) result.peak_rss_bytes = static_cast<double>(usage.ru_maxrss) * 1024.0;
  if (result.interrupted) log.end_live_line();
  // The run's last lines, on the terminal and in train.log.
  if (!result.losses.empty()) {
    auto four = [](double v) { return format_fixed(v, 4); };
    std::string done = std::string("ds train: ") + (result.interrupted ? "interrupted at step " : "done: ") +
                       std::to_string(result.steps) + " of " + std::to_string(plan.steps) + " steps (" +
                       std::to_string(result.steps - result.first_step) + " this run) in " + format_fixed(result.seconds, 1) +
                       " s; loss " + four(result.losses.front()) + " -> " + four(result.losses.back());
    if (!result.val_losses.empty()) done += " (validation " + four(result.val_losses.back()) + ")";
    if (config.data.type == DataType::synthetic) done += "; the synthetic language's floor is " + four(markov_entropy_nats());
    if (result.skipped_steps) done += "; " + std::to_string(result.skipped_steps) + " steps skipped";
    log.note(done);
    const double predicted = plan.memory.device.total() + plan.memory.host.total();
    const double grown = result.peak_rss_bytes - result.baseline_rss_bytes;
    log.note("ds train: peak resident memory " + format_bytes(result.peak_rss_bytes) + ": " + format_bytes(result.baseline_rss_bytes) +
             " of code and libraries + " + format_bytes(grown) + " for training, " + format_fixed(grown / predicted, 2) +
             "x the plan's " + format_bytes(predicted) + " (the plan leaves out allocator slack and library workspaces)");
  }
  return result;
}

}  // namespace ds
