// The device seam (engine/runtime/device/device.hpp) held to what a GPU backend must do, on the CPU: a second
// device whose memory the host may not address keeps its buffers apart from the host's, refuses a kernel
// handed a pointer from the wrong place, sees any host write into page-locked memory a copy to the device may still
// be reading (ordered as the CUDA device orders its copies), and counts every byte that crosses between the two. A ZeRO-3 run
// with its optimizer offloaded trains on it exactly as on the CPU device, moving the plan's bytes.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <csignal>
#include <cstring>
#include <cmath>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <thread>

#include "engine/plan/optimizer_groups.hpp"
#include "engine/runtime/comm/comm_local.hpp"
#include "engine/runtime/device/device.hpp"
#include "engine/runtime/run/trainer.hpp"
#include "schema/loader.hpp"
#include "test_helpers.hpp"

#include <nlohmann/json.hpp>

using namespace ds;
namespace fs = std::filesystem;

namespace {

// The point in the test device's compute stream an event of it marks (records so far, counting it); -1 for another's.
int64_t compute_point(const Event& e);

// A copy stream as a GPU's behaves for the host (the test device has two, as the CUDA device: one for the copies to the
// device, one for those to the host): a copy to the device may still be reading its host source when copy() returns,
// until the host waits for an event recorded after it (or synchronizes the stream; an event the host finds done counts
// as waited); a copy to the host has ended when copy() returns, and every copy queued on its stream before it (the
// CUDA device synchronizes that stream then: host code reads it next), but not those on the other stream. It keeps the host ranges such copies read, for the host's kernel table to refuse a
// kernel that would write one before the copy is known to have ended, and their bytes as the copy took them: a range
// changed by the time its copy is known to have ended was written by something else meanwhile (a plain torch op, which
// no kernel table sees), and a GPU's copy could have read either version. Such ranges are kept as `races()`.
class TrackedCopyStream final : public Stream {
 public:
  std::shared_ptr<Event> record() override { return std::make_shared<Recorded>(this, queued_); }
  std::shared_ptr<Event> record_timed() override { return record(); }  // (never timed: the step's clock is the compute stream's)
  // (orders the device's work, not the host's) The copies queued next wait for the compute stream's point `e`.
  void wait_for(const Event& e) override { after_compute_ = compute_point(e); }
  void synchronize() override { ended(queued_); }
  // The compute stream's point the last wait_for named: what the copies queued since wait for.
  int64_t after_compute() const { return after_compute_; }
  // `pinned`: the source is page-locked, so the copy reads it while it runs (a GPU stages a pageable source before
  // the copy call returns: its later writes race nothing, and only its range is kept, for the kernel table).
  void reading(const void* p, int64_t bytes, bool pinned) {
    const char* c = static_cast<const char*>(p);
    pending_.push_back({++queued_, c, c + bytes, pinned ? std::vector<char>(c, c + bytes) : std::vector<char>()});
    if (pinned && bytes > 0) ++pinned_reads;
  }
  int64_t pinned_reads = 0;  // copies from page-locked memory (those the races are looked for in)
  // The copy just queued (reading()'s) writes its bytes only once the compute stream waits for it or the host learns it
  // ended (Device::copy_ahead's: what runs on the device before then may not see them).
  void defer(void* dst, const void* src, int64_t bytes) { deferred_.push_back({queued_, dst, src, bytes}); }
  // A copy from the device to the host queued to land later, as defer()'s (no host source to watch), after the compute
  // stream's point the last wait_for named: `arrivals_landed_late` counts those landing once the compute stream has
  // been given more since (`compute_points`: its count of points).
  void queue_arrival(void* dst, const void* src, int64_t bytes, const int64_t* compute_points) {
    deferred_.push_back({++queued_, dst, src, bytes, after_compute_, compute_points});
  }
  int64_t arrivals_landed_late = 0;
  // The deferred copies up to `seq` land, in order.
  void land(int64_t seq) {
    while (!deferred_.empty() && deferred_.front().seq <= seq) {
      const Deferred& d = deferred_.front();
      std::memcpy(d.dst, d.src, static_cast<size_t>(d.bytes));
      if (d.compute_points && *d.compute_points > d.after_compute) ++arrivals_landed_late;
      deferred_.pop_front();
    }
  }
  const std::vector<std::string>& races() const { return races_; }
  // The copies queued before `e` (an event of this stream's; -1 for another's) have ended once the host knows `e` has.
  int64_t copies_before(const Event& e) const {
    const auto* r = dynamic_cast<const Recorded*>(&e);
    return r && r->stream() == this ? r->seq() : -1;
  }
  void ended(int64_t seq) {
    land(seq);
    for (const Pending& q : pending_)
      if (q.seq <= seq && !q.taken.empty() && !std::equal(q.lo, q.hi, q.taken.begin()) && races_.size() < 8)
        races_.push_back("copy " + std::to_string(q.seq) + " to the device (" + std::to_string(q.hi - q.lo) +
                         " bytes): its host source changed before the copy was known to have ended");
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(), [seq](const Pending& q) { return q.seq <= seq; }), pending_.end());
  }
  // Whether a copy not yet known to have ended reads any of [p, p + bytes).
  bool still_read(const void* p, int64_t bytes) const {
    const char* c = static_cast<const char*>(p);
    for (const Pending& q : pending_)
      if (c < q.hi && c + bytes > q.lo) return true;
    return false;
  }

 private:
  struct Pending {
    int64_t seq;
    const char *lo, *hi;
    std::vector<char> taken;  // a pinned source's bytes when the copy was queued
  };
  class Recorded final : public Event {
   public:
    Recorded(TrackedCopyStream* s, int64_t seq) : s_(s), seq_(seq) {}
    bool done() const override { return s_->ended(seq_), true; }
    void wait() override { s_->ended(seq_); }
    int64_t seq() const { return seq_; }
    const TrackedCopyStream* stream() const { return s_; }

   private:
    TrackedCopyStream* s_;
    int64_t seq_;
  };
  int64_t queued_ = 0, after_compute_ = -1;
  std::vector<Pending> pending_;
  struct Deferred {
    int64_t seq;
    void* dst;
    const void* src;
    int64_t bytes;
    int64_t after_compute = -1;
    const int64_t* compute_points = nullptr;  // (an arrival's: queue_arrival)
  };
  std::deque<Deferred> deferred_;
  std::vector<std::string> races_;
};

// The test device's compute stream: immediate, as the CPU's, but its timed events read a clock of the device's
// own, which moves one second at each timed event and not otherwise: a time taken on the host's clock instead
// is a fraction of a second, and a time between two events is the count of timed events between them. It keeps the
// last copy of each copy stream it was made to wait for: once the host has waited for it, so have those copies ended.
class TickingStream final : public Stream {
 public:
  // `host_calls`: the host's kernel calls so far, kept at each point (host_calls_at).
  TickingStream(TrackedCopyStream& to_device, TrackedCopyStream& to_host, const int64_t& host_calls)
      : copies_{{{&to_device, -1}, {&to_host, -1}}}, host_calls_(host_calls) {}
  std::shared_ptr<Event> record() override { return std::make_shared<Tick>(-1, next_point()); }
  std::shared_ptr<Event> record_timed() override { return std::make_shared<Tick>(++ticks, next_point()); }
  void wait_for(const Event& e) override {  // (the compute queued next reads what the copies up to `e` wrote)
    for (auto& [copies, waited] : copies_) {
      waited = std::max(waited, copies->copies_before(e));
      copies->land(waited);
    }
  }
  void synchronize() override {
    for (auto& [copies, waited] : copies_) copies->ended(waited);
  }
  int64_t ticks = 0;
  int64_t points = 0;  // events recorded: each a point in the compute stream's work
  static int64_t point_of(const Event& e) {
    const auto* t = dynamic_cast<const Tick*>(&e);
    return t ? t->point() : -1;
  }
  // The host's kernel calls made by the time `point` was recorded.
  int64_t host_calls_at(int64_t point) const { return host_calls_at_[static_cast<size_t>(point - 1)]; }

 private:
  int64_t next_point() {
    host_calls_at_.push_back(host_calls_);
    return ++points;
  }
  class Tick final : public Event {
   public:
    Tick(int64_t at, int64_t point) : at_(at), point_(point) {}
    int64_t point() const { return point_; }
    bool done() const override { return true; }
    void wait() override {}
    double seconds_since(const Event& earlier) const override {
      const int64_t from = dynamic_cast<const Tick&>(earlier).at_;
      if (at_ < 0 || from < 0) throw std::logic_error("an untimed event timed");
      return static_cast<double>(at_ - from);
    }

   private:
    int64_t at_, point_;
  };
  std::array<std::pair<TrackedCopyStream*, int64_t>, 2> copies_;  // each copy stream, and the last of its copies waited for
  const int64_t& host_calls_;
  std::vector<int64_t> host_calls_at_;  // per point, from 1
};

int64_t compute_point(const Event& e) { return TickingStream::point_of(e); }

// A CPU "device" with memory of its own: host code may not reach into it (host_addresses_device false), so
// the runtime must copy (counted) where the CPU device lets a host kernel write in place.
// The stop handler a run installs (TrainOptions::set_stop_handler), kept here for a test device to call as Ctrl-C would.
std::atomic<StopHandler> g_run_stop_handler{nullptr};
StopHandler take_stop_handler(StopHandler handler) { return g_run_stop_handler.exchange(handler); }

class SeparateMemoryDevice final : public Device {
 public:
  SeparateMemoryDevice() : device_table_(*this, Place::device), host_table_(*this, Place::host), compute_(copy_, to_host_, host_table_.calls) {}
  std::string name() const override { return "separate-memory test device"; }
  bool host_addresses_device() const override { return false; }
  double pinned_bytes = 0;  // host memory asked page-locked
  // A copy from the device the host waits for later (Device::copy_ahead) lands as it is queued rather than when waited
  // for: the source has been written by then (the CPU's compute has run), so what this catches is a destination
  // taken again before the host read what landed there before.
  bool arrivals_land_at_once = false;
  // The host's sums of squares of bf16 values that return infinity, counted from 1, as a gradient's overflow would
  // make them (the step's norm: one such sum a step where the gradients are on the host).
  std::set<int64_t> infinite_host_sums;
  mutable int64_t host_bf16_sums = 0;
  torch::Tensor allocate(Place place, Dtype dtype, int64_t elements, bool pinned) override {
    if (pinned) pinned_bytes += static_cast<double>(elements * dtype_bytes(dtype));
    torch::Tensor t = torch::zeros({elements}, to_torch(dtype));
    const auto* p = static_cast<const char*>(t.data_ptr());
    if (place != Place::device) {
      if (!pinned) return t;
      pinned_ranges_[p] = p + t.nbytes();
      // (freed as cudaFreeHost frees: once every copy has ended, so a copy never outlives the memory it reads)
      return torch::from_blob(t.data_ptr(), {elements}, [this, t, p](void*) { copy_.synchronize(), to_host_.synchronize(), pinned_ranges_.erase(p); }, t.options());
    }
    device_ranges_[p] = p + t.nbytes();
    // Freed, its range is no longer the device's (the host may be handed those addresses next).
    return torch::from_blob(t.data_ptr(), {elements}, [this, t, p](void*) { device_ranges_.erase(p); }, t.options());
  }
  const KernelTable& kernels(Place place) const override { return place == Place::device ? device_table_ : host_table_; }
  Stream& compute_stream() override { return compute_; }
  Stream& copy_stream() override { return copy_; }
  Stream& copy_stream_to_host() override { return to_host_; }
  int64_t clock_ticks() const { return compute_.ticks; }

