#include "kernels/cpu/embedding.hpp"

#include <algorithm>
#include <numeric>
#include <vector>

#include "kernels/cpu/simd.hpp"

namespace ds::kernels {
namespace {

// The batch's positions ordered by id (stable: equal ids keep their batch order), and where each id's
// run starts.
struct Runs {
  std::vector<int64_t> order, starts;
};

Runs runs_of(const int64_t* ids, int64_t n) {
  Runs r;
  r.order.resize(static_cast<size_t>(n));
  std::iota(r.order.begin(), r.order.end(), int64_t{0});
  std::stable_sort(r.order.begin(), r.order.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  for (int64_t i = 0; i < n; ++i)
    if (i == 0 || ids[r.order[static_cast<size_t>(i)]] != ids[r.order[static_cast<size_t>(i - 1)]]) r.starts.push_back(i);
  r.starts.push_back(n);
  return r;
}

// One id's rows into its table row g, a column at a time, summed in double.
template <class T>
void add_run_reference(T* g, const T* dy, const int64_t* rows, int64_t count, int64_t width) {
  for (int64_t c = 0; c < width; ++c) {
    double sum = 0;
    for (int64_t i = 0; i < count; ++i) sum += widen(dy[rows[i] * width + c]);
    narrow(g + c, widen(g[c]) + sum);
  }
}

#if defined(__x86_64__)
// One id's rows, 16 columns at a time: summed in fp32 registers, added to the table once.
template <class T>
DS_AVX512 void add_run_avx512(T* g, const T* dy, const int64_t* rows, int64_t count, int64_t width) {
  for (int64_t c = 0; c < width; c += 16) {
    const __mmask16 m = simd::first_lanes(width - c);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < count; ++i) acc = _mm512_add_ps(acc, simd::load(dy + rows[i] * width + c, m));
    simd::store(g + c, m, _mm512_add_ps(simd::load(g + c, m), acc));
  }
}
#endif

template <class T>
void run(T* grad, const int64_t* ids, const T* dy, int64_t n, int64_t width, bool reference) {
  const Runs r = runs_of(ids, n);
  const int64_t runs = static_cast<int64_t>(r.starts.size()) - 1;
  // Each run is a different row of the table: threads never share one.
#pragma omp parallel for schedule(dynamic, 8) if (!reference && runs * width > (1 << 16))
  for (int64_t k = 0; k < runs; ++k) {
    const int64_t begin = r.starts[static_cast<size_t>(k)], count = r.starts[static_cast<size_t>(k) + 1] - begin;
    const int64_t* rows = r.order.data() + begin;
    T* g = grad + ids[rows[0]] * width;
#if defined(__x86_64__)
    if (!reference && simd::has_avx512()) {
      add_run_avx512(g, dy, rows, count, width);
      continue;
    }
#endif
    add_run_reference(g, dy, rows, count, width);
  }
}

}  // namespace

void embedding_backward_f32(float* grad, const int64_t* ids, const float* dy, int64_t n, int64_t width) {
  run(grad, ids, dy, n, width, false);
}
void embedding_backward_bf16(uint16_t* grad, const int64_t* ids, const uint16_t* dy, int64_t n, int64_t width) {
  run(grad, ids, dy, n, width, false);
}
void embedding_backward_f32_reference(float* grad, const int64_t* ids, const float* dy, int64_t n, int64_t width) {
  run(grad, ids, dy, n, width, true);
}
void embedding_backward_bf16_reference(uint16_t* grad, const int64_t* ids, const uint16_t* dy, int64_t n, int64_t width) {
  run(grad, ids, dy, n, width, true);
}

}  // namespace ds::kernels
