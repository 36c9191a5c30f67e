// Device-side pieces shared by the normal-mode kernels (cuda_normal.h): the kernel
// parameter block, the sync-region map, inter-rank flags and bounded waits, and the
// arrival barrier / done barrier both dispatch and combine use.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "epd/kernels/cuda_normal.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/layout.h"
#include "kernels/cuda/common.cuh"

namespace epd::kernels::cuda::normal {

/// Ranks whose rows one warp of the balanced combine loads before it adds them.
inline constexpr int kCombineRanksInFlight = 2;

/// The normal kernels' variants (`EPD_NORMAL_KERNELS`, docs/CUDA_BACKEND.md "Normal
/// mode"): the same results bit for bit, a different order of work.
enum class NormalKernelVariant : int32_t {
  /// Default: the warps of a rank's copy / combine take its tokens one at a time from one
  /// counter in its sync region (TokenOrder::kRank); a combine warp loads two ranks' rows
  /// at once.
  kBalanced,
  /// Warp w of the grid takes tokens w, w + warps, ...; a combine warp loads one rank's
  /// row at a time (the kernels before the balanced order, kept for comparison).
  kStatic,
  /// kBalanced with a counter per block over a contiguous range (TokenOrder::kBlock).
  kBlock,
  /// kBalanced, with the dispatch's rows moved by bulk copies (NormalDispatchBulkKernel,
  /// which takes tokens as kBlock does) where the GPU has them (sm_90 and later) and a row
  /// is a multiple of 16 bytes.
  kBulk,
};

/// How a copy or combine kernel's warps take this rank's tokens (TokenSchedule).
enum class TokenOrder : int32_t { kStatic, kBlock, kRank };

/// Everything a normal-mode kernel of one rank reads, passed by value.
struct NormalParams {
  GroupShape shape;
  EndpointLayout layout;
  int32_t rank = 0;
  uint8_t* const* peer_bases = nullptr;  ///< Device array [R].
  const int32_t* num_tokens = nullptr;   ///< Device int32: run-time T.
  int64_t timeout_ns = 0;
  /// CudaRankContext::abort_flag: the daemon's shutdown word (null = none).
  const uint32_t* abort_flag = nullptr;
  NormalSyncLayout sync_map;
  // Dispatch options.
  int32_t fp8 = 0;
  int32_t expert_alignment = 1;
  int32_t with_weights = 0;
  int32_t cached = 0;
  /// NormalDispatchArgs::recv_count_out (host-mapped pinned), may be null.
  int32_t* recv_count_out = nullptr;
  /// NormalDispatchArgs::expert_stats (null totals = off).
  ExpertTokenStats expert_stats;
  /// Overrides of the default input regions (GetDispatchLayout only), may be null.
  const int64_t* topk_idx = nullptr;
  /// CudaRankContext::rank_masked: device [R], nonzero = masked; null = none masked.
  const uint8_t* rank_masked = nullptr;
  /// NormalDispatchTiling::For(M): the dispatch's layout tiles (`normal_tiles` region).
  NormalDispatchTiling tiling;
  /// Work order of the copy and combine kernels (TokenSchedule).
  TokenOrder order = TokenOrder::kRank;
  /// Ranks whose rows one combine warp has in flight at once: 1 or kCombineRanksInFlight.
  int32_t combine_ranks_in_flight = kCombineRanksInFlight;
  /// The variant these fields came from (the launchers pick their kernels by it).
  NormalKernelVariant variant = NormalKernelVariant::kBalanced;
  /// The op's second kernel (copy or combine) is launched with programmatic stream
  /// serialization behind its first (EPD_NORMAL_PDL on and the kernels built with grid
  /// dependency control: NormalProgrammaticFromEnv). Read by the launchers only: the kernels
  /// run the same code either way (LetSecondKernelStart, WaitForFirstKernel).
  int32_t programmatic = 0;
  /// The inter-rank flags (arrival, done) and the fences before them at .gpu scope instead of
  /// .sys: every rank on this GPU (CudaRankContext::all_ranks_on_device) and
  /// EPD_NORMAL_GPU_SCOPE on (docs/CUDA_BACKEND.md "Memory scope of the flags").
  int32_t gpu_scope = 0;
  /// The dispatch copy's vector path (CopyTokensByVectors) splits each token's row into up
  /// to this many parts of whole chunks (2 KiB of int4, 256 bytes of bf16 units), each taken by a
  /// warp as one work item, so a rank's last items are short and its warps end together
  /// (EPD_NORMAL_COPY_PARTS, NormalCopyPartsFromEnv). 1 = a token per item.
  int32_t copy_parts = 1;
  /// NormalDispatchArgs::phase_ns (measurement only), may be null.
  uint64_t* phase_ns = nullptr;
};

/// Stamps phase `phase` of the op (NormalDispatchArgs::phase_ns) with the global timer, when
/// stamps were asked for. Call from one thread.
__device__ __forceinline__ void StampPhase(const NormalParams& p, NormalDispatchPhase phase) {
  if (p.phase_ns != nullptr) p.phase_ns[static_cast<int32_t>(phase)] = device::GlobalTimerNs();
}

// ---- addressing ---------------------------------------------------------------------------

/// Base of rank `r`'s normal sync area as seen from this context.
__device__ __forceinline__ uint8_t* NormalSync(const NormalParams& p, int r) {
  return p.peer_bases[r] + p.layout.sync.offset + kSyncNormalOffset;
}
__device__ __forceinline__ DeviceStatus* OwnStatus(const NormalParams& p) {
  return reinterpret_cast<DeviceStatus*>(p.peer_bases[p.rank] + p.layout.sync.offset +
                                         kSyncStatusOffset);
}
template <typename T>
__device__ __forceinline__ T* Region(uint8_t* base, const epd::kernels::Region& r) {
  return reinterpret_cast<T*>(base + r.offset);
}

// ---- flags (uint32 sequence numbers, compared wrap-around safe: common.cuh) -----------

/// Releases an inter-rank flag (`*flag = v`) at the op's scope (NormalParams::gpu_scope).
__device__ __forceinline__ void ReleaseFlag(const NormalParams& p, uint32_t* flag, uint32_t v) {
  device::StRelease(flag, v, p.gpu_scope != 0);
}

/// Orders this thread's earlier writes (and, after a barrier, its block's) before its later
/// ones for every rank: __threadfence at .gpu scope (NormalParams::gpu_scope), else
/// __threadfence_system.
__device__ __forceinline__ void FenceForPeers(const NormalParams& p) {
  if (p.gpu_scope != 0) {
    __threadfence();
  } else {
    __threadfence_system();
  }
}

// ---- programmatic launch of an op's second kernel (NormalParams::programmatic) ----------

/// In the op's first kernel (the notify, or the arrival barrier), every thread of a block
/// that has passed its last wait on other ranks: the second kernel, when launched
/// programmatically, may start once every block of this grid has done so or exited. Its
/// blocks then take SMs while this grid finishes, so a block calls it only when no other
/// rank's kernel waits on this grid any more: past the arrival wait, every peer's first
/// kernel is in its last block or done, and what is left of this grid waits for nothing.
/// A no-op without a programmatic launch, and before sm_90.
__device__ __forceinline__ void LetSecondKernelStart() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// In the op's second kernel, before it reads anything the first kernel wrote (the op's
/// sequence number, its failed mark, the token counter, the layout's tile bases): waits
/// until the first kernel's grid has completed and its writes are visible. Returns at once
/// when the kernel was not launched programmatically. Before sm_90 it compiles to nothing,
/// which is why the launchers launch programmatically only kernels built for sm_90 or later
/// (NormalProgrammaticFromEnv).
__device__ __forceinline__ void WaitForFirstKernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// ---- per-token routing ------------------------------------------------------------------

/// Scans one token's top-k row: returns the mask of ranks it has an expert on; adds 1 to
/// expert_count[e] (shared memory) for each expert once (a duplicate in the row counted
/// once) when expert_count is not null; counts ids outside [-1, E) into *bad (skipped).
/// With `masked` ([R], nonzero = masked), an expert of a masked rank is taken as -1 and
/// counted into *dropped.
__device__ __forceinline__ uint64_t ScanTopkRow(const int64_t* row, int num_topk, int num_experts,
                                                int experts_per_rank, int32_t* expert_count,
                                                unsigned int* bad, const uint8_t* masked = nullptr,
                                                unsigned int* dropped = nullptr) {
  // The ids are loaded kScanBatch at a time, all in flight at once (one round trip per
  // batch, not one per id), into registers: each is read from the row once, and the
  // duplicate check compares the values read.
  constexpr int kScanBatch = 8;
  uint64_t mask = 0;
  for (int k0 = 0; k0 < num_topk; k0 += kScanBatch) {
    int64_t ids[kScanBatch];
#pragma unroll
    for (int u = 0; u < kScanBatch; ++u) ids[u] = k0 + u < num_topk ? row[k0 + u] : -1;
#pragma unroll
    for (int u = 0; u < kScanBatch; ++u) {
      const int64_t e = ids[u];
      if (e < -1 || e >= num_experts) {
        ++*bad;
        continue;
      }
      if (e < 0) continue;
      if (masked != nullptr && masked[e / experts_per_rank] != 0) {
        if (dropped != nullptr) ++*dropped;
        continue;
      }
      if (expert_count != nullptr) {
        bool duplicate = false;
#pragma unroll
        for (int j = 0; j < u; ++j) duplicate |= ids[j] == e;
        // Ids of earlier batches (top-k above kScanBatch): read again, as read before.
        for (int j = 0; j < k0; ++j) duplicate |= row[j] == e;
        if (!duplicate) atomicAdd(&expert_count[e], 1);
      }
      mask |= 1ull << (e / experts_per_rank);
    }
  }
  return mask;
}

/// A dispatch's layout pass writes a token's row inside its tile `row` (>= 0) to send_pos as
/// EncodeTileRow(row) <= kEncodedTileRow, so that the copy can tell it from a final row
/// (>= 0) or "not sent" (-1) however many of its warps read the entry (ResolveRow).
inline constexpr int64_t kEncodedTileRow = -2;
/// send_pos's encoding of row `row` (>= 0) inside a tile: -2 - row.
__device__ __forceinline__ int32_t EncodeTileRow(int32_t row) { return -2 - row; }
/// The row inside its tile of an entry `encoded` <= kEncodedTileRow (EncodeTileRow's
/// inverse, in 64 bits: no overflow for any int32 entry).
__device__ __forceinline__ int64_t DecodeTileRow(int64_t encoded) { return -2 - encoded; }

/// The ranks one token goes to (or comes back from), held by one warp: lane l keeps the
/// send_pos row entries and data-area bases of ranks l and l + 32 (R <= 64); `mask` has
/// bit r set when send_pos[t, r] is a row and rank r is not masked (LoadBases' `masked`). Row(r) /
/// Base(r) are warp-collective (r uniform). send_pos lives in the endpoint's memory, which its
/// client can rewrite (CUDA IPC): each entry is read once into a register and checked against the
/// receive capacity there; only the checked value is used.
struct TokenRanks {
  int32_t pos_lo, pos_hi;
  unsigned long long base_lo, base_hi;
  bool masked_lo, masked_hi;  ///< Ranks lane and lane + 32 are masked: their routes dropped.
  uint64_t mask;

