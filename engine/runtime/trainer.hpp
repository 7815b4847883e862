// ds — the training loop: executes a Plan on one process. It re-decides nothing: batch sizes,
// precision, layout, schedule and thread count all come from the Plan. The header carries no LibTorch
// types, so cli/ stays free of it.
//
// This build trains gpt2 and llama models in fp32 or bf16 with Adam/AdamW on one process, saves
// checkpoints (engine/runtime/checkpoint.hpp) every train.save_every steps, at the end and on Ctrl-C,
// and resumes from one exactly: in fp32 on the CPU, N steps + resume + N steps == 2N steps, bit for bit.
// Checks at start (before any work) reject what it cannot do yet, with exit code 2 and the reason.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/plan/plan.hpp"

namespace ds {

struct TrainOptions {
  std::string resolved_config_json;  // written to <output_dir>/config.json
  std::string plan_json;             // written to <output_dir>/plan.json
  bool live_progress = false;        // one rewriting status line (a terminal); else plain lines
  int64_t print_every = 10;          // plain progress lines every N steps
  std::string resume_from;           // a complete checkpoint directory to continue from, or ""
};

struct TrainResult {
  int64_t steps = 0;          // optimizer steps attempted
  int64_t skipped_steps = 0;  // inf/NaN gradients
  std::vector<double> losses;      // training loss per step (mean over its micro batches)
  std::vector<double> val_losses;  // at each validation
  double seconds = 0;
  bool interrupted = false;
  int stop_signal = 0;             // SIGINT or SIGTERM when interrupted
  int64_t first_step = 0;          // > 0 when resumed
  std::string metrics_path;
  std::string last_checkpoint;     // the newest checkpoint written, "" if none
  double peak_rss_bytes = 0;       // the process's peak resident memory (getrusage)
  double baseline_rss_bytes = 0;   // resident before training allocated anything (code, libraries)
  std::vector<double> comm_bytes; // per step: bytes this rank sent (ring algorithms), validation excluded
};

// Throws UserError for configurations this trainer cannot run (exit 2), std::runtime_error when the
// run fails (exit 1). Progress goes to stderr.
TrainResult train(const Plan& plan, const Config& config, const TrainOptions& options);

// The reasons `train` would refuse this plan, empty when it can run it (for `ds plan` and tests).
std::vector<std::string> unsupported_by_trainer(const Plan& plan, const Config& config);

}  // namespace ds
