// GroupRegistry and groups that span nodes: a join needs the Peer listener and a rank of
// this daemon's node; ListGroups carries the mesh's per-node state.
#include <memory>
#include <string>
#include <vector>

#include "daemon/control/group_registry.h"
#include "daemon/peer/peer_mesh.h"
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

/// A mesh that only answers its address and a fixed node list.
class FakeMesh final : public peer::PeerMesh {
 public:
  absl::StatusOr<std::unique_ptr<peer::GroupPeers>> RegisterGroup(peer::GroupMembership) override {
    return absl::UnimplementedError("fake");
  }
  std::string advertised_address() const override { return "10.0.0.2:7100"; }
  std::vector<v1::GroupNodeInfo> NodeStatuses(const std::string& group) const override {
    v1::GroupNodeInfo n;
    n.set_node(1);
    n.set_peer_address(group == "span" ? "10.0.0.2:7100" : "?");
    n.set_state(v1::NODE_STATE_SELF);
    return {n};
  }
};

v1::GroupSpec SpanningSpec() {
  v1::GroupSpec spec = testing::MakeSpec("span", {.num_ranks = 4, .num_experts = 8});
  for (const char* address : {"10.0.0.1:7100", "10.0.0.2:7100"}) {
    v1::NodeSpec* n = spec.add_nodes();
    n->set_peer_address(address);
    n->set_num_ranks(2);
  }
  return spec;
}

class RegistryNodesTest : public ::testing::Test {
 protected:
  absl::StatusOr<v1::EndpointInfo> Join(GroupRegistry& registry, int32_t rank,
                                        const std::string& join_secret = "") {
    absl::StatusOr<std::string> session =
        registry.OpenSession(PeerCredentials{.pid = 7, .uid = 1000, .gid = 1000}, "test");
    EXPECT_TRUE(session.ok());
    v1::JoinGroupRequest request;
    *request.mutable_spec() = SpanningSpec();
    request.set_rank(rank);
    request.set_session_id(session.value_or(""));
    request.set_join_secret(join_secret);
    return registry.Join(request);
  }

  std::shared_ptr<FakeDataPlaneState> state_ = std::make_shared<FakeDataPlaneState>();
  FakeDataPlane plane_{state_};
  FakeMesh mesh_;
};

TEST_F(RegistryNodesTest, SpanningGroupNeedsThePeerListener) {
  GroupRegistry registry(&plane_, OneGpu(), GroupRegistry::Options{});
  absl::Status s = Join(registry, 2).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("peer_listen"), HasSubstr("spans 2 nodes")));
}

TEST_F(RegistryNodesTest, RankMustLiveOnThisNode) {
  GroupRegistry registry(&plane_, OneGpu(), GroupRegistry::Options{.peer_mesh = &mesh_});
  absl::Status s = Join(registry, 1).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("rank 1"), HasSubstr("node 0 (10.0.0.1:7100"),
                                 HasSubstr("this daemon (10.0.0.2:7100)")));
  EXPECT_EQ(Join(registry, 9).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<v1::EndpointInfo> ok = Join(registry, 2);
  ASSERT_TRUE(ok.ok()) << ok.status();
  v1::ListGroupsResponse groups = registry.ListGroups(PeerCredentials{.pid = 1, .uid = 0});
  ASSERT_EQ(groups.groups_size(), 1);
  ASSERT_EQ(groups.groups(0).nodes_size(), 1);
  EXPECT_EQ(groups.groups(0).nodes(0).peer_address(), "10.0.0.2:7100");
  registry.ReleaseAll();
}

// The group's join secret reaches the data plane at creation (which keeps only its digest
// for the Peer rendezvous: MultinodeHostTest.JoinSecretReachesTheMeshAsItsDigest).
TEST_F(RegistryNodesTest, JoinSecretGoesToTheDataPlaneAtCreation) {
  GroupRegistry registry(&plane_, OneGpu(), GroupRegistry::Options{.peer_mesh = &mesh_});
  absl::StatusOr<v1::EndpointInfo> ok = Join(registry, 2, "s3cret");
  ASSERT_TRUE(ok.ok()) << ok.status();
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    EXPECT_EQ(state_->last_join_secret, "s3cret");
  }
  registry.ReleaseAll();
}

}  // namespace
}  // namespace epd
