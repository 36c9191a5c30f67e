// `epctl doctor`: gathers the facts (a live epd's GetStats and ListGroups plus what epctl
// reads on the node, or everything itself with --standalone), runs the checks (doctor.h)
// and prints them. Exit 1 when any check fails.
#include "client/epctl/doctor_command.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <set>
#include <string>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/control_channel.h"
#include "client/epctl/doctor.h"
#include "client/epctl/doctor_facts.h"
#include "epd/v1/control.grpc.pb.h"

ABSL_FLAG(bool, standalone, false,
          "doctor: probe this node without asking epd (before epd runs: an init container).");
ABSL_FLAG(std::string, peers, "",
          "doctor: comma-separated host:port of the other nodes' Peer listeners to try a TCP "
          "connect to (besides the nodes of this epd's live groups).");
ABSL_FLAG(absl::Duration, peer_timeout, absl::Seconds(1),
          "doctor: how long each TCP connect to a peer may take.");
ABSL_FLAG(std::string, daemon_config, "",
          "doctor --standalone: epd's --config file (DaemonConfig text), for its transport, "
          "rdma and peer settings.");
ABSL_FLAG(std::string, sysfs_root, "/sys",
          "doctor: where sysfs is (a container may mount the host's at /host/sys).");

#ifndef EPD_CUDA_ARCHITECTURES
#define EPD_CUDA_ARCHITECTURES ""
#endif

