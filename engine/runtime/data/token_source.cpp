#include "engine/runtime/data/token_source.hpp"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <hdf5.h>

#include <cmath>
#include <algorithm>
#include <climits>
#include <cstring>
#include <vector>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "common/error.hpp"
#include "common/format.hpp"
#include "common/hash.hpp"
#include "engine/runtime/data/byte_level_bpe.hpp"
#include "engine/runtime/data/chat_data.hpp"
#include "engine/runtime/data/hf_tokenizer.hpp"
#include "engine/plan/topology.hpp"
#include "engine/runtime/io/hdf5_quiet.hpp"

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

TokenFile::TokenFile(const std::string& path, const std::string& format) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw UserError("cannot open token file '" + path + "': " + std::strerror(errno), "check data.path");
  struct stat st {};
  ::fstat(fd_, &st);
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    throw UserError("token file '" + path + "' is not a regular file", "data.path names a file of token ids");
  }
  file_bytes_ = static_cast<size_t>(st.st_size);
  if (file_bytes_ == 0) {
    ::close(fd_);
    throw UserError("token file '" + path + "' is empty", "");
  }
  try {
    if (format == "llmc") {
      int32_t h[256];
      if (file_bytes_ < sizeof h) throw UserError("'" + path + "' is shorter than llm.c's 1024-byte header", "");
      read_bytes(0, sizeof h, reinterpret_cast<unsigned char*>(h));
      if (h[0] != 20240520)
        throw UserError("'" + path + "' is not an llm.c token file (magic " + std::to_string(h[0]) + ", expected 20240520)",
                        "use data.token_format \"uint16\" for raw nanoGPT files");
      if (h[1] != 1) throw UserError("'" + path + "' has llm.c token-file version " + std::to_string(h[1]) + "; ds reads version 1", "");
      header_ = sizeof h;
      token_bytes_ = 2;
      count_ = h[2];
      if (header_ + static_cast<size_t>(count_) * 2 != file_bytes_)
        throw UserError("'" + path + "': the header says " + std::to_string(count_) + " tokens but the file holds " +
                            std::to_string((file_bytes_ - header_) / 2),
                        "the file is truncated or not an llm.c token file");
    } else {
      token_bytes_ = format == "uint32" ? 4 : 2;
      if (file_bytes_ % token_bytes_ != 0)
        throw UserError("'" + path + "' is " + std::to_string(file_bytes_) + " bytes, not a whole number of " + format + " tokens", "");
      count_ = static_cast<int64_t>(file_bytes_ / token_bytes_);
    }
    // One pass for the largest id, so a vocabulary mismatch is caught before training; as read from the file
    // (unsigned), so a uint32 id past 2^31 is not taken for a negative one. In 1 MiB pieces.
    uint32_t largest = 0;
    std::vector<unsigned char> piece;
    const int64_t per_piece = (int64_t{1} << 20) / token_bytes_;
    for (int64_t at = 0; at < count_; at += per_piece) {
      const int64_t n = std::min(per_piece, count_ - at);
      piece.resize(static_cast<size_t>(n) * token_bytes_);
      read_bytes(static_cast<int64_t>(header_) + at * token_bytes_, piece.size(), piece.data());
      for (int64_t i = 0; i < n; ++i) {
        uint32_t v = 0;
        if (token_bytes_ == 2) {
          uint16_t h;
          std::memcpy(&h, piece.data() + i * 2, 2);
          v = h;
        } else {
          std::memcpy(&v, piece.data() + i * 4, 4);
        }
        largest = std::max(largest, v);
      }
    }
    if (largest > static_cast<uint32_t>(INT32_MAX))
      throw UserError("'" + path + "' contains token id " + std::to_string(largest) + ", beyond any vocabulary ds can train (2^31 - 1)",
                      "the file is not " + format + " token ids, or was written with another data.token_format");
    max_token_ = static_cast<int32_t>(largest);
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
  description_ = path + ": " + format_count(count_) + " " + format + " tokens";
}

TokenFile::~TokenFile() {
  if (fd_ >= 0) ::close(fd_);
}

void TokenFile::read_bytes(int64_t at, size_t bytes, unsigned char* out) const {
  for (size_t done = 0; done < bytes;) {
    const ssize_t n = ::pread(fd_, out + done, bytes - done, static_cast<off_t>(at) + static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      struct stat st {};
      const bool shrank = ::fstat(fd_, &st) == 0 && static_cast<size_t>(st.st_size) < file_bytes_;
      throw DataReadError("'" + path_ + "' could not be read at byte " + std::to_string(at + static_cast<int64_t>(done)) + ": " +
                              (shrank ? "it shrank from " + std::to_string(file_bytes_) + " to " + std::to_string(st.st_size) +
                                            " bytes while the run read it"
                                      : std::string(n < 0 ? std::strerror(errno) : "the file ended early")),
                          "restore the data file (or point data.path at a complete copy), then resume: the run's last "
                          "completed step is saved",
                          kExitRuntime);
    }
    done += static_cast<size_t>(n);
  }
}

