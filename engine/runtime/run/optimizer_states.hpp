// ds — this rank's optimizer states, walked wherever the plan put them (ZeroExecution::state_spans): each
// span in order; a span in memory (the device, or host memory under ZeRO-Offload) is one chunk (a staged one
// from a GPU: one a weight tile), a span on NVMe one sub-group at a time, read into the swapper's host buffers
// and written back (a staged one: stepped there in the plan's windows). The step, the weights
// copied from the master and the finite check all walk it, so where a state lives is decided once, by the
// plan, and a new place (pinned host windows on a copy stream) is one case here rather than a branch in each.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <vector>

#include "engine/runtime/io/nvme_swap.hpp"
#include "engine/runtime/run/flat_params.hpp"

namespace ds {

// Local elements [begin, begin + numel) of span `span`, as tensors in the memory they are in.
struct StateChunk {
  size_t span = 0;
  int64_t begin = 0, numel = 0;
  Place at = Place::device;  // the memory of the tensors below (a span on NVMe: the host buffers it goes through)
  torch::Tensor master, exp_avg, exp_avg_sq;  // fp32; undefined where the plan has no such state
};

class OptimizerStates {
 public:
  // `swapper`: the NVMe span's files (null when no span is on NVMe). Both borrowed.
  OptimizerStates(FlatParams& flat, OptimizerSwapper* swapper);

  const std::vector<StateSpan>& spans() const { return flat_.spans; }
  // Whether the part is one span in memory, stepped as one chunk: one optimizer call steps it whole (Lamb's
  // per-tensor norms need that).
  bool whole_in_memory() const { return spans().size() == 1 && spans()[0].place != Place::nvme && flat_.weight_tiles.size() <= 1; }
  // Seconds waited on the NVMe span's reads and writes so far (0 without).
  double io_wait() const { return swapper_ ? swapper_->io().wait_seconds() : 0.0; }
  // Bytes the NVMe span's files have read and written so far (0 without).
  double io_bytes() const { return swapper_ ? swapper_->io().bytes_read() + swapper_->io().bytes_written() : 0.0; }

  // The most elements one chunk of `span` holds: the span in memory, else its largest weight tile (or window) where
  // the plan tiles it, else its largest sub-group on NVMe.
  int64_t largest_chunk(const StateSpan& span) const;

  // fn(chunk) for every chunk in order. On NVMe `read`: the sub-group's states are read in first (else the
  // buffers hold whatever they held); `write`: written back after fn.
  void for_each(const std::function<void(const StateChunk&)>& fn, bool read = true, bool write = true) const;
  // Weight tile `tile` of the first span, which the plan tiles in memory (the chunk for_each gives for it).
  StateChunk tile_chunk(size_t tile) const;

 private:
  FlatParams& flat_;
  OptimizerSwapper* swapper_;
};

}  // namespace ds
