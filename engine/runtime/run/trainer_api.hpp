// ds — what `ds train` hands the trainer and gets back: the plan, the config and these options in, a
// TrainResult out. Shared by the CLI (which never loads LibTorch) and the trainer in libds_train.so.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "common/stop_signals.hpp"
#include "engine/plan/plan.hpp"
#include "engine/runtime/device/kernel_trace.hpp"

namespace ds {

struct TrainOptions {
  std::string resolved_config_json;  // written to <output_dir>/config.json
  std::string plan_json;             // written to <output_dir>/plan.json
  bool live_progress = false;        // one rewriting status line (a terminal); else plain lines
  int64_t print_every = 10;          // plain progress lines every N steps
  std::string resume_from;           // a complete checkpoint directory to continue from, or ""
  // ds profile: no checkpoint and no validation; the compute dtype's matmul rate at the model's shapes
  // is measured before the first step and after each (TrainResult::gemm_peak_flops, gemm_rates).
  bool profile = false;
  // How the run takes Ctrl-C and SIGTERM: through the process's signals' thread (common/stop_signals.hpp).
  // A field, not a direct call, because this library carries its own copy of that code while the thread
  // belongs to the ds binary that loaded it; built there, the default is the binary's.
  StopHandler (*set_stop_handler)(StopHandler) = &ds::set_stop_handler;
};

// Where one optimizer step's time went, in seconds, phase by phase in the order they run. Under
// overlap_comm the gradient reduction runs inside backward (its hooks); `reduce` is what is left after.
struct StepPhases {
  double data = 0;       // the step's batches: sampling and conversion to model input
  double forward = 0;    // the loss of every micro batch (stage 3: with its parameter gathers)
  double backward = 0;   // gradients of every micro batch (with the reductions its hooks start)
  double reduce = 0;     // the rest of the gradient reduction, rounding to the stored gradient dtype
  double norm = 0;       // gradient norm, the ranks' agreement on loss / norm / stop, overflow check, clipping
  double offload = 0;    // optimizer offload: gradients to the host, weights back
  double optimizer = 0;  // the fused optimizer update of this rank's part
  double gather = 0;     // the new weights published to every rank (and widened to the compute dtype)
};

// One run of a block within a step (ds profile's trace): when it began, after the step's start.
struct BlockSpan {
  int layer = 0;
  bool backward = false;
  double start_s = 0, seconds = 0;
};

// One collective within a step (ds profile's trace): from issue to completion on this rank.
struct CollectiveSpan {
  std::string name;  // collective_name()
  double start_s = 0, seconds = 0, bytes = 0;
};

// One piece of the host's offload work within a step (ds profile's trace): the plan's offload row it is part of
// (StepTime's OffloadTime::what: "gradients to the host" for the host's waits for those copies and the copies it
// makes, "gradients summed on the host", "optimizer step on the host", "updated weights to the device" for its
// waits for a staging buffer and its copies, "speculated states backed up"), where it ran, and when on the host's
// clock after the step's start. During the forward or the backward a GPU may hide it behind compute; what runs
// after them (the last blocks' sums included) it does not.
struct HostWorkSpan {
  enum class During { forward, backward, after };
  std::string what;
  int64_t index = -1;       // the block whose gradients were summed; the weight tile stepped (-1: the whole span)
  int64_t hook = -1;        // the block whose backward hook ran it (-1: none)
  int64_t micro_step = -1;  // the micro step whose forward or backward ran it
  During during = During::after;
  double start_s = 0, seconds = 0;
};

struct TrainResult {
  int64_t steps = 0;          // optimizer steps attempted
  int64_t skipped_steps = 0;  // inf/NaN gradients
  std::vector<double> losses;      // training loss per step (mean over its micro batches)
  std::vector<double> val_losses;  // at each validation
  double seconds = 0;
  bool interrupted = false;
  int stop_signal = 0;             // SIGINT or SIGTERM when interrupted
  std::string stopped_while;       // interrupted before the first step: what it was doing ("drawing the initial weights")
  int64_t first_step = 0;          // > 0 when resumed
  std::string metrics_path;
  std::string last_checkpoint;     // the newest checkpoint written, "" if none
  double peak_rss_bytes = 0;       // the process's peak resident memory (getrusage)
  double baseline_rss_bytes = 0;   // resident before training allocated anything (code, libraries)
  double paged_file_bytes = 0;     // code and files come in since then, at the peak: file-backed pages (code first
                                   // run, mapped data) and code generated at run time (oneDNN's JIT kernels)
  double device_baseline_bytes = 0;  // a GPU run: device memory in use before training allocated (context, others)
  double device_peak_bytes = 0;      // a GPU run: the most in use after any step (LibTorch's cache keeps the step's peak)
  std::vector<double> comm_bytes; // per step: bytes this rank sent (ring algorithms), validation excluded
  // ZeRO-Offload (plan.execution.step_in_forward): the weight tiles the host stepped during a next step's forward
  // (the last update's tiles are stepped before its checkpoint, not counted here).
  int64_t tiles_stepped_in_forward = 0;
  // Kept only when keeps_step_measurements (below): one entry per step.
  std::vector<double> step_seconds;       // per step: the optimizer step's wall time
  std::vector<StepPhases> phases;         // per step: where that time went
  std::vector<double> comm_seconds;       // per step: time spent inside collectives
  std::vector<double> offload_bytes;      // per step: bytes copied between device and host (optimizer offload)
  std::vector<double> rss_bytes;          // per step: peak resident memory so far, after the step
  std::vector<double> step_start_s;       // per step: when it began, seconds after the first step's start
  std::vector<double> model_flops;        // per step: its model FLOPs over all ranks (Plan::train_flops_of_step)
  std::vector<double> stage_waits_s;      // a pipeline stage, per step: held up by the other stages (waits_for_other_stages)
  struct CollectiveTotal {
    std::string name;  // collective_name()
    int64_t calls = 0;
    double bytes = 0, seconds = 0;
  };
  std::vector<CollectiveTotal> collectives;  // summed over the run's steps (validation excluded)
  std::vector<std::vector<double>> block_forward_s, block_backward_s;  // ds profile: per step, per block
  std::vector<std::vector<double>> attention_forward_s, mlp_backward_s;  // ds profile: the attention half's forward and the MLP half's backward of those
  std::vector<std::vector<BlockSpan>> block_spans;                    // ds profile: per step, every block run
  std::vector<std::vector<CollectiveSpan>> collective_spans;          // ds profile: per step, every collective
  std::vector<std::vector<HostWorkSpan>> host_work_spans;           // ds profile: per step, the host's offload work
  std::vector<std::array<double, 8>> phase_rss_bytes;  // ds profile: per step, the peak resident memory within each phase
  std::vector<std::array<double, 8>> phase_device_bytes;  // ds profile on a GPU: per step, its memory in use at each phase's end
  double gemm_peak_flops = 0;             // ds profile: FLOP/s of the model's matmul shapes before the first step (gemm_peak.hpp)
  // ds profile: per step, the same measured right after it, so each step's MFU is taken against the rate the
  // machine had then (a shared or throttling machine's rate drifts by 2x over minutes).
  std::vector<double> gemm_rates;
  // ds profile on a GPU: per step, the kernels it ran (CUPTI), the longest first; or why none are listed.
  std::vector<std::vector<KernelTime>> kernel_times;
  // And per step, its copies between the host's and the GPU's memory, by way and host memory (copy_name): a copy to
  // pageable host memory is the host waiting for the GPU (a figure read back).
  std::vector<std::vector<KernelTime>> copy_times;
  std::string kernels_not_listed;

  // What training itself held at the peak, to set against the plan: neither the code and libraries there
  // before it began nor the file-backed pages that came in since.
  double training_rss_bytes() const { return peak_rss_bytes - baseline_rss_bytes - paged_file_bytes; }
};

// Whether the run keeps its per-step measurements for a profile report (phases, block and collective
// spans, memory): ds profile, or ds train with the flops_profiler block. Other runs keep none of them.
inline bool keeps_step_measurements(const Plan& plan, const TrainOptions& options) {
  return options.profile || plan.run.flops_profiler.enabled;
}

// The one symbol libds_train.so exports (C linkage: found by dlsym); it calls train().
extern "C" void ds_runtime_train(const Plan* plan, const TrainOptions* options, TrainResult* result);
using RuntimeTrainFn = void (*)(const Plan*, const TrainOptions*, TrainResult*);

}  // namespace ds
