// CSV and TensorBoard monitors: DeepSpeed's CSV layout, and event files that decode as TFRecords of
// Event protos with valid CRCs.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "engine/runtime/run/monitor.hpp"

using namespace ds;
namespace fs = std::filesystem;

namespace {
std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}
fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("ds_monitor_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}
}  // namespace

TEST(Crc32c, MatchesTheStandardCheckValue) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);  // the CRC-32C check value (RFC 3720)
  EXPECT_EQ(crc32c("", 0), 0u);
}

TEST(CsvMonitor, OneFilePerMetricInDeepSpeedsLayout) {
  const fs::path d = fresh_dir("csv");
  CsvMonitor m(d.string());
  m.write({{"Train/Samples/lr", 0.001, 32}, {"Train/Samples/train_loss", 5.5, 32}});
  m.write({{"Train/Samples/lr", 0.002, 64}});
  EXPECT_EQ(slurp(d / "Train_Samples_lr.csv"), "step,lr\n32,0.001\n64,0.002\n");
  EXPECT_EQ(slurp(d / "Train_Samples_train_loss.csv"), "step,train_loss\n32,5.5\n");
}

TEST(TensorBoardMonitor, WritesTfRecordsOfScalarEventsWithValidCrcs) {
  const fs::path d = fresh_dir("tb");
  std::string path;
  {
    TensorBoardMonitor m(d.string());
    path = m.path();
    m.write({{"Train/Samples/lr", 0.25, 96}});
  }
  EXPECT_EQ(fs::path(path).filename().string().rfind("events.out.tfevents.", 0), 0u);
  const std::string bytes = slurp(path);
  std::vector<std::string> records;
  for (size_t at = 0; at < bytes.size();) {
    ASSERT_LE(at + 12, bytes.size());
    uint64_t len;
    uint32_t len_crc, data_crc;
    std::memcpy(&len, bytes.data() + at, 8);
    std::memcpy(&len_crc, bytes.data() + at + 8, 4);
    ASSERT_EQ(len_crc, masked_crc32c(bytes.data() + at, 8));
    ASSERT_LE(at + 16 + len, bytes.size());
    const std::string data = bytes.substr(at + 12, len);
    std::memcpy(&data_crc, bytes.data() + at + 12 + len, 4);
    ASSERT_EQ(data_crc, masked_crc32c(data.data(), data.size()));
    records.push_back(data);
    at += 16 + len;
  }
  ASSERT_EQ(records.size(), 2u);
  EXPECT_NE(records[0].find("brain.Event:2"), std::string::npos);
  // Event: wall_time (9 bytes), step 96 as field 2 (0x10 0x60), then the summary with the tag and
  // simple_value (field 2, fixed32: 0x15 then 0.25f).
  const std::string& e = records[1];
  EXPECT_EQ(e.substr(9, 2), std::string("\x10\x60", 2));
  EXPECT_NE(e.find("Train/Samples/lr"), std::string::npos);
  const float quarter = 0.25f;
  std::string value = "\x15";
  value.append(reinterpret_cast<const char*>(&quarter), 4);
  EXPECT_NE(e.find(value), std::string::npos);
}
