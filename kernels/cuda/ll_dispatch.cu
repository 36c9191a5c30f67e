// LowLatencyDispatch on CUDA (cuda_ops.h; semantics: host_ops.h LowLatencyDispatch): one
// kernel per rank, routing on the small (shared memory) or large (ll_routing) path, count
// exchange, row copy with FP8 quantisation, data flags, and the daemon-launched hand-off.
// The step-by-step protocol is in docs/CUDA_BACKEND.md "Low-latency dispatch".
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/op_rules.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ll_internal.h"

namespace epd::kernels::cuda {
namespace {

using device::GlobalTimerNs;
using device::LaneId;
using device::LdRelaxed;
using device::LowLatencyExchange;
using device::LowLatencyState;
using device::StRelease;
using device::WaitFlagAtLeast;

constexpr int kWarps = kLowLatencyThreads / 32;

enum DispatchMode : int { kBf16Vec = 0, kBf16Scalar = 1, kFp8 = 2 };

struct DispatchParams {
  uint8_t* const* peer_bases;
  uint8_t* own_base;
  const int32_t* num_tokens;
  int32_t num_tokens_value;  // >= 0: T by value (num_tokens unused)
  const bf16_bits* x;
  const int64_t* topk_idx;
  const uint8_t* rank_masked;  // [R] nonzero = masked (CudaRankContext::rank_masked), or null
  int32_t* recv_count;         // own ll_recv_count[b]
  int32_t* handle_pos;         // own ll_handle_pos[b]
  uint64_t sync_offset;
  uint64_t recv_x_offset;         // ll_recv_x[b], same at every rank
  uint64_t recv_scales_offset;    // ll_recv_scales[b] (layout.h LowLatencyScaleOffset)
  uint64_t recv_src_info_offset;  // ll_recv_src_info[b]
  int64_t rows_per_expert;        // R * Mll
  int64_t timeout_ns;
  const uint32_t* abort_flag;     // CudaRankContext::abort_flag (the daemon's shutdown word).
  KernelHandoff handoff;          // Daemon-launched stream-ordered hand-off (null flags = none).
  ExpertTokenStats expert_stats;  // Cumulative per-expert counts (null totals = off).
  int32_t rank;
  int32_t num_ranks;
  int32_t num_experts;
  int32_t experts_per_rank;
  int32_t hidden;
  int32_t num_topk;
  int32_t max_tokens;  // Mll
  int32_t num_scales;
  int32_t scale_words;  // 4-byte scale columns per token: num_scales, or num_scales / 4 (UE8M0)
  int32_t buffer;
  int32_t mask_stride;  // words per token of the expert bitmask: ceil(E/32) made odd
  // Large path: own ll_routing [Mll, K] {route code, position}, and the groups of 32
  // tokens per routing tile (shared memory holds [tile_groups, E] ballots and prefixes).
  int2* routing;
  int32_t tile_groups;
  bool round_scale;
  bool use_ue8m0;  // scales as UE8M0 bytes, one int32 word per 512-channel chunk
  bool gpu_scope;  // every rank on this GPU: flags at .gpu scope (common.cuh LdAcquire)
};

__device__ __forceinline__ int32_t* CountsAt(uint8_t* base, const DispatchParams& p, int32_t parity,
                                             int32_t sender) {
  return reinterpret_cast<int32_t*>(
      base + p.sync_offset + kSyncLowLatencyExchangeOffset +
      LowLatencyExchange::Counts(parity, sender, p.num_ranks, p.num_experts));
}

__device__ __forceinline__ uint32_t* ExchangeFlag(uint8_t* base, const DispatchParams& p,
                                                  uint64_t flag_offset) {
  return reinterpret_cast<uint32_t*>(base + p.sync_offset + kSyncLowLatencyExchangeOffset +
                                     flag_offset);
}

/// Channels per unit of work of the vector paths: a multiple of 128 (FP8 scale blocks).
constexpr int32_t kChunkChannels = 512;

// Quantizes the 16 channels held by this lane (two 16-byte bf16 vectors) to 16 e4m3 bytes
// with the scale of their 128-channel block, exactly as host::QuantizeRowFp8: amax over the
// block (fmaxf, NaN ignored) reduced over the 8 lanes that hold it, Fp8Scale, then x / scale
// (a true division) rounded to e4m3. All 32 lanes must call it together.
__device__ __forceinline__ uint4 QuantizeVec16(const uint4& lo, const uint4& hi, bool round_scale,
                                               float* scale) {
  float f[16];
  const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    f[2 * c] = Bf16ToFloat(static_cast<bf16_bits>(w[c] & 0xffffu));
    f[2 * c + 1] = Bf16ToFloat(static_cast<bf16_bits>(w[c] >> 16));
  }
  float amax = 0.0f;
#pragma unroll
  for (int c = 0; c < 16; ++c) amax = fmaxf(amax, fabsf(f[c]));
#pragma unroll
  for (int mask = 4; mask >= 1; mask >>= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, mask));
  }
  const float s = Fp8Scale(amax, round_scale);
  *scale = s;
  uint32_t packed[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    packed[c] =
        static_cast<uint32_t>(device::FloatsToE4m3x2(f[4 * c] / s, f[4 * c + 1] / s)) |
        (static_cast<uint32_t>(device::FloatsToE4m3x2(f[4 * c + 2] / s, f[4 * c + 3] / s)) << 16);
  }
  return make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

/// One unit of copy work of the vector paths as one lane holds it: the lane's 16 channels
/// of one (token, 512-channel chunk), loaded (BF16: v0, v1 = 16 bf16) or quantised (FP8:
/// v0 = 16 e4m3 bytes, scale = its 128-channel block's scale, ue8m0_word = the Ue8m0Code
/// bytes of the chunk's four blocks, block 4j + i in byte i, as lanes 0, 8, 16, 24 hold them).
struct UnitData {
  uint4 v0;
  uint4 v1;
  float scale;
  uint32_t ue8m0_word;
};

/// Destinations a warp works out at once (one per lane): the small path's K (<= this) in
/// one batch, the large path's in batches of this many.
constexpr int32_t kDestinationBatch = 32;

