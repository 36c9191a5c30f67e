// The client's CUDA resource factories (cuda_resources.h). Empty without CUDA.
#include "client/cuda/cuda_resources.h"

#if EPD_HAVE_CUDA

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_ops.h"

namespace epd::internal {

absl::StatusOr<DeviceMemory> AllocateDevice(size_t bytes) {
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("cudaMalloc of ", bytes, " bytes failed: out of GPU memory"));
  }
  EPD_CUDA_RETURN_IF_ERROR(err);
  DeviceMemory m(static_cast<uint8_t*>(p));
  EPD_CUDA_RETURN_IF_ERROR(cudaMemset(p, 0, bytes));
  return m;
}

absl::StatusOr<PinnedMemory> AllocatePinned(size_t bytes) {
  void* p = nullptr;
  EPD_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, bytes, cudaHostAllocPortable));
  std::memset(p, 0, bytes);
  return PinnedMemory(static_cast<uint8_t*>(p));
}

absl::StatusOr<StreamHandle> CreateStream() {
  cudaStream_t s = nullptr;
  EPD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return StreamHandle(s);
}

absl::StatusOr<EventHandle> CreateEvent() {
  cudaEvent_t e = nullptr;
  EPD_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return EventHandle(e);
}

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
