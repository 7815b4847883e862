#include "engine/runtime/device/device.hpp"

#include <chrono>
#include <stdexcept>

#include "common/error.hpp"
#ifdef DS_WITH_CUDA_DEVICE
#include "engine/runtime/device/device_cuda.hpp"
#endif

namespace ds {
namespace {

class CompletedEvent final : public Event {
 public:
  bool done() const override { return true; }
  void wait() override {}
  double seconds_since(const Event& earlier) const override {
    const auto* e = dynamic_cast<const CompletedEvent*>(&earlier);
    DS_CHECK(e, "an event timed against another stream's");
    return std::chrono::duration<double>(at_ - e->at_).count();
  }

 private:
  std::chrono::steady_clock::time_point at_ = std::chrono::steady_clock::now();
};

class CpuDevice final : public Device {
 public:
  std::string name() const override { return "cpu"; }
  bool host_addresses_device() const override { return true; }
  torch::Tensor allocate(Place place, Dtype dtype, int64_t elements, bool /*pinned: one memory, no copies to speed*/) override {
    DS_CHECK(place != Place::nvme, "NVMe space is the swappers', not an allocation");
    return torch::zeros({elements}, to_torch(dtype));
  }
  const KernelTable& kernels(Place) const override { return cpu_kernel_table(); }
  Stream& compute_stream() override { return compute_; }
  Stream& copy_stream() override { return copy_; }

 private:
  ImmediateStream compute_, copy_;
};

}  // namespace

torch::ScalarType to_torch(Dtype d) {
  switch (d) {
    case Dtype::fp32: return torch::kFloat32;
    case Dtype::bf16: return torch::kBFloat16;
    case Dtype::fp16: return torch::kFloat16;
  }
  return torch::kFloat32;
}

double Event::seconds_since(const Event&) const { throw std::logic_error("an event recorded without its time (Stream::record_timed)"); }

std::shared_ptr<Event> ImmediateStream::record() { return std::make_shared<CompletedEvent>(); }

std::unique_ptr<Device> Device::create(DeviceKind kind, int local_rank) {
  (void)local_rank;  // a CPU has one
  switch (kind) {
    case DeviceKind::cpu: return std::make_unique<CpuDevice>();
    case DeviceKind::cuda:
#ifdef DS_WITH_CUDA_DEVICE
      return make_cuda_device(local_rank);
#else
      break;
#endif
  }
  throw UserError("this build of ds has no CUDA device", "train on the CPU (--device cpu), or build ds with the CUDA toolkit (see the README)");
}

void Device::copy(const torch::Tensor& dst, Place to, const torch::Tensor& src, Place from) {
  copy(dst, to, src, from, *compute_stream().record());
}

void Device::copy(const torch::Tensor& dst, Place to, const torch::Tensor& src, Place from, const Event& after) {
  DS_CHECK(dst.numel() == src.numel(), "a copy of ", src.numel(), " elements into ", dst.numel());
  Stream& copies = copy_stream_for(from, to);
  copies.wait_for(after);
  copy_between(dst, to, src, from);
  compute_stream().wait_for(*copies.record());  // what the compute stream queues next sees dst
  count(from, to, static_cast<double>(dst.nbytes()));
}

std::shared_ptr<Event> Device::copy_ahead(const torch::Tensor& dst, Place to, const torch::Tensor& src, Place from) {
  return copy_ahead(dst, to, src, from, *compute_stream().record());  // (after every use of dst queued so far)
}

std::shared_ptr<Event> Device::copy_ahead(const torch::Tensor& dst, Place to, const torch::Tensor& src, Place from, const Event& after) {
  DS_CHECK(dst.numel() == src.numel(), "a copy of ", src.numel(), " elements into ", dst.numel());
  Stream& copies = copy_stream_for(from, to);
  copies.wait_for(after);
  copy_between_ahead(dst, to, src, from);
  count(from, to, static_cast<double>(dst.nbytes()));
  ++transfers_[{from, to}].ahead;
  return copies.record();
}

void Device::copy_between(const torch::Tensor& dst, Place, const torch::Tensor& src, Place) { dst.copy_(src); }

void Device::count(Place from, Place to, double bytes) {
  TransferStats& s = transfers_[{from, to}];
  ++s.copies;
  s.bytes += bytes;
}

double Device::transferred_bytes() const {
  double total = 0;
  for (const auto& [key, s] : transfers_)
    if (key.first != key.second) total += s.bytes;
  return total;
}

}  // namespace ds
