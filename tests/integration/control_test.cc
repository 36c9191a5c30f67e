// Control-plane integration tests: the real epd binary on a temporary socket and
// a free TCP port, real client processes (epd_test_client), real epctl.
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/os/shm_region.h"
#include "common/version.h"
#include "epd/client.h"
#include "epd/v1/control.grpc.pb.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"
#include "tests/common/dtypes.h"

namespace epd::testing {
namespace {

using grpc::health::v1::HealthCheckResponse;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

/// A running epd_test_client process holding one rank.
struct ClientProcess {
  std::string dir;
  std::unique_ptr<Subprocess> process;
};

class ControlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<DaemonProcess>> epd = DaemonProcess::Start();
    ASSERT_TRUE(epd.ok()) << epd.status();
    epd_ = *std::move(epd);
  }
  void TearDown() override {
    if (HasFailure() && epd_ != nullptr) std::cerr << "---- epd log ----\n" << epd_->Logs();
  }

  /// Starts epd_test_client joining `rank` with extra flags (e.g. "--hidden=512").
  std::unique_ptr<Subprocess> StartClient(int rank, std::vector<std::string> flags = {}) {
    std::vector<std::string> argv = {TestClientBinary(), "--socket=" + epd_->socket_path(),
                                     absl::StrCat("--rank=", rank)};
    argv.insert(argv.end(), flags.begin(), flags.end());
    SubprocessOptions options;
    std::string tag = absl::StrCat(next_client_++);
    options.stdout_path = absl::StrCat(epd_->dir(), "/client", tag, ".out");
    options.stderr_path = absl::StrCat(epd_->dir(), "/client", tag, ".err");
    options.pipe_stdin = true;
    absl::StatusOr<std::unique_ptr<Subprocess>> p = Subprocess::Spawn(argv, options);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *std::move(p) : nullptr;
  }
  /// Starts a client and waits until it has joined.
  std::unique_ptr<Subprocess> JoinedClient(int rank, std::vector<std::string> flags = {}) {
    std::unique_ptr<Subprocess> p = StartClient(rank, std::move(flags));
    if (p == nullptr) return nullptr;
    absl::Status joined = p->WaitForOutput("JOINED", absl::Seconds(10));
    EXPECT_TRUE(joined.ok()) << joined;
    return p;
  }

  std::unique_ptr<v1::Control::Stub> Stub(const std::string& target = "") {
    return v1::Control::NewStub(grpc::CreateChannel(target.empty() ? epd_->unix_target() : target,
                                                    grpc::InsecureChannelCredentials()));
  }
  v1::ListGroupsResponse ListGroups() {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::ListGroupsResponse response;
    grpc::Status status = Stub()->ListGroups(&context, v1::ListGroupsRequest(), &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }
  /// Ranks currently joined in `group` (empty when the group does not exist).
  std::vector<int> JoinedRanks(const std::string& group = "g") {
    std::vector<int> ranks;
    const v1::ListGroupsResponse list = ListGroups();
    for (const v1::GroupInfo& g : list.groups()) {
      if (g.spec().name() != group) continue;
      for (const v1::RankInfo& r : g.ranks()) ranks.push_back(r.rank());
    }
    return ranks;
  }
  void ExpectServing() {
    auto health = epd_->CheckHealth("");
    ASSERT_TRUE(health.ok()) << health.status();
    EXPECT_EQ(*health, HealthCheckResponse::SERVING);
  }
  CommandResult Epctl(std::vector<std::string> args) {
    std::vector<std::string> argv = {EpctlBinary(), "--socket=" + epd_->socket_path()};
    argv.insert(argv.end(), args.begin(), args.end());
    absl::StatusOr<CommandResult> result = RunCommand(argv, absl::Seconds(20));
    EXPECT_TRUE(result.ok()) << result.status();
    return result.value_or(CommandResult{-1, "", ""});
  }

  std::unique_ptr<DaemonProcess> epd_;
  int next_client_ = 0;
};

TEST_F(ControlTest, StandardHealthClientSeesServingOnEveryListener) {
  for (const std::string& target : {epd_->unix_target(), epd_->tcp_target()}) {
    for (const std::string& service : {"", "epd.v1.Control"}) {
      auto health = epd_->CheckHealth(service, target);
      ASSERT_TRUE(health.ok()) << target << " " << service << ": " << health.status();
      EXPECT_EQ(*health, HealthCheckResponse::SERVING) << target << " " << service;
    }
  }
  // The default health service answers NOT_FOUND for a service it does not know.
  auto unknown = epd_->CheckHealth("no.such.Service");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ControlTest, EpctlStatusGroupsHealthStatsConfig) {
  CommandResult status = Epctl({"status"});
  EXPECT_EQ(status.exit_code, 0) << status.stderr_text;
  EXPECT_THAT(status.stdout_text,
              AllOf(HasSubstr("SERVING"), HasSubstr("backend: host"), HasSubstr("MPS:"),
                    HasSubstr(absl::StrCat("pid ", epd_->pid())), HasSubstr("GPUs:")));

  // Uptime always has a unit ("up 0s" in the first second; absl alone prints "0").
  EXPECT_THAT(status.stdout_text, ::testing::ContainsRegex("up [0-9]+[hms]"));
  // A stray argument is named; the usage line is not prefixed twice.
  CommandResult extra = Epctl({"status", "extra"});
  EXPECT_EQ(extra.exit_code, 2);
  EXPECT_THAT(extra.stderr_text, HasSubstr("unexpected argument \"extra\""));
  CommandResult version = Epctl({"--version"});
  EXPECT_THAT(version.stdout_text, HasSubstr(absl::StrCat("epctl ", kEpdVersion)));
  CommandResult help = Epctl({"--help"});
  EXPECT_EQ(help.exit_code, 0) << help.stderr_text;
  EXPECT_THAT(help.stdout_text + help.stderr_text,
              AllOf(HasSubstr("epctl: inspect a running epd daemon"),
                    ::testing::Not(HasSubstr("epctl: epctl:"))));

  CommandResult groups = Epctl({"groups"});
  EXPECT_EQ(groups.exit_code, 0) << groups.stderr_text;
  EXPECT_THAT(groups.stdout_text, HasSubstr("no groups"));

  std::unique_ptr<Subprocess> c0 = JoinedClient(0, {"--name=epctl_group"});
  groups = Epctl({"groups"});
  EXPECT_EQ(groups.exit_code, 0);
  EXPECT_THAT(groups.stdout_text, AllOf(HasSubstr("epctl_group"), HasSubstr("1/2"),
                                        HasSubstr(absl::StrCat(c0->pid()))));

  CommandResult health = Epctl({"health"});
  EXPECT_EQ(health.exit_code, 0);
  EXPECT_EQ(health.stdout_text, "SERVING\n");
  // A service name that is not UTF-8 is refused by epctl, naming the flag, before it is sent.
  CommandResult bad_service = Epctl({"health", "--service=epd\xff"});
  EXPECT_EQ(bad_service.exit_code, 2);
  EXPECT_THAT(bad_service.stderr_text, HasSubstr("--service \"epd\\xff\" is not valid UTF-8"));
  EXPECT_THAT(bad_service.stderr_text, Not(HasSubstr("libprotobuf")));

  CommandResult stats = Epctl({"stats"});
  EXPECT_EQ(stats.exit_code, 0);
  EXPECT_THAT(stats.stdout_text, AllOf(HasSubstr("num_groups"), HasSubstr("num_sessions")));

  CommandResult config = Epctl({"config"});
  EXPECT_EQ(config.exit_code, 0);
  EXPECT_THAT(config.stdout_text,
              AllOf(HasSubstr(absl::StrCat("socket_path: \"", epd_->socket_path(), "\"")),
                    HasSubstr("backend: BACKEND_HOST"), HasSubstr("op_timeout_ms: 10000")));

  // The TCP listener works as --socket for health, and refuses Control (no authentication
  // on TCP: Control is served on the unix socket alone).
  absl::StatusOr<CommandResult> over_tcp =
      RunCommand({EpctlBinary(), "--socket=" + epd_->tcp_target(), "health"});
  ASSERT_TRUE(over_tcp.ok());
  EXPECT_EQ(over_tcp->exit_code, 0) << over_tcp->stderr_text;
  auto channel = grpc::CreateChannel(epd_->tcp_target(), grpc::InsecureChannelCredentials());
  auto control = v1::Control::NewStub(channel);
  for (int call = 0; call < 3; ++call) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    grpc::Status status;
    if (call == 0) {
      v1::GetStatsResponse r;
      status = control->GetStats(&context, v1::GetStatsRequest(), &r);
    } else if (call == 1) {
      v1::ListGroupsResponse r;
      status = control->ListGroups(&context, v1::ListGroupsRequest(), &r);
    } else {
      v1::LeaveGroupRequest leave;
      leave.set_group("any");
      v1::LeaveGroupResponse r;
      status = control->LeaveGroup(&context, leave, &r);
    }
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED)
        << "Control call " << call << " over TCP: " << status.error_message();
  }
}

