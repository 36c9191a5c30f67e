// The RDMA preflight with injected facts on fake sysfs trees: one line per problem saying
// what to change, which problems refuse the transport and which only warn.
#include "daemon/transport/rdma/preflight.h"

#include "daemon/core/config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/fake_sysfs.h"

namespace epd::transport {
namespace {

using ::testing::AllOf;
using ::testing::Contains;
using ::testing::Each;
using ::testing::ElementsAre;
using testing::FakeSysfs;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::StartsWith;

PreflightFacts GoodFacts() {
  PreflightFacts f;
  f.rdma_built = true;
  f.cuda_built = true;
  f.memlock_bytes = UINT64_MAX;
  f.dmabuf_supported[0] = true;
  return f;
}

v1::DaemonConfig RdmaConfig() {
  v1::DaemonConfig config;
  config.set_transport("rdma");
  FillDaemonConfigDefaults(&config);
  return config;
}

std::vector<v1::GpuInfo> OneGpu() {
  v1::GpuInfo g;
  g.set_ordinal(0);
  g.set_uuid("GPU-0");
  g.set_pci_bus_id("0000:03:00.0");
  return {g};
}

struct Outcome {
  PreflightResult result;
  NicPlan plan;
};

Outcome Preflight(const FakeSysfs& fs, const v1::DaemonConfig& config, const PreflightFacts& facts,
                  const std::vector<v1::GpuInfo>& gpus = OneGpu()) {
  const std::vector<RdmaPortInfo> ports = ScanRdmaPorts(fs.root());
  Outcome r;
  r.plan = PlanNics(ports, config.rdma(), gpus, fs.root());
  r.result = RunRdmaPreflight(config, ports, gpus, facts, &r.plan);
  return r;
}

TEST(PreflightTest, AHealthyRocePortHasNoLines) {
  FakeSysfs fs;
  fs.AddDevice("mlx5_0", "pci0000:00", "0000:1a:00.0");
  testing::AddRocePort(fs, "mlx5_0", 1);
  Outcome r = Preflight(fs, RdmaConfig(), GoodFacts());
  EXPECT_THAT(r.result.lines, IsEmpty());
  EXPECT_TRUE(r.result.rdma_usable);
  EXPECT_TRUE(r.result.gpudirect_usable);
  ASSERT_EQ(r.plan.nics.size(), 1u);
  EXPECT_TRUE(r.plan.nics[0].gpudirect());
}

TEST(PreflightTest, NoDeviceAndNotBuiltRefuse) {
  FakeSysfs fs;
  PreflightFacts facts = GoodFacts();
  facts.rdma_built = false;
  Outcome r = Preflight(fs, RdmaConfig(), facts);
  EXPECT_FALSE(r.result.rdma_usable);
  EXPECT_THAT(r.result.lines, Contains(HasSubstr("built without libibverbs")));
  EXPECT_THAT(r.result.lines, Contains(HasSubstr("no RDMA device found")));
  EXPECT_THAT(r.result.reason, HasSubstr("-DEPD_WITH_RDMA=ON"));
  EXPECT_FALSE(RdmaPreflightWanted(v1::DaemonConfig(), {}));
  EXPECT_TRUE(RdmaPreflightWanted(RdmaConfig(), {}));
  // Configured for rdma: tcp is offered as the way out.
  EXPECT_THAT(r.result.lines, Each(HasSubstr("or use transport \"tcp\"")));
  EXPECT_THAT(r.result.lines, Each(StartsWith("refuse: RDMA: ")));
}

// A daemon on tcp that only lists devices is not told to use tcp, which it does.
TEST(PreflightTest, OnTcpTheLinesDoNotOfferTcp) {
  FakeSysfs fs;
  PreflightFacts facts = GoodFacts();
  facts.rdma_built = false;
  v1::DaemonConfig config = RdmaConfig();
  config.set_transport("tcp");
  Outcome r = Preflight(fs, config, facts);
  ASSERT_THAT(r.result.lines, Contains(HasSubstr("no RDMA device found")));
  EXPECT_THAT(r.result.lines, Each(Not(HasSubstr("use transport"))));
}

TEST(PreflightTest, ListedPortsMustExistAndBeActive) {
  FakeSysfs fs;
  fs.AddDevice("mlx5_0", "pci0000:00", "0000:1a:00.0");
  testing::AddRocePort(fs, "mlx5_0", 1);
  testing::AddRocePort(fs, "mlx5_0", 2, "1: DOWN");
  v1::DaemonConfig config = RdmaConfig();
  for (auto [dev, port] :
       std::vector<std::pair<std::string, int>>{{"mlx5_0", 2}, {"mlx5_0", 3}, {"mlx5_9", 0}}) {
    v1::RdmaDevicePort* d = config.mutable_rdma()->add_devices();
    d->set_device(dev);
    d->set_port(port);
  }
  Outcome r = Preflight(fs, config, GoodFacts());
  EXPECT_FALSE(r.result.rdma_usable);
  ASSERT_EQ(r.result.lines.size(), 3u) << ::testing::PrintToString(r.result.lines);
  EXPECT_THAT(r.result.lines[0], AllOf(HasSubstr("mlx5_0:2 is DOWN"), HasSubstr("link up")));
  EXPECT_THAT(r.result.lines[1], HasSubstr("mlx5_0:3, but that device has no such port"));
  EXPECT_THAT(r.result.lines[2], HasSubstr("mlx5_9:1, but no such device exists"));
}

TEST(PreflightTest, NoActivePortRefuses) {
  FakeSysfs fs;
  fs.AddDevice("mlx5_0", "pci0000:00", "0000:1a:00.0");
  testing::AddRocePort(fs, "mlx5_0", 1, "2: INIT");
  Outcome r = Preflight(fs, RdmaConfig(), GoodFacts());
  EXPECT_FALSE(r.result.rdma_usable);
  EXPECT_THAT(r.result.reason, HasSubstr("no port is ACTIVE"));
}

TEST(PreflightTest, GidMustFitTheLinkLayer) {
  FakeSysfs fs;
  fs.AddDevice("mlx5_0", "pci0000:00", "0000:1a:00.0");
  fs.AddPort("mlx5_0", 1, "4: ACTIVE", "Ethernet");
  fs.AddGid("mlx5_0", 1, 0, testing::kLinkLocalGid, "IB/RoCE v1");
  fs.AddGid("mlx5_0", 1, 1, testing::kLinkLocalGid, "RoCE v2");
  // No IPv4-mapped RoCE v2 GID.
  Outcome none = Preflight(fs, RdmaConfig(), GoodFacts());
  EXPECT_FALSE(none.result.rdma_usable);
  EXPECT_THAT(none.result.reason, AllOf(HasSubstr("mlx5_0:1 has no RoCE v2 GID with an IPv4"),
                                        HasSubstr("rdma.gid_index")));
  // A configured index: a RoCE v2 one is accepted, a v1 one and an empty one are not.
  v1::DaemonConfig config = RdmaConfig();
  config.mutable_rdma()->set_gid_index(1);
  EXPECT_TRUE(Preflight(fs, config, GoodFacts()).result.rdma_usable);
  config.mutable_rdma()->set_gid_index(0);
  EXPECT_THAT(Preflight(fs, config, GoodFacts()).result.reason,
              AllOf(HasSubstr("rdma.gid_index 0"), HasSubstr("\"IB/RoCE v1\", not a RoCE v2")));
  config.mutable_rdma()->set_gid_index(7);
  EXPECT_THAT(Preflight(fs, config, GoodFacts()).result.reason,
              HasSubstr("rdma.gid_index 7 is empty on port mlx5_0:1"));
}

TEST(PreflightTest, InfinibandNeedsGidZero) {
  FakeSysfs fs;
  fs.AddDevice("mlx5_0", "pci0000:00", "0000:1a:00.0");
  fs.AddPort("mlx5_0", 1, "4: ACTIVE", "InfiniBand");
  EXPECT_THAT(Preflight(fs, RdmaConfig(), GoodFacts()).result.reason,
              HasSubstr("no GID at index 0"));
  fs.AddGid("mlx5_0", 1, 0, testing::kLinkLocalGid, "IB/RoCE v1");
  EXPECT_TRUE(Preflight(fs, RdmaConfig(), GoodFacts()).result.rdma_usable);
}

TEST(PreflightTest, MemlockRefusesBelowTheMinimumAndWarnsAbove) {
  FakeSysfs fs;
  fs.AddDevice("mlx5_0", "pci0000:00", "0000:1a:00.0");
  testing::AddRocePort(fs, "mlx5_0", 1);
  PreflightFacts facts = GoodFacts();
  facts.memlock_bytes = 8ull << 20;
  Outcome small = Preflight(fs, RdmaConfig(), facts);
  EXPECT_FALSE(small.result.rdma_usable);
  EXPECT_THAT(small.result.reason,
              AllOf(HasSubstr("RLIMIT_MEMLOCK is 8 MiB"), HasSubstr("LimitMEMLOCK=infinity"),
                    HasSubstr("ulimit -l unlimited")));
  facts.memlock_bytes = 4ull << 30;
  Outcome big = Preflight(fs, RdmaConfig(), facts);
  EXPECT_TRUE(big.result.rdma_usable);
  EXPECT_THAT(big.result.lines, Contains(HasSubstr("RLIMIT_MEMLOCK is 4 GiB")));
  // Each line says its severity first: the one RDMA runs with warns, the other refuses.
  EXPECT_THAT(big.result.lines, ElementsAre(StartsWith("warn: RDMA: RLIMIT_MEMLOCK is 4 GiB")));
  EXPECT_THAT(small.result.lines, ElementsAre(StartsWith("refuse: RDMA: RLIMIT_MEMLOCK is 8 MiB")));
  EXPECT_THAT(small.result.reason, StartsWith("RDMA: "));
  facts.memlock_bytes = 8ull << 20;
  facts.cap_ipc_lock = true;  // Root / CAP_IPC_LOCK: no limit applies.
  EXPECT_THAT(Preflight(fs, RdmaConfig(), facts).result.lines, IsEmpty());
}

TEST(PreflightTest, GpuDirectFromDmabufOrPeermemAndItsMode) {
  FakeSysfs fs;
  fs.AddDevice("mlx5_0", "pci0000:00", "0000:1a:00.0");
  testing::AddRocePort(fs, "mlx5_0", 1);
  PreflightFacts facts = GoodFacts();
  facts.dmabuf_supported[0] = false;
  // auto: a warning, the transport still runs (staging through host memory).
  Outcome staged = Preflight(fs, RdmaConfig(), facts);
  EXPECT_TRUE(staged.result.rdma_usable);
  EXPECT_FALSE(staged.result.gpudirect_usable);
  EXPECT_THAT(staged.result.lines,
              Contains(AllOf(HasSubstr("GPUDirect RDMA is not usable"), HasSubstr("nvidia_peermem"),
                             HasSubstr("pinned host memory"))));
  EXPECT_THAT(staged.result.lines, Each(StartsWith("warn: ")));
  EXPECT_FALSE(staged.plan.nics[0].gpudirect());
  // on: refused.
  v1::DaemonConfig on = RdmaConfig();
  on.mutable_rdma()->set_gpudirect("on");
  EXPECT_THAT(Preflight(fs, on, facts).result.reason, HasSubstr("rdma.gpudirect is \"on\""));
  // off: nothing to say, and no port claims GPUDirect.
  v1::DaemonConfig off = RdmaConfig();
  off.mutable_rdma()->set_gpudirect("off");
  EXPECT_THAT(Preflight(fs, off, GoodFacts()).result.lines, IsEmpty());
  EXPECT_FALSE(Preflight(fs, off, GoodFacts()).plan.nics[0].gpudirect());
  // nvidia_peermem alone is enough.
  facts.nvidia_peermem_loaded = true;
  EXPECT_TRUE(Preflight(fs, RdmaConfig(), facts).result.gpudirect_usable);
  // Without GPUs GPUDirect does not matter.
  facts.nvidia_peermem_loaded = false;
  EXPECT_THAT(Preflight(fs, RdmaConfig(), facts, {}).result.lines, IsEmpty());
}

TEST(PreflightTest, GatheredFactsReadTheModuleDirectory) {
  FakeSysfs fs;
  EXPECT_FALSE(GatherPreflightFacts(fs.root(), {}).nvidia_peermem_loaded);
  std::filesystem::create_directories(std::filesystem::path(fs.root()) / "module" /
                                      "nvidia_peermem");
  PreflightFacts f = GatherPreflightFacts(fs.root(), {});
  EXPECT_TRUE(f.nvidia_peermem_loaded);
  EXPECT_GT(f.memlock_bytes, 0u);
  EXPECT_EQ(MemlockText(UINT64_MAX), "unlimited");
  EXPECT_EQ(MemlockText(64ull << 10), "64 KiB");
}

}  // namespace
}  // namespace epd::transport
