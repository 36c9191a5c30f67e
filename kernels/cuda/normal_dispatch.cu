// Normal (high-throughput) dispatch on CUDA: the notify step (a multi-block layout pass,
// then one block's count exchange and prefix sums) and the copy kernel that writes every token
// straight into its final row at each receiving rank (cuda_normal.h explains the protocol;
// host_ops.h the semantics).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_normal.h"
#include "epd/kernels/cuda_ops.h"
#include "kernels/cuda/bulk_copy.cuh"
#include "kernels/cuda/normal_common.cuh"

namespace epd::kernels::cuda {
namespace normal {
namespace {

constexpr int kNotifyWarps = kNormalNotifyThreads / 32;
constexpr int kCopyUnroll = 4;
using Tiling = NormalDispatchTiling;

/// N into the caller's host-mapped recv_count_out, if any (thread 0 only).
__device__ __forceinline__ void PublishRecvCount(const NormalParams& p, int32_t n) {
  if (p.recv_count_out != nullptr) *reinterpret_cast<volatile int32_t*>(p.recv_count_out) = n;
}

/// Tokens of tile `tile` below the run-time T: in [0, tile_tokens].
__device__ __forceinline__ int32_t TileLength(const NormalParams& p, int tile, int num_tokens) {
  const int64_t left =
      static_cast<int64_t>(num_tokens) - static_cast<int64_t>(tile) * p.tiling.tile_tokens;
  return left <= 0
             ? 0
             : static_cast<int32_t>(left < p.tiling.tile_tokens ? left : p.tiling.tile_tokens);
}

/// Tiles holding the first `num_tokens` tokens.
__device__ __forceinline__ int NumTiles(const NormalParams& p, int num_tokens) {
  return static_cast<int>((static_cast<int64_t>(num_tokens) + p.tiling.tile_tokens - 1) /
                          p.tiling.tile_tokens);
}

/// Base of this rank's `normal_tiles` region, at byte offset `offset` in it.
__device__ __forceinline__ int32_t* Tiles(const NormalParams& p, uint64_t offset) {
  return reinterpret_cast<int32_t*>(p.peer_bases[p.rank] + p.layout.normal_tiles.offset + offset);
}

/// The layout pass of a dispatch, one block's share: tiles blockIdx.x, + gridDim.x, ... of
/// NormalDispatchTiling, each scanned kNormalNotifyThreads tokens at a time (one thread a
/// token). For each tile it writes send_pos[t, r] = EncodeTileRow(tokens of the tile before
/// t sent to r), -1 where t is not sent to r, and the tile's counts into `normal_tiles`: tokens per
/// destination rank [tile, R] and per expert [tile, E] (a duplicate expert in a row once).
/// Ids outside [-1, E) are counted into DeviceStatus and skipped; pairs to a masked rank's
/// expert are dropped and counted. `s_expert_count`: E int32 of shared memory.
__device__ __forceinline__ void LayoutTiles(const NormalParams& p, int num_tokens,
                                            int32_t* s_expert_count) {
  __shared__ int32_t s_warp_count[kNotifyWarps][kNormalMaxRanks];
  __shared__ int32_t s_running[kNormalMaxRanks];
  __shared__ unsigned int s_bad;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const GroupShape& shape = p.shape;
  const int num_ranks = shape.num_ranks;
  const int num_experts = shape.num_experts;
  const int num_topk = shape.num_topk;
  const int experts_per_rank = shape.num_local_experts();
  const unsigned int lanes_below = (1u << lane) - 1u;
  uint8_t* own = p.peer_bases[p.rank];
  const int64_t* topk_idx = Region<const int64_t>(own, p.layout.in_topk_idx);
  int32_t* send_pos = Region<int32_t>(own, p.layout.send_pos);
  int32_t* rank_counts = Tiles(p, p.tiling.rank_counts());
  int32_t* expert_counts = Tiles(p, p.tiling.expert_counts(num_ranks));
  if (tid == 0) s_bad = 0;
  unsigned int bad = 0;
  unsigned int dropped = 0;  // Pairs to masked ranks' experts.

  const int num_tiles = NumTiles(p, num_tokens);
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    for (int e = tid; e < num_experts; e += blockDim.x) s_expert_count[e] = 0;
    for (int r = tid; r < num_ranks; r += blockDim.x) s_running[r] = 0;
    __syncthreads();
    const int first = tile * p.tiling.tile_tokens;
    const int end = first + TileLength(p, tile, num_tokens);
    for (int base = first; base < end; base += blockDim.x) {
      const int t = base + tid;
      const uint64_t mask = t < end ? ScanTopkRow(topk_idx + static_cast<int64_t>(t) * num_topk,
                                                  num_topk, num_experts, experts_per_rank,
                                                  s_expert_count, &bad, p.rank_masked, &dropped)
                                    : 0;
      for (int r = 0; r < num_ranks; ++r) {
        const unsigned int b = __ballot_sync(0xffffffffu, (mask >> r) & 1ull);
        if (lane == 0) s_warp_count[warp][r] = __popc(b);
      }
      __syncthreads();
      if (tid < num_ranks) {  // Exclusive prefix over the warps, after the earlier tokens.
        int32_t acc = s_running[tid];
        for (int w = 0; w < kNotifyWarps; ++w) {
          const int32_t c = s_warp_count[w][tid];
          s_warp_count[w][tid] = acc;
          acc += c;
        }
        s_running[tid] = acc;
      }
      __syncthreads();
      int32_t* pos = send_pos + static_cast<int64_t>(t) * num_ranks;
      for (int r = 0; r < num_ranks; ++r) {
        const bool to_r = (mask >> r) & 1ull;
        const unsigned int b = __ballot_sync(0xffffffffu, to_r);
        if (t < end) {
          pos[r] = to_r ? EncodeTileRow(s_warp_count[warp][r] + __popc(b & lanes_below)) : -1;
        }
      }
      __syncthreads();
    }
    for (int r = tid; r < num_ranks; r += blockDim.x) {
      rank_counts[static_cast<int64_t>(tile) * num_ranks + r] = s_running[r];
    }
    for (int e = tid; e < num_experts; e += blockDim.x) {
      expert_counts[static_cast<int64_t>(tile) * num_experts + e] = s_expert_count[e];
    }
    __syncthreads();  // The next tile zeroes the shared counts.
  }
  if (bad != 0) atomicAdd(&s_bad, bad);
  RecordDropped(p, dropped);
  __syncthreads();
  if (tid == 0 && s_bad != 0) atomicAdd(&OwnStatus(p)->bad_expert_ids, s_bad);
}

/// True in the block of the grid that finished last (every thread of it); the others'
/// global writes are visible to it. Call from every thread of every block, once per kernel.
__device__ __forceinline__ bool LastBlockToFinish(const NormalParams& p) {
  __shared__ int s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    unsigned int* counter =
        reinterpret_cast<unsigned int*>(NormalSync(p, p.rank) + NormalSyncLayout::kBlockCounter);
    const unsigned int done_blocks = atomicAdd(counter, 1u);
    s_last = done_blocks == gridDim.x - 1;
    if (s_last) *counter = 0;  // Only this block still runs: the next kernel starts from 0.
  }
  __syncthreads();
  if (!s_last) return false;
  __threadfence();
  return true;
}

/// The notify step of a dispatch (`notify` set) or the arrival barrier of a cached
/// dispatch / combine (`notify` clear). Blocks of kNormalNotifyThreads threads: with
/// `notify`, min(num_sms, tiles) of them, else one; dynamic shared memory: E int32 when
/// `notify`.
///
/// With `notify`, every block first runs its share of the layout pass (LayoutTiles: the
/// rank-local counts and send_pos within each tile, no peer involved); the block that
/// finishes last goes on alone (LastBlockToFinish), the others exit. That one block bumps
/// the rank's op counter (the op's sequence number seq) and zeroes its token counter
/// (NormalSyncLayout::kNextToken, for the copy or combine kernel after it), then, with
/// `notify`:
///  totals: tokens per destination rank and per expert, summed over the tiles (each tile's
///          count clamped to its token count, so no total exceeds T), and the exclusive
///          prefix of the per-rank counts over the tiles;
///  exchange: thread r writes counts [R] and peer r's per-local-expert counts [El] into
///          peer r's sync region, then releases arrive[rank] = seq there; thread s waits
///          for arrive[s] >= seq here (bounded);
///  receiver: rank_prefix[s] = Σ_{s'<s} counts[s'][rank], recv_count, aligned
///          recv_tokens_per_expert;
///  bases:  bases[tile, r] = Σ_{s'<rank} counts[s'][r] + (tokens of earlier tiles sent to
///          r) into `normal_tiles`; the copy kernel adds them to the layout's send_pos.
/// On a timeout the op is marked failed (kFailedSeq = seq): the copy kernel then skips.
/// Once the arrival wait has passed or timed out, the block lets the op's second kernel start
/// (LetSecondKernelStart: it waits for this grid before it reads what this grid writes).
/// Thread 0 publishes N (PublishRecvCount): the new count, or with `notify` clear or on a
/// timeout the count left as it was.
__global__ void __launch_bounds__(kNormalNotifyThreads)
    NormalNotifyKernel(NormalParams p, int notify) {
  extern __shared__ int32_t s_expert_count[];
  __shared__ int32_t s_tile_prefix[Tiling::kMaxTiles * kNormalMaxRanks];
  __shared__ int32_t s_rank_count[kNormalMaxRanks];
  __shared__ int32_t s_send_offset[kNormalMaxRanks];
  __shared__ uint32_t s_seq;
  __shared__ int32_t s_num_tokens;
  __shared__ int s_failed;

  if (blockIdx.x == 0 && threadIdx.x == 0) StampPhase(p, NormalDispatchPhase::kNotifyStart);
  if (notify) {
    LayoutTiles(p, ReadNumTokens(p, false), s_expert_count);
    if (!LastBlockToFinish(p)) return;
  }
  if (threadIdx.x == 0) StampPhase(p, NormalDispatchPhase::kLayoutDone);

  const int num_ranks = p.shape.num_ranks;
  const int num_experts = p.shape.num_experts;
  const int experts_per_rank = num_experts / num_ranks;
  const int tid = threadIdx.x;
  uint8_t* own = p.peer_bases[p.rank];
  uint8_t* own_sync = NormalSync(p, p.rank);

  if (tid == 0) {
    auto* counter = reinterpret_cast<uint32_t*>(own_sync + NormalSyncLayout::kOpCounter);
    const uint32_t seq = *counter + 1;
    *counter = seq;
    s_seq = seq;
    // The op's copy or combine kernel, next on this stream, takes tokens from 0.
    *reinterpret_cast<int32_t*>(own_sync + NormalSyncLayout::kNextToken) = 0;
    s_num_tokens = ReadNumTokens(p, true);
    s_failed = 0;
  }
  __syncthreads();
  const uint32_t seq = s_seq;
  const int num_tokens = s_num_tokens;
  const int num_tiles = NumTiles(p, num_tokens);

  // ---- totals over the layout's tiles (written by other blocks of this grid: read past L1).
  if (notify) {
    const int32_t* rank_counts = Tiles(p, p.tiling.rank_counts());
    const int32_t* expert_counts = Tiles(p, p.tiling.expert_counts(num_ranks));
    for (int i = tid; i < num_tiles * num_ranks; i += blockDim.x) {
      const int32_t len = TileLength(p, i / num_ranks, num_tokens);
      const int32_t c = __ldcg(rank_counts + i);
      s_tile_prefix[i] = c < 0 ? 0 : (c > len ? len : c);
    }
    for (int e = tid; e < num_experts; e += blockDim.x) {
      // kTotalsBatch tiles' counts in flight at once: one round trip per batch.
      constexpr int kTotalsBatch = 8;
      int32_t total = 0;
      for (int tile0 = 0; tile0 < num_tiles; tile0 += kTotalsBatch) {
        int32_t c[kTotalsBatch];
#pragma unroll
        for (int u = 0; u < kTotalsBatch; ++u) {
          c[u] = tile0 + u < num_tiles
                     ? __ldcg(expert_counts + static_cast<int64_t>(tile0 + u) * num_experts + e)
                     : 0;
        }
#pragma unroll
        for (int u = 0; u < kTotalsBatch; ++u) {
          const int32_t len = TileLength(p, tile0 + u, num_tokens);  // 0 past the last tile
          total += c[u] < 0 ? 0 : (c[u] > len ? len : c[u]);
        }
      }
      s_expert_count[e] = total;
    }
    __syncthreads();
    if (tid < num_ranks) {
      int32_t acc = 0;
      for (int tile = 0; tile < num_tiles; ++tile) {
        const int32_t c = s_tile_prefix[tile * num_ranks + tid];
        s_tile_prefix[tile * num_ranks + tid] = acc;
        acc += c;
      }
      s_rank_count[tid] = acc;
    }
    __syncthreads();
  }

  // ---- exchange: counts and arrival flags into every peer's sync region.
  if (tid < num_ranks) {
    const int peer = tid;
    uint8_t* peer_sync = NormalSync(p, peer);
    if (notify) {
      int32_t* counts =
          reinterpret_cast<int32_t*>(peer_sync + p.sync_map.counts()) + p.rank * num_ranks;
      for (int r = 0; r < num_ranks; ++r) counts[r] = s_rank_count[r];
      int32_t* expert =
          reinterpret_cast<int32_t*>(peer_sync + p.sync_map.expert()) + p.rank * experts_per_rank;
      for (int j = 0; j < experts_per_rank; ++j) {
        expert[j] = s_expert_count[peer * experts_per_rank + j];
      }
    }
    ReleaseFlag(p, reinterpret_cast<uint32_t*>(peer_sync + p.sync_map.arrive()) + p.rank, seq);
  }
  if (tid < num_ranks) {
    const auto* arrive = reinterpret_cast<const uint32_t*>(own_sync + p.sync_map.arrive());
    if (!WaitFlag(p, arrive + tid, seq, tid)) s_failed = 1;
  }
  __syncthreads();
  if (tid == 0) StampPhase(p, NormalDispatchPhase::kArrived);
  // Every peer is past its own layout pass, and the rest of this block waits for nothing:
  // the copy or combine kernel's blocks may take SMs now (a programmatic launch).
  LetSecondKernelStart();
  if (s_failed || !notify) {
    if (!s_failed && p.cached && p.expert_stats.last_normal != nullptr) {
      for (int j = tid; j < experts_per_rank; j += blockDim.x) {
        device::AddExpertTokens(p.expert_stats, j,
                                static_cast<int64_t>(p.expert_stats.last_normal[j]));
      }
    }
    if (tid == 0) {
      if (s_failed) {
        *reinterpret_cast<volatile uint32_t*>(own_sync + NormalSyncLayout::kFailedSeq) = seq;
      }
      PublishRecvCount(p, *Region<int32_t>(own, p.layout.recv_count));  // Left as it was.
      StampPhase(p, NormalDispatchPhase::kNotifyDone);
    }
    return;
  }

  // ---- receiver side: prefixes and counts; sender side: offsets at each destination.
  // Every peer's counts are read once, all loads in flight at once, into shared memory (not
  // one round trip per peer in a thread's loop): the column sent to this rank into
  // s_rank_count, the offsets at each destination summed over the lower ranks into
  // s_send_offset, the local-expert counts [R, El] into s_expert_count (the counts that went
  // out above were read before the arrival barrier).
  for (int r = tid; r < num_ranks; r += blockDim.x) s_send_offset[r] = 0;
  __syncthreads();
  {
    const volatile int32_t* counts =
        reinterpret_cast<const volatile int32_t*>(own_sync + p.sync_map.counts());
    const volatile int32_t* expert =
        reinterpret_cast<const volatile int32_t*>(own_sync + p.sync_map.expert());
    for (int i = tid; i < num_ranks * num_ranks; i += blockDim.x) {
      const int sender = i / num_ranks;
      const int dest = i - sender * num_ranks;
      const int32_t c = counts[i];
      if (dest == p.rank) s_rank_count[sender] = c;
      if (sender < p.rank) atomicAdd(&s_send_offset[dest], c);
    }
    for (int i = tid; i < num_ranks * experts_per_rank; i += blockDim.x) {
      s_expert_count[i] = expert[i];
    }
  }
  __syncthreads();
  if (tid < num_ranks) {
    int32_t prefix = 0;
    for (int s = 0; s < tid; ++s) prefix += s_rank_count[s];
    Region<int32_t>(own, p.layout.rank_prefix)[tid] = prefix;
  }
  if (tid == 0) {
    int32_t total = 0;
    for (int s = 0; s < num_ranks; ++s) total += s_rank_count[s];
    *Region<int32_t>(own, p.layout.recv_count) = total;
    PublishRecvCount(p, total);
  }
  for (int j = tid; j < experts_per_rank; j += blockDim.x) {
    int64_t count = 0;
    for (int s = 0; s < num_ranks; ++s) count += s_expert_count[s * experts_per_rank + j];
    device::AddExpertTokens(p.expert_stats, j, count);
    if (p.expert_stats.last_normal != nullptr) {
      p.expert_stats.last_normal[j] = static_cast<uint64_t>(count);
    }
    const int64_t a = p.expert_alignment;
    Region<int32_t>(own, p.layout.recv_tokens_per_expert)[j] =
        static_cast<int32_t>((count + a - 1) / a * a);
  }
  __syncthreads();

  // ---- bases: first row of each tile's tokens at each destination.
  int32_t* bases = Tiles(p, p.tiling.bases(num_ranks));
  for (int i = tid; i < num_tiles * num_ranks; i += blockDim.x) {
    bases[i] = s_send_offset[i % num_ranks] + s_tile_prefix[i];
  }
  if (p.phase_ns != nullptr) {
    __syncthreads();
    if (tid == 0) StampPhase(p, NormalDispatchPhase::kNotifyDone);
  }
}

/// Streaming 16-byte / 2-byte load that does not allocate in L1 (rows are read once).
template <typename Vec>
__device__ __forceinline__ Vec LoadStreaming(const Vec* p) {
  if constexpr (sizeof(Vec) == 16) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
  } else {
    return *p;
  }
}

