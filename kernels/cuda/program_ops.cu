// Graph-mode program kernels (DESIGN.md §3.2): the client's hand-off acknowledgement
// (cuda_ops.h ProgramAckAsync) and the copies without a copy engine of cuda_program.h.
#include <cuda_runtime.h>

#include "common/cuda/cuda_check.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/cuda_program.h"

namespace epd::kernels::cuda {
namespace {

/// done: 1 → 0 (acknowledged by the client); 0 and kProgramReleased stay.
__global__ void ProgramAckKernel(unsigned long long* done) { atomicCAS(done, 1ull, 0ull); }

__global__ void ReadWordKernel(const unsigned long long* word, unsigned long long* host) {
  *host = *reinterpret_cast<const volatile unsigned long long*>(word);
}

absl::Status PreloadProgramKernels() {
  cudaFuncAttributes attr;
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, ProgramAckKernel));
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
