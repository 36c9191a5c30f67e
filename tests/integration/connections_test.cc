// epd's own listener and descriptor budget, against the real epd (host backend):
//   - a session's pid is the kernel's (SO_PEERCRED), not the one the client sends;
//   - a connection flood (thousands held, thousands opened and closed, garbage, and
//     connections that never send a byte) leaves health SERVING and a client joining and
//     running ops; the silent connections are closed by epd within seconds;
//   - with a low RLIMIT_NOFILE, epd raises its soft limit to the hard one; joins that do not
//     map their endpoints are refused with RESOURCE_EXHAUSTED naming the descriptors while
//     health stays reachable, and joins work again once the offending session ends;
//   - once every descriptor is taken, new connections get a clean close (no hang, logged
//     rate-limited) and epd accepts again as soon as descriptors are free;
//   - endpoints never mapped expire after unmapped_endpoint_timeout_ms; mapped ones stay.
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/os/shm_region.h"
#include "epd/client.h"
#include "epd/v1/control.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"
#include "tests/common/dtypes.h"
#include "tests/common/specs.h"
#include "tests/common/unix_socket.h"
#include "tests/integration/raw_session.h"

namespace epd::testing {
namespace {

using grpc::health::v1::HealthCheckResponse;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr std::string_view kPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

v1::GroupSpec Spec(const std::string& name, int ranks) {
  return testing::MakeSpec(name, {.num_ranks = ranks,
                                  .num_experts = ranks,
                                  .hidden = 128,
                                  .num_topk = 1,
                                  .max_tokens_per_rank = 4});
}

class ConnectionsTest : public ::testing::Test {
 protected:
  void TearDown() override {
    if (HasFailure() && epd_ != nullptr) std::cerr << "---- epd log ----\n" << epd_->Logs();
  }
  void StartEpd(DaemonProcessOptions options = {}) {
    auto epd = DaemonProcess::Start(std::move(options));
    ASSERT_TRUE(epd.ok()) << epd.status();
    epd_ = *std::move(epd);
    stub_ = v1::Control::NewStub(
        grpc::CreateChannel(epd_->unix_target(), grpc::InsecureChannelCredentials()));
  }
  grpc::Status Join(const RawSession& session, const v1::GroupSpec& spec, int rank) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::JoinGroupRequest request;
    *request.mutable_spec() = spec;
    request.set_rank(rank);
    request.set_session_id(session.id());
    v1::JoinGroupResponse response;
    return stub_->JoinGroup(&context, request, &response);
  }
  v1::ListGroupsResponse ListGroups() {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ListGroupsResponse response;
    EXPECT_TRUE(stub_->ListGroups(&context, v1::ListGroupsRequest(), &response).ok());
    return response;
  }
  /// Health of "" on a new unix connection, and on the TCP listener.
  void ExpectServing(const std::string& when) {
    auto unix_health = epd_->CheckHealth("", "", absl::Seconds(5));
    ASSERT_TRUE(unix_health.ok()) << when << ": " << unix_health.status();
    EXPECT_EQ(*unix_health, HealthCheckResponse::SERVING) << when;
    auto tcp_health = epd_->CheckHealth("", epd_->tcp_target(), absl::Seconds(5));
    ASSERT_TRUE(tcp_health.ok()) << when << ": " << tcp_health.status();
    EXPECT_EQ(*tcp_health, HealthCheckResponse::SERVING) << when;
  }
  /// A new client process's work: Connect, Join a one-rank group, run `ops` ops, leave.
  void ClientJoinsAndRunsOps(const std::string& group, int ops) {
    ClientOptions options;
    options.socket_path = epd_->socket_path();
    options.connect_timeout = absl::Seconds(10);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
    ASSERT_TRUE(client.ok()) << client.status();
    JoinOptions join;
    join.spec = Spec(group, 1);
    join.spec.set_num_experts(4);
    join.spec.set_num_topk(2);
    absl::StatusOr<std::unique_ptr<Endpoint>> endpoint = (*client)->Join(join);
    ASSERT_TRUE(endpoint.ok()) << endpoint.status();
    std::vector<int64_t> idx = {0, 1, 2, 3, 1, 2, 3, 0};
    std::vector<int64_t> shape = {4, 2};
    DLTensor topk_idx = MakeDLTensor(idx.data(), kI64, shape);
    for (int i = 0; i < ops; ++i) {
      auto op = (*endpoint)->GetDispatchLayout(topk_idx);
      ASSERT_TRUE(op.ok()) << op.status();
      absl::StatusOr<LayoutResult> layout = op->Wait();
      ASSERT_TRUE(layout.ok()) << layout.status();
      EXPECT_EQ(layout->num_tokens_per_expert.as<int32_t>()[1], 2);
    }
    EXPECT_TRUE((*endpoint)->Leave().ok());
  }
  /// epd's "Max open files" soft and hard limits from /proc/<pid>/limits.
  std::pair<std::string, std::string> EpdFdLimits() {
    std::ifstream in(absl::StrCat("/proc/", epd_->pid(), "/limits"));
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("Max open files", 0) != 0) continue;
      std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (words.size() >= 5) return {words[3], words[4]};
    }
    return {"?", "?"};
  }

  std::unique_ptr<DaemonProcess> epd_;
  std::unique_ptr<v1::Control::Stub> stub_;
};

