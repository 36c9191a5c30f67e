// Host-side helpers of the normal-mode CUDA ops (cuda_normal.h): context checks, the
// run-time token-count slot, sync reset, and the optional CPU read of dispatch counts.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/env_switch.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_normal.h"
#include "epd/kernels/cuda_ops.h"
#include "kernels/cuda/normal_common.cuh"
#include "kernels/cuda/programmatic_launch.h"

namespace epd::kernels::cuda {
namespace {

__global__ void SetNumTokensKernel(int32_t* slot, int32_t value) { *slot = value; }

absl::Status PreloadHostKernels() {
  cudaFuncAttributes attr;
  return EPD_CUDA_STATUS(cudaFuncGetAttributes(&attr, SetNumTokensKernel));
}
const bool kHostPreloadRegistered = RegisterPreloadHook(&PreloadHostKernels);

NormalSyncLayout SyncMap(const GroupShape& shape) {
  NormalSyncLayout map;
  map.num_ranks = shape.num_ranks;
  map.num_experts = shape.num_experts;
  return map;
}

}  // namespace

absl::Status ValidateNormalContext(const CudaRankContext& ctx) {
  EPD_RETURN_IF_ERROR(ValidateContext(ctx));
  const GroupShape& s = ctx.shape;
  if (s.num_ranks < 1 || s.num_ranks > kNormalMaxRanks) {
    return absl::InvalidArgumentError(absl::StrCat("normal mode: num_ranks = ", s.num_ranks,
                                                   " is outside [1, ", kNormalMaxRanks, "]"));
  }
  if (s.num_experts < s.num_ranks || s.num_experts % s.num_ranks != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("normal mode: num_experts = ", s.num_experts,
                     " must be a positive multiple of num_ranks = ", s.num_ranks));
  }
  if (s.max_tokens_per_rank < 0 || s.hidden < 1 || s.num_topk < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "normal mode: max_tokens_per_rank = ", s.max_tokens_per_rank, ", hidden = ", s.hidden,
        ", num_topk = ", s.num_topk, " (need M >= 0, H >= 1, K >= 1)"));
  }
  const uint64_t need = SyncMap(s).bytes();
  if (need > kSyncNormalBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("normal mode: num_ranks = ", s.num_ranks, " and num_experts = ", s.num_experts,
                     " need ", need, " bytes of normal sync state, more than the ",
                     kSyncNormalBytes, " bytes reserved in the sync region"));
  }
  return absl::OkStatus();
}

int32_t* NormalNumTokensSlot(const CudaRankContext& ctx) {
  return reinterpret_cast<int32_t*>(ctx.own_base + ctx.layout.sync.offset + kSyncNormalOffset +
                                    NormalSyncLayout::kNumTokens);
}

absl::Status SetNormalNumTokensAsync(const CudaRankContext& ctx, int32_t num_tokens,
                                     cudaStream_t stream) {
  if (ctx.own_base == nullptr) {
    return absl::InvalidArgumentError("SetNormalNumTokensAsync: ctx.own_base is null");
  }
  SetNumTokensKernel<<<1, 1, 0, stream>>>(NormalNumTokensSlot(ctx), num_tokens);
  return EPD_CUDA_STATUS(cudaGetLastError());
}

absl::Status ResetNormalSync(const CudaRankContext& ctx, cudaStream_t stream) {
  EPD_RETURN_IF_ERROR(ValidateNormalContext(ctx));
  // Everything but the token-count slot: op counter, failed seq, block counter, flags,
  // counts.
  uint8_t* base = ctx.own_base + ctx.layout.sync.offset + kSyncNormalOffset;
  EPD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(base, 0, NormalSyncLayout::kNumTokens, stream));
  EPD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(base + NormalSyncLayout::kArrive, 0,
                                           SyncMap(ctx.shape).bytes() - NormalSyncLayout::kArrive,
                                           stream));
  return absl::OkStatus();
}

absl::StatusOr<NormalDispatchCounts> ReadNormalDispatchCounts(const CudaRankContext& ctx,
                                                              cudaStream_t stream) {
  EPD_RETURN_IF_ERROR(ValidateNormalContext(ctx));
  NormalDispatchCounts counts;
  counts.recv_tokens_per_expert.resize(ctx.shape.num_local_experts());
  counts.rank_prefix.resize(ctx.shape.num_ranks);
  EPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  EPD_CUDA_RETURN_IF_ERROR(cudaMemcpy(&counts.num_recv_tokens,
                                      ctx.own_base + ctx.layout.recv_count.offset, sizeof(int32_t),
                                      cudaMemcpyDeviceToHost));
  EPD_CUDA_RETURN_IF_ERROR(cudaMemcpy(
      counts.recv_tokens_per_expert.data(), ctx.own_base + ctx.layout.recv_tokens_per_expert.offset,
      sizeof(int32_t) * counts.recv_tokens_per_expert.size(), cudaMemcpyDeviceToHost));
  EPD_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(counts.rank_prefix.data(), ctx.own_base + ctx.layout.rank_prefix.offset,
                 sizeof(int32_t) * counts.rank_prefix.size(), cudaMemcpyDeviceToHost));
  return counts;
}

