// Per-rank host-op steps shared by the host backend and the exchange (rank_routing.h).
#include "daemon/dataplane/exchange/rank_routing.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace epd {

RankRouting::RankRouting(const kernels::GroupShape& s)
    : topk_idx(static_cast<size_t>(s.max_input_tokens()) * s.num_topk),
      send_pos(static_cast<size_t>(s.max_tokens_per_rank) * s.num_ranks) {
  for (auto& h : ll_handle_pos) {
    h.resize(static_cast<size_t>(s.ll_max_tokens_per_rank) * s.num_topk);
  }
}

absl::StatusOr<const int64_t*> TakeTopkIdx(const kernels::GroupShape& shape,
                                           const kernels::EndpointLayout& layout, uint8_t* data,
                                           RankRouting& routing, int32_t rank, int32_t num_tokens) {
  // num_tokens comes from the validated slot: at most max(M, Mll) rows.
  const size_t n = static_cast<size_t>(std::max(num_tokens, 0)) * shape.num_topk;
  if (n > routing.topk_idx.size()) {
    return absl::InternalError(absl::StrCat("rank ", rank, ": num_tokens ", num_tokens,
                                            " exceeds the private topk_idx copy"));
  }
  std::memcpy(routing.topk_idx.data(), RegionPtr<const int64_t>(data, layout.in_topk_idx),
              n * sizeof(int64_t));
  EPD_RETURN_IF_ERROR(
      kernels::host::CheckTopkIdx(shape, rank, num_tokens, routing.topk_idx.data()));
  return routing.topk_idx.data();
}

void PublishRouting(uint8_t* data, const std::vector<int32_t>& src, int64_t rows, int64_t row_elems,
                    const kernels::Region& dst) {
  const uint64_t bytes = static_cast<uint64_t>(std::max<int64_t>(rows, 0)) *
                         static_cast<uint64_t>(row_elems) * sizeof(int32_t);
  std::memcpy(RegionPtr<int32_t>(data, dst), src.data(),
              std::min({bytes, dst.bytes, src.size() * sizeof(int32_t)}));
}

absl::Status RunLayoutOp(const kernels::GroupShape& shape, const kernels::EndpointLayout& layout,
                         uint8_t* data, RankRouting& routing, int32_t rank,
                         const abi::RequestSlot& slot, const kernels::host::HostExecution& exec,
                         const std::function<void(bool)>* on_kernels) {
  kernels::host::LayoutRankArgs a;
  a.num_tokens = slot.num_tokens;
  a.num_tokens_per_rank = RegionPtr<int32_t>(data, layout.layout_tokens_per_rank);
  a.num_tokens_per_expert = RegionPtr<int32_t>(data, layout.layout_tokens_per_expert);
  a.is_token_in_rank = RegionPtr<uint8_t>(data, layout.layout_is_token_in_rank);
  EPD_ASSIGN_OR_RETURN(a.topk_idx, TakeTopkIdx(shape, layout, data, routing, rank, a.num_tokens));
  KernelScope k(on_kernels);
  return kernels::host::GetDispatchLayout(shape, a, exec);
}

}  // namespace epd
