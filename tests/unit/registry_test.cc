// GroupRegistry with a fake DataPlane: sessions, joins, leaves, session end, the error
// codes of JoinGroup and group lifetime (daemon/control/group_registry.h).
#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "daemon/control/group_registry.h"
#include "daemon/core/logging.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/fake_data_plane.h"

namespace epd {
namespace {

using ::testing::AllOf;
using testing::FakeDataPlane;
using testing::FakeDataPlaneState;
using ::testing::HasSubstr;
using testing::kGpuA;
using ::testing::Not;
using testing::OneGpu;
using ::testing::SizeIs;
using testing::SmallSpec;

class RegistryTest : public ::testing::Test {
 protected:
  RegistryTest()
      : state_(std::make_shared<FakeDataPlaneState>()),
        plane_(state_),
        registry_(&plane_, OneGpu(), GroupRegistry::Options{.max_groups = 2}) {}

  std::string Session(int64_t pid = 42, uint32_t uid = 1000) {
    absl::StatusOr<std::string> id =
        registry_.OpenSession(PeerCredentials{.pid = pid, .uid = uid, .gid = uid}, "test");
    EXPECT_TRUE(id.ok()) << id.status();
    return id.value_or("");
  }

  absl::StatusOr<v1::EndpointInfo> Join(const std::string& session, int32_t rank,
                                        const v1::GroupSpec& spec = SmallSpec(),
                                        const std::string& gpu = "") {
    v1::JoinGroupRequest request;
    *request.mutable_spec() = spec;
    request.set_rank(rank);
    request.set_session_id(session);
    request.set_gpu_uuid(gpu);
    return registry_.Join(request);
  }

  absl::Status Leave(const std::string& session, const std::string& group, int32_t rank) {
    v1::LeaveGroupRequest request;
    request.set_group(group);
    request.set_rank(rank);
    request.set_session_id(session);
    return registry_.Leave(request);
  }

  std::shared_ptr<FakeDataPlaneState> state_;
  FakeDataPlane plane_;
  GroupRegistry registry_;
};

TEST_F(RegistryTest, SessionIdsAreUniqueHex) {
  std::string a = Session();
  std::string b = Session();
  EXPECT_THAT(a, SizeIs(32));
  EXPECT_NE(a, b);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_EQ(registry_.counters().num_sessions, 2);
}

TEST_F(RegistryTest, FirstJoinCreatesGroupAndRanksJoin) {
  std::string s0 = Session(100), s1 = Session(101);
  absl::StatusOr<v1::EndpointInfo> e0 = Join(s0, 0);
  ASSERT_TRUE(e0.ok()) << e0.status();
  EXPECT_EQ(e0->group(), "g");
  EXPECT_EQ(e0->rank(), 0);
  ASSERT_TRUE(Join(s1, 1).ok());
  EXPECT_EQ(state_->groups_created, 1);
  EXPECT_THAT(state_->attached, SizeIs(2));

  v1::ListGroupsResponse list = registry_.ListGroups(PeerCredentials{.uid = 1000});
  ASSERT_THAT(list.groups(), SizeIs(1));
  const v1::GroupInfo& g = list.groups(0);
  EXPECT_EQ(g.spec().name(), "g");
  EXPECT_EQ(g.buffer_bytes_per_rank(), state_->bytes_per_rank);
  ASSERT_THAT(g.ranks(), SizeIs(2));
  EXPECT_EQ(g.ranks(0).rank(), 0);
  EXPECT_EQ(g.ranks(0).client_pid(), 100);
  // ListGroups shows only a prefix of the session id (the id is a capability).
  EXPECT_EQ(g.ranks(0).session_id(), s0.substr(0, 8) + "...");
  EXPECT_EQ(g.ranks(1).client_pid(), 101);
  EXPECT_EQ(g.ranks(1).ops_completed(), 101u);
  EXPECT_EQ(registry_.counters().num_groups, 1);
}

TEST_F(RegistryTest, SessionsKeepThePeerCredentialsTheyWereOpenedWith) {
  std::string s = Session(/*pid=*/4242, /*uid=*/1234);
  absl::StatusOr<PeerCredentials> creds = registry_.SessionCredentials(s);
  ASSERT_TRUE(creds.ok()) << creds.status();
  EXPECT_EQ(*creds, (PeerCredentials{.pid = 4242, .uid = 1234, .gid = 1234}));
  EXPECT_EQ(registry_.SessionCredentials("0123456789abcdef0123456789abcdef").status().code(),
            absl::StatusCode::kFailedPrecondition);
  registry_.CloseSession(s, "test");
  EXPECT_EQ(registry_.SessionCredentials(s).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(RegistryTest, AuthorizeEndpointNeedsTheSessionsUidAndItsRank) {
  std::string s0 = Session(100, 1000), s1 = Session(101, 1000);
  ASSERT_TRUE(Join(s0, 0).ok());
  ASSERT_TRUE(Join(s1, 1).ok());
  const PeerCredentials same_uid{.pid = 555, .uid = 1000, .gid = 1000};
  EXPECT_TRUE(registry_.AuthorizeEndpoint(s0, "g", 0, same_uid).ok());
  // Another uid quoting the session id.
  absl::Status status =
      registry_.AuthorizeEndpoint(s0, "g", 0, PeerCredentials{.pid = 7, .uid = 2000}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr("uid 1000"), HasSubstr("uid 2000")));
  // A rank of the group the session does not hold, and a group that does not exist: the same
  // answer.
  status = registry_.AuthorizeEndpoint(s0, "g", 1, same_uid).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr("rank 1"), Not(HasSubstr(s0))));
  EXPECT_EQ(registry_.AuthorizeEndpoint(s0, "nope", 0, same_uid).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(registry_.AuthorizeEndpoint("0123456789abcdef0123456789abcdef", "g", 0, same_uid)
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(Leave(s0, "g", 0).ok());
  EXPECT_EQ(registry_.AuthorizeEndpoint(s0, "g", 0, same_uid).status().code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(RegistryTest, RankHeldIsAlreadyExists) {
  std::string s0 = Session(100), s1 = Session(101);
  ASSERT_TRUE(Join(s0, 1).ok());
  absl::Status status = Join(s1, 1).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kAlreadyExists);
  // The holder's session id is its credential (LeaveGroup): only its redacted form.
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("rank 1"), HasSubstr("\"g\""), HasSubstr(s0.substr(0, 8) + "..."),
                    Not(HasSubstr(s0)), HasSubstr("pid 100")));
  // The same session asking again is refused too: one endpoint per rank.
  EXPECT_EQ(Join(s0, 1).status().code(), absl::StatusCode::kAlreadyExists);
}

TEST_F(RegistryTest, MismatchedSpecListsEveryDifferingField) {
  std::string s0 = Session(), s1 = Session();
  ASSERT_TRUE(Join(s0, 0).ok());
  v1::GroupSpec other = SmallSpec();
  other.set_hidden(512);
  other.set_max_tokens_per_rank(32);
  absl::Status status = Join(s1, 1, other).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("hidden: live=256 requested=512"),
                    HasSubstr("max_tokens_per_rank: live=16 requested=32")));
  EXPECT_THAT(state_->attached, SizeIs(1));
}