void TokenFile::read(int64_t begin, int64_t n, int32_t* out) const {
  DS_CHECK(begin >= 0 && begin + n <= count_, "read [", begin, ", ", begin + n, ") of ", count_);
  std::vector<unsigned char> staged(static_cast<size_t>(n) * token_bytes_);  // a window's worth: small
  read_bytes(static_cast<int64_t>(header_) + begin * token_bytes_, staged.size(), staged.data());
  if (token_bytes_ == 2) {
    uint16_t v;
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(&v, staged.data() + i * 2, 2);
      out[i] = v;
    }
  } else {
    uint32_t v;
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(&v, staged.data() + i * 4, 4);
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

std::vector<std::string> data_files(const std::string& path, const std::string& key) {
  std::error_code ec;
  if (!std::filesystem::is_directory(path, ec)) return {path};
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(path, ec))
    if (e.path().filename().string()[0] != '.' && e.is_regular_file(ec)) files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  if (files.empty()) throw UserError(key + " '" + path + "' is a directory with no data files in it", "give a file, or a directory of shards");
  // Shards are files of one kind; a directory that also holds other things (nanoGPT's data/ has input.txt,
  // meta.pkl, prepare.py, train.bin and val.bin) is not a dataset to read whole.
  std::set<std::string> kinds;
  for (const std::string& f : files) kinds.insert(std::filesystem::path(f).extension().string());
  if (kinds.size() > 1) {
    std::string list;
    for (const std::string& k : kinds) list += (list.empty() ? "" : ", ") + (k.empty() ? std::string("(none)") : k);
    throw UserError(key + " '" + path + "' holds files of several kinds (" + list + "): a directory is read whole, as shards of one dataset",
                    "name the data file itself, or a directory that holds its shards alone");
  }
  // A held-out split beside the training data would be trained on: ds holds out data.val_fraction itself.
  for (const std::string& f : files) {
    if (key != "data.path") break;  // a validation directory may hold them
    const std::string stem = std::filesystem::path(f).stem().string();
    if (files.size() > 1 && (stem == "val" || stem == "valid" || stem == "validation" || stem == "test" || stem == "eval"))
      throw UserError(key + " '" + path + "' holds '" + std::filesystem::path(f).filename().string() +
                          "', a held-out split by its name, which would be read as training data",
                      "name the training file itself (ds holds out data.val_fraction of it for validation; jsonl data takes a "
                      "validation file as data.val_path)");
  }
  return files;
}

namespace {
// Many shards, each an open file: the soft limit on descriptors is raised as far as the hard one allows.
void allow_open_files(size_t n, const std::string& path) {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur >= n + 256) return;
  lim.rlim_cur = std::min<rlim_t>(lim.rlim_max, n + 256);
  ::setrlimit(RLIMIT_NOFILE, &lim);
  if (lim.rlim_cur < n + 64)
    throw UserError("data.path '" + path + "' holds " + std::to_string(n) + " shards, more than this process may open (ulimit -n " +
                        std::to_string(lim.rlim_max) + ")",
                    "merge the shards into fewer files, or raise the limit (ulimit -Hn)");
}
}  // namespace

ConcatTokenStream::ConcatTokenStream(std::vector<std::unique_ptr<TokenStream>> parts, std::string description)
    : parts_(std::move(parts)), description_(std::move(description)) {
  starts_.push_back(0);
  for (const auto& p : parts_) {
    starts_.push_back(starts_.back() + p->size());
    max_token_ = std::max(max_token_, p->max_token());
  }
}

void ConcatTokenStream::read(int64_t begin, int64_t n, int32_t* out) const {
  DS_CHECK(begin >= 0 && begin + n <= size(), "read [", begin, ", ", begin + n, ") of ", size());
  size_t i = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin()) - 1;
  while (n > 0) {
    const int64_t within = begin - starts_[i], take = std::min(n, starts_[i + 1] - begin);
    parts_[i]->read(within, take, out);
    begin += take, out += take, n -= take, ++i;
  }
}

int64_t measure_samples(const DataConfig& d) {
  DS_CHECK(d.type == DataType::jsonl, "only jsonl data is a set of samples");
  return count_jsonl_samples(data_files(d.path));
}

