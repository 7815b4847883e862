// ds — collectives between ranks, in the c10d spirit: a small interface (all-reduce, all-gather and
// reduce-scatter in place, barrier, point to point, groups) and three implementations:
//  * Gloo over LibTorch's c10d (engine/runtime/comm/comm_gloo.cpp): CPU tensors, rendezvous through a
//    TCPStore at the plan topology's master address (rank 0 hosts it), torchrun's convention, so
//    `ds train --nproc-per-node`, `torchrun --no-python` and Slurm all start ranks the same way. Every
//    collective waits at most the timeout, then throws: a dead peer ends the run, never hangs it. The
//    all-gather and the reduce-scatter are point-to-point sends (each rank sends each other rank the
//    elements that rank owns): Gloo's own all-gather is a third as fast as its all-reduce here, and
//    LibTorch 1.13's Gloo has no reduce-scatter; sent directly they move half an all-reduce's bytes.
//  * LocalGroup (engine/runtime/comm/comm_local.hpp): ranks as threads of one process, for unit tests of
//    ZeRO's exchange at every stage without starting processes.
//  * NCCL (engine/runtime/comm/comm_nccl.cpp): CUDA tensors, one rank a GPU, collectives on streams of
//    their own that the compute stream waits for.
// split() forms a group of some ranks (the mesh's tensor, data and pipeline groups) over the same transport
// and rendezvous: Gloo's and NCCL's meet under the group's name in the world's store, the threads' in memory.
// Every collective is counted in the ledger under the plan's CollectiveKind, with the bytes this rank sent
// (ring algorithms, engine/plan/comm.hpp).
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <map>
#include <utility>
#include <vector>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "engine/plan/comm.hpp"
#include "engine/plan/topology.hpp"

namespace ds {

// Per collective kind: calls, bytes this rank sent and seconds: where the host waits for each (Gloo, the thread
// ranks) the time it was held up (a collective running beside compute counts only its wait); over NCCL, which the
// host only queues, each one's span on the GPU, running beside compute or not.
struct CommStats {
  std::string op;
  int64_t calls = 0;
  double bytes = 0, seconds = 0;
};
using CommLedger = std::map<CollectiveKind, CommStats>;

// A collective in flight; wait() finishes it (and throws if a peer failed or the timeout passed).
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  virtual void wait() = 0;
};

class Communicator {
 public:
  // Joins the group the plan's topology describes (its rank, world size and rendezvous address, which
  // the CLI read from torchrun's variables) over the plan's backend. Throws UserError when the address
  // is missing, or for a backend this build lacks.
  static std::unique_ptr<Communicator> create(CommBackend backend, const Topology& topology, std::chrono::milliseconds timeout);
  virtual ~Communicator() = default;

  // What its collectives do natively: the plan's comm_capabilities for its backend.
  virtual CommCapabilities capabilities() const = 0;
  int rank() const { return rank_; }
  int world_size() const { return world_; }

