#include "engine/runtime/data/token_source.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <hdf5.h>

#include <cmath>
#include <algorithm>
#include <climits>
#include <cstring>
#include <vector>
#include <fstream>
#include <sstream>

#include "common/error.hpp"
#include "common/format.hpp"
#include "common/hash.hpp"
#include "engine/runtime/data/gpt2_tokenizer.hpp"
#include "engine/runtime/hdf5_quiet.hpp"

namespace ds {
namespace {

constexpr double kMarkovProbs[4] = {0.55, 0.25, 0.15, 0.05};

std::string read_text_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw UserError("cannot read data file '" + path + "'", "check data.path (relative paths start at the working directory)");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

MemoryTokenStream::MemoryTokenStream(std::vector<int32_t> tokens, std::string description)
    : tokens_(std::move(tokens)), description_(std::move(description)) {
  for (int32_t t : tokens_) max_token_ = std::max(max_token_, t);
}

void MemoryTokenStream::read(int64_t begin, int64_t n, int32_t* out) const {
  DS_CHECK(begin >= 0 && begin + n <= size(), "read [", begin, ", ", begin + n, ") of ", size());
  std::memcpy(out, tokens_.data() + begin, static_cast<size_t>(n) * sizeof(int32_t));
}

MappedTokenFile::MappedTokenFile(const std::string& path, const std::string& format) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw UserError("cannot open token file '" + path + "': " + std::strerror(errno), "check data.path");
  struct stat st {};
  ::fstat(fd, &st);
  map_bytes_ = static_cast<size_t>(st.st_size);
  if (map_bytes_ == 0) {
    ::close(fd);
    throw UserError("token file '" + path + "' is empty", "");
  }
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) throw UserError("cannot map token file '" + path + "'", "");
  data_ = static_cast<const unsigned char*>(map_);
  size_t header = 0;
  if (format == "llmc") {
    int32_t h[256];
    if (map_bytes_ < sizeof h) throw UserError("'" + path + "' is shorter than llm.c's 1024-byte header", "");
    std::memcpy(h, data_, sizeof h);
    if (h[0] != 20240520)
      throw UserError("'" + path + "' is not an llm.c token file (magic " + std::to_string(h[0]) + ", expected 20240520)",
                      "use data.token_format \"uint16\" for raw nanoGPT files");
    if (h[1] != 1) throw UserError("'" + path + "' has llm.c token-file version " + std::to_string(h[1]) + "; ds reads version 1", "");
    header = sizeof h;
    token_bytes_ = 2;
    count_ = h[2];
    if (header + static_cast<size_t>(count_) * 2 != map_bytes_)
      throw UserError("'" + path + "': the header says " + std::to_string(count_) + " tokens but the file holds " +
                          std::to_string((map_bytes_ - header) / 2),
                      "the file is truncated or not an llm.c token file");
  } else {
    token_bytes_ = format == "uint32" ? 4 : 2;
    if (map_bytes_ % token_bytes_ != 0)
      throw UserError("'" + path + "' is " + std::to_string(map_bytes_) + " bytes, not a whole number of " + format + " tokens", "");
    count_ = static_cast<int64_t>(map_bytes_ / token_bytes_);
  }
  data_ += header;
  // One pass for the largest id, so a vocabulary mismatch is caught before training; as read from the file
  // (unsigned), so a uint32 id past 2^31 is not taken for a negative one.
  uint32_t largest = 0;
  for (int64_t i = 0; i < count_; ++i) {
    uint32_t v = 0;
    if (token_bytes_ == 2) {
      uint16_t h;
      std::memcpy(&h, data_ + i * 2, 2);
      v = h;
    } else {
      std::memcpy(&v, data_ + i * 4, 4);
    }
    largest = std::max(largest, v);
  }
  if (largest > static_cast<uint32_t>(INT32_MAX))
    throw UserError("'" + path + "' contains token id " + std::to_string(largest) + ", beyond any vocabulary ds can train (2^31 - 1)",
                    "the file is not " + format + " token ids, or was written with another data.token_format");
  max_token_ = static_cast<int32_t>(largest);
  description_ = path + ": " + format_count(count_) + " " + format + " tokens";
}

