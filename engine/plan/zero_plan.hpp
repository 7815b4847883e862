// ds — one ZeRO execution, described once: what a stage shards, groups and gathers, every buffer a
// rank holds (role, dtype, elements, where it lives) and every collective it issues per step. The
// memory table sums these buffers (engine/plan/memory.hpp), `ds plan` lists the collectives, and the
// runtime allocates exactly these buffers (engine/runtime/run/flat_params.cpp) and issues exactly these
// collectives (engine/runtime/run/zero.cpp), counting them under the same CollectiveKind. A new placement
// (offload) is a new Place on a buffer here, not a new branch in the files that use it.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "engine/plan/comm.hpp"
#include "engine/plan/optimizer_groups.hpp"
#include "schema/config.hpp"

namespace ds {

struct Plan;

enum class Place { device, host, nvme };
const char* place_name(Place p);

// How a span's updated weights reach the place the weights live once its states are stepped (decided by the plan
// once: the runtime's step, the plan's transfers and buffers, and its time model read it).
enum class WeightsBack {
  in_place,  // the optimizer's kernel writes the bf16 weights where they live as it steps (one memory holds both)
  staged,    // the host's kernel writes the bf16 weights into a page-locked host buffer (weights_staging) as it
             // steps, which is copied to the device whole: half the bytes of the fp32 master on the link, and
             // the master not read again
  copied,    // copied from the fp32 master after the step, converted on the way (fp32 or fp16 weights, weights in
             // a file, or a device's step for weights on the host); nothing where the master is the weights
};
const char* weights_back_name(WeightsBack w);
// The most elements one tile of staged weights holds (32 MiB of bf16 in each of the two page-locked buffers),
// and the most tiles a span is cut in (a small sub_group_size would otherwise cut millions).
constexpr int64_t kMostStagingTile = int64_t{1} << 24;
constexpr int64_t kMostWeightTiles = 1024;

// Local elements [begin, end) of a rank's optimizer part whose states (fp32 master, moments) live at `place`.
struct StateSpan {
  int64_t begin = 0, end = 0;
  Place place = Place::device;
  WeightsBack weights = WeightsBack::copied;
  int64_t numel() const { return end - begin; }
};

// The memory states at `place` are stepped in: NVMe's go through host buffers.
inline Place memory_of(Place place) { return place == Place::nvme ? Place::host : place; }
inline Place memory_of(const StateSpan& s) { return memory_of(s.place); }

// The memory table's rows.
enum class MemoryCategory { params, grads, optimizer_states, buffers };

enum class BufferRole {
  params,          // the stored weights: the whole (padded) model, or at stage 3 this rank's partition
  whole_params,    // stage 3: the parameters below the persistence threshold, whole, in the compute dtype
  frozen_params,   // LoRA's base, model.freeze: the weights that do not train, in the compute dtype, kept whole
  frozen_partitions,  // stage 3 on several ranks: this rank's partitions of the frozen tensors inside the blocks
                      // (on the host with offload_param, as the trained partitions are)
  grads,           // gradients in their stored dtype: the whole model (stages 0-1) or this rank's part (2-3)
  offload_grads,   // fp32 copy of this rank's reduced gradients where an offloaded optimizer runs
  compute,         // a wider working copy of the weights (fp16 on the CPU, which has no fp16 kernels)
  compute_grads,   // the gradients backward accumulates in that wider dtype
  micro_grads,     // stages 0-1 accumulating in a wider dtype than the weights' (bf16 weights, fp32 gradients): what
                   // backward writes one micro-batch's gradients into, added into the wider ones after it
  master,          // fp32 master weights of this rank's part (mixed precision)
  exp_avg,         // the optimizer's first moment (Adam, Lamb, SGD with momentum)
  exp_avg_sq,      // the optimizer's second moment (Adam, Lamb)
  block_grads,     // grouped: one transformer block's gradients (two with overlap_comm)
  outer_grads,     // grouped: the gradients of the parameters outside the blocks
  block_params,    // stage 3: one gathered block (two: the next one is prefetched)
  frozen_block_params,  // stage 3: a gathered block's frozen tensors (two, as block_params)
  outer_params,    // stage 3: the gathered parameters outside the blocks
  gather_staging,  // stage 3, staged gathers: every rank's partitions packed for a gather waited on at once
  prefetch_staging,  // stage 3, staged gathers: the same for the next block's gather, in flight while this block computes
  frozen_staging,  // stage 3, staged gathers of frozen tensors: a block's and the prefetched block's, packed
  reduce_staging,  // Gloo: the fp32 copy of the 16-bit gradient pieces in flight (the communicator's)
  reduce_cast,     // communication_data_type: the gradient pieces in flight cast to it (ZeroExecution::wire_dtype)
  reduce_scratch,  // grouped reduce-scatter: the other ranks' contributions to this rank's part of a group
  optimizer_swap,  // NVMe optimizer offload: host buffers sub-groups are swapped through
  param_swap,      // NVMe parameter offload: host buffers partitions are swapped through
  weights_staging,  // offload from a GPU: a tile of the host-stepped bf16 weights on its way to the device (WeightsBack::staged;
                    // two, taken in turn, where a span is stepped in several tiles or sub-groups)
  grads_arrival,    // gradients leaving a GPU block by block: the page-locked buffer a piece arrives in before it is
                    // added to the host's gradients (the largest piece's)
  block_arrivals,   // one rank's gradients leaving a GPU block by block with overlap_comm: the page-locked buffers a block's
                    // gradients land in whole, gradient_lag + 1 of them, taken in turn (ZeroExecution::gradient_lag)
  step_backup,      // the speculative step (ZeroExecution::step_in_backward): the fp32 master and each moment of the
                    // speculated tiles as they were before it, one copy per state, restored where the step is clipped or skipped
};
const char* buffer_role_name(BufferRole r);

struct ZeroBuffer {
  BufferRole role = BufferRole::params;
  Dtype dtype = Dtype::fp32;
  int64_t elements = 0;  // per copy
  int copies = 1;
  Place place = Place::device;
  MemoryCategory category = MemoryCategory::params;
  // Allocated by the communicator for each collective rather than held by the runtime's buffers.
  bool transient = false;
  // Page-locked host memory: a GPU copies to or from it (its copies then run beside compute without a bounce
  // through the driver's own buffer), as the offload block that put it there asks (pin_memory). The states the
  // host steps where they are never cross, and are not.
  bool pinned = false;
  double bytes() const { return static_cast<double>(elements) * copies * dtype_bytes(dtype); }
};

// Bytes one rank moves between places each optimizer step (offload).
struct Transfer {
  std::string what;
  Place from = Place::device, to = Place::host;
  double bytes_per_step = 0;
  // The optimizer's kernel writes these bytes where they go as it steps (bf16 weights on a CPU device, whose host
  // is its memory): no copy of their own, their time is the step's.
  bool written_in_step = false;
};

struct ZeroExecution {
  int stage = 0, world_size = 1;
  bool sharded = false;             // optimizer states partitioned: each rank steps its part
  bool grouped = false;             // gradients reduced per parameter group as backward finishes it
  bool gathers = false;             // stage 3: parameters partitioned, gathered before use
  bool overlap = false;             // reduces run while backward goes on (overlap_comm; stages 0-1: the step's last backward)
  bool widened = false;             // the model computes in a wider dtype than the weights are stored in
  // Stages 1-2 with overlap: the updated parameters' all-gather, issued after the optimizer, runs while the next
  // step's forward goes on, each block waiting only for the pieces that hold it (ZeroExchange's block hooks).
  bool gather_ahead = false;
  // ZeRO-Offload's host step during the next forward: where the host steps the states of a GPU's weights in tiles
  // (a staged span: one rank's whole part, or its first `ratio` with the rest on the device, stepped there at once),
  // it steps now only the tiles the forward reads before its first block
  // (once the step's norm and skip are known); each other tile is stepped just before the forward's first block
  // hook that reads it (weight_tile_hooks), its weights copied over, so the GPU runs the blocks before it while the host
  // steps it. Exact: every tile gets the same inputs as stepped at once. One rank's part only (stages 1-2 with
  // several ranks publish the updated shards to the others first).
  bool step_in_forward = false;
  // With step_in_forward, per weight tile the forward's block hook it is stepped before, in the forward's order: 2 l
  // before block l, 2 l + 1 after it; -1 for a tile beginning before the first trained block (stepped at once). A tile
  // is stepped where its first element is read (one past the blocks: after the last block). Empty otherwise.
  std::vector<int64_t> weight_tile_hooks;
  // ZeRO-Offload's speculative step (offload_optimizer.speculative_step), where a GPU's gradients leave block by
  // block for the host that steps its weights in staged tiles: on the step's last micro step, each tile whose
  // gradients are all final (every block it holds has finished its backward and reached the host) is stepped at once,
  // during the backward of the blocks below it, as if the step were neither clipped nor skipped, after its fp32
  // master and moments are copied to step_backup (where the step can be undone: speculation_backed_up). Once the
  // ranks agree on the norm: a step neither clipped nor skipped keeps them; a clipped one restores them and steps
  // them again with the clip; a skipped one restores them and puts their weights back from the master. Exact either way. Composes with step_in_forward (which takes the tiles not
  // speculated). A tile holding a parameter outside the blocks is final only after the backward: never speculated.
  bool step_in_backward = false;
  // With step_in_backward, per weight tile the block after whose gradients' arrival on the last micro step the tile is
  // final (the lowest block it holds), or -1 (not speculated). Empty otherwise.
  std::vector<int64_t> weight_tile_final_after;
  int64_t speculated_numel = 0;  // the elements of the tiles speculated (step_backup holds one copy per fp32 state)
  // Whether a speculated step can be undone: gradient_clipping may clip it, or an overflow skip it (fp16, bf16's
  // check_grad_overflow). Without either every speculated step stands (a step the data says trains nothing is not
  // speculated; a non-finite loss ends the run): no backup, nothing read or written beyond the step itself.
  bool speculation_backed_up = false;
  // One rank whose gradients leave a GPU block by block for page-locked host memory, with overlap_comm: each block's
  // gradients are queued for the host in its own block hook once the hook's sums are done (into the next of
  // block_arrivals' buffers, on the copy stream to the host, the copy waiting on the device only for the block's
  // backward) and the host sums them in the hook of the block
  // `gradient_lag` + 1 below, so the hook of the block just below, which autograd makes the GPU wait for, does not
  // wait for that copy. 0: no such buffers; each block's gradients are copied and summed at once in the hook of the
  // block below (several ranks: after the collective).
  int64_t gradient_lag = 0;
  // The run measures each step alone (RunSettings::steps_measured_alone) and that turned gather_ahead or
  // step_in_forward off: what ds plan says the profile changes.
  bool kept_within_step = false;
  // Gradients accumulate in a wider dtype than backward writes them in (data_types.grad_accum_dtype fp32 with
  // bf16 weights, DeepSpeed's BF16_Optimizer): stages 0-1 add each micro-batch's gradients from micro_grads into
  // the fp32 buffer after its backward; grouped stages add each reduced group into their fp32 part anyway.
  bool micro_grads = false;
  // The dtype gradients are reduced over ranks in: the buffer backward writes (a group's, grouped; the step's at
  // stages 0-1, the compute dtype where that is wider, fp32 where micro_grads adds into it).
  Dtype reduced_dtype = Dtype::fp32;
  // The dtype they cross ranks in: communication_data_type where it names one and a rank has others to sum
  // with, else reduced_dtype. Where the two differ, each piece in flight is cast to it (reduce_cast), reduced,
  // and this rank's sums are cast back into the gradients (DeepSpeed's cast before its all-reduce).
  Dtype wire_dtype = Dtype::fp32;
  CommBackend backend = CommBackend::gloo;  // CPU ranks: Gloo (no 16-bit all-reduce); GPUs: NCCL
  bool scatter = false;             // gradients reduce-scattered (stages 2-3; stage 1 too off Gloo), else all-reduced
  // Stage 3: gathers go through staging buffers, each rank's partitions packed: the stored dtype is not the
  // one the model computes in (CPU fp16), the partition is read from NVMe, or the collective takes equal
  // pieces (NCCL's all-gather). Otherwise (Gloo's point-to-point spans) every rank's partitions land
  // straight in the group buffers.
  bool gather_staged = false;
  int64_t full_numel = 0;           // elements of the whole-model buffers (padded from stage 1 on)
  int64_t local_numel = 0;          // elements this rank's optimizer steps (padding included)
  int64_t block_numel = 0, outer_numel = 0;  // grouped: the elements of a block, of the outer parameters
  int64_t whole_numel = 0;          // stage 3: elements kept whole on every rank
  int64_t offloaded_numel = 0;      // optimizer offload: the first this many local elements' states are offloaded
  int64_t gather_numel = 0;         // stage 3: the largest gather's packed elements (all ranks)
  int64_t prefetch_numel = 0;       // stage 3: the largest block gather's packed elements (all ranks)
  std::vector<int64_t> group_offset;  // grouped: per parameter, its place in its group's buffers
  std::vector<int64_t> whole_offset;  // stage 3: per parameter, its place in whole_params, or -1
  // Frozen tensors (LoRA's base, model.freeze; per tensor of the model). Stage 3 on several ranks partitions
  // those inside the blocks at or above the persistence threshold, as it does the trained ones: frozen_layout
  // lays them out alone (stage 3), frozen_params holds the ones kept whole, frozen_partitions this rank's
  // partitions, and a block's are gathered with it into frozen_block_params. Elsewhere every frozen tensor stays whole.
  FlatLayout frozen_layout;
  std::vector<int> frozen_slot;              // per tensor of the model: its index in frozen_layout.params, or -1
  std::vector<int64_t> frozen_offset;        // per tensor of the model, frozen and kept whole: its place in frozen_params; else -1
  std::vector<int64_t> frozen_group_offset;  // per frozen_layout parameter: its place in the frozen block buffer
  int64_t frozen_whole_numel = 0;            // frozen_params' elements: the frozen tensors kept whole
  int64_t frozen_block_numel = 0;            // the largest block's partitioned frozen elements, gathered
  bool frozen_staged = false;                // frozen gathers pack every rank's partitions (frozen_staging) first
  int64_t frozen_gather_numel = 0;           // ... the largest block's, every rank's partitions packed
  std::vector<ZeroBuffer> buffers;
  std::vector<Collective> collectives;  // empty on one rank
  std::vector<Transfer> transfers;      // empty without offload
  // NVMe optimizer offload: the sub-groups this rank's states are swapped in (each state's file holds them
  // one after another), the largest one's elements, and the buffer sets in flight at once.
  std::vector<SubGroup> sub_groups;
  int64_t sub_group_numel = 0;
  int swap_sets = 0;
  // Where the optimizer's states of this rank's part live, chosen here once: spans of the local elements in
  // order, each at one place. One span [0, local_numel) (the device, or the host/NVMe the optimizer is
  // offloaded to), or under offload_optimizer.ratio < 1 the offloaded [0, offloaded_numel) then the rest on
  // the device. The runtime walks them (optimizer_states.hpp) instead of asking which buffers exist.
  std::vector<StateSpan> state_spans;
  // A staged span (WeightsBack::staged, the host's states of a GPU run): the tiles it is stepped in, each tile's
  // bf16 weights written into a staging buffer and copied to the device while the next tile is stepped into the
  // other buffer. In memory: cut as NVMe's sub-groups are (at most sub_group_size elements, and at most
  // kMostStagingTile, on the kernels' grain; at most kMostWeightTiles tiles; Lamb's one, the span, each tensor
  // stepped whole). On NVMe: each sub-group's windows of at most that many (staging_windows), stepped from its
  // buffers once read in. Empty otherwise (and for Lamb on NVMe, which the plan refuses).
  std::vector<SubGroup> weight_tiles;
  // The tiles staged weights cross in: weight_tiles, else the sub-groups.
  const std::vector<SubGroup>& staged_tiles() const { return weight_tiles.empty() ? sub_groups : weight_tiles; }

  // The buffer of this role placed at `place`, or nullptr when the execution has none.
  const ZeroBuffer* find(BufferRole role, Place place = Place::device) const;
  const ZeroBuffer* find_anywhere(BufferRole role) const;  // the first of that role, wherever it lives
};

// Grouped stages: for each group, which elements of its gradient buffer (at `group_offset`) each rank
// owns, i.e. receives the sum of when the group is reduce-scattered.
std::vector<Ownership> group_ownerships(const FlatLayout& L, const std::vector<ParamGroup>& groups,
                                        const std::vector<int64_t>& group_offset);

// Describes the execution of a plan whose layout, zero knobs, precision, optimizer, batch and topology
// are resolved. Pure.
ZeroExecution describe_zero(const Plan& plan);
// The speculative step kept to the tiles final after one of `blocks`; the others are stepped after the backward as
// without speculation (the next forward steps them where step_in_forward). The backup shrinks with them; with none
// left, no speculation.
void limit_speculation(ZeroExecution& z, const std::set<int64_t>& blocks);
// gradient_lag set to `lag` (>= 1) where the plan lands blocks' gradients in block_arrivals (one buffer more than the lag).
void set_gradient_lag(ZeroExecution& z, int64_t lag);

}  // namespace ds
