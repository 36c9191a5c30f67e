// One rank's device resources on the CUDA backend (see cuda_rank.h), and this process's
// registry of exported areas (FindInProcessCudaArea, cuda_data_plane.h).
#include "daemon/dataplane/cuda/cuda_rank.h"

#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "daemon/dataplane/cuda/cuda_data_plane.h"

namespace epd {
namespace {

std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}
std::map<std::string, void*>& Registry() {
  static auto* m = new std::map<std::string, void*>();
  return *m;
}

}  // namespace

CudaRank::~CudaRank() {
  if (!ipc_handle.empty()) {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    Registry().erase(ipc_handle);
  }
  if (stream != nullptr) {
    cudaSetDevice(device);
    cudaStreamSynchronize(stream.get());  // Bounded: every kernel wait is bounded.
  }
  area.reset();
  cudaGetLastError();
}

absl::StatusOr<DeviceMemory> DeviceAlloc(uint64_t bytes, int device) {
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("cudaMalloc of ", bytes, " bytes on GPU ", device, " failed: out of memory"));
  }
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(err));
  return DeviceMemory(static_cast<uint8_t*>(p));
}

absl::StatusOr<std::shared_ptr<CudaRank>> CreateCudaRank(int device, int32_t rank,
                                                         const kernels::EndpointLayout& layout,
                                                         bool client_launched) {
  auto r = std::make_shared<CudaRank>();
  r->device = device;
  r->rank = rank;
  r->bytes = layout.total_bytes;
  r->launch_flags_offset = layout.launch_flags.offset;
  r->client_launched = client_launched;
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(device)));
  cudaStream_t stream = nullptr;
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)));
  r->stream.reset(stream);
  cudaEvent_t event = nullptr;
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaEventCreateWithFlags(&event, cudaEventDisableTiming)));
  r->done.reset(event);
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaEventCreateWithFlags(&event, cudaEventDisableTiming)));
  r->waited.reset(event);
  // Mapped: kernels write the status, N and ready_seen straight into it.
  void* pinned = nullptr;
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(
      cudaHostAlloc(&pinned, sizeof(Readback), cudaHostAllocPortable | cudaHostAllocMapped)));
  r->readback.reset(static_cast<Readback*>(pinned));
  std::memset(pinned, 0, sizeof(Readback));
  EPD_ASSIGN_OR_RETURN(r->area, DeviceAlloc(r->bytes, device));
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaMemsetAsync(r->area.get(), 0, r->bytes, stream)));
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaStreamSynchronize(stream)));
  cudaIpcMemHandle_t handle;
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaIpcGetMemHandle(&handle, r->area.get())));
  r->ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    Registry()[r->ipc_handle] = r->area.get();
  }
  return r;
}

absl::StatusOr<void*> FindInProcessCudaArea(const std::string& cuda_ipc_handle) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(cuda_ipc_handle);
  if (it == Registry().end()) {
    return absl::NotFoundError("no endpoint of this process exported that CUDA IPC handle");
  }
  return it->second;
}

}  // namespace epd
