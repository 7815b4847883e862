// ds — the memory model: bytes per rank by category and by place (device, host, NVMe) for one
// configuration. `ds plan` and `ds estimate-memory` both call estimate_memory; there is no second
// model, and it adds up the very buffers the runtime allocates (the ZeRO execution's). What is counted:
// parameters, gradients, optimizer states (fp32 master + moments), activations kept for backward at
// the given micro batch and sequence length, and communication / gather buffers. Not counted:
// allocator fragmentation, the CUDA context, LibTorch's workspace.
#pragma once

#include <cstdint>

#include "engine/plan/model_spec.hpp"
#include "schema/config.hpp"

namespace ds {

struct MemoryCategories {
  double params = 0, grads = 0, optimizer_states = 0, activations = 0, buffers = 0;  // bytes
  double total() const { return params + grads + optimizer_states + activations + buffers; }
};

struct MemoryEstimate {
  MemoryCategories device;  // per rank on its device (a CPU-only run's device is host RAM)
  MemoryCategories host;    // per rank in host RAM besides the device (offloaded states, staging)
  double nvme = 0;          // per rank on NVMe
  int64_t shard_numel = 0;  // elements of the optimizer partition each rank owns
  int64_t persistent_numel = 0;  // stage 3: elements kept whole on every rank
  // Device and host together, category by category: what a rank's runtime holds, wherever it is.
  MemoryCategories held() const {
    return {device.params + host.params, device.grads + host.grads, device.optimizer_states + host.optimizer_states,
            device.activations + host.activations, device.buffers + host.buffers};
  }
};

struct ZeroExecution;

// Activations kept for backward per rank, at this micro batch and sequence length. With activation
// checkpointing (`recompute_group` G > 0; 0: none): each group of G blocks' input, plus one group recomputed at a
// time (model.activation_checkpointing is G = 1). In two parts: what one micro-batch
// keeps until its backward (a pipeline stage holds several at once), and the workspaces of one forward and
// backward at a time. The first `forward_only` blocks (below every trained tensor) keep nothing.
// `library_attention`: the device's attention is LibTorch's fused kernel (block_activation_bytes_per_token).
// `widened_products`: the device takes bf16 products in fp32 (Topology::cpu_widens_bf16_products): the largest
// product's fp32 copies (ModelSpec::widened_product_bytes) are a workspace too.
struct ActivationParts {
  double kept = 0, workspace = 0;
  double total() const { return kept + workspace; }
};
ActivationParts activation_parts(const ModelSpec& model, int64_t micro_batch, int64_t seq_len, Dtype compute_dtype, int64_t recompute_group,
                                 int threads = 1, int64_t forward_only = 0, bool library_attention = false,
                                 bool widened_products = false);
inline double activation_bytes(const ModelSpec& model, int64_t micro_batch, int64_t seq_len, Dtype compute_dtype, int64_t recompute_group,
                               int threads = 1) {
  return activation_parts(model, micro_batch, seq_len, compute_dtype, recompute_group, threads).total();
}

// The ZeRO execution's buffers summed by place and category (engine/plan/zero_plan.hpp), plus the activations.
MemoryEstimate estimate_memory(const ZeroExecution& zero, double activations);

}  // namespace ds
