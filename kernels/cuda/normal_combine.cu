// Normal (high-throughput) combine on CUDA: an arrival barrier, then every rank pulls its
// tokens' rows from the ranks that hold them (send_pos) and reduces them in f32 in
// ascending rank order (host_ops.h: Combine; bit-identical to the host).
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda/cuda_check.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_normal.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/types.h"
#include "kernels/cuda/normal_common.cuh"

namespace epd::kernels::cuda {
namespace normal {
namespace {

constexpr int kCombineUnroll = 4;
/// Ranks whose top-k weights one warp of the balanced combine loads before it adds them.
constexpr int kWeightRanksInFlight = 8;

__device__ __forceinline__ int4 LoadNoAllocate(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

/// Adds the 8 bf16 of `v` (element 2j in the low half of word j) to acc[0..8).
__device__ __forceinline__ void AddBf16x8(const int4& v, float* acc) {
  const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y),
                         static_cast<uint32_t>(v.z), static_cast<uint32_t>(v.w)};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    acc[2 * j] += __uint_as_float(w[j] << 16);
    acc[2 * j + 1] += __uint_as_float(w[j] & 0xffff0000u);
  }
}

/// Pull-and-reduce: grid of num_sms blocks of kNormalThreads, one warp a token at a time
/// (TokenSchedule, p.order). For token t: send_pos[t, :] (read while the warp's
/// previous token finishes) gives the row at each rank holding it; for each group of kCombineUnroll
/// 16-byte vectors of the row (8 bf16 channels each), acc = +0.0f, then += f32(row at r) for r
/// ascending, then one round-to-nearest-even to bf16 (types.h FloatToBf16, the host's rounding).
/// The warp loads the vectors of p.combine_ranks_in_flight ranks (1 or kCombineRanksInFlight)
/// before it adds them, in the same order; the top-k weights of up to kWeightRanksInFlight ranks at
/// once likewise. With `kVector` false (H % 8 != 0) channels go one bf16 at a time. The op's
/// sequence number, failed mark and token counter are read past WaitForFirstKernel.
template <bool kVector>
__global__ void __launch_bounds__(kNormalThreads) NormalCombineKernel(NormalParams p) {
  __shared__ int32_t s_next_token;
  const int num_ranks = p.shape.num_ranks;
  const int num_topk = p.shape.num_topk;
  const int64_t hidden = p.shape.hidden;
  const int lane = threadIdx.x & 31;

  uint8_t* own = p.peer_bases[p.rank];
  const int32_t* send_pos = Region<const int32_t>(own, p.layout.send_pos);
  bf16_bits* combined_x = Region<bf16_bits>(own, p.layout.combined_x);
  float* combined_w = Region<float>(own, p.layout.combined_topk_weights);
  TokenRanks ranks;
  ranks.LoadBases(p.peer_bases, num_ranks, lane, p.rank_masked);
  // Up to here nothing the barrier writes is read (a programmatic launch overlaps it with
  // the barrier's end).
  WaitForFirstKernel();
  const uint32_t seq = CurrentSeq(p);
  if (CurrentOpFailed(p, seq)) return;
  const int num_tokens = ReadNumTokens(p, false);
  const int64_t capacity = p.shape.max_recv_tokens();
  unsigned int bad_routing = 0;
  unsigned int dropped = 0;  // Routes to masked ranks: their rows are left out of the sum.
  const int rows_in_flight = p.combine_ranks_in_flight > 1 ? kCombineRanksInFlight : 1;
  const int weights_in_flight = p.combine_ranks_in_flight > 1 ? kWeightRanksInFlight : 1;
  TokenSchedule tokens;
  tokens.Init(p.order, num_tokens, &s_next_token, RankTokenCounter(p));

  // Token t's send_pos row is read one token ahead (before the previous token's weights)
  // and checked when its token starts; the token itself is claimed as the previous token's
  // last chunk starts.
  int32_t t = tokens.Next();
  int64_t row_lo = -1, row_hi = -1;
  if (t < tokens.end) {
    TokenRanks::FetchRow(send_pos + static_cast<int64_t>(t) * num_ranks, num_ranks, lane, &row_lo,
                         &row_hi);
  }
  while (t < tokens.end) {
    ranks.CheckRow(row_lo, row_hi, capacity, &bad_routing, &dropped);
    const uint64_t mask = ranks.mask;
    bf16_bits* out = combined_x + t * hidden;
    int32_t claim = 0;  // Set in the last chunk of the row (every row has one).

    if constexpr (kVector) {
      const int64_t num_vec = hidden / 8;
      // Warp-uniform trip counts: every lane runs every iteration (the shuffles in RowAt
      // need the whole warp); the tail is guarded per vector.
      for (int64_t base = 0; base < num_vec; base += 32 * kCombineUnroll) {
        const int64_t i = base + lane;
        if (base + 32 * kCombineUnroll >= num_vec) claim = tokens.Claim();
        float acc[kCombineUnroll][8];
#pragma unroll
        for (int u = 0; u < kCombineUnroll; ++u) {
#pragma unroll
          for (int c = 0; c < 8; ++c) acc[u][c] = 0.0f;
        }
        for (uint64_t m = mask; m != 0;) {
          // Up to rows_in_flight ranks' vectors loaded (ascending ranks), then added in
          // that order.
          int4 v[kCombineRanksInFlight][kCombineUnroll];
          int loaded = 0;  // Warp-uniform.
#pragma unroll
          for (int g = 0; g < kCombineRanksInFlight; ++g) {
            if (g < rows_in_flight && m != 0) {
              const int4* src = reinterpret_cast<const int4*>(
                  ranks.RowAt(LowestRank(m), p.layout.in_combine_x.offset, hidden * 2));
              m &= m - 1;
#pragma unroll
              for (int u = 0; u < kCombineUnroll; ++u) {
                if (i + 32 * u < num_vec) v[g][u] = LoadNoAllocate(src + i + 32 * u);
              }
              loaded = g + 1;
            }
          }
#pragma unroll
          for (int g = 0; g < kCombineRanksInFlight; ++g) {
            if (g >= loaded) continue;
#pragma unroll
            for (int u = 0; u < kCombineUnroll; ++u) {
              if (i + 32 * u < num_vec) AddBf16x8(v[g][u], acc[u]);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < kCombineUnroll; ++u) {
          if (i + 32 * u >= num_vec) continue;
          int4 o;
          uint32_t* w = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            w[j] = static_cast<uint32_t>(FloatToBf16(acc[u][2 * j])) |
                   (static_cast<uint32_t>(FloatToBf16(acc[u][2 * j + 1])) << 16);
          }
          reinterpret_cast<int4*>(out)[i + 32 * u] = o;
        }
      }
    } else {
      for (int64_t base = 0; base < hidden; base += 32) {
        const int64_t h = base + lane;
        if (base + 32 >= hidden) claim = tokens.Claim();
        float acc = 0.0f;
        for (uint64_t m = mask; m != 0; m &= m - 1) {
          const bf16_bits* src = reinterpret_cast<const bf16_bits*>(
              ranks.RowAt(LowestRank(m), p.layout.in_combine_x.offset, hidden * 2));
          if (h < hidden) acc += Bf16ToFloat(src[h]);
        }
        if (h < hidden) out[h] = FloatToBf16(acc);
      }
    }

    const int32_t next = tokens.Take(claim);
    if (next < tokens.end) {
      TokenRanks::FetchRow(send_pos + static_cast<int64_t>(next) * num_ranks, num_ranks, lane,
                           &row_lo, &row_hi);
    }
    if (p.with_weights) {
      for (int base = 0; base < num_topk; base += 32) {  // warp-uniform, as above
        const int k = base + lane;
        float w = 0.0f;
        for (uint64_t m = mask; m != 0;) {
          float row_w[kWeightRanksInFlight];
          int loaded = 0;  // Warp-uniform.
#pragma unroll
          for (int g = 0; g < kWeightRanksInFlight; ++g) {
            if (g < weights_in_flight && m != 0) {
              const float* row = reinterpret_cast<const float*>(ranks.RowAt(
                  LowestRank(m), p.layout.in_combine_weights.offset, 4 * int64_t{num_topk}));
              m &= m - 1;
              row_w[g] = k < num_topk ? row[k] : 0.0f;
              loaded = g + 1;
            }
          }
#pragma unroll
          for (int g = 0; g < kWeightRanksInFlight; ++g) {
            if (g < loaded) w += row_w[g];
          }
        }
        if (k < num_topk) combined_w[static_cast<int64_t>(t) * num_topk + k] = w;
      }
    }
    t = next;
  }
  RecordBadRouting(p, bad_routing);
  RecordDropped(p, dropped);
  FinishOp(p, seq);
}

absl::Status PreloadCombineKernels() {
  cudaFuncAttributes attr;
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, NormalCombineKernel<true>));
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, NormalCombineKernel<false>));
  return absl::OkStatus();
}
const bool kCombinePreloadRegistered = RegisterPreloadHook(&PreloadCombineKernels);

}  // namespace
}  // namespace normal

absl::Status NormalCombine(const CudaRankContext& ctx, const NormalCombineArgs& args,
                           cudaStream_t stream) {
  normal::NormalParams p;
  int32_t num_blocks = 0;
  EPD_RETURN_IF_ERROR(normal::MakeNormalParams(ctx, args.num_tokens, &p, &num_blocks));
  p.with_weights = args.with_weights ? 1 : 0;
  EPD_RETURN_IF_ERROR(normal::LaunchNotify(p, /*notify=*/false, num_blocks, stream));
  return normal::LaunchSecondKernel(ctx.shape.hidden % 8 == 0 ? normal::NormalCombineKernel<true>
                                                              : normal::NormalCombineKernel<false>,
                                    num_blocks, kNormalThreads, 0, stream, p);
}

}  // namespace epd::kernels::cuda
