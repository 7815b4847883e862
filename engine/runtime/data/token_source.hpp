// ds — where training tokens come from. Every source ends as one flat token stream: read once at
// start (a text file tokenized, a binary token file memory-mapped, a synthetic stream generated), so
// sampling is plain index arithmetic. Problems with the input (missing file, bad header, a token id
// outside the model's vocabulary) are UserErrors naming the file, raised before any training starts.
#pragma once

#include "common/error.hpp"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "schema/config.hpp"

namespace ds {

// The training data could not be read mid-run (a file truncated or replaced under the run): the run
// saves the steps it completed and stops with this message.
class DataReadError : public UserError {
 public:
  using UserError::UserError;
};


class TokenStream {
 public:
  virtual ~TokenStream() = default;
  virtual int64_t size() const = 0;
  // Copies tokens [begin, begin + n) into out (n tokens). Requires begin + n <= size().
  virtual void read(int64_t begin, int64_t n, int32_t* out) const = 0;
  virtual std::string describe() const = 0;  // "tinyshakespeare.txt: 1,115,394 bytes -> 338,027 GPT-2 tokens"
  int32_t max_token() const { return max_token_; }

 protected:
  int32_t max_token_ = 0;
};

// Tokens held in memory (text sources, synthetic data).
class MemoryTokenStream : public TokenStream {
 public:
  MemoryTokenStream(std::vector<int32_t> tokens, std::string description);
  int64_t size() const override { return static_cast<int64_t>(tokens_.size()); }
  void read(int64_t begin, int64_t n, int32_t* out) const override;
  std::string describe() const override { return description_; }

 private:
  std::vector<int32_t> tokens_;
  std::string description_;
};

// A memory-mapped binary token file: raw uint16 (nanoGPT's train.bin), raw uint32, or llm.c's
// headered .bin (256 int32 header: magic 20240520, version 1 = uint16 tokens, token count).
class TokenFile : public TokenStream {
 public:
  TokenFile(const std::string& path, const std::string& format);
  ~TokenFile() override;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  int64_t size() const override { return count_; }
  // Read with pread, never through a mapping: a file truncated or rewritten while a run reads it gives a
  // DataReadError naming it (the run saves its last step and stops), where a mapped read dies of SIGBUS.
  void read(int64_t begin, int64_t n, int32_t* out) const override;
  std::string describe() const override { return description_; }

 private:
  void read_bytes(int64_t at, size_t bytes, unsigned char* out) const;
  std::string path_;
  int fd_ = -1;
  size_t file_bytes_ = 0, header_ = 0;
  int64_t count_ = 0;
  int token_bytes_ = 2;
  std::string description_;
};

// A 1-D integer dataset in an HDF5 file (any integer width; HDF5 converts on read). Samples are read
// on demand as hyperslabs, so the dataset never has to fit in memory.
class Hdf5TokenDataset : public TokenStream {
 public:
  Hdf5TokenDataset(const std::string& path, const std::string& dataset);
  ~Hdf5TokenDataset() override;
  Hdf5TokenDataset(const Hdf5TokenDataset&) = delete;
  Hdf5TokenDataset& operator=(const Hdf5TokenDataset&) = delete;
  int64_t size() const override { return count_; }
  void read(int64_t begin, int64_t n, int32_t* out) const override;
  std::string describe() const override { return description_; }

 private:
  void close();
  int64_t file_ = -1, dataset_ = -1;  // hid_t, kept out of this header
  int64_t count_ = 0;
  std::string description_;
};

// A synthetic language for smoke tests and the quickstart, needing no file: an order-1 Markov chain
// over `vocab` tokens where each token has four successors with probabilities 0.55, 0.25, 0.15 and
// 0.05. A model that learns it reaches the chain's entropy, markov_entropy_nats() (~1.11 nats),
// from ln(vocab) at initialisation, so learning is visible within a few hundred steps.
std::unique_ptr<TokenStream> make_synthetic_stream(int32_t vocab, int64_t tokens, uint64_t seed);
double markov_entropy_nats();

// The stream the data block describes, checked against the model's vocabulary size.
std::unique_ptr<TokenStream> open_token_stream(const DataConfig& data, int64_t vocab_size, uint64_t seed);

// data.type jsonl: the samples of data.path, tokenized with data.tokenizer_path's tokenizer (chat_data.hpp),
// checked against the model's vocabulary size; their tokens in memory, or indexed (data.tokens_in_memory, or
// by their size against this node's memory shared by `ranks_on_node` ranks), their targets counted within rows of
// seq_len positions.
struct SampleSet;
std::unique_ptr<SampleSet> open_samples(const DataConfig& data, int64_t vocab_size, int64_t seq_len, int ranks_on_node = 1);

// The number of tokens open_token_stream would give, measured as cheaply as the format allows: token files
// and byte text by their sizes, GPT-2 BPE text by encoding it (once per process and file version). For
// train.epochs, which the plan resolves before anything is read.
int64_t measure_tokens(const DataConfig& data);
// For jsonl data, the samples open_samples would give (one per line that is not blank), counted without
// tokenizing: train.epochs counts its steps in rows.
int64_t measure_samples(const DataConfig& data);
// For jsonl data packed into rows (data.packing): each sample's tokens, which only tokenizing tells; the rows
// an epoch holds follow from them and seq_len (pack_samples).
std::vector<int64_t> measure_sample_tokens(const DataConfig& data);

// data.path's files: the file itself, or for a directory every regular file in it that is not hidden, in
// name order (a dataset in shards). UserError for a directory with none.
// `key` names the path in errors (data.val_path's directory may hold files named as held-out splits).
std::vector<std::string> data_files(const std::string& path, const std::string& key = "data.path");

// Several token streams read as one, in order (token file shards); windows may span two of them.
class ConcatTokenStream : public TokenStream {
 public:
  explicit ConcatTokenStream(std::vector<std::unique_ptr<TokenStream>> parts, std::string description);
  int64_t size() const override { return starts_.back(); }
  void read(int64_t begin, int64_t n, int32_t* out) const override;
  std::string describe() const override { return description_; }

 private:
  std::vector<std::unique_ptr<TokenStream>> parts_;
  std::vector<int64_t> starts_;  // parts_[i] holds [starts_[i], starts_[i + 1])
  std::string description_;
};

}  // namespace ds
