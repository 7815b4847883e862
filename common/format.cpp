#include "common/format.hpp"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace ds {

std::string format_bytes(double bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  double v = bytes;
  while (std::fabs(v) >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char buf[64];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%.0f B", v);
  else
    std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

std::string format_fixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

std::string format_shape(const std::vector<int64_t>& shape) {
  std::string t = "[";
  for (size_t i = 0; i < shape.size(); ++i) t += (i ? ", " : "") + std::to_string(shape[i]);
  return t + "]";
}

std::string format_gib(double bytes, int decimals) { return format_fixed(bytes / 1073741824.0, decimals); }

std::string format_count(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n);
  std::string out;
  int k = 0;
  for (auto it = digits.rbegin(); it != digits.rend(); ++it) {
    if (k > 0 && k % 3 == 0) out.insert(out.begin(), ',');
    out.insert(out.begin(), *it);
    ++k;
  }
  return n < 0 ? "-" + out : out;
}

std::string format_si(double n) {
  static const char* suffix[] = {"", "K", "M", "B", "T", "P"};
  int u = 0;
  while (std::fabs(n) >= 1000.0 && u < 5) {
    n /= 1000.0;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f%s" : "%.3g%s", n, suffix[u]);
  return buf;
}

std::string format_double(double v) {
  char buf[64];
  for (int precision = 6; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

bool parse_bytes(const std::string& text, double* bytes) {
  const char* s = text.c_str();
  char* end = nullptr;
  double v = std::strtod(s, &end);
  if (end == s || !std::isfinite(v) || v < 0) return false;
  std::string unit;
  for (const char* p = end; *p; ++p)
    if (!std::isspace(static_cast<unsigned char>(*p))) unit += static_cast<char>(std::tolower(static_cast<unsigned char>(*p)));
  double mult;
  if (unit.empty()) return false;  // a bare number is ambiguous (80 means 80 GiB to most people, 80 bytes to a parser)
  if (unit == "b") mult = 1;
  else if (unit == "k" || unit == "kib") mult = 1024.0;
  else if (unit == "kb") mult = 1e3;
  else if (unit == "m" || unit == "mib") mult = 1048576.0;
  else if (unit == "mb") mult = 1e6;
  else if (unit == "g" || unit == "gib") mult = 1073741824.0;
  else if (unit == "gb") mult = 1e9;
  else if (unit == "t" || unit == "tib") mult = 1099511627776.0;
  else if (unit == "tb") mult = 1e12;
  else return false;
  *bytes = v * mult;
  return true;
}

}  // namespace ds
