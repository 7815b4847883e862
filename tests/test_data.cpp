#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <hdf5.h>

#include "engine/runtime/data/sampler.hpp"
#include "engine/runtime/data/token_source.hpp"
#include "test_helpers.hpp"

using namespace ds;
namespace fs = std::filesystem;

namespace {
std::string temp_file(const std::string& name) { return (fs::temp_directory_path() / ("ds_test_" + name)).string(); }

template <class T>
void write_tokens(const std::string& path, const std::vector<T>& v, const std::vector<int32_t>& header = {}) {
  std::ofstream f(path, std::ios::binary);
  if (!header.empty()) f.write(reinterpret_cast<const char*>(header.data()), header.size() * 4);
  f.write(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

std::vector<int32_t> all_tokens(const TokenStream& s) {
  std::vector<int32_t> out(static_cast<size_t>(s.size()));
  s.read(0, s.size(), out.data());
  return out;
}

DataConfig data(DataType type, const std::string& path, const std::string& format = "uint16") {
  DataConfig d;
  d.type = type;
  d.path = path;
  d.tokenizer = "bytes";
  d.token_format = format;
  return d;
}
}  // namespace

TEST(TokenFiles, RawUint16AndUint32RoundTrip) {
  const std::vector<uint16_t> a = {1, 2, 65535, 7};
  write_tokens(temp_file("a.bin"), a);
  TokenFile f16(temp_file("a.bin"), "uint16");
  EXPECT_EQ(all_tokens(f16), (std::vector<int32_t>{1, 2, 65535, 7}));
  const std::vector<uint32_t> b = {100000, 3};
  write_tokens(temp_file("b.bin"), b);
  TokenFile f32(temp_file("b.bin"), "uint32");
  EXPECT_EQ(all_tokens(f32), (std::vector<int32_t>{100000, 3}));
  EXPECT_EQ(f32.max_token(), 100000);
}

TEST(TokenFiles, LlmcHeaderIsCheckedAndSkipped) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  header[2] = 3;
  write_tokens(temp_file("c.bin"), std::vector<uint16_t>{5, 6, 50256}, header);
  TokenFile f(temp_file("c.bin"), "llmc");
  EXPECT_EQ(all_tokens(f), (std::vector<int32_t>{5, 6, 50256}));
  header[2] = 4;  // claims one more token than the file holds
  write_tokens(temp_file("d.bin"), std::vector<uint16_t>{5, 6, 7}, header);
  EXPECT_THROW(TokenFile(temp_file("d.bin"), "llmc"), UserError);
  header[0] = 1234;
  write_tokens(temp_file("e.bin"), std::vector<uint16_t>{5, 6, 7, 8}, header);
  try {
    TokenFile(temp_file("e.bin"), "llmc");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("magic 1234"), std::string::npos) << e.what();
  }
}

TEST(TokenFiles, BadInputsAreUserErrorsNamingTheFile) {
  EXPECT_THROW(TokenFile("/nonexistent/tokens.bin", "uint16"), UserError);
  std::ofstream(temp_file("odd.bin"), std::ios::binary) << "abc";
  EXPECT_THROW(TokenFile(temp_file("odd.bin"), "uint16"), UserError);
  write_tokens(temp_file("big.bin"), std::vector<uint16_t>{1, 300});
  try {
    open_token_stream(data(DataType::tokens, temp_file("big.bin")), 256, 1);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("token id 300"), std::string::npos) << e.what();
  }
  try {
    open_token_stream(data(DataType::text, "/nonexistent/corpus.txt"), 256, 1);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/corpus.txt"), std::string::npos);
  }
}

