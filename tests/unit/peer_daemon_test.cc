// The Daemon with peer_listen, in-process on the host data plane (and a fake sysfs for its
// NIC inventory): the mesh starts, its address is in GetStats, a bad secret file refuses the
// start naming it, and shutdown stops the mesh. Its transports by name: GetStats lists what
// it can run, its NICs and preflight lines; a group asking for a transport the daemon cannot
// run is refused at join naming spec.transport and why; a daemon configured for "rdma" that
// cannot run it does not start.
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "daemon/core/config.h"
#include "daemon/core/daemon.h"
#include "daemon/peer/peer_mesh.h"
#include "epd/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/specs.h"
#include "tests/unit/fake_sysfs.h"

namespace epd {
namespace {

using ::testing::AllOf;
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::StartsWith;

constexpr char kSecret[] = "0123456789abcdef-daemon";

class PeerDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/epd_peer_daemon_XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  v1::DaemonConfig Config(const std::string& secret, mode_t mode,
                          const std::string& transport = "") {
    const std::string secret_path = dir_ + "/peer.secret";
    std::ofstream(secret_path) << secret;
    EXPECT_EQ(::chmod(secret_path.c_str(), mode), 0);
    v1::DaemonConfig config;
    config.set_socket_path(dir_ + "/epd.sock");
    config.set_socket_mode("0600");
    config.set_log_level("warn");
    config.set_backend(v1::BACKEND_HOST);
    config.set_peer_listen("127.0.0.1:0");
    config.set_peer_secret_file(secret_path);
    config.set_transport(transport);
    FillDaemonConfigDefaults(&config);
    EXPECT_TRUE(ValidateDaemonConfig(config).ok()) << ValidateDaemonConfig(config);
    return config;
  }
  DaemonOptions Options() {
    DaemonOptions options;
    options.inventory = GpuInventory::FromList({}, "no GPU (test)");
    options.drain_grace = absl::Milliseconds(10);
    options.sysfs_root = sysfs_.root();
    transport::PreflightFacts facts;
    facts.rdma_built = true;
    options.preflight_facts = facts;
    return options;
  }