TEST_F(ControlTest, EpctlJson) {
  std::unique_ptr<Subprocess> c0 = JoinedClient(0, {"--name=json_group"});
  CommandResult status = Epctl({"--json", "status"});
  ASSERT_EQ(status.exit_code, 0) << status.stderr_text;
  v1::GetStatsResponse stats;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(status.stdout_text, &stats).ok())
      << status.stdout_text;
  EXPECT_EQ(stats.backend(), "host");
  EXPECT_EQ(stats.pid(), epd_->pid());
  EXPECT_EQ(stats.num_groups(), 1);
  EXPECT_EQ(stats.num_sessions(), 1);
  EXPECT_EQ(stats.serving_status(), "SERVING");
  EXPECT_FALSE(stats.backend_reason().empty());

  CommandResult groups = Epctl({"--json", "groups"});
  ASSERT_EQ(groups.exit_code, 0);
  v1::ListGroupsResponse list;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(groups.stdout_text, &list).ok())
      << groups.stdout_text;
  ASSERT_EQ(list.groups_size(), 1);
  EXPECT_EQ(list.groups(0).spec().name(), "json_group");
  ASSERT_EQ(list.groups(0).ranks_size(), 1);
  EXPECT_EQ(list.groups(0).ranks(0).client_pid(), c0->pid());

  CommandResult config = Epctl({"--json", "config"});
  ASSERT_EQ(config.exit_code, 0);
  v1::DaemonConfig effective;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(config.stdout_text, &effective).ok());
  EXPECT_EQ(effective.socket_path(), epd_->socket_path());

  CommandResult health = Epctl({"--json", "health"});
  EXPECT_EQ(health.exit_code, 0);
  EXPECT_THAT(health.stdout_text, HasSubstr("\"SERVING\""));
}

