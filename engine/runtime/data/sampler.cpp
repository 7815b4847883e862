#include "engine/runtime/data/sampler.hpp"

#include <algorithm>

#include "common/error.hpp"
#include "common/format.hpp"
#include "common/hash.hpp"
#include "engine/plan/packing.hpp"

namespace ds {

BatchSampler::BatchSampler(const TokenStream& stream, const SamplerOptions& o) : stream_(&stream), o_(o) {
  DS_CHECK(o.seq_len > 0 && o.micro_batch > 0 && o.world_size > 0 && o.rank < o.world_size);
  const int64_t n = stream.size();
  const int64_t val = static_cast<int64_t>(static_cast<double>(n) * o.val_fraction);
  train_end_ = n - val;
  const int64_t need = o.seq_len + 1;  // inputs plus the shifted target
  if (train_end_ < need || (o.val_fraction > 0 && val < need))
    throw UserError(stream.describe() + " is too short: each split needs at least seq_len + 1 = " + std::to_string(need) +
                        " tokens (training split " + format_count(train_end_) + ", validation split " + format_count(val) + ")",
                    "use more data, a shorter data.seq_len, or a different data.val_fraction");
}

BatchSampler::BatchSampler(const SampleSet& samples, const SamplerOptions& o) : samples_(&samples), o_(o) {
  DS_CHECK(o.seq_len > 0 && o.micro_batch > 0 && o.world_size > 0 && o.rank < o.world_size);
  const int64_t n = samples.size();
  // The validation samples: those of data.val_path, else the last val_fraction.
  const int64_t val = samples.held_out_from >= 0 ? n - samples.held_out_from : static_cast<int64_t>(static_cast<double>(n) * o.val_fraction);
  const bool validates = o.val_fraction > 0 || samples.held_out_from >= 0;
  train_end_ = n - val;
  if (train_end_ < 1 || (validates && val < 1))
    throw UserError(samples.description + ": too few samples for data.val_fraction " + format_double(o.val_fraction) + " (" +
                        format_count(train_end_) + " for training, " + format_count(val) + " for validation)",
                    "each split needs at least one sample: use more data or another data.val_fraction");
  // A sample's counted targets in a row: those of its positions (counted as the data was read, where it knew the row).
  const bool read_counted = samples.counted_seq_len == o.seq_len && static_cast<int64_t>(samples.counted.size()) == n;
  DS_CHECK(read_counted || !samples.indexed, "an indexed sample set counts its targets as it reads (SampleOptions::seq_len)");
  const auto counted = [&](int64_t i) {
    if (read_counted) return samples.counted[static_cast<size_t>(i)];
    const int64_t begin = samples.starts[static_cast<size_t>(i)], last = sample_positions(samples.length(i), o.seq_len);
    int32_t c = 0;
    for (int64_t t = 0; t < last; ++t) c += samples.trained[static_cast<size_t>(begin + t + 1)] ? 1 : 0;
    return c;
  };
  train_units_ = train_end_;
  if (o.pack) {
    // Each split packed on its own; the rows' sample indices kept flat.
    unit_starts_.push_back(0);
    for (const auto& [first, end] : {std::pair<int64_t, int64_t>{0, train_end_}, {train_end_, n}}) {
      std::vector<int64_t> tokens;
      for (int64_t i = first; i < end; ++i) tokens.push_back(samples.length(i));
      for (const auto& row : pack_samples(tokens, o.seq_len)) {
        for (const int64_t i : row) unit_samples_.push_back(first + i);
        unit_starts_.push_back(static_cast<int64_t>(unit_samples_.size()));
      }
      if (first == 0) train_units_ = static_cast<int64_t>(unit_starts_.size()) - 1;
    }
    if (train_units_ < 1 || (validates && units() == train_units_))
      throw UserError(samples.description + ": a split holds no sample with more than one token to pack", "use more data");
  }
  counted_.resize(static_cast<size_t>(train_units_));
  for (int64_t u = 0; u < train_units_; ++u)
    for (const int64_t i : packed() ? row_samples(u) : std::vector<int64_t>{u}) counted_[static_cast<size_t>(u)] += counted(i);
  if (!packed()) return;
  // A packed row's attention runs sample by sample, the padding with the last (LanguageModel::per_sample).
  attention_squares_.resize(static_cast<size_t>(train_units_));
  for (int64_t u = 0; u < train_units_; ++u) {
    const std::vector<int64_t> row = row_samples(u);
    int64_t before_last = 0, squares = 0;
    for (size_t k = 0; k + 1 < row.size(); ++k) {
      const int64_t n = sample_positions(samples.length(row[k]), o.seq_len);
      before_last += n;
      squares += n * n;
    }
    attention_squares_[static_cast<size_t>(u)] = squares + (o.seq_len - before_last) * (o.seq_len - before_last);
  }
}

int64_t BatchSampler::units() const {
  return packed() ? static_cast<int64_t>(unit_starts_.size()) - 1 : samples_->size();
}

std::vector<int64_t> BatchSampler::row_samples(int64_t row) const {
  DS_CHECK(packed() && row >= 0 && row < units());
  return {unit_samples_.begin() + unit_starts_[static_cast<size_t>(row)], unit_samples_.begin() + unit_starts_[static_cast<size_t>(row) + 1]};
}

int64_t BatchSampler::first_sample(int64_t step, int64_t micro) const {
  const int64_t b = o_.micro_batch;
  return step * b * o_.grad_accum * o_.world_size + (micro * o_.world_size + o_.rank) * b;
}

int64_t BatchSampler::counted_targets(int64_t step, int64_t micro) const {
  const int64_t b = o_.micro_batch;
  if (!samples_) return b * o_.seq_len;
  const int64_t first = first_sample(step, micro);
  int64_t n = 0;
  for (int64_t i = 0; i < b; ++i) n += counted_[static_cast<size_t>(sample_offset(first + i))];
  return n;
}

int64_t BatchSampler::step_attention_squares(int64_t step) const {
  const int64_t global_batch = o_.micro_batch * o_.grad_accum * o_.world_size;
  if (!packed()) return global_batch * o_.seq_len * o_.seq_len;
  int64_t n = 0;
  for (int64_t g = step * global_batch; g < (step + 1) * global_batch; ++g) n += attention_squares_[static_cast<size_t>(sample_offset(g))];
  return n;
}

int64_t BatchSampler::step_counted_targets(int64_t step) const {
  const int64_t global_batch = o_.micro_batch * o_.grad_accum * o_.world_size;
  if (!samples_) return global_batch * o_.seq_len;
  int64_t n = 0;
  for (int64_t g = step * global_batch; g < (step + 1) * global_batch; ++g) n += counted_[static_cast<size_t>(sample_offset(g))];
  return n;
}

namespace {

// A bijection of [0, n) keyed by `key`: a four-round Feistel network over the smallest even number of
// bits that holds n, walking the cycle until the image falls inside [0, n) (under four steps on average).
int64_t permute(int64_t x, int64_t n, uint64_t key) {
  int bits = 2;
  while ((int64_t{1} << bits) < n) bits += 2;
  const int half = bits / 2;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  uint64_t v = static_cast<uint64_t>(x);
  do {
    uint64_t left = v >> half, right = v & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t next = left ^ (splitmix64(key ^ splitmix64(right * 4 + round)) & mask);
      left = right;
      right = next;
    }
    v = (left << half) | right;
  } while (static_cast<int64_t>(v) >= n);
  return static_cast<int64_t>(v);
}

}  // namespace

