// NVMe swapping for optimizer offload: the sub-groups the plan cuts, stepping them one by one against
// stepping the whole buffer, the io_uring swapper's reads and writes, the checks on nvme_path before
// anything is written, and swap directories left by dead runs.
#include <gtest/gtest.h>

#include <linux/magic.h>
#include <fcntl.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "common/error.hpp"
#include "common/format.hpp"
#include "engine/plan/model_spec.hpp"
#include "engine/plan/optimizer_groups.hpp"
#include "engine/plan/plan.hpp"
#include "engine/runtime/io/nvme_swap.hpp"
#include "engine/runtime/run/optimizer.hpp"
#include "schema/loader.hpp"

using namespace ds;
namespace fs = std::filesystem;

namespace {

const char* kTiny = R"({"train_micro_batch_size_per_gpu": 2, "model": {"preset": "gpt2-tiny"},
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
  "data": {"type": "synthetic", "seq_len": 16}, "train": {"steps": 2}})";

Plan plan_of(const char* text, int world, int rank, const std::vector<std::string>& overrides) {
  Config c = load_config_text(text, "t.json", overrides);
  Topology t;
  t.world_size = t.ranks_per_node = world;
  t.rank = rank;
  t.cores_per_node = 2;
  t.host_memory_bytes = 8.0 * (1 << 30);
  t.world_size_source = "test";
  return compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), t);
}

fs::path scratch(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("ds_nvme_swap_" + std::to_string(::getpid())) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::vector<std::string> nvme_at(const fs::path& dir, std::vector<std::string> more = {}) {
  more.push_back("zero_optimization.offload_optimizer.device=nvme");
  more.push_back("zero_optimization.offload_optimizer.nvme_path=" + dir.string());
  return more;
}

std::string user_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return std::string(e.what()) + " [" + e.hint() + "]";
  }
  return "";
}

}  // namespace

TEST(NvmeSwap, SubGroupsTileTheLocalBufferOnTheKernelsGrainAndTheirFilesOnBlocks) {
  const fs::path dir = scratch("groups");
  for (int world : {1, 3})
    for (int stage : {1, 3})
      for (int64_t size : {16, 100, 1000, 4096, 50000, 1000000000}) {
        SCOPED_TRACE("world " + std::to_string(world) + " stage " + std::to_string(stage) + " sub_group_size " + std::to_string(size));
        const Plan p = plan_of(kTiny, world, world - 1,
                               nvme_at(dir, {"zero_optimization.stage=" + std::to_string(stage),
                                             "zero_optimization.sub_group_size=" + std::to_string(size)}));
        const ZeroExecution& z = p.execution;
        const std::vector<StepRun> runs = optimizer_runs(p.layout, world - 1, false);
        ASSERT_FALSE(z.sub_groups.empty());
        int64_t at = 0, offset = 0, largest = 0;
        for (const SubGroup& g : z.sub_groups) {
          EXPECT_EQ(g.begin, at);
          EXPECT_LE(g.numel(), std::max<int64_t>(size, kStepGrain));
          EXPECT_EQ(g.file_offset, offset);
          EXPECT_EQ(g.file_offset % kSwapAlignBytes, 0);
          offset += (g.numel() * 4 + kSwapAlignBytes - 1) / kSwapAlignBytes * kSwapAlignBytes;
          largest = std::max(largest, g.numel());
          at = g.end;
          // A cut inside a run sits a whole number of grains from the run's start.
          for (const StepRun& r : runs) {
            if (r.begin < g.end && g.end < r.end) {
              EXPECT_EQ((g.end - r.begin) % kStepGrain, 0);
            }
          }
        }
        EXPECT_EQ(at, z.local_numel);
        EXPECT_EQ(z.sub_group_numel, largest);
        // The plan's NVMe bytes are the three state files' (master and two moments), byte for byte.
        EXPECT_DOUBLE_EQ(p.memory.nvme, 3.0 * static_cast<double>(offset));
      }
}

