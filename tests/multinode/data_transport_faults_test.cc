// Groups across nodes through a faulty network: two real `epd --backend=host` daemons of two
// ranks each whose TCP transport is wrapped in the fault-injecting one
// (--testing_transport_faults, daemon/transport/fault/). Delayed links still give exact
// results; a link reset after some writes, or a partition, makes every rank's op fail
// within op_timeout + 1 s with an error naming the other node, and nothing hangs.
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/multinode/data_cluster.h"

namespace epd::multinode {
namespace {

constexpr absl::Duration kOpTimeout = absl::Seconds(1);

// Every op of both families, each of its writes delayed by 20 ms: still bit for bit.
TEST(DataTransportFaultsTest, DelayedLinksStillGiveExactResults) {
  auto cluster = StartCluster({2, 2}, absl::Seconds(5), /*peer=*/true,
                              {"--testing_transport_faults=delay_ms=20"});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto clients = StartClients(*cluster, {.group = "delayed", .tokens = {5, 0, 8, 3}, .seed = 7});
  ASSERT_TRUE(clients.ok()) << clients.status();
  absl::Status done = WaitClients(*clients, absl::Seconds(60));
  EXPECT_TRUE(done.ok()) << done.message() << cluster->Logs();
}

/// Runs loop clients on a 2 x 2 cluster whose daemons inject `faults` and expects each rank
/// to see an error within op_timeout + 1 s naming the other node, then every client to
/// stop (exit 0: no OK result was wrong) once its stdin closes.
void ExpectFailuresNamingTheOtherNode(const std::string& group, const std::string& faults) {
  auto cluster =
      StartCluster({2, 2}, kOpTimeout, /*peer=*/true, {"--testing_transport_faults=" + faults});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ClientRun run{.group = group, .scenario = "loop", .tokens = {3, 5, 0, 4}};
  run.extra_args = {"--max_seconds=60", "--wait_seconds=20"};
  auto clients = StartClients(*cluster, run);
  ASSERT_TRUE(clients.ok()) << clients.status();
  for (int r = 0; r < 4; ++r) {
    // Bounded: joining takes well under a second; then an op fails within op_timeout + 1 s.
    const std::string line = WaitErrorLine(*(*clients)[r], 0, kOpTimeout + absl::Seconds(10));
    ASSERT_FALSE(line.empty()) << "rank " << r << " saw no error:\n"
                               << (*clients)[r]->Stdout() << cluster->Logs();
    EXPECT_LE(ErrorMillis(line), absl::ToInt64Milliseconds(kOpTimeout) + 1000) << line;
    const int other = cluster->NodeOf(r) == 0 ? 1 : 0;
    const bool names_other =
        absl::StrContains(line, absl::StrCat("node ", other)) ||
        absl::StrContains(line, cluster->daemons[static_cast<size_t>(other)]->peer_address());
    EXPECT_TRUE(names_other) << "rank " << r << "'s error does not name node " << other << ": "
                             << line;
  }
  for (auto& client : *clients) client->CloseStdin();
  absl::Status stopped = WaitClients(*clients, kOpTimeout + absl::Seconds(25));
  EXPECT_TRUE(stopped.ok()) << stopped.message() << cluster->Logs();
  for (auto& daemon : cluster->daemons) EXPECT_TRUE(daemon->Running()) << daemon->Logs();
}

// Node 0's link to node 1 resets after 30 writes (a few rounds in): both nodes' ops fail
// naming the other.
TEST(DataTransportFaultsTest, LinkResetFailsOpsNamingTheNode) {
  ExpectFailuresNamingTheOtherNode("reset", "reset_after_writes=30:node=1");
}

// The two nodes are partitioned from the start: no op hangs; each fails naming the other.
TEST(DataTransportFaultsTest, PartitionFailsOpsNamingTheNode) {
  ExpectFailuresNamingTheOtherNode("partition", "partition=0|1");
}

}  // namespace
}  // namespace epd::multinode
