// The TCP transport (daemon/transport/tcp/) between links in one process over 127.0.0.1,
// each link standing in for a node: exact bytes for many and for large pieces, immediate
// order, several connections, both directions at once, flow control, peer failure, bad
// descriptors and pieces, hostile raw sockets against the data listener (a member posing
// as another node, floods from several addresses), and no allocation on the steady-state
// path.
#include "daemon/transport/tcp/tcp_transport.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/os/scoped_fd.h"
#include "proto/abi/tcp_wire.h"
#include "tests/common/counting_new.h"
#include "tests/unit/transport_nodes.h"

namespace epd::transport {
namespace {

using testing::ConnectAll;
using testing::MakeNodes;
using testing::PollImmWaiting;
using testing::PostWriteRetrying;
using testing::TestNode;
using testing::WaitFor;

std::unique_ptr<Transport> MakeTcp(TcpTransportOptions o = {}) {
  auto t = MakeTcpTransport(o);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

/// `num_transports` TCP transports built with `o` and a group of `num_nodes` nodes over them
/// (node i on transport i % num_transports), connected.
struct Connected {
  std::vector<std::unique_ptr<Transport>> transports;
  std::vector<TestNode> nodes;
  Connected(const TcpTransportOptions& o, int num_transports, int num_nodes, uint64_t recv_bytes) {
    std::vector<Transport*> raw;
    for (int i = 0; i < num_transports; ++i) {
      transports.push_back(MakeTcp(o));
      raw.push_back(transports.back().get());
    }
    nodes = MakeNodes(raw, num_nodes, recv_bytes);
    ConnectAll(nodes);
  }
};

/// `n` pseudo-random bytes (xorshift64*, fast enough for 64 MiB).
std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (size_t i = 0; i < n; i += 8) {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    const uint64_t r = x * 0x2545f4914f6cdd1dull;
    std::memcpy(v.data() + i, &r, std::min<size_t>(8, n - i));
  }
  return v;
}

TEST(TcpTransport, OptionsAreChecked) {
  TcpTransportOptions o;
  o.connections_per_peer = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(MakeTcpTransport(o).status()));
  o.connections_per_peer = 17;
  EXPECT_TRUE(absl::IsInvalidArgument(MakeTcpTransport(o).status()));
  o = {};
  o.listen_address = "127.0.0.1";
  EXPECT_TRUE(absl::IsInvalidArgument(MakeTcpTransport(o).status()));
  o.listen_address = "127.0.0.1:99999";
  EXPECT_TRUE(absl::IsInvalidArgument(MakeTcpTransport(o).status()));
  auto t = MakeTcp();
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->name(), "tcp");
  EXPECT_NE(TcpListenAddress(*t).find("127.0.0.1:"), std::string::npos);
  GroupLinkOptions g;
  g.num_nodes = 1;
  EXPECT_TRUE(absl::IsInvalidArgument(t->CreateGroupLink(g).status()));
  g.num_nodes = 2;
  g.self_node = 2;
  EXPECT_TRUE(absl::IsInvalidArgument(t->CreateGroupLink(g).status()));
  g.self_node = 0;
  g.recv_bytes = 16;  // No recv_base.
  EXPECT_TRUE(absl::IsInvalidArgument(t->CreateGroupLink(g).status()));
}

// A wildcard listener advertises the host it is told; IPv6 listens and connects too (where
// the machine has ::1); a transport shut down makes no more links.
TEST(TcpTransport, AddressesAndShutdown) {
  TcpTransportOptions o;
  o.listen_address = "0.0.0.0:0";
  o.advertise_host = "127.0.0.1";
  Connected v4(o, 2, 2, 64);
  abi::TcpDescriptor d{};
  std::memcpy(&d, v4.nodes[0].link->LocalDescriptor().data(), sizeof d);
  EXPECT_STREQ(d.host, "127.0.0.1");
  EXPECT_EQ(d.recv_bytes, 64u);
  EXPECT_EQ(d.num_connections, 2);

  ScopedFd probe(::socket(AF_INET6, SOCK_STREAM, 0));
  sockaddr_in6 sa6{};
  sa6.sin6_family = AF_INET6;
  sa6.sin6_addr = in6addr_loopback;
  if (probe.valid() && ::bind(probe.get(), reinterpret_cast<sockaddr*>(&sa6), sizeof sa6) == 0) {
    o.listen_address = "[::1]:0";
    o.advertise_host = "";
    Connected v6(o, 2, 2, 64);
    EXPECT_NE(TcpListenAddress(*v6.transports[0]).find("[::1]:"), std::string::npos);
    const uint8_t byte = 9;
    const WritePiece p{&byte, 1, 7};
    ASSERT_TRUE(v6.nodes[0].link->PostWrite(1, std::span(&p, 1), 1).ok());
    uint32_t imm = 0;
    ASSERT_TRUE(PollImmWaiting(*v6.nodes[1].link, 0, &imm));
    EXPECT_EQ(v6.nodes[1].recv[7], 9);
  } else {
    std::cout << "no IPv6 loopback here: the IPv6 half is not run\n";
  }
  o.listen_address = "::1:0";  // IPv6 without brackets.
  EXPECT_TRUE(absl::IsInvalidArgument(MakeTcpTransport(o).status()));

  v4.transports[0]->Shutdown();
  v4.transports[0]->Shutdown();  // Idempotent.
  GroupLinkOptions g;
  g.num_nodes = 2;
  EXPECT_TRUE(absl::IsFailedPrecondition(v4.transports[0]->CreateGroupLink(g).status()));
  EXPECT_EQ(v4.nodes[0].link->State(1), PeerState::kFailed);
  EXPECT_NE(v4.nodes[0].link->PeerStatus(1).message().find("shut down"), absl::string_view::npos);
}

