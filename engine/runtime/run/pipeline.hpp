// ds — one optimizer step's micro-batches through a pipeline stage, in the 1F1B order of
// one_forward_one_backward (engine/plan/mesh.hpp): each forward takes the previous stage's output (received),
// or the token ids on the first stage, and sends its own to the next stage, or on the last stage makes the
// loss; each backward takes the next stage's gradient of that output (received), or the loss's on the last
// stage, and sends the gradient of its input back. Sends never block (the sender goes on at once), so the
// stages only ever wait for what they need: a neighbour's message. The activations of a micro-batch are kept
// from its forward to its backward, at most PipelineStage::in_flight of them at once; a sent tensor is let go
// as soon as the schedule says it has arrived (an activation when its gradient comes back, a gradient when the
// previous stage's next forward does), so the sends hold no more than that either. A stage whose blocks all lie
// below every trained tensor (Plan::backward_from) runs its forwards alone, and the stage after it sends no
// gradient back.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <vector>

#include "engine/plan/mesh.hpp"
#include "engine/runtime/comm/comm.hpp"
#include "engine/runtime/model/language_model.hpp"

namespace ds {

// What a stage did, in order (the schedule's test reads it).
struct PipelineEvent {
  enum Kind { forward, backward, received_activation, sent_activation, received_gradient, sent_gradient };
  Kind kind = forward;
  int micro = 0;
};

class PipelineStageRunner {
 public:
  // `stages`: the pipeline group, this rank's place in it its stage (null: one stage, nothing sent). A stage's
  // output, sent on, is (micro_batch, seq_len, hidden) of `activations`' dtype, received into its device's memory (the
  // model's). Borrowed; they outlive this.
  PipelineStageRunner(LanguageModel& model, Communicator* stages, int micro_batches, std::vector<int64_t> activation_shape,
                      torch::TensorOptions activations);

  // Before micro-batch `micro`'s forward (`forward` true) and again before its backward: whatever the model
  // reads then (its segments, its dropout key) set for it; before the forward, the token ids and targets given back.
  struct Batch {
    torch::Tensor inputs, targets;
  };
  using Prepare = std::function<Batch(int micro, bool forward)>;
  // The last stage: what a micro-batch's loss backpropagates from (the loss times its gradient's scale).
  using Backward = std::function<torch::Tensor(const torch::Tensor& loss, int micro)>;
  // After micro-batch `micro`'s backward.
  using Finished = std::function<void(int micro)>;

  // Runs every micro-batch's forward and backward. The last stage returns their losses (detached, in order);
  // the others an empty list.
  std::vector<torch::Tensor> run(const Prepare& prepare, const Backward& backward, const Finished& finished);

  // Forward only (validation), `count` micro-batches in order: the last stage returns their losses.
  std::vector<torch::Tensor> evaluate(int count, const Prepare& prepare);

  void set_trace(std::vector<PipelineEvent>* trace) { trace_ = trace; }
  // The most micro-batches whose activations the stage held at once in the last run, and the most sends it held.
  int most_in_flight() const { return most_in_flight_; }
  int most_sends_held() const { return most_sends_held_; }

 private:
  torch::Tensor forward(int micro, const Batch& batch, torch::Tensor* kept_input);
  void note(PipelineEvent::Kind kind, int micro) {
    if (trace_) trace_->push_back({kind, micro});
  }
  // Waits for every send still in flight (their tensors are then free).
  void finish_sends();
  // Waits for (and lets go of) the sends of activations, or of gradients, of micro-batches up to `up_to`: called
  // where the schedule says they have arrived, so it does not wait.
  void release(bool activations, int up_to);

  LanguageModel& model_;
  Communicator* stages_;
  int stage_ = 0, count_ = 1, micro_batches_;
  // A stage whose blocks all run forward only (below every trained tensor) has no backward; the first stage
  // with one sends no gradient back to them.
  bool runs_backward_ = true, sends_gradient_ = true;
  std::vector<int64_t> shape_;
  torch::TensorOptions options_;  // a received activation's or gradient's dtype and device
  torch::ScalarType dtype_;
  struct Send {
    std::unique_ptr<PendingCollective> pending;
    torch::Tensor tensor;  // what it reads until done
    int micro = 0;
    bool activation = true;  // a forward's output, or a backward's input gradient
  };
  std::vector<Send> sends_;
  std::vector<PipelineEvent>* trace_ = nullptr;
  int most_in_flight_ = 0, most_sends_held_ = 0;
};

}  // namespace ds
