// ds — NVMe swapping (ZeRO-Infinity). The optimizer states of this rank (fp32 master weights and
// moments) live in one file per state under <nvme_path>/ds-swap-<host>-<pid>-r<rank>/, each
// holding the plan's sub-groups one after another from 4 KiB boundaries. A step reads sub-group i into
// host buffers, steps it and writes it back, with the next read and the previous write in flight
// (pipeline_read / pipeline_write) through io_uring, O_DIRECT where the filesystem allows it. At stage 3
// the rank's parameter partition can live there too (ParamSwapper, a folder ending in -params).
// The swap directory is scratch: made at start, removed when the run ends however it ends (short of
// kill -9); a directory left by a dead run is reported at the next start with the command that removes
// it. No LibTorch here: raw buffers.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/plan/plan.hpp"
#include "engine/runtime/io/checkpoint.hpp"

namespace ds {

// A swap directory whose process is gone (same host, pid dead or reused).
struct StaleSwap {
  std::string path;
  int64_t pid = 0;
  uint64_t bytes = 0;
};
std::vector<StaleSwap> stale_swap_directories(const std::string& nvme_path);

// Requests to one set of files through one io_uring. Every transfer is whole 4 KiB blocks from 4 KiB
// aligned buffers, split into requests of aio.block_size bytes, at most aio.queue_depth in flight.
class SwapIo {
 public:
  using Ticket = int64_t;  // a transfer in flight; 0: none
  explicit SwapIo(const AioConfig& aio);
  ~SwapIo();
  SwapIo(const SwapIo&) = delete;
  SwapIo& operator=(const SwapIo&) = delete;

  // Creates `path` with `bytes` reserved (fallocate: a disk that is too small fails here, not mid-run).
  // Returns the file's index. Throws UserError when the space is not there.
  int create(const std::string& path, int64_t bytes);
  bool direct() const { return direct_; }  // O_DIRECT (false: the filesystem refused it; page cache)

  Ticket read(int file, void* buffer, int64_t bytes, int64_t offset);
  Ticket write(int file, const void* buffer, int64_t bytes, int64_t offset);
  // Blocks until the transfer is done. Throws std::runtime_error naming the file, offset and errno when a
  // request failed or came up short (a full or failing disk).
  void wait(Ticket t);
  void wait_all();

  double bytes_read() const { return bytes_read_; }
  double bytes_written() const { return bytes_written_; }
  double wait_seconds() const { return wait_s_; }  // time spent in submitting and waiting: the I/O the caller felt

