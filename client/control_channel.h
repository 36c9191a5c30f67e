// Internal to libepdclient and epctl: how a socket argument becomes a gRPC channel to
// epd's Control and Health services.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace epd::internal {

/// The gRPC target of a socket argument: "/path" → "unix:///path"; "unix:..." as is;
/// "host:port" (and any other "scheme:" target such as "dns:///h:p") as is; a relative
/// path ("run/epd.sock", "./epd.sock") → "unix:" + path.
std::string ChannelTarget(absl::string_view socket);

/// An insecure channel to `target` (a ChannelTarget) that is not throttled by gRPC's
/// reconnect back-off, so a freshly started daemon is found at once.
std::shared_ptr<grpc::Channel> MakeControlChannel(const std::string& target);

/// grpc::Status → absl::Status (same code and message).
absl::Status FromGrpcStatus(const grpc::Status& status);

/// Adds "; is epd running? (no daemon answers on <target>)" context to UNAVAILABLE errors.
absl::Status AnnotateUnavailable(const absl::Status& status, const std::string& target);

}  // namespace epd::internal
