// The RDMA transport end to end (daemon/transport/rdma/): on a machine without an RDMA
// device, MakeRdmaTransport answers a clean UNAVAILABLE naming the device; built without
// RDMA, UNIMPLEMENTED. With a device (port 1 of the first one; EPD_RDMA_TEST_DEVICE and
// EPD_RDMA_TEST_GID_INDEX choose others), links of one group on one transport stand in for
// nodes over the loopback of the port: exact bytes, immediate order, flow control, failing
// a peer, a new incarnation, and no allocation on the steady-state path. Those tests skip
// with the reason where there is no device.
#include "daemon/transport/rdma/rdma_transport.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(EPD_HAVE_RDMA)
#include <infiniband/verbs.h>
#endif

#include "tests/common/counting_new.h"
#include "tests/unit/transport_nodes.h"

namespace epd::transport {
namespace {

#if !defined(EPD_HAVE_RDMA)

TEST(RdmaTransport, NotBuiltIsUnimplemented) {
  RdmaTransportOptions o;
  o.ports.push_back(RdmaPort{"mlx5_0", 1, 0, {}});
  const absl::Status s = MakeRdmaTransport(o).status();
  EXPECT_TRUE(absl::IsUnimplemented(s)) << s;
  EXPECT_NE(s.message().find("tcp"), std::string::npos) << s;
}

#else

using testing::PollImmWaiting;
using testing::PostWriteRetrying;
using testing::WaitFor;

/// The number of RDMA devices here (ibv_get_device_list).
int DeviceCount(std::string* first) {
  int num = 0;
  ibv_device** list = ibv_get_device_list(&num);
  if (list == nullptr) return 0;
  if (num > 0 && first != nullptr) *first = ibv_get_device_name(list[0]);
  ibv_free_device_list(list);
  return num;
}

TEST(RdmaTransport, BadOptionsAreRefusedBeforeAnyDevice) {
  RdmaTransportOptions o;
  EXPECT_TRUE(absl::IsInvalidArgument(MakeRdmaTransport(o).status()));
  o.ports.push_back(RdmaPort{"mlx5_0", 1, 0, {}});
  o.qps_per_peer = 0;
  const absl::Status s = MakeRdmaTransport(o).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("qps_per_peer"), std::string::npos) << s;
}

TEST(RdmaTransport, NoDeviceIsUnavailableNamingIt) {
  RdmaTransportOptions o;
  o.ports.push_back(RdmaPort{"epd_no_such_dev0", 1, 0, {}});
  auto t = MakeRdmaTransport(o);
  ASSERT_FALSE(t.ok());
  EXPECT_TRUE(absl::IsUnavailable(t.status())) << t.status();
  EXPECT_NE(t.status().message().find("epd_no_such_dev0"), std::string::npos) << t.status();
  if (DeviceCount(nullptr) == 0) {
    EXPECT_NE(t.status().message().find("ibv_get_device_list returned 0 devices"),
              std::string::npos)
        << t.status();
  } else {
    EXPECT_NE(t.status().message().find("not found"), std::string::npos) << t.status();
  }
}

/// The device and GID index the device tests use, or a skip reason.
bool TestPort(RdmaPort* port, std::string* why) {
  std::string first;
  if (DeviceCount(&first) == 0) {
    *why = "no RDMA device: ibv_get_device_list returned 0 devices";
    return false;
  }
  const char* dev = std::getenv("EPD_RDMA_TEST_DEVICE");
  const char* gid = std::getenv("EPD_RDMA_TEST_GID_INDEX");
  port->device = dev != nullptr ? dev : first;
  port->port = 1;
  port->gid_index = gid != nullptr ? std::atoi(gid) : 0;
  return true;
}

/// One node of the loopback group: receive region, a send region and its link.
struct RdmaNode {
  std::vector<uint8_t> recv;
  std::vector<uint8_t> send;
  std::unique_ptr<GroupLink> link;
  std::shared_ptr<std::atomic<int> > wakes = std::make_shared<std::atomic<int> >(0);
};

class RdmaLoopback : public ::testing::Test {
 protected:
  void SetUp() override {
    RdmaPort port;
    std::string why;
    if (!TestPort(&port, &why)) GTEST_SKIP() << why;
    RdmaTransportOptions o;
    o.ports.push_back(port);
    o.qps_per_peer = 2;
    o.max_send_wr = 64;
    o.cq_depth = 1024;
    o.connect_timeout_ms = 5000;
    o.gpudirect = GpuDirectMode::kOff;
    auto t = MakeRdmaTransport(o);
    if (!t.ok() && absl::IsUnavailable(t.status())) GTEST_SKIP() << t.status();
    ASSERT_TRUE(t.ok()) << t.status();
    transport_ = std::move(*t);
  }

