// The predicted step time (engine/plan/step_time.hpp) and the hardware it is predicted for
// (engine/plan/hardware.hpp): every figure recomputed here by hand from the plan's FLOPs and bytes, the rates
// as NCCL defines bus bandwidth (time = payload x factor / busbw), and the overlap rules written out again.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "common/format.hpp"
#include "engine/plan/flops.hpp"
#include "engine/plan/plan.hpp"
#include "engine/plan/plan_record.hpp"
#include "test_helpers.hpp"

namespace ds {
namespace {

// The topology of `per_node` GPUs of model `gpu` on each of `nodes` nodes, nothing detected here, `o`'s other rates.
Topology gpus_with(int nodes, int per_node, const std::string& gpu, TopologyOptions o) {
  o.nnodes = nodes;
  o.nproc_per_node = per_node;
  o.gpu = gpu;
  return make_topology(o, [](const char*) -> const char* { return nullptr; });
}

Topology gpus(int nodes, int per_node, const std::string& gpu, const std::string& inter = "", double mfu = 0) {
  TopologyOptions o;
  o.inter_node_link = inter;
  o.mfu = mfu;
  return gpus_with(nodes, per_node, gpu, o);
}

Plan plan_on(const std::string& text, const Topology& t, const std::vector<std::string>& overrides = {}) {
  const Config c = load_config_text(text, "test.json", overrides);
  return compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), t);
}

// NCCL's factors: an all-reduce moves 2 (n - 1) / n of its payload per rank, a reduce-scatter and an all-gather (n - 1) / n.
double by_hand(const Collective& c, int n, double busbw, double latency) {
  const double factor = c.op == CollectiveOp::all_reduce ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
  return c.payload_bytes_per_step * factor / busbw + static_cast<double>(c.calls_per_step) * latency;
}

// Stages 1-2 gathering the updated parameters ahead, by hand from the layout: pieces of at most `bucket` elements cut
// at each block's first and last element; those through block 0's end (the embeddings', block 0's) are waited for
// before any block computes: their share of the bytes' time (s less each call's latency) and their calls' latency.
struct AheadByHand {
  int64_t calls = 0, exposed_calls = 0;
  double exposed_s = 0;
};
AheadByHand ahead_by_hand(const Plan& p, int64_t bucket, double s, double latency) {
  std::map<int, std::pair<int64_t, int64_t>> blocks;
  for (const ParamSlot& slot : p.layout.params) {
    if (slot.layer < 0) continue;
    auto [it, fresh] = blocks.try_emplace(slot.layer, slot.offset, slot.offset + slot.numel);
    it->second.first = std::min(it->second.first, slot.offset);
    it->second.second = std::max(it->second.second, slot.offset + slot.numel);
  }
  const auto pieces = [&](int64_t n) { return (n + bucket - 1) / bucket; };
  const auto& [first_begin, first_end] = blocks.begin()->second;
  AheadByHand a;
  a.exposed_calls = pieces(first_begin) + pieces(first_end - first_begin);
  a.calls = pieces(first_begin) + pieces(p.layout.padded_numel - blocks.rbegin()->second.second);
  for (const auto& [layer, range] : blocks) a.calls += pieces(range.second - range.first);
  const double bytes_s = s - static_cast<double>(a.calls) * latency;
  a.exposed_s = bytes_s * static_cast<double>(first_end) / static_cast<double>(p.layout.padded_numel) + static_cast<double>(a.exposed_calls) * latency;
  return a;
}

const char* kGpt2Zero2 = R"({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "bf16": {"enabled": true},
                             "zero_optimization": {"stage": 2, "overlap_comm": true},
                             "model": {"preset": "gpt2"}, "data": {"seq_len": 1024}})";

TEST(Hardware, LinksAreKnownByNameOrGivenAsARate) {
  EXPECT_DOUBLE_EQ(link_from_text("ib-ndr", true)->busbw, 400e9 / 8 * 0.9);
  EXPECT_DOUBLE_EQ(link_from_text("NVLink4", false)->busbw, 370e9);
  EXPECT_DOUBLE_EQ(link_from_text("400Gb/s", true)->busbw, 400e9 / 8 * 0.9);  // a NIC's line rate, in bits
  EXPECT_DOUBLE_EQ(link_from_text("100GB/s", false)->busbw, 100e9);
  EXPECT_DOUBLE_EQ(link_from_text("25GiB/s", false)->busbw, 25.0 * 1024 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(link_from_text("800Mbps", true)->busbw, 800e6 / 8 * 0.9);
  // A rate takes the latency of where it is: the network's across nodes.
  EXPECT_GT(link_from_text("50GB/s", true)->latency_s, link_from_text("50GB/s", false)->latency_s);
  for (const char* bad : {"fast", "10GB", "0GB/s", "-5GB/s", "5XB/s", "GB/s", "nan GB/s", "1e-300GB/s", "10kB/s"}) EXPECT_FALSE(link_from_text(bad, true)) << bad;
}

TEST(Hardware, AGpuIsKnownByTheNameItsDriverGives) {
  const auto model = [](const char* n) { const GpuModel* g = gpu_from_device_name(n); return g ? g->name : std::string("-"); };
  EXPECT_EQ(model("NVIDIA H100 80GB HBM3"), "h100");
  EXPECT_EQ(model("NVIDIA H100 PCIe"), "h100-pcie");
  EXPECT_EQ(model("NVIDIA H200"), "h200");
  EXPECT_EQ(model("NVIDIA A100-SXM4-40GB"), "a100-40gb");
  EXPECT_EQ(model("NVIDIA A100-SXM4-80GB"), "a100");
  EXPECT_EQ(model("NVIDIA A100 80GB PCIe"), "a100-pcie");
  EXPECT_EQ(model("Tesla T4"), "-");
  // Every model's own link is one ds knows, and each --gpu name finds itself.
  for (const GpuModel& g : known_gpus()) {
    EXPECT_TRUE(link_from_text(g.intra_node_link, false)) << g.name;
    EXPECT_EQ(gpu_by_name(g.name), &g);
  }
}

TEST(Hardware, GpuPlansForThatGpuAndBadFlagsAreRefused) {
  const Topology t = gpus(1, 8, "h100");
  EXPECT_EQ(t.device, DeviceKind::cuda);
  EXPECT_DOUBLE_EQ(t.device_memory_bytes, 81559.0 * 1048576);
  EXPECT_EQ(t.host_memory_bytes, 0);  // another machine's GPUs: this one's RAM says nothing of theirs
  EXPECT_EQ(t.rates.intra_node.name, "nvlink4");
  EXPECT_FALSE(t.rates.inter_node.known());
  EXPECT_DOUBLE_EQ(t.rates.peak_flops_16bit, 989.4e12);
  EXPECT_DOUBLE_EQ(t.rates.mfu, kAssumedMfu);
  EXPECT_THROW(gpus(1, 8, "h1000"), UserError);
  EXPECT_THROW(gpus(2, 8, "h100", "fast"), UserError);
  EXPECT_THROW(gpus(1, 8, "h100", "", 1.5), UserError);
  TopologyOptions cpu;
  cpu.device = "cpu";
  cpu.gpu = "h100";
  EXPECT_THROW(make_topology(cpu, [](const char*) -> const char* { return nullptr; }), UserError);
}

TEST(Hardware, ADetectedGpuGivesItsRatesOnlyWhenThePlanIsForThisMachine) {
  const auto none = [](const char*) -> const char* { return nullptr; };
  TopologyOptions here;
  here.gpus = {{"NVIDIA H200", 150e9}};
  Topology t = make_topology(here, none);
  EXPECT_EQ(t.rates.gpu, "H200 SXM 141GB");
  EXPECT_DOUBLE_EQ(t.device_memory_bytes, 150e9);
  EXPECT_GT(t.host_memory_bytes, 0);  // this machine's
  // --device-memory plans for other GPUs: the card here says nothing of their rates.
  TopologyOptions other = here;
  other.device_memory_bytes = 80e9;
  t = make_topology(other, none);
  EXPECT_EQ(t.rates.peak_flops_16bit, 0);
  EXPECT_DOUBLE_EQ(t.device_memory_bytes, 80e9);
  // --gpu naming another model: its memory and rates, and not this machine's host memory.
  TopologyOptions named = here;
  named.gpu = "a100";
  t = make_topology(named, none);
  EXPECT_EQ(t.rates.gpu, "A100 SXM 80GB");
  EXPECT_DOUBLE_EQ(t.device_memory_bytes, 81920.0 * 1048576);
  EXPECT_EQ(t.host_memory_bytes, 0);
  // A run here trains on the GPU here: --gpu changes only the rates its prediction uses.
  TopologyOptions run = named;
  run.runs_here = true;
  run.build = BuildSupport{true, "CUDA 13.0, sm_90", ""};
  t = make_topology(run, none);
  EXPECT_EQ(t.device, DeviceKind::cuda);
  EXPECT_DOUBLE_EQ(t.device_memory_bytes, 150e9);
  EXPECT_GT(t.host_memory_bytes, 0);
  EXPECT_EQ(t.rates.gpu, "A100 SXM 80GB");
  // ... and with no GPU here, --gpu does not make it a GPU run: it is refused, saying why.
  TopologyOptions bare;
  bare.gpu = "h100";
  bare.runs_here = true;
  bare.build = run.build;
  try {
    make_topology(bare, none);
    ADD_FAILURE() << "--gpu on a run without a GPU was taken";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("no GPU is visible here"), std::string::npos) << e.what();
  }
}

TEST(StepTime, EightGpusOfANodeAreTheirFlopsAtThePeakTimesMfuAndTheirBytesAtNvlinksBusBandwidth) {
  const Plan p = plan_on(kGpt2Zero2, gpus(1, 8, "h100"), {"zero_optimization.allgather_bucket_size=20000000"});
  const StepTime& t = p.step_time;
  ASSERT_TRUE(t.compute_known && t.comm_known) << (t.missing.empty() ? "" : t.missing.front());
  // Compute: the step's model FLOPs shared by 8 ranks, at 989.4 TFLOP/s x 0.45; backward is twice the forward.
  const double compute = p.train_flops_per_step / 8 / (989.4e12 * 0.45);
  EXPECT_NEAR(t.compute_s, compute, 1e-9 * compute);
  EXPECT_NEAR(t.backward_s, 2 * t.forward_s, 1e-9 * compute);
  EXPECT_EQ(t.bubble_s, 0);
  // Each collective on NVLink 4 (370 GB/s, 10 us a call).
  ASSERT_EQ(t.collectives.size(), p.execution.collectives.size());
  double comm = 0, hidden_by_hand = 0, gathered_ahead = 0;
  for (size_t i = 0; i < t.collectives.size(); ++i) {
    const Collective& c = p.execution.collectives[i];
    const double s = by_hand(c, 8, 370e9, 10e-6);
    EXPECT_NEAR(t.collectives[i].seconds, s, 1e-9 * s + 1e-15) << c.what();
    EXPECT_EQ(t.collectives[i].link, "nvlink4 (within a node)");
    comm += s;
    // Stage 2 reduces each micro step's gradients during its backward: all but each of the 2 micro steps' last
    // bucket hide, up to the backward's time; nothing else can.
    if (c.kind == CollectiveKind::gradients) {
      EXPECT_EQ(t.collectives[i].phase, StepPhase::backward);
      ASSERT_GE(c.calls_per_step, 2);
      hidden_by_hand = std::min(s - 2 * s / static_cast<double>(c.calls_per_step), 2.0 / 3.0 * compute);
      EXPECT_NEAR(t.collectives[i].hidden_s, hidden_by_hand, 1e-9 * s);
    } else if (c.kind == CollectiveKind::updated_parameters) {
      // The updated parameters arrive while the next step's first micro step runs forward (a sixth of compute),
      // each block waiting for its own pieces: all but the embeddings' and block 0's hide.
      EXPECT_TRUE(p.execution.gather_ahead);
      EXPECT_EQ(t.collectives[i].phase, StepPhase::forward);
      const AheadByHand a = ahead_by_hand(p, 20000000, s, 10e-6);
      EXPECT_EQ(c.calls_per_step, a.calls);  // 2 pieces of the embeddings (38.6M), one per block, one of the rest
      EXPECT_EQ(a.exposed_calls, 3);
      gathered_ahead = std::min(s - a.exposed_s, compute / 6);
      EXPECT_NEAR(t.collectives[i].hidden_s, gathered_ahead, 1e-9 * s);
    } else {
      EXPECT_EQ(t.collectives[i].hidden_s, 0) << c.what();
    }
  }
  EXPECT_GT(hidden_by_hand, 0);
  EXPECT_GT(gathered_ahead, 0);
  EXPECT_NEAR(t.comm_s, comm, 1e-9 * comm);
  EXPECT_NEAR(t.step_s(), compute + comm - hidden_by_hand - gathered_ahead, 1e-9 * compute);
  EXPECT_STREQ(t.bound(), comm > compute ? "communication-bound" : "compute-bound");
  // MFU of the predicted step: the assumed one, less what communication adds.
  EXPECT_NEAR(t.mfu(p.train_flops_per_step / 8), 0.45 * compute / t.step_s(), 1e-9);
}

