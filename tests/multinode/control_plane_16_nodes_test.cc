// The control plane at 16 nodes: 16 real epd daemons on this machine (host backend, each
// with its own socket and Peer port), one tiny group spanning all of them (1 rank per
// daemon, joined through the client library). Pass = every daemon's ListGroups shows all
// 16 nodes registered within a bound; then one daemon is SIGKILLed and every other one
// shows its node lost within the liveness bound. Bounded to seconds on 2 cores.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "epd/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"
#include "tests/common/subprocess.h"

namespace epd::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int kNodes = 16;
constexpr int kHeartbeatMs = 500;
constexpr char kSecret[] = "control-plane-16-nodes-secret-0123";
/// Bound on every node appearing registered at every daemon once all ranks joined.
constexpr absl::Duration kRegisteredBound = absl::Seconds(20);
/// Bound on a killed node showing lost everywhere: 3 failed heartbeats, slack.
constexpr absl::Duration kLostBound = absl::Seconds(5);

/// The node states of group `name` at the daemon of `client` ("" = no such group there).
std::string NodeStates(Client& client, const std::string& name) {
  absl::StatusOr<v1::ListGroupsResponse> groups = client.ListGroups();
  if (!groups.ok()) return absl::StrCat("ListGroups: ", groups.status().ToString());
  for (const v1::GroupInfo& g : groups->groups()) {
    if (g.spec().name() != name) continue;
    std::string states;
    for (const v1::GroupNodeInfo& n : g.nodes()) {
      states += n.state() == v1::NODE_STATE_SELF         ? 'S'
                : n.state() == v1::NODE_STATE_REGISTERED ? 'R'
                : n.state() == v1::NODE_STATE_LOST       ? 'L'
                : n.state() == v1::NODE_STATE_MISSING    ? 'm'
                                                         : '?';
    }
    return states;
  }
  return "";
}

/// Every node's info at the daemon of `client`, for failure messages.
std::string Nodes(Client& client) {
  absl::StatusOr<v1::ListGroupsResponse> groups = client.ListGroups();
  if (!groups.ok()) return groups.status().ToString();
  std::string out;
  for (const v1::GroupInfo& g : groups->groups()) {
    for (const v1::GroupNodeInfo& n : g.nodes()) absl::StrAppend(&out, n.ShortDebugString(), "\n");
  }
  return out;
}