  /// Lane-local part of the rank bases and of the rank mask (`masked`: [R], nonzero =
  /// masked, or null); call once per kernel.
  __device__ __forceinline__ void LoadBases(uint8_t* const* peer_bases, int num_ranks, int lane,
                                            const uint8_t* masked = nullptr) {
    base_lo = reinterpret_cast<unsigned long long>(lane < num_ranks ? peer_bases[lane] : nullptr);
    base_hi = reinterpret_cast<unsigned long long>(lane + 32 < num_ranks ? peer_bases[lane + 32]
                                                                         : nullptr);
    masked_lo = masked != nullptr && lane < num_ranks && masked[lane] != 0;
    masked_hi = masked != nullptr && lane + 32 < num_ranks && masked[lane + 32] != 0;
  }
  /// Loads send_pos[t, :] (row `pos_row`) and builds the mask. Warp-collective. An entry
  /// outside [-1, capacity) (capacity = R * M, the rows of every receive / combine-input
  /// region) is counted into *bad and taken as -1; a row of a masked rank is counted into
  /// *dropped and taken as -1.
  __device__ __forceinline__ void LoadRow(const int32_t* pos_row, int num_ranks, int lane,
                                          int64_t capacity, unsigned int* bad,
                                          unsigned int* dropped) {
    int64_t lo, hi;
    FetchRow(pos_row, num_ranks, lane, &lo, &hi);
    CheckRow(lo, hi, capacity, bad, dropped);
  }
  /// The raw entries LoadRow reads (the lane's ranks lane and lane + 32, -1 past R), for a
  /// caller that reads a row ahead of its use and passes them to CheckRow there.
  __device__ __forceinline__ static void FetchRow(const int32_t* pos_row, int num_ranks, int lane,
                                                  int64_t* lo, int64_t* hi) {
    *lo = lane < num_ranks ? pos_row[lane] : -1;
    *hi = lane + 32 < num_ranks ? pos_row[lane + 32] : -1;
  }
  /// The dispatch copy's LoadRow: `pos_row` holds token t's row as the layout pass wrote
  /// it (EncodeTileRow: the row inside its tile; -1 = not sent) or, where another warp of
  /// the same copy resolved it already, the final row. `base_row` [R] is its tile's first
  /// row at each rank. An encoded entry becomes its row + base (64-bit), a final one stays;
  /// both are checked as in LoadRow. With `write_back` (the warp of the token's first part
  /// only) the resolved entries are written back to `pos_row` (the handle). The warps that
  /// share a token (NormalParams::copy_parts) may race on the row: whether a warp reads the
  /// encoded entry or the value written back, it arrives at the same row (or at -1 for a
  /// route that the check drops). Warp-collective.
  __device__ __forceinline__ void ResolveRow(int32_t* pos_row, const int32_t* base_row,
                                             int num_ranks, int lane, int64_t capacity,
                                             unsigned int* bad, unsigned int* dropped,
                                             bool write_back) {
    int64_t lo = lane < num_ranks ? pos_row[lane] : -1;
    int64_t hi = lane + 32 < num_ranks ? pos_row[lane + 32] : -1;
    const bool encoded_lo = lo <= kEncodedTileRow;
    const bool encoded_hi = hi <= kEncodedTileRow;
    if (encoded_lo) lo = DecodeTileRow(lo) + base_row[lane];
    if (encoded_hi) hi = DecodeTileRow(hi) + base_row[lane + 32];
    CheckRow(lo, hi, capacity, bad, dropped);
    if (write_back && encoded_lo) pos_row[lane] = pos_lo;
    if (write_back && encoded_hi) pos_row[lane + 32] = pos_hi;
  }
  /// LoadRow's checks on the lane's two raw entries; sets pos_lo / pos_hi and the mask.
  __device__ __forceinline__ void CheckRow(int64_t lo, int64_t hi, int64_t capacity,
                                           unsigned int* bad, unsigned int* dropped) {
    if (lo < -1 || lo >= capacity) {
      ++*bad;
      lo = -1;
    }
    if (hi < -1 || hi >= capacity) {
      ++*bad;
      hi = -1;
    }
    pos_lo = static_cast<int32_t>(lo);
    pos_hi = static_cast<int32_t>(hi);
    if (masked_lo && pos_lo >= 0) {
      ++*dropped;
      pos_lo = -1;
    }
    if (masked_hi && pos_hi >= 0) {
      ++*dropped;
      pos_hi = -1;
    }
    mask = static_cast<uint64_t>(__ballot_sync(0xffffffffu, pos_lo >= 0)) |
           (static_cast<uint64_t>(__ballot_sync(0xffffffffu, pos_hi >= 0)) << 32);
  }
  __device__ __forceinline__ int64_t Row(int r) const {
    return __shfl_sync(0xffffffffu, r < 32 ? pos_lo : pos_hi, r & 31);
  }
  __device__ __forceinline__ uint8_t* Base(int r) const {
    return reinterpret_cast<uint8_t*>(__shfl_sync(0xffffffffu, r < 32 ? base_lo : base_hi, r & 31));
  }
  /// Address of this token's row in rank r's region at `region_offset` (rows of
  /// `row_bytes`): 64-bit offsets throughout.
  __device__ __forceinline__ uint8_t* RowAt(int r, uint64_t region_offset,
                                            int64_t row_bytes) const {
    return Base(r) + region_offset + Row(r) * row_bytes;
  }
};

/// The order in which a kernel's warps take this rank's tokens (one warp a token), by
/// TokenOrder. kStatic: warp w of the grid takes tokens w, w + W, ... (W warps in the
/// grid), so every warp gets the same count of tokens whatever their destinations. kBlock:
/// block b owns the contiguous tokens [T·b/G, T·(b+1)/G) (G blocks) and its warps take them
/// one at a time from a shared-memory counter as each finishes its last. kRank: every warp
/// of the rank takes the next token from one counter in the rank's sync region
/// (NormalSyncLayout::kNextToken, zeroed by the op's first kernel). With a counter, a warp
/// whose tokens have few destinations takes more of them, and the warps end within about
/// one token of each other. A warp claims its next token (Claim: the counter's atomic
/// issued, its result not yet waited for) some time before it takes it (Take), which hides
/// the atomic's round trip; it should claim late in its current token, as a claimed token
/// waits for it. Init is block-collective (every thread, once); Claim and Take
/// warp-collective.
struct TokenSchedule {
  int32_t next = 0;  ///< kStatic: this warp's next token.
  int32_t stride = 0;
  int32_t end = 0;             ///< Tokens at or past it are not this block's.
  int32_t* counter = nullptr;  ///< kBlock / kRank: the next token (shared / global memory).

