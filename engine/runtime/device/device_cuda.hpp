// ds — the CUDA GPU's Device (device_cuda.cpp), in builds that found the CUDA toolkit.
#pragma once

#include <memory>

#include "engine/runtime/device/device.hpp"

namespace ds {

// The GPU LOCAL_RANK picks (modulo the visible ones). Throws UserError when none is visible.
std::unique_ptr<Device> make_cuda_device(int local_rank);

}  // namespace ds
