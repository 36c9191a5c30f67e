// The daemon-launched graph-mode program (DESIGN.md §3.2) end to end through an epd Daemon
// running in this process and a real Client on its socket, R = 2 and 8 virtual ranks on one
// GPU: [LowLatencyDispatch{use_fp8}, LowLatencyCombine] around a toy FP8 expert captured
// per rank into a CUDA graph, replayed with new inputs and T, every output compared byte for
// byte with kernels/host; then a bad expert id, a ring op while armed, and a replay released
// by UnregisterProgram. A HangWatchdog (below) turns a hang into a dump and exit code 3.
// Each test must run in a process of its own (it skips itself otherwise, saying so), e.g.
//   epd_gpu_tests --gtest_filter=GraphProgramTest.TwoRanks
// The scenario in full: docs/CUDA_BACKEND.md "How the GPU tests are built".
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/cuda/cuda_ipc.h"
#include "daemon/control/spec_validation.h"
#include "daemon/core/config.h"
#include "daemon/core/daemon.h"
#include "daemon/dataplane/cuda/cuda_data_plane.h"
#include "daemon/dataplane/lockstep_group.h"
#include "epd/client.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/host_ops.h"
#include "epd/kernels/layout.h"
#include "proto/abi/launch_flags.h"
#include "tests/common/dtypes.h"
#include "tests/common/specs.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/graph_program_kernels.h"
#include "tests/gpu/in_process_epd.h"
#include "tests/gpu/test_bytes.h"

