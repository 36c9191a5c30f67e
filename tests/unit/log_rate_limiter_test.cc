// LogRateLimiter (daemon/core/logging.h): the token bucket behind every client-caused warning of
// the data plane, one per uid shared by all of its endpoints and groups on every engine
// thread. A flood gives at most the burst plus the steady rate, then one line that counts
// what was dropped and names the client and its last source; deciding allocates nothing.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "daemon/core/logging.h"
#include "spdlog/sinks/ostream_sink.h"
#include "tests/common/counting_new.h"

namespace epd {
namespace {

using Clock = LogRateLimiter::Clock;
using std::chrono::milliseconds;

TEST(LogRateLimiterTest, BurstThenSteadyRateAndTheReportCountsTheSuppressedLines) {
  LogRateLimiter limiter(/*per_second=*/2, /*burst=*/3);
  const Clock::time_point t0 = Clock::now();
  for (int i = 0; i < 3; ++i) {
    const LogRateLimiter::Decision d = limiter.Allow("x", t0);
    EXPECT_TRUE(d.log) << i;
    EXPECT_EQ(d.suppressed, 0u) << i;
  }
  for (int i = 0; i < 100; ++i) EXPECT_FALSE(limiter.Allow("x", t0).log) << i;
  EXPECT_EQ(limiter.suppressed(), 100u);
  // 0.25 s later: half a token, still suppressed.
  EXPECT_FALSE(limiter.Allow("x", t0 + milliseconds(250)).log);
  // 0.5 s after the flood began: one token; the line carries the count of the 101 before it.
  const LogRateLimiter::Decision d = limiter.Allow("x", t0 + milliseconds(500));
  ASSERT_TRUE(d.log);
  EXPECT_EQ(d.suppressed, 101u);
  EXPECT_NEAR(d.suppressed_seconds, 0.5, 1e-6);
  EXPECT_EQ(limiter.suppressed(), 0u);
  // Refilling stops at the burst.
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(limiter.Allow("x", t0 + std::chrono::seconds(60)).log);
  EXPECT_FALSE(limiter.Allow("x", t0 + std::chrono::seconds(60)).log);
}

TEST(LogRateLimiterTest, TakeReportWaitsForATokenAndFlushDoesNot) {
  LogRateLimiter limiter(/*per_second=*/1, /*burst=*/1);
  const Clock::time_point t0 = Clock::now();
  EXPECT_FALSE(limiter.TakeReport(t0).log);  // Nothing suppressed.
  EXPECT_TRUE(limiter.Allow("x", t0).log);
  EXPECT_FALSE(limiter.Allow("x", t0).log);
  EXPECT_FALSE(limiter.Allow("x", t0).log);
  EXPECT_FALSE(limiter.TakeReport(t0 + milliseconds(500)).log);  // No token yet.
  const LogRateLimiter::Decision report = limiter.TakeReport(t0 + milliseconds(1000));
  ASSERT_TRUE(report.log);
  EXPECT_EQ(report.suppressed, 2u);
  EXPECT_FALSE(limiter.TakeReport(t0 + std::chrono::seconds(10)).log);  // Reported once.
  EXPECT_FALSE(limiter.Allow("x", t0 + milliseconds(1000)).log);  // The report took the token.
  const LogRateLimiter::Decision flushed = limiter.Flush(t0 + milliseconds(1000));
  EXPECT_TRUE(flushed.log);
  EXPECT_EQ(flushed.suppressed, 1u);
  EXPECT_FALSE(limiter.Flush(t0 + milliseconds(1000)).log);
}

TEST(LogRateLimiterTest, AFloodThroughLogLimitedGivesBoundedLinesNamingTheSource) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_st>(out);
  spdlog::logger log("epd.test", sink);
  log.set_pattern("%v");
  log.set_level(spdlog::level::info);
  LogRateLimiter limiter;
  const auto start = Clock::now();
  for (int i = 0; i < 20000; ++i) {
    LogLimited(log, spdlog::level::warn, limiter, "group g rank 1 (endpoint 7)",
               "group {} rank {}: dropped a malformed ring slot {}", "g", 1, i);
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  // Suppressed lines are reported once a token is back.
  const auto later = Clock::now() + std::chrono::seconds(1);
  while (!LogSuppressed(log, spdlog::level::warn, limiter) && Clock::now() < later) {
  }
  std::vector<std::string> lines = absl::StrSplit(out.str(), '\n', absl::SkipEmpty());
  const size_t bound = static_cast<size_t>(LogRateLimiter::kDefaultBurst +
                                           LogRateLimiter::kDefaultPerSecond * (seconds + 1)) +
                       2;
  EXPECT_LE(lines.size(), bound) << out.str().substr(0, 2000);
  EXPECT_GE(lines.size(), static_cast<size_t>(LogRateLimiter::kDefaultBurst) + 1);
  ASSERT_FALSE(lines.empty());
  EXPECT_TRUE(absl::StrContains(lines.back(),
                                "similar messages from group g rank 1 (endpoint 7) "
                                "suppressed in the last"))
      << lines.back();
  // The first lines are the flood's own, in full.
  EXPECT_EQ(lines.front(), "group g rank 1: dropped a malformed ring slot 0");
}

TEST(LogRateLimiterTest, AClientsBudgetIsSharedByItsSourcesAndItsReportNamesTheLastOne) {
  // One uid's budget: its endpoints in two groups draw from the same tokens, and the report
  // names the uid and the source of the last line it suppressed.
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_st>(out);
  spdlog::logger log("epd.test", sink);
  log.set_pattern("%v");
  LogRateLimiter budget(/*per_second=*/0.001, /*burst=*/4, "uid 1000");
  for (int i = 0; i < 100; ++i) {
    const bool a = i % 2 == 0;
    LogLimited(log, spdlog::level::warn, budget,
               a ? "group a rank 0 (endpoint 1)" : "group b rank 1 (endpoint 2)", "line {}", i);
  }
  EXPECT_EQ(budget.suppressed(), 96u);
  const LogRateLimiter::Decision report = budget.Flush();
  ASSERT_TRUE(report.log);
  EXPECT_EQ(report.suppressed, 96u);
  EXPECT_EQ(report.last(), "group b rank 1 (endpoint 2)");
  LogSuppressedReport(log, spdlog::level::warn, budget, report);
  std::vector<std::string> lines = absl::StrSplit(out.str(), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 5u) << out.str();
  EXPECT_EQ(lines[0], "line 0");
  EXPECT_EQ(lines[3], "line 3");
  EXPECT_TRUE(absl::StartsWith(lines[4],
                               "96 similar messages from uid 1000 (last: group b rank 1 "
                               "(endpoint 2)) suppressed in the last "))
      << lines[4];
}

TEST(LogRateLimiterTest, ALongSourceIsCutInTheReport) {
  LogRateLimiter budget(/*per_second=*/0.001, /*burst=*/1, "uid 7");
  EXPECT_TRUE(budget.Allow("first").log);
  const std::string source(1000, 'g');
  EXPECT_FALSE(budget.Allow(source).log);
  const LogRateLimiter::Decision report = budget.Flush();
  EXPECT_EQ(report.last(), source.substr(0, LogRateLimiter::kMaxSourceBytes));
}

TEST(LogRateLimiterTest, EngineThreadsSharingABudgetLogOnlyItsBurstAndCountEveryOtherLine) {
  // Four engine threads, each with its own endpoints of the same uid: together they get
  // the uid's burst, not four bursts, and no line is lost from the count.
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  spdlog::logger log("epd.test", sink);
  log.set_pattern("%v");
  auto budget = std::make_shared<LogRateLimiter>(/*per_second=*/0.001, /*burst=*/10, "uid 1000");
  constexpr int kThreads = 4, kLines = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::string source = absl::StrCat("group g", t, " rank 0 (endpoint ", t, ")");
      for (int i = 0; i < kLines; ++i) {
        LogLimited(log, spdlog::level::warn, *budget, source, "thread {} line {}", t, i);
        LogSuppressed(log, spdlog::level::warn, *budget);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  std::vector<std::string> lines = absl::StrSplit(out.str(), '\n', absl::SkipEmpty());
  EXPECT_EQ(lines.size(), 10u) << out.str().substr(0, 2000);
  EXPECT_EQ(budget->suppressed(), uint64_t{kThreads} * kLines - 10);
}

TEST(LogRateLimiterTest, SuppressedLinesAreNeitherFormattedNorAllocated) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_st>(out);
  spdlog::logger log("epd.test", sink);
  LogRateLimiter limiter(/*per_second=*/0.001, /*burst=*/1);
  LogLimited(log, spdlog::level::warn, limiter, "x", "first {}", 1);
  const std::string long_source(500, 's');  // Cut when kept, never copied to the heap.
  const uint64_t before = testing::counting_new::t_allocs;
  for (int i = 0; i < 1000; ++i) {
    LogLimited(log, spdlog::level::warn, limiter, i % 2 ? "x" : absl::string_view(long_source),
               "line {} of {}", i, "a flood");
    LogSuppressed(log, spdlog::level::warn, limiter);
  }
  EXPECT_EQ(testing::counting_new::t_allocs - before, 0u);
  EXPECT_EQ(limiter.suppressed(), 1000u);
}

TEST(LogRateLimiterTest, LinesBelowTheLoggersLevelAreNotCounted) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_st>(out);
  spdlog::logger log("epd.test", sink);
  log.set_level(spdlog::level::err);
  LogRateLimiter limiter(/*per_second=*/1, /*burst=*/1);
  for (int i = 0; i < 10; ++i) LogLimited(log, spdlog::level::warn, limiter, "x", "hidden {}", i);
  EXPECT_EQ(limiter.suppressed(), 0u);
  EXPECT_TRUE(out.str().empty());
}

}  // namespace
}  // namespace epd
