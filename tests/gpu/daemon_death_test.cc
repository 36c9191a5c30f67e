// A daemon-launched op's stream when epd dies mid-op (client/endpoint/endpoint.cc
// Endpoint::Impl::ReleaseStreams): rank 0 of a 2-rank group submits a low-latency
// dispatch whose peer never comes, so its stream waits for done_seq (a cuStreamWaitValue64
// without MPS; the staging kernel's own wait, kc::DoneWait, under MPS). epd is then
// SIGKILLed: the library sees its session end and writes done_seq = kReleasedSeq from the
// host, so the stream goes on within seconds, far before the op's timeout (60 s here) or
// the kernel wait's own bound, and Wait returns UNAVAILABLE. The same for a graph-mode
// program step (client/endpoint/graph_program.cc: a stream wait for program_done and an
// acknowledging kernel without MPS, the staging kernel's own wait with DoneWait::clear
// under MPS): the library writes program_done = kProgramReleased, which both pass.
//
// A graceful stop (SIGTERM) must not hurt the clients, with or without MPS: epd ends its
// kernels' waits (the shutdown word), disarms programs, waits for the clients' stagings
// still to come and for its streams, and releases every client wait on its memory before
// that memory goes (CudaDataPlaneImpl::Shutdown). The Sigterm* tests check that the
// clients' streams then end with cudaSuccess (never cudaErrorIllegalAddress), their ops fail
// with UNAVAILABLE, and epd exits 0 within kShutdownHardLimit.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/cuda/cuda_ipc.h"
#include "daemon/core/daemon.h"
#include "epd/client.h"
#include "tests/common/daemon_process.h"
#include "tests/common/dtypes.h"
#include "tests/common/on_every_rank.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/stream_delay.h"

