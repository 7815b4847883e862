// ds — the Communicator over NCCL (comm.hpp's interface on CUDA tensors), one rank a GPU. The unique id goes
// through the world's store (rendezvous.hpp); LOCAL_RANK picks the GPU as the runtime's Device does (local
// rank modulo the GPUs seen). Collectives run on a stream of their own, ordered after the compute stream's
// work by an event, and a pending collective is waited on by the compute stream (another event), not by the
// host; before the host reads the device (settle: the step's loss, its norm, its end) it waits for those the compute
// stream was told to wait for, bounded by the comm timeout: a peer that never joins a collective aborts the
// communicator there, naming the step, instead of holding the host's read for ever. (Collectives nothing waits for
// yet, stages 1-2's updated parameters gathered during the next forward, run on past a settle.) Host tensors (the step's agreed figures) go through
// a device buffer and are waited for at once. Spans that are NCCL's equal pieces in
// rank order go through ncclAllGather / ncclReduceScatter in place; any others as NCCL groups of broadcasts
// (all-gather) or reduces (reduce-scatter), one a span, each rooted at the span's owner, 1024 a group. 16-bit floats are
// summed in their own dtype (NCCL's way; the plan's capabilities say so). split() forms the mesh's tensor and
// data groups as communicators of their own, met under the group's name in the world's store; split_for_messages()
// the pipeline's and the tied table's, which open none: their sends and receives go over a two-rank communicator
// and stream per direction between two ranks. A collective's or message's time (the ledger's seconds, ds profile's
// spans) is its span on the GPU's clock, from when its stream starts it to its end, read once it has run: the host
// only queues it, so the host's clock would time the queueing.
#include <cuda_runtime.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <utility>

#include "common/error.hpp"
#include "engine/runtime/comm/comm.hpp"
#include "engine/runtime/comm/nccl_group.hpp"
#include "engine/runtime/comm/rendezvous.hpp"
#include "engine/runtime/comm/watchdog.hpp"
#include "engine/runtime/device/kernel_route.hpp"  // on_host

namespace ds {
namespace {

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("CUDA: ") + what + ": " + cudaGetErrorString(e));
}

NcclElement element_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return NcclElement::f32;
    case torch::kBFloat16: return NcclElement::bf16;
    case torch::kFloat16: return NcclElement::f16;
    case torch::kFloat64: return NcclElement::f64;
    default: DS_CHECK(false, "NCCL collectives over ", t.scalar_type(), " are not used by ds");
  }
  return NcclElement::f32;
}

// The process's watchdogs over its NCCL work, one per comm timeout (one in a run: every communicator shares it): work
// unfinished a minute past the timeout ends the rank, naming it. The host's own bounded waits (settle) time out first
// where the host waits for the collectives soon after queueing them; this catches a host blocked elsewhere behind one
// (a copy to host memory, a read of the device), where nothing else would: the reason several GPU ranks could not
// offload. The report is written with write(2), not stdio, whose lock a thread blocked on the GPU may hold.
Watchdog& nccl_watchdog(std::chrono::milliseconds timeout) {
  static std::mutex m;
  static std::map<int64_t, std::unique_ptr<Watchdog>> dogs;
  std::lock_guard<std::mutex> lock(m);
  std::unique_ptr<Watchdog>& dog = dogs[timeout.count()];
  if (!dog)
    dog = std::make_unique<Watchdog>(timeout + std::chrono::seconds(60), [](const std::string& what, double waited) {
      char line[1024];
      const int n = std::snprintf(line, sizeof line,
                                  "ds: %s has not finished %.0f s after it was queued: a peer is gone or stuck, and this rank "
                                  "waited for the GPU behind it; ending this rank (exit 1; its peers' own waits time out)\n",
                                  what.c_str(), waited);
      if (n > 0) (void)!::write(2, line, std::min(static_cast<size_t>(n), sizeof line - 1));
      std::_Exit(1);
    });
  return *dog;
}

