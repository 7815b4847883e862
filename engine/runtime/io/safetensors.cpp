#include "engine/runtime/io/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/error.hpp"
#include "common/json_depth.hpp"
#include "kernels/cpu/adam.hpp"

namespace ds {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the reference reader's limit

struct DtypeInfo {
  StDtype dtype;
  const char* name;
  int bytes;
};
constexpr DtypeInfo kDtypes[] = {{StDtype::BOOL, "BOOL", 1}, {StDtype::U8, "U8", 1},     {StDtype::I8, "I8", 1},
                                 {StDtype::I16, "I16", 2},   {StDtype::U16, "U16", 2},   {StDtype::F16, "F16", 2},
                                 {StDtype::BF16, "BF16", 2}, {StDtype::I32, "I32", 4},   {StDtype::U32, "U32", 4},
                                 {StDtype::F32, "F32", 4},   {StDtype::F64, "F64", 8},   {StDtype::I64, "I64", 8},
                                 {StDtype::U64, "U64", 8},   {StDtype::F8_E4M3, "F8_E4M3", 1}, {StDtype::F8_E5M2, "F8_E5M2", 1}};

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

const char* st_dtype_name(StDtype d) {
  for (const auto& i : kDtypes)
    if (i.dtype == d) return i.name;
  return "?";
}

int st_dtype_bytes(StDtype d) {
  for (const auto& i : kDtypes)
    if (i.dtype == d) return i.bytes;
  return 0;
}

int64_t StTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsView::SafetensorsView(const uint8_t* data, size_t size, const std::string& source) : source_(source) {
  auto bad = [&](const std::string& what, const std::string& tensor = "") {
    return UserError("'" + source + "' is not a valid safetensors file: " + (tensor.empty() ? "" : "tensor '" + tensor + "': ") + what,
                     "re-export it, or check that the download or copy is complete");
  };
  if (size < 8) throw bad("shorter than its 8-byte header length (" + std::to_string(size) + " bytes)");
  const uint64_t n = read_u64_le(data);
  if (n > kMaxHeaderBytes) throw bad("the header claims " + std::to_string(n) + " bytes (at most 100 MB)");
  if (n > size - 8) throw bad("the header claims " + std::to_string(n) + " bytes but the file has " + std::to_string(size - 8) + " after the length");
  if (n == 0 || data[8] != '{') throw bad("the header does not start with '{'");
  // Parse, refusing a name given twice (JSON allows it; the format does not).
  std::set<std::string> seen;
  std::string duplicate;
  check_json_nesting(std::string_view(reinterpret_cast<const char*>(data + 8), n), source);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(
        data + 8, data + 8 + n,
        [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
          if (depth == 1 && event == nlohmann::json::parse_event_t::key && !seen.insert(parsed.get<std::string>()).second &&
              duplicate.empty())
            duplicate = parsed.get<std::string>();
          return true;
        });
  } catch (const nlohmann::json::exception& e) {
    throw bad(std::string("its header is not JSON (") + e.what() + ")");
  }
  if (!duplicate.empty()) throw bad("the name appears twice", duplicate);
  if (!header.is_object()) throw bad("its header is not a JSON object");
  const uint64_t data_size = size - 8 - n;
  data_ = data + 8 + n;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) throw bad("__metadata__ is not an object");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) throw bad("__metadata__ value of '" + k + "' is not a string");
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    if (!entry.is_object()) throw bad("its entry is not an object", name);
    StTensor t;
    t.name = name;
    const auto dt = entry.find("dtype");
    if (dt == entry.end() || !dt->is_string()) throw bad("no dtype", name);
    const std::string dts = dt->get<std::string>();
    const auto info = std::find_if(std::begin(kDtypes), std::end(kDtypes), [&](const DtypeInfo& i) { return dts == i.name; });
    if (info == std::end(kDtypes)) throw bad("unknown dtype '" + dts + "'", name);
    t.dtype = info->dtype;
    const auto sh = entry.find("shape");
    if (sh == entry.end() || !sh->is_array()) throw bad("no shape", name);
    uint64_t bytes = static_cast<uint64_t>(info->bytes);
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned() && !(d.is_number_integer() && d.get<int64_t>() >= 0))
        throw bad("a dimension is not a non-negative integer", name);
      const uint64_t v = d.get<uint64_t>();
      if (v > static_cast<uint64_t>(INT64_MAX) || __builtin_mul_overflow(bytes, v, &bytes)) throw bad("its shape overflows", name);
      t.shape.push_back(static_cast<int64_t>(v));
    }
    const auto off = entry.find("data_offsets");
    if (off == entry.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned())
      throw bad("data_offsets is not [begin, end]", name);
    t.begin = (*off)[0].get<uint64_t>();
    t.end = (*off)[1].get<uint64_t>();
    if (t.begin > t.end || t.end > data_size)
      throw bad("data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + "] outside the data section of " +
                    std::to_string(data_size) + " bytes",
                name);
    if (t.end - t.begin != bytes)
      throw bad("its shape and dtype make " + std::to_string(bytes) + " bytes, but data_offsets span " +
                    std::to_string(t.end - t.begin),
                name);
    tensors_.push_back(std::move(t));
  }
  // In file order, the spans tile the data section: no overlap, no hole.
  std::stable_sort(tensors_.begin(), tensors_.end(), [](const StTensor& a, const StTensor& b) { return a.begin < b.begin; });
  uint64_t at = 0;
  for (const StTensor& t : tensors_) {
    if (t.begin != at)
      throw bad(t.begin < at ? "its data overlaps the previous tensor's" : "a hole of " + std::to_string(t.begin - at) + " bytes precedes it",
                t.name);
    at = t.end;
  }
  if (at != data_size) throw bad(std::to_string(data_size - at) + " bytes after the last tensor");
  for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
}

