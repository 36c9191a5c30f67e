// Groups across nodes, faults with real processes: two nodes (real `epd --backend=host`
// daemons) of two ranks each, every rank a real client looping Dispatch, Combine,
// LowLatencyDispatch and LowLatencyCombine (clients/mn_client.cc --scenario=loop, every OK
// result checked bit for bit). Node 1's daemon is SIGKILLed mid-op: node 0's ops fail
// within op_timeout + 1 s, naming node 1. Then node 1 is restarted on the same ports and its
// ranks rejoin: the group re-forms and node 0's ranks, which never left, run exact ops again.
// A rank whose client stops submitting is named in every node's error, not only its own.
// Each test takes a few seconds (op_timeout is 2 s).
#include <signal.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/multinode/data_cluster.h"

namespace epd::multinode {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kOpTimeout = absl::Seconds(2);

class DataFaultsTest : public ::testing::Test {
 protected:
  void SetUp() override { StartGroup("faults", {}, /*exit_after_recovery=*/true); }

  /// Starts the cluster and group `name`'s four clients (with `extra` flags) and waits until
  /// each ran two rounds. `exit_after_recovery`: node 0's ranks exit once they have seen a
  /// failure and then 3 good rounds.
  void StartGroup(const std::string& name, const std::vector<std::string>& extra,
                  bool exit_after_recovery) {
    auto cluster = StartCluster({2, 2}, kOpTimeout);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    run_.group = name;
    run_.scenario = "loop";
    run_.tokens = {3, 5, 0, 4};
    run_.extra_args = {"--max_seconds=60", "--wait_seconds=20", "--round_pause_ms=5"};
    run_.extra_args.insert(run_.extra_args.end(), extra.begin(), extra.end());
    for (int r = 0; r < 4; ++r) {
      ClientRun run = run_;
      if (r < 2 && exit_after_recovery) run.extra_args.push_back("--exit_after_recovery");
      auto client = StartClient(cluster_, run, r);
      ASSERT_TRUE(client.ok()) << client.status();
      clients_.push_back(*std::move(client));
    }
    for (int r = 0; r < 4; ++r) {
      absl::Status running = clients_[r]->WaitForOutput("ROUND 2 OK", absl::Seconds(20));
      ASSERT_TRUE(running.ok()) << "rank " << r << ": " << running.message() << cluster_.Logs();
    }
  }

  /// SIGKILLs node 1's daemon while ops run, and expects node 0's ranks to fail an op
  /// within op_timeout + 1 s naming node 1; then ends node 1's client processes.
  void KillNodeOne() {
    std::vector<size_t> seen(2);
    for (int r = 0; r < 2; ++r) seen[r] = clients_[r]->Stdout().size();
    cluster_.daemons[1]->Kill();
    for (int r = 0; r < 2; ++r) {
      // The first error after the kill, polled for (bounded: op_timeout + 5 s).
      const std::string line = WaitErrorLine(*clients_[r], seen[r], kOpTimeout + absl::Seconds(5));
      ASSERT_FALSE(line.empty()) << "rank " << r << " saw no error within op_timeout + 5 s:\n"
                                 << clients_[r]->Stdout() << cluster_.Logs();
      EXPECT_LE(ErrorMillis(line), absl::ToInt64Milliseconds(kOpTimeout) + 1000) << line;
      const bool names_node = absl::StrContains(line, cluster_.daemons[1]->peer_address()) ||
                              absl::StrContains(line, "node 1");
      EXPECT_TRUE(names_node) << "rank " << r << "'s error does not name node 1 ("
                              << cluster_.daemons[1]->peer_address() << "): " << line;
    }
    for (int r = 2; r < 4; ++r) {
      clients_[r]->Signal(SIGKILL);
      ASSERT_TRUE(clients_[r]->Wait(absl::Seconds(5)).ok());
    }
  }

