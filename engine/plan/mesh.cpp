#include "engine/plan/mesh.hpp"

#include <algorithm>
#include <map>
#include <set>

#include "common/error.hpp"

namespace ds {

MeshCoord mesh_coord(const MeshShape& m, int rank) {
  return {(rank / m.tensor) % m.data, rank % m.tensor, rank / (m.tensor * m.data)};
}

int mesh_rank(const MeshShape& m, const MeshCoord& c) { return (c.pipeline * m.data + c.data) * m.tensor + c.tensor; }

const char* mesh_axis_name(MeshAxis a) {
  switch (a) {
    case MeshAxis::data: return "data";
    case MeshAxis::tensor: return "tensor";
    case MeshAxis::pipeline: return "pipeline";
  }
  return "?";
}

std::vector<std::vector<int>> mesh_groups(const MeshShape& m, MeshAxis axis) {
  // A group is the ranks that differ only along `axis`; it is named by its first rank's coordinates.
  std::vector<std::vector<int>> groups;
  for (int rank = 0; rank < m.world(); ++rank) {
    MeshCoord c = mesh_coord(m, rank);
    int& along = axis == MeshAxis::data ? c.data : axis == MeshAxis::tensor ? c.tensor : c.pipeline;
    if (along != 0) continue;
    const int size = axis == MeshAxis::data ? m.data : axis == MeshAxis::tensor ? m.tensor : m.pipeline;
    std::vector<int> g;
    for (along = 0; along < size; ++along) g.push_back(mesh_rank(m, c));
    groups.push_back(std::move(g));
  }
  return groups;
}

const char* tensor_split_name(TensorSplit s) {
  switch (s) {
    case TensorSplit::column: return "column";
    case TensorSplit::row: return "row";
    case TensorSplit::vocabulary: return "vocabulary";
    case TensorSplit::whole: return "whole";
  }
  return "?";
}

namespace {

// "model.layers.3.self_attn.q_proj.weight" -> module "q_proj", leaf "weight".
std::pair<std::string, std::string> module_and_leaf(const std::string& name) {
  const size_t last = name.rfind('.');
  if (last == std::string::npos) return {"", name};
  const size_t before = name.rfind('.', last - 1);
  return {name.substr(before == std::string::npos ? 0 : before + 1, last - (before == std::string::npos ? 0 : before + 1)),
          name.substr(last + 1)};
}

bool has(const std::vector<std::string>& names, const std::string& n) { return std::find(names.begin(), names.end(), n) != names.end(); }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The projection a tensor belongs to and how its matrix is stored: GPT-2's Conv1D [in, out], nn.Linear [out, in]; a
// LoRA adapter's A [r, in] and B [out, r] are nn.Linear's whatever the base, and split with their base's module.
struct Form {
  std::string module, leaf;
  bool in_out = false;
  char adapter = 0;  // 'A', 'B', or 0 for a tensor of the model
};
Form form_of(const ModelSpec& model, const TensorSpec& t) {
  const auto [module, leaf] = module_and_leaf(t.name);
  if (module == "lora_A" || module == "lora_B") {
    const std::string stem = t.name.substr(0, t.name.size() - std::string(".lora_A.weight").size());
    return {module_and_leaf(stem + ".weight").first, leaf, false, module == "lora_A" ? 'A' : 'B'};
  }
  return {module, leaf, model.hp.traits().in_out, 0};
}

}  // namespace

TensorSplit tensor_split_of(const ModelSpec& model, const TensorSpec& t) {
  const ArchTraits& traits = model.hp.traits();
  const Form f = form_of(model, t);
  const std::string& module = f.module;
  if (t.layer >= 0) {
    if (!has(traits.lora_modules, module)) return TensorSplit::whole;  // norms (a block's, and Qwen3's per-head q/k norms)
    const bool row = has(traits.row_parallel, module);
    // LoRA beside a column-parallel projection: A whole, B by its output rows (the rank's own outputs); beside a
    // row-parallel one: A by its input columns (the rank's own inputs), B whole.
    if (f.adapter == 'A') return row ? TensorSplit::row : TensorSplit::whole;
    if (f.adapter == 'B') return row ? TensorSplit::whole : TensorSplit::column;
    if (!row) return TensorSplit::column;
    return f.leaf == "bias" ? TensorSplit::whole : TensorSplit::row;  // added once, after the all-reduce
  }
  if (module == "lm_head") return TensorSplit::vocabulary;
  if (is_embedding_table(t)) return module == "wpe" ? TensorSplit::whole : TensorSplit::vocabulary;
  return TensorSplit::whole;  // the final norm
}

int64_t tensor_numel_per_rank(const ModelSpec& model, const TensorSpec& t, int tensor) {
  switch (tensor_split_of(model, t)) {
    case TensorSplit::whole: return t.numel;
    case TensorSplit::vocabulary: {
      const int64_t rows = t.shape.empty() ? t.numel : t.shape[0];
      return rows == 0 ? 0 : t.numel / rows * ceil_div(rows, tensor);
    }
    case TensorSplit::column:
    case TensorSplit::row: return t.numel / tensor;
  }
  return t.numel;
}

// A tensor's shape on one tensor rank: the split dimension divided (the output's for column and vocabulary
// splits, the input's for row splits; GPT-2's Conv1D stores [in, out], nn.Linear [out, in]).
std::vector<int64_t> tensor_shape_per_rank(const ModelSpec& model, const TensorSpec& t, int tensor) {
  std::vector<int64_t> shape = t.shape;
  if (shape.empty() || tensor == 1) return shape;
  const TensorSplit split = tensor_split_of(model, t);
  if (split == TensorSplit::whole) return shape;
  size_t dim = 0;
  if (shape.size() == 2 && split != TensorSplit::vocabulary) {
    const bool in_out = form_of(model, t).in_out;
    const bool by_output = split == TensorSplit::column;
    dim = by_output == in_out ? 1 : 0;
  }
  shape[dim] = split == TensorSplit::vocabulary ? ceil_div(shape[dim], tensor) : shape[dim] / tensor;
  return shape;
}


VocabShare vocab_share(int64_t vocab, int tensor, int rank) {
  VocabShare v;
  v.rows = ceil_div(vocab, tensor);
  v.begin = std::min<int64_t>(vocab, v.rows * rank);
  v.real = std::min<int64_t>(v.rows, vocab - v.begin);
  return v;
}

TensorSlice tensor_slice_of(const ModelSpec& model, const TensorSpec& t, int tensor, int rank) {
  TensorSlice slice;
  const TensorSplit split = tensor == 1 ? TensorSplit::whole : tensor_split_of(model, t);
  const int64_t rows = t.shape.empty() ? t.numel : t.shape[0];
  if (split == TensorSplit::whole) {
    slice.runs = {{0, rows}};
    return slice;
  }
  if (split == TensorSplit::vocabulary) {
    const VocabShare v = vocab_share(rows, tensor, rank);
    slice.runs = {{v.begin, v.real}};
    slice.padding = v.rows - v.real;
    return slice;
  }
  const bool column = split == TensorSplit::column;
  const Form f = form_of(model, t);
  if (t.shape.size() == 2) slice.dim = column == f.in_out ? 1 : 0;
  const int64_t along = t.shape.empty() ? t.numel : t.shape[static_cast<size_t>(slice.dim)];
  // The parts a packed projection makes, along its output (a packed projection's B too).
  std::vector<int64_t> parts = {along};
  const ModelHyper& h = model.hp;
  const std::string& module = f.module;
  if (column && h.traits().fused_qkv && module == h.traits().lora_modules.front()) {
    const int64_t kv = (h.num_kv_heads > 0 ? h.num_kv_heads : h.num_heads) * h.head_dim();
    parts = {along - 2 * kv, kv, kv};
  } else if (column && h.traits().fused_gate_up && module == "gate_up_proj") {
    parts = {along / 2, along / 2};
  }
  int64_t start = 0;
  for (const int64_t part : parts) {
    slice.runs.push_back({start + part / tensor * rank, part / tensor});
    start += part;
  }
  return slice;
}

std::vector<StageTensor> stage_tensors(const ModelSpec& model, const MeshPlan& mesh, int stage) {
  std::vector<StageTensor> out;
  if (mesh.stages.empty()) {
    for (size_t i = 0; i < model.tensors.size(); ++i) out.push_back({static_cast<int>(i), false});
    return out;
  }
  // stage_share's order: the stage's tensors as the model has them, then a tied head's copy of the table.
  const PipelineStage& st = mesh.stages.at(static_cast<size_t>(stage));
  int token_table = -1;
  for (size_t i = 0; i < model.tensors.size(); ++i) {
    const TensorSpec& t = model.tensors[i];
    const bool table = t.layer < 0 && is_embedding_table(t);
    if (table && is_token_table(t)) token_table = static_cast<int>(i);
    const bool holds = t.layer >= 0 ? t.layer >= st.first_block && t.layer < st.first_block + st.blocks : table ? st.embeddings : st.head;
    if (holds) out.push_back({static_cast<int>(i), false});
  }
  if (st.head && !st.embeddings && mesh.tied_copy_per_rank > 0 && token_table >= 0) out.push_back({token_table, true});
  return out;
}

std::vector<OwnedSegment> whole_segments(const ModelSpec& model, const ModelSpec& whole, const std::vector<StageTensor>& sources, int tensor,
                                         int tensor_rank, const FlatLayout& share, const std::vector<OwnedSegment>& owned, bool writing) {
  DS_CHECK(share.params.size() == sources.size(), "whole_segments: the share has ", share.params.size(), " tensors, its stage ",
           sources.size());
  std::vector<int64_t> offset(whole.tensors.size() + 1, 0);  // each whole tensor's place in the whole's flat order
  for (size_t i = 0; i < whole.tensors.size(); ++i) offset[i + 1] = offset[i] + whole.tensors[i].numel;
  std::vector<OwnedSegment> out;
  for (const OwnedSegment& s : owned) {
    const StageTensor& source = sources[static_cast<size_t>(s.param)];
    const size_t i = static_cast<size_t>(source.whole);
    const TensorSpec& t = whole.tensors[i];
    const TensorSlice slice = tensor_slice_of(model, t, tensor, tensor_rank);
    const bool kept_whole = tensor == 1 || tensor_split_of(model, t) == TensorSplit::whole;
    if (writing && ((kept_whole && tensor_rank != 0) || source.tied_copy)) continue;
    // The share as rows x columns along the slice's dimension: dimension 0 splits rows (of `inner` elements),
    // dimension 1 the columns of each row.
    const int64_t rows = t.shape.empty() ? t.numel : t.shape[0];
    const int64_t inner = rows == 0 ? 0 : t.numel / rows;             // the whole's row length
    int64_t along_runs = 0;  // the share's length along the split dimension, without its padding
    for (const auto& run : slice.runs) along_runs += run.second;
    const int64_t share_inner = slice.dim == 0 ? inner : along_runs;  // the share's row length
    int64_t k = s.global - share.params[static_cast<size_t>(s.param)].offset;  // within the share tensor
    const int64_t end = k + s.numel;
    int64_t local = s.local;
    while (k < end) {
      const int64_t row = share_inner == 0 ? 0 : k / share_inner, col = share_inner == 0 ? 0 : k % share_inner;
      const int64_t along = slice.dim == 0 ? row : col;  // the share's index along the split dimension
      int64_t start = 0, whole_index = -1, stretch = 0;
      for (const auto& [begin, length] : slice.runs) {
        if (along < start + length) {
          if (slice.dim == 0) {
            whole_index = (begin + along - start) * inner + col;
            stretch = (start + length - along) * inner - col;
          } else {
            whole_index = row * inner + begin + along - start;
            stretch = start + length - along;
          }
          break;
        }
        start += length;
      }
      if (whole_index < 0) stretch = (along_runs + slice.padding - row) * inner - col;  // the padding rows (dimension 0 only)
      stretch = std::min(stretch, end - k);
      if (whole_index >= 0) out.push_back({s.param, offset[i] + whole_index, local, stretch});
      k += stretch;
      local += stretch;
    }
  }
  return out;
}

ModelSpec stage_share(const ModelSpec& model, const MeshPlan& mesh, int stage) {
  const PipelineStage& st = mesh.stages.at(static_cast<size_t>(stage));
  const int t = mesh.shape.tensor;
  ModelSpec s;
  s.hp = model.hp;
  s.hp.num_layers = st.blocks;
  s.hp.head_dim_given = model.hp.head_dim();  // the heads keep their width when a rank holds fewer of them
  s.hp.num_heads = model.hp.num_heads / t;
  if (s.hp.num_kv_heads > 0) s.hp.num_kv_heads = model.hp.num_kv_heads / t;
  s.hp.intermediate_size = model.hp.intermediate_size / t;
  s.hp.vocab_size = ceil_div(model.hp.vocab_size, t);  // the rows of the table and head a rank holds
  s.holds_head = st.head;
  std::map<int, int64_t> per_block;
  const auto add = [&](const TensorSpec& whole, int layer) {
    TensorSpec part = whole;
    part.shape = tensor_shape_per_rank(model, whole, t);
    part.numel = tensor_numel_per_rank(model, whole, t);
    part.layer = layer;
    s.num_params += part.numel;
    s.largest_module_params = std::max(s.largest_module_params, part.numel);
    if (layer >= 0) per_block[layer] += part.numel;
    s.tensors.push_back(std::move(part));
  };
  // (a tied head's copy of the token table last, where the head is: plan_mesh counted it)
  for (const StageTensor& source : stage_tensors(model, mesh, stage)) {
    const TensorSpec& whole = model.tensors[static_cast<size_t>(source.whole)];
    add(whole, whole.layer >= 0 ? whole.layer - st.first_block : -1);
  }
  for (const auto& [layer, n] : per_block) s.largest_block_params = std::max(s.largest_block_params, n);
  return s;
}

double pipeline_bubble(int stages, int micro_batches) {
  if (stages <= 1) return 0;
  return static_cast<double>(stages - 1) / static_cast<double>(micro_batches + stages - 1);
}

std::vector<MeshCollective> mesh_collectives(const MeshTraffic& x) {
  std::vector<MeshCollective> out;
  if (x.tensor_all_reduces > 0) out.push_back({CollectiveKind::tensor_activations, x.tensor_all_reduces, x.tensor_wire_bytes});
  if (x.pipeline_sends > x.pipeline_gradient_sends)
    out.push_back({CollectiveKind::pipeline_activations, x.pipeline_sends - x.pipeline_gradient_sends,
                   x.pipeline_bytes - x.pipeline_gradient_bytes});
  if (x.pipeline_gradient_sends > 0)
    out.push_back({CollectiveKind::pipeline_gradients, x.pipeline_gradient_sends, x.pipeline_gradient_bytes});
  if (x.tied_sends > 0) out.push_back({CollectiveKind::tied_embedding, x.tied_sends, x.tied_bytes});
  if (x.lamb_all_reduces > 0) out.push_back({CollectiveKind::lamb_norms_tensor, x.lamb_all_reduces, x.lamb_bytes});
  return out;
}

std::vector<PipelineOp> one_forward_one_backward(int stages, int stage, int micro_batches) {
  const int warm_up = std::min(stages - stage - 1, micro_batches);
  std::vector<PipelineOp> ops;
  int forward = 0, backward = 0;
  for (; forward < warm_up; ++forward) ops.push_back({true, forward});
  while (forward < micro_batches) {
    ops.push_back({true, forward++});
    ops.push_back({false, backward++});
  }
  while (backward < micro_batches) ops.push_back({false, backward++});
  return ops;
}

namespace {

// Per rank of a tensor group: each block's share, what the first stage adds (the token and position tables)
// and what the last adds (the final norm and the head; a tied head is a copy of the token table there once
// the two are on different stages).
struct StageWeights {
  std::vector<int64_t> block;
  int64_t first = 0, last = 0, tied_copy = 0;
};

StageWeights stage_weights(const ModelSpec& model, int tensor) {
  StageWeights w;
  w.block.assign(static_cast<size_t>(std::max<int64_t>(model.hp.num_layers, 0)), 0);
  for (const TensorSpec& t : model.tensors) {
    const int64_t n = tensor_numel_per_rank(model, t, tensor);
    if (t.layer >= 0 && static_cast<size_t>(t.layer) < w.block.size()) w.block[static_cast<size_t>(t.layer)] += n;
    else if (is_embedding_table(t)) w.first += n;
    else w.last += n;
    if (is_embedding_table(t) && tensor_split_of(model, t) == TensorSplit::vocabulary && model.hp.tie_word_embeddings) w.tied_copy = n;
  }
  return w;
}

// Blocks per stage for `p` stages: the same number on each, the first ones taking one more.
std::vector<int> uniform_cut(int blocks, int p) {
  std::vector<int> n(static_cast<size_t>(p), blocks / p);
  for (int s = 0; s < blocks % p; ++s) ++n[static_cast<size_t>(s)];
  return n;
}

// Blocks per stage so that the largest stage (its blocks, and the first's and last's extras) is as small as
// it can be: the least capacity at which filling each stage in turn, as full as it goes while leaving a
// block for each stage after it, fits them all.
std::vector<int> balanced_cut(const StageWeights& w, int p, int64_t last_extra) {
  const int L = static_cast<int>(w.block.size());
  auto fill = [&](int64_t cap, std::vector<int>* out) {
    std::vector<int> n;
    int next = 0;
    for (int s = 0; s < p; ++s) {
      int64_t load = (s == 0 ? w.first : 0) + (s == p - 1 ? last_extra : 0);
      int taken = 0;
      const int must_leave = p - 1 - s;
      while (next < L - must_leave && (s == p - 1 || load + w.block[static_cast<size_t>(next)] <= cap || taken == 0)) {
        load += w.block[static_cast<size_t>(next++)];
        ++taken;
      }
      if (load > cap) return false;
      n.push_back(taken);
    }
    if (out) *out = n;
    return next == L;
  };
  int64_t lo = 0, hi = w.first + last_extra;
  for (int64_t b : w.block) hi += b;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (fill(mid, nullptr)) hi = mid; else lo = mid + 1;
  }
  std::vector<int> n;
  fill(lo, &n);
  return n;
}

}  // namespace