TEST(NvmeSwap, SteppingSubGroupsOneByOneGivesTheBitsOfOneWholeStep) {
  // Random weights, moments and gradients; the optimizer once over the whole local buffer, and once per
  // sub-group from copies of that sub-group's elements (as the swapper hands them over): equal bits.
  const fs::path dir = scratch("step");
  for (const char* opt : {"optimizer.type=AdamW", "optimizer.type=Adam", "optimizer.type=SGD"})
    for (bool bf16_grads : {false, true}) {
      SCOPED_TRACE(std::string(opt) + (bf16_grads ? ", bf16 gradients" : ", fp32 gradients"));
      const Plan p = plan_of(kTiny, 2, 1,
                             nvme_at(dir, {opt, std::string(opt) == "optimizer.type=SGD" ? "optimizer.params.momentum=0.9" : "optimizer.params.lr=1e-2",
                                           "zero_optimization.stage=3", "zero_optimization.sub_group_size=1000"}));
      const int64_t n = p.execution.local_numel;
      std::mt19937 rng(7);
      std::normal_distribution<float> normal;
      auto random = [&](size_t k) {
        std::vector<float> v(k);
        for (float& x : v) x = normal(rng);
        return v;
      };
      std::vector<float> w = random(static_cast<size_t>(n)), m = random(static_cast<size_t>(n)), v = random(static_cast<size_t>(n)),
                         g = random(static_cast<size_t>(n));
      for (float& x : v) x = x * x;
      std::vector<uint16_t> gb(static_cast<size_t>(n)), out_whole(static_cast<size_t>(n)), out_groups(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        uint32_t bits;
        std::memcpy(&bits, &g[static_cast<size_t>(i)], 4);
        gb[static_cast<size_t>(i)] = static_cast<uint16_t>(bits >> 16);
      }
      const FlatOptimizer optimizer(p.optimizer, p.layout, 1);
      OptimizerStepInputs in;
      in.lr = 1e-2;
      in.step = 3;
      in.grad_scale = 0.5;
      std::vector<float> w1 = w, m1 = m, v1 = v;
      OptimizerBuffers whole{w1.data(), m1.data(), v1.data(), out_whole.data(),
                             bf16_grads ? static_cast<const void*>(gb.data()) : g.data(), bf16_grads ? GradElements::bf16 : GradElements::f32};
      optimizer.step(whole, in);
      std::vector<float> w2 = w, m2 = m, v2 = v;
      for (const SubGroup& sg : p.execution.sub_groups) {
        const auto b = static_cast<size_t>(sg.begin), e = static_cast<size_t>(sg.end);
        std::vector<float> ws(w2.begin() + b, w2.begin() + e), ms(m2.begin() + b, m2.begin() + e), vs(v2.begin() + b, v2.begin() + e);
        OptimizerBuffers part{ws.data(), ms.data(), vs.data(), out_groups.data() + b,
                              bf16_grads ? static_cast<const void*>(gb.data() + b) : g.data() + b,
                              bf16_grads ? GradElements::bf16 : GradElements::f32};
        optimizer.step_window(part, in, sg.begin, sg.end);
        std::copy(ws.begin(), ws.end(), w2.begin() + b);
        std::copy(ms.begin(), ms.end(), m2.begin() + b);
        std::copy(vs.begin(), vs.end(), v2.begin() + b);
      }
      EXPECT_EQ(std::memcmp(w1.data(), w2.data(), w1.size() * 4), 0);
      EXPECT_EQ(std::memcmp(m1.data(), m2.data(), m1.size() * 4), 0);
      EXPECT_EQ(std::memcmp(v1.data(), v2.data(), v1.size() * 4), 0);
      EXPECT_EQ(out_whole, out_groups);
    }
}

