// Issue 4's launch modes on the CPU: GetGroupEndpoints and the group launch mode in the
// GroupRegistry (with a fake data plane), the host backend's refusals (client-launched
// mode, stream-ordered requests), and LockstepGroup's OpEndedWithoutLaunch hook (the CUDA
// backend writes launch_flags.done_seq from it) on every path where an op ends without
// the backend running it.
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/os/shm_region.h"
#include "daemon/control/group_registry.h"
#include "daemon/dataplane/host/host_data_plane.h"
#include "daemon/dataplane/lockstep_group.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/abi/shm_abi.h"
#include "tests/unit/fake_data_plane.h"
#include "tests/unit/raw_ring.h"

namespace epd {
namespace {

using ::testing::ElementsAre;
using testing::FakeDataPlane;
using testing::FakeDataPlaneState;
using ::testing::HasSubstr;
using testing::kGpuA;
using testing::OneGpu;
using testing::RawRing;
using testing::SmallSpec;

v1::GroupSpec SpecOf(const std::string& name, int ranks) {
  v1::GroupSpec spec = SmallSpec(name);
  spec.set_num_ranks(ranks);
  spec.set_num_experts(2 * ranks);  // E % R == 0.
  return spec;
}

// ---- GroupRegistry: GetGroupEndpoints and launch modes -----------------------------------

class RegistryLaunchModeTest : public ::testing::Test {
 protected:
  explicit RegistryLaunchModeTest(const std::string& backend = "host")
      : state_(MakeState(backend)),
        plane_(state_),
        registry_(&plane_, OneGpu(),
                  GroupRegistry::Options{.max_groups = 8, .max_endpoints_wait_ms = 3000}) {}

  static std::shared_ptr<FakeDataPlaneState> MakeState(const std::string& backend) {
    auto s = std::make_shared<FakeDataPlaneState>();
    s->backend = backend;
    return s;
  }

  std::string Session(int64_t pid = 42, uint32_t uid = 1000) {
    absl::StatusOr<std::string> id =
        registry_.OpenSession(PeerCredentials{.pid = pid, .uid = uid, .gid = uid}, "test");
    EXPECT_TRUE(id.ok()) << id.status();
    return id.value_or("");
  }

  absl::StatusOr<v1::EndpointInfo> Join(const std::string& session, int32_t rank,
                                        const v1::GroupSpec& spec,
                                        v1::LaunchMode mode = v1::LAUNCH_MODE_UNSPECIFIED) {
    v1::JoinGroupRequest request;
    *request.mutable_spec() = spec;
    request.set_rank(rank);
    request.set_session_id(session);
    request.set_launch_mode(mode);
    if (state_->backend == "cuda") request.set_gpu_uuid(kGpuA);
    return registry_.Join(request);
  }

  static v1::GetGroupEndpointsRequest Ask(const std::string& session, const std::string& group,
                                          int32_t rank, uint32_t wait_ms) {
    v1::GetGroupEndpointsRequest r;
    r.set_group(group);
    r.set_rank(rank);
    r.set_session_id(session);
    r.set_wait_ms(wait_ms);
    return r;
  }

  std::shared_ptr<FakeDataPlaneState> state_;
  FakeDataPlane plane_;
  GroupRegistry registry_;
};

class CudaRegistryLaunchModeTest : public RegistryLaunchModeTest {
 protected:
  CudaRegistryLaunchModeTest() : RegistryLaunchModeTest("cuda") {}
};

TEST_F(RegistryLaunchModeTest, EndpointsOfACompleteGroupComeAtOnceOrderedByRank) {
  const std::string s = Session();
  const v1::GroupSpec spec = SpecOf("full", 3);
  // Joined out of order.
  for (int r : {2, 0, 1}) ASSERT_TRUE(Join(s, r, spec).ok());
  const auto start = std::chrono::steady_clock::now();
  auto eps = registry_.GetGroupEndpoints(Ask(s, "full", 1, 0));
  ASSERT_TRUE(eps.ok()) << eps.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(500));
  ASSERT_EQ(eps->endpoints_size(), 3);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(eps->endpoints(r).rank(), r);
    EXPECT_EQ(eps->endpoints(r).launch_mode(), v1::LAUNCH_MODE_DAEMON);
    EXPECT_EQ(eps->endpoints(r).cuda_ipc_handle(), "");  // Host backend.
  }
}

