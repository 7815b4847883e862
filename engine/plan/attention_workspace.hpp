// ds — what the attention kernels allocate beside their inputs, as arithmetic: the tile sizes they work
// in and the bytes of their copies. The plan counts these bytes in its activation model; the kernels
// (kernels/cpu/attention_tiles*) size their buffers by the same formulas, so the two cannot disagree.
// Pure: the plan layer includes no kernel.
#pragma once

#include <cstdint>

namespace ds::workspace {

// Queries and keys per tile: a 64 x 64 fp32 tile is 16 KiB, L1-sized. The plan counts the kernels'
// copies of K and V in whole tiles.
constexpr int64_t kAttentionTile = 64;
// AMX's k step: the bf16 kernels pad D to a multiple of it.
constexpr int64_t kAttentionBf16Step = 32;
// n rounded up to a multiple of m (T to whole tiles, D to whole AMX steps).
inline int64_t attention_padded(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// What the fp32 kernels' backward copies: K^T, V^T and K per kv head, T in whole tiles.
inline int64_t attention_tiles_f32_backward_bytes(int64_t B, int64_t NKV, int64_t T, int64_t D) {
  return 3 * B * NKV * attention_padded(T, kAttentionTile) * D * 4;
}

// What the bf16 kernels allocate. Forward: k and v of every kv head in their AMX layouts, and per thread
// a tile of q, scores, probabilities and output. Backward, per (sample, kv head) task, one per thread at
// a time: k (twice) and v, one query head's q and dy in two layouts each, dK, dV and that head's dq^T in
// fp32, its lse and delta, and the tiles of one key tile against one query tile.
inline int64_t attention_tiles_bf16_forward_bytes(int64_t B, int64_t NKV, int64_t T, int64_t D, int64_t threads) {
  const int64_t Tp = attention_padded(T, kAttentionTile), Dp = attention_padded(D, kAttentionBf16Step);
  return 2 * B * NKV * Tp * Dp * 2 + threads * (kAttentionTile * Dp * (2 + 4) + kAttentionTile * kAttentionTile * (4 + 2));
}
inline int64_t attention_tiles_bf16_backward_task_bytes(int64_t T, int64_t D) {
  const int64_t Tp = attention_padded(T, kAttentionTile), Dp = attention_padded(D, kAttentionBf16Step);
  return Tp * Dp * (3 * 2 + 4 * 2 + 3 * 4) + Tp * 2 * 4 + kAttentionTile * kAttentionTile * (2 * 4 + 3 * 2);
}

}  // namespace ds::workspace
