// RawSession: one open Session stream of epd's Control service over the raw gRPC stub, as
// the client library opens it, for tests that drive the RPCs themselves (the session lives
// while the object does; destroying it ends the stream, and epd releases its endpoints).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <memory>
#include <string>

#include "epd/v1/control.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace epd::testing {

class RawSession {
 public:
  /// Opens a session on `stub`, sending `client_pid` (what a client claims) and `name`.
  explicit RawSession(v1::Control::Stub* stub, int64_t client_pid = ::getpid(),
                      const std::string& name = "raw_session") {
    stream_ = stub->Session(&context_);
    v1::SessionRequest hello;
    hello.set_client_pid(client_pid);
    hello.set_client_name(name);
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
  const std::string& id() const { return id_; }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream_;
  std::string id_;
};

}  // namespace epd::testing
