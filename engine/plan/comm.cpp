#include "engine/plan/comm.hpp"

#include <algorithm>

#include "common/error.hpp"
#include "engine/plan/plan.hpp"

namespace ds {

const char* collective_op_name(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::all_reduce: return "all_reduce";
    case CollectiveOp::reduce_scatter: return "reduce_scatter";
    case CollectiveOp::all_gather: return "all_gather";
    case CollectiveOp::send: return "send";
  }
  return "?";
}

const char* cadence_name(Cadence c) { return c == Cadence::per_micro_step ? "per micro step" : "per step"; }

const char* collective_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::control: return "loss, norm and stop flag";
    case CollectiveKind::lamb_norms: return "Lamb tensor norms";
    case CollectiveKind::lamb_norms_tensor: return "Lamb tensor norms (tensor group)";
    case CollectiveKind::gradients: return "gradients";
    case CollectiveKind::updated_parameters: return "updated parameters";
    case CollectiveKind::parameters_forward: return "parameters (forward)";
    case CollectiveKind::parameters_outer: return "parameters outside the blocks";
    case CollectiveKind::parameters_backward: return "parameters (backward)";
    case CollectiveKind::parameters_whole: return "parameters kept whole";
    case CollectiveKind::frozen_parameters: return "frozen parameters (each pass)";
    case CollectiveKind::parameters_validation: return "parameters (validation)";
    case CollectiveKind::validation_loss: return "validation loss";
    case CollectiveKind::tensor_activations: return "tensor-parallel activations";
    case CollectiveKind::pipeline_activations: return "pipeline activations";
    case CollectiveKind::pipeline_gradients: return "pipeline activations' gradients";
    case CollectiveKind::tied_embedding: return "tied embedding (gradient in, weights back)";
  }
  return "?";
}

const char* comm_backend_name(CommBackend backend) { return backend == CommBackend::gloo ? "gloo" : "nccl"; }

CommCapabilities comm_capabilities(CommBackend backend) {
  CommCapabilities c;
  switch (backend) {
    case CommBackend::gloo:  // LibTorch 1.13's: no reduce-scatter, no 16-bit sums; ds sends spans point to point
      c.gathers_into_spans = true;
      break;
    case CommBackend::nccl:  // ncclReduceScatter and ncclAllGather over equal pieces, bf16/fp16 sums
      c.native_reduce_scatter = true;
      c.sums_16bit = true;
      break;
  }
  return c;
}

std::optional<EqualPieces> equal_pieces(const Ownership& owners, int world) {
  if (world < 1 || owners.size() != static_cast<size_t>(world) || owners[0].size() != 1) return std::nullopt;
  const EqualPieces p{owners[0][0].offset, owners[0][0].numel};
  for (size_t q = 0; q < owners.size(); ++q)
    if (owners[q].size() != 1 || owners[q][0].numel != p.size || owners[q][0].offset != p.first + static_cast<int64_t>(q) * p.size)
      return std::nullopt;
  return p;
}

int64_t span_elements(const std::vector<Span>& spans) {
  int64_t n = 0;
  for (const Span& s : spans) n += s.numel;
  return n;
}

Ownership clip(const Ownership& owners, int64_t at, int64_t n) {
  Ownership out(owners.size());
  for (size_t q = 0; q < owners.size(); ++q)
    for (const Span& s : owners[q]) {
      const int64_t b = std::max(s.offset, at), e = std::min(s.offset + s.numel, at + n);
      if (e > b) out[q].push_back({b - at, e - b});
    }
  return out;
}

double wire_bytes_per_rank(CollectiveOp op, double payload_bytes, int world_size) {
  if (op == CollectiveOp::send) return payload_bytes;  // to one rank, whole
  const double share = static_cast<double>(world_size - 1) / world_size;
  return payload_bytes * (op == CollectiveOp::all_reduce ? 2 * share : share);
}

namespace {

Collective make(CollectiveKind kind, CollectiveOp op, Cadence when, int64_t times, int64_t calls, int64_t elements,
                int bytes, int world) {
  Collective c;
  c.kind = kind;
  c.op = op;
  c.when = when;
  c.calls_per_step = calls * times;
  c.elements_per_step = elements * times;
  c.dtype_bytes = bytes;
  c.payload_bytes_per_step = static_cast<double>(c.elements_per_step) * bytes;
  c.wire_bytes_per_rank_per_step = wire_bytes_per_rank(op, c.payload_bytes_per_step, world);
  return c;
}

}  // namespace

