// CUDA error to absl::Status (cuda_check.h).
#include "common/cuda/cuda_check.h"

#include "absl/strings/str_cat.h"
#include "common/errors/reason.h"

namespace epd {
namespace {

/// The catalog reason of a CUDA error; kCudaError for those without a more specific one.
errors::Reason ReasonOfCudaError(cudaError_t err) {
  switch (err) {
    case cudaErrorInsufficientDriver:
      return errors::Reason::kCudaDriverTooOld;
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
      return errors::Reason::kGpuArchUnsupported;
    case cudaErrorMemoryAllocation:
      return errors::Reason::kGpuOutOfMemory;
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
      return errors::Reason::kCudaNoDevice;
    case cudaErrorDevicesUnavailable:
      return errors::Reason::kGpuUnavailable;
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorAssert:
      return errors::Reason::kGpuKernelFault;
    default:
      return errors::Reason::kCudaError;
  }
}

}  // namespace

absl::Status CudaErrorToStatus(cudaError_t err, const char* call, const char* file, int line) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // clear a non-sticky error so the next check does not see it again
  // A specific reason comes with its catalog code (FAILED_PRECONDITION for a driver too
  // old, ...); the rest are INTERNAL.
  const errors::Reason reason = ReasonOfCudaError(err);
  const errors::ReasonInfo* info = errors::FindReason(static_cast<int32_t>(reason));
  return errors::WithReason(
      absl::Status(info != nullptr ? info->code : absl::StatusCode::kInternal,
                   absl::StrCat(call, " failed at ", file, ":", line, ": ", cudaGetErrorName(err),
                                ": ", cudaGetErrorString(err))),
      reason);
}

void IgnoreCudaError(cudaError_t err) {
  if (err != cudaSuccess) cudaGetLastError();
}

}  // namespace epd
