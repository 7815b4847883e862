#include "engine/runtime/data/sampler.hpp"

#include "common/error.hpp"
#include "common/format.hpp"
#include "common/hash.hpp"

namespace ds {

BatchSampler::BatchSampler(const TokenStream& stream, const SamplerOptions& o) : stream_(stream), o_(o) {
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

int64_t BatchSampler::sample_offset(int64_t g) const {
  if (!o_.shuffle) return (g % ((train_end_ - 1) / o_.seq_len)) * o_.seq_len;  // the split's whole windows, in order
  const uint64_t span = static_cast<uint64_t>(train_end_ - o_.seq_len);  // valid starts: [0, train_end - seq_len - 1]
  return static_cast<int64_t>(splitmix64(o_.seed * 0x100000001B3ull ^ splitmix64(static_cast<uint64_t>(g))) % span);
}

void BatchSampler::window(int64_t start, int32_t* in, int32_t* tgt) const {
  std::vector<int32_t> buf(static_cast<size_t>(o_.seq_len + 1));
  stream_.read(start, o_.seq_len + 1, buf.data());
  for (int64_t t = 0; t < o_.seq_len; ++t) {
    in[t] = buf[t];
    tgt[t] = buf[t + 1];
  }
}

void BatchSampler::train_batch(int64_t step, int64_t micro, std::vector<int32_t>& inputs, std::vector<int32_t>& targets) const {
  const int64_t b = o_.micro_batch, T = o_.seq_len;
  inputs.resize(static_cast<size_t>(b * T));
  targets.resize(static_cast<size_t>(b * T));
  const int64_t global_batch = b * o_.grad_accum * o_.world_size;
  const int64_t first = step * global_batch + (micro * o_.world_size + o_.rank) * b;
  for (int64_t i = 0; i < b; ++i) window(sample_offset(first + i), inputs.data() + i * T, targets.data() + i * T);
}

void BatchSampler::val_batch(int64_t index, std::vector<int32_t>& inputs, std::vector<int32_t>& targets) const {
  const int64_t b = o_.micro_batch, T = o_.seq_len;
  inputs.resize(static_cast<size_t>(b * T));
  targets.resize(static_cast<size_t>(b * T));
  const int64_t windows = (stream_.size() - train_end_ - 1) / T;  // non-overlapping windows in the split
  DS_CHECK(windows > 0, "no validation split (data.val_fraction is 0)");
  for (int64_t i = 0; i < b; ++i) {
    const int64_t w = (index * b + i) % windows;
    window(train_end_ + w * T, inputs.data() + i * T, targets.data() + i * T);
  }
}

}  // namespace ds
