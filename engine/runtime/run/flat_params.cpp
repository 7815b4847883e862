#include "engine/runtime/run/flat_params.hpp"

#include <map>
#include <optional>
#include <tuple>

#include "common/error.hpp"
#include "common/strings.hpp"

namespace ds {

namespace {

// The execution's buffers carved from one allocation per dtype, place and page-locking (each start aligned to 64 bytes
// for the kernels), made by the device. On a CPU run the host is the same RAM as the device, but its
// buffers are allocations of their own, reached through the same copies a GPU run makes. States on NVMe
// and the buffers they are swapped through belong to the swapper (nvme_swap.hpp); the communicator's
// transient pieces are its own.
class Arenas {
 public:
  Arenas(const ZeroExecution& z, Device& device) : z_(z) {
    std::map<Key, int64_t> total;
    for (const ZeroBuffer& b : z.buffers) {
      if (b.transient || b.place == Place::nvme || b.role == BufferRole::optimizer_swap || b.role == BufferRole::param_swap) continue;
      total[{b.dtype, b.place, b.pinned}] += aligned(b.elements, b.dtype) * b.copies;
    }
    for (const auto& [key, n] : total) arena_[key] = device.allocate(std::get<1>(key), std::get<0>(key), n, std::get<2>(key));
  }
  std::vector<torch::Tensor> all() const {
    std::vector<torch::Tensor> out;
    for (const auto& [key, a] : arena_) out.push_back(a);
    return out;
  }
  // The next copy of the buffer of `role` on the device, else on the host; or exactly at `place`.
  // Undefined when the execution has none.
  torch::Tensor take(BufferRole role, int copy = 0, std::optional<Place> place = std::nullopt) {
    const ZeroBuffer* b = z_.find(role, place.value_or(Place::device));
    if (!b && !place) b = z_.find(role, Place::host);
    if (!b || copy >= b->copies) return {};
    // A tensor of its own over the arena's memory, not a view: views share their base's version counter,
    // and autograd would take a gradient accumulated into one buffer for a change of the weights in another.
    const Key key{b->dtype, b->place, b->pinned};
    const torch::Tensor& a = arena_.at(key);
    char* at = static_cast<char*>(a.data_ptr()) + used_[key] * dtype_bytes(b->dtype);
    used_[key] += aligned(b->elements, b->dtype);
    return torch::from_blob(at, {b->elements}, a.options());
  }