TEST_F(ConnectionsTest, SessionPidIsTheKernelsNotTheOneTheClientSends) {
  ASSERT_NO_FATAL_FAILURE(StartEpd());
  RawSession liar(stub_.get(), /*client_pid=*/999999, "liar");
  ASSERT_TRUE(Join(liar, Spec("creds", 2), 0).ok());
  v1::ListGroupsResponse groups = ListGroups();
  ASSERT_EQ(groups.groups_size(), 1);
  ASSERT_EQ(groups.groups(0).ranks_size(), 1);
  EXPECT_EQ(groups.groups(0).ranks(0).client_pid(), ::getpid());
  EXPECT_EQ(groups.groups(0).ranks(0).uid(), ::geteuid());
  EXPECT_EQ(groups.groups(0).owner_uid(), ::geteuid());
  EXPECT_THAT(epd_->Logs(), HasSubstr(absl::StrCat("(pid ", ::getpid(), " uid ", ::geteuid(),
                                                   " gid ", ::getegid(), ", name \"liar\")")));
  EXPECT_THAT(epd_->Logs(), ::testing::Not(HasSubstr("999999")));
}

TEST_F(ConnectionsTest, ConnectionFloodLeavesHealthServingAndClientsWorking) {
  ASSERT_NO_FATAL_FAILURE(StartEpd());
  constexpr int kHeldGrpc = 1500;
  constexpr int kSilent = 1000;
  constexpr int kChurn = 4000;
  // Held: connections that opened HTTP/2 (gRPC owns them) and then say nothing more.
  std::vector<ScopedFd> held;
  for (int i = 0; i < kHeldGrpc; ++i) {
    held.push_back(ConnectUnix(epd_->socket_path()));
    ASSERT_TRUE(held.back().valid()) << "connection " << i;
    ASSERT_EQ(::send(held.back().get(), kPreface.data(), kPreface.size(), MSG_NOSIGNAL),
              ssize_t(kPreface.size()));
  }
  // Silent: connections that never send a byte.
  std::vector<ScopedFd> silent;
  for (int i = 0; i < kSilent; ++i) {
    silent.push_back(ConnectUnix(epd_->socket_path()));
    ASSERT_TRUE(silent.back().valid()) << "silent connection " << i;
  }
  const absl::Time silent_since = absl::Now();
  // Health, watched on the TCP listener and by GetStats throughout the flood.
  std::atomic<bool> flooding{true};
  std::atomic<int> checks{0};
  std::vector<std::string> not_serving;
  std::thread watch([&] {
    while (flooding.load()) {
      auto tcp = epd_->CheckHealth("", epd_->tcp_target(), absl::Seconds(2));
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      v1::GetStatsResponse stats;
      grpc::Status got = stub_->GetStats(&context, v1::GetStatsRequest(), &stats);
      if (!tcp.ok() || *tcp != HealthCheckResponse::SERVING) {
        not_serving.push_back(tcp.ok() ? "tcp NOT_SERVING" : tcp.status().ToString());
      }
      if (!got.ok() || stats.serving_status() != "SERVING") {
        not_serving.push_back(got.ok() ? stats.serving_status() : got.error_message());
      }
      checks.fetch_add(1);
      absl::SleepFor(absl::Milliseconds(50));
    }
  });
  // Churn: opened and closed at once, some after garbage, while a client works.
  std::atomic<int> churned{0};
  std::thread churn([&] {
    for (int i = 0; i < kChurn; ++i) {
      ScopedFd fd = ConnectUnix(epd_->socket_path());
      if (!fd.valid()) continue;
      if (i % 3 == 0) (void)!::send(fd.get(), "GET / HTTP/1.1\r\n\r\n", 18, MSG_NOSIGNAL);
      if (i % 3 == 1) (void)!::send(fd.get(), kPreface.data(), kPreface.size(), MSG_NOSIGNAL);
      churned.fetch_add(1);
    }
  });
  ExpectServing("during the flood");
  ClientJoinsAndRunsOps("flood", 50);
  churn.join();
  EXPECT_EQ(churned.load(), kChurn);
  ExpectServing("after the churn");

  // epd closes the silent ones itself, within seconds (not gRPC's handshake timeout).
  int closed = 0;
  for (const ScopedFd& fd : silent) {
    closed += ClosedByPeer(fd.get(), absl::Seconds(6) - (absl::Now() - silent_since)) ? 1 : 0;
  }
  EXPECT_EQ(closed, kSilent);
  // The held gRPC connections are still open, and clients still work beside them.
  EXPECT_FALSE(ClosedByPeer(held.front().get(), absl::Milliseconds(100)));
  ClientJoinsAndRunsOps("after-flood", 10);
  ExpectServing("after the flood");
  flooding = false;
  watch.join();
  EXPECT_GT(checks.load(), 10);
  EXPECT_THAT(not_serving, ::testing::IsEmpty());
}

