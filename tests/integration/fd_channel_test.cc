// Shared memory the client cannot resize, and the fd channel that hands it out
// (docs/SECURITY.md), with the real epd binary and real client processes:
// - a hostile client that holds its endpoint region and its engine's doorbell page tries
//   to shrink and grow both (ftruncate, fallocate) in a tight loop while it scribbles the
//   doorbell: every attempt fails with EPERM, epd keeps serving, and a victim group on the
//   same engine gets exact results all along (a shrunk mapping would SIGBUS epd);
// - the fd channel answers only the session's own uid for a (group, rank) the session
//   holds, once; wrong sessions, other users, ranks not held, garbage, oversized and silent
//   connections get a clear error or a bounded close, and epd keeps serving meanwhile.
#include "client/fd_channel.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/os/fd_frame.h"
#include "common/os/shm_region.h"
#include "epd/v1/control.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/abi/shm_abi.h"
#include "tests/common/daemon_process.h"
#include "tests/common/subprocess.h"
#include "tests/integration/raw_session.h"

namespace epd::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

std::string HostileBinary() { return std::string(EPD_TEST_BIN_DIR) + "/epd_dp_hostile"; }
std::string MoeLayerBinary() { return std::string(EPD_EXAMPLES_DIR) + "/moe_layer"; }

