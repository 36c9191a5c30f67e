// QuantizeRowsFp8Async (cuda_gather.h): token rows to e4m3 with per-128-channel scales.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "epd/kernels/cuda_gather.h"
#include "epd/kernels/types.h"

namespace epd::kernels::cuda {
namespace {

constexpr int kQuantThreads = 256;
constexpr int kWarps = kQuantThreads / 32;
// A warp quantizes one 128-channel block, each lane four consecutive channels.
constexpr int kChannelsPerLane = kFp8BlockChannels / 32;
static_assert(kChannelsPerLane == 4, "a lane stores its four e4m3 bytes as one word");

struct QuantParams {
  int32_t num_rows;
  int32_t hidden;
  const bf16_bits* x;
  bool round_scale;
  e4m3_bits* out;
  float* scales;
  e4m3_bits* out_copy;
  float* scales_copy;
};

// amax over the block (fmaxf of |x|, a NaN counting as 0, as the host's std::fmax from 0),
// Fp8Scale, then x / scale rounded to e4m3: QuantizeRowFp8 bit for bit. The outputs go
// out as one 4-byte word per lane (128 contiguous bytes per warp), which matters when they
// are host memory across PCIe.
__global__ void __launch_bounds__(kQuantThreads) QuantizeRowsKernel(const QuantParams p) {
  const int32_t S = (p.hidden + kFp8BlockChannels - 1) / kFp8BlockChannels;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t blocks = static_cast<int64_t>(p.num_rows) * S;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; w < blocks;
       w += warps) {
    const int64_t row = w / S;
    const int32_t g = static_cast<int32_t>(w % S);
    const int32_t h0 = g * kFp8BlockChannels + lane * kChannelsPerLane;
    const bf16_bits* x = p.x + row * p.hidden;
    float v[kChannelsPerLane];
    float amax = 0.0f;
    for (int c = 0; c < kChannelsPerLane; ++c) {
      v[c] = h0 + c < p.hidden ? Bf16ToFloat(x[h0 + c]) : 0.0f;
      amax = fmaxf(amax, fabsf(v[c]));
    }
    for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, off));
    const float scale = Fp8Scale(amax, p.round_scale);
    uint32_t word = 0;
    for (int c = 0; c < kChannelsPerLane; ++c) {
      word |= static_cast<uint32_t>(QuantizeE4m3(v[c], scale)) << (8 * c);
    }
    const int64_t at = row * p.hidden + h0;
    auto store = [&](e4m3_bits* out) {
      if (h0 + kChannelsPerLane <= p.hidden && (at & 3) == 0) {
        *reinterpret_cast<uint32_t*>(out + at) = word;
      } else {
        for (int c = 0; c < kChannelsPerLane && h0 + c < p.hidden; ++c) {
          out[at + c] = static_cast<e4m3_bits>(word >> (8 * c));
        }
      }
    };
    store(p.out);
    if (p.out_copy != nullptr) store(p.out_copy);
    if (lane == 0) {
      p.scales[row * S + g] = scale;
      if (p.scales_copy != nullptr) p.scales_copy[row * S + g] = scale;
    }
  }
}

}  // namespace

absl::Status QuantizeRowsFp8Async(const GroupShape& shape, int32_t num_rows, const bf16_bits* x,
                                  bool round_scale, e4m3_bits* out, float* scales,
                                  cudaStream_t stream, e4m3_bits* out_copy, float* scales_copy) {
  if (num_rows < 0 || (num_rows > 0 && (x == nullptr || out == nullptr || scales == nullptr))) {
    return absl::InvalidArgumentError(absl::StrCat("QuantizeRowsFp8Async: num_rows = ", num_rows,
                                                   " or a null row, output or scales pointer"));
  }
  if (num_rows == 0) return absl::OkStatus();
  QuantParams p{
      num_rows,   static_cast<int32_t>(shape.hidden), x, round_scale, out, scales, out_copy,
      scales_copy};
  void* args[] = {&p};
  const int64_t warps = static_cast<int64_t>(num_rows) * shape.num_scales();
  const unsigned grid =
      static_cast<unsigned>(std::min<int64_t>((warps + kWarps - 1) / kWarps, 1056));
  return EPD_CUDA_STATUS(cudaLaunchKernel(reinterpret_cast<const void*>(&QuantizeRowsKernel),
                                          dim3(grid), dim3(kQuantThreads), args, 0, stream));
}

}  // namespace epd::kernels::cuda
