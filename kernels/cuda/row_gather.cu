// GatherRowsAsync (cuda_gather.h): a rank's received rows into its GPU area.
#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "epd/kernels/cuda_gather.h"
#include "epd/kernels/types.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/copy_bytes.cuh"

namespace epd::kernels::cuda {
namespace {

constexpr int kGatherThreads = 256;
constexpr int kWarps = kGatherThreads / 32;

struct GatherParams {
  GroupShape shape;
  RowGather g;
  const GatherWindow* windows;
  int32_t num_windows;
};

__global__ void __launch_bounds__(kGatherThreads) GatherRowsKernel(const GatherParams p) {
  __shared__ int64_t first_row[kMaxGatherBlocks + 1];  // Prefix of the clamped counts.
  __shared__ GatherWindow windows[kMaxGatherWindows];
  const RowGather& g = p.g;
  for (int32_t i = static_cast<int32_t>(threadIdx.x); i < p.num_windows; i += blockDim.x) {
    windows[i] = p.windows[i];
  }
  // The counts may be host memory: read in parallel, then summed from shared memory.
  for (int32_t b = static_cast<int32_t>(threadIdx.x); b < g.blocks; b += blockDim.x) {
    const int64_t c = g.counts[b];
    first_row[b + 1] = c < 0 ? 0 : (c > g.block_rows ? g.block_rows : c);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    first_row[0] = 0;
    for (int32_t b = 0; b < g.blocks; ++b) first_row[b + 1] += first_row[b];
  }
  __syncthreads();
  const int32_t S = p.shape.num_scales();
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const bool ue8m0 = g.scales_kind == GatherScales::kLowLatencyUe8m0;
  const bool ll_scales = g.scales_kind == GatherScales::kLowLatency || ue8m0;
  int32_t b = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
       i < first_row[g.blocks]; i += warps) {
    while (first_row[b + 1] <= i) ++b;  // i only grows: the block only moves forward.
    const int64_t in_block = i - first_row[b];
    const int64_t row = b * g.block_rows + in_block;
    const RowSource src = g.sources[row];
    if (src.x == nullptr) continue;
    const uint8_t* x = TranslateWindow(src.x, windows, p.num_windows);
    device::CopyBytes(static_cast<uint8_t*>(g.x) + row * g.row_bytes, x,
                      static_cast<uint64_t>(g.row_bytes), lane, 32);
    if (src.scales == nullptr || g.scales_kind == GatherScales::kNone) continue;
    const auto* sc =
        reinterpret_cast<const float*>(TranslateWindow(src.scales, windows, p.num_windows));
    auto* out = static_cast<uint8_t*>(g.scales);
    for (int32_t s = lane; s < S; s += 32) {
      const float v = sc[s];
      if (!ll_scales) {
        reinterpret_cast<float*>(out)[row * S + s] = v;
      } else if (ue8m0) {
        out[LowLatencyScaleOffset(p.shape, true, b, in_block, s)] = Ue8m0Code(v);
      } else {
        *reinterpret_cast<float*>(out + LowLatencyScaleOffset(p.shape, false, b, in_block, s)) = v;
      }
    }
  }
}

}  // namespace

absl::Status GatherRowsAsync(const GroupShape& shape, const RowGather& g,
                             const GatherWindow* windows, int32_t num_windows,
                             cudaStream_t stream) {
  if (g.blocks < 0 || g.blocks > kMaxGatherBlocks) {
    return absl::InvalidArgumentError(absl::StrCat("GatherRowsAsync: blocks = ", g.blocks,
                                                   " is outside [0, ", kMaxGatherBlocks, "]"));
  }
  if (num_windows < 0 || num_windows > kMaxGatherWindows || (num_windows > 0 && !windows)) {
    return absl::InvalidArgumentError(absl::StrCat("GatherRowsAsync: num_windows = ", num_windows,
                                                   " is outside [0, ", kMaxGatherWindows,
                                                   "] or has no table"));
  }
  if (g.row_bytes < 0 || g.block_rows < 0) {
    return absl::InvalidArgumentError(absl::StrCat("GatherRowsAsync: row_bytes = ", g.row_bytes,
                                                   ", block_rows = ", g.block_rows));
  }
  if (g.blocks == 0) return absl::OkStatus();
  if (g.x == nullptr || g.counts == nullptr || g.sources == nullptr ||
      (g.scales_kind != GatherScales::kNone && g.scales == nullptr)) {
    return absl::InvalidArgumentError(
        "GatherRowsAsync: a null destination, count table, source table or scales region");
  }
  // Many rows in flight: the sources are mostly across PCIe.
  const unsigned grid = 264;
  GatherParams p{shape, g, windows, num_windows};
  void* args[] = {&p};
  return EPD_CUDA_STATUS(cudaLaunchKernel(reinterpret_cast<const void*>(&GatherRowsKernel),
                                          dim3(grid), dim3(kGatherThreads), args, 0, stream));
}

}  // namespace epd::kernels::cuda
