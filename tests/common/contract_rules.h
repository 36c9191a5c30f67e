// The rules of the client API that client.h and DESIGN.md §3.3 state beyond "the host's
// results", checked through the public API on any backend and launch mode with values
// worked out by hand (not by kernels/host): duplicate experts in a top-k row (sent once,
// counted once by GetDispatchLayout, Dispatch and LowLatencyDispatch; both combines add
// every k with its own weight), is_token_in_rank's dtype, recv_topk_weights of a Dispatch
// given no topk_weights, the outputs of a cached re-dispatch, an empty sum (+0), and the
// FP8 scale floor of LowLatencyDispatch. Used by tests/unit/host_data_plane_test.cc (host
// backend) and tests/gpu/client_launch_test.cc (CUDA, both launch modes).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "epd/client.h"
#include "epd/kernels/types.h"
#include "tests/common/dtypes.h"
#include "tests/common/specs.h"

namespace epd::testing::contract {

// The group: R = 2 (experts 0, 1 at rank 0; 2, 3 at rank 1), H = 256 (two FP8 blocks).
inline constexpr int kR = 2, kE = 4, kH = 256, kK = 4, kM = 8;

inline v1::GroupSpec Spec(const std::string& name) {
  return MakeSpec(name, {.num_ranks = kR,
                         .num_experts = kE,
                         .hidden = kH,
                         .num_topk = kK,
                         .max_tokens_per_rank = kM,
                         .ll_max_tokens_per_rank = kM,
                         .use_fp8 = true});
}

/// Reads a result view's bytes (host memory, or the CUDA backend's device memory).
using ViewReader = std::function<std::vector<uint8_t>(const TensorView&)>;

template <typename T>
std::vector<T> Read(const ViewReader& read, const TensorView& v) {
  const std::vector<uint8_t> bytes = read(v);
  std::vector<T> out(bytes.size() / sizeof(T));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
  return out;
}

/// One rank's inputs (host memory: every backend stages them).
struct RankInputs {
  int T = 0;
  std::vector<int64_t> idx;           // [T, K]
  std::vector<float> w;               // [T, K]
  std::vector<kernels::bf16_bits> x;  // [T, H]
  std::vector<int64_t> xs, ks;
  DLTensor x_t{}, idx_t{}, w_t{};
};

/// Rank 0: t0 = {1, 1, 3, -1} (expert 1 twice), t1 = no expert, t2 = {0, 2, 0, 0} (expert 0
/// three times); its t0's first 128 channels are tiny (|x| ~ 1e-12). Rank 1: t0 = {2, 3, 2,
/// 1}, t1 = {3, -1, 3, -1}. Weights and values are exact binary fractions; `salt` changes x.
inline std::vector<RankInputs> Inputs(float salt = 0.0f) {
  const std::vector<std::vector<int64_t>> idx = {{1, 1, 3, -1, -1, -1, -1, -1, 0, 2, 0, 0},
                                                 {2, 3, 2, 1, 3, -1, 3, -1}};
  std::vector<RankInputs> in(kR);
  for (int r = 0; r < kR; ++r) {
    RankInputs& ri = in[r];
    ri.idx = idx[r];
    ri.T = static_cast<int>(ri.idx.size()) / kK;
    for (int t = 0; t < ri.T; ++t) {
      for (int k = 0; k < kK; ++k) ri.w.push_back(0.25f * (k + 1) + 0.125f * r + 0.0625f * t);
      for (int h = 0; h < kH; ++h) {
        const float v = r == 0 && t == 0 && h < 128
                            ? 1e-12f * static_cast<float>(1 + h % 4)
                            : ((h % 13) - 6) * 0.25f + 0.5f * r + 0.125f * t + salt;
        ri.x.push_back(kernels::FloatToBf16(v));
      }
    }
    ri.xs = {ri.T, kH};
    ri.ks = {ri.T, kK};
    ri.x_t = MakeDLTensor(ri.x.data(), kBf16, ri.xs);
    ri.idx_t = MakeDLTensor(ri.idx.data(), kI64, ri.ks);
    ri.w_t = MakeDLTensor(ri.w.data(), kF32, ri.ks);
  }
  return in;
}

/// Submits `submit(r)` on every rank (none waits for its peers), then waits for each.
template <typename Result, typename Submit>
std::vector<Result> OnRanks(Submit submit) {
  std::vector<std::optional<PendingOp<Result>>> ops(kR);
  for (int r = 0; r < kR; ++r) {
    auto op = submit(r);
    EXPECT_TRUE(op.ok()) << "rank " << r << ": " << op.status();
    if (op.ok()) ops[r] = *op;
  }
  std::vector<Result> results(kR);
  for (int r = 0; r < kR; ++r) {
    if (!ops[r]) continue;
    auto res = ops[r]->Wait(absl::Seconds(30));
    EXPECT_TRUE(res.ok()) << "rank " << r << ": " << res.status();
    if (res.ok()) results[r] = *res;
  }
  return results;
}

/// f32(bf16(x)) of token t of rank r, channel h.
inline float X(const std::vector<RankInputs>& in, int r, int t, int h) {
  return kernels::Bf16ToFloat(in[r].x[static_cast<size_t>(t) * kH + h]);
}

/// Runs every rule's ops on `eps` (both ranks of a group of Spec(), held by this thread)
/// and checks them.
inline void CheckContractRules(const std::vector<Endpoint*>& eps, const ViewReader& read) {
  ASSERT_EQ(static_cast<int>(eps.size()), kR);
  std::vector<RankInputs> in = Inputs();

  // ---- GetDispatchLayout: is_token_in_rank is kU8 (tests/common/dtypes.h); duplicates count once.
  std::vector<LayoutResult> layout =
      OnRanks<LayoutResult>([&](int r) { return eps[r]->GetDispatchLayout(in[r].idx_t, nullptr); });
  const std::vector<std::vector<int32_t>> per_rank = {{2, 2}, {1, 2}};
  const std::vector<std::vector<int32_t>> per_expert = {{1, 1, 1, 1}, {0, 1, 1, 2}};
  const std::vector<std::vector<uint8_t>> in_rank = {{1, 1, 0, 0, 1, 1}, {1, 1, 0, 1}};
  for (int r = 0; r < kR; ++r) {
    const DLDataType dt = layout[r].is_token_in_rank.dl().dtype;
    EXPECT_TRUE(dt.code == kDLUInt && dt.bits == 8 && dt.lanes == 1) << "rank " << r;
    EXPECT_EQ(Read<int32_t>(read, layout[r].num_tokens_per_rank), per_rank[r]) << "rank " << r;
    EXPECT_EQ(Read<int32_t>(read, layout[r].num_tokens_per_expert), per_expert[r]) << "rank " << r;
    EXPECT_EQ(Read<uint8_t>(read, layout[r].is_token_in_rank), in_rank[r]) << "rank " << r;
  }

  // Rank 0 receives r0t0, r0t2, r1t0 (src_info = src_rank * M + t); rank 1 r0t0, r0t2,
  // r1t0, r1t1. Per local expert (duplicates once): rank 0 {1, 2}, rank 1 {2, 3}.
  const std::vector<std::vector<int32_t>> src_info = {{0, 2, kM}, {0, 2, kM, kM + 1}};
  const std::vector<std::vector<int32_t>> recv_per_expert = {{1, 2}, {2, 3}};

  // ---- A cached re-dispatch's recv_topk_idx, recv_topk_weights and
  // num_recv_tokens_per_expert are the routing dispatch's views, not rewritten (its own
  // topk_weights are not read); recv_x holds the new x.
  std::vector<DispatchResult> routing = OnRanks<DispatchResult>([&](int r) {
    DispatchArgs a;
    a.x = &in[r].x_t;
    a.topk_idx = &in[r].idx_t;
    a.topk_weights = &in[r].w_t;
    return eps[r]->Dispatch(a);
  });
  std::vector<std::vector<uint8_t>> kept_idx(kR), kept_w(kR), kept_count(kR);
  for (int r = 0; r < kR; ++r) {
    kept_idx[r] = read(routing[r].recv_topk_idx);
    kept_w[r] = read(routing[r].recv_topk_weights);
    kept_count[r] = read(routing[r].num_recv_tokens_per_expert);
  }
  std::vector<RankInputs> again = Inputs(/*salt=*/1.0f);
  for (RankInputs& ri : again) {
    for (float& w : ri.w) w += 8.0f;
  }
  std::vector<DispatchResult> cached = OnRanks<DispatchResult>([&](int r) {
    DispatchArgs a;
    a.x = &again[r].x_t;
    a.topk_weights = &again[r].w_t;
    a.cached = routing[r].handle;
    return eps[r]->Dispatch(a);
  });
  for (int r = 0; r < kR; ++r) {
    EXPECT_EQ(cached[r].recv_topk_idx.data(), routing[r].recv_topk_idx.data()) << "rank " << r;
    EXPECT_EQ(cached[r].recv_topk_weights.data(), routing[r].recv_topk_weights.data());
    EXPECT_EQ(cached[r].num_recv_tokens_per_expert.data(),
              routing[r].num_recv_tokens_per_expert.data());
    EXPECT_EQ(read(cached[r].recv_topk_idx), kept_idx[r]) << "rank " << r;
    EXPECT_EQ(read(cached[r].recv_topk_weights), kept_w[r]) << "rank " << r;
    EXPECT_EQ(read(cached[r].num_recv_tokens_per_expert), kept_count[r]) << "rank " << r;
    const std::vector<kernels::bf16_bits> rx = Read<kernels::bf16_bits>(read, cached[r].recv_x);
    for (size_t i = 0; i < src_info[r].size(); ++i) {
      const int src = src_info[r][i] / kM, t = src_info[r][i] % kM;
      EXPECT_EQ(std::memcmp(rx.data() + i * kH, again[src].x.data() + static_cast<size_t>(t) * kH,
                            kH * 2),
                0)
          << "rank " << r << " row " << i;
    }
  }

  // ---- Dispatch without topk_weights (after one with them): recv_topk_weights is zeros;
  // a duplicate is sent once and counted once.
  std::vector<DispatchResult> d = OnRanks<DispatchResult>([&](int r) {
    DispatchArgs a;
    a.x = &in[r].x_t;
    a.topk_idx = &in[r].idx_t;
    return eps[r]->Dispatch(a);
  });
  for (int r = 0; r < kR; ++r) {
    ASSERT_EQ(d[r].num_recv_tokens, static_cast<int>(src_info[r].size())) << "rank " << r;
    EXPECT_EQ(Read<int32_t>(read, d[r].num_recv_tokens_per_expert), recv_per_expert[r]);
    EXPECT_EQ(Read<int32_t>(read, d[r].recv_src_info), src_info[r]) << "rank " << r;
    const std::vector<uint8_t> w = read(d[r].recv_topk_weights);
    EXPECT_EQ(w, std::vector<uint8_t>(static_cast<size_t>(d[r].num_recv_tokens) * kK * 4, 0))
        << "rank " << r << ": recv_topk_weights of a Dispatch without topk_weights";
  }

  // ---- Combine of the received rows (each rank returns them as they came): a token sent
  // nowhere (rank 0's t1) is +0 (bits 0x0000) in every channel and weight; r0t0 went to
  // both ranks: 2 x.
  std::vector<CombineResult> c = OnRanks<CombineResult>([&](int r) {
    CombineArgs a;
    a.x = &d[r].recv_x.dl();
    a.handle = &d[r].handle;
    a.topk_weights = &d[r].recv_topk_weights.dl();
    return eps[r]->Combine(a);
  });
  {
    const std::vector<kernels::bf16_bits> out = Read<kernels::bf16_bits>(read, c[0].combined_x);
    ASSERT_EQ(out.size(), static_cast<size_t>(in[0].T) * kH);
    for (int h = 0; h < kH; ++h) {
      EXPECT_EQ(out[kH + h], 0) << "empty sum, channel " << h;
      EXPECT_EQ(out[h], kernels::FloatToBf16(2.0f * X(in, 0, 0, h))) << "r0t0 channel " << h;
    }
    const std::vector<uint8_t> cw = read(c[0].combined_topk_weights);
    EXPECT_EQ(std::vector<uint8_t>(cw.begin() + kK * 4, cw.begin() + 2 * kK * 4),
              std::vector<uint8_t>(kK * 4, 0));
  }

  // ---- LowLatencyDispatch (BF16), duplicates sent once; LowLatencyCombine of the received
  // rows adds every k with its own weight, in ascending k, each product rounded to f32,
  // from +0; an empty row is +0.
  auto low_latency_dispatch = [&](bool use_fp8) {
    return OnRanks<LowLatencyDispatchResult>([&](int r) {
      LowLatencyDispatchArgs a;
      a.x = &in[r].x_t;
      a.topk_idx = &in[r].idx_t;
      a.use_fp8 = use_fp8;
      return eps[r]->LowLatencyDispatch(a);
    });
  };
  std::vector<LowLatencyDispatchResult> ll = low_latency_dispatch(/*use_fp8=*/false);
  for (int r = 0; r < kR; ++r) {
    EXPECT_EQ(Read<int32_t>(read, ll[r].recv_count), recv_per_expert[r]) << "rank " << r;
  }
  std::vector<LowLatencyCombineResult> llc = OnRanks<LowLatencyCombineResult>([&](int r) {
    LowLatencyCombineArgs a;
    a.x = &ll[r].recv_x.dl();
    a.topk_idx = &in[r].idx_t;
    a.topk_weights = &in[r].w_t;
    a.handle = &ll[r].handle;
    return eps[r]->LowLatencyCombine(a);
  });
  for (int r = 0; r < kR; ++r) {
    const std::vector<kernels::bf16_bits> out = Read<kernels::bf16_bits>(read, llc[r].combined_x);
    ASSERT_EQ(out.size(), static_cast<size_t>(in[r].T) * kH);
    for (int t = 0; t < in[r].T; ++t) {
      for (int h = 0; h < kH; ++h) {
        float acc = 0.0f;
        for (int k = 0; k < kK; ++k) {
          if (in[r].idx[t * kK + k] < 0) continue;
          const volatile float product = in[r].w[t * kK + k] * X(in, r, t, h);
          acc = acc + product;
        }
        EXPECT_EQ(out[static_cast<size_t>(t) * kH + h], kernels::FloatToBf16(acc))
            << "rank " << r << " t " << t << " h " << h;
        if (::testing::Test::HasFailure()) return;
      }
    }
  }

  // ---- FP8: scale = max(amax, 1e-4) / 448. r0t0's first block (|x| ~ 1e-12) gets
  // 1e-4 / 448 and quantises to zeros; its second block amax / 448.
  std::vector<LowLatencyDispatchResult> fp8 = low_latency_dispatch(/*use_fp8=*/true);
  // Rank 0's local expert 1 (global 1): its first row is r0t0 (src_info 0).
  const int64_t rows = int64_t{kR} * kM, row = 1 * rows;
  const std::vector<int32_t> src = Read<int32_t>(read, fp8[0].recv_src_info);
  ASSERT_EQ(src.size(), static_cast<size_t>(2 * rows));
  ASSERT_EQ(src[row], 0);
  const std::vector<uint8_t> q = read(fp8[0].recv_x);
  // Scales are stored token index fastest: [E/R, R*Mll, S] with strides {S*R*Mll, 1, R*Mll}.
  const std::vector<float> scales = Read<float>(read, fp8[0].recv_scales);
  const TensorShape& strides = fp8[0].recv_scales.strides();
  ASSERT_EQ(fp8[0].recv_scales.shape(), (std::vector<int64_t>{2, rows, 2}));
  ASSERT_EQ(strides, (std::vector<int64_t>{2 * rows, 1, rows}));
  ASSERT_EQ(fp8[0].recv_scales.dl().strides, strides.data());
  auto scale = [&](int64_t j, int64_t i, int64_t g) {
    return scales[j * strides[0] + i * strides[1] + g * strides[2]];
  };
  float amax = 0.0f;
  for (int h = 128; h < kH; ++h) amax = std::max(amax, std::fabs(X(in, 0, 0, h)));
  EXPECT_EQ(scale(1, 0, 0), 1e-4f / 448.0f);
  EXPECT_EQ(scale(1, 0, 1), amax / 448.0f);
  for (int h = 0; h < 128; ++h) {
    EXPECT_EQ(kernels::E4m3ToFloat(q[row * kH + h]), 0.0f) << "channel " << h;
  }
}

}  // namespace epd::testing::contract
