#include "engine/runtime/io/torch_zip.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/error.hpp"

namespace ds {
void ByteReader::check_span(uint64_t offset, uint64_t n, const std::string& hint) const {
  if (offset > size() || n > size() - offset)
    throw UserError("'" + name() + "' is cut short: " + std::to_string(n) + " bytes at offset " + std::to_string(offset) +
                        " lie beyond its " + std::to_string(size()) + " bytes",
                    hint);
}

namespace {

class FileReader : public ByteReader {
 public:
  explicit FileReader(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw UserError("cannot open '" + path + "': " + std::strerror(errno), "");
    struct stat st {};
    if (fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd_);
      throw UserError("'" + path + "' is not a regular file", "");
    }
    size_ = static_cast<uint64_t>(st.st_size);
  }
  ~FileReader() override { ::close(fd_); }
  uint64_t size() const override { return size_; }
  const std::string& name() const override { return path_; }
  void read(uint64_t offset, void* out, uint64_t n) const override {
    check_span(offset, n, "the file is damaged or still being written; copy it again");
    auto* into = static_cast<uint8_t*>(out);
    for (uint64_t done = 0; done < n;) {
      const ssize_t got = ::pread(fd_, into + done, static_cast<size_t>(n - done), static_cast<off_t>(offset + done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0)
        throw UserError("reading '" + path_ + "' failed at offset " + std::to_string(offset + done) + ": " +
                            (got < 0 ? std::strerror(errno) : "the file shrank while it was read"),
                        "another program changed the file; read it again once it is complete");
      done += static_cast<uint64_t>(got);
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

class MemoryReader : public ByteReader {
 public:
  MemoryReader(const uint8_t* data, uint64_t size, std::string name) : data_(data), size_(size), name_(std::move(name)) {}
  uint64_t size() const override { return size_; }
  const std::string& name() const override { return name_; }
  void read(uint64_t offset, void* out, uint64_t n) const override {
    check_span(offset, n, "");
    if (n) std::memcpy(out, data_ + offset, static_cast<size_t>(n));
  }

 private:
  const uint8_t* data_;
  uint64_t size_;
  std::string name_;
};

uint64_t le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

constexpr uint32_t kEndSig = 0x06054b50, kZip64EndSig = 0x06064b50, kZip64LocatorSig = 0x07064b50, kCentralSig = 0x02014b50,
                   kLocalSig = 0x04034b50;
constexpr uint64_t kMaxMembers = 1u << 20;  // a storage per member: far beyond any checkpoint

}  // namespace

std::unique_ptr<ByteReader> open_file_reader(const std::string& path) { return std::make_unique<FileReader>(path); }
std::unique_ptr<ByteReader> memory_reader(const uint8_t* data, uint64_t size, const std::string& name) {
  return std::make_unique<MemoryReader>(data, size, name);
}

TorchZip::TorchZip(std::unique_ptr<ByteReader> bytes) : bytes_(std::move(bytes)) {
  const std::string& path = bytes_->name();
  const uint64_t size = bytes_->size();
  auto bad = [&](const std::string& what) {
    return UserError("'" + path + "' is not a readable torch.save file: " + what,
                     "ds reads the zip files torch.save writes (PyTorch 1.6 and later); re-save older files with torch.save");
  };
  if (size < 22) throw bad("too short for a zip file (" + std::to_string(size) + " bytes)");
  // The end record: the last 22 bytes, or earlier when the archive has a comment (at most 65535 bytes).
  const uint64_t tail_len = std::min<uint64_t>(size, 22 + 65535);
  std::vector<uint8_t> tail(tail_len);
  bytes_->read(size - tail_len, tail.data(), tail_len);
  int64_t end_at = -1;
  for (int64_t i = static_cast<int64_t>(tail_len) - 22; i >= 0; --i)
    if (le(&tail[i], 4) == kEndSig && static_cast<uint64_t>(i) + 22 + le(&tail[i + 20], 2) == tail_len) {
      end_at = i;
      break;
    }
  if (end_at < 0) throw bad("no zip end record (a file cut short by a copy or a full disk, or a pickle saved with _use_new_zipfile_serialization=False)");
  const uint8_t* e = &tail[end_at];
  uint64_t count = le(e + 10, 2), cd_size = le(e + 12, 4), cd_offset = le(e + 16, 4);
  const uint64_t end_offset = size - tail_len + static_cast<uint64_t>(end_at);
  if (count == 0xFFFF || cd_size == 0xFFFFFFFFu || cd_offset == 0xFFFFFFFFu) {  // ZIP64: the locator just before
    if (end_offset < 20) throw bad("a ZIP64 archive without its locator");
    uint8_t loc[20];
    bytes_->read(end_offset - 20, loc, 20);
    if (le(loc, 4) != kZip64LocatorSig) throw bad("a ZIP64 archive without its locator");
    const uint64_t z_at = le(loc + 8, 8);
    uint8_t z[56];
    if (z_at > size || size - z_at < 56) throw bad("the ZIP64 end record lies outside the file");
    bytes_->read(z_at, z, 56);
    if (le(z, 4) != kZip64EndSig) throw bad("the ZIP64 end record is missing");
    count = le(z + 32, 8);
    cd_size = le(z + 40, 8);
    cd_offset = le(z + 48, 8);
  }
  if (count > kMaxMembers) throw bad(std::to_string(count) + " members (at most " + std::to_string(kMaxMembers) + ")");
  if (cd_offset > size || cd_size > size - cd_offset) throw bad("the central directory lies outside the file");
  if (cd_size < count * 46) throw bad("the central directory is too small for its " + std::to_string(count) + " members");
  std::vector<uint8_t> cd(cd_size);
  bytes_->read(cd_offset, cd.data(), cd_size);
  uint64_t at = 0;
  for (uint64_t i = 0; i < count; ++i) {
    if (cd_size - at < 46 || le(&cd[at], 4) != kCentralSig) throw bad("central directory entry " + std::to_string(i) + " is damaged");
    const uint8_t* c = &cd[at];
    const uint64_t flags = le(c + 8, 2), method = le(c + 10, 2), name_len = le(c + 28, 2), extra_len = le(c + 30, 2),
                   comment_len = le(c + 32, 2);
    uint64_t csize = le(c + 20, 4), usize = le(c + 24, 4), local = le(c + 42, 4);
    if (cd_size - at - 46 < name_len + extra_len + comment_len) throw bad("central directory entry " + std::to_string(i) + " is damaged");
    ZipMember m;
    m.name.assign(reinterpret_cast<const char*>(c + 46), name_len);
    // ZIP64's extra field carries the values the 32-bit fields could not (those set to 0xFFFFFFFF), in order.
    for (uint64_t x = 0; x + 4 <= extra_len;) {
      const uint8_t* f = c + 46 + name_len + x;
      const uint64_t id = le(f, 2), len = le(f + 2, 2);
      if (x + 4 + len > extra_len) throw bad("member '" + m.name + "' has a damaged extra field");
      if (id == 1) {
        uint64_t k = 0;
        for (uint64_t* v : {&usize, &csize, &local})
          if (*v == 0xFFFFFFFFu) {
            if (k + 8 > len) throw bad("member '" + m.name + "' has a damaged ZIP64 field");
            *v = le(f + 4 + k, 8);
            k += 8;
          }
      }
      x += 4 + len;
    }
    if (flags & 1) throw bad("member '" + m.name + "' is encrypted");
    if (method != 0 || csize != usize)
      throw bad("member '" + m.name + "' is compressed (method " + std::to_string(method) + "); torch.save stores members uncompressed");
    if (local > size || size - local < 30) throw bad("member '" + m.name + "' lies outside the file");
    uint8_t h[30];
    bytes_->read(local, h, 30);
    if (le(h, 4) != kLocalSig) throw bad("member '" + m.name + "' has no local header where the directory says");
    const uint64_t data = local + 30 + le(h + 26, 2) + le(h + 28, 2);
    if (data > size || usize > size - data) throw bad("member '" + m.name + "' (" + std::to_string(usize) + " bytes) runs past the end of the file");
    m.offset = data;
    m.size = usize;
    if (!index_.emplace(m.name, members_.size()).second) throw bad("member '" + m.name + "' appears twice");
    members_.push_back(std::move(m));
    at += 46 + name_len + extra_len + comment_len;
  }
  int pickles = 0;
  for (const ZipMember& m : members_) {
    const std::string tail_name = "data.pkl";
    if (m.name == tail_name || (m.name.size() > tail_name.size() && m.name.compare(m.name.size() - 9, 9, "/data.pkl") == 0)) {
      record_ = m.name.substr(0, m.name.size() - tail_name.size());
      ++pickles;
    }
  }
  if (pickles != 1) throw bad(pickles == 0 ? "no data.pkl member" : "more than one data.pkl member");
}

const ZipMember* TorchZip::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &members_[it->second];
}

std::string TorchZip::read_pickle(uint64_t limit) const {
  const ZipMember* m = find(record_ + "data.pkl");
  if (m->size > limit)
    throw UserError("'" + path() + "': its pickle is " + std::to_string(m->size) + " bytes, more than the " + std::to_string(limit) +
                        " ds reads",
                    "a checkpoint's pickle holds names and shapes, not weights; this file holds something else");
  std::string s(m->size, '\0');
  bytes_->read(m->offset, s.data(), m->size);
  return s;
}

void TorchZip::read(const ZipMember& m, uint64_t offset, void* out, uint64_t n) const {
  if (offset > m.size || n > m.size - offset)
    throw UserError("'" + path() + "': " + std::to_string(n) + " bytes at " + std::to_string(offset) + " lie outside member '" + m.name +
                        "' (" + std::to_string(m.size) + " bytes)",
                    "the file is damaged, or its pickle describes another file's storage");
  bytes_->read(m.offset + offset, out, n);
}

}  // namespace ds
