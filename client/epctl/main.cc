// epctl: inspect a running epd. Thin: flags → one RPC → print.
//   epctl [--socket=/run/epd/epd.sock] [--json] status|groups|health|stats|metrics|config|doctor
//   epctl [--socket=...] drain [--undo] | undrain | reload      (operator actions)
//   epctl [--json] explain EPD-2003|NAME|--list   (offline: the error catalog)
// Exit status: 0 on success (for `health`: only when SERVING; `--help`, `--version`), 1
// when the daemon is down, not serving or answers with an error, 2 on a usage error (an
// unknown command or flag, a flag value that does not parse).
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/control_channel.h"
#include "client/epctl/doctor_command.h"
#include "client/epctl/explain.h"
#include "client/epctl/format.h"
#include "client/request_text.h"
#include "common/errors/reason.h"
#include "common/version.h"
#include "epd/v1/control.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"

ABSL_FLAG(std::string, socket, "/run/epd/epd.sock",
          "epd's socket: /path, unix:///path, or host:port (its --listen).");
ABSL_FLAG(bool, json, false, "Print JSON (protobuf JSON mapping) instead of tables.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(5), "Deadline of the RPC, connect included.");
ABSL_FLAG(std::string, service, "",
          "health: the service to check (\"\" = the whole daemon, or epd.v1.Control).");
ABSL_FLAG(bool, list, false, "explain: list every reason of the error catalog.");
ABSL_FLAG(bool, undo, false, "drain: undo a drain (the same as `epctl undrain`).");

namespace {

constexpr char kUsage[] =
    "inspect a running epd daemon.\n"
    "Usage: epctl [--socket=/run/epd/epd.sock] [--json] [--timeout=5s] COMMAND\n"
    "Commands:\n"
    "  status   daemon, backend and why, MPS, GPU inventory, transports, RDMA NICs, preflight\n"
    "  groups   live groups and their joined ranks: those your uid owns or holds a rank\n"
    "           of (every group for root and epd's own uid)\n"
    "  health   grpc.health.v1 status; exit 0 only when SERVING (for HEALTHCHECK)\n"
    "  stats    counters\n"
    "  metrics  the metrics registry: ops, latency P50/P95/P99, stragglers, experts, ...\n"
    "           (groups your uid may list; what --metrics_listen serves for all)\n"
    "  config   the daemon's effective DaemonConfig\n"
    "  doctor   pre-flight of this node, one line per check (ok/warn/fail and the next\n"
    "           step); --standalone without a daemon; exit 1 when a check fails\n"
    "  drain    stop creating new groups (live ones are served) and turn health NOT_SERVING,\n"
    "           for maintenance; as root or epd's user\n"
    "  undrain  (or drain --undo) serve new groups again\n"
    "  reload   re-read the configuration (as SIGHUP does): apply the fields that change\n"
    "           live, name those that need a restart; exit 1 unless all applied\n"
    "  explain EPD-2003|NAME|--list\n"
    "           an error reason's cause and next step (docs/ERRORS.md); needs no daemon";

bool IsEpctlFlag(absl::string_view file) { return absl::StrContains(file, "epctl/"); }

/// What a value of each of epctl's flags looks like, for the message refusing a bad one.
std::string ValueExample(absl::string_view name) {
  if (name == "timeout") return "a duration such as 5s, 500ms or 1m30s";
  if (name == "json") return "true or false (--json alone means true, --nojson false)";
  if (name == "socket") return "/run/epd/epd.sock, unix:///path or host:port";
  if (name == "list") return "true or false (--list alone means true)";
  if (name == "undo") return "true or false (--undo alone means true)";
  if (name == "service") return "epd.v1.Control, or \"\" for the whole daemon";
  if (name == "peer_timeout") return "a duration such as 1s or 500ms";
  if (name == "peers") return "host:port,host:port";
  return "what `epctl --help` says";
}

/// epctl --help (and --helpfull, --helpshort, ...): the usage and epctl's own flags on
/// stdout.
void PrintHelp() {
  std::string text = absl::StrCat("epctl: ", kUsage, "\n\nFlags:\n");
  std::vector<absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (IsEpctlFlag(flag->Filename())) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(),
            [](const absl::CommandLineFlag* a, const absl::CommandLineFlag* b) {
              return a->Name() < b->Name();
            });
  for (const absl::CommandLineFlag* flag : flags) {
    absl::StrAppend(&text, "  --", flag->Name(), "  ", flag->Help(), " (default: \"",
                    flag->DefaultValue(), "\")\n");
  }
  absl::StrAppend(&text, "  --version  print epctl's version\n  --help  this text\n");
  std::fwrite(text.data(), 1, text.size(), stdout);
}

/// Looks at the flags before absl::ParseCommandLine does, because absl exits with code 1
/// both for --help and for a flag it cannot parse. Returns the exit code when epctl must
/// exit now (0 after --help; 2 for an unknown flag or a bad value, with a message naming
/// the flag and what a value looks like), or -1 to go on. The names of the flags given go
/// into `given`.
int CheckFlags(int argc, char** argv, std::set<std::string>* given) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') continue;  // A command (or "-").
    arg.remove_prefix(arg[1] == '-' ? 2 : 1);
    const size_t eq = arg.find('=');
    const absl::string_view name = arg.substr(0, eq);
    const bool has_value = eq != absl::string_view::npos;
    absl::string_view value = has_value ? arg.substr(eq + 1) : absl::string_view();
    if (name == "help" || name == "helpfull" || name == "helpshort" || name == "helppackage" ||
        name == "helpon" || name == "helpmatch") {
      PrintHelp();
      return 0;
    }
    // absl's own flags (--version, --flagfile, ...): absl parses them.
    if (name == "version" || name == "only_check_args") continue;
    if (name == "flagfile" || name == "fromenv" || name == "tryfromenv" || name == "undefok") {
      if (!has_value) ++i;
      continue;
    }
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && absl::StartsWith(name, "no") && !has_value) {
      absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name.substr(2));
      if (negated != nullptr && negated->IsOfType<bool>()) {  // --nojson
        given->insert(std::string(negated->Name()));
        continue;
      }
    }
    if (flag == nullptr || flag->IsRetired()) {
      std::fprintf(stderr, "epctl: unknown flag --%s (epctl --help lists the flags)\n",
                   std::string(name).c_str());
      return 2;
    }
    given->insert(std::string(flag->Name()));
    if (flag->IsOfType<bool>() && !has_value) continue;  // --json
    if (!has_value) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "epctl: --%s needs a value: %s\n", std::string(name).c_str(),
                     ValueExample(name).c_str());
        return 2;
      }
      value = argv[++i];
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      std::fprintf(stderr, "epctl: --%s=%s is not a valid value; a value looks like %s\n",
                   std::string(name).c_str(), std::string(value).c_str(),
                   ValueExample(name).c_str());
      return 2;
    }
  }
  return -1;
}