// DeepSpeed's default allgather_bucket_size (5e8) holds all of GPT-2 124M: one piece, nothing for a block's forward to
// run beside. Cut at the blocks' boundaries, each block's parameters are their own piece and all past block 0 hide.
TEST(StepTime, AtTheDefaultBucketTheUpdatedParametersStillGoBlockByBlock) {
  const Plan p = plan_on(kGpt2Zero2, gpus(1, 8, "h100"));
  ASSERT_EQ(p.zero.allgather_bucket_size, 500000000);
  ASSERT_TRUE(p.execution.gather_ahead);
  const StepTime& t = p.step_time;
  ASSERT_TRUE(t.compute_known && t.comm_known);
  for (size_t i = 0; i < t.collectives.size(); ++i) {
    const Collective& c = p.execution.collectives[i];
    if (c.kind != CollectiveKind::updated_parameters) continue;
    EXPECT_EQ(c.calls_per_step, p.model.hp.num_layers + 2);  // the embeddings, each block, the final norm
    const double s = t.collectives[i].seconds;
    const AheadByHand a = ahead_by_hand(p, 500000000, s, 10e-6);
    EXPECT_EQ(a.calls, c.calls_per_step);
    EXPECT_EQ(a.exposed_calls, 2);
    EXPECT_GT(t.collectives[i].hidden_s, 0.5 * s);
    EXPECT_NEAR(t.collectives[i].hidden_s, std::min(s - a.exposed_s, t.forward_s / 2), 1e-9 * s);
    return;
  }
  ADD_FAILURE() << "no updated parameters' row";
}

TEST(StepTime, WithoutOverlapCommNothingHidesAndStagesZeroAndOneHideOnlyBehindTheLastBackward) {
  const Plan off = plan_on(kGpt2Zero2, gpus(1, 8, "h100"), {"zero_optimization.overlap_comm=false"});
  EXPECT_FALSE(off.execution.gather_ahead);
  EXPECT_EQ(off.step_time.hidden_s, 0);
  EXPECT_NEAR(off.step_time.step_s(), off.step_time.compute_s + off.step_time.comm_s, 1e-12);
  // Stage 1 reduces once per step, after the last of 2 micro steps: only that backward (a sixth of compute) covers it.
  const Plan one = plan_on(kGpt2Zero2, gpus(1, 8, "h100"), {"zero_optimization.stage=1", "zero_optimization.allgather_bucket_size=20000000"});
  const StepTime& t = one.step_time;
  double hideable = 0, ahead = 0;  // (and its updated parameters behind the next step's first forward, as stage 2's)
  for (size_t i = 0; i < t.collectives.size(); ++i) {
    const Collective& c = one.execution.collectives[i];
    const double s = t.collectives[i].seconds, calls = static_cast<double>(c.calls_per_step);
    if (c.kind == CollectiveKind::gradients) hideable += s - s / calls;
    if (c.kind == CollectiveKind::updated_parameters) ahead += s - ahead_by_hand(one, 20000000, s, 10e-6).exposed_s;
  }
  ASSERT_GT(hideable, 0);
  ASSERT_GT(ahead, 0);
  EXPECT_TRUE(one.execution.gather_ahead);
  EXPECT_NEAR(t.hidden_s, std::min(hideable, t.backward_s / 2) + std::min(ahead, t.forward_s / 2), 1e-12);
}

TEST(StepTime, AcrossNodesTheDataGroupCrossesTheNetworkWhichMustBeGiven) {
  const Plan unknown = plan_on(kGpt2Zero2, gpus(2, 8, "h100"));
  EXPECT_TRUE(unknown.step_time.compute_known);
  EXPECT_FALSE(unknown.step_time.comm_known);
  ASSERT_EQ(unknown.step_time.missing.size(), 1u);
  EXPECT_NE(unknown.step_time.missing[0].find("--inter-node-link"), std::string::npos);
  EXPECT_TRUE(unknown.step_time.collectives.empty());

  // 16 ranks on 2 nodes: NCCL runs a ring per NIC, 8 NICs a node (one per GPU): 8 x 45 GB/s, capped by NVLink's 370.
  const Plan p = plan_on(kGpt2Zero2, gpus(2, 8, "h100", "ib-ndr"));
  ASSERT_TRUE(p.step_time.comm_known);
  for (size_t i = 0; i < p.step_time.collectives.size(); ++i) {
    const double s = by_hand(p.execution.collectives[i], 16, std::min(370e9, 8 * 45e9), 30e-6);
    EXPECT_NEAR(p.step_time.collectives[i].seconds, s, 1e-9 * s) << p.execution.collectives[i].what();
    EXPECT_EQ(p.step_time.collectives[i].link, "ib-ndr (across nodes, 8 NICs a node)");
  }
  // A slower network per GPU (a rate: 10 GB/s) sets the pace at 8 x 10 GB/s.
  const Plan slow = plan_on(kGpt2Zero2, gpus(2, 8, "h100", "10GB/s"));
  for (size_t i = 0; i < slow.step_time.collectives.size(); ++i) {
    const double s = by_hand(slow.execution.collectives[i], 16, 80e9, 30e-6);
    EXPECT_NEAR(slow.step_time.collectives[i].seconds, s, 1e-9 * s) << slow.execution.collectives[i].what();
  }
  // A plan for the CPU knows no peak rate: it says so.
  const Plan cpu = plan_on(kGpt2Zero2, test::thread_ranks(2, 0));
  EXPECT_FALSE(cpu.step_time.compute_known);
  EXPECT_FALSE(cpu.step_time.comm_known);
}

TEST(StepTime, TheMeshsTensorGroupStaysOnNvlinkItsDataGroupCrossesNodesAndTheBubbleIsAdded) {
  // Llama-2-7B on 2 nodes x 8: tensor 8 (a node each), pipeline 2, data 1... 2 x 8 x 2 needs 32: use 4 nodes.
  const std::string text = R"({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4, "bf16": {"enabled": true},
                               "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 8},
                               "pipeline": {"stages": 2}, "model": {"preset": "llama-2-7b"}, "data": {"seq_len": 2048}})";
  const Plan p = plan_on(text, gpus(4, 8, "h100", "ib-ndr"));
  const StepTime& t = p.step_time;
  ASSERT_TRUE(t.compute_known && t.comm_known) << (t.missing.empty() ? "" : t.missing.front());
  // 4 micro-batches through 2 stages: a bubble of 1 / 5 of the step.
  const double busy = t.forward_s + t.backward_s;
  EXPECT_NEAR(t.bubble_s, busy * (1.0 / 5) / (1 - 1.0 / 5), 1e-9 * busy);
  // The busier stage sets the pace: its blocks' and (the last) the head's FLOPs, 6 per parameter and the attention
  // core's 12 T C per token a block, for 4 micro-batches of 2048 tokens over its 8 tensor ranks.
  double block = 0;
  for (const TensorSpec& w : p.model.tensors)
    if (w.layer == 0 && w.shape.size() == 2) block += static_cast<double>(w.numel);
  const double T = 2048, C = 4096, V = 32000, per_block = 6 * block + 12 * T * C;
  const double first = p.mesh.stages[0].blocks * per_block * T * 4 / 8, last = (p.mesh.stages[1].blocks * per_block + 6 * V * C) * T * 4 / 8;
  EXPECT_NEAR(busy, std::max(first, last) / (989.4e12 * 0.45), 1e-9 * busy);
  EXPECT_GE(busy, p.train_flops_per_step / 32 / (989.4e12 * 0.45) * (1 - 1e-12));  // no less than an even share
  // A first stage below every trained tensor runs forward only: the second stage's work sets the pace.
  const Plan frozen = plan_on(text, gpus(4, 8, "h100", "ib-ndr"), {R"(model.freeze=["model.embed_tokens.weight", "model.layers.[0-9].*"])"});
  ASSERT_EQ(frozen.backward_from, 10);
  const int b0 = frozen.mesh.stages[0].blocks, b1 = frozen.mesh.stages[1].blocks;
  const double forward_block = 2 * block + 4 * T * C;  // below every trained one: forward alone
  const double stage0 = (10 * forward_block + (b0 - 10) * per_block) * T * 4 / 8, stage1 = (b1 * per_block + 6 * V * C) * T * 4 / 8;
  EXPECT_NEAR(frozen.step_time.forward_s + frozen.step_time.backward_s, std::max(stage0, stage1) / (989.4e12 * 0.45), 1e-9 * stage1);
  const auto row = [&](const std::string& what) -> const CollectiveTime* {
    for (const CollectiveTime& c : t.collectives)
      if (c.what == what) return &c;
    return nullptr;
  };
  const CollectiveTime* tensor = row("tensor all-reduces");
  const CollectiveTime* pipe = row("pipeline sends");
  ASSERT_TRUE(tensor && pipe);
  EXPECT_EQ(tensor->link, "nvlink4 (within a node)");
  EXPECT_EQ(pipe->link, "ib-ndr (across nodes)");  // stage 1's ranks are 16 further on: another node
  // The busiest stage's traffic at the link's rate.
  double most = 0;
  const MeshTraffic* x = nullptr;
  for (const PipelineStage& s : p.mesh.stages)
    if (s.traffic.tensor_wire_bytes + s.traffic.pipeline_bytes + s.traffic.tied_bytes > most)
      most = s.traffic.tensor_wire_bytes + s.traffic.pipeline_bytes + s.traffic.tied_bytes, x = &s.traffic;
  ASSERT_TRUE(x);
  EXPECT_NEAR(tensor->seconds, x->tensor_wire_bytes / 370e9 + static_cast<double>(x->tensor_all_reduces) * 10e-6, 1e-12);
  EXPECT_NEAR(pipe->seconds, x->pipeline_bytes / 45e9 + static_cast<double>(x->pipeline_sends) * 30e-6, 1e-12);
  EXPECT_EQ(tensor->hidden_s, 0);  // Megatron's all-reduces wait for the compute that needs them
  // The data group (ranks 8 apart) spans nodes: ZeRO's collectives on the network; the step's agreement spans the
  // world, 8 ranks a node (a ring per NIC).
  EXPECT_EQ(t.collectives.front().what, std::string(collective_name(CollectiveKind::control)));
  EXPECT_EQ(t.collectives.front().link, "ib-ndr (across nodes, 8 NICs a node)");
  ASSERT_TRUE(row("gradients"));
  EXPECT_EQ(row("gradients")->link, "ib-ndr (across nodes)");
}

TEST(StepTime, PlanJsonCarriesThePredictionAndNullsWhatIsUnknown) {
  const Plan p = plan_on(kGpt2Zero2, gpus(1, 8, "h100", "", 0.5));
  const nlohmann::json j = nlohmann::json::parse(plan_to_json(p))["step_time"];
  EXPECT_EQ(j["gpu"], "H100 SXM 80GB");
  EXPECT_DOUBLE_EQ(j["mfu"].get<double>(), 0.5);
  EXPECT_EQ(j["mfu_source"], "--mfu");
  EXPECT_NEAR(j["compute_s"].get<double>(), p.train_flops_per_step / 8 / (989.4e12 * 0.5), 1e-12);
  EXPECT_NEAR(j["step_s"].get<double>(), j["compute_s"].get<double>() + j["communication_s"].get<double>() - j["hidden_s"].get<double>(), 1e-12);
  EXPECT_EQ(j["collectives"].size(), p.execution.collectives.size());
  const nlohmann::json cpu = nlohmann::json::parse(plan_to_json(plan_on(kGpt2Zero2, test::thread_ranks(2, 0))))["step_time"];
  EXPECT_TRUE(cpu["step_s"].is_null());
  EXPECT_TRUE(cpu["compute_s"].is_null());
  EXPECT_FALSE(cpu["missing"].empty());
}

// A GPU plan with its offload rates: --host-link, --host-memory-bw, --nvme-bw ("" for unknown).
Topology gpus_offloading(int per_node, const std::string& gpu, const std::string& host_link, const std::string& memory, const std::string& nvme) {
  TopologyOptions o;
  o.host_link = host_link;
  o.host_memory_bw = memory;
  o.nvme_bw = nvme;
  return gpus_with(1, per_node, gpu, o);
}

// One GPU whose gradients leave for the host group by group, with overlap_comm: what of their copies and sums hides
// behind the backward, by hand (defined below last_backward_by_hand). 0 elsewhere.
double gradients_trip_hidden(const Plan& p);

bool mentions(const std::vector<std::string>& missing, const std::string& flag) {
  for (const std::string& m : missing)
    if (m.find(flag) != std::string::npos) return true;
  return false;
}

