// ZeRO's exchange at every stage inside one process: ranks are threads joined by a LocalGroup, so the
// flat buffers, the gradient reduction, the stage-3 gathers and the communicator's ledger are checked
// without starting processes (the Gloo runs in test_zero.cpp remain the integration tests).
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <exception>
#include <fstream>
#include <filesystem>
#include <functional>
#include <mutex>
#include <thread>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "engine/plan/mesh.hpp"
#include "engine/plan/plan_record.hpp"
#include "engine/runtime/comm/comm_local.hpp"
#include "engine/runtime/model/tensor_parallel.hpp"
#include "engine/runtime/run/flat_params.hpp"
#include "engine/runtime/run/optimizer_states.hpp"
#include "engine/runtime/model/language_model.hpp"
#include "engine/runtime/run/trainer.hpp"
#include "engine/runtime/run/zero.hpp"
#include "schema/loader.hpp"
#include "test_helpers.hpp"

#include <nlohmann/json.hpp>

using namespace ds;
namespace fs = std::filesystem;

namespace {

const char* kTiny = R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
  "model": {"preset": "gpt2-tiny"}, "data": {"type": "synthetic", "seq_len": 16, "val_fraction": 0.05},
  "zero_optimization": {"reduce_bucket_size": 3000, "allgather_bucket_size": 5000,
                        "stage3_param_persistence_threshold": "auto"},
  "train": {"steps": 6, "eval_every": 0, "threads": 1}})";

Plan plan_for(int world, int rank, const std::vector<std::string>& overrides) { return test::plan_of(kTiny, world, rank, overrides); }

// The plan of thread ranks whose collectives speak `library`'s terms (Gloo's are the CPU's own).
Plan plan_speaking(CommBackend library, int world, int rank, const std::vector<std::string>& overrides) {
  Config c = load_config_text(kTiny, "test.json", overrides);
  Topology t = test::thread_ranks(world, rank);
  t.communicator = library;
  return compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), t);
}

using test::on_ranks;

torch::Tensor tokens(int64_t sample, int64_t T) {
  return torch::randint(0, 256, {1, T}, torch::TensorOptions().dtype(torch::kLong)).add_(sample * 7).remainder_(256);
}

// The whole model's weights from the seed, as the trainer initialises them, into this rank's buffers.
void initialise(const Plan& plan, FlatParams& flat, ZeroExchange& zero) {
  torch::NoGradGuard ng;
  torch::Tensor init = torch::zeros({plan.layout.numel}, torch::kFloat32);
  initialise_model(plan, init, 5);
  const torch::Tensor& master = flat.states.at(0).master;  // one state span: no offload here
  for (const OwnedSegment& s : flat.owned) master.narrow(0, s.local, s.numel).copy_(init.narrow(0, s.global, s.numel));
  if (master.data_ptr() != flat.local_params.data_ptr()) flat.local_params.copy_(master);
  zero.publish_parameters();
}

// A rank's buffers, exchange and model (`comm` null: one rank), its weights initialised from the seed. Built in
// place: the exchange and the model hold references into the buffers.
struct RankModel {
  std::unique_ptr<Device> device;
  FlatParams flat;
  ZeroExchange zero;
  std::unique_ptr<LanguageModel> model;
  RankModel(const Plan& plan, int rank, Communicator* comm)
      : device(Device::create(DeviceKind::cpu, rank)), flat(FlatParams::allocate(plan, rank, *device)), zero(plan, flat, comm),
        model(make_model(plan, flat)) {
    if (zero.hooks_blocks()) model->set_block_hooks(&zero);
    initialise(plan, flat, zero);
  }
};

// One micro step on this rank's batch, its loss scaled (1/W: the ranks' sum is the mean); as the
// trainer does, the model is told the scale first (its head adds its weight's gradient in forward).
void micro_step(ZeroExchange& zero, LanguageModel& model, const torch::Tensor& in, const torch::Tensor& tgt, double scale,
                bool last = true) {
  zero.begin_micro_step(false);
  model.set_loss_gradient(scale);
  torch::Tensor loss = model.loss(in, tgt);
  zero.begin_backward(last);
  (loss * scale).backward();
  zero.end_micro_step();
}

}  // namespace

TEST(ZeroInProcess, EachRanksReducedGradientPartIsTheWholeBatchsAtEveryStage) {
  const int64_t T = 16;  // two samples per rank
  for (int world : {2, 3}) {
    // Every rank's batch, and the reference: one rank of the same model accumulating them all.
    std::vector<torch::Tensor> in, tgt;
    torch::manual_seed(11);
    for (int r = 0; r < world; ++r) {
      in.push_back(torch::cat({tokens(2 * r, T), tokens(2 * r + 1, T)}));
      tgt.push_back(torch::cat({tokens(2 * r + 7, T), tokens(2 * r + 8, T)}));
    }
    const Plan one = plan_for(1, 0, {"zero_optimization.stage=0"});
    RankModel reference(one, 0, nullptr);
    for (int r = 0; r < world; ++r) micro_step(reference.zero, *reference.model, in[r], tgt[r], 1.0 / world);
    const torch::Tensor expected = reference.flat.grads.narrow(0, 0, one.layout.numel);

    // Over Gloo's terms (point-to-point reduce-scatter into scratch, gathers into spans) and NCCL's (the
    // library's own reduce-scatter, no scratch; gathers packed into equal pieces).
    for (const CommBackend library : {CommBackend::gloo, CommBackend::nccl})
    for (int stage : {0, 1, 2, 3}) {
      // The third variant keeps every parameter of this tiny model whole at stage 3 (DeepSpeed's default threshold).
      for (const char* overlap : {"zero_optimization.overlap_comm=false", "zero_optimization.overlap_comm=true",
                                  "zero_optimization.stage3_param_persistence_threshold=100000"}) {
        SCOPED_TRACE("stage " + std::to_string(stage) + " on " + std::to_string(world) + " thread ranks speaking " +
                     comm_backend_name(library) + ", " + overlap);
        LocalGroup group(world, std::chrono::seconds(60), library);
        torch::Tensor assembled = torch::zeros({one.layout.numel}, torch::kFloat32);
        std::vector<CommLedger> ledgers(static_cast<size_t>(world));
        std::vector<Plan> plans;
        for (int r = 0; r < world; ++r)
          plans.push_back(plan_speaking(library, world, r, {"zero_optimization.stage=" + std::to_string(stage), overlap}));
        EXPECT_EQ(plans[0].execution.backend, library);
        std::mutex m;
        on_ranks(world, [&](int r) {
          const Plan& plan = plans[static_cast<size_t>(r)];
          auto comm = group.join(r);
          RankModel rank(plan, r, comm.get());
          FlatParams& flat = rank.flat;
          const CommLedger before = comm->ledger();
          micro_step(rank.zero, *rank.model, in[static_cast<size_t>(r)], tgt[static_cast<size_t>(r)], 1.0 / world);
          rank.zero.reduce_gradients();
          std::lock_guard<std::mutex> lock(m);
          for (const OwnedSegment& s : flat.owned)
            assembled.narrow(0, s.global, s.numel).copy_(flat.local_grads.narrow(0, s.local, s.numel));
          CommLedger step;
          for (const auto& [kind, st] : comm->ledger()) {
            CommStats d = st;
            if (auto it = before.find(kind); it != before.end()) d.bytes -= it->second.bytes, d.calls -= it->second.calls;
            if (d.calls > 0) step[kind] = d;
          }
          ledgers[static_cast<size_t>(r)] = step;
        });
        // Every element of the gradient is owned by exactly one rank and equals the whole batch's.
        EXPECT_TRUE(torch::allclose(assembled, expected, 1e-5, 1e-7))
            << "max difference " << (assembled - expected).abs().max().item<double>();
        // One micro step's collectives are the plan's, kind for kind, byte for byte.
        for (const Collective& c : plans[0].execution.collectives) {
          if (c.when != Cadence::per_micro_step && c.kind != CollectiveKind::gradients) continue;
          for (int r = 0; r < world; ++r) {
            const CommLedger& l = ledgers[static_cast<size_t>(r)];
            const auto it = l.find(c.kind);
            ASSERT_NE(it, l.end()) << c.what() << " on rank " << r;
            EXPECT_DOUBLE_EQ(it->second.bytes, c.wire_bytes_per_rank_per_step) << c.what() << " on rank " << r;
            EXPECT_EQ(it->second.calls, c.calls_per_step) << c.what() << " on rank " << r;
          }
        }
      }
    }
  }
}