TEST_F(RegistryTest, InvalidSpecAndRankAreInvalidArgument) {
  std::string s = Session();
  v1::GroupSpec bad = SmallSpec();
  bad.set_num_experts(7);
  absl::Status status = Join(s, 0, bad).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("spec.num_experts: 7"));

  status = Join(s, 2).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("rank: 2"));
  status = Join(s, -1).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(state_->groups_created, 0);
}

TEST_F(RegistryTest, SessionMustBeOpen) {
  EXPECT_EQ(Join("", 0).status().code(), absl::StatusCode::kInvalidArgument);
  absl::Status status = Join("0123456789abcdef0123456789abcdef", 0).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()), HasSubstr("0123456789abcdef0123456789abcdef"));
}

TEST_F(RegistryTest, GpuIsResolvedByUuidOrPciBusIdElseNotFound) {
  std::string s = Session();
  ASSERT_TRUE(Join(s, 0, SmallSpec(), kGpuA).ok());
  ASSERT_TRUE(Join(s, 1, SmallSpec(), "0000:3b:00.0").ok());  // PCI bus id, other spelling.
  EXPECT_EQ(state_->last_gpu["g/1"], kGpuA);
  absl::Status status = Join(s, 0, SmallSpec("h"), "GPU-unknown").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr("GPU-unknown"), HasSubstr(kGpuA)));
}

TEST_F(RegistryTest, CudaBackendNeedsAGpu) {
  state_->backend = "cuda";
  std::string s = Session();
  absl::Status status = Join(s, 0).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("gpu_uuid"));
  EXPECT_TRUE(Join(s, 0, SmallSpec(), kGpuA).ok());
}

TEST_F(RegistryTest, BuffersThatDoNotFitAreResourceExhausted) {
  state_->bytes_per_rank = 5000000;
  state_->free_bytes = 4000;
  std::string s = Session();
  absl::Status status = Join(s, 0).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("5000000 bytes"), HasSubstr("4000 bytes free")));
  EXPECT_EQ(state_->groups_created, 0);
}

