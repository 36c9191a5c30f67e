// A client flooding its endpoints' rings with garbage slots, against a real epd (host
// backend), cannot flood epd's log: the warnings it causes are charged to its uid's budget
// (daemon/core/logging.h LogRateLimiter, one per uid in GroupRegistry), which new sessions, new
// groups and rejoins share, and one line counts those that were dropped. Every slot is
// still counted (rejected_requests) and epd keeps serving.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/fd_channel.h"
#include "common/os/futex.h"
#include "common/os/shm_region.h"
#include "epd/v1/control.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/abi/shm_abi.h"
#include "tests/common/daemon_process.h"

namespace epd {
namespace {

using testing::DaemonProcess;
using Clock = std::chrono::steady_clock;

/// One session of this process that joins a 1-rank group, maps its endpoint the way a
/// client must (the fd channel) and writes garbage ring slots into it.
class RingFlooder {
 public:
  explicit RingFlooder(DaemonProcess& epd) : epd_(epd) {
    stub_ = v1::Control::NewStub(
        grpc::CreateChannel(epd.unix_target(), grpc::InsecureChannelCredentials()));
  }
  ~RingFlooder() { Close(); }

  /// Opens the session and joins rank 0 of 1-rank group `group`. Fatal failures.
  void Join(const std::string& group) {
    session_ = stub_->Session(&session_context_);
    v1::SessionRequest hello;
    hello.set_client_pid(getpid());
    hello.set_client_name("ring_flood_logging_test");
    ASSERT_TRUE(session_->Write(hello));
    v1::SessionResponse open;
    ASSERT_TRUE(session_->Read(&open));

    v1::JoinGroupRequest join;
    v1::GroupSpec& spec = *join.mutable_spec();
    spec.set_name(group);
    spec.set_num_ranks(1);
    spec.set_num_experts(2);
    spec.set_hidden(128);
    spec.set_num_topk(1);
    spec.set_max_tokens_per_rank(4);
    join.set_session_id(open.session_id());
    v1::JoinGroupResponse joined;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Status status = stub_->JoinGroup(&context, join, &joined);
    ASSERT_TRUE(status.ok()) << status.error_message();
    const v1::EndpointInfo& info = joined.endpoint();
    absl::StatusOr<EndpointFds> fds = internal::FetchEndpointFds(
        epd_.socket_path(), open.session_id(), info.group(), info.rank(), absl::Seconds(10));
    ASSERT_TRUE(fds.ok()) << fds.status();
    auto region = ShmRegion::Map(std::move(fds->region), info.shm_bytes(), "endpoint region");
    ASSERT_TRUE(region.ok()) << region.status();
    region_ = std::move(*region);
    auto doorbell = ShmRegion::Map(std::move(fds->doorbell), sizeof(abi::DoorbellPage), "doorbell");
    ASSERT_TRUE(doorbell.ok()) << doorbell.status();
    doorbell_ = std::move(*doorbell);
  }

  /// Writes `slots` garbage slots, a ring's worth at a time, each batch consumed by epd
  /// before the next. Fatal failure when epd stops consuming.
  void Flood(int slots) {
    auto* h = reinterpret_cast<abi::EndpointShmHeader*>(region_.data());
    auto* ring = reinterpret_cast<abi::RequestSlot*>(region_.data() +
                                                     abi::ComputeEndpointShmLayout(0).ring_offset);
    auto* doorbell = reinterpret_cast<abi::DoorbellPage*>(doorbell_.data());
    int published = 0;
    while (published < slots) {
      const uint64_t head = abi::Atomic(h->ring_head).load();
      const int n = std::min<int>(abi::kRingCapacity, slots - published);
      for (int i = 1; i <= n; ++i) {
        std::memset(&ring[(head + i) % abi::kRingCapacity], 0xA0 + (published + i) % 16,
                    sizeof(abi::RequestSlot));
      }
      abi::Atomic(h->ring_head).store(head + n, std::memory_order_seq_cst);
      abi::Atomic(doorbell->futex_word).fetch_add(1, std::memory_order_seq_cst);
      FutexWakeAll(&doorbell->futex_word);  // As the client library rings it.
      published += n;
      const auto deadline = Clock::now() + std::chrono::seconds(10);
      while (abi::Atomic(h->ring_tail).load(std::memory_order_acquire) != head + n) {
        ASSERT_LT(Clock::now(), deadline) << "epd stopped consuming the ring";
        std::this_thread::yield();
      }
    }
    rejected_ = abi::Atomic(h->rejected_requests).load();
  }
  /// The endpoint's rejected_requests after the last Flood.
  uint64_t rejected() const { return rejected_; }

