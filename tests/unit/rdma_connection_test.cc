// The RDMA transport's connection logic without a device (daemon/transport/rdma/
// rdma_connection.h): the descriptor's round trip and the rejection of every malformed field
// (the bytes come from a peer daemon), the attributes and masks of each queue pair
// transition, and the peer link state machine.
#if defined(EPD_HAVE_RDMA)

#include "daemon/transport/rdma/rdma_connection.h"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "proto/abi/rdma_wire.h"

namespace epd::transport::rdma {
namespace {

constexpr int32_t kNodes = 3;
constexpr uint32_t kQps = 2;

/// Node 1's endpoint on a RoCE port; its queue pair towards node n, index i, is
/// qpn 100 + 10 n + i, psn 1000 + 10 n + i.
LocalEndpoint Local(uint8_t link_layer = IBV_LINK_LAYER_ETHERNET) {
  LocalEndpoint l;
  l.node = 1;
  l.num_nodes = kNodes;
  l.num_qps = kQps;
  l.port.link_layer = link_layer;
  l.port.mtu = IBV_MTU_4096;
  if (link_layer == IBV_LINK_LAYER_ETHERNET) {
    for (size_t i = 0; i < 16; ++i) l.port.gid[i] = static_cast<uint8_t>(0xa0 + i);
  } else {
    l.port.lid = 7;
  }
  l.recv_addr = 0x7f0000001000;
  l.recv_bytes = 1 << 20;
  l.recv_rkey = 0xabcd;
  return l;
}

std::vector<QpEndpoint> Qps() {
  std::vector<QpEndpoint> qps(kNodes * kQps);
  for (int32_t n = 0; n < kNodes; ++n) {
    for (uint32_t i = 0; i < kQps; ++i) {
      qps[n * kQps + i] = {100u + 10u * n + i, 1000u + 10u * n + i};
    }
  }
  return qps;
}

std::string Encoded(uint8_t link_layer = IBV_LINK_LAYER_ETHERNET) {
  return EncodeDescriptor(Local(link_layer), Qps());
}

abi::RdmaDescriptorHeader Header(const std::string& d) {
  abi::RdmaDescriptorHeader h{};
  std::memcpy(&h, d.data(), sizeof h);
  return h;
}
void SetHeader(std::string& d, const abi::RdmaDescriptorHeader& h) {
  std::memcpy(d.data(), &h, sizeof h);
}
void SetQp(std::string& d, int32_t node, uint32_t i, abi::RdmaQpWire w) {
  std::memcpy(d.data() + sizeof(abi::RdmaDescriptorHeader) + (node * kQps + i) * sizeof w, &w,
              sizeof w);
}

absl::StatusOr<RemoteEndpoint> Parse(const std::string& d, int32_t self = 0,
                                     uint8_t link_layer = IBV_LINK_LAYER_ETHERNET) {
  return ParseDescriptor(d, /*from=*/1, self, kNodes, kQps, link_layer);
}

TEST(RdmaDescriptor, RoundTripsForEachPeer) {
  const std::string d = Encoded();
  EXPECT_EQ(d.size(), abi::RdmaDescriptorBytes(kNodes, kQps));
  for (int32_t self : {0, 2}) {
    auto r = Parse(d, self);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->node, 1);
    EXPECT_EQ(r->num_qps, kQps);
    EXPECT_EQ(r->recv_addr, 0x7f0000001000u);
    EXPECT_EQ(r->recv_bytes, 1u << 20);
    EXPECT_EQ(r->recv_rkey, 0xabcdu);
    EXPECT_EQ(r->mtu, IBV_MTU_4096);
    EXPECT_EQ(r->link_layer, IBV_LINK_LAYER_ETHERNET);
    EXPECT_EQ(r->gid, Local().port.gid);
    for (uint32_t i = 0; i < kQps; ++i) {
      EXPECT_EQ(r->qps[i].qpn, 100u + 10u * self + i);
      EXPECT_EQ(r->qps[i].psn, 1000u + 10u * self + i);
    }
  }
  // The publisher's own entries are written as zero.
  abi::RdmaQpWire own{};
  std::memcpy(&own, d.data() + sizeof(abi::RdmaDescriptorHeader) + kQps * sizeof own, sizeof own);
  EXPECT_EQ(own.qpn, 0u);
  auto ib = Parse(Encoded(IBV_LINK_LAYER_INFINIBAND), 0, IBV_LINK_LAYER_INFINIBAND);
  ASSERT_TRUE(ib.ok()) << ib.status();
  EXPECT_EQ(ib->lid, 7);
}

// The settings every node must share, compared at rendezvous: queue pairs per peer and
// link layer differ = FAILED_PRECONDITION naming both values; what is not an RDMA
// descriptor is left to ParseDescriptor.
TEST(RdmaDescriptor, SettingsComparedAtRendezvousNameBothValues) {
  const std::string roce = Encoded();
  const auto compare = [](const std::string& ours, const std::string& theirs) {
    return CompareDescriptorSettings(ours, theirs, "node 0 (a:1)", "node 1 (b:2)");
  };
  EXPECT_TRUE(compare(roce, Encoded()).ok());
  LocalEndpoint four = Local();
  four.num_qps = 4;
  const std::string four_qps = EncodeDescriptor(four, std::vector<QpEndpoint>(kNodes * 4));
  absl::Status qps = compare(roce, four_qps);
  EXPECT_EQ(qps.code(), absl::StatusCode::kFailedPrecondition) << qps;
  EXPECT_NE(qps.message().find("rdma.qps_per_peer differs: node 0 (a:1) uses 2 queue pairs per "
                               "peer, node 1 (b:2) uses 4"),
            std::string::npos)
      << qps;
  absl::Status link = compare(roce, Encoded(IBV_LINK_LAYER_INFINIBAND));
  EXPECT_EQ(link.code(), absl::StatusCode::kFailedPrecondition) << link;
  EXPECT_NE(link.message().find("node 0 (a:1)'s port is Ethernet (RoCE), node 1 (b:2)'s is "
                                "InfiniBand"),
            std::string::npos)
      << link;
  // Short, another transport's, another wire version: for Connect to refuse.
  std::string other_version = Encoded();
  abi::RdmaDescriptorHeader h = Header(other_version);
  ++h.version;
  SetHeader(other_version, h);
  for (const std::string& theirs : {std::string("fake:1"), std::string(), other_version}) {
    EXPECT_TRUE(compare(roce, theirs).ok());
  }
}

/// One malformed descriptor: what is changed and a word the error must contain.
struct Malformed {
  const char* name;
  std::function<void(std::string&)> mutate;
  const char* expect;
};

TEST(RdmaDescriptor, RejectsEveryMalformedField) {
  using H = abi::RdmaDescriptorHeader;
  const auto header = [](std::function<void(H&)> f) {
    return [f](std::string& d) {
      H h = Header(d);
      f(h);
      SetHeader(d, h);
    };
  };
  const std::vector<Malformed> cases = {
      {"short", [](std::string& d) { d.resize(10); }, "shorter"},
      {"empty", [](std::string& d) { d.clear(); }, "shorter"},
      {"one byte more", [](std::string& d) { d.push_back('\0'); }, "bytes, want"},
      {"one byte less", [](std::string& d) { d.pop_back(); }, "bytes, want"},
      {"magic", header([](H& h) { h.magic = 0x44504354; }), "magic"},
      {"version", header([](H& h) { h.version = 2; }), "wire version 2"},
      {"node", header([](H& h) { h.node = 2; }), "node 2's"},
      {"num_nodes", header([](H& h) { h.num_nodes = 4; }), "num_nodes 4"},
      {"num_qps", header([](H& h) { h.num_qps = 3; }), "num_qps 3"},
      {"num_qps zero", header([](H& h) { h.num_qps = 0; }), "num_qps 0"},
      {"link_layer", header([](H& h) { h.link_layer = 9; }), "link_layer 9"},
      {"link_layer other", header([](H& h) {
         h.link_layer = 1;
         h.lid = 3;
       }),
       "InfiniBand"},
      {"zero gid", header([](H& h) { std::memset(h.gid, 0, sizeof h.gid); }), "zero GID"},
      {"roce lid", header([](H& h) { h.lid = 5; }), "a LID"},
      {"mtu 0", header([](H& h) { h.mtu = 0; }), "mtu 0"},
      {"mtu 6", header([](H& h) { h.mtu = 6; }), "mtu 6"},
      {"reserved", header([](H& h) { h.reserved = 1; }), "reserved"},
      {"region wraps", header([](H& h) { h.recv_addr = ~uint64_t{0} - 10; }), "wraps"},
      {"region null", header([](H& h) { h.recv_addr = 0; }), "wraps or is null"},
      {"empty region with key", header([](H& h) {
         h.recv_bytes = 0;
         h.recv_addr = 0;
       }),
       "empty receive region"},
      {"own entry set",
       [](std::string& d) {
         SetQp(d, 1, 0, {5, 0});
       },
       "own entry"},
      {"qpn 0",
       [](std::string& d) {
         SetQp(d, 0, 1, {0, 1});
       },
       "qpn 0"},
      {"qpn 2^24",
       [](std::string& d) {
         SetQp(d, 2, 0, {1u << 24, 1});
       },
       "qpn 16777216"},
      {"psn 2^24",
       [](std::string& d) {
         SetQp(d, 0, 0, {9, 1u << 24});
       },
       "psn 16777216"},
  };
  for (const Malformed& c : cases) {
    std::string d = Encoded();
    c.mutate(d);
    auto r = Parse(d);
    ASSERT_FALSE(r.ok()) << c.name;
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << c.name << ": " << r.status();
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos)
        << c.name << ": " << r.status();
    EXPECT_NE(r.status().message().find("node 1"), std::string::npos) << c.name;
  }
  // InfiniBand: a LID of 0 or a multicast LID.
  for (uint16_t lid : {uint16_t{0}, uint16_t{0xc000}}) {
    std::string d = Encoded(IBV_LINK_LAYER_INFINIBAND);
    H h = Header(d);
    h.lid = lid;
    SetHeader(d, h);
    auto r = Parse(d, 0, IBV_LINK_LAYER_INFINIBAND);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("LID"), std::string::npos) << r.status();
  }
  // A descriptor of RoCE read by an InfiniBand port.
  EXPECT_FALSE(Parse(Encoded(), 0, IBV_LINK_LAYER_INFINIBAND).ok());
}