// The private memory a group's creation allocates (the host backend's kernel scratch is
// ~R*M*R int32) is checked against free memory with the first rank's endpoint, and charged
// to the creator's byte quota: refused naming the bytes, never an allocation that fails.
TEST_F(RegistryTest, GroupPrivateMemoryThatDoesNotFitIsResourceExhausted) {
  state_->group_private_bytes = 4398046511104;  // R = M = 4096: 4096^3 int32.
  state_->bytes_per_rank = 1000;
  state_->free_bytes = 1ull << 34;
  std::string s = Session();
  absl::Status status = Join(s, 0).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("4398046511104 bytes of epd's private memory"),
                    HasSubstr("1000 bytes for rank 0's endpoint"),
                    HasSubstr(std::to_string(1ull << 34) + " bytes free")));
  EXPECT_EQ(state_->groups_created, 0);

  // Fits: created; the next rank of the live group is not charged it again.
  state_->group_private_bytes = (1ull << 34) - 1000;
  ASSERT_TRUE(Join(s, 0).ok());
  state_->free_bytes = 1000;
  EXPECT_TRUE(Join(s, 1).ok());
}

TEST_F(RegistryTest, MaxGroups) {
  std::string s = Session();
  ASSERT_TRUE(Join(s, 0, SmallSpec("a")).ok());
  ASSERT_TRUE(Join(s, 0, SmallSpec("b")).ok());
  absl::Status status = Join(s, 0, SmallSpec("c")).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(status.message()), HasSubstr("max_groups: 2"));
  ASSERT_TRUE(Join(s, 1, SmallSpec("a")).ok());  // Joining a live group is still fine.
}

