#include "engine/plan/comm.hpp"

#include <algorithm>

#include "common/error.hpp"

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

Collective make(std::string what, CollectiveOp op, const char* when, int64_t times, int64_t calls, int64_t elements,
                int bytes, int world) {
  Collective c;
  c.what = std::move(what);
  c.op = op;
  c.when = when;
  c.calls_per_step = calls * times;
  c.elements_per_step = elements * times;
  c.dtype_bytes = bytes;
  c.payload_bytes_per_step = static_cast<double>(c.elements_per_step) * bytes;
  const double share = static_cast<double>(world - 1) / world;
  c.wire_bytes_per_rank_per_step = c.payload_bytes_per_step * (op == CollectiveOp::all_reduce ? 2 * share : share);
  return c;
}

}  // namespace

std::vector<Collective> plan_collectives(const CommInputs& in) {
  DS_CHECK(in.layout != nullptr);
  const FlatLayout& L = *in.layout;
  std::vector<Collective> out;
  const int W = L.world_size;
  if (W <= 1) return out;
  const int pb = dtype_bytes(in.param_dtype);
  // Gloo reduces 16-bit floats through an fp32 copy.
  const int gb = in.gloo ? std::max(4, dtype_bytes(in.comm_dtype)) : dtype_bytes(in.comm_dtype);
  const bool scatter = in.reduce_scatter && !in.gloo;
  const CollectiveOp grad_op = scatter ? CollectiveOp::reduce_scatter : CollectiveOp::all_reduce;
  const char* grad_note = scatter ? "" : in.gloo ? "as all_reduce: Gloo has no reduce_scatter; each rank keeps its part"
                                                 : "as all_reduce: zero_optimization.reduce_scatter is false";
  const auto groups = parameter_groups(L);

  out.push_back(make(kControlCollective, CollectiveOp::all_reduce, "per step", 1, 1, 3, 8, W));
  if (in.per_tensor_norms && L.stage >= 1)
    out.push_back(make(kLambNormsCollective, CollectiveOp::all_reduce, "per step", 1, 1,
                       2 * static_cast<int64_t>(L.params.size()), 8, W));
  // Parameters are gathered with an all-gather, or on Gloo by an all-reduce of their bits.
  const CollectiveOp gather_op = in.gloo ? CollectiveOp::all_reduce : CollectiveOp::all_gather;
  auto gather = [&](const char* what, const char* when, int64_t times, int64_t calls, int64_t elements) {
    Collective c = make(what, gather_op, when, times, calls, elements, pb, W);
    if (in.gloo) c.note = "an all-gather as an all_reduce of raw bits: Gloo's all-gather is 3x slower";
    out.push_back(c);
  };
  auto gather_updated = [&] {
    gather("updated parameters", "per step", 1, calls_for(L.padded_numel, in.allgather_bucket_size), L.padded_numel);
  };
  // Stages 2-3: every group's gradients as backward finishes it, in reduce-bucket pieces.
  auto grads_per_group = [&] {
    int64_t calls = 0;
    for (const auto& g : groups) calls += calls_for(g.numel, in.reduce_bucket_size);
    Collective c = make("gradients", grad_op, "per micro step", in.grad_accum, calls, L.numel, gb, W);
    c.note = grad_note;
    out.push_back(c);
  };
  switch (L.stage) {
    case 0: {  // accumulate locally, all-reduce once per step
      Collective c = make("gradients", CollectiveOp::all_reduce, "per step", 1, calls_for(L.numel, in.reduce_bucket_size),
                          L.numel, gb, W);
      out.push_back(c);
      break;
    }
    case 1: {  // accumulate locally, reduce into the owners' partitions, gather the updated parameters
      Collective c = make("gradients", grad_op, "per step", 1, calls_for(L.padded_numel, in.reduce_bucket_size),
                          L.padded_numel, gb, W);
      c.note = grad_note;
      out.push_back(c);
      gather_updated();
      break;
    }
    case 2:
      grads_per_group();
      gather_updated();
      break;
    case 3: {
      // Each group's partitioned parameters are gathered before its forward; the blocks again before
      // their backward (the parameters outside the blocks stay gathered through the micro step).
      int64_t fwd_calls = 0, fwd_elements = 0, bwd_calls = 0, bwd_elements = 0, whole = 0;
      for (const auto& g : groups) {
        int64_t n = 0;
        for (int i : g.params) {
          const ParamSlot& p = L.params[static_cast<size_t>(i)];
          if (stays_whole(p, in.persistence_threshold))
            whole += p.partition_numel;
          else
            n += p.partition_numel;
        }
        if (n == 0) continue;
        ++fwd_calls;
        fwd_elements += n * W;
        if (g.layer >= 0) {
          ++bwd_calls;
          bwd_elements += n * W;
        }
      }
      gather("parameters (forward)", "per micro step", in.grad_accum, fwd_calls, fwd_elements);
      gather("parameters (backward)", "per micro step", in.grad_accum, bwd_calls, bwd_elements);
      grads_per_group();
      if (whole > 0) gather("parameters kept whole", "per step", 1, 1, whole * W);
      break;
    }
  }
  return out;
}

}  // namespace ds