namespace epd {
namespace {

using ::epd::testing::kBf16;
using ::epd::testing::kI32;
using ::epd::testing::kI64;

using ::epd::testing::CudaStream;
using ::epd::testing::DaemonProcess;
using ::epd::testing::DaemonProcessOptions;

constexpr int32_t kTokens = 4, kHidden = 256, kTopk = 2;

/// epd (CUDA backend, op_timeout 60 s) in a process of its own, a client of it and both
/// daemon-launched endpoints of a 2-rank group on its first GPU (`gpu_uuid`).
struct DeadDaemonFixture {
  std::unique_ptr<DaemonProcess> epd;
  std::unique_ptr<Client> client;
  std::string gpu_uuid;
  std::vector<std::unique_ptr<Endpoint>> eps;
};

/// Fills `fx` (a fatal test failure where a step fails).
void StartAndJoin(DeadDaemonFixture& fx) {
  DaemonProcessOptions o;
  o.backend = "cuda";
  o.tcp = false;
  o.extra_args = {"--op_timeout=60s"};
  o.start_timeout = absl::Seconds(60);
  auto epd = DaemonProcess::Start(o);
  ASSERT_TRUE(epd.ok()) << epd.status();
  fx.epd = std::move(*epd);

  ClientOptions co;
  co.socket_path = fx.epd->socket_path();
  co.client_name = "daemon_death_test";
  auto client = Client::Connect(co);
  ASSERT_TRUE(client.ok()) << client.status();
  fx.client = std::move(*client);
  auto stats = fx.client->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_GT(stats->gpus_size(), 0);

  JoinOptions jo;
  jo.spec.set_name("death");
  jo.spec.set_num_ranks(2);
  jo.spec.set_num_experts(8);
  jo.spec.set_hidden(kHidden);
  jo.spec.set_num_topk(kTopk);
  jo.spec.set_max_tokens_per_rank(16);
  jo.spec.set_ll_max_tokens_per_rank(16);
  fx.gpu_uuid = stats->gpus(0).uuid();
  jo.gpu_uuid = fx.gpu_uuid;
  jo.launch_mode = v1::LAUNCH_MODE_DAEMON;
  for (int32_t r = 0; r < 2; ++r) {
    jo.rank = r;
    auto ep = fx.client->Join(jo);
    ASSERT_TRUE(ep.ok()) << ep.status();
    fx.eps.push_back(std::move(*ep));
  }
}

/// Whether MPS serves this process's contexts on the current device.
bool MpsActive() {
  int device = 0, mps = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return mps != 0;
}

/// Kills epd and waits (up to 20 s) for `stream` to go on; it must within 10 s. Returns
/// the stream's state. With `kernel_running` (one of epd's kernels runs when it dies) under
/// MPS the stream may end with cudaErrorIllegalAddress instead of success: the client's
/// wait reads epd's allocations, gone, through its CUDA IPC mapping (seen on the H200 with
/// the stream wait and the kernel wait alike, Xid 31 in the client's process, the MPS
/// server tearing down only that process; docs/RELIABILITY.md). It must not hang either way.
cudaError_t KillAndExpectStreamReleased(DaemonProcess& epd, cudaStream_t stream,
                                        bool kernel_running = false) {
  epd.Kill();
  const auto killed = std::chrono::steady_clock::now();
  cudaError_t state = cudaErrorNotReady;
  while (state == cudaErrorNotReady &&
         std::chrono::steady_clock::now() - killed < std::chrono::seconds(20)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    state = cudaStreamQuery(stream);
  }
  EXPECT_NE(state, cudaErrorNotReady) << "the stream still waits 20 s after epd's death";
  if (kernel_running && MpsActive() && state == cudaErrorIllegalAddress) {
    std::printf("note: under MPS the stream ended with %s (epd killed mid-kernel)\n",
                cudaGetErrorString(state));
  } else {
    EXPECT_EQ(state, cudaSuccess) << "the stream did not go on cleanly after epd's death: "
                                  << cudaGetErrorString(state);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - killed, std::chrono::seconds(10));
  return state;
}

/// SIGTERMs epd (DaemonProcess::Stop, on a thread) and waits (up to 20 s) for every stream
/// of `streams` to go on: each must end with cudaSuccess, with or without MPS (a graceful
/// stop drains the GPU and releases the clients before epd's memory goes), and epd must
/// exit 0 within kShutdownHardLimit. Prints epd's shutdown line (what its drain did).
void StopAndExpectStreamsReleased(DaemonProcess& epd, const std::vector<cudaStream_t>& streams) {
  std::printf("MPS %s for this process\n", MpsActive() ? "active" : "not active");
  absl::StatusOr<int> exit_code = absl::UnknownError("epd was not stopped");
  absl::Duration stop_took;
  std::thread stopper([&] {
    const absl::Time t = absl::Now();
    exit_code = epd.Stop(absl::Seconds(10));
    stop_took = absl::Now() - t;
  });
  const auto stopped = std::chrono::steady_clock::now();
  for (size_t i = 0; i < streams.size(); ++i) {
    cudaError_t state = cudaErrorNotReady;
    while (state == cudaErrorNotReady &&
           std::chrono::steady_clock::now() - stopped < std::chrono::seconds(20)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      state = cudaStreamQuery(streams[i]);
    }
    EXPECT_EQ(state, cudaSuccess) << "stream " << i
                                  << " after epd's SIGTERM: " << cudaGetErrorString(state);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - stopped, std::chrono::seconds(10));
  stopper.join();
  ASSERT_TRUE(exit_code.ok()) << exit_code.status() << "\n" << epd.Logs();
  EXPECT_EQ(*exit_code, 0) << epd.Logs();
  EXPECT_LT(stop_took, kShutdownHardLimit) << epd.Logs();
  bool drained = false;
  for (absl::string_view line : absl::StrSplit(epd.Logs(), '\n')) {
    if (line.find("shutdown: stopped") == absl::string_view::npos) continue;
    std::printf("epd: %.*s\n", static_cast<int>(line.size()), line.data());
    drained = line.find("GPU work drained") != absl::string_view::npos;
  }
  EXPECT_TRUE(drained) << "epd did not log a drained GPU:\n" << epd.Logs();
  std::printf("SIGTERM to exit: %s\n", absl::FormatDuration(stop_took).c_str());
}

/// Low-latency dispatch inputs and a program step's T on the endpoints' GPU (a staging
/// kernel copies them on the op's stream; a host input's copy could block the submitting
/// thread behind a busy stream).
struct DeviceInputs {
  testing::DeviceBuffer x, idx, t;
  std::vector<int64_t> x_shape = {kTokens, kHidden}, idx_shape = {kTokens, kTopk}, t_shape = {1};
  DLTensor xt{}, it{}, tt{};
};

void MakeDeviceInputs(const std::string& gpu_uuid, DeviceInputs* in) {
  absl::StatusOr<int> device = internal::DeviceOfUuid(gpu_uuid);
  ASSERT_TRUE(device.ok()) << device.status();
  ASSERT_EQ(cudaSetDevice(*device), cudaSuccess);
  std::vector<uint16_t> x(kTokens * kHidden, 0x3f80);  // bf16 1.0
  std::vector<int64_t> idx(kTokens * kTopk, 5);        // all to rank 1's experts
  const int32_t t = kTokens;
  auto x_dev = testing::DeviceBuffer::Allocate(x.size() * sizeof(x[0]));
  auto idx_dev = testing::DeviceBuffer::Allocate(idx.size() * sizeof(idx[0]));
  auto t_dev = testing::DeviceBuffer::Allocate(sizeof(t));
  ASSERT_TRUE(x_dev.ok() && idx_dev.ok() && t_dev.ok());
  in->x = std::move(*x_dev);
  in->idx = std::move(*idx_dev);
  in->t = std::move(*t_dev);
  ASSERT_EQ(cudaMemcpy(in->x.get(), x.data(), in->x.bytes(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(in->idx.get(), idx.data(), in->idx.bytes(), cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(in->t.get(), &t, sizeof(t), cudaMemcpyHostToDevice), cudaSuccess);
  const DLDevice on_gpu{kDLCUDA, *device};
  in->xt = MakeDLTensor(in->x.get(), kBf16, in->x_shape, on_gpu);
  in->it = MakeDLTensor(in->idx.get(), kI64, in->idx_shape, on_gpu);
  in->tt = MakeDLTensor(in->t.get(), kI32, in->t_shape, on_gpu);
}

/// Rank `rank` submits a low-latency dispatch of `in` on `stream`, appended to `ops`.
void SubmitDispatch(DeadDaemonFixture& fx, int rank, DeviceInputs& in, cudaStream_t stream,
                    std::vector<PendingOp<LowLatencyDispatchResult>>* ops) {
  LowLatencyDispatchArgs a;
  a.x = &in.xt;
  a.topk_idx = &in.it;
  a.stream = stream;
  auto op = fx.eps[rank]->LowLatencyDispatch(a);
  ASSERT_TRUE(op.ok()) << op.status();
  ops->push_back(std::move(*op));
}

/// Rank 0 alone submits a low-latency dispatch on `stream` (rank 1 never does): nothing of
/// the op runs on the GPU, and the stream waits for its done_seq.
void SubmitLoneDispatch(DeadDaemonFixture& fx, DeviceInputs& in, cudaStream_t stream,
                        std::vector<PendingOp<LowLatencyDispatchResult>>* ops) {
  ASSERT_NO_FATAL_FAILURE(SubmitDispatch(fx, 0, in, stream, ops));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(cudaStreamQuery(stream), cudaErrorNotReady)
      << "the stream went on although the op cannot have finished";
}

/// Every op of `ops` fails with UNAVAILABLE (epd is gone or stopping).
void ExpectUnavailable(std::vector<PendingOp<LowLatencyDispatchResult>>& ops) {
  for (PendingOp<LowLatencyDispatchResult>& op : ops) {
    absl::StatusOr<LowLatencyDispatchResult> result = op.Wait(absl::Seconds(20));
    EXPECT_EQ(result.status().code(), absl::StatusCode::kUnavailable) << result.status();
  }
}

/// Both ranks register a dispatch → combine program; then rank 0 alone runs its first step
/// on `stream` (rank 1 never does): the daemon's instance runs its dispatch, which waits
/// for rank 1 (op_timeout 60 s), so program_done stays 0 and the step's stream waits.
void RunLoneProgramStep(DeadDaemonFixture& fx, DeviceInputs& in, cudaStream_t stream) {
  const std::vector<ProgramStep> program = {{ProgramStep::Op::kLowLatencyDispatch},
                                            {ProgramStep::Op::kLowLatencyCombine}};
  for (const absl::Status& st : testing::OnEveryRank(
           2, [&](int r) { return fx.eps[r]->RegisterProgram(program, absl::Seconds(30)); })) {
    ASSERT_TRUE(st.ok()) << st;
  }
  ProgramDispatchArgs a;
  a.x = &in.xt;
  a.topk_idx = &in.it;
  a.num_tokens = &in.tt;
  a.stream = stream;
  auto step = fx.eps[0]->RunProgramDispatch(a);
  ASSERT_TRUE(step.ok()) << step.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(cudaStreamQuery(stream), cudaErrorNotReady)
      << "the stream went on although the step cannot have finished";
}

/// epd with a 2-rank daemon-launched group (StartAndJoin), the ops' inputs on its GPU and a
/// stream of this process; skipped without a GPU.
class DaemonDeathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!testing::HaveGpu(&why)) GTEST_SKIP() << why;
    ASSERT_NO_FATAL_FAILURE(StartAndJoin(fx_));
    ASSERT_NO_FATAL_FAILURE(MakeDeviceInputs(fx_.gpu_uuid, &in_));
    auto stream = CudaStream::Create();
    ASSERT_TRUE(stream.ok());
    stream_ = std::move(*stream);
  }

  DeadDaemonFixture fx_;
  DeviceInputs in_;
  CudaStream stream_;
  std::vector<PendingOp<LowLatencyDispatchResult>> ops_;
};

TEST_F(DaemonDeathTest, StreamOfAnOpInFlightIsReleasedWhenEpdIsKilled) {
  ASSERT_NO_FATAL_FAILURE(SubmitLoneDispatch(fx_, in_, stream_.get(), &ops_));
  KillAndExpectStreamReleased(*fx_.epd, stream_.get());
  ExpectUnavailable(ops_);
  ASSERT_EQ(cudaStreamSynchronize(stream_.get()), cudaSuccess);
}

TEST_F(DaemonDeathTest, StreamOfAProgramStepIsReleasedWhenEpdIsKilled) {
  ASSERT_NO_FATAL_FAILURE(RunLoneProgramStep(fx_, in_, stream_.get()));
  const cudaError_t state =
      KillAndExpectStreamReleased(*fx_.epd, stream_.get(), /*kernel_running=*/true);
  // After an MPS fault the context is unusable: nothing more to check on it.
  if (state == cudaSuccess) ASSERT_EQ(cudaStreamSynchronize(stream_.get()), cudaSuccess);
}

// Rank 0 submits, rank 1 never does: the stop releases rank 0's stream (done_seq for an op
// that ended without its kernels) and its op fails with UNAVAILABLE.
TEST_F(DaemonDeathTest, SigtermReleasesTheStreamOfAnOpWaitingForAPeer) {
  ASSERT_NO_FATAL_FAILURE(SubmitLoneDispatch(fx_, in_, stream_.get(), &ops_));
  ASSERT_NO_FATAL_FAILURE(StopAndExpectStreamsReleased(*fx_.epd, {stream_.get()}));
  ExpectUnavailable(ops_);
  EXPECT_EQ(cudaStreamSynchronize(stream_.get()), cudaSuccess);
}

// Both ranks submit, but rank 1's stream is busy with its own work for 900 ms, so its
// staging kernel runs late: epd launches the op and its kernels wait (for rank 1's ready
// flag, and rank 0's for rank 1's data) when the SIGTERM comes. The stop ends those waits
// (the shutdown word), waits for rank 1's staging (it writes into epd's memory) and
// releases both clients' waits before epd's memory goes: under MPS a staging kernel or a
// done wait reading freed memory would fail the client's context (cudaErrorIllegalAddress).
TEST_F(DaemonDeathTest, SigtermWhileEpdsKernelsWaitForALateClientReleasesBothCleanly) {
  auto late = CudaStream::Create();
  ASSERT_TRUE(late.ok());
  ASSERT_TRUE(testing::DelayStreamAsync(late->get(), 900'000'000).ok());
  ASSERT_NO_FATAL_FAILURE(SubmitDispatch(fx_, 1, in_, late->get(), &ops_));
  ASSERT_NO_FATAL_FAILURE(SubmitDispatch(fx_, 0, in_, stream_.get(), &ops_));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // epd launches the op.
  EXPECT_EQ(cudaStreamQuery(stream_.get()), cudaErrorNotReady);

  ASSERT_NO_FATAL_FAILURE(StopAndExpectStreamsReleased(*fx_.epd, {stream_.get(), late->get()}));
  ExpectUnavailable(ops_);
  EXPECT_EQ(cudaStreamSynchronize(stream_.get()), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(late->get()), cudaSuccess);
}

// A program armed, rank 0's step in flight (its instance's dispatch waits for rank 1, which
// never runs its step): the stop ends that wait, disarms the program (rank 1's instances
// released, program_done = kProgramReleased) and releases rank 0's stream cleanly, with or
// without MPS; later calls of the endpoint fail with UNAVAILABLE.
TEST_F(DaemonDeathTest, SigtermWithAProgramStepInFlightReleasesItsStreamCleanly) {
  ASSERT_NO_FATAL_FAILURE(RunLoneProgramStep(fx_, in_, stream_.get()));
  ASSERT_NO_FATAL_FAILURE(StopAndExpectStreamsReleased(*fx_.epd, {stream_.get()}));
  EXPECT_EQ(cudaStreamSynchronize(stream_.get()), cudaSuccess);
  EXPECT_EQ(fx_.eps[0]->ProgramStatus().code(), absl::StatusCode::kUnavailable);
  // The context still works: a kernel of this process runs.
  ASSERT_TRUE(testing::DelayStreamAsync(stream_.get(), 1000).ok());
  EXPECT_EQ(cudaStreamSynchronize(stream_.get()), cudaSuccess);
}

}  // namespace
}  // namespace epd
