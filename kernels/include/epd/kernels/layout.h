// EndpointLayout: where every buffer of one endpoint (one rank of a group) lives inside
// that endpoint's data area. The daemon sizes the allocation from it, publishes the
// regions to the client (EndpointInfo.regions), and the host and CUDA kernels compute
// the same offsets from it, so host and device never disagree (DeepEP V2's shared
// layout-struct habit). All offsets and sizes are 64-bit bytes: areas over 4 GiB work.
#pragma once

#include <cstdint>

#include "epd/kernels/types.h"
#include "proto/abi/launch_flags.h"

namespace epd::kernels {

/// Alignment of every region, in bytes (covers 16-byte vector access and TMA's 128 B).
inline constexpr uint64_t kRegionAlignment = 256;

/// The group shape the layout is computed from (a GroupSpec without its name).
struct GroupShape {
  int32_t num_ranks = 1;               ///< R.
  int32_t num_experts = 1;             ///< E; E % R == 0.
  int32_t hidden = 128;                ///< H channels.
  int32_t num_topk = 1;                ///< K.
  int32_t max_tokens_per_rank = 1;     ///< M: largest T of a normal-mode op.
  int32_t ll_max_tokens_per_rank = 0;  ///< Low-latency M (0 = low-latency ops disabled).
  bool use_fp8 = false;                ///< FP8 inputs/outputs allowed (needs H % 128 == 0).

  EPD_HD int32_t num_local_experts() const { return num_experts / num_ranks; }
  /// Scale columns per token: ceil(H / 128).
  EPD_HD int32_t num_scales() const { return (hidden + kFp8BlockChannels - 1) / kFp8BlockChannels; }
  /// Largest number of rows a rank can receive in normal mode: R * M.
  EPD_HD int64_t max_recv_tokens() const {
    return static_cast<int64_t>(num_ranks) * max_tokens_per_rank;
  }
  /// Rows per local expert in the low-latency layout: R * M_ll.
  EPD_HD int64_t ll_rows_per_expert() const {
    return static_cast<int64_t>(num_ranks) * ll_max_tokens_per_rank;
  }
  /// Largest T of any op (normal or low-latency).
  EPD_HD int32_t max_input_tokens() const {
    return max_tokens_per_rank > ll_max_tokens_per_rank ? max_tokens_per_rank
                                                        : ll_max_tokens_per_rank;
  }
};

/// Byte offset, inside an ll_recv_scales region of `shape`, of the scale of 128-channel
/// block `block` of row `row` of local expert `local_expert`. f32 scales: element
/// [local_expert, block, row] of [El, S, R*Mll]. UE8M0 (`ue8m0`): byte block % 4 (least
/// significant first) of int32 element [local_expert, block / 4, row] of
/// [El, ceil(S/4), R*Mll]. Both fit the region's El * S * R*Mll * 4 bytes.
EPD_HD uint64_t LowLatencyScaleOffset(const GroupShape& shape, bool ue8m0, int64_t local_expert,
                                      int64_t row, int32_t block) {
  const int64_t rows = shape.ll_rows_per_expert();
  if (!ue8m0) {
    return static_cast<uint64_t>(((local_expert * shape.num_scales() + block) * rows + row) * 4);
  }
  const int64_t words = (shape.num_scales() + kUe8m0BlocksPerWord - 1) / kUe8m0BlocksPerWord;
  return static_cast<uint64_t>(((local_expert * words + block / kUe8m0BlocksPerWord) * rows + row) *
                                   4 +
                               block % kUe8m0BlocksPerWord);
}

/// [offset, offset + bytes) inside an endpoint's data area.
struct Region {
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

/// How the CUDA normal dispatch splits a rank's token slots into tiles for its multi-block
/// layout pass (kernels/cuda/normal_dispatch.cu): tile c holds tokens [c * tile_tokens,
/// (c + 1) * tile_tokens). tile_tokens is a multiple of kTokenGranule, at least
/// ceil(M / kMaxTiles), so num_tiles = ceil(M / tile_tokens) <= kMaxTiles. The
/// `normal_tiles` region has `slots` = min(kMaxTiles, ceil(M / kTokenGranule)) >= num_tiles
/// rows (so its size never shrinks as M grows) of each of: [slots, R] int32 counts,
/// [slots, R] int32 bases, [slots, E] int32 expert counts. Pure function of M.
struct NormalDispatchTiling {
  static constexpr int32_t kMaxTiles = 64;
  static constexpr int32_t kTokenGranule = 256;
  int32_t tile_tokens = kTokenGranule;
  int32_t num_tiles = 0;
  int32_t slots = 0;

