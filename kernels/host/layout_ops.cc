// GetDispatchLayout on the CPU (host_ops.h).
#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "epd/kernels/host_ops.h"
#include "kernels/host/internal.h"

namespace epd::kernels::host {

absl::Status GetDispatchLayout(const GroupShape& shape, const LayoutRankArgs& args,
                               const HostExecution& exec) {
  constexpr const char* kOp = "GetDispatchLayout";
  EPD_RETURN_IF_ERROR(internal::CheckGroupShape(shape));
  // LayoutRankArgs does not say which rank it is: errors name the token, k and value.
  if (args.num_tokens < 0 || args.num_tokens > shape.max_tokens_per_rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": num_tokens = ", args.num_tokens,
                     " is outside [0, max_tokens_per_rank = ", shape.max_tokens_per_rank, "]"));
  }
  EPD_RETURN_IF_ERROR(internal::CheckTopkIdxImpl(shape, -1, args.num_tokens, args.topk_idx));
  if (args.num_tokens_per_rank == nullptr || args.num_tokens_per_expert == nullptr ||
      (args.num_tokens > 0 && args.is_token_in_rank == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp,
                     ": an output is null (num_tokens_per_rank, num_tokens_per_expert, "
                     "is_token_in_rank)"));
  }

  const int32_t num_ranks = shape.num_ranks;
  const int32_t num_experts = shape.num_experts;
  const int32_t num_topk = shape.num_topk;
  const int32_t experts_per_rank = shape.num_local_experts();
  const int32_t num_tokens = args.num_tokens;

  // Chunks of tokens; each chunk counts into its own row of partial sums, added in chunk
  // order afterwards (integer sums: the result does not depend on the thread count).
  constexpr int32_t kGrain = 1024;
  const int32_t num_chunks = (num_tokens + kGrain - 1) / kGrain;
  internal::OpContext ctx(exec);
  internal::ScratchState& scratch = ctx.scratch();
  std::vector<int32_t>& per_rank = scratch.layout_per_rank;
  std::vector<int32_t>& per_expert = scratch.layout_per_expert;
  per_rank.assign(static_cast<size_t>(num_chunks) * num_ranks, 0);
  per_expert.assign(static_cast<size_t>(num_chunks) * num_experts, 0);
  ctx.ParallelFor(num_chunks, [&](int64_t c, int) {
    int32_t* rank_count = per_rank.data() + c * num_ranks;
    int32_t* expert_count = per_expert.data() + c * num_experts;
    const int32_t end = std::min<int32_t>(num_tokens, static_cast<int32_t>(c + 1) * kGrain);
    for (int32_t t = static_cast<int32_t>(c) * kGrain; t < end; ++t) {
      const int64_t* row = args.topk_idx + static_cast<int64_t>(t) * num_topk;
      uint8_t* in_rank = args.is_token_in_rank + static_cast<int64_t>(t) * num_ranks;
      std::memset(in_rank, 0, static_cast<size_t>(num_ranks));
      for (int k = 0; k < num_topk; ++k) {
        const int64_t e = row[k];
        if (e < 0 || internal::IsDuplicateInRow(row, k)) continue;
        ++expert_count[e];
        in_rank[e / experts_per_rank] = 1;
      }
      for (int32_t r = 0; r < num_ranks; ++r) rank_count[r] += in_rank[r];
    }
  });
  for (int32_t r = 0; r < num_ranks; ++r) {
    int32_t sum = 0;
    for (int32_t c = 0; c < num_chunks; ++c)
      sum += per_rank[static_cast<size_t>(c) * num_ranks + r];
    args.num_tokens_per_rank[r] = sum;
  }
  for (int32_t e = 0; e < num_experts; ++e) {
    int32_t sum = 0;
    for (int32_t c = 0; c < num_chunks; ++c) {
      sum += per_expert[static_cast<size_t>(c) * num_experts + e];
    }
    args.num_tokens_per_expert[e] = sum;
  }
  return absl::OkStatus();
}

}  // namespace epd::kernels::host