TEST_F(ConnectionsTest, LowFdLimitRefusesJoinsNamingDescriptorsAndRecovers) {
  DaemonProcessOptions options;
  options.wrapper = {"/usr/bin/prlimit", "--nofile=256:512", "--"};
  // One uid holds more endpoints here than max_endpoints_per_uid allows by default; the
  // limit under test is the descriptors'.
  options.extra_args = {"--max_endpoints_per_uid=0"};
  ASSERT_NO_FATAL_FAILURE(StartEpd(options));
  // The soft limit was raised to the hard one, and said so (min_free_fds: the default 64).
  EXPECT_EQ(EpdFdLimits(), (std::pair<std::string, std::string>{"512", "512"}));
  EXPECT_THAT(epd_->Logs(), HasSubstr("RLIMIT_NOFILE: soft limit 256 -> 512 (hard limit 512)"));

  // One session joins rank after rank and maps none: each holds a descriptor in epd.
  const v1::GroupSpec wide = Spec("wide", 1024);
  grpc::Status refused;
  int joined = 0;
  {
    RawSession hog(stub_.get(), ::getpid(), "hog");
    for (; joined < 1024; ++joined) {
      refused = Join(hog, wide, joined);
      if (!refused.ok()) break;
    }
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << refused.error_message();
    EXPECT_THAT(refused.error_message(),
                AllOf(HasSubstr("file descriptors"), HasSubstr("of its 512"),
                      HasSubstr("min_free_fds = 64")));
    EXPECT_GT(joined, 256);  // The raised limit is what counts.
    EXPECT_LT(joined, 512 - 64);
    // Health answers on new connections, and other clients are told the same clearly.
    ExpectServing("with joins refused");
    RawSession other(stub_.get(), ::getpid(), "other");
    grpc::Status also = Join(other, Spec("other", 1), 0);
    EXPECT_EQ(also.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << also.error_message();
  }
  // The hog's session ended: its endpoints are released and joins work again.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (absl::Now() < deadline && ListGroups().groups_size() != 0) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(ListGroups().groups_size(), 0);
  ClientJoinsAndRunsOps("after-hog", 5);
  ExpectServing("after the hog left");
}

TEST_F(ConnectionsTest, OutOfDescriptorsNewConnectionsAreClosedAndAcceptedAgainOnceFreed) {
  DaemonProcessOptions options;
  options.wrapper = {"/usr/bin/prlimit", "--nofile=160:160", "--"};
  ASSERT_NO_FATAL_FAILURE(StartEpd(options));
  // gRPC connections held open until epd has no descriptor left: then a new connection is
  // accepted with the reserve descriptor and closed at once.
  std::vector<ScopedFd> held;
  bool exhausted = false;
  for (int i = 0; i < 400 && !exhausted; ++i) {
    ScopedFd fd = ConnectUnix(epd_->socket_path());
    ASSERT_TRUE(fd.valid());
    // Out of descriptors, epd closes a new connection at once, which may be before the
    // preface is sent: the send then fails with EPIPE or ECONNRESET, and that is the sign.
    const ssize_t sent = ::send(fd.get(), kPreface.data(), kPreface.size(), MSG_NOSIGNAL);
    if (sent < 0) {
      ASSERT_TRUE(errno == EPIPE || errno == ECONNRESET) << "send: " << std::strerror(errno);
      exhausted = true;
      break;
    }
    ASSERT_EQ(sent, ssize_t(kPreface.size()));
    exhausted = ClosedByPeer(fd.get(), absl::Milliseconds(30));
    if (!exhausted) held.push_back(std::move(fd));
  }
  ASSERT_TRUE(exhausted) << "epd never ran out of descriptors with " << held.size() << " held";
  // Many more: each is closed cleanly and promptly, none hangs in the backlog.
  const absl::Time begin = absl::Now();
  int closed = 0;
  for (int i = 0; i < 200; ++i) {
    ScopedFd fd = ConnectUnix(epd_->socket_path());
    ASSERT_TRUE(fd.valid());
    closed += ClosedByPeer(fd.get(), absl::Seconds(2)) ? 1 : 0;
  }
  EXPECT_EQ(closed, 200);
  EXPECT_LT(absl::Now() - begin, absl::Seconds(10));

  // Descriptors freed: epd accepts again at once (gRPC's own listener would not).
  held.clear();
  absl::StatusOr<HealthCheckResponse::ServingStatus> health;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    health = epd_->CheckHealth("", "", absl::Seconds(1));
  } while ((!health.ok() || *health != HealthCheckResponse::SERVING) && absl::Now() < deadline);
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, HealthCheckResponse::SERVING);
  ClientJoinsAndRunsOps("after-exhaustion", 5);
  // Logged, rate-limited: far fewer lines than refused connections.
  const std::string logs = epd_->Logs();
  size_t lines = 0;
  for (size_t at = logs.find("out of file descriptors"); at != std::string::npos;
       at = logs.find("out of file descriptors", at + 1)) {
    ++lines;
  }
  EXPECT_GE(lines, 1u);
  EXPECT_LE(lines, 12u);
}

