// UnixListener (daemon/server/listener.h) in-process, with a real gRPC server fed by it: a gRPC
// call arrives as "fd:N" and CallerCredentials gives this process's pid/uid/gid; fd-channel
// connections reach the handler with the preamble consumed (also when it arrives in
// pieces); garbage and silent connections are closed without blocking anything else; on
// EMFILE the pending connection gets a clean close and the listener accepts again as soon
// as descriptors are free; Stop is prompt. The same loop on TCP (BindTcp, the plaintext Peer
// listener): bad addresses, gRPC over TCP, the total cap, EMFILE and recovery.
#include "daemon/server/listener.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "daemon/core/fd_limits.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/abi/shm_abi.h"
#include "tests/common/raw_http.h"
#include "tests/common/unix_socket.h"

namespace epd {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;
using testing::ClosedByPeer;
using testing::ConnectTcp;
using testing::ConnectUnix;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;

/// A Health service that records what the server knows of each caller.
class RecordingHealth final : public grpc::health::v1::Health::Service {
 public:
  grpc::Status Check(grpc::ServerContext* context, const HealthCheckRequest*,
                     HealthCheckResponse* response) override {
    absl::MutexLock lock(&mu_);
    peer_ = context->peer();
    credentials_ = CallerCredentials(*context);
    response->set_status(HealthCheckResponse::SERVING);
    return grpc::Status::OK;
  }
  std::string peer() {
    absl::MutexLock lock(&mu_);
    return peer_;
  }
  std::optional<PeerCredentials> credentials() {
    absl::MutexLock lock(&mu_);
    return credentials_;
  }

 private:
  absl::Mutex mu_;
  std::string peer_;
  std::optional<PeerCredentials> credentials_;
};

/// Makes 20 client sockets of addr's family (first: connect then needs no new descriptor),
/// lowers this process's RLIMIT_NOFILE to its lowest free descriptor number (every number
/// below it is in use, so `listener`'s accept gets EMFILE), connects each to `addr`, and
/// expects every one closed by the listener within 3 s (a clean close, not a hang in the
/// backlog) with EMFILE recorded. Takes `listener`'s status then into `during` and
/// restores the limit.
void ConnectWhileOutOfDescriptors(const sockaddr* addr, socklen_t addr_len,
                                  const UnixListener& listener, ListenerStatus* during) {
  std::vector<ScopedFd> clients;
  for (int i = 0; i < 20; ++i) {
    clients.emplace_back(::socket(addr->sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    ASSERT_TRUE(clients.back().valid());
  }
  absl::StatusOr<FdLimit> saved = GetFdLimit();
  ASSERT_TRUE(saved.ok());
  const int lowest_free = ::dup(0);
  ASSERT_GE(lowest_free, 0);
  ::close(lowest_free);
  rlimit squeezed{static_cast<rlim_t>(lowest_free), static_cast<rlim_t>(saved->hard)};
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &squeezed), 0);
  bool connected = true;
  for (ScopedFd& c : clients) connected = connected && ::connect(c.get(), addr, addr_len) == 0;
  int closed = 0;
  for (ScopedFd& c : clients) closed += ClosedByPeer(c.get(), absl::Seconds(3)) ? 1 : 0;
  *during = listener.status();
  rlimit restored{static_cast<rlim_t>(saved->soft), static_cast<rlim_t>(saved->hard)};
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &restored), 0);
  ASSERT_TRUE(connected);
  EXPECT_EQ(closed, 20);
  EXPECT_GE(during->refused_no_fds, 1u);
  EXPECT_THAT(during->last_failure, HasSubstr("EMFILE"));
}

class ListenerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/epd_listener_test_XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
    socket_ = dir_ + "/epd.sock";
  }
  void TearDown() override {
    if (listener_ != nullptr) listener_->Stop();
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
    std::filesystem::remove_all(dir_);
  }

  /// Starts a gRPC server without a port and a listener feeding it.
  void StartListener(UnixListener::Options options) {
    grpc::ServerBuilder builder;
    builder.RegisterService(&health_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    options.socket_path = socket_;
    absl::StatusOr<std::unique_ptr<UnixListener>> listener = UnixListener::Bind(options);
    ASSERT_TRUE(listener.ok()) << listener.status();
    listener_ = *std::move(listener);
    listener_->Start(server_.get());
  }

  grpc::Status CheckHealth() {
    auto stub = grpc::health::v1::Health::NewStub(
        grpc::CreateChannel("unix://" + socket_, grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    HealthCheckRequest request;
    HealthCheckResponse response;
    return stub->Check(&context, request, &response);
  }

  std::string dir_;
  std::string socket_;
  RecordingHealth health_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<UnixListener> listener_;
};

TEST(ClassifyConnectionTest, PrefacesPrefixesAndGarbage) {
  const std::string fd_preamble(abi::kFdChannelPreamble, sizeof(abi::kFdChannelPreamble));
  EXPECT_EQ(ClassifyConnection(""), ConnectionKind::kUndecided);
  EXPECT_EQ(ClassifyConnection("PRI * HTTP/2.0"), ConnectionKind::kUndecided);
  EXPECT_EQ(ClassifyConnection(kHttp2ClientPreface), ConnectionKind::kGrpc);
  EXPECT_EQ(ClassifyConnection(std::string(kHttp2ClientPreface) + std::string("\0\0\x12\x04", 4)),
            ConnectionKind::kGrpc);
  EXPECT_EQ(ClassifyConnection("EPDF"), ConnectionKind::kUndecided);
  EXPECT_EQ(ClassifyConnection(fd_preamble), ConnectionKind::kFdChannel);
  EXPECT_EQ(ClassifyConnection(fd_preamble + "request"), ConnectionKind::kFdChannel);
  EXPECT_EQ(ClassifyConnection("GET / HTTP/1.1\r\n"), ConnectionKind::kInvalid);
  EXPECT_EQ(ClassifyConnection("PRX"), ConnectionKind::kInvalid);
  EXPECT_EQ(ClassifyConnection("EPDFDCH2"), ConnectionKind::kInvalid);
}

TEST_F(ListenerTest, GrpcCallIsNamedFdNAndCarriesThePeersCredentials) {
  StartListener({});
  grpc::Status status = CheckHealth();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_THAT(health_.peer(), MatchesRegex("fd:[0-9]+"));
  std::optional<PeerCredentials> creds = health_.credentials();
  ASSERT_TRUE(creds.has_value()) << "no credentials recorded for peer " << health_.peer();
  EXPECT_EQ(creds->pid, ::getpid());
  EXPECT_EQ(creds->uid, ::getuid());
  EXPECT_EQ(creds->gid, ::getgid());
  EXPECT_EQ(listener_->status().grpc_connections, 1u);
}

TEST_F(ListenerTest, FdChannelConnectionsReachTheHandlerWithThePreambleConsumed) {
  absl::Mutex mu;
  std::vector<std::string> received;
  std::vector<PeerCredentials> peers;
  UnixListener::Options options;
  options.fd_channel_handler = [&](ScopedFd conn, const PeerCredentials& peer) {
    std::string text;
    char buffer[64];
    for (int i = 0; i < 200 && text.size() < 5; ++i) {
      const ssize_t n = ::recv(conn.get(), buffer, sizeof(buffer), 0);
      if (n > 0) text.append(buffer, static_cast<size_t>(n));
      if (n == 0) break;
      if (n < 0) absl::SleepFor(absl::Milliseconds(5));
    }
    {
      absl::MutexLock lock(&mu);
      received.push_back(text);
      peers.push_back(peer);
    }
    (void)!::send(conn.get(), "ok", 2, MSG_NOSIGNAL);
  };
  StartListener(std::move(options));

  // In one write, and in pieces (a preamble split across writes waits, bounded).
  ScopedFd whole = ConnectUnix(socket_);
  ASSERT_TRUE(whole.valid());
  const std::string fd_preamble(abi::kFdChannelPreamble, sizeof(abi::kFdChannelPreamble));
  const std::string message = fd_preamble + "hello";
  ASSERT_EQ(::send(whole.get(), message.data(), message.size(), 0), ssize_t(message.size()));
  ScopedFd pieces = ConnectUnix(socket_);
  ASSERT_TRUE(pieces.valid());
  ASSERT_EQ(::send(pieces.get(), "EPD", 3, 0), 3);
  absl::SleepFor(absl::Milliseconds(100));
  ASSERT_EQ(::send(pieces.get(), "FDCH1world", 10, 0), 10);

  for (int fd : {whole.get(), pieces.get()}) {
    char reply[2] = {};
    pollfd p{fd, POLLIN, 0};
    ASSERT_EQ(::poll(&p, 1, 5000), 1);
    ASSERT_EQ(::recv(fd, reply, 2, 0), 2);
    EXPECT_EQ(std::string(reply, 2), "ok");
  }
  listener_->Stop();  // Joins the workers, which use this test's locals.
  absl::MutexLock lock(&mu);
  EXPECT_THAT(received, ::testing::UnorderedElementsAre("hello", "world"));
  for (const PeerCredentials& peer : peers) {
    EXPECT_EQ(peer, (PeerCredentials{::getpid(), ::getuid(), ::getgid()}));
  }
}

TEST_F(ListenerTest, PeerOfAnotherUserIsRecordedAsTheKernelSeesIt) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to connect as another user";
  absl::Mutex mu;
  std::optional<PeerCredentials> seen;
  UnixListener::Options options;
  options.fd_channel_handler = [&](ScopedFd, const PeerCredentials& peer) {
    absl::MutexLock lock(&mu);
    seen = peer;
  };
  StartListener(std::move(options));
  ASSERT_EQ(::chmod(dir_.c_str(), 0755), 0);
  ASSERT_EQ(::chmod(socket_.c_str(), 0666), 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, socket_.c_str(), sizeof(addr.sun_path) - 1);
  // The child makes system calls only (it is a fork of a threaded process).
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (::setresgid(65534, 65534, 65534) != 0 || ::setresuid(65534, 65534, 65534) != 0) _exit(2);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) _exit(3);
    if (::write(fd, abi::kFdChannelPreamble, 8) != 8) _exit(4);
    char c;
    (void)!::read(fd, &c, 1);  // Until the listener's side closes.
    _exit(0);
  }
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  EXPECT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) << wstatus;
  listener_->Stop();
  absl::MutexLock lock(&mu);
  ASSERT_TRUE(seen.has_value());
  EXPECT_EQ(*seen, (PeerCredentials{child, 65534, 65534}));
}

