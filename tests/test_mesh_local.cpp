// A model split over thread ranks: the mesh's tensor, pipeline and data groups split from a LocalGroup's world, so
// the meshes test_zero_mesh.cpp starts as processes over Gloo train in one process, in seconds. The same runs on
// one GPU's tensors (test_cuda_train.cpp) check the device side of tensor and pipeline parallelism, which several
// GPUs run over NCCL.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "engine/plan/mesh.hpp"
#include "engine/runtime/comm/comm.hpp"
#include "engine/runtime/comm/comm_local.hpp"
#include "engine/runtime/run/trainer.hpp"
#include "schema/loader.hpp"
#include "test_helpers.hpp"

using namespace ds;
namespace fs = std::filesystem;

namespace {

// gpt2-tiny (2 blocks, 4 heads, tied head), a global batch of 8 samples per step, clipping on so the norm crosses
// every group.
const char* kTiny = R"({"train_batch_size": 8, "gradient_clipping": 1.0,
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
  "model": {"preset": "gpt2-tiny"}, "data": {"type": "synthetic", "seq_len": 16, "val_fraction": 0.05},
  "zero_optimization": {"reduce_bucket_size": 3000, "allgather_bucket_size": 5000},
  "train": {"steps": 6, "eval_every": 0, "threads": 1}})";

struct RankRun {
  Plan plan;
  TrainResult result;
  // "group: peer", in the order this rank's communicators were asked to connect, after "split group" or "split group
  // for messages" as each group was formed
  std::vector<std::string> connects;
};

// A thread rank's communicator that notes every connect() (the order NCCL's two-rank links are made in) and split, of
// itself and of the groups split from it, and passes everything on.
class NotingConnects final : public Communicator {
 public:
  NotingConnects(std::unique_ptr<Communicator> inner, std::string name, std::vector<std::string>* log)
      : Communicator(inner->rank(), inner->world_size()), inner_(std::move(inner)), name_(std::move(name)), log_(log) {}
  CommCapabilities capabilities() const override { return inner_->capabilities(); }
  std::unique_ptr<PendingCollective> all_reduce_sum_async(const torch::Tensor& t, CollectiveKind kind) override {
    return inner_->all_reduce_sum_async(t, kind);
  }
  std::unique_ptr<PendingCollective> all_gather_async(const torch::Tensor& t, const Ownership& owners, CollectiveKind kind) override {
    return inner_->all_gather_async(t, owners, kind);
  }
  std::unique_ptr<PendingCollective> reduce_scatter_sum_async(const torch::Tensor& t, const Ownership& owners, const torch::Tensor& scratch,
                                                              CollectiveKind kind) override {
    return inner_->reduce_scatter_sum_async(t, owners, scratch, kind);
  }
  void barrier() override { inner_->barrier(); }
  std::unique_ptr<PendingCollective> send_async(const torch::Tensor& t, int to, CollectiveKind kind) override {
    return inner_->send_async(t, to, kind);
  }
  void recv(const torch::Tensor& t, int from, CollectiveKind kind) override { inner_->recv(t, from, kind); }
  std::unique_ptr<Communicator> split(const std::string& name, const std::vector<int>& members) override {
    log_->push_back("split " + name);
    return std::make_unique<NotingConnects>(inner_->split(name, members), name, log_);
  }
  std::unique_ptr<Communicator> split_for_messages(const std::string& name, const std::vector<int>& members) override {
    log_->push_back("split " + name + " for messages");
    return std::make_unique<NotingConnects>(inner_->split_for_messages(name, members), name, log_);
  }
  void connect(int peer) override {
    log_->push_back(name_ + ": " + std::to_string(peer));
    inner_->connect(peer);
  }
  void abort(const std::string& reason) override { inner_->abort(reason); }

 private:
  std::unique_ptr<Communicator> inner_;
  std::string name_;
  std::vector<std::string>* log_;
};

// Every rank's plan and run on `world` thread ranks (one: no communicator) whose collectives speak `library`'s terms,
// rank 0 first; with `note_connects`, each rank's connects noted (its ledger then empty: the noting layer counts nothing).
std::vector<RankRun> train_mesh(int world, const std::vector<std::string>& overrides, CommBackend library = CommBackend::gloo,
                                bool note_connects = false) {
  std::vector<RankRun> runs(static_cast<size_t>(world));
  LocalGroup group(world, std::chrono::seconds(60), library);
  test::on_ranks(world, [&](int r) {
    RankRun& run = runs[static_cast<size_t>(r)];
    Config c = load_config_text(kTiny, "test.json", overrides);
    Topology t = test::thread_ranks(world, r);
    t.communicator = library;
    run.plan = compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), t);
    TrainOptions opt;
    opt.print_every = 1000;
    std::unique_ptr<Communicator> comm;
    if (world > 1) comm = group.join(r);
    if (comm && note_connects) comm = std::make_unique<NotingConnects>(std::move(comm), "world", &run.connects);
    run.result = train(run.plan, opt, comm.get());
  });
  return runs;
}

}  // namespace

