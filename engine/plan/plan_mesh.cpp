// ds — the plan of a model split over ranks (tensor and pipeline parallelism, engine/plan/mesh.hpp) as compile_plan
// makes it: each stage's rank laid out over its data group, the stages cut by memory where asked, the heaviest
// stage's rank judged, and the warnings a split model's plan carries.
#include <algorithm>
#include <map>
#include <tuple>
#include <utility>

#include "common/format.hpp"
#include "engine/plan/plan.hpp"
#include "engine/plan/plan_steps.hpp"

namespace ds {

StageShare share_of(const Plan& plan, int stage) {
  StageShare own;
  const bool split = plan.mesh.shape.splits_the_model() && !plan.mesh.stages.empty();
  own.model = split ? stage_share(plan.model, plan.mesh, stage) : plan.model;
  own.tensors = stage_tensors(plan.model, plan.mesh, split ? stage : 0);  // (the model's own order without stages)
  const int first_block = split ? plan.mesh.stages[static_cast<size_t>(stage)].first_block : 0;
  if (!plan.frozen.empty())
    for (const StageTensor& t : own.tensors) own.frozen.push_back(plan.frozen[static_cast<size_t>(t.whole)]);
  if (plan.lora.enabled) {
    // The adapters of the share's tensors, in the whole adapter's order (A then B, a projection's pair together).
    std::vector<int> local(plan.model.tensors.size(), -1);
    for (size_t i = 0; i < own.tensors.size(); ++i)
      if (!own.tensors[i].tied_copy) local[static_cast<size_t>(own.tensors[i].whole)] = static_cast<int>(i);
    LoraPlan& l = own.lora;
    l = plan.lora;
    l.adapters.tensors.clear();
    l.adapted.clear();
    l.adapters.hp = own.model.hp;
    l.adapters.num_params = l.adapters.largest_module_params = l.adapters.largest_block_params = 0;
    std::map<int, int64_t> per_block;
    for (size_t a = 0; a + 1 < plan.lora.adapters.tensors.size(); a += 2) {
      const int at = local[static_cast<size_t>(plan.lora.adapted[a])];
      if (at < 0) continue;
      int64_t module = 0;
      for (size_t k = a; k < a + 2; ++k) {
        TensorSpec t = plan.lora.adapters.tensors[k];
        t.shape = tensor_shape_per_rank(plan.model, t, plan.mesh.shape.tensor);  // (split with its base over tensor ranks)
        t.numel = tensor_numel_per_rank(plan.model, t, plan.mesh.shape.tensor);
        t.layer -= first_block;
        module += t.numel;
        per_block[t.layer] += t.numel;
        l.adapters.tensors.push_back(std::move(t));
        l.adapted.push_back(at);
        own.trained.push_back({static_cast<int>(k), false});
        own.trained_model.push_back(-1);
      }
      l.adapters.num_params += module;
      l.adapters.largest_module_params = std::max(l.adapters.largest_module_params, module);
    }
    for (const auto& [layer, n] : per_block) l.adapters.largest_block_params = std::max(l.adapters.largest_block_params, n);
    return own;
  }
  // The whole run's trained tensors: the model's, or under model.freeze those not frozen, in the model's order.
  std::vector<int> trained_at(plan.model.tensors.size(), -1);
  for (size_t i = 0, k = 0; i < plan.model.tensors.size(); ++i)
    if (!plan.is_frozen(i)) trained_at[i] = static_cast<int>(k++);
  for (size_t i = 0; i < own.tensors.size(); ++i) {
    if (own.is_frozen(i)) continue;
    const StageTensor& t = own.tensors[i];
    own.trained.push_back({trained_at[static_cast<size_t>(t.whole)], t.tied_copy});
    own.trained_model.push_back(t.whole);
  }
  if (!own.frozen.empty()) own.unfrozen = unfrozen_part(own.model, own.frozen);
  return own;
}

std::vector<StageTraining> stage_training(const Plan& plan) {
  std::vector<StageTraining> out;
  const bool gains = plan.model.hp.traits().qk_norm;
  for (size_t s = 0; s < plan.mesh.stages.size(); ++s) {
    const StageShare own = share_of(plan, static_cast<int>(s));
    StageTraining t;
    t.tensors = static_cast<int64_t>(own.trained.size());
    for (const int whole : own.trained_model) {
      if (whole < 0 || !gains) continue;
      const TensorSpec& w = plan.model.tensors[static_cast<size_t>(whole)];
      const std::string module = lora_module_of(w.name);
      if (w.layer >= 0 && (module == "q_norm" || module == "k_norm")) ++t.gains;
    }
    const std::vector<TensorSpec>& adapters = own.lora.adapters.tensors;
    for (size_t a = 0; a + 1 < adapters.size(); a += 2) {
      const TensorSpec& base = plan.model.tensors[static_cast<size_t>(own.tensors[static_cast<size_t>(own.lora.adapted[a])].whole)];
      t.adapters.push_back({tensor_split_of(plan.model, base), adapters[a].numel});
    }
    out.push_back(std::move(t));
  }
  return out;
}

Plan stage_rank_plan(const Plan& plan, size_t s, int zero_stage) {
  const MeshPlan& mesh = plan.mesh;
  Plan rank = plan;
  rank.own = share_of(plan, static_cast<int>(s));
  // The rank's share as the model it trains: its tensors, those frozen, LoRA's adapters on its blocks.
  rank.model = rank.own.model;
  rank.frozen = rank.own.frozen;
  rank.unfrozen = rank.own.unfrozen;
  rank.lora = rank.own.lora;
  const PipelineStage& st = mesh.stages[s];
  rank.backward_from = std::clamp<int64_t>(plan.backward_from - st.first_block, 0, st.blocks);
  rank.topology.world_size = mesh.shape.data;
  rank.topology.rank = mesh_coord(mesh.shape, plan.topology.rank).data;  // its place in its data group
  lay_out(rank, zero_stage, mesh.stages[s].in_flight);
  return rank;
}

namespace {

// Device bytes per rank (the host's a tie-break, as lay_out_mesh judges) of pipeline stage `s` holding the `n` blocks
// from block `b`, the stages before it the `b` blocks before and the stages after the rest (one block each at least,
// which does not change stage s's own bytes).
double stage_bytes_with(const Plan& plan, int s, int b, int n, int zero_stage) {
  const int p = plan.mesh.shape.pipeline, L = static_cast<int>(plan.model.hp.num_layers);
  int before = b, after = L - b - n;
  if (s == 0) after += std::exchange(before, 0);  // (alike blocks: only how many the stage holds matters)
  if (s == p - 1) before += std::exchange(after, 0);
  std::vector<int> blocks(static_cast<size_t>(p), 1);
  blocks[static_cast<size_t>(s)] = n;
  if (s > 0) blocks[0] += before - s;
  if (s < p - 1) blocks[static_cast<size_t>(p - 1)] += after - (p - 1 - s);
  Plan probe = plan;
  cut_stages(probe.mesh, probe.model, blocks);
  const Plan rank = stage_rank_plan(probe, static_cast<size_t>(s), zero_stage);
  return rank.memory.device.total() + 1e-9 * rank.memory.host.total();
}

}  // namespace

// pipeline.partition "memory": the cut whose heaviest stage needs the least memory per rank. A stage's bytes grow
// with its blocks (their weights, gradients and states, and the activations of the micro-batches it holds at once,
// more on the first stages); the least capacity every stage's blocks fit in is found by bisection, the stages from
// the first taking as many blocks as fit in it (a binary search over the block count, each count's bytes the plan's
// memory model's, computed once), which leaves the later stages the fewest. Blocks alike (every one training, or
// LoRA's) weigh the same wherever they are; under model.freeze a stage's bytes depend on which blocks it holds (a
// frozen block has no gradient or state, and below every trained tensor no activations either).
void cut_stages_by_memory(Plan& plan, int zero_stage) {
  MeshPlan& mesh = plan.mesh;
  const int p = mesh.shape.pipeline, L = static_cast<int>(plan.model.hp.num_layers);
  if (p <= 1 || L < p) return;
  const bool alike = plan.lora.enabled || plan.frozen.empty();
  std::map<std::tuple<int, int, int>, double> known;
  const auto bytes = [&](int s, int b, int n) {
    const auto [it, added] = known.try_emplace({s, alike ? 0 : b, n}, 0.0);
    if (added) it->second = stage_bytes_with(plan, s, b, n, zero_stage);
    return it->second;
  };
  const auto most_within = [&](int s, int b, double cap) {  // 0: not even one block fits
    int lo = 0, hi = L - b - (p - 1 - s);  // the stages after keep a block each
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (bytes(s, b, mid) <= cap) lo = mid; else hi = mid - 1;
    }
    return lo;
  };
  // The blocks each stage takes under `cap`, from the first; empty where they do not all fit.
  const auto cut_within = [&](double cap) {
    std::vector<int> blocks;
    int b = 0;
    for (int s = 0; s < p; ++s) {
      const int n = s == p - 1 ? (bytes(s, b, L - b) <= cap ? L - b : 0) : most_within(s, b, cap);
      if (n == 0) return std::vector<int>{};
      blocks.push_back(n);
      b += n;
    }
    return blocks;
  };
  // lo does not fit (or is the least any cut needs), hi does: the cut by parameters' heaviest stage (a stage's
  // bytes never grow when it holds fewer of its blocks, so the greedy cut fits wherever any cut does).
  double lo = 0, hi = 0;
  for (int s = 0, b = 0; s < p; b += mesh.stages[static_cast<size_t>(s)].blocks, ++s)
    hi = std::max(hi, bytes(s, b, mesh.stages[static_cast<size_t>(s)].blocks));
  if (alike)
    for (int s = 0; s < p; ++s) lo = std::max(lo, bytes(s, s, 1));  // every cut gives each stage a block at least
  if (!cut_within(lo).empty()) hi = lo;
  for (int i = 0; i < 64 && hi - lo > 1.0; ++i) {
    const double mid = lo + (hi - lo) / 2;
    (cut_within(mid).empty() ? lo : hi) = mid;
  }
  const std::vector<int> blocks = cut_within(hi);
  DS_CHECK(!blocks.empty(), "no cut of ", L, " blocks into ", p, " stages within ", hi, " bytes");
  cut_stages(mesh, plan.model, blocks);
}