/// Loads the vectors [i + 32u] (u < kCopyUnroll) of `src` below `num_vec` into v[u]
/// (i = the chunk's first vector + lane).
template <typename Vec>
__device__ __forceinline__ void LoadChunk(const Vec* src, int64_t i, int64_t num_vec,
                                          Vec (&v)[kCopyUnroll]) {
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    if (i + 32 * u < num_vec) v[u] = LoadStreaming(src + i + 32 * u);
  }
}

/// One token's metadata held by its warp: lane j has scales j and j + 32 (fp8) and top-k
/// entry j (a new dispatch); any beyond are read where they are written.
struct TokenMeta {
  float scale_lo, scale_hi;
  int64_t expert;
  float weight;
};

/// The per-warp state and steps of a dispatch's copy, shared by its two kernels
/// (NormalDispatchCopyKernel, NormalDispatchBulkKernel): the token's routing row, its
/// metadata in and out, and the end of the op.
struct DispatchCopy {
  const NormalParams* p;
  int lane;
  int num_ranks, num_topk, experts_per_rank, num_scales;
  int64_t row_bytes;
  int32_t* send_pos;
  const int32_t* tile_bases;
  const uint8_t* x;
  const float* x_scales;
  const int64_t* topk_idx;
  const float* topk_weights;
  TokenRanks ranks;
  int64_t capacity;
  int64_t src_info_base;
  bool fresh;  ///< A new dispatch: recv_topk_idx / weights written (not cached).
  unsigned int bad_routing = 0;
  // Routes to masked ranks: counted for a cached dispatch (its send_pos predates the mask);
  // a new dispatch's send_pos has none (its pairs were dropped and counted by the notify).
  unsigned int dropped = 0;