TEST(StepTime, OffloadIsEachTransferAtTheHostLinkAndTheHostsStepAtItsMemorysRateSharedByTheNodesRanks) {
  const std::vector<std::string> cpu_offload{"zero_optimization.offload_optimizer.device=cpu"};
  // The host's memory unknown: the copies are predicted at the H100's PCIe 5 (50 GB/s), the step is not.
  const Plan unknown = plan_on(kGpt2Zero2, gpus_offloading(8, "h100", "", "", ""), cpu_offload);
  EXPECT_FALSE(unknown.step_time.step_known());
  EXPECT_TRUE(mentions(unknown.step_time.missing, "--host-memory-bw"));
  // The transfers' rows first, then the host's sums of the gradients arriving block by block, then the host's step.
  ASSERT_EQ(unknown.step_time.offload.size(), unknown.execution.transfers.size() + 2);
  for (size_t i = 0; i < unknown.execution.transfers.size(); ++i) {
    const Transfer& x = unknown.execution.transfers[i];
    EXPECT_EQ(unknown.step_time.offload[i].what, x.what);
    EXPECT_TRUE(unknown.step_time.offload[i].known);
    EXPECT_DOUBLE_EQ(unknown.step_time.offload[i].seconds, x.bytes_per_step / 50e9) << x.what;
  }
  EXPECT_FALSE(unknown.step_time.offload.back().known);  // the host's step: its bytes, no time
  EXPECT_FALSE(unknown.step_time.offload.end()[-2].known);
  EXPECT_FALSE(unknown.step_time.offload_known());
  EXPECT_TRUE(nlohmann::json::parse(plan_to_json(unknown))["step_time"]["offload_s"].is_null());
  // Given (400 GB/s a node, 8 ranks on it): the step of the offloaded states streams, per element, the gradient
  // (bf16 where it left the GPU block by block into host memory, read by the kernel as it is; else its fp32 copy),
  // the master and two moments read and written, and the bf16 weight written into the staging buffer the GPU's
  // copy takes: 2 (or 4) + 8 x 3 + 2 bytes.
  const Plan p = plan_on(kGpt2Zero2, gpus_offloading(8, "h100", "", "400GB/s", ""), cpu_offload);
  const StepTime& t = p.step_time;
  ASSERT_TRUE(t.step_known()) << (t.missing.empty() ? "" : t.missing.front());
  const ZeroExecution& z = p.execution;
  ASSERT_EQ(z.state_spans.size(), 1u);
  ASSERT_EQ(z.state_spans[0].place, Place::host);
  const bool grads_on_host = z.find_anywhere(BufferRole::grads)->place == Place::host;
  EXPECT_TRUE(grads_on_host);  // ZeRO 2 from a GPU: the gradients leave block by block (DeepSpeed's ZeRO-Offload)
  EXPECT_EQ(z.find_anywhere(BufferRole::offload_grads), nullptr);  // no fp32 copy of them
  const double n = static_cast<double>(z.local_numel), step_bytes = n * ((grads_on_host ? 2 : 4) + 8 * 3 + 2);
  ASSERT_EQ(t.offload.size(), z.transfers.size() + 2);
  EXPECT_EQ(t.offload.back().what, "optimizer step on the host");
  EXPECT_DOUBLE_EQ(t.offload.back().bytes, step_bytes);
  EXPECT_NEAR(t.offload.back().seconds, step_bytes / (400e9 / 8), 1e-15);
  // Each micro step's bf16 gradients, as they arrive, added into the step's sum on the host (arrival read, sum read
  // and written: 3 x 2 bytes an element), the first micro step's copied in instead (read and written: 2 x 2 bytes).
  const double micro_steps = static_cast<double>(p.batch.grad_accum), sum_bytes = n * 2 * (2 + 3 * (micro_steps - 1));
  EXPECT_EQ(t.offload.end()[-2].what, "gradients summed on the host");
  EXPECT_DOUBLE_EQ(t.offload.end()[-2].bytes, sum_bytes);
  double link_s = 0;
  for (const Transfer& x : z.transfers) link_s += x.bytes_per_step / 50e9;
  const double host_s = (step_bytes + sum_bytes) / 50e9;
  EXPECT_NEAR(t.offload_s, link_s + host_s, 1e-12);
  EXPECT_EQ(t.offload_hidden_s, 0);
  EXPECT_NEAR(t.step_s(), t.compute_s + t.comm_s - t.hidden_s + link_s + host_s, 1e-12);
  // What it waits on most: here the host's memory (the step's states), over compute and the link.
  const double most = std::max({t.compute_s, t.comm_s, link_s, host_s});
  EXPECT_STREQ(t.bound(), most == host_s ? "host-memory-bound" : most == link_s ? "host-link-bound" : most == t.comm_s ? "communication-bound" : "compute-bound");
  // With the parameters on the host too (ZeRO 3) the kernel writes the bf16 weights there itself: 2 + 8 x 3 + 2.
  const Plan on_host = plan_on(kGpt2Zero2, gpus_offloading(8, "h100", "", "400GB/s", ""),
                               {"zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=cpu", "zero_optimization.offload_param.device=cpu"});
  EXPECT_DOUBLE_EQ(on_host.step_time.offload.back().bytes, static_cast<double>(on_host.execution.local_numel) * (2 + 8 * 3 + 2));
  // --host-link replaces the GPU's own; plan.json carries every row.
  const Plan slow = plan_on(kGpt2Zero2, gpus_offloading(8, "h100", "pcie4", "400GB/s", ""), cpu_offload);
  EXPECT_NEAR(slow.step_time.offload_s, link_s * 2 + host_s, 1e-12);
  const nlohmann::json j = nlohmann::json::parse(plan_to_json(p))["step_time"];
  EXPECT_EQ(j["offload"].size(), t.offload.size());
  EXPECT_EQ(j["offload"].back()["resource"], "host memory");
  EXPECT_DOUBLE_EQ(j["host_link"]["busbw_bytes_per_s"].get<double>(), 50e9);
  EXPECT_NEAR(j["step_s"].get<double>(), t.step_s(), 1e-12);
}

// Per weight tile, the lowest block it holds (-1: it holds a parameter outside the blocks): the block after whose
// gradients a speculative step may take it.
std::vector<int64_t> lowest_block_of_tiles(const Plan& p) {
  std::vector<int64_t> lowest_of;
  for (const SubGroup& g : p.execution.weight_tiles) {
    int lowest = p.model.hp.num_layers;
    bool outside = false;
    for (const ParamSlot& s : p.layout.params)
      if (s.offset < g.end && s.offset + s.numel > g.begin) outside = outside || s.layer < 0, lowest = std::min(lowest, s.layer);
    lowest_of.push_back(outside ? -1 : lowest);
  }
  return lowest_of;
}

// The host's memory serves the host's work and every copy to or from it (the link's DMA reads or writes it too): busy
// for its rows in full, hidden or not, and the copies' bytes at its rate. However much of either hides behind compute,
// the step is no shorter. By hand from the plan's transfers and the step's bytes (as in the test above).
TEST(StepTime, TheHostsMemoryServesItsWorkAndEveryCopySoTheStepIsNoShorterThanItsBusyTime) {
  bool floored = false, not_floored = false;
  // bf16: the host writes the weights into staging, which the link reads (a copy of its own); fp16: the link reads the
  // fp32 master itself (converted on the GPU), the read the step's bytes count already.
  for (const bool fp16 : {false, true})
    for (const double memory : {10e9, 20e9, 1000e9}) {
      SCOPED_TRACE(std::to_string(memory) + (fp16 ? ", fp16" : ", bf16"));
      std::vector<std::string> o{"zero_optimization.offload_optimizer.device=cpu"};
      if (fp16) o.insert(o.end(), {"bf16.enabled=false", "fp16.enabled=true"});
      const Plan p = plan_on(kGpt2Zero2, gpus_offloading(1, "h100", "", format_fixed(memory / 1e9, 0) + "GB/s", ""), o);
      const StepTime& t = p.step_time;
      ASSERT_TRUE(t.step_known()) << (t.missing.empty() ? "" : t.missing.front());
      const ZeroExecution& z = p.execution;
      ASSERT_EQ(z.find_anywhere(BufferRole::grads)->place, Place::host);
      ASSERT_EQ(z.state_spans.front().weights, fp16 ? WeightsBack::copied : WeightsBack::staged);
      const double n = static_cast<double>(z.local_numel), micro_steps = static_cast<double>(p.batch.grad_accum);
      // the step: the 16-bit gradient, master and moments read and written, the weight written (bf16) or the master
      // read again (fp16); the gradients' sums
      const double work = n * (2 + 8 * 3 + (fp16 ? 4 : 2)) + n * 2 * (2 + 3 * (micro_steps - 1));
      double copied = 0;
      for (const Transfer& x : z.transfers)
        copied += x.written_in_step || (fp16 && x.what == "updated weights to the device") ? 0.0 : x.bytes_per_step;
      EXPECT_GT(copied, 0);
      EXPECT_DOUBLE_EQ(t.host_memory_copied_bytes, copied);
      const double busy = (work + copied) / memory;
      EXPECT_NEAR(t.host_memory_busy_s, busy, 1e-12 * busy);
      double parts = t.compute_s + t.comm_s - t.hidden_s;
      for (const OffloadTime& x : t.offload) parts += x.seconds - x.hidden_s;
      EXPECT_NEAR(t.parts_s(), parts, 1e-12);
      EXPECT_DOUBLE_EQ(t.step_s(), std::max(parts, busy));
      EXPECT_EQ(t.host_memory_floored(), busy > parts);
      if (busy > parts) {
        EXPECT_STREQ(t.bound(), "host-memory-bound");
      }
      (busy > parts ? floored : not_floored) = true;
      const nlohmann::json j = nlohmann::json::parse(plan_to_json(p))["step_time"];
      EXPECT_NEAR(j["host_memory_busy_s"].get<double>(), busy, 1e-12 * busy);
      EXPECT_NEAR(j["step_s"].get<double>(), std::max(parts, busy), 1e-12);
    }
  EXPECT_TRUE(floored);  // (the rates cover both sides)
  EXPECT_TRUE(not_floored);
  // A speculative step without backup moves the same bytes whichever tiles it takes: under the floor the plan still
  // takes the choice whose parts add up to least (no top blocks' choice and no single block toggled does better).
  // (examples/gpu-offload-speculative.json: gpt2-xl, one micro step, recomputed blocks, an H200's host at 82 GB/s)
  const Plan spec = plan_on(kGpt2Zero2, gpus_offloading(1, "h200", "", "82GB/s", ""),
                            {"zero_optimization.offload_optimizer.device=cpu", "gradient_clipping=0", "bf16.check_grad_overflow=false",
                             "zero_optimization.offload_optimizer.speculative_step=true", "model.preset=gpt2-xl",
                             "model.activation_checkpointing=true", "gradient_accumulation_steps=1"});
  ASSERT_TRUE(spec.execution.step_in_backward);
  ASSERT_TRUE(spec.step_time.host_memory_floored());
  const ZeroExecution& z = spec.execution;
  const std::vector<int64_t> lowest_of = lowest_block_of_tiles(spec);
  std::set<int64_t> chosen, candidates(lowest_of.begin(), lowest_of.end());
  candidates.erase(-1);
  for (int64_t a : z.weight_tile_final_after)
    if (a >= 0) chosen.insert(a);
  ASSERT_FALSE(chosen.empty());
  // (no choice predicts a shorter step, nor the same step with a shorter sum of parts)
  const double step = spec.step_time.step_s(), parts = spec.step_time.parts_s();
  bool tied_longer = false;  // a choice at the floor whose parts add up to more: the tie-break decides
  const auto no_better = [&](const std::set<int64_t>& blocks) {
    Plan trial = spec;
    trial.execution.weight_tile_final_after = lowest_of;
    limit_speculation(trial.execution, blocks);
    const StepTime t = predict_step_time(trial);
    if (t.step_s() == step && t.parts_s() > parts + 1e-9) tied_longer = true;
    return t.step_s() > step || t.parts_s() >= parts - 1e-15;
  };
  EXPECT_TRUE(no_better(chosen));
  for (int64_t k : candidates) EXPECT_TRUE(no_better(std::set<int64_t>(candidates.lower_bound(k), candidates.end()))) << "from block " << k;
  for (int64_t g : candidates) {
    std::set<int64_t> other = chosen;
    if (!other.erase(g)) other.insert(g);
    if (!other.empty()) {
      EXPECT_TRUE(no_better(other)) << "block " << g << " taken out or put back";
    }
  }
  EXPECT_TRUE(tied_longer);  // (without the parts as the tie-break, any choice at the floor would do)
  // Unknown where the host memory's rate is not given.
  const Plan unknown = plan_on(kGpt2Zero2, gpus_offloading(1, "h100", "", "", ""), {"zero_optimization.offload_optimizer.device=cpu"});
  EXPECT_EQ(unknown.step_time.host_memory_busy_s, 0);
  EXPECT_TRUE(nlohmann::json::parse(plan_to_json(unknown))["step_time"]["host_memory_busy_s"].is_null());
}