// The step's loss, norm and stop flag are agreed by the whole world (every rank holds a part of the norm), not
// the data group ZeRO's collectives run over.
void agree_over_the_world(Plan& plan) {
  std::vector<Collective>& all = plan.execution.collectives;
  all.erase(std::remove_if(all.begin(), all.end(), [](const Collective& c) { return c.kind == CollectiveKind::control; }), all.end());
  if (plan.topology.world_size > 1) all.insert(all.begin(), control_collective(plan.topology.world_size));
}

// A model split over ranks: each stage's rank laid out and executed over its data group by the same model as
// the whole plan (its share of the model as a model of its own: its frozen tensors, LoRA's adapters on its
// blocks), its activations those of the micro-batches it holds at once. The plan's layout, buffers and memory
// become those of the heaviest stage's rank, which the fit check and the device budget judge.
void lay_out_mesh(Plan& plan, int stage) {
  MeshPlan& mesh = plan.mesh;
  if (!mesh.shape.splits_the_model()) return;
  double heaviest = -1;
  Plan at_heaviest;
  for (size_t s = 0; s < mesh.stages.size(); ++s) {
    PipelineStage& st = mesh.stages[s];
    Plan rank = stage_rank_plan(plan, s, stage);
    st.memory = rank.memory;
    st.zero_wire_bytes = 0;
    for (const Collective& c : rank.execution.collectives)
      if (c.kind != CollectiveKind::control) st.zero_wire_bytes += c.wire_bytes_per_rank_per_step;
    st.memory_planned = true;
    // Heaviest on the device, which the fit judges (the host's as a tie-break: offloaded states differ by stage).
    const double bytes = rank.memory.device.total() + 1e-9 * rank.memory.host.total();
    if (bytes > heaviest) {
      heaviest = bytes;
      mesh.heaviest_stage = static_cast<int>(s);
      at_heaviest = std::move(rank);
    }
  }
  plan.layout = std::move(at_heaviest.layout);
  plan.execution = std::move(at_heaviest.execution);
  plan.memory = mesh.stages[static_cast<size_t>(mesh.heaviest_stage)].memory;
  agree_over_the_world(plan);
}

