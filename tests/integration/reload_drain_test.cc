// Config reload and drain against a real epd (docs/OPERATIONS.md "Reloading the
// configuration", "Draining a node"): SIGHUP re-reads the --config file and applies a new
// log level, refuses a field that needs a restart (naming it, keeping the running value),
// keeps the old config when the file is broken, and starts a metrics listener that is then
// scraped; `epctl reload` does the same over Control. `epctl drain` refuses new groups with
// DAEMON_DRAINED while the live group keeps joining ranks and running ops, health turns
// NOT_SERVING, GetStats and epd_draining say so, and `epctl undrain` restores it all; a
// caller who is not root nor epd's uid may do neither.
#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/errors/reason.h"
#include "common/os/scoped_fd.h"
#include "epd/client.h"
#include "epd/v1/control.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"
#include "tests/common/dtypes.h"
#include "tests/common/subprocess.h"
#include "tests/integration/as_other_user.h"
#include "tests/integration/raw_session.h"

namespace epd::testing {
namespace {

using grpc::health::v1::HealthCheckResponse;
using ::testing::HasSubstr;
using ::testing::Not;

/// Occurrences of `text` in `haystack`.
int Count(const std::string& haystack, const std::string& text) {
  int n = 0;
  for (size_t at = haystack.find(text); at != std::string::npos;
       at = haystack.find(text, at + text.size())) {
    ++n;
  }
  return n;
}

/// The value of the sample `name` with label `label`="`value`" (or no label when empty) in
/// `metrics`; -1 when absent.
double MetricValue(const v1::MetricsSnapshot& metrics, const std::string& name,
                   const std::string& label = "", const std::string& value = "") {
  for (const v1::MetricFamily& f : metrics.families()) {
    if (f.name() != name) continue;
    for (const v1::MetricSample& s : f.samples()) {
      if (label.empty() && s.labels().empty()) return s.value();
      for (const v1::MetricLabel& l : s.labels()) {
        if (l.name() == label && l.value() == value) return s.value();
      }
    }
  }
  return -1;
}

class ReloadDrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    audit_dir_ = MakeTempDir("epd_reload_audit_");
    audit_path_ = audit_dir_ + "/audit.log";
  }
  void TearDown() override {
    if (HasFailure() && epd_ != nullptr) std::cerr << "---- epd log ----\n" << epd_->Logs();
    epd_.reset();
    std::filesystem::remove_all(audit_dir_);
  }

  /// Starts epd with `config_text` as its --config file and no --log_level flag (so the
  /// file's log_level is the one in effect), an audit log, and no TCP listener.
  void StartEpd(const std::string& config_text, bool tcp = false) {
    DaemonProcessOptions options;
    options.tcp = tcp;
    options.log_level = "";
    options.config_text = config_text;
    options.extra_args = {"--audit_log=" + audit_path_, "--op_timeout=10s"};
    auto epd = DaemonProcess::Start(options);
    ASSERT_TRUE(epd.ok()) << epd.status();
    epd_ = *std::move(epd);
    stub_ = v1::Control::NewStub(
        grpc::CreateChannel(epd_->unix_target(), grpc::InsecureChannelCredentials()));
  }
  std::string ConfigPath() const { return epd_->dir() + "/epd.textproto"; }
  void WriteConfig(const std::string& text) const { std::ofstream(ConfigPath()) << text; }

