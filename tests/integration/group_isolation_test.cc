// Groups of different users on one epd (the real epd, real epd_test_client and epctl
// processes run as other users through setpriv; needs root, else skipped): epd knows a
// client by the kernel's SO_PEERCRED of its connection, never by what it claims.
// - a process of another uid cannot join a rank of a group without the group's join
//   secret, and cannot see the group in ListGroups (epctl groups); with the secret it can
//   do both; the error names the group and the rank, never the secret;
// - processes of the owner's uid join further ranks without a secret;
// - a per-uid quota (max_groups_per_uid) stops one uid without stopping another.
// (A Session that claims another pid is shown with its real one: connections_test.cc.)
#include <sys/stat.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "epd/v1/control.pb.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/integration/as_other_user.h"

namespace epd::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

/// Two users besides root: the owner of the victim group and the one that tries to get in.
constexpr uint32_t kOwnerUid = 4242;
constexpr uint32_t kOtherUid = 65534;  // nobody
constexpr char kSecret[] = "victim-secret-7f3a9c";

/// argv run as `uid` (AsUser) with EPD_JOIN_SECRET set to `secret`, or unset when
/// `secret` is empty.
std::vector<std::string> AsUserWithSecret(uint32_t uid, const std::string& secret,
                                          const std::vector<std::string>& argv) {
  std::vector<std::string> env = {"/usr/bin/env", "-u", "EPD_JOIN_SECRET"};
  if (!secret.empty()) env.push_back(absl::StrCat("EPD_JOIN_SECRET=", secret));
  env.insert(env.end(), argv.begin(), argv.end());
  return AsUser(uid, env);
}

class GroupIsolationTest : public AsOtherUserTest {
 protected:
  /// epd that every user may connect to (socket 0666) and whose endpoint regions every
  /// user may map: the isolation under test is epd's own, not the file modes'.
  void StartOpenEpd(std::vector<std::string> extra_args = {}) {
    extra_args.insert(extra_args.begin(), {"--socket_mode=0666", "--shm_mode=0666"});
    StartEpd(std::move(extra_args));
    if (epd_ != nullptr) ASSERT_EQ(::chmod(epd_->dir().c_str(), 0755), 0);
  }

  std::vector<std::string> ClientArgs(const std::string& group, int rank) const {
    return {TestClientBinary(), "--socket=" + epd_->socket_path(),
            "--name=" + group,  absl::StrCat("--rank=", rank),
            "--num_ranks=4",    "--num_experts=8"};
  }

  /// An epd_test_client of `uid` holding rank `rank` of `group` (waits for JOINED).
  std::unique_ptr<Subprocess> Holder(uint32_t uid, const std::string& secret,
                                     const std::string& group, int rank) {
    SubprocessOptions options;
    options.stdout_path = absl::StrCat(epd_->dir(), "/holder-", group, "-", rank, ".out");
    options.stderr_path = options.stdout_path + ".err";
    options.pipe_stdin = true;
    auto p = Subprocess::Spawn(AsUserWithSecret(uid, secret, ClientArgs(group, rank)), options);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return nullptr;
    absl::Status joined = (*p)->WaitForOutput("JOINED", absl::Seconds(20));
    EXPECT_TRUE(joined.ok()) << joined;
    return joined.ok() ? *std::move(p) : nullptr;
  }

  /// An epd_test_client of `uid` that tries to join; its output once it is refused.
  CommandResult TryJoin(uint32_t uid, const std::string& secret, const std::string& group,
                        int rank) {
    // A client that joins holds its rank until stdin closes: RunCommand gives it
    // /dev/null, so it leaves again at once.
    absl::StatusOr<CommandResult> r =
        RunCommand(AsUserWithSecret(uid, secret, ClientArgs(group, rank)), absl::Seconds(30));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.value_or(CommandResult{-1, "", ""});
  }

  /// `epctl --json groups` run as `uid`: the groups it lists.
  v1::ListGroupsResponse GroupsSeenBy(uint32_t uid) {
    absl::StatusOr<CommandResult> r = RunCommand(
        AsUserWithSecret(uid, "",
                         {EpctlBinary(), "--socket=" + epd_->socket_path(), "--json", "groups"}),
        absl::Seconds(30));
    v1::ListGroupsResponse list;
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return list;
    EXPECT_EQ(r->exit_code, 0) << r->stderr_text;
    EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(r->stdout_text, &list).ok())
        << r->stdout_text;
    return list;
  }

  static std::vector<std::string> Names(const v1::ListGroupsResponse& list) {
    std::vector<std::string> names;
    for (const v1::GroupInfo& g : list.groups()) names.push_back(g.spec().name());
    return names;
  }
};

