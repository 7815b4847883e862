#include "engine/plan/hardware.hpp"

#include <algorithm>
#include <cctype>
#include <cstdlib>

namespace ds {
namespace {

constexpr double kGB = 1e9;
constexpr double kMiB = 1048576.0;
constexpr double kNvlinkLatency = 10e-6;   // a small all-reduce inside one node
constexpr double kNetworkLatency = 30e-6;  // the same across nodes
constexpr double kNicEfficiency = 0.9;     // busbw over a NIC's line rate

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

std::string join_names(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

const std::vector<Link>& known_links() {
  static const std::vector<Link> links = {
      {"nvlink4", 370 * kGB, kNvlinkLatency},   // H100/H200 SXM: 450 GB/s a direction, ~370 through NCCL (ring)
      {"nvlink3", 210 * kGB, kNvlinkLatency},   // A100 SXM: 300 GB/s a direction; nccl-tests report ~200-230
      {"pcie5", 40 * kGB, 15e-6},               // x16 Gen5: 64 GB/s a direction, shared with the host's traffic
      {"pcie4", 20 * kGB, 15e-6},               // x16 Gen4: 32 GB/s a direction
      {"ib-ndr", 400 / 8.0 * kNicEfficiency * kGB, kNetworkLatency},  // InfiniBand NDR, 400 Gb/s per GPU
      {"ib-hdr", 200 / 8.0 * kNicEfficiency * kGB, kNetworkLatency},  // InfiniBand HDR, 200 Gb/s per GPU
      {"eth-100g", 100 / 8.0 * kNicEfficiency * kGB, 50e-6},          // 100 GbE (RoCE) per GPU
  };
  return links;
}

std::string known_link_names() {
  std::vector<std::string> names;
  for (const Link& l : known_links()) names.push_back(l.name);
  return join_names(names);
}

std::optional<Link> link_from_text(const std::string& text, bool network) {
  const std::string key = lower(text);
  for (const Link& l : known_links())
    if (l.name == key) return l;
  // A rate: a number, a prefix (k, M, G, T; "i" for powers of two), B (bytes) or b (bits), "/s" or "ps".
  const char* s = text.c_str();
  char* end = nullptr;
  const double number = std::strtod(s, &end);
  if (end == s || !(number > 0) || !(number < 1e6)) return std::nullopt;
  std::string unit(end);
  if (unit.size() >= 2 && (unit.compare(unit.size() - 2, 2, "/s") == 0 || unit.compare(unit.size() - 2, 2, "ps") == 0))
    unit.resize(unit.size() - 2);
  else
    return std::nullopt;
  if (unit.empty()) return std::nullopt;
  const char last = unit.back();
  if (last != 'B' && last != 'b') return std::nullopt;
  unit.pop_back();
  const bool binary = !unit.empty() && unit.back() == 'i';
  if (binary) unit.pop_back();
  if (unit.size() != 1) return std::nullopt;
  const std::string prefixes = "kMGT";
  const size_t p = prefixes.find(unit[0] == 'K' ? 'k' : unit[0]);
  if (p == std::string::npos) return std::nullopt;
  double rate = number;
  for (size_t i = 0; i <= p; ++i) rate *= binary ? 1024.0 : 1000.0;
  if (last == 'b') rate = rate / 8 * kNicEfficiency;  // a line rate in bits: what NCCL carries over it
  if (rate < 1e6) return std::nullopt;  // under 1 MB/s: a typo, not a link
  return Link{text, rate, network ? kNetworkLatency : kNvlinkLatency};
}

namespace {

const std::vector<Link>& host_links() {
  static const std::vector<Link> links = {
      {"pcie5", 50 * kGB, 10e-6},  // x16 Gen5: 64 GB/s a direction; pinned copies sustain about 50
      {"pcie4", 25 * kGB, 10e-6},  // x16 Gen4: 32 GB/s a direction; about 25
  };
  return links;
}

}  // namespace

std::optional<Link> host_link_from_text(const std::string& text) {
  const std::string key = lower(text);
  for (const Link& l : host_links())
    if (l.name == key) return l;
  const std::optional<double> rate = byte_rate_from_text(text);
  if (!rate) return std::nullopt;
  return Link{text, *rate, 10e-6};
}

std::string known_host_link_names() {
  std::vector<std::string> names;
  for (const Link& l : host_links()) names.push_back(l.name);
  return join_names(names);
}

std::optional<double> byte_rate_from_text(const std::string& text) {
  const size_t slash = text.find('/');
  if (slash == std::string::npos || slash == 0 || text[slash - 1] != 'B') return std::nullopt;  // bytes, not a line rate in bits
  const std::optional<Link> l = link_from_text(text, false);
  return l ? std::optional<double>(l->busbw) : std::nullopt;
}

const std::vector<GpuModel>& known_gpus() {
  // Memory as nvidia-smi reports it; peak dense matmul rates from NVIDIA's data sheets. Listed so that the
  // first whose pieces all appear in a device's name is the one (PCIe variants before their SXM siblings).
  static const std::vector<GpuModel> gpus = {
      {"h100-pcie", "H100 PCIe 80GB", {"h100", "pcie"}, 81559 * kMiB, 756e12, 51.2e12, "pcie5", "pcie5"},
      {"h100", "H100 SXM 80GB", {"h100"}, 81559 * kMiB, 989.4e12, 66.9e12, "nvlink4", "pcie5"},
      {"h200", "H200 SXM 141GB", {"h200"}, 143771 * kMiB, 989.4e12, 66.9e12, "nvlink4", "pcie5"},
      {"a100-pcie", "A100 PCIe 80GB", {"a100", "pcie"}, 81920 * kMiB, 312e12, 19.5e12, "pcie4", "pcie4"},
      {"a100-40gb", "A100 SXM 40GB", {"a100", "40gb"}, 40960 * kMiB, 312e12, 19.5e12, "nvlink3", "pcie4"},
      {"a100", "A100 SXM 80GB", {"a100"}, 81920 * kMiB, 312e12, 19.5e12, "nvlink3", "pcie4"},
      {"l40s", "L40S 48GB", {"l40s"}, 46068 * kMiB, 362e12, 91.6e12, "pcie4", "pcie4"},
      {"rtx4090", "GeForce RTX 4090 24GB", {"4090"}, 24564 * kMiB, 165.2e12, 82.6e12, "pcie4", "pcie4"},
  };
  return gpus;
}

const GpuModel* gpu_by_name(const std::string& name) {
  const std::string key = lower(name);
  for (const GpuModel& g : known_gpus())
    if (g.name == key) return &g;
  return nullptr;
}

const GpuModel* gpu_from_device_name(const std::string& device_name) {
  const std::string name = lower(device_name);
  for (const GpuModel& g : known_gpus())
    if (std::all_of(g.matches.begin(), g.matches.end(), [&](const std::string& m) { return name.find(m) != std::string::npos; }))
      return &g;
  return nullptr;
}

std::string known_gpu_names() {
  std::vector<std::string> names;
  for (const GpuModel& g : known_gpus()) names.push_back(g.name);
  return join_names(names);
}

}  // namespace ds
