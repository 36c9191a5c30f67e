// The kill -9 scenario of rank masking with real processes, shared by the host backend's
// integration test (tests/integration/rank_mask_test.cc) and the CUDA backend's GPU test
// (tests/gpu/mask_process_test.cc): kRanks epd_dp_mask processes
// (tests/integration/clients/dp_mask.cc) run low-latency rounds of a MASK group; rank 3 is
// killed mid-stream; each survivor's next rounds complete within op_timeout + 1 s without
// it, equal to kernels/host's reference with its experts dropped (checked by the processes,
// "verified"), reporting the mask; a new process joins the masked slot and the next rounds
// include it again.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tests/common/daemon_process.h"
#include "tests/common/subprocess.h"

namespace epd::testing {

/// Ranks of the scenario's group.
inline constexpr int kMaskScenarioRanks = 4;

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// A parsed "round I OK epoch E masked M dropped D at NS verified|unverified" line.
struct RoundLine {
  int round = -1;
  bool ok = false;
  uint32_t epoch = 0;
  int masked = 0;
  int64_t at_ns = 0;
  bool verified = false;
};

inline std::vector<RoundLine> Rounds(const std::string& out) {
  std::vector<RoundLine> rounds;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    std::vector<std::string> f = absl::StrSplit(line, ' ');
    if (f.size() < 4 || f[0] != "round") continue;
    RoundLine r;
    if (!absl::SimpleAtoi(f[1], &r.round)) continue;
    r.ok = f[2] == "OK";
    if (r.ok && f.size() >= 12) {
      (void)absl::SimpleAtoi(f[4], &r.epoch);
      (void)absl::SimpleAtoi(f[6], &r.masked);
      (void)absl::SimpleAtoi(f[10], &r.at_ns);
      r.verified = f[11] == "verified";
    }
    rounds.push_back(r);
  }
  return rounds;
}

/// The first round line of `p` for which `pred` holds, waiting up to `timeout`.
inline std::optional<RoundLine> WaitForRound(Subprocess& p,
                                             const std::function<bool(const RoundLine&)>& pred,
                                             absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  do {
    for (const RoundLine& l : Rounds(p.Stdout())) {
      if (pred(l)) return l;
    }
    absl::SleepFor(absl::Milliseconds(20));
  } while (absl::Now() < end);
  return std::nullopt;
}

/// Starts epd_dp_mask rank `rank` (stdout in a file named after `name`), with `flags`.
using MaskRankSpawner = std::function<std::unique_ptr<Subprocess>(int rank, const std::string& name,
                                                                  std::vector<std::string> flags)>;

/// The scenario against `epd` (its --op_timeout is `op_timeout_ms`), with processes from
/// `spawn`. Fails the calling test (gtest assertions) on any violation. `failed_rounds_allowed`:
/// failed rounds a survivor may have (a CUDA client killed between handing an op to the
/// daemon and its stream's ready_seq fails that op for every rank: one at most).
inline void KilledRankIsMaskedThenARejoinIsIncluded(DaemonProcess& epd, int op_timeout_ms,
                                                    const MaskRankSpawner& spawn,
                                                    int failed_rounds_allowed = 0) {
  constexpr int kRanks = kMaskScenarioRanks;
  const int kOpTimeoutMs = op_timeout_ms;

  std::vector<std::unique_ptr<Subprocess>> ranks;
  for (int r = 0; r < kRanks; ++r) {
    ranks.push_back(
        spawn(r, absl::StrCat("rank", r),
              r == 0 ? std::vector<std::string>{"--api_checks"} : std::vector<std::string>{}));
    ASSERT_NE(ranks.back(), nullptr);
  }
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(ranks[r]->WaitForOutput("round 20 OK", absl::Seconds(30)).ok())
        << ranks[r]->Stdout() << epd.Logs();
  }
  EXPECT_NE(ranks[0]->Stdout().find("api_checks OK"), std::string::npos) << ranks[0]->Stdout();
  // The mask epoch before the kill (the group may have masked a rank that joined late).
  const std::vector<RoundLine> before = Rounds(ranks[0]->Stdout());
  ASSERT_FALSE(before.empty());
  const uint32_t epoch0 = before.back().epoch;
  ASSERT_EQ(before.back().masked, 0) << ranks[0]->Stdout();
  ranks[3]->Signal(SIGKILL);
  const int64_t killed_at = NowNs();
  ASSERT_TRUE(ranks[3]->Wait(absl::Seconds(5)).ok());
  // Each survivor: a round without rank 3 (a later epoch, 1 masked) soon after the kill.
  uint32_t epoch1 = 0;
  for (int r = 0; r < 3; ++r) {
    auto l = WaitForRound(
        *ranks[r], [&](const RoundLine& l) { return l.ok && l.epoch > epoch0 && l.masked == 1; },
        absl::Seconds(10));
    ASSERT_TRUE(l.has_value()) << ranks[r]->Stdout() << epd.Logs();
    epoch1 = l->epoch;
  }
  // A new process joins rank 3's slot; the survivors' rounds include it again.
  auto again = spawn(3, "rank3_again", {});
  ASSERT_NE(again, nullptr);
  auto back = [&](const RoundLine& l) {
    return l.ok && l.epoch > epoch1 && l.masked == 0 && l.verified;
  };
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(WaitForRound(*ranks[r], back, absl::Seconds(10)).has_value())
        << ranks[r]->Stdout() << epd.Logs();
  }
  ASSERT_TRUE(WaitForRound(*again, back, absl::Seconds(10)).has_value())
      << again->Stdout() << epd.Logs();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // A few rounds with it.
  for (auto& p : ranks) p->Signal(SIGKILL);
  again->Signal(SIGKILL);
  for (int r = 0; r < 3; ++r) {
    (void)ranks[r]->Wait(absl::Seconds(5));
    const std::string out = ranks[r]->Stdout();
    EXPECT_EQ(out.find("MISMATCH"), std::string::npos) << out;
    std::vector<RoundLine> rounds = Rounds(out);
    int64_t first_without = 0;
    int verified_without = 0, verified_with_again = 0, failed = 0;
    for (const RoundLine& l : rounds) {
      failed += !l.ok;
      if (l.ok && l.epoch > epoch0 && l.masked == 1) {
        if (first_without == 0) first_without = l.at_ns;
        verified_without += l.verified;
      }
      if (l.ok && l.epoch > epoch1 && l.masked == 0) verified_with_again += l.verified;
    }
    EXPECT_LE(failed, failed_rounds_allowed) << "survivor " << r << "'s failed rounds:\n" << out;
    ASSERT_GT(first_without, 0) << out;
    EXPECT_LT(first_without - killed_at, (kOpTimeoutMs + 1000) * int64_t{1000000})
        << "survivor " << r << ": first round without rank 3 came late";
    EXPECT_GT(verified_without, 0) << "no round without rank 3 was checked:\n" << out;
    EXPECT_GT(verified_with_again, 0) << "no round with the rejoined rank was checked:\n" << out;
  }
  (void)again->Wait(absl::Seconds(5));
  EXPECT_EQ(again->Stdout().find("MISMATCH"), std::string::npos) << again->Stdout();
  auto health = epd.CheckHealth();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_TRUE(absl::StrContains(epd.Logs(), "rank 3 masked")) << epd.Logs();
}

}  // namespace epd::testing