TEST_F(RegistryLaunchModeTest, WaitsForTheLastRankWithoutBlockingOtherCalls) {
  const std::string s0 = Session(1), s1 = Session(2);
  const v1::GroupSpec spec = SpecOf("waits", 2);
  ASSERT_TRUE(Join(s0, 0, spec).ok());
  std::atomic<bool> answered{false};
  absl::StatusOr<v1::GetGroupEndpointsResponse> got = absl::UnknownError("not answered");
  std::thread waiter([&] {
    got = registry_.GetGroupEndpoints(Ask(s0, "waits", 0, 2500));
    answered = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(answered.load()) << "answered before rank 1 joined";
  // Other registry calls go on meanwhile (ListGroups, a join of another group).
  EXPECT_EQ(registry_.ListGroups(PeerCredentials{.uid = 1000}).groups_size(), 1);
  ASSERT_TRUE(Join(s1, 0, SpecOf("other", 1)).ok());
  const auto joined = std::chrono::steady_clock::now();
  ASSERT_TRUE(Join(s1, 1, spec).ok());
  waiter.join();
  EXPECT_LT(std::chrono::steady_clock::now() - joined, std::chrono::milliseconds(1000))
      << "the answer must come as the last rank joins, not at the end of the wait";
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->endpoints_size(), 2);
  EXPECT_EQ(got->endpoints(0).rank(), 0);
  EXPECT_EQ(got->endpoints(1).rank(), 1);
}

TEST_F(RegistryLaunchModeTest, MissingRanksAreNamedWhenTheWaitEnds) {
  const std::string s = Session();
  const v1::GroupSpec spec = SpecOf("missing", 4);
  ASSERT_TRUE(Join(s, 0, spec).ok());
  ASSERT_TRUE(Join(s, 2, spec).ok());
  auto now = registry_.GetGroupEndpoints(Ask(s, "missing", 0, 0));
  EXPECT_EQ(now.status().code(), absl::StatusCode::kDeadlineExceeded) << now.status();
  EXPECT_THAT(now.status().message(), HasSubstr("rank(s) 1, 3 of 4"));
  const auto start = std::chrono::steady_clock::now();
  auto waited = registry_.GetGroupEndpoints(Ask(s, "missing", 2, 300));
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kDeadlineExceeded) << waited.status();
  EXPECT_THAT(waited.status().message(), HasSubstr("rank(s) 1, 3"));
  EXPECT_THAT(waited.status().message(), HasSubstr("wait_ms = 300"));
  EXPECT_GE(took, std::chrono::milliseconds(280));
  EXPECT_LT(took, std::chrono::milliseconds(2000));
}

TEST_F(RegistryLaunchModeTest, WaitIsCappedByTheDaemonsBound) {
  const std::string s = Session();
  ASSERT_TRUE(Join(s, 0, SpecOf("capped", 2)).ok());
  const auto start = std::chrono::steady_clock::now();
  auto r = registry_.GetGroupEndpoints(Ask(s, "capped", 0, 3600 * 1000));
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("wait_ms = 3000"));  // Options' cap.
  EXPECT_LT(took, std::chrono::milliseconds(5000));
}