TEST(NvmeSwap, StatesWrittenAndReadBackThroughEveryPipelineAndRequestSize) {
  // Weights in, then read back piece by piece at awkward offsets; and a step-like pass that rewrites
  // every sub-group, whose results read back. Small requests (8 KiB, two in flight) make each transfer
  // many requests; one-by-one submission too.
  const fs::path dir = scratch("roundtrip");
  for (const char* pipeline : {"false", "true"})
    for (const char* single : {"false", "true"}) {
      SCOPED_TRACE(std::string("pipelined ") + pipeline + ", single_submit " + single);
      const Plan p = plan_of(kTiny, 1, 0,
                             nvme_at(dir, {"zero_optimization.stage=2", "zero_optimization.sub_group_size=7000",
                                           "zero_optimization.offload_optimizer.buffer_count=12",
                                           std::string("zero_optimization.offload_optimizer.pipeline_read=") + pipeline,
                                           std::string("zero_optimization.offload_optimizer.pipeline_write=") + pipeline,
                                           "aio.block_size=8192", "aio.queue_depth=2", std::string("aio.single_submit=") + single}));
      const int64_t n = p.execution.local_numel;
      std::vector<float> whole(static_cast<size_t>(p.layout.numel));
      for (size_t i = 0; i < whole.size(); ++i) whole[i] = static_cast<float>(i) * 0.5f + 1.0f;
      {
        OptimizerSwapper s(p, 0, 3);
        EXPECT_TRUE(fs::exists(fs::path(s.directory()) / "master.swap"));
        swap_in_weights(s, owned_segments(p.layout, 0), [&](const OwnedSegment& seg) { return whole.data() + seg.global; });
        // A "step": exp_avg = master + 1, exp_avg_sq = 2 x master.
        s.for_each([&](size_t i, float* const* st) {
          for (int64_t k = 0; k < s.sub_groups()[i].numel(); ++k) {
            st[1][k] = st[0][k] + 1;
            st[2][k] = 2 * st[0][k];
          }
        });
        std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n)), c(static_cast<size_t>(n));
        for (int64_t at = 0; at < n;) {
          const int64_t len = std::min<int64_t>(n - at, 3001);
          float* out[3] = {a.data() + at, b.data() + at, c.data() + at};
          s.read_range(at, len, out);
          at += len;
        }
        for (const OwnedSegment& seg : owned_segments(p.layout, 0))
          for (int64_t k = 0; k < seg.numel; ++k) {
            const float x = whole[static_cast<size_t>(seg.global + k)];
            ASSERT_EQ(a[static_cast<size_t>(seg.local + k)], x);
            ASSERT_EQ(b[static_cast<size_t>(seg.local + k)], x + 1);
            ASSERT_EQ(c[static_cast<size_t>(seg.local + k)], 2 * x);
          }
        EXPECT_DOUBLE_EQ(s.io().bytes_written(), s.file_bytes() * 2);  // weights in, then the pass
      }
      EXPECT_TRUE(fs::is_empty(dir)) << "the swap directory outlived its swapper";
    }
}

