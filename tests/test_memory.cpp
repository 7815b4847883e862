#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "engine/plan/plan.hpp"
#include "schema/loader.hpp"

using namespace ds;

namespace {

const char* kTiny = R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                        "model": {"preset": "gpt2-tiny"}, "data": {"seq_len": 64},
                        "zero_optimization": {"reduce_bucket_size": 1000}})";

Plan tiny(int world, const std::vector<std::string>& overrides = {}) {
  Config c = load_config_text(kTiny, "tiny.json", overrides);
  Topology t;
  t.world_size = t.ranks_per_node = world;
  t.cores_per_node = 2;
  t.world_size_source = "test";
  return compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), t);
}

double bytes_of(const Plan& p, BufferRole role, Place place = Place::device) {
  const ZeroBuffer* b = p.execution.find(role, place);
  return b ? b->bytes() : 0.0;
}

}  // namespace

TEST(MemoryModel, Fp32SingleRankHoldsParamsGradsAndTwoMoments) {
  const Plan p = tiny(1);
  const MemoryEstimate& e = p.memory;
  const double P = static_cast<double>(p.model.num_params);
  EXPECT_DOUBLE_EQ(e.device.params, 4 * P);
  EXPECT_DOUBLE_EQ(e.device.grads, 4 * P);
  EXPECT_DOUBLE_EQ(e.device.optimizer_states, 8 * P);  // no master copy in fp32
  EXPECT_DOUBLE_EQ(e.device.buffers, 0);                 // one rank: no reduction buckets
  EXPECT_DOUBLE_EQ(e.host.total(), 0);
}

TEST(MemoryModel, TheEstimateIsTheSumOfTheExecutionsBuffers) {
  for (int world : {1, 2, 3})
    for (int stage : {0, 1, 2, 3})
      for (const char* precision : {"bf16.enabled=true", "fp16.enabled=true", "bf16.enabled=false"}) {
        const Plan p = tiny(world, {"zero_optimization.stage=" + std::to_string(stage), precision});
        double device = 0, host = 0;
        for (const ZeroBuffer& b : p.execution.buffers)
          (b.place == Place::device ? device : host) += static_cast<double>(b.elements) * b.copies * dtype_bytes(b.dtype);
        SCOPED_TRACE(std::string(precision) + " stage " + std::to_string(stage) + " on " + std::to_string(world));
        EXPECT_DOUBLE_EQ(p.memory.device.total() - p.memory.device.activations, device);
        EXPECT_DOUBLE_EQ(p.memory.host.total(), host);
      }
}

TEST(MemoryModel, StageThreeOnOneRankHoldsTheWholeModelAndGathersNothing) {
  const Plan p = tiny(1, {"zero_optimization.stage=3"});
  EXPECT_FALSE(p.execution.gathers);
  EXPECT_DOUBLE_EQ(p.memory.device.params, 4.0 * static_cast<double>(p.model.num_params));
  EXPECT_DOUBLE_EQ(p.memory.device.buffers, 0);
}

