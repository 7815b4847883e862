// ds — the step's time, predicted from the plan: its model FLOPs at the GPU's peak rate times an MFU, and each
// collective's wire bytes (the plan's, exact) at its link's bus bandwidth (engine/plan/hardware.hpp), with the
// overlap the runtime carries out. Pure arithmetic over a compiled Plan; a prediction, labelled so wherever
// it is printed, and checked in the tests against hand computations.
//
// Per rank, one optimizer step:
//   compute   = (forward + backward + recompute FLOPs of its micro-batches, its share of the model)
//               / (peak x mfu), over (1 - bubble) with pipeline stages (stages assumed balanced);
//   a collective = wire bytes per rank / busbw + calls x the link's latency, on the link its group crosses:
//               within one node the GPUs' link, across nodes a ring per NIC: k of the group's ranks a node
//               give k x the network's rate per GPU, at most the node's link;
//   hidden    = what overlaps compute as ds runs it: with overlap_comm the gradient reductions run during
//               the backward that produces them (stages 0-1: the last micro step's; 2-3: every one's), stage 3's
//               gathers one block ahead of the forward or backward that needs them; each collective's first
//               call of a micro step (the first block's gather, the last bucket's reduce) cannot hide. The rest (the control
//               values, the updated parameters' all-gather, the tensor-parallel all-reduces, pipeline sends)
//               waits for compute, and compute for it;
//   offload   = each of the plan's transfers (ZeroExecution::transfers) at its resource's rate: between a GPU and its
//               host the host link (per GPU), to and from NVMe the drives' rate, and the optimizer's step on the
//               host its states streamed through the host's memory (per element: the fp32 gradient read, the
//               master and each moment read and written, the weight written); memory and drives are shared by a
//               node's ranks, and on a CPU device a "copy between places" is a memory copy (read and write). What
//               hides: one rank's gradients on their way to the host block by block, and the host's sum of them,
//               behind the blocks' backward (overlap_comm: each block's beside the next block's), stage 3's
//               parameters from page-locked host memory a block ahead (one rank), NVMe swaps
//               pipelined (pipeline_read/write) and staged weights' copies behind the host's step,
//               and where the host steps tiles during the next forward (step_in_forward) their share of its step,
//               up to the first micro step's forward; a speculative step (step_in_backward) its tiles' share of the
//               host's step and their backup, up to the last micro step's blocks' backward the gradients leave free;
//   step      = compute + communication - hidden + offload - its hidden part, and no shorter than the time the
//               host's memory is busy: every host-memory row in full (the optimizer's step, the sums, the backup) and
//               every byte a copy reads from or writes to it (the link's DMA, the drives) at its rate, whatever of
//               either hides behind compute (the copies and the host's work share that memory).
#pragma once

#include <algorithm>
#include <string>
#include <vector>

namespace ds {

struct Plan;

enum class StepPhase { forward, backward, between };  // what a collective can hide behind (between: nothing)
const char* step_phase_name(StepPhase p);

struct CollectiveTime {
  std::string what;      // a collective kind's name, or "tensor all-reduces", "pipeline sends", "tied embeddings"
  std::string link;      // "nvlink4 (within a node)", "ib-ndr (across nodes)"
  StepPhase phase = StepPhase::between;
  double seconds = 0;    // per step
  double hidden_s = 0;   // of which overlapped with compute
  double call_s = 0;     // of `seconds`, what each call pays whatever its size (the link's latency)
};

enum class OffloadResource { host_link, host_memory, nvme };

struct OffloadTime {
  std::string what;      // a transfer's name ("gradients to the optimizer"), or "optimizer step on the host"
  OffloadResource resource = OffloadResource::host_link;
  std::string rate;      // the resource and its rate as given: "pcie5 (50.0 GB/s a direction)"
  double bytes = 0;      // per step and rank
  double seconds = 0;    // 0 where the resource's rate is not known (`known`)
  double hidden_s = 0;   // of which overlapped (NVMe swaps behind the host's step; the host's step behind the forward)
  bool known = true;
};
const char* offload_resource_name(OffloadResource r);

struct StepTime {
  bool compute_known = false;  // the device's peak rate is known (--gpu or a detected GPU ds knows)
  bool comm_known = false;     // every link a collective crosses is known (or nothing crosses one)
  std::vector<std::string> missing;  // what the prediction lacks, each naming the flag that gives it
  std::string rate_source;     // "0.45 x H100 SXM 80GB's 989.4 TFLOP/s bf16/fp16 (an assumed share: ...)"
  double peak_flops = 0;       // per rank, in the compute dtype
  double compute_s = 0;        // per step and rank, the bubble included
  double bubble_s = 0;         // of which the pipeline's idle share
  double forward_s = 0, backward_s = 0;  // the compute windows collectives hide behind (backward with recompute)
  double comm_s = 0;           // every collective's seconds
  double hidden_s = 0;         // of which hidden behind compute
  std::vector<CollectiveTime> collectives;  // the plan's collectives in order, then the mesh's
  std::vector<OffloadTime> offload;         // the plan's transfers in order, then the host's optimizer step
  double offload_s = 0, offload_hidden_s = 0;  // the known rows'
  // The host memory's busy time a step: its rows' seconds in full, and the bytes the other rows' copies read from
  // or write to it (`host_memory_copied_bytes`) at its rate. A floor under the step; 0 where a rate is not known.
  double host_memory_busy_s = 0, host_memory_copied_bytes = 0;
  bool offload_known() const;                   // every row's rate is known
  double offload_seconds(OffloadResource r) const;  // its rows' exposed seconds
  // Everything the step needs is known: compute, every link, and nothing the model leaves out (offload).
  bool step_known() const { return compute_known && comm_known && missing.empty(); }
  double exposed_s() const { return comm_s - hidden_s; }
  double parts_s() const { return compute_s + exposed_s() + offload_s - offload_hidden_s; }  // one after the other
  double step_s() const { return std::max(parts_s(), host_memory_busy_s); }  // all known
  bool host_memory_floored() const { return host_memory_busy_s > parts_s(); }  // its busy time sets the step
  // What the step waits on most: "compute-bound", "communication-bound" (its collectives before any overlap), or
  // with offload "host-link-bound", "host-memory-bound", "nvme-bound" (the resource whose exposed time is longest;
  // host memory also where its busy time sets the step).
  // The share of the peak the predicted step reaches, from the model FLOPs one rank does (recomputation not counted).
  double mfu(double train_flops_per_rank) const { return train_flops_per_rank / step_s() / peak_flops; }
  const char* bound() const;
};

StepTime predict_step_time(const Plan& plan);

// One rank whose reduced gradients live on the host and arrive there in their reduced dtype (ZeRO-Offload from
// stage 2): the blocks' gradients can leave group by group during the backward, which overlap_comm turns on. The
// step's prediction hides them behind the backward where overlap_comm is set; ds plan suggests it where it is not.
bool gradients_can_leave_during_backward(const Plan& plan);

// The host's work in the step's last backward in the order the prediction walks it (such a rank with overlap_comm):
// each trained block's gradients summed, each tile the speculative step takes stepped, with the block whose backward
// hook runs it (-1: after the backward). ds profile's spans of that backward (HostWorkSpan) come in this order.
struct BackwardHostWork {
  bool tile = false;   // a speculated tile stepped, else a block's gradients summed
  int64_t index = -1;  // the tile (ZeroExecution::weight_tiles), or the block
  int64_t hook = -1;
};
std::vector<BackwardHostWork> host_work_in_last_backward(const Plan& plan);

}  // namespace ds
