#include "control_channel.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace epd::internal {

std::string ChannelTarget(absl::string_view socket) {
  if (absl::StartsWith(socket, "/")) return absl::StrCat("unix://", socket);
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
  return absl::StrCat("unix:", socket);
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
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::Status AnnotateUnavailable(const absl::Status& status, const std::string& target) {
  if (status.code() != absl::StatusCode::kUnavailable) return status;
  return absl::UnavailableError(absl::StrCat("no epd daemon answers on ", target, ": ",
                                             status.message(), " (is epd running?)"));
}

absl::Status ExplainControlError(const absl::Status& status, const std::string& target) {
  if (absl::IsUnimplemented(status)) {
    return absl::UnavailableError(absl::StrCat(
        target,
        " does not serve epd's Control service (an epd TCP listener answers grpc.health.v1 "
        "probes only): connect to epd's unix socket"));
  }
  return AnnotateUnavailable(status, target);
}

absl::Status CheckUnixSocket(const std::string& target, absl::string_view option) {
  if (!absl::StartsWith(target, "unix://")) return absl::OkStatus();
  const std::string path = target.substr(7);
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return absl::UnavailableError(absl::StrCat("no epd daemon: socket ", path,
                                               " does not exist (is epd running? is ", option,
                                               " right?)"));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(option, ": ", path, " is not a unix socket (is ", option, " right?)"));
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) return absl::OkStatus();  // gRPC will say.
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::OkStatus();  // No probe; the connect's timeout still bounds it.
  const int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const int error = rc == 0 ? 0 : errno;
  ::close(fd);
  if (error == ECONNREFUSED) {
    return absl::UnavailableError(absl::StrCat(
        "no epd daemon: nothing listens on socket ", path,
        " (connection refused: a socket file left by an epd that was killed? is epd running? "
        "is ",
        option, " right?)"));
  }
  return absl::OkStatus();
}

}  // namespace epd::internal
