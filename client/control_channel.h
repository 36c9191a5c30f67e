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

/// An error of a Control RPC on `target`, explained: UNIMPLEMENTED (an epd TCP listener,
/// which serves grpc.health.v1 only) becomes UNAVAILABLE saying to use epd's unix socket;
/// UNAVAILABLE gets AnnotateUnavailable's context; anything else is returned as is.
absl::Status ExplainControlError(const absl::Status& status, const std::string& target);

/// For a "unix://<path>" target, fails at once when nothing can answer there instead of
/// letting a connect wait its whole timeout: UNAVAILABLE when <path> does not exist or
/// refuses a connection (a socket file that no process listens on, e.g. left by an epd
/// that was killed), FAILED_PRECONDITION when it is not a unix socket; each names `option`
/// (the flag or field the path came from). The probe is one non-blocking connect(), closed
/// at once. OK for other targets and for a socket that accepts (or whose backlog is full).
absl::Status CheckUnixSocket(const std::string& target, absl::string_view option);

}  // namespace epd::internal
