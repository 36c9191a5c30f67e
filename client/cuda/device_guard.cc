// DeviceGuard (device_guard.h). Empty without CUDA.
#include "client/cuda/device_guard.h"

#if EPD_HAVE_CUDA

#include <cuda_runtime.h>

namespace epd::internal {

DeviceGuard::DeviceGuard(int device) {
  if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = device;
  // Always set, even when it is already the current device: that also makes the device's
  // primary context current on this thread (CUDA >= 12), which the driver entry points
  // (cuStreamWriteValue64, ...) need on a thread that made no runtime call yet.
  if (cudaSetDevice(device) == cudaSuccess) restore_ = previous_ != device;
}

DeviceGuard::~DeviceGuard() {
  if (restore_) cudaSetDevice(previous_);
}

}  // namespace epd::internal

#endif  // EPD_HAVE_CUDA