  static NormalDispatchTiling For(int32_t max_tokens_per_rank) {
    NormalDispatchTiling t;
    const int64_t m = max_tokens_per_rank > 0 ? max_tokens_per_rank : 0;
    const int64_t least = (m + kMaxTiles - 1) / kMaxTiles;
    const int64_t granules = (least + kTokenGranule - 1) / kTokenGranule;
    t.tile_tokens = static_cast<int32_t>((granules > 1 ? granules : 1) * kTokenGranule);
    t.num_tiles = static_cast<int32_t>((m + t.tile_tokens - 1) / t.tile_tokens);
    const int64_t slots = (m + kTokenGranule - 1) / kTokenGranule;
    t.slots = static_cast<int32_t>(slots < kMaxTiles ? slots : kMaxTiles);
    return t;
  }
  /// Byte offsets inside the `normal_tiles` region, and its size, for R ranks, E experts.
  EPD_HD uint64_t rank_counts() const { return 0; }
  EPD_HD uint64_t bases(int32_t num_ranks) const { return 4ull * slots * num_ranks; }
  EPD_HD uint64_t expert_counts(int32_t num_ranks) const { return 8ull * slots * num_ranks; }
  EPD_HD uint64_t bytes(int32_t num_ranks, int32_t num_experts) const {
    return expert_counts(num_ranks) + 4ull * slots * num_experts;
  }
};

/// How the CUDA normal dispatch copy's register path cuts a token's row into work items
/// (kernels/cuda/normal_dispatch.cu, EPD_NORMAL_COPY_PARTS): `parts` items, each
/// `part_vec` vectors (the last may be shorter), every part a whole number of chunks and
/// none empty.
struct NormalCopyParts {
  int64_t parts = 1;
  int64_t part_vec = 0;

  /// The parts of a row of `num_vec` vectors (>= 1), chunks of `chunk_vec` vectors (>= 1),
  /// `wanted` parts asked for (< 1 taken as 1), `num_tokens` tokens: at most the row's
  /// chunks, fewer where equal whole-chunk parts leave one empty, and 1 when num_tokens x
  /// parts would pass int32 (the item counter's range).
  EPD_HD static NormalCopyParts For(int64_t num_vec, int64_t chunk_vec, int32_t wanted,
                                    int32_t num_tokens) {
    NormalCopyParts c;
    const int64_t num_chunks = (num_vec + chunk_vec - 1) / chunk_vec;
    int64_t parts = wanted < 1 ? 1 : wanted;
    if (parts > num_chunks) parts = num_chunks > 1 ? num_chunks : 1;
    const int64_t part_chunks = (num_chunks + parts - 1) / parts;
    if (part_chunks > 0) parts = (num_chunks + part_chunks - 1) / part_chunks;
    if (static_cast<int64_t>(num_tokens) * parts > 0x7fffffffLL) parts = 1;
    c.parts = parts;
    c.part_vec = parts == 1 ? num_vec : part_chunks * chunk_vec;
    return c;
  }
};

/// Most byte ranges of an area one mirror copy takes (kernels::cuda::CopySpansAsync, the
/// CUDA backend across nodes; daemon/dataplane/exchange/mirror_spans.h).
inline constexpr int kMaxAreaSpans = 256;

/// Number of low-latency buffer sets: consecutive low-latency ops alternate between them,
/// so a low-latency output view stays valid until the op after next.
inline constexpr int kLowLatencyBuffers = 2;

/// Size of the `sync` region: inter-rank flags and counters owned by the CUDA kernels.
inline constexpr uint64_t kSyncRegionBytes = 64 * 1024;

/// Every region of one endpoint. Shapes are given with M = max_tokens_per_rank,
/// Mll = ll_max_tokens_per_rank, N = R*M, El = E/R, S = ceil(H/128).
/// Regions that a spec does not need (FP8 scales without use_fp8, low-latency regions
/// with Mll = 0) have bytes == 0.
struct EndpointLayout {
  // ---- staging: inputs the client copies in (or writes directly) ----
  Region in_x;                ///< [max(M,Mll), H] bf16, or e4m3 (first half used).
  Region in_scales;           ///< [M, S] f32 (FP8 normal dispatch input).
  Region in_topk_idx;         ///< [max(M,Mll), K] int64.
  Region in_topk_weights;     ///< [max(M,Mll), K] f32.
  Region in_combine_x;        ///< [N, H] bf16: normal combine input.
  Region in_combine_weights;  ///< [N, K] f32: normal combine optional weights.
  Region in_ll_combine_x;     ///< [El, R*Mll, H] bf16: low-latency combine input.