  /// `num` nodes with `recv_bytes` receive regions and 8 MiB send regions, connected.
  void MakeGroup(int num, uint64_t recv_bytes) {
    nodes_.resize(static_cast<size_t>(num));
    for (int i = 0; i < num; ++i) {
      RdmaNode& n = nodes_[static_cast<size_t>(i)];
      n.recv.assign(recv_bytes, 0);
      n.send.assign(8 << 20, 0);
      GroupLinkOptions lo;
      lo.group = "rg";
      lo.num_nodes = num;
      lo.self_node = i;
      lo.recv_base = n.recv.data();
      lo.recv_bytes = recv_bytes;
      lo.send_regions.push_back(MemoryRegion{n.send.data(), n.send.size(), MemoryKind::kHost, -1});
      lo.node_labels.assign(static_cast<size_t>(num), "");
      lo.node_labels[1] = "10.0.0.2:7100, ranks 4-7";
      lo.wake = [w = n.wakes] { w->fetch_add(1); };
      auto link = transport_->CreateGroupLink(lo);
      ASSERT_TRUE(link.ok()) << link.status();
      n.link = std::move(*link);
    }
    for (int i = 0; i < num; ++i) {
      for (int j = 0; j < num; ++j) {
        if (i != j) {
          ASSERT_TRUE(nodes_[i].link->Connect(j, nodes_[j].link->LocalDescriptor()).ok());
        }
      }
    }
    for (int i = 0; i < num; ++i) {
      for (int j = 0; j < num; ++j) {
        if (i == j) continue;
        GroupLink& l = *nodes_[i].link;
        ASSERT_TRUE(WaitFor([&] { return l.State(j) == PeerState::kReady; }))
            << i << " -> " << j << ": " << l.PeerStatus(j);
      }
    }
  }

