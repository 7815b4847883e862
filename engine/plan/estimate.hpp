// ds — memory for every ZeRO stage and offload choice of one model, for `ds estimate-memory`.
// Each row is a real compile_plan of the base config with one choice changed, so the numbers are
// exactly what `ds plan` would print for that choice: one memory model, not two.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "engine/plan/deepspeed_estimate.hpp"
#include "engine/plan/plan.hpp"

namespace ds {

struct EstimateChoice {
  int stage = 0;
  OffloadDevice offload_optimizer = OffloadDevice::none;
  OffloadDevice offload_param = OffloadDevice::none;
  bool activation_checkpointing = false;
};

struct EstimateRow {
  EstimateChoice choice;
  MemoryEstimate memory;            // per rank
  double device_per_rank = 0;
  double host_per_node = 0;         // host RAM of one node (offloaded states and staging buffers)
  double nvme_per_node = 0;
  std::optional<bool> fits_device;  // empty: device memory unknown; else within (1 - headroom) of it
  std::optional<bool> fits_host;    // empty: host memory unknown
  int speed_rank = 0;               // 0 is fastest (see speed_rank_of)
  std::string overrides;            // the config overrides that select this row
  std::vector<std::string> not_yet;  // why this ds cannot train it on its device yet (runnable.hpp); empty: it can
  double step_s = 0;                // the plan's predicted step (step_time.hpp); 0: not predicted (rates unknown, offload)
  double tokens_per_s = 0;          // ... and the throughput it gives, over all GPUs
  bool fits() const { return fits_device.value_or(true) && fits_host.value_or(true); }
};

struct EstimateFilter {
  std::optional<int> stage;
  std::optional<OffloadDevice> offload;            // narrows the optimizer's (and at stage 3 the parameters') offload
  std::optional<bool> activation_checkpointing;    // empty: rows with and without
};

struct MemoryEstimateTable {
  std::vector<EstimateRow> rows;  // fastest first: by predicted tokens/s where the rates are known, then by speed_rank_of
  int recommended = -1;           // index of the fastest row that fits, -1 if none fits
  int runnable = -1;              // index of the fastest row that fits and this ds trains today (not_yet empty), -1 if none
  std::vector<DeepSpeedEstimateRow> deepspeed;  // DeepSpeed's own ZeRO-2/3 estimators for the same model
  double host_memory_per_node = 0;  // 0: unknown
};

// Expected speed order, fastest first: ZeRO 1 and 2 move the same bytes as plain data parallelism;
// recomputation costs about a third more compute; stage 3 gathers parameters twice per micro step;
// offload adds host transfers and a CPU optimizer step, NVMe more so.
int speed_rank_of(const EstimateChoice& c);

// `base` may split the model over ranks (base.parallel): each row is then the heaviest stage's rank, and a
// pipeline's rows stop at ZeRO stage 1 (the most a pipeline takes).
MemoryEstimateTable estimate_memory_table(const Config& base, const ModelSpec& model, const Topology& topo,
                                          const EstimateFilter& filter = {}, double headroom = 0.10);

// A mesh for a model that data parallelism alone cannot fit: at ZeRO stage 1, the fastest predicted of those
// whose heaviest stage fits when the hardware's rates are known (step_time.hpp), else the fewest ranks per copy of
// the model (tensor x pipeline: the most data parallelism) whose heaviest stage fits; at one size, tensor
// groups within a node before pipeline stages, fewer stages before more, recomputation only if needed. A
// pipeline runs as many micro-batches per step as it has stages (the fewest that keep every stage busy).
struct MeshChoice {
  int tensor = 1, pipeline = 1;
  bool activation_checkpointing = false;
  double device_per_rank = 0;  // the heaviest stage's rank
  int heaviest_stage = 0;
  std::vector<std::string> not_yet;  // why this ds cannot train it yet
  std::string overrides;             // the config overrides that select it
  double step_s = 0;                 // its predicted step (0: not predicted)
  double tokens_per_s = 0;           // ... and throughput over all GPUs (meshes differ in micro-batches per step)
  bool fastest = false;              // chosen as the fastest predicted of the meshes that fit, not the fewest GPUs
};
// The config `base` with this mesh, as compiled for the recommendation (and by a user's ds plan with `overrides`).
Config with_mesh(const Config& base, int tensor, int pipeline, bool activation_checkpointing);
// Empty when the device memory is unknown or no mesh of these ranks fits.
std::optional<MeshChoice> recommend_mesh(const Config& base, const ModelSpec& model, const Topology& topo, double headroom = 0.10);

}  // namespace ds
