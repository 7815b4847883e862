#include "engine/runtime/io/nvme_swap.hpp"

#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <deque>
#include <unordered_map>

#include "common/error.hpp"
#include "common/format.hpp"

namespace ds {

namespace fs = std::filesystem;

namespace {

constexpr const char* kSwapPrefix = "ds-swap-";
constexpr const char* kStateNames[] = {"master", "exp_avg", "exp_avg_sq"};

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0) return "localhost";
  return name;
}

// Fields 3 (state) and 22 (start time, in clock ticks since boot) of /proc/<pid>/stat: with the pid, the
// start time names one process even after pids wrap around. Empty when there is no such process.
struct ProcessStat {
  char state = 0;
  std::string start;
};
ProcessStat process_stat(int64_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return {};
  const size_t close = line.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return {};
  std::istringstream rest(line.substr(close + 2));
  ProcessStat st;
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i)
    if (i == 3) st.state = field.empty() ? 0 : field[0];
  st.start = field;
  return st;
}

// The process that wrote an owner file still runs: same pid, same start, not a zombie (killed runs whose
// parent has not reaped them, as under a container's init, are zombies).
bool still_running(int64_t pid, const std::string& start) {
  const ProcessStat st = process_stat(pid);
  return !st.start.empty() && st.start == start && st.state != 'Z' && st.state != 'X';
}

uint64_t allocated_bytes(const fs::path& dir) {
  uint64_t total = 0;
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec)) {
    struct stat st {};
    if (::lstat(e.path().c_str(), &st) == 0 && S_ISREG(st.st_mode)) total += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return total;
}

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

}  // namespace

std::vector<StaleSwap> stale_swap_directories(const std::string& nvme_path) {
  std::vector<StaleSwap> out;
  std::error_code ec;
  const std::string host = host_name();
  for (const auto& e : fs::directory_iterator(nvme_path, ec)) {
    if (e.path().filename().string().rfind(kSwapPrefix, 0) != 0) continue;
    std::ifstream owner(e.path() / "owner");
    std::string their_host, start;
    int64_t pid = 0;
    if (!(owner >> their_host >> pid >> start) || their_host != host) continue;  // another machine's: not ours to judge
    if (still_running(pid, start)) continue;
    out.push_back({e.path().string(), pid, allocated_bytes(e.path())});
  }
  return out;
}

// ---------------------------------------------------------------------------------------------

struct SwapIo::Impl {
  io_uring ring{};
  bool ring_ok = false;
  int queue_depth = 8;
  int64_t block_size = 1 << 20;
  bool single_submit = false;
  std::vector<int> fds;
  std::vector<std::string> paths;
  struct Request {
    Ticket ticket = 0;
    int file = 0;
    int64_t offset = 0;
    uint32_t bytes = 0;
    bool is_write = false;
  };
  std::unordered_map<uint64_t, Request> requests;
  struct Queued {
    Request r;
    char* buffer = nullptr;
  };
  std::deque<Queued> queued;  // accepted, waiting for room in the ring (queue_depth in flight)
  std::unordered_map<Ticket, int> remaining;
  std::unordered_map<Ticket, std::string> failed;
  int in_flight = 0;
  uint64_t next_request = 1;
  Ticket next_ticket = 1;

  void complete(const Request& r, int res) {
    if (res < 0 || static_cast<uint32_t>(res) != r.bytes) {
      auto& why = failed[r.ticket];
      if (why.empty())
        why = std::string(r.is_write ? "writing " : "reading ") + std::to_string(r.bytes) + " bytes at offset " +
              std::to_string(r.offset) + (r.is_write ? " to " : " from ") + paths[static_cast<size_t>(r.file)] + " failed: " +
              (res < 0 ? errno_text(-res) : "only " + std::to_string(res) + " bytes transferred (disk full?)");
    }
    --remaining[r.ticket];
  }
};

SwapIo::SwapIo(const AioConfig& aio) : impl_(std::make_unique<Impl>()) {
  impl_->queue_depth = static_cast<int>(std::clamp<int64_t>(aio.queue_depth, 1, 4096));
  impl_->block_size = std::max<int64_t>(kSwapAlignBytes, aio.block_size / kSwapAlignBytes * kSwapAlignBytes);
  impl_->single_submit = aio.single_submit;
  // Where io_uring is not allowed (some container seccomp profiles), requests run synchronously instead.
  impl_->ring_ok = io_uring_queue_init(static_cast<unsigned>(impl_->queue_depth), &impl_->ring, 0) == 0;
}