  /// Sends SIGHUP and waits until epd logged the reload's outcome.
  void SighupAndWait() {
    const std::string marker = "config reload (SIGHUP)";
    const int before = Count(epd_->Logs(), marker);
    ASSERT_EQ(::kill(epd_->pid(), SIGHUP), 0);
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (Count(epd_->Logs(), marker) == before) {
      ASSERT_LT(absl::Now(), deadline) << "no reload logged after SIGHUP";
      absl::SleepFor(absl::Milliseconds(20));
    }
    ASSERT_TRUE(epd_->Running());
  }
  /// Waits until epd's log contains `text` `times` times (log lines are written when the
  /// action is done, sometimes after the RPC that caused it returned).
  void WaitForLog(const std::string& text, int times = 1) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (Count(epd_->Logs(), text) < times) {
      ASSERT_LT(absl::Now(), deadline) << "not in epd's log: " << text;
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  v1::GetStatsResponse Stats() {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::GetStatsResponse stats;
    grpc::Status status = stub_->GetStats(&context, v1::GetStatsRequest(), &stats);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return stats;
  }
  std::string AuditText() const {
    std::ifstream in(audit_path_);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  CommandResult Epctl(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {EpctlBinary(), "--socket=" + epd_->socket_path()};
    argv.insert(argv.end(), args.begin(), args.end());
    absl::StatusOr<CommandResult> r = RunCommand(argv, absl::Seconds(20));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.value_or(CommandResult{-1, "", ""});
  }

  std::string audit_dir_;
  std::string audit_path_;
  std::unique_ptr<DaemonProcess> epd_;
  std::unique_ptr<v1::Control::Stub> stub_;
};

TEST_F(ReloadDrainTest, SighupAppliesANewLogLevel) {
  StartEpd("log_level: \"info\"\n");
  const std::string debug_line = "client_pid is not the kernel's pid";
  { RawSession at_info(stub_.get(), /*client_pid=*/1); }  // A debug line: not logged.
  WriteConfig("log_level: \"debug\"\n");
  SighupAndWait();
  EXPECT_THAT(epd_->Logs(),
              HasSubstr("config reload: log_level: \"info\" -> log_level: \"debug\""));
  EXPECT_THAT(epd_->Logs(), HasSubstr("config reload (SIGHUP): applied: log_level"));
  EXPECT_EQ(Stats().effective_config().log_level(), "debug");
  EXPECT_EQ(Count(epd_->Logs(), debug_line), 0);
  { RawSession at_debug(stub_.get(), /*client_pid=*/1); }
  WaitForLog(debug_line);
  EXPECT_THAT(AuditText(), HasSubstr("\"action\":\"config_reload\",\"result\":\"OK\""));
  EXPECT_EQ(MetricValue(Stats().metrics(), "epd_config_reloads_total", "result", "ok"), 1);
  EXPECT_EQ(*epd_->Stop(), 0);
}

TEST_F(ReloadDrainTest, SighupRefusesAFieldThatNeedsARestartAndKeepsItsValue) {
  StartEpd("log_level: \"info\"\nmax_sessions_per_uid: 50\n");
  // A field no flag of DaemonProcess sets (a flag would override the file at reload too).
  WriteConfig("log_level: \"info\"\nmax_sessions_per_uid: 7\nmax_request_bytes: 1048576\n");
  SighupAndWait();
  const std::string logs = epd_->Logs();
  EXPECT_THAT(logs, HasSubstr("config reload: max_request_bytes changed (max_request_bytes: "
                              "4194304 -> max_request_bytes: 1048576) but only a restart "
                              "applies it"));
  EXPECT_THAT(logs, HasSubstr("refused, needs a restart: max_request_bytes"));
  const v1::GetStatsResponse stats = Stats();
  EXPECT_EQ(stats.effective_config().max_request_bytes(), 4194304u);
  EXPECT_EQ(stats.effective_config().max_sessions_per_uid(), 7u);  // Live: applied.
  EXPECT_EQ(stats.serving_status(), "SERVING");
  EXPECT_EQ(MetricValue(stats.metrics(), "epd_config_reloads_total", "result", "refused"), 1);
  EXPECT_THAT(AuditText(), HasSubstr("refused (restart needed): max_request_bytes"));
  EXPECT_EQ(*epd_->Stop(), 0);
}

TEST_F(ReloadDrainTest, SighupWithABrokenFileKeepsTheRunningConfig) {
  StartEpd("log_level: \"info\"\nmax_groups: 9\n");
  WriteConfig("log_level: \"info\"\nmax_groups: 3\nmax_grops: 4\n");  // A typo: unknown field.
  SighupAndWait();
  WriteConfig("log_level: \"loud\"\nmax_groups: 3\n");  // Parses; does not validate.
  SighupAndWait();
  std::filesystem::remove(ConfigPath());  // Gone.
  SighupAndWait();
  const std::string logs = epd_->Logs();
  EXPECT_EQ(Count(logs, "config reload (SIGHUP) failed"), 3) << logs;
  EXPECT_THAT(logs, HasSubstr("max_grops"));
  EXPECT_THAT(logs, HasSubstr("log_level"));
  EXPECT_THAT(logs, HasSubstr("nothing was applied, epd runs on as before"));
  const v1::GetStatsResponse stats = Stats();
  EXPECT_EQ(stats.effective_config().max_groups(), 9u);
  EXPECT_EQ(stats.serving_status(), "SERVING");
  EXPECT_EQ(MetricValue(stats.metrics(), "epd_config_reloads_total", "result", "failed"), 3);
  EXPECT_EQ(Count(AuditText(), "\"action\":\"config_reload\",\"result\":\"INVALID_ARGUMENT\""), 2);
  // Fixed: the next reload applies.
  WriteConfig("log_level: \"info\"\nmax_groups: 3\n");
  SighupAndWait();
  EXPECT_EQ(Stats().effective_config().max_groups(), 3u);
  EXPECT_EQ(*epd_->Stop(), 0);
}

TEST_F(ReloadDrainTest, ReloadStartsAScrapeableMetricsListenerAndStopsIt) {
  StartEpd("log_level: \"info\"\n");
  const int port = PickFreeTcpPort();
  ASSERT_GT(port, 0);
  WriteConfig(absl::StrCat("log_level: \"info\"\nmetrics_listen: \"127.0.0.1:", port, "\"\n"));
  // Over Control this time: `epctl reload` as root (an operator).
  CommandResult r = Epctl({"reload"});
  EXPECT_EQ(r.exit_code, 0) << r.stdout_text << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("reload: ok\napplied: metrics_listen\n"));
  httplib::Client http("127.0.0.1", port);
  http.set_connection_timeout(5, 0);
  http.set_read_timeout(5, 0);
  httplib::Result scraped = http.Get("/metrics");
  ASSERT_TRUE(scraped) << httplib::to_string(scraped.error());
  EXPECT_EQ(scraped->status, 200);
  EXPECT_THAT(scraped->body, HasSubstr("epd_config_reloads_total{result=\"ok\"} 1\n"));
  EXPECT_THAT(scraped->body, HasSubstr("epd_draining 0\n"));

  WriteConfig("log_level: \"info\"\n");
  r = Epctl({"--json", "reload"});
  EXPECT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("\"metrics_listen\""));
  httplib::Client gone("127.0.0.1", port);
  gone.set_connection_timeout(1, 0);
  EXPECT_FALSE(gone.Get("/metrics"));
  EXPECT_THAT(AuditText(), HasSubstr("Control.ReloadConfig from"));
  EXPECT_EQ(*epd_->Stop(), 0);
}

