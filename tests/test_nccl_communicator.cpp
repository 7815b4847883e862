// The Communicator over NCCL (engine/runtime/comm/comm_nccl.cpp). Anywhere: rank 0's NCCL unique id reaches every
// rank through the world's store (NCCL makes the id without a GPU), and a rank whose rank 0 never sends it fails at
// the timeout naming what it waited for. On a GPU (label gpu; skipped elsewhere, saying why): a one-rank
// communicator runs every collective over CUDA tensors, NCCL's equal pieces and uneven spans alike, each the
// identity on one rank, and counts them in its ledger; a group split from it runs its own; one split for messages
// only runs none; a settle leaves a collective nothing waits for running; a collective's time is its span on the GPU.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <chrono>
#include <functional>
#include <future>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "engine/runtime/comm/comm.hpp"
#include "engine/runtime/comm/nccl_group.hpp"
#include "engine/runtime/comm/rendezvous.hpp"
#include "kernels/cuda/optimizers.hpp"
#include "test_helpers.hpp"

using namespace ds;

namespace ds {
std::unique_ptr<Communicator> make_nccl_communicator(const Topology& t, std::chrono::milliseconds timeout);  // comm_nccl.cpp
}

namespace {

Topology rank_of(int rank, int world, int port) {
  Topology t;
  t.world_size = world;
  t.rank = t.local_rank = rank;
  t.master_addr = "127.0.0.1";
  t.master_port = port;
  return t;
}

// Why a GPU test cannot run here ("" where it can).
std::string why_no_gpu() {
  const char* why = nullptr;
  if (kernels::cuda::device_count(&why) == 0)
    return std::string("no CUDA device visible (") + (why ? why : "none") +
           "): the NCCL communicator was compiled and linked; run scripts/device-check.sh on a GPU machine";
  if (!torch::cuda::is_available()) return "this LibTorch has no CUDA: the device check builds with CUDA LibTorch";
  return "";
}

// What `call` throws ("" when it returns).
std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(NcclRendezvous, RankZerosUniqueIdReachesEveryRankThroughTheStore) {
  constexpr int W = 3;
  const int port = test::free_port();
  std::vector<std::string> got(W);
  std::vector<std::string> errors(W);
  std::vector<std::thread> ranks;
  for (int r = 0; r < W; ++r)
    ranks.emplace_back([&, r] {
      try {
        const auto store = open_world_store(rank_of(r, W, port), std::chrono::seconds(60));
        got[static_cast<size_t>(r)] =
            share_from_rank0(*store, "ds/nccl/unique_id", r, std::chrono::seconds(60), NcclGroup::make_unique_id, "NCCL unique id");
        store->add("done", 1);  // rank 0 serves the store: it stays until every rank has read
        while (r == 0 && store->add("done", 0) < W) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < W; ++r) ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  ASSERT_EQ(got[0].size(), 128u);  // NCCL_UNIQUE_ID_BYTES, zero bytes and all
  EXPECT_EQ(got[1], got[0]);
  EXPECT_EQ(got[2], got[0]);
  EXPECT_NE(got[0], NcclGroup::make_unique_id());  // a new id each time: the one shared is rank 0's
}

TEST(NcclRendezvous, ARankWhoseRankZeroNeverSendsTheIdFailsAtTheTimeoutNamingIt) {
  const int port = test::free_port();
  std::string error;
  std::thread rank0([&] {  // joins the store, never sends the id, stays until rank 1 gave up
    const auto store = open_world_store(rank_of(0, 2, port), std::chrono::seconds(60));
    store->wait({"gave up"}, std::chrono::seconds(60));
  });
  std::thread rank1([&] {
    const auto store = open_world_store(rank_of(1, 2, port), std::chrono::seconds(60));
    try {
      share_from_rank0(*store, "ds/nccl/unique_id", 1, std::chrono::seconds(1), NcclGroup::make_unique_id, "NCCL unique id");
    } catch (const std::runtime_error& e) {
      error = e.what();
    }
    store->set("gave up", std::vector<uint8_t>{1});
  });
  rank1.join();
  rank0.join();
  EXPECT_NE(error.find("rank 1 waited 1 s for rank 0's NCCL unique id, which never came"), std::string::npos) << error;
}

TEST(NcclCommunicatorOneGpu, EveryCollectiveOverCudaTensorsEqualPiecesAndUnevenSpans) {
  if (const std::string why = why_no_gpu(); !why.empty()) GTEST_SKIP() << why;
  const std::unique_ptr<Communicator> comm = make_nccl_communicator(rank_of(0, 1, test::free_port()), std::chrono::seconds(30));
  EXPECT_TRUE(comm->capabilities() == comm_capabilities(CommBackend::nccl));
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    const torch::Tensor host = torch::arange(0, 4099, torch::kFloat32).mul(0.25).sub(7).to(dtype);
    torch::Tensor t = host.to(torch::kCUDA);
    comm->all_reduce_sum_async(t, CollectiveKind::gradients)->wait();
    comm->all_gather_async(t, Ownership{{{3, 4000}}}, CollectiveKind::updated_parameters)->wait();  // NCCL's one piece
    comm->all_gather_async(t, Ownership{{{0, 5}, {100, 7}, {4090, 9}}}, CollectiveKind::updated_parameters)->wait();  // uneven spans
    comm->reduce_scatter_sum_async(t, Ownership{{{0, 4099}}}, torch::Tensor(), CollectiveKind::gradients)->wait();
    comm->reduce_scatter_sum_async(t, Ownership{{{1, 2}, {50, 0}, {60, 600}}}, torch::Tensor(), CollectiveKind::gradients)->wait();
    comm->mark_step(1);  // the host waits for the step's collectives here
    EXPECT_TRUE(torch::equal(t.cpu(), host)) << dtype;
  }
  comm->barrier();
  EXPECT_EQ(comm->ledger().at(CollectiveKind::gradients).calls, 6);
  EXPECT_EQ(comm->ledger().at(CollectiveKind::updated_parameters).calls, 4);
  // A group split from the world (a mesh's tensor group): an NCCL communicator of its own, met under its name in the
  // world's store, whose ledger is its own; a name meets once, and a rank sends no message to itself.
  const std::unique_ptr<Communicator> group = comm->split("tensor-0", {0});
  ASSERT_EQ(group->world_size(), 1);
  torch::Tensor g = torch::full({17}, 2.0, torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCUDA));
  group->all_reduce_sum(g, CollectiveKind::tensor_activations);
  group->settle();
  EXPECT_EQ(g.sum().item<double>(), 34.0);
  EXPECT_EQ(group->ledger().at(CollectiveKind::tensor_activations).calls, 1);
  EXPECT_EQ(comm->ledger().count(CollectiveKind::tensor_activations), 0u);
  EXPECT_ANY_THROW(comm->split("tensor-0", {0}));
  EXPECT_ANY_THROW(group->send_async(g, 0, CollectiveKind::pipeline_activations));
  // A group split for messages only (a pipeline's) opens no NCCL communicator: its collectives are refused, naming
  // it, and it settles (no links yet) without one.
  const std::unique_ptr<Communicator> stages = comm->split_for_messages("pipeline-0", {0});
  ASSERT_EQ(stages->world_size(), 1);
  const std::string refused = error_of([&] { stages->all_reduce_sum(g, CollectiveKind::control); });
  EXPECT_NE(refused.find("pipeline-0, which was split for messages only"), std::string::npos) << refused;
  EXPECT_ANY_THROW(stages->barrier());
  stages->settle();
}

// A collective nothing waits for yet (stages 1-2's updated parameters, gathered while the next forward runs) does not
// hold a settle: here its stream waits behind a compute stream the test holds shut, and settle() returns at once
// instead of timing out (2 s) on it; waited for once the gate opens, its result is there.
TEST(NcclCommunicatorOneGpu, ASettleLeavesACollectiveNothingWaitsForRunning) {
  if (const std::string why = why_no_gpu(); !why.empty()) GTEST_SKIP() << why;
  const std::unique_ptr<Communicator> comm = make_nccl_communicator(rank_of(0, 1, test::free_port()), std::chrono::seconds(2));
  const torch::Tensor host = torch::arange(0, 4096, torch::kFloat32);
  torch::Tensor t = host.to(torch::kCUDA);
  comm->all_reduce_sum(t, CollectiveKind::gradients);  // (one waited for before it)
  comm->settle();
  std::promise<void> open;
  auto* gate = new std::shared_future<void>(open.get_future().share());
  ASSERT_EQ(cudaLaunchHostFunc(cudaStreamLegacy, [](void* g) { static_cast<std::shared_future<void>*>(g)->wait(); }, gate), cudaSuccess);
  std::unique_ptr<PendingCollective> ahead = comm->all_gather_async(t, Ownership{{{0, 4096}}}, CollectiveKind::updated_parameters);
  const std::string held = error_of([&] { comm->settle(); });
  EXPECT_EQ(held, "");
  open.set_value();
  ahead->wait();
  comm->settle();
  EXPECT_TRUE(torch::equal(t.cpu(), host));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  delete gate;
}

// A collective's time is its span on the GPU, not the host's queueing of it: here it is queued behind a compute stream
// the test holds shut, so it cannot start before the host opens the gate. Its profile span starts after that (the
// host's clock queued it before), ends before the settle that follows returns, and is what the ledger counts.
TEST(NcclCommunicatorOneGpu, ACollectivesTimeIsItsSpanOnTheGpuNotItsQueueing) {
  if (const std::string why = why_no_gpu(); !why.empty()) GTEST_SKIP() << why;
  const std::unique_ptr<Communicator> comm = make_nccl_communicator(rank_of(0, 1, test::free_port()), std::chrono::seconds(30));
  torch::Tensor t = torch::arange(0, 1 << 20, torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCUDA));
  comm->all_reduce_sum(t, CollectiveKind::gradients);  // (the communicator's first call, before any gate)
  comm->settle();
  comm->record_events(true);
  const double before = comm->ledger().at(CollectiveKind::gradients).seconds;
  std::promise<void> open;
  auto* gate = new std::shared_future<void>(open.get_future().share());
  ASSERT_EQ(cudaLaunchHostFunc(cudaStreamLegacy, [](void* g) { static_cast<std::shared_future<void>*>(g)->wait(); }, gate), cudaSuccess);
  std::unique_ptr<PendingCollective> held = comm->all_reduce_sum_async(t, CollectiveKind::gradients);
  held->wait();  // (the compute stream waits for it; the host does not)
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // (a queueing timed on the host would end before the gate opens)
  const auto opened = std::chrono::steady_clock::now();
  open.set_value();
  comm->settle();
  const auto settled = std::chrono::steady_clock::now();
  const std::vector<Communicator::Event> events = comm->take_events();
  ASSERT_EQ(events.size(), 1u);
  const Communicator::Event& e = events[0];
  EXPECT_EQ(e.kind, CollectiveKind::gradients);
  const auto slack = std::chrono::milliseconds(2);  // where the GPU's clock meets the host's
  EXPECT_GE(e.issued + slack, opened) << "the span starts " << std::chrono::duration<double>(opened - e.issued).count() << " s before the gate opened";
  EXPECT_LE(e.done, settled + slack);
  EXPECT_LE(e.issued, e.done);
  const double seconds = comm->ledger().at(CollectiveKind::gradients).seconds - before;
  EXPECT_NEAR(seconds, std::chrono::duration<double>(e.done - e.issued).count(), 1e-5);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  delete gate;
}

