// ds — a pool for the large, short-lived blocks of a training step (tensor data), apart from malloc's heap.
//
// Why: a step allocates and frees the same large tensors in the same order every step. In glibc's heap
// they sit among small long-lived objects (autograd nodes, vectors) and the few-byte pieces that 64-byte
// aligned allocation splits off; those pin the holes large blocks leave, so the heap's top keeps rising
// for a while after the live bytes stop doing so (bench/RESULTS.md: 7.7 MiB above a 13 MiB live peak on
// the quickstart). Here large blocks only meet each other: a freed block merges with free neighbours and
// the smallest free span that fits is taken, lowest address first. Memory is never handed back to the
// system (like the trainer's malloc settings): a step reuses what the last one touched, without page faults.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ds {

class BlockPool {
 public:
  // Blocks are carved from regions of reserved address space, reserve_bytes each unless a request needs
  // more; pages become writable commit_step at a time as the highest block handed out rises. Block sizes
  // round up to `granule`, which is also their alignment.
  explicit BlockPool(std::size_t reserve_bytes = std::size_t{256} << 30, std::size_t granule = 4096,
                     std::size_t commit_step = std::size_t{2} << 20);
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // A block of at least n bytes aligned to the granule; a UserError (exit 1, with what to change) when the
  // system refuses the address space or the memory.
  void* allocate(std::size_t n);
  // Gives back a block allocate() handed out; false (and nothing done) when p is not in the pool's
  // address space at all, so one deleter can serve the pool's blocks and malloc's.
  bool release(void* p);
  bool owns(const void* p) const;

  struct Stats {
    std::size_t live_bytes = 0;      // handed out now (rounded sizes)
    std::size_t peak_live_bytes = 0;  // the most ever handed out at once
    std::size_t reserved_bytes = 0;    // address space of all regions
    std::size_t writable_bytes = 0;    // of which made writable
    std::size_t high_water_bytes = 0;  // per region, up to the end of the highest block ever handed out,
                                       // summed: an upper bound on the pool's resident pages
    std::size_t free_spans = 0;
  };
  Stats stats() const;
  // peak_live_bytes counts again from what is live now: the most of one phase (a forward, a backward).
  void restart_peak();

 private:
  struct Region {
    std::uintptr_t base;
    std::size_t bytes;
    std::size_t writable;    // from base
    std::size_t high_water;  // from base to the end of the highest block ever handed out
    bool contains(std::uintptr_t a) const { return a >= base && a < base + bytes; }
  };
  void add_region(std::size_t at_least);
  Region& region_of(std::uintptr_t a);
  bool make_writable(Region& r, std::uintptr_t end);
  void insert_free(std::uintptr_t at, std::size_t n);
  void erase_free(std::map<std::uintptr_t, std::size_t>::iterator it);

  std::size_t reserve_bytes_;
  std::size_t granule_;
  std::size_t commit_step_;
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, std::size_t> free_by_address_;
  std::set<std::pair<std::size_t, std::uintptr_t>> free_by_size_;
  std::unordered_map<std::uintptr_t, std::size_t> used_;
  std::vector<Region> regions_;
  std::size_t live_ = 0;
  std::size_t peak_live_ = 0;
};

// Routes LibTorch's CPU tensor allocations of at least `min_bytes` to one process-wide BlockPool (never
// destroyed: tensors may outlive any scope); smaller ones stay with malloc. Idempotent; the first call's
// threshold holds. Returns the pool, for its stats. (In block_pool_torch.cpp, the LibTorch part.)
const BlockPool& route_large_tensors_to_pool(std::size_t min_bytes = std::size_t{64} << 10);
// The routed pool's restart_peak (route_large_tensors_to_pool first).
void restart_pooled_peak();

}  // namespace ds