TEST_F(ListenerTest, GarbageAndSilentConnectionsAreClosedWithoutBlockingOthers) {
  UnixListener::Options options;
  options.first_bytes_timeout = absl::Milliseconds(500);
  StartListener(std::move(options));

  std::vector<ScopedFd> silent;
  for (int i = 0; i < 200; ++i) {
    silent.push_back(ConnectUnix(socket_));
    ASSERT_TRUE(silent.back().valid());
  }
  ScopedFd garbage = ConnectUnix(socket_);
  ASSERT_EQ(::send(garbage.get(), "GET / HTTP/1.1\r\n\r\n", 18, 0), 18);
  ScopedFd fd_channel = ConnectUnix(socket_);  // Served by nobody: closed at once.
  ASSERT_EQ(::send(fd_channel.get(), abi::kFdChannelPreamble, 8, 0), 8);

  // The silent ones wait for their bytes in the poll set; calls are served meanwhile.
  const absl::Time begin = absl::Now();
  grpc::Status status = CheckHealth();
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_LT(absl::Now() - begin, absl::Milliseconds(400));
  EXPECT_TRUE(ClosedByPeer(garbage.get(), absl::Seconds(2)));
  EXPECT_TRUE(ClosedByPeer(fd_channel.get(), absl::Seconds(2)));
  for (const ScopedFd& fd : silent) {
    ASSERT_TRUE(ClosedByPeer(fd.get(), absl::Seconds(3))) << "a silent connection stayed open";
  }
  const ListenerStatus s = listener_->status();
  EXPECT_EQ(s.closed_silent, 200u);
  EXPECT_EQ(s.closed_invalid, 2u);
  EXPECT_TRUE(CheckHealth().ok());
}

