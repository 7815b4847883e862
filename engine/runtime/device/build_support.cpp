#include "engine/runtime/device/build_support.hpp"

#ifdef DS_CUDA_KERNELS
#include "kernels/cuda/optimizers.hpp"  // device_count
#endif
#ifdef DS_WITH_NCCL_COMMUNICATOR
#include "engine/runtime/comm/nccl_group.hpp"  // nccl_version
#endif

namespace ds {

BuildSupport build_support() {
  BuildSupport b;
#ifdef DS_TORCH_CUDA
  b.torch_cuda = true;
#endif
#ifdef DS_CUDA_KERNELS
  b.cuda_kernels = DS_CUDA_KERNELS;
#endif
#ifdef DS_WITH_NCCL_COMMUNICATOR
  b.nccl = nccl_version();
#endif
  return b;
}

CudaSeen cuda_seen() {
  CudaSeen c;
#ifdef DS_CUDA_KERNELS
  const char* why = nullptr;
  c.kernels_built = true;
  c.devices = kernels::cuda::device_count(&why);
  if (c.devices == 0 && why) c.why = why;
#endif
  return c;
}

}  // namespace ds
