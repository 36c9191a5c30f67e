// DelayStreamAsync (stream_delay.h).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "tests/gpu/stream_delay.h"

namespace epd::testing {
namespace {

__device__ __forceinline__ uint64_t NowNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void DelayKernel(uint64_t ns) {
  const uint64_t end = NowNs() + ns;
  while (NowNs() < end) {
    __nanosleep(1000);
  }
}

}  // namespace

absl::Status DelayStreamAsync(cudaStream_t stream, int64_t ns) {
  const uint64_t bounded = static_cast<uint64_t>(std::clamp<int64_t>(ns, 0, 60'000'000'000));
  DelayKernel<<<1, 1, 0, stream>>>(bounded);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrCat("DelayKernel launch: ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

}  // namespace epd::testing
