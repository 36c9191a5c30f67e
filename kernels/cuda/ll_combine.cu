// LowLatencyCombine on CUDA (cuda_ops.h; semantics: host_ops.h LowLatencyCombine): one
// kernel per rank; each warp pulls a token's expert rows from their owners and reduces them
// in f32 in ascending k, bit-identical to kernels/host. The protocol (flags, checks, why no
// completion signal) is in docs/CUDA_BACKEND.md "Low-latency combine".
#include <span>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_ops.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ll_internal.h"

namespace epd::kernels::cuda {
namespace {

using device::GlobalTimerNs;
using device::LaneId;
using device::LowLatencyExchange;
using device::LowLatencyState;
using device::StRelease;
using device::WaitFlagAtLeast;

constexpr int kWarps = kLowLatencyThreads / 32;
/// Channels per unit of work of the vector path (a warp covers 256 channels per step).
constexpr int32_t kChunkChannels = 512;
/// Top-k slots a warp stages at once (one per lane): all of them when K <= this; else
/// the batched kernel takes them in batches of this many, in ascending k.
constexpr int32_t kSlotBatch = 32;

struct CombineParams {
  uint8_t* const* peer_bases;
  uint8_t* own_base;
  const int64_t* topk_idx;
  const uint8_t* rank_masked;  // [R] nonzero = masked (CudaRankContext::rank_masked), or null
  const float* topk_weights;
  const int32_t* handle_pos;  // own ll_handle_pos[b]
  bf16_bits* combined_x;
  uint64_t sync_offset;
  uint64_t x_offset;  // expert outputs [El, R*Mll, H] bf16, same at every rank
  int64_t rows_per_expert;
  int64_t timeout_ns;
  const uint32_t* abort_flag;  // CudaRankContext::abort_flag (the daemon's shutdown word).
  KernelHandoff handoff;       // Daemon-launched stream-ordered hand-off (null flags = none).
  int32_t rank;
  int32_t num_ranks;
  int32_t num_experts;
  int32_t experts_per_rank;
  int32_t hidden;
  int32_t num_topk;
  int32_t max_tokens;
  int32_t buffer;
  int32_t num_tokens_value;  // >= 0: at most this T (LowLatencyCombineArgs::num_tokens_value)
  bool gpu_scope;            // every rank on this GPU: flags at .gpu scope (common.cuh LdAcquire)
};

__device__ __forceinline__ uint32_t* CombineFlag(uint8_t* base, const CombineParams& p,
                                                 int32_t rank) {
  return reinterpret_cast<uint32_t*>(base + p.sync_offset + kSyncLowLatencyExchangeOffset +
                                     LowLatencyExchange::CombineFlag(rank));
}

__device__ __forceinline__ void AccumulateBf16x8(float* acc, const uint4& y, float w) {
  const uint32_t words[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    acc[2 * c] = __fadd_rn(acc[2 * c],
                           __fmul_rn(w, Bf16ToFloat(static_cast<bf16_bits>(words[c] & 0xffffu))));
    acc[2 * c + 1] = __fadd_rn(acc[2 * c + 1],
                               __fmul_rn(w, Bf16ToFloat(static_cast<bf16_bits>(words[c] >> 16))));
  }
}

// One rank's combine, run by `num_blocks` blocks, this block being `block` of them
// (blockIdx.x / gridDim.x of the per-rank kernel; the fused kernel runs several ranks'
// bodies side by side in one grid).
// kBatched (K > kSlotBatch): each unit is one step of the warp (256 channels, one 8-channel
// vector per lane; or 32 channels, one per lane) and the warp stages the token's slots in
// batches of kSlotBatch, the lanes keeping their sums in registers across batches.
// Shape: internal::LowLatencyShape, the generic one (every value from p) or a specialised
// one (hidden, K and experts per rank compile-time constants equal to p's).
template <bool kVec, bool kBatched, typename Shape>
__device__ __forceinline__ void CombineBody(const CombineParams& p, int32_t block,
                                            int32_t num_blocks) {
  __shared__ uint8_t* s_peer[kMaxStatusRanks];
  // Per warp and top-k slot of the batch: source row address (null = skip) and weight.
  __shared__ const uint8_t* s_src[kWarps][kSlotBatch];
  __shared__ float s_w[kWarps][kSlotBatch];
  __shared__ uint32_t s_seq;
  __shared__ int32_t s_num_tokens;
  __shared__ int s_last;

  const int lane = LaneId();
  const int warp = device::WarpId();
  const int32_t num_ranks = p.num_ranks;
  const int32_t num_topk = Shape::Topk(p);
  const int32_t experts_per_rank = Shape::ExpertsPerRank(p);
  const int32_t hidden32 = Shape::Hidden(p);
  const uint64_t deadline = GlobalTimerNs() + static_cast<uint64_t>(p.timeout_ns);
  uint8_t* sync = p.own_base + p.sync_offset;
  auto* state = reinterpret_cast<LowLatencyState*>(sync + kSyncLowLatencyStateOffset);
  DeviceStatus* status = device::StatusOf(p.own_base, p.sync_offset);

  if (threadIdx.x == 0) {
    // Daemon-launched: the client's inputs (expert outputs, topk_idx, topk_weights) are
    // staged once ready >= value; block 0 announces the expert outputs to the peers below.
    device::WaitReady(p.handoff, deadline, status, p.rank, block == 0, p.abort_flag);
    s_seq = *reinterpret_cast<volatile uint32_t*>(&state->combine_seq) + 1;
    int32_t t = *reinterpret_cast<volatile int32_t*>(&state->dispatch_num_tokens[p.buffer]);
    t = (t < 0 || t > p.max_tokens) ? 0 : t;  // written sanitised by the dispatch
    s_num_tokens = p.num_tokens_value >= 0 ? min(t, p.num_tokens_value) : t;
  }
  for (int32_t q = threadIdx.x; q < num_ranks; q += blockDim.x) s_peer[q] = p.peer_bases[q];
  __syncthreads();
  const uint32_t seq = s_seq;
  const int32_t num_tokens = s_num_tokens;

  // ---- 1. announce: this rank's expert outputs are ready ----
  if (block == 0 && threadIdx.x < num_ranks) {
    device::FenceAcqRel(p.gpu_scope);
    StRelease(CombineFlag(s_peer[threadIdx.x], p, p.rank), seq, p.gpu_scope);
  }
  // ---- 2. wait for every rank ----
  bool arrived = true;
  if (threadIdx.x < num_ranks) {
    arrived = WaitFlagAtLeast(CombineFlag(p.own_base, p, threadIdx.x), seq, deadline, p.gpu_scope,
                              p.abort_flag);
    if (!arrived) device::RecordMissingPeer(status, threadIdx.x);
  }
  const bool all_arrived = __syncthreads_and(arrived) != 0;

  if (all_arrived) {
    // ---- 3. pull and reduce ----
    const int64_t hidden = hidden32;
    // Slot k = kb + lane of token t: the id and its row, each read once from
    // client-writable memory into a register, checked, and only then used; a bad one is
    // counted (once per slot: when `count`, in the token's first chunk) and contributes
    // nothing; so does a slot whose expert is a masked rank's (counted as dropped, its row
    // not read: the dispatch left it -1). Lanes past K stage nothing.
    auto stage_slot = [&](int32_t t, int32_t kb, bool count) {
      const int32_t k = kb + lane;
      if (k >= num_topk) return;
      const int64_t i = static_cast<int64_t>(t) * num_topk + k;
      const int64_t e = p.topk_idx[i];
      const int32_t row = p.handle_pos[i];
      const uint8_t* src = nullptr;
      const bool bad_id = e < -1 || e >= p.num_experts;
      const bool masked =
          e >= 0 && !bad_id && p.rank_masked != nullptr && p.rank_masked[e / experts_per_rank] != 0;
      const bool bad_row = e >= 0 && !bad_id && !masked && (row < 0 || row >= p.rows_per_expert);
      if (e >= 0 && !bad_id && !masked && !bad_row) {
        const int32_t owner = static_cast<int32_t>(e) / experts_per_rank;
        const int64_t local = e - static_cast<int64_t>(owner) * experts_per_rank;
        src = s_peer[owner] + p.x_offset + (local * p.rows_per_expert + row) * hidden * 2;
      }
      if (count && bad_id) atomicAdd(&status->bad_expert_ids, 1u);
      if (count && bad_row) atomicAdd(&status->bad_routing, 1u);
      if (count && masked) atomicAdd(&status->dropped_pairs, 1u);
      s_src[warp][lane] = src;
      s_w[warp][lane] = p.topk_weights[i];
    };
    // acc[0..8) += the staged slots [0, n) at vector v (8 channels), in ascending k, up to
    // 4 rows' loads in flight.
    auto accumulate_vec = [&](float* acc, int32_t v, int32_t n) {
      for (int32_t k0 = 0; k0 < n; k0 += 4) {
        uint4 y[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const uint8_t* src = k0 + q < n ? s_src[warp][k0 + q] : nullptr;
          if (src != nullptr) y[q] = device::LdVec16(src + static_cast<int64_t>(v) * 16);
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const uint8_t* src = k0 + q < n ? s_src[warp][k0 + q] : nullptr;
          if (src != nullptr) AccumulateBf16x8(acc, y[q], s_w[warp][k0 + q]);
        }
      }
    };
    auto accumulate_scalar = [&](float acc, int32_t h, int32_t n) {
      for (int32_t k = 0; k < n; ++k) {
        const uint8_t* src = s_src[warp][k];
        if (src == nullptr) continue;
        const bf16_bits y = reinterpret_cast<const bf16_bits*>(src)[h];
        acc = __fadd_rn(acc, __fmul_rn(s_w[warp][k], Bf16ToFloat(y)));
      }
      return acc;
    };
    auto store_vec = [&](bf16_bits* out, int32_t v, const float* acc) {
      uint4 o;
      o.x = FloatToBf16(acc[0]) | (static_cast<uint32_t>(FloatToBf16(acc[1])) << 16);
      o.y = FloatToBf16(acc[2]) | (static_cast<uint32_t>(FloatToBf16(acc[3])) << 16);
      o.z = FloatToBf16(acc[4]) | (static_cast<uint32_t>(FloatToBf16(acc[5])) << 16);
      o.w = FloatToBf16(acc[6]) | (static_cast<uint32_t>(FloatToBf16(acc[7])) << 16);
      device::StVec16(out + static_cast<int64_t>(v) * 8, o);
    };
    const int32_t chunk = kBatched ? (kVec ? 8 * 32 : 32) : (kVec ? kChunkChannels : hidden32);
    const int32_t chunks_per_token = (hidden32 + chunk - 1) / chunk;
    const int32_t units = num_tokens * chunks_per_token;
    const int32_t total_warps = num_blocks * kWarps;
    for (int32_t u = block * kWarps + warp; u < units; u += total_warps) {
      const int32_t t = u / chunks_per_token;
      const int32_t c0 = (u - t * chunks_per_token) * chunk;
      bf16_bits* out = p.combined_x + static_cast<int64_t>(t) * hidden;
      if constexpr (kBatched) {
        // One vector (or channel) per lane, summed over every batch of slots.
        const int32_t h = c0 + (kVec ? 8 : 1) * lane;
        const bool active = h < hidden32;  // kVec: H % 8 == 0, so h + 8 <= H
        float acc[8];
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[c] = 0.0f;
        for (int32_t kb = 0; kb < num_topk; kb += kSlotBatch) {
          stage_slot(t, kb, c0 == 0);
          __syncwarp();
          const int32_t n = min(kSlotBatch, num_topk - kb);
          if (active) {
            if constexpr (kVec) {
              accumulate_vec(acc, h / 8, n);
            } else {
              acc[0] = accumulate_scalar(acc[0], h, n);
            }
          }
          __syncwarp();
        }
        if (active) {
          if constexpr (kVec) {
            store_vec(out, h / 8, acc);
          } else {
            out[h] = FloatToBf16(acc[0]);
          }
        }
      } else {
        const int32_t c1 = min(hidden32, c0 + chunk);
        stage_slot(t, 0, c0 == 0);
        __syncwarp();
        auto combine_vec = [&](int32_t v) {
          float acc[8];
#pragma unroll
          for (int c = 0; c < 8; ++c) acc[c] = 0.0f;
          accumulate_vec(acc, v, num_topk);
          store_vec(out, v, acc);
        };
        if constexpr (kVec && Shape::FullChunks(kChunkChannels)) {
          // Every chunk whole: each lane's vectors v = c0 / 8 + lane + 32 i, a fixed count.
#pragma unroll
          for (int32_t i = 0; i < kChunkChannels / 8 / 32; ++i) combine_vec(c0 / 8 + lane + 32 * i);
        } else if constexpr (kVec) {
          for (int32_t v = c0 / 8 + lane; v < c1 / 8; v += 32) combine_vec(v);
        } else {
          for (int32_t h = c0 + lane; h < c1; h += 32) {
            out[h] = FloatToBf16(accumulate_scalar(0.0f, h, num_topk));
          }
        }
        __syncwarp();
      }
    }
  }

  // ---- 4. the last block bumps the counter ----
  __syncthreads();
  if (threadIdx.x == 0) {
    // Daemon-launched: the last block stores done once every block's rows of combined_x
    // are written (each block releases its rows before its ticket at .gpu scope: every
    // block runs on this GPU; the last one acquires them and publishes done, which the
    // client's stream reads on this GPU too, then copies the status out: StoreDone).
    if (p.handoff.done_flag != nullptr) device::FenceAcqRel(/*gpu=*/true);
    const uint32_t ticket = atomicAdd(&state->combine_ticket, 1u);
    s_last = ticket == static_cast<uint32_t>(num_blocks - 1);
    if (s_last) {
      state->combine_ticket = 0;
      state->combine_seq = seq;
      if (p.handoff.done_flag != nullptr) {
        device::StoreDone(p.handoff);  // Its fence also acquires the other blocks' status.
        if (p.handoff.status_out != nullptr) device::CopyStatusOut(status, p.handoff.status_out);
      }
    }
  }
}

template <bool kVec, bool kBatched, typename Shape = internal::GenericShape>
__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    LowLatencyCombineKernel(const CombineParams p) {
  CombineBody<kVec, kBatched, Shape>(p, static_cast<int32_t>(blockIdx.x),
                                     static_cast<int32_t>(gridDim.x));
}

template <bool kVec, bool kBatched, typename Shape = internal::GenericShape>
__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    FusedLowLatencyCombineKernel(const internal::FusedParams<CombineParams> fp) {
  internal::RunFusedRank<CombineParams, CombineBody<kVec, kBatched, Shape>>(fp);
}

// The combine kernels, per-rank and fused, by variant (PreparedCombine::variant): (kVec,
// kBatched) as 2 * batched + !vec, then the specialised instance (the vector path, for the
// one shape it is for).
using RankKernel = void (*)(CombineParams);
using FusedKernel = void (*)(internal::FusedParams<CombineParams>);
using CombineKernels = internal::KernelPair<CombineParams>;
template <bool kVec, bool kBatched, typename Shape = internal::GenericShape>
constexpr CombineKernels kInstance = {LowLatencyCombineKernel<kVec, kBatched, Shape>,
                                      FusedLowLatencyCombineKernel<kVec, kBatched, Shape>};
constexpr int kNumVariants = 5;
constexpr int kSpecialisedVariant = 4;
constexpr CombineKernels kKernels[kNumVariants] = {
    kInstance<true, false>, kInstance<false, false>, kInstance<true, true>, kInstance<false, true>,
    kInstance<true, false, internal::SpecialisedShape>};

/// One rank's combine as the launchers need it: the kernel's params, grid and variant.
struct PreparedCombine {
  CombineParams p{};
  int32_t num_blocks = 0;
  int variant = 0;
};

/// Checks one rank's context and args (errors as LowLatencyCombine, prefixed with `op`) and
/// works out its launch.
absl::Status PrepareCombine(const CudaRankContext& ctx, const LowLatencyCombineArgs& args,
                            const char* op, PreparedCombine* out) {
  EPD_RETURN_IF_ERROR(internal::ValidateLowLatency(ctx, args.buffer, op));
  const GroupShape& s = ctx.shape;
  const EndpointLayout& l = ctx.layout;
  const int b = args.buffer;
  const uint64_t x_offset = args.x_offset != 0 ? args.x_offset : l.in_ll_combine_x.offset;
  const uint64_t x_bytes = static_cast<uint64_t>(s.num_local_experts()) *
                           static_cast<uint64_t>(s.ll_rows_per_expert()) * s.hidden * 2;
  if (x_offset % 16 != 0 || x_offset + x_bytes > l.total_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": x_offset = ", x_offset, " must be 16-byte aligned and leave room for ", x_bytes,
        " bytes of expert outputs in a data area of ", l.total_bytes, " bytes"));
  }
  CombineParams& p = out->p;
  p = CombineParams{};
  p.peer_bases = ctx.peer_bases;
  p.own_base = ctx.own_base;
  p.topk_idx = args.topk_idx != nullptr
                   ? args.topk_idx
                   : reinterpret_cast<const int64_t*>(ctx.own_base + l.in_topk_idx.offset);
  p.rank_masked = ctx.rank_masked;
  p.topk_weights = args.topk_weights != nullptr
                       ? args.topk_weights
                       : reinterpret_cast<const float*>(ctx.own_base + l.in_topk_weights.offset);
  p.handle_pos = reinterpret_cast<const int32_t*>(ctx.own_base + l.ll_handle_pos[b].offset);
  p.combined_x = args.combined_x != nullptr
                     ? args.combined_x
                     : reinterpret_cast<bf16_bits*>(ctx.own_base + l.ll_combined_x[b].offset);
  p.sync_offset = l.sync.offset;
  p.x_offset = x_offset;
  p.rows_per_expert = s.ll_rows_per_expert();
  p.timeout_ns = ctx.timeout_ns;
  p.abort_flag = ctx.abort_flag;
  p.handoff = args.handoff;
  p.rank = ctx.rank;
  p.num_ranks = s.num_ranks;
  p.num_experts = s.num_experts;
  p.experts_per_rank = s.num_local_experts();
  p.hidden = s.hidden;
  p.num_topk = s.num_topk;
  p.max_tokens = s.ll_max_tokens_per_rank;
  p.buffer = b;
  p.num_tokens_value = args.num_tokens_value;
  p.gpu_scope = ctx.all_ranks_on_device;
  EPD_RETURN_IF_ERROR(ResolveNumBlocks(ctx, &out->num_blocks));
  const bool vec = s.hidden % 8 == 0 && (args.combined_x == nullptr ||
                                         reinterpret_cast<uintptr_t>(args.combined_x) % 16 == 0);
  const bool batched = s.num_topk > kSlotBatch;
  out->variant = !batched && vec && LowLatencySpecialisedFor(s) ? kSpecialisedVariant
                                                                : 2 * batched + (vec ? 0 : 1);
  return absl::OkStatus();
}

