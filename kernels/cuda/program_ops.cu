// Graph-mode program hand-off kernel (cuda_ops.h ProgramAckAsync; DESIGN.md §3.2).
#include <cuda_runtime.h>

#include "epd/kernels/cuda_ops.h"

namespace epd::kernels::cuda {
namespace {

/// done: 1 → 0 (acknowledged by the client); 0 and kProgramReleased stay.
__global__ void ProgramAckKernel(unsigned long long* done) { atomicCAS(done, 1ull, 0ull); }

absl::Status PreloadProgramKernels() {
  cudaFuncAttributes attr;
  return EPD_CUDA_STATUS(cudaFuncGetAttributes(&attr, ProgramAckKernel));
}
const bool kProgramPreloadRegistered = RegisterPreloadHook(&PreloadProgramKernels);

}  // namespace

absl::Status ProgramAckAsync(uint64_t* program_done, cudaStream_t stream) {
  (void)kProgramPreloadRegistered;
  if (program_done == nullptr) return absl::InvalidArgumentError("program_done is null");
  ProgramAckKernel<<<1, 1, 0, stream>>>(reinterpret_cast<unsigned long long*>(program_done));
  return EPD_CUDA_STATUS(cudaGetLastError());
}

}  // namespace epd::kernels::cuda