TEST(RdmaDescriptor, RandomBytesNeverParse) {
  uint64_t x = 0x9e3779b97f4a7c15ull;
  std::string d = Encoded();
  for (int round = 0; round < 2000; ++round) {
    std::string m = d;
    for (int k = 0; k < 4; ++k) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      m[x % sizeof(abi::RdmaDescriptorHeader)] ^= static_cast<char>(1 + (x >> 32) % 255);
    }
    auto r = Parse(m);
    if (r.ok()) {
      // Only fields a peer may choose freely changed (GID bytes, region, key).
      EXPECT_EQ(r->num_qps, kQps);
      EXPECT_GE(r->mtu, IBV_MTU_256);
      EXPECT_LE(r->mtu, IBV_MTU_4096);
    } else {
      EXPECT_TRUE(absl::IsInvalidArgument(r.status()));
    }
  }
}

PathOptions Path(uint8_t link_layer = IBV_LINK_LAYER_ETHERNET) {
  PathOptions p;
  p.port = 2;
  p.gid_index = 3;
  p.link_layer = link_layer;
  p.mtu = IBV_MTU_4096;
  p.service_level = 5;
  p.traffic_class = 106;
  p.timeout = 17;
  p.retry_count = 6;
  p.rnr_retry = 7;
  return p;
}

