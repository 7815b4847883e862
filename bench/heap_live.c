// An LD_PRELOAD counter of the bytes malloc has handed out and not yet had back (malloc_usable_size of
// each block), with the most seen since heap_live_restart(). bench/bench_heap.sh reads it through gdb
// to set ds's plan against the live heap, apart from the allocator's slack that RSS also holds.
#define _GNU_SOURCE
#include <malloc.h>
#include <stdatomic.h>
#include <stddef.h>

extern void* __libc_malloc(size_t);
extern void* __libc_calloc(size_t, size_t);
extern void* __libc_realloc(void*, size_t);
extern void* __libc_memalign(size_t, size_t);
extern void __libc_free(void*);

static atomic_long live_bytes, most_bytes;

static void* counted(void* p) {
  if (!p) return p;
  const long now = atomic_fetch_add(&live_bytes, (long)malloc_usable_size(p)) + (long)malloc_usable_size(p);
  long most = atomic_load(&most_bytes);
  while (now > most && !atomic_compare_exchange_weak(&most_bytes, &most, now)) {
  }
  return p;
}
static void uncount(void* p) {
  if (p) atomic_fetch_sub(&live_bytes, (long)malloc_usable_size(p));
}

void* malloc(size_t n) { return counted(__libc_malloc(n)); }
void* calloc(size_t n, size_t size) { return counted(__libc_calloc(n, size)); }
void* memalign(size_t align, size_t n) { return counted(__libc_memalign(align, n)); }
void* aligned_alloc(size_t align, size_t n) { return counted(__libc_memalign(align, n)); }
void free(void* p) {
  uncount(p);
  __libc_free(p);
}
void* realloc(void* old, size_t n) {
  const long before = old ? (long)malloc_usable_size(old) : 0;
  void* p = __libc_realloc(old, n);
  if (!p) {  // realloc(old, 0) freed it; any other failure left it held
    if (n == 0) atomic_fetch_sub(&live_bytes, before);
    return p;
  }
  atomic_fetch_sub(&live_bytes, before);
  return counted(p);
}
int posix_memalign(void** out, size_t align, size_t n) {
  void* p = __libc_memalign(align, n);
  if (!p) return 12;  // ENOMEM
  *out = counted(p);
  return 0;
}

long heap_live_now(void) { return atomic_load(&live_bytes); }
long heap_live_most(void) { return atomic_load(&most_bytes); }
void heap_live_restart(void) { atomic_store(&most_bytes, atomic_load(&live_bytes)); }
