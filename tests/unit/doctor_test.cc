// epctl doctor (client/epctl/doctor.h, doctor_facts.h): each check against fake facts that
// make it pass, warn and fail; the facts read from a fake sysfs tree and a fake GetStats;
// peer reachability against a real listening and a closed port; the table and the JSON.
#include "client/epctl/doctor.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "client/epctl/doctor_facts.h"
#include "common/os/scoped_fd.h"
#include "common/version.h"
#include "daemon/transport/rdma/preflight.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/unit/fake_sysfs.h"

namespace epd::epctl {
namespace {

using ::testing::HasSubstr;

v1::GpuInfo Gpu(int ordinal, int major, int minor, const std::string& bus = "") {
  v1::GpuInfo gpu;
  gpu.set_ordinal(ordinal);
  gpu.set_uuid(absl::StrCat("GPU-", ordinal));
  gpu.set_name("NVIDIA Test");
  gpu.set_compute_capability_major(major);
  gpu.set_compute_capability_minor(minor);
  gpu.set_pci_bus_id(bus);
  return gpu;
}

/// Facts of a healthy two-GPU node with NVLink, MPS, big limits, tsc and no RDMA.
DoctorFacts HealthyNode() {
  DoctorFacts f;
  f.source = "test";
  f.gpus = {Gpu(0, 9, 0), Gpu(1, 9, 0)};
  f.p2p = {{P2pLink::kNone, P2pLink::kAtomics}, {P2pLink::kAtomics, P2pLink::kNone}};
  f.driver_version = 13000;
  f.runtime_version = 13000;
  f.cuda_driver_loaded = true;
  f.mps_active = true;
  f.mps_detail = "socket answers";
  f.shm_total_bytes = 64ull << 30;
  f.shm_free_bytes = 60ull << 30;
  f.memlock_bytes = UINT64_MAX;
  f.fd_limit = 1048576;
  f.clocksource = "tsc";
  f.config.set_transport("tcp");
  return f;
}

Verdict Only(const std::vector<CheckResult>& results, const std::string& name) {
  std::vector<CheckResult> found;
  for (const CheckResult& r : results) {
    if (r.name == name) found.push_back(r);
  }
  EXPECT_EQ(found.size(), 1u) << name;
  return found.empty() ? Verdict::kOk : found[0].verdict;
}

TEST(DoctorTest, AHealthyNodePassesEveryCheckAndExitsZero) {
  std::vector<CheckResult> results = RunDoctorChecks(HealthyNode());
  for (const CheckResult& r : results) {
    EXPECT_EQ(r.verdict, Verdict::kOk) << r.name << ": " << r.detail;
    EXPECT_TRUE(r.next_step.empty()) << r.name;
  }
  EXPECT_FALSE(AnyFailed(results));
  EXPECT_THAT(CheckP2p(HealthyNode()).detail, HasSubstr("NVLink"));
}

TEST(DoctorTest, GpuArchitectureBelowSm80OrNotInTheBuildFails) {
  DoctorFacts f = HealthyNode();
  f.gpus = {Gpu(0, 7, 0)};
  std::vector<CheckResult> r = CheckGpuArchitecture(f);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].verdict, Verdict::kFail);
  EXPECT_THAT(r[0].detail, HasSubstr("sm_70"));
  EXPECT_THAT(r[0].next_step, HasSubstr("sm_80"));

  f.gpus = {Gpu(0, 8, 0)};
  f.built_cuda_architectures = "90-real,90-virtual";
  r = CheckGpuArchitecture(f);
  EXPECT_EQ(r[0].verdict, Verdict::kFail);
  EXPECT_THAT(r[0].next_step, HasSubstr("CMAKE_CUDA_ARCHITECTURES"));

  f.built_cuda_architectures = "80;90";
  r = CheckGpuArchitecture(f);
  EXPECT_EQ(r[0].verdict, Verdict::kOk);
  EXPECT_THAT(r[0].detail, HasSubstr("FP8 groups (use_fp8) need sm_89+"));