TEST(RdmaQpTransition, InitSetsPortAndRemoteWriteAccess) {
  const QpTransition t = InitTransition(Path());
  EXPECT_EQ(t.mask, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  EXPECT_EQ(t.attr.qp_state, IBV_QPS_INIT);
  EXPECT_EQ(t.attr.port_num, 2);
  EXPECT_EQ(t.attr.pkey_index, 0);
  EXPECT_EQ(t.attr.qp_access_flags,
            static_cast<unsigned>(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE));
}

TEST(RdmaQpTransition, RtrOnRoceUsesTheGrh) {
  auto remote = Parse(Encoded(), 0);
  ASSERT_TRUE(remote.ok());
  remote->mtu = IBV_MTU_1024;  // The smaller end's MTU is the path's.
  const QpTransition t = RtrTransition(Path(), *remote, remote->qps[1]);
  EXPECT_EQ(t.mask, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  EXPECT_EQ(t.attr.qp_state, IBV_QPS_RTR);
  EXPECT_EQ(t.attr.path_mtu, IBV_MTU_1024);
  EXPECT_EQ(t.attr.dest_qp_num, 101u);
  EXPECT_EQ(t.attr.rq_psn, 1001u);
  EXPECT_GE(t.attr.max_dest_rd_atomic, 1);
  EXPECT_GT(t.attr.min_rnr_timer, 0);
  const ibv_ah_attr& ah = t.attr.ah_attr;
  EXPECT_EQ(ah.is_global, 1);
  EXPECT_EQ(std::memcmp(ah.grh.dgid.raw, remote->gid.data(), 16), 0);
  EXPECT_EQ(ah.grh.sgid_index, 3);
  EXPECT_EQ(ah.grh.traffic_class, 106);
  EXPECT_GT(ah.grh.hop_limit, 1);
  EXPECT_EQ(ah.sl, 5);
  EXPECT_EQ(ah.port_num, 2);
  EXPECT_EQ(ah.dlid, 0);
}

TEST(RdmaQpTransition, RtrOnInfiniBandUsesTheLid) {
  auto remote = Parse(Encoded(IBV_LINK_LAYER_INFINIBAND), 2, IBV_LINK_LAYER_INFINIBAND);
  ASSERT_TRUE(remote.ok()) << remote.status();
  const QpTransition t = RtrTransition(Path(IBV_LINK_LAYER_INFINIBAND), *remote, remote->qps[0]);
  EXPECT_EQ(t.attr.ah_attr.is_global, 0);
  EXPECT_EQ(t.attr.ah_attr.dlid, 7);
  EXPECT_EQ(t.attr.ah_attr.sl, 5);
  EXPECT_EQ(t.attr.dest_qp_num, 120u);
  EXPECT_EQ(t.attr.path_mtu, IBV_MTU_4096);
}

TEST(RdmaQpTransition, RtsSetsRetriesAndOwnPsn) {
  const QpTransition t = RtsTransition(Path(), 0x123456);
  EXPECT_EQ(t.mask, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                        IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
  EXPECT_EQ(t.attr.qp_state, IBV_QPS_RTS);
  EXPECT_EQ(t.attr.timeout, 17);
  EXPECT_EQ(t.attr.retry_cnt, 6);
  EXPECT_EQ(t.attr.rnr_retry, 7);
  EXPECT_EQ(t.attr.sq_psn, 0x123456u);
}

TEST(RdmaQpTransition, ResetAndErrorSetTheStateOnly) {
  for (ibv_qp_state s : {IBV_QPS_RESET, IBV_QPS_ERR}) {
    const QpTransition t = StateTransition(s);
    EXPECT_EQ(t.mask, IBV_QP_STATE);
    EXPECT_EQ(t.attr.qp_state, s);
  }
}

TEST(RdmaQpTransition, PathOptionsComeFromOptionsAndPort) {
  RdmaTransportOptions o;
  o.service_level = 3;
  o.traffic_class = 96;
  o.timeout = 20;
  o.retry_count = 5;
  o.rnr_retry = 4;
  PortInfo port;
  port.port = 2;
  port.gid_index = 1;
  port.link_layer = IBV_LINK_LAYER_ETHERNET;
  port.mtu = IBV_MTU_2048;
  const PathOptions p = MakePathOptions(o, port);
  EXPECT_EQ(p.port, 2u);
  EXPECT_EQ(p.gid_index, 1);
  EXPECT_EQ(p.mtu, IBV_MTU_2048);
  EXPECT_EQ(p.service_level, 3u);
  EXPECT_EQ(p.traffic_class, 96u);
  EXPECT_EQ(p.timeout, 20u);
  EXPECT_EQ(p.retry_count, 5u);
  EXPECT_EQ(p.rnr_retry, 4u);
}

using Action = PeerLinkMachine::Action;
using MClock = PeerLinkMachine::Clock;

TEST(RdmaPeerLinkMachine, ReadyOnceEveryQueuePairAnswered) {
  PeerLinkMachine m(3);
  EXPECT_EQ(m.state(), PeerState::kIdle);
  const MClock::time_point t0 = MClock::now();
  m.OnConnect(t0 + std::chrono::seconds(10));
  EXPECT_EQ(m.state(), PeerState::kConnecting);
  EXPECT_EQ(m.OnProbe(0, IBV_WC_SUCCESS, t0), Action::kNone);
  EXPECT_EQ(m.OnProbe(0, IBV_WC_SUCCESS, t0), Action::kNone);  // Twice counts once.
  EXPECT_EQ(m.OnProbe(2, IBV_WC_SUCCESS, t0), Action::kNone);
  EXPECT_EQ(m.probed(), 2u);
  EXPECT_EQ(m.state(), PeerState::kConnecting);
  EXPECT_EQ(m.OnProbe(1, IBV_WC_SUCCESS, t0), Action::kReady);
  EXPECT_EQ(m.state(), PeerState::kReady);
  // A late success changes nothing; a late error fails the ready peer.
  EXPECT_EQ(m.OnProbe(1, IBV_WC_SUCCESS, t0), Action::kNone);
  EXPECT_EQ(m.OnTick(t0 + std::chrono::hours(1)), Action::kNone);
  EXPECT_EQ(m.OnProbe(0, IBV_WC_RETRY_EXC_ERR, t0), Action::kFail);
  EXPECT_EQ(m.state(), PeerState::kFailed);
}

TEST(RdmaPeerLinkMachine, InitiatorProbesAgainAfterAnErrorUntilTheDeadline) {
  PeerLinkMachine m(2, /*initiator=*/true);
  EXPECT_TRUE(m.initiator());
  const MClock::time_point t0 = MClock::now();
  m.OnConnect(t0 + std::chrono::seconds(1));
  // Retries exceeded (the peer is not in RTR yet), or an error from a queue pair still
  // bound to the peer's previous incarnation: probe again.
  EXPECT_EQ(m.OnProbe(0, IBV_WC_RETRY_EXC_ERR, t0), Action::kReprobe);
  EXPECT_EQ(m.OnProbe(0, IBV_WC_REM_INV_REQ_ERR, t0 + std::chrono::milliseconds(500)),
            Action::kReprobe);
  EXPECT_EQ(m.reprobes(), 2u);
  EXPECT_EQ(m.last_error(), IBV_WC_REM_INV_REQ_ERR);
  EXPECT_EQ(m.state(), PeerState::kConnecting);
  EXPECT_EQ(m.OnTick(t0 + std::chrono::milliseconds(999)), Action::kNone);
  EXPECT_EQ(m.OnProbe(1, IBV_WC_RETRY_EXC_ERR, t0 + std::chrono::seconds(1)), Action::kFail);
  EXPECT_EQ(m.state(), PeerState::kFailed);
  m.OnConnect(t0 + std::chrono::seconds(5));
  EXPECT_EQ(m.last_error(), IBV_WC_SUCCESS);
  EXPECT_EQ(m.reprobes(), 0u);
}

TEST(RdmaPeerLinkMachine, ResponderProbesBackOnlyAfterThePeersProbe) {
  PeerLinkMachine m(2, /*initiator=*/false);
  EXPECT_FALSE(m.initiator());
  const MClock::time_point t0 = MClock::now();
  m.OnConnect(t0 + std::chrono::seconds(10));
  EXPECT_FALSE(m.peer_probed(0));
  EXPECT_EQ(m.OnPeerProbe(0), Action::kSendProbe);
  EXPECT_TRUE(m.peer_probed(0));
  EXPECT_EQ(m.OnPeerProbe(0), Action::kNone);  // Once per queue pair.
  EXPECT_EQ(m.OnProbe(0, IBV_WC_SUCCESS, t0), Action::kNone);
  EXPECT_EQ(m.OnPeerProbe(1), Action::kSendProbe);
  EXPECT_EQ(m.OnProbe(1, IBV_WC_SUCCESS, t0), Action::kReady);
  // The responder's probe went to a queue pair that was up: any error fails at once.
  PeerLinkMachine r(1, /*initiator=*/false);
  r.OnConnect(t0 + std::chrono::seconds(10));
  EXPECT_EQ(r.OnPeerProbe(0), Action::kSendProbe);
  EXPECT_EQ(r.OnProbe(0, IBV_WC_RETRY_EXC_ERR, t0), Action::kFail);
  EXPECT_EQ(r.state(), PeerState::kFailed);
  // The initiator swallows the peer's probe without answering; Connect clears it.
  PeerLinkMachine i(1, /*initiator=*/true);
  i.OnConnect(t0 + std::chrono::seconds(10));
  EXPECT_EQ(i.OnPeerProbe(0), Action::kNone);
  EXPECT_TRUE(i.peer_probed(0));
  i.OnConnect(t0 + std::chrono::seconds(10));
  EXPECT_FALSE(i.peer_probed(0));
}

TEST(RdmaPeerLinkMachine, TheDeadlineFailsAndFailedStaysFailed) {
  PeerLinkMachine m(1);
  const MClock::time_point t0 = MClock::now();
  m.OnConnect(t0 + std::chrono::milliseconds(5));
  EXPECT_EQ(m.OnTick(t0), Action::kNone);
  EXPECT_EQ(m.OnTick(t0 + std::chrono::milliseconds(5)), Action::kFail);
  EXPECT_EQ(m.state(), PeerState::kFailed);
  // Failed stays failed (a probe answer of the old life changes nothing) until Connect.
  EXPECT_EQ(m.OnProbe(0, IBV_WC_SUCCESS, t0), Action::kNone);
  EXPECT_EQ(m.state(), PeerState::kFailed);
  m.OnConnect(t0 + std::chrono::seconds(10));
  EXPECT_EQ(m.state(), PeerState::kConnecting);
  EXPECT_EQ(m.probed(), 0u);
  EXPECT_EQ(m.OnProbe(0, IBV_WC_SUCCESS, t0), Action::kReady);
  m.OnFail();
  EXPECT_EQ(m.state(), PeerState::kFailed);
}

TEST(RdmaPeerLinkMachine, ProbeOfNoQueuePairIsIgnored) {
  PeerLinkMachine m(2);
  m.OnConnect(MClock::now() + std::chrono::seconds(1));
  EXPECT_EQ(m.OnProbe(5, IBV_WC_SUCCESS, MClock::now()), Action::kNone);
  EXPECT_EQ(m.probed(), 0u);
}

}  // namespace
}  // namespace epd::transport::rdma

#endif  // EPD_HAVE_RDMA
