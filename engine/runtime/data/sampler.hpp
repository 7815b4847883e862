// ds — which tokens each rank trains on. Sampling is counter-based: global sample g of the run starts
// at a position drawn from hash(seed, g) in the training split, so the loader's whole state is one
// number (the next global sample). That makes resume exact, and makes a step's global batch the same
// set of samples whatever the world size: step s owns samples [s*B, (s+1)*B) of the global batch B,
// and rank r's micro batch m takes samples s*B + (m*W + r)*b + [0, b) for micro batch size b.
// The validation split is the stream's last val_fraction, read in order. Without shuffling (data.shuffle
// false) sample g is the g-th window of seq_len + 1 tokens at a stride of seq_len, wrapping at the split's end.
// Over a SampleSet (fine-tuning data) a row is one sample: cut at seq_len + 1 tokens, padded after its end;
// a target the loss does not count (padding, a prompt's token) is -1. Sample g of the run is sample
// perm_e(g mod n) of epoch e = g / n, perm_e a permutation hashed from the seed and e (in file order
// without shuffling): each epoch sees every training sample once, on any world size.
// Packed (data.packing): the training samples are packed into rows once (engine/plan/packing.hpp), the
// validation samples into rows of their own, and the rows take the samples' place above: row g of the run
// is row perm_e(g mod rows). Each sample in a row is followed by the next; the padding after the last.
#pragma once

#include <cstdint>
#include <vector>

#include <string>

#include "engine/runtime/data/chat_data.hpp"
#include "engine/runtime/data/token_source.hpp"

namespace ds {

struct SamplerOptions {
  int64_t seq_len = 0;
  int64_t micro_batch = 0;
  int64_t grad_accum = 1;
  int world_size = 1;
  int rank = 0;
  double val_fraction = 0;
  uint64_t seed = 0;
  bool shuffle = true;  // false: sample g starts at (g mod the split's windows) x seq_len
  bool pack = false;    // over a SampleSet: several samples a row
};

// Per row of a batch, the lengths of the samples packed in it, in order, then the padding after them as a
// negative length (their magnitudes sum to seq_len); empty when the rows are not packed.
using RowSegments = std::vector<std::vector<int64_t>>;

class BatchSampler {
 public:
  // Throws UserError when the stream is too short for one sample in each split.
  BatchSampler(const TokenStream& stream, const SamplerOptions& o);
  // Throws UserError when a split would hold no sample.
  BatchSampler(const SampleSet& samples, const SamplerOptions& o);

  // Inputs and targets (targets are the inputs shifted by one) of this rank's micro batch `micro` of
  // optimizer step `step`; each is micro_batch x seq_len, row-major.
  // Packed rows also give their samples' lengths in `segments` (when given).
  void train_batch(int64_t step, int64_t micro, std::vector<int32_t>& inputs, std::vector<int32_t>& targets,
                   RowSegments* segments = nullptr) const;
  // Validation micro batch `index` (deterministic, in stream order, wrapping around).
  void val_batch(int64_t index, std::vector<int32_t>& inputs, std::vector<int32_t>& targets, RowSegments* segments = nullptr) const;

  int64_t train_tokens() const;
  int64_t val_tokens() const;
  // The start offset of global sample g (exposed for tests); over a SampleSet, the sample's index (packed:
  // the row's, whose samples row_samples gives).
  int64_t sample_offset(int64_t g) const;
  std::vector<int64_t> row_samples(int64_t row) const;
  bool packed() const { return !unit_starts_.empty(); }
  // What a user should know of the rows (samples cut at seq_len, the share of padding); "" for windows.
  std::string notes() const;

  // Rows whose targets the loss may leave out (fine-tuning samples). The loss of a step is then the mean
  // over every counted target of the step (all micro batches, all ranks), as Hugging Face's Trainer
  // weighs accumulated micro batches: each micro batch's mean weighs its share of the step's targets.
  bool masked() const { return samples_ != nullptr; }
  // Counted targets of this rank's micro batch `micro` of `step`, and of the whole step on every rank
  // (read from the data itself, so no rank needs to ask the others).
  int64_t counted_targets(int64_t step, int64_t micro) const;
  int64_t step_counted_targets(int64_t step) const;
  // The step's rows (every rank's): the sum over the attention's calls of their length squared, seq_len^2 a
  // row, or in packed rows each sample's (the padding with the last sample, which runs it).
  int64_t step_attention_squares(int64_t step) const;

 private:
  int64_t first_sample(int64_t step, int64_t micro) const;  // this rank's micro batch's first global sample
  void window(int64_t start, int32_t* in, int32_t* tgt) const;
  // Unit `index` (a sample, or packed a row of samples) into a row; its segments added to `segments`.
  void sample_row(int64_t index, int32_t* in, int32_t* tgt, RowSegments* segments) const;
  int64_t units() const;  // samples, or packed rows
  const TokenStream* stream_ = nullptr;
  const SampleSet* samples_ = nullptr;
  SamplerOptions o_;
  int64_t train_end_ = 0;  // tokens of the training split; over a SampleSet, its samples
  int64_t train_units_ = 0;  // over a SampleSet: training samples, or packed the rows they fill
  std::vector<int64_t> unit_starts_, unit_samples_;  // packed: row u holds unit_samples_[unit_starts_[u], unit_starts_[u + 1])
  std::vector<int32_t> counted_;  // over a SampleSet: each training unit's counted targets
  std::vector<int64_t> attention_squares_;  // packed: each training row's attention calls' lengths squared, summed
};

}  // namespace ds
