#include "engine/runtime/comm/nccl_group.hpp"
#include "kernels/cuda/check.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

namespace ds {
namespace {

ncclComm_t as_comm(void* c) { return static_cast<ncclComm_t>(c); }
cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

void check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess && r != ncclInProgress)
    throw std::runtime_error(std::string("NCCL: ") + what + ": " + ncclGetErrorString(r) + " (" + ncclGetLastError(nullptr) + ")");
}

using ds::cuda::check;

ncclDataType_t type_of(NcclElement e) {
  switch (e) {
    case NcclElement::f32: return ncclFloat32;
    case NcclElement::bf16: return ncclBfloat16;
    case NcclElement::f16: return ncclFloat16;
    case NcclElement::f64: return ncclFloat64;
  }
  return ncclFloat32;
}

// Every NCCL group of the process, so that one failing aborts them all.
std::mutex& registry_lock() {
  static std::mutex m;
  return m;
}
std::set<NcclGroup*>& registry() {
  static std::set<NcclGroup*> groups;
  return groups;
}

}  // namespace

std::string NcclGroup::make_unique_id() {
  ncclUniqueId id;
  check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  return std::string(id.internal, sizeof id.internal);
}

NcclGroup::NcclGroup(const std::string& unique_id, int rank, int world, int device, std::chrono::milliseconds timeout)
    : rank_(rank), world_(world), timeout_(timeout) {
  if (unique_id.size() != NCCL_UNIQUE_ID_BYTES)
    throw std::runtime_error("NCCL: a unique id of " + std::to_string(unique_id.size()) + " bytes (" +
                             std::to_string(NCCL_UNIQUE_ID_BYTES) + " expected)");
  check(cudaSetDevice(device), "cudaSetDevice");
  ncclUniqueId id;
  unique_id.copy(id.internal, sizeof id.internal);
  // Non-blocking: the join is polled against the timeout, so a peer that never starts is a named error,
  // not a process stuck inside ncclCommInitRank.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t started = ncclCommInitRankConfig(&comm, world, id, rank, &config);
  comm_ = comm;
  {
    std::lock_guard<std::mutex> lock(registry_lock());
    registry().insert(this);
  }
  if (started != ncclSuccess && started != ncclInProgress) fail(std::string("NCCL: ncclCommInitRankConfig: ") + ncclGetErrorString(started));
  settle("joining the NCCL group of " + std::to_string(world) + " ranks (every rank must join within the timeout)");
}