  // Whether [p, p + bytes) lies inside one device allocation (one page-locked host allocation); whether it touches any
  // device allocation.
  bool inside_device(const void* p, int64_t bytes) const { return inside(device_ranges_, p, bytes); }
  bool inside_pinned(const void* p, int64_t bytes) const { return inside(pinned_ranges_, p, bytes); }
  static bool inside(const std::map<const char*, const char*>& ranges, const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    auto it = ranges.upper_bound(c);
    if (it == ranges.begin()) return false;
    --it;
    return c >= it->first && c + bytes <= it->second;
  }
  bool touches_device(const void* p, int64_t bytes) const {
    const char* c = static_cast<const char*>(p);
    for (const auto& [lo, hi] : device_ranges_)
      if (c < hi && c + bytes > lo) return true;
    return false;
  }
  // Kernel calls made through each place's table.
  int64_t kernel_calls(Place place) const { return place == Place::device ? device_table_.calls : host_table_.calls; }
  // Sums of squares queued into device memory for the host to read later (KernelTable::sum_of_squares_to).
  int64_t queued_sums() const { return device_table_.queued_sums + host_table_.queued_sums; }
  // Ctrl-C reaches the run (its handler, as take_stop_handler kept it) while the device's `k`-th sum is queued: mid-step.
  void stop_during_queued_sum(int64_t k) { device_table_.stop_at_sum = k; }
  int64_t pinned_copies() const { return copy_.pinned_reads; }
  // Copies to the device ordered after an earlier point of the compute stream than its latest: ones a GPU runs beside
  // the compute queued since (Device::copy with `after`).
  int64_t copies_beside_compute() const { return copies_beside_compute_; }
  // The same from the device to the host: gradients leaving while a GPU runs the compute queued after theirs.
  int64_t arrivals_beside_compute() const { return arrivals_beside_compute_; }
  // The same for the copies to the device the compute stream waits for only later (Device::copy_ahead).
  int64_t ahead_beside_compute() const { return ahead_beside_compute_; }
  // Copies from the device the host waits for only later (Device::copy_ahead: gradients landing late), and of them
  // those that landed once the compute stream had been given more (a GPU runs them beside that).
  int64_t arrivals_ahead() const { return arrivals_ahead_; }
  int64_t arrivals_landed_late() const { return to_host_.arrivals_landed_late; }
  // ... and those queued once the host had run kernels (a step's) since the compute stream's point they wait for, just
  // after their block's backward: a block's copy out queued behind the host's work in its hook.
  int64_t arrivals_behind_host_steps() const { return arrivals_behind_host_steps_; }
  // Host sources changed under a copy still reading them (TrackedCopyStream), once every copy has ended.
  std::vector<std::string> copy_races() {
    copy_.synchronize(), to_host_.synchronize();
    return copy_.races();  // (the copies to the host read no host memory)
  }

 protected:
  void copy_between(const torch::Tensor& dst, Place to, const torch::Tensor& src, Place from) override {
    check_at(dst.data_ptr(), static_cast<int64_t>(dst.nbytes()), to, "a copy's destination");
    check_at(src.data_ptr(), static_cast<int64_t>(src.nbytes()), from, "a copy's source");
    // As the CUDA device: a copy between equal dtypes is queued on the copy stream for its direction, behind every copy
    // before it there (which have ended by the time it writes); one that converts is LibTorch's, on the compute stream
    // (which waits for every copy before it: Device::copy), blocking the host until it has run.
    const bool on_copy_stream = dst.scalar_type() == src.scalar_type() && dst.is_contiguous() && src.is_contiguous();
    TrackedCopyStream& copies = stream_for(from, to);
    if (on_copy_stream) copies.land(std::numeric_limits<int64_t>::max());  // (behind the copies queued before it)
    if (on_copy_stream && to == Place::host) copies.synchronize();  // (then the host waits for it: host code reads it next)
    if (!on_copy_stream && (from == Place::host) != (to == Place::host)) compute_.synchronize();
    // As cudaMemcpyAsync, a copy between equal dtypes writes the bytes and leaves LibTorch's version counters alone
    // (the host's step during the forward writes later blocks' weights, views of one buffer, after earlier blocks
    // saved theirs for the backward); a converting copy is LibTorch's, as on the GPU.
    if (on_copy_stream)
      std::memcpy(dst.data_ptr(), src.data_ptr(), dst.nbytes());
    else
      dst.copy_(src);
    if (on_copy_stream && from == Place::host && to == Place::device) {
      copy_.reading(src.data_ptr(), static_cast<int64_t>(src.nbytes()), inside_pinned(src.data_ptr(), static_cast<int64_t>(src.nbytes())));
      // (on a GPU it runs beside the compute queued after the point it waits for)
      if (copy_.after_compute() < compute_.points) ++copies_beside_compute_;
    }
    if (on_copy_stream && from == Place::device && to == Place::host && to_host_.after_compute() < compute_.points) ++arrivals_beside_compute_;
  }

  // A copy the compute stream waits for only later (Device::copy_ahead): its bytes land then, or (to the host) once
  // the host waits for it: reading the destination before, or writing the source, reads or copies the wrong bytes.
  void copy_between_ahead(const torch::Tensor& dst, Place to, const torch::Tensor& src, Place from) override {
    if (!(from != to && dst.scalar_type() == src.scalar_type() && dst.is_contiguous() && src.is_contiguous()))
      return copy_between(dst, to, src, from);
    check_at(dst.data_ptr(), static_cast<int64_t>(dst.nbytes()), to, "a copy's destination");
    check_at(src.data_ptr(), static_cast<int64_t>(src.nbytes()), from, "a copy's source");
    if (to == Place::host) {
      if (!inside_pinned(dst.data_ptr(), static_cast<int64_t>(dst.nbytes())))
        throw std::logic_error("a copy from the device the host waits for later lands in pageable memory (a GPU copies into it at once)");
      ++arrivals_ahead_;
      if (const int64_t after = to_host_.after_compute(); after > 0 && host_table_.calls > compute_.host_calls_at(after)) ++arrivals_behind_host_steps_;
      if (arrivals_land_at_once) {  // (the other order a GPU may take: a buffer still to be summed is overwritten now)
        to_host_.land(std::numeric_limits<int64_t>::max());
        std::memcpy(dst.data_ptr(), src.data_ptr(), dst.nbytes());
        return;
      }
      to_host_.queue_arrival(dst.data_ptr(), src.data_ptr(), static_cast<int64_t>(dst.nbytes()), &compute_.points);
      return;
    }
    copy_.reading(src.data_ptr(), static_cast<int64_t>(src.nbytes()), inside_pinned(src.data_ptr(), static_cast<int64_t>(src.nbytes())));
    copy_.defer(dst.data_ptr(), src.data_ptr(), static_cast<int64_t>(dst.nbytes()));
    if (copy_.after_compute() < compute_.points) ++ahead_beside_compute_;
  }

 private:
  TrackedCopyStream& stream_for(Place from, Place to) { return &copy_stream_for(from, to) == &to_host_ ? to_host_ : copy_; }
  void check_at(const void* p, int64_t bytes, Place place, const char* what) const {
    if (!p || bytes == 0) return;
    const bool ok = place == Place::device ? inside_device(p, bytes) : !touches_device(p, bytes);
    if (!ok) throw std::logic_error(std::string(what) + " is not in " + place_name(place) + " memory");
  }

  // Checks every buffer a kernel is handed lies where the table's kernels run, then runs the CPU's.
  class CheckingTable final : public KernelTable {
   public:
    CheckingTable(const SeparateMemoryDevice& d, Place place) : d_(d), place_(place) {}
    const char* name() const override { return "checking"; }
    void adam_step_f32(float* w, float* m, float* v, uint16_t* out, const float* g, int64_t n, const kernels::AdamStep& s) const override {
      check({{w, 4, true}, {m, 4, true}, {v, 4, true}, {out, 2, true}, {g, 4, false}}, n, "adam_step_f32");
      cpu_kernel_table().adam_step_f32(w, m, v, out, g, n, s);
    }
    void adam_step_bf16(float* w, float* m, float* v, uint16_t* out, const uint16_t* g, int64_t n,
                        const kernels::AdamStep& s) const override {
      check({{w, 4, true}, {m, 4, true}, {v, 4, true}, {out, 2, true}, {g, 2, false}}, n, "adam_step_bf16");
      cpu_kernel_table().adam_step_bf16(w, m, v, out, g, n, s);
    }
    void sgd_step_f32(float* w, float* buf, uint16_t* out, const float* g, int64_t n, const kernels::SgdStep& s) const override {
      check({{w, 4, true}, {buf, 4, true}, {out, 2, true}, {g, 4, false}}, n, "sgd_step_f32");
      cpu_kernel_table().sgd_step_f32(w, buf, out, g, n, s);
    }
    void sgd_step_bf16(float* w, float* buf, uint16_t* out, const uint16_t* g, int64_t n, const kernels::SgdStep& s) const override {
      check({{w, 4, true}, {buf, 4, true}, {out, 2, true}, {g, 2, false}}, n, "sgd_step_bf16");
      cpu_kernel_table().sgd_step_bf16(w, buf, out, g, n, s);
    }
    void lamb_moments_f32(const float* w, float* m, float* v, const float* g, int64_t n, const kernels::LambStep& s, double* w_sq,
                          double* u_sq) const override {
      check({{w, 4, false}, {m, 4, true}, {v, 4, true}, {g, 4, false}}, n, "lamb_moments_f32");
      cpu_kernel_table().lamb_moments_f32(w, m, v, g, n, s, w_sq, u_sq);
    }
    void lamb_moments_bf16(const float* w, float* m, float* v, const uint16_t* g, int64_t n, const kernels::LambStep& s, double* w_sq,
                           double* u_sq) const override {
      check({{w, 4, false}, {m, 4, true}, {v, 4, true}, {g, 2, false}}, n, "lamb_moments_bf16");
      cpu_kernel_table().lamb_moments_bf16(w, m, v, g, n, s, w_sq, u_sq);
    }
    void lamb_apply(float* w, const float* m, const float* v, uint16_t* out, int64_t n, const kernels::LambStep& s,
                    float ratio) const override {
      check({{w, 4, true}, {m, 4, false}, {v, 4, false}, {out, 2, true}}, n, "lamb_apply");
      cpu_kernel_table().lamb_apply(w, m, v, out, n, s, ratio);
    }
    double sum_of_squares_f32(const float* x, int64_t n) const override {
      check({{x, 4, false}}, n, "sum_of_squares_f32");
      return cpu_kernel_table().sum_of_squares_f32(x, n);
    }
    double sum_of_squares_bf16(const uint16_t* x, int64_t n) const override {
      check({{x, 2, false}}, n, "sum_of_squares_bf16");
      if (place_ == Place::host && d_.infinite_host_sums.count(++d_.host_bf16_sums)) return std::numeric_limits<double>::infinity();
      return cpu_kernel_table().sum_of_squares_bf16(x, n);
    }
    void adam_step_fp16(float* w, float* m, float* v, uint16_t* out, const uint16_t* g, int64_t n,
                        const kernels::AdamStep& s) const override {
      check({{w, 4, true}, {m, 4, true}, {v, 4, true}, {out, 2, true}, {g, 2, false}}, n, "adam_step_fp16");
      cpu_kernel_table().adam_step_fp16(w, m, v, out, g, n, s);
    }
    void sgd_step_fp16(float* w, float* buf, uint16_t* out, const uint16_t* g, int64_t n, const kernels::SgdStep& s) const override {
      check({{w, 4, true}, {buf, 4, true}, {out, 2, true}, {g, 2, false}}, n, "sgd_step_fp16");
      cpu_kernel_table().sgd_step_fp16(w, buf, out, g, n, s);
    }
    void lamb_moments_fp16(const float* w, float* m, float* v, const uint16_t* g, int64_t n, const kernels::LambStep& s, double* w_sq,
                           double* u_sq) const override {
      check({{w, 4, false}, {m, 4, true}, {v, 4, true}, {g, 2, false}}, n, "lamb_moments_fp16");
      cpu_kernel_table().lamb_moments_fp16(w, m, v, g, n, s, w_sq, u_sq);
    }
    double sum_of_squares_fp16(const uint16_t* x, int64_t n) const override {
      check({{x, 2, false}}, n, "sum_of_squares_fp16");
      return cpu_kernel_table().sum_of_squares_fp16(x, n);
    }
    // (a sum the host does not wait for: counted apart, then the blocking one's checks and result)
    void sum_of_squares_to(const void* x, GradElements e, int64_t n, double* out) const override {
      if (++queued_sums == stop_at_sum)
        if (const StopHandler stop = g_run_stop_handler.load()) stop(SIGINT);  // (as Ctrl-C would, mid-step)
      *out = sum_of_squares(x, e, n);
    }
    mutable int64_t calls = 0, queued_sums = 0;
    int64_t stop_at_sum = 0;  // the queued sum during which the run is stopped (0: never)