TEST_F(ControlTest, EpctlExitsNonZeroWhenDaemonIsDown) {
  std::string missing = epd_->dir() + "/nobody.sock";
  for (const std::string& command : {"status", "groups", "health", "stats", "config"}) {
    absl::StatusOr<CommandResult> result =
        RunCommand({EpctlBinary(), "--socket=" + missing, "--timeout=1s", command});
    ASSERT_TRUE(result.ok());
    EXPECT_EQ(result->exit_code, 1) << command;
    EXPECT_THAT(result->stderr_text, AllOf(HasSubstr("no epd daemon"), HasSubstr(missing)))
        << command;
  }
  // A path that is not a socket fails at once, naming it; an empty --socket is a usage error.
  const std::string regular = epd_->dir() + "/regular-file";
  { std::ofstream(regular) << "not a socket\n"; }
  const absl::Time start = absl::Now();
  absl::StatusOr<CommandResult> not_socket =
      RunCommand({EpctlBinary(), "--socket=" + regular, "--timeout=5s", "status"});
  ASSERT_TRUE(not_socket.ok());
  EXPECT_EQ(not_socket->exit_code, 1);
  EXPECT_THAT(not_socket->stderr_text, HasSubstr(regular + " is not a unix socket"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  absl::StatusOr<CommandResult> empty = RunCommand({EpctlBinary(), "--socket=", "status"});
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->exit_code, 2);
  EXPECT_THAT(empty->stderr_text, HasSubstr("--socket is empty"));
  // Also on a TCP port nobody listens on.
  absl::StatusOr<CommandResult> tcp =
      RunCommand({EpctlBinary(), absl::StrCat("--socket=127.0.0.1:", PickFreeTcpPort()),
                  "--timeout=1s", "health"});
  ASSERT_TRUE(tcp.ok());
  EXPECT_EQ(tcp->exit_code, 1);
  EXPECT_THAT(tcp->stderr_text, HasSubstr("no epd daemon"));
}

TEST_F(ControlTest, TwoClientsJoinAndAThirdGetsAlreadyExists) {
  std::unique_ptr<Subprocess> c0 = JoinedClient(0);
  std::unique_ptr<Subprocess> c1 = JoinedClient(1);
  EXPECT_EQ(JoinedRanks(), (std::vector<int>{0, 1}));
  v1::ListGroupsResponse list = ListGroups();
  ASSERT_EQ(list.groups_size(), 1);
  EXPECT_EQ(list.groups(0).ranks(0).client_pid(), c0->pid());
  EXPECT_EQ(list.groups(0).ranks(1).client_pid(), c1->pid());

  std::unique_ptr<Subprocess> c2 = StartClient(1);
  absl::StatusOr<int> code = c2->Wait(absl::Seconds(10));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 4);
  EXPECT_THAT(c2->Stdout(), AllOf(HasSubstr("JOIN_ERROR ALREADY_EXISTS"), HasSubstr("rank 1"),
                                  HasSubstr(absl::StrCat("pid ", c1->pid()))));
  // The holders are untouched.
  EXPECT_EQ(JoinedRanks(), (std::vector<int>{0, 1}));
  EXPECT_TRUE(c0->Running());
  EXPECT_TRUE(c1->Running());
}