void schedule_micro_batches(MeshPlan& plan, int micro_batches) {
  plan.micro_batches = std::max(micro_batches, 1);
  plan.bubble = pipeline_bubble(plan.shape.pipeline, plan.micro_batches);
  for (size_t s = 0; s < plan.stages.size(); ++s)
    plan.stages[s].in_flight = std::min(plan.shape.pipeline - static_cast<int>(s), plan.micro_batches);
}

void count_mesh_traffic(MeshPlan& plan, const ModelSpec& model, const std::vector<StageTraining>& training, int64_t backward_from,
                        int64_t lora_r, int64_t micro_batch, int64_t seq_len, int summed_bytes, int sent_bytes, int grad_bytes,
                        int weight_bytes, int tied_grad_bytes, bool checkpointing, bool per_tensor_norms) {
  const ModelHyper& h = model.hp;
  const int t = plan.shape.tensor, p = plan.shape.pipeline;
  const double m = plan.micro_batches, tokens = static_cast<double>(micro_batch) * static_cast<double>(seq_len);
  const double boundary = tokens * static_cast<double>(h.hidden_size);  // one micro-batch's elements at one block boundary
  const double activation = boundary * summed_bytes, sent = boundary * sent_bytes;
  const double ring = t > 1 ? 2.0 * (t - 1) / t : 0;
  DS_CHECK(training.size() == plan.stages.size(), "what ", training.size(), " stages train, for ", plan.stages.size());
  for (size_t s = 0; s < plan.stages.size(); ++s) {
    PipelineStage& st = plan.stages[s];
    MeshTraffic& x = st.traffic;
    x = {};
    const int64_t forward_only = std::clamp<int64_t>(backward_from - st.first_block, 0, st.blocks);
    if (t > 1) {
      const int64_t per_block = 2 + 2 + (checkpointing ? 2 : 0);  // forward, backward, forward again
      const int64_t big = (st.blocks - forward_only) * per_block + forward_only * 2 + (st.embeddings ? 1 : 0) + (st.head ? 1 : 0);
      // The loss: a call per chunk of the rank's logits, 2t + 1 values per token over the chunks.
      const int64_t chunk = head_chunk_rows(ceil_div(h.vocab_size, t));
      const int64_t loss = st.head ? ceil_div(micro_batch * seq_len, chunk) : 0;
      const StageTraining& trains = training[s];
      // LoRA beside a column-parallel projection: A's gradient summed in backward (r x in); beside a row-parallel one
      // each rank's x A^T summed in forward (micro x seq x r, again when the block is recomputed).
      int64_t adapter_calls = 0;
      double adapter_payload = 0;
      for (const StageTraining::Adapter& a : trains.adapters) {
        if (a.base == TensorSplit::row) {
          const int64_t calls = checkpointing ? 2 : 1;
          adapter_calls += calls;
          adapter_payload += static_cast<double>(calls) * tokens * static_cast<double>(lora_r) * summed_bytes;
        } else {
          adapter_calls += 1;
          adapter_payload += static_cast<double>(a.a_numel) * grad_bytes;
        }
      }
      const int64_t gains = trains.gains, trained = trains.tensors;
      x.tensor_all_reduces = static_cast<int64_t>(m) * (big + loss + gains + adapter_calls);
      x.tensor_payload_bytes =
          m * (static_cast<double>(big) * activation + (st.head ? static_cast<double>(2 * t + 1) * tokens * 4 : 0.0) +
               static_cast<double>(gains * h.head_dim() * grad_bytes) + adapter_payload);
      x.tensor_wire_bytes = ring * x.tensor_payload_bytes;
      if (per_tensor_norms) {
        x.lamb_all_reduces = 1;
        x.lamb_bytes = ring * 2.0 * 8.0 * static_cast<double>(trained);
      }
    }
    // Activations on; gradients back where a block before this stage runs backward.
    const int gradients_back = stage_sends_gradient(st, backward_from) ? 1 : 0;
    const int neighbours = (static_cast<int>(s) + 1 < p ? 1 : 0) + gradients_back;
    x.pipeline_sends = static_cast<int64_t>(m) * neighbours;
    x.pipeline_bytes = m * neighbours * sent;
    x.pipeline_gradient_sends = static_cast<int64_t>(m) * gradients_back;
    x.pipeline_gradient_bytes = m * gradients_back * sent;
    if (plan.tied_exchange() && (st.embeddings || st.head)) {
      x.tied_sends = 1;  // the last stage's gradient of its copy (as the step holds it), the first stage's weights back
      x.tied_bytes = static_cast<double>(plan.tied_copy_per_rank) * (st.head ? tied_grad_bytes : weight_bytes);
    }
  }
}