namespace epd {
namespace {

using kernels::bf16_bits;
using kernels::GroupShape;
using testing::Bytes;
using testing::DeviceBuffer;
using testing::DrainsWithin;
using testing::Fetch;
using testing::OnEveryRank;
namespace host = kernels::host;

constexpr uint32_t kOpTimeoutMs = 3000;
constexpr auto kWait = absl::Seconds(20);
using testing::kBf16;
using testing::kF32;
using testing::kI32;
using testing::kI64;

int g_device = 0;

v1::GroupSpec Spec(const std::string& name, int R, int H, int Mll, int E = 0, int K = 4) {
  return testing::MakeSpec(name, {.num_ranks = R,
                                  .num_experts = E > 0 ? E : 4 * R,
                                  .hidden = H,
                                  .num_topk = K,
                                  .max_tokens_per_rank = 16,
                                  .ll_max_tokens_per_rank = Mll,
                                  .use_fp8 = true});
}

template <typename T>
DeviceBuffer Zeros(size_t count) {
  auto buf = DeviceBuffer::Allocate(std::max<size_t>(count * sizeof(T), 16));
  EXPECT_TRUE(buf.ok()) << buf.status();
  return buf.ok() ? std::move(*buf) : DeviceBuffer();
}

/// One rank's inputs of one replay.
struct RankInputs {
  int T = 0;
  std::vector<bf16_bits> x;  // [T, H]
  std::vector<int64_t> idx;  // [T, K]
  std::vector<float> w;      // [T, K]
};

/// Named byte blobs of one rank's outputs.
using Blobs = std::vector<std::pair<std::string, std::vector<uint8_t>>>;

/// Reads rank outputs (recv_count, then per local expert the valid rows of recv_x, recv_src_info,
/// recv_scales; then combined_x [T, H]) through `at(which, offset, bytes)`: which 0 recv_x, 1
/// src_info, 2 scales, 3 combined_x. `ue8m0`: the scales are UE8M0-packed int32 words.
template <typename Reader>
Blobs OutputBlobs(const GroupShape& g, const int32_t* count, int T, Reader at, bool ue8m0) {
  const int64_t El = g.num_local_experts(), rows = g.ll_rows_per_expert();
  const size_t H = static_cast<size_t>(g.hidden);
  const size_t S = static_cast<size_t>(ue8m0 ? g.num_scales() / 4 : g.num_scales());
  Blobs b;
  b.push_back({"recv_count", Bytes(count, El)});
  for (int64_t j = 0; j < El; ++j) {
    const size_t n = static_cast<size_t>(std::max(0, count[j]));
    const size_t row0 = static_cast<size_t>(j * rows);
    b.push_back({absl::StrCat("recv_x[", j, "]"), at(0, row0 * H, n * H)});
    b.push_back({absl::StrCat("recv_src_info[", j, "]"), at(1, row0 * 4, n * 4)});
    // Scales are stored [El, S, rows] of 4-byte words (token index fastest): rows [0, n) of
    // each column.
    for (size_t c = 0; c < S; ++c) {
      b.push_back({absl::StrCat("recv_scales[", j, "][", c, "]"),
                   at(2, (static_cast<size_t>(j) * S + c) * static_cast<size_t>(rows) * 4, n * 4)});
    }
  }
  b.push_back({"combined_x", at(3, 0, static_cast<size_t>(T) * H * 2)});
  return b;
}

/// The host's FP8 low-latency dispatch (`ue8m0`: with round_scale and UE8M0-packed scales),
/// the toy expert (dequantise, scale), and the combine.
std::vector<Blobs> HostProgram(const GroupShape& g, const std::vector<RankInputs>& in, bool ue8m0) {
  const int R = g.num_ranks, H = g.hidden, K = g.num_topk;
  const int64_t El = g.num_local_experts(), rows = g.ll_rows_per_expert();
  const size_t S = static_cast<size_t>(g.num_scales());
  const size_t cells = static_cast<size_t>(El * rows);
  std::vector<std::vector<uint8_t>> recv_x(R, std::vector<uint8_t>(cells * H * 2));
  std::vector<std::vector<float>> scales(R, std::vector<float>(cells * S));
  std::vector<std::vector<int32_t>> count(R, std::vector<int32_t>(El)),
      src(R, std::vector<int32_t>(cells)),
      handle(R, std::vector<int32_t>(static_cast<size_t>(g.ll_max_tokens_per_rank) * K));
  std::vector<host::LowLatencyDispatchRankArgs> da(R);
  for (int r = 0; r < R; ++r) {
    da[r] = {in[r].T,          in[r].x.data(),  in[r].idx.data(), recv_x[r].data(),
             scales[r].data(), count[r].data(), src[r].data(),    handle[r].data()};
  }
  absl::Status st = host::LowLatencyDispatch(g, {/*use_fp8=*/true, ue8m0, ue8m0}, std::span(da));
  EXPECT_TRUE(st.ok()) << st;
  std::vector<std::vector<bf16_bits>> y(R, std::vector<bf16_bits>(cells * H)), combined(R);
  for (int r = 0; r < R; ++r) {
    for (size_t i = 0; i < cells * H; ++i) {
      const size_t row = i / H, j = row / rows;
      const int block = static_cast<int>((i % H) / kernels::kFp8BlockChannels);
      const float v = (kernels::E4m3ToFloat(recv_x[r][i]) *
                       testing::ProgramScaleAt(scales[r].data(), ue8m0, ue8m0 ? S / 4 : S, rows,
                                               static_cast<int64_t>(j), row % rows, block)) *
                      testing::ProgramExpertScale(static_cast<int64_t>(row / rows));
      y[r][i] = kernels::FloatToBf16(v);
    }
    combined[r].assign(static_cast<size_t>(in[r].T) * H, 0);
  }
  std::vector<host::LowLatencyCombineRankArgs> ca(R);
  for (int r = 0; r < R; ++r) {
    ca[r] = {in[r].T,          in[r].idx.data(), in[r].w.data(),
             handle[r].data(), y[r].data(),      combined[r].data()};
  }
  st = host::LowLatencyCombine(g, std::span(ca));
  EXPECT_TRUE(st.ok()) << st;
  std::vector<Blobs> out(R);
  for (int r = 0; r < R; ++r) {
    out[r] = OutputBlobs(
        g, count[r].data(), in[r].T,
        [&](int which, size_t off, size_t n) {
          const uint8_t* base = which == 0   ? recv_x[r].data()
                                : which == 1 ? reinterpret_cast<const uint8_t*>(src[r].data())
                                : which == 2 ? reinterpret_cast<const uint8_t*>(scales[r].data())
                                             : reinterpret_cast<const uint8_t*>(combined[r].data());
          return std::vector<uint8_t>(base + off, base + off + n);
        },
        ue8m0);
  }
  return out;
}

class GraphProgramTest : public testing::InProcessEpdTest<GraphProgramTest> {
 public:
  static constexpr const char* kSuiteName = "graph_program";
  static constexpr uint32_t kSuiteOpTimeoutMs = kOpTimeoutMs;

