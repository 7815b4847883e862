// ds — ZeRO across ranks: the collectives each stage issues around the training step, exactly those
// the plan's ZeRO execution lists (engine/plan/zero_plan.hpp), counted in the communicator's ledger
// under the same CollectiveKind, through the buffers it describes (engine/runtime/run/flat_params.hpp).
//   stage 0  gradients all-reduced once per step (in reduce-bucket pieces; with overlap_comm each block's
//            as the step's last backward finishes it, then the rest)
//   stage 1  the same, each rank keeping its part for its optimizer shard; updated parameters all-gathered
//   stage 2  each group's gradients (a block, or the parameters outside the blocks) reduce-scattered into
//            the owners' parts as soon as backward finishes the group, so the whole gradient is never held;
//            with overlap_comm the reduce runs while backward goes on (a block's during the next
//            block's backward, the outer parameters' during the next micro step's forward)
//   stage 3  stage 2, plus parameters partitioned: a block is gathered before it runs (the next block
//            prefetched while the current one computes) and again for its backward; the parameters
//            outside the blocks once per step, before its first forward (their buffer is their own);
//            parameters below the persistence threshold stay whole, gathered once per step after the
//            optimizer. Over Gloo every rank's partitions land straight in the group buffer (point-to-
//            point spans); a staged gather (ZeroExecution::gather_staged) packs them first.
//            Two buffers serve all blocks, so block l's weights are overwritten by block l+2's gather
//            while autograd still holds views of them: gathers write around autograd's version
//            counters, and the re-gather before block l's backward restores the very same bits.
//            Frozen tensors (LoRA's base, model.freeze) partitioned by the plan go the same way, in a
//            gather of their own beside their block's (they are held in the compute dtype).
// With zero_optimization.reduce_scatter false (and at stage 1 on Gloo) gradients are all-reduced instead
// and each rank keeps its part.
#pragma once

#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/plan/plan.hpp"
#include "engine/runtime/comm/comm.hpp"
#include "engine/runtime/run/flat_params.hpp"
#include "engine/runtime/run/host_work.hpp"
#include "engine/runtime/model/language_model.hpp"
#include "engine/runtime/io/nvme_swap.hpp"

namespace ds {

class ZeroExchange : public BlockHooks {
 public:
  // `comm` null: one rank, every call below is a no-op. `param_swap`: the rank's partition is on NVMe
  // (stage 3, offload_param.device=nvme): each gather reads its partitions from there (a prefetch's
  // reads run while the current block computes; its collective follows them).
  ZeroExchange(const Plan& plan, FlatParams& flat, Communicator* comm, ParamSwapper* param_swap = nullptr);
  ~ZeroExchange() override;

