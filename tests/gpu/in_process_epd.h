// An epd Daemon running the CUDA backend inside the test process, with one Client connected
// to it: what the tests of the client library's CUDA paths (client_launch_test.cc,
// graph_program_test.cc) share. The data areas the daemon exports are reached through
// FindInProcessCudaArea (CUDA cannot open an IPC handle in the exporting process). Also the
// helpers of tests that hold every rank of a group in this one process (graph_program_test.cc,
// cuda_hot_path_alloc_test.cc): DrainsWithin (and OnEveryRank, tests/common/on_every_rank.h).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/core/daemon.h"
#include "epd/client.h"
#include "tests/common/on_every_rank.h"
#include "tests/gpu/gpu_test_util.h"

namespace epd::testing {

class InProcessEpd {
 public:
  /// Starts a daemon (backend cuda, op_timeout `op_timeout_ms`, socket in a fresh temp dir
  /// named after `name`) and connects a client. FAILED_PRECONDITION when the daemon does
  /// not run the CUDA backend; the daemon's or the client's error otherwise.
  static absl::StatusOr<std::unique_ptr<InProcessEpd>> Start(const std::string& name,
                                                             uint32_t op_timeout_ms);
  InProcessEpd() = default;  ///< Empty; use Start.
  /// Closes the client, stops the daemon, removes the temp dir and the area resolver.
  ~InProcessEpd();
  InProcessEpd(const InProcessEpd&) = delete;
  InProcessEpd& operator=(const InProcessEpd&) = delete;

  Client& client() { return *client_; }
  /// UUID of the GPU the tests join (the daemon's first) and this process's ordinal of it.
  const std::string& gpu_uuid() const { return gpu_uuid_; }
  int device() const { return device_; }

 private:
  std::string dir_;
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<Client> client_;
  std::string gpu_uuid_;
  int device_ = 0;
};

/// Base of a test suite sharing one InProcessEpd (CRTP: each Suite has its own). Suite
/// defines `static constexpr const char* kSuiteName` and `uint32_t kSuiteOpTimeoutMs`.
/// Without a GPU every test skips with the reason; SetUp fails when the daemon did not
/// start and makes its GPU current.
template <typename Suite>
class InProcessEpdTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string why;
    if (!HaveGpu(&why)) {
      SkipReason() = why;
      return;
    }
    auto epd = InProcessEpd::Start(Suite::kSuiteName, Suite::kSuiteOpTimeoutMs);
    ASSERT_TRUE(epd.ok()) << epd.status();
    Epd() = std::move(*epd);
  }
  static void TearDownTestSuite() { Epd().reset(); }
  void SetUp() override {
    if (!SkipReason().empty()) GTEST_SKIP() << SkipReason();
    ASSERT_NE(Epd(), nullptr) << "the in-process epd did not start (see the first test)";
    ASSERT_EQ(cudaSetDevice(Epd()->device()), cudaSuccess);
  }
  /// The suite's daemon and client (null when it did not start).
  static std::unique_ptr<InProcessEpd>& Epd() {
    static std::unique_ptr<InProcessEpd> epd;
    return epd;
  }
  /// Why the suite skips (empty: it runs).
  static std::string& SkipReason() {
    static std::string reason;
    return reason;
  }
};

/// Waits (bounded: polls cudaStreamQuery every 1 ms) for `stream` to drain; false if it is
/// still busy after `limit`. A stream error is a test failure (ADD_FAILURE) and returns true.
inline bool DrainsWithin(cudaStream_t stream, std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaSuccess) return true;
    if (e != cudaErrorNotReady) {
      ADD_FAILURE() << "stream error: " << cudaGetErrorString(e);
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

}  // namespace epd::testing