// One GPU with its optimizer on the host: the host steps the tiles the forward reads before its first block at once
// and the others during the next step's first forward (ZeroExecution::step_in_forward), so their share of the host's
// step hides behind that forward, up to its length. Several ranks' shards are published to each other first: nothing
// hides there.
// ds profile and the flops_profiler block measure each step's work within it: the plan leaves nothing to the next
// forward (no gathering ahead, no host step during it), and its prediction hides nothing there, as the run does.
TEST(StepTime, AStepMeasuredAloneLeavesNothingToTheNextForward) {
  const std::vector<std::string> cpu_offload{"zero_optimization.offload_optimizer.device=cpu"};
  const Plan gathers = plan_on(kGpt2Zero2, gpus(1, 8, "h100"));
  const Plan steps = plan_on(kGpt2Zero2, gpus_offloading(1, "h100", "", "20GB/s", ""), cpu_offload);
  ASSERT_TRUE(gathers.execution.gather_ahead);
  ASSERT_TRUE(steps.execution.step_in_forward);
  ASSERT_FALSE(gathers.run.steps_measured_alone);
  const Plan gathers_alone = plan_on(kGpt2Zero2, gpus(1, 8, "h100"), {"flops_profiler.enabled=true"});
  std::vector<std::string> profiled = cpu_offload;
  profiled.push_back("flops_profiler.enabled=true");
  const Plan steps_alone = plan_on(kGpt2Zero2, gpus_offloading(1, "h100", "", "20GB/s", ""), profiled);
  EXPECT_TRUE(gathers_alone.run.steps_measured_alone);
  EXPECT_FALSE(gathers_alone.execution.gather_ahead);
  EXPECT_FALSE(steps_alone.execution.step_in_forward);
  EXPECT_TRUE(steps_alone.execution.weight_tile_hooks.empty());
  // What the measurement turned off is recorded (ds plan says so); one GPU with nothing to defer records nothing.
  EXPECT_FALSE(gathers.execution.kept_within_step);
  EXPECT_FALSE(steps.execution.kept_within_step);
  EXPECT_TRUE(gathers_alone.execution.kept_within_step);
  EXPECT_TRUE(steps_alone.execution.kept_within_step);
  const Plan nothing_deferred = plan_on(kGpt2Zero2, gpus(1, 1, "h100"), {"flops_profiler.enabled=true"});
  EXPECT_TRUE(nothing_deferred.run.steps_measured_alone);
  EXPECT_FALSE(nothing_deferred.execution.kept_within_step);
  // The updated parameters' gather waits where it is issued: nothing of it hides behind the next forward. It is
  // the same gather, in the same pieces (cut at the blocks), as the run measured: a profile times ds train's calls.
  ASSERT_EQ(gathers_alone.execution.collectives.size(), gathers.execution.collectives.size());
  int gathers_seen = 0;
  for (size_t i = 0; i < gathers_alone.execution.collectives.size(); ++i)
    if (gathers_alone.execution.collectives[i].kind == CollectiveKind::updated_parameters) {
      ++gathers_seen;
      EXPECT_EQ(gathers_alone.step_time.collectives[i].hidden_s, 0);
      EXPECT_EQ(gathers_alone.execution.collectives[i].calls_per_step, gathers.execution.collectives[i].calls_per_step);
      EXPECT_EQ(gathers_alone.execution.collectives[i].payload_bytes_per_step, gathers.execution.collectives[i].payload_bytes_per_step);
      EXPECT_GT(gathers_alone.execution.collectives[i].calls_per_step,
                static_cast<int64_t>(bucket_pieces(gathers.execution.full_numel, gathers.zero.allgather_bucket_size).size()));  // (cut at the blocks)
    }
  EXPECT_EQ(gathers_seen, 1);
  // The host's step hides nowhere: the offload is the step's whole, as where nothing is stepped during the forward.
  EXPECT_EQ(steps_alone.step_time.offload.back().what, "optimizer step on the host");
  EXPECT_EQ(steps_alone.step_time.offload.back().hidden_s, 0);
  EXPECT_GT(steps.step_time.offload.back().hidden_s, 0);
  // (the parts one after the other: at 20 GB/s the host memory's busy time, the same bytes in both, sets both steps)
  EXPECT_GT(steps_alone.step_time.parts_s(), steps.step_time.parts_s());
  EXPECT_GE(steps_alone.step_time.step_s(), steps.step_time.step_s());
}

TEST(StepTime, OneGpusHostStepHidesItsLaterTilesBehindTheNextForward) {
  const std::vector<std::string> cpu_offload{"zero_optimization.offload_optimizer.device=cpu"};
  struct Case {
    const char* memory;  // the host's step shorter than the blocks' forward, and longer
    std::vector<std::string> overrides;
  };
  const std::vector<std::string> pageable_offload{"zero_optimization.offload_optimizer.device=cpu", "zero_optimization.offload_optimizer.pin_memory=false"};
  const std::vector<Case> cases{{"1000GB/s", cpu_offload},
                                {"20GB/s", cpu_offload},
                                // ZeRO-Offload++: the host holds the first 80%, the device steps the rest at once
                                {"20GB/s", {"zero_optimization.offload_optimizer.device=cpu", "zero_optimization.stage=3",
                                            "zero_optimization.offload_optimizer.ratio=0.8"}},
                                // pageable staging: the host waits for each copy, its step and the copies one stage;
                                // the step alone past the window, and a step shorter than it (the copies hide the rest)
                                {"20GB/s", pageable_offload},
                                {"1000GB/s", pageable_offload}};
  for (const Case& c : cases) {
    const bool pageable = c.overrides.back().find("pin_memory=false") != std::string::npos;
    const bool partial = c.overrides.size() > 1 && !pageable;
    SCOPED_TRACE(std::string(c.memory) + (partial ? ", ratio 0.8" : "") + (pageable ? ", pageable" : ""));
    const Plan p = plan_on(kGpt2Zero2, gpus_offloading(1, "h100", "", c.memory, ""), c.overrides);
    const ZeroExecution& z = p.execution;
    ASSERT_TRUE(z.step_in_forward);
    ASSERT_EQ(z.state_spans.size(), partial ? 2u : 1u);
    const int64_t host = z.state_spans.front().numel();  // (the host's span comes first)
    const StepTime& t = p.step_time;
    ASSERT_TRUE(t.step_known());
    // The tiles beginning at or after block 0's first element wait for the forward (the layout: embeddings, blocks, rest).
    int64_t first_block = p.layout.numel, later = 0;
    for (const ParamSlot& s : p.layout.params)
      if (s.layer >= 0) first_block = std::min(first_block, s.offset);
    int64_t at_once = 0;
    for (const SubGroup& g : z.weight_tiles) later += g.begin >= first_block ? g.numel() : 0, at_once += g.begin < first_block;
    ASSERT_GT(later, 0);
    ASSERT_GT(at_once, 1);
    ASSERT_LT(later, host);
    const OffloadTime& step = t.offload.back();
    ASSERT_EQ(step.what, "optimizer step on the host");
    const double share = static_cast<double>(later) / static_cast<double>(host);
    // A pipeline whose stages are the places the waiting tiles are stepped (the block their first element lies in,
    // or the head's, past the blocks: -1 here): the first stage's step and copy hide behind nothing.
    std::set<int> places;
    for (const SubGroup& g : z.weight_tiles) {
      if (g.begin < first_block) continue;
      int layer = -1;
      for (const ParamSlot& s : p.layout.params)
        if (s.offset <= g.begin && g.begin < s.offset + s.numel) layer = s.layer;
      places.insert(layer);
    }
    ASSERT_GT(places.size(), 1u);
    const double stages = static_cast<double>(places.size()), filled = (stages - 1) / stages;
    // They run beside the blocks before the last of those places (all of them where a tile begins past the blocks),
    // not beside the head after them, nor beside the blocks past the host's part: that share of the forward's FLOPs.
    const int reached = places.count(-1) ? p.model.hp.num_layers : *places.rbegin();
    if (partial) {
      EXPECT_LT(reached, p.model.hp.num_layers);
    }
    double before = 0, all = 0;
    for (const ModuleFlops& m : module_flops(p.model, p.batch.micro_batch, p.seq_len, p.activation_checkpointing, p.frozen, p.lora)) {
      if (m.depth != 1) continue;
      all += m.forward;
      if (m.layer >= 0 && m.layer < reached) before += m.forward;
    }
    ASSERT_LT(before, all);  // (the head's matmul comes after)
    const double beside = t.forward_s / static_cast<double>(p.batch.grad_accum) * before / all;  // of the first micro step
    const auto weights = std::find_if(t.offload.begin(), t.offload.end(), [](const OffloadTime& x) { return x.what == "updated weights to the device"; });
    ASSERT_NE(weights, t.offload.end());
    if (pageable) {
      // The host's step of the waiting tiles and their copies, one after the other, hide together behind the blocks:
      // the step's part as with page-locked staging, the copies what is left; the copies of the tiles stepped at once
      // hide behind nothing (the host waits for them).
      const double together = filled * std::min(share * (step.seconds + weights->seconds), beside);
      EXPECT_NEAR(step.hidden_s, filled * std::min(share * step.seconds, beside), 1e-15);
      EXPECT_NEAR(weights->hidden_s, together - step.hidden_s, 1e-15);
      EXPECT_NEAR(t.offload_hidden_s, together + gradients_trip_hidden(p), 1e-15);
      if (std::string(c.memory) == "20GB/s") {
        EXPECT_GT(share * step.seconds, beside);  // (the host's step alone fills the window: the copies hide nothing)
        EXPECT_EQ(weights->hidden_s, 0);
      } else {
        EXPECT_LT(share * step.seconds, beside);  // (the copies hide in what the step leaves of the window)
        EXPECT_GT(weights->hidden_s, 0);
      }
      const Plan pinned = plan_on(kGpt2Zero2, gpus_offloading(1, "h100", "", c.memory, ""), cpu_offload);
      EXPECT_GT(pinned.step_time.offload_hidden_s, t.offload_hidden_s);
      continue;
    }
    EXPECT_NEAR(step.hidden_s, filled * std::min(share * step.seconds, beside), 1e-15);
    if (std::string(c.memory) == "1000GB/s")  // (both regimes are met: the share hides whole, then the blocks' forward is the cap)
      EXPECT_LT(share * step.seconds, beside);
    else
      EXPECT_GT(share * step.seconds, beside);
    EXPECT_GT(step.hidden_s, 0);
    // The copies of the tiles stepped at once cross while the host steps the next of them (all but the last), up to
    // its step of those tiles; the waiting tiles' cross beside the blocks before theirs, hidden up to the longer of
    // that forward and the host's step of them.
    const double tiles = static_cast<double>(z.weight_tiles.size());
    const double early = std::min(weights->seconds * static_cast<double>(at_once - 1) / tiles, step.seconds * (1 - share));
    const double longer = std::string(c.memory) == "1000GB/s" ? beside : share * step.seconds;
    EXPECT_NEAR(weights->hidden_s, early + filled * std::min(share * weights->seconds, longer), 1e-15);
    EXPECT_GT(weights->hidden_s, 0);
    double others_hidden = 0;
    for (const OffloadTime& x : t.offload) others_hidden += &x == &step ? 0.0 : x.hidden_s;
    EXPECT_NEAR(t.offload_hidden_s, others_hidden + step.hidden_s, 1e-15);
    EXPECT_NEAR(t.parts_s(), t.compute_s + t.comm_s - t.hidden_s + t.offload_s - t.offload_hidden_s, 1e-12);
    EXPECT_DOUBLE_EQ(t.step_s(), std::max(t.parts_s(), t.host_memory_busy_s));
  }
  const Plan shards = plan_on(kGpt2Zero2, gpus_offloading(8, "h100", "", "400GB/s", ""), cpu_offload);
  EXPECT_FALSE(shards.execution.step_in_forward);
  EXPECT_EQ(shards.step_time.offload.back().hidden_s, 0);
}

