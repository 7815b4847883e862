// ds — the Communicator over NCCL (comm.hpp's interface on CUDA tensors), one rank a GPU. The unique id goes
// through the world's store (rendezvous.hpp); LOCAL_RANK picks the GPU as the runtime's Device does (local
// rank modulo the GPUs seen). Collectives run on a stream of their own, ordered after the compute stream's
// work by an event, and a pending collective is waited on by the compute stream (another event), not by the
// host; before the host reads the device (settle: the step's loss, its norm, its end) it waits for them,
// bounded by the comm timeout: a peer that never joins a collective aborts the communicator there, naming
// the step, instead of holding the host's read for ever. Host tensors (the step's agreed figures) go through
// a device buffer and are waited for at once. Spans that are NCCL's equal pieces in
// rank order go through ncclAllGather / ncclReduceScatter in place; any others as NCCL groups of broadcasts
// (all-gather) or reduces (reduce-scatter), one a span, each rooted at the span's owner, 1024 a group. 16-bit floats are
// summed in their own dtype (NCCL's way; the plan's capabilities say so).
#include <cuda_runtime.h>

#include <functional>
#include <optional>
#include <stdexcept>

#include "common/error.hpp"
#include "engine/runtime/comm/comm.hpp"
#include "engine/runtime/comm/nccl_group.hpp"
#include "engine/runtime/comm/rendezvous.hpp"
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

// A collective queued on the communication stream: waiting makes the compute stream wait for it.
// Dropped without a wait (an exception unwinding), it still orders the compute stream after it: what follows
// must not touch the buffer NCCL writes.
class NcclWork final : public PendingCollective {
 public:
  NcclWork(cudaEvent_t done, std::function<void()> finished) : done_(done), finished_(std::move(finished)) {}
  ~NcclWork() override {
    if (!done_) return;
    cudaStreamWaitEvent(cudaStreamLegacy, done_, 0);
    cudaEventDestroy(done_);
  }
  void wait() override {
    if (!done_) return;
    cuda_check(cudaStreamWaitEvent(cudaStreamLegacy, done_, 0), "cudaStreamWaitEvent");  // the compute stream waits, not the host
    cudaEventDestroy(done_);
    done_ = nullptr;
    if (finished_) finished_();
  }

 private:
  cudaEvent_t done_;
  std::function<void()> finished_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const Topology& t, std::chrono::milliseconds timeout) : Communicator(t.rank, t.world_size), timeout_(timeout) {
    int gpus = 0;
    cuda_check(cudaGetDeviceCount(&gpus), "cudaGetDeviceCount");
    if (gpus < 1) throw UserError("rank " + std::to_string(t.rank) + " sees no GPU, but the plan runs its ranks over NCCL",
                                  "run GPU ranks where CUDA_VISIBLE_DEVICES shows each its GPU, or plan for the CPU (--device cpu)");
    device_ = t.local_rank % gpus;  // as the runtime's Device picks it (make_cuda_device)
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    // Ranks meet in the world's store; rank 0's NCCL id reaches the others there.
    const auto store = open_world_store(t, timeout);
    const std::string id = share_from_rank0(*store, "ds/nccl/unique_id", t.rank, timeout, NcclGroup::make_unique_id, "NCCL unique id");
    group_ = std::make_unique<NcclGroup>(id, t.rank, t.world_size, device_, timeout);
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    cuda_check(cudaMalloc(&one_, sizeof(float)), "cudaMalloc");
  }
  ~NcclCommunicator() override {
    try {
      group_->wait(stream_, "the last collectives");
    } catch (const std::exception&) {  // aborted already: nothing left to wait for
    }
    group_.reset();
    if (staging_) cudaFree(staging_);
    if (one_) cudaFree(one_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  CommCapabilities capabilities() const override { return comm_capabilities(CommBackend::nccl); }

  std::unique_ptr<PendingCollective> all_reduce_sum_async(const torch::Tensor& t, CollectiveKind kind) override {
    const NcclElement e = element_of(t);
    if (on_host(t)) return all_reduce_host(t, kind, e);
    const Issue issue = begin(t, kind, CollectiveOp::all_reduce, static_cast<double>(t.numel() * t.element_size()));
    group_->all_reduce_sum(t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()), e, stream_);
    return end(issue);
  }

  std::unique_ptr<PendingCollective> all_gather_async(const torch::Tensor& t, const Ownership& owners, CollectiveKind kind) override {
    const NcclElement e = element_of(t);
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
    cuda_check(cudaMemsetAsync(one_, 0, sizeof(float), stream_), "cudaMemsetAsync");
    group_->all_reduce_sum(one_, one_, 1, NcclElement::f32, stream_);
    group_->wait(stream_, "a barrier");
  }

  void mark_step(int64_t step) override {
    settle();
    step_ = step;
  }
  // Before the host reads the device (Communicator::settle): every collective so far, bounded by the timeout.
  void settle() override { group_->wait(stream_, "the collectives " + at_step()); }

 private:
  struct Issue {
    int64_t event;
    CommStats* stats;
    std::chrono::steady_clock::time_point start;
  };
  // Counts the call, and orders it after what the compute stream has queued (the tensor's producer).
  Issue begin(const torch::Tensor& t, CollectiveKind kind, CollectiveOp op, double payload) {
    DS_CHECK(t.is_contiguous(), "NCCL collectives take contiguous tensors");
    Issue issue{-1, nullptr, std::chrono::steady_clock::now()};
    issue.stats = &count(kind, op, payload, &issue.event);
    cudaEvent_t ready;
    cuda_check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
    cuda_check(cudaEventRecord(ready, cudaStreamLegacy), "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(stream_, ready, 0), "cudaStreamWaitEvent");
    cudaEventDestroy(ready);  // released once the wait is queued
    return issue;
  }
  std::string at_step() const { return step_ < 0 ? "before the first step" : "of step " + std::to_string(step_ + 1); }
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
    Issue issue{-1, nullptr, std::chrono::steady_clock::now()};
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
    group_->wait(stream_, std::string("an all-reduce of ") + collective_name(kind) + " " + at_step());
    cuda_check(cudaMemcpy(t.data_ptr(), staging_, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
    issue.stats->seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - issue.start).count();
    finish_event(issue.event);
    return std::make_unique<NcclWork>(nullptr, nullptr);
  }

  std::unique_ptr<PendingCollective> end(const Issue& issue) {
    cudaEvent_t done;
    cuda_check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
    cuda_check(cudaEventRecord(done, stream_), "cudaEventRecord");
    issue.stats->seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - issue.start).count();
    const int64_t event = issue.event;
    return std::make_unique<NcclWork>(done, [this, event] { finish_event(event); });
  }

  std::chrono::milliseconds timeout_;
  int device_ = 0;
  std::unique_ptr<NcclGroup> group_;
  cudaStream_t stream_ = nullptr;
  void* one_ = nullptr;  // the barrier's float
  void* staging_ = nullptr;  // host tensors' all-reduces go through it
  size_t staging_bytes_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const Topology& t, std::chrono::milliseconds timeout) {
  return std::make_unique<NcclCommunicator>(t, timeout);
}

}  // namespace ds
