// ds — the matmul rate this machine reaches at a model's own GEMM shapes: the peak that ds profile
// reports MFU against, measured in the same run rather than taken from a datasheet.
#pragma once

#include <cstdint>

#include "engine/plan/model_spec.hpp"
#include "engine/plan/plan.hpp"
#include "engine/runtime/device/device.hpp"

namespace ds {

struct GemmPeak {
  double flops_per_s = 0;  // the shapes' FLOPs over their measured time, each weighted by its share of a step
  double seconds = 0;      // spent measuring
  int shapes = 0;          // distinct (m, k, n) timed
};

// Times `tokens` x k x n products in `dtype` for every linear layer's (k, n) and the output head's,
// about `budget_s` in all, in `device`'s memory (the CPU's threads already set, or a GPU), its compute stream
// waited for before each reading of the clock (a GPU's queued work counts once it ran). The operands are the
// device's own allocations, freed when done: none stays in LibTorch's cache to swell the GPU memory the profile
// measures after a step. The attention core's batched T x T products are not included (they are small and
// run as many GEMMs).
GemmPeak measure_gemm_peak(const ModelSpec& model, int64_t tokens, Dtype dtype, Device& device, double budget_s = 1.0);

}  // namespace ds
