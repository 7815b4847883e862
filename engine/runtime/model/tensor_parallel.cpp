#include "engine/runtime/model/tensor_parallel.hpp"

#include <cstdint>
#include <vector>

#include "common/error.hpp"
#include "engine/runtime/model/fused_ops.hpp"  // embedding_lookup, ids_to_device

namespace ds {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The group travels in the autograd context as its address: it outlives the graph (see the header).
Communicator& group_of(AutogradContext* ctx) { return *reinterpret_cast<Communicator*>(ctx->saved_data["group"].toInt()); }

torch::Tensor summed_over(const torch::Tensor& t, Communicator& group) {
  torch::Tensor sum = t.contiguous().clone();
  group.all_reduce_sum(sum, CollectiveKind::tensor_activations);
  return sum;
}

class EnterTensorGroup : public torch::autograd::Function<EnterTensorGroup> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return x.view_as(x);  // a new tensor of the graph, the same values
  }
  // The gradient leaves the group as g does: differentiable again (a double backward all-reduces too).
  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    return {leave_tensor_group(grad_out[0], group_of(ctx)), torch::Tensor()};
  }
};

class LeaveTensorGroup : public torch::autograd::Function<LeaveTensorGroup> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& partial, int64_t group) {
    ctx->saved_data["group"] = group;
    return summed_over(partial, *reinterpret_cast<Communicator*>(group));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    return {enter_tensor_group(grad_out[0], group_of(ctx)), torch::Tensor()};
  }
};

int64_t address_of(Communicator& group) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(&group)); }

}  // namespace

torch::Tensor enter_tensor_group(const torch::Tensor& x, Communicator& group) {
  if (group.world_size() == 1) return x;
  return EnterTensorGroup::apply(x, address_of(group));
}

torch::Tensor leave_tensor_group(const torch::Tensor& partial, Communicator& group) {
  if (group.world_size() == 1) return partial;
  return LeaveTensorGroup::apply(partial, address_of(group));
}

torch::Tensor take_share(const torch::Tensor& whole, const TensorSlice& slice) {
  const int64_t dim = slice.dim;
  DS_CHECK(dim < whole.dim() || (whole.dim() == 0 && dim == 0), "take_share: dimension ", dim, " of a tensor of ", whole.sizes());
  std::vector<torch::Tensor> parts;
  for (const auto& [begin, length] : slice.runs) parts.push_back(whole.narrow(dim, begin, length));
  if (slice.padding > 0) {
    std::vector<int64_t> shape = whole.sizes().vec();
    shape[static_cast<size_t>(dim)] = slice.padding;
    parts.push_back(torch::zeros(shape, whole.options()));
  }
  return torch::cat(parts, dim).contiguous();
}

torch::Tensor vocab_parallel_embedding(const torch::Tensor& table, const torch::Tensor& ids, const TensorGroup& group) {
  if (!group.split()) return embedding_lookup(table, ids);
  const VocabShare& v = group.vocab;
  // On the table's device from the start: a mask made on the host and copied there would hold the host until the
  // GPU had run everything queued (a pageable copy), collectives included.
  const torch::Tensor local = ids_to_device(ids, table.device()) - v.begin;
  const torch::Tensor mine = (local >= 0) & (local < v.real);
  // Another rank's id reads row 0 and is zeroed: its gradient into row 0 is zero.
  const torch::Tensor rows = embedding_lookup(table, torch::where(mine, local, torch::zeros_like(local)));
  return leave_tensor_group(rows * mine.unsqueeze(-1).to(rows.scalar_type()), *group.comm);
}

}  // namespace ds
