#include "engine/plan/memory.hpp"

#include <algorithm>

#include "common/error.hpp"

namespace ds {

MemoryEstimate estimate_memory(const MemoryInputs& in) {
  DS_CHECK(in.model != nullptr);
  const ModelSpec& m = *in.model;
  const FlatLayout layout = build_layout(m, in.stage, in.world_size);
  const double P = static_cast<double>(layout.numel);
  const double S = static_cast<double>(in.stage == 0 ? layout.padded_numel : layout.shard_numel);
  const double bp = dtype_bytes(in.param_dtype), bc = dtype_bytes(in.compute_dtype);
  const double bg = dtype_bytes(in.grad_dtype), bcomm = dtype_bytes(in.comm_dtype);
  const bool multi = in.world_size > 1;

  MemoryEstimate e;
  e.shard_numel = static_cast<int64_t>(S);

  // Parameters. Stage 3 keeps only this rank's partition plus the small parameters below the
  // persistence threshold, which stay whole (DeepSpeed's stage3_param_persistence_threshold).
  if (in.stage < 3) {
    e.device.params = P * bp;
  } else {
    double persistent_extra = 0;
    for (const auto& p : layout.params)
      if (p.numel < in.param_persistence_threshold) {
        e.persistent_numel += p.numel;
        persistent_extra += static_cast<double>(p.numel - p.partition_numel);
      }
    const double partition = S * bp;
    switch (in.offload_param.device) {
      case OffloadDevice::none: e.device.params = partition; break;
      case OffloadDevice::cpu: e.host.params = partition; break;
      case OffloadDevice::nvme:
        e.nvme += partition;
        e.host.buffers += static_cast<double>(in.offload_param.buffer_count) * in.offload_param.buffer_size * bp;
        break;
    }
    e.device.params += persistent_extra * bp;
  }

  // A compute dtype wider than the stored one (fp16 on the CPU, which has no fp16 kernels): the model
  // runs on a working copy of the weights and accumulates its gradients in that dtype.
  if (bc > bp) e.device.buffers += 2.0 * P * bc;

  // Gradients: full size up to stage 1, this rank's partition from stage 2 on. With the optimizer
  // offloaded, the reduced partition lives on the host in fp32 for the CPU optimizer.
  const bool opt_offloaded = in.offload_optimizer.device != OffloadDevice::none && in.stage >= 1;
  if (in.stage <= 1)
    e.device.grads = P * bg;
  else if (!opt_offloaded)
    e.device.grads = S * bg;
  if (opt_offloaded) e.host.grads = S * 4;

  // Optimizer states: fp32 master copy (mixed precision) and moments, over the full model at stage 0
  // or this rank's partition from stage 1 on.
  const double state_bytes = S * ((in.fp32_master ? 4.0 : 0.0) + 4.0 * in.optimizer_moments);
  const double offloaded_share = opt_offloaded ? in.offload_optimizer.ratio : 0.0;
  e.device.optimizer_states = state_bytes * (1.0 - offloaded_share);
  if (opt_offloaded) {
    if (in.offload_optimizer.device == OffloadDevice::cpu) {
      e.host.optimizer_states = state_bytes * offloaded_share;
    } else {
      e.nvme += state_bytes * offloaded_share;
      const double sub_group = std::min<double>(static_cast<double>(in.sub_group_size), S);
      e.host.buffers += static_cast<double>(in.offload_optimizer.buffer_count) * sub_group * 4.0;
    }
  }

  // Activations kept for backward at this micro batch and sequence length.
  const double tokens = static_cast<double>(in.micro_batch) * static_cast<double>(in.seq_len);
  const double block = m.block_activation_bytes_per_token(in.seq_len, static_cast<int>(bc));
  const double head = m.head_activation_bytes_per_token(static_cast<int>(bc));
  const double L = static_cast<double>(m.hp.num_layers);
  if (in.activation_checkpointing)
    e.device.activations = tokens * (L * m.hp.hidden_size * bc + block + head);  // block inputs + one block recomputed
  else
    e.device.activations = tokens * (L * block + head);

  // Buffers: gradient reduction and parameter gathering.
  const double reduce_bucket = std::min<double>(static_cast<double>(in.reduce_bucket_size), P) * bcomm;
  if (in.stage < 3) {
    if (multi) e.device.buffers += reduce_bucket * (in.overlap_comm ? 2 : 1);
    if (multi && in.stage >= 1) e.device.buffers += std::min<double>(static_cast<double>(in.allgather_bucket_size), P) * bp;
  } else {
    // One block gathered for use plus the next one prefetched, capped by max_live_parameters,
    // and one block's full gradients before they are reduce-scattered.
    const double block_params = static_cast<double>(m.largest_block_params);
    const double live = std::min<double>(static_cast<double>(in.max_live_parameters),
                                         block_params + std::min<double>(static_cast<double>(in.prefetch_bucket_size), P));
    const double largest = std::max<double>(block_params, static_cast<double>(m.largest_module_params));
    e.device.buffers += std::max(live, largest) * bp + largest * bg;
    e.device.buffers += std::min(reduce_bucket, largest * bcomm);
  }
  return e;
}

}  // namespace ds
