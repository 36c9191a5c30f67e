// Groups across nodes, the data path: N real `epd --backend=host` daemons on this machine
// (each its own socket and Peer port) and one real client process per rank, joined to its
// own node's daemon. Every client runs every op and option of both families
// (clients/mn_client.cc) and checks its results bit for bit against kernels/host computing
// the whole group's answer: 2 and 4 nodes, 2 to 4 ranks per node, uneven nodes, mixed T per
// rank including 0, every token routed to one node.
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/multinode/data_cluster.h"

namespace epd::multinode {
namespace {

/// Bound of one client run (the ops themselves take milliseconds).
constexpr absl::Duration kRunTimeout = absl::Seconds(60);

/// Starts a cluster of `ranks_per_node`, runs every rank's client with `run` and expects each
/// to exit 0 (every op OK and exact).
void RunEveryOp(std::vector<int> ranks_per_node, ClientRun run, bool peer = true) {
  auto cluster = StartCluster(std::move(ranks_per_node), absl::Seconds(5), peer);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto clients = StartClients(*cluster, run);
  ASSERT_TRUE(clients.ok()) << clients.status();
  absl::Status done = WaitClients(*clients, kRunTimeout);
  EXPECT_TRUE(done.ok()) << done.message() << cluster->Logs();
}

// The harness and the client program on their own: one daemon without a Peer listener,
// a one-node group of 4 client processes.
TEST(DataClusterTest, OneNodeGroupThroughTheHarness) {
  RunEveryOp({4}, {.group = "one-node", .tokens = {5, 0, 8, 3}}, /*peer=*/false);
}

TEST(DataClusterTest, EachDaemonAdvertisesItsPeerAddress) {
  auto cluster = StartCluster({1, 1});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  for (const auto& daemon : cluster->daemons) {
    ClientOptions options;
    options.socket_path = daemon->socket_path();
    auto client = Client::Connect(options);
    ASSERT_TRUE(client.ok()) << client.status();
    auto address = (*client)->PeerAddress();
    ASSERT_TRUE(address.ok()) << address.status();
    EXPECT_EQ(*address, daemon->peer_address());
  }
}

TEST(DataOpsTest, TwoNodesTwoRanksEachMixedTokens) {
  RunEveryOp({2, 2}, {.group = "two-by-two", .tokens = {5, 0, 8, 3}});
}

TEST(DataOpsTest, TwoNodesFourRanksEach) {
  RunEveryOp({4, 4}, {.group = "two-by-four", .tokens = {8, 1, 0, 6, 2, 7, 0, 4}, .seed = 2});
}

TEST(DataOpsTest, TwoUnevenNodes) {
  RunEveryOp({3, 2}, {.group = "uneven", .tokens = {3, 8, 0, 5, 1}, .seed = 3});
}

TEST(DataOpsTest, FourNodes) {
  RunEveryOp({2, 3, 2, 2}, {.group = "four", .tokens = {4, 0, 7, 2, 8, 1, 0, 6, 3}, .seed = 4});
}

TEST(DataOpsTest, EveryTokenToTheFirstNode) {
  RunEveryOp({3, 3},
             {.group = "to-first", .tokens = {6, 2, 0, 8, 5, 1}, .to_first_node = true, .seed = 5});
}

// spec.transport "tcp" on one node and "" (the daemon's default, tcp) on the other resolve
// to the same transport, which the rendezvous compares: the group forms and runs.
TEST(DataOpsTest, TransportNamedOnOneNodeAndDefaultedOnTheOther) {
  RunEveryOp({2, 2}, {.group = "named-transport",
                      .tokens = {3, 4, 0, 2},
                      .seed = 7,
                      .node_transports = {"tcp", ""}});
}

TEST(DataOpsTest, NoRankHasTokens) {
  RunEveryOp({2, 2}, {.group = "empty", .tokens = {0, 0, 0, 0}, .seed = 6});
}

}  // namespace
}  // namespace epd::multinode
