// ds — the model's parameters as flat buffers: exactly the buffers of the plan's ZeRO execution
// (engine/plan/zero_plan.hpp) for this rank, in state_dict order at the FlatLayout's offsets, carved from
// one allocation per dtype. Every parameter tensor and its .grad are views into them, so autograd
// accumulates gradients straight into a flat buffer and the fused optimizer steps the rank's part in
// one pass.
//   params  parameter dtype: the weights as stored. Stages 0-2: the whole model (padded); stage 3:
//           this rank's partition (the layout's concatenated per-parameter partitions).
//   grads   gradient dtype. Stages 0-1: the whole model; stages 2-3: this rank's part only.
//   compute, compute_grads: what forward reads and backward accumulates into (stages 0-1; at stages
//           2-3 compute_grads holds this rank's reduced part). They alias params/grads except for fp16 on
//           the CPU (no fp16 kernels there): the model computes in an fp32 copy (none at stage 3, where it
//           reads gathered fp32 buffers) and its gradients are rounded into the fp16 `grads` each step,
//           so overflow is real.
//   states  per span of the plan's state_spans (where the optimizer's states live): the fp32 master of the
//           span's elements (aliases params in fp32 runs unless the states or the parameters are offloaded)
//           and the moments the plan counts; a span on NVMe has none here (the swapper's buffers)
//   micro_grads: stages 0-1 with gradients accumulated in fp32 over bf16 weights (data_types.grad_accum_dtype):
//           what backward writes one micro-batch's gradients into (bf16), added into compute_grads (= grads, fp32)
//           and zeroed after each micro-batch (ZeroExchange)
//   local_params, local_grads: this rank's part of params and grads, what the optimizer reads and writes
// ZeRO stages 2-3 on several ranks: backward accumulates into one parameter group's buffer at a time
// (block_grads: a transformer block; outer_grads: the parameters outside the blocks), reduced into
// grads as soon as the group is done (with overlap_comm, while backward goes on: two block buffers). Stage 3 gathers a group's parameters into group_params before use
// (two block buffers: the next block is prefetched), in place, or when the plan stages its gathers
// through gather_staging (every rank's partitions packed: [0] for a gather waited on at once, [1] for
// the prefetch); parameters below the persistence
// threshold live whole in whole_params, refreshed once per step. A group's reduce-scatter receives the
// other ranks' contributions to this rank's part into reduce_scratch.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "engine/plan/plan.hpp"
#include "engine/runtime/device/device.hpp"