TEST_F(RegistryTest, FailedFirstAttachLeavesNoGroup) {
  state_->attach_error = absl::ResourceExhaustedError("shm full");
  std::string s = Session();
  EXPECT_EQ(Join(s, 0).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(registry_.counters().num_groups, 0);
  EXPECT_EQ(state_->groups_destroyed, 1);
  state_->attach_error = absl::OkStatus();
  EXPECT_TRUE(Join(s, 0).ok());
}

TEST_F(RegistryTest, LeaveReleasesAndLastLeaveDestroysGroup) {
  std::string s0 = Session(), s1 = Session();
  ASSERT_TRUE(Join(s0, 0).ok());
  ASSERT_TRUE(Join(s1, 1).ok());
  const absl::Status foreign = Leave(s1, "g", 0);
  EXPECT_EQ(foreign.code(), absl::StatusCode::kPermissionDenied);
  // Naming the holder by its whole id would let s1 leave in s0's name with it.
  EXPECT_THAT(std::string(foreign.message()), Not(HasSubstr(s0)));
  EXPECT_EQ(Leave(s0, "nope", 0).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(Leave(s0, "g", 0).ok());
  EXPECT_EQ(Leave(s0, "g", 0).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(state_->groups_destroyed, 0);
  ASSERT_TRUE(Join(s1, 0).ok());  // The freed rank can be joined again.
  ASSERT_TRUE(Leave(s1, "g", 0).ok());
  ASSERT_TRUE(Leave(s1, "g", 1).ok());
  EXPECT_EQ(state_->groups_destroyed, 1);
  EXPECT_EQ(registry_.counters().num_groups, 0);
  EXPECT_TRUE(state_->attached.empty());
  // Ops of destroyed groups still count.
  EXPECT_EQ(registry_.counters().ops_completed, 7u);
}

TEST_F(RegistryTest, SessionEndReleasesOnlyItsEndpoints) {
  std::string s0 = Session(), s1 = Session();
  ASSERT_TRUE(Join(s0, 0).ok());
  ASSERT_TRUE(Join(s0, 0, SmallSpec("other")).ok());
  ASSERT_TRUE(Join(s1, 1).ok());
  EXPECT_EQ(registry_.CloseSession(s0, "test"), 2);
  EXPECT_EQ(registry_.counters().num_sessions, 1);
  EXPECT_EQ(state_->attached, (std::set<std::pair<std::string, int>>{{"g", 1}}));
  EXPECT_EQ(registry_.counters().num_groups, 1);  // "other" had no member left.
  EXPECT_EQ(state_->groups_destroyed, 1);
  // Rank 0 is free again for a new session; the closed session cannot join.
  std::string s2 = Session();
  EXPECT_TRUE(Join(s2, 0).ok());
  EXPECT_EQ(Join(s0, 0, SmallSpec("x")).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(registry_.CloseSession(s0, "again"), 0);
}

TEST_F(RegistryTest, DrainingRefusesSessionsAndJoins) {
  std::string s = Session();
  registry_.SetDraining();
  EXPECT_EQ(registry_.OpenSession(PeerCredentials{.pid = 1}, "late").status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(Join(s, 0).status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(RegistryTest, ReleaseAllDetachesEverything) {
  std::string s = Session();
  ASSERT_TRUE(Join(s, 0).ok());
  ASSERT_TRUE(Join(s, 0, SmallSpec("h")).ok());
  registry_.ReleaseAll();
  EXPECT_TRUE(state_->attached.empty());
  EXPECT_EQ(state_->groups_destroyed, 2);
  EXPECT_EQ(registry_.counters().num_sessions, 0);
}

// ---- Who may join and see a group; per-uid quotas ------------------------------------------

TEST(JoinSecretTest, MatchesOnlyTheSameBytes) {
  JoinSecret none;
  EXPECT_FALSE(none.set());
  EXPECT_TRUE(none.Matches(""));
  EXPECT_FALSE(none.Matches("x"));
  JoinSecret secret;
  secret.Set(std::string("s3cr\0t", 6));  // Any bytes, NULs included.
  EXPECT_TRUE(secret.set());
  EXPECT_TRUE(secret.Matches(std::string("s3cr\0t", 6)));
  EXPECT_FALSE(secret.Matches("s3cr"));  // A prefix.
  EXPECT_FALSE(secret.Matches(std::string("s3cr\0t\0", 7)));
  EXPECT_FALSE(secret.Matches(std::string("s3cr\0u", 6)));
  EXPECT_FALSE(secret.Matches(""));
  const std::string longest(kMaxJoinSecretBytes, 'k');
  secret.Set(longest);
  EXPECT_TRUE(secret.Matches(longest));
  EXPECT_FALSE(secret.Matches(longest + "k"));
  secret.Set("");
  EXPECT_FALSE(secret.set());
}

constexpr uint32_t kAlice = 1000, kBob = 2000, kCarol = 3000, kEpdUid = 999;

/// A registry with the daemon's default quotas, epd's own uid kEpdUid, and sessions of
/// several uids (as SO_PEERCRED would give them).
class RegistryPolicyTest : public ::testing::Test {
 protected:
  RegistryPolicyTest() : state_(std::make_shared<FakeDataPlaneState>()), plane_(state_) {
    Reset(GroupRegistry::Options{.operator_uid = kEpdUid});
  }

  void Reset(GroupRegistry::Options options) {
    registry_.reset();
    registry_ = std::make_unique<GroupRegistry>(&plane_, OneGpu(), options);
  }

  std::string Session(uint32_t uid, int64_t pid = 77) {
    absl::StatusOr<std::string> id =
        registry_->OpenSession(PeerCredentials{.pid = pid, .uid = uid, .gid = uid}, "test");
    EXPECT_TRUE(id.ok()) << id.status();
    return id.value_or("");
  }

  absl::Status Join(const std::string& session, int32_t rank, const std::string& secret = "",
                    const v1::GroupSpec& spec = SmallSpec()) {
    v1::JoinGroupRequest request;
    *request.mutable_spec() = spec;
    request.set_rank(rank);
    request.set_session_id(session);
    request.set_join_secret(secret);
    return registry_->Join(request).status();
  }

  std::vector<std::string> Visible(uint32_t uid) const {
    std::vector<std::string> names;
    const v1::ListGroupsResponse list = registry_->ListGroups(PeerCredentials{.uid = uid});
    for (const v1::GroupInfo& g : list.groups()) {
      names.push_back(g.spec().name());
    }
    return names;
  }

  std::shared_ptr<FakeDataPlaneState> state_;
  FakeDataPlane plane_;
  std::unique_ptr<GroupRegistry> registry_;
};

TEST_F(RegistryPolicyTest, TheFirstJoinersUidOwnsTheGroupAndListGroupsShowsIt) {
  std::string a = Session(kAlice, 4321);
  ASSERT_TRUE(Join(a, 0).ok());
  v1::ListGroupsResponse list = registry_->ListGroups(PeerCredentials{.uid = kAlice});
  ASSERT_THAT(list.groups(), SizeIs(1));
  EXPECT_EQ(list.groups(0).owner_uid(), kAlice);
  EXPECT_FALSE(list.groups(0).join_secret_set());
  ASSERT_THAT(list.groups(0).ranks(), SizeIs(1));
  EXPECT_EQ(list.groups(0).ranks(0).uid(), kAlice);
  EXPECT_EQ(list.groups(0).ranks(0).client_pid(), 4321);
  // The owner stays the first joiner's uid while the group lives, whoever holds its ranks.
  std::string a2 = Session(kAlice);
  ASSERT_TRUE(Join(a2, 1).ok());
  ASSERT_TRUE(registry_->CloseSession(a, "test"));
  EXPECT_EQ(registry_->ListGroups(PeerCredentials{.uid = kAlice}).groups(0).owner_uid(), kAlice);
}

TEST_F(RegistryPolicyTest, WithoutASecretOnlyTheOwnersUidJoinsRootIncluded) {
  std::string a0 = Session(kAlice), a1 = Session(kAlice), b = Session(kBob), root = Session(0);
  ASSERT_TRUE(Join(a0, 0).ok());
  absl::Status status = Join(b, 1);
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("rank 1 of group \"g\""), HasSubstr("uid 2000"),
                    HasSubstr("owner's uid (1000)"), HasSubstr("join secret")));
  EXPECT_EQ(Join(root, 1).code(), absl::StatusCode::kPermissionDenied);
  // A refused joiner learns nothing of the group's spec or ranks: a different spec, or a
  // held rank, gets the same refusal, not the field comparison or the holder.
  v1::GroupSpec other = SmallSpec();
  other.set_hidden(512);
  status = Join(b, 1, "", other);
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(status.message()), Not(HasSubstr("hidden")));
  status = Join(b, 0);
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(status.message()), Not(HasSubstr("pid")));
  EXPECT_THAT(state_->attached, SizeIs(1));
  // The owner's uid joins further ranks without a secret, from any of its processes.
  EXPECT_TRUE(Join(a1, 1).ok());
}

TEST_F(RegistryPolicyTest, WithASecretEveryLaterJoinerPresentsIt) {
  const std::string secret = "correct horse battery staple";
  std::string a0 = Session(kAlice), a1 = Session(kAlice), b = Session(kBob), c = Session(kCarol);
  ASSERT_TRUE(Join(a0, 0, secret).ok());
  for (const std::string& wrong : {std::string(), std::string("correct horse"), secret + "!"}) {
    absl::Status status = Join(b, 1, wrong);
    EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << wrong;
    EXPECT_THAT(std::string(status.message()),
                AllOf(HasSubstr("join_secret"), HasSubstr("rank 1 of group \"g\""),
                      Not(HasSubstr("correct horse")), Not(HasSubstr("staple"))));
  }
  // The owner's own uid needs it too: the secret admits exactly those who hold it.
  EXPECT_EQ(Join(a1, 1).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(Join(b, 1, secret).ok());
  // A secret presented to a group created without one is refused (a misconfigured rank).
  ASSERT_TRUE(Join(c, 0, "", SmallSpec("plain")).ok());
  EXPECT_EQ(Join(c, 1, "anything", SmallSpec("plain")).code(), absl::StatusCode::kPermissionDenied);
  // Longer than kMaxJoinSecretBytes: refused before anything else, without an echo.
  absl::Status status = Join(a1, 1, std::string(kMaxJoinSecretBytes + 1, 'z'), SmallSpec("h"));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("join_secret: 257 bytes"), Not(HasSubstr("zz"))));
  // ListGroups says a secret is set, never what it is.
  v1::ListGroupsResponse list = registry_->ListGroups(PeerCredentials{.uid = 0});
  ASSERT_THAT(list.groups(), SizeIs(2));
  EXPECT_TRUE(list.groups(0).join_secret_set());
  EXPECT_FALSE(list.groups(1).join_secret_set());
  EXPECT_THAT(list.DebugString(), Not(HasSubstr("horse")));
}

TEST_F(RegistryPolicyTest, ListGroupsShowsOwnAndHeldGroupsOperatorsSeeAll) {
  std::string a = Session(kAlice), b = Session(kBob), c = Session(kCarol);
  ASSERT_TRUE(Join(a, 0, "", SmallSpec("alices")).ok());
  ASSERT_TRUE(Join(b, 0, "bobs-secret", SmallSpec("bobs")).ok());
  ASSERT_TRUE(Join(a, 1, "bobs-secret", SmallSpec("bobs")).ok());
  EXPECT_EQ(Visible(kAlice), (std::vector<std::string>{"alices", "bobs"}));
  EXPECT_EQ(Visible(kBob), (std::vector<std::string>{"bobs"}));
  EXPECT_TRUE(Visible(kCarol).empty());
  EXPECT_EQ(Visible(0), (std::vector<std::string>{"alices", "bobs"}));
  EXPECT_EQ(Visible(kEpdUid), (std::vector<std::string>{"alices", "bobs"}));
  // Once alice's rank leaves "bobs", she no longer sees it.
  ASSERT_TRUE(registry_->CloseSession(a, "test"));
  EXPECT_TRUE(Visible(kAlice).empty());
  // Counts stay whole-daemon for everyone (GetStats).
  EXPECT_EQ(registry_->counters().num_groups, 1);
  (void)c;
}

TEST_F(RegistryPolicyTest, GroupsAnotherUidCannotSeeAnswerAsIfTheyDidNotExist) {
  std::string a = Session(kAlice), c = Session(kCarol);
  ASSERT_TRUE(Join(a, 0).ok());
  auto leave = [&](const std::string& group, int32_t rank) {
    v1::LeaveGroupRequest r;
    r.set_group(group);
    r.set_rank(rank);
    r.set_session_id(c);
    return registry_->Leave(r);
  };
  auto endpoints = [&](const std::string& group, int32_t rank) {
    v1::GetGroupEndpointsRequest r;
    r.set_group(group);
    r.set_rank(rank);
    r.set_session_id(c);
    return registry_->GetGroupEndpoints(r).status();
  };
  for (int32_t rank : {0, 1}) {
    absl::Status hidden = leave("g", rank), missing = leave("h", rank);
    EXPECT_EQ(hidden.code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(absl::StrReplaceAll(hidden.message(), {{"\"g\"", "\"h\""}}), missing.message());
    hidden = endpoints("g", rank);
    missing = endpoints("h", rank);
    EXPECT_EQ(hidden.code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(absl::StrReplaceAll(hidden.message(), {{"\"g\"", "\"h\""}}), missing.message());
  }
  EXPECT_THAT(state_->attached, SizeIs(1));
}

TEST_F(RegistryPolicyTest, ASessionActsOnlyForTheUidThatOpenedIt) {
  std::string a = Session(kAlice);
  EXPECT_TRUE(registry_->CheckSessionCaller(a, PeerCredentials{.pid = 5, .uid = kAlice}).ok());
  absl::Status status = registry_->CheckSessionCaller(a, PeerCredentials{.uid = kBob});
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("uid 1000"), HasSubstr("uid 2000"), Not(HasSubstr(a))));
  // Root is no exception: a session id is not a credential for another user.
  EXPECT_EQ(registry_->CheckSessionCaller(a, PeerCredentials{.uid = 0}).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(
      registry_
          ->CheckSessionCaller("0123456789abcdef0123456789abcdef", PeerCredentials{.uid = kAlice})
          .code(),
      absl::StatusCode::kFailedPrecondition);
}

TEST_F(RegistryPolicyTest, EveryEndpointOfAUidSharesOneLogBudgetAcrossSessionsGroupsAndRejoins) {
  // Client-caused warnings are charged to the uid (docs/SECURITY.md): a new session, a new
  // group, or leaving everything and joining again gives a client no fresh budget.
  const std::string a1 = Session(kAlice), a2 = Session(kAlice, 78);
  ASSERT_TRUE(Join(a1, 0).ok());
  ASSERT_TRUE(Join(a2, 1).ok());
  ASSERT_TRUE(Join(a2, 0, "", SmallSpec("g2")).ok());
  auto client_of = [&](const std::string& group_rank) {
    std::lock_guard<std::mutex> lock(state_->mu);
    return state_->last_client.at(group_rank);
  };
  const RankClient first = client_of("g/0");
  ASSERT_NE(first.log_budget, nullptr);
  EXPECT_EQ(first.uid, kAlice);
  EXPECT_EQ(first.log_budget->client(), "uid 1000");
  EXPECT_EQ(client_of("g/1").log_budget, first.log_budget);
  EXPECT_EQ(client_of("g2/0").log_budget, first.log_budget);
  registry_->CloseSession(a1, "test");
  registry_->CloseSession(a2, "test");
  EXPECT_EQ(registry_->counters().num_groups, 0);
  const std::string a3 = Session(kAlice, 79);
  ASSERT_TRUE(Join(a3, 0).ok());
  EXPECT_EQ(client_of("g/0").log_budget, first.log_budget);
  // Another uid has a budget of its own.
  const std::string b = Session(kBob);
  ASSERT_TRUE(Join(b, 0, "", SmallSpec("bobs")).ok());
  EXPECT_EQ(client_of("bobs/0").uid, kBob);
  ASSERT_NE(client_of("bobs/0").log_budget, nullptr);
  EXPECT_NE(client_of("bobs/0").log_budget, first.log_budget);
  EXPECT_EQ(client_of("bobs/0").log_budget->client(), "uid 2000");
}

TEST_F(RegistryPolicyTest, MaxGroupsPerUid) {
  Reset(GroupRegistry::Options{.max_groups = 8, .max_groups_per_uid = 2});
  std::string a = Session(kAlice), b = Session(kBob), root = Session(0);
  ASSERT_TRUE(Join(a, 0, "", SmallSpec("a1")).ok());
  ASSERT_TRUE(Join(a, 0, "", SmallSpec("a2")).ok());
  absl::Status status = Join(a, 0, "", SmallSpec("a3"));
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("max_groups_per_uid"), HasSubstr("uid 1000 owns 2 groups"),
                    HasSubstr("quota is 2"), HasSubstr("group \"a3\""), HasSubstr("DaemonConfig")));
  EXPECT_EQ(state_->groups_created, 2);
  // Joining a live group is no new group; other uids have their own quota; root has one too.
  ASSERT_TRUE(Join(a, 1, "", SmallSpec("a1")).ok());
  EXPECT_TRUE(Join(b, 0, "", SmallSpec("b1")).ok());
  ASSERT_TRUE(Join(root, 0, "", SmallSpec("r1")).ok());
  ASSERT_TRUE(Join(root, 0, "", SmallSpec("r2")).ok());
  EXPECT_EQ(Join(root, 0, "", SmallSpec("r3")).code(), absl::StatusCode::kResourceExhausted);
  // A destroyed group no longer counts.
  ASSERT_TRUE(registry_->CloseSession(a, "test"));
  EXPECT_TRUE(Join(Session(kAlice), 0, "", SmallSpec("a3")).ok());
  EXPECT_EQ(registry_->UsageOf(kAlice).groups_owned, 1u);
}

TEST_F(RegistryPolicyTest, MaxEndpointsPerUidCountsEverySessionOfTheUid) {
  Reset(GroupRegistry::Options{.max_endpoints_per_uid = 3});
  std::string a0 = Session(kAlice), a1 = Session(kAlice), b = Session(kBob);
  ASSERT_TRUE(Join(a0, 0, "s", SmallSpec("x")).ok());
  ASSERT_TRUE(Join(a0, 1, "s", SmallSpec("x")).ok());
  ASSERT_TRUE(Join(a1, 0, "s", SmallSpec("y")).ok());
  absl::Status status = Join(a1, 1, "s", SmallSpec("y"));
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("max_endpoints_per_uid"), HasSubstr("uid 1000 holds 3 endpoints"),
                    HasSubstr("quota is 3"), HasSubstr("rank 1 of group \"y\"")));
  // Another uid may take that rank (with the secret); a leave frees one of alice's.
  EXPECT_TRUE(Join(b, 1, "s", SmallSpec("y")).ok());
  EXPECT_EQ(registry_->UsageOf(kAlice).endpoints, 3u);
  v1::LeaveGroupRequest leave;
  leave.set_group("x");
  leave.set_rank(1);
  leave.set_session_id(a0);
  ASSERT_TRUE(registry_->Leave(leave).ok());
  EXPECT_TRUE(Join(a1, 1, "s", SmallSpec("x")).ok());
}