  // ---- GetDispatchLayout outputs ----
  Region layout_tokens_per_rank;    ///< [R] int32.
  Region layout_tokens_per_expert;  ///< [E] int32.
  Region layout_is_token_in_rank;   ///< [M, R] bool (1 byte).

  // ---- normal dispatch outputs (valid until the next normal dispatch) ----
  Region recv_x;                  ///< [N, H] bf16 or e4m3.
  Region recv_scales;             ///< [N, S] f32 (FP8).
  Region recv_topk_idx;           ///< [N, K] int64: local expert ids, -1 elsewhere.
  Region recv_topk_weights;       ///< [N, K] f32: 0 where recv_topk_idx is -1.
  Region recv_tokens_per_expert;  ///< [El] int32, each rounded up to expert_alignment.
  Region recv_src_info;           ///< [N] int32: src_rank * M + src_token.
  Region send_pos;                ///< [M, R] int32: handle, row of token t at rank r
                                  ///< (-1 = not sent). Source side.
  Region rank_prefix;             ///< [R] int32: first recv row of each source rank.
  Region recv_count;              ///< [1] int32: N_recv of the last dispatch.

  // ---- normal combine outputs (valid until the next normal combine) ----
  Region combined_x;             ///< [M, H] bf16.
  Region combined_topk_weights;  ///< [M, K] f32.

  // ---- low-latency, per buffer b in {0, 1} ----
  Region ll_recv_x[kLowLatencyBuffers];  ///< [El, R*Mll, H] bf16 or e4m3.
  /// Scales of the FP8 low-latency dispatch, token index fastest (DeepEP's column-major
  /// storage, what DeepGEMM reads): [El, S, R*Mll] f32, or with use_ue8m0 [El, S/4, R*Mll]
  /// int32 (4 exponent bytes per word). LowLatencyScaleOffset gives each scale's byte.
  Region ll_recv_scales[kLowLatencyBuffers];
  Region ll_recv_count[kLowLatencyBuffers];     ///< [El] int32.
  Region ll_recv_src_info[kLowLatencyBuffers];  ///< [El, R*Mll] int32: src_rank*Mll + t.
  Region ll_handle_pos[kLowLatencyBuffers];     ///< [Mll, K] int32: handle, row of
                                                ///< (t,k) in its expert's block, -1 none.
  Region ll_combined_x[kLowLatencyBuffers];     ///< [Mll, H] bf16.
  /// [Mll, K] of {int32 code, int32 position}: the CUDA low-latency dispatch's routing of
  /// its own tokens when it does not fit in shared memory (kernels/cuda/ll_dispatch.cu);
  /// one for both buffers (a rank's dispatches run one after another). Not an output: its
  /// contents are undefined between ops; unused on the host backend.
  Region ll_routing;
  /// NormalDispatchTiling's per-tile counts and bases of the CUDA normal dispatch
  /// (kernels/cuda/normal_dispatch.cu): written by its layout pass, read by its notify and
  /// copy steps. Not an output: its contents are undefined between ops; unused on the host
  /// backend.
  Region normal_tiles;

  // ---- kernel-owned flags and counters ----
  Region sync;          ///< kSyncRegionBytes, zeroed at creation.
  Region launch_flags;  ///< abi::kLaunchFlagsRegionBytes: ready/done seq flags, zeroed.

  uint64_t total_bytes = 0;

  /// Computes the layout of `shape`. Regions are laid out in declaration order, each
  /// aligned to kRegionAlignment. Pure function of the shape.
  static EndpointLayout Compute(const GroupShape& shape);