/// A connection to `socket_path` that has sent the fd-channel preamble and `bytes`.
ScopedFd FdChannelConnection(const std::string& socket_path, const std::string& bytes) {
  ScopedFd conn(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", socket_path.c_str());
  EXPECT_EQ(::connect(conn.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const std::string all =
      std::string(abi::kFdChannelPreamble, sizeof(abi::kFdChannelPreamble)) + bytes;
  EXPECT_TRUE(SendAll(conn.get(), all, absl::Now() + absl::Seconds(5)).ok());
  return conn;
}

std::string Prefix(uint32_t length) {
  std::string p(4, '\0');
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  return p;
}

class FdChannelTest : public ::testing::Test {
 protected:
  void StartEpd(std::vector<std::string> extra_args = {}) {
    DaemonProcessOptions options;
    options.tcp = false;
    options.log_level = "info";
    options.extra_args = std::move(extra_args);
    options.extra_args.push_back("--op_timeout=5s");
    auto epd = DaemonProcess::Start(options);
    ASSERT_TRUE(epd.ok()) << epd.status();
    epd_ = *std::move(epd);
    stub_ = v1::Control::NewStub(
        grpc::CreateChannel(epd_->unix_target(), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (HasFailure() && epd_ != nullptr) std::cerr << "---- epd log ----\n" << epd_->Logs();
  }
  /// Joins rank `rank` of a 2-rank group `group` in `session` (no descriptors fetched).
  void Join(const std::string& session, const std::string& group, int rank) {
    v1::JoinGroupRequest request;
    v1::GroupSpec* spec = request.mutable_spec();
    spec->set_name(group);
    spec->set_num_ranks(2);
    spec->set_num_experts(4);
    spec->set_hidden(128);
    spec->set_num_topk(1);
    spec->set_max_tokens_per_rank(4);
    request.set_rank(rank);
    request.set_session_id(session);
    v1::JoinGroupResponse response;
    grpc::ClientContext context;
    grpc::Status status = stub_->JoinGroup(&context, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    shm_bytes_ = response.endpoint().shm_bytes();
  }
  void ExpectServing() {
    ASSERT_TRUE(epd_->Running()) << "epd died";
    auto health = epd_->CheckHealth();
    ASSERT_TRUE(health.ok()) << health.status();
    EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
  }

  std::unique_ptr<DaemonProcess> epd_;
  std::unique_ptr<v1::Control::Stub> stub_;
  uint64_t shm_bytes_ = 0;
};

TEST_F(FdChannelTest, ResizingEveryHeldFdFailsAndAVictimGroupStaysExact) {
  StartEpd();
  SubprocessOptions o;
  o.stdout_path = epd_->dir() + "/hostile.out";
  o.stderr_path = epd_->dir() + "/hostile.err";
  auto hostile = Subprocess::Spawn(
      {HostileBinary(), "--socket=" + epd_->socket_path(), "--scenario=resize", "--seconds=4"}, o);
  ASSERT_TRUE(hostile.ok()) << hostile.status();
  ASSERT_TRUE((*hostile)->WaitForOutput("RESIZE doorbell", absl::Seconds(20)).ok())
      << (*hostile)->Stdout() << (*hostile)->Stderr();
  // The victim: a 2-rank MoE layer on the same engine (and doorbell), compared exactly
  // against the single-process layer, while the attacker's loop runs.
  o.stdout_path = epd_->dir() + "/victim.out";
  o.stderr_path = epd_->dir() + "/victim.err";
  auto victim = Subprocess::Spawn(
      {MoeLayerBinary(), "--socket=" + epd_->socket_path(), "--group=victim", "--num_ranks=2",
       "--num_experts=8", "--hidden=128", "--tokens=16", "--iters=10"},
      o);
  ASSERT_TRUE(victim.ok()) << victim.status();
  absl::StatusOr<int> victim_rc = (*victim)->Wait(absl::Seconds(120));
  absl::StatusOr<int> hostile_rc = (*hostile)->Wait(absl::Seconds(60));
  ASSERT_TRUE(hostile_rc.ok()) << hostile_rc.status();
  const std::string out = (*hostile)->Stdout();
  EXPECT_EQ(*hostile_rc, 0) << out << (*hostile)->Stderr();
  // Every resize of both descriptors was refused by the seals.
  for (const char* fd : {"region", "doorbell"}) {
    for (const char* attempt : {"ftruncate(0)", "fallocate(grow)", "F_ADD_SEALS(F_SEAL_WRITE)"}) {
      EXPECT_THAT(out, HasSubstr(absl::StrCat("RESIZE ", fd, " ", attempt, " EPERM"))) << out;
    }
  }
  EXPECT_THAT(out, AllOf(HasSubstr("DONE resized=0"), Not(HasSubstr(" OK\n"))));
  ASSERT_TRUE(victim_rc.ok()) << victim_rc.status();
  EXPECT_EQ(*victim_rc, 0) << (*victim)->Stdout() << (*victim)->Stderr();
  ExpectServing();
  EXPECT_THAT(epd_->Logs(), Not(HasSubstr("SIGBUS")));
}

TEST_F(FdChannelTest, OnlyTheSessionHoldingTheRankGetsItsDescriptorsOnce) {
  StartEpd();
  RawSession session(stub_.get());
  RawSession other(stub_.get());
  Join(session.id(), "g", 0);
  Join(other.id(), "g", 1);
  auto fetch = [&](const std::string& id, const std::string& group, int rank) {
    return internal::FetchEndpointFds(epd_->socket_path(), id, group, rank, absl::Seconds(10));
  };
  // Not a session.
  absl::StatusOr<EndpointFds> fds = fetch(std::string(32, '0'), "g", 0);
  EXPECT_EQ(fds.status().code(), absl::StatusCode::kFailedPrecondition) << fds.status();
  EXPECT_THAT(std::string(fds.status().message()), HasSubstr("not an open session"));
  // A rank the session does not hold (another session's), a group it has no rank in.
  fds = fetch(session.id(), "g", 1);
  EXPECT_EQ(fds.status().code(), absl::StatusCode::kPermissionDenied) << fds.status();
  fds = fetch(session.id(), "nope", 0);
  EXPECT_EQ(fds.status().code(), absl::StatusCode::kPermissionDenied) << fds.status();
  // The holder gets the sealed region and doorbell, of the sizes the ABI says.
  fds = fetch(session.id(), "g", 0);
  ASSERT_TRUE(fds.ok()) << fds.status();
  for (const auto& [fd, bytes] : {std::pair<int, uint64_t>{fds->region.get(), shm_bytes_},
                                  {fds->doorbell.get(), sizeof(abi::DoorbellPage)}}) {
    EXPECT_EQ(::fcntl(fd, F_GET_SEALS) & kRequiredSeals, kRequiredSeals);
    struct stat st {};
    ASSERT_EQ(::fstat(fd, &st), 0);
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), bytes);
    EXPECT_EQ(::ftruncate(fd, 0), -1);
    EXPECT_EQ(errno, EPERM);
  }
  // Once.
  absl::StatusOr<EndpointFds> again = fetch(session.id(), "g", 0);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("already handed out"));
  ExpectServing();
}

TEST_F(FdChannelTest, MalformedAndSilentConnectionsAreAnsweredOrClosedInBoundedTime) {
  StartEpd();
  RawSession session(stub_.get());
  Join(session.id(), "g", 0);
  auto answer_of = [](ScopedFd conn) -> absl::StatusOr<v1::FdChannelResponse> {
    absl::StatusOr<ReceivedFrame> frame =
        ReceiveFrame(conn.get(), kMaxFdFrameBytes, kMaxFdFrameFds, absl::Now() + absl::Seconds(10));
    if (!frame.ok()) return frame.status();
    EXPECT_TRUE(frame->fds.empty());
    v1::FdChannelResponse response;
    EXPECT_TRUE(response.ParseFromString(frame->body));
    return response;
  };
  // Garbage, and frames longer than the limit: INVALID_ARGUMENT, no descriptors.
  for (const std::string& bytes : {Prefix(6) + "\xff\xff\xff\xff\xff\xff",
                                   Prefix(kMaxFdFrameBytes + 1) + "x", Prefix(0xffffffffu)}) {
    absl::StatusOr<v1::FdChannelResponse> response =
        answer_of(FdChannelConnection(epd_->socket_path(), bytes));
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_EQ(response->code(), static_cast<int>(absl::StatusCode::kInvalidArgument))
        << response->message();
  }
  // Silent peers (the preamble, then nothing or half a frame) are closed within a few
  // seconds, and epd serves everyone else meanwhile: health, and the session's own fetch.
  std::vector<ScopedFd> silent;
  for (int i = 0; i < 8; ++i) {
    silent.push_back(FdChannelConnection(epd_->socket_path(), i % 2 ? Prefix(40) + "abc" : ""));
  }
  const absl::Time start = absl::Now();
  ExpectServing();
  absl::StatusOr<EndpointFds> fds =
      internal::FetchEndpointFds(epd_->socket_path(), session.id(), "g", 0, absl::Seconds(10));
  EXPECT_TRUE(fds.ok()) << fds.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  for (ScopedFd& conn : silent) {
    absl::StatusOr<v1::FdChannelResponse> response = answer_of(std::move(conn));
    EXPECT_EQ(response.status().code(), absl::StatusCode::kUnavailable) << response.status();
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(8));
  ExpectServing();
}

// As root, a process of another user (nobody, through setpriv) presents a session of
// root's: PERMISSION_DENIED without descriptors, and the session's owner still gets them.
TEST_F(FdChannelTest, ASessionOfAnotherUidIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another user";
  if (::access("/usr/bin/setpriv", X_OK) != 0) GTEST_SKIP() << "needs setpriv (util-linux)";
  StartEpd({"--socket_mode=0666"});
  ASSERT_EQ(::chmod(epd_->dir().c_str(), 0755), 0);
  RawSession session(stub_.get());
  Join(session.id(), "g", 0);
  absl::StatusOr<CommandResult> r =
      RunCommand({"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                  HostileBinary(), "--socket=" + epd_->socket_path(), "--scenario=fetch",
                  "--session=" + session.id(), "--group=g", "--rank=0"},
                 absl::Seconds(30));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->stdout_text, AllOf(HasSubstr("FETCH PERMISSION_DENIED"), HasSubstr("uid 65534"),
                                    HasSubstr("fds=0")))
      << r->stderr_text;
  absl::StatusOr<EndpointFds> fds =
      internal::FetchEndpointFds(epd_->socket_path(), session.id(), "g", 0, absl::Seconds(10));
  EXPECT_TRUE(fds.ok()) << fds.status();
}

}  // namespace
}  // namespace epd::testing
