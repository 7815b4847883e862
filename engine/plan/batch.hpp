// ds — the batch triangle: train_batch_size = micro batch x gradient accumulation x data-parallel
// world size. Resolution follows DeepSpeed's table (deepspeed/runtime/config.py), except that
// combinations that do not divide evenly are rejected up front, showing the arithmetic.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace ds {

struct BatchInputs {
  std::optional<int64_t> train_batch_size, micro_batch, grad_accum;  // empty: not given or "auto"
  int world_size = 1;
  std::string world_size_source;
  std::string world_name = "world size";  // what the ranks the batch counts are called: a mesh's are its data-parallel ones
};

struct ResolvedBatch {
  int64_t train_batch_size = 0, micro_batch = 0, grad_accum = 0;
  int world_size = 1;
  std::string derivation;  // how the missing values were computed, e.g. "gradient_accumulation_steps = 32 / (4 x 2) = 4"
};

// Throws ConfigError with the arithmetic when the three cannot agree, and when neither
// train_batch_size nor the micro batch is known.
ResolvedBatch resolve_batch(const BatchInputs& in);

}  // namespace ds