/// The first argument a fused combine needs equal on every rank that `a` and `a0` disagree
/// on, or null.
const char* CombineArgDiffers(const LowLatencyCombineArgs& a, const LowLatencyCombineArgs& a0) {
  return a.buffer != a0.buffer                               ? "buffer"
         : a.x_offset != a0.x_offset                         ? "x_offset"
         : a.handoff.programmatic != a0.handoff.programmatic ? "handoff.programmatic"
                                                             : nullptr;
}

}  // namespace

namespace internal {

absl::Status PreloadLowLatencyCombineKernels() {
  cudaFuncAttributes attr;
  for (int v = 0; v < kNumVariants; ++v) {
    EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, kKernels[v].rank));
    EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, kKernels[v].fused));
  }
  return absl::OkStatus();
}

}  // namespace internal

absl::Status LowLatencyCombine(const CudaRankContext& ctx, const LowLatencyCombineArgs& args,
                               cudaStream_t stream) {
  PreparedCombine c;
  EPD_RETURN_IF_ERROR(PrepareCombine(ctx, args, "LowLatencyCombine", &c));
  return internal::LaunchLowLatency(kKernels[c.variant].rank, c.num_blocks, 0,
                                    args.handoff.programmatic, stream, c.p);
}

absl::Status LowLatencyCombineRanks(std::span<const CudaRankContext> ctxs,
                                    std::span<const LowLatencyCombineArgs> args,
                                    cudaStream_t stream) {
  internal::FusedParams<CombineParams> fp{};
  PreparedCombine first;
  EPD_RETURN_IF_ERROR(internal::PrepareFusedRanks(
      ctxs, args, "LowLatencyCombineRanks", &PrepareCombine, &CombineArgDiffers,
      "combined_x (kernel variant: one 16-byte aligned, another not)", &fp, &first));
  return internal::LaunchLowLatency(kKernels[first.variant].fused, fp.num_ranks * first.num_blocks,
                                    0, args[0].handoff.programmatic, stream, fp);
}

}  // namespace epd::kernels::cuda
