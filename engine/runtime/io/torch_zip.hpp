// ds — the zip container torch.save writes (a .pt / .bin file): one folder "<record>/" holding data.pkl
// (the pickle), data/<key> (one member per storage, raw little-endian elements) and version. torch writes
// every member STORED (uncompressed) and 64-byte aligned, with ZIP64 records; ds reads exactly that and
// refuses compressed or encrypted members by name. Everything the file claims (the end record, the
// central directory, each member's local header and span) is checked against the file's size before it
// is used: a bad file is a UserError naming it, never a read out of bounds (fuzz/fuzz_torch_pickle.cpp).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace ds {

// Bytes read by offset: a file (pread, so a file cut short while read is an error, not SIGBUS) or memory.
class ByteReader {
 public:
  virtual ~ByteReader() = default;
  virtual uint64_t size() const = 0;
  // Exactly n bytes at `offset` into `out`; UserError naming the source when they are not there.
  virtual void read(uint64_t offset, void* out, uint64_t n) const = 0;
  virtual const std::string& name() const = 0;

 protected:
  // UserError naming the source when [offset, offset + n) is not inside it.
  void check_span(uint64_t offset, uint64_t n, const std::string& hint) const;
};
std::unique_ptr<ByteReader> open_file_reader(const std::string& path);
std::unique_ptr<ByteReader> memory_reader(const uint8_t* data, uint64_t size, const std::string& name);

struct ZipMember {
  std::string name;
  uint64_t offset = 0, size = 0;  // where its bytes start in the file, and how many
};

class TorchZip {
 public:
  explicit TorchZip(std::unique_ptr<ByteReader> bytes);
  const std::string& path() const { return bytes_->name(); }
  // The folder every member sits in ("archive/" or the saved file's stem), from data.pkl's place.
  const std::string& record() const { return record_; }
  const ZipMember* find(const std::string& name) const;  // the full member name
  const std::vector<ZipMember>& members() const { return members_; }
  // data.pkl's bytes (at most `limit`: UserError beyond it).
  std::string read_pickle(uint64_t limit) const;
  // `n` bytes at `offset` within a member; UserError when the span leaves the member.
  void read(const ZipMember& m, uint64_t offset, void* out, uint64_t n) const;

 private:
  std::unique_ptr<ByteReader> bytes_;
  std::vector<ZipMember> members_;
  std::map<std::string, size_t> index_;
  std::string record_;
};

}  // namespace ds
