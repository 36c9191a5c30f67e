// The one factory of a rank's CudaRankContext (see epd/kernels/rank_context.h).
#include "epd/kernels/rank_context.h"

namespace epd::kernels::cuda {

CudaRankContext MakeRankContext(const GroupShape& shape, const EndpointLayout& layout,
                                const RankPlacement& at, int32_t num_sms) {
  CudaRankContext ctx;
  ctx.shape = shape;
  ctx.layout = layout;
  ctx.rank = at.rank;
  ctx.peer_bases = at.peer_bases;
  ctx.own_base = at.own_base;
  ctx.num_sms = num_sms;
  ctx.ranks_on_device = at.ranks_on_device;
  ctx.all_ranks_on_device = at.ranks_on_device == shape.num_ranks;
  ctx.timeout_ns = static_cast<int64_t>(at.op_timeout_ms) * 1'000'000;
  return ctx;
}

}  // namespace epd::kernels::cuda