TEST_F(ConnectionsTest, EndpointsNeverMappedExpireAndMappedOnesStay) {
  DaemonProcessOptions options;
  options.config_text = "unmapped_endpoint_timeout_ms: 1000\n";
  ASSERT_NO_FATAL_FAILURE(StartEpd(options));
  RawSession lazy(stub_.get(), ::getpid(), "lazy");
  ASSERT_TRUE(Join(lazy, Spec("lazy", 2), 0).ok());
  ASSERT_TRUE(Join(lazy, Spec("lazy", 2), 1).ok());
  // A client that maps what it joins, beside it.
  ClientOptions client_options;
  client_options.socket_path = epd_->socket_path();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(client_options);
  ASSERT_TRUE(client.ok()) << client.status();
  JoinOptions join;
  join.spec = Spec("mapped", 2);
  absl::StatusOr<std::unique_ptr<Endpoint>> endpoint = (*client)->Join(join);
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();

  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_EQ(ListGroups().groups_size(), 2);  // Not yet.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (absl::Now() < deadline && ListGroups().groups_size() != 1) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  v1::ListGroupsResponse groups = ListGroups();
  ASSERT_EQ(groups.groups_size(), 1);
  EXPECT_EQ(groups.groups(0).spec().name(), "mapped");
  // Logged (at most a line per 5 s: the two may expire in two sweeps).
  const auto logged = AllOf(HasSubstr("endpoint(s) not mapped by its client within "
                                      "unmapped_endpoint_timeout_ms = 1000"),
                            HasSubstr("lazy/0"), HasSubstr("lazy/1"));
  const absl::Time log_deadline = absl::Now() + absl::Seconds(8);
  while (absl::Now() < log_deadline && !::testing::Matches(logged)(epd_->Logs())) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_THAT(epd_->Logs(), logged);
  // The lazy session no longer holds them; it may join again.
  grpc::ClientContext context;
  v1::LeaveGroupRequest leave;
  leave.set_group("lazy");
  leave.set_rank(0);
  leave.set_session_id(lazy.id());
  v1::LeaveGroupResponse left;
  EXPECT_EQ(stub_->LeaveGroup(&context, leave, &left).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(Join(lazy, Spec("lazy", 2), 0).ok());
  EXPECT_TRUE((*endpoint)->Leave().ok());
}

}  // namespace
}  // namespace epd::testing
