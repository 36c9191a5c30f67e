// The multinode harness itself (tests/common/daemon_process.h): the Peer flags StartNodes
// gives each daemon (distinct ports, one secret in a file only its owner may read), and
// DaemonProcess::Restart (same socket, same argv, serving again). These hold with or without
// a daemon that knows the Peer flags: the daemons here are not waited for, or have none.
#include <sys/stat.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"
#include "tests/common/subprocess.h"

namespace epd::testing {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;

TEST(DataHarnessTest, NodesGetDistinctPeerPortsAndOnePrivateSecret) {
  DaemonProcessOptions options;
  options.wait_serving = false;
  options.peer_heartbeat_ms = 50;
  auto nodes = StartNodes(4, options);
  ASSERT_TRUE(nodes.ok()) << nodes.status();
  ASSERT_EQ(nodes->size(), 4u);
  std::set<int> ports;
  std::set<std::string> sockets;
  for (const auto& node : *nodes) {
    ASSERT_NE(node->peer_port(), 0);
    ports.insert(node->peer_port());
    sockets.insert(node->socket_path());
    EXPECT_EQ(node->peer_address(), "127.0.0.1:" + std::to_string(node->peer_port()));
    const std::string secret_path = node->dir() + "/peer.secret";
    EXPECT_THAT(node->argv(), Contains("--peer_listen=" + node->peer_address()));
    EXPECT_THAT(node->argv(), Contains("--peer_secret_file=" + secret_path));
    EXPECT_THAT(node->argv(), Contains("--peer_heartbeat_ms=50"));
    struct stat st {};
    ASSERT_EQ(::stat(secret_path.c_str(), &st), 0) << secret_path;
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    std::stringstream secret;
    secret << std::ifstream(secret_path).rdbuf();
    EXPECT_EQ(secret.str(), options.peer_secret);
    EXPECT_GE(secret.str().size(), 16u);
  }
  EXPECT_EQ(ports.size(), 4u);
  EXPECT_EQ(sockets.size(), 4u);
}

TEST(DataHarnessTest, RestartServesAgainOnTheSameSocket) {
  DaemonProcessOptions options;
  options.tcp = false;
  options.log_level = "info";
  auto daemon = DaemonProcess::Start(options);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const pid_t first = (*daemon)->pid();
  (*daemon)->Kill();
  EXPECT_FALSE((*daemon)->Running());
  absl::Status restarted = (*daemon)->Restart();
  ASSERT_TRUE(restarted.ok()) << restarted;
  EXPECT_NE((*daemon)->pid(), first);
  EXPECT_TRUE((*daemon)->Running());
  auto health = (*daemon)->CheckHealth();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
  std::ifstream old_log((*daemon)->dir() + "/epd.log.1");
  EXPECT_TRUE(old_log.good()) << "the first run's log is kept";
}

// The client's --nodes says what it needs when it gets none, or a node without ranks.
TEST(DataHarnessTest, MnClientNodesFlagNamesWhatItNeeds) {
  const struct {
    std::string flag;
    std::string message;
  } cases[] = {
      {"--nodes=",
       "--nodes must list at least one node as host:port=RANKS (comma-separated), "
       "got ''"},
      {"--nodes=,",
       "--nodes must list at least one node as host:port=RANKS (comma-separated), "
       "got ','"},
      {"--nodes=127.0.0.1:1=0", "--nodes entry '127.0.0.1:1=0' gives 0 ranks; it needs >= 1"},
      {"--nodes=127.0.0.1:1", "--nodes entry '127.0.0.1:1' is not ADDRESS=RANKS"},
  };
  for (const auto& c : cases) {
    auto run = RunCommand({EPD_MN_CLIENT_BINARY, c.flag, "--socket=/nonexistent"});
    ASSERT_TRUE(run.ok()) << run.status();
    EXPECT_EQ(run->exit_code, 2) << c.flag << ": " << run->stdout_text;
    EXPECT_THAT(run->stdout_text, HasSubstr("FLAGS " + c.message)) << c.flag;
  }
}

}  // namespace
}  // namespace epd::testing
