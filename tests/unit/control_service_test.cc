// ControlService without SO_PEERCRED (daemon/control/control_service.h): a Control call that did
// not come through epd's unix listener (here gRPC's in-process channel, which has no peer
// credentials) is refused with UNAUTHENTICATED, every RPC alike, so that no path around the
// listener acts without an identity.
#include "daemon/control/control_service.h"

#include <chrono>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/unit/fake_data_plane.h"

namespace epd {
namespace {

using testing::FakeDataPlane;
using testing::FakeDataPlaneState;
using ::testing::HasSubstr;
using testing::OneGpu;
using testing::SmallSpec;

class ControlServiceWithoutCredentialsTest : public ::testing::Test {
 protected:
  ControlServiceWithoutCredentialsTest()
      : plane_(std::make_shared<FakeDataPlaneState>()),
        registry_(&plane_, OneGpu(), GroupRegistry::Options{}),
        service_(&registry_, [] { return v1::GetStatsResponse(); }) {
    grpc::ServerBuilder builder;
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    stub_ = v1::Control::NewStub(server_->InProcessChannel(grpc::ChannelArguments()));
  }
  ~ControlServiceWithoutCredentialsTest() override {
    service_.DrainSessions();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    registry_.ReleaseAll();
  }

  /// One unary call of `rpc` with `request` on the in-process channel.
  template <typename Request, typename Response>
  grpc::Status Call(grpc::Status (v1::Control::Stub::*rpc)(grpc::ClientContext*, const Request&,
                                                           Response*),
                    const Request& request) {
    grpc::ClientContext context;
    Response response;
    return (stub_.get()->*rpc)(&context, request, &response);
  }

  static void ExpectUnauthenticated(const grpc::Status& status) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr("SO_PEERCRED"));
  }

  FakeDataPlane plane_;
  GroupRegistry registry_;
  ControlService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Control::Stub> stub_;
};

TEST_F(ControlServiceWithoutCredentialsTest, EveryRpcIsUnauthenticated) {
  {
    grpc::ClientContext context;
    auto stream = stub_->Session(&context);
    v1::SessionRequest hello;
    hello.set_client_pid(1234);
    stream->Write(hello);
    v1::SessionResponse open;
    EXPECT_FALSE(stream->Read(&open)) << "a session was opened: " << open.session_id();
    ExpectUnauthenticated(stream->Finish());
  }
  EXPECT_EQ(registry_.counters().num_sessions, 0);
  // A session opened directly in the registry (as if by a client with credentials): its id
  // is no way in without credentials either.
  absl::StatusOr<std::string> session =
      registry_.OpenSession(PeerCredentials{.pid = 1, .uid = 1000, .gid = 1000}, "test");
  ASSERT_TRUE(session.ok()) << session.status();
  v1::JoinGroupRequest join;
  *join.mutable_spec() = SmallSpec();
  join.set_session_id(*session);
  ExpectUnauthenticated(Call(&v1::Control::Stub::JoinGroup, join));
  v1::LeaveGroupRequest leave;
  leave.set_group("g");
  leave.set_session_id(*session);
  ExpectUnauthenticated(Call(&v1::Control::Stub::LeaveGroup, leave));
  v1::GetGroupEndpointsRequest endpoints;
  endpoints.set_group("g");
  endpoints.set_session_id(*session);
  ExpectUnauthenticated(Call(&v1::Control::Stub::GetGroupEndpoints, endpoints));
  ExpectUnauthenticated(Call(&v1::Control::Stub::ListGroups, v1::ListGroupsRequest()));
  ExpectUnauthenticated(Call(&v1::Control::Stub::GetStats, v1::GetStatsRequest()));
  EXPECT_EQ(registry_.counters().num_groups, 0);
}

}  // namespace
}  // namespace epd