  __device__ __forceinline__ void Init(TokenOrder order, int32_t num_tokens, int32_t* s_counter,
                                       int32_t* rank_counter) {
    const int32_t warps = static_cast<int32_t>(blockDim.x >> 5);
    if (order == TokenOrder::kBlock) {
      const int64_t n = num_tokens;
      const int32_t begin = static_cast<int32_t>(n * blockIdx.x / gridDim.x);
      end = static_cast<int32_t>(n * (blockIdx.x + 1) / gridDim.x);
      counter = s_counter;
      if (threadIdx.x == 0) *counter = begin;
      __syncthreads();
    } else if (order == TokenOrder::kRank) {
      end = num_tokens;
      counter = rank_counter;
    } else {
      next = static_cast<int32_t>(blockIdx.x) * warps + static_cast<int32_t>(threadIdx.x >> 5);
      stride = static_cast<int32_t>(gridDim.x) * warps;
      end = num_tokens;
    }
  }
  /// Claims this warp's next token: the value to pass to Take (meaningful in lane 0).
  __device__ __forceinline__ int32_t Claim() {
    if (counter == nullptr) {
      const int32_t t = next;
      next = t < end ? t + stride : t;  // Never past end + stride: no overflow near 2^31.
      return t;
    }
    return (threadIdx.x & 31) == 0 ? atomicAdd(counter, 1) : 0;
  }
  /// The token a Claim got (uniform in the warp); >= end when none was left. kRank's
  /// counter is in endpoint memory, which its client can rewrite (CUDA IPC): a claim below
  /// 0 is taken as none left, so every token used is in [0, end).
  __device__ __forceinline__ int32_t Take(int32_t claim) const {
    if (counter == nullptr) return claim;
    const int32_t t = __shfl_sync(0xffffffffu, claim, 0);
    return t < 0 ? end : t;
  }
  /// Claim and Take at once.
  __device__ __forceinline__ int32_t Next() { return Take(Claim()); }
};

/// This rank's token counter of TokenOrder::kRank (NormalSyncLayout::kNextToken).
__device__ __forceinline__ int32_t* RankTokenCounter(const NormalParams& p) {
  return reinterpret_cast<int32_t*>(NormalSync(p, p.rank) + NormalSyncLayout::kNextToken);
}

/// Lowest set bit of a non-zero mask (ranks are visited in ascending order).
__device__ __forceinline__ int LowestRank(uint64_t m) {
  return __ffsll(static_cast<long long>(m)) - 1;
}

/// Adds a thread's count of out-of-range routing values (TokenRanks::LoadRow) to the
/// status word (one atomic per thread that saw any).
__device__ __forceinline__ void RecordBadRouting(const NormalParams& p, unsigned int bad) {
  if (bad != 0) atomicAdd(&OwnStatus(p)->bad_routing, bad);
}

/// Adds a thread's count of pairs or routes dropped for a masked rank to the status word.
__device__ __forceinline__ void RecordDropped(const NormalParams& p, unsigned int dropped) {
  if (dropped != 0) atomicAdd(&OwnStatus(p)->dropped_pairs, dropped);
}

/// Reads the run-time T, recording a value outside [0, M] in the status word (the op then
/// uses T = 0). Call from one thread only when `record` is set.
__device__ __forceinline__ int32_t ReadNumTokens(const NormalParams& p, bool record) {
  const int32_t t = *p.num_tokens;
  if (t >= 0 && t <= p.shape.max_tokens_per_rank) return t;
  if (record) device::RecordBadNumTokens(OwnStatus(p), t);
  return 0;
}

/// Waits, in the calling thread, until `*flag` reaches `seq` (wrap-around safe) or
/// p.timeout_ns pass or the daemon's shutdown word is raised (p.abort_flag); returns false
/// then, recording `peer` as missing.
__device__ __forceinline__ bool WaitFlag(const NormalParams& p, const uint32_t* flag, uint32_t seq,
                                         int peer) {
  const uint64_t deadline = device::GlobalTimerNs() + static_cast<uint64_t>(p.timeout_ns);
  if (device::WaitFlagAtLeast(flag, seq, deadline, p.gpu_scope != 0, p.abort_flag)) return true;
  device::RecordMissingPeer(OwnStatus(p), peer);
  return false;
}

/// Current op's sequence number (written by the op's first kernel).
__device__ __forceinline__ uint32_t CurrentSeq(const NormalParams& p) {
  return *reinterpret_cast<volatile uint32_t*>(NormalSync(p, p.rank) +
                                               NormalSyncLayout::kOpCounter);
}
/// True when the current op's barrier timed out at this rank (the op then moves nothing).
__device__ __forceinline__ bool CurrentOpFailed(const NormalParams& p, uint32_t seq) {
  return *reinterpret_cast<volatile uint32_t*>(NormalSync(p, p.rank) +
                                               NormalSyncLayout::kFailedSeq) == seq;
}

/// End of a multi-block op (copy or combine): each block, after its last global access,
/// counts itself; the last one releases done[rank] = seq at every peer and waits until
/// every peer released done[peer] >= seq here. Call from every thread of every block.
__device__ __forceinline__ void FinishOp(const NormalParams& p, uint32_t seq) {
  __shared__ int s_last;
  __syncthreads();
  uint8_t* own_sync = NormalSync(p, p.rank);
  if (threadIdx.x == 0) {
    FenceForPeers(p);
    unsigned int* counter =
        reinterpret_cast<unsigned int*>(own_sync + NormalSyncLayout::kBlockCounter);
    const unsigned int done_blocks = atomicAdd(counter, 1u);
    s_last = done_blocks == gridDim.x - 1;
    if (s_last) {
      *counter = 0;  // Only this block still runs: the next op starts from 0.
      FenceForPeers(p);
    }
  }
  __syncthreads();
  if (!s_last) return;
  if (threadIdx.x == 0) StampPhase(p, NormalDispatchPhase::kCopyDone);
  const int num_ranks = p.shape.num_ranks;
  const uint64_t done_off = p.sync_map.done();
  for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) {
    ReleaseFlag(p, reinterpret_cast<uint32_t*>(NormalSync(p, r) + done_off) + p.rank, seq);
  }
  for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) {
    WaitFlag(p, reinterpret_cast<const uint32_t*>(own_sync + done_off) + r, seq, r);
  }
  if (p.phase_ns != nullptr) {
    __syncthreads();
    if (threadIdx.x == 0) StampPhase(p, NormalDispatchPhase::kOpDone);
  }
}

}  // namespace epd::kernels::cuda::normal

