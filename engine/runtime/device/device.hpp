// ds — the runtime's device: where a Place's bytes live and where kernels run on them. The plan says where
// every buffer is (ZeroBuffer::place); the device turns that into memory (allocate), the kernels that can
// reach it (a KernelTable per place), the copies between places (copy, counted per direction: the run's
// transfers ledger, held equal to the plan's table) and the streams work is ordered on. A second device
// (CUDA) implements this interface and nothing above it changes: FlatParams allocates through it, the
// optimizer, the gradient norm and the finite checks run through its tables, the offload copies go
// through copy().
//   cpu   host memory for both places, one kernel table, streams that have finished every operation when
//         its call returns (events are complete when recorded). Device and host buffers are still
//         allocations of their own, reached through the same copies a GPU run makes.
#pragma once

#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <utility>

#include "engine/plan/topology.hpp"
#include "engine/plan/zero_plan.hpp"
#include "engine/runtime/device/kernel_table.hpp"

namespace ds {

torch::ScalarType to_torch(Dtype d);

// A point in a stream's work. wait() returns once everything recorded before it has run.
class Event {
 public:
  virtual ~Event() = default;
  virtual bool done() const = 0;
  virtual void wait() = 0;
  // Seconds from `earlier` to this point, both recorded by the same stream's record_timed() and both done:
  // when the stream reached each (a GPU's clock; the CPU's streams, the host's at the call). A GPU's work runs
  // after the host queues it, so phases timed by the host's clock would be the launches'.
  virtual double seconds_since(const Event& earlier) const;
};

// Work on a device, in order: record() marks what has been queued so far; wait_for(e) makes what is
// queued next wait for e (the copy stream waits for the compute stream's gradients, and back).
class Stream {
 public:
  virtual ~Stream() = default;
  virtual std::shared_ptr<Event> record() = 0;
  // record(), with the moment kept for Event::seconds_since (a GPU's timed events cost a little more).
  virtual std::shared_ptr<Event> record_timed() = 0;
  virtual void wait_for(const Event& e) = 0;
  virtual void synchronize() = 0;
};

// Bytes that arrived at one place from another, per direction.
struct TransferStats {
  int64_t copies = 0;
  double bytes = 0;
  int64_t ahead = 0;  // of the copies, those the compute stream waited for only later (Device::copy_ahead)
};
using TransferLedger = std::map<std::pair<Place, Place>, TransferStats>;  // (from, to)

class Device {
 public:
  // The device the plan trains on, this process's (a rank's local_rank picks among several GPUs). Throws
  // UserError for a kind this build lacks.
  static std::unique_ptr<Device> create(DeviceKind kind, int local_rank);
  virtual ~Device() = default;

  virtual std::string name() const = 0;
  // Whether host code may read and write the device's memory in place (the CPU: it is host memory). Where
  // it may not, every byte between the two goes through copy(), and a host kernel gets no device pointer.
  virtual bool host_addresses_device() const = 0;
  // `elements` zeros of `dtype` at `place`: the device's memory, or the host's (page-locked when `pinned` and
  // the device has memory of its own, so that copies to and from it run beside compute). NVMe is the swappers'.
  virtual torch::Tensor allocate(Place place, Dtype dtype, int64_t elements, bool pinned) = 0;
  // The kernels that run on memory at `place`: the device's own, or the host's for an offloaded optimizer.
  virtual const KernelTable& kernels(Place place) const = 0;
  // Bytes of the device's own memory in use now, by anything (a GPU: cudaMemGetInfo's total - free, so
  // LibTorch's cache, ds's buffers and the CUDA context); 0 where the device is the host (RSS says it).
  virtual double memory_in_use() const { return 0; }
  virtual Stream& compute_stream() = 0;
  // The copies to the device run here, and those between two buffers of one place.
  virtual Stream& copy_stream() = 0;
  // The copies from the device to the host: the copy stream itself, or (a GPU) a stream of their own, so a block's
  // gradients leaving wait behind no weights coming in and the link's two directions run at once. Nothing orders the
  // two streams but events: a copy to the host that has ended says nothing of the copies to the device.
  virtual Stream& copy_stream_to_host() { return copy_stream(); }
  // The stream a copy from `from` to `to` runs on.
  Stream& copy_stream_for(Place from, Place to) { return from == Place::device && to != Place::device ? copy_stream_to_host() : copy_stream(); }

  // `dst` (at `to`) takes `src` (at `from`), converted to dst's dtype as Tensor::copy_ converts (nearest
  // even), on the copy stream for the direction (copy_stream_for) after the compute stream's work so far, and before what the compute stream
  // is given next; counted under (from, to) with the bytes that arrive (dst's). On a device with memory of its
  // own, a copy between equal dtypes writes dst's bytes without bumping LibTorch's version counter (a raw copy):
  // the host's step during the forward writes later blocks' weights into the buffer whose views earlier blocks
  // saved for the backward.
  void copy(const torch::Tensor& dst, Place to, const torch::Tensor& src, Place from);
  // copy(), ordered after `after` (a compute stream's event following the last work that reads or writes dst, or writes src) rather
  // than after all the compute queued so far: the copy may run beside what the compute stream was given since (the
  // host's step during the forward copies a block's weights while the GPU runs the blocks before it).
  void copy(const torch::Tensor& dst, Place to, const torch::Tensor& src, Place from, const Event& after);
  // copy() that the compute stream does not wait for yet: what it is given next runs beside the copy, and the caller
  // makes it wait for the event returned before the first work that reads dst (stage 3's gather of the next block
  // from host memory, while the GPU runs the current one).
  std::shared_ptr<Event> copy_ahead(const torch::Tensor& dst, Place to, const torch::Tensor& src, Place from);
  // copy_ahead(), ordered after `after` (as copy() with `after`) rather than after all the compute queued so far: the
  // speculative step's weights leave while the GPU runs the backward of the blocks below theirs. To the host, the
  // host too waits for the event returned before it reads dst (a block's gradients landing while the host sums the
  // blocks' above), and the compute stream before it writes src again.
  std::shared_ptr<Event> copy_ahead(const torch::Tensor& dst, Place to, const torch::Tensor& src, Place from, const Event& after);
  // A kernel running on memory at `from` wrote `bytes` at `to` in place (host_addresses_device): counted as
  // a transfer.
  void count_direct_write(Place from, Place to, double bytes) { count(from, to, bytes); }
  const TransferLedger& transfers() const { return transfers_; }
  // Bytes moved between different places so far.
  double transferred_bytes() const;

 protected:
  virtual void copy_between(const torch::Tensor& dst, Place to, const torch::Tensor& src, Place from);
  // copy_between() for copy_ahead (a test device lands it only once the compute stream waits for it).
  virtual void copy_between_ahead(const torch::Tensor& dst, Place to, const torch::Tensor& src, Place from) { copy_between(dst, to, src, from); }
  void count(Place from, Place to, double bytes);

 private:
  TransferLedger transfers_;
};

// The CPU's stream: every operation has finished when its call returns; its events are timed by the host's
// clock when recorded.
class ImmediateStream final : public Stream {
 public:
  std::shared_ptr<Event> record() override;
  std::shared_ptr<Event> record_timed() override { return record(); }
  void wait_for(const Event&) override {}
  void synchronize() override {}
};

}  // namespace ds
