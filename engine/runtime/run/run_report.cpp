#include "engine/runtime/run/run_report.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/files.hpp"
#include "common/format.hpp"
#include "common/idle_waits.hpp"
#include "engine/runtime/data/token_source.hpp"
#include "engine/runtime/device/resident_memory.hpp"

namespace ds {
namespace {

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

// A value for metrics.jsonl, the shortest text that reads back as the same double (a loss compared across
// runs must not lose its last digits there); JSON has no inf or NaN (an overflowed fp16 step's norm): null.
std::string json_number(double v) { return std::isfinite(v) ? format_double(v) : "null"; }

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

RunLog::RunLog(const std::filesystem::path& file, bool live, const std::string& command) : live_(live), command_(command) {
  if (!file.empty()) {
    file_.open(file, std::ios::app);
    if (!file_) throw std::runtime_error("cannot write " + file.string());
  }
}

std::string RunLog::named(const std::string& line) const {
  static const std::string train = "ds train:";
  return line.rfind(train, 0) == 0 && command_ != "ds train" ? command_ + ":" + line.substr(train.size()) : line;
}

void RunLog::note(const std::string& text) {
  const std::string line = named(text);
  if (live_) std::cerr << "\r\033[K";
  std::cerr << line << "\n";
  write_file(line);
}

void RunLog::progress(const std::string& text, bool due) {
  const std::string line = named(text);
  if (live_) {
    std::cerr << "\r\033[K" << line << (due ? "\n" : "") << std::flush;
  } else if (due) {
    std::cerr << line << "\n";
  }
  if (due) write_file(line);
}

void RunLog::end_live_line() {
  if (live_) std::cerr << "\n";
}

void RunLog::write_file(const std::string& line) {
  if (!file_.is_open()) return;
  const std::time_t now = std::time(nullptr);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", std::localtime(&now));
  file_ << stamp << " " << line << "\n" << std::flush;
  if (!file_) throw std::runtime_error("writing train.log failed (is the disk full?)");
}

namespace {
// Truncates a file after its last newline, when something follows it.
void drop_partial_last_line(const std::string& path) {
  std::error_code ec;
  const auto size = static_cast<int64_t>(std::filesystem::file_size(path, ec));
  if (ec || size == 0) return;
  std::ifstream in(path, std::ios::binary);
  int64_t keep = size;  // bytes up to and including the last newline
  std::string chunk;
  for (int64_t end = size; end > 0 && keep == size;) {  // backwards, 64 KiB at a time
    const int64_t begin = std::max<int64_t>(0, end - 65536);
    chunk.resize(static_cast<size_t>(end - begin));
    in.seekg(begin);
    in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    if (end == size && chunk.back() == '\n') return;
    const size_t nl = chunk.rfind('\n');
    if (nl != std::string::npos) keep = begin + static_cast<int64_t>(nl) + 1;
    else if (begin == 0) keep = 0;
    end = begin;
  }
  std::filesystem::resize_file(path, static_cast<uintmax_t>(keep), ec);
  if (ec) throw std::runtime_error("cannot repair " + path + " (a partial last line): " + ec.message());
  std::cerr << "ds train: " << path << " ended in a partial line (" << size - keep << " bytes, from an interrupted write): removed\n";
}

// Rank 0 creates the run directory before the log opens its train.log there.
std::filesystem::path prepared_dir(const Plan& plan, bool lead) {
  const std::filesystem::path dir(plan.run.output_dir);
  if (lead) std::filesystem::create_directories(dir);
  return dir;
}
}  // namespace

RunReport::RunReport(const Plan& plan, const TrainOptions& options, bool lead, TrainResult& result)
    : plan_(plan),
      opt_(options),
      lead_(lead),
      result_(result),
      dir_(prepared_dir(plan, lead)),
      log_(lead ? dir_ / "train.log" : std::filesystem::path(), options.live_progress && lead, options.profile ? "ds profile" : "ds train") {
  baseline_code_and_file_bytes_ = resident_code_and_file_bytes();
  result_.metrics_path = (dir_ / "metrics.jsonl").string();
  if (!lead) return;
  // Through a temporary name (NAME.partial, which the run directory's survey knows as ds's): a kill
  // mid-write leaves the earlier file or none, never a cut one that could be taken for a user's.
  for (const auto& [name, text] : {std::pair{"config.json", &opt_.resolved_config_json}, {"plan.json", &opt_.plan_json}})
    write_text_atomically((dir_ / name).string(), *text + "\n");
  monitors_ = open_monitors(plan.run);
}

namespace {
// The step a metrics.jsonl line records, or -1 when it has none.
int64_t step_of_line(const std::string& line) {
  const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
  return j.is_object() && j.contains("step") && j["step"].is_number_integer() ? j["step"].get<int64_t>() : -1;
}
}  // namespace

void RunReport::open_metrics(int64_t first_step) {
  if (!lead_) return;
  const std::string& path = result_.metrics_path;
  drop_partial_last_line(path);  // a line cut short (disk full, a kill mid-write) is not JSONL
  // Appended: a resumed run's steps follow the earlier ones up to its checkpoint.
  int64_t keep = 0, first_dropped = -1, last_dropped = -1;
  if (first_step < plan_.steps) {  // a run with nothing to do leaves the record as it is
    std::ifstream in(path, std::ios::binary);
    int64_t at = 0;
    for (std::string line; std::getline(in, line);) {
      const int64_t next = at + static_cast<int64_t>(line.size()) + 1;
      const int64_t step = step_of_line(line);
      if (first_dropped < 0 && step > first_step) first_dropped = step;
      if (first_dropped < 0) keep = next;
      else last_dropped = std::max(last_dropped, step);
      at = next;
    }
  }
  if (first_dropped >= 0) {
    std::error_code ec;
    std::filesystem::resize_file(path, static_cast<uintmax_t>(keep), ec);
    if (ec) throw std::runtime_error("cannot trim " + path + ": " + ec.message());
    log_.note("ds train: " + path + ": dropped steps " + std::to_string(first_dropped) + "-" + std::to_string(last_dropped) +
              (first_step > 0 ? ", recorded after the checkpoint of step " + std::to_string(first_step) + " by a run that stopped later"
                              : ", recorded by an earlier start that saved no checkpoint") +
              ": this run trains them again");
  }
  metrics_.open(path, std::ios::app);
  if (!metrics_) throw std::runtime_error("cannot write " + path);
}

namespace {
// How idle OpenMP and OpenBLAS threads wait, when set (cli/main.cpp sets short waits unless the user
// chose). Read from the environment the process started with (/proc/self/environ): what the libraries read.
std::string idle_wait_policy() {
  std::ifstream in("/proc/self/environ", std::ios::binary);
  std::string entry;
  std::vector<std::string> environ_entries;
  while (std::getline(in, entry, '\0')) environ_entries.push_back(entry);
  std::string out;
  auto name = [&](const char* variable) {
    const std::string prefix = std::string(variable) + "=";
    for (const std::string& e : environ_entries)
      if (e.rfind(prefix, 0) == 0) out += (out.empty() ? " (" : ", ") + e;
  };
  for (const IdleWait& w : kIdleWaits) {
    if (w.user_choice) name(w.user_choice);
    name(w.variable);
  }
  return out.empty() ? out : out + ")";
}
}  // namespace

namespace {
// A split model's mesh as the run log names it, after "on 8 ranks (": "tensor 2 x pipeline 2 x data 2: this rank, of
// stage 0 (blocks 0-1 and the embeddings), trains N parameters and holds M frozen), ZeRO stage 1 over each data group of 2".
std::string mesh_description(const Plan& p) {
  const MeshShape& m = p.mesh.shape;
  std::string d = "tensor " + std::to_string(m.tensor) + (m.pipeline > 1 ? " x pipeline " + std::to_string(m.pipeline) : "") + " x data " +
                  std::to_string(m.data) + ": ";
  if (m.pipeline > 1) {
    const int s = own_stage(p);
    const PipelineStage& st = p.mesh.stages[static_cast<size_t>(s)];
    const std::string blocks = st.blocks == 1 ? "block " + std::to_string(st.first_block)
                               : "blocks " + std::to_string(st.first_block) + "-" + std::to_string(st.first_block + st.blocks - 1);
    d += "this rank, of stage " + std::to_string(s) + " (" + blocks + (st.embeddings ? " and the embeddings" : st.head ? " and the head" : "") +
         "), ";
  } else {
    d += "each rank ";
  }
  // The rank's own share: what it trains, and what it holds frozen beside it.
  const int64_t frozen = p.own.frozen_numel();
  d += "trains " + format_count(p.layout.numel) + " parameters" + (frozen > 0 ? " and holds " + format_count(frozen) + " frozen" : "") + ")";
  if (m.data > 1) d += ", ZeRO stage " + std::to_string(p.zero_stage()) + " over each data group of " + std::to_string(m.data);
  return d;
}
}  // namespace

void RunReport::describe(const FlatParams::Bytes& held, const std::string& data, int64_t train_tokens, int64_t val_tokens) {
  const Plan& p = plan_;
  const int W = p.topology.world_size;
  const std::string lora = p.lora.enabled ? " (frozen; a LoRA adapter of r " + std::to_string(p.lora.r) + ", " +
                                                format_count(p.lora.adapters.num_params) + " parameters, trains)"
                                          : std::string();
  log_.note("ds train: " + p.model.hp.name + ", " + format_count(p.model.num_params) + " parameters" + lora + ", " + p.precision.mode + ", " +
            optimizer_type_name(p.optimizer.type) +
            (p.mesh.shape.splits_the_model() ? " on " + std::to_string(W) + " ranks (" + mesh_description(p)
             : W > 1                         ? ", ZeRO stage " + std::to_string(p.zero_stage()) + " on " + std::to_string(W) + " ranks"
                                             : std::string()));
  double in_flight = 0;  // allocated per collective (the communicator's copies, communication_data_type's cast): in the plan's buffers, never held here
  for (const ZeroBuffer& b : p.execution.buffers)
    if (b.transient) in_flight += b.bytes();
  log_.note("ds train: " + held_bytes_line(held, p.memory.held()) +
            (in_flight > 0 ? "; the plan's buffers count " + format_bytes(in_flight) + " allocated for each collective in flight" : ""));
  log_.note("ds train: data " + data + "; " + format_count(train_tokens) + " training / " + format_count(val_tokens) +
            " validation tokens");
  log_.note("ds train: " + std::to_string(p.steps) + " steps of " + std::to_string(p.batch.train_batch_size) + " x " +
            std::to_string(p.seq_len) + " tokens (" + std::to_string(p.batch.micro_batch) + " x " +
            std::to_string(p.batch.grad_accum) + " micro batches), " + std::to_string(p.threads) +
            (p.threads == 1 ? " thread" : " threads") + idle_wait_policy() + "; writing " + dir_.string() + "/");
}

void RunReport::start() { start_ = std::chrono::steady_clock::now(); }

void RunReport::begin_step(const CommLedger* ledger) {
  if (ledger) comm_before_ = *ledger;
}

void RunReport::end_collectives(const CommLedger* ledger) {
  step_comm_.clear();
  if (!ledger) return;
  ranks_ = true;
  for (const auto& [kind, st] : *ledger) {
    CommStats d = st;
    if (auto it = comm_before_.find(kind); it != comm_before_.end()) {
      d.calls -= it->second.calls;
      d.bytes -= it->second.bytes;
      d.seconds -= it->second.seconds;
    }
    if (d.calls == 0 && d.seconds == 0) continue;  // (a kind this rank only receives has time, not calls)
    step_comm_[kind] = d;
    comm_total_[kind].bytes += d.bytes;
    comm_total_[kind].calls += d.calls;
    comm_total_[kind].seconds += d.seconds;
  }
}

// metrics.jsonl's line for a step: every figure of it, each step's own (the console's are smoothed).
void RunReport::write_metrics(int64_t step, const StepOutcome& o, std::optional<double> val, double step_s, double step_flops,
                              double comm_bytes, double comm_s) {
  const Plan& p = plan_;
  const StepPhases& ph = o.phases;
  const double forward_s = ph.forward, backward_s = ph.backward, after_s = ph.reduce + ph.norm + ph.offload + ph.optimizer + ph.gather;
  char val_json[48] = "";
  if (val) std::snprintf(val_json, sizeof val_json, ", \"val_loss\": %s", json_number(*val).c_str());
  char scale_json[48] = "";
  if (p.precision.loss_scaling.enabled) std::snprintf(scale_json, sizeof scale_json, ", \"loss_scale\": %g", o.loss_scale);
  // wall_clock_breakdown: every phase of the step, in seconds (they sum to step_s but for loop overhead).
  std::string phases_json;
  if (p.run.wall_clock_breakdown) {
    char buf[400];
    std::snprintf(buf, sizeof buf,
                  ", \"phases\": {\"data\": %.6f, \"forward\": %.6f, \"backward\": %.6f, \"reduce\": %.6f, \"norm\": %.6f, "
                  "\"offload\": %.6f, \"optimizer\": %.6f, \"gather\": %.6f}",
                  ph.data, ph.forward, ph.backward, ph.reduce, ph.norm, ph.offload, ph.optimizer, ph.gather);
    phases_json = buf;
  }
  char json[512];
  std::snprintf(json, sizeof json,
                "{\"step\": %lld, \"loss\": %s, \"lr\": %.6e, \"grad_norm\": %s, \"tokens_per_s\": %.1f, "
                "\"step_s\": %.4f, \"forward_s\": %.4f, \"backward_s\": %.4f, \"optimizer_s\": %.4f, \"comm_bytes\": %.0f, "
                "\"comm_s\": %.4f, \"offload_bytes\": %.0f, \"offload_s\": %.6f, \"tflops\": %.6g, \"skipped\": %s%s%s",
                static_cast<long long>(step + 1), json_number(o.loss).c_str(), o.lr, json_number(o.norm).c_str(),
                static_cast<double>(p.tokens_per_step) / step_s, step_s,
                forward_s, backward_s, after_s, comm_bytes, comm_s, o.offload_bytes, ph.offload,
                step_flops / step_s / 1e12,
                o.skipped ? "true" : "false", scale_json, val_json);
  // Fine-tuning data: the step's trained tokens (its counted targets, every rank's), read from the data.
  const std::string trained = o.trained_tokens >= 0 ? ", \"trained_tokens\": " + std::to_string(o.trained_tokens) : "";
  // ZeRO-Offload's host step during the forward: its seconds there, the last update's (inside forward_s).
  std::string deferred;
  if (p.execution.step_in_forward) {
    char buf[48];
    std::snprintf(buf, sizeof buf, ", \"deferred_step_s\": %.6f", o.deferred_step_s);
    deferred = buf;
  }
  // The speculative step: the tiles stepped during the last backward, those restored, and their copies beyond the plan's.
  if (p.execution.step_in_backward) {
    char buf[128];
    std::snprintf(buf, sizeof buf, ", \"speculated_tiles\": %lld, \"restored_tiles\": %lld, \"speculation_bytes\": %.0f",
                  static_cast<long long>(o.speculated_tiles), static_cast<long long>(o.restored_tiles), o.speculation_bytes);
    deferred += buf;
  }
  metrics_ << (std::string(json) + trained + deferred + phases_json + "}\n") << std::flush;  // one write per line
  if (!metrics_) throw std::runtime_error("writing " + result_.metrics_path + " failed (is the disk full?)");
}

void RunReport::step(int64_t step, const StepOutcome& o, std::optional<double> val, double step_s) {
  const Plan& p = plan_;
  const double step_flops = p.train_flops_of_step(o.counted_targets, o.attention_squares);
  double comm_bytes = 0, comm_s = 0;
  for (const auto& [kind, d] : step_comm_) {
    comm_bytes += d.bytes;
    comm_s += d.seconds;
  }
  result_.comm_bytes.push_back(comm_bytes);
  if (p.mesh.shape.pipeline > 1) {
    // Idle: the receives' waits (a send returns at once), the tied table's exchange and the step's agreement, which a
    // stage that finished first waits in for the others (the last stage ends its backwards before the first does).
    double waited = 0;
    for (const auto& [kind, d] : step_comm_)
      if (waits_for_other_stages(kind)) waited += d.seconds;
    if (step_s > 0) pipeline_waits_.push_back(waited / step_s);
    if (keeps_step_measurements(p, opt_)) result_.stage_waits_s.push_back(waited);
  }
  const double peak = peak_resident_bytes();
  track_peak(peak);
  if (keeps_step_measurements(p, opt_)) {
    result_.comm_seconds.push_back(comm_s);
    result_.offload_bytes.push_back(o.offload_bytes);
    result_.step_seconds.push_back(step_s);
    result_.phases.push_back(o.phases);
    result_.rss_bytes.push_back(peak);
    result_.model_flops.push_back(step_flops);
  }
  result_.losses.push_back(o.loss);
  if (val) result_.val_losses.push_back(*val);
  if (o.skipped) ++result_.skipped_steps;
  result_.steps = step + 1;

  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  // The console line's rates are smoothed over recent steps; metrics.jsonl's are each step's own. The
  // average starts again at the second step: the first one's warm-up (allocations, library handles) would
  // weigh on it for dozens of steps (GPT-2 124M on an H200 showed 180k tokens/s at step 30 while running at 290k).
  const bool restart = step <= result_.first_step + 1;
  smoothed_step_s_ = restart ? step_s : 0.9 * smoothed_step_s_ + 0.1 * step_s;
  smoothed_flops_ = restart ? step_flops : 0.9 * smoothed_flops_ + 0.1 * step_flops;
  const double tok_s = static_cast<double>(p.tokens_per_step) / smoothed_step_s_;
  const double tflops = smoothed_flops_ / smoothed_step_s_ / 1e12;
  char val_text[32] = "";
  if (val) std::snprintf(val_text, sizeof val_text, " (val %.4f)", *val);
  char line[256];
  std::snprintf(line, sizeof line, "step %*lld/%lld | loss %.4f%s | lr %.2e | norm %.3f | %s tok/s | %s TFLOP/s | eta %s",
                static_cast<int>(std::to_string(p.steps).size()), static_cast<long long>(step + 1), static_cast<long long>(p.steps),
                o.loss, val_text, o.lr, o.norm, format_count(static_cast<int64_t>(tok_s)).c_str(), three_digits(tflops).c_str(),
                duration_text(elapsed / static_cast<double>(step + 1 - result_.first_step) * static_cast<double>(p.steps - step - 1))
                    .c_str());
  const bool due = (step + 1) % std::max<int64_t>(1, opt_.print_every) == 0 || step == 0 || step + 1 == p.steps || val;
  // DeepSpeed's three wall-clock figures: forward, backward, and "step" = everything after backward.
  const StepPhases& ph = o.phases;
  const double forward_s = ph.forward, backward_s = ph.backward, after_s = ph.reduce + ph.norm + ph.offload + ph.optimizer + ph.gather;
  log_.progress(line, due);
  if (due && p.run.comms_logger && ranks_) {  // DeepSpeed's comms_logger: bytes and time per collective
    std::string c = "comms step " + std::to_string(step + 1) + ": ";
    for (const auto& [kind, d] : step_comm_)
      c += std::string(c.back() == ' ' ? "" : " | ") + collective_name(kind) + " " + std::to_string(d.calls) + "x " +
           format_bytes(d.bytes) + " " + format_fixed(d.seconds * 1e3, 2) + " ms";
    log_.note(c);
  }
  if (due && p.run.wall_clock_breakdown && !opt_.live_progress) {  // DeepSpeed's format; "step" = optimizer + clipping
    char times[128];
    std::snprintf(times, sizeof times, "time (ms) | fwd: %.2f | bwd: %.2f | step: %.2f", forward_s * 1e3, backward_s * 1e3,
                  after_s * 1e3);
    log_.note(times);
  }
  if (lead_) write_metrics(step, o, val, step_s, step_flops, comm_bytes, comm_s);
  if (!monitors_.empty()) {
    const int64_t samples = (step + 1) * p.batch.train_batch_size;  // DeepSpeed's x axis
    std::vector<MetricEvent> events{{"Train/Samples/train_loss", o.loss, samples}, {"Train/Samples/lr", o.lr, samples},
                                    {"Train/Samples/grad_norm", o.norm, samples}};
    if (p.precision.loss_scaling.enabled) events.push_back({"Train/Samples/loss_scale", o.loss_scale, samples});
    if (val) events.push_back({"Train/Samples/val_loss", *val, samples});
    if (p.run.wall_clock_breakdown)
      for (const auto& [name, s] : {std::pair{"forward", forward_s}, {"backward", backward_s}, {"step", after_s}})
        events.push_back({std::string("Train/Samples/elapsed_time_ms_") + name, s * 1e3, samples});
    for (const auto& m : monitors_) m->write(events);
  }
}

void RunReport::finish() {
  const Plan& p = plan_;
  TrainResult& r = result_;
  if (ranks_ && r.steps > r.first_step) {
    // What went on the wire per step beside the plan's prediction, per collective.
    const double n = static_cast<double>(r.steps - r.first_step);
    log_.note("ds train: sent per rank per step (plan):");
    const auto line = [&](CollectiveKind kind, int64_t planned_calls, double planned_bytes) {
      const auto it = comm_total_.find(kind);
      const double bytes = it == comm_total_.end() ? 0.0 : it->second.bytes / n;
      const double calls = it == comm_total_.end() ? 0.0 : static_cast<double>(it->second.calls) / n;
      if (calls == 0 && planned_calls == 0) return;  // (a pipeline stage training nothing reduces no gradient)
      log_.note(std::string("  ") + collective_name(kind) + ": " + format_fixed(calls, 1) + " calls, " + format_bytes(bytes) + " (" +
                std::to_string(planned_calls) + " calls, " + format_bytes(planned_bytes) + ")");
    };
    for (const Collective& c : p.execution.collectives) line(c.kind, c.calls_per_step, c.wire_bytes_per_rank_per_step);
    if (!p.mesh.stages.empty())  // the mesh's own, from its traffic at this rank's stage
      for (const MeshCollective& c : mesh_collectives(p.mesh.stages[static_cast<size_t>(own_stage(p))].traffic)) line(c.kind, c.calls, c.bytes);
  }
  for (const auto& [kind, d] : comm_total_) r.collectives.push_back({collective_name(kind), d.calls, d.bytes, d.seconds});
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  r.peak_rss_bytes = peak_resident_bytes();
  for (const auto& phases : r.phase_rss_bytes)  // ds profile restarts the high-water mark at every phase
    for (double b : phases) r.peak_rss_bytes = std::max(r.peak_rss_bytes, b);
  track_peak(r.peak_rss_bytes);
  if (r.interrupted) log_.end_live_line();
  if (r.losses.empty()) return;
  // The run's last lines, on the terminal and in train.log.
  auto four = [](double v) { return format_fixed(v, 4); };
  std::string done = std::string("ds train: ") + (r.interrupted ? "interrupted at step " : "done: ") + std::to_string(r.steps) +
                     " of " + std::to_string(p.steps) + " steps (" + std::to_string(r.steps - r.first_step) + " this run) in " +
                     format_fixed(r.seconds, 1) + " s; loss " + four(r.losses.front()) + " -> " + four(r.losses.back());
  if (!r.val_losses.empty()) done += " (validation " + four(r.val_losses.back()) + ")";
  if (p.data.type == DataType::synthetic) done += "; the synthetic language's floor is " + four(markov_entropy_nats());
  if (r.skipped_steps) done += "; " + std::to_string(r.skipped_steps) + (r.skipped_steps == 1 ? " step" : " steps") + " skipped";
  log_.note(done);
  const double predicted = p.memory.held().total();
  const double training = r.training_rss_bytes();
  log_.note("ds train: peak resident memory " + format_bytes(r.peak_rss_bytes) + ": " + format_bytes(r.baseline_rss_bytes) +
            " of code and libraries + " + format_bytes(r.paged_file_bytes) + " of code and files paged in since + " +
            (training > 0 ? format_bytes(training) + " for training, " + format_fixed(training / predicted, 2) + "x the plan's " +
                                format_bytes(predicted) + " (the plan leaves out allocator slack and library workspaces)"
                          // Memory this process freed before the run (an earlier run in it) was reused: no growth to show.
                          : "no growth for training (it reused memory this process had freed before it; the plan's " +
                                format_bytes(predicted) + ")"));
  // A pipeline stage's idle time beside the plan's bubble, the first step left out.
  if (pipeline_waits_.size() > 1) {
    std::vector<double> later(pipeline_waits_.begin() + 1, pipeline_waits_.end());
    std::nth_element(later.begin(), later.begin() + static_cast<std::ptrdiff_t>(later.size() / 2), later.end());
    const MeshPlan& m = p.mesh;
    log_.note("ds train: stage " + std::to_string(own_stage(p)) + " waited for the other stages (their activations, gradients, the step's end) " +
              format_fixed(100 * later[later.size() / 2], 1) + "% of a step (the median after the first; the plan's bubble: " +
              format_fixed(100 * m.bubble, 1) + "%, (p - 1) / (m + p - 1) with p " + std::to_string(m.shape.pipeline) + ", m " +
              std::to_string(m.micro_batches) + "; more is the stages' uneven work or the link" +
              (stage_runs_backward(m.stages[static_cast<size_t>(own_stage(p))], p.backward_from)
                   ? ")"
                   : "; this stage runs forward only, nothing in or below it training, and waits out the others' backward)"));
  }
  // The plan's predicted step beside the measured one (its first step left out: warm-up), where the plan knew the rates.
  if (p.step_time.step_known() && r.step_seconds.size() > 1) {
    std::vector<double> later(r.step_seconds.begin() + 1, r.step_seconds.end());
    std::nth_element(later.begin(), later.begin() + static_cast<std::ptrdiff_t>(later.size() / 2), later.end());
    const double measured = later[later.size() / 2];
    log_.note("ds train: a step took " + format_fixed(measured * 1e3, 1) + " ms (the median after the first), the plan predicted " +
              format_fixed(p.step_time.step_s() * 1e3, 1) + " ms (" + format_fixed(measured / p.step_time.step_s(), 2) + "x; ds plan's STEP TIME)");
  }
  if (r.device_peak_bytes > 0) {
    const double on_device = p.memory.device.total(), trained = r.device_peak_bytes - r.device_baseline_bytes;
    log_.note("ds train: GPU memory in use after a step at most " + format_bytes(r.device_peak_bytes) + ": " +
              format_bytes(r.device_baseline_bytes) + " before training (CUDA context, other processes) + " + format_bytes(trained) +
              " for training, " + format_fixed(trained / on_device, 2) + "x the plan's " + format_bytes(on_device) +
              " on the device (LibTorch's cache holds the step's peak)");
  }
}

void RunReport::track_peak(double peak) {
  if (peak <= peak_seen_) return;
  peak_seen_ = peak;
  result_.paged_file_bytes = std::max(0.0, resident_code_and_file_bytes() - baseline_code_and_file_bytes_);
}

}  // namespace ds
