#include "client/control_channel.h"

#include <grp.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/errors/grpc_status.h"
#include "common/errors/reason.h"

namespace epd::internal {

namespace {

/// "unix://" + `path` made absolute against the working directory (as gRPC would resolve
/// it), so CheckUnixSocket sees a relative socket path too; `path` itself when that fails.
std::string AbsoluteUnixTarget(absl::string_view path) {
  std::error_code error;
  const std::filesystem::path absolute = std::filesystem::absolute(std::string(path), error);
  return error ? absl::StrCat("unix:", path) : absl::StrCat("unix://", absolute.string());
}

}  // namespace

std::string ChannelTarget(absl::string_view socket) {
  if (absl::StartsWith(socket, "/")) return absl::StrCat("unix://", socket);
  if (absl::StartsWith(socket, "unix:") && !absl::StartsWith(socket, "unix://")) {
    return AbsoluteUnixTarget(socket.substr(5));  // "unix:relative.sock"
  }
  if (absl::StartsWith(socket, "unix:") || absl::StartsWith(socket, "unix-abstract:")) {
    return std::string(socket);
  }
  // "host:port", "[::1]:port", "dns:///host:port", "ipv4:..." all contain a ':' and no
  // path separator before it.
  size_t colon = socket.find(':');
  size_t slash = socket.find('/');
  if (colon != absl::string_view::npos && (slash == absl::string_view::npos || slash > colon)) {
    return std::string(socket);
  }
  return AbsoluteUnixTarget(socket);
}

std::shared_ptr<grpc::Channel> MakeControlChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // Each channel gets its own subchannel: a client's Session must not share a connection
  // with another object's channel in this process (its end is the client's death).
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  absl::Status st = errors::FromGrpcStatus(status);
  // gRPC's own UNAVAILABLE (no reason from epd): nothing answers on the socket.
  if (absl::IsUnavailable(st)) {
    st = errors::WithDefaultReason(std::move(st), errors::Reason::kDaemonUnavailable);
  }
  return st;
}

absl::Status AnnotateUnavailable(const absl::Status& status, const std::string& target) {
  if (status.code() != absl::StatusCode::kUnavailable) return status;
  // An UNAVAILABLE epd answered with (any reason but DAEMON_UNAVAILABLE, which only gRPC's
  // own failures get: FromGrpcStatus): the daemon's error, as it is (e.g. DAEMON_DRAINING,
  // or a reload's metrics_listen that cannot be bound).
  if (errors::HasReason(status) && errors::ReasonOf(status) != errors::Reason::kDaemonUnavailable) {
    return status;
  }
  return errors::WithReason(
      absl::UnavailableError(absl::StrCat("no epd daemon answers on ", target, ": ",
                                          status.message(), " (is epd running?)")),
      errors::Reason::kDaemonUnavailable);
}

absl::Status ExplainControlError(const absl::Status& status, const std::string& target) {
  if (absl::IsUnimplemented(status)) {
    return errors::WithReason(
        absl::UnavailableError(absl::StrCat(
            target,
            " does not serve epd's Control service (an epd TCP listener answers grpc.health.v1 "
            "probes only): connect to epd's unix socket")),
        errors::Reason::kDaemonUnavailable);
  }
  return AnnotateUnavailable(status, target);
}

namespace {

std::string UserText(const UnixSocketProbe& probe) {
  return probe.user_name.empty() ? absl::StrCat("uid ", probe.uid)
                                 : absl::StrCat(probe.user_name, " (uid ", probe.uid, ")");
}

std::string GroupText(const UnixSocketProbe& probe) {
  return probe.group_name.empty() ? absl::StrCat("gid ", probe.gid)
                                  : absl::StrCat(probe.group_name, " (gid ", probe.gid, ")");
}

}  // namespace