SwapIo::~SwapIo() {
  try {
    wait_all();
  } catch (...) {
  }
  if (impl_->ring_ok) io_uring_queue_exit(&impl_->ring);
  for (int fd : impl_->fds) ::close(fd);
}

int SwapIo::create(const std::string& path, int64_t bytes) {
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0 && errno == EINVAL) {  // tmpfs and some network filesystems: no O_DIRECT
    direct_ = false;
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  }
  if (fd < 0) throw UserError("cannot create the NVMe swap file " + path + ": " + errno_text(errno), "check nvme_path");
  if (bytes > 0) {
    const int rc = ::posix_fallocate(fd, 0, bytes);
    if (rc == ENOSPC || rc == EDQUOT) {
      ::close(fd);
      ::unlink(path.c_str());
      throw UserError("no room for the NVMe swap file " + path + ": it needs " + format_bytes(static_cast<double>(bytes)),
                      "free space there, or point nvme_path at a larger drive (`ds plan` shows the swap bytes)");
    }
    if (rc != 0) {
      ::close(fd);
      throw UserError("cannot reserve " + format_bytes(static_cast<double>(bytes)) + " for " + path + ": " + errno_text(rc));
    }
  }
  impl_->fds.push_back(fd);
  impl_->paths.push_back(path);
  return static_cast<int>(impl_->fds.size()) - 1;
}

SwapIo::Ticket SwapIo::read(int file, void* buffer, int64_t bytes, int64_t offset) {
  bytes_read_ += static_cast<double>(bytes);
  return submit(false, file, buffer, bytes, offset);
}

SwapIo::Ticket SwapIo::write(int file, const void* buffer, int64_t bytes, int64_t offset) {
  bytes_written_ += static_cast<double>(bytes);
  return submit(true, file, const_cast<void*>(buffer), bytes, offset);
}

SwapIo::Ticket SwapIo::submit(bool is_write, int file, void* buffer, int64_t bytes, int64_t offset) {
  Impl& m = *impl_;
  DS_CHECK(bytes % kSwapAlignBytes == 0 && offset % kSwapAlignBytes == 0 &&
               reinterpret_cast<uintptr_t>(buffer) % kSwapAlignBytes == 0,
           "unaligned swap transfer");
  const Ticket t = m.next_ticket++;
  m.remaining[t] = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t done = 0; done < bytes; done += m.block_size) {
    const uint32_t n = static_cast<uint32_t>(std::min(m.block_size, bytes - done));
    const Impl::Request r{t, file, offset + done, n, is_write};
    ++m.remaining[t];
    char* at = static_cast<char*>(buffer) + done;
    if (!m.ring_ok) {  // synchronous: the transfer is done when submit returns
      const int fd = m.fds[static_cast<size_t>(file)];
      const ssize_t res = is_write ? ::pwrite(fd, at, n, r.offset) : ::pread(fd, at, n, r.offset);
      m.complete(r, res < 0 ? -errno : static_cast<int>(res));
      continue;
    }
    m.queued.push_back({r, at});
  }
  // As many requests into the ring as it has room for; the rest follow as earlier ones complete, so
  // submitting never blocks on the disk.
  pump();
  wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return t;
}

void SwapIo::pump() {
  Impl& m = *impl_;
  if (!m.ring_ok) return;
  bool added = false;
  while (m.in_flight < m.queue_depth && !m.queued.empty()) {
    io_uring_sqe* sqe = io_uring_get_sqe(&m.ring);
    if (!sqe) {  // the submission queue is full of requests not yet handed to the kernel
      io_uring_submit(&m.ring);
      sqe = io_uring_get_sqe(&m.ring);
    }
    DS_CHECK(sqe != nullptr, "io_uring has no free entry");
    const Impl::Queued q = m.queued.front();
    m.queued.pop_front();
    const int fd = m.fds[static_cast<size_t>(q.r.file)];
    if (q.r.is_write)
      io_uring_prep_write(sqe, fd, q.buffer, q.r.bytes, static_cast<uint64_t>(q.r.offset));
    else
      io_uring_prep_read(sqe, fd, q.buffer, q.r.bytes, static_cast<uint64_t>(q.r.offset));
    const uint64_t id = m.next_request++;
    io_uring_sqe_set_data64(sqe, id);
    m.requests[id] = q.r;
    ++m.in_flight;
    added = true;
    if (m.single_submit) io_uring_submit(&m.ring);
  }
  if (added && !m.single_submit) io_uring_submit(&m.ring);
}

