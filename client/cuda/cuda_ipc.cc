// CUDA IPC mapping of CUDA-backend endpoints (see cuda_ipc.h). Empty without CUDA.
#include "client/cuda/cuda_ipc.h"

#include "common/errors/reason.h"
#include "common/gpu_uuid.h"

#if EPD_HAVE_CUDA

#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "epd/kernels/cuda_ops.h"

namespace epd::internal {
namespace {

std::mutex& ResolverMutex() {
  static std::mutex mu;
  return mu;
}
InProcessAreaResolver& Resolver() {
  static auto* r = new InProcessAreaResolver();
  return *r;
}

}  // namespace

void SetInProcessAreaResolver(InProcessAreaResolver resolver) {
  std::lock_guard<std::mutex> lock(ResolverMutex());
  Resolver() = std::move(resolver);
}

absl::StatusOr<int> DeviceOfUuid(const std::string& gpu_uuid) {
  int count = 0;
  EPD_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  std::string seen;
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp prop;
    EPD_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, d));
    std::string uuid = FormatGpuUuid(prop.uuid.bytes);
    if (uuid == gpu_uuid) return d;
    absl::StrAppend(&seen, seen.empty() ? "" : ", ", uuid);
  }
  return errors::WithReason(
      absl::NotFoundError(absl::StrCat("the endpoint's GPU ", gpu_uuid,
                                       " is not visible to this process (it sees: ", seen,
                                       "); check CUDA_VISIBLE_DEVICES")),
      errors::Reason::kCudaIpcFailed);
}

absl::StatusOr<CudaAreaMapping> CudaAreaMapping::Open(const std::string& ipc_handle,
                                                      const std::string& gpu_uuid) {
  if (ipc_handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc_handle has ", ipc_handle.size(),
                                                   " bytes, expected ",
                                                   sizeof(cudaIpcMemHandle_t)));
  }
  CudaAreaMapping m;
  auto device = DeviceOfUuid(gpu_uuid);
  if (!device.ok()) return device.status();
  m.device_ = *device;
  InProcessAreaResolver resolver;
  {
    std::lock_guard<std::mutex> lock(ResolverMutex());
    resolver = Resolver();
  }
  if (resolver) {
    absl::StatusOr<void*> local = resolver(ipc_handle);
    if (local.ok()) {
      m.data_ = static_cast<uint8_t*>(*local);
      return m;
    }
  }
  int previous = 0;
  EPD_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous));
  EPD_CUDA_RETURN_IF_ERROR(cudaSetDevice(m.device_));
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, ipc_handle.data(), sizeof(handle));
  void* p = nullptr;
  absl::Status st =
      EPD_CUDA_STATUS(cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess));
  cudaSetDevice(previous);
  if (!st.ok()) return st;
  m.data_ = static_cast<uint8_t*>(p);
  m.opened_ = true;
  return m;
}

CudaAreaMapping::CudaAreaMapping(CudaAreaMapping&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      device_(other.device_),
      opened_(std::exchange(other.opened_, false)) {}

CudaAreaMapping& CudaAreaMapping::operator=(CudaAreaMapping&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    device_ = other.device_;
    opened_ = std::exchange(other.opened_, false);
  }
  return *this;
}

CudaAreaMapping::~CudaAreaMapping() { Reset(); }

void CudaAreaMapping::Reset() {
  if (opened_ && data_ != nullptr) cudaIpcCloseMemHandle(data_);
  data_ = nullptr;
  opened_ = false;
}

}  // namespace epd::internal

#endif  // EPD_HAVE_CUDA
