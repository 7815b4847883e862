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

#include "engine/plan/layout.hpp"
#include "engine/plan/model_spec.hpp"
#include "schema/config.hpp"

namespace ds {

enum class CollectiveOp { all_reduce, reduce_scatter, all_gather };
const char* collective_op_name(CollectiveOp op);

struct Collective {
  std::string what;            // "gradients", "parameters (forward)", ...: the runtime counts under this name
  CollectiveOp op = CollectiveOp::all_reduce;
  std::string when;            // "per step" | "per micro step"
  int64_t calls_per_step = 0;  // bucketed calls
  int64_t elements_per_step = 0;  // all-gather: the gathered (output) elements
  int dtype_bytes = 0;
  double payload_bytes_per_step = 0;
  double wire_bytes_per_rank_per_step = 0;
  std::string note;            // e.g. why a reduce-scatter runs as an all-reduce
};

struct CommInputs {
  const FlatLayout* layout = nullptr;
  int64_t grad_accum = 1;
  int64_t persistence_threshold = 0;  // stage 3: parameters below it stay whole
  Dtype param_dtype = Dtype::fp32, comm_dtype = Dtype::fp32;
  int64_t reduce_bucket_size = 1, allgather_bucket_size = 1;
  bool reduce_scatter = true;  // zero_optimization.reduce_scatter
  bool gloo = true;            // CPU ranks: no reduce-scatter, no 16-bit reductions
  bool per_tensor_norms = false;  // Lamb: each tensor's ||w|| and ||u|| summed over its parts
};

// Empty for a single rank: nothing crosses a wire.
std::vector<Collective> plan_collectives(const CommInputs& in);

// The names the runtime and the plan share.
inline constexpr const char* kControlCollective = "loss, norm and stop flag";
inline constexpr const char* kLambNormsCollective = "Lamb tensor norms";

// Elements per reduction call: a group's gradients go in pieces of at most the reduce bucket.
inline int64_t calls_for(int64_t elements, int64_t bucket) {
  const int64_t b = bucket > 0 ? bucket : 1;
  return (elements + b - 1) / b;
}

}  // namespace ds
