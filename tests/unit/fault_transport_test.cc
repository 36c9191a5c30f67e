// The fault-injecting transport (daemon/transport/fault/) over the TCP transport, each node
// with its own wrapper: the spec parser, and every fault (drop, delay, reset after N writes
// and through the API, partition) as the engine and the peer see it.
#include "daemon/transport/fault/fault_transport.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "daemon/transport/tcp/tcp_transport.h"
#include "tests/unit/transport_nodes.h"

namespace epd::transport {
namespace {

using std::chrono::milliseconds;
using testing::ConnectAll;
using testing::MakeNodes;
using testing::PollImmWaiting;
using testing::TestNode;
using testing::WaitFor;

std::unique_ptr<FaultTransport> MakeFaultTcp(const std::string& spec = "") {
  auto tcp = MakeTcpTransport({});
  EXPECT_TRUE(tcp.ok()) << tcp.status();
  auto plan = ParseFaultPlan(spec);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return MakeFaultTransport(std::move(*tcp), *plan);
}

/// Two (or more) nodes, node i on transports[i].
struct Cluster {
  std::vector<std::unique_ptr<FaultTransport>> transports;
  std::vector<TestNode> nodes;
  explicit Cluster(const std::vector<std::string>& specs, uint64_t recv_bytes = 1024) {
    std::vector<Transport*> raw;
    for (const std::string& s : specs) {
      transports.push_back(MakeFaultTcp(s));
      raw.push_back(transports.back().get());
    }
    nodes = MakeNodes(raw, static_cast<int>(specs.size()), recv_bytes);
    ConnectAll(nodes);
  }
};

/// Posts a write of one byte `value` at `offset` from node `from` to `to`.
absl::Status PostByte(TestNode& from, int32_t to, const uint8_t* value, uint64_t offset,
                      uint32_t imm) {
  const WritePiece p{value, 1, offset};
  return from.link->PostWrite(to, std::span(&p, 1), imm);
}

TEST(FaultPlan, ParsesSpecs) {
  auto plan =
      ParseFaultPlan("delay_ms=5;drop_after_writes=3:node=1;reset_after_writes=10;partition=0|1");
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->all.delay_ms, 5);
  EXPECT_EQ(plan->all.reset_after_writes, 10);
  EXPECT_FALSE(plan->all.drop_after_writes.has_value());
  EXPECT_EQ(plan->For(1).drop_after_writes, 3);
  EXPECT_EQ(plan->For(1).delay_ms, 5);
  EXPECT_FALSE(plan->For(2).drop_after_writes.has_value());
  EXPECT_TRUE(plan->Partitioned(0, 1));
  EXPECT_FALSE(plan->Partitioned(0, 2));
  auto again = ParseFaultPlan(plan->ToString());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->ToString(), plan->ToString());
  auto sides = ParseFaultPlan(" partition=0,1|2,3 ; partition_fail_ms=50 ");
  ASSERT_TRUE(sides.ok()) << sides.status();
  EXPECT_FALSE(sides->Partitioned(0, 1));
  EXPECT_TRUE(sides->Partitioned(1, 2));
  EXPECT_EQ(sides->partition_fail_after, milliseconds(50));
  EXPECT_TRUE(ParseFaultPlan("").ok());
  for (const char* bad : {"delay_ms", "delay_ms=-1", "delay_ms=x", "foo=1", "partition=0",
                          "partition=0|x", "drop_after_writes=1:nod=1", "delay_ms=1:node=-2",
                          "partition_fail_ms=0", "partition=0|1:node=1"}) {
    const auto r = ParseFaultPlan(bad);
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << bad;
    if (!r.ok()) {
      EXPECT_NE(r.status().message().find(bad), absl::string_view::npos) << r.status();
    }
  }
}

TEST(FaultTransport, DropsWritesSilently) {
  Cluster c({"drop_after_writes=2:node=1", ""});
  EXPECT_EQ(c.transports[0]->name(), "fault(tcp)");
  const uint8_t v[5] = {1, 2, 3, 4, 5};
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(PostByte(c.nodes[0], 1, &v[i], i, i).ok());
  uint32_t imm = 0;
  for (uint32_t i = 0; i < 2; ++i) {
    ASSERT_TRUE(PollImmWaiting(*c.nodes[1].link, 0, &imm));
    EXPECT_EQ(imm, i);
  }
  EXPECT_TRUE(WaitFor([&] { return c.nodes[0].link->WritesCompleted(1) == 5; }));
  EXPECT_FALSE(PollImmWaiting(*c.nodes[1].link, 0, &imm, milliseconds(200)));
  EXPECT_EQ(c.nodes[1].recv[1], 2);
  EXPECT_EQ(c.nodes[1].recv[2], 0);  // Dropped.
  EXPECT_EQ(c.nodes[0].link->State(1), PeerState::kReady);
  // The other direction is untouched.
  ASSERT_TRUE(PostByte(c.nodes[1], 0, &v[4], 0, 42).ok());
  ASSERT_TRUE(PollImmWaiting(*c.nodes[0].link, 1, &imm));
  EXPECT_EQ(imm, 42u);
}

