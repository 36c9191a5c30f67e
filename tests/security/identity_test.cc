// Family 4: identity. A client tries to take ranks of a group that is not its own (without
// the group's join secret; as another user), to read its endpoints and to leave its ranks;
// one claims another pid in its Session; one lists the groups as another user. epd must
// refuse every claim with a clear error (the victim group then completes and stays exact),
// record the pid the kernel gives (SO_PEERCRED), and show a caller only its own groups
// (docs/SECURITY.md "No group reaches another", "Identity is the kernel's").
// Other users: the attacker runs as nobody through setpriv, which needs root (skipped
// otherwise, as in tests/integration/socket_permissions_test.cc); epd's socket is then
// 0666 so that nobody may connect at all.
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/security/security_harness.h"

namespace epd::testing::security {
namespace {

constexpr char kSecret[] = "victim-secret-5f3a9c";

class IdentityTest : public SecurityTest {
 protected:
  /// Victim rank 0 joins group "victim" (with `secret`); the attacker (as nobody when
  /// `as_nobody`) tries to take its ranks; then victim rank 1 joins and the group must
  /// run exact rounds.
  void ClaimAttack(const std::string& secret, bool as_nobody) {
    ASSERT_NO_FATAL_FAILURE(StartEpd({.world_socket = as_nobody}));
    ASSERT_NO_FATAL_FAILURE(StartVictimRank("victim", 0, secret));
    AttackResult a = RunAttacker({"--mode=claim", "--victim_group=victim",
                                  "--join_secret=not-" + std::string(kSecret), "--hold_seconds=2"},
                                 absl::Seconds(60), as_nobody);
    EXPECT_EQ(a.exit_code, 0) << a.output;
    std::vector<std::string> claims = LinesStartingWith(a.output, "CLAIM ");
    EXPECT_FALSE(claims.empty()) << a.output;
    for (const std::string& line : claims) {
      // "CLAIM rank <r> secret=<none|wrong> <CODE> <message>"
      const std::string code = Token(line, 4);
      EXPECT_TRUE(code == "PERMISSION_DENIED" || code == "ALREADY_EXISTS" ||
                  code == "FAILED_PRECONDITION")
          << "a rank of another group was not refused clearly: " << line;
    }
    EXPECT_EQ(a.Get("claimed"), 0) << "the attacker took a rank of the victim's group";
    for (const std::string& line : LinesStartingWith(a.output, "ENDPOINTS ")) {
      EXPECT_NE(Token(line, 3), "OK") << "it read the victim's endpoints: " << line;
    }
    for (const std::string& line : LinesStartingWith(a.output, "LEAVE ")) {
      EXPECT_NE(Token(line, 3), "OK") << "it removed a victim's rank: " << line;
    }
    // The victim's rank 1 (with the secret) still joins, and the group is exact.
    ASSERT_NO_FATAL_FAILURE(StartVictimRank("victim", 1, secret));
    ASSERT_NO_FATAL_FAILURE(WaitVictimOkRounds(3, absl::Seconds(30)));
    ExpectEpdServing("after the claims");
    ExpectNewClientServed("after the claims");
    StopVictimsAndExpectExact();
  }
};

// The attacker runs as the same user as the victim; the group has a secret, which every
// joiner after the first must present (the owner's uid too).
TEST_F(IdentityTest, RanksOfASecretGroupAreRefusedWithoutTheSecret) {
  ClaimAttack(kSecret, /*as_nobody=*/false);
  for (const auto& v : victims_) {
    EXPECT_NE(v->Stdout().find("join_secret: set"), std::string::npos)
        << "this build's JoinOptions has no join_secret (tests/security/security_spec.h)";
  }
}

// Another user, a group without a secret: only its owner's uid may join it.
TEST_F(IdentityTest, RanksOfAnotherUsersGroupAreRefused) {
  if (const std::string why = WhyNotAsNobody(); !why.empty()) GTEST_SKIP() << why;
  ClaimAttack("", /*as_nobody=*/true);
}

TEST_F(IdentityTest, ClaimedClientPidIsNotWhatEpdRecords) {
  ASSERT_NO_FATAL_FAILURE(StartEpd());
  ASSERT_NO_FATAL_FAILURE(StartVictims());
  // It claims the first victim's pid: epd must record its own.
  const int victim_pid = victims_[0]->pid();
  AttackResult a = RunAttacker({"--mode=spoof_pid", absl::StrCat("--claimed_pid=", victim_pid)},
                               absl::Seconds(30));
  EXPECT_EQ(a.exit_code, 0) << a.output;
  std::vector<std::string> pids = LinesStartingWith(a.output, "PID ");
  ASSERT_EQ(pids.size(), 1u) << a.output;
  const int attacker_pid = attackers_.back()->pid();
  EXPECT_EQ(pids[0], absl::StrCat("PID real=", attacker_pid, " claimed=", victim_pid,
                                  " recorded=", attacker_pid))
      << "epd recorded the pid the client claimed, not its own";
  ExpectEpdServing("after the spoofed Session");
  StopVictimsAndExpectExact();
}

TEST_F(IdentityTest, ListGroupsShowsAnotherUserNoneOfTheVictimsGroups) {
  if (const std::string why = WhyNotAsNobody(); !why.empty()) GTEST_SKIP() << why;
  ASSERT_NO_FATAL_FAILURE(StartEpd({.world_socket = true}));
  ASSERT_NO_FATAL_FAILURE(StartVictims("victim", kSecret));
  AttackResult a = RunAttacker({"--mode=list_groups"}, absl::Seconds(30), /*as_nobody=*/true);
  EXPECT_EQ(a.exit_code, 0) << a.output;
  EXPECT_TRUE(LinesStartingWith(a.output, "LIST_ERROR").empty())
      << "ListGroups must answer another user (with what it may see): " << a.output;
  EXPECT_TRUE(LinesStartingWith(a.output, "GROUP victim ").empty())
      << "another user sees the victim's group: " << a.output;
  ExpectEpdServing("after ListGroups");
  StopVictimsAndExpectExact();
}

}  // namespace
}  // namespace epd::testing::security