TEST_F(RegistryPolicyTest, MaxEndpointBytesPerUid) {
  state_->bytes_per_rank = 1000;
  Reset(GroupRegistry::Options{.max_endpoint_bytes_per_uid = 2500});
  std::string a = Session(kAlice), b = Session(kBob);
  ASSERT_TRUE(Join(a, 0, "", SmallSpec("x")).ok());
  ASSERT_TRUE(Join(a, 1, "", SmallSpec("x")).ok());
  absl::Status status = Join(a, 0, "", SmallSpec("y"));
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("max_endpoint_bytes_per_uid"), HasSubstr("uid 1000 holds 2000 bytes"),
                    HasSubstr("quota is 2500"), HasSubstr("needs 1000 more")));
  EXPECT_EQ(state_->groups_created, 1) << "a refused join creates no group";
  EXPECT_TRUE(Join(b, 0, "", SmallSpec("y")).ok());
  EXPECT_EQ(registry_->UsageOf(kAlice).endpoint_bytes, 2000u);
  // One endpoint larger than the whole quota is refused as well (no wrap-around).
  state_->bytes_per_rank = ~uint64_t{0};
  EXPECT_EQ(Join(Session(kCarol), 0, "", SmallSpec("huge")).code(),
            absl::StatusCode::kResourceExhausted);
}