TEST(FaultTransport, DelaysWritesInOrder) {
  Cluster c({"delay_ms=150", ""});
  const uint8_t v[3] = {7, 8, 9};
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(PostByte(c.nodes[0], 1, &v[i], i, 10 + i).ok());
  uint32_t imm = 0;
  ASSERT_TRUE(PollImmWaiting(*c.nodes[1].link, 0, &imm));
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(150));
  EXPECT_EQ(imm, 10u);
  for (uint32_t i = 1; i < 3; ++i) {
    ASSERT_TRUE(PollImmWaiting(*c.nodes[1].link, 0, &imm));
    EXPECT_EQ(imm, 10 + i);
  }
  EXPECT_EQ(c.nodes[1].recv[2], 9);
  EXPECT_TRUE(WaitFor([&] { return c.nodes[0].link->WritesCompleted(1) == 3; }));
}

TEST(FaultTransport, ResetsAfterWrites) {
  Cluster c({"reset_after_writes=3", ""});
  const uint8_t v = 1;
  for (uint32_t i = 0; i < 3; ++i) ASSERT_TRUE(PostByte(c.nodes[0], 1, &v, i, i).ok());
  uint32_t imm = 0;
  for (uint32_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(PollImmWaiting(*c.nodes[1].link, 0, &imm));
    EXPECT_EQ(imm, i);
  }
  const absl::Status s = PostByte(c.nodes[0], 1, &v, 3, 3);
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_NE(s.message().find("node 1"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("reset after 3 writes"), absl::string_view::npos) << s;
  EXPECT_EQ(c.nodes[0].link->State(1), PeerState::kFailed);
  EXPECT_EQ(c.nodes[0].link->WritesCompleted(1), 3u);
  // The peer sees it: the wrapped link's connections were closed.
  EXPECT_TRUE(
      WaitFor([&] { return c.nodes[1].link->State(0) == PeerState::kFailed; }, milliseconds(2000)));
  EXPECT_NE(c.nodes[1].link->PeerStatus(0).message().find("node 0"), absl::string_view::npos);
}

TEST(FaultTransport, ResetThroughTheApiAndLivePlanChanges) {
  Cluster c({"", "", ""});
  const uint8_t v = 1;
  ASSERT_TRUE(PostByte(c.nodes[0], 1, &v, 0, 0).ok());
  uint32_t imm = 0;
  ASSERT_TRUE(PollImmWaiting(*c.nodes[1].link, 0, &imm));
  // A plan set later applies to live links.
  auto plan = ParseFaultPlan("drop_after_writes=1:node=2");
  ASSERT_TRUE(plan.ok());
  c.transports[0]->SetPlan(*plan);
  EXPECT_EQ(c.transports[0]->plan().ToString(), "drop_after_writes=1:node=2");
  ASSERT_TRUE(PostByte(c.nodes[0], 2, &v, 0, 5).ok());
  ASSERT_TRUE(PostByte(c.nodes[0], 2, &v, 1, 6).ok());
  ASSERT_TRUE(PollImmWaiting(*c.nodes[2].link, 0, &imm));
  EXPECT_EQ(imm, 5u);
  EXPECT_FALSE(PollImmWaiting(*c.nodes[2].link, 0, &imm, milliseconds(150)));
  EXPECT_TRUE(absl::IsNotFound(c.transports[0]->ResetPeer("nope", 1)));
  const int wakes = c.nodes[0].wakes->load();
  ASSERT_TRUE(c.transports[0]->ResetPeer("g", 1).ok());
  EXPECT_EQ(c.nodes[0].link->State(1), PeerState::kFailed);
  EXPECT_GT(c.nodes[0].wakes->load(), wakes);  // Reset from outside the engine: woken.
  EXPECT_TRUE(absl::IsUnavailable(PostByte(c.nodes[0], 1, &v, 0, 0)));
  EXPECT_TRUE(
      WaitFor([&] { return c.nodes[1].link->State(0) == PeerState::kFailed; }, milliseconds(2000)));
  EXPECT_EQ(c.nodes[0].link->State(2), PeerState::kReady);
}

TEST(FaultTransport, PartitionFailsAfterTheBound) {
  // Node 0 and node 1 are cut apart (both wrappers carry the plan, as every process of a
  // multi-process test would); node 2 is on no side and reaches both.
  Cluster c({"", "", ""});
  auto plan = ParseFaultPlan("partition=0|1;partition_fail_ms=150");
  ASSERT_TRUE(plan.ok());
  for (auto& t : c.transports) t->SetPlan(*plan);
  const uint8_t v = 1;
  const auto start = std::chrono::steady_clock::now();
  const absl::Status s = PostByte(c.nodes[0], 1, &v, 0, 0);
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_NE(s.message().find("partitioned"), absl::string_view::npos) << s;
  ASSERT_TRUE(
      WaitFor([&] { return c.nodes[0].link->State(1) == PeerState::kFailed; }, milliseconds(2000)));
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(100));
  EXPECT_TRUE(
      WaitFor([&] { return c.nodes[1].link->State(0) == PeerState::kFailed; }, milliseconds(2000)));
  EXPECT_NE(c.nodes[1].link->PeerStatus(0).message().find("node 0"), absl::string_view::npos);
  uint32_t imm = 0;
  ASSERT_TRUE(PostByte(c.nodes[0], 2, &v, 0, 3).ok());
  ASSERT_TRUE(PollImmWaiting(*c.nodes[2].link, 0, &imm));
  EXPECT_EQ(imm, 3u);
  ASSERT_TRUE(PostByte(c.nodes[2], 1, &v, 0, 4).ok());
  ASSERT_TRUE(PollImmWaiting(*c.nodes[1].link, 2, &imm));
  EXPECT_EQ(imm, 4u);
}

}  // namespace
}  // namespace epd::transport