namespace epd::kernels::cuda::normal {

/// Host side: the variant `EPD_NORMAL_KERNELS` names: unset or empty = kBalanced,
/// "balanced", "static", "block", "bulk". INVALID_ARGUMENT naming the variable and value otherwise.
absl::StatusOr<NormalKernelVariant> NormalKernelVariantFromEnv();

/// The dispatch copy's parts per token (NormalParams::copy_parts) by default, and the most
/// EPD_NORMAL_COPY_PARTS takes.
inline constexpr int32_t kDefaultCopyParts = 4;
inline constexpr int32_t kMaxCopyParts = 16;

/// Host side: NormalParams::copy_parts from `EPD_NORMAL_COPY_PARTS`: unset or empty =
/// kDefaultCopyParts, else a whole number in [1, kMaxCopyParts]; INVALID_ARGUMENT naming the
/// variable and value otherwise.
absl::StatusOr<int32_t> NormalCopyPartsFromEnv();

/// Host side: whether the op's second kernel is launched programmatically
/// (NormalParams::programmatic): `EPD_NORMAL_PDL` unset, empty or "0" = no, "1" = yes when
/// the normal kernels loaded on the current device were built from PTX for sm_90 or later
/// (they have griddepcontrol; on an older GPU, or a compute_80 image JIT-compiled on a newer
/// one, no). INVALID_ARGUMENT naming the variable and value for any other value.
absl::StatusOr<bool> NormalProgrammaticFromEnv();

/// Host side: whether the inter-rank flags are ordered at .gpu scope
/// (NormalParams::gpu_scope): yes when ctx.all_ranks_on_device, unless
/// `EPD_NORMAL_GPU_SCOPE` is "0" (unset, empty or "1" = yes there). INVALID_ARGUMENT naming
/// the variable and value for any other value.
absl::StatusOr<bool> NormalGpuScopeFromEnv(const CudaRankContext& ctx);

/// Host side: launches `kernel<<<grid, threads, shared, stream>>>(params)`, through
/// cudaLaunchKernelEx with programmatic stream serialization when params.programmatic (the
/// op's second kernel). INTERNAL for a launch error.
absl::Status LaunchSecondKernel(void (*kernel)(NormalParams), int32_t grid, int32_t threads,
                                size_t shared, cudaStream_t stream, const NormalParams& params);

/// Host side: validates `ctx` (ValidateNormalContext), fills the parameter block (the
/// kernel variant from NormalKernelVariantFromEnv, the programmatic launch from
/// NormalProgrammaticFromEnv, the flags' scope from NormalGpuScopeFromEnv) and resolves the grid
/// size (ResolveNumBlocks). `num_tokens` null = NormalNumTokensSlot(ctx).
absl::Status MakeNormalParams(const CudaRankContext& ctx, const int32_t* num_tokens,
                              NormalParams* params, int32_t* num_blocks);

/// Host side: launches the one-block arrival barrier (cached dispatch, combine) or, with
/// `notify`, the dispatch notify step (layout pass on min(num_blocks, tiles) blocks, then
/// the exchange in the last of them). Defined in normal_dispatch.cu.
absl::Status LaunchNotify(const NormalParams& params, bool notify, int32_t num_blocks,
                          cudaStream_t stream);

}  // namespace epd::kernels::cuda::normal
