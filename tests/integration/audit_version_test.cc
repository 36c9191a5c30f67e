// The audit log and the version exchange against a real epd: joins, leaves, a refused join,
// the group's creation and destruction, sessions and the drain appear as JSON lines with
// the real pid/uid of the client and the outcome; a client claiming a version epd does not
// serve is refused with FAILED_PRECONDITION naming both versions and the range.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/version.h"
#include "epd/client.h"
#include "epd/v1/control.grpc.pb.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"
#include "tests/common/specs.h"
#include "tests/common/subprocess.h"

namespace epd {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kSecret[] = "audit-test-join-secret-4711";

class AuditVersionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/epd_audit_XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
    audit_path_ = dir_ + "/audit.log";
    testing::DaemonProcessOptions options;
    options.tcp = false;
    options.extra_args = {"--audit_log=" + audit_path_};
    auto epd = testing::DaemonProcess::Start(options);
    ASSERT_TRUE(epd.ok()) << epd.status();
    epd_ = *std::move(epd);
  }
  void TearDown() override {
    if (HasFailure() && epd_ != nullptr) std::cerr << "---- epd log ----\n" << epd_->Logs();
    epd_.reset();
    std::filesystem::remove_all(dir_);
  }

  /// Every line of the audit log, parsed.
  std::vector<google::protobuf::Struct> Lines() const {
    std::vector<google::protobuf::Struct> out;
    std::ifstream in(audit_path_);
    std::string line;
    while (std::getline(in, line)) {
      google::protobuf::Struct parsed;
      EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(line, &parsed).ok()) << line;
      out.push_back(parsed);
    }
    return out;
  }
  std::string Text() const {
    std::ifstream in(audit_path_);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  static std::string Str(const google::protobuf::Struct& s, const std::string& key) {
    auto it = s.fields().find(key);
    return it == s.fields().end() ? "" : it->second.string_value();
  }
  static double Num(const google::protobuf::Struct& s, const std::string& key) {
    auto it = s.fields().find(key);
    return it == s.fields().end() ? -1 : it->second.number_value();
  }
  /// The lines of `action` (and `result` when given).
  std::vector<google::protobuf::Struct> Find(const std::string& action,
                                             const std::string& result = "") const {
    std::vector<google::protobuf::Struct> out;
    for (const auto& s : Lines()) {
      if (Str(s, "action") == action && (result.empty() || Str(s, "result") == result)) {
        out.push_back(s);
      }
    }
    return out;
  }

  std::string dir_;
  std::string audit_path_;
  std::unique_ptr<testing::DaemonProcess> epd_;
};

