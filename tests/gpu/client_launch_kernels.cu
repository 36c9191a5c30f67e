// The toy expert of client_launch_test (see client_launch_kernels.h).
#include "common/cuda/cuda_check.h"
#include "epd/kernels/cuda_ops.h"
#include "tests/gpu/client_launch_kernels.h"

namespace epd::testing {
namespace {

__global__ void ScaleExpertsKernel(const kernels::bf16_bits* x, kernels::bf16_bits* y,
                                   int64_t per_expert, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float s = 0.5f + 0.25f * static_cast<float>((i / per_expert) % 4);
    y[i] = kernels::FloatToBf16(__fmul_rn(kernels::Bf16ToFloat(x[i]), s));
  }
}

}  // namespace

absl::Status LaunchScaleExperts(const kernels::bf16_bits* x, kernels::bf16_bits* y, int64_t El,
                                int64_t rows, int64_t H, cudaStream_t stream) {
  const int64_t total = El * rows * H;
  ScaleExpertsKernel<<<64, 256, 0, stream>>>(x, y, rows * H, total);
  return EPD_CUDA_STATUS(cudaGetLastError());
}

}  // namespace epd::testing
