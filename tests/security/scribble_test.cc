// Family 1: a client rewrites every word of every region epd lets it map (the endpoint
// header with its layout offsets, sizes and counters; ring slots and completions; the
// staged inputs; the routing state and low-latency handle positions), at random and in
// tight loops from a second thread, during thousands of its own ops. epd must keep
// serving, the victim group beside it must stay exact, and the log bounded
// (docs/SECURITY.md: "Nothing the daemon dereferences comes from client-writable memory").
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "tests/security/security_harness.h"

namespace epd::testing::security {
namespace {

class ScribbleTest : public SecurityTest {
 protected:
  /// Runs the scribble attack on `targets` for `seconds` beside a victim group and checks
  /// the promises; the attacker must have run `min_ops` ops (its own, mostly failing ones
  /// count: epd answered them).
  AttackResult Attack(const std::string& targets, int min_ops, double seconds = 6,
                      const std::vector<std::string>& extra_args = {}) {
    AttackResult a;
    StartEpd();
    if (HasFatalFailure()) return a;
    StartVictims();
    if (HasFatalFailure()) return a;
    const int64_t ok_before = VictimOkRounds();
    const LogMark log = MarkLog();
    std::vector<std::string> args = {"--mode=scribble", "--targets=" + targets,
                                     absl::StrCat("--seconds=", seconds), "--supervise"};
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    a = RunAttacker(args, absl::Seconds(seconds + 25));
    ExpectEpdServing("after the scribble attack on " + targets);
    ExpectNewClientServed("after the scribble attack on " + targets);
    EXPECT_EQ(a.exit_code, 0);
    EXPECT_GE(a.Progress("ops"), min_ops) << "the attacker ran too few ops to mean anything";
    EXPECT_GT(a.Progress("writes"), 0) << "the attacker found nothing to write";
    EXPECT_FALSE(LinesStartingWith(a.output, "TARGETS mappings=").empty())
        << "the attacker did not find its endpoints' regions";
    // A child stuck past its deadline waited on epd without an answer.
    EXPECT_EQ(a.output.find("stuck past the deadline"), std::string::npos)
        << "an attacker process hung in a call to epd; its lines from STUCK on:\n"
        << a.output.substr(std::min(a.output.size(), a.output.find("STUCK")));
    ExpectVictimProgress(ok_before, 3, "the attack");
    // The warnings the attacker causes are charged to its uid's one budget, however often
    // it rejoins or a child restarts (a new session); each rejoin logs a few info lines.
    const int64_t children = std::max<int64_t>(1, LinesStartingWith(a.output, "CHILD").size());
    ExpectLogBounded(log, 200 + 12 * (a.Progress("rejoins") + 4 * children), 100 + 50 * children,
                     "the scribble attack on " + targets);
    StopVictimsAndExpectExact();
    return a;
  }
};

TEST_F(ScribbleTest, HeaderWordsIncludingLayoutOffsetsSizesAndCounters) {
  Attack("header", 200, /*seconds=*/10);  // Its ops mostly fail slowly: more time, same bar.
}

TEST_F(ScribbleTest, StagedInputsRacedBetweenCheckAndUse) { Attack("inputs", 1000); }

TEST_F(ScribbleTest, RoutingStateAndLowLatencyHandlePositionsRaced) { Attack("routing", 1000); }

TEST_F(ScribbleTest, RingSlotsAndCompletionsAtRandom) { Attack("ring", 1000); }

TEST_F(ScribbleTest, EveryWordOfEveryRegionAtRandom) { Attack("random", 500); }

// A group with on_rank_failure MASK: its client masks, unmasks, queries and cleans its rank
// mask between ops while the words its ops' masks come back in (each completion's
// mask_epoch, num_masked, dropped_pairs, reason) and the ring are scribbled, and its
// endpoint's daemon_closed is set to values epd never writes. Besides the promises above,
// the client reports the scribbled close word as such (DATA_LOSS naming it), never as epd
// shutting down, and its mask requests are answered.
TEST_F(ScribbleTest, MaskGroupResultMaskWordsRingAndCloseFlag) {
  AttackResult a = Attack("mask,ring", 300, /*seconds=*/8, {"--mask_group"});
  EXPECT_GT(a.Get("mask_calls"), 0) << "the attacker made no mask request";
  const std::vector<std::string> close_errors = LinesStartingWith(a.output, "CLOSE_FLAG_ERROR");
  ASSERT_FALSE(close_errors.empty()) << "no op reported the scribbled daemon_closed:\n"
                                     << a.output.substr(0, 4000);
  EXPECT_THAT(close_errors[0], ::testing::HasSubstr("DATA_LOSS"));
  EXPECT_THAT(close_errors[0], ::testing::HasSubstr("daemon_closed holds"));
  EXPECT_TRUE(LinesStartingWith(a.output, "CLOSE_FLAG_SHUTDOWN").empty())
      << "a scribbled daemon_closed was taken for epd shutting down: "
      << LinesStartingWith(a.output, "CLOSE_FLAG_SHUTDOWN")[0];
}

}  // namespace
}  // namespace epd::testing::security