TEST_F(RegistryLaunchModeTest, CallerMustHoldTheRankAndTheGroupMustExist) {
  const std::string mine = Session(1), theirs = Session(2);
  const v1::GroupSpec spec = SpecOf("held", 2);
  ASSERT_TRUE(Join(mine, 0, spec).ok());
  ASSERT_TRUE(Join(theirs, 1, spec).ok());
  auto unknown = registry_.GetGroupEndpoints(Ask(mine, "nope", 0, 0));
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
  EXPECT_THAT(unknown.status().message(), HasSubstr("\"nope\""));
  auto foreign = registry_.GetGroupEndpoints(Ask(mine, "held", 1, 0));
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kPermissionDenied) << foreign.status();
  EXPECT_THAT(foreign.status().message(), HasSubstr("does not hold rank 1"));
  EXPECT_THAT(std::string(foreign.status().message()), ::testing::Not(HasSubstr(theirs)));
  auto bad_session = registry_.GetGroupEndpoints(Ask("0123", "held", 0, 0));
  EXPECT_EQ(bad_session.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(bad_session.status().message(), HasSubstr("not an open session"));
  ASSERT_TRUE(Join(mine, 0, SpecOf("half", 2)).ok());
  auto not_joined = registry_.GetGroupEndpoints(Ask(mine, "half", 1, 0));
  EXPECT_EQ(not_joined.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(not_joined.status().message(), HasSubstr("rank: 1 of group \"half\" is not joined"));
  // The rightful holder gets the endpoints.
  EXPECT_TRUE(registry_.GetGroupEndpoints(Ask(theirs, "held", 1, 0)).ok());
}

TEST_F(RegistryLaunchModeTest, AWaitEndsWhenTheCallersSessionEndsOrTheDaemonDrains) {
  const std::string s = Session(1), t = Session(2);
  ASSERT_TRUE(Join(s, 0, SpecOf("ends", 2)).ok());
  ASSERT_TRUE(Join(t, 0, SpecOf("drains", 2)).ok());
  absl::StatusOr<v1::GetGroupEndpointsResponse> ended = absl::UnknownError("");
  absl::StatusOr<v1::GetGroupEndpointsResponse> drained = absl::UnknownError("");
  std::thread a([&] { ended = registry_.GetGroupEndpoints(Ask(s, "ends", 0, 3000)); });
  std::thread b([&] { drained = registry_.GetGroupEndpoints(Ask(t, "drains", 0, 3000)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const auto start = std::chrono::steady_clock::now();
  registry_.CloseSession(s, "test");
  a.join();
  EXPECT_EQ(ended.status().code(), absl::StatusCode::kFailedPrecondition) << ended.status();
  registry_.SetDraining();
  b.join();
  EXPECT_EQ(drained.status().code(), absl::StatusCode::kUnavailable) << drained.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(1500));
}

TEST_F(RegistryLaunchModeTest, HostBackendRefusesClientLaunchedMode) {
  const std::string s = Session();
  auto e = Join(s, 0, SpecOf("hostclient", 2), v1::LAUNCH_MODE_CLIENT);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition) << e.status();
  EXPECT_THAT(e.status().message(), HasSubstr("client-launched mode needs the CUDA backend"));
  EXPECT_EQ(registry_.ListGroups(PeerCredentials{.uid = 1000}).groups_size(), 0)
      << "a refused first join leaves no group";
  auto d = Join(s, 0, SpecOf("hostclient", 2), v1::LAUNCH_MODE_DAEMON);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->launch_mode(), v1::LAUNCH_MODE_DAEMON);
}

TEST_F(CudaRegistryLaunchModeTest, FirstJoinerFixesTheModeAndAMismatchNamesBoth) {
  const std::string s = Session();
  const v1::GroupSpec spec = SpecOf("modes", 3);
  auto e0 = Join(s, 0, spec, v1::LAUNCH_MODE_CLIENT);
  ASSERT_TRUE(e0.ok()) << e0.status();
  EXPECT_EQ(e0->launch_mode(), v1::LAUNCH_MODE_CLIENT);
  auto e1 = Join(s, 1, spec, v1::LAUNCH_MODE_DAEMON);
  EXPECT_EQ(e1.status().code(), absl::StatusCode::kFailedPrecondition) << e1.status();
  EXPECT_THAT(e1.status().message(), HasSubstr("LAUNCH_MODE_DAEMON"));
  EXPECT_THAT(e1.status().message(), HasSubstr("LAUNCH_MODE_CLIENT"));
  // Unspecified: the group's mode.
  auto e1b = Join(s, 1, spec);
  ASSERT_TRUE(e1b.ok()) << e1b.status();
  EXPECT_EQ(e1b->launch_mode(), v1::LAUNCH_MODE_CLIENT);
  auto e2 = Join(s, 2, spec, v1::LAUNCH_MODE_CLIENT);
  ASSERT_TRUE(e2.ok()) << e2.status();
  auto eps = registry_.GetGroupEndpoints(Ask(s, "modes", 2, 0));
  ASSERT_TRUE(eps.ok()) << eps.status();
  for (const auto& ep : eps->endpoints()) {
    EXPECT_EQ(ep.launch_mode(), v1::LAUNCH_MODE_CLIENT);
    EXPECT_EQ(ep.gpu_uuid(), kGpuA);
  }

  // A daemon-launched group (first joiner unspecified) refuses an explicit CLIENT joiner.
  auto d0 = Join(s, 0, SpecOf("daemonmode", 2));
  ASSERT_TRUE(d0.ok()) << d0.status();
  EXPECT_EQ(d0->launch_mode(), v1::LAUNCH_MODE_DAEMON);
  auto d1 = Join(s, 1, SpecOf("daemonmode", 2), v1::LAUNCH_MODE_CLIENT);
  EXPECT_EQ(d1.status().code(), absl::StatusCode::kFailedPrecondition) << d1.status();
  EXPECT_THAT(d1.status().message(),
              HasSubstr("asks for LAUNCH_MODE_CLIENT but group \"daemonmode\" runs "
                        "LAUNCH_MODE_DAEMON"));

  // Once the group is gone, a new first joiner picks the mode again.
  v1::LeaveGroupRequest leave;
  leave.set_group("daemonmode");
  leave.set_rank(0);
  leave.set_session_id(s);
  ASSERT_TRUE(registry_.Leave(leave).ok());
  auto again = Join(s, 0, SpecOf("daemonmode", 2), v1::LAUNCH_MODE_CLIENT);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->launch_mode(), v1::LAUNCH_MODE_CLIENT);

  // ListGroups reports each group's mode.
  const v1::ListGroupsResponse groups = registry_.ListGroups(PeerCredentials{.uid = 1000});
  ASSERT_EQ(groups.groups_size(), 2);
  for (const v1::GroupInfo& g : groups.groups()) {
    EXPECT_EQ(g.launch_mode(), v1::LAUNCH_MODE_CLIENT) << g.spec().name();
  }
}

