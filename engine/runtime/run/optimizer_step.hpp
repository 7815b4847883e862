// ds — one optimizer step of the training loop, as the plan describes it: the micro steps (forward,
// backward, ZeRO's exchange around them), the gradient reduction, one small collective in which the
// ranks agree on the mean loss, the global gradient norm and whether to stop, overflow handling (loss
// scale, skipped steps), DeepSpeed's clipping, the fused optimizer update of this rank's part, and the
// new weights published to every rank. The training loop (trainer.cpp) orchestrates; this does the step.
#pragma once

#include <array>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "engine/plan/plan.hpp"
#include "engine/runtime/comm/comm.hpp"
#include "engine/runtime/data/sampler.hpp"
#include "engine/runtime/run/flat_params.hpp"
#include "engine/runtime/model/language_model.hpp"
#include "engine/runtime/run/loss_scaler.hpp"
#include "engine/runtime/run/lr_schedule.hpp"
#include "engine/runtime/run/mesh_groups.hpp"
#include "engine/runtime/io/nvme_swap.hpp"
#include "engine/runtime/run/optimizer.hpp"
#include "engine/runtime/run/optimizer_states.hpp"
#include "engine/runtime/run/pipeline.hpp"
#include "engine/runtime/run/trainer_api.hpp"
#include "engine/runtime/run/zero.hpp"

namespace ds {

struct StepOutcome {
  double loss = 0;        // mean over the step's micro batches and ranks
  double norm = 0;        // global gradient norm, loss scale removed (inf/NaN on overflow)
  double lr = 0;
  double loss_scale = 1;  // the scale this step ran at (fp16)
  bool skipped = false;   // inf/NaN gradients: no update
  bool stop_requested = false;  // Ctrl-C or SIGTERM on any rank: every rank stops after this step
  std::vector<std::string> notes;  // loss-scale changes and skips, for the run log
  StepPhases phases;
  std::array<double, 8> phase_rss_bytes{};  // with sample_memory: the peak resident bytes within each phase
  std::array<double, 8> phase_device_bytes{};  // with sample_memory, on a GPU: its memory in use at each phase's end
  double offload_bytes = 0;  // optimizer offload: bytes copied between places (their time: phases.offload)
  // ZeRO-Offload stepping during the next forward (ZeroExecution::step_in_forward): the host's seconds on the last
  // update's tiles in this step's forward, their step and the waits for their staging buffers and copies (a part of
  // phases.forward; on a GPU beside the blocks it runs).
  double deferred_step_s = 0;
  // The speculative step (ZeroExecution::step_in_backward): the tiles the host stepped during the last backward, and
  // of those the ones restored from their backup (a clipped step: stepped again; a skipped one: weights put back).
  // Their extra copies (the first weights of a restored tile, the weights put back) are in speculation_bytes, not in
  // offload_bytes, which stays the plan's figure.
  int64_t speculated_tiles = 0, restored_tiles = 0;
  double speculation_bytes = 0;
  int64_t trained_tokens = -1;  // fine-tuning data: the targets the step's loss counted, on every rank; -1 otherwise
  int64_t counted_targets = -1;  // the same, kept when the step is skipped: the rows that ran through the head (FLOPs)
  int64_t attention_squares = -1;  // packed rows: their attention calls' lengths squared, summed over the step (FLOPs)
};

class OptimizerStep {
 public:
  // `groups.world` null on one rank; `swapper` null unless the optimizer's states are on NVMe, `param_swap` unless
  // the parameters are (stage 3). Everything is borrowed and must outlive this object.
  OptimizerStep(const Plan& plan, FlatParams& flat, ZeroExchange& zero, LanguageModel& model, BatchSampler& sampler,
                const MeshGroups& groups, LossScaler& scaler, OptimizerSwapper* swapper = nullptr, ParamSwapper* param_swap = nullptr);
  ~OptimizerStep();

  // The weights the model reads, from the master copy: this rank's part rounded to the stored dtype
  // (nearest even, as the optimizer kernel does; `rounded` says the kernel did it already), gathered
  // from every rank, then widened to the compute dtype where the two differ (CPU fp16; at stage 3 the
  // gathers widen).
  void refresh_weights(bool rounded);

  // Runs step `step` (0-based). `stop_signal`: this rank's pending SIGINT/SIGTERM, 0 if none. Throws
  // std::runtime_error when the loss or the weights are lost (non-finite without a scaler, or too many
  // skipped steps in a row).
  StepOutcome run(int64_t step, int stop_signal);

