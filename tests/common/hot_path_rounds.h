// The per-round op scenario of the hot-path allocation tests
// (tests/unit/hot_path_alloc_test.cc on the host backend, tests/gpu/cuda_hot_path_alloc_test.cc
// on the CUDA backend): the op kinds measured, the routed inputs each rank sends, and one
// round of ops run from one thread on every rank's endpoint (GetDispatchLayout, Dispatch,
// Combine of the received rows through identity experts, Dispatch with the cached handle,
// optionally an FP8 Dispatch, LowLatencyDispatch, LowLatencyCombine, FP8 LowLatencyDispatch).
// Each test keeps its own way of counting: RunRound calls the test's `run` for every op.
#pragma once

#include <dlpack/dlpack.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "epd/client.h"
#include "epd/kernels/types.h"
#include "tests/common/dtypes.h"

namespace epd::testing::hot_path {

/// The op kinds measured, in the order one round runs them.
enum Kind {
  kLayout,
  kDispatch,
  kCombine,
  kCachedDispatch,
  kDispatchFp8,  ///< Only when RunRound's `fp8_dispatch` is set.
  kLowLatencyDispatch,
  kLowLatencyCombine,
  kLowLatencyDispatchFp8,
  kNumKinds
};
inline constexpr const char* kKindNames[kNumKinds] = {
    "GetDispatchLayout", "Dispatch",           "Combine",           "Dispatch(cached handle)",
    "Dispatch(fp8)",     "LowLatencyDispatch", "LowLatencyCombine", "LowLatencyDispatch(fp8)"};

/// A compact row-major 2-D DLTensor over `data` [shape[0], shape[1]] of `dtype` on `device`;
/// it points at `shape`, which must outlive it.
inline DLTensor Tensor2d(void* data, DLDataType dtype, std::array<int64_t, 2>& shape,
                         DLDevice device = {kDLCPU, 0}) {
  DLTensor t{};
  t.data = data;
  t.device = device;
  t.ndim = 2;
  t.dtype = dtype;
  t.shape = shape.data();
  return t;
}

/// Fills rank `rank`'s routed tokens: x [T, H] bf16 in [0, 2) from `rng`; topk_idx [T, K]
/// int64 = (t * 5 + k * (E / K) + rank) % E (distinct experts per row when K divides E), with
/// k = 3 masked (-1) on every third row; topk_weights [T, K] f32 = 0.25.
inline void FillRoutedTokens(int T, int H, int K, int E, int rank, std::mt19937& rng,
                             std::vector<kernels::bf16_bits>& x, std::vector<int64_t>& idx,
                             std::vector<float>& w) {
  x.resize(size_t(T) * H);
  for (size_t i = 0; i < x.size(); ++i) x[i] = kernels::FloatToBf16((rng() % 200) / 100.f);
  idx.resize(size_t(T) * K);
  w.resize(idx.size());
  for (int t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      idx[size_t(t) * K + k] = (k == 3 && t % 3 == 0) ? -1 : (t * 5 + k * (E / K) + rank) % E;
      w[size_t(t) * K + k] = 0.25f;
    }
  }
}

/// Keeps a submitted op in `slot`; its error otherwise.
template <typename Result>
absl::Status Keep(absl::StatusOr<PendingOp<Result>> op, std::optional<PendingOp<Result>>& slot) {
  if (!op.ok()) return op.status();
  slot.emplace(std::move(*op));
  return absl::OkStatus();
}

/// Waits (up to `timeout`) for the op kept in `slot` and stores its result in `out`.
template <typename Result>
absl::Status WaitInto(std::optional<PendingOp<Result>>& slot, Result& out, absl::Duration timeout) {
  absl::StatusOr<Result> res = slot->Wait(timeout);
  if (!res.ok()) return res.status();
  out = std::move(*res);
  return absl::OkStatus();
}

/// One op of a kind on ranks 0..R-1 from the calling thread: after a 2 ms pause when `pause`
/// (longer than the engine's idle_us, so its sleep and wake-up are measured too), submit(r)
/// on every rank (an op call does not wait for the peers), then wait(r) on every rank;
/// stops at the first error and returns it.
template <typename Submit, typename Wait>
absl::Status SubmitThenWaitAll(int R, bool pause, Submit& submit, Wait& wait) {
  if (pause) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  absl::Status st;
  for (int r = 0; r < R && st.ok(); ++r) st = submit(r);
  for (int r = 0; r < R && st.ok(); ++r) st = wait(r);
  return st;
}

/// One rank's inputs to a round (the tensors live in the test). Normal ops: x [T, H] bf16,
/// topk_idx and topk_weights [T, K]; with RunRound's `fp8_dispatch`, also x8 [T, H] e4m3
/// and scales [T, H / 128] f32. Low-latency ops: the first Tll rows of the same data.
struct RoundInputs {
  const DLTensor* x = nullptr;
  const DLTensor* x8 = nullptr;
  const DLTensor* scales = nullptr;
  const DLTensor* topk_idx = nullptr;
  const DLTensor* topk_weights = nullptr;
  const DLTensor* x_ll = nullptr;
  const DLTensor* topk_idx_ll = nullptr;
  const DLTensor* topk_weights_ll = nullptr;
};

