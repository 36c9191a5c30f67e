// The multinode data-path tests' harness: N real `epd` daemons on this machine (host
// backend; cuda in tests/gpu/multinode_cuda_test.cc) standing in for N nodes (StartNodes:
// each its own socket and Peer port, one shared secret), and real client processes
// (clients/mn_client.cc, EPD_MN_CLIENT_BINARY), one per rank, each joining its own node's
// daemon with the group's node list.
#pragma once

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "epd/client.h"
#include "tests/common/daemon_process.h"
#include "tests/common/subprocess.h"
#include "tests/multinode/data_spec.h"

#ifndef EPD_MN_CLIENT_BINARY
#define EPD_MN_CLIENT_BINARY "epd_mn_client"
#endif

namespace epd::multinode {

/// N nodes and the ranks each hosts.
struct Cluster {
  std::vector<std::unique_ptr<testing::DaemonProcess>> daemons;
  std::vector<int> ranks_per_node;

  int num_ranks() const {
    int n = 0;
    for (int r : ranks_per_node) n += r;
    return n;
  }
  /// The node that hosts `rank`.
  int NodeOf(int rank) const {
    for (int i = 0; i < static_cast<int>(ranks_per_node.size()); ++i) {
      if (rank < ranks_per_node[i]) return i;
      rank -= ranks_per_node[i];
    }
    return -1;
  }
  /// The spec's node list: each daemon's Peer address and its ranks.
  std::vector<GroupNode> Nodes() const {
    std::vector<GroupNode> nodes;
    for (size_t i = 0; i < daemons.size(); ++i) {
      nodes.push_back({daemons[i]->peer_address(), ranks_per_node[i]});
    }
    return nodes;
  }
  /// Every daemon's log, headed by its node, for a failure message.
  std::string Logs() const {
    std::string out;
    for (size_t i = 0; i < daemons.size(); ++i) {
      absl::StrAppend(&out, "---- node ", i, " (", daemons[i]->peer_address(), ") log:\n",
                      daemons[i]->Logs());
    }
    return out;
  }
};

/// Starts one daemon per entry of `ranks_per_node` (`backend`, `op_timeout`, and
/// `daemon_args` on every command line), each with its Peer listener; without `peer` a
/// single daemon without one (a one-node group: the harness and the client checked apart
/// from the Peer service).
inline absl::StatusOr<Cluster> StartCluster(std::vector<int> ranks_per_node,
                                            absl::Duration op_timeout = absl::Seconds(5),
                                            bool peer = true,
                                            const std::vector<std::string>& daemon_args = {},
                                            const std::string& backend = "host") {
  testing::DaemonProcessOptions options;
  options.backend = backend;
  options.tcp = false;
  options.log_level = "info";
  options.extra_args = {absl::StrCat("--op_timeout=", absl::ToInt64Milliseconds(op_timeout), "ms")};
  options.extra_args.insert(options.extra_args.end(), daemon_args.begin(), daemon_args.end());
  Cluster cluster;
  if (!peer) {
    if (ranks_per_node.size() != 1) {
      return absl::InvalidArgumentError("StartCluster: without peer, one node only");
    }
    auto daemon = testing::DaemonProcess::Start(options);
    if (!daemon.ok()) return daemon.status();
    cluster.daemons.push_back(*std::move(daemon));
    cluster.ranks_per_node = std::move(ranks_per_node);
    return cluster;
  }
  // A Peer port picked free can be taken before the daemon binds it (another test's
  // ephemeral port, tests run in parallel): then the nodes start again on new ports.
  absl::StatusOr<std::vector<std::unique_ptr<testing::DaemonProcess>>> daemons;
  for (int attempt = 0; attempt < 5; ++attempt) {
    daemons = testing::StartNodes(static_cast<int>(ranks_per_node.size()), options);
    if (daemons.ok() || !absl::StrContains(daemons.status().message(), "cannot listen")) break;
  }
  if (!daemons.ok()) return daemons.status();
  cluster.daemons = *std::move(daemons);
  cluster.ranks_per_node = std::move(ranks_per_node);
  return cluster;
}

/// What each client process of a run gets on its command line.
struct ClientRun {
  std::string group;
  std::string scenario = "ops";
  std::vector<int> tokens;  ///< T of every rank (empty: the client's default).
  bool to_first_node = false;
  uint64_t seed = 1;
  std::vector<std::string> extra_args;
  /// spec.transport the ranks of each node present (empty: "" everywhere).
  std::vector<std::string> node_transports;
};

/// Starts the client process of `rank` (stdin a pipe: closing it stops a loop).
inline absl::StatusOr<std::unique_ptr<testing::Subprocess>> StartClient(const Cluster& cluster,
                                                                        const ClientRun& run,
                                                                        int rank) {
  const int node = cluster.NodeOf(rank);
  // The environment variable of the same name overrides the built-in path (binaries run
  // from another directory, e.g. on a GPU machine).
  const char* binary = std::getenv("EPD_MN_CLIENT_BINARY");
  std::vector<std::string> argv = {
      binary != nullptr && *binary != '\0' ? binary : EPD_MN_CLIENT_BINARY,
      "--socket=" + cluster.daemons[node]->socket_path(),
      "--group=" + run.group,
      "--nodes=" + NodesFlag(cluster.Nodes()),
      absl::StrCat("--rank=", rank),
      "--scenario=" + run.scenario,
      absl::StrCat("--seed=", run.seed),
      absl::StrCat("--to_first_node=", run.to_first_node ? "true" : "false"),
  };
  if (!run.tokens.empty()) argv.push_back("--tokens=" + absl::StrJoin(run.tokens, ","));
  if (!run.node_transports.empty()) argv.push_back("--transport=" + run.node_transports.at(node));
  argv.insert(argv.end(), run.extra_args.begin(), run.extra_args.end());
  // Its output goes to files in its node's daemon directory (removed with the daemon), one
  // pair per start of the rank.
  static int starts = 0;
  const std::string base =
      absl::StrCat(cluster.daemons[node]->dir(), "/client.rank", rank, ".", ++starts);
  testing::SubprocessOptions options;
  options.stdout_path = base + ".stdout";
  options.stderr_path = base + ".stderr";
  options.pipe_stdin = true;
  return testing::Subprocess::Spawn(argv, options);
}

/// Starts every rank's client.
inline absl::StatusOr<std::vector<std::unique_ptr<testing::Subprocess>>> StartClients(
    const Cluster& cluster, const ClientRun& run) {
  std::vector<std::unique_ptr<testing::Subprocess>> clients;
  for (int r = 0; r < cluster.num_ranks(); ++r) {
    auto client = StartClient(cluster, run, r);
    if (!client.ok()) return client.status();
    clients.push_back(*std::move(client));
  }
  return clients;
}

/// Waits for every client to exit (SIGKILLing those still running at `timeout`). OK when
/// each exited 0; otherwise an error holding every rank's exit code and output.
inline absl::Status WaitClients(std::vector<std::unique_ptr<testing::Subprocess>>& clients,
                                absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  bool all_ok = true;
  std::string report;
  for (size_t r = 0; r < clients.size(); ++r) {
    absl::StatusOr<int> code =
        clients[r]->Wait(std::max(deadline - absl::Now(), absl::ZeroDuration()));
    if (!code.ok()) {
      clients[r]->Signal(SIGKILL);
      code = clients[r]->Wait(absl::Seconds(5));
    }
    const bool ok = code.ok() && *code == 0;
    all_ok &= ok;
    absl::StrAppend(&report, "---- rank ", r, ": ",
                    code.ok() ? absl::StrCat("exit ", *code) : std::string("still running"),
                    ok ? "" : " (FAILED)", "\n", clients[r]->Stdout(), clients[r]->Stderr());
  }
  if (all_ok) return absl::OkStatus();
  return absl::InternalError(report);
}

/// The first "ROUND <i> ERROR <op> <CODE> after <ms> ms: <message>" line a loop client
/// (--scenario=loop) printed in `output` after its first `skip` bytes, or "" when there is
/// none yet.
inline std::string FirstErrorLine(const std::string& output, size_t skip = 0) {
  if (skip > output.size()) return "";
  for (absl::string_view line : absl::StrSplit(absl::string_view(output).substr(skip), '\n')) {
    if (absl::StartsWith(line, "ROUND ") && absl::StrContains(line, " ERROR ")) {
      return std::string(line);
    }
  }
  return "";
}

/// The <ms> of an error line (-1 when it has none).
inline int64_t ErrorMillis(const std::string& line) {
  const size_t after = line.find(" after ");
  int64_t ms = -1;
  if (after == std::string::npos) return ms;
  const size_t end = line.find(" ms:", after);
  if (end == std::string::npos) return ms;
  if (!absl::SimpleAtoi(line.substr(after + 7, end - after - 7), &ms)) return -1;
  return ms;
}

/// Polls `client`'s stdout (bounded by `timeout`) for its first error line after `skip`
/// bytes; "" when none came.
inline std::string WaitErrorLine(testing::Subprocess& client, size_t skip, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::string line;
  while ((line = FirstErrorLine(client.Stdout(), skip)).empty() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  return line;
}

}  // namespace epd::multinode