  f.gpus.clear();
  f.cuda_error = "no CUDA driver";
  r = CheckGpuArchitecture(f);
  EXPECT_EQ(r[0].verdict, Verdict::kWarn);
  EXPECT_THAT(r[0].detail, HasSubstr("host backend"));
}

TEST(DoctorTest, BuildArchitecturesRunOnMatchingSassOrOlderPtx) {
  EXPECT_EQ(BuildRunsOn("90-real;90-virtual", 90), true);
  EXPECT_EQ(BuildRunsOn("90-real;90-virtual", 100), true) << "PTX for 90 JIT-compiles on 100";
  EXPECT_EQ(BuildRunsOn("90-real", 100), false);
  EXPECT_EQ(BuildRunsOn("90-real;90-virtual", 80), false);
  EXPECT_EQ(BuildRunsOn("80-real", 86), true);
  EXPECT_EQ(BuildRunsOn("90a-real", 90), true);
  EXPECT_EQ(BuildRunsOn("90a", 100), false);
  EXPECT_EQ(BuildRunsOn("", 90), std::nullopt);
  EXPECT_EQ(BuildRunsOn("native", 90), std::nullopt);
}

TEST(DoctorTest, CudaVersions) {
  DoctorFacts f = HealthyNode();
  f.driver_version = 11080;
  EXPECT_EQ(CheckCudaVersions(f).verdict, Verdict::kFail);
  f.driver_version = 12020;
  f.runtime_version = 13000;
  EXPECT_EQ(CheckCudaVersions(f).verdict, Verdict::kFail);
  EXPECT_THAT(CheckCudaVersions(f).detail, HasSubstr("driver 12.2, runtime 13.0"));
  f.runtime_version = 12080;
  EXPECT_EQ(CheckCudaVersions(f).verdict, Verdict::kWarn);
  f.driver_version = 0;
  f.gpus.clear();
  EXPECT_EQ(CheckCudaVersions(f).verdict, Verdict::kWarn);
}

TEST(DoctorTest, P2pWithoutPeerAccessWarnsAndNamesThePair) {
  DoctorFacts f = HealthyNode();
  f.gpus.push_back(Gpu(2, 9, 0));
  f.p2p = {{P2pLink::kNone, P2pLink::kAtomics, P2pLink::kAccess},
           {P2pLink::kAtomics, P2pLink::kNone, P2pLink::kNone},
           {P2pLink::kAccess, P2pLink::kNone, P2pLink::kNone}};
  CheckResult r = CheckP2p(f);
  EXPECT_EQ(r.verdict, Verdict::kWarn);
  EXPECT_THAT(r.detail, HasSubstr("1-2"));
  EXPECT_THAT(r.detail, HasSubstr("0: X NV P"));
  // From GetStats (peer_access only).
  f.p2p.clear();
  f.gpus = {Gpu(0, 9, 0), Gpu(1, 9, 0)};
  for (auto* gpu : {&f.gpus[0], &f.gpus[1]}) {
    gpu->add_peer_access(true);
    gpu->add_peer_access(true);
  }
  EXPECT_EQ(CheckP2p(f).verdict, Verdict::kOk);
}

