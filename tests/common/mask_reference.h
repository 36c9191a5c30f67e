// The reference of a low-latency round (LowLatencyDispatch, then LowLatencyCombine of the
// received rows as they are: an identity expert) under a rank mask, computed by kernels/host
// on the same inputs with the masked ranks' experts dropped (their ids set to -1) and the
// masked ranks sending nothing: what the daemon must return to the ranks that take part.
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
    const int32_t T = dispatch_masked[r] ? 0 : in[r].num_tokens;
    idx[r].assign(in[r].topk_idx.begin(), in[r].topk_idx.begin() + T * K);
    host::DropMaskedExperts(shape, dispatch_masked, T, idx[r].data());
    d[r].num_tokens = T;
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

}  // namespace epd::testing
