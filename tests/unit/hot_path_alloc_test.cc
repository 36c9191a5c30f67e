// The hot path allocates nothing (issue 4: "no gRPC, no allocation, no host synchronisation
// per op"; README "Hot path"). A host-backend group runs in this process (HostDataPlane +
// endpoints opened by the real client code, internal::OpenEndpoint); after a warm-up,
// every op kind runs kRounds more times, and the heap allocations made meanwhile are
// counted on the client's calling thread (the test thread, which drives every rank's
// endpoint) and on the daemon's engine thread, per op kind.
//
// Counting (tests/common/counting_new.h, whose replacement operators this file defines for
// the whole epd_unit_tests binary; they only count and forward to malloc/free): every global
// operator new / new[] (plain, nothrow, aligned, aligned + nothrow) counts into a
// thread_local counter; the engine thread marks itself through
// HostDataPlaneOptions::on_engine_start, and its allocations go to a global atomic (outside
// kernels/host) or to a second one (inside kernels/host, bracketed by
// HostDataPlaneOptions::on_kernels; kernels/host's worker threads, marked through
// HostDataPlaneOptions::on_kernel_thread_start, count there too). Both must stay 0: the
// reference data movement runs on the plane's persistent worker pool with the group's
// persistent scratch. Allocations made through malloc directly (not through operator new)
// are not counted.
#include <dlpack/dlpack.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <new>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/endpoint_internal.h"
#include "daemon/host_data_plane.h"
#include "epd/client.h"
#include "epd/kernels/types.h"
#define EPD_COUNTING_NEW_DEFINE_OPERATORS
#include "tests/common/counting_new.h"

