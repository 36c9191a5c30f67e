// The toy FP8 expert of graph_program_test (see graph_program_kernels.h).
#include "common/cuda/cuda_check.h"
#include "epd/kernels/cuda_ops.h"
#include "tests/gpu/graph_program_kernels.h"

namespace epd::testing {
namespace {

__global__ void DequantScaleExpertsKernel(const kernels::e4m3_bits* x, const void* scales,
                                          bool ue8m0, kernels::bf16_bits* y, int64_t rows,
                                          int64_t H, int64_t total) {
  const size_t cols = (ue8m0 ? H / 512 : H / kernels::kFp8BlockChannels);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / H;  // Row of [El * rows].
    const int64_t h = i % H;
    const int64_t j = row / rows;
    const float s = 0.5f + 0.25f * static_cast<float>(j % 4);
    const float scale = ProgramScaleAt(scales, ue8m0, cols, rows, j, row % rows,
                                       static_cast<int>(h / kernels::kFp8BlockChannels));
    const float v = __fmul_rn(__fmul_rn(kernels::E4m3ToFloat(x[i]), scale), s);
    y[i] = kernels::FloatToBf16(v);
  }
}

__global__ void PeekWordsKernel(const unsigned long long* src, int n, unsigned long long* host,
                                unsigned long long ticket) {
  for (int i = static_cast<int>(threadIdx.x); i < n; i += blockDim.x) {
    host[i] = reinterpret_cast<const volatile unsigned long long*>(src)[i];
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) reinterpret_cast<volatile unsigned long long*>(host)[kPeekWords] = ticket;
}

}  // namespace

absl::Status PeekWordsAsync(const void* src, int n, uint64_t* host_mapped, uint64_t ticket,
                            cudaStream_t stream) {
  PeekWordsKernel<<<1, kPeekWords, 0, stream>>>(
      static_cast<const unsigned long long*>(src), n < kPeekWords ? n : kPeekWords,
      reinterpret_cast<unsigned long long*>(host_mapped), ticket);
  return EPD_CUDA_STATUS(cudaGetLastError());
}

absl::Status LaunchDequantScaleExperts(const kernels::e4m3_bits* x, const void* scales, bool ue8m0,
                                       kernels::bf16_bits* y, int64_t El, int64_t rows, int64_t H,
                                       cudaStream_t stream) {
  DequantScaleExpertsKernel<<<64, 256, 0, stream>>>(x, scales, ue8m0, y, rows, H, El * rows * H);
  return EPD_CUDA_STATUS(cudaGetLastError());
}

}  // namespace epd::testing