TEST(MemoryModel, ActivationsGrowWithTokensAndShrinkWithCheckpointing) {
  const ModelSpec m = build_model_spec(model_preset("gpt2-tiny"));
  const double a1 = activation_bytes(m, 2, 64, Dtype::fp32, false), a2 = activation_bytes(m, 4, 64, Dtype::fp32, false);
  // Independent count for gpt2-tiny (C 64, I 256, NH 4, L 2, V 256) at T = 64, fp32:
  const double T = 64, C = 64, I = 256, NH = 4, D = 16, V = 256, L = 2, b = 4;
  // Per token: 8C + 2I elements and one fp32 log-sum-exp per head, two fp32 statistics per norm.
  const double block = (8 * C + 2 * I) * b + NH * 4 + 16;
  const double head = 2 * C * b;  // the final norm's input, the head input's gradient (measured: test_families)
  // The fused head's chunk of logits (the whole batch's rows at this size; its weight's gradient goes
  // into the flat gradients), and one block's attention backward: probabilities and their gradient for
  // all T rows (one block at this size), the keys' and values' gradients in fp32.
  const auto workspace = [&](double B) { return B * T * V * b + 2 * B * NH * T * T * b + 2 * B * NH * T * D * 4; };
  EXPECT_DOUBLE_EQ(a1, 2 * T * (L * block + head) + workspace(2));
  EXPECT_DOUBLE_EQ(a2 - a1, 2 * T * (L * block + head) + workspace(4) - workspace(2));
  EXPECT_LT(activation_bytes(m, 4, 64, Dtype::fp32, true), a2);
  // Checkpointed in groups of G blocks: each group's input (C per token) kept, one group recomputed at a time; the
  // blocks running forward only keep nothing.
  ModelHyper deeper = model_preset("gpt2-tiny");
  deeper.num_layers = 8;
  const ModelSpec m8 = build_model_spec(deeper);
  for (const auto& [group, forward_only, groups, recomputed] :
       {std::tuple{1, 0, 8.0, 1.0}, std::tuple{3, 0, 3.0, 3.0}, std::tuple{8, 0, 1.0, 8.0}, std::tuple{3, 2, 2.0, 3.0}, std::tuple{4, 5, 1.0, 3.0}}) {
    SCOPED_TRACE("groups of " + std::to_string(group) + ", " + std::to_string(forward_only) + " blocks forward only");
    const ActivationParts parts = activation_parts(m8, 2, 64, Dtype::fp32, group, 1, forward_only);
    EXPECT_DOUBLE_EQ(parts.kept, 2 * T * (groups * C * b + head));
    EXPECT_DOUBLE_EQ(parts.workspace, 2 * T * recomputed * block + workspace(2));
  }
  const ActivationParts plain = activation_parts(m8, 2, 64, Dtype::fp32, 0, 1, 5);
  EXPECT_DOUBLE_EQ(plain.kept, 2 * T * (3 * block + head));
  EXPECT_DOUBLE_EQ(plain.workspace, workspace(2));
  // Every block forward only: nothing kept, the running block's own held while it runs.
  const ActivationParts passing = activation_parts(m8, 2, 64, Dtype::fp32, 0, 1, 8);
  EXPECT_DOUBLE_EQ(passing.kept, 2 * T * head);
  EXPECT_DOUBLE_EQ(passing.workspace, 2 * T * block + workspace(2));
  EXPECT_DOUBLE_EQ(tiny(1).memory.device.activations, a1);
  // GPT-2 at 4 x 1024 tokens: the logits come 667 rows at a time (2^25 elements / 50257), not 4096;
  // the attention 170 query rows at a time (2^23 scores / (4 x 12 heads x 1024 keys)).
  const ModelSpec g = build_model_spec(model_preset("gpt2"));
  EXPECT_DOUBLE_EQ(g.head_workspace_bytes(4096, 2), 667.0 * 50257 * 2);
  // fp16 logits (a GPU computing in fp16) take the cross-entropy kernel in place, as bf16's: an fp16 plan's
  // activations are a bf16 plan's, byte for byte.
  EXPECT_DOUBLE_EQ(activation_bytes(g, 4, 1024, Dtype::fp16, false), activation_bytes(g, 4, 1024, Dtype::bf16, false));
  EXPECT_DOUBLE_EQ(g.attention_workspace_bytes(4, 1024, 2), 2 * 4 * 12 * 170.0 * 1024 * 2 + 2 * 4 * 12 * 1024.0 * 64 * 4);
  // fp32 counts the larger of the block path and the tiled kernels' copies of K^T, V^T and K (T in
  // whole 64-key tiles): the blocks at 4 x 1024, the copies at 8 x 8192 (the blocks' scores and fp32
  // dK, dV: 444 MiB; the copies: 576 MiB), and a ragged T = 8001 counts 8064 keys.
  EXPECT_DOUBLE_EQ(g.attention_workspace_bytes(4, 1024, 4), 2 * 4 * 12 * 170.0 * 1024 * 4 + 2 * 4 * 12 * 1024.0 * 64 * 4);
  EXPECT_DOUBLE_EQ(g.attention_workspace_bytes(8, 8192, 4), 3 * 8 * 12 * 8192.0 * 64 * 4);
  EXPECT_DOUBLE_EQ(g.attention_workspace_bytes(8, 8001, 4), 3 * 8 * 12 * 8064.0 * 64 * 4);
  // bf16 counts the larger of the blocks and the AMX kernels: backward's copies per (sample, kv head)
  // task -- k twice and v, one query head's q and dy twice each (bf16), dK, dV and dq^T (fp32), lse and
  // delta, five 64 x 64 tiles -- times the tasks that run at once: min(threads, 1 x 12 kv heads).
  const double task = 8192.0 * 64 * (3 * 2 + 4 * 2 + 3 * 4) + 8192 * 2 * 4 + 64 * 64 * (2 * 4 + 3 * 2);
  EXPECT_DOUBLE_EQ(g.attention_workspace_bytes(1, 8192, 2, 12), 12 * task);
  EXPECT_DOUBLE_EQ(g.attention_workspace_bytes(1, 8192, 2, 64), 12 * task);
  EXPECT_DOUBLE_EQ(g.attention_workspace_bytes(1, 8192, 2, 2), 2 * 12 * 85.0 * 8192 * 2 + 2 * 12 * 8192.0 * 64 * 4);  // blocks
}

