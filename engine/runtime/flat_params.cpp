#include "engine/runtime/flat_params.hpp"

#include "common/error.hpp"
#include "common/strings.hpp"

namespace ds {

namespace {
torch::ScalarType to_torch(Dtype d) {
  switch (d) {
    case Dtype::fp32: return torch::kFloat32;
    case Dtype::bf16: return torch::kBFloat16;
    case Dtype::fp16: return torch::kFloat16;
  }
  return torch::kFloat32;
}
}  // namespace

FlatParams FlatParams::allocate(const Plan& plan, int rank) {
  const FlatLayout& L = plan.layout;
  const PrecisionPolicy& pp = plan.precision;
  const bool sharded = L.world_size > 1 && L.stage >= 1;
  FlatParams f;
  f.rank = rank;
  f.grouped = L.world_size > 1 && L.stage >= 2;
  f.owned = owned_segments(L, rank);
  const int64_t full = L.stage == 0 ? L.numel : L.padded_numel;
  const int64_t local = sharded ? L.shard_numel : full;
  const int64_t shard_begin = sharded && L.stage < 3 ? L.shards[static_cast<size_t>(rank)].begin : 0;
  const auto ptype = to_torch(pp.param_dtype), gtype = to_torch(pp.grad_dtype), ctype = to_torch(pp.compute_dtype);
  const bool stage3 = sharded && L.stage == 3;

  f.params = torch::zeros({stage3 ? local : full}, ptype);
  f.grads = torch::zeros({f.grouped ? local : full}, gtype);
  f.widened = pp.compute_dtype != pp.param_dtype;  // fp16 on the CPU
  // Widened at stage 3 the model reads only the gathered buffers (in the compute dtype): no whole copy.
  if (f.widened && !stage3) f.compute = torch::zeros({full}, ctype);
  if (!f.widened) f.compute = f.params;
  f.compute_grads = f.widened ? torch::zeros({f.grouped ? local : full}, ctype) : f.grads;
  f.local_params = f.params.narrow(0, shard_begin, local);
  f.local_grads = f.compute_grads.narrow(0, f.grouped ? 0 : shard_begin, local);
  f.master = pp.fp32_master ? torch::zeros({local}, torch::kFloat32) : f.local_params;
  if (plan.optimizer.moments >= 1) f.exp_avg = torch::zeros({local}, torch::kFloat32);
  if (plan.optimizer.moments >= 2) f.exp_avg_sq = torch::zeros({local}, torch::kFloat32);

  // Grouped: where each parameter sits in its group's buffers. Every block has the same layout, so
  // all blocks share one buffer (the offsets repeat); the outer parameters concatenate in order. The
  // model reads and accumulates into them, so they hold the compute dtype.
  f.group_offset.assign(L.params.size(), 0);
  f.whole_offset.assign(L.params.size(), -1);
  int64_t block_numel = 0, outer_numel = 0, whole_numel = 0;
  if (f.grouped) {
    for (const ParamGroup& g : parameter_groups(L)) {
      int64_t at = 0;
      for (int i : g.params) {
        f.group_offset[static_cast<size_t>(i)] = at;
        at += L.params[static_cast<size_t>(i)].numel;
        if (stage3 && stays_whole(L.params[static_cast<size_t>(i)], plan.zero.param_persistence_threshold)) {
          f.whole_offset[static_cast<size_t>(i)] = whole_numel;
          whole_numel += L.params[static_cast<size_t>(i)].numel;
        }
      }
      if (g.layer >= 0) {
        DS_CHECK(block_numel == 0 || block_numel == at, "blocks of different sizes: ", block_numel, " and ", at);
        block_numel = at;
      } else {
        outer_numel = at;
      }
    }
    f.overlap = plan.zero.overlap_comm;
    f.block_grads[0] = torch::zeros({block_numel}, ctype);
    if (f.overlap) f.block_grads[1] = torch::zeros({block_numel}, ctype);
    f.outer_grads = torch::zeros({outer_numel}, ctype);
    if (stage3) {
      f.block_params[0] = torch::zeros({block_numel}, ctype);
      f.block_params[1] = torch::zeros({block_numel}, ctype);
      f.outer_params = torch::zeros({outer_numel}, ctype);
      f.whole_params = torch::zeros({whole_numel}, ctype);
    }
  }

  for (size_t i = 0; i < L.params.size(); ++i) {
    const ParamSlot& p = L.params[i];
    const bool in_block = p.layer >= 0;
    torch::Tensor weight, grad;
    if (!f.grouped) {
      weight = f.compute.narrow(0, p.offset, p.numel);
      grad = f.compute_grads.narrow(0, p.offset, p.numel);
    } else {
      grad = (in_block ? f.block_grads[f.overlap ? p.layer % 2 : 0] : f.outer_grads).narrow(0, f.group_offset[i], p.numel);
      if (!stage3)
        weight = f.compute.narrow(0, p.offset, p.numel);
      else if (f.whole_offset[i] >= 0)
        weight = f.whole_params.narrow(0, f.whole_offset[i], p.numel);
      else
        weight = (in_block ? f.block_params[p.layer % 2] : f.outer_params).narrow(0, f.group_offset[i], p.numel);
    }
    torch::Tensor v = weight.view(p.shape).detach().requires_grad_(true);
    v.mutable_grad() = grad.view(p.shape);
    f.views.push_back(v);
    f.names.push_back(p.name);
  }
  return f;
}

const torch::Tensor& ParamCursor::next(const std::string& suffix) {
  DS_CHECK(i_ < p_.views.size() && ends_with(p_.names[i_], suffix), "parameter ", i_, " is ",
           (i_ < p_.names.size() ? p_.names[i_] : "missing"), ", expected *", suffix);
  return p_.views[i_++];
}

FlatParams::Bytes FlatParams::bytes() const {
  const auto n = [](const torch::Tensor& t) { return t.defined() ? static_cast<double>(t.nbytes()) : 0.0; };
  Bytes b;
  b.params = n(params) + n(whole_params);
  b.grads = n(grads);
  b.optimizer_states = n(exp_avg) + n(exp_avg_sq) + (master.data_ptr() != local_params.data_ptr() ? n(master) : 0.0);
  if (widened) b.buffers += n(compute) + n(compute_grads);
  b.buffers += n(block_grads[0]) + n(block_grads[1]) + n(outer_grads) + n(block_params[0]) + n(block_params[1]) + n(outer_params);
  return b;
}

}  // namespace ds