MappedTokenFile::~MappedTokenFile() {
  if (map_ && map_ != MAP_FAILED) ::munmap(map_, map_bytes_);
}

void MappedTokenFile::read(int64_t begin, int64_t n, int32_t* out) const {
  DS_CHECK(begin >= 0 && begin + n <= count_, "read [", begin, ", ", begin + n, ") of ", count_);
  if (token_bytes_ == 2) {
    uint16_t v;
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(&v, data_ + (begin + i) * 2, 2);
      out[i] = v;
    }
  } else {
    uint32_t v;
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(&v, data_ + (begin + i) * 4, 4);
      out[i] = static_cast<int32_t>(v);
    }
  }
}

double markov_entropy_nats() {
  double h = 0;
  for (double p : kMarkovProbs) h -= p * std::log(p);
  return h;
}

Hdf5TokenDataset::Hdf5TokenDataset(const std::string& path, const std::string& name) {
  quiet_hdf5();  // failures become UserErrors below
  if (!std::ifstream(path))
    throw UserError("cannot read data file '" + path + "'", "check data.path (relative paths start at the working directory)");
  file_ = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (file_ < 0) throw UserError("'" + path + "' is not an HDF5 file", "data.type \"hdf5\" reads HDF5 files (h5py writes them)");
  auto fail = [&](const std::string& what, const std::string& hint) {
    close();  // a throwing constructor runs no destructor
    throw UserError("'" + path + "': " + what, hint);
  };
  if (H5Lexists(file_, name.c_str(), H5P_DEFAULT) <= 0)
    fail("has no dataset '" + name + "'", "set data.dataset to the name of the token dataset (h5ls lists them)");
  dataset_ = H5Dopen2(file_, name.c_str(), H5P_DEFAULT);
  if (dataset_ < 0) fail("'" + name + "' is not a dataset", "set data.dataset to a 1-D integer dataset");
  const hid_t type = H5Dget_type(dataset_);
  const bool integer = H5Tget_class(type) == H5T_INTEGER;
  H5Tclose(type);
  const hid_t space = H5Dget_space(dataset_);
  const int rank = H5Sget_simple_extent_ndims(space);
  hsize_t dims[8] = {};
  if (rank == 1) H5Sget_simple_extent_dims(space, dims, nullptr);
  H5Sclose(space);
  if (!integer || rank != 1)
    fail("dataset '" + name + "' is not a 1-D integer array (rank " + std::to_string(rank) + (integer ? "" : ", not integers") + ")",
         "store the token ids as one flat integer dataset");
  count_ = static_cast<int64_t>(dims[0]);
  // One pass in blocks for the id range, so bad ids are caught before training.
  std::vector<int32_t> block(1 << 20);
  int32_t lowest = 0;
  for (int64_t at = 0; at < count_; at += static_cast<int64_t>(block.size())) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(block.size()), count_ - at);
    read(at, n, block.data());
    for (int64_t i = 0; i < n; ++i) {
      max_token_ = std::max(max_token_, block[i]);
      lowest = std::min(lowest, block[i]);
    }
  }
  if (lowest < 0) fail("dataset '" + name + "' holds a negative token id (" + std::to_string(lowest) + ")", "token ids start at 0");
  description_ = path + ":" + name + ": " + format_count(count_) + " tokens (HDF5)";
}

Hdf5TokenDataset::~Hdf5TokenDataset() { close(); }

void Hdf5TokenDataset::close() {
  if (dataset_ >= 0) H5Dclose(dataset_);
  if (file_ >= 0) H5Fclose(file_);
  dataset_ = file_ = -1;
}

