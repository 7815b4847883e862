#include "engine/plan/zero_plan.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/error.hpp"
#include "engine/plan/plan.hpp"

namespace ds {

const char* place_name(Place p) {
  switch (p) {
    case Place::device: return "device";
    case Place::host: return "host";
    case Place::nvme: return "nvme";
  }
  return "?";
}

const char* weights_back_name(WeightsBack w) {
  switch (w) {
    case WeightsBack::in_place: return "written in place";
    case WeightsBack::staged: return "staged on the host";
    case WeightsBack::copied: return "copied from the master";
  }
  return "?";
}

const char* buffer_role_name(BufferRole r) {
  switch (r) {
    case BufferRole::params: return "params";
    case BufferRole::whole_params: return "whole_params";
    case BufferRole::frozen_params: return "frozen_params";
    case BufferRole::frozen_partitions: return "frozen_partitions";
    case BufferRole::grads: return "grads";
    case BufferRole::offload_grads: return "offload_grads";
    case BufferRole::compute: return "compute";
    case BufferRole::compute_grads: return "compute_grads";
    case BufferRole::micro_grads: return "micro_grads";
    case BufferRole::master: return "master";
    case BufferRole::exp_avg: return "exp_avg";
    case BufferRole::exp_avg_sq: return "exp_avg_sq";
    case BufferRole::block_grads: return "block_grads";
    case BufferRole::outer_grads: return "outer_grads";
    case BufferRole::block_params: return "block_params";
    case BufferRole::frozen_block_params: return "frozen_block_params";
    case BufferRole::outer_params: return "outer_params";
    case BufferRole::gather_staging: return "gather_staging";
    case BufferRole::prefetch_staging: return "prefetch_staging";
    case BufferRole::frozen_staging: return "frozen_staging";
    case BufferRole::reduce_staging: return "reduce_staging";
    case BufferRole::reduce_cast: return "reduce_cast";
    case BufferRole::reduce_scratch: return "reduce_scratch";
    case BufferRole::optimizer_swap: return "optimizer_swap";
    case BufferRole::param_swap: return "param_swap";
    case BufferRole::weights_staging: return "weights_staging";
    case BufferRole::grads_arrival: return "grads_arrival";
    case BufferRole::block_arrivals: return "block_arrivals";
    case BufferRole::step_backup: return "step_backup";
  }
  return "?";
}

const ZeroBuffer* ZeroExecution::find_anywhere(BufferRole role) const {
  for (const ZeroBuffer& b : buffers)
    if (b.role == role) return &b;
  return nullptr;
}

const ZeroBuffer* ZeroExecution::find(BufferRole role, Place place) const {
  for (const ZeroBuffer& b : buffers)
    if (b.role == role && b.place == place) return &b;
  return nullptr;
}

namespace {

Place offload_place(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::none: return Place::device;
    case OffloadDevice::cpu: return Place::host;
    case OffloadDevice::nvme: return Place::nvme;
  }
  return Place::device;
}

// Where the frozen tensors live (see ZeroExecution::frozen_layout). Those outside the blocks stay whole at
// stage 3 too: the trained ones there are held gathered all along, and a frozen one, once whole, never needs
// gathering again. Small ones stay whole as DeepSpeed keeps them (stage3_param_persistence_threshold).
void place_frozen(const Plan& plan, const CommCapabilities& caps, ZeroExecution& z) {
  const ModelSpec& model = plan.model;
  z.frozen_slot.assign(model.tensors.size(), -1);
  z.frozen_offset.assign(model.tensors.size(), -1);
  if (plan.frozen.empty()) return;
  const bool partition = z.gathers && z.world_size > 1;
  std::vector<uint8_t> partitioned(model.tensors.size(), 0);
  int slot = 0;
  for (size_t i = 0; i < model.tensors.size(); ++i) {
    if (!plan.is_frozen(i)) continue;
    const TensorSpec& t = model.tensors[i];
    if (partition && t.layer >= 0 && !stays_whole(t.numel, plan.zero.param_persistence_threshold)) {
      partitioned[i] = 1;
      z.frozen_slot[i] = slot++;
    } else {
      z.frozen_offset[i] = z.frozen_whole_numel;
      z.frozen_whole_numel += t.numel;
    }
  }
  z.frozen_layout = build_layout(model_part(model, partitioned), 3, z.world_size);
  z.frozen_staged = slot > 0 && !caps.gathers_into_spans;
  z.frozen_group_offset.assign(z.frozen_layout.params.size(), 0);
  for (const ParamGroup& g : parameter_groups(z.frozen_layout)) {
    int64_t at = 0, partitions = 0;
    for (int k : g.params) {
      const ParamSlot& p = z.frozen_layout.params[static_cast<size_t>(k)];
      z.frozen_group_offset[static_cast<size_t>(k)] = at;
      at += p.numel;
      partitions += p.partition_numel;
    }
    z.frozen_block_numel = std::max(z.frozen_block_numel, at);
    z.frozen_gather_numel = std::max(z.frozen_gather_numel, partitions * z.world_size);
  }
}

}  // namespace

