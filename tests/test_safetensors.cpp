// The safetensors reader and writer: round trips in every float dtype, the reference layout (8-byte
// aligned data, spaces as padding), and every malformed header a clear error naming the file and tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include <sys/stat.h>
#include <unistd.h>

#include "common/error.hpp"
#include "engine/runtime/io/safetensors.hpp"
#include "kernels/cpu/adam.hpp"

using namespace ds;
namespace fs = std::filesystem;

namespace {

std::string scratch(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("ds_st_" + std::to_string(::getpid()));
  fs::create_directories(d);
  return (d / name).string();
}

// A file from a header text and a data section.
std::vector<uint8_t> file_of(const std::string& header, size_t data_bytes) {
  std::vector<uint8_t> f(8 + header.size() + data_bytes, 0);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) f[static_cast<size_t>(i)] = static_cast<uint8_t>(n >> (8 * i));
  std::memcpy(f.data() + 8, header.data(), header.size());
  return f;
}

std::string error_of(const std::vector<uint8_t>& bytes) {
  try {
    SafetensorsView v(bytes.data(), bytes.size(), "bad.safetensors");
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Safetensors, RoundTripsEveryFloatDtypeWithTheReferenceLayout) {
  const std::vector<float> values{0.0f, 1.0f, -2.5f, 3.14159f, 1e-3f, -65504.0f, 0.1f, 7.0f};
  const std::string path = scratch("round.safetensors");
  std::vector<StTensorSource> tensors;
  for (StDtype d : {StDtype::F32, StDtype::BF16, StDtype::F16}) {
    tensors.push_back({std::string("t_") + st_dtype_name(d), d, {2, 4}, [d, &values](uint8_t* out) {
                         for (size_t i = 0; i < values.size(); ++i) {
                           if (d == StDtype::F32) std::memcpy(out + 4 * i, &values[i], 4);
                           const uint16_t h = d == StDtype::BF16 ? kernels::float_to_bf16(values[i]) : f32_to_f16(values[i]);
                           if (d != StDtype::F32) std::memcpy(out + 2 * i, &h, 2);
                         }
                       }});
  }
  tensors.push_back({"empty", StDtype::F32, {0, 3}, [](uint8_t*) {}});
  tensors.push_back({"scalar", StDtype::F32, {}, [](uint8_t* out) { const float v = 42; std::memcpy(out, &v, 4); }});
  EXPECT_EQ(write_safetensors(path, tensors), 8u * 4 + 8 * 2 + 8 * 2 + 0 + 4);
  EXPECT_FALSE(fs::exists(path + ".partial"));

  // The header: a little-endian length, JSON starting with '{', padded with spaces so data starts at 8k.
  std::ifstream in(path, std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[static_cast<size_t>(i)];
  EXPECT_EQ((8 + n) % 8, 0u);
  EXPECT_EQ(bytes[8], '{');
  EXPECT_EQ(bytes[8 + n - 1] == ' ' || bytes[8 + n - 1] == '}', true);

  SafetensorsFile f(path);
  const SafetensorsView& v = f.view();
  EXPECT_EQ(v.tensors().size(), 5u);
  EXPECT_EQ(v.metadata().at("format"), "pt");
  std::vector<float> back(8);
  v.read_f32(*v.find("t_F32"), back.data());
  EXPECT_EQ(back, values);
  v.read_f32(*v.find("t_BF16"), back.data());
  for (size_t i = 0; i < values.size(); ++i) EXPECT_NEAR(back[i], values[i], std::abs(values[i]) / 128 + 1e-30) << i;
  v.read_f32(*v.find("t_F16"), back.data());
  for (size_t i = 0; i < values.size(); ++i) EXPECT_NEAR(back[i], values[i], std::abs(values[i]) / 1024 + 1e-6) << i;
  EXPECT_EQ(v.find("scalar")->numel(), 1);
  EXPECT_EQ(v.find("empty")->numel(), 0);
}

TEST(Safetensors, HalfPrecisionConvertsAsIeeeSays) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);                         // the largest half
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);                         // rounds up to inf
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);            // the smallest subnormal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -26)), 0x0000);            // below half of it: zero
  EXPECT_EQ(f32_to_f16(0.1f), 0x2e66);
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);     // a tie rounds to even
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(std::numeric_limits<float>::quiet_NaN()))));
  // Every half that is a number converts to fp32 and back to itself.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) continue;  // NaN payloads
    ASSERT_EQ(f32_to_f16(f16_to_f32(static_cast<uint16_t>(h))), h) << std::hex << h;
  }
}

