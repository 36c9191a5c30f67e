// CopySpansAsync (cuda_mirror.h): a GPU data area to its host-mapped mirror and back.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "epd/kernels/cuda_mirror.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/copy_bytes.cuh"

namespace epd::kernels::cuda {
namespace {

struct SpanCopyParams {
  uint8_t* dst;
  const uint8_t* src;
  const Region* spans;
  int32_t num_spans;
  uint32_t* counter;
  uint64_t* signal;
  uint64_t signal_value;
};

__global__ void CopySpansKernel(const SpanCopyParams p) {
  // The span table is read once per block (it may be host memory, across PCIe).
  __shared__ Region spans[kMaxAreaSpans];
  for (int32_t i = static_cast<int32_t>(threadIdx.x); i < p.num_spans; i += blockDim.x) {
    spans[i] = p.spans[i];
  }
  __syncthreads();
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int32_t s = 0; s < p.num_spans; ++s) {
    device::CopyBytes(p.dst + spans[s].offset, p.src + spans[s].offset, spans[s].bytes, first,
                      stride);
  }
  if (p.signal == nullptr) return;
  // Every thread's writes are made visible system-wide before its block takes a ticket.
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (gridDim.x > 1) {
    const uint32_t ticket = atomicAdd(p.counter, 1u);
    if (ticket != gridDim.x - 1) return;
    __threadfence_system();
    *p.counter = 0;
  }
  device::StReleaseSys64(p.signal, p.signal_value);
}

}  // namespace

absl::Status CopySpansAsync(uint8_t* dst, const uint8_t* src, const Region* spans,
                            int32_t num_spans, uint64_t total_bytes, uint32_t* counter,
                            uint64_t* signal, uint64_t signal_value, cudaStream_t stream) {
  if (num_spans < 0 || num_spans > kMaxAreaSpans) {
    return absl::InvalidArgumentError(absl::StrCat("CopySpansAsync: num_spans = ", num_spans,
                                                   " is outside [0, ", kMaxAreaSpans, "]"));
  }
  if (num_spans > 0 && (dst == nullptr || src == nullptr || spans == nullptr)) {
    return absl::InvalidArgumentError("CopySpansAsync: a null destination, source or span table");
  }
  if (num_spans == 0 && signal == nullptr) return absl::OkStatus();
  // At most 64 blocks: reads or writes across PCIe want many requests in flight.
  const uint64_t blocks = CopyBlocks(total_bytes, 64);
  if (signal != nullptr && blocks > 1 && counter == nullptr) {
    return absl::InvalidArgumentError(
        "CopySpansAsync: a signal after a multi-block copy needs a counter word");
  }
  SpanCopyParams p{dst, src, spans, num_spans, counter, signal, signal_value};
  void* args[] = {&p};
  return EPD_CUDA_STATUS(cudaLaunchKernel(reinterpret_cast<const void*>(&CopySpansKernel),
                                          dim3(static_cast<unsigned>(blocks)), dim3(kCopyThreads),
                                          args, 0, stream));
}

}  // namespace epd::kernels::cuda