  /// Calls `fn(const char* name, const Region&)` for every region, in layout order.
  /// Names are the member names above with "[b]" spelled as "_b" (e.g. "ll_recv_x_1").
  template <typename Fn>
  void ForEachRegion(Fn&& fn) const;
};

// ---------------------------------------------------------------------------------------
inline EndpointLayout EndpointLayout::Compute(const GroupShape& s) {
  EndpointLayout l;
  uint64_t cursor = 0;
  auto take = [&cursor](uint64_t bytes) {
    Region r;
    r.offset = cursor;
    r.bytes = bytes;
    cursor += (bytes + kRegionAlignment - 1) / kRegionAlignment * kRegionAlignment;
    return r;
  };
  const uint64_t R = static_cast<uint64_t>(s.num_ranks);
  const uint64_t E = static_cast<uint64_t>(s.num_experts);
  const uint64_t H = static_cast<uint64_t>(s.hidden);
  const uint64_t K = static_cast<uint64_t>(s.num_topk);
  const uint64_t M = static_cast<uint64_t>(s.max_tokens_per_rank);
  const uint64_t Mll = static_cast<uint64_t>(s.ll_max_tokens_per_rank);
  const uint64_t Min = static_cast<uint64_t>(s.max_input_tokens());
  const uint64_t N = R * M;
  const uint64_t El = E / R;
  const uint64_t S = static_cast<uint64_t>(s.num_scales());
  const uint64_t fp8 = s.use_fp8 ? 1 : 0;
  const uint64_t ll = Mll > 0 ? 1 : 0;

  l.in_x = take(Min * H * 2);
  l.in_scales = take(fp8 * M * S * 4);
  l.in_topk_idx = take(Min * K * 8);
  l.in_topk_weights = take(Min * K * 4);
  l.in_combine_x = take(N * H * 2);
  l.in_combine_weights = take(N * K * 4);
  l.in_ll_combine_x = take(El * R * Mll * H * 2);

  l.layout_tokens_per_rank = take(R * 4);
  l.layout_tokens_per_expert = take(E * 4);
  l.layout_is_token_in_rank = take(M * R);

  l.recv_x = take(N * H * 2);
  l.recv_scales = take(fp8 * N * S * 4);
  l.recv_topk_idx = take(N * K * 8);
  l.recv_topk_weights = take(N * K * 4);
  l.recv_tokens_per_expert = take(El * 4);
  l.recv_src_info = take(N * 4);
  l.send_pos = take(M * R * 4);
  l.rank_prefix = take(R * 4);
  l.recv_count = take(4);

  l.combined_x = take(M * H * 2);
  l.combined_topk_weights = take(M * K * 4);

  for (int b = 0; b < kLowLatencyBuffers; ++b) {
    l.ll_recv_x[b] = take(El * R * Mll * H * 2);
    l.ll_recv_scales[b] = take(fp8 * El * R * Mll * S * 4);
    l.ll_recv_count[b] = take(ll * El * 4);
    l.ll_recv_src_info[b] = take(El * R * Mll * 4);
    l.ll_handle_pos[b] = take(Mll * K * 4);
    l.ll_combined_x[b] = take(Mll * H * 2);
  }
  l.ll_routing = take(Mll * K * 8);
  l.normal_tiles =
      take(NormalDispatchTiling::For(s.max_tokens_per_rank).bytes(s.num_ranks, s.num_experts));
  l.sync = take(kSyncRegionBytes);
  l.launch_flags = take(abi::kLaunchFlagsRegionBytes);
  l.total_bytes = cursor;
  return l;
}

template <typename Fn>
void EndpointLayout::ForEachRegion(Fn&& fn) const {
  fn("in_x", in_x);
  fn("in_scales", in_scales);
  fn("in_topk_idx", in_topk_idx);
  fn("in_topk_weights", in_topk_weights);
  fn("in_combine_x", in_combine_x);
  fn("in_combine_weights", in_combine_weights);
  fn("in_ll_combine_x", in_ll_combine_x);
  fn("layout_tokens_per_rank", layout_tokens_per_rank);
  fn("layout_tokens_per_expert", layout_tokens_per_expert);
  fn("layout_is_token_in_rank", layout_is_token_in_rank);
  fn("recv_x", recv_x);
  fn("recv_scales", recv_scales);
  fn("recv_topk_idx", recv_topk_idx);
  fn("recv_topk_weights", recv_topk_weights);
  fn("recv_tokens_per_expert", recv_tokens_per_expert);
  fn("recv_src_info", recv_src_info);
  fn("send_pos", send_pos);
  fn("rank_prefix", rank_prefix);
  fn("recv_count", recv_count);
  fn("combined_x", combined_x);
  fn("combined_topk_weights", combined_topk_weights);
  static constexpr const char* kLl[][kLowLatencyBuffers] = {
      {"ll_recv_x_0", "ll_recv_x_1"},         {"ll_recv_scales_0", "ll_recv_scales_1"},
      {"ll_recv_count_0", "ll_recv_count_1"}, {"ll_recv_src_info_0", "ll_recv_src_info_1"},
      {"ll_handle_pos_0", "ll_handle_pos_1"}, {"ll_combined_x_0", "ll_combined_x_1"}};
  for (int b = 0; b < kLowLatencyBuffers; ++b) {
    fn(kLl[0][b], ll_recv_x[b]);
    fn(kLl[1][b], ll_recv_scales[b]);
    fn(kLl[2][b], ll_recv_count[b]);
    fn(kLl[3][b], ll_recv_src_info[b]);
    fn(kLl[4][b], ll_handle_pos[b]);
    fn(kLl[5][b], ll_combined_x[b]);
  }
  fn("ll_routing", ll_routing);
  fn("normal_tiles", normal_tiles);
  fn("sync", sync);
  fn("launch_flags", launch_flags);
}

}  // namespace epd::kernels
