#include "engine/runtime/device/block_pool.hpp"

#include <sys/mman.h>

#include <algorithm>

#include "common/error.hpp"
#include "common/format.hpp"

#if defined(__SANITIZE_ADDRESS__)
#define DS_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DS_ASAN 1
#endif
#endif

#if defined(DS_ASAN)
#include <sanitizer/asan_interface.h>
// Free spans and the rounding past a block's requested size stay poisoned, so AddressSanitizer still
// catches a read past a tensor's end or after its release, as it would in malloc's heap.
#define DS_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define DS_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define DS_POISON(p, n) ((void)(p), (void)(n))
#define DS_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace ds {
namespace {
std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

[[noreturn]] void out_of_memory(std::size_t bytes, std::size_t live) {
  throw UserError("out of memory: the system refused " + format_bytes(static_cast<double>(bytes)) + " for a tensor (tensors hold " +
                      format_bytes(static_cast<double>(live)) + " now)",
                  "`ds plan CONFIG` shows what a rank needs; lower train_micro_batch_size_per_gpu, set "
                  "model.activation_checkpointing=true, or offload (zero_optimization.offload_optimizer.device=cpu or nvme)",
                  kExitRuntime);
}
}  // namespace

BlockPool::BlockPool(std::size_t reserve_bytes, std::size_t granule, std::size_t commit_step)
    : reserve_bytes_(round_up(std::max(reserve_bytes, granule), granule)), granule_(granule), commit_step_(commit_step) {}

BlockPool::~BlockPool() {
  for (const Region& r : regions_) munmap(reinterpret_cast<void*>(r.base), r.bytes);
}

void BlockPool::add_region(std::size_t at_least) {
  // Address space only (PROT_NONE is neither resident nor charged against the commit limit); pages are
  // made writable as the highest block handed out rises, and become resident as tensors first write them.
  // One large region keeps the free space in one piece, as a heap's top is; where the system refuses that
  // much address space (ulimit -v), less is asked for.
  std::size_t bytes = std::max(reserve_bytes_, at_least);
  void* base = MAP_FAILED;
  while (true) {
    base = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base != MAP_FAILED || bytes / 2 < at_least) break;
    bytes = round_up(bytes / 2, granule_);
  }
  if (base == MAP_FAILED) out_of_memory(at_least, live_);
  regions_.push_back({reinterpret_cast<std::uintptr_t>(base), bytes, 0, 0});
  // Regions are never merged: each has its own writable part.
  free_by_address_.emplace(regions_.back().base, bytes);
  free_by_size_.emplace(bytes, regions_.back().base);
}

BlockPool::Region& BlockPool::region_of(std::uintptr_t a) {
  for (Region& r : regions_)
    if (r.contains(a)) return r;
  std::abort();  // a span outside every region: the pool's own books are wrong
}

bool BlockPool::make_writable(Region& r, std::uintptr_t end) {
  const std::size_t need = end - r.base;
  if (need > r.writable) {
    const std::size_t to = std::min(r.bytes, round_up(need, commit_step_));
    if (mprotect(reinterpret_cast<void*>(r.base + r.writable), to - r.writable, PROT_READ | PROT_WRITE) != 0) return false;
    DS_POISON(reinterpret_cast<void*>(r.base + r.writable), to - r.writable);
    r.writable = to;
  }
  r.high_water = std::max(r.high_water, need);
  return true;
}

void BlockPool::erase_free(std::map<std::uintptr_t, std::size_t>::iterator it) {
  free_by_size_.erase({it->second, it->first});
  free_by_address_.erase(it);
}

void BlockPool::insert_free(std::uintptr_t at, std::size_t n) {
  const std::uintptr_t region = region_of(at).base;
  auto next = free_by_address_.lower_bound(at);
  if (next != free_by_address_.end() && next->first == at + n && region_of(next->first).base == region) {
    n += next->second;
    erase_free(next++);
  }
  if (next != free_by_address_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == at && region_of(prev->first).base == region) {
      at = prev->first;
      n += prev->second;
      erase_free(prev);
    }
  }
  free_by_address_.emplace(at, n);
  free_by_size_.emplace(n, at);
}

void* BlockPool::allocate(std::size_t n) {
  const std::size_t bytes = round_up(std::max<std::size_t>(n, 1), granule_);
  std::lock_guard<std::mutex> lock(mutex_);
  // The smallest free span that fits, the lowest such: a step's repeated sizes land in last step's holes.
  auto fit = free_by_size_.lower_bound({bytes, 0});
  if (fit == free_by_size_.end()) {
    add_region(bytes);
    fit = free_by_size_.lower_bound({bytes, 0});
  }
  const std::uintptr_t at = fit->second;
  const std::size_t span = fit->first;
  if (!make_writable(region_of(at), at + bytes)) out_of_memory(bytes, live_);
  erase_free(free_by_address_.find(at));
  if (span > bytes) {  // the rest stays free, at the higher addresses
    free_by_address_.emplace(at + bytes, span - bytes);
    free_by_size_.emplace(span - bytes, at + bytes);
  }
  used_.emplace(at, bytes);
  live_ += bytes;
  peak_live_ = std::max(peak_live_, live_);
  DS_UNPOISON(reinterpret_cast<void*>(at), n);
  return reinterpret_cast<void*>(at);
}

bool BlockPool::release(void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<std::mutex> lock(mutex_);
  if (std::none_of(regions_.begin(), regions_.end(), [&](const Region& r) { return r.contains(a); })) return false;
  const auto it = used_.find(a);
  if (it == used_.end()) std::abort();  // inside the pool but not handed out (released twice): memory is already corrupt
  const std::size_t bytes = it->second;
  used_.erase(it);
  live_ -= bytes;
  DS_POISON(p, bytes);
  insert_free(a, bytes);
  return true;
}

bool BlockPool::owns(const void* p) const {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<std::mutex> lock(mutex_);
  return std::any_of(regions_.begin(), regions_.end(), [&](const Region& r) { return r.contains(a); });
}

void BlockPool::restart_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  peak_live_ = live_;
}

BlockPool::Stats BlockPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  Stats s;
  s.live_bytes = live_;
  s.peak_live_bytes = peak_live_;
  for (const Region& r : regions_) {
    s.reserved_bytes += r.bytes;
    s.writable_bytes += r.writable;
    s.high_water_bytes += r.high_water;
  }
  s.free_spans = free_by_address_.size();
  return s;
}

}  // namespace ds
