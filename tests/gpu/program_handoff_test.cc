// A graph-mode program step's wait for done in its staging kernel (epd/kernels/cuda_ops.h
// DoneWait with `clear`; client/endpoint/graph_program.cc HandOffProgramStep under MPS):
// the kernel stores go = 1, waits for program_done >= 1 and swaps 1 back to 0 itself (the
// acknowledgement ProgramAckAsync does after a stream wait otherwise). kProgramReleased
// (the daemon's Disarm, the client's ReleaseStreams) passes and stays; a timed-out wait
// leaves the word as it is; captured in a CUDA graph, each replay waits for the daemon
// again. The daemon's side (its stream's go wait, go = 0, the step kernel's done = 1) is
// written from the host here.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <thread>

#include "absl/status/status.h"
#include "common/cuda/cuda_handles.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_ops.h"
#include "proto/abi/launch_flags.h"
#include "tests/gpu/gpu_test_util.h"

namespace epd::testing {
namespace {

namespace kc = ::epd::kernels::cuda;

constexpr int64_t kBound = 10'000'000'000;  // A wait that must not time out here.

/// One program step's launch_flags words (go, done, the staging kernel's ticket word), a
/// staged input and its staging destination, and the client's stream.
class ProgramHandoffTest : public ::testing::Test {
 protected:
  void SetUp() override {
    REQUIRE_GPU();
    auto words = DeviceBuffer::Allocate(64);
    ASSERT_TRUE(words.ok()) << words.status();
    words_ = *std::move(words);
    go_ = reinterpret_cast<uint64_t*>(words_.get());
    done_ = go_ + 1;
    counter_ = reinterpret_cast<uint32_t*>(go_ + 2);
    src_ = go_ + 3;
    dst_ = go_ + 4;
    auto stream = CudaStream::Create();
    ASSERT_TRUE(stream.ok()) << stream.status();
    stream_ = *std::move(stream);
    EPD_ASSERT_OK(kc::PreloadKernels());
  }

  /// The step's hand-off as HandOffProgramStep enqueues it under MPS: one kernel that
  /// stages src → dst, stores go = 1 and waits for done >= 1 (`clear`: then 1 → 0).
  absl::Status Step(int64_t timeout_ns, bool clear = true) {
    const kc::DeviceCopy copy{dst_, src_, sizeof(uint64_t)};
    kc::DoneWait wait;
    wait.flag = done_;
    wait.value = 1;
    wait.timeout_ns = timeout_ns;
    wait.clear = clear;
    return kc::CopyDeviceBatchAsync(&copy, 1, go_, 1, counter_, stream_.get(), nullptr, wait);
  }

  static void Write(uint64_t* word, uint64_t v) {
    ASSERT_EQ(cudaMemcpy(word, &v, sizeof(v), cudaMemcpyHostToDevice), cudaSuccess);
  }

  /// Polls `word` until it reads `value` (bounded: 10 s, so a loaded machine does not fail).
  static uint64_t Eventually(const uint64_t* word, uint64_t value) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (ReadWord(word) != value && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return ReadWord(word);
  }

  /// The stream is still held (by the kernel's wait) 50 ms from now.
  bool StillWaiting() {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    return cudaStreamQuery(stream_.get()) == cudaErrorNotReady;
  }

