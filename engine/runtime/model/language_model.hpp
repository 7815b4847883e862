// ds — what the trainer needs of a model: the loss of a batch, with parameters that are views into
// the flat buffers, and a deterministic initialisation written into the fp32 master copy.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "engine/runtime/run/flat_params.hpp"
#include "engine/runtime/run/trainer_api.hpp"
#include "engine/runtime/model/fused_attention.hpp"  // AttentionForm
#include "engine/runtime/model/tensor_parallel.hpp"

namespace ds {

// What ZeRO stages 2-3 do around each transformer block: stage 3 gathers its parameters before the
// block runs (forward and backward); both reduce its gradients as soon as its backward is done.
class BlockHooks {
 public:
  virtual ~BlockHooks() = default;
  virtual void before_forward(int64_t layer) = 0;
  virtual void after_forward(int64_t /*layer*/) {}
  virtual void before_backward(int64_t layer) = 0;
  virtual void after_backward(int64_t layer) = 0;
};

// ds profile: the moments a block passes from its attention half (with its first norm) to its MLP half
// (with its second): in forward when the attention's residual sum exists, in backward when the gradient
// reaches that sum (the MLP half's backward is done).
class BlockParts {
 public:
  virtual ~BlockParts() = default;
  virtual void attention_done(int64_t layer) = 0;
  virtual void mlp_backward_done(int64_t layer) = 0;
};

// ds profile: the time of each block's forward and backward (recomputation included), around another set of
// hooks (ZeRO's, or none), on the compute stream's clock (a GPU's, when it ran the block's work). The blocks then
// run as units of their own, as under ZeRO 2-3.
class BlockTimer : public BlockHooks, public BlockParts {
 public:
  BlockTimer(BlockHooks* inner, int64_t blocks, Stream& clock) : inner_(inner), blocks_(static_cast<size_t>(blocks)), clock_(clock) {}
  void before_forward(int64_t layer) override;
  void after_forward(int64_t layer) override;
  void before_backward(int64_t layer) override;
  void after_backward(int64_t layer) override;
  void attention_done(int64_t layer) override;
  void mlp_backward_done(int64_t layer) override;
  // Seconds per block since the last call (summed over micro batches), and every block run with its
  // start after `step_start` (an event the clock stream recorded, timed); then cleared. Waits for the stream.
  struct Taken {
    std::vector<double> forward, backward;
    std::vector<double> attention_forward, mlp_backward;  // the parts of the two above
    std::vector<BlockSpan> spans;
  };
  Taken take(const Event& step_start);
  // Forgets what was timed since the last take() (a forward outside the steps: validation).
  void discard() { timed_.clear(); }

 private:
  enum class Part { forward, backward, attention_forward, mlp_backward };
  struct Timed {
    Part part;
    int64_t layer;
    std::shared_ptr<Event> begin, end;
  };
  void record(int64_t layer, Part part);
  BlockHooks* inner_;
  size_t blocks_;
  Stream& clock_;
  int64_t in_backward_ = -1;  // the block whose backward runs (its recomputed forward is not forward time)
  std::shared_ptr<Event> started_;  // the running block's start
  std::vector<Timed> timed_;
};

// A projection's weight and bias (undefined for none) and, with LoRA, its adapter: A (r, in), B (out, r),
// undefined where the projection has none. `index`, the weight's place in the state_dict, keys the
// adapter's dropout masks.
struct Linear {
  torch::Tensor weight, bias, lora_a, lora_b;
  int64_t index = 0;
};

// What a model binds to, in state_dict order: each tensor's view in the flat buffers, or in the frozen
// buffer when it is frozen (model.freeze; every one under LoRA), and beside each projection LoRA targets,
// the adapter's views from the flat buffers.
class ModelWeights {
 public:
  ModelWeights(const Plan& plan, const FlatParams& params);
  // The next tensor, whose name must end in `suffix`.
  const torch::Tensor& next(const std::string& suffix);
  // The next projection: its weight (and bias, when named), with its adapter when it has one.
  Linear linear(const std::string& weight_suffix, const std::string& bias_suffix = "");
  bool done() const { return trained_.done() && frozen_.done() && adapter_ == adapters_.size(); }

