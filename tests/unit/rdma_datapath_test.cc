// The RDMA transport's device-free data path and device logic (daemon/transport/rdma/
// rdma_datapath.h, rdma_device.h, rdma_memory.h): how writes become work requests (every
// byte once, on the queue pair of its stripe, the immediate last on every queue pair),
// signalling, error completions as statuses, option validation, queue planning against
// device limits, MTU choice and the source-region lookup.
#if defined(EPD_HAVE_RDMA)

#include "daemon/transport/rdma/rdma_datapath.h"

#include <gtest/gtest.h>

#include <array>
#include <map>
#include <string>
#include <vector>

#include "daemon/transport/rdma/rdma_device.h"
#include "daemon/transport/rdma/rdma_memory.h"

namespace epd::transport::rdma {
namespace {

/// Every work request of a write on every queue pair, as the transport would post them.
struct Planned {
  std::vector<std::vector<PlannedWr>> per_qp;
};

Planned Plan(const std::vector<WritePiece>& pieces, uint64_t stripe, uint32_t num_qps) {
  std::array<uint32_t, 16> counts{};
  CountWrs(pieces, stripe, num_qps, counts);
  Planned p;
  p.per_qp.resize(num_qps);
  for (uint32_t q = 0; q < num_qps; ++q) {
    PlanQpWrs(pieces, stripe, num_qps, q, counts[q],
              [&](const PlannedWr& w) { p.per_qp[q].push_back(w); });
    EXPECT_EQ(p.per_qp[q].size(), std::max<uint32_t>(counts[q], 1)) << "queue pair " << q;
  }
  return p;
}

/// Checks that the plan covers every byte of `pieces` once, on the queue pair of its stripe,
/// within the stripe, and that each queue pair's last work request (only) has the immediate.
void CheckPlan(const std::vector<WritePiece>& pieces, uint64_t stripe, uint32_t num_qps,
               const Planned& p) {
  std::map<uint64_t, uint64_t> covered;  // remote offset -> bytes
  for (uint32_t q = 0; q < num_qps; ++q) {
    const auto& wrs = p.per_qp[q];
    ASSERT_FALSE(wrs.empty());
    for (size_t i = 0; i < wrs.size(); ++i) {
      const PlannedWr& w = wrs[i];
      EXPECT_EQ(w.with_imm, i + 1 == wrs.size()) << "queue pair " << q << " wr " << i;
      if (w.piece == kNoPiece) {
        EXPECT_EQ(wrs.size(), 1u);
        EXPECT_EQ(w.bytes, 0u);
        continue;
      }
      ASSERT_LT(w.piece, pieces.size());
      const WritePiece& piece = pieces[w.piece];
      ASSERT_GT(w.bytes, 0u);
      ASSERT_LE(w.offset + w.bytes, piece.bytes);
      const uint64_t at = piece.remote_offset + w.offset;
      EXPECT_EQ(StripeQp(at, stripe, num_qps), q);
      EXPECT_EQ(at / stripe, (at + w.bytes - 1) / stripe) << "crosses a stripe";
      EXPECT_TRUE(covered.emplace(at, w.bytes).second) << "offset " << at << " twice";
    }
  }
  uint64_t total = 0;
  for (const WritePiece& w : pieces) total += w.bytes;
  uint64_t sum = 0;
  for (const auto& [at, bytes] : covered) sum += bytes;
  EXPECT_EQ(sum, total);
}

TEST(RdmaPlan, OneQueuePairOneWorkRequestPerPiece) {
  const std::vector<WritePiece> pieces = {
      {reinterpret_cast<void*>(0x1000), 100, 0},
      {reinterpret_cast<void*>(0x2000), 0, 50},  // Empty: nothing.
      {reinterpret_cast<void*>(0x3000), 4096, 8192},
  };
  const Planned p = Plan(pieces, StripeBytes(1), 1);
  ASSERT_EQ(p.per_qp[0].size(), 2u);
  EXPECT_EQ(p.per_qp[0][0].piece, 0u);
  EXPECT_FALSE(p.per_qp[0][0].with_imm);
  EXPECT_EQ(p.per_qp[0][1].piece, 2u);
  EXPECT_TRUE(p.per_qp[0][1].with_imm);
  CheckPlan(pieces, StripeBytes(1), 1, p);
}

TEST(RdmaPlan, NoPiecesIsOneZeroLengthImmediatePerQueuePair) {
  const Planned p = Plan({}, kStripeBytes, 4);
  for (const auto& wrs : p.per_qp) {
    ASSERT_EQ(wrs.size(), 1u);
    EXPECT_EQ(wrs[0].piece, kNoPiece);
    EXPECT_TRUE(wrs[0].with_imm);
  }
}

TEST(RdmaPlan, PiecesAreCutAtStripesAndEveryByteGoesOnce) {
  const uint64_t stripe = 4096;
  const std::vector<WritePiece> pieces = {
      {reinterpret_cast<void*>(0x10000), 10000, 1000},   // Crosses 3 stripes.
      {reinterpret_cast<void*>(0x90000), 1, 4095},       // The last byte of stripe 0.
      {reinterpret_cast<void*>(0xa0000), 4096, 40960},   // Exactly stripe 10.
      {reinterpret_cast<void*>(0xb0000), 12288, 20000},  // Unaligned, 4 stripes.
  };
  for (uint32_t qps : {1u, 2u, 3u, 16u}) {
    const Planned p = Plan(pieces, stripe, qps);
    CheckPlan(pieces, stripe, qps, p);
  }
  // With 2 queue pairs, stripe k goes on k % 2: the first piece's three parts alternate.
  const Planned p = Plan({pieces[0]}, stripe, 2);
  ASSERT_EQ(p.per_qp[0].size(), 2u);  // [1000, 4096) and [8192, 11000).
  ASSERT_EQ(p.per_qp[1].size(), 1u);  // [4096, 8192).
  EXPECT_EQ(p.per_qp[0][0].offset, 0u);
  EXPECT_EQ(p.per_qp[0][0].bytes, 3096u);
  EXPECT_EQ(p.per_qp[1][0].offset, 3096u);
  EXPECT_EQ(p.per_qp[1][0].bytes, 4096u);
  EXPECT_EQ(p.per_qp[0][1].offset, 7192u);
  EXPECT_EQ(p.per_qp[0][1].bytes, 2808u);
}

TEST(RdmaPlan, TheSameRemoteByteAlwaysTakesTheSameQueuePair) {
  // Two writes touching the same bytes through different pieces: each byte's queue pair is
  // a function of its offset only, so the later write's bytes land after the earlier's.
  const uint64_t stripe = kStripeBytes;
  for (uint64_t off : {uint64_t{0}, stripe - 1, stripe, 5 * stripe + 17}) {
    EXPECT_EQ(StripeQp(off, stripe, 4), (off / stripe) % 4);
  }
  const std::vector<WritePiece> a = {{reinterpret_cast<void*>(0x1), 3 * stripe, 0}};
  const std::vector<WritePiece> b = {{reinterpret_cast<void*>(0x2), 100, stripe + 5}};
  const Planned pa = Plan(a, stripe, 2);
  const Planned pb = Plan(b, stripe, 2);
  ASSERT_EQ(pb.per_qp[1].size(), 1u);
  EXPECT_EQ(pb.per_qp[0][0].piece, kNoPiece);
  bool found = false;
  for (const PlannedWr& w : pa.per_qp[1])
    found |= w.offset <= stripe + 5 && w.offset + w.bytes >= stripe + 105;
  EXPECT_TRUE(found);
}

TEST(RdmaPlan, LargePieceOnOneQueuePairIsCutToBoundAWorkRequest) {
  const std::vector<WritePiece> pieces = {{reinterpret_cast<void*>(0x1), 3 * kMaxWrBytes + 5, 0}};
  std::array<uint32_t, 16> counts{};
  CountWrs(pieces, StripeBytes(1), 1, counts);
  EXPECT_EQ(counts[0], 4u);
}

TEST(RdmaPlan, SignalsTheLastOfAWriteAndOneOfEveryN) {
  EXPECT_TRUE(Signalled(0, 64, true));
  EXPECT_FALSE(Signalled(0, 64, false));
  EXPECT_TRUE(Signalled(63, 64, false));
  EXPECT_FALSE(Signalled(64, 64, false));
  EXPECT_TRUE(Signalled(127, 64, false));
  for (uint64_t i = 0; i < 10; ++i) EXPECT_TRUE(Signalled(i, 1, false));
}

TEST(RdmaCompletion, ErrorsMapToStatusesNamingThePeer) {
  const std::string peer = "group 'g': node 2 (10.0.0.3:7100, ranks 8-11; rdma GID fe80::1)";
  struct Case {
    ibv_wc_status status;
    absl::StatusCode code;
  };
  const Case cases[] = {
      {IBV_WC_RETRY_EXC_ERR, absl::StatusCode::kUnavailable},
      {IBV_WC_RNR_RETRY_EXC_ERR, absl::StatusCode::kUnavailable},
      {IBV_WC_WR_FLUSH_ERR, absl::StatusCode::kUnavailable},
      {IBV_WC_REM_ABORT_ERR, absl::StatusCode::kUnavailable},
      {IBV_WC_REM_ACCESS_ERR, absl::StatusCode::kDataLoss},
      {IBV_WC_REM_INV_REQ_ERR, absl::StatusCode::kDataLoss},
      {IBV_WC_REM_OP_ERR, absl::StatusCode::kDataLoss},
      {IBV_WC_LOC_PROT_ERR, absl::StatusCode::kInternal},
      {IBV_WC_LOC_LEN_ERR, absl::StatusCode::kInternal},
      {IBV_WC_LOC_QP_OP_ERR, absl::StatusCode::kInternal},
      {IBV_WC_GENERAL_ERR, absl::StatusCode::kInternal},
  };
  for (const Case& c : cases) {
    const absl::Status s = WcStatusToStatus(c.status, 0x81, peer, 1, false);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_NE(s.message().find(peer), std::string::npos) << s;
    EXPECT_NE(s.message().find(ibv_wc_status_str(c.status)), std::string::npos) << s;
    EXPECT_NE(s.message().find("queue pair 1 (send)"), std::string::npos) << s;
    EXPECT_NE(s.message().find("0x81"), std::string::npos) << s;
  }
  EXPECT_NE(WcStatusToStatus(IBV_WC_RETRY_EXC_ERR, 0, peer, 0, false).message().find("gone"),
            std::string::npos);
  EXPECT_NE(WcStatusToStatus(IBV_WC_WR_FLUSH_ERR, 0, peer, 3, true).message().find("(receive)"),
            std::string::npos);
  EXPECT_TRUE(WcStatusToStatus(IBV_WC_SUCCESS, 0, peer, 0, false).ok());
}

RdmaTransportOptions ValidOptions() {
  RdmaTransportOptions o;
  o.ports.push_back(RdmaPort{"mlx5_0", 1, 3, {0, 1}});
  return o;
}

TEST(RdmaCompletion, ErrorCompletionsCountEveryErrorButFlushes) {
  EXPECT_FALSE(CountsAsErrorCompletion(IBV_WC_SUCCESS));
  EXPECT_FALSE(CountsAsErrorCompletion(IBV_WC_WR_FLUSH_ERR));  // Follows the error counted.
  for (ibv_wc_status s : {IBV_WC_RETRY_EXC_ERR, IBV_WC_RNR_RETRY_EXC_ERR, IBV_WC_REM_ACCESS_ERR,
                          IBV_WC_LOC_PROT_ERR, IBV_WC_REM_ABORT_ERR, IBV_WC_RESP_TIMEOUT_ERR}) {
    EXPECT_TRUE(CountsAsErrorCompletion(s)) << ibv_wc_status_str(s);
  }
}

TEST(RdmaOptions, DefaultsWithAPortAreValid) {
  EXPECT_TRUE(ValidateRdmaOptions(ValidOptions()).ok());
  RdmaTransportOptions o = ValidOptions();
  o.ports.push_back(RdmaPort{"mlx5_0", 2, 0, {}});  // Dual-port card.
  o.ports.push_back(RdmaPort{"mlx5_1", 1, 0, {}});
  o.mtu = 4096;
  o.gpudirect = GpuDirectMode::kOff;
  EXPECT_TRUE(ValidateRdmaOptions(o).ok());
}

TEST(RdmaOptions, EveryRangeIsCheckedAndNamed) {
  struct Case {
    const char* name;
    std::function<void(RdmaTransportOptions&)> mutate;
  };
  const std::vector<Case> cases = {
      {"ports", [](RdmaTransportOptions& o) { o.ports.clear(); }},
      {"ports[0].device", [](RdmaTransportOptions& o) { o.ports[0].device.clear(); }},
      {"ports[0].device", [](RdmaTransportOptions& o) { o.ports[0].device.assign(100, 'x'); }},
      {"ports[0].port 0", [](RdmaTransportOptions& o) { o.ports[0].port = 0; }},
      {"ports[0].port 256", [](RdmaTransportOptions& o) { o.ports[0].port = 256; }},
      {"ports[0].gid_index -1", [](RdmaTransportOptions& o) { o.ports[0].gid_index = -1; }},
      {"ports[0].gid_index 256", [](RdmaTransportOptions& o) { o.ports[0].gid_index = 256; }},
      {"cuda_devices entry -2", [](RdmaTransportOptions& o) { o.ports[0].cuda_devices = {-2}; }},
      {"listed twice", [](RdmaTransportOptions& o) { o.ports.push_back(o.ports[0]); }},
      {"service_level 16", [](RdmaTransportOptions& o) { o.service_level = 16; }},
      {"traffic_class 256", [](RdmaTransportOptions& o) { o.traffic_class = 256; }},
      {"timeout 0", [](RdmaTransportOptions& o) { o.timeout = 0; }},
      {"timeout 32", [](RdmaTransportOptions& o) { o.timeout = 32; }},
      {"retry_count 8", [](RdmaTransportOptions& o) { o.retry_count = 8; }},
      {"rnr_retry 8", [](RdmaTransportOptions& o) { o.rnr_retry = 8; }},
      {"qps_per_peer 0", [](RdmaTransportOptions& o) { o.qps_per_peer = 0; }},
      {"qps_per_peer 17", [](RdmaTransportOptions& o) { o.qps_per_peer = 17; }},
      {"max_send_wr 1", [](RdmaTransportOptions& o) { o.max_send_wr = 1; }},
      {"cq_depth 4", [](RdmaTransportOptions& o) { o.cq_depth = 4; }},
      {"connect_timeout_ms 0", [](RdmaTransportOptions& o) { o.connect_timeout_ms = 0; }},
      {"mtu 1500", [](RdmaTransportOptions& o) { o.mtu = 1500; }},
      {"gpudirect 7", [](RdmaTransportOptions& o) { o.gpudirect = static_cast<GpuDirectMode>(7); }},
  };
  for (const Case& c : cases) {
    RdmaTransportOptions o = ValidOptions();
    c.mutate(o);
    const absl::Status s = ValidateRdmaOptions(o);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << c.name << ": " << s;
    EXPECT_NE(s.message().find(c.name), std::string::npos) << c.name << ": " << s;
  }
}

TEST(RdmaOptions, QueuesArePlannedAgainstTheDevice) {
  RdmaTransportOptions o = ValidOptions();  // 1024 send WRs, 4096 CQEs, 2 QPs per peer.
  DeviceCaps caps{32768, 4194303, 1 << 17, 1 << 16};
  auto plan = PlanQueues(o, caps);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->send_wr, 1024u);
  EXPECT_EQ(plan->recv_wr, 1024u);
  EXPECT_EQ(plan->cq_depth, 4096u);
  EXPECT_GE(plan->signal_every, 1u);
  EXPECT_LE(plan->signal_every, plan->send_wr / 2);