// The last micro step's backward by hand, for the speculative step: the GPU runs the blocks' backward top down, a unit
// at a time handed to it once the host is free (a block; with activation checkpointing in groups of k, the group,
// recomputed and run back in one call); once it is handed over, the host runs the unit's blocks' hooks top down, each
// summing the gradients of the block gradient_lag + 1 above it once landed, starting its own block's copy out (once
// the unit holding the block has run, behind the earlier copies to the host), then stepping the tiles final after the
// block it summed, each tile's weights copied to the device once stepped, into two staging buffers in turn; the two
// directions' copies run at once. The lowest blocks' come after the whole backward.
// Per block, the work: its share of one micro step's backward by FLOPs, of the gradients' rows by elements; per tile,
// its share of the host's step (by elements of the host's span), of the backup (of the speculated elements), of the
// weights' copies. `tiles` false: the same backward without them.
struct ByHand {
  double end = 0, copies_end = 0;
  double step = 0, backup = 0, copies = 0;  // the speculated tiles' work in all
  std::map<int64_t, double> work;           // per block, the work of the tiles final after it (step and backup)
  std::map<int64_t, double> copies_of;      // and their weights' copies
  std::map<int64_t, double> room;           // per block, the backward of the block whose hook takes its gradients, less their trip
};
ByHand last_backward_by_hand(const Plan& p, bool tiles, bool first_micro_step = false) {
  const ZeroExecution& z = p.execution;
  const StepTime& t = p.step_time;
  const int64_t L = p.model.hp.num_layers, k = p.activation_checkpointing ? std::max<int64_t>(1, p.recompute_group) : 1;
  const double micro = static_cast<double>(p.batch.grad_accum);
  std::map<int64_t, double> gpu_s, copy_s, sum_s;
  double total_flops = 0;
  for (const ModuleFlops& m : module_flops(p.model, p.batch.micro_batch, p.seq_len, p.activation_checkpointing, p.frozen, p.lora)) {
    if (m.depth != 1) continue;
    total_flops += m.backward + m.recompute;
    if (m.layer >= 0) gpu_s[m.layer] += m.backward + m.recompute;
  }
  for (auto& [l, s] : gpu_s) s = t.backward_s / micro * s / total_flops;
  double numel = 0, gradients = 0, sums = 0, step = 0, backup = 0, weights = 0;
  for (const ParamSlot& s : p.layout.params) numel += static_cast<double>(s.numel);
  for (const OffloadTime& x : t.offload) {
    if (x.what == "gradients to the host") gradients = x.seconds / micro;
    if (x.what == "gradients summed on the host")  // (the last's: an add; the first's, of several, a copy in)
      sums = x.seconds * (micro > 1 ? (first_micro_step ? 2 : 3) / (2 + 3 * (micro - 1)) : 1.0);
    if (x.what == "optimizer step on the host") step = x.seconds;
    if (x.what == "speculated states backed up") backup = x.seconds;
    if (x.what == "updated weights to the device") weights = x.seconds;
  }
  for (const ParamSlot& s : p.layout.params) {
    if (s.layer < 0) continue;
    copy_s[s.layer] += gradients * static_cast<double>(s.numel) / numel;
    sum_s[s.layer] += sums * static_cast<double>(s.numel) / numel;
  }
  ByHand h;
  std::map<int64_t, std::vector<std::pair<double, double>>> tiles_of;  // per block: each tile's (step + backup, copy)
  const double host = static_cast<double>(z.state_spans.front().numel());
  for (size_t i = 0; i < z.weight_tile_final_after.size(); ++i) {  // (empty without speculation)
    const int64_t after = z.weight_tile_final_after[i];
    if (after < 0) continue;
    const double n = static_cast<double>(z.weight_tiles[i].numel());
    const double work = step * n / host + backup * n / static_cast<double>(z.speculated_numel);
    tiles_of[after].push_back({work, weights * n / host});
    h.step += step * n / host, h.backup += backup * n / static_cast<double>(z.speculated_numel), h.copies += weights * n / host;
    h.work[after] += work;
    h.copies_of[after] += weights * n / host;
  }
  // (the block whose hook takes block l's gradients: gradient_lag + 1 below it)
  const int64_t lag = z.gradient_lag;
  for (const auto& [l, w] : h.work)
    if (gpu_s.count(l - 1 - lag) && k == 1) h.room[l] = gpu_s[l - 1 - lag] - copy_s[l] - sum_s[l];
  // The link's two directions run at once: the gradients' copies to the host, the tiles' weights to the device.
  double gpu_free = 0, host_free = 0, out_free = 0, in_free = 0;
  std::vector<double> buffer_free(2, 0.0);
  int turn = 0;
  std::deque<std::pair<int64_t, double>> waiting;  // blocks whose gradients' copy is queued, oldest first, and when each lands
  std::map<int64_t, double> landed;
  const auto tiles_after = [&](int64_t l) {
    if (!tiles) return;
    for (const auto& [work, copy] : tiles_of[l]) {
      host_free = std::max(host_free, buffer_free[turn]) + work;
      in_free = std::max(in_free, host_free) + copy;
      buffer_free[turn] = in_free;
      turn = 1 - turn;
    }
  };
  // The units the GPU is given, top first: recompute groups of k blocks counted up from the first block whose backward
  // runs (each block alone without activation checkpointing), each unit's blocks' hooks run top down once it is given.
  // A unit runs once the gradient buffers its blocks write (those of the blocks two above each) have been copied out.
  std::vector<std::vector<int64_t>> units;
  for (int64_t first = p.backward_from; first < L; first += k) {
    units.insert(units.begin(), std::vector<int64_t>{});
    for (int64_t l = std::min(first + k, L) - 1; l >= first; --l) units.front().push_back(l);
  }
  for (const std::vector<int64_t>& unit : units) {
    double unit_s = 0, copied_out = 0;
    for (int64_t l : unit) unit_s += gpu_s[l], copied_out = std::max(copied_out, landed.count(l + 2) ? landed[l + 2] : 0.0);
    gpu_free = std::max({gpu_free, host_free, copied_out}) + unit_s;
    for (int64_t l : unit) {  // (each trained block's hook: the sums due, its copy out, then the summed blocks' tiles)
      const bool trains = copy_s[l] > 0 || tiles_of.count(l);
      if (!trains && lag > 0) continue;  // (without a lag a frozen block's hook still sums what waits: the runtime's)
      std::vector<int64_t> summed;
      for (; static_cast<int64_t>(waiting.size()) > lag; waiting.pop_front()) {
        host_free = std::max(host_free, waiting.front().second) + sum_s[waiting.front().first];
        summed.push_back(waiting.front().first);
      }
      if (trains) {
        out_free = std::max({out_free, gpu_free, host_free}) + copy_s[l];
        waiting.emplace_back(l, landed[l] = out_free);
      }
      for (int64_t s : summed) tiles_after(s);
    }
  }
  for (const auto& [l, at] : waiting) host_free = std::max(host_free, at) + sum_s[l], tiles_after(l);
  h.end = std::max(gpu_free, host_free);
  h.copies_end = in_free;
  return h;
}

// Each micro step's backward by hand without tiles (last_backward_by_hand: the first micro step's sums copy the
// arrivals in, the later ones add them): what of the blocks' copies and sums does not lengthen the blocks' backward
// hides; the rest (the lowest blocks', summed after it) shows, and the GPU waits where the host's hooks hold it.
double gradients_trip_hidden(const Plan& p) {
  if (!p.execution.overlap || p.topology.world_size != 1 || p.precision.grad_dtype != p.precision.compute_dtype) return 0;
  double copy = 0, sum = 0;
  for (const OffloadTime& x : p.step_time.offload) {
    if (x.what == "gradients to the host") copy += x.seconds;
    if (x.what == "gradients summed on the host") sum += x.seconds;
  }
  if (copy + sum == 0) return 0;
  double in_blocks = 0, elements = 0;
  for (const ParamSlot& s : p.layout.params) elements += static_cast<double>(s.numel), in_blocks += s.layer >= 0 ? static_cast<double>(s.numel) : 0.0;
  double backward = 0, blocks_backward = 0;
  for (const ModuleFlops& m : module_flops(p.model, p.batch.micro_batch, p.seq_len, p.activation_checkpointing, p.frozen, p.lora)) {
    if (m.depth != 1) continue;
    backward += m.backward + m.recompute;
    if (m.layer >= 0) blocks_backward += m.backward + m.recompute;
  }
  const double micro = static_cast<double>(p.batch.grad_accum);
  const double blocks_s = p.step_time.backward_s / micro * blocks_backward / backward;  // one micro step's blocks' backward
  const auto hidden = [&](bool first) {
    const double sums = sum * (micro > 1 ? (first ? 2 : 3) / (2 + 3 * (micro - 1)) : 1.0);
    const double carried = (copy / micro + sums) * in_blocks / elements;
    return carried - std::clamp(last_backward_by_hand(p, false, first).end - blocks_s, 0.0, carried);
  };
  return micro > 1 ? hidden(true) + (micro - 1) * hidden(false) : hidden(true);
}

