#include "engine/plan/comm.hpp"

#include <algorithm>

namespace ds {

const char* collective_op_name(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::all_reduce: return "all_reduce";
    case CollectiveOp::reduce_scatter: return "reduce_scatter";
    case CollectiveOp::all_gather: return "all_gather";
  }
  return "?";
}

namespace {

Collective make(std::string what, CollectiveOp op, int64_t times_per_step, int64_t elements, int64_t bucket,
                int bytes, int world, const char* when) {
  Collective c;
  c.what = std::move(what);
  c.op = op;
  c.when = when;
  const int64_t calls = (elements + std::max<int64_t>(bucket, 1) - 1) / std::max<int64_t>(bucket, 1);
  c.calls_per_step = calls * times_per_step;
  c.elements_per_step = elements * times_per_step;
  c.dtype_bytes = bytes;
  c.payload_bytes_per_step = static_cast<double>(c.elements_per_step) * bytes;
  const double share = static_cast<double>(world - 1) / world;
  c.wire_bytes_per_rank_per_step = c.payload_bytes_per_step * (op == CollectiveOp::all_reduce ? 2 * share : share);
  return c;
}

}  // namespace

std::vector<Collective> plan_collectives(const CommInputs& in) {
  std::vector<Collective> out;
  const int W = in.world_size;
  if (W <= 1) return out;
  const int gb = dtype_bytes(in.comm_dtype), pb = dtype_bytes(in.param_dtype);
  const CollectiveOp grad_op = in.reduce_scatter ? CollectiveOp::reduce_scatter : CollectiveOp::all_reduce;
  switch (in.stage) {
    case 0:  // plain data parallel: accumulate locally, all-reduce once per step
      out.push_back(make("gradients", CollectiveOp::all_reduce, 1, in.numel, in.reduce_bucket_size, gb, W, "per step"));
      break;
    case 1:  // accumulate locally, reduce into the owner's partition, gather updated parameters
      out.push_back(make("gradients", grad_op, 1, in.numel, in.reduce_bucket_size, gb, W, "per step"));
      out.push_back(make("updated parameters", CollectiveOp::all_gather, 1, in.numel, in.allgather_bucket_size, pb, W, "per step"));
      break;
    case 2:  // reduce every micro step's gradients into the partition as backward produces them
      out.push_back(make("gradients", grad_op, in.grad_accum, in.numel, in.reduce_bucket_size, gb, W, "per micro step"));
      out.push_back(make("updated parameters", CollectiveOp::all_gather, 1, in.numel, in.allgather_bucket_size, pb, W, "per step"));
      break;
    case 3: {  // gather each block for forward and again for backward; reduce-scatter its gradients
      const int64_t block = in.model ? std::max<int64_t>(in.model->largest_block_params, 1) : 1;
      const int64_t partitioned = in.numel - in.persistent_numel;
      out.push_back(make("parameters (forward)", CollectiveOp::all_gather, in.grad_accum, partitioned, block, pb, W, "per micro step"));
      out.push_back(make("parameters (backward)", CollectiveOp::all_gather, in.grad_accum, partitioned, block, pb, W, "per micro step"));
      out.push_back(make("gradients", CollectiveOp::reduce_scatter, in.grad_accum, partitioned, block, gb, W, "per micro step"));
      if (in.persistent_numel > 0)
        out.push_back(make("gradients of persistent parameters", CollectiveOp::all_reduce, in.grad_accum,
                           in.persistent_numel, in.reduce_bucket_size, gb, W, "per micro step"));
      break;
    }
  }
  return out;
}

}  // namespace ds
