// The CUDA resources a client endpoint keeps: zeroed device and pinned memory, streams,
// events (move-only owners from common/cuda/cuda_handles.h), and DeviceGuard. Built only
// with CUDA.
#pragma once

#if EPD_HAVE_CUDA

#include <cuda_runtime.h>

#include <cstddef>

#include "absl/status/statusor.h"
#include "common/cuda/cuda_handles.h"

namespace epd::internal {

// common/cuda/cuda_handles.h, shared with the daemon.
using ::epd::DeviceMemory;
using ::epd::EventHandle;
using ::epd::PinnedMemory;
using ::epd::StreamHandle;

/// `bytes` of device memory on the current device, zeroed. RESOURCE_EXHAUSTED when full,
/// INTERNAL for other CUDA errors.
absl::StatusOr<DeviceMemory> AllocateDevice(size_t bytes);
/// `bytes` of pinned host memory (cudaHostAllocPortable), zeroed. INTERNAL on failure.
absl::StatusOr<PinnedMemory> AllocatePinned(size_t bytes);
/// A non-blocking stream on the current device (no implicit sync with the legacy stream).
absl::StatusOr<StreamHandle> CreateStream();
/// An event without timing on the current device.
absl::StatusOr<EventHandle> CreateEvent();

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
