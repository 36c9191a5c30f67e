// GrpcPeerMesh: two and three in-process meshes on 127.0.0.1 (rendezvous, descriptors,
// spec mismatch, loss within the liveness bound, re-registration, teardown, wrong secret).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <functional>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/peer/grpc_peer_mesh.h"
#include "epd/v1/peer.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace epd::peer {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kSecret[] = "0123456789abcdef-test-secret";
constexpr absl::Duration kInterval = absl::Milliseconds(50);

std::unique_ptr<GrpcPeerMesh> StartMesh(const std::string& listen = "127.0.0.1:0",
                                        const std::string& secret = kSecret,
                                        absl::Duration session_lifetime = absl::Hours(1)) {
  PeerMeshOptions options;
  options.listen = listen;
  options.secret = secret;
  options.heartbeat_interval = kInterval;
  options.session_lifetime = session_lifetime;
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
                    const std::string& descriptor, const std::string& join_secret_digest = "",
                    std::vector<std::string> per_node_descriptors = {}) {
  Registered r;
  GroupMembership m;
  m.spec = spec;
  m.self_node = node;
  m.transport_descriptor = descriptor;
  m.transport_descriptors = std::move(per_node_descriptors);
  m.join_secret_digest = join_secret_digest;
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

/// Two meshes with group "g" registered on both ("a" at node 0, `b_descriptor` at node 1)
/// and paired.
struct PairedMeshes {
  std::unique_ptr<GrpcPeerMesh> m0;
  std::unique_ptr<GrpcPeerMesh> m1;
  v1::GroupSpec spec;
  Registered a;
  Registered b;
};

void StartPaired(PairedMeshes* p, const std::string& b_descriptor = "b") {
  p->m0 = StartMesh();
  p->m1 = StartMesh();
  ASSERT_TRUE(p->m0 && p->m1);
  p->spec = Spec({p->m0.get(), p->m1.get()});
  p->a = Register(p->m0.get(), p->spec, 0, "a");
  p->b = Register(p->m1.get(), p->spec, 1, b_descriptor);
  ASSERT_TRUE(p->a.peers && p->b.peers);
  ASSERT_TRUE(WaitFor([&] { return HasDescriptor(*p->a.peers, 1, b_descriptor); }));
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

// Per-node descriptors: each node gets the one made for it, by request and by answer.
TEST(PeerMeshTest, EachNodeIsHandedTheDescriptorMadeForIt) {
  auto m0 = StartMesh();
  auto m1 = StartMesh();
  auto m2 = StartMesh();
  ASSERT_TRUE(m0 && m1 && m2);
  v1::GroupSpec spec = Spec({m0.get(), m1.get(), m2.get()}, 1);
  const auto per_node = [](int self) {
    std::vector<std::string> d;
    for (int to = 0; to < 3; ++to) d.push_back(absl::StrCat(self, "for", to));
    return d;
  };
  Registered r0 = Register(m0.get(), spec, 0, "zero", "", per_node(0));
  Registered r1 = Register(m1.get(), spec, 1, "one", "", per_node(1));
  Registered r2 = Register(m2.get(), spec, 2, "two", "", per_node(2));
  ASSERT_TRUE(WaitFor([&] {
    return HasDescriptor(*r0.peers, 1, "1for0") && HasDescriptor(*r0.peers, 2, "2for0") &&
           HasDescriptor(*r1.peers, 0, "0for1") && HasDescriptor(*r1.peers, 2, "2for1") &&
           HasDescriptor(*r2.peers, 0, "0for2") && HasDescriptor(*r2.peers, 1, "1for2");
  }));
  GroupMembership short_list;
  short_list.spec = spec;
  short_list.spec.set_name("h");
  short_list.self_node = 0;
  short_list.transport_descriptors = {"a", "b"};
  EXPECT_EQ(m0->RegisterGroup(short_list).status().code(), absl::StatusCode::kInvalidArgument);
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

// Each daemon registers the transport it resolved (spec.transport, or its default): nodes
// that would run different transports are refused at rendezvous, naming the field.
TEST(PeerMeshTest, TransportMismatchIsFailedPreconditionNamingTheField) {
  auto m0 = StartMesh();
  auto m1 = StartMesh();
  ASSERT_TRUE(m0 && m1);
  v1::GroupSpec spec = Spec({m0.get(), m1.get()});
  spec.set_transport("tcp");
  v1::GroupSpec other = spec;
  other.set_transport("rdma");
  Registered a = Register(m0.get(), spec, 0, "a");
  Registered b = Register(m1.get(), other, 1, "b");
  ASSERT_TRUE(WaitFor([&] { return !a.peers->Health().ok() && !b.peers->Health().ok(); }));
  EXPECT_EQ(a.peers->Health().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(a.peers->Health().message(), HasSubstr("transport"));
  EXPECT_THAT(a.peers->Health().message(), HasSubstr("\"rdma\""));
  EXPECT_THAT(b.peers->Health().message(), HasSubstr("transport"));
  EXPECT_FALSE(a.peers->Descriptor(1).has_value());
  EXPECT_EQ(m0->NodeStatuses("g")[1].state(), v1::NODE_STATE_MISMATCH);
}

TEST(PeerMeshTest, JoinSecretMismatchIsFailedPreconditionNamingTheFieldNotTheValue) {
  auto m0 = StartMesh();
  auto m1 = StartMesh();
  ASSERT_TRUE(m0 && m1);
  v1::GroupSpec spec = Spec({m0.get(), m1.get()});
  const std::string victim = m0->JoinSecretDigest("g", "victim-secret");
  // Node 1's ranks presented another secret, or none at all: neither pairs.
  for (const std::string& attacker :
       {m1->JoinSecretDigest("g", "attacker-secret"), m1->JoinSecretDigest("g", "")}) {
    Registered a = Register(m0.get(), spec, 0, "a", victim);
    Registered b = Register(m1.get(), spec, 1, "b", attacker);
    ASSERT_TRUE(WaitFor([&] { return !a.peers->Health().ok() && !b.peers->Health().ok(); }));
    EXPECT_EQ(a.peers->Health().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(a.peers->Health().message(), HasSubstr("join_secret"));
    EXPECT_THAT(b.peers->Health().message(), HasSubstr("join_secret"));
    for (const auto& p : {&a, &b}) {
      EXPECT_THAT(p->peers->Health().message(), Not(HasSubstr("victim-secret")));
      EXPECT_THAT(p->peers->Health().message(), Not(HasSubstr("attacker-secret")));
    }
    EXPECT_FALSE(a.peers->Descriptor(1).has_value());
    EXPECT_FALSE(b.peers->Descriptor(0).has_value());
    EXPECT_EQ(m0->NodeStatuses("g")[1].state(), v1::NODE_STATE_MISMATCH);
  }
}

// Transport settings the nodes must share (RDMA: queue pairs per peer, link layer) are
// compared at rendezvous by the membership's comparison: nodes that differ are a mismatch
// on both sides, naming both nodes and both values, and never get each other's descriptor.
TEST(PeerMeshTest, DescriptorSettingsMismatchIsRefusedAtRendezvousNamingBothNodes) {
  auto m0 = StartMesh();
  auto m1 = StartMesh();
  ASSERT_TRUE(m0 && m1);
  v1::GroupSpec spec = Spec({m0.get(), m1.get()});
  spec.set_transport("rdma");
  auto register_with = [&](GrpcPeerMesh* mesh, int node, const std::string& descriptor) {
    Registered r;
    GroupMembership m;
    m.spec = spec;
    m.self_node = node;
    m.transport_descriptor = descriptor;
    m.compare_descriptors = [](std::string_view ours, std::string_view theirs,
                               std::string_view our_node, std::string_view their_node) {
      if (ours == theirs) return absl::OkStatus();
      return absl::FailedPreconditionError(
          absl::StrCat(std::string(our_node), " uses ", std::string(ours), ", ",
                       std::string(their_node), " uses ", std::string(theirs)));
    };
    absl::StatusOr<std::unique_ptr<GroupPeers>> peers = mesh->RegisterGroup(std::move(m));
    EXPECT_TRUE(peers.ok()) << peers.status();
    if (peers.ok()) r.peers = *std::move(peers);
    return r;
  };
  Registered a = register_with(m0.get(), 0, "qps_per_peer=2");
  Registered b = register_with(m1.get(), 1, "qps_per_peer=4");
  ASSERT_TRUE(a.peers && b.peers);
  ASSERT_TRUE(WaitFor([&] { return !a.peers->Health().ok() && !b.peers->Health().ok(); }));
  // Whichever node saw the other's registration first, each names both by number.
  const std::string node0 = absl::StrCat("node 0 (", m0->advertised_address(), ")");
  const std::string node1 = absl::StrCat("node 1 (", m1->advertised_address(), ")");
  for (const Registered* r : {&a, &b}) {
    EXPECT_EQ(r->peers->Health().code(), absl::StatusCode::kFailedPrecondition);
    const std::string message(r->peers->Health().message());
    EXPECT_THAT(message, HasSubstr("group \"g\": spec.transport \"rdma\": "));
    EXPECT_TRUE(absl::StrContains(
                    message, node0 + " uses qps_per_peer=2, " + node1 + " uses qps_per_peer=4") ||
                absl::StrContains(
                    message, node1 + " uses qps_per_peer=4, " + node0 + " uses qps_per_peer=2"))
        << message;
  }
  EXPECT_FALSE(a.peers->Descriptor(1).has_value());
  EXPECT_FALSE(b.peers->Descriptor(0).has_value());
  EXPECT_EQ(m0->NodeStatuses("g")[1].state(), v1::NODE_STATE_MISMATCH);
}

TEST(PeerMeshTest, SameJoinSecretPairs) {
  auto m0 = StartMesh();
  auto m1 = StartMesh();
  ASSERT_TRUE(m0 && m1);
  v1::GroupSpec spec = Spec({m0.get(), m1.get()});
  // Both meshes know the same cluster secret, so each computes the same digest.
  const std::string d0 = m0->JoinSecretDigest("g", "s3cret");
  EXPECT_EQ(d0, m1->JoinSecretDigest("g", "s3cret"));
  EXPECT_EQ(d0.size(), 32u);
  EXPECT_NE(d0, m0->JoinSecretDigest("h", "s3cret"));  // Bound to the group's name.
  Registered a = Register(m0.get(), spec, 0, "a", d0);
  Registered b = Register(m1.get(), spec, 1, "b", m1->JoinSecretDigest("g", "s3cret"));
  ASSERT_TRUE(WaitFor([&] { return HasDescriptor(*a.peers, 1, "b"); }));
  ASSERT_TRUE(WaitFor([&] { return HasDescriptor(*b.peers, 0, "a"); }));
  EXPECT_TRUE(a.peers->Health().ok()) << a.peers->Health();
}

TEST(PeerMeshTest, WorkerThatCannotStartIsResourceExhaustedNamingThePeerAndLeavesNoEntry) {
  auto fail = std::make_shared<std::atomic<bool>>(true);
  PeerMeshOptions options;
  options.listen = "127.0.0.1:0";
  options.secret = std::string(kSecret);
  options.heartbeat_interval = kInterval;
  options.before_worker_start = [fail](const std::string&) {
    if (fail->load()) throw std::system_error(EAGAIN, std::generic_category(), "thread");
  };
  absl::StatusOr<std::unique_ptr<GrpcPeerMesh>> m0 = GrpcPeerMesh::Start(options);
  ASSERT_TRUE(m0.ok()) << m0.status();
  auto m1 = StartMesh();
  ASSERT_TRUE(m1);
  v1::GroupSpec spec = Spec({m0->get(), m1.get()});
  GroupMembership m;
  m.spec = spec;
  m.self_node = 0;
  m.transport_descriptor = "a";
  absl::StatusOr<std::unique_ptr<GroupPeers>> refused = (*m0)->RegisterGroup(m);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr(m1->advertised_address()));
  EXPECT_THAT(refused.status().message(), HasSubstr("ranks 2-3"));
  EXPECT_EQ((*m0)->num_peer_workers(), 0);
  EXPECT_TRUE((*m0)->NodeStatuses("g").empty());
  // Once threads can be made again, the same group registers and pairs.
  fail->store(false);
  Registered a = Register(m0->get(), spec, 0, "a");
  Registered b = Register(m1.get(), spec, 1, "b");
  ASSERT_TRUE(a.peers && b.peers);
  ASSERT_TRUE(WaitFor([&] { return HasDescriptor(*a.peers, 1, "b"); }));
  EXPECT_EQ((*m0)->num_peer_workers(), 1);
}

// The health probe: a live Peer listener answers; a listener whose accept loop is gone
// (here: a socket that listens but never accepts) is DEADLINE_EXCEEDED naming it, within
// the timeout; a port nobody listens on is UNAVAILABLE.
TEST(PeerMeshTest, ListenerProbeTellsALiveListenerFromAStuckOne) {
  auto mesh = StartMesh();
  ASSERT_TRUE(mesh);
  EXPECT_TRUE(mesh->ProbeListener(absl::Seconds(2)).ok()) << mesh->ProbeListener(absl::Seconds(2));
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 16), 0);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int port = ntohs(addr.sin_port);
  const absl::Time t0 = absl::Now();
  absl::Status stuck = ProbeGrpcListener("127.0.0.1", port, absl::Milliseconds(200));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
  EXPECT_EQ(stuck.code(), absl::StatusCode::kDeadlineExceeded) << stuck;
  EXPECT_THAT(stuck.message(), HasSubstr(absl::StrCat("127.0.0.1:", port)));
  ::close(fd);
  absl::Status refused = ProbeGrpcListener("127.0.0.1", port, absl::Milliseconds(200));
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
}

TEST(PeerMeshTest, LossDetectedWithinBoundAndReRegistrationHeals) {
  PairedMeshes p;
  ASSERT_NO_FATAL_FAILURE(StartPaired(&p, "b-first"));
  auto& m0 = p.m0;
  auto& m1 = p.m1;
  auto& spec = p.spec;
  auto& a = p.a;
  auto& b = p.b;
  const std::string address1 = m1->advertised_address();
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
  PairedMeshes p;
  ASSERT_NO_FATAL_FAILURE(StartPaired(&p));
  auto& m1 = p.m1;
  auto& spec = p.spec;
  auto& a = p.a;
  auto& b = p.b;
  const absl::Time left = absl::Now();
  b.peers.reset();
  ASSERT_TRUE(WaitFor([&] { return !a.peers->Health().ok(); }, absl::Seconds(2)));
  EXPECT_LT(absl::Now() - left, kLostAfterIntervals * kInterval);  // The notice, not liveness.
  EXPECT_EQ(a.peers->Health().code(), absl::StatusCode::kUnavailable);
  // Told either by the Leave notice or by a heartbeat that no longer lists the group,
  // whichever arrives first: both say the daemon tore the group down.
  EXPECT_THAT(a.peers->Health().message(), HasSubstr("tore the group down"));
  // Registered again on node 1: healthy with the new incarnation.
  Registered b2 = Register(m1.get(), spec, 1, "b2");
  ASSERT_TRUE(WaitFor([&] { return HasDescriptor(*a.peers, 1, "b2"); }));
  EXPECT_TRUE(a.peers->Health().ok());
}

// A peer daemon that no registered group names any more keeps no worker: addresses a spec
// named once are not dialled for ever, and a later group that names one starts anew.
TEST(PeerMeshTest, WorkersOfPeersNoGroupNamesEnd) {
  auto m0 = StartMesh();
  ASSERT_NE(m0, nullptr);
  auto spec_naming = [&](const std::string& name, const std::vector<std::string>& others) {
    v1::GroupSpec spec = Spec({m0.get()}, 1);
    spec.set_name(name);
    for (const std::string& address : others) {
      v1::NodeSpec* n = spec.add_nodes();
      n->set_peer_address(address);
      n->set_num_ranks(1);
    }
    spec.set_num_ranks(spec.nodes_size());
    spec.set_num_experts(2 * spec.num_ranks());
    return spec;
  };
  {
    Registered r = Register(m0.get(), spec_naming("g1", {"127.0.0.1:1", "127.0.0.1:2"}), 0, "d");
    EXPECT_EQ(m0->num_peer_workers(), 2);
  }
  EXPECT_TRUE(WaitFor([&] { return m0->num_peer_workers() == 0; }));
  Registered r2 = Register(m0.get(), spec_naming("g2", {"127.0.0.1:2"}), 0, "d");
  EXPECT_EQ(m0->num_peer_workers(), 1);
  EXPECT_FALSE(HasDescriptor(*r2.peers, 1, "x"));
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

/// A caller that speaks the Peer protocol by hand as daemon `daemon_id` (it knows the
/// secret): what a compromised or buggy peer daemon could send.
class HandCaller {
 public:
  HandCaller(const std::string& target, const std::string& daemon_id)
      : id_(daemon_id),
        stub_(v1::Peer::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()))) {
    grpc::ClientContext c1;
    v1::ChallengeRequest challenge;
    challenge.set_protocol_version(kPeerProtocolVersion);
    v1::ChallengeResponse nonce;
    EXPECT_TRUE(stub_->Challenge(&c1, challenge, &nonce).ok());
    v1::HelloRequest hello;
    hello.set_protocol_version(kPeerProtocolVersion);
    hello.set_daemon_id(id_);
    hello.set_server_nonce(nonce.server_nonce());
    hello.set_client_nonce(std::string(32, 'n'));
    hello.set_proof(HelloProof(kSecret, hello.server_nonce(), hello.client_nonce(), id_));
    grpc::ClientContext c2;
    v1::HelloResponse welcome;
    EXPECT_TRUE(stub_->Hello(&c2, hello, &welcome).ok());
    session_ = welcome.session_id();
    key_ = SessionKey(kSecret, hello.server_nonce(), hello.client_nonce(), id_);
  }
  grpc::Status Rendezvous(v1::RendezvousRequest request) {
    SignPeerRequest("Rendezvous", session_, key_, ++counter_, &request);
    grpc::ClientContext c;
    v1::RendezvousResponse r;
    return stub_->Rendezvous(&c, request, &r);
  }
  grpc::Status Heartbeat(v1::HeartbeatRequest request) {
    SignPeerRequest("Heartbeat", session_, key_, ++counter_, &request);
    grpc::ClientContext c;
    v1::HeartbeatResponse r;
    return stub_->Heartbeat(&c, request, &r);
  }
  std::string session_hex() const { return absl::BytesToHexString(session_); }
  grpc::Status Leave(v1::LeaveRequest request) {
    SignPeerRequest("Leave", session_, key_, ++counter_, &request);
    grpc::ClientContext c;
    v1::LeaveResponse r;
    return stub_->Leave(&c, request, &r);
  }

 private:
  std::string id_;
  std::unique_ptr<v1::Peer::Stub> stub_;
  std::string session_;
  std::string key_;
  uint64_t counter_ = 0;
};

TEST(PeerMeshTest, MalformedInputFromAnAuthenticatedPeerIsRefusedAndChangesNothing) {
  PairedMeshes p;
  ASSERT_NO_FATAL_FAILURE(StartPaired(&p));
  auto& m0 = p.m0;
  auto& m1 = p.m1;
  auto& spec = p.spec;
  auto& a = p.a;
  const uint64_t incarnation = a.peers->Descriptor(1)->incarnation;

  // Claims to be node 1's daemon (it knows the secret).
  HandCaller evil(m0->advertised_address(), m1->advertised_address());
  auto registration = [&] {
    v1::RendezvousRequest r;
    *r.mutable_registration()->mutable_spec() = spec;
    r.mutable_registration()->set_node(1);
    r.mutable_registration()->set_incarnation(77);
    r.mutable_registration()->set_transport_descriptor("evil");
    return r;
  };
  struct Case {
    std::function<void(v1::RendezvousRequest*)> mutate;
    grpc::StatusCode code;
  };
  for (const Case& c : std::vector<Case>{
           {[](v1::RendezvousRequest* r) { r->mutable_registration()->set_node(5); },
            grpc::StatusCode::INVALID_ARGUMENT},
           {[](v1::RendezvousRequest* r) { r->mutable_registration()->set_node(-1); },
            grpc::StatusCode::INVALID_ARGUMENT},
           {[](v1::RendezvousRequest* r) { r->mutable_registration()->set_node(0); },
            grpc::StatusCode::INVALID_ARGUMENT},  // Not the caller's address.
           {[](v1::RendezvousRequest* r) { r->mutable_registration()->set_incarnation(0); },
            grpc::StatusCode::INVALID_ARGUMENT},
           {[](v1::RendezvousRequest* r) {
              r->mutable_registration()->set_transport_descriptor(std::string(65537, 'x'));
            },
            grpc::StatusCode::INVALID_ARGUMENT},
           {[](v1::RendezvousRequest* r) {
              r->mutable_registration()->mutable_spec()->set_num_ranks(0);
            },
            grpc::StatusCode::INVALID_ARGUMENT},
           {[](v1::RendezvousRequest* r) {
              r->mutable_registration()->mutable_spec()->mutable_nodes(1)->set_num_ranks(5);
            },
            grpc::StatusCode::INVALID_ARGUMENT},
           {[](v1::RendezvousRequest* r) {
              r->mutable_registration()->mutable_spec()->clear_nodes();
            },
            grpc::StatusCode::INVALID_ARGUMENT},
           {[](v1::RendezvousRequest* r) {
              r->mutable_registration()->mutable_spec()->set_name("other");
            },
            grpc::StatusCode::NOT_FOUND},
       }) {
    v1::RendezvousRequest r = registration();
    c.mutate(&r);
    EXPECT_EQ(evil.Rendezvous(r).error_code(), c.code) << r.ShortDebugString().substr(0, 300);
  }
  v1::HeartbeatRequest flood;
  for (int i = 0; i < 65537; ++i) flood.mutable_held()->add_groups()->set_name("x");
  EXPECT_EQ(evil.Heartbeat(flood).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::HeartbeatRequest odd;  // Joined bits of the wrong size: ignored.
  v1::HeldGroup* h = odd.mutable_held()->add_groups();
  h->set_name("g");
  h->set_incarnation(incarnation);
  h->set_joined_ranks(std::string(1000, '\1'));
  odd.mutable_held()->set_daemon_instance(1);
  EXPECT_TRUE(evil.Heartbeat(odd).ok());
  v1::LeaveRequest stale;  // An older registration's Leave: ignored.
  stale.set_group("g");
  stale.set_incarnation(incarnation + 1);
  EXPECT_TRUE(evil.Leave(stale).ok());

  EXPECT_TRUE(a.peers->Health().ok()) << a.peers->Health();
  ASSERT_TRUE(a.peers->Descriptor(1).has_value());
  EXPECT_EQ(a.peers->Descriptor(1)->incarnation, incarnation);
  EXPECT_EQ(a.peers->Descriptor(1)->transport, "b");
}

TEST(PeerMeshTest, SessionsExpireAtTheServerAndClientsRenewThemFirst) {
  constexpr absl::Duration kLifetime = absl::Milliseconds(400);
  auto m0 = StartMesh("127.0.0.1:0", kSecret, kLifetime);
  auto m1 = StartMesh("127.0.0.1:0", kSecret, kLifetime);
  ASSERT_TRUE(m0 && m1);
  v1::GroupSpec spec = Spec({m0.get(), m1.get()});
  Registered a = Register(m0.get(), spec, 0, "a");
  Registered b = Register(m1.get(), spec, 1, "b");
  ASSERT_TRUE(WaitFor([&] { return HasDescriptor(*a.peers, 1, "b"); }));
  ASSERT_TRUE(WaitFor([&] { return HasDescriptor(*b.peers, 0, "a"); }));

  // A session older than its lifetime is refused, naming it, however well its calls are
  // signed.
  HandCaller caller(m0->advertised_address(), "127.0.0.1:1");
  ASSERT_TRUE(caller.Heartbeat(v1::HeartbeatRequest()).ok());
  absl::SleepFor(kLifetime + absl::Milliseconds(100));
  grpc::Status expired = caller.Heartbeat(v1::HeartbeatRequest());
  EXPECT_EQ(expired.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(expired.error_message(), HasSubstr("expired"));
  EXPECT_THAT(expired.error_message(), HasSubstr(caller.session_hex()));

  // The meshes' own sessions are renewed before they expire: the pair stays healthy over
  // several lifetimes.
  const absl::Time until = absl::Now() + 4 * kLifetime;
  while (absl::Now() < until) {
    ASSERT_TRUE(a.peers->Health().ok()) << a.peers->Health();
    ASSERT_TRUE(b.peers->Health().ok()) << b.peers->Health();
    absl::SleepFor(absl::Milliseconds(20));
  }
}

TEST(PeerMeshTest, CertificateNamesMustNameTheDaemonIdHost) {
  EXPECT_TRUE(CheckPeerCertificateNames("127.0.0.1:7000", {"localhost", "127.0.0.1"}, {}).ok());
  EXPECT_TRUE(CheckPeerCertificateNames("[::1]:7000", {"0:0:0:0:0:0:0:1"}, {}).ok());
  EXPECT_TRUE(CheckPeerCertificateNames("Node3.Example:1", {"node3.example"}, {}).ok());
  EXPECT_TRUE(CheckPeerCertificateNames("node3.example:1", {"*.example"}, {}).ok());
  EXPECT_FALSE(CheckPeerCertificateNames("a.node3.example:1", {"*.example"}, {}).ok());
  EXPECT_FALSE(CheckPeerCertificateNames("example:1", {"*.example"}, {}).ok());
  // The common name counts only when there are no subject alternative names.
  EXPECT_TRUE(CheckPeerCertificateNames("node3:1", {}, {"node3"}).ok());
  EXPECT_FALSE(CheckPeerCertificateNames("node3:1", {"node4"}, {"node3"}).ok());
  absl::Status s = CheckPeerCertificateNames("127.0.0.2:7000", {"127.0.0.1", "localhost"}, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("127.0.0.2:7000"));
  EXPECT_THAT(s.message(), HasSubstr("127.0.0.1, localhost"));
  EXPECT_EQ(CheckPeerCertificateNames("h:1", {}, {}).code(), absl::StatusCode::kPermissionDenied);
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
