// Internal to libepdclient: the CUDA pieces of both launch modes (DESIGN.md §3.2).
//
// - The value that releases a daemon-launched stream whose daemon is gone (the stream
//   memory operations themselves are epd/kernels/cuda_ops.h's, shared with the daemon).
// - A process-wide, reference-counted cache of mapped data areas: client-launched mode
//   maps every peer's area, and one process may hold several endpoints of a group (each
//   also mapping its own area); CUDA refuses to open one IPC handle twice in a process.
// - Move-only RAII owners of the CUDA resources an endpoint keeps (device memory, pinned
//   host memory, streams, events).
// Built only with CUDA.
#pragma once

#if EPD_HAVE_CUDA

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/cuda/cuda_ipc.h"
#include "common/cuda/cuda_handles.h"
#include "proto/abi/launch_flags.h"

namespace epd::internal {

// ---- stream memory operations: kernels::cuda::StreamWriteValue64 / StreamWaitValue64Geq
// (epd/kernels/cuda_ops.h), shared with the daemon.

/// The done_seq value that releases a stream whose daemon is gone (launch_flags.h).
using ::epd::abi::kReleasedSeq;

// ---- shared mapping of data areas -----------------------------------------------------------

/// The mapping of the data area exported as `ipc_handle` (cudaIpcMemHandle_t bytes) on GPU
/// `gpu_uuid`, shared by every endpoint of this process that maps it: opened once
/// (CudaAreaMapping::Open) and closed when the last holder releases it. Errors: those of
/// CudaAreaMapping::Open.
absl::StatusOr<std::shared_ptr<const CudaAreaMapping>> MapSharedArea(const std::string& ipc_handle,
                                                                     const std::string& gpu_uuid);

// ---- RAII owners ------------------------------------------------------------------------------

// epd/common/cuda_handles.h, shared with the daemon.
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
