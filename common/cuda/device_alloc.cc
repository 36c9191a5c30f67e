// CUDA allocation, stream and event factories (device_alloc.h).
#include "common/cuda/device_alloc.h"

#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"

namespace epd {

absl::StatusOr<DeviceMemory> AllocateDevice(size_t bytes, DeviceZero zero) {
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    int device = -1;
    EPD_CUDA_IGNORE(cudaGetDevice(&device));
    return absl::ResourceExhaustedError(absl::StrCat("cudaMalloc of ", bytes, " bytes on GPU ",
                                                     device, " failed: out of GPU memory"));
  }
  EPD_CUDA_RETURN_IF_ERROR(err);
  DeviceMemory m(static_cast<uint8_t*>(p));
  if (zero == DeviceZero::kYes) EPD_CUDA_RETURN_IF_ERROR(cudaMemset(p, 0, bytes));
  return m;
}

absl::StatusOr<PinnedMemory> AllocatePinned(size_t bytes, unsigned int flags) {
  void* p = nullptr;
  EPD_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, bytes, flags));
  std::memset(p, 0, bytes);
  return PinnedMemory(static_cast<uint8_t*>(p));
}

absl::StatusOr<HostRegistration> RegisterHostMapped(uint8_t* p, size_t bytes,
                                                    uint8_t** device_ptr) {
  EPD_CUDA_RETURN_IF_ERROR(
      cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
  HostRegistration registration(p);
  void* d = nullptr;
  EPD_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&d, p, 0));
  *device_ptr = static_cast<uint8_t*>(d);
  return registration;
}

absl::StatusOr<StreamHandle> CreateStream(unsigned int flags) {
  cudaStream_t s = nullptr;
  EPD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, flags));
  return StreamHandle(s);
}

absl::StatusOr<EventHandle> CreateEvent(unsigned int flags) {
  cudaEvent_t e = nullptr;
  EPD_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, flags));
  return EventHandle(e);
}

}  // namespace epd