void cut_stages(MeshPlan& plan, const ModelSpec& model, const std::vector<int>& blocks) {
  const int p = static_cast<int>(blocks.size());
  DS_CHECK(p == plan.shape.pipeline, "a cut of ", p, " stages for a pipeline of ", plan.shape.pipeline);
  const StageWeights w = stage_weights(model, plan.shape.tensor);
  const int64_t last_extra = w.last + (p > 1 ? w.tied_copy : 0);
  const std::vector<int> in_flight = [&] {
    std::vector<int> f;
    for (const PipelineStage& st : plan.stages) f.push_back(st.in_flight);
    return f;
  }();
  plan.stages.clear();
  int first = 0;
  for (int s = 0; s < p; ++s) {
    PipelineStage st;
    st.first_block = first;
    st.blocks = blocks[static_cast<size_t>(s)];
    DS_CHECK(st.blocks >= 1 || p == 1, "stage ", s, " of ", p, " cut with no block");
    st.embeddings = s == 0;
    st.head = s == p - 1;
    if (static_cast<size_t>(s) < in_flight.size()) st.in_flight = in_flight[static_cast<size_t>(s)];
    for (int b = first; b < first + st.blocks; ++b) st.params_per_rank += w.block[static_cast<size_t>(b)];
    if (st.embeddings) st.params_per_rank += w.first;
    if (st.head) st.params_per_rank += last_extra;
    first += st.blocks;
    plan.stages.push_back(st);
  }
  DS_CHECK(first == static_cast<int>(w.block.size()), "a cut of ", first, " blocks for a model of ", w.block.size());
}

