// The one factory of a rank's CudaRankContext, used by the daemon (daemon-launched ops)
// and by the client (client-launched ops): where a rank's kernels find the group's areas.
#pragma once

#include <cstdint>

#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/layout.h"
#include "epd/kernels/types.h"

namespace epd::kernels::cuda {

/// Where one rank's kernels run, as the launching CUDA context sees it.
struct RankPlacement {
  int32_t rank = 0;  ///< This rank, in [0, R).
  /// Device array [R] of every rank's data-area base in the launching context; must stay
  /// valid while ops run. May be null for contexts that only address their own area.
  uint8_t* const* peer_bases = nullptr;
  uint8_t* own_base = nullptr;  ///< Host copy of this rank's data-area base.
  /// Ranks of the group whose kernels share this rank's GPU (1..R).
  int32_t ranks_on_device = 0;
  uint32_t op_timeout_ms = 0;  ///< Bound of every spin wait (> 0 for launches).
};

/// Rank `at.rank`'s context for `shape` and its `layout` (EndpointLayout::Compute(shape)),
/// with `num_sms` blocks per op (0 = default grid). all_ranks_on_device is set exactly when
/// every rank is on this GPU (flags at .gpu scope, cuda_ops.h). Pure; allocates nothing.
/// Check the result with ValidateContext before the first launch.
CudaRankContext MakeRankContext(const GroupShape& shape, const EndpointLayout& layout,
                                const RankPlacement& at, int32_t num_sms = 0);

}  // namespace epd::kernels::cuda