// Many small pieces at random offsets, 3 connections, both directions at once, each on its
// own engine thread: every byte lands and the immediates come in posting order.
TEST(TcpTransport, ManyPiecesBothWaysInOrder) {
  TcpTransportOptions o;
  o.connections_per_peer = 3;
  o.max_writes_in_flight = 16;
  o.chunk_bytes = 4096;
  constexpr uint64_t kRegion = 1 << 20;
  Connected c(o, 2, 2, kRegion);
  auto& nodes = c.nodes;
  constexpr int kWrites = 400;
  constexpr int kPiecesPerWrite = 8;
  constexpr uint64_t kSlot = kRegion / (kWrites * kPiecesPerWrite);  // 327 bytes.
  std::vector<std::vector<uint8_t>> src(2);
  for (int i = 0; i < 2; ++i) src[i] = RandomBytes(kRegion, 7 + i);
  std::atomic<int> failures{0};
  const auto engine = [&](int self) {
    const int peer = 1 - self;
    GroupLink& link = *nodes[self].link;
    int next_imm = 0;
    for (int w = 0; w < kWrites; ++w) {
      std::array<WritePiece, kPiecesPerWrite> pieces{};
      for (int k = 0; k < kPiecesPerWrite; ++k) {
        // Pieces of a write go to scattered slots; lengths vary.
        const uint64_t slot = (static_cast<uint64_t>(k) * kWrites + w) * kSlot;
        pieces[k] = WritePiece{src[self].data() + slot, kSlot - (w + k) % 17, slot};
      }
      if (!PostWriteRetrying(link, peer, pieces, 1000 + w).ok()) ++failures;
      uint32_t imm = 0;
      while (link.PollImm(peer, &imm)) {
        if (imm != static_cast<uint32_t>(1000 + next_imm++)) ++failures;
      }
    }
    uint32_t imm = 0;
    while (next_imm < kWrites && PollImmWaiting(link, peer, &imm)) {
      if (imm != static_cast<uint32_t>(1000 + next_imm++)) ++failures;
    }
    if (next_imm != kWrites) ++failures;
    if (!WaitFor([&] { return link.WritesCompleted(peer) == kWrites; })) ++failures;
  };
  std::thread a(engine, 0), b(engine, 1);
  a.join();
  b.join();
  EXPECT_EQ(failures.load(), 0);
  for (int self = 0; self < 2; ++self) {
    const auto& got = nodes[1 - self].recv;
    for (int w = 0; w < kWrites; ++w) {
      for (int k = 0; k < kPiecesPerWrite; ++k) {
        const uint64_t slot = (static_cast<uint64_t>(k) * kWrites + w) * kSlot;
        const uint64_t len = kSlot - (w + k) % 17;
        ASSERT_EQ(std::memcmp(got.data() + slot, src[self].data() + slot, len), 0)
            << "write " << w << " piece " << k;
        if (len < kSlot) {
          ASSERT_EQ(got[slot + len], 0) << "bytes past write " << w << " piece " << k;
        }
      }
    }
  }
  EXPECT_GT(nodes[0].wakes->load(), 0);
}

// Successive writes to the same bytes, each striped differently over 3 connections: the
// later write's bytes win.
TEST(TcpTransport, LaterWritesWinOverlaps) {
  TcpTransportOptions o;
  o.connections_per_peer = 3;
  o.chunk_bytes = 4096;
  constexpr uint64_t kRegion = 64 * 1024;
  Connected c(o, 2, 2, kRegion);
  const std::vector<uint8_t> a = RandomBytes(kRegion, 1), b = RandomBytes(kRegion, 2);
  constexpr int kWrites = 300;
  for (int w = 0; w < kWrites; ++w) {
    const std::vector<WritePiece> pieces = {{(w % 2 ? b : a).data(), kRegion, 0}};
    ASSERT_TRUE(PostWriteRetrying(*c.nodes[0].link, 1, pieces, w).ok());
  }
  uint32_t imm = 0;
  for (int w = 0; w < kWrites; ++w) ASSERT_TRUE(PollImmWaiting(*c.nodes[1].link, 0, &imm));
  EXPECT_EQ(imm, static_cast<uint32_t>(kWrites - 1));
  EXPECT_TRUE(c.nodes[1].recv == b);
}

// 64 MiB in pieces far larger than the socket buffers (one of 24 MiB), striped over 4
// connections.
TEST(TcpTransport, LargeWritesLandExactly) {
  TcpTransportOptions o;
  o.connections_per_peer = 4;
  constexpr uint64_t kRegion = 64ull << 20;
  Connected c(o, 2, 2, kRegion);
  auto& nodes = c.nodes;
  const std::vector<uint8_t> src = RandomBytes(kRegion, 42);
  const std::vector<WritePiece> first = {{src.data(), 24ull << 20, 0},
                                         {src.data() + (24ull << 20), 12345, 24ull << 20}};
  ASSERT_TRUE(nodes[0].link->PostWrite(1, first, 1).ok());
  std::vector<WritePiece> rest;
  for (uint64_t off = (24ull << 20) + 12345; off < kRegion; off += 3ull << 20) {
    rest.push_back({src.data() + off, std::min<uint64_t>(3ull << 20, kRegion - off), off});
  }
  ASSERT_TRUE(nodes[0].link->PostWrite(1, rest, 2).ok());
  uint32_t imm = 0;
  ASSERT_TRUE(PollImmWaiting(*nodes[1].link, 0, &imm, std::chrono::milliseconds(20000)));
  EXPECT_EQ(imm, 1u);
  ASSERT_TRUE(PollImmWaiting(*nodes[1].link, 0, &imm, std::chrono::milliseconds(20000)));
  EXPECT_EQ(imm, 2u);
  EXPECT_TRUE(nodes[1].recv == src);
  EXPECT_TRUE(WaitFor([&] { return nodes[0].link->WritesCompleted(1) == 2; }));
}