TEST_F(ListenerTest, PendingConnectionsBeyondTheCapEvictTheOldest) {
  UnixListener::Options options;
  options.max_pending = 4;
  options.first_bytes_timeout = absl::Seconds(30);
  StartListener(std::move(options));
  std::vector<ScopedFd> silent;
  for (int i = 0; i < 6; ++i) {
    silent.push_back(ConnectUnix(socket_));
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(ClosedByPeer(silent[0].get(), absl::Seconds(2)));
  EXPECT_TRUE(ClosedByPeer(silent[1].get(), absl::Seconds(2)));
  EXPECT_FALSE(ClosedByPeer(silent[5].get(), absl::Milliseconds(200)));
  EXPECT_TRUE(CheckHealth().ok());
}

/// Connects and sends what a gRPC client sends first (the HTTP/2 preface and an empty
/// SETTINGS frame), then nothing more: a connection the listener hands to gRPC.
// The first bytes gRPC's client sends: the HTTP/2 preface and an empty SETTINGS frame.
std::string GrpcHello() {
  return std::string(kHttp2ClientPreface) + std::string("\0\0\0\x04\0\0\0\0\0", 9);
}

ScopedFd ConnectLikeGrpc(const std::string& socket) {
  ScopedFd fd = ConnectUnix(socket);
  const std::string hello = GrpcHello();
  if (!fd.valid() || ::send(fd.get(), hello.data(), hello.size(), MSG_NOSIGNAL) !=
                         static_cast<ssize_t>(hello.size())) {
    return ScopedFd();
  }
  return fd;
}

TEST(ConnectionCounterTest, CapsPerUidAndInAllExemptUidsAreNeverRefused) {
  ConnectionCounter counter({.per_uid = 2, .total = 3, .exempt_uids = {0}});
  using Admission = ConnectionCounter::Admission;
  EXPECT_EQ(counter.Admit(100, 1000), Admission::kAdmitted);
  EXPECT_EQ(counter.Admit(101, 1000), Admission::kAdmitted);
  EXPECT_EQ(counter.Admit(102, 1000), Admission::kOverUidCap);
  EXPECT_EQ(counter.live(1000), 2u);
  EXPECT_EQ(counter.Admit(103, 2000), Admission::kAdmitted);
  EXPECT_EQ(counter.Admit(104, 3000), Admission::kOverTotalCap);
  for (int fd = 105; fd < 110; ++fd) EXPECT_EQ(counter.Admit(fd, 0), Admission::kAdmitted);
  EXPECT_EQ(counter.live(0), 5u);
  EXPECT_EQ(counter.live_total(), 8u);
  counter.Release(1000);
  EXPECT_EQ(counter.Admit(110, 3000), Admission::kAdmitted);
  EXPECT_EQ(counter.Admit(111, 1000), Admission::kOverTotalCap);
  // 0 = no limit.
  ConnectionCounter unlimited({});
  for (int fd = 0; fd < 1000; ++fd) ASSERT_EQ(unlimited.Admit(fd, 7), Admission::kAdmitted);
  EXPECT_EQ(unlimited.live(7), 1000u);
}

TEST(ConnectionCounterTest, SweepReleasesHandedOverConnectionsOnceTheirDescriptorCloses) {
  ConnectionCounter counter({.per_uid = 2});
  using Admission = ConnectionCounter::Admission;
  int pair_a[2], pair_b[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, pair_a), 0);
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, pair_b), 0);
  ScopedFd a(pair_a[0]), a_peer(pair_a[1]), b(pair_b[0]), b_peer(pair_b[1]);
  ASSERT_EQ(counter.Admit(a.get(), 1000), Admission::kAdmitted);
  ASSERT_EQ(counter.Admit(b.get(), 1000), Admission::kAdmitted);
  counter.Track(a.get(), 1000);
  counter.Track(b.get(), 1000);
  EXPECT_TRUE(counter.Sweep().empty());  // Both still open.
  EXPECT_EQ(counter.Admit(999999, 1000), Admission::kOverUidCap);

  // Closed: the number is free (EBADF).
  const int a_number = a.get();
  a = ScopedFd();
  EXPECT_EQ(counter.Sweep(), std::vector<int>{a_number});
  EXPECT_EQ(counter.live(1000), 1u);

  // Closed and the number reused by another file: the inode differs.
  const int b_number = b.get();
  b = ScopedFd();
  ScopedFd reused(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(reused.valid());
  if (reused.get() == b_number) {
    EXPECT_EQ(counter.Sweep(), std::vector<int>{b_number});
  } else {
    ASSERT_EQ(::dup2(reused.get(), b_number), b_number);
    EXPECT_EQ(counter.Sweep(), std::vector<int>{b_number});
    ::close(b_number);
  }
  EXPECT_EQ(counter.live(1000), 0u);
  EXPECT_EQ(counter.tracked(), 0u);

  // A tracked number the kernel hands out again at accept: that connection is gone.
  ASSERT_EQ(counter.Admit(50, 2000), Admission::kAdmitted);
  ASSERT_EQ(counter.Admit(51, 2000), Admission::kAdmitted);
  counter.Track(a_peer.get(), 2000);  // Open: a sweep would keep it.
  EXPECT_EQ(counter.Admit(a_peer.get(), 3000), Admission::kAdmitted);
  EXPECT_EQ(counter.live(2000), 1u);
  EXPECT_EQ(counter.tracked(), 0u);
}

