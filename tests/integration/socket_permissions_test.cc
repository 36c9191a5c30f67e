// A client running as another user than epd (real epd, real epctl and epd_test_client run
// as nobody through setpriv; needs root, else skipped): it is told at once that it lacks
// permission, naming the path and the setting to change, instead of "is epd running?"
// after its whole timeout (socket in a 0700 directory: "does not exist"; socket 0660 of
// another group: a 5 s wait); and a client of another user that may connect joins and maps
// its endpoint with no other setting (the endpoint's memory is handed to it as descriptors).
#include <sys/stat.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/as_other_user.h"

namespace epd::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

/// argv run as nobody:nogroup (65534), without supplementary groups.
std::vector<std::string> AsNobody(const std::vector<std::string>& argv) {
  return AsUser(65534, argv);
}

class SocketPermissionsTest : public AsOtherUserTest {
 protected:
  /// Runs `epctl --socket=<epd's> --timeout=10s status` as nobody; its result and time.
  CommandResult EpctlStatusAsNobody(absl::Duration* took) {
    const absl::Time start = absl::Now();
    absl::StatusOr<CommandResult> result = RunCommand(
        AsNobody({EpctlBinary(), "--socket=" + epd_->socket_path(), "--timeout=10s", "status"}),
        absl::Seconds(30));
    *took = absl::Now() - start;
    EXPECT_TRUE(result.ok()) << result.status();
    return result.value_or(CommandResult{-1, "", ""});
  }
};

TEST_F(SocketPermissionsTest, SocketInAClosedDirectoryIsPermissionNotMissing) {
  StartEpd();  // Its socket is in a fresh 0700 directory of root's.
  absl::Duration took;
  CommandResult r = EpctlStatusAsNobody(&took);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(took, absl::Seconds(5)) << r.stderr_text;
  EXPECT_THAT(r.stderr_text, AllOf(HasSubstr("cannot reach socket " + epd_->socket_path()),
                                   HasSubstr("not searchable"), Not(HasSubstr("does not exist"))));
}

TEST_F(SocketPermissionsTest, SocketOfAnotherGroupIsPermissionDeniedAtOnce) {
  StartEpd();  // socket_mode 0660, group root: nobody may not connect.
  ASSERT_EQ(::chmod(epd_->dir().c_str(), 0755), 0);
  absl::Duration took;
  CommandResult r = EpctlStatusAsNobody(&took);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(took, absl::Seconds(5)) << r.stderr_text;
  EXPECT_THAT(
      r.stderr_text,
      AllOf(HasSubstr("permission denied connecting to socket " + epd_->socket_path()),
            HasSubstr("mode 0660"), HasSubstr("socket_group"), Not(HasSubstr("is epd running"))));
}

TEST_F(SocketPermissionsTest, AClientOfAnotherUserWhoMayConnectJoinsAndMapsItsEndpoint) {
  // Access to the socket is all it takes: no shm file mode or group to configure.
  StartEpd({"--socket_mode=0666"});
  ASSERT_EQ(::chmod(epd_->dir().c_str(), 0755), 0);
  absl::StatusOr<CommandResult> r =
      RunCommand(AsNobody({TestClientBinary(), "--socket=" + epd_->socket_path(), "--rank=0",
                           "--num_ranks=1", "--num_experts=2"}),
                 absl::Seconds(30));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->stdout_text << r->stderr_text;
  EXPECT_THAT(r->stdout_text, HasSubstr("JOINED group=g rank=0"));
}

}  // namespace
}  // namespace epd::testing