   private:
    struct Buffer {
      const void* p;
      int width;
      bool written;  // (what a kernel only reads, a copy may read beside it)
    };
    void check(std::initializer_list<Buffer> buffers, int64_t n, const char* kernel) const {
      ++calls;
      for (const auto& [p, width, written] : buffers) {
        d_.check_at(p, n * width, place_, kernel);
        if (place_ == Place::host && written && d_.copy_.still_read(p, n * width))
          throw std::logic_error(std::string(kernel) + " is handed host memory a copy to the device may still be reading: wait "
                                 "for an event the copy stream recorded after it first");
      }
    }
    const SeparateMemoryDevice& d_;
    Place place_;
  };

  std::map<const char*, const char*> device_ranges_;  // begin -> end of every device allocation
  std::map<const char*, const char*> pinned_ranges_;  // and of every page-locked host allocation
  int64_t copies_beside_compute_ = 0, arrivals_beside_compute_ = 0, ahead_beside_compute_ = 0, arrivals_ahead_ = 0, arrivals_behind_host_steps_ = 0;
  CheckingTable device_table_, host_table_;
  TrackedCopyStream copy_, to_host_;  // the copies to the device (and between host buffers); those to the host
  TickingStream compute_;  // its own clock: a step is timed on the device's, not the host's
};

const char* kTiny = R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
  "model": {"preset": "gpt2-tiny"}, "data": {"type": "synthetic", "seq_len": 16},
  "zero_optimization": {"reduce_bucket_size": 3000, "allgather_bucket_size": 5000,
                        "stage3_param_persistence_threshold": "auto"},
  "train": {"steps": 4, "eval_every": 0, "threads": 1}})";

// `grads_leave`: an offloaded optimizer's gradients leave block by block for host memory, as on a GPU.
// `separate`: for the separate-memory device, whose weights cross between places by copies, as a GPU's do.
// A compiled plan changed by a test before it runs (what the planner only does at sizes a test cannot train).
using PlanEdit = std::function<void(Plan&)>;

// `backend`: the communicator the plan is made for (NCCL's equal packed pieces stage stage 3's gathers, as on a GPU).
Plan plan_for(int world, int rank, const std::vector<std::string>& overrides, bool grads_leave = false, bool separate = false,
              const PlanEdit& edit = {}, std::optional<CommBackend> backend = {}) {
  Config c = load_config_text(kTiny, "test.json", overrides);
  Topology t = test::thread_ranks(world, rank);
  t.communicator = backend;
  if (grads_leave) t.gradients_leave_per_block = true;
  if (separate) t.host_writes_device = false;
  Plan plan = compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), t);
  if (edit) edit(plan);
  return plan;
}

struct RankRun {
  TrainResult result;
  TransferLedger transfers;
  double pinned_bytes = 0;  // the separate-memory device's page-locked host allocations
  int64_t device_kernels = 0, host_kernels = 0;
  std::vector<std::string> copy_races;  // the separate-memory device's (SeparateMemoryDevice::copy_races)
  int64_t pinned_copies = 0;            // its copies to the device from page-locked memory (where races are looked for)
  int64_t queued_sums = 0;              // its sums of squares the host read only later (the step's norm kept on the device)
  int64_t copies_beside_compute = 0;    // its copies to the device a GPU would run beside compute queued before them
  int64_t arrivals_beside_compute = 0;  // and from the device (SeparateMemoryDevice::arrivals_beside_compute)
  int64_t ahead_beside_compute = 0;     // and those waited for only later (SeparateMemoryDevice::ahead_beside_compute)
  int64_t arrivals_ahead = 0;           // the arrivals the host waited for only later (SeparateMemoryDevice::arrivals_ahead)
  int64_t arrivals_landed_late = 0;     // ... landed once later compute was queued (SeparateMemoryDevice::arrivals_landed_late)
  int64_t arrivals_behind_host_steps = 0;  // ... queued behind the host's steps (SeparateMemoryDevice::arrivals_behind_host_steps)
};

// Trains on `world` thread ranks, each on its own device (the CPU's, or a separate-memory one).
// `prepare`: a rank's options and device, changed before it trains.
using RankPrepare = std::function<void(int rank, TrainOptions&, Device&)>;

std::vector<RankRun> train_ranks(int world, const std::vector<std::string>& overrides, bool separate,
                                 const std::string& resume_from = "", bool grads_leave = false, const PlanEdit& edit = {},
                                 const RankPrepare& prepare = {}, std::optional<CommBackend> backend = {}) {
  std::vector<RankRun> runs(static_cast<size_t>(world));
  LocalGroup group(world);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        const Plan plan = plan_for(world, r, overrides, grads_leave, separate, edit, backend);
        TrainOptions opt;
        opt.print_every = 1000;
        opt.resume_from = resume_from;
        auto comm = world > 1 ? group.join(r) : nullptr;
        std::unique_ptr<Device> device = separate ? std::make_unique<SeparateMemoryDevice>() : Device::create(DeviceKind::cpu, r);
        if (prepare) prepare(r, opt, *device);
        RankRun& run = runs[static_cast<size_t>(r)];
        run.result = train(plan, opt, comm.get(), device.get());
        run.transfers = device->transfers();
        if (separate) {
          auto& d = static_cast<SeparateMemoryDevice&>(*device);
          run.device_kernels = d.kernel_calls(Place::device);
          run.pinned_bytes = d.pinned_bytes;
          run.host_kernels = d.kernel_calls(Place::host);
          run.copy_races = d.copy_races();
          run.pinned_copies = d.pinned_copies();
          run.queued_sums = d.queued_sums();
          run.copies_beside_compute = d.copies_beside_compute();
          run.arrivals_beside_compute = d.arrivals_beside_compute();
          run.ahead_beside_compute = d.ahead_beside_compute();
          run.arrivals_ahead = d.arrivals_ahead();
          run.arrivals_landed_late = d.arrivals_landed_late();
          run.arrivals_behind_host_steps = d.arrivals_behind_host_steps();
        }
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) EXPECT_EQ(e, "");
  for (const RankRun& run : runs)  // (every separate-memory run: no host write raced a copy to the device)
    EXPECT_EQ(run.copy_races, std::vector<std::string>{});
  return runs;
}

double ledger_bytes(const TransferLedger& l, Place from, Place to) {
  const auto it = l.find({from, to});
  return it == l.end() ? 0.0 : it->second.bytes;
}

}  // namespace

// The test device sees what a GPU's asynchronous copy would suffer: a host source written (here by a plain torch op,
// which no kernel table sees) before the copy reading it is known to have ended; written after the host waited for an
// event recorded behind the copy, it is not. Every separate-memory run in this file is held to having none.
TEST(DeviceSeam, TheTestDeviceSeesAHostWriteThatRacesACopyToTheDevice) {
  SeparateMemoryDevice device;
  const torch::Tensor host = device.allocate(Place::host, Dtype::fp32, 64, /*pinned=*/true);
  const torch::Tensor on_device = device.allocate(Place::device, Dtype::fp32, 64, false);
  host.fill_(1);
  device.copy(on_device, Place::device, host, Place::host);
  device.copy_stream().record()->wait();
  host.add_(1);  // after the wait: no race
  EXPECT_EQ(device.copy_races(), std::vector<std::string>{});
  // Ended as the compute stream, which waits for every copy (Device::copy), was synchronized.
  device.copy(on_device, Place::device, host, Place::host);
  device.compute_stream().synchronize();
  host.add_(1);
  // A pageable source is taken before the copy call returns: nothing to race.
  const torch::Tensor pageable = torch::ones({64});
  device.copy(on_device, Place::device, pageable, Place::host);
  pageable.add_(1);
  EXPECT_EQ(device.copy_races(), std::vector<std::string>{});
  device.copy(on_device, Place::device, host, Place::host);
  host.add_(1);  // before any wait: the copy could have read either version
  std::vector<std::string> races = device.copy_races();
  ASSERT_EQ(races.size(), 1u);
  EXPECT_NE(races[0].find("256 bytes): its host source changed before the copy was known to have ended"), std::string::npos) << races[0];
  // A copy to the host, ended as copy() returns, ends the copies before it on its own stream only (as on a GPU, where
  // the two directions run at once): the copy to the device may still be reading.
  device.copy(on_device, Place::device, host, Place::host);
  device.copy(device.allocate(Place::host, Dtype::fp32, 64, false), Place::host, on_device, Place::device);
  host.add_(1);
  races = device.copy_races();
  EXPECT_EQ(races.size(), 2u);
}