/// Every rank's pending ops and results, kept across rounds so the rounds only reuse them,
/// and each rank's low-latency combine input.
struct RoundOps {
  explicit RoundOps(std::span<const std::unique_ptr<Endpoint>> eps)
      : RoundOps(static_cast<int>(eps.size())) {
    for (const auto& ep : eps) ll_y.push_back(ep->LowLatencyCombineInput());
  }
  explicit RoundOps(int R)
      : p_layout(R),
        p_dispatch(R),
        p_combine(R),
        p_ll_dispatch(R),
        p_ll_combine(R),
        layout(R),
        dispatch(R),
        cached(R),
        dispatch_fp8(R),
        combine(R),
        ll_dispatch(R),
        ll_dispatch_fp8(R),
        ll_combine(R) {}
  std::vector<std::optional<PendingOp<LayoutResult>>> p_layout;
  std::vector<std::optional<PendingOp<DispatchResult>>> p_dispatch;
  std::vector<std::optional<PendingOp<CombineResult>>> p_combine;
  std::vector<std::optional<PendingOp<LowLatencyDispatchResult>>> p_ll_dispatch;
  std::vector<std::optional<PendingOp<LowLatencyCombineResult>>> p_ll_combine;
  std::vector<LayoutResult> layout;
  std::vector<DispatchResult> dispatch, cached, dispatch_fp8;
  std::vector<CombineResult> combine;
  std::vector<LowLatencyDispatchResult> ll_dispatch, ll_dispatch_fp8;
  std::vector<LowLatencyCombineResult> ll_combine;
  /// The experts' low-latency outputs of each rank, where its combine reads them (no copy):
  /// Endpoint::LowLatencyCombineInput().
  std::vector<TensorView> ll_y;
  /// The first error of each kind (set by the test's `run`; the error path may allocate).
  std::vector<absl::Status> errors = std::vector<absl::Status>(kNumKinds);
};

/// Runs one round on every rank of `eps`, each op kind through
/// `run(kind, measured, pause, submit, wait)`, where submit(r) and wait(r) return the rank's
/// absl::Status (the test's `run` brackets them with its counting). The order: layout,
/// Dispatch (bf16, weights, expert_alignment 4), Combine of the received rows (identity
/// experts, with their weights), Dispatch with the cached handle, Dispatch(fp8) when
/// `fp8_dispatch`, LowLatencyDispatch (bf16), LowLatencyCombine of `ops.ll_y`,
/// LowLatencyDispatch(fp8). Waits are bounded by `wait_timeout`.
template <typename Run>
void RunRound(std::span<const std::unique_ptr<Endpoint>> eps, std::span<const RoundInputs> in,
              RoundOps& ops, bool fp8_dispatch, absl::Duration wait_timeout, bool measured,
              bool pause, Run& run) {
  run(
      kLayout, measured, pause,
      [&](int r) -> absl::Status {
        return Keep(eps[r]->GetDispatchLayout(*in[r].topk_idx), ops.p_layout[r]);
      },
      [&](int r) { return WaitInto(ops.p_layout[r], ops.layout[r], wait_timeout); });
  // Normal dispatch (bf16, with weights), its combine, a cached re-dispatch, FP8.
  for (Kind kind : {kDispatch, kCachedDispatch, kDispatchFp8}) {
    if (kind == kDispatchFp8 && !fp8_dispatch) continue;
    std::vector<DispatchResult>& out = kind == kDispatch         ? ops.dispatch
                                       : kind == kCachedDispatch ? ops.cached
                                                                 : ops.dispatch_fp8;
    run(
        kind, measured, pause,
        [&](int r) -> absl::Status {
          DispatchArgs a;
          a.x = kind == kDispatchFp8 ? in[r].x8 : in[r].x;
          a.x_scales = kind == kDispatchFp8 ? in[r].scales : nullptr;
          a.topk_idx = in[r].topk_idx;
          a.topk_weights = kind == kDispatch ? in[r].topk_weights : nullptr;
          a.expert_alignment = 4;
          if (kind == kCachedDispatch) a.cached = ops.dispatch[r].handle;
          return Keep(eps[r]->Dispatch(a), ops.p_dispatch[r]);
        },
        [&](int r) { return WaitInto(ops.p_dispatch[r], out[r], wait_timeout); });
    if (kind != kDispatch) continue;
    run(
        kCombine, measured, pause,
        [&](int r) -> absl::Status {
          CombineArgs a;
          a.x = &ops.dispatch[r].recv_x.dl();  // Identity experts.
          a.topk_weights = &ops.dispatch[r].recv_topk_weights.dl();
          a.handle = &ops.dispatch[r].handle;
          return Keep(eps[r]->Combine(a), ops.p_combine[r]);
        },
        [&](int r) { return WaitInto(ops.p_combine[r], ops.combine[r], wait_timeout); });
  }
  // Low-latency dispatch (bf16), its combine, then an FP8 low-latency dispatch.
  for (Kind kind : {kLowLatencyDispatch, kLowLatencyDispatchFp8}) {
    std::vector<LowLatencyDispatchResult>& out =
        kind == kLowLatencyDispatch ? ops.ll_dispatch : ops.ll_dispatch_fp8;
    run(
        kind, measured, pause,
        [&](int r) -> absl::Status {
          LowLatencyDispatchArgs a;
          a.x = in[r].x_ll;
          a.topk_idx = in[r].topk_idx_ll;
          a.use_fp8 = kind == kLowLatencyDispatchFp8;
          return Keep(eps[r]->LowLatencyDispatch(a), ops.p_ll_dispatch[r]);
        },
        [&](int r) { return WaitInto(ops.p_ll_dispatch[r], out[r], wait_timeout); });
    if (kind != kLowLatencyDispatch) continue;
    run(
        kLowLatencyCombine, measured, pause,
        [&](int r) -> absl::Status {
          LowLatencyCombineArgs a;
          a.x = &ops.ll_y[r].dl();
          a.topk_idx = in[r].topk_idx_ll;
          a.topk_weights = in[r].topk_weights_ll;
          a.handle = &ops.ll_dispatch[r].handle;
          return Keep(eps[r]->LowLatencyCombine(a), ops.p_ll_combine[r]);
        },
        [&](int r) { return WaitInto(ops.p_ll_combine[r], ops.ll_combine[r], wait_timeout); });
  }
}

