// Raw unix-socket clients for tests of epd's listener: connect, and wait for the other
// side to close (any stream socket).
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/os/shm_region.h"

namespace epd::testing {

/// A blocking socket connected to the unix socket at `path`; invalid when connect fails.
inline ScopedFd ConnectUnix(const std::string& path) {
  ScopedFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (!fd.valid() || ::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ScopedFd();
  }
  return fd;
}

/// What the peer sent on `fd` until it closed it or `timeout` passed.
struct Reply {
  std::string bytes;
  bool closed = false;  ///< The peer closed (EOF or reset) within the timeout.
};

inline Reply ReadUntilClosed(int fd, absl::Duration timeout) {
  Reply reply;
  const absl::Time deadline = absl::Now() + timeout;
  char buffer[4096];
  while (true) {
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) return reply;
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), MSG_DONTWAIT);
    if (n > 0) {
      reply.bytes.append(buffer, static_cast<size_t>(n));
    } else if (n == 0 || errno != EAGAIN) {
      reply.closed = true;
      return reply;
    }
  }
}

/// True when the peer closes `fd` (EOF or reset) within `timeout`; data it sends first
/// (e.g. gRPC's HTTP/2 SETTINGS) is read and dropped.
inline bool ClosedByPeer(int fd, absl::Duration timeout) {
  return ReadUntilClosed(fd, timeout).closed;
}

}  // namespace epd::testing