  caps.max_qp_wr = 512;  // The device's queue limit caps max_send_wr.
  plan = PlanQueues(o, caps);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->send_wr, 512u);
  EXPECT_EQ(plan->cq_depth, 2048u);

  caps.max_qp_wr = 32768;
  caps.max_cqe = 1000;  // The completion queue bounds the queues: 2 QPs x (s + r) <= 1000.
  plan = PlanQueues(o, caps);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->send_wr, 250u);
  EXPECT_LE(2 * (plan->send_wr + plan->recv_wr), 1000u);

  o.qps_per_peer = 16;
  o.cq_depth = 32;
  caps.max_cqe = 1 << 20;
  const absl::Status small = PlanQueues(o, caps).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(small)) << small;
  EXPECT_NE(small.message().find("cq_depth"), std::string::npos) << small;
}

TEST(RdmaOptions, MtuIsChosenWithinThePort) {
  EXPECT_EQ(*MtuFromBytes(4096), IBV_MTU_4096);
  EXPECT_EQ(*MtuFromBytes(256), IBV_MTU_256);
  EXPECT_FALSE(MtuFromBytes(9000).ok());
  EXPECT_EQ(MtuBytes(IBV_MTU_2048), 2048u);
  EXPECT_EQ(MtuBytes(0), 0u);
  EXPECT_EQ(*ChooseMtu(0, IBV_MTU_1024, "p"), IBV_MTU_1024);
  EXPECT_EQ(*ChooseMtu(512, IBV_MTU_1024, "p"), IBV_MTU_512);
  const absl::Status big = ChooseMtu(4096, IBV_MTU_1024, "rdma device mlx5_0 port 1").status();
  EXPECT_TRUE(absl::IsInvalidArgument(big));
  EXPECT_NE(big.message().find("mlx5_0 port 1"), std::string::npos) << big;
}