TEST(DeviceSeam, ASeparateMemoryDeviceTrainsZero3WithOffloadAsTheCpuMovingThePlansBytes) {
  const fs::path root = fs::temp_directory_path() / ("ds_device_seam_" + std::to_string(::getpid()));
  const fs::path nvme = root / "nvme";
  fs::create_directories(nvme);
  struct Case {
    std::string name;
    std::vector<std::string> overrides;
    bool grads_leave = false;  // each block's reduced gradients leave for the host (ZeRO-Offload as on a GPU)
  };
  const std::vector<Case> cases{
      {"bf16, optimizer on the CPU", {"bf16.enabled=true", "zero_optimization.offload_optimizer.device=cpu"}},
      // The host's step writes the device's bf16 weights into two staging buffers in turn, tile by tile (of an
      // in-memory span, or windows of NVMe's sub-groups), each copied over as the next is stepped.
      {"bf16, optimizer on the CPU in tiles", {"bf16.enabled=true", "zero_optimization.offload_optimizer.device=cpu",
                                               "zero_optimization.sub_group_size=20000"}},
      {"bf16, optimizer on NVMe, gradients leaving block by block",
       {"bf16.enabled=true", "zero_optimization.offload_optimizer.device=nvme", "zero_optimization.offload_optimizer.nvme_path=" + nvme.string(),
        "zero_optimization.sub_group_size=20000"},
       true},
      {"fp32, optimizer on NVMe", {"bf16.enabled=false", "zero_optimization.offload_optimizer.device=nvme",
                                   "zero_optimization.offload_optimizer.nvme_path=" + nvme.string(), "zero_optimization.sub_group_size=5000"}},
      {"fp16, 40% of the optimizer on the CPU",
       {"fp16.enabled=true", "zero_optimization.offload_optimizer.device=cpu", "zero_optimization.offload_optimizer.ratio=0.4"}},
      {"bf16, no offload", {"bf16.enabled=true"}},
      // The parameters offloaded too: their partitions reach the device's gather buffers through counted
      // copies (from the host, or from the swap file's host buffers), and the weights stepped on the device
      // go back to the host's partition or file the same way.
      {"bf16, parameters and optimizer on the CPU",
       {"bf16.enabled=true", "zero_optimization.offload_param.device=cpu", "zero_optimization.offload_optimizer.device=cpu"}},
      {"fp32, parameters on the CPU, optimizer on the device", {"bf16.enabled=false", "zero_optimization.offload_param.device=cpu"}},
      {"bf16, parameters on NVMe, 40% of the optimizer on the CPU",
       {"bf16.enabled=true", "zero_optimization.offload_param.device=nvme", "zero_optimization.offload_param.nvme_path=" + nvme.string(),
        "zero_optimization.offload_param.buffer_size=2000", "zero_optimization.offload_optimizer.device=cpu",
        "zero_optimization.offload_optimizer.ratio=0.4"}},
      {"bf16, optimizer on the CPU, gradients leaving block by block", {"bf16.enabled=true", "zero_optimization.offload_optimizer.device=cpu"}, true},
      {"stage 2, bf16, optimizer on the CPU, gradients leaving block by block",
       {"zero_optimization.stage=2", "bf16.enabled=true", "zero_optimization.offload_optimizer.device=cpu"},
       true},
      {"fp32, optimizer on NVMe, gradients leaving block by block",
       {"bf16.enabled=false", "zero_optimization.offload_optimizer.device=nvme", "zero_optimization.offload_optimizer.nvme_path=" + nvme.string(),
        "zero_optimization.sub_group_size=5000", "gradient_accumulation_steps=2"},
       true},
      {"bf16, parameters on the CPU, optimizer on NVMe",
       {"bf16.enabled=true", "zero_optimization.offload_param.device=cpu", "zero_optimization.offload_optimizer.device=nvme",
        "zero_optimization.offload_optimizer.nvme_path=" + nvme.string(), "zero_optimization.sub_group_size=5000"}},
      {"fp32, parameters and optimizer on NVMe",
       {"bf16.enabled=false", "zero_optimization.offload_param.device=nvme", "zero_optimization.offload_param.nvme_path=" + nvme.string(),
        "zero_optimization.offload_optimizer.device=nvme", "zero_optimization.offload_optimizer.nvme_path=" + nvme.string(),
        "zero_optimization.sub_group_size=5000"}},
  };
  int64_t pinned_copies_seen = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<std::string> o{"zero_optimization.stage=3", "train.output_dir=" + (root / c.name).string()};
    o.insert(o.end(), c.overrides.begin(), c.overrides.end());
    const std::vector<RankRun> cpu = train_ranks(2, o, false, "", c.grads_leave);
    fs::remove_all(root / c.name);
    const std::vector<RankRun> separate = train_ranks(2, o, true, "", c.grads_leave);
    std::vector<double> moved;  // per step, as the separate device counted them (metrics.jsonl)
    std::ifstream metrics(root / c.name / "metrics.jsonl");
    for (std::string line; std::getline(metrics, line);) moved.push_back(nlohmann::json::parse(line)["offload_bytes"].get<double>());
    fs::remove_all(root / c.name);
    const Plan plan = plan_for(2, 0, o, c.grads_leave, /*separate=*/true);
    ASSERT_EQ(separate.size(), 2u);
    // Where the host steps bf16 states of weights it cannot reach, they come over through the staging buffers.
    const StateSpan& front = plan.execution.state_spans.front();
    const bool staged = front.place != Place::device && plan.precision.param_dtype == Dtype::bf16 &&
                        plan.zero.offload_param.device == OffloadDevice::none;
    EXPECT_EQ(front.weights == WeightsBack::staged, staged);
    EXPECT_EQ(plan.execution.find(BufferRole::weights_staging, Place::host) != nullptr, staged);
    if (c.name == "bf16, optimizer on the CPU in tiles") {
      EXPECT_GT(plan.execution.weight_tiles.size(), 2u);
    }
    // Page-locked: exactly the host buffers the device copies to or from (each carved at a 64-byte boundary), never
    // the states the host steps where they are.
    double pinned = 0;
    int pinned_buffers = 0;
    for (const ZeroBuffer& b : plan.execution.buffers) {
      if (!b.pinned) continue;
      EXPECT_EQ(b.place, Place::host) << buffer_role_name(b.role);
      // (the master only where the device's weights are copied from it)
      EXPECT_TRUE(b.role != BufferRole::exp_avg && b.role != BufferRole::exp_avg_sq) << buffer_role_name(b.role);
      if (b.role == BufferRole::master) {
        EXPECT_EQ(front.weights, WeightsBack::copied);
      }
      pinned += b.bytes();
      pinned_buffers += b.copies;
    }
    EXPECT_EQ(pinned > 0, plan.execution.offloaded_numel > 0 || plan.zero.offload_param.device != OffloadDevice::none);
    if (c.grads_leave) {
      EXPECT_EQ(plan.execution.find_anywhere(BufferRole::grads)->place, Place::host);
    }
    // Bytes per step between the places, as the separate device counted them crossing (rank 0's
    // metrics.jsonl), against the plan's table.
    double planned = 0;
    for (const Transfer& t : plan.execution.transfers) planned += t.bytes_per_step;
    ASSERT_EQ(moved.size(), 4u);
    for (size_t i = 0; i < moved.size(); ++i) EXPECT_DOUBLE_EQ(moved[i], planned) << "step " << i + 1;
    for (int r = 0; r < 2; ++r) {
      const RankRun& s = separate[static_cast<size_t>(r)];
      if (r == 0) {  // (rank 0's plan)
        EXPECT_GE(s.pinned_bytes, pinned);
        EXPECT_LE(s.pinned_bytes, pinned + 64.0 * pinned_buffers);
      }
      // Copies to the device from page-locked buffers (not every case has one: a converting copy blocks): each was
      // checked for a host write racing it (train_ranks).
      if (pinned == 0) {
        EXPECT_EQ(s.pinned_copies, 0) << "rank " << r;
      }
      pinned_copies_seen += s.pinned_copies;
      // The same numbers: the weights the optimizer's kernel rounds in place on the CPU are copied (and
      // rounded the same way) on a device the host cannot reach.
      EXPECT_EQ(cpu[static_cast<size_t>(r)].result.losses, s.result.losses) << "rank " << r;
      ASSERT_EQ(s.result.losses.size(), 4u);
      // Every kernel ran on the place its buffers are: the gradient norm where the gradients are (on the
      // host once they leave block by block), an offloaded optimizer on the host (its table refuses a device
      // pointer), a kept one on the device.
      EXPECT_EQ(s.device_kernels > 0, !c.grads_leave);
      const bool offloaded = plan.execution.offloaded_numel > 0;
      EXPECT_EQ(s.host_kernels > 0, offloaded);
      // The checkpoint at the end: states the host cannot address cross to it through counted copies
      // (fp32 master and two moments of every element kept on the device).
      const double kept_states = 12.0 * static_cast<double>(plan.execution.local_numel - plan.execution.offloaded_numel);
      if (plan.zero.offload_param.device != OffloadDevice::none) {
        // Each direction moved at least its four steps' worth (the start and the checkpoint add to both).
        for (const auto& [from, to] : {std::pair{Place::host, Place::device}, std::pair{Place::device, Place::host}}) {
          double per_step = 0;
          for (const Transfer& t : plan.execution.transfers)
            if (t.from == from && t.to == to) per_step += t.bytes_per_step;
          EXPECT_GT(per_step, 0);
          EXPECT_GE(ledger_bytes(s.transfers, from, to), 4 * per_step) << place_name(from) << " -> " << place_name(to);
        }
        continue;
      }
      if (!offloaded) {
        EXPECT_DOUBLE_EQ(ledger_bytes(s.transfers, Place::device, Place::host), kept_states);
        continue;
      }
      // Over the whole run: the gradients out at every step; the weights back at every step and once at
      // the start (drawn into the host's master copy, then published).
      const double grads_out = plan.execution.transfers[0].bytes_per_step;
      double weights_back = 0;
      for (const Transfer& t : plan.execution.transfers)
        if (t.from != Place::nvme && t.to == Place::device) weights_back = t.bytes_per_step;
      EXPECT_DOUBLE_EQ(ledger_bytes(s.transfers, Place::device, Place::host), 4 * grads_out + kept_states);
      if (plan.execution.offloaded_numel == plan.execution.local_numel) {  // partial: the kept part is drawn on the device too
        EXPECT_DOUBLE_EQ(ledger_bytes(s.transfers, Place::host, Place::device), 5 * weights_back);
      }
    }
  }
  EXPECT_GT(pinned_copies_seen, 0);  // (the race check had copies to look at)
  fs::remove_all(root);
}

// An NVMe sub-group read into the host's buffers is stepped there in windows, each window's bf16 weights staged
// and copied to the device while the next is stepped, so the page-locked staging holds a window, not a sub-group.
// The planner windows only sub-groups above kMostStagingTile (16M elements); here the plan is cut finer, into
// windows of at most 700 of the 20,000-element sub-groups, as the planner would at that size. The run equals the
// CPU's bit for bit (the cuts fall on the kernels' grain) and moves the plan's bytes; the test device's copy stream
// refuses a window's weights written into a staging buffer a copy may still be reading. With the gradients leaving
// the device block by block, and kept there until the step (each window's copied over beside its states).
TEST(DeviceSeam, AnNvmeSubGroupIsSteppedInWindowsAsTheCpuStepsItWhole) {
  const fs::path root = fs::temp_directory_path() / ("ds_device_windows_" + std::to_string(::getpid()));
  const fs::path nvme = root / "nvme";
  fs::create_directories(nvme);
  constexpr int64_t kWindow = 700;
  const PlanEdit windows = [](Plan& plan) {
    ZeroExecution& z = plan.execution;
    z.weight_tiles = staging_windows(z.sub_groups, optimizer_runs(plan.layout, plan.topology.rank, false), kWindow);
    int64_t most = 0;
    for (const SubGroup& w : z.weight_tiles) most = std::max(most, w.numel());
    for (ZeroBuffer& b : z.buffers)
      if (b.role == BufferRole::weights_staging) b.elements = most, b.copies = 2;
  };
  const std::vector<std::string> o{"zero_optimization.stage=3", "bf16.enabled=true", "zero_optimization.offload_optimizer.device=nvme",
                                   "zero_optimization.offload_optimizer.nvme_path=" + nvme.string(), "zero_optimization.sub_group_size=20000",
                                   "train.output_dir=" + (root / "run").string()};
  for (const bool grads_leave : {true, false}) {
    SCOPED_TRACE(grads_leave ? "gradients leaving block by block" : "gradients kept on the device until the step");
    const Plan plan = plan_for(2, 0, o, grads_leave, /*separate=*/true, windows);
    ASSERT_EQ(plan.execution.state_spans.front().weights, WeightsBack::staged);
    ASSERT_GT(plan.execution.sub_groups.size(), 1u);
    EXPECT_GT(plan.execution.weight_tiles.size(), 3 * plan.execution.sub_groups.size());
    for (const SubGroup& w : plan.execution.weight_tiles) EXPECT_LE(w.numel(), kWindow);
    EXPECT_EQ(plan.execution.find(BufferRole::offload_grads, Place::host) != nullptr, !grads_leave);
    const std::vector<RankRun> cpu = train_ranks(2, o, false, "", grads_leave);
    fs::remove_all(root / "run");
    const std::vector<RankRun> separate = train_ranks(2, o, true, "", grads_leave, windows);
    std::vector<double> moved;
    std::ifstream metrics(root / "run" / "metrics.jsonl");
    for (std::string line; std::getline(metrics, line);) moved.push_back(nlohmann::json::parse(line)["offload_bytes"].get<double>());
    fs::remove_all(root / "run");
    double planned = 0;
    for (const Transfer& t : plan.execution.transfers) planned += t.bytes_per_step;
    ASSERT_EQ(moved.size(), 4u);
    for (size_t i = 0; i < moved.size(); ++i) EXPECT_DOUBLE_EQ(moved[i], planned) << "step " << i + 1;
    for (int r = 0; r < 2; ++r) {
      ASSERT_EQ(separate[static_cast<size_t>(r)].result.losses.size(), 4u);
      EXPECT_EQ(cpu[static_cast<size_t>(r)].result.losses, separate[static_cast<size_t>(r)].result.losses) << "rank " << r;
    }
  }
  fs::remove_all(root);
}