std::vector<ConfigIssue> tensor_split_issues(const ModelHyper& h, int tensor) {
  std::vector<ConfigIssue> issues;
  if (tensor <= 1) return issues;
  const int64_t kv = h.num_kv_heads > 0 ? h.num_kv_heads : h.num_heads;
  const auto need = [&](int64_t count, const std::string& what, const std::string& why) {
    if (count % tensor != 0)
      issues.push_back({"tensor_parallel.autotp_size",
                        "the model's " + std::to_string(count) + " " + what + " do not split over " + std::to_string(tensor) + " tensor ranks", why});
  };
  need(h.num_heads, "attention heads", "each tensor rank computes whole heads: choose a tensor size that divides them");
  if (kv != h.num_heads)
    need(kv, "key/value heads",
         kv < tensor ? "each tensor rank needs whole key/value heads, and there are fewer than ranks (Megatron copies them to "
                       "each rank; ds does not yet): choose a tensor size of at most " + std::to_string(kv)
                     : "each tensor rank needs whole key/value heads: choose a tensor size that divides them");
  need(h.intermediate_size, "MLP channels (intermediate_size)", "each tensor rank computes an equal share of the MLP");
  // Each rank's rows are ceil(V / t): the last rank must still hold a real one (its loss's share of the softmax).
  if (h.vocab_size > 0 && vocab_share(h.vocab_size, tensor, tensor - 1).real < 1)
    issues.push_back({"tensor_parallel.autotp_size",
                      "the model's " + std::to_string(h.vocab_size) + " vocabulary rows leave tensor rank " + std::to_string(tensor - 1) +
                          " none of its own (each rank holds " + std::to_string(ceil_div(h.vocab_size, tensor)) + ")",
                      "choose a smaller tensor size"});
  return issues;
}

