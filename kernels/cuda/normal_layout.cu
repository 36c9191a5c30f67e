// GetDispatchLayout on CUDA (host_ops.h: GetDispatchLayout): per-rank and per-expert token
// counts and the [T, R] membership table, from topk_idx alone (no other rank involved).
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda/cuda_check.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_normal.h"
#include "epd/kernels/cuda_ops.h"
#include "kernels/cuda/normal_common.cuh"

namespace epd::kernels::cuda {
namespace normal {
namespace {

/// Grid of num_sms blocks of kNormalThreads, one thread per token (grid-stride). Each block
/// counts into shared histograms ([E] dynamic, [R] static) and adds them to the outputs,
/// which the launcher zeroed before. A duplicate expert in a row is counted once; ids
/// outside [-1, E) are counted into DeviceStatus and skipped.
__global__ void __launch_bounds__(kNormalThreads) NormalLayoutKernel(NormalParams p) {
  extern __shared__ int32_t s_expert_count[];
  __shared__ int32_t s_rank_count[kNormalMaxRanks];
  __shared__ unsigned int s_bad;
  const int num_ranks = p.shape.num_ranks;
  const int num_experts = p.shape.num_experts;
  const int num_topk = p.shape.num_topk;
  const int experts_per_rank = num_experts / num_ranks;
  const int tid = threadIdx.x;
  for (int e = tid; e < num_experts; e += blockDim.x) s_expert_count[e] = 0;
  for (int r = tid; r < kNormalMaxRanks; r += blockDim.x) s_rank_count[r] = 0;
  if (tid == 0) s_bad = 0;
  __syncthreads();

  uint8_t* own = p.peer_bases[p.rank];
  const int num_tokens = ReadNumTokens(p, blockIdx.x == 0 && tid == 0);
  const int64_t* topk_idx =
      p.topk_idx != nullptr ? p.topk_idx : Region<const int64_t>(own, p.layout.in_topk_idx);
  uint8_t* in_rank = Region<uint8_t>(own, p.layout.layout_is_token_in_rank);
  unsigned int bad = 0;
  for (int t = blockIdx.x * blockDim.x + tid; t < num_tokens; t += gridDim.x * blockDim.x) {
    const uint64_t mask = ScanTopkRow(topk_idx + static_cast<int64_t>(t) * num_topk, num_topk,
                                      num_experts, experts_per_rank, s_expert_count, &bad);
    uint8_t* in_rank_row = in_rank + static_cast<int64_t>(t) * num_ranks;
    for (int r = 0; r < num_ranks; ++r) {
      const bool in = (mask >> r) & 1ull;
      in_rank_row[r] = in ? 1 : 0;
      if (in) atomicAdd(&s_rank_count[r], 1);
    }
  }
  if (bad != 0) atomicAdd(&s_bad, bad);
  __syncthreads();
  int32_t* per_expert = Region<int32_t>(own, p.layout.layout_tokens_per_expert);
  int32_t* per_rank = Region<int32_t>(own, p.layout.layout_tokens_per_rank);
  for (int e = tid; e < num_experts; e += blockDim.x) {
    if (s_expert_count[e] != 0) atomicAdd(&per_expert[e], s_expert_count[e]);
  }
  for (int r = tid; r < num_ranks; r += blockDim.x) {
    if (s_rank_count[r] != 0) atomicAdd(&per_rank[r], s_rank_count[r]);
  }
  if (tid == 0 && s_bad != 0) atomicAdd(&OwnStatus(p)->bad_expert_ids, s_bad);
}

absl::Status PreloadLayoutKernels() {
  cudaFuncAttributes attr;
  return EPD_CUDA_STATUS(cudaFuncGetAttributes(&attr, NormalLayoutKernel));
}
const bool kLayoutPreloadRegistered = RegisterPreloadHook(&PreloadLayoutKernels);

}  // namespace
}  // namespace normal

absl::Status GetDispatchLayout(const CudaRankContext& ctx, const GetDispatchLayoutArgs& args,
                               cudaStream_t stream) {
  normal::NormalParams p;
  int32_t num_blocks = 0;
  EPD_RETURN_IF_ERROR(normal::MakeNormalParams(ctx, args.num_tokens, &p, &num_blocks));
  p.topk_idx = args.topk_idx;
  uint8_t* own = ctx.own_base;
  EPD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(own + ctx.layout.layout_tokens_per_rank.offset, 0,
                                           ctx.layout.layout_tokens_per_rank.bytes, stream));
  EPD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(own + ctx.layout.layout_tokens_per_expert.offset, 0,
                                           ctx.layout.layout_tokens_per_expert.bytes, stream));
  const size_t shared = sizeof(int32_t) * ctx.shape.num_experts;
  normal::NormalLayoutKernel<<<num_blocks, kNormalThreads, shared, stream>>>(p);
  return EPD_CUDA_STATUS(cudaGetLastError());
}

}  // namespace epd::kernels::cuda