  DeviceBuffer words_;
  uint64_t* go_ = nullptr;
  uint64_t* done_ = nullptr;
  uint32_t* counter_ = nullptr;
  uint64_t* src_ = nullptr;
  uint64_t* dst_ = nullptr;
  CudaStream stream_;
};

TEST_F(ProgramHandoffTest, DoneAlreadyOnePassesAndIsClearedToZero) {
  Write(src_, 0x5eed);
  Write(done_, 1);
  EPD_ASSERT_OK(Step(kBound));
  ASSERT_EQ(cudaStreamSynchronize(stream_.get()), cudaSuccess);
  EXPECT_EQ(ReadWord(go_), 1u);
  EXPECT_EQ(ReadWord(dst_), 0x5eedu) << "the input was not staged";
  EXPECT_EQ(ReadWord(done_), 0u) << "the wait did not acknowledge done";
  // Without `clear` (a daemon-launched op's done_seq wait) the word is only read.
  Write(done_, 1);
  EPD_ASSERT_OK(Step(kBound, /*clear=*/false));
  ASSERT_EQ(cudaStreamSynchronize(stream_.get()), cudaSuccess);
  EXPECT_EQ(ReadWord(done_), 1u);
}

TEST_F(ProgramHandoffTest, DoneWrittenDuringTheWaitPassesAndIsCleared) {
  Write(go_, 0);
  EPD_ASSERT_OK(Step(kBound));
  EXPECT_EQ(Eventually(go_, 1), 1u) << "go comes before the wait";
  EXPECT_TRUE(StillWaiting()) << "went on before done";
  Write(go_, 0);  // The daemon's stream, past its go wait.
  const auto start = std::chrono::steady_clock::now();
  Write(done_, 1);  // The step kernel's done.
  ASSERT_EQ(cudaStreamSynchronize(stream_.get()), cudaSuccess);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_EQ(ReadWord(done_), 0u);
  EXPECT_EQ(ReadWord(go_), 0u) << "the kernel wrote go again after its signal";
}

TEST_F(ProgramHandoffTest, ReleasedPassesAndStays) {
  // Disarmed before the step (the daemon's done = kProgramReleased stays for every step).
  Write(done_, abi::kProgramReleased);
  EPD_ASSERT_OK(Step(kBound));
  ASSERT_EQ(cudaStreamSynchronize(stream_.get()), cudaSuccess);
  EXPECT_EQ(ReadWord(done_), abi::kProgramReleased);
  EPD_ASSERT_OK(Step(kBound));
  ASSERT_EQ(cudaStreamSynchronize(stream_.get()), cudaSuccess);
  EXPECT_EQ(ReadWord(done_), abi::kProgramReleased);
  // Released while the step waits (the client's ReleaseStreams when the daemon is gone).
  Write(done_, 0);
  Write(go_, 0);
  EPD_ASSERT_OK(Step(kBound));
  EXPECT_EQ(Eventually(go_, 1), 1u);
  EXPECT_TRUE(StillWaiting());
  Write(done_, abi::kProgramReleased);
  ASSERT_EQ(cudaStreamSynchronize(stream_.get()), cudaSuccess);
  EXPECT_EQ(ReadWord(done_), abi::kProgramReleased);
}

TEST_F(ProgramHandoffTest, TimedOutWaitLeavesDoneAlone) {
  Write(done_, 0);
  const auto start = std::chrono::steady_clock::now();
  EPD_ASSERT_OK(Step(/*timeout_ns=*/50'000'000));
  ASSERT_EQ(cudaStreamSynchronize(stream_.get()), cudaSuccess);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, std::chrono::milliseconds(45)) << "did not wait for the bound";
  EXPECT_LT(took, std::chrono::seconds(2));
  EXPECT_EQ(ReadWord(done_), 0u);
  EXPECT_EQ(ReadWord(go_), 1u);
}

// HandOffProgramStep's capture: one kernel node, replayed as is. Each replay stores go,
// waits for the daemon's done and leaves 0 for the next: the second replay waits again
// (with the acknowledgement missing, done would still be 1 and it would pass at once).
TEST_F(ProgramHandoffTest, CapturedStepWaitsForTheDaemonOnEveryReplay) {
  cudaGraph_t captured = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream_.get(), cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const absl::Status st = Step(kBound);
  ASSERT_EQ(cudaStreamEndCapture(stream_.get(), &captured), cudaSuccess);
  GraphHandle graph(captured);
  EPD_ASSERT_OK(st);
  cudaGraphExec_t instantiated = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&instantiated, graph.get(), 0), cudaSuccess);
  GraphExecHandle exec(instantiated);
  for (uint64_t replay = 1; replay <= 2; ++replay) {
    SCOPED_TRACE(replay);
    Write(src_, 100 + replay);
    ASSERT_EQ(cudaGraphLaunch(exec.get(), stream_.get()), cudaSuccess);
    EXPECT_EQ(Eventually(go_, 1), 1u);
    EXPECT_TRUE(StillWaiting()) << "the replay went on without the daemon's done";
    EXPECT_EQ(ReadWord(dst_), 100 + replay) << "staged before go";
    Write(go_, 0);    // The daemon's instance passes its go wait...
    Write(done_, 1);  // ...and its step kernel stores done.
    ASSERT_EQ(cudaStreamSynchronize(stream_.get()), cudaSuccess);
    EXPECT_EQ(ReadWord(done_), 0u) << "not acknowledged";
  }
}

TEST_F(ProgramHandoffTest, ClearNeedsAFlagAndAValue) {
  Write(go_, 0);
  kc::DoneWait wait;
  wait.timeout_ns = kBound;
  wait.clear = true;  // No flag.
  absl::Status st =
      kc::CopyDeviceBatchAsync(nullptr, 0, go_, 1, counter_, stream_.get(), nullptr, wait);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("done_wait.clear needs done_wait.flag"), std::string::npos) << st;
  wait.flag = done_;
  wait.value = 0;
  st = kc::CopyDeviceBatchAsync(nullptr, 0, go_, 1, counter_, stream_.get(), nullptr, wait);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("done_wait.value > 0 (got 0)"), std::string::npos) << st;
  ASSERT_EQ(cudaStreamSynchronize(stream_.get()), cudaSuccess);
  EXPECT_EQ(ReadWord(go_), 0u) << "a refused call launched something";
}

}  // namespace
}  // namespace epd::testing
