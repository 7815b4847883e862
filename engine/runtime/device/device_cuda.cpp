// ds — the CUDA GPU as a Device: device memory from cudaMalloc, host memory page-locked (cudaMallocHost,
// so copies run beside compute), copies between them on two copy streams (to the device, to the host: the link's
// two directions at once) ordered with the compute stream by events, the CUDA kernel table for device memory and the
// CPU's for host memory (an offloaded optimizer).
// The compute stream is the legacy default stream LibTorch's operations run on (docs/ARCHITECTURE.md).
// Compiled wherever the CUDA toolkit is (against any LibTorch: tensors are made over its memory with
// from_blob); the models' LibTorch ops on these tensors need a CUDA LibTorch.
#include "engine/runtime/device/device_cuda.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/error.hpp"

#include "engine/runtime/device/build_support.hpp"
#include "engine/runtime/device/kernel_table_cuda.hpp"
#include "kernels/cuda/optimizers.hpp"
#include "kernels/cuda/check.hpp"

namespace ds {
namespace {

using ds::cuda::check;

class CudaEvent final : public Event {
 public:
  // `timed`: the GPU's clock is read as the stream reaches it (seconds_since); otherwise ordering only, cheaper.
  CudaEvent(cudaStream_t s, bool timed) : timed_(timed) {
    check(cudaEventCreateWithFlags(&e_, timed ? cudaEventDefault : cudaEventDisableTiming), "cudaEventCreate");
    check(cudaEventRecord(e_, s), "cudaEventRecord");
  }
  ~CudaEvent() override { cudaEventDestroy(e_); }
  bool done() const override { return cudaEventQuery(e_) == cudaSuccess; }
  void wait() override { check(cudaEventSynchronize(e_), "cudaEventSynchronize"); }
  double seconds_since(const Event& earlier) const override {
    const auto* e = dynamic_cast<const CudaEvent*>(&earlier);
    if (!e || !timed_ || !e->timed_) return Event::seconds_since(earlier);  // (says why)
    float ms = 0;
    check(cudaEventElapsedTime(&ms, e->e_, e_), "cudaEventElapsedTime");
    return static_cast<double>(ms) / 1e3;
  }
  cudaEvent_t handle() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
  bool timed_ = false;
};

class CudaStream final : public Stream {
 public:
  // A stream of its own, which runs beside the others.
  CudaStream() : owned_(true) { check(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreate"); }
  // The legacy default stream, where LibTorch queues the model's operations: the optimizer and the norms
  // queued there run after the backward that wrote the gradients, with no event between them.
  explicit CudaStream(cudaStream_t borrowed) : s_(borrowed), owned_(false) {}
  ~CudaStream() override {
    if (owned_) cudaStreamDestroy(s_);
  }
  std::shared_ptr<Event> record() override { return std::make_shared<CudaEvent>(s_, false); }
  std::shared_ptr<Event> record_timed() override { return std::make_shared<CudaEvent>(s_, true); }
  void wait_for(const Event& e) override {
    if (const auto* c = dynamic_cast<const CudaEvent*>(&e)) check(cudaStreamWaitEvent(s_, c->handle(), 0), "cudaStreamWaitEvent");
    // Any other event (the CPU's) is complete when it exists.
  }
  void synchronize() override { check(cudaStreamSynchronize(s_), "cudaStreamSynchronize"); }
  cudaStream_t handle() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
  bool owned_ = false;
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(int index) : index_(index) {
    check(cudaSetDevice(index), "cudaSetDevice");
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, index), "cudaGetDeviceProperties");
    name_ = "cuda:" + std::to_string(index) + " (" + prop.name + ")";
    compute_ = std::make_unique<CudaStream>(cudaStreamLegacy);
    copy_ = std::make_unique<CudaStream>();
    to_host_ = std::make_unique<CudaStream>();
    table_ = make_cuda_kernel_table(compute_->handle());
  }
  std::string name() const override { return name_; }
  bool host_addresses_device() const override { return false; }

