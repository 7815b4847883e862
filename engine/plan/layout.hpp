// ds — the flat parameter layout and each rank's shard, following DeepSpeed's partitioning so that
// converting to and from DeepSpeed checkpoints is mechanical (reference §4.2):
//  * stages 0-2: all trainable parameters concatenated in state_dict order into one flat buffer,
//    zero-padded at the end to a multiple of 2 x world size (DeepSpeed's nccl_start_alignment_factor
//    of 2 elements); rank r owns the r-th of world-size equal contiguous pieces (stage 0: replicated).
//  * stage 3: each parameter separately padded to a multiple of the world size; rank r owns elements
//    [r*ceil(n/W), (r+1)*ceil(n/W)) of every parameter, and its local buffer concatenates those
//    partitions in order.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/plan/model_spec.hpp"

namespace ds {

struct ParamSlot {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t offset = 0;            // in the unpadded concatenation of all parameters
  int64_t partition_numel = 0;   // stage 3: ceil(numel / W) elements per rank (incl. padding); else 0
  int64_t partition_offset = 0;  // stage 3: where this parameter's partition starts in a rank's buffer
  bool weight_decay = false;
  int layer = -1;                // transformer block, -1 outside the blocks
};

struct ShardRange {
  int64_t begin = 0, end = 0;  // [begin, end) in the padded flat buffer (stages 0-2)
  int64_t real = 0;            // elements of real parameters inside, the rest is padding
  int64_t numel() const { return end - begin; }
};

struct FlatLayout {
  int stage = 0;
  int world_size = 1;
  std::vector<ParamSlot> params;
  int64_t numel = 0;          // real elements
  int64_t padded_numel = 0;   // stages 0-2: numel rounded up to `alignment`; stage 3: sum of partitions x W
  int64_t alignment = 1;      // elements
  int64_t shard_numel = 0;    // elements each rank owns (equal on every rank, padding included)
  std::vector<ShardRange> shards;  // one per rank (stages 0-2; stage 0 ranks each hold everything)
};

FlatLayout build_layout(const ModelSpec& model, int stage, int world_size);

// Stage 3: the elements [begin, end) of parameter `p` that rank `r` owns for real (padding excluded).
ShardRange stage3_owned(const ParamSlot& p, int rank);

// A run of real elements a rank owns: `numel` elements of parameter `param` starting at `global` in
// the unpadded flat order, stored at `local` in the rank's optimizer buffers (master, moments). The
// optimizer steps these, checkpoints store them, and a resume at another world size maps them back.
struct OwnedSegment {
  int param = 0;
  int64_t global = 0, local = 0, numel = 0;
};
// What rank `rank` owns, in local order; stage 0 (and one rank) owns every parameter whole.
std::vector<OwnedSegment> owned_segments(const FlatLayout& layout, int rank);

// ZeRO's units of work at stages 2 and 3: one group per transformer block, in order, then one for
// the parameters outside the blocks (embeddings, final norm, an untied head). Gradients are reduced
// per group as backward finishes it; stage 3 gathers a group's parameters before it runs.
struct ParamGroup {
  int layer = -1;           // the block, or -1 for the parameters outside the blocks
  std::vector<int> params;  // indices into FlatLayout::params, in layout order
  int64_t numel = 0;
};
std::vector<ParamGroup> parameter_groups(const FlatLayout& layout);

// Where each block's parameters sit in the flat order, [begin, end) in block order: blocks are contiguous
// in state_dict order, the parameters outside them before and after. Stages 0-1 with overlap_comm reduce
// these ranges as backward finishes each block.
std::vector<std::pair<int64_t, int64_t>> block_ranges(const FlatLayout& layout);

// Stage 3: parameters smaller than the threshold are kept whole on every rank (DeepSpeed's
// stage3_param_persistence_threshold); their optimizer state is partitioned like the rest.
inline bool stays_whole(int64_t numel, int64_t persistence_threshold) { return numel < persistence_threshold; }
inline bool stays_whole(const ParamSlot& p, int64_t persistence_threshold) { return stays_whole(p.numel, persistence_threshold); }

}  // namespace ds
