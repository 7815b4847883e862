// ds — the mesh: how ranks split the work three ways. Data parallel (ZeRO over each data group), tensor
// parallel (Megatron's split of each block's matrices over a tensor group) and pipeline parallel (the blocks
// cut into stages, micro-batches flowing through them one forward, one backward). data x tensor x pipeline =
// world size. Pure arithmetic from the config's tensor_parallel and pipeline blocks and the model's tensors.
//
// Rank order: tensor fastest, then data, then pipeline (Megatron's), so a tensor group is consecutive ranks
// and shares a node whenever its size divides the ranks per node: its all-reduces, two per block in forward
// and two in backward, are the mesh's most frequent messages.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "engine/plan/comm.hpp"
#include "engine/plan/layout.hpp"
#include "engine/plan/lora.hpp"
#include "engine/plan/memory.hpp"
#include "engine/plan/model_spec.hpp"

namespace ds {

struct MeshShape {
  int data = 1, tensor = 1, pipeline = 1;
  int world() const { return data * tensor * pipeline; }
  bool splits_the_model() const { return tensor > 1 || pipeline > 1; }
};

// Where a rank sits, and the rank at a position.
struct MeshCoord {
  int data = 0, tensor = 0, pipeline = 0;
};
MeshCoord mesh_coord(const MeshShape& m, int rank);
int mesh_rank(const MeshShape& m, const MeshCoord& c);

// The groups of each kind, each a list of ranks in order: a tensor group shares data and stage, a data group
// shares tensor rank and stage, a pipeline group shares data and tensor rank.
enum class MeshAxis { data, tensor, pipeline };
const char* mesh_axis_name(MeshAxis a);
std::vector<std::vector<int>> mesh_groups(const MeshShape& m, MeshAxis axis);

// How the blocks are cut into stages (DeepSpeed's pipeline.partition): the same number of blocks on each
// (uniform; "type:..." too, the transformer block being the one layer type ds repeats), or the parameters
// balanced, the first stage holding the embeddings and the last the final norm and the head (parameters;
// DeepSpeed's "best" too), or ds's own: the heaviest stage's memory per rank as small as it can be (memory: each
// stage's weights, gradients and optimizer states with the activations of the micro-batches it holds at once,
// which the first stages hold more of; compile_plan cuts it, by the plan's memory model, once the ZeRO stage and
// the micro batch are known).
enum class StagePartition { uniform, parameters, memory };

// How a tensor is split over a tensor group (Megatron): by its output (q, k, v, gate, up and their biases;
// each rank computes its heads or its share of the MLP), by its input (o and down; their biases added once,
// after the all-reduce, so whole on every rank), by vocabulary rows (the token table and the head), or
// whole on every rank (norms, the position table). LoRA's adapters: beside a column-parallel projection A is
// whole (its gradient summed over the group) and B split by output rows; beside a row-parallel one A is split by
// input columns (x A^T summed over the group) and B whole.
enum class TensorSplit { column, row, vocabulary, whole };
const char* tensor_split_name(TensorSplit s);
TensorSplit tensor_split_of(const ModelSpec& model, const TensorSpec& t);
// A tensor's elements on one rank of a tensor group of `tensor` ranks (the vocabulary padded to a multiple of it), and
// its shape there (the split dimension divided). A LoRA adapter's A and B split with their base (tensor_split_of).
int64_t tensor_numel_per_rank(const ModelSpec& model, const TensorSpec& t, int tensor);
std::vector<int64_t> tensor_shape_per_rank(const ModelSpec& model, const TensorSpec& t, int tensor);

// The vocabulary rows tensor rank `rank` holds of the token table and the head: [begin, begin + real) of the
// whole, then rows - real rows of padding (the last ranks' when the vocabulary does not divide by `tensor`).
struct VocabShare {
  int64_t begin = 0, rows = 0, real = 0;
};
VocabShare vocab_share(int64_t vocab, int tensor, int rank);

// Where tensor rank `rank`'s share of a tensor comes from in the whole tensor: along dimension `dim`, the runs
// (begin, length) of the whole's indices, joined in order, then `padding` zero rows. A projection that packs
// several (GPT-2's c_attn and Phi-3's qkv_proj: q, k and v; Phi-3's gate_up_proj: gate and up) gives each
// rank its share of every part, so a rank's packed projection makes its own heads' q, k and v. A tensor kept
// whole: one run over all of dimension 0.
struct TensorSlice {
  int dim = 0;
  std::vector<std::pair<int64_t, int64_t>> runs;
  int64_t padding = 0;
};
TensorSlice tensor_slice_of(const ModelSpec& model, const TensorSpec& t, int tensor, int rank);


// What one rank of a stage sends per optimizer step for the mesh, besides ZeRO's collectives over its data
// group (which the plan's collectives list). Megatron's tensor parallelism without sequence parallelism:
// per block and micro-batch, an all-reduce of the activations after attention and after the MLP in forward
// (again when activation checkpointing recomputes it) and of the input gradients of q|k|v and gate|up in
// backward, each micro x seq x hidden in the compute dtype; the first stage's embedding output once more; the
// last stage's head input gradient, and for the vocabulary-parallel loss one all-reduce per chunk of logits
// (head_chunk_rows of the rank's vocabulary) of 2t + 1 fp32 values per token: every rank's maximum logit and
// its sum of exponentials below it (each rank fills its own two rows, the others are zero: a sum that gathers
// them), and the target's logit (from the rank that holds it); Qwen3's per-head q and k norms, whose gains every
// rank holds whole but applies to its own heads, have their gradients summed once per block in backward. Pipeline: per micro-batch, the activations
// sent to the next stage and their gradient sent back, micro x seq x hidden each, whole from every tensor
// rank (DeepSpeed's pipe_partitioned would split them over the tensor group; ds does not yet).
struct MeshTraffic {
  int64_t tensor_all_reduces = 0;    // calls per step
  double tensor_payload_bytes = 0;   // summed over those calls
  double tensor_wire_bytes = 0;      // sent per rank: ring all-reduce, 2 (t - 1) / t of the payload
  int64_t pipeline_sends = 0;        // point-to-point sends per step: activations on and gradients back
  double pipeline_bytes = 0;         // sent per rank
  int64_t pipeline_gradient_sends = 0;  // of those, the gradients sent back to the stage before
  double pipeline_gradient_bytes = 0;
  // A tied head on another stage than the table, once per step: the last stage sends its copy's gradient to the
  // first, whose table steps on the sum, and the first sends the table's new weights back (each sends one).
  int64_t tied_sends = 0;
  double tied_bytes = 0;
  // Lamb with tensor parallelism, once per step: every tensor's ||w||^2 and ||u||^2 (two fp64 values per tensor of
  // the stage) all-reduced over the tensor group, so a split tensor's trust ratio is the whole tensor's.
  int64_t lamb_all_reduces = 0;
  double lamb_bytes = 0;  // sent per rank: ring
  double sent_bytes() const { return tensor_wire_bytes + pipeline_bytes + tied_bytes + lamb_bytes; }  // all of the above
};

// A stage's MeshTraffic as the ledger counts it, one row per kind a rank of it sends (none for a kind it does not):
// the calls and the bytes it sends per step.
struct MeshCollective {
  CollectiveKind kind;
  int64_t calls = 0;
  double bytes = 0;
};
std::vector<MeshCollective> mesh_collectives(const MeshTraffic& x);

struct PipelineStage {
  int first_block = 0, blocks = 0;  // blocks [first_block, first_block + blocks)
  bool embeddings = false;          // the token (and position) table: the first stage
  bool head = false;                // the final norm and the head (a tied head's copy of the table): the last
  int64_t params_per_rank = 0;      // elements one rank of this stage holds (its tensor group's share)
  int in_flight = 1;                // micro-batches whose activations it holds at once under 1F1B: min(p - s, m)
  // Per rank of this stage: its share laid out and executed over its data group by the plan's memory model
  // (compile_plan fills it: memory_planned).
  MemoryEstimate memory;
  bool memory_planned = false;
  MeshTraffic traffic;              // per rank of this stage (count_mesh_traffic)
  double zero_wire_bytes = 0;       // per rank per step: ZeRO's collectives over its data group (compile_plan fills it)
};

// With the blocks below `backward_from` running forward only (Plan::backward_from): whether a stage runs any
// backward (the head's always does), and whether it sends its input's gradient back (a block before it runs one).
inline bool stage_runs_backward(const PipelineStage& st, int64_t backward_from) {
  return st.head || st.first_block + st.blocks > backward_from;
}
inline bool stage_sends_gradient(const PipelineStage& st, int64_t backward_from) { return !st.embeddings && backward_from < st.first_block; }
// The micro-batches whose activations a stage keeps at once: none where it runs forward only (each let go once sent).
inline int activations_in_flight(const PipelineStage& st, int64_t backward_from) {
  return stage_runs_backward(st, backward_from) ? st.in_flight : 0;
}

struct MeshPlan {
  MeshShape shape;
  StagePartition partition = StagePartition::parameters;
  std::string partition_text;  // as the config gave it
  int micro_batches = 1;       // in flight per step: gradient_accumulation_steps
  std::vector<PipelineStage> stages;  // one per pipeline stage
  double bubble = 0;           // the pipeline's idle share of a step: (p - 1) / (m + p - 1)
  int tensor_groups_across_nodes = 0;  // tensor groups whose ranks are on more than one node
  int tensor_group_nodes = 1;          // the most nodes one tensor group spans
  int heaviest_stage = -1;     // the stage whose rank the plan's layout, buffers and memory describe (-1: none)
  int64_t tied_copy_per_rank = 0;  // elements of the tied table's copy on the last stage (0: none)
  // The tied table trains (compile_plan: not frozen by model.freeze or LoRA): its copy's gradient and the table's
  // weights cross between the first and last stage each step. A frozen table's copy is only read: nothing crosses.
  bool tied_trains = true;
  bool tied_exchange() const { return tied_copy_per_rank > 0 && tied_trains; }
};

// Each tensor of stage `stage`'s share (stage_share's order): the whole model's tensor it is a part of, and whether
// it is the last stage's copy of the token table for a tied head. That copy's gradient goes to the first
// stage's table each step and the table's weights come back (the copy always holds the table's weights), it
// counts once in the gradient norm (the table's) and the checkpoint takes the first stage's. Without stages (an empty mesh): the model's tensors in order.
struct StageTensor {
  int whole = 0;
  bool tied_copy = false;
};
std::vector<StageTensor> stage_tensors(const ModelSpec& model, const MeshPlan& mesh, int stage);

// A rank's segments (owned_segments of its share's layout, `share`: tensor rank `tensor_rank` of a group of `tensor`)
// as segments of the whole run's flat order (the trained tensors `whole` concatenated, as one rank lays them out:
// the model's, those model.freeze leaves, or LoRA's adapters): the same local places, the elements they hold found
// through `sources` (per parameter of `share`, the tensor of `whole` it is a part of: StageShare::trained) and
// tensor_slice_of (`model` the whole model, whose hyperparameters say how tensors split), a run broken wherever
// the whole's elements stop being consecutive (each row of a tensor split by columns); the padding's rows left
// out. `writing`: only what this rank writes to a checkpoint, so that every element is written once: the tensors
// every tensor rank holds whole come from tensor rank 0, the tied table from the first stage. A checkpoint
// written with these is the whole run's: any mesh, or one rank, resumes it, and convert-ckpt reads it as it
// reads any other.
std::vector<OwnedSegment> whole_segments(const ModelSpec& model, const ModelSpec& whole, const std::vector<StageTensor>& sources, int tensor,
                                         int tensor_rank, const FlatLayout& share, const std::vector<OwnedSegment>& owned, bool writing);

// What the config asks of the mesh, read from its tensor_parallel and pipeline blocks.
struct MeshRequest {
  int tensor = 1, pipeline = 1;
  StagePartition partition = StagePartition::parameters;
  std::string partition_text = "parameters";
};

// Sets the stages' blocks (`blocks[s]` for stage s, in order, each at least one, summing to the model's blocks) and
// each stage's parameters per rank from them.
void cut_stages(MeshPlan& plan, const ModelSpec& model, const std::vector<int>& blocks);

// Why the model's layers do not split over `tensor` ranks (empty: they do): each rank needs whole attention
// heads, whole key/value heads, an equal share of the MLP and at least one real vocabulary row.
std::vector<ConfigIssue> tensor_split_issues(const ModelHyper& h, int tensor);

// Whether tensor x pipeline divides the world; when not, the error, naming the key and the sizes that would, is
// appended (where the model is known, only sizes it takes: a tensor size its layers split over, a pipeline of at
// most its blocks).
bool check_mesh_world(const MeshRequest& request, int world_size, std::vector<ConfigIssue>& errors, const ModelHyper* model = nullptr);

// Cuts the blocks and counts each stage's share. The world must divide by tensor x pipeline; the heads, the
// kv heads and the MLP width by tensor; there must be a block per stage. What does not is appended to
// `errors`, naming the config key (the plan then has no stages).
MeshPlan plan_mesh(const ModelSpec& model, const MeshRequest& request, int world_size, int ranks_per_node, int micro_batches,
                   std::vector<ConfigIssue>& errors);

// What one rank of stage `stage` holds of the model, as a model of its own: the stage's blocks (numbered from
// 0), the embeddings on the first stage, the final norm and head (or the tied table's copy) on the last, each
// tensor its tensor-rank share. Its hyperparameters say the same: its blocks, heads, kv heads, MLP channels and
// vocabulary rows per tensor rank, and which ends it holds. What the memory model reads of it is what the
// rank holds.
ModelSpec stage_share(const ModelSpec& model, const MeshPlan& mesh, int stage);

// The micro-batches in flight per step (gradient_accumulation_steps), and what follows from them: the bubble
// and what each stage holds at once. plan_mesh calls it; the compiler again when a resumed run keeps its batch.
void schedule_micro_batches(MeshPlan& plan, int micro_batches);

// What one rank of a stage trains, as far as its traffic goes (plan_mesh.cpp's stage_training reads it off the
// stage's share: which stage holds what is decided there alone).
struct StageTraining {
  int64_t tensors = 0;  // trained tensors and adapters (Lamb's norms)
  int64_t gains = 0;    // per-head q/k norm gains among them: each rank's gradient of the whole gain summed in backward
  struct Adapter {
    TensorSplit base = TensorSplit::whole;  // its projection's split
    int64_t a_numel = 0;                    // A's elements (whole beside a column-parallel projection)
  };
  std::vector<Adapter> adapters;  // LoRA's pairs on its blocks
};

// Each stage's MeshTraffic at this micro batch and sequence length, `training` per stage, the blocks below
// `backward_from` forward only (Plan::backward_from), `lora_r` the adapters' rank: `summed_bytes` per activation
// element an all-reduce sums (fp32 where the library cannot sum 16-bit floats itself), `sent_bytes` per one the
// pipeline sends as it is, `grad_bytes` per gradient element summed, `weight_bytes` per weight (or its gradient)
// sent as it is; `per_tensor_norms`: the optimizer takes each tensor's norms (Lamb), summed over a tensor group
// once per step.
void count_mesh_traffic(MeshPlan& plan, const ModelSpec& model, const std::vector<StageTraining>& training, int64_t backward_from,
                        int64_t lora_r, int64_t micro_batch, int64_t seq_len, int summed_bytes, int sent_bytes, int grad_bytes,
                        int weight_bytes, int tied_grad_bytes, bool checkpointing, bool per_tensor_norms);

// The pipeline's idle share with p stages and m micro-batches: (p - 1) / (m + p - 1).
double pipeline_bubble(int stages, int micro_batches);

// One step of a stage's 1F1B schedule (PipeDream-Flush, DeepSpeed's TrainSchedule, Megatron's): a micro-batch's
// forward or backward.
struct PipelineOp {
  bool forward = true;
  int micro = 0;
};
// Stage `stage` of `stages` over `micro_batches`: min(p - s - 1, m) forwards to fill the pipeline, then one
// forward and one backward in turn, then the backwards left. Micro-batches go forward and backward in order, so
// a stage holds at most min(p - s, m) micro-batches' activations at once (PipelineStage::in_flight); with
// sends that never block, no two stages wait on each other.
std::vector<PipelineOp> one_forward_one_backward(int stages, int stage, int micro_batches);

}  // namespace ds