// Route codes of the large path's routing scratch (DispatchParams::routing, per slot
// {code, position}): code = e for the first k of the token's row with expert e (the one
// that sends the token), kRouteNone for -1, kRouteDuplicateBase - e for a later k with the
// same expert e (same position, sends nothing).
constexpr int32_t kRouteNone = -1;
constexpr int32_t kRouteDuplicateBase = -2;

/// Whether expert `e` (in [0, E)) belongs to a masked rank: its pairs are then dropped
/// (taken as -1) and counted in DeviceStatus::dropped_pairs.
__device__ __forceinline__ bool ExpertMasked(const DispatchParams& p, int64_t e,
                                             int32_t experts_per_rank) {
  return p.rank_masked != nullptr && p.rank_masked[e / experts_per_rank] != 0;
}

/// The expert of a route code (any int32, the scratch being client-writable), or -1.
__device__ __forceinline__ int64_t RouteExpert(int32_t code) {
  if (code >= 0) return code;
  return code <= kRouteDuplicateBase ? kRouteDuplicateBase - static_cast<int64_t>(code) : -1;
}

// Large path, step 1, by every thread of block 0: the routing of this rank's `num_tokens`
// tokens, tile by tile (p.tile_groups groups of 32 tokens), into p.routing. Per tile: each
// slot's id is read once from topk_idx (an id outside [-1, E) is counted in DeviceStatus
// and taken as -1, as is one of a masked rank's experts, counted as dropped); a slot with
// expert e sets its token's bit of s_ballot[group, e]
// (atomicOr, whose old value tells a later k of the same row with the same expert: code
// kRouteDuplicateBase - e, which sends nothing); then, per expert, the running count
// s_count[e] gives each group's first index (s_prefix), and each slot's position is that
// plus the group's earlier tokens to e. Ends with s_count[e] = this rank's tokens to e.
// The positions are the small path's (token order, a duplicate k shares its row's).
__device__ void RouteTiles(const DispatchParams& p, int32_t num_tokens, int32_t* s_count,
                           uint32_t* s_ballot, int32_t* s_prefix, DeviceStatus* status) {
  const int32_t num_experts = p.num_experts;
  const int32_t num_topk = p.num_topk;
  const int32_t tile_tokens = p.tile_groups * 32;
  for (int32_t e = threadIdx.x; e < num_experts; e += blockDim.x) s_count[e] = 0;
  for (int32_t t0 = 0; t0 < num_tokens; t0 += tile_tokens) {
    const int32_t n = min(tile_tokens, num_tokens - t0);
    const int32_t groups = (n + 31) / 32;
    for (int32_t i = threadIdx.x; i < groups * num_experts; i += blockDim.x) s_ballot[i] = 0;
    __syncthreads();
    const int64_t first = static_cast<int64_t>(t0) * num_topk;
    const int64_t tile_slots = static_cast<int64_t>(n) * num_topk;
    for (int64_t i = threadIdx.x; i < tile_slots; i += blockDim.x) {
      const int64_t e = p.topk_idx[first + i];
      int32_t code = kRouteNone;
      if (e >= 0 && e < num_experts && ExpertMasked(p, e, p.experts_per_rank)) {
        atomicAdd(&status->dropped_pairs, 1u);
      } else if (e >= 0 && e < num_experts) {
        const int32_t t = static_cast<int32_t>(i / num_topk);
        const uint32_t bit = 1u << (t & 31);
        const uint32_t old = atomicOr(&s_ballot[(t >> 5) * num_experts + e], bit);
        code = (old & bit) != 0 ? kRouteDuplicateBase - static_cast<int32_t>(e)
                                : static_cast<int32_t>(e);
      } else if (e != -1) {
        atomicAdd(&status->bad_expert_ids, 1u);
      }
      p.routing[first + i].x = code;
    }
    __syncthreads();
    for (int32_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
      int32_t c = s_count[e];
      for (int32_t g = 0; g < groups; ++g) {
        s_prefix[g * num_experts + e] = c;
        c += __popc(s_ballot[g * num_experts + e]);
      }
      s_count[e] = c;
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < tile_slots; i += blockDim.x) {
      // This thread's own code from above, read back from client-writable memory: checked.
      const int64_t e = RouteExpert(p.routing[first + i].x);
      int32_t pos = -1;
      if (e >= 0 && e < num_experts) {
        const int32_t t = static_cast<int32_t>(i / num_topk);
        const int64_t ge = static_cast<int64_t>(t >> 5) * num_experts + e;
        pos = s_prefix[ge] + __popc(s_ballot[ge] & ((1u << (t & 31)) - 1u));
      }
      p.routing[first + i].y = pos;
    }
    __syncthreads();  // Before the next tile clears s_ballot.
  }
}

