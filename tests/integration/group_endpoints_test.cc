// GetGroupEndpoints and the launch modes through a real epd (host backend), over its unix
// socket with the raw gRPC stub: sessions are opened with the Session stream, as the
// client library does. Covers the wait (answered as the last rank joins, while other RPCs
// are served), missing ranks named at the end of the wait, a foreign session refused, an
// unknown group, a launch-mode mismatch naming both modes and client-launched mode
// refused on the host backend.
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "epd/v1/control.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"
#include "tests/common/specs.h"
#include "tests/integration/raw_session.h"

namespace epd {
namespace {

using testing::DaemonProcess;
using ::testing::HasSubstr;
using testing::RawSession;

v1::GroupSpec Spec(const std::string& name, int ranks) {
  return testing::MakeSpec(name, {.num_ranks = ranks,
                                  .num_experts = 2 * ranks,
                                  .hidden = 128,
                                  .num_topk = 1,
                                  .max_tokens_per_rank = 4});
}

class GroupEndpointsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::DaemonProcessOptions o;
    o.extra_args = {"--op_timeout=2s"};
    auto epd = DaemonProcess::Start(o);
    ASSERT_TRUE(epd.ok()) << epd.status();
    epd_ = std::move(*epd);
    stub_ = v1::Control::NewStub(
        grpc::CreateChannel(epd_->unix_target(), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (HasFailure() && epd_) std::cerr << epd_->Logs();
  }

  grpc::Status Join(const RawSession& s, const v1::GroupSpec& spec, int rank,
                    v1::LaunchMode mode = v1::LAUNCH_MODE_UNSPECIFIED,
                    v1::EndpointInfo* info = nullptr) {
    grpc::ClientContext context;
    v1::JoinGroupRequest request;
    *request.mutable_spec() = spec;
    request.set_rank(rank);
    request.set_session_id(s.id());
    request.set_launch_mode(mode);
    v1::JoinGroupResponse response;
    grpc::Status st = stub_->JoinGroup(&context, request, &response);
    if (info != nullptr) *info = response.endpoint();
    return st;
  }

  grpc::Status Endpoints(const RawSession& s, const std::string& group, int rank, uint32_t wait_ms,
                         v1::GetGroupEndpointsResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::GetGroupEndpointsRequest request;
    request.set_group(group);
    request.set_rank(rank);
    request.set_session_id(s.id());
    request.set_wait_ms(wait_ms);
    return stub_->GetGroupEndpoints(&context, request, response);
  }

  std::unique_ptr<DaemonProcess> epd_;
  std::unique_ptr<v1::Control::Stub> stub_;
};

TEST_F(GroupEndpointsTest, WaitsForEveryRankWhileOtherRpcsAreServed) {
  RawSession a(stub_.get()), b(stub_.get());
  const v1::GroupSpec spec = Spec("eps", 3);
  v1::EndpointInfo info0, info2;
  ASSERT_TRUE(Join(a, spec, 0, v1::LAUNCH_MODE_UNSPECIFIED, &info0).ok());
  grpc::Status waited;
  v1::GetGroupEndpointsResponse response;
  std::thread waiter([&] { waited = Endpoints(a, "eps", 0, 10000, &response); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // Served while the call above waits.
  for (int i = 0; i < 3; ++i) {
    grpc::ClientContext context;
    v1::ListGroupsResponse groups;
    ASSERT_TRUE(stub_->ListGroups(&context, v1::ListGroupsRequest(), &groups).ok());
    EXPECT_EQ(groups.groups_size(), 1);
  }
  ASSERT_TRUE(Join(b, spec, 2, v1::LAUNCH_MODE_DAEMON, &info2).ok());
  const auto last = std::chrono::steady_clock::now();
  ASSERT_TRUE(Join(b, spec, 1).ok());
  waiter.join();
  EXPECT_LT(std::chrono::steady_clock::now() - last, std::chrono::seconds(2));
  ASSERT_TRUE(waited.ok()) << waited.error_message();
  ASSERT_EQ(response.endpoints_size(), 3);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(response.endpoints(r).rank(), r);
    EXPECT_EQ(response.endpoints(r).launch_mode(), v1::LAUNCH_MODE_DAEMON);
    EXPECT_TRUE(response.endpoints(r).cuda_ipc_handle().empty());  // Host backend.
    EXPECT_NE(response.endpoints(r).endpoint_id(), 0u);
  }
  EXPECT_EQ(response.endpoints(0).endpoint_id(), info0.endpoint_id());
  EXPECT_EQ(response.endpoints(2).endpoint_id(), info2.endpoint_id());
}

TEST_F(GroupEndpointsTest, MissingRanksForeignSessionAndUnknownGroup) {
  RawSession a(stub_.get()), b(stub_.get());
  const v1::GroupSpec spec = Spec("partial", 4);
  ASSERT_TRUE(Join(a, spec, 0).ok());
  ASSERT_TRUE(Join(b, spec, 3).ok());
  v1::GetGroupEndpointsResponse response;
  const auto start = std::chrono::steady_clock::now();
  grpc::Status missing = Endpoints(a, "partial", 0, 400, &response);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(missing.error_message(), HasSubstr("rank(s) 1, 2 of 4"));
  EXPECT_GE(took, std::chrono::milliseconds(350));
  EXPECT_LT(took, std::chrono::seconds(3));

  grpc::Status foreign = Endpoints(a, "partial", 3, 0, &response);
  EXPECT_EQ(foreign.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(foreign.error_message(), HasSubstr("does not hold rank 3"));

  grpc::Status unknown = Endpoints(a, "no-such-group", 0, 0, &response);
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(unknown.error_message(), HasSubstr("no-such-group"));
}

TEST_F(GroupEndpointsTest, LaunchModeMismatchAndClientModeOnHost) {
  RawSession a(stub_.get());
  grpc::Status client = Join(a, Spec("client", 2), 0, v1::LAUNCH_MODE_CLIENT);
  EXPECT_EQ(client.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(client.error_message(), HasSubstr("client-launched mode needs the CUDA backend"));

  v1::EndpointInfo info;
  ASSERT_TRUE(Join(a, Spec("mode", 2), 0, v1::LAUNCH_MODE_UNSPECIFIED, &info).ok());
  EXPECT_EQ(info.launch_mode(), v1::LAUNCH_MODE_DAEMON);
  grpc::Status mismatch = Join(a, Spec("mode", 2), 1, v1::LAUNCH_MODE_CLIENT);
  EXPECT_EQ(mismatch.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(mismatch.error_message(), HasSubstr("LAUNCH_MODE_CLIENT"));
  EXPECT_THAT(mismatch.error_message(), HasSubstr("LAUNCH_MODE_DAEMON"));
}

}  // namespace
}  // namespace epd
