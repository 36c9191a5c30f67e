// Family 1: a client rewrites every word of every region epd lets it map (the endpoint
// header with its layout offsets, sizes and counters; ring slots and completions; the
// staged inputs; the routing state and low-latency handle positions), at random and in
// tight loops from a second thread, during thousands of its own ops. epd must keep
// serving, the victim group beside it must stay exact, and the log bounded
// (docs/SECURITY.md: "Nothing the daemon dereferences comes from client-writable memory").
#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "tests/security/security_harness.h"

namespace epd::testing::security {
namespace {

class ScribbleTest : public SecurityTest {
 protected:
  /// Runs the scribble attack on `targets` for `seconds` beside a victim group and checks
  /// the promises; the attacker must have run `min_ops` ops (its own, mostly failing ones
  /// count: epd answered them).
  void Attack(const std::string& targets, int min_ops, double seconds = 6) {
    ASSERT_NO_FATAL_FAILURE(StartEpd());
    ASSERT_NO_FATAL_FAILURE(StartVictims());
    const int64_t ok_before = VictimOkRounds();
    const LogMark log = MarkLog();
    AttackResult a = RunAttacker({"--mode=scribble", "--targets=" + targets,
                                  absl::StrCat("--seconds=", seconds), "--supervise"},
                                 absl::Seconds(seconds + 25));
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
  }
};

TEST_F(ScribbleTest, HeaderWordsIncludingLayoutOffsetsSizesAndCounters) {
  Attack("header", 200, /*seconds=*/10);  // Its ops mostly fail slowly: more time, same bar.
}

TEST_F(ScribbleTest, StagedInputsRacedBetweenCheckAndUse) { Attack("inputs", 1000); }

TEST_F(ScribbleTest, RoutingStateAndLowLatencyHandlePositionsRaced) { Attack("routing", 1000); }

TEST_F(ScribbleTest, RingSlotsAndCompletionsAtRandom) { Attack("ring", 1000); }

TEST_F(ScribbleTest, EveryWordOfEveryRegionAtRandom) { Attack("random", 500); }

}  // namespace
}  // namespace epd::testing::security