int64_t BatchSampler::train_tokens() const {
  return samples_ ? samples_->starts[static_cast<size_t>(train_end_)] : train_end_;
}

int64_t BatchSampler::val_tokens() const {
  return samples_ ? samples_->starts.back() - samples_->starts[static_cast<size_t>(train_end_)] : stream_->size() - train_end_;
}

std::string BatchSampler::notes() const {
  if (!samples_) return "";
  int64_t cut = 0, rows_tokens = 0, placed = 0;  // placed: the samples with a position (a 1-token sample has none)
  for (int64_t i = 0; i < train_end_; ++i) {
    const int64_t len = samples_->length(i);
    cut += len > o_.seq_len + 1;
    rows_tokens += sample_positions(len, o_.seq_len);
    placed += sample_positions(len, o_.seq_len) > 0;
  }
  std::string s = format_fixed(100.0 * (1.0 - static_cast<double>(rows_tokens) / static_cast<double>(train_units_ * o_.seq_len)), 1) +
                  "% of the training rows' positions are padding (" +
                  (packed() ? format_count(placed) + " samples packed into " + format_count(train_units_) + " rows" : "one sample a row") + ")";
  if (cut) s += "; " + format_count(cut) + " of " + format_count(train_end_) + " training samples are longer than seq_len + 1 = " +
                std::to_string(o_.seq_len + 1) + " tokens and are cut there";
  return s;
}

