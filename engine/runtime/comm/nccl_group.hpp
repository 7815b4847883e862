// ds — NCCL between GPU ranks over raw device buffers: the collectives ZeRO needs (all-reduce, and the
// native all-gather and reduce-scatter over equal pieces, in fp32, bf16, fp16 and fp64) and a pipeline's
// sends and receives, each queued on a CUDA stream, and a wait that never hangs: past the timeout the communicator is aborted and the wait
// throws naming the collective. No LibTorch: the Communicator over CUDA tensors (#39) is built on this,
// and this compiles and links wherever the CUDA toolkit and NCCL are (CI included).
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>

namespace ds {

enum class NcclElement { f32, bf16, f16, f64 };

class NcclGroup {
 public:
  // The bytes every rank must be handed to join one group (rank 0 makes them; ds's rendezvous store
  // carries them to the others).
  static std::string make_unique_id();
  // Joins the group as `rank` of `world` on CUDA device `device`, without blocking inside NCCL: past the
  // timeout (a peer that never started) the communicator is aborted and this throws. Throws
  // std::runtime_error naming NCCL's reason.
  NcclGroup(const std::string& unique_id, int rank, int world, int device, std::chrono::milliseconds timeout);
  ~NcclGroup();
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_; }

  // Queued on `stream` (a cudaStream_t). In place when send == recv (all-reduce), or where NCCL allows it
  // (all-gather: send is recv's rank()-th piece; reduce-scatter: recv is send's rank()-th piece).
  void all_reduce_sum(const void* send, void* recv, size_t count, NcclElement e, void* stream);
  // recv: world x count elements, rank q's `count` at q x count.
  void all_gather(const void* send, void* recv, size_t count, NcclElement e, void* stream);
  // send: world x count elements; recv: this rank's `count`, summed over the ranks.
  void reduce_scatter_sum(const void* send, void* recv, size_t count, NcclElement e, void* stream);

  // Several calls queued as one (ncclGroupStart / ncclGroupEnd): the broadcasts and reduces below, one a span,
  // where an all-gather's or a reduce-scatter's spans are not NCCL's equal pieces in rank order. end_group
  // settles the whole group (naming `what` on a failure or past the timeout).
  void begin_group();
  void end_group(const std::string& what);
  // In place, inside a group: `root`'s `count` elements at `buf` to every rank; every rank's summed into root's.
  void broadcast(void* buf, size_t count, NcclElement e, int root, void* stream);
  void reduce_sum(void* buf, size_t count, NcclElement e, int root, void* stream);

  // Point to point, queued on `stream`: `count` elements of `buf` to rank `peer`, or into `buf` from it. A send
  // may wait on its stream for the peer's receive (or finish into NCCL's buffers first, when small); between two
  // ranks, messages arrive in the order sent. Inside a group or alone.
  void send(const void* buf, size_t count, NcclElement e, int peer, void* stream);
  void recv(void* buf, size_t count, NcclElement e, int peer, void* stream);

  // Blocks until `stream` has run everything queued on it. A collective a peer never joins is seen here:
  // past the timeout the communicator is aborted (every rank's NCCL calls fail from then on) and this
  // throws std::runtime_error naming `what` and the seconds waited.
  void wait(void* stream, const std::string& what);
  // The same until `event` (a cudaEvent_t recorded on a stream of this group's) has happened: what was queued before
  // it, and not what followed.
  void wait_event(void* event, const std::string& what);

  // Aborts every NCCL group of the process at once (the run failed elsewhere, Communicator::abort): what they
  // have queued fails instead of spinning on peers that will never hear from this rank, and their calls throw
  // from then on.
  static void abort_all();

 private:
  // The communicator is non-blocking: after each call, its state is polled until NCCL has taken the call
  // (or failed); past the timeout it is aborted and this throws naming `what`.
  void settle(const std::string& what);
  // Polls `query` (a cudaError_t: cudaSuccess once done, cudaErrorNotReady until then) within the timeout, watching
  // the communicator's errors meanwhile: wait()'s and wait_event()'s loop.
  void poll(const std::function<int()>& query, const std::string& what);
  // A collective's call: its result (an ncclResult_t) checked (an error aborts), then settled.
  void queued(int result, const std::string& what);
  // A call inside a group: checked, settled with the group.
  void grouped(int result, const std::string& what);
  [[noreturn]] void abort_after(const std::string& what, std::chrono::steady_clock::duration waited);
  // Aborts the communicator (a failed one is never finalized), and every other NCCL group of the process, and throws
  // std::runtime_error(message). The others' kernels would otherwise spin for ever on the peer that failed this one,
  // and the first cudaFree the unwinding run makes would wait for them.
  [[noreturn]] void fail(const std::string& message);
  // Aborts the communicator, if it still stands; its calls fail from then on, naming the abort.
  void abort_now();
  // Aborts `failed` (unless null) and every group of the process, all at once, under the registry's lock.
  static void abort_together(NcclGroup* failed);
  // Throws, naming `what`, once the communicator was aborted (before any NCCL call is handed a dead one).
  void require_live(const std::string& what) const;
  void* comm_ = nullptr;  // ncclComm_t
  int rank_ = 0, world_ = 1;
  std::chrono::milliseconds timeout_;
  bool aborted_ = false;
  bool in_group_ = false;  // between begin_group and end_group
};

// The NCCL library's version, e.g. "2.27.7".
std::string nccl_version();

}  // namespace ds