  Cluster cluster_;
  ClientRun run_;
  std::vector<std::unique_ptr<testing::Subprocess>> clients_;
};

TEST_F(DataFaultsTest, PeerDaemonKilledMidOpFailsTheOtherNodesOpsNamingIt) {
  ASSERT_NO_FATAL_FAILURE(KillNodeOne());
  // Node 0's daemon serves on: its ranks keep getting clear errors, never a hang.
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(clients_[r]->Running()) << clients_[r]->Stdout();
    clients_[r]->CloseStdin();
  }
  for (int r = 0; r < 2; ++r) {
    auto code = clients_[r]->Wait(kOpTimeout + absl::Seconds(25));
    ASSERT_TRUE(code.ok()) << "rank " << r << " did not stop: " << clients_[r]->Stdout();
    EXPECT_EQ(*code, 0) << clients_[r]->Stdout();
  }
  EXPECT_TRUE(cluster_.daemons[0]->Running()) << cluster_.daemons[0]->Logs();
}

TEST_F(DataFaultsTest, RestartedPeerRejoinsAndTheGroupReforms) {
  ASSERT_NO_FATAL_FAILURE(KillNodeOne());
  absl::Status restarted = cluster_.daemons[1]->Restart();
  ASSERT_TRUE(restarted.ok()) << restarted;
  std::vector<std::unique_ptr<testing::Subprocess>> rejoined;
  for (int r = 2; r < 4; ++r) {
    auto client = StartClient(cluster_, run_, r);
    ASSERT_TRUE(client.ok()) << client.status();
    rejoined.push_back(*std::move(client));
  }
  // Node 0's ranks never left: they exit 0 after 3 exact rounds with the new node 1.
  for (int r = 0; r < 2; ++r) {
    auto code = clients_[r]->Wait(absl::Seconds(30));
    ASSERT_TRUE(code.ok()) << "rank " << r << " did not recover: " << clients_[r]->Stdout()
                           << cluster_.Logs();
    EXPECT_EQ(*code, 0) << clients_[r]->Stdout();
    EXPECT_THAT(clients_[r]->Stdout(), HasSubstr("RECOVERED"));
  }
  for (size_t i = 0; i < rejoined.size(); ++i) {
    // Their first rounds may meet node 0's ranks mid-round (an error, then in step again).
    EXPECT_THAT(rejoined[i]->Stdout(), HasSubstr(" OK\n")) << "rank " << i + 2;
    rejoined[i]->CloseStdin();
    auto code = rejoined[i]->Wait(kOpTimeout + absl::Seconds(25));
    ASSERT_TRUE(code.ok()) << rejoined[i]->Stdout();
    EXPECT_EQ(*code, 0) << rejoined[i]->Stdout();
  }
}

// Rank 3's client stops (SIGSTOP: joined, never submits again). Node 1 fails the op at
// op_timeout naming rank 3; node 0 waits op_timeout plus its grace (min(1 s, op_timeout))
// for that live peer's error, so every rank's first error names rank 3, within
// op_timeout + 2 s.
TEST_F(DataFaultsTest, SilentRankIsNamedOnEveryNode) {
  std::vector<size_t> seen(3);
  for (int r = 0; r < 3; ++r) seen[r] = clients_[r]->Stdout().size();
  clients_[3]->Signal(SIGSTOP);
  for (int r = 0; r < 3; ++r) {
    const std::string line = WaitErrorLine(*clients_[r], seen[r], kOpTimeout + absl::Seconds(5));
    ASSERT_FALSE(line.empty()) << "rank " << r << " saw no error within op_timeout + 5 s:\n"
                               << clients_[r]->Stdout() << cluster_.Logs();
    EXPECT_THAT(line, HasSubstr("rank(s) 3 did not arrive within op_timeout")) << "rank " << r;
    EXPECT_LE(ErrorMillis(line), absl::ToInt64Milliseconds(kOpTimeout) + 2000) << line;
  }
  for (int r = 0; r < 4; ++r) {
    clients_[r]->Signal(SIGKILL);
    ASSERT_TRUE(clients_[r]->Wait(absl::Seconds(5)).ok()) << "rank " << r;
  }
  for (int n = 0; n < 2; ++n) {
    EXPECT_TRUE(cluster_.daemons[n]->Running()) << cluster_.daemons[n]->Logs();
  }
}