std::vector<Ownership> group_ownerships(const FlatLayout& L, const std::vector<ParamGroup>& groups,
                                        const std::vector<int64_t>& group_offset) {
  std::vector<int> group_of(L.params.size(), -1);
  for (size_t g = 0; g < groups.size(); ++g)
    for (int i : groups[g].params) group_of[static_cast<size_t>(i)] = static_cast<int>(g);
  std::vector<Ownership> out(groups.size(), Ownership(static_cast<size_t>(L.world_size)));
  for (int q = 0; q < L.world_size; ++q)
    for (const OwnedSegment& s : owned_segments(L, q)) {  // in parameter order: each group's spans come in order
      const ParamSlot& p = L.params[static_cast<size_t>(s.param)];
      const int g = group_of[static_cast<size_t>(s.param)];
      out[static_cast<size_t>(g)][static_cast<size_t>(q)].push_back(
          {group_offset[static_cast<size_t>(s.param)] + (s.global - p.offset), s.numel});
    }
  return out;
}

namespace {

// What describe_zero's steps share: the plan, the execution being described, and the choices they read.
struct ZeroBuild {
  const Plan& plan;
  ZeroExecution& z;
  CommCapabilities caps;
  bool param_offload = false, opt_offload = false, params_on_nvme = false, grads_to_host = false;
  bool master_crosses = false;  // the host's master is copied to the device's weights (WeightsBack::copied)
  // Parameters on NVMe: the partition file's size, and the chunk it is read and written in (bytes).
  int64_t param_bytes = 0, param_file_bytes = 0, param_chunk = 0;

  void add(BufferRole role, Dtype dtype, int64_t elements, MemoryCategory category, Place place = Place::device, int copies = 1,
           bool transient = false) {
    if (elements > 0 && copies > 0) z.buffers.push_back({role, dtype, elements, copies, place, category, transient, pinned(role, place)});
  }

