#include "engine/runtime/device/kernel_route.hpp"

#include "common/error.hpp"
#ifdef DS_WITH_CUDA_KERNELS
#include "kernels/cuda/cross_entropy.hpp"
#include "kernels/cuda/dropout.hpp"
#endif

namespace ds {

bool on_host(const torch::Device& d) { return d.is_cpu(); }
bool on_host(const torch::Tensor& x) { return on_host(x.device()); }

KernelRoute kernel_route(const torch::Tensor& x) {
  const auto dtype = x.scalar_type();
  if (dtype != torch::kFloat32 && dtype != torch::kBFloat16) return KernelRoute::libtorch;
  if (on_host(x)) return KernelRoute::host;
#ifdef DS_WITH_CUDA_KERNELS
  if (x.is_cuda()) return KernelRoute::cuda;
#endif
  return KernelRoute::libtorch;
}

namespace {

void check_cuda_route(const torch::Tensor& x, const char* op) {
  DS_CHECK(kernel_route(x) == KernelRoute::cuda, op, ": a ", x.scalar_type(), " tensor on ", x.device(), " is not kernels/cuda's");
}

uint16_t* bf16_data(const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

}  // namespace

void cuda_dropout(const torch::Tensor& x, const torch::Tensor& y, uint64_t key, uint32_t keep_below, float scale) {
  check_cuda_route(x, "dropout");
  DS_CHECK(x.is_contiguous() && y.is_contiguous() && y.scalar_type() == x.scalar_type() && y.numel() == x.numel(),
           "dropout: x and y contiguous, of one dtype and size");
#ifdef DS_WITH_CUDA_KERNELS
  if (x.scalar_type() == torch::kFloat32)
    kernels::cuda::dropout_f32(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), key, keep_below, scale, nullptr);
  else
    kernels::cuda::dropout_bf16(bf16_data(x), bf16_data(y), x.numel(), key, keep_below, scale, nullptr);
#else
  (void)key, (void)keep_below, (void)scale;
#endif
}

void cuda_softmax_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets, float row_grad, bool write_grad,
                                const torch::Tensor& row_loss) {
  check_cuda_route(logits, "softmax cross-entropy");
  DS_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && targets.scalar_type() == torch::kLong && targets.is_contiguous() &&
               row_loss.scalar_type() == torch::kFloat32,
           "softmax cross-entropy: (rows, vocab) logits of unit stride, int64 targets, fp32 row losses");
#ifdef DS_WITH_CUDA_KERNELS
  const int64_t rows = logits.size(0), vocab = logits.size(1), ld = logits.stride(0);
  if (logits.scalar_type() == torch::kBFloat16)
    kernels::cuda::softmax_cross_entropy_bf16(bf16_data(logits), targets.data_ptr<int64_t>(), rows, vocab, ld, row_grad, write_grad,
                                              row_loss.data_ptr<float>(), nullptr);
  else
    kernels::cuda::softmax_cross_entropy_f32(logits.data_ptr<float>(), targets.data_ptr<int64_t>(), rows, vocab, ld, row_grad,
                                             write_grad, row_loss.data_ptr<float>(), nullptr);
#else
  (void)targets, (void)row_grad, (void)write_grad, (void)row_loss;
#endif
}

}  // namespace ds