  std::string dir_;
  testing::FakeSysfs sysfs_;
};

TEST_F(PeerDaemonTest, MeshStartsAndItsAddressIsInStats) {
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Start(Config("0123456789abcdef-daemon\n", 0600), Options());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  ASSERT_NE((*daemon)->peer_mesh(), nullptr);
  const std::string address = (*daemon)->Stats().peer_address();
  EXPECT_TRUE(absl::StartsWith(address, "127.0.0.1:")) << address;
  EXPECT_NE(address, "127.0.0.1:0");
  EXPECT_EQ(address, (*daemon)->peer_mesh()->advertised_address());
  (*daemon)->Shutdown();
}

TEST_F(PeerDaemonTest, WithoutPeerListenThereIsNoMesh) {
  v1::DaemonConfig config = Config("0123456789abcdef-daemon", 0600);
  config.clear_peer_listen();
  config.clear_peer_secret_file();
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(config, Options());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  EXPECT_EQ((*daemon)->peer_mesh(), nullptr);
  EXPECT_EQ((*daemon)->Stats().peer_address(), "");
}

TEST_F(PeerDaemonTest, BadSecretFilesRefuseTheStart) {
  absl::StatusOr<std::unique_ptr<Daemon>> open =
      Daemon::Start(Config("0123456789abcdef-daemon", 0644), Options());
  EXPECT_EQ(open.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(open.status().message(), HasSubstr("peer_secret_file"));
  absl::StatusOr<std::unique_ptr<Daemon>> short_secret =
      Daemon::Start(Config("short", 0600), Options());
  EXPECT_EQ(short_secret.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(short_secret.status().message(), HasSubstr("fewer than 16"));
}

// Ranks of one node whose specs name the daemon's default transport, one by name and one
// by "", join the same group: the nodes compare transports as each resolves them, and so
// does the daemon.
TEST_F(PeerDaemonTest, DefaultTransportByNameOrEmptyJoinsTheSameGroup) {
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(Config(kSecret, 0600), Options());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string self = (*daemon)->Stats().peer_address();
  ClientOptions options;
  options.socket_path = (*daemon)->socket_path();
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<std::unique_ptr<Endpoint>> endpoints;
  for (const std::string transport : {"", "tcp", "rdma"}) {
    SCOPED_TRACE(transport);
    auto client = Client::Connect(options);
    ASSERT_TRUE(client.ok()) << client.status();
    JoinOptions join;
    join.spec = testing::MakeSpec("mixed-names", {.num_ranks = 4});
    SetNodes(&join.spec, {{self, 3}, {"127.0.0.1:1", 1}});
    join.spec.set_transport(transport);
    join.rank = static_cast<int32_t>(clients.size());
    auto endpoint = (*client)->Join(join);
    if (transport == "rdma") {  // Another transport: still refused.
      EXPECT_EQ(endpoint.status().code(), absl::StatusCode::kFailedPrecondition)
          << endpoint.status();
    } else {
      ASSERT_TRUE(endpoint.ok()) << endpoint.status();
      endpoints.push_back(*std::move(endpoint));  // The rank stays joined.
    }
    clients.push_back(*std::move(client));
  }
  EXPECT_EQ((*daemon)->Stats().num_groups(), 1);
  endpoints.clear();
  clients.clear();
  (*daemon)->Shutdown();
}

TEST_F(PeerDaemonTest, WithoutRdmaAGroupAskingForItIsRefusedAtJoin) {
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(Config(kSecret, 0600), Options());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const v1::GetStatsResponse stats = (*daemon)->Stats();
  EXPECT_THAT(stats.transports(), ElementsAre("tcp"));
  EXPECT_THAT(stats.nics(), IsEmpty());
  EXPECT_THAT(stats.preflight(), IsEmpty());  // No RDMA configured, no device: nothing to say.

  ClientOptions options;
  options.socket_path = (*daemon)->socket_path();
  auto client = Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  JoinOptions join;
  join.spec = testing::MakeSpec("wants-rdma", {.num_ranks = 2});
  SetNodes(&join.spec, {{stats.peer_address(), 1}, {"127.0.0.1:1", 1}});
  join.spec.set_transport("rdma");
  join.rank = 0;
  absl::Status status = (*client)->Join(join).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(status.message(),
              AllOf(HasSubstr("spec.transport: \"rdma\""), HasSubstr("wants-rdma"),
                    HasSubstr("it runs: tcp"), HasSubstr("no RDMA device found")));
  EXPECT_EQ((*daemon)->Stats().num_groups(), 0);
  (*daemon)->Shutdown();
}

TEST_F(PeerDaemonTest, ConfiguredForRdmaWithoutItTheStartFailsWithThePreflight) {
  transport::PreflightFacts facts;
  facts.rdma_built = false;
  DaemonOptions options = Options();
  options.preflight_facts = facts;
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Start(Config(kSecret, 0600, "rdma"), options);
  EXPECT_EQ(daemon.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(daemon.status().message(),
              AllOf(HasSubstr("transport: \"rdma\" is configured"), HasSubstr("no fallback"),
                    HasSubstr("built without libibverbs"), HasSubstr("no RDMA device found")));
}

TEST_F(PeerDaemonTest, DevicesAreShownWithTheReasonRdmaIsNotRunnable) {
  sysfs_.AddDevice("mlx5_0", "pci0000:00", "0000:1a:00.0", 0);
  testing::AddRocePort(sysfs_, "mlx5_0", 1);
  sysfs_.AddPort("mlx5_0", 2, "1: DOWN", "Ethernet");
  DaemonOptions options = Options();
  options.preflight_facts->memlock_bytes = 8ull << 20;
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(Config(kSecret, 0600), options);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const v1::GetStatsResponse stats = (*daemon)->Stats();
  EXPECT_THAT(stats.transports(), ElementsAre("tcp"));
  ASSERT_EQ(stats.nics_size(), 2);
  EXPECT_EQ(stats.nics(0).device(), "mlx5_0");
  EXPECT_EQ(stats.nics(0).state(), "ACTIVE");
  EXPECT_EQ(stats.nics(0).gid_index(), 3);
  EXPECT_TRUE(stats.nics(0).selected());
  EXPECT_EQ(stats.nics(0).numa_node(), 0);
  EXPECT_EQ(stats.nics(1).state(), "DOWN");
  EXPECT_FALSE(stats.nics(1).selected());
  EXPECT_THAT(stats.preflight(), Contains(StartsWith("refuse: RDMA: RLIMIT_MEMLOCK is 8 MiB")));
  (*daemon)->Shutdown();
}

TEST_F(PeerDaemonTest, ARunnableRdmaThatFailsToStartIsNamedAndRefusesAnRdmaDaemon) {
  sysfs_.AddDevice("mlx5_0", "pci0000:00", "0000:1a:00.0");
  testing::AddRocePort(sysfs_, "mlx5_0", 1);
  // The preflight passes on the fake tree; the transport cannot open a fake device (or is
  // not built), which GetStats names and which refuses a daemon configured for it.
  absl::StatusOr<std::unique_ptr<Daemon>> tcp = Daemon::Start(Config(kSecret, 0600), Options());
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  const v1::GetStatsResponse stats = (*tcp)->Stats();
  EXPECT_THAT(stats.transports(), ElementsAre("tcp"));
  EXPECT_THAT(stats.preflight(),
              ElementsAre(StartsWith("refuse: RDMA: the transport did not start")));
  (*tcp)->Shutdown();
  tcp->reset();
  absl::StatusOr<std::unique_ptr<Daemon>> rdma =
      Daemon::Start(Config(kSecret, 0600, "rdma"), Options());
  EXPECT_EQ(rdma.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(rdma.status().message(), HasSubstr("the transport did not start"));
}

TEST_F(PeerDaemonTest, WithoutPeerListenNoTransportIsListedButNicsAre) {
  sysfs_.AddDevice("mlx5_0", "pci0000:00", "0000:1a:00.0");
  testing::AddRocePort(sysfs_, "mlx5_0", 1);
  v1::DaemonConfig config = Config(kSecret, 0600);
  config.clear_peer_listen();
  config.clear_peer_secret_file();
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(config, Options());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const v1::GetStatsResponse stats = (*daemon)->Stats();
  EXPECT_THAT(stats.transports(), IsEmpty());
  ASSERT_EQ(stats.nics_size(), 1);
  EXPECT_EQ(stats.nics(0).device(), "mlx5_0");
  EXPECT_THAT(stats.preflight(), IsEmpty());
}

}  // namespace
}  // namespace epd
