// The client's own argument checks: saturating wait deadlines (client/endpoint/deadline.h),
// the UTF-8 checks of request text (client/request_text.h) and a DLTensor's byte_offset
// (client/endpoint/tensor_checks.h).
#include <chrono>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "client/endpoint/deadline.h"
#include "client/endpoint/tensor_checks.h"
#include "client/request_text.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace epd::internal {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

TEST(DeadlineAfterTest, SaturatesInsteadOfOverflowing) {
  const Clock::time_point start = Clock::now();
  EXPECT_EQ(DeadlineAfter(start, absl::InfiniteDuration()), Clock::time_point::max());
  EXPECT_EQ(DeadlineAfter(start, absl::Milliseconds(std::numeric_limits<int64_t>::max())),
            Clock::time_point::max());
  EXPECT_EQ(DeadlineAfter(start, absl::Nanoseconds(std::numeric_limits<int64_t>::max())),
            Clock::time_point::max());
  EXPECT_EQ(DeadlineAfter(start, absl::Seconds(3)), start + std::chrono::seconds(3));
  EXPECT_EQ(DeadlineAfter(start, absl::ZeroDuration()), start);
  EXPECT_EQ(DeadlineAfter(start, -absl::InfiniteDuration()), start);
  EXPECT_EQ(DeadlineAfter(start, absl::Milliseconds(std::numeric_limits<int64_t>::min())), start);
}

TEST(RequestTextTest, OnlyWellFormedUtf8WithoutNulWithinTheLimitPasses) {
  EXPECT_TRUE(CheckRequestText("f", "plain-ascii_1.0", 64).ok());
  EXPECT_TRUE(CheckRequestText("f", "gr\xc3\xbc\xc3\x9f \xe2\x82\xac \xf0\x9f\x98\x80", 64).ok());
  EXPECT_TRUE(CheckRequestText("f", "", 0).ok());
  for (const std::string bad : {std::string("\xff"), std::string("a\xc3"),  // Truncated.
                                std::string("\xc0\xaf"),                    // Overlong.
                                std::string("\xe0\x80\xaf"),                // Overlong.
                                std::string("\xed\xa0\x80"),                // Surrogate.
                                std::string("\xf4\x90\x80\x80"),            // > U+10FFFF.
                                std::string("\x80"), std::string("ab\xe2\x82")}) {
    SCOPED_TRACE(bad);
    absl::Status st = CheckRequestText("ClientOptions::client_name", bad, 64);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr("ClientOptions::client_name"));
    EXPECT_THAT(st.message(), HasSubstr("not valid UTF-8"));
  }
  absl::Status nul = CheckRequestText("g", std::string("a\0b", 3), 64);
  EXPECT_EQ(nul.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(nul.message(), HasSubstr("NUL byte at byte 1"));
  absl::Status long_text = CheckRequestText("g", std::string(65, 'x'), 64);
  EXPECT_EQ(long_text.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(long_text.message(), HasSubstr("65 bytes long; at most 64"));
}

TEST(RequestTextTest, SanitizeReplacesEachStrayByte) {
  EXPECT_EQ(SanitizeUtf8("ok \xc3\xbc"), "ok \xc3\xbc");
  EXPECT_EQ(SanitizeUtf8("a\xff\xfe"
                         "b\xc3"),
            "a??b?");
  EXPECT_EQ(ValidUtf8Prefix(SanitizeUtf8("\xed\xa0\x80x")), 4u);
}

DLTensor Bf16Tensor(void* data, int64_t* shape) {
  DLTensor t{};
  t.data = data;
  t.device = {kDLCPU, 0};
  t.ndim = 1;
  t.dtype = kBf16;
  t.shape = shape;
  return t;
}

TEST(TensorChecksTest, ByteOffsetThatWrapsOrSplitsAnElementIsRefused) {
  alignas(16) static uint16_t buffer[16];
  int64_t shape[1] = {4};
  DLTensor t = Bf16Tensor(buffer, shape);
  int64_t want[1] = {-1};
  t.byte_offset = 8;
  EXPECT_TRUE(CheckTensor(false, "Dispatch", "x", &t, {kBf16}, want).ok());

  t.byte_offset = static_cast<uint64_t>(-2);  // data - 2: before the caller's buffer.
  absl::Status st = CheckTensor(false, "Dispatch", "x", &t, {kBf16}, want);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("Dispatch: x.byte_offset=18446744073709551614"));

  // A misaligned data pointer that byte_offset brings back into alignment: not whole elements.
  t.data = reinterpret_cast<uint8_t*>(buffer) + 1;
  t.byte_offset = 1;
  st = CheckTensor(false, "Dispatch", "x", &t, {kBf16}, want);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("x.byte_offset=1 is not a multiple"));

  // An extent whose end passes the end of the address space.
  t.data = buffer;
  t.byte_offset = 0;
  shape[0] = std::numeric_limits<int64_t>::max();  // Its bytes overflow a uint64.
  want[0] = -1;
  st = CheckTensor(false, "Dispatch", "x", &t, {kBf16}, want);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("runs past the end of the address space"));
}

}  // namespace
}  // namespace epd::internal