namespace {
// Writes `v` as a 1-D (or, with rows > 1, 2-D) dataset of the given HDF5 integer type.
template <class T>
void write_hdf5(const std::string& path, const char* name, const std::vector<T>& v, hid_t type, hsize_t rows = 1) {
  const hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  const hsize_t dims[2] = {rows, v.size() / rows};
  const hsize_t flat = v.size();
  const hid_t space = rows > 1 ? H5Screate_simple(2, dims, nullptr) : H5Screate_simple(1, &flat, nullptr);
  const hid_t d = H5Dcreate2(f, name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  H5Dwrite(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
  H5Dclose(d);
  H5Sclose(space);
  H5Fclose(f);
}
}  // namespace

TEST(Hdf5Data, A1DIntegerDatasetRoundTripsInAnyWidth) {
  const std::vector<uint16_t> a = {5, 0, 65535, 17, 3};
  write_hdf5(temp_file("a.h5"), "tokens", a, H5T_NATIVE_UINT16);
  Hdf5TokenDataset d16(temp_file("a.h5"), "tokens");
  EXPECT_EQ(all_tokens(d16), (std::vector<int32_t>{5, 0, 65535, 17, 3}));
  EXPECT_EQ(d16.max_token(), 65535);
  std::vector<int32_t> part(2);
  d16.read(2, 2, part.data());  // a hyperslab in the middle
  EXPECT_EQ(part, (std::vector<int32_t>{65535, 17}));
  const std::vector<int64_t> b = {100000, 1};
  write_hdf5(temp_file("b.h5"), "ids", b, H5T_NATIVE_INT64);
  DataConfig c = data(DataType::hdf5, temp_file("b.h5"));
  c.dataset = "ids";
  EXPECT_EQ(all_tokens(*open_token_stream(c, 200000, 1)), (std::vector<int32_t>{100000, 1}));
}

TEST(Hdf5Data, BadInputsAreUserErrorsNamingFileAndDataset) {
  write_hdf5(temp_file("c.h5"), "tokens", std::vector<int32_t>{1, 2, 3, 4}, H5T_NATIVE_INT32, 2);
  write_hdf5(temp_file("d.h5"), "tokens", std::vector<int32_t>{1, -2}, H5T_NATIVE_INT32);
  write_hdf5(temp_file("e.h5"), "tokens", std::vector<float>{1, 2}, H5T_NATIVE_FLOAT);
  std::ofstream(temp_file("f.h5")) << "not hdf5";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {temp_file("c.h5"), "not a 1-D integer array"}, {temp_file("d.h5"), "negative token id"},
      {temp_file("e.h5"), "not integers"},           {temp_file("f.h5"), "is not an HDF5 file"},
      {temp_file("missing.h5"), "cannot read data file"}};
  for (const auto& [path, message] : cases) {
    try {
      Hdf5TokenDataset d(path, "tokens");
      ADD_FAILURE() << path << " was accepted";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
  try {
    Hdf5TokenDataset d(temp_file("d.h5"), "input_ids");
    ADD_FAILURE() << "a missing dataset was accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("no dataset 'input_ids'"), std::string::npos) << e.what();
  }
}

TEST(TextData, ByteTokensAreTheFilesBytes) {
  std::ofstream(temp_file("t.txt"), std::ios::binary) << "Hi\n\xc3\xa9";
  auto s = open_token_stream(data(DataType::text, temp_file("t.txt")), 256, 1);
  EXPECT_EQ(all_tokens(*s), (std::vector<int32_t>{'H', 'i', '\n', 0xc3, 0xa9}));
}

TEST(SyntheticData, IsDeterministicAndHasTheStatedEntropy) {
  auto a = make_synthetic_stream(64, 200000, 7), b = make_synthetic_stream(64, 200000, 7), c = make_synthetic_stream(64, 200000, 8);
  EXPECT_EQ(all_tokens(*a), all_tokens(*b));
  EXPECT_NE(all_tokens(*a), all_tokens(*c));
  EXPECT_LT(a->max_token(), 64);
  // Empirical conditional entropy H(next | current) approaches the chain's (successors may collide
  // for small vocabularies, which can only lower it).
  const auto t = all_tokens(*a);
  std::map<int32_t, std::map<int32_t, int64_t>> counts;
  for (size_t i = 0; i + 1 < t.size(); ++i) ++counts[t[i]][t[i + 1]];
  double h = 0;
  for (const auto& [cur, next] : counts) {
    int64_t total = 0;
    for (const auto& [n, k] : next) total += k;
    for (const auto& [n, k] : next) h -= static_cast<double>(k) / (t.size() - 1) * std::log(static_cast<double>(k) / total);
  }
  EXPECT_LE(h, markov_entropy_nats() + 0.01);
  EXPECT_GT(h, markov_entropy_nats() - 0.15);
}

TEST(BatchSampler, TargetsAreInputsShiftedByOne) {
  auto s = make_synthetic_stream(256, 10000, 1);
  const auto t = all_tokens(*s);
  BatchSampler sampler(*s, {16, 4, 1, 1, 0, 0.1, 3});
  std::vector<int32_t> in, tgt;
  sampler.train_batch(5, 0, in, tgt);
  ASSERT_EQ(in.size(), 64u);
  for (int i = 0; i < 4; ++i) {
    const int64_t off = sampler.sample_offset(5 * 4 + i);
    EXPECT_LE(off + 16, sampler.train_tokens() - 1);
    for (int k = 0; k < 16; ++k) {
      EXPECT_EQ(in[i * 16 + k], t[off + k]);
      EXPECT_EQ(tgt[i * 16 + k], t[off + k + 1]);
    }
  }
}

// data.shuffle false: rank r's micro batch m of step s reads windows s*B + (m*W + r)*b + i in stream order
// (seq_len + 1 tokens at a stride of seq_len), wrapping after the split's last whole window.
TEST(BatchSampler, UnshuffledSamplesAreConsecutiveWindowsInStreamOrder) {
  auto s = make_synthetic_stream(256, 1001, 1);
  const auto t = all_tokens(*s);
  BatchSampler sampler(*s, {10, 2, 2, 3, 1, 0.0, 7, false});  // seq_len 10, micro 2, accumulation 2, rank 1 of 3
  std::vector<int32_t> in, tgt;
  sampler.train_batch(4, 1, in, tgt);
  for (int i = 0; i < 2; ++i) {
    const int64_t g = 4 * 12 + (1 * 3 + 1) * 2 + i;  // global batch 12
    for (int k = 0; k < 10; ++k) {
      EXPECT_EQ(in[i * 10 + k], t[g * 10 + k]) << i;
      EXPECT_EQ(tgt[i * 10 + k], t[g * 10 + k + 1]) << i;
    }
  }
  EXPECT_EQ(sampler.sample_offset(99), 990);  // the last whole window: 990 + 11 tokens = 1001
  EXPECT_EQ(sampler.sample_offset(100), 0);   // then the split again from its start
}

// The same global batch whatever the world size: the data side of "ZeRO on N ranks computes the
// same run as one rank with the same global batch".
TEST(BatchSampler, GlobalBatchIsTheSameSetOfSamplesAtAnyWorldSize) {
  auto s = make_synthetic_stream(256, 50000, 1);
  auto global_batch = [&](int world, int64_t grad_accum, int64_t step) {
    std::multiset<std::vector<int32_t>> samples;
    for (int r = 0; r < world; ++r) {
      BatchSampler sampler(*s, {8, 2, grad_accum, world, r, 0.0, 11});
      for (int64_t m = 0; m < grad_accum; ++m) {
        std::vector<int32_t> in, tgt;
        sampler.train_batch(step, m, in, tgt);
        for (int i = 0; i < 2; ++i) samples.insert(std::vector<int32_t>(in.begin() + i * 8, in.begin() + (i + 1) * 8));
      }
    }
    return samples;
  };
  for (int64_t step : {0, 3}) {
    const auto one = global_batch(1, 8, step);
    EXPECT_EQ(one.size(), 16u);
    EXPECT_EQ(global_batch(2, 4, step), one);
    EXPECT_EQ(global_batch(4, 2, step), one);
  }
  EXPECT_NE(global_batch(1, 8, 0), global_batch(1, 8, 1));
}

TEST(BatchSampler, ValidationReadsTheHeldOutTail) {
  auto s = make_synthetic_stream(256, 1000, 1);
  const auto t = all_tokens(*s);
  BatchSampler sampler(*s, {10, 2, 1, 1, 0, 0.1, 1});
  EXPECT_EQ(sampler.val_tokens(), 100);
  std::vector<int32_t> in, tgt;
  sampler.val_batch(0, in, tgt);
  EXPECT_EQ(in[0], t[900]);
  EXPECT_EQ(tgt[9], t[910]);
  EXPECT_EQ(in[10], t[910]);
}

TEST(BatchSampler, TooLittleDataIsAUserError) {
  auto s = make_synthetic_stream(256, 100, 1);
  EXPECT_THROW(BatchSampler(*s, {128, 1, 1, 1, 0, 0.0, 1}), UserError);
  EXPECT_THROW(BatchSampler(*s, {16, 1, 1, 1, 0, 0.05, 1}), UserError);  // 5 validation tokens < 17
}

// Shards read as one stream: a window that spans two files reads the end of one and the start of the next.
TEST(TokenFiles, ShardsReadAsOneStreamAcrossTheirBoundaries) {
  write_tokens(temp_file("s1.bin"), std::vector<uint16_t>{1, 2, 3});
  write_tokens(temp_file("s2.bin"), std::vector<uint16_t>{40, 50});
  std::vector<std::unique_ptr<TokenStream>> parts;
  parts.push_back(std::make_unique<TokenFile>(temp_file("s1.bin"), "uint16"));
  parts.push_back(std::make_unique<TokenFile>(temp_file("s2.bin"), "uint16"));
  const ConcatTokenStream s(std::move(parts), "two shards");
  EXPECT_EQ(s.size(), 5);
  EXPECT_EQ(s.max_token(), 50);
  EXPECT_EQ(all_tokens(s), (std::vector<int32_t>{1, 2, 3, 40, 50}));
  std::vector<int32_t> window(3);
  s.read(1, 3, window.data());
  EXPECT_EQ(window, (std::vector<int32_t>{2, 3, 40}));
}
