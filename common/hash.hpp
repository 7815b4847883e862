// ds — the one integer hash used wherever ds needs reproducible pseudo-randomness from a counter
// (sample positions, the synthetic language): splitmix64 (Steele, Lea and Flood, 2014).
#pragma once

#include <cstdint>

namespace ds {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace ds
