#include "engine/runtime/device/kernel_table_cuda.hpp"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "kernels/cuda/optimizers.hpp"
#include "kernels/cuda/check.hpp"

namespace ds {
namespace {

namespace kc = kernels::cuda;

using ds::cuda::check;

class CudaKernelTable final : public KernelTable {
 public:
  explicit CudaKernelTable(void* stream) : stream_(stream) {
    // Device: two running sums, then the reductions' partials. Host: page-locked room for the sums.
    check(cudaMalloc(reinterpret_cast<void**>(&device_), sizeof(double) * (2 + 2 * kc::kReduceBlocks)), "cudaMalloc");
    check(cudaMallocHost(reinterpret_cast<void**>(&host_), sizeof(double) * 2), "cudaMallocHost");
  }
  ~CudaKernelTable() override {
    cudaFree(device_);
    cudaFreeHost(host_);
  }
  const char* name() const override { return "cuda"; }

  void adam_step_f32(float* w, float* m, float* v, uint16_t* out, const float* g, int64_t n, const kernels::AdamStep& s) const override {
    kc::adam_step_f32(w, m, v, out, g, n, s, stream_);
  }
  void adam_step_bf16(float* w, float* m, float* v, uint16_t* out, const uint16_t* g, int64_t n,
                      const kernels::AdamStep& s) const override {
    kc::adam_step_bf16(w, m, v, out, g, n, s, stream_);
  }
  void sgd_step_f32(float* w, float* buf, uint16_t* out, const float* g, int64_t n, const kernels::SgdStep& s) const override {
    kc::sgd_step_f32(w, buf, out, g, n, s, stream_);
  }
  void sgd_step_bf16(float* w, float* buf, uint16_t* out, const uint16_t* g, int64_t n, const kernels::SgdStep& s) const override {
    kc::sgd_step_bf16(w, buf, out, g, n, s, stream_);
  }
  void lamb_moments_f32(const float* w, float* m, float* v, const float* g, int64_t n, const kernels::LambStep& s, double* w_sq,
                        double* u_sq) const override {
    lamb_moments_with(kc::lamb_moments_f32, w, m, v, g, n, s, w_sq, u_sq);
  }
  void lamb_moments_bf16(const float* w, float* m, float* v, const uint16_t* g, int64_t n, const kernels::LambStep& s, double* w_sq,
                         double* u_sq) const override {
    lamb_moments_with(kc::lamb_moments_bf16, w, m, v, g, n, s, w_sq, u_sq);
  }
  void lamb_apply(float* w, const float* m, const float* v, uint16_t* out, int64_t n, const kernels::LambStep& s,
                  float ratio) const override {
    kc::lamb_apply(w, m, v, out, n, s, ratio, stream_);
  }
  void adam_step_fp16(float* w, float* m, float* v, uint16_t* out, const uint16_t* g, int64_t n,
                      const kernels::AdamStep& s) const override {
    kc::adam_step_fp16(w, m, v, out, g, n, s, stream_);
  }
  void sgd_step_fp16(float* w, float* buf, uint16_t* out, const uint16_t* g, int64_t n, const kernels::SgdStep& s) const override {
    kc::sgd_step_fp16(w, buf, out, g, n, s, stream_);
  }
  void lamb_moments_fp16(const float* w, float* m, float* v, const uint16_t* g, int64_t n, const kernels::LambStep& s, double* w_sq,
                         double* u_sq) const override {
    lamb_moments_with(kc::lamb_moments_fp16, w, m, v, g, n, s, w_sq, u_sq);
  }
  double sum_of_squares_fp16(const uint16_t* x, int64_t n) const override {
    kc::sum_of_squares_fp16(x, n, device_, device_ + 2, stream_);
    return read_sum();
  }
  double sum_of_squares_f32(const float* x, int64_t n) const override {
    kc::sum_of_squares_f32(x, n, device_, device_ + 2, stream_);
    return read_sum();
  }
  double sum_of_squares_bf16(const uint16_t* x, int64_t n) const override {
    kc::sum_of_squares_bf16(x, n, device_, device_ + 2, stream_);
    return read_sum();
  }
  void sum_of_squares_to(const void* x, GradElements e, int64_t n, double* out) const override {
    const auto* h = static_cast<const uint16_t*>(x);
    switch (e) {
      case GradElements::f32: return kc::sum_of_squares_f32(static_cast<const float*>(x), n, out, device_ + 2, stream_);
      case GradElements::bf16: return kc::sum_of_squares_bf16(h, n, out, device_ + 2, stream_);
      case GradElements::fp16: return kc::sum_of_squares_fp16(h, n, out, device_ + 2, stream_);
    }
  }

 private:
  cudaStream_t stream() const { return static_cast<cudaStream_t>(stream_); }
  // Lamb's first half for gradients of type G: its two sums on the device, then added to the host's.
  template <class G, class Kernel>
  void lamb_moments_with(Kernel kernel, const float* w, float* m, float* v, const G* g, int64_t n, const kernels::LambStep& s,
                         double* w_sq, double* u_sq) const {
    zero_sums();
    kernel(w, m, v, g, n, s, device_, device_ + 2, stream_);
    add_sums(w_sq, u_sq);
  }
  void zero_sums() const { check(cudaMemsetAsync(device_, 0, sizeof(double) * 2, stream()), "cudaMemsetAsync"); }
  // The two device sums added to the host's (waits for the stream).
  void add_sums(double* a, double* b) const {
    check(cudaMemcpyAsync(host_, device_, sizeof(double) * 2, cudaMemcpyDeviceToHost, stream()), "cudaMemcpyAsync");
    check(cudaStreamSynchronize(stream()), "cudaStreamSynchronize");
    *a += host_[0];
    *b += host_[1];
  }
  double read_sum() const {
    check(cudaMemcpyAsync(host_, device_, sizeof(double), cudaMemcpyDeviceToHost, stream()), "cudaMemcpyAsync");
    check(cudaStreamSynchronize(stream()), "cudaStreamSynchronize");
    return host_[0];
  }
  void* stream_;
  double* device_ = nullptr;
  double* host_ = nullptr;
};

}  // namespace

std::unique_ptr<KernelTable> make_cuda_kernel_table(void* stream) {
  const char* why = nullptr;
  if (kc::device_count(&why) == 0) throw std::runtime_error(std::string("no CUDA device for the kernel table: ") + (why ? why : "none visible"));
  return std::make_unique<CudaKernelTable>(stream);
}

}  // namespace ds
