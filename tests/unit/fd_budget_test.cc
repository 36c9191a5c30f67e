// The descriptor budget (daemon/core/fd_limits.h) and what rests on it: RLIMIT_NOFILE raised to
// its hard limit, open descriptors counted, joins refused with RESOURCE_EXHAUSTED naming
// the descriptors while fewer than min_free_fds are free, endpoints never mapped expired
// (GroupRegistry::ExpireUnmappedEndpoints), and the two config fields with their defaults
// and bounds.
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "common/os/shm_region.h"
#include "daemon/control/group_registry.h"
#include "daemon/core/config.h"
#include "daemon/core/fd_limits.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/fake_data_plane.h"

namespace epd {
namespace {

using ::testing::AllOf;
using testing::FakeDataPlane;
using testing::FakeDataPlaneState;
using ::testing::HasSubstr;
using testing::OneGpu;
using testing::SmallSpec;

TEST(FdLimitsTest, SoftLimitIsRaisedToTheHardLimit) {
  absl::StatusOr<FdLimit> saved = GetFdLimit();
  ASSERT_TRUE(saved.ok()) << saved.status();
  ASSERT_GT(saved->hard, 64u);
  const rlimit lowered{static_cast<rlim_t>(saved->hard / 2), static_cast<rlim_t>(saved->hard)};
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &lowered), 0);
  absl::StatusOr<FdLimitChange> change = RaiseFdLimitToHard();
  ASSERT_TRUE(change.ok()) << change.status();
  EXPECT_EQ(change->before.soft, saved->hard / 2);
  EXPECT_EQ(change->after.soft, saved->hard);
  EXPECT_EQ(change->after.hard, saved->hard);
  EXPECT_EQ(GetFdLimit()->soft, saved->hard);
  // Already at the hard limit: nothing changes.
  change = RaiseFdLimitToHard();
  ASSERT_TRUE(change.ok());
  EXPECT_EQ(change->before.soft, change->after.soft);
  const rlimit restored{static_cast<rlim_t>(saved->soft), static_cast<rlim_t>(saved->hard)};
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &restored), 0);
}

TEST(FdLimitsTest, OpenDescriptorsAreCountedAndTooFewFreeRefuses) {
  absl::StatusOr<uint64_t> before = CountOpenFds();
  ASSERT_TRUE(before.ok()) << before.status();
  std::vector<ScopedFd> held;
  for (int i = 0; i < 5; ++i) held.emplace_back(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  EXPECT_EQ(*CountOpenFds(), *before + 5);
  held.clear();
  EXPECT_EQ(*CountOpenFds(), *before);

  EXPECT_TRUE(CheckFreeFds(0, "JoinGroup").ok());
  EXPECT_TRUE(CheckFreeFds(8, "JoinGroup").ok());
  const uint64_t soft = GetFdLimit()->soft;
  absl::Status refused = CheckFreeFds(static_cast<uint32_t>(soft), "JoinGroup");
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.message()),
              AllOf(HasSubstr("JoinGroup"), HasSubstr("file descriptors"),
                    HasSubstr(absl::StrCat("of its ", soft)),
                    HasSubstr(absl::StrCat("min_free_fds = ", soft)), HasSubstr("LimitNOFILE")));
}

class FdBudgetRegistryTest : public ::testing::Test {
 protected:
  GroupRegistry::Options Options() {
    GroupRegistry::Options options;
    options.unmapped_endpoint_timeout = absl::Seconds(30);
    return options;
  }
  absl::StatusOr<v1::EndpointInfo> Join(GroupRegistry& registry, const std::string& session,
                                        int32_t rank, const std::string& group = "g") {
    v1::JoinGroupRequest request;
    *request.mutable_spec() = SmallSpec(group);
    request.set_rank(rank);
    request.set_session_id(session);
    return registry.Join(request);
  }
  std::shared_ptr<FakeDataPlaneState> state_ = std::make_shared<FakeDataPlaneState>();
  FakeDataPlane plane_{state_};
};

TEST_F(FdBudgetRegistryTest, JoinsAreRefusedWhileTooFewDescriptorsAreFree) {
  GroupRegistry::Options options = Options();
  options.min_free_fds = static_cast<uint32_t>(GetFdLimit()->soft);  // Never that many free.
  GroupRegistry registry(&plane_, OneGpu(), options);
  const std::string session =
      *registry.OpenSession(PeerCredentials{.pid = 1, .uid = 1000, .gid = 1000}, "test");
  absl::StatusOr<v1::EndpointInfo> joined = Join(registry, session, 0);
  EXPECT_EQ(joined.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(joined.status().message()),
              AllOf(HasSubstr("file descriptors"), HasSubstr("min_free_fds")));
  EXPECT_TRUE(state_->attached.empty());

  GroupRegistry relaxed(&plane_, OneGpu(), Options());  // The default 0: never refused.
  const std::string other =
      *relaxed.OpenSession(PeerCredentials{.pid = 1, .uid = 1000, .gid = 1000}, "test");
  EXPECT_TRUE(Join(relaxed, other, 0).ok());
}