// A collective queued on the communication stream: waiting makes the compute stream wait for it, and hands its
// `done` event to `waited` (which keeps or destroys it). Dropped without a wait (an exception unwinding), it still
// orders the compute stream after it: what follows must not touch the buffer NCCL writes.
class NcclWork final : public PendingCollective {
 public:
  NcclWork(cudaEvent_t done, std::function<void(cudaEvent_t)> waited) : done_(done), waited_(std::move(waited)) {}
  ~NcclWork() override {
    if (!done_) return;
    cudaStreamWaitEvent(cudaStreamLegacy, done_, 0);
    cudaEventDestroy(done_);
  }
  void wait() override {
    if (!done_) return;
    cuda_check(cudaStreamWaitEvent(cudaStreamLegacy, done_, 0), "cudaStreamWaitEvent");  // the compute stream waits, not the host
    const cudaEvent_t done = std::exchange(done_, nullptr);
    if (waited_)
      waited_(done);
    else
      cudaEventDestroy(done);
  }

 private:
  cudaEvent_t done_;
  std::function<void(cudaEvent_t)> waited_;
};

class NcclCommunicator final : public Communicator {
 public:
  // The world: its ranks meet in the world's store, where rank 0's NCCL id reaches the others.
  NcclCommunicator(const Topology& t, std::chrono::milliseconds timeout) : Communicator(t.rank, t.world_size), timeout_(timeout) {
    int gpus = 0;
    cuda_check(cudaGetDeviceCount(&gpus), "cudaGetDeviceCount");
    if (gpus < 1) throw UserError("rank " + std::to_string(t.rank) + " sees no GPU, but the plan runs its ranks over NCCL",
                                  "run GPU ranks where CUDA_VISIBLE_DEVICES shows each its GPU, or plan for the CPU (--device cpu)");
    device_ = t.local_rank % gpus;  // as the runtime's Device picks it (make_cuda_device)
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    store_ = c10::make_intrusive<c10d::PrefixStore>("ds/nccl", open_world_store(t, timeout));
    open(share_from_rank0(*store_, "unique_id", t.rank, timeout, NcclGroup::make_unique_id, "NCCL unique id"));
  }
  // A group split from `parent` (split()): its members meet under its name in the parent's store; the first
  // member makes its id. On the parent's GPU, with the parent's timeout; it reports the parent's step. A group for
  // messages only (split_for_messages) opens no communicator of its own: only the links its messages take.
  NcclCommunicator(int place, int size, const NcclCommunicator& parent, const std::string& name, bool messages_only)
      : Communicator(place, size),
        timeout_(parent.timeout_),
        device_(parent.device_),
        store_(c10::make_intrusive<c10d::PrefixStore>("group/" + name, parent.store_)),
        parent_(&parent),
        name_(name) {
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    watchdog_ = &nccl_watchdog(timeout_);
    if (!messages_only)
      open(share_from_rank0(*store_, "unique_id", place, timeout_, NcclGroup::make_unique_id, "NCCL unique id of the group " + name));
  }
  ~NcclCommunicator() override {
    forget_work();  // (waited for below, bounded)
    for (auto& [ends, link] : links_) {
      try {
        link.group->wait(link.stream, "the last messages");
      } catch (const std::exception&) {  // aborted already: nothing left to wait for
      }
      link.group.reset();
      cudaStreamDestroy(link.stream);
    }
    try {
      if (group_) group_->wait(stream_, "the last collectives");
    } catch (const std::exception&) {
    }
    group_.reset();
    for (const GpuSpan& s : spans_) cudaEventDestroy(s.start), cudaEventDestroy(s.stop);
    for (cudaEvent_t e : spare_events_) cudaEventDestroy(e);
    if (clock_anchor_) cudaEventDestroy(clock_anchor_);
    if (newest_waited_event_) cudaEventDestroy(newest_waited_event_);
    if (staging_) cudaFree(staging_);
    if (one_) cudaFree(one_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  std::unique_ptr<Communicator> split(const std::string& name, const std::vector<int>& members) override {
    const int place = place_in(name, members);
    return std::make_unique<NcclCommunicator>(place, static_cast<int>(members.size()), *this, name, /*messages_only=*/false);
  }
  std::unique_ptr<Communicator> split_for_messages(const std::string& name, const std::vector<int>& members) override {
    const int place = place_in(name, members);
    return std::make_unique<NcclCommunicator>(place, static_cast<int>(members.size()), *this, name, /*messages_only=*/true);
  }

  // A pipeline's messages: each direction between two ranks has a communicator and a stream of its own, so a send
  // waiting for its receiver never holds up a message the other way (one stream would deadlock 1F1B: a stage's
  // next activation queued before the gradient it must first receive). The compute stream waits for a receive,
  // the host does not.
  std::unique_ptr<PendingCollective> send_async(const torch::Tensor& t, int to, CollectiveKind kind) override {
    DS_CHECK(!on_host(t) && t.is_contiguous() && to >= 0 && to < world_ && to != rank_, "an NCCL send of a host or non-contiguous tensor, or to rank ", to);
    Link& link = link_of(rank_, to);
    const Issue issue = begin(t, kind, CollectiveOp::send, static_cast<double>(t.nbytes()), link.stream);
    link.group->send(t.data_ptr(), static_cast<size_t>(t.numel()), element_of(t), 1, link.stream);
    return end(issue, link.stream);
  }
  // Both links with `peer`, the lower rank's sends first, before any message (Communicator::connect).
  void connect(int peer) override {
    DS_CHECK(peer >= 0 && peer < world_ && peer != rank_, "rank ", rank_, " of ", world_, " connecting to rank ", peer);
    // A stage's send waits on the GPU for its neighbour's receive while the receive it needs first runs beside it:
    // both kernels must be able to run at once, which one hardware queue for every stream forbids.
    if (const char* queues = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS"); queues && std::string(queues) == "1")
      throw UserError("CUDA_DEVICE_MAX_CONNECTIONS=1 puts every CUDA stream in one queue: a pipeline stage's send, waiting on the GPU "
                      "for its neighbour, would hold up the receive that neighbour waits for first, and the stages would wait for "
                      "each other until the comm timeout",
                      "unset CUDA_DEVICE_MAX_CONNECTIONS for runs with pipeline stages (Megatron's launch scripts set it to 1)");
    const int low = std::min(rank_, peer), high = std::max(rank_, peer);
    link_of(low, high);
    link_of(high, low);
  }
  void recv(const torch::Tensor& t, int from, CollectiveKind kind) override {
    const std::string what = std::string("receive of ") + collective_name(kind) + " from rank " + std::to_string(from);
    DS_CHECK(!on_host(t) && t.is_contiguous() && from >= 0 && from < world_ && from != rank_,
             "an NCCL receive into a host or non-contiguous tensor, or from rank ", from);
    Link& link = link_of(from, rank_);
    Issue issue{-1, nullptr, std::chrono::steady_clock::now(), std::string()};
    issue.stats = &count_received(kind, &issue.event);
    issue.what = what;
    start_span(issue, link.stream);  // (the buffer's memory may have been the compute stream's a moment ago)
    link.group->recv(t.data_ptr(), static_cast<size_t>(t.numel()), element_of(t), 0, link.stream);
    end(issue, link.stream)->wait();
  }

  CommCapabilities capabilities() const override { return comm_capabilities(CommBackend::nccl); }

  std::unique_ptr<PendingCollective> all_reduce_sum_async(const torch::Tensor& t, CollectiveKind kind) override {
    const NcclElement e = element_of(t);
    require_collectives("an all-reduce");
    if (on_host(t)) return all_reduce_host(t, kind, e);
    const Issue issue = begin(t, kind, CollectiveOp::all_reduce, static_cast<double>(t.numel() * t.element_size()));
    group_->all_reduce_sum(t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()), e, stream_);
    return end(issue);
  }

  std::unique_ptr<PendingCollective> all_gather_async(const torch::Tensor& t, const Ownership& owners, CollectiveKind kind) override {
    const NcclElement e = element_of(t);
    require_collectives("an all-gather");
    const Issue issue = begin(t, kind, CollectiveOp::all_gather, payload_bytes(t, owners));
    char* base = static_cast<char*>(t.data_ptr());
    const size_t bytes = static_cast<size_t>(t.element_size());
    if (const auto p = equal_pieces(owners, world_)) {
      group_->all_gather(base + (p->first + rank_ * p->size) * bytes, base + p->first * bytes, static_cast<size_t>(p->size), e, stream_);
    } else {
      grouped(owners, "queueing an all-gather of uneven spans", [&](const Span& s, int owner) {
        group_->broadcast(base + s.offset * bytes, static_cast<size_t>(s.numel), e, owner, stream_);
      });
    }
    return end(issue);
  }

  std::unique_ptr<PendingCollective> reduce_scatter_sum_async(const torch::Tensor& t, const Ownership& owners, const torch::Tensor&,
                                                              CollectiveKind kind) override {
    const NcclElement e = element_of(t);
    require_collectives("a reduce-scatter");
    const Issue issue = begin(t, kind, CollectiveOp::reduce_scatter, payload_bytes(t, owners));
    char* base = static_cast<char*>(t.data_ptr());
    const size_t bytes = static_cast<size_t>(t.element_size());
    if (const auto p = equal_pieces(owners, world_)) {
      group_->reduce_scatter_sum(base + p->first * bytes, base + (p->first + rank_ * p->size) * bytes, static_cast<size_t>(p->size), e,
                                 stream_);
    } else {
      grouped(owners, "queueing a reduce-scatter of uneven spans", [&](const Span& s, int owner) {
        group_->reduce_sum(base + s.offset * bytes, static_cast<size_t>(s.numel), e, owner, stream_);
      });
    }
    return end(issue);
  }

  void barrier() override {
    require_collectives("a barrier");
    cuda_check(cudaMemsetAsync(one_, 0, sizeof(float), stream_), "cudaMemsetAsync");
    group_->all_reduce_sum(one_, one_, 1, NcclElement::f32, stream_);
    group_->wait(stream_, "a barrier");
  }

  // The run failed elsewhere: every NCCL group of the process is aborted, then the watchdog forgets this
  // communicator's work (the run ends with its own error, not a report of a collective that will never finish).
  // In that order: a look of the watchdog's may be blocked behind the hung work, holding what forget() waits for,
  // until the abort ends that work.
  void abort(const std::string& reason) override {
    (void)reason;  // (said by the run as it ends; the launcher then ends the peers waiting for this rank)
    NcclGroup::abort_all();
    forget_work();
  }

  void mark_step(int64_t step) override {
    wait_for_waited();  // (not stamped here: a span ending now is timed in the step about to run, not between two)
    step_ = step;
  }
  // Before the host reads the device (Communicator::settle): every collective and message so far, bounded by the
  // timeout.
  // Collectives not yet waited for (stages 1-2's updated parameters, gathered while the next forward runs) are left
  // running: the compute stream does not wait for them, so nothing the host reads does either; the collectives before
  // the newest one waited for end first (one stream runs them in order).
  void settle() override {
    wait_for_waited();
    try {
      stamp_timed_events();
    } catch (...) {
      forget_work();
      throw;
    }
  }

 private:
  void wait_for_waited() {
    try {
      if (group_ && unwaited_ == 0)
        group_->wait(stream_, "the collectives " + at_step());
      else if (group_ && newest_waited_event_)
        group_->wait_event(newest_waited_event_, "the collectives " + at_step());
      for (auto& [ends, link] : links_)
        link.group->wait(link.stream, "the messages from rank " + std::to_string(ends.first) + " to rank " + std::to_string(ends.second) + " " + at_step());
    } catch (...) {
      forget_work();  // aborted: the error is the one the run ends with
      throw;
    }
  }
  // A group split for messages only has no communicator to run a collective over.
  void require_collectives(const char* what) const {
    DS_CHECK(group_, "rank ", world_rank(), ": ", what, " in the NCCL group ", name_, ", which was split for messages only");
  }
  struct Issue {
    int64_t event;
    CommStats* stats;
    std::chrono::steady_clock::time_point start;
    std::string what;  // for the watchdog: "an all_gather of updated parameters"
    cudaEvent_t began = nullptr;  // recorded on its stream before it (start_span)
  };
  // Counts the call, and orders `stream` (the collectives' own, or a link's) after what the compute stream has
  // queued (the tensor's producer).
  Issue begin(const torch::Tensor& t, CollectiveKind kind, CollectiveOp op, double payload, cudaStream_t stream) {
    DS_CHECK(t.is_contiguous(), "NCCL collectives take contiguous tensors");
    Issue issue{-1, nullptr, std::chrono::steady_clock::now(), std::string(collective_op_name(op)) + " of " + collective_name(kind)};
    issue.stats = &count(kind, op, payload, &issue.event);
    start_span(issue, stream);
    return issue;
  }
  // Orders `stream` after the compute stream's work, then marks where the call's span starts on the GPU's clock: once
  // the stream reaches it (what it waits for, and the calls queued before it on that stream, have run).
  void start_span(Issue& issue, cudaStream_t stream) {
    if (issue.event >= 0) anchor_clock();  // (its span goes onto the host's clock)
    after_compute(stream);
    issue.began = timing_event();
    cuda_check(cudaEventRecord(issue.began, stream), "cudaEventRecord");
  }
  Issue begin(const torch::Tensor& t, CollectiveKind kind, CollectiveOp op, double payload) { return begin(t, kind, op, payload, stream_); }
  static void after_compute(cudaStream_t stream) {
    cudaEvent_t ready;
    cuda_check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
    cuda_check(cudaEventRecord(ready, cudaStreamLegacy), "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(stream, ready, 0), "cudaStreamWaitEvent");
    cudaEventDestroy(ready);  // released once the wait is queued
  }
  // A group reports the world's step, as the trainer marks it there.
  std::string at_step() const {
    const int64_t step = step_now();
    return step < 0 ? "before the first step" : "of step " + std::to_string(step + 1);
  }
  int64_t step_now() const { return parent_ ? parent_->step_now() : step_; }
  int world_rank() const { return parent_ ? parent_->world_rank() : rank_; }

  // The watchdog watches what `stream` has queued so far (the work just issued) until the GPU has run it.
  void watch(const std::string& what, cudaStream_t stream) {
    cudaEvent_t ran;
    cuda_check(cudaEventCreateWithFlags(&ran, cudaEventDisableTiming), "cudaEventCreate");
    cuda_check(cudaEventRecord(ran, stream), "cudaEventRecord");
    // The watchdog's thread makes this rank's GPU current first: on a thread's default device 0 each rank would
    // create a CUDA context there (half a GiB of GPU 0 a rank).
    const int device = device_;
    watchdog_->watch(
        this, "rank " + std::to_string(world_rank()) + ": the " + what + " " + at_step() + (parent_ ? " in the group " + name_ : ""),
        [ran, device] {
          cudaSetDevice(device);
          return cudaEventQuery(ran) != cudaErrorNotReady;
        },
        [ran, device] {
          cudaSetDevice(device);
          cudaEventDestroy(ran);
        });
  }
  void forget_work() {
    if (watchdog_) watchdog_->forget(this);
  }

  // Its NCCL group (this rank's place and the group's size), its collectives' stream and the barrier's float.
  void open(const std::string& unique_id) {
    watchdog_ = &nccl_watchdog(timeout_);
    group_ = std::make_unique<NcclGroup>(unique_id, rank_, world_, device_, timeout_);
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    cuda_check(cudaMalloc(&one_, sizeof(float)), "cudaMalloc");
  }

  // The messages one way between two ranks of this group: a communicator of the two (the sender its rank 0) and a
  // stream, made by connect() before any message (both ranks meet then, bounded by the timeout), or else at the
  // first message.
  struct Link {
    std::unique_ptr<NcclGroup> group;
    cudaStream_t stream = nullptr;
  };
  Link& link_of(int from, int to) {
    const auto ends = std::make_pair(from, to);
    auto found = links_.find(ends);
    if (found != links_.end()) return found->second;
    const std::string between = "rank " + std::to_string(from) + " to rank " + std::to_string(to);
    const int place = rank_ == from ? 0 : 1;
    const std::string id = share_from_rank0(*store_, "p2p/" + std::to_string(from) + "-" + std::to_string(to), place, timeout_,
                                            NcclGroup::make_unique_id, "NCCL unique id for the messages from " + between);
    Link link;
    link.group = std::make_unique<NcclGroup>(id, place, 2, device_, timeout_);
    cuda_check(cudaStreamCreateWithFlags(&link.stream, cudaStreamNonBlocking), "cudaStreamCreate");
    return links_.emplace(ends, std::move(link)).first->second;
  }
  // Uneven spans: NCCL calls, one a non-empty span rooted at its owner, in groups of at most kMostGrouped.
  static constexpr int kMostGrouped = 1024;  // NCCL caps the operations one group may hold
  void grouped(const Ownership& owners, const std::string& what, const std::function<void(const Span&, int)>& call) {
    int in_group = 0;
    for (size_t q = 0; q < owners.size(); ++q)
      for (const Span& s : owners[q]) {
        if (s.numel <= 0) continue;
        if (in_group == 0) group_->begin_group();
        call(s, static_cast<int>(q));
        if (++in_group == kMostGrouped) group_->end_group(what), in_group = 0;
      }
    if (in_group > 0) group_->end_group(what);
  }
  // A host tensor (the step's agreed loss, norm and stop flag): through a device buffer, summed, back, and
  // waited for by the host (bounded), so the caller reads the sum when this returns.
  std::unique_ptr<PendingCollective> all_reduce_host(const torch::Tensor& t, CollectiveKind kind, NcclElement e) {
    DS_CHECK(t.is_contiguous(), "NCCL collectives take contiguous tensors");
    const size_t bytes = static_cast<size_t>(t.numel() * t.element_size());
    Issue issue{-1, nullptr, std::chrono::steady_clock::now(), std::string()};
    issue.stats = &count(kind, CollectiveOp::all_reduce, static_cast<double>(bytes), &issue.event);
    if (bytes > staging_bytes_) {
      if (staging_) cudaFree(staging_);
      staging_ = nullptr;
      cuda_check(cudaMalloc(&staging_, bytes), "cudaMalloc");
      staging_bytes_ = bytes;
    }
    cuda_check(cudaMemcpyAsync(staging_, t.data_ptr(), bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync");
    group_->all_reduce_sum(staging_, staging_, static_cast<size_t>(t.numel()), e, stream_);
    // Bounded first: a copy into pageable host memory would block until the sum lands, a dead peer's for ever.
    try {
      group_->wait(stream_, std::string("an all-reduce of ") + collective_name(kind) + " " + at_step());
    } catch (...) {
      forget_work();
      throw;
    }
    cuda_check(cudaMemcpy(t.data_ptr(), staging_, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
    issue.stats->seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - issue.start).count();
    finish_event(issue.event);
    return std::make_unique<NcclWork>(nullptr, nullptr);
  }

  std::unique_ptr<PendingCollective> end(const Issue& issue) { return end(issue, stream_); }
  std::unique_ptr<PendingCollective> end(const Issue& issue, cudaStream_t stream) {
    cudaEvent_t ended = timing_event();
    cuda_check(cudaEventRecord(ended, stream), "cudaEventRecord");
    spans_.push_back({issue.began, ended, issue.stats, issue.event});  // (its time and profile span: stamp_timed_events)
    cudaEvent_t done;
    cuda_check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
    cuda_check(cudaEventRecord(done, stream), "cudaEventRecord");
    watch(issue.what, stream);
    if (stream != stream_)  // a link's message
      return std::make_unique<NcclWork>(done, [](cudaEvent_t e) { cudaEventDestroy(e); });
    const int64_t order = issued_++;
    ++unwaited_;
    return std::make_unique<NcclWork>(done, [this, order](cudaEvent_t e) { waited(order, e); });
  }

  // The spans whose end has run: their GPU time into the ledger and, ds profile recording, onto the host's clock as
  // their events' spans. Those still running wait for a later call (a settle, a take of the events).
  void stamp_timed_events() override {
    std::vector<GpuSpan> pending = std::move(spans_);
    spans_.clear();
    size_t i = 0;
    try {
      for (; i < pending.size(); ++i) {
        const GpuSpan& s = pending[i];
        const cudaError_t ran = cudaEventQuery(s.stop);
        if (ran == cudaErrorNotReady) {
          spans_.push_back(s);
          continue;
        }
        cuda_check(ran, "cudaEventQuery");
        float ms = 0;
        cuda_check(cudaEventElapsedTime(&ms, s.start, s.stop), "cudaEventElapsedTime");
        const auto issued = s.event >= 0 ? on_host_clock(s.start) : std::chrono::steady_clock::time_point();
        // (read before anything changes: a throw above leaves the span pending, counted once when it is retried)
        s.stats->seconds += ms / 1e3;
        if (s.event >= 0) stamp_event(s.event, issued, issued + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double, std::milli>(ms)));
        spare_events_.push_back(s.start);
        spare_events_.push_back(s.stop);
      }
    } catch (...) {
      spans_.insert(spans_.end(), pending.begin() + static_cast<std::ptrdiff_t>(i), pending.end());
      throw;
    }
  }
  // Timing events are reused: a step issues hundreds of calls at stage 3.
  cudaEvent_t timing_event() {
    if (!spare_events_.empty()) {
      const cudaEvent_t e = spare_events_.back();
      spare_events_.pop_back();
      return e;
    }
    cudaEvent_t e;
    cuda_check(cudaEventCreate(&e), "cudaEventCreate");
    return e;
  }
  // Where the GPU's clock meets the host's: an event recorded on an empty stream of its own, the host's time when it
  // has run (within microseconds). Made before the first span recorded for ds profile, so that every such span starts
  // after it (a profile is short: the float milliseconds from it stay fine). Waited for at most the comm timeout.
  void anchor_clock() {
    if (clock_anchor_) return;
    cudaStream_t empty;
    cuda_check(cudaStreamCreateWithFlags(&empty, cudaStreamNonBlocking), "cudaStreamCreate");
    cudaEvent_t anchor;
    cuda_check(cudaEventCreate(&anchor), "cudaEventCreate");
    cuda_check(cudaEventRecord(anchor, empty), "cudaEventRecord");
    const auto asked = std::chrono::steady_clock::now();
    cudaError_t ran;
    while ((ran = cudaEventQuery(anchor)) == cudaErrorNotReady) {
      if (std::chrono::steady_clock::now() - asked > timeout_) {
        cudaEventDestroy(anchor);
        cudaStreamDestroy(empty);
        throw std::runtime_error("rank " + std::to_string(world_rank()) + ": an empty CUDA stream did not run within the comm timeout (the GPU is stuck)");
      }
      std::this_thread::yield();
    }
    anchor_host_ = std::chrono::steady_clock::now();
    cudaStreamDestroy(empty);
    if (ran != cudaSuccess) cudaEventDestroy(anchor);
    cuda_check(ran, "cudaEventQuery");
    clock_anchor_ = anchor;
  }
  std::chrono::steady_clock::time_point on_host_clock(cudaEvent_t e) const {
    float ms = 0;
    cuda_check(cudaEventElapsedTime(&ms, clock_anchor_, e), "cudaEventElapsedTime");
    return anchor_host_ + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double, std::milli>(ms));
  }
  // The collective issued `order`-th was waited for (its `done` event): the newest such is where settle() waits to.
  void waited(int64_t order, cudaEvent_t done) {
    --unwaited_;
    if (order < newest_waited_) {
      cudaEventDestroy(done);
      return;
    }
    if (newest_waited_event_) cudaEventDestroy(newest_waited_event_);
    newest_waited_event_ = done;
    newest_waited_ = order;
  }

  std::chrono::milliseconds timeout_;
  int device_ = 0;
  c10::intrusive_ptr<c10d::Store> store_;  // the world's, under "ds/nccl" (a group's: under its name there)
  const NcclCommunicator* parent_ = nullptr;  // a group's: the communicator it was split from
  std::string name_ = "world";
  Watchdog* watchdog_ = nullptr;
  std::map<std::pair<int, int>, Link> links_;  // by (from, to)
  std::unique_ptr<NcclGroup> group_;
  cudaStream_t stream_ = nullptr;
  void* one_ = nullptr;  // the barrier's float
  void* staging_ = nullptr;  // host tensors' all-reduces go through it
  size_t staging_bytes_ = 0;
  // The collectives on stream_: how many were issued, how many are not yet waited for (a dropped one stays counted),
  // and the newest waited for, with its event.
  int64_t issued_ = 0, unwaited_ = 0, newest_waited_ = -1;
  cudaEvent_t newest_waited_event_ = nullptr;
  // Each call's span on its stream (timing events before and after it), until its end has run and it is counted.
  struct GpuSpan {
    cudaEvent_t start, stop;
    CommStats* stats;  // (the ledger's map keeps its entries where they are)
    int64_t event;     // its profile event, -1 when not recording
  };
  std::vector<GpuSpan> spans_;
  std::vector<cudaEvent_t> spare_events_;
  cudaEvent_t clock_anchor_ = nullptr;
  std::chrono::steady_clock::time_point anchor_host_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const Topology& t, std::chrono::milliseconds timeout) {
  return std::make_unique<NcclCommunicator>(t, timeout);
}

}  // namespace ds