// In Gloo's terms and in NCCL's (gathers in equal pieces, the library's own reduce-scatter), as several GPUs run them.
TEST(MeshInProcess, TensorAndPipelineGroupsOfThreadRanksTrainTheOneRankRunAndSendThePlansBytes) {
  const fs::path root = fs::temp_directory_path() / ("ds_mesh_local_" + std::to_string(::getpid()));
  const auto out = [&](const std::string& name) { return "train.output_dir=" + (root / name).string(); };
  const std::vector<double> base = train_mesh(1, {"train_micro_batch_size_per_gpu=4", out("one")})[0].result.losses;
  ASSERT_EQ(base.size(), 6u);
  struct Mesh {
    std::string name;
    int world;
    std::vector<std::string> shape;
  };
  const std::vector<Mesh> meshes = {
      {"t2", 2, {"tensor_parallel.autotp_size=2", "train_micro_batch_size_per_gpu=4"}},
      {"p2", 2, {"pipeline.stages=2", "train_micro_batch_size_per_gpu=4"}},
      {"t2d2z2", 4, {"tensor_parallel.autotp_size=2", "zero_optimization.stage=2", "train_micro_batch_size_per_gpu=2"}},
      {"t2p2", 4, {"tensor_parallel.autotp_size=2", "pipeline.stages=2", "train_micro_batch_size_per_gpu=2"}},
  };
  for (const CommBackend library : {CommBackend::gloo, CommBackend::nccl}) {
    for (const Mesh& m : meshes) {
      SCOPED_TRACE(m.name + std::string(" in ") + comm_backend_name(library) + "'s terms");
      std::vector<std::string> o = m.shape;
      o.push_back(out(m.name + comm_backend_name(library)));
      const std::vector<RankRun> runs = train_mesh(m.world, o, library);
      const MeshPlan& mesh = runs[0].plan.mesh;
      ASSERT_TRUE(mesh.shape.splits_the_model());
      EXPECT_EQ(mesh.shape.tensor * mesh.shape.pipeline * mesh.shape.data, m.world);
      for (int r = 0; r < m.world; ++r) {
        SCOPED_TRACE("rank " + std::to_string(r));
        const RankRun& run = runs[static_cast<size_t>(r)];
        ASSERT_EQ(run.result.losses.size(), base.size());
        for (size_t i = 0; i < base.size(); ++i) EXPECT_NEAR(run.result.losses[i], base[i], 1e-5 * base[i]) << "step " << i + 1;
        // The bytes this rank sent each step, the plan's.
        const double planned = test::mesh_bytes_per_step(run.plan, r);
        EXPECT_GT(mesh.stages[static_cast<size_t>(mesh_coord(mesh.shape, r).pipeline)].traffic.sent_bytes(), 0);
        ASSERT_EQ(run.result.comm_bytes.size(), base.size());
        for (size_t i = 0; i < base.size(); ++i) EXPECT_NEAR(run.result.comm_bytes[i], planned, 1.0) << "step " << i + 1;
      }
    }
  }
  fs::remove_all(root);
}

// The two-rank links NCCL makes for a pipeline's messages are made before any message, each rank meeting its lower
// neighbour first, then its upper, then the other end of the tied token table: an order in which every pair meets
// without any rank waiting on one that waits on it (Communicator::connect). Three stages, GPT-2's tied head. The
// pipeline's and the tied table's groups carry messages only (so NCCL opens no communicator of the whole group).
TEST(MeshInProcess, APipelinesRanksConnectToTheirNeighboursLowerFirstThenTheTiedEnds) {
  const fs::path root = fs::temp_directory_path() / ("ds_mesh_connect_" + std::to_string(::getpid()));
  const std::vector<RankRun> runs = train_mesh(3, {"pipeline.stages=3", "model.num_layers=3", "train_micro_batch_size_per_gpu=4",
                                                   "train.steps=1", "train.output_dir=" + (root / "p3").string()},
                                             CommBackend::gloo, /*note_connects=*/true);
  ASSERT_EQ(runs[0].plan.mesh.shape.pipeline, 3);
  ASSERT_TRUE(runs[0].plan.mesh.tied_exchange());
  EXPECT_EQ(runs[0].connects, (std::vector<std::string>{"split pipeline-0 for messages", "split tied-0 for messages", "split writers",
                                                        "pipeline-0: 1", "tied-0: 1"}));
  EXPECT_EQ(runs[1].connects, (std::vector<std::string>{"split pipeline-0 for messages", "split writers", "pipeline-0: 0", "pipeline-0: 2"}));
  EXPECT_EQ(runs[2].connects, (std::vector<std::string>{"split pipeline-0 for messages", "split tied-0 for messages", "split writers",
                                                        "pipeline-0: 1", "tied-0: 0"}));
  fs::remove_all(root);
}