const StTensor* SafetensorsView::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

bool convert_to_f32(StDtype dtype, const uint8_t* p, int64_t n, float* out) {
  switch (dtype) {
    case StDtype::F32: std::memcpy(out, p, static_cast<size_t>(n) * 4); return true;
    case StDtype::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = kernels::bf16_to_float(h);
      }
      return true;
    case StDtype::F16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = f16_to_f32(h);
      }
      return true;
    case StDtype::F64:
      for (int64_t i = 0; i < n; ++i) {
        double d;
        std::memcpy(&d, p + 8 * i, 8);
        out[i] = static_cast<float>(d);
      }
      return true;
    default: return false;
  }
}

void SafetensorsView::read_f32(const StTensor& t, float* out) const {
  if (!convert_to_f32(t.dtype, bytes(t), t.numel(), out))
    throw UserError("'" + source_ + "': tensor '" + t.name + "' is " + st_dtype_name(t.dtype) + ", not a floating-point type",
                    "weights must be F32, BF16, F16 or F64");
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  // O_NONBLOCK: opening a FIFO (or a device) must not wait for a writer; such a file is refused below.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw UserError("cannot open '" + path + "': " + std::strerror(errno), "");
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw UserError("'" + path + "' is not a regular file (a pipe, a device or a directory)", "weights are read from regular files only");
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    map_ = mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map_ == MAP_FAILED) {
      map_ = nullptr;
      const int err = errno;
      ::close(fd);
      throw UserError("cannot map '" + path + "': " + std::strerror(err), "");
    }
  }
  fd_ = fd;
  try {
    view_ = std::make_unique<SafetensorsView>(static_cast<const uint8_t*>(map_), size_, path);
  } catch (...) {
    if (map_) munmap(map_, size_);
    map_ = nullptr;
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

void SafetensorsFile::read_f32(const StTensor& t, float* out) const {
  // Read with pread, not through the mapping: a file truncated while it is read (another process
  // rewriting it) gives a short read and an error naming it, where a mapped read would die of SIGBUS.
  if (t.dtype != StDtype::F32 && t.dtype != StDtype::BF16 && t.dtype != StDtype::F16 && t.dtype != StDtype::F64)
    return view_->read_f32(t, out);  // refused there, naming the dtype
  const size_t bytes = static_cast<size_t>(t.end - t.begin);
  const off_t at = static_cast<off_t>(view_->bytes(t) - static_cast<const uint8_t*>(map_));
  std::vector<uint8_t> staged(t.dtype == StDtype::F32 ? 0 : bytes);
  uint8_t* into = t.dtype == StDtype::F32 ? reinterpret_cast<uint8_t*>(out) : staged.data();
  for (size_t done = 0; done < bytes;) {
    const ssize_t n = ::pread(fd_, into + done, bytes - done, at + static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      struct stat st {};
      const bool shrank = fstat(fd_, &st) == 0 && static_cast<size_t>(st.st_size) < size_;
      throw UserError("'" + path_ + "': reading tensor '" + t.name + "' failed: " +
                          (shrank ? "the file shrank from " + std::to_string(size_) + " to " + std::to_string(st.st_size) +
                                        " bytes while it was read"
                                  : std::string(n < 0 ? std::strerror(errno) : "unexpected end of file")),
                      "another program changed the file; read it again once it is complete");
    }
    done += static_cast<size_t>(n);
  }
  if (t.dtype != StDtype::F32) convert_to_f32(t.dtype, staged.data(), t.numel(), out);
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) munmap(map_, size_);
  if (fd_ >= 0) ::close(fd_);
}

