// GrpcPeerMesh: two and three in-process meshes on 127.0.0.1 (rendezvous, descriptors,
// spec mismatch, loss within the liveness bound, re-registration, teardown, wrong secret).
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/peer/grpc_peer_mesh.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace epd::peer {
namespace {

using ::testing::HasSubstr;

constexpr char kSecret[] = "0123456789abcdef-test-secret";
constexpr absl::Duration kInterval = absl::Milliseconds(50);

std::unique_ptr<GrpcPeerMesh> StartMesh(const std::string& listen = "127.0.0.1:0",
                                        const std::string& secret = kSecret) {
  PeerMeshOptions options;
  options.listen = listen;
  options.secret = secret;
  options.heartbeat_interval = kInterval;
  absl::StatusOr<std::unique_ptr<GrpcPeerMesh>> mesh = GrpcPeerMesh::Start(options);
  EXPECT_TRUE(mesh.ok()) << mesh.status();
  return mesh.ok() ? *std::move(mesh) : nullptr;
}

v1::GroupSpec Spec(const std::vector<GrpcPeerMesh*>& meshes, int ranks_per_node = 2) {
  v1::GroupSpec spec;
  spec.set_name("g");
  spec.set_num_ranks(ranks_per_node * static_cast<int>(meshes.size()));
  spec.set_num_experts(spec.num_ranks() * 2);
  spec.set_hidden(128);
  spec.set_num_topk(2);
  spec.set_max_tokens_per_rank(8);
  for (GrpcPeerMesh* m : meshes) {
    v1::NodeSpec* n = spec.add_nodes();
    n->set_peer_address(m->advertised_address());
    n->set_num_ranks(ranks_per_node);
  }
  return spec;
}

struct Registered {
  std::unique_ptr<GroupPeers> peers;
  std::shared_ptr<std::atomic<int>> wakes = std::make_shared<std::atomic<int>>(0);
};

Registered Register(GrpcPeerMesh* mesh, const v1::GroupSpec& spec, int node,
                    const std::string& descriptor) {
  Registered r;
  GroupMembership m;
  m.spec = spec;
  m.self_node = node;
  m.transport_descriptor = descriptor;
  m.wake = [w = r.wakes] { ++*w; };
  absl::StatusOr<std::unique_ptr<GroupPeers>> peers = mesh->RegisterGroup(std::move(m));
  EXPECT_TRUE(peers.ok()) << peers.status();
  if (peers.ok()) r.peers = *std::move(peers);
  return r;
}

/// Polls `done` until true or `limit` passes; returns whether it became true.
bool WaitFor(const std::function<bool()>& done, absl::Duration limit = absl::Seconds(5)) {
  const absl::Time until = absl::Now() + limit;
  while (absl::Now() < until) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return done();
}

bool HasDescriptor(const GroupPeers& p, int node, const std::string& transport) {
  std::optional<PeerDescriptor> d = p.Descriptor(node);
  return d.has_value() && d->transport == transport;
}

TEST(PeerMeshTest, TwoMeshesRendezvousAndExchangeDescriptors) {
  auto m0 = StartMesh();
  auto m1 = StartMesh();
  ASSERT_TRUE(m0 && m1);
  EXPECT_EQ(m0->advertised_address(), absl::StrCat("127.0.0.1:", m0->bound_port()));
  v1::GroupSpec spec = Spec({m0.get(), m1.get()});
  Registered a = Register(m0.get(), spec, 0, "desc-of-0");
  ASSERT_TRUE(a.peers);
  // Before node 1 registers: missing, named with its address and ranks; Health OK.
  EXPECT_FALSE(a.peers->Descriptor(1).has_value());
  EXPECT_TRUE(a.peers->Health().ok());
  EXPECT_THAT(a.peers->DescribeMissing(),
              HasSubstr(absl::StrCat("node 1 (", m1->advertised_address(), ", ranks 2-3)")));
  absl::SleepFor(3 * kInterval);
  Registered b = Register(m1.get(), spec, 1, "desc-of-1");
  ASSERT_TRUE(b.peers);
  ASSERT_TRUE(WaitFor([&] {
    return HasDescriptor(*a.peers, 1, "desc-of-1") && HasDescriptor(*b.peers, 0, "desc-of-0");
  }));
  EXPECT_GT(*a.wakes, 0);
  EXPECT_GT(*b.wakes, 0);
  EXPECT_TRUE(a.peers->Health().ok());
  EXPECT_TRUE(b.peers->Health().ok());
  // Registered, with no rank joined there yet: named.
  EXPECT_EQ(a.peers->DescribeMissing(),
            absl::StrCat("node 1 (", m1->advertised_address(), "): ranks 2, 3 not joined"));
  EXPECT_NE(a.peers->Descriptor(1)->incarnation, 0u);
  EXPECT_FALSE(a.peers->Descriptor(0).has_value());   // Itself.
  EXPECT_FALSE(a.peers->Descriptor(7).has_value());   // Out of range.
  EXPECT_FALSE(a.peers->Descriptor(-1).has_value());  // Out of range.

  // Ranks joined on node 1 travel with the heartbeats; node 0 names the missing one.
  b.peers->SetLocalRanksJoined({true, false});
  ASSERT_TRUE(WaitFor(
      [&] { return a.peers->DescribeMissing().find("rank 3 not joined") != std::string::npos; }));
  EXPECT_THAT(a.peers->DescribeMissing(), HasSubstr("rank 3 not joined"));
  std::vector<v1::GroupNodeInfo> nodes = m0->NodeStatuses("g");
  ASSERT_EQ(nodes.size(), 2u);
  EXPECT_EQ(nodes[0].state(), v1::NODE_STATE_SELF);
  EXPECT_EQ(nodes[1].state(), v1::NODE_STATE_REGISTERED);
  EXPECT_EQ(nodes[1].first_rank(), 2);
  EXPECT_EQ(nodes[1].joined_ranks(), 1);
  b.peers->SetLocalRanksJoined({true, true});
  EXPECT_TRUE(WaitFor([&] { return a.peers->DescribeMissing() == ""; }));
  EXPECT_TRUE(m0->NodeStatuses("nope").empty());
}

TEST(PeerMeshTest, ThreeMeshesAllRegistered) {
  auto m0 = StartMesh();
  auto m1 = StartMesh();
  auto m2 = StartMesh();
  ASSERT_TRUE(m0 && m1 && m2);
  v1::GroupSpec spec = Spec({m0.get(), m1.get(), m2.get()}, 1);
  Registered r2 = Register(m2.get(), spec, 2, "two");
  Registered r0 = Register(m0.get(), spec, 0, "zero");
  Registered r1 = Register(m1.get(), spec, 1, "one");
  ASSERT_TRUE(WaitFor([&] {
    return HasDescriptor(*r0.peers, 1, "one") && HasDescriptor(*r0.peers, 2, "two") &&
           HasDescriptor(*r1.peers, 0, "zero") && HasDescriptor(*r1.peers, 2, "two") &&
           HasDescriptor(*r2.peers, 0, "zero") && HasDescriptor(*r2.peers, 1, "one");
  }));
  for (GrpcPeerMesh* m : {m0.get(), m1.get(), m2.get()}) {
    for (const v1::GroupNodeInfo& n : m->NodeStatuses("g")) {
      EXPECT_TRUE(n.state() == v1::NODE_STATE_SELF || n.state() == v1::NODE_STATE_REGISTERED)
          << n.ShortDebugString();
    }
  }
}

TEST(PeerMeshTest, RegisterGroupRefusesBadMemberships) {
  auto m0 = StartMesh();
  auto m1 = StartMesh();
  ASSERT_TRUE(m0 && m1);
  v1::GroupSpec spec = Spec({m0.get(), m1.get()});
  GroupMembership wrong_node;
  wrong_node.spec = spec;
  wrong_node.self_node = 1;  // m1's address, not m0's.
  EXPECT_EQ(m0->RegisterGroup(wrong_node).status().code(), absl::StatusCode::kInvalidArgument);
  GroupMembership out_of_range;
  out_of_range.spec = spec;
  out_of_range.self_node = 2;
  EXPECT_EQ(m0->RegisterGroup(out_of_range).status().code(), absl::StatusCode::kInvalidArgument);
  Registered a = Register(m0.get(), spec, 0, "x");
  GroupMembership again;
  again.spec = spec;
  again.self_node = 0;
  EXPECT_EQ(m0->RegisterGroup(again).status().code(), absl::StatusCode::kAlreadyExists);
  GroupMembership one_node;
  one_node.spec = spec;
  one_node.spec.set_name("h");
  one_node.spec.clear_nodes();
  EXPECT_EQ(m0->RegisterGroup(one_node).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PeerMeshTest, SpecMismatchIsFailedPreconditionNamingTheField) {
  auto m0 = StartMesh();
  auto m1 = StartMesh();
  ASSERT_TRUE(m0 && m1);
  v1::GroupSpec spec = Spec({m0.get(), m1.get()});
  v1::GroupSpec other = spec;
  other.set_hidden(256);
  Registered a = Register(m0.get(), spec, 0, "a");
  Registered b = Register(m1.get(), other, 1, "b");
  ASSERT_TRUE(WaitFor([&] { return !a.peers->Health().ok() && !b.peers->Health().ok(); }));
  EXPECT_EQ(a.peers->Health().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(a.peers->Health().message(), HasSubstr("hidden"));
  EXPECT_THAT(b.peers->Health().message(), HasSubstr("hidden"));
  EXPECT_FALSE(a.peers->Descriptor(1).has_value());
  EXPECT_EQ(m0->NodeStatuses("g")[1].state(), v1::NODE_STATE_MISMATCH);
}

TEST(PeerMeshTest, LossDetectedWithinBoundAndReRegistrationHeals) {
  auto m0 = StartMesh();
  auto m1 = StartMesh();
  ASSERT_TRUE(m0 && m1);
  const std::string address1 = m1->advertised_address();
  v1::GroupSpec spec = Spec({m0.get(), m1.get()});
  Registered a = Register(m0.get(), spec, 0, "a");
  Registered b = Register(m1.get(), spec, 1, "b-first");
  ASSERT_TRUE(WaitFor([&] { return HasDescriptor(*a.peers, 1, "b-first"); }));
  const uint64_t first_incarnation = a.peers->Descriptor(1)->incarnation;

  // The daemon of node 1 stops (no teardown notice): lost after 3 silent intervals.
  const absl::Time stopped = absl::Now();
  m1->Shutdown();
  ASSERT_TRUE(WaitFor([&] { return !a.peers->Health().ok(); }, absl::Seconds(3)));
  const absl::Duration took = absl::Now() - stopped;
  EXPECT_LT(took, kLostAfterIntervals * kInterval + absl::Milliseconds(700)) << took;
  absl::Status health = a.peers->Health();
  EXPECT_EQ(health.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(health.message(), HasSubstr(absl::StrCat("node 1 (", address1, ", ranks 2-3)")));
  EXPECT_FALSE(a.peers->Descriptor(1).has_value());
  EXPECT_EQ(m0->NodeStatuses("g")[1].state(), v1::NODE_STATE_LOST);
  // GroupPeers outlive their mesh: UNAVAILABLE.
  EXPECT_EQ(b.peers->Health().code(), absl::StatusCode::kUnavailable);
  b.peers.reset();
  m1.reset();

  // A new daemon on the same address registers the group: a new incarnation, healthy.
  auto m1b = StartMesh(address1);
  ASSERT_TRUE(m1b);
  Registered b2 = Register(m1b.get(), spec, 1, "b-second");
  ASSERT_TRUE(WaitFor([&] { return HasDescriptor(*a.peers, 1, "b-second"); }));
  EXPECT_NE(a.peers->Descriptor(1)->incarnation, first_incarnation);
  EXPECT_TRUE(a.peers->Health().ok()) << a.peers->Health();
  EXPECT_TRUE(WaitFor([&] { return HasDescriptor(*b2.peers, 0, "a"); }));
}

TEST(PeerMeshTest, TeardownIsToldToThePeers) {
  auto m0 = StartMesh();
  auto m1 = StartMesh();
  ASSERT_TRUE(m0 && m1);
  v1::GroupSpec spec = Spec({m0.get(), m1.get()});
  Registered a = Register(m0.get(), spec, 0, "a");
  Registered b = Register(m1.get(), spec, 1, "b");
  ASSERT_TRUE(WaitFor([&] { return HasDescriptor(*a.peers, 1, "b"); }));
  const absl::Time left = absl::Now();
  b.peers.reset();
  ASSERT_TRUE(WaitFor([&] { return !a.peers->Health().ok(); }, absl::Seconds(2)));
  EXPECT_LT(absl::Now() - left, kLostAfterIntervals * kInterval);  // The notice, not liveness.
  EXPECT_EQ(a.peers->Health().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(a.peers->Health().message(), HasSubstr("left the group"));
  // Registered again on node 1: healthy with the new incarnation.
  Registered b2 = Register(m1.get(), spec, 1, "b2");
  ASSERT_TRUE(WaitFor([&] { return HasDescriptor(*a.peers, 1, "b2"); }));
  EXPECT_TRUE(a.peers->Health().ok());
}

TEST(PeerMeshTest, WrongSecretNeverRegistersAndSaysWhy) {
  auto m0 = StartMesh();
  auto m1 = StartMesh("127.0.0.1:0", "another-secret-of-16-bytes");
  ASSERT_TRUE(m0 && m1);
  v1::GroupSpec spec = Spec({m0.get(), m1.get()});
  Registered a = Register(m0.get(), spec, 0, "a");
  Registered b = Register(m1.get(), spec, 1, "b");
  ASSERT_TRUE(
      WaitFor([&] { return a.peers->DescribeMissing().find("secret") != std::string::npos; }));
  EXPECT_FALSE(a.peers->Descriptor(1).has_value());
  EXPECT_FALSE(b.peers->Descriptor(0).has_value());
  EXPECT_THAT(a.peers->DescribeMissing(), HasSubstr("node 1"));
}

TEST(PeerMeshTest, StartRefusesBadOptions) {
  PeerMeshOptions o;
  o.listen = "127.0.0.1:0";
  o.secret = "short";
  EXPECT_EQ(GrpcPeerMesh::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.secret = kSecret;
  o.tls_cert_pem = "x";
  EXPECT_EQ(GrpcPeerMesh::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.tls_cert_pem.clear();
  o.listen = "0.0.0.0:0";
  EXPECT_THAT(GrpcPeerMesh::Start(o).status().message(), HasSubstr("peer_advertise"));
  auto m0 = StartMesh();
  ASSERT_TRUE(m0);
  o.listen = m0->advertised_address();  // Taken.
  EXPECT_EQ(GrpcPeerMesh::Start(o).status().code(), absl::StatusCode::kUnavailable);
}

TEST(PeerMeshTest, RankRangeText) {
  EXPECT_EQ(RankRangeText(4, 4), "ranks 4-7");
  EXPECT_EQ(RankRangeText(3, 1), "rank 3");
}

}  // namespace
}  // namespace epd::peer
