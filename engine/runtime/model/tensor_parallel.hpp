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

#include "engine/plan/mesh.hpp"
#include "engine/runtime/comm/comm.hpp"

namespace ds {

torch::Tensor enter_tensor_group(const torch::Tensor& x, Communicator& group);
torch::Tensor leave_tensor_group(const torch::Tensor& partial, Communicator& group);

// A model's tensor group as it runs: the communicator of the ranks that split each block (none, or one rank:
// the model is whole) and the vocabulary rows this rank holds of the token table and the head.
struct TensorGroup {
  Communicator* comm = nullptr;  // not owned; outlives every graph the model makes
  VocabShare vocab;
  int64_t whole_vocab = 0;       // the model's vocabulary: what a token id must be below
  int size() const { return comm ? comm->world_size() : 1; }
  int rank() const { return comm ? comm->rank() : 0; }
  bool split() const { return size() > 1; }
};

// This rank's share of a whole tensor as `slice` says: its runs along the slice's dimension joined, then the
// padding's zero rows. A new contiguous tensor of the whole's dtype and device.
torch::Tensor take_share(const torch::Tensor& whole, const TensorSlice& slice);

// The token embedding from a vocabulary-parallel table (this rank's rows [begin, begin + real)): each id this
// rank holds looked up, the others zero, then summed over the group, so every rank gets every id's row. Its
// backward reaches only the rows this rank holds.
torch::Tensor vocab_parallel_embedding(const torch::Tensor& table, const torch::Tensor& ids, const TensorGroup& group);

}  // namespace ds
