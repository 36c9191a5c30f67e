// `epctl status` from a fake GetStats: the transports line, the NIC table (device:port,
// state, link layer, rate, GID index, NUMA, GPUs by ordinal, GPUDirect, used) and the
// preflight lines; --json carries the same fields.
#include "client/epctl/format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace epd::epctl {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

v1::GetStatsResponse FakeStats() {
  v1::GetStatsResponse s;
  s.set_version("0.test");
  s.set_backend("cuda");
  s.set_peer_address("10.0.0.2:7100");
  s.add_transports("tcp");
  s.add_transports("rdma");
  for (int i = 0; i < 2; ++i) {
    v1::GpuInfo* g = s.add_gpus();
    g->set_ordinal(i);
    g->set_uuid("GPU-" + std::to_string(i));
  }
  v1::NicInfo* a = s.add_nics();
  a->set_device("mlx5_0");
  a->set_port(1);
  a->set_state("ACTIVE");
  a->set_link_layer("Ethernet");
  a->set_rate_gbps(400);
  a->set_gid_index(3);
  a->set_gid("::ffff:10.0.0.2");
  a->set_numa_node(0);
  a->set_pci_bus_id("0000:1a:00.0");
  a->add_gpu_uuids("GPU-0");
  a->add_gpu_uuids("GPU-1");
  a->set_selected(true);
  a->set_gpudirect(true);
  v1::NicInfo* b = s.add_nics();
  b->set_device("mlx5_0");
  b->set_port(2);
  b->set_state("DOWN");
  b->set_link_layer("Ethernet");
  b->set_gid_index(-1);
  b->set_numa_node(-1);
  b->add_gpu_uuids("GPU-unknown");
  s.add_preflight("warn: RDMA: RLIMIT_MEMLOCK is 4 GiB; set LimitMEMLOCK=infinity in the unit");
  s.add_preflight("refuse: RDMA: port mlx5_0:2 is DOWN, not ACTIVE; bring its link up");
  return s;
}

TEST(EpctlStatusTest, UnsupportedGpuIsMarkedWithTheReason) {
  v1::GetStatsResponse s = FakeStats();
  s.mutable_gpus(0)->set_supported(true);
  s.mutable_gpus(1)->set_compute_capability_major(7);
  s.mutable_gpus(1)->set_compute_capability_minor(5);
  s.mutable_gpus(1)->set_unsupported_reason("GPU 1 (T4) has compute capability 7.5 (sm_75)");
  const std::string out = FormatStatus(s, "unix:///x");
  EXPECT_THAT(out, HasSubstr("7.5 (unsupported)"));
  EXPECT_THAT(out, HasSubstr("  GPU 1 (T4) has compute capability 7.5 (sm_75)\n"));
  EXPECT_EQ(out.find("0.0 (unsupported)"), std::string::npos);
}

TEST(EpctlStatusTest, NicTableAndPreflight) {
  const std::string out = FormatStatus(FakeStats(), "unix:///run/epd/epd.sock");
  EXPECT_THAT(out, HasSubstr("transports: tcp, rdma\n"));
  EXPECT_THAT(out, HasSubstr("NICs: 2\n"));
  EXPECT_THAT(out, AllOf(HasSubstr("PORT"), HasSubstr("STATE"), HasSubstr("LINK"),
                         HasSubstr("RATE"), HasSubstr("GID INDEX"), HasSubstr("NUMA"),
                         HasSubstr("GPUS"), HasSubstr("GPUDIRECT")));
  EXPECT_THAT(
      out, ::testing::ContainsRegex("mlx5_0:1 +ACTIVE +Ethernet +400 Gb/s +3 +::ffff:10.0.0.2 +0 +"
                                    "0000:1a:00.0 +0,1 +yes +yes"));
  EXPECT_THAT(out, ::testing::ContainsRegex(
                       "mlx5_0:2 +DOWN +Ethernet +- +none +- +- +- +GPU-unknown +no +no"));
  EXPECT_THAT(out, HasSubstr("preflight: 2 problem(s) (1 refusing rdma, 1 warning)\n"
                             "  warn: RDMA: RLIMIT_MEMLOCK is 4 GiB; set LimitMEMLOCK=infinity in "
                             "the unit\n"
                             "  refuse: RDMA: port mlx5_0:2 is DOWN"));
}

TEST(EpctlStatusTest, TransportsNameTheDefault) {
  v1::GetStatsResponse s = FakeStats();
  s.mutable_effective_config()->set_transport("rdma");
  EXPECT_THAT(FormatStatus(s, "unix:///x"), HasSubstr("transports: tcp, rdma (default: rdma)\n"));
}

TEST(EpctlStatusTest, NothingToShow) {
  v1::GetStatsResponse s;
  const std::string out = FormatStatus(s, "unix:///x");
  EXPECT_THAT(out,
              AllOf(HasSubstr("GPUs: none\n"), HasSubstr("transports: none (peer listener off)\n"),
                    HasSubstr("NICs: none\n"), HasSubstr("preflight: ok\n")));
  EXPECT_THAT(out, Not(HasSubstr("PORT")));
}

TEST(EpctlStatusTest, JsonCarriesNicsPreflightAndTransports) {
  const std::string json = JsonOutput(FakeStats());
  EXPECT_THAT(json, AllOf(HasSubstr("\"nics\""), HasSubstr("\"device\": \"mlx5_0\""),
                          HasSubstr("\"gid_index\": 3"), HasSubstr("\"gpudirect\": true"),
                          HasSubstr("\"preflight\""), HasSubstr("\"transports\"")));
}

}  // namespace
}  // namespace epd::epctl