  uint32_t seq;          ///< The op's sequence number.
  TokenSchedule tokens;  ///< This warp's work items: tokens, or parts of tokens.
  int64_t parts = 1;     ///< Items per token (CopyTokensByVectors).
  int64_t part_vec = 0;  ///< `vec_bytes` vectors of a part (the last part may be shorter).

  /// The copy kernels' start (every thread of the block): false when the op failed (the
  /// block then returns at once), else the state set up and the schedule started. What
  /// comes from the params alone is set up before the wait for the notify's grid
  /// (WaitForFirstKernel), which a programmatic launch overlaps with the notify's end.
  /// `vec_bytes`: the vector path's unit (its items are parts of tokens:
  /// NormalCopyParts::For of NormalParams::copy_parts in chunks of 32 * kCopyUnroll
  /// vectors); 0 = a token per item.
  __device__ __forceinline__ bool Start(const NormalParams& params, TokenOrder order,
                                        int32_t* s_next_token, int64_t vec_bytes) {
    Init(params);
    WaitForFirstKernel();
    seq = CurrentSeq(params);
    if (CurrentOpFailed(params, seq)) return false;
    const int32_t num_tokens = ReadNumTokens(params, false);
    if (vec_bytes > 0) {
      const NormalCopyParts split = NormalCopyParts::For(row_bytes / vec_bytes, 32 * kCopyUnroll,
                                                         params.copy_parts, num_tokens);
      parts = split.parts;
      part_vec = split.part_vec;
    }
    tokens.Init(order, static_cast<int32_t>(num_tokens * parts), s_next_token,
                RankTokenCounter(params));
    if (blockIdx.x == 0 && threadIdx.x == 0) StampPhase(params, NormalDispatchPhase::kCopyStart);
    return true;
  }

