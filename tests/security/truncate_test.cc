// Family 2: a client truncates, grows and punches holes in every shared file it can open
// (the fds it holds, the files behind its mappings, the names EndpointInfo gives and this
// epd's names in /dev/shm, the region of a rank it joined without mapping) while its ops
// run. epd must keep serving (no SIGBUS), the victim group must stay exact, new clients
// must still be served, and no file of epd's may change size (docs/SECURITY.md "Shared
// memory the client cannot resize").
#include <algorithm>
#include <string>
#include <vector>

#include "tests/security/security_harness.h"

namespace epd::testing::security {
namespace {

using TruncateTest = SecurityTest;

TEST_F(TruncateTest, EveryFileItCanOpenIsTruncatedAndGrownDuringOps) {
  ASSERT_NO_FATAL_FAILURE(StartEpd());
  ASSERT_NO_FATAL_FAILURE(StartVictims());
  const int64_t ok_before = VictimOkRounds();
  const LogMark log = MarkLog();
  AttackResult a =
      RunAttacker({"--mode=truncate", "--seconds=6", "--supervise"}, absl::Seconds(35));
  ExpectEpdServing("after the truncation attack");
  ExpectNewClientServed("after the truncation attack");
  EXPECT_EQ(a.exit_code, 0);
  EXPECT_GT(LinesStartingWith(a.output, "OPENED").size() +
                LinesStartingWith(a.output, "OPEN_FAILED").size(),
            0u)
      << "the attacker tried no file";
  // A size change that succeeded: the file is not sealed ("DONE <op> <file>: ok").
  for (const char* op : {"DONE ftruncate", "DONE fallocate_grow"}) {
    const std::vector<std::string> done = LinesStartingWith(a.output, op);
    EXPECT_TRUE(done.empty()) << "an epd file changed size: " << done.front();
  }
  ExpectVictimProgress(ok_before, 3, "the attack");
  const int64_t children = std::max<int64_t>(1, LinesStartingWith(a.output, "CHILD").size());
  ExpectLogBounded(log, 200 + 12 * (a.Progress("rejoins") + 4 * children), 100 + 50 * children,
                   "the truncation attack");
  StopVictimsAndExpectExact();
}

}  // namespace
}  // namespace epd::testing::security