 private:
  const Plan& plan_;
  ParamCursor trained_, frozen_;
  size_t tensor_ = 0;  // the model's tensors handed out
  // LoRA: per adapter tensor pair, the base tensor it adapts and the views of A and B.
  struct Adapter {
    size_t base = 0;
    torch::Tensor a, b;
  };
  std::vector<Adapter> adapters_;
  size_t adapter_ = 0;
};

// What a pipeline stage's model holds: the token (and position) tables, the final norm and the head, and the
// whole model's number of its first block (its blocks keep their numbers: dropout streams and per-layer forms
// such as Gemma 2's sliding windows follow them). A head tied to the token table on a later stage than the
// table is bound to a copy of it, after the final norm. The whole model holds everything.
struct StageEnds {
  bool embeddings = true, head = true;
  int64_t first_block = 0;
};

class LanguageModel {
 public:
  virtual ~LanguageModel() = default;
  // Mean cross-entropy of predicting targets (B, T) from inputs (B, T); computed in fp32. The whole model's.
  torch::Tensor loss(const torch::Tensor& inputs, const torch::Tensor& targets) const;
  // A pipeline stage's forward of a micro batch: from the token ids `inputs` (B, T) on the first stage, from the
  // previous stage's output `x` (B, T, C) on the others; through the stage's blocks; the last stage returns the
  // loss of `targets` (as loss() does), the others their output (B, T, C) for the next stage.
  torch::Tensor stage_forward(const torch::Tensor& inputs, const torch::Tensor& x, const torch::Tensor& targets) const;
  const StageEnds& stage() const { return stage_; }
  // Transformer block `layer` (the whole model's number: stage().first_block onwards) applied to x (B, T, C):
  // self-contained, so it can be run again.
  virtual torch::Tensor block(int64_t layer, const torch::Tensor& x) const = 0;
  virtual int64_t num_blocks() const = 0;

  // Activation checkpointing: keep only each group's input and recompute the group in backward, `group` blocks at
  // a time (1: each block; pipeline.activation_checkpoint_interval).
  void set_checkpoint_activations(bool on) { checkpoint_activations_ = on; }
  void set_recompute_group(int64_t group) { recompute_group_ = std::max<int64_t>(group, 1); }
  // In training, the blocks below `layer` (the whole model's number: Plan::backward_from) run forward only, keeping
  // nothing: nothing in or below them trains, so no gradient is wanted there.
  void set_backward_from(int64_t layer) { backward_from_ = layer; }
  int64_t backward_from() const { return backward_from_; }
  // Not owned; null runs the blocks plainly.
  void set_block_hooks(BlockHooks* hooks) { hooks_ = hooks; }
  // Not owned; null (the default) reports nothing.
  void set_block_parts(BlockParts* parts) { parts_ = parts; }
  // Dropout masks of the next forward come from a stream keyed by `key` (the trainer's seed, rank,
  // step and micro step) and each layer and site, so a block recomputed in backward draws the same
  // masks and a resumed run the same as an uninterrupted one. `training` false: no dropout (validation).
  void set_dropout(uint64_t key, bool training) {
    dropout_key_ = key;
    training_ = training;
  }
  // The gradient the next loss will receive in backward (the loss scale over micro batches and ranks):
  // the fused head computes its gradients for it during forward (fused_head_loss.hpp).
  void set_loss_gradient(double g) { loss_gradient_ = g; }
  // LoRA: every adapter's output is scaled by `scale` (alpha / r), its input dropped with probability `dropout`.
  void set_lora(double scale, double dropout) {
    lora_scale_ = scale;
    lora_dropout_ = dropout;
  }
  // Packed rows (data.packing): per row of the next batches, the lengths of the samples in it, then the
  // padding after them as a negative length (the sampler's RowSegments, |lengths| summing to T). Each sample
  // is attended to on its own, its positions counted from 0, as if it were run alone. The padding is
  // attended to with the sample before it (which, causal, never sees it); no counted target reads its
  // outputs. Copied; null or empty, or no row with two samples: each row is one sequence.
  void set_segments(const std::vector<std::vector<int64_t>>* segments);
  // Tensor parallel (Megatron's scheme, make_model sets it): the model was built with its share's sizes (its
  // heads, MLP channels and vocabulary rows) and bound to its share of each split tensor; each block sums its
  // attention's and its MLP's partial outputs over the group (then adds their biases, whole on every rank), and
  // sums its inputs' gradients in backward; the embedding and the loss run over the group's vocabulary rows.
  // The dropout masks of activations every rank holds whole are the same on each (set_dropout's key must be);
  // the attention's probabilities, each rank's own heads, draw from a stream of the rank's.
  void set_tensor_group(const TensorGroup& group);

