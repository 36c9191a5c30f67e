// The host-side checks shared by the fused low-latency launchers (LowLatencyDispatchRanks,
// LowLatencyCombineRanks: ll_internal.h PrepareFusedRanks): the ranks of one launch, and the
// errors that name one of them.
#include <span>
#include <string>

#include "absl/strings/str_cat.h"
#include "epd/kernels/cuda_ops.h"
#include "kernels/cuda/ll_internal.h"

namespace epd::kernels::cuda::internal {

absl::Status ValidateFusedRanks(std::span<const CudaRankContext> ctxs, size_t num_args,
                                const char* op) {
  if (ctxs.empty() || ctxs.size() > static_cast<size_t>(kMaxFusedRanks)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ctxs.size() = ", ctxs.size(),
                     " ranks is outside [1, kMaxFusedRanks = ", kMaxFusedRanks, "]"));
  }
  if (num_args != ctxs.size()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": args.size() = ", num_args,
                                                   " differs from ctxs.size() = ", ctxs.size()));
  }
  const GroupShape& s0 = ctxs[0].shape;
  for (size_t i = 0; i < ctxs.size(); ++i) {
    const GroupShape& s = ctxs[i].shape;
    const char* field = s.num_ranks != s0.num_ranks                       ? "num_ranks"
                        : s.num_experts != s0.num_experts                 ? "num_experts"
                        : s.hidden != s0.hidden                           ? "hidden"
                        : s.num_topk != s0.num_topk                       ? "num_topk"
                        : s.max_tokens_per_rank != s0.max_tokens_per_rank ? "max_tokens_per_rank"
                        : s.ll_max_tokens_per_rank != s0.ll_max_tokens_per_rank
                            ? "ll_max_tokens_per_rank"
                        : s.use_fp8 != s0.use_fp8 ? "use_fp8"
                                                  : nullptr;
    if (field != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(FusedRankPrefix(op, ctxs, i), ": shape.",
                                                     field, " differs from ranks[0]'s; a fused ",
                                                     "launch takes ranks of one group"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (ctxs[j].rank == ctxs[i].rank) {
        return absl::InvalidArgumentError(
            absl::StrCat(FusedRankPrefix(op, ctxs, i), ": rank given twice (also ranks[", j, "])"));
      }
    }
  }
  return absl::OkStatus();
}

std::string FusedRankPrefix(const char* op, std::span<const CudaRankContext> ctxs, size_t i) {
  return absl::StrCat(op, ": ranks[", i, "] (rank ", ctxs[i].rank, ")");
}

absl::Status FusedArgDiffers(const std::string& prefix, const char* field,
                             std::span<const CudaRankContext> ctxs) {
  return absl::InvalidArgumentError(absl::StrCat(prefix, ": args.", field,
                                                 " differs from ranks[0]'s (rank ", ctxs[0].rank,
                                                 "); a fused launch needs them equal"));
}

absl::Status CheckFusedGrid(const std::string& prefix, int32_t num_blocks,
                            int32_t first_num_blocks) {
  if (num_blocks == first_num_blocks) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      prefix, ": num_sms resolves to ", num_blocks, " blocks where ranks[0]'s resolves to ",
      first_num_blocks, " (num_sms, sms_left_per_rank and ranks_on_device must agree)"));
}

}  // namespace epd::kernels::cuda::internal