// On a device with memory of its own, a step whose states stay there keeps its figures there too: the loss, the norm
// agreed over the ranks, DeepSpeed's clipping and the skip on inf/NaN gradients are decided on the device and read by
// the host once, at the step's end (one queued sum of squares a step). The runs equal the
// CPU's, which decides on the host, bit for bit: losses, norms, loss scales, skips, with fp16's dynamic scale
// skipping its way down from 2^20, a static scale that is no power of two, and the partitioned norms of stages 1-3
// over two ranks, Adam and SGD.
TEST(DeviceSeam, AStepsNormClippingAndSkipsDecidedOnTheDeviceEqualTheHosts) {
  const fs::path root = fs::temp_directory_path() / ("ds_device_figures_" + std::to_string(::getpid()));
  struct Case {
    std::string name;
    int world;
    std::vector<std::string> overrides;
  };
  const std::vector<Case> cases{
      {"fp16, dynamic scale from 2^20, clipped, one rank",
       1, {"fp16.enabled=true", "fp16.initial_scale_power=20", "fp16.hysteresis=1", "gradient_clipping=0.05", "train.steps=10"}},
      {"fp16, static scale 1000, clipped, stage 1", 2, {"fp16.enabled=true", "fp16.loss_scale=1000", "gradient_clipping=0.1", "zero_optimization.stage=1"}},
      {"bf16, SGD with momentum, clipped, stage 2",
       2, {"bf16.enabled=true", "optimizer.type=SGD", "optimizer.params.momentum=0.9", "gradient_clipping=0.01", "zero_optimization.stage=2"}},
      {"fp32, two micro steps, stage 3", 2, {"bf16.enabled=false", "gradient_accumulation_steps=2", "zero_optimization.stage=3"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<std::string> o{"train.output_dir=" + (root / "run").string()};
    o.insert(o.end(), c.overrides.begin(), c.overrides.end());
    // rank 0's metrics.jsonl, per step: the figures the step decided on
    const auto figures = [&] {
      std::vector<std::string> lines;
      std::ifstream metrics(root / "run" / "metrics.jsonl");
      for (std::string line; std::getline(metrics, line);) {
        const nlohmann::json j = nlohmann::json::parse(line);
        lines.push_back(j["loss"].dump() + " " + j["grad_norm"].dump() + " " + j["skipped"].dump() + " " + j.value("loss_scale", nlohmann::json()).dump());
      }
      fs::remove_all(root);
      return lines;
    };
    const std::vector<RankRun> cpu = train_ranks(c.world, o, false);
    const std::vector<std::string> on_host = figures();
    const std::vector<RankRun> separate = train_ranks(c.world, o, true);
    const std::vector<std::string> on_device = figures();
    const Plan plan = plan_for(c.world, 0, o, false, true);
    ASSERT_EQ(on_device.size(), static_cast<size_t>(plan.steps));
    EXPECT_EQ(on_host, on_device);
    for (size_t r = 0; r < cpu.size(); ++r) {
      EXPECT_EQ(cpu[r].result.losses, separate[r].result.losses) << "rank " << r;
      EXPECT_EQ(cpu[r].result.skipped_steps, separate[r].result.skipped_steps) << "rank " << r;
      EXPECT_EQ(separate[r].queued_sums, plan.steps) << "rank " << r;  // (the device's route was taken)
    }
    if (c.name.rfind("fp16, dynamic", 0) == 0) {  // the skips and the steps after them both ran
      EXPECT_GT(separate[0].result.skipped_steps, 0);
      EXPECT_LT(separate[0].result.skipped_steps, plan.steps);
    }
  }
  fs::remove_all(root);
}

// Without a loss scaler a non-finite loss ends the run; decided on the device, the step writes nothing and the run ends
// at the step's end with the host's message, naming the same step. With the parameters on the host the step's figures
// are the host's again (its weights' copies wait anyway): no queued sum.
TEST(DeviceSeam, ANonFiniteLossEndsTheRunAtTheSameStepWhereverItIsDecided) {
  const fs::path root = fs::temp_directory_path() / ("ds_device_nonfinite_" + std::to_string(::getpid()));
  const std::vector<std::string> o{"train.output_dir=" + (root / "run").string(), "optimizer.params.lr=1e30", "bf16.enabled=false",
                                    "train.steps=6"};
  std::string errors[2];
  for (const bool separate : {false, true}) {
    const Plan plan = plan_for(1, 0, o, false, separate);
    TrainOptions opt;
    opt.print_every = 1000;
    std::unique_ptr<Device> device = separate ? std::make_unique<SeparateMemoryDevice>() : Device::create(DeviceKind::cpu, 0);
    try {
      train(plan, opt, nullptr, device.get());
    } catch (const std::exception& e) {
      errors[separate] = e.what();
    }
    if (separate) {
      EXPECT_GT(static_cast<SeparateMemoryDevice&>(*device).queued_sums(), 0);
    }
    fs::remove_all(root);
  }
  EXPECT_NE(errors[0].find("the loss or gradient became"), std::string::npos) << errors[0];
  EXPECT_EQ(errors[0], errors[1]);
  const std::vector<std::string> on_host{"zero_optimization.stage=3", "zero_optimization.offload_param.device=cpu",
                                         "train.output_dir=" + (root / "run").string()};
  const std::vector<RankRun> runs = train_ranks(1, on_host, true);
  fs::remove_all(root);
  EXPECT_EQ(runs[0].queued_sums, 0);
  EXPECT_EQ(runs[0].result.losses, train_ranks(1, on_host, false)[0].result.losses);
  fs::remove_all(root);
}

// Ctrl-C on one rank while the device holds its step's figures: the stop travels in the figures the device all-reduces,
// so every rank reads it at the next step's end and stops there, with a checkpoint, having trained what the
// uninterrupted run trained up to then.
TEST(DeviceSeam, AStopAgreedOnTheDeviceEndsEveryRankAfterTheSameStep) {
  const fs::path root = fs::temp_directory_path() / ("ds_device_stop_" + std::to_string(::getpid()));
  const std::vector<std::string> o{"train.output_dir=" + (root / "run").string(), "train.steps=6", "zero_optimization.stage=1"};
  const std::vector<RankRun> whole = train_ranks(2, o, false);
  fs::remove_all(root);
  const std::vector<RankRun> stopped = train_ranks(2, o, true, "", false, {}, [](int rank, TrainOptions& opt, Device& device) {
    if (rank != 0) return;
    opt.set_stop_handler = &take_stop_handler;
    static_cast<SeparateMemoryDevice&>(device).stop_during_queued_sum(2);  // during step 2, before its figures are agreed
  });
  g_run_stop_handler = nullptr;
  for (size_t r = 0; r < stopped.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const TrainResult& s = stopped[r].result;
    EXPECT_TRUE(s.interrupted);
    EXPECT_EQ(s.stop_signal, SIGINT);
    EXPECT_EQ(s.steps, 3);  // step 2's figures were agreed without it; step 3's carried it
    ASSERT_EQ(s.losses.size(), 3u);
    EXPECT_EQ(s.losses, std::vector<double>(whole[r].result.losses.begin(), whole[r].result.losses.begin() + 3));
    EXPECT_EQ(stopped[r].queued_sums, 3);  // (the device's route was taken)
  }
  EXPECT_FALSE(stopped[0].result.last_checkpoint.empty());
  EXPECT_TRUE(fs::exists(stopped[0].result.last_checkpoint)) << stopped[0].result.last_checkpoint;
  fs::remove_all(root);
}

// Fine-tuning data whose step trains no token (its one sample's prompt fills the row): the host knows it from the batch,
// so the device runs no update, and the step is skipped with the host's note; the run goes on as on the CPU, bit for bit.
TEST(DeviceSeam, AStepThatTrainsNoTokenIsSkippedOnTheDeviceAsOnTheHost) {
  const fs::path root = fs::temp_directory_path() / ("ds_device_untrained_" + std::to_string(::getpid()));
  fs::create_directories(root);
  {
    std::ofstream f(root / "data.jsonl");
    f << "{\"prompt\": \"" << std::string(300, 'x') << "\", \"completion\": \" done\"}\n";
    for (int i = 0; i < 20; ++i) f << "{\"prompt\": \"What is " << i << "?\", \"completion\": \" " << i << ".\"}\n";
  }
  const std::string sft = std::string(DS_SOURCE_DIR) + "/examples/data/sft";
  const std::vector<std::string> o{"train.output_dir=" + (root / "run").string(), "model.preset=qwen2-tiny", "model.vocab_size=320",
                                   "data.type=jsonl", "data.path=" + (root / "data.jsonl").string(), "data.tokenizer=hf",
                                   "data.tokenizer_path=" + sft, "data.chat_template=auto", "data.seq_len=64", "data.shuffle=false",
                                   "train_micro_batch_size_per_gpu=1", "gradient_clipping=1.0", "train.steps=3"};
  const auto metrics = [&] {
    std::vector<std::string> lines;
    std::ifstream in(root / "run" / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      lines.push_back(j["loss"].dump() + " " + j["grad_norm"].dump() + " " + j["skipped"].dump() + " " + j["trained_tokens"].dump());
    }
    fs::remove_all(root / "run");
    return lines;
  };
  const std::vector<RankRun> cpu = train_ranks(1, o, false);
  const std::vector<std::string> on_host = metrics();
  const std::vector<RankRun> separate = train_ranks(1, o, true);
  const std::vector<std::string> on_device = metrics();
  fs::remove_all(root);
  ASSERT_EQ(on_device.size(), 3u);
  EXPECT_EQ(on_host, on_device);
  EXPECT_EQ(on_device[0].substr(on_device[0].rfind(' ')), " 0");  // step 1 trained no token
  EXPECT_EQ(cpu[0].result.skipped_steps, 1);
  EXPECT_EQ(separate[0].result.skipped_steps, 1);
  EXPECT_EQ(cpu[0].result.losses, separate[0].result.losses);
  EXPECT_EQ(separate[0].queued_sums, 3);  // (the device's route was taken, the skipped step's figures included)
}

// Where this rank's gradients arrive on the host block by block (ZeRO-Offload from a GPU), the step's sum takes each
// segment's first arrival as a copy and adds the later ones, never zeroed whole: the same run as the gradients
// summed on the device, bit for bit, with one micro step a step or three, at stages 2 and 3.
TEST(DeviceSeam, GradientsSummedOnTheHostAsTheyArriveEqualTheDevicesSum) {
  const fs::path root = fs::temp_directory_path() / ("ds_device_sums_" + std::to_string(::getpid()));
  for (const char* stage : {"zero_optimization.stage=2", "zero_optimization.stage=3"})
    for (const char* accumulation : {"gradient_accumulation_steps=1", "gradient_accumulation_steps=3"}) {
      SCOPED_TRACE(std::string(stage) + ", " + accumulation);
      const std::vector<std::string> o{stage, accumulation, "bf16.enabled=true", "zero_optimization.offload_optimizer.device=cpu",
                                       "train.output_dir=" + (root / "run").string()};
      EXPECT_EQ(plan_for(2, 0, o, /*grads_leave=*/true, true).execution.find_anywhere(BufferRole::grads)->place, Place::host);
      const std::vector<RankRun> on_host = train_ranks(2, o, true, "", /*grads_leave=*/true);
      fs::remove_all(root);
      const std::vector<RankRun> on_device = train_ranks(2, o, true, "", /*grads_leave=*/false);
      fs::remove_all(root);
      for (size_t r = 0; r < 2; ++r) {
        ASSERT_EQ(on_host[r].result.losses.size(), 4u);
        EXPECT_EQ(on_host[r].result.losses, on_device[r].result.losses) << "rank " << r;
      }
    }
}

// One rank of a GPU-like device whose gradients leave block by block for the host (ZeRO-Offload, stage 2). With
// overlap_comm each block's gradients are queued for page-locked host memory whole in its hook (on the copy stream to
// the host, once the hook's sum is done), into the next of gradient_lag + 1 buffers, ordered after the compute stream's point just after that block's backward only;
// the host sums them in the hook of the block gradient_lag + 1 below. The test device lands such a copy only once the
// host waits for it (or the compute stream does, before the block two below writes the buffer again): a sum read
// before, or a buffer zeroed before its copy left, would change the losses; each landed after the compute stream had
// been given more (a GPU runs it beside that). Landing each as it is queued instead (the order a GPU may also take), a
// buffer taken again before its sum would change them. The parameters outside the blocks leave tensor by tensor once
// the backward has ended, each copy after its group's point. Without overlap_comm each copy waits for everything
// queued, the host for each. Six blocks, two micro steps a step (lag 3 sums three blocks inside hooks each backward);
// the same run at every lag as without, bit for bit (the CPU's own run accumulates two micro steps in another order:
// DeviceSeam.GradientsSummedOnTheHostAsTheyArriveEqualTheDevicesSum holds the host's sums to the device's).
TEST(DeviceSeam, WithOverlapCommABlocksGradientsLandWhileTheHostSumsTheBlocksAbove) {
  const fs::path root = fs::temp_directory_path() / ("ds_device_arrivals_" + std::to_string(::getpid()));
  const std::vector<std::string> base{"zero_optimization.stage=2", "bf16.enabled=true", "zero_optimization.offload_optimizer.device=cpu",
                                      "model.num_layers=6", "gradient_accumulation_steps=2", "train.output_dir=" + (root / "run").string()};
  std::vector<double> serial;  // (lag 0's: each copy awaited at once)
  for (const bool at_once : {false, true})
    for (const int64_t lag : {0, 1, 2, 3}) {  // (0: without overlap_comm)
      SCOPED_TRACE("gradient lag " + std::to_string(lag) + (at_once ? ", arrivals landing as queued" : ", arrivals landing when waited for"));
      const bool overlapped = lag > 0;
      if (at_once && !overlapped) continue;
      std::vector<std::string> o = base;
      o.push_back(overlapped ? "zero_optimization.overlap_comm=true" : "zero_optimization.overlap_comm=false");
      const PlanEdit edit = [lag](Plan& p) {
        if (lag > 1) set_gradient_lag(p.execution, lag);
      };
      const Plan plan = plan_for(1, 0, o, /*grads_leave=*/true, /*separate=*/true, edit);
      ASSERT_EQ(plan.execution.find_anywhere(BufferRole::grads)->place, Place::host);
      ASSERT_TRUE(plan.execution.grouped);
      EXPECT_EQ(plan.execution.overlap, overlapped);
      EXPECT_EQ(plan.execution.gradient_lag, lag);  // (1 unless the speculative step's choice lengthens it)
      const ZeroBuffer* arrivals = plan.execution.find(BufferRole::block_arrivals, Place::host);
      ASSERT_EQ(arrivals != nullptr, overlapped);
      if (arrivals) {
        EXPECT_EQ(arrivals->copies, lag + 1);
        EXPECT_TRUE(arrivals->pinned);
      }
      std::set<int> blocks;
      int64_t outer = 0;
      for (const ParamSlot& s : plan.layout.params) s.layer >= 0 ? void(blocks.insert(s.layer)) : void(++outer);
      const int64_t per_micro_blocks = static_cast<int64_t>(blocks.size()), tensors = static_cast<int64_t>(plan.layout.params.size());
      ASSERT_EQ(per_micro_blocks, 6);
      const int64_t micro_steps = 4 * 2;
      const std::vector<RankRun> run = train_ranks(1, o, true, "", /*grads_leave=*/true, edit, [at_once](int, TrainOptions&, Device& d) {
        static_cast<SeparateMemoryDevice&>(d).arrivals_land_at_once = at_once;
      });
      fs::remove_all(root);
      ASSERT_EQ(run[0].result.losses.size(), 4u);
      // Each micro step: a copy per block (landing late) and per tensor outside them with overlap_comm; per tensor without.
      EXPECT_EQ(run[0].transfers.at({Place::device, Place::host}).copies, micro_steps * (overlapped ? per_micro_blocks + outer : tensors));
      EXPECT_EQ(run[0].arrivals_ahead, overlapped ? micro_steps * per_micro_blocks : 0);
      EXPECT_EQ(run[0].arrivals_landed_late, overlapped && !at_once ? micro_steps * per_micro_blocks : 0);
      EXPECT_EQ(run[0].arrivals_beside_compute, overlapped ? micro_steps * outer : 0);
      if (!overlapped) serial = run[0].result.losses;
      EXPECT_EQ(run[0].result.losses, serial);
    }
}

// Stage 3 on one rank of a GPU-like device with the parameters in host memory: each block's partitions cross to the
// device ahead (Device::copy_ahead), the next block's while the current one runs, and the compute stream waits for
// them only as the block's gather finishes. The test device lands such a copy's bytes only then, so a block that ran
// before its copy was waited for would read stale weights: the run equals the CPU's bit for bit. Several ranks
// gather through a collective that reads the copy: there every copy is waited for at once.
// overlap_comm with a block between two trained ones that trains nothing (frozen): the block below it writes its
// gradients into the buffer of the same parity as the block above, whose reduce (or copy out) must have left it
// first. The same run with overlap_comm as without it, bit for bit: two CPU ranks at stage 2, and one rank of a
// GPU-like device whose gradients leave for the host.
TEST(DeviceSeam, AFrozenBlockBetweenTrainedOnesLeavesOverlappedGradientsWhole) {
  const fs::path root = fs::temp_directory_path() / ("ds_device_frozen_middle_" + std::to_string(::getpid()));
  for (const char* frozen : {R"(model.freeze=["transformer.h.1.*"])", R"(model.freeze=["transformer.h.2.*"])"})
    for (const int world : {2, 1}) {
      SCOPED_TRACE(std::string(frozen) + (world == 2 ? ", two CPU ranks" : ", one rank, gradients leaving for the host"));
      std::vector<std::vector<double>> losses;
      for (const char* overlap : {"zero_optimization.overlap_comm=true", "zero_optimization.overlap_comm=false"}) {
        std::vector<std::string> o{overlap, frozen, "model.num_layers=4", "zero_optimization.stage=2", "bf16.enabled=true",
                                   "train.output_dir=" + (root / "run").string()};
        if (world == 1) o.push_back("zero_optimization.offload_optimizer.device=cpu");
        EXPECT_EQ(plan_for(world, 0, o, world == 1, world == 1).execution.overlap, std::string(overlap).find("true") != std::string::npos);
        const std::vector<RankRun> run = train_ranks(world, o, /*separate=*/world == 1, "", /*grads_leave=*/world == 1);
        fs::remove_all(root);
        ASSERT_EQ(run[0].result.losses.size(), 4u);
        losses.push_back(run[0].result.losses);
      }
      EXPECT_EQ(losses[0], losses[1]);
    }
}

TEST(DeviceSeam, OneRanksOffloadedParametersCrossAheadAndAreWaitedForAsTheirBlockIsGathered) {
  const fs::path root = fs::temp_directory_path() / ("ds_device_ahead_" + std::to_string(::getpid()));
  struct Case {
    std::string name;
    bool optimizer_offloaded;  // (its gradients' copies to the host make the host wait for every copy queued before)
    std::optional<CommBackend> backend;
  };
  int64_t ahead = 0;
  for (const Case& c : {Case{"optimizer on the host", true, {}}, Case{"optimizer on the device", false, {}},
                        Case{"optimizer on the device, NCCL's capabilities (a GPU's)", false, CommBackend::nccl}}) {
    SCOPED_TRACE(c.name);
    std::vector<std::string> o{"zero_optimization.stage=3", "bf16.enabled=true", "zero_optimization.offload_param.device=cpu",
                               "gradient_accumulation_steps=2", "train.output_dir=" + (root / "run").string()};
    if (c.optimizer_offloaded) o.push_back("zero_optimization.offload_optimizer.device=cpu");
    const Plan plan = plan_for(1, 0, o, /*grads_leave=*/c.optimizer_offloaded, /*separate=*/true, {}, c.backend);
    ASSERT_TRUE(plan.execution.gathers);
    // One rank gathers from no other: even over NCCL (whose collectives want equal pieces) its partitions go
    // straight to the block, with no staging buffer and no copy out of one.
    EXPECT_FALSE(plan.execution.gather_staged);
    EXPECT_EQ(plan.execution.find(BufferRole::gather_staging), nullptr);
    const std::vector<RankRun> separate = train_ranks(1, o, true, "", c.optimizer_offloaded, {}, {}, c.backend);
    fs::remove_all(root);
    const std::vector<RankRun> cpu = train_ranks(1, o, false, "", c.optimizer_offloaded);
    fs::remove_all(root);
    ASSERT_EQ(separate[0].result.losses.size(), 4u);
    EXPECT_EQ(separate[0].result.losses, cpu[0].result.losses);
    const TransferStats& in = separate[0].transfers.at({Place::host, Place::device});
    EXPECT_GT(in.ahead, 0);
    // With the optimizer on the host every copy to the device is a gather's (the host steps the parameters where they
    // are); with it on the device, its states' first copies from the host are not. The gathers are the same copies.
    if (c.optimizer_offloaded) {
      EXPECT_EQ(in.ahead, in.copies);
      ahead = in.ahead;
    } else {
      EXPECT_EQ(in.ahead, ahead);
    }
  }
  const std::vector<std::string> o{"zero_optimization.stage=3", "bf16.enabled=true", "zero_optimization.offload_param.device=cpu",
                                   "train.output_dir=" + (root / "run").string()};
  const std::vector<RankRun> ranks = train_ranks(2, o, true);
  fs::remove_all(root);
  EXPECT_GT(ranks[0].transfers.at({Place::host, Place::device}).copies, 0);
  EXPECT_EQ(ranks[0].transfers.at({Place::host, Place::device}).ahead, 0);
}

TEST(DeviceSeam, CheckpointsOfStatesTheHostCannotAddressCrossThroughCountedCopiesAndResume) {
  // On a device the host may not address, a checkpoint is written from host copies of the states and read
  // back into host memory first: the bytes show in the device's ledger, and a run resumed from step 2 on it
  // ends where the straight run on the CPU device ends, bit for bit (ZeRO-2 on 2 thread ranks, bf16, and
  // with 40% of the states offloaded at stage 3: both places in one shard; and with the parameters on NVMe).
  const fs::path root = fs::temp_directory_path() / ("ds_device_ckpt_" + std::to_string(::getpid()));
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{"zero_optimization.stage=2"},
        std::vector<std::string>{"zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=cpu",
                                 "zero_optimization.offload_optimizer.ratio=0.4"},
        std::vector<std::string>{"zero_optimization.stage=3", "zero_optimization.offload_param.device=nvme",
                                 "zero_optimization.offload_param.nvme_path=" + root.string(), "zero_optimization.offload_optimizer.device=cpu",
                                 "zero_optimization.offload_optimizer.ratio=0.4"}}) {
    SCOPED_TRACE(extra.back());
    fs::create_directories(root);  // the NVMe case's swap folder
    std::vector<std::string> o{"bf16.enabled=true", "train.save_every=2", "train.output_dir=" + (root / "straight").string()};
    o.insert(o.end(), extra.begin(), extra.end());
    const std::vector<RankRun> straight = train_ranks(2, o, false);
    o[2] = "train.output_dir=" + (root / "resumed").string();
    const std::vector<RankRun> first = train_ranks(2, o, true);
    const Plan plan = plan_for(2, 0, o);
    const double device_states = 12.0 * static_cast<double>(plan.execution.local_numel - plan.execution.offloaded_numel);
    // Two checkpoints (steps 2 and 4) drawn through the host, beside each step's own crossings (the gradients
    // out; with the parameters offloaded, the weights stepped on the device to the file, once more at the start).
    double per_step = 0, stepped = 0;
    for (const Transfer& t : plan.execution.transfers) {
      if (t.from == Place::device && t.to == Place::host) per_step += t.bytes_per_step;
      if (t.what == "stepped weights to the host") stepped = t.bytes_per_step;
    }
    EXPECT_EQ(stepped > 0, plan.zero.offload_param.device != OffloadDevice::none);
    EXPECT_DOUBLE_EQ(ledger_bytes(first[0].transfers, Place::device, Place::host), 2 * device_states + 4 * per_step + stepped);
    o[2] = "train.output_dir=" + (root / "continued").string();
    const std::vector<RankRun> resumed = train_ranks(2, o, true, (root / "resumed" / "checkpoints" / "step_00000002").string());
    ASSERT_EQ(resumed[0].result.losses.size(), 2u);
    EXPECT_EQ(resumed[0].result.losses[0], straight[0].result.losses[2]);
    EXPECT_EQ(resumed[0].result.losses[1], straight[0].result.losses[3]);
    // The resume read the states into host memory and copied them over.
    EXPECT_GE(ledger_bytes(resumed[0].transfers, Place::host, Place::device), device_states);
    fs::remove_all(root);
  }
}

