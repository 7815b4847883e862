// ds — the CUDA GPU's KernelTable: kernels/cuda's launches on one stream. The table's sums come back to
// the host as a double (the gradient norm, a finite check, Lamb's per-tensor norms), so those calls wait
// for the stream; the optimizers' updates only queue work. Built wherever the CUDA toolkit is (CI
// included), without LibTorch: the device that owns the stream is the CUDA build's Device.
#pragma once

#include <memory>

#include "engine/runtime/device/kernel_table.hpp"

namespace ds {

// `stream`: a cudaStream_t (null: the default stream). Throws std::runtime_error without a usable GPU.
std::unique_ptr<KernelTable> make_cuda_kernel_table(void* stream);

}  // namespace ds