// The speculative step (offload_optimizer.speculative_step) on one GPU whose gradients leave block by block: the tiles
// lying wholly in the blocks are backed up and stepped during the last micro step's backward, the host's work for the
// tiles final after a block beside the GPU's backward of the blocks below (the host summing each block's gradients
// gradient_lag blocks late, the lag chosen with the blocks); what of it hides is what does not lengthen that backward
// (last_backward_by_hand, with and without the tiles); the tiles the forward would have stepped are those left, and
// their copies' rule leaves the speculated tiles' copies out: those hide but for what is still crossing once the
// backward has ended. Where the step can be undone (gradient_clipping, bf16's overflow check) the backup's traffic is a
// row of its own. A host fast enough that each block's tiles fit beside the block whose hook takes them (all hidden
// but the lowest trained blocks', stepped after the backward), and one that is not; with and without the backup;
// blocks recomputed three at a time. With the backup on the fast host the predicted step is slower than without
// speculation (the next forward hides most of the host's step already) and ds plan warns; without it, on the slower
// host, faster.
TEST(StepTime, ASpeculativeStepHidesItsTilesHostStepBehindTheLastBackward) {
  bool capped = false, whole = false, slower_warned = false;
  struct Case {
    bool backed_up;
    const char* memory;
    int64_t recompute_group;  // (0: no activation checkpointing; above 1 a plan ds train refuses at stages 2-3 today,
                              // each block's gradients passing through one of two buffers: the model's units, ahead)
    const char* frozen = "";  // a frozen block in the middle: no gradients to copy, no tiles; its hook does nothing
  };
  // (a GH200-like link, so the gradients' trip leaves most of the backward free)
  for (const Case& c : {Case{true, "100GB/s", 0}, Case{true, "1000GB/s", 0}, Case{false, "200GB/s", 0}, Case{false, "1000GB/s", 0},
                        Case{false, "200GB/s", 1}, Case{false, "200GB/s", 3}, Case{false, "50GB/s", 0, R"(["transformer.h.6.*"])"}}) {
    const bool backed_up = c.backed_up;
    const std::string memory = c.memory;
    SCOPED_TRACE(memory + (backed_up ? ", backed up" : ", no backup") + ", recompute group " + std::to_string(c.recompute_group) + " " + c.frozen);
    std::vector<std::string> offload{"zero_optimization.offload_optimizer.device=cpu"};
    if (*c.frozen) offload.push_back(std::string("model.freeze=") + c.frozen);
    if (!backed_up) offload.insert(offload.end(), {"gradient_clipping=0", "bf16.check_grad_overflow=false"});
    if (c.recompute_group > 0) offload.push_back("pipeline.activation_checkpoint_interval=" + std::to_string(c.recompute_group));
    std::vector<std::string> speculative = offload;
    speculative.push_back("zero_optimization.offload_optimizer.speculative_step=true");
    const Plan p = plan_on(kGpt2Zero2, gpus_offloading(1, "h100", "450GB/s", memory, ""), speculative);
    const Plan without = plan_on(kGpt2Zero2, gpus_offloading(1, "h100", "450GB/s", memory, ""), offload);
    const ZeroExecution& z = p.execution;
    ASSERT_TRUE(z.step_in_backward);
    ASSERT_TRUE(z.step_in_forward);
    if (*c.frozen) {  // (nothing of block 6 is trained: the walk and the hand skip its hook)
      ASSERT_TRUE(std::none_of(p.layout.params.begin(), p.layout.params.end(), [](const ParamSlot& s) { return s.layer == 6; }));
    }
    EXPECT_EQ(p.recompute_group, c.recompute_group > 0 ? c.recompute_group : p.recompute_group);
    const StepTime& t = p.step_time;
    ASSERT_TRUE(t.step_known());
    // The blocks' gradients' trip hides as each micro step's backward by hand without tiles gives (recomputed groups and
    // a frozen block too).
    double trip_hidden = 0;
    for (const OffloadTime& x : t.offload)
      trip_hidden += x.what == "gradients to the host" || x.what == "gradients summed on the host" ? x.hidden_s : 0.0;
    EXPECT_GT(trip_hidden, 0);
    EXPECT_NEAR(trip_hidden, gradients_trip_hidden(p), 1e-15);
    // Per tile the lowest block it holds (-1: it holds a parameter outside the blocks); the plan speculates the tiles
    // of the blocks from some block K up, the K whose step it predicts shortest.
    ASSERT_EQ(z.weight_tile_final_after.size(), z.weight_tiles.size());
    int64_t first_block = p.layout.numel, speculated = 0, later = 0;
    for (const ParamSlot& s : p.layout.params)
      if (s.layer >= 0) first_block = std::min(first_block, s.offset);
    const std::vector<int64_t> lowest_of = lowest_block_of_tiles(p);
    // The tiles final after a set of blocks, chosen as "block K and up" for the K predicting the shortest step, then
    // each block's tiles taken out or put back while that predicts a shorter one: no choice of the top blocks, and no
    // one block's tiles taken out or put back, predicts a shorter step than the plan's.
    std::set<int64_t> chosen, candidates(lowest_of.begin(), lowest_of.end());
    for (int64_t a : z.weight_tile_final_after)
      if (a >= 0) chosen.insert(a);
    candidates.erase(-1);
    ASSERT_FALSE(chosen.empty());
    // The host sums each block's gradients a block or more late (gradient_lag, from 1 to 3: chosen with the blocks).
    ASSERT_GE(z.gradient_lag, 1);
    ASSERT_LE(z.gradient_lag, 3);
    const auto step_with = [&](const std::set<int64_t>& blocks, int64_t lag) {
      Plan trial = p;
      set_gradient_lag(trial.execution, lag);
      trial.execution.weight_tile_final_after = lowest_of;
      limit_speculation(trial.execution, blocks);
      return predict_step_time(trial).step_s();
    };
    EXPECT_NEAR(step_with(chosen, z.gradient_lag), t.step_s(), 1e-15);
    for (int64_t lag = 1; lag <= 3; ++lag)
      for (int64_t k : candidates)
        EXPECT_GE(step_with(std::set<int64_t>(candidates.lower_bound(k), candidates.end()), lag), t.step_s() - 1e-15)
            << "from block " << k << ", lag " << lag;
    for (int64_t g : candidates) {
      std::set<int64_t> other = chosen;
      if (!other.erase(g)) other.insert(g);
      if (!other.empty()) {
        EXPECT_GE(step_with(other, z.gradient_lag), t.step_s() - 1e-15) << "block " << g << " taken out or put back";
      }
    }
    std::set<int> groups, places;
    for (size_t i = 0; i < z.weight_tiles.size(); ++i) {
      const SubGroup& g = z.weight_tiles[i];
      int begins_in = -1;
      for (const ParamSlot& s : p.layout.params)
        if (s.offset <= g.begin && g.begin < s.offset + s.numel) begins_in = s.layer;
      const bool taken = chosen.count(lowest_of[i]) > 0;
      EXPECT_EQ(z.weight_tile_final_after[i], taken ? lowest_of[i] : -1) << "tile " << i;
      if (taken) {
        speculated += g.numel();
        groups.insert(static_cast<int>(lowest_of[i]));
      } else if (g.begin >= first_block) {
        later += g.numel();
        places.insert(begins_in);
      }
    }
    ASSERT_GE(groups.size(), 1u);
    EXPECT_EQ(z.speculated_numel, speculated);
    const double host = static_cast<double>(z.state_spans.front().numel());
    const auto row = [&](const char* what) {
      const auto x = std::find_if(t.offload.begin(), t.offload.end(), [&](const OffloadTime& o) { return o.what == what; });
      EXPECT_NE(x, t.offload.end()) << what;
      return x != t.offload.end() ? *x : OffloadTime{};
    };
    const OffloadTime step = row("optimizer step on the host");
    EXPECT_EQ(t.offload.back().what, "optimizer step on the host");
    EXPECT_EQ(z.speculation_backed_up, backed_up);
    EXPECT_EQ(std::count_if(t.offload.begin(), t.offload.end(), [](const OffloadTime& x) { return x.what == "speculated states backed up"; }),
              backed_up ? 1 : 0);
    // The backup: AdamW's master and two moments read, then written, each speculated element, at the host's memory rate.
    const OffloadTime backup = backed_up ? row("speculated states backed up") : OffloadTime{};
    if (backed_up) {
      EXPECT_DOUBLE_EQ(backup.bytes, 2.0 * 3 * 4 * static_cast<double>(speculated));
      EXPECT_NEAR(backup.seconds, step.seconds * backup.bytes / step.bytes, 1e-15);
    }
    // The last backward by hand: what of the speculated tiles' host work lengthens it shows, the rest hides.
    const ByHand plain = last_backward_by_hand(p, false), by_hand = last_backward_by_hand(p, true);
    const double share = static_cast<double>(speculated) / host;
    EXPECT_NEAR(by_hand.step, step.seconds * share, 1e-15);
    const double work = by_hand.step + by_hand.backup;
    ASSERT_GT(work, 0);
    const double hidden = work - std::clamp(by_hand.end - plain.end, 0.0, work);
    // The lowest trained block's tiles show (its gradients leave once the GPU is done). Where each block's tiles, their
    // copies and the block's gradients' trip fit within the backward of the block whose hook takes them (a block at a
    // time), the GPU never waits for the host: what shows is at most the tiles of the lowest gradient_lag + 1 trained
    // blocks, taken after the last hook (those above the lowest beside what the GPU has left to run).
    bool fit = !p.activation_checkpointing || p.recompute_group == 1;
    for (const auto& [l, w] : by_hand.work)
      if (by_hand.room.count(l)) fit = fit && w + by_hand.copies_of.at(l) <= by_hand.room.at(l);
    int64_t lowest_trained = p.model.hp.num_layers;
    for (const ParamSlot& s : p.layout.params)
      if (s.layer >= 0) lowest_trained = std::min<int64_t>(lowest_trained, s.layer);
    const double lowest = by_hand.work.begin()->first == lowest_trained ? by_hand.work.begin()->second : 0.0;
    double tail = 0;
    for (const auto& [l, w] : by_hand.work) tail += l <= lowest_trained + z.gradient_lag ? w : 0.0;
    EXPECT_LE(hidden, work - lowest + 1e-12);
    if (fit) {
      whole = true;
      EXPECT_GE(hidden, work - tail - 1e-12);
    } else if (hidden < work - tail) {  // (the host's work lengthens the backward)
      capped = true;
    }
    // The forward's part: the tiles left to it, a pipeline of the places they are stepped at.
    const double micro = static_cast<double>(p.batch.grad_accum);
    ASSERT_EQ(micro, 2);
    double before = 0, all = 0;
    const int reached = places.count(-1) ? p.model.hp.num_layers : *places.rbegin();
    for (const ModuleFlops& m : module_flops(p.model, p.batch.micro_batch, p.seq_len, p.activation_checkpointing, p.frozen, p.lora)) {
      if (m.depth != 1) continue;
      all += m.forward;
      if (m.layer >= 0 && m.layer < reached) before += m.forward;
    }
    const double later_share = static_cast<double>(later) / host, stages = static_cast<double>(places.size());
    const double filled = later > 0 ? (stages - 1) / stages : 0.0, beside = t.forward_s / micro * before / all;
    const double forward_hidden = filled * std::min(later_share * step.seconds, beside);
    EXPECT_NEAR(step.hidden_s, forward_hidden + hidden * by_hand.step / work, 1e-15);
    EXPECT_NEAR(backup.hidden_s, hidden * by_hand.backup / work, 1e-15);
    EXPECT_EQ(backup.hidden_s > 0, backed_up);
    // The weights' copies: the tiles stepped at once cross while the host steps the next of them, up to its step of
    // the tiles stepped after the backward; the forward's tiles beside the blocks before theirs; the speculated tiles'
    // all but what is still crossing once the last backward has ended.
    const OffloadTime weights = row("updated weights to the device");
    EXPECT_NEAR(by_hand.copies, weights.seconds * share, 1e-15);
    int64_t at_once = 0;
    for (const SubGroup& g : z.weight_tiles) at_once += g.begin < first_block;
    const double tiles = static_cast<double>(z.weight_tiles.size());
    const double early = std::min(weights.seconds * static_cast<double>(at_once - 1) / tiles, step.seconds * (1 - later_share - share));
    const double forward_copies = filled * std::min(later_share * weights.seconds, std::max(beside, later_share * step.seconds));
    const double speculated_copies = by_hand.copies - std::clamp(by_hand.copies_end - by_hand.end, 0.0, by_hand.copies);
    EXPECT_NEAR(weights.hidden_s, early + forward_copies + speculated_copies, 1e-15);
    double sum = 0;
    for (const OffloadTime& x : t.offload) sum += x.hidden_s;
    EXPECT_NEAR(t.offload_hidden_s, sum, 1e-15);
    EXPECT_NEAR(t.step_s(), t.compute_s + t.comm_s - t.hidden_s + t.offload_s - t.offload_hidden_s, 1e-12);
    const auto warned = std::find_if(p.warnings.begin(), p.warnings.end(), [](const ConfigIssue& w) {
      return w.path == "zero_optimization.offload_optimizer.speculative_step";
    });
    if (!backed_up) {  // the backward hides more of the slower host's step than the forward would, at no cost
      if (std::string(memory) == "200GB/s") {
        EXPECT_LT(t.step_s(), without.step_time.step_s());
        EXPECT_EQ(warned, p.warnings.end());
      }
      continue;
    }
    // The next forward already hides most of the host's step without speculation: where the backup's traffic costs
    // more than the backward adds (the fast host's), predicted slower, and ds plan says so, naming both figures.
    const bool slower = t.step_s() > without.step_time.step_s();
    EXPECT_EQ(warned != p.warnings.end(), slower);
    if (slower && warned != p.warnings.end()) {
      slower_warned = true;
      EXPECT_NE(warned->message.find("by " + format_fixed((t.step_s() - without.step_time.step_s()) * 1e3, 1) + " ms"), std::string::npos)
          << warned->message;
    }
    EXPECT_TRUE(std::none_of(without.warnings.begin(), without.warnings.end(), [](const ConfigIssue& w) {
      return w.path == "zero_optimization.offload_optimizer.speculative_step";
    }));
  }
  EXPECT_TRUE(capped);
  EXPECT_TRUE(whole);
  EXPECT_TRUE(slower_warned);
}

// One GPU with its optimizer on the host, the gradients leaving block by block (stage 2): with overlap_comm each
// block's copy out and the host's sum of it run beside the next block's backward, and hide behind it as
// gradients_trip_hidden computes, split between the two rows by their seconds; the rest of the offload as without.
// A host slow enough that the trip outlasts the blocks' backward, and a fast one. Without overlap_comm, or on
// several ranks (each group copied once its collective has ended), nothing of the trip hides.
TEST(StepTime, WithOverlapCommTheBackwardHidesOneGpusGradientsOnTheirWayToTheHost) {
  bool capped = false, whole = false;
  for (const char* memory : {"2GB/s", "1000GB/s"}) {
    SCOPED_TRACE(memory);
    const std::vector<std::string> cpu_offload{"zero_optimization.offload_optimizer.device=cpu"};
    const Plan on = plan_on(kGpt2Zero2, gpus_offloading(1, "h100", "", memory, ""), cpu_offload);
    const Plan off = plan_on(kGpt2Zero2, gpus_offloading(1, "h100", "", memory, ""),
                             {"zero_optimization.offload_optimizer.device=cpu", "zero_optimization.overlap_comm=false"});
    ASSERT_TRUE(on.execution.overlap);
    ASSERT_FALSE(off.execution.overlap);
    ASSERT_TRUE(on.step_time.step_known());
    const auto row = [](const Plan& p, const std::string& what) -> const OffloadTime& {
      const auto it = std::find_if(p.step_time.offload.begin(), p.step_time.offload.end(), [&](const OffloadTime& x) { return x.what == what; });
      EXPECT_NE(it, p.step_time.offload.end()) << what;
      return *it;
    };
    const OffloadTime& copy = row(on, "gradients to the host");
    const OffloadTime& sum = row(on, "gradients summed on the host");
    const double hidden = gradients_trip_hidden(on);
    ASSERT_GT(hidden, 0);
    EXPECT_NEAR(copy.hidden_s, hidden * copy.seconds / (copy.seconds + sum.seconds), 1e-15);
    EXPECT_NEAR(sum.hidden_s, hidden * sum.seconds / (copy.seconds + sum.seconds), 1e-15);
    EXPECT_EQ(row(off, "gradients to the host").hidden_s, 0);
    EXPECT_EQ(row(off, "gradients summed on the host").hidden_s, 0);
    // The same rows otherwise: the parts' sum is shorter by what hides (the step too, unless the host memory's busy
    // time, the same in both, sets it).
    ASSERT_EQ(on.step_time.offload.size(), off.step_time.offload.size());
    for (size_t i = 0; i < on.step_time.offload.size(); ++i) EXPECT_EQ(on.step_time.offload[i].seconds, off.step_time.offload[i].seconds);
    EXPECT_NEAR(off.step_time.parts_s() - on.step_time.parts_s(), hidden, 1e-12);
    EXPECT_DOUBLE_EQ(on.step_time.host_memory_busy_s, off.step_time.host_memory_busy_s);
    EXPECT_GE(off.step_time.step_s(), on.step_time.step_s());
    // (both regimes met: the slow host's trip lengthens the backward; the fast host's hides whole but the lowest
    // gradient_lag + 1 blocks' at most, summed after the backward: the blocks are equal)
    double blocks = 0;
    for (const ParamSlot& s : on.layout.params) blocks += s.layer >= 0 ? static_cast<double>(s.numel) : 0.0;
    const double trip_in_blocks = (copy.seconds + sum.seconds) * blocks / static_cast<double>(on.layout.numel);
    const double n = on.model.hp.num_layers, lag = static_cast<double>(on.execution.gradient_lag);
    ASSERT_EQ(lag, 1);
    if (hidden < trip_in_blocks * (n - lag - 1) / n * (1 - 1e-12)) capped = true;
    else whole = true;
  }
  EXPECT_TRUE(capped);
  EXPECT_TRUE(whole);
  // Gradients accumulated in fp32 arrive through a copy that widens them, which a GPU runs on its compute stream.
  const Plan wide = plan_on(kGpt2Zero2, gpus_offloading(1, "h100", "", "20GB/s", ""),
                            {"zero_optimization.offload_optimizer.device=cpu", "data_types.grad_accum_dtype=fp32"});
  ASSERT_EQ(wide.execution.find(BufferRole::grads_arrival, Place::host)->dtype, Dtype::fp32);
  int wide_rows = 0;
  for (const OffloadTime& x : wide.step_time.offload)
    if (x.what == "gradients to the host" || x.what == "gradients summed on the host") {
      ++wide_rows;
      EXPECT_GT(x.seconds, 0) << x.what;
      EXPECT_EQ(x.hidden_s, 0) << x.what;
    }
  EXPECT_EQ(wide_rows, 2);
  const Plan ranks = plan_on(kGpt2Zero2, gpus_offloading(8, "h100", "", "400GB/s", ""), {"zero_optimization.offload_optimizer.device=cpu"});
  ASSERT_TRUE(ranks.execution.overlap);
  int trip_rows = 0;
  for (const OffloadTime& x : ranks.step_time.offload)
    if (x.what == "gradients to the host" || x.what == "gradients summed on the host") {
      ++trip_rows;
      EXPECT_EQ(x.hidden_s, 0) << x.what;
    }
  EXPECT_EQ(trip_rows, 2);
}