namespace normal {

absl::StatusOr<NormalKernelVariant> NormalKernelVariantFromEnv() {
  const char* v = std::getenv("EPD_NORMAL_KERNELS");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "balanced") == 0) {
    return NormalKernelVariant::kBalanced;
  }
  if (std::strcmp(v, "static") == 0) return NormalKernelVariant::kStatic;
  if (std::strcmp(v, "block") == 0) return NormalKernelVariant::kBlock;
  if (std::strcmp(v, "bulk") == 0) return NormalKernelVariant::kBulk;
  return absl::InvalidArgumentError(
      absl::StrCat("EPD_NORMAL_KERNELS = \"", v,
                   "\" is not one of \"balanced\", \"static\", \"block\", \"bulk\""));
}

namespace {

/// Whether the normal kernels on the current device have grid dependency control: the PTX
/// they were built from is for sm_90 or later (the library's kernels are built for one set
/// of architectures, so SetNumTokensKernel stands for all). Asked once per device (devices
/// past 63 on every call).
absl::StatusOr<bool> KernelsHaveGridDependencyControl() {
  static std::atomic<uint64_t> known{0};
  static std::atomic<uint64_t> have{0};
  int device = 0;
  EPD_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (known.load(std::memory_order_acquire) & bit) != 0) {
    return (have.load(std::memory_order_relaxed) & bit) != 0;
  }
  cudaFuncAttributes attr;
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, SetNumTokensKernel));
  const bool yes = attr.ptxVersion >= 90;
  if (yes) have.fetch_or(bit, std::memory_order_relaxed);
  known.fetch_or(bit, std::memory_order_release);
  return yes;
}

}  // namespace

absl::StatusOr<int32_t> NormalCopyPartsFromEnv() {
  const char* v = std::getenv("EPD_NORMAL_COPY_PARTS");
  if (v == nullptr || *v == '\0') return kDefaultCopyParts;
  int32_t parts = 0;
  if (!absl::SimpleAtoi(v, &parts) || parts < 1 || parts > kMaxCopyParts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "EPD_NORMAL_COPY_PARTS = \"", v, "\" is not a whole number in [1, ", kMaxCopyParts, "]"));
  }
  return parts;
}

absl::StatusOr<bool> NormalProgrammaticFromEnv() {
  EPD_ASSIGN_OR_RETURN(const bool on, SwitchFromEnv("EPD_NORMAL_PDL", /*unset=*/false));
  if (!on) return false;
  return KernelsHaveGridDependencyControl();
}

absl::StatusOr<bool> NormalGpuScopeFromEnv(const CudaRankContext& ctx) {
  // On by default: -4.5 us (0.9%) on the FP8 dispatch at T=4096 (docs/BENCHMARKS.md).
  EPD_ASSIGN_OR_RETURN(const bool on, SwitchFromEnv("EPD_NORMAL_GPU_SCOPE", /*unset=*/true));
  return on && ctx.all_ranks_on_device;
}

absl::Status LaunchSecondKernel(void (*kernel)(NormalParams), int32_t grid, int32_t threads,
                                size_t shared, cudaStream_t stream, const NormalParams& params) {
  if (params.programmatic == 0) {
    kernel<<<grid, threads, shared, stream>>>(params);
    return EPD_CUDA_STATUS(cudaGetLastError());
  }
  return internal::LaunchProgrammatic(kernel, grid, threads, shared, stream, params);
}

absl::Status MakeNormalParams(const CudaRankContext& ctx, const int32_t* num_tokens,
                              NormalParams* params, int32_t* num_blocks) {
  EPD_RETURN_IF_ERROR(ValidateNormalContext(ctx));
  EPD_RETURN_IF_ERROR(ResolveNumBlocks(ctx, num_blocks));
  NormalParams& p = *params;
  p.shape = ctx.shape;
  p.layout = ctx.layout;
  p.rank = ctx.rank;
  p.peer_bases = ctx.peer_bases;
  p.num_tokens = num_tokens != nullptr ? num_tokens : NormalNumTokensSlot(ctx);
  p.timeout_ns = ctx.timeout_ns;
  p.abort_flag = ctx.abort_flag;
  p.sync_map = SyncMap(ctx.shape);
  p.rank_masked = ctx.rank_masked;
  p.tiling = NormalDispatchTiling::For(ctx.shape.max_tokens_per_rank);
  EPD_ASSIGN_OR_RETURN(const NormalKernelVariant variant, NormalKernelVariantFromEnv());
  p.order = variant == NormalKernelVariant::kStatic  ? TokenOrder::kStatic
            : variant == NormalKernelVariant::kBlock ? TokenOrder::kBlock
                                                     : TokenOrder::kRank;
  p.combine_ranks_in_flight = variant == NormalKernelVariant::kStatic ? 1 : kCombineRanksInFlight;
  p.variant = variant;
  EPD_ASSIGN_OR_RETURN(const bool programmatic, NormalProgrammaticFromEnv());
  p.programmatic = programmatic ? 1 : 0;
  EPD_ASSIGN_OR_RETURN(const bool gpu_scope, NormalGpuScopeFromEnv(ctx));
  p.gpu_scope = gpu_scope ? 1 : 0;
  EPD_ASSIGN_OR_RETURN(p.copy_parts, NormalCopyPartsFromEnv());
  return absl::OkStatus();
}

}  // namespace normal
}  // namespace epd::kernels::cuda
