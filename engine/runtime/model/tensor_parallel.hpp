// ds — Megatron's two tensor-parallel operators (Shoeybi et al. 2019, section 3), over a tensor group (a
// Communicator from Communicator::split, the mesh's tensor group):
//   enter_tensor_group: the identity forward; backward, the input's gradient all-reduced over the group. Where a
//                       column-parallel layer (q/k/v, gate/up: each rank holds some outputs) takes its input,
//                       every rank's partial gradient of that input is summed. Megatron's "f".
//   leave_tensor_group: forward, the partial outputs all-reduced over the group; the identity backward. Where a
//                       row-parallel layer (o, down: each rank holds some inputs) gives its output. Megatron's "g".
// A block (attention, then the MLP) costs one all-reduce of the activations each way per pair. The group
// must outlive the autograd graph that holds these (the backward all-reduces on it). In place of an
// all-reduce's input a contiguous copy is summed: the autograd graph's tensors are never written.
#pragma once

#include <torch/torch.h>

#include "engine/runtime/comm/comm.hpp"

namespace ds {

torch::Tensor enter_tensor_group(const torch::Tensor& x, Communicator& group);
torch::Tensor leave_tensor_group(const torch::Tensor& partial, Communicator& group);

}  // namespace ds