  // ds profile: the peak resident memory within every phase (the process's high-water mark, restarted at
  // each phase; a /proc read and write each). Off by default: it resets what getrusage reports as the peak.
  void set_sample_memory(bool on) { sample_memory_ = on; }

  // Whether every master weight is finite (a checkpoint is never written otherwise). Swapped states are
  // checked as each sub-group is stepped, so this reads no file.
  bool master_finite() const;

  // Successful optimizer steps so far: the schedule's position (restored from a checkpoint).
  int64_t applied() const { return applied_; }
  void set_applied(int64_t n) { applied_ = n; }

  // ZeRO-Offload's host step during the next forward (plan.execution.step_in_forward): the model's block hooks,
  // around `inner` (ZeRO's, or null), that step each tile the last update left pending before the forward reads it.
  // Owned here; valid while this object is.
  BlockHooks* forward_hooks(BlockHooks* inner);
  // Every pending tile stepped now: before anything but the next step's forward reads the weights or the states (a
  // checkpoint, a validation, the run's end).
  void finish_update();
  // Tiles stepped by the forward's hooks so far (not by finish_update).
  int64_t tiles_stepped_in_forward() const { return stepped_in_forward_; }

  // Pipeline parallel: the stage's runner of the micro-batches (over the pipeline group) and the two ranks that
  // hold the tied token table, the first stage's (its rank 0) and the last stage's copy (`tied`: null when the
  // head is not tied or this rank holds neither). Borrowed.
  void set_pipeline(PipelineStageRunner* stage, Communicator* tied);