void SwapIo::reap_one() {
  Impl& m = *impl_;
  io_uring_cqe* cqe = nullptr;
  int rc;
  do {
    rc = io_uring_wait_cqe(&m.ring, &cqe);
  } while (rc == -EINTR);
  if (rc < 0) throw std::runtime_error("waiting on NVMe swap I/O failed: " + errno_text(-rc));
  const uint64_t id = io_uring_cqe_get_data64(cqe);
  const int res = cqe->res;
  io_uring_cqe_seen(&m.ring, cqe);
  const auto it = m.requests.find(id);
  DS_CHECK(it != m.requests.end(), "unknown io_uring completion ", id);
  const Impl::Request r = it->second;
  m.requests.erase(it);
  --m.in_flight;
  m.complete(r, res);
  pump();
}

void SwapIo::wait(Ticket t) {
  if (t == 0) return;
  Impl& m = *impl_;
  const auto start = std::chrono::steady_clock::now();
  while (m.remaining[t] > 0) reap_one();
  wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  m.remaining.erase(t);
  const auto f = m.failed.find(t);
  if (f != m.failed.end()) {
    const std::string why = f->second;
    m.failed.erase(f);
    throw std::runtime_error("NVMe swap: " + why);
  }
}

void SwapIo::wait_all() {
  std::vector<Ticket> open;
  for (const auto& [t, n] : impl_->remaining) open.push_back(t);
  for (Ticket t : open) wait(t);
}

// ---------------------------------------------------------------------------------------------

SwapDirectory::SwapDirectory(const std::string& root, const std::string& key, const std::string& name, double need,
                             const std::string& what) {
  // Everything that can be wrong with the folder, before a byte is written.
  std::error_code ec;
  const fs::file_status st = fs::status(root, ec);
  if (!fs::exists(st))
    throw UserError(key + " '" + root + "' does not exist", "create it (mkdir -p " + root + ") or point nvme_path at a folder on a fast local drive");
  if (!fs::is_directory(st)) throw UserError(key + " '" + root + "' is not a directory", "point nvme_path at a folder");
  if (::access(root.c_str(), W_OK | X_OK) != 0)
    throw UserError(key + " '" + root + "' is not writable by this user: " + errno_text(errno), "choose a folder you can write to");
  struct statvfs vfs {};
  if (::statvfs(root.c_str(), &vfs) == 0) {
    const double free_bytes = static_cast<double>(vfs.f_bavail) * static_cast<double>(vfs.f_frsize);
    if (free_bytes < need) {
      std::string stale;
      for (const StaleSwap& s : stale_swap_directories(root))
        stale += "; " + s.path + " (" + format_bytes(static_cast<double>(s.bytes)) + ") is left from a dead run";
      throw UserError(key + " '" + root + "' has " + format_bytes(free_bytes) + " free; " + what + " need " + format_bytes(need) +
                          " there" + stale,
                      "free space there, or point nvme_path at a larger drive");
    }
  }
  path_ = (fs::path(root) / (kSwapPrefix + host_name() + "-" + std::to_string(::getpid()) + "-" + name)).string();
  if (!fs::create_directory(path_, ec) || ec)
    throw UserError("cannot create the swap directory " + path_ + ": " + (ec ? ec.message() : std::string("it already exists")),
                    "check " + key);
  std::ofstream owner(fs::path(path_) / "owner");
  owner << host_name() << ' ' << ::getpid() << ' ' << process_stat(::getpid()).start << '\n';
  owner.close();
  if (!owner) {
    fs::remove_all(path_, ec);
    throw UserError("cannot write " + path_ + "/owner", "check " + key);
  }
}

SwapDirectory::~SwapDirectory() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

namespace {

// `count` buffers of `bytes` each, 4 KiB aligned and zeroed.
std::vector<char*> aligned_buffers(int64_t count, int64_t bytes) {
  std::vector<char*> out;
  try {
    for (int64_t i = 0; i < count; ++i) {
      void* p = std::aligned_alloc(kSwapAlignBytes, static_cast<size_t>(bytes));
      if (!p) throw std::bad_alloc();
      std::memset(p, 0, static_cast<size_t>(bytes));
      out.push_back(static_cast<char*>(p));
    }
  } catch (...) {
    for (char* p : out) std::free(p);
    throw;
  }
  return out;
}

}  // namespace

