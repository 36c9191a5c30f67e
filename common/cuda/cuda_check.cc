// CUDA error to absl::Status (cuda_check.h).
#include "common/cuda/cuda_check.h"

#include "absl/strings/str_cat.h"

namespace epd {

absl::Status CudaErrorToStatus(cudaError_t err, const char* call, const char* file, int line) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // clear a non-sticky error so the next check does not see it again
  return absl::InternalError(absl::StrCat(call, " failed at ", file, ":", line, ": ",
                                          cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
}

void IgnoreCudaError(cudaError_t err) {
  if (err != cudaSuccess) cudaGetLastError();
}

}  // namespace epd
