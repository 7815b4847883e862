#include "engine/plan/step_time.hpp"

#include <algorithm>

#include "common/format.hpp"
#include "engine/plan/flops.hpp"
#include "engine/plan/plan.hpp"

namespace ds {
namespace {

// Whether any group of this kind has ranks on more than one node.
bool spans_nodes(const std::vector<std::vector<int>>& groups, int ranks_per_node) {
  const int per_node = std::max(1, ranks_per_node);
  for (const auto& g : groups)
    for (int r : g)
      if (r / per_node != g.front() / per_node) return true;
  return false;
}

// The link a group of this kind crosses; an unknown one is added to `missing` once, naming the flag.
const Link* link_of(const Plan& p, MeshAxis axis, std::vector<std::string>& missing) {
  const HardwareRates& hw = p.topology.rates;
  const bool across = spans_nodes(mesh_groups(p.mesh.shape, axis), p.topology.ranks_per_node);
  const Link& link = across ? hw.inter_node : hw.intra_node;
  if (link.known()) return &link;
  const std::string need = across ? "the network between nodes (--inter-node-link, e.g. ib-ndr or 400Gb/s)"
                                  : "the link between the ranks of a node (--intra-node-link, or --gpu)";
  if (std::find(missing.begin(), missing.end(), need) == missing.end()) missing.push_back(need);
  return nullptr;
}

std::string link_text(const Plan& p, const Link& link) {
  return link.name + (&link == &p.topology.rates.inter_node ? " (across nodes)" : " (within a node)");
}

// What a collective of the data group can hide behind, as the runtime issues it.
StepPhase phase_of(const Collective& c, const ZeroExecution& z) {
  switch (c.kind) {
    case CollectiveKind::gradients: return z.overlap ? StepPhase::backward : StepPhase::between;
    case CollectiveKind::parameters_forward:
    case CollectiveKind::frozen_parameters: return StepPhase::forward;
    case CollectiveKind::parameters_backward: return StepPhase::backward;
    default: return StepPhase::between;
  }
}

// Per rank and step: the forward's and the backward's (recomputation included) FLOPs of its micro-batches and share.
std::pair<double, double> rank_flops(const Plan& p) {
  double forward = 0, backward = 0;
  for (const ModuleFlops& m : module_flops(p.model, p.batch.micro_batch, p.seq_len, p.activation_checkpointing, p.frozen, p.lora))
    if (m.depth == 1) forward += m.forward, backward += m.backward + m.recompute;
  const double share = static_cast<double>(p.batch.grad_accum) / (p.mesh.shape.tensor * p.mesh.shape.pipeline);
  return {forward * share, backward * share};
}

void predict_compute(const Plan& p, StepTime& t) {
  const HardwareRates& hw = p.topology.rates;
  const bool fp32 = p.precision.compute_dtype == Dtype::fp32;
  const double peak = fp32 ? hw.peak_flops_fp32 : hw.peak_flops_16bit;
  if (!(peak > 0)) {
    t.missing.push_back(p.topology.device_traits().memory_is_host ? std::string("the CPU's matmul rate (ds profile measures it)")
                                                                  : "the GPU's peak rate (--gpu " + known_gpu_names() + ")");
    return;
  }
  t.compute_known = true;
  t.peak_flops = peak;
  const double rate = peak * hw.mfu;
  t.rate_source = format_fixed(hw.mfu, 2) + " x " + hw.gpu + "'s " + format_fixed(peak / 1e12, 1) + " TFLOP/s " +
                  (fp32 ? "fp32" : "bf16/fp16") + (hw.mfu_given ? " (--mfu)" : " (an assumed share: --mfu to change)");
  const auto [forward, backward] = rank_flops(p);
  t.forward_s = forward / rate;
  t.backward_s = backward / rate;
  const double busy = t.forward_s + t.backward_s;
  const double bubble = p.mesh.shape.pipeline > 1 ? p.mesh.bubble : 0;
  t.compute_s = busy / (1 - bubble);
  t.bubble_s = t.compute_s - busy;
}

void add_row(StepTime& t, std::string what, const Plan& p, const Link& link, StepPhase phase, double bytes, double calls) {
  t.collectives.push_back({std::move(what), link_text(p, link), phase, bytes / link.busbw + calls * link.latency_s, 0});
}

// The mesh's own traffic, of the stage that sends the most (stages run side by side: the slowest sets the pace).
void mesh_rows(const Plan& p, StepTime& t) {
  if (!p.mesh.shape.splits_the_model() || p.mesh.stages.empty()) return;
  const PipelineStage* busiest = &p.mesh.stages.front();
  for (const PipelineStage& s : p.mesh.stages)
    if (s.traffic.tensor_wire_bytes + s.traffic.pipeline_bytes + s.traffic.tied_bytes >
        busiest->traffic.tensor_wire_bytes + busiest->traffic.pipeline_bytes + busiest->traffic.tied_bytes)
      busiest = &s;
  const MeshTraffic& x = busiest->traffic;
  if (x.tensor_all_reduces > 0)
    if (const Link* l = link_of(p, MeshAxis::tensor, t.missing))
      add_row(t, "tensor all-reduces", p, *l, StepPhase::between, x.tensor_wire_bytes, static_cast<double>(x.tensor_all_reduces));
  if (x.pipeline_sends > 0)
    if (const Link* l = link_of(p, MeshAxis::pipeline, t.missing))
      add_row(t, "pipeline sends", p, *l, StepPhase::between, x.pipeline_bytes, static_cast<double>(x.pipeline_sends));
  if (x.tied_all_reduces > 0)
    if (const Link* l = link_of(p, MeshAxis::pipeline, t.missing))
      add_row(t, "tied embeddings", p, *l, StepPhase::between, x.tied_bytes, static_cast<double>(x.tied_all_reduces));
}

// Within each phase, what can hide (all but each collective's first call) hides up to the phase's compute.
void overlap(const Plan& p, StepTime& t) {
  const double windows[] = {t.forward_s, t.backward_s};
  for (StepPhase phase : {StepPhase::forward, StepPhase::backward}) {
    double window = windows[phase == StepPhase::forward ? 0 : 1];
    // Stages 0-1 reduce once per step, during the last micro step's backward only.
    const bool once_per_step = phase == StepPhase::backward && !p.execution.collectives.empty() && p.zero_stage() <= 1;
    if (once_per_step) window /= std::max<int64_t>(1, p.batch.grad_accum);
    double hideable = 0;
    std::vector<std::pair<CollectiveTime*, double>> rows;
    size_t i = 0;
    for (const Collective& c : p.execution.collectives) {
      if (i >= t.collectives.size()) break;
      CollectiveTime& row = t.collectives[i++];
      if (row.phase != phase) continue;
      const double first_call = row.seconds / std::max<double>(1, static_cast<double>(c.calls_per_step));
      rows.push_back({&row, row.seconds - first_call});
      hideable += row.seconds - first_call;
    }
    if (!(hideable > 0)) continue;
    const double hidden = std::min(hideable, window);
    for (auto& [row, share] : rows) row->hidden_s = hidden * share / hideable;
  }
}

}  // namespace

const char* step_phase_name(StepPhase p) {
  switch (p) {
    case StepPhase::forward: return "forward";
    case StepPhase::backward: return "backward";
    case StepPhase::between: return "between";
  }
  return "?";
}

StepTime predict_step_time(const Plan& p) {
  StepTime t;
  if (!p.has_model || p.batch.micro_batch <= 0) return t;
  predict_compute(p, t);
  // ZeRO's collectives run over the data group; one row each, in the plan's order (overlap() relies on it).
  bool comm_known = true;
  for (const Collective& c : p.execution.collectives) {
    const Link* l = link_of(p, MeshAxis::data, t.missing);
    if (!l) {
      comm_known = false;
      break;
    }
    add_row(t, c.what(), p, *l, phase_of(c, p.execution), c.wire_bytes_per_rank_per_step, static_cast<double>(c.calls_per_step));
  }
  if (!comm_known) t.collectives.clear();
  const size_t before = t.missing.size();
  if (comm_known) mesh_rows(p, t);
  t.comm_known = comm_known && t.missing.size() == before;
  if (!t.comm_known) {
    t.collectives.clear();
    return t;
  }
  if (!p.execution.transfers.empty())
    t.missing.push_back("a model of offload: its device-host transfers and the CPU's optimizer step are not predicted yet");
  if (t.compute_known) overlap(p, t);
  for (const CollectiveTime& c : t.collectives) t.comm_s += c.seconds, t.hidden_s += c.hidden_s;
  return t;
}

}  // namespace ds
