// Factories for the CUDA resources daemon and client own: device and pinned memory, streams
// and events, each returned as its RAII handle (cuda_handles.h). Needs the CUDA runtime
// headers (include only where CUDA is built).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "absl/status/statusor.h"
#include "common/cuda/cuda_handles.h"

namespace epd {

/// Whether AllocateDevice zeroes the memory before returning it.
enum class DeviceZero {
  kNo,   ///< Contents undefined; the caller zeroes it (e.g. cudaMemsetAsync on its stream).
  kYes,  ///< Zeroed with a synchronous cudaMemset.
};

/// `bytes` (> 0) of device memory on the current device (cudaMalloc). Errors:
/// RESOURCE_EXHAUSTED naming the size and the GPU when the GPU is full; INTERNAL naming the
/// CUDA call otherwise.
absl::StatusOr<DeviceMemory> AllocateDevice(size_t bytes, DeviceZero zero = DeviceZero::kYes);

/// `bytes` of pinned host memory (cudaHostAlloc with `flags`, e.g. cudaHostAllocPortable,
/// | cudaHostAllocMapped for memory kernels write), zeroed. INTERNAL on failure.
absl::StatusOr<PinnedMemory> AllocatePinned(size_t bytes,
                                            unsigned int flags = cudaHostAllocPortable);

/// Pinned host memory holding `T` objects (a trivially copyable type).
template <typename T>
using PinnedArray = std::unique_ptr<T, CudaFreeHostDeleter>;

/// `count` zeroed `T`s of pinned host memory (AllocatePinned with `flags`).
template <typename T>
absl::StatusOr<PinnedArray<T>> AllocatePinnedArray(size_t count,
                                                   unsigned int flags = cudaHostAllocPortable) {
  static_assert(std::is_trivially_copyable_v<T>, "pinned memory holds trivially copyable T");
  absl::StatusOr<PinnedMemory> m = AllocatePinned(sizeof(T) * count, flags);
  if (!m.ok()) return m.status();
  return PinnedArray<T>(reinterpret_cast<T*>(m->release()));
}

/// Registers `bytes` of this process's mapped host memory at `p` (e.g. a shared memfd
/// mapping) as pinned and mapped into every device's address space (cudaHostRegister,
/// portable | mapped), and sets *device_ptr to its device address. INTERNAL naming the call
/// on failure.
absl::StatusOr<HostRegistration> RegisterHostMapped(uint8_t* p, size_t bytes, uint8_t** device_ptr);

/// A stream of the current device (cudaStreamCreateWithFlags; default non-blocking:
/// no implicit ordering with the legacy default stream). INTERNAL on failure.
absl::StatusOr<StreamHandle> CreateStream(unsigned int flags = cudaStreamNonBlocking);

/// An event of the current device (cudaEventCreateWithFlags; default without timing).
/// INTERNAL on failure.
absl::StatusOr<EventHandle> CreateEvent(unsigned int flags = cudaEventDisableTiming);

}  // namespace epd