namespace epd::epctl {
namespace {

/// The unreachable daemon as a result, so that the table still says what to do.
std::vector<CheckResult> DaemonDown(const std::string& why) {
  return {{"daemon.reachable", Verdict::kFail, why,
           "start epd (systemctl start epd), fix --socket, or run `epctl doctor --standalone` "
           "to check the node without it"}};
}

/// Refuses a bad doctor argument: prints "epctl: <message>" on stderr, returns 2.
int Refuse(const std::string& message) {
  std::fprintf(stderr, "epctl: %s\n", message.c_str());
  return 2;
}

}  // namespace

int CheckDoctorArguments(absl::string_view command, const std::set<std::string>& given) {
  const auto is_given = [&given](const char* name) { return given.count(name) > 0; };
  constexpr const char* kDoctorFlags[] = {"standalone", "peers", "peer_timeout", "daemon_config",
                                          "sysfs_root"};
  if (command != "doctor") {
    for (const char* name : kDoctorFlags) {
      if (is_given(name)) {
        return Refuse(absl::StrCat("--", name, " is an option of `epctl doctor`, not of `epctl ",
                                   command, "` (epctl --help)"));
      }
    }
    return -1;
  }
  if (is_given("daemon_config") && !absl::GetFlag(FLAGS_standalone)) {
    return Refuse(
        "--daemon_config is read only with --standalone (a running epd reports its own "
        "configuration): add --standalone, or leave --daemon_config out");
  }
  if (const absl::Duration t = absl::GetFlag(FLAGS_peer_timeout);
      t <= absl::ZeroDuration() || t > absl::Minutes(1)) {
    return Refuse(absl::StrCat("--peer_timeout=", absl::FormatDuration(t),
                               " must be more than 0 and at most 1m (e.g. 1s or 500ms)"));
  }
  const std::string peers = absl::GetFlag(FLAGS_peers);
  if (is_given("peers") && absl::StripAsciiWhitespace(peers).empty()) {
    return Refuse("--peers is empty; give host:port,host:port or leave it out");
  }
  for (absl::string_view peer : absl::StrSplit(peers, ',', absl::SkipWhitespace())) {
    absl::StatusOr<std::pair<std::string, std::string>> hp =
        SplitHostPort(std::string(absl::StripAsciiWhitespace(peer)));
    if (!hp.ok()) return Refuse(absl::StrCat("--peers: ", hp.status().message()));
  }
  const std::string sysfs = absl::GetFlag(FLAGS_sysfs_root);
  struct stat st {};
  if (sysfs.empty() || ::stat(sysfs.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return Refuse(absl::StrCat("--sysfs_root=", sysfs,
                               " is not a directory (sysfs: /sys, or where a container mounts "
                               "the host's, e.g. /host/sys)"));
  }
  return -1;
}

int RunDoctor(const std::string& target, bool json, absl::Duration timeout) {
  NodePaths paths;
  paths.sysfs_root = absl::GetFlag(FLAGS_sysfs_root);
  std::vector<std::string> peers =
      absl::StrSplit(absl::GetFlag(FLAGS_peers), ',', absl::SkipWhitespace());
  DoctorFacts facts;
  std::vector<CheckResult> results;
  if (absl::GetFlag(FLAGS_standalone)) {
    v1::DaemonConfig config;
    if (const std::string path = absl::GetFlag(FLAGS_daemon_config); !path.empty()) {
      absl::StatusOr<v1::DaemonConfig> read = ReadDaemonConfigText(path);
      if (!read.ok()) {
        std::fprintf(stderr, "epctl: --daemon_config: %s\n",
                     std::string(read.status().message()).c_str());
        return 2;
      }
      config = *std::move(read);
    }
    facts = GatherStandaloneFacts(paths, std::move(config), EPD_CUDA_ARCHITECTURES);
  } else {
    const auto deadline = absl::ToChronoTime(absl::Now() + timeout);
    auto channel = internal::MakeControlChannel(target);
    absl::Status socket = internal::CheckUnixSocket(target, "--socket");
    v1::GetStatsResponse stats;
    v1::ListGroupsResponse groups;
    grpc::Status status = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                       absl::StrCat("no epd daemon answers on ", target, " within ",
                                                    absl::FormatDuration(timeout)));
    if (!socket.ok()) {
      status = grpc::Status(grpc::StatusCode::UNAVAILABLE, std::string(socket.message()));
    } else if (channel->WaitForConnected(deadline)) {
      auto stub = v1::Control::NewStub(channel);
      grpc::ClientContext context;
      context.set_deadline(deadline);
      status = stub->GetStats(&context, v1::GetStatsRequest(), &stats);
      grpc::ClientContext list_context;
      list_context.set_deadline(deadline);
      if (status.ok() && stub->ListGroups(&list_context, v1::ListGroupsRequest(), &groups).ok()) {
        for (const v1::GroupInfo& group : groups.groups()) {
          for (const v1::GroupNodeInfo& node : group.nodes()) {
            if (node.state() == v1::NODE_STATE_SELF) continue;
            if (std::find(peers.begin(), peers.end(), node.peer_address()) == peers.end()) {
              peers.push_back(node.peer_address());
            }
          }
        }
      }
    }
    if (!status.ok()) {
      facts.source = absl::StrCat("epd on ", target);
      results = DaemonDown(status.error_message());
    } else {
      facts = FactsFromStats(stats, target);
      facts.built_cuda_architectures = EPD_CUDA_ARCHITECTURES;
      // A daemon older than these fields reports 0: epctl, on the same node, asks itself.
      if (stats.memlock_limit_bytes() == 0 || stats.fd_limit() == 0) {
        DoctorFacts own = GatherStandaloneFacts(paths, facts.config, "");
        if (stats.memlock_limit_bytes() == 0) facts.memlock_bytes = own.memlock_bytes;
        if (stats.fd_limit() == 0) facts.fd_limit = own.fd_limit;
      }
      facts.ports = transport::ScanRdmaPorts(paths.sysfs_root);
      GatherLocalFacts(paths, &facts);
    }
  }
  if (results.empty()) {
    facts.peers = ProbePeers(peers, absl::GetFlag(FLAGS_peer_timeout));
    results = RunDoctorChecks(facts);
  }
  const std::string text = json ? DoctorJson(facts, results) : FormatDoctor(facts, results);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return AnyFailed(results) ? 1 : 0;
}

}  // namespace epd::epctl
