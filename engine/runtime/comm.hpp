// ds — collectives between ranks, in the c10d spirit: a small interface (sum in place, gather by sum,
// barrier) with what a backend can do natively in capabilities(), and two implementations:
//  * Gloo over LibTorch's c10d (engine/runtime/comm_gloo.cpp): CPU tensors, rendezvous through a
//    TCPStore at the plan topology's master address (rank 0 hosts it), torchrun's convention, so
//    `ds train --nproc-per-node`, `torchrun --no-python` and Slurm all start ranks the same way. Every
//    collective waits at most the timeout, then throws: a dead peer ends the run, never hangs it.
//  * LocalGroup (engine/runtime/comm_local.hpp): ranks as threads of one process, for unit tests of
//    ZeRO's exchange at every stage without starting processes.
// A CUDA/NCCL communicator slots in beside them. Every collective is counted in the ledger under the
// plan's CollectiveKind, with the bytes this rank sent (ring algorithms, engine/plan/comm.hpp).
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <map>
#include <utility>
#include <vector>
#include <memory>
#include <string>

#include "engine/plan/comm.hpp"
#include "engine/plan/topology.hpp"

namespace ds {

// Per collective kind: calls, bytes this rank sent and seconds it was held up by them (a collective
// running beside compute counts only its wait).
struct CommStats {
  std::string op;
  int64_t calls = 0;
  double bytes = 0, seconds = 0;
};
using CommLedger = std::map<CollectiveKind, CommStats>;

// What a backend does natively. ZeRO uses the generic forms where one is missing: an all-reduce of
// which each rank keeps its part for a reduce-scatter, a gather by sum for an all-gather, 16-bit
// reductions through an fp32 copy.
struct CommCapabilities {
  bool reduce_scatter = false;
  bool all_gather = false;
  bool reduce_16bit = false;
};

// A collective in flight; wait() finishes it (and throws if a peer failed or the timeout passed).
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  virtual void wait() = 0;
};

class Communicator {
 public:
  // Joins the Gloo group the plan's topology describes (its rank, world size and rendezvous address,
  // which the CLI read from torchrun's variables). Throws UserError when the address is missing.
  static std::unique_ptr<Communicator> create(const Topology& topology, std::chrono::milliseconds timeout);
  virtual ~Communicator() = default;

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  virtual CommCapabilities capabilities() const = 0;

  // In place: every rank ends with the element-wise sum in `t`'s storage (contiguous). The async form
  // starts it and returns at once; `t` must stay untouched until wait().
  virtual std::unique_ptr<PendingCollective> all_reduce_sum_async(const torch::Tensor& t, CollectiveKind kind) = 0;
  void all_reduce_sum(const torch::Tensor& t, CollectiveKind kind) { all_reduce_sum_async(t, kind)->wait(); }
  // An all-gather as an all-reduce of raw bits: every element of `t` is nonzero on at most one rank (each
  // rank fills its own part, the rest is zero), so the integer sum of the bit patterns is that rank's
  // bits, exactly, in any dtype. Gloo's own all-gather moves ~80 MB/s on this machine against ~500 MB/s
  // for its all-reduce: twice the bytes, a third of the time. Starts it and returns at once.
  virtual std::unique_ptr<PendingCollective> gather_by_sum_async(const torch::Tensor& t, CollectiveKind kind) = 0;
  void gather_by_sum(const torch::Tensor& t, CollectiveKind kind) { gather_by_sum_async(t, kind)->wait(); }
  virtual void barrier() = 0;
  // Where this rank is (the trainer calls it at every step), so that a rank whose collective times out
  // can name the ranks that never arrived.
  virtual void mark_step(int64_t step) { step_ = step; }

  const CommLedger& ledger() const { return ledger_; }

  // ds profile: each collective's span on this rank, from issue to completion (off unless asked).
  struct Event {
    CollectiveKind kind;
    std::chrono::steady_clock::time_point issued, done;
    double bytes = 0;  // this rank's wire bytes, as the ledger counts them
  };
  void record_events(bool on) { recording_ = on; }
  std::vector<Event> take_events() { return std::exchange(events_, {}); }

 protected:
  Communicator(int rank, int world) : rank_(rank), world_(world) {}
  // One more call of `kind` sending `payload_bytes` through an all-reduce (the ledger's figure).
  // `*event`: the profile event it opened (finish_event stamps its end), -1 when not recording.
  CommStats& count_all_reduce(CollectiveKind kind, double payload_bytes, int64_t* event);

  // Stamps the end of event `index` (from count_all_reduce); -1 does nothing.
  void finish_event(int64_t index) {
    if (index >= 0 && static_cast<size_t>(index) < events_.size()) events_[static_cast<size_t>(index)].done = std::chrono::steady_clock::now();
  }

  int rank_ = 0, world_ = 1;
  int64_t step_ = -1;
  CommLedger ledger_;
  bool recording_ = false;
  std::vector<Event> events_;
};

}  // namespace ds
