// QuantizeRowsFp8Async (cuda_gather.h): token rows to e4m3 with per-128-channel scales.
#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "epd/kernels/cuda_gather.h"
#include "epd/kernels/types.h"

namespace epd::kernels::cuda {
namespace {

constexpr int kQuantThreads = kFp8BlockChannels;  // One thread per channel of a block.

struct QuantParams {
  int32_t num_rows;
  int32_t hidden;
  const bf16_bits* x;
  bool round_scale;
  e4m3_bits* out;
  float* scales;
};

// One CTA per row; its 128 threads take the channels of each 128-channel block in turn:
// amax over the block (fmaxf of |x|, NaN ignored, as the host's std::fmax), Fp8Scale, then
// x / scale rounded to e4m3.
__global__ void __launch_bounds__(kQuantThreads) QuantizeRowsKernel(const QuantParams p) {
  __shared__ float warp_amax[kQuantThreads / 32];
  const int32_t S = (p.hidden + kFp8BlockChannels - 1) / kFp8BlockChannels;
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) / 32;
  for (int32_t row = static_cast<int32_t>(blockIdx.x); row < p.num_rows; row += gridDim.x) {
    const bf16_bits* x = p.x + static_cast<int64_t>(row) * p.hidden;
    e4m3_bits* out = p.out + static_cast<int64_t>(row) * p.hidden;
    for (int32_t g = 0; g < S; ++g) {
      const int32_t h = g * kFp8BlockChannels + static_cast<int32_t>(threadIdx.x);
      const float v = h < p.hidden ? Bf16ToFloat(x[h]) : 0.0f;
      float amax = fmaxf(0.0f, fabsf(v));  // A NaN counts as 0, as on the host.
      for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, off));
      if (lane == 0) warp_amax[warp] = amax;
      __syncthreads();
      amax = fmaxf(fmaxf(warp_amax[0], warp_amax[1]), fmaxf(warp_amax[2], warp_amax[3]));
      __syncthreads();  // warp_amax is written again by the next block.
      const float scale = Fp8Scale(amax, p.round_scale);
      if (h < p.hidden) out[h] = QuantizeE4m3(v, scale);
      if (threadIdx.x == 0) p.scales[static_cast<int64_t>(row) * S + g] = scale;
    }
  }
}

}  // namespace

absl::Status QuantizeRowsFp8Async(const GroupShape& shape, int32_t num_rows, const bf16_bits* x,
                                  bool round_scale, e4m3_bits* out, float* scales,
                                  cudaStream_t stream) {
  if (num_rows < 0 || (num_rows > 0 && (x == nullptr || out == nullptr || scales == nullptr))) {
    return absl::InvalidArgumentError(absl::StrCat("QuantizeRowsFp8Async: num_rows = ", num_rows,
                                                   " or a null row, output or scales pointer"));
  }
  if (num_rows == 0) return absl::OkStatus();
  static_assert(kQuantThreads == 128, "four warps reduce a block's amax");
  QuantParams p{num_rows, static_cast<int32_t>(shape.hidden), x, round_scale, out, scales};
  void* args[] = {&p};
  const unsigned grid = static_cast<unsigned>(num_rows < 1024 ? num_rows : 1024);
  return EPD_CUDA_STATUS(cudaLaunchKernel(reinterpret_cast<const void*>(&QuantizeRowsKernel),
                                          dim3(grid), dim3(kQuantThreads), args, 0, stream));
}

}  // namespace epd::kernels::cuda