// A field the file sets that a flag of epd's sets too (here --op_timeout, which StartEpd
// passes): the flag wins at start-up and at every reload, and both say so, naming the field
// and the flag; a reload said nothing, so an edit of the file seemed ignored.
TEST_F(ReloadDrainTest, AFlagOverridingTheFilesValueIsNamedAtStartAndAtReload) {
  StartEpd("log_level: \"info\"\nop_timeout_ms: 5000\n");
  EXPECT_THAT(epd_->Logs(),
              HasSubstr("op_timeout_ms: set by --op_timeout on the command line (op_timeout_ms: "
                        "10000); the config file's value (op_timeout_ms: 5000) is not applied"));
  WriteConfig("log_level: \"info\"\nop_timeout_ms: 7000\n");
  CommandResult r = Epctl({"reload"});
  EXPECT_EQ(r.exit_code, 0) << r.stdout_text << r.stderr_text;
  EXPECT_THAT(r.stdout_text,
              HasSubstr("reload: ok\napplied: nothing changed\noverridden: op_timeout_ms: set by "
                        "--op_timeout on epd's command line, the file's value is not applied\n"));
  const std::string summary =
      "applied: nothing changed; overridden by the command line, the file's value is not "
      "applied: op_timeout_ms: set by --op_timeout";
  WaitForLog(summary);
  EXPECT_THAT(epd_->Logs(), HasSubstr("the config file's value (op_timeout_ms: 7000) is not "
                                      "applied (the flag wins at a reload as at start-up"));
  r = Epctl({"--json", "reload"});
  EXPECT_THAT(r.stdout_text, HasSubstr("\"flag\": \"--op_timeout\""));
  SighupAndWait();
  WaitForLog(summary, 3);
  EXPECT_EQ(Stats().effective_config().op_timeout_ms(), 10000u);
  EXPECT_THAT(AuditText(), HasSubstr("overridden by the command line"));
  EXPECT_EQ(*epd_->Stop(), 0);
}

