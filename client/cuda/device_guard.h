// DeviceGuard: makes an endpoint's GPU current for a scope (the client's CUDA resources
// themselves come from common/cuda/device_alloc.h). Built only with CUDA.
#pragma once

#if EPD_HAVE_CUDA

namespace epd::internal {

/// Makes `device` current for its scope (and its primary context current on this thread)
/// and restores the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool restore_ = false;
};

}  // namespace epd::internal

#endif  // EPD_HAVE_CUDA
