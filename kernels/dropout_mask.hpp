// ds — dropout's mask as a function of a counter, written once for the CPU's kernel and the GPU's: element i
// of a dropout site keyed `key` is kept when the top 32 bits of splitmix64(key + i γ) fall below
// `keep_below` (γ splitmix64's own increment, so consecutive elements are consecutive outputs of one
// splitmix64 stream). Nothing is drawn or stored: a mask is recomputed wherever it is needed (backward, a
// recomputed block, a resumed run), on either device, bit for bit.
#pragma once

#include <cstdint>

#include "common/hash.hpp"
#include "common/host_device.hpp"

namespace ds::kernels {

constexpr uint64_t kDropoutStride = 0x9E3779B97F4A7C15ull;

DS_HOST_DEVICE bool dropout_keeps(uint64_t key, uint64_t i, uint32_t keep_below) {
  return static_cast<uint32_t>(splitmix64(key + i * kDropoutStride) >> 32) < keep_below;
}

// The threshold for dropping with probability p in (0, 1): each element is kept with probability 1 - p
// to within 2^-32.
inline uint32_t dropout_keep_below(double p) {
  const double keep = (1.0 - p) * 4294967296.0;
  return keep >= 4294967295.0 ? 0xffffffffu : keep <= 0 ? 0u : static_cast<uint32_t>(keep);
}

}  // namespace ds::kernels
