// ds — packing fine-tuning samples into rows (data.packing): several samples share one row of seq_len
// positions, each attending only to itself, so short samples cost no padding. Pure: the plan counts
// the rows an epoch holds (train.epochs) with the same function the sampler fills them with.
#pragma once

#include <cstdint>
#include <vector>

namespace ds {

// The positions a sample of `tokens` tokens takes in a row of `seq_len`: its inputs, one fewer than its
// tokens (the last is only a target), cut at seq_len.
int64_t sample_positions(int64_t tokens, int64_t seq_len);

// Rows of `seq_len` positions holding the samples whose token counts are `tokens`, by best fit in
// decreasing length (each sample, longest first, goes to the fullest row it still fits; ties to the
// first made): deterministic, and a row is left with room only when no later sample fits it.
// Each row lists its samples' indices ascending; rows are ordered by their first sample. A sample
// with no position (one token) is in no row.
std::vector<std::vector<int64_t>> pack_samples(const std::vector<int64_t>& tokens, int64_t seq_len);

}  // namespace ds
