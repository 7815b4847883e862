// ds — DeepSpeed's own model-state estimators, reproduced to the byte for comparison
// (deepspeed/runtime/zero/stage_1_and_2.py estimate_zero2_model_states_mem_needs and
// zero/stage3.py estimate_zero3_model_states_mem_needs; reference §3). They count parameters,
// gradients and optimizer states only, with a 1.5x "additional buffer factor" on CPU memory.
// P total parameters, L largest layer's parameters, G GPUs per node, N nodes, T = G N GPUs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ds {

struct DeepSpeedEstimateRow {
  int stage = 2;
  std::string options;   // as DeepSpeed prints them, e.g. "offload_param=cpu, offload_optimizer=cpu, zero_init=1"
  double cpu_bytes = 0;  // per node
  double gpu_bytes = 0;  // per GPU
};

// ZeRO-2 rows: optimizer offload cpu, then none.
std::vector<DeepSpeedEstimateRow> deepspeed_zero2_estimate(int64_t P, int gpus_per_node, int nodes,
                                                           double buffer_factor = 1.5);
// ZeRO-3 rows: (param cpu, opt cpu), (param none, opt cpu), (none, none), each with zero_init 1 then 0.
std::vector<DeepSpeedEstimateRow> deepspeed_zero3_estimate(int64_t P, int64_t L, int gpus_per_node, int nodes,
                                                           double buffer_factor = 1.5);

}  // namespace ds
