// Client-supplied strings through a real epd (host backend): a group name, a client_name,
// a session id or a gpu_uuid with a '\n' never puts a raw newline into the daemon's log
// (no forged log line), an oversized one is cut in the log, and an 8200-byte group name
// gets INVALID_ARGUMENT naming spec.name (it got RESOURCE_EXHAUSTED "received initial
// metadata size exceeds limit" when the whole name was echoed back in the error).
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "epd/v1/control.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"
#include "tests/common/specs.h"

namespace epd {
namespace {

using ::testing::AllOf;
using testing::DaemonProcess;
using ::testing::HasSubstr;
using ::testing::Not;

/// What an attacker wants to appear as a line of its own in epd's log.
constexpr char kForgedLine[] = "[2026-11-30 05:18:00.000] [epd.daemon] [error] FORGED LINE";

std::string Forged(absl::string_view prefix) { return absl::StrCat(prefix, "\n", kForgedLine); }

v1::GroupSpec Spec(const std::string& name) {
  return testing::MakeSpec(
      name,
      {.num_ranks = 1, .num_experts = 2, .hidden = 128, .num_topk = 1, .max_tokens_per_rank = 4});
}

class ClientTextLoggingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::DaemonProcessOptions options;
    options.log_level = "debug";
    auto epd = DaemonProcess::Start(options);
    ASSERT_TRUE(epd.ok()) << epd.status();
    epd_ = std::move(*epd);
    stub_ = v1::Control::NewStub(
        grpc::CreateChannel(epd_->unix_target(), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (HasFailure() && epd_) std::cerr << epd_->Logs();
  }

  grpc::Status Join(const std::string& session_id, const v1::GroupSpec& spec,
                    const std::string& gpu_uuid = "") {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::JoinGroupRequest request;
    *request.mutable_spec() = spec;
    request.set_session_id(session_id);
    request.set_gpu_uuid(gpu_uuid);
    v1::JoinGroupResponse response;
    return stub_->JoinGroup(&context, request, &response);
  }

  /// Stops epd and returns its log lines.
  std::vector<std::string> StopAndReadLog() {
    absl::StatusOr<int> code = epd_->Stop();
    EXPECT_TRUE(code.ok()) << code.status();
    return absl::StrSplit(epd_->Logs(), '\n');
  }

  std::unique_ptr<DaemonProcess> epd_;
  std::unique_ptr<v1::Control::Stub> stub_;
};

TEST_F(ClientTextLoggingTest, OversizedGroupNameIsRefusedNamingSpecName) {
  grpc::ClientContext context;
  auto stream = stub_->Session(&context);
  v1::SessionRequest hello;
  hello.set_client_pid(getpid());
  hello.set_client_name("client_text_logging_test");
  ASSERT_TRUE(stream->Write(hello));
  v1::SessionResponse open;
  ASSERT_TRUE(stream->Read(&open));

  const std::string name(8200, 'a');
  grpc::Status status = Join(open.session_id(), Spec(name));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(),
              AllOf(HasSubstr("spec.name"), HasSubstr("must be 1 to 64 characters"),
                    HasSubstr("(8200 bytes)")));
  EXPECT_LT(status.error_message().size(), 512u) << status.error_message();

  // The same for a foreign session id of that size (echoed in FAILED_PRECONDITION).
  status = Join(std::string(8200, 's'), Spec("ok"));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  EXPECT_THAT(status.error_message(), AllOf(HasSubstr("session_id"), HasSubstr("(8200 bytes)")));

  stream->WritesDone();
  context.TryCancel();
  stream->Finish().IgnoreError();

  for (const std::string& line : StopAndReadLog()) {
    EXPECT_LT(line.size(), 2048u) << line.substr(0, 300);
  }
}

TEST_F(ClientTextLoggingTest, NewlinesInClientStringsNeverForgeALogLine) {
  grpc::ClientContext context;
  auto stream = stub_->Session(&context);
  v1::SessionRequest hello;
  hello.set_client_pid(getpid());
  hello.set_client_name(Forged("client"));
  ASSERT_TRUE(stream->Write(hello));
  v1::SessionResponse open;
  ASSERT_TRUE(stream->Read(&open));
  const std::string session = open.session_id();

  // A refused join (logged by the control service with the name).
  grpc::Status status = Join(session, Spec(Forged("x")));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), AllOf(HasSubstr("spec.name"), Not(HasSubstr("\n"))));
  // A bad gpu_uuid (its error is in the same log line).
  status = Join(session, Spec("good"), Forged("GPU-x"));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), AllOf(HasSubstr("gpu_uuid"), Not(HasSubstr("\n"))));
  // GetGroupEndpoints of an unknown group (logged with the group and the error).
  {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::GetGroupEndpointsRequest request;
    request.set_group(Forged("g"));
    request.set_session_id(session);
    v1::GetGroupEndpointsResponse response;
    status = stub_->GetGroupEndpoints(&c, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << status.error_message();
    EXPECT_THAT(status.error_message(), Not(HasSubstr("\n")));
  }
  stream->WritesDone();
  context.TryCancel();
  stream->Finish().IgnoreError();

  std::vector<std::string> lines = StopAndReadLog();
  int escaped = 0;
  for (const std::string& line : lines) {
    EXPECT_FALSE(absl::StartsWith(line, kForgedLine)) << "forged log line: " << line;
    if (absl::StrContains(line, "\\n[2026-11-30 05:18:00.000]")) ++escaped;
  }
  // Session opened + ended (client_name), join refused, gpu_uuid, GetGroupEndpoints.
  EXPECT_GE(escaped, 5) << epd_->Logs();
}

}  // namespace
}  // namespace epd