  // Around each micro step: stage 3 gathers the parameters outside the blocks before a step's first
  // forward, and before every evaluation (`evaluation` counts those gathers apart from training's);
  // before backward, the previous micro step's reduce in flight (overlap_comm) finishes; after
  // backward, stages 2-3 reduce the outer parameters' gradients.
  void begin_micro_step(bool evaluation);
  // `last`: the step's last micro step, whose backward finishes the gradients (stages 0-1 with
  // overlap_comm reduce each block's then).
  void begin_backward(bool last = false);
  void end_micro_step();
  // After the last micro step: stages 0-1 reduce the accumulated gradients.
  void reduce_gradients();
  // Around a step's gradients: begin zeroes them, except where this rank's part arrives on the host block by
  // block (ZeRO-Offload from a GPU): there each segment's first arrival of the step is copied in and later ones
  // added, which saves a pass writing every gradient, and end (after reduce_gradients) zeroes what no arrival
  // reached (gaps between segments, parameters no group reduced).
  void begin_gradient_sums();
  void end_gradient_sums();
  bool sums_on_host() const;  // begin leaves the gradients as they are
  // The sum of squares of this rank's gradients; `partial` says whether ranks must add theirs.
  double grad_sum_of_squares(bool* partial) const;
  // The same written to *out, in the gradients' memory, without waiting for it (KernelTable::sum_of_squares_to).
  void grad_sum_of_squares_to(double* out, bool* partial) const;
  // The same over the owned segments of the parameters `counted` marks (tensor parallel: a tensor rank other
  // than the first leaves out the tensors every tensor rank holds whole, so the mesh counts them once).
  double grad_sum_of_squares_of(const std::vector<uint8_t>& counted) const;
  // Figures each rank computed over its own partition (Lamb's per-tensor norms), summed over the data group
  // in place: a no-op on one rank and where nothing is partitioned (every rank holds the whole of each tensor).
  void sum_over_partitions(double* values, size_t n) const;
  // After the optimizer changed this rank's part (and at the start): every rank gets the new weights. Stages 1-2
  // gathering ahead (plan.execution.gather_ahead) leave the pieces in flight: the next forward waits for each as its
  // blocks need it (before the embeddings, before each block, after the last), and the next backward for any left.
  void publish_parameters();
  // Before anything else reads the weights (a checkpoint, a validation, the run's end): the pieces still in flight.
  void finish_published() { finish_published(std::numeric_limits<int64_t>::max()); }
  // How many pieces of the updated parameters are still in flight.
  size_t published_in_flight() const { return published_.size(); }
  // The speculative step (ZeroExecution::step_in_backward): `f` is called on the step's last micro step as each
  // block's gradients have all arrived in this rank's host sums (`layer`: the block; `written`: the compute stream's
  // point just after that block's backward, when the blocks from it up have done reading their weights).
  using FinalGradients = std::function<void(int64_t layer, const Event& written)>;
  void on_final_gradients(FinalGradients f) { on_final_ = std::move(f); }
  // The host's offload work this step, span by span (ds profile): the gradients' sums here, the step's own work
  // through the same log (one log, so each span knows the hook it ran in).
  HostWorkLog& host_work() { return host_work_; }
  // Whether the model must call the block hooks below: grouped stages, and stages 0-1 reducing blocks as
  // backward finishes them.
  bool hooks_blocks() const { return flat_.grouped || !block_ranges_.empty(); }

  void before_forward(int64_t layer) override;
  // After the last block's forward: the previous micro step's reduce of the outer gradients finishes,
  // since the fused head writes its weight's gradient in its forward.
  void after_forward(int64_t layer) override;
  void before_backward(int64_t layer) override;
  void after_backward(int64_t layer) override;

 private:
  struct Gather;
  // What stage 3 gathers: the trained parameters or the frozen tensors, each laid out by a stage-3 layout
  // with this rank's partitions, block buffers and (staged) packing buffers of its own.
  struct Partitioned {
    const FlatLayout* layout = nullptr;
    torch::Tensor partitions;             // this rank's, in the layout's order (undefined when they are on NVMe)
    Place place = Place::device;          // where `partitions` lives (the host under offload_param)
    bool on_nvme = false;                 // read through the ParamSwapper
    bool staged = false;                  // packed through staging[0] ([1]: the prefetch's) before unpacking
    torch::Tensor staging[2];
    torch::Tensor blocks[2];              // block l gathered into [l % 2]
    const std::vector<int64_t>* block_offset = nullptr;  // per parameter of the layout: its place in a block buffer
    std::vector<std::vector<int>> per_block;  // per block: its parameters gathered on use
    std::unique_ptr<Gather> prefetch;     // the next block's gather in flight
  };
  // `prefetch`: packs into the prefetch's staging buffer (at most one gather of each kind is in flight).
  std::unique_ptr<Gather> start_gather(Partitioned& from, const std::vector<int>& params, torch::Tensor dest,
                                       const std::vector<int64_t>& offsets, CollectiveKind what, bool prefetch);
  void finish(Gather& g);
  // This rank's partitions into a gather's device buffer: a counted copy when they live on the host (on one rank into a
  // gather's destination, `ahead`: a copy the gather's finish makes the compute stream wait for).
  void take_partitions(const Partitioned& from, const torch::Tensor& dst, const torch::Tensor& src, Gather* ahead = nullptr);
  // The gather's own partitions are packed and its collective issued (NVMe: after the reads).
  void issue(Gather& g);
  void gather_block(int64_t layer, CollectiveKind what, int64_t prefetch);
  void gather_block(Partitioned& from, int64_t layer, CollectiveKind what, int64_t prefetch);
  // The pieces of the updated parameters in flight that start before element `before`, in order.
  void finish_published(int64_t before);
  struct Reduce;
  void start_reduce(const ParamGroup& g, const torch::Tensor& buf);
  // The reduces in flight finished, oldest first, until `keep` are left: each summed, then its block's hook run.
  void finish_reduces(size_t keep);
  // A reduce's gradients summed into this rank's (its collective or its copy waited for), its buffer released; then,
  // apart (start_reduce queues a block's copy out between the two), the speculative step's hook of its block.
  void sum_reduce(Reduce& r);
  // (sum_reduce's sum, once its gradients are there; the time of the copies it makes to the host added to *copying)
  void add_reduced(Reduce& r, std::optional<HostWorkLog::Clock::duration>* copying = nullptr);
  void final_hook(const Reduce& r);
  // A reduce's group buffer zeroed for the next block that writes it, once its copy to the host has left it.
  void release(Reduce& r);
  // Gradients reduced in reduce_bucket_size pieces, reduce-scattered to `owners` (group g's, through the
  // scratch) or else all-reduced; `wait_each` finishes each before the next starts.
  // Gradients [at, at + n) of compute_grads (stages 0-1): all-reduced, or at stage 1 over a library with its
  // own reduce-scatter, reduce-scattered to the shards' owners.
  std::vector<std::unique_ptr<PendingCollective>> reduce_range(int64_t at, int64_t n, bool wait_each);
  // Stages 0-1 accumulating wider than backward writes (micro_grads): [at, at + n) of this micro-batch's
  // gradients added into the step's (fp32) and zeroed for the next.
  void add_micro_gradients(int64_t at, int64_t n);
  std::vector<std::unique_ptr<PendingCollective>> reduce_in_pieces(const torch::Tensor& t, const Ownership* owners, bool wait_each);