TEST_F(ControlTest, KilledClientsRankIsFreeWithinOneSecond) {
  std::unique_ptr<Subprocess> c0 = JoinedClient(0);
  std::unique_ptr<Subprocess> c1 = JoinedClient(1);
  ASSERT_EQ(JoinedRanks(), (std::vector<int>{0, 1}));

  const absl::Time killed = absl::Now();
  c1->Signal(SIGKILL);
  absl::Duration freed_after = absl::InfiniteDuration();
  while (absl::Now() - killed < absl::Seconds(3)) {
    if (JoinedRanks() == std::vector<int>{0}) {
      freed_after = absl::Now() - killed;
      break;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_LT(freed_after, absl::Seconds(1)) << "rank 1 still held after SIGKILL";
  std::cerr << "rank 1 freed " << absl::FormatDuration(freed_after) << " after SIGKILL\n";
  EXPECT_THAT(epd_->Logs(), AllOf(HasSubstr("ended"), HasSubstr("released 1 endpoint(s): g/1")));

  // It can be joined again, and the group kept rank 0 all along.
  std::unique_ptr<Subprocess> c2 = JoinedClient(1);
  EXPECT_EQ(JoinedRanks(), (std::vector<int>{0, 1}));
}

TEST_F(ControlTest, CleanExitAndLeaveFreeRanksAndEmptyGroupIsDestroyed) {
  std::unique_ptr<Subprocess> c0 = JoinedClient(0);
  std::unique_ptr<Subprocess> c1 = JoinedClient(1);
  ASSERT_TRUE(c1->WriteStdin("leave\n").ok());
  ASSERT_TRUE(c1->WaitForOutput("LEFT", absl::Seconds(5)).ok()) << c1->Stdout();
  EXPECT_EQ(JoinedRanks(), (std::vector<int>{0}));
  c0->CloseStdin();  // The client exits normally; its Session ends.
  absl::StatusOr<int> code = c0->Wait(absl::Seconds(5));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
  absl::Time deadline = absl::Now() + absl::Seconds(1);
  while (ListGroups().groups_size() != 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(ListGroups().groups_size(), 0);
  EXPECT_THAT(epd_->Logs(), HasSubstr("group \"g\" destroyed"));
}

TEST_F(ControlTest, MismatchedSpecIsRejected) {
  std::unique_ptr<Subprocess> c0 = JoinedClient(0);
  std::unique_ptr<Subprocess> c1 = StartClient(1, {"--hidden=512", "--num_topk=4"});
  absl::StatusOr<int> code = c1->Wait(absl::Seconds(10));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 4);
  EXPECT_THAT(c1->Stdout(), AllOf(HasSubstr("JOIN_ERROR FAILED_PRECONDITION"),
                                  HasSubstr("hidden: live=256 requested=512"),
                                  HasSubstr("num_topk: live=2 requested=4")));
  // An invalid spec is INVALID_ARGUMENT naming the field; a bad rank too.
  std::unique_ptr<Subprocess> c2 = StartClient(0, {"--name=fp8", "--use_fp8", "--hidden=100"});
  ASSERT_TRUE(c2->Wait(absl::Seconds(10)).ok());
  EXPECT_THAT(c2->Stdout(),
              AllOf(HasSubstr("JOIN_ERROR INVALID_ARGUMENT"), HasSubstr("spec.hidden: 100")));
  std::unique_ptr<Subprocess> c3 = StartClient(5);
  ASSERT_TRUE(c3->Wait(absl::Seconds(10)).ok());
  EXPECT_THAT(c3->Stdout(), AllOf(HasSubstr("JOIN_ERROR INVALID_ARGUMENT"), HasSubstr("rank: 5")));
  std::unique_ptr<Subprocess> c4 = StartClient(1, {"--gpu_uuid=GPU-nope"});
  ASSERT_TRUE(c4->Wait(absl::Seconds(10)).ok());
  EXPECT_THAT(c4->Stdout(), AllOf(HasSubstr("JOIN_ERROR NOT_FOUND"), HasSubstr("GPU-nope")));
  EXPECT_EQ(JoinedRanks(), (std::vector<int>{0}));
}

TEST_F(ControlTest, OversizedBuffersAreResourceExhausted) {
  // H = 65536, M = 2^20 on 4096 ranks: petabytes, never free in host memory.
  std::unique_ptr<Subprocess> c =
      StartClient(0, {"--name=huge", "--num_ranks=4096", "--num_experts=4096", "--hidden=65536",
                      "--max_tokens_per_rank=1048576"});
  ASSERT_TRUE(c->Wait(absl::Seconds(10)).ok());
  // The host backend's group memory (kernel scratch, routing state) is counted first.
  EXPECT_THAT(
      c->Stdout(),
      AllOf(HasSubstr("JOIN_ERROR RESOURCE_EXHAUSTED"), HasSubstr("bytes of epd's private memory"),
            HasSubstr("bytes for rank 0's endpoint"), HasSubstr("bytes free")));
  ExpectServing();
}

TEST_F(ControlTest, SigtermTurnsNotServingThenExitsZero) {
  std::unique_ptr<Subprocess> c0 = JoinedClient(0);
  // Watch health over TCP the way a load balancer does.
  auto channel = grpc::CreateChannel(epd_->tcp_target(), grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  grpc::health::v1::HealthCheckRequest request;
  auto watch = stub->Watch(&context, request);
  HealthCheckResponse response;
  ASSERT_TRUE(watch->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);

  // SIGUSR1 / SIGUSR2 are logged and ignored; SIGHUP reloads the same configuration
  // (nothing changes): epd keeps serving.
  for (int sig : {SIGHUP, SIGUSR1, SIGUSR2}) epd_->process().Signal(sig);
  absl::SleepFor(absl::Milliseconds(200));
  ExpectServing();
  EXPECT_THAT(epd_->Logs(), AllOf(HasSubstr("received SIGHUP: reloading the configuration"),
                                  HasSubstr("config reload (SIGHUP): applied: nothing changed"),
                                  HasSubstr("received SIGUSR1: ignored"),
                                  HasSubstr("received SIGUSR2: ignored")));

  const absl::Time signalled = absl::Now();
  epd_->process().Signal(SIGTERM);
  ASSERT_TRUE(watch->Read(&response)) << "health stream ended without NOT_SERVING";
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
  absl::StatusOr<int> code = epd_->WaitExit(absl::Seconds(5));
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << epd_->Logs();
  EXPECT_EQ(*code, 0);
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(5));
  context.TryCancel();
  EXPECT_THAT(epd_->Logs(), AllOf(HasSubstr("received SIGTERM"), HasSubstr("joins refused"),
                                  HasSubstr("epd stopped")));
  EXPECT_FALSE(std::filesystem::exists(epd_->socket_path()));
}

TEST_F(ControlTest, JoinsAreRefusedWhileDrainingAndClientsSeeTheDaemonGo) {
  ClientOptions options;
  options.socket_path = epd_->socket_path();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  JoinOptions join;
  join.spec.set_name("late");
  join.spec.set_num_ranks(1);
  join.spec.set_num_experts(2);
  join.spec.set_hidden(128);
  join.spec.set_num_topk(1);
  join.spec.set_max_tokens_per_rank(4);
  epd_->process().Signal(SIGTERM);
  // epd keeps answering for its drain grace (500 ms) with health NOT_SERVING.
  absl::SleepFor(absl::Milliseconds(100));
  absl::StatusOr<std::unique_ptr<Endpoint>> endpoint = (*client)->Join(join);
  EXPECT_EQ(endpoint.status().code(), absl::StatusCode::kUnavailable) << endpoint.status();
  EXPECT_THAT(std::string(endpoint.status().message()), HasSubstr("shutting down"));
  absl::StatusOr<int> code = epd_->WaitExit(absl::Seconds(5));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
  // Once it is gone, a new client cannot connect and says where it looked.
  std::unique_ptr<Subprocess> gone = StartClient(0, {"--connect_timeout=1s"});
  ASSERT_TRUE(gone->Wait(absl::Seconds(10)).ok());
  EXPECT_THAT(gone->Stdout(),
              AllOf(HasSubstr("CONNECT_ERROR UNAVAILABLE"), HasSubstr(epd_->socket_path())));
  // And the connected client's next call is UNAVAILABLE too.
  EXPECT_EQ((*client)->Join(join).status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(ControlTest, SecondEpdOnTheSameSocketRefusesToStart) {
  DaemonProcessOptions options;
  options.socket_path = epd_->socket_path();
  options.wait_serving = false;
  absl::StatusOr<std::unique_ptr<DaemonProcess>> second = DaemonProcess::Start(options);
  ASSERT_TRUE(second.ok()) << second.status();
  absl::StatusOr<int> code = (*second)->WaitExit(absl::Seconds(10));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_NE(*code, 0);
  EXPECT_THAT((*second)->Logs(), AllOf(HasSubstr("refusing to start a second epd"),
                                       HasSubstr(absl::StrCat("pid ", epd_->pid()))));
  ExpectServing();  // The first is untouched, socket included.
  CommandResult status = Epctl({"status"});
  EXPECT_EQ(status.exit_code, 0);
  EXPECT_THAT(status.stdout_text, HasSubstr(absl::StrCat("pid ", epd_->pid())));
}

// A running epd whose socket file was deleted serves nobody, but still holds the socket's
// lock: a second epd on the path refuses to start, naming the holder's pid and why.
TEST_F(ControlTest, SecondEpdOnADeletedSocketNamesTheHolder) {
  ASSERT_EQ(::unlink(epd_->socket_path().c_str()), 0);
  DaemonProcessOptions options;
  options.socket_path = epd_->socket_path();
  options.wait_serving = false;
  options.tcp = false;
  absl::StatusOr<std::unique_ptr<DaemonProcess>> second = DaemonProcess::Start(options);
  ASSERT_TRUE(second.ok()) << second.status();
  absl::StatusOr<int> code = (*second)->WaitExit(absl::Seconds(10));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_NE(*code, 0);
  EXPECT_THAT((*second)->Logs(), AllOf(HasSubstr(absl::StrCat("is held by epd pid ", epd_->pid())),
                                       HasSubstr("its socket file was deleted"),
                                       HasSubstr("refusing to start a second epd")));
}

// A second epd whose health listener asks for the first one's TCP port fails to start
// (gRPC's default SO_REUSEPORT would let both listen, and probes reach either).
TEST_F(ControlTest, SecondEpdOnTheSameTcpPortRefusesToStart) {
  ASSERT_GT(epd_->tcp_port(), 0);
  DaemonProcessOptions options;
  options.tcp = false;
  options.extra_args = {absl::StrCat("--listen=127.0.0.1:", epd_->tcp_port())};
  options.wait_serving = false;
  absl::StatusOr<std::unique_ptr<DaemonProcess>> second = DaemonProcess::Start(options);
  ASSERT_TRUE(second.ok()) << second.status();
  absl::StatusOr<int> code = (*second)->WaitExit(absl::Seconds(10));
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << (*second)->Logs();
  EXPECT_NE(*code, 0);
  EXPECT_THAT((*second)->Logs(),
              HasSubstr(absl::StrCat("cannot listen on 127.0.0.1:", epd_->tcp_port())));
  auto health = epd_->CheckHealth("", epd_->tcp_target());
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, HealthCheckResponse::SERVING);
}

// Two epd started at the same instant on a new socket: exactly one serves, and its socket
// file stays (the other must not take or remove it). Whichever exits first (within 10 s)
// is the loser; the other must still run 0.5 s later and serve.
TEST_F(ControlTest, TwoEpdStartedTogetherLeaveExactlyOneServing) {
  for (int round = 0; round < 4; ++round) {
    DaemonProcessOptions options;
    options.socket_path = absl::StrCat(epd_->dir(), "/race", round, ".sock");
    options.wait_serving = false;
    options.tcp = false;
    absl::StatusOr<std::unique_ptr<DaemonProcess>> a = DaemonProcess::Start(options);
    absl::StatusOr<std::unique_ptr<DaemonProcess>> b = DaemonProcess::Start(options);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while ((*a)->Running() && (*b)->Running() && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    const bool a_exited = !(*a)->Running();
    DaemonProcess& loser = a_exited ? **a : **b;
    DaemonProcess& winner = a_exited ? **b : **a;
    absl::StatusOr<int> loser_code = loser.WaitExit(absl::ZeroDuration());
    absl::StatusOr<int> winner_code = winner.WaitExit(absl::Milliseconds(500));
    ASSERT_TRUE(loser_code.ok() && !winner_code.ok())
        << "round " << round << ": exactly one must exit\n"
        << (*a)->Logs() << "\n----\n"
        << (*b)->Logs();
    EXPECT_NE(*loser_code, 0);
    EXPECT_THAT(loser.Logs(), HasSubstr("refusing to start a second epd")) << round;
    EXPECT_TRUE(winner.WaitServing(absl::Seconds(10)).ok()) << round << "\n" << winner.Logs();
    EXPECT_TRUE(std::filesystem::exists(options.socket_path)) << round;
    EXPECT_EQ(winner.Stop().value_or(-1), 0);
  }
}

TEST_F(ControlTest, StaleSocketFileIsReplaced) {
  ASSERT_EQ(epd_->Stop().value_or(-1), 0);
  // Leave a socket file nobody listens on, as a SIGKILLed epd does.
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, epd_->socket_path().c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ::close(fd);
  DaemonProcessOptions options;
  options.socket_path = epd_->socket_path();
  absl::StatusOr<std::unique_ptr<DaemonProcess>> again = DaemonProcess::Start(options);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_THAT((*again)->Logs(), HasSubstr("replacing stale socket file"));
}

/// The lines of /proc/<pid>/maps and the targets of /proc/<pid>/fd/* of process `pid`.
std::vector<std::string> MappingsAndFds(pid_t pid) {
  std::vector<std::string> out;
  std::ifstream maps(absl::StrCat("/proc/", pid, "/maps"));
  for (std::string line; std::getline(maps, line);) out.push_back(line);
  std::error_code ec;
  for (const auto& e :
       std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd"), ec)) {
    out.push_back(std::filesystem::read_symlink(e.path(), ec).string());
  }
  return out;
}

// Endpoint regions and doorbell pages are memfds without a name: while groups are live,
// neither epd nor its clients map or hold anything in /dev/shm (whose files any process
// allowed to open them could truncate), so a killed epd leaves nothing behind either.
TEST_F(ControlTest, NothingOfEpdsIsInDevShmWhileGroupsAreLive) {
  std::unique_ptr<Subprocess> c0 = JoinedClient(0);
  std::unique_ptr<Subprocess> c1 = JoinedClient(1);
  ASSERT_EQ(JoinedRanks(), (std::vector<int>{0, 1}));
  for (const pid_t pid : {epd_->pid(), c0->pid(), c1->pid()}) {
    const std::vector<std::string> seen = MappingsAndFds(pid);
    for (const std::string& line : seen) {
      EXPECT_THAT(line, Not(HasSubstr("/dev/shm/"))) << "pid " << pid;
    }
    // The regions are there, as memfds.
    EXPECT_GE(
        std::count_if(seen.begin(), seen.end(),
                      [](const std::string& l) { return absl::StrContains(l, "/memfd:epd-ep"); }),
        1)
        << "pid " << pid << ": " << ::testing::PrintToString(seen);
    EXPECT_GE(std::count_if(
                  seen.begin(), seen.end(),
                  [](const std::string& l) { return absl::StrContains(l, "/memfd:epd-doorbell"); }),
              1)
        << "pid " << pid;
  }
}

// The TCP listener serves grpc.health.v1 only: a client or epctl pointed at it is told
// to use the unix socket (gRPC alone says UNIMPLEMENTED with an empty message).
TEST_F(ControlTest, ControlOverTheTcpListenerIsExplained) {
  ClientOptions options;
  options.socket_path = epd_->tcp_target();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  ASSERT_FALSE(client.ok());
  EXPECT_TRUE(absl::IsUnavailable(client.status())) << client.status();
  EXPECT_THAT(std::string(client.status().message()),
              HasSubstr("does not serve epd's Control service"));
  CommandResult status = Epctl({"--socket=" + epd_->tcp_target(), "status"});
  EXPECT_NE(status.exit_code, 0);
  EXPECT_THAT(status.stderr_text, HasSubstr("does not serve epd's Control service"));
}

TEST_F(ControlTest, MalformedAndOversizedRequestsLeaveTheDaemonServing) {
  auto channel = grpc::CreateChannel(epd_->unix_target(), grpc::InsecureChannelCredentials());
  // 1. Bytes that are not a JoinGroupRequest.
  {
    grpc::GenericStub generic(channel);
    const std::string garbage = "\xff\xff\xff\xff\x0f garbage \x01\x02";
    grpc::Slice slice(garbage);
    grpc::ByteBuffer request(&slice, 1), response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    std::promise<grpc::Status> done;
    generic.UnaryCall(&context, "/epd.v1.Control/JoinGroup", grpc::StubOptions(), &request,
                      &response, [&](grpc::Status s) { done.set_value(s); });
    grpc::Status status = done.get_future().get();
    EXPECT_FALSE(status.ok());
    ExpectServing();
  }
  // 2. A request larger than max_request_bytes (4 MiB by default).
  {
    auto stub = v1::Control::NewStub(channel);
    v1::JoinGroupRequest request;
    request.mutable_spec()->set_name(std::string(5 << 20, 'x'));
    v1::JoinGroupResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    grpc::Status status = stub->JoinGroup(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
    ExpectServing();
  }
  // 3. Valid protobuf with nonsense values, and no session.
  {
    auto stub = v1::Control::NewStub(channel);
    v1::JoinGroupRequest request;
    request.mutable_spec()->set_name("bad");
    request.mutable_spec()->set_num_ranks(-3);
    request.set_rank(-7);
    v1::JoinGroupResponse response;
    grpc::ClientContext context;
    grpc::Status status = stub->JoinGroup(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), HasSubstr("spec.num_ranks: -3"));
    v1::LeaveGroupRequest leave;
    leave.set_group("nope");
    v1::LeaveGroupResponse left;
    grpc::ClientContext leave_context;
    // No session: refused as JoinGroup refuses it (which groups exist depends on who asks).
    EXPECT_EQ(stub->LeaveGroup(&leave_context, leave, &left).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
    ExpectServing();
  }
  // 4. Raw bytes that are not HTTP/2 on the unix socket and on the TCP port.
  {
    int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, epd_->socket_path().c_str(), sizeof(addr.sun_path) - 1);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    const std::string junk = "GET / HTTP/1.1\r\nHost: epd\r\n\r\n" + std::string(100000, '\x7f');
    ::send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
    ::close(fd);
    ExpectServing();
  }
  // 5. A session stream that sends garbage framing: a client that opens Session and
  // immediately cancels, many times.
  for (int i = 0; i < 20; ++i) {
    auto stub = v1::Control::NewStub(channel);
    grpc::ClientContext context;
    auto stream = stub->Session(&context);
    context.TryCancel();
    stream->Finish().IgnoreError();
  }
  ExpectServing();
  // Still fully functional: a real client joins.
  std::unique_ptr<Subprocess> c0 = JoinedClient(0);
  EXPECT_EQ(JoinedRanks(), (std::vector<int>{0}));
}

TEST(ControlConfigTest, SmallMaxRequestBytesFromConfigFileIsEnforced) {
  DaemonProcessOptions options;
  options.config_text = "max_request_bytes: 65536\nop_timeout_ms: 2000\n";
  absl::StatusOr<std::unique_ptr<DaemonProcess>> epd = DaemonProcess::Start(options);
  ASSERT_TRUE(epd.ok()) << epd.status();
  auto stub = v1::Control::NewStub(
      grpc::CreateChannel((*epd)->unix_target(), grpc::InsecureChannelCredentials()));
  v1::JoinGroupRequest request;
  request.mutable_spec()->set_name(std::string(100000, 'x'));
  v1::JoinGroupResponse response;
  grpc::ClientContext context;
  grpc::Status status = stub->JoinGroup(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  auto health = (*epd)->CheckHealth("");
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(*health, HealthCheckResponse::SERVING);
  absl::StatusOr<CommandResult> config =
      RunCommand({EpctlBinary(), "--socket=" + (*epd)->socket_path(), "config"});
  ASSERT_TRUE(config.ok());
  EXPECT_THAT(config->stdout_text,
              AllOf(HasSubstr("max_request_bytes: 65536"), HasSubstr("op_timeout_ms: 2000")));
}

TEST(ControlConfigTest, BadConfigIsRefusedNamingTheField) {
  DaemonProcessOptions options;
  options.config_text = "socket_colour: \"blue\"\n";
  options.wait_serving = false;
  absl::StatusOr<std::unique_ptr<DaemonProcess>> epd = DaemonProcess::Start(options);
  ASSERT_TRUE(epd.ok());
  absl::StatusOr<int> code = (*epd)->WaitExit(absl::Seconds(10));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 2);
  EXPECT_THAT((*epd)->Logs(), HasSubstr("socket_colour"));
}

// A socket path that does not exist fails at once (not after connect_timeout), naming it.
TEST(ControlClientTest, ConnectWithoutDaemonIsUnavailableNamingTheSocket) {
  ClientOptions options;
  options.socket_path = "/tmp/epd-no-daemon-here.sock";
  options.connect_timeout = absl::Seconds(10);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(client.status().message()),
              AllOf(HasSubstr("/tmp/epd-no-daemon-here.sock"), HasSubstr("does not exist")));
}

// A socket file that nothing listens on (left by an epd that was killed): Client::Connect
// and epctl fail at once with "connection refused", not after their whole timeout.
TEST(ControlClientTest, StaleSocketFileIsUnavailableAtOnce) {
  const std::string path = absl::StrCat("/tmp/epd-stale-", ::getpid(), ".sock");
  ::unlink(path.c_str());
  {  // Bound, never listening, closed: the file stays.
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
    ASSERT_EQ(::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
    ::close(fd);
  }
  ClientOptions options;
  options.socket_path = path;
  options.connect_timeout = absl::Seconds(10);
  absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(client.status().message()),
              AllOf(HasSubstr(path), HasSubstr("connection refused")));
  start = absl::Now();
  absl::StatusOr<CommandResult> epctl =
      RunCommand({EpctlBinary(), "--socket=" + path, "--timeout=10s", "status"}, absl::Seconds(20));
  ASSERT_TRUE(epctl.ok()) << epctl.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_NE(epctl->exit_code, 0);
  EXPECT_THAT(epctl->stderr_text, HasSubstr("connection refused"));
  ::unlink(path.c_str());
}

// epctl's exit codes without a daemon: --help is 0 with the usage on stdout (absl alone
// exits 1); an unknown flag or a value that does not parse is a usage error, 2, naming the
// flag and what a value looks like (absl alone exits 1).
TEST(EpctlFlagsTest, HelpIsZeroAndBadFlagsAreUsageErrors) {
  for (const std::string& flag : {"--help", "-help", "--helpfull"}) {
    absl::StatusOr<CommandResult> help = RunCommand({EpctlBinary(), flag}, absl::Seconds(20));
    ASSERT_TRUE(help.ok()) << help.status();
    EXPECT_EQ(help->exit_code, 0) << flag << ": " << help->stderr_text;
    EXPECT_THAT(help->stdout_text,
                AllOf(HasSubstr("Usage: epctl"), HasSubstr("--timeout"), HasSubstr("--json")))
        << flag;
  }
  const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> cases = {
      {{"--timeout=abc", "status"}, {"--timeout=abc", "5s"}},
      {{"--timeout", "abc", "status"}, {"--timeout=abc", "5s"}},
      {{"--json=maybe", "status"}, {"--json=maybe", "true or false"}},
      {{"--no_such_flag", "status"}, {"unknown flag --no_such_flag"}},
      {{"status", "--timeout"}, {"--timeout needs a value", "5s"}},
      {{"--timeout=0s", "status"}, {"--timeout=0", "must be positive"}},
  };
  for (const auto& [args, messages] : cases) {
    std::vector<std::string> argv = {EpctlBinary(), "--socket=/tmp/epd-no-daemon-here.sock"};
    argv.insert(argv.end(), args.begin(), args.end());
    absl::StatusOr<CommandResult> result = RunCommand(argv, absl::Seconds(20));
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->exit_code, 2) << args[0] << ": " << result->stderr_text;
    for (const std::string& message : messages) {
      EXPECT_THAT(result->stderr_text, HasSubstr(message)) << args[0];
    }
  }
}

// `epctl doctor`'s own arguments: a doctor flag given to another command, --daemon_config
// without --standalone, a --peer_timeout that is not positive, a --peers entry that is not
// host:port and a --sysfs_root that is no directory are usage errors (2) naming the flag,
// before anything runs (they were taken silently).
TEST(EpctlFlagsTest, DoctorRefusesBadArguments) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"status", "--standalone"},
       "--standalone is an option of `epctl doctor`, not of `epctl status`"},
      {{"reload", "--peers=10.0.0.2:7100"}, "--peers is an option of `epctl doctor`"},
      {{"explain", "--list", "--sysfs_root=/sys"}, "--sysfs_root is an option of `epctl doctor`"},
      {{"doctor", "--daemon_config=/etc/epd/epd.textproto"},
       "--daemon_config is read only with --standalone"},
      {{"doctor", "--peer_timeout=0s"}, "--peer_timeout=0 must be more than 0"},
      {{"doctor", "--peer_timeout=-1s"}, "--peer_timeout=-1s must be more than 0"},
      {{"doctor", "--peers=10.0.0.2"}, "--peers: peer address \"10.0.0.2\" is not host:port"},
      {{"doctor", "--peers=10.0.0.2:7100,node3:0"}, "--peers: peer address \"node3:0\""},
      {{"doctor", "--peers="}, "--peers is empty"},
      {{"doctor", "--standalone", "--sysfs_root=/nonexistent-sysfs"},
       "--sysfs_root=/nonexistent-sysfs is not a directory"},
  };
  for (const auto& [args, message] : cases) {
    std::vector<std::string> argv = {EpctlBinary(), "--socket=/tmp/epd-no-daemon-here.sock"};
    argv.insert(argv.end(), args.begin(), args.end());
    absl::StatusOr<CommandResult> result = RunCommand(argv, absl::Seconds(20));
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->exit_code, 2)
        << args[1] << ": " << result->stdout_text << result->stderr_text;
    EXPECT_THAT(result->stderr_text, HasSubstr(message)) << args[1];
    EXPECT_EQ(result->stdout_text, "") << args[1];
  }
}