// One rank's dispatch, run by `num_blocks` blocks of kLowLatencyThreads threads, this block
// being `block` of them (blockIdx.x / gridDim.x of the per-rank kernel; the fused kernel
// runs several ranks' bodies side by side in one grid). Shape: internal::LowLatencyShape,
// the generic one (every value from p) or a specialised one (hidden, K and experts per rank
// compile-time constants equal to p's).
template <int kMode, bool kTiled, typename Shape>
__device__ __forceinline__ void DispatchBody(const DispatchParams& p, int32_t block,
                                             int32_t num_blocks) {
  extern __shared__ int32_t smem[];
  __shared__ uint8_t* s_peer[kMaxStatusRanks];
  __shared__ uint32_t s_seq;
  __shared__ int32_t s_num_tokens;
  __shared__ int s_last;
  __shared__ int s_data_missed;  // Block 0: a DataFlag wait of step 5 timed out.
  __shared__ int s_aborted;
  // Per warp: the destinations of the token it copies (row start, scales row start).
  __shared__ uint8_t* s_dst[kWarps][kDestinationBatch];
  __shared__ uint8_t* s_dst_scales[kWarps][kDestinationBatch];

  const int32_t num_ranks = p.num_ranks;
  const int32_t num_experts = p.num_experts;
  const int32_t num_topk = Shape::Topk(p);
  const int32_t experts_per_rank = Shape::ExpertsPerRank(p);
  const int32_t hidden32 = Shape::Hidden(p);
  // Every 512-channel chunk of a row is whole (no tail checks on the vector paths).
  constexpr bool kFullChunks = Shape::FullChunks(kChunkChannels);
  // Small path (kTiled false): every token's routing in shared memory. Large path: the
  // tile's ballots only (tile_groups groups of 32 tokens); the routing in p.routing.
  const int32_t max_slots = kTiled ? 0 : p.max_tokens * num_topk;
  const int32_t max_groups = kTiled ? p.tile_groups : (p.max_tokens + 31) / 32;
  int32_t* s_expert = smem;                 // [Mll*K] expert of (t,k), -1 = none
  int32_t* s_pos = s_expert + max_slots;    // [Mll*K] index among this rank's tokens to e
  int32_t* s_count = s_pos + max_slots;     // [E] this rank's tokens per expert
  int32_t* s_base = s_count + num_experts;  // [E] first row of this rank in e's block
  uint32_t* s_mask = reinterpret_cast<uint32_t*>(s_base + num_experts);  // [Mll, stride]
  // [groups, E] token bitmasks
  uint32_t* s_ballot = s_mask + (kTiled ? 0 : p.max_tokens * p.mask_stride);
  int32_t* s_prefix = reinterpret_cast<int32_t*>(s_ballot + max_groups * num_experts);  // same

  const int lane = LaneId();
  const int warp = device::WarpId();
  const uint64_t deadline = GlobalTimerNs() + static_cast<uint64_t>(p.timeout_ns);
  uint8_t* sync = p.own_base + p.sync_offset;
  auto* state = reinterpret_cast<LowLatencyState*>(sync + kSyncLowLatencyStateOffset);
  DeviceStatus* status = device::StatusOf(p.own_base, p.sync_offset);

  if (threadIdx.x == 0) {
    // Daemon-launched: the client's inputs (x, topk_idx) are staged once ready >= value.
    device::WaitReady(p.handoff, deadline, status, p.rank, block == 0, p.abort_flag);
    s_seq = *reinterpret_cast<volatile uint32_t*>(&state->dispatch_seq) + 1;
    int32_t t = p.num_tokens_value >= 0 ? p.num_tokens_value
                                        : *reinterpret_cast<const volatile int32_t*>(p.num_tokens);
    if (t < 0 || t > p.max_tokens) {
      if (block == 0) device::RecordBadNumTokens(status, t);
      t = 0;
    }
    s_num_tokens = t;
  }
  for (int32_t q = threadIdx.x; q < num_ranks; q += blockDim.x) s_peer[q] = p.peer_bases[q];
  __syncthreads();
  const uint32_t seq = s_seq;
  const int32_t num_tokens = s_num_tokens;
  const int32_t parity = static_cast<int32_t>(seq & 1u);
  // Slots of the small path (the large path's may pass 2^31: int64 there).
  const int32_t slots = kTiled ? 0 : num_tokens * num_topk;

  // ---- 1. routing of this rank's tokens ----
  if constexpr (kTiled) {
    for (int32_t e = threadIdx.x; e < num_experts; e += blockDim.x) s_base[e] = 0;
    if (block == 0) RouteTiles(p, num_tokens, s_count, s_ballot, s_prefix, status);
    __syncthreads();
  } else {
    // s_mask: per token a bitmask of its experts (stride p.mask_stride words, odd, so lanes
    // reading consecutive tokens hit distinct banks).
    for (int32_t i = threadIdx.x; i < num_tokens * p.mask_stride; i += blockDim.x) s_mask[i] = 0;
    __syncthreads();
    for (int32_t i = threadIdx.x; i < slots; i += blockDim.x) {
      const int64_t e = p.topk_idx[i];
      bool in_range = e >= 0 && e < num_experts;
      if (block == 0 && (e < -1 || e >= num_experts)) atomicAdd(&status->bad_expert_ids, 1u);
      if (in_range && ExpertMasked(p, e, experts_per_rank)) {  // Dropped: as -1.
        if (block == 0) atomicAdd(&status->dropped_pairs, 1u);
        in_range = false;
      }
      s_expert[i] = in_range ? static_cast<int32_t>(e) : -1;
      if (in_range) {
        atomicOr(&s_mask[(i / num_topk) * p.mask_stride + (e >> 5)], 1u << (e & 31));
      }
    }
    __syncthreads();
    // Per group g of 32 tokens and expert e, s_ballot[g][e] = the bitmask of the group's
    // tokens routed to e: a warp per (group, mask word) transposes the word with 32 ballots.
    // Then a thread per expert: s_prefix[g][e] = the group's first index among this rank's
    // tokens to e, and s_count[e]. (Positions of the slots follow in step 2b, off the critical
    // path of the count exchange.)
    const int32_t groups = (num_tokens + 31) / 32;
    const int32_t words = (num_experts + 31) / 32;
    for (int32_t gw = warp; gw < groups * words; gw += kWarps) {
      const int32_t g = gw / words;
      const int32_t w = gw - g * words;
      const int32_t t = g * 32 + lane;
      const uint32_t m = t < num_tokens ? s_mask[t * p.mask_stride + w] : 0u;
      uint32_t mine = 0;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const uint32_t b = __ballot_sync(0xffffffffu, (m >> j) & 1u);
        if (lane == j) mine = b;
      }
      const int32_t e = w * 32 + lane;
      if (e < num_experts) s_ballot[g * num_experts + e] = mine;
    }
    __syncthreads();
    for (int32_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
      int32_t c = 0;
      for (int32_t g = 0; g < groups; ++g) {
        s_prefix[g * num_experts + e] = c;
        c += __popc(s_ballot[g * num_experts + e]);
      }
      s_count[e] = c;
      s_base[e] = 0;
    }
    __syncthreads();
  }

  // ---- 2. publish counts (block 0) ----
  if (block == 0) {
    for (int32_t i = threadIdx.x; i < num_ranks * num_experts; i += blockDim.x) {
      const int32_t q = i / num_experts;
      const int32_t e = i - q * num_experts;
      CountsAt(s_peer[q], p, parity, p.rank)[e] = s_count[e];
    }
    __syncthreads();
    if (threadIdx.x < num_ranks) {
      device::FenceAcqRel(p.gpu_scope);
      StRelease(ExchangeFlag(s_peer[threadIdx.x], p, LowLatencyExchange::CountFlag(p.rank)), seq,
                p.gpu_scope);
    }
  }

  // Each slot's index among this rank's tokens routed to its expert (token order; duplicate
  // k's of a row share it). Read after step 3's barrier.
  if constexpr (!kTiled) {
    for (int32_t i = threadIdx.x; i < slots; i += blockDim.x) {
      const int32_t e = s_expert[i];
      if (e >= 0) {
        const int32_t t = i / num_topk;
        const int32_t ge = (t >> 5) * num_experts + e;
        s_pos[i] = s_prefix[ge] + __popc(s_ballot[ge] & ((1u << (t & 31)) - 1u));
      }
    }
  }

  // ---- 2b. while the counts travel: load (and quantise) this warp's first two units ----
  // A unit is one (token, 512-channel chunk); each lane holds 16 of its channels (see
  // first_channel). Units are dealt to warps round-robin (u = first_unit + i * total_warps). The
  // vector paths keep two units in registers: loaded before the count wait (their loads and
  // quantisation overlap the exchange), and afterwards the next two units' loads are issued
  // before the current two are stored (software pipelining).
  const int32_t total_warps = num_blocks * kWarps;
  const int32_t first_unit = block * kWarps + warp;
  const int32_t chunk = kMode == kBf16Scalar ? hidden32 : kChunkChannels;
  const int32_t chunks_per_token = (hidden32 + chunk - 1) / chunk;
  const int32_t units = num_tokens * chunks_per_token;
  const int64_t hidden = hidden32;
  // The first channel of the lane's two 8-channel vectors in unit u (vector paths). FP8:
  // 16 consecutive channels (one 16-byte e4m3 store per destination, 8 lanes per scale
  // block). BF16: channels 8 l and 256 + 8 l of the chunk, so that each 16-byte store
  // instruction of the warp writes 512 consecutive bytes.
  auto first_channel = [&](int32_t u) {
    const int32_t t = u / chunks_per_token;
    return (u - t * chunks_per_token) * kChunkChannels + (kMode == kFp8 ? 16 : 8) * lane;
  };
  constexpr int32_t kSecondVector = kMode == kFp8 ? 8 : kChunkChannels / 2;
  // Raw 16-byte loads of the lane's two vectors of unit u (zero past H).
  auto load_unit = [&](int32_t u, uint4* lo, uint4* hi) {
    const int32_t t = u / chunks_per_token;
    const int32_t h0 = first_channel(u);
    const bf16_bits* src = p.x + static_cast<int64_t>(t) * hidden + h0;
    *lo = kFullChunks || h0 < hidden32 ? *reinterpret_cast<const uint4*>(src)
                                       : make_uint4(0, 0, 0, 0);
    *hi = kFullChunks || h0 + kSecondVector < hidden32
              ? *reinterpret_cast<const uint4*>(src + kSecondVector)
              : make_uint4(0, 0, 0, 0);
  };
  // What is stored: FP8 quantised (all 32 lanes call it together), BF16 as loaded.
  auto prepare_unit = [&](const uint4& lo, const uint4& hi) {
    UnitData d;
    if constexpr (kMode == kFp8) {
      d.v0 = QuantizeVec16(lo, hi, p.round_scale, &d.scale);
      d.v1 = make_uint4(0, 0, 0, 0);
      d.ue8m0_word = 0;
      if (p.use_ue8m0) {
        const uint32_t code = Ue8m0Code(d.scale);
#pragma unroll
        for (int i = 0; i < kUe8m0BlocksPerWord; ++i) {
          d.ue8m0_word |= __shfl_sync(0xffffffffu, code, 8 * i) << (8 * i);
        }
      }
    } else {
      d.v0 = lo;
      d.v1 = hi;
      d.scale = 0.0f;
      d.ue8m0_word = 0;
    }
    return d;
  };
  UnitData staged0{};
  UnitData staged1{};
  if constexpr (kMode != kBf16Scalar) {
    uint4 lo0 = make_uint4(0, 0, 0, 0), hi0 = lo0, lo1 = lo0, hi1 = lo0;
    if (first_unit < units) load_unit(first_unit, &lo0, &hi0);
    if (first_unit + total_warps < units) load_unit(first_unit + total_warps, &lo1, &hi1);
    if (first_unit < units) staged0 = prepare_unit(lo0, hi0);
    if (first_unit + total_warps < units) staged1 = prepare_unit(lo1, hi1);
  }
  // ---- 3. wait for every rank's counts ----
  bool arrived = true;
  if (threadIdx.x < num_ranks) {
    arrived =
        WaitFlagAtLeast(ExchangeFlag(p.own_base, p, LowLatencyExchange::CountFlag(threadIdx.x)),
                        seq, deadline, p.gpu_scope, p.abort_flag);
    if (!arrived) device::RecordMissingPeer(status, threadIdx.x);
  }
  const bool counts_ok = __syncthreads_and(arrived) != 0;

  if (counts_ok) {
    // s_base[e] = Σ_{q < rank} count_q[e] (zeroed in step 1): every load in flight at once,
    // summed with shared atomics (integer sums: the order does not matter).
    for (int32_t i = threadIdx.x; i < p.rank * num_experts; i += blockDim.x) {
      const int32_t q = i / num_experts;
      const int32_t e = i - q * num_experts;
      const int32_t c = LdRelaxed(CountsAt(p.own_base, p, parity, q) + e, p.gpu_scope);
      if (c != 0) atomicAdd(&s_base[e], c);
    }
    __syncthreads();
    // ---- 4. rows straight into the owners' buffers ----
    // Each unit is stored to every destination of its token (first occurrence of each
    // expert): lanes work out the destination rows of up to kDestinationBatch slots (k =
    // kb + lane) into s_dst, then every lane stores its 16 bytes (FP8) or 32 bytes (BF16) to
    // each. The small path (K <= kDestinationBatch) has one batch, the large path
    // ceil(K / kDestinationBatch).
    const int64_t out_row_bytes = kMode == kFp8 ? hidden : hidden * 2;
    const int32_t batches_end = kTiled ? num_topk : 1;  // kb < batches_end
    auto destinations = [&](int32_t t, int32_t c0, int32_t kb) {
      bool has_dst = false;
      uint8_t* dst = nullptr;
      uint8_t* dst_scales = nullptr;  // the row's block-0 scale (LowLatencyScaleOffset)
      const int32_t k = kb + lane;
      if (k < num_topk) {
        int32_t e;    // The slot's expert when the slot sends the token, else -1.
        int32_t pos;  // Its index among this rank's tokens to e.
        if constexpr (kTiled) {
          // One 8-byte load of the routing scratch, which a client can rewrite: a code
          // past E is counted (once per slot) and skipped; a position is checked below.
          const int2 route = p.routing[static_cast<int64_t>(t) * num_topk + k];
          e = route.x;  // < 0: none, or a duplicate k of the row.
          pos = route.y;
          if (e >= num_experts) {
            if (c0 == 0) atomicAdd(&status->bad_routing, 1u);
            e = -1;
          }
        } else {
          const int32_t slot = t * num_topk + k;
          e = s_expert[slot];
          bool duplicate = false;
          for (int32_t j = 0; j < k; ++j) duplicate |= s_expert[t * num_topk + j] == e;
          if (duplicate) e = -1;
          pos = s_pos[slot];
        }
        // The row in the expert's block, from the peers' counts (s_base), which a client
        // can rewrite through its IPC mapping of the sync region: used only when inside the
        // block (else counted, once per slot, and skipped).
        const int64_t in_block = e >= 0 ? static_cast<int64_t>(s_base[e]) + pos : int64_t{-1};
        if (e >= 0 && in_block >= 0 && in_block < p.rows_per_expert) {
          has_dst = true;
          const int32_t owner = e / experts_per_rank;
          const int64_t row =
              static_cast<int64_t>(e - owner * experts_per_rank) * p.rows_per_expert + in_block;
          uint8_t* owner_base = s_peer[owner];
          dst = owner_base + p.recv_x_offset + row * out_row_bytes;
          dst_scales = owner_base + p.recv_scales_offset +
                       (static_cast<int64_t>(e - owner * experts_per_rank) * p.scale_words *
                            p.rows_per_expert +
                        in_block) *
                           4;
          if (c0 == 0) {
            reinterpret_cast<int32_t*>(owner_base + p.recv_src_info_offset)[row] =
                p.rank * p.max_tokens + t;
          }
        } else if (e >= 0 && c0 == 0) {
          atomicAdd(&status->bad_routing, 1u);
        }
      }
      const uint32_t dst_mask = __ballot_sync(0xffffffffu, has_dst);
      if (has_dst) {
        const int idx = __popc(dst_mask & ((1u << lane) - 1u));
        s_dst[warp][idx] = dst;
        s_dst_scales[warp][idx] = dst_scales;
      }
      __syncwarp();
      return __popc(dst_mask);
    };
    if constexpr (kMode == kBf16Scalar) {
      for (int32_t u = first_unit; u < units; u += total_warps) {
        const int32_t t = u / chunks_per_token;
        const int32_t c0 = (u - t * chunks_per_token) * chunk;
        const int32_t c1 = min(hidden32, c0 + chunk);
        const bf16_bits* src = p.x + static_cast<int64_t>(t) * hidden;
        for (int32_t kb = 0; kb < batches_end; kb += kDestinationBatch) {
          const int num_dst = destinations(t, c0, kb);
          for (int32_t h = c0 + lane; h < c1; h += 32) {
            const bf16_bits v = src[h];
            for (int d = 0; d < num_dst; ++d) reinterpret_cast<bf16_bits*>(s_dst[warp][d])[h] = v;
          }
          __syncwarp();
        }
      }
    } else {
      auto store_unit = [&](int32_t u, const UnitData& d) {
        const int32_t t = u / chunks_per_token;
        const int32_t h0 = first_channel(u);
        const int32_t c0 = (u - t * chunks_per_token) * kChunkChannels;
        for (int32_t kb = 0; kb < batches_end; kb += kDestinationBatch) {
          const int num_dst = destinations(t, c0, kb);
          if (kFullChunks || h0 < hidden32) {
            for (int i = 0; i < num_dst; ++i) {
              if constexpr (kMode == kFp8) {
                *reinterpret_cast<uint4*>(s_dst[warp][i] + h0) = d.v0;
                // Scales are token-fastest: block g of the row is g * rows_per_expert * 4
                // bytes past its block 0 (UE8M0: word g / 4, written whole by lane 0).
                if (p.use_ue8m0) {
                  if (lane == 0) {
                    *reinterpret_cast<uint32_t*>(
                        s_dst_scales[warp][i] + (h0 / kUe8m0WordChannels) * p.rows_per_expert * 4) =
                        d.ue8m0_word;
                  }
                } else if ((lane & 7) == 0) {
                  *reinterpret_cast<float*>(s_dst_scales[warp][i] +
                                            (h0 / kFp8BlockChannels) * p.rows_per_expert * 4) =
                      d.scale;
                }
              } else {
                bf16_bits* o = reinterpret_cast<bf16_bits*>(s_dst[warp][i]) + h0;
                *reinterpret_cast<uint4*>(o) = d.v0;
                if (kFullChunks || h0 + kSecondVector < hidden32) {
                  *reinterpret_cast<uint4*>(o + kSecondVector) = d.v1;
                }
              }
            }
          }
          __syncwarp();
        }
      };
      for (int32_t u = first_unit; u < units; u += 2 * total_warps) {
        const int32_t u1 = u + total_warps;
        const int32_t next0 = u + 2 * total_warps;
        const int32_t next1 = u + 3 * total_warps;
        uint4 lo0, hi0, lo1, hi1;
        if (next0 < units) load_unit(next0, &lo0, &hi0);
        if (next1 < units) load_unit(next1, &lo1, &hi1);
        store_unit(u, staged0);
        if (u1 < units) store_unit(u1, staged1);
        if (next0 < units) staged0 = prepare_unit(lo0, hi0);
        if (next1 < units) staged1 = prepare_unit(lo1, hi1);
      }
    }
    // Block 0, after its rows: this rank's recv_count and the handle (read by the next
    // kernels on this stream, not by the peers).
    if (block == 0) {
      const int32_t first = p.rank * experts_per_rank;
      for (int32_t j = threadIdx.x; j < experts_per_rank; j += blockDim.x) {
        int32_t total = 0;
        for (int32_t q = 0; q < num_ranks; ++q) {
          total += LdRelaxed(CountsAt(p.own_base, p, parity, q) + first + j, p.gpu_scope);
        }
        p.recv_count[j] = total;
        device::AddExpertTokens(p.expert_stats, j, total);
      }
      if (threadIdx.x == 0) state->dispatch_num_tokens[p.buffer] = num_tokens;
      if constexpr (kTiled) {
        // From the routing scratch (client-writable: a code or row out of range gives -1,
        // which the combine counts as bad routing for a valid id).
        const int64_t all_slots = static_cast<int64_t>(num_tokens) * num_topk;
        for (int64_t i = threadIdx.x; i < all_slots; i += blockDim.x) {
          const int2 route = p.routing[i];
          const int64_t e = RouteExpert(route.x);
          const int64_t row =
              e >= 0 && e < num_experts ? static_cast<int64_t>(s_base[e]) + route.y : int64_t{-1};
          p.handle_pos[i] = row >= 0 && row < p.rows_per_expert ? static_cast<int32_t>(row) : -1;
        }
      } else {
        for (int32_t i = threadIdx.x; i < slots; i += blockDim.x) {
          const int32_t e = s_expert[i];
          p.handle_pos[i] = e >= 0 ? s_base[e] + s_pos[i] : -1;
        }
      }
    }
  } else if (threadIdx.x == 0) {
    atomicExch(&state->dispatch_aborted, seq);
    if (block == 0) state->dispatch_num_tokens[p.buffer] = 0;
  }

  // ---- 5. the last block tells every rank that this rank's rows have landed ----
  __syncthreads();
  if (threadIdx.x == 0) {
    device::FenceAcqRel(p.gpu_scope);
    const uint32_t ticket = atomicAdd(&state->dispatch_ticket, 1u);
    s_last = ticket == static_cast<uint32_t>(num_blocks - 1);
    s_data_missed = 0;
    if (s_last) {
      device::FenceAcqRel(p.gpu_scope);  // acquire the other blocks' writes (their fence + ticket)
      s_aborted = atomicAdd(&state->dispatch_aborted, 0u) == seq;
      state->dispatch_ticket = 0;
      // A strong store: block 0 acquires it after a timeout (step 6).
      StRelease(&state->dispatch_seq, seq, /*gpu=*/true);
    }
  }
  __syncthreads();
  if (s_last && !s_aborted && threadIdx.x < num_ranks) {
    device::FenceAcqRel(p.gpu_scope);
    StRelease(ExchangeFlag(s_peer[threadIdx.x], p, LowLatencyExchange::DataFlag(p.rank)), seq,
              p.gpu_scope);
  }
  if (block == 0 && counts_ok && threadIdx.x < num_ranks) {
    if (!WaitFlagAtLeast(ExchangeFlag(p.own_base, p, LowLatencyExchange::DataFlag(threadIdx.x)),
                         seq, deadline, p.gpu_scope, p.abort_flag)) {
      device::RecordMissingPeer(status, threadIdx.x);
      s_data_missed = 1;
    }
  }
  // ---- 6. daemon-launched: done (every sender's rows have landed, block 0 wrote the counts
  // and the handle; the other blocks are past their last read of the inputs) ----
  if (block == 0 && p.handoff.done_flag != nullptr) {
    __syncthreads();
    if (threadIdx.x == 0) {
      if (!counts_ok || s_data_missed != 0) {
        // Timed out: block 0 did not see this rank's own DataFlag (it did not wait for the
        // senders, or a block aborted), so wait (bounded) until every block has taken its
        // ticket (the last one sets dispatch_seq): none reads the inputs after done, which
        // lets the client overwrite them, and every block's status update is ordered
        // before the copy below. If even this wait runs out, a late block's update may miss
        // the copy; the op has failed anyway (DEADLINE_EXCEEDED resets the sync state).
        WaitFlagAtLeast(&state->dispatch_seq, seq,
                        GlobalTimerNs() + static_cast<uint64_t>(p.timeout_ns), /*gpu=*/true,
                        p.abort_flag);
      }
      device::StoreDone(p.handoff);
      // Every block's status updates came before its ticket, and this rank's last ticket
      // before its own DataFlag / dispatch_seq, which block 0 acquired above.
      if (p.handoff.status_out != nullptr) device::CopyStatusOut(status, p.handoff.status_out);
    }
  }
}