TEST(MemoryModel, AttentionKeepsNothingOfSizeTUnlessDropoutMaterialisesIt) {
  // A Llama with grouped-query attention: q 8 heads, k and v 2, each of 16. Its MLP keeps gate, up and
  // down's input (I each): the fused SwiGLU does not keep silu(gate).
  ModelHyper hp = model_preset("llama-tiny");
  hp.hidden_size = 128, hp.num_heads = 8, hp.num_kv_heads = 2, hp.intermediate_size = 256, hp.num_layers = 2;
  const double C = 128, I = 256, NH = 8, NKV = 2, D = 16, b = 2;
  const ModelSpec fused = build_model_spec(hp);
  for (int64_t T : {64, 4096})  // the same per token at any length
    EXPECT_DOUBLE_EQ(fused.block_activation_bytes_per_token(T, 2), (4 * C + 2 * NH * D + 2 * NKV * D + 3 * I) * b + NH * 4 + 16);
  hp.attn_pdrop = 0.1;  // the probabilities kept (NH x T per token) and k, v repeated to every query head
  const ModelSpec dropped = build_model_spec(hp);
  EXPECT_DOUBLE_EQ(dropped.block_activation_bytes_per_token(4096, 2), (4 * C + 4 * NH * D + 3 * I + NH * 4096) * b + 16);
  // ...and while it runs, the scores and their masked copy, B x NH x T x T each (no fused workspace).
  EXPECT_DOUBLE_EQ(dropped.attention_workspace_bytes(4, 4096, 2), 2 * 4 * NH * 4096.0 * 4096 * b);
}

TEST(MemoryModel, LibTorchsFusedAttentionKeepsTheKeysAndValuesRepeatedToTheQueryHeads) {
  // A GPU's attention (LibTorch's scaled_dot_product_attention) gets k and v repeated to the NH query heads and keeps
  // them, in place of the NKV-head ones; its output is the output projection's input (no copy).
  ModelHyper hp = model_preset("llama-tiny");
  hp.hidden_size = 128, hp.num_heads = 8, hp.num_kv_heads = 2, hp.intermediate_size = 256, hp.num_layers = 2;
  const double C = 128, I = 256, NH = 8, D = 16, b = 2;
  const ModelSpec llama = build_model_spec(hp);
  EXPECT_DOUBLE_EQ(llama.block_activation_bytes_per_token(64, 2, true), (4 * C + 2 * NH * D + 2 * NH * D + 3 * I) * b + NH * 4 + 16);
  // GPT-2's heads are all query heads: nothing is repeated.
  const ModelSpec gpt2 = build_model_spec(model_preset("gpt2"));
  EXPECT_DOUBLE_EQ(gpt2.block_activation_bytes_per_token(1024, 2, true), gpt2.block_activation_bytes_per_token(1024, 2));
  // Materialised (attention dropout), the device runs ds's composed ops, which repeat them on both.
  hp.attn_pdrop = 0.1;
  const ModelSpec dropped = build_model_spec(hp);
  EXPECT_DOUBLE_EQ(dropped.block_activation_bytes_per_token(256, 2, true), dropped.block_activation_bytes_per_token(256, 2));
}

