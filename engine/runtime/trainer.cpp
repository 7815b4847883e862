#include "engine/runtime/trainer.hpp"

#include <malloc.h>
#include <sys/resource.h>
#include <omp.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "common/error.hpp"
#include "common/format.hpp"
#include "engine/runtime/checkpoint.hpp"
#include "engine/runtime/data/sampler.hpp"
#include "engine/runtime/data/token_source.hpp"
#include "engine/runtime/flat_params.hpp"
#include "engine/runtime/language_model.hpp"
#include "engine/runtime/lr_schedule.hpp"
#include "kernels/cpu/adam.hpp"
#include "kernels/cpu/norm.hpp"

namespace ds {
namespace {

std::atomic<bool> g_interrupted{false};
void on_sigint(int) { g_interrupted = true; }

// Contiguous runs of parameters that share a weight-decay setting: one kernel call each.
struct Segment {
  int64_t begin = 0, end = 0;
  bool decay = false;
};
std::vector<Segment> decay_segments(const FlatLayout& L) {
  std::vector<Segment> out;
  for (const ParamSlot& p : L.params) {
    if (!out.empty() && out.back().decay == p.weight_decay && out.back().end == p.offset)
      out.back().end = p.offset + p.numel;
    else
      out.push_back({p.offset, p.offset + p.numel, p.weight_decay});
  }
  return out;
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

// A training step allocates and frees the same large tensors every step (logits, activations,
// gradients). glibc hands blocks above 32 MiB back to the OS on free, so every step page-faults them
// in again: measured here, a fresh 512x50257 bf16 matmul output costs 146 ms against 57 ms reused.
// Serve large blocks from the heap and never trim it: RSS stays at the peak, which the plan predicts.
double resident_bytes() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE));
}

void keep_freed_memory() {
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
  mallopt(M_TOP_PAD, 256 << 20);
}

}  // namespace