template <int kMode, bool kTiled, typename Shape = internal::GenericShape>
__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    LowLatencyDispatchKernel(const DispatchParams p) {
  DispatchBody<kMode, kTiled, Shape>(p, static_cast<int32_t>(blockIdx.x),
                                     static_cast<int32_t>(gridDim.x));
}

template <int kMode, bool kTiled, typename Shape = internal::GenericShape>
__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    FusedLowLatencyDispatchKernel(const internal::FusedParams<DispatchParams> fp) {
  internal::RunFusedRank<DispatchParams, DispatchBody<kMode, kTiled, Shape>>(fp);
}

// Lets `kernel` launch with up to the device's opt-in shared memory less its static part
// (the same value every time: launches of other shapes on other threads cannot race with
// it), which it returns in *dynamic_limit.
template <typename Params>
absl::Status AllowLargestDynamicSmem(void (*kernel)(Params), size_t* dynamic_limit) {
  cudaFuncAttributes attr;
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, kernel));
  int device = 0;
  int limit = 0;
  EPD_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  EPD_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  *dynamic_limit =
      static_cast<size_t>(limit) > attr.sharedSizeBytes ? limit - attr.sharedSizeBytes : 0;
  return EPD_CUDA_STATUS(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(*dynamic_limit)));
}