int64_t measure_tokens(const DataConfig& d) {
  if (d.type == DataType::synthetic) return int64_t{1} << 20;  // as open_token_stream draws it
  if (d.type == DataType::hdf5) return Hdf5TokenDataset(d.path, d.dataset).size();
  DS_CHECK(d.type != DataType::jsonl, "jsonl data is measured in samples (measure_samples), not tokens");
  const std::vector<std::string> files = data_files(d.path);
  int64_t n = 0;
  if (d.type == DataType::tokens) {  // by size (llm.c's files say their count in the header); read when the run opens them
    for (const std::string& f : files) {
      if (d.token_format != "llmc") {
        n += static_cast<int64_t>(std::filesystem::file_size(f)) / (d.token_format == "uint32" ? 4 : 2);
        continue;
      }
      int32_t header[3] = {0, 0, 0};
      std::ifstream in(f, std::ios::binary);
      in.read(reinterpret_cast<char*>(header), sizeof header);
      n += std::max(0, header[2]);
    }
    return n;
  }
  if (d.tokenizer == "bytes") {
    for (const std::string& f : files) n += static_cast<int64_t>(std::filesystem::file_size(f));
    return n;
  }
  // BPE: only encoding tells; kept for the process, keyed by each file's size and modification time.
  static std::map<std::string, int64_t> encoded;
  std::string key = d.vocab_file + "|" + d.merges_file + "|" + d.tokenizer_path;
  for (const std::string& f : files) {
    std::error_code ec;
    key += "|" + f + ":" + std::to_string(std::filesystem::file_size(f, ec)) + ":" +
           std::to_string(std::filesystem::last_write_time(f, ec).time_since_epoch().count());
  }
  if (const auto it = encoded.find(key); it != encoded.end()) return it->second;
  std::string text;
  for (const std::string& f : files) text += read_text_file(f);
  const int64_t n_tokens = d.tokenizer == "hf" ? static_cast<int64_t>(HfTokenizer(d.tokenizer_path).encode(text).size())
                                               : static_cast<int64_t>(ByteLevelBpe(d.vocab_file, d.merges_file).encode(text).size());
  return encoded[key] = n_tokens;
}

std::unique_ptr<TokenStream> open_token_stream(const DataConfig& d, int64_t vocab_size, uint64_t seed) {
  std::unique_ptr<TokenStream> s;
  const std::vector<std::string> files = d.type == DataType::synthetic ? std::vector<std::string>{} : data_files(d.path);
  const std::string shards = files.size() > 1 ? d.path + " (" + std::to_string(files.size()) + " files)" : d.path;
  switch (d.type) {
    case DataType::synthetic:
      s = make_synthetic_stream(static_cast<int32_t>(std::min<int64_t>(vocab_size, 256)), 1 << 20, seed);
      break;
    case DataType::text: {
      std::string text;
      for (const std::string& f : files) text += read_text_file(f);
      if (d.tokenizer == "hf") {
        const HfTokenizer tok(d.tokenizer_path);
        auto ids = tok.encode(text);
        const std::string desc = shards + ": " + format_count(static_cast<int64_t>(text.size())) + " bytes -> " +
                                 format_count(static_cast<int64_t>(ids.size())) + " tokens (" + tok.describe() + ")";
        s = std::make_unique<MemoryTokenStream>(std::move(ids), desc);
      } else if (d.tokenizer == "gpt2") {
        ByteLevelBpe tok(d.vocab_file, d.merges_file);
        auto ids = tok.encode(text);
        const std::string desc = shards + ": " + format_count(static_cast<int64_t>(text.size())) + " bytes -> " +
                                 format_count(static_cast<int64_t>(ids.size())) + " GPT-2 tokens";
        s = std::make_unique<MemoryTokenStream>(std::move(ids), desc);
      } else {
        std::vector<int32_t> ids(text.begin(), text.end());
        for (auto& t : ids) t &= 0xFF;
        s = std::make_unique<MemoryTokenStream>(std::move(ids), shards + ": " + format_count(static_cast<int64_t>(text.size())) +
                                                                    " bytes (byte tokens)");
      }
      break;
    }
    case DataType::tokens: {
      if (files.size() == 1) {
        s = std::make_unique<TokenFile>(files[0], d.token_format);
        break;
      }
      allow_open_files(files.size(), d.path);
      std::vector<std::unique_ptr<TokenStream>> parts;
      int64_t tokens = 0;
      for (const std::string& f : files) {
        parts.push_back(std::make_unique<TokenFile>(f, d.token_format));
        tokens += parts.back()->size();
      }
      s = std::make_unique<ConcatTokenStream>(std::move(parts), shards + ": " + format_count(tokens) + " " + d.token_format + " tokens");
      break;
    }
    case DataType::jsonl:
      throw UserError("data.type jsonl is read as samples (open_samples), not as a token stream", "");
    case DataType::hdf5:
      if (files.size() > 1 || files[0] != d.path)
        throw UserError("data.path '" + d.path + "' is a directory; data.type hdf5 reads one file", "name the HDF5 file");
      s = std::make_unique<Hdf5TokenDataset>(d.path, d.dataset);
      break;
  }
  if (s->max_token() >= vocab_size)
    throw UserError(s->describe() + " contains token id " + std::to_string(s->max_token()) + ", but the model's vocabulary has " +
                        std::to_string(vocab_size) + " ids",
                    "raise model.vocab_size, or use the tokenizer the data was made with");
  return s;
}

