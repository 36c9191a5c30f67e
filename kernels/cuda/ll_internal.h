// Internal declarations shared by the low-latency CUDA sources (not part of the API).
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "common/cuda/cuda_check.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/cuda_specialise.h"

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

/// A low-latency kernel's view of the group's shape: each of hidden, top-k and experts per
/// rank is either a compile-time constant (a specialised instance; > 0) or read from the
/// kernel's params (0). The launchers pick a specialised instance only for a group whose
/// shape has exactly these values (LowLatencySpecialisedFor), so either way the kernel
/// computes the same thing; the constants only let the compiler fold divisions, bounds and
/// loop counts.
template <int32_t kHiddenValue, int32_t kTopkValue, int32_t kExpertsPerRankValue>
struct LowLatencyShape {
  static constexpr int32_t kHidden = kHiddenValue;
  static constexpr int32_t kTopk = kTopkValue;
  static constexpr int32_t kExpertsPerRank = kExpertsPerRankValue;
  template <typename Params>
  __host__ __device__ __forceinline__ static int32_t Hidden(const Params& p) {
    return kHidden > 0 ? kHidden : p.hidden;
  }
  template <typename Params>
  __host__ __device__ __forceinline__ static int32_t Topk(const Params& p) {
    return kTopk > 0 ? kTopk : p.num_topk;
  }
  template <typename Params>
  __host__ __device__ __forceinline__ static int32_t ExpertsPerRank(const Params& p) {
    return kExpertsPerRank > 0 ? kExpertsPerRank : p.experts_per_rank;
  }
  /// Whether H is known to be a whole number of `chunk`-channel chunks (no tail checks).
  static constexpr bool FullChunks(int32_t chunk) { return kHidden > 0 && kHidden % chunk == 0; }
};
/// Every value from the params: the kernels every shape can run.
using GenericShape = LowLatencyShape<0, 0, 0>;
/// The specialised instances' shape (kLowLatencySpecialised*: DeepSeek-V3 decode).
using SpecialisedShape = LowLatencyShape<kLowLatencySpecialisedHidden, kLowLatencySpecialisedTopk,
                                         kLowLatencySpecialisedExpertsPerRank>;

/// Checks shared by both low-latency launchers: ValidateContext, Mll > 0, buffer in
/// [0, kLowLatencyBuffers), and the exchange fits the sync region.
absl::Status ValidateLowLatency(const CudaRankContext& ctx, int32_t buffer, const char* op);

}  // namespace epd::kernels::cuda::internal