TEST(MemoryModel, NvmeOffloadPutsStatesOnNvmeAndStagingOnTheHost) {
  const Plan p = tiny(2, {"zero_optimization.stage=3", "bf16.enabled=true", "zero_optimization.offload_optimizer.device=nvme",
                          "zero_optimization.offload_optimizer.nvme_path=/tmp", "zero_optimization.offload_optimizer.buffer_count=4"});
  const MemoryEstimate& e = p.memory;
  const double S = static_cast<double>(e.shard_numel);
  // One sub-group (sub_group_size 1e9 > S): each state's file is S fp32 rounded up to 4 KiB blocks, and
  // so is each of the host buffers it is swapped through: one set (no pipelining) of three states.
  const double file = std::ceil(S * 4 / 4096) * 4096;
  EXPECT_DOUBLE_EQ(e.nvme, 3 * file);  // fp32 master + two moments
  EXPECT_DOUBLE_EQ(e.device.optimizer_states, 0);
  EXPECT_DOUBLE_EQ(e.host.buffers, 3 * file);
  EXPECT_DOUBLE_EQ(e.host.grads, 4 * S);    // one sub-group's gradients in fp32 for the CPU optimizer
  EXPECT_DOUBLE_EQ(e.device.grads, 2 * S);  // the reduced bf16 part, copied to the host a sub-group at a time
  // Smaller sub-groups: the host holds one sub-group's gradients and buffers, the files grow by padding only.
  const Plan small = tiny(2, {"zero_optimization.stage=3", "bf16.enabled=true", "zero_optimization.offload_optimizer.device=nvme",
                              "zero_optimization.offload_optimizer.nvme_path=/tmp", "zero_optimization.sub_group_size=10000"});
  EXPECT_LE(small.memory.host.grads, 4 * 10000.0);
  EXPECT_LT(small.memory.host.buffers, 3 * 4 * 11024.0);
  EXPECT_GE(small.memory.nvme, 12 * S);
  EXPECT_LT(small.memory.nvme, 12 * S + 3 * 4096.0 * static_cast<double>(small.execution.sub_groups.size()));
}

TEST(MemoryModel, PartialOffloadKeepsTheRestOnTheDevice) {
  const Plan p = tiny(2, {"zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=cpu",
                          "zero_optimization.offload_optimizer.ratio=0.25"});
  const double S = static_cast<double>(p.memory.shard_numel), host = std::llround(0.25 * S);
  // fp32: the offloaded part has its own fp32 master beside its two moments; the rest steps the weights.
  EXPECT_DOUBLE_EQ(p.memory.host.optimizer_states, 12 * host);
  EXPECT_DOUBLE_EQ(p.memory.device.optimizer_states, 8 * (S - host));
}

TEST(MemoryModel, OverlapCommAddsOneBlockGradientBufferAndAWholeGroupInFlight) {
  // gpt2-tiny block: 2 x 64 (ln_1) + 64 x 192 + 192 (attn) + 64 x 64 + 64 (proj) + 2 x 64 (ln_2) +
  // 64 x 256 + 256 (fc) + 256 x 64 + 64 (fc proj) = 49,984 elements.
  const double block = 49984;
  auto buffers = [](const char* precision, bool overlap, const char* scatter = "true") {
    return tiny(2, {"zero_optimization.stage=2", precision, std::string("zero_optimization.overlap_comm=") + (overlap ? "true" : "false"),
                    std::string("zero_optimization.reduce_scatter=") + scatter})
        .memory.device.buffers;
  };
  // A reduce-scatter's receive buffer does not depend on overlap: one more block buffer is the difference.
  EXPECT_DOUBLE_EQ(buffers("bf16.enabled=false", true) - buffers("bf16.enabled=false", false), block * 4);
  EXPECT_DOUBLE_EQ(buffers("bf16.enabled=true", true) - buffers("bf16.enabled=true", false), block * 2);
  // All-reduced instead, bf16 goes through fp32 copies: of every piece of the largest group at once when
  // overlapping, else of one reduce bucket (1000 elements here).
  const double P = static_cast<double>(tiny(1).model.num_params);
  const double largest = std::max(block, P - 2 * block);
  EXPECT_DOUBLE_EQ(buffers("bf16.enabled=true", true, "false") - buffers("bf16.enabled=true", false, "false"), block * 2 + (largest - 1000) * 4);
  EXPECT_DOUBLE_EQ(bytes_of(tiny(2, {"zero_optimization.stage=2", "bf16.enabled=true", "zero_optimization.reduce_scatter=false"}),
                            BufferRole::reduce_staging),
                   1000 * 4);
}