  /// Ends the session: epd releases its endpoint (and group).
  void Close() {
    if (!session_) return;
    session_->WritesDone();
    session_context_.TryCancel();
    session_->Finish().IgnoreError();
    session_.reset();
  }

 private:
  DaemonProcess& epd_;
  std::unique_ptr<v1::Control::Stub> stub_;
  grpc::ClientContext session_context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> session_;
  ShmRegion region_;
  ShmRegion doorbell_;
  uint64_t rejected_ = 0;
};

struct LineCounts {
  int malformed = 0;  ///< "dropped a malformed ring slot" warnings.
  int reports = 0;    ///< Lines counting suppressed ones, of this process's uid.
};

LineCounts CountLines(const std::string& logs, const std::string& last_source) {
  LineCounts counts;
  const std::string report = absl::StrCat("similar messages from uid ", getuid(), " (last: ");
  for (absl::string_view line : absl::StrSplit(logs, '\n')) {
    counts.malformed += absl::StrContains(line, "dropped a malformed ring slot");
    counts.reports += absl::StrContains(line, report) && absl::StrContains(line, last_source);
  }
  return counts;
}

/// The most warning lines a budget of 10 at once and 2 a second (LogRateLimiter's
/// defaults) can give in `seconds`, with slack for a slow machine.
int Bound(double seconds) { return 10 + static_cast<int>(2 * (seconds + 2)) + 5; }

TEST(RingFloodLoggingTest, TwentyThousandGarbageSlotsGiveABoundedNumberOfLogLines) {
  testing::DaemonProcessOptions options;
  options.log_level = "info";
  auto epd = DaemonProcess::Start(options);
  ASSERT_TRUE(epd.ok()) << epd.status();
  RingFlooder flooder(**epd);
  ASSERT_NO_FATAL_FAILURE(flooder.Join("flood"));
  constexpr int kSlots = 20000;
  const auto start = Clock::now();
  ASSERT_NO_FATAL_FAILURE(flooder.Flood(kSlots));
  const double flood_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_EQ(flooder.rejected(), static_cast<uint64_t>(kSlots));
  // The dropped lines' count comes out once the uid's budget has a token again.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  auto health = (*epd)->CheckHealth();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);

  flooder.Close();
  absl::StatusOr<int> code = (*epd)->Stop();
  ASSERT_TRUE(code.ok()) << code.status();
  const std::string logs = (*epd)->Logs();
  const LineCounts counts = CountLines(logs, "group flood rank 0 (endpoint");
  EXPECT_GE(counts.malformed, 1);
  EXPECT_LE(counts.malformed, Bound(flood_seconds)) << "flood took " << flood_seconds << " s";
  EXPECT_GE(counts.reports, 1) << logs.substr(logs.size() > 4000 ? logs.size() - 4000 : 0);
  EXPECT_LE(counts.reports, Bound(flood_seconds));
}

TEST(RingFloodLoggingTest, NewSessionsGroupsAndRejoinsDrawFromOneBudgetPerUid) {
  // A client that opens a new session, joins a new group and floods it, again and again,
  // gets its uid's one budget, not a fresh burst each time.
  testing::DaemonProcessOptions options;
  options.log_level = "info";
  auto epd = DaemonProcess::Start(options);
  ASSERT_TRUE(epd.ok()) << epd.status();
  constexpr int kRounds = 40, kSlots = 64;
  const auto start = Clock::now();
  for (int i = 0; i < kRounds; ++i) {
    RingFlooder flooder(**epd);
    ASSERT_NO_FATAL_FAILURE(flooder.Join(absl::StrCat("rejoin-", i)));
    ASSERT_NO_FATAL_FAILURE(flooder.Flood(kSlots));
    EXPECT_EQ(flooder.rejected(), static_cast<uint64_t>(kSlots));
  }
  const double flood_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  // Every endpoint is gone: the count comes out through the registry's periodic report.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  auto health = (*epd)->CheckHealth();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
  const std::string logs = (*epd)->Logs();
  const LineCounts counts = CountLines(logs, "group rejoin-");
  EXPECT_GE(counts.malformed, 1);
  EXPECT_LE(counts.malformed, Bound(flood_seconds))
      << kRounds << " rounds took " << flood_seconds << " s";
  EXPECT_GE(counts.reports, 1) << logs.substr(logs.size() > 4000 ? logs.size() - 4000 : 0);
  EXPECT_LE(counts.reports, Bound(flood_seconds));
  absl::StatusOr<int> code = (*epd)->Stop();
  ASSERT_TRUE(code.ok()) << code.status();
}

}  // namespace
}  // namespace epd

