// What the CUDA kernels can run, as pure functions of a group's shape (no CUDA needed, so
// the daemon's Join, host-only builds and unit tests use the launchers' numbers): the map
// of the per-rank `sync` region, the low-latency dispatch's routing path and its shared
// memory (PlanLowLatencyRouting), and CheckCudaShape, which names the first limit a shape
// is past. The limits (num_ranks <= 64; num_experts bounded by the sync region) and why
// are in docs/CUDA_BACKEND.md "Limits".
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "epd/kernels/layout.h"
#include "epd/kernels/types.h"

namespace epd::kernels::cuda {

// ---- the sync region --------------------------------------------------------------------

/// Map of the `sync` region (kSyncRegionBytes = 64 KiB, zeroed at creation) of every rank.
/// Offsets in bytes from the start of the region.
///   [0, 256)          DeviceStatus, shared by every CUDA op of the endpoint.
///   [256, 4096)       low-latency counters and the run-time token count slot (LL).
///   [4096, 40960)     low-latency inter-rank flags and count exchange (LL).
///   [40960, 65536)    normal-mode kernels (cuda_normal.h).
inline constexpr uint64_t kSyncStatusOffset = 0;
inline constexpr uint64_t kSyncLowLatencyStateOffset = 256;
inline constexpr uint64_t kSyncLowLatencyExchangeOffset = 4096;
inline constexpr uint64_t kSyncLowLatencyExchangeBytes = 40960 - 4096;
inline constexpr uint64_t kSyncNormalOffset = 40960;
inline constexpr uint64_t kSyncNormalBytes = kSyncRegionBytes - kSyncNormalOffset;

/// Largest group the status word can name missing ranks for.
inline constexpr int kMaxStatusRanks = 256;

/// Largest R normal mode supports (destination sets are 64-bit masks).
inline constexpr int kNormalMaxRanks = 64;

/// Map of the normal-mode part of a rank's sync region, [kSyncNormalOffset, 64 KiB).
/// Byte offsets from `layout.sync.offset + kSyncNormalOffset`; R = num_ranks, E = experts.
/// Sequence numbers are uint32, compared wrap-around safe.
///   [0, 4)      uint32 op counter: sequence number of the last normal op of this rank.
///   [4, 8)      uint32 sequence number of the last op whose barrier timed out here.
///   [8, 12)     uint32 count of the blocks of the running multi-block kernel (dispatch
///               notify, copy, combine) that finished (reset by the last one).
///   [12, 16)    int32 run-time token count slot (NormalNumTokensSlot).
///   [16, 20)    int32 next token of the running copy or combine kernel (its warps take
///               tokens from it; zeroed by the op's notify / arrival kernel before).
///   arrive      uint32 [R]: arrive[s] = last op sequence number rank s arrived at.
///   done        uint32 [R]: done[s] = last op whose writes/reads rank s has finished.
///   counts      int32 [R, R]: counts[s][r] = tokens of rank s sent to rank r.
///   expert      int32 [R, El]: expert[s][j] = tokens of rank s routed to local expert j.
struct NormalSyncLayout {
  static constexpr uint64_t kOpCounter = 0;
  static constexpr uint64_t kFailedSeq = 4;
  static constexpr uint64_t kBlockCounter = 8;
  static constexpr uint64_t kNumTokens = 12;
  static constexpr uint64_t kNextToken = 16;
  static constexpr uint64_t kArrive = 64;

  int32_t num_ranks = 1;
  int32_t num_experts = 1;

