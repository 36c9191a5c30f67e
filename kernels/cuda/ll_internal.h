// Internal declarations shared by the low-latency CUDA sources (not part of the API).
#pragma once

#include <cuda_runtime.h>

#include <span>
#include <string>

#include "absl/status/status.h"
#include "common/cuda/cuda_check.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/cuda_specialise.h"
#include "kernels/cuda/programmatic_launch.h"

namespace epd::kernels::cuda::internal {

/// cudaFuncGetAttributes on every low-latency kernel (called by PreloadKernels).
absl::Status PreloadLowLatencyDispatchKernels();
absl::Status PreloadLowLatencyCombineKernels();
inline absl::Status PreloadLowLatencyKernels() {
  absl::Status s = PreloadLowLatencyDispatchKernels();
  if (!s.ok()) return s;
  return PreloadLowLatencyCombineKernels();
}

/// Launches `kernel<<<num_blocks, kLowLatencyThreads, smem, stream>>>(params)`; with
/// `programmatic`, through cudaLaunchKernelEx with programmatic stream serialization, so it
/// starts as soon as the WaitFlagAsync kernel before it on the stream lets it
/// (KernelHandoff::programmatic). Errors: INTERNAL for a launch error.
template <typename Params>
absl::Status LaunchLowLatency(void (*kernel)(Params), int32_t num_blocks, size_t smem,
                              bool programmatic, cudaStream_t stream, const Params& params) {
  if (!programmatic) {
    kernel<<<num_blocks, kLowLatencyThreads, smem, stream>>>(params);
    return EPD_CUDA_STATUS(cudaGetLastError());
  }
  return LaunchProgrammatic(kernel, num_blocks, kLowLatencyThreads, smem, stream, params);
}

/// The parameters of a fused launch (LowLatencyDispatchRanks / LowLatencyCombineRanks), in
/// the kernel's parameter space: ranks[0, num_ranks) are set; the grid is num_ranks *
/// blocks_per_rank blocks, blocks [r * B, (r + 1) * B) running rank r (B = blocks_per_rank).
template <typename Params>
struct FusedParams {
  static_assert(sizeof(Params) * kMaxFusedRanks + 64 <= 4096,
                "a fused launch's params must fit the 4 KiB kernel parameter space");
  Params ranks[kMaxFusedRanks];
  int32_t num_ranks;
  int32_t blocks_per_rank;
};

/// An op's kernel instance in both forms: one rank per launch, and fused.
template <typename Params>
struct KernelPair {
  void (*rank)(Params);
  void (*fused)(FusedParams<Params>);
};

#ifdef __CUDACC__
/// Runs `Body(params, block, num_blocks)` (a low-latency op's body) for this block's rank of
/// a fused launch, with the block's index among that rank's blocks. One thread first copies
/// the rank's params into shared memory (a switch over the ranks), and the body reads them
/// there. Why a copy: with the params `__grid_constant__` and read by the bodies in place,
/// every kernel with a hand-off failed with an illegal address on the H200 (CUDA 13.0), and
/// the same code with the params copied passes; the cause was not established
/// (docs/CUDA_BACKEND.md "Every rank of a GPU in one launch").
template <typename Params, void (*Body)(const Params&, int32_t, int32_t)>
__device__ __forceinline__ void RunFusedRank(const FusedParams<Params>& fp) {
  static_assert(kMaxFusedRanks == 8, "RunFusedRank's switch names every rank of a fused launch");
  __shared__ __align__(16) unsigned char s_params[sizeof(Params)];
  const int32_t r = static_cast<int32_t>(blockIdx.x) / fp.blocks_per_rank;
  if (threadIdx.x == 0) {
    Params* dst = reinterpret_cast<Params*>(s_params);
    switch (r) {
      case 0:
        *dst = fp.ranks[0];
        break;
      case 1:
        *dst = fp.ranks[1];
        break;
      case 2:
        *dst = fp.ranks[2];
        break;
      case 3:
        *dst = fp.ranks[3];
        break;
      case 4:
        *dst = fp.ranks[4];
        break;
      case 5:
        *dst = fp.ranks[5];
        break;
      case 6:
        *dst = fp.ranks[6];
        break;
      default:
        *dst = fp.ranks[7];
        break;
    }
  }
  __syncthreads();
  Body(*reinterpret_cast<const Params*>(s_params),
       static_cast<int32_t>(blockIdx.x) - r * fp.blocks_per_rank, fp.blocks_per_rank);
}
#endif

/// A low-latency kernel's view of the group's shape: each of hidden, top-k and experts per
/// rank is either a compile-time constant (a specialised instance; > 0) or read from the
/// kernel's params (0). The launchers pick a specialised instance only for a group whose
/// shape has exactly these values (LowLatencySpecialisedFor), so either way the kernel
/// computes the same thing; the constants only let the compiler fold divisions, bounds and
/// loop counts.
template <int32_t kHiddenValue, int32_t kTopkValue, int32_t kExpertsPerRankValue>
struct LowLatencyShape {
  static constexpr int32_t kHidden = kHiddenValue;
  static constexpr int32_t kTopk = kTopkValue;
  static constexpr int32_t kExpertsPerRank = kExpertsPerRankValue;
  template <typename Params>
  __host__ __device__ __forceinline__ static int32_t Hidden(const Params& p) {
    return kHidden > 0 ? kHidden : p.hidden;
  }
  template <typename Params>
  __host__ __device__ __forceinline__ static int32_t Topk(const Params& p) {
    return kTopk > 0 ? kTopk : p.num_topk;
  }
  template <typename Params>
  __host__ __device__ __forceinline__ static int32_t ExpertsPerRank(const Params& p) {
    return kExpertsPerRank > 0 ? kExpertsPerRank : p.experts_per_rank;
  }
  /// Whether H is known to be a whole number of `chunk`-channel chunks (no tail checks).
  static constexpr bool FullChunks(int32_t chunk) { return kHidden > 0 && kHidden % chunk == 0; }
};
/// Every value from the params: the kernels every shape can run.
using GenericShape = LowLatencyShape<0, 0, 0>;
/// The specialised instances' shape (kLowLatencySpecialised*: DeepSeek-V3 decode).
using SpecialisedShape = LowLatencyShape<kLowLatencySpecialisedHidden, kLowLatencySpecialisedTopk,
                                         kLowLatencySpecialisedExpertsPerRank>;

/// Checks shared by both low-latency launchers: ValidateContext, Mll > 0, buffer in
/// [0, kLowLatencyBuffers), and the exchange fits the sync region.
absl::Status ValidateLowLatency(const CudaRankContext& ctx, int32_t buffer, const char* op);

/// Checks shared by the fused launchers (LowLatencyDispatchRanks / LowLatencyCombineRanks)
/// before any rank's own checks: 1..kMaxFusedRanks contexts, as many args (`num_args`), no
/// rank given twice, every shape equal to ctxs[0]'s. INVALID_ARGUMENT naming the field.
absl::Status ValidateFusedRanks(std::span<const CudaRankContext> ctxs, size_t num_args,
                                const char* op);

/// "op: ranks[i] (rank r)", the prefix of a fused launcher's errors about one rank.
std::string FusedRankPrefix(const char* op, std::span<const CudaRankContext> ctxs, size_t i);

/// INVALID_ARGUMENT (after `prefix`) when a rank's grid (`num_blocks`) differs from
/// ranks[0]'s (`first_num_blocks`): every rank of a fused launch has the same blocks.
absl::Status CheckFusedGrid(const std::string& prefix, int32_t num_blocks,
                            int32_t first_num_blocks);

/// INVALID_ARGUMENT (after `prefix`): args.`field` of a rank differs from ranks[0]'s.
absl::Status FusedArgDiffers(const std::string& prefix, const char* field,
                             std::span<const CudaRankContext> ctxs);

/// The host side shared by the fused launchers: ValidateFusedRanks, then per rank
/// `prepare(ctx, args, prefix, &prepared)` (the per-rank launcher's checks and params;
/// Prepared has p, num_blocks and variant), `differs(args[i], args[0])` (the name of an
/// argument that must agree, or null), the same kernel variant (else `variant_field` is
/// named) and the same grid. Fills `fp` and `*first` (ranks[0]'s Prepared); nothing is
/// launched.
template <typename Args, typename Prepared, typename Params>
absl::Status PrepareFusedRanks(
    std::span<const CudaRankContext> ctxs, std::span<const Args> args, const char* op,
    absl::Status (*prepare)(const CudaRankContext&, const Args&, const char*, Prepared*),
    const char* (*differs)(const Args&, const Args&), const char* variant_field,
    FusedParams<Params>* fp, Prepared* first) {
  EPD_RETURN_IF_ERROR(ValidateFusedRanks(ctxs, args.size(), op));
  fp->num_ranks = static_cast<int32_t>(ctxs.size());
  for (size_t i = 0; i < ctxs.size(); ++i) {
    Prepared d;
    // The errors' prefix naming the rank is built only on the error path: the daemon's
    // engine calls this per op and allocates nothing there.
    if (!prepare(ctxs[i], args[i], op, &d).ok()) {
      const std::string prefix = FusedRankPrefix(op, ctxs, i);
      return prepare(ctxs[i], args[i], prefix.c_str(), &d);
    }
    if (i == 0) *first = d;
    const char* field = differs(args[i], args[0]);
    if (field == nullptr && d.variant != first->variant) field = variant_field;
    if (field != nullptr) return FusedArgDiffers(FusedRankPrefix(op, ctxs, i), field, ctxs);
    if (d.num_blocks != first->num_blocks) {
      return CheckFusedGrid(FusedRankPrefix(op, ctxs, i), d.num_blocks, first->num_blocks);
    }
    fp->ranks[i] = d.p;
  }
  fp->blocks_per_rank = first->num_blocks;
  return absl::OkStatus();
}

}  // namespace epd::kernels::cuda::internal
