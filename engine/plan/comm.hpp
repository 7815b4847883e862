// ds — the collectives one optimizer step issues, with their sizes: exactly the calls the runtime
// makes (engine/runtime/zero.cpp), so `ds train` can report bytes sent beside this prediction.
// Wire bytes per rank assume ring algorithms: all-reduce moves 2(W-1)/W of the payload, reduce-scatter
// and all-gather (W-1)/W. Gloo (CPU ranks) has no reduce-scatter in LibTorch 1.13 and cannot reduce
// 16-bit floats: there gradients are all-reduced in fp32 and each rank keeps its part. Its all-gather is
// slow (a third of its all-reduce's rate here), so on Gloo parameters are gathered by summing their raw
// bits (every element nonzero on one rank only): an all-reduce, twice the bytes, a third of the time.
#pragma once

#include <cstdint>
#include <string>
#include <vector>


namespace ds {

enum class CollectiveOp { all_reduce, reduce_scatter, all_gather };
const char* collective_op_name(CollectiveOp op);

// What a collective carries: the plan lists them, the runtime issues and counts them under the same kind,
// and collective_name is the one place their names are spelled.
enum class CollectiveKind {
  control,                // the mean loss, the gradient norm and the stop flag, agreed each step
  lamb_norms,             // Lamb: each tensor's ||w|| and ||u|| summed over its parts
  gradients,              // the gradient reduction
  updated_parameters,     // stages 1-2: every rank's updated part, after the optimizer
  parameters_forward,     // stage 3: a block gathered before its forward
  parameters_outer,       // stage 3: the parameters outside the blocks, before a step's first forward
  parameters_backward,    // stage 3: a block gathered again before its backward
  parameters_whole,       // stage 3: the parameters kept whole, after the optimizer
  parameters_validation,  // stage 3: gathers for validation (not part of a training step)
};
const char* collective_name(CollectiveKind kind);

struct Collective {
  CollectiveKind kind = CollectiveKind::gradients;
  CollectiveOp op = CollectiveOp::all_reduce;
  std::string when;            // "per step" | "per micro step"
  int64_t calls_per_step = 0;  // bucketed calls
  int64_t elements_per_step = 0;  // all-gather: the gathered (output) elements
  int dtype_bytes = 0;
  double payload_bytes_per_step = 0;
  double wire_bytes_per_rank_per_step = 0;
  std::string note;            // e.g. why a reduce-scatter runs as an all-reduce
  const char* what() const { return collective_name(kind); }
};

struct Plan;
struct ZeroExecution;
// The collectives one optimizer step of this plan issues, for the execution's flags. Empty for a
// single rank: nothing crosses a wire.
std::vector<Collective> plan_collectives(const Plan& plan, const ZeroExecution& zero);

// Wire bytes one rank sends for a payload (ring algorithms).
double wire_bytes_per_rank(CollectiveOp op, double payload_bytes, int world_size);

// Elements per reduction call: a group's gradients go in pieces of at most the reduce bucket.
inline int64_t calls_for(int64_t elements, int64_t bucket) {
  const int64_t b = bucket > 0 ? bucket : 1;
  return (elements + b - 1) / b;
}

}  // namespace ds