/// Expects no op of the rounds to have failed (`ops.errors`, named by kind).
inline void ExpectNoRoundErrors(const RoundOps& ops) {
  for (int k = 0; k < kNumKinds; ++k) {
    EXPECT_TRUE(ops.errors[k].ok()) << kKindNames[k] << ": " << ops.errors[k];
  }
}

/// Expects rank `r`'s last results (not a vacuous pass) to match its inputs: layout over T
/// tokens, a dispatch that received rows, the cached re-dispatch the same N, with
/// `fp8_dispatch` the FP8 dispatch's scales for its N rows; low-latency views over E / R
/// local experts (FP8 scales over H / 128 channel blocks) and a combine of Tll tokens. The
/// normal combine is each test's own (ExpectIdentityCombine on its host copy).
inline void ExpectRoundResults(const RoundOps& ops, int r, int T, int Tll, int E, int R, int H,
                               bool fp8_dispatch) {
  EXPECT_EQ(ops.layout[r].is_token_in_rank.shape()[0], T);
  EXPECT_GT(ops.dispatch[r].num_recv_tokens, 0) << "rank " << r;
  EXPECT_EQ(ops.cached[r].num_recv_tokens, ops.dispatch[r].num_recv_tokens) << "rank " << r;
  if (fp8_dispatch) {
    EXPECT_EQ(ops.dispatch_fp8[r].recv_scales.shape()[0], ops.dispatch_fp8[r].num_recv_tokens);
  }
  EXPECT_EQ(ops.ll_dispatch[r].recv_x.shape()[0], E / R);
  EXPECT_EQ(ops.ll_dispatch_fp8[r].recv_scales.shape()[2], H / 128);
  EXPECT_EQ(ops.ll_combine[r].combined_x.shape()[0], Tll);
}

/// Asserts rank `rank`'s normal combine of identity experts: combined [T, H] bf16 (host
/// memory) = x[t] times the number of ranks (of R, E / R experts each) token t went to
/// through idx [T, K] (exact in f32, rounded once to bf16). Fatal failure at the first wrong
/// element (call through ASSERT_NO_FATAL_FAILURE).
inline void ExpectIdentityCombine(int rank, int T, int H, int K, int E, int R,
                                  const std::vector<kernels::bf16_bits>& x,
                                  const std::vector<int64_t>& idx,
                                  const kernels::bf16_bits* combined) {
  for (int t = 0; t < T; ++t) {
    std::vector<bool> to(R, false);
    for (int k = 0; k < K; ++k) {
      const int64_t e = idx[size_t(t) * K + k];
      if (e >= 0) to[e / (E / R)] = true;
    }
    const float n = static_cast<float>(std::count(to.begin(), to.end(), true));
    for (int h = 0; h < H; ++h) {
      const float xv = kernels::Bf16ToFloat(x[size_t(t) * H + h]);
      ASSERT_EQ(combined[size_t(t) * H + h], kernels::FloatToBf16(n * xv))
          << "rank " << rank << " token " << t << " channel " << h;
    }
  }
}

}  // namespace epd::testing::hot_path