TEST(ZeroInProcess, Bf16GradientsAccumulatedInFp32AddEachMicroBatchsGradientAtEveryStage) {
  // data_types.grad_accum_dtype fp32 over bf16 weights: backward writes each micro-batch's gradients in bf16, and
  // the step's gradient is their sum in fp32. The reference takes each micro-batch's bf16 gradient alone on one
  // plain bf16 rank (same weights, same kernels) and sums them here: stages 0-1 add every micro-batch into fp32
  // and reduce the fp32 sums; stages 2-3 reduce each micro-batch's group over the ranks in bf16 (summed in fp32,
  // rounded once, as Gloo's reduce-scatter of bf16) and add that into the rank's fp32 part. Accumulating in bf16
  // would round after every micro-batch, far outside these tolerances.
  const int64_t T = 16;
  const int GAS = 3;
  for (int world : {2, 3}) {
    std::vector<std::vector<torch::Tensor>> in(static_cast<size_t>(world)), tgt(static_cast<size_t>(world));
    torch::manual_seed(13);
    for (int r = 0; r < world; ++r)
      for (int m = 0; m < GAS; ++m) {
        const int64_t at = 2 * (r * GAS + m);
        in[static_cast<size_t>(r)].push_back(torch::cat({tokens(at, T), tokens(at + 1, T)}));
        tgt[static_cast<size_t>(r)].push_back(torch::cat({tokens(at + 5, T), tokens(at + 6, T)}));
      }
    const double scale = 1.0 / (world * GAS);
    const Plan one = plan_for(1, 0, {"zero_optimization.stage=0", "bf16.enabled=true"});
    ASSERT_FALSE(one.execution.micro_grads);
    RankModel reference(one, 0, nullptr);
    FlatParams& ref = reference.flat;
    const int64_t P = one.layout.numel;
    torch::Tensor summed = torch::zeros({P}, torch::kFloat32), per_micro_rounded = torch::zeros({P}, torch::kFloat32);
    for (int m = 0; m < GAS; ++m) {
      torch::Tensor over_ranks = torch::zeros({P}, torch::kFloat32);
      for (int r = 0; r < world; ++r) {
        ref.grads.zero_();
        micro_step(reference.zero, *reference.model, in[static_cast<size_t>(r)][static_cast<size_t>(m)], tgt[static_cast<size_t>(r)][static_cast<size_t>(m)], scale);
        ASSERT_EQ(ref.grads.scalar_type(), torch::kBFloat16);
        const torch::Tensor g = ref.grads.narrow(0, 0, P).to(torch::kFloat32);
        summed.add_(g);
        over_ranks.add_(g);
      }
      per_micro_rounded.add_(over_ranks.to(torch::kBFloat16).to(torch::kFloat32));
    }
    for (int stage : {0, 1, 2, 3})
      for (const char* overlap : {"zero_optimization.overlap_comm=false", "zero_optimization.overlap_comm=true"}) {
        SCOPED_TRACE("stage " + std::to_string(stage) + " on " + std::to_string(world) + " thread ranks, " + overlap);
        LocalGroup group(world, std::chrono::seconds(60));
        std::vector<Plan> plans;
        for (int r = 0; r < world; ++r)
          plans.push_back(plan_for(world, r, {"bf16.enabled=true", "data_types.grad_accum_dtype=fp32",
                                              "zero_optimization.stage=" + std::to_string(stage), overlap}));
        EXPECT_EQ(plans[0].execution.micro_grads, stage <= 1);
        torch::Tensor assembled = torch::zeros({P}, torch::kFloat32);
        std::mutex mu;
        on_ranks(world, [&](int r) {
          const Plan& plan = plans[static_cast<size_t>(r)];
          auto comm = group.join(r);
          RankModel rank(plan, r, comm.get());
          for (int m = 0; m < GAS; ++m)
            micro_step(rank.zero, *rank.model, in[static_cast<size_t>(r)][static_cast<size_t>(m)], tgt[static_cast<size_t>(r)][static_cast<size_t>(m)],
                       scale, /*last=*/m == GAS - 1);
          rank.zero.reduce_gradients();
          const FlatParams& flat = rank.flat;
          std::lock_guard<std::mutex> lock(mu);
          ASSERT_EQ(flat.local_grads.scalar_type(), torch::kFloat32);
          for (const OwnedSegment& s : flat.owned)
            assembled.narrow(0, s.global, s.numel).copy_(flat.local_grads.narrow(0, s.local, s.numel));
        });
        const torch::Tensor& expected = stage <= 1 ? summed : per_micro_rounded;
        EXPECT_TRUE(torch::allclose(assembled, expected, 1e-5, 1e-8)) << "max difference " << (assembled - expected).abs().max().item<double>();
      }
  }
}

TEST(ZeroInProcess, GradientsCrossRanksInCommunicationDataTypeAndComeBackInTheirOwn) {
  // communication_data_type bf16 over fp32 gradients: each rank's piece is cast to bf16, reduced, and this rank's
  // sums cast back into its fp32 gradients. The reference takes each rank's gradient alone on one rank and does
  // the same sums by hand: over Gloo's terms the bf16 values add in fp32 and round once (the all-reduce in rank
  // order; the point-to-point reduce-scatter this rank's own first, then the others'); over NCCL's, in bf16,
  // rank after rank, each add rounded.
  const int64_t T = 16;
  const int world = 3;
  std::vector<torch::Tensor> in, tgt;
  torch::manual_seed(17);
  for (int r = 0; r < world; ++r) {
    in.push_back(torch::cat({tokens(2 * r, T), tokens(2 * r + 1, T)}));
    tgt.push_back(torch::cat({tokens(2 * r + 5, T), tokens(2 * r + 6, T)}));
  }
  const Plan one = plan_for(1, 0, {"zero_optimization.stage=0"});
  const int64_t P = one.layout.numel;
  std::vector<torch::Tensor> sent;  // each rank's gradient as it crosses: rounded to bf16
  torch::Tensor magnitude = torch::zeros({P}, torch::kFloat32), exact = torch::zeros({P}, torch::kFloat32);
  for (int r = 0; r < world; ++r) {
    RankModel alone(one, 0, nullptr);
    micro_step(alone.zero, *alone.model, in[static_cast<size_t>(r)], tgt[static_cast<size_t>(r)], 1.0 / world);
    const torch::Tensor g = alone.flat.grads.narrow(0, 0, P);
    ASSERT_EQ(g.scalar_type(), torch::kFloat32);
    magnitude.add_(g.abs());
    exact.add_(g);
    sent.push_back(g.to(torch::kBFloat16));
  }
  const auto in_rank_order_fp32 = [&](int first) {  // `first`'s own, then the others in rank order
    torch::Tensor s = sent[static_cast<size_t>(first)].to(torch::kFloat32);
    for (int q = 0; q < world; ++q)
      if (q != first) s.add_(sent[static_cast<size_t>(q)].to(torch::kFloat32));
    return s.to(torch::kBFloat16).to(torch::kFloat32);
  };
  torch::Tensor in_bf16 = sent[0].clone();
  for (int q = 1; q < world; ++q) in_bf16.add_(sent[static_cast<size_t>(q)]);
  in_bf16 = in_bf16.to(torch::kFloat32);

  for (const CommBackend library : {CommBackend::gloo, CommBackend::nccl})
    for (int stage : {0, 1, 2, 3})
      for (const char* overlap : {"zero_optimization.overlap_comm=false", "zero_optimization.overlap_comm=true"}) {
        SCOPED_TRACE("stage " + std::to_string(stage) + " speaking " + comm_backend_name(library) + ", " + overlap);
        LocalGroup group(world, std::chrono::seconds(60), library);
        std::vector<Plan> plans;
        for (int r = 0; r < world; ++r)
          plans.push_back(plan_speaking(library, world, r,
                                        {"communication_data_type=bf16", "zero_optimization.stage=" + std::to_string(stage), overlap}));
        ASSERT_EQ(plans[0].execution.wire_dtype, Dtype::bf16);
        ASSERT_EQ(plans[0].execution.reduced_dtype, Dtype::fp32);
        torch::Tensor assembled = torch::zeros({P}, torch::kFloat32), owner = torch::full({P}, -1, torch::kLong);
        std::vector<double> gradient_bytes(static_cast<size_t>(world), 0);
        std::mutex mu;
        on_ranks(world, [&](int r) {
          const Plan& plan = plans[static_cast<size_t>(r)];
          auto comm = group.join(r);
          RankModel rank(plan, r, comm.get());
          micro_step(rank.zero, *rank.model, in[static_cast<size_t>(r)], tgt[static_cast<size_t>(r)], 1.0 / world);
          rank.zero.reduce_gradients();
          std::lock_guard<std::mutex> lock(mu);
          const FlatParams& flat = rank.flat;
          ASSERT_EQ(flat.local_grads.scalar_type(), torch::kFloat32);
          for (const OwnedSegment& s : flat.owned) {
            assembled.narrow(0, s.global, s.numel).copy_(flat.local_grads.narrow(0, s.local, s.numel));
            owner.narrow(0, s.global, s.numel).fill_(r);
          }
          gradient_bytes[static_cast<size_t>(r)] = comm->ledger().at(CollectiveKind::gradients).bytes;
        });
        // What each element's owner summed, by hand.
        torch::Tensor expected = in_bf16;
        if (library == CommBackend::gloo) {
          const bool scattered = plans[0].execution.scatter;
          expected = in_rank_order_fp32(0);
          for (int r = 1; scattered && r < world; ++r) expected = torch::where(owner == r, in_rank_order_fp32(r), expected);
        }
        EXPECT_GE(owner.min().item<int64_t>(), 0);  // every element has an owner
        EXPECT_TRUE(torch::equal(assembled, expected)) << "max difference " << (assembled - expected).abs().max().item<double>();
        // The sums came back bf16-rounded, near the fp32 sum (five roundings at most, each 2^-9 of the magnitudes).
        EXPECT_TRUE(torch::equal(assembled, assembled.to(torch::kBFloat16).to(torch::kFloat32)));
        EXPECT_TRUE(((assembled - exact).abs() <= magnitude * std::ldexp(1.0, -6)).all().item<bool>());
        // The ledger counts bf16 bytes, as the plan does.
        for (const Collective& c : plans[0].execution.collectives)
          if (c.kind == CollectiveKind::gradients) {
            EXPECT_EQ(c.dtype_bytes, library == CommBackend::gloo && !plans[0].execution.scatter ? 4 : 2);
            for (int r = 0; r < world; ++r) EXPECT_DOUBLE_EQ(gradient_bytes[static_cast<size_t>(r)], c.wire_bytes_per_rank_per_step) << "rank " << r;
          }
      }
}