bool check_mesh_world(const MeshRequest& r, int world_size, std::vector<ConfigIssue>& errors, const ModelHyper* model) {
  const int64_t blocks = model ? model->num_layers : 0;
  const int64_t split = int64_t{r.tensor} * r.pipeline;  // each up to the schema's 2^20: their product needs 64 bits
  if (split <= world_size && world_size % split == 0) return true;
  // The key to change: the tensor size when it alone does not divide the world, else the pipeline's.
  const bool tensor_alone = r.tensor > world_size || world_size % r.tensor != 0;
  const std::string key = tensor_alone ? "tensor_parallel.autotp_size" : "pipeline.stages";
  // The sizes of that key the world takes with the other kept (the divisors of what the other leaves of the world),
  // or, where the other does not divide the world either, with the other 1; a pipeline no longer than the blocks.
  const int other = tensor_alone ? r.pipeline : r.tensor;
  const bool other_kept = other > 1 && world_size % other == 0;
  const int left = other_kept ? world_size / other : world_size;
  std::string sizes;
  for (int d = 1; d <= left; ++d)
    if (left % d == 0 && (tensor_alone ? !model || tensor_split_issues(*model, d).empty() : blocks <= 0 || d <= blocks))
      sizes += (sizes.empty() ? "" : ", ") + std::to_string(d);
  const std::string other_key = tensor_alone ? "pipeline" : "tensor";
  const std::string with = other <= 1 ? ""
                           : other_kept ? " (with " + other_key + " " + std::to_string(other) + ")"
                                        : " (with " + other_key + " 1: " + std::to_string(other) + " does not divide the world either)";
  errors.push_back({key,
                    "the " + std::to_string(world_size) + (world_size == 1 ? " rank does" : " ranks do") + " not split into tensor " +
                        std::to_string(r.tensor) + " x pipeline " + std::to_string(r.pipeline) +
                        " groups (their product must divide the world size)",
                    "launch a multiple of " + std::to_string(split) + " ranks, or set " + key + with + " to one of: " + sizes});
  return false;
}