namespace epd {
namespace {

using kernels::bf16_bits;
namespace counting_new = testing::counting_new;
using counting_new::g_engine_allocs;
using counting_new::g_kernel_allocs;
using counting_new::t_allocs;

constexpr DLDataType kBf16{kDLBfloat, 16, 1};
constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kI64{kDLInt, 64, 1};

/// The op kinds measured, in the order one round runs them.
enum Kind {
  kLayout,
  kDispatch,
  kCombine,
  kCachedDispatch,
  kDispatchFp8,
  kLowLatencyDispatch,
  kLowLatencyCombine,
  kLowLatencyDispatchFp8,
  kNumKinds
};
constexpr const char* kKindNames[kNumKinds] = {
    "GetDispatchLayout", "Dispatch",           "Combine",           "Dispatch(cached handle)",
    "Dispatch(fp8)",     "LowLatencyDispatch", "LowLatencyCombine", "LowLatencyDispatch(fp8)"};

/// One rank's inputs, with DLTensors built once (their shape arrays live here).
struct RankInputs {
  int T = 0;    ///< Tokens of the normal ops.
  int Tll = 0;  ///< Tokens of the low-latency ops (the first Tll rows of the same data).
  std::vector<bf16_bits> x;
  std::vector<uint8_t> x8;  ///< e4m3 bytes (moved as is by a normal dispatch).
  std::vector<float> scales, w;
  std::vector<int64_t> idx;
  std::array<int64_t, 2> xs{}, ss{}, ks{}, xs_ll{}, ks_ll{};
  DLTensor x_t{}, x8_t{}, scales_t{}, idx_t{}, w_t{}, x_ll{}, idx_ll{}, w_ll{};
};

DLTensor Tensor(void* data, DLDataType dtype, std::array<int64_t, 2>& shape) {
  DLTensor t{};
  t.data = data;
  t.device = {kDLCPU, 0};
  t.ndim = 2;
  t.dtype = dtype;
  t.shape = shape.data();
  return t;
}

/// Keeps a submitted op in `slot`; its error otherwise.
template <typename Result>
absl::Status Keep(absl::StatusOr<PendingOp<Result>> op, std::optional<PendingOp<Result>>& slot) {
  if (!op.ok()) return op.status();
  slot.emplace(std::move(*op));
  return absl::OkStatus();
}

/// Waits for the op kept in `slot` and stores its result in `out`.
template <typename Result>
absl::Status WaitInto(std::optional<PendingOp<Result>>& slot, Result& out) {
  absl::StatusOr<Result> res = slot->Wait();
  if (!res.ok()) return res.status();
  out = std::move(*res);
  return absl::OkStatus();
}

TEST(HotPathAllocTest, SteadyOpsAllocateNothingOnClientThreadOrEngineThread) {
  constexpr int R = 4, E = 16, H = 256, K = 4, M = 32, Mll = 16;
  constexpr int kWarmupRounds = 3, kRounds = 20;
  counting_new::t_client = true;

  std::atomic<bool> engine_marked{false};
  HostDataPlaneOptions o;
  o.op_timeout_ms = 10000;
  o.host_threads = 2;
  o.on_engine_start = [&engine_marked] {
    // Also a probe: proves the engine thread's allocations are counted.
    counting_new::MarkEngineThread();
    engine_marked = true;
  };
  o.on_kernels = [](bool entering) { counting_new::t_in_kernels = entering; };
  o.on_kernel_thread_start = [] {
    // kernels/host's worker threads: all their allocations count as inside kernels/host.
    counting_new::t_engine = true;
    counting_new::t_in_kernels = true;
  };
  auto plane = MakeHostDataPlane(o);
  ASSERT_TRUE(plane.ok()) << plane.status();
  const auto marked_by = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!engine_marked && std::chrono::steady_clock::now() < marked_by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(engine_marked) << "the engine thread never ran on_engine_start";
  ASSERT_GE(g_engine_allocs.load(), 1u) << "the engine thread's probe allocation was not counted";
  ASSERT_TRUE(counting_new::CountingNewInForce()) << "the counting operator new is not in force";

  v1::GroupSpec spec;
  spec.set_name("hot-path");
  spec.set_num_ranks(R);
  spec.set_num_experts(E);
  spec.set_hidden(H);
  spec.set_num_topk(K);
  spec.set_max_tokens_per_rank(M);
  spec.set_ll_max_tokens_per_rank(Mll);
  spec.set_use_fp8(true);
  auto group_or = (*plane)->CreateGroup(spec);
  ASSERT_TRUE(group_or.ok()) << group_or.status();
  std::unique_ptr<DataPlaneGroup> group = std::move(*group_or);
  std::vector<std::unique_ptr<Endpoint>> eps;
  for (int r = 0; r < R; ++r) {
    v1::EndpointInfo info;
    ASSERT_TRUE(group->AttachRank(r, "", v1::LAUNCH_MODE_UNSPECIFIED, &info).ok());
    DataPlaneGroup* g = group.get();
    auto ep = internal::OpenEndpoint(info, spec, [g, r] {
      g->DetachRank(r);
      return absl::OkStatus();
    });
    ASSERT_TRUE(ep.ok()) << ep.status();
    eps.push_back(std::move(*ep));
  }

  std::vector<RankInputs> in(R);
  std::mt19937 rng(7);
  for (int r = 0; r < R; ++r) {
    RankInputs& d = in[r];
    d.T = 9 + 7 * r;  // 9, 16, 23, 30 <= M
    d.Tll = std::min(d.T, Mll);
    d.x.resize(size_t(d.T) * H);
    for (size_t i = 0; i < d.x.size(); ++i) d.x[i] = kernels::FloatToBf16((rng() % 200) / 100.f);
    d.x8.assign(size_t(d.T) * H, 0x38);  // e4m3 1.0
    d.scales.assign(size_t(d.T) * (H / 128), 0.5f);
    d.idx.resize(size_t(d.T) * K);
    d.w.resize(d.idx.size());
    for (int t = 0; t < d.T; ++t) {
      for (int k = 0; k < K; ++k) {
        d.idx[size_t(t) * K + k] = (k == 3 && t % 3 == 0) ? -1 : (t * 5 + k * 4 + r) % E;
        d.w[size_t(t) * K + k] = 0.25f;
      }
    }
    d.xs = {d.T, H};
    d.ss = {d.T, H / 128};
    d.ks = {d.T, K};
    d.xs_ll = {d.Tll, H};
    d.ks_ll = {d.Tll, K};
    d.x_t = Tensor(d.x.data(), kBf16, d.xs);
    d.x8_t = Tensor(d.x8.data(), kDLFloat8E4m3fn, d.xs);
    d.scales_t = Tensor(d.scales.data(), kF32, d.ss);
    d.idx_t = Tensor(d.idx.data(), kI64, d.ks);
    d.w_t = Tensor(d.w.data(), kF32, d.ks);
    d.x_ll = Tensor(d.x.data(), kBf16, d.xs_ll);
    d.idx_ll = Tensor(d.idx.data(), kI64, d.ks_ll);
    d.w_ll = Tensor(d.w.data(), kF32, d.ks_ll);
  }
  // The experts' low-latency outputs, written where the combine reads them (no copy).
  std::vector<TensorView> ll_y;
  for (int r = 0; r < R; ++r) ll_y.push_back(eps[r]->LowLatencyCombineInput());

  // Every result and pending op lives here, so the rounds below only reuse them.
  std::vector<std::optional<PendingOp<LayoutResult>>> p_layout(R);
  std::vector<std::optional<PendingOp<DispatchResult>>> p_dispatch(R);
  std::vector<std::optional<PendingOp<CombineResult>>> p_combine(R);
  std::vector<std::optional<PendingOp<LowLatencyDispatchResult>>> p_ll_dispatch(R);
  std::vector<std::optional<PendingOp<LowLatencyCombineResult>>> p_ll_combine(R);
  std::vector<LayoutResult> layout(R);
  std::vector<DispatchResult> dispatch(R), cached(R), dispatch_fp8(R);
  std::vector<CombineResult> combine(R);
  std::vector<LowLatencyDispatchResult> ll_dispatch(R), ll_dispatch_fp8(R);
  std::vector<LowLatencyCombineResult> ll_combine(R);
  std::vector<absl::Status> errors(kNumKinds);  // First error of each kind (error path only).

  std::array<uint64_t, kNumKinds> client_allocs{}, engine_allocs{}, kernel_allocs{};
  // First allocation sizes per kind, per thread (0 client, 1 engine).
  std::array<std::array<counting_new::RecordedSizes, 2>, kNumKinds> first_sizes{};
  std::array<bool, kNumKinds> sizes_taken{};
  uint64_t group_ops = group->ops_completed();
  bool engine_lagged = false;

  // Runs one op of `kind` on every rank: submit all (the host backend's Submit does not
  // wait for peers), then Wait all, then until the engine has finished the op. In every
  // other measured round the client first pauses for longer than the engine's idle_us,
  // so the engine's sleep and doorbell wake-up are measured too.
  auto run = [&](Kind kind, bool measured, bool pause, auto submit, auto wait) {
    const uint64_t c0 = t_allocs;
    const uint64_t e0 = g_engine_allocs.load();
    const uint64_t k0 = g_kernel_allocs.load();
    if (measured && !sizes_taken[kind]) counting_new::StartRecordingSizes();
    if (pause) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    absl::Status st;
    for (int r = 0; r < R && st.ok(); ++r) st = submit(r);
    for (int r = 0; r < R && st.ok(); ++r) st = wait(r);
    ++group_ops;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (group->ops_completed() < group_ops) {
      if (std::chrono::steady_clock::now() > deadline) {
        engine_lagged = true;
        break;
      }
    }
    counting_new::StopRecordingSizes();
    if (!st.ok() && errors[kind].ok()) errors[kind] = st;  // Error path: may allocate.
    if (!measured) return;
    client_allocs[kind] += t_allocs - c0;
    engine_allocs[kind] += g_engine_allocs.load() - e0;
    kernel_allocs[kind] += g_kernel_allocs.load() - k0;
    if (!sizes_taken[kind]) {
      sizes_taken[kind] = true;
      for (counting_new::Who who : {counting_new::kClientThread, counting_new::kEngineThread}) {
        first_sizes[kind][who] = counting_new::TakeRecordedSizes(who);
      }
    }
  };

  for (int round = 0; round < kWarmupRounds + kRounds; ++round) {
    const bool m = round >= kWarmupRounds;
    const bool pause = m && round % 2 == 1;
    run(
        kLayout, m, pause,
        [&](int r) -> absl::Status {
          return Keep(eps[r]->GetDispatchLayout(in[r].idx_t), p_layout[r]);
        },
        [&](int r) { return WaitInto(p_layout[r], layout[r]); });
    // Normal dispatch (bf16, with weights), its combine, a cached re-dispatch, FP8.
    for (Kind kind : {kDispatch, kCachedDispatch, kDispatchFp8}) {
      std::vector<DispatchResult>& out = kind == kDispatch         ? dispatch
                                         : kind == kCachedDispatch ? cached
                                                                   : dispatch_fp8;
      run(
          kind, m, pause,
          [&](int r) -> absl::Status {
            DispatchArgs a;
            a.x = kind == kDispatchFp8 ? &in[r].x8_t : &in[r].x_t;
            a.x_scales = kind == kDispatchFp8 ? &in[r].scales_t : nullptr;
            a.topk_idx = &in[r].idx_t;
            a.topk_weights = kind == kDispatch ? &in[r].w_t : nullptr;
            a.expert_alignment = 4;
            if (kind == kCachedDispatch) a.cached = dispatch[r].handle;
            return Keep(eps[r]->Dispatch(a), p_dispatch[r]);
          },
          [&](int r) { return WaitInto(p_dispatch[r], out[r]); });
      if (kind != kDispatch) continue;
      run(
          kCombine, m, pause,
          [&](int r) -> absl::Status {
            CombineArgs a;
            a.x = &dispatch[r].recv_x.dl();  // Identity experts.
            a.topk_weights = &dispatch[r].recv_topk_weights.dl();
            a.handle = &dispatch[r].handle;
            return Keep(eps[r]->Combine(a), p_combine[r]);
          },
          [&](int r) { return WaitInto(p_combine[r], combine[r]); });
    }
    // Low-latency dispatch (bf16), its combine, then an FP8 low-latency dispatch.
    for (Kind kind : {kLowLatencyDispatch, kLowLatencyDispatchFp8}) {
      std::vector<LowLatencyDispatchResult>& out =
          kind == kLowLatencyDispatch ? ll_dispatch : ll_dispatch_fp8;
      run(
          kind, m, pause,
          [&](int r) -> absl::Status {
            LowLatencyDispatchArgs a;
            a.x = &in[r].x_ll;
            a.topk_idx = &in[r].idx_ll;
            a.use_fp8 = kind == kLowLatencyDispatchFp8;
            return Keep(eps[r]->LowLatencyDispatch(a), p_ll_dispatch[r]);
          },
          [&](int r) { return WaitInto(p_ll_dispatch[r], out[r]); });
      if (kind != kLowLatencyDispatch) continue;
      run(
          kLowLatencyCombine, m, pause,
          [&](int r) -> absl::Status {
            LowLatencyCombineArgs a;
            a.x = &ll_y[r].dl();
            a.topk_idx = &in[r].idx_ll;
            a.topk_weights = &in[r].w_ll;
            a.handle = &ll_dispatch[r].handle;
            return Keep(eps[r]->LowLatencyCombine(a), p_ll_combine[r]);
          },
          [&](int r) { return WaitInto(p_ll_combine[r], ll_combine[r]); });
    }
  }

  EXPECT_FALSE(engine_lagged) << "the engine did not finish an op within 10 s of its Waits";
  EXPECT_EQ(group->ops_failed(), 0u);
  for (int k = 0; k < kNumKinds; ++k) {
    EXPECT_TRUE(errors[k].ok()) << kKindNames[k] << ": " << errors[k];
  }
  // The ops did their work (not a vacuous pass): the results have the expected shapes.
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(layout[r].is_token_in_rank.shape()[0], in[r].T);
    EXPECT_GT(dispatch[r].num_recv_tokens, 0) << "rank " << r;
    EXPECT_EQ(cached[r].num_recv_tokens, dispatch[r].num_recv_tokens) << "rank " << r;
    EXPECT_EQ(dispatch_fp8[r].recv_scales.shape()[0], dispatch_fp8[r].num_recv_tokens);
    EXPECT_EQ(combine[r].combined_x.shape()[0], in[r].T);
    EXPECT_EQ(ll_dispatch[r].recv_x.shape()[0], E / R);
    EXPECT_EQ(ll_dispatch_fp8[r].recv_scales.shape()[2], H / 128);
    EXPECT_EQ(ll_combine[r].combined_x.shape()[0], in[r].Tll);
    // Identity experts: combined_x[t] = x[t] times the number of ranks token t went to
    // (exact in f32, rounded once to bf16).
    for (int t = 0; t < in[r].T; ++t) {
      std::array<bool, R> to{};
      for (int k = 0; k < K; ++k) {
        const int64_t e = in[r].idx[size_t(t) * K + k];
        if (e >= 0) to[e / (E / R)] = true;
      }
      const float n = static_cast<float>(std::count(to.begin(), to.end(), true));
      for (int h = 0; h < H; ++h) {
        const float x = kernels::Bf16ToFloat(in[r].x[size_t(t) * H + h]);
        ASSERT_EQ(combine[r].combined_x.as<bf16_bits>()[size_t(t) * H + h],
                  kernels::FloatToBf16(n * x))
            << "rank " << r << " token " << t << " channel " << h;
      }
    }
  }