  const Plan& plan_;
  FlatParams& flat_;
  Communicator* comm_;
  ParamSwapper* param_swap_ = nullptr;
  bool stage3_ = false;
  bool native_scatter_ = false;  // the library reduce-scatters itself (NCCL): no receive scratch
  bool scatter_shards_ = false;  // stage 1 on such a library: each rank receives its shard's sum only
  bool evaluating_ = false;
  bool last_backward_ = false;  // the step's last micro step's backward (until the next step begins)
  FinalGradients on_final_;
  HostWorkLog host_work_;
  bool outer_gathered_ = false;  // stage 3: the outer parameters hold this step's weights
  bool gather_ahead_ = false;    // stages 1-2: the updated parameters' pieces are waited for as the forward needs them
  std::vector<int64_t> block_end_;  // gathering ahead: per block, where its parameters end in the flat buffer
  int64_t front_end_ = 0;           // ... and where the first block's begin (what lies before is read first)
  std::deque<std::pair<int64_t, std::unique_ptr<PendingCollective>>> published_;  // (a piece's first element, it), in order
  std::vector<ParamGroup> groups_;         // blocks in order, then the outer parameters
  std::vector<Ownership> group_owners_;    // grouped reduce-scatter: per group, what each rank owns of its buffer
  Ownership shard_owners_;                 // stages 1-2: each rank's shard of the padded buffer
  std::vector<int> owned_of_param_;        // index into flat_.owned, or -1
  std::vector<uint8_t> summed_;            // per owned segment: an arrival is in this step's sum (host sums only)
  Partitioned trained_, frozen_;           // stage 3: the trained parameters; the frozen ones the plan partitions
  std::vector<int> outer_;                 // stage 3: the parameters outside the blocks gathered on use
  std::vector<int> whole_;                 // stage 3: parameters kept whole
  // grouped: the group reduces in flight, oldest first (one; gradient_lag + 1 where blocks' gradients land late;
  // finished at once without overlap_comm)
  std::deque<std::unique_ptr<Reduce>> reducing_;
  size_t next_arrival_ = 0;                // ... the block_arrivals buffer the next block's gradients land in
  std::vector<std::pair<int64_t, int64_t>> block_ranges_;  // stages 0-1 with overlap_comm: each block's flat range
  // Per block of the model: its group in groups_ and its range in block_ranges_, -1 for a block with nothing
  // that trains (model.freeze: its parameters are not in the layout, and it has no gradients to reduce).
  std::vector<int> group_of_block_, range_of_block_;
  bool reducing_blocks_ = false;           // ... and this backward reduces them as it goes
  std::vector<std::unique_ptr<PendingCollective>> block_reduces_;  // ... those in flight
};

}  // namespace ds
