// Stream memory operations (stream_memops.h) through driver entry points resolved at run
// time, so neither daemon nor client links libcuda: both start where no NVIDIA driver is
// installed (CI) and run the host backend there.
#include "common/cuda/stream_memops.h"

#include <cuda.h>  // Driver API types only.

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/status_macros.h"

namespace epd {
namespace {

struct StreamMemOps {
  CUresult (*write_value64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int) = nullptr;
  CUresult (*wait_value64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int) = nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
};

/// The resolved entry points, or FAILED_PRECONDITION saying which one is missing.
absl::StatusOr<const StreamMemOps*> GetStreamMemOps() {
  static StreamMemOps ops;
  static const absl::Status status = [] {
    auto resolve = [](const char* name, void** fn) -> absl::Status {
      cudaDriverEntryPointQueryResult q{};
      EPD_CUDA_RETURN_IF_ERROR(
          cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &q));
      if (q != cudaDriverEntryPointSuccess || *fn == nullptr) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the CUDA driver has no entry point ", name, " (query result ", static_cast<int>(q),
            "); the stream-ordered hand-off needs a driver of CUDA 12.0 or later"));
      }
      return absl::OkStatus();
    };
    EPD_RETURN_IF_ERROR(
        resolve("cuStreamWriteValue64", reinterpret_cast<void**>(&ops.write_value64)));
    EPD_RETURN_IF_ERROR(
        resolve("cuStreamWaitValue64", reinterpret_cast<void**>(&ops.wait_value64)));
    return resolve("cuGetErrorString", reinterpret_cast<void**>(&ops.get_error_string));
  }();
  if (!status.ok()) return status;
  return &ops;
}

absl::Status DriverStatus(const StreamMemOps& ops, CUresult r, const char* call) {
  if (r == CUDA_SUCCESS) return absl::OkStatus();
  const char* msg = nullptr;
  ops.get_error_string(r, &msg);
  return absl::InternalError(absl::StrCat(call, " failed: CUresult ", static_cast<int>(r), ": ",
                                          msg != nullptr ? msg : "unknown error"));
}

}  // namespace

absl::Status StreamMemOpsAvailable() { return GetStreamMemOps().status(); }

absl::Status StreamWriteValue64(cudaStream_t stream, void* address, uint64_t value) {
  EPD_ASSIGN_OR_RETURN(const StreamMemOps* ops, GetStreamMemOps());
  return DriverStatus(
      *ops,
      ops->write_value64(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(address),
                         value, CU_STREAM_WRITE_VALUE_DEFAULT),
      "cuStreamWriteValue64");
}

absl::Status StreamWaitValue64Geq(cudaStream_t stream, const void* address, uint64_t value) {
  EPD_ASSIGN_OR_RETURN(const StreamMemOps* ops, GetStreamMemOps());
  return DriverStatus(
      *ops,
      ops->wait_value64(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(address),
                        value, CU_STREAM_WAIT_VALUE_GEQ),
      "cuStreamWaitValue64");
}

}  // namespace epd
