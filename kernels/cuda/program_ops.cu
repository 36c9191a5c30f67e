// Graph-mode program kernels (DESIGN.md §3.2): the client's hand-off acknowledgement
// (cuda_ops.h ProgramAckAsync) and the copies without a copy engine of cuda_program.h.
#include <cuda_runtime.h>

#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/cuda_program.h"

namespace epd::kernels::cuda {
namespace {

/// done: 1 → 0 (acknowledged by the client); 0 and kProgramReleased stay.
__global__ void ProgramAckKernel(unsigned long long* done) { atomicCAS(done, 1ull, 0ull); }

constexpr int kStatusWords = static_cast<int>(sizeof(DeviceStatus) / sizeof(uint32_t));

/// host[i] = status[i]; status[i] = 0 for the 64 words of a DeviceStatus (one warp pair).
__global__ void ProgramStatusReadbackKernel(uint32_t* status, uint32_t* host) {
  for (int i = static_cast<int>(threadIdx.x); i < kStatusWords; i += blockDim.x) {
    host[i] = status[i];
    status[i] = 0;
  }
}

__global__ void ReadWordKernel(const unsigned long long* word, unsigned long long* host) {
  *host = *reinterpret_cast<const volatile unsigned long long*>(word);
}

absl::Status PreloadProgramKernels() {
  cudaFuncAttributes attr;
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, ProgramAckKernel));
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, ProgramStatusReadbackKernel));
  return EPD_CUDA_STATUS(cudaFuncGetAttributes(&attr, ReadWordKernel));
}
const bool kProgramPreloadRegistered = RegisterPreloadHook(&PreloadProgramKernels);

}  // namespace

absl::Status ProgramAckAsync(uint64_t* program_done, cudaStream_t stream) {
  (void)kProgramPreloadRegistered;
  if (program_done == nullptr) return absl::InvalidArgumentError("program_done is null");
  ProgramAckKernel<<<1, 1, 0, stream>>>(reinterpret_cast<unsigned long long*>(program_done));
  return EPD_CUDA_STATUS(cudaGetLastError());
}

absl::Status ProgramStatusReadbackAsync(const CudaRankContext& ctx, DeviceStatus* host_mapped,
                                        cudaStream_t stream) {
  (void)kProgramPreloadRegistered;
  if (host_mapped == nullptr || ctx.own_base == nullptr) {
    return absl::InvalidArgumentError("ProgramStatusReadbackAsync: null host or area pointer");
  }
  uint8_t* dev = ctx.own_base + ctx.layout.sync.offset + kSyncStatusOffset;
  ProgramStatusReadbackKernel<<<1, kStatusWords, 0, stream>>>(
      reinterpret_cast<uint32_t*>(dev), reinterpret_cast<uint32_t*>(host_mapped));
  return EPD_CUDA_STATUS(cudaGetLastError());
}

absl::Status ReadWordAsync(const uint64_t* word, uint64_t* host_mapped, cudaStream_t stream) {
  (void)kProgramPreloadRegistered;
  if (word == nullptr || host_mapped == nullptr) {
    return absl::InvalidArgumentError("ReadWordAsync: null word or host pointer");
  }
  ReadWordKernel<<<1, 1, 0, stream>>>(reinterpret_cast<const unsigned long long*>(word),
                                      reinterpret_cast<unsigned long long*>(host_mapped));
  return EPD_CUDA_STATUS(cudaGetLastError());
}

}  // namespace epd::kernels::cuda
