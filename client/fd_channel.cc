#include "client/fd_channel.h"

#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "epd/v1/control.pb.h"
#include "proto/abi/shm_abi.h"

namespace epd::internal {

absl::StatusOr<std::string> UnixSocketPathOf(absl::string_view target) {
  absl::string_view path = target;
  if (absl::ConsumePrefix(&path, "unix:")) {
    // "unix:///p" → "/p"; "unix:/p" → "/p".
    if (absl::StartsWith(path, "///")) path.remove_prefix(2);
    if (absl::StartsWith(path, "/") && !absl::StartsWith(path, "//")) return std::string(path);
  }
  return absl::FailedPreconditionError(
      absl::StrCat("the endpoint's memory is handed out on epd's unix socket only, and \"", target,
                   "\" is not one (give ClientOptions::socket_path as /path or unix:///path)"));
}

absl::StatusOr<EndpointFds> FetchEndpointFds(const std::string& socket_path,
                                             const std::string& session_id,
                                             const std::string& group, int32_t rank,
                                             absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  const std::string where = absl::StrCat("fd channel of epd on ", socket_path);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": the socket path is longer than a unix socket address allows"));
  }
  std::memcpy(addr.sun_path, socket_path.c_str(), socket_path.size() + 1);
  ScopedFd conn(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!conn.valid()) {
    return absl::ResourceExhaustedError(absl::StrCat(where, ": socket: ", std::strerror(errno)));
  }
  // A full backlog makes connect wait: bound it by the timeout.
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(absl::ToInt64Seconds(timeout));
  tv.tv_usec =
      static_cast<suseconds_t>(absl::ToInt64Microseconds(timeout - absl::Seconds(tv.tv_sec)));
  ::setsockopt(conn.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  if (::connect(conn.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::UnavailableError(absl::StrCat(where, ": connect: ", std::strerror(errno)));
  }
  v1::FdChannelRequest request;
  request.set_session_id(session_id);
  request.set_group(group);
  request.set_rank(rank);
  absl::Status sent = SendAll(
      conn.get(), absl::string_view(abi::kFdChannelPreamble, sizeof(abi::kFdChannelPreamble)),
      deadline);
  if (sent.ok()) sent = SendFrame(conn.get(), request.SerializeAsString(), {}, deadline);
  if (!sent.ok()) return absl::Status(sent.code(), absl::StrCat(where, ": ", sent.message()));
  absl::StatusOr<ReceivedFrame> frame =
      ReceiveFrame(conn.get(), kMaxFdFrameBytes, /*max_fds=*/2, deadline);
  if (!frame.ok()) {
    // Closed without an answer, or answered with something that is not a frame (an epd
    // without an fd channel closes, or answers in HTTP/2).
    const bool not_an_fd_channel =
        absl::IsUnavailable(frame.status()) || absl::IsInvalidArgument(frame.status());
    return absl::Status(
        not_an_fd_channel ? absl::StatusCode::kUnavailable : frame.status().code(),
        absl::StrCat(where, ": no answer (", frame.status().message(), ")",
                     not_an_fd_channel ? "; an epd older than this libepdclient has no fd "
                                         "channel: upgrade epd"
                                       : ""));
  }
  v1::FdChannelResponse response;
  if (!response.ParseFromString(frame->body)) {
    return absl::InternalError(absl::StrCat(where, ": the answer is not an FdChannelResponse"));
  }
  if (response.code() != 0) {
    const absl::StatusCode code = response.code() > 0 && response.code() <= 16
                                      ? static_cast<absl::StatusCode>(response.code())
                                      : absl::StatusCode::kUnknown;
    return absl::Status(code, response.message());
  }
  if (frame->fds.size() != 2) {
    return absl::InternalError(absl::StrCat(where, ": an OK answer carried ", frame->fds.size(),
                                            " descriptor(s), expected 2"));
  }
  EndpointFds fds;
  fds.region = std::move(frame->fds[0]);
  fds.doorbell = std::move(frame->fds[1]);
  fds.endpoint_id = response.endpoint_id();
  return fds;
}

}  // namespace epd::internal
