// ds — where ranks meet: a TCPStore at the topology's master address (rank 0 hosts it, torchrun's
// convention), which Gloo's process group and NCCL's unique id both go through. Every wait is bounded by
// the run's comm timeout and fails naming what it waited for.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <string>

#include "engine/plan/topology.hpp"

namespace ds {

// The world's store: every rank of the topology connects (rank 0 serves). std::runtime_error naming the
// address and the timeout when the ranks do not all arrive in time.
c10::intrusive_ptr<c10d::Store> open_world_store(const Topology& t, std::chrono::milliseconds timeout);

// Bytes rank 0 makes (`make`, called on rank 0 only) and every rank gets, under `key`: NCCL's unique id.
// std::runtime_error naming `what` and the timeout when rank 0's never comes.
std::string share_from_rank0(c10d::Store& store, const std::string& key, int rank, std::chrono::milliseconds timeout,
                             const std::function<std::string()>& make, const std::string& what);

}  // namespace ds
