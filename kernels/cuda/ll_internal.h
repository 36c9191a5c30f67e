// Internal declarations shared by the low-latency CUDA sources (not part of the API).
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "common/cuda/cuda_check.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_ops.h"

namespace epd::kernels::cuda::internal {

/// cudaFuncGetAttributes on every low-latency kernel (called by PreloadKernels).
absl::Status PreloadLowLatencyDispatchKernels();
absl::Status PreloadLowLatencyCombineKernels();
inline absl::Status PreloadLowLatencyKernels() {
  absl::Status s = PreloadLowLatencyDispatchKernels();
  if (!s.ok()) return s;
  return PreloadLowLatencyCombineKernels();
}

/// Launches `kernel<<<num_blocks, kLowLatencyThreads, smem, stream>>>(params)`; with
/// `programmatic`, through cudaLaunchKernelEx with programmatic stream serialization, so it
/// starts as soon as the WaitFlagAsync kernel before it on the stream lets it
/// (KernelHandoff::programmatic). Errors: INTERNAL for a launch error.
template <typename Params>
absl::Status LaunchLowLatency(void (*kernel)(Params), int32_t num_blocks, size_t smem,
                              bool programmatic, cudaStream_t stream, const Params& params) {
  if (!programmatic) {
    kernel<<<num_blocks, kLowLatencyThreads, smem, stream>>>(params);
    return EPD_CUDA_STATUS(cudaGetLastError());
  }
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(num_blocks));
  config.blockDim = dim3(kLowLatencyThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return EPD_CUDA_STATUS(cudaLaunchKernelEx(&config, kernel, params));
}

/// Checks shared by both low-latency launchers: ValidateContext, Mll > 0, buffer in
/// [0, kLowLatencyBuffers), and the exchange fits the sync region.
absl::Status ValidateLowLatency(const CudaRankContext& ctx, int32_t buffer, const char* op);

}  // namespace epd::kernels::cuda::internal
