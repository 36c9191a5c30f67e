// Family 5: a client destroys an Endpoint with an op pending (and one with an op completed
// but not yet waited for), reuses the freed memory, then calls PendingOp::Wait and
// Enqueued. The client library must answer with an error, not touch freed memory (no
// crash; under AddressSanitizer no use-after-free), and epd and the victim group beside it
// must not notice.
#include <string>

#include "absl/strings/match.h"
#include "tests/security/security_harness.h"

namespace epd::testing::security {
namespace {

using LifetimeTest = SecurityTest;

TEST_F(LifetimeTest, WaitAfterItsEndpointWasDestroyed) {
  ASSERT_NO_FATAL_FAILURE(StartEpd());
  ASSERT_NO_FATAL_FAILURE(StartVictims());
  AttackResult a = RunAttacker({"--mode=destroy_pending"}, absl::Seconds(60));
  EXPECT_EQ(a.exit_code, 0) << "the client crashed (exit " << a.exit_code << "):\n"
                            << a.output << attackers_.back()->Stderr();
  EXPECT_NE(a.output.find("DONE"), std::string::npos) << a.output;
  const std::vector<std::string> waits = LinesStartingWith(a.output, "WAIT ");
  EXPECT_EQ(waits.size(), 2u) << a.output;
  for (const std::string& line : waits) {
    // "WAIT <case> <CODE> <message>": an error that says what happened.
    EXPECT_NE(Token(line, 2), "OK") << "Wait returned a result of a destroyed endpoint (its "
                                       "views point at unmapped memory): "
                                    << line;
    EXPECT_GT(line.size(), 40u) << "no message: " << line;
  }
  ExpectEpdServing("after the destroyed endpoints");
  ExpectNewClientServed("after the destroyed endpoints");
  StopVictimsAndExpectExact();
}

}  // namespace
}  // namespace epd::testing::security