absl::Status ClassifyUnixSocketProbe(const std::string& path, absl::string_view option,
                                     const UnixSocketProbe& probe) {
  const bool denied = probe.stat_errno == EACCES || probe.stat_errno == EPERM;
  if (denied) {
    // stat() needs only search (x) permission on the directories above the socket.
    return errors::WithReason(
        absl::PermissionDeniedError(absl::StrCat(
            "cannot reach socket ", path, " (", option, "): ", std::strerror(probe.stat_errno),
            ": a directory above it is not searchable by ", UserText(probe),
            "; epd may well be running: have the operator let the clients' group search that "
            "directory (e.g. chmod 0750 and chgrp it to epd's socket_group), or give epd a "
            "socket_path in a directory the clients can reach")),
        errors::Reason::kNoCredentials);
  }
  if (probe.stat_errno == ENOENT || probe.stat_errno == ENOTDIR) {
    return errors::WithReason(absl::UnavailableError(absl::StrCat(
                                  "no epd daemon: socket ", path,
                                  " does not exist (is epd running? is ", option, " right?)")),
                              errors::Reason::kDaemonUnavailable);
  }
  if (probe.stat_errno != 0) {
    return errors::WithReason(
        absl::UnavailableError(absl::StrCat("cannot stat socket ", path, " (", option,
                                            "): ", std::strerror(probe.stat_errno))),
        errors::Reason::kDaemonUnavailable);
  }
  if (!S_ISSOCK(probe.mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(option, ": ", path, " is not a unix socket (is ", option, " right?)"));
  }
  if (probe.connect_errno == ECONNREFUSED) {
    return errors::WithReason(
        absl::UnavailableError(absl::StrCat(
            "no epd daemon: nothing listens on socket ", path,
            " (connection refused: a socket file left by an epd that was killed? is epd running? "
            "is ",
            option, " right?)")),
        errors::Reason::kDaemonUnavailable);
  }
  if (probe.connect_errno == EACCES || probe.connect_errno == EPERM) {
    const std::string denied = absl::StrFormat(
        "permission denied connecting to socket %s (%s): it has mode %04o and group %s, and "
        "%s may not write to it; epd is probably running: ",
        path, option, probe.mode & 07777, GroupText(probe), UserText(probe));
    if (probe.gid == 0) {
      // Group root gives far more than this socket: never the advice.
      return errors::WithReason(
          absl::PermissionDeniedError(absl::StrCat(
              denied,
              "epd runs without a dedicated socket group, so only root may connect. Have the "
              "operator give the socket a group of its own (e.g. `groupadd epd`; the systemd "
              "unit's Group=epd and deploy/systemd/epd.sysusers make one) by setting epd's "
              "socket_group to it and socket_mode to \"0660\", then add this user to that group")),
          errors::Reason::kNoCredentials);
    }
    return errors::WithReason(
        absl::PermissionDeniedError(absl::StrCat(
            denied, "add this user to group ",
            probe.group_name.empty() ? absl::StrCat(probe.gid) : probe.group_name,
            " (then log in again), or have the operator set epd's socket_group to a group of this "
            "user and socket_mode to \"0660\"")),
        errors::Reason::kNoCredentials);
  }
  if (probe.connect_errno == ENOENT) {  // Removed between stat and connect.
    return errors::WithReason(absl::UnavailableError(absl::StrCat(
                                  "no epd daemon: socket ", path,
                                  " does not exist (is epd running? is ", option, " right?)")),
                              errors::Reason::kDaemonUnavailable);
  }
  return absl::OkStatus();
}

absl::Status CheckUnixSocket(const std::string& target, absl::string_view option) {
  if (!absl::StartsWith(target, "unix://")) return absl::OkStatus();
  const std::string path = target.substr(7);
  UnixSocketProbe probe;
  probe.uid = ::geteuid();
  if (const passwd* pw = ::getpwuid(probe.uid); pw != nullptr) probe.user_name = pw->pw_name;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    probe.stat_errno = errno;
    return ClassifyUnixSocketProbe(path, option, probe);
  }
  probe.mode = st.st_mode;
  probe.gid = st.st_gid;
  if (const group* gr = ::getgrgid(st.st_gid); gr != nullptr) probe.group_name = gr->gr_name;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (S_ISSOCK(st.st_mode) && path.size() < sizeof(addr.sun_path)) {  // Else gRPC will say.
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd >= 0) {  // Else no probe; the connect's timeout still bounds the wait.
      const int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
      probe.connect_errno = rc == 0 ? 0 : errno;
      ::close(fd);
    }
  }
  return ClassifyUnixSocketProbe(path, option, probe);
}

}  // namespace epd::internal