namespace {

void add_gather(std::vector<Collective>& out, CollectiveKind kind, Cadence when, int64_t times, int64_t calls, int64_t elements,
                int dtype_bytes, int world) {
  if (calls == 0) return;  // e.g. stage 3 with every parameter kept whole: no block is gathered
  out.push_back(make(kind, CollectiveOp::all_gather, when, times, calls, elements, dtype_bytes, world));
}

// Gradients travel in their wire dtype (ZeroExecution::wire_dtype: as held, or communication_data_type's),
// except that Gloo's all-reduce sums 16-bit floats through an fp32 copy.
int gradient_element_bytes(const ZeroExecution& z) {
  return comm_capabilities(z.backend).sums_16bit || z.scatter ? dtype_bytes(z.wire_dtype) : 4;
}

// Stages 0-1 reduce the whole gradient once per step, in reduce-bucket pieces; with overlap_comm each
// block's range as the last backward finishes it, then the ranges outside the blocks.
int64_t whole_gradient_calls(const FlatLayout& L, const ZeroExecution& z, int64_t bucket) {
  return static_cast<int64_t>(bucket_pieces(z.full_numel, bucket, z.overlap && !z.grouped ? block_ranges(L) : Pieces{}).size());
}

// The gradients' reduction at stages 1-3: stage 1 accumulates locally and reduces into the owners'
// partitions once; stages 2-3 reduce every group's gradients as backward finishes it, in reduce-bucket
// pieces (reduce-scattered: point to point on Gloo, in their own dtype; stage 1 on Gloo all-reduces, see
// ZeroExecution::scatter).
Collective sharded_gradients(const Plan& plan, const ZeroExecution& z, int64_t whole_calls) {
  const FlatLayout& L = plan.layout;
  const ResolvedZero& knobs = plan.zero;
  const int W = z.world_size;
  const bool scatter = z.scatter;
  const CollectiveOp grad_op = scatter ? CollectiveOp::reduce_scatter : CollectiveOp::all_reduce;
  const int gb = gradient_element_bytes(z);
  int64_t grad_calls = whole_calls;
  if (z.grouped) {
    grad_calls = 0;
    for (const auto& g : parameter_groups(L)) grad_calls += calls_for(g.numel, knobs.reduce_bucket_size);
  }
  Collective grads = z.grouped ? make(CollectiveKind::gradients, grad_op, Cadence::per_micro_step, std::max<int64_t>(1, plan.batch.grad_accum),
                                      grad_calls, L.numel, gb, W)
                               : make(CollectiveKind::gradients, grad_op, Cadence::per_step, 1, grad_calls, z.full_numel, gb, W);
  grads.note = scatter ? ""
               : !knobs.reduce_scatter
                   ? "as all_reduce: zero_optimization.reduce_scatter is false"
                   : "as all_reduce: stage 1 on Gloo keeps its memory (a reduce-scatter needs a shard-sized receive buffer)";
  return grads;
}

// Stage 3: each block's partitioned parameters are gathered before its forward and again before its
// backward (two buffers serve all blocks); the parameters outside the blocks have a buffer of their own
// and are gathered once a step, before its first forward: they change only in the optimizer. A staged
// gather carries every rank's padded partitions; one in place only the real elements. A block's
// partitioned frozen tensors go with it, in the compute dtype they are held in. Returns the elements of
// the parameters kept whole, gathered once a step after the optimizer.
int64_t add_stage3_gathers(const Plan& plan, const ZeroExecution& z, std::vector<Collective>& out) {
  const FlatLayout& L = plan.layout;
  const int W = z.world_size;
  const int64_t grad_accum = std::max<int64_t>(1, plan.batch.grad_accum);
  const int pb = dtype_bytes(plan.precision.param_dtype);
  const auto carried = [&](const ParamSlot& p) { return z.gather_staged ? p.partition_numel * W : p.numel; };
  int64_t fwd_calls = 0, fwd_elements = 0, bwd_calls = 0, bwd_elements = 0, outer = 0, whole = 0;
  for (const auto& g : parameter_groups(L)) {
    int64_t n = 0;
    for (int i : g.params) {
      const ParamSlot& p = L.params[static_cast<size_t>(i)];
      if (z.whole_offset[static_cast<size_t>(i)] >= 0)
        whole += carried(p);
      else
        n += carried(p);
    }
    if (n == 0) continue;
    if (g.layer < 0) {
      outer = n;
      continue;
    }
    ++fwd_calls;
    fwd_elements += n;
    ++bwd_calls;
    bwd_elements += n;
  }
  add_gather(out, CollectiveKind::parameters_outer, Cadence::per_step, 1, outer > 0 ? 1 : 0, outer, pb, W);
  add_gather(out, CollectiveKind::parameters_forward, Cadence::per_micro_step, grad_accum, fwd_calls, fwd_elements, pb, W);
  add_gather(out, CollectiveKind::parameters_backward, Cadence::per_micro_step, grad_accum, bwd_calls, bwd_elements, pb, W);
  int64_t frozen_calls = 0, frozen_elements = 0;
  for (const ParamGroup& g : parameter_groups(z.frozen_layout)) {
    if (g.params.empty()) continue;  // a block with nothing frozen in it (parameter_groups keeps its place)
    const int passes = g.layer >= 0 && g.layer < plan.backward_from ? 1 : 2;  // a block below every trained one: forward only
    frozen_calls += passes;
    for (int k : g.params) {
      const ParamSlot& p = z.frozen_layout.params[static_cast<size_t>(k)];
      frozen_elements += passes * (z.frozen_staged ? p.partition_numel * W : p.numel);
    }
  }
  if (frozen_calls > 0)
    out.push_back(make(CollectiveKind::frozen_parameters, CollectiveOp::all_gather, Cadence::per_micro_step, grad_accum, frozen_calls,
                       frozen_elements, dtype_bytes(plan.precision.compute_dtype), W));
  return whole;
}

}  // namespace

