// Groups across nodes, the data path: N real `epd --backend=host` daemons on this machine
// (each its own socket and Peer port) and one real client process per rank, joined to its
// own node's daemon. Every client runs every op and option of both families
// (clients/mn_client.cc) and checks its results bit for bit against kernels/host computing
// the whole group's answer: 2 and 4 nodes, 2 to 4 ranks per node, uneven nodes, mixed T per
// rank including 0, every token routed to one node; a rank joining past op_timeout after
// the others (their first op waits for it: mn_client's join barrier).
#include <csignal>
#include <memory>
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

/// Starts a cluster of `ranks_per_node` with a 1 s op_timeout, whose last rank joins 2.5 s
/// after the others (mn_client --join_delay_ms), and expects every rank's client to exit 0:
/// the others wait for it after their Join (mn_client's join barrier), so their first op
/// does not spend its op_timeout on a rank still joining.
void RunWithALateRank(std::vector<int> ranks_per_node, ClientRun run, bool peer) {
  auto cluster = StartCluster(std::move(ranks_per_node), absl::Seconds(1), peer);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::unique_ptr<testing::Subprocess>> clients;
  for (int r = 0; r < cluster->num_ranks(); ++r) {
    ClientRun late = run;
    if (r == cluster->num_ranks() - 1) late.extra_args.push_back("--join_delay_ms=2500");
    auto client = StartClient(*cluster, late, r);
    ASSERT_TRUE(client.ok()) << client.status();
    clients.push_back(*std::move(client));
  }
  absl::Status done = WaitClients(clients, kRunTimeout);
  EXPECT_TRUE(done.ok()) << done.message() << cluster->Logs();
  for (auto& client : clients) {
    EXPECT_THAT(client->Stdout(), ::testing::Not(::testing::HasSubstr("JOIN_BARRIER")));
  }
}

TEST(DataOpsTest, ARankJoiningPastOpTimeoutIsWaitedForAcrossNodes) {
  RunWithALateRank({2, 2}, {.group = "late-joiner", .tokens = {3, 4, 0, 2}, .seed = 8},
                   /*peer=*/true);
}

TEST(DataClusterTest, ARankJoiningPastOpTimeoutIsWaitedForInAOneNodeGroup) {
  RunWithALateRank({3}, {.group = "late-joiner-one-node", .tokens = {3, 4, 2}, .seed = 9},
                   /*peer=*/false);
}

// A rank that never joins: the barrier gives up at its bound (--join_barrier_ms), says so in
// one line, and the first op's own op_timeout names the missing rank.
TEST(DataClusterTest, JoinBarrierGivesUpAtItsBoundAndTheFirstOpNamesTheMissingRank) {
  auto cluster = StartCluster({2}, absl::Seconds(1), /*peer=*/false);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ClientRun run{.group = "never-complete", .extra_args = {"--join_barrier_ms=300"}};
  auto client = StartClient(*cluster, run, 0);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::Status gave_up = (*client)->WaitForOutput(
      "JOIN_BARRIER not every rank joined within 300 ms (1 of 2 seen)", absl::Seconds(10));
  EXPECT_TRUE(gave_up.ok()) << gave_up << (*client)->Stdout();
  absl::Status named = (*client)->WaitForOutput("rank(s) 1 did not arrive", absl::Seconds(10));
  EXPECT_TRUE(named.ok()) << named << (*client)->Stdout();
  (*client)->Signal(SIGKILL);
  EXPECT_TRUE((*client)->Wait(absl::Seconds(5)).ok());
}

}  // namespace
}  // namespace epd::multinode