// A new metrics_listen that cannot be bound: `epctl reload` prints the daemon's error (code,
// message, reason), not "no epd daemon answers", and exits 1; the running config stays.
TEST_F(ReloadDrainTest, EpctlReloadShowsTheDaemonsErrorWhenMetricsListenCannotBeBound) {
  StartEpd("log_level: \"info\"\n");
  ScopedFd holder(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(holder.valid());
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  ASSERT_EQ(::bind(holder.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(::listen(holder.get(), 1), 0);
  ASSERT_EQ(::getsockname(holder.get(), reinterpret_cast<sockaddr*>(&address), &length), 0);
  const int port = ntohs(address.sin_port);
  WriteConfig(absl::StrCat("log_level: \"info\"\nmetrics_listen: \"127.0.0.1:", port, "\"\n"));
  CommandResult r = Epctl({"reload"});
  EXPECT_EQ(r.exit_code, 1) << r.stdout_text << r.stderr_text;
  EXPECT_THAT(r.stderr_text,
              HasSubstr(absl::StrCat("epctl: UNAVAILABLE: metrics_listen: cannot listen on "
                                     "127.0.0.1:",
                                     port)));
  EXPECT_THAT(r.stderr_text, HasSubstr("the reload changed nothing"));
  EXPECT_THAT(r.stderr_text, HasSubstr("[EPD-4007 CONFIG_INVALID]"));
  EXPECT_THAT(r.stderr_text, Not(HasSubstr("no epd daemon answers")));
  EXPECT_EQ(Stats().effective_config().metrics_listen(), "");
  EXPECT_EQ(*epd_->Stop(), 0);
}

TEST_F(ReloadDrainTest, DrainRefusesNewGroupsKeepsTheLiveOneAndUndrainRestores) {
  StartEpd("log_level: \"info\"\n", /*tcp=*/true);
  ClientOptions client_options;
  client_options.socket_path = epd_->socket_path();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(client_options);
  ASSERT_TRUE(client.ok()) << client.status();
  auto join = [&](const std::string& group, int rank) {
    JoinOptions options;
    options.spec.set_name(group);
    options.spec.set_num_ranks(2);
    options.spec.set_num_experts(4);
    options.spec.set_hidden(128);
    options.spec.set_num_topk(2);
    options.spec.set_max_tokens_per_rank(8);
    options.rank = rank;
    return (*client)->Join(options);
  };
  std::vector<std::unique_ptr<Endpoint>> live;
  absl::StatusOr<std::unique_ptr<Endpoint>> rank0 = join("live", 0);
  ASSERT_TRUE(rank0.ok()) << rank0.status();
  live.push_back(*std::move(rank0));

  CommandResult r = Epctl({"drain"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("drained: live groups are served, new groups are refused"));

  // A new group: refused, with the reason.
  absl::StatusOr<std::unique_ptr<Endpoint>> fresh = join("fresh", 0);
  EXPECT_EQ(fresh.status().code(), absl::StatusCode::kFailedPrecondition) << fresh.status();
  EXPECT_EQ(errors::ReasonOf(fresh.status()), errors::Reason::kDaemonDrained) << fresh.status();
  EXPECT_THAT(std::string(fresh.status().message()), HasSubstr("epctl undrain"));
  // The live group: its other rank joins, and ops run.
  absl::StatusOr<std::unique_ptr<Endpoint>> rank1 = join("live", 1);
  ASSERT_TRUE(rank1.ok()) << rank1.status();
  live.push_back(*std::move(rank1));
  std::vector<std::vector<int64_t>> idx(2, std::vector<int64_t>{0, 1, 2, 3});
  std::vector<int64_t> idx_shape = {2, 2};
  std::vector<DLTensor> idx_t;
  for (int rank = 0; rank < 2; ++rank) {
    idx_t.push_back(MakeDLTensor(idx[rank].data(), kI64, idx_shape));
  }
  std::vector<PendingOp<LayoutResult>> ops;
  for (int rank = 0; rank < 2; ++rank) {
    absl::StatusOr<PendingOp<LayoutResult>> op = live[rank]->GetDispatchLayout(idx_t[rank]);
    ASSERT_TRUE(op.ok()) << op.status();
    ops.push_back(*op);
  }
  for (auto& op : ops) EXPECT_TRUE(op.Wait(absl::Seconds(10)).ok());

  // Health, both listeners: the Control service (readiness, load balancers) is not
  // serving, the process ("", liveness) is: a liveness probe must not restart a drained
  // epd. GetStats, `epctl status`, the gauges.
  EXPECT_EQ(*epd_->CheckHealth("epd.v1.Control"), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(*epd_->CheckHealth("epd.v1.Control", epd_->tcp_target()),
            HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(*epd_->CheckHealth(), HealthCheckResponse::SERVING);
  EXPECT_EQ(*epd_->CheckHealth("", epd_->tcp_target()), HealthCheckResponse::SERVING);
  v1::GetStatsResponse stats = Stats();
  EXPECT_TRUE(stats.draining());
  EXPECT_THAT(stats.serving_status(), HasSubstr("drained by the operator"));
  EXPECT_EQ(MetricValue(stats.metrics(), "epd_draining"), 1);
  EXPECT_EQ(MetricValue(stats.metrics(), "epd_serving"), 1);
  r = Epctl({"status"});
  EXPECT_THAT(r.stdout_text, HasSubstr("drained: yes"));
  r = Epctl({"health", "--service=epd.v1.Control"});
  EXPECT_EQ(r.exit_code, 1);
  r = Epctl({"health"});
  EXPECT_EQ(r.exit_code, 0) << r.stdout_text << r.stderr_text;

  r = Epctl({"drain", "--undo"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("undrained"));
  EXPECT_EQ(*epd_->CheckHealth("epd.v1.Control"), HealthCheckResponse::SERVING);
  EXPECT_EQ(*epd_->CheckHealth("epd.v1.Control", epd_->tcp_target()), HealthCheckResponse::SERVING);
  stats = Stats();
  EXPECT_FALSE(stats.draining());
  EXPECT_EQ(MetricValue(stats.metrics(), "epd_draining"), 0);
  fresh = join("fresh", 0);
  EXPECT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_THAT(Epctl({"status"}).stdout_text, Not(HasSubstr("drained")));
  EXPECT_EQ(Epctl({"undrain"}).exit_code, 0);  // Already: fine.

  const std::string audit = AuditText();
  EXPECT_THAT(audit, HasSubstr("\"action\":\"drain\",\"pid\":"));
  EXPECT_THAT(audit, HasSubstr("\"action\":\"undrain\",\"pid\":"));
  EXPECT_THAT(audit, HasSubstr("\"result\":\"FAILED_PRECONDITION\""));  // The refused join.
  EXPECT_EQ(*epd_->Stop(), 0);
}

/// As another user than root or epd's: drain and reload are refused.
class OperatorOnlyTest : public AsOtherUserTest {};

TEST_F(OperatorOnlyTest, DrainAndReloadNeedRootOrEpdsUid) {
  StartEpd({"--socket_mode=0666"});
  ASSERT_EQ(::chmod(epd_->dir().c_str(), 0755), 0);
  for (const char* command : {"drain", "reload"}) {
    absl::StatusOr<CommandResult> r =
        RunCommand(AsUser(65534, {EpctlBinary(), "--socket=" + epd_->socket_path(), command}),
                   absl::Seconds(20));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->exit_code, 1) << command;
    EXPECT_THAT(r->stderr_text, HasSubstr("NOT_OPERATOR")) << command;
    EXPECT_THAT(r->stderr_text, HasSubstr("uid 65534")) << command;
  }
  EXPECT_EQ(*epd_->CheckHealth(), HealthCheckResponse::SERVING);
}

}  // namespace
}  // namespace epd::testing