TEST_F(AuditVersionTest, JoinLeaveAndARefusedJoinAreLoggedWithTheCallersCredentials) {
  ClientOptions options;
  options.socket_path = epd_->socket_path();
  absl::StatusOr<std::unique_ptr<Client>> owner = Client::Connect(options);
  ASSERT_TRUE(owner.ok()) << owner.status();
  absl::StatusOr<std::unique_ptr<Client>> intruder = Client::Connect(options);
  ASSERT_TRUE(intruder.ok()) << intruder.status();

  JoinOptions join;
  join.spec = testing::MakeSpec("audited", {.num_ranks = 2});
  join.rank = 0;
  join.join_secret = kSecret;
  absl::StatusOr<std::unique_ptr<Endpoint>> endpoint = (*owner)->Join(join);
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();

  JoinOptions wrong = join;
  wrong.rank = 1;
  wrong.join_secret = "not-the-secret";
  absl::StatusOr<std::unique_ptr<Endpoint>> refused = (*intruder)->Join(wrong);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();

  ASSERT_TRUE((*endpoint)->Leave().ok());

  const double pid = ::getpid();
  const double uid = ::getuid();
  auto joins = Find("join", "OK");
  ASSERT_EQ(joins.size(), 1u) << Text();
  EXPECT_EQ(Num(joins[0], "pid"), pid);
  EXPECT_EQ(Num(joins[0], "uid"), uid);
  EXPECT_EQ(Num(joins[0], "gid"), static_cast<double>(::getgid()));
  EXPECT_EQ(Str(joins[0], "group"), "audited");
  EXPECT_EQ(Num(joins[0], "rank"), 0);

  auto denied = Find("join", "PERMISSION_DENIED");
  ASSERT_EQ(denied.size(), 1u) << Text();
  EXPECT_EQ(Num(denied[0], "pid"), pid);
  EXPECT_EQ(Num(denied[0], "uid"), uid);
  EXPECT_EQ(Num(denied[0], "rank"), 1);
  EXPECT_THAT(Str(denied[0], "message"), HasSubstr("secret"));

  auto leaves = Find("leave", "OK");
  ASSERT_EQ(leaves.size(), 1u) << Text();
  EXPECT_EQ(Num(leaves[0], "uid"), uid);
  EXPECT_EQ(Find("group_create", "OK").size(), 1u) << Text();
  auto destroyed = Find("group_destroy", "OK");
  ASSERT_EQ(destroyed.size(), 1u) << Text();
  EXPECT_EQ(Str(destroyed[0], "group"), "audited");
  EXPECT_EQ(Find("session_open", "OK").size(), 2u) << Text();

  // Neither secret, nor a whole session id, is ever written.
  const std::string text = Text();
  EXPECT_THAT(text, Not(HasSubstr(kSecret)));
  EXPECT_THAT(text, Not(HasSubstr("not-the-secret")));
  EXPECT_THAT(text, Not(HasSubstr((*owner)->session_id())));

  endpoint->reset();
  owner->reset();
  intruder->reset();
  ASSERT_EQ(*epd_->Stop(), 0);
  EXPECT_EQ(Find("session_close", "OK").size(), 2u) << Text();
  auto drain = Find("drain", "OK");
  ASSERT_EQ(drain.size(), 1u) << Text();
  EXPECT_EQ(Num(drain[0], "uid"), -1) << "a drain on SIGTERM has no caller";
}

TEST_F(AuditVersionTest, AClientOfAnIncompatibleVersionIsRefusedNamingBothVersions) {
  auto channel = grpc::CreateChannel(epd_->unix_target(), grpc::InsecureChannelCredentials());
  auto stub = v1::Control::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  auto stream = stub->Session(&context);
  v1::SessionRequest hello;
  hello.set_client_pid(::getpid());
  hello.set_client_name("from the future");
  hello.set_client_version("99.0.0");
  ASSERT_TRUE(stream->Write(hello));
  v1::SessionResponse response;
  EXPECT_FALSE(stream->Read(&response));
  grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("99.0.0"));
  EXPECT_THAT(status.error_message(), HasSubstr(kEpdVersion));
  absl::StatusOr<Version> daemon = ParseVersion(kEpdVersion);
  ASSERT_TRUE(daemon.ok());
  EXPECT_THAT(status.error_message(), HasSubstr(CompatibleClientVersions(*daemon)));

  auto refused = Find("session_open", "FAILED_PRECONDITION");
  ASSERT_EQ(refused.size(), 1u) << Text();
  EXPECT_EQ(Num(refused[0], "pid"), static_cast<double>(::getpid()));
  EXPECT_EQ(Num(refused[0], "uid"), static_cast<double>(::getuid()));

  // The real client sends its own version and is served; the answer names epd's.
  grpc::ClientContext ok_context;
  ok_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  auto ok_stream = stub->Session(&ok_context);
  hello.set_client_version(kEpdVersion);
  ASSERT_TRUE(ok_stream->Write(hello));
  ASSERT_TRUE(ok_stream->Read(&response));
  EXPECT_EQ(response.event(), "open");
  EXPECT_EQ(response.daemon_version(), kEpdVersion);
  EXPECT_EQ(response.compatible_client_versions(), CompatibleClientVersions(*daemon));
  ok_context.TryCancel();
  ok_stream->Finish().IgnoreError();

  ClientOptions options;
  options.socket_path = epd_->socket_path();
  EXPECT_TRUE(Client::Connect(options).ok());
}

