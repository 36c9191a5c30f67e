// A kernel launch with programmatic stream serialization (Hopper's programmatic dependent
// launch), shared by the low-latency hand-off (ll_internal.h) and the normal ops' second
// kernels (normal_common.cuh). Internal, not part of the API.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "common/cuda/cuda_check.h"

namespace epd::kernels::cuda::internal {

/// Launches `kernel<<<grid, threads, smem, stream>>>(params)` through cudaLaunchKernelEx with
/// cudaLaunchAttributeProgrammaticStreamSerialization: on sm_90 and later it may start once
/// every block of the kernel before it on the stream has run griddepcontrol.launch_dependents
/// or exited (it must run griddepcontrol.wait before it reads that kernel's writes); before
/// sm_90 it starts when that kernel ends. Works inside a stream capture. INTERNAL for a launch
/// error.
template <typename Params>
absl::Status LaunchProgrammatic(void (*kernel)(Params), int32_t grid, int32_t threads, size_t smem,
                                cudaStream_t stream, const Params& params) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(grid));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return EPD_CUDA_STATUS(cudaLaunchKernelEx(&config, kernel, params));
}

}  // namespace epd::kernels::cuda::internal
