// A daemon-launched op's stream when epd dies mid-op (client/endpoint/endpoint.cc
// Endpoint::Impl::ReleaseStreams): rank 0 of a 2-rank group submits a low-latency
// dispatch whose peer never comes, so its stream waits for done_seq (a cuStreamWaitValue64
// without MPS; the staging kernel's own wait, kc::DoneWait, under MPS). epd is then
// SIGKILLed: the library sees its session end and writes done_seq = kReleasedSeq from the
// host, so the stream goes on within seconds, far before the op's timeout (60 s here) or
// the kernel wait's own bound, and Wait returns UNAVAILABLE.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "epd/client.h"
#include "tests/common/daemon_process.h"
#include "tests/common/dtypes.h"
#include "tests/gpu/gpu_test_util.h"

namespace epd {
namespace {

using ::epd::testing::kBf16;
using ::epd::testing::kI64;

using ::epd::testing::CudaStream;
using ::epd::testing::DaemonProcess;
using ::epd::testing::DaemonProcessOptions;

TEST(DaemonDeathTest, StreamOfAnOpInFlightIsReleasedWhenEpdIsKilled) {
  std::string why;
  if (!testing::HaveGpu(&why)) GTEST_SKIP() << why;
  DaemonProcessOptions o;
  o.backend = "cuda";
  o.tcp = false;
  o.extra_args = {"--op_timeout=60s"};
  o.start_timeout = absl::Seconds(60);
  auto epd = DaemonProcess::Start(o);
  ASSERT_TRUE(epd.ok()) << epd.status();

  ClientOptions co;
  co.socket_path = (*epd)->socket_path();
  co.client_name = "daemon_death_test";
  auto client = Client::Connect(co);
  ASSERT_TRUE(client.ok()) << client.status();
  auto stats = (*client)->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_GT(stats->gpus_size(), 0);

  constexpr int32_t kTokens = 4, kHidden = 256, kTopk = 2;
  JoinOptions jo;
  jo.spec.set_name("death");
  jo.spec.set_num_ranks(2);
  jo.spec.set_num_experts(8);
  jo.spec.set_hidden(kHidden);
  jo.spec.set_num_topk(kTopk);
  jo.spec.set_max_tokens_per_rank(16);
  jo.spec.set_ll_max_tokens_per_rank(16);
  jo.gpu_uuid = stats->gpus(0).uuid();
  jo.launch_mode = v1::LAUNCH_MODE_DAEMON;
  std::vector<std::unique_ptr<Endpoint>> eps;
  for (int32_t r = 0; r < 2; ++r) {
    jo.rank = r;
    auto ep = (*client)->Join(jo);
    ASSERT_TRUE(ep.ok()) << ep.status();
    eps.push_back(std::move(*ep));
  }

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

  (*epd)->Kill();
  const auto killed = std::chrono::steady_clock::now();
  cudaError_t state = cudaErrorNotReady;
  while (state == cudaErrorNotReady &&
         std::chrono::steady_clock::now() - killed < std::chrono::seconds(20)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    state = cudaStreamQuery(stream->get());
  }
  EXPECT_EQ(state, cudaSuccess) << "the stream was not released within 20 s of epd's death";
  EXPECT_LT(std::chrono::steady_clock::now() - killed, std::chrono::seconds(10));
  absl::StatusOr<LowLatencyDispatchResult> result = op->Wait(absl::Seconds(20));
  EXPECT_EQ(result.status().code(), absl::StatusCode::kUnavailable) << result.status();
  ASSERT_EQ(cudaStreamSynchronize(stream->get()), cudaSuccess);
}

}  // namespace
}  // namespace epd