OptimizerSwapper::OptimizerSwapper(const Plan& plan, int rank, int states)
    : io_(plan.zero.aio),
      groups_(plan.execution.sub_groups),
      states_(states),
      dir_(plan.zero.offload_optimizer.nvme_path, "zero_optimization.offload_optimizer.nvme_path", "r" + std::to_string(rank),
           static_cast<double>(swap_file_bytes(plan.execution.sub_groups)) * states, "this rank's optimizer states") {
  const ZeroExecution& z = plan.execution;
  DS_CHECK(states >= 1 && states <= 3 && !groups_.empty(), "swapper for ", states, " states and ", groups_.size(), " sub-groups");
  sets_ = std::max(1, z.swap_sets);
  pipeline_read_ = plan.zero.offload_optimizer.pipeline_read && sets_ > 1;
  pipeline_write_ = plan.zero.offload_optimizer.pipeline_write && sets_ > 1;
  file_bytes_ = swap_file_bytes(groups_);
  for (int k = 0; k < states_; ++k)
    files_.push_back(io_.create((fs::path(dir_.path()) / (std::string(kStateNames[k]) + ".swap")).string(), file_bytes_));
  const int64_t per_block = kSwapAlignBytes / 4;
  buffer_floats_ = (z.sub_group_numel + per_block - 1) / per_block * per_block;
  for (char* p : aligned_buffers(sets_ * states_, buffer_floats_ * 4)) buffers_.push_back(reinterpret_cast<float*>(p));
}

OptimizerSwapper::~OptimizerSwapper() {
  try {
    io_.wait_all();
  } catch (...) {
  }
  for (float* p : buffers_) std::free(p);
}

std::vector<SwapIo::Ticket> OptimizerSwapper::transfer(size_t group, int set, bool is_write) {
  const SubGroup& g = groups_[group];
  std::vector<SwapIo::Ticket> t;
  for (int k = 0; k < states_; ++k)
    t.push_back(is_write ? io_.write(files_[static_cast<size_t>(k)], buffer(set, k), g.file_bytes(), g.file_offset)
                         : io_.read(files_[static_cast<size_t>(k)], buffer(set, k), g.file_bytes(), g.file_offset));
  return t;
}

void OptimizerSwapper::for_each(const Visit& fn, bool read, bool write) {
  const size_t n = groups_.size();
  const auto set_of = [&](size_t i) { return static_cast<int>(i % static_cast<size_t>(sets_)); };
  std::vector<std::vector<SwapIo::Ticket>> reading(static_cast<size_t>(sets_)), writing(static_cast<size_t>(sets_));
  const auto settle = [&](std::vector<SwapIo::Ticket>& tickets) {
    for (SwapIo::Ticket t : tickets) io_.wait(t);
    tickets.clear();
  };
  // A set is refilled only once its previous sub-group's write-back has finished.
  const auto start_read = [&](size_t i) {
    const int s = set_of(i);
    settle(writing[static_cast<size_t>(s)]);
    reading[static_cast<size_t>(s)] = transfer(i, s, false);
  };
  const bool ahead = read && pipeline_read_;
  if (ahead) start_read(0);
  std::vector<float*> states(static_cast<size_t>(states_));
  for (size_t i = 0; i < n; ++i) {
    const int s = set_of(i);
    if (read && !ahead) start_read(i);
    if (!read) settle(writing[static_cast<size_t>(s)]);
    settle(reading[static_cast<size_t>(s)]);
    if (ahead && i + 1 < n) start_read(i + 1);  // another set (sets_ >= 2), read while this one is stepped
    for (int k = 0; k < states_; ++k) states[static_cast<size_t>(k)] = buffer(s, k);
    fn(i, states.data());
    if (write) {
      writing[static_cast<size_t>(s)] = transfer(i, s, true);
      if (!pipeline_write_) settle(writing[static_cast<size_t>(s)]);
    }
  }
  for (auto& w : writing) settle(w);
}