TEST(NvmeSwap, WhereODirectIsRefusedItSwapsThroughThePageCache) {
  // tmpfs refused O_DIRECT before Linux 6.6: there the files open without it, and the data is the same.
  struct statfs v {};
  if (::statfs("/dev/shm", &v) != 0 || v.f_type != TMPFS_MAGIC || ::access("/dev/shm", W_OK) != 0)
    GTEST_SKIP() << "no writable tmpfs at /dev/shm";
  const fs::path dir = fs::path("/dev/shm") / ("ds_nvme_swap_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const int probe = ::open((dir / "probe").c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
  const bool takes_direct = probe >= 0;
  if (probe >= 0) ::close(probe);
  SwapIo io(AioConfig{});
  const int f = io.create((dir / "x.swap").string(), 8192);
  EXPECT_EQ(io.direct(), takes_direct);
  void* buf = std::aligned_alloc(4096, 8192);
  std::memset(buf, 7, 8192);
  io.wait(io.write(f, buf, 8192, 0));
  std::memset(buf, 0, 8192);
  io.wait(io.read(f, buf, 8192, 0));
  EXPECT_EQ(static_cast<unsigned char*>(buf)[8191], 7);
  std::free(buf);
  fs::remove_all(dir);
}

TEST(NvmeSwap, AFailedTransferNamesTheFileAndWhatWentWrong) {
  const fs::path dir = scratch("fail");
  SwapIo io(AioConfig{});
  const int f = io.create((dir / "short.swap").string(), 4096);
  void* buf = std::aligned_alloc(4096, 8192);
  // Reading past the reserved bytes comes up short: an error naming the path, not garbage.
  try {
    io.wait(io.read(f, buf, 8192, 4096));
    ADD_FAILURE() << "a short read passed";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find((dir / "short.swap").string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bytes transferred"), std::string::npos) << e.what();
  }
  std::free(buf);
}

TEST(NvmeSwap, ABadNvmePathIsRefusedBeforeAnythingIsWritten) {
  const fs::path dir = scratch("bad");
  auto swapper_at = [&](const fs::path& where, const char* preset = "gpt2-tiny") {
    return user_error([&] {
      const Plan p = plan_of(kTiny, 1, 0, nvme_at(where, {"zero_optimization.stage=3", std::string("model.preset=") + preset}));
      OptimizerSwapper s(p, 0, 3);
    });
  };
  std::string e = swapper_at(dir / "missing");
  EXPECT_NE(e.find("does not exist"), std::string::npos) << e;
  EXPECT_NE(e.find("mkdir -p"), std::string::npos) << e;
  std::ofstream(dir / "file") << "x";
  e = swapper_at(dir / "file");
  EXPECT_NE(e.find("is not a directory"), std::string::npos) << e;
  if (::geteuid() != 0) {  // root writes anywhere
    fs::create_directories(dir / "locked");
    fs::permissions(dir / "locked", fs::perms::owner_read | fs::perms::owner_exec);
    e = swapper_at(dir / "locked");
    EXPECT_NE(e.find("not writable"), std::string::npos) << e;
  }
  // Llama-2 70B's fp32 master and moments are ~840 GB on one rank: more than this disk has free. The
  // message has both numbers, the plan's computed here independently.
  e = swapper_at(dir, "llama-2-70b");
  const Plan big = plan_of(kTiny, 1, 0, nvme_at(dir, {"zero_optimization.stage=3", "model.preset=llama-2-70b"}));
  EXPECT_NE(e.find("free; this rank's optimizer states need " + format_bytes(big.memory.nvme)), std::string::npos) << e;
  EXPECT_NEAR(big.memory.nvme, 12.0 * static_cast<double>(big.model.num_params), 1e-3 * big.memory.nvme);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1) << "only the test's own file";
}

TEST(NvmeSwap, SwapDirectoriesOfDeadRunsAreFoundAndLiveOnesLeftAlone) {
  const fs::path dir = scratch("stale");
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);  // a pid that is certainly gone
  auto fake = [&](const std::string& name, const std::string& owner) {
    fs::create_directories(dir / name);
    std::ofstream(dir / name / "owner") << owner << "\n";
    std::ofstream(dir / name / "master.swap") << std::string(10000, 'x');
  };
  fake("ds-swap-dead", std::string(host) + " " + std::to_string(child) + " 12345");
  fake("ds-swap-elsewhere", "another-host 1 1");
  // This process, but a start time that is not its own: the pid was reused, the run is gone.
  fake("ds-swap-reused", std::string(host) + " " + std::to_string(::getpid()) + " 1");
  const Plan p = plan_of(kTiny, 1, 0, nvme_at(dir, {"zero_optimization.stage=3"}));
  OptimizerSwapper live(p, 0, 3);  // its own directory is alive
  std::vector<std::string> found;
  for (const StaleSwap& s : stale_swap_directories(dir.string())) {
    found.push_back(fs::path(s.path).filename().string());
    EXPECT_GE(s.bytes, 10000u);
  }
  std::sort(found.begin(), found.end());
  EXPECT_EQ(found, (std::vector<std::string>{"ds-swap-dead", "ds-swap-reused"}));
}