// A receiver that polls slowly holds the sender back (max_pending_imms) and nothing is lost;
// writes beyond max_writes_in_flight are RESOURCE_EXHAUSTED.
TEST(TcpTransport, FlowControlKeepsOrder) {
  TcpTransportOptions o;
  o.max_writes_in_flight = 4;
  o.max_pieces_in_flight = 8;
  o.max_pending_imms = 3;
  Connected c(o, 1, 2, 4096);
  auto& nodes = c.nodes;
  // Whole-region writes: once the receiver holds max_pending_imms it reads no more, so
  // the socket buffers fill and the sender must be held back (however fast its progress
  // thread drains them), which small writes alone do not guarantee under load.
  std::vector<uint8_t> bytes(4096, 7);
  const WritePiece piece{bytes.data(), bytes.size(), 0};
  int exhausted = 0;
  uint32_t posted = 0;
  uint32_t next = 0;
  while ((posted < 200 || exhausted == 0) && posted < 100000) {
    const absl::Status s = nodes[0].link->PostWrite(1, std::span(&piece, 1), posted);
    if (absl::IsResourceExhausted(s)) {
      ++exhausted;
      uint32_t imm = 0;
      if (nodes[1].link->PollImm(0, &imm)) {
        EXPECT_EQ(imm, next++);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      continue;
    }
    ASSERT_TRUE(s.ok()) << s;
    ++posted;
  }
  uint32_t imm = 0;
  while (next < posted && PollImmWaiting(*nodes[1].link, 0, &imm)) {
    EXPECT_EQ(imm, next++);
  }
  EXPECT_EQ(next, posted);
  EXPECT_GT(exhausted, 0);
  std::vector<WritePiece> too_many(9, piece);
  EXPECT_TRUE(absl::IsInvalidArgument(nodes[0].link->PostWrite(1, too_many, 0)));
}

/// Node 1 of `nodes` comes back as a new incarnation (a new link on `t`, group "g"), connects
/// to node 0 and is ready (node 0 has not connected to it again yet).
void RestartNode1(Transport& t, std::vector<TestNode>& nodes) {
  GroupLinkOptions o;
  o.group = "g";
  o.num_nodes = static_cast<int32_t>(nodes.size());
  o.self_node = 1;
  o.recv_base = nodes[1].recv.data();
  o.recv_bytes = nodes[1].recv.size();
  auto fresh = t.CreateGroupLink(o);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  nodes[1].link = std::move(*fresh);
  ASSERT_TRUE(nodes[1].link->Connect(0, nodes[0].link->LocalDescriptorFor(1)).ok());
  ASSERT_TRUE(WaitFor([&] { return nodes[1].link->State(0) == PeerState::kReady; }))
      << nodes[1].link->PeerStatus(0);
}

// A peer that restarts (its link closed, a new one with a new token): the survivor's link
// to it fails, the new incarnation's connections wait parked until the survivor calls
// Connect with the new descriptor, which drops the old connections and their undelivered
// immediates; then writes flow both ways again. Connect again on a ready peer reconnects too.
TEST(TcpTransport, ConnectAgainToARestartedPeer) {
  auto t0 = MakeTcp(), t1 = MakeTcp();
  auto nodes = MakeNodes({t0.get(), t1.get()}, 2, 256);
  ConnectAll(nodes);
  const uint32_t old_value = 0x11111111, new_value = 0x22222222, back = 0x33333333;
  const WritePiece old_piece{&old_value, 4, 0};
  ASSERT_TRUE(nodes[1].link->PostWrite(0, std::span(&old_piece, 1), 7).ok());
  ASSERT_TRUE(WaitFor([&] { return nodes[1].link->WritesCompleted(0) == 1; }));
  // Node 1 restarts: node 0 sees it fail (its immediate 7 is never polled).
  nodes[1].link.reset();
  ASSERT_TRUE(WaitFor([&] { return nodes[0].link->State(1) == PeerState::kFailed; }));
  // The new node 1 connects first and writes: parked at node 0 until it reconnects.
  ASSERT_NO_FATAL_FAILURE(RestartNode1(*t1, nodes));
  const WritePiece new_piece{&new_value, 4, 4};
  ASSERT_TRUE(nodes[1].link->PostWrite(0, std::span(&new_piece, 1), 8).ok());
  EXPECT_EQ(nodes[0].link->State(1), PeerState::kFailed);
  ASSERT_TRUE(nodes[0].link->Connect(1, nodes[1].link->LocalDescriptorFor(0)).ok());
  ASSERT_TRUE(WaitFor([&] { return nodes[0].link->State(1) == PeerState::kReady; }))
      << nodes[0].link->PeerStatus(1);
  EXPECT_TRUE(nodes[0].link->PeerStatus(1).ok());
  uint32_t imm = 0;
  ASSERT_TRUE(PollImmWaiting(*nodes[0].link, 1, &imm));
  EXPECT_EQ(imm, 8u);  // The old incarnation's 7 was dropped.
  uint32_t got = 0;
  std::memcpy(&got, nodes[0].recv.data() + 4, 4);
  EXPECT_EQ(got, new_value);
  const WritePiece back_piece{&back, 4, 8};
  ASSERT_TRUE(nodes[0].link->PostWrite(1, std::span(&back_piece, 1), 9).ok());
  ASSERT_TRUE(PollImmWaiting(*nodes[1].link, 0, &imm));
  EXPECT_EQ(imm, 9u);
  std::memcpy(&got, nodes[1].recv.data() + 8, 4);
  EXPECT_EQ(got, back);
  // Node 0's write count started anew with the new incarnation.
  EXPECT_TRUE(WaitFor([&] { return nodes[0].link->WritesCompleted(1) == 1; }));
}

// A peer that finished writing and closed (its group torn down): what it wrote still
// arrives whole, on every connection, before the link to it fails; many rounds, since
// which connection's close is seen first varies.
TEST(TcpTransport, WritesBeforeAPeersCloseStillArrive) {
  TcpTransportOptions o;
  o.connections_per_peer = 4;
  o.chunk_bytes = 4096;
  for (int round = 0; round < 20; ++round) {
    Connected c(o, 2, 2, 64 * 1024);
    const std::vector<uint8_t> src = RandomBytes(40000, static_cast<uint64_t>(round));
    const WritePiece piece{src.data(), src.size(), 100};
    ASSERT_TRUE(c.nodes[1].link->PostWrite(0, std::span(&piece, 1), 42).ok());
    ASSERT_TRUE(WaitFor([&] { return c.nodes[1].link->WritesCompleted(0) == 1; }));
    c.nodes[1].link.reset();
    ASSERT_TRUE(WaitFor([&] { return c.nodes[0].link->State(1) == PeerState::kFailed; }));
    uint32_t imm = 0;
    ASSERT_TRUE(c.nodes[0].link->PollImm(1, &imm)) << "round " << round;
    EXPECT_EQ(imm, 42u);
    EXPECT_EQ(std::memcmp(c.nodes[0].recv.data() + 100, src.data(), src.size()), 0);
  }
}

TEST(TcpTransport, BadDescriptorsAndPieces) {
  auto t = MakeTcp();
  auto nodes = MakeNodes({t.get()}, 3, 1024);
  GroupLink& link = *nodes[0].link;
  const std::string d1 = nodes[1].link->LocalDescriptorFor(0);
  EXPECT_TRUE(absl::IsInvalidArgument(link.Connect(0, d1)));  // Self.
  EXPECT_TRUE(absl::IsInvalidArgument(link.Connect(3, d1)));  // Out of range.
  EXPECT_TRUE(absl::IsInvalidArgument(link.Connect(2, d1)));  // Node 1's descriptor.
  // Node 1's descriptor for node 2, or for no node: not node 0's to connect with.
  const absl::Status other = link.Connect(1, nodes[1].link->LocalDescriptorFor(2));
  EXPECT_TRUE(absl::IsInvalidArgument(other));
  EXPECT_NE(other.message().find("made for node 2"), absl::string_view::npos) << other;
  EXPECT_TRUE(absl::IsInvalidArgument(link.Connect(1, nodes[1].link->LocalDescriptor())));
  EXPECT_TRUE(absl::IsInvalidArgument(link.Connect(1, d1.substr(1))));
  EXPECT_TRUE(absl::IsInvalidArgument(link.Connect(1, "garbage")));
  std::string bad = d1;
  bad[0] ^= 1;  // Magic.
  EXPECT_TRUE(absl::IsInvalidArgument(link.Connect(1, bad)));
  bad = d1;
  bad[offsetof(abi::TcpDescriptor, version)] = 9;
  EXPECT_TRUE(absl::IsInvalidArgument(link.Connect(1, bad)));
  bad = d1;
  std::memset(bad.data() + offsetof(abi::TcpDescriptor, host), 'x', abi::kTcpHostBytes);
  EXPECT_TRUE(absl::IsInvalidArgument(link.Connect(1, bad)));  // Host not terminated.
  EXPECT_EQ(link.State(1), PeerState::kIdle);
  const uint8_t byte = 1;
  const WritePiece p{&byte, 1, 0};
  EXPECT_TRUE(absl::IsUnavailable(link.PostWrite(1, std::span(&p, 1), 0)));  // Not connected.

  ConnectAll(nodes);
  const std::vector<uint8_t> src(2048, 5);
  const WritePiece outside[] = {{src.data(), 8, 1020}};
  EXPECT_TRUE(absl::IsInvalidArgument(link.PostWrite(1, outside, 0)));
  const WritePiece huge[] = {{src.data(), 1, ~uint64_t{0}}};
  EXPECT_TRUE(absl::IsInvalidArgument(link.PostWrite(1, huge, 0)));
  const WritePiece no_src[] = {{nullptr, 4, 0}};
  EXPECT_TRUE(absl::IsInvalidArgument(link.PostWrite(1, no_src, 0)));
  const WritePiece edge[] = {{src.data(), 4, 1020}, {src.data(), 0, 1024}};
  EXPECT_TRUE(link.PostWrite(1, edge, 9).ok());
  uint32_t imm = 0;
  ASSERT_TRUE(PollImmWaiting(*nodes[1].link, 0, &imm));
  EXPECT_EQ(imm, 9u);
  EXPECT_EQ(nodes[1].recv[1023], 5);
  EXPECT_TRUE(link.PostWrite(1, {}, 10).ok());  // An immediate alone.
  ASSERT_TRUE(PollImmWaiting(*nodes[1].link, 0, &imm));
  EXPECT_EQ(imm, 10u);
}

// A peer that closes its link is kFailed within a bound, naming the node; the engine is
// woken; other links of the same transport keep working.
TEST(TcpTransport, PeerCloseFailsThatPeerOnly) {
  auto ta = MakeTcp();
  auto tb = MakeTcp();
  // Nodes named as the data plane names them (their Peer address and ranks).
  auto g1 = MakeNodes({ta.get(), tb.get()}, 2, 256, "g1",
                      {"10.0.0.1:7300, ranks 0-1", "10.0.0.2:7301, ranks 2-3"});
  auto g2 = MakeNodes({ta.get(), tb.get()}, 2, 256, "g2");
  ConnectAll(g1);
  ConnectAll(g2);
  const int wakes = g1[0].wakes->load();
  g1[1].link->Close();
  g1[1].link->Close();  // Idempotent.
  ASSERT_TRUE(WaitFor([&] { return g1[0].link->State(1) == PeerState::kFailed; },
                      std::chrono::milliseconds(2000)));
  const absl::Status s = g1[0].link->PeerStatus(1);
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_NE(s.message().find("node 1"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("g1"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("node 1 (10.0.0.2:7301, ranks 2-3; data "), absl::string_view::npos)
      << s;
  EXPECT_GT(g1[0].wakes->load(), wakes);
  const uint8_t byte = 3;
  const WritePiece p{&byte, 1, 0};
  EXPECT_TRUE(absl::IsUnavailable(g1[0].link->PostWrite(1, std::span(&p, 1), 0)));
  ASSERT_TRUE(g2[0].link->PostWrite(1, std::span(&p, 1), 77).ok());
  uint32_t imm = 0;
  ASSERT_TRUE(PollImmWaiting(*g2[1].link, 0, &imm));
  EXPECT_EQ(imm, 77u);
  EXPECT_EQ(g2[1].recv[0], 3);
  // A transport shut down under live links fails their peers too; links outlive it.
  tb->Shutdown();
  ASSERT_TRUE(WaitFor([&] { return g2[0].link->State(1) == PeerState::kFailed; },
                      std::chrono::milliseconds(2000)));
  EXPECT_EQ(g2[1].link->State(0), PeerState::kFailed);
  tb.reset();
  g2[1].link->Close();
}

// A receiver that polls nothing stops reading (max_pending_imms), so a large write stays
// incomplete; once that peer fails, every posted write counts as completed.
TEST(TcpTransport, FailedPeerReleasesSources) {
  TcpTransportOptions o;
  o.max_pending_imms = 1;
  constexpr uint64_t kRegion = 64ull << 20;  // Beyond what the socket buffers hold.
  Connected c(o, 2, 2, kRegion);
  const std::vector<uint8_t> src(kRegion, 1);
  const std::vector<WritePiece> small = {{src.data(), 8, 0}};
  const std::vector<WritePiece> large = {{src.data(), kRegion, 0}};
  ASSERT_TRUE(c.nodes[0].link->PostWrite(1, small, 1).ok());
  ASSERT_TRUE(c.nodes[0].link->PostWrite(1, small, 2).ok());
  ASSERT_TRUE(c.nodes[0].link->PostWrite(1, large, 3).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_LT(c.nodes[0].link->WritesCompleted(1), 3u);  // Held back by the receiver.
  c.nodes[1].link->Close();
  ASSERT_TRUE(WaitFor([&] { return c.nodes[0].link->State(1) == PeerState::kFailed; }));
  EXPECT_EQ(c.nodes[0].link->WritesCompleted(1), 3u);
}

/// A listening socket on 127.0.0.1 (any port, stored in *port) that accepts nothing itself.
ScopedFd ListenOnLoopback(uint16_t* port) {
  ScopedFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  EXPECT_EQ(::listen(fd.get(), 16), 0);
  socklen_t len = sizeof sa;
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&sa), &len);
  *port = ntohs(sa.sin_port);
  return fd;
}

TEST(TcpTransport, ConnectFailuresAreBounded) {
  TcpTransportOptions o;
  o.connect_timeout = std::chrono::milliseconds(300);
  auto t = MakeTcp(o);
  auto nodes = MakeNodes({t.get()}, 3, 64);
  // A listener that never answers the handshake.
  uint16_t silent_port = 0;
  ScopedFd silent = ListenOnLoopback(&silent_port);
  abi::TcpDescriptor d{};
  const std::string real = nodes[1].link->LocalDescriptorFor(0);
  std::memcpy(&d, real.data(), sizeof d);
  d.port = silent_port;
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(nodes[0].link->Connect(1, std::string(reinterpret_cast<char*>(&d), sizeof d)).ok());
  ASSERT_TRUE(WaitFor([&] { return nodes[0].link->State(1) == PeerState::kFailed; },
                      std::chrono::milliseconds(3000)));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(2000));
  EXPECT_NE(nodes[0].link->PeerStatus(1).message().find("not connected within 300 ms"),
            absl::string_view::npos)
      << nodes[0].link->PeerStatus(1);
  // Nothing listening: refused at once.
  silent.Reset();
  d.node = 2;
  ASSERT_TRUE(nodes[0].link->Connect(2, std::string(reinterpret_cast<char*>(&d), sizeof d)).ok());
  ASSERT_TRUE(WaitFor([&] { return nodes[0].link->State(2) == PeerState::kFailed; },
                      std::chrono::milliseconds(3000)));
  EXPECT_NE(nodes[0].link->PeerStatus(2).message().find("node 2"), absl::string_view::npos);
}

/// A raw client socket to the data listener of `node`'s transport.
/// A blocking connection to the descriptor's port on 127.0.0.1, from `source` (an address of
/// 127.0.0.0/8, host byte order).
ScopedFd RawConnect(const std::string& descriptor, uint32_t source = INADDR_LOOPBACK) {
  abi::TcpDescriptor d{};
  std::memcpy(&d, descriptor.data(), sizeof d);
  ScopedFd fd(::socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in from{};
  from.sin_family = AF_INET;
  from.sin_addr.s_addr = htonl(source);
  EXPECT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&from), sizeof from), 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  sa.sin_port = htons(d.port);
  EXPECT_EQ(::connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  timeval tv{5, 0};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

/// The handshake node `from` sends to `target` on `connection`, made with the descriptor
/// `target` hands node `from` (or, with `presented_for`, the one it hands that node).
abi::TcpHandshake Handshake(const GroupLink& target, int32_t from, uint32_t connection,
                            uint16_t num_connections = 2, uint64_t incarnation = 0,
                            std::optional<int32_t> presented_for = std::nullopt) {
  abi::TcpDescriptor d{};
  std::memcpy(&d, target.LocalDescriptorFor(presented_for.value_or(from)).data(), sizeof d);
  abi::TcpHandshake hs = MakeTcpHandshake(
      d, from, incarnation != 0 ? incarnation : 0x5eed0000u + 17 * from, connection);
  hs.num_connections = num_connections;
  return hs;
}

/// True when the listener closed `fd` (no acknowledgement).
bool Refused(int fd) {
  char buf[sizeof(abi::TcpAck)];
  const ssize_t r = ::recv(fd, buf, sizeof buf, MSG_WAITALL);
  return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

bool Accepted(int fd) {
  abi::TcpAck ack{};
  return ::recv(fd, &ack, sizeof ack, MSG_WAITALL) == static_cast<ssize_t>(sizeof ack) &&
         ack.magic == abi::kTcpAckMagic;
}

template <typename T>
void SendAll(int fd, const T& v, size_t bytes = sizeof(T)) {
  ASSERT_EQ(::send(fd, &v, bytes, MSG_NOSIGNAL), static_cast<ssize_t>(bytes));
}

/// Node 1 writes `value` at `offset` of node 0's region with immediate `imm`: node 0 polls
/// the immediate and finds the value there.
void ExpectWriteLands(std::vector<TestNode>& nodes, uint32_t value, uint64_t offset, uint32_t imm) {
  const WritePiece p{&value, sizeof value, offset};
  ASSERT_TRUE(nodes[1].link->PostWrite(0, std::span(&p, 1), imm).ok());
  uint32_t got = 0;
  ASSERT_TRUE(PollImmWaiting(*nodes[0].link, 1, &got));
  EXPECT_EQ(got, imm);
  uint32_t landed = 0;
  std::memcpy(&landed, nodes[0].recv.data() + offset, sizeof landed);
  EXPECT_EQ(landed, value);
}

// Hostile connections to the data listener are refused or fail only the peer they claim to
// be; the listener and the real peers keep working.
TEST(TcpTransport, HostileConnectionsAreRefused) {
  auto t = MakeTcp();
  auto nodes = MakeNodes({t.get()}, 4, 4096);
  // Nodes 0 and 1 are real; 2 and 3 are played by raw sockets against node 0.
  for (int i : {0, 1}) {
    ASSERT_TRUE(nodes[i].link->Connect(1 - i, nodes[1 - i].link->LocalDescriptorFor(i)).ok());
  }
  // Both ways: node 1 writes to node 0 at the end (PostWrite fails on a peer not yet ready).
  ASSERT_TRUE(WaitFor([&] {
    return nodes[0].link->State(1) == PeerState::kReady &&
           nodes[1].link->State(0) == PeerState::kReady;
  }));
  const std::string d0 = nodes[0].link->LocalDescriptor();
  {
    ScopedFd fd = RawConnect(d0);
    const char garbage[64] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    SendAll(fd.get(), garbage);
    EXPECT_TRUE(Refused(fd.get()));
  }
  {
    abi::TcpHandshake hs = Handshake(*nodes[0].link, 2, 0);
    hs.magic ^= 1;
    ScopedFd fd = RawConnect(d0);
    SendAll(fd.get(), hs);
    EXPECT_TRUE(Refused(fd.get()));
  }
  {
    abi::TcpHandshake hs = Handshake(*nodes[0].link, 2, 0);
    hs.version = abi::kTcpWireVersion + 1;
    ScopedFd fd = RawConnect(d0);
    SendAll(fd.get(), hs);
    EXPECT_TRUE(Refused(fd.get()));
  }
  {
    abi::TcpHandshake hs = Handshake(*nodes[0].link, 2, 0);
    hs.proof[3] ^= 0x40;
    ScopedFd fd = RawConnect(d0);
    SendAll(fd.get(), hs);
    EXPECT_TRUE(Refused(fd.get()));
  }
  for (const abi::TcpHandshake& bad :
       {Handshake(*nodes[0].link, 0, 0), Handshake(*nodes[0].link, 4, 0),
        Handshake(*nodes[0].link, -1, 0), Handshake(*nodes[0].link, 2, 2),
        Handshake(*nodes[0].link, 2, 0, 3)}) {
    ScopedFd fd = RawConnect(d0);
    SendAll(fd.get(), bad);
    EXPECT_TRUE(Refused(fd.get())) << "from " << bad.from_node << " conn " << bad.connection;
  }
  {  // Half a handshake, then close.
    ScopedFd fd = RawConnect(d0);
    const abi::TcpHandshake hs = Handshake(*nodes[0].link, 2, 0);
    SendAll(fd.get(), hs, 10);
  }
  EXPECT_EQ(nodes[0].link->State(2), PeerState::kIdle);
  // Node 2 (raw) sends a piece outside node 0's region: node 2 fails, naming it.
  ScopedFd c0 = RawConnect(d0), c1 = RawConnect(d0);
  SendAll(c0.get(), Handshake(*nodes[0].link, 2, 0));
  SendAll(c1.get(), Handshake(*nodes[0].link, 2, 1));
  ASSERT_TRUE(Accepted(c0.get()));
  ASSERT_TRUE(Accepted(c1.get()));
  {  // A repeated connection index is refused.
    ScopedFd dup = RawConnect(d0);
    SendAll(dup.get(), Handshake(*nodes[0].link, 2, 1));
    EXPECT_TRUE(Refused(dup.get()));
  }
  abi::TcpFrameHeader h = abi::MakeTcpFrame(abi::TcpFrameKind::kPiece, 0, 4000, 200, 0);
  SendAll(c0.get(), h);
  ASSERT_TRUE(WaitFor([&] { return nodes[0].link->State(2) == PeerState::kFailed; }));
  const absl::Status s = nodes[0].link->PeerStatus(2);
  EXPECT_NE(s.message().find("node 2"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("outside"), absl::string_view::npos) << s;
  EXPECT_TRUE(Refused(c1.get()));  // Every connection of the failed peer is closed.
  // Node 3 (raw) sends half a frame, then closes: node 3 fails.
  ScopedFd e0 = RawConnect(d0), e1 = RawConnect(d0);
  SendAll(e0.get(), Handshake(*nodes[0].link, 3, 0));
  SendAll(e1.get(), Handshake(*nodes[0].link, 3, 1));
  ASSERT_TRUE(Accepted(e0.get()));
  ASSERT_TRUE(Accepted(e1.get()));
  h.offset = 0;
  h.bytes = 100;
  SendAll(e0.get(), h);
  const char half[50] = {};
  SendAll(e0.get(), half);
  e0.Reset();
  ASSERT_TRUE(WaitFor([&] { return nodes[0].link->State(3) == PeerState::kFailed; }));
  EXPECT_NE(nodes[0].link->PeerStatus(3).message().find("node 3"), absl::string_view::npos);
  // The real peer is untouched and the listener still accepts.
  EXPECT_EQ(nodes[0].link->State(1), PeerState::kReady);
  ExpectWriteLands(nodes, 0xabcdef01, 64, 5);
  auto late = MakeNodes({t.get()}, 2, 64, "late");
  ConnectAll(late);
}

// Connections that never send a handshake cannot hold the data listener shut: more of them
// than may handshake at once (64) make the oldest go, and real peers still connect.
TEST(TcpTransport, SilentConnectionsCannotHoldTheListenerShut) {
  auto t = MakeTcp();
  auto nodes = MakeNodes({t.get()}, 2, 64);
  const std::string d0 = nodes[0].link->LocalDescriptor();
  std::vector<ScopedFd> silent;
  for (int i = 0; i < 80; ++i) silent.push_back(RawConnect(d0));
  EXPECT_TRUE(Refused(silent.front().get()));  // The oldest made room for the newer ones.
  ConnectAll(nodes);
  ExpectWriteLands(nodes, 0x5a5a1234, 8, 7);
}

// A flood of connections from one address drops its own handshaking connections, not a real
// peer's from another address that has sent only part of its handshake yet.
TEST(TcpTransport, AFloodFromOneAddressDoesNotDropAnotherAddresssHandshake) {
  auto t = MakeTcp();
  auto nodes = MakeNodes({t.get()}, 2, 64);
  const std::string d0 = nodes[0].link->LocalDescriptor();
  const abi::TcpHandshake hs = Handshake(*nodes[0].link, 1, 0);
  ScopedFd peer = RawConnect(d0);
  SendAll(peer.get(), hs, 10);
  std::vector<ScopedFd> flood;
  for (int i = 0; i < 80; ++i) flood.push_back(RawConnect(d0, INADDR_LOOPBACK + 1));
  EXPECT_TRUE(Refused(flood.front().get()));  // The flood's oldest made room.
  const auto* rest = reinterpret_cast<const char*>(&hs) + 10;
  ASSERT_EQ(::send(peer.get(), rest, sizeof hs - 10, MSG_NOSIGNAL),
            static_cast<ssize_t>(sizeof hs - 10));
  EXPECT_TRUE(Accepted(peer.get()));
}

// A member of the group holds the descriptor node 0 handed it, not node 1's: it cannot
// connect to node 0 as node 1, neither while node 1 is connected nor while it is failed
// (when a connection would be held for node 1's next incarnation). Connections parked for
// an incarnation node 0 has not connected (an old one's, a stale holder's) do not keep the
// real new incarnation out: the newest per index wins, and Connect takes only those of the
// descriptor's incarnation.
TEST(TcpTransport, AMemberCannotConnectAsAnotherNode) {
  auto t0 = MakeTcp(), t1 = MakeTcp();
  auto nodes = MakeNodes({t0.get(), t1.get(), t1.get()}, 3, 256);
  for (int i : {0, 1}) {
    ASSERT_TRUE(nodes[i].link->Connect(1 - i, nodes[1 - i].link->LocalDescriptorFor(i)).ok());
  }
  // Both ways: node 1 writes to node 0 below (PostWrite fails on a peer not yet ready).
  ASSERT_TRUE(WaitFor([&] {
    return nodes[0].link->State(1) == PeerState::kReady &&
           nodes[1].link->State(0) == PeerState::kReady;
  }));
  const std::string d0 = nodes[0].link->LocalDescriptor();
  // Node 2 (raw) presents its own token, claiming to be node 1.
  const auto pose_as_1 = [&](uint32_t connection) {
    ScopedFd fd = RawConnect(d0);
    SendAll(fd.get(), Handshake(*nodes[0].link, 1, connection, 2, 0x77, /*presented_for=*/2));
    return Refused(fd.get());
  };
  EXPECT_TRUE(pose_as_1(0));
  EXPECT_EQ(nodes[0].link->State(1), PeerState::kReady);
  ExpectWriteLands(nodes, 0x01020304, 0, 1);

  // Node 1 restarts; while node 0 holds it failed, the pose is refused still.
  nodes[1].link.reset();
  ASSERT_TRUE(WaitFor([&] { return nodes[0].link->State(1) == PeerState::kFailed; }));
  EXPECT_TRUE(pose_as_1(0));
  EXPECT_TRUE(pose_as_1(1));
  // Connections with node 1's token from an incarnation that is not the new one: parked.
  ScopedFd stale0 = RawConnect(d0), stale1 = RawConnect(d0);
  SendAll(stale0.get(), Handshake(*nodes[0].link, 1, 0, 2, 0xdead));
  SendAll(stale1.get(), Handshake(*nodes[0].link, 1, 1, 2, 0xdead));
  ASSERT_TRUE(Accepted(stale0.get()));
  ASSERT_TRUE(Accepted(stale1.get()));

  // The new node 1 connects: its connections replace the parked ones.
  ASSERT_NO_FATAL_FAILURE(RestartNode1(*t1, nodes));
  EXPECT_TRUE(Refused(stale0.get()));  // Replaced: closed.
  EXPECT_TRUE(Refused(stale1.get()));
  ASSERT_TRUE(nodes[0].link->Connect(1, nodes[1].link->LocalDescriptorFor(0)).ok());
  ASSERT_TRUE(WaitFor([&] { return nodes[0].link->State(1) == PeerState::kReady; }))
      << nodes[0].link->PeerStatus(1);
  ExpectWriteLands(nodes, 0x0a0b0c0d, 8, 2);
}

/// A TCP relay on 127.0.0.1 to `target_port` on 127.0.0.1: every connection it accepts gets
/// its own upstream connection, and bytes flow both ways; the first `hold` connections send
/// nothing upstream (their upstream stays silent at the listener). Either side closing
/// closes both.
class Relay {
 public:
  Relay(uint16_t target_port, int hold) : target_port_(target_port), hold_(hold) {
    listen_ = ListenOnLoopback(&port_);
    thread_ = std::thread([this] { Run(); });
  }
  ~Relay() {
    stop_ = true;
    thread_.join();
  }
  uint16_t port() const { return port_; }
  /// Connections relayed so far (their upstream connected).
  int relayed() const { return relayed_.load(); }

 private:
  struct Pair {
    ScopedFd down, up;
    bool held = false;
  };

  /// Moves what `from` has to `to`; false when `from` closed or failed.
  static bool Pump(int from, int to) {
    char buf[4096];
    const ssize_t n = ::recv(from, buf, sizeof buf, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return true;
    return n > 0 && ::send(to, buf, static_cast<size_t>(n), MSG_NOSIGNAL) == n;
  }

  void Run() {
    std::vector<Pair> pairs;
    while (!stop_) {
      std::vector<pollfd> fds{{listen_.get(), POLLIN, 0}};
      for (const Pair& p : pairs) {
        fds.push_back({p.down.get(), static_cast<short>(p.held ? 0 : POLLIN), 0});
        fds.push_back({p.up.get(), POLLIN, 0});
      }
      if (::poll(fds.data(), fds.size(), 20) <= 0) continue;
      const size_t n = pairs.size();
      std::vector<bool> dead(n, false);
      for (size_t i = 0; i < n; ++i) {
        const short down = fds[1 + 2 * i].revents, up = fds[2 + 2 * i].revents;
        if (down != 0 && !Pump(pairs[i].down.get(), pairs[i].up.get())) dead[i] = true;
        if (up != 0 && !Pump(pairs[i].up.get(), pairs[i].down.get())) dead[i] = true;
      }
      for (size_t i = n; i-- > 0;) {
        if (dead[i]) pairs.erase(pairs.begin() + static_cast<ptrdiff_t>(i));
      }
      if (fds[0].revents & POLLIN) {
        Pair p;
        p.down.Reset(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC));
        p.up.Reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
        sockaddr_in sa{};
        sa.sin_family = AF_INET;
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        sa.sin_port = htons(target_port_);
        if (!p.down.valid() ||
            ::connect(p.up.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
          continue;
        }
        p.held = relayed_.fetch_add(1) < hold_;
        pairs.push_back(std::move(p));
      }
    }
  }

  const uint16_t target_port_;
  const int hold_;
  ScopedFd listen_;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> relayed_{0};
  std::thread thread_;
};

// A flood of silent connections from several addresses (the connecting peer's own among
// them) fills the data listener while a link connects: the listener drops the link's
// connection before its handshake arrived (here held back by a relay, as a slow sender's
// would be), and the connecting side connects again, with backoff, within its timeout.
TEST(TcpTransport, AConnectionAFloodDroppedBeforeItsAcknowledgementIsRetried) {
  TcpTransportOptions o;
  o.connections_per_peer = 1;
  o.connect_timeout = std::chrono::milliseconds(5000);
  auto t0 = MakeTcp(o), t1 = MakeTcp(o);
  auto nodes = MakeNodes({t0.get(), t1.get()}, 2, 64);
  const std::string d0 = nodes[0].link->LocalDescriptor();
  abi::TcpDescriptor d{};
  std::memcpy(&d, nodes[0].link->LocalDescriptorFor(1).data(), sizeof d);
  Relay relay(d.port, /*hold=*/1);
  d.port = relay.port();
  ASSERT_TRUE(nodes[1].link->Connect(0, std::string(reinterpret_cast<char*>(&d), sizeof d)).ok());
  ASSERT_TRUE(WaitFor([&] { return relay.relayed() == 1; }));
  std::vector<ScopedFd> flood;
  for (int i = 0; i < 60; ++i) flood.push_back(RawConnect(d0));
  for (uint32_t host = 2; host <= 5; ++host) {
    for (int i = 0; i < 8; ++i) flood.push_back(RawConnect(d0, INADDR_LOOPBACK - 1 + host));
  }
  EXPECT_TRUE(Refused(flood.front().get()));  // The flood overflowed the listener.
  ASSERT_TRUE(WaitFor([&] { return nodes[1].link->State(0) == PeerState::kReady; }))
      << nodes[1].link->PeerStatus(0);
  EXPECT_GE(relay.relayed(), 2);  // Connected again after the drop.
  ASSERT_TRUE(nodes[0].link->Connect(1, nodes[1].link->LocalDescriptorFor(0)).ok());
  ASSERT_TRUE(WaitFor([&] { return nodes[0].link->State(1) == PeerState::kReady; }))
      << nodes[0].link->PeerStatus(1);
  ExpectWriteLands(nodes, 0x600d600d, 16, 3);
}

// Streams of random frames (mostly well-formed headers with random kinds, sequence numbers,
// offsets and lengths, some corrupted, some cut short) from a handshaken raw peer never write
// outside the receive region and always end with that peer failed, naming it.
TEST(TcpTransport, RandomFramesStayInsideTheRegion) {
  TcpTransportOptions o;
  o.connections_per_peer = 1;
  auto t = MakeTcp(o);
  constexpr uint64_t kRegion = 4096;
  constexpr uint8_t kCanary = 0xa5;
  std::vector<uint8_t> memory(3 * kRegion, kCanary);
  uint64_t x = 88172645463325252ull;
  const auto next = [&x] {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
  };
  const uint64_t offsets[] = {0, 1, kRegion - 1, kRegion, kRegion + 1, ~uint64_t{0}, 1ull << 63};
  for (int iter = 0; iter < 300; ++iter) {
    GroupLinkOptions g;
    g.group = "fuzz";
    g.num_nodes = 2;
    g.recv_base = memory.data() + kRegion;
    g.recv_bytes = kRegion;
    auto link = t->CreateGroupLink(g);
    ASSERT_TRUE(link.ok()) << link.status();
    const std::string d = (*link)->LocalDescriptor();
    ScopedFd fd = RawConnect(d);
    SendAll(fd.get(), Handshake(**link, 1, 0, 1));
    ASSERT_TRUE(Accepted(fd.get()));
    std::string stream;
    uint64_t seq = 0;
    const int frames = 1 + static_cast<int>(next() % 8);
    for (int f = 0; f < frames; ++f) {
      const bool done = next() % 3 == 0;
      const uint64_t offset = next() % 2 ? next() % (2 * kRegion) : offsets[next() % 7];
      const uint64_t bytes = next() % 2 ? next() % 600 : offsets[next() % 7];
      abi::TcpFrameHeader h =
          abi::MakeTcpFrame(done ? abi::TcpFrameKind::kDone : abi::TcpFrameKind::kPiece,
                            next() % 8 == 0 ? next() % 4 : seq, done ? 0 : offset, done ? 0 : bytes,
                            static_cast<uint32_t>(next()));
      if (!done) h.imm = 0;
      switch (next() % 16) {
        case 0:
          h.magic ^= 1;
          break;
        case 1:
          h.version = 7;
          break;
        case 2:
          h.reserved = 1;
          break;
        case 3:
          h.kind = 9;
          break;
        default:
          break;
      }
      if (done) ++seq;
      stream.append(reinterpret_cast<const char*>(&h), sizeof h);
      if (!done) {
        const uint64_t payload = std::min<uint64_t>(bytes, next() % 2 ? bytes : next() % 700);
        for (uint64_t i = 0; i < std::min<uint64_t>(payload, 700); ++i) {
          stream.push_back(static_cast<char>(next()));
        }
      }
    }
    stream.resize(stream.size() - next() % std::min<size_t>(stream.size(), 64));  // Cut short.
    ::send(fd.get(), stream.data(), stream.size(), MSG_NOSIGNAL);
    fd.Reset();
    GroupLink& l = **link;
    ASSERT_TRUE(WaitFor([&] { return l.State(1) == PeerState::kFailed; }, std::chrono::seconds(2)))
        << "iteration " << iter;
    EXPECT_NE(l.PeerStatus(1).message().find("node 1"), absl::string_view::npos);
    for (uint64_t i = 0; i < kRegion; ++i) {
      ASSERT_EQ(memory[i], kCanary) << "iteration " << iter << ": byte " << i << " before";
      ASSERT_EQ(memory[2 * kRegion + i], kCanary)
          << "iteration " << iter << ": byte " << i << " after";
    }
  }
  auto late = MakeNodes({t.get()}, 2, 64, "late");  // The listener still serves.
  ConnectAll(late);
}

// Steady-state PostWrite / PollImm on the engine thread and the progress thread allocate
// nothing (counting operator new of tests/common/counting_new.h, defined in
// hot_path_alloc_test.cc).
TEST(TcpTransport, SteadyStateAllocatesNothing) {
  namespace counting_new = epd::testing::counting_new;
  ASSERT_TRUE(counting_new::CountingNewInForce()) << "the counting operator new is not in force";
  TcpTransportOptions o;
  o.on_progress_thread_start = [] { counting_new::MarkEngineThread(); };
  o.max_writes_in_flight = 8;
  Connected c(o, 1, 2, 1 << 16);
  auto& nodes = c.nodes;
  ASSERT_GE(counting_new::g_engine_allocs.load(), 1u) << "the progress thread is not counted";
  std::vector<uint8_t> src = RandomBytes(1 << 16, 3);
  const auto round = [&](int rounds) {
    for (int r = 0; r < rounds; ++r) {
      std::array<WritePiece, 4> pieces{};
      for (int k = 0; k < 4; ++k) {
        const uint64_t off = static_cast<uint64_t>((r * 4 + k) % 16) * 4096;
        pieces[k] = WritePiece{src.data() + off, static_cast<uint64_t>(4096 - k), off};
      }
      for (int dir = 0; dir < 2; ++dir) {
        absl::Status s;
        do {
          s = nodes[dir].link->PostWrite(1 - dir, pieces, r);
        } while (absl::IsResourceExhausted(s));
        ASSERT_TRUE(s.ok());
      }
      for (int dir = 0; dir < 2; ++dir) {
        uint32_t imm = 0;
        while (!nodes[1 - dir].link->PollImm(dir, &imm)) {
        }
        ASSERT_EQ(imm, static_cast<uint32_t>(r));
      }
    }
  };
  round(50);  // Warm-up.
  const uint64_t engine_before = counting_new::t_allocs;
  const uint64_t progress_before = counting_new::g_engine_allocs.load();
  round(500);
  EXPECT_EQ(counting_new::t_allocs - engine_before, 0u) << "PostWrite/PollImm allocated";
  EXPECT_EQ(counting_new::g_engine_allocs.load() - progress_before, 0u)
      << "the progress thread allocated";
}

// The plain-TCP yardstick moves the bytes and says how fast; the transport's rate for the
// same bytes is printed beside it (not compared: CI machines are noisy).
TEST(TcpTransport, RetransmitsAreReadFromTcpInfoOfARealSocket) {
  auto pairs = ConnectPlainTcpPairs(1, "127.0.0.1");
  ASSERT_TRUE(pairs.ok()) << pairs.status();
  // Some traffic first (well inside the socket buffers: one thread sends, then reads).
  const std::vector<uint8_t> bytes = RandomBytes(16 << 10, 3);
  ASSERT_EQ(::send((*pairs)[0].sender.get(), bytes.data(), bytes.size(), 0),
            static_cast<ssize_t>(bytes.size()))
      << std::strerror(errno);
  std::vector<uint8_t> sink(bytes.size());
  size_t got = 0;
  while (got < sink.size()) {
    const ssize_t n = ::recv((*pairs)[0].receiver.get(), sink.data() + got, sink.size() - got, 0);
    ASSERT_GT(n, 0) << std::strerror(errno);
    got += static_cast<size_t>(n);
  }
  for (const ScopedFd* fd : {&(*pairs)[0].sender, &(*pairs)[0].receiver}) {
    absl::StatusOr<uint64_t> n = TcpTotalRetransmits(fd->get());
    ASSERT_TRUE(n.ok()) << n.status();
    EXPECT_EQ(*n, 0u);  // Loopback loses nothing.
  }
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  ScopedFd rd(pipe_fds[0]), wr(pipe_fds[1]);
  absl::StatusOr<uint64_t> not_tcp = TcpTotalRetransmits(rd.get());
  EXPECT_TRUE(absl::IsInvalidArgument(not_tcp.status())) << not_tcp.status();
  EXPECT_NE(not_tcp.status().message().find("TCP_INFO"), std::string::npos);
}

TEST(TcpTransport, LinkCountersReportRetransmitsPerPeerAcrossAFailure) {
  Connected c(TcpTransportOptions{}, 2, 3, 1 << 16);
  const std::vector<uint8_t> src = RandomBytes(1 << 16, 4);
  const WritePiece piece{src.data(), src.size(), 0};
  ASSERT_TRUE(PostWriteRetrying(*c.nodes[0].link, 1, {&piece, 1}, 7).ok());
  uint32_t imm = 0;
  ASSERT_TRUE(PollImmWaiting(*c.nodes[1].link, 0, &imm));
  for (int32_t peer : {1, 2}) {
    const LinkCounters k = c.nodes[0].link->Counters(peer);
    EXPECT_EQ(k.retransmits, 0) << "peer " << peer;  // Known (TCP_INFO), none on loopback.
    EXPECT_EQ(k.error_completions, -1);              // Not a TCP notion.
  }
  EXPECT_EQ(c.nodes[0].link->Counters(0).retransmits, -1);   // Itself: no link.
  EXPECT_EQ(c.nodes[0].link->Counters(99).retransmits, -1);  // Not a node.
  // Its connections closed, the peer's count is kept.
  c.nodes[0].link->FailPeer(1, absl::UnavailableError("test"));
  EXPECT_EQ(c.nodes[0].link->Counters(1).retransmits, 0);
}

TEST(TcpTransport, PlainTcpBound) {
  EXPECT_TRUE(absl::IsInvalidArgument(MeasurePlainTcp(0, 2).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(MeasurePlainTcp(1, 0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(MeasurePlainTcp(1, 17).status()));
  constexpr uint64_t kBytes = 32ull << 20;
  auto plain = MeasurePlainTcp(kBytes + 3, 2);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->bytes, kBytes + 3);
  EXPECT_EQ(plain->connections, 2);
  EXPECT_GT(plain->seconds, 0);
  EXPECT_GT(plain->GBps(), 0);

  Connected c(TcpTransportOptions{}, 2, 2, kBytes);
  const std::vector<uint8_t> src = RandomBytes(kBytes, 5);
  std::vector<WritePiece> pieces;
  for (uint64_t off = 0; off < kBytes; off += 1 << 20)
    pieces.push_back({src.data() + off, 1 << 20, off});
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(c.nodes[0].link->PostWrite(1, pieces, 1).ok());
  uint32_t imm = 0;
  ASSERT_TRUE(PollImmWaiting(*c.nodes[1].link, 0, &imm, std::chrono::milliseconds(20000)));
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  std::cout << "same " << kBytes << " bytes over 2 connections: transport "
            << static_cast<double>(kBytes) / took.count() / 1e9 << " GB/s, plain TCP "
            << plain->GBps() << " GB/s\n";
}

}  // namespace
}  // namespace epd::transport
