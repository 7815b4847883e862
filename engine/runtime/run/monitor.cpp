#include "engine/runtime/run/monitor.hpp"

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "common/error.hpp"

namespace ds {
namespace fs = std::filesystem;

uint32_t crc32c(const void* data, size_t n) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reflected Castagnoli polynomial
      t[i] = c;
    }
    return t;
  }();
  uint32_t c = 0xFFFFFFFFu;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

namespace {

std::string create_dir(const MonitorConfig& m, const char* which) {
  const fs::path dir = fs::path(m.output_path.empty() ? "." : m.output_path) / m.job_name;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw UserError(std::string("cannot create the ") + which + " directory '" + dir.string() + "': " + ec.message(),
                    std::string("set ") + which + ".output_path to a writable directory");
  return dir.string();
}

// Protocol buffer wire format, just what an Event with scalar summaries needs.
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
template <class T>
void put_fixed(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // little-endian on every machine ds builds for
  out.append(b, sizeof(T));
}
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_varint(out, static_cast<uint64_t>(field) << 3 | 2);
  put_varint(out, bytes.size());
  out += bytes;
}

double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

CsvMonitor::CsvMonitor(std::string dir) : dir_(std::move(dir)) {}

void CsvMonitor::write(const std::vector<MetricEvent>& events) {
  for (const MetricEvent& e : events) {
    auto it = files_.find(e.name);
    if (it == files_.end()) {
      std::string file = e.name;
      for (char& c : file)
        if (c == '/' || c == ' ') c = '_';
      const std::string path = (fs::path(dir_) / (file + ".csv")).string();
      const bool fresh = !fs::exists(path);  // a resumed run appends
      it = files_.emplace(e.name, std::ofstream(path, std::ios::app)).first;
      if (!it->second) throw std::runtime_error("cannot write " + path);
      if (fresh) it->second << "step," << e.name.substr(e.name.rfind('/') + 1) << "\n";
    }
    it->second << e.step << "," << e.value << "\n";
    it->second.flush();
  }
}

TensorBoardMonitor::TensorBoardMonitor(const std::string& dir) {
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  path_ = (fs::path(dir) / ("events.out.tfevents." + std::to_string(static_cast<int64_t>(wall_time())) + "." + host + "." +
                            std::to_string(::getpid()) + ".0"))
              .string();
  out_.open(path_, std::ios::binary | std::ios::trunc);
  if (!out_) throw std::runtime_error("cannot write " + path_);
  std::string first;  // Event{wall_time = 1, file_version = 3}
  put_varint(first, 1 << 3 | 1);
  put_fixed(first, wall_time());
  put_bytes(first, 3, "brain.Event:2");
  record(first);
}

void TensorBoardMonitor::record(const std::string& data) {
  // TFRecord: length, masked CRC of the length, data, masked CRC of the data.
  std::string header;
  put_fixed(header, static_cast<uint64_t>(data.size()));
  out_.write(header.data(), 8);
  std::string crc;
  put_fixed(crc, masked_crc32c(header.data(), 8));
  put_fixed(crc, masked_crc32c(data.data(), data.size()));
  out_.write(crc.data(), 4);
  out_.write(data.data(), static_cast<std::streamsize>(data.size()));
  out_.write(crc.data() + 4, 4);
}

void TensorBoardMonitor::write(const std::vector<MetricEvent>& events) {
  const double now = wall_time();
  for (const MetricEvent& e : events) {
    std::string value;  // Summary.Value{tag = 1, simple_value = 2}
    put_bytes(value, 1, e.name);
    put_varint(value, 2 << 3 | 5);
    put_fixed(value, static_cast<float>(e.value));
    std::string summary;  // Summary{value = 1}
    put_bytes(summary, 1, value);
    std::string event;  // Event{wall_time = 1, step = 2, summary = 5}
    put_varint(event, 1 << 3 | 1);
    put_fixed(event, now);
    put_varint(event, 2 << 3 | 0);
    put_varint(event, static_cast<uint64_t>(e.step));
    put_bytes(event, 5, summary);
    record(event);
  }
  out_.flush();
}

std::vector<std::unique_ptr<MetricSink>> open_monitors(const RunSettings& run) {
  std::vector<std::unique_ptr<MetricSink>> sinks;
  if (run.csv_monitor.enabled) sinks.push_back(std::make_unique<CsvMonitor>(create_dir(run.csv_monitor, "csv_monitor")));
  if (run.tensorboard.enabled)
    sinks.push_back(std::make_unique<TensorBoardMonitor>(create_dir(run.tensorboard, "tensorboard")));
  return sinks;
}

}  // namespace ds
