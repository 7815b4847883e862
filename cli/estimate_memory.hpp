// ds estimate-memory — memory per GPU and per node for every ZeRO stage and offload choice of a
// model, before anything is allocated, with DeepSpeed's own estimator beside it and a recommendation.
#pragma once

#include "cli/common.hpp"

namespace ds::cli {

struct EstimateMemoryArgs {
  std::string model;             // preset, size shorthand, HF config.json, or a ds config
  double headroom = 0.10;        // share of each GPU not planned for (fragmentation, CUDA context)
  double params = 0;             // hypothetical model: total parameters (2851e6 is fine)
  double largest_layer = 0;      //   ... and its largest layer
  int gpus = 1, nodes = 1;
  std::string gpu_memory, cpu_memory;
  int64_t micro_batch = 0;       // 0: the config's, else 1
  int64_t seq_len = 0;           // 0: the config's, else min(context, 2048)
  std::string dtype;             // "": the config's, else bf16
  std::string activation_checkpointing = "both";  // on | off | both
  int zero_stage = -1;
  std::string offload;           // "": all
  int64_t lora_r = 0;            // > 0: a LoRA fine-tune of this rank (the base frozen)
  std::vector<std::string> lora_targets;  // empty: every projection of the architecture
  int tp = 0, pp = 0;            // the model split over ranks: tensor and pipeline sizes (0: the config's, else 1)
  HardwareArgs hardware;         // --gpu and the links: each row's step time predicted
  bool json = false;
};

Subcommand setup_estimate_memory(CLI::App& app);
int run_estimate_memory(const EstimateMemoryArgs& args);

}  // namespace ds::cli