  std::unique_ptr<Transport> transport_;
  std::vector<RdmaNode> nodes_;
};

TEST_F(RdmaLoopback, WritesLandExactlyAndImmediatesComeInOrder) {
  MakeGroup(3, 4 << 20);
  EXPECT_EQ(transport_->name(), "rdma");
  EXPECT_TRUE(transport_->Supports(MemoryKind::kHost));
  EXPECT_FALSE(transport_->Supports(MemoryKind::kCudaDevice));  // gpudirect off.
  for (size_t i = 0; i < nodes_[0].send.size(); ++i) {
    nodes_[0].send[i] = static_cast<uint8_t>(i * 131 + 7);
  }
  // Pieces across stripes (1 MiB), on both queue pairs, and a small one.
  const std::vector<WritePiece> pieces = {
      {nodes_[0].send.data(), 3 << 20, 100},
      {nodes_[0].send.data() + (3 << 20), 1000, (3 << 20) + 200},
  };
  for (uint32_t k = 0; k < 20; ++k) {
    ASSERT_TRUE(PostWriteRetrying(*nodes_[0].link, 1, pieces, 1000 + k).ok());
  }
  for (uint32_t k = 0; k < 20; ++k) {
    uint32_t imm = 0;
    ASSERT_TRUE(PollImmWaiting(*nodes_[1].link, 0, &imm));
    EXPECT_EQ(imm, 1000 + k);
  }
  EXPECT_EQ(std::memcmp(nodes_[1].recv.data() + 100, nodes_[0].send.data(), 3 << 20), 0);
  EXPECT_EQ(
      std::memcmp(nodes_[1].recv.data() + (3 << 20) + 200, nodes_[0].send.data() + (3 << 20), 1000),
      0);
  EXPECT_TRUE(WaitFor([&] { return nodes_[0].link->WritesCompleted(1) == 20; }));
  uint32_t imm = 0;
  EXPECT_FALSE(nodes_[2].link->PollImm(0, &imm));
  // A write of no pieces still delivers its immediate.
  ASSERT_TRUE(nodes_[2].link->PostWrite(0, {}, 77).ok());
  ASSERT_TRUE(PollImmWaiting(*nodes_[0].link, 2, &imm));
  EXPECT_EQ(imm, 77u);
}

TEST_F(RdmaLoopback, BadPiecesAreRefused) {
  MakeGroup(2, 1 << 20);
  std::vector<uint8_t> unregistered(64);
  const WritePiece outside{nodes_[0].send.data(), 100, (1 << 20) - 50};
  EXPECT_TRUE(absl::IsInvalidArgument(nodes_[0].link->PostWrite(1, {&outside, 1}, 1)));
  const WritePiece unreg{unregistered.data(), 64, 0};
  const absl::Status s = nodes_[0].link->PostWrite(1, {&unreg, 1}, 1);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("registered"), std::string::npos) << s;
  EXPECT_TRUE(absl::IsInvalidArgument(nodes_[0].link->PostWrite(0, {}, 1)));
  EXPECT_TRUE(absl::IsInvalidArgument(nodes_[0].link->Connect(1, "garbage")));
}

// Memory that comes after the link (a rank's data area): writable from once added, refused
// again once removed, and the latest registration of an address is the one used.
TEST_F(RdmaLoopback, AddedSendRegionsAreWritableUntilRemoved) {
  MakeGroup(2, 1 << 20);
  std::vector<uint8_t> area(4096);
  for (size_t i = 0; i < area.size(); ++i) area[i] = static_cast<uint8_t>(i * 7 + 3);
  const WritePiece from_area{area.data(), area.size(), 512};
  EXPECT_TRUE(absl::IsInvalidArgument(nodes_[0].link->PostWrite(1, {&from_area, 1}, 1)));
  absl::StatusOr<int> h = nodes_[0].link->AddSendRegion({area.data(), area.size()});
  ASSERT_TRUE(h.ok()) << h.status();
  absl::StatusOr<int> again = nodes_[0].link->AddSendRegion({area.data(), area.size()});
  ASSERT_TRUE(again.ok()) << again.status();
  nodes_[0].link->RemoveSendRegion(*h);  // The other registration still covers it.
  ASSERT_TRUE(PostWriteRetrying(*nodes_[0].link, 1, {&from_area, 1}, 2).ok());
  uint32_t imm = 0;
  ASSERT_TRUE(PollImmWaiting(*nodes_[1].link, 0, &imm));
  EXPECT_EQ(imm, 2u);
  EXPECT_EQ(std::memcmp(nodes_[1].recv.data() + 512, area.data(), area.size()), 0);
  EXPECT_TRUE(WaitFor([&] { return nodes_[0].link->WritesCompleted(1) == 1; }));
  nodes_[0].link->RemoveSendRegion(*again);
  nodes_[0].link->RemoveSendRegion(12345);  // Unknown: ignored.
  EXPECT_TRUE(absl::IsInvalidArgument(nodes_[0].link->PostWrite(1, {&from_area, 1}, 3)));
  EXPECT_TRUE(absl::IsInvalidArgument(nodes_[0].link->AddSendRegion({nullptr, 64}).status()));
}