TEST(MemoryModel, CommunicationDataTypeCastsTheGradientPiecesInFlightAndTheScratchHoldsIt) {
  const double block = 49984;  // gpt2-tiny's block (above)
  const double P = static_cast<double>(tiny(1).model.num_params);
  const double largest = std::max(block, P - 2 * block);  // the group outside the blocks
  const auto stage2 = [](const std::vector<std::string>& more) {
    std::vector<std::string> o{"zero_optimization.stage=2", "zero_optimization.overlap_comm=false"};
    o.insert(o.end(), more.begin(), more.end());
    return tiny(2, o);
  };
  // fp32 gradients crossing in bf16: a bf16 copy of the piece in flight (one 1000-element bucket, a whole group
  // with overlap_comm); the reduce-scatter's receive buffer holds bf16 too, half the fp32 run's.
  const Plan fp32 = stage2({}), bf16_wire = stage2({"communication_data_type=bf16"});
  EXPECT_EQ(bf16_wire.execution.reduced_dtype, Dtype::fp32);
  EXPECT_EQ(bf16_wire.execution.wire_dtype, Dtype::bf16);
  EXPECT_DOUBLE_EQ(bytes_of(bf16_wire, BufferRole::reduce_cast), 1000 * 2);
  EXPECT_DOUBLE_EQ(bytes_of(bf16_wire, BufferRole::reduce_scratch), bytes_of(fp32, BufferRole::reduce_scratch) / 2);
  EXPECT_DOUBLE_EQ(bytes_of(stage2({"communication_data_type=bf16", "zero_optimization.overlap_comm=true"}), BufferRole::reduce_cast),
                   largest * 2);
  // bf16 gradients crossing in fp32: an fp32 copy, and fp32 scratch, twice the bf16 run's.
  const Plan bf16 = stage2({"bf16.enabled=true"}), fp32_wire = stage2({"bf16.enabled=true", "communication_data_type=fp32"});
  EXPECT_DOUBLE_EQ(bytes_of(fp32_wire, BufferRole::reduce_cast), 1000 * 4);
  EXPECT_DOUBLE_EQ(bytes_of(fp32_wire, BufferRole::reduce_scratch), 2 * bytes_of(bf16, BufferRole::reduce_scratch));
  // Gloo all-reducing (stage 1) fp32 gradients in bf16: the cast, then the communicator's own fp32 copy of it.
  const Plan stage1 = tiny(2, {"zero_optimization.stage=1", "communication_data_type=bf16"});
  EXPECT_DOUBLE_EQ(bytes_of(stage1, BufferRole::reduce_cast), 1000 * 2);
  EXPECT_DOUBLE_EQ(bytes_of(stage1, BufferRole::reduce_staging), 1000 * 4);
  // Where it names the dtype gradients are held in, or on one rank, nothing is cast.
  EXPECT_EQ(bytes_of(stage2({"communication_data_type=fp32"}), BufferRole::reduce_cast), 0.0);
  EXPECT_EQ(bytes_of(tiny(1, {"zero_optimization.stage=2", "communication_data_type=bf16"}), BufferRole::reduce_cast), 0.0);
}

TEST(MemoryModel, AReduceScatterReceivesTheOtherRanksShareOfTheLargestPartAnyRankOwns) {
  // Stage 2 on 2 ranks: each rank owns half the padded flat buffer; a group's part on a rank is where
  // the group's parameters meet that half. The receive buffer holds the largest such part, once per other rank.
  for (const char* precision : {"bf16.enabled=false", "bf16.enabled=true"}) {
    for (const int world : {2, 3}) {
      const Plan p = tiny(world, {"zero_optimization.stage=2", precision});
      std::map<int, std::vector<double>> part;  // group (layer, -1 outside the blocks) -> elements per rank
      for (const ParamSlot& s : p.layout.params)
        for (int r = 0; r < world; ++r) {
          const ShardRange& shard = p.layout.shards[static_cast<size_t>(r)];
          const int64_t meet = std::min(s.offset + s.numel, shard.end) - std::max(s.offset, shard.begin);
          part[s.layer].resize(static_cast<size_t>(world));
          if (meet > 0) part[s.layer][static_cast<size_t>(r)] += static_cast<double>(meet);
        }
      double most = 0;
      for (const auto& [layer, per_rank] : part) most = std::max(most, *std::max_element(per_rank.begin(), per_rank.end()));
      const double width = std::string(precision) == "bf16.enabled=true" ? 2 : 4;
      EXPECT_DOUBLE_EQ(bytes_of(p, BufferRole::reduce_scratch), most * (world - 1) * width) << precision << " on " << world;
      EXPECT_EQ(bytes_of(p, BufferRole::reduce_staging), 0.0);  // no fp32 copies
    }
  }
}