void OptimizerSwapper::read_range(int64_t at, int64_t n, float* const* out) {
  const int64_t end = at + n;
  for (const SubGroup& g : groups_) {
    const int64_t lo = std::max(at, g.begin), hi = std::min(end, g.end);
    if (lo >= hi) continue;
    // The whole blocks around [lo, hi) of this sub-group.
    const int64_t first = (lo - g.begin) * 4 / kSwapAlignBytes * kSwapAlignBytes;
    const int64_t last = std::min(g.file_bytes(), ((hi - g.begin) * 4 + kSwapAlignBytes - 1) / kSwapAlignBytes * kSwapAlignBytes);
    std::vector<SwapIo::Ticket> t;
    for (int k = 0; k < states_; ++k)
      if (out[k]) t.push_back(io_.read(files_[static_cast<size_t>(k)], buffer(0, k), last - first, g.file_offset + first));
    for (SwapIo::Ticket x : t) io_.wait(x);
    for (int k = 0; k < states_; ++k)
      if (out[k])
        std::memcpy(out[k] + (lo - at), reinterpret_cast<const char*>(buffer(0, k)) + ((lo - g.begin) * 4 - first),
                    static_cast<size_t>(hi - lo) * 4);
  }
}

// ---------------------------------------------------------------------------------------------

ParamSwapper::ParamSwapper(const Plan& plan, int rank)
    : io_(plan.zero.aio),
      dir_(plan.zero.offload_param.nvme_path, "zero_optimization.offload_param.nvme_path", "r" + std::to_string(rank) + "-params",
           static_cast<double>(swap_aligned(plan.execution.local_numel * dtype_bytes(plan.precision.param_dtype))),
           "this rank's parameter partition") {
  const ZeroBuffer* pool = plan.execution.find(BufferRole::param_swap, Place::host);
  DS_CHECK(pool != nullptr, "parameters on NVMe without swap buffers in the plan");
  elem_bytes_ = dtype_bytes(plan.precision.param_dtype);
  file_bytes_ = swap_aligned(plan.execution.local_numel * elem_bytes_);
  chunk_bytes_ = pool->elements * elem_bytes_;
  DS_CHECK(chunk_bytes_ % kSwapAlignBytes == 0, "parameter swap buffers of ", chunk_bytes_, " bytes");
  file_ = io_.create((fs::path(dir_.path()) / "params.swap").string(), file_bytes_);
  buffers_ = aligned_buffers(pool->copies, chunk_bytes_);
  tickets_.assign(buffers_.size(), 0);
}

ParamSwapper::~ParamSwapper() {
  try {
    io_.wait_all();
  } catch (...) {
  }
  for (char* p : buffers_) std::free(p);
}

void ParamSwapper::issue(size_t i) {
  const size_t b = i % buffers_.size();
  const SwapTransfer& t = transfers_[i];
  tickets_[b] = io_.read(file_, buffers_[b], t.bytes, t.offset);
}

void ParamSwapper::start_read(std::vector<Piece> pieces) {
  DS_CHECK(!reading() && chunk_ < 0, "a parameter read while another read or a write is under way");
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.at < b.at; });
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const Piece& p : pieces)
    if (p.n > 0) ranges.push_back({p.at * elem_bytes_, (p.at + p.n) * elem_bytes_});
  pieces_ = std::move(pieces);
  transfers_ = swap_transfers(ranges, chunk_bytes_);
  next_ = done_ = 0;
  while (next_ < transfers_.size() && next_ < buffers_.size()) issue(next_++);
}

void ParamSwapper::finish_read(const Deliver& deliver) {
  size_t first = 0;  // the first piece that may overlap the next transfer (both ordered by offset)
  for (; done_ < transfers_.size(); ++done_) {
    const size_t b = done_ % buffers_.size();
    io_.wait(tickets_[b]);
    tickets_[b] = 0;
    const SwapTransfer& t = transfers_[done_];
    while (first < pieces_.size() && (pieces_[first].at + pieces_[first].n) * elem_bytes_ <= t.offset) ++first;
    for (size_t k = first; k < pieces_.size() && pieces_[k].at * elem_bytes_ < t.offset + t.bytes; ++k) {
      const Piece& p = pieces_[k];
      const int64_t lo = std::max(p.at * elem_bytes_, t.offset), hi = std::min((p.at + p.n) * elem_bytes_, t.offset + t.bytes);
      if (lo < hi)
        deliver(static_cast<char*>(p.dest) + (lo - p.at * elem_bytes_), buffers_[b] + (lo - t.offset), hi - lo);
    }
    if (next_ < transfers_.size()) issue(next_++);  // into the buffer just emptied
  }
  pieces_.clear();
  transfers_.clear();
  next_ = done_ = 0;
}

void ParamSwapper::begin_write() {
  DS_CHECK(!reading() && chunk_ < 0, "a parameter write while a read or another write is under way");
  chunk_ = 0;
  filled_ = 0;
  // Every buffer is free: no read is in flight, and the last write ended with all of them settled.
}

