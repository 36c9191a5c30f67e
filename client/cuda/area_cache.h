// A process-wide, reference-counted cache of mapped CUDA data areas: client-launched mode
// maps every peer's area, and one process may hold several endpoints of a group (each also
// mapping its own area); CUDA refuses to open one IPC handle twice in a process. Built only
// with CUDA.
#pragma once

#if EPD_HAVE_CUDA

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "client/cuda/cuda_ipc.h"

namespace epd::internal {

/// The mapping of the data area exported as `ipc_handle` (cudaIpcMemHandle_t bytes) on GPU
/// `gpu_uuid`, shared by every endpoint of this process that maps it: opened once
/// (CudaAreaMapping::Open) and closed when the last holder releases it. Errors: those of
/// CudaAreaMapping::Open.
absl::StatusOr<std::shared_ptr<const CudaAreaMapping>> MapSharedArea(const std::string& ipc_handle,
                                                                     const std::string& gpu_uuid);

}  // namespace epd::internal

#endif  // EPD_HAVE_CUDA
