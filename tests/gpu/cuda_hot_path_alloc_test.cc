// The CUDA data plane's per-op path allocates nothing: a daemon-launched group of R = 2 and
// R = 8 virtual ranks on the first GPU runs in this process, every op kind of a round
// (tests/common/hot_path_rounds.h) runs kRounds times after warm-up, and the heap
// allocations on the engine threads must be 0 per op kind (the client thread's are
// printed); CudaHotPathAllocProgramTest does the same over 100 replays of an armed graph-mode
// program. This file defines the counting operators of tests/common/counting_new.h for
// epd_gpu_tests. How it counts, how to run it (the program test in a process of its own)
// and what passes: docs/CUDA_BACKEND.md "Hot path: no allocation per op".
#include <cuda_runtime.h>
#include <dlpack/dlpack.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <new>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/cuda/cuda_ipc.h"
#include "client/endpoint/endpoint_internal.h"
#include "daemon/dataplane/cuda/cuda_data_plane.h"
#include "epd/client.h"
#include "epd/kernels/types.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/in_process_epd.h"
#define EPD_COUNTING_NEW_DEFINE_OPERATORS
#include "tests/common/counting_new.h"
#include "tests/common/dtypes.h"
#include "tests/common/hot_path_rounds.h"
#include "tests/common/specs.h"