// The dispatch kernels, per-rank and fused, by variant (PreparedDispatch::variant): the
// small path's modes, the large path's modes, then the specialised instances (the small
// path's vector modes, for the one shape they are for).
using RankKernel = void (*)(DispatchParams);
using FusedKernel = void (*)(internal::FusedParams<DispatchParams>);
using DispatchKernels = internal::KernelPair<DispatchParams>;
template <int kMode, bool kTiled, typename Shape = internal::GenericShape>
constexpr DispatchKernels kInstance = {LowLatencyDispatchKernel<kMode, kTiled, Shape>,
                                       FusedLowLatencyDispatchKernel<kMode, kTiled, Shape>};
constexpr int kNumVariants = 8;
constexpr int kSpecialisedVariant[3] = {6, -1, 7};  // by mode; -1: none
constexpr DispatchKernels kKernels[kNumVariants] = {
    kInstance<kBf16Vec, false>,
    kInstance<kBf16Scalar, false>,
    kInstance<kFp8, false>,
    kInstance<kBf16Vec, true>,
    kInstance<kBf16Scalar, true>,
    kInstance<kFp8, true>,
    kInstance<kBf16Vec, false, internal::SpecialisedShape>,
    kInstance<kFp8, false, internal::SpecialisedShape>};

/// Opens `kernel` to the device's largest dynamic shared memory when it has not been (once
/// PreloadKernels ran, every kernel has) and checks that `smem` fits. INVALID_ARGUMENT
/// naming the shape when it does not.
template <typename Params>
absl::Status EnsureDynamicSmem(void (*kernel)(Params), size_t smem, const GroupShape& s,
                               const char* op) {
  if (smem <= kLowLatencyDefaultDynamicSmemBytes) return absl::OkStatus();
  cudaFuncAttributes attr;
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, kernel));
  if (static_cast<size_t>(attr.maxDynamicSharedSizeBytes) >= smem) return absl::OkStatus();
  size_t dynamic_limit = 0;
  EPD_RETURN_IF_ERROR(AllowLargestDynamicSmem(kernel, &dynamic_limit));
  if (smem > dynamic_limit) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": num_experts = ", s.num_experts, " needs ", smem,
        " bytes of shared memory for the low-latency routing; this device allows ", dynamic_limit));
  }
  return absl::OkStatus();
}

}  // namespace

