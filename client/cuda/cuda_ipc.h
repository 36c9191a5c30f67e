// Internal to libepdclient: mapping a CUDA-backend endpoint's data area (DESIGN.md §3.2).
// The daemon exports each endpoint's data area with cudaIpcGetMemHandle; the client opens
// it with cudaIpcOpenMemHandle on its own ordinal of the endpoint's GPU (found by UUID:
// CUDA_VISIBLE_DEVICES differs between the daemon and its clients). Built only with CUDA.
#pragma once

#if EPD_HAVE_CUDA

#include <functional>
#include <string>

#include "absl/status/statusor.h"

namespace epd::internal {

/// CUDA cannot open an IPC handle in the process that exported it. A data plane running
/// in the client's own process (tests, an embedded daemon) is reached through this hook
/// instead: it returns the device address of the area exported as `ipc_handle` by this
/// process, or NOT_FOUND (then the handle is opened with cudaIpcOpenMemHandle).
using InProcessAreaResolver = std::function<absl::StatusOr<void*>(const std::string& ipc_handle)>;

/// Installs (or, with an empty function, removes) the process-wide resolver.
void SetInProcessAreaResolver(InProcessAreaResolver resolver);

/// The client's CUDA ordinal of the GPU named `gpu_uuid` ("GPU-..."). NOT_FOUND naming the
/// UUID when this process does not see it (check CUDA_VISIBLE_DEVICES).
absl::StatusOr<int> DeviceOfUuid(const std::string& gpu_uuid);

/// One mapped data area. Move-only; closes the IPC mapping on destruction.
class CudaAreaMapping {
 public:
  CudaAreaMapping() = default;
  /// Maps the area exported as `ipc_handle` (cudaIpcMemHandle_t bytes) on GPU `gpu_uuid`.
  /// Errors: INVALID_ARGUMENT (handle size), NOT_FOUND (GPU), INTERNAL (CUDA, naming the
  /// call and the CUDA error).
  static absl::StatusOr<CudaAreaMapping> Open(const std::string& ipc_handle,
                                              const std::string& gpu_uuid);
  CudaAreaMapping(CudaAreaMapping&& other) noexcept;
  CudaAreaMapping& operator=(CudaAreaMapping&& other) noexcept;
  CudaAreaMapping(const CudaAreaMapping&) = delete;
  CudaAreaMapping& operator=(const CudaAreaMapping&) = delete;
  ~CudaAreaMapping();

  uint8_t* data() const { return data_; }
  /// This process's ordinal of the area's GPU.
  int device() const { return device_; }

 private:
  void Reset();
  uint8_t* data_ = nullptr;
  int device_ = 0;
  bool opened_ = false;  ///< cudaIpcOpenMemHandle'd (else resolved in-process).
};

}  // namespace epd::internal

#endif  // EPD_HAVE_CUDA