namespace epd {
namespace {

using kernels::bf16_bits;
using testing::DeviceBuffer;
using testing::DrainsWithin;
using testing::OnEveryRank;
namespace counting_new = testing::counting_new;
using counting_new::g_client_allocs;
using counting_new::g_engine_allocs;
namespace hot_path = testing::hot_path;
using testing::kBf16;
using testing::kF32;
using testing::kI32;
using testing::kI64;
constexpr auto kWait = absl::Seconds(30);

/// One rank's inputs: x on the GPU (staged device to device), topk on the host; DLTensors
/// built once (their shape arrays live here).
struct RankInputs {
  int T = 0;    ///< Tokens of the normal ops.
  int Tll = 0;  ///< Tokens of the low-latency ops (the first Tll rows of the same data).
  std::vector<bf16_bits> x;
  std::vector<float> w;
  std::vector<int64_t> idx;
  DeviceBuffer dx;
  std::array<int64_t, 2> xs{}, ks{}, xs_ll{}, ks_ll{};
  DLTensor x_t{}, idx_t{}, w_t{}, x_ll{}, idx_ll{}, w_ll{};
};

/// Removes the in-process area resolver when the test ends, whatever the path.
struct ResolverGuard {
  ResolverGuard() { internal::SetInProcessAreaResolver(FindInProcessCudaArea); }
  ~ResolverGuard() { internal::SetInProcessAreaResolver({}); }
};

/// Marks the test thread as counted while the test runs.
struct ClientMark {
  ClientMark() { counting_new::t_client = true; }
  ~ClientMark() { counting_new::t_client = false; }
};

/// A CUDA data plane whose engine threads count their allocations, and one group of
/// daemon-launched ranks on its first GPU with every endpoint opened in this process.
/// Members are destroyed in reverse order: endpoints (DetachRank), group, plane.
struct CountedPlane {
  std::unique_ptr<DataPlane> plane;
  std::unique_ptr<DataPlaneGroup> group;
  std::vector<std::unique_ptr<Endpoint>> eps;
  ~CountedPlane() {
    eps.clear();
    group.reset();
    plane.reset();
  }
};

/// Starts the plane (engines marked through on_engine_start, each allocating one probe that
/// must be counted) and opens every rank of `spec` (daemon-launched, first GPU).
void OpenCountedPlane(const v1::GroupSpec& spec, CountedPlane& f) {
  // Shared with the plane's copy of the options (the engine threads may run the hook late).
  auto engines_marked = std::make_shared<std::atomic<int>>(0);
  CudaDataPlaneOptions o;
  o.op_timeout_ms = 10000;
  o.on_engine_start = [engines_marked] {
    // Also a probe: proves the engine threads' allocations are counted.
    counting_new::MarkEngineThread();
    engines_marked->fetch_add(1);
  };
  const uint64_t probes_before = g_engine_allocs.load();
  auto plane = MakeCudaDataPlane(o);
  ASSERT_TRUE(plane.ok()) << plane.status();
  f.plane = std::move(*plane);
  // One engine per GPU: wait for every one's probe, so none lands in a measured window.
  int gpus = 0;
  ASSERT_EQ(cudaGetDeviceCount(&gpus), cudaSuccess);
  const auto marked_by = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (engines_marked->load() < gpus && std::chrono::steady_clock::now() < marked_by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_GE(engines_marked->load(), 1) << "no engine thread ran on_engine_start";
  ASSERT_GE(g_engine_allocs.load(), probes_before + 1)
      << "the engine thread's probe allocation was not counted";
  ASSERT_TRUE(counting_new::CountingNewInForce()) << "the counting operator new is not in force";

  auto group_or = f.plane->CreateGroup(spec);
  ASSERT_TRUE(group_or.ok()) << group_or.status();
  f.group = std::move(*group_or);
  for (int r = 0; r < spec.num_ranks(); ++r) {
    v1::EndpointInfo info;
    absl::Status st = f.group->AttachRank(r, "", v1::LAUNCH_MODE_DAEMON, {}, &info);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_EQ(info.backend(), "cuda");
    ASSERT_EQ(info.launch_mode(), v1::LAUNCH_MODE_DAEMON);
    DataPlaneGroup* g = f.group.get();
    absl::StatusOr<EndpointFds> fds = g->TakeEndpointFds(r);
    ASSERT_TRUE(fds.ok()) << fds.status();
    auto ep = internal::OpenEndpoint(info, spec, *std::move(fds), [g, r] {
      g->DetachRank(r);
      return absl::OkStatus();
    });
    ASSERT_TRUE(ep.ok()) << ep.status();
    f.eps.push_back(std::move(*ep));
  }
}

v1::GroupSpec Spec(const std::string& name, int R, int M, int Mll) {
  return testing::MakeSpec(name, {.num_ranks = R,
                                  .num_experts = 4 * R,
                                  .hidden = 256,
                                  .num_topk = 4,
                                  .max_tokens_per_rank = M,
                                  .ll_max_tokens_per_rank = Mll,
                                  .use_fp8 = true});
}

class CudaHotPathAllocTest : public ::testing::TestWithParam<int> {};

TEST_P(CudaHotPathAllocTest, DaemonLaunchedOpsAllocateNothingOnTheEngineThread) {
  const int R = GetParam();
  const int M = 32, Mll = 16;
  const v1::GroupSpec spec = Spec(absl::StrCat("hot-path-cuda-", R), R, M, Mll);
  const int E = spec.num_experts(), H = spec.hidden(), K = spec.num_topk();
  constexpr int kWarmupRounds = 3, kRounds = 20;
  std::string why;
  if (!testing::HaveGpu(&why)) GTEST_SKIP() << why;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);  // The plane's first GPU ("" at AttachRank).
  const DLDevice gpu{kDLCUDA, 0};
  ResolverGuard resolver;
  CountedPlane f;
  OpenCountedPlane(spec, f);
  if (HasFatalFailure()) return;
  ClientMark client_mark;
  DataPlaneGroup* group = f.group.get();
  std::vector<std::unique_ptr<Endpoint>>& eps = f.eps;

  std::vector<RankInputs> in(R);
  std::mt19937 rng(7 + R);
  for (int r = 0; r < R; ++r) {
    RankInputs& d = in[r];
    d.T = std::min(M, 9 + 7 * r);  // 9, 16, 23, 30, 32, ...
    d.Tll = std::min(d.T, Mll);
    // Distinct experts per row (offsets k * E / K differ mod E), some masked.
    hot_path::FillRoutedTokens(d.T, H, K, E, r, rng, d.x, d.idx, d.w);
    auto dx = DeviceBuffer::Allocate(d.x.size() * sizeof(bf16_bits));
    ASSERT_TRUE(dx.ok()) << dx.status();
    d.dx = std::move(*dx);
    ASSERT_EQ(
        cudaMemcpy(d.dx.get(), d.x.data(), d.x.size() * sizeof(bf16_bits), cudaMemcpyHostToDevice),
        cudaSuccess);
    d.xs = {d.T, H};
    d.ks = {d.T, K};
    d.xs_ll = {d.Tll, H};
    d.ks_ll = {d.Tll, K};
    const DLDevice cpu{kDLCPU, 0};
    d.x_t = hot_path::Tensor2d(d.dx.get(), kBf16, d.xs, gpu);
    d.idx_t = hot_path::Tensor2d(d.idx.data(), kI64, d.ks, cpu);
    d.w_t = hot_path::Tensor2d(d.w.data(), kF32, d.ks, cpu);
    d.x_ll = hot_path::Tensor2d(d.dx.get(), kBf16, d.xs_ll, gpu);
    d.idx_ll = hot_path::Tensor2d(d.idx.data(), kI64, d.ks_ll, cpu);
    d.w_ll = hot_path::Tensor2d(d.w.data(), kF32, d.ks_ll, cpu);
  }
  std::vector<hot_path::RoundInputs> round_in(R);
  for (int r = 0; r < R; ++r) {
    round_in[r] = {&in[r].x_t, nullptr,     nullptr,       &in[r].idx_t,
                   &in[r].w_t, &in[r].x_ll, &in[r].idx_ll, &in[r].w_ll};
  }
  // Every result, pending op and low-latency combine input (LowLatencyCombineInput(): no
  // copy) lives here, so the rounds below only reuse them.
  hot_path::RoundOps ops(eps);

  std::array<uint64_t, hot_path::kNumKinds> client_allocs{}, engine_allocs{};
  std::array<counting_new::RecordedSizes, hot_path::kNumKinds> first_sizes{};  // Engine threads.
  std::array<bool, hot_path::kNumKinds> sizes_taken{};
  uint64_t group_ops = group->ops_completed();
  bool engine_lagged = false;

  // Runs one op of `kind` on every rank from this thread: submit all (an op call does not
  // wait for the peers), then Wait all, then until the engine has finished the op (its
  // completions are written before ops_completed counts it).
  auto run = [&](hot_path::Kind kind, bool measured, bool pause, auto submit, auto wait) {
    const uint64_t c0 = g_client_allocs.load();
    const uint64_t e0 = g_engine_allocs.load();
    if (measured && !sizes_taken[kind]) counting_new::StartRecordingSizes();
    const absl::Status st = hot_path::SubmitThenWaitAll(R, pause, submit, wait);
    ++group_ops;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    while (group->ops_completed() + group->ops_failed() < group_ops) {
      if (std::chrono::steady_clock::now() > deadline) {
        engine_lagged = true;
        break;
      }
      std::this_thread::yield();
    }
    counting_new::StopRecordingSizes();
    if (!st.ok() && ops.errors[kind].ok()) ops.errors[kind] = st;  // Error path: may allocate.
    if (!measured) return;
    client_allocs[kind] += g_client_allocs.load() - c0;
    engine_allocs[kind] += g_engine_allocs.load() - e0;
    if (!sizes_taken[kind]) {
      sizes_taken[kind] = true;
      first_sizes[kind] = counting_new::TakeRecordedSizes(counting_new::kEngineThread);
    }
  };

  for (int round = 0; round < kWarmupRounds + kRounds && !engine_lagged; ++round) {
    const bool m = round >= kWarmupRounds;
    const bool pause = m && round % 2 == 1;
    hot_path::RunRound(eps, round_in, ops, /*fp8_dispatch=*/false, kWait, m, pause, run);
  }

  ASSERT_FALSE(engine_lagged) << "the engine did not finish an op within 15 s of its Waits";
  EXPECT_EQ(group->ops_failed(), 0u);
  hot_path::ExpectNoRoundErrors(ops);
  // The ops did their work (not a vacuous pass). Read back outside the measured windows.
  for (int r = 0; r < R; ++r) {
    hot_path::ExpectRoundResults(ops, r, in[r].T, in[r].Tll, E, R, H, /*fp8_dispatch=*/false);
    // Identity experts: combined_x[t] = x[t] times the number of ranks token t went to.
    std::vector<bf16_bits> got(size_t(in[r].T) * H);
    ASSERT_EQ(ops.combine[r].combined_x.nbytes(), got.size() * sizeof(bf16_bits));
    ASSERT_EQ(cudaMemcpy(got.data(), ops.combine[r].combined_x.data(),
                         got.size() * sizeof(bf16_bits), cudaMemcpyDefault),
              cudaSuccess);
    ASSERT_NO_FATAL_FAILURE(
        hot_path::ExpectIdentityCombine(r, in[r].T, H, K, E, R, in[r].x, in[r].idx, got.data()));
  }

  // The verdict, per op kind, with a hint at the allocations' sizes.
  for (int k = 0; k < hot_path::kNumKinds; ++k) {
    if (k == hot_path::kDispatchFp8) continue;  // Not run on this backend.
    const std::string sizes = first_sizes[k].ToString();
    std::cout << "[alloc] R=" << R << " " << hot_path::kKindNames[k] << ": engine thread "
              << engine_allocs[k] << ", client thread " << client_allocs[k] << " (not asserted)\n";
    EXPECT_EQ(engine_allocs[k], 0u)
        << "the engine thread allocated in " << hot_path::kKindNames[k] << " (" << kRounds
        << " group ops of " << R << " daemon-launched ranks after warm-up); sizes of its first "
        << "allocations in the first measured op, bytes: [" << sizes << "]";
  }
}

INSTANTIATE_TEST_SUITE_P(VirtualRanks, CudaHotPathAllocTest, ::testing::Values(2, 8),
                         [](const ::testing::TestParamInfo<int>& p) {
                           return absl::StrCat("R", p.param);
                         });

// Graph mode (DESIGN.md §3.2): while a program is armed the engine polls without sleeping
// (PollBackground on every loop), completes each instance and enqueues the next; none of
// that may allocate. R = 2 daemon-launched ranks register [LowLatencyDispatch{bf16},
// LowLatencyCombine]; the steps are enqueued on one stream per rank (no graph capture: the
// engine's side is the same), kWarmup replays, then kReplays measured ones; the engine
// threads' allocations over the measured replays (every instance checked: ProgramStatus)
// must be 0. Runs only as the one test of its process, as GraphProgramTest does (in one
// process the daemon's and the client's streams share the GPU's 32 hardware queues, and a
// stream memory wait enqueued ahead can then hold an unrelated stream's work):
//   epd_gpu_tests --gtest_filter=CudaHotPathAllocProgramTest.*
TEST(CudaHotPathAllocProgramTest, ArmedProgramAllocatesNothingOnTheEngineThread) {
  constexpr int R = 2, M = 32, Mll = 16, T = 11;
  constexpr int kWarmup = 5, kReplays = 100;
  std::string why;
  if (!testing::HaveGpu(&why)) GTEST_SKIP() << why;
  if (::testing::UnitTest::GetInstance()->test_to_run_count() != 1) {
    GTEST_SKIP() << "CudaHotPathAllocProgramTest runs only as the one test of its process "
                    "(--gtest_filter=CudaHotPathAllocProgramTest.*): in one process the "
                    "daemon's and the client's streams share the GPU's "
                    "CUDA_DEVICE_MAX_CONNECTIONS (32) hardware queues (graph_program_test.cc)";
  }
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  const DLDevice gpu{kDLCUDA, 0};
  const v1::GroupSpec spec = Spec("hot-path-cuda-program", R, M, Mll);
  const int E = spec.num_experts(), H = spec.hidden(), K = spec.num_topk();
  ResolverGuard resolver;
  CountedPlane f;
  OpenCountedPlane(spec, f);
  if (HasFatalFailure()) return;

  // Per rank: a stream and the step inputs on the GPU, staged once (C = Mll rows, T used).
  struct RankSteps {
    testing::CudaStream stream;
    DeviceBuffer dx, didx, dw, dT;
    std::array<int64_t, 2> xs{}, ks{};
    std::array<int64_t, 1> ns{};
    DLTensor x{}, idx{}, w{}, num_tokens{};
  };
  std::vector<RankSteps> rs(R);
  std::mt19937 rng(11);
  for (int r = 0; r < R; ++r) {
    RankSteps& q = rs[r];
    auto s = testing::CudaStream::Create();
    ASSERT_TRUE(s.ok()) << s.status();
    q.stream = std::move(*s);
    std::vector<bf16_bits> x(size_t(Mll) * H);
    for (auto& v : x) v = kernels::FloatToBf16((rng() % 200) / 100.f);
    std::vector<int64_t> idx(size_t(Mll) * K);
    for (int t = 0; t < Mll; ++t) {
      for (int k = 0; k < K; ++k) idx[size_t(t) * K + k] = (t * 3 + k * (E / K) + r) % E;
    }
    std::vector<float> w(idx.size(), 0.5f);
    const int32_t num_tokens = T;
    auto dx = DeviceBuffer::Allocate(x.size() * sizeof(bf16_bits));
    auto didx = DeviceBuffer::Allocate(idx.size() * sizeof(int64_t));
    auto dw = DeviceBuffer::Allocate(w.size() * sizeof(float));
    auto dT = DeviceBuffer::Allocate(16);
    ASSERT_TRUE(dx.ok() && didx.ok() && dw.ok() && dT.ok());
    q.dx = std::move(*dx);
    q.didx = std::move(*didx);
    q.dw = std::move(*dw);
    q.dT = std::move(*dT);
    ASSERT_EQ(cudaMemcpy(q.dx.get(), x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(q.didx.get(), idx.data(), idx.size() * 8, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(q.dw.get(), w.data(), w.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(q.dT.get(), &num_tokens, 4, cudaMemcpyHostToDevice), cudaSuccess);
    q.xs = {Mll, H};
    q.ks = {Mll, K};
    q.ns = {1};
    q.x = hot_path::Tensor2d(q.dx.get(), kBf16, q.xs, gpu);
    q.idx = hot_path::Tensor2d(q.didx.get(), kI64, q.ks, gpu);
    q.w = hot_path::Tensor2d(q.dw.get(), kF32, q.ks, gpu);
    q.num_tokens = q.x;
    q.num_tokens.data = q.dT.get();
    q.num_tokens.ndim = 1;
    q.num_tokens.dtype = kI32;
    q.num_tokens.shape = q.ns.data();
  }
  std::vector<TensorView> expert_out;
  for (int r = 0; r < R; ++r) expert_out.push_back(f.eps[r]->LowLatencyCombineInput());

  const std::vector<ProgramStep> program = {{ProgramStep::Op::kLowLatencyDispatch, false, false},
                                            {ProgramStep::Op::kLowLatencyCombine, false, false}};
  for (const absl::Status& st :
       OnEveryRank(R, [&](int r) { return f.eps[r]->RegisterProgram(program, kWait); })) {
    ASSERT_TRUE(st.ok()) << st;
  }
  // Every path below ends with the program unregistered (its waits released).
  struct Unregister {
    CountedPlane& f;
    ~Unregister() {
      OnEveryRank(static_cast<int>(f.eps.size()),
                  [this](int r) { return f.eps[r]->UnregisterProgram(kWait); });
    }
  } unregister{f};

  std::vector<LowLatencyDispatchResult> d(R);
  std::vector<LowLatencyCombineResult> c(R);
  // One replay: every rank's dispatch step, then every rank's combine step, then every
  // stream drained (bounded).
  auto replay = [&]() -> absl::Status {
    for (int r = 0; r < R; ++r) {
      ProgramDispatchArgs a;
      a.x = &rs[r].x;
      a.topk_idx = &rs[r].idx;
      a.num_tokens = &rs[r].num_tokens;
      a.stream = rs[r].stream.get();
      auto res = f.eps[r]->RunProgramDispatch(a);
      if (!res.ok()) return res.status();
      d[r] = std::move(*res);
    }
    for (int r = 0; r < R; ++r) {
      ProgramCombineArgs a;
      a.x = &expert_out[r].dl();
      a.topk_idx = &rs[r].idx;
      a.topk_weights = &rs[r].w;
      a.stream = rs[r].stream.get();
      auto res = f.eps[r]->RunProgramCombine(a);
      if (!res.ok()) return res.status();
      c[r] = std::move(*res);
    }
    for (int r = 0; r < R; ++r) {
      if (!DrainsWithin(rs[r].stream.get(), std::chrono::milliseconds(20000))) {
        return absl::DeadlineExceededError(absl::StrCat("rank ", r, "'s stream did not drain"));
      }
    }
    return absl::OkStatus();
  };
  // Every instance run so far checked by the daemon, without errors.
  auto checked = [&]() -> absl::Status {
    for (int r = 0; r < R; ++r) {
      absl::Status st = f.eps[r]->ProgramStatus();
      if (!st.ok()) return absl::Status(st.code(), absl::StrCat("rank ", r, ": ", st.message()));
    }
    return absl::OkStatus();
  };

  for (int i = 0; i < kWarmup; ++i) {
    absl::Status st = replay();
    ASSERT_TRUE(st.ok()) << "warm-up replay " << i << ": " << st;
  }
  ASSERT_TRUE(checked().ok()) << checked();
  const uint64_t instances0 = f.group->ops_completed();
  counting_new::StartRecordingSizes();
  const uint64_t e0 = g_engine_allocs.load();
  absl::Status st;
  for (int i = 0; i < kReplays && st.ok(); ++i) st = replay();
  if (st.ok()) st = checked();
  const uint64_t e1 = g_engine_allocs.load();
  counting_new::StopRecordingSizes();
  ASSERT_TRUE(st.ok()) << st;
  // Not vacuous: the engine completed (at least) every measured instance, two per replay.
  EXPECT_GE(f.group->ops_completed() - instances0, uint64_t{2} * kReplays);
  EXPECT_EQ(f.group->ops_failed(), 0u);
  EXPECT_EQ(d[0].recv_x.shape()[0], E / R);
  EXPECT_EQ(c[0].combined_x.shape()[0], Mll);
  const std::string sizes = counting_new::TakeRecordedSizes(counting_new::kEngineThread).ToString();
  std::cout << "[alloc] program R=" << R << ": engine thread " << e1 - e0 << " over " << kReplays
            << " replays (" << 2 * kReplays << " instances)\n";
  EXPECT_EQ(e1 - e0, 0u) << "the engine thread allocated while the program ran " << kReplays
                         << " replays; sizes of its first allocations, bytes: [" << sizes << "]";
}
}  // namespace
}  // namespace epd