void ParamSwapper::flush_chunk() {
  const size_t b = static_cast<size_t>(chunk_) % buffers_.size();
  const int64_t offset = chunk_ * chunk_bytes_, bytes = std::min(chunk_bytes_, file_bytes_ - offset);
  std::memset(buffers_[b] + filled_, 0, static_cast<size_t>(bytes - std::min(filled_, bytes)));
  tickets_[b] = io_.write(file_, buffers_[b], bytes, offset);
  ++chunk_;
  filled_ = 0;
  // The next chunk's buffer: free once its previous write is done.
  const size_t next = static_cast<size_t>(chunk_) % buffers_.size();
  io_.wait(tickets_[next]);
  tickets_[next] = 0;
}

std::pair<void*, int64_t> ParamSwapper::span(int64_t at, int64_t n) {
  DS_CHECK(chunk_ >= 0 && at >= 0 && n > 0 && (at + n) * elem_bytes_ <= file_bytes_, "parameter write span [", at, ", ", at + n, ")");
  const int64_t byte = at * elem_bytes_;
  while (byte >= (chunk_ + 1) * chunk_bytes_) flush_chunk();
  const int64_t in_chunk = byte - chunk_ * chunk_bytes_;
  DS_CHECK(in_chunk >= filled_, "parameter write spans out of order");
  char* buf = buffers_[static_cast<size_t>(chunk_) % buffers_.size()];
  std::memset(buf + filled_, 0, static_cast<size_t>(in_chunk - filled_));  // a gap: padding
  const int64_t k = std::min(n, (chunk_bytes_ - in_chunk) / elem_bytes_);
  filled_ = in_chunk + k * elem_bytes_;
  return {buf + in_chunk, k};
}

void ParamSwapper::end_write() {
  DS_CHECK(chunk_ >= 0, "end_write without begin_write");
  while (chunk_ * chunk_bytes_ < file_bytes_) flush_chunk();
  for (SwapIo::Ticket& t : tickets_) {
    io_.wait(t);
    t = 0;
  }
  chunk_ = -1;
}

// ---------------------------------------------------------------------------------------------

void swap_in_weights(OptimizerSwapper& swapper, const std::vector<OwnedSegment>& owned, const SegmentValues& values) {
  swapper.for_each(
      [&](size_t i, float* const* st) {
        const SubGroup& g = swapper.sub_groups()[i];
        for (int k = 0; k < swapper.states(); ++k) std::memset(st[k], 0, static_cast<size_t>(g.numel()) * 4);
        // Each owned segment's part within the sub-group, taken from the segment's values at its offset.
        for (const OwnedSegment& s : owned) {
          const int64_t lo = std::max(s.local, g.begin), hi = std::min(s.local + s.numel, g.end);
          if (lo < hi) std::memcpy(st[0] + (lo - g.begin), values(s) + (lo - s.local), static_cast<size_t>(hi - lo) * 4);
        }
      },
      /*read=*/false, /*write=*/true);
}

CheckpointScalars swap_in_checkpoint(OptimizerSwapper& swapper, const std::string& checkpoint_dir, const CheckpointBuffers& part) {
  CheckpointScalars scalars;
  bool first = true;
  swapper.for_each(
      [&](size_t i, float* const* st) {
        const SubGroup& g = swapper.sub_groups()[i];
        for (int k = 0; k < swapper.states(); ++k) std::memset(st[k], 0, static_cast<size_t>(g.numel()) * 4);
        CheckpointBuffers piece{st[0], swapper.states() > 1 ? st[1] : nullptr,
                                swapper.states() > 2 ? st[2] : nullptr, g.numel(), segments_within(part.segments, g.begin, g.end),
                                part.model_numel};
        piece.verify = first;  // every data set's checksum once, not once per sub-group
        const CheckpointScalars sc = load_checkpoint(checkpoint_dir, piece);
        if (first) scalars = sc;
        first = false;
      },
      /*read=*/false, /*write=*/true);
  return scalars;
}

ShardPieces swapped_pieces(OptimizerSwapper& swapper, int moments) {
  ShardPieces p;
  p.moments = moments;
  p.read = [&swapper](int64_t at, int64_t n, float* master, float* exp_avg, float* exp_avg_sq) {
    float* out[3] = {master, exp_avg, exp_avg_sq};
    swapper.read_range(at, n, out);
  };
  return p;
}

}  // namespace ds
