// A client flooding its endpoint's ring with garbage slots, against a real epd (host
// backend), cannot flood epd's log: the warnings it causes are rate-limited per endpoint
// (daemon/logging.h LogRateLimiter), and one line counts those that were dropped. Every
// slot is still counted (rejected_requests) and epd keeps serving.
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/fd_channel.h"
#include "epd/v1/control.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "shm_abi.h"
#include "shm_region.h"
#include "tests/integration/daemon_process.h"

namespace epd {
namespace {

using testing::DaemonProcess;

TEST(RingFloodLoggingTest, TwentyThousandGarbageSlotsGiveABoundedNumberOfLogLines) {
  testing::DaemonProcessOptions options;
  options.log_level = "info";
  auto epd = DaemonProcess::Start(options);
  ASSERT_TRUE(epd.ok()) << epd.status();
  auto stub = v1::Control::NewStub(
      grpc::CreateChannel((*epd)->unix_target(), grpc::InsecureChannelCredentials()));

  grpc::ClientContext session_context;
  auto session = stub->Session(&session_context);
  v1::SessionRequest hello;
  hello.set_client_pid(getpid());
  hello.set_client_name("ring_flood_logging_test");
  ASSERT_TRUE(session->Write(hello));
  v1::SessionResponse open;
  ASSERT_TRUE(session->Read(&open));

  v1::JoinGroupRequest join;
  v1::GroupSpec& spec = *join.mutable_spec();
  spec.set_name("flood");
  spec.set_num_ranks(1);
  spec.set_num_experts(2);
  spec.set_hidden(128);
  spec.set_num_topk(1);
  spec.set_max_tokens_per_rank(4);
  join.set_session_id(open.session_id());
  v1::JoinGroupResponse joined;
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Status status = stub->JoinGroup(&context, join, &joined);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  const v1::EndpointInfo& info = joined.endpoint();
  absl::StatusOr<EndpointFds> fds = internal::FetchEndpointFds(
      (*epd)->socket_path(), open.session_id(), info.group(), info.rank(), absl::Seconds(10));
  ASSERT_TRUE(fds.ok()) << fds.status();
  auto region = ShmRegion::Map(std::move(fds->region), info.shm_bytes(), "endpoint region");
  ASSERT_TRUE(region.ok()) << region.status();
  auto* h = reinterpret_cast<abi::EndpointShmHeader*>(region->data());
  auto* ring = reinterpret_cast<abi::RequestSlot*>(region->data() +
                                                   abi::ComputeEndpointShmLayout(0).ring_offset);
  auto doorbell_region =
      ShmRegion::Map(std::move(fds->doorbell), sizeof(abi::DoorbellPage), "doorbell");
  ASSERT_TRUE(doorbell_region.ok()) << doorbell_region.status();
  auto* doorbell = reinterpret_cast<abi::DoorbellPage*>(doorbell_region->data());

  // 20,000 garbage slots, a ring's worth at a time, each batch consumed before the next.
  constexpr int kSlots = 20000;
  const auto start = std::chrono::steady_clock::now();
  int published = 0;
  while (published < kSlots) {
    const uint64_t head = abi::Atomic(h->ring_head).load();
    const int n = std::min<int>(abi::kRingCapacity, kSlots - published);
    for (int i = 1; i <= n; ++i) {
      std::memset(&ring[(head + i) % abi::kRingCapacity], 0xA0 + (published + i) % 16,
                  sizeof(abi::RequestSlot));
    }
    abi::Atomic(h->ring_head).store(head + n, std::memory_order_seq_cst);
    abi::Atomic(doorbell->futex_word).fetch_add(1, std::memory_order_seq_cst);
    FutexWakeAll(&doorbell->futex_word);  // As the client library rings it.
    published += n;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (abi::Atomic(h->ring_tail).load(std::memory_order_acquire) != head + n) {
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "epd stopped consuming the ring";
      std::this_thread::yield();
    }
  }
  const double flood_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(abi::Atomic(h->rejected_requests).load(), static_cast<uint64_t>(kSlots));
  // The dropped lines' count comes out once the endpoint's rate limit has a token again.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  auto health = (*epd)->CheckHealth();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);

  session->WritesDone();
  session_context.TryCancel();
  session->Finish().IgnoreError();
  absl::StatusOr<int> code = (*epd)->Stop();
  ASSERT_TRUE(code.ok()) << code.status();
  const std::string logs = (*epd)->Logs();
  int malformed = 0, reports = 0;
  for (absl::string_view line : absl::StrSplit(logs, '\n')) {
    malformed += absl::StrContains(line, "dropped a malformed ring slot");
    reports += absl::StrContains(line, "similar messages from group flood rank 0 (endpoint");
  }
  // A burst of 10 and 2 a second (LogRateLimiter's defaults), with slack for a slow machine.
  const int bound = 10 + static_cast<int>(2 * (flood_seconds + 2)) + 5;
  EXPECT_GE(malformed, 1);
  EXPECT_LE(malformed, bound) << "flood took " << flood_seconds << " s";
  EXPECT_GE(reports, 1) << logs.substr(logs.size() > 4000 ? logs.size() - 4000 : 0);
  EXPECT_LE(reports, bound);
}

}  // namespace
}  // namespace epd