uint64_t write_safetensors(const std::string& path, const std::vector<StTensorSource>& tensors,
                           const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t at = 0;
  std::set<std::string> names;
  for (const StTensorSource& t : tensors) {
    DS_CHECK(names.insert(t.name).second && t.name != "__metadata__", "tensor name '", t.name, "' twice");
    uint64_t bytes = static_cast<uint64_t>(st_dtype_bytes(t.dtype));
    for (int64_t d : t.shape) bytes *= static_cast<uint64_t>(d);
    header[t.name] = {{"dtype", st_dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {at, at + bytes}}};
    at += bytes;
  }
  std::string text = header.dump();
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');  // the data section starts at a multiple of 8
  const std::string partial = path + ".partial";
  FILE* f = std::fopen(partial.c_str(), "wb");
  if (!f) throw std::runtime_error("cannot write '" + partial + "': " + std::strerror(errno));
  auto fail = [&](const char* what) {
    const int err = errno;
    std::fclose(f);
    std::remove(partial.c_str());
    return std::runtime_error(std::string(what) + " '" + partial + "' failed: " + std::strerror(err) + " (is the disk full?)");
  };
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  if (std::fwrite(len, 1, 8, f) != 8 || std::fwrite(text.data(), 1, text.size(), f) != text.size()) throw fail("writing");
  std::vector<uint8_t> buf;
  for (const StTensorSource& t : tensors) {
    uint64_t bytes = static_cast<uint64_t>(st_dtype_bytes(t.dtype));
    for (int64_t d : t.shape) bytes *= static_cast<uint64_t>(d);
    buf.assign(static_cast<size_t>(bytes), 0);
    try {
      t.fill(buf.data());
    } catch (...) {  // a source that cannot be read (a corrupt checkpoint): no partial file is left behind
      std::fclose(f);
      std::remove(partial.c_str());
      throw;
    }
    if (std::fwrite(buf.data(), 1, buf.size(), f) != buf.size()) throw fail("writing");
  }
  if (std::fflush(f) != 0 || fsync(fileno(f)) != 0) throw fail("flushing");
  if (std::fclose(f) != 0) {
    std::remove(partial.c_str());
    throw std::runtime_error("closing '" + partial + "' failed: " + std::strerror(errno));
  }
  if (std::rename(partial.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(partial.c_str());
    throw std::runtime_error("cannot rename '" + partial + "' to '" + path + "': " + std::strerror(err));
  }
  return at;
}

uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t mant = x & 0x7fffffu;
  const int32_t exp = static_cast<int32_t>((x >> 23) & 0xffu);
  if (exp == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0u));  // inf, NaN
  const int32_t e = exp - 127 + 15;
  if (e >= 31) return static_cast<uint16_t>(sign | 0x7c00u);  // too large: inf
  if (e <= 0) {                                                // a half subnormal, or zero
    if (e < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000u;
    const uint32_t shift = static_cast<uint32_t>(14 - e);
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;  // a carry into the exponent is right (up to inf)
  return static_cast<uint16_t>(sign | half);
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t x;
  if (exp == 0) {
    const float f = std::ldexp(static_cast<float>(mant), -24);  // zero or a subnormal, exact
    return sign ? -f : f;
  }
  x = exp == 31 ? (sign | 0x7f800000u | (mant << 13)) : (sign | ((exp + 112u) << 23) | (mant << 13));
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

}  // namespace ds