TEST_F(ListenerTest, ConnectionsBeyondTheUidCapAreClosedUntilGrpcClosesOne) {
  UnixListener::Options options;
  options.max_connections_per_uid = 3;
  options.sweep_interval = absl::Milliseconds(50);
  StartListener(std::move(options));
  std::vector<ScopedFd> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(ConnectLikeGrpc(socket_));
    ASSERT_TRUE(held.back().valid());
  }
  for (int i = 0; i < 50 && listener_->status().grpc_connections < 3; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(listener_->status().grpc_connections, 3u);
  // The held connections are gRPC's now; this uid gets no more, whatever it sends. The
  // listener may close it before the preface is sent (the send then fails with EPIPE or
  // ECONNRESET): either way the connection must end up closed by the listener.
  ScopedFd over = ConnectUnix(socket_);
  ASSERT_TRUE(over.valid());
  const std::string hello = GrpcHello();
  (void)::send(over.get(), hello.data(), hello.size(), MSG_NOSIGNAL);
  EXPECT_TRUE(ClosedByPeer(over.get(), absl::Seconds(2)));
  EXPECT_FALSE(CheckHealth().ok());
  ListenerStatus s = listener_->status();
  EXPECT_GE(s.refused_over_cap, 2u);
  EXPECT_EQ(s.live_connections, 3u);

  // The client closes one; gRPC closes its end; a sweep finds it and the uid may connect.
  held.pop_back();
  grpc::Status status;
  for (int i = 0; i < 100; ++i) {
    status = CheckHealth();
    if (status.ok()) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(status.ok()) << status.error_message();
}

TEST_F(ListenerTest, ExemptUidsAreNeverCapped) {
  UnixListener::Options options;
  options.max_connections_per_uid = 2;
  options.exempt_uids = {static_cast<uint32_t>(::geteuid())};
  StartListener(std::move(options));
  std::vector<ScopedFd> held;
  for (int i = 0; i < 5; ++i) held.push_back(ConnectLikeGrpc(socket_));
  grpc::Status status = CheckHealth();
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(listener_->status().refused_over_cap, 0u);
}

TEST_F(ListenerTest, OutOfDescriptorsClosesNewConnectionsCleanlyAndRecovers) {
  absl::Notification served;
  UnixListener::Options options;
  options.fd_channel_handler = [&](ScopedFd, const PeerCredentials&) { served.Notify(); };
  StartListener(std::move(options));
  // No gRPC call before the squeeze: a connection gRPC closes meanwhile would free a
  // descriptor under the limit.
  absl::SleepFor(absl::Milliseconds(100));

  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, socket_.c_str(), sizeof(addr.sun_path) - 1);
  ListenerStatus during;
  ASSERT_NO_FATAL_FAILURE(ConnectWhileOutOfDescriptors(reinterpret_cast<sockaddr*>(&addr),
                                                       sizeof(addr), *listener_, &during));
  EXPECT_GT(during.failing_for, absl::ZeroDuration());

  // Descriptors are free again: the very next connection is served.
  ScopedFd after = ConnectUnix(socket_);
  ASSERT_TRUE(after.valid());
  ASSERT_EQ(::send(after.get(), abi::kFdChannelPreamble, 8, 0), 8);
  EXPECT_TRUE(served.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_TRUE(CheckHealth().ok());
  EXPECT_EQ(listener_->status().failing_for, absl::ZeroDuration());
  listener_->Stop();  // Joins the workers, which use this test's locals.
}

TEST_F(ListenerTest, HeartbeatStopsWhileTheLoopIsStalledAndStopIsPrompt) {
  absl::Notification stall;
  absl::Notification release;
  absl::Notification stalled;
  UnixListener::Options options;
  options.loop_hook_for_testing = [&] {
    if (stall.HasBeenNotified() && !release.HasBeenNotified()) {
      stalled.Notify();
      release.WaitForNotification();
    }
  };
  StartListener(std::move(options));
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_LT(absl::Now() - listener_->status().heartbeat, absl::Milliseconds(250));
  stall.Notify();
  ASSERT_TRUE(stalled.WaitForNotificationWithTimeout(absl::Seconds(2)));
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_GT(absl::Now() - listener_->status().heartbeat, absl::Milliseconds(450));
  release.Notify();
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_LT(absl::Now() - listener_->status().heartbeat, absl::Milliseconds(250));
  const absl::Time begin = absl::Now();
  listener_->Stop();
  EXPECT_LT(absl::Now() - begin, absl::Milliseconds(500));
  EXPECT_FALSE(ConnectUnix(socket_).valid());
}

/// A gRPC server fed by a TCP listener on 127.0.0.1 (a free port).
class TcpListenerTest : public ::testing::Test {
 protected:
  void TearDown() override {
    if (listener_ != nullptr) listener_->Stop();
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
  }
  void StartListener(UnixListener::Options options) {
    grpc::ServerBuilder builder;
    builder.RegisterService(&health_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    options.name = "Peer listener";
    absl::StatusOr<std::unique_ptr<UnixListener>> bound =
        UnixListener::BindTcp(std::move(options), "127.0.0.1:0");
    ASSERT_TRUE(bound.ok()) << bound.status();
    listener_ = *std::move(bound);
    listener_->Start(server_.get());
    port_ = listener_->port();
  }
  /// A Health/Check over a new TCP channel (5 s).
  grpc::Status CheckHealth() {
    auto stub = grpc::health::v1::Health::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    HealthCheckResponse response;
    return stub->Check(&context, HealthCheckRequest(), &response);
  }

  RecordingHealth health_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<UnixListener> listener_;
  int port_ = 0;
};

TEST_F(TcpListenerTest, BadAddressesAndAPortInUseAreRefusedNamingThem) {
  absl::StatusOr<std::unique_ptr<UnixListener>> no_port = UnixListener::BindTcp({}, "localhost");
  EXPECT_EQ(no_port.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_port.status().message(), HasSubstr("\"localhost\""));
  EXPECT_EQ(UnixListener::BindTcp({}, "127.0.0.1:70000").status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<UnixListener>> first = UnixListener::BindTcp({}, "127.0.0.1:0");
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_GT((*first)->port(), 0);
  const std::string taken = absl::StrCat("127.0.0.1:", (*first)->port());
  absl::StatusOr<std::unique_ptr<UnixListener>> second = UnixListener::BindTcp({}, taken);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr(taken));
}

TEST_F(TcpListenerTest, GrpcOverTcpIsServedGarbageIsClosedAndTheTotalCapHolds) {
  UnixListener::Options options;
  options.max_connections = 2;
  options.first_bytes_timeout = absl::Milliseconds(300);
  options.sweep_interval = absl::Milliseconds(50);
  ASSERT_NO_FATAL_FAILURE(StartListener(std::move(options)));
  const int port = port_;
  std::unique_ptr<UnixListener>& listener = listener_;
  auto check = [&] { return CheckHealth(); };
  grpc::Status status = check();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_THAT(health_.peer(), MatchesRegex("fd:[0-9]+"));

  // Garbage is closed at once; a silent connection after first_bytes_timeout.
  ScopedFd garbage = ConnectTcp(port);
  ASSERT_TRUE(garbage.valid());
  ASSERT_EQ(::send(garbage.get(), "GET / HTTP/1.1\r\n", 16, MSG_NOSIGNAL), 16);
  EXPECT_TRUE(ClosedByPeer(garbage.get(), absl::Seconds(2)));
  ScopedFd silent = ConnectTcp(port);
  ASSERT_TRUE(silent.valid());
  EXPECT_TRUE(ClosedByPeer(silent.get(), absl::Seconds(2)));

  // Two silent connections fill the cap: a third is closed at accept, and gRPC refused.
  for (int i = 0; i < 50 && listener->status().live_connections > 0; ++i) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ScopedFd a = ConnectTcp(port);
  ScopedFd b = ConnectTcp(port);
  ASSERT_TRUE(a.valid() && b.valid());
  for (int i = 0; i < 50 && listener->status().live_connections < 2; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ScopedFd over = ConnectTcp(port);
  ASSERT_TRUE(over.valid());
  EXPECT_TRUE(ClosedByPeer(over.get(), absl::Milliseconds(200)));
  EXPECT_GE(listener->status().refused_over_cap, 1u);
  // Once they close (or time out), a call is served again.
  a = ScopedFd();
  b = ScopedFd();
  for (int i = 0; i < 100; ++i) {
    status = check();
    if (status.ok()) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(status.ok()) << status.error_message();
}

TEST_F(TcpListenerTest, OutOfDescriptorsClosesNewConnectionsCleanlyAndRecovers) {
  ASSERT_NO_FATAL_FAILURE(StartListener({}));
  absl::SleepFor(absl::Milliseconds(100));

  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port_));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ListenerStatus during;
  ASSERT_NO_FATAL_FAILURE(ConnectWhileOutOfDescriptors(reinterpret_cast<sockaddr*>(&addr),
                                                       sizeof(addr), *listener_, &during));

  // Descriptors are free again: a gRPC call over TCP is served.
  const grpc::Status status = CheckHealth();
  EXPECT_TRUE(status.ok()) << status.error_message();
}

}  // namespace
}  // namespace epd