void BatchSampler::sample_row(int64_t index, int32_t* in, int32_t* tgt, RowSegments* segments) const {
  const SampleSet& s = *samples_;
  const int64_t T = o_.seq_len;
  std::vector<int32_t> ids;  // a sample's first T + 1 tokens, from memory or read again from its file
  std::vector<uint8_t> trained;
  if (!packed()) {
    s.sample(index, T + 1, ids, trained);
    const int64_t len = static_cast<int64_t>(ids.size());
    for (int64_t t = 0; t < T; ++t) {
      in[t] = t < len ? ids[static_cast<size_t>(t)] : s.pad_id;
      tgt[t] = t + 1 < len && trained[static_cast<size_t>(t + 1)] ? ids[static_cast<size_t>(t + 1)] : -1;
    }
    return;
  }
  std::vector<int64_t> lengths;
  int64_t at = 0;
  for (const int64_t i : row_samples(index)) {
    const int64_t n = sample_positions(s.length(i), T);
    s.sample(i, n + 1, ids, trained);
    for (int64_t t = 0; t < n; ++t) {
      in[at + t] = ids[static_cast<size_t>(t)];
      tgt[at + t] = trained[static_cast<size_t>(t + 1)] ? ids[static_cast<size_t>(t + 1)] : -1;
    }
    at += n;
    lengths.push_back(n);
  }
  DS_CHECK(at <= T, "a packed row overflows seq_len");
  std::fill(in + at, in + T, s.pad_id);
  std::fill(tgt + at, tgt + T, -1);
  if (at < T) lengths.push_back(at - T);  // padding: negative
  if (segments) segments->push_back(std::move(lengths));
}

int64_t BatchSampler::sample_offset(int64_t g) const {
  if (samples_) {
    const int64_t n = train_units_;
    if (!o_.shuffle) return g % n;
    const uint64_t epoch = static_cast<uint64_t>(g / n);
    return permute(g % n, n, splitmix64(o_.seed * 0x100000001B3ull ^ splitmix64(epoch + 0x5A17)));
  }
  if (!o_.shuffle) return (g % ((train_end_ - 1) / o_.seq_len)) * o_.seq_len;  // the split's whole windows, in order
  const uint64_t span = static_cast<uint64_t>(train_end_ - o_.seq_len);  // valid starts: [0, train_end - seq_len - 1]
  return static_cast<int64_t>(splitmix64(o_.seed * 0x100000001B3ull ^ splitmix64(static_cast<uint64_t>(g))) % span);
}

void BatchSampler::window(int64_t start, int32_t* in, int32_t* tgt) const {
  std::vector<int32_t> buf(static_cast<size_t>(o_.seq_len + 1));
  stream_->read(start, o_.seq_len + 1, buf.data());
  for (int64_t t = 0; t < o_.seq_len; ++t) {
    in[t] = buf[t];
    tgt[t] = buf[t + 1];
  }
}

void BatchSampler::train_batch(int64_t step, int64_t micro, std::vector<int32_t>& inputs, std::vector<int32_t>& targets,
                               RowSegments* segments) const {
  const int64_t b = o_.micro_batch, T = o_.seq_len;
  inputs.resize(static_cast<size_t>(b * T));
  targets.resize(static_cast<size_t>(b * T));
  if (segments) segments->clear();
  const int64_t first = first_sample(step, micro);
  for (int64_t i = 0; i < b; ++i) {
    if (samples_) sample_row(sample_offset(first + i), inputs.data() + i * T, targets.data() + i * T, segments);
    else window(sample_offset(first + i), inputs.data() + i * T, targets.data() + i * T);
  }
}

void BatchSampler::val_batch(int64_t index, std::vector<int32_t>& inputs, std::vector<int32_t>& targets, RowSegments* segments) const {
  const int64_t b = o_.micro_batch, T = o_.seq_len;
  inputs.resize(static_cast<size_t>(b * T));
  targets.resize(static_cast<size_t>(b * T));
  if (segments) segments->clear();
  if (samples_) {
    const int64_t n = units() - train_units_;
    DS_CHECK(n > 0, "no validation split (data.val_fraction is 0)");
    for (int64_t i = 0; i < b; ++i)
      sample_row(train_units_ + (index * b + i) % n, inputs.data() + i * T, targets.data() + i * T, segments);
    return;
  }
  const int64_t windows = (stream_->size() - train_end_ - 1) / T;  // non-overlapping windows in the split
  DS_CHECK(windows > 0, "no validation split (data.val_fraction is 0)");
  for (int64_t i = 0; i < b; ++i) {
    const int64_t w = (index * b + i) % windows;
    window(train_end_ + w * T, inputs.data() + i * T, targets.data() + i * T);
  }
}

}  // namespace ds