  // In place: every rank ends with the element-wise sum in `t`'s storage (contiguous). The async form
  // starts it and returns at once; `t` must stay untouched until wait().
  virtual std::unique_ptr<PendingCollective> all_reduce_sum_async(const torch::Tensor& t, CollectiveKind kind) = 0;
  void all_reduce_sum(const torch::Tensor& t, CollectiveKind kind) { all_reduce_sum_async(t, kind)->wait(); }
  // In place, any dtype: this rank's spans of `t` (owners[rank()]) are filled; on wait every rank's are.
  virtual std::unique_ptr<PendingCollective> all_gather_async(const torch::Tensor& t, const Ownership& owners,
                                                              CollectiveKind kind) = 0;
  // In place: `t` holds this rank's contribution to every element; on wait this rank's spans hold the sum
  // over the ranks (its other elements are left as they were). `scratch` (t's dtype, at least
  // (world - 1) x this rank's span elements) receives the others' contributions; both stay untouched
  // until wait(). 16-bit floats accumulate in fp32 and round once.
  virtual std::unique_ptr<PendingCollective> reduce_scatter_sum_async(const torch::Tensor& t, const Ownership& owners,
                                                                      const torch::Tensor& scratch, CollectiveKind kind) = 0;
  virtual void barrier() = 0;
  // Point to point (a pipeline stage's activations and their gradients): send_async starts sending `t`
  // (contiguous) to rank `to` and returns; `t` stays untouched until wait(). recv fills `t` (contiguous, the
  // sent shape and dtype) from rank `from`, returning once it holds it. Between two ranks, messages arrive in
  // the order they were sent. The ledger counts a send's bytes and calls, and a receive's wait. On a GPU
  // (NCCL) "holds it" is for the compute stream: what it is given next reads the message.
  virtual std::unique_ptr<PendingCollective> send_async(const torch::Tensor& t, int to, CollectiveKind kind) = 0;
  virtual void recv(const torch::Tensor& t, int from, CollectiveKind kind) = 0;
  // Before the first message with `peer`, either way: readies both directions (NCCL makes a two-rank communicator
  // for each, which both ranks join at once; nothing elsewhere). Every rank of a chain calls it for its lower
  // neighbour first, then its upper, so each pair meets in turn; made before any message is queued, no join waits
  // behind a send already spinning on the GPU.
  virtual void connect(int peer) { (void)peer; }
  // A communicator over `members` (ranks of this one, in order, each once, this rank among them), met under
  // `name`: every member calls it with the same name and members, and no other group uses that name. The
  // mesh's tensor, pipeline and data groups are these, over the world's own transport and rendezvous. Its
  // rank is this rank's place in `members`; its collectives involve only them; its ledger is its own.
  virtual std::unique_ptr<Communicator> split(const std::string& name, const std::vector<int>& members) = 0;
  // The same for a group that only carries messages between its members (send_async, recv, connect; settle): the
  // mesh's pipeline and tied groups. NCCL then opens no communicator of the whole group, whose buffers would sit
  // unused on the GPU beside the two-rank links the messages take; its collectives are refused. Elsewhere split().
  virtual std::unique_ptr<Communicator> split_for_messages(const std::string& name, const std::vector<int>& members) {
    return split(name, members);
  }
  // Where this rank is (the trainer calls it at every step), so that a rank whose collective times out
  // can name the ranks that never arrived.
  virtual void mark_step(int64_t step) { step_ = step; }
  // Before the host reads what the device computed (a loss, a norm, the step's end): waits, at most the comm
  // timeout, for every collective issued so far. Where a collective's wait blocks the host already (Gloo, the
  // thread ranks) there is nothing to do; NCCL's run on a stream the host does not wait for, and a peer that
  // never joins one would hold the host's read for ever: there it throws instead, naming the step.
  virtual void settle() {}
  // This rank's run failed with `reason` and takes part in nothing more. Called before the failing run frees its
  // memory. Thread ranks: every wait in this group throws at once, naming this rank and the reason (not the
  // timeout's "waited for the others"). NCCL: every communicator of the process is aborted, so the unwinding
  // run's frees do not wait behind kernels spinning on peers that will never hear from it (the watchdog would
  // end the rank a minute past the timeout, naming a collective instead of the first error). Gloo: nothing to do
  // (the launcher ends the other ranks once this one exits).
  virtual void abort(const std::string& reason) { (void)reason; }

  const CommLedger& ledger() const { return ledger_; }

  // ds profile: each collective's span on this rank, from issue to completion (NCCL: from its start on the GPU to its
  // end there, on the host's clock) (off unless asked).
  struct Event {
    CollectiveKind kind;
    std::chrono::steady_clock::time_point issued, done;
    double bytes = 0;       // this rank's wire bytes, as the ledger counts them
    bool received = false;  // a receive: the wait for another rank's send (its bytes are the sender's)
    bool finished = false;  // its end is stamped (waited for)
  };
  void record_events(bool on) { recording_ = on; }
  // The events finished since the last take, in the order issued. One still in flight (the updated parameters, which
  // stages 1-2 gather during the next step's forward) is kept for the take after it ends.
  std::vector<Event> take_events();
  // Forgets every event, finished or not (what ran before the first step).
  void drop_events() { events_.clear(); }

 protected:
  Communicator(int rank, int world) : rank_(rank), world_(world) {}
  // One more call of `kind`: an `op` over `payload_bytes` (the ledger's figure is a ring's wire bytes for
  // it). `*event`: the profile event it opened (finish_event stamps its end), -1 when not recording.
  CommStats& count(CollectiveKind kind, CollectiveOp op, double payload_bytes, int64_t* event);
  // A receive of `kind`: its wait is counted here (its bytes and calls are the sender's). `*event` as count's.
  CommStats& count_received(CollectiveKind kind, int64_t* event);
  // This rank's place in `members` for split(), after checking them (every rank once, in range, this one among them)
  // and the name (one not split from this communicator before).
  int place_in(const std::string& name, const std::vector<int>& members);
  // The bytes of every rank's spans of `t`: an all-gather's or a reduce-scatter's payload.
  static double payload_bytes(const torch::Tensor& t, const Ownership& owners);

  // Stamps the end of event `id` (from count); -1, or one dropped, does nothing.
  void finish_event(int64_t id) { stamp_event(id, std::nullopt, std::chrono::steady_clock::now()); }
  // The same with its span timed elsewhere (on a GPU's clock, mapped onto the host's): its start too.
  void stamp_event(int64_t id, std::optional<std::chrono::steady_clock::time_point> issued, std::chrono::steady_clock::time_point done) {
    const auto it = events_.find(id);
    if (it == events_.end()) return;
    if (issued) it->second.issued = *issued;
    it->second.done = done;
    it->second.finished = true;
  }
  // Before take_events: stamps the spans timed elsewhere that have ended since (NCCL's, on the GPU's clock).
  virtual void stamp_timed_events() {}

  int rank_ = 0, world_ = 1;
  int64_t step_ = -1;
  CommLedger ledger_;
  bool recording_ = false;
  std::map<int64_t, Event> events_;  // by id, in the order issued
  int64_t next_event_ = 0;
  std::set<std::string> group_names_;  // the groups split from this one: a name meets once
};

}  // namespace ds
