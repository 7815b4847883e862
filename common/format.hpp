// ds — number formatting for people: bytes in binary units (GiB), counts with separators.
// Units are always named; 1 GiB = 2^30 bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ds {

std::string format_bytes(double bytes);            // "12.55 GiB", "512.00 MiB", "100 B"
std::string format_gib(double bytes, int decimals = 2);  // always GiB: "0.49"
std::string format_count(int64_t n);               // "124,439,808"
std::string format_si(double n);                   // "124.4M", "6.74B", "1.2T"
std::string format_double(double v);               // shortest text that reads back the same
std::string format_fixed(double v, int decimals);  // "%.*f": "12.35"
std::string format_shape(const std::vector<int64_t>& shape);  // "[768, 2304]"
// Table columns: `s` padded with spaces to `width` on the right (pad) or on the left (lpad).
inline std::string pad(const std::string& s, size_t width) { return s.size() >= width ? s : s + std::string(width - s.size(), ' '); }
inline std::string lpad(const std::string& s, size_t width) { return s.size() >= width ? s : std::string(width - s.size(), ' ') + s; }

// Parses "80GiB", "80 GB", "512MiB", "1.5T", "4096B". The rule: KB/MB/GB/TB are powers of 10 (GB = 10^9);
// KiB/MiB/GiB/TiB and the bare letters K/M/G/T are powers of 2 (GiB = G = 2^30). A number without a unit
// is refused (false), as is anything else.
inline constexpr const char* kSizeUnitsHelp = "GB = 10^9 bytes; GiB (or G) = 2^30 bytes; a unit is required";
bool parse_bytes(const std::string& text, double* bytes);

}  // namespace ds
