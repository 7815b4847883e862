// The pool that serves a step's large tensors (engine/runtime/device/block_pool.hpp): blocks disjoint, aligned and
// intact; freed neighbours merge; the smallest fitting span is taken; a repeated step stops growing the
// pool after its first pass; threads share it; requests beyond a reservation get a region of their own.
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "common/error.hpp"
#include "engine/runtime/device/block_pool.hpp"

using namespace ds;

namespace {

constexpr std::size_t kGranule = 4096;
std::size_t rounded(std::size_t n) { return (std::max<std::size_t>(n, 1) + kGranule - 1) / kGranule * kGranule; }

struct Block {
  unsigned char* p;
  std::size_t n;
  unsigned char fill;
};

void fill(const Block& b) { std::memset(b.p, b.fill, b.n); }
bool intact(const Block& b) {
  return std::all_of(b.p, b.p + b.n, [&](unsigned char c) { return c == b.fill; });
}

}  // namespace

TEST(BlockPool, BlocksAreAlignedDisjointAndKeepTheirData) {
  BlockPool pool(std::size_t{64} << 20);
  std::mt19937 rng(7);
  std::vector<Block> held;
  std::size_t live = 0;  // counted here, apart from the pool's own books
  for (int i = 0; i < 400; ++i) {
    if (!held.empty() && rng() % 3 == 0) {
      const std::size_t k = rng() % held.size();
      ASSERT_TRUE(intact(held[k])) << "block " << k << " was overwritten";
      live -= rounded(held[k].n);
      pool.release(held[k].p);
      held.erase(held.begin() + static_cast<std::ptrdiff_t>(k));
      continue;
    }
    const std::size_t n = 1 + rng() % (300 * 1024);  // awkward sizes, most not a page multiple
    Block b{static_cast<unsigned char*>(pool.allocate(n)), n, static_cast<unsigned char>(i)};
    ASSERT_EQ(reinterpret_cast<std::uintptr_t>(b.p) % kGranule, 0u);
    ASSERT_TRUE(pool.owns(b.p));
    ASSERT_TRUE(pool.owns(b.p + n - 1));
    fill(b);
    held.push_back(b);
    live += rounded(n);
    EXPECT_EQ(pool.stats().live_bytes, live);
  }
  std::vector<Block> by_address = held;
  std::sort(by_address.begin(), by_address.end(), [](const Block& a, const Block& b) { return a.p < b.p; });
  for (std::size_t i = 1; i < by_address.size(); ++i)
    EXPECT_LE(by_address[i - 1].p + rounded(by_address[i - 1].n), by_address[i].p) << "blocks overlap";
  for (const Block& b : held) {
    EXPECT_TRUE(intact(b));
    pool.release(b.p);
  }
  const BlockPool::Stats s = pool.stats();
  EXPECT_EQ(s.live_bytes, 0u);
  EXPECT_EQ(s.free_spans, 1u) << "every freed block merged back into its region's one free span";
  EXPECT_FALSE(pool.owns(&s));
}

TEST(BlockPool, FreedNeighboursMergeAndTheSmallestFittingSpanIsTaken) {
  BlockPool pool(std::size_t{64} << 20);
  auto* a = static_cast<unsigned char*>(pool.allocate(5 * kGranule));
  auto* b = static_cast<unsigned char*>(pool.allocate(kGranule));
  auto* c = static_cast<unsigned char*>(pool.allocate(3 * kGranule));
  auto* d = static_cast<unsigned char*>(pool.allocate(kGranule));
  ASSERT_EQ(b, a + 5 * kGranule);  // carved in order from the region's start
  ASSERT_EQ(c, b + kGranule);
  ASSERT_EQ(d, c + 3 * kGranule);
  pool.release(a);  // holes: 5 granules at a, then 3 at c
  pool.release(c);
  EXPECT_EQ(pool.allocate(3 * kGranule), c) << "the smallest hole that fits, not the first by address";
  EXPECT_EQ(pool.allocate(4 * kGranule), a) << "the only hole left that fits, before the region's free end";
  auto* e = static_cast<unsigned char*>(pool.allocate(kGranule));
  EXPECT_EQ(e, a + 4 * kGranule) << "what was left of a's hole";
  pool.release(b);
  pool.release(e);  // e and b merge: 2 granules
  pool.release(a);  // and a's 4 with them: one 6-granule span
  EXPECT_EQ(pool.stats().free_spans, 2u) << "the merged span and the region's free end";
  EXPECT_EQ(pool.allocate(6 * kGranule), a);
  (void)d;
}

