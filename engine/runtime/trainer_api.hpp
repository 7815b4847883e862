// ds — what `ds train` hands the trainer and gets back: the plan, the config and these options in, a
// TrainResult out. Shared by the CLI (which never loads LibTorch) and the trainer in libds_train.so.
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

// The one symbol libds_train.so exports (C linkage: found by dlsym); it calls train().
extern "C" void ds_runtime_train(const Plan* plan, const TrainOptions* options, TrainResult* result);
using RuntimeTrainFn = void (*)(const Plan*, const TrainOptions*, TrainResult*);

}  // namespace ds
