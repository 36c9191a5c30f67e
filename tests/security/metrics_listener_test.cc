// Hostile HTTP clients against a real epd's metrics listener (--metrics_listen, DESIGN.md
// §10): a flood of short header lines is refused past 8 KiB and epd's memory stays flat; a
// head sent one byte at a time is closed at the 5 s head timeout; idle connections one past
// the cap of 16 hold a scrape off at most one head timeout; scrapes work after each.
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"
#include "tests/common/raw_http.h"
#include "tests/common/subprocess.h"

namespace epd::testing {
namespace {

using ::testing::HasSubstr;

/// VmRSS of process `pid` in KiB (-1 when unreadable).
int64_t RssKib(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view value = line;
    if (absl::ConsumePrefix(&value, "VmRSS:")) {
      int64_t kib = -1;
      value = absl::StripSuffix(absl::StripAsciiWhitespace(value), "kB");
      return absl::SimpleAtoi(absl::StripAsciiWhitespace(value), &kib) ? kib : -1;
    }
  }
  return -1;
}

class MetricsListenerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    port_ = PickFreeTcpPort();
    ASSERT_GT(port_, 0);
    DaemonProcessOptions options = UnixSocketOnly();
    options.extra_args.push_back(absl::StrCat("--metrics_listen=127.0.0.1:", port_));
    absl::StatusOr<std::unique_ptr<DaemonProcess>> epd = DaemonProcess::Start(options);
    ASSERT_TRUE(epd.ok()) << epd.status();
    epd_ = *std::move(epd);
    ASSERT_THAT(RawGet(port_, "/metrics"), HasSubstr("epd_up"));
  }
  void TearDown() override {
    if (HasFailure() && epd_ != nullptr) std::cerr << "---- epd log ----\n" << epd_->Logs();
  }
  void ExpectScrapeAnswered(const std::string& when) {
    const absl::Time start = absl::Now();
    EXPECT_THAT(RawGet(port_, "/metrics"), HasSubstr("epd_up")) << when;
    EXPECT_LT(absl::Now() - start, absl::Seconds(1)) << when;
  }

  int port_ = 0;
  std::unique_ptr<DaemonProcess> epd_;
};

TEST_F(MetricsListenerTest, HeaderLineFloodIsRefusedAndMemoryStaysFlat) {
  const int64_t rss_before = RssKib(epd_->pid());
  ASSERT_GT(rss_before, 0);
  // 4 connections, each up to 16 MiB of short header lines: kept whole, that is ~64 MiB of
  // text and millions of header entries.
  constexpr size_t kFlood = size_t{16} << 20;
  for (int i = 0; i < 4; ++i) {
    FloodResult flood = FloodHeaderLines(port_, kFlood, absl::Seconds(10));
    EXPECT_TRUE(flood.refused || flood.reply.closed) << "flood " << i;
    EXPECT_LT(flood.sent, kFlood) << "flood " << i << " was taken whole";
    if (!flood.reply.bytes.empty()) {
      EXPECT_THAT(flood.reply.bytes, ::testing::StartsWith("HTTP/1.1 431 ")) << "flood " << i;
    }
  }
  const int64_t rss_after = RssKib(epd_->pid());
  EXPECT_LT(rss_after - rss_before, 8 * 1024)
      << "epd's RSS grew from " << rss_before << " KiB to " << rss_after << " KiB";
  ExpectScrapeAnswered("after the floods");
}

TEST_F(MetricsListenerTest, SlowHeadIsClosedAtTheHeadTimeout) {
  const absl::Duration held = SlowHeadHeldFor(port_, absl::Milliseconds(200), absl::Seconds(12));
  EXPECT_GE(held, absl::Milliseconds(4500));
  EXPECT_LT(held, absl::Seconds(7)) << "a head sent a byte at a time held its connection";
  ExpectScrapeAnswered("after the slow head");
}

TEST_F(MetricsListenerTest, IdleConnectionsPastTheCapHoldAScrapeOffAtMostOneHeadTimeout) {
  {
    // Below the cap idle connections hold nothing a scrape needs.
    std::vector<ScopedFd> idle = OpenIdleConnections(port_, 15);
    ExpectScrapeAnswered("beside 15 idle connections");
  }
  // The cap (16) plus one: the scrape waits in the listen queue until the 5 s head timeout
  // closes the idle ones.
  std::vector<ScopedFd> idle = OpenIdleConnections(port_, 17);
  const absl::Time start = absl::Now();
  EXPECT_THAT(RawGet(port_, "/metrics", absl::Seconds(15)), HasSubstr("epd_up"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(7));
  idle.clear();
  ExpectScrapeAnswered("after the idle connections");
}

}  // namespace
}  // namespace epd::testing