 private:
  struct Impl;
  Ticket submit(bool is_write, int file, void* buffer, int64_t bytes, int64_t offset);
  void reap_one();
  void pump();
  std::unique_ptr<Impl> impl_;
  bool direct_ = true;
  double bytes_read_ = 0, bytes_written_ = 0, wait_s_ = 0;
};

// A rank's scratch folder under an nvme_path: checked (exists, a directory, writable, `need` bytes free)
// before anything is written, made with an owner file naming this process, removed when destroyed.
// `key`: the config key that named the path; `what`: what the files hold, for messages.
class SwapDirectory {
 public:
  SwapDirectory(const std::string& root, const std::string& key, const std::string& name, double need, const std::string& what);
  ~SwapDirectory();
  SwapDirectory(const SwapDirectory&) = delete;
  SwapDirectory& operator=(const SwapDirectory&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// One rank's optimizer states on NVMe, swapped sub-group by sub-group through host buffers.
class OptimizerSwapper {
 public:
  // `states`: the fp32 buffers per element (master plus the optimizer's moments). Creates the swap
  // directory and files. Throws UserError before anything is written when nvme_path is missing, not a
  // directory, not writable or short of the files' bytes (named, with the numbers).
  OptimizerSwapper(const Plan& plan, int rank, int states);
  ~OptimizerSwapper();  // removes the swap directory

  // Each sub-group in order: read its states into a buffer set (`read`), hand them to `fn`, write them
  // back (`write`), with reads ahead and writes behind as the plan's swap sets allow. `fn(g, states)`
  // gets the plan's sub-group index and one pointer per state, each holding the sub-group's elements.
  using Visit = std::function<void(size_t group, float* const* states)>;
  void for_each(const Visit& fn, bool read = true, bool write = true);

  // Elements [at, at + n) of every state (checkpoint saving); `out` one pointer per state.
  void read_range(int64_t at, int64_t n, float* const* out);

  const std::vector<SubGroup>& sub_groups() const { return groups_; }
  int states() const { return states_; }
  const std::string& directory() const { return dir_.path(); }
  bool direct() const { return io_.direct(); }
  double buffer_bytes() const { return static_cast<double>(buffers_.size()) * static_cast<double>(buffer_floats_) * 4; }
  double file_bytes() const { return static_cast<double>(file_bytes_) * states_; }
  const SwapIo& io() const { return io_; }

 private:
  float* buffer(int set, int state) const { return buffers_[static_cast<size_t>(set * states_ + state)]; }
  std::vector<SwapIo::Ticket> transfer(size_t group, int set, bool is_write);
  SwapIo io_;
  std::vector<SubGroup> groups_;
  int states_ = 0, sets_ = 1;
  bool pipeline_read_ = false, pipeline_write_ = false;
  SwapDirectory dir_;
  std::vector<int> files_;
  int64_t file_bytes_ = 0, buffer_floats_ = 0;
  std::vector<float*> buffers_;  // sets x states, 4 KiB aligned
};

// One rank's parameter partition on NVMe (ZeRO-3 offload_param): one file in the parameters' dtype,
// read piecewise for each gather and rewritten front to back after each optimizer step, both streamed
// through the plan's buffer_count host buffers of buffer_size elements. One read at a time: a gather's
// reads may stay in flight (the next block's, while this one computes) until finish_read.
class ParamSwapper {
 public:
  ParamSwapper(const Plan& plan, int rank);
  ~ParamSwapper();

  // Elements [at, at + n) of the partition, for `dest` (in the parameters' dtype; possibly memory the host
  // cannot address: only `deliver` writes it).
  struct Piece {
    int64_t at = 0, n = 0;
    void* dest = nullptr;
  };
  // Puts the first transfers in flight, as many as there are buffers.
  void start_read(std::vector<Piece> pieces);
  // Moves `bytes` from a host buffer to a piece's destination; the buffer is refilled once it returns.
  using Deliver = std::function<void(void* dest, const char* host, int64_t bytes)>;
  // Waits for them, delivering each piece while the rest stream through the freed buffers.
  void finish_read(const Deliver& deliver);
  bool reading() const { return !pieces_.empty() || next_ < transfers_.size(); }

  // Rewriting the partition, front to back: `span(at, n)` returns where elements [at, at + k) go (k <= n,
  // in the parameters' dtype), `at` never below a previous span's end. Elements no span covers are
  // written as zeros (padding). end_write returns once everything is on disk.
  void begin_write();
  std::pair<void*, int64_t> span(int64_t at, int64_t n);
  void end_write();

  const std::string& directory() const { return dir_.path(); }
  bool direct() const { return io_.direct(); }
  double buffer_bytes() const { return static_cast<double>(buffers_.size()) * static_cast<double>(chunk_bytes_); }
  double file_bytes() const { return static_cast<double>(file_bytes_); }
  const SwapIo& io() const { return io_; }

 private:
  void issue(size_t transfer);
  void flush_chunk();
  SwapIo io_;
  SwapDirectory dir_;
  int file_ = 0;
  int64_t elem_bytes_ = 2, file_bytes_ = 0, chunk_bytes_ = 0;
  std::vector<char*> buffers_;  // buffer_count, 4 KiB aligned, chunk_bytes_ each
  std::vector<SwapIo::Ticket> tickets_;  // per buffer: its transfer in flight
  // Reading: the pieces (by offset), the transfers they need, the next one to issue and to finish.
  std::vector<Piece> pieces_;
  std::vector<SwapTransfer> transfers_;
  size_t next_ = 0, done_ = 0;
  // Writing: the chunk being filled (chunk_bytes_ of the file from chunk_ * chunk_bytes_), its bytes filled so far.
  int64_t chunk_ = -1, filled_ = 0;
};

// The swapped states of a fresh run: the master from this rank's segments of the initial weights (asked
// for in order: `values(s)` points at segment s's first element), the moments zero.
using SegmentValues = std::function<const float*(const OwnedSegment& s)>;
void swap_in_weights(OptimizerSwapper& swapper, const std::vector<OwnedSegment>& owned, const SegmentValues& values);
// The swapped states from a checkpoint (any world size or stage), read sub-group by sub-group: memory
// is one buffer set, never the rank's part. `part`: this rank's segments and sizes (no pointers).
CheckpointScalars swap_in_checkpoint(OptimizerSwapper& swapper, const std::string& checkpoint_dir, const CheckpointBuffers& part);
// A checkpoint's shard drawn from the swap files.
ShardPieces swapped_pieces(OptimizerSwapper& swapper, int moments);

}  // namespace ds