// A training step allocates and frees the same sizes in the same order every step; the pool's high-water
// mark (what can be resident) must stop rising after the first steps, not creep as glibc's heap top did.
TEST(BlockPool, ARepeatedStepStopsGrowingThePoolAfterItsFirstPass) {
  BlockPool pool(std::size_t{256} << 20);
  std::mt19937 rng(11);
  std::vector<std::size_t> forward(40), backward(40);
  for (auto& n : forward) n = 64 * 1024 + rng() % (2 << 20);
  for (auto& n : backward) n = 64 * 1024 + rng() % (2 << 20);
  void* weights = pool.allocate(3 << 20);  // lives through every step
  std::size_t most_live = 0, live = rounded(3 << 20);
  const auto step = [&] {
    std::vector<void*> saved;
    for (std::size_t n : forward) {
      saved.push_back(pool.allocate(n));
      void* scratch = pool.allocate(n / 2 + 4096);  // an op's temporary
      live += rounded(n) + rounded(n / 2 + 4096);
      most_live = std::max(most_live, live);
      pool.release(scratch);
      live -= rounded(n / 2 + 4096);
    }
    for (std::size_t i = 0; i < backward.size(); ++i) {
      void* grad = pool.allocate(backward[i]);
      live += rounded(backward[i]);
      most_live = std::max(most_live, live);
      pool.release(saved.back());
      live -= rounded(forward[forward.size() - 1 - i]);
      saved.pop_back();
      pool.release(grad);
      live -= rounded(backward[i]);
    }
  };
  step();
  step();
  const std::size_t settled = pool.stats().high_water_bytes;
  for (int i = 0; i < 30; ++i) step();
  const BlockPool::Stats s = pool.stats();
  EXPECT_EQ(s.high_water_bytes, settled);
  EXPECT_EQ(s.peak_live_bytes, most_live);
  EXPECT_GE(s.high_water_bytes, most_live);
  EXPECT_GE(s.writable_bytes, s.high_water_bytes);
  EXPECT_EQ(s.writable_bytes % (std::size_t{2} << 20), 0u) << "made writable a commit step at a time";
  pool.release(weights);
}

TEST(BlockPool, ARequestBeyondTheReservationGetsARegionOfItsOwn) {
  BlockPool pool(std::size_t{1} << 20);
  void* small = pool.allocate(512 * 1024);
  auto* big = static_cast<unsigned char*>(pool.allocate(std::size_t{5} << 20));
  std::memset(big, 1, std::size_t{5} << 20);  // writable all through
  EXPECT_TRUE(pool.owns(big + (std::size_t{5} << 20) - 1));
  BlockPool::Stats s = pool.stats();
  EXPECT_EQ(s.reserved_bytes, (std::size_t{1} << 20) + (std::size_t{5} << 20));
  EXPECT_EQ(s.live_bytes, (std::size_t{512} << 10) + (std::size_t{5} << 20));
  pool.release(big);
  pool.release(small);
  EXPECT_EQ(pool.stats().free_spans, 2u) << "regions are not merged with each other";
}

TEST(BlockPool, TwoThreadsShareItWithoutTouchingEachOthersBlocks) {
  BlockPool pool(std::size_t{64} << 20);
  bool ok[2] = {true, true};
  const auto work = [&](int id) {
    std::mt19937 rng(static_cast<unsigned>(100 + id));
    std::vector<Block> held;
    for (int i = 0; i < 3000; ++i) {
      if (held.size() > 8 || (!held.empty() && rng() % 2)) {
        ok[id] = ok[id] && intact(held.back());
        pool.release(held.back().p);
        held.pop_back();
      } else {
        const std::size_t n = 1 + rng() % (128 * 1024);
        Block b{static_cast<unsigned char*>(pool.allocate(n)), n, static_cast<unsigned char>(id * 100 + i % 100)};
        fill(b);
        held.push_back(b);
      }
    }
    for (const Block& b : held) {
      ok[id] = ok[id] && intact(b);
      pool.release(b.p);
    }
  };
  std::thread t0(work, 0), t1(work, 1);
  t0.join();
  t1.join();
  EXPECT_TRUE(ok[0]);
  EXPECT_TRUE(ok[1]);
  EXPECT_EQ(pool.stats().live_bytes, 0u);
}

#if defined(__SANITIZE_ADDRESS__)
#define DS_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DS_TEST_ASAN 1
#endif
#endif

#if !defined(DS_TEST_ASAN)  // AddressSanitizer's shadow memory cannot live under an address-space limit
// When the system refuses memory the run ends with a sentence that says so and what to change, not
// "std::bad_alloc". A child process under a small address-space limit (ulimit -v) asks for 1 GiB.
TEST(BlockPoolDeathTest, MemoryTheSystemRefusesEndsWithAnErrorThatSaysWhatToChange) {
  EXPECT_EXIT(
      {
        BlockPool pool(std::size_t{1} << 30);
        rlimit limit{};
        getrlimit(RLIMIT_AS, &limit);
        std::FILE* maps = std::fopen("/proc/self/statm", "r");
        unsigned long pages = 0;
        if (!maps || std::fscanf(maps, "%lu", &pages) != 1) std::exit(4);
        limit.rlim_cur = pages * 4096 + (std::size_t{64} << 20);
        setrlimit(RLIMIT_AS, &limit);
        try {
          pool.allocate(std::size_t{1} << 30);
        } catch (const UserError& e) {
          std::fprintf(stderr, "%s | %s\n", e.what(), e.hint().c_str());
          std::exit(e.exit_code() == kExitRuntime ? 3 : 5);
        }
        std::exit(0);
      },
      testing::ExitedWithCode(3), "out of memory: the system refused 1.00 GiB for a tensor.*ds plan CONFIG");
}
#endif

#if defined(DS_TEST_ASAN)
// Under AddressSanitizer the pool keeps what is not handed out poisoned: a tensor read one byte past its
// end, or after it was released, is reported as it would be in malloc's heap.
TEST(BlockPoolDeathTest, AddressSanitizerSeesReadsPastABlockAndAfterRelease) {
  BlockPool pool(std::size_t{64} << 20);
  auto* p = static_cast<volatile unsigned char*>(pool.allocate(100000));
  EXPECT_DEATH((void)p[100000], "AddressSanitizer");
  pool.release(const_cast<unsigned char*>(p));
  EXPECT_DEATH((void)p[0], "AddressSanitizer");
}
#endif
