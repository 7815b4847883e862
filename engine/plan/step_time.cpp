#include "engine/plan/step_time.hpp"

#include <algorithm>
#include <deque>
#include <map>
#include <optional>
#include <set>

#include "common/format.hpp"
#include "engine/plan/flops.hpp"
#include "engine/plan/plan.hpp"
#include "engine/plan/plan_steps.hpp"

namespace ds {
namespace {

// How a group of this kind sits on the nodes: 0 when every group is inside one node, else the fewest of a
// group's ranks on one of its nodes (the NICs that carry its rings there).
int ranks_per_node_across(const std::vector<std::vector<int>>& groups, int ranks_per_node) {
  const int per_node = std::max(1, ranks_per_node);
  int fewest = 0;
  for (const auto& g : groups) {
    std::map<int, int> on_node;
    for (int r : g) ++on_node[r / per_node];
    if (on_node.size() < 2) continue;
    for (const auto& [node, n] : on_node) fewest = fewest == 0 ? n : std::min(fewest, n);
  }
  return fewest;
}

// The link a group of this kind crosses, as a rate: within a node the node's link; across nodes one ring per NIC
// (one NIC per GPU), so k ranks of the group on each node give k times the network's rate, at most the node's link.
// Unknown: added to `missing` once, naming the flag, and nullopt.
std::optional<Link> link_of(const Plan& p, const std::vector<std::vector<int>>& groups, std::vector<std::string>& missing) {
  const HardwareRates& hw = p.topology.rates;
  const int k = ranks_per_node_across(groups, p.topology.ranks_per_node);
  const bool gpu = !p.topology.device_traits().memory_is_host;
  const auto need = [&](const std::string& what) {
    if (std::find(missing.begin(), missing.end(), what) == missing.end()) missing.push_back(what);
    return std::nullopt;
  };
  if (k == 0) {
    if (hw.intra_node.known()) return Link{hw.intra_node.name + " (within a node)", hw.intra_node.busbw, hw.intra_node.latency_s};
    return need(gpu ? "the link between the ranks of a node (--intra-node-link, or --gpu)" : "the link between the ranks of a node (--intra-node-link)");
  }
  if (!hw.inter_node.known()) return need("the network between nodes (--inter-node-link, e.g. ib-ndr or 400Gb/s)");
  Link across{hw.inter_node.name + " (across nodes", k * hw.inter_node.busbw, hw.inter_node.latency_s};
  if (k > 1) across.name += ", " + std::to_string(k) + " NICs a node";
  if (hw.intra_node.known() && hw.intra_node.busbw < across.busbw) across.busbw = hw.intra_node.busbw;
  across.name += ")";
  return across;
}
std::optional<Link> link_of(const Plan& p, MeshAxis axis, std::vector<std::string>& missing) {
  return link_of(p, mesh_groups(p.mesh.shape, axis), missing);
}

// What a collective of the data group can hide behind, as the runtime issues it.
StepPhase phase_of(const Collective& c, const ZeroExecution& z) {
  switch (c.kind) {
    case CollectiveKind::gradients: return z.overlap ? StepPhase::backward : StepPhase::between;
    case CollectiveKind::parameters_forward:
    case CollectiveKind::frozen_parameters: return StepPhase::forward;
    case CollectiveKind::parameters_backward: return StepPhase::backward;
    case CollectiveKind::updated_parameters: return z.gather_ahead ? StepPhase::forward : StepPhase::between;
    default: return StepPhase::between;
  }
}

// Per rank and step: the forward's and the backward's (recomputation included) FLOPs of its micro-batches and share.
// Pipeline stages run side by side: the one with the most work sets the pace (a stage below every trained tensor
// runs forward only), its blocks' FLOPs and, on the last, the head's.
std::pair<double, double> rank_flops(const Plan& p) {
  const std::vector<PipelineStage>& stages = p.mesh.stages;
  const size_t count = std::max<size_t>(stages.size(), 1);
  std::vector<double> forward(count, 0.0), backward(count, 0.0);
  for (const ModuleFlops& m : module_flops(p.model, p.batch.micro_batch, p.seq_len, p.activation_checkpointing, p.frozen, p.lora)) {
    if (m.depth != 1) continue;
    size_t s = count - 1;  // outside the blocks: the head's matmul (the embeddings' lookups count none)
    if (m.layer >= 0)
      for (size_t k = 0; k < stages.size(); ++k)
        if (m.layer >= stages[k].first_block && m.layer < stages[k].first_block + stages[k].blocks) s = k;
    forward[s] += m.forward;
    backward[s] += m.backward + m.recompute;
  }
  size_t slowest = 0;
  for (size_t s = 1; s < count; ++s)
    if (forward[s] + backward[s] > forward[slowest] + backward[slowest]) slowest = s;
  const double share = static_cast<double>(p.batch.grad_accum) / p.mesh.shape.tensor;
  return {forward[slowest] * share, backward[slowest] * share};
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

void add_row(StepTime& t, std::string what, const Link& link, StepPhase phase, double bytes, double calls) {
  t.collectives.push_back({std::move(what), link.name, phase, bytes / link.busbw + calls * link.latency_s, 0, link.latency_s});
}

// The mesh's own traffic, of the stage that sends the most (stages run side by side: the slowest sets the pace).
void mesh_rows(const Plan& p, StepTime& t) {
  if (!p.mesh.shape.splits_the_model() || p.mesh.stages.empty()) return;
  const PipelineStage* busiest = &p.mesh.stages.front();
  for (const PipelineStage& s : p.mesh.stages)
    if (s.traffic.sent_bytes() > busiest->traffic.sent_bytes()) busiest = &s;
  const MeshTraffic& x = busiest->traffic;
  if (x.tensor_all_reduces > 0)
    if (const auto l = link_of(p, MeshAxis::tensor, t.missing))
      add_row(t, "tensor all-reduces", *l, StepPhase::between, x.tensor_wire_bytes, static_cast<double>(x.tensor_all_reduces));
  if (x.pipeline_sends > 0)
    if (const auto l = link_of(p, MeshAxis::pipeline, t.missing))
      add_row(t, "pipeline sends", *l, StepPhase::between, x.pipeline_bytes, static_cast<double>(x.pipeline_sends));
  if (x.tied_sends > 0)
    if (const auto l = link_of(p, MeshAxis::pipeline, t.missing))
      add_row(t, "tied embeddings", *l, StepPhase::between, x.tied_bytes, static_cast<double>(x.tied_sends));
  if (x.lamb_all_reduces > 0)
    if (const auto l = link_of(p, MeshAxis::tensor, t.missing))
      add_row(t, "Lamb norms (tensor group)", *l, StepPhase::between, x.lamb_bytes, static_cast<double>(x.lamb_all_reduces));
}

// What of a collective's time nothing in its phase runs beside. Stages 1-2 gathering the updated parameters ahead: the
// pieces through the first block's parameters (the embeddings', then block 0's), which the forward waits for before
// any block computes (ZeroExchange::before_forward); each of their calls and their share of the bytes. Else each
// micro step's first call (the first block's gather, the last bucket's reduce), as if the calls were of one size.
double unhidden_seconds(const Plan& p, const Collective& c, const CollectiveTime& row) {
  const double calls = static_cast<double>(std::max<int64_t>(1, c.calls_per_step));
  if (c.kind != CollectiveKind::updated_parameters) {
    const double micro_steps = c.when == Cadence::per_micro_step ? static_cast<double>(std::max<int64_t>(1, p.batch.grad_accum)) : 1.0;
    return row.seconds / calls * std::min(micro_steps, calls);
  }
  const Pieces blocks = block_ranges(p.layout);
  const int64_t waited_before = blocks.empty() ? p.execution.full_numel : blocks.front().second;
  int64_t elements = 0, pieces = 0;
  for (const auto& [begin, end] : updated_parameter_pieces(p.layout, p.execution, p.zero.allgather_bucket_size))
    if (begin < waited_before) elements += end - begin, ++pieces;
  const double bytes_s = row.seconds - calls * row.call_s;
  return bytes_s * static_cast<double>(elements) / static_cast<double>(std::max<int64_t>(1, p.execution.full_numel)) +
         static_cast<double>(pieces) * row.call_s;
}

// Within each phase, what can hide hides up to the phase's compute: all but each collective's unhidden_seconds.
void overlap(const Plan& p, StepTime& t) {
  const double windows[] = {t.forward_s, t.backward_s};
  for (StepPhase phase : {StepPhase::forward, StepPhase::backward}) {
    double window = windows[phase == StepPhase::forward ? 0 : 1];
    // Stages 0-1 reduce once per step, during the last micro step's backward only; stages 1-2's updated parameters
    // arrive during the next step's first forward.
    const bool once_per_step =
        !p.execution.collectives.empty() && (phase == StepPhase::backward ? p.zero_stage() <= 1 : p.execution.gather_ahead);
    if (once_per_step) window /= std::max<int64_t>(1, p.batch.grad_accum);
    double hideable = 0;
    std::vector<std::pair<CollectiveTime*, double>> rows;
    size_t i = 0;
    for (const Collective& c : p.execution.collectives) {
      if (i >= t.collectives.size()) break;
      CollectiveTime& row = t.collectives[i++];
      if (row.phase != phase) continue;
      const double share = std::max(0.0, row.seconds - unhidden_seconds(p, c, row));
      rows.push_back({&row, share});
      hideable += share;
    }
    if (!(hideable > 0)) continue;
    const double hidden = std::min(hideable, window);
    for (auto& [row, share] : rows) row->hidden_s = hidden * share / hideable;
  }
}

// Offload's resources and their rates (bytes a second, for one rank): 0 where not known, with what would give it
// added to `missing` once.
struct OffloadRates {
  double link = 0, memory = 0, nvme = 0;
  std::string link_name, memory_name, nvme_name;
};

OffloadRates offload_rates(const Plan& p) {
  const HardwareRates& hw = p.topology.rates;
  const double sharing = std::max(1, p.topology.ranks_per_node);  // a node's memory and drives serve all its ranks
  const auto per_rank = [&](double rate, const std::string& what) {
    return what + " (" + format_fixed(rate / 1e9, 1) + " GB/s" + (sharing > 1 ? " a node over " + format_count(static_cast<int64_t>(sharing)) + " ranks" : "") + ")";
  };
  OffloadRates r;
  if (hw.host_memory_bw > 0) {
    r.memory = hw.host_memory_bw / sharing;
    r.memory_name = per_rank(hw.host_memory_bw, "host memory");
  }
  if (hw.nvme_bw > 0) {
    r.nvme = hw.nvme_bw / sharing;
    r.nvme_name = per_rank(hw.nvme_bw, "nvme");
  }
  if (!p.topology.device_traits().memory_is_host && hw.host_link.known()) {  // (a CPU device's copies are its memory's)
    r.link = hw.host_link.busbw;
    r.link_name = hw.host_link.name + " (" + format_fixed(r.link / 1e9, 1) + " GB/s a direction)";
  }
  return r;
}

// One rank's offload (`z`, its execution, laid out by `p`): each transfer at its resource's rate, then what the host's
// memory streams for the optimizer's step, run after the backward one after another (ds's offload today); NVMe
// swaps of a pipelined optimizer overlap the host's step. An unknown rate leaves the row's time unknown and names the
// flag in `missing`.
std::vector<OffloadTime> offload_rows(const Plan& p, const ZeroExecution& z, const OffloadRates& r, std::vector<std::string>& missing) {
  std::vector<OffloadTime> rows;
  const bool cpu = p.topology.device_traits().memory_is_host;
  const auto need = [&](const std::string& what) {
    if (std::find(missing.begin(), missing.end(), what) == missing.end()) missing.push_back(what);
  };
  const auto add = [&](const std::string& what, OffloadResource resource, double bytes, double rate, const std::string& at) {
    if (rate > 0) {
      rows.push_back({what, resource, at, bytes, bytes / rate, 0, true});
      return;
    }
    need(resource == OffloadResource::nvme          ? "the NVMe drives' rate under nvme_path (--nvme-bw, e.g. 6GB/s)"
         : resource == OffloadResource::host_memory ? "the host's memory bandwidth (--host-memory-bw, e.g. 200GB/s)"
                                                    : "the link between a GPU and its host (--host-link " + known_host_link_names() +
                                                          " or a rate, e.g. 50GB/s; or --gpu)");
    rows.push_back({what, resource, std::string(offload_resource_name(resource)) + " (rate unknown)", bytes, 0, 0, false});
  };
  for (const Transfer& x : z.transfers) {
    if (x.written_in_step)  // the optimizer's kernel writes them as it steps: the host's step counts their bytes
      rows.push_back({x.what, OffloadResource::host_memory, "written by the optimizer's step", x.bytes_per_step, 0, 0, true});
    else if (x.from == Place::nvme || x.to == Place::nvme)
      add(x.what, OffloadResource::nvme, x.bytes_per_step, r.nvme, r.nvme_name);
    else if (cpu)  // the device is the host: a copy reads and writes its memory
      add(x.what, OffloadResource::host_memory, x.bytes_per_step, r.memory / 2, "memory copy, " + r.memory_name);
    else
      add(x.what, OffloadResource::host_link, x.bytes_per_step, r.link, r.link_name);
  }
  if (z.state_spans.empty() || z.state_spans.front().place == Place::device) return rows;
  const double n = static_cast<double>(z.state_spans.front().numel());
  const Dtype param = p.precision.param_dtype;
  // The step: per element its gradient read (fp32 beside the states, or in its own dtype where it left the device
  // block by block into host memory), the master and each moment read and written, then the weight: bf16
  // written by the kernel where it reaches the weights (one memory, or the parameters on the host) or into the host's
  // staging buffer for a GPU, else the master read again by the weights' copy (and the weight written where it lands
  // in host memory: the parameters' file buffers).
  const OffloadDevice params_at = p.zero.offload_param.device;
  const double weight = z.state_spans.front().weights != WeightsBack::copied ? dtype_bytes(param) : 4.0 + (params_at != OffloadDevice::none ? dtype_bytes(param) : 0.0);
  const ZeroBuffer* g = z.find_anywhere(BufferRole::grads);
  const double grad = g && g->place == Place::host ? dtype_bytes(p.precision.grad_dtype) : 4.0;
  // Where the gradients leave the GPU block by block into host memory (ZeRO-Offload), the host adds each micro step's
  // as they arrive into the step's sum (the arrival read, the sum read and written), the first copied in instead (read
  // and written: the sum is never zeroed whole, ZeroExchange::begin_gradient_sums).
  if (g && g->place == Place::host && z.find(BufferRole::grads_arrival, Place::host)) {
    const double micro_steps = static_cast<double>(std::max<int64_t>(1, p.batch.grad_accum));
    add("gradients summed on the host", OffloadResource::host_memory, g->bytes() * (2 + 3 * (micro_steps - 1)), r.memory, r.memory_name);
  }
  // The speculative step (step_in_backward): each step copies the speculated tiles' master and moments to their backup
  // first (read, then written).
  if (const ZeroBuffer* backup = z.step_in_backward ? z.find(BufferRole::step_backup, Place::host) : nullptr)
    add("speculated states backed up", OffloadResource::host_memory, 2 * backup->bytes(), r.memory, r.memory_name);
  add("optimizer step on the host", OffloadResource::host_memory, n * (grad + 8.0 * (1 + p.optimizer.moments) + weight), r.memory, r.memory_name);
  // Work that runs while the host steps: a pipelined optimizer reads the next sub-groups and writes the last ones
  // (all but one sub-group's read, the first, and write, the last, in the directions pipelined), and staged weights
  // cross tile by tile while the next tile is stepped (all but the last tile's), together up to the step's time.
  const OffloadConfig& o = p.zero.offload_optimizer;
  const int64_t groups = static_cast<int64_t>(z.sub_groups.size());
  const bool pipelined = z.swap_sets > 1 && groups > 1;
  // (only from page-locked buffers, which the host need not wait on; and not where each NVMe sub-group's gradients
  // come from the GPU first, a copy that waits for the weights' copies queued before it)
  const ZeroBuffer* staging = z.find(BufferRole::weights_staging, Place::host);
  const bool overlaps = staging && staging->pinned && (z.state_spans.front().place == Place::host || (g && g->place == Place::host));
  const int64_t tiles = overlaps ? static_cast<int64_t>(z.staged_tiles().size()) : 0;
  const auto hiding = [&](const OffloadTime& x) -> double {  // the share of a row that may hide
    if (!x.known) return 0;
    if (pipelined && ((o.pipeline_read && x.what == "optimizer states read") || (o.pipeline_write && x.what == "optimizer states written")))
      return static_cast<double>(groups - 1) / static_cast<double>(groups);
    if (tiles > 1 && x.what == "updated weights to the device") return static_cast<double>(tiles - 1) / static_cast<double>(tiles);
    return 0;
  };
  double hideable = 0, step = 0;
  for (const OffloadTime& x : rows) {
    hideable += x.seconds * hiding(x);
    if (x.what == "optimizer step on the host") step = x.seconds;
  }
  if (!(hideable > 0)) return rows;
  const double hidden = std::min(hideable, step);
  for (OffloadTime& x : rows) x.hidden_s = hidden * x.seconds * hiding(x) / hideable;
  return rows;
}

double exposed(const std::vector<OffloadTime>& rows) {
  double s = 0;
  for (const OffloadTime& x : rows) s += x.seconds - x.hidden_s + 1e-18 * x.bytes;  // (bytes: the tie-break where rates are unknown)
  return s;
}

// The blocks' compute in a step (every micro step's), each pass: their share of the pass's FLOPs (the backward's with
// the recomputed forward) of its predicted time. What a block-by-block copy beside them can hide behind.
struct BlocksCompute {
  double forward_s = 0, backward_s = 0;
};
BlocksCompute blocks_compute(const Plan& p, const StepTime& t) {
  double forward = 0, backward = 0, blocks_forward = 0, blocks_backward = 0;
  for (const ModuleFlops& m : module_flops(p.model, p.batch.micro_batch, p.seq_len, p.activation_checkpointing, p.frozen, p.lora)) {
    if (m.depth != 1) continue;
    forward += m.forward, backward += m.backward + m.recompute;
    if (m.layer >= 0) blocks_forward += m.forward, blocks_backward += m.backward + m.recompute;
  }
  return {forward > 0 ? t.forward_s * blocks_forward / forward : 0.0, backward > 0 ? t.backward_s * blocks_backward / backward : 0.0};
}

// The speculative step (step_in_backward) on the step's last micro step, as the runtime runs it: the GPU is given the
// blocks' backward a unit at a time from the top (a block, or with activation checkpointing in groups of more than one
// a recompute group: its forward run again and its blocks' backward in one call); once a unit is given, the host runs
// its blocks' hooks, top down. Each hook sums the gradients of the block `lag` + 1 above it (waiting for their copy to
// land), queues its own block's copy to the host (on the copy stream to the host: it begins once the unit holding the
// block has run and the copies to the host before it have ended), then steps the tiles final after the block just
// summed one after the other, each tile's weights leaving on the copy stream to the device once stepped (from
// page-locked staging; from pageable staging the host passes them through the driver itself), a tile waiting for the
// copy of the tile that last used its staging buffer. The two copy streams are the link's two directions, each at its
// rate. Meanwhile the GPU runs what it was given, and is given nothing more: the next unit is given once the hooks
// return (so in a group of g blocks only the first hook's work runs beside the GPU), and runs once the copies of the
// blocks two above its own have left the gradient buffers it writes. The last `lag` + 1 blocks' gradients and tiles
// come after the whole backward. Timed in seconds from the first unit's backward.
struct LastBackward {
  struct Tile {
    double step_s = 0, copy_s = 0;  // the host's step (and backup) of it; its weights' copy
    int64_t index = -1;             // (ZeroExecution::weight_tiles')
  };
  std::vector<double> block_s;                  // per block, the GPU's backward (with its forward run again)
  std::vector<double> copy_s, sum_s;            // per block, its gradients' copy to the host and the host's sum
  std::vector<char> trains;                     // per block, whether any of its parameters trains
  std::vector<std::vector<Tile>> final_after;   // per block, the tiles speculated once its gradients have landed
  int64_t from = 0;                             // the lowest block whose backward runs
  int64_t unit = 1;                             // blocks given to the GPU at once, counted from `from`
  bool pinned = true;
  size_t staging = 1;                           // the staging buffers the tiles' copies take turns in
  size_t lag = 0;                               // ZeroExecution::gradient_lag
};
struct LastBackwardEnd {
  double end = 0;     // when the GPU's backward and the host's work in it have both ended
  double copies = 0;  // when the last of the tiles' weights' copies to the device ends
};
// `order`, where given, gets the host's work in the order the walk runs it.
LastBackwardEnd run_last_backward(const LastBackward& b, bool speculating, std::vector<BackwardHostWork>* order = nullptr) {
  double gpu = 0, host = 0, to_host = 0, to_device = 0;
  std::vector<double> staged(b.staging, 0.0);  // when each staging buffer's last copy ends
  size_t turn = 0;
  std::vector<double> landed(b.block_s.size(), 0.0);  // per block, when its gradients' copy ends (0: not queued yet)
  int64_t hook = -1;                                  // (the block whose hook the host is in)
  const auto sum = [&](size_t l) {
    host = std::max(host, landed[l]) + b.sum_s[l];
    if (order) order->push_back({false, static_cast<int64_t>(l), hook});
  };
  const auto step_tiles = [&](size_t l) {
    if (!speculating) return;
    for (const LastBackward::Tile& t : b.final_after[l]) {
      if (order) order->push_back({true, t.index, hook});
      host = std::max(host, staged[turn]) + t.step_s;
      if (b.pinned) to_device = std::max(to_device, host) + t.copy_s;
      else host += t.copy_s, to_device = std::max(to_device, host);
      staged[turn] = to_device;
      turn = (turn + 1) % b.staging;
    }
  };
  std::deque<size_t> pending;  // blocks whose copy is queued and whose gradients are not summed yet, top down
  std::vector<size_t> summed;  // (in this hook, their tiles still to step)
  const int64_t n = static_cast<int64_t>(b.block_s.size());
  for (int64_t l = n - 1; l >= b.from; --l) {
    const int64_t first = b.from + (l - b.from) / b.unit * b.unit;  // the unit holding l, [first, l] when l is its top
    if (l == std::min(first + b.unit, n) - 1) {
      double unit_s = 0, copied_out = 0;  // (its blocks write the gradient buffers the blocks two above each used: copied out first)
      for (int64_t k = first; k <= l; ++k)
        unit_s += b.block_s[static_cast<size_t>(k)], copied_out = std::max(copied_out, k + 2 < n ? landed[static_cast<size_t>(k + 2)] : 0.0);
      gpu = std::max({gpu, host, copied_out}) + unit_s;
    }
    // A block that trains nothing has nothing to copy or sum; where its gradients land late, its hook sums nothing
    // either, but without a lag it finishes the block above's (ZeroExchange::after_backward).
    const bool trains = b.trains[static_cast<size_t>(l)] || !b.final_after[static_cast<size_t>(l)].empty();
    if (!trains && b.lag > 0) continue;
    hook = l;
    for (summed.clear(); pending.size() > b.lag; pending.pop_front()) sum(pending.front()), summed.push_back(pending.front());
    if (trains) {
      to_host = std::max({to_host, gpu, host}) + b.copy_s[static_cast<size_t>(l)];  // (queued once the hook's sums are done)
      landed[static_cast<size_t>(l)] = to_host;
      pending.push_back(static_cast<size_t>(l));
    }
    for (size_t k : summed) step_tiles(k);
  }
  hook = -1;
  for (size_t l : pending) sum(l), step_tiles(l);
  return {std::max(gpu, host), to_device};
}

// The last backward's inputs from the plan: each block's share of the backward's FLOPs (its forward run again
// included) of one micro step's predicted backward; each block's share of the gradients' rows by its elements (of the
// host's sums the last micro step's: an add, where earlier micro steps' arrivals were summed, 3 of the row's 2 + 3(m - 1)
// accesses an element; the first copied in, 2 of 2, where m is 1); each speculated tile's share of the host's step, of
// the backup and of the weights' copies by its elements. Nothing hides behind the backward of what lies outside the
// blocks: not counted.
LastBackward last_backward_of(const Plan& p, const StepTime& t, const std::vector<OffloadTime>& rows) {
  const ZeroExecution& z = p.execution;
  const auto seconds = [&](const char* what) {
    double s = 0;
    for (const OffloadTime& x : rows) s += x.known && x.what == what ? x.seconds : 0.0;
    return s;
  };
  const size_t n = static_cast<size_t>(p.model.hp.num_layers);
  const double micro_steps = static_cast<double>(std::max<int64_t>(1, p.batch.grad_accum));
  LastBackward b;
  b.block_s.assign(n, 0), b.copy_s.assign(n, 0), b.sum_s.assign(n, 0), b.final_after.assign(n, {}), b.trains.assign(n, 0);
  b.from = p.backward_from;
  b.unit = p.activation_checkpointing ? std::max<int64_t>(1, p.recompute_group) : 1;
  double backward = 0;
  for (const ModuleFlops& m : module_flops(p.model, p.batch.micro_batch, p.seq_len, p.activation_checkpointing, p.frozen, p.lora)) {
    if (m.depth != 1) continue;
    backward += m.backward + m.recompute;
    if (m.layer >= 0 && static_cast<size_t>(m.layer) < n) b.block_s[static_cast<size_t>(m.layer)] += m.backward + m.recompute;
  }
  for (double& s : b.block_s) s = backward > 0 ? t.backward_s / micro_steps * s / backward : 0.0;
  int64_t all = 0;
  for (const ParamSlot& s : p.layout.params) all += s.numel;
  const double copy = seconds("gradients to the host") / micro_steps;
  const double sum = seconds("gradients summed on the host") * (micro_steps > 1 ? 3 / (2 + 3 * (micro_steps - 1)) : 1.0);
  for (const ParamSlot& s : p.layout.params) {
    if (s.layer < 0 || all == 0) continue;
    b.trains[static_cast<size_t>(s.layer)] = 1;
    b.copy_s[static_cast<size_t>(s.layer)] += copy * static_cast<double>(s.numel) / static_cast<double>(all);
    b.sum_s[static_cast<size_t>(s.layer)] += sum * static_cast<double>(s.numel) / static_cast<double>(all);
  }
  const double host = static_cast<double>(z.state_spans.front().numel()), speculated = static_cast<double>(z.speculated_numel);
  const double step = seconds("optimizer step on the host"), backup = seconds("speculated states backed up");
  const double weights = seconds("updated weights to the device");
  for (size_t i = 0; i < z.weight_tile_final_after.size(); ++i) {
    const int64_t after = z.weight_tile_final_after[i];
    if (after < 0) continue;
    const double numel = static_cast<double>(z.weight_tiles[i].numel());
    b.final_after[static_cast<size_t>(after)].push_back(
        {step * numel / host + backup * numel / speculated, weights * numel / host, static_cast<int64_t>(i)});
  }
  const ZeroBuffer* staging = z.find(BufferRole::weights_staging, Place::host);
  b.pinned = staging && staging->pinned;
  b.staging = staging ? static_cast<size_t>(std::max(1, staging->copies)) : 1;
  b.lag = static_cast<size_t>(std::max<int64_t>(0, z.gradient_lag));
  return b;
}

// One rank whose gradients leave a GPU group by group for the host (ZeRO-Offload from stage 2) with overlap_comm: each
// micro step's backward as the runtime runs it (run_last_backward, no tiles): each block's copy out waits only for its
// own backward and the copies before it, the host sums it a block or more late (gradient_lag) while the GPU runs the
// blocks below, and the GPU is given the next block once the hook has returned. What of the blocks' copies and sums
// does not lengthen that backward hides; the lowest blocks' (summed after the backward) and the parameters outside the
// blocks (they leave once the backward has ended) show. The first micro step's sums copy the arrivals in (2 of the
// row's 2 + 3(m - 1) accesses an element), the later ones add them (3). (Several ranks copy a group once its
// collective has ended: not modelled. Nor a copy that widens as it lands, fp32 accumulation of 16-bit gradients: a GPU
// runs that one on its compute stream.)
void hide_gradients_behind_backward(const Plan& p, const StepTime& t, std::vector<OffloadTime>& rows) {
  if (!p.execution.overlap || !gradients_can_leave_during_backward(p) || !(t.backward_s > 0)) return;
  const auto trip = [](const OffloadTime& x) { return x.known && (x.what == "gradients to the host" || x.what == "gradients summed on the host"); };
  double seconds = 0;
  for (const OffloadTime& x : rows) seconds += trip(x) ? x.seconds : 0.0;
  if (!(seconds > 0)) return;
  LastBackward b = last_backward_of(p, t, rows);
  const double m = static_cast<double>(std::max<int64_t>(1, p.batch.grad_accum));
  const auto hidden_in = [&](double sum_share) {  // one micro step's, its sums `sum_share` of the last one's
    LastBackward micro = b;
    double blocks = 0, carried = 0;
    for (size_t l = 0; l < micro.block_s.size(); ++l) {
      micro.sum_s[l] *= sum_share;
      blocks += static_cast<int64_t>(l) >= micro.from ? micro.block_s[l] : 0.0;
      carried += micro.copy_s[l] + micro.sum_s[l];
    }
    return carried - std::clamp(run_last_backward(micro, false).end - blocks, 0.0, carried);
  };
  const double hidden = m > 1 ? hidden_in(2.0 / 3.0) + (m - 1) * hidden_in(1.0) : hidden_in(1.0);
  for (OffloadTime& x : rows)
    if (trip(x)) x.hidden_s = hidden * x.seconds / seconds;
}

// What of the speculated tiles' work hides behind the last micro step's backward: all of it, less what it lengthens
// that backward by (run_last_backward with and without it), split between the host's step and the backup by their
// seconds (with pageable staging the weights' copies are the host's work too). The weights' copies from page-locked
// staging hide but for what is still crossing once the backward ends; counted where the next forward's copies' rule
// (`forward_rule`, which leaves these out) set the row, since elsewhere every tile's copy hides behind the host's step
// of the next tile anyway. A clipped or skipped step restores and steps them again: not predicted
// (it depends on the norm).
void hide_step_behind_backward(const Plan& p, const StepTime& t, std::vector<OffloadTime>& rows, bool forward_rule) {
  const ZeroExecution& z = p.execution;
  if (!z.step_in_backward || !(t.backward_s > 0)) return;
  const auto row = [&](const char* what) {
    const auto x = std::find_if(rows.begin(), rows.end(), [&](const OffloadTime& o) { return o.what == what; });
    return x != rows.end() && x->known ? &*x : nullptr;
  };
  OffloadTime* step = row("optimizer step on the host");
  OffloadTime* backup = row("speculated states backed up");  // (none where nothing can undo the step)
  OffloadTime* weights = row("updated weights to the device");
  if (!step || (z.speculation_backed_up && !backup)) return;
  const LastBackward b = last_backward_of(p, t, rows);
  const LastBackwardEnd plain = run_last_backward(b, false), speculated = run_last_backward(b, true);
  const double share = static_cast<double>(z.speculated_numel) / static_cast<double>(z.state_spans.front().numel());
  const double step_s = step->seconds * share, backup_s = backup ? backup->seconds : 0.0;
  double copies_s = 0;
  for (const auto& tiles : b.final_after)
    for (const LastBackward::Tile& x : tiles) copies_s += x.copy_s;
  const double host_s = step_s + backup_s + (b.pinned ? 0.0 : copies_s);
  if (!(host_s > 0)) return;
  const double hidden = host_s - std::clamp(speculated.end - plain.end, 0.0, host_s);
  const auto add = [](OffloadTime& x, double s) { x.hidden_s = std::min(x.seconds, x.hidden_s + s); };
  add(*step, hidden * step_s / host_s);
  if (backup) add(*backup, hidden * backup_s / host_s);
  if (!weights || !forward_rule) return;
  add(*weights, b.pinned ? copies_s - std::clamp(speculated.copies - speculated.end, 0.0, copies_s) : hidden * copies_s / host_s);
}

// Stage 3 on one rank with the parameters in page-locked host memory: each block's partitions cross to the GPU one block
// ahead (Device::copy_ahead), the next block's beside the current block's forward or backward, the compute stream
// waiting for them only as their block's gather finishes. Each pass's first block (block 0 in the forward, the top
// one in the backward) is gathered at once: of n blocks, (n - 1) / n of what n equal stages would hide, in each pass up
// to that pass's blocks' compute; the blocks' share of the row is half the forward's, half the backward's. The outer
// parameters (once a step) and those kept whole (after the update) hide nothing. (Several ranks' gathers read the copy
// in a collective, which waits for it at once; from pageable memory or NVMe the host waits for each copy.) The
// gradients leaving for the host beside the same backward take the other copy stream (the link's other direction),
// and the host waits only for theirs before it sums: the two hide side by side (the host memory both read or write
// counts only in the step's floor, host_memory_busy).
void hide_parameters_ahead(const Plan& p, const StepTime& t, std::vector<OffloadTime>& rows) {
  const ZeroExecution& z = p.execution;
  const ZeroBuffer* partitions = z.find(BufferRole::params, Place::host);
  if (p.topology.world_size != 1 || !z.gathers || p.zero.offload_param.device != OffloadDevice::cpu || !partitions || !partitions->pinned)
    return;
  const auto row = std::find_if(rows.begin(), rows.end(), [](const OffloadTime& x) { return x.what == "parameters to the device"; });
  if (row == rows.end() || !row->known || !(row->bytes > 0)) return;
  double gathered = 0;  // the blocks' gathered bytes a step: every micro step's forward and backward
  std::set<int> blocks;
  for (size_t i = 0; i < p.layout.params.size(); ++i) {
    const ParamSlot& s = p.layout.params[i];
    if (s.layer < 0 || z.whole_offset[i] >= 0) continue;
    gathered += 2.0 * static_cast<double>(p.batch.grad_accum * s.numel * dtype_bytes(p.precision.param_dtype));
    blocks.insert(s.layer);
  }
  if (blocks.size() < 2) return;
  const BlocksCompute beside = blocks_compute(p, t);
  const double pass = row->seconds * std::min(1.0, gathered / row->bytes) / 2;  // one pass's blocks' copies
  const double n = static_cast<double>(blocks.size());
  row->hidden_s = (n - 1) / n * (std::min(pass, beside.forward_s) + std::min(pass, beside.backward_s));
}

// What the host's memory does in a step, one thing after another at its rate: its own rows in full, hidden or not,
// and each copy's bytes once (a copy over the link reads or writes them there by DMA; a drive's read lands there,
// its write leaves from there). On a CPU device a copy between places is a host-memory row already; weights copied
// from the fp32 master (WeightsBack::copied) are the master's read the step's row counts already. (Pageable staging
// also passes each copy through the driver's own buffer: not counted, so the floor stays a floor.)
struct HostMemoryBusy {
  double seconds = 0, copied_bytes = 0;
};
HostMemoryBusy host_memory_busy(const ZeroExecution& z, const std::vector<OffloadTime>& rows, const OffloadRates& r) {
  const bool master_read = !z.state_spans.empty() && z.state_spans.front().weights == WeightsBack::copied;
  HostMemoryBusy b;
  for (const OffloadTime& x : rows)
    if (x.resource == OffloadResource::host_memory) b.seconds += x.seconds;
    else if (!(master_read && x.what == "updated weights to the device")) b.copied_bytes += x.bytes;
  b.seconds += b.copied_bytes / r.memory;
  return b;
}

void predict_offload(const Plan& p, StepTime& t) {
  if (p.execution.transfers.empty()) return;
  const OffloadRates r = offload_rates(p);
  std::vector<OffloadTime> rows = offload_rows(p, p.execution, r, t.missing);
  const bool memory_known = r.memory > 0;
  HostMemoryBusy busiest = memory_known ? host_memory_busy(p.execution, rows, r) : HostMemoryBusy{};
  // Pipeline stages hold different parts and run side by side: the one whose offload takes longest sets the pace,
  // and the one whose host memory is busy longest the floor (not always the same stage). (The plan's execution is
  // the stage heaviest on the device, not necessarily either.)
  if (p.mesh.shape.pipeline > 1 && p.mesh.heaviest_stage >= 0)
    for (size_t s = 0; s < p.mesh.stages.size(); ++s) {
      const Plan rank = stage_rank_plan(p, s, p.zero_stage());
      std::vector<OffloadTime> other = offload_rows(rank, rank.execution, r, t.missing);
      if (memory_known)
        if (const HostMemoryBusy b = host_memory_busy(rank.execution, other, r); b.seconds > busiest.seconds) busiest = b;
      if (exposed(other) > exposed(rows)) rows = std::move(other);
    }
  // The host's step during the next forward (step_in_forward): the tiles after the embeddings' are stepped while the
  // GPU runs the blocks before theirs, up to the first micro step's forward. Each one's weights then cross beside
  // those blocks (the copy waits only for the update's start, the block for the copy): three stages in a pipeline
  // (host step, copy, compute), so the copies hide behind the longer of the forward and the host's step of those
  // tiles. The copies of the tiles stepped at once hide behind its step of the next of them.
  // A pipeline of n hooks (each stepping its tiles, copying them, running its blocks) takes its stages' sum plus
  // n - 1 times the slowest: the first hook's step and copy hide behind nothing (the embeddings' forward, short, is
  // not counted), so what hides is (n - 1) / n of what n equal stages beside each other would hide. The compute they
  // run beside is the blocks' before the last hook: not the head's after them, nor the blocks' past the host's part.
  // (The tiles the speculative step takes during the backward, step_in_backward, are not left to the forward.)
  const std::vector<SubGroup>& tiles = p.execution.weight_tiles;
  const std::vector<int64_t>& hooks = p.execution.weight_tile_hooks;
  const std::vector<int64_t>& speculated = p.execution.weight_tile_final_after;  // (empty without speculation)
  int64_t later = 0, at_once = 0, stages = 0, last_hook = -1;
  for (size_t i = 0; p.execution.step_in_forward && i < tiles.size(); ++i) {
    if (hooks[i] < 0) {
      ++at_once;
    } else if (speculated.empty() || speculated[i] < 0) {
      later += tiles[i].numel();
      stages += hooks[i] != last_hook;
      last_hook = hooks[i];
    }
  }
  const bool forward_rule = p.execution.step_in_forward && t.forward_s > 0 && later > 0;
  if (forward_rule) {
    const double host = static_cast<double>(p.execution.state_spans.front().numel());
    const double share = static_cast<double>(later) / host;
    const double speculated_share = static_cast<double>(p.execution.speculated_numel) / host;
    const int64_t reached = (last_hook + 1) / 2;  // blocks run before the last hook
    double before = 0, all = 0;
    for (const ModuleFlops& m : module_flops(p.model, p.batch.micro_batch, p.seq_len, p.activation_checkpointing, p.frozen, p.lora))
      if (m.depth == 1) all += m.forward, before += m.layer >= 0 && m.layer < reached ? m.forward : 0.0;
    const double window = t.forward_s / static_cast<double>(std::max<int64_t>(1, p.batch.grad_accum)) * (all > 0 ? before / all : 0.0);
    const double filled = static_cast<double>(stages - 1) / static_cast<double>(stages);
    double step_s = 0;
    for (const OffloadTime& x : rows) step_s += x.what == "optimizer step on the host" ? x.seconds : 0.0;
    // From pageable staging (pin_memory false) a copy returns only once the host has passed the tile through the
    // driver's own page-locked memory: the host's step and the copies run one after the other, one stage hidden
    // behind the blocks (the step's part as where the copies run apart, the copies the rest); the tiles stepped at
    // once hide nothing of their copies.
    const ZeroBuffer* staging = p.execution.find(BufferRole::weights_staging, Place::host);
    const bool pinned = staging && staging->pinned;
    double copy_s = 0;
    for (const OffloadTime& x : rows) copy_s += x.what == "updated weights to the device" && x.known ? x.seconds : 0.0;
    const double host_stage_hidden = filled * std::min((step_s + copy_s) * share, window);
    for (OffloadTime& x : rows)
      if (x.what == "optimizer step on the host")
        x.hidden_s = filled * std::min(x.seconds * share, window);
      else if (x.what == "updated weights to the device" && x.known)
        x.hidden_s = !pinned ? host_stage_hidden - filled * std::min(step_s * share, window)
                             : std::min(x.seconds * static_cast<double>(std::max<int64_t>(0, at_once - 1)) / static_cast<double>(tiles.size()),
                                        step_s * (1 - share - speculated_share)) +
                                   filled * std::min(x.seconds * share, std::max(window, step_s * share));
  }
  hide_gradients_behind_backward(p, t, rows);
  hide_step_behind_backward(p, t, rows, forward_rule);
  hide_parameters_ahead(p, t, rows);
  t.offload = std::move(rows);
  for (const OffloadTime& x : t.offload) t.offload_s += x.seconds, t.offload_hidden_s += x.hidden_s;
  if (memory_known && t.offload_known()) t.host_memory_busy_s = busiest.seconds, t.host_memory_copied_bytes = busiest.copied_bytes;
}

}  // namespace

bool gradients_can_leave_during_backward(const Plan& p) {
  const ZeroExecution& z = p.execution;
  const ZeroBuffer* g = z.find_anywhere(BufferRole::grads);
  const ZeroBuffer* arrival = z.find(BufferRole::grads_arrival, Place::host);
  return p.topology.world_size == 1 && g && g->place == Place::host && arrival && arrival->dtype == z.reduced_dtype;
}

std::vector<BackwardHostWork> host_work_in_last_backward(const Plan& p) {
  std::vector<BackwardHostWork> order;
  if (!p.execution.overlap || !gradients_can_leave_during_backward(p)) return order;
  // (the order does not depend on the rates: any time for every row walks it)
  StepTime t;
  t.backward_s = 1;
  std::vector<OffloadTime> rows;
  for (const char* what : {"gradients to the host", "gradients summed on the host", "optimizer step on the host", "speculated states backed up",
                           "updated weights to the device"})
    rows.push_back({what, OffloadResource::host_memory, "", 1, 1, 0, true});
  run_last_backward(last_backward_of(p, t, rows), p.execution.step_in_backward, &order);
  return order;
}

const char* offload_resource_name(OffloadResource r) {
  switch (r) {
    case OffloadResource::host_link: return "host link";
    case OffloadResource::host_memory: return "host memory";
    case OffloadResource::nvme: return "nvme";
  }
  return "?";
}

bool StepTime::offload_known() const {
  return std::all_of(offload.begin(), offload.end(), [](const OffloadTime& o) { return o.known; });
}

double StepTime::offload_seconds(OffloadResource r) const {
  double s = 0;
  for (const OffloadTime& o : offload)
    if (o.resource == r) s += o.seconds - o.hidden_s;
  return s;
}

const char* StepTime::bound() const {
  if (host_memory_floored()) return "host-memory-bound";
  const char* name = comm_s > compute_s ? "communication-bound" : "compute-bound";
  double most = std::max(comm_s, compute_s);
  const std::pair<OffloadResource, const char*> resources[] = {
      {OffloadResource::host_link, "host-link-bound"}, {OffloadResource::host_memory, "host-memory-bound"}, {OffloadResource::nvme, "nvme-bound"}};
  for (const auto& [r, label] : resources)
    if (offload_seconds(r) > most) most = offload_seconds(r), name = label;
  return name;
}

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
  if (!p.has_model || p.batch.micro_batch <= 0) {
    t.missing.push_back(p.has_model ? "the micro batch (\"auto\" is chosen once the model is known)" : "a model (model.preset, or a model block)");
    return t;
  }
  predict_compute(p, t);
  // ZeRO's collectives run over the data group, the step's agreement over the world (the same group unless the
  // mesh splits the model); one row each, in the plan's order (overlap() relies on it).
  bool comm_known = true;
  if (!p.execution.collectives.empty()) {
    std::vector<int> everyone(static_cast<size_t>(p.mesh.shape.world()));
    for (size_t r = 0; r < everyone.size(); ++r) everyone[r] = static_cast<int>(r);
    const bool over_data = std::any_of(p.execution.collectives.begin(), p.execution.collectives.end(),
                                       [](const Collective& c) { return c.kind != CollectiveKind::control; });
    const bool split = p.mesh.shape.splits_the_model();
    const std::optional<Link> data = over_data || !split ? link_of(p, MeshAxis::data, t.missing) : std::nullopt;
    const std::optional<Link> world = split ? link_of(p, {everyone}, t.missing) : data;
    comm_known = (data || !over_data) && world;
    for (const Collective& c : p.execution.collectives)
      if (comm_known)
        add_row(t, c.what(), c.kind == CollectiveKind::control ? *world : *data, phase_of(c, p.execution), c.wire_bytes_per_rank_per_step,
                static_cast<double>(c.calls_per_step));
  }
  const size_t before = t.missing.size();
  if (comm_known) mesh_rows(p, t);
  t.comm_known = comm_known && t.missing.size() == before;
  if (!t.comm_known) {
    t.collectives.clear();
    predict_offload(p, t);
    return t;
  }
  predict_offload(p, t);
  if (t.compute_known) overlap(p, t);
  for (const CollectiveTime& c : t.collectives) t.comm_s += c.seconds, t.hidden_s += c.hidden_s;
  return t;
}

}  // namespace ds