// A relative --socket that does not exist is reported at once, naming the file (it was
// waited on for the whole --timeout, then "no epd daemon answers").
TEST(EpctlFlagsTest, MissingRelativeSocketIsReportedAtOnce) {
  const std::string name = absl::StrCat("epd-no-such-", ::getpid(), ".sock");
  ASSERT_FALSE(std::filesystem::exists(name));
  for (const std::string& socket : {name, "unix:" + name}) {
    const absl::Time start = absl::Now();
    absl::StatusOr<CommandResult> result = RunCommand(
        {EpctlBinary(), "--socket=" + socket, "--timeout=10s", "status"}, absl::Seconds(30));
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << socket;
    EXPECT_EQ(result->exit_code, 1) << socket;
    EXPECT_THAT(result->stderr_text, AllOf(HasSubstr(name), HasSubstr("does not exist"))) << socket;
  }
}

// A rank removed by epd while its client waits (here a LeaveGroup in the session's name
// from another thread): the wait fails at once with FAILED_PRECONDITION saying so, not with
// "daemon gone" after op_timeout + 5 s; later ops are refused the same way.
TEST_F(ControlTest, ARemovedRanksWaitingOpFailsAtOnceNamingTheRemoval) {
  ClientOptions options;
  options.socket_path = epd_->socket_path();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  JoinOptions join;
  join.spec.set_name("evicted");
  join.spec.set_num_ranks(2);  // Rank 1 never comes: rank 0's op waits (op_timeout 10 s).
  join.spec.set_num_experts(4);
  join.spec.set_hidden(128);
  join.spec.set_num_topk(2);
  join.spec.set_max_tokens_per_rank(8);
  absl::StatusOr<std::unique_ptr<Endpoint>> endpoint = (*client)->Join(join);
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  std::vector<int64_t> idx(4 * 2, 1);
  std::vector<int64_t> shape = {4, 2};
  DLTensor topk_idx = MakeDLTensor(idx.data(), kI64, shape);
  auto op = (*endpoint)->GetDispatchLayout(topk_idx);
  ASSERT_TRUE(op.ok()) << op.status();
  const absl::Time start = absl::Now();
  std::thread evict([&] {
    absl::SleepFor(absl::Milliseconds(200));
    grpc::ClientContext context;
    v1::LeaveGroupRequest leave;
    leave.set_group("evicted");
    leave.set_rank(0);
    leave.set_session_id((*client)->session_id());
    v1::LeaveGroupResponse response;
    EXPECT_TRUE(Stub()->LeaveGroup(&context, leave, &response).ok());
  });
  absl::StatusOr<LayoutResult> result = op->Wait();
  evict.join();
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition) << result.status();
  EXPECT_THAT(std::string(result.status().message()), HasSubstr("was removed from its group"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  auto again = (*endpoint)->GetDispatchLayout(topk_idx);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
}

TEST_F(ControlTest, InProcessClientApi) {
  ClientOptions options;
  options.socket_path = "unix://" + epd_->socket_path();
  options.client_name = "in-process";
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->session_id().size(), 32u);
  absl::StatusOr<v1::GetStatsResponse> stats = (*client)->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->num_sessions(), 1);
  JoinOptions join;
  join.spec.set_name("api");
  join.spec.set_num_ranks(1);
  join.spec.set_num_experts(4);
  join.spec.set_hidden(128);
  join.spec.set_num_topk(2);
  join.spec.set_max_tokens_per_rank(8);
  absl::StatusOr<std::unique_ptr<Endpoint>> endpoint = (*client)->Join(join);
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  EXPECT_EQ((*endpoint)->info().group(), "api");
  absl::StatusOr<v1::ListGroupsResponse> groups = (*client)->ListGroups();
  ASSERT_TRUE(groups.ok());
  ASSERT_EQ(groups->groups_size(), 1);
  EXPECT_EQ(groups->groups(0).ranks(0).client_pid(), ::getpid());
  EXPECT_TRUE((*endpoint)->Leave().ok());
  EXPECT_EQ(JoinedRanks("api"), std::vector<int>{});
  // Not by the TCP listener: it serves grpc.health.v1 only (Control has no authentication).
  options.socket_path = epd_->tcp_target();
  absl::StatusOr<std::unique_ptr<Client>> tcp_client = Client::Connect(options);
  EXPECT_FALSE(tcp_client.ok());
  // Destroying a client ends its session.
  client->reset();
  absl::Time deadline = absl::Now() + absl::Seconds(1);
  int sessions = -1;
  while (absl::Now() < deadline) {
    grpc::ClientContext context;
    v1::GetStatsResponse s;
    ASSERT_TRUE(Stub()->GetStats(&context, v1::GetStatsRequest(), &s).ok());
    sessions = s.num_sessions();
    if (sessions == 0) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(sessions, 0);
}

}  // namespace
}  // namespace epd::testing