// Stage 3 on one GPU with the parameters in page-locked host memory: each block's partitions cross one block ahead,
// beside the block before it (forward) or after it (backward); each pass's first block is gathered at once. By hand:
// the blocks' gathered bytes (those not kept whole, every micro step's forward and backward) are their share of the
// row, half a pass; each pass hides (n - 1) / n of that, up to the blocks' compute in it. A slow link (the copies
// outlast the blocks) and a fast one. From pageable memory, or on several ranks, nothing hides.
TEST(StepTime, OneRanksOffloadedParametersCrossABlockAheadBesideTheBlockBefore) {
  const std::vector<std::string> offload{"zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=cpu",
                                         "zero_optimization.offload_param.device=cpu"};
  bool capped = false, whole = false;
  for (const char* link : {"2GB/s", "400GB/s"}) {
    SCOPED_TRACE(link);
    const Plan p = plan_on(kGpt2Zero2, gpus_offloading(1, "h100", link, "200GB/s", ""), offload);
    ASSERT_TRUE(p.step_time.step_known());
    const auto row = std::find_if(p.step_time.offload.begin(), p.step_time.offload.end(),
                                  [](const OffloadTime& x) { return x.what == "parameters to the device"; });
    ASSERT_NE(row, p.step_time.offload.end());
    double gathered = 0;
    std::set<int> layers;
    for (size_t i = 0; i < p.layout.params.size(); ++i)
      if (p.layout.params[i].layer >= 0 && p.execution.whole_offset[i] < 0) {
        gathered += 2.0 * static_cast<double>(p.batch.grad_accum) * static_cast<double>(p.layout.params[i].numel) * 2;  // (bf16)
        layers.insert(p.layout.params[i].layer);
      }
    ASSERT_GT(gathered, 0);
    ASSERT_LT(gathered, row->bytes);  // (the outer parameters and those kept whole cross too)
    double forward = 0, backward = 0, blocks_forward = 0, blocks_backward = 0;
    for (const ModuleFlops& m : module_flops(p.model, p.batch.micro_batch, p.seq_len, p.activation_checkpointing, p.frozen, p.lora)) {
      if (m.depth != 1) continue;
      forward += m.forward, backward += m.backward + m.recompute;
      if (m.layer >= 0) blocks_forward += m.forward, blocks_backward += m.backward + m.recompute;
    }
    const double pass = row->seconds * gathered / row->bytes / 2;
    const double f = p.step_time.forward_s * blocks_forward / forward, b = p.step_time.backward_s * blocks_backward / backward;
    const double n = static_cast<double>(layers.size());
    // (the gradients leaving for the host beside the same backward hide too, on the other copy stream: the link's other
    // direction)
    EXPECT_GT(gradients_trip_hidden(p), 0);
    EXPECT_NEAR(row->hidden_s, (n - 1) / n * (std::min(pass, f) + std::min(pass, b)), 1e-15);
    EXPECT_GT(row->hidden_s, 0);
    (pass > f || pass > b ? capped : whole) = true;
    std::vector<std::string> pageable = offload;
    pageable.push_back("zero_optimization.offload_param.pin_memory=false");
    const Plan slow = plan_on(kGpt2Zero2, gpus_offloading(1, "h100", link, "200GB/s", ""), pageable);
    for (const OffloadTime& x : slow.step_time.offload)
      if (x.what == "parameters to the device") EXPECT_EQ(x.hidden_s, 0);
    EXPECT_NEAR(slow.step_time.step_s() - p.step_time.step_s(), row->hidden_s, 1e-12);
  }
  EXPECT_TRUE(capped);
  EXPECT_TRUE(whole);
  const Plan ranks = plan_on(kGpt2Zero2, gpus_offloading(8, "h100", "", "400GB/s", ""), offload);
  int rows = 0;
  for (const OffloadTime& x : ranks.step_time.offload)
    if (x.what == "parameters to the device") {
      ++rows;
      EXPECT_EQ(x.hidden_s, 0);
    }
  EXPECT_EQ(rows, 1);
}