namespace {

// Trains on `world` thread ranks (one rank: no communicator); every rank's result, rank 0 first.
std::vector<TrainResult> train_ranks(int world, const std::vector<std::string>& overrides, const std::string& resume_from = "") {
  std::vector<TrainResult> results(static_cast<size_t>(world));
  LocalGroup group(world);
  on_ranks(world, [&](int r) {
    const Plan plan = plan_for(world, r, overrides);
    TrainOptions opt;
    opt.print_every = 1000;
    opt.resume_from = resume_from;
    auto comm = world > 1 ? group.join(r) : nullptr;
    results[static_cast<size_t>(r)] = train(plan, opt, comm.get());
  });
  return results;
}

TrainResult train_on(int world, const std::vector<std::string>& overrides, const std::string& resume_from = "") {
  return train_ranks(world, overrides, resume_from)[0];
}

}  // namespace

// Stages 1-2 with overlap_comm leave the updated parameters' pieces in flight after the optimizer: the next forward
// waits for each only when it reaches the parameters it holds (the embeddings before the first block, then block by
// block, the rest after the last), so the gather runs beside the forward. The pieces are cut at the blocks' boundaries
// (a block's wait covers its own parameters only, whatever allgather_bucket_size is). Without overlap_comm, or at
// stage 3, they are waited for at once.
TEST(ZeroInProcess, StagesOneAndTwoWaitForEachPieceOfTheUpdatedParametersOnlyWhenTheForwardReachesIt) {
  for (const int64_t bucket : {int64_t{1000}, int64_t{1} << 40})
    for (int stage : {0, 1, 2, 3})
      for (const bool overlap : {true, false}) {
        SCOPED_TRACE("stage " + std::to_string(stage) + (overlap ? ", overlap_comm" : "") + ", bucket " + std::to_string(bucket));
        const std::vector<std::string> o{"zero_optimization.stage=" + std::to_string(stage),
                                         "zero_optimization.allgather_bucket_size=" + std::to_string(bucket),
                                         std::string("zero_optimization.overlap_comm=") + (overlap ? "true" : "false")};
        const Plan plan = plan_for(2, 0, o);
        const bool ahead = overlap && (stage == 1 || stage == 2);
        EXPECT_EQ(plan.execution.gather_ahead, ahead);
        if (!ahead) {
          LocalGroup group(2);
          on_ranks(2, [&](int r) {
            auto comm = group.join(r);
            RankModel rank(plan_for(2, r, o), r, comm.get());
            EXPECT_EQ(rank.zero.published_in_flight(), 0u);
          });
          continue;
        }
        // Each block's first and last element in the flat buffer (the layout's own order), and from them the pieces'
        // starts: at most `bucket` apart, a new one at the first block's start and after each block's end.
        const FlatLayout& L = plan.layout;
        const int64_t layers = plan.model.hp.num_layers;
        std::vector<int64_t> block_begin(static_cast<size_t>(layers), L.padded_numel), block_end(static_cast<size_t>(layers), 0);
        for (const ParamSlot& p : L.params)
          if (p.layer >= 0) {
            const auto l = static_cast<size_t>(p.layer);
            block_begin[l] = std::min(block_begin[l], p.offset);
            block_end[l] = std::max(block_end[l], p.offset + p.numel);
          }
        std::vector<int64_t> segment_starts{0};
        for (int64_t l = 0; l < layers; ++l) segment_starts.push_back(block_begin[static_cast<size_t>(l)]);
        segment_starts.push_back(block_end.back());
        segment_starts.push_back(L.padded_numel);
        std::vector<int64_t> starts;
        for (size_t k = 0; k + 1 < segment_starts.size(); ++k)
          for (int64_t at = segment_starts[k]; at < segment_starts[k + 1]; at += bucket) starts.push_back(at);
        const auto pieces_from = [&](int64_t at) { return static_cast<size_t>(std::count_if(starts.begin(), starts.end(), [&](int64_t s) { return s >= at; })); };
        const size_t all = starts.size();
        ASSERT_GT(block_begin[0], 0);  // (the embeddings come first)
        ASSERT_LT(block_end.back(), L.padded_numel);  // (the final norm after the last block)
        if (bucket > L.padded_numel) {
          EXPECT_EQ(all, static_cast<size_t>(layers + 2));  // the embeddings, each block, the rest
        }
        EXPECT_EQ(plan.execution.collectives.back().calls_per_step, static_cast<int64_t>(all));
        LocalGroup group(2);
        on_ranks(2, [&](int r) {
          auto comm = group.join(r);
          RankModel rank(plan_for(2, r, o), r, comm.get());
          ZeroExchange& zero = rank.zero;
          EXPECT_EQ(zero.published_in_flight(), all);  // the starting weights' gather too
          zero.begin_micro_step(false);
          EXPECT_EQ(zero.published_in_flight(), pieces_from(block_begin[0]));  // those the embeddings need, waited for
          for (int64_t l = 0; l < layers; ++l) {
            zero.before_forward(l);
            EXPECT_EQ(zero.published_in_flight(), pieces_from(block_end[static_cast<size_t>(l)])) << "block " << l;
            zero.after_forward(l);
          }
          EXPECT_EQ(zero.published_in_flight(), 0u);  // the final norm and the head read the rest
          zero.publish_parameters();
          EXPECT_EQ(zero.published_in_flight(), all);
          zero.finish_published();  // (a checkpoint, a validation)
          EXPECT_EQ(zero.published_in_flight(), 0u);
          zero.publish_parameters();
          zero.begin_backward(true);  // a forward that never reached them (none does): the backward waits for the rest
          EXPECT_EQ(zero.published_in_flight(), 0u);
        });
      }
}