  // Whether a buffer is page-locked: on the host of a device with memory of its own, copied to or from the device
  // (the offloaded parameters and their frozen partitions, the gradients that left it, the gradients' fp32 copy
  // taken from it, the staged weights), as its offload block's pin_memory asks.
  bool pinned(BufferRole role, Place place) const {
    if (place != Place::host || plan.topology.host_writes_device_memory()) return false;  // (one memory: nothing crosses)
    switch (role) {
      case BufferRole::master: return master_crosses && plan.zero.offload_optimizer.pin_memory;
      case BufferRole::params:
      case BufferRole::frozen_partitions: return plan.zero.offload_param.pin_memory;
      case BufferRole::grads_arrival:
      case BufferRole::block_arrivals:
      case BufferRole::offload_grads:
      case BufferRole::weights_staging: return plan.zero.offload_optimizer.pin_memory;
      default: return false;  // the states stepped where they are; NVMe's swap buffers are the swappers'
    }
  }
};

// How this stage runs on these ranks and this device: sharded, gathered, grouped, overlapped, through which
// library, in which dtypes; and the sizes of the parameter file when it lives on NVMe.
ZeroBuild decide_execution(const Plan& plan, ZeroExecution& z) {
  const FlatLayout& L = plan.layout;
  const ResolvedZero& knobs = plan.zero;
  const PrecisionPolicy& pp = plan.precision;
  DS_CHECK(L.stage >= 0 && L.stage <= 3, "stage ", L.stage);
  z.stage = L.stage;
  z.world_size = L.world_size;
  const bool multi = L.world_size > 1;
  ZeroBuild b{plan, z, {}};
  b.param_offload = L.stage == 3 && knobs.offload_param.device != OffloadDevice::none;
  b.opt_offload = L.stage >= 1 && knobs.offload_optimizer.device != OffloadDevice::none;
  z.sharded = multi && L.stage >= 1;
  // Stage 3 gathers parameters into group buffers whenever they are not all here: across ranks, or
  // offloaded on one rank.
  z.gathers = L.stage == 3 && (multi || b.param_offload);
  z.widened = pp.compute_dtype != pp.param_dtype;
  // A GPU's gradients leave for an offloaded optimizer block by block (DeepSpeed's ZeRO-Offload), so from
  // stage 2 on they are reduced per group even on one rank, and this rank's part lives on the host. (Not
  // with a widened compute dtype, the CPU's fp16: its gradients are rounded through the device's buffers.)
  b.grads_to_host = plan.topology.grads_leave_per_block() && !z.widened && b.opt_offload && knobs.offload_optimizer.ratio >= 1.0 &&
                    L.stage >= 2;
  z.grouped = L.stage >= 2 && (multi || z.gathers || b.grads_to_host);
  z.micro_grads = !z.grouped && !z.widened && dtype_bytes(pp.grad_dtype) > dtype_bytes(pp.compute_dtype);
  z.reduced_dtype = z.grouped || z.widened ? pp.compute_dtype : pp.grad_dtype;
  z.wire_dtype = multi && pp.comm_dtype ? *pp.comm_dtype : z.reduced_dtype;
  // overlap_comm: grouped stages reduce each group while backward goes on; stages 0-1 on several ranks
  // reduce each block's gradients as the step's last backward finishes it.
  z.overlap = knobs.overlap_comm && (z.grouped || multi);
  // And stages 1-2 gather the updated parameters while the next step's forward runs. Not through a split model's
  // stages, nor where the model computes in a wider copy of the weights, refreshed from the whole buffer at once.
  // (And only where the blocks hold trained parameters: the forward's block hooks are where it waits.)
  const bool blocks_train = std::any_of(L.params.begin(), L.params.end(), [](const ParamSlot& p) { return p.layer >= 0; });
  const bool could_gather_ahead = z.sharded && !z.gathers && z.overlap && !z.widened && !plan.mesh.shape.splits_the_model() && blocks_train;
  z.gather_ahead = could_gather_ahead && !plan.run.steps_measured_alone;
  z.kept_within_step = could_gather_ahead && plan.run.steps_measured_alone;
  z.backend = plan.topology.comm_backend();
  b.caps = comm_capabilities(z.backend);
  // Without a native reduce-scatter (Gloo) it is point-to-point sends into a receive buffer of (W-1) x the
  // rank's part: a group's part at stages 2-3; at stage 1 it would be the whole shard, so stage 1 all-reduces.
  z.scatter = multi && knobs.reduce_scatter && (z.grouped || b.caps.native_reduce_scatter);
  z.full_numel = L.stage == 0 ? L.numel : L.padded_numel;
  z.local_numel = z.sharded ? L.shard_numel : z.full_numel;
  b.params_on_nvme = b.param_offload && knobs.offload_param.device == OffloadDevice::nvme;
  // Staged: packed into a buffer of equal pieces first, where the collective cannot land each rank's spans in place
  // (NCCL), and unpacked after; one rank gathers nothing from others, so its partitions go straight to the block.
  z.gather_staged = z.gathers && (z.widened || b.params_on_nvme || (multi && !b.caps.gathers_into_spans));
  b.param_bytes = dtype_bytes(pp.param_dtype);
  // A swap buffer never holds more than the whole partition file (DeepSpeed allocates buffer_size regardless).
  b.param_file_bytes = swap_aligned(z.local_numel * b.param_bytes);
  b.param_chunk = std::max(kSwapAlignBytes,
                           std::min(swap_aligned(std::max<int64_t>(1, knobs.offload_param.buffer_size) * b.param_bytes), b.param_file_bytes));
  return b;
}

// Parameters on NVMe: the bytes of the partition file each gather reads (a block's twice per micro step,
// forward and backward; the outer parameters' and the whole-kept ones' once per step).
struct ParamFileReads {
  std::vector<std::pair<int64_t, int64_t>> whole_ranges;
  double per_micro_step = 0, outer = 0;
};

// Where each parameter sits in its group's buffers. Every block has the same layout, so all blocks share
// one buffer (the offsets repeat); the outer parameters concatenate in order. Stage 3 keeps parameters
// below the persistence threshold whole, in a buffer of their own.
ParamFileReads lay_out_groups(ZeroBuild& b) {
  const FlatLayout& L = b.plan.layout;
  ZeroExecution& z = b.z;
  z.group_offset.assign(L.params.size(), 0);
  z.whole_offset.assign(L.params.size(), -1);
  ParamFileReads reads;
  if (!z.grouped) return reads;
  int64_t whole_partitions = 0;
  for (const ParamGroup& g : parameter_groups(L)) {
    int64_t at = 0, gathered = 0;
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (int i : g.params) {
      const ParamSlot& p = L.params[static_cast<size_t>(i)];
      z.group_offset[static_cast<size_t>(i)] = at;
      at += p.numel;
      const std::pair<int64_t, int64_t> bytes{p.partition_offset * b.param_bytes, (p.partition_offset + p.partition_numel) * b.param_bytes};
      if (z.gathers && stays_whole(p, b.plan.zero.param_persistence_threshold)) {
        z.whole_offset[static_cast<size_t>(i)] = z.whole_numel;
        z.whole_numel += p.numel;
        whole_partitions += p.partition_numel;
        reads.whole_ranges.push_back(bytes);
      } else {
        gathered += p.partition_numel;
        ranges.push_back(bytes);
      }
    }
    if (b.params_on_nvme) {
      const double group_reads = static_cast<double>(swap_transfer_bytes(ranges, b.param_chunk));
      if (g.layer >= 0)
        reads.per_micro_step += 2 * group_reads;
      else
        reads.outer += group_reads;
    }
    if (g.layer >= 0) {
      z.block_numel = std::max(z.block_numel, at);  // equal in every model ds trains; a hypothetical one may differ
    } else {
      z.outer_numel = at;
    }
    z.gather_numel = std::max(z.gather_numel, gathered * L.world_size);
    if (g.layer >= 0) z.prefetch_numel = std::max(z.prefetch_numel, gathered * L.world_size);
  }
  z.gather_numel = std::max(z.gather_numel, whole_partitions * L.world_size);
  return reads;
}

// Model states. Stage 3 holds only this rank's partition of the weights (on the host or NVMe when
// offloaded; on NVMe the partition's file takes whole blocks) plus, in the compute dtype the model reads,
// the parameters kept whole.
void add_weights_and_gradients(ZeroBuild& b) {
  const PrecisionPolicy& pp = b.plan.precision;
  const ResolvedZero& knobs = b.plan.zero;
  ZeroExecution& z = b.z;
  const Dtype compute = pp.compute_dtype;
  using C = MemoryCategory;
  b.add(BufferRole::params, pp.param_dtype,
        b.params_on_nvme ? b.param_file_bytes / b.param_bytes : z.gathers ? z.local_numel : z.full_numel, C::params,
        b.param_offload ? offload_place(knobs.offload_param.device) : Place::device);
  b.add(BufferRole::whole_params, compute, z.whole_numel, C::params);
  // Frozen tensors (LoRA's base, model.freeze): read by the model, never stepped or reduced; at stage 3 on
  // several ranks partitioned and gathered as a block runs.
  place_frozen(b.plan, b.caps, z);
  b.add(BufferRole::frozen_params, compute, z.frozen_whole_numel, C::params);
  // Their partitions live where the trained ones do: offload_param puts them on the host (with NVMe too:
  // never updated, they need no file).
  b.add(BufferRole::frozen_partitions, compute, z.frozen_layout.shard_numel, C::params, b.param_offload ? Place::host : Place::device);
  // Gradients: the whole model up to stage 1, this rank's part from stage 2 on. An offloaded optimizer
  // reads this rank's reduced part, copied (widened to fp32, exactly) to where the states live. On a GPU
  // with the whole optimizer offloaded from stage 2 on, that part lives on the host, as DeepSpeed's
  // ZeRO-Offload keeps it: each block's gradients leave the device's block buffer once reduced.
  b.add(BufferRole::grads, pp.grad_dtype, z.grouped ? z.local_numel : z.full_numel, C::grads, b.grads_to_host ? Place::host : Place::device);
  // A compute dtype wider than the stored one (fp16 on the CPU): the model runs on a working copy of the
  // weights (none when it reads gathered buffers only) and accumulates its gradients in that dtype.
  if (z.widened) {
    if (!z.gathers) b.add(BufferRole::compute, compute, z.full_numel, C::buffers);
    b.add(BufferRole::compute_grads, compute, z.grouped ? z.local_numel : z.full_numel, C::buffers);
  }
  // Gradients accumulated wider than backward writes them (bf16 weights, fp32 accumulation) at stages 0-1: each
  // micro-batch's in the compute dtype first. (Grouped stages add each reduced group buffer into the wider part.)
  if (z.micro_grads) b.add(BufferRole::micro_grads, compute, z.full_numel, C::buffers);
}

// NVMe: the states are swapped sub-group by sub-group through host buffers, and their files hold each
// sub-group from a block boundary on (O_DIRECT), so they take a little more than the elements. Returns
// the elements each state's file holds.
int64_t cut_sub_groups(ZeroBuild& b, const std::vector<StepRun>& runs, int64_t offloaded) {
  const ResolvedZero& knobs = b.plan.zero;
  ZeroExecution& z = b.z;
  const int64_t capacity = std::min(std::max<int64_t>(knobs.sub_group_size, kStepGrain), offloaded);
  // Each sub-group is a round of file transfers per state: millions of them is a typo (0, 1e1), not a
  // plan, and listing them would take gigabytes.
  constexpr int64_t kMostSubGroups = int64_t{1} << 20;
  if ((offloaded + capacity - 1) / capacity > kMostSubGroups)
    throw ConfigError("zero_optimization",
                      {{"zero_optimization.sub_group_size",
                        "sub_group_size " + std::to_string(knobs.sub_group_size) + " cuts the rank's " + std::to_string(offloaded) +
                            " offloaded optimizer elements into more than " + std::to_string(kMostSubGroups) + " sub-groups",
                        "set it to at least " + std::to_string((offloaded + kMostSubGroups - 1) / kMostSubGroups) +
                            " (DeepSpeed's default is 1e9; 1e8 suits a machine short of RAM)"}});
  z.sub_groups = optimizer_sub_groups(runs, offloaded, capacity);
  for (const SubGroup& g : z.sub_groups) z.sub_group_numel = std::max(z.sub_group_numel, g.numel());
  z.swap_sets = std::max(1, knobs.swap_sets);
  return swap_file_bytes(z.sub_groups) / 4;
}

// How the weights stepped at `states` reach their own place: the kernel writes bf16 weights in place where one
// memory holds both (the states beside the weights, or a CPU device), into a host staging buffer where a host
// kernel steps a GPU's weights, else they are copied from the master (and weights in a file are written by the
// parameters' swap).
WeightsBack weights_back_of(const ZeroBuild& b, Place states) {
  const Plan& plan = b.plan;
  if (plan.precision.param_dtype != Dtype::bf16 || b.params_on_nvme) return WeightsBack::copied;
  const Place stepped_at = memory_of(states);  // (swapped in to be stepped)
  const Place params_at = b.param_offload ? Place::host : Place::device;
  if (stepped_at == params_at || plan.topology.host_writes_device_memory()) return WeightsBack::in_place;
  return stepped_at == Place::host ? WeightsBack::staged : WeightsBack::copied;
}

// Optimizer states of this rank's part: the fp32 master (mixed precision) and the moments. With offload
// the first `ratio` of them lives on the host or NVMe, the rest stays; the gradients go there each step
// and the updated weights come back.
void add_optimizer_states(ZeroBuild& b) {
  const Plan& plan = b.plan;
  const PrecisionPolicy& pp = plan.precision;
  const ResolvedZero& knobs = plan.zero;
  ZeroExecution& z = b.z;
  using C = MemoryCategory;
  const double ratio = b.opt_offload ? knobs.offload_optimizer.ratio : 0.0;
  // Partial offload splits the part on a kernel's grain, so each element's update is the one it gets whole.
  const std::vector<StepRun> runs = optimizer_runs(plan.layout, plan.topology.rank, plan.optimizer.per_tensor_update());
  const int64_t offloaded = step_cut(runs, static_cast<int64_t>(std::llround(static_cast<double>(z.local_numel) * ratio)));
  z.offloaded_numel = offloaded;
  const Place state_place = offload_place(b.opt_offload ? knobs.offload_optimizer.device : OffloadDevice::none);
  if (offloaded > 0) z.state_spans.push_back({0, offloaded, state_place, weights_back_of(b, state_place)});
  if (offloaded < z.local_numel || z.state_spans.empty())
    z.state_spans.push_back({offloaded, z.local_numel, Place::device, weights_back_of(b, Place::device)});
  std::vector<BufferRole> states;
  // Offloaded, the optimizer updates an fp32 master where the states live even in an fp32 run (whose
  // master is otherwise the weights themselves), and the device's weights are copied from it; so it does
  // when the weights themselves are offloaded (the states stepped on the device send the weights over).
  const bool own_master = pp.fp32_master || b.param_offload;
  if (own_master || offloaded > 0) states.push_back(BufferRole::master);
  if (plan.optimizer.moments >= 1) states.push_back(BufferRole::exp_avg);
  if (plan.optimizer.moments >= 2) states.push_back(BufferRole::exp_avg_sq);
  const bool swapped = offloaded > 0 && state_place == Place::nvme;
  const int64_t state_elements = swapped ? cut_sub_groups(b, runs, offloaded) : offloaded;
  // A staged NVMe span (bf16 weights a host kernel writes for a GPU): each sub-group (DeepSpeed's default
  // sub_group_size: 1e9 elements) is stepped in windows of at most kMostStagingTile once read in, so what holds a
  // chunk at a time (the staging, the gradients' fp32 copy) holds a window's, not a sub-group's (4 GB each at 1e9).
  // (Lamb steps each tensor whole: refused on NVMe, it would keep its sub-groups.)
  const bool staged = offloaded > 0 && z.state_spans.front().weights == WeightsBack::staged;
  const int64_t window = std::min(std::max(knobs.sub_group_size, kStepGrain), kMostStagingTile);  // the most a tile or window holds
  if (swapped && staged && !plan.optimizer.per_tensor_update()) z.weight_tiles = staging_windows(z.sub_groups, runs, window);
  int64_t swapped_chunk = 0;  // the most elements an NVMe span is stepped in at a time
  for (const SubGroup& g : z.weight_tiles.empty() ? z.sub_groups : z.weight_tiles) swapped_chunk = std::max(swapped_chunk, g.numel());
  b.master_crosses = offloaded > 0 && state_place == Place::host && !b.param_offload && z.state_spans.front().weights == WeightsBack::copied;
  for (BufferRole r : states) {
    if (r != BufferRole::master || own_master) b.add(r, Dtype::fp32, z.local_numel - offloaded, C::optimizer_states);
    b.add(r, Dtype::fp32, state_elements, C::optimizer_states, state_place);
  }
  if (offloaded == 0) return;
  // The reduced gradients (all of them, or one chunk's at a time when swapping: a sub-group's, or a window's) in fp32 where the
  // optimizer runs; none where they left the device block by block into host memory, where the kernel reads
  // them in their own dtype.
  const Place grads_place = swapped ? Place::host : state_place;
  if (!b.grads_to_host) b.add(BufferRole::offload_grads, Dtype::fp32, swapped ? swapped_chunk : offloaded, C::grads, grads_place);
  if (b.grads_to_host) {  // each micro step, every group's reduced part of this rank leaves as backward finishes it
    int64_t owned = 0, largest = 0;
    for (const OwnedSegment& s : owned_segments(plan.layout, plan.topology.rank)) owned += s.numel, largest = std::max(largest, s.numel);
    // (each piece arrives in a page-locked buffer, then is added to the gradients the micro steps accumulate)
    b.add(BufferRole::grads_arrival, pp.grad_dtype, largest, C::buffers, Place::host);
    z.transfers.push_back({"gradients to the host", Place::device, Place::host,
                           static_cast<double>(plan.batch.grad_accum * owned * dtype_bytes(pp.grad_dtype))});
  } else {
    z.transfers.push_back({"gradients to the optimizer", Place::device, grads_place, static_cast<double>(offloaded) * 4});
  }
  if (swapped) {
    const double state_bytes = static_cast<double>(states.size()) * static_cast<double>(state_elements) * 4;
    z.transfers.push_back({"optimizer states read", Place::nvme, Place::host, state_bytes});
    z.transfers.push_back({"optimizer states written", Place::host, Place::nvme, state_bytes});
    // Whole blocks, as the files are read and written.
    const int64_t per_block = kSwapAlignBytes / 4;
    b.add(BufferRole::optimizer_swap, Dtype::fp32, (z.sub_group_numel + per_block - 1) / per_block * per_block, C::buffers, Place::host,
          z.swap_sets * static_cast<int>(states.size()));
  }
  if (!b.param_offload)  // offloaded weights live beside the states (on the host) or in their file
    z.transfers.push_back({"updated weights to the device", grads_place, Place::device, static_cast<double>(offloaded) * dtype_bytes(pp.param_dtype),
                           z.state_spans.front().weights == WeightsBack::in_place});
  if (staged) {
    // A tile's weights at a time (a tile of the span in memory, or a window of an NVMe sub-group: above), in two
    // buffers taken in turn where there are several: the host steps the next tile while the last one crosses.
    // (Lamb steps each tensor whole: one tile, the span; the others at most kMostWeightTiles of them)
    const int64_t tile = std::max(window, (offloaded + kMostWeightTiles - 1) / kMostWeightTiles + kStepGrain);
    // (+ a grain: each cut may move back onto its run's grain by less than one)
    if (!swapped) z.weight_tiles = optimizer_sub_groups(runs, offloaded, plan.optimizer.per_tensor_update() ? offloaded : tile);
    const std::vector<SubGroup>& tiles = z.staged_tiles();
    int64_t most = 0;
    for (const SubGroup& t : tiles) most = std::max(most, t.numel());
    b.add(BufferRole::weights_staging, pp.param_dtype, most, C::buffers, Place::host, tiles.size() > 1 ? 2 : 1);
  }
}

// Bytes of this rank's partitions one gather of `params` copies into the device's buffer: whole partitions
// when packed (staged), the elements this rank really owns when gathered in place.
double partition_bytes(const FlatLayout& L, const std::vector<int>& params, bool staged, int rank, int64_t bytes) {
  int64_t n = 0;
  for (int i : params) {
    const ParamSlot& p = L.params[static_cast<size_t>(i)];
    n += staged ? p.partition_numel : stage3_owned(p, rank).real;
  }
  return static_cast<double>(n * bytes);
}

// Offloaded parameters: the weights the optimizer steps on the device (all of them, or the part a ratio
// keeps there) go to the host's partition or file; every gather copies this rank's partitions from the
// host to the device (each block's twice a micro step, forward and backward, the frozen blocks' too; the
// outer parameters' at the step's first micro step; the ones kept whole after the update).
void add_parameter_fetches(ZeroBuild& b) {
  const Plan& plan = b.plan;
  ZeroExecution& z = b.z;
  const int rank = plan.topology.rank;
  const int64_t stepped_on_device = z.local_numel - z.offloaded_numel;
  if (stepped_on_device > 0)
    z.transfers.push_back({"stepped weights to the host", Place::device, Place::host,
                           static_cast<double>(stepped_on_device * b.param_bytes), z.state_spans.back().weights == WeightsBack::in_place});
  const FlatLayout& L = plan.layout;
  const double micro = static_cast<double>(plan.batch.grad_accum);
  double bytes = 0;
  std::vector<int> whole;
  for (const ParamGroup& g : parameter_groups(L)) {
    std::vector<int> gathered;
    for (int i : g.params) (z.whole_offset[static_cast<size_t>(i)] >= 0 ? whole : gathered).push_back(i);
    bytes += (g.layer >= 0 ? 2 * micro : 1.0) * partition_bytes(L, gathered, z.gather_staged, rank, b.param_bytes);
  }
  bytes += partition_bytes(L, whole, z.gather_staged, rank, b.param_bytes);
  for (const ParamGroup& g : parameter_groups(z.frozen_layout))
    bytes += 2 * micro * partition_bytes(z.frozen_layout, g.params, z.frozen_staged, rank, dtype_bytes(plan.precision.compute_dtype));
  z.transfers.push_back({"parameters to the device", Place::host, Place::device, bytes});
}

// The parameter partition on NVMe streams through buffer_count host buffers of buffer_size elements (whole
// blocks): the gathers read the parts they need, the optimizer's update rewrites the whole file.
void add_parameter_swap(ZeroBuild& b, const ParamFileReads& reads) {
  const ResolvedZero& knobs = b.plan.zero;
  ZeroExecution& z = b.z;
  b.add(BufferRole::param_swap, b.plan.precision.param_dtype, b.param_chunk / b.param_bytes, MemoryCategory::buffers, Place::host,
        static_cast<int>(std::max<int64_t>(1, knobs.offload_param.buffer_count)));
  const double whole_reads = static_cast<double>(swap_transfer_bytes(reads.whole_ranges, b.param_chunk));
  z.transfers.push_back({"parameters read for gathers", Place::nvme, Place::host,
                         static_cast<double>(b.plan.batch.grad_accum) * reads.per_micro_step + reads.outer + whole_reads});
  z.transfers.push_back({"updated parameters written", Place::host, Place::nvme, static_cast<double>(b.param_file_bytes)});
}

// The gradient elements being reduced at once: one reduce bucket at a time, or a whole group (stages 0-1: every
// block's range) when its pieces all run beside backward (overlap_comm).
int64_t gradients_in_flight(const ZeroBuild& b) {
  const ZeroExecution& z = b.z;
  const int64_t largest = z.grouped ? std::max(z.block_numel, z.outer_numel) : z.full_numel;
  return z.overlap ? largest : std::min(std::max<int64_t>(1, b.plan.zero.reduce_bucket_size), largest);
}

// What ZeRO works through: a group's gradients land in its buffer and are reduced as backward finishes
// it (with overlap_comm a second block buffer: the next block's backward writes it meanwhile); stage 3
// gathers into one buffer per block in use (the next one prefetched) and the outer parameters'; a staged
// gather packs every rank's partitions into a staging buffer first (the prefetch into its own).
void add_working_buffers(ZeroBuild& b) {
  const FlatLayout& L = b.plan.layout;
  const PrecisionPolicy& pp = b.plan.precision;
  ZeroExecution& z = b.z;
  const Dtype compute = pp.compute_dtype;
  using C = MemoryCategory;
  if (z.grouped) {
    b.add(BufferRole::block_grads, compute, z.block_numel, C::buffers, Place::device, z.overlap ? 2 : 1);
    b.add(BufferRole::outer_grads, compute, z.outer_numel, C::buffers);
    // One rank's gradients leaving for page-locked host memory beside the backward: summed a block late (the plan may
    // choose a longer lag: choose_speculated_tiles).
    if (b.grads_to_host && z.overlap && L.world_size == 1 && b.pinned(BufferRole::block_arrivals, Place::host) && z.block_numel > 0) {
      z.gradient_lag = 1;
      b.add(BufferRole::block_arrivals, compute, z.block_numel, C::buffers, Place::host, 2);
    }
  }
  if (z.gathers) {
    b.add(BufferRole::block_params, compute, z.block_numel, C::buffers, Place::device, 2);
    b.add(BufferRole::outer_params, compute, z.outer_numel, C::buffers);
    if (z.gather_staged) {
      b.add(BufferRole::gather_staging, pp.param_dtype, z.gather_numel, C::buffers);
      b.add(BufferRole::prefetch_staging, pp.param_dtype, z.prefetch_numel, C::buffers);
    }
    b.add(BufferRole::frozen_block_params, compute, z.frozen_block_numel, C::buffers, Place::device, 2);
    if (z.frozen_staged) b.add(BufferRole::frozen_staging, compute, z.frozen_gather_numel, C::buffers, Place::device, 2);
  }
  // A grouped reduce-scatter receives the other ranks' contributions to this rank's part of a group: room
  // for the largest part any rank owns (stage 2's shards cut groups unevenly), once per other rank.
  if (z.grouped && z.scatter && !b.caps.native_reduce_scatter) {
    int64_t largest = 0;
    for (const Ownership& owners : group_ownerships(L, parameter_groups(L), z.group_offset))
      for (const std::vector<Span>& spans : owners) largest = std::max(largest, span_elements(spans));
    b.add(BufferRole::reduce_scratch, z.wire_dtype, largest * (L.world_size - 1), C::buffers);
  } else if (L.world_size > 1 && !b.caps.sums_16bit && dtype_bytes(z.wire_dtype) < 4) {
    // Gloo all-reduces 16-bit gradients through an fp32 copy of the pieces in flight. (Gradients summed in
    // fp32 over bf16 weights are reduced from the fp32 buffer itself.)
    b.add(BufferRole::reduce_staging, Dtype::fp32, gradients_in_flight(b), C::buffers, Place::device, 1, /*transient=*/true);
  }
  // communication_data_type: the pieces in flight cast to it before they are reduced.
  if (z.wire_dtype != z.reduced_dtype)
    b.add(BufferRole::reduce_cast, z.wire_dtype, gradients_in_flight(b), C::buffers, Place::device, 1, /*transient=*/true);
}

}  // namespace

