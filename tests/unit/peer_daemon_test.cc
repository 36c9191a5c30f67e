// The Daemon with peer_listen, in-process on the host data plane: the mesh starts, its
// address is in GetStats, a bad secret file refuses the start naming it, and shutdown
// stops the mesh.
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
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace epd {
namespace {

using ::testing::HasSubstr;

class PeerDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/epd_peer_daemon_XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  v1::DaemonConfig Config(const std::string& secret, mode_t mode) {
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
    FillDaemonConfigDefaults(&config);
    EXPECT_TRUE(ValidateDaemonConfig(config).ok()) << ValidateDaemonConfig(config);
    return config;
  }
  DaemonOptions Options() {
    DaemonOptions options;
    options.inventory = GpuInventory::FromList({}, "no GPU (test)");
    options.drain_grace = absl::Milliseconds(10);
    return options;
  }

  std::string dir_;
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

}  // namespace
}  // namespace epd
