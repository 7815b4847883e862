#include "engine/plan/memory.hpp"

#include <algorithm>

#include "engine/plan/zero_plan.hpp"

namespace ds {

ActivationParts activation_parts(const ModelSpec& m, int64_t micro_batch, int64_t seq_len, Dtype compute_dtype, int64_t recompute_group,
                                 int threads, int64_t forward_only, bool library_attention, bool widened_products) {
  const int bc = dtype_bytes(compute_dtype);
  const double tokens = static_cast<double>(micro_batch) * static_cast<double>(seq_len);
  const double block = m.block_activation_bytes_per_token(seq_len, bc, library_attention);
  const double head = m.head_activation_bytes_per_token(bc);
  const int64_t with_backward = m.hp.num_layers - forward_only;  // the blocks that keep activations for backward
  const double L = static_cast<double>(with_backward);
  // Both workspaces counted whole: the head's chunk of logits is kept from step to step (the model
  // reuses it), and the attention's is at its largest in a block's backward.
  // (fp16 logits, computed only where the device computes fp16, take the kernel in place as bf16's do)
  const double workspace = m.head_workspace_bytes(micro_batch * seq_len, bc) + m.attention_workspace_bytes(micro_batch, seq_len, bc, threads) +
                           (widened_products && compute_dtype == Dtype::bf16 ? m.widened_product_bytes(micro_batch * seq_len) : 0.0);
  // Where every block runs forward only (a pipeline stage below every trained tensor) none keeps anything, and the
  // one running holds its own activations until the next starts: one block's, as a workspace.
  const double passing = forward_only > 0 && with_backward == 0 ? 1.0 : 0.0;
  // Checkpointed: each group's input is kept; the one group recomputed at a time is a workspace.
  if (recompute_group > 0) {
    const double groups = static_cast<double>((with_backward + recompute_group - 1) / recompute_group);
    const double recomputed = static_cast<double>(std::min(recompute_group, with_backward));
    return {tokens * (groups * static_cast<double>(m.hp.hidden_size) * bc + head), tokens * (recomputed + passing) * block + workspace};
  }
  return {tokens * (L * block + head), tokens * passing * block + workspace};
}

MemoryEstimate estimate_memory(const ZeroExecution& zero, double activations) {
  MemoryEstimate e;
  e.shard_numel = zero.local_numel;
  e.persistent_numel = zero.whole_numel;
  for (const ZeroBuffer& b : zero.buffers) {
    if (b.place == Place::nvme) {
      e.nvme += b.bytes();
      continue;
    }
    MemoryCategories& at = b.place == Place::device ? e.device : e.host;
    switch (b.category) {
      case MemoryCategory::params: at.params += b.bytes(); break;
      case MemoryCategory::grads: at.grads += b.bytes(); break;
      case MemoryCategory::optimizer_states: at.optimizer_states += b.bytes(); break;
      case MemoryCategory::buffers: at.buffers += b.bytes(); break;
    }
  }
  e.device.activations = activations;
  return e;
}

}  // namespace ds
