// The CUDA runtime error-checking macros of daemon, client and kernels: a call's error as
// absl::Status naming the call, file, line and CUDA error, and a best-effort form for
// clean-up paths. Needs the CUDA runtime headers (include only where CUDA is built).
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"

namespace epd {

/// OK for cudaSuccess; otherwise "<call> failed at <file>:<line>: <name>: <string>" with the
/// error catalog's reason of the CUDA error (common/errors/reason.h: CUDA_DRIVER_TOO_OLD,
/// GPU_ARCH_UNSUPPORTED, GPU_OUT_OF_MEMORY, ..., else CUDA_ERROR) and that reason's status
/// code (INTERNAL for CUDA_ERROR).
/// Also clears a non-sticky error (cudaGetLastError) so a later check does not report it
/// again (NCCL's CUDACHECK habit).
absl::Status CudaErrorToStatus(cudaError_t err, const char* call, const char* file, int line);

/// Discards `err` of a best-effort call (clean-up, a destructor) and clears a non-sticky
/// error so a later check does not report it.
void IgnoreCudaError(cudaError_t err);

}  // namespace epd

/// `EPD_CUDA_STATUS(cudaMalloc(&p, n))` evaluates a CUDA runtime call and yields an
/// absl::Status naming the call, file, line and cudaGetErrorString.
#define EPD_CUDA_STATUS(call) ::epd::CudaErrorToStatus((call), #call, __FILE__, __LINE__)

/// Returns the CUDA call's error as absl::Status from the enclosing function.
#define EPD_CUDA_RETURN_IF_ERROR(call)                       \
  do {                                                       \
    ::absl::Status epd_cuda_status_ = EPD_CUDA_STATUS(call); \
    if (!epd_cuda_status_.ok()) return epd_cuda_status_;     \
  } while (0)

/// Evaluates a best-effort CUDA call (clean-up after a failure, a destructor) whose error
/// nobody can act on: the error is dropped and a non-sticky one cleared.
#define EPD_CUDA_IGNORE(call) ::epd::IgnoreCudaError((call))