 protected:
  explicit LanguageModel(const StageEnds& stage) : stage_(stage) {}
  // The token ids' embedding (B, T, C), dropout applied: the first stage's start.
  virtual torch::Tensor embed(const torch::Tensor& inputs) const = 0;
  // The final norm, the head and the loss of `targets` from the last block's output x (B, T, C).
  virtual torch::Tensor head(const torch::Tensor& x, const torch::Tensor& targets) const = 0;
  // Every block in order, checkpointed when configured.
  torch::Tensor run_blocks(torch::Tensor x) const;
  // x with each element zeroed with probability p and the rest scaled by 1/(1-p); x itself when p is 0
  // or not training. `layer` -1 is outside the blocks; `site` (0-7) tells the places within one apart.
  torch::Tensor dropout(const torch::Tensor& x, double p, int64_t layer, int site) const;
  // The projection x W^T + b (x W + b with `in_out`: GPT-2's Conv1D), plus with an adapter
  // scale dropout(x) A^T B^T, added in the same pass that adds the two.
  torch::Tensor linear(const torch::Tensor& x, const Linear& l, bool in_out) const;
  // Tensor parallel: where column-parallel projections (q, k, v; gate, up) take their input `x` (Megatron's f:
  // backward sums its gradient over the group); `x` itself on one rank.
  torch::Tensor column_input(const torch::Tensor& x) const;
  // A row-parallel projection (attention's output, the MLP's down): this rank's partial product summed over the
  // group (Megatron's g), then the bias; `linear` itself on one rank.
  torch::Tensor row_linear(const torch::Tensor& x, const Linear& l, bool in_out) const;
  // LoRA dropout of a row-parallel projection's input columns, as one rank drops the whole input's.
  torch::Tensor row_dropout(const torch::Tensor& x, const Linear& l) const;
  // A whole tensor each rank applies to its own heads only (Qwen3's per-head q and k norms): under tensor
  // parallelism its gradient is summed over the group in backward, so every rank's copy steps alike.
  torch::Tensor per_head_weight(const torch::Tensor& w) const { return column_input(w); }
  // The token embedding of `ids` from the table (this rank's vocabulary rows under tensor parallelism).
  torch::Tensor token_embedding(const torch::Tensor& table, const torch::Tensor& ids) const;
  // Called by block() after the attention half with the MLP's input (the norm of the residual sum): the profile's
  // timer marks the MLP's backward done when that input's gradient is whole.
  void attention_half_done(int64_t layer, torch::Tensor& mlp_input) const;
  // Causal self-attention of q (B, T, NH, D) over k, v (B, T, NKV, D), as (B, T, NH, D): the fused
  // attention, or the materialised one when its probabilities take dropout (training, p > 0) or the
  // family's form is not the plain one at this length (a window shorter than T, soft-capping, a scale).
  // `sample` (per_sample's key) draws a packed sample's attention dropout from a stream of its own.
  torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double p,
                          int64_t layer, const AttentionForm& form = {}, uint64_t sample = 0) const;
  // The same from one packed projection (B, T, NH + 2 NKV, D) (fused_attention.hpp), each packed sample on its own.
  torch::Tensor attention(const torch::Tensor& qkv, int64_t heads, double p, int64_t layer) const;
  // Whether the rows hold samples of their own (set_segments).
  bool packed() const { return positions_.defined(); }
  // Packed rows: each position's place within its sample (B, T), int64 on `device`.
  const torch::Tensor& positions(const torch::Device& device) const;
  // Packed rows: `f` applied to each sample's slices (1, L, ...) of `parts` (each (B, T, ...)), with a key
  // of the sample (its row x T + first position + 1) and its length, the results (1, L, heads, D) joined into
  // (B, T, heads, D) with one gradient per part (split and stacked, not a zeroed full-size gradient per
  // slice). The padding goes with the sample before it (L is then longer than the sample; a row of padding
  // alone gives zeros). Unpacked: f(parts, 0, T); `by_length`: rows of one sample are still taken one by
  // one, for what depends on a sample's length (Llama's dynamic and longrope rotary scaling).
  using SampleFn = std::function<torch::Tensor(const std::vector<torch::Tensor>&, uint64_t, int64_t)>;
  torch::Tensor per_sample(const std::vector<torch::Tensor>& parts, int64_t heads, const SampleFn& f, bool by_length = false) const;
  // Whether set_segments gave rows (packed or not), and a number that changes with every set_segments.
  bool has_segments() const { return !segments_.empty(); }
  uint64_t segments_version() const { return segments_version_; }
  // The mean cross-entropy of targets under softmax(x weight^T): x (B*T, C), the head (V, C).
  // `softcap` > 0: the logits soft-capped first (Gemma 2's final_logit_softcapping).
  torch::Tensor head_loss(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& targets, double softcap = 0) const;