namespace {

// The samples of `path` (data.path, or with `key` data.val_path), read as the data block says.
SampleSet read_samples(const DataConfig& d, std::shared_ptr<const HfTokenizer> tok, const std::string& path, const std::string& key,
                       int64_t seq_len, bool keep_tokens) {
  SampleOptions o;
  o.train_on_prompt = d.train_on_prompt;
  o.source = path;
  o.chat_template = d.chat_template;
  o.seq_len = seq_len;
  o.keep_tokens = keep_tokens;
  o.skip_bad_lines = d.skip_bad_lines;
  return read_jsonl_samples(data_files(path, key), std::move(tok), o);
}

// data.tokens_in_memory, or when unset whether the tokens fit in a quarter of this machine's memory: 5 bytes a
// token (its id and whether it is trained), a token taken as at most 3 bytes of the files (JSON's keys and
// quotes included), so the estimate errs towards the index.
bool keep_tokens_in_memory(const DataConfig& d, int ranks_on_node, std::string& why) {
  if (d.tokens_in_memory) {
    why = *d.tokens_in_memory ? "" : "data.tokens_in_memory false";
    return *d.tokens_in_memory;
  }
  double bytes = 0;
  for (const std::string& key : {std::string("data.path"), std::string("data.val_path")}) {
    const std::string& path = key == "data.path" ? d.path : d.val_path;
    if (path.empty()) continue;
    for (const std::string& f : data_files(path, key)) {
      struct stat st {};
      if (::stat(f.c_str(), &st) == 0) bytes += static_cast<double>(st.st_size);
    }
  }
  // Each rank on the node holds its own copy, and reading grows vectors to twice what they hold at worst.
  const double tokens_bytes = bytes / 3.0 * 5.0 * 2.0 * std::max(ranks_on_node, 1), memory = detect_host_memory_bytes();
  if (memory <= 0 || tokens_bytes <= memory / 4) return true;
  why = "its tokens would take about " + format_bytes(tokens_bytes) + " while read (" + std::to_string(std::max(ranks_on_node, 1)) +
        (ranks_on_node > 1 ? " ranks" : " rank") + " on this node), over a quarter of its " + format_bytes(memory) +
        " (data.tokens_in_memory true keeps them)";
  return false;
}

}  // namespace

std::unique_ptr<SampleSet> open_samples(const DataConfig& d, int64_t vocab_size, int64_t seq_len, int ranks_on_node) {
  const auto tok = std::make_shared<const HfTokenizer>(d.tokenizer_path);
  if (tok->vocab_size() > vocab_size)
    throw UserError(tok->describe() + ": its ids reach " + format_count(tok->vocab_size() - 1) + ", but the model's vocabulary has " +
                        format_count(vocab_size) + " ids",
                    "use the tokenizer of the model you train (model.init_from's directory), or raise model.vocab_size");
  std::string why;
  const bool keep = keep_tokens_in_memory(d, ranks_on_node, why);
  auto samples = std::make_unique<SampleSet>(read_samples(d, tok, d.path, "data.path", seq_len, keep));
  if (!d.val_path.empty()) {  // the validation samples after the training ones (BatchSampler starts them at held_out_from)
    const SampleSet held = read_samples(d, tok, d.val_path, "data.val_path", seq_len, keep);
    samples->held_out_from = samples->size();
    samples->append(held);
    samples->description += "; validation " + held.description;
  }
  if (!keep)
    samples->description += "; indexed (" + why + "): each batch's lines are read and tokenized again, " +
                            format_bytes(static_cast<double>(samples->size()) * 28.0) + " kept in memory";
  return samples;
}

std::vector<int64_t> measure_sample_tokens(const DataConfig& d) {
  DS_CHECK(d.type == DataType::jsonl, "only jsonl data is a set of samples");
  // Lengths only: indexed, so a data set bigger than memory is measured in what its lengths take.
  const SampleSet s = read_samples(d, std::make_shared<const HfTokenizer>(d.tokenizer_path), d.path, "data.path", 0, false);
  std::vector<int64_t> tokens(static_cast<size_t>(s.size()));
  for (int64_t i = 0; i < s.size(); ++i) tokens[static_cast<size_t>(i)] = s.length(i);
  return tokens;
}

}  // namespace ds
