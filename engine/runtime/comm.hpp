// ds — collectives between ranks, over LibTorch's c10d: Gloo for CPU tensors, rendezvous through a
// TCPStore at MASTER_ADDR:MASTER_PORT (rank 0 hosts it), the torchrun environment's convention, so
// `ds train --nproc-per-node`, `torchrun --no-python` and Slurm all start ranks the same way.
// Every collective waits at most the timeout, then throws: a dead peer ends the run, never hangs it.
// LibTorch 1.13's Gloo cannot reduce bf16 (or fp16): those are reduced through an fp32 copy, and
// the bytes counted are what went on the wire. All-gathers move raw bytes, so any dtype goes as is.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace ds {

// Per collective name (the plan's Collective::what): calls and bytes this rank sent (ring algorithms).
struct CommStats {
  std::string op;
  int64_t calls = 0;
  double bytes = 0, seconds = 0;
};
using CommLedger = std::map<std::string, CommStats>;

// An all-gather in flight; wait() finishes it (and throws if a peer failed or the timeout passed).
class PendingGather {
 public:
  virtual ~PendingGather() = default;
  virtual void wait() = 0;
};

class Communicator {
 public:
  // Joins the group the environment describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
  // Throws UserError naming the variable when one is missing or malformed.
  static std::unique_ptr<Communicator> from_environment(std::chrono::milliseconds timeout);
  ~Communicator();

  int rank() const { return rank_; }
  int world_size() const { return world_; }

  // In place: every rank ends with the element-wise sum in `t`'s storage (contiguous).
  void all_reduce_sum(const torch::Tensor& t, const std::string& what);
  // Every rank's `send` (contiguous) lands in outputs[r] (same byte size each), in any dtype.
  // Starts the collective and returns at once; call wait() before reading the outputs.
  std::unique_ptr<PendingGather> all_gather_async(const torch::Tensor& send, const std::vector<torch::Tensor>& outputs,
                                                  const std::string& what);
  void all_gather(const torch::Tensor& send, const std::vector<torch::Tensor>& outputs, const std::string& what) {
    all_gather_async(send, outputs, what)->wait();
  }
  void barrier();
  const CommLedger& ledger() const { return ledger_; }

 private:
  Communicator(int rank, int world, std::chrono::milliseconds timeout, const std::string& host, int port);
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int rank_ = 0, world_ = 1;
  CommLedger ledger_;
};

}  // namespace ds