 private:
  using Key = std::tuple<Dtype, Place, bool>;  // (dtype, place, page-locked)
  static int64_t aligned(int64_t elements, Dtype d) {
    constexpr int64_t kAlignBytes = 64;
    const int64_t step = kAlignBytes / dtype_bytes(d);
    return (elements + step - 1) / step * step;
  }
  const ZeroExecution& z_;
  std::map<Key, torch::Tensor> arena_;
  std::map<Key, int64_t> used_;
};

// The optimizer's states, span by span where the plan placed them (none here for a span on NVMe).
void take_states(FlatParams& f, const ZeroExecution& z, Arenas& arenas) {
  f.spans = z.state_spans;
  for (const StateSpan& s : z.state_spans) {
    FlatParams::States st;
    if (s.place != Place::nvme) {
      st.master = arenas.take(BufferRole::master, 0, s.place);
      // fp32 with the states on the device: the optimizer steps the weights themselves
      if (!st.master.defined() && f.local_params.defined())
        st.master = s.numel() > 0 ? f.local_params.narrow(0, s.begin, s.numel()) : torch::empty({0}, torch::kFloat32);  // (a rank owning nothing)
      st.exp_avg = arenas.take(BufferRole::exp_avg, 0, s.place);
      st.exp_avg_sq = arenas.take(BufferRole::exp_avg_sq, 0, s.place);
    }
    f.states.push_back(st);
  }
  f.offload_grads = arenas.take(BufferRole::offload_grads);
  for (int i = 0; i < 2; ++i) f.weights_staging[i] = arenas.take(BufferRole::weights_staging, i);
  f.weight_tiles = z.weight_tiles;
  f.grads_arrival = arenas.take(BufferRole::grads_arrival);
  if (const ZeroBuffer* b = z.find(BufferRole::block_arrivals, Place::host))
    for (int i = 0; i < b->copies; ++i) f.block_arrivals.push_back(arenas.take(BufferRole::block_arrivals, i));
  for (int i = 0; i < 3; ++i) f.step_backup[i] = arenas.take(BufferRole::step_backup, i);
}

// One view per parameter, requires_grad, its .grad a view of the buffer backward accumulates it in.
void make_views(FlatParams& f, const FlatLayout& L, const ZeroExecution& z) {
  for (size_t i = 0; i < L.params.size(); ++i) {
    const ParamSlot& p = L.params[i];
    const bool in_block = p.layer >= 0;
    torch::Tensor weight, grad;
    if (!f.grouped) {
      weight = f.compute.narrow(0, p.offset, p.numel);
      grad = (f.micro_grads.defined() ? f.micro_grads : f.compute_grads).narrow(0, p.offset, p.numel);
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
}

// The rank's frozen tensors (LoRA's base, model.freeze), in state_dict order, never with a gradient: kept whole, or
// in their block's gathered buffer.
void take_frozen(FlatParams& f, const Plan& plan, Arenas& arenas) {
  f.frozen = arenas.take(BufferRole::frozen_params);
  f.frozen_partitions = arenas.take(BufferRole::frozen_partitions);
  if (!f.frozen.defined() && !f.frozen_partitions.defined()) return;
  const ZeroExecution& z = plan.execution;
  for (int i = 0; i < 2; ++i) {
    f.frozen_block_params[i] = arenas.take(BufferRole::frozen_block_params, i);
    f.frozen_staging[i] = arenas.take(BufferRole::frozen_staging, i);
  }
  const StageShare& own = plan.own;  // the rank's tensors (a pipeline stage's share)
  for (size_t i = 0; i < own.model.tensors.size(); ++i) {
    if (!own.is_frozen(i)) continue;
    const TensorSpec& t = own.model.tensors[i];
    const int slot = z.frozen_slot[i];
    const torch::Tensor weight =
        slot < 0 ? f.frozen.narrow(0, z.frozen_offset[i], t.numel)
                 : f.frozen_block_params[t.layer % 2].narrow(0, z.frozen_group_offset[static_cast<size_t>(slot)], t.numel);
    f.frozen_views.push_back(weight.view(t.shape));
    f.frozen_names.push_back(t.name);
  }
}

}  // namespace

FlatParams FlatParams::allocate(const Plan& plan, int rank, Device& device) {
  const FlatLayout& L = plan.layout;
  const ZeroExecution& z = plan.execution;
  FlatParams f;
  f.device = &device;
  f.rank = rank;
  f.grouped = z.grouped;
  f.widened = z.widened;
  f.overlap = z.overlap;
  f.group_offset = z.group_offset;
  f.whole_offset = z.whole_offset;
  f.owned = owned_segments(L, rank);
  Arenas arenas(z, device);
  f.arenas = arenas.all();  // owns the memory every buffer below points into

  f.params = arenas.take(BufferRole::params);
  f.params_swapped = z.find(BufferRole::params, Place::nvme) != nullptr;
  if (const ZeroBuffer* b = z.find_anywhere(BufferRole::params); b && b->place != Place::device) f.params_place = Place::host;
  if (const ZeroBuffer* b = z.find_anywhere(BufferRole::grads)) f.grads_place = b->place;
  f.whole_params = arenas.take(BufferRole::whole_params);
  f.grads = arenas.take(BufferRole::grads);
  if (L.numel == 0) {  // a pipeline stage training nothing (its every tensor frozen): no element, no buffer in the plan
    f.params = device.allocate(Place::device, plan.precision.param_dtype, 0, false);
    f.grads = device.allocate(Place::device, plan.precision.grad_dtype, 0, false);
  }
  DS_CHECK((f.params.defined() || f.params_swapped) && f.grads.defined(), "the execution lacks the parameters or gradients");
  f.compute = z.widened ? arenas.take(BufferRole::compute) : f.params;  // widened stage 3 reads gathered buffers only
  f.compute_grads = z.widened ? arenas.take(BufferRole::compute_grads) : f.grads;
  const int64_t shard_begin = z.sharded && !z.gathers ? L.shards[static_cast<size_t>(rank)].begin : 0;
  if (f.params.defined()) f.local_params = f.params.narrow(0, z.gathers ? 0 : shard_begin, z.local_numel);
  f.local_grads = f.compute_grads.narrow(0, z.grouped ? 0 : shard_begin, z.local_numel);
  f.micro_grads = arenas.take(BufferRole::micro_grads);
  take_states(f, z, arenas);
  for (int i = 0; i < 2; ++i) {
    f.block_grads[i] = arenas.take(BufferRole::block_grads, i);
    f.block_params[i] = arenas.take(BufferRole::block_params, i);
  }
  f.gather_staging[0] = arenas.take(BufferRole::gather_staging);
  f.gather_staging[1] = arenas.take(BufferRole::prefetch_staging);
  f.reduce_scratch = arenas.take(BufferRole::reduce_scratch);
  f.outer_grads = arenas.take(BufferRole::outer_grads);
  f.outer_params = arenas.take(BufferRole::outer_params);
  make_views(f, L, z);
  take_frozen(f, plan, arenas);
  return f;
}

const torch::Tensor& ParamCursor::next(const std::string& suffix) {
  DS_CHECK(i_ < views_->size() && ends_with((*names_)[i_], suffix), "parameter ", i_, " is ",
           (i_ < names_->size() ? (*names_)[i_] : "missing"), ", expected *", suffix);
  return (*views_)[i_++];
}

FlatParams::Bytes FlatParams::bytes() const {
  const auto n = [](const torch::Tensor& t) { return t.defined() ? static_cast<double>(t.nbytes()) : 0.0; };
  Bytes b;
  b.params = n(params) + n(whole_params) + n(frozen) + n(frozen_partitions);
  b.grads = n(grads) + n(offload_grads);
  const auto own = [&](const torch::Tensor& t) {  // not the weights themselves (fp32)
    return t.defined() && (!local_params.defined() || t.data_ptr() < local_params.data_ptr() ||
                           t.data_ptr() >= static_cast<char*>(local_params.data_ptr()) + local_params.nbytes());
  };
  for (const States& s : states) b.optimizer_states += n(s.exp_avg) + n(s.exp_avg_sq) + (own(s.master) ? n(s.master) : 0.0);
  if (widened) b.buffers += n(compute) + n(compute_grads);
  b.buffers += n(micro_grads);
  for (const torch::Tensor* t : {&block_grads[0], &block_grads[1], &outer_grads, &block_params[0], &block_params[1], &outer_params,
                                 &gather_staging[0], &gather_staging[1], &reduce_scratch, &frozen_block_params[0],
                                 &frozen_block_params[1], &frozen_staging[0], &frozen_staging[1], &weights_staging[0], &weights_staging[1], &grads_arrival,
                                 &step_backup[0], &step_backup[1], &step_backup[2]})
    b.buffers += n(*t);
  for (const torch::Tensor& t : block_arrivals) b.buffers += n(t);
  return b;
}

}  // namespace ds
