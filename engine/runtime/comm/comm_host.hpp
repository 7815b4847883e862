// ds — what the host-side communicators (Gloo, and LocalGroup's threads, which behave as Gloo does) do
// on the CPU themselves: a reduce-scatter built from point-to-point sends ends by summing the other
// ranks' contributions into this rank's spans. A device communicator (NCCL) reduces natively.
#pragma once

#include <torch/torch.h>

#include <vector>

#include "engine/plan/comm.hpp"

namespace ds {

// This rank's spans `mine` of `t` += the `peers` other ranks' contributions, which `scratch` holds in rank
// order, each rank's as `mine` concatenated. 16-bit floats accumulate in fp32 and round once.
void add_received_on_host(const torch::Tensor& t, const std::vector<Span>& mine, int peers, const torch::Tensor& scratch);

}  // namespace ds
