// The CUDA backend across nodes (DESIGN.md §5.5): two real `epd --backend=cuda` daemons on
// this machine's one GPU, each a node of 4 ranks (Peer service and TCP data links over
// 127.0.0.1), and one real client process per rank (tests/multinode/clients/mn_client.cc,
// daemon-launched endpoints, results copied from the GPU). Every client runs
// GetDispatchLayout, Dispatch BF16 (weights) and FP8, Combine with and without weights, the
// cached re-dispatch, and LowLatencyDispatch BF16 / FP8 / FP8+round_scale /
// FP8+round_scale+UE8M0 each with its LowLatencyCombine, and checks every output bit for
// bit against kernels/host computing the whole group's answer. Then a killed peer daemon:
// the other node's ops fail within op_timeout, naming the node. The same with
// client-launched endpoints (--launch_mode=client: the client's kernels post each op to its
// daemon through the rank's mirror), plus a CUDA graph of LowLatencyDispatch (T on the
// device) + LowLatencyCombine replayed with changing T. Skips without a GPU.
//
// Run on a GPU machine: ctest -R MultinodeCudaTest (or epd_gpu_tests
// --gtest_filter='MultinodeCudaTest.*').
#include <signal.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/multinode/data_cluster.h"

namespace epd::multinode {
namespace {

/// Long enough for the first op: without MPS, eight client processes creating their CUDA
/// contexts (and, client-launched, capturing graphs) on one GPU reach it seconds apart.
constexpr absl::Duration kOpTimeout = absl::Seconds(10);

/// Two CUDA daemons of 4 ranks each.
absl::StatusOr<Cluster> StartCudaCluster() {
  return StartCluster({4, 4}, kOpTimeout, /*peer=*/true, {}, "cuda");
}

/// The UUID of node 0's daemon's first GPU (every rank joins on it: one GPU here).
absl::StatusOr<std::string> FirstGpu(const Cluster& cluster) {
  ClientOptions options;
  options.socket_path = cluster.daemons[0]->socket_path();
  auto client = Client::Connect(options);
  if (!client.ok()) return client.status();
  auto stats = (*client)->GetStats();
  if (!stats.ok()) return stats.status();
  if (stats->gpus_size() == 0) return absl::FailedPreconditionError("the daemon lists no GPU");
  return stats->gpus(0).uuid();
}

/// `run` with every client joining on the cluster's GPU.
ClientRun OnGpu(ClientRun run, const std::string& gpu) {
  run.extra_args.push_back("--gpu_uuid=" + gpu);
  return run;
}

#define EPD_REQUIRE_GPU()                                    \
  do {                                                       \
    std::string why;                                         \
    if (!::epd::testing::HaveGpu(&why)) GTEST_SKIP() << why; \
  } while (0)

TEST(MultinodeCudaTest, TwoDaemonsEveryOpExactAgainstTheHostReference) {
  EPD_REQUIRE_GPU();
  auto cluster = StartCudaCluster();
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto gpu = FirstGpu(*cluster);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto clients = StartClients(
      *cluster, OnGpu({.group = "cuda-span", .tokens = {8, 1, 0, 6, 2, 7, 0, 4}, .seed = 7}, *gpu));
  ASSERT_TRUE(clients.ok()) << clients.status();
  absl::Status done = WaitClients(*clients, absl::Seconds(120));
  EXPECT_TRUE(done.ok()) << done.message() << cluster->Logs();
}

TEST(MultinodeCudaTest, EveryTokenToTheFirstNode) {
  EPD_REQUIRE_GPU();
  auto cluster = StartCudaCluster();
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto gpu = FirstGpu(*cluster);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto clients = StartClients(*cluster, OnGpu({.group = "cuda-first",
                                               .tokens = {6, 2, 0, 8, 5, 1, 3, 0},
                                               .to_first_node = true,
                                               .seed = 8},
                                              *gpu));
  ASSERT_TRUE(clients.ok()) << clients.status();
  absl::Status done = WaitClients(*clients, absl::Seconds(120));
  EXPECT_TRUE(done.ok()) << done.message() << cluster->Logs();
}

/// Node 1's daemon is SIGKILLed while every rank (`launch_mode`: "daemon" or "client")
/// loops Dispatch + Combine + LowLatencyDispatch + LowLatencyCombine (each OK round exact):
/// node 0's ranks fail an op within op_timeout + 1 s naming node 1, and node 0's daemon
/// serves on.
void KilledPeerFailsTheOtherNodesOps(const std::string& launch_mode) {
  auto cluster = StartCudaCluster();
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ClientRun run;
  run.group = "cuda-dead-peer-" + launch_mode;
  run.scenario = "loop";
  run.tokens = {3, 5, 0, 4, 2, 8, 1, 6};
  auto gpu = FirstGpu(*cluster);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  run.extra_args = {"--max_seconds=60", "--wait_seconds=20", "--round_pause_ms=5",
                    "--gpu_uuid=" + *gpu, "--launch_mode=" + launch_mode};
  auto clients = StartClients(*cluster, run);
  ASSERT_TRUE(clients.ok()) << clients.status();
  for (int r = 0; r < 8; ++r) {
    absl::Status running = (*clients)[r]->WaitForOutput("ROUND 2 OK", absl::Seconds(30));
    ASSERT_TRUE(running.ok()) << "rank " << r << ": " << running.message()
                              << (*clients)[r]->Stdout() << cluster->Logs();
  }
  std::vector<size_t> seen(4);
  for (int r = 0; r < 4; ++r) seen[r] = (*clients)[r]->Stdout().size();
  cluster->daemons[1]->Kill();
  for (int r = 0; r < 4; ++r) {
    const std::string line = WaitErrorLine(*(*clients)[r], seen[r], kOpTimeout + absl::Seconds(5));
    ASSERT_FALSE(line.empty()) << "rank " << r << " saw no error within op_timeout + 5 s:\n"
                               << (*clients)[r]->Stdout() << cluster->Logs();
    EXPECT_LE(ErrorMillis(line), absl::ToInt64Milliseconds(kOpTimeout) + 1000) << line;
    const bool names_node = absl::StrContains(line, cluster->daemons[1]->peer_address()) ||
                            absl::StrContains(line, "node 1");
    EXPECT_TRUE(names_node) << "rank " << r << "'s error does not name node 1 ("
                            << cluster->daemons[1]->peer_address() << "): " << line;
  }
  for (int r = 4; r < 8; ++r) (*clients)[r]->Signal(SIGKILL);
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE((*clients)[r]->Running()) << (*clients)[r]->Stdout();
    (*clients)[r]->CloseStdin();
  }
  for (int r = 0; r < 8; ++r) {
    auto code = (*clients)[r]->Wait(kOpTimeout + absl::Seconds(25));
    ASSERT_TRUE(code.ok()) << "rank " << r << " did not stop: " << (*clients)[r]->Stdout();
    if (r < 4) EXPECT_EQ(*code, 0) << (*clients)[r]->Stdout();  // No wrong OK result.
  }
  EXPECT_TRUE(cluster->daemons[0]->Running()) << cluster->daemons[0]->Logs();
}

TEST(MultinodeCudaTest, KilledPeerFailsTheOtherNodesOpsNamingIt) {
  EPD_REQUIRE_GPU();
  KilledPeerFailsTheOtherNodesOps("daemon");
}

// ---- client-launched endpoints (DESIGN.md §5.5 "Client-launched") ----
// Each rank's process launches the posting and await kernels itself; the daemons run the
// exchange. Eight processes on one GPU time-slice (no MPS needed: no kernel waits for
// another process's kernel, only for its daemon).

TEST(MultinodeCudaTest, ClientLaunchedEveryOpExactAgainstTheHostReference) {
  EPD_REQUIRE_GPU();
  auto cluster = StartCudaCluster();
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto gpu = FirstGpu(*cluster);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  ClientRun run =
      OnGpu({.group = "cuda-span-client", .tokens = {8, 1, 0, 6, 2, 7, 0, 4}, .seed = 9}, *gpu);
  run.extra_args.push_back("--launch_mode=client");
  auto clients = StartClients(*cluster, run);
  ASSERT_TRUE(clients.ok()) << clients.status();
  absl::Status done = WaitClients(*clients, absl::Seconds(180));
  EXPECT_TRUE(done.ok()) << done.message() << cluster->Logs();
}

TEST(MultinodeCudaTest, ClientLaunchedEveryTokenToTheFirstNode) {
  EPD_REQUIRE_GPU();
  auto cluster = StartCudaCluster();
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto gpu = FirstGpu(*cluster);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  ClientRun run = OnGpu({.group = "cuda-first-client",
                         .tokens = {6, 2, 0, 8, 5, 1, 3, 0},
                         .to_first_node = true,
                         .seed = 10},
                        *gpu);
  run.extra_args.push_back("--launch_mode=client");
  auto clients = StartClients(*cluster, run);
  ASSERT_TRUE(clients.ok()) << clients.status();
  absl::Status done = WaitClients(*clients, absl::Seconds(180));
  EXPECT_TRUE(done.ok()) << done.message() << cluster->Logs();
}

// LowLatencyDispatch (T on the device) + LowLatencyCombine captured in one CUDA graph per
// rank, replayed 8 times with every rank's T changed between replays (0 and Mll among
// them); every replay's outputs exact against kernels/host.
TEST(MultinodeCudaTest, ClientLaunchedGraphReplaysWithChangingTokens) {
  EPD_REQUIRE_GPU();
  auto cluster = StartCudaCluster();
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto gpu = FirstGpu(*cluster);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  ClientRun run = OnGpu({.group = "cuda-span-graph",
                         .scenario = "graph",
                         .tokens = {8, 1, 0, 6, 2, 7, 5, 4},
                         .seed = 11},
                        *gpu);
  run.extra_args.push_back("--launch_mode=client");
  run.extra_args.push_back("--graph_rounds=8");
  auto clients = StartClients(*cluster, run);
  ASSERT_TRUE(clients.ok()) << clients.status();
  absl::Status done = WaitClients(*clients, absl::Seconds(180));
  EXPECT_TRUE(done.ok()) << done.message() << cluster->Logs();
  for (int r = 0; r < 8 && done.ok(); ++r) {
    EXPECT_THAT((*clients)[r]->Stdout(), ::testing::HasSubstr("DONE ok=9 bad=0"));
  }
}

TEST(MultinodeCudaTest, ClientLaunchedKilledPeerFailsTheOtherNodesOpsNamingIt) {
  EPD_REQUIRE_GPU();
  KilledPeerFailsTheOtherNodesOps("client");
}

}  // namespace
}  // namespace epd::multinode
