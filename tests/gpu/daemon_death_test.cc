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
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "client/cuda/cuda_ipc.h"
#include "epd/client.h"
#include "tests/common/daemon_process.h"
#include "tests/common/dtypes.h"
#include "tests/common/on_every_rank.h"
#include "tests/gpu/gpu_test_util.h"

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

TEST(DaemonDeathTest, StreamOfAnOpInFlightIsReleasedWhenEpdIsKilled) {
  std::string why;
  if (!testing::HaveGpu(&why)) GTEST_SKIP() << why;
  DeadDaemonFixture fx;
  ASSERT_NO_FATAL_FAILURE(StartAndJoin(fx));
  std::vector<std::unique_ptr<Endpoint>>& eps = fx.eps;

  std::vector<uint16_t> x(kTokens * kHidden, 0x3f80);  // bf16 1.0
  std::vector<int64_t> idx(kTokens * kTopk, 5);        // all to rank 1's experts
  std::vector<int64_t> x_shape = {kTokens, kHidden}, idx_shape = {kTokens, kTopk};
  DLTensor xt = MakeDLTensor(x.data(), kBf16, x_shape, {kDLCPU, 0});
  DLTensor it = MakeDLTensor(idx.data(), kI64, idx_shape, {kDLCPU, 0});
  auto stream = CudaStream::Create();
  ASSERT_TRUE(stream.ok());
  LowLatencyDispatchArgs a;
  a.x = &xt;
  a.topk_idx = &it;
  a.stream = stream->get();
  auto op = eps[0]->LowLatencyDispatch(a);  // Rank 1 never submits.
  ASSERT_TRUE(op.ok()) << op.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(cudaStreamQuery(stream->get()), cudaErrorNotReady)
      << "the stream went on although the op cannot have finished";

  KillAndExpectStreamReleased(*fx.epd, stream->get());
  absl::StatusOr<LowLatencyDispatchResult> result = op->Wait(absl::Seconds(20));
  EXPECT_EQ(result.status().code(), absl::StatusCode::kUnavailable) << result.status();
  ASSERT_EQ(cudaStreamSynchronize(stream->get()), cudaSuccess);
}

// A program step of rank 0 alone: the daemon's instance runs its dispatch, which waits for
// rank 1 (op_timeout 60 s), so program_done stays 0 and the step's stream waits.
TEST(DaemonDeathTest, StreamOfAProgramStepIsReleasedWhenEpdIsKilled) {
  std::string why;
  if (!testing::HaveGpu(&why)) GTEST_SKIP() << why;
  DeadDaemonFixture fx;
  ASSERT_NO_FATAL_FAILURE(StartAndJoin(fx));
  const std::vector<ProgramStep> program = {{ProgramStep::Op::kLowLatencyDispatch},
                                            {ProgramStep::Op::kLowLatencyCombine}};
  for (const absl::Status& st : testing::OnEveryRank(
           2, [&](int r) { return fx.eps[r]->RegisterProgram(program, absl::Seconds(30)); })) {
    ASSERT_TRUE(st.ok()) << st;
  }
  // The step's inputs on the endpoint's GPU (a program step reads them at run time).
  absl::StatusOr<int> device = internal::DeviceOfUuid(fx.gpu_uuid);
  ASSERT_TRUE(device.ok()) << device.status();
  ASSERT_EQ(cudaSetDevice(*device), cudaSuccess);
  std::vector<uint16_t> x(kTokens * kHidden, 0x3f80);  // bf16 1.0
  std::vector<int64_t> idx(kTokens * kTopk, 5);        // all to rank 1's experts
  const int32_t t = kTokens;
  auto x_dev = testing::DeviceBuffer::Allocate(x.size() * sizeof(x[0]));
  auto idx_dev = testing::DeviceBuffer::Allocate(idx.size() * sizeof(idx[0]));
  auto t_dev = testing::DeviceBuffer::Allocate(sizeof(t));
  ASSERT_TRUE(x_dev.ok() && idx_dev.ok() && t_dev.ok());
  ASSERT_EQ(cudaMemcpy(x_dev->get(), x.data(), x_dev->bytes(), cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(idx_dev->get(), idx.data(), idx_dev->bytes(), cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(t_dev->get(), &t, sizeof(t), cudaMemcpyHostToDevice), cudaSuccess);
  const DLDevice on_gpu{kDLCUDA, *device};
  std::vector<int64_t> x_shape = {kTokens, kHidden}, idx_shape = {kTokens, kTopk}, t_shape = {1};
  DLTensor xt = MakeDLTensor(x_dev->get(), kBf16, x_shape, on_gpu);
  DLTensor it = MakeDLTensor(idx_dev->get(), kI64, idx_shape, on_gpu);
  DLTensor tt = MakeDLTensor(t_dev->get(), kI32, t_shape, on_gpu);
  auto stream = CudaStream::Create();
  ASSERT_TRUE(stream.ok());
  ProgramDispatchArgs a;
  a.x = &xt;
  a.topk_idx = &it;
  a.num_tokens = &tt;
  a.stream = stream->get();
  auto step = fx.eps[0]->RunProgramDispatch(a);  // Rank 1 never runs its step.
  ASSERT_TRUE(step.ok()) << step.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(cudaStreamQuery(stream->get()), cudaErrorNotReady)
      << "the stream went on although the step cannot have finished";

  const cudaError_t state =
      KillAndExpectStreamReleased(*fx.epd, stream->get(), /*kernel_running=*/true);
  // After an MPS fault the context is unusable: nothing more to check on it.
  if (state == cudaSuccess) ASSERT_EQ(cudaStreamSynchronize(stream->get()), cudaSuccess);
}

}  // namespace
}  // namespace epd