TEST_F(FdBudgetRegistryTest, EndpointsNeverMappedExpireAndMappedOnesStay) {
  GroupRegistry registry(&plane_, OneGpu(), Options());
  const std::string session =
      *registry.OpenSession(PeerCredentials{.pid = 1, .uid = 1000, .gid = 1000}, "test");
  state_->unmapped = {{"g", 1}, {"h", 0}, {"h", 1}};
  ASSERT_TRUE(Join(registry, session, 0, "g").ok());
  ASSERT_TRUE(Join(registry, session, 1, "g").ok());
  ASSERT_TRUE(Join(registry, session, 0, "h").ok());
  ASSERT_TRUE(Join(registry, session, 1, "h").ok());

  const absl::Time now = absl::Now();
  EXPECT_EQ(registry.ExpireUnmappedEndpoints(now), 0);
  EXPECT_EQ(registry.ExpireUnmappedEndpoints(now + absl::Seconds(29)), 0);
  EXPECT_EQ(registry.ExpireUnmappedEndpoints(now + absl::Seconds(31)), 3);
  // g/0 was mapped and stays; g/1 and group h went.
  EXPECT_EQ(state_->attached, (std::set<std::pair<std::string, int>>{{"g", 0}}));
  v1::ListGroupsResponse groups = registry.ListGroups(PeerCredentials{.uid = 1000});
  ASSERT_EQ(groups.groups_size(), 1);
  EXPECT_EQ(groups.groups(0).spec().name(), "g");
  ASSERT_EQ(groups.groups(0).ranks_size(), 1);
  EXPECT_EQ(groups.groups(0).ranks(0).rank(), 0);
  // The session no longer holds them: leaving one is NOT_FOUND, rejoining works.
  v1::LeaveGroupRequest leave;
  leave.set_group("g");
  leave.set_rank(1);
  leave.set_session_id(session);
  EXPECT_EQ(registry.Leave(leave).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Join(registry, session, 1, "g").ok());
  // A rank once seen mapped (g/0) never expires, however long it lives; the new g/1 does.
  EXPECT_EQ(registry.ExpireUnmappedEndpoints(now + absl::Hours(10)), 1);
  EXPECT_EQ(state_->attached, (std::set<std::pair<std::string, int>>{{"g", 0}}));
  EXPECT_EQ(registry.CloseSession(session, "test"), 1);
}

TEST(FdBudgetConfigTest, DefaultsBoundsAndWarning) {
  v1::DaemonConfig config;
  FillDaemonConfigDefaults(&config);
  EXPECT_EQ(config.min_free_fds(), 64u);
  EXPECT_EQ(config.unmapped_endpoint_timeout_ms(), 30000u);
  EXPECT_TRUE(ValidateDaemonConfig(config).ok());
  EXPECT_TRUE(DaemonConfigWarnings(config).empty());

  // A long op timeout moves the default past the wait of a client-launched rank.
  v1::DaemonConfig slow;
  slow.set_op_timeout_ms(60000);
  FillDaemonConfigDefaults(&slow);
  EXPECT_EQ(slow.unmapped_endpoint_timeout_ms(), 70000u);

  // Present values are kept (0 = never refuse joins) and checked.
  absl::StatusOr<v1::DaemonConfig> parsed =
      ParseDaemonConfig("min_free_fds: 0 unmapped_endpoint_timeout_ms: 500", "test");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  FillDaemonConfigDefaults(&*parsed);
  EXPECT_EQ(parsed->min_free_fds(), 0u);
  EXPECT_EQ(parsed->unmapped_endpoint_timeout_ms(), 500u);
  EXPECT_TRUE(ValidateDaemonConfig(*parsed).ok());
  EXPECT_THAT(DaemonConfigWarnings(*parsed),
              ::testing::ElementsAre(AllOf(HasSubstr("unmapped_endpoint_timeout_ms: 500"),
                                           HasSubstr("client-launched"))));

  for (const auto& [text, field, value] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"unmapped_endpoint_timeout_ms: 0", "unmapped_endpoint_timeout_ms", "0"},
           {"unmapped_endpoint_timeout_ms: 99", "unmapped_endpoint_timeout_ms", "99"},
           {"unmapped_endpoint_timeout_ms: 86400001", "unmapped_endpoint_timeout_ms", "86400001"},
           {"min_free_fds: 1048577", "min_free_fds", "1048577"}}) {
    absl::StatusOr<v1::DaemonConfig> bad = ParseDaemonConfig(text, "test");
    ASSERT_TRUE(bad.ok()) << bad.status();
    FillDaemonConfigDefaults(&*bad);
    absl::Status status = ValidateDaemonConfig(*bad);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr(field), HasSubstr(value)));
  }
}

}  // namespace
}  // namespace epd