  /// The per-warp state from the params (and the peer bases and rank mask, which no kernel
  /// of the op writes).
  __device__ __forceinline__ void Init(const NormalParams& params) {
    p = &params;
    lane = threadIdx.x & 31;
    num_ranks = params.shape.num_ranks;
    num_topk = params.shape.num_topk;
    experts_per_rank = params.shape.num_local_experts();
    num_scales = params.shape.num_scales();
    row_bytes = params.fp8 ? static_cast<int64_t>(params.shape.hidden)
                           : 2 * static_cast<int64_t>(params.shape.hidden);
    uint8_t* own = params.peer_bases[params.rank];
    send_pos = Region<int32_t>(own, params.layout.send_pos);
    tile_bases = reinterpret_cast<const int32_t*>(own + params.layout.normal_tiles.offset +
                                                  params.tiling.bases(num_ranks));
    x = Region<const uint8_t>(own, params.layout.in_x);
    x_scales = Region<const float>(own, params.layout.in_scales);
    topk_idx = Region<const int64_t>(own, params.layout.in_topk_idx);
    topk_weights = Region<const float>(own, params.layout.in_topk_weights);
    ranks.LoadBases(params.peer_bases, num_ranks, lane, params.rank_masked);
    capacity = params.shape.max_recv_tokens();
    src_info_base = static_cast<int64_t>(params.rank) * params.shape.max_tokens_per_rank;
    fresh = params.cached == 0;
  }