// A SessionRequest whose client_version or client_name is not UTF-8 is refused with
// INVALID_ARGUMENT naming the field, its bytes escaped (as a `string` it failed to parse,
// which ended the stream OK with no session); a stream closed before its first message is
// INVALID_ARGUMENT too, not an OK end.
TEST_F(AuditVersionTest, ASessionRequestThatIsNotUtf8IsRefusedNamingTheField) {
  auto stub = v1::Control::NewStub(
      grpc::CreateChannel(epd_->unix_target(), grpc::InsecureChannelCredentials()));
  auto open = [&](const std::string& name, const std::string& version, bool send) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    auto stream = stub->Session(&context);
    if (send) {
      v1::SessionRequest hello;
      hello.set_client_pid(::getpid());
      hello.set_client_name(name);
      hello.set_client_version(version);
      stream->Write(hello);
    }
    stream->WritesDone();
    v1::SessionResponse response;
    EXPECT_FALSE(stream->Read(&response)) << "a session was opened: " << response.session_id();
    return stream->Finish();
  };
  grpc::Status status = open("utf8", absl::StrCat(kEpdVersion, "\xff"), true);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(),
              AllOf(HasSubstr("SessionRequest.client_version"),
                    HasSubstr(absl::StrCat(kEpdVersion, "\\xff")), HasSubstr("not valid UTF-8")));
  status = open("bad \xc3(", kEpdVersion, true);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(),
              AllOf(HasSubstr("SessionRequest.client_name"), HasSubstr("bad \\xc3(")));
  status = open("", "", false);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("ended before a SessionRequest"));
  EXPECT_EQ(Find("session_open", "INVALID_ARGUMENT").size(), 2u) << Text();
  // Valid UTF-8 (not ASCII) is served.
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  auto stream = stub->Session(&context);
  v1::SessionRequest hello;
  hello.set_client_name("r\xc3\xa9sum\xc3\xa9");
  hello.set_client_version(kEpdVersion);
  ASSERT_TRUE(stream->Write(hello));
  v1::SessionResponse response;
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.event(), "open");
  context.TryCancel();
  stream->Finish().IgnoreError();
}

