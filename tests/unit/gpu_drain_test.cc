// The graceful stop's GPU drain, without a GPU: the cadence at which the daemon's kernels
// read the shutdown word (kernels/include/epd/kernels/abort_poll.h, the same code the
// kernels' spin waits run), the drain's bounded polling and its report
// (daemon/dataplane/gpu_drain.h), and that its bound fits inside epd's stop limit.
#include "daemon/dataplane/gpu_drain.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/core/daemon.h"
#include "epd/kernels/abort_poll.h"

namespace epd {
namespace {

using kernels::cuda::AbortPoll;
using kernels::cuda::kAbortPollNs;
using kernels::cuda::SpinEnds;

TEST(AbortPollTest, AWaitReadsNothingDuringItsFirstPeriod) {
  AbortPoll poll;
  const uint64_t t0 = 1'000'000;
  EXPECT_FALSE(poll.Due(t0));
  EXPECT_FALSE(poll.Due(t0 + 1));
  EXPECT_FALSE(poll.Due(t0 + kAbortPollNs - 1));
  EXPECT_TRUE(poll.Due(t0 + kAbortPollNs));
  EXPECT_FALSE(poll.Due(t0 + kAbortPollNs + 1));  // The next period starts at the read.
  EXPECT_TRUE(poll.Due(t0 + 2 * kAbortPollNs));
}

// A spin of 10 ms at one iteration per 50 ns (200 000 iterations) reads the word once per
// period, not once per iteration: a read over the bus costs about 1-2 us.
TEST(AbortPollTest, ALongWaitReadsTheWordOncePerPeriod) {
  AbortPoll poll;
  int reads = 0;
  int iterations = 0;
  const uint64_t t0 = 5'000'000, deadline = t0 + 10'000'000;
  for (uint64_t now = t0;; now += 50, ++iterations) {
    const bool ended = SpinEnds(now, deadline, &poll, [&] {
      ++reads;
      return false;
    });
    if (ended) break;
  }
  EXPECT_EQ(iterations, 200'001);
  EXPECT_LE(reads, static_cast<int>(10'000'000 / kAbortPollNs));
  EXPECT_GE(reads, static_cast<int>(10'000'000 / kAbortPollNs) - 1);
}

// A wait whose op ends quickly (under one period) never reads the word at all.
TEST(AbortPollTest, AShortWaitNeverReadsTheWord) {
  AbortPoll poll;
  int reads = 0;
  for (uint64_t now = 0; now < kAbortPollNs; now += 100) {
    EXPECT_FALSE(SpinEnds(now + 1, ~uint64_t{0}, &poll, [&] {
      ++reads;
      return true;
    }));
  }
  EXPECT_EQ(reads, 0);
}

// The host raises the word while the wait spins (deadline far away, as op_timeout is): the
// wait ends within two periods of the store.
TEST(AbortPollTest, ARaisedWordEndsTheWaitWithinTwoPeriods) {
  for (const uint64_t raised_at : {uint64_t{0}, uint64_t{7'777}, uint64_t{3'000'000}}) {
    AbortPoll poll;
    const uint64_t t0 = 42;
    uint64_t ended_at = 0;
    for (uint64_t now = t0;; now += 30) {
      if (SpinEnds(now, t0 + 60'000'000'000ull, &poll, [&] { return now >= t0 + raised_at; })) {
        ended_at = now;
        break;
      }
    }
    EXPECT_GE(ended_at, t0 + raised_at);
    EXPECT_LE(ended_at, t0 + raised_at + 2 * kAbortPollNs) << "raised at +" << raised_at << " ns";
  }
}

TEST(AbortPollTest, TheDeadlineStillEndsAWaitWhoseWordStaysDown) {
  AbortPoll poll;
  EXPECT_FALSE(SpinEnds(100, 200, &poll, [] { return false; }));
  EXPECT_TRUE(SpinEnds(201, 200, &poll, [] { return false; }));
}

TEST(GpuDrainTest, PollUntilReturnsAtTheFirstTrue) {
  int calls = 0;
  const absl::Time start = absl::Now();
  EXPECT_TRUE(PollUntil([&] { return ++calls == 3; }, start + absl::Seconds(10)));
  EXPECT_EQ(calls, 3);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

TEST(GpuDrainTest, PollUntilEndsAtItsDeadline) {
  int calls = 0;
  const absl::Time start = absl::Now();
  EXPECT_FALSE(PollUntil(
      [&] {
        ++calls;
        return false;
      },
      start + absl::Milliseconds(50), absl::Milliseconds(5)));
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Milliseconds(50));
  EXPECT_LT(took, absl::Milliseconds(500));
  EXPECT_GE(calls, 2);
}

TEST(GpuDrainTest, PollUntilTriesOnceWhenTheDeadlineHasPassed) {
  int calls = 0;
  EXPECT_TRUE(PollUntil([&] { return ++calls > 0; }, absl::Now() - absl::Seconds(1)));
  EXPECT_EQ(calls, 1);
}

TEST(GpuDrainTest, TheReportSaysWhatWasStoppedAndHowLongTheGpuTook) {
  GpuDrainReport r;
  r.groups = 2;
  r.ops_failed = 3;
  r.programs_disarmed = 1;
  r.stagings_awaited = 1;
  r.staging_wait = absl::Milliseconds(12);
  r.took = absl::Milliseconds(15);
  const std::string line = DescribeGpuDrain(r);
  EXPECT_NE(line.find("stopped 2 group(s)"), std::string::npos) << line;
  EXPECT_NE(line.find("3 op(s) failed with UNAVAILABLE"), std::string::npos) << line;
  EXPECT_NE(line.find("1 graph-mode program(s) disarmed"), std::string::npos) << line;
  EXPECT_NE(line.find("GPU work drained in 15 ms"), std::string::npos) << line;
  EXPECT_EQ(line.find("NOT drained"), std::string::npos) << line;
}

TEST(GpuDrainTest, TheReportNamesWhatWasLeftBusyOrNeverStaged) {
  GpuDrainReport r;
  r.groups = 1;
  r.busy = {"group g rank 1"};
  r.stagings_missed = {"group g rank 1 op 7"};
  r.took = kGpuDrainBound;
  const std::string line = DescribeGpuDrain(r);
  EXPECT_NE(line.find("NOT drained within 1250 ms, still busy: group g rank 1"), std::string::npos)
      << line;
  EXPECT_NE(line.find("staging never came for group g rank 1 op 7"), std::string::npos) << line;
}

// Daemon::Shutdown's drain_grace, the GPU drain and the gRPC servers' 1 s shutdown leave
// at least a second of the limit after which epd's main exits with 1 regardless.
TEST(GpuDrainTest, TheDrainFitsWellInsideTheStopLimit) {
  const absl::Duration servers = absl::Seconds(1);
  EXPECT_LE(DaemonOptions{}.drain_grace + kGpuDrainBound + servers + absl::Seconds(1),
            kShutdownHardLimit);
}

}  // namespace
}  // namespace epd
