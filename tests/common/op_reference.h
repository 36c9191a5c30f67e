// Expected outputs of one rank for the client programs that recompute a whole group's ops
// with kernels/host (tests/security/epd_victim.cc, tests/multinode/clients/mn_client.cc):
// the reference buffers of a normal and a low-latency dispatch, sized to their capacities
// and bound to the host op's arguments, and a byte-for-byte comparison of a result with them.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "epd/kernels/host_ops.h"
#include "epd/kernels/layout.h"
#include "epd/kernels/types.h"

namespace epd::testing {

/// One rank's expected outputs of a normal dispatch; recv_x as bytes (bf16, or e4m3 with fp8).
struct DispatchRef {
  int32_t N = 0;
  std::vector<uint8_t> recv_x;
  std::vector<float> recv_scales, recv_w;
  std::vector<int64_t> recv_idx;
  std::vector<int32_t> per_expert, src_info, send_pos, rank_prefix;

  const kernels::bf16_bits* bf16() const {
    return reinterpret_cast<const kernels::bf16_bits*>(recv_x.data());
  }
  /// Sizes the outputs to their capacities and points `a`'s outputs at them.
  void Bind(const kernels::GroupShape& s, kernels::host::DispatchRankArgs& a, bool fp8 = false) {
    const int64_t cap = s.max_recv_tokens();
    recv_x.assign(size_t(cap) * s.hidden * (fp8 ? 1 : 2), 0);
    recv_scales.assign(fp8 ? size_t(cap) * s.num_scales() : 0, 0);
    recv_idx.assign(size_t(cap) * s.num_topk, 0);
    recv_w.assign(size_t(cap) * s.num_topk, 0);
    per_expert.assign(s.num_local_experts(), 0);
    src_info.assign(size_t(cap), 0);
    send_pos.assign(size_t(s.max_tokens_per_rank) * s.num_ranks, 0);
    rank_prefix.assign(s.num_ranks, 0);
    a.recv_capacity = cap;
    a.recv_x = recv_x.data();
    a.recv_scales = fp8 ? recv_scales.data() : nullptr;
    a.recv_topk_idx = recv_idx.data();
    a.recv_topk_weights = recv_w.data();
    a.recv_tokens_per_expert = per_expert.data();
    a.recv_src_info = src_info.data();
    a.send_pos = send_pos.data();
    a.rank_prefix = rank_prefix.data();
  }
};

/// One rank's expected outputs of a low-latency dispatch: x as bytes (bf16 or e4m3), scales
/// as f32 (or, with UE8M0, the int32 words in the same bytes).
struct LowLatencyRef {
  std::vector<uint8_t> x;
  std::vector<float> scales;
  std::vector<int32_t> count, src, pos;
  void Bind(const kernels::GroupShape& s, bool fp8, kernels::host::LowLatencyDispatchRankArgs& a) {
    const int64_t rows = int64_t(s.num_local_experts()) * s.ll_rows_per_expert();
    x.assign(size_t(rows) * s.hidden * (fp8 ? 1 : 2), 0);
    scales.assign(fp8 ? size_t(rows) * s.num_scales() : 0, 0);
    count.assign(s.num_local_experts(), 0);
    src.assign(size_t(rows), 0);
    pos.assign(size_t(s.ll_max_tokens_per_rank) * s.num_topk, 0);
    a.recv_x = x.data();
    a.recv_scales = fp8 ? scales.data() : nullptr;
    a.recv_count = count.data();
    a.recv_src_info = src.data();
    a.handle_pos = pos.data();
  }
};

/// "" when the `n` elements at `actual` equal `expected` byte for byte; otherwise the first
/// difference ("element i of n: got a, want b"), or "no data" for a null `actual`.
template <typename T>
std::string FirstDifference(const void* actual, const T* expected, int64_t n) {
  if (n <= 0) return "";
  if (actual == nullptr) return absl::StrCat("no data (", n, " elements expected)");
  const T* a = static_cast<const T*>(actual);
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(&a[i], &expected[i], sizeof(T)) != 0) {
      return absl::StrCat("element ", i, " of ", n, ": got ", +a[i], ", want ", +expected[i]);
    }
  }
  return "";
}

}  // namespace epd::testing
