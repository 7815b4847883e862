#include "engine/plan/deepspeed_estimate.hpp"

#include <algorithm>

namespace ds {

std::vector<DeepSpeedEstimateRow> deepspeed_zero2_estimate(int64_t P, int G, int N, double f) {
  const double p = static_cast<double>(P);
  const int64_t T = static_cast<int64_t>(G) * N;
  std::vector<DeepSpeedEstimateRow> rows;
  // cpu_offload: gpu = 2P; cpu = P * max(4T, 16) * f (DeepSpeed uses the total GPU count here).
  rows.push_back({2, "offload_optimizer=cpu", p * std::max<int64_t>(4 * T, 16) * f, 2.0 * p});
  // no offload: gpu = 2P + int(18P / T); cpu = 4P * G * f.
  rows.push_back({2, "offload_optimizer=none", 4.0 * p * G * f, 2.0 * p + static_cast<double>((18 * P) / T)});
  return rows;
}

std::vector<DeepSpeedEstimateRow> deepspeed_zero3_estimate(int64_t P, int64_t L, int G, int N, double f) {
  const double p = static_cast<double>(P);
  const int64_t T = static_cast<int64_t>(G) * N;
  const double gpus_factor = 1.0 / N;
  const double largest_layer_memory = 4.0 * static_cast<double>(L);  // 16-bit param + grad of the largest layer
  std::vector<DeepSpeedEstimateRow> rows;
  for (int zero_init : {1, 0}) {
    const std::string zi = ", zero_init=" + std::to_string(zero_init);
    const double cpu = zero_init ? p * 18 * gpus_factor * f : p * std::max(4.0 * G, 18 * gpus_factor) * f;
    rows.push_back({3, "offload_param=cpu, offload_optimizer=cpu" + zi, cpu, largest_layer_memory});
  }
  for (int zero_init : {1, 0}) {
    const std::string zi = ", zero_init=" + std::to_string(zero_init);
    const double cpu = zero_init ? p * 16 * gpus_factor * f : p * std::max(4.0 * G, 16 * gpus_factor) * f;
    rows.push_back({3, "offload_param=none, offload_optimizer=cpu" + zi, cpu,
                    largest_layer_memory + static_cast<double>((2 * P) / T)});
  }
  for (int zero_init : {1, 0}) {
    const std::string zi = ", zero_init=" + std::to_string(zero_init);
    const double cpu = zero_init ? static_cast<double>(L) * 4 * G * f : p * 4 * G * f;
    rows.push_back({3, "offload_param=none, offload_optimizer=none" + zi, cpu,
                    largest_layer_memory + static_cast<double>((18 * P) / T)});
  }
  return rows;
}

}  // namespace ds