void Hdf5TokenDataset::read(int64_t begin, int64_t n, int32_t* out) const {
  DS_CHECK(begin >= 0 && begin + n <= count_, "read [", begin, ", ", begin + n, ") of ", count_);
  const hid_t file_space = H5Dget_space(dataset_);
  const hsize_t start = static_cast<hsize_t>(begin), count = static_cast<hsize_t>(n);
  H5Sselect_hyperslab(file_space, H5S_SELECT_SET, &start, nullptr, &count, nullptr);
  const hid_t mem_space = H5Screate_simple(1, &count, nullptr);
  const herr_t status = H5Dread(dataset_, H5T_NATIVE_INT32, mem_space, file_space, H5P_DEFAULT, out);
  H5Sclose(mem_space);
  H5Sclose(file_space);
  if (status < 0) throw std::runtime_error("reading tokens [" + std::to_string(begin) + ", " + std::to_string(begin + n) + ") failed");
}

std::unique_ptr<TokenStream> make_synthetic_stream(int32_t vocab, int64_t n, uint64_t seed) {
  DS_CHECK(vocab >= 2 && n >= 1);
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  uint64_t state = splitmix64(seed ^ 0x5EEDull);
  int32_t cur = static_cast<int32_t>(state % static_cast<uint64_t>(vocab));
  for (int64_t i = 0; i < n; ++i) {
    tokens[i] = cur;
    // Successor k of token t is a fixed pseudo-random token: hash(seed, t, k) mod vocab.
    state = splitmix64(state);
    const double u = static_cast<double>(state >> 11) * 0x1.0p-53;
    int k = 0;
    for (double acc = kMarkovProbs[0]; u >= acc && k < 3; acc += kMarkovProbs[++k]) {
    }
    cur = static_cast<int32_t>(splitmix64(seed * 1000003ull + static_cast<uint64_t>(cur) * 4 + k) % static_cast<uint64_t>(vocab));
  }
  char desc[160];
  std::snprintf(desc, sizeof desc, "synthetic Markov chain: %s tokens over %d ids, entropy floor %.3f nats", format_count(n).c_str(),
                vocab, markov_entropy_nats());
  return std::make_unique<MemoryTokenStream>(std::move(tokens), desc);
}

std::unique_ptr<TokenStream> open_token_stream(const DataConfig& d, int64_t vocab_size, uint64_t seed) {
  std::unique_ptr<TokenStream> s;
  switch (d.type) {
    case DataType::synthetic:
      s = make_synthetic_stream(static_cast<int32_t>(std::min<int64_t>(vocab_size, 256)), 1 << 20, seed);
      break;
    case DataType::text: {
      const std::string text = read_text_file(d.path);
      if (d.tokenizer == "gpt2") {
        Gpt2Tokenizer tok(d.vocab_file, d.merges_file);
        auto ids = tok.encode(text);
        const std::string desc = d.path + ": " + format_count(static_cast<int64_t>(text.size())) + " bytes -> " +
                                 format_count(static_cast<int64_t>(ids.size())) + " GPT-2 tokens";
        s = std::make_unique<MemoryTokenStream>(std::move(ids), desc);
      } else {
        std::vector<int32_t> ids(text.begin(), text.end());
        for (auto& t : ids) t &= 0xFF;
        s = std::make_unique<MemoryTokenStream>(std::move(ids), d.path + ": " + format_count(static_cast<int64_t>(text.size())) +
                                                                    " bytes (byte tokens)");
      }
      break;
    }
    case DataType::tokens:
      s = std::make_unique<MappedTokenFile>(d.path, d.token_format);
      break;
    case DataType::hdf5:
      s = std::make_unique<Hdf5TokenDataset>(d.path, d.dataset);
      break;
  }
  if (s->max_token() >= vocab_size)
    throw UserError(s->describe() + " contains token id " + std::to_string(s->max_token()) + ", but the model's vocabulary has " +
                        std::to_string(vocab_size) + " ids",
                    "raise model.vocab_size, or use the tokenizer the data was made with");
  return s;
}

}  // namespace ds
