// ds — the Communicator over NCCL (comm.hpp's interface on CUDA tensors), one rank a GPU. The unique id goes
// through the world's store (rendezvous.hpp); LOCAL_RANK picks the GPU as the runtime's Device does (local
// rank modulo the GPUs seen). Collectives run on a stream of their own, ordered after the compute stream's
// work by an event, and a pending collective is waited on by the compute stream (another event), not by the
// host; the host waits for them once a step (mark_step), bounded by the comm timeout: a peer that never
// joins a collective aborts the communicator there, naming the step. Spans that are NCCL's equal pieces in
// rank order go through ncclAllGather / ncclReduceScatter in place; any others as one group of broadcasts
// (all-gather) or reduces (reduce-scatter), one a span, each rooted at the span's owner. 16-bit floats are
// summed in their own dtype (NCCL's way; the plan's capabilities say so).
#include <cuda_runtime.h>

#include <optional>
#include <stdexcept>

#include "common/error.hpp"
#include "engine/runtime/comm/comm.hpp"
#include "engine/runtime/comm/nccl_group.hpp"
#include "engine/runtime/comm/rendezvous.hpp"

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

// The first element and the piece size when `owners` are NCCL's layout: one span a rank, all of one size, rank
// q's at first + q x size.
std::optional<std::pair<int64_t, int64_t>> equal_pieces(const Ownership& owners) {
  if (owners.empty() || owners[0].size() != 1) return std::nullopt;
  const int64_t first = owners[0][0].offset, size = owners[0][0].numel;
  for (size_t q = 0; q < owners.size(); ++q)
    if (owners[q].size() != 1 || owners[q][0].numel != size || owners[q][0].offset != first + static_cast<int64_t>(q) * size)
      return std::nullopt;
  return std::make_pair(first, size);
}

// A collective queued on the communication stream: waiting makes the compute stream wait for it.
class NcclWork final : public PendingCollective {
 public:
  NcclWork(cudaEvent_t done, std::function<void()> finished) : done_(done), finished_(std::move(finished)) {}
  ~NcclWork() override {
    if (done_) cudaEventDestroy(done_);
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
    if (one_) cudaFree(one_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  CommCapabilities capabilities() const override { return comm_capabilities(CommBackend::nccl); }

  std::unique_ptr<PendingCollective> all_reduce_sum_async(const torch::Tensor& t, CollectiveKind kind) override {
    const Issue issue = begin(t, kind, CollectiveOp::all_reduce, static_cast<double>(t.numel() * t.element_size()));
    group_->all_reduce_sum(t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()), element_of(t), stream_);
    return end(issue);
  }

  std::unique_ptr<PendingCollective> all_gather_async(const torch::Tensor& t, const Ownership& owners, CollectiveKind kind) override {
    const Issue issue = begin(t, kind, CollectiveOp::all_gather, payload_bytes(t, owners));
    char* base = static_cast<char*>(t.data_ptr());
    const size_t bytes = static_cast<size_t>(t.element_size());
    if (const auto pieces = equal_pieces(owners)) {
      const auto [first, size] = *pieces;
      group_->all_gather(base + (first + rank_ * size) * bytes, base + first * bytes, static_cast<size_t>(size), element_of(t), stream_);
    } else {
      group_->begin_group();
      for (size_t q = 0; q < owners.size(); ++q)
        for (const Span& s : owners[q])
          if (s.numel > 0)
            group_->broadcast(base + s.offset * bytes, static_cast<size_t>(s.numel), element_of(t), static_cast<int>(q), stream_);
      group_->end_group("queueing an all-gather of uneven spans");
    }
    return end(issue);
  }

  std::unique_ptr<PendingCollective> reduce_scatter_sum_async(const torch::Tensor& t, const Ownership& owners, const torch::Tensor&,
                                                              CollectiveKind kind) override {
    const Issue issue = begin(t, kind, CollectiveOp::reduce_scatter, payload_bytes(t, owners));
    char* base = static_cast<char*>(t.data_ptr());
    const size_t bytes = static_cast<size_t>(t.element_size());
    if (const auto pieces = equal_pieces(owners)) {
      const auto [first, size] = *pieces;
      group_->reduce_scatter_sum(base + first * bytes, base + (first + rank_ * size) * bytes, static_cast<size_t>(size), element_of(t),
                                 stream_);
    } else {
      group_->begin_group();
      for (size_t q = 0; q < owners.size(); ++q)
        for (const Span& s : owners[q])
          if (s.numel > 0)
            group_->reduce_sum(base + s.offset * bytes, static_cast<size_t>(s.numel), element_of(t), static_cast<int>(q), stream_);
      group_->end_group("queueing a reduce-scatter of uneven spans");
    }
    return end(issue);
  }

  void barrier() override {
    cuda_check(cudaMemsetAsync(one_, 0, sizeof(float), stream_), "cudaMemsetAsync");
    group_->all_reduce_sum(one_, one_, 1, NcclElement::f32, stream_);
    group_->wait(stream_, "a barrier");
  }

  // Once a step the host waits for the step's collectives, bounded: a peer that never joined one is found here.
  void mark_step(int64_t step) override {
    group_->wait(stream_, "the collectives of step " + std::to_string(step_));
    step_ = step;
  }

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
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const Topology& t, std::chrono::milliseconds timeout) {
  return std::make_unique<NcclCommunicator>(t, timeout);
}

}  // namespace ds