// The same group with on_rank_failure = MASK: node 1's daemon is SIGKILLed mid-op and node
// 0's ranks go on without node 1's ranks, exact (every OK result checked against kernels/host
// with ranks 2 and 3 masked), their first such round within op_timeout + 1 s of the kill;
// once node 1 is back and its ranks rejoin, they are unmasked and the group is whole again.
class DataMaskFaultsTest : public DataFaultsTest {
 protected:
  /// Waits until `client`'s stdout after its first `skip` bytes holds `text`; false after
  /// `timeout`.
  static bool WaitFor(testing::Subprocess& client, const std::string& text, size_t skip,
                      absl::Duration timeout) {
    const absl::Time end = absl::Now() + timeout;
    while (client.Stdout().find(text, skip) == std::string::npos) {
      if (absl::Now() > end) return false;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return true;
  }

  void SetUp() override {
    StartGroup("mask_faults", {"--on_rank_failure=mask"}, /*exit_after_recovery=*/false);
  }
};

TEST_F(DataMaskFaultsTest, PeerDaemonKilledIsMaskedAndARestartedPeerRejoins) {
  std::vector<size_t> seen(2);
  for (int r = 0; r < 2; ++r) seen[r] = clients_[r]->Stdout().size();
  const absl::Time killed = absl::Now();
  cluster_.daemons[1]->Kill();
  for (int r = 2; r < 4; ++r) {
    clients_[r]->Signal(SIGKILL);
    ASSERT_TRUE(clients_[r]->Wait(absl::Seconds(5)).ok());
  }
  for (int r = 0; r < 2; ++r) {
    const bool masked =
        WaitFor(*clients_[r], "masked=2,3\n", seen[r], kOpTimeout + absl::Seconds(1));
    ASSERT_TRUE(masked) << "rank " << r << " ran no round without node 1's ranks within "
                        << "op_timeout + 1 s of the kill:\n"
                        << clients_[r]->Stdout().substr(seen[r]) << cluster_.Logs();
    EXPECT_LE(absl::Now() - killed, kOpTimeout + absl::Seconds(1));
    EXPECT_EQ(clients_[r]->Stdout().find("MISMATCH"), std::string::npos) << clients_[r]->Stdout();
  }
  // Node 1 restarts on the same ports; its ranks rejoin and are unmasked.
  absl::Status restarted = cluster_.daemons[1]->Restart();
  ASSERT_TRUE(restarted.ok()) << restarted;
  for (int r = 0; r < 2; ++r) seen[r] = clients_[r]->Stdout().size();
  for (int r = 2; r < 4; ++r) {
    auto client = StartClient(cluster_, run_, r);
    ASSERT_TRUE(client.ok()) << client.status();
    clients_[r] = *std::move(client);
  }
  for (int r = 0; r < 4; ++r) {
    const bool whole = WaitFor(*clients_[r], "masked=-\n", r < 2 ? seen[r] : 0, absl::Seconds(30));
    ASSERT_TRUE(whole) << "rank " << r << " ran no round with every rank after the rejoin:\n"
                       << clients_[r]->Stdout() << cluster_.Logs();
  }
  for (int r = 0; r < 4; ++r) {
    clients_[r]->CloseStdin();
    auto code = clients_[r]->Wait(kOpTimeout + absl::Seconds(25));
    ASSERT_TRUE(code.ok()) << "rank " << r << " did not stop: " << clients_[r]->Stdout();
    EXPECT_EQ(*code, 0) << "rank " << r << ": " << clients_[r]->Stdout();
  }
}

}  // namespace
}  // namespace epd::multinode
