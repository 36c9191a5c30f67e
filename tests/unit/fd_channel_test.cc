// The fd channel (docs/SECURITY.md "Shared memory the client cannot resize") below the
// listener: its framing (common/os/fd_frame.h), the seal checks of a region the client maps
// (ShmRegion::Map), epd's handler (daemon/server/fd_channel.h) over a socketpair, the client's
// FetchEndpointFds against that handler on a real unix socket, and the registry's
// authorization of a request (GroupRegistry::TakeEndpointFds).
#include "client/fd_channel.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/endpoint/endpoint_internal.h"
#include "common/os/fd_frame.h"
#include "common/os/shm_region.h"
#include "daemon/control/group_registry.h"
#include "daemon/dataplane/host/host_data_plane.h"
#include "daemon/server/fd_channel.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/abi/shm_abi.h"
#include "tests/unit/fake_data_plane.h"

namespace epd {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

/// A connected pair of unix stream sockets.
struct SocketPair {
  SocketPair() {
    int fds[2] = {-1, -1};
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    a = ScopedFd(fds[0]);
    b = ScopedFd(fds[1]);
  }
  ScopedFd a, b;
};

/// The number of descriptors this process has open.
int OpenFdCount() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

/// Whether two descriptors are the same file.
bool SameFile(int x, int y) {
  struct stat sx {
  }, sy{};
  return ::fstat(x, &sx) == 0 && ::fstat(y, &sy) == 0 && sx.st_dev == sy.st_dev &&
         sx.st_ino == sy.st_ino;
}

/// A 4-byte little-endian length prefix.
std::string Prefix(uint32_t length) {
  std::string p(4, '\0');
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  return p;
}

ScopedFd SealedMemfd(uint64_t bytes, int seals) {
  ScopedFd fd(::memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  EXPECT_TRUE(fd.valid());
  EXPECT_EQ(::ftruncate(fd.get(), static_cast<off_t>(bytes)), 0);
  if (seals != 0) EXPECT_EQ(::fcntl(fd.get(), F_ADD_SEALS, seals), 0);
  return fd;
}

// ---- framing ------------------------------------------------------------------------

TEST(FdFrameTest, BodyAndDescriptorsRoundTrip) {
  SocketPair s;
  absl::StatusOr<ShmRegion> r1 = ShmRegion::Create("epd-t1", 4096);
  absl::StatusOr<ShmRegion> r2 = ShmRegion::Create("epd-t2", 128);
  ASSERT_TRUE(r1.ok() && r2.ok());
  const std::string body(kMaxFdFrameBytes, 'x');
  ASSERT_TRUE(
      SendFrame(s.a.get(), body, {r1->fd(), r2->fd()}, absl::Now() + absl::Seconds(5)).ok());
  absl::StatusOr<ReceivedFrame> got =
      ReceiveFrame(s.b.get(), kMaxFdFrameBytes, 2, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->body, body);
  ASSERT_EQ(got->fds.size(), 2u);
  EXPECT_TRUE(SameFile(got->fds[0].get(), r1->fd()));
  EXPECT_TRUE(SameFile(got->fds[1].get(), r2->fd()));
  EXPECT_TRUE(::fcntl(got->fds[0].get(), F_GETFD) & FD_CLOEXEC);
  // An empty body is a frame too.
  ASSERT_TRUE(SendFrame(s.a.get(), "", {}, absl::Now() + absl::Seconds(5)).ok());
  got = ReceiveFrame(s.b.get(), kMaxFdFrameBytes, 2, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->body.empty());
  EXPECT_TRUE(got->fds.empty());
}

TEST(FdFrameTest, OversizedFramesAreRefusedOnBothSides) {
  SocketPair s;
  EXPECT_EQ(SendFrame(s.a.get(), std::string(kMaxFdFrameBytes + 1, 'x'), {}, absl::Now()).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(SendAll(s.a.get(), Prefix(1u << 30), absl::Now() + absl::Seconds(5)).ok());
  const absl::Time start = absl::Now();
  absl::StatusOr<ReceivedFrame> got =
      ReceiveFrame(s.b.get(), kMaxFdFrameBytes, 0, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(got.status().message()),
              AllOf(HasSubstr("1073741824"), HasSubstr(absl::StrCat(kMaxFdFrameBytes))));
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));  // The body was not waited for.
}

TEST(FdFrameTest, SilentAndVanishingPeersAreBounded) {
  SocketPair s;
  // The length, then nothing: the deadline ends the wait.
  ASSERT_TRUE(SendAll(s.a.get(), Prefix(10), absl::Now() + absl::Seconds(5)).ok());
  absl::Time start = absl::Now();
  absl::StatusOr<ReceivedFrame> got =
      ReceiveFrame(s.b.get(), kMaxFdFrameBytes, 0, absl::Now() + absl::Milliseconds(200));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded) << got.status();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(190));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  // Half a body, then the peer closes.
  SocketPair u;
  ASSERT_TRUE(SendAll(u.a.get(), Prefix(10) + "12345", absl::Now() + absl::Seconds(5)).ok());
  u.a.Reset();
  got = ReceiveFrame(u.b.get(), kMaxFdFrameBytes, 0, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  // Sending to a closed peer is UNAVAILABLE, not SIGPIPE.
  SocketPair t;
  t.b.Reset();
  EXPECT_EQ(SendAll(t.a.get(), "x", absl::Now() + absl::Seconds(1)).code(),
            absl::StatusCode::kUnavailable);
}