namespace ds {

struct FlatParams {
  torch::Tensor params, grads, compute, compute_grads, micro_grads;
  torch::Tensor local_params, local_grads;
  // The optimizer's states by where they live: `spans` are the plan's state_spans (local elements at a place,
  // in order), `states` their buffers (undefined for a span on NVMe). optimizer_states.hpp walks them.
  struct States {
    torch::Tensor master, exp_avg, exp_avg_sq;
  };
  std::vector<StateSpan> spans;
  std::vector<States> states;
  // Optimizer offload: an fp32 copy of an offloaded span's reduced gradients (of one NVMe sub-group's at a
  // time), beside its states.
  torch::Tensor offload_grads;
  // Offload from a GPU (WeightsBack::staged): the page-locked buffers the host's kernel writes a tile's bf16 weights
  // into as it steps it, copied to the device from there (the second undefined where one suffices), and the tiles
  // a staged span is stepped in (the plan's weight_tiles: of a span in memory, or each NVMe sub-group's windows).
  torch::Tensor weights_staging[2];
  // Gradients leaving the device block by block: the page-locked buffer each piece arrives in (grads_arrival).
  torch::Tensor grads_arrival;
  // ... and, one rank's with overlap_comm, those a whole block's land in, taken in turn (ZeroExecution::gradient_lag).
  std::vector<torch::Tensor> block_arrivals;
  // The speculative step (ZeroExecution::step_in_backward): the speculated tiles' master and moments as they were,
  // one buffer per fp32 state the host span has (in the order master, exp_avg, exp_avg_sq; the rest undefined).
  torch::Tensor step_backup[3];
  std::vector<SubGroup> weight_tiles;
  int rank = 0;
  bool grouped = false;  // stages 2-3 on several ranks: gradients go through group buffers
  bool widened = false;  // the model computes in a wider copy of the stored weights (CPU fp16)
  bool params_swapped = false;  // stage 3: the partition is on NVMe (params, local_params undefined here)
  Place params_place = Place::device;  // where `params` lives: the host under offload_param (NVMe: its buffers' host)
  Place grads_place = Place::device;   // where `grads` lives: the host when each block's gradients leave (ZeRO-Offload on a GPU)
  // grouped: a block's gradients (block l in [l % 2] when their reduce overlaps the next block's
  // backward, overlap_comm; else all in [0]), the outer parameters'
  torch::Tensor block_grads[2], outer_grads;
  bool overlap = false;  // grouped and overlap_comm: gradient reduces run while backward goes on
  torch::Tensor block_params[2], outer_params;   // stage 3: gathered parameters (block l in [l % 2])
  torch::Tensor whole_params;                    // stage 3: parameters kept whole
  torch::Tensor gather_staging[2];               // stage 3: packed partitions of a gather ([1]: the prefetch's)
  torch::Tensor reduce_scratch;                  // grouped reduce-scatter: the other ranks' contributions to this rank's part
  std::vector<int64_t> group_offset;  // grouped: per parameter, where it sits in its group's buffers
  std::vector<int64_t> whole_offset;  // stage 3: per parameter, its place in whole_params or -1
  std::vector<OwnedSegment> owned;    // what this rank steps and checkpoints
  std::vector<torch::Tensor> views;   // one per ParamSlot, requires_grad, .grad set to a view of a gradient buffer
  std::vector<std::string> names;
  // The frozen tensors (LoRA's base, model.freeze) in the compute dtype (the plan's frozen_params buffer), and
  // a view per frozen tensor in state_dict order (no gradient). Undefined / empty when nothing is frozen.
  // Stage 3 on several ranks (ZeroExecution::frozen_layout): `frozen` holds the ones kept whole and
  // frozen_partitions (its own buffer, on the host with offload_param) this rank's partitions of the others,
  // whose views are into frozen_block_params (block l in [l % 2]), gathered there as their block runs (packed
  // through frozen_staging when the plan stages).
  torch::Tensor frozen, frozen_partitions;
  torch::Tensor frozen_block_params[2], frozen_staging[2];
  std::vector<torch::Tensor> frozen_views;
  std::vector<std::string> frozen_names;
  std::vector<torch::Tensor> arenas;  // one allocation per dtype and place; the buffers above are tensors over them
  Device* device = nullptr;           // what allocated them, and the kernels and copies that reach them

  // Allocates the plan's execution's buffers, as rank `rank` holds them, on `device` (borrowed).
  static FlatParams allocate(const Plan& plan, int rank, Device& device);
  const torch::Tensor& operator[](size_t i) const { return views[i]; }

  static float* data_or_null(const torch::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

  // Bytes held, by the plan's categories (model states, then the buffers ZeRO works through).
  struct Bytes {
    double params = 0, grads = 0, optimizer_states = 0, buffers = 0;
  };
  Bytes bytes() const;
};

// Hands the parameter views to a model in layout order, checking each name ends as the model expects
// (a mismatch is a bug: the model and ModelSpec disagree on the state_dict order).
class ParamCursor {
 public:
  // `from`: the first view to hand out (views.size(): none).
  ParamCursor(const std::vector<torch::Tensor>& views, const std::vector<std::string>& names, size_t from = 0)
      : views_(&views), names_(&names), i_(from) {}
  explicit ParamCursor(const FlatParams& params) : ParamCursor(params.views, params.names) {}
  const torch::Tensor& next(const std::string& suffix);
  bool done() const { return i_ == views_->size(); }

 private:
  const std::vector<torch::Tensor>* views_;
  const std::vector<std::string>* names_;
  size_t i_ = 0;
};

}  // namespace ds