// ZeRO-Offload on one rank of a GPU-like device: the host steps the tiles the forward reads before its first block at
// once and leaves every other tile to the next forward, stepping each before the first block hook that reads it
// (the block its first element lies in; after the last block for the final norm and an untied head). The runs equal
// the CPU's, which steps every tile at once, bit for bit (losses, validation losses, a run resumed from a checkpoint
// taken with tiles pending); each step moves the plan's bytes (a pending tile's weights counted in the step that
// updated them); the forwards stepped every pending tile of the three updates before the last, each tile's copy
// ordered only after its update's start (beside the blocks before it); the test device saw no host write into a
// staging buffer a copy was still reading.
TEST(DeviceSeam, TheHostStepsOffloadedTilesDuringTheNextForwardAsTheCpuStepsThemAtOnce) {
  const fs::path root = fs::temp_directory_path() / ("ds_device_in_forward_" + std::to_string(::getpid()));
  struct Case {
    std::string name;
    std::vector<std::string> overrides;
    bool grads_leave = false;
  };
  const std::vector<Case> cases{
      {"stage 2, gradients leaving block by block", {"zero_optimization.stage=2", "zero_optimization.sub_group_size=20000"}, true},
      {"stage 1, gradients kept on the device, two micro steps, validation",
       {"zero_optimization.stage=1", "zero_optimization.sub_group_size=20000", "gradient_accumulation_steps=2", "train.eval_every=2",
        "data.val_fraction=0.2"}},
      {"llama, untied head after the blocks",
       {"model.preset=llama-tiny", "zero_optimization.stage=2", "zero_optimization.sub_group_size=15000"}, true},
      {"stage 3, half offloaded (ratio 0.5): the device steps the rest at once",
       {"zero_optimization.stage=3", "zero_optimization.offload_optimizer.ratio=0.5", "zero_optimization.sub_group_size=10000"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<std::string> o{"bf16.enabled=true", "zero_optimization.offload_optimizer.device=cpu", "train.save_every=2",
                               "train.output_dir=" + (root / "cpu").string()};
    o.insert(o.end(), c.overrides.begin(), c.overrides.end());
    const Plan plan = plan_for(1, 0, o, c.grads_leave, /*separate=*/true);
    const ZeroExecution& z = plan.execution;
    ASSERT_TRUE(z.step_in_forward);
    // Which tiles wait, independently of the plan's hooks: those beginning at or after the first trained block's first element.
    int64_t first_block = plan.layout.numel, blocks_end = 0;
    for (const ParamSlot& p : plan.layout.params)
      if (p.layer >= 0) first_block = std::min(first_block, p.offset), blocks_end = std::max(blocks_end, p.offset + p.numel);
    int64_t waiting = 0, after_blocks = 0;
    for (const SubGroup& t : z.weight_tiles) waiting += t.begin >= first_block, after_blocks += t.begin >= blocks_end;
    ASSERT_EQ(z.weight_tile_hooks.size(), z.weight_tiles.size());
    EXPECT_EQ(std::count_if(z.weight_tile_hooks.begin(), z.weight_tile_hooks.end(), [](int64_t h) { return h >= 0; }), waiting);
    ASSERT_GT(waiting, 0);
    ASSERT_LT(waiting, static_cast<int64_t>(z.weight_tiles.size()));  // (the embeddings' tiles are stepped at once)
    if (c.name.rfind("llama", 0) == 0) {
      EXPECT_GT(after_blocks, 0);  // (the head's own tile, stepped after the last block)
    }
    // Not where nothing would overlap: the CPU device's (one memory), or two ranks' shards (published to each other first).
    EXPECT_FALSE(plan_for(1, 0, o, c.grads_leave, /*separate=*/false).execution.step_in_forward);
    const Plan shards = plan_for(2, 0, o, c.grads_leave, /*separate=*/true);
    EXPECT_FALSE(shards.execution.step_in_forward);
    EXPECT_TRUE(shards.execution.weight_tile_hooks.empty());

    const std::vector<RankRun> cpu = train_ranks(1, o, false, "", c.grads_leave);
    o[3] = "train.output_dir=" + (root / "separate").string();
    const std::vector<RankRun> separate = train_ranks(1, o, true, "", c.grads_leave);
    ASSERT_EQ(separate[0].result.losses.size(), 4u);
    EXPECT_EQ(cpu[0].result.losses, separate[0].result.losses);
    EXPECT_EQ(cpu[0].result.val_losses, separate[0].result.val_losses);
    if (c.name.find("validation") != std::string::npos) {
      EXPECT_EQ(separate[0].result.val_losses.size(), 2u);
    }
    EXPECT_EQ(cpu[0].result.tiles_stepped_in_forward, 0);
    // Steps 1 and 3's updates left their tiles to steps 2 and 4's forwards; step 2's checkpoint (and validation) and
    // the run's end stepped steps 2 and 4's at once.
    EXPECT_EQ(separate[0].result.tiles_stepped_in_forward, 2 * waiting);
    // Each waiting tile's copy waits only for its update's start (the backward's reads of its old weights), not for
    // the compute queued since: the blocks before its own where the next forward steps it (steps 1 and 3's updates),
    // whatever ran after the update began where the checkpoint or the run's end steps it (steps 2 and 4's). The
    // tiles stepped at once wait for all the compute before them.
    EXPECT_EQ(separate[0].copies_beside_compute, 4 * waiting);
    double planned = 0;
    for (const Transfer& t : z.transfers) planned += t.bytes_per_step;
    std::vector<double> moved, deferred;
    std::ifstream metrics(root / "separate" / "metrics.jsonl");
    for (std::string line; std::getline(metrics, line);) {
      const nlohmann::json m = nlohmann::json::parse(line);
      moved.push_back(m["offload_bytes"].get<double>());
      deferred.push_back(m["deferred_step_s"].get<double>());
    }
    ASSERT_EQ(moved.size(), 4u);
    for (size_t i = 0; i < moved.size(); ++i) EXPECT_DOUBLE_EQ(moved[i], planned) << "step " << i + 1;
    // The host's time stepping tiles in a forward: steps 2 and 4's (steps 1 and 3's updates), none in steps 1 and 3
    // (the first, and the one after the checkpoint stepped what was left).
    EXPECT_EQ(deferred[0], 0);
    EXPECT_GT(deferred[1], 0);
    EXPECT_EQ(deferred[2], 0);
    EXPECT_GT(deferred[3], 0);
    // The checkpoint at step 2 was written with the second update's tiles stepped first: resumed, the run goes on as
    // the straight one did.
    o[3] = "train.output_dir=" + (root / "resumed").string();
    const std::vector<RankRun> resumed = train_ranks(1, o, true, (root / "separate" / "checkpoints" / "step_00000002").string(), c.grads_leave);
    ASSERT_EQ(resumed[0].result.losses.size(), 2u);
    EXPECT_EQ(resumed[0].result.losses[0], cpu[0].result.losses[2]);
    EXPECT_EQ(resumed[0].result.losses[1], cpu[0].result.losses[3]);
    fs::remove_all(root);
  }
}

// ZeRO-Offload's speculative step (offload_optimizer.speculative_step) on one rank of a GPU-like device whose gradients
// leave block by block: on each step's last micro step the host steps every weight tile lying wholly in the blocks as
// soon as the lowest block it holds has sent its gradients, during the backward of the blocks below, as if unclipped.
// Where the step can be undone (gradient_clipping, an overflow skip: bf16.check_grad_overflow, on by default) it backs up
// the tiles' master and moments first.
// The runs equal those without speculation bit for bit: with nothing to undo (no backup; every speculated tile
// stands), clipped every step (every one restored and stepped again), an overflow skipping step 2 (restored, their
// weights put back from the master), and a step the data says trains nothing (not speculated). Each step moves the
// plan's bytes, the copies of restored tiles and of the weights put back counted apart. Not planned where it has no
// effect (the CPU's one memory, two ranks), with a warning.
TEST(DeviceSeam, ASpeculativeStepDuringTheLastBackwardEqualsTheStepAfterIt) {
  const fs::path root = fs::temp_directory_path() / ("ds_device_speculative_" + std::to_string(::getpid()));
  fs::create_directories(root);
  {
    std::ofstream f(root / "data.jsonl");  // (the untrained case: step 1's one sample is all prompt)
    f << "{\"prompt\": \"" << std::string(300, 'x') << "\", \"completion\": \" done\"}\n";
    for (int i = 0; i < 20; ++i) f << "{\"prompt\": \"What is " << i << "?\", \"completion\": \" " << i << ".\"}\n";
  }
  const std::string sft = std::string(DS_SOURCE_DIR) + "/examples/data/sft";
  enum class Undo { nothing, clipped, overflow, untrained };
  struct Case {
    std::string name;
    std::vector<std::string> overrides;
    Undo undo = Undo::nothing;
  };
  const std::vector<Case> cases{
      {"stage 2, four blocks, two micro steps, nothing to undo",
       {"zero_optimization.stage=2", "model.num_layers=4", "zero_optimization.sub_group_size=15000", "gradient_accumulation_steps=2",
        "gradient_clipping=0", "bf16.check_grad_overflow=false"}},
      {"stage 2, clipped every step",
       {"zero_optimization.stage=2", "zero_optimization.sub_group_size=15000", "gradient_clipping=0.001"}, Undo::clipped},
      {"stage 2, each block recomputed, nothing to undo",
       {"zero_optimization.stage=2", "zero_optimization.sub_group_size=15000", "model.activation_checkpointing=true", "gradient_clipping=0",
        "bf16.check_grad_overflow=false"}},
      {"llama, stage 3, nothing to undo",
       {"model.preset=llama-tiny", "zero_optimization.stage=3", "zero_optimization.sub_group_size=15000", "gradient_clipping=0", "bf16.check_grad_overflow=false"}},
      {"stage 2, an overflow skips step 2",
       {"zero_optimization.stage=2", "zero_optimization.sub_group_size=15000", "gradient_clipping=0", "bf16.check_grad_overflow=true"},
       Undo::overflow},
      {"a step that trains no token",
       {"zero_optimization.stage=2", "zero_optimization.sub_group_size=20000", "model.preset=qwen2-tiny", "model.vocab_size=320",
        "data.type=jsonl", "data.path=" + (root / "data.jsonl").string(), "data.tokenizer=hf", "data.tokenizer_path=" + sft,
        "data.chat_template=auto", "data.seq_len=64", "data.shuffle=false", "train_micro_batch_size_per_gpu=1", "train.steps=3",
        "gradient_clipping=0", "bf16.check_grad_overflow=false"},
       Undo::untrained},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<std::string> o{"bf16.enabled=true", "zero_optimization.offload_optimizer.device=cpu", "zero_optimization.overlap_comm=true",
                               "train.output_dir=" + (root / "run").string()};
    o.insert(o.end(), c.overrides.begin(), c.overrides.end());
    std::vector<std::string> speculative = o;
    speculative.push_back("zero_optimization.offload_optimizer.speculative_step=true");
    const Plan plan = plan_for(1, 0, speculative, /*grads_leave=*/true, /*separate=*/true);
    const ZeroExecution& z = plan.execution;
    ASSERT_TRUE(z.step_in_backward);
    // Which tiles are speculated and after which block, independently of the plan: the lowest layer of the parameters a
    // tile overlaps, where none lies outside the blocks.
    ASSERT_EQ(z.weight_tile_final_after.size(), z.weight_tiles.size());
    int64_t tiles = 0, numel = 0;
    for (size_t t = 0; t < z.weight_tiles.size(); ++t) {
      int64_t lowest = plan.model.hp.num_layers;
      bool outside = false;
      for (const ParamSlot& p : plan.layout.params)
        if (p.offset < z.weight_tiles[t].end && p.offset + p.numel > z.weight_tiles[t].begin) {
          outside = outside || p.layer < 0;
          lowest = std::min<int64_t>(lowest, p.layer);
        }
      EXPECT_EQ(z.weight_tile_final_after[t], outside ? -1 : lowest) << "tile " << t;
      if (!outside) ++tiles, numel += z.weight_tiles[t].numel();
    }
    ASSERT_GT(tiles, 1);
    ASSERT_LT(tiles, static_cast<int64_t>(z.weight_tiles.size()));  // (the embeddings' tile is final only at the end)
    EXPECT_EQ(z.speculated_numel, numel);
    // A backup only where the step can be undone: AdamW's master and two moments of every speculated element.
    const bool undoable = c.undo == Undo::clipped || c.undo == Undo::overflow;
    EXPECT_EQ(z.speculation_backed_up, undoable);
    const ZeroBuffer* backup = z.find(BufferRole::step_backup, Place::host);
    ASSERT_EQ(backup != nullptr, undoable);
    if (backup) {
      EXPECT_EQ(backup->elements, numel);
      EXPECT_EQ(backup->copies, 3);
    }
    // Not where it would hide nothing (the CPU's one memory; without overlap_comm, where the host sums each block's
    // gradients before the GPU is given the next block's backward), nor on two ranks: warned, once.
    std::vector<std::string> serial = speculative;
    serial.push_back("zero_optimization.overlap_comm=false");
    for (const Plan& no : {plan_for(1, 0, speculative, true, /*separate=*/false), plan_for(2, 0, speculative, true, true),
                           plan_for(1, 0, serial, true, true)}) {
      EXPECT_FALSE(no.execution.step_in_backward);
      EXPECT_EQ(no.execution.find(BufferRole::step_backup, Place::host), nullptr);
      EXPECT_EQ(std::count_if(no.warnings.begin(), no.warnings.end(),
                              [](const ConfigIssue& w) { return w.path == "zero_optimization.offload_optimizer.speculative_step"; }),
                1);
    }
    EXPECT_FALSE(plan_for(1, 0, o, true, true).execution.step_in_backward);  // (off unless asked)

    // The overflow: step 2's norm (the host's one sum of the bf16 gradients a step) comes out infinite, in both runs.
    const RankPrepare overflow = [&](int, TrainOptions&, Device& d) {
      if (c.undo == Undo::overflow) static_cast<SeparateMemoryDevice&>(d).infinite_host_sums = {2};
    };
    const std::vector<RankRun> after = train_ranks(1, o, true, "", /*grads_leave=*/true, {}, overflow);
    fs::remove_all(root / "run");
    const std::vector<RankRun> during = train_ranks(1, speculative, true, "", /*grads_leave=*/true, {}, overflow);
    ASSERT_EQ(during[0].result.losses.size(), static_cast<size_t>(plan.steps));
    EXPECT_EQ(after[0].result.losses, during[0].result.losses);
    EXPECT_EQ(after[0].result.skipped_steps, during[0].result.skipped_steps);
    EXPECT_EQ(during[0].result.skipped_steps, c.undo == Undo::overflow || c.undo == Undo::untrained ? 1 : 0);
    EXPECT_TRUE(during[0].copy_races.empty()) << during[0].copy_races.front();
    // Each speculated tile's weights leave after its blocks' backward, not after the backward of the blocks below (queued
    // since): on a GPU they cross beside it.
    EXPECT_EQ(during[0].ahead_beside_compute, tiles * (plan.steps - (c.undo == Undo::untrained ? 1 : 0)));
    EXPECT_EQ(after[0].ahead_beside_compute, 0);
    // Each block's gradients start for the host (on the copy stream to it) before its hook steps the tiles final after
    // the block gradient_lag + 1 above: they wait behind none of the host's work, nor those tiles' copies.
    EXPECT_GT(during[0].arrivals_ahead, 0);
    EXPECT_EQ(during[0].arrivals_behind_host_steps, 0);
    double planned = 0, gradients = 0;
    for (const Transfer& t : z.transfers) {
      planned += t.bytes_per_step;
      if (t.from == Place::device) gradients += t.bytes_per_step;
    }
    const double speculated_bytes = static_cast<double>(numel) * 2;  // (the tiles' bf16 weights)
    std::ifstream metrics(root / "run" / "metrics.jsonl");
    int64_t step = 0;
    for (std::string line; std::getline(metrics, line); ++step) {
      SCOPED_TRACE("step " + std::to_string(step + 1));
      const nlohmann::json m = nlohmann::json::parse(line);
      const bool untrained = c.undo == Undo::untrained && step == 0, overflowed = c.undo == Undo::overflow && step == 1;
      EXPECT_EQ(m["skipped"].get<bool>(), untrained || overflowed);
      EXPECT_EQ(m["speculated_tiles"].get<int64_t>(), untrained ? 0 : tiles);
      EXPECT_EQ(m["restored_tiles"].get<int64_t>(), c.undo == Undo::clipped || overflowed ? tiles : 0);
      // Restored: the speculated copies; with no update, the weights put back as well. A skipped step moves only its
      // gradients, as without speculation.
      EXPECT_DOUBLE_EQ(m["speculation_bytes"].get<double>(), overflowed ? 2 * speculated_bytes : c.undo == Undo::clipped ? speculated_bytes : 0.0);
      EXPECT_DOUBLE_EQ(m["offload_bytes"].get<double>(), untrained || overflowed ? gradients : planned);
    }
    EXPECT_EQ(step, plan.steps);
    fs::remove_all(root / "run");
  }
  fs::remove_all(root);
}

// The host's offload work in each backward, as ds profile's spans show it (HostWorkSpan: a block's gradients waited
// for and summed, a speculated tile stepped, each with the block whose backward hook ran it), comes in the order the
// plan's prediction walks (host_work_in_last_backward): each block summed `gradient_lag` trained blocks late, in the
// hook of the block below, its tiles stepped right after, the last blocks after the backward. A block that trains
// nothing sums nothing in its hook where the gradients land late, and the block above's where they do not (lag 0,
// pageable arrivals). The earlier micro steps sum in the same order, stepping no tile.
TEST(DeviceSeam, TheHostsWorkInEachBackwardRunsInTheOrderThePredictionWalks) {
  const fs::path root = fs::temp_directory_path() / ("ds_device_host_order_" + std::to_string(::getpid()));
  struct Case {
    std::string name;
    std::vector<std::string> overrides;
    int64_t lag = 1;
  };
  const std::vector<std::string> speculative{"zero_optimization.offload_optimizer.speculative_step=true", "zero_optimization.sub_group_size=15000",
                                             "gradient_clipping=0", "bf16.check_grad_overflow=false"};
  const auto with = [&](std::vector<std::string> o, const std::vector<std::string>& more) {
    o.insert(o.end(), more.begin(), more.end());
    return o;
  };
  const std::vector<Case> cases{
      {"lag 1", {}},
      {"lag 3", {}, 3},
      {"the middle block frozen", {R"(model.freeze=["transformer.h.2.*"])"}},
      {"speculative, lag 1", speculative},
      {"speculative, lag 2", speculative, 2},
      {"speculative, a block frozen", with(speculative, {R"(model.freeze=["transformer.h.3.*"])"})},
      {"speculative, each block recomputed", with(speculative, {"model.activation_checkpointing=true"})},
      // (pageable arrivals: each block's gradients copied out and summed in the hook of the block below, lag 0)
      {"pageable", {"zero_optimization.offload_optimizer.pin_memory=false"}, 0},
      {"pageable, speculative, a block frozen",
       with(speculative, {"zero_optimization.offload_optimizer.pin_memory=false", R"(model.freeze=["transformer.h.2.*"])"}), 0},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<std::string> o{"zero_optimization.stage=2", "bf16.enabled=true", "zero_optimization.offload_optimizer.device=cpu",
                               "zero_optimization.overlap_comm=true", "model.num_layers=6", "gradient_accumulation_steps=2",
                               "flops_profiler.enabled=true", "train.output_dir=" + (root / "run").string()};
    o.insert(o.end(), c.overrides.begin(), c.overrides.end());
    const PlanEdit edit = [lag = c.lag](Plan& p) {
      if (lag > 1) set_gradient_lag(p.execution, lag);
    };
    const Plan plan = plan_for(1, 0, o, /*grads_leave=*/true, /*separate=*/true, edit);
    ASSERT_EQ(plan.execution.gradient_lag, c.lag);
    const bool speculating = c.name.find("speculative") != std::string::npos;
    ASSERT_EQ(plan.execution.step_in_backward, speculating);
    const std::vector<BackwardHostWork> walked = host_work_in_last_backward(plan);
    ASSERT_FALSE(walked.empty());
    const auto text = [](bool tile, int64_t index, int64_t hook) {
      return (tile ? "tile " : "block ") + std::to_string(index) + (hook >= 0 ? " in block " + std::to_string(hook) + "'s hook" : " after");
    };
    std::vector<std::string> last, earlier;  // the prediction's: the last micro step's, and without its tiles the others'
    for (const BackwardHostWork& w : walked) {
      last.push_back(text(w.tile, w.index, w.hook));
      if (!w.tile) earlier.push_back(last.back());
    }
    const std::vector<RankRun> run = train_ranks(1, o, /*separate=*/true, "", /*grads_leave=*/true, edit);
    fs::remove_all(root);
    const std::vector<std::vector<HostWorkSpan>>& steps = run[0].result.host_work_spans;
    ASSERT_EQ(steps.size(), 4u);
    int64_t tiles_in_backward = 0;
    for (size_t s = 0; s < steps.size(); ++s)
      for (int64_t m = 0; m < 2; ++m) {
        SCOPED_TRACE("step " + std::to_string(s + 1) + ", micro step " + std::to_string(m + 1));
        std::vector<std::string> ran;
        int64_t waits = 0;
        for (const HostWorkSpan& h : steps[s]) {
          // (the backward's, and what ZeRO finishes right after it: the last blocks' sums)
          if (h.micro_step != m || h.during == HostWorkSpan::During::forward) continue;
          EXPECT_EQ(h.during == HostWorkSpan::During::after, h.hook < 0) << h.what << " " << h.index;
          waits += h.what == "gradients to the host";
          if (h.what == "gradients summed on the host" || h.what == "optimizer step on the host")
            ran.push_back(text(h.what != "gradients summed on the host", h.index, h.hook));
          tiles_in_backward += h.what == "optimizer step on the host";
        }
        EXPECT_EQ(ran, m == 1 ? last : earlier);
        EXPECT_EQ(waits, static_cast<int64_t>(earlier.size()));  // (each sum waits for its copy first)
      }
    // The speculated tiles, each once a step during the backward (it stands: nothing to undo).
    int64_t speculated = 0;
    for (int64_t after : plan.execution.weight_tile_final_after) speculated += after >= 0;
    EXPECT_EQ(tiles_in_backward, 4 * speculated);
    EXPECT_EQ(speculated > 0, speculating);
  }
}

// ds profile on a device whose work runs apart from the host (a GPU): the step's phases and blocks are timed on the
// device's clock, read once the step ran. The test device's clock moves one second at each timed event, so every phase
// and block time is a whole number of seconds (the host's clock gives fractions), each micro step's data is one lap,
// and the phases tile the step: their sum is every tick after the step's clock started (each step's start is marked by
// the trainer, then by the step's clock; nothing else is timed).
TEST(DeviceSeam, AProfileTimesTheStepOnTheDevicesClock) {
  const fs::path root = fs::temp_directory_path() / ("ds_device_clock_" + std::to_string(::getpid()));
  const int64_t steps = 3, accumulation = 2;
  const Plan plan = plan_for(1, 0, {"gradient_accumulation_steps=" + std::to_string(accumulation), "train.steps=" + std::to_string(steps), "flops_profiler.enabled=true",
                                    "train.output_dir=" + (root / "run").string()},
                             false, true);
  TrainOptions opt;
  opt.print_every = 1000;
  opt.profile = true;
  SeparateMemoryDevice device;
  const TrainResult r = train(plan, opt, nullptr, &device);
  fs::remove_all(root);
  ASSERT_EQ(r.phases.size(), static_cast<size_t>(steps));
  const auto whole = [](double s) { return s == std::round(s); };
  double phases = 0;
  for (size_t i = 0; i < r.phases.size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    const StepPhases& p = r.phases[i];
    for (const double s : {p.data, p.forward, p.backward, p.reduce, p.norm, p.offload, p.optimizer, p.gather}) EXPECT_TRUE(whole(s)) << s;
    EXPECT_EQ(p.data, accumulation);
    EXPECT_GT(p.forward, accumulation);  // (its blocks' events fall inside it)
    EXPECT_GT(p.backward, accumulation);
    EXPECT_GE(p.optimizer, 1);
    phases += p.data + p.forward + p.backward + p.reduce + p.norm + p.offload + p.optimizer + p.gather;
    const std::vector<double>& forward = r.block_forward_s[i];
    ASSERT_EQ(forward.size(), static_cast<size_t>(plan.model.hp.num_layers));
    for (size_t b = 0; b < forward.size(); ++b) {
      EXPECT_TRUE(whole(forward[b]) && whole(r.block_backward_s[i][b])) << "block " << b;
      EXPECT_EQ(forward[b], forward[0]) << "block " << b;  // each block marks the same points
      EXPECT_GT(r.block_backward_s[i][b], 0) << "block " << b;
      EXPECT_LT(r.attention_forward_s[i][b], forward[b]) << "block " << b;
    }
    double last = -1;
    for (const BlockSpan& s : r.block_spans[i]) {
      EXPECT_TRUE(whole(s.start_s)) << s.start_s;
      EXPECT_GT(s.start_s, last);  // in the order they ran, none at the step's start
      last = s.start_s;
    }
  }
  EXPECT_EQ(phases, static_cast<double>(device.clock_ticks() - 2 * steps));
}