namespace epd {
namespace {

// The control plane's client-caused lines (sessions opened and ended, refused joins) are
// charged to a budget per uid too: thousands of sessions and refused joins from one client
// give a bounded number of lines and a count of the rest, and epd keeps serving.
TEST(ControlFloodLoggingTest, SessionChurnAndRefusedJoinsGiveABoundedNumberOfLogLines) {
  testing::DaemonProcessOptions options;
  options.log_level = "info";
  auto epd = DaemonProcess::Start(options);
  ASSERT_TRUE(epd.ok()) << epd.status();
  auto stub = v1::Control::NewStub(
      grpc::CreateChannel((*epd)->unix_target(), grpc::InsecureChannelCredentials()));
  constexpr int kSessions = 1500, kRefusals = 1500;
  const auto start = Clock::now();
  for (int i = 0; i < kSessions; ++i) {
    grpc::ClientContext context;
    auto session = stub->Session(&context);
    v1::SessionRequest hello;
    hello.set_client_name("churn");
    ASSERT_TRUE(session->Write(hello));
    v1::SessionResponse open;
    ASSERT_TRUE(session->Read(&open));
    session->WritesDone();
    session->Finish().IgnoreError();
  }
  for (int i = 0; i < kRefusals; ++i) {
    v1::JoinGroupRequest join;  // No session: refused (and logged) every time.
    join.mutable_spec()->set_name(absl::StrCat("refused-", i));
    join.set_session_id("not-a-session");
    v1::JoinGroupResponse joined;
    grpc::ClientContext context;
    EXPECT_FALSE(stub->JoinGroup(&context, join, &joined).ok());
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // The periodic report.
  auto health = (*epd)->CheckHealth();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
  absl::StatusOr<int> code = (*epd)->Stop();
  ASSERT_TRUE(code.ok()) << code.status();
  const std::string logs = (*epd)->Logs();
  int opened = 0, ended = 0, refused = 0, reports = 0;
  for (absl::string_view line : absl::StrSplit(logs, '\n')) {
    opened += absl::StrContains(line, "opened (pid");
    ended += absl::StrContains(line, ") ended (");
    refused += absl::StrContains(line, "JoinGroup group \"refused-");
    reports += absl::StrContains(line, "similar messages from uid");
  }
  // The budget: a burst of 200 lines, then 20 a second (GroupRegistry::ControlLogBudget),
  // for every line of the uid together; before, each session and refusal gave its line.
  const int bound = 200 + static_cast<int>(20 * (seconds + 3));
  EXPECT_LE(opened + ended + refused, bound) << opened << " opened, " << ended << " ended, "
                                             << refused << " refused in " << seconds << " s";
  EXPECT_GE(opened, 1);
  EXPECT_GE(reports, 1) << logs.substr(logs.size() > 4000 ? logs.size() - 4000 : 0);
}

}  // namespace
}  // namespace epd
