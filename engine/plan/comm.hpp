// ds — the collectives one optimizer step issues, with their sizes. Wire bytes per rank assume ring
// algorithms: all-reduce moves 2(W-1)/W of the payload, reduce-scatter and all-gather (W-1)/W.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/plan/model_spec.hpp"
#include "schema/config.hpp"

namespace ds {

enum class CollectiveOp { all_reduce, reduce_scatter, all_gather };
const char* collective_op_name(CollectiveOp op);

struct Collective {
  std::string what;            // "gradients", "parameters (forward)", ...
  CollectiveOp op = CollectiveOp::all_reduce;
  std::string when;            // "per step" | "per micro step"
  int64_t calls_per_step = 0;  // bucketed calls
  int64_t elements_per_step = 0;
  int dtype_bytes = 0;
  double payload_bytes_per_step = 0;
  double wire_bytes_per_rank_per_step = 0;
};

struct CommInputs {
  const ModelSpec* model = nullptr;
  int stage = 0;
  int world_size = 1;
  int64_t grad_accum = 1;
  int64_t numel = 0;             // padded flat size (stages 0-2) or sum of partitions x W (stage 3)
  int64_t persistent_numel = 0;  // stage 3: elements kept whole (their gradients are all-reduced)
  Dtype param_dtype = Dtype::fp32, comm_dtype = Dtype::fp32;
  int64_t reduce_bucket_size = 1, allgather_bucket_size = 1;
  bool reduce_scatter = true;
};

// Empty for a single rank: nothing crosses a wire.
std::vector<Collective> plan_collectives(const CommInputs& in);

}  // namespace ds