TEST_F(RegistryPolicyTest, ZeroQuotasAreUnlimited) {
  Reset(GroupRegistry::Options{.max_groups = 100,
                               .max_groups_per_uid = 0,
                               .max_endpoints_per_uid = 0,
                               .max_endpoint_bytes_per_uid = 0});
  std::string a = Session(kAlice);
  for (int i = 0; i < 80; ++i) {
    ASSERT_TRUE(Join(a, 0, "", SmallSpec(absl::StrCat("g", i))).ok()) << i;
    ASSERT_TRUE(Join(a, 1, "", SmallSpec(absl::StrCat("g", i))).ok()) << i;
  }
  EXPECT_EQ(registry_->UsageOf(kAlice).endpoints, 160u);
}

TEST_F(RegistryPolicyTest, MaxSessionsPerUidCountsOpenSessionsRootIncluded) {
  Reset(GroupRegistry::Options{.max_sessions_per_uid = 2});
  std::string a1 = Session(kAlice), a2 = Session(kAlice);
  absl::StatusOr<std::string> third =
      registry_->OpenSession(PeerCredentials{.pid = 9, .uid = kAlice, .gid = kAlice}, "third");
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(third.status().message()),
              AllOf(HasSubstr("max_sessions_per_uid"), HasSubstr("uid 1000 has 2 open sessions"),
                    HasSubstr("quota is 2"), HasSubstr("DaemonConfig")));
  EXPECT_EQ(registry_->UsageOf(kAlice).sessions, 2u);
  // Another uid has its own quota; root has one too.
  Session(kBob);
  Session(0);
  Session(0);
  EXPECT_EQ(registry_->OpenSession(PeerCredentials{.uid = 0}, "root").status().code(),
            absl::StatusCode::kResourceExhausted);
  // A closed session no longer counts.
  registry_->CloseSession(a1, "test");
  EXPECT_TRUE(
      registry_->OpenSession(PeerCredentials{.pid = 9, .uid = kAlice, .gid = kAlice}, "again")
          .ok());
  // 0 = no limit.
  Reset(GroupRegistry::Options{.max_sessions_per_uid = 0});
  for (int i = 0; i < 300; ++i) Session(kAlice);
  EXPECT_EQ(registry_->UsageOf(kAlice).sessions, 300u);
}