  /// Token t's row of x.
  __device__ __forceinline__ const uint8_t* Row(int32_t t) const { return x + t * row_bytes; }

  /// Loads token t's metadata (TokenMeta). Warp-collective.
  __device__ __forceinline__ TokenMeta LoadMeta(int32_t t) const {
    const float* sc = x_scales + static_cast<int64_t>(t) * num_scales;
    const int64_t first = static_cast<int64_t>(t) * num_topk;
    TokenMeta m;
    m.scale_lo = p->fp8 && lane < num_scales ? sc[lane] : 0.0f;
    m.scale_hi = p->fp8 && lane + 32 < num_scales ? sc[lane + 32] : 0.0f;
    m.expert = fresh && lane < num_topk ? topk_idx[first + lane] : -1;
    m.weight = fresh && p->with_weights && lane < num_topk ? topk_weights[first + lane] : 0.0f;
    return m;
  }

  /// Reads send_pos[t, :] into `ranks` (lane r holds ranks r and r + 32; unless cached,
  /// the layout's rows within the tile, which it turns into final rows with the notify's
  /// tile bases: TokenRanks::ResolveRow) and returns the destination mask. The warp that
  /// takes a token's first part (`first_part`; every warp when a token is one item) counts
  /// bad and dropped routes and writes the final rows back; the warps of its other parts
  /// route the same and count nothing. Warp-collective.
  __device__ __forceinline__ uint64_t Route(int32_t t, bool first_part) {
    int32_t* pos_row = send_pos + static_cast<int64_t>(t) * num_ranks;
    unsigned int uncounted = 0;
    unsigned int* bad = first_part ? &bad_routing : &uncounted;
    unsigned int* drop = first_part ? &dropped : &uncounted;
    if (p->cached) {
      ranks.LoadRow(pos_row, num_ranks, lane, capacity, bad, drop);
    } else {
      ranks.ResolveRow(pos_row,
                       tile_bases + static_cast<int64_t>(t / p->tiling.tile_tokens) * num_ranks,
                       num_ranks, lane, capacity, bad, drop, first_part);
    }
    return ranks.mask;
  }

