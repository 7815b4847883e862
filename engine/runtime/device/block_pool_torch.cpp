// LibTorch's CPU allocator, with large blocks from a BlockPool (engine/runtime/device/block_pool.hpp).
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <cstring>
#include <mutex>
#include <utility>

#include "common/error.hpp"
#include "engine/runtime/device/block_pool.hpp"

namespace ds {
namespace {

BlockPool* g_pool = nullptr;

// One deleter for both kinds of block: LibTorch's raw_allocate/raw_deallocate (oneDNN's workspaces) need it.
void release_block(void* p) {
  if (!g_pool->release(p)) c10::free_cpu(p);
}

class PooledCpuAllocator final : public c10::Allocator {
 public:
  explicit PooledCpuAllocator(std::size_t min_bytes) : min_bytes_(min_bytes) {}
  // LibTorch 1.13 declares allocate() const, LibTorch 2.x not: both are defined (no `override`), and each
  // version's pure virtual is overridden by the one that matches it.
  c10::DataPtr allocate(std::size_t n) const {
    void* p = n < min_bytes_ ? c10::alloc_cpu(n) : g_pool->allocate(n);
    return {p, p, &release_block, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DataPtr allocate(std::size_t n) { return std::as_const(*this).allocate(n); }
  c10::DeleterFnPtr raw_deleter() const override { return &release_block; }
  // Pure virtual in LibTorch 2.x (not declared in 1.13, hence no `override`).
  void copy_data(void* dest, const void* src, std::size_t n) const { std::memcpy(dest, src, n); }

 private:
  std::size_t min_bytes_;
};

}  // namespace

const BlockPool& route_large_tensors_to_pool(std::size_t min_bytes) {
  static std::once_flag once;
  std::call_once(once, [&] {
    g_pool = new BlockPool();  // never deleted: a tensor may be freed during exit
    // Above the default's priority (0), so empty(), zeros() and every op's output use it.
    c10::SetCPUAllocator(new PooledCpuAllocator(min_bytes), 1);
  });
  return *g_pool;
}

void restart_pooled_peak() {
  DS_CHECK(g_pool != nullptr, "restart_pooled_peak: no pool routed (route_large_tensors_to_pool first)");
  g_pool->restart_peak();
}

}  // namespace ds