 protected:
  void SetUp() override {
    InProcessEpdTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    g_device = Epd()->device();
    if (::testing::UnitTest::GetInstance()->test_to_run_count() != 1) {
      GTEST_SKIP() << "GraphProgramTest runs only as the one test of its process "
                      "(--gtest_filter=GraphProgramTest.TwoRanks, then a second process with "
                      "GraphProgramTest.EightRanks): in one process the daemon's and the "
                      "client's streams share the GPU's CUDA_DEVICE_MAX_CONNECTIONS (32) "
                      "hardware queues, and beyond 32 streams a stream memory wait enqueued "
                      "ahead can hold an unrelated stream's work (see the file comment)";
    }
    ASSERT_EQ(cudaSetDevice(g_device), cudaSuccess);
  }
};

/// Progress on stderr (unbuffered), so a run cut short still shows how far it came.
void Phase(int R, const std::string& what) {
  std::fprintf(stderr, "[graph program R=%d] %s\n", R, what.c_str());
}

/// The test's hang detector. A thread watches Beat(); when no beat came for `limit` (the
/// scenario is stuck in a wait that no timeout of its own bounds, e.g. a stream memory wait
/// of the hand-off), it prints on stderr where the scenario was, every test stream's state,
/// and every rank's launch_flags words (ready_seq, done_seq; program go, done, instance) and
/// low-latency sync words (status, counters, exchange flags), read by a kernel on a stream of
/// its own, and once by a device-to-host copy on another stream for comparison (bounded);
/// then it ends the process with exit code 3 (the GPU waits of a hung program would hold its
/// teardown for ever). It found the hang this test was written for: the daemon's status
/// read-back copies, enqueued ahead behind the program's go waits, held the copy-engine
/// queue the test's cudaMemcpy needed (epd/kernels/cuda_program.h).
class HangWatchdog {
 public:
  HangWatchdog(int R, std::vector<const uint8_t*> bases, const kernels::EndpointLayout& layout,
               std::vector<cudaStream_t> streams, std::chrono::seconds limit)
      : R_(R),
        bases_(std::move(bases)),
        layout_(layout),
        streams_(std::move(streams)),
        limit_(limit) {
    // Everything the dump needs is made now: while the GPU is stuck, allocations may wait.
    void* p = nullptr;
    if (cudaHostAlloc(&p, (testing::kPeekWords + 1) * 8 * 2, cudaHostAllocMapped) != cudaSuccess) {
      ADD_FAILURE() << "HangWatchdog: cudaHostAlloc failed";
      return;
    }
    host_ = static_cast<uint64_t*>(p);
    std::memset(host_, 0, (testing::kPeekWords + 1) * 8 * 2);
    if (cudaStreamCreateWithFlags(&peek_, cudaStreamNonBlocking) != cudaSuccess ||
        cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking) != cudaSuccess) {
      ADD_FAILURE() << "HangWatchdog: cudaStreamCreateWithFlags failed";
      return;
    }
    thread_ = std::thread([this] { Watch(); });
  }
  ~HangWatchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    if (peek_ != nullptr) cudaStreamDestroy(peek_);
    if (copy_ != nullptr) cudaStreamDestroy(copy_);
    if (host_ != nullptr) cudaFreeHost(host_);
  }
  HangWatchdog(const HangWatchdog&) = delete;
  HangWatchdog& operator=(const HangWatchdog&) = delete;

  /// The scenario made progress; `where` names what it does next.
  void Beat(std::string where) {
    std::lock_guard<std::mutex> lock(mu_);
    where_ = std::move(where);
    last_ = std::chrono::steady_clock::now();
  }

