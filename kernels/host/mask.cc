// Rank masking on the host (host_ops.h: DropMaskedExperts, DropMaskedRoutes).
#include <cstdint>
#include <span>

#include "epd/kernels/host_ops.h"

namespace epd::kernels::host {

int32_t DropMaskedExperts(const GroupShape& shape, std::span<const uint8_t> rank_masked,
                          int32_t num_tokens, int64_t* topk_idx) {
  const int64_t experts_per_rank = shape.num_local_experts();
  const int64_t pairs = static_cast<int64_t>(num_tokens < 0 ? 0 : num_tokens) * shape.num_topk;
  int32_t dropped = 0;
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t e = topk_idx[i];
    if (e < 0 || e >= shape.num_experts) continue;
    const int64_t r = e / experts_per_rank;
    if (r < static_cast<int64_t>(rank_masked.size()) && rank_masked[r] != 0) {
      topk_idx[i] = -1;
      ++dropped;
    }
  }
  return dropped;
}

int32_t DropMaskedRoutes(const GroupShape& shape, std::span<const uint8_t> rank_masked,
                         int32_t num_tokens, int32_t* send_pos) {
  const int32_t num_ranks = shape.num_ranks;
  int32_t dropped = 0;
  for (int32_t t = 0; t < num_tokens; ++t) {
    int32_t* row = send_pos + static_cast<int64_t>(t) * num_ranks;
    for (int32_t r = 0; r < num_ranks && r < static_cast<int32_t>(rank_masked.size()); ++r) {
      if (rank_masked[r] != 0 && row[r] >= 0) {
        row[r] = -1;
        ++dropped;
      }
    }
  }
  return dropped;
}

}  // namespace epd::kernels::host
