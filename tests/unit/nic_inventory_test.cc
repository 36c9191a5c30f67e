// The NIC inventory on fake sysfs trees: port states, link layers and rates, RoCE v1/v2
// GIDs (IPv4-mapped vs link-local), the GID index chosen, dual-port cards, two NICs and
// GPUs at different PCIe distances, missing files.
#include "daemon/transport/rdma/nic_inventory.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/fake_sysfs.h"

namespace epd::transport {
namespace {

using ::testing::ElementsAre;
using testing::FakeSysfs;

v1::GpuInfo Gpu(int ordinal, const std::string& uuid, const std::string& bus_id) {
  v1::GpuInfo g;
  g.set_ordinal(ordinal);
  g.set_uuid(uuid);
  g.set_pci_bus_id(bus_id);
  return g;
}

TEST(NicInventoryTest, NoInfinibandDirectoryIsNoPorts) {
  FakeSysfs fs;
  EXPECT_TRUE(ScanRdmaPorts(fs.root()).empty());
  EXPECT_TRUE(ScanRdmaPorts(fs.root() + "/does-not-exist").empty());
}

TEST(NicInventoryTest, ReadsStateLinkLayerRateNumaPciAndGids) {
  FakeSysfs fs;
  fs.AddDevice("mlx5_0", "pci0000:00/0000:00:01.0", "0000:1a:00.0", 1);
  testing::AddRocePort(fs, "mlx5_0", 1);
  std::vector<RdmaPortInfo> ports = ScanRdmaPorts(fs.root());
  ASSERT_EQ(ports.size(), 1u);
  const RdmaPortInfo& p = ports[0];
  EXPECT_EQ(p.device, "mlx5_0");
  EXPECT_EQ(p.port, 1u);
  EXPECT_EQ(p.state, "ACTIVE");
  EXPECT_EQ(p.link_layer, "Ethernet");
  EXPECT_EQ(p.rate_gbps, 100u);
  EXPECT_EQ(p.numa_node, 1);
  EXPECT_EQ(p.pci_bus_id, "0000:1a:00.0");
  EXPECT_THAT(p.pci_path, ::testing::EndsWith("/devices/pci0000:00/0000:00:01.0/0000:1a:00.0"));
  // The all-zero entry 4 is left out.
  ASSERT_EQ(p.gids.size(), 4u);
  EXPECT_EQ(p.gids[0].gid, "fe80::a00:27ff:fe00:1");
  EXPECT_FALSE(p.gids[0].ipv4_mapped);
  EXPECT_EQ(p.gids[0].type, "IB/RoCE v1");
  EXPECT_EQ(p.gids[3].gid, "::ffff:10.0.0.2");
  EXPECT_TRUE(p.gids[3].ipv4_mapped);
  EXPECT_EQ(p.gids[3].type, "RoCE v2");
}

TEST(NicInventoryTest, GidIndexIsFirstRoceV2Ipv4OnEthernetAndZeroOnInfiniband) {
  FakeSysfs fs;
  fs.AddDevice("mlx5_0", "pci0000:00", "0000:1a:00.0");
  testing::AddRocePort(fs, "mlx5_0", 1);
  fs.AddDevice("mlx5_1", "pci0000:00", "0000:1b:00.0");
  fs.AddPort("mlx5_1", 1, "4: ACTIVE", "InfiniBand", "200 Gb/sec (2X NDR)");
  fs.AddGid("mlx5_1", 1, 0, testing::kLinkLocalGid, "IB/RoCE v1");
  // Only link-local RoCE v2 GIDs: none fits.
  fs.AddDevice("mlx5_2", "pci0000:00", "0000:1c:00.0");
  fs.AddPort("mlx5_2", 1, "4: ACTIVE", "Ethernet");
  fs.AddGid("mlx5_2", 1, 0, testing::kLinkLocalGid, "IB/RoCE v1");
  fs.AddGid("mlx5_2", 1, 1, testing::kLinkLocalGid, "RoCE v2");
  // The IPv4 GID is RoCE v1 only.
  fs.AddDevice("mlx5_3", "pci0000:00", "0000:1d:00.0");
  fs.AddPort("mlx5_3", 1, "4: ACTIVE", "Ethernet");
  fs.AddGid("mlx5_3", 1, 0, testing::kIpv4MappedGid, "IB/RoCE v1");
  std::vector<RdmaPortInfo> ports = ScanRdmaPorts(fs.root());
  ASSERT_EQ(ports.size(), 4u);
  EXPECT_EQ(ChooseGidIndex(ports[0], std::nullopt), 3);
  EXPECT_EQ(ChooseGidIndex(ports[1], std::nullopt), 0);
  EXPECT_EQ(ChooseGidIndex(ports[2], std::nullopt), -1);
  EXPECT_EQ(ChooseGidIndex(ports[3], std::nullopt), -1);
  EXPECT_EQ(ChooseGidIndex(ports[0], 1u), 1);  // Configured wins.
  EXPECT_EQ(ports[1].rate_gbps, 200u);

  NicPlan plan = PlanNics(ports, v1::RdmaConfig(), {}, fs.root());
  ASSERT_EQ(plan.nics.size(), 4u);
  EXPECT_EQ(plan.nics[0].gid_index(), 3);
  EXPECT_EQ(plan.nics[0].gid(), "::ffff:10.0.0.2");
  EXPECT_EQ(plan.nics[2].gid_index(), -1);
  EXPECT_EQ(plan.nics[2].gid(), "");
}

TEST(NicInventoryTest, DualPortCardSelectionByConfigAndState) {
  FakeSysfs fs;
  fs.AddDevice("mlx5_0", "pci0000:00", "0000:1a:00.0");
  testing::AddRocePort(fs, "mlx5_0", 1);
  testing::AddRocePort(fs, "mlx5_0", 2, "1: DOWN");
  std::vector<RdmaPortInfo> ports = ScanRdmaPorts(fs.root());
  ASSERT_EQ(ports.size(), 2u);
  EXPECT_EQ(ports[1].port, 2u);
  EXPECT_EQ(ports[1].state, "DOWN");

  // Empty devices: every ACTIVE port.
  NicPlan all = PlanNics(ports, v1::RdmaConfig(), {}, fs.root());
  EXPECT_TRUE(all.nics[0].selected());
  EXPECT_FALSE(all.nics[1].selected());
  ASSERT_EQ(all.options.ports.size(), 1u);
  EXPECT_EQ(all.options.ports[0].port, 1u);

  // Listed: port 2 (even when down; the preflight says so), port 0 means 1.
  v1::RdmaConfig config;
  v1::RdmaDevicePort* d = config.add_devices();
  d->set_device("mlx5_0");
  d->set_port(2);
  NicPlan listed = PlanNics(ports, config, {}, fs.root());
  EXPECT_FALSE(listed.nics[0].selected());
  EXPECT_TRUE(listed.nics[1].selected());
  d->set_port(0);
  EXPECT_TRUE(PortSelected(ports[0], config));
  EXPECT_FALSE(PortSelected(ports[1], config));
}

TEST(NicInventoryTest, EachGpuUsesItsNearestPortAndTiesGoToTheLeastUsed) {
  FakeSysfs fs;
  // Two root complexes; NIC A and GPU 0 under one switch, NIC B and GPU 1 under another.
  fs.AddDevice("mlx5_a", "pci0000:00/0000:00:01.0/0000:01:00.0", "0000:02:00.0");
  testing::AddRocePort(fs, "mlx5_a", 1);
  fs.AddDevice("mlx5_b", "pci0000:80/0000:80:01.0/0000:81:00.0", "0000:82:00.0");
  testing::AddRocePort(fs, "mlx5_b", 1);
  fs.AddPci("pci0000:00/0000:00:01.0/0000:01:00.0", "0000:03:00.0");  // GPU 0: beside A.
  fs.AddPci("pci0000:80/0000:80:01.0/0000:81:00.0", "0000:83:00.0");  // GPU 1: beside B.
  fs.AddPci("pci0000:80/0000:80:01.0/0000:81:00.0", "0000:84:00.0");  // GPU 2: beside B.
  fs.AddPci("pci0000:40", "0000:41:00.0");                            // GPU 3: equally far.
  const std::vector<v1::GpuInfo> gpus = {
      Gpu(0, "GPU-0", "00000000:03:00.0"), Gpu(1, "GPU-1", "0000:83:00.0"),
      Gpu(2, "GPU-2", "84:00.0"), Gpu(3, "GPU-3", "0000:41:00.0"),
      Gpu(4, "GPU-4", "0000:99:00.0")};  // Not in sysfs: least used.
  std::vector<RdmaPortInfo> ports = ScanRdmaPorts(fs.root());
  ASSERT_EQ(ports.size(), 2u);
  EXPECT_LT(PciDistance(ResolvePciPath(fs.root(), "0000:03:00.0"), ports[0].pci_path),
            PciDistance(ResolvePciPath(fs.root(), "0000:03:00.0"), ports[1].pci_path));
  NicPlan plan = PlanNics(ports, v1::RdmaConfig(), gpus, fs.root());
  // GPU 3 ties (A has 1 user, B 2): A; GPU 4 is unknown, A and B have 2 each: A (first).
  EXPECT_THAT(plan.nics[0].gpu_uuids(), ElementsAre("GPU-0", "GPU-3", "GPU-4"));
  EXPECT_THAT(plan.nics[1].gpu_uuids(), ElementsAre("GPU-1", "GPU-2"));
  ASSERT_EQ(plan.options.ports.size(), 2u);
  EXPECT_THAT(plan.options.ports[0].cuda_devices, ElementsAre(0, 3, 4));
  EXPECT_THAT(plan.options.ports[1].cuda_devices, ElementsAre(1, 2));
  EXPECT_EQ(plan.options.ports[0].gid_index, 3);
}

TEST(NicInventoryTest, PciDistanceCountsHopsThroughTheCommonAncestor) {
  EXPECT_EQ(PciDistance("/sys/devices/p0/a/b", "/sys/devices/p0/a/c"), 2);
  EXPECT_EQ(PciDistance("/sys/devices/p0/a/b", "/sys/devices/p1/x/y"), 6);
  EXPECT_EQ(PciDistance("/sys/devices/p0/a", "/sys/devices/p0/a"), 0);
  EXPECT_EQ(PciDistance("", "/sys/devices/p0"), -1);
  EXPECT_EQ(NormalizePciBusId("00000000:1A:00.0"), "0000:1a:00.0");
  EXPECT_EQ(NormalizePciBusId("1a:00.0"), "0000:1a:00.0");
  EXPECT_EQ(NormalizePciBusId("0000:1a:00.0"), "0000:1a:00.0");
}

TEST(NicInventoryTest, MissingFilesLeaveFieldsUnknown) {
  FakeSysfs fs;
  fs.AddDevice("mlx5_0", "pci0000:00", "0000:1a:00.0");
  fs.AddPort("mlx5_0", 1, "", "", "");
  // A GID that does not parse, and a port directory that is not a number.
  fs.AddGid("mlx5_0", 1, 0, "not-a-gid", "RoCE v2");
  std::filesystem::create_directories(fs.PortDir("mlx5_0", 1).parent_path() / "x");
  // A device with no `device` link and no ports directory.
  std::filesystem::create_directories(std::filesystem::path(fs.root()) / "class" / "infiniband" /
                                      "bare");
  std::vector<RdmaPortInfo> ports = ScanRdmaPorts(fs.root());
  ASSERT_EQ(ports.size(), 1u);
  EXPECT_EQ(ports[0].state, "UNKNOWN");
  EXPECT_EQ(ports[0].link_layer, "");
  EXPECT_EQ(ports[0].rate_gbps, 0u);
  EXPECT_TRUE(ports[0].gids.empty());
  NicPlan plan = PlanNics(ports, v1::RdmaConfig(), {Gpu(0, "GPU-0", "0000:03:00.0")}, fs.root());
  EXPECT_FALSE(plan.nics[0].selected());  // Not ACTIVE.
  EXPECT_TRUE(plan.options.ports.empty());
  EXPECT_TRUE(plan.nics[0].gpu_uuids().empty());
}

TEST(NicInventoryTest, HugeAndSpecialFilesAreReadBoundedAndNeverBlock) {
  FakeSysfs fs;
  fs.AddDevice("mlx5_0", "pci0000:00", "0000:1a:00.0");
  fs.AddPort("mlx5_0", 1, "4: ACTIVE", "", "");
  // An 8 MiB link_layer with no newline: at most a page of it is read.
  {
    std::ofstream out(fs.PortDir("mlx5_0", 1) / "link_layer");
    out << std::string(8 << 20, 'E');
  }
  // A FIFO for rate that nobody writes: opening it must not wait for a writer.
  const std::filesystem::path fifo = fs.PortDir("mlx5_0", 1) / "rate";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto scan = std::async(std::launch::async, [&] { return ScanRdmaPorts(fs.root()); });
  if (scan.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    // Let the blocked reader go before failing.
    const int w = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (w >= 0) ::close(w);
    ADD_FAILURE() << "ScanRdmaPorts blocked on a FIFO";
  }
  std::vector<RdmaPortInfo> ports = scan.get();
  ASSERT_EQ(ports.size(), 1u);
  EXPECT_EQ(ports[0].state, "ACTIVE");
  EXPECT_LE(ports[0].link_layer.size(), 4096u);
  EXPECT_EQ(ports[0].rate_gbps, 0u);
}

TEST(NicInventoryTest, SymlinkLoopsEndTheScanWithFieldsUnknown) {
  FakeSysfs fs;
  const std::filesystem::path dev =
      std::filesystem::path(fs.root()) / "class" / "infiniband" / "mlx5_0";
  std::filesystem::create_directories(dev / "ports" / "1");
  std::filesystem::create_symlink("device", dev / "device");  // Points at itself.
  std::filesystem::create_symlink("state", dev / "ports" / "1" / "state");
  std::filesystem::create_symlink("../1", dev / "ports" / "1" / "gids");  // A cycle.
  std::vector<RdmaPortInfo> ports = ScanRdmaPorts(fs.root());
  ASSERT_EQ(ports.size(), 1u);
  EXPECT_EQ(ports[0].state, "UNKNOWN");
  EXPECT_EQ(ports[0].numa_node, -1);
  EXPECT_EQ(ports[0].pci_path, "");
  EXPECT_EQ(ports[0].pci_bus_id, "");  // The loop's name is no PCI id.
  EXPECT_TRUE(ports[0].gids.empty());
}

TEST(NicInventoryTest, DeviceLinksThatDoNotResolveToAPciFunctionLeaveThePciIdUnknown) {
  FakeSysfs fs;
  const std::filesystem::path ib = std::filesystem::path(fs.root()) / "class" / "infiniband";
  // A loop named like a PCI function, a dangling link named like one, a link to a
  // directory not named like one; and a good device beside them.
  std::filesystem::create_directories(ib / "loop" / "ports" / "1");
  std::filesystem::create_symlink("0000:1b:00.0", ib / "loop" / "0000:1b:00.0");
  std::filesystem::create_symlink("0000:1b:00.0", ib / "loop" / "device");
  std::filesystem::create_directories(ib / "dangling" / "ports" / "1");
  std::filesystem::create_symlink("../../../devices/pci0000:00/0000:1c:00.0",
                                  ib / "dangling" / "device");
  std::filesystem::create_directories(ib / "odd" / "ports" / "1");
  std::filesystem::create_directories(std::filesystem::path(fs.root()) / "devices" / "platform");
  std::filesystem::create_symlink("../../../devices/platform", ib / "odd" / "device");
  fs.AddDevice("mlx5_0", "pci0000:00", "0000:1a:00.0");
  fs.AddPort("mlx5_0", 1, "4: ACTIVE", "InfiniBand");
  std::vector<RdmaPortInfo> ports = ScanRdmaPorts(fs.root());
  ASSERT_EQ(ports.size(), 4u);
  EXPECT_EQ(ports[0].device, "dangling");
  EXPECT_EQ(ports[0].pci_bus_id, "");
  EXPECT_EQ(ports[0].pci_path, "");
  EXPECT_EQ(ports[1].device, "loop");
  EXPECT_EQ(ports[1].pci_bus_id, "");
  EXPECT_EQ(ports[1].pci_path, "");
  EXPECT_EQ(ports[2].device, "mlx5_0");
  EXPECT_EQ(ports[2].pci_bus_id, "0000:1a:00.0");
  EXPECT_EQ(ports[3].device, "odd");
  EXPECT_EQ(ports[3].pci_bus_id, "");
  EXPECT_NE(ports[3].pci_path, "");
}

TEST(NicInventoryTest, RatesThatAreNotFiniteOrInRangeAreUnknown) {
  for (const std::string rate : {"nan Gb/sec (4X EDR)", "-nan Gb/sec", "inf Gb/sec", "-1 Gb/sec",
                                 "1e300 Gb/sec", "Gb/sec", "400 Gb/sec (4X NDR)"}) {
    SCOPED_TRACE(rate);
    FakeSysfs fs;
    fs.AddDevice("mlx5_0", "pci0000:00", "0000:1a:00.0");
    fs.AddPort("mlx5_0", 1, "4: ACTIVE", "InfiniBand", rate);
    std::vector<RdmaPortInfo> ports = ScanRdmaPorts(fs.root());
    ASSERT_EQ(ports.size(), 1u);
    EXPECT_EQ(ports[0].rate_gbps, rate.starts_with("400") ? 400u : 0u);
  }
}

TEST(NicInventoryTest, OptionsCarryTheConfig) {
  v1::RdmaConfig config;
  config.set_service_level(3);
  config.set_traffic_class(106);
  config.set_timeout(18);
  config.set_qps_per_peer(4);
  config.set_mtu(4096);
  config.set_gpudirect("off");
  RdmaTransportOptions o = RdmaOptionsFromConfig(config);
  EXPECT_EQ(o.service_level, 3u);
  EXPECT_EQ(o.traffic_class, 106u);
  EXPECT_EQ(o.timeout, 18u);
  EXPECT_EQ(o.qps_per_peer, 4u);
  EXPECT_EQ(o.mtu, 4096u);
  EXPECT_EQ(o.gpudirect, GpuDirectMode::kOff);
  EXPECT_EQ(o.retry_count, 7u);  // Absent: the contract's default.
  EXPECT_EQ(RdmaOptionsFromConfig(v1::RdmaConfig()).gpudirect, GpuDirectMode::kAuto);
}

}  // namespace
}  // namespace epd::transport