// Stepping during the next forward (ZeroExecution::step_in_forward): for each tile [begin, end) of the flat
// parameters, the block hook before which it is stepped, numbered in the forward's order: 2 l before block l's
// forward, 2 l + 1 after it; -1 for a tile that begins before the first trained block (stepped at once) and the last
// trained block's "after" for one that begins after it (stepped before the final norm and the head). A tile is
// stepped where its first element is read; a tile reaching into the next block is stepped with its first.
static std::vector<int64_t> tile_hooks(const FlatLayout& L, const std::vector<SubGroup>& tiles) {
  std::vector<std::pair<int64_t, int>> blocks;  // (the first flat element, the layer) of each trained block, in order
  int64_t blocks_end = 0;
  for (const ParamGroup& g : parameter_groups(L)) {
    if (g.layer < 0) continue;
    int64_t begin = L.numel;
    for (int i : g.params) {
      const ParamSlot& p = L.params[static_cast<size_t>(i)];
      begin = std::min(begin, p.offset);
      blocks_end = std::max(blocks_end, p.offset + p.numel);
    }
    blocks.emplace_back(begin, g.layer);
  }
  std::vector<int64_t> hooks;
  for (const SubGroup& t : tiles) {
    if (blocks.empty() || t.begin < blocks.front().first) {
      hooks.push_back(-1);
    } else if (t.begin >= blocks_end) {
      hooks.push_back(2 * int64_t{blocks.back().second} + 1);
    } else {
      const auto in = std::upper_bound(blocks.begin(), blocks.end(), std::pair<int64_t, int>{t.begin, std::numeric_limits<int>::max()}) - 1;
      hooks.push_back(2 * int64_t{in->second});
    }
  }
  return hooks;
}