TEST(Safetensors, EveryMalformedFileIsAnErrorNamingWhatIsWrong) {
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  EXPECT_EQ(error_of(file_of(ok, 8)), "");
  const std::vector<std::pair<std::vector<uint8_t>, std::string>> cases{
      {{1, 2, 3}, "shorter than its 8-byte header length"},
      {file_of(ok, 4), "outside the data section"},
      {file_of(ok, 12), "4 bytes after the last tensor"},
      {file_of("[1,2]", 0), "does not start with '{'"},
      {file_of("{\"a\":", 0), "not JSON"},
      {file_of(R"({"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", 8), "unknown dtype 'F33'"},
      {file_of(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "make 12 bytes, but data_offsets span 8"},
      {file_of(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,8]}})", 8), "not a non-negative integer"},
      {file_of(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8), "overflows"},
      {file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "outside the data section"},
      {file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
       "overlaps"},
      {file_of(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8), "a hole of 4 bytes"},
      {file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 16),
       "tensor 'a': the name appears twice"},
      {file_of(R"({"__metadata__":{"format":1}})", 0), "not a string"},
      {file_of(R"({"a":{"dtype":"F32","shape":[2]}})", 8), "tensor 'a': data_offsets is not [begin, end]"},
  };
  for (const auto& [bytes, expected] : cases) {
    const std::string e = error_of(bytes);
    EXPECT_NE(e.find("bad.safetensors"), std::string::npos) << e;
    EXPECT_NE(e.find(expected), std::string::npos) << "expected '" << expected << "' in: " << e;
  }
  // A header length past the file, and one past the reference reader's 100 MB limit.
  std::vector<uint8_t> huge = file_of(ok, 8);
  huge[3] = 0x10;
  EXPECT_NE(error_of(huge).find("at most 100 MB"), std::string::npos) << error_of(huge);
  huge[3] = 0;
  huge[1] = 0x10;
  EXPECT_NE(error_of(huge).find("but the file has"), std::string::npos) << error_of(huge);
  // Integers as a non-float dtype are refused as weights, by name.
  const std::vector<uint8_t> ints = file_of(R"({"ids":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}})", 8);
  SafetensorsView v(ints.data(), ints.size(), "ids.safetensors");
  float out[2];
  try {
    v.read_f32(*v.find("ids"), out);
    ADD_FAILURE() << "I32 read as weights";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("'ids' is I32"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, AFileThatShrinksWhileReadIsAnErrorNamingItNotSigbus) {
  // Another program truncating the file mid-import used to kill ds with SIGBUS (a read through the
  // mapping past the new end). The file's reads go through pread now: a short read names the file.
  const std::string path = scratch("shrinks.safetensors");
  std::vector<float> a(4096, 1.5f), b(4096, 2.5f);
  std::vector<StTensorSource> tensors;
  tensors.push_back({"a", StDtype::F32, {4096}, [&](uint8_t* out) { std::memcpy(out, a.data(), a.size() * 4); }});
  tensors.push_back({"b", StDtype::BF16, {4096}, [&](uint8_t* out) {
                       for (size_t i = 0; i < b.size(); ++i) {
                         const uint16_t h = kernels::float_to_bf16(b[i]);
                         std::memcpy(out + 2 * i, &h, 2);
                       }
                     }});
  write_safetensors(path, tensors);
  SafetensorsFile f(path);
  std::vector<float> back(4096);
  f.read_f32(*f.view().find("a"), back.data());
  EXPECT_EQ(back, a);
  fs::resize_file(path, fs::file_size(path) - 4096);  // b's tail is gone
  try {
    f.read_f32(*f.view().find("b"), back.data());
    FAIL() << "read past the end of a truncated file";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("shrinks.safetensors': reading tensor 'b' failed: the file shrank from"), std::string::npos) << e.what();
  }
  f.read_f32(*f.view().find("a"), back.data());  // what is still there reads as before
  EXPECT_EQ(back, a);
}

TEST(Safetensors, AFifoIsRefusedWithoutWaitingForAWriter) {
  const std::string path = scratch("fifo.safetensors");
  fs::remove(path);
  ASSERT_EQ(::mkfifo(path.c_str(), 0644), 0);
  try {
    SafetensorsFile f(path);
    FAIL() << "a FIFO was opened as weights";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("is not a regular file"), std::string::npos) << e.what();
  }
}