TEST_F(RdmaLoopback, TooManyInFlightIsResourceExhausted) {
  MakeGroup(2, 1 << 20);
  const WritePiece w{nodes_[0].send.data(), 64, 0};
  absl::Status s;
  int posted = 0;
  for (int k = 0; k < 100000 && s.ok(); ++k) {
    s = nodes_[0].link->PostWrite(1, {&w, 1}, static_cast<uint32_t>(k));
    posted += s.ok();
  }
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(WaitFor([&] { return nodes_[0].link->WritesCompleted(1) > 0; }));
  (void)posted;
}

TEST_F(RdmaLoopback, FailPeerNamesTheNodeAndConnectAgainStartsOver) {
  MakeGroup(2, 1 << 20);
  nodes_[0].link->FailPeer(1, absl::AbortedError("given up"));
  EXPECT_EQ(nodes_[0].link->State(1), PeerState::kFailed);
  const absl::Status s = nodes_[0].link->PeerStatus(1);
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_NE(s.message().find("node 1 (10.0.0.2:7100, ranks 4-7"), std::string::npos) << s;
  EXPECT_NE(s.message().find("given up"), std::string::npos) << s;
  // The other end learns of it when it writes (its queue pairs see no answer).
  const WritePiece w{nodes_[1].send.data(), 64, 0};
  (void)nodes_[1].link->PostWrite(0, {&w, 1}, 5);
  EXPECT_TRUE(WaitFor([&] { return nodes_[1].link->State(0) == PeerState::kFailed; },
                      std::chrono::seconds(30)));
  // A new incarnation on both ends: writes flow again.
  ASSERT_TRUE(nodes_[0].link->Connect(1, nodes_[1].link->LocalDescriptor()).ok());
  ASSERT_TRUE(nodes_[1].link->Connect(0, nodes_[0].link->LocalDescriptor()).ok());
  ASSERT_TRUE(WaitFor([&] {
    return nodes_[0].link->State(1) == PeerState::kReady &&
           nodes_[1].link->State(0) == PeerState::kReady;
  }));
  ASSERT_TRUE(nodes_[1].link->PostWrite(0, {&w, 1}, 9).ok());
  uint32_t imm = 0;
  ASSERT_TRUE(PollImmWaiting(*nodes_[0].link, 1, &imm));
  EXPECT_EQ(imm, 9u);
}

TEST_F(RdmaLoopback, CloseFailsThePeers) {
  MakeGroup(2, 1 << 20);
  nodes_[0].link->Close();
  nodes_[0].link->Close();  // Idempotent.
  EXPECT_EQ(nodes_[0].link->State(1), PeerState::kFailed);
  transport_->Shutdown();
  EXPECT_EQ(nodes_[1].link->State(0), PeerState::kFailed);
  EXPECT_FALSE(transport_->CreateGroupLink(GroupLinkOptions{}).ok());
  EXPECT_TRUE(
      absl::IsFailedPrecondition(nodes_[1].link->Connect(0, nodes_[0].link->LocalDescriptor())));
}

TEST_F(RdmaLoopback, SteadyStateAllocatesNothingOnTheEngineThread) {
  namespace counting_new = epd::testing::counting_new;
  ASSERT_TRUE(counting_new::CountingNewInForce()) << "the counting operator new is not in force";
  MakeGroup(2, 1 << 20);
  const WritePiece w[2] = {{nodes_[0].send.data(), 3000, 0}, {nodes_[0].send.data(), 100, 5000}};
  const auto round = [&](uint32_t k) {
    ASSERT_TRUE(PostWriteRetrying(*nodes_[0].link, 1, w, k).ok());
    uint32_t imm = 0;
    ASSERT_TRUE(PollImmWaiting(*nodes_[1].link, 0, &imm));
    ASSERT_EQ(imm, k);
  };
  for (uint32_t k = 0; k < 200; ++k) round(k);  // Warm up.
  const uint64_t before = counting_new::t_allocs;
  for (uint32_t k = 200; k < 1200; ++k) round(k);
  EXPECT_EQ(counting_new::t_allocs - before, 0u) << "PostWrite/PollImm allocated";
}

#endif  // EPD_HAVE_RDMA

}  // namespace
}  // namespace epd::transport
