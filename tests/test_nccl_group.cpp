// The NCCL group (engine/runtime/comm/nccl_group.hpp) on one GPU: a group of one rank runs every collective for
// real (NCCL refuses two ranks on one GPU), each the identity on the data, in each element type ZeRO sends, and a
// send to itself arrives.
// Without a visible GPU those tests skip and say why (label gpu); a malformed unique id is refused anywhere. A
// group whose peer never joins fails at the timeout (the join is non-blocking).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <stdexcept>
#include <vector>

#include "engine/runtime/comm/nccl_group.hpp"
#include "kernels/cuda/optimizers.hpp"

using namespace ds;

TEST(NcclGroupAnywhere, AUniqueIdOfTheWrongLengthIsRefusedBeforeAnythingStarts) {
  try {
    NcclGroup g("too short", 0, 1, 0, std::chrono::seconds(5));
    FAIL() << "joined a group with a 9-byte id";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("9 bytes"), std::string::npos) << e.what();
  }
}

class NcclOneGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* why = nullptr;
    if (kernels::cuda::device_count(&why) == 0)
      GTEST_SKIP() << "no CUDA device visible (" << (why ? why : "none") << "): the NCCL group was compiled and linked; "
                   << "run scripts/device-check.sh on a GPU machine";
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    group_ = std::make_unique<NcclGroup>(NcclGroup::make_unique_id(), 0, 1, 0, std::chrono::seconds(30));
  }
  void TearDown() override {
    group_.reset();
    if (stream_) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<NcclGroup> group_;
};

TEST_F(NcclOneGpu, EveryCollectiveRunsAndIsTheIdentityOnOneRank) {
  const size_t n = 4099;
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i) * 0.25f - 7.0f;
  float *a = nullptr, *b = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&a), n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&b), n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(a, host.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  group_->all_reduce_sum(a, a, n, NcclElement::f32, stream_);  // in place
  group_->all_gather(a, b, n, NcclElement::f32, stream_);
  group_->reduce_scatter_sum(b, a, n, NcclElement::f32, stream_);
  group_->wait(stream_, "the three collectives");
  std::vector<float> back(n);
  ASSERT_EQ(cudaMemcpy(back.data(), a, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);
  // bf16 and fp64 go through as bits.
  std::vector<uint16_t> h16(n);
  for (size_t i = 0; i < n; ++i) h16[i] = static_cast<uint16_t>(0x3f80 + i % 64);
  ASSERT_EQ(cudaMemcpy(a, h16.data(), n * 2, cudaMemcpyHostToDevice), cudaSuccess);
  group_->all_reduce_sum(a, b, n, NcclElement::bf16, stream_);
  group_->wait(stream_, "a bf16 all-reduce");
  std::vector<uint16_t> b16(n);
  ASSERT_EQ(cudaMemcpy(b16.data(), b, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(b16, h16);
  cudaFree(a);
  cudaFree(b);
  EXPECT_FALSE(nccl_version().empty());
}

// A pipeline's send and receive, on one GPU: a rank of a group of one sends to itself and receives from itself, the
// two grouped (NCCL's way of letting a rank be both ends); the bytes arrive, in fp32 and as bf16 bits. Between two
// ranks, each direction of a pipeline's messages has a communicator of its own (comm_nccl.cpp), which several GPUs check.
TEST_F(NcclOneGpu, ASendToItselfArrivesInTheReceiveGroupedWithIt) {
  const size_t n = 1031;
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i) * 0.5f - 3.0f;
  float *a = nullptr, *b = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&a), n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&b), n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(a, host.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(b, 0, n * sizeof(float)), cudaSuccess);
  group_->begin_group();
  group_->send(a, n, NcclElement::f32, 0, stream_);
  group_->recv(b, n, NcclElement::f32, 0, stream_);
  group_->end_group("a send to itself and its receive");
  group_->wait(stream_, "a send to itself");
  std::vector<float> back(n);
  ASSERT_EQ(cudaMemcpy(back.data(), b, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);
  group_->begin_group();  // 2n bf16 elements: the same bytes
  group_->send(b, 2 * n, NcclElement::bf16, 0, stream_);
  group_->recv(a, 2 * n, NcclElement::bf16, 0, stream_);
  group_->end_group("a bf16 send to itself and its receive");
  group_->wait(stream_, "a bf16 send to itself");
  ASSERT_EQ(cudaMemcpy(back.data(), a, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);
  cudaFree(a);
  cudaFree(b);
}

// The join is non-blocking and polled against the timeout: a group of two whose second rank never starts ends
// in a named error on the rank that did, with its communicator aborted (and the process's others), instead of a
// process stuck in NCCL.
TEST_F(NcclOneGpu, AGroupWhosePeerNeverJoinsFailsAtTheTimeoutNamingTheJoin) {
  try {
    NcclGroup lonely(NcclGroup::make_unique_id(), 0, 2, 0, std::chrono::seconds(2));
    FAIL() << "joined a group of two with one rank";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 0: joining the NCCL group of 2 ranks"), std::string::npos) << what;
    EXPECT_NE(what.find("aborted"), std::string::npos) << what;
  }
  // Every NCCL group of the process went with it (their kernels would spin for ever on the peer that failed): the
  // group of one made in SetUp refuses its next call, naming the abort, and hands NCCL nothing.
  float* a = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&a), 64 * sizeof(float)), cudaSuccess);
  try {
    group_->all_reduce_sum(a, a, 64, NcclElement::f32, stream_);
    ADD_FAILURE() << "a group of the process queued an all-reduce after another failed";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("aborted earlier"), std::string::npos) << e.what();
  }
  cudaFree(a);
}