TEST(DoctorTest, MpsShmMemlockFdsAndClock) {
  DoctorFacts f = HealthyNode();
  f.mps_active = false;
  EXPECT_EQ(CheckMps(f).verdict, Verdict::kWarn);
  EXPECT_THAT(CheckMps(f).next_step, HasSubstr("start-mps.sh"));

  f.shm_total_bytes = 64ull << 20;
  EXPECT_EQ(CheckDevShm(f).verdict, Verdict::kWarn);
  f.shm_total_bytes.reset();
  EXPECT_EQ(CheckDevShm(f).verdict, Verdict::kWarn);

  f.memlock_bytes = 8ull << 20;
  EXPECT_EQ(CheckMemlock(f).verdict, Verdict::kOk) << "no RDMA: any limit does";
  f.config.set_transport("rdma");
  EXPECT_EQ(CheckMemlock(f).verdict, Verdict::kFail);
  EXPECT_THAT(CheckMemlock(f).next_step, HasSubstr("LimitMEMLOCK=infinity"));
  f.memlock_bytes = 1ull << 30;
  EXPECT_EQ(CheckMemlock(f).verdict, Verdict::kWarn);
  f.cap_ipc_lock = true;
  EXPECT_EQ(CheckMemlock(f).verdict, Verdict::kOk);

  f.fd_limit = 512;
  EXPECT_EQ(CheckFdLimit(f).verdict, Verdict::kFail);
  f.fd_limit = 4096;
  EXPECT_EQ(CheckFdLimit(f).verdict, Verdict::kWarn);

  f.clocksource = "hpet";
  EXPECT_EQ(CheckClockSource(f).verdict, Verdict::kWarn);
  f.clocksource = "kvm-clock";
  EXPECT_EQ(CheckClockSource(f).verdict, Verdict::kOk);
}

TEST(DoctorTest, RdmaChecksFromAFakeSysfsTree) {
  testing::FakeSysfs fs;
  fs.AddDevice("mlx5_0", "pci0000:00/0000:00:01.0", "0000:1a:00.0", /*numa_node=*/0);
  testing::AddRocePort(fs, "mlx5_0", 1);
  testing::FakeSysfs::Write(fs.PortDir("mlx5_0", 1) / "gid_attrs" / "ndevs" / "0", "eth2");
  testing::FakeSysfs::Write(std::filesystem::path(fs.root()) / "devices" / "pci0000:00" /
                                "0000:00:01.0" / "0000:1a:00.0" / "net" / "eth2" / "mtu",
                            "1500");
  fs.AddDevice("mlx5_1", "pci0000:80/0000:80:01.0", "0000:9a:00.0", /*numa_node=*/1);
  fs.AddPort("mlx5_1", 1, "1: DOWN", "InfiniBand");
  fs.AddPci("pci0000:00/0000:00:02.0", "0000:1b:00.0", /*numa_node=*/1);  // The GPU.
  testing::FakeSysfs::Write(std::filesystem::path(fs.root()) / "devices" / "system" /
                                "clocksource" / "clocksource0" / "current_clocksource",
                            "tsc");

  std::vector<transport::RdmaPortInfo> ports = transport::ScanRdmaPorts(fs.root());
  ASSERT_EQ(ports.size(), 2u);
  EXPECT_EQ(ports[0].netdev, "eth2");
  EXPECT_EQ(ports[0].netdev_mtu, 1500u);

  DoctorFacts f = HealthyNode();
  f.gpus = {Gpu(0, 9, 0, "0000:1b:00.0")};
  f.p2p.clear();
  f.config.set_transport("rdma");
  f.config.mutable_rdma()->set_gpudirect("auto");
  f.ports = ports;
  transport::NicPlan plan = transport::PlanNics(ports, f.config.rdma(), f.gpus, fs.root());
  f.nics = plan.nics;
  f.clocksource.clear();
  GatherLocalFacts({fs.root(), "/dev/shm"}, &f);
  EXPECT_EQ(f.clocksource, "tsc");
  EXPECT_EQ(f.gpu_numa.at("0000:1b:00.0"), 1);

  std::vector<CheckResult> r = CheckRdma(f);
  auto verdict_of = [&r](const std::string& name, const std::string& about) {
    for (const CheckResult& c : r) {
      if (c.name == name && c.detail.find(about) != std::string::npos) return c.verdict;
    }
    ADD_FAILURE() << "no " << name << " about " << about;
    return Verdict::kOk;
  };
  EXPECT_EQ(verdict_of("rdma.port_state", "mlx5_0:1"), Verdict::kOk);
  EXPECT_EQ(verdict_of("rdma.port_state", "mlx5_1:1"), Verdict::kOk) << "DOWN but not used";
  EXPECT_EQ(verdict_of("rdma.gid", "table: 0 v1, 1 v2, 2 v1 IPv4, 3 v2 IPv4"), Verdict::kOk);
  EXPECT_EQ(verdict_of("rdma.mtu", "MTU 1500"), Verdict::kWarn);
  EXPECT_EQ(verdict_of("rdma.affinity", "across sockets"), Verdict::kWarn);

  // The DOWN port listed in rdma.devices fails, and so does a port without a usable GID.
  f.config.mutable_rdma()->add_devices()->set_device("mlx5_1");
  f.nics = transport::PlanNics(ports, f.config.rdma(), f.gpus, fs.root()).nics;
  r = CheckRdma(f);
  EXPECT_EQ(verdict_of("rdma.port_state", "mlx5_1:1"), Verdict::kFail);
  for (v1::NicInfo& nic : f.nics) nic.set_gid_index(-1);
  f.nics[0].set_selected(true);
  r = CheckRdma(f);
  EXPECT_EQ(verdict_of("rdma.gid", "mlx5_0:1"), Verdict::kFail);

  // No device at all: ok for tcp, a failure when rdma is configured.
  f.nics.clear();
  EXPECT_EQ(Only(CheckRdma(f), "rdma.devices"), Verdict::kFail);
  f.config.set_transport("tcp");
  f.config.mutable_rdma()->clear_devices();
  EXPECT_EQ(Only(CheckRdma(f), "rdma.devices"), Verdict::kOk);
}

