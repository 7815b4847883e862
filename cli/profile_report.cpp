#include "cli/profile_report.hpp"

#include <algorithm>
#include <array>
#include <functional>
#include <map>
#include <sstream>

#include "common/error.hpp"
#include "common/format.hpp"
#include "common/strings.hpp"
#include "engine/plan/flops.hpp"
#include "engine/plan/mesh.hpp"

namespace ds::cli {

using nlohmann::json;

namespace {

constexpr const char* kPhaseNames[] = {"data", "forward", "backward", "reduce", "norm", "offload", "optimizer", "gather"};

std::vector<double> phase_values(const StepPhases& p) {
  return {p.data, p.forward, p.backward, p.reduce, p.norm, p.offload, p.optimizer, p.gather};
}

// The middle value (the mean of the two middle ones for an even count); 0 for none.
double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// The mean of f over steps [first, end).
double mean_over(const json& steps, int first, int end, const std::function<double(const json&)>& f) {
  double sum = 0;
  int n = 0;
  for (int i = first; i < end; ++i, ++n) sum += f(steps[static_cast<size_t>(i)]);
  return n ? sum / n : 0.0;
}

std::string ms(double s) { return format_fixed(s * 1e3, 2) + " ms"; }
std::string pct(double f) { return format_fixed(f * 100, 1) + "%"; }

const char* during_name(HostWorkSpan::During d) {
  switch (d) {
    case HostWorkSpan::During::forward: return "forward";
    case HostWorkSpan::During::backward: return "backward";
    case HostWorkSpan::During::after: return "after";
  }
  return "?";
}

}  // namespace

json profile_rank_part(const Plan& plan, const TrainResult& r) {
  json steps = json::array();
  for (size_t i = 0; i < r.step_seconds.size(); ++i) {
    json phases = json::object();
    const auto v = phase_values(r.phases[i]);
    for (size_t k = 0; k < v.size(); ++k) phases[kPhaseNames[k]] = v[k];
    steps.push_back({{"start_s", r.step_start_s[i]}, {"step_s", r.step_seconds[i]}, {"phases", phases}, {"comm_s", r.comm_seconds[i]},
                     {"comm_bytes", r.comm_bytes[i]}, {"offload_bytes", r.offload_bytes[i]}, {"peak_rss_bytes", r.rss_bytes[i]},
                     {"gemm_flops_per_s", i < r.gemm_rates.size() ? r.gemm_rates[i] : r.gemm_peak_flops},
                     {"block_forward_s", i < r.block_forward_s.size() ? r.block_forward_s[i] : std::vector<double>{}},
                     {"block_backward_s", i < r.block_backward_s.size() ? r.block_backward_s[i] : std::vector<double>{}}});
    json& step = steps.back();
    if (i < r.attention_forward_s.size()) {
      step["attention_forward_s"] = r.attention_forward_s[i];
      step["mlp_backward_s"] = r.mlp_backward_s[i];
    }
    step["block_spans"] = json::array();
    if (i < r.block_spans.size())
      for (const BlockSpan& b : r.block_spans[i])
        step["block_spans"].push_back({{"layer", b.layer}, {"backward", b.backward}, {"start_s", b.start_s}, {"seconds", b.seconds}});
    if (i < r.phase_rss_bytes.size()) step["phase_rss_bytes"] = r.phase_rss_bytes[i];
    if (i < r.phase_device_bytes.size()) step["phase_device_bytes"] = r.phase_device_bytes[i];
    if (i < r.model_flops.size()) step["model_flops"] = r.model_flops[i];
    step["collective_spans"] = json::array();
    if (i < r.collective_spans.size())
      for (const CollectiveSpan& c : r.collective_spans[i])
        step["collective_spans"].push_back({{"name", c.name}, {"start_s", c.start_s}, {"seconds", c.seconds}, {"bytes", c.bytes}});
    if (i < r.host_work_spans.size() && !r.host_work_spans[i].empty()) {
      step["host_work_spans"] = json::array();
      for (const HostWorkSpan& h : r.host_work_spans[i])
        step["host_work_spans"].push_back({{"what", h.what}, {"index", h.index}, {"hook", h.hook}, {"micro_step", h.micro_step},
                                           {"during", during_name(h.during)}, {"start_s", h.start_s}, {"seconds", h.seconds}});
    }
    if (i < r.stage_waits_s.size()) step["waited_s"] = r.stage_waits_s[i];  // a pipeline stage's time held up by the others
    if (i < r.kernel_times.size()) {
      step["kernels"] = json::array();
      for (const KernelTime& k : r.kernel_times[i])
        step["kernels"].push_back({{"name", k.name}, {"launches", k.launches}, {"seconds", k.seconds}});
    }
    if (i < r.copy_times.size()) {
      step["copies"] = json::array();
      for (const KernelTime& c : r.copy_times[i])
        step["copies"].push_back({{"name", c.name}, {"count", c.launches}, {"seconds", c.seconds}, {"bytes", c.bytes}});
    }
  }
  json collectives = json::array();
  for (const auto& c : r.collectives) collectives.push_back({{"name", c.name}, {"calls", c.calls}, {"bytes", c.bytes}, {"seconds", c.seconds}});
  // A pipeline stage's blocks are numbered from its first (the block times, the spans): "first_block" maps them back.
  const int stage = own_stage(plan);
  const int first_block = plan.mesh.stages.empty() ? 0 : plan.mesh.stages[static_cast<size_t>(stage)].first_block;
  return {{"rank", plan.topology.rank}, {"stage", stage}, {"first_block", first_block}, {"steps", steps}, {"collectives", collectives},
          {"gemm_peak_flops", r.gemm_peak_flops}, {"peak_rss_bytes", r.peak_rss_bytes}, {"baseline_rss_bytes", r.baseline_rss_bytes},
          {"paged_file_bytes", r.paged_file_bytes}, {"device_peak_bytes", r.device_peak_bytes},
          {"device_baseline_bytes", r.device_baseline_bytes}, {"kernels_not_listed", r.kernels_not_listed}};
}

namespace {

// Rank 0's measured steps (after the warm-up) and the FLOPs the plan counts for each. `lead`: the rank whose
// collectives and memory are set beside the plan's: rank 0, or with pipeline stages the first rank of the heaviest
// stage (the one the plan describes). `stages`: each pipeline stage's first rank (rank 0 alone without stages).
struct Measured {
  Measured(const Plan& p, const std::vector<json>& parts)
      : plan(p), stages(stage_leads(p, parts)), lead(*stages[static_cast<size_t>(std::max(p.mesh.heaviest_stage, 0))]),
        steps(parts.front()["steps"]) {}
  const Plan& plan;
  std::vector<const json*> stages;
  const json& lead;
  const json& steps;
  int warmup = 0, end = 0;
  double step_s = 0;
  std::vector<ModuleFlops> modules;
  double fwd = 0, bwd = 0, recompute = 0;  // per micro batch, the model's top-level modules
  double micro_batches = 1;               // per rank per step