 private:
  // A split model: per parameter, whether its gradient counts in the norm on this rank. A tensor every tensor
  // rank holds whole counts on the first only; the tied head's copy on the last stage never (the table does).
  std::vector<uint8_t> counted_params_;
  struct Clock;  // the step's phases, timed back to back (optimizer_step.cpp)
  // Forward and backward of every micro batch; returns the sum of their losses (a float64 scalar where the losses
  // are: a GPU's stays there, unread).
  torch::Tensor micro_steps(int64_t step, StepOutcome& out, Clock& clock);
  // The same through a pipeline stage, 1F1B (pipeline.hpp): only the last stage has losses to sum (on the host).
  torch::Tensor pipeline_micro_steps(int64_t step, StepOutcome& out, Clock& clock);
  // Micro batch m of `step`: drawn, its segments and dropout key given to the model.
  void draw_micro_batch(int64_t step, int64_t m);
  // The gradient micro batch m's loss gets (the loss scale, its share of the ranks' and micro batches' targets)
  // and the weight of its loss in the step's mean.
  std::pair<double, double> loss_gradient_of(int64_t step, int64_t m, double loss_scale, int64_t step_counted) const;
  // Pipeline parallel with a tied head, before the gradients are reduced: the last stage's copy sends its
  // gradient to the first stage, which adds it to the table's (one table, one sum: the data groups of the two
  // stages would sum it in different orders).
  void tied_gradient_in();
  // After the micro steps: the step's gradients final where the optimizer reads them (reduced, summed, rounded).
  void end_gradients();
  // After the update: the first stage sends the table's new weights to the copy (whose own step they replace).
  void tied_weights_back();
  PipelineStageRunner* pipeline_ = nullptr;
  Communicator* tied_ = nullptr;
  int tied_param_ = -1;  // the layout's parameter that is the tied table, or its copy
  // The ranks agree on the mean loss, the gradient norm and whether to stop (one small collective); sets
  // out.loss, out.norm and out.stop_requested. Returns the sum of squares of the scaled gradients.
  double agree(StepOutcome& out, const torch::Tensor& loss_sum, int stop_signal);
  // out.loss, out.stop_requested and out.norm from the figures agreed over the ranks.
  void take_figures(StepOutcome& out, double loss_sum, bool stop, double sum_of_squares) const;
  // Whether the step's figures stay on the device until its end (agree_on_device): a device with memory of its own
  // (the host would wait for it to read one), an optimizer whose step needs no figure on the host (not Lamb), and
  // states, gradients and parameters all on the device (weights copied elsewhere wait for the copy), the model whole
  // on the rank.
  bool figures_stay_on_device() const;
  // agree() and the update's clipping and skip decision (step_inputs, check_overflow), on the device: queued,
  // nothing read. `values`: {loss sum, stop, squares summed over the ranks, this rank's squares}; `control`: the
  // optimizer kernels' {grad scale, apply} (OptimizerStepInputs::control).
  struct DeviceFigures {
    torch::Tensor values, control;
    bool partial = false;  // the squares are this rank's part of the norm's (summed over the ranks)
  };
  DeviceFigures agree_on_device(const StepOutcome& out, const torch::Tensor& loss_sum, int stop_signal);
  // At the step's end, its one wait for the device: the figures into `out` (take_figures) and *sum_of_squares;
  // returns the control the kernels read.
  struct DeviceControl {
    float grad_scale = 0;
    bool apply = false;
  };
  DeviceControl read_figures(StepOutcome& out, const DeviceFigures& f, double* sum_of_squares) const;
  // Overflow (inf/NaN gradients): the step is skipped, the scale lowered, or the run ends (throws).
  void check_overflow(int64_t step, StepOutcome& out, bool overflow);
  // check_overflow with the agreed squares, then a step that trains no token (fine-tuning data) is skipped too.
  void decide_skip(int64_t step, StepOutcome& out, double sum_of_squares);
  // The schedule's values and the gradients' scale (loss scale and clipping) for this step.
  OptimizerStepInputs step_inputs(const StepOutcome& out) const;
  // The schedule's values for the next update, at learning rate `lr`, its gradients multiplied by `grad_scale`.
  OptimizerStepInputs inputs_at(double lr, double grad_scale) const;
  // The speculative step (plan.execution.step_in_backward). speculate: on the step's last micro step, once block
  // `layer`'s gradients have all reached the host, every tile final from then on is backed up (where the plan keeps a
  // backup) and stepped with speculated_inputs_ (no clipping), its weights sent to the device ahead, after `written`
  // (the backward of the blocks below goes on beside the copies; the compute stream waits for them only in
  // settle_speculation). settle_speculation, once the step's inputs are known (`si`; null: no
  // update this step): tiles stepped with the same inputs stand; otherwise each is restored from the backup, and either
  // left to update() (a clipped step) or given back its weights from the restored master (no update). `failing`: the
  // step threw and the run ends (without a backup the tiles stay as speculated).
  void speculate(int64_t layer, const Event& written);
  void settle_speculation(const OptimizerStepInputs* si, StepOutcome& out, bool failing = false);
  bool speculating_ = false;
  const Event* copies_ahead_after_ = nullptr;  // weights_home's staged copies go ahead, after this (speculate's)
  std::shared_ptr<Event> ahead_arrived_;  // the last of them
  std::vector<uint8_t> speculated_;       // per weight tile: stepped during this step's backward
  std::vector<int64_t> backup_at_;        // per weight tile: where its states sit in step_backup (-1: never speculated)
  int64_t speculated_count_ = 0;
  double speculated_bytes_ = 0;  // what the speculated tiles' copies moved this step
  OptimizerStepInputs speculated_inputs_;
  // The optimizer's update of this rank's part and the new weights published: chunk by chunk of the states'
  // walk, the gradients to where the chunk's states are, its update, its weights home.
  void update(const OptimizerStepInputs& si, Clock& clock);
  // Chunk c stepped with its gradients `grads`: the kernel's update and its weights home; the time of copies between
  // places added to *crossing_s. `read_before`: where given, the compute stream's point after the last work that read
  // the chunk's weights, which a copy of them to the device waits for (else for all the compute queued so far).
  // `tile`: its number among the host's tiles (-1: none), which a profile's spans of the host's work name.
  void step_chunk(const StateChunk& c, const torch::Tensor& grads, const OptimizerStepInputs& si, double* crossing_s,
                  const Event* read_before = nullptr, int64_t tile = -1);
  // Stepping during the next forward: each tile the update left for later, with its gradients (read in place until
  // the next backward writes them) and the forward's block hook it is stepped before (the plan's weight_tile_hooks), in order.
  struct PendingTile {
    StateChunk chunk;
    torch::Tensor grads;
    int64_t hook = 0;
    double bytes = 0;  // what its weights' copy moves: counted in the step whose update it is
    // The compute stream as the update began: every read of the tile's old weights (the last backward's) is before it,
    // so its copy runs beside the blocks the forward queued before the tile's, not after them.
    std::shared_ptr<Event> read_before;
    int64_t tile = -1;  // (its number among the host's tiles: the profile's spans name it)
  };
  // The pending tiles whose hook is at most `hook` stepped now (the block hooks' call; INT64_MAX: all).
  void step_pending(int64_t hook);
  class ForwardHooks;
  std::unique_ptr<ForwardHooks> forward_hooks_;
  std::deque<PendingTile> pending_;
  OptimizerStepInputs pending_inputs_;  // the update's, for its pending tiles
  double pending_bytes_ = 0;  // the last update's pending tiles' bytes, counted in its step
  int64_t stepped_in_forward_ = 0;
  // Bytes moved by pending tiles stepped since the step began: the last step's (its update's), taken out of this one's.
  double carried_bytes_ = 0;
  double carried_seconds_ = 0;  // and the host's seconds stepping them
  // The weights from the master copy, wherever its spans are (a copy between places when offloaded; the
  // parameter file rewritten when the parameters are on NVMe).
  void weights_from_master();
  // Chunk c's reduced gradients where its states are: the rank's gradients themselves where they are in that
  // memory already (on the device; on the host once they left it block by block), else their fp32 copy
  // (widened exactly) beside the offloaded states, copied now.
  torch::Tensor gradients_at(const StateChunk& c);
  // Chunk c's updated weights where they live (its span's part of the parameter file when that is on NVMe), the
  // way `how` says (after the kernel's step: its span's; from the master alone: copied); a chunk swapped from NVMe
  // is checked finite as it passes.
  void put_weights(const StateChunk& c, WeightsBack how, const Event* read_before = nullptr);
  // What the optimizer's kernel gets for chunk c and its gradients `grads` (a staged chunk's weights: the
  // staging buffer whose turn it is, once its last copy has left).
  OptimizerBuffers buffers_of(const StateChunk& c, const torch::Tensor& grads);
  // Staged weights (WeightsBack::staged): the buffer the next tile is written into, taken in turn; each is written
  // again only once the copy that read it last has left (`staging_copied_`). settle_staging() waits for them all.
  torch::Tensor& staging_now();
  void settle_staging();
  int staging_turn_ = 0;
  std::shared_ptr<Event> staging_copied_[2];
  // Bytes moved between places so far: the device's copies and the swap files' reads and writes.
  double bytes_moved() const;

