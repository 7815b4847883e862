// The CUDA GPU as a runtime Device (engine/runtime/device/device_cuda.cpp), held to the seam's contract on a GPU:
// device memory is device memory and host memory is page-locked, every copy between them is counted by
// direction, the device's kernel table reaches device memory, events order the streams. Without a visible
// GPU those tests skip and say why (label gpu); asking for the CUDA device then is refused with a reason (the
// build's, where its LibTorch has no CUDA).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cmath>

#include "common/error.hpp"
#include "engine/runtime/device/build_support.hpp"
#include "engine/runtime/device/device.hpp"
#include "kernels/cpu/norm.hpp"
#include "kernels/cuda/optimizers.hpp"

using namespace ds;

TEST(CudaDeviceAnywhere, WithoutAVisibleGpuTheCudaDeviceIsRefusedWithTheReason) {
  const char* why = nullptr;
  if (kernels::cuda::device_count(&why) > 0) GTEST_SKIP() << "a GPU is visible: the refusal cannot be seen here";
  try {
    Device::create(DeviceKind::cuda, 0);
    FAIL() << "a CUDA device without a GPU";
  } catch (const UserError& e) {
    // The build's reason first (a LibTorch without CUDA could not use a GPU either), else the driver's.
    const char* reason = build_support().torch_cuda ? "no CUDA device is visible" : "this build of ds has no CUDA LibTorch";
    EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
    EXPECT_NE(e.hint().find("--device cpu"), std::string::npos);
  }
}

TEST(CudaDeviceOnGpu, AllocatesByPlaceCountsEveryCopyAndItsKernelsReachDeviceMemory) {
  const char* why = nullptr;
  if (kernels::cuda::device_count(&why) == 0)
    GTEST_SKIP() << "no CUDA device visible (" << (why ? why : "none") << "): run scripts/device-check.sh on a GPU machine";
  const auto d = Device::create(DeviceKind::cuda, 0);
  EXPECT_FALSE(d->host_addresses_device());
  const int64_t n = 100003;
  torch::Tensor dev = d->allocate(Place::device, Dtype::fp32, n, false), host = d->allocate(Place::host, Dtype::fp32, n, true);
  cudaPointerAttributes a{}, b{};
  ASSERT_EQ(cudaPointerGetAttributes(&a, dev.data_ptr()), cudaSuccess);
  ASSERT_EQ(cudaPointerGetAttributes(&b, host.data_ptr()), cudaSuccess);
  EXPECT_EQ(a.type, cudaMemoryTypeDevice);
  EXPECT_EQ(b.type, cudaMemoryTypeHost);  // page-locked
  float* h = host.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) h[i] = std::sin(static_cast<float>(i));
  const double expected = kernels::sum_of_squares_f32_reference(h, n);  // in double, as the GPU adds
  d->copy(dev, Place::device, host, Place::host);
  EXPECT_NEAR(d->kernels(Place::device).sum_of_squares_f32(dev.data_ptr<float>(), n), expected, 1e-12 * expected);
  EXPECT_NEAR(d->kernels(Place::host).sum_of_squares_f32(h, n), expected, 1e-6 * expected);  // fp32 partial sums
  for (int64_t i = 0; i < n; ++i) h[i] = 0;
  d->copy(host, Place::host, dev, Place::device);
  EXPECT_EQ(h[n - 1], std::sin(static_cast<float>(n - 1)));
  EXPECT_DOUBLE_EQ(d->transfers().at({Place::host, Place::device}).bytes, 4.0 * n);
  EXPECT_DOUBLE_EQ(d->transfers().at({Place::device, Place::host}).bytes, 4.0 * n);
  EXPECT_DOUBLE_EQ(d->transferred_bytes(), 8.0 * n);
  const auto e = d->compute_stream().record();
  d->copy_stream().wait_for(*e);
  e->wait();
  EXPECT_TRUE(e->done());
  // The copies to the host run on a stream of their own (the link's other direction); one the host waits for later
  // has landed once its event has.
  EXPECT_NE(&d->copy_stream_to_host(), &d->copy_stream());
  EXPECT_EQ(&d->copy_stream_for(Place::device, Place::host), &d->copy_stream_to_host());
  EXPECT_EQ(&d->copy_stream_for(Place::host, Place::device), &d->copy_stream());
  for (int64_t i = 0; i < n; ++i) h[i] = 0;
  const auto landed = d->copy_ahead(host, Place::host, dev, Place::device);
  landed->wait();
  EXPECT_EQ(h[n - 1], std::sin(static_cast<float>(n - 1)));
  EXPECT_EQ(d->transfers().at({Place::device, Place::host}).ahead, 1);
}
