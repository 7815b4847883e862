#include "engine/plan/estimate.hpp"

#include "engine/plan/fit.hpp"
#include "engine/plan/runnable.hpp"

#include <algorithm>

namespace ds {
namespace {

int offload_level(const EstimateChoice& c) {
  if (c.offload_param == OffloadDevice::nvme || c.offload_optimizer == OffloadDevice::nvme) return 3;
  if (c.offload_param == OffloadDevice::cpu) return 2;
  if (c.offload_optimizer == OffloadDevice::cpu) return 1;
  return 0;
}

std::vector<EstimateChoice> all_choices() {
  std::vector<EstimateChoice> out;
  const OffloadDevice none = OffloadDevice::none, cpu = OffloadDevice::cpu, nvme = OffloadDevice::nvme;
  for (bool ckpt : {false, true}) {
    for (int s : {0, 1, 2, 3}) out.push_back({s, none, none, ckpt});
    out.push_back({1, cpu, none, ckpt});
    out.push_back({2, cpu, none, ckpt});
    out.push_back({3, cpu, none, ckpt});
    out.push_back({3, cpu, cpu, ckpt});
    out.push_back({3, nvme, none, ckpt});
    out.push_back({3, nvme, nvme, ckpt});
  }
  return out;
}

std::string overrides_for(const Config& base, const EstimateChoice& c) {
  std::string o;
  if (base.parallel.tensor > 1 || base.parallel.pipeline > 1)  // the mesh the rows are for
    o = "tensor_parallel.autotp_size=" + std::to_string(base.parallel.tensor) + " pipeline.stages=" + std::to_string(base.parallel.pipeline) +
        " gradient_accumulation_steps=" + std::to_string(base.gradient_accumulation_steps.value_or(1)) + " ";
  o += "zero_optimization.stage=" + std::to_string(c.stage);
  if (c.offload_optimizer != OffloadDevice::none)
    o += std::string(" zero_optimization.offload_optimizer.device=") + offload_device_name(c.offload_optimizer);
  if (c.offload_param != OffloadDevice::none)
    o += std::string(" zero_optimization.offload_param.device=") + offload_device_name(c.offload_param);
  if (c.offload_optimizer == OffloadDevice::nvme || c.offload_param == OffloadDevice::nvme)
    o += " (and nvme_path)";
  o += c.activation_checkpointing ? " model.activation_checkpointing=true" : "";
  return o;
}

}  // namespace

int speed_rank_of(const EstimateChoice& c) {
  // Offload level first, then stage 3 vs the others, then recomputation, then the stage itself.
  return offload_level(c) * 1000 + (c.stage == 3 ? 100 : 0) + (c.activation_checkpointing ? 10 : 0) + c.stage;
}

MemoryEstimateTable estimate_memory_table(const Config& base, const ModelSpec& model, const Topology& topo,
                                          const EstimateFilter& filter, double headroom) {
  MemoryEstimateTable t;
  t.host_memory_per_node = topo.host_memory_bytes;
  for (const EstimateChoice& c : all_choices()) {
    if (filter.stage && c.stage != *filter.stage) continue;
    if (filter.offload && c.offload_optimizer != *filter.offload) continue;
    if (filter.activation_checkpointing && c.activation_checkpointing != *filter.activation_checkpointing) continue;
    if (base.parallel.pipeline > 1 && c.stage >= 2) continue;  // a pipeline keeps its stages' gradients whole
    Config cfg = base;
    cfg.zero.stage = c.stage;
    cfg.zero.offload_optimizer.device = c.offload_optimizer;
    cfg.zero.offload_param.device = c.offload_param;
    for (OffloadConfig* o : {&cfg.zero.offload_optimizer, &cfg.zero.offload_param})
      if (o->device == OffloadDevice::nvme && o->nvme_path.empty()) o->nvme_path = "/local_nvme";
    cfg.model.activation_checkpointing = c.activation_checkpointing;
    Topology judged = topo;
    judged.headroom = headroom;
    const Plan plan = compile_plan(cfg, model, judged);
    EstimateRow r;
    r.choice = c;
    r.memory = plan.memory;
    r.device_per_rank = plan.memory.device.total();
    r.host_per_node = plan.memory.host.total() * topo.ranks_per_node;
    r.nvme_per_node = plan.memory.nvme * topo.ranks_per_node;
    // The one fit rule (fit.hpp), as ds plan judges the same plan.
    const FitCheck f = check_fit(plan, headroom);
    if (f.device != Fit::unknown && f.device != Fit::not_applicable) r.fits_device = f.device == Fit::fits;
    if (f.host != Fit::unknown) r.fits_host = f.host == Fit::fits;
    r.not_yet = not_yet_runnable(plan);
    if (plan.step_time.step_known()) {
      r.step_s = plan.step_time.step_s();
      r.tokens_per_s = static_cast<double>(plan.tokens_per_step) / r.step_s;
    }
    r.speed_rank = speed_rank_of(c);
    r.overrides = overrides_for(base, c);
    t.rows.push_back(std::move(r));
  }
  std::stable_sort(t.rows.begin(), t.rows.end(),
                   [](const EstimateRow& a, const EstimateRow& b) { return a.speed_rank < b.speed_rank; });
  // Where the plan predicts the rows' throughput, that orders them (fastest first), the rows it cannot predict
  // (offload without --host-memory-bw / --nvme-bw) after them in the expected order.
  std::stable_sort(t.rows.begin(), t.rows.end(), [](const EstimateRow& a, const EstimateRow& b) {
    if ((a.step_s > 0) != (b.step_s > 0)) return a.step_s > 0;
    return a.step_s > 0 && a.tokens_per_s > b.tokens_per_s;
  });
  if (topo.device_memory_bytes > 0)
    for (size_t i = 0; i < t.rows.size(); ++i) {
      if (!t.rows[i].fits()) continue;
      if (t.recommended < 0) t.recommended = static_cast<int>(i);
      if (t.rows[i].not_yet.empty()) {
        t.runnable = static_cast<int>(i);
        break;
      }
    }
  const int G = topo.ranks_per_node, N = topo.num_nodes;
  if (base.parallel.tensor > 1 || base.parallel.pipeline > 1) return t;  // DeepSpeed's estimators know no mesh
  t.deepspeed = deepspeed_zero2_estimate(model.num_params, G, N);
  for (auto& r : deepspeed_zero3_estimate(model.num_params, model.largest_module_params, G, N)) t.deepspeed.push_back(r);
  return t;
}

Config with_mesh(const Config& base, int tensor, int pipeline, bool activation_checkpointing) {
  Config cfg = base;
  cfg.parallel.tensor = tensor;
  cfg.parallel.pipeline = pipeline;
  cfg.zero.stage = 1;
  cfg.zero.offload_optimizer.device = cfg.zero.offload_param.device = OffloadDevice::none;
  cfg.model.activation_checkpointing = activation_checkpointing;
  cfg.train_batch_size.reset();
  // The config's micro-batches per step, else as many as stages (the fewest that keep every stage busy).
  cfg.gradient_accumulation_steps = base.gradient_accumulation_steps.value_or(pipeline);
  return cfg;
}

std::optional<MeshChoice> recommend_mesh(const Config& base, const ModelSpec& model, const Topology& topo, double headroom) {
  if (topo.device_memory_bytes <= 0) return std::nullopt;
  struct Candidate {
    int tensor, pipeline;
    bool checkpointing;
  };
  std::vector<Candidate> candidates;
  for (int t = 1; t <= topo.ranks_per_node; ++t) {
    if (topo.ranks_per_node % t != 0) continue;  // a tensor group within one node
    for (int p = 1; p <= topo.world_size / t; ++p)
      if ((topo.world_size / t) % p == 0 && t * p > 1)
        for (bool ckpt : {false, true}) candidates.push_back({t, p, ckpt});
  }
  std::stable_sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    if (a.tensor * a.pipeline != b.tensor * b.pipeline) return a.tensor * a.pipeline < b.tensor * b.pipeline;
    if (a.pipeline != b.pipeline) return a.pipeline < b.pipeline;
    return a.checkpointing < b.checkpointing;
  });
  Topology judged = topo;
  judged.headroom = headroom;
  std::optional<MeshChoice> best;
  for (const Candidate& c : candidates) {
    Plan plan;
    try {
      plan = compile_plan(with_mesh(base, c.tensor, c.pipeline, c.checkpointing), model, judged);
    } catch (const ConfigError&) {
      continue;  // a mesh this model cannot take (heads, kv heads, channels, blocks)
    }
    if (check_fit(plan, headroom).device != Fit::fits) continue;
    MeshChoice m;
    m.tensor = c.tensor;
    m.pipeline = c.pipeline;
    m.activation_checkpointing = c.checkpointing;
    m.device_per_rank = plan.memory.device.total();
    m.heaviest_stage = plan.mesh.heaviest_stage;
    m.not_yet = not_yet_runnable(plan);
    m.overrides = "tensor_parallel.autotp_size=" + std::to_string(c.tensor) + " pipeline.stages=" + std::to_string(c.pipeline) +
                  " zero_optimization.stage=1" +
                  (base.gradient_accumulation_steps ? "" : " gradient_accumulation_steps=" + std::to_string(c.pipeline)) +
                  (c.checkpointing ? " model.activation_checkpointing=true" : "");
    if (plan.step_time.step_known()) {
      m.step_s = plan.step_time.step_s();
      m.tokens_per_s = static_cast<double>(plan.tokens_per_step) / m.step_s;
    }
    // Without a prediction the first that fits is the fewest GPUs per copy; with one, the most tokens/s (the earlier on a tie).
    if (!best) best = m;
    else if (m.step_s > 0 && best->step_s > 0 && m.tokens_per_s > best->tokens_per_s) best = m;
    if (best->step_s <= 0) return best;
  }
  if (best && best->step_s > 0) best->fastest = true;
  return best;
}

}  // namespace ds