TEST(ZeroInProcess, EveryStageOnThreadRanksTrainsTheSingleRankRun) {
  const fs::path root = fs::temp_directory_path() / ("ds_zero_local_" + std::to_string(::getpid()));
  auto run = [&](int world, int stage) {
    const std::string dir = (root / ("w" + std::to_string(world) + "_s" + std::to_string(stage))).string();
    fs::remove_all(dir);
    // The same global batch of 4 samples: 2 per rank on 2 ranks, 4 on one.
    const std::vector<std::string> o{"zero_optimization.stage=" + std::to_string(stage),
                                     "train_micro_batch_size_per_gpu=" + std::to_string(4 / world), "train.output_dir=" + dir};
    return train_ranks(world, o);
  };
  const std::vector<double> base = run(1, 0)[0].losses;
  ASSERT_EQ(base.size(), 6u);
  for (int stage : {0, 1, 2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const auto results = run(2, stage);
    for (const TrainResult& r : results) {
      ASSERT_EQ(r.losses.size(), base.size());
      for (size_t i = 0; i < base.size(); ++i) EXPECT_NEAR(r.losses[i], base[i], 1e-5 * base[i]) << "step " << i + 1;
    }
    EXPECT_EQ(results[0].losses, results[1].losses);  // every rank agrees on the mean loss
    EXPECT_FALSE(results[0].last_checkpoint.empty());
  }
  fs::remove_all(root);
}

// ZeRO as it runs over NCCL (the plan's choices for that library: the library's own reduce-scatter without a
// receive scratch, gathers packed into equal pieces, 16-bit gradients summed in their dtype), on thread ranks:
// every stage trains the single-rank run, fp32 to 1e-5 and bf16 to bf16's precision (NCCL sums bf16 in bf16).
TEST(ZeroInProcess, EveryStageSpeakingNcclsTermsTrainsTheSingleRankRun) {
  const fs::path root = fs::temp_directory_path() / ("ds_zero_nccl_terms_" + std::to_string(::getpid()));
  for (const char* precision : {"bf16.enabled=false", "bf16.enabled=true"}) {
    const auto run = [&](int world, int stage, CommBackend library) {
      std::vector<TrainResult> results(static_cast<size_t>(world));
      const std::string dir = (root / (std::to_string(world) + "_" + std::to_string(stage))).string();
      fs::remove_all(dir);
      LocalGroup group(world, std::chrono::seconds(60), library);
      on_ranks(world, [&](int r) {
        const Plan plan = plan_speaking(library, world, r,
                                        {precision, "zero_optimization.stage=" + std::to_string(stage),
                                         "train_micro_batch_size_per_gpu=" + std::to_string(4 / world), "train.output_dir=" + dir});
        TrainOptions opt;
        opt.print_every = 1000;
        auto comm = world > 1 ? group.join(r) : nullptr;
        results[static_cast<size_t>(r)] = train(plan, opt, comm.get());
      });
      return results;
    };
    const std::vector<double> base = run(1, 0, CommBackend::nccl)[0].losses;
    ASSERT_EQ(base.size(), 6u);
    const double tolerance = std::string(precision) == "bf16.enabled=true" ? 1e-2 : 1e-5;
    for (int stage : {1, 2, 3}) {
      SCOPED_TRACE(std::string(precision) + ", stage " + std::to_string(stage));
      const auto results = run(2, stage, CommBackend::nccl);
      for (const TrainResult& r : results) {
        ASSERT_EQ(r.losses.size(), base.size());
        for (size_t i = 0; i < base.size(); ++i) EXPECT_NEAR(r.losses[i], base[i], tolerance * base[i]) << "step " << i + 1;
      }
    }
  }
  fs::remove_all(root);
}

namespace {

std::vector<nlohmann::json> metrics_in(const std::string& dir) {
  std::vector<nlohmann::json> out;
  std::ifstream f(dir + "/metrics.jsonl");
  for (std::string line; std::getline(f, line);)
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

}  // namespace

TEST(OptimizerOffload, ChangesWhereStatesLiveNeverTheNumbers) {
  // Stages 1-3 x fp32 / bf16 / fp16 x 1 and 2 ranks: the same losses, bit for bit, with the optimizer's
  // states in host buffers; the bytes moved per step are the plan's.
  const fs::path root = fs::temp_directory_path() / ("ds_offload_" + std::to_string(::getpid()));
  for (int world : {1, 2})
    for (int stage : {1, 2, 3}) {
      for (const char* precision : {"bf16.enabled=false", "bf16.enabled=true", "fp16.enabled=true"}) {
        SCOPED_TRACE(std::string(precision) + " stage " + std::to_string(stage) + " on " + std::to_string(world));
        const std::string tag = std::to_string(world) + "_" + std::to_string(stage) + "_" + precision;
        const std::vector<std::string> base{precision, "zero_optimization.stage=" + std::to_string(stage),
                                            "train_micro_batch_size_per_gpu=" + std::to_string(4 / world)};
        auto with = [&](std::vector<std::string> o, const std::string& name) {
          o.push_back("train.output_dir=" + (root / (tag + name)).string());
          return o;
        };
        const TrainResult plain = train_on(world, with(base, "plain"));
        std::vector<std::string> off = with(base, "offload");
        off.push_back("zero_optimization.offload_optimizer.device=cpu");
        const TrainResult offloaded = train_on(world, off);
        EXPECT_EQ(plain.losses, offloaded.losses);
        const Plan plan = plan_for(world, 0, off);
        ASSERT_EQ(plan.execution.transfers.size(), 2u);
        const double planned = plan.execution.transfers[0].bytes_per_step + plan.execution.transfers[1].bytes_per_step;
        for (const auto& m : metrics_in((root / (tag + "offload")).string())) {
          if (m["skipped"].get<bool>()) continue;
          EXPECT_DOUBLE_EQ(m["offload_bytes"].get<double>(), planned) << "step " << m["step"];
        }
      }
    }
  // A checkpoint saved with offload resumes without it (and the run continues as if never offloaded).
  const std::vector<std::string> base{"bf16.enabled=true", "zero_optimization.stage=2", "train_micro_batch_size_per_gpu=2"};
  std::vector<std::string> straight = base, first = base, second = base;
  straight.push_back("train.output_dir=" + (root / "straight").string());
  const TrainResult whole = train_on(2, straight);
  first.insert(first.end(), {"train.steps=3", "zero_optimization.offload_optimizer.device=cpu", "train.output_dir=" + (root / "split").string()});
  const TrainResult a = train_on(2, first);
  ASSERT_FALSE(a.last_checkpoint.empty());
  second.push_back("train.output_dir=" + (root / "split").string());
  const TrainResult b = train_on(2, second, a.last_checkpoint);
  std::vector<double> joined = a.losses;
  joined.insert(joined.end(), b.losses.begin(), b.losses.end());
  EXPECT_EQ(joined, whole.losses);
  fs::remove_all(root);
}

TEST(OptimizerOffload, NvmeSwapsChangeWhereStatesLiveNeverTheNumbers) {
  // Stages 1-3 x fp32 / bf16 / fp16 x 1 and 2 ranks, the states swapped to files in small sub-groups
  // (~5,000 elements: a dozen per rank, cut inside tensors), with and without pipelining: the losses of
  // the run without offload, bit for bit; the bytes moved per step are the plan's (gradients, states
  // read and written, weights back); the swap directory is gone when the run ends.
  const fs::path root = fs::temp_directory_path() / ("ds_nvme_" + std::to_string(::getpid()));
  const fs::path nvme = root / "nvme";
  fs::create_directories(nvme);
  bool pipelined = false;
  for (int world : {1, 2})
    for (int stage : {1, 2, 3})
      for (const char* precision : {"bf16.enabled=false", "bf16.enabled=true", "fp16.enabled=true"}) {
        pipelined = !pipelined;
        SCOPED_TRACE(std::string(precision) + " stage " + std::to_string(stage) + " on " + std::to_string(world) +
                     (pipelined ? ", pipelined" : ""));
        const std::string tag = std::to_string(world) + "_" + std::to_string(stage) + "_" + precision;
        const std::vector<std::string> base{precision, "zero_optimization.stage=" + std::to_string(stage),
                                            "train_micro_batch_size_per_gpu=" + std::to_string(4 / world)};
        std::vector<std::string> plain = base, off = base;
        plain.push_back("train.output_dir=" + (root / (tag + "plain")).string());
        off.insert(off.end(), {"train.output_dir=" + (root / (tag + "nvme")).string(), "zero_optimization.offload_optimizer.device=nvme",
                               "zero_optimization.offload_optimizer.nvme_path=" + nvme.string(), "zero_optimization.sub_group_size=5000",
                               "zero_optimization.offload_optimizer.buffer_count=12",
                               std::string("zero_optimization.offload_optimizer.pipeline_read=") + (pipelined ? "true" : "false"),
                               std::string("zero_optimization.offload_optimizer.pipeline_write=") + (pipelined ? "true" : "false")});
        const Plan plan = plan_for(world, 0, off);
        ASSERT_GT(plan.execution.sub_groups.size(), 10u);
        EXPECT_EQ(plan.execution.swap_sets, pipelined ? 3 : 1);
        const TrainResult expected = train_on(world, plain);
        const TrainResult swapped = train_on(world, off);
        EXPECT_EQ(expected.losses, swapped.losses);
        double planned = 0;
        for (const Transfer& t : plan.execution.transfers) planned += t.bytes_per_step;
        ASSERT_EQ(plan.execution.transfers.size(), 4u);
        for (const auto& m : metrics_in((root / (tag + "nvme")).string())) {
          if (m["skipped"].get<bool>()) continue;
          EXPECT_DOUBLE_EQ(m["offload_bytes"].get<double>(), planned) << "step " << m["step"];
        }
        EXPECT_TRUE(fs::is_empty(nvme)) << "a swap directory outlived its run";
      }
  // Checkpoints hold the whole state wherever it lived. Saved after 3 steps on 2 ranks at stage 3 with the
  // states swapped (or in RAM) and resumed the other way: the straight 6-step run, bit for bit. Resumed at
  // another world size and stage (one rank, stage 1), the two checkpoints continue identically, each in
  // the other placement.
  const std::vector<std::string> base{"bf16.enabled=true", "train_micro_batch_size_per_gpu=2"};
  const std::vector<std::string> swap{"zero_optimization.offload_optimizer.device=nvme", "zero_optimization.offload_optimizer.nvme_path=" + nvme.string(),
                                      "zero_optimization.sub_group_size=3000"};
  auto opts = [&](std::vector<std::string> o, const std::vector<std::string>& more) {
    o.insert(o.end(), more.begin(), more.end());
    return o;
  };
  const TrainResult whole = train_on(2, opts(base, {"zero_optimization.stage=3", "train.output_dir=" + (root / "straight").string()}));
  std::vector<std::vector<double>> elsewhere;
  for (const bool first_swapped : {true, false}) {
    SCOPED_TRACE(first_swapped ? "swapped, then in RAM" : "in RAM, then swapped");
    const std::string dir = (root / (first_swapped ? "split_a" : "split_b")).string();
    const std::vector<std::string> stage3 = opts(base, {"zero_optimization.stage=3", "train.output_dir=" + dir});
    const TrainResult a = train_on(2, first_swapped ? opts(opts(stage3, swap), {"train.steps=3"}) : opts(stage3, {"train.steps=3"}));
    ASSERT_FALSE(a.last_checkpoint.empty());
    const TrainResult b = train_on(2, first_swapped ? stage3 : opts(stage3, swap), a.last_checkpoint);
    std::vector<double> joined = a.losses;
    joined.insert(joined.end(), b.losses.begin(), b.losses.end());
    EXPECT_EQ(joined, whole.losses);
    const std::vector<std::string> one{"bf16.enabled=true", "train_micro_batch_size_per_gpu=4", "zero_optimization.stage=1",
                                       "train.output_dir=" + dir + "_one"};
    elsewhere.push_back(train_on(1, first_swapped ? one : opts(one, swap), a.last_checkpoint).losses);
    ASSERT_EQ(elsewhere.back().size(), 3u);
  }
  EXPECT_EQ(elsewhere[0], elsewhere[1]);
  EXPECT_TRUE(fs::is_empty(nvme));
  fs::remove_all(root);
}

TEST(ParameterOffload, CpuPartitionsGatheredFromHostBuffersGiveTheSameRun) {
  // offload_param=cpu at stage 3: the rank's parameter partitions live in host buffers and every block
  // is gathered from there before its forward and again before its backward (one rank too, where
  // stage 3 otherwise keeps the weights whole): the losses of stage 3 without it, in fp32, bf16 and fp16.
  const fs::path root = fs::temp_directory_path() / ("ds_param_offload_" + std::to_string(::getpid()));
  for (int world : {1, 2})
    for (const char* precision : {"bf16.enabled=false", "bf16.enabled=true", "fp16.enabled=true"}) {
      SCOPED_TRACE(std::string(precision) + " on " + std::to_string(world));
      const std::string tag = std::to_string(world) + precision;
      const std::vector<std::string> base{precision, "zero_optimization.stage=3", "train_micro_batch_size_per_gpu=" + std::to_string(4 / world),
                                          "train.eval_every=3", "train.eval_batches=2"};
      std::vector<std::string> plain = base, off = base;
      plain.push_back("train.output_dir=" + (root / (tag + "plain")).string());
      off.insert(off.end(), {"train.output_dir=" + (root / (tag + "off")).string(), "zero_optimization.offload_param.device=cpu"});
      const Plan plan = plan_for(world, 0, off);
      const ZeroBuffer* params = plan.execution.find(BufferRole::params, Place::host);
      ASSERT_NE(params, nullptr);
      EXPECT_TRUE(plan.execution.gathers);
      const TrainResult expected = train_on(world, plain), offloaded = train_on(world, off);
      EXPECT_EQ(expected.losses, offloaded.losses);
      // Validation runs through the gathers as well.
      ASSERT_EQ(offloaded.val_losses.size(), 2u);
      EXPECT_EQ(expected.val_losses, offloaded.val_losses);
    }
  fs::remove_all(root);
}

TEST(ParameterOffload, NvmePartitionsReadForEveryGatherGiveTheSameRun) {
  // offload_param=nvme at stage 3: the rank's partition is a file, read piece by piece for every gather
  // (through small buffers here: a block's partitions take several transfers) and rewritten after each
  // optimizer step, with the optimizer's states in RAM, on the CPU or on NVMe as well: the losses and
  // validation losses of stage 3 without offload, bit for bit; the bytes read and written per step are
  // the plan's; the swap directories are gone when the run ends.
  const fs::path root = fs::temp_directory_path() / ("ds_param_nvme_" + std::to_string(::getpid()));
  const fs::path nvme = root / "nvme";
  fs::create_directories(nvme);
  const char* optimizer_places[] = {"none", "cpu", "nvme"};
  int turn = 0;
  for (int world : {1, 2})
    for (const char* precision : {"bf16.enabled=false", "bf16.enabled=true", "fp16.enabled=true"}) {
      const std::string states = optimizer_places[turn++ % 3];
      SCOPED_TRACE(std::string(precision) + " on " + std::to_string(world) + ", optimizer states: " + states);
      const std::string tag = std::to_string(world) + precision + states;
      const std::vector<std::string> base{precision, "zero_optimization.stage=3", "train_micro_batch_size_per_gpu=" + std::to_string(4 / world),
                                          "train.eval_every=3", "train.eval_batches=2"};
      std::vector<std::string> plain = base, off = base;
      plain.push_back("train.output_dir=" + (root / (tag + "plain")).string());
      off.insert(off.end(), {"train.output_dir=" + (root / (tag + "off")).string(), "zero_optimization.offload_param.device=nvme",
                             "zero_optimization.offload_param.nvme_path=" + nvme.string(), "zero_optimization.offload_param.buffer_size=3000",
                             "zero_optimization.offload_param.buffer_count=" + std::to_string(2 + turn % 2)});
      if (states != "none")
        off.insert(off.end(), {"zero_optimization.offload_optimizer.device=" + states, "zero_optimization.offload_optimizer.nvme_path=" + nvme.string(),
                               "zero_optimization.sub_group_size=5000"});
      const Plan plan = plan_for(world, 0, off);
      ASSERT_NE(plan.execution.find(BufferRole::params, Place::nvme), nullptr);
      ASSERT_NE(plan.execution.find(BufferRole::param_swap, Place::host), nullptr);
      const TrainResult expected = train_on(world, plain), offloaded = train_on(world, off);
      EXPECT_EQ(expected.losses, offloaded.losses);
      ASSERT_EQ(offloaded.val_losses.size(), 2u);
      EXPECT_EQ(expected.val_losses, offloaded.val_losses);
      double planned = 0;
      for (const Transfer& t : plan.execution.transfers) planned += t.bytes_per_step;
      for (const auto& m : metrics_in((root / (tag + "off")).string())) {
        if (m["skipped"].get<bool>()) continue;
        EXPECT_DOUBLE_EQ(m["offload_bytes"].get<double>(), planned) << "step " << m["step"];
      }
      EXPECT_TRUE(fs::is_empty(nvme)) << "a swap directory outlived its run";
    }
  fs::remove_all(root);
}

TEST(OptimizerOffload, ThePlanPlacesTheStatesInSpansAndTheWalkVisitsEachElementOnceWhereItLives) {
  // Every placement the plan can choose: the states on the device, all on the host or NVMe, a ratio's part
  // there and the rest on the device. The spans tile the rank's part in order (the offloaded first, its size
  // the plan's offloaded_numel); the walk hands every local element over exactly once, in order, in its
  // span's memory (NVMe's through host buffers, one sub-group at a time), and what a writing walk stores a
  // reading walk reads back (through the files on NVMe).
  const fs::path root = fs::temp_directory_path() / ("ds_spans_" + std::to_string(::getpid()));
  fs::create_directories(root);
  struct Case {
    const char* device;
    double ratio;
    std::vector<Place> places;
  };
  for (const Case& c : {Case{"none", 1, {Place::device}}, Case{"cpu", 1, {Place::host}}, Case{"cpu", 0.4, {Place::host, Place::device}},
                        Case{"nvme", 1, {Place::nvme}}, Case{"nvme", 0.4, {Place::nvme, Place::device}}})
    for (int rank : {0, 1}) {
      SCOPED_TRACE(std::string(c.device) + " ratio " + std::to_string(c.ratio) + ", rank " + std::to_string(rank));
      std::vector<std::string> overrides{"bf16.enabled=true", "zero_optimization.stage=3", "zero_optimization.sub_group_size=3000"};
      if (std::string(c.device) != "none")
        overrides.insert(overrides.end(), {std::string("zero_optimization.offload_optimizer.device=") + c.device,
                                           "zero_optimization.offload_optimizer.nvme_path=" + root.string(),
                                           "zero_optimization.offload_optimizer.ratio=" + std::to_string(c.ratio)});
      const Plan plan = plan_for(2, rank, overrides);
      const ZeroExecution& z = plan.execution;
      ASSERT_EQ(z.state_spans.size(), c.places.size());
      int64_t at = 0;
      for (size_t i = 0; i < z.state_spans.size(); ++i) {
        EXPECT_EQ(z.state_spans[i].place, c.places[i]);
        EXPECT_EQ(z.state_spans[i].begin, at);
        at = z.state_spans[i].end;
      }
      EXPECT_EQ(at, z.local_numel);
      const nlohmann::json spans = nlohmann::json::parse(plan_to_json(plan))["zero_execution"]["optimizer_state_spans"];
      ASSERT_EQ(spans.size(), c.places.size());
      EXPECT_EQ(spans.back()["end"], z.local_numel);
      EXPECT_EQ(spans[0]["place"], place_name(c.places[0]));
      if (c.places[0] != Place::device) {
        EXPECT_EQ(z.state_spans[0].numel(), z.offloaded_numel);
      }
      auto device = Device::create(DeviceKind::cpu, 0);
      FlatParams flat = FlatParams::allocate(plan, rank, *device);
      std::unique_ptr<OptimizerSwapper> swapper;
      if (std::string(c.device) == "nvme") swapper = std::make_unique<OptimizerSwapper>(plan, rank, 1 + plan.optimizer.moments);
      const OptimizerStates states(flat, swapper.get());
      int64_t next = 0, chunks = 0;
      states.for_each([&](const StateChunk& k) {  // write: each element's master its local index, exp_avg_sq minus it
        EXPECT_EQ(k.begin, next);
        next += k.numel;
        ++chunks;
        const StateSpan& span = z.state_spans[k.span];
        EXPECT_TRUE(k.begin >= span.begin && k.begin + k.numel <= span.end);
        EXPECT_EQ(k.at, memory_of(span));
        ASSERT_TRUE(k.master.defined() && k.exp_avg.defined() && k.exp_avg_sq.defined());
        EXPECT_EQ(k.master.numel(), k.numel);
        if (span.place != Place::nvme) {
          EXPECT_EQ(k.master.data_ptr(), flat.states[k.span].master.data_ptr());
        }
        const torch::Tensor index = torch::arange(k.begin, k.begin + k.numel, torch::kFloat32);
        k.master.copy_(index);
        k.exp_avg_sq.copy_(-index);
      });
      EXPECT_EQ(next, z.local_numel);
      int64_t expected_chunks = 0;
      for (const Place p : c.places) expected_chunks += p == Place::nvme ? static_cast<int64_t>(z.sub_groups.size()) : 1;
      if (c.places[0] == Place::nvme) {
        EXPECT_GT(z.sub_groups.size(), 2u);
      }
      EXPECT_EQ(chunks, expected_chunks);
      int64_t wrong = 0;
      states.for_each(
          [&](const StateChunk& k) {
            const torch::Tensor index = torch::arange(k.begin, k.begin + k.numel, torch::kFloat32);
            wrong += (k.master != index).sum().item<int64_t>() + (k.exp_avg_sq != -index).sum().item<int64_t>();
          },
          /*read=*/true, /*write=*/false);
      EXPECT_EQ(wrong, 0);
    }
  fs::remove_all(root);
}

TEST(OptimizerOffload, PartialOffloadSplitsTheStatesNeverTheNumbers) {
  // offload_optimizer.ratio < 1 at stage 3: the first part of each rank's states (cut on a kernel's grain) is
  // offloaded to the CPU or NVMe, the rest stays: the losses of stage 3 without offload, bit for bit, at
  // every precision on 1 and 2 ranks (with the parameters on NVMe too, once); the bytes moved per step are
  // the plan's. A checkpoint saved with half the states offloaded resumes without offload, and the other way
  // round, as the straight run.
  const fs::path root = fs::temp_directory_path() / ("ds_partial_" + std::to_string(::getpid()));
  const fs::path nvme = root / "nvme";
  fs::create_directories(nvme);
  int turn = 0;
  for (int world : {1, 2})
    for (const char* precision : {"bf16.enabled=false", "bf16.enabled=true", "fp16.enabled=true"}) {
      const std::string device = turn % 2 ? "nvme" : "cpu";
      const bool params_on_nvme = turn == 4;
      ++turn;
      SCOPED_TRACE(std::string(precision) + " on " + std::to_string(world) + ", " + device + (params_on_nvme ? ", parameters on NVMe" : ""));
      const std::string tag = std::to_string(world) + precision + device;
      const std::vector<std::string> base{precision, "zero_optimization.stage=3", "train_micro_batch_size_per_gpu=" + std::to_string(4 / world)};
      std::vector<std::string> plain = base, off = base;
      plain.push_back("train.output_dir=" + (root / (tag + "plain")).string());
      off.insert(off.end(), {"train.output_dir=" + (root / (tag + "off")).string(), "zero_optimization.offload_optimizer.device=" + device,
                             "zero_optimization.offload_optimizer.nvme_path=" + nvme.string(), "zero_optimization.offload_optimizer.ratio=0.4",
                             "zero_optimization.sub_group_size=7000"});
      if (params_on_nvme)
        off.insert(off.end(), {"zero_optimization.offload_param.device=nvme", "zero_optimization.offload_param.nvme_path=" + nvme.string()});
      const Plan plan = plan_for(world, 0, off);
      const ZeroExecution& z = plan.execution;
      EXPECT_GT(z.offloaded_numel, 0);
      EXPECT_LT(z.offloaded_numel, z.local_numel);
      const TrainResult expected = train_on(world, plain), offloaded = train_on(world, off);
      EXPECT_EQ(expected.losses, offloaded.losses);
      double planned = 0;
      for (const Transfer& t : z.transfers) planned += t.bytes_per_step;
      for (const auto& m : metrics_in((root / (tag + "off")).string())) {
        if (m["skipped"].get<bool>()) continue;
        EXPECT_DOUBLE_EQ(m["offload_bytes"].get<double>(), planned) << "step " << m["step"];
      }
      EXPECT_TRUE(fs::is_empty(nvme));
    }
  for (const char* device : {"cpu", "nvme"}) {
    SCOPED_TRACE(std::string("checkpoint across placements, ") + device);
    const std::vector<std::string> base{"fp16.enabled=true", "zero_optimization.stage=3", "train_micro_batch_size_per_gpu=2"};
    auto with = [&](std::vector<std::string> o, const std::vector<std::string>& more) {
      o.insert(o.end(), more.begin(), more.end());
      return o;
    };
    const std::string dir = (root / (std::string("split_") + device)).string();
    const std::vector<std::string> partial{std::string("zero_optimization.offload_optimizer.device=") + device,
                                           "zero_optimization.offload_optimizer.nvme_path=" + nvme.string(),
                                           "zero_optimization.offload_optimizer.ratio=0.5"};
    const TrainResult whole = train_on(2, with(base, {"train.output_dir=" + dir + "_straight"}));
    for (const bool first_partial : {true, false}) {
      const std::string d = dir + (first_partial ? "_a" : "_b");
      const TrainResult a = train_on(2, with(with(base, {"train.steps=3", "train.output_dir=" + d}), first_partial ? partial : std::vector<std::string>{}));
      ASSERT_FALSE(a.last_checkpoint.empty());
      const TrainResult b = train_on(2, with(with(base, {"train.output_dir=" + d}), first_partial ? std::vector<std::string>{} : partial), a.last_checkpoint);
      std::vector<double> joined = a.losses;
      joined.insert(joined.end(), b.losses.begin(), b.losses.end());
      EXPECT_EQ(joined, whole.losses) << (first_partial ? "saved partially offloaded" : "resumed partially offloaded");
    }
  }
  fs::remove_all(root);
}

namespace {

// Rank `rank` of `world` Gloo ranks meeting on this host at `port`.
std::unique_ptr<Communicator> gloo_rank(int rank, int world, int port) {
  Topology t;
  t.world_size = world;
  t.rank = rank;
  t.master_addr = "127.0.0.1";
  t.master_port = port;
  return Communicator::create(CommBackend::gloo, t, std::chrono::seconds(60));
}

}  // namespace

// The all-gather and the reduce-scatter ZeRO issues, by spans, on three ranks, over shared memory and over
// Gloo's point-to-point sends: uneven spans, an empty one, fp32 and bf16, against sums done here.
TEST(Communicator, AllGatherAndReduceScatterBySpansOnLocalAndGlooRanks) {
  constexpr int W = 3;
  constexpr int64_t N = 37;
  const Ownership owners{{{0, 5}, {20, 3}}, {{5, 0}, {5, 10}, {30, 7}}, {{15, 5}, {23, 7}}};
  std::vector<int> owner_of(N, -1);
  for (int q = 0; q < W; ++q)
    for (const Span& s : owners[static_cast<size_t>(q)])
      for (int64_t i = s.offset; i < s.offset + s.numel; ++i) owner_of[static_cast<size_t>(i)] = q;
  // Rank r's contribution to element i; element 33 (rank 1's) sums 256 + 1 + 1, which bf16 gets right only
  // by accumulating in fp32 and rounding once.
  const auto contribution = [](int r, int64_t i) { return i == 33 ? (r == 0 ? 256.0 : 1.0) : static_cast<double>((r + 1) * (i % 7) - r); };
  LocalGroup local(W);
  const int port = test::free_port();
  for (const bool gloo : {false, true}) {
    on_ranks(W, [&](int rank) {
      std::unique_ptr<Communicator> comm;
      if (gloo) {
        comm = gloo_rank(rank, W, port);
      } else {
        comm = local.join(rank);
      }
      for (const auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {  // fp16: communication_data_type's
        const std::string what = std::string(gloo ? "Gloo " : "local ") + c10::toString(dtype) + " rank " + std::to_string(rank);
        // All-gather: this rank's spans hold 100 q + i, the rest -1 until the others' arrive.
        torch::Tensor t = torch::full({N}, -1.0, dtype);
        for (const Span& s : owners[static_cast<size_t>(rank)])
          for (int64_t i = s.offset; i < s.offset + s.numel; ++i) t[i] = 100.0 * rank + static_cast<double>(i);
        comm->all_gather_async(t, owners, CollectiveKind::updated_parameters)->wait();
        for (int64_t i = 0; i < N; ++i) EXPECT_EQ(t[i].item<double>(), 100.0 * owner_of[static_cast<size_t>(i)] + static_cast<double>(i)) << what << " element " << i;
        // Reduce-scatter: this rank's spans end as the sum over ranks; its other elements stay its own.
        torch::Tensor c = torch::empty({N}, dtype);
        for (int64_t i = 0; i < N; ++i) c[i] = contribution(rank, i);
        const torch::Tensor scratch = torch::full({(W - 1) * span_elements(owners[static_cast<size_t>(rank)])}, -7.0, dtype);
        comm->reduce_scatter_sum_async(c, owners, scratch, CollectiveKind::gradients)->wait();
        for (int64_t i = 0; i < N; ++i) {
          double expect = contribution(rank, i);
          if (owner_of[static_cast<size_t>(i)] == rank) expect = contribution(0, i) + contribution(1, i) + contribution(2, i);
          EXPECT_EQ(c[i].item<double>(), expect) << what << " element " << i;
        }
      }
      // The ledger: a ring's wire bytes for each payload (all 37 elements), fp32, bf16 then fp16.
      const double share = static_cast<double>(W - 1) / W;
      EXPECT_DOUBLE_EQ(comm->ledger().at(CollectiveKind::updated_parameters).bytes, N * (4 + 2 + 2) * share);
      EXPECT_EQ(comm->ledger().at(CollectiveKind::gradients).op, "reduce_scatter");
      EXPECT_DOUBLE_EQ(comm->ledger().at(CollectiveKind::gradients).bytes, N * (4 + 2 + 2) * share);
    });
  }
}

// The mesh's groups as sub-communicators of the world's: 8 ranks over Gloo as data x tensor x pipeline = 2 x 2 x 2
// in the plan's layout (mesh_groups). Each rank joins its tensor, data and pipeline group; an all-reduce in each sums
// over that group's ranks only, an all-gather fills the group's spans, each group's ledger counts its own bytes (a
// ring's, computed here) and the world's none; a name meets once. The same over thread ranks (LocalGroup), and a
// message sent inside a group reaches its member.
TEST(Communicator, TheMeshsGroupsAreSubCommunicatorsOfTheWorldsOverGlooAndOnThreadRanks) {
  const MeshShape mesh{2, 2, 2};
  const int W = mesh.world();
  const int port = test::free_port();
  LocalGroup threads(W);
  for (const bool over_gloo : {true, false}) {
    on_ranks(W, [&](int rank) {
      const std::unique_ptr<Communicator> world = over_gloo ? gloo_rank(rank, W, port) : threads.join(rank);
      for (const MeshAxis axis : {MeshAxis::tensor, MeshAxis::data, MeshAxis::pipeline}) {
        const std::vector<std::vector<int>> groups = mesh_groups(mesh, axis);
        size_t index = 0;
        while (index < groups.size() && std::find(groups[index].begin(), groups[index].end(), rank) == groups[index].end()) ++index;
        ASSERT_LT(index, groups.size()) << "rank " << rank << " is in no " << mesh_axis_name(axis) << " group";
        const std::vector<int>& members = groups[index];
        const std::string name = std::string(mesh_axis_name(axis)) + "-" + std::to_string(index);
        const std::string what = "rank " + std::to_string(rank) + " in " + name;
        const std::unique_ptr<Communicator> group = world->split(name, members);
        const int n = static_cast<int>(members.size());
        ASSERT_EQ(group->world_size(), n) << what;
        EXPECT_EQ(members[static_cast<size_t>(group->rank())], rank) << what;
        torch::Tensor x = torch::full({5}, static_cast<double>(rank + 1), torch::kFloat32);
        group->all_reduce_sum(x, CollectiveKind::gradients);
        double want = 0;
        for (const int m : members) want += m + 1;
        EXPECT_EQ(x[4].item<double>(), want) << what;
        Ownership owners(static_cast<size_t>(n));
        for (int k = 0; k < n; ++k) owners[static_cast<size_t>(k)] = {{k, 1}};
        torch::Tensor g = torch::full({n}, -1.0, torch::kFloat32);
        g[group->rank()] = 10.0 * rank;
        group->all_gather_async(g, owners, CollectiveKind::updated_parameters)->wait();
        for (int k = 0; k < n; ++k) EXPECT_EQ(g[k].item<double>(), 10.0 * members[static_cast<size_t>(k)]) << what << " element " << k;
        // A ring all-reduce sends 2 (n - 1) / n of its 20 bytes from each rank.
        EXPECT_DOUBLE_EQ(group->ledger().at(CollectiveKind::gradients).bytes, 2.0 * (n - 1) / n * 20.0) << what;
        EXPECT_EQ(world->ledger().count(CollectiveKind::gradients), 0u) << what;
        // Point to point inside the group: its rank 0 sends its members' world ranks to its last.
        torch::Tensor m = torch::zeros({n}, torch::kInt32);
        if (group->rank() == 0) {
          for (int k = 0; k < n; ++k) m[k] = members[static_cast<size_t>(k)];
          group->send_async(m, n - 1, CollectiveKind::pipeline_activations)->wait();
        } else if (group->rank() == n - 1) {
          group->recv(m, 0, CollectiveKind::pipeline_activations);
          for (int k = 0; k < n; ++k) EXPECT_EQ(m[k].item<int>(), members[static_cast<size_t>(k)]) << what << " element " << k;
        }
        // The rendezvous keys stay in the store: a name meets once.
        EXPECT_ANY_THROW(world->split(name, members)) << what;
      }
      world->barrier();
    });
  }
}

// Megatron's MLP split over a tensor group of 2 Gloo ranks: the first matrix by its outputs (column-parallel), the
// second by its inputs (row-parallel), entered and left through the tensor-parallel operators. The output, the
// input's gradient and each rank's slices of the weights' gradients equal the whole MLP's on one rank, and the
// group sent one all-reduce of the activations forward and one of their gradient backward, a ring's bytes each.
TEST(TensorParallel, AColumnThenRowParallelMlpOnTwoRanksIsTheWholeMlp) {
  constexpr int W = 2;
  constexpr int64_t B = 3, T = 4, C = 8, H = 32, part = H / W;
  const int port = test::free_port();
  on_ranks(W, [&](int rank) {
    const std::unique_ptr<Communicator> world = gloo_rank(rank, W, port);
    const std::unique_ptr<Communicator> group = world->split("tensor-0", {0, 1});
    // The same values on every rank: a generator of each rank's own (the global one is shared by the threads).
    at::Generator gen = at::detail::createCPUGenerator(7);
    const auto draw = [&](at::IntArrayRef shape) { return torch::randn(shape, gen); };
    const torch::Tensor x0 = draw({B, T, C}), w1 = draw({C, H}) * 0.3, b1 = draw({H}), w2 = draw({H, C}) * 0.3, b2 = draw({C}),
                        r = draw({B, T, C});
    const auto leaf = [](const torch::Tensor& v) { return v.clone().requires_grad_(true); };
    // The whole MLP, here alone.
    const torch::Tensor xw = leaf(x0), w1w = leaf(w1), w2w = leaf(w2), b2w = leaf(b2);
    const torch::Tensor yw = torch::matmul(torch::gelu(torch::matmul(xw, w1w) + b1), w2w) + b2w;
    (yw * r).sum().backward();
    // This rank's share: columns [rank part, (rank + 1) part) of w1 and b1, the same rows of w2.
    const torch::Tensor xs = leaf(x0), w1s = leaf(w1.narrow(1, rank * part, part)), w2s = leaf(w2.narrow(0, rank * part, part)),
                        b2s = leaf(b2);
    const torch::Tensor h = torch::gelu(torch::matmul(enter_tensor_group(xs, *group), w1s) + b1.narrow(0, rank * part, part));
    const torch::Tensor ys = leave_tensor_group(torch::matmul(h, w2s), *group) + b2s;
    (ys * r).sum().backward();
    const std::string what = "rank " + std::to_string(rank);
    EXPECT_TRUE(torch::allclose(ys, yw, 1e-5, 1e-5)) << what << ": output";
    EXPECT_TRUE(torch::allclose(xs.grad(), xw.grad(), 1e-5, 1e-5)) << what << ": the input's gradient";
    EXPECT_TRUE(torch::allclose(w1s.grad(), w1w.grad().narrow(1, rank * part, part), 1e-5, 1e-5)) << what << ": w1's columns";
    EXPECT_TRUE(torch::allclose(w2s.grad(), w2w.grad().narrow(0, rank * part, part), 1e-5, 1e-5)) << what << ": w2's rows";
    EXPECT_TRUE(torch::allclose(b2s.grad(), b2w.grad(), 1e-5, 1e-5)) << what << ": b2";
    const CommStats& sent = group->ledger().at(CollectiveKind::tensor_activations);
    EXPECT_EQ(sent.calls, 2) << what;
    EXPECT_DOUBLE_EQ(sent.bytes, 2 * (2.0 * (W - 1) / W * B * T * C * 4)) << what;
  });
}

// A thread rank that fails (Communicator::abort) ends its peers' waits in its groups at once, naming it and the
// reason, where they used to wait out the timeout and then say only that they had waited. Groups it is not in go on.
TEST(Communicator, AThreadRankThatFailsEndsItsPeersWaitsNamingItsReason) {
  constexpr int W = 3;
  LocalGroup threads(W, std::chrono::minutes(2));
  std::vector<std::string> errors(W);
  const auto error_of = [](const std::function<void()>& call) -> std::string {
    try {
      call();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "(nothing thrown)";
  };
  on_ranks(W, [&](int rank) {
    const std::unique_ptr<Communicator> world = threads.join(rank);
    const std::vector<int> pair{0, 1}, others{0, 2};
    std::unique_ptr<Communicator> with_1 = rank != 2 ? world->split("pair", pair) : nullptr;
    std::unique_ptr<Communicator> without_1 = rank != 1 ? world->split("others", others) : nullptr;
    const torch::Tensor t = torch::ones({4});
    if (rank == 1) {  // fails before its next message and collective
      with_1->abort("the disk is full");
      world->abort("the disk is full");
      // Its own later calls there fail alike.
      errors[1] = error_of([&] { with_1->send_async(t, 0, CollectiveKind::pipeline_activations)->wait(); });
      return;
    }
    if (rank == 0) errors[0] = error_of([&] { with_1->recv(t, 1, CollectiveKind::pipeline_activations); });
    // A group without the failed rank still meets.
    without_1->all_reduce_sum(t, CollectiveKind::control);
    EXPECT_TRUE(torch::equal(t, torch::full({4}, 2.0f))) << "rank " << rank;
    // One split for messages only (a pipeline's) carries messages and refuses collectives, as NCCL's does.
    const std::unique_ptr<Communicator> stages = world->split_for_messages("stages", others);
    if (rank == 0) stages->send_async(t, 1, CollectiveKind::pipeline_activations)->wait();
    else stages->recv(t, 0, CollectiveKind::pipeline_activations);
    EXPECT_THROW(stages->all_reduce_sum(t, CollectiveKind::control), std::exception) << "rank " << rank;
    EXPECT_THROW(stages->barrier(), std::exception) << "rank " << rank;
    const std::string in_world = error_of([&] { world->all_reduce_sum(t, CollectiveKind::control); });
    EXPECT_EQ(in_world, "thread rank 1 failed: the disk is full") << "rank " << rank;
  });
  for (int r : {0, 1}) EXPECT_EQ(errors[static_cast<size_t>(r)], "thread rank 1 failed: the disk is full") << "rank " << r;
}

// A rank whose run fails tells its groups before unwinding (train() calls Communicator::abort), so its peers' error
// is its reason at once, not a timeout. Rank 1 is asked to resume from a checkpoint that is not there.
TEST(ZeroInProcess, ARankWhoseRunFailsEndsItsPeersRunsWithItsReason) {
  constexpr int W = 2;
  const fs::path dir = fs::temp_directory_path() / ("ds_abort_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  LocalGroup group(W, std::chrono::minutes(5));
  std::vector<std::string> errors(W);
  on_ranks(W, [&](int r) {
    const Plan plan = plan_for(W, r, {"zero_optimization.stage=2", "train.output_dir=" + dir.string()});
    TrainOptions opt;
    opt.print_every = 1000;
    if (r == 1) opt.resume_from = (dir / "no_such_checkpoint").string();
    auto comm = group.join(r);
    try {
      train(plan, opt, comm.get());
      errors[static_cast<size_t>(r)] = "(trained)";
    } catch (const std::exception& e) {
      errors[static_cast<size_t>(r)] = e.what();
    }
  });
  EXPECT_NE(errors[1].find("no_such_checkpoint"), std::string::npos) << errors[1];
  EXPECT_EQ(errors[0].rfind("thread rank 1 failed: ", 0), 0u) << errors[0];
  EXPECT_NE(errors[0].find("no_such_checkpoint"), std::string::npos) << errors[0];
  fs::remove_all(dir);
}