TEST_F(GroupIsolationTest, AnotherUserNeedsTheJoinSecretToJoinOrSeeAGroup) {
  ASSERT_NO_FATAL_FAILURE(StartOpenEpd());
  std::unique_ptr<Subprocess> owner = Holder(kOwnerUid, kSecret, "victim", 0);
  ASSERT_NE(owner, nullptr);

  // Without the secret, or with a wrong one: refused, naming the group and the rank.
  for (const std::string& secret : {std::string(), std::string("victim-secret")}) {
    CommandResult r = TryJoin(kOtherUid, secret, "victim", 1);
    EXPECT_EQ(r.exit_code, 4) << r.stdout_text << r.stderr_text;
    EXPECT_THAT(r.stdout_text,
                AllOf(HasSubstr("JOIN_ERROR PERMISSION_DENIED"),
                      HasSubstr("rank 1 of group \"victim\""), Not(HasSubstr("7f3a9c"))));
  }
  // It does not see the group; the owner and root (an operator) do, with the owner's uid
  // and without the secret.
  EXPECT_THAT(Names(GroupsSeenBy(kOtherUid)), ::testing::IsEmpty());
  v1::ListGroupsResponse seen_by_owner = GroupsSeenBy(kOwnerUid);
  ASSERT_EQ(Names(seen_by_owner), std::vector<std::string>{"victim"});
  EXPECT_EQ(seen_by_owner.groups(0).owner_uid(), kOwnerUid);
  EXPECT_TRUE(seen_by_owner.groups(0).join_secret_set());
  ASSERT_EQ(seen_by_owner.groups(0).ranks_size(), 1);
  EXPECT_EQ(seen_by_owner.groups(0).ranks(0).uid(), kOwnerUid);
  EXPECT_EQ(Names(GroupsSeenBy(0)), std::vector<std::string>{"victim"});
  CommandResult text = *RunCommand({EpctlBinary(), "--socket=" + epd_->socket_path(), "groups"});
  EXPECT_THAT(text.stdout_text, AllOf(HasSubstr("victim"), HasSubstr("OWNER"), HasSubstr("4242"),
                                      Not(HasSubstr("7f3a9c"))));

  // With the secret it joins, and then sees the group.
  std::unique_ptr<Subprocess> other = Holder(kOtherUid, kSecret, "victim", 1);
  ASSERT_NE(other, nullptr);
  EXPECT_EQ(Names(GroupsSeenBy(kOtherUid)), std::vector<std::string>{"victim"});
  EXPECT_EQ(GroupsSeenBy(kOwnerUid).groups(0).ranks_size(), 2);

  // The secret never reached the log.
  EXPECT_THAT(epd_->Logs(), Not(HasSubstr("7f3a9c")));
}

TEST_F(GroupIsolationTest, TheOwnersUidJoinsWithoutASecretOthersDoNot) {
  ASSERT_NO_FATAL_FAILURE(StartOpenEpd());
  std::unique_ptr<Subprocess> r0 = Holder(kOwnerUid, "", "plain", 0);
  ASSERT_NE(r0, nullptr);
  std::unique_ptr<Subprocess> r1 = Holder(kOwnerUid, "", "plain", 1);
  ASSERT_NE(r1, nullptr);
  CommandResult r = TryJoin(kOtherUid, "", "plain", 2);
  EXPECT_EQ(r.exit_code, 4) << r.stdout_text;
  EXPECT_THAT(r.stdout_text,
              AllOf(HasSubstr("JOIN_ERROR PERMISSION_DENIED"),
                    HasSubstr("rank 2 of group \"plain\""), HasSubstr("owner's uid (4242)")));
  // Root is no exception for joins (a job running as root in a container is a user too).
  r = TryJoin(0, "", "plain", 2);
  EXPECT_EQ(r.exit_code, 4) << r.stdout_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("JOIN_ERROR PERMISSION_DENIED"));
}

TEST_F(GroupIsolationTest, PerUidGroupQuotaStopsOneUidNotAnother) {
  ASSERT_NO_FATAL_FAILURE(StartOpenEpd({"--max_groups_per_uid=1"}));
  std::unique_ptr<Subprocess> first = Holder(kOwnerUid, "", "first", 0);
  ASSERT_NE(first, nullptr);
  CommandResult r = TryJoin(kOwnerUid, "", "second", 0);
  EXPECT_EQ(r.exit_code, 4) << r.stdout_text;
  EXPECT_THAT(r.stdout_text,
              AllOf(HasSubstr("JOIN_ERROR RESOURCE_EXHAUSTED"), HasSubstr("max_groups_per_uid"),
                    HasSubstr("uid 4242 owns 1 groups")));
  std::unique_ptr<Subprocess> other = Holder(kOtherUid, "", "others", 0);
  EXPECT_NE(other, nullptr);
}

// `epctl metrics` (GetStats.metrics) keeps the series of the groups the caller may list:
// the owner sees its group's, another user none of them (and no name of the group).
TEST_F(GroupIsolationTest, EpctlMetricsShowsOnlyTheCallersGroups) {
  ASSERT_NO_FATAL_FAILURE(StartOpenEpd());
  std::unique_ptr<Subprocess> owner = Holder(kOwnerUid, kSecret, "victim", 0);
  ASSERT_NE(owner, nullptr);
  auto metrics_as = [&](uint32_t uid) {
    absl::StatusOr<CommandResult> r = RunCommand(
        AsUserWithSecret(uid, "",
                         {EpctlBinary(), "--socket=" + epd_->socket_path(), "--json", "metrics"}),
        absl::Seconds(30));
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return std::string();
    EXPECT_EQ(r->exit_code, 0) << r->stderr_text;
    return r->stdout_text;
  };
  const std::string mine = metrics_as(kOwnerUid);
  EXPECT_THAT(mine, HasSubstr("\"victim\""));
  EXPECT_THAT(mine, HasSubstr("epd_masked_ranks"));
  const std::string theirs = metrics_as(kOtherUid);
  EXPECT_THAT(theirs, Not(HasSubstr("victim")));
  EXPECT_THAT(theirs, HasSubstr("epd_sessions"));  // Daemon-wide series stay.
}

}  // namespace
}  // namespace epd::testing