  const Plan& plan_;
  FlatParams& flat_;
  Device& device_;
  ZeroExchange& zero_;
  LanguageModel& model_;
  BatchSampler& sampler_;
  Communicator* comm_;
  const MeshGroups& groups_;  // the world's and a split model's groups
  LossScaler& scaler_;
  LrSchedule schedule_;
  FlatOptimizer optimizer_;
  SumOverRanks sum_over_ranks_;
  // A split model, per parameter of this rank's layout: 1 where another tensor rank's copy of a tensor every
  // tensor rank holds whole is the one counted (Lamb's norms).
  std::vector<uint8_t> held_whole_elsewhere_;
  OptimizerStates states_;
  // The updated weights, local elements [begin, begin + master.numel()), to where the weights live: nothing to
  // move where the kernel wrote them in place (counted when that crossed places), the staging buffer's copy where
  // it wrote them there, else a copy from the master at `at` (counted between places). `read_before`: step_chunk's.
  void weights_home(const torch::Tensor& master, Place at, int64_t begin, WeightsBack how, const Event* read_before = nullptr);
  ParamSwapper* param_swap_ = nullptr;
  // Parameters on NVMe: `master` (fp32, at `place`), elements [begin, begin + numel) of the partition, rounded
  // to the stored dtype into the file's host buffers (inside a begin_write/end_write); from the device
  // through counted copies.
  void store_params(const torch::Tensor& master, Place place, int64_t begin);
  // Parameters on NVMe: seconds waited on their I/O so far (0 without).
  double param_wait() const { return param_swap_ ? param_swap_->io().wait_seconds() : 0.0; }
  bool swapped_finite_ = true;  // NVMe: every master sub-group finite when last stepped or loaded
  // Whether the master weights `master` (at `place`) are all finite.
  bool finite(const torch::Tensor& master, Place place) const;
  int64_t applied_ = 0, consecutive_skips_ = 0;
  bool sample_memory_ = false;
  std::vector<int32_t> in_, tgt_;
  RowSegments segments_;  // packed rows: the samples in each (read by the model until the next micro batch)
};

// Token ids as the model's input: a [B, T] int64 tensor.
torch::Tensor to_long_tensor(const std::vector<int32_t>& v, int64_t B, int64_t T);

}  // namespace ds
