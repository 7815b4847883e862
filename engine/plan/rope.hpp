// ds — the rotary embedding's frequencies, as Hugging Face's modeling_rope_utils computes them for each
// rope_type (default, linear, dynamic, llama3, yarn), in double: the models cast them to their dtype. Pure
// arithmetic, so the plan, the models and the tests read one definition.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/plan/model_spec.hpp"

namespace ds {

struct RotaryTables {
  std::vector<double> inv_freq;  // head_dim / 2 inverse frequencies: angle(t, j) = t * inv_freq[j]
  double attention_factor = 1;    // cos and sin are scaled by it (yarn)
};

// For a sequence of `seq_len` positions (dynamic scaling stretches the base only past the model's context).
RotaryTables rotary_tables(const ModelHyper& hp, int64_t seq_len);

}  // namespace ds