 private:
  bool checkpoint_activations_ = false;
  int64_t backward_from_ = 0;
  int64_t recompute_group_ = 1;
  uint64_t dropout_key_ = 0;
  bool training_ = true;
  double loss_gradient_ = 1.0;
  double lora_scale_ = 0, lora_dropout_ = 0;
  // x with dropout p from the mask stream `stream` (dropout()'s: dropout_stream).
  torch::Tensor dropout_from(const torch::Tensor& x, double p, uint64_t stream) const;
  // The mask stream of dropout site `site` of block `layer` (-1: outside the blocks).
  static uint64_t dropout_stream(int64_t layer, int site) { return static_cast<uint64_t>(layer + 1) * 8 + static_cast<uint64_t>(site); }
  mutable torch::Tensor head_logits_;  // the fused head's chunk of logits, kept from step to step
  std::vector<std::vector<int64_t>> segments_;  // set_segments'
  uint64_t segments_version_ = 0;
  torch::Tensor positions_;                      // packed: (B, T) on the host; undefined unpacked
  mutable torch::Tensor device_positions_;       // positions_ where the model runs
  BlockHooks* hooks_ = nullptr;
  BlockParts* parts_ = nullptr;
  TensorGroup tensor_;
  uint64_t head_streams_ = 0;  // tensor parallel: mixed into the attention probabilities' dropout streams, per rank
  StageEnds stage_;
};

// The model the plan describes (gpt2 or llama), bound to the flat parameter views, with activation
// checkpointing as the plan says. A plan whose mesh splits the model: the share of this rank (the plan's
// topology.rank, whose stage's layout the plan must carry: with_own_stage), built with the share's sizes (its
// stage's blocks and ends; over tensor ranks its heads, MLP channels and vocabulary rows) and running over
// `tensor_group` (the mesh's tensor group, this rank's place in it its tensor rank).
std::unique_ptr<LanguageModel> make_model(const Plan& plan, const FlatParams& params, Communicator* tensor_group = nullptr);
// The architecture's initial weights, deterministic in `seed`, drawn parameter by parameter in layout
// order from one generator of their own (the process-wide one is shared with other threads: ranks in
// tests), so a rank holding a part of the model never needs the whole of it in fp32.
class InitialWeights {
 public:
  // The layout's parameters (with LoRA the adapter's: A as model.lora.init says, B zero), or with `base` the
  // model's tensors in state_dict order (what a frozen tensor is filled from). A model's tensor gets the
  // same values whatever is frozen: those a run training every weight draws from this seed.
  // A plan that splits the model: the whole model's tensors are drawn as one rank would, and each of its stage's
  // (the plan's rank's) handed out as tensor rank `tensor_rank`'s share (take_share), so every mesh starts from
  // the weights one rank does.
  InitialWeights(const Plan& plan, uint64_t seed, bool base = false, int tensor_rank = 0);
  // Parameter `i`'s values (fp32, its numel). Ask in increasing order; asking again for the last is free.
  const float* param(int i);

 private:
  // Draws the whole model's tensors up to and including `i`, in order (keeping the tied table's share).
  void draw_through(int i);
  const Plan& plan_;
  std::vector<ParamSlot> slots_;  // what is drawn, in order
  bool adapters_;                 // the slots are LoRA's A and B
  at::Generator gen_;
  int drawn_ = -1;
  torch::Tensor values_;
  int tensor_rank_ = 0;  // split over tensor ranks: the share handed out
  bool sharing_;         // whether the plan splits the model (over tensor ranks, pipeline stages or both)
  // Per parameter asked for, the model's tensor it is (a share of): model.freeze's trained ones, a split model's
  // stage's; empty when the slots are the layout's own.
  std::vector<StageTensor> sources_;
  torch::Tensor share_;   // a split model: this rank's share of values_
  int tied_table_ = -1;   // the last stage's tied head: the table it copies, whose share is kept in tied_
  torch::Tensor tied_;
};
// The whole model's initial weights into `master` (fp32, the plan's layout); `tensor_rank`'s share of them
// when the plan splits the model over tensor ranks.
void initialise_model(const Plan& plan, torch::Tensor master, uint64_t seed, int tensor_rank = 0);

}  // namespace ds