// The speculative step (ZeroExecution::step_in_backward): per tile [begin, end) of the flat parameters, the lowest
// block whose parameters it holds (its gradients are all final once that block's have arrived on the step's last
// micro step: the blocks above it ran their backward before), or -1 where it holds a parameter outside the blocks.
static std::vector<int64_t> tile_final_after(const FlatLayout& L, const std::vector<SubGroup>& tiles) {
  std::vector<int64_t> after;
  for (const SubGroup& t : tiles) {
    int64_t lowest = std::numeric_limits<int64_t>::max();
    for (const ParamSlot& p : L.params) {
      if (p.offset >= t.end || p.offset + p.numel <= t.begin) continue;
      lowest = p.layer < 0 ? -1 : std::min<int64_t>(lowest, p.layer);
      if (lowest < 0) break;
    }
    after.push_back(lowest == std::numeric_limits<int64_t>::max() ? -1 : lowest);  // (padding alone: nothing to speculate)
  }
  return after;
}

void set_gradient_lag(ZeroExecution& z, int64_t lag) {
  DS_CHECK(lag >= 1 && z.gradient_lag >= 1, "a gradient lag of ", lag, " where the plan's is ", z.gradient_lag);
  z.gradient_lag = lag;
  for (ZeroBuffer& b : z.buffers)
    if (b.role == BufferRole::block_arrivals) b.copies = static_cast<int>(lag + 1);
}

