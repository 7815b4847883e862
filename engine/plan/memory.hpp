// ds — the memory model: bytes per rank by category and by place (device, host, NVMe) for one
// configuration. `ds plan` and `ds estimate-memory` both call estimate_memory; there is no second
// model. What is counted: parameters, gradients, optimizer states (fp32 master + moments),
// activations kept for backward at the given micro batch and sequence length, and communication /
// gather buffers. Not counted: allocator fragmentation, the CUDA context, LibTorch's workspace.
#pragma once

#include <cstdint>

#include "engine/plan/layout.hpp"
#include "engine/plan/model_spec.hpp"
#include "schema/config.hpp"

namespace ds {

struct MemoryCategories {
  double params = 0, grads = 0, optimizer_states = 0, activations = 0, buffers = 0;  // bytes
  double total() const { return params + grads + optimizer_states + activations + buffers; }
};

struct MemoryInputs {
  const ModelSpec* model = nullptr;
  int stage = 0;
  int world_size = 1;
  Dtype param_dtype = Dtype::fp32;    // storage of the working parameters
  Dtype compute_dtype = Dtype::fp32;  // activations
  Dtype grad_dtype = Dtype::fp32;
  bool fp32_master = false;           // mixed precision keeps an fp32 copy in the optimizer
  int optimizer_moments = 2;          // Adam/AdamW/Lamb 2, SGD with momentum 1, plain SGD 0
  OffloadConfig offload_optimizer, offload_param;
  int64_t sub_group_size = 0;
  int64_t micro_batch = 1, seq_len = 1;
  bool activation_checkpointing = false;
  int64_t reduce_bucket_size = 0;  // elements
  bool overlap_comm = false;       // stages 2-3: a group's reduce runs while the next block's backward goes on
  int64_t param_persistence_threshold = 0;  // stage 3: smaller parameters stay whole
};

struct MemoryEstimate {
  MemoryCategories device;  // per rank on its device (a CPU-only run's device is host RAM)
  MemoryCategories host;    // per rank in host RAM besides the device (offloaded states, staging)
  double nvme = 0;          // per rank on NVMe
  int64_t shard_numel = 0;  // elements of the optimizer partition each rank owns
  int64_t persistent_numel = 0;  // stage 3: elements kept whole on every rank
};

MemoryEstimate estimate_memory(const MemoryInputs& in);

}  // namespace ds