TEST(DoctorTest, StandaloneFactsOfAFakeNodeWithoutGpuOrDriverAreJudged) {
  testing::FakeSysfs fs;
  fs.AddDevice("mlx5_0", "pci0000:00/0000:00:01.0", "0000:1a:00.0");
  testing::AddRocePort(fs, "mlx5_0", 1);
  v1::DaemonConfig config;
  config.set_transport("rdma");
  DoctorFacts f = GatherStandaloneFacts({fs.root(), "/dev/shm"}, config, "90-real");
  EXPECT_FALSE(f.live);
  ASSERT_EQ(f.nics.size(), 1u);
  EXPECT_TRUE(f.nics[0].selected());
  EXPECT_EQ(f.config.rdma().gpudirect(), "auto") << "the daemon's default filled in";
  EXPECT_GT(f.fd_limit, 0u);
  std::vector<CheckResult> results = RunDoctorChecks(f);
  EXPECT_EQ(Only(results, "clock.source"), Verdict::kWarn) << "the fake tree has none";
  EXPECT_EQ(Only(results, "rdma.devices"), Verdict::kOk);
}

TEST(DoctorTest, LiveFactsComeFromGetStatsAndTheDaemonsVersionIsChecked) {
  v1::GetStatsResponse stats;
  stats.set_version(kEpdVersion);
  stats.set_pid(77);
  stats.set_serving_status("SERVING");
  stats.set_backend("cuda");
  *stats.add_gpus() = Gpu(0, 9, 0);
  stats.set_mps_active(true);
  stats.set_memlock_limit_bytes(UINT64_MAX);
  stats.set_fd_limit(1 << 20);
  stats.set_cuda_driver_version(13000);
  stats.set_cuda_runtime_version(13000);
  stats.add_preflight("RDMA: mlx5_0:1 is DOWN; bring the link up");
  stats.mutable_effective_config()->set_transport("tcp");
  DoctorFacts f = FactsFromStats(stats, "unix:///run/epd/epd.sock");
  EXPECT_TRUE(f.live);
  EXPECT_THAT(f.source, HasSubstr("pid 77"));
  EXPECT_EQ(f.gpus.size(), 1u);
  EXPECT_EQ(f.driver_version, 13000);
  std::vector<CheckResult> daemon = CheckDaemon(f);
  EXPECT_EQ(Only(daemon, "daemon.serving"), Verdict::kOk);
  EXPECT_EQ(Only(daemon, "daemon.version"), Verdict::kOk);
  EXPECT_EQ(Only(CheckRdma(f), "rdma.preflight"), Verdict::kWarn);

  f.serving_status = "NOT_SERVING (GPU lost)";
  f.daemon_version = "99.0.0";
  daemon = CheckDaemon(f);
  EXPECT_EQ(Only(daemon, "daemon.serving"), Verdict::kFail);
  // Drained on purpose: a warning naming the way back; drained with a fault: the fault.
  f.draining = true;
  f.serving_status = "NOT_SERVING (drained by the operator: `epctl undrain` serves again)";
  EXPECT_EQ(Only(CheckDaemon(f), "daemon.serving"), Verdict::kWarn);
  f.serving_status = "NOT_SERVING (GPU 0 lost)";
  EXPECT_EQ(Only(CheckDaemon(f), "daemon.serving"), Verdict::kFail);
  f.draining = false;
  EXPECT_EQ(Only(daemon, "daemon.version"), Verdict::kFail);
  EXPECT_TRUE(AnyFailed(daemon));
}