namespace internal {

absl::Status ValidateLowLatency(const CudaRankContext& ctx, int32_t buffer, const char* op) {
  EPD_RETURN_IF_ERROR(ValidateContext(ctx));
  const GroupShape& s = ctx.shape;
  if (s.ll_max_tokens_per_rank <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": low-latency ops are disabled (ll_max_tokens_per_rank = ", s.ll_max_tokens_per_rank,
        ")"));
  }
  if (buffer < 0 || buffer >= kLowLatencyBuffers) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": buffer = ", buffer, " is outside [0, ", kLowLatencyBuffers, ")"));
  }
  if (device::LowLatencyExchange::Bytes(s.num_ranks, s.num_experts) >
      kSyncLowLatencyExchangeBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": num_ranks * num_experts = ", static_cast<int64_t>(s.num_ranks) * s.num_experts,
        " needs ", device::LowLatencyExchange::Bytes(s.num_ranks, s.num_experts),
        " bytes of low-latency count exchange; the sync region has ",
        kSyncLowLatencyExchangeBytes));
  }
  return absl::OkStatus();
}

absl::Status PreloadLowLatencyDispatchKernels() {
  cudaFuncAttributes attr;
  auto preload = [&attr](auto kernel) -> absl::Status {
    EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, kernel));
    // Opened now, outside any stream capture: launches never change an attribute then.
    size_t dynamic_limit = 0;
    EPD_RETURN_IF_ERROR(AllowLargestDynamicSmem(kernel, &dynamic_limit));
    if (attr.sharedSizeBytes > kLowLatencyStaticSmemBound) {
      return absl::InternalError(absl::StrCat(
          "LowLatencyDispatch: a kernel's static shared memory, ", attr.sharedSizeBytes,
          " bytes, is above kLowLatencyStaticSmemBound = ", kLowLatencyStaticSmemBound,
          " (cuda_limits.h), which the launcher plans with"));
    }
    return absl::OkStatus();
  };
  for (int v = 0; v < kNumVariants; ++v) {
    EPD_RETURN_IF_ERROR(preload(kKernels[v].rank));
    EPD_RETURN_IF_ERROR(preload(kKernels[v].fused));
  }
  return absl::OkStatus();
}

}  // namespace internal