// A hostile client_version (64 KiB, with a newline and a forged line) from a client that
// reconnects in a loop: every error and audit line names at most its first 64 bytes,
// escaped; the log never gets a raw newline from it, and its "refused" lines are held to
// the uid's control-log budget (a burst, then a steady rate).
TEST_F(AuditVersionTest, AHostileClientVersionIsEchoedCutAndItsLogLinesAreBudgeted) {
  auto stub = v1::Control::NewStub(
      grpc::CreateChannel(epd_->unix_target(), grpc::InsecureChannelCredentials()));
  const std::string version =
      absl::StrCat("9.0.0-\n[2026-12-02 12:00:00.000] [epd.daemon] [error] FORGED ",
                   std::string(64 * 1024, 'v'));
  auto open_refused = [&] {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    auto stream = stub->Session(&context);
    v1::SessionRequest hello;
    hello.set_client_pid(::getpid());
    hello.set_client_version(version);
    stream->Write(hello);
    v1::SessionResponse response;
    EXPECT_FALSE(stream->Read(&response));
    return stream->Finish();
  };
  const grpc::Status first = open_refused();
  EXPECT_EQ(first.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << first.error_message();
  EXPECT_LT(first.error_message().size(), 640u);
  EXPECT_THAT(first.error_message(), HasSubstr("9.0.0-\\n[2026-12-02"));
  EXPECT_THAT(first.error_message(), Not(HasSubstr("\n")));
  // Past the budget's burst (GroupRegistry::kControlLogBurst, 200 lines).
  constexpr int kMoreSessions = 400;
  const absl::Time start = absl::Now();
  for (int i = 0; i < kMoreSessions; ++i) {
    EXPECT_EQ(open_refused().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  ASSERT_EQ(*epd_->Stop(), 0);
  int refused_lines = 0;
  for (absl::string_view line : absl::StrSplit(epd_->Logs(), '\n')) {
    EXPECT_FALSE(absl::StrContains(line, "FORGED") && !absl::StrContains(line, "refused"))
        << "a line forged by the client: " << line;
    EXPECT_LT(line.size(), 1024u);
    if (absl::StrContains(line, "refused: client version")) ++refused_lines;
  }
  EXPECT_LE(refused_lines, 200 + static_cast<int>(20 * seconds) + 1)
      << kMoreSessions + 1 << " refused sessions in " << seconds << " s";
  auto audited = Find("session_open", "FAILED_PRECONDITION");
  EXPECT_EQ(audited.size(), static_cast<size_t>(kMoreSessions + 1)) << "every one is audited";
  for (const google::protobuf::Struct& line : audited) {
    EXPECT_LT(Str(line, "detail").size(), 128u);
    EXPECT_LT(Str(line, "message").size(), 640u);
  }
}

// `epctl doctor` against this epd: the daemon's rows, one line per check, exit 1 with an
// unreachable peer (and its next step), JSON that parses; without a daemon, a failing row
// that points at --standalone.
TEST_F(AuditVersionTest, EpctlDoctorJudgesTheLiveDaemonAndFailsOnAnUnreachablePeer) {
  absl::StatusOr<testing::CommandResult> doctor =
      testing::RunCommand({testing::EpctlBinary(), "--socket=" + epd_->socket_path(), "doctor",
                           "--peers=127.0.0.1:1", "--peer_timeout=1s"},
                          absl::Seconds(30));
  ASSERT_TRUE(doctor.ok()) << doctor.status();
  EXPECT_EQ(doctor->exit_code, 1) << doctor->stdout_text << doctor->stderr_text;
  EXPECT_THAT(doctor->stdout_text, HasSubstr("daemon.serving    ok"));
  EXPECT_THAT(doctor->stdout_text, HasSubstr("daemon.version    ok"));
  EXPECT_THAT(doctor->stdout_text, HasSubstr("limits.nofile"));
  EXPECT_THAT(doctor->stdout_text, HasSubstr("peer.reachable    fail    127.0.0.1:1:"));
  EXPECT_THAT(doctor->stdout_text, HasSubstr("next: is epd running there"));

  absl::StatusOr<testing::CommandResult> json =
      testing::RunCommand({testing::EpctlBinary(), "--socket=" + epd_->socket_path(), "--json",
                           "doctor", "--peers=127.0.0.1:1", "--peer_timeout=1s"},
                          absl::Seconds(30));
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_EQ(json->exit_code, 1);
  google::protobuf::Struct parsed;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json->stdout_text, &parsed).ok())
      << json->stdout_text;
  EXPECT_GE(parsed.fields().at("fail").number_value(), 1);
  EXPECT_THAT(parsed.fields().at("source").string_value(), HasSubstr(epd_->socket_path()));

  absl::StatusOr<testing::CommandResult> down = testing::RunCommand(
      {testing::EpctlBinary(), "--socket=" + dir_ + "/none.sock", "--timeout=1s", "doctor"},
      absl::Seconds(30));
  ASSERT_TRUE(down.ok()) << down.status();
  EXPECT_EQ(down->exit_code, 1);
  EXPECT_THAT(down->stdout_text, HasSubstr("daemon.reachable  fail"));
  EXPECT_THAT(down->stdout_text, HasSubstr("epctl doctor --standalone"));
}

}  // namespace
}  // namespace epd
