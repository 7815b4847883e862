// ds — what a training run tells its user and tools: the run log (stderr and <output_dir>/train.log),
// the progress line, metrics.jsonl, DeepSpeed's monitors (CSV, TensorBoard), comms_logger and
// wall_clock_breakdown lines, and the closing summary (losses, bytes sent against the plan's collectives,
// peak memory against the plan's prediction). Rank 0 writes files; every rank keeps its TrainResult.
#pragma once

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/plan/plan.hpp"
#include "engine/runtime/comm/comm.hpp"
#include "engine/runtime/run/flat_params.hpp"
#include "engine/runtime/run/monitor.hpp"
#include "engine/runtime/run/optimizer_step.hpp"
#include "engine/runtime/run/trainer_api.hpp"

namespace ds {

// Every line the run prints also goes to <output_dir>/train.log with a timestamp, so a finished or
// crashed run keeps its own account. On a terminal, progress is one rewriting line: notes clear it first.
class RunLog {
 public:
  // An empty `file` logs to stderr only (ranks other than 0: the launcher captures their stderr).
  // Appended to, never truncated, as metrics.jsonl.
  // `command` names the run in its lines: callers write "ds train: ...", and a `ds profile` run's lines
  // say "ds profile: ..." instead.
  RunLog(const std::filesystem::path& file, bool live, const std::string& command = "ds train");
  void note(const std::string& line);
  // `due` lines (every steps_per_print steps, validations, the last step) stay on the terminal and go to
  // train.log; on a terminal every other step rewrites one live line below them.
  void progress(const std::string& line, bool due);
  void end_live_line();

 private:
  std::string named(const std::string& line) const;
  void write_file(const std::string& line);
  std::ofstream file_;
  bool live_;
  std::string command_;
};

class RunReport {
 public:
  // Rank 0 (`lead`) creates the run directory and writes config.json and plan.json there, and opens the
  // monitors the plan enables.
  RunReport(const Plan& plan, const TrainOptions& options, bool lead, TrainResult& result);
  RunLog& log() { return log_; }
  // Rank 0: opens metrics.jsonl (created only now, once the run has started) to append this run's steps
  // after `first_step` (the checkpoint's step, 0 for a fresh start). Lines an earlier start wrote for
  // later steps (after the checkpoint it continues from, or of a start that saved none) are dropped and
  // named: those steps are trained again.
  void open_metrics(int64_t first_step);

  // The opening lines: model, held bytes against the plan, data, batch.
  void describe(const FlatParams::Bytes& held, const std::string& data, int64_t train_tokens, int64_t val_tokens);
  // Before the first step: the clock starts.
  void start();
  // Around the optimizer step's own collectives (not the start's gathers, validation's or a checkpoint's):
  // begin_step before it, end_collectives right after it.
  // `ledger`: what the run's communicators have counted so far (the world's, and a mesh's groups' added); null on one rank.
  void begin_step(const CommLedger* ledger);
  void end_collectives(const CommLedger* ledger);
  // After each step: the result's losses and bytes, the progress line, comms_logger and wall-clock lines,
  // metrics.jsonl and the monitors.
  void step(int64_t step, const StepOutcome& o, std::optional<double> val, double step_s);
  // The closing lines: bytes sent per collective against the plan, losses, peak memory against the plan.
  void finish();

 private:
  void write_metrics(int64_t step, const StepOutcome& o, std::optional<double> val, double step_s, double step_flops, double comm_bytes,
                     double comm_s);
  const Plan& plan_;
  const TrainOptions& opt_;
  bool lead_;
  TrainResult& result_;
  std::filesystem::path dir_;
  std::ofstream metrics_;
  std::vector<std::unique_ptr<MetricSink>> monitors_;
  RunLog log_;
  std::chrono::steady_clock::time_point start_;
  double smoothed_step_s_ = 0;  // an exponential average over ~10 steps, for tok/s and TFLOP/s
  double smoothed_flops_ = 0;   // the same average of the steps' model FLOPs (fewer where masked rows skip the head)
  bool ranks_ = false;  // several ranks: collectives are reported
  CommLedger comm_before_, step_comm_, comm_total_;  // before this step, this step's, summed over the run's steps
  std::vector<double> pipeline_waits_;  // a pipeline stage: per step, the share of it spent waiting for the other stages
  // The code and file pages at the highest peak seen so far (read when the peak rises): the code that first
  // runs or is generated in the first steps and a mapped token file are in the peak but are not training's memory.
  void track_peak(double peak);
  double baseline_code_and_file_bytes_ = 0;
  double peak_seen_ = 0;
};

}  // namespace ds