  template <class F>
  double mean(F&& f) const {
    return mean_over(steps, warmup, end, f);
  }
  // The part of the stage that holds block `layer`, and the block's number there.
  std::pair<const json*, size_t> holding(int64_t layer) const {
    for (size_t s = stages.size(); s-- > 0;)
      if (layer >= (*stages[s])["first_block"].get<int64_t>()) return {stages[s], static_cast<size_t>(layer - (*stages[s])["first_block"].get<int64_t>())};
    return {stages.front(), static_cast<size_t>(layer)};
  }

 private:
  static std::vector<const json*> stage_leads(const Plan& p, const std::vector<json>& parts) {
    std::vector<const json*> out;
    for (int s = 0; s < std::max(p.mesh.shape.pipeline, 1); ++s) {
      const int rank = p.mesh.shape.pipeline > 1 ? mesh_rank(p.mesh.shape, MeshCoord{0, 0, s}) : parts.front()["rank"].get<int>();
      const auto it = std::find_if(parts.begin(), parts.end(), [&](const json& x) { return x["rank"].get<int>() == rank; });
      DS_CHECK(it != parts.end(), "no measurements from rank ", rank, ", the first of pipeline stage ", s);
      out.push_back(&*it);
    }
    return out;
  }
};

Measured measured_of(const Plan& plan, const std::vector<json>& parts, const ReportOptions& a) {
  Measured m(plan, parts);
  const int total = static_cast<int>(m.steps.size());
  m.warmup = std::clamp(a.warmup, 0, total - 1);
  m.end = a.end < 0 ? total : std::clamp(a.end, m.warmup + 1, total);
  m.step_s = m.mean([](const json& s) { return s["step_s"].get<double>(); });
  m.micro_batches = static_cast<double>(plan.batch.grad_accum);
  m.modules = module_flops(plan.model, plan.batch.micro_batch, plan.seq_len, plan.activation_checkpointing, plan.frozen, plan.lora);
  // Tensor parallel: a rank computes its share of every module's products (its heads, MLP channels and
  // vocabulary rows), 1/t of each (the norms' and embeddings' FLOPs are not counted).
  if (const int t = plan.mesh.shape.tensor; t > 1)
    for (auto& x : m.modules) {
      x.forward /= t;
      x.backward /= t;
      x.recompute /= t;
    }
  for (const auto& x : m.modules)
    if (x.depth == 1) {
      m.fwd += x.forward;
      m.bwd += x.backward;
      m.recompute += x.recompute;
    }
  return m;
}

// The summary, and MFU step by step, each against the matmul rate measured right after it (the median
// and its spread in the summary).
void add_summary(const Measured& ms, json& r) {
  const Plan& plan = ms.plan;
  const json& steps = ms.steps;
  const double W = plan.topology.world_size;
  // Per step and rank, every row's; a step whose masked rows skipped the head did less (its model_flops, over
  // all ranks, against the plan's full figure), and its own is what its MFU counts.
  // (pipeline stages: each rank computes its stage's modules, on average 1/p of the model's)
  const double full_per_rank = (ms.fwd + ms.bwd) * ms.micro_batches / std::max(plan.mesh.shape.pipeline, 1);
  const auto flops_of = [&](const json& s) {
    const bool own = s.contains("model_flops") && plan.train_flops_per_step > 0;
    return own ? full_per_rank * s["model_flops"].get<double>() / plan.train_flops_per_step : full_per_rank;
  };
  const double model_flops_per_rank = ms.mean(flops_of);
  const double executed_per_rank = model_flops_per_rank + ms.recompute * ms.micro_batches / std::max(plan.mesh.shape.pipeline, 1);
  std::vector<double> rates, mfus;
  json per_step = json::array();
  for (int i = ms.warmup; i < ms.end; ++i) {
    const double rate = steps[i]["gemm_flops_per_s"].get<double>(), s_i = steps[i]["step_s"].get<double>();
    const double mfu = rate > 0 ? flops_of(steps[i]) / s_i / rate : 0.0;
    rates.push_back(rate);
    mfus.push_back(mfu);
    per_step.push_back({{"step_s", s_i}, {"gemm_flops_per_s", rate}, {"mfu", mfu}, {"model_flops", flops_of(steps[i]) * W}});
    if (steps[i].contains("host_work_spans")) per_step.back()["host_work_spans"] = steps[i]["host_work_spans"];
  }
  const double step_s = ms.step_s, fwd = ms.fwd;
  r["summary"] = {
      {"world_size", plan.topology.world_size},
      {"micro_batch", plan.batch.micro_batch},
      {"grad_accum", plan.batch.grad_accum},
      {"seq_len", plan.seq_len},
      {"params", plan.model.num_params},
      // (ZeRO's shard of what the rank trains; unsharded, a tensor rank's share of the model, else the whole model;
      // with pipeline stages what rank 0's stage holds, as the plan's mesh table counts it)
      {"params_per_rank", plan.mesh.shape.pipeline > 1 ? plan.mesh.stages.front().params_per_rank
                          : plan.execution.sharded     ? plan.layout.shard_numel
                          : plan.mesh.shape.tensor > 1 ? plan.layout.numel
                                                       : plan.model.num_params},
      {"trainable_params", plan.trained().num_params},
      {"compute_dtype", dtype_name(plan.precision.compute_dtype)},
      {"fwd_flops_per_micro_batch", fwd},
      {"fwd_macs_per_micro_batch", fwd / 2},
      {"model_flops_per_step", model_flops_per_rank * W},
      {"plan_flops_per_step", plan.train_flops_per_step},
      {"executed_flops_per_step", executed_per_rank * W},
      {"fwd_latency_s", ms.mean([](const json& s) { return s["phases"]["forward"].get<double>(); })},
      {"bwd_latency_s", ms.mean([](const json& s) { return s["phases"]["backward"].get<double>(); })},
      {"step_latency_s", step_s},
      {"flops_per_s_per_rank", model_flops_per_rank / step_s},
      {"samples_per_s", static_cast<double>(plan.batch.train_batch_size) / step_s},
      {"tokens_per_s", static_cast<double>(plan.tokens_per_step) / step_s},
      {"gemm_peak_flops_per_s", median_of(rates)},
      {"gemm_peak_range", {*std::min_element(rates.begin(), rates.end()), *std::max_element(rates.begin(), rates.end())}},
      {"mfu", median_of(mfus)},
      {"mfu_range", {*std::min_element(mfus.begin(), mfus.end()), *std::max_element(mfus.begin(), mfus.end())}},
  };
  // The plan's prediction beside the measurement, where the hardware's rates are known (engine/plan/step_time.hpp).
  const StepTime& t = plan.step_time;
  if (t.step_known()) r["summary"]["predicted_step_latency_s"] = t.step_s();
  r["steps"] = per_step;  // rank 0's measured steps
}

void add_phases(const Measured& ms, json& r) {
  json phases = json::array();
  double accounted = 0;
  for (const char* name : kPhaseNames) {
    const double s = ms.mean([&](const json& x) { return x["phases"][name].get<double>(); });
    accounted += s;
    phases.push_back({{"phase", name}, {"seconds", s}, {"share", s / ms.step_s}});
  }
  r["phases"] = phases;
  r["unaccounted_s"] = ms.step_s - accounted;
}

// Latency per block (its forward; its backward with recomputation and, under ZeRO 2-3, its gather and
// reduction), and what is left of the forward and backward phases outside the blocks.
void add_modules(const Measured& ms, const ReportOptions& a, json& r) {
  const json& steps = ms.steps;
  const int warmup = ms.warmup;
  const double step_s = ms.step_s, fwd = ms.fwd, bwd = ms.bwd, recompute = ms.recompute, GAS = ms.micro_batches;
  auto block_mean = [&](const char* key, size_t layer) {  // from the rank of the stage that runs the block
    const auto [part, own] = ms.holding(static_cast<int64_t>(layer));
    return mean_over((*part)["steps"], warmup, ms.end, [&, own = own](const json& x) { return x[key][own].get<double>(); });
  };
  const bool timed_blocks = !steps[static_cast<size_t>(warmup)]["block_forward_s"].empty();
  double blocks_fwd = 0, blocks_bwd = 0, outside_flops = 0;
  json mods = json::array();
  for (const auto& m : ms.modules) {
    if (m.depth == 1 && m.layer < 0) outside_flops += m.total() * GAS;
    if (m.depth > a.depth) continue;
    json row = {{"name", m.name}, {"depth", m.depth}, {"params", m.params}, {"forward_flops", m.forward},
                {"backward_flops", m.backward}, {"recompute_flops", m.recompute},
                {"share_of_step_flops", m.total() / (fwd + bwd + recompute)}};
    if (m.depth == 1 && m.layer >= 0 && timed_blocks) {
      const double f = block_mean("block_forward_s", static_cast<size_t>(m.layer)), b = block_mean("block_backward_s", static_cast<size_t>(m.layer));
      blocks_fwd += f;
      blocks_bwd += b;
      row["forward_s"] = f;
      row["backward_s"] = b;
      row["share_of_step_time"] = (f + b) / step_s;
      row["flops_per_s"] = f + b > 0 ? m.total() * GAS / (f + b) : 0.0;
    }
    // A block's halves: the attention (with the norm before it) and the MLP (with its norm), split where the
    // attention's residual sum is formed in forward and where its gradient is complete in backward.
    const bool attention = ends_with(m.name, ".attn") || ends_with(m.name, ".self_attn"), mlp = ends_with(m.name, ".mlp");
    if (m.depth == 2 && timed_blocks && (attention || mlp) && steps[static_cast<size_t>(warmup)].contains("attention_forward_s")) {
      const auto layer = static_cast<size_t>(m.layer);
      const double block_f = block_mean("block_forward_s", layer), block_b = block_mean("block_backward_s", layer);
      const double attn_f = block_mean("attention_forward_s", layer), mlp_b = block_mean("mlp_backward_s", layer);
      const double f = attention ? attn_f : block_f - attn_f, b = attention ? block_b - mlp_b : mlp_b;
      row["forward_s"] = f;
      row["backward_s"] = b;
      row["share_of_step_time"] = (f + b) / step_s;
      row["flops_per_s"] = f + b > 0 ? m.total() * GAS / (f + b) : 0.0;
    }
    mods.push_back(row);
  }
  r["modules"] = mods;
  // A pipeline stage's phases hold its waits for the other stages, which its ledger cannot split from the work
  // around the blocks there: the time outside the blocks is left unmeasured (the stages' table has the waits).
  if (ms.plan.mesh.shape.pipeline > 1) {
    r["outside_blocks"] = {{"what", "embeddings, final norm, head and loss"}, {"flops", outside_flops}};
    return;
  }
  const double phases_f = r["summary"]["fwd_latency_s"].get<double>(), phases_b = r["summary"]["bwd_latency_s"].get<double>();
  const double out_f = std::max(0.0, phases_f - blocks_fwd), out_b = std::max(0.0, phases_b - blocks_bwd);
  r["outside_blocks"] = {{"what", "embeddings, final norm, head and loss"}, {"forward_s", out_f}, {"backward_s", out_b},
                         {"share_of_step_time", (out_f + out_b) / step_s}, {"flops", outside_flops},
                         {"flops_per_s", out_f + out_b > 0 ? outside_flops / (out_f + out_b) : 0.0}};
}

void add_top_modules(const Measured& ms, const ReportOptions& a, json& r) {
  std::vector<const ModuleFlops*> top;
  for (const auto& m : ms.modules)
    if (m.depth == 2 || (m.depth == 1 && m.layer < 0)) top.push_back(&m);  // leaves: no block counted with its children
  std::stable_sort(top.begin(), top.end(), [](const ModuleFlops* x, const ModuleFlops* y) { return x->total() > y->total(); });
  json tops = json::array();
  for (size_t i = 0; i < top.size() && static_cast<int>(i) < a.top && top[i]->total() > 0; ++i) tops.push_back(top[i]->name);
  r["top_modules"] = tops;
}

// Communication: the plan's table beside what rank 0 measured (bytes per step equal the plan's).
void add_communication(const Measured& ms, json& r) {
  const Plan& plan = ms.plan;
  const json& lead = ms.lead;
  const double n_steps = static_cast<double>(lead["steps"].size());
  json comm = json::array();
  const auto measured = [&](CollectiveKind kind, json& row) {
    for (const json& m : lead["collectives"])
      if (m["name"] == collective_name(kind)) {
        const double s = m["seconds"].get<double>() / n_steps;
        row["calls_per_step"] = m["calls"].get<double>() / n_steps;
        row["bytes_per_step"] = m["bytes"].get<double>() / n_steps;
        row["seconds_per_step"] = s;
        row["bus_gb_per_s"] = s > 0 ? m["bytes"].get<double>() / n_steps / s / 1e9 : 0.0;
      }
  };
  for (size_t i = 0; i < plan.execution.collectives.size(); ++i) {
    const Collective& c = plan.execution.collectives[i];
    json row = {{"collective", c.what()}, {"plan_calls_per_step", c.calls_per_step}, {"plan_bytes_per_step", c.wire_bytes_per_rank_per_step}};
    if (plan.step_time.comm_known && i < plan.step_time.collectives.size()) {  // a row per collective, in order
      row["predicted_seconds_per_step"] = plan.step_time.collectives[i].seconds;
      row["predicted_link"] = plan.step_time.collectives[i].link;
    }
    measured(c.kind, row);
    comm.push_back(row);
  }
  if (plan.mesh.heaviest_stage >= 0)  // the mesh's own (the tensor group's all-reduces), from its traffic
    for (const MeshCollective& c : mesh_collectives(plan.mesh.stages[static_cast<size_t>(plan.mesh.heaviest_stage)].traffic)) {
      json row = {{"collective", collective_name(c.kind)}, {"plan_calls_per_step", c.calls}, {"plan_bytes_per_step", c.bytes}};
      measured(c.kind, row);
      comm.push_back(row);
    }
  r["communication"] = comm;
}

// The host's offload work per measured step, by the plan's row it belongs to (HostWorkSpan::what) and where it ran
// (during the forward or the backward, beside compute; after them), beside the row's predicted time and hidden part
// where the plan predicts it. A copy's row holds the host's waits for it and the copies it makes itself.
void add_host_work(const Measured& ms, json& offload) {
  const json& steps = ms.steps;
  std::vector<std::string> order;  // (the rows in the order the step first runs them)
  std::map<std::string, std::array<double, 3>> seconds;  // per row, per During: summed over the measured steps
  for (int i = ms.warmup; i < ms.end; ++i) {
    const json& step = steps[static_cast<size_t>(i)];
    if (!step.contains("host_work_spans")) continue;
    for (const json& h : step["host_work_spans"]) {
      const std::string what = h["what"].get<std::string>(), during = h["during"].get<std::string>();
      if (!seconds.count(what)) order.push_back(what);
      seconds[what][during == "forward" ? 0 : during == "backward" ? 1 : 2] += h["seconds"].get<double>();
    }
  }
  if (order.empty()) return;
  const double n = ms.end - ms.warmup;
  json rows = json::array();
  for (const std::string& what : order) {
    const auto& s = seconds[what];
    json row{{"what", what}, {"seconds_per_step", (s[0] + s[1] + s[2]) / n}, {"during_forward_s", s[0] / n}, {"during_backward_s", s[1] / n},
             {"after_s", s[2] / n}};
    // (with pipeline stages the plan's rows are its slowest stage's, and the spans rank 0's: not set side by side)
    for (const OffloadTime& x : ms.plan.step_time.offload)
      if (x.what == what && x.known && ms.plan.mesh.shape.pipeline <= 1)
        row["predicted_seconds_per_step"] = x.seconds, row["predicted_hidden_s"] = x.hidden_s;
    rows.push_back(row);
  }
  offload["host_work"] = rows;
}

// Offload I/O: bytes moved between places per step beside the plan's transfers, the time, the rate.
void add_offload(const Measured& ms, json& r) {
  const Plan& plan = ms.plan;
  if (plan.execution.transfers.empty()) return;
  double planned = 0;
  json transfers = json::array();
  for (const auto& t : plan.execution.transfers) {
    planned += t.bytes_per_step;
    transfers.push_back({{"what", t.what}, {"bytes_per_step", t.bytes_per_step}});
  }
  const double bytes = ms.mean([](const json& x) { return x["offload_bytes"].get<double>(); });
  const double secs = ms.mean([](const json& x) { return x["phases"]["offload"].get<double>(); });
  r["offload"] = {{"bytes_per_step", bytes}, {"plan_bytes_per_step", planned}, {"seconds_per_step", secs},
                  {"gb_per_s", secs > 0 ? bytes / secs / 1e9 : 0.0}, {"plan_transfers", transfers}};
  add_host_work(ms, r["offload"]);
}

// The most, over the measured steps, of a per-phase array each step holds under `key`; empty where none was sampled.
json most_by_phase(const json& steps, int warmup, int end, const char* key, const char* as) {
  const json& first_measured = steps[static_cast<size_t>(warmup)];
  if (!first_measured.contains(key) || first_measured[key][1].get<double>() <= 0) return json();
  json by_phase = json::array();
  for (size_t k = 0; k < std::size(kPhaseNames); ++k) {
    double most = 0;
    for (int i = warmup; i < end; ++i) most = std::max(most, steps[static_cast<size_t>(i)][key][k].get<double>());
    by_phase.push_back({{"phase", kPhaseNames[k]}, {as, most}});
  }
  return by_phase;
}

void add_memory(const Measured& ms, json& r) {
  const Plan& plan = ms.plan;
  const json& lead = ms.lead;
  const json& steps = lead["steps"];
  const int warmup = ms.warmup, end = ms.end;
  // On a GPU the process's resident memory is the host's part of the plan; the device's is measured apart.
  const bool gpu = !plan.topology.device_traits().memory_is_host;
  const MemoryCategories planned = gpu ? plan.memory.host : plan.memory.held();
  // Training's part of the peak: neither the code and libraries there before it began nor the file-backed
  // pages (code first run, mapped data) that came in since.
  const double outside = lead["baseline_rss_bytes"].get<double>() + lead["paged_file_bytes"].get<double>();
  r["memory"] = {{"peak_rss_bytes", lead["peak_rss_bytes"]}, {"baseline_rss_bytes", lead["baseline_rss_bytes"]},
                 {"paged_file_bytes", lead["paged_file_bytes"]}, {"training_bytes", lead["peak_rss_bytes"].get<double>() - outside},
                 {"plan", {{"params", planned.params}, {"grads", planned.grads}, {"optimizer_states", planned.optimizer_states},
                           {"activations", planned.activations}, {"buffers", planned.buffers}, {"total", planned.total()}}}};
  // The peak resident memory within each phase, the most over the measured steps.
  const json by_phase = most_by_phase(steps, warmup, end, "phase_rss_bytes", "resident_bytes");
  if (!by_phase.is_null()) {
    r["memory"]["by_phase"] = by_phase;
    // getrusage's high-water mark is updated lazily; a phase's reading may be above it.
    double peak = r["memory"]["peak_rss_bytes"].get<double>();
    for (const json& p : by_phase) peak = std::max(peak, p["resident_bytes"].get<double>());
    r["memory"]["peak_rss_bytes"] = peak;
    r["memory"]["training_bytes"] = peak - outside;
  }
  if (gpu && lead.contains("device_peak_bytes")) {
    // cudaMemGetInfo: what anything holds on the GPU (LibTorch's cache included, which keeps a step's peak).
    const double peak = lead["device_peak_bytes"].get<double>(), before = lead["device_baseline_bytes"].get<double>();
    r["memory"]["device"] = {{"peak_bytes", peak}, {"baseline_bytes", before}, {"training_bytes", peak - before},
                             {"plan_bytes", plan.memory.device.total()}};
    const json in_use = most_by_phase(steps, warmup, end, "phase_device_bytes", "in_use_bytes");
    if (!in_use.is_null()) r["memory"]["device"]["by_phase"] = in_use;
  }
}

// A GPU's kernels (rank 0's), a measured step's mean, the longest first: the first kKernelRows named, the rest
// summed; or why none are listed. Nothing on the CPU (its work is not kernels launched on a device).
void add_kernels(const Measured& ms, json& r) {
  constexpr size_t kKernelRows = 20;
  const json& first = ms.steps[static_cast<size_t>(ms.warmup)];
  const std::string why = ms.lead.value("kernels_not_listed", std::string());
  if (!first.contains("kernels")) {
    if (!why.empty()) r["kernels"] = {{"not_listed", why}};
    return;
  }
  std::vector<std::vector<KernelTime>> per_step;
  for (int i = ms.warmup; i < ms.end; ++i) {
    std::vector<KernelTime>& step = per_step.emplace_back();
    for (const json& k : ms.steps[static_cast<size_t>(i)].value("kernels", json::array()))
      step.push_back({k["name"].get<std::string>(), k["launches"].get<double>(), k["seconds"].get<double>()});
  }
  const std::vector<KernelTime> mean = mean_kernel_times(per_step, ms.end - ms.warmup);
  const auto share = [&](double s) { return ms.step_s > 0 ? s / ms.step_s : 0.0; };
  double busy = 0, launches = 0;
  for (const KernelTime& k : mean) {
    busy += k.seconds;
    launches += k.launches;
  }
  json top = json::array();
  double rest_s = 0, rest_launches = 0;
  for (size_t i = 0; i < mean.size(); ++i) {
    if (i < kKernelRows)
      top.push_back({{"name", mean[i].name}, {"launches_per_step", mean[i].launches}, {"seconds_per_step", mean[i].seconds},
                     {"share_of_step_time", share(mean[i].seconds)}});
    else
      rest_s += mean[i].seconds, rest_launches += mean[i].launches;
  }
  // The copies between memories, a measured step's mean by way (a copy to pageable host memory: the host waited).
  std::vector<std::vector<KernelTime>> copies_per_step;
  for (int i = ms.warmup; i < ms.end; ++i) {
    std::vector<KernelTime>& step = copies_per_step.emplace_back();
    for (const json& c : ms.steps[static_cast<size_t>(i)].value("copies", json::array()))
      step.push_back({c["name"].get<std::string>(), c["count"].get<double>(), c["seconds"].get<double>(), c["bytes"].get<double>()});
  }
  json copies = json::array();
  for (const KernelTime& c : mean_kernel_times(copies_per_step, ms.end - ms.warmup))
    copies.push_back({{"name", c.name}, {"count_per_step", c.launches}, {"bytes_per_step", c.bytes}, {"seconds_per_step", c.seconds}});
  r["copies"] = copies;
  r["kernels"] = {{"source", "CUPTI (each kernel's start and end on the GPU's clock)"},
                  {"distinct", mean.size()},
                  {"launches_per_step", launches},
                  {"busy_seconds_per_step", busy},
                  {"busy_share_of_step_time", share(busy)},
                  {"top", top},
                  {"others", {{"kernels", mean.size() - std::min(mean.size(), kKernelRows)}, {"launches_per_step", rest_launches},
                              {"seconds_per_step", rest_s}}}};
}

// Pipeline stages: each stage's first rank's phases, the time it waited for the other stages beside the plan's
// bubble, and its training memory beside the stage's plan.
void add_pipeline(const Measured& ms, json& r) {
  const Plan& plan = ms.plan;
  if (plan.mesh.shape.pipeline <= 1) return;
  json stages = json::array();
  for (size_t s = 0; s < ms.stages.size(); ++s) {
    const json& part = *ms.stages[s];
    const PipelineStage& st = plan.mesh.stages[s];
    const auto mean = [&](const std::function<double(const json&)>& f) { return mean_over(part["steps"], ms.warmup, ms.end, f); };
    const double step_s = mean([](const json& x) { return x["step_s"].get<double>(); });
    const double waited = mean([](const json& x) { return x["waited_s"].get<double>(); });
    std::vector<double> shares;  // each step's, whose median ds train's "waited" line gives too
    for (int i = ms.warmup; i < ms.end; ++i) {
      const json& x = part["steps"][static_cast<size_t>(i)];
      shares.push_back(x["step_s"].get<double>() > 0 ? x["waited_s"].get<double>() / x["step_s"].get<double>() : 0.0);
    }
    const double outside = part["baseline_rss_bytes"].get<double>() + part["paged_file_bytes"].get<double>();
    stages.push_back({{"stage", s}, {"rank", part["rank"]}, {"first_block", st.first_block}, {"blocks", st.blocks},
                      {"forward_s", mean([](const json& x) { return x["phases"]["forward"].get<double>(); })},
                      {"backward_s", mean([](const json& x) { return x["phases"]["backward"].get<double>(); })},
                      {"step_s", step_s}, {"waited_s", waited}, {"waited_share", median_of(shares)},
                      {"runs_backward", stage_runs_backward(st, plan.backward_from)},
                      {"training_bytes", part["peak_rss_bytes"].get<double>() - outside},
                      {"plan_bytes", st.memory_planned ? st.memory.device.total() + st.memory.host.total() : 0.0}});
  }
  r["pipeline"] = {{"stages", stages}, {"bubble", plan.mesh.bubble}, {"micro_batches", plan.mesh.micro_batches}};
}

void add_ranks(const Measured& ms, const std::vector<json>& parts, json& r) {
  const int warmup = ms.warmup, end = ms.end;
  json ranks = json::array();
  for (const json& p : parts)
    ranks.push_back({{"rank", p["rank"]},
                     {"step_latency_s", mean_over(p["steps"], warmup, end, [](const json& s) { return s["step_s"].get<double>(); })},
                     {"comm_s", mean_over(p["steps"], warmup, end, [](const json& s) { return s["comm_s"].get<double>(); })},
                     {"peak_rss_bytes", p["peak_rss_bytes"]}});
  r["ranks"] = ranks;
}

}  // namespace

json build_profile_report(const Plan& plan, const std::vector<json>& parts, const ReportOptions& a) {
  const Measured ms = measured_of(plan, parts, a);
  json r;
  r["schema_version"] = 1;
  r["measured_steps"] = ms.end - ms.warmup;
  r["warmup_steps"] = ms.warmup;
  add_summary(ms, r);
  add_phases(ms, r);
  add_modules(ms, a, r);
  add_top_modules(ms, a, r);
  add_communication(ms, r);
  add_offload(ms, r);
  add_memory(ms, r);
  add_kernels(ms, r);
  add_pipeline(ms, r);
  add_ranks(ms, parts, r);
  r["lead_rank"] = ms.lead["rank"];  // the rank whose collectives and memory are set beside the plan's
  return r;
}

namespace {

void add_line(std::ostringstream& o, const std::string& key, const std::string& value) { o << "  " << pad(key, 30) << value << "\n"; }

void render_summary(const json& r, std::ostringstream& o) {
  const json& s = r["summary"];
  auto line = [&](const std::string& k, const std::string& v) { add_line(o, k, v); };
  line("world size", std::to_string(s["world_size"].get<int>()));
  line("batch per rank", std::to_string(s["micro_batch"].get<int64_t>()) + " x " + std::to_string(s["seq_len"].get<int64_t>()) +
                             " tokens, " + std::to_string(s["grad_accum"].get<int64_t>()) + " micro batches per step");
  line("params per rank", format_count(s["params_per_rank"].get<int64_t>()) + " of " + format_count(s["params"].get<int64_t>()));
  line("fwd MACs per micro batch", format_si(s["fwd_macs_per_micro_batch"].get<double>()));
  line("fwd FLOPs per micro batch", format_si(s["fwd_flops_per_micro_batch"].get<double>()));
  line("FLOPs per step (model)", format_si(s["model_flops_per_step"].get<double>()) + " (plan: " +
                                     format_si(s["plan_flops_per_step"].get<double>()) + ")");
  if (s["executed_flops_per_step"].get<double>() != s["model_flops_per_step"].get<double>())
    line("FLOPs per step (executed)", format_si(s["executed_flops_per_step"].get<double>()) + " with recomputation");
  line("fwd latency", ms(s["fwd_latency_s"].get<double>()));
  line("bwd latency", ms(s["bwd_latency_s"].get<double>()));
  line("step latency", ms(s["step_latency_s"].get<double>()) +
                          (s.contains("predicted_step_latency_s") ? " (predicted " + ms(s["predicted_step_latency_s"].get<double>()) + ": ds plan)" : ""));
  line("FLOPS per rank", format_fixed(s["flops_per_s_per_rank"].get<double>() / 1e12, 3) + " TFLOP/s");
  line("samples/s", format_fixed(s["samples_per_s"].get<double>(), 1));
  line("tokens/s", format_count(static_cast<int64_t>(s["tokens_per_s"].get<double>())));
  if (s["gemm_peak_flops_per_s"].get<double>() > 0) {
    const auto tf = [](const json& v) { return format_fixed(v.get<double>() / 1e12, 3); };
    line("matmul peak (measured)", tf(s["gemm_peak_flops_per_s"]) + " TFLOP/s " + s["compute_dtype"].get<std::string>() +
                                        " at the model's GEMM shapes (median; " + tf(s["gemm_peak_range"][0]) + "-" +
                                        tf(s["gemm_peak_range"][1]) + " right after each measured step)");
    line("MFU", pct(s["mfu"].get<double>()) + " (median of each step against the rate after it; " + pct(s["mfu_range"][0].get<double>()) +
                    "-" + pct(s["mfu_range"][1].get<double>()) + ")");
  } else {
    line("MFU", "not measured here (ds profile measures the matmul peak first)");
  }
}

void render_phases(const json& r, std::ostringstream& o) {
  const json& s = r["summary"];
  o << "\nPhases of one optimizer step\n";
  for (const json& p : r["phases"])
    o << "  " << pad(p["phase"].get<std::string>(), 12) << lpad(ms(p["seconds"].get<double>()), 12) << lpad(pct(p["share"].get<double>()), 8)
      << "\n";
  const double step_s = s["step_latency_s"].get<double>();
  o << "  " << pad("unaccounted", 12) << lpad(ms(r["unaccounted_s"].get<double>()), 12)
    << lpad(pct(r["unaccounted_s"].get<double>() / step_s), 8) << "\n";
  o << "  " << pad("step", 12) << lpad(ms(step_s), 12) << "\n";
}

// Each module's FLOPs per micro batch and, for the blocks and their halves, time per step.
void render_modules(const Plan& plan, const json& r, std::ostringstream& o) {
  o << "\nModules (FLOPs per micro batch, backward = "
    << (!plan.frozen.empty() ? "the input's gradient of a frozen matmul, both of a trained one's" : "both gradients of every matmul")
    << "; time per step, a block's backward with\n"
       "its recomputation and ZeRO's exchange; a block's attention timed with the norm before it, its MLP likewise"
    << (plan.mesh.shape.tensor > 1 ? ";\n  tensor parallel: the FLOPs a rank computes, 1/" + std::to_string(plan.mesh.shape.tensor) +
                                         " of each module's; params are the whole module's"
                                   : std::string())
    << ")\n";
  o << "  " << pad("module", 32) << lpad("params", 12) << lpad("forward", 9) << lpad("backward", 9) << lpad("recomp", 8)
    << lpad("FLOPs", 7) << lpad("fwd ms", 9) << lpad("bwd ms", 9) << lpad("time", 7) << lpad("TFLOP/s", 9) << "\n";
  for (const json& m : r["modules"]) {
    o << "  " << pad(std::string(m["depth"].get<int>() == 2 ? "  " : "") + m["name"].get<std::string>(), 32)
      << lpad(format_count(m["params"].get<int64_t>()), 12) << lpad(format_si(m["forward_flops"].get<double>()), 9)
      << lpad(format_si(m["backward_flops"].get<double>()), 9) << lpad(format_si(m["recompute_flops"].get<double>()), 8)
      << lpad(pct(m["share_of_step_flops"].get<double>()), 7);
    if (m.contains("forward_s"))
      o << lpad(format_fixed(m["forward_s"].get<double>() * 1e3, 2), 9) << lpad(format_fixed(m["backward_s"].get<double>() * 1e3, 2), 9)
        << lpad(pct(m["share_of_step_time"].get<double>()), 7) << lpad(format_fixed(m["flops_per_s"].get<double>() / 1e12, 3), 9);
    o << "\n";
  }
  const json& ob = r["outside_blocks"];
  if (!ob.contains("forward_s")) {
    o << "  " << pad("outside the blocks", 32) << "  not timed on a pipeline (a stage's phases hold its waits for the others)\n";
    return;
  }
  o << "  " << pad("outside the blocks", 32) << lpad("", 12 + 9 + 9 + 8 + 7) << lpad(format_fixed(ob["forward_s"].get<double>() * 1e3, 2), 9)
    << lpad(format_fixed(ob["backward_s"].get<double>() * 1e3, 2), 9) << lpad(pct(ob["share_of_step_time"].get<double>()), 7)
    << lpad(format_fixed(ob["flops_per_s"].get<double>() / 1e12, 3), 9) << "  (" << ob["what"].get<std::string>() << ")\n";

}

void render_communication(const json& r, std::ostringstream& o) {
  if (!r["communication"].empty()) {
    o << "\nCommunication per step (rank " << r["lead_rank"].get<int>()
      << (r.contains("pipeline") ? ", the first of the stage the plan describes" : "")
      << "; plan in parentheses; waited: the time the rank was held up, so an overlapped collective waits less than it takes)\n";
    for (const json& c : r["communication"]) {
      o << "  " << pad(c["collective"].get<std::string>(), 34);
      if (c.contains("bytes_per_step")) {
        o << lpad(format_fixed(c["calls_per_step"].get<double>(), 1), 6) << " calls " << lpad(format_bytes(c["bytes_per_step"].get<double>()), 11)
          << " (" << format_bytes(c["plan_bytes_per_step"].get<double>()) << ")  waited " << ms(c["seconds_per_step"].get<double>())
          << ", " << format_fixed(c["bus_gb_per_s"].get<double>(), 2) << " GB/s";
        if (c.contains("predicted_seconds_per_step"))
          o << " (predicted " << ms(c["predicted_seconds_per_step"].get<double>()) << " on " << c["predicted_link"].get<std::string>() << ")";
      } else {
        o << " not measured (" << format_bytes(c["plan_bytes_per_step"].get<double>()) << " planned)";
      }
      o << "\n";
    }
  }
}

// Offload I/O, memory beside the plan's, and each rank's step (with several).
void render_io_memory_ranks(const json& r, std::ostringstream& o) {
  auto line = [&](const std::string& k, const std::string& v) { add_line(o, k, v); };
  if (r.contains("offload")) {
    const json& f = r["offload"];
    o << "\nOffload I/O per step (rank 0)\n";
    line("bytes moved", format_bytes(f["bytes_per_step"].get<double>()) + " (plan: " + format_bytes(f["plan_bytes_per_step"].get<double>()) + ")");
    line("time", ms(f["seconds_per_step"].get<double>()) + ", " + format_fixed(f["gb_per_s"].get<double>(), 2) + " GB/s");
    if (f.contains("host_work")) {
      o << "  the host's work (under a copy's row, the host's waits for it and the copies it makes itself; during the forward "
           "or the backward a GPU may hide it, after them not; plan in parentheses, where it predicts the row)\n";
      for (const json& h : f["host_work"]) {
        o << "    " << pad(h["what"].get<std::string>(), 32) << lpad(ms(h["seconds_per_step"].get<double>()), 11);
        if (h.contains("predicted_seconds_per_step"))
          o << " (" << ms(h["predicted_seconds_per_step"].get<double>()) << ", " << ms(h["predicted_hidden_s"].get<double>()) << " hidden)";
        o << ": " << ms(h["during_forward_s"].get<double>()) << " during the forward, " << ms(h["during_backward_s"].get<double>())
          << " during the backward, " << ms(h["after_s"].get<double>()) << " after\n";
      }
    }
  }
  const json& m = r["memory"];
  o << "\nMemory (rank " << r["lead_rank"].get<int>() << ")\n";
  line("peak resident", format_bytes(m["peak_rss_bytes"].get<double>()));
  line("code and libraries", format_bytes(m["baseline_rss_bytes"].get<double>()) + " before training, " +
                                 format_bytes(m["paged_file_bytes"].get<double>()) + " of code and files paged in since");
  const bool gpu = m.contains("device");  // then the resident memory is the plan's host part
  line(gpu ? "training (host)" : "training", format_bytes(m["training_bytes"].get<double>()) + " against the plan's " + (gpu ? "host " : "") +
                       format_bytes(m["plan"]["total"].get<double>()) + " (params " + format_bytes(m["plan"]["params"].get<double>()) +
                       ", gradients " + format_bytes(m["plan"]["grads"].get<double>()) + ", optimizer states " +
                       format_bytes(m["plan"]["optimizer_states"].get<double>()) + ", activations " +
                       format_bytes(m["plan"]["activations"].get<double>()) + ", buffers " +
                       format_bytes(m["plan"]["buffers"].get<double>()) + ")");
  // "phase bytes, ..." for the phases that have a figure under `key`.
  const auto phase_row = [](const json& by_phase, const char* key) {
    std::string row;
    for (const json& p : by_phase)
      if (p[key].get<double>() > 0) row += (row.empty() ? "" : ", ") + p["phase"].get<std::string>() + " " + format_bytes(p[key].get<double>());
    return row;
  };
  if (m.contains("by_phase")) line("peak within each phase", phase_row(m["by_phase"], "resident_bytes"));
  if (m.contains("device")) {
    const json& d = m["device"];
    const double trained = d["training_bytes"].get<double>(), planned = d["plan_bytes"].get<double>();
    line("GPU in use", format_bytes(d["peak_bytes"].get<double>()) + " at most after a step: " + format_bytes(d["baseline_bytes"].get<double>()) +
                           " before training (CUDA context, other processes) + " + format_bytes(trained) + " for training, against the plan's " +
                           format_bytes(planned) + " on the device" + (planned > 0 ? " (" + format_fixed(trained / planned, 2) + "x)" : std::string()));
    if (d.contains("by_phase")) line("GPU at each phase's end", phase_row(d["by_phase"], "in_use_bytes"));
  }
  if (r.contains("kernels")) {
    const json& k = r["kernels"];
    if (k.contains("not_listed")) {
      o << "\nGPU kernels: not listed (" << k["not_listed"].get<std::string>() << ")\n";
    } else {
      o << "\nGPU kernels per step (rank 0; CUPTI: each kernel's time on the GPU, the longest first)\n";
      line("kernels", format_fixed(k["launches_per_step"].get<double>(), 0) + " launches of " + std::to_string(k["distinct"].get<size_t>()) +
                          " kernels, busy " + ms(k["busy_seconds_per_step"].get<double>()) + " (" +
                          pct(k["busy_share_of_step_time"].get<double>()) + " of the step; the rest: the GPU idle, or copies)");
      for (const json& t : k["top"])
        o << "  " << lpad(ms(t["seconds_per_step"].get<double>()), 11) << lpad(pct(t["share_of_step_time"].get<double>()), 8)
          << lpad(format_fixed(t["launches_per_step"].get<double>(), 0) + "x", 8) << "  " << t["name"].get<std::string>() << "\n";
      const json& rest = k["others"];
      if (rest["kernels"].get<size_t>() > 0)
        o << "  " << lpad(ms(rest["seconds_per_step"].get<double>()), 11) << lpad("", 8)
          << lpad(format_fixed(rest["launches_per_step"].get<double>(), 0) + "x", 8) << "  " << rest["kernels"].get<size_t>()
          << " other kernels\n";
    }
  }
  if (r.contains("copies") && !r["copies"].empty()) {
    o << "\nCopies between host and GPU per step (rank 0; CUPTI; to pageable host memory: the host waited for the GPU)\n";
    for (const json& c : r["copies"])
      o << "  " << lpad(ms(c["seconds_per_step"].get<double>()), 11) << lpad(format_fixed(c["count_per_step"].get<double>(), 1) + "x", 8)
        << lpad(format_bytes(c["bytes_per_step"].get<double>()), 12) << "  " << c["name"].get<std::string>() << "\n";
  }
  if (r.contains("pipeline")) {
    const json& pl = r["pipeline"];
    o << "\nPipeline stages (each stage's first rank; waited: held up by the other stages, the median share of a step, beside the "
         "plan's bubble "
      << pct(pl["bubble"].get<double>()) << ", (p - 1) / (m + p - 1) with m " << pl["micro_batches"].get<int>() << ")\n";
    o << "  " << pad("stage", 7) << pad("rank", 6) << pad("blocks", 12) << lpad("forward", 11) << lpad("backward", 11)
      << lpad("waited", 18) << lpad("training memory (plan)", 26) << "\n";
    for (const json& s : pl["stages"]) {
      const int first = s["first_block"].get<int>(), n = s["blocks"].get<int>();
      o << "  " << pad(std::to_string(s["stage"].get<int>()), 7) << pad(std::to_string(s["rank"].get<int>()), 6)
        << pad(std::to_string(first) + "-" + std::to_string(first + n - 1) + " (" + std::to_string(n) + ")", 12)
        << lpad(ms(s["forward_s"].get<double>()), 11) << lpad(ms(s["backward_s"].get<double>()), 11)
        << lpad(ms(s["waited_s"].get<double>()) + " " + pct(s["waited_share"].get<double>()), 18)
        << lpad(format_bytes(s["training_bytes"].get<double>()) + " (" + format_bytes(s["plan_bytes"].get<double>()) + ")", 26)
        << (s["runs_backward"].get<bool>() ? "" : "  forward only") << "\n";
    }
    o << "  forward and backward include the waits for the neighbouring stages; the blocks' times above are each stage's own\n";
  }
  if (r["ranks"].size() > 1) {
    o << "\nRanks\n";
    for (const json& k : r["ranks"])
      o << "  rank " << pad(std::to_string(k["rank"].get<int>()), 4) << " step " << ms(k["step_latency_s"].get<double>()) << ", in collectives "
        << ms(k["comm_s"].get<double>()) << ", peak resident " << format_bytes(k["peak_rss_bytes"].get<double>()) << "\n";
  }
}

}  // namespace

std::string render_profile_text(const Plan& plan, const json& r, bool detailed) {
  std::ostringstream o;
  o << "ds profile: " << plan.model.hp.name << ", " << plan.precision.mode << ", ZeRO stage " << plan.zero_stage() << " on "
    << plan.topology.world_size << (plan.topology.world_size == 1 ? " rank" : " ranks") << "; " << r["measured_steps"].get<int>()
    << (r["measured_steps"].get<int>() == 1 ? " step" : " steps") << " measured after " << r["warmup_steps"].get<int>()
    << " earlier (means; rank 0" << (plan.mesh.shape.pipeline > 1 ? "'s step, each block from the stage that runs it" : "") << ")\n\n";
  o << "Summary\n";
  render_summary(r, o);
  render_phases(r, o);
  if (detailed) render_modules(plan, r, o);
  o << "  top modules by FLOPs: " << join(r["top_modules"].get<std::vector<std::string>>(), ", ") << "\n";
  render_communication(r, o);
  render_io_memory_ranks(r, o);
  return o.str();
}

// Chrome trace-event JSON: one process per rank; a track for compute, one for communication, one for
// offload I/O phases, blocks and collectives; a span per step and per phase (micro batches' phases summed into one
// span each), per block run and per collective at the times they ran.
json profile_chrome_trace(const Plan& plan, const std::vector<json>& parts) {
  json events = json::array();
  auto track = [](const char* phase) {
    const std::string p = phase;
    return p == "reduce" || p == "norm" || p == "gather" ? 2 : p == "offload" ? 3 : 1;
  };
  for (const json& part : parts) {
    const int pid = part["rank"].get<int>();
    events.push_back({{"ph", "M"}, {"pid", pid}, {"name", "process_name"}, {"args", {{"name", "rank " + std::to_string(pid)}}}});
    for (const auto& [tid, name] :
         {std::pair{1, "compute"}, {2, "communication"}, {3, "offload I/O"}, {4, "blocks"}, {5, "collectives"}, {6, "host's offload work"}})
      events.push_back({{"ph", "M"}, {"pid", pid}, {"tid", tid}, {"name", "thread_name"}, {"args", {{"name", name}}}});
    const int first_block = part.value("first_block", 0);  // a pipeline stage numbers its blocks from its first
    int step = 0;
    for (const json& s : part["steps"]) {
      ++step;
      double at = s["start_s"].get<double>() * 1e6;
      events.push_back({{"ph", "X"}, {"pid", pid}, {"tid", 1}, {"name", "step " + std::to_string(step)}, {"ts", at},
                        {"dur", s["step_s"].get<double>() * 1e6},
                        {"args", {{"model_flops", s.value("model_flops", plan.train_flops_per_step) / plan.topology.world_size},
                                  {"comm_bytes", s["comm_bytes"]}}}});
      const double step_at = at;
      if (s.contains("block_spans"))
        for (const json& b : s["block_spans"])
          events.push_back({{"ph", "X"}, {"pid", pid}, {"tid", 4},
                            {"name", "block " + std::to_string(first_block + b["layer"].get<int>()) +
                                         (b["backward"].get<bool>() ? " backward" : " forward")},
                            {"ts", step_at + b["start_s"].get<double>() * 1e6}, {"dur", b["seconds"].get<double>() * 1e6},
                            {"args", {{"step", step}}}});
      if (s.contains("collective_spans"))
        for (const json& c : s["collective_spans"])
          events.push_back({{"ph", "X"}, {"pid", pid}, {"tid", 5}, {"name", c["name"]}, {"ts", step_at + c["start_s"].get<double>() * 1e6},
                            {"dur", c["seconds"].get<double>() * 1e6}, {"args", {{"step", step}, {"bytes", c["bytes"]}}}});
      if (s.contains("host_work_spans"))
        for (const json& h : s["host_work_spans"])
          events.push_back({{"ph", "X"}, {"pid", pid}, {"tid", 6},
                            {"name", h["what"].get<std::string>() + (h["index"].get<int64_t>() >= 0 ? " " + std::to_string(h["index"].get<int64_t>()) : "")},
                            {"ts", step_at + h["start_s"].get<double>() * 1e6}, {"dur", h["seconds"].get<double>() * 1e6},
                            {"args", {{"step", step}, {"hook", h["hook"]}, {"during", h["during"]}}}});
      for (const char* phase : kPhaseNames) {
        const double dur = s["phases"][phase].get<double>() * 1e6;
        if (dur <= 0) continue;
        events.push_back({{"ph", "X"}, {"pid", pid}, {"tid", track(phase)}, {"name", phase}, {"ts", at}, {"dur", dur},
                          {"args", {{"step", step}}}});
        at += dur;
      }
    }
  }
  return {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
}


}  // namespace ds::cli
