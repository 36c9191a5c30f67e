// The reference of a round (a low-latency or a normal dispatch, then the matching combine of
// the received rows as they are: an identity expert) under a rank mask, computed by
// kernels/host on the same inputs with the masked ranks' experts dropped (their ids set to
// -1) and the masked ranks sending nothing: what the daemon must return to the ranks that
// take part.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "epd/kernels/host_ops.h"
#include "epd/kernels/layout.h"
#include "epd/kernels/types.h"

namespace epd::testing {

/// One rank's inputs of a low-latency round: x [T, H] bf16, topk_idx and weights [T, K].
struct LlRoundInputs {
  int32_t num_tokens = 0;
  std::vector<kernels::bf16_bits> x;
  std::vector<int64_t> topk_idx;
  std::vector<float> topk_weights;
};

/// What a low-latency round under a mask gives each rank.
struct LlRoundReference {
  std::vector<std::vector<kernels::bf16_bits>> combined_x;  ///< [R][T_r * H].
  std::vector<int32_t> dropped_pairs;                       ///< [R] pairs dropped at combine.
};

/// Rank `r`'s T and topk_idx (into `*idx`) as it sends them under `masked` [R] (nonzero =
/// masked), from its own T `tokens` and ids `topk_idx` [tokens, K]: nothing when masked
/// itself, else its ids with the masked ranks' experts dropped (returns the count).
inline int32_t MaskedIds(const kernels::GroupShape& shape, int32_t tokens, const int64_t* topk_idx,
                         int r, std::span<const uint8_t> masked, std::vector<int64_t>* idx,
                         int32_t* num_tokens) {
  *num_tokens = masked[r] ? 0 : tokens;
  idx->assign(topk_idx, topk_idx + int64_t{*num_tokens} * shape.num_topk);
  return kernels::host::DropMaskedExperts(shape, masked, *num_tokens, idx->data());
}
/// The same for a low-latency round's inputs `in` of rank `r`.
inline int32_t MaskedIds(const kernels::GroupShape& shape, const LlRoundInputs& in, int r,
                         std::span<const uint8_t> masked, std::vector<int64_t>* idx,
                         int32_t* num_tokens) {
  return MaskedIds(shape, in.num_tokens, in.topk_idx.data(), r, masked, idx, num_tokens);
}

/// kernels/host's LowLatencyDispatch + LowLatencyCombine (identity experts: each rank's
/// combine input is its received rows) of `in` [R] with `dispatch_masked` [R] ranks
/// masked at the dispatch and `combine_masked` [R] at the combine (nonzero = masked).
/// Masked ranks send nothing and get empty outputs.
inline absl::StatusOr<LlRoundReference> LowLatencyRoundReference(
    const kernels::GroupShape& shape, const std::vector<LlRoundInputs>& in,
    std::span<const uint8_t> dispatch_masked, std::span<const uint8_t> combine_masked) {
  namespace host = kernels::host;
  const int R = shape.num_ranks;
  const int64_t H = shape.hidden, K = shape.num_topk, El = shape.num_local_experts();
  const int64_t Mll = shape.ll_max_tokens_per_rank;
  std::vector<std::vector<int64_t>> idx(R);
  std::vector<std::vector<kernels::bf16_bits>> recv_x(
      R, std::vector<kernels::bf16_bits>(El * R * Mll * H));
  std::vector<std::vector<int32_t>> recv_count(R, std::vector<int32_t>(El)),
      src_info(R, std::vector<int32_t>(El * R * Mll)), handle(R, std::vector<int32_t>(Mll * K));
  std::vector<host::LowLatencyDispatchRankArgs> d(R);
  for (int r = 0; r < R; ++r) {
    MaskedIds(shape, in[r], r, dispatch_masked, &idx[r], &d[r].num_tokens);
    d[r].x = in[r].x.data();
    d[r].topk_idx = idx[r].data();
    d[r].recv_x = recv_x[r].data();
    d[r].recv_count = recv_count[r].data();
    d[r].recv_src_info = src_info[r].data();
    d[r].handle_pos = handle[r].data();
  }
  if (absl::Status st = host::LowLatencyDispatch(shape, {}, d); !st.ok()) return st;
  LlRoundReference ref;
  ref.combined_x.resize(R);
  ref.dropped_pairs.assign(R, 0);
  std::vector<host::LowLatencyCombineRankArgs> c(R);
  for (int r = 0; r < R; ++r) {
    const int32_t T = dispatch_masked[r] || combine_masked[r] ? 0 : in[r].num_tokens;
    idx[r].assign(in[r].topk_idx.begin(), in[r].topk_idx.begin() + T * K);
    ref.dropped_pairs[r] = host::DropMaskedExperts(shape, combine_masked, T, idx[r].data());
    host::DropMaskedExperts(shape, dispatch_masked, T, idx[r].data());
    ref.combined_x[r].assign(T * H, 0);
    c[r].num_tokens = T;
    c[r].topk_idx = idx[r].data();
    c[r].topk_weights = in[r].topk_weights.data();
    c[r].handle_pos = handle[r].data();
    c[r].x = recv_x[r].data();
    c[r].combined_x = ref.combined_x[r].data();
  }
  if (absl::Status st = host::LowLatencyCombine(shape, c); !st.ok()) return st;
  return ref;
}

/// kernels/host's Dispatch + Combine (identity experts: each rank's combine input is its
/// received rows; no weights) of `in` [R] with `dispatch_masked` [R] ranks masked at the
/// dispatch and `combine_masked` [R] at the combine (the combine leaves out the routes to
/// them). LlRoundReference::dropped_pairs: each rank's routes dropped at the combine.
inline absl::StatusOr<LlRoundReference> NormalRoundReference(
    const kernels::GroupShape& shape, const std::vector<LlRoundInputs>& in,
    std::span<const uint8_t> dispatch_masked, std::span<const uint8_t> combine_masked) {
  namespace host = kernels::host;
  const int R = shape.num_ranks;
  const int64_t H = shape.hidden, K = shape.num_topk, N = shape.max_recv_tokens();
  std::vector<std::vector<int64_t>> idx(R), recv_idx(R, std::vector<int64_t>(N * K));
  std::vector<std::vector<kernels::bf16_bits>> recv_x(R, std::vector<kernels::bf16_bits>(N * H));
  std::vector<std::vector<float>> recv_w(R, std::vector<float>(N * K));
  std::vector<std::vector<int32_t>> per_expert(R, std::vector<int32_t>(shape.num_local_experts())),
      src_info(R, std::vector<int32_t>(N)),
      send_pos(R, std::vector<int32_t>(int64_t{shape.max_tokens_per_rank} * R)),
      prefix(R, std::vector<int32_t>(R));
  std::vector<host::DispatchRankArgs> d(R);
  for (int r = 0; r < R; ++r) {
    MaskedIds(shape, in[r], r, dispatch_masked, &idx[r], &d[r].num_tokens);
    d[r].x = in[r].x.data();
    d[r].topk_idx = idx[r].data();
    d[r].recv_capacity = N;
    d[r].recv_x = recv_x[r].data();
    d[r].recv_topk_idx = recv_idx[r].data();
    d[r].recv_topk_weights = recv_w[r].data();
    d[r].recv_tokens_per_expert = per_expert[r].data();
    d[r].recv_src_info = src_info[r].data();
    d[r].send_pos = send_pos[r].data();
    d[r].rank_prefix = prefix[r].data();
  }
  if (absl::Status st = host::Dispatch(shape, {}, d); !st.ok()) return st;
  LlRoundReference ref;
  ref.combined_x.resize(R);
  ref.dropped_pairs.assign(R, 0);
  std::vector<host::CombineRankArgs> c(R);
  for (int r = 0; r < R; ++r) {
    const bool out = dispatch_masked[r] || combine_masked[r];
    const int32_t T = out ? 0 : in[r].num_tokens;
    ref.dropped_pairs[r] = host::DropMaskedRoutes(shape, combine_masked, T, send_pos[r].data());
    ref.combined_x[r].assign(T * H, 0);
    c[r].num_tokens = T;
    c[r].send_pos = send_pos[r].data();
    c[r].num_recv_tokens = out ? 0 : d[r].num_recv_tokens;
    c[r].x = recv_x[r].data();
    c[r].combined_x = ref.combined_x[r].data();
  }
  if (absl::Status st = host::Combine(shape, c); !st.ok()) return st;
  return ref;
}

}  // namespace epd::testing
