// ds — the one integer hash used wherever ds needs reproducible pseudo-randomness from a counter
// (sample positions, the synthetic language): splitmix64 (Steele, Lea and Flood, 2014).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/host_device.hpp"

namespace ds {

DS_HOST_DEVICE uint64_t splitmix64(uint64_t x) {  // also in CUDA kernels (dropout)
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A 64-bit checksum of a byte range (four independent multiply-xorshift lanes over 8-byte words, then
// the tail, then the length): catches flipped bits and torn writes in checkpoint data. Not cryptographic.
inline uint64_t checksum64(const void* data, size_t n) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint64_t lane[4] = {0x243F6A8885A308D3ull, 0x13198A2E03707344ull, 0xA4093822299F31D0ull, 0x082EFA98EC4E6C89ull};
  size_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      __builtin_memcpy(&w, p + i + 8 * k, 8);
      lane[k] = (lane[k] ^ w) * 0x9E3779B97F4A7C15ull;
      lane[k] ^= lane[k] >> 29;
    }
  uint64_t h = splitmix64(lane[0]) ^ splitmix64(lane[1] + 1) ^ splitmix64(lane[2] + 2) ^ splitmix64(lane[3] + 3);
  for (; i < n; ++i) h = splitmix64(h ^ p[i]);
  return splitmix64(h ^ static_cast<uint64_t>(n));
}

// A model's weights as one checksum: each tensor's fp32 values in state_dict order folded in (a LoRA run
// records its frozen base so; ds convert-ckpt --merge checks a base against it).
constexpr uint64_t kWeightsChecksumSeed = 0x6c6f72615f626173ull;  // "lora_bas"
inline uint64_t fold_weights_checksum(uint64_t h, const float* values, int64_t n) {
  return splitmix64(h ^ checksum64(values, static_cast<size_t>(n) * sizeof(float)));
}

// 16 hex digits of a 64-bit value.
inline std::string hex64(uint64_t h) {
  static const char* digits = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, h >>= 4) out[static_cast<size_t>(i)] = digits[h & 15];
  return out;
}

// A file's identity as ds records it (a run's tokenizer files): checksum64 of its bytes, 16 hex digits.
inline std::string checksum64_hex(const std::string& bytes) { return hex64(checksum64(bytes.data(), bytes.size())); }

}  // namespace ds