std::vector<std::string> unsupported_by_trainer(const Plan& plan, const Config& config) {
  std::vector<std::string> why;
  if (plan.topology.world_size != 1)
    why.push_back("training on " + std::to_string(plan.topology.world_size) + " ranks (this build trains on one process)");
  if (plan.topology.device != DeviceKind::cpu) why.push_back("training on CUDA devices (this build trains on the CPU)");
  if (plan.model.hp.arch == ModelArch::gpt2 && !plan.model.hp.tie_word_embeddings) why.push_back("an untied gpt2 output head");
  if (plan.precision.mode == "fp16") why.push_back("fp16 (use bf16, the fast and overflow-free choice on this CPU)");
  if (plan.precision.mode != "fp16" && plan.precision.grad_dtype != plan.precision.compute_dtype)
    why.push_back("data_types.grad_accum_dtype other than the compute dtype");
  if (plan.optimizer.type != OptimizerType::Adam && plan.optimizer.type != OptimizerType::AdamW)
    why.push_back(std::string("the ") + optimizer_type_name(plan.optimizer.type) + " optimizer (use Adam or AdamW)");
  if (plan.activation_checkpointing) why.push_back("model.activation_checkpointing");
  if (plan.zero.offload_optimizer.device != OffloadDevice::none || plan.zero.offload_param.device != OffloadDevice::none)
    why.push_back("optimizer or parameter offload");
  if (config.data.type == DataType::hdf5) why.push_back("data.type \"hdf5\"");
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
  BatchSampler sampler(*stream, {T, B, GAS, 1, 0, config.data.val_fraction, seed});

  keep_freed_memory();
  TrainResult result;
  result.baseline_rss_bytes = resident_bytes();
  torch::set_num_threads(plan.threads);
  omp_set_num_threads(plan.threads);
  std::filesystem::create_directories(config.train.output_dir);
  const std::filesystem::path dir(config.train.output_dir);
  std::ofstream(dir / "config.json") << opt.resolved_config_json << "\n";
  std::ofstream(dir / "plan.json") << opt.plan_json << "\n";
  result.metrics_path = (dir / "metrics.jsonl").string();
  std::ofstream metrics(result.metrics_path, opt.resume_from.empty() ? std::ios::trunc : std::ios::app);
  if (!metrics) throw std::runtime_error("cannot write " + result.metrics_path);

  FlatParams flat = FlatParams::allocate(plan);
  const CheckpointBuffers buffers{flat.master.data_ptr<float>(), flat.exp_avg.data_ptr<float>(),
                                  flat.exp_avg_sq.data_ptr<float>(), flat.numel()};
  int64_t applied = 0;  // successful optimizer steps: the schedule's position
  if (opt.resume_from.empty()) {
    initialise_model(hp, plan, flat.master, seed);
  } else {
    const CheckpointScalars sc = load_checkpoint(opt.resume_from, buffers);
    result.first_step = sc.step;
    applied = sc.applied_steps;
    result.skipped_steps = sc.skipped_steps;
    if (sc.seed != seed)
      std::cerr << "ds train: warning: the checkpoint was trained with seed " << sc.seed << ", this run uses " << seed
                << ": the data order changes from here on\n";
    std::cerr << "ds train: resuming from " << opt.resume_from << " at step " << sc.step << "\n";
  }
  if (plan.precision.fp32_master) {
    torch::NoGradGuard ng;
    flat.params.copy_(flat.master);  // round to nearest even, as the optimizer kernel does
  }
  auto save = [&](int64_t step) {
    CheckpointScalars sc;
    sc.step = step;
    sc.applied_steps = applied;
    sc.skipped_steps = result.skipped_steps;
    sc.seed = seed;
    const SavedCheckpoint saved = save_checkpoint(dir.string(), sc, buffers, opt.plan_json, opt.resolved_config_json,
                                                  config.train.keep_last);
    result.last_checkpoint = saved.path;
    if (opt.live_progress) std::cerr << "\r\033[K";
    std::cerr << "ds train: checkpoint at step " << step << " -> " << saved.path << " ("
              << format_bytes(static_cast<double>(saved.bytes)) << ")\n";
  };
  const std::unique_ptr<LanguageModel> model_ptr = make_model(hp, flat);
  const LanguageModel& model = *model_ptr;
  const ResolvedOptimizer& o = plan.optimizer;
  LrSchedule schedule(plan.scheduler, o.lr, o.betas[0]);
  const auto segments = decay_segments(plan.layout);
  const bool bf16 = plan.precision.compute_dtype == Dtype::bf16;

  std::cerr << "ds train: " << hp.name << ", " << format_count(plan.model.num_params) << " parameters, " << plan.precision.mode
            << ", " << optimizer_type_name(o.type) << "; " << format_bytes(static_cast<double>(flat.bytes()))
            << " of model state (plan: " << format_bytes(plan.memory.device.params + plan.memory.device.grads +
                                                         plan.memory.device.optimizer_states)
            << ")\n"
            << "ds train: data " << stream->describe() << "; " << format_count(sampler.train_tokens()) << " training / "
            << format_count(sampler.val_tokens()) << " validation tokens\n"
            << "ds train: " << plan.steps << " steps of " << plan.batch.train_batch_size << " x " << T << " tokens ("
            << B << " x " << GAS << " micro batches), " << plan.threads << " threads; writing " << dir.string() << "/\n";

  g_interrupted = false;
  auto previous = std::signal(SIGINT, on_sigint);
  const auto start = std::chrono::steady_clock::now();
  std::vector<int32_t> in, tgt;
  if (result.first_step >= plan.steps)
    std::cerr << "ds train: the checkpoint is at step " << result.first_step << " and train.steps is " << plan.steps
              << ": nothing to do (raise train.steps to continue)\n";
  result.steps = result.first_step;
  for (int64_t step = result.first_step; step < plan.steps && !g_interrupted; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    {
      torch::NoGradGuard ng;
      flat.grads.zero_();
    }
    double loss_sum = 0, fwd_s = 0, bwd_s = 0;
    for (int64_t m = 0; m < GAS; ++m) {
      sampler.train_batch(step, m, in, tgt);
      const auto f0 = std::chrono::steady_clock::now();
      torch::Tensor loss = model.loss(to_long_tensor(in, B, T), to_long_tensor(tgt, B, T));
      const auto b0 = std::chrono::steady_clock::now();
      (loss / static_cast<double>(GAS)).backward();
      const auto b1 = std::chrono::steady_clock::now();
      fwd_s += std::chrono::duration<double>(b0 - f0).count();
      bwd_s += std::chrono::duration<double>(b1 - b0).count();
      loss_sum += loss.item<double>();
    }
    const auto opt0 = std::chrono::steady_clock::now();
    const double loss = loss_sum / GAS;
    // Our own reduction: LibTorch 1.13's linalg_vector_norm over bf16 is slow and measurably inexact.
    const double norm = std::sqrt(
        bf16 ? kernels::sum_of_squares_bf16(reinterpret_cast<const uint16_t*>(flat.grads.data_ptr<at::BFloat16>()), flat.numel())
             : kernels::sum_of_squares_f32(flat.grads.data_ptr<float>(), flat.numel()));
    const bool overflow = !std::isfinite(norm);
    if (!bf16 && (overflow || !std::isfinite(loss)))
      throw std::runtime_error("the loss or gradient became " + std::string(std::isnan(loss) ? "NaN" : "infinite") + " at step " +
                               std::to_string(step + 1) + ": lower the learning rate or keep gradient_clipping on");
    const double lr = schedule.lr_at(applied - 1);
    if (overflow && plan.precision.check_overflow) {
      ++result.skipped_steps;
      std::cerr << "ds train: step " << step + 1 << ": inf/NaN gradient, step skipped\n";
    } else {
      // DeepSpeed's clipping: coefficient ((norm + 1e-6) / clip), applied when above 1.
      double grad_scale = 1.0;
      if (plan.gradient_clipping > 0) {
        const double c = (norm + 1e-6) / plan.gradient_clipping;
        if (c > 1) grad_scale = 1.0 / c;
      }
      const double beta1 = schedule.beta1_at(applied - 1);
      const double beta2 = schedule.beta2_override().value_or(o.betas[1]);
      float* master = flat.master.data_ptr<float>();
      float* m1 = flat.exp_avg.data_ptr<float>();
      float* m2 = flat.exp_avg_sq.data_ptr<float>();
      for (const Segment& s : segments) {
        const auto k = kernels::adam_step_for(static_cast<float>(lr), static_cast<float>(beta1), static_cast<float>(beta2),
                                              static_cast<float>(o.eps), s.decay ? static_cast<float>(o.weight_decay) : 0.f,
                                              o.decoupled_weight_decay, o.bias_correction, applied + 1,
                                              static_cast<float>(grad_scale));
        const int64_t n = s.end - s.begin;
        if (bf16)
          kernels::adam_step_bf16(master + s.begin, m1 + s.begin, m2 + s.begin,
                                  reinterpret_cast<uint16_t*>(flat.params.data_ptr<at::BFloat16>()) + s.begin,
                                  reinterpret_cast<const uint16_t*>(flat.grads.data_ptr<at::BFloat16>()) + s.begin, n, k);
        else
          kernels::adam_step_f32(master + s.begin, m1 + s.begin, m2 + s.begin, nullptr, flat.grads.data_ptr<float>() + s.begin,
                                 n, k);
      }
      ++applied;
    }
    const double opt_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - opt0).count();
    result.losses.push_back(loss);
    result.steps = step + 1;

    const double step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double tok_s = static_cast<double>(plan.tokens_per_step) / step_s;
    const double tflops = plan.train_flops_per_step / step_s / 1e12;
    std::optional<double> val;
    if (config.train.eval_every > 0 && ((step + 1) % config.train.eval_every == 0 || step + 1 == plan.steps) &&
        sampler.val_tokens() > 0) {
      torch::NoGradGuard ng;
      double sum = 0;
      for (int64_t i = 0; i < config.train.eval_batches; ++i) {
        sampler.val_batch(i, in, tgt);
        sum += model.loss(to_long_tensor(in, B, T), to_long_tensor(tgt, B, T)).item<double>();
      }
      val = sum / static_cast<double>(config.train.eval_batches);
      result.val_losses.push_back(*val);
    }
    char val_text[32] = "";
    if (val) std::snprintf(val_text, sizeof val_text, " (val %.4f)", *val);
    char line[256];
    std::snprintf(line, sizeof line, "step %*lld/%lld | loss %.4f%s | lr %.2e | norm %.3f | %s tok/s | %.2f TFLOP/s | eta %s",
                  static_cast<int>(std::to_string(plan.steps).size()), static_cast<long long>(step + 1),
                  static_cast<long long>(plan.steps), loss, val_text, lr, norm,
                  format_count(static_cast<int64_t>(tok_s)).c_str(), tflops,
                  duration_text(elapsed / (step + 1 - result.first_step) * (plan.steps - step - 1)).c_str());
    if (opt.live_progress) {
      std::cerr << "\r\033[K" << line << std::flush;
      if (val || step + 1 == plan.steps) std::cerr << "\n";
    } else if ((step + 1) % std::max<int64_t>(1, opt.print_every) == 0 || step == 0 || step + 1 == plan.steps || val) {
      std::cerr << line << "\n";
      if (config.wall_clock_breakdown)  // DeepSpeed's format; "step" is the optimizer step with clipping
        std::fprintf(stderr, "time (ms) | fwd: %.2f | bwd: %.2f | step: %.2f\n", fwd_s * 1e3, bwd_s * 1e3, opt_s * 1e3);
    }
    char val_json[48] = "";
    if (val) std::snprintf(val_json, sizeof val_json, ", \"val_loss\": %.6f", *val);
    char json[400];
    std::snprintf(json, sizeof json,
                  "{\"step\": %lld, \"loss\": %.6f, \"lr\": %.6e, \"grad_norm\": %.6f, \"tokens_per_s\": %.1f, "
                  "\"step_s\": %.4f, \"forward_s\": %.4f, \"backward_s\": %.4f, \"optimizer_s\": %.4f, \"skipped\": %s%s}\n",
                  static_cast<long long>(step + 1), loss, lr, norm, tok_s, step_s, fwd_s, bwd_s, opt_s,
                  overflow ? "true" : "false", val_json);
    metrics << json << std::flush;
    const bool cadence = config.train.save_every > 0 && (step + 1) % config.train.save_every == 0;
    if (cadence || step + 1 == plan.steps || g_interrupted) save(step + 1);
  }
  std::signal(SIGINT, previous);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.interrupted = g_interrupted;
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) == 0) result.peak_rss_bytes = static_cast<double>(usage.ru_maxrss) * 1024.0;
  if (opt.live_progress && result.interrupted) std::cerr << "\n";
  return result;
}

}  // namespace ds