  // The verdict, per op kind, with a hint at the allocations' sizes.
  for (int k = 0; k < kNumKinds; ++k) {
    std::array<std::string, 2> where;
    for (int who = 0; who < 2; ++who) {
      const std::string sizes = first_sizes[k][who].ToString();
      where[who] = absl::StrCat(kKindNames[k], " (", kRounds, " group ops of ", R,
                                " ranks after warm-up; sizes of its first allocations in the "
                                "first measured op, bytes: [",
                                sizes, "])");
    }
    std::cout << "[alloc] " << kKindNames[k] << ": client thread " << client_allocs[k]
              << ", engine thread " << engine_allocs[k] << ", inside kernels/host "
              << kernel_allocs[k] << "\n";
    EXPECT_EQ(client_allocs[k], 0u) << "the client thread allocated in " << where[0];
    EXPECT_EQ(engine_allocs[k], 0u)
        << "the engine thread (outside kernels/host) allocated in " << where[1];
    EXPECT_EQ(kernel_allocs[k], 0u)
        << "kernels/host (engine thread inside the kernels, or its worker threads) allocated "
        << kernel_allocs[k] << " times in " << kKindNames[k] << " (" << kRounds << " group ops of "
        << R << " ranks after warm-up)";
  }
}

}  // namespace
}  // namespace epd