  /// Writes token t's scales, recv_src_info and (a new dispatch) recv_topk_idx /
  /// recv_topk_weights at every destination in `mask`. Warp-collective.
  __device__ __forceinline__ void StoreMeta(int32_t t, uint64_t mask, const TokenMeta& meta) {
    const float* sc = x_scales + static_cast<int64_t>(t) * num_scales;
    const int64_t first = static_cast<int64_t>(t) * num_topk;
    for (uint64_t m = mask; m != 0; m &= m - 1) {
      const int r = LowestRank(m);
      const int64_t pos = ranks.Row(r);
      uint8_t* dst_base = ranks.Base(r);
      if (p->fp8) {
        float* dst = Region<float>(dst_base, p->layout.recv_scales) + pos * num_scales;
        if (lane < num_scales) dst[lane] = meta.scale_lo;
        if (lane + 32 < num_scales) dst[lane + 32] = meta.scale_hi;
        for (int j = lane + 64; j < num_scales; j += 32) dst[j] = sc[j];
      }
      if (lane == 0) {
        Region<int32_t>(dst_base, p->layout.recv_src_info)[pos] =
            static_cast<int32_t>(src_info_base + t);
      }
      if (fresh) {
        const int64_t first_local = static_cast<int64_t>(r) * experts_per_rank;
        int64_t* recv_idx = Region<int64_t>(dst_base, p->layout.recv_topk_idx) + pos * num_topk;
        float* recv_w = Region<float>(dst_base, p->layout.recv_topk_weights) + pos * num_topk;
        if (lane < num_topk) {
          const bool local =
              meta.expert >= first_local && meta.expert < first_local + experts_per_rank;
          recv_idx[lane] = local ? meta.expert - first_local : -1;
          // Without weights: zeros (not what an earlier dispatch left there).
          recv_w[lane] = local ? meta.weight : 0.0f;
        }
        for (int k = lane + 32; k < num_topk; k += 32) {
          const int64_t e = topk_idx[first + k];
          const bool local = e >= first_local && e < first_local + experts_per_rank;
          recv_idx[k] = local ? e - first_local : -1;
          recv_w[k] = local && p->with_weights ? topk_weights[first + k] : 0.0f;
        }
      }
    }
  }

  /// The end of the copy: the routing counts into DeviceStatus, then FinishOp. Every
  /// thread of every block.
  __device__ __forceinline__ void Finish() {
    RecordBadRouting(*p, bad_routing);
    if (p->cached) RecordDropped(*p, dropped);
    FinishOp(*p, seq);
  }
};

/// The vector path of the copy, from the warp's TokenSchedule on. The schedule hands out
/// items (DispatchCopy::Start with sizeof(Vec)): token t's row is cut into `parts` parts of
/// whole chunks (kCopyUnroll vectors a lane: 2 KiB of int4, 256 bytes of bf16 units), item =
/// t * parts + part. For each item, one round trip
/// loads its first chunk, the routing row and (first part only) the token's metadata (none
/// depends on another); then each chunk is stored at every destination and the next chunk
/// loaded; the first part's warp then stores the metadata. `Vec` is int4 when a row is a
/// multiple of 16 bytes, else bf16 units.
template <typename Vec>
__device__ __forceinline__ void CopyTokensByVectors(DispatchCopy& c) {
  const int lane = c.lane;
  const int64_t num_vec = c.row_bytes / static_cast<int64_t>(sizeof(Vec));
  constexpr int64_t kChunk = 32 * kCopyUnroll;
  const int64_t parts = c.parts;
  const int64_t part_vec = c.part_vec;
  TokenSchedule& items = c.tokens;
  int32_t claim = items.Claim();
  for (;;) {
    const int32_t item = items.Take(claim);
    if (item >= items.end) break;
    const int32_t t = static_cast<int32_t>(item / parts);
    const int64_t part = item - static_cast<int64_t>(t) * parts;
    const int64_t first = part * part_vec;
    const int64_t last = first + part_vec < num_vec ? first + part_vec : num_vec;
    const Vec* src = reinterpret_cast<const Vec*>(c.Row(t));
    Vec v[kCopyUnroll];
    LoadChunk(src, first + lane, last, v);
    const TokenMeta meta = part == 0 ? c.LoadMeta(t) : TokenMeta{};
    const uint64_t mask = c.Route(t, part == 0);
    if (mask == 0) {
      claim = items.Claim();
      continue;
    }
    // Warp-uniform trip count: every lane runs every iteration (RowAt shuffles need the
    // whole warp); the tail is guarded per vector. The next item is claimed as the last
    // chunk starts.
    for (int64_t base = first; base < last; base += kChunk) {
      const int64_t i = base + lane;
      if (base != first) LoadChunk(src, i, last, v);
      if (base + kChunk >= last) claim = items.Claim();
      for (uint64_t m = mask; m != 0; m &= m - 1) {
        Vec* dst = reinterpret_cast<Vec*>(
            c.ranks.RowAt(LowestRank(m), c.p->layout.recv_x.offset, c.row_bytes));
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          if (i + 32 * u < last) dst[i + 32 * u] = v[u];
        }
      }
    }
    if (part == 0) c.StoreMeta(t, mask, meta);
  }
}

/// The copy step of a dispatch: grid of num_sms blocks of kNormalThreads, one warp a token
/// at a time (TokenSchedule, p.order), moving rows through registers
/// (CopyTokensByVectors). The params are by value: no pointer into the parameter space
/// (ll_internal.h, RunFusedRank; the PTX is the same as with __grid_constant__).
template <typename Vec>
__global__ void __launch_bounds__(kNormalThreads, 1) NormalDispatchCopyKernel(NormalParams p) {
  __shared__ int32_t s_next_token;
  DispatchCopy c;
  if (!c.Start(p, p.order, &s_next_token, sizeof(Vec))) return;
  CopyTokensByVectors<Vec>(c);
  c.Finish();
}

