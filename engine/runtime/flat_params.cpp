#include "engine/runtime/flat_params.hpp"

#include <map>
#include <optional>

#include "common/error.hpp"
#include "common/strings.hpp"

namespace ds {

torch::ScalarType to_torch(Dtype d) {
  switch (d) {
    case Dtype::fp32: return torch::kFloat32;
    case Dtype::bf16: return torch::kBFloat16;
    case Dtype::fp16: return torch::kFloat16;
  }
  return torch::kFloat32;
}

FlatParams FlatParams::allocate(const Plan& plan, int rank) {
  const FlatLayout& L = plan.layout;
  const ZeroExecution& z = plan.execution;
  FlatParams f;
  f.rank = rank;
  f.grouped = z.grouped;
  f.widened = z.widened;
  f.overlap = z.overlap;
  f.group_offset = z.group_offset;
  f.whole_offset = z.whole_offset;
  f.owned = owned_segments(L, rank);

  // One allocation per dtype and place, carved into the execution's buffers (each start aligned to 64
  // bytes for the kernels). On a CPU run the host is the same RAM as the device, but its buffers are
  // allocations of their own, reached through the same copies a GPU run makes. States on NVMe and the
  // buffers they are swapped through belong to the swapper (nvme_swap.hpp); the communicator's transient
  // pieces are its own.
  constexpr int64_t kAlignBytes = 64;
  auto aligned = [&](int64_t elements, Dtype d) {
    const int64_t step = kAlignBytes / dtype_bytes(d);
    return (elements + step - 1) / step * step;
  };
  using Key = std::pair<Dtype, Place>;
  std::map<Key, int64_t> total;
  for (const ZeroBuffer& b : z.buffers) {
    if (b.transient || b.place == Place::nvme || b.role == BufferRole::optimizer_swap || b.role == BufferRole::param_swap) continue;
    total[{b.dtype, b.place}] += aligned(b.elements, b.dtype) * b.copies;
  }
  std::map<Key, torch::Tensor> arena;
  std::map<Key, int64_t> used;
  for (const auto& [key, n] : total) {
    arena[key] = torch::zeros({n}, to_torch(key.first));
    f.arenas.push_back(arena[key]);  // owns the memory every buffer below points into
  }
  // The buffer of `role` on the device, else on the host; or exactly at `at`.
  auto take = [&](BufferRole role, int copy = 0, std::optional<Place> place = std::nullopt) -> torch::Tensor {
    const ZeroBuffer* b = z.find(role, place.value_or(Place::device));
    if (!b && !place) b = z.find(role, Place::host);
    if (!b || copy >= b->copies) return {};
    // A tensor of its own over the arena's memory, not a view: views share their base's version counter,
    // and autograd would take a gradient accumulated into one buffer for a change of the weights in another.
    const Key key{b->dtype, b->place};
    const torch::Tensor& a = arena[key];
    char* at = static_cast<char*>(a.data_ptr()) + used[key] * dtype_bytes(b->dtype);
    used[key] += aligned(b->elements, b->dtype);
    return torch::from_blob(at, {b->elements}, a.options());
  };

  f.params = take(BufferRole::params);
  f.params_swapped = z.find(BufferRole::params, Place::nvme) != nullptr;
  f.whole_params = take(BufferRole::whole_params);
  f.grads = take(BufferRole::grads);
  DS_CHECK((f.params.defined() || f.params_swapped) && f.grads.defined(), "the execution lacks the parameters or gradients");
  f.compute = z.widened ? take(BufferRole::compute) : f.params;  // widened stage 3 reads gathered buffers only
  f.compute_grads = z.widened ? take(BufferRole::compute_grads) : f.grads;
  const int64_t shard_begin = z.sharded && !z.gathers ? L.shards[static_cast<size_t>(rank)].begin : 0;
  if (f.params.defined()) f.local_params = f.params.narrow(0, z.gathers ? 0 : shard_begin, z.local_numel);
  f.local_grads = f.compute_grads.narrow(0, z.grouped ? 0 : shard_begin, z.local_numel);
  f.swapped = z.find(BufferRole::master, Place::nvme) != nullptr;
  // Partial offload: the offloaded part's states (on the host, or swapped) and the rest's on the device.
  f.offloaded = z.offloaded_numel;
  const bool partial = f.offloaded > 0 && f.offloaded < z.local_numel;
  const std::optional<Place> offloaded_at = partial ? std::optional<Place>(Place::host) : std::nullopt;
  f.master = take(BufferRole::master, 0, offloaded_at);
  f.exp_avg = take(BufferRole::exp_avg, 0, offloaded_at);
  f.exp_avg_sq = take(BufferRole::exp_avg_sq, 0, offloaded_at);
  if (partial) {
    f.kept_master = take(BufferRole::master, 0, Place::device);
    if (!f.kept_master.defined()) f.kept_master = f.local_params.narrow(0, f.offloaded, z.local_numel - f.offloaded);  // fp32
    f.kept_exp_avg = take(BufferRole::exp_avg, 0, Place::device);
    f.kept_exp_avg_sq = take(BufferRole::exp_avg_sq, 0, Place::device);
  }
  if (!f.master.defined() && !f.swapped) f.master = f.local_params;  // fp32: the optimizer steps the weights themselves
  f.offload_grads = take(BufferRole::offload_grads);
  for (int i = 0; i < 2; ++i) {
    f.block_grads[i] = take(BufferRole::block_grads, i);
    f.block_params[i] = take(BufferRole::block_params, i);

  }
  f.gather_staging[0] = take(BufferRole::gather_staging);
  f.gather_staging[1] = take(BufferRole::prefetch_staging);
  f.reduce_scratch = take(BufferRole::reduce_scratch);
  f.outer_grads = take(BufferRole::outer_grads);
  f.outer_params = take(BufferRole::outer_params);

  for (size_t i = 0; i < L.params.size(); ++i) {
    const ParamSlot& p = L.params[i];
    const bool in_block = p.layer >= 0;
    torch::Tensor weight, grad;
    if (!f.grouped) {
      weight = f.compute.narrow(0, p.offset, p.numel);
      grad = f.compute_grads.narrow(0, p.offset, p.numel);
    } else {
      grad = (in_block ? f.block_grads[f.overlap ? p.layer % 2 : 0] : f.outer_grads).narrow(0, f.group_offset[i], p.numel);
      if (!z.gathers)
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
  b.grads = n(grads) + n(offload_grads);
  const auto own = [&](const torch::Tensor& t) {  // not the weights themselves (fp32)
    return t.defined() && (!local_params.defined() || t.data_ptr() < local_params.data_ptr() ||
                           t.data_ptr() >= static_cast<char*>(local_params.data_ptr()) + local_params.nbytes());
  };
  b.optimizer_states = n(exp_avg) + n(exp_avg_sq) + n(kept_exp_avg) + n(kept_exp_avg_sq) + (own(master) ? n(master) : 0.0) +
                       (own(kept_master) ? n(kept_master) : 0.0);
  if (widened) b.buffers += n(compute) + n(compute_grads);
  for (const torch::Tensor* t : {&block_grads[0], &block_grads[1], &outer_grads, &block_params[0], &block_params[1], &outer_params,
                                 &gather_staging[0], &gather_staging[1], &reduce_scratch})
    b.buffers += n(*t);
  return b;
}

}  // namespace ds