NcclGroup::~NcclGroup() {
  {
    std::lock_guard<std::mutex> lock(registry_lock());
    registry().erase(this);
  }
  if (!comm_) return;
  ncclComm_t comm = as_comm(comm_);
  // Finalizing flushes what is queued (polled: a non-blocking communicator answers ncclInProgress); a peer gone
  // meanwhile must not hold the process at its exit.
  if (!aborted_) {
    const ncclResult_t r = ncclCommFinalize(comm);
    aborted_ = r != ncclSuccess && r != ncclInProgress;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  ncclResult_t state = ncclInProgress;
  while (!aborted_ && ncclCommGetAsyncError(comm, &state) == ncclSuccess && state == ncclInProgress) {
    if (std::chrono::steady_clock::now() > deadline) aborted_ = true;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  if (aborted_ || state != ncclSuccess)
    ncclCommAbort(comm);
  else
    ncclCommDestroy(comm);
}

void NcclGroup::require_live(const std::string& what) const {
  if (!comm_) throw std::runtime_error("rank " + std::to_string(rank_) + ": " + what + ": the NCCL communicator was aborted earlier");
}

void NcclGroup::queued(int result, const std::string& what) {
  if (in_group_) return grouped(result, what);  // settled with the group
  if (!comm_) throw std::runtime_error("rank " + std::to_string(rank_) + ": " + what + ": the NCCL communicator was aborted earlier");
  const auto r = static_cast<ncclResult_t>(result);
  if (r != ncclSuccess && r != ncclInProgress)
    fail("rank " + std::to_string(rank_) + ": " + what + ": NCCL: " + ncclGetErrorString(r) + " (" + ncclGetLastError(nullptr) + ")");
  settle(what);
}

void NcclGroup::settle(const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t asked = ncclCommGetAsyncError(as_comm(comm_), &state);
    if (asked != ncclSuccess) state = asked;
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) fail("rank " + std::to_string(rank_) + ": " + what + ": NCCL: " + ncclGetErrorString(state) + " (" + ncclGetLastError(nullptr) + ")");
    const auto waited = std::chrono::steady_clock::now() - start;
    if (waited > timeout_) abort_after(what, waited);
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void NcclGroup::abort_after(const std::string& what, std::chrono::steady_clock::duration waited) {
  fail("rank " + std::to_string(rank_) + ": " + what + " did not finish within " +
       std::to_string(std::chrono::duration_cast<std::chrono::seconds>(waited).count()) +
       " s (a peer never joined it); the NCCL communicator was aborted");
}

void NcclGroup::fail(const std::string& message) {
  // A communicator that saw an error is aborted (NCCL's rule), never finalized: what is queued fails
  // instead of waiting for ever, and nothing of it leaks when a constructor throws. The process's other groups go
  // with it (their peers are the same ranks, or the run is ending anyway), all at once: an abort frees memory, which
  // may wait for another group's kernel still spinning on the dead peer until that group is aborted too.
  abort_together(this);
  throw std::runtime_error(message);
}

void NcclGroup::abort_all() { abort_together(nullptr); }

void NcclGroup::abort_together(NcclGroup* failed) {
  std::lock_guard<std::mutex> lock(registry_lock());  // (no group is destroyed meanwhile)
  if (failed) registry().erase(failed);  // (a constructor that throws in fail() never reaches the destructor that would)
  std::vector<std::thread> aborting;
  if (failed) aborting.emplace_back([failed] { failed->abort_now(); });
  for (NcclGroup* g : registry()) aborting.emplace_back([g] { g->abort_now(); });
  for (std::thread& t : aborting) t.join();
}

void NcclGroup::abort_now() {
  if (comm_) ncclCommAbort(as_comm(comm_));
  comm_ = nullptr;
  aborted_ = true;
  in_group_ = false;
}

void NcclGroup::all_reduce_sum(const void* send, void* recv, size_t count, NcclElement e, void* stream) {
  require_live("queueing an all-reduce");
  queued(ncclAllReduce(send, recv, count, type_of(e), ncclSum, as_comm(comm_), as_stream(stream)), "queueing an all-reduce");
}

void NcclGroup::all_gather(const void* send, void* recv, size_t count, NcclElement e, void* stream) {
  require_live("queueing an all-gather");
  queued(ncclAllGather(send, recv, count, type_of(e), as_comm(comm_), as_stream(stream)), "queueing an all-gather");
}

void NcclGroup::reduce_scatter_sum(const void* send, void* recv, size_t count, NcclElement e, void* stream) {
  require_live("queueing a reduce-scatter");
  queued(ncclReduceScatter(send, recv, count, type_of(e), ncclSum, as_comm(comm_), as_stream(stream)), "queueing a reduce-scatter");
}

void NcclGroup::begin_group() {
  if (!comm_) throw std::runtime_error("rank " + std::to_string(rank_) + ": the NCCL communicator was aborted earlier");
  check(ncclGroupStart(), "ncclGroupStart");
  in_group_ = true;
}

void NcclGroup::end_group(const std::string& what) {
  in_group_ = false;
  queued(ncclGroupEnd(), what);
}

void NcclGroup::grouped(int result, const std::string& what) {
  const auto r = static_cast<ncclResult_t>(result);
  if (r != ncclSuccess && r != ncclInProgress) {
    ncclGroupEnd();  // close the group before the communicator is aborted
    in_group_ = false;
    fail("rank " + std::to_string(rank_) + ": " + what + ": NCCL: " + ncclGetErrorString(r) + " (" + ncclGetLastError(nullptr) + ")");
  }
}

void NcclGroup::broadcast(void* buf, size_t count, NcclElement e, int root, void* stream) {
  require_live("queueing a broadcast");
  grouped(ncclBroadcast(buf, buf, count, type_of(e), root, as_comm(comm_), as_stream(stream)), "queueing a broadcast");
}

void NcclGroup::reduce_sum(void* buf, size_t count, NcclElement e, int root, void* stream) {
  require_live("queueing a reduce");
  grouped(ncclReduce(buf, buf, count, type_of(e), ncclSum, root, as_comm(comm_), as_stream(stream)), "queueing a reduce");
}

void NcclGroup::send(const void* buf, size_t count, NcclElement e, int peer, void* stream) {
  require_live("queueing a send");
  queued(ncclSend(buf, count, type_of(e), peer, as_comm(comm_), as_stream(stream)), "queueing a send to rank " + std::to_string(peer));
}

void NcclGroup::recv(void* buf, size_t count, NcclElement e, int peer, void* stream) {
  require_live("queueing a receive");
  queued(ncclRecv(buf, count, type_of(e), peer, as_comm(comm_), as_stream(stream)), "queueing a receive from rank " + std::to_string(peer));
}

void NcclGroup::wait(void* stream, const std::string& what) {
  poll([stream] { return static_cast<int>(cudaStreamQuery(as_stream(stream))); }, what);
}

void NcclGroup::wait_event(void* event, const std::string& what) {
  poll([event] { return static_cast<int>(cudaEventQuery(static_cast<cudaEvent_t>(event))); }, what);
}

void NcclGroup::poll(const std::function<int()>& query, const std::string& what) {
  if (!comm_) throw std::runtime_error("rank " + std::to_string(rank_) + ": " + what + ": the NCCL communicator was aborted earlier");
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const auto q = static_cast<cudaError_t>(query());
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) fail("rank " + std::to_string(rank_) + ": " + what + ": CUDA: " + cudaGetErrorString(q));
    ncclResult_t async = ncclSuccess;
    const ncclResult_t asked = ncclCommGetAsyncError(as_comm(comm_), &async);
    if (asked != ncclSuccess) async = asked;
    if (async != ncclSuccess && async != ncclInProgress)
      fail("rank " + std::to_string(rank_) + ": " + what + ": NCCL: " + ncclGetErrorString(async) + " (" + ncclGetLastError(nullptr) + ")");
    const auto waited = std::chrono::steady_clock::now() - start;
    if (waited > timeout_) abort_after(what, waited);
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z from 2.9 on.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

}  // namespace ds
