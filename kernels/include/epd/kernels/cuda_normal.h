// Normal (high-throughput) mode on CUDA: GetDispatchLayout, Dispatch and Combine, one
// launcher per op taking one Args struct, plus the normal sync-state helpers. Semantics are
// exactly kernels/host (host_ops.h); outputs are bit-identical to it. Buffers are laid out
// by EndpointLayout (layout.h); errors only the GPU sees go to DeviceStatus (cuda_ops.h).
// The protocol (notify + copy kernels, barriers, run-time T, SM count default and its
// basis) is in docs/CUDA_BACKEND.md "Kernels".
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/layout.h"

namespace epd::kernels::cuda {

/// Threads per block of the normal-mode copy and combine kernels (16 warps).
inline constexpr int kNormalThreads = 512;
/// Threads per block of the dispatch notify step (its layout pass takes one token a
/// thread) and of the one-block arrival barrier.
inline constexpr int kNormalNotifyThreads = 256;
/// Checks that normal mode can run `ctx`: ValidateContext, 1 <= R <= kNormalMaxRanks, the
/// normal sync map fits its part of the sync region, M >= 0. INVALID_ARGUMENT naming the
/// field and value otherwise.
absl::Status ValidateNormalContext(const CudaRankContext& ctx);

/// Device address of this rank's normal-mode token-count slot (int32 in its sync region).
/// The normal ops read T from it unless their args name another device int32.
int32_t* NormalNumTokensSlot(const CudaRankContext& ctx);

/// Enqueues a write of `num_tokens` into the rank's normal token-count slot (a 4-byte
/// cudaMemcpyAsync from a pinned staging word would also do; this uses a one-thread
/// kernel so it needs no host memory). Errors: CUDA launch errors.
absl::Status SetNormalNumTokensAsync(const CudaRankContext& ctx, int32_t num_tokens,
                                     cudaStream_t stream);

/// Zeroes this rank's normal-mode sync state (op counter, flags, counts) on `stream`.
/// Needed only after a DEADLINE_EXCEEDED where a rank never arrived at all: then call it
/// for every rank of the group once no op is in flight anywhere in the group. Errors:
/// CUDA launch errors.
absl::Status ResetNormalSync(const CudaRankContext& ctx, cudaStream_t stream);

// ---- GetDispatchLayout ------------------------------------------------------------------

/// Arguments of one rank's GetDispatchLayout (host_ops.h: GetDispatchLayout).
/// Input: topk_idx [T, K] int64 (-1 = none), default this rank's in_topk_idx region.
/// Outputs in this rank's area: layout_tokens_per_rank [R] int32 (tokens with >= 1 expert
/// on r), layout_tokens_per_expert [E] int32 (a duplicate expert in a row counted once),
/// layout_is_token_in_rank [T, R] uint8 0/1. Needs no other rank (no flags, no waits).
struct GetDispatchLayoutArgs {
  /// Device int32 holding T; null = NormalNumTokensSlot(ctx).
  const int32_t* num_tokens = nullptr;
  /// [T, K] int64 on this GPU; null = this rank's in_topk_idx region.
  const int64_t* topk_idx = nullptr;
};

/// Enqueues GetDispatchLayout for one rank. Errors: INVALID_ARGUMENT (context), INTERNAL
/// (CUDA launch). Device-side: bad ids counted in DeviceStatus.
absl::Status GetDispatchLayout(const CudaRankContext& ctx, const GetDispatchLayoutArgs& args,
                               cudaStream_t stream);

// ---- normal dispatch --------------------------------------------------------------------

/// Arguments of one rank's normal Dispatch (host_ops.h: Dispatch). Inputs are this rank's
/// staging regions: in_x [T, H] bf16 (or e4m3, H bytes a row, when fp8), in_scales
/// [T, S] f32 (fp8), in_topk_idx [T, K] int64, in_topk_weights [T, K] f32. Outputs:
/// recv_x [N, H], recv_scales [N, S], recv_topk_idx [N, K] int64, recv_topk_weights
/// [N, K] f32, recv_src_info [N] int32 (src_rank * M + src_token) in the receivers'
/// areas; recv_tokens_per_expert [El], rank_prefix [R], recv_count [1] (= N) in this
/// rank's area (on the device always; ReadNormalDispatchCounts copies them to the host
/// only when asked); send_pos [T, R] int32 (the handle) in this rank's area.
/// Every rank of the group must launch each dispatch (ranks with T = 0 too), with the same
/// fp8 / expert_alignment / with_weights / cached.
struct NormalDispatchArgs {
  bool fp8 = false;              ///< x is e4m3 + scales (needs shape.use_fp8, H % 128 == 0).
  int32_t expert_alignment = 1;  ///< >= 1: recv_tokens_per_expert rounded up to it.
  bool with_weights = true;      ///< Move in_topk_weights into recv_topk_weights.
  /// Re-dispatch with the routing of this rank's send_pos from the previous dispatch
  /// (same T): no layout, no count exchange; recv_topk_* and counts are not written.
  bool cached = false;
  /// Device int32 holding T; null = NormalNumTokensSlot(ctx).
  const int32_t* num_tokens = nullptr;
  /// Optional int32 in host-mapped pinned memory (cudaHostAlloc ... Mapped) that the
  /// dispatch's notify kernel writes recv_count (N) into, so the caller reads N after the
  /// op's event without a device-to-host copy (no copy engine on the op path). A cached
  /// dispatch writes the recv_count left in the area. Null = not written.
  int32_t* recv_count_out = nullptr;
  /// Per-expert received-token totals the notify kernel adds this dispatch's counts to
  /// (unaligned; a cached dispatch those of the dispatch it repeats); default off.
  ExpertTokenStats expert_stats;
  /// Measurement only (epd_bench --normal_phases): device uint64 [kNormalDispatchPhases]
  /// the kernels stamp with the GPU's global timer (ns) as the op passes each
  /// NormalDispatchPhase; null (the default, and always in epd) = no stamps.
  uint64_t* phase_ns = nullptr;
};

/// The points of a normal dispatch NormalDispatchArgs::phase_ns stamps, in op order. A
/// cached dispatch has no layout pass: its kLayoutDone is its kNotifyStart.
enum class NormalDispatchPhase : int32_t {
  kNotifyStart = 0,  ///< The notify kernel's block 0 starts.
  kLayoutDone = 1,   ///< The notify's last block starts the totals (every tile scanned).
  kArrived = 2,      ///< The notify has its counts out and every peer's in (arrival wait).
  kNotifyDone = 3,   ///< The notify's last block ends (prefixes, counts, tile bases written).
  kCopyStart = 4,    ///< The copy kernel's block 0 starts taking tokens.
  kCopyDone = 5,     ///< The copy's last block to finish starts the done barrier.
  kOpDone = 6,       ///< Every rank's done flag is in: the op's end.
};
inline constexpr int32_t kNormalDispatchPhases = 7;

/// Enqueues one rank's normal dispatch on `stream`. Errors: INVALID_ARGUMENT for a bad
/// context or arguments (expert_alignment < 1, FP8 without shape.use_fp8 or with
/// H % 128 != 0, shared memory over the device limit); INTERNAL for CUDA launch errors.
absl::Status NormalDispatch(const CudaRankContext& ctx, const NormalDispatchArgs& args,
                            cudaStream_t stream);

/// Host copy of the counts a dispatch left on the device (the optional CPU sync).
struct NormalDispatchCounts {
  int32_t num_recv_tokens = 0;                  ///< N: rows received by this rank.
  std::vector<int32_t> recv_tokens_per_expert;  ///< [El], aligned.
  std::vector<int32_t> rank_prefix;             ///< [R]: first row of each source rank.
};

/// The optional CPU sync of a dispatch: synchronizes `stream` and copies recv_count,
/// recv_tokens_per_expert and rank_prefix of this rank to the host. Blocks the CPU; the
/// hot path never calls it. Errors: INTERNAL (CUDA).
absl::StatusOr<NormalDispatchCounts> ReadNormalDispatchCounts(const CudaRankContext& ctx,
                                                              cudaStream_t stream);

// ---- normal combine ---------------------------------------------------------------------

/// Arguments of one rank's normal Combine (host_ops.h: Combine). Inputs: every rank's
/// in_combine_x [N, H] bf16 (and in_combine_weights [N, K] f32 with with_weights), read
/// through peer_bases at the rows of this rank's send_pos [T, R]. Outputs in this rank's
/// area: combined_x [T, H] bf16 = bf16(Σ_{r ascending, send_pos[t,r] >= 0} f32(x_r[row]))
/// (acc starts at +0.0f; a token sent nowhere gets zeros) and, with with_weights,
/// combined_topk_weights [T, K] f32 summed in the same order.
struct NormalCombineArgs {
  bool with_weights = false;  ///< Also reduce in_combine_weights.
  /// Device int32 holding T (the T of the dispatch whose handle is used);
  /// null = NormalNumTokensSlot(ctx).
  const int32_t* num_tokens = nullptr;
};

/// Enqueues one rank's normal combine on `stream`. Errors: INVALID_ARGUMENT (context),
/// INTERNAL (CUDA launch).
absl::Status NormalCombine(const CudaRankContext& ctx, const NormalCombineArgs& args,
                           cudaStream_t stream);

}  // namespace epd::kernels::cuda