namespace {

std::atomic<int> g_specialisation{static_cast<int>(LowLatencySpecialisation::kEnvironment)};

bool SpecialisationInEnvironment() {
  static const bool on = [] {
    const char* v = std::getenv("EPD_LL_SPECIALISED");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

}  // namespace

void SetLowLatencySpecialisation(LowLatencySpecialisation mode) {
  g_specialisation.store(static_cast<int>(mode), std::memory_order_relaxed);
}

bool LowLatencySpecialisedFor(const GroupShape& shape) {
  if (shape.hidden != kLowLatencySpecialisedHidden ||
      shape.num_topk != kLowLatencySpecialisedTopk || shape.num_ranks <= 0 ||
      shape.num_experts % shape.num_ranks != 0 ||
      shape.num_local_experts() != kLowLatencySpecialisedExpertsPerRank) {
    return false;
  }
  switch (static_cast<LowLatencySpecialisation>(g_specialisation.load(std::memory_order_relaxed))) {
    case LowLatencySpecialisation::kOn:
      return true;
    case LowLatencySpecialisation::kOff:
      return false;
    case LowLatencySpecialisation::kEnvironment:
      break;
  }
  return SpecialisationInEnvironment();
}

namespace {

/// One rank's dispatch as the launchers need it: the kernel's params, its grid, dynamic
/// shared memory and kernel variant (kKernels).
struct PreparedDispatch {
  DispatchParams p{};
  int32_t num_blocks = 0;
  size_t smem = 0;
  int variant = 0;
};

/// Checks one rank's context and args (errors as LowLatencyDispatch, prefixed with `op`) and
/// works out its launch. Touches no GPU state besides device queries (ResolveNumBlocks
/// without num_sms).
absl::Status PrepareDispatch(const CudaRankContext& ctx, const LowLatencyDispatchArgs& args,
                             const char* op, PreparedDispatch* out) {
  EPD_RETURN_IF_ERROR(internal::ValidateLowLatency(ctx, args.buffer, op));
  const GroupShape& s = ctx.shape;
  const EndpointLayout& l = ctx.layout;
  if (args.use_fp8 && !rules::Fp8Allowed(abi::OpKind::kLowLatencyDispatch, s)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": use_fp8 needs shape.use_fp8 (", s.use_fp8,
                                                   ") and hidden % ", kFp8BlockChannels,
                                                   " == 0 (hidden = ", s.hidden, ")"));
  }
  EPD_RETURN_IF_ERROR(
      rules::CheckScaleFormat(op, args.use_fp8, args.round_scale, args.use_ue8m0, s));
  const int b = args.buffer;
  DispatchParams& p = out->p;
  p = DispatchParams{};
  p.peer_bases = ctx.peer_bases;
  p.own_base = ctx.own_base;
  p.num_tokens = args.num_tokens != nullptr ? args.num_tokens : LowLatencyNumTokensSlot(ctx);
  p.num_tokens_value = args.num_tokens_value;
  p.x =
      args.x != nullptr ? args.x : reinterpret_cast<const bf16_bits*>(ctx.own_base + l.in_x.offset);
  p.topk_idx = args.topk_idx != nullptr
                   ? args.topk_idx
                   : reinterpret_cast<const int64_t*>(ctx.own_base + l.in_topk_idx.offset);
  p.rank_masked = ctx.rank_masked;
  p.recv_count = reinterpret_cast<int32_t*>(ctx.own_base + l.ll_recv_count[b].offset);
  p.handle_pos = reinterpret_cast<int32_t*>(ctx.own_base + l.ll_handle_pos[b].offset);
  p.sync_offset = l.sync.offset;
  p.recv_x_offset = l.ll_recv_x[b].offset;
  p.recv_scales_offset = l.ll_recv_scales[b].offset;
  p.recv_src_info_offset = l.ll_recv_src_info[b].offset;
  p.rows_per_expert = s.ll_rows_per_expert();
  p.timeout_ns = ctx.timeout_ns;
  p.abort_flag = ctx.abort_flag;
  p.handoff = args.handoff;
  p.expert_stats = args.expert_stats;
  p.rank = ctx.rank;
  p.num_ranks = s.num_ranks;
  p.num_experts = s.num_experts;
  p.experts_per_rank = s.num_local_experts();
  p.hidden = s.hidden;
  p.num_topk = s.num_topk;
  p.max_tokens = s.ll_max_tokens_per_rank;
  p.num_scales = s.num_scales();
  p.buffer = b;
  p.round_scale = args.round_scale;
  p.use_ue8m0 = args.use_ue8m0;
  p.scale_words = args.use_ue8m0 ? p.num_scales / kUe8m0BlocksPerWord : p.num_scales;
  p.gpu_scope = ctx.all_ranks_on_device;

  EPD_RETURN_IF_ERROR(ResolveNumBlocks(ctx, &out->num_blocks));
  const bool x_aligned = reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
  if (args.use_fp8 && !x_aligned) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": x must be 16-byte aligned for FP8"));
  }
  const int mode = args.use_fp8 ? kFp8 : (s.hidden % 8 == 0 && x_aligned ? kBf16Vec : kBf16Scalar);
  const LowLatencyRoutingPlan plan = PlanLowLatencyRouting(s);
  const bool tiled = plan.tiled || args.large_path;
  p.mask_stride = plan.mask_stride;
  p.routing = reinterpret_cast<int2*>(ctx.own_base + l.ll_routing.offset);
  p.tile_groups = plan.tile_groups;
  out->smem = tiled ? plan.tiled_smem_bytes : plan.small_smem_bytes;
  const int specialised = tiled ? -1 : kSpecialisedVariant[mode];
  out->variant =
      specialised >= 0 && LowLatencySpecialisedFor(s) ? specialised : (tiled ? 3 : 0) + mode;
  return absl::OkStatus();
}

