// ds — the safetensors format (Hugging Face's tensor files), read and written without LibTorch.
// Layout: 8 bytes little-endian N, N bytes of JSON header {name: {"dtype", "shape", "data_offsets":
// [begin, end]}, "__metadata__": {string: string}}, then the data section (offsets relative to its
// start, row-major, little-endian). Everything a file claims is checked before a byte of data is read:
// header length against the file size (and at most 100 MB, as the reference reader), the JSON, known
// dtypes, shapes whose product fits, offsets in order without overlap or hole ending at the data's end,
// shape x dtype size equal to the byte span, no duplicate names. A bad file is a UserError naming the
// file and the tensor: never a crash, never a read out of bounds (fuzz/fuzz_safetensors.cpp).
// Writing pads the header with spaces to a multiple of 8 (as the reference writer does), streams one
// tensor at a time (memory bounded by the largest tensor) to a temporary file, and renames it into place.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace ds {

enum class StDtype { BOOL, U8, I8, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64, F8_E4M3, F8_E5M2 };
const char* st_dtype_name(StDtype d);
int st_dtype_bytes(StDtype d);

struct StTensor {
  std::string name;
  StDtype dtype = StDtype::F32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // in the data section
  int64_t numel() const;
};

// A validated view of safetensors bytes held elsewhere (a mapped file, or a fuzzer's input).
class SafetensorsView {
 public:
  // Throws UserError naming `source` for anything the format forbids.
  SafetensorsView(const uint8_t* data, size_t size, const std::string& source);

  const std::vector<StTensor>& tensors() const { return tensors_; }  // in file order
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const StTensor* find(const std::string& name) const;
  const uint8_t* bytes(const StTensor& t) const { return data_ + t.begin; }
  // The tensor's values as fp32 (from F32, F16, BF16 or F64) into `out` (numel elements). UserError
  // for other dtypes.
  void read_f32(const StTensor& t, float* out) const;
  const std::string& source() const { return source_; }

 private:
  const uint8_t* data_ = nullptr;  // the data section
  std::string source_;
  std::vector<StTensor> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// A safetensors file, memory-mapped read-only.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);  // UserError naming the path when unreadable or invalid
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  const SafetensorsView& view() const { return *view_; }
  // The tensor's values as fp32, read from the file (not the mapping, which holds only the header's
  // pages resident): a file that shrinks meanwhile is a UserError naming it, never SIGBUS.
  void read_f32(const StTensor& t, float* out) const;

 private:
  std::string path_;
  int fd_ = -1;
  void* map_ = nullptr;
  size_t size_ = 0;
  std::unique_ptr<SafetensorsView> view_;
};

// One tensor to write: its bytes are produced on demand into a buffer of (numel x dtype size) bytes.
struct StTensorSource {
  std::string name;
  StDtype dtype = StDtype::F32;
  std::vector<int64_t> shape;
  std::function<void(uint8_t* out)> fill;
};

// Writes `tensors` (in this order) to `path` through `path`.partial and a rename; returns the bytes of
// tensor data written. Throws std::runtime_error naming the path on I/O failure (nothing is left at
// `path` then). Names must be unique.
uint64_t write_safetensors(const std::string& path, const std::vector<StTensorSource>& tensors,
                           const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

// `n` values of `dtype` at `p` as fp32 into `out`; false for a dtype that is not floating point.
bool convert_to_f32(StDtype dtype, const uint8_t* p, int64_t n, float* out);

// IEEE half precision <-> fp32: round to nearest even, overflow to inf, NaN stays NaN (bf16's pair is
// kernels::float_to_bf16 / bf16_to_float).
uint16_t f32_to_f16(float f);
float f16_to_f32(uint16_t h);

}  // namespace ds