TEST_F(RegistryPolicyTest, EndpointsWaitersAreCappedPerSessionAndInAll) {
  Reset(GroupRegistry::Options{.max_endpoints_waiters_per_session = 2, .max_endpoints_waiters = 3});
  // Answers arrive when the registry goes away (UNAVAILABLE): count them from outside it.
  auto answered = std::make_shared<std::atomic<int>>(0);
  std::string a = Session(kAlice), b = Session(kBob);
  ASSERT_TRUE(Join(a, 0, "", SmallSpec("ga")).ok());
  ASSERT_TRUE(Join(b, 0, "", SmallSpec("gb")).ok());
  auto wait = [&](const std::string& session, const std::string& group) {
    v1::GetGroupEndpointsRequest r;
    r.set_group(group);
    r.set_rank(0);
    r.set_session_id(session);
    r.set_wait_ms(60000);
    auto got = std::make_shared<std::optional<absl::Status>>();
    registry_->GetGroupEndpoints(r, [answered, got](auto result) {
      *got = result.status();
      ++*answered;
    });
    return *got;  // nullopt: parked (rank 1 is missing).
  };
  EXPECT_FALSE(wait(a, "ga").has_value());
  EXPECT_FALSE(wait(a, "ga").has_value());
  std::optional<absl::Status> third = wait(a, "ga");
  ASSERT_TRUE(third.has_value());
  EXPECT_EQ(third->code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(third->message()),
              AllOf(HasSubstr("already has 2 calls waiting"), HasSubstr("per session is 2"),
                    Not(HasSubstr(a))));
  // Another session may still wait, up to the total.
  EXPECT_FALSE(wait(b, "gb").has_value());
  std::optional<absl::Status> over_total = wait(b, "gb");
  ASSERT_TRUE(over_total.has_value());
  EXPECT_EQ(over_total->code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(over_total->message()),
              AllOf(HasSubstr("3 calls are already waiting"), HasSubstr("limit is 3")));
  // A call that need not wait is answered whatever the waiters.
  ASSERT_TRUE(Join(b, 1, "", SmallSpec("gb")).ok());
  for (int i = 0; i < 50 && answered->load() < 3; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(answered->load(), 3);  // Two refusals and b's waiter, answered by the join.
  std::optional<absl::Status> ready = wait(b, "gb");
  ASSERT_TRUE(ready.has_value());
  EXPECT_TRUE(ready->ok()) << *ready;
  registry_.reset();
  EXPECT_EQ(answered->load(), 6);
}

}  // namespace
}  // namespace epd