TEST(DoctorTest, PeersAreReachableOnlyWhereSomethingListens) {
  ScopedFd listener(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(listener.valid());
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(listener.get(), 4), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string open = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  // A port that was just free: bound, then closed.
  std::string closed;
  {
    ScopedFd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::bind(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    socklen_t l = sizeof(a);
    ASSERT_EQ(::getsockname(s.get(), reinterpret_cast<sockaddr*>(&a), &l), 0);
    closed = absl::StrCat("127.0.0.1:", ntohs(a.sin_port));
  }
  const absl::Time start = absl::Now();
  std::vector<PeerProbe> probes =
      ProbePeers({open, closed, "not-an-address", "[::1]:0"}, absl::Seconds(1));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ASSERT_EQ(probes.size(), 4u);
  EXPECT_TRUE(probes[0].reachable) << probes[0].error;
  EXPECT_FALSE(probes[1].reachable);
  EXPECT_THAT(probes[1].error, HasSubstr("refused"));
  EXPECT_FALSE(probes[2].reachable);
  EXPECT_THAT(probes[2].error, HasSubstr("host:port"));
  EXPECT_FALSE(probes[3].reachable);

  DoctorFacts f = HealthyNode();
  f.peers = probes;
  std::vector<CheckResult> r = CheckPeers(f);
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(r[0].verdict, Verdict::kOk);
  EXPECT_EQ(r[1].verdict, Verdict::kFail);
  EXPECT_THAT(r[1].next_step, HasSubstr("firewall"));
}

TEST(DoctorTest, TheTableHasOneLinePerCheckAndTheJsonParses) {
  DoctorFacts f = HealthyNode();
  f.fd_limit = 100;
  std::vector<CheckResult> results = RunDoctorChecks(f);
  const std::string table = FormatDoctor(f, results);
  EXPECT_THAT(table, HasSubstr("CHECK"));
  EXPECT_THAT(table, HasSubstr("limits.nofile"));
  EXPECT_THAT(table, HasSubstr("next: set LimitNOFILE"));
  EXPECT_THAT(table,
              HasSubstr(absl::StrCat("summary: ", results.size() - 1, " ok, 0 warn, 1 fail")));
  google::protobuf::Struct json;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(DoctorJson(f, results), &json).ok());
  EXPECT_EQ(json.fields().at("fail").number_value(), 1);
  EXPECT_EQ(json.fields().at("checks").list_value().values_size(),
            static_cast<int>(results.size()));
  EXPECT_TRUE(AnyFailed(results));
}

}  // namespace
}  // namespace epd::epctl
