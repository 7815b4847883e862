// ds — the collectives one optimizer step issues, with their sizes: exactly the calls the runtime
// makes (engine/runtime/run/zero.cpp), so `ds train` can report bytes sent beside this prediction.
// Wire bytes per rank assume ring algorithms: all-reduce moves 2(W-1)/W of the payload, reduce-scatter
// and all-gather (W-1)/W. On Gloo (CPU ranks) ds builds the reduce-scatter and the all-gather from
// point-to-point sends (each rank sends every other rank the elements that rank owns), which move
// exactly those bytes; Gloo's own all-gather is a third as fast as its all-reduce here, and LibTorch
// 1.13's Gloo has no reduce-scatter. Gloo's all-reduce cannot sum 16-bit floats: it runs on an fp32 copy.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>


namespace ds {

// send: point to point, one rank to another (a pipeline stage's activations or their gradient).
enum class CollectiveOp { all_reduce, reduce_scatter, all_gather, send };
const char* collective_op_name(CollectiveOp op);

// How often a collective runs: once per optimizer step, or at each of its micro steps.
enum class Cadence { per_step, per_micro_step };
const char* cadence_name(Cadence c);  // "per step" | "per micro step"

// What a collective carries: the plan lists them, the runtime issues and counts them under the same kind,
// and collective_name is the one place their names are spelled.
enum class CollectiveKind {
  control,                // the mean loss, the gradient norm and the stop flag, agreed each step
  lamb_norms,             // Lamb: each tensor's ||w|| and ||u|| summed over its parts
  lamb_norms_tensor,      // Lamb with tensor parallelism: the same summed over the tensor group (a split tensor's parts)
  gradients,              // the gradient reduction
  updated_parameters,     // stages 1-2: every rank's updated part, after the optimizer
  parameters_forward,     // stage 3: a block gathered before its forward
  parameters_outer,       // stage 3: the parameters outside the blocks, before a step's first forward
  parameters_backward,    // stage 3: a block gathered again before its backward
  parameters_whole,       // stage 3: the parameters kept whole, after the optimizer
  frozen_parameters,      // stage 3: a block's frozen tensors (LoRA's base, model.freeze), before its forward and its backward
  parameters_validation,  // stage 3: gathers for validation (not part of a training step)
  validation_loss,        // each rank's share of the validation loss, summed (validation steps only)
  tensor_activations,     // tensor parallel: a block's partial outputs (forward) and its input's gradients (backward)
  pipeline_activations,   // pipeline parallel: a stage's output sent to the next stage
  pipeline_gradients,     // pipeline parallel: the gradient of a stage's input sent back to the stage before
  tied_embedding,         // pipeline parallel: a tied head's copy sends its gradient to the first stage, which sends the table's weights back
};
const char* collective_name(CollectiveKind kind);
// What a pipeline stage waits in for the other stages: its neighbours' activations and their gradients, the tied
// table's exchange, and the step's agreement (where a stage that finished first waits for the others).
inline bool waits_for_other_stages(CollectiveKind kind) {
  return kind == CollectiveKind::pipeline_activations || kind == CollectiveKind::pipeline_gradients ||
         kind == CollectiveKind::tied_embedding || kind == CollectiveKind::control;
}

// The library a run's collectives go through, decided by the plan (from the device): Gloo between CPU
// ranks (no 16-bit all-reduce, no reduce-scatter: ds builds them from point-to-point sends), NCCL
// between GPUs. Ranks as threads of one process (LocalGroup, the tests) behave as Gloo does.
enum class CommBackend { gloo, nccl };
const char* comm_backend_name(CommBackend backend);

// What a backend's collectives do natively, read by the plan to decide how ZeRO uses them (scatter,
// gather_staged, the gradients' wire dtype). Each Communicator reports the same (capabilities()), checked
// when it is created, so the plan and the library cannot disagree.
struct CommCapabilities {
  bool native_reduce_scatter = false;  // else point-to-point sends into a receive scratch of (W-1) parts
  bool gathers_into_spans = false;     // an all-gather lands every rank's spans in place; else equal packed pieces
  bool sums_16bit = false;             // all-reduce sums bf16/fp16 itself; else through an fp32 copy
  bool operator==(const CommCapabilities& o) const {
    return native_reduce_scatter == o.native_reduce_scatter && gathers_into_spans == o.gathers_into_spans && sums_16bit == o.sums_16bit;
  }
};
CommCapabilities comm_capabilities(CommBackend backend);

struct Collective {
  CollectiveKind kind = CollectiveKind::gradients;
  CollectiveOp op = CollectiveOp::all_reduce;
  Cadence when = Cadence::per_step;
  int64_t calls_per_step = 0;  // bucketed calls
  int64_t elements_per_step = 0;  // all-gather: the gathered (output) elements
  int dtype_bytes = 0;
  double payload_bytes_per_step = 0;
  double wire_bytes_per_rank_per_step = 0;
  std::string note;            // e.g. why a reduce-scatter runs as an all-reduce
  const char* what() const { return collective_name(kind); }
};

// Which elements of a buffer each rank holds (an all-gather) or receives the sum of (a reduce-scatter):
// owners[q] lists rank q's (offset, numel) pieces, in order. Every rank describes a collective with the
// same lists.
struct Span {
  int64_t offset = 0, numel = 0;
};
using Ownership = std::vector<std::vector<Span>>;
int64_t span_elements(const std::vector<Span>& spans);
// The owners of the elements [at, at + n) of a buffer, with offsets from `at`: a bucket's share.
Ownership clip(const Ownership& owners, int64_t at, int64_t n);
// NCCL's layout for its all-gather and reduce-scatter: one span a rank of `world`, all of one size, rank q's at
// first + q x size. {first, size} when `owners` are so; none when not (uneven spans: grouped broadcasts/reduces).
struct EqualPieces {
  int64_t first = 0, size = 0;
};
std::optional<EqualPieces> equal_pieces(const Ownership& owners, int world);

struct Plan;
struct ZeroExecution;
// The collectives one optimizer step of this plan issues, for the execution's flags. Empty for a
// single rank: nothing crosses a wire.
std::vector<Collective> plan_collectives(const Plan& plan, const ZeroExecution& zero);
// The step's agreement (the loss, the gradient norm's sum of squares and the stop flag, 3 fp64) over `world_size` ranks.
Collective control_collective(int world_size);

// Wire bytes one rank sends for a payload (ring algorithms).
double wire_bytes_per_rank(CollectiveOp op, double payload_bytes, int world_size);

// Elements per reduction call: a group's gradients go in pieces of at most the reduce bucket.
inline int64_t calls_for(int64_t elements, int64_t bucket) {
  const int64_t b = bucket > 0 ? bucket : 1;
  return (elements + b - 1) / b;
}

// The pieces [begin, end) a collective over a flat buffer of `numel` elements is issued in: at most `bucket`
// elements each and, given the blocks' ranges (block_ranges), none crossing a block's first or last element, so
// that each block's pieces can go (or be waited for) as the compute reaches that block.
using Pieces = std::vector<std::pair<int64_t, int64_t>>;
Pieces bucket_pieces(int64_t numel, int64_t bucket, const Pieces& blocks = {});
struct FlatLayout;
// Stages 1-2's all-gather of the updated parameters (allgather_bucket_size pieces over the padded buffer), cut at
// the blocks' boundaries where the next forward waits for each block's pieces (ZeroExecution::gather_ahead), and
// where a profile measuring each step alone turned that off (the same collectives as the run it measures).
Pieces updated_parameter_pieces(const FlatLayout& layout, const ZeroExecution& zero, int64_t allgather_bucket_size);

}  // namespace ds