TEST(FdFrameTest, SurplusDescriptorsAreRefusedAndClosed) {
  SocketPair s;
  std::vector<ScopedFd> sent;
  std::vector<int> raw;
  for (int i = 0; i < 3; ++i) {
    sent.push_back(SealedMemfd(4096, kRequiredSeals));
    raw.push_back(sent.back().get());
  }
  ASSERT_TRUE(SendFrame(s.a.get(), "abc", raw, absl::Now() + absl::Seconds(5)).ok());
  sent.clear();
  const int before = OpenFdCount();
  absl::StatusOr<ReceivedFrame> got =
      ReceiveFrame(s.b.get(), kMaxFdFrameBytes, 1, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
  EXPECT_EQ(OpenFdCount(), before);  // Nothing of the surplus stays open here.
}

// ---- seal checks (the client side of mapping) ----------------------------------------

TEST(ShmRegionMapTest, OnlySealedMemfdsOfTheExpectedSizeAreMapped) {
  // Unsealed, partly sealed, or not sealable at all: refused, naming what and why.
  struct Case {
    ScopedFd fd;
    std::string expected;
  };
  std::vector<Case> refused;
  refused.push_back({SealedMemfd(4096, 0), "F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL"});
  refused.push_back({SealedMemfd(4096, F_SEAL_SHRINK), "F_SEAL_GROW|F_SEAL_SEAL"});
  refused.push_back({SealedMemfd(4096, F_SEAL_SHRINK | F_SEAL_GROW), "F_SEAL_SEAL"});
  // A memfd made without MFD_ALLOW_SEALING carries F_SEAL_SEAL alone.
  refused.push_back({ScopedFd(::memfd_create("plain", MFD_CLOEXEC)), "F_SEAL_SHRINK|F_SEAL_GROW,"});
  FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  refused.push_back({ScopedFd(::dup(::fileno(file))), "not a sealable memfd"});
  std::fclose(file);
  refused.push_back({SealedMemfd(8192, kRequiredSeals), "8192 bytes, expected 4096"});
  for (Case& c : refused) {
    absl::StatusOr<ShmRegion> mapped = ShmRegion::Map(std::move(c.fd), 4096, "test region");
    EXPECT_EQ(mapped.status().code(), absl::StatusCode::kFailedPrecondition) << c.expected;
    EXPECT_THAT(std::string(mapped.status().message()),
                AllOf(HasSubstr("test region"), HasSubstr(c.expected)));
  }
  EXPECT_EQ(ShmRegion::Map(ScopedFd(), 4096, "none").status().code(),
            absl::StatusCode::kInvalidArgument);
  // What epd creates maps, and stays mapped once the descriptor is gone.
  absl::StatusOr<ShmRegion> created = ShmRegion::Create("epd-t", 4096);
  ASSERT_TRUE(created.ok()) << created.status();
  created->data()[7] = 42;
  absl::StatusOr<ShmRegion> mapped = ShmRegion::Map(created->TakeFd(), 4096, "region");
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  EXPECT_EQ(mapped->fd(), -1);
  EXPECT_EQ(mapped->data()[7], 42);
  mapped->data()[8] = 43;
  EXPECT_EQ(created->data()[8], 43);
  EXPECT_EQ(created->DupFd().status().code(), absl::StatusCode::kFailedPrecondition);
}

// The client library refuses an endpoint whose region is not sealed, before it maps it.
TEST(ShmRegionMapTest, OpenEndpointRefusesAnUnsealedRegion) {
  HostDataPlaneOptions o;
  o.host_threads = 1;
  auto plane = MakeHostDataPlane(o);
  ASSERT_TRUE(plane.ok()) << plane.status();
  v1::GroupSpec spec = testing::SmallSpec("unsealed");
  spec.set_num_ranks(1);
  auto group = (*plane)->CreateGroup(spec);
  ASSERT_TRUE(group.ok()) << group.status();
  v1::EndpointInfo info;
  ASSERT_TRUE((*group)->AttachRank(0, "", v1::LAUNCH_MODE_UNSPECIFIED, {}, &info).ok());
  absl::StatusOr<EndpointFds> fds = (*group)->TakeEndpointFds(0);
  ASSERT_TRUE(fds.ok()) << fds.status();
  for (const bool doorbell : {false, true}) {
    EndpointFds forged;
    forged.endpoint_id = fds->endpoint_id;
    forged.region = doorbell ? ScopedFd(::dup(fds->region.get()))
                             : SealedMemfd(info.shm_bytes(), F_SEAL_SHRINK | F_SEAL_GROW);
    forged.doorbell =
        doorbell ? SealedMemfd(sizeof(abi::DoorbellPage), 0) : ScopedFd(::dup(fds->doorbell.get()));
    auto ep =
        internal::OpenEndpoint(info, spec, std::move(forged), [] { return absl::OkStatus(); });
    EXPECT_EQ(ep.status().code(), absl::StatusCode::kFailedPrecondition) << ep.status();
    EXPECT_THAT(std::string(ep.status().message()),
                AllOf(HasSubstr(doorbell ? "doorbell" : "endpoint region"), HasSubstr("F_SEAL")));
  }
  // Descriptors of another endpoint are refused too.
  fds->endpoint_id += 1;
  auto ep = internal::OpenEndpoint(info, spec, *std::move(fds), [] { return absl::OkStatus(); });
  EXPECT_EQ(ep.status().code(), absl::StatusCode::kFailedPrecondition) << ep.status();
}

// ---- epd's handler over a socketpair ----------------------------------------------------

/// A FdChannel whose Fetch records its calls and answers as the test says.
class FdChannelTest : public ::testing::Test {
 protected:
  FdChannelTest() {
    FdChannelOptions options;
    options.request_timeout = absl::Milliseconds(300);
    options.response_timeout = absl::Milliseconds(300);
    auto channel = FdChannel::Start(
        [this](const v1::FdChannelRequest& request,
               const PeerCredentials& peer) -> absl::StatusOr<EndpointFds> {
          ++calls_;
          last_request_ = request;
          last_peer_ = peer;
          if (!answer_.ok()) return answer_;
          EndpointFds fds;
          fds.region = SealedMemfd(4096, kRequiredSeals);
          fds.doorbell = SealedMemfd(sizeof(abi::DoorbellPage), kRequiredSeals);
          fds.endpoint_id = 77;
          return fds;
        },
        options);
    EXPECT_TRUE(channel.ok()) << channel.status();
    channel_ = *std::move(channel);
  }

  /// Hands `s.b` to the channel while the test writes `bytes` to `s.a`, then reads the
  /// answer (nullopt = closed without one). `*took` is how long until the answer or close.
  std::optional<ReceivedFrame> Exchange(const std::string& bytes, absl::Duration* took = nullptr,
                                        std::vector<int> fds = {}) {
    SocketPair s;
    const absl::Time start = absl::Now();
    channel_->Serve(std::move(s.b), peer_);
    if (!bytes.empty() || !fds.empty()) {
      EXPECT_TRUE(SendWithDescriptors(s.a.get(), bytes, fds));
    }
    absl::StatusOr<ReceivedFrame> frame =
        ReceiveFrame(s.a.get(), kMaxFdFrameBytes, 2, absl::Now() + absl::Seconds(5));
    if (took != nullptr) *took = absl::Now() - start;
    if (!frame.ok()) {
      EXPECT_TRUE(absl::IsUnavailable(frame.status())) << frame.status();  // Closed.
      return std::nullopt;
    }
    return *std::move(frame);
  }
  static bool SendWithDescriptors(int socket, const std::string& bytes, std::vector<int> fds) {
    if (fds.empty()) return SendAll(socket, bytes, absl::Now() + absl::Seconds(5)).ok();
    // The frame again, with descriptors attached.
    return SendFrame(socket, bytes.substr(4), fds, absl::Now() + absl::Seconds(5)).ok();
  }
  static v1::FdChannelResponse Parse(const ReceivedFrame& frame) {
    v1::FdChannelResponse response;
    EXPECT_TRUE(response.ParseFromString(frame.body));
    return response;
  }
  static std::string Request(const std::string& session, const std::string& group, int rank) {
    v1::FdChannelRequest r;
    r.set_session_id(session);
    r.set_group(group);
    r.set_rank(rank);
    const std::string body = r.SerializeAsString();
    return Prefix(static_cast<uint32_t>(body.size())) + body;
  }

  std::unique_ptr<FdChannel> channel_;
  absl::Status answer_;
  std::atomic<int> calls_{0};
  v1::FdChannelRequest last_request_;
  PeerCredentials last_peer_;
  PeerCredentials peer_{.pid = 123, .uid = 1000, .gid = 1000};
};

TEST_F(FdChannelTest, AnAuthorizedRequestGetsTheRegionAndTheDoorbell) {
  std::optional<ReceivedFrame> answer = Exchange(Request("s1", "g", 3));
  ASSERT_TRUE(answer.has_value());
  v1::FdChannelResponse response = Parse(*answer);
  EXPECT_EQ(response.code(), 0) << response.message();
  EXPECT_EQ(response.endpoint_id(), 77u);
  ASSERT_EQ(answer->fds.size(), 2u);
  struct stat st {};
  ASSERT_EQ(::fstat(answer->fds[0].get(), &st), 0);
  EXPECT_EQ(st.st_size, 4096);
  ASSERT_EQ(::fstat(answer->fds[1].get(), &st), 0);
  EXPECT_EQ(st.st_size, static_cast<off_t>(sizeof(abi::DoorbellPage)));
  EXPECT_EQ(last_request_.session_id(), "s1");
  EXPECT_EQ(last_request_.group(), "g");
  EXPECT_EQ(last_request_.rank(), 3);
  EXPECT_EQ(last_peer_, peer_);  // The peer's credentials, as the listener gave them.
}

TEST_F(FdChannelTest, RefusalsCarryTheErrorAndNoDescriptors) {
  answer_ = absl::PermissionDeniedError("session s1 was opened by uid 0, not by uid 1000");
  std::optional<ReceivedFrame> answer = Exchange(Request("s1", "g", 0));
  ASSERT_TRUE(answer.has_value());
  v1::FdChannelResponse response = Parse(*answer);
  EXPECT_EQ(response.code(), static_cast<int>(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(response.message(), HasSubstr("not by uid 1000"));
  EXPECT_TRUE(answer->fds.empty());
}

TEST_F(FdChannelTest, MalformedRequestsAreAnsweredInvalidArgument) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {Prefix(4) + "\xff\xff\xff\xff", "not an epd.v1.FdChannelRequest"},
      {Prefix(kMaxFdFrameBytes + 1) + "x", absl::StrCat(kMaxFdFrameBytes + 1)},
      {Prefix(0xffffffffu), "4294967295"},
  };
  for (const auto& [bytes, text] : cases) {
    std::optional<ReceivedFrame> answer = Exchange(bytes);
    ASSERT_TRUE(answer.has_value()) << text;
    v1::FdChannelResponse response = Parse(*answer);
    EXPECT_EQ(response.code(), static_cast<int>(absl::StatusCode::kInvalidArgument)) << text;
    EXPECT_THAT(response.message(), HasSubstr(text));
    EXPECT_TRUE(answer->fds.empty());
  }
  // A request that brings descriptors of its own: refused, and none is kept.
  ScopedFd mine = SealedMemfd(4096, kRequiredSeals);
  std::optional<ReceivedFrame> answer = Exchange(Request("s1", "g", 0), nullptr, {mine.get()});
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(Parse(*answer).code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(calls_.load(), 0);  // None of these reached the registry.
}

TEST_F(FdChannelTest, APeerThatSendsNothingIsClosedWithinTheTimeout) {
  for (const std::string& partial : {std::string(), Prefix(20), Prefix(20) + "abc"}) {
    absl::Duration took;
    std::optional<ReceivedFrame> answer = Exchange(partial, &took);
    EXPECT_FALSE(answer.has_value());
    EXPECT_GE(took, absl::Milliseconds(290));
    EXPECT_LT(took, absl::Seconds(2));
  }
  EXPECT_EQ(calls_.load(), 0);
}

// Silent peers hold no thread: while many wait for their deadline, a complete request is
// answered at once.
TEST_F(FdChannelTest, SilentPeersDelayNobody) {
  std::vector<SocketPair> silent(50);
  for (SocketPair& s : silent) channel_->Serve(std::move(s.b), peer_);
  const absl::Time start = absl::Now();
  std::optional<ReceivedFrame> answer = Exchange(Request("s1", "g", 0));
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(Parse(*answer).code(), 0);
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(200));
  for (SocketPair& s : silent) {
    absl::StatusOr<ReceivedFrame> closed =
        ReceiveFrame(s.a.get(), kMaxFdFrameBytes, 0, absl::Now() + absl::Seconds(5));
    EXPECT_EQ(closed.status().code(), absl::StatusCode::kUnavailable) << closed.status();
  }
}

// Beyond max_pending, the oldest waiting connection is closed.
TEST(FdChannelLimitTest, TheOldestOfTooManyWaitingConnectionsIsClosed) {
  FdChannelOptions options;
  options.max_pending = 4;
  options.request_timeout = absl::Seconds(30);
  auto channel = FdChannel::Start(
      [](const v1::FdChannelRequest&, const PeerCredentials&) -> absl::StatusOr<EndpointFds> {
        return absl::NotFoundError("none");
      },
      options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  std::vector<SocketPair> conns(5);
  for (SocketPair& s : conns) (*channel)->Serve(std::move(s.b), PeerCredentials{});
  absl::StatusOr<ReceivedFrame> oldest =
      ReceiveFrame(conns[0].a.get(), kMaxFdFrameBytes, 0, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(oldest.status().code(), absl::StatusCode::kUnavailable) << oldest.status();
  absl::StatusOr<ReceivedFrame> newest =
      ReceiveFrame(conns[4].a.get(), kMaxFdFrameBytes, 0, absl::Now() + absl::Milliseconds(300));
  EXPECT_EQ(newest.status().code(), absl::StatusCode::kDeadlineExceeded) << newest.status();
}

// A fetch that takes longer than request_timeout (it waits on a join that allocates GBs)
// does not make the requests that arrived meanwhile expire: their time is the channel's.
TEST(FdChannelSlowFetchTest, PeersWaitingOnASlowFetchAreStillAnswered) {
  FdChannelOptions options;
  options.request_timeout = absl::Milliseconds(200);
  options.response_timeout = absl::Milliseconds(500);
  std::atomic<int> calls{0};
  auto channel = FdChannel::Start(
      [&](const v1::FdChannelRequest&, const PeerCredentials&) -> absl::StatusOr<EndpointFds> {
        if (calls.fetch_add(1) == 0) absl::SleepFor(absl::Milliseconds(600));
        return absl::NotFoundError("none");
      },
      options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  v1::FdChannelRequest r;
  r.set_session_id("s");
  r.set_group("g");
  const std::string body = r.SerializeAsString();
  const std::string request = Prefix(static_cast<uint32_t>(body.size())) + body;
  std::vector<SocketPair> conns(3);
  // The first one's fetch is slow; the others connect and send while it runs.
  (*channel)->Serve(std::move(conns[0].b), PeerCredentials{});
  ASSERT_TRUE(SendAll(conns[0].a.get(), request, absl::Now() + absl::Seconds(5)).ok());
  absl::SleepFor(absl::Milliseconds(100));
  (*channel)->Serve(std::move(conns[1].b), PeerCredentials{});
  ASSERT_TRUE(SendAll(conns[1].a.get(), request, absl::Now() + absl::Seconds(5)).ok());
  (*channel)->Serve(std::move(conns[2].b), PeerCredentials{});
  ASSERT_TRUE(SendAll(conns[2].a.get(), request, absl::Now() + absl::Seconds(5)).ok());
  for (size_t i = 0; i < conns.size(); ++i) {
    absl::StatusOr<ReceivedFrame> answer =
        ReceiveFrame(conns[i].a.get(), kMaxFdFrameBytes, 2, absl::Now() + absl::Seconds(5));
    ASSERT_TRUE(answer.ok()) << "connection " << i << ": " << answer.status();
    v1::FdChannelResponse response;
    ASSERT_TRUE(response.ParseFromString(answer->body));
    EXPECT_EQ(response.code(), static_cast<int>(absl::StatusCode::kNotFound)) << i;
  }
  EXPECT_EQ(calls.load(), 3);
}

// ---- the client's side against the handler, on a real unix socket ----------------------

/// A unix socket served by `channel` as epd's listener would: accept, check the preamble,
/// hand over with the peer's SO_PEERCRED.
class ServedSocket {
 public:
  explicit ServedSocket(FdChannel& channel) {
    dir_ = ::testing::TempDir() + "/fdch" + std::to_string(::getpid());
    std::filesystem::create_directories(dir_);
    path_ = dir_ + "/s.sock";
    ::unlink(path_.c_str());
    listener_ = ScopedFd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path_.c_str());
    EXPECT_EQ(::bind(listener_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(::listen(listener_.get(), 8), 0);
    thread_ = std::thread([this, &channel] {
      for (;;) {
        ScopedFd conn(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
        if (!conn.valid() || stop_.load()) return;
        char preamble[sizeof(abi::kFdChannelPreamble)];
        if (::recv(conn.get(), preamble, sizeof(preamble), MSG_WAITALL) !=
                static_cast<ssize_t>(sizeof(preamble)) ||
            std::memcmp(preamble, abi::kFdChannelPreamble, sizeof(preamble)) != 0) {
          continue;
        }
        std::optional<PeerCredentials> peer = SocketPeerCredentials(conn.get());
        channel.Serve(std::move(conn), peer.value_or(PeerCredentials{}));
      }
    });
  }
  ~ServedSocket() {
    stop_.store(true);
    ScopedFd wake(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path_.c_str());
    (void)::connect(wake.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    thread_.join();
    std::filesystem::remove_all(dir_);
  }
  const std::string& path() const { return path_; }

 private:
  std::string dir_, path_;
  ScopedFd listener_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

TEST_F(FdChannelTest, ClientFetchesOverARealSocketAndGetsTheDaemonsErrors) {
  ServedSocket socket(*channel_);
  absl::StatusOr<EndpointFds> fds =
      internal::FetchEndpointFds(socket.path(), "s9", "grp", 2, absl::Seconds(5));
  ASSERT_TRUE(fds.ok()) << fds.status();
  EXPECT_EQ(fds->endpoint_id, 77u);
  EXPECT_TRUE(fds->region.valid() && fds->doorbell.valid());
  EXPECT_EQ(last_request_.session_id(), "s9");
  EXPECT_EQ(last_peer_.pid, ::getpid());  // SO_PEERCRED of the client's connection.
  EXPECT_EQ(last_peer_.uid, ::geteuid());

  answer_ = absl::NotFoundError("no such rank");
  fds = internal::FetchEndpointFds(socket.path(), "s9", "grp", 2, absl::Seconds(5));
  EXPECT_EQ(fds.status(), absl::NotFoundError("no such rank"));
  // Nothing listens: UNAVAILABLE naming the path.
  fds = internal::FetchEndpointFds(socket.path() + ".none", "s9", "grp", 2, absl::Seconds(5));
  EXPECT_EQ(fds.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(fds.status().message()), HasSubstr(socket.path() + ".none"));
}

TEST(UnixSocketPathOfTest, UnixTargetsOnly) {
  EXPECT_EQ(*internal::UnixSocketPathOf("unix:///run/epd/epd.sock"), "/run/epd/epd.sock");
  EXPECT_EQ(*internal::UnixSocketPathOf("unix:/run/epd.sock"), "/run/epd.sock");
  EXPECT_EQ(internal::UnixSocketPathOf("127.0.0.1:5").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(internal::UnixSocketPathOf("unix://host/x").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// ---- the registry's authorization ---------------------------------------------------

class TakeEndpointFdsTest : public ::testing::Test {
 protected:
  TakeEndpointFdsTest()
      : state_(std::make_shared<testing::FakeDataPlaneState>()),
        plane_(state_),
        registry_(&plane_, GpuInventory(), GroupRegistry::Options()) {}
  std::string Session(uint32_t uid) {
    absl::StatusOr<std::string> id =
        registry_.OpenSession(PeerCredentials{.pid = 10, .uid = uid, .gid = uid}, "t");
    EXPECT_TRUE(id.ok()) << id.status();
    return id.value_or("");
  }
  void Join(const std::string& session, int rank) {
    v1::JoinGroupRequest request;
    *request.mutable_spec() = testing::SmallSpec("g");
    request.set_rank(rank);
    request.set_session_id(session);
    request.set_join_secret("fd-channel-test");  // Ranks of two uids share the group.
    absl::StatusOr<v1::EndpointInfo> info = registry_.Join(request);
    ASSERT_TRUE(info.ok()) << info.status();
  }
  std::shared_ptr<testing::FakeDataPlaneState> state_;
  testing::FakeDataPlane plane_;
  GroupRegistry registry_;
};

TEST_F(TakeEndpointFdsTest, OnlyTheSessionsUidHoldingTheRankGetsThemOnce) {
  const std::string alice = Session(1000);
  const std::string bob = Session(1001);
  Join(alice, 0);
  Join(bob, 1);
  const PeerCredentials alice_peer{.pid = 11, .uid = 1000, .gid = 1000};
  const PeerCredentials bob_peer{.pid = 12, .uid = 1001, .gid = 1001};
  // An unknown session id.
  absl::StatusOr<EndpointFds> fds = registry_.TakeEndpointFds("nope", "g", 0, alice_peer);
  EXPECT_EQ(fds.status().code(), absl::StatusCode::kFailedPrecondition) << fds.status();
  // Alice's session id presented by bob's uid.
  fds = registry_.TakeEndpointFds(alice, "g", 0, bob_peer);
  EXPECT_EQ(fds.status().code(), absl::StatusCode::kPermissionDenied) << fds.status();
  EXPECT_THAT(std::string(fds.status().message()), HasSubstr("1001"));
  // A rank, or a group, alice's session does not hold.
  fds = registry_.TakeEndpointFds(alice, "g", 1, alice_peer);
  EXPECT_EQ(fds.status().code(), absl::StatusCode::kPermissionDenied) << fds.status();
  fds = registry_.TakeEndpointFds(alice, "other", 0, alice_peer);
  EXPECT_EQ(fds.status().code(), absl::StatusCode::kPermissionDenied) << fds.status();
  EXPECT_TRUE(state_->fds_taken.empty());
  // The holder: once (another process of alice's uid may present her session id too).
  fds = registry_.TakeEndpointFds(alice, "g", 0, alice_peer);
  ASSERT_TRUE(fds.ok()) << fds.status();
  EXPECT_TRUE(fds->region.valid() && fds->doorbell.valid());
  fds = registry_.TakeEndpointFds(alice, "g", 0, alice_peer);
  EXPECT_EQ(fds.status().code(), absl::StatusCode::kFailedPrecondition) << fds.status();
  // A fresh join of the rank is a fresh endpoint: its descriptors can be fetched again.
  v1::LeaveGroupRequest leave;
  leave.set_group("g");
  leave.set_rank(0);
  leave.set_session_id(alice);
  ASSERT_TRUE(registry_.Leave(leave).ok());
  Join(alice, 0);
  EXPECT_TRUE(registry_.TakeEndpointFds(alice, "g", 0, alice_peer).ok());
  // Draining: refused.
  registry_.SetDraining();
  EXPECT_EQ(registry_.TakeEndpointFds(bob, "g", 1, bob_peer).status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace epd