TEST_F(CudaRegistryLaunchModeTest, AnUnspecifiedFirstJoinerGetsTheDataPlanesDefault) {
  const std::string s = Session();
  state_->default_launch_mode = v1::LAUNCH_MODE_CLIENT;
  auto c0 = Join(s, 0, SpecOf("bydefault", 2));
  ASSERT_TRUE(c0.ok()) << c0.status();
  EXPECT_EQ(c0->launch_mode(), v1::LAUNCH_MODE_CLIENT);
  // The default applies to new groups only: a live group keeps its mode.
  state_->default_launch_mode = v1::LAUNCH_MODE_DAEMON;
  auto c1 = Join(s, 1, SpecOf("bydefault", 2));
  ASSERT_TRUE(c1.ok()) << c1.status();
  EXPECT_EQ(c1->launch_mode(), v1::LAUNCH_MODE_CLIENT);
  auto d0 = Join(s, 0, SpecOf("other", 2));
  ASSERT_TRUE(d0.ok()) << d0.status();
  EXPECT_EQ(d0->launch_mode(), v1::LAUNCH_MODE_DAEMON);
  const v1::ListGroupsResponse groups = registry_.ListGroups(PeerCredentials{.uid = 1000});
  ASSERT_EQ(groups.groups_size(), 2);
  for (const v1::GroupInfo& g : groups.groups()) {
    EXPECT_EQ(g.launch_mode(),
              g.spec().name() == "bydefault" ? v1::LAUNCH_MODE_CLIENT : v1::LAUNCH_MODE_DAEMON);
  }
}