// A run that fails for a reason of its own aborts its communicators (Communicator::abort, from train()): every NCCL
// group of the process is aborted (twice is harmless), what they hold fails at once instead of waiting, and the
// communicator then goes without waiting for anything.
TEST(NcclCommunicatorOneGpu, AnAbortedCommunicatorRefusesWhatFollowsAndGoesAtOnce) {
  if (const std::string why = why_no_gpu(); !why.empty()) GTEST_SKIP() << why;
  std::unique_ptr<Communicator> comm = make_nccl_communicator(rank_of(0, 1, test::free_port()), std::chrono::seconds(30));
  std::unique_ptr<Communicator> group = comm->split("tensor-0", {0});
  torch::Tensor t = torch::ones({1024}, torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCUDA));
  comm->all_reduce_sum(t, CollectiveKind::gradients);
  comm->abort("the disk is full");
  comm->abort("the disk is full");
  for (Communicator* c : {comm.get(), group.get()}) {  // the group split from it is aborted with it
    const std::string refused = error_of([&] { c->all_reduce_sum(t, CollectiveKind::gradients); });
    EXPECT_NE(refused.find("aborted earlier"), std::string::npos) << refused;
  }
  EXPECT_ANY_THROW(comm->settle());
  group.reset();  // (their destructors' waits end at once: nothing of an aborted group is waited for)
  comm.reset();
}
