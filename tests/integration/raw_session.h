// RawSession: a Session stream opened with the raw gRPC stub, as the client library opens
// one, for integration tests that drive epd's Control service (and the fd channel) without
// the client library.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "epd/v1/control.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace epd::testing {

/// One open Session stream of this process (the session lives while this object does).
class RawSession {
 public:
  /// Opens the session on `stub`, naming the client `client_name`.
  explicit RawSession(v1::Control::Stub* stub, const std::string& client_name = "test") {
    stream_ = stub->Session(&context_);
    v1::SessionRequest hello;
    hello.set_client_pid(getpid());
    hello.set_client_name(client_name);
    EXPECT_TRUE(stream_->Write(hello));
    v1::SessionResponse open;
    EXPECT_TRUE(stream_->Read(&open));
    EXPECT_EQ(open.event(), "open");
    id_ = open.session_id();
  }
  ~RawSession() {
    stream_->WritesDone();
    context_.TryCancel();
    stream_->Finish().IgnoreError();
  }
  RawSession(const RawSession&) = delete;
  RawSession& operator=(const RawSession&) = delete;

  /// The session id epd answered with ("" when it refused).
  const std::string& id() const { return id_; }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream_;
  std::string id_;
};

}  // namespace epd::testing
