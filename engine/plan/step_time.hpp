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
//   step      = compute + communication - hidden.
#pragma once

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
};

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
  // Everything the step needs is known: compute, every link, and nothing the model leaves out (offload).
  bool step_known() const { return compute_known && comm_known && missing.empty(); }
  double exposed_s() const { return comm_s - hidden_s; }
  double step_s() const { return compute_s + exposed_s(); }  // both known
  // "compute-bound" or "communication-bound": which of the two is longer before any overlap.
  // The share of the peak the predicted step reaches, from the model FLOPs one rank does (recomputation not counted).
  double mfu(double train_flops_per_rank) const { return train_flops_per_rank / step_s() / peak_flops; }
  const char* bound() const { return comm_s > compute_s ? "communication-bound" : "compute-bound"; }
};

StepTime predict_step_time(const Plan& plan);

}  // namespace ds
