#include "engine/runtime/run/pipeline.hpp"

#include <algorithm>

#include "common/error.hpp"

namespace ds {

PipelineStageRunner::PipelineStageRunner(LanguageModel& model, Communicator* stages, int micro_batches, std::vector<int64_t> activation_shape,
                                         torch::TensorOptions activations)
    : model_(model),
      stages_(stages),
      micro_batches_(micro_batches),
      shape_(std::move(activation_shape)),
      options_(activations),
      dtype_(c10::typeMetaToScalarType(activations.dtype())) {
  if (stages) {
    stage_ = stages->rank();
    count_ = stages->world_size();
  }
  DS_CHECK(model.stage().embeddings == (stage_ == 0) && model.stage().head == (stage_ == count_ - 1),
           "pipeline stage ", stage_, " of ", count_, ": the model holds other ends");
  PipelineStage at;  // this stage's ends and blocks, as the model holds them
  at.first_block = static_cast<int>(model.stage().first_block);
  at.blocks = static_cast<int>(model.num_blocks());
  at.embeddings = model.stage().embeddings;
  at.head = model.stage().head;
  runs_backward_ = stage_runs_backward(at, model.backward_from());
  sends_gradient_ = stage_sends_gradient(at, model.backward_from());
  if (stages_) {  // the neighbours, lower first (Communicator::connect)
    if (stage_ > 0) stages_->connect(stage_ - 1);
    if (stage_ + 1 < count_) stages_->connect(stage_ + 1);
  }
}

torch::Tensor PipelineStageRunner::forward(int micro, const Batch& batch, torch::Tensor* kept_input) {
  torch::Tensor x;
  if (!model_.stage().embeddings) {
    x = torch::empty(shape_, options_);
    stages_->recv(x, stage_ - 1, CollectiveKind::pipeline_activations);
    note(PipelineEvent::received_activation, micro);
    if (torch::GradMode::is_enabled() && sends_gradient_) x.requires_grad_(true);  // its gradient goes back to the previous stage
    if (kept_input) *kept_input = x;
  }
  note(PipelineEvent::forward, micro);
  torch::Tensor y = model_.stage_forward(batch.inputs, x, batch.targets);
  if (!model_.stage().head) {
    DS_CHECK(y.sizes() == torch::IntArrayRef(shape_) && y.scalar_type() == dtype_, "pipeline stage ", stage_, ": an output of ", y.sizes(),
             " ", y.scalar_type(), " where the next stage receives ", torch::IntArrayRef(shape_), " ", dtype_);
    const torch::Tensor out = y.detach().contiguous();
    sends_.push_back({stages_->send_async(out, stage_ + 1, CollectiveKind::pipeline_activations), out, micro, true});
    most_sends_held_ = std::max(most_sends_held_, static_cast<int>(sends_.size()));
    note(PipelineEvent::sent_activation, micro);
  }
  return y;
}

void PipelineStageRunner::finish_sends() {
  for (Send& send : sends_) send.pending->wait();
  sends_.clear();
}

void PipelineStageRunner::release(bool activations, int up_to) {
  const auto done = [&](Send& send) {
    if (send.activation != activations || send.micro > up_to) return false;
    send.pending->wait();
    return true;
  };
  sends_.erase(std::remove_if(sends_.begin(), sends_.end(), done), sends_.end());
}

std::vector<torch::Tensor> PipelineStageRunner::run(const Prepare& prepare, const Backward& backward, const Finished& finished) {
  const auto M = static_cast<size_t>(micro_batches_);
  std::vector<torch::Tensor> outputs(M), inputs(M), losses;
  int in_flight = 0;
  most_in_flight_ = most_sends_held_ = 0;
  try {
    if (!runs_backward_) {  // forward only, each output let go once the next stage has it
      for (int m = 0; m < micro_batches_; ++m) {
        forward(m, prepare(m, true), nullptr);
        release(/*activations=*/true, m - 1);
      }
      finish_sends();
      return losses;
    }
    for (const PipelineOp& op : one_forward_one_backward(count_, stage_, micro_batches_)) {
      const auto m = static_cast<size_t>(op.micro);
      if (op.forward) {
        const Batch batch = prepare(op.micro, true);
        outputs[m] = forward(op.micro, batch, &inputs[m]);
        // The previous stage ran micro-batch m's forward after the backward of m - (p - s) - 1, whose gradient
        // this stage had sent: delivered, its tensor is free.
        if (!model_.stage().embeddings) release(/*activations=*/false, op.micro - (count_ - stage_) - 1);
        if (model_.stage().head) losses.push_back(outputs[m].detach());
        most_in_flight_ = std::max(most_in_flight_, ++in_flight);
        continue;
      }
      prepare(op.micro, false);
      if (model_.stage().head) {
        note(PipelineEvent::backward, op.micro);
        backward(outputs[m], op.micro).backward();
      } else {
        torch::Tensor grad = torch::empty(shape_, options_);
        stages_->recv(grad, stage_ + 1, CollectiveKind::pipeline_gradients);
        note(PipelineEvent::received_gradient, op.micro);
        release(/*activations=*/true, op.micro);  // the next stage ran its forward, on what this one sent
        note(PipelineEvent::backward, op.micro);
        outputs[m].backward(grad);
      }
      if (sends_gradient_) {
        DS_CHECK(inputs[m].grad().defined(), "pipeline stage ", stage_, ": micro-batch ", op.micro, "'s input got no gradient");
        const torch::Tensor grad_in = inputs[m].grad().contiguous();
        sends_.push_back({stages_->send_async(grad_in, stage_ - 1, CollectiveKind::pipeline_gradients), grad_in, op.micro, false});
        most_sends_held_ = std::max(most_sends_held_, static_cast<int>(sends_.size()));
        note(PipelineEvent::sent_gradient, op.micro);
      }
      outputs[m] = torch::Tensor();
      inputs[m] = torch::Tensor();
      --in_flight;
      finished(op.micro);
    }
  } catch (...) {
    sends_.clear();  // each send's destructor waits (Gloo) or orders the compute stream after it (NCCL); the error goes on
    throw;
  }
  finish_sends();
  return losses;
}

std::vector<torch::Tensor> PipelineStageRunner::evaluate(int count, const Prepare& prepare) {
  std::vector<torch::Tensor> losses;
  try {
    for (int m = 0; m < count; ++m) {
      const torch::Tensor y = forward(m, prepare(m, true), nullptr);
      release(/*activations=*/true, m - 1);  // the next stage took it before it could ask for this one
      if (model_.stage().head) losses.push_back(y.detach());
    }
  } catch (...) {
    sends_.clear();
    throw;
  }
  finish_sends();
  return losses;
}

}  // namespace ds