/// The copy step with bulk copies (sm_90 and later; rows a multiple of 16 bytes): grid of
/// num_sms blocks of W warps (LaunchBulkCopy), TokenOrder::kBlock; dynamic shared
/// memory: two row slots per warp, then two mbarriers per warp. Each warp's lane 0 loads
/// its next token's row into one slot (one bulk copy) while the current token's row, in
/// the other slot, goes to every destination (one bulk store each, one bulk group a
/// token); the warp meanwhile resolves the routing and moves the metadata. Before a slot
/// is loaded again, lane 0 waits until the stores from it have read it; before the end,
/// until every store has written. Compiled for an older architecture (a compute_80 image
/// JIT-compiled on a newer GPU) it runs CopyTokensByVectors instead.
__global__ void __launch_bounds__(kNormalThreads, 1) NormalDispatchBulkKernel(NormalParams p) {
  __shared__ int32_t s_next_token;
  DispatchCopy c;
#ifdef EPD_BULK_COPY
  if (!c.Start(p, TokenOrder::kBlock, &s_next_token, /*vec_bytes=*/0)) return;
#else
  if (!c.Start(p, TokenOrder::kBlock, &s_next_token, sizeof(int4))) return;
#endif
#ifdef EPD_BULK_COPY
  TokenSchedule& tokens = c.tokens;
  extern __shared__ __align__(128) uint8_t s_rows[];
  const int lane = c.lane;
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int warps = static_cast<int>(blockDim.x >> 5);
  const uint32_t row_bytes = static_cast<uint32_t>(c.row_bytes);
  uint8_t* slots = s_rows + static_cast<uint64_t>(warp) * 2 * row_bytes;
  uint64_t* bars =
      reinterpret_cast<uint64_t*>(s_rows + static_cast<uint64_t>(warps) * 2 * row_bytes) + 2 * warp;
  if (lane == 0) {
    device::InitBulkBarrier(&bars[0]);
    device::InitBulkBarrier(&bars[1]);
  }
  __syncwarp();
  bool stuck = false;   // A row load passed the deadline: stores skipped from then on.
  uint32_t parity = 0;  // Bit s: parity of slot s's next phase (lane 0).
  int slot = 0;
  int32_t t = tokens.Next();
  if (lane == 0 && t < tokens.end) device::BulkLoad(slots, c.Row(t), row_bytes, &bars[0]);
  while (t < tokens.end) {
    const int32_t next = tokens.Next();
    uint8_t* row = slots + static_cast<uint64_t>(slot) * row_bytes;
    if (lane == 0 && next < tokens.end) {
      device::BulkWaitRead();  // The other slot's stores (the token before t) have read it.
      device::BulkLoad(slots + static_cast<uint64_t>(slot ^ 1) * row_bytes, c.Row(next), row_bytes,
                       &bars[slot ^ 1]);
    }
    const TokenMeta meta = c.LoadMeta(t);
    const uint64_t mask = c.Route(t, /*first_part=*/true);
    if (lane == 0) {
      // Every load is waited for, sent or not, so each slot's phases stay in step.
      const uint32_t phase = (parity >> slot) & 1u;
      if (!stuck && !device::BulkBarrierDone(&bars[slot], phase)) {
        const uint64_t deadline = device::GlobalTimerNs() + static_cast<uint64_t>(p.timeout_ns);
        while (!device::BulkBarrierDone(&bars[slot], phase)) {
          if (device::GlobalTimerNs() > deadline) {
            stuck = true;
            atomicOr(&OwnStatus(p)->timed_out, 1u);
            break;
          }
        }
      }
      parity ^= 1u << slot;
    }
    for (uint64_t m = mask; m != 0; m &= m - 1) {
      uint8_t* dst = c.ranks.RowAt(LowestRank(m), p.layout.recv_x.offset, c.row_bytes);
      if (lane == 0 && !stuck) device::BulkStore(dst, row, row_bytes);
    }
    if (lane == 0) device::BulkCommit();
    c.StoreMeta(t, mask, meta);
    t = next;
    slot ^= 1;
  }
  if (lane == 0) device::BulkWaitWritten();
  __syncwarp();
#else
  CopyTokensByVectors<int4>(c);
#endif
  c.Finish();
}

/// Shared memory NormalDispatchBulkKernel leaves for its static variables.
constexpr int64_t kBulkStaticShared = 1024;

/// The current device and the dynamic shared memory NormalDispatchBulkKernel may use on
/// it: its opt-in maximum less kBulkStaticShared, or 0 below compute capability 9 (no bulk
/// copies).
absl::Status BulkSharedBudget(int* device, int64_t* budget) {
  int major = 0;
  int optin = 0;
  EPD_CUDA_RETURN_IF_ERROR(cudaGetDevice(device));
  EPD_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, *device));
  EPD_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, *device));
  *budget = major >= 9 ? static_cast<int64_t>(optin) - kBulkStaticShared : 0;
  return absl::OkStatus();
}