  EPD_HD uint64_t arrive() const { return kArrive; }
  EPD_HD uint64_t done() const { return kArrive + 4ull * num_ranks; }
  EPD_HD uint64_t counts() const { return kArrive + 8ull * num_ranks; }
  EPD_HD uint64_t expert() const {
    return counts() + 4ull * static_cast<uint64_t>(num_ranks) * num_ranks;
  }
  EPD_HD uint64_t bytes() const { return expert() + 4ull * static_cast<uint64_t>(num_experts); }
};

/// Inter-rank exchange area of the low-latency kernels, at sync +
/// kSyncLowLatencyExchangeOffset, written by peers:
///   uint32 count_flag[R]    sender s sets [s] = seq after publishing its counts;
///   uint32 data_flag[R]     sender s sets [s] = seq after all its rows to this rank landed;
///   uint32 combine_flag[R]  rank s sets [s] = combine seq when it entered its combine;
///   int32  counts[2][R][E]  counts of sender s per global expert, set (seq & 1).
struct LowLatencyExchange {
  static constexpr uint64_t kFlagsBytes = 3 * kMaxStatusRanks * 4;
  static EPD_HD constexpr uint64_t CountFlag(int32_t s) { return 4ull * s; }
  static EPD_HD constexpr uint64_t DataFlag(int32_t s) { return 4ull * (kMaxStatusRanks + s); }
  static EPD_HD constexpr uint64_t CombineFlag(int32_t s) {
    return 4ull * (2 * kMaxStatusRanks + s);
  }
  static EPD_HD uint64_t Counts(int32_t parity, int32_t sender, int32_t num_ranks,
                                int32_t num_experts) {
    return kFlagsBytes +
           4ull * ((static_cast<uint64_t>(parity) * num_ranks + sender) * num_experts);
  }
  /// Bytes the exchange needs for R ranks and E experts.
  static EPD_HD uint64_t Bytes(int32_t num_ranks, int32_t num_experts) {
    return kFlagsBytes + 4ull * 2 * static_cast<uint64_t>(num_ranks) * num_experts;
  }
};

// ---- the low-latency dispatch's routing -------------------------------------------------

/// Threads per block of the low-latency kernels (32 warps).
inline constexpr int kLowLatencyThreads = 1024;
/// Largest K of the low-latency dispatch's small path (one warp lane per top-k slot).
inline constexpr int kLowLatencySmallPathMaxTopk = 32;
/// Upper bound of the low-latency dispatch kernels' static shared memory (peer bases,
/// per-warp destinations); checked against the compiled kernels when they are loaded
/// (PreloadKernels).
inline constexpr uint64_t kLowLatencyStaticSmemBound = 19 * 1024;
/// Dynamic shared memory a kernel gets without opting in: 48 KiB less its static part.
inline constexpr uint64_t kLowLatencyDefaultDynamicSmemBytes =
    48 * 1024 - kLowLatencyStaticSmemBound;
/// Dynamic shared memory the large path's routing tiles may take: with the static part,
/// within the 96 KiB every CUDA GPU since Volta (sm_70) lets a block opt in to.
inline constexpr uint64_t kLowLatencyTiledSmemBudget = 96 * 1024 - kLowLatencyStaticSmemBound;

/// How the low-latency dispatch routes a rank's tokens (kernels/cuda/ll_dispatch.cu).
/// Small path: every block keeps all Mll * K slots' routing in shared memory
/// (small_smem_bytes); taken when K <= kLowLatencySmallPathMaxTopk and that fits the
/// default dynamic shared memory (DeepSeek-V3 decode: Mll = 128, K = 8, E = 256 needs
/// 23040 bytes). Large path (`tiled`): block 0 routes the tokens in tiles of
/// 32 * tile_groups tokens into the rank's ll_routing region, the others read it there;
/// shared memory holds one tile's per-(32-token group, expert) ballots and prefixes and
/// per-expert counts and bases: tiled_smem_bytes = 8 E + 8 E tile_groups.
struct LowLatencyRoutingPlan {
  bool tiled = false;
  int32_t mask_stride = 1;  ///< Small path: words per token of the expert bitmask.
  int32_t tile_groups = 1;  ///< Large path: groups of 32 tokens per routing tile.
  uint64_t small_smem_bytes = 0;
  uint64_t tiled_smem_bytes = 0;
};

/// The plan for `shape` (Mll > 0, K >= 1, E >= 1). Pure function of the shape.
inline LowLatencyRoutingPlan PlanLowLatencyRouting(const GroupShape& shape) {
  LowLatencyRoutingPlan plan;
  const uint64_t mll = static_cast<uint64_t>(shape.ll_max_tokens_per_rank);
  const uint64_t k = static_cast<uint64_t>(shape.num_topk);
  const uint64_t e = static_cast<uint64_t>(shape.num_experts);
  const uint64_t groups = (mll + 31) / 32;
  plan.mask_stride = static_cast<int32_t>((e + 31) / 32) | 1;  // odd: no bank conflicts
  plan.small_smem_bytes = 4 * (2 * mll * k + 2 * e + mll * plan.mask_stride + 2 * groups * e);
  plan.tiled = shape.num_topk > kLowLatencySmallPathMaxTopk ||
               plan.small_smem_bytes > kLowLatencyDefaultDynamicSmemBytes;
  // As many groups per tile as the budget holds (at least one), but no more than Mll needs.
  const uint64_t fit =
      kLowLatencyTiledSmemBudget > 8 * e ? (kLowLatencyTiledSmemBudget - 8 * e) / (8 * e) : 0;
  uint64_t tile_groups = fit < groups ? fit : groups;
  if (tile_groups < 1) tile_groups = 1;
  plan.tile_groups = static_cast<int32_t>(tile_groups);
  plan.tiled_smem_bytes = 8 * e + 8 * e * tile_groups;
  return plan;
}

// ---- limits on a group's shape ------------------------------------------------------------

/// OK when every CUDA op of a group of `shape` can run (the limits in this file's header);
/// else INVALID_ARGUMENT "spec.<field>: <value> ... on the CUDA backend ... the largest
/// <field> that works ... is <n>" for the first limit it is past. The CUDA data plane
/// refuses such a spec at Join (daemon/control/spec_validation.h ValidateGroupSpecForBackend).
/// Expects a spec that passed ValidateGroupSpec (R >= 1, E >= R, E % R == 0).
inline absl::Status CheckCudaShape(const GroupShape& shape) {
  const int32_t r = shape.num_ranks;
  const int32_t e = shape.num_experts;
  const bool low_latency = shape.ll_max_tokens_per_rank > 0;
  if (r > kNormalMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.num_ranks: ", r, " is past the CUDA backend's limit: the largest ",
                     "num_ranks that works there is ", kNormalMaxRanks,
                     " (normal-mode kernels keep destination ranks in 64-bit masks)"));
  }
  // The largest multiple of R, E, with fixed + per_expert * E <= room.
  auto largest = [r](uint64_t fixed, uint64_t per_expert, uint64_t room) -> int64_t {
    if (fixed > room) return 0;
    return static_cast<int64_t>((room - fixed) / per_expert) / r * r;
  };
  const int64_t normal_most = largest(NormalSyncLayout{r, 0}.bytes(), 4, kSyncNormalBytes);
  const int64_t exchange_most =
      largest(LowLatencyExchange::kFlagsBytes, 8ull * r, kSyncLowLatencyExchangeBytes);
  const int64_t most = low_latency && exchange_most < normal_most ? exchange_most : normal_most;
  if (e > most) {
    const bool exchange =
        low_latency && LowLatencyExchange::Bytes(r, e) > kSyncLowLatencyExchangeBytes;
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.num_experts: ", e, " with num_ranks = ", r, " is past the CUDA backend's limit: ",
        exchange ? absl::StrCat("low-latency mode's count exchange needs ",
                                LowLatencyExchange::Bytes(r, e), " bytes of the ",
                                kSyncLowLatencyExchangeBytes, " in the sync region")
                 : absl::StrCat("normal mode's sync state needs ", NormalSyncLayout{r, e}.bytes(),
                                " bytes of the ", kSyncNormalBytes, " in the sync region"),
        "; the largest num_experts that works with ", r, " ranks is ", most,
        low_latency && exchange_most < normal_most
            ? absl::StrCat(" (", normal_most, " with ll_max_tokens_per_rank = 0)")
            : std::string()));
  }
  if (low_latency) {
    // Holds for every E the exchange allows (16 E + 19 KiB <= 96 KiB); kept so that a
    // change of either limit cannot let a spec through that the dispatch cannot launch.
    const LowLatencyRoutingPlan plan = PlanLowLatencyRouting(shape);
    if (plan.tiled_smem_bytes > kLowLatencyTiledSmemBudget) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.num_experts: ", e, " needs ", plan.tiled_smem_bytes,
          " bytes of shared memory for the low-latency routing on the CUDA backend; the "
          "largest num_experts that works is ",
          kLowLatencyTiledSmemBudget / 16 / r * r));
    }
    // The low-latency kernels number their units of work (token, channel chunk of at least
    // 32 channels) in 32-bit integers: Mll * ceil(H / 32) must stay below 2^31.
    const int64_t chunks = (static_cast<int64_t>(shape.hidden) + 31) / 32;
    const int64_t most_tokens = (int64_t{1} << 31) / chunks - 1;
    if (shape.ll_max_tokens_per_rank > most_tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.ll_max_tokens_per_rank: ", shape.ll_max_tokens_per_rank, " with hidden = ",
          shape.hidden, " is past the CUDA backend's limit: the low-latency kernels count ",
          "(token, 32-channel chunk) units in 32 bits; the largest ll_max_tokens_per_rank that "
          "works with this hidden is ",
          most_tokens));
    }
  }
  return absl::OkStatus();
}

}  // namespace epd::kernels::cuda