void limit_speculation(ZeroExecution& z, const std::set<int64_t>& blocks) {
  if (!z.step_in_backward) return;
  z.speculated_numel = 0;
  for (size_t i = 0; i < z.weight_tile_final_after.size(); ++i) {
    int64_t& after = z.weight_tile_final_after[i];
    if (!blocks.count(after)) after = -1;
    if (after >= 0) z.speculated_numel += z.weight_tiles[i].numel();
  }
  for (ZeroBuffer& b : z.buffers)
    if (b.role == BufferRole::step_backup) b.elements = z.speculated_numel;
  if (z.speculated_numel > 0) return;
  z.step_in_backward = z.speculation_backed_up = false;
  z.weight_tile_final_after.clear();
  z.buffers.erase(std::remove_if(z.buffers.begin(), z.buffers.end(), [](const ZeroBuffer& b) { return b.role == BufferRole::step_backup; }),
                  z.buffers.end());
}

ZeroExecution describe_zero(const Plan& plan) {
  ZeroExecution z;
  ZeroBuild b = decide_execution(plan, z);
  const ParamFileReads reads = lay_out_groups(b);
  add_weights_and_gradients(b);
  add_optimizer_states(b);
  if (b.params_on_nvme) add_parameter_swap(b, reads);
  if (b.param_offload) add_parameter_fetches(b);
  add_working_buffers(b);
  z.collectives = plan_collectives(plan, z);
  // The host's step of a GPU's weights during the next forward: the host's span of this rank's part (all of it, or the
  // first `ratio` of it, the rest stepped on the device at once) stepped in tiles whose weights are staged for the
  // device, over a model whole on the rank that computes in the stored weights (Lamb's per-tensor norms need every
  // tile's first; refused as a tile layout anyway).
  const auto on_device = [](const StateSpan& s) { return s.place == Place::device; };
  const bool host_steps_tiles = !z.state_spans.empty() && z.state_spans.front().place == Place::host &&
                                z.state_spans.front().weights == WeightsBack::staged &&
                                std::all_of(z.state_spans.begin() + 1, z.state_spans.end(), on_device) && z.weight_tiles.size() > 1 &&
                                !z.sharded && !z.gathers && !z.widened && !plan.mesh.shape.splits_the_model() &&
                                !plan.optimizer.per_tensor_update();
  // The speculative step: where the gradients leave block by block (summed on the host as they arrive), so a tile's
  // are final in host memory before the backward ends. Only with overlap_comm: without it the host sums each block's
  // gradients, and would step its tiles, before the GPU is given the next block's backward (nothing to hide behind).
  if (host_steps_tiles && b.grads_to_host && z.overlap && plan.zero.offload_optimizer.speculative_step) {
    using C = MemoryCategory;
    std::vector<int64_t> after = tile_final_after(plan.layout, z.weight_tiles);
    for (size_t i = 0; i < after.size(); ++i) z.speculated_numel += after[i] >= 0 ? z.weight_tiles[i].numel() : 0;
    if (z.speculated_numel > 0) {
      z.step_in_backward = true;
      z.weight_tile_final_after = std::move(after);
      z.speculation_backed_up = plan.gradient_clipping > 0 || plan.precision.check_overflow;
      int states = 0;
      for (const ZeroBuffer& x : z.buffers)
        states += x.place == Place::host && (x.role == BufferRole::master || x.role == BufferRole::exp_avg || x.role == BufferRole::exp_avg_sq);
      if (z.speculation_backed_up) b.add(BufferRole::step_backup, Dtype::fp32, z.speculated_numel, C::buffers, Place::host, states);
    }
  }
  if (host_steps_tiles) {
    std::vector<int64_t> hooks = tile_hooks(plan.layout, z.weight_tiles);
    const bool could = std::any_of(hooks.begin(), hooks.end(), [](int64_t h) { return h >= 0; });
    z.step_in_forward = could && !plan.run.steps_measured_alone;
    z.kept_within_step = z.kept_within_step || (could && plan.run.steps_measured_alone);
    if (z.step_in_forward) z.weight_tile_hooks = std::move(hooks);
  }
  return z;
}

}  // namespace ds
