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

std::string overrides_for(const EstimateChoice& c) {
  std::string o = "zero_optimization.stage=" + std::to_string(c.stage);
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
    r.speed_rank = speed_rank_of(c);
    r.overrides = overrides_for(c);
    t.rows.push_back(std::move(r));
  }
  std::stable_sort(t.rows.begin(), t.rows.end(),
                   [](const EstimateRow& a, const EstimateRow& b) { return a.speed_rank < b.speed_rank; });
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
  t.deepspeed = deepspeed_zero2_estimate(model.num_params, G, N);
  for (auto& r : deepspeed_zero3_estimate(model.num_params, model.largest_module_params, G, N)) t.deepspeed.push_back(r);
  return t;
}

}  // namespace ds