/// Lets NormalDispatchBulkKernel use `bytes` of dynamic shared memory on `device` (the
/// current one), once per device (a per-kernel, per-device attribute; devices past 63 set it
/// on every call). The preload sets it, so a launch inside a stream capture need not.
absl::Status AllowBulkSharedMemory(int device, int64_t bytes) {
  static std::atomic<uint64_t> allowed{0};
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (allowed.load(std::memory_order_relaxed) & bit) != 0) return absl::OkStatus();
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(NormalDispatchBulkKernel,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(bytes)));
  allowed.fetch_or(bit, std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::Status PreloadDispatchKernels() {
  cudaFuncAttributes attr;
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, NormalNotifyKernel));
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, NormalDispatchCopyKernel<int4>));
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, NormalDispatchCopyKernel<uint16_t>));
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, NormalDispatchBulkKernel));
  int device = 0;
  int64_t budget = 0;
  EPD_RETURN_IF_ERROR(BulkSharedBudget(&device, &budget));
  if (budget > 0) EPD_RETURN_IF_ERROR(AllowBulkSharedMemory(device, budget));
  return absl::OkStatus();
}
const bool kDispatchPreloadRegistered = RegisterPreloadHook(&PreloadDispatchKernels);

/// Launches NormalDispatchBulkKernel for rows of `row_bytes` when the current device has
/// bulk copies (compute capability >= 9) and room for two rows a warp, with as many warps
/// (<= kNormalThreads / 32) as its opt-in shared memory holds; sets *launched. Leaves
/// *launched false (and launches nothing) otherwise: rows not a multiple of 16 bytes or
/// regions not 16-byte aligned, an older GPU, rows too long.
absl::Status LaunchBulkCopy(const NormalParams& p, int64_t row_bytes, int32_t num_blocks,
                            cudaStream_t stream, bool* launched) {
  *launched = false;
  if (row_bytes % 16 != 0 || p.layout.in_x.offset % 16 != 0 || p.layout.recv_x.offset % 16 != 0) {
    return absl::OkStatus();
  }
  int device = 0;
  int64_t budget = 0;
  EPD_RETURN_IF_ERROR(BulkSharedBudget(&device, &budget));
  const int64_t per_warp = 2 * row_bytes + 2 * static_cast<int64_t>(sizeof(uint64_t));
  const int64_t warps = std::min<int64_t>(budget / per_warp, kNormalThreads / 32);
  if (warps < 1) return absl::OkStatus();
  EPD_RETURN_IF_ERROR(AllowBulkSharedMemory(device, budget));
  *launched = true;
  return LaunchSecondKernel(NormalDispatchBulkKernel, num_blocks, static_cast<int32_t>(warps * 32),
                            static_cast<size_t>(warps * per_warp), stream, p);
}

}  // namespace

absl::Status LaunchNotify(const NormalParams& params, bool notify, int32_t num_blocks,
                          cudaStream_t stream) {
  const size_t shared = notify ? sizeof(int32_t) * params.shape.num_experts : 0;
  int32_t grid = 1;
  if (notify) {
    grid = num_blocks < params.tiling.num_tiles ? num_blocks : params.tiling.num_tiles;
    if (grid < 1) grid = 1;
  }
  NormalNotifyKernel<<<grid, kNormalNotifyThreads, shared, stream>>>(params, notify ? 1 : 0);
  return EPD_CUDA_STATUS(cudaGetLastError());
}

}  // namespace normal

absl::Status NormalDispatch(const CudaRankContext& ctx, const NormalDispatchArgs& args,
                            cudaStream_t stream) {
  if (args.expert_alignment < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "NormalDispatch: expert_alignment = ", args.expert_alignment, " must be >= 1"));
  }
  if (args.fp8 && !ctx.shape.use_fp8) {
    return absl::InvalidArgumentError(
        "NormalDispatch: fp8 = true but the group spec has use_fp8 = false (no FP8 regions)");
  }
  if (args.fp8 && ctx.shape.hidden % kFp8BlockChannels != 0) {
    return absl::InvalidArgumentError(absl::StrCat("NormalDispatch: FP8 needs hidden % ",
                                                   kFp8BlockChannels,
                                                   " == 0, hidden = ", ctx.shape.hidden));
  }
  normal::NormalParams p;
  int32_t num_blocks = 0;
  EPD_RETURN_IF_ERROR(normal::MakeNormalParams(ctx, args.num_tokens, &p, &num_blocks));
  p.fp8 = args.fp8 ? 1 : 0;
  p.expert_alignment = args.expert_alignment;
  p.with_weights = args.with_weights ? 1 : 0;
  p.cached = args.cached ? 1 : 0;
  p.recv_count_out = args.recv_count_out;
  p.expert_stats = args.expert_stats;
  p.phase_ns = args.phase_ns;

  EPD_RETURN_IF_ERROR(normal::LaunchNotify(p, !args.cached, num_blocks, stream));
  const int64_t row_bytes = args.fp8 ? ctx.shape.hidden : 2 * int64_t{ctx.shape.hidden};
  if (p.variant == normal::NormalKernelVariant::kBulk) {
    bool launched = false;
    EPD_RETURN_IF_ERROR(normal::LaunchBulkCopy(p, row_bytes, num_blocks, stream, &launched));
    if (launched) return absl::OkStatus();
  }
  return normal::LaunchSecondKernel(row_bytes % 16 == 0
                                        ? normal::NormalDispatchCopyKernel<int4>
                                        : normal::NormalDispatchCopyKernel<uint16_t>,
                                    num_blocks, kNormalThreads, 0, stream, p);
}

}  // namespace epd::kernels::cuda
