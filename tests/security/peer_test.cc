// The Peer service (proto/epd/v1/peer.proto) of a real epd presented with hostile callers:
// a wrong protocol version, a wrong secret, a replayed or forged nonce, calls without a
// session, garbage bytes on the TCP port, and a flood of bad handshakes. Each is refused
// with a clear status and logged (rate-limited); epd keeps serving Control (a victim group
// runs exact ops throughout, and a fresh client joins) and the Peer service (a correct
// handshake and heartbeat succeed after the attack). docs/DESIGN.md §5.3.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/peer/grpc_peer_mesh.h"
#include "epd/v1/control.grpc.pb.h"
#include "epd/v1/peer.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "tests/security/security_harness.h"

namespace epd::testing::security {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr char kSecret[] = "peer-security-test-secret-0123456789";
constexpr char kCallerId[] = "127.0.0.1:1";

class PeerSecurityTest : public SecurityTest {
 protected:
  void SetUp() override {
    char path[] = "/tmp/epd_peer_secret_XXXXXX";
    int fd = ::mkstemp(path);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, kSecret, sizeof(kSecret) - 1), static_cast<ssize_t>(sizeof(kSecret) - 1));
    ::close(fd);
    ASSERT_EQ(::chmod(path, 0600), 0);
    secret_path_ = path;
    ASSERT_NO_FATAL_FAILURE(
        StartEpd({.extra_args = {"--peer_listen=127.0.0.1:0", "--peer_secret_file=" + secret_path_,
                                 "--peer_heartbeat_ms=100"},
                  .wrapper = Wrapper()}));
    // The Peer address (the bound port) from GetStats.
    auto control = v1::Control::NewStub(
        grpc::CreateChannel(epd_->unix_target(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::GetStatsResponse stats;
    ASSERT_TRUE(control->GetStats(&context, v1::GetStatsRequest(), &stats).ok());
    address_ = stats.peer_address();
    ASSERT_TRUE(absl::StartsWith(address_, "127.0.0.1:")) << address_;
    ASSERT_TRUE(absl::SimpleAtoi(address_.substr(10), &port_));
    peer_ = v1::Peer::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  }
  /// What runs epd (SecurityTest::StartEpd's wrapper).
  virtual std::vector<std::string> Wrapper() const { return {}; }

  void TearDown() override {
    SecurityTest::TearDown();
    std::remove(secret_path_.c_str());
  }

  grpc::Status Challenge(uint32_t version, v1::ChallengeResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::ChallengeRequest request;
    request.set_protocol_version(version);
    return peer_->Challenge(&context, request, response);
  }

  /// A handshake with `secret`; the response of Hello.
  grpc::Status Handshake(const std::string& secret, v1::HelloResponse* welcome,
                         std::string* session_key = nullptr) {
    v1::ChallengeResponse nonce;
    grpc::Status s = Challenge(peer::kPeerProtocolVersion, &nonce);
    if (!s.ok()) return s;
    v1::HelloRequest hello;
    hello.set_protocol_version(peer::kPeerProtocolVersion);
    hello.set_daemon_id(kCallerId);
    hello.set_server_nonce(nonce.server_nonce());
    hello.set_client_nonce(std::string(32, 'c'));
    hello.set_proof(
        peer::HelloProof(secret, hello.server_nonce(), hello.client_nonce(), kCallerId));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    s = peer_->Hello(&context, hello, welcome);
    if (s.ok() && session_key != nullptr) {
      *session_key =
          peer::SessionKey(secret, hello.server_nonce(), hello.client_nonce(), kCallerId);
    }
    return s;
  }

  /// A correct handshake and a signed heartbeat succeed: the Peer service serves.
  void ExpectPeerServes(const std::string& when) {
    v1::HelloResponse welcome;
    std::string key;
    grpc::Status s = Handshake(kSecret, &welcome, &key);
    ASSERT_TRUE(s.ok()) << when << ": " << s.error_message();
    EXPECT_EQ(welcome.daemon_id(), address_);
    v1::HeartbeatRequest beat;
    beat.mutable_held()->set_daemon_instance(1);
    peer::SignPeerRequest("Heartbeat", welcome.session_id(), key, 1, &beat);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::HeartbeatResponse answer;
    s = peer_->Heartbeat(&context, beat, &answer);
    EXPECT_TRUE(s.ok()) << when << ": " << s.error_message();
    EXPECT_NE(answer.held().daemon_instance(), 0u);
  }

  std::string secret_path_;
  std::string address_;
  int port_ = 0;
  std::unique_ptr<v1::Peer::Stub> peer_;
};

TEST_F(PeerSecurityTest, WrongVersionWrongSecretAndForgeriesAreRefused) {
  ASSERT_NO_FATAL_FAILURE(StartVictims());
  const LogMark mark = MarkLog();

  v1::ChallengeResponse nonce;
  grpc::Status version = Challenge(peer::kPeerProtocolVersion + 41, &nonce);
  EXPECT_EQ(version.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(version.error_message(),
              AllOf(HasSubstr(absl::StrCat("version ", peer::kPeerProtocolVersion + 41)),
                    HasSubstr(absl::StrCat("version ", peer::kPeerProtocolVersion))));

  v1::HelloResponse welcome;
  grpc::Status wrong = Handshake("a-wrong-secret-of-enough-bytes", &welcome);
  EXPECT_EQ(wrong.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(wrong.error_message(), HasSubstr("shared secret"));
  EXPECT_TRUE(welcome.session_id().empty());

  // A nonce the daemon never issued, and one used twice.
  ASSERT_TRUE(Challenge(peer::kPeerProtocolVersion, &nonce).ok());
  for (const std::string& server_nonce : {std::string(32, 'x'), nonce.server_nonce()}) {
    v1::HelloRequest hello;
    hello.set_protocol_version(peer::kPeerProtocolVersion);
    hello.set_daemon_id(kCallerId);
    hello.set_server_nonce(server_nonce);
    hello.set_client_nonce(std::string(32, 'c'));
    hello.set_proof(peer::HelloProof(kSecret, server_nonce, hello.client_nonce(), kCallerId));
    grpc::ClientContext context;
    v1::HelloResponse r;
    grpc::Status s = peer_->Hello(&context, hello, &r);
    if (server_nonce == nonce.server_nonce() && s.ok()) continue;  // First use is fine.
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  }
  {
    v1::HelloRequest replay;
    replay.set_protocol_version(peer::kPeerProtocolVersion);
    replay.set_daemon_id(kCallerId);
    replay.set_server_nonce(nonce.server_nonce());
    replay.set_client_nonce(std::string(32, 'c'));
    replay.set_proof(
        peer::HelloProof(kSecret, nonce.server_nonce(), replay.client_nonce(), kCallerId));
    grpc::ClientContext context;
    v1::HelloResponse r;
    EXPECT_EQ(peer_->Hello(&context, replay, &r).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  // Malformed handshake fields.
  {
    v1::HelloRequest bad;
    bad.set_protocol_version(peer::kPeerProtocolVersion);
    bad.set_daemon_id(std::string(10000, 'd'));
    grpc::ClientContext context;
    v1::HelloResponse r;
    EXPECT_EQ(peer_->Hello(&context, bad, &r).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  // Calls without a session, or with a forged MAC.
  {
    v1::RendezvousRequest rendezvous;
    rendezvous.mutable_auth()->set_session_id("no-such-session");
    grpc::ClientContext context;
    v1::RendezvousResponse r;
    EXPECT_EQ(peer_->Rendezvous(&context, rendezvous, &r).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    std::string key;
    ASSERT_TRUE(Handshake(kSecret, &welcome, &key).ok());
    v1::HeartbeatRequest beat;
    peer::SignPeerRequest("Heartbeat", welcome.session_id(), "not-the-session-key", 1, &beat);
    grpc::ClientContext context;
    v1::HeartbeatResponse r;
    grpc::Status s = peer_->Heartbeat(&context, beat, &r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_THAT(s.error_message(), HasSubstr("MAC"));
    v1::LeaveRequest leave;
    leave.mutable_auth()->set_session_id(welcome.session_id());
    leave.set_group("victim");
    grpc::ClientContext leave_context;
    v1::LeaveResponse lr;
    EXPECT_EQ(peer_->Leave(&leave_context, leave, &lr).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }

  ExpectEpdServing("after the bad handshakes");
  ASSERT_NO_FATAL_FAILURE(ExpectPeerServes("after the bad handshakes"));
  ExpectNewClientServed("after the bad handshakes");
  const std::string log = epd_->Logs();
  EXPECT_THAT(log, AllOf(HasSubstr("Peer call from"), HasSubstr("version mismatch"),
                         HasSubstr("does not know the shared secret")));
  EXPECT_THAT(log, ::testing::Not(HasSubstr(kSecret)));
  ExpectLogBounded(mark, 200, 20, "bad Peer handshakes");
  StopVictimsAndExpectExact();
}

TEST_F(PeerSecurityTest, ReplayedAndReorderedCallsAreRefusedNamingTheSession) {
  ASSERT_NO_FATAL_FAILURE(StartVictims());
  v1::HelloResponse welcome;
  std::string key;
  ASSERT_TRUE(Handshake(kSecret, &welcome, &key).ok());
  const std::string session_hex = absl::BytesToHexString(welcome.session_id());
  const auto beat = [&](uint64_t counter) {
    v1::HeartbeatRequest request;
    request.mutable_held()->set_daemon_instance(7);
    peer::SignPeerRequest("Heartbeat", welcome.session_id(), key, counter, &request);
    return request;
  };
  const auto send = [&](const v1::HeartbeatRequest& request) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::HeartbeatResponse answer;
    return peer_->Heartbeat(&context, request, &answer);
  };
  const v1::HeartbeatRequest first = beat(1);
  ASSERT_TRUE(send(first).ok());
  // The same signed bytes again: a replay.
  grpc::Status replay = send(first);
  EXPECT_EQ(replay.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(replay.error_message(),
              AllOf(HasSubstr(session_hex), HasSubstr("replayed or reordered")));
  // A later call, then an earlier one (captured, held back): a reorder.
  const v1::HeartbeatRequest second = beat(2);
  ASSERT_TRUE(send(beat(3)).ok());
  EXPECT_EQ(send(second).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // A counter changed on the wire breaks the MAC.
  v1::HeartbeatRequest bumped = beat(4);
  bumped.mutable_auth()->set_counter(5);
  EXPECT_EQ(send(bumped).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(send(beat(4)).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectPeerServes("after the replays"));
  StopVictimsAndExpectExact();
}

TEST_F(PeerSecurityTest, GarbageBytesAndAFloodOfBadHandshakes) {
  ASSERT_NO_FATAL_FAILURE(StartVictims());
  const int64_t ok_before = VictimOkRounds();
  const LogMark mark = MarkLog();

  // Raw TCP: garbage, a truncated HTTP/2 preface, and connections closed at once.
  const std::vector<std::string> payloads = {std::string(4096, '\xff'),
                                             "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00",
                                             "GET / HTTP/1.1\r\n\r\n", ""};
  for (int round = 0; round < 50; ++round) {
    for (const std::string& payload : payloads) {
      int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      ASSERT_GE(fd, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(static_cast<uint16_t>(port_));
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
      if (!payload.empty()) (void)!::send(fd, payload.data(), payload.size(), MSG_NOSIGNAL);
      ::close(fd);
    }
  }

  // A flood of bad handshakes from several threads.
  std::vector<std::thread> threads;
  std::atomic<int> refused{0};
  std::atomic<int> accepted{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto stub =
          v1::Peer::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
      for (int i = 0; i < 250; ++i) {
        v1::ChallengeRequest c;
        c.set_protocol_version(peer::kPeerProtocolVersion);
        v1::ChallengeResponse nonce;
        grpc::ClientContext c1;
        c1.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
        if (!stub->Challenge(&c1, c, &nonce).ok()) continue;
        v1::HelloRequest hello;
        hello.set_protocol_version(peer::kPeerProtocolVersion);
        hello.set_daemon_id(absl::StrCat("10.0.", t, ".", i % 250, ":7100"));
        hello.set_server_nonce(nonce.server_nonce());
        hello.set_client_nonce(std::string(32, static_cast<char>(i)));
        hello.set_proof(std::string(32, 'p'));
        grpc::ClientContext c2;
        c2.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
        v1::HelloResponse r;
        grpc::Status s = stub->Hello(&c2, hello, &r);
        (s.error_code() == grpc::StatusCode::UNAUTHENTICATED ? refused : accepted)++;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(accepted.load(), 0);
  EXPECT_GT(refused.load(), 900);

  ExpectEpdServing("after the garbage and the handshake flood");
  ASSERT_NO_FATAL_FAILURE(ExpectPeerServes("after the handshake flood"));
  ExpectNewClientServed("after the handshake flood");
  ExpectVictimProgress(ok_before, 1, "the handshake flood");
  // About a thousand refusals: logged rate-limited, with the count of those suppressed
  // (reported by the first Peer call once the limiter has a token again).
  absl::SleepFor(absl::Seconds(1));
  ASSERT_NO_FATAL_FAILURE(ExpectPeerServes("a second after the handshake flood"));
  EXPECT_THAT(epd_->Logs(), HasSubstr("similar messages"));
  ExpectLogBounded(mark, 300, 60, "a flood of bad Peer handshakes");
  StopVictimsAndExpectExact();
}

/// epd with a descriptor limit of 256, so that a flood of idle connections to the Peer port
/// runs it out of descriptors.
class PeerListenerFloodTest : public PeerSecurityTest {
 protected:
  std::vector<std::string> Wrapper() const override {
    return {"/usr/bin/prlimit", "--nofile=256:256", "--"};
  }
};

TEST_F(PeerListenerFloodTest, IdleConnectionFloodDoesNotStopThePeerListener) {
  ASSERT_NO_FATAL_FAILURE(ExpectPeerServes("before the flood"));
  const LogMark mark = MarkLog();
  // More idle connections than epd has descriptors, opened without waiting (a connect
  // into a full backlog would block), held for a while, then closed.
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port_));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::vector<int> flood;
  for (int i = 0; i < 400; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    (void)::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    flood.push_back(fd);
  }
  absl::SleepFor(absl::Seconds(1));
  for (int fd : flood) ::close(fd);

  // Served again within a few seconds of the flood's end.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  bool served = false;
  std::string last;
  while (!served && absl::Now() < deadline) {
    peer_ = v1::Peer::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
    v1::HelloResponse welcome;
    grpc::Status s = Handshake(kSecret, &welcome);
    served = s.ok();
    if (!served) {
      last = s.error_message();
      absl::SleepFor(absl::Milliseconds(200));
    }
  }
  ASSERT_TRUE(served) << "no handshake within 10 s of the flood's end: " << last << "\n"
                      << epd_->Logs();
  ASSERT_NO_FATAL_FAILURE(ExpectPeerServes("after the flood"));
  ExpectEpdServing("after the flood");
  // The flood was met by the accept loop: connections over the cap, or out of descriptors,
  // were closed at once, and the warnings are rate-limited.
  EXPECT_THAT(epd_->Logs(), HasSubstr("Peer listener: "));
  ExpectLogBounded(mark, 100, 30, "a flood of idle Peer connections");
}

}  // namespace
}  // namespace epd::testing::security
