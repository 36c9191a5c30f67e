// Internal to libepdclient and epctl: how a socket argument becomes a gRPC channel to
// epd's Control and Health services.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace epd::internal {

/// The gRPC target of a socket argument: "/path" → "unix:///path"; "unix://..." as is;
/// "host:port" (and any other "scheme:" target such as "dns:///h:p") as is; a relative
/// path ("run/epd.sock", "./epd.sock", "unix:epd.sock") → "unix://" + the absolute path
/// against the working directory, so a missing file is reported at once (CheckUnixSocket)
/// by epctl and Client::Connect alike.
std::string ChannelTarget(absl::string_view socket);

/// An insecure channel to `target` (a ChannelTarget) that is not throttled by gRPC's
/// reconnect back-off, so a freshly started daemon is found at once.
std::shared_ptr<grpc::Channel> MakeControlChannel(const std::string& target);

/// grpc::Status → absl::Status (same code and message) with epd's error reason
/// (common/errors/grpc_status.h); gRPC's own UNAVAILABLE gets DAEMON_UNAVAILABLE.
absl::Status FromGrpcStatus(const grpc::Status& status);

/// Adds "no epd daemon answers on <target>: ... (is epd running?)" context to an UNAVAILABLE
/// error of gRPC's own (no reason, or DAEMON_UNAVAILABLE); an UNAVAILABLE the daemon
/// answered with (any other reason: DAEMON_DRAINING, CONFIG_INVALID, ...) is returned as
/// it is.
absl::Status AnnotateUnavailable(const absl::Status& status, const std::string& target);

/// An error of a Control RPC on `target`, explained: UNIMPLEMENTED (an epd TCP listener,
/// which serves grpc.health.v1 only) becomes UNAVAILABLE saying to use epd's unix socket;
/// UNAVAILABLE gets AnnotateUnavailable's context; anything else is returned as is.
absl::Status ExplainControlError(const absl::Status& status, const std::string& target);

/// For a "unix://<path>" target, fails at once when nothing can answer there instead of
/// letting a connect wait its whole timeout: UNAVAILABLE when <path> does not exist or
/// refuses a connection (a socket file that no process listens on, e.g. left by an epd
/// that was killed), PERMISSION_DENIED when this user may not reach or connect to it (the
/// fix is the socket's group or epd's socket_mode / socket_group, not starting epd),
/// FAILED_PRECONDITION when it is not a unix socket; each names the path and `option`
/// (the flag or field the path came from). The probe is one stat() and one non-blocking
/// connect(), closed at once; ClassifyUnixSocketProbe turns their outcome into the status.
/// OK for other targets and for a socket that accepts (or whose backlog is full).
absl::Status CheckUnixSocket(const std::string& target, absl::string_view option);

/// What CheckUnixSocket's probe of a socket path found (built by it, or by a test).
struct UnixSocketProbe {
  /// errno of stat(path): 0 = it succeeded; ENOENT/ENOTDIR = no such file; EACCES = a
  /// directory on the path is not searchable by this user.
  int stat_errno = 0;
  /// From a successful stat: the file's type and permission bits (st_mode), its group id
  /// and that group's name ("" when unknown).
  uint32_t mode = 0;
  uint32_t gid = 0;
  std::string group_name;
  /// errno of the probe connect(): 0 = accepted, in progress or not tried; ECONNREFUSED =
  /// nothing listens; EACCES/EPERM = no write permission on the socket (or no search
  /// permission on a directory above it).
  int connect_errno = 0;
  /// The user running the probe, for the message: uid and name ("" when unknown).
  uint32_t uid = 0;
  std::string user_name;
};

/// CheckUnixSocket's verdict on `probe` of socket `path` (named with `option`), as
/// documented there. Pure: the permission cases can be tested as root, where the kernel
/// never refuses.
absl::Status ClassifyUnixSocketProbe(const std::string& path, absl::string_view option,
                                     const UnixSocketProbe& probe);

}  // namespace epd::internal