// ---- the host data plane refuses stream-ordered requests --------------------------------

TEST(HostDataPlaneLaunchModeTest, StreamOrderedRequestIsInvalidArgumentNamingTheFlag) {
  HostDataPlaneOptions o;
  o.op_timeout_ms = 2000;
  o.host_threads = 1;
  auto plane = MakeHostDataPlane(o);
  ASSERT_TRUE(plane.ok()) << plane.status();
  const v1::GroupSpec spec = SpecOf("streams", 2);
  auto group = (*plane)->CreateGroup(spec);
  ASSERT_TRUE(group.ok()) << group.status();
  std::vector<std::unique_ptr<RawRing>> rings;
  for (int r = 0; r < 2; ++r) {
    v1::EndpointInfo info;
    ASSERT_TRUE((*group)->AttachRank(r, "", v1::LAUNCH_MODE_DAEMON, {}, &info).ok());
    rings.push_back(RawRing::Open(info, **group));
    ASSERT_NE(rings.back(), nullptr);
  }
  // Client-launched mode is refused by the host group itself too.
  v1::EndpointInfo info;
  absl::Status client = (*group)->AttachRank(1, "", v1::LAUNCH_MODE_CLIENT, {}, &info);
  EXPECT_EQ(client.code(), absl::StatusCode::kFailedPrecondition) << client;
  EXPECT_THAT(client.message(), HasSubstr("client-launched mode needs the CUDA backend"));

  // Rank 1 asks for a stream-ordered op: the op fails for both ranks, naming the flag.
  const uint64_t s0 = rings[0]->Submit(abi::OpKind::kGetDispatchLayout, 0, 0);
  const uint64_t s1 = rings[1]->Submit(abi::OpKind::kGetDispatchLayout, abi::kFlagStreamOrdered, 0);
  ASSERT_EQ(s0, s1);
  for (int r = 0; r < 2; ++r) {
    auto c = rings[r]->Await(s0, std::chrono::milliseconds(5000));
    ASSERT_TRUE(c.has_value()) << "rank " << r << " got no completion";
    EXPECT_EQ(c->status_code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(std::string(c->message), HasSubstr("kFlagStreamOrdered"));
    EXPECT_THAT(std::string(c->message), HasSubstr("rank 1"));
  }
  // Without the flag the next op runs.
  const uint64_t n0 = rings[0]->Submit(abi::OpKind::kGetDispatchLayout, 0, 0);
  rings[1]->Submit(abi::OpKind::kGetDispatchLayout, 0, 0);
  for (int r = 0; r < 2; ++r) {
    auto c = rings[r]->Await(n0, std::chrono::milliseconds(5000));
    ASSERT_TRUE(c.has_value());
    EXPECT_EQ(c->status_code, 0) << c->message;
  }
}

// ---- LockstepGroup: OpEndedWithoutLaunch on every path ------------------------------------

/// A backend that runs every op at once (OK), records the requests that ended without it
/// and can refuse one rank's requests.
class RecordingGroup : public LockstepGroup {
 public:
  RecordingGroup(const v1::GroupSpec& spec, uint32_t op_timeout_ms)
      : LockstepGroup(spec, Options(op_timeout_ms)) {}

  /// (rank, seq) of every OpEndedWithoutLaunch call so far.
  std::vector<std::pair<int32_t, uint64_t>> ended() {
    std::lock_guard<std::mutex> lock(mu_);
    return ended_;
  }
  int started() {
    std::lock_guard<std::mutex> lock(mu_);
    return started_;
  }
  void RefuseRank(int32_t rank) {
    std::lock_guard<std::mutex> lock(mu_);
    refused_rank_ = rank;
  }

 protected:
  static LockstepOptions Options(uint32_t op_timeout_ms) {
    LockstepOptions o;
    o.op_timeout_ms = op_timeout_ms;
    return o;
  }
  uint64_t ShmDataBytes(const RankResources&) const override { return 0; }
  absl::StatusOr<ScopedFd> DoorbellFd(int32_t) const override { return testing::TestDoorbellFd(); }
  absl::StatusOr<std::shared_ptr<RankResources>> PrepareRank(int32_t, const std::string&,
                                                             v1::LaunchMode,
                                                             v1::EndpointInfo* info) override {
    info->set_backend("recording");
    return std::shared_ptr<RankResources>();
  }
  bool StartOpInto(const OpPlan&, const std::vector<abi::RequestSlot>&,
                   std::span<RankOutcome>) override {
    ++started_;
    return true;
  }
  absl::Status AcceptsRequests(int32_t rank) const override {
    if (rank == refused_rank_) return absl::FailedPreconditionError("rank refused by the test");
    return absl::OkStatus();
  }
  void OpEndedWithoutLaunch(int32_t rank, const abi::RequestSlot& slot) override {
    ended_.emplace_back(rank, slot.seq);
  }

 private:
  std::vector<std::pair<int32_t, uint64_t>> ended_;
  int started_ = 0;
  int32_t refused_rank_ = -1;
};

class OpEndedWithoutLaunchTest : public ::testing::Test {
 protected:
  void Open(int ranks, uint32_t op_timeout_ms) {
    group_ = std::make_unique<RecordingGroup>(SpecOf("hook", ranks), op_timeout_ms);
    for (int r = 0; r < ranks; ++r) {
      v1::EndpointInfo info;
      ASSERT_TRUE(group_->AttachRank(r, "", v1::LAUNCH_MODE_DAEMON, {}, &info).ok());
      rings_.push_back(RawRing::Open(info, *group_));
      ASSERT_NE(rings_.back(), nullptr);
    }
  }
  std::optional<abi::Completion> Await(int r, uint64_t seq, int ms = 3000) {
    return rings_[r]->Await(seq, std::chrono::milliseconds(ms), [this] { group_->Poll(); });
  }

  std::unique_ptr<RecordingGroup> group_;
  std::vector<std::unique_ptr<RawRing>> rings_;
};

constexpr uint32_t kOrdered = abi::kFlagStreamOrdered;

TEST_F(OpEndedWithoutLaunchTest, NotCalledForAnOpTheBackendRan) {
  Open(2, 1000);
  const uint64_t seq = rings_[0]->Submit(abi::OpKind::kGetDispatchLayout, kOrdered, 1);
  rings_[1]->Submit(abi::OpKind::kGetDispatchLayout, kOrdered, 1);
  for (int r = 0; r < 2; ++r) {
    auto c = Await(r, seq);
    ASSERT_TRUE(c.has_value());
    EXPECT_EQ(c->status_code, 0) << c->message;
  }
  EXPECT_EQ(group_->started(), 1);
  EXPECT_TRUE(group_->ended().empty());
}

TEST_F(OpEndedWithoutLaunchTest, ClientErrorAndInvalidSlotEndEveryRanksRequest) {
  Open(2, 1000);
  // Rank 0 rejected its own inputs; rank 1's request is valid: both end unrun.
  const uint64_t a =
      rings_[0]->Submit(abi::OpKind::kGetDispatchLayout, kOrdered | abi::kFlagClientError, 1);
  rings_[1]->Submit(abi::OpKind::kGetDispatchLayout, kOrdered, 1);
  for (int r = 0; r < 2; ++r) {
    auto c = Await(r, a);
    ASSERT_TRUE(c.has_value());
    EXPECT_EQ(c->status_code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  }
  // A T beyond the spec's bound on rank 1.
  const uint64_t b = rings_[0]->Submit(abi::OpKind::kGetDispatchLayout, kOrdered, 1);
  rings_[1]->Submit(abi::OpKind::kGetDispatchLayout, kOrdered, 1 << 20);
  for (int r = 0; r < 2; ++r) {
    auto c = Await(r, b);
    ASSERT_TRUE(c.has_value());
    EXPECT_EQ(c->status_code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  }
  EXPECT_EQ(group_->started(), 0);
  EXPECT_THAT(group_->ended(),
              ElementsAre(std::pair<int32_t, uint64_t>{0, a}, std::pair<int32_t, uint64_t>{1, a},
                          std::pair<int32_t, uint64_t>{0, b}, std::pair<int32_t, uint64_t>{1, b}));
}

TEST_F(OpEndedWithoutLaunchTest, MissingRankTimeoutThenTheLateRequest) {
  Open(3, 200);
  const uint64_t seq = rings_[0]->Submit(abi::OpKind::kGetDispatchLayout, kOrdered, 1);
  rings_[2]->Submit(abi::OpKind::kGetDispatchLayout, kOrdered, 1);
  auto c0 = Await(0, seq);
  ASSERT_TRUE(c0.has_value());
  EXPECT_EQ(c0->status_code, static_cast<int32_t>(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(std::string(c0->message), HasSubstr("rank(s) 1"));
  EXPECT_THAT(group_->ended(), ElementsAre(std::pair<int32_t, uint64_t>{0, seq},
                                           std::pair<int32_t, uint64_t>{2, seq}));
  // Rank 1 comes late: its request for the failed op ends at once, unrun.
  rings_[1]->Submit(abi::OpKind::kGetDispatchLayout, kOrdered, 1);
  auto c1 = Await(1, seq);
  ASSERT_TRUE(c1.has_value());
  EXPECT_EQ(c1->status_code, static_cast<int32_t>(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(std::string(c1->message),
              HasSubstr(absl::StrCat("rank 1 arrived after op ", seq, " had failed")));
  EXPECT_EQ(group_->ended().size(), 3u);
  EXPECT_EQ(group_->ended().back(), (std::pair<int32_t, uint64_t>{1, seq}));
  EXPECT_EQ(group_->started(), 0);
}

TEST_F(OpEndedWithoutLaunchTest, RankLeavingAndShutdownEndPendingRequests) {
  Open(3, 5000);
  const uint64_t seq = rings_[0]->Submit(abi::OpKind::kGetDispatchLayout, kOrdered, 1);
  rings_[1]->Submit(abi::OpKind::kGetDispatchLayout, kOrdered, 1);
  group_->Poll();
  // Rank 2 leaves before arriving: the op fails for ranks 0 and 1.
  group_->DetachRank(2);
  for (int r = 0; r < 2; ++r) {
    auto c = Await(r, seq);
    ASSERT_TRUE(c.has_value());
    EXPECT_EQ(c->status_code, static_cast<int32_t>(absl::StatusCode::kDeadlineExceeded));
  }
  EXPECT_EQ(group_->ended().size(), 2u);
  // Shutdown: a popped request (rank 0) and one still in the ring (rank 1, not polled).
  const uint64_t next = rings_[0]->Submit(abi::OpKind::kGetDispatchLayout, kOrdered, 1);
  group_->Poll();
  rings_[1]->Submit(abi::OpKind::kGetDispatchLayout, kOrdered, 1);
  group_->FailAll(absl::UnavailableError("shutting down"));
  for (int r = 0; r < 2; ++r) {
    auto c = rings_[r]->Completion(next);
    ASSERT_TRUE(c.has_value()) << "rank " << r;
    EXPECT_EQ(c->status_code, static_cast<int32_t>(absl::StatusCode::kUnavailable));
  }
  const auto ended = group_->ended();
  ASSERT_EQ(ended.size(), 4u);
  EXPECT_EQ(ended[2], (std::pair<int32_t, uint64_t>{0, next}));
  EXPECT_EQ(ended[3], (std::pair<int32_t, uint64_t>{1, next}));
}

// A rank that left (or whose client died) while no op was in flight: the group's next op
// that waits for it fails at once, not after op_timeout; only once, so the op after that
// waits op_timeout for a rejoin again. A rejoined rank makes ops run again.
TEST_F(OpEndedWithoutLaunchTest, AnOpWaitingForADepartedRankFailsAtOnceAndOnlyOnce) {
  Open(2, 5000);
  group_->DetachRank(1);
  const auto start = std::chrono::steady_clock::now();
  const uint64_t seq = rings_[0]->Submit(abi::OpKind::kGetDispatchLayout, kOrdered, 1);
  auto c = Await(0, seq, 1000);
  ASSERT_TRUE(c.has_value()) << "the op waited for the departed rank";
  EXPECT_EQ(c->status_code, static_cast<int32_t>(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(std::string(c->message), HasSubstr("rank(s) 1 left the group"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(1000));
  const uint64_t next = rings_[0]->Submit(abi::OpKind::kGetDispatchLayout, kOrdered, 1);
  EXPECT_FALSE(Await(0, next, 300).has_value()) << "the second op must wait for a rejoin";
}

// Ranks that submit different ops fail the op for every rank, and the error names what
// each rank submitted.
TEST_F(OpEndedWithoutLaunchTest, RanksDisagreeingNameWhatEachSubmitted) {
  Open(2, 5000);
  const uint64_t seq = rings_[0]->Submit(abi::OpKind::kGetDispatchLayout, kOrdered, 1);
  rings_[1]->Submit(abi::OpKind::kDispatch, kOrdered, 1);
  for (int r = 0; r < 2; ++r) {
    auto c = Await(r, seq);
    ASSERT_TRUE(c.has_value()) << "rank " << r;
    EXPECT_EQ(c->status_code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(std::string(c->message),
                AllOf(HasSubstr("ranks disagree"), HasSubstr("rank 0 submitted GetDispatchLayout"),
                      HasSubstr("rank 1 submitted Dispatch"), HasSubstr("expert_alignment 1")))
        << c->message;
  }
}

TEST_F(OpEndedWithoutLaunchTest, RefusedRankHasEverySlotCompletedAtOnce) {
  Open(2, 5000);
  group_->RefuseRank(1);
  const uint64_t a = rings_[1]->Submit(abi::OpKind::kLowLatencyDispatch, kOrdered, 1);
  const uint64_t b = rings_[1]->Submit(abi::OpKind::kGetDispatchLayout, 0, 1);
  for (uint64_t seq : {a, b}) {
    auto c = rings_[1]->Await(seq, std::chrono::milliseconds(1000), [this] { group_->Poll(); });
    ASSERT_TRUE(c.has_value()) << "seq " << seq;
    EXPECT_EQ(c->status_code, static_cast<int32_t>(absl::StatusCode::kFailedPrecondition));
    EXPECT_THAT(std::string(c->message), HasSubstr("rank refused by the test"));
  }
  EXPECT_THAT(group_->ended(),
              ElementsAre(std::pair<int32_t, uint64_t>{1, a}, std::pair<int32_t, uint64_t>{1, b}));
  EXPECT_EQ(abi::Atomic(rings_[1]->header()->rejected_requests).load(), 2u);
  EXPECT_EQ(group_->started(), 0);
}

}  // namespace
}  // namespace epd