/// The first argument a fused dispatch needs equal on every rank that `a` and `a0` disagree
/// on, or null.
const char* DispatchArgDiffers(const LowLatencyDispatchArgs& a, const LowLatencyDispatchArgs& a0) {
  return a.buffer != a0.buffer                               ? "buffer"
         : a.use_fp8 != a0.use_fp8                           ? "use_fp8"
         : a.round_scale != a0.round_scale                   ? "round_scale"
         : a.use_ue8m0 != a0.use_ue8m0                       ? "use_ue8m0"
         : a.large_path != a0.large_path                     ? "large_path"
         : a.handoff.programmatic != a0.handoff.programmatic ? "handoff.programmatic"
                                                             : nullptr;
}

}  // namespace

absl::Status LowLatencyDispatch(const CudaRankContext& ctx, const LowLatencyDispatchArgs& args,
                                cudaStream_t stream) {
  constexpr const char* kOp = "LowLatencyDispatch";
  PreparedDispatch d;
  EPD_RETURN_IF_ERROR(PrepareDispatch(ctx, args, kOp, &d));
  const RankKernel kernel = kKernels[d.variant].rank;
  EPD_RETURN_IF_ERROR(EnsureDynamicSmem(kernel, d.smem, ctx.shape, kOp));
  return internal::LaunchLowLatency(kernel, d.num_blocks, d.smem, args.handoff.programmatic, stream,
                                    d.p);
}

absl::Status LowLatencyDispatchRanks(std::span<const CudaRankContext> ctxs,
                                     std::span<const LowLatencyDispatchArgs> args,
                                     cudaStream_t stream) {
  constexpr const char* kOp = "LowLatencyDispatchRanks";
  internal::FusedParams<DispatchParams> fp{};
  PreparedDispatch first;
  EPD_RETURN_IF_ERROR(internal::PrepareFusedRanks(
      ctxs, args, kOp, &PrepareDispatch, &DispatchArgDiffers,
      "x (kernel variant: one BF16 x 16-byte aligned, another not)", &fp, &first));
  const FusedKernel kernel = kKernels[first.variant].fused;
  EPD_RETURN_IF_ERROR(EnsureDynamicSmem(kernel, first.smem, ctxs[0].shape, kOp));
  return internal::LaunchLowLatency(kernel, fp.num_ranks * first.num_blocks, first.smem,
                                    args[0].handoff.programmatic, stream, fp);
}

}  // namespace epd::kernels::cuda
