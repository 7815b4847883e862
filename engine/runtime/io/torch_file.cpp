#include "engine/runtime/io/torch_file.hpp"

#include <vector>

#include "common/error.hpp"

namespace ds {
namespace {
// A checkpoint's pickle holds names, shapes and small state; 256 MiB is far beyond any seen.
constexpr uint64_t kMaxPickleBytes = uint64_t{256} << 20;
}  // namespace

TorchFile::TorchFile(const std::string& path) : TorchFile(open_file_reader(path)) {}

// Every storage the pickle names must be there in full before any tensor is sized from its shape: a small
// file claiming a huge tensor is refused here, not after a buffer of that size is allocated.
TorchFile::TorchFile(std::unique_ptr<ByteReader> bytes)
    : zip_(std::move(bytes)), pickle_(zip_.read_pickle(kMaxPickleBytes), zip_.path()) {
  for (const PyValue* s : pickle_.storages()) storage_member(*s);
}

const ZipMember& TorchFile::storage_member(const PyValue& s) const {
  const uint64_t width = static_cast<uint64_t>(st_dtype_bytes(s.dtype));
  const ZipMember* m = zip_.find(zip_.record() + "data/" + s.storage_key);
  if (!m) throw UserError("'" + path() + "' lacks the member data/" + s.storage_key + " that its pickle refers to", "the file is damaged");
  if (static_cast<uint64_t>(s.storage_numel) > m->size / width)
    throw UserError("'" + path() + "': member data/" + s.storage_key + " holds " + std::to_string(m->size) + " bytes, less than its " +
                        std::to_string(s.storage_numel) + " elements of " + st_dtype_name(s.dtype),
                    "the file is damaged");
  return *m;
}

void TorchFile::read_f32(const PyValue& t, int64_t from, int64_t n, float* out) const {
  DS_CHECK(t.is(PyKind::tensor) && from >= 0 && n >= 0 && from + n <= t.numel(), "TorchFile::read_f32: a range outside the tensor");
  if (n == 0) return;
  const PyValue& s = *t.storage;
  if (!t.contiguous())
    throw UserError("'" + path() + "': a tensor of storage '" + s.storage_key + "' is a strided view, which ds does not read", "");
  const int width = st_dtype_bytes(s.dtype);
  if (s.dtype != StDtype::F32 && s.dtype != StDtype::BF16 && s.dtype != StDtype::F16 && s.dtype != StDtype::F64)
    throw UserError("'" + path() + "': storage '" + s.storage_key + "' holds " + st_dtype_name(s.dtype) + ", not floating point", "");
  const ZipMember* m = &storage_member(s);
  const uint64_t at = static_cast<uint64_t>(t.offset + from) * static_cast<uint64_t>(width);
  const uint64_t bytes = static_cast<uint64_t>(n) * static_cast<uint64_t>(width);
  if (s.dtype == StDtype::F32) {
    zip_.read(*m, at, out, bytes);
    return;
  }
  std::vector<uint8_t> staged(bytes);
  zip_.read(*m, at, staged.data(), bytes);
  convert_to_f32(s.dtype, staged.data(), n, out);
}

}  // namespace ds
