// ds — the matmul rate this machine reaches at a model's own GEMM shapes: the peak that ds profile
// reports MFU against, measured in the same run rather than taken from a datasheet.
#pragma once

#include <cstdint>
#include <map>
#include <utility>

#include "engine/plan/model_spec.hpp"
#include "engine/plan/plan.hpp"
#include "engine/runtime/device/device.hpp"

namespace ds {

struct GemmPeak {
  double flops_per_s = 0;  // the shapes' FLOPs over their measured time, each weighted by its share of a step
  double seconds = 0;      // spent measuring
  int shapes = 0;          // distinct (m, k, n) timed
};

// A step's distinct products as (k, n), each with the FLOPs `tokens` rows spend in it: every linear layer's and
// the output head's. `host`: the model runs where the host's memory is; off it the head's products are cut to the
// vocabulary's aligned part as training cuts them (head_product_vocab), since cuBLAS runs an odd vocabulary
// (GPT-2's 50257) on slow kernels for unaligned data that training never uses: timed whole, it made the peak
// 255 TFLOP/s on an H200 whose training ran its products at about 625, and ds profile's MFU 134%.
std::map<std::pair<int64_t, int64_t>, double> gemm_shapes(const ModelSpec& model, int64_t tokens, bool host);

// Times `tokens` x k x n products in `dtype` for each of gemm_shapes,
// about `budget_s` in all, in `device`'s memory (the CPU's threads already set, or a GPU), its compute stream
// waited for before each reading of the clock (a GPU's queued work counts once it ran). The operands are the
// device's own allocations, freed when done: none stays in LibTorch's cache to swell the GPU memory the profile
// measures after a step. The attention core's batched T x T products are not included (they are small and
// run as many GEMMs).
GemmPeak measure_gemm_peak(const ModelSpec& model, int64_t tokens, Dtype dtype, Device& device, double budget_s = 1.0);

}  // namespace ds