MeshPlan plan_mesh(const ModelSpec& model, const MeshRequest& r, int world_size, int ranks_per_node, int micro_batches,
                   std::vector<ConfigIssue>& errors) {
  MeshPlan plan;
  plan.partition = r.partition;
  plan.partition_text = r.partition_text;
  const size_t before = errors.size();
  check_mesh_world(r, world_size, errors, &model.hp);
  const ModelHyper& h = model.hp;
  for (ConfigIssue& issue : tensor_split_issues(h, r.tensor)) errors.push_back(std::move(issue));
  if (r.pipeline > 1 && r.pipeline > h.num_layers)
    errors.push_back({"pipeline.stages", std::to_string(r.pipeline) + " stages for the model's " + std::to_string(h.num_layers) + " blocks",
                      "each stage needs at least one block: use at most " + std::to_string(h.num_layers) + " stages"});
  if (errors.size() != before) return plan;
  plan.shape = {world_size / (r.tensor * r.pipeline), r.tensor, r.pipeline};  // checked: divides the world

  const StageWeights w = stage_weights(model, r.tensor);
  const int64_t last_extra = w.last + (r.pipeline > 1 ? w.tied_copy : 0);
  plan.tied_copy_per_rank = r.pipeline > 1 ? w.tied_copy : 0;
  // (memory: the parameters' cut until compile_plan knows what a stage's memory is)
  cut_stages(plan, model, r.partition == StagePartition::uniform ? uniform_cut(static_cast<int>(h.num_layers), r.pipeline)
                                                                 : balanced_cut(w, r.pipeline, last_extra));
  schedule_micro_batches(plan, micro_batches);
  const int per_node = std::max(ranks_per_node, 1);
  for (const std::vector<int>& g : mesh_groups(plan.shape, MeshAxis::tensor)) {
    const int nodes = g.back() / per_node - g.front() / per_node + 1;  // a group is consecutive ranks
    if (nodes > 1) ++plan.tensor_groups_across_nodes;
    plan.tensor_group_nodes = std::max(plan.tensor_group_nodes, nodes);
  }
  return plan;
}

}  // namespace ds