  torch::Tensor allocate(Place place, Dtype dtype, int64_t elements, bool pinned) override {
    if (place == Place::nvme) throw std::logic_error("NVMe space is the swappers', not an allocation");
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(elements, 1)) * static_cast<size_t>(dtype_bytes(dtype));
    void* p = nullptr;
    const auto options = torch::TensorOptions().dtype(to_torch(dtype));
    if (place == Place::device) {
      check(cudaMalloc(&p, bytes), "cudaMalloc");
      check(cudaMemsetAsync(p, 0, bytes, compute_->handle()), "cudaMemsetAsync");
      return torch::from_blob(p, {elements}, [](void* q) { cudaFree(q); }, options.device(torch::Device(torch::kCUDA, index_)));
    }
    if (!pinned) return torch::zeros({elements}, options);  // host memory no copy crosses from (the states)
    check(cudaMallocHost(&p, bytes), "cudaMallocHost");  // page-locked: copies to and from it are asynchronous
    std::memset(p, 0, bytes);
    return torch::from_blob(p, {elements}, [](void* q) { cudaFreeHost(q); }, options);
  }

  const KernelTable& kernels(Place place) const override { return place == Place::device ? *table_ : cpu_kernel_table(); }
  double memory_in_use() const override {
    size_t free_bytes = 0, total = 0;
    check(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo");
    return static_cast<double>(total - free_bytes);
  }
  Stream& compute_stream() override { return *compute_; }
  Stream& copy_stream() override { return *copy_; }
  Stream& copy_stream_to_host() override { return *to_host_; }

 protected:
  void copy_between(const torch::Tensor& dst, Place to, const torch::Tensor& src, Place from) override {
    if (!queue_raw_copy(dst, to, src, from)) {
      dst.copy_(src);  // a converting copy: LibTorch's (CUDA LibTorch runs it on the GPU)
      return;
    }
    if (to != Place::device) copy_stream_for(from, to).synchronize();  // host code reads it next
  }
  // (Device::copy_ahead: to the host too, the host waits for the event returned before it reads dst)
  void copy_between_ahead(const torch::Tensor& dst, Place to, const torch::Tensor& src, Place from) override {
    if (!queue_raw_copy(dst, to, src, from)) copy_between(dst, to, src, from);
  }

 private:
  // dst <- src queued on the copy stream where both are one dtype and contiguous (raw: LibTorch's version counters are
  // left alone, as Device::copy promises); false where the copy converts.
  bool queue_raw_copy(const torch::Tensor& dst, Place to, const torch::Tensor& src, Place from) {
    if (dst.scalar_type() != src.scalar_type() || !dst.is_contiguous() || !src.is_contiguous()) return false;
    const cudaMemcpyKind kind = from == Place::device ? (to == Place::device ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost)
                                                      : (to == Place::device ? cudaMemcpyHostToDevice : cudaMemcpyHostToHost);
    const cudaStream_t on = static_cast<CudaStream&>(copy_stream_for(from, to)).handle();
    check(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), dst.nbytes(), kind, on), "cudaMemcpyAsync");
    return true;
  }

  int index_ = 0;
  std::string name_;
  std::unique_ptr<CudaStream> compute_, copy_, to_host_;
  std::unique_ptr<KernelTable> table_;
};

}  // namespace

std::unique_ptr<Device> make_cuda_device(int local_rank) {
  if (!build_support().torch_cuda)  // a plan made without the build (a library caller): the build says it first
    throw UserError("this build of ds has no CUDA LibTorch: it trains on the CPU", "train on the CPU (--device cpu)");
  const char* why = nullptr;
  const int n = kernels::cuda::device_count(&why);
  if (n == 0) throw UserError(std::string("no CUDA device is visible: ") + (why ? why : "none found"), "train on the CPU (--device cpu)");
  if (!torch::cuda::is_available())
    throw UserError("LibTorch sees no usable GPU, though the CUDA runtime shows " + std::to_string(n) + " (its driver or CUDA runtime differs)",
                    "train on the CPU (--device cpu), or run ds where PyTorch's CUDA works");
  return std::make_unique<CudaDevice>(local_rank % n);
}

}  // namespace ds
