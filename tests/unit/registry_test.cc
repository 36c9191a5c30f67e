// GroupRegistry with a fake DataPlane: sessions, joins, leaves, session end, the error
// codes of JoinGroup and group lifetime (daemon/group_registry.h).
#include <memory>
#include <string>

#include "daemon/group_registry.h"
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

  v1::ListGroupsResponse list = registry_.ListGroups();
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

}  // namespace
}  // namespace epd
