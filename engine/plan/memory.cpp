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
  const double bg = dtype_bytes(in.grad_dtype);
  const bool multi = in.world_size > 1;

  MemoryEstimate e;
  e.shard_numel = static_cast<int64_t>(S);

  // Parameters. Stage 3 keeps only this rank's partition plus the small parameters below the
  // persistence threshold, which stay whole (DeepSpeed's stage3_param_persistence_threshold).
  if (in.stage < 3) {
    e.device.params = P * bp;
  } else {
    // The partition, plus a whole copy of each parameter kept whole (its optimizer state stays in the partition).
    double whole = 0;
    for (const auto& p : layout.params)
      if (stays_whole(p, in.param_persistence_threshold)) {
        e.persistent_numel += p.numel;
        whole += static_cast<double>(p.numel);
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
    e.device.params += whole * bc;  // the model reads them, so in the compute dtype
  }

  // A compute dtype wider than the stored one (fp16 on the CPU, which has no fp16 kernels): the model
  // runs on a working copy of the weights (at stage 3 on its gathered buffers only) and accumulates its
  // gradients in that dtype (from stage 2 on across ranks, only this rank's reduced part).
  const bool grouped = multi && in.stage >= 2;
  if (bc > bp) e.device.buffers += (in.stage == 3 && multi ? 0.0 : P * bc) + (grouped ? S : P) * bc;

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

  // Buffers: what the runtime holds to reduce gradients and gather parameters (engine/runtime/zero.cpp).
  // Stage 3 gathers into them even on one rank when the parameters are offloaded.
  if (multi || in.stage == 3) {
    // Gloo reduces 16-bit gradients through an fp32 copy of the piece in flight. The gradients reduced
    // are those the model accumulated, in the compute dtype.
    const double reduce_piece_bytes = bc < 4 ? 4.0 : 0.0;
    if (in.stage <= 1) {
      e.device.buffers += std::min<double>(static_cast<double>(in.reduce_bucket_size), P) * reduce_piece_bytes;
    } else {
      // Gradients land in one block's buffer (or the outer parameters') and are reduced as backward
      // finishes each; stage 3 also gathers the parameters outside the blocks for the micro step and
      // two blocks at a time (the next one prefetched).
      double block = 0, outer = 0, block_gathered = 0, outer_gathered = 0;
      for (const auto& g : parameter_groups(layout)) {
        double gathered = 0;
        for (int i : g.params)
          if (!stays_whole(layout.params[static_cast<size_t>(i)], in.param_persistence_threshold))
            gathered += static_cast<double>(layout.params[static_cast<size_t>(i)].numel);
        if (g.layer >= 0) {
          block = std::max(block, static_cast<double>(g.numel));
          block_gathered = std::max(block_gathered, gathered);
        } else {
          outer = static_cast<double>(g.numel);
          outer_gathered = gathered;
        }
      }
      const double largest = std::max(block, outer);
      // overlap_comm: a second block buffer (the next block's backward writes it while the previous
      // one is reduced) and every piece of a group in flight at once.
      const double in_flight = in.overlap_comm ? largest : std::min<double>(static_cast<double>(in.reduce_bucket_size), largest);
      e.device.buffers += (block * (in.overlap_comm ? 2.0 : 1.0) + outer) * bc + in_flight * reduce_piece_bytes;
      // Stages 1-2 gather the updated parameters in place; stage 3 into one packed buffer per gather in flight.
      if (in.stage == 3)
        e.device.buffers += (outer_gathered + 2.0 * block_gathered) * bc + 2.0 * std::max(outer_gathered, block_gathered) * bp;
    }
  }
  return e;
}

}  // namespace ds