int Fail(const std::string& message) {
  std::fprintf(stderr, "epctl: %s\n", message.c_str());
  return 1;
}

std::chrono::system_clock::time_point Deadline() {
  return absl::ToChronoTime(absl::Now() + absl::GetFlag(FLAGS_timeout));
}

/// Connects to the daemon; prints why and returns null when nothing answers.
std::shared_ptr<grpc::Channel> Connect(const std::string& target) {
  if (absl::Status st = epd::internal::CheckUnixSocket(target, "--socket"); !st.ok()) {
    Fail(std::string(st.message()));
    return nullptr;
  }
  auto channel = epd::internal::MakeControlChannel(target);
  if (!channel->WaitForConnected(Deadline())) {
    Fail(absl::StrCat("no epd daemon answers on ", target, " within ",
                      absl::FormatDuration(absl::GetFlag(FLAGS_timeout)),
                      " (is epd running? is --socket right?)"));
    return nullptr;
  }
  return channel;
}

int RpcFailed(const grpc::Status& status, const std::string& target) {
  return Fail(epd::errors::StatusText(
      epd::internal::ExplainControlError(epd::internal::FromGrpcStatus(status), target)));
}

void Print(const std::string& text) { std::fwrite(text.data(), 1, text.size(), stdout); }

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = IsEpctlFlag;
  usage.contains_helpshort_flags = usage.contains_help_flags;
  usage.version_string = [] { return std::string("epctl ") + epd::kEpdVersion + "\n"; };
  usage.normalize_filename = [](absl::string_view file) {
    const size_t at = file.rfind("epctl/");
    return std::string(at == absl::string_view::npos ? file : file.substr(at));
  };
  absl::SetFlagsUsageConfig(usage);
  std::set<std::string> given;  // The flags the command line names.
  if (const int exit_code = CheckFlags(argc, argv, &given); exit_code >= 0) return exit_code;
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() >= 2 && absl::string_view(args[1]) == "explain") {
    if (const int exit_code = epd::epctl::CheckDoctorArguments("explain", given); exit_code >= 0) {
      return exit_code;
    }
    const bool list = absl::GetFlag(FLAGS_list);
    if (args.size() != (list ? 2u : 3u)) {
      std::fprintf(stderr, "epctl: explain takes one reason (EPD-2003 or its name) or --list\n");
      return 2;
    }
    return epd::epctl::RunExplain(list ? "" : args[2], list, absl::GetFlag(FLAGS_json));
  }
  if (args.size() != 2) {
    if (args.size() > 2) std::fprintf(stderr, "epctl: unexpected argument \"%s\"\n", args[2]);
    std::fprintf(stderr, "epctl: %s\n", kUsage);
    return 2;
  }
  const std::string command = args[1];
  const bool json = absl::GetFlag(FLAGS_json);
  if (absl::GetFlag(FLAGS_timeout) <= absl::ZeroDuration()) {
    std::fprintf(stderr, "epctl: --timeout=%s must be positive (e.g. 5s)\n",
                 absl::FormatDuration(absl::GetFlag(FLAGS_timeout)).c_str());
    return 2;
  }
  if (command != "status" && command != "groups" && command != "health" && command != "stats" &&
      command != "metrics" && command != "config" && command != "doctor" && command != "drain" &&
      command != "undrain" && command != "reload") {
    std::fprintf(stderr, "epctl: unknown command \"%s\"\nepctl: %s\n", command.c_str(), kUsage);
    return 2;
  }
  if (absl::GetFlag(FLAGS_socket).empty()) {
    std::fprintf(stderr, "epctl: --socket is empty; give epd's socket path or host:port\n");
    return 2;
  }
  if (const int exit_code = epd::epctl::CheckDoctorArguments(command, given); exit_code >= 0) {
    return exit_code;
  }
  const std::string target = epd::internal::ChannelTarget(absl::GetFlag(FLAGS_socket));
  if (command == "doctor") return epd::epctl::RunDoctor(target, json, absl::GetFlag(FLAGS_timeout));
  std::shared_ptr<grpc::Channel> channel = Connect(target);
  if (channel == nullptr) return 1;

  if (command == "health") {
    if (absl::Status text = epd::internal::CheckRequestText(
            "--service", absl::GetFlag(FLAGS_service), std::numeric_limits<size_t>::max());
        !text.ok()) {
      std::fprintf(stderr, "epctl: %s\n", std::string(text.message()).c_str());
      return 2;
    }
    auto stub = grpc::health::v1::Health::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(absl::GetFlag(FLAGS_service));
    grpc::health::v1::HealthCheckResponse response;
    grpc::Status status = stub->Check(&context, request, &response);
    if (!status.ok()) return RpcFailed(status, target);
    const std::string name =
        grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
    Print(json ? epd::epctl::JsonOutput(response) : name + "\n");
    return response.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
  }

  auto stub = epd::v1::Control::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(Deadline());
  if (command == "drain" || command == "undrain") {
    epd::v1::DrainRequest request;
    request.set_drain(command == "drain" && !absl::GetFlag(FLAGS_undo));
    epd::v1::DrainResponse response;
    grpc::Status status = stub->Drain(&context, request, &response);
    if (!status.ok()) return RpcFailed(status, target);
    Print(json ? epd::epctl::JsonOutput(response) : epd::epctl::FormatDrain(response));
    return 0;
  }
  if (command == "reload") {
    epd::v1::ReloadConfigResponse response;
    grpc::Status status = stub->ReloadConfig(&context, epd::v1::ReloadConfigRequest(), &response);
    if (!status.ok()) return RpcFailed(status, target);
    Print(json ? epd::epctl::JsonOutput(response) : epd::epctl::FormatReload(response));
    return response.result() == "ok" ? 0 : 1;
  }
  if (command == "groups") {
    epd::v1::ListGroupsResponse groups;
    grpc::Status status = stub->ListGroups(&context, epd::v1::ListGroupsRequest(), &groups);
    if (!status.ok()) return RpcFailed(status, target);
    Print(json ? epd::epctl::JsonOutput(groups) : epd::epctl::FormatGroups(groups));
    return 0;
  }
  epd::v1::GetStatsResponse stats;
  grpc::Status status = stub->GetStats(&context, epd::v1::GetStatsRequest(), &stats);
  if (!status.ok()) return RpcFailed(status, target);
  if (command == "metrics") {
    Print(json ? epd::epctl::JsonOutput(stats.metrics())
               : epd::epctl::FormatMetrics(stats.metrics()));
    return 0;
  }
  stats.clear_metrics();  // `epctl metrics` shows them.
  if (command == "status") {
    Print(json ? epd::epctl::JsonOutput(stats) : epd::epctl::FormatStatus(stats, target));
  } else if (command == "stats") {
    stats.clear_effective_config();
    Print(json ? epd::epctl::JsonOutput(stats) : epd::epctl::FormatStats(stats));
  } else {
    Print(json ? epd::epctl::JsonOutput(stats.effective_config())
               : epd::epctl::FormatConfig(stats.effective_config()));
  }
  return 0;
}