MeshRequest mesh_request(const Config& c) {
  MeshRequest r;
  r.tensor = c.parallel.tensor;
  r.pipeline = c.parallel.pipeline;
  r.partition_text = c.parallel.partition;
  r.partition = c.parallel.partition == "uniform" || c.parallel.partition.rfind("type:", 0) == 0 ? StagePartition::uniform
                : c.parallel.partition == "memory"                                                ? StagePartition::memory
                                                                                                   : StagePartition::parameters;
  return r;
}

// The mesh's shape before the batch (which counts its data-parallel ranks); a world it does not divide is
// reported by plan_mesh, and the batch meanwhile counts every rank.
MeshShape mesh_shape_of(const Config& c, const Topology& topo) {
  std::vector<ConfigIssue> reported_by_plan_mesh;
  if (!check_mesh_world(mesh_request(c), topo.world_size, reported_by_plan_mesh)) return {topo.world_size, 1, 1};
  return {topo.world_size / (c.parallel.tensor * c.parallel.pipeline), c.parallel.tensor, c.parallel.pipeline};
}

// What a split model's plan counts and what it does not yet.
void note_mesh(Plan& plan) {
  const MeshPlan& m = plan.mesh;
  if (!m.shape.splits_the_model()) return;
  const std::string split = "tensor " + std::to_string(m.shape.tensor) + " x pipeline " + std::to_string(m.shape.pipeline);
  if (!plan.has_model)
    plan.warnings.push_back({"", "the model is split over ranks (" + split + "): its stages, their parameters and memory per rank need "
                                     "the model (model.preset=NAME or a model block)",
                             "give the model: ds train splits it over tensor ranks and pipeline stages"});
  // (otherwise ds plan's mesh table says what a rank of each stage holds and sends, and which stage the memory below is)
  // Fewer micro-batches than stages: most of each step, most stages wait. 4 (p - 1) keeps the bubble at 20%.
  const int p = m.shape.pipeline;
  if (plan.has_model && p > 1 && m.micro_batches < p)
    plan.warnings.push_back({"gradient_accumulation_steps",
                             std::to_string(m.micro_batches) + (m.micro_batches == 1 ? " micro-batch" : " micro-batches") + " per step through " +
                                 std::to_string(p) + " pipeline stages: " + format_fixed(100 * m.bubble, 1) +
                                 "% of each step is the pipeline's bubble, each stage idle",
                             "raise gradient_accumulation_steps (the micro-batches in flight; " + std::to_string(4 * (p - 1)) +
                                 " keep the bubble at 20% or less) and lower train_micro_batch_size_per_gpu to keep the global batch"});
}

std::vector<double> stage_device_bytes(const Plan& plan, const std::vector<int>& blocks) {
  Plan probe = plan;
  cut_stages(probe.mesh, probe.model, blocks);
  std::vector<double> out;
  for (size_t s = 0; s < blocks.size(); ++s) out.push_back(stage_rank_plan(probe, s, plan.zero_stage()).memory.device.total());
  return out;
}

int own_stage(const Plan& plan) {
  return plan.mesh.shape.pipeline > 1 ? mesh_coord(plan.mesh.shape, plan.topology.rank).pipeline : 0;
}

Plan with_own_stage(const Plan& plan) {
  Plan own = plan;
  const int s = own_stage(plan);
  if (plan.mesh.shape.pipeline == 1 || s == plan.mesh.heaviest_stage || plan.mesh.heaviest_stage < 0) return own;
  const Plan rank = stage_rank_plan(plan, static_cast<size_t>(s), plan.zero_stage());
  own.own = rank.own;
  own.layout = rank.layout;
  own.execution = rank.execution;
  own.memory = rank.memory;
  agree_over_the_world(own);
  return own;
}

}  // namespace ds
