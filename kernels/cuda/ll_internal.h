// Internal declarations shared by the low-latency CUDA sources (not part of the API).
#pragma once

#include "absl/status/status.h"
#include "epd/kernels/cuda_ops.h"

namespace epd::kernels::cuda::internal {

/// Threads per block of the low-latency kernels (32 warps).
inline constexpr int kLowLatencyThreads = 1024;
/// Largest K the CUDA low-latency kernels support (one warp lane per top-k slot).
inline constexpr int kLowLatencyMaxTopk = 32;

/// cudaFuncGetAttributes on every low-latency kernel (called by PreloadKernels).
absl::Status PreloadLowLatencyDispatchKernels();
absl::Status PreloadLowLatencyCombineKernels();
inline absl::Status PreloadLowLatencyKernels() {
  absl::Status s = PreloadLowLatencyDispatchKernels();
  if (!s.ok()) return s;
  return PreloadLowLatencyCombineKernels();
}

/// Checks shared by both low-latency launchers: ValidateContext, Mll > 0, buffer in
/// [0, kLowLatencyBuffers), K <= kLowLatencyMaxTopk, and the exchange fits the sync region.
absl::Status ValidateLowLatency(const CudaRankContext& ctx, int32_t buffer, const char* op);

}  // namespace epd::kernels::cuda::internal