TEST(ControlPlane16NodesTest, EveryDaemonSeesEveryNodeRegisteredThenOneLost) {
  char secret_path[] = "/tmp/epd_cp16_secret_XXXXXX";
  int fd = ::mkstemp(secret_path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, kSecret, sizeof(kSecret) - 1), static_cast<ssize_t>(sizeof(kSecret) - 1));
  ::close(fd);
  ASSERT_EQ(::chmod(secret_path, 0600), 0);
  struct RemoveSecret {
    const char* path;
    ~RemoveSecret() { std::remove(path); }
  } remove_secret{secret_path};

  // Start all 16 at once, then wait for each.
  std::vector<std::unique_ptr<DaemonProcess>> daemons;
  for (int i = 0; i < kNodes; ++i) {
    DaemonProcessOptions options;
    options.tcp = false;
    options.log_level = "info";
    options.wait_serving = false;
    options.extra_args = {
        "--peer_listen=127.0.0.1:0", absl::StrCat("--peer_secret_file=", secret_path),
        absl::StrCat("--peer_heartbeat_ms=", kHeartbeatMs), "--host_threads=1", "--op_timeout=5s"};
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(options);
    ASSERT_TRUE(d.ok()) << d.status();
    daemons.push_back(*std::move(d));
  }
  std::vector<std::unique_ptr<Client>> clients;
  v1::GroupSpec spec;
  spec.set_name("cp16");
  spec.set_num_ranks(kNodes);
  spec.set_num_experts(kNodes);
  spec.set_hidden(128);
  spec.set_num_topk(1);
  spec.set_max_tokens_per_rank(1);
  for (int i = 0; i < kNodes; ++i) {
    ASSERT_TRUE(daemons[i]->WaitServing(absl::Seconds(20)).ok()) << daemons[i]->Logs();
    absl::StatusOr<std::unique_ptr<Client>> c =
        Client::Connect({.socket_path = daemons[i]->socket_path(), .client_name = "cp16"});
    ASSERT_TRUE(c.ok()) << c.status();
    absl::StatusOr<v1::GetStatsResponse> stats = (*c)->GetStats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    ASSERT_FALSE(stats->peer_address().empty()) << "daemon " << i << " has no Peer listener";
    v1::NodeSpec* node = spec.add_nodes();
    node->set_peer_address(stats->peer_address());
    node->set_num_ranks(1);
    clients.push_back(*std::move(c));
  }

  const absl::Time joined_at = absl::Now();
  std::vector<std::unique_ptr<Endpoint>> endpoints;
  for (int i = 0; i < kNodes; ++i) {
    JoinOptions join;
    join.spec = spec;
    join.rank = i;
    absl::StatusOr<std::unique_ptr<Endpoint>> e = clients[i]->Join(join);
    ASSERT_TRUE(e.ok()) << "rank " << i << ": " << e.status();
    endpoints.push_back(*std::move(e));
  }
  // A rank of another node is refused at this one, naming the node.
  {
    JoinOptions wrong;
    wrong.spec = spec;
    wrong.rank = 1;
    absl::StatusOr<std::unique_ptr<Endpoint>> e = clients[0]->Join(wrong);
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(e.status().message(), HasSubstr("lives on node 1"));
  }

  auto expected_all = [](int self) {
    std::string s(kNodes, 'R');
    s[self] = 'S';
    return s;
  };
  std::vector<std::string> seen(kNodes);
  bool all = false;
  while (!all && absl::Now() - joined_at < kRegisteredBound) {
    all = true;
    for (int i = 0; i < kNodes; ++i) {
      seen[i] = NodeStates(*clients[i], "cp16");
      if (seen[i] != expected_all(i)) all = false;
    }
    if (!all) absl::SleepFor(absl::Milliseconds(100));
  }
  for (int i = 0; i < kNodes; ++i) {
    EXPECT_EQ(seen[i], expected_all(i))
        << "daemon " << i << " (S self, R registered, m missing, L lost) after " << kRegisteredBound
        << ": " << Nodes(*clients[i]) << "\n"
        << daemons[i]->Logs().substr(
               daemons[i]->Logs().size() > 6000 ? daemons[i]->Logs().size() - 6000 : 0);
  }
  ASSERT_TRUE(all);
  std::printf("all %d nodes registered at all %d daemons %s after the joins\n", kNodes, kNodes,
              absl::FormatDuration(absl::Now() - joined_at).c_str());

  // epctl shows the Peer address and the node table.
  absl::StatusOr<CommandResult> status = RunCommand(
      {EpctlBinary(), "--socket=" + daemons[0]->socket_path(), "status"}, absl::Seconds(20));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_THAT(status->stdout_text, HasSubstr("peer: " + spec.nodes(0).peer_address()));
  absl::StatusOr<CommandResult> groups = RunCommand(
      {EpctlBinary(), "--socket=" + daemons[0]->socket_path(), "groups"}, absl::Seconds(20));
  ASSERT_TRUE(groups.ok()) << groups.status();
  EXPECT_THAT(groups->stdout_text,
              AllOf(HasSubstr("PEER ADDRESS"), HasSubstr("self"), HasSubstr("registered"),
                    HasSubstr(spec.nodes(15).peer_address())));

  // SIGKILL the last daemon: every other one shows its node lost within the bound.
  const absl::Time killed_at = absl::Now();
  daemons[kNodes - 1]->Kill();
  bool lost = false;
  while (!lost && absl::Now() - killed_at < kLostBound) {
    lost = true;
    for (int i = 0; i + 1 < kNodes; ++i) {
      seen[i] = NodeStates(*clients[i], "cp16");
      if (seen[i].size() != kNodes || seen[i][kNodes - 1] != 'L') lost = false;
    }
    if (!lost) absl::SleepFor(absl::Milliseconds(50));
  }
  for (int i = 0; i + 1 < kNodes; ++i) {
    EXPECT_EQ(seen[i].substr(kNodes - 1), "L") << "daemon " << i << ": " << seen[i];
  }
  std::printf("node %d lost at the other daemons %s after SIGKILL\n", kNodes - 1,
              absl::FormatDuration(absl::Now() - killed_at).c_str());
  endpoints.clear();
  clients.clear();
}

}  // namespace
}  // namespace epd::testing