TEST(RdmaRegions, SourcesAreFoundOnlyWholeInARegion) {
  const std::vector<RegisteredRegion> regions = {{0x1000, 0x2000, 11, 12},
                                                 {0x8000, 0x9000, 21, 22}};
  const auto at = [](uint64_t a) { return reinterpret_cast<const void*>(a); };
  ASSERT_NE(FindRegion(regions, at(0x1000), 0x1000), nullptr);
  EXPECT_EQ(FindRegion(regions, at(0x1000), 0x1000)->lkey, 11u);
  EXPECT_EQ(FindRegion(regions, at(0x8ff0), 0x10)->lkey, 21u);
  EXPECT_EQ(FindRegion(regions, at(0x1ff0), 0x11), nullptr);  // One byte past the end.
  EXPECT_EQ(FindRegion(regions, at(0xfff), 1), nullptr);
  EXPECT_EQ(FindRegion(regions, at(0x3000), 1), nullptr);
  EXPECT_EQ(FindRegion(regions, at(0x1000), ~uint64_t{0}), nullptr);
  EXPECT_EQ(FindRegion({}, at(0x1000), 1), nullptr);
  // Memory registered anew where a stale registration still lies: the latest wins.
  const std::vector<RegisteredRegion> twice = {{0x1000, 0x2000, 11, 12}, {0x1000, 0x3000, 31, 32}};
  EXPECT_EQ(FindRegion(twice, at(0x1800), 0x10)->lkey, 31u);
}

TEST(RdmaRegions, OnlyCudaDeviceRegionsAreExportedAsDmabuf) {
  std::vector<char> host(4096);
  const absl::Status h =
      ExportCudaDmabuf(MemoryRegion{host.data(), host.size(), MemoryKind::kHost, -1}, "region")
          .status();
  EXPECT_TRUE(absl::IsInvalidArgument(h)) << h;
  const absl::Status empty =
      ExportCudaDmabuf(MemoryRegion{nullptr, 0, MemoryKind::kCudaDevice, 0}, "region").status();
  EXPECT_TRUE(absl::IsInvalidArgument(empty)) << empty;
#if !defined(EPD_HAVE_CUDA)
  const absl::Status s =
      ExportCudaDmabuf(MemoryRegion{host.data(), 64, MemoryKind::kCudaDevice, 0}, "region")
          .status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("without CUDA"), std::string::npos) << s;
  EXPECT_TRUE(absl::IsFailedPrecondition(CudaDmabufUsable({})));
#endif
}

}  // namespace
}  // namespace epd::transport::rdma

#endif  // EPD_HAVE_RDMA