Collective control_collective(int world_size) {
  return make(CollectiveKind::control, CollectiveOp::all_reduce, Cadence::per_step, 1, 1, 3, 8, world_size);
}

Pieces bucket_pieces(int64_t numel, int64_t bucket, const Pieces& blocks) {
  const int64_t most = std::max<int64_t>(1, bucket);
  Pieces out;
  const auto cut = [&](int64_t begin, int64_t end) {
    for (int64_t at = begin; at < end; at += most) out.emplace_back(at, std::min(end, at + most));
  };
  int64_t at = 0;
  for (const auto& [begin, end] : blocks) {
    DS_CHECK(at <= begin && begin <= end && end <= numel, "block range [", begin, ", ", end, ") out of order in a buffer of ", numel);
    cut(at, begin);
    cut(begin, end);
    at = end;
  }
  cut(at, numel);
  return out;
}

Pieces updated_parameter_pieces(const FlatLayout& L, const ZeroExecution& z, int64_t allgather_bucket_size) {
  // (kept_within_step on sharded ranks is gather_ahead's: the host's step during the forward is one rank's part)
  const bool cut = z.gather_ahead || (z.kept_within_step && z.sharded);
  return bucket_pieces(z.full_numel, allgather_bucket_size, cut ? block_ranges(L) : Pieces{});
}

std::vector<Collective> plan_collectives(const Plan& plan, const ZeroExecution& z) {
  const FlatLayout& L = plan.layout;
  const ResolvedZero& knobs = plan.zero;
  std::vector<Collective> out;
  const int W = z.world_size;
  if (W <= 1) return out;
  out.push_back(control_collective(W));
  if (plan.optimizer.per_tensor_update() && z.sharded)
    out.push_back(make(CollectiveKind::lamb_norms, CollectiveOp::all_reduce, Cadence::per_step, 1, 1, 2 * static_cast<int64_t>(L.params.size()), 8, W));
  const int64_t whole_calls = whole_gradient_calls(L, z, knobs.reduce_bucket_size);
  if (!z.sharded) {  // stage 0: accumulate locally, all-reduce once per step
    out.push_back(make(CollectiveKind::gradients, CollectiveOp::all_reduce, Cadence::per_step, 1, whole_calls, z.full_numel,
                       gradient_element_bytes(z), W));
    return out;
  }
  const Collective grads = sharded_gradients(plan, z, whole_calls);
  if (!z.gathers) {  // stages 1-2: then the updated parameters, in place
    out.push_back(grads);
    add_gather(out, CollectiveKind::updated_parameters, Cadence::per_step, 1,
               static_cast<int64_t>(updated_parameter_pieces(L, z, knobs.allgather_bucket_size).size()), z.full_numel,
               dtype_bytes(plan.precision.param_dtype), W);
    return out;
  }
  const int64_t whole = add_stage3_gathers(plan, z, out);
  out.push_back(grads);
  if (whole > 0) add_gather(out, CollectiveKind::parameters_whole, Cadence::per_step, 1, 1, whole, dtype_bytes(plan.precision.param_dtype), W);
  return out;
}

}  // namespace ds
