// ds — ranks as threads of one process: a Communicator whose collectives meet in shared memory. For
// unit tests of ZeRO's exchange and flat buffers at every stage inside one process (the multi-process
// tests over Gloo stay as integration tests). Sums run in rank order; a collective completes when the
// last rank issues it, so the async forms return finished work. The ledger counts what a ring would
// send, as Gloo's does. It speaks Gloo's terms (16-bit sums through fp32, reduce-scatter into a receive
// scratch) or NCCL's (16-bit sums in their dtype, a native reduce-scatter without scratch), as asked, so
// ZeRO's NCCL path runs here on the CPU. split() forms the mesh's groups (tensor, pipeline, data) among the
// threads, so a split model trains in one process too, on the CPU or on one GPU's tensors. A rank that fails
// (Communicator::abort) ends every wait in its groups at once, naming itself and its reason; a group split for
// messages only refuses collectives, as NCCL's does.
#pragma once

#include <memory>

#include "engine/runtime/comm/comm.hpp"

namespace ds {

class LocalGroup {
 public:
  // `timeout`: a rank waiting longer than this for the others throws (a test's deadlock fails, not hangs).
  explicit LocalGroup(int world_size, std::chrono::milliseconds timeout = std::chrono::seconds(60),
                      CommBackend speaks = CommBackend::gloo);
  ~LocalGroup();
  // The communicator of `rank`; each rank's is used by one thread.
  std::unique_ptr<Communicator> join(int rank);

  struct Shared;

 private:
  std::shared_ptr<Shared> shared_;
};

}  // namespace ds