TEST(StepTime, HowTheWeightsComeBackIsOnePlanDecisionPerSpanThatTheBuffersTransfersAndStepReadAlike) {
  // bf16 weights are written by the optimizer's kernel in place where one memory holds the stepped states and the
  // weights (the device's span on the device, the host's with the parameters on the host, or a CPU device); a host
  // kernel stepping a GPU's weights writes them into a page-locked staging buffer (a chunk's: the span, or an NVMe
  // sub-group) copied over whole; an fp32 run's and weights in a file are copied from the master. The transfers,
  // the buffers and the host's step row follow the span's decision.
  using W = WeightsBack;
  struct Case {
    const char* what;
    bool gpu;
    std::vector<std::string> overrides;
    std::vector<W> weights;  // per span, offloaded first
  };
  const std::string opt = "zero_optimization.offload_optimizer.", par = "zero_optimization.offload_param.";
  const std::vector<Case> cases{
      {"GPU, no offload", true, {}, {W::in_place}},
      {"GPU, fp32", true, {"bf16.enabled=false"}, {W::copied}},
      {"GPU, states on the host", true, {opt + "device=cpu"}, {W::staged}},
      {"GPU, Lamb's states on the host (one tile)", true, {opt + "device=cpu", "optimizer.type=Lamb"}, {W::staged}},
      {"GPU, states on the host in at most 1024 tiles", true, {opt + "device=cpu", "zero_optimization.sub_group_size=16"}, {W::staged}},
      {"GPU, half on the host", true, {"zero_optimization.stage=3", opt + "device=cpu", opt + "ratio=0.5"}, {W::staged, W::in_place}},
      {"GPU, states on NVMe", true, {"zero_optimization.stage=3", opt + "device=nvme", opt + "nvme_path=/tmp", "zero_optimization.sub_group_size=20000000"},
       {W::staged}},
      {"GPU, states and parameters on the host", true, {"zero_optimization.stage=3", opt + "device=cpu", par + "device=cpu"}, {W::in_place}},
      {"GPU, states on NVMe, parameters on the host", true,
       {"zero_optimization.stage=3", opt + "device=nvme", opt + "nvme_path=/tmp", par + "device=cpu"}, {W::in_place}},
      {"GPU, parameters on NVMe", true,
       {"zero_optimization.stage=3", opt + "device=cpu", par + "device=nvme", par + "nvme_path=/tmp"}, {W::copied}},
      {"GPU, parameters on the host, states on the device", true, {"zero_optimization.stage=3", par + "device=cpu"}, {W::copied}},
      {"CPU, half on the host", false, {"zero_optimization.stage=3", opt + "device=cpu", opt + "ratio=0.5"}, {W::in_place, W::in_place}},
      {"CPU, fp32 on the host", false, {"bf16.enabled=false", opt + "device=cpu"}, {W::copied}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Topology t = c.gpu ? gpus_offloading(1, "h100", "", "400GB/s", "") : test::thread_ranks(1, 0);
    t.rates.host_memory_bw = 400e9;
    Plan p;
    try {
      p = plan_on(kGpt2Zero2, t, c.overrides);
    } catch (const ConfigError& e) {
      FAIL() << e.issues().front().path << ": " << e.issues().front().message;
    }
    const ZeroExecution& z = p.execution;
    ASSERT_EQ(z.state_spans.size(), c.weights.size());
    for (size_t i = 0; i < c.weights.size(); ++i)
      EXPECT_EQ(z.state_spans[i].weights, c.weights[i]) << "span " << i << ": " << weights_back_name(z.state_spans[i].weights);
    for (const Transfer& x : z.transfers) {
      if (x.what == "updated weights to the device") {
        EXPECT_EQ(x.written_in_step, c.weights.front() == W::in_place) << x.what;
      }
      if (x.what == "stepped weights to the host") {
        EXPECT_EQ(x.written_in_step, c.weights.back() == W::in_place) << x.what;
      }
    }
    // The staging buffers: on the host, in the weights' dtype, a tile's each (a tile of the span in memory, or a
    // window of an NVMe sub-group: at most kMostStagingTile elements, the tiles tiling the span, an NVMe span's
    // each inside one sub-group), two where there are several.
    const ZeroBuffer* staging = z.find(BufferRole::weights_staging, Place::host);
    ASSERT_EQ(staging != nullptr, c.weights.front() == W::staged);
    EXPECT_EQ(!z.weight_tiles.empty(), c.weights.front() == W::staged);
    if (staging) {
      EXPECT_EQ(staging->dtype, Dtype::bf16);
      const bool nvme = z.state_spans.front().place == Place::nvme;
      const std::vector<SubGroup>& tiles = z.staged_tiles();
      ASSERT_FALSE(tiles.empty());
      EXPECT_LE(tiles.size(), static_cast<size_t>(kMostWeightTiles));
      EXPECT_EQ(tiles.size() == 1, p.optimizer.per_tensor_update());  // Lamb steps its tensors whole: one tile
      int64_t most = 0, at = 0;
      size_t in = 0;  // the sub-group holding the tile (NVMe)
      for (const SubGroup& g : tiles) {
        EXPECT_EQ(g.begin, at);
        at = g.end;
        most = std::max(most, g.numel());
        if (tiles.size() > 1) {
          EXPECT_LE(g.numel(), std::max(kMostStagingTile, (z.state_spans.front().numel() + kMostWeightTiles - 1) / kMostWeightTiles));
        }
        if (!nvme) continue;
        while (in < z.sub_groups.size() && z.sub_groups[in].end <= g.begin) ++in;
        ASSERT_LT(in, z.sub_groups.size());
        EXPECT_TRUE(g.begin >= z.sub_groups[in].begin && g.end <= z.sub_groups[in].end) << "a window across sub-groups at " << g.begin;
      }
      // Sub-groups of 20M elements: stepped in windows of at most 16M, so the staging holds a window, not a sub-group.
      if (nvme) {
        EXPECT_GT(tiles.size(), z.sub_groups.size());
        EXPECT_LE(most, kMostStagingTile);
        EXPECT_GT(most, kMostStagingTile - kStepGrain);  // (a cut moves back onto its run's grain by less than one)
        // The gradients' fp32 copy beside the states (gradients kept on the device until the step) holds a window too.
        if (const ZeroBuffer* g = z.find(BufferRole::offload_grads, Place::host)) {
          EXPECT_EQ(g->elements, most);
        }
      }
      EXPECT_EQ(at, z.state_spans.front().end);
      EXPECT_EQ(staging->elements, most);
      EXPECT_EQ(staging->copies, tiles.size() > 1 ? 2 : 1);
      // All but the last tile's copy to the device hides behind the host's step, where it steps every tile at once
      // (OneGpusHostStepHidesItsLaterTilesBehindTheNextForward: where it leaves most to the next forward).
      for (const OffloadTime& x : p.step_time.offload)
        if (x.what == "updated weights to the device" && !z.step_in_forward) {
          EXPECT_NEAR(x.hidden_s, x.seconds * static_cast<double>(tiles.size() - 1) / static_cast<double>(tiles.size()), 1e-15);
        }
    }
    const nlohmann::json spans = nlohmann::json::parse(plan_to_json(p))["zero_execution"]["optimizer_state_spans"];
    EXPECT_EQ(spans.front()["weights"], weights_back_name(c.weights.front()));
    if (z.state_spans.front().place == Place::device) continue;
    // The host's step: a weight the kernel writes is its bf16 bytes, else the master read again (+ the weight where
    // it lands on the host).
    const bool params_on_host = p.zero.offload_param.device != OffloadDevice::none;
    const double weight = c.weights.front() != W::copied ? 2.0 : 4.0 + (params_on_host ? dtype_bytes(p.precision.param_dtype) : 0.0);
    const double moments = static_cast<double>(p.optimizer.moments);
    // (the gradient: in its own dtype where it left the GPU block by block into host memory, else its fp32 copy)
    const double grad = z.find_anywhere(BufferRole::grads)->place == Place::host ? dtype_bytes(p.precision.grad_dtype) : 4.0;
    EXPECT_DOUBLE_EQ(p.step_time.offload.back().bytes, static_cast<double>(z.state_spans.front().numel()) * (grad + 8 * (1 + moments) + weight));
  }
}

TEST(StepTime, PinMemoryPageLocksTheHostBuffersAGpuCopiesAndNeverTheStatesOnTheCpuItWarns) {
  // From a GPU, ZeRO 3 with the optimizer and the parameters on the host: the parameters' partition, the buffer the
  // gradients leaving the GPU arrive in and the staged weights are page-locked (pin_memory, DeepSpeed's default true), the master and
  // moments the host steps in place are not; each block's pin_memory false leaves its own buffers pageable.
  const std::vector<std::string> both{"zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=cpu",
                                      "zero_optimization.offload_param.device=cpu"};
  const auto pinned_roles = [](const Plan& p) {
    std::set<std::string> roles;
    for (const ZeroBuffer& b : p.execution.buffers)
      if (b.pinned) roles.insert(buffer_role_name(b.role));
    return roles;
  };
  const Plan gpu = plan_on(kGpt2Zero2, gpus_offloading(1, "h100", "", "", ""), both);
  // (the parameters on the host: weights in place; ZeRO 3's overlap_comm: each block's gradients land whole, a block late)
  EXPECT_EQ(pinned_roles(gpu), (std::set<std::string>{"params", "grads_arrival", "block_arrivals"}));
  std::vector<std::string> staged{"zero_optimization.stage=2", "zero_optimization.offload_optimizer.device=cpu"};
  EXPECT_EQ(pinned_roles(plan_on(kGpt2Zero2, gpus_offloading(1, "h100", "", "", ""), staged)),
            (std::set<std::string>{"grads_arrival", "block_arrivals", "weights_staging"}));
  std::vector<std::string> no_params = both, no_optimizer = both;
  no_params.push_back("zero_optimization.offload_param.pin_memory=false");
  no_optimizer.push_back("zero_optimization.offload_optimizer.pin_memory=false");
  EXPECT_EQ(pinned_roles(plan_on(kGpt2Zero2, gpus_offloading(1, "h100", "", "", ""), no_params)),
            (std::set<std::string>{"grads_arrival", "block_arrivals"}));
  // fp32 from the GPU: the weights are the master's, copied over from it: the master is page-locked; ZeRO 1's gradients
  // come over whole into their fp32 copy beside the states.
  EXPECT_EQ(pinned_roles(plan_on(kGpt2Zero2, gpus_offloading(1, "h100", "", "", ""),
                                 {"bf16.enabled=false", "zero_optimization.stage=1", "zero_optimization.offload_optimizer.device=cpu"})),
            (std::set<std::string>{"master", "offload_grads"}));
  EXPECT_EQ(pinned_roles(plan_on(kGpt2Zero2, gpus_offloading(1, "h100", "", "", ""), no_optimizer)), (std::set<std::string>{"params"}));
  const nlohmann::json buffers = nlohmann::json::parse(plan_to_json(gpu))["zero_execution"]["buffers"];
  int pinned_json = 0;
  for (const auto& b : buffers) pinned_json += b["pinned"].get<bool>() ? 1 : 0;
  EXPECT_EQ(pinned_json, 3);
  // On the CPU nothing crosses: nothing is page-locked, and pin_memory false is named as having no effect.
  const Plan cpu = plan_on(kGpt2Zero2, test::thread_ranks(1, 0), no_optimizer);
  EXPECT_TRUE(pinned_roles(cpu).empty());
  int warned = 0;
  for (const ConfigIssue& w : cpu.warnings) warned += w.path == "zero_optimization.offload_optimizer.pin_memory" ? 1 : 0;
  EXPECT_EQ(warned, 1);
  for (const ConfigIssue& w : gpu.warnings) EXPECT_EQ(w.path.find("pin_memory"), std::string::npos) << w.path;
}

TEST(StepTime, NvmeSwapsAreTheDrivesRateAndPipelinedOnesHideBehindTheHostsStep) {
  const auto nvme = [](bool read, bool write, int64_t sub_group) {
    return std::vector<std::string>{"zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=nvme",
                                    "zero_optimization.offload_optimizer.nvme_path=/tmp", "zero_optimization.offload_optimizer.buffer_count=8",
                                    std::string("zero_optimization.offload_optimizer.pipeline_read=") + (read ? "true" : "false"),
                                    std::string("zero_optimization.offload_optimizer.pipeline_write=") + (write ? "true" : "false"),
                                    "zero_optimization.sub_group_size=" + std::to_string(sub_group)};
  };
  EXPECT_TRUE(mentions(plan_on(kGpt2Zero2, gpus_offloading(1, "h200", "", "200GB/s", ""), nvme(true, true, 10000000)).step_time.missing, "--nvme-bw"));
  // Pipelined reads let every sub-group's read but the first run while the host steps another; pipelined writes every
  // write but the last; up to the step's time. One sub-group: nothing to overlap.
  struct Case {
    bool read, write;
    int64_t sub_group;
  };
  for (const Case& c : {Case{false, false, 10000000}, Case{true, false, 10000000}, Case{true, true, 10000000}, Case{true, true, 1000000000}}) {
    SCOPED_TRACE(std::string(c.read ? "read " : "") + (c.write ? "write " : "") + std::to_string(c.sub_group));
    const Plan p = plan_on(kGpt2Zero2, gpus_offloading(1, "h200", "", "200GB/s", "5GB/s"), nvme(c.read, c.write, c.sub_group));
    const StepTime& t = p.step_time;
    ASSERT_TRUE(t.step_known()) << (t.missing.empty() ? "" : t.missing.front());
    const double groups = static_cast<double>(p.execution.sub_groups.size());
    double reads = 0, writes = 0, weights = 0, step = 0, all = 0;
    for (const OffloadTime& o : t.offload) {
      const bool on_nvme = o.resource == OffloadResource::nvme;
      EXPECT_DOUBLE_EQ(o.seconds, o.bytes / (on_nvme ? 5e9 : o.resource == OffloadResource::host_memory ? 200e9 : 50e9)) << o.what;
      if (o.what == "optimizer states read") reads = o.seconds;
      if (o.what == "optimizer states written") writes = o.seconds;
      if (o.what == "updated weights to the device") weights = o.seconds;
      if (o.what == "optimizer step on the host") step = o.seconds;
      all += o.seconds;
    }
    ASSERT_GT(reads, 0);
    ASSERT_GT(step, 0);
    // The bf16 weights cross window by window (each sub-group's, of at most kMostStagingTile elements) through the
    // staging buffers as the host steps the next: all but the last's hides too, pipelined or not, one sub-group too.
    ASSERT_EQ(p.execution.state_spans.front().weights, WeightsBack::staged);
    const double windows = static_cast<double>(p.execution.weight_tiles.size());
    EXPECT_GE(windows, groups);
    if (c.sub_group == 1000000000) {
      EXPECT_EQ(groups, 1);
      EXPECT_GE(windows, std::ceil(static_cast<double>(p.execution.offloaded_numel) / kMostStagingTile));
    }
    const double share = groups > 1 && p.execution.swap_sets > 1 ? (groups - 1) / groups : 0;
    const double nvme_hideable = share * ((c.read ? reads : 0) + (c.write ? writes : 0));
    const double weights_hideable = windows > 1 ? (windows - 1) / windows * weights : 0;
    const double hidden = std::min(nvme_hideable + weights_hideable, step);
    const double nvme_hidden = hidden > 0 ? hidden * nvme_hideable / (nvme_hideable + weights_hideable) : 0;
    if (c.sub_group == 10000000) {
      EXPECT_GT(groups, 5);
    }
    if (c.read && c.sub_group == 10000000) {
      EXPECT_GT(hidden, 0);
    }
    // (and the backward hides the gradients' trip to the host: overlap_comm)
    const double trip = gradients_trip_hidden(p);
    EXPECT_GT(trip, 0);
    EXPECT_NEAR(t.offload_hidden_s, hidden + trip, 1e-12);
    EXPECT_NEAR(t.step_s(), t.compute_s + t.comm_s - t.hidden_s + all - hidden - trip, 1e-12);
    EXPECT_NEAR(t.offload_seconds(OffloadResource::nvme), reads + writes - nvme_hidden, 1e-12);  // the states are the drives' only traffic here
  }
}

TEST(StepTime, APipelinesOffloadIsItsSlowestStagesAndItsHostMemoryEachNodesOwnStages) {
  // 8 H100s on 2 nodes, pipeline 2 x data 4 (ranks 0-3 stage 0 on node 0, 4-7 stage 1 on node 1), the optimizer on
  // the host: the stages step different parts, and the one with more to step sets the offload's pace; each node's
  // host memory is its own ranks' stages'.
  TopologyOptions o;
  o.host_memory_bw = "400GB/s";
  const Topology two_nodes = gpus_with(2, 4, "h100", o);
  const std::vector<std::string> mesh{"pipeline.stages=2", "zero_optimization.stage=1", "gradient_accumulation_steps=8",
                                      "train_micro_batch_size_per_gpu=1", "zero_optimization.offload_optimizer.device=cpu", "model.num_layers=5"};
  const Plan p = plan_on(kGpt2Zero2, two_nodes, mesh);
  ASSERT_EQ(p.mesh.shape.pipeline, 2);
  double most_step_bytes = 0, node_host[2] = {0, 0}, most_busy_bytes = 0;
  for (int r = 0; r < 8; ++r) {
    Topology t = two_nodes;
    t.rank = r;
    const Plan own = with_own_stage(plan_on(kGpt2Zero2, t, mesh));
    ASSERT_EQ(own.execution.state_spans.size(), 1u);
    const double step_bytes = static_cast<double>(own.execution.state_spans[0].numel()) * (4 + 8 * 3 + 2);
    most_step_bytes = std::max(most_step_bytes, step_bytes);
    node_host[r / 4] += own.memory.host.total();
    // Its host memory's work: the step's bytes, and every copy's bytes read or written there (bf16 weights staged).
    double copied = 0;
    for (const Transfer& x : own.execution.transfers) copied += x.bytes_per_step;
    most_busy_bytes = std::max(most_busy_bytes, step_bytes + copied);
  }
  EXPECT_DOUBLE_EQ(p.step_time.offload.back().bytes, most_step_bytes);
  // The floor: the busiest stage's host memory, at the node's rate shared by its 4 ranks (here the stage whose offload
  // is slowest too: both grow with a stage's elements).
  EXPECT_NEAR(p.step_time.host_memory_busy_s, most_busy_bytes / (400e9 / 4), 1e-12);
  EXPECT_DOUBLE_EQ(p.host_bytes_per_node(), std::max(node_host[0], node_host[1]));
  EXPECT_NE(node_host[0], node_host[1]);  // the stages hold different parts
}

TEST(StepTime, OnTheCpuACopyBetweenPlacesReadsAndWritesTheHostsMemoryAndBadRatesAreRefused) {
  Topology t = test::thread_ranks(2, 0);
  t.rates.host_memory_bw = 100e9;
  const Plan p = plan_on(kGpt2Zero2, t, {"zero_optimization.offload_optimizer.device=cpu"});
  const int sharing = std::max(1, p.topology.ranks_per_node);
  ASSERT_FALSE(p.step_time.offload.empty());
  int written = 0;
  for (const OffloadTime& o : p.step_time.offload) {
    EXPECT_EQ(o.resource, OffloadResource::host_memory) << o.what;  // one memory: no link
    // bf16 weights the host's step writes in place (one memory holds both places): their bytes, no time of their own.
    if (o.what == "updated weights to the device") {
      ++written;
      EXPECT_EQ(o.seconds, 0);
      continue;
    }
    // The step streams the memory; a copy between places reads and writes it.
    EXPECT_DOUBLE_EQ(o.seconds, o.bytes / (o.what == "optimizer step on the host" ? 100e9 / sharing : 100e9 / 2 / sharing)) << o.what;
  }
  EXPECT_EQ(written, 1);
  // The step's weight is the kernel's write on a CPU device: 4 + 8 x 3 + 2 bytes.
  EXPECT_DOUBLE_EQ(p.step_time.offload.back().bytes, static_cast<double>(p.execution.local_numel) * (4 + 8 * 3 + 2));
  EXPECT_NE(std::string(p.step_time.bound()), "host-link-bound");
  EXPECT_FALSE(mentions(p.step_time.missing, "--host"));  // compute is what a CPU plan lacks
  for (const auto& [link, memory, nvme] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"fast", "", ""}, {"", "400Gb/s", ""}, {"", "", "lots"}, {"", "200GB", ""}})
    EXPECT_THROW(gpus_offloading(1, "h100", link, memory, nvme), UserError) << link << memory << nvme;
  EXPECT_DOUBLE_EQ(gpus_offloading(1, "a100", "", "", "").rates.host_link.busbw, 25e9);
  EXPECT_DOUBLE_EQ(gpus_offloading(1, "a100", "64GB/s", "6.5GiB/s", "").rates.host_link.busbw, 64e9);
  EXPECT_DOUBLE_EQ(gpus_offloading(1, "a100", "", "6.5GiB/s", "").rates.host_memory_bw, 6.5 * 1024 * 1024 * 1024);
}

}  // namespace
}  // namespace ds

// NCCL's layout for its all-gather and reduce-scatter (equal_pieces): one span a rank, all of one size, rank q's at
// first + q x size, as many owners as ranks. Anything else is uneven (the NCCL communicator then groups broadcasts or
// reduces, one a span).
TEST(NcclLayout, EqualPiecesAreOneSpanARankOfOneSizeInRankOrder) {
  using ds::equal_pieces;
  using ds::Ownership;
  const auto p = equal_pieces(Ownership{{{10, 4}}, {{14, 4}}, {{18, 4}}}, 3);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->first, 10);
  EXPECT_EQ(p->size, 4);
  EXPECT_TRUE(equal_pieces(Ownership{{{0, 0}}, {{0, 0}}}, 2).has_value());  // empty pieces, all at one place
  EXPECT_FALSE(equal_pieces(Ownership{{{10, 4}}, {{14, 4}}}, 3).has_value());  // fewer owners than ranks
  EXPECT_FALSE(equal_pieces(Ownership{{{10, 4}}, {{14, 5}}, {{19, 4}}}, 3).has_value());  // sizes differ
  EXPECT_FALSE(equal_pieces(Ownership{{{14, 4}}, {{10, 4}}, {{18, 4}}}, 3).has_value());  // not in rank order
  EXPECT_FALSE(equal_pieces(Ownership{{{10, 2}, {12, 2}}, {{14, 4}}, {{18, 4}}}, 3).has_value());  // two spans for rank 0
  EXPECT_FALSE(equal_pieces(Ownership{{{10, 4}}, {{15, 4}}, {{20, 4}}}, 3).has_value());  // a gap between pieces
}
