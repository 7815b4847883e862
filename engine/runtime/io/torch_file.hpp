// ds — one torch.save file (.pt, .bin) opened for reading without running it: its zip container
// (torch_zip.hpp), its pickle read by ds's bounded reader (pickle_reader.hpp), and any tensor's elements
// read from its storage member on demand, a range at a time, so memory holds what is asked for only.
#pragma once

#include <cstdint>
#include <string>

#include "engine/runtime/io/pickle_reader.hpp"
#include "engine/runtime/io/torch_zip.hpp"

namespace ds {

class TorchFile {
 public:
  explicit TorchFile(const std::string& path);  // UserError naming the path
  TorchFile(std::unique_ptr<ByteReader> bytes);  // a fuzzer's or a test's bytes
  const std::string& path() const { return zip_.path(); }
  const PyValue& root() const { return pickle_.root(); }
  // Elements [from, from + n) of a contiguous tensor, as fp32 (from F32, BF16, F16 or F64 storages). UserError
  // naming the file for another dtype, a view that is not contiguous, or a storage member missing or short.
  void read_f32(const PyValue& tensor, int64_t from, int64_t n, float* out) const;

 private:
  const ZipMember& storage_member(const PyValue& storage) const;  // UserError when missing or short
  TorchZip zip_;
  Pickle pickle_;
};

}  // namespace ds
