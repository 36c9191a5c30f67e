// epd/kernels/cuda_ops.h CopyDeviceBatchAsync: a DoneWait the staging kernel could not run
// is refused with INVALID_ARGUMENT naming the field, before anything is launched. No GPU
// needed (every call here is refused on the host; the words are never touched); the waits
// themselves are tests/gpu/program_handoff_test.cc and ll_test.cu.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#if EPD_HAVE_CUDA
#include "epd/kernels/cuda_ops.h"

namespace epd {
namespace {

namespace kc = kernels::cuda;
using ::testing::HasSubstr;

constexpr int64_t kBound = 1'000'000'000;

/// CopyDeviceBatchAsync with no copies, `signal` and `wait`, on the legacy stream (every
/// call here is refused before a launch).
absl::Status Refused(uint64_t* signal, kc::DoneWait wait) {
  return kc::CopyDeviceBatchAsync(nullptr, 0, signal, 1, nullptr, nullptr, nullptr, wait);
}

TEST(DoneWaitArgsTest, AWaitNeedsASignalAndABound) {
  uint64_t words[2] = {};
  kc::DoneWait wait;
  wait.flag = &words[1];
  wait.value = 1;
  wait.timeout_ns = kBound;
  absl::Status st = Refused(nullptr, wait);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("a done wait needs a signal (none)"));
  wait.timeout_ns = 0;
  st = Refused(&words[0], wait);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("done_wait.timeout_ns > 0 (got 0)"));
}

TEST(DoneWaitArgsTest, ClearNeedsAFlagAndAValue) {
  uint64_t words[2] = {};
  kc::DoneWait wait;
  wait.timeout_ns = kBound;
  wait.clear = true;
  absl::Status st = Refused(&words[0], wait);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("done_wait.clear needs done_wait.flag (null)"));
  wait.flag = &words[1];
  wait.value = 0;
  st = Refused(&words[0], wait);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("done_wait.value > 0 (got 0)"));
  EXPECT_EQ(words[0], 0u);
  EXPECT_EQ(words[1], 0u);
}

}  // namespace
}  // namespace epd
#endif  // EPD_HAVE_CUDA