 private:
  void Watch() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(200));
      if (stop_ || std::chrono::steady_clock::now() - last_ < limit_) continue;
      const std::string where = where_;
      lock.unlock();
      // The dump's CUDA calls may block too (a thread stuck in a synchronous copy can hold
      // the context): it runs on a thread of its own, given 10 s.
      std::atomic<bool> dumped{false};
      std::thread([&] {
        Dump(where);
        dumped.store(true);
      }).detach();
      const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (!dumped.load() && std::chrono::steady_clock::now() < end) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (!dumped.load()) {
        std::fprintf(stderr, "[hang watchdog] the dump itself blocked in a CUDA call\n");
      }
      std::fflush(nullptr);
      std::_Exit(3);
    }
  }

  /// `n` words at `src` by a kernel (bounded 1 s); empty on timeout.
  std::vector<uint64_t> Peek(const uint8_t* src, int n) {
    const uint64_t ticket = ++ticket_;
    if (!testing::PeekWordsAsync(src, n, host_, ticket, peek_).ok()) return {};
    volatile uint64_t* done = host_ + testing::kPeekWords;
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (*done != ticket) {
      if (std::chrono::steady_clock::now() > end) return {};
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return std::vector<uint64_t>(host_, host_ + n);
  }

  static std::string Words(const std::vector<uint64_t>& w, bool halves) {
    if (w.empty()) return "(the peek kernel did not finish within 1 s)";
    std::string out;
    for (uint64_t v : w) {
      if (halves) {
        absl::StrAppend(&out, " ", v & 0xffffffffu, " ", v >> 32);
      } else {
        absl::StrAppend(&out, " ", v);
      }
    }
    return out;
  }

  void Dump(const std::string& where) {
    std::fprintf(stderr, "[hang watchdog] no progress for %lld s; the scenario was at: %s\n",
                 static_cast<long long>(limit_.count()), where.c_str());
    for (size_t r = 0; r < streams_.size(); ++r) {
      std::fprintf(stderr, "[hang watchdog] test stream %zu: %s\n", r,
                   cudaGetErrorString(cudaStreamQuery(streams_[r])));
    }
    const int flag_words = (R_ + 1) / 2;
    for (int r = 0; r < R_; ++r) {
      const uint8_t* flags = bases_[r] + layout_.launch_flags.offset;
      const uint8_t* sync = bases_[r] + layout_.sync.offset;
      const uint8_t* ex = sync + kernels::cuda::kSyncLowLatencyExchangeOffset;
      std::string line = absl::StrCat(
          "rank ", r, ": ready_seq done_seq:", Words(Peek(flags, 2), false),
          "; go done instance:", Words(Peek(flags + abi::kProgramGoOffset, 3), false),
          "; status (bad ids, bad T, has bad T, timed out, missing):",
          Words(Peek(sync + kernels::cuda::kSyncStatusOffset, 3), true),
          "; ll state (dispatch_seq, combine_seq, tickets, aborted, T, T per buffer):",
          Words(Peek(sync + kernels::cuda::kSyncLowLatencyStateOffset, 4), true),
          "; count_flag:", Words(Peek(ex, flag_words), true),
          "; data_flag:", Words(Peek(ex + 4 * kernels::cuda::kMaxStatusRanks, flag_words), true),
          "; combine_flag:",
          Words(Peek(ex + 8 * kernels::cuda::kMaxStatusRanks, flag_words), true));
      std::fprintf(stderr, "[hang watchdog] %s\n", line.c_str());
    }
    // The same words of rank 0 by a device-to-host copy: does a copy get through?
    uint64_t* dst = host_ + testing::kPeekWords + 1;
    const cudaError_t err = cudaMemcpyAsync(dst, bases_[0] + layout_.launch_flags.offset, 16,
                                            cudaMemcpyDeviceToHost, copy_);
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    cudaError_t q = cudaErrorNotReady;
    while (err == cudaSuccess && (q = cudaStreamQuery(copy_)) == cudaErrorNotReady &&
           std::chrono::steady_clock::now() < end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::fprintf(stderr, "[hang watchdog] rank 0 ready_seq done_seq by cudaMemcpyAsync D2H: %s\n",
                 err != cudaSuccess       ? cudaGetErrorString(err)
                 : q == cudaSuccess       ? absl::StrCat(dst[0], " ", dst[1]).c_str()
                 : q == cudaErrorNotReady ? "the copy did not finish within 2 s"
                                          : cudaGetErrorString(q));
  }

  const int R_;
  const std::vector<const uint8_t*> bases_;
  const kernels::EndpointLayout layout_;
  const std::vector<cudaStream_t> streams_;
  const std::chrono::seconds limit_;
  uint64_t* host_ = nullptr;
  cudaStream_t peek_ = nullptr;
  cudaStream_t copy_ = nullptr;
  uint64_t ticket_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::string where_ = "start";
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
  std::thread thread_;
};

/// The whole scenario of the file comment for R virtual ranks.
void RunProgramScenario(const v1::GroupSpec& spec, const std::string& gpu_uuid, Client* client,
                        int replays = 100, bool ue8m0 = false) {
  {
    SCOPED_TRACE(SpecSummary(spec));
    const int R = spec.num_ranks(), Mll = spec.ll_max_tokens_per_rank(), H = spec.hidden();
    const GroupShape shape = ShapeOf(spec);
    const int K = spec.num_topk(), E = spec.num_experts();
    const int64_t El = shape.num_local_experts(), rows = shape.ll_rows_per_expert();
    std::vector<testing::CudaStream> streams;
    std::vector<std::unique_ptr<Endpoint>> eps;
    for (int r = 0; r < R; ++r) {
      auto s = testing::CudaStream::Create();
      ASSERT_TRUE(s.ok()) << s.status();
      streams.push_back(std::move(*s));
      JoinOptions o;
      o.spec = spec;
      o.rank = r;
      o.gpu_uuid = gpu_uuid;
      o.launch_mode = v1::LAUNCH_MODE_DAEMON;
      auto ep = client->Join(o);
      ASSERT_TRUE(ep.ok()) << ep.status();
      ASSERT_EQ((*ep)->info().launch_mode(), v1::LAUNCH_MODE_DAEMON);
      eps.push_back(std::move(*ep));
    }
    auto stream = [&](int r) { return streams[r].get(); };
    std::vector<const uint8_t*> bases;
    std::vector<cudaStream_t> raw_streams;
    for (int r = 0; r < R; ++r) {
      auto area = FindInProcessCudaArea(eps[r]->info().cuda_ipc_handle());
      ASSERT_TRUE(area.ok()) << area.status();
      bases.push_back(static_cast<const uint8_t*>(*area));
      raw_streams.push_back(stream(r));
    }
    HangWatchdog watchdog(R, bases, kernels::EndpointLayout::Compute(shape), raw_streams,
                          std::chrono::seconds(15));
    auto Phase = [&](int /*R*/, const std::string& what) {
      epd::Phase(R, what);
      watchdog.Beat(what);
    };

    // Registration: every rank, the same program.
    const std::vector<ProgramStep> program = {
        {ProgramStep::Op::kLowLatencyDispatch, /*use_fp8=*/true, /*round_scale=*/ue8m0,
         /*use_ue8m0=*/ue8m0},
        {ProgramStep::Op::kLowLatencyCombine, false, false}};
    Phase(R, "joined");
    for (const absl::Status& st :
         OnEveryRank(R, [&](int r) { return eps[r]->RegisterProgram(program, kWait); })) {
      ASSERT_TRUE(st.ok()) << st;
    }
    Phase(R, "registered");

    // Capture per rank: dispatch step → FP8 expert → combine step.
    struct RankGraph {
      DeviceBuffer dx, didx, dw, dT;
      std::vector<int64_t> xs, ks, ns;
      DLTensor x, idx, w, T;
      LowLatencyDispatchResult d;
      TensorView combined;
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
    };
    std::vector<RankGraph> rg(R);
    for (int r = 0; r < R; ++r) {
      RankGraph& q = rg[r];
      q.dx = Zeros<bf16_bits>(static_cast<size_t>(Mll) * H);
      q.didx = Zeros<int64_t>(static_cast<size_t>(Mll) * K);
      q.dw = Zeros<float>(static_cast<size_t>(Mll) * K);
      q.dT = Zeros<int32_t>(1);
      q.xs = {Mll, H};
      q.ks = {Mll, K};
      q.ns = {1};
      const DLDevice dev{kDLCUDA, g_device};
      q.x = MakeDLTensor(q.dx.get(), kBf16, q.xs, dev);
      q.idx = MakeDLTensor(q.didx.get(), kI64, q.ks, dev);
      q.w = MakeDLTensor(q.dw.get(), kF32, q.ks, dev);
      q.T = MakeDLTensor(q.dT.get(), kI32, q.ns, dev);
      cudaStream_t s = stream(r);
      ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
      testing::EndCaptureOnExit end_capture(s);
      ProgramDispatchArgs da;
      da.x = &q.x;
      da.topk_idx = &q.idx;
      da.num_tokens = &q.T;
      da.stream = s;
      auto d = eps[r]->RunProgramDispatch(da);
      ASSERT_TRUE(d.ok()) << d.status();
      q.d = *d;
      ASSERT_EQ(q.d.recv_x.shape(), (std::vector<int64_t>{El, rows, H}));
      const int64_t cols = ue8m0 ? H / 512 : H / 128;
      ASSERT_EQ(q.d.recv_scales.shape(), (std::vector<int64_t>{El, rows, cols}));
      ASSERT_EQ(q.d.recv_scales.strides(), (std::vector<int64_t>{cols * rows, 1, rows}));
      ASSERT_EQ(q.d.recv_scales.dl().dtype.code, ue8m0 ? kDLInt : kDLFloat);
      const TensorView expert_out = eps[r]->LowLatencyCombineInput();
      ASSERT_TRUE(testing::LaunchDequantScaleExperts(q.d.recv_x.as<kernels::e4m3_bits>(),
                                                     q.d.recv_scales.data(), ue8m0,
                                                     expert_out.as<bf16_bits>(), El, rows, H, s)
                      .ok());
      ProgramCombineArgs ca;
      ca.x = &expert_out.dl();
      ca.topk_idx = &q.idx;
      ca.topk_weights = &q.w;
      ca.stream = s;
      auto c = eps[r]->RunProgramCombine(ca);
      ASSERT_TRUE(c.ok()) << c.status();
      q.combined = c->combined_x;
      ASSERT_EQ(cudaStreamEndCapture(s, &q.graph), cudaSuccess);
      ASSERT_EQ(cudaGraphInstantiate(&q.exec, q.graph, 0), cudaSuccess);
    }
    // A step out of program order is refused (the next step is the dispatch again).
    {
      ProgramCombineArgs ca;
      ca.stream = stream(0);
      auto c = eps[0]->RunProgramCombine(ca);
      EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
    }

    std::mt19937_64 rng(777 + R);
    // Writes replay inputs (T and rows past T: out-of-range ids) on each rank's stream.
    auto stage = [&](std::vector<RankInputs>& in) {
      for (int r = 0; r < R; ++r) {
        RankInputs& ri = in[r];
        std::vector<bf16_bits> x_cap = ri.x;
        x_cap.resize(static_cast<size_t>(Mll) * H, 0x7fc0);
        std::vector<int64_t> idx_cap = ri.idx;
        idx_cap.resize(static_cast<size_t>(Mll) * K, E + 5);
        std::vector<float> w_cap = ri.w;
        w_cap.resize(static_cast<size_t>(Mll) * K, 1.f);
        cudaStream_t s = stream(r);
        watchdog.Beat(absl::StrCat("staging the inputs of rank ", r));
        ASSERT_EQ(cudaMemcpyAsync(rg[r].dx.get(), x_cap.data(), x_cap.size() * 2,
                                  cudaMemcpyHostToDevice, s),
                  cudaSuccess);
        ASSERT_EQ(cudaMemcpyAsync(rg[r].didx.get(), idx_cap.data(), idx_cap.size() * 8,
                                  cudaMemcpyHostToDevice, s),
                  cudaSuccess);
        ASSERT_EQ(cudaMemcpyAsync(rg[r].dw.get(), w_cap.data(), w_cap.size() * 4,
                                  cudaMemcpyHostToDevice, s),
                  cudaSuccess);
        ASSERT_EQ(cudaMemcpyAsync(rg[r].dT.get(), &ri.T, 4, cudaMemcpyHostToDevice, s),
                  cudaSuccess);
        // Pageable sources; bounded, as every wait of this test.
        ASSERT_TRUE(DrainsWithin(s, std::chrono::milliseconds(20000))) << "stage rank " << r;
      }
    };
    auto random_inputs = [&](int replay) {
      std::vector<RankInputs> in(R);
      for (int r = 0; r < R; ++r) {
        RankInputs& ri = in[r];
        ri.T = replay == 0 ? Mll : (r + replay) % 7 == 0 ? 0 : static_cast<int>(rng() % (Mll + 1));
        testing::RoutingOptions routing;
        routing.masked_fraction = (replay % 3) * 0.25;
        if (replay % 10 == 9) routing.one_expert = replay % E;  // Every token to one expert.
        ri.x = testing::RandomBf16(static_cast<size_t>(ri.T) * H, rng);
        ri.idx = testing::RandomTopk(ri.T, K, E, routing, rng);
        ri.w = testing::RandomFloats(ri.idx.size(), rng, 0.f, 1.f);
      }
      return in;
    };
    // Launches every rank's graph, then waits for every stream (bounded).
    auto replay_all = [&]() {
      for (int r = 0; r < R; ++r) {
        watchdog.Beat(absl::StrCat("cudaGraphLaunch of rank ", r));
        ASSERT_EQ(cudaGraphLaunch(rg[r].exec, stream(r)), cudaSuccess);
      }
      watchdog.Beat("draining the replay's streams");
      for (int r = 0; r < R; ++r) {
        ASSERT_TRUE(DrainsWithin(stream(r), std::chrono::milliseconds(20000))) << "rank " << r;
      }
    };
    auto check = [&](const std::vector<RankInputs>& in, const std::string& what) {
      const std::vector<Blobs> want = HostProgram(shape, in, ue8m0);
      watchdog.Beat(absl::StrCat("reading the outputs back (", what, ")"));
      for (int r = 0; r < R; ++r) {
        const std::vector<uint8_t> count_bytes = Fetch(rg[r].d.recv_count.data(), 0, El * 4);
        const auto* count = reinterpret_cast<const int32_t*>(count_bytes.data());
        const Blobs got = OutputBlobs(
            shape, count, in[r].T,
            [&](int which, size_t off, size_t n) {
              const void* base = which == 0   ? rg[r].d.recv_x.data()
                                 : which == 1 ? rg[r].d.recv_src_info.data()
                                 : which == 2 ? rg[r].d.recv_scales.data()
                                              : rg[r].combined.data();
              return Fetch(base, off, n);
            },
            ue8m0);
        ASSERT_EQ(got.size(), want[r].size()) << what << " rank " << r;
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_TRUE(got[i].second == want[r][i].second)
              << what << " rank " << r << ": " << want[r][i].first << " differs from the host";
        }
      }
    };

    Phase(R, "captured");
    int checked = 0;
    for (int replay = 0; replay < replays; ++replay) {
      if (replay % 25 == 0) Phase(R, absl::StrCat("replay ", replay));
      watchdog.Beat(absl::StrCat("replay ", replay));
      std::vector<RankInputs> in = random_inputs(replay);
      stage(in);
      replay_all();
      if (::testing::Test::HasFatalFailure()) break;
      for (int r = 0; r < R; ++r) {
        watchdog.Beat(absl::StrCat("ProgramStatus of rank ", r, " after replay ", replay));
        absl::Status st = eps[r]->ProgramStatus();
        ASSERT_TRUE(st.ok()) << "replay " << replay << " rank " << r << ": " << st;
      }
      check(in, absl::StrCat("replay ", replay));
      if (::testing::Test::HasFailure()) break;
      ++checked;
    }
    EXPECT_EQ(checked, replays);
    Phase(R, absl::StrCat(checked, " replays checked"));

    // A bad expert id at rank 0: every rank's ProgramStatus reports it; the next replay is
    // correct.
    {
      std::vector<RankInputs> in = random_inputs(1);
      in[0].T = std::max(in[0].T, 1);
      in[0].x = testing::RandomBf16(static_cast<size_t>(in[0].T) * H, rng);
      in[0].idx = testing::RandomTopk(in[0].T, K, E, {}, rng);
      in[0].w = testing::RandomFloats(in[0].idx.size(), rng, 0.f, 1.f);
      in[0].idx[0] = E + 3;
      stage(in);
      replay_all();
      for (int r = 0; r < R; ++r) {
        absl::Status st = eps[r]->ProgramStatus();
        EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << "rank " << r << ": " << st;
        // The dispatch (step 0) and the combine (step 1) both see the id; the latest is
        // returned, naming the earlier one as not shown.
        EXPECT_NE(st.message().find("rank 0"), std::string::npos) << st;
        EXPECT_NE(st.message().find("program instance"), std::string::npos) << st;
        EXPECT_TRUE(eps[r]->ProgramStatus().ok()) << "reported once";
      }
      std::vector<RankInputs> good = random_inputs(2);
      stage(good);
      replay_all();
      for (int r = 0; r < R; ++r) EXPECT_TRUE(eps[r]->ProgramStatus().ok()) << "rank " << r;
      check(good, "replay after the bad id");
    }

    Phase(R, "bad id reported, next replay correct");
    // A ring op while armed: refused by the library at once (FAILED_PRECONDITION), with no
    // stream work and no ring slot; the daemon would refuse it too (graph_program_test in
    // tests/unit).
    {
      std::vector<int64_t> shape0{0, K};
      DLTensor empty = MakeDLTensor(nullptr, kI64, shape0, DLDevice{kDLCUDA, g_device});
      for (int r = 0; r < R; ++r) {
        auto op = eps[r]->GetDispatchLayout(empty, stream(r));
        EXPECT_EQ(op.status().code(), absl::StatusCode::kFailedPrecondition) << op.status();
        EXPECT_NE(op.status().message().find("graph-mode program armed"), std::string::npos)
            << op.status();
      }
    }

    // Rank 0 alone replays: its dispatch waits for peers that never come. Unregister
    // releases it (the peers' waiting instances run too), and later replays return at once.
    {
      std::vector<RankInputs> in = random_inputs(3);
      stage(in);
      ASSERT_EQ(cudaGraphLaunch(rg[0].exec, stream(0)), cudaSuccess);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      EXPECT_EQ(cudaStreamQuery(stream(0)), cudaErrorNotReady) << "rank 0 should be waiting";
      watchdog.Beat("UnregisterProgram while rank 0 waits alone");
      for (const absl::Status& st :
           OnEveryRank(R, [&](int r) { return eps[r]->UnregisterProgram(kWait); })) {
        EXPECT_TRUE(st.ok()) << st;
      }
      EXPECT_TRUE(DrainsWithin(stream(0), std::chrono::milliseconds(kOpTimeoutMs + 5000)));
      Phase(R, "unregistered: rank 0's lone replay released");
      for (int r = 0; r < R; ++r) {
        ASSERT_EQ(cudaGraphLaunch(rg[r].exec, stream(r)), cudaSuccess);
        EXPECT_TRUE(DrainsWithin(stream(r), std::chrono::milliseconds(5000)))
            << "rank " << r << ": a replay after UnregisterProgram must not wait";
      }
      // No program: a step is refused on the host.
      ProgramDispatchArgs da;
      da.stream = stream(0);
      EXPECT_EQ(eps[0]->RunProgramDispatch(da).status().code(),
                absl::StatusCode::kFailedPrecondition);
    }

    Phase(R, "replays after unregister return at once");
    // Ring ops run again (after the daemon reset the kernels' sync state).
    {
      std::vector<int64_t> xs{Mll, H}, ks{Mll, K};
      std::vector<RankInputs> in = random_inputs(4);
      stage(in);
      std::vector<PendingOp<LowLatencyDispatchResult>> ops;
      std::vector<std::vector<int64_t>> xsh(R), ksh(R);
      std::vector<DLTensor> x(R), idx(R);
      for (int r = 0; r < R; ++r) {
        xsh[r] = {in[r].T, H};
        ksh[r] = {in[r].T, K};
        x[r] = MakeDLTensor(rg[r].dx.get(), kBf16, xsh[r], DLDevice{kDLCUDA, g_device});
        idx[r] = MakeDLTensor(rg[r].didx.get(), kI64, ksh[r], DLDevice{kDLCUDA, g_device});
        LowLatencyDispatchArgs a;
        a.x = &x[r];
        a.topk_idx = &idx[r];
        a.use_fp8 = true;
        a.stream = stream(r);
        auto op = eps[r]->LowLatencyDispatch(a);
        ASSERT_TRUE(op.ok()) << op.status();
        ops.push_back(*op);
      }
      watchdog.Beat("waiting for the ring ops after UnregisterProgram");
      for (int r = 0; r < R; ++r) {
        auto res = ops[r].Wait(kWait);
        EXPECT_TRUE(res.ok()) << "rank " << r << ": " << res.status();
      }
    }
    for (auto& q : rg) {
      cudaGraphExecDestroy(q.exec);
      cudaGraphDestroy(q.graph);
    }
    for (int r = 0; r < R; ++r) {
      ASSERT_TRUE(DrainsWithin(stream(r), std::chrono::milliseconds(20000))) << "rank " << r;
    }
    Phase(R, "ring ops run again: done");
  }
}

