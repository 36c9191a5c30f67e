// The host backend's hot path allocates nothing: a host-backend group runs in this process
// (HostDataPlane + endpoints opened by the real client code), every op kind of a round
// (tests/common/hot_path_rounds.h) runs kRounds times after warm-up, and the heap
// allocations on the client's calling thread and on the engine thread (outside and inside
// kernels/host) must be 0 per op kind. This file defines the counting operators of
// tests/common/counting_new.h for epd_unit_tests. How it counts: docs/CUDA_BACKEND.md
// "Hot path: no allocation per op".
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
#include "client/endpoint/endpoint_internal.h"
#include "daemon/dataplane/host/host_data_plane.h"
#include "epd/client.h"
#include "epd/kernels/types.h"
#define EPD_COUNTING_NEW_DEFINE_OPERATORS
#include "tests/common/counting_new.h"
#include "tests/common/dtypes.h"
#include "tests/common/hot_path_rounds.h"
#include "tests/unit/in_process_ranks.h"

namespace epd {
namespace {

using kernels::bf16_bits;
namespace counting_new = testing::counting_new;
using counting_new::g_engine_allocs;
using counting_new::g_kernel_allocs;
using counting_new::t_allocs;
namespace hot_path = testing::hot_path;
using testing::kBf16;
using testing::kF32;
using testing::kI64;

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
  auto opened = testing::OpenRanks(*group, spec);
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::vector<std::unique_ptr<Endpoint>> eps = *std::move(opened);

  std::vector<RankInputs> in(R);
  std::mt19937 rng(7);
  for (int r = 0; r < R; ++r) {
    RankInputs& d = in[r];
    d.T = 9 + 7 * r;  // 9, 16, 23, 30 <= M
    d.Tll = std::min(d.T, Mll);
    hot_path::FillRoutedTokens(d.T, H, K, E, r, rng, d.x, d.idx, d.w);
    d.x8.assign(size_t(d.T) * H, 0x38);  // e4m3 1.0
    d.scales.assign(size_t(d.T) * (H / 128), 0.5f);
    d.xs = {d.T, H};
    d.ss = {d.T, H / 128};
    d.ks = {d.T, K};
    d.xs_ll = {d.Tll, H};
    d.ks_ll = {d.Tll, K};
    d.x_t = hot_path::Tensor2d(d.x.data(), kBf16, d.xs);
    d.x8_t = hot_path::Tensor2d(d.x8.data(), kDLFloat8E4m3fn, d.xs);
    d.scales_t = hot_path::Tensor2d(d.scales.data(), kF32, d.ss);
    d.idx_t = hot_path::Tensor2d(d.idx.data(), kI64, d.ks);
    d.w_t = hot_path::Tensor2d(d.w.data(), kF32, d.ks);
    d.x_ll = hot_path::Tensor2d(d.x.data(), kBf16, d.xs_ll);
    d.idx_ll = hot_path::Tensor2d(d.idx.data(), kI64, d.ks_ll);
    d.w_ll = hot_path::Tensor2d(d.w.data(), kF32, d.ks_ll);
  }
  std::vector<hot_path::RoundInputs> round_in(R);
  for (int r = 0; r < R; ++r) {
    round_in[r] = {&in[r].x_t, &in[r].x8_t, &in[r].scales_t, &in[r].idx_t,
                   &in[r].w_t, &in[r].x_ll, &in[r].idx_ll,   &in[r].w_ll};
  }
  // Every result, pending op and low-latency combine input (LowLatencyCombineInput(): no
  // copy) lives here, so the rounds below only reuse them.
  hot_path::RoundOps ops(eps);

  std::array<uint64_t, hot_path::kNumKinds> client_allocs{}, engine_allocs{}, kernel_allocs{};
  // First allocation sizes per kind, per thread (0 client, 1 engine).
  std::array<std::array<counting_new::RecordedSizes, 2>, hot_path::kNumKinds> first_sizes{};
  std::array<bool, hot_path::kNumKinds> sizes_taken{};
  uint64_t group_ops = group->ops_completed();
  bool engine_lagged = false;

  // Runs one op of `kind` on every rank: submit all (the host backend's Submit does not
  // wait for peers), then Wait all, then until the engine has finished the op. In every
  // other measured round the client first pauses for longer than the engine's idle_us,
  // so the engine's sleep and doorbell wake-up are measured too.
  auto run = [&](hot_path::Kind kind, bool measured, bool pause, auto submit, auto wait) {
    const uint64_t c0 = t_allocs;
    const uint64_t e0 = g_engine_allocs.load();
    const uint64_t k0 = g_kernel_allocs.load();
    if (measured && !sizes_taken[kind]) counting_new::StartRecordingSizes();
    const absl::Status st = hot_path::SubmitThenWaitAll(R, pause, submit, wait);
    ++group_ops;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (group->ops_completed() < group_ops) {
      if (std::chrono::steady_clock::now() > deadline) {
        engine_lagged = true;
        break;
      }
    }
    counting_new::StopRecordingSizes();
    if (!st.ok() && ops.errors[kind].ok()) ops.errors[kind] = st;  // Error path: may allocate.
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
    hot_path::RunRound(eps, round_in, ops, /*fp8_dispatch=*/true, absl::InfiniteDuration(), m,
                       pause, run);
  }

  EXPECT_FALSE(engine_lagged) << "the engine did not finish an op within 10 s of its Waits";
  EXPECT_EQ(group->ops_failed(), 0u);
  hot_path::ExpectNoRoundErrors(ops);
  // The ops did their work (not a vacuous pass): the results have the expected shapes.
  for (int r = 0; r < R; ++r) {
    hot_path::ExpectRoundResults(ops, r, in[r].T, in[r].Tll, E, R, H, /*fp8_dispatch=*/true);
    EXPECT_EQ(ops.combine[r].combined_x.shape()[0], in[r].T);
    // Identity experts: combined_x[t] = x[t] times the number of ranks token t went to.
    ASSERT_NO_FATAL_FAILURE(hot_path::ExpectIdentityCombine(
        r, in[r].T, H, K, E, R, in[r].x, in[r].idx, ops.combine[r].combined_x.as<bf16_bits>()));
  }

  // The verdict, per op kind, with a hint at the allocations' sizes.
  for (int k = 0; k < hot_path::kNumKinds; ++k) {
    std::array<std::string, 2> where;
    for (int who = 0; who < 2; ++who) {
      const std::string sizes = first_sizes[k][who].ToString();
      where[who] = absl::StrCat(hot_path::kKindNames[k], " (", kRounds, " group ops of ", R,
                                " ranks after warm-up; sizes of its first allocations in the "
                                "first measured op, bytes: [",
                                sizes, "])");
    }
    std::cout << "[alloc] " << hot_path::kKindNames[k] << ": client thread " << client_allocs[k]
              << ", engine thread " << engine_allocs[k] << ", inside kernels/host "
              << kernel_allocs[k] << "\n";
    EXPECT_EQ(client_allocs[k], 0u) << "the client thread allocated in " << where[0];
    EXPECT_EQ(engine_allocs[k], 0u)
        << "the engine thread (outside kernels/host) allocated in " << where[1];
    EXPECT_EQ(kernel_allocs[k], 0u)
        << "kernels/host (engine thread inside the kernels, or its worker threads) allocated "
        << kernel_allocs[k] << " times in " << hot_path::kKindNames[k] << " (" << kRounds
        << " group ops of " << R << " ranks after warm-up)";
  }
}

}  // namespace
}  // namespace epd
