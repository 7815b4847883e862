#include <gtest/gtest.h>

#include "engine/plan/memory.hpp"

using namespace ds;

namespace {
MemoryInputs base(const ModelSpec& m) {
  MemoryInputs in;
  in.model = &m;
  in.micro_batch = 2;
  in.seq_len = 64;
  in.reduce_bucket_size = 1000;
  in.sub_group_size = 1000000000;
  return in;
}
}  // namespace

TEST(MemoryModel, Fp32SingleRankHoldsParamsGradsAndTwoMoments) {
  ModelSpec m = build_model_spec(model_preset("gpt2-tiny"));
  MemoryEstimate e = estimate_memory(base(m));
  const double P = static_cast<double>(m.num_params);
  EXPECT_DOUBLE_EQ(e.device.params, 4 * P);
  EXPECT_DOUBLE_EQ(e.device.grads, 4 * P);
  EXPECT_DOUBLE_EQ(e.device.optimizer_states, 8 * P);  // no master copy in fp32
  EXPECT_DOUBLE_EQ(e.device.buffers, 0);                 // one rank: no reduction buckets
  EXPECT_DOUBLE_EQ(e.host.total(), 0);
}

TEST(MemoryModel, ActivationsScaleWithTokensAndShrinkWithCheckpointing) {
  ModelSpec m = build_model_spec(model_preset("gpt2-tiny"));
  MemoryInputs in = base(m);
  const double a1 = estimate_memory(in).device.activations;
  in.micro_batch = 4;
  EXPECT_DOUBLE_EQ(estimate_memory(in).device.activations, 2 * a1);
  in.activation_checkpointing = true;
  EXPECT_LT(estimate_memory(in).device.activations, 2 * a1);
  // Independent count for gpt2-tiny (C 64, I 256, NH 4, L 2, V 256) at T = 64, fp32:
  const double T = 64, C = 64, I = 256, NH = 4, V = 256, L = 2, b = 4;
  const double block = (8 * C + 2 * I + NH * T) * b + 16;
  const double head = 3 * C * b + V * b + V * 4;
  EXPECT_DOUBLE_EQ(a1, 2 * T * (L * block + head));
}

TEST(MemoryModel, NvmeOffloadPutsStatesOnNvmeAndStagingOnTheHost) {
  ModelSpec m = build_model_spec(model_preset("gpt2-tiny"));
  MemoryInputs in = base(m);
  in.stage = 3;
  in.world_size = 2;
  in.fp32_master = true;
  in.param_dtype = in.compute_dtype = in.grad_dtype = Dtype::bf16;
  in.offload_optimizer.device = OffloadDevice::nvme;
  in.offload_optimizer.buffer_count = 4;
  MemoryEstimate e = estimate_memory(in);
  const double S = static_cast<double>(e.shard_numel);
  EXPECT_DOUBLE_EQ(e.nvme, 12 * S);
  EXPECT_DOUBLE_EQ(e.device.optimizer_states, 0);
  EXPECT_DOUBLE_EQ(e.host.buffers, 4 * S * 4);  // buffer_count x sub-group (all of S here) x fp32
  EXPECT_DOUBLE_EQ(e.host.grads, 4 * S);        // fp32 gradient partition for the CPU optimizer
}

TEST(MemoryModel, PartialOffloadKeepsTheRestOnTheDevice) {
  ModelSpec m = build_model_spec(model_preset("gpt2-tiny"));
  MemoryInputs in = base(m);
  in.stage = 3;
  in.world_size = 2;
  in.offload_optimizer.device = OffloadDevice::cpu;
  in.offload_optimizer.ratio = 0.25;
  MemoryEstimate e = estimate_memory(in);
  EXPECT_DOUBLE_EQ(e.host.optimizer_states, 0.25 * 8 * e.shard_numel);
  EXPECT_DOUBLE_EQ(e.device.optimizer_states, 0.75 * 8 * e.shard_numel);
}

TEST(MemoryModel, OverlapCommAddsOneBlockGradientBufferAndAWholeGroupInFlight) {
  // gpt2-tiny block: 2 x 64 (ln_1) + 64 x 192 + 192 (attn) + 64 x 64 + 64 (proj) + 2 x 64 (ln_2) +
  // 64 x 256 + 256 (fc) + 256 x 64 + 64 (fc proj) = 49,984 elements.
  ModelSpec m = build_model_spec(model_preset("gpt2-tiny"));
  MemoryInputs in = base(m);
  in.stage = 2;
  in.world_size = 2;
  const double block = 49984;
  const double off = estimate_memory(in).device.buffers;
  in.overlap_comm = true;
  EXPECT_DOUBLE_EQ(estimate_memory(in).device.buffers - off, block * 4);  // fp32: no reduce copies
  // bf16: Gloo reduces through fp32 copies, of every piece of the largest group at once when overlapping.
  in.param_dtype = in.compute_dtype = in.grad_dtype = Dtype::bf16;
  const double overlapped = estimate_memory(in).device.buffers;
  in.overlap_comm = false;
  const double largest = std::max(block, static_cast<double>(m.num_params) - 2 * block);
  EXPECT_DOUBLE_EQ(overlapped - estimate_memory(in).device.buffers, block * 2 + (largest - 1000) * 4);
}