TEST_F(GraphProgramTest, TwoRanks) {
  RunProgramScenario(Spec("program-2", 2, 256, 32), Epd()->gpu_uuid(), &Epd()->client());
}

// Run it in a process of its own (--gtest_filter): in-process, the daemon's streams and
// the client's share the GPU's CUDA_DEVICE_MAX_CONNECTIONS (32) hardware queues, and a
// stream memory wait at the head of a shared queue holds every stream behind it; 8 ranks
// use 25 streams (8 daemon + 1 daemon aux + 8 client aux + 8 test streams).
TEST_F(GraphProgramTest, EightRanks) {
  RunProgramScenario(Spec("program-8", 8, 256, 32), Epd()->gpu_uuid(), &Epd()->client());
}

// A program whose dispatch takes the large path (Mll = 1024, K = 48 > 32), 20 replays. In a
// process of its own too.
TEST_F(GraphProgramTest, TwoRanksLargeCapacityAndTopk) {
  RunProgramScenario(Spec("program-large", 2, 256, 1024, /*E=*/64, /*K=*/48), Epd()->gpu_uuid(),
                     &Epd()->client(), /*replays=*/20);
}

// The same with UE8M0-packed scales (use_ue8m0 with round_scale; H % 512 == 0): the step's
// recv_scales view is int32 [E/R, R*Mll, H/512] and the toy expert decodes the exponents.
// In a process of its own too.
TEST_F(GraphProgramTest, TwoRanksUe8m0Scales) {
  RunProgramScenario(Spec("program-ue8m0", 2, 1024, 32), Epd()->gpu_uuid(), &Epd()->client(),
                     /*replays=*/30, /*ue8m0=*/true);
}

}  // namespace
}  // namespace epd
